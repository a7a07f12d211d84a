"""Device mesh and where every parameter, optimiser slot and batch lives.

The mesh has three axes: `data` (pure data parallelism), `fsdp` (data
parallelism with parameters and optimiser state sharded) and `model` (tensor
parallelism: attention heads, the MLP hidden dimension and convolution output
channels split). The batch is split over (`data`, `fsdp`).

Parameters are placed in two steps:
  1. logical axes: the models annotate their parameters with logical axis
     names (`nn.with_logical_partitioning` on the initialisers, e.g. a query
     kernel (D, heads, head_dim) is ('embed', 'heads', 'kv'), a convolution
     kernel (kh, kw, in, out) is (None, None, 'conv_in', 'conv_out'));
     `logical_axes(model, image_shape)` reads them from an abstract init.
     `LOGICAL_RULES` map 'heads', 'mlp' and 'conv_out' to the `model` mesh
     axis and everything else to None (replicated). A config can add rules
     (`sharding_rules`, which take precedence) and replace the names of
     parameters by path (`sharding_overrides`: (path regex, names) pairs);
  2. FSDP: for tensors of at least `fsdp_min_size` elements, the largest
     dimension not already sharded that divides by the `fsdp` axis size is
     sharded over `fsdp`.
Optimiser state mirrors the parameters it belongs to. `model.init` returns
plain arrays (`vit_jax.models.Module`); only this file sees the annotations.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ('data', 'fsdp', 'model')
BATCH = ('data', 'fsdp')

# Logical parameter axis -> mesh axis (flax rule pairs, first match wins).
# Unlisted logical axes are replicated.
LOGICAL_RULES: Tuple[Tuple[str, Optional[str]], ...] = (
    ('heads', 'model'),
    ('mlp', 'model'),
    ('conv_out', 'model'),
    ('embed', None),
    ('kv', None),
    ('classes', None),
    ('conv_in', None),
    ('layers', None),
)

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

Names = Tuple[Optional[str], ...]


class MeshError(ValueError):
  """A mesh or batch size the devices cannot take (the message says why
  and what to set)."""


def make_mesh(data: int = -1, fsdp: int = 1, model: int = 1,
              devices: Optional[Sequence[Any]] = None) -> Mesh:
  """A (data, fsdp, model) mesh over all devices; one axis may be -1 (fill)."""
  devices = list(jax.devices() if devices is None else devices)
  return jax.make_mesh(mesh_shape(data, fsdp, model, len(devices)), AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=devices)


def platform(mesh: Mesh) -> str:
  """The platform of the mesh's devices ("cpu", "gpu", "tpu"): where its
  programs run, whatever host traces them."""
  return mesh.devices.flat[0].platform


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
    raise MeshError(f'mesh {dict(zip(AXES, shape))}: at most one axis may '
                    'be -1 (fill the devices left); mesh.data is -1 unless '
                    'set: e.g. --config.mesh.data=1 --config.mesh.fsdp=-1')
  if any(s == 0 or s < -1 for s in shape):
    raise MeshError(f'mesh {dict(zip(AXES, shape))}: sizes must be >= 1 or '
                     '-1 (fill)')
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise MeshError(
          f'mesh {dict(zip(AXES, shape))}: {num_devices} devices do not '
          f'divide by {known}; choose axis sizes whose product divides '
          f'{num_devices}')
    shape[shape.index(-1)] = num_devices // known
  if math.prod(shape) != num_devices:
    raise MeshError(
        f'mesh {dict(zip(AXES, shape))} needs {math.prod(shape)} devices, '
        f'{num_devices} are available; set one axis to -1 to fill')
  return tuple(shape)


def abstract_params(model: nn.Module, image_shape: Sequence[int]):
  """The model's parameters as ShapeDtypeStructs, each in the
  `nn.LogicallyPartitioned` box its annotation made (no compute, no memory).

  `nn.Module.init` is the flax one: it keeps the boxes that
  `vit_jax.models.Module.init` strips.
  """
  images = jax.ShapeDtypeStruct((1, *image_shape), jnp.float32)
  init = lambda x: nn.Module.init(model, jax.random.key(0), x, train=False)
  return jax.eval_shape(init, images)['params']


def logical_axes(model: nn.Module, image_shape: Sequence[int]):
  """The logical axis names of every parameter (a tree of tuples; () for a
  parameter without annotation)."""
  return axes_of(abstract_params(model, image_shape))


def axes_of(boxed_params):
  """`logical_axes` of parameters `abstract_params` gave."""
  specs = nn.get_partition_spec(boxed_params)
  return jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, P))


def _size(mesh: Mesh, axis) -> int:
  axes = axis if isinstance(axis, tuple) else (axis,)
  unknown = [a for a in axes if a not in mesh.shape]
  if unknown:
    raise ValueError(f'sharding rule names mesh axis {unknown[0]!r}; the mesh '
                     f'has {tuple(mesh.shape)}: fix sharding_rules')
  return math.prod(mesh.shape[a] for a in axes)


def param_spec(shape: Sequence[int], mesh: Mesh, axes: Names = (),
               fsdp_min_size: int = 2**18,
               rules: Sequence[Tuple[str, Any]] = LOGICAL_RULES) -> P:
  """The PartitionSpec of one parameter from its logical `axes` (rules, then
  FSDP)."""
  axes = tuple(axes)
  if axes and len(axes) != len(shape):
    raise ValueError(f'logical axes {axes} do not match a parameter of shape '
                     f'{tuple(shape)}: give one name (or None) per dimension')
  names = axes or (None,) * len(shape)
  spec = list(nn.logical_to_mesh_axes(names, rules)) if any(names) else [
      None] * len(shape)
  spec += [None] * (len(shape) - len(spec))
  # An axis only shards a dimension it divides; size-1 axes are dropped.
  spec = [s if s and shape[i] % _size(mesh, s) == 0 and _size(mesh, s) > 1
          else None for i, s in enumerate(spec)]
  n = mesh.shape['fsdp']
  used = {a for s in spec if s for a in (s if isinstance(s, tuple) else (s,))}
  # A rule may already have put 'fsdp' on a dimension (sharding_rules such
  # as ('embed', 'fsdp')): an axis shards one dimension at most.
  if n > 1 and math.prod(shape) >= fsdp_min_size and 'fsdp' not in used:
    free = [i for i, s in enumerate(spec) if s is None and shape[i] % n == 0]
    if free:
      spec[max(free, key=lambda i: (shape[i], -i))] = 'fsdp'
  return P(*spec)


def param_shardings(params: Any, mesh: Mesh, fsdp_min_size: int = 2**18, *,
                    axes: Any = None, rules: Sequence[Tuple[str, Any]] = (),
                    overrides: Sequence[Tuple[str, Names]] = ()):
  """A NamedSharding for every leaf of a (possibly abstract) params tree.

  The logical names come from `axes` (a tree like `logical_axes(model,
  image_shape)`), or from the leaves themselves when `params` holds
  `nn.LogicallyPartitioned` boxes (`abstract_params`); without either every
  parameter is unannotated (replicated, FSDP aside). `rules` are extra
  (logical, mesh axis) pairs taking precedence over `LOGICAL_RULES`;
  `overrides` are (path regex, names) pairs replacing the names of the
  parameters whose '/'-joined path matches (first match wins).
  """
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
  flat = traverse_util.flatten_dict(params)
  names = traverse_util.flatten_dict(axes) if axes is not None else {}
  all_rules = tuple(tuple(r) for r in rules) + LOGICAL_RULES
  out = {}
  for k, v in flat.items():
    path = '/'.join(k)
    if is_box(v):
      leaf_axes, v = tuple(v.names), v.value
    else:
      leaf_axes = names.get(k, ())
    for pattern, override in overrides:
      if re.search(pattern, path):
        leaf_axes = tuple(override)
        break
    try:
      spec = param_spec(np.shape(v), mesh, leaf_axes, fsdp_min_size,
                        all_rules)
      out[k] = NamedSharding(mesh, spec)
    except Exception as e:  # pylint: disable=broad-except
      # ValueErrors of ours, and jax's DuplicateSpecError (an Exception).
      raise ValueError(f'parameter {path}: {e}') from None
  return traverse_util.unflatten_dict(out)


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


def _check_rows_per_process(mesh: Mesh) -> None:
  """Each process feeds the rows its devices hold (`global_batch`), from
  its own part of the data: a mesh on which two processes hold the same
  rows (the `model` axis spanning hosts) would give those rows different
  examples on each, silently. An abstract mesh (no devices: a launcher's
  plan) is checked by its caller, which knows the hosts."""
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return
  devices = np.asarray(mesh.devices).reshape(
      mesh.shape['data'] * mesh.shape['fsdp'], -1)  # Rows x model.
  shared = [p for p in ({d.process_index for d in row} for row in devices)
            if len(p) > 1]
  if shared:
    raise MeshError(
        f'processes {sorted(shared[0])} hold the same batch rows: this mesh '
        f'(data x fsdp x model = {mesh.shape["data"]} x {mesh.shape["fsdp"]} '
        f'x {mesh.shape["model"]}) puts the model axis across hosts, and '
        'each process reads its own part of the data. Use a model axis no '
        f'larger than the devices of one host ({jax.local_device_count()}) '
        '(e.g. --config.mesh.model), or shard parameters with fsdp instead')


def check_batch_size(batch_size: int, mesh: Mesh, what: str = 'batch_size',
                     accum_steps: int = 1) -> None:
  """A clear error when the global batch cannot be split evenly, or when
  processes would share batch rows."""
  _check_rows_per_process(mesh)
  n = batch_divisor(mesh)
  if batch_size % (n * accum_steps):
    raise MeshError(
        f'{what}={batch_size} is not divisible by the {n} devices it is split '
        f'over (mesh data x fsdp = {mesh.shape["data"]} x '
        f'{mesh.shape["fsdp"]}){f" times accum_steps={accum_steps}" if accum_steps > 1 else ""}: '
        f'use a multiple of {n * accum_steps}, e.g. '
        f'{max(1, batch_size // (n * accum_steps)) * n * accum_steps}')
