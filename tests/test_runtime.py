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
