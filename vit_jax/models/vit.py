"""The Vision Transformer (Dosovitskiy et al., ICLR 2021), in plain flax linen.

The module and parameter names are those of the public ViT checkpoints in their
linen form (`Transformer/encoderblock_0/MultiHeadDotProductAttention_0/...`),
so `vit_jax.checkpoint` loads them without a renaming table.

Placement of the paper's pieces:
  * patch embedding: a stride-P convolution named `embedding` (lecun-normal);
  * class token `cls` (zeros), learned 1-D position embeddings
    `Transformer/posembed_input/pos_embedding` (normal, stddev 0.02), dropout
    right after adding them;
  * pre-LayerNorm encoder blocks (epsilon 1e-6): x + MSA(LN(x)), x + MLP(LN(x));
    dropout after every dense layer except the q/k/v projections;
  * final LayerNorm `Transformer/encoder_norm`, then the class token (or the mean
    of all tokens with `classifier="gap"`), an optional `pre_logits` Dense+tanh
    layer (the pre-training head), and a zero-initialised `head`.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp

from vit_jax.models import matmul, resnet
from vit_jax.models.inputs import check_image_shape

Dtype = Any


class AddPositionEmbs(nn.Module):
  """Adds learned 1-D position embeddings of shape (1, tokens, width)."""
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    shape = (1, x.shape[1], x.shape[2])
    pe = self.param('pos_embedding', nn.initializers.normal(stddev=0.02),
                    shape, self.param_dtype)
    return x + pe.astype(x.dtype)


class MlpBlock(nn.Module):
  """Dense -> GELU -> dropout -> Dense -> dropout.

  `gelu_approximate`: the tanh approximation of the public JAX checkpoints
  (True) or the exact erf GELU of Hugging Face's `hidden_act="gelu"` (False).
  """
  mlp_dim: int
  dropout_rate: float = 0.0
  gelu_approximate: bool = True
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, *, deterministic: bool):
    dense = lambda n: nn.Dense(
        n, dtype=self.dtype, param_dtype=self.param_dtype,
        dot_general=matmul.dot_general,
        kernel_init=nn.initializers.xavier_uniform(),
        bias_init=nn.initializers.normal(stddev=1e-6))
    out_dim = x.shape[-1]
    x = dense(self.mlp_dim)(x)
    x = nn.with_logical_constraint(x, ('batch', 'length', 'mlp'))
    x = nn.gelu(x, approximate=self.gelu_approximate)
    x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)
    x = dense(out_dim)(x)
    return nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)


class Encoder1DBlock(nn.Module):
  """One pre-LayerNorm transformer block."""
  mlp_dim: int
  num_heads: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  gelu_approximate: bool = True
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, deterministic: bool):
    norm = lambda: nn.LayerNorm(epsilon=1e-6, dtype=self.dtype,
                                param_dtype=self.param_dtype)
    # Logical activation axes: no-ops unless the caller sets axis rules
    # (the train step maps 'batch' to the data axes, 'mlp' to 'model').
    x = nn.with_logical_constraint(x, ('batch', 'length', 'embed'))
    y = norm()(x)
    y = nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, dtype=self.dtype,
        param_dtype=self.param_dtype,
        kernel_init=nn.initializers.xavier_uniform(),
        qkv_dot_general=matmul.dot_general,
        out_dot_general=matmul.dot_general,
        attention_fn=functools.partial(nn.dot_product_attention,
                                       einsum_dot_general=matmul.dot_general),
        broadcast_dropout=False, dropout_rate=self.attention_dropout_rate,
        deterministic=deterministic)(y, y)
    y = nn.Dropout(rate=self.dropout_rate)(y, deterministic=deterministic)
    x = x + y
    y = norm()(x)
    y = MlpBlock(self.mlp_dim, self.dropout_rate, self.gelu_approximate,
                 self.dtype, self.param_dtype)(y, deterministic=deterministic)
    return x + y


class _ScannedBlock(Encoder1DBlock):
  """Encoder1DBlock with the (carry, output) signature nn.scan wants."""

  @nn.compact
  def __call__(self, x, deterministic: bool):
    return super().__call__(x, deterministic=deterministic), None


class Encoder(nn.Module):
  """Position embeddings, `num_layers` blocks and the final LayerNorm.

  `scan_layers` runs the blocks with nn.scan (one compiled block, parameters
  stacked under `encoderblock` with a leading layer axis; convert with
  `vit_jax.checkpoint.stack_blocks` / `unstack_blocks`); `remat` recomputes
  each block's activations in the backward pass to save memory.
  """
  num_layers: int
  mlp_dim: int
  num_heads: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  gelu_approximate: bool = True
  scan_layers: bool = False
  remat: bool = False
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, *, train: bool):
    x = AddPositionEmbs(self.param_dtype, name='posembed_input')(x)
    x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=not train)
    kw = dict(mlp_dim=self.mlp_dim, num_heads=self.num_heads,
              dropout_rate=self.dropout_rate,
              attention_dropout_rate=self.attention_dropout_rate,
              gelu_approximate=self.gelu_approximate,
              dtype=self.dtype, param_dtype=self.param_dtype)
    if self.scan_layers:
      block = _ScannedBlock
      if self.remat:
        block = nn.remat(block, prevent_cse=False, static_argnums=(2,))
      x, _ = nn.scan(block, variable_axes={'params': 0},
                     split_rngs={'params': True, 'dropout': True},
                     in_axes=nn.broadcast, length=self.num_layers)(
                         name='encoderblock', **kw)(x, not train)
    else:
      block = Encoder1DBlock
      if self.remat:
        block = nn.remat(block, static_argnums=(2,))
      for i in range(self.num_layers):
        x = block(name=f'encoderblock_{i}', **kw)(x, not train)
    return nn.LayerNorm(epsilon=1e-6, dtype=self.dtype,
                        param_dtype=self.param_dtype, name='encoder_norm')(x)


class VisionTransformer(nn.Module):
  """ViT classifier; with `resnet_layers` set it is the hybrid (R50+ViT).

  Attributes:
    num_classes: size of the `head`; 0 or None returns the representation.
    patch_size: side of the square patches (1 for hybrids).
    hidden_size, mlp_dim, num_heads, num_layers: the Table 1 dimensions.
    representation_size: width of the `pre_logits` Dense+tanh layer of the
      pre-training head, or None for none.
    classifier: "token" (class token) or "gap" (mean over patch tokens).
    resnet_layers / resnet_width: units per stage and width factor of the
      hybrid's ResNet stem (e.g. (3, 4, 9), 1 for R50+ViT-B/16).
    head_bias_init: constant for the head bias (e.g. -10 for i21k pre-training).
    gelu_approximate: tanh GELU (the public JAX checkpoints) or exact erf GELU
      (False: Hugging Face ViTs with `hidden_act="gelu"`).
    scan_layers / remat: see `Encoder` (same numbers, less compile time and
      memory for deep models).
    dtype: compute dtype of every layer; param_dtype: storage dtype of params.
  """
  num_classes: Optional[int]
  patch_size: int
  hidden_size: int
  mlp_dim: int
  num_heads: int
  num_layers: int
  representation_size: Optional[int] = None
  classifier: str = 'token'
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  resnet_layers: Optional[Sequence[int]] = None
  resnet_width: float = 1.0
  head_bias_init: float = 0.0
  gelu_approximate: bool = True
  scan_layers: bool = False
  remat: bool = False
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @property
  def stride(self) -> int:
    """Pixels per token along each side."""
    stem = resnet.stem_stride(self.resnet_layers) if self.resnet_layers else 1
    return stem * self.patch_size

  @nn.compact
  def __call__(self, images, *, train: bool = False):
    if self.classifier not in ('token', 'gap'):
      raise ValueError(f"classifier must be 'token' or 'gap', got "
                       f'{self.classifier!r}')
    check_image_shape(images.shape, self.stride)
    x = images
    if self.resnet_layers:
      x = resnet.hybrid_stem(x, self.resnet_layers, self.resnet_width,
                             self.dtype, self.param_dtype)
    p = self.patch_size
    x = nn.Conv(self.hidden_size, (p, p), strides=(p, p), padding='VALID',
                dtype=self.dtype, param_dtype=self.param_dtype,
                name='embedding')(x)
    n, h, w, c = x.shape
    x = jnp.reshape(x, (n, h * w, c))
    if self.classifier == 'token':
      cls = self.param('cls', nn.initializers.zeros, (1, 1, c),
                       self.param_dtype)
      x = jnp.concatenate([jnp.tile(cls.astype(x.dtype), (n, 1, 1)), x], 1)

    x = Encoder(num_layers=self.num_layers, mlp_dim=self.mlp_dim,
                num_heads=self.num_heads, dropout_rate=self.dropout_rate,
                attention_dropout_rate=self.attention_dropout_rate,
                gelu_approximate=self.gelu_approximate,
                scan_layers=self.scan_layers, remat=self.remat,
                dtype=self.dtype, param_dtype=self.param_dtype,
                name='Transformer')(x, train=train)
    x = x[:, 0] if self.classifier == 'token' else jnp.mean(x, axis=1)

    if self.representation_size:
      x = nn.Dense(self.representation_size, dtype=self.dtype,
                   param_dtype=self.param_dtype,
                   dot_general=matmul.dot_general, name='pre_logits')(x)
      x = nn.tanh(x)
    # The image representation (few-shot evaluators read it from here).
    self.sow('intermediates', 'representation', x)
    if not self.num_classes:
      return x
    x = nn.Dense(self.num_classes, dtype=self.dtype,
                 param_dtype=self.param_dtype, name='head',
                 dot_general=matmul.dot_general,
                 kernel_init=nn.initializers.zeros,
                 bias_init=nn.initializers.constant(self.head_bias_init))(x)
    return x.astype(jnp.float32)
