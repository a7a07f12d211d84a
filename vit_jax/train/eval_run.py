"""`--config.mode=eval`: evaluate a run's checkpoint (or `config.init`).

Evaluates the latest checkpoint of `workdir` — refusing one of a different
model than the config's — with top-1 on `input.eval_split` and every
`config.evals` evaluator. Without a checkpoint in `workdir`, `config.init`
(an .npz file or another run's workdir) is evaluated instead.

Every evaluation writes `workdir/eval_summary.json` (the latest) and adds a
line to `workdir/eval_history.jsonl` (every one, with what it was: step,
resolution, split, EMA mode, each evaluator's settings, merged or why not).
Its metrics are also merged into the run's `summary.json` (where the
result tables read them) only when they describe that run
(`_not_the_runs_evaluation`): its own final checkpoint, evaluated as it was
(data, split, pre-processing, loss, EMA mode, resolution, and each of its
evaluators with the same settings, defaults filled in; new evaluators may
be added, as long as they write no metric the run already has). So
re-evaluating another way, an unfinished run, or `init` never replaces a
run's results. The head is kept; position embeddings are resized when the
resolution differs.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from etils import epath

from vit_jax import evaluators, models, selfsup
from vit_jax.checkpoint import CheckpointNotFoundError, load_pretrained
from vit_jax.data import folder_source, pipeline, prepare, registry
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


def _shardings(config, model, image_shape, mesh):
  """(abstract parameters, their shardings on `mesh`): shapes only, so that
  the evaluators are built (and their data checked) before the weights are
  read."""
  init = functools.partial(model.init, train=False)
  abstract = jax.eval_shape(init, jax.random.PRNGKey(0),
                            jnp.zeros((1, *image_shape), jnp.float32))
  params_sh = shd.param_shardings(
      abstract['params'], mesh, config.get('fsdp_min_size', 2**18),
      axes=shd.logical_axes(model, image_shape),
      rules=config.get('sharding_rules', ()),
      overrides=config.get('sharding_overrides', ()))
  return abstract['params'], params_sh


def _load(source: str, model, image_shape, abstract, params_sh, ema: bool):
  """(params, Polyak averages or None) of `source` placed as `params_sh`;
  the averages only with `ema` and where the checkpoint has them (never for
  .npz files)."""
  npz = source.endswith('.npz')
  loaded, averages = ((source, None) if npz
                      else orbax_state.load_weights(source))
  source_grid = None if npz else orbax_state.patch_grid(source)
  host = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)

  def place(tree):
    return jax.device_put(load_pretrained(
        tree, host, keep_head=True,
        grid=models.patch_grid(model, image_shape),
        source_grid=source_grid), params_sh)
  return (place(loaded), place(averages) if ema and averages is not None
          else None)


def _has_averages(source: str) -> Optional[bool]:
  """Whether checkpoint `source` holds Polyak averages, as its record says
  without reading the weights (its run's optim.ema_decay); None where it
  does not say (a record of an earlier version). An .npz file has none."""
  if source.endswith('.npz'):
    return False
  optim = orbax_state.load_run_state(source).get('optim')
  return bool(optim.get('ema_decay')) if isinstance(optim, dict) else None


def _no_averages(source: str) -> str:
  """eval_ema=both of a checkpoint without averages: they come from the
  checkpoint, so the config's optim.ema_decay cannot help."""
  return (f'--config.eval_ema=both: {source} holds no Polyak (EMA) '
          'averages (an .npz file, or a run without optim.ema_decay), only '
          'its parameters: evaluate those with --config.eval_ema=raw')


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
  if config.get('objective', 'supervised') == 'mpp':
    # As training refuses them: colour accuracies of other pixel values
    # are meaningless.
    selfsup.check_value_range(config.input,
                              config.mpp.get('target', 'colour'))
  prepare.ensure_prepared(config.input)
  mesh = shd.make_mesh(**config.get('mesh', {}))
  shd.check_batch_size(config.input.eval_batch_size, mesh,
                       'input.eval_batch_size')
  info = pipeline.dataset_info(config.input, training=False)
  if config.get('objective', 'supervised') == 'mpp':
    num_classes = 0  # An MPP model: no head, labels unread.
  else:
    num_classes = config.get('num_classes') or info.num_classes
    pipeline.check_num_classes(config.input, num_classes)
  model = selfsup.model_from_config(config, num_classes,
                                     shd.platform(mesh))
  image_shape = tuple(info.eval_image_shape)
  abstract, params_sh = _shardings(config, model, image_shape, mesh)
  mode = config.get('eval_ema', 'ema')
  if mode == 'both' and _has_averages(source) is False:
    raise ValueError(_no_averages(source))
  # Before the (possibly long) load: a bad evaluator setting fails first.
  evals = evaluators.build(config, model, mesh, params_sh, image_shape)
  params, averages = _load(source, model, image_shape, abstract, params_sh,
                           ema=mode != 'raw')
  if mode == 'both' and averages is None:  # A record that did not say.
    raise ValueError(_no_averages(source))
  logging.info('evaluating %s at %s', source, image_shape)
  by_evaluator = {}
  with jax.set_mesh(mesh):
    for evaluator in evals:
      by_evaluator[evaluator.name] = evaluators.run_with_ema(
          [evaluator], params, averages, mode)
  metrics = {k: v for out in by_evaluator.values() for k, v in out.items()}
  last = source.rstrip('/').rsplit('/', 1)[-1]
  step = int(last) if last.isdigit() else 0
  result = {'evaluated_checkpoint': source, 'image_size': image_shape[0],
            'data': config.input.data, 'eval_split': info.eval_split,
            'eval_ema': mode, **metrics}
  run_files.write_json(workdir, run_files.EVAL_SUMMARY, result)
  why_not = (_not_the_runs_evaluation(config, workdir, step, image_shape[0],
                                      by_evaluator)
             if own else 'it evaluated config.init, not this run')
  _append_history(workdir, {
      'time': datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec='seconds'),
      'step': step, **result, 'image_shape': list(image_shape),
      'settings': evaluation_settings(config),
      'merged': not why_not, 'not_merged_because': why_not})
  if why_not:
    logging.info('metrics written to %s/%s (and %s) only, not merged into '
                 'the run\'s summary.json: %s', workdir,
                 run_files.EVAL_SUMMARY, EVAL_HISTORY, why_not)
  else:
    run_files.write_summary(workdir, metrics)
    writer = reporting.make_writer(workdir)
    writer.write_scalars(step, metrics)
    writer.close()
    logging.info('metrics merged into %s/summary.json', workdir)
  return result


# Every `mode=eval` evaluation of a workdir, one JSON object a line.
EVAL_HISTORY = 'eval_history.jsonl'


def _append_history(workdir: str, entry: Dict[str, Any]) -> None:
  """Adds `entry` as a line of `workdir/eval_history.jsonl` (process 0),
  written whole through a temporary file and a rename as metrics.jsonl
  is (object stores cannot append): a killed write leaves the old file."""
  if jax.process_index() != 0:
    return
  path = epath.Path(workdir) / EVAL_HISTORY
  before = path.read_text() if path.exists() else ''
  if before and not before.endswith('\n'):
    before += '\n'
  run_files.write_text(os.fspath(path), before + json.dumps(
      entry, sort_keys=True, default=str) + '\n')


def evaluation_settings(config: ml_collections.ConfigDict) -> Dict[str, Any]:
  """What an evaluation's numbers depend on besides the checkpoint and the
  resolution: the `_SAME` settings (defaults filled in) and each
  evaluator's `settings` (with its `type`)."""
  now = _as_recorded(config)
  out = {'.'.join(keys): _get(now, keys, default)
         for keys, default in _same(now)}
  out = {k: (None if v is _MISSING else v) for k, v in out.items()}
  out['evals'] = {name: {'type': section.get('type'),
                         **_settings(name, section, now)}
                  for name, section in sorted((now.get('evals') or {})
                                              .items())}
  return out


def _not_the_runs_evaluation(config, workdir: str, step: int,
                             image_size: int,
                             metrics: Optional[Dict[str, Dict[str, float]]]
                             = None):
  """Why metrics of `workdir`'s checkpoint `step` do not describe the
  run's results (summary.json, where the tables read them), else None: the
  run must have finished at that step, and the evaluation be the one it
  ran (its data, split, pre-processing, loss, EMA mode, resolution,
  objective and its settings (for MPP also how its corruption is drawn:
  runs before 2026-11-29 drew it per global batch), and each of its evaluators with the same settings). An
  evaluator the run did not have may be added unless it writes a metric
  the run's summary already has (`metrics`: each evaluator's, by name).
  """
  run = run_files.read_summary(workdir)
  if not run:
    return 'the run has no summary.json (it did not finish)'
  if run.get('steps') != step:
    return (f'checkpoint step {step} is not the step the run finished at '
            f'({run.get("steps")})')
  if run.get('image_size', image_size) != image_size:
    return f'image size {image_size}, the run\'s is {run["image_size"]}'
  inp = config.input
  if (registry.get(inp.data).source == 'folder'
      and run.get('file_order') != folder_source.FILE_ORDER
      and any('[' in (inp.get(k) or '') for k in ('train_split',
                                                   'eval_split'))):
    return ('the run read its image folder in the order before 2026-11-29: '
            'its held-out slice held other images than this version\'s')
  if (config.get('objective') == 'mpp' and run.get('mpp_eval_corruption')
      != evaluators.mpp.CORRUPTION):
    return ('the run\'s MPP evaluation drew its corruption per global batch '
            '(a version before 2026-11-29); this one draws it per image, so '
            'its numbers differ')
  why = differs_from_run(config, workdir)
  if why:
    return why
  recorded = (run_files.read_config(workdir).get('config') or {}).get(
      'evals') or {}
  for name, out in sorted((metrics or {}).items()):
    if name == evaluators.BUILT_IN or name in recorded:
      continue  # The run's own: compared above.
    taken = sorted(set(out) & set(run))
    if taken:
      return (f'config.evals.{name} is not one of the run\'s evaluators '
              f'({", ".join(sorted(recorded)) or "none recorded"}) but '
              f'writes {taken[0]!r}, a result the run already has')
  return None


def differs_from_run(config, workdir: str):
  """Why `config` does not evaluate as the run of `workdir` did (its
  config.json), else None: the `_SAME` settings and each of the run's
  evaluators that `config` also has (by name; new ones may be added), as
  their `settings` resolve them (defaults filled in: an option a record of
  an earlier version lacks counts as its default). A `_SAME` setting the
  record lacks and that has no known default (recorded before the field
  existed) is not compared."""
  trained = run_files.read_config(workdir).get('config') or {}
  if not trained:
    return None
  now = _as_recorded(config)
  for keys, default in _same(now):
    then = _get(trained, keys, default)
    if then is _MISSING:
      continue
    why = _difference('.'.join(keys), then, _get(now, keys, None))
    if why:
      return why
  before, after = trained.get('evals') or {}, now.get('evals') or {}
  for name in sorted(set(before) & set(after)):
    kinds = before[name].get('type'), after[name].get('type')
    if kinds[0] != kinds[1]:
      return (f'config.evals.{name}.type is {kinds[1]!r}, the run\'s was '
              f'{kinds[0]!r}')
    then = _settings(name, before[name], trained)
    value = _settings(name, after[name], now)
    for key in sorted(set(then) | set(value)):
      if (orbax_state.as_saved(then.get(key)) !=
          orbax_state.as_saved(value.get(key))):
        return (f'config.evals.{name}.{key} is {value.get(key)!r}, the '
                f'run\'s was {then.get(key)!r} (defaults filled in)')
  return None


_MISSING = object()  # A key the run's record lacks (an older version's).

# What an evaluation must share with the run's own to stand in its summary
# (evaluators may be added: their metrics are new keys), with the value a
# record that lacks it had (_MISSING: unknown, not compared). The loss is
# eval_loss's; label smoothing changes training only.
_SAME = ((('input', 'data'), _MISSING), (('input', 'eval_split'), _MISSING),
         (('input', 'pp_eval'), _MISSING), (('eval_ema',), 'ema'),
         (('objective',), 'supervised'), (('loss',), 'softmax'))
# Masked patch prediction: its objective's settings (its corruption is drawn
# per image, the same at any eval batch size or process count).
_SAME_MPP = ((('mpp',), _MISSING),)


def _same(now: Dict[str, Any]):
  return _SAME + (_SAME_MPP if now.get('objective') == 'mpp' else ())


def _as_recorded(config) -> Dict[str, Any]:
  """`config` as config.json records it (tuples become lists)."""
  return json.loads(config.to_json_best_effort())


def _get(tree: Dict[str, Any], keys, default):
  for key in keys:
    tree = tree.get(key, _MISSING) if isinstance(tree, dict) else _MISSING
  return default if tree is _MISSING else tree


def _settings(name: str, section: Dict[str, Any],
              config: Dict[str, Any]) -> Dict[str, Any]:
  """The `settings` of evaluator section `name` (an unregistered type's:
  the section as written, as `Evaluator.settings` gives it)."""
  kind = section.get('type')
  cls = (evaluators.base.TYPES.get(kind, evaluators.Evaluator)
         if isinstance(kind, str) else evaluators.Evaluator)
  return cls.settings(section, config)


def _difference(path: str, then, now):
  """Where `now` differs from the recorded `then` (keys `then` lacks are
  skipped), as a message, else None."""
  found = None if then is _MISSING else run_files.first_difference(
      then, now, path)
  if found:
    path, then, now = found
    return f'config.{path} is {now!r}, the run\'s was {then!r}'
  return None
