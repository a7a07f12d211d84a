"""MLP-Mixer (Tolstikhin et al., NeurIPS 2021): the other model family of
google-research/vision_transformer, an all-MLP network on the same patches.

  * `stem`: a stride-P convolution cutting the image into P x P patches, as
    the ViT's `embedding` (but no class token and no position embeddings);
  * `num_blocks` x `MixerBlock`: x + token_mixing(LN(x)^T)^T, then
    x + channel_mixing(LN(x)); each mixing is Dense -> GELU -> Dense (the
    token MLP across the patches, `tokens_mlp_dim` wide; the channel MLP
    across the features, `channels_mlp_dim` wide); LayerNorm epsilon 1e-6;
  * `pre_head_layer_norm`, the mean over the patches (what few-shot reads),
    then a zero-initialised `head`.

Parameter names and shapes are those of the public Mixer checkpoints
(`stem`, `MixerBlock_<i>/LayerNorm_0`, `.../token_mixing/Dense_0`,
`.../channel_mixing/Dense_1`, `pre_head_layer_norm`, `head`), with the
reference's initialisers (flax's defaults: lecun-normal kernels, zero
biases) and its tanh-approximated GELU.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from vit_jax.models import dense, registry
from vit_jax.models.inputs import check_image_shape
from vit_jax.models.partitioning import Module, with_axes
from vit_jax.models.vit import LayerNorm

Dtype = Any


class MlpBlock(nn.Module):
  """Dense (`mlp_dim`) -> GELU -> Dense back to the input's width, over the
  last axis; `axis` is the logical name of that axis ('length': the tokens,
  'embed': the channels)."""
  mlp_dim: int
  axis: str
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    def layer(n, axes, name):
      return dense.Dense(n, axes, dtype=self.dtype,
                         param_dtype=self.param_dtype, name=name)
    y = layer(self.mlp_dim, (self.axis, 'mlp'), 'Dense_0')(x)
    y = nn.gelu(y.astype(jnp.float32)).astype(y.dtype)
    return layer(x.shape[-1], ('mlp', self.axis), 'Dense_1')(y)


class MixerBlock(nn.Module):
  """Token mixing, then channel mixing, each pre-LayerNorm and residual."""
  tokens_mlp_dim: int
  channels_mlp_dim: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    y = LayerNorm(**kw, name='LayerNorm_0')(x)
    y = jnp.swapaxes(y, 1, 2)
    y = MlpBlock(self.tokens_mlp_dim, 'length', **kw, name='token_mixing')(y)
    x = x + jnp.swapaxes(y, 1, 2)
    y = LayerNorm(**kw, name='LayerNorm_1')(x)
    return x + MlpBlock(self.channels_mlp_dim, 'embed', **kw,
                        name='channel_mixing')(y)


class MlpMixer(Module):
  """MLP-Mixer classifier (`Mixer-S/32` ... `Mixer-L/16`)."""
  num_classes: Optional[int]
  patch_size: int = 16
  hidden_dim: int = 768
  num_blocks: int = 12
  tokens_mlp_dim: int = 384
  channels_mlp_dim: int = 3072
  head_bias_init: float = 0.0
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @property
  def stride(self) -> int:
    """Pixels per token along each side."""
    return self.patch_size

  @nn.compact
  def __call__(self, images, *, train: bool = False):
    del train  # No dropout in the reference Mixer.
    # Its stem pads, as the reference's (flax's default SAME): any size
    # gives ceil(size / patch) tokens per side, every pixel seen.
    check_image_shape(images.shape, 1)
    p = self.patch_size
    x = nn.Conv(self.hidden_dim, (p, p), strides=(p, p), padding='SAME',
                dtype=self.dtype, param_dtype=self.param_dtype,
                kernel_init=with_axes(nn.initializers.lecun_normal(),
                                      (None, None, None, 'embed')),
                bias_init=with_axes(nn.initializers.zeros, ('embed',)),
                name='stem')(images)
    x = jnp.reshape(x, (x.shape[0], -1, x.shape[-1]))
    for i in range(self.num_blocks):
      x = MixerBlock(self.tokens_mlp_dim, self.channels_mlp_dim,
                     dtype=self.dtype, param_dtype=self.param_dtype,
                     name=f'MixerBlock_{i}')(x)
    x = LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype,
                  name='pre_head_layer_norm')(x)
    x = jnp.mean(x.astype(jnp.float32), axis=1)
    self.sow('intermediates', 'representation', x)
    if not self.num_classes:
      return x
    return dense.head(self, self.num_classes, self.head_bias_init)(x)


def mixer_flops(spec, h: int, w: int, num_classes: int) -> float:
  """Matmul and convolution FLOPs of a Mixer (multiply-add = 2)."""
  p, c = spec['patch_size'], spec['hidden_dim']
  s = -(-h // p) * -(-w // p)  # The padded stem's tokens.
  flops = 2.0 * s * p * p * 3 * c  # The stem.
  per_block = (2.0 * 2 * s * spec['tokens_mlp_dim'] * c  # Token MLP.
               + 2.0 * 2 * s * c * spec['channels_mlp_dim'])  # Channel MLP.
  return flops + spec['num_blocks'] * per_block + 2.0 * c * (num_classes or 0)


def mixer_shrink(spec):
  """Width 32, 2 blocks, same patch size; a 2x2 patch grid."""
  return dict(hidden_dim=32, num_blocks=2, tokens_mlp_dim=16,
              channels_mlp_dim=64), 2 * spec['patch_size']


# The paper's Table 1 (S, B, L, H); the public checkpoints are B/16, L/16
# (ImageNet-21k and -1k) and the SAM-trained S/16, S/32, B/32.
WIDTHS = {
    # width: (hidden_dim, num_blocks, tokens_mlp_dim, channels_mlp_dim)
    'S': (512, 8, 256, 2048),
    'B': (768, 12, 384, 3072),
    'L': (1024, 24, 512, 4096),
    'H': (1280, 32, 640, 5120),
}


def dims(width: str, patch: int):
  hidden, blocks, tokens, channels = WIDTHS[width]
  return dict(patch_size=patch, hidden_dim=hidden, num_blocks=blocks,
              tokens_mlp_dim=tokens, channels_mlp_dim=channels)


registry.register(
    registry.Family('Mixer', MlpMixer, mixer_flops, mixer_shrink),
    {f'Mixer-{width}/{patch}': dims(width, patch)
     for width, patch in (('S', 32), ('S', 16), ('B', 32), ('B', 16),
                          ('L', 32), ('L', 16), ('H', 14))})
