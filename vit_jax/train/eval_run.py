"""`--config.mode=eval`: evaluate a run's checkpoint (or `config.init`).

Evaluates the latest checkpoint of `workdir` — refusing one of a different
model than the config's — with top-1 on `input.eval_split` and every
`config.evals` evaluator. Without a checkpoint in `workdir`, `config.init`
(an .npz file or another run's workdir) is evaluated instead.

Every evaluation writes `workdir/eval_summary.json`. Its metrics are also
merged into the run's `summary.json` (where the result tables read them)
only when they describe that run (`_not_the_runs_evaluation`): its own
final checkpoint, evaluated as it was (data, split, pre-processing, EMA
mode, resolution, its evaluators; new ones may be added). So re-evaluating
another way, an unfinished run, or `init` never replaces a run's results.
The head is kept; position embeddings are resized when the resolution
differs.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from vit_jax import evaluators, models, selfsup
from vit_jax.checkpoint import CheckpointNotFoundError, load_pretrained
from vit_jax.data import pipeline, prepare
from vit_jax import sharding as shd
from vit_jax.train import config_check, lock, orbax_state, reporting
from vit_jax.train import run_files


def _source(config, workdir: str) -> Tuple[str, bool]:
  """(checkpoint to evaluate, whether it is workdir's own)."""
  try:
    source = orbax_state.resolve(workdir)
  except FileNotFoundError:
    if not config.get('init'):
      raise CheckpointNotFoundError(
          f'--config.mode=eval: {workdir} has no checkpoint and config.init '
          'is not set; pass the workdir of a training run or '
          '--config.init=PATH(.npz or workdir)') from None
    init = config.init
    logging.warning('%s has no checkpoint: evaluating config.init=%s',
                    workdir, init)
    return (init if init.endswith('.npz') else orbax_state.resolve(init),
            False)
  saved = orbax_state.load_run_state(source).get('model')
  now = orbax_state.as_saved(config.model.to_dict())
  if saved is not None and orbax_state.as_saved(saved) != now:
    raise orbax_state.ConfigChangedError(
        f'{source} is a checkpoint of model {orbax_state.as_saved(saved)}; '
        f'this config has {now}. Evaluate it with the config it was '
        'trained with (the same config args)')
  return source, True


def _load(config, source: str, model, image_shape, mesh, ema: bool):
  """(params, Polyak averages or None, their shardings) of `source` on the
  mesh; the averages only with `ema` and where the checkpoint has them
  (never for .npz files)."""
  init = functools.partial(model.init, train=False)
  abstract = jax.eval_shape(init, jax.random.PRNGKey(0),
                            jnp.zeros((1, *image_shape), jnp.float32))
  params_sh = shd.param_shardings(
      abstract['params'], mesh, config.get('fsdp_min_size', 2**18),
      axes=shd.logical_axes(model, image_shape),
      rules=config.get('sharding_rules', ()),
      overrides=config.get('sharding_overrides', ()))
  npz = source.endswith('.npz')
  loaded, averages = ((source, None) if npz
                      else orbax_state.load_weights(source))
  source_grid = None if npz else orbax_state.patch_grid(source)
  host = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype),
                      abstract['params'])

  def place(tree):
    return jax.device_put(load_pretrained(
        tree, host, keep_head=True,
        grid=models.patch_grid(model, image_shape),
        source_grid=source_grid), params_sh)
  return (place(loaded), place(averages) if ema and averages is not None
          else None, params_sh)


def evaluate_run(config: ml_collections.ConfigDict,
                 workdir: str) -> Dict[str, Any]:
  """Evaluates a checkpoint; returns what it wrote to eval_summary.json.

  Holds the workdir's lock (it writes there): evaluating the workdir of a
  run that is still training is refused; evaluate a copy, or pass that
  workdir as --config.init with a new --workdir.
  """
  config_check.check(config)
  with lock.hold(workdir):
    return _evaluate(config, workdir)


def _evaluate(config: ml_collections.ConfigDict,
              workdir: str) -> Dict[str, Any]:
  source, own = _source(config, workdir)  # First: a missing one fails fast.
  prepare.ensure_prepared(config.input)
  mesh = shd.make_mesh(**config.get('mesh', {}))
  shd.check_batch_size(config.input.eval_batch_size, mesh,
                       'input.eval_batch_size')
  info = pipeline.dataset_info(config.input)
  if config.get('objective', 'supervised') == 'mpp':
    num_classes = 0  # An MPP model: no head, labels unread.
  else:
    num_classes = config.get('num_classes') or info.num_classes
    pipeline.check_num_classes(config.input, num_classes)
  model = selfsup.model_from_config(config, num_classes,
                                     shd.platform(mesh))
  image_shape = tuple(info.eval_image_shape)
  mode = config.get('eval_ema', 'ema')
  params, averages, params_sh = _load(config, source, model, image_shape,
                                      mesh, ema=mode != 'raw')
  logging.info('evaluating %s at %s', source, image_shape)
  evals = evaluators.build(config, model, mesh, params_sh, image_shape)
  with jax.set_mesh(mesh):
    metrics = evaluators.run_with_ema(evals, params, averages, mode)
  last = source.rstrip('/').rsplit('/', 1)[-1]
  step = int(last) if last.isdigit() else 0
  result = {'evaluated_checkpoint': source, 'image_size': image_shape[0],
            'data': config.input.data, 'eval_split': info.eval_split,
            'eval_ema': mode, **metrics}
  run_files.write_json(workdir, run_files.EVAL_SUMMARY, result)
  why_not = _not_the_runs_evaluation(config, workdir, step, image_shape[0]) \
      if own else 'it evaluated config.init, not this run'
  if why_not:
    logging.info('metrics written to %s/%s only, not merged into the run\'s '
                 'summary.json: %s', workdir, run_files.EVAL_SUMMARY, why_not)
  else:
    run_files.write_summary(workdir, metrics)
    writer = reporting.make_writer(workdir)
    writer.write_scalars(step, metrics)
    writer.close()
    logging.info('metrics merged into %s/summary.json', workdir)
  return result


# What an evaluation must share with the run's own to stand in its summary
# (evaluators may be added: their metrics are new keys).
_SAME = (('input', 'data'), ('input', 'eval_split'), ('input', 'pp_eval'),
         ('eval_ema',), ('objective',), ('mpp',))
# Masked patch prediction draws its corruption from one key per global
# batch: its numbers also depend on the eval batch size.
_SAME_MPP = (('input', 'eval_batch_size'),)


def _not_the_runs_evaluation(config, workdir: str, step: int,
                             image_size: int):
  """Why metrics of `workdir`'s checkpoint `step` do not describe the
  run's results (summary.json, where the tables read them), else None: the
  run must have finished at that step, and the evaluation be the one it
  ran (its data, split, pre-processing, EMA mode, resolution, objective and
  its settings (for MPP also the eval batch size and the process count),
  and each of its evaluators as it was; new evaluators may be added).
  """
  run = run_files.read_summary(workdir)
  if not run:
    return 'the run has no summary.json (it did not finish)'
  if run.get('steps') != step:
    return (f'checkpoint step {step} is not the step the run finished at '
            f'({run.get("steps")})')
  if run.get('image_size', image_size) != image_size:
    return f'image size {image_size}, the run\'s is {run["image_size"]}'
  # MPP corrupts patches per global batch, which holds each process's next
  # examples: its numbers change with the process count (not the mesh).
  ran = run.get('num_processes')
  if (config.get('objective') == 'mpp' and ran is not None
      and ran != jax.process_count()):
    return (f'MPP evaluated on {jax.process_count()} processes, the run on '
            f'{ran}: its batches, and so its corruption, differ')
  return differs_from_run(config, workdir)


def differs_from_run(config, workdir: str):
  """Why `config` does not evaluate as the run of `workdir` did (its
  config.json), else None: the `_SAME` settings and each of the run's
  evaluators (new evaluators may be added). Settings the run's record
  lacks, at any depth (runs of earlier versions, recorded before a field
  such as `objective` or an evaluator option existed), are not compared."""
  trained = run_files.read_config(workdir).get('config') or {}
  if not trained:
    return None
  now = config.to_dict()
  same = _SAME + (_SAME_MPP if now.get('objective') == 'mpp' else ())
  for keys in same:
    then, value = trained, now
    for key in keys:
      then = then.get(key, _MISSING) if isinstance(then, dict) else _MISSING
      value = value.get(key) if isinstance(value, dict) else None
    why = _difference('.'.join(keys), then, value)
    if why:
      return why
  before, after = trained.get('evals') or {}, now.get('evals') or {}
  for name in sorted(set(before) & set(after)):
    why = _difference(f'evals.{name}', before[name], after[name])
    if why:
      return why
  return None


_MISSING = object()  # A key the run's record lacks (an older version's).


def _difference(path: str, then, now):
  """Where `now` differs from the recorded `then` (keys `then` lacks are
  skipped), as a message, else None."""
  if then is _MISSING:
    return None
  if isinstance(then, dict) and isinstance(now, dict):
    for key in sorted(then):
      why = _difference(f'{path}.{key}', then[key], now.get(key))
      if why:
        return why
    return None
  if orbax_state.as_saved(then) != orbax_state.as_saved(now):
    return f'config.{path} is {now!r}, the run\'s was {then!r}'
  return None
