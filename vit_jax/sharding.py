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

from absl import logging
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
  """A (data, fsdp, model) mesh over all devices; one axis may be -1 (fill).

  Devices are placed by `jax.make_mesh` (the physical torus). With several
  processes, where that placement would put a batch row (a `model` group) on
  more than one process, or cannot place the shape at all (a TPU torus only
  splits into the products of its axes), the devices are placed host by host
  instead (`_host_aware_devices`): every `model` group stays on one host.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(data, fsdp, model, len(devices))
  types = (jax.sharding.AxisType.Auto,) * 3
  try:
    mesh = jax.make_mesh(shape, AXES, axis_types=types, devices=devices)
  except NotImplementedError as e:  # No torus assignment for this shape.
    mesh, error = None, e
  hosts = len({d.process_index for d in devices})
  multi = hosts > 1
  if mesh is not None and (not multi or not _rows_shared(mesh)):
    return mesh
  if multi:
    grid = _host_aware_devices(shape, devices)
    if grid is not None:
      return Mesh(grid, AXES, axis_types=types)
  if mesh is not None:
    return mesh  # Rows across hosts: `check_batch_size` says what to set.
  per_host = len(devices) // hosts
  raise MeshError(
      f'mesh {dict(zip(AXES, shape))} does not fit the devices\' physical '
      f'layout {_physical_shape(devices)} ({len(devices)} devices, '
      f'{per_host} per host): jax could not place it ({error}). Choose axis '
      'sizes that are products of the physical axes, with a model axis that '
      f'divides the devices of one host ({per_host}) (--config.mesh.*)') from None


def _physical_shape(devices) -> str:
  """'4x4x4 (TPU v4)' from the devices' coords, or their count."""
  coords = [getattr(d, 'coords', None) for d in devices]
  if not all(coords):
    return f'{len(devices)} {devices[0].device_kind} devices'
  dims = [max(c[i] for c in coords) - min(c[i] for c in coords) + 1
          for i in range(len(coords[0]))]
  cores = len({getattr(d, 'core_on_chip', 0) for d in devices})
  return ('x'.join(map(str, dims)) + (f' x {cores} cores' if cores > 1 else '')
          + f' ({devices[0].device_kind})')


def _host_aware_devices(shape: Tuple[int, int, int], devices):
  """The device grid of `shape` with each process's devices in whole
  `model` groups (so whole batch rows), or None when no such grid exists
  (the model axis larger than, or not dividing, a host's devices; hosts
  with different device counts).

  Each process is one granule of `create_hybrid_device_mesh`: a
  (data_h, fsdp_h, model) grid of its devices placed by their torus, the
  processes laid out (data / data_h, fsdp / fsdp_h, 1) around them, so the
  model axis never crosses hosts. fsdp_h = gcd(fsdp, local / model) keeps
  as much of fsdp on a host as fits; data_h = local / (model * fsdp_h)
  then divides data. Where the torus cannot place the host's grid, the
  devices are taken in (process, id) order: consecutive `model`-sized runs
  of one host's devices, the same invariant.
  """
  data, fsdp, model = shape
  by_process = {}
  for d in devices:
    by_process.setdefault(d.process_index, []).append(d)
  counts = {len(v) for v in by_process.values()}
  if len(counts) != 1:
    return None
  local = counts.pop()
  if local % model:
    return None
  fsdp_h = math.gcd(fsdp, local // model)
  data_h = local // (model * fsdp_h)
  try:
    from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
    grid = mesh_utils.create_hybrid_device_mesh(
        (data_h, fsdp_h, model), (data // data_h, fsdp // fsdp_h, 1),
        devices, process_is_granule=True)
  except Exception:  # pylint: disable=broad-except
    grid = None  # No torus placement for the host's grid (or no coords).
  if grid is None or _rows_shared_grid(grid):
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.array(ordered, dtype=object).reshape(shape)
  return grid


def _rows_shared_grid(grid) -> list:
  """The process sets of the batch rows (data x fsdp cells) of a
  (data, fsdp, model) device grid that span more than one process."""
  rows = np.asarray(grid).reshape(-1, np.shape(grid)[-1])
  return [p for p in ({d.process_index for d in row} for row in rows)
          if len(p) > 1]


def _rows_shared(mesh: Mesh) -> list:
  return _rows_shared_grid(mesh.devices)  # (data, fsdp, model), as AXES.


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
  return _param_spec(shape, mesh, axes, fsdp_min_size, rules)[0]


def _param_spec(shape, mesh, axes, fsdp_min_size, rules):
  """`param_spec`; the (logical name, dimension size, mesh axis, axis
  size) of each dimension a rule assigned to a mesh axis that does not
  divide it (left replicated); and whether FSDP should have sharded the
  parameter (its size reaches `fsdp_min_size`) but divides none of its
  free dimensions (left whole on every device)."""
  axes = tuple(axes)
  if axes and len(axes) != len(shape):
    raise ValueError(f'logical axes {axes} do not match a parameter of shape '
                     f'{tuple(shape)}: give one name (or None) per dimension')
  names = axes or (None,) * len(shape)
  spec = list(nn.logical_to_mesh_axes(names, rules)) if any(names) else [
      None] * len(shape)
  spec += [None] * (len(shape) - len(spec))
  # An axis only shards a dimension it divides; size-1 axes are dropped.
  undivided = [(names[i], shape[i], s, _size(mesh, s))
               for i, s in enumerate(spec)
               if s and _size(mesh, s) > 1 and shape[i] % _size(mesh, s)]
  spec = [s if s and shape[i] % _size(mesh, s) == 0 and _size(mesh, s) > 1
          else None for i, s in enumerate(spec)]
  n = mesh.shape['fsdp']
  used = {a for s in spec if s for a in (s if isinstance(s, tuple) else (s,))}
  # A rule may already have put 'fsdp' on a dimension (sharding_rules such
  # as ('embed', 'fsdp')): an axis shards one dimension at most.
  whole = False
  if n > 1 and math.prod(shape) >= fsdp_min_size and 'fsdp' not in used:
    free = [i for i, s in enumerate(spec) if s is None and shape[i] % n == 0]
    if free:
      spec[max(free, key=lambda i: (shape[i], -i))] = 'fsdp'
    whole = not free and not any(spec)  # Not on another axis either.
  return P(*spec), undivided, whole


def rule_problems(rules: Any, overrides: Any) -> list:
  """One line per malformed `sharding_rules` / `sharding_overrides` entry
  (config_check runs it before any set-up): rules are (logical axis, mesh
  axis or None) pairs, overrides (parameter path regex, logical axes)
  pairs, each in a sequence of them even when alone."""
  out = []
  def pairs(value, key, example):
    if value is None:
      return []
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 for p in value)
    if not ok:
      out.append(f'--config.{key}={value!r} cannot work; expected a tuple '
                 f'of pairs, e.g. {example} (note the trailing comma of one '
                 'pair)')
      return []
    return value
  for name, axis in pairs(rules, 'sharding_rules', "(('mlp', None),)"):
    axes = axis if isinstance(axis, (list, tuple)) else (axis,)
    if not isinstance(name, str) or any(
        a is not None and a not in AXES for a in axes):
      out.append(f'--config.sharding_rules entry {(name, axis)!r} cannot '
                 'work; expected (logical axis name, one of '
                 f'{", ".join(AXES)} or None)')
  for pattern, names in pairs(overrides, 'sharding_overrides',
                              "(('^head/kernel$', ('embed', None)),)"):
    try:
      re.compile(pattern)
      bad = not isinstance(names, (list, tuple)) or not all(
          n is None or isinstance(n, str) for n in names)
    except (re.error, TypeError):
      bad = True
    if bad:
      out.append(f'--config.sharding_overrides entry {(pattern, names)!r} '
                 'cannot work; expected (parameter path regex, a tuple of '
                 'logical axis names or None, one per dimension)')
  return out


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
  parameters whose '/'-joined path matches (first match wins); an override
  naming a logical axis no rule knows is an error. Dimensions a rule puts
  on a mesh axis that does not divide them stay replicated: one warning
  lists them.
  """
  problems = rule_problems(rules, overrides)
  if problems:
    raise ValueError('; '.join(problems))
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
  flat = traverse_util.flatten_dict(params)
  names = traverse_util.flatten_dict(axes) if axes is not None else {}
  all_rules = tuple(tuple(r) for r in rules) + LOGICAL_RULES
  known = {r[0] for r in all_rules}
  for pattern, override in overrides:
    unknown = [a for a in override if a is not None and a not in known]
    if unknown:
      raise ValueError(
          f'sharding_overrides ({pattern!r}, {tuple(override)}) names logical '
          f'axis {unknown[0]!r}, which no rule knows; the known ones are '
          f'{sorted(known)} (or None: replicated). Fix the name, or add a '
          'rule for it in sharding_rules')
  out, undivided, whole = {}, [], []
  matched, named = set(), set()
  for k, v in flat.items():
    path = '/'.join(k)
    if is_box(v):
      leaf_axes, v = tuple(v.names), v.value
    else:
      leaf_axes = names.get(k, ())
    for pattern, override in overrides:
      if re.search(pattern, path):
        leaf_axes = tuple(override)
        matched.add(pattern)
        break
    named.update(a for a in leaf_axes if a)
    try:
      spec, left, unsharded = _param_spec(np.shape(v), mesh, leaf_axes,
                                          fsdp_min_size, all_rules)
      out[k] = NamedSharding(mesh, spec)
    except Exception as e:  # pylint: disable=broad-except
      # ValueErrors of ours, and jax's DuplicateSpecError (an Exception).
      raise ValueError(f'parameter {path}: {e}') from None
    undivided += [(path, tuple(np.shape(v))) + u for u in left]
    if unsharded:
      whole.append((path, tuple(np.shape(v))))
  # A misspelt path or logical name matches nothing and changes nothing:
  # said, rather than sharding as if it were not there.
  for pattern, _ in overrides:
    if pattern not in matched:
      logging.warning('sharding_overrides: %r matches no parameter path '
                      '(e.g. %s): it changes nothing', pattern,
                      '/'.join(next(iter(flat), ('?',))))
  for name, _ in rules:
    if name not in named:
      logging.warning('sharding_rules: no parameter of this model has the '
                      'logical axis %r (those it has: %s): the rule changes '
                      'nothing', name, ', '.join(sorted(named)))
  if undivided:
    logging.warning(
        '%d parameter dimension(s) a sharding rule puts on a mesh axis that '
        'does not divide them stay replicated (whole on every device): %s. '
        'Choose a mesh axis size that divides them (--config.mesh.*)',
        len(undivided), '; '.join(
            f'{p} {shape} dim {name!r}={n} over {axis!r} of size {size}'
            for p, shape, name, n, axis, size in undivided))
  if whole:
    _warn_fsdp_whole(whole, flat, mesh.shape['fsdp'], fsdp_min_size)
  return traverse_util.unflatten_dict(out)


def _warn_fsdp_whole(whole, flat, n, fsdp_min_size) -> None:
  """One warning for the parameters FSDP left whole on every device: no
  free dimension divides by the fsdp axis size (e.g. `mesh.fsdp=-1` on 5
  or 10 devices), so memory is not what an FSDP run expects."""
  size = lambda v: math.prod(np.shape(getattr(v, 'value', v)))  # pylint: disable=unnecessary-lambda-assignment
  total = sum(size(v) for v in flat.values())
  left = sum(math.prod(shape) for _, shape in whole)
  widths = sorted({d for _, shape in whole for d in shape if d > 1},
                  reverse=True)[:4]
  logging.warning(
      'FSDP: %d parameter(s) of at least fsdp_min_size=%d elements, %.1f%% '
      'of the model, stay whole on every device: the fsdp axis size %d '
      'divides none of their dimensions (e.g. %s %s). Choose an fsdp size '
      'that divides them (their sizes include %s; --config.mesh.fsdp, the '
      'rest on --config.mesh.data)', len(whole), fsdp_min_size,
      100 * left / max(total, 1), n, whole[0][0], whole[0][1],
      ', '.join(map(str, widths)))


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
  shared = _rows_shared(mesh)
  if shared:
    raise MeshError(
        f'processes {sorted(shared[0])} hold the same batch rows: this mesh '
        f'(data x fsdp x model = {mesh.shape["data"]} x {mesh.shape["fsdp"]} '
        f'x {mesh.shape["model"]}) puts the model axis across hosts, and '
        'each process reads its own part of the data. Use a model axis that '
        f'divides the devices of one host ({jax.local_device_count()}) '
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
