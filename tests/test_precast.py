"""Serving parameters cast once: the same logits, the bf16 weights stored
in bf16, anything used in float32 left alone."""

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax import models
from vit_jax.models import precast


def _model_and_params(dtype, **options):
  model = models.create('ViT-test', num_classes=10, dtype=dtype, **options)
  images = jax.random.uniform(jax.random.key(1), (2, 28, 28, 3),
                              minval=-1, maxval=1)
  params = jax.jit(lambda k, x: model.init(k, x, train=False))(
      jax.random.key(0), images)['params']
  fn = jax.jit(lambda p, x: model.apply({'params': p}, x, train=False))
  return fn, params, images


def test_bf16_forward_is_bitwise_the_same_with_weights_cast_once():
  fn, params, images = _model_and_params(jnp.bfloat16)
  served = precast.cast_once(fn, params, images)
  dtypes = {jax.tree_util.keystr(k): v.dtype for k, v in
            jax.tree_util.tree_flatten_with_path(served)[0]}
  block = "['Transformer']['encoderblock_0']"
  # Every matmul weight is stored in bf16, the MLP's second Dense too (it
  # is used inside the recomputing custom VJP)...
  for name in ("['MlpBlock_0']['Dense_0']['kernel']",
               "['MlpBlock_0']['Dense_1']['kernel']",
               "['MultiHeadDotProductAttention_0']['query']['kernel']"):
    assert dtypes[block + name] == jnp.bfloat16, name
  assert dtypes["['embedding']['kernel']"] == jnp.bfloat16
  # ... LayerNorm's parameters, applied in float32, stay float32.
  assert dtypes[block + "['LayerNorm_0']['scale']"] == jnp.float32
  saved = sum(x.nbytes for x in jax.tree.leaves(params)) - sum(
      x.nbytes for x in jax.tree.leaves(served))
  assert saved > 0.4 * sum(x.nbytes for x in jax.tree.leaves(params))
  np.testing.assert_array_equal(np.asarray(fn(served, images), np.float32),
                                np.asarray(fn(params, images), np.float32))


def test_float32_model_keeps_float32_parameters():
  fn, params, images = _model_and_params(jnp.float32)
  served = precast.cast_once(fn, params, images)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(served))


def test_a_leaf_used_in_float32_anywhere_is_kept():
  def fn(p, x):
    w = p['w'].astype(jnp.bfloat16)
    both = (x.astype(jnp.bfloat16) @ w).astype(jnp.float32) + p['b'].sum()
    return both + (p['b'].astype(jnp.bfloat16).sum()
                   + jax.jit(lambda v: v.astype(jnp.bfloat16))(p['v']).sum())
  params = {'w': jnp.ones((3, 4)), 'b': jnp.ones((4,)), 'v': jnp.ones((2,))}
  dtypes = precast.served_dtypes(fn, params, jnp.ones((2, 3)))
  assert dtypes == {'w': jnp.bfloat16, 'b': jnp.float32, 'v': jnp.bfloat16}


def test_scanned_remat_layers_are_cast_too():
  """Stacked layers (`scan_layers`) under remat: the scan and checkpoint
  sub-programs are followed, and the logits stay bitwise the same."""
  fn, params, images = _model_and_params(jnp.bfloat16, scan_layers=True,
                                         remat='nothing_saveable')
  served = precast.cast_once(fn, params, images)
  nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
  assert nbytes(served) < 0.6 * nbytes(params)
  np.testing.assert_array_equal(np.asarray(fn(served, images), np.float32),
                                np.asarray(fn(params, images), np.float32))
