"""Pre-train, fine-tune or evaluate: `python -m vit_jax.main`.

    python -m vit_jax.main --config=configs/smoke.py --workdir=/tmp/smoke
    python -m vit_jax.main --config=configs/pretrain.py:model=ViT-B/16,data=i21k \
        --workdir=gs://bucket/run --config.input.batch_size=1024

Run the same command on every worker of a TPU pod (jax.distributed is
initialised automatically there) or pass --coordinator/--num_processes/
--process_id for multi-process runs elsewhere. Re-running with the same
--workdir resumes from its latest checkpoint.

Exit codes: 0 done; 75 stopped by SIGTERM or a preemption notice after
saving a checkpoint, or by SIGTERM before the first step (setup:
nothing to save) (re-run to resume: `launch.tpu` does); 130
the same for Ctrl-C during the steps; 1 an error (the message says what to
do).
"""

from __future__ import annotations

import importlib.util
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from vit_jax import hugepages, outputs, runtime

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Config file and args, e.g. configs/smoke.py.',
    lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Checkpoints, metrics and '
                               'summary.json go here; re-use it to resume.')
flags.mark_flags_as_required(['config', 'workdir'])

EXIT_ERROR = 1


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  runtime.setup()
  import jax
  from vit_jax.train import config_check, lock, run_files
  config = _CONFIG.value
  try:
    workdir = outputs.directory(_WORKDIR.value)
  except outputs.OutputPathError as e:
    raise app.UsageError(str(e)) from None
  mode = config.get('mode', 'train')
  if mode not in ('train', 'eval'):
    raise app.UsageError(f'config.mode={mode!r}: expected train or eval')
  # A bad value or a busy workdir is refused in seconds, before the imports
  # of TensorFlow and the trainer (`_run`).
  try:
    config_check.check(config)
    with lock.hold(workdir):
      summary = _run(mode, config, workdir)
  except (config_check.ConfigError, lock.WorkdirBusyError,
          lock.WorkdirNotWritableError) as e:
    _exit(f'{type(e).__name__}: {e}', EXIT_ERROR)
  if jax.process_index() == 0:
    keys = [k for k in summary if ('accuracy' in k or 'loss' in k or
                                   k.endswith('shot'))]
    width = max([len(k) for k in keys] + [16])
    print('\n'.join(f'{k:>{width}}: {summary[k]:.4f}' for k in sorted(keys)))
    name = run_files.SUMMARY if mode == 'train' else run_files.EVAL_SUMMARY
    print(f'{"written to":>{width}}: {os.path.join(workdir, name)}')


def _run(mode: str, config, workdir: str):
  """Trains or evaluates, in the workdir `main` has locked (the trainer's
  own `lock.hold` finds it held by this process)."""
  from vit_jax.checkpoint import CheckpointError, CheckpointNotFoundError
  from vit_jax.data import pipeline
  from vit_jax.data.errors import DataError
  from vit_jax.train import eval_run, loop, orbax_state, param_groups
  from vit_jax.train import preemption
  from vit_jax.sharding import MeshError
  pipeline.hide_accelerators_from_tf()  # TF is loaded now, before any op.
  run = loop.train_and_evaluate if mode == 'train' else eval_run.evaluate_run
  try:
    with preemption.stop_at_once_outside_steps():
      return run(config, workdir)
  except preemption.RunInterrupted as e:
    _exit(str(e), e.exit_code)
  except orbax_state.CheckpointUnavailableError as e:  # Try again later.
    _exit(f'{type(e).__name__}: {e}', preemption.EXIT_PREEMPTED)
  # What users cause and the message explains (the data, a checkpoint, a
  # path): no traceback. Anything else keeps its traceback.
  except (orbax_state.DamagedCheckpointError, orbax_state.ConfigChangedError,
          loop.NonFiniteLossError, DataError, CheckpointError,
          CheckpointNotFoundError, param_groups.ParamGroupError,
          MeshError) as e:
    _exit(f'{type(e).__name__}: {e}', EXIT_ERROR)


def _exit(message: str, code: int):
  print(f'vit_jax: {message}', file=sys.stderr)
  sys.exit(code)


def _find_config(argv):
  """`argv` with its --config file found (`configs.config_file`: the
  installed configs/ outside a checkout); a missing one ends the process
  with the reason, not with absl's chained tracebacks."""
  from vit_jax.configs import config_file

  def found(spec):
    try:
      path, arg = config_file(spec)
    except ValueError as e:
      _exit(str(e), EXIT_ERROR)
    # Built once here, so that a bad `:args` is its own message rather than
    # absl's chained tracebacks (config_flags builds it again).
    name = '_vit_jax_config_check'
    loader = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module  # As an import would (dataclasses need it).
    try:
      loader.loader.exec_module(module)
      built.append(module.get_config(*([arg[1:]] if arg else [])))
    except Exception as e:  # pylint: disable=broad-except
      _exit(f'--config={spec}: {type(e).__name__}: {e}', EXIT_ERROR)
    finally:
      del sys.modules[name]
    return path + arg

  built = []  # The config as config_flags will build it.
  out = list(argv)
  for i, arg in enumerate(out):
    if arg.startswith('--config='):
      out[i] = '--config=' + found(arg[len('--config='):])
    elif arg == '--config' and i + 1 < len(out):
      out[i + 1] = found(out[i + 1])
  if built:
    for arg in out:
      if arg.startswith('--config.'):
        _check_field(built[-1], arg[len('--config.'):].split('=', 1)[0])
  return out


def _check_field(config, path: str) -> None:
  """Ends the process naming the field when `--config.<path>` names none."""
  from vit_jax.configs import unknown_field
  problem = unknown_field(config, path)
  if problem:
    _exit(problem, EXIT_ERROR)


if __name__ == '__main__':
  hugepages.reexec()  # First: restarts the process where it helps.
  app.run(main, argv=_find_config(sys.argv))
