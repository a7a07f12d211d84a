"""Validation of the images a model is called with."""

from typing import Optional, Sequence, Tuple

from absl import logging


# (height, width, stride) already said to leave pixels out.
_WARNED = set()


def check_image_shape(shape: Sequence[int], stride: int, *,
                      drops_partial: bool = False) -> None:
  """Raises a ValueError naming the fix when images cannot be cut in patches.

  `drops_partial`: the model's patches are a VALID stride-`stride`
  convolution (a plain ViT), which cuts `size // stride` patches per
  side and never sees the last `size % stride` rows and columns, as the
  reference implementation does (ViT-H/14 at the paper's 384 px: a 27x27
  grid over 378x378 pixels). Such sizes are logged, not refused.
  """
  if len(shape) != 4:
    raise ValueError(f'images must be NHWC (4 dims), got shape {tuple(shape)}')
  _, h, w, c = shape
  if c not in (1, 3):  # First: NCHW images would fail the size checks.
    nchw = (' (they look NCHW, as PyTorch keeps them: transpose them with '
            'x.transpose(0, 2, 3, 1))' if h in (1, 3) else '')
    raise ValueError(f'images must have 1 or 3 channels, got {c} '
                     f'(shape {tuple(shape)}, expected NHWC){nchw}')
  if h < 1 or w < 1 or (drops_partial and (h < stride or w < stride)):
    raise ValueError(f'image size {h}x{w}: images need at least one patch '
                     f'({stride}x{stride} pixels)')
  if (h % stride or w % stride) and drops_partial:
    if (h, w, stride) not in _WARNED:  # Once per size: every trace checks.
      _WARNED.add((h, w, stride))
      logging.warning(
          'image size %dx%d is not a multiple of the patch size %d: the '
          'model sees a %dx%d grid of patches (%dx%d pixels); the last %d '
          'rows and %d columns of pixels are not seen (as in the reference '
          'implementation)', h, w, stride, h // stride, w // stride,
          h // stride * stride, w // stride * stride, h % stride, w % stride)
  elif h % stride or w % stride:
    near = lambda n: max(stride, (n + stride // 2) // stride * stride)
    raise ValueError(
        f'image size {h}x{w} is not divisible by the patch size {stride} '
        f'(pixels per token): use an image size that is a multiple of {stride}, '
        f'e.g. {near(h)}x{near(w)}')


def patch_grid(model, image_shape: Sequence[int]
               ) -> Optional[Tuple[int, int]]:
  """(rows, cols) of tokens `model` cuts (H, W, ...) images into; None for a
  model without a patch grid (BiT). A partial last patch is left out by a
  plain ViT (`drops_partial_patches`), padded by Mixer's stem (a token of
  its own); other models take whole patches only."""
  stride = getattr(model, 'stride', None)
  if stride is None:
    return None
  if getattr(model, 'drops_partial_patches', False):
    return image_shape[0] // stride, image_shape[1] // stride
  return -(-image_shape[0] // stride), -(-image_shape[1] // stride)
