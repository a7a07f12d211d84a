"""The BiT ResNet-v2 classifiers (Big Transfer), the paper's CNN baselines.

Pre-activation bottleneck units (`resnet.BottleneckV2`) with weight-
standardised convolutions and GroupNorm, a GroupNorm + ReLU before global
average pooling, then a zero-initialised `head`. The public BiT files name
these parameters their own way; `checkpoint.load_npz` renames them.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from vit_jax.models import dense, registry, resnet
from vit_jax.models.inputs import check_image_shape
from vit_jax.models.partitioning import Module

Dtype = Any


class BiT(Module):
  """BiT ResNet-v2 classifier (`BiT-R50x1` ... `BiT-R200x3`)."""
  num_classes: Optional[int]
  depth: int = 50
  width_factor: float = 1.0
  head_bias_init: float = 0.0
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @property
  def stride(self) -> int:
    return 32

  @nn.compact
  def __call__(self, images, *, train: bool = False):
    del train  # No dropout or batch statistics in BiT.
    check_image_shape(images.shape, self.stride)
    width = int(64 * self.width_factor)
    x = resnet.StdConv(width, (7, 7), strides=(2, 2),
                       padding=[(3, 3), (3, 3)], use_bias=False,
                       dtype=self.dtype, param_dtype=self.param_dtype,
                       bit=True, name='conv_root')(images)
    x = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding='VALID')
    for i, units in enumerate(resnet.DEPTHS[self.depth]):
      x = resnet.ResNetStage(
          units, width * 2**i, (1, 1) if i == 0 else (2, 2), self.dtype,
          self.param_dtype, unit=resnet.BottleneckV2, name=f'block{i + 1}')(x)
    x = resnet.bit_group_norm(self.dtype, self.param_dtype, 'norm_pre_head')(x)
    x = jnp.mean(nn.relu(x), axis=(1, 2))
    self.sow('intermediates', 'representation', x)
    if not self.num_classes:
      return x
    return dense.head(self, self.num_classes, self.head_bias_init)(x)


def bit_flops(spec, h: int, w: int, num_classes: int) -> float:
  """Convolution and head FLOPs of a BiT ResNet."""
  flops, (_, _, c) = resnet.bottleneck_flops(
      h, w, resnet.DEPTHS[spec.get('depth', 50)],
      spec.get('width_factor', 1.0))
  return flops + 2.0 * c * (num_classes or 0)


def bit_shrink(spec):
  """4 stages of 2 units, 32 channels at the root; 32 px (a 1x1 final map).

  Not 64 px: where a map is smaller than a 3x3 kernel, XLA rewrites the
  convolution (operands swapped, window reversed) into a form XLA:CPU runs
  as a plain loop nest rather than a library kernel, so the 2x2 last stage
  made most of the step's time. At 32 px the train step of `configs/
  pretrain.py:model=BiT-R50x1,data=jft,opt=sgd,smoke=true` takes 0.19 s
  instead of 0.57 s (XLA's defaults; 0.73 instead of 2.25 s under the test
  suite's XLA flags) on a 2-vCPU AMD EPYC VM.
  """
  del spec
  return dict(depth=26, width_factor=0.5), 32


registry.register(
    registry.Family('BiT', BiT, bit_flops, bit_shrink),
    {f'BiT-R{depth}x{width}': dict(depth=depth, width_factor=float(width))
     for depth, width in ((50, 1), (50, 2), (101, 1), (152, 1), (152, 2),
                          (200, 3))})
