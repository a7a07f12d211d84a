"""VTAB-1k: fine-tune one model on all 19 tasks and report them together.

    python -m vit_jax.vtab --config_args=model=ViT-B/16,init=gs://.../pretrain \
        --workdir=gs://.../vtab [--tasks=caltech101,dtd] \
        [--set=input.data_dir=gs://.../tfds --set=accum_steps=2]

Runs `configs/vtab.py:<config_args>,task=<task>` for every task, each in
`<workdir>/<task>` (a finished task is skipped, an interrupted one resumes
from its checkpoint; one that holds a run with other settings, finished or
not, is refused), then prints the per-task table with the Natural /
Specialized / Structured and overall means, and the runs no cell takes with
the reason (its own `steps=` / `res=`, a `--set` off the paper's protocol,
its splits, batch or optimizer: `overridden`; LR sweeps by rate) (`python -m vit_jax.tables
--tables=vtab,sweep,other` renders the same later from the workdirs). A task that fails (its
data not prepared, say) does not stop the others (in a one-process run):
the failures are listed before the table and the exit status is 1;
re-running trains only what is missing.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging

from vit_jax import hugepages, outputs, runtime

_ARGS = flags.DEFINE_string('config_args', '', 'Arguments of configs/vtab.py '
                            'except task, e.g. model=ViT-B/16,init=DIR.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'One sub-directory per task.')
_TASKS = flags.DEFINE_list('tasks', ['all'], 'Task names (without vtab/), or '
                           'all.')
_SET = flags.DEFINE_multi_string(
    'set', [], 'FIELD=VALUE: sets a field of every task\'s config, as '
    '--config.FIELD=VALUE does for vit_jax.main (repeatable), e.g. '
    '--set=input.data_dir=gs://b/tfds --set=accum_steps=2 (the batch of 512 '
    'in two halves, where it does not fit).')
flags.mark_flag_as_required('workdir')


def tasks(names) -> list:
  from vit_jax.data import registry
  every = [t[len('vtab/'):] for t in registry.VTAB_TASKS]
  if list(names) == ['all']:
    return every
  # `vtab/dtd` as the registry (and configs/vtab.py's task=) spell it.
  names = [n[len('vtab/'):] if n.startswith('vtab/') else n for n in names]
  unknown = sorted(set(names) - set(every))
  if unknown:
    raise app.UsageError(f'unknown VTAB task(s) {unknown}; known: '
                         f'{", ".join(every)}')
  return list(dict.fromkeys(names))  # Each once (`dtd,vtab/dtd`: one).


def override(config, item: str) -> None:
  """Sets `config`'s field as `--set=FIELD=VALUE` says: VALUE is a Python
  literal (`256`, `0.01`, `True`, `(1, 5)`), else a string; an unknown
  field or a value of the wrong type is a UsageError naming it."""
  import ast
  from vit_jax.configs import unknown_field
  path, sep, text = item.partition('=')
  if not sep or not path:
    raise app.UsageError(f'--set={item}: expected FIELD=VALUE, e.g. '
                         '--set=input.data_dir=gs://b/tfds')
  problem = unknown_field(config, path)
  if problem:
    raise app.UsageError(problem.replace(f'--config.{path}', f'--set={item}',
                                         1))
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    value = text  # A path, a name: a string.
  *parents, key = path.split('.')
  node = config
  for name in parents:
    node = node[name]
  try:
    node[key] = value
  except (TypeError, ValueError) as e:
    try:  # A string field's value that reads as a literal (a folder `2024`).
      node[key] = text
    except (TypeError, ValueError):
      raise app.UsageError(f'--set={item}: {e}') from None


def _finished(workdir: str, config) -> bool:
  """Whether `workdir` holds this config's finished run. An earlier run
  there with other settings (model, init, lr, ...) is an error, not a skip;
  so is an interrupted one (config.json and a checkpoint, no summary.json
  yet), which re-running would resume under the new settings."""
  from vit_jax.train import run_files  # Loads no TensorFlow.
  summary = run_files.read_summary(workdir)
  recorded = run_files.read_config(workdir).get('config') or {}
  if not summary and not (recorded and _has_checkpoint(workdir)):
    return False  # A new task, or one that failed before its first save.
  what = ('a VTAB run' if summary else 'an interrupted VTAB run (a '
          'checkpoint, no summary.json yet)')
  # The trainer records the learning rate it trained with (--set may
  # change the config args' one).
  ours = {**config.report.to_dict(), 'lr': float(config.optim.lr),
          'init': config.init, 'image_size': config.input.image_size}
  theirs = _recorded_settings(summary, recorded)
  # Compared over the keys the record has: one written before a report
  # key existed (`transfer`, ...) lacks it.
  changed = [k for k in sorted(ours) if k in theirs and theirs[k] != ours[k]]
  if (set(changed) & set(run_files.PRETRAIN_FIELDS)
      and theirs.get('init') == ours['init']
      and _pretraining_from_init(theirs, summary)):
    # The trainer takes (took) them from the init run's own report: with
    # the same init, the config args' ones do not matter.
    changed = [k for k in changed if k not in run_files.PRETRAIN_FIELDS]
  if changed:
    raise app.UsageError(
        f'{workdir} holds {what} with other settings ({", ".join(changed)}'
        f': {[theirs.get(k) for k in changed]} there, '
        f'{[ours[k] for k in changed]} now); use a new --workdir')
  # Every other setting (`--set=input.batch_size=...`, an optimizer field)
  # as the task's config.json recorded it.
  # An interrupted run resumes its input pipeline, which `input.cache`
  # changes (epochs in one order): compared for it. It may resume in
  # another compute dtype (the trainer logs it: `COMPUTE_OPTIONS`); a
  # finished run's results were computed in its own.
  skip = (_NOT_RESULTS if summary else
          _NOT_RESULTS - {'input.cache'} | {'model.dtype'})
  found = run_files.first_difference(
      recorded, json.loads(config.to_json_best_effort()), skip=skip,
      skip_keys=frozenset({'data_dir'}))
  if found:
    field, then, now = found
    raise app.UsageError(
        f'{workdir} holds {what} with other settings ({field}: '
        f'{then!r} there, {now!r} now); use a new '
        '--workdir, or the --set values it was trained with')
  return summary.get('steps') == config.total_steps and (
      'eval_accuracy' in summary)


def _has_checkpoint(workdir: str) -> bool:
  """Whether `workdir` has a saved step to resume from (the trainer's
  `checkpoints/<step>`; a save in progress is named otherwise)."""
  from etils import epath
  path = epath.Path(workdir) / 'checkpoints'
  return path.is_dir() and any(p.name.isdigit() for p in path.iterdir())


def _recorded_settings(summary, recorded) -> dict:
  """What `_finished` compares, as the task's workdir recorded it: the
  report, init and resolution of its summary.json (the trainer's: the lr
  it trained with), else of its config.json (an interrupted run: the
  config's report, its `optim.lr`). Only keys the record has."""
  if summary:
    report = summary.get('report')
    theirs = dict(report) if isinstance(report, dict) else {}
    theirs.update({k: summary[k] for k in ('init', 'image_size')
                   if k in summary})
    return theirs
  report = recorded.get('report')
  theirs = dict(report) if isinstance(report, dict) else {}
  if 'init' in recorded:
    theirs['init'] = recorded['init']
  lr = (recorded.get('optim') or {}).get('lr')
  if lr is not None:
    theirs['lr'] = float(lr)
  size = (recorded.get('input') or {}).get('image_size')
  if size is not None:
    theirs['image_size'] = size
  return theirs


def _pretraining_from_init(theirs, summary) -> bool:
  """Whether the trainer takes (or took) the task's pre-training fields
  from its init run's own report (`loop._report`): as its report recorded
  (`pretrain_from_init`), else (older runs, an interrupted one) whether the
  init is one of our pre-training runs. An .npz, a run that is gone or
  not a pre-training: no, and the config args' fields are the record's."""
  from vit_jax.train import run_files
  if 'pretrain_from_init' in theirs:
    return bool(theirs['pretrain_from_init'])
  found = run_files.init_report(summary.get('init_from') or theirs.get('init'))
  return bool(found) and found.get('task') == 'pretrain'


# Config fields that change where data lives (`data_dir` at any depth too),
# what is logged, saved or profiled, the device layout, or how the model
# computes without changing its numbers (remat, attention kernel), not a task's
# result. `report` is compared above (with the init run's own pre-training
# fields).
_NOT_RESULTS = frozenset((
    'data_dir', 'mode', 'report', 'accounting', 'log_every', 'eval_every',
    'checkpoint_every', 'keep_checkpoints', 'async_checkpoints', 'profile',
    'mesh', 'fsdp_min_size', 'sharding_rules', 'sharding_overrides',
    'input.prefetch', 'input.cache', 'input.eval_batch_size',
    'input.prepare', 'model.remat', 'model.attention_impl',
    'model.recompute_internals'))


# The driver's tables: the per-task one, and the runs it cannot show with
# the reason (`overridden`: its own `steps=` / `res=` args, a `--set` off the
# paper's protocol; `sweep`: dev-split accuracies, by learning rate).
TABLES = 'vtab,sweep,other'


def report(root: str) -> str:
  """The Markdown tables of the task runs below `root` (`TABLES`); a
  summary that cannot be read is logged, not shown."""
  from vit_jax import tables
  skipped = []
  try:
    runs = tables.load_runs([root], skipped=skipped)
  except tables.TablesError as e:
    return f'no table: {e}'
  for why in skipped:
    logging.warning('not in the table: %s', why)
  return tables.render(runs, tables=TABLES)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  runtime.setup()
  import jax
  from vit_jax.configs import vtab as vtab_config
  try:
    root = outputs.directory(_WORKDIR.value)
  except outputs.OutputPathError as e:
    raise app.UsageError(str(e)) from None
  names = tasks(_TASKS.value)
  args = ','.join(filter(None, [_ARGS.value]))
  todo = []  # Every task checked first: a refusal comes before any training.
  for task in names:
    spec = ','.join(filter(None, [args, f'task={task}']))
    try:
      config = vtab_config.get_config(spec)
    except ValueError as e:
      raise app.UsageError(f'--config_args={_ARGS.value}: {e}') from None
    for item in _SET.value:
      override(config, item)
    workdir = os.path.join(root, task)
    if _finished(workdir, config):
      logging.info('%s: finished earlier, skipped', task)
    else:
      todo.append((task, config, workdir))
  from vit_jax.train import preemption  # No JAX nor TF: cheap.
  failed = {}
  for task, config, workdir in todo:
    logging.info('%s: training in %s', task, workdir)
    from vit_jax.train import loop  # Only here: no TF to skip.
    try:
      with preemption.stop_at_once_outside_steps():
        loop.train_and_evaluate(config, workdir)
    except preemption.RunInterrupted as e:  # Saved: re-run to resume.
      print(f'vit_jax.vtab: {task}: {e}', file=sys.stderr)
      sys.exit(e.exit_code)
    except Exception as e:  # pylint: disable=broad-except
      if jax.process_count() > 1:
        raise  # The processes would no longer run the same programs.
      # One task's failure (data not prepared, a bad image, ...) does not
      # cost the others: they run, and the failures are listed at the end.
      logging.exception('%s failed; going on with the other tasks', task)
      failed[task] = f'{type(e).__name__}: {e}'
  preemption.ignore_sigterm_once_done()  # Every task ended.
  for task, why in failed.items():
    print(f'vit_jax.vtab: {task} failed: {why}', file=sys.stderr)
  if jax.process_index() == 0 and len(failed) < len(names):
    print(report(root))
  if failed:
    sys.exit(1)


if __name__ == '__main__':
  hugepages.reexec()  # First: restarts the process where it helps.
  app.run(main)
