"""Pre-processing ops: per-example transforms that run in tf.data on the host.

Every op is made by a factory registered under its name; the factory takes
the op's arguments and returns `fn(features, seed) -> features`. `features`
is the example dict (`image`, `label`, ...); `seed` is a shape-[2] integer
tensor, distinct per op and per example, that random ops feed to TensorFlow's
stateless random functions: the same seed gives the same output on any
machine, whatever the tf.data parallelism.

| op | what it does |
|---|---|
| `decode(channels=3)` | encoded JPEG/PNG/GIF/BMP -> uint8 HxWxC; uint8 input passes (channels adjusted) |
| `inception_crop(size=None, area_min=0.05, area_max=1.0, aspect_min=0.75, aspect_max=1.333)` | random crop of 5-100% of the area (then resized to `size`) |
| `decode_jpeg_and_inception_crop(size=None, ...)` | the two above fused: decodes only the crop window of a JPEG |
| `resize(h, w=h, method='bilinear', antialias=False)` | resize to h x w (float32 out); `resize((h, w))` too |
| `resize_small(size, method='bilinear', antialias=False)` | resize the shorter side to `size`, keep the aspect ratio (big_vision's defaults to `method='area'`) |
| `random_crop(h, w=h)` | random h x w crop (an image smaller than the crop fails: resize first); `(h, w)` too |
| `central_crop(h, w=h)` | central h x w crop (likewise) |
| `flip_lr` | random left-right flip |
| `randaug(num_layers=2, magnitude=10)`, `random_erasing(...)` | RandAugment and random erasing (`randaug.py`) |
| `value_range(vmin=-1, vmax=1, in_min=0, in_max=255, clip=True)` | affine map of pixel values |
| `to_rgb` | grayscale (1 channel) -> 3 channels |
| `onehot(depth, on=1.0, off=0.0)` | label -> float32 one-hot [depth] |
| `keep(*keys)` | drop every other feature |

Sizes are whole pixel counts (`resize(8.5)` is refused, `resize(224.0)` is
224). A crop of an image smaller than the crop fails with a tagged assertion
that `explain_error` turns into a `DataError` naming the op and the fix.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from typing import Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from vit_jax import registration
from vit_jax.data.errors import DataError

Features = Dict[str, tf.Tensor]
OpFn = Callable[[Features, tf.Tensor], Features]

_FACTORIES: Dict[str, Tuple[Callable[..., OpFn], bool]] = {}


def register(name: str, *, random: bool = False, pixels: bool = False):
  """Registers `factory(*args) -> OpFn` as op `name` (`random`: uses seed;
  `pixels`: works on [0, 255] pixel values, so it must come before
  `value_range`). A taken name is refused (a built-in op replaced silently
  would change every preset using it), but for the same definition run
  again (a config file runs twice: `vit_jax.registration`)."""
  def deco(factory):
    registration.check_free('pre-processing op', name,
                            _FACTORIES.get(name, (None,))[0], factory)
    _FACTORIES[name] = (factory, random, pixels)
    return factory
  return deco


def names() -> List[str]:
  return sorted(_FACTORIES)


def is_random(name: str) -> bool:
  return _FACTORIES[name][1]


def needs_pixels(name: str) -> bool:
  return _FACTORIES[name][2]


def is_builtin(name: str) -> bool:
  """Whether op `name` is one of this package's (its effect on pixel values
  is known), not one registered by a user's module."""
  return _FACTORIES[name][0].__module__.startswith('vit_jax.data.')


def make(name: str, *args, **kwargs) -> OpFn:
  """Builds op `name`; errors list the known ops or the op's signature."""
  if name not in _FACTORIES:
    raise ValueError(f'unknown pre-processing op {name!r}; known ops: '
                     f'{", ".join(names())}')
  factory = _FACTORIES[name][0]
  try:
    inspect.signature(factory).bind(*args, **kwargs)
  except TypeError as e:
    raise ValueError(f'bad arguments for op {name}{inspect.signature(factory)}'
                     f': {e}') from None
  return factory(*args, **kwargs)


def on_image(fn: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]) -> OpFn:
  def op(features: Features, seed: tf.Tensor) -> Features:
    return {**features, 'image': fn(features['image'], seed)}
  return op


def pixels(value, name: str) -> int:
  """`value` as a positive whole number of pixels (224 or 224.0), else a
  ValueError naming it (`int(8.5)` would silently make 8)."""
  whole = (not isinstance(value, bool) and isinstance(value, numbers.Real)
           and float(value).is_integer() and value >= 1)
  if not whole:
    hint = 'e.g. 224'
    if isinstance(value, (tuple, list)):
      hint = 'this argument is one side, not an (h, w) pair'
    if isinstance(value, numbers.Real) and math.isfinite(value) and value > 1:
      hint = f'e.g. {math.floor(value)} or {math.ceil(value)}'
    raise ValueError(f'{name}={value!r} is not a positive whole number of '
                     f'pixels; write an integer, {hint}')
  return int(value)


def _hw(h, w: Optional[int], op: str) -> Tuple[int, int]:
  """(h, w) in pixels from `op(h)`, `op(h, w)` or big_vision's
  `op((h, w))`."""
  if isinstance(h, (tuple, list)):
    if len(h) != 2 or w is not None:
      raise ValueError(
          f'pre-processing op {op}: h={h!r}, w={w!r}; give the size as '
          f'{op}(h, w), {op}((h, w)) or {op}(side), e.g. {op}(224, 224)')
    h, w = h
  if isinstance(w, str) and op == 'resize':
    raise ValueError(f'pre-processing op {op}: w={w!r} is the second side; '
                     f'a method is a keyword: {op}({h!r}, method={w!r})')
  return (pixels(h, f'pre-processing op {op}: h'),
          pixels(h if w is None else w, f'pre-processing op {op}: w'))


# A crop of an image smaller than the crop fails with this tagged assertion
# (the op and crop size after it), that `explain_error` reads back.
_TOO_SMALL = 'image smaller than the crop of pre-processing op'


def _check_fits(image: tf.Tensor, h: int, w: int, op: str) -> tf.Tensor:
  """`image`, after checking that it holds an h x w crop (statically when
  its size is known, else by a tagged assertion, one scalar test)."""
  known = image.shape[:2]
  if known.is_fully_defined() and (known[0] < h or known[1] < w):
    error = DataError(f'pre-processing op {op}({h}, {w}) gets '
                      f'{known[0]}x{known[1]} images, smaller than the crop: '
                      f'{_RESIZE_FIRST.format(h=h)}')
    # Raised while tf.data or tf.function traces the ops: AutoGraph would
    # wrap it in a StagingError that prints its stack first.
    error.ag_pass_through = True
    raise error
  shape = tf.shape(image)
  check = tf.debugging.Assert(
      (shape[0] >= h) & (shape[1] >= w),
      [f'{_TOO_SMALL} {op}({h}, {w})', shape], summarize=3)
  with tf.control_dependencies([check]):
    return tf.identity(image)


_RESIZE_FIRST = ('resize first, e.g. resize_small({h}) or resize({h}) before '
                 'the crop (the finetune and eval presets do)')


def explain_error(error: Exception, field: str = 'input.pp_train'
                  ) -> Optional[DataError]:
  """A DataError for an op's tagged failure in `error` (read while running
  the ops of config field `field`), or None."""
  match = re.search(re.escape(_TOO_SMALL) + r' (\w+)\((\d+), (\d+)\)\]\s*'
                    r'\[(\d+) (\d+)', str(getattr(error, 'message', error)))
  if match is None:
    return None
  op, h, w, ih, iw = match.groups()
  return DataError(
      f'{field}: pre-processing op {op}({h}, {w}) got a {ih}x{iw} image, '
      f'smaller than the crop: {_RESIZE_FIRST.format(h=h)}')


def _set_channels(image: tf.Tensor, channels: Optional[int]) -> tf.Tensor:
  """Grayscale -> RGB (tile) or RGB -> grayscale; None keeps the channels."""
  if not channels:
    return image
  have = image.shape[-1]
  if have == channels:
    return image
  if channels == 3 and have == 1:
    return tf.tile(image, [1, 1, 3])
  if channels == 1 and have == 3:
    return tf.cast(tf.round(tf.image.rgb_to_grayscale(
        tf.cast(image, tf.float32))), image.dtype)
  # Channels unknown statically: decide at run time (1 -> tile, else keep).
  image = tf.cond(tf.equal(tf.shape(image)[-1], 1),
                  lambda: tf.tile(image, [1, 1, channels]),
                  lambda: image[..., :channels])
  return tf.ensure_shape(image, [None, None, channels])


def decode_image(data: tf.Tensor, channels: Optional[int] = 3) -> tf.Tensor:
  """Encoded bytes -> uint8 [H, W, C]; an already decoded image passes."""
  if data.dtype != tf.string:
    return _set_channels(data, channels)
  if channels == 1:  # GIF, BMP, WebP and CMYK JPEG decode to RGB only.
    image = tf.io.decode_image(data, channels=3, expand_animations=False)
    return _set_channels(tf.ensure_shape(image, [None, None, 3]), 1)
  image = tf.io.decode_image(data, channels=channels or 0,
                             expand_animations=False)
  return tf.ensure_shape(image, [None, None, channels or None])


@register('decode')
def decode(channels: Optional[int] = 3) -> OpFn:
  return on_image(lambda image, seed: decode_image(image, channels))


def _sample_crop(shape: tf.Tensor, seed: tf.Tensor, area: Tuple[float, float],
                 aspect: Tuple[float, float]):
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
      shape, tf.zeros([0, 0, 4], tf.float32), seed=seed, area_range=area,
      aspect_ratio_range=aspect, min_object_covered=0.0, max_attempts=10,
      use_image_if_no_bounding_boxes=True)
  return begin, size


def _keep_channels(crop: tf.Tensor, image: tf.Tensor) -> tf.Tensor:
  """A dynamic-size crop keeps `image`'s static channel count (later ops,
  e.g. randaug, read it)."""
  crop.set_shape([None, None, image.shape[-1]])
  return crop


def check_box_ranges(op: str, area_min: float, area_max: float,
                     aspect_min: float, aspect_max: float) -> None:
  """The area and aspect ranges `op` (an inception crop, random erasing)
  samples boxes from (an inverted aspect range would otherwise be accepted
  and sample nonsense)."""
  if not 0 < area_min <= area_max <= 1:
    # big_vision writes the areas in percent (area_min=5, area_max=100).
    percent = (f': fractions of the image, not percent (big_vision\'s '
               f'area_min={area_min:g} is area_min={area_min / 100:g} here)'
               if 1 < area_min <= 100 else '')
    raise ValueError(f'{op} needs 0 < area_min <= area_max <= 1, '
                     f'got ({area_min}, {area_max}){percent}')
  if not 0 < aspect_min <= aspect_max:
    fix = ('swap them' if 0 < aspect_max < aspect_min else
           'both are width/height ratios')
    raise ValueError(
        f'{op} needs 0 < aspect_min <= aspect_max (width / height),'
        f' got aspect_min={aspect_min:g}, aspect_max={aspect_max:g}: {fix}, '
        'e.g. aspect_min=3/4, aspect_max=4/3 (the default)')


def _crop_side(size, op: str) -> Optional[int]:
  """The square side an inception crop is resized to (None: not resized)."""
  if isinstance(size, (tuple, list)):
    raise ValueError(
        f'pre-processing op {op}: size={size!r}; it makes square crops: '
        f'write {op}(224), or {op}() followed by resize(h, w)')
  if size is None or size == 0:  # 0: as None, as before.
    return None
  return pixels(size, f'pre-processing op {op}: size')


# tf.image.resize's methods, checked when the op is built (not per image).
_METHODS = ('area', 'bicubic', 'bilinear', 'gaussian', 'lanczos3', 'lanczos5',
            'mitchellcubic', 'nearest')


def _check_resize_args(op: str, method, antialias) -> None:
  if method not in _METHODS:
    raise ValueError(f'pre-processing op {op}: method={method!r} is not one '
                     f'of {", ".join(map(repr, _METHODS))}')
  if not isinstance(antialias, bool):
    raise ValueError(f'pre-processing op {op}: antialias={antialias!r}; '
                     'write antialias=True or antialias=False')


def _resize(image: tf.Tensor, h: int, w: int, method: str = 'bilinear',
            antialias: bool = False) -> tf.Tensor:
  out = tf.image.resize(image, [h, w], method=method, antialias=antialias)
  return tf.cast(out, tf.float32)


@register('inception_crop', random=True)
def inception_crop(size: Optional[int] = None, area_min: float = 0.05,
                   area_max: float = 1.0, aspect_min: float = 3 / 4,
                   aspect_max: float = 4 / 3) -> OpFn:
  """A crop covering a random 5-100% of the area ("Inception" crop)."""
  check_box_ranges('inception_crop', area_min, area_max, aspect_min,
                   aspect_max)
  size = _crop_side(size, 'inception_crop')

  def fn(image, seed):
    begin, crop = _sample_crop(tf.shape(image), seed, (area_min, area_max),
                               (aspect_min, aspect_max))
    image = _keep_channels(tf.slice(image, begin, crop), image)
    return _resize(image, size, size) if size else image
  return on_image(fn)


@register('decode_jpeg_and_inception_crop', random=True)
def decode_jpeg_and_inception_crop(
    size: Optional[int] = None, area_min: float = 0.05, area_max: float = 1.0,
    aspect_min: float = 3 / 4, aspect_max: float = 4 / 3,
    channels: int = 3) -> OpFn:
  """`decode|inception_crop`, decoding only the crop window of a JPEG.

  For the same seed the window is the unfused ops' window; pixels agree up
  to JPEG chroma upsampling at its edges. Non-JPEG bytes and decoded images
  take the unfused path.
  """
  check_box_ranges('inception_crop', area_min, area_max, aspect_min,
                   aspect_max)
  size = _crop_side(size, 'decode_jpeg_and_inception_crop')
  area, aspect = (area_min, area_max), (aspect_min, aspect_max)

  def unfused(image, seed):
    image = decode_image(image, channels)
    begin, crop = _sample_crop(tf.shape(image), seed, area, aspect)
    return _keep_channels(tf.slice(image, begin, crop), image)

  def fn(data, seed):
    if data.dtype != tf.string:
      image = unfused(data, seed)
    else:
      def jpeg():
        shape = tf.image.extract_jpeg_shape(data)
        shape = tf.concat([shape[:2], [channels]], axis=0)
        begin, crop = _sample_crop(shape, seed, area, aspect)
        window = tf.stack([begin[0], begin[1], crop[0], crop[1]])
        return tf.image.decode_and_crop_jpeg(data, window, channels=channels)
      image = tf.cond(tf.io.is_jpeg(data), jpeg, lambda: unfused(data, seed))
      image = tf.ensure_shape(image, [None, None, channels])
    return _resize(image, size, size) if size else image
  return on_image(fn)


@register('resize')
def resize(h: int, w: Optional[int] = None, method: str = 'bilinear',
           antialias: bool = False) -> OpFn:
  """Resizes to h x w: `resize(224)`, `resize(224, 160)` or `resize((224,
  160))` (big_vision's form)."""
  h, w = _hw(h, w, 'resize')
  _check_resize_args('resize', method, antialias)
  return on_image(lambda image, seed: _resize(image, h, w, method, antialias))


@register('resize_small')
def resize_small(size: int, method: str = 'bilinear',
                 antialias: bool = False) -> OpFn:
  """Resizes so that the shorter side is `size`, keeping the aspect ratio.

  Bilinear without antialiasing by default (as `resize`); big_vision's
  `resize_small` defaults to `method='area'`, which averages the pixels a
  downscale drops: pass `method='area'` for that.
  """
  size = pixels(size, 'pre-processing op resize_small: size')
  _check_resize_args('resize_small', method, antialias)

  def fn(image, seed):
    hw = tf.cast(tf.shape(image)[:2], tf.float32)
    scale = size / tf.reduce_min(hw)
    new = tf.maximum(tf.cast(tf.round(hw * scale), tf.int32), size)
    out = tf.image.resize(image, new, method=method, antialias=antialias)
    return tf.cast(out, tf.float32)
  return on_image(fn)


@register('random_crop', random=True)
def random_crop(h: int, w: Optional[int] = None) -> OpFn:
  h, w = _hw(h, w, 'random_crop')

  def fn(image, seed):
    image = _check_fits(image, h, w, 'random_crop')
    channels = tf.shape(image)[-1]
    out = tf.image.stateless_random_crop(image, [h, w, channels], seed=seed)
    return tf.ensure_shape(out, [h, w, image.shape[-1]])
  return on_image(fn)


@register('central_crop')
def central_crop(h: int, w: Optional[int] = None) -> OpFn:
  h, w = _hw(h, w, 'central_crop')

  def fn(image, seed):
    image = _check_fits(image, h, w, 'central_crop')
    shape = tf.shape(image)
    top, left = (shape[0] - h) // 2, (shape[1] - w) // 2
    out = image[top:top + h, left:left + w]
    return tf.ensure_shape(out, [h, w, image.shape[-1]])
  return on_image(fn)


@register('flip_lr', random=True)
def flip_lr() -> OpFn:
  return on_image(lambda image, seed:
                   tf.image.stateless_random_flip_left_right(image, seed))


@register('value_range')
def value_range(vmin: float = -1.0, vmax: float = 1.0, in_min: float = 0.0,
                in_max: float = 255.0, clip: bool = True) -> OpFn:
  """Maps [in_min, in_max] affinely onto [vmin, vmax] (float32)."""
  if in_min == in_max:
    raise ValueError(f'pre-processing op value_range: in_min = in_max = '
                     f'{in_min:g} maps nothing; the input range of decoded '
                     'pixels is in_min=0, in_max=255 (the default)')
  scale = (vmax - vmin) / (in_max - in_min)

  def fn(image, seed):
    out = vmin + (tf.cast(image, tf.float32) - in_min) * scale
    if clip:
      out = tf.clip_by_value(out, min(vmin, vmax), max(vmin, vmax))
    return out
  return on_image(fn)


@register('to_rgb')
def to_rgb() -> OpFn:
  return on_image(lambda image, seed: _set_channels(image, 3))


@register('onehot')
def onehot(depth: int, on: float = 1.0, off: float = 0.0) -> OpFn:
  def op(features, seed):
    label = tf.one_hot(features['label'], depth, on_value=on, off_value=off,
                       dtype=tf.float32)
    return {**features, 'label': label}
  return op


@register('keep')
def keep(*keys: str) -> OpFn:
  def op(features, seed):
    return {k: v for k, v in features.items() if k in keys}
  return op
