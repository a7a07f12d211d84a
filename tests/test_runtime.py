"""Process set-up: `jax.distributed` from the flags or from the cluster."""

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

  def initialize(*args):
    made.append(args)
    if not args:  # What JAX raises where it detects no cluster.
      raise ValueError('coordinator_address should be defined.')
  monkeypatch.setattr(jax.distributed, 'initialize', initialize)
  monkeypatch.setattr(jax.config, 'update', lambda *a: None)
  return made


def test_without_flags_jax_detects_the_cluster(calls):
  """A Cloud TPU VM pod sets none of our flags: JAX's own detection (the
  TPU metadata server, Slurm, Open MPI) starts it; with none detected the
  run is one process."""
  with flagsaver.flagsaver(coordinator=None, num_processes=None,
                           process_id=None):
    runtime.init_distributed()
  assert calls == [()]


def test_flags_start_it_explicitly(calls):
  with flagsaver.flagsaver(coordinator='10.0.0.1:1234', num_processes=2,
                           process_id=1):
    runtime.init_distributed()
  assert calls == [('10.0.0.1:1234', 2, 1)]
