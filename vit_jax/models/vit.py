"""The Vision Transformer (Dosovitskiy et al., ICLR 2021), in plain flax linen.

The module and parameter names are those of the public ViT checkpoints in their
linen form (`Transformer/encoderblock_0/MultiHeadDotProductAttention_0/...`),
so `vit_jax.checkpoint` loads them without a renaming table.

Placement of the paper's pieces:
  * patch embedding: a stride-P convolution named `embedding` (lecun-normal);
  * class token `cls` (zeros), learned 1-D position embeddings
    `Transformer/posembed_input/pos_embedding` (normal, stddev 0.02), dropout
    right after adding them; or, with `posemb="sincos2d"`, fixed 2-D
    sine-cosine embeddings added to the patch tokens before the class token
    (no parameter: big_vision's plain ViT baselines, `sincos2d`);
  * pre-LayerNorm encoder blocks (epsilon 1e-6): x + MSA(LN(x)), x + MLP(LN(x));
    dropout after every dense layer except the q/k/v projections;
  * final LayerNorm `Transformer/encoder_norm`, then the class token (or the mean
    of all tokens with `classifier="gap"`, or big_vision's multihead
    attention pooling `MAPHead_0` with `classifier="map"`), an optional
    `pre_logits` Dense+tanh layer (the pre-training head), and a
    zero-initialised `head`.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.models import attention, dense, matmul, recompute, registry
from vit_jax.models import remat as remat_lib
from vit_jax.models import resnet
from vit_jax.models.partitioning import Module, with_axes
from vit_jax.models.inputs import check_image_shape

Dtype = Any


class AddPositionEmbs(nn.Module):
  """Adds learned 1-D position embeddings of shape (1, tokens, width)."""
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    shape = (1, x.shape[1], x.shape[2])
    self._check_tokens(x.shape[1])
    pe = self.param('pos_embedding',
                    with_axes(nn.initializers.normal(stddev=0.02),
                              (None, None, 'embed')),
                    shape, self.param_dtype)
    return x + pe.astype(x.dtype)

  def _check_tokens(self, tokens: int) -> None:
    """Parameters of another token count (another image or patch size) are
    a ValueError that says so and names the resize, not flax's shape
    error, which names neither."""
    if not self.has_variable('params', 'pos_embedding'):
      return
    have = jnp.shape(nn.meta.unbox(self.get_variable('params',
                                                   'pos_embedding')))
    known = lambda n: isinstance(n, (int, np.integer))  # Not symbolic.
    if len(have) == 3 and known(have[1]) and known(tokens) and (
        have[1] != tokens):
      name = '/'.join(tuple(self.scope.path) + ('pos_embedding',))
      raise ValueError(
          f'{name} holds {have[1]} positions (class token, if any, and '
          f'patch grid), but these images give {tokens} tokens: the '
          'parameters were made for another image size (or patch size). '
          'Resize them to this input with vit_jax.checkpoint.resize_posemb '
          '(load_pretrained does, given the new model\'s initial '
          'parameters), or vit_jax.trained.resized for a trained model; '
          'or feed images of the size they were made for')


# Position embeddings a ViT can have (`VisionTransformer.posemb`).
POSEMBS = ('learn', 'sincos2d')
# How a ViT pools its tokens (`VisionTransformer.classifier`).
CLASSIFIERS = ('token', 'gap', 'map')


def sincos2d(grid, width: int, temperature: float = 10_000.) -> np.ndarray:
  """Fixed 2-D sine-cosine position embeddings, (rows * cols, width) float32.

  The patch at row y, column x (row-major, as the tokens) gets
  [sin(x w_k), cos(x w_k), sin(y w_k), cos(y w_k)] for the width / 4
  frequencies w_k = temperature ** (-k / (width / 4 - 1)): the form of MoCo
  v3 and big_vision's `posemb="sincos2d"`. Defined for any grid, so a model
  with them fine-tunes at another resolution without a resize.
  """
  if width % 4:
    raise ValueError(f"posemb='sincos2d' needs a width divisible by 4 "
                     f'(four sine/cosine groups), got hidden_size={width}')
  rows, cols = (int(g) for g in grid)
  k = width // 4
  omega = 1.0 / temperature ** (np.arange(k) / max(k - 1, 1))
  y, x = np.mgrid[:rows, :cols]
  x = x.reshape(-1, 1) * omega
  y = y.reshape(-1, 1) * omega
  return np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)],
                        axis=1).astype(np.float32)


class DropPath(nn.Module):
  """Stochastic depth (Huang et al. 2016; DeiT / AugReg's drop path): in
  training, each example's residual branch is dropped with probability
  `rate` and kept ones are scaled by 1 / (1 - rate); the identity in eval.
  `rate` may be a traced scalar (per-layer rates under nn.scan)."""

  @nn.compact
  def __call__(self, y, rate, *, deterministic: bool):
    if deterministic or (isinstance(rate, (int, float)) and rate == 0):
      return y
    keep = 1.0 - jnp.asarray(rate, jnp.float32)
    mask = jax.random.bernoulli(self.make_rng('dropout'), keep,
                                (y.shape[0],) + (1,) * (y.ndim - 1))
    return jnp.where(mask, y / keep.astype(y.dtype), jnp.zeros_like(y))


def depth_rates(max_rate: float, num_layers: int):
  """Drop-path rate of each block: linear from 0 (first) to `max_rate`
  (last), as DeiT and AugReg schedule it."""
  if not 0.0 <= max_rate < 1.0:
    raise ValueError(f'stochastic_depth={max_rate}: a drop probability in '
                     '[0, 1)')
  if num_layers == 1:
    return [max_rate]
  return [max_rate * i / (num_layers - 1) for i in range(num_layers)]


class LayerNorm(nn.Module):
  """flax's LayerNorm (epsilon 1e-6, same parameters and numbers); with
  `recompute`, its backward pass recomputes the statistics from the input
  instead of keeping the centred and scaled copies (see
  `Encoder.recompute_internals`)."""
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  recompute: bool = True

  @nn.compact
  def __call__(self, x):
    features = (x.shape[-1],)
    scale = self.param('scale', with_axes(nn.initializers.ones, ('embed',)),
                       features, self.param_dtype)
    bias = self.param('bias', with_axes(nn.initializers.zeros, ('embed',)),
                      features, self.param_dtype)
    norm = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype,
                        param_dtype=self.param_dtype, parent=None)
    fn = lambda x, s, b: norm.apply({'params': {'scale': s, 'bias': b}}, x)
    return (recompute.recompute(fn) if self.recompute else fn)(
        x, scale, bias)


class MlpBlock(nn.Module):
  """Dense -> GELU -> dropout -> Dense -> dropout.

  `gelu_approximate`: the tanh approximation of the public JAX checkpoints
  (True) or the exact erf GELU of Hugging Face's `hidden_act="gelu"` (False).
  `recompute_internals`: the GELU and the second Dense keep only the GELU's
  input for the backward pass, which recomputes the GELU's output for the
  Dense's weight gradient (without dropout; with it, the GELU alone; see
  `Encoder`); without it, a float32 block traces no custom VJP
  (`recompute.plain_autodiff`).
  """
  mlp_dim: int
  dropout_rate: float = 0.0
  gelu_approximate: bool = True
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  recompute_internals: bool = True

  @nn.compact
  def __call__(self, x, *, deterministic: bool):
    plain = recompute.plain_autodiff(self.dtype, self.recompute_internals)
    dot_general = matmul.dot_general_for(plain)
    def layer(n, axes, name, cls=dense.Dense):
      return cls(n, axes, kernel_init=nn.initializers.xavier_uniform(),
                 bias_init=nn.initializers.normal(stddev=1e-6),
                 dtype=self.dtype, param_dtype=self.param_dtype,
                 dot_general=dot_general, name=name)
    out_dim = x.shape[-1]
    x = layer(self.mlp_dim, ('embed', 'mlp'), 'Dense_0')(x)
    x = nn.with_logical_constraint(x, ('batch', 'length', 'mlp'))
    # The second Dense's parameters, applied by a function of them so that
    # it can be recomputed with the GELU.
    kernel, bias = layer(out_dim, ('mlp', 'embed'), 'Dense_1',
                         dense.DenseParams)(x.shape[-1:])
    def gelu(y):  # In float32 whatever the compute dtype: one rounding.
      return nn.gelu(y.astype(jnp.float32),
                     approximate=self.gelu_approximate).astype(y.dtype)
    project = functools.partial(dense.apply, dtype=self.dtype,
                                dot_general=dot_general)
    maybe = recompute.recompute if self.recompute_internals else (lambda f: f)
    if self.dropout_rate > 0.0 and not deterministic:
      x = nn.Dropout(rate=self.dropout_rate)(maybe(gelu)(x),
                                             deterministic=False)
      x = project(x, kernel, bias)
    else:
      x = maybe(lambda y, k, b: project(gelu(y), k, b))(x, kernel, bias)
    return nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)


class MAPHead(nn.Module):
  """Multihead attention pooling (big_vision's `pool_type="map"`, its
  parameter names): a learned `probe` token attends over the encoder's
  tokens, then a pre-LayerNorm residual MLP; the probe's output (batch,
  width) is the image's representation."""
  num_heads: int
  mlp_dim: int
  gelu_approximate: bool = True
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    n, _, d = x.shape
    probe = self.param('probe', with_axes(nn.initializers.xavier_uniform(),
                                          (None, None, 'embed')),
                       (1, 1, d), self.param_dtype)
    # One query: the explicit form (its weights are 1 x tokens).
    y = attention.MultiHeadDotProductAttention(
        num_heads=self.num_heads, impl='explicit', dtype=self.dtype,
        param_dtype=self.param_dtype)(
            jnp.tile(probe.astype(x.dtype), (n, 1, 1)), x,
            deterministic=True)
    z = LayerNorm(self.dtype, self.param_dtype, False)(y)
    y = y + MlpBlock(self.mlp_dim, 0.0, self.gelu_approximate, self.dtype,
                     self.param_dtype, False)(z, deterministic=True)
    return y[:, 0]


class Encoder1DBlock(nn.Module):
  """One pre-LayerNorm transformer block.

  `attention_impl`: see `vit_jax.models.attention`; `capture_attention` sows
  the softmax weights into the `intermediates` collection (inspection only:
  the train and eval steps never ask for them); `valid_length`: the tokens
  from this index on are padding that no real token attends to (`Encoder`).
  """
  mlp_dim: int
  num_heads: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  gelu_approximate: bool = True
  attention_impl: str = 'xla'
  capture_attention: bool = False
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  recompute_internals: bool = True
  valid_length: Optional[int] = None

  @nn.compact
  def __call__(self, x, deterministic: bool, drop_path=0.0):
    norm = lambda i: LayerNorm(self.dtype, self.param_dtype,
                               self.recompute_internals, name=f'LayerNorm_{i}')
    # Logical activation axes: no-ops unless the caller sets axis rules
    # (the train step maps 'batch' to the data axes, 'mlp' to 'model').
    x = nn.with_logical_constraint(x, ('batch', 'length', 'embed'))
    y = norm(0)(x)
    y = attention.MultiHeadDotProductAttention(
        num_heads=self.num_heads, impl=self.attention_impl,
        recompute=self.recompute_internals, valid_length=self.valid_length,
        dropout_rate=self.attention_dropout_rate, dtype=self.dtype,
        param_dtype=self.param_dtype)(
            y, deterministic=deterministic,
            sow_weights=self.capture_attention)
    y = nn.Dropout(rate=self.dropout_rate)(y, deterministic=deterministic)
    x = x + DropPath()(y, drop_path, deterministic=deterministic)
    y = norm(1)(x)
    y = MlpBlock(self.mlp_dim, self.dropout_rate, self.gelu_approximate,
                 self.dtype, self.param_dtype, self.recompute_internals)(
                     y, deterministic=deterministic)
    return x + DropPath()(y, drop_path, deterministic=deterministic)


class _ScannedBlock(Encoder1DBlock):
  """Encoder1DBlock with the (carry, output) signature nn.scan wants."""

  @nn.compact
  def __call__(self, x, drop_path, deterministic: bool):
    return super().__call__(x, deterministic, drop_path), None


class Encoder(nn.Module):
  """Position embeddings, `num_layers` blocks and the final LayerNorm.

  `learned_posemb`: add the learned `posembed_input` (False: the caller has
  added fixed ones, `sincos2d`).

  `scan_layers` runs the blocks with nn.scan (one compiled block, parameters
  stacked under `encoderblock` with a leading layer axis; convert with
  `vit_jax.checkpoint.stack_blocks` / `unstack_blocks`); `remat` recomputes
  each block's activations in the backward pass to save memory (True or a
  policy name from `vit_jax.models.remat.POLICIES`); `stochastic_depth` is
  the last block's drop-path rate (`depth_rates`).

  `recompute_internals` (default True): LayerNorm, XLA attention and the
  MLP's GELU + second Dense keep only their inputs for the backward pass and
  recompute their intermediate values there, once the cotangent has arrived
  (`vit_jax.models.recompute`): statistics, attention logits and softmax, the
  GELU's output. That is less than PyTorch's autograd keeps. False keeps
  every intermediate (jax's default: the same numbers with about twice the
  activation memory, docs/performance.md); in float32 the model then has no
  custom VJP at all, so that forward-mode autodiff works
  (`recompute.plain_autodiff`). Independent of `remat`, which recomputes
  whole blocks.

  `even_tokens`: an odd token count (a ViT's 197) is padded once by one zero
  token, which every block's attention hides as a key, and sliced off
  before the final LayerNorm: the same outputs and gradients. cuDNN's flash
  attention needs even lengths in its backward pass; padding once here saves
  each layer's pads and slices (`attention.even_lengths`). None (default):
  only where it pays, for "cudnn" attention without captured weights or
  attention dropout; True: for any implementation (tests); False: never.
  """
  num_layers: int
  mlp_dim: int
  num_heads: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  gelu_approximate: bool = True
  attention_impl: str = 'xla'
  capture_attention: bool = False
  stochastic_depth: float = 0.0
  scan_layers: bool = False
  remat: bool | str = False
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  recompute_internals: bool = True
  even_tokens: Optional[bool] = None
  learned_posemb: bool = True

  def _pads(self, length: int, train: bool) -> bool:
    if length % 2 == 0:
      return False
    if self.even_tokens is not None:
      return self.even_tokens
    return (self.attention_impl == 'cudnn' and not self.capture_attention
            and not (train and self.attention_dropout_rate > 0))

  @nn.compact
  def __call__(self, x, *, train: bool):
    if self.learned_posemb:
      x = AddPositionEmbs(self.param_dtype, name='posembed_input')(x)
    x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=not train)
    length = x.shape[1]
    pads = self._pads(length, train)
    if pads:
      x = jnp.pad(x, ((0, 0), (0, 1), (0, 0)))
    kw = dict(mlp_dim=self.mlp_dim, num_heads=self.num_heads,
              dropout_rate=self.dropout_rate,
              attention_dropout_rate=self.attention_dropout_rate,
              gelu_approximate=self.gelu_approximate,
              attention_impl=self.attention_impl,
              capture_attention=self.capture_attention,
              dtype=self.dtype, param_dtype=self.param_dtype,
              recompute_internals=self.recompute_internals,
              valid_length=length if pads else None)
    policy = remat_lib.policy(self.remat)
    rates = depth_rates(self.stochastic_depth, self.num_layers)
    # Drop-path rates are static Python floats, except under nn.scan with
    # stochastic depth on, where each layer's rate is a scanned input.
    scanned_rates = self.scan_layers and self.stochastic_depth > 0
    if self.scan_layers:
      block = _ScannedBlock  # (x, drop_path, deterministic)
      if self.remat:
        block = nn.remat(block, prevent_cse=False, policy=policy,
                         static_argnums=(3,) if scanned_rates else (2, 3))
      x, _ = nn.scan(block, variable_axes={'params': 0, 'intermediates': 0},
                     split_rngs={'params': True, 'dropout': True},
                     in_axes=(0 if scanned_rates else nn.broadcast,
                              nn.broadcast),
                     length=self.num_layers,
                     metadata_params={nn.PARTITION_NAME: 'layers'})(
                         name='encoderblock', **kw)(
                             x, jnp.asarray(rates) if scanned_rates else 0.0,
                             not train)
    else:
      block = Encoder1DBlock  # (x, deterministic, drop_path)
      if self.remat:
        block = nn.remat(block, static_argnums=(2, 3), policy=policy)
      for i in range(self.num_layers):
        x = block(name=f'encoderblock_{i}', **kw)(x, not train, rates[i])
    if pads:
      x = x[:, :length]
    return LayerNorm(self.dtype, self.param_dtype, self.recompute_internals,
                     name='encoder_norm')(x)


class VisionTransformer(Module):
  """ViT classifier; with `resnet_layers` set it is the hybrid (R50+ViT).

  Attributes:
    num_classes: size of the `head`; 0 or None returns the representation.
    patch_size: side of the square patches (1 for hybrids).
    hidden_size, mlp_dim, num_heads, num_layers: the Table 1 dimensions.
    representation_size: width of the `pre_logits` Dense+tanh layer of the
      pre-training head, or None for none.
    classifier: "token" (class token), "gap" (mean over patch tokens) or
      "map" (multihead attention pooling, `MAPHead`: big_vision's
      `pool_type="map"`, e.g. SigLIP's image towers; no class token).
    posemb: "learn" (the paper's learned 1-D position embeddings, class
      token's row included) or "sincos2d" (fixed 2-D sine-cosine ones added
      to the patch tokens before the class token: no parameter; big_vision's
      plain ViT baselines, `sincos2d`).
    resnet_layers / resnet_width: units per stage and width factor of the
      hybrid's ResNet stem (e.g. (3, 4, 9), 1 for R50+ViT-B/16).
    head_bias_init: constant for the head bias (e.g. -10 for i21k pre-training).
    gelu_approximate: tanh GELU (the public JAX checkpoints) or exact erf GELU
      (False: Hugging Face ViTs with `hidden_act="gelu"`).
    attention_impl: "xla", "cudnn" or "explicit" (`vit_jax.models.attention`;
      `models.from_config` resolves "auto" from the platform).
    capture_attention: sow every block's softmax weights (`vit_jax.inspect`).
    stochastic_depth: drop-path rate of the last block, linearly less for
      earlier ones (0: off; DeiT / AugReg use 0.1 for ViT-B).
    scan_layers / remat: see `Encoder` (same numbers, less compile time and
      memory for deep models).
    recompute_internals: see `Encoder` (same numbers; False keeps every
      LayerNorm/GELU/attention intermediate for the backward pass, and a
      float32 model is then plain autodiff: `jax.jvp`, `jax.jacfwd` and
      Hessian-vector products work, `recompute.plain_autodiff`).
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
  posemb: str = 'learn'
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  resnet_layers: Optional[Sequence[int]] = None
  resnet_width: float = 1.0
  head_bias_init: float = 0.0
  gelu_approximate: bool = True
  attention_impl: str = 'xla'
  capture_attention: bool = False
  stochastic_depth: float = 0.0
  scan_layers: bool = False
  remat: bool | str = False
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  recompute_internals: bool = True

  @property
  def stride(self) -> int:
    """Pixels per token along each side."""
    stem = (resnet.stem_stride(self.resnet_layers)
            if self.resnet_layers is not None else 1)
    return stem * self.patch_size

  @property
  def drops_partial_patches(self) -> bool:
    """A plain ViT's VALID patch convolution leaves out the pixels past the
    last whole patch (see `inputs.check_image_shape`); a hybrid's ResNet stem
    pads instead, so its images must tile exactly."""
    return self.resnet_layers is None

  @nn.compact
  def __call__(self, images, *, train: bool = False):
    tokens, grid = embed_patches(self, images)
    x = encode(self, tokens, grid, train=train)
    if self.classifier == 'token':
      x = x[:, 0]
    elif self.classifier == 'map':
      x = MAPHead(self.num_heads, self.mlp_dim, self.gelu_approximate,
                  self.dtype, self.param_dtype)(x)
    else:
      x = jnp.mean(x, axis=1)

    plain = recompute.plain_autodiff(self.dtype, self.recompute_internals)
    dot_general = matmul.dot_general_for(plain)
    if self.representation_size:
      # Named as an MLP's first layer: the representation is split over
      # the `model` mesh axis under tensor parallelism.
      x = nn.Dense(self.representation_size, dtype=self.dtype,
                   param_dtype=self.param_dtype,
                   kernel_init=with_axes(nn.initializers.lecun_normal(),
                                         ('embed', 'mlp')),
                   bias_init=with_axes(nn.initializers.zeros, ('mlp',)),
                   dot_general=dot_general, name='pre_logits')(x)
      x = nn.tanh(x)
    # The image representation (few-shot evaluators read it from here).
    self.sow('intermediates', 'representation', x)
    if not self.num_classes:
      return x
    return dense.head(self, self.num_classes, self.head_bias_init,
                      dot_general=dot_general)(x)


def embed_patches(module: VisionTransformer, images):
  """(tokens, grid): the patch tokens (batch, grid_h * grid_w, hidden) of
  `images`, row-major, and their (grid_h, grid_w): the hybrid stem (if any)
  and the `embedding` projection.

  Call it inside `module`'s compact method (its parameters are created
  there); `encode` continues. Self-supervised models put their corruption
  between the two (see `vit_jax.selfsup`).
  """
  if module.classifier not in CLASSIFIERS:
    raise ValueError(f'classifier must be one of {CLASSIFIERS}, got '
                     f'{module.classifier!r}')
  if module.posemb not in POSEMBS:
    raise ValueError(f'posemb must be one of {POSEMBS}, got '
                     f'{module.posemb!r}')
  check_image_shape(images.shape, module.stride,
                    drops_partial=module.drops_partial_patches)
  x = images
  if module.resnet_layers is not None:  # () : the root block alone.
    x = resnet.hybrid_stem(x, module.resnet_layers, module.resnet_width,
                           module.dtype, module.param_dtype)
  p = module.patch_size
  x = nn.Conv(module.hidden_size, (p, p), strides=(p, p), padding='VALID',
              dtype=module.dtype, param_dtype=module.param_dtype,
              kernel_init=with_axes(nn.initializers.lecun_normal(),
                                    (None, None, None, 'embed')),
              bias_init=with_axes(nn.initializers.zeros, ('embed',)),
              name='embedding')(x)
  n, h, w, c = x.shape
  return jnp.reshape(x, (n, h * w, c)), (h, w)


def encode(module: VisionTransformer, x, grid, *, train: bool):
  """The class token (if any), position embeddings and the `Transformer`
  encoder over patch tokens `x` of a (rows, cols) `grid`; returns every
  output token (class token first), after the final LayerNorm."""
  n, _, c = x.shape
  if module.posemb == 'sincos2d':  # Before the class token, which has none.
    x = x + jnp.asarray(sincos2d(grid, c), x.dtype)
  if module.classifier == 'token':
    cls = module.param('cls', with_axes(nn.initializers.zeros,
                                        (None, None, 'embed')),
                       (1, 1, c), module.param_dtype)
    x = jnp.concatenate([jnp.tile(cls.astype(x.dtype), (n, 1, 1)), x], 1)
  return Encoder(num_layers=module.num_layers, mlp_dim=module.mlp_dim,
                 num_heads=module.num_heads, dropout_rate=module.dropout_rate,
                 attention_dropout_rate=module.attention_dropout_rate,
                 gelu_approximate=module.gelu_approximate,
                 attention_impl=module.attention_impl,
                 capture_attention=module.capture_attention,
                 stochastic_depth=module.stochastic_depth,
                 scan_layers=module.scan_layers, remat=module.remat,
                 dtype=module.dtype, param_dtype=module.param_dtype,
                 recompute_internals=module.recompute_internals,
                 learned_posemb=module.posemb == 'learn',
                 name='Transformer')(x, train=train)


def vit_flops(spec, h: int, w: int, num_classes: int) -> float:
  """Matmul and convolution FLOPs of a ViT (with its hybrid stem, if any)."""
  flops, c = 0.0, 3
  if spec.get('resnet_layers') is not None:
    flops, (h, w, c) = resnet.bottleneck_flops(
        h, w, spec['resnet_layers'], spec.get('resnet_width', 1.0))
  p, d, m = spec['patch_size'], spec['hidden_size'], spec['mlp_dim']
  patches = (h // p) * (w // p)
  n = patches + (spec.get('classifier', 'token') == 'token')
  flops += 2.0 * patches * p * p * c * d  # Patch embedding.
  per_layer = (2.0 * n * d * 3 * d  # q, k, v projections.
               + 2.0 * 2 * n * n * d  # q.k logits and attention x v.
               + 2.0 * n * d * d  # Output projection.
               + 2.0 * 2 * n * d * m)  # MLP.
  flops += spec['num_layers'] * per_layer
  if spec.get('classifier') == 'map':  # One query over the patch tokens.
    flops += (2.0 * 2 * d * d  # Its query and output projections.
              + 2.0 * 2 * patches * d * d  # Keys and values.
              + 2.0 * 2 * patches * d  # Logits and weighted sum.
              + 2.0 * 2 * d * m)  # MLP.
  rep = spec.get('representation_size') or 0
  if rep:
    flops += 2.0 * d * rep
  return flops + 2.0 * (rep or d) * (num_classes or 0)


def vit_shrink(spec):
  """Width 32, 2 layers, same patch size (and stem depth: one unit per stage,
  half width); the image size gives a 2x2 patch grid."""
  out = dict(hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2)
  if spec.get('representation_size'):
    out['representation_size'] = 32
  stride = spec['patch_size']
  if spec.get('resnet_layers') is not None:
    out['resnet_layers'] = (1,) * len(spec['resnet_layers'])
    out['resnet_width'] = 0.5
    stride *= resnet.stem_stride(spec['resnet_layers'])
  return out, 2 * stride


# Table 1 of the paper, plus the Ti and S widths of the public checkpoints.
WIDTHS = {
    # width: (hidden_size, mlp_dim, num_heads, num_layers)
    'Ti': (192, 768, 3, 12),
    'S': (384, 1536, 6, 12),
    'B': (768, 3072, 12, 12),
    'L': (1024, 4096, 16, 24),
    'H': (1280, 5120, 16, 32),
}


def dims(width: str, patch: int, **extra):
  """The module arguments of a ViT of width `width` (a key of WIDTHS)."""
  hidden, mlp, heads, layers = WIDTHS[width]
  return dict(patch_size=patch, hidden_size=hidden, mlp_dim=mlp,
              num_heads=heads, num_layers=layers, **extra)


FAMILY = registry.Family('ViT', VisionTransformer, vit_flops, vit_shrink)
registry.register(FAMILY, {
    f'ViT-{width}/{patch}': dims(width, patch)
    for width, patch in (('Ti', 16), ('S', 16), ('S', 32), ('B', 32),
                         ('B', 16), ('B', 8), ('L', 32), ('L', 16), ('H', 14))
})
