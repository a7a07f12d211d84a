"""What masked patch prediction predicts for each patch (paper Appendix B.1.2).

Images are NHWC in [-1, 1]; patches are cut in row-major order (the order of
the ViT's patch tokens). Three targets:

  * `patch_colour_targets`: the patch's mean colour, each channel mapped to
    [0, 1] and quantised to `2**bits` levels (`min(floor(v * 2**bits),
    2**bits - 1)`), combined first-channel-most-significant into one class
    out of `2**(bits * channels)` (512 for RGB at 3 bits, 8 for 1 channel);
  * `downsized_targets`: the same colour classes for each cell of a
    `size` x `size` (4x4) downsized patch: `size**2` independent predictions;
  * `pixel_targets`: the full patch's pixel values, for L2 regression.

`check_value_range` refuses input pipelines whose images are not in that
range (training and `--config.mode=eval` both call it).
"""

from __future__ import annotations

import jax.numpy as jnp

MAX_BITS = 8


def _check_bits(bits: int) -> None:
  if isinstance(bits, bool) or not isinstance(bits, int) or not (
      1 <= bits <= MAX_BITS):
    raise ValueError(f'bits={bits!r} is out of range: expected an integer '
                     f'from 1 to {MAX_BITS} (the paper uses 3: 8 levels per '
                     'channel, 512 colour classes)')


def num_classes(bits: int, channels: int) -> int:
  """Colour classes of one prediction: 2**(bits * channels)."""
  _check_bits(bits)
  return 2 ** (bits * channels)


def patches(images, patch_size: int):
  """(batch, grid_h * grid_w, patch, patch, channels), row-major."""
  if images.ndim != 4:
    raise ValueError(f'images must be NHWC (4 dims), got shape '
                     f'{tuple(images.shape)}')
  b, h, w, c = images.shape
  p = int(patch_size)
  if p < 1 or h % p or w % p:
    raise ValueError(
        f'image size {h}x{w} is not divisible by the patch size {p}: use an '
        f'image size that is a multiple of {p}, e.g. {max(p, h // p * p)}')
  x = jnp.reshape(images, (b, h // p, p, w // p, p, c))
  x = jnp.transpose(x, (0, 1, 3, 2, 4, 5))
  return jnp.reshape(x, (b, (h // p) * (w // p), p, p, c))


def check_value_range(input_config, target: str) -> None:
  """The colour targets (colour, downsized; not pixels, a regression)
  quantise pixel values in [-1, 1]: images of another range
  (value_range(0,1), or none: 0-255, or in_min/in_max that saturate) would
  train on a few levels or one constant class without any error, and an
  evaluation on them would report a meaningless accuracy. A pipeline whose
  range is unknown (an op of the user's own after its last value_range) is
  not refused. `input_config`: `config.input` (`pp_train`, `pp_eval`,
  `image_size`)."""
  if target == 'pixels':
    return
  # Imported here: `vit_jax.selfsup` is imported by the config check, which
  # refuses bad values before TensorFlow (which `preprocess` loads) is.
  from vit_jax.data import preprocess
  from vit_jax.data.errors import DataError
  for field in ('pp_train', 'pp_eval'):
    spec = input_config.get(field)
    if not spec:
      continue
    found = preprocess.output_range(spec, input_config.get('image_size') or 0)
    if found is None or found == preprocess.MINUS_ONE_TO_ONE:
      continue
    # A DataError: the trainer's and `mode=eval`'s one line, no traceback.
    raise DataError(
        f'objective=mpp predicts colours of pixels in [-1, 1], but '
        f'input.{field}={spec!r} gives '
        f'{preprocess.describe_range(found)}: end it with value_range(-1,1)')


def quantise(values, bits: int):
  """Values in [-1, 1] (..., channels) -> one int32 class per position:
  levels `min(floor((v + 1) / 2 * 2**bits), 2**bits - 1)`, first channel
  most significant."""
  _check_bits(bits)
  levels = 2 ** bits
  v = (values.astype(jnp.float32) + 1.0) / 2.0
  q = jnp.clip(jnp.floor(v * levels), 0, levels - 1).astype(jnp.int32)
  out = jnp.zeros(q.shape[:-1], jnp.int32)
  for i in range(q.shape[-1]):
    out = out * levels + q[..., i]
  return out


def patch_colour_targets(images, patch_size: int, bits: int = 3):
  """int32 (batch, grid_h * grid_w): each patch's quantised mean colour."""
  _check_bits(bits)
  x = patches(images, patch_size).astype(jnp.float32)
  return quantise(jnp.mean(x, axis=(2, 3)), bits)


def downsized_targets(images, patch_size: int, bits: int = 3, size: int = 4):
  """int32 (batch, grid_h * grid_w, size * size): the colour class of each
  cell of the patch averaged down to size x size (row-major cells)."""
  _check_bits(bits)
  if patch_size % size:
    raise ValueError(f'the {size}x{size} downsized target needs a patch size '
                     f'divisible by {size}, got {patch_size}: use '
                     "mpp.target='colour' or a model with such patches")
  x = patches(images, patch_size).astype(jnp.float32)
  b, n, p, _, c = x.shape
  k = p // size
  x = jnp.reshape(x, (b, n, size, k, size, k, c)).mean(axis=(3, 5))
  return quantise(jnp.reshape(x, (b, n, size * size, c)), bits)


def pixel_targets(images, patch_size: int):
  """float32 (batch, grid_h * grid_w, patch * patch * channels)."""
  x = patches(images, patch_size).astype(jnp.float32)
  return jnp.reshape(x, (*x.shape[:2], -1))
