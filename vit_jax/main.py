"""Pre-train, fine-tune or evaluate: `python -m vit_jax.main`.

    python -m vit_jax.main --config=configs/smoke.py --workdir=/tmp/smoke
    python -m vit_jax.main --config=configs/pretrain.py:model=ViT-B/16,data=i21k \
        --workdir=gs://bucket/run --config.input.batch_size=1024

Run the same command on every worker of a TPU pod (jax.distributed is
initialised automatically there) or pass --coordinator/--num_processes/
--process_id for multi-process runs elsewhere. Re-running with the same
--workdir resumes from its latest checkpoint.
"""

from __future__ import annotations

import logging as logging_std
import os

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Config file and args, e.g. configs/smoke.py.',
    lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Checkpoints, metrics and '
                               'summary.json go here; re-use it to resume.')
_COORDINATOR = flags.DEFINE_string(
    'coordinator', None, 'host:port of process 0 for multi-process runs '
    '(not needed on TPU pods).')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None,
                                      'Processes in a multi-process run.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None,
                                   'This process\'s index (0-based).')
flags.mark_flags_as_required(['config', 'workdir'])


def _init_distributed():
  import jax
  if _COORDINATOR.value or _NUM_PROCESSES.value:
    if jax.devices()[0].platform == 'cpu':
      jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value,
                               _PROCESS_ID.value)
  elif os.environ.get('TPU_WORKER_HOSTNAMES') or os.environ.get(
      'CLOUD_TPU_TASK_ID'):
    jax.distributed.initialize()  # Every worker of a pod finds the others.


class _QuietLibraries(logging_std.Filter):
  """Drops INFO chatter of orbax and tfds; their warnings still show."""

  def filter(self, record):
    return record.levelno >= logging_std.WARNING or not any(
        n in record.pathname for n in ('/orbax/', '/tensorflow_datasets/'))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  logging.get_absl_handler().addFilter(_QuietLibraries())
  _init_distributed()
  import jax
  import tensorflow as tf
  tf.config.set_visible_devices([], 'GPU')  # tf.data stays on the host.
  from vit_jax.train import eval_run, loop
  logging.info('process %d/%d, %d devices (%s)', jax.process_index(),
               jax.process_count(), jax.device_count(),
               jax.devices()[0].device_kind)
  config = _CONFIG.value
  mode = config.get('mode', 'train')
  if mode not in ('train', 'eval'):
    raise app.UsageError(f'config.mode={mode!r}: expected train or eval')
  run = loop.train_and_evaluate if mode == 'train' else eval_run.evaluate_run
  summary = run(config, _WORKDIR.value)
  if jax.process_index() == 0:
    keys = [k for k in summary if ('accuracy' in k or 'loss' in k or
                                   k.endswith('shot'))]
    width = max([len(k) for k in keys] + [16])
    print('\n'.join(f'{k:>{width}}: {summary[k]:.4f}' for k in sorted(keys)))
    print(f'{"summary":>{width}}: '
          f'{os.path.join(_WORKDIR.value, "summary.json")}')


if __name__ == '__main__':
  app.run(main)
