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

import os
import signal
import sys

# Standard library only (no JAX): cheap before the handler below.
from vit_jax.train import preemption
from vit_jax.train.preemption import EXIT_PREEMPTED


def _stop_outside_training(signum, frame):  # pylint: disable=unused-argument
  """SIGTERM while the run starts (imports, TensorFlow, jax.distributed:
  minutes on a fresh pod), before `preemption` installs its handlers, or
  once they are gone again after the last checkpoint (evaluating, writing
  the summary): exits 75, which launchers re-run, instead of dying by the
  signal (143, which they take as a failure). Nothing is left to save;
  `os._exit`, as no cleanup may wait on peers (jax.distributed's shutdown
  barrier) and a lock left behind is taken over on this host."""
  for stream in (sys.stdout, sys.stderr):
    try:  # The code interrupted may be writing to it (reentrant flush).
      stream.flush()
    except Exception:  # pylint: disable=broad-except
      pass
  try:
    os.write(2, b'vit_jax: stopped by SIGTERM outside training steps; '
             b'nothing to save; exit 75 (restart)\n')
  except OSError:  # A stderr that is gone.
    pass
  os._exit(EXIT_PREEMPTED)  # pylint: disable=protected-access


if __name__ == '__main__':
  # First, before the heavy imports; replaced by `preemption`'s handlers
  # (and on a pod by JAX's preemption service) while the steps run, and
  # back in place after the last checkpoint.
  signal.signal(signal.SIGTERM, _stop_outside_training)

# pylint: disable=wrong-import-position
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
  preemption.ignore_sigterm_once_done()
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
          orbax_state.CheckpointWriteError, loop.NonFiniteLossError,
          loop.ResultsWithoutCheckpointError, DataError, CheckpointError,
          CheckpointNotFoundError, param_groups.ParamGroupError,
          MeshError) as e:
    _exit(f'{type(e).__name__}: {e}', EXIT_ERROR)


def _exit(message: str, code: int):
  print(f'vit_jax: {message}', file=sys.stderr)
  sys.exit(code)


def _find_config(argv):
  """`argv` with its --config file found and the config checked
  (`configs.common.check_command_line`, shared with the other entry
  points); a bad spec or field ends the process with one line."""
  from vit_jax.configs import common
  try:
    return common.check_command_line(argv)
  except common.ConfigSpecError as e:
    _exit(str(e), EXIT_ERROR)


if __name__ == '__main__':
  hugepages.reexec()  # First: restarts the process where it helps.
  app.run(main, argv=_find_config(sys.argv))
