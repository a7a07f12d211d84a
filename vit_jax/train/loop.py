"""The training loop: owns I/O, checkpoints, evaluation and reporting.

config -> data -> model -> jitted step -> checkpoint / metrics. Everything
numeric happens in `step.py`; this file only moves things around it.
"""

from __future__ import annotations

import math
import time
from typing import Any, Dict

import jax
import ml_collections
from absl import logging

from vit_jax import accounting, evaluators, models
from vit_jax.checkpoint import load_pretrained
from vit_jax.data import pipeline, prepare
from vit_jax.train import optim, orbax_state, reporting
from vit_jax import sharding as shd
from vit_jax.train import step as step_lib


class NonFiniteLossError(FloatingPointError):
  """The loss became NaN or Inf; the last good checkpoint is kept."""


def total_steps(config: ml_collections.ConfigDict, num_train: int) -> int:
  if config.get('total_steps'):
    return int(config.total_steps)
  if config.get('total_epochs'):
    return max(1, math.ceil(config.total_epochs * num_train /
                            config.input.batch_size))
  raise ValueError('config sets neither total_steps nor total_epochs')


def _init_params(config, state, state_sh):
  """Replaces fresh params with `config.init` weights (an .npz file, or an
  orbax workdir / checkpoint directory of an earlier run)."""
  host = jax.device_get(state.params)
  source = config.init
  if not source.endswith('.npz'):
    source = orbax_state.load_params(source)
  params = load_pretrained(source, host)
  params = jax.device_put(params, state_sh.params)
  logging.info('initialised from %s', config.init)
  return state.replace(params=params)


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> Dict[str, Any]:
  """Trains (resuming from `workdir` when it holds a checkpoint); returns
  the summary written to `workdir/summary.json`."""
  prepare.ensure_prepared(config.input)
  mesh = shd.make_mesh(**config.get('mesh', {}))
  accum = config.get('accum_steps', 1)
  shd.check_batch_size(config.input.batch_size, mesh, 'input.batch_size',
                       accum)
  shd.check_batch_size(config.input.eval_batch_size, mesh,
                       'input.eval_batch_size')
  info = pipeline.dataset_info(config.input)
  num_classes = config.get('num_classes') or info.num_classes
  pipeline.check_num_classes(config.input, num_classes)
  steps = total_steps(config, info.num_train_examples)
  model = models.from_config(config.model, num_classes)
  tx, lr_fn = optim.make(config.optim, steps)
  image_shape = tuple(info.image_shape)
  fsdp_min = config.get('fsdp_min_size', 2**18)
  state, state_sh = step_lib.create_state(model, tx, config.seed, image_shape,
                                          mesh, fsdp_min)
  ckpt = orbax_state.Checkpointer(
      workdir, every=config.get('checkpoint_every', 1000),
      keep=config.get('keep_checkpoints', 3),
      async_save=config.get('async_checkpoints', True))
  train_it = pipeline.train_iterator(
      config.input, seed=config.seed, process_index=jax.process_index(),
      process_count=jax.process_count())

  model_spec = config.model.to_dict()
  start, restored, run_state = ckpt.restore(
      step_lib.abstract_state(model, tx, image_shape, config.seed), state_sh,
      expect={'model': model_spec})
  prior_wall = 0.0
  if start is not None:
    state = restored
    train_it.set_state(run_state['input'])
    prior_wall = run_state.get('wall_s', 0.0)
    logging.info('resumed from step %d in %s', start, workdir)
  else:
    start = 0
    if config.get('init'):
      state = _init_params(config, state, state_sh)

  label_ndim = 2 if config.input.get('mixup') else 1
  train_fn = step_lib.compile_train_step(model, tx, lr_fn, state_sh, mesh,
                                        config, label_ndim)
  evals = evaluators.build(config, model, mesh, state_sh.params,
                           image_shape[0])
  fwd = accounting.forward_flops(
      config.model.name, image_shape[:2], num_classes, **{
          k: v for k, v in dict(config.model).items()
          if k not in ('name', 'dtype', 'param_dtype') and v is not None})
  writer = reporting.make_writer(workdir)
  progress = reporting.Progress(total_steps=steps,
                                batch_size=config.input.batch_size,
                                start_step=start, forward_flops=fwd)
  log_every = config.get('log_every', 50)

  def run_state_now():
    return {'input': train_it.get_state(), 'model': model_spec,
            'wall_s': prior_wall + progress.elapsed()}

  pending = None  # (step, metrics) of the previous step, checked one late.
  eval_metrics: Dict[str, float] = {}
  step = start
  try:
    with jax.set_mesh(mesh):
      while step < steps:
        t0 = time.perf_counter()
        batch = shd.global_batch(next(train_it), mesh)
        progress.input_wait(time.perf_counter() - t0)
        state, metrics = train_fn(state, batch)
        step += 1
        if pending is not None:
          _check_finite(*pending, ckpt)
        pending = (step, metrics)
        if step % log_every == 0 or step == steps:
          _check_finite(*pending, ckpt)
          scalars = {k: float(v) for k, v in jax.device_get(metrics).items()}
          scalars.update(progress.report(step))
          writer.write_scalars(step, scalars)
          writer.flush()
        due = [e for e in evals if e.due(step, steps)]
        if due:
          eval_metrics = evaluators.run_all(due, state.params)
          writer.write_scalars(step, eval_metrics)
        if ckpt.due(step):
          _check_finite(*pending, ckpt)  # Never save a diverged state.
          ckpt.maybe_save(step, state, run_state_now())
      if pending:
        _check_finite(*pending, ckpt)
      final_metrics = jax.device_get(pending[1]) if pending else {}
      ckpt.maybe_save(step, state, run_state_now(), force=True)
      eval_metrics = evaluators.run_all(evals, state.params)
      writer.write_scalars(step, eval_metrics)
  finally:
    ckpt.close()
    writer.close()

  wall = prior_wall + progress.elapsed()
  examples = step * config.input.batch_size
  summary = {
      'model': config.model.name, 'dataset': config.input.data,
      'steps': step, 'batch_size': config.input.batch_size,
      'examples_seen': examples, 'wall_s': wall,
      'num_devices': jax.device_count(), 'hardware': progress.hardware,
      'device_hours': jax.device_count() * wall / 3600,
      'core_days': jax.device_count() * progress.cores_per_device * wall
                   / 86400,
      'image_size': image_shape[0], 'init': config.get('init'),
      'forward_gflops': fwd / 1e9,
      'exaflops': examples * 3 * fwd / 1e18,
      'report': config.report.to_dict() if 'report' in config else {},
      **{f'train_{k}': float(v) for k, v in final_metrics.items()},
      **eval_metrics,
  }
  path = reporting.write_summary(workdir, summary)
  logging.info('summary written to %s: %s', path, summary)
  return summary


def _check_finite(step: int, metrics: Dict[str, Any],
                  ckpt: orbax_state.Checkpointer) -> None:
  loss = float(metrics['loss'])
  if not math.isfinite(loss):
    ckpt.wait()
    last = ckpt.latest_step()
    raise NonFiniteLossError(
        f'loss is {loss} at step {step}; stopping. The last good checkpoint '
        f'(step {last}) is kept in {ckpt.manager.directory}. Lower optim.lr, '
        'raise optim.warmup_steps or set optim.grad_clip_norm, then resume.')
