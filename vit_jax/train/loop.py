"""The training loop: owns I/O, checkpoints, evaluation and reporting.

config -> data -> model -> jitted step -> checkpoint / metrics. Everything
numeric happens in `step.py`; this file only moves things around it, in
three parts: `setup` (what a run needs, resumed from its workdir),
`train` (the steps, evaluations and saves) and `summarise`
(summary.json). `train_and_evaluate` holds the workdir's lock around them.

A run never saves a state whose loss, gradient norm or parameters are not
finite, stops at the next step boundary on SIGTERM / SIGINT / a preemption
notice after saving (see `preemption.py`), and resumes from the newest
checkpoint that restores completely (see `orbax_state.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Any, Dict, List, Optional, Tuple

import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np
from absl import logging

from vit_jax import accounting, evaluators, heap, models, paper, selfsup
from vit_jax.checkpoint import load_npz, load_pretrained
from vit_jax.data import folder_source, pipeline, prepare
from vit_jax.data import registry
from vit_jax import sharding as shd
from vit_jax.train import config_check, eval_run, lock, optim, orbax_state
from vit_jax.train import preemption, profiling
from vit_jax.train import reporting, run_files
from vit_jax.train import step as step_lib


class NonFiniteLossError(FloatingPointError):
  """The loss, gradients or parameters became NaN or Inf; the checkpoints
  kept are all finite."""


class ResultsWithoutCheckpointError(RuntimeError):
  """A workdir with a finished run's results but no checkpoint to resume
  from: training would start over and replace those results."""


def _init_weights(config) -> Tuple[Any, str, Optional[Tuple[int, int]]]:
  """(the host weights of `config.init`, the file or checkpoint step they
  were read from, their patch grid where recorded): an .npz file, or an
  orbax workdir / checkpoint directory of an earlier run (its newest step
  now: recorded, as that run may save more). Read before the fresh state
  is computed, so a bad path fails first."""
  source = config.init
  if source.endswith('.npz'):
    return load_npz(source), (source if '://' in source
                              else os.path.abspath(source)), None
  step_dir = orbax_state.resolve(source)
  # The parameters the run's metrics describe (its Polyak averages unless
  # it evaluated only its raw ones), as predict and export take.
  recorded = run_files.read_config(step_dir.rstrip('/').rsplit('/', 2)[0])
  ema = run_files.described_params(recorded.get('config') or {})
  return (orbax_state.load_params(step_dir, ema=ema), step_dir,
          orbax_state.patch_grid(step_dir))


def _init_params(source, state, state_sh, grid, source_grid):
  """Replaces fresh params with `config.init`'s weights (`_init_weights`);
  `grid`: the model's patch grid at the run's image size, `source_grid`
  the init's (None: not recorded)."""
  # Every host needs the whole template (shapes, the fresh head): on a
  # mesh whose FSDP/model axis spans hosts no process holds it alone.
  host = multihost_utils.process_allgather(state.params, tiled=True)
  params = load_pretrained(source, host, grid=grid, source_grid=source_grid)
  # The averages, if any, start at the init too, in their own dtype (at
  # least float32, `optim.ema_init`: bfloat16 averages would not move) and
  # buffers (the state is donated).
  ema = None if state.ema_params is None else jax.device_put(
      jax.tree.map(lambda p, e: np.asarray(p).astype(e.dtype), params,
                   state.ema_params), state_sh.ema_params)
  return state.replace(params=jax.device_put(params, state_sh.params),
                       ema_params=ema)


def _class_names(config, workdir: str, resuming: bool):
  """The names of the labels the run trains on, to record with its config
  (None where the data has none). A resumed run keeps those it started
  with (its record's); a fresh start (also after an attempt that saved no
  checkpoint) reads them from the data. Never fails the run."""
  recorded = run_files.read_config(workdir).get('class_names')
  if resuming and recorded:
    return recorded
  if config.get('objective', 'supervised') != 'supervised':
    return None  # No labels are learnt.
  try:
    return pipeline.class_names(config.input)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning('no class names recorded for %s (%s: %s): predict and '
                    'export will read them from the data, or take --labels',
                    config.input.get('data'), type(e).__name__, e)
    return None


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> Dict[str, Any]:
  """Trains (resuming from `workdir` when it holds a checkpoint); returns
  the summary written to `workdir/summary.json`."""
  config_check.check(config)
  with lock.hold(workdir):
    _check_results_kept(workdir)
    run = setup(config, workdir)
    if run.start >= run.steps:
      _check_finished_run(config, workdir, run)
    # After the restore accepted this config: a refused one (another model,
    # a changed input pipeline) leaves the run's record as it was.
    run_files.write_config(
        workdir, config,
        class_names=_class_names(config, workdir, resuming=run.start > 0))
    try:
      outcome = train(run)
    except BaseException:
      # The run's own error (a stop, a divergence) is what the user needs;
      # one from closing the checkpointer as well (a full disk) is logged.
      try:
        run.ckpt.close()
      except Exception as e:  # pylint: disable=broad-except
        logging.error('closing the checkpointer failed as well: %s: %s',
                      type(e).__name__, e)
      raise
    run.ckpt.close()
    return summarise(run, *outcome)


def _check_results_kept(workdir: str) -> None:
  """A finished run whose checkpoints/ was removed (a clean-up after a
  sweep) would train again from scratch and replace its summary.json and
  metrics.jsonl rows: refused, before anything is read or written. Only
  summary.json says a run finished: a run stopped before its first save
  (a divergence, a kill) has metrics rows but no summary, and starts
  afresh as its error said."""
  summary = run_files.read_summary(workdir, own=False)
  if not summary or orbax_state.saved_steps(workdir):
    return
  raise ResultsWithoutCheckpointError(
      f'{workdir} holds a finished run\'s results (summary.json, step '
      f'{summary.get("steps")}) but no checkpoint to resume from: training '
      'here would start over and replace them. Use a new --workdir, or move '
      'summary.json and metrics.jsonl aside to train again here')


def _check_finished_run(config, workdir: str, run: 'Run') -> None:
  """A finished run started again evaluates again, into its summary.json:
  only with its own evaluation settings (`eval_run._SAME`), else its results
  would be replaced by another evaluation's; and only with the training
  settings it trained with (optimiser, schedule, loss, run length, the
  report's description), else its record (config.json, the summary's
  report, a model card) would say it trained with settings that never
  trained a step (a sweep's command pointed at another LR's workdir)."""
  step = run.start
  why = eval_run.differs_from_run(config, workdir)
  if not why:
    why = _trained_otherwise(config, workdir, run)
  if why:
    raise orbax_state.ConfigChangedError(
        f'{workdir} finished at step {step}; {why}, so evaluating again here '
        'would replace its results or its record. To evaluate it with other '
        'settings use --config.mode=eval (written to eval_summary.json); to '
        'train with them, a new --workdir (--config.init=<this workdir> '
        'starts from it) or a longer --config.total_steps here')


def _trained_otherwise(config, workdir: str, run: 'Run') -> Optional[str]:
  """Why `config` is not what the finished run in `workdir` trained with,
  or None: fewer steps than it trained (a run stopped early may be ended
  where it stands, `total_steps` = its step), or a `_TRAINED_WITH` setting
  that differs from its config.json's (written when it last started, so a
  deliberate change on resume is its record). config.json records every
  field, unset ones as null: a field it lacks was added to the configs
  since, and is no difference; a null one turned on is."""
  if run.steps < run.start:
    return (f'it trained {run.start} steps and this config asks for '
            f'{run.steps}: nothing would train')
  recorded = run_files.read_config(workdir).get('config') or {}
  now = json.loads(config.to_json_best_effort())
  for key in _TRAINED_WITH:
    if key not in recorded:
      continue
    was, cur = recorded[key], now.get(key)
    if isinstance(was, dict):
      cur = cur if isinstance(cur, dict) else {}
      diff = {k: (v, cur.get(k)) for k, v in was.items() if cur.get(k) != v}
    else:
      diff = (was, cur) if cur != was else None
    if diff:
      return f'{key} differs from what it trained with (was -> now: {diff})'
  return None


# What a finished run's re-run must share with its record (config.json):
# how it trained, and the report that says which experiment it is.
_TRAINED_WITH = ('optim', 'loss', 'label_smoothing', 'accum_steps', 'report')


@dataclasses.dataclass
class Run:
  """Everything a run needs, as `setup` built it."""
  config: ml_collections.ConfigDict
  workdir: str
  mesh: Any
  num_classes: int
  steps: int
  image_shape: Tuple[int, ...]
  grid: Optional[Tuple[int, int]]  # The model's patch grid (None: BiT).
  state: Any
  state_sh: Any
  ckpt: orbax_state.Checkpointer
  train_it: Any
  train_fn: Any
  evals: list
  forward_flops: float
  start: int
  saved: Dict[str, Any]  # The JSON saved with the restored checkpoint.

  @property
  def specs(self) -> Dict[str, Any]:
    """What a checkpoint records about its configuration."""
    return {'model': orbax_state.as_saved(self.config.model.to_dict()),
            'optim': self.config.optim.to_dict(), 'total_steps': self.steps,
            # What loaders resize position embeddings from (a 7x9 grid and
            # a 9x7 one have the same rows).
            'patch_grid': list(self.grid) if self.grid else None,
            **_objective(self.config), **_training(self.config)}


def setup(config: ml_collections.ConfigDict, workdir: str) -> Run:
  """Data, model, sharded state and step; resumed from `workdir`'s newest
  good checkpoint, else initialised (from `config.init` if set)."""
  if jax.process_count() > 1:
    # Processes started with different configs (another batch size) would
    # pass set-up and abort inside the step ("collective mismatch"): compare
    # a hash of the config (8 bytes a process) first.
    digest = hashlib.sha256(config.to_json_best_effort(
        sort_keys=True).encode()).digest()[:8]
    every = np.asarray(multihost_utils.process_allgather(
        np.frombuffer(digest, np.int32)))
    differ = [p for p in range(len(every))
              if not np.array_equal(every[p], every[0])]
    if differ:
      raise ValueError(
          f'the processes\' configs differ: process(es) {differ} were started '
          'with another config than process 0 (e.g. another --config file '
          'or --config.* flag); start every process of a run with the same '
          'config')
  prepare.ensure_prepared(config.input)
  mesh = shd.make_mesh(**config.get('mesh', {}))
  accum = config.get('accum_steps', 1)
  shd.check_batch_size(config.input.batch_size, mesh, 'input.batch_size',
                       accum)
  shd.check_batch_size(config.input.eval_batch_size, mesh,
                       'input.eval_batch_size')
  info = pipeline.dataset_info(config.input)
  mpp = config.get('objective', 'supervised') == 'mpp'
  if mpp:  # No head, no labels: any images do.
    num_classes = 0
    selfsup.check_value_range(config.input,
                              config.mpp.get('target', 'colour'))
  else:
    num_classes = config.get('num_classes') or info.num_classes
    pipeline.check_num_classes(config.input, num_classes)
  steps = optim.total_steps(config, info.num_train_examples)
  model = selfsup.model_from_config(config, num_classes,
                                     shd.platform(mesh))
  tx, lr_fn = optim.make(config.optim, steps)
  image_shape = tuple(info.image_shape)
  grid = models.patch_grid(model, image_shape)
  ema = bool(config.optim.get('ema_decay'))
  abstract, state_sh = step_lib.planned_state(
      model, tx, image_shape, mesh, config.get('fsdp_min_size', 2**18),
      rules=config.get('sharding_rules', ()),
      overrides=config.get('sharding_overrides', ()), ema=ema)
  ckpt = orbax_state.Checkpointer(
      workdir, every=config.get('checkpoint_every', 1000),
      keep=config.get('keep_checkpoints', 3),
      async_save=config.get('async_checkpoints', True))
  train_it = pipeline.train_iterator(
      config.input, seed=config.seed, process_index=jax.process_index(),
      process_count=jax.process_count())
  # A resume reads the checkpoint into the planned shardings; only a fresh
  # start computes a state (never both: one state's memory at a time).
  start, state, saved = ckpt.restore(
      abstract, state_sh,
      expect={'model': config.model.to_dict(), **_objective(config)},
      loose={'model': models.registry.COMPUTE_OPTIONS})
  if start is not None:
    train_it.set_state(saved['input'])
    logging.info('resumed from step %d in %s', start, workdir)
    if start < steps:  # A finished run's changes: _check_finished_run.
      _log_changes(saved, config, steps, start)
  else:
    start, saved = 0, {}
    init = None
    if config.get('init'):
      init, saved['init_from'], init_grid = _init_weights(config)
      # What the init was trained by: an MPP model has its mpp_head.
      saved['init_objective'] = (
          'mpp' if any(k in init for k in selfsup.PARAMS) else 'supervised')
      saved['init_report'] = run_files.init_report(saved['init_from'])
    state = step_lib.init_state(model, tx, config.seed, image_shape, mesh,
                                state_sh, ema=ema)
    if init is not None:
      state = _init_params(init, state, state_sh, grid, init_grid)
      logging.info('initialised from %s', saved['init_from'])
  label_ndim = 2 if (config.input.get('mixup') or config.input.get('cutmix')
                    or info.multi_label) else 1
  train_fn = step_lib.compile_train_step(model, tx, lr_fn, state_sh, mesh,
                                        config, label_ndim)
  evals = evaluators.build(config, model, mesh, state_sh.params,
                           image_shape)
  fwd = (accounting.module_forward_flops(model, image_shape) if mpp else
         accounting.forward_flops(config.model.name, image_shape[:2],
                                  num_classes,
                                  **accounting.counted_options(config.model)))
  heap.release()  # What initialisation or the restore freed.
  return Run(config=config, workdir=workdir, mesh=mesh,
             num_classes=num_classes, steps=steps, image_shape=image_shape,
             grid=grid, state=state, state_sh=state_sh, ckpt=ckpt,
             train_it=train_it, train_fn=train_fn, evals=evals,
             forward_flops=fwd, start=start, saved=saved)


def _objective(config) -> Dict[str, Any]:
  """What a checkpoint records about a self-supervised objective (nothing
  for supervised runs, whose checkpoints predate the field)."""
  if config.get('objective', 'supervised') != 'mpp':
    return {}
  return {'objective': 'mpp', 'mpp': config.mpp.to_dict()}


def _overrides(config) -> Dict[str, Any]:
  """The model options the config sets beyond the zoo variant's."""
  return {k: v for k, v in dict(config.model).items()
          if k not in ('name', 'dtype', 'param_dtype') and v is not None}


def _training(config) -> Dict[str, Any]:
  """How the loss is computed (legitimate to change on resume, but never
  silently): the loss, label smoothing, gradient accumulation."""
  return {'loss': config.get('loss', 'softmax'),
          'label_smoothing': config.get('label_smoothing', 0.0) or 0.0,
          'accum_steps': config.get('accum_steps', 1) or 1}


def _log_changes(saved: Dict[str, Any], config, steps: int,
                 start: int) -> None:
  """Logs, loudly, an optimiser, schedule, loss or model compute option
  (`registry.COMPUTE_OPTIONS`: the restore refused other model changes)
  that differs from the one the checkpoint was trained with (legitimate:
  e.g. a lower LR after a divergence, a longer run, remat on smaller
  devices). Checkpoints of earlier versions did not record the loss:
  nothing to compare there."""
  now = orbax_state.as_saved(
      {'optim': config.optim.to_dict(), 'total_steps': steps,
       'model': config.model.to_dict(), **_training(config)})
  for key, value in now.items():
    if key in saved and saved[key] != value:
      before = saved[key]
      if isinstance(value, dict) and isinstance(before, dict):
        diff = {k: (before.get(k), value.get(k))
                for k in sorted(set(before) | set(value))
                if before.get(k) != value.get(k)}
        if not diff:  # Only fields added since, at their default (None).
          continue
      else:
        diff = (before, value)
      logging.warning(
          '*** DELIBERATE CHANGE on resume from step %d: %s was %s in the '
          'checkpoint and is now %s (was -> now: %s). Training continues '
          'with the new setting. ***', start, key, before, value, diff)


def train(run: Run) -> Tuple[int, Dict[str, float], Dict[str, float],
                            Dict[str, Any]]:
  """Runs the steps from `run.start`; returns (step reached, final train
  metrics, final eval metrics, the cost of this and earlier runs
  (`reporting.COST_KEYS` and `hardware`))."""
  config, ckpt, state = run.config, run.ckpt, run.state
  log_every = config.get('log_every', 50)
  writer = reporting.make_writer(run.workdir, resume_step=run.start)
  progress = reporting.Progress(
      total_steps=run.steps, batch_size=config.input.batch_size,
      start_step=run.start, forward_flops=run.forward_flops,
      every_steps=log_every, prior=run.saved)
  hardware = reporting.hardware_so_far(run.saved.get('hardware'),
                                       progress.hardware)
  # The train metrics of the restored step: a run resumed at its last step
  # (killed before its summary) reports them again.
  last_metrics = dict(run.saved.get('train_metrics', {}))

  def run_state(step_metrics, evals_owed=()):
    return {'input': run.train_it.get_state(), **run.specs,
            **progress.spent(), 'hardware': hardware,
            'train_metrics': step_metrics,
            # Evaluations due at this step that a stop put off.
            'evals_owed': list(evals_owed),
            'init_from': run.saved.get('init_from'),
            'init_objective': run.saved.get('init_objective'),
            'init_report': run.saved.get('init_report')}

  keys = step_lib.batch_keys(config)  # MPP: images only, labels unread.
  pending = None  # (step, metrics) of the previous step, checked one late.
  step = run.start
  stops = preemption.StopRequests(ckpt.manager.reached_preemption)
  # Its trace's start and export are timed as 'profile' (not host overhead).
  profile = profiling.Window(
      config.get('profile'), run.workdir, run.start, run.steps,
      timed=lambda name: progress.timed(name, wait_jax_async_dispatch=False))
  try:
    with stops, jax.set_mesh(run.mesh):
      owed = [e for e in run.evals
              if e.name in run.saved.get('evals_owed', ())]
      if owed and step < run.steps:  # The final step evaluates them all.
        with progress.timed('eval', wait_jax_async_dispatch=False):
          writer.write_scalars(step, _evaluate(config, owed, state))
      while step < run.steps:
        profile.before_step(step)
        with progress.timed('input_wait', wait_jax_async_dispatch=False):
          host = next(run.train_it)
          batch = shd.global_batch({k: host[k] for k in keys}, run.mesh)
        # 'step': dispatching this step and waiting for the previous one
        # (its metrics are checked one step late, so the input of this
        # step overlaps the device's work on the previous one).
        with progress.timed('step', wait_jax_async_dispatch=False):
          state, metrics = run.train_fn(state, batch)
          if step == run.start:
            heap.release()  # What compiling the step freed.
          if pending is not None:
            _check_finite(*pending, ckpt)
        step += 1
        progress(step)
        profile.after_step(step, (state, metrics))
        pending = (step, metrics)
        if step % log_every == 0 or step == run.steps:
          with progress.timed('step', wait_jax_async_dispatch=False):
            last_metrics = _check_finite(*pending, ckpt)  # Waits for it.
          writer.write_scalars(step, {**last_metrics, **progress.scalars})
        # A checkpoint due at this step is saved before its evaluations,
        # which it records as owed: a run killed while evaluating resumes
        # from here and evaluates first (a repeated row replaces the first
        # one), instead of from the previous checkpoint. A stop (SIGTERM, a
        # preemption notice) then stops: a spot VM's grace period is no
        # time for an evaluation.
        stop = stops.requested(step)
        due = [e for e in run.evals if e.due(step, run.steps)]
        if ckpt.due(step) or stop:
          last_metrics = _check_finite(*pending, ckpt)  # Never save NaNs.
          with progress.timed('checkpoint', wait_jax_async_dispatch=False):
            ckpt.maybe_save(step, state, run_state(
                last_metrics, [e.name for e in due]), force=True)
        if stop:
          ckpt.wait()
          raise stop  # `finally` writes the metrics (and never hides this).
        if due:
          with progress.timed('eval', wait_jax_async_dispatch=False):
            writer.write_scalars(step, _evaluate(config, due, state))
      if pending:
        last_metrics = _check_finite(*pending, ckpt)
      ckpt.maybe_save(step, state, run_state(last_metrics), force=True)
      eval_metrics = _evaluate(config, run.evals, state)
      writer.write_scalars(step, eval_metrics)
  except BaseException:
    # The run's own exception (a stop's exit code 75, a NaN's report) is
    # what the user and the launcher act on: a metrics store failing too
    # is logged, never raised in its place.
    profile.close()
    try:
      writer.close()
    except Exception as e:  # pylint: disable=broad-except
      logging.error('%s', e)
    raise
  profile.close()
  writer.close()
  return step, last_metrics, eval_metrics, {**progress.spent(),
                                            'hardware': hardware}


def _evaluate(config, evals, state) -> Dict[str, float]:
  """The evaluators on the raw parameters and / or their Polyak averages,
  as `config.eval_ema` says (see `evaluators.run_with_ema`)."""
  return evaluators.run_with_ema(evals, state.params, state.ema_params,
                                 config.get('eval_ema', 'ema'))


def summarise(run: Run, step: int, train_metrics: Dict[str, float],
              eval_metrics: Dict[str, float],
              spent: Dict[str, Any]) -> Dict[str, Any]:
  """Writes `summary.json`: what was trained, its cost and final metrics."""
  config = run.config
  examples = step * config.input.batch_size
  overrides = _overrides(config)
  summary = {
      'model': config.model.name,
      # The architecture actually trained: the variant and what the config
      # changed (e.g. a smoke run's shrunk ViT-B/16).
      'model_overrides': overrides,
      'architecture': config.model.name + (
          ' (' + ', '.join(f'{k}={v}' for k, v in sorted(overrides.items()))
          + ')' if overrides else ''),
      'dataset': config.input.data,
      'steps': step, 'batch_size': config.input.batch_size,
      'examples_seen': examples,
      # Each part of a resumed run on its own devices (`train`).
      **{k: spent[k] for k in reporting.COST_KEYS},
      'num_devices': jax.device_count(),
      'num_processes': jax.process_count(),
      'hardware': spent['hardware'],
      'image_size': run.image_shape[0], 'init': config.get('init'),
      # The file or checkpoint step `init` named when the run started.
      'init_from': run.saved.get('init_from'),
      'init_objective': run.saved.get('init_objective'),
      'forward_gflops': run.forward_flops / 1e9,
      'exaflops': examples * 3 * run.forward_flops / 1e18,
      'objective': config.get('objective', 'supervised'),
      **({'mpp_eval_corruption': evaluators.mpp.CORRUPTION}
         if config.get('objective') == 'mpp' else {}),
      **({'file_order': folder_source.FILE_ORDER}
         if registry.get(config.input.data).source == 'folder' else {}),
      'report': _report(config, run.saved.get('init_objective'),
                        run.saved.get('init_report'),
                        ran=(run.steps, run.image_shape)),
      **{f'train_{k}': float(v) for k, v in train_metrics.items()},
      **eval_metrics,
  }
  # A run that trained since its workdir's summary was written (extended,
  # or trained again) keeps nothing of it; one resumed at its last step
  # (it only evaluated) keeps what it lacks (train metrics of a checkpoint
  # saved before they were recorded, metrics `mode=eval` merged in).
  if step == run.start:
    summary.update(_cost_recorded(run.workdir, step))
  path = run_files.write_summary(run.workdir, summary,
                                 fresh=step != run.start)
  logging.info('summary written to %s: %s', path, summary)
  return summary


def _cost_recorded(workdir: str, step: int) -> Dict[str, Any]:
  """The cost figures of the summary a finished run started again (it
  trained nothing: it evaluated again) already has for `step`: evaluating
  again is not training time. {} where there is none (a run killed before
  its summary: the evaluation now stands in for the one it lost)."""
  earlier = run_files.read_summary(workdir, own=False)
  if earlier.get('steps') != step:
    return {}
  return {**{k: earlier[k] for k in reporting.COST_KEYS
             if isinstance(earlier.get(k), (int, float))},
          # Not the evaluating host's kind added to those it trained on.
          **({'hardware': earlier['hardware']}
             if isinstance(earlier.get('hardware'), str) else {})}


def _cell_data(report: Dict[str, Any]) -> Optional[str]:
  """The dataset (registry name) the run of `report`'s table cell trains
  on: a transfer's task, a pre-training's (also MPP's) data; None where
  the report names none (cpu_reproduce's steps, ...)."""
  if report.get('transfer'):
    return report.get('task')
  task = str(report.get('task', ''))
  if task == 'pretrain' or task.startswith('mpp_'):
    return paper.PRETRAIN_DATA.get(report.get('pretrain'))
  return None


def _report(config, init_objective: Optional[str] = None,
            init_report: Optional[Dict[str, Any]] = None,
            ran: Optional[Tuple[int, Tuple[int, ...]]] = None
            ) -> Dict[str, Any]:
  """`config.report` (which paper table cell the run is) as the run was
  really trained. The config args made it; the command line may change the
  run: `overridden` (no cell is this run's) when it trained another zoo
  model, another pre-training length, a transfer without `init`, or one
  whose `init` was not trained by supervision (`init_objective`: an MPP
  run's fine-tune is not the supervised pre-training's); the task names
  the objective when it is not supervised (`mpp_<target>`, also when
  `--config.mpp.target` changed the config's own). A transfer run takes its
  pre-training fields from `init_report`, the init run's own report, where
  they differ (a 7-epoch ViT-L/16 fine-tuned under the default 14-epoch
  args); an overridden init makes the transfer overridden too. `ran`:
  (total steps, image shape) of the run, for `_record_transfer`."""
  report = config.report.to_dict() if 'report' in config else {}
  if report.get('transfer'):
    # Whether the pre-training fields are the init run's own (below):
    # `python -m vit_jax.vtab` then lets the config args' ones differ.
    report['pretrain_from_init'] = bool(
        init_report and init_report.get('task') == 'pretrain')
  if report.get('pretrain_from_init'):
    if init_report.get('overridden'):
      report['overridden'] = f'init run: {init_report["overridden"]}'
    for key in run_files.PRETRAIN_FIELDS:
      theirs = init_report.get(key)
      if theirs is not None and report.get(key) != theirs:
        logging.warning('config.report says %s=%s; the init run\'s report '
                        'says %s: taken', key, report.get(key), theirs)
        report[key] = theirs
  trained = (config.get('model') or {}).get('name')
  if (report.get('model') in models.names() and trained
      and report['model'] != trained):
    # --config.model.name changed the zoo model the config args named
    # (labels such as cpu_reproduce's 'ViT-cpu' name no zoo model): this
    # run is not that table cell's (the tables list it with the others).
    logging.warning('config.report names %s but the run trained %s: its '
                    'report is marked overridden', report['model'], trained)
    report['overridden'] = f'model.name={trained}'
  cell_data, data = _cell_data(report), config.get('input', {}).get('data')
  if cell_data and data and data != cell_data and not report.get('smoke'):
    # --config.input.data trained on other data (your own folder, ...)
    # than the cell the config args named: the run is not that cell's.
    logging.warning('config.report is a %s cell but the run trained on %s: '
                    'its report is marked overridden', cell_data, data)
    report['overridden'] = f'input.data={data}'
  if (report.get('transfer') and not config.get('init')
      and not report.get('smoke')):
    # A transfer row (finetune.py, vtab.py) is fine-tuning from its
    # `pretrain`: without init the run trained from scratch.
    report['overridden'] = 'no init: trained from scratch'
  objective = config.get('objective', 'supervised')
  if (report and config.get('init') and objective == 'supervised'
      and init_objective not in (None, 'supervised')):
    report['overridden'] = (f'init is a {init_objective} run, not the '
                            'supervised pre-training the report names')
  epochs = report.get('pretrain_epochs')
  if report.get('task') == 'pretrain' and epochs and (
      config.get('total_steps') or (config.get('total_epochs') or epochs)
      != epochs) and config.get('total_epochs') is not None:
    # The cell's epochs came from the config args; --config.total_epochs
    # (or a total_steps, which wins over it) trained another length.
    logging.warning('config.report says %s pre-training epochs but the run '
                    'set total_epochs=%s, total_steps=%s: its report is '
                    'marked overridden', epochs, config.get('total_epochs'),
                    config.get('total_steps'))
    report['overridden'] = (f'total_epochs={config.get("total_epochs")}, '
                            f'total_steps={config.get("total_steps")}')
  if report.get('transfer') and ran is not None:
    _record_transfer(report, config, *ran)
  if report and objective != 'supervised':
    target = config.get(objective, {}).get('target')
    report['task'] = objective + (f'_{target}' if target else '')
  return report


def _record_transfer(report: Dict[str, Any], config, steps: int,
                     image_shape: Tuple[int, ...]) -> None:
  """A transfer row's report says how the run really fine-tuned: its
  learning rate (what a sweep's rows are told apart by), steps, resolution
  and Polyak factor, whatever the command line changed. A run that left
  the paper's protocol for its task (`paper.transfer_protocol`: Table 4's
  steps at 384 px, or Table 2's ImageNet at 512/518 px with Polyak
  averaging; Table 4's splits, batch and optimizer: `_off_table4`) is
  marked overridden: no paper cell is its. Smoke runs (stand-ins) are not
  compared."""
  lr = float(config.optim.lr)
  if report.get('lr') is not None and float(report['lr']) != lr:
    logging.warning('config.report says lr=%s but the run trained with '
                    'optim.lr=%s: recorded', report['lr'], lr)
  h, w = image_shape[:2]
  ema = config.optim.get('ema_decay') or None
  report.update(lr=lr, steps=steps, image_size=h if h == w else [h, w],
                ema_decay=ema)
  if ema:  # Which parameters its metrics are of: the averages, or not.
    report['eval_ema'] = run_files.eval_mode(config)
  if report.get('smoke') or report.get('overridden'):
    return
  protocol = paper.transfer_protocol(
      str(report.get('task')), str(report.get('model')),
      bool(report.get('table2')))
  if protocol is None:
    return
  why = []
  if steps != protocol['steps']:
    why.append(f'{steps} steps, the paper\'s {protocol["steps"]}')
  if (h, w) != (protocol['image_size'],) * 2:
    why.append(f'{h}x{w} px, the paper\'s {protocol["image_size"]}')
  if ema != protocol['polyak']:
    why.append(f'Polyak averaging {ema}, the paper\'s {protocol["polyak"]}'
               if protocol['polyak'] else
               f'Polyak averaging {ema}, which the paper did not use here')
  elif ema and report.get('eval_ema') == 'raw':
    why.append('evaluated the raw parameters (eval_ema=raw), not the Polyak '
               'averages the paper reports')
  why += _off_table4(config, report)
  if why:
    logging.warning('this %s fine-tune left the paper\'s protocol (%s): its '
                    'report is marked overridden', report.get('task'),
                    '; '.join(why))
    report['overridden'] = '; '.join(why)


def _off_table4(config, report: Dict[str, Any]) -> List[str]:
  """How the run left the rest of the paper's fine-tuning protocol: its
  splits (a final run: the task's train and test splits; a learning-rate
  sweep: the held-out ones, `train800`/`val200` or `train_dev`/`dev`, never
  test nor data it trained on), and Table 4's batch and optimizer."""
  spec = registry.get(config.input.data)
  if report.get('sweep'):
    want = (('train800', 'val200') if str(report.get('task')).startswith(
        'vtab/') else ('train_dev', 'dev'))
  else:
    want = (spec.train_split, spec.eval_split)
  why = []
  for what, key, wanted in (('trained', 'train_split', want[0]),
                            ('evaluated', 'eval_split', want[1])):
    split = config.input.get(key) or getattr(spec, key)
    if split != wanted:
      why.append(f'{what} on {split}, not {wanted}'
                 + (' (a learning-rate sweep)' if report.get('sweep') else ''))
  t4, optim = paper.TABLE4_COMMON, config.optim
  got = dict(batch_size=config.input.batch_size, optimizer=optim.get('name'),
             momentum=optim.get('momentum'), decay=optim.get('decay'),
             weight_decay=optim.get('weight_decay') or 0.0,
             grad_clip_norm=optim.get('grad_clip_norm'))
  why += [f'{key}={value}, the paper\'s {t4[key]}'
          for key, value in got.items() if value != t4[key]]
  if optim.get('nesterov'):
    why.append('Nesterov momentum, the paper\'s plain SGD momentum')
  why += [f'optim.{key}={optim.get(key)!r}, which the paper did not use'
          for key in ('frozen', 'lr_mults', 'layer_decay', 'schedules')
          if optim.get(key) is not None]
  return why


def _check_finite(step: int, metrics: Dict[str, Any],
                  ckpt: orbax_state.Checkpointer) -> Dict[str, float]:
  """The step's metrics as floats; NonFiniteLossError if the loss, the
  gradient norm or the new parameters (their norm) are not finite."""
  values = {k: float(v) for k, v in jax.device_get(metrics).items()}
  bad = [k for k in ('loss', 'grad_norm', 'param_norm')
         if k in values and not math.isfinite(values[k])]
  if bad:
    ckpt.wait()
    last = ckpt.latest_step()
    kept = (f'The last good checkpoint (step {last}) is kept in '
            f'{ckpt.manager.directory}; every saved state is finite'
            if last is not None else 'No checkpoint was saved yet')
    what = ', '.join(f'{k}={values[k]}' for k in bad)
    again = ('re-run the same command with e.g. --config.optim.lr=<lower>: '
             'it resumes from that checkpoint and logs the changed '
             'optimiser. If it diverges again right after it, that state was '
             'already poor: move checkpoints/<step> into damaged_checkpoints/ '
             'to resume from an earlier one. (Adding grad_clip_norm changes '
             'the optimiser state, so it needs a new --workdir with '
             '--config.init=<this workdir>.)' if last is not None else
             're-run the same command with e.g. --config.optim.lr=<lower>: '
             'it starts afresh.')
    raise NonFiniteLossError(
        f'{what} at step {step} (loss is {values.get("loss")}); stopping. '
        f'{kept}. Lower optim.lr, raise optim.warmup_steps or set '
        f'optim.grad_clip_norm, then {again}')
  return values
