"""Process set-up shared by the command-line faces (`main`, `vtab`).

Defines the multi-process flags, initialises `jax.distributed` (from the
flags, or automatically on TPU pods), keeps TensorFlow off accelerators and
quiets the INFO chatter of orbax and tfds.
"""

from __future__ import annotations

import logging as logging_std
import os
import sys

from absl import flags, logging

_COORDINATOR = flags.DEFINE_string(
    'coordinator', None, 'host:port of process 0 for multi-process runs '
    '(not needed on TPU pods).')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None,
                                      'Processes in a multi-process run.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None,
                                   'This process\'s index (0-based).')


class _QuietLibraries(logging_std.Filter):
  """Drops INFO chatter of orbax and tfds; their warnings still show."""

  def filter(self, record):
    return record.levelno >= logging_std.WARNING or not any(
        n in record.pathname for n in ('/orbax/', '/tensorflow_datasets/'))


def init_distributed() -> None:
  """`jax.distributed` from the flags, else from the cluster JAX detects
  (Cloud TPU VMs and pods, found by the TPU metadata server, and GKE; Slurm;
  Open MPI), else none: one process. On a pod it is what preemption sync
  points and orbax's cross-host barriers need."""
  import jax
  if _COORDINATOR.value or _NUM_PROCESSES.value:
    # Cross-process collectives for CPU devices (harmless elsewhere); set
    # before initialize, which must precede any backend use.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value,
                               _PROCESS_ID.value)
    return
  try:
    jax.distributed.initialize()  # Every worker of a pod finds the others.
  except ValueError:  # JAX detects no cluster: a single process.
    pass


def setup() -> None:
  """Call first in main(): logs, jax.distributed, TF on the host only
  (where TF is loaded; `pipeline.hide_accelerators_from_tf`)."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  logging.get_absl_handler().addFilter(_QuietLibraries())
  init_distributed()
  import jax
  if 'tensorflow' in sys.modules:  # Else each data entry point hides it.
    from vit_jax.data import pipeline
    pipeline.hide_accelerators_from_tf()  # tf.data stays on the host.
  logging.info('process %d/%d, %d devices (%s)', jax.process_index(),
               jax.process_count(), jax.device_count(),
               jax.devices()[0].device_kind)
