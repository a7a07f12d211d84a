"""VTAB-1k: fine-tune one model on all 19 tasks and report them together.

    python -m vit_jax.vtab --config_args=model=ViT-B/16,init=gs://.../pretrain \
        --workdir=gs://.../vtab [--tasks=caltech101,dtd]

Runs `configs/vtab.py:<config_args>,task=<task>` for every task, each in
`<workdir>/<task>` (a finished task is skipped, an interrupted one resumes
from its checkpoint), then prints the per-task table with the Natural /
Specialized / Structured and overall means (`python -m vit_jax.tables`
renders the same table later from the workdirs).
"""

from __future__ import annotations

import os

from absl import app, flags, logging

from vit_jax import hugepages, runtime

_ARGS = flags.DEFINE_string('config_args', '', 'Arguments of configs/vtab.py '
                            'except task, e.g. model=ViT-B/16,init=DIR.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'One sub-directory per task.')
_TASKS = flags.DEFINE_list('tasks', ['all'], 'Task names (without vtab/), or '
                           'all.')
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


def _finished(workdir: str, config) -> bool:
  """Whether `workdir` holds this config's finished run; an earlier run
  with other settings (model, init, lr, ...) is an error, not a skip."""
  from vit_jax.train import run_files  # Loads no TensorFlow.
  summary = run_files.read_summary(workdir)
  if not summary:
    return False
  ours = {**config.report.to_dict(), 'init': config.init,
          'image_size': config.input.image_size}
  theirs = {**summary.get('report', {}), 'init': summary.get('init'),
            'image_size': summary.get('image_size')}
  changed = sorted(k for k in ours if theirs.get(k) != ours[k])
  if changed:
    raise app.UsageError(
        f'{workdir} holds a VTAB run with other settings ({", ".join(changed)}'
        f': {[theirs.get(k) for k in changed]} there, '
        f'{[ours[k] for k in changed]} now); use a new --workdir')
  return summary.get('steps') == config.total_steps and (
      'eval_accuracy' in summary)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  runtime.setup()
  import jax
  from vit_jax.configs import vtab as vtab_config
  from vit_jax import tables
  names = tasks(_TASKS.value)
  args = ','.join(filter(None, [_ARGS.value]))
  for task in names:
    config = vtab_config.get_config(','.join(filter(None, [args,
                                                            f'task={task}'])))
    workdir = os.path.join(_WORKDIR.value, task)
    if _finished(workdir, config):
      logging.info('%s: finished earlier, skipped', task)
      continue
    logging.info('%s: training in %s', task, workdir)
    from vit_jax.train import loop  # Only here: skipping needs no TF.
    loop.train_and_evaluate(config, workdir)
  if jax.process_index() == 0:
    runs = tables.load_runs([_WORKDIR.value])
    print(tables.render(runs, tables='vtab'))


if __name__ == '__main__':
  hugepages.reexec()  # First: restarts the process where it helps.
  app.run(main)
