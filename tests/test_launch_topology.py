"""TPU slice names: chips, cores, JAX devices, hosts; estimates per slice."""

import subprocess
import sys

import pytest

from vit_jax.launch import topology


@pytest.mark.parametrize('name,chips,cores,devices,hosts', [
    ('v3-8', 4, 8, 8, 1),
    ('v3-32', 16, 32, 32, 4),
    ('v4-32', 16, 32, 16, 4),
    ('v5p-16', 8, 16, 8, 2),
    ('v5litepod-8', 8, 8, 8, 1),
    ('v5litepod-16', 16, 16, 16, 4),
    ('v6e-8', 8, 8, 8, 1),
])
def test_parse(name, chips, cores, devices, hosts):
  t = topology.parse(name)
  assert (t.chips, t.cores, t.devices, t.hosts) == (chips, cores, devices,
                                                    hosts)


def test_bad_names():
  with pytest.raises(ValueError, match="unknown TPU topology 'v9-8'"):
    topology.parse('v9-8')
  with pytest.raises(ValueError, match='even number'):
    topology.parse('v3-9')
  # Names Cloud TPU does not offer: refused here, not by gcloud at create.
  for bad, hint in (('v3-16', 'v3-8, v3-32'), ('v2-16', 'v2-8, v2-32'),
                    ('v5litepod-2', 'v5litepod-1, v5litepod-4'),
                    ('v5litepod-12', 'v5litepod-16'), ('v6e-2', 'v6e-4'),
                    ('v4-4', 'multiple of 8'), ('v5p-12', 'multiple of 8')):
    with pytest.raises(ValueError, match=hint):
      topology.parse(bad)


def test_estimate_core_days_do_not_depend_on_the_slice_size():
  from vit_jax.configs import pretrain
  c = pretrain.get_config('model=ViT-B/16,data=i1k')
  small = topology.estimate(c, topology.parse('v3-8'))
  big = topology.estimate(c, topology.parse('v3-32'))
  assert small.core_days == pytest.approx(big.core_days)
  assert small.wall_hours == pytest.approx(4 * big.wall_hours)
  # v4-32: 16 devices of 2 cores each.
  v4 = topology.estimate(c, topology.parse('v4-32'))
  assert v4.wall_hours == pytest.approx(v4.core_days * 24 / 32)


def test_cli():
  out = subprocess.run(
      [sys.executable, '-m', 'launch.topology', 'v4-32',
       '--config=configs/pretrain.py:model=ViT-B/16,data=i21k'],
      capture_output=True, text=True, check=True).stdout
  assert '16 chips, 32 TensorCores, 16 JAX devices on 4 host(s)' in out
  assert 'core-days' in out and 'on 16 devices' in out
