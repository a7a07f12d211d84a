"""Validation of the images a model is called with."""

from typing import Optional, Sequence, Tuple


def check_image_shape(shape: Sequence[int], stride: int) -> None:
  """Raises a ValueError naming the fix when images cannot be cut in patches."""
  if len(shape) != 4:
    raise ValueError(f'images must be NHWC (4 dims), got shape {tuple(shape)}')
  _, h, w, c = shape
  if h < 1 or w < 1:
    raise ValueError(f'image size {h}x{w}: images need at least one patch '
                     f'({stride}x{stride} pixels)')
  if h % stride or w % stride:
    near = lambda n: max(stride, (n + stride // 2) // stride * stride)
    raise ValueError(
        f'image size {h}x{w} is not divisible by the patch size {stride} '
        f'(pixels per token): use an image size that is a multiple of {stride}, '
        f'e.g. {near(h)}x{near(w)}')
  if c not in (1, 3):
    raise ValueError(f'images must have 1 or 3 channels, got {c} '
                     f'(shape {tuple(shape)}, expected NHWC)')


def patch_grid(model, image_shape: Sequence[int]
               ) -> Optional[Tuple[int, int]]:
  """(rows, cols) of tokens `model` cuts (H, W, ...) images into; None for a
  model without a patch grid (BiT)."""
  stride = getattr(model, 'stride', None)
  if stride is None:
    return None
  return image_shape[0] // stride, image_shape[1] // stride
