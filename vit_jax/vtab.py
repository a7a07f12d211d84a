"""VTAB-1k: fine-tune one model on all 19 tasks and report them together.

    python -m vit_jax.vtab --config_args=model=ViT-B/16,init=gs://.../pretrain \
        --workdir=gs://.../vtab [--tasks=caltech101,dtd] \
        [--set=input.data_dir=gs://.../tfds --set=input.batch_size=256]

Runs `configs/vtab.py:<config_args>,task=<task>` for every task, each in
`<workdir>/<task>` (a finished task is skipped, an interrupted one resumes
from its checkpoint), then prints the per-task table with the Natural /
Specialized / Structured and overall means (`python -m vit_jax.tables`
renders the same table later from the workdirs). A task that fails (its
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
    '--set=input.data_dir=gs://b/tfds --set=input.batch_size=256.')
flags.mark_flag_as_required('workdir')


def tasks(names) -> list:
  from vit_jax.data import registry
  every = [t[len('vtab/'):] for t in registry.VTAB_TASKS]
  if list(names) == ['all']:
    return every
  unknown = sorted(set(names) - set(every))
  if unknown:
    raise app.UsageError(f'unknown VTAB task(s) {unknown}; known: '
                         f'{", ".join(every)}')
  return list(names)


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
  """Whether `workdir` holds this config's finished run; an earlier run
  with other settings (model, init, lr, ...) is an error, not a skip."""
  from vit_jax.train import run_files  # Loads no TensorFlow.
  summary = run_files.read_summary(workdir)
  if not summary:
    return False
  # The trainer records the learning rate it trained with (--set may
  # change the config args' one).
  ours = {**config.report.to_dict(), 'lr': float(config.optim.lr),
          'init': config.init, 'image_size': config.input.image_size}
  theirs = {**summary.get('report', {}), 'init': summary.get('init'),
            'image_size': summary.get('image_size')}
  # The trainer takes the pre-training fields from the init run's own
  # report: with the same init, theirs are the truer ones.
  same_init = theirs['init'] == ours['init']
  changed = sorted(k for k in ours if theirs.get(k) != ours[k] and not (
      same_init and k in run_files.PRETRAIN_FIELDS))
  if changed:
    raise app.UsageError(
        f'{workdir} holds a VTAB run with other settings ({", ".join(changed)}'
        f': {[theirs.get(k) for k in changed]} there, '
        f'{[ours[k] for k in changed]} now); use a new --workdir')
  # Every other setting (`--set=input.batch_size=...`, an optimizer field)
  # as the task's config.json recorded it.
  recorded = run_files.read_config(workdir).get('config') or {}
  found = run_files.first_difference(
      recorded, json.loads(config.to_json_best_effort()),
      skip=_NOT_RESULTS, skip_keys=frozenset({'data_dir'}))
  if found:
    field, then, now = found
    raise app.UsageError(
        f'{workdir} holds a VTAB run with other settings ({field}: '
        f'{then!r} there, {now!r} now); use a new '
        '--workdir, or the --set values it was trained with')
  return summary.get('steps') == config.total_steps and (
      'eval_accuracy' in summary)


# Config fields that change where data lives (`data_dir` at any depth too),
# what is logged, saved or profiled, or the device layout, not a task's
# result. `report` is compared above (with the init run's own pre-training
# fields).
_NOT_RESULTS = frozenset((
    'data_dir', 'mode', 'report', 'accounting', 'log_every', 'eval_every',
    'checkpoint_every', 'keep_checkpoints', 'async_checkpoints', 'profile',
    'mesh', 'fsdp_min_size', 'sharding_rules', 'sharding_overrides',
    'input.prefetch', 'input.cache', 'input.eval_batch_size',
    'input.prepare'))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  runtime.setup()
  import jax
  from vit_jax.configs import vtab as vtab_config
  from vit_jax import tables
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
  failed = {}
  for task, config, workdir in todo:
    logging.info('%s: training in %s', task, workdir)
    from vit_jax.train import loop, preemption  # Only here: no TF to skip.
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
  for task, why in failed.items():
    print(f'vit_jax.vtab: {task} failed: {why}', file=sys.stderr)
  if jax.process_index() == 0 and len(failed) < len(names):
    skipped = []
    print(tables.render(tables.load_runs([root], skipped=skipped),
                        tables='vtab'))
    for why in skipped:
      logging.warning('not in the table: %s', why)
  if failed:
    sys.exit(1)


if __name__ == '__main__':
  hugepages.reexec()  # First: restarts the process where it helps.
  app.run(main)
