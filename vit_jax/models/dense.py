"""Dense layers with a float32 bias gradient: flax's `nn.Dense` /
`nn.DenseGeneral` parameters, applied by our own function.

`Dense` creates exactly the parameters flax's `DenseGeneral` would under the
same name (`kernel` of shape in_shape + features, `bias` of shape features,
the initialisers applied to the flattened 2-D / 1-D shapes, the same
random keys), so checkpoints and converters see no difference. It applies
them with `apply`: the kernel product through the project's mixed-precision
`matmul.dot_general`, then `add_bias`.

Why not flax's own: flax adds a bf16 bias (cast from the float32 parameter)
to the bf16 product, so autodiff sums the bias gradient over batch x tokens
in bf16. XLA:CPU runs such bf16 reductions as slow loops (ViT-B/16 batch 8:
~18 ms for one MLP bias, against 1.5 ms for the same sum in float32, ~0.4 s
of a 3.6 s bf16 train step, docs/performance.md) and bf16 accumulation over
thousands of terms loses precision. `add_bias` computes the same forward
sum, and in the backward pass sums the cotangent in float32 (what TPUs and
GPUs accumulate in anyway). For float32 activations it is the plain sum,
whose autodiff gradient is that float32 sum already (and which forward-mode
autodiff, `jax.jvp`, can differentiate: a custom VJP cannot be).

`Dense`, `apply` and `Head` take the kernel product from `dot_general`
(`matmul.dot_general`; `matmul.plain_dot_general` for models that must
support forward-mode autodiff, `recompute.plain_autodiff`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.models import matmul
from vit_jax.models import platform_switch
from vit_jax.models.partitioning import with_axes

Dtype = Any


def add_bias(y, bias):
  """y + bias (broadcast over y's leading axes, cast to y's dtype); the bias
  gradient is summed in float32 (at least) and cast to the bias's dtype.

  For a y of 32 bits or more that is autodiff's own gradient: the plain sum,
  no custom VJP (so `jax.jvp` and `jax.jacfwd` work through it); half
  precision takes `_half_add_bias`."""
  if jnp.dtype(y.dtype).itemsize >= 4:
    return y + bias.astype(y.dtype)
  return _half_add_bias(y, bias)


@jax.custom_vjp
def _half_add_bias(y, bias):
  """`add_bias` of a half-precision y: autodiff would sum the bias gradient
  in y's dtype (module doc)."""
  return y + bias.astype(y.dtype)


def _add_bias_fwd(y, bias):
  return _half_add_bias(y, bias), bias


def _add_bias_bwd(bias, g):
  return g, bias_gradient(g, bias.ndim).astype(bias.dtype)


def bias_gradient(g, bias_ndim: int):
  """The float32 sum of cotangent `g` over its leading axes (all but the
  last `bias_ndim`).

  On NVIDIA GPUs a half-precision `g` is summed by a matrix product with
  ones, bf16 x bf16 accumulated in float32 (the same sum in another order).
  XLA's column-sum reduction over batch x tokens rows read the cotangent at
  about a third of the memory bandwidth (an H200 profile of the ViT-B/16
  train step: 2.6 ms for the MLP's first bias alone); as products the step
  ran 8.8% faster on an H100 (docs/performance.md). The ones pass through
  an optimisation barrier, as measured, so that no simplification can turn
  the product back into that reduction. Elsewhere (CPUs; TPUs, not
  measured) the plain float32 sum.
  """
  lead = g.ndim - bias_ndim
  if g.dtype == jnp.float32 or not lead:
    return _summed(g, lead)
  return platform_switch.switch(
      g, cuda=lambda g: _by_product(g, lead),
      default=lambda g: _summed(g, lead))


def _summed(g, lead: int):
  return jnp.sum(g.astype(jnp.float32), axis=tuple(range(lead)))


def _by_product(g, lead: int):
  """`_summed` as ones (8 rows, as measured) times `g`'s rows."""
  rows = g.reshape(-1, math.prod(g.shape[lead:]))
  ones = jax.lax.optimization_barrier(jnp.ones((8, rows.shape[0]), g.dtype))
  out = jax.lax.dot_general(ones, rows, (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
  return out[0].reshape(g.shape[lead:])


_half_add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


def apply(x, kernel, bias, dtype: Optional[Dtype] = None,
          dot_general: Callable = matmul.dot_general):
  """flax DenseGeneral's computation: x's trailing `kernel.ndim - bias.ndim`
  axes contracted with the kernel's leading ones (by `dot_general`), then
  the bias; operands cast to `dtype` (the kernel and bias dtypes' promotion
  with x's if None)."""
  dtype = dtype or jnp.result_type(x, kernel, bias)
  n = kernel.ndim - (bias.ndim if bias is not None else 0)
  contract = tuple(range(x.ndim - n, x.ndim))
  y = dot_general(x.astype(dtype), kernel.astype(dtype),
                  ((contract, tuple(range(n))), ((), ())))
  return y if bias is None else add_bias(y, bias)


def _flat(init: Callable, n_in: int) -> Callable:
  """`init` applied to the (prod(in), prod(out)) shape (1-D for a bias:
  n_in=0) and reshaped, as flax's DenseGeneral initialises."""

  def flat(key, shape, dtype=jnp.float32):
    shape = tuple(shape)
    if n_in:
      two_d = (math.prod(shape[:n_in]), math.prod(shape[n_in:]))
    else:
      two_d = (math.prod(shape),)
    return jnp.reshape(init(key, two_d, dtype), shape)
  return flat


class DenseParams(nn.Module):
  """The kernel and bias `nn.DenseGeneral(features, axis=(-in_axes..-1))`
  would create (same names, shapes, initialisation), returned as
  (kernel, bias) for a caller that applies them with `apply` inside a
  function of its own (`vit.MlpBlock` recomputes its second Dense).

  `axes`: logical names of the kernel's axes (input axes, then features);
  the bias takes the features' names. `dot_general`: the kernel product
  of the subclasses that apply them (`Dense`, `Head`).
  """
  features: Union[int, Sequence[int]]
  axes: Sequence[Optional[str]]
  kernel_init: Callable = nn.initializers.lecun_normal()
  bias_init: Callable = nn.initializers.zeros
  in_axes: int = 1
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  dot_general: Callable = matmul.dot_general

  @nn.compact
  def __call__(self, in_shape: Sequence[int]) -> Tuple[jax.Array, jax.Array]:
    return self._create(tuple(in_shape))

  def _create(self, in_shape):
    features = ((self.features,) if isinstance(self.features, int)
                else tuple(self.features))
    if len(in_shape) != self.in_axes or len(self.axes) != self.in_axes + len(
        features):
      raise ValueError(f'Dense {self.name}: {len(self.axes)} axis names '
                       f'{tuple(self.axes)} for a kernel of shape '
                       f'{in_shape + features} ({self.in_axes} input axes)')
    kernel = self.param(
        'kernel', with_axes(_flat(self.kernel_init, self.in_axes), self.axes),
        in_shape + features, self.param_dtype)
    bias = self.param(
        'bias', with_axes(_flat(self.bias_init, 0), self.axes[self.in_axes:]),
        features, self.param_dtype)
    return kernel, bias


class Dense(DenseParams):
  """`nn.DenseGeneral(features, axis=(-in_axes..-1))` with the same
  parameters and numbers, applied by `apply` (float32 bias gradient)."""

  @nn.compact
  def __call__(self, x):  # pylint: disable=arguments-renamed
    kernel, bias = self._create(tuple(x.shape[x.ndim - self.in_axes:]))
    return apply(x, kernel, bias, self.dtype, self.dot_general)


@jax.custom_vjp
def _wide_dot(x, kernel):
  """x (..., D) @ kernel (D, C) on x's dtype, the float32 accumulator
  returned as is (not rounded to x's dtype); the backward pass takes the
  cotangent in x's dtype, as every other layer's (no float32 products in a
  bf16 step)."""
  return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)


def _wide_dot_fwd(x, kernel):
  return _wide_dot(x, kernel), (x, kernel)


def _wide_dot_bwd(res, g):
  x, kernel = res
  g = g.astype(x.dtype)
  dx = matmul.dot_general(g, kernel, (((g.ndim - 1,), (1,)), ((), ())))
  flat_x = x.reshape(-1, x.shape[-1])
  flat_g = g.reshape(-1, g.shape[-1])
  dk = matmul.dot_general(flat_x, flat_g, (((0,), (0,)), ((), ())))
  return dx.astype(x.dtype), dk.astype(kernel.dtype)


_wide_dot.defvjp(_wide_dot_fwd, _wide_dot_bwd)


class Head(DenseParams):
  """A classifier's (or predictor's) output layer, `nn.Dense`'s parameters
  (zero kernel, constant bias by default, axes (embed, classes)), giving
  float32 logits whatever the compute dtype: the product runs on `dtype`
  operands and keeps its float32 accumulator, and the bias is added in
  float32. bf16 logits would step by 0.0625 at 10, which the loss, the
  softmax and top-1 ties would all see."""
  axes: Sequence[Optional[str]] = ('embed', 'classes')
  kernel_init: Callable = nn.initializers.zeros

  @nn.compact
  def __call__(self, x):  # pylint: disable=arguments-renamed
    kernel, bias = self._create((x.shape[-1],))
    dtype = self.dtype or jnp.result_type(x, kernel)
    if jnp.dtype(dtype) == jnp.float32:
      y = self.dot_general(x.astype(dtype), kernel.astype(dtype),
                           (((x.ndim - 1,), (0,)), ((), ())))
    else:
      y = _wide_dot(x.astype(dtype), kernel.astype(dtype))
    return y + bias.astype(jnp.float32)


def head(module, features: int, bias: float = 0.0, name: str = 'head',
         dot_general: Callable = matmul.dot_general) -> Head:
  """The output layer of `module` (a model with `dtype` and `param_dtype`):
  `features` wide, its bias initialised to the constant `bias`, its float32
  product by `dot_general`."""
  return Head(features, dtype=module.dtype, param_dtype=module.param_dtype,
              name=name, bias_init=nn.initializers.constant(bias),
              dot_general=dot_general)
