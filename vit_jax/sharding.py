"""Device mesh and where every parameter, optimiser slot and batch lives.

The mesh has three axes: `data` (pure data parallelism), `fsdp` (data
parallelism with parameters and optimiser state sharded) and `model` (tensor
parallelism: attention heads and the MLP hidden dimension split). The batch
is split over (`data`, `fsdp`).

Parameters are placed in two steps, both from the parameter's path and shape:
  1. logical axes (`param_logical_axes`): e.g. a query kernel (D, heads,
     head_dim) is ('embed', 'heads', 'kv'); the rules map 'heads' and 'mlp'
     to the `model` mesh axis and everything else to None (replicated);
  2. FSDP: for tensors of at least `fsdp_min_size` elements, the largest
     dimension not already sharded that divides by the `fsdp` axis size is
     sharded over `fsdp`.
Optimiser state mirrors the parameters it belongs to.
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, Optional, Sequence, Tuple

import jax
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ('data', 'fsdp', 'model')
BATCH = ('data', 'fsdp')

# Logical axis -> mesh axis. Unlisted logical axes are replicated.
LOGICAL_RULES: Dict[str, Optional[str]] = {
    'heads': 'model',
    'mlp': 'model',
    'embed': None,
    'kv': None,
    'classes': None,
}

# Logical activation axes (`nn.with_logical_constraint` in the models) ->
# mesh axes, active inside the train and eval steps.
ACTIVATION_RULES = (
    ('batch', BATCH),
    ('length', None),
    ('embed', None),
    ('mlp', 'model'),
    ('heads', 'model'),
    ('kv', None),
)

# (path regex, logical axes) for every parameter; the first match wins.
# Paths are module names joined by '/', e.g.
# 'Transformer/encoderblock_3/MultiHeadDotProductAttention_0/query/kernel'.
PARAM_AXES: Sequence[Tuple[str, Tuple[Optional[str], ...]]] = (
    (r'MultiHeadDotProductAttention_\d+/(query|key|value)/kernel$',
     ('embed', 'heads', 'kv')),
    (r'MultiHeadDotProductAttention_\d+/(query|key|value)/bias$',
     ('heads', 'kv')),
    (r'MultiHeadDotProductAttention_\d+/out/kernel$', ('heads', 'kv', 'embed')),
    (r'MlpBlock_\d+/Dense_0/kernel$', ('embed', 'mlp')),
    (r'MlpBlock_\d+/Dense_0/bias$', ('mlp',)),
    (r'MlpBlock_\d+/Dense_1/kernel$', ('mlp', 'embed')),
    (r'^head/kernel$', ('embed', 'classes')),
)


def make_mesh(data: int = -1, fsdp: int = 1, model: int = 1,
              devices: Optional[Sequence[Any]] = None) -> Mesh:
  """A (data, fsdp, model) mesh over all devices; one axis may be -1 (fill)."""
  devices = list(jax.devices() if devices is None else devices)
  return jax.make_mesh(mesh_shape(data, fsdp, model, len(devices)), AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=devices)


def abstract_mesh(num_devices: int, data: int = -1, fsdp: int = 1,
                  model: int = 1) -> jax.sharding.AbstractMesh:
  """The mesh `make_mesh` would build on `num_devices` devices, without
  them (e.g. to check batch sizes before a TPU slice exists)."""
  return jax.sharding.AbstractMesh(
      mesh_shape(data, fsdp, model, num_devices), AXES)


def mesh_shape(data: int, fsdp: int, model: int,
               num_devices: int) -> Tuple[int, int, int]:
  """(data, fsdp, model) sizes over `num_devices`, the -1 axis filled."""
  shape = [data, fsdp, model]
  if shape.count(-1) > 1:
    raise ValueError(f'mesh {dict(zip(AXES, shape))}: at most one axis may '
                     'be -1')
  if any(s == 0 or s < -1 for s in shape):
    raise ValueError(f'mesh {dict(zip(AXES, shape))}: sizes must be >= 1 or '
                     '-1 (fill)')
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ValueError(
          f'mesh {dict(zip(AXES, shape))}: {num_devices} devices do not '
          f'divide by {known}; choose axis sizes whose product divides '
          f'{num_devices}')
    shape[shape.index(-1)] = num_devices // known
  if math.prod(shape) != num_devices:
    raise ValueError(
        f'mesh {dict(zip(AXES, shape))} needs {math.prod(shape)} devices, '
        f'{num_devices} are available; set one axis to -1 to fill')
  return tuple(shape)


def param_logical_axes(path: str, ndim: int) -> Tuple[Optional[str], ...]:
  for pattern, axes in PARAM_AXES:
    if re.search(pattern, path) and len(axes) == ndim:
      return axes
  return (None,) * ndim


def param_spec(path: str, shape: Sequence[int], mesh: Mesh,
               fsdp_min_size: int = 2**18) -> P:
  """The PartitionSpec of one parameter (logical rules, then FSDP)."""
  spec = [LOGICAL_RULES.get(a) if a else None
          for a in param_logical_axes(path, len(shape))]
  # An axis only shards a dimension it divides.
  spec = [s if s and shape[i] % mesh.shape[s] == 0 else None
          for i, s in enumerate(spec)]
  spec = [None if s and mesh.shape[s] == 1 else s for s in spec]
  n = mesh.shape['fsdp']
  if n > 1 and math.prod(shape) >= fsdp_min_size:
    free = [i for i, s in enumerate(spec) if s is None and shape[i] % n == 0]
    if free:
      spec[max(free, key=lambda i: (shape[i], -i))] = 'fsdp'
  return P(*spec)


def param_shardings(params: Any, mesh: Mesh, fsdp_min_size: int = 2**18):
  """A NamedSharding for every leaf of a (possibly abstract) params tree."""
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict({
      k: NamedSharding(mesh, param_spec('/'.join(k), np.shape(v), mesh,
                                        fsdp_min_size))
      for k, v in flat.items()})


def batch_sharding(mesh: Mesh, ndim: int = 4) -> NamedSharding:
  """Leading (batch) dimension over (data, fsdp); the rest replicated."""
  return NamedSharding(mesh, P(BATCH, *([None] * (ndim - 1))))


def global_batch(batch, mesh: Mesh):
  """Process-local numpy batch -> global arrays split over (data, fsdp)."""
  return {k: jax.make_array_from_process_local_data(
      batch_sharding(mesh, v.ndim), v) for k, v in batch.items()}


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_divisor(mesh: Mesh) -> int:
  """Devices the batch is split over."""
  return mesh.shape['data'] * mesh.shape['fsdp']


def check_batch_size(batch_size: int, mesh: Mesh, what: str = 'batch_size',
                     accum_steps: int = 1) -> None:
  """A clear error when the global batch cannot be split evenly."""
  n = batch_divisor(mesh)
  if batch_size % (n * accum_steps):
    raise ValueError(
        f'{what}={batch_size} is not divisible by the {n} devices it is split '
        f'over (mesh data x fsdp = {mesh.shape["data"]} x '
        f'{mesh.shape["fsdp"]}){f" times accum_steps={accum_steps}" if accum_steps > 1 else ""}: '
        f'use a multiple of {n * accum_steps}, e.g. '
        f'{max(1, batch_size // (n * accum_steps)) * n * accum_steps}')
