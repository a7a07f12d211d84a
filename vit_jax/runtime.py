"""Process set-up shared by the command-line faces (`main`, `vtab`).

Defines the multi-process flags, initialises `jax.distributed` (from the
flags, or automatically on Cloud TPU VMs), keeps TensorFlow off accelerators
and quiets the INFO chatter of orbax and tfds.
"""

from __future__ import annotations

import glob
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


# A Cloud TPU VM's TPU chips, as JAX's own detection finds them
# (`jax._src.hardware_utils`, private: its ids are copied here; a test checks
# they still cover the installed JAX's): PCI devices of Google's vendor id
# with a TPU's device id. The vendor id alone is not enough: on GCE it also
# covers the gVNIC network card (1ae0:0042) and the persistent-disk NVMe
# controller of every VM, GPU VMs included.
_PCI_DEVICES = '/sys/bus/pci/devices'
_GOOGLE_PCI_VENDOR = '0x1ae0'
TPU_PCI_DEVICE_IDS = frozenset({
    '0x0027',  # v2, v3
    '0x0056',  # (no public name)
    '0x005e',  # v4
    '0x0062',  # v5p
    '0x0063',  # v5e
    '0x006f',  # v6e
    '0x0076',  # TPU7x
})


def _read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read().strip().lower()
  except OSError:
    return ''


def _tpu_chips_present() -> bool:
  for device in glob.glob(os.path.join(_PCI_DEVICES, '*')):
    if (_read(os.path.join(device, 'vendor')) == _GOOGLE_PCI_VENDOR and
        _read(os.path.join(device, 'device')) in TPU_PCI_DEVICE_IDS):
      return True
  return False


def _on_tpu_vm() -> bool:
  """A Cloud TPU VM (GCE or GKE) whose TPUs this run may use."""
  platforms = os.environ.get('JAX_PLATFORMS', '')
  if platforms and 'tpu' not in platforms.split(','):
    return False  # E.g. JAX_PLATFORMS=cpu: a CPU run on a TPU VM.
  return bool(os.environ.get('TPU_WORKER_HOSTNAMES')
              or os.environ.get('CLOUD_TPU_TASK_ID') or _tpu_chips_present())


def _distributed_flags() -> bool:
  """Whether --coordinator, --num_processes and --process_id are given;
  they go together (a partial set is an error naming the missing ones)."""
  given = {'--coordinator': _COORDINATOR.value,
           '--num_processes': _NUM_PROCESSES.value,
           '--process_id': _PROCESS_ID.value}
  missing = [k for k, v in given.items() if v is None]
  if len(missing) == len(given):
    return False
  if missing:
    raise ValueError(
        f'{", ".join(missing)} not set: a multi-process run needs '
        '--coordinator (host:port of process 0), --num_processes and '
        '--process_id (0 to num_processes - 1) together, on every process; '
        'pass none of them for one process (or on a Cloud TPU VM, where JAX '
        'finds the workers itself)')
  if _NUM_PROCESSES.value < 1 or not (
      0 <= _PROCESS_ID.value < _NUM_PROCESSES.value):
    raise ValueError(
        f'--process_id={_PROCESS_ID.value} with --num_processes='
        f'{_NUM_PROCESSES.value}: process ids run from 0 to num_processes - '
        '1; give each process its own')
  return True


def init_distributed() -> None:
  """`jax.distributed` from the flags; on a Cloud TPU VM, from JAX's own
  detection (the TPU metadata server finds every worker of a pod; a single
  host is one process); elsewhere none. On a pod it is what preemption sync
  points and orbax's cross-host barriers need. Slurm and MPI jobs pass the
  flags: JAX's detection there would also narrow each process to one local
  device."""
  import jax
  if jax.distributed.is_initialized():  # A second run in this process.
    return
  if _distributed_flags():
    # Cross-process collectives for CPU devices (harmless elsewhere); set
    # before initialize, which must precede any backend use.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value,
                               _PROCESS_ID.value)
  elif _on_tpu_vm():
    jax.distributed.initialize()  # Every worker of a pod finds the others.


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
