"""How multi-head self-attention turns q, k and v into its output.

The encoder blocks' `attention_impl` picks one of:

  * "xla": `jax.nn.dot_product_attention` (XLA's fused attention; on CPUs
    the same computation as batched matmuls in the layout of XLA:CPU's
    library kernel, with flash attention's backward pass, `_cpu_core`; the
    softmax weights are never handed back to the caller);
  * "cudnn": the same call with cuDNN flash attention (NVIDIA GPUs, bf16 or
    fp16 compute; cuDNN must be present when the step is traced: jax builds
    the call only where it finds a GPU and cuDNN). Odd sequence lengths (a
    ViT's 197 tokens) are padded to even ones, which cuDNN's backward pass
    needs (`even_lengths`). A program traced for NVIDIA GPUs
    (`platform_switch.tracing_for` "gpu" or "cuda": a GPU mesh's train
    step, an export for CUDA) that cannot have the cuDNN call (no cuDNN on
    the tracing host, shapes cuDNN refuses) is an error rather than another
    program; one traced for other platforms only takes "xla" (cuDNN cannot
    run there), with a warning; where the platforms are unknown, a block
    whose cuDNN call cannot be built falls back to "xla" with a warning
    (`_without_cudnn`);
  * "explicit": softmax weights as an array (flax's `dot_product_attention`
    with the project's mixed-precision matmul, float32 logits and softmax as
    "xla"). Used whenever a caller needs the weights (`vit_jax.inspect`) or
    attention dropout is active in training, and by ONNX export.

Plain-autodiff models (`recompute.plain_autodiff`: float32 without
`recompute_internals`) trace no custom VJP here, so forward-mode autodiff
works: "xla"'s CPU core is its forward computation under autodiff's own
backward pass, "explicit" takes `matmul.plain_dot_general`. ("cudnn" is
jax's cuDNN call, half precision only.)

`resolve(impl, platform, dtype)` turns "auto" into one of these from the
platform the program will run on, which callers know from their mesh: no
decision is taken from the tracing host's `jax.default_backend()`, so a step
exported on a CPU host for a TPU is the TPU program.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from vit_jax.models import dense
from vit_jax.models import matmul
from vit_jax.models import platform_switch
from vit_jax.models import recompute

Dtype = Any

IMPLEMENTATIONS = ('xla', 'cudnn', 'explicit')
CHOICES = ('auto',) + IMPLEMENTATIONS
# The platforms (`resolve`'s, `platform_switch.tracing_for`'s) of NVIDIA GPUs.
NVIDIA = ('gpu', 'cuda')


def check(impl: str) -> str:
  if impl not in CHOICES:
    raise ValueError(f'attention_impl={impl!r}: expected one of '
                     f'{", ".join(CHOICES)}')
  return impl


def resolve(impl: str | None, platform: str, dtype) -> str:
  """'auto' (or None): cuDNN flash attention for bf16/fp16 on NVIDIA GPUs,
  XLA otherwise; any other choice is kept."""
  impl = check(impl or 'auto')
  if impl != 'auto':
    return impl
  half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  return 'cudnn' if platform in NVIDIA and half else 'xla'


def even_lengths(query, key, value, mask, implementation: str):
  """`jax.nn.dot_product_attention` with odd sequence lengths padded by one.

  cuDNN's flash attention has no backward pass for an odd query or key
  length, and a ViT's is odd (196 patches + the class token). Without a mask,
  an odd length gets one zero query row, sliced off the output, and one zero
  key and value that the kernel's own padding mask (`key_value_seq_lengths`)
  hides: every query attends to exactly its keys, so outputs and gradients
  are those of the unpadded call. q, k, v: (batch, length, heads, head_dim).
  The encoder pads its tokens once instead (`vit.Encoder`, `valid_length`),
  which saves these per-layer pads and slices.
  """
  t, s = query.shape[1], key.shape[1]
  if mask is not None or (t % 2 == 0 and s % 2 == 0):
    return jax.nn.dot_product_attention(query, key, value, mask=mask,
                                        implementation=implementation)

  def pad(x):
    return jnp.pad(x, ((0, 0), (0, x.shape[1] % 2), (0, 0), (0, 0)))

  return _valid_only(pad(query), pad(key), pad(value), t, s,
                     implementation)[:, :t]


def _valid_only(query, key, value, t: int, s: int, implementation: str):
  """Attention of the first `t` queries over the first `s` keys and values
  (the rest: padding, hidden by the kernel's own sequence-length mask;
  padded query rows come out as zeros)."""
  b = query.shape[0]
  return jax.nn.dot_product_attention(
      query, key, value,
      query_seq_lengths=jnp.full((b,), t, jnp.int32),
      key_value_seq_lengths=jnp.full((b,), s, jnp.int32),
      implementation=implementation)


def _keys_mask(mask, valid_length: int, key_length: int):
  """`mask` (or none) and a mask that hides keys from `valid_length` on,
  broadcastable to (batch, heads, queries, keys)."""
  keep = (jnp.arange(key_length) < valid_length)[None, None, None, :]
  return keep if mask is None else jnp.logical_and(mask, keep)


def _xla(query, key, value, mask, recomputed: bool = False,
         plain: bool = False):
  """`jax.nn.dot_product_attention(implementation='xla')`; on CPUs the same
  computation as canonical-layout batched matmuls with a backward pass of
  their own (`_cpu_core`). `recomputed`: on TPUs and GPUs the backward pass
  recomputes the logits and softmax from q, k, v instead of keeping them
  (flash attention's trade: 2% more FLOPs for ViT-B/16, no (heads, tokens,
  tokens) arrays kept per layer); the CPU core always does, except with
  `plain` (no custom VJP: autodiff's backward pass, forward mode works)."""
  def default(q, k, v, mask):
    return jax.nn.dot_product_attention(q, k, v, mask=mask,
                                        implementation='xla')
  if recomputed:
    default = recompute.recompute(default)
  return platform_switch.switch(
      query, key, value,
      cpu=lambda q, k, v: _cpu_core(q, k, v, mask, plain),
      default=lambda q, k, v: default(q, k, v, mask))


# The CPU core's backward pass pads token axes to a multiple of this.
PAD = 16


def _padded(n):
  return -(-n // PAD) * PAD


def _heads_major(x):
  """(B, L, N, H) -> (B * N, L, H)."""
  b, l, n, h = x.shape
  return jnp.swapaxes(x, 1, 2).reshape(b * n, l, h)


def _tokens_major(x, b: int, n: int, length: int):
  """`_heads_major`'s inverse: (B * N, L', H) -> (B, L, N, H), the first
  `length` of L' rows (the rest: padding)."""
  return jnp.swapaxes(x.reshape(b, n, -1, x.shape[-1])[:, :, :length], 1, 2)


def _scale(q):
  """The logits' scale, 1 / sqrt(head size)."""
  return jnp.float32(1.0 / math.sqrt(q.shape[-1]))


def _pad_rows(x):
  """(G, L, ...) -> (G, L', ...), zero rows appended up to L' = `_padded(L)`."""
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, _padded(x.shape[1]) - x.shape[1])
  return jnp.pad(x, pad)


# The float32 logit of a masked key (jax's XLA attention's); a Python float
# (weakly typed: keeps the logits' float32).
_BIG_NEGATIVE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _masked(logits, mask, shape):
  """`logits` (B * N, T', S') whose first (T, S) of `shape` (B, N, T, S) are
  real, the rest padding: keys past S, and those `mask` drops, get a large
  negative logit (padded query rows: every key)."""
  b, n, t, s = shape
  if mask is not None:
    keep = jnp.broadcast_to(mask, shape).reshape(b * n, t, s)
    keep = jnp.pad(keep, ((0, 0), (0, logits.shape[1] - t),
                          (0, logits.shape[2] - s)))
  elif logits.shape[2] > s:
    keep = jnp.arange(logits.shape[2]) < s
  else:
    return logits
  return jnp.where(keep, logits, _BIG_NEGATIVE)


def _logits(q, k, mask, shape):
  """Scaled, masked float32 logits of heads-major q, k."""
  logits = matmul.cpu_batched(q, k, jnp.float32, trans_b=True)
  return _masked(logits * _scale(q), mask, shape)


def _cpu_core(query, key, value, mask, plain: bool = False):
  """What `jax.nn.dot_product_attention`'s XLA implementation computes:
  float32 logits (bf16 products accumulated in float32), scaled, masked,
  float32 softmax, probabilities in the inputs' dtype times the values.

  Written as (batch x heads) batched matmuls in the layout XLA:CPU's
  library kernel takes (`matmul.cpu_batched`): XLA's own lowering
  of the (B, T, N, H) einsums runs them as float32 loops on CPUs, 3x slower
  in the forward pass (ViT-B/16, docs/performance.md). The backward pass is
  flash attention's, written for the same kernel: it keeps q, k, v and the
  softmax's log-normaliser, recomputes the probabilities once the
  cotangent has arrived, and takes every product in the canonical layout,
  transposing the small (tokens, head_dim) operands, never the (tokens,
  tokens) ones, on token axes padded to a multiple of PAD (the 'onednn'
  CPU form reads the transposed operands in place). Autodiff of the
  forward pass ran XLA:CPU's transposes and float32 fallbacks: 1.4x the
  time of a ViT-B/16 layer's attention, forward and backward
  (docs/performance.md). The backward products take the cotangents rounded
  to the inputs' dtype, as flash attention kernels do.

  The output is named as `matmul.dot_general`'s batched products are, so
  that the "dots_saveable" remat policy keeps it (`vit_jax.models.remat`).
  `plain`: the forward computation alone, differentiated by autodiff (no
  custom VJP; `recompute.plain_autodiff`).
  """
  if plain:
    out = _flash_fwd(key.shape[1], query, key, value, mask)[0]
  else:
    out = _flash(key.shape[1], query, key, value, mask)
  return checkpoint_name(out, matmul.BATCHED_NAME)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(kv_len, query, key, value, mask):
  return _flash_fwd(kv_len, query, key, value, mask)[0]


def _flash_fwd(kv_len, query, key, value, mask):
  """The output, and what the backward pass keeps: heads-major q, k, v,
  the mask and the softmax's log-normaliser."""
  del kv_len
  b, t, n, _ = query.shape
  shape = (b, n, t, key.shape[1])
  q, k, v = _heads_major(query), _heads_major(key), _heads_major(value)
  logits = _logits(q, k, mask, shape)
  top = jnp.max(logits, axis=-1, keepdims=True)
  unnormalised = jnp.exp(logits - top)
  total = jnp.sum(unnormalised, axis=-1, keepdims=True)
  probs = (unnormalised / total).astype(value.dtype)
  out = matmul.cpu_batched(probs, v, value.dtype)
  return _tokens_major(out, b, n, t), (q, k, v, mask, top + jnp.log(total))


def _flash_bwd(kv_len, res, g):
  q, k, v, mask, lse = res
  b, t, n, _ = g.shape
  # Tied to the cotangent: no schedule can run this before the backward
  # pass reaches it (see `recompute`).
  q, k, v, lse = recompute.tie((q, k, v, lse), g)
  # Token axes padded to a multiple of PAD: XLA:CPU's batched bf16 kernel
  # runs 197-token products slower than 208-token ones (docs/performance.md).
  # Padded query rows get a zero cotangent, padded keys a zero probability:
  # neither reaches the gradients.
  q, k, v, lse = (_pad_rows(x) for x in (q, k, v, lse))
  shape = (b, n, t, kv_len)
  bf = matmul.cpu_batched
  g = _pad_rows(_heads_major(g.astype(v.dtype)))  # (BN, T', H)
  probs = jnp.exp(_logits(q, k, mask, shape) - lse)  # float32 (BN, T', S')
  dprobs = bf(g, v, jnp.float32, trans_b=True)
  dlogits = probs * (dprobs - jnp.sum(dprobs * probs, -1, keepdims=True))
  dlogits = (dlogits * _scale(q)).astype(q.dtype)
  dq = bf(dlogits, k, q.dtype)
  # dK = dlogits^T q and dV = probs^T g: products over the rows of both
  # operands (`cpu_batched`'s trans_a: read in place on oneDNN, else
  # computed as (H, T) x (T, S) products and transposed to (S, H)).
  dk = bf(dlogits, q, k.dtype, trans_a=True)
  dv = bf(probs.astype(v.dtype), g, v.dtype, trans_a=True)
  return (_tokens_major(dq, b, n, t), _tokens_major(dk, b, n, kv_len),
          _tokens_major(dv, b, n, kv_len), None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _for_nvidia(query) -> bool:
  """Whether "cudnn" attention should build its cuDNN call: unless the
  program is traced for platforms none of which is an NVIDIA GPU (cuDNN
  cannot run there: "xla", with a warning, whatever the tracing host has)."""
  targets = platform_switch.targets()
  if targets is None or any(p in NVIDIA for p in targets):
    return True
  logging.warning("attention_impl='cudnn' in a program traced for %s: "
                  "cuDNN runs on NVIDIA GPUs only; using attention_impl='xla' "
                  'for q%s %s', '/'.join(targets), query.shape, query.dtype)
  return False


def _without_cudnn(query, error: Exception) -> None:
  """jax could not build the cuDNN call (`error`): "xla" with a warning where
  the program's platforms are unknown; an error where it is traced for
  NVIDIA GPUs, where the fallback would make the program depend on the
  host that traces it (XLA attention from a CPU host exporting for CUDA,
  cuDNN's from a GPU host)."""
  targets = platform_switch.targets()
  if targets is not None:
    raise ValueError(
        f"attention_impl='cudnn': jax cannot build cuDNN flash attention "
        f'for q{query.shape} {query.dtype} here ({error}), in a program '
        f'traced for {"/".join(targets)}. jax builds the cuDNN call only on '
        'a host with an NVIDIA GPU and cuDNN, for bf16/fp16 and shapes '
        "cuDNN takes: trace the program there, or set attention_impl='xla' "
        '(the same attention, XLA-fused)') from error
  logging.warning('cuDNN attention unavailable for q%s %s (%s); using '
                  "attention_impl='xla'", query.shape, query.dtype, error)


def attention_fn(impl: str, recompute: bool = False,
                 valid_length: Optional[int] = None, plain: bool = False):
  """An `attention_fn` for `flax.linen.MultiHeadDotProductAttention`;
  `recompute`: "xla" keeps only its inputs for the backward pass;
  `valid_length`: the tokens from this index on are padding, hidden as keys
  (cuDNN's sequence-length mask, a key mask elsewhere); their outputs are
  whatever the implementation gives and must be dropped by the caller;
  `plain`: no custom VJP ("xla", "explicit"; `recompute.plain_autodiff`)."""
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f'attention_impl={impl!r} must be resolved to one of '
                     f'{", ".join(IMPLEMENTATIONS)} (see attention.resolve)')

  # Flax passes only the keyword arguments this signature names.
  def fn(query, key, value, mask=None, dropout_rng=None, dropout_rate=0.0,
         broadcast_dropout=True, deterministic=False, dtype=None,
         precision=None, module=None):
    dropout = dropout_rate > 0.0 and not deterministic
    fused = not (impl == 'explicit' or dropout or module is not None)
    lengths_only = valid_length is not None and mask is None
    if valid_length is not None:
      mask = _keys_mask(mask, valid_length, key.shape[1])
    if impl == 'cudnn' and fused and _for_nvidia(query):
      try:
        if lengths_only:
          return _valid_only(query, key, value, valid_length, valid_length,
                             'cudnn')
        return even_lengths(query, key, value, mask, 'cudnn')
      except (RuntimeError, ValueError, NotImplementedError) as e:
        _without_cudnn(query, e)
    if not fused:
      return _explicit(
          query, key, value, mask, dropout_rng=dropout_rng,
          dropout_rate=dropout_rate, broadcast_dropout=broadcast_dropout,
          deterministic=deterministic, dtype=dtype, precision=precision,
          module=module, dot_general=matmul.dot_general_for(plain))
    return _xla(query, key, value, mask, recompute, plain)

  return fn


def _explicit(query, key, value, mask, *, dtype, precision, module,
              dot_general=matmul.dot_general, **dropout):
  """Flax's `dot_product_attention` with the numerics of "xla" (jax's
  `dot_product_attention`): float32 logits and softmax, whatever the
  compute dtype (bf16 logits of a trained model reach tens, where bf16
  steps by 0.125, and shift every weight), float32 weights sown for
  `vit_jax.inspect`; the weighted sum of the values in the compute dtype,
  by the project's mixed-precision matmul (`dot_general`)."""
  dtype = dtype or jnp.result_type(query, key, value)
  weights = _weights(query.astype(dtype), key.astype(dtype), mask,
                     dtype=dtype, precision=precision, module=module,
                     dot_general=dot_general, **dropout)
  return jnp.einsum('...hqk,...khd->...qhd', weights.astype(dtype),
                    value.astype(dtype), precision=precision,
                    _dot_general=dot_general)


def _weights(query, key, mask, *, dtype, precision, module, dropout_rng,
             dropout_rate, broadcast_dropout, deterministic,
             dot_general=matmul.dot_general):
  """Softmax weights (..., heads, queries, keys) in float32, as flax's
  `dot_product_attention_weights(force_fp32_for_softmax=True)` gives them
  (sown, then attention dropout with flax's masks), except that the
  1 / sqrt(head_dim) scale multiplies the float32 logits, as "xla" does,
  rather than the queries in the compute dtype: a bf16 query rounded
  after scaling by 1 / sqrt(80) (ViT-H/14) put the output 0.91% from
  float32 attention, against "xla"'s 0.77%."""
  logits = jnp.einsum('...qhd,...khd->...hqk', query, key,
                      precision=precision, preferred_element_type=jnp.float32,
                      _dot_general=dot_general)
  logits = logits * _scale(query)
  if mask is not None:
    logits = jnp.where(mask, logits, _BIG_NEGATIVE)
  weights = jax.nn.softmax(logits)
  if module:
    module.sow('intermediates', 'attention_weights', weights)
  if not deterministic and dropout_rate > 0.0:
    keep_prob = 1.0 - dropout_rate
    shape = ((1,) * (key.ndim - 2) + weights.shape[-2:] if broadcast_dropout
             else weights.shape)
    keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
    weights = weights * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype))
  return weights


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head self-attention with flax's `nn.MultiHeadDotProductAttention`
  parameters (`query`, `key`, `value`: kernel (embed, heads, head_dim), bias
  (heads, head_dim); `out`: kernel (heads, head_dim, embed), bias (embed))
  and numbers, its projections applied by `vit_jax.models.dense` (float32
  bias gradients).

  `impl`: a resolved implementation and `valid_length` the count of real
  tokens, the rest padding (`attention_fn`); without `recompute`, a float32
  block traces no custom VJP (`recompute.plain_autodiff`); `sow_weights=True`
  sows the softmax weights into `intermediates` as `attention_weights`
  (flax's name, read by `vit_jax.inspect`).
  """
  num_heads: int
  impl: str = 'xla'
  recompute: bool = False
  valid_length: Optional[int] = None
  dropout_rate: float = 0.0
  kernel_init: Callable = nn.initializers.xavier_uniform()
  bias_init: Callable = nn.initializers.zeros
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, inputs_kv=None, *, deterministic: bool,
               sow_weights: bool = False):
    """Self-attention over `x`; with `inputs_kv`, `x`'s tokens attend to
    those (queries from `x`, keys and values from `inputs_kv`)."""
    width = x.shape[-1]
    if width % self.num_heads:
      raise ValueError(f'hidden size {width} is not divisible by '
                       f'num_heads={self.num_heads}')
    heads = (self.num_heads, width // self.num_heads)
    plain = recompute.plain_autodiff(self.dtype, self.recompute)
    dot_general = matmul.dot_general_for(plain)
    project = functools.partial(
        dense.Dense, heads, ('embed', 'heads', 'kv'),
        kernel_init=self.kernel_init, bias_init=self.bias_init,
        dtype=self.dtype, param_dtype=self.param_dtype,
        dot_general=dot_general)
    kv = x if inputs_kv is None else inputs_kv
    query = project(name='query')(x)
    key, value = (project(name=n)(kv) for n in ('key', 'value'))
    dropout = self.dropout_rate > 0.0 and not deterministic
    fn = attention_fn(self.impl, self.recompute, self.valid_length, plain)
    y = fn(query, key, value,
           dropout_rng=self.make_rng('dropout') if dropout else None,
           dropout_rate=self.dropout_rate, broadcast_dropout=False,
           deterministic=not dropout, dtype=self.dtype,
           module=self if sow_weights else None)
    return dense.Dense(width, ('heads', 'kv', 'embed'), in_axes=2,
                       kernel_init=self.kernel_init,
                       bias_init=self.bias_init, dtype=self.dtype,
                       param_dtype=self.param_dtype, dot_general=dot_general,
                       name='out')(y)
