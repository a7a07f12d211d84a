"""`--format=stablehlo`: a `jax.export` serialisation, for JAX serving.

Writes `model.jax_exported` (`jax.export.Exported.serialize()`: StableHLO
with the weights as constants, lowered for cpu, cuda and tpu) and
`model.mlir` (the program as text, weights as arguments, to read). Any JAX (of a compatible
serialisation version) runs it without vit_jax:

    exp = jax.export.deserialize(bytearray(open('model.jax_exported', 'rb').read()))
    logits = exp.call(images)        # float32 [B, S, S, C], export.json's range
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.export.registry import Format, register
from vit_jax.models import precast

FILE = 'model.jax_exported'
PLATFORMS = ('cpu', 'cuda', 'tpu')
# The serialisation is one flatbuffer: it cannot exceed 2 GiB.
MAX_BYTES = 2**31 - 2**26


def _baked(trained, dtype: str):
  """(fn, the parameters baked into the program): in a narrower dtype,
  each leaf the forward pass only uses narrowed is stored so
  (`vit_jax.models.precast`: the same logits, half the bytes in bf16)."""
  fn = trained.apply_fn(dtype)
  params = trained.params
  if jnp.dtype(dtype) != jnp.float32:
    one = jax.ShapeDtypeStruct((1, *trained.image_shape), jnp.float32)
    params = precast.cast_once(fn, params, one)
  return fn, params


def _bytes(params) -> int:
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))


def export(trained, out: str, options):
  fn, params = _baked(trained, options.dtype)
  size = _bytes(params)
  if size > MAX_BYTES:
    hint = ''
    if jnp.dtype(options.dtype) == jnp.float32:
      half = _bytes(_baked(trained, 'bfloat16')[1])
      if half <= MAX_BYTES:
        hint = (f', or --dtype=bfloat16 (which stores {half / 2**30:.1f} GiB '
                'of them in bfloat16)')
    raise ValueError(
        f'{trained.architecture} has {size / 2**30:.1f} GiB of weights in '
        f'{options.dtype}: a jax.export serialisation holds at most 2 GiB. '
        f'Use --format=savedmodel (weights as variables){hint}')
  batch = (jax.export.symbolic_shape('batch')[0] if options.batch is None
           else options.batch)
  spec = jax.ShapeDtypeStruct((batch, *trained.image_shape), jnp.float32)
  exported = jax.export.export(jax.jit(lambda images: fn(params, images)),
                               platforms=PLATFORMS)(spec)
  data = exported.serialize()
  with open(os.path.join(out, FILE), 'wb') as f:
    f.write(data)
  # To read: the same program with the weights as arguments (the module
  # above prints them as megabytes of hex).
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
      params)
  readable = jax.export.export(jax.jit(fn), platforms=PLATFORMS)(abstract,
                                                                 spec)
  with open(os.path.join(out, 'model.mlir'), 'w') as f:
    f.write(readable.mlir_module())
  return {'files': [FILE, 'model.mlir'], 'platforms': list(PLATFORMS),
          'calling_convention_version':
              exported.calling_convention_version}


@functools.lru_cache(maxsize=2)
def _load(path: str, stamp: float):
  del stamp  # Part of the cache key: a new export is read anew.
  with open(path, 'rb') as f:
    return jax.export.deserialize(bytearray(f.read()))


def run(out: str, images: np.ndarray) -> np.ndarray:
  path = os.path.join(out, FILE)
  return np.asarray(_load(path, os.path.getmtime(path)).call(images))


register(Format(
    name='stablehlo', export=export, run=run, requires=(),
    no_preprocessing='image decoding is no StableHLO op',
    description='jax.export serialisation (StableHLO, weights inside); '
    'jax.export.deserialize(...).call(images)'))
