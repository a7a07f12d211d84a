"""TPU slice names -> chips, TensorCores, JAX devices, hosts, cost estimate.

    python -m launch.topology v4-32
    python -m launch.topology v5litepod-16 --config=configs/pretrain.py:model=ViT-B/16,data=i21k

Naming (Cloud TPU accelerator types): for v2, v3, v4 and v5p the number
counts TensorCores (two per chip); for v5e (`v5litepod-N`) and v6e (`v6e-N`)
it counts chips (one core each). JAX sees one device per core on v2/v3 and
one per chip from v4 on (the two cores of a v4/v5p chip form a megacore).
Hosts hold 4 chips, except single-host v5e/v6e slices of up to 8 chips.
"""

from __future__ import annotations

import dataclasses
import re

from vit_jax import accounting

# generation -> (hardware table name, name counts cores?, cores per chip,
#                JAX devices per chip, chips per host, largest 1-host slice)
_GENERATIONS = {
    'v2': ('tpu_v2', True, 2, 2, 4, 4),
    'v3': ('tpu_v3', True, 2, 2, 4, 4),
    'v4': ('tpu_v4', True, 2, 1, 4, 4),
    'v5p': ('tpu_v5p', True, 2, 1, 4, 4),
    'v5litepod': ('tpu_v5e', False, 1, 1, 4, 8),
    'v6e': ('tpu_v6e', False, 1, 1, 4, 8),
}
_NAME = re.compile(r'^(v2|v3|v4|v5p|v5litepod|v6e)-(\d+)$')
# The slice sizes (the name's number) Cloud TPU offers: listed, or for v4
# and v5p any multiple of 8 TensorCores (a host's 4 chips; 3-D shapes).
_SIZES = {
    'v2': (8, 32, 128, 256, 512),
    'v3': (8, 32, 64, 128, 256, 512, 1024, 2048),
    'v5litepod': (1, 4, 8, 16, 32, 64, 128, 256),
    'v6e': (1, 4, 8, 16, 32, 64, 128, 256),
}
_MULTIPLE = {'v4': 8, 'v5p': 8}


@dataclasses.dataclass(frozen=True)
class Topology:
  name: str
  hardware: str  # Key of vit_jax.accounting.HARDWARE.
  chips: int
  cores: int
  devices: int  # JAX devices (jax.device_count() on the slice).
  hosts: int  # Workers (jax.process_count()).

  @property
  def devices_per_host(self) -> int:
    return self.devices // self.hosts


def parse(name: str) -> Topology:
  """`v3-32` -> Topology(chips=16, cores=32, devices=32, hosts=4, ...)."""
  m = _NAME.match(name.strip().lower())
  if not m:
    raise ValueError(
        f'unknown TPU topology {name!r}: expected e.g. v3-8, v3-32, v4-32, '
        f'v5p-16, v5litepod-16 or v6e-8 (generations: {", ".join(_GENERATIONS)})')
  gen, n = m.group(1), int(m.group(2))
  hw, counts_cores, cores_per_chip, dev_per_chip, per_host, single = (
      _GENERATIONS[gen])
  chips, rest = divmod(n, cores_per_chip) if counts_cores else (n, 0)
  if rest or chips < 1:
    raise ValueError(f'{name}: {gen} slices count TensorCores, two per chip; '
                     'use an even number')
  if gen in _SIZES and n not in _SIZES[gen]:
    raise ValueError(f'{name}: Cloud TPU has no such {gen} slice; sizes: '
                     + ', '.join(f'{gen}-{k}' for k in _SIZES[gen]))
  if gen in _MULTIPLE and n % _MULTIPLE[gen]:
    raise ValueError(f'{name}: {gen} slices have a multiple of '
                     f'{_MULTIPLE[gen]} TensorCores (4 chips per host), e.g. '
                     f'{gen}-8, {gen}-16, {gen}-32')
  hosts = 1 if chips <= single else -(-chips // per_host)
  if chips > single and chips % per_host:
    raise ValueError(f'{name}: multi-host {gen} slices have a multiple of '
                     f'{per_host} chips')
  return Topology(name, hw, chips, chips * cores_per_chip,
                  chips * dev_per_chip, hosts)


def estimate(config, topology: Topology, utilization=None):
  """The accounting estimate of a training config on this slice."""
  return accounting.estimate_for_config(
      config, hardware_name=topology.hardware, num_devices=topology.devices,
      utilization=utilization)


def _main(argv):
  from absl import flags
  f = flags.FLAGS
  if len(argv) != 2:
    raise SystemExit('usage: python -m launch.topology TOPOLOGY '
                     '[--config=SPEC] [--utilization=U]')
  try:
    topo = parse(argv[1])
  except ValueError as e:
    raise SystemExit(f'launch.topology: {e}') from None
  print(f'{topo.name}: {topo.chips} chips, {topo.cores} TensorCores, '
        f'{topo.devices} JAX devices on {topo.hosts} host(s) '
        f'({topo.devices_per_host} per host), {topo.hardware}')
  if f.config is not None:
    try:
      est = estimate(f.config, topo, f.utilization)
    except ValueError as e:  # A model, dataset or length the config names.
      raise SystemExit(f'launch.topology: {e}') from None
    print('\n'.join(est.lines()))


if __name__ == '__main__':
  import sys
  from absl import app, flags
  from ml_collections import config_flags
  from vit_jax.configs import common
  config_flags.DEFINE_config_file('config', None, 'Config to estimate.')
  flags.DEFINE_float('utilization', None, 'Share of bf16 peak (default: '
                     'the paper-implied TPUv3 utilisation).')
  try:  # configs/... from any directory, checked as vit_jax.main does.
    argv = common.check_command_line(sys.argv)
  except common.ConfigSpecError as e:
    raise SystemExit(f'launch.topology: {e}') from None
  app.run(_main, argv=argv)
