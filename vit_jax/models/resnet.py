"""BiT-style ResNets: weight-standardised convolutions + GroupNorm.

Two users:
  * `hybrid_stem`: the CNN of the hybrid R50+ViT models. Post-activation
    bottleneck units with the names of the public hybrid checkpoints
    (`conv_root`, `gn_root`, `block1/unit1/conv1`, `gn1`, ..., `conv_proj`,
    `gn_proj`). /16 hybrids use units (3, 4, 9) (stage 4 dropped, stage 3
    extended), /32 hybrids the full R50 (3, 4, 6, 3).
  * `bit.BiT`: the paper's ResNet baselines (Big Transfer, ResNet-v2:
    pre-activation units `BottleneckV2`, a GroupNorm+ReLU before global
    pooling, then a zero-initialised `head`).
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax.numpy as jnp

from vit_jax.models.partitioning import Module, with_axes


Dtype = Any

# Units per stage of the BiT depths.
DEPTHS = {
    26: (2, 2, 2, 2),  # Not a paper model: CPU-scale runs and smoke tests.
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
    200: (3, 24, 36, 3),
}


def weight_standardize(w, axis, eps):
  """(w - mean) / (std + eps): vision_transformer's `models_resnet.py`, whose
  hybrid checkpoints were trained with it."""
  w = w - jnp.mean(w, axis=axis, keepdims=True)
  return w / (jnp.std(w, axis=axis, keepdims=True) + eps)


def weight_standardize_bit(w, axis, eps):
  """(w - mean) / sqrt(mean((w - mean)^2) + eps): BiT's code (big_transfer,
  big_vision `models/bit_paper.py`), whose BiT checkpoints were trained
  with it."""
  w = w - jnp.mean(w, axis=axis, keepdims=True)
  return w / jnp.sqrt(jnp.mean(jnp.square(w), axis=axis, keepdims=True) + eps)


class StdConv(Module, nn.Conv):
  """Convolution whose kernel is standardised over (kh, kw, in) per output.

  `bit=False` is the hybrid stem's formula (`weight_standardize`, eps 1e-5),
  `bit=True` the BiT ResNets' (`weight_standardize_bit`, eps 1e-10): they
  differ for kernels of small variance, so each model uses its reference's.
  The kernel's output channels are the logical axis 'conv_out' (split over
  the `model` mesh axis under tensor parallelism).
  """
  bit: bool = False
  kernel_init: Any = with_axes(nn.initializers.lecun_normal(),
                               (None, None, 'conv_in', 'conv_out'))

  def param(self, name, *args, **kwargs):
    p = super().param(name, *args, **kwargs)
    if name == 'kernel':
      if self.bit:
        p = weight_standardize_bit(p, axis=(0, 1, 2), eps=1e-10)
      else:
        p = weight_standardize(p, axis=(0, 1, 2), eps=1e-5)
    return p


def stem_stride(resnet_layers: Sequence[int]) -> int:
  """Down-sampling of the hybrid stem: root (4) x 2 per stage after the
  first; the root block alone (no stages, AugReg's R+Ti/16) is 4."""
  return 4 * 2 ** max(len(resnet_layers) - 1, 0)


class ResidualUnit(nn.Module):
  """Post-activation bottleneck unit (the hybrid checkpoints' layout)."""
  features: int
  strides: Sequence[int] = (1, 1)
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    conv = lambda f, k, s, name: StdConv(
        f, (k, k), strides=s, use_bias=False, dtype=self.dtype,
        param_dtype=self.param_dtype, name=name)
    gn = lambda name, **kw: group_norm(self.dtype, self.param_dtype, name,
                                       **kw)
    nout = self.features * 4
    residual = x
    if x.shape[-1] != nout or tuple(self.strides) != (1, 1):
      residual = conv(nout, 1, self.strides, 'conv_proj')(residual)
      residual = gn('gn_proj')(residual)
    y = nn.relu(gn('gn1')(conv(self.features, 1, (1, 1), 'conv1')(x)))
    y = nn.relu(gn('gn2')(conv(self.features, 3, self.strides, 'conv2')(y)))
    y = conv(nout, 1, (1, 1), 'conv3')(y)
    y = gn('gn3', scale=nn.initializers.zeros)(y)
    return nn.relu(residual + y)


def hybrid_stem(x, layers: Sequence[int], width_factor: float = 1.0,
                dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32):
  """Root block and stages of the hybrid's ResNet (1/4, then 1/2 per stage).

  Called inside the ViT's compact `__call__`, so its layers sit at the top of
  the parameter tree (`conv_root`, `gn_root`, `block1`, ...) exactly as in the
  public hybrid checkpoints.
  """
  width = int(64 * width_factor)
  x = StdConv(width, (7, 7), strides=(2, 2), use_bias=False, dtype=dtype,
              param_dtype=param_dtype, name='conv_root')(x)
  x = group_norm(dtype, param_dtype, 'gn_root')(x)
  x = nn.relu(x)
  x = nn.max_pool(x, (3, 3), strides=(2, 2), padding='SAME')
  for i, units in enumerate(layers):
    x = ResNetStage(units, width * 2**i, (1, 1) if i == 0 else (2, 2), dtype,
                    param_dtype, name=f'block{i + 1}')(x)
  return x


class ResNetStage(nn.Module):
  """`units` bottleneck units named unit1, unit2, ...; the first one strides."""
  units: int
  features: int
  first_stride: Sequence[int]
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  unit: Any = None  # ResidualUnit (hybrid) or BottleneckV2 (BiT).

  @nn.compact
  def __call__(self, x):
    unit = self.unit or ResidualUnit
    for j in range(self.units):
      x = unit(self.features, self.first_stride if j == 0 else (1, 1),
               self.dtype, self.param_dtype, name=f'unit{j + 1}')(x)
    return x


def group_norm(dtype, param_dtype, name, scale=nn.initializers.ones,
               **kw) -> nn.GroupNorm:
  """flax's GroupNorm (32 groups; the hybrid stem's eps 1e-6 unless `kw`
  says otherwise) whose scale and bias are per channel of the convolution
  output it normalises: logical axis 'conv_out', split over the `model`
  mesh axis with the kernels' output channels."""
  return nn.GroupNorm(
      dtype=dtype, param_dtype=param_dtype, name=name,
      scale_init=with_axes(scale, ('conv_out',)),
      bias_init=with_axes(nn.initializers.zeros, ('conv_out',)), **kw)


def bit_group_norm(dtype, param_dtype, name):
  """BiT's GroupNorm: 32 groups, eps 1e-5, variance of the centred values."""
  return group_norm(dtype, param_dtype, name, epsilon=1e-5,
                    use_fast_variance=False)


class BottleneckV2(nn.Module):
  """Pre-activation bottleneck unit of BiT (ResNet-v2)."""
  features: int
  strides: Sequence[int] = (1, 1)
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    conv = lambda f, k, s, name: StdConv(
        f, (k, k), strides=s, use_bias=False, padding=[(k // 2, k // 2)] * 2,
        dtype=self.dtype, param_dtype=self.param_dtype, bit=True, name=name)
    gn = lambda name: bit_group_norm(self.dtype, self.param_dtype, name)
    nout = self.features * 4
    residual = x
    x = nn.relu(gn('gn1')(x))
    if residual.shape[-1] != nout or tuple(self.strides) != (1, 1):
      residual = conv(nout, 1, self.strides, 'conv_proj')(x)
    x = conv(self.features, 1, (1, 1), 'conv1')(x)
    x = conv(self.features, 3, self.strides, 'conv2')(nn.relu(gn('gn2')(x)))
    x = conv(nout, 1, (1, 1), 'conv3')(nn.relu(gn('gn3')(x)))
    return x + residual


def bottleneck_flops(h: int, w: int, layers: Sequence[int],
                     width_factor: float):
  """Convolution FLOPs of a bottleneck ResNet (root conv, max pool, stages)
  on an h x w x 3 image; returns (flops, output (h, w, channels))."""
  width = int(64 * width_factor)
  h, w = -(-h // 2), -(-w // 2)
  flops = 2.0 * h * w * 7 * 7 * 3 * width  # Root conv, stride 2.
  h, w, cin = -(-h // 2), -(-w // 2), width  # Max pool, stride 2.
  for i, units in enumerate(layers):
    mid = width * 2**i
    for j in range(units):
      s = 2 if (i > 0 and j == 0) else 1
      ho, wo = -(-h // s), -(-w // s)
      flops += 2.0 * h * w * cin * mid  # conv1 (1x1); conv2 strides.
      flops += 2.0 * ho * wo * 9 * mid * mid + 2.0 * ho * wo * mid * 4 * mid
      if cin != 4 * mid or s != 1:
        flops += 2.0 * ho * wo * cin * 4 * mid
      h, w, cin = ho, wo, 4 * mid
  return flops, (h, w, cin)
