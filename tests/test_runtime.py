"""Process set-up: `jax.distributed` from the flags or on a Cloud TPU VM."""

import jax
import pytest
from absl import flags
from absl.testing import flagsaver

from vit_jax import runtime


@pytest.fixture
def calls(monkeypatch):
  """The `jax.distributed.initialize` calls `init_distributed` makes."""
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  made = []
  monkeypatch.setattr(jax.distributed, 'initialize',
                      lambda *args: made.append(args))
  monkeypatch.setattr(jax.distributed, 'is_initialized', lambda: bool(made))
  monkeypatch.setattr(jax.config, 'update', lambda *a: None)
  for name in ('JAX_PLATFORMS', 'TPU_WORKER_HOSTNAMES', 'CLOUD_TPU_TASK_ID'):
    monkeypatch.delenv(name, raising=False)
  return made


NO_FLAGS = dict(coordinator=None, num_processes=None, process_id=None)


def test_a_cloud_tpu_vm_lets_jax_find_its_workers(calls, monkeypatch):
  """A Cloud TPU VM pod sets none of our flags (nor TPU_WORKER_HOSTNAMES,
  a GKE variable): its TPU chips say where JAX's own detection works."""
  monkeypatch.setattr(runtime, '_tpu_chips_present', lambda: True)
  with flagsaver.flagsaver(**NO_FLAGS):
    runtime.init_distributed()
    runtime.init_distributed()  # A second run in the process: once.
  assert calls == [()]


@pytest.mark.parametrize('env', [{}, {'JAX_PLATFORMS': 'cpu'}])
def test_elsewhere_one_process(calls, monkeypatch, env):
  """No flags and no TPU chips (a CPU or GPU machine, Slurm without the
  flags), or a CPU run on a TPU VM: no jax.distributed."""
  chips = 'JAX_PLATFORMS' in env
  monkeypatch.setattr(runtime, '_tpu_chips_present', lambda: chips)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  with flagsaver.flagsaver(**NO_FLAGS):
    runtime.init_distributed()
  assert calls == []


def test_flags_start_it_explicitly(calls):
  with flagsaver.flagsaver(coordinator='10.0.0.1:1234', num_processes=2,
                           process_id=1):
    runtime.init_distributed()
  assert calls == [('10.0.0.1:1234', 2, 1)]


def _pci(root, *devices):
  """A fake /sys/bus/pci/devices: (vendor, device) per PCI function."""
  for i, (vendor, device) in enumerate(devices):
    d = root / f'0000:00:{i:02x}.0'
    d.mkdir(parents=True)
    (d / 'vendor').write_text(vendor + '\n')
    (d / 'device').write_text(device + '\n')


# A GCE GPU VM: Google's gVNIC network card and persistent-disk NVMe
# controller share the TPUs' vendor id; an H100.
GCE_GPU_VM = [('0x1ae0', '0x0042'), ('0x1ae0', '0x001f'),
              ('0x10de', '0x2330')]


def test_a_gce_gpu_vm_is_no_tpu_vm(calls, monkeypatch, tmp_path):
  """Google's vendor id alone (the NIC, the disk) is no TPU: no
  `jax.distributed.initialize()`, which died there asking for a
  coordinator address."""
  _pci(tmp_path, *GCE_GPU_VM)
  monkeypatch.setattr(runtime, '_PCI_DEVICES', str(tmp_path))
  assert not runtime._tpu_chips_present()
  with flagsaver.flagsaver(**NO_FLAGS):
    runtime.init_distributed()
  assert calls == []


@pytest.mark.parametrize('device', ['0x005e', '0x0063', '0x006f', '0x0076'])
def test_tpu_chips_are_found_by_their_device_id(monkeypatch, tmp_path,
                                                device):
  _pci(tmp_path, ('0x1ae0', '0x0042'), ('0x1ae0', device))
  monkeypatch.setattr(runtime, '_PCI_DEVICES', str(tmp_path))
  assert runtime._tpu_chips_present()


def test_tpu_device_ids_cover_the_installed_jaxs():
  """Ours are a copy of JAX's private list: a JAX that knows a newer TPU
  fails here until the copy has it."""
  hardware_utils = pytest.importorskip('jax._src.hardware_utils')
  ids = getattr(hardware_utils, '_TPU_PCI_DEVICE_IDS', None)
  if ids is None:
    pytest.skip('this JAX keeps its TPU PCI ids elsewhere')
  assert set(ids) <= runtime.TPU_PCI_DEVICE_IDS


@pytest.mark.parametrize('given, missing', [
    (dict(coordinator='10.0.0.1:1234'), '--num_processes, --process_id'),
    (dict(coordinator='10.0.0.1:1234', num_processes=2), '--process_id'),
    (dict(num_processes=2, process_id=0), '--coordinator'),
    (dict(process_id=1), '--coordinator, --num_processes'),
])
def test_a_partial_set_of_process_flags_is_a_clear_error(calls, given,
                                                          missing):
  """--coordinator alone gave a raw JAX ValueError traceback."""
  with flagsaver.flagsaver(**{**NO_FLAGS, **given}):
    with pytest.raises(ValueError, match=f'^{missing} not set: a multi-'
                       'process run needs --coordinator'):
      runtime.init_distributed()
  assert calls == []


def test_a_process_id_out_of_range_is_a_clear_error(calls):
  with flagsaver.flagsaver(coordinator='10.0.0.1:1234', num_processes=2,
                           process_id=2):
    with pytest.raises(ValueError, match='process ids run from 0 to '
                       'num_processes - 1'):
      runtime.init_distributed()
  assert calls == []


class _PastTheCheck(Exception):
  pass


def _past_the_check(_):
  raise _PastTheCheck  # Set-up went on to prepare the data.


@pytest.mark.parametrize('other, error', [(0, None), (1, 'process')])
def test_processes_with_different_configs_stop_in_setup(monkeypatch, other,
                                                        error):
  """A process started with another batch size passed set-up and aborted
  later inside the step with a gloo "collective mismatch"."""
  import ml_collections
  import numpy as np
  from jax.experimental import multihost_utils
  from vit_jax.data import prepare
  from vit_jax.train import loop
  config = ml_collections.ConfigDict({'input': {'batch_size': 64}})
  gathered = []

  def allgather(x):
    gathered.append(np.asarray(x))
    # Process 1's digest: its own unless `other`, then another config's.
    mine = np.asarray(x)
    other_config = ml_collections.ConfigDict({'input': {'batch_size': 32}})
    import hashlib
    theirs = np.frombuffer(hashlib.sha256(other_config.to_json_best_effort(
        sort_keys=True).encode()).digest()[:8], np.int32)
    return np.stack([mine, theirs if other else mine])

  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  monkeypatch.setattr(multihost_utils, 'process_allgather', allgather)
  monkeypatch.setattr(prepare, 'ensure_prepared', _past_the_check)
  if error:
    with pytest.raises(ValueError, match=r"processes' configs differ: "
                       r'process\(es\) \[1\] were started with another '
                       'config than process 0'):
      loop.setup(config, '/nonexistent')
  else:
    with pytest.raises(_PastTheCheck):
      loop.setup(config, '/nonexistent')
  assert len(gathered) == 1 and gathered[0].nbytes == 8


def test_one_process_does_not_compare_configs(monkeypatch):
  import ml_collections
  from jax.experimental import multihost_utils
  from vit_jax.data import prepare
  from vit_jax.train import loop
  monkeypatch.setattr(multihost_utils, 'process_allgather',
                      lambda x: pytest.fail('gathered on one process'))
  monkeypatch.setattr(prepare, 'ensure_prepared', _past_the_check)
  with pytest.raises(_PastTheCheck):
    loop.setup(ml_collections.ConfigDict({'input': {}}), '/nonexistent')
