"""Recompute a function's internals in the backward pass, after its cotangent.

`recompute(fn)` is `fn` with a custom VJP: the forward pass keeps only
`fn`'s inputs; the backward pass runs `jax.vjp(fn, ...)` on them again.
This is `jax.checkpoint(fn)`'s memory trade, made so that no XLA backend can
undo it. `jax.checkpoint` keeps its recomputation apart from the forward
pass with optimisation barriers. XLA's CPU pipeline removes those barriers
before scheduling. Its scheduler then runs the recomputation in the forward
pass, beside the original, and keeps the results alive until the backward
pass. For ViT-B/16 fp32 at batch 8 that was 0.5 GiB of
(heads, tokens, tokens) softmax copies.

Here the recomputation's inputs are tied to the incoming cotangent: each
floating input `a` becomes `a + 0 * g[0]`. That sum is exactly `a` for any
finite cotangent (XLA never folds `x * 0` for floats, because `inf * 0` is
NaN). No schedule can therefore run the recomputation before the backward
pass reaches it. It also can never be merged with the forward pass's
identical ops. A NaN or infinite cotangent makes the gradient NaN, which it
would be anyway.

Callers: the encoder's LayerNorm, XLA attention and the MLP's GELU +
second Dense (`recompute_internals`, `vit_jax.models.vit`).

A custom VJP cannot be differentiated in forward mode (`jax.jvp`,
`jax.jacfwd`, `jax.linearize`, forward-over-reverse Hessian-vector
products). `plain_autodiff` names the configuration whose models trace
none: float32 without `recompute_internals`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def plain_autodiff(dtype, recompute_internals: bool) -> bool:
  """Whether a ViT of compute `dtype` (None: float32) is written in plain
  differentiable ops only, with no custom VJP anywhere (not even in a
  platform branch that lowering drops), so that forward-mode autodiff works:
  float32 with `recompute_internals=False`. Its backward pass is then
  autodiff's own: the same values, but on CPUs without the layouts of the
  custom backward passes (`matmul.plain_dot_general`, `attention._cpu_core`).
  Half precision keeps its float32-accumulating custom VJPs (bias gradients,
  matmuls), and `recompute_internals` is one by construction.

  The one rule of every layer (MLP, attention, head): each passes its
  configured `dtype` field, which a model hands to all of them alike, never
  an input's dtype, so that no two layers of a model decide differently.
  None is flax's "promote the inputs with the parameters", float32 with the
  float32 parameters a model keeps by default."""
  return not recompute_internals and jnp.dtype(
      dtype or jnp.float32) == jnp.float32


def _is_float(x) -> bool:
  return hasattr(x, 'dtype') and jnp.issubdtype(x.dtype, jnp.inexact)


def tie(args, cotangent):
  """`args` with every floating leaf made to depend on `cotangent`, values
  unchanged."""
  leaves = [g for g in jax.tree.leaves(cotangent) if _is_float(g)]
  if not leaves:
    return args
  g = leaves[0]
  zero = jnp.reshape(g, (-1,))[0] * 0
  return jax.tree.map(
      lambda a: a + zero.astype(a.dtype) if _is_float(a) else a, args)


def recompute(fn: Callable) -> Callable:
  """`fn(*args)` whose backward pass recomputes `fn` from `args` once the
  cotangent has arrived, instead of keeping `fn`'s intermediate values.
  `args` are arrays or pytrees of them (None allowed); same values and
  gradients as `fn`."""

  @jax.custom_vjp
  def wrapped(*args):
    return fn(*args)

  def fwd(*args):
    return fn(*args), args

  def bwd(args, cotangent):
    _, vjp = jax.vjp(fn, *tie(args, cotangent))
    return vjp(cotangent)

  wrapped.defvjp(fwd, bwd)
  return wrapped
