"""Mixed-precision matmuls for the dense layers: bf16 in, f32 accumulate.

`dot_general` is a drop-in for `lax.dot_general` (flax's `dot_general=` and
`einsum_dot_general=` hooks). For float32 operands it is `lax.dot_general`.
For bfloat16 operands it multiplies with float32 accumulation and returns
bfloat16, forward and backward (a custom VJP), in the canonical layout
(M, K) x (K, N), with one leading batch axis for batched dots (attention):

  * numerics: every product is accumulated in float32 (what TPUs and GPUs do
    for bf16 matmuls anyway), also in the backward pass, where plain autodiff
    would produce bf16-accumulated or float32 matmuls;
  * speed on CPUs with bf16 dot-product instructions (AVX512-BF16, AMX):
    XLA's CPU backend hands such matmuls to its fast library kernels
    (YNNPACK) only when they are bf16 x bf16 -> f32 with the contracted
    dimension last in the left operand. Otherwise it upcasts both operands to
    float32 first and runs at float32 speed. Measured on the 2-core AVX512-BF16
    machine of docs/performance.md: 700-830 GFLOP/s against 260-400 for the
    alternatives. XLA folds transposes into a dot's dimension numbers, so the
    weight gradient's transposed activation is materialised behind an
    optimisation barrier on the CPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

F32 = jnp.float32
BF16 = jnp.bfloat16
# `checkpoint_name`s of the bf16 products (see `vit_jax.models.remat`).
NAME, BATCHED_NAME = 'bf16_matmul', 'bf16_batched_matmul'


def dot_general(lhs, rhs, dimension_numbers, precision=None,
                preferred_element_type=None, **kwargs):
  """`lax.dot_general`, with float32 accumulation for bf16 x bf16."""
  (lc, rc), (lb, rb) = dimension_numbers
  if (lhs.dtype != BF16 or rhs.dtype != BF16
      or preferred_element_type not in (None, BF16)):
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type,
                           **kwargs)
  lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
  lfree = [i for i in range(lhs.ndim) if i not in lc + lb]
  rfree = [i for i in range(rhs.ndim) if i not in rc + rb]
  k = math.prod(lhs.shape[i] for i in lc)
  batch = [lhs.shape[i] for i in lb]
  a = jnp.transpose(lhs, list(lb) + lfree + list(lc))
  b = jnp.transpose(rhs, list(rb) + list(rc) + rfree)
  # Named so that remat policies can keep them: the custom VJP hides the
  # dot_general primitive that `jax.checkpoint_policies.dots_*` look for.
  if batch:
    out = checkpoint_name(_matmul(a.reshape(math.prod(batch), -1, k),
                                  b.reshape(math.prod(batch), k, -1)),
                          BATCHED_NAME)
  else:
    out = checkpoint_name(_matmul(a.reshape(-1, k), b.reshape(k, -1)),
                          NAME)
  return out.reshape(batch + [lhs.shape[i] for i in lfree] +
                     [rhs.shape[i] for i in rfree])


def _dot(a, b, contract):
  """a x b contracting a's axis `contract[0]` with b's `contract[1]`;
  3-D operands have a leading batch axis."""
  batch = ((0,), (0,)) if a.ndim == 3 else ((), ())
  return lax.dot_general(a, b, (contract, batch),
                         preferred_element_type=F32).astype(BF16)


def _transposed(x):
  """x with its last two axes swapped, materialised in row-major order on
  the CPU (see module doc)."""
  t = jnp.swapaxes(x, -1, -2)
  if jax.default_backend() != 'cpu':
    return t
  return lax.optimization_barrier(t.reshape(-1)).reshape(t.shape)


@jax.custom_vjp
def _matmul(a, b):
  """(..., M, K) x (..., K, N) -> (..., M, N); `...` is one batch axis or none."""
  return _dot(a, b, ((a.ndim - 1,), (b.ndim - 2,)))


def _matmul_fwd(a, b):
  return _matmul(a, b), (a, b)


def _matmul_bwd(res, g):
  a, b = res
  g = g.astype(BF16)
  last = g.ndim - 1
  da = _dot(g, b, ((last,), (last,)))  # (M, N) x (K, N)^T
  db = _dot(_transposed(a), g, ((last,), (last - 1,)))  # (K, M) x (M, N)
  return da, db


_matmul.defvjp(_matmul_fwd, _matmul_bwd)
