"""RandAugment (Cubuk et al. 2020) and random erasing (Zhong et al. 2020) as
pre-processing ops, in TensorFlow image ops inside tf.data.

`randaug(num_layers=2, magnitude=10)`: `num_layers` times, one operation
drawn uniformly from OPERATIONS is applied (always: the reference draws a
probability in [0.2, 0.8] per operation but never uses it), at strength
`magnitude` on the scale of the AutoAugment / AugReg implementation
big_vision uses (`distort_image_with_randaugment`), with that
implementation's level-to-argument maps, level = magnitude / 10:

  rotate        up to level * 30 degrees, about the centre, random direction
  shear x / y   level * 0.3, about the top-left corner, random direction
  translate x/y level * 100/224 of the image side, random direction
  cutout        a grey square of half-side level * 40/224 of the image side
  colour, contrast, brightness, sharpness
                factor 0.1 + 1.8 * level (> 1 enhances; no random direction)
  posterize     keeps int(4 * level) bits (magnitude 20: all 8; below 2.5:
                0 bits, which the reference's uint8 shift keeps as 1 bit:
                pixels 0 or 128, not a black image)
  solarize      inverts pixels >= int(256 * level) (magnitude 10 and above:
                none, as there: stronger is weaker for this one)
  solarize_add  adds int(110 * level) to pixels below 128

As there, magnitudes above 10 extrapolate (AugReg's recipes use
randaug(2, 10), (2, 15) and (2, 20): 15 rotates by up to 45 degrees where
10 rotates by 30). Geometric operations fill with grey (128), as the
reference does. Differences from it: translate and cutout are fractions of
the image side (its 100 px and 40 px at 224 px), so small images stay
meaningful; contrast blends towards the image's mean grey level, where the
reference's histogram sum gives (pixel count) / 256 (196 at 224 px, 3 at
28 px) instead of a mean.

`random_erasing(probability=0.25, area_min=0.02, area_max=1/3,
aspect_min=0.3, aspect_max=1/0.3)`: with `probability`, one rectangle of
that area fraction and aspect ratio is replaced by per-pixel noise (DeiT's
`mode='pixel'`), uniform over the pixel range [0, 255] whatever the image
holds (DeiT draws normal noise after normalising); on pixels, so before
`value_range`.

Both draw every random number from the op's stateless seed: a resumed run
augments each example exactly as the uninterrupted one did.
"""

from __future__ import annotations

import functools
import math

import tensorflow as tf

from vit_jax.data import ops

MAX_MAGNITUDE = 10.0
GREY = 128


def _blend(a, b, factor):
  """a + factor * (b - a), clipped to [0, 255] (factor > 1 extrapolates)."""
  return tf.clip_by_value(a + factor * (b - a), 0.0, 255.0)


def _grey(image):
  g = tf.image.rgb_to_grayscale(image) if image.shape[-1] == 3 else image
  return tf.broadcast_to(g, tf.shape(image))


def _transform(image, matrix):
  """Output pixel (x, y) reads input (a0 x + a1 y + a2, b0 x + b1 y + b2)."""
  out = tf.raw_ops.ImageProjectiveTransformV3(
      images=image[None], transforms=tf.cast(matrix, tf.float32)[None],
      output_shape=tf.shape(image)[:2], fill_value=float(GREY),
      interpolation='NEAREST', fill_mode='CONSTANT')
  return out[0]


def _centred(image, a, b, c, d):
  """The linear map [[a, b], [c, d]] about the image centre."""
  h = tf.cast(tf.shape(image)[0], tf.float32)
  w = tf.cast(tf.shape(image)[1], tf.float32)
  cx, cy = (w - 1) / 2, (h - 1) / 2
  return tf.stack([a, b, cx - a * cx - b * cy, c, d, cy - c * cx - d * cy,
                   0.0, 0.0])


def _side(image):
  return tf.cast(tf.reduce_min(tf.shape(image)[:2]), tf.float32)


# Each operation: fn(image float32 in [0, 255], level in [0, 1], sign) ->
# image. `level` = magnitude / MAX_MAGNITUDE; `sign` is +1 or -1 (the
# random direction of rotate, shear and translate; the others ignore it).
def _auto_contrast(image, level, sign):
  lo = tf.reduce_min(image, axis=[0, 1], keepdims=True)
  hi = tf.reduce_max(image, axis=[0, 1], keepdims=True)
  scale = tf.where(hi > lo, 255.0 / tf.maximum(hi - lo, 1e-3), 1.0)
  return tf.where(hi > lo, (image - lo) * scale, image)


def _equalize(image, level, sign):
  def channel(x):
    x = tf.cast(x, tf.int32)
    hist = tf.math.bincount(tf.reshape(x, [-1]), minlength=256, maxlength=256)
    nonzero = tf.boolean_mask(hist, hist > 0)
    step = (tf.reduce_sum(nonzero) - nonzero[-1]) // 255
    lut = (tf.cumsum(hist) - hist + step // 2) // tf.maximum(step, 1)
    lut = tf.clip_by_value(lut, 0, 255)
    return tf.cast(tf.where(step > 0, tf.gather(lut, x), x), tf.float32)
  return tf.stack([channel(tf.round(image[..., c]))
                   for c in range(image.shape[-1])], axis=-1)


def _invert(image, level, sign):
  return 255.0 - image


def _rotate(image, level, sign):
  angle = sign * level * 30.0 * math.pi / 180.0
  c, s = tf.cos(angle), tf.sin(angle)
  return _transform(image, _centred(image, c, -s, s, c))


def _posterize(image, level, sign):
  bits = tf.clip_by_value(tf.cast(tf.math.floor(level * 4.0), tf.int32), 0, 8)
  # The reference shifts uint8 pixels, whose shift amount TF clamps to 7: 0
  # bits keep the top bit (an int32 shift by 8 would black out the image,
  # 12% of randaug(2, 0)'s images, AugReg's light1).
  shift = tf.minimum(8 - bits, 7)
  x = tf.cast(tf.round(image), tf.int32)
  return tf.cast(tf.bitwise.left_shift(tf.bitwise.right_shift(x, shift),
                                       shift), tf.float32)


def _solarize(image, level, sign):
  threshold = tf.math.floor(level * 256.0)
  return tf.where(image < threshold, image, 255.0 - image)


def _solarize_add(image, level, sign):
  return tf.where(image < 128.0,
                  tf.minimum(image + tf.math.floor(level * 110.0), 255.0),
                  image)


def _factor(level):
  """The enhance operations' factor (the reference's _enhance_level_to_arg)."""
  return 0.1 + level * 1.8


def _color(image, level, sign):
  return _blend(_grey(image), image, _factor(level))


def _contrast(image, level, sign):
  mean = tf.reduce_mean(_grey(image))
  return _blend(tf.fill(tf.shape(image), mean), image, _factor(level))


def _brightness(image, level, sign):
  return _blend(tf.zeros_like(image), image, _factor(level))


def _sharpness(image, level, sign):
  kernel = tf.constant([[1, 1, 1], [1, 5, 1], [1, 1, 1]], tf.float32) / 13.0
  c = image.shape[-1]
  kernel = tf.tile(kernel[:, :, None, None], [1, 1, c, 1])
  smooth = tf.nn.depthwise_conv2d(image[None], kernel, [1, 1, 1, 1],
                                  'SAME')[0]
  # The border keeps its pixels, as PIL's ImageEnhance.Sharpness does.
  h, w = tf.shape(image)[0], tf.shape(image)[1]
  inner = tf.pad(tf.ones([h - 2, w - 2, c]), [[1, 1], [1, 1], [0, 0]])
  smooth = inner * smooth + (1 - inner) * image
  return _blend(smooth, image, _factor(level))


def _shear_x(image, level, sign):
  return _transform(image, tf.stack([1.0, sign * level * 0.3, 0.0, 0.0, 1.0,
                                     0.0, 0.0, 0.0]))


def _shear_y(image, level, sign):
  return _transform(image, tf.stack([1.0, 0.0, 0.0, sign * level * 0.3, 1.0,
                                     0.0, 0.0, 0.0]))


TRANSLATE = 100 / 224  # The reference's 100 px at 224 px, as a fraction.
CUTOUT = 40 / 224  # Its cutout's 40 px half-side at 224 px.


def _translate_x(image, level, sign):
  shift = sign * level * TRANSLATE * _side(image)
  return _transform(image, tf.stack([1.0, 0.0, -shift, 0.0, 1.0, 0.0, 0.0,
                                     0.0]))


def _translate_y(image, level, sign):
  shift = sign * level * TRANSLATE * _side(image)
  return _transform(image, tf.stack([1.0, 0.0, 0.0, 0.0, 1.0, -shift, 0.0,
                                     0.0]))


def _box(shape, centre, half):
  """Bool [H, W, 1]: pixels within `half` of `centre` (row, col)."""
  rows = tf.range(shape[0], dtype=tf.float32)[:, None]
  cols = tf.range(shape[1], dtype=tf.float32)[None, :]
  inside = ((tf.abs(rows - centre[0]) <= half[0]) &
            (tf.abs(cols - centre[1]) <= half[1]))
  return inside[..., None]


def _cutout(image, level, sign, seed):
  half = level * CUTOUT * _side(image)
  shape = tf.cast(tf.shape(image)[:2], tf.float32)
  centre = tf.random.stateless_uniform([2], seed) * shape
  return tf.where(_box(tf.shape(image), centre, [half, half]),
                  float(GREY), image)


OPERATIONS = {
    'auto_contrast': _auto_contrast, 'equalize': _equalize,
    'invert': _invert, 'rotate': _rotate, 'posterize': _posterize,
    'solarize': _solarize, 'color': _color, 'contrast': _contrast,
    'brightness': _brightness, 'sharpness': _sharpness,
    'shear_x': _shear_x, 'shear_y': _shear_y, 'translate_x': _translate_x,
    'translate_y': _translate_y, 'cutout': _cutout,
    'solarize_add': _solarize_add,
}


def _apply(image, seed, magnitude: float):
  """One RandAugment layer: a random operation, always applied."""
  seeds = tf.random.experimental.stateless_split(seed, 3)
  index = tf.random.stateless_uniform([], seeds[0], 0, len(OPERATIONS),
                                      dtype=tf.int32)
  sign = tf.where(tf.random.stateless_uniform([], seeds[1]) < 0.5, -1.0, 1.0)
  level = magnitude / MAX_MAGNITUDE  # Above 1: extrapolated, as theirs.
  branches = []
  for name, fn in OPERATIONS.items():
    if name == 'cutout':
      branches.append(lambda fn=fn: fn(image, level, sign, seeds[2]))
    else:
      branches.append(lambda fn=fn: fn(image, level, sign))
  out = tf.switch_case(index, branches)
  return tf.ensure_shape(out, image.shape)


@functools.lru_cache(maxsize=None)
def _layer(magnitude: float):
  """`_apply` at `magnitude` as one tf.function per process, traced once
  per image shape however many layers and pipelines call it. Its 16
  branches cost ~0.7 s of TensorFlow tracing per layer each time a
  pipeline was traced (`dataset_info` and the train iterator trace it
  three times per run); the outputs are bitwise the same."""
  return tf.function(lambda image, seed: _apply(image, seed, magnitude),
                     autograph=False)


@ops.register('randaug', random=True, pixels=True)
def randaug(num_layers: int = 2, magnitude: float = 10) -> ops.OpFn:
  if not isinstance(num_layers, int) or num_layers < 0:
    raise ValueError(f'randaug(num_layers={num_layers!r}): a number of '
                     'operations >= 0 (AugReg: 2)')
  if not 0 <= magnitude <= 30:
    raise ValueError(f'randaug(magnitude={magnitude!r}): a strength in '
                     f'[0, 30] (the reference scale: {MAX_MAGNITUDE:g} rotates by '
                     '30 degrees; AugReg uses 10, 15 or 20)')

  def fn(image, seed):
    dtype = image.dtype
    x = tf.cast(image, tf.float32)
    if dtype != tf.uint8:
      x = tf.clip_by_value(x, 0.0, 255.0)
    layer = _layer(float(magnitude))
    for s in tf.unstack(tf.random.experimental.stateless_split(
        seed, max(num_layers, 1))[:num_layers]):
      x = layer(x, s)
    return tf.cast(tf.round(x), tf.uint8) if dtype == tf.uint8 else x
  return ops.on_image(fn)


@ops.register('random_erasing', random=True, pixels=True)
def random_erasing(probability: float = 0.25, area_min: float = 0.02,
                   area_max: float = 1 / 3, aspect_min: float = 0.3,
                   aspect_max: float = 1 / 0.3) -> ops.OpFn:
  if not 0 <= probability <= 1:
    raise ValueError(f'random_erasing(probability={probability!r}): a '
                     'probability in [0, 1]')
  ops.check_box_ranges('random_erasing', area_min, area_max, aspect_min,
                       aspect_max)

  def fn(image, seed):
    s = tf.random.experimental.stateless_split(seed, 5)
    shape = tf.shape(image)
    hw = tf.cast(shape[:2], tf.float32)
    area = tf.random.stateless_uniform([], s[0], area_min, area_max) * (
        hw[0] * hw[1])
    log_aspect = tf.random.stateless_uniform(
        [], s[1], math.log(aspect_min), math.log(aspect_max))
    aspect = tf.exp(log_aspect)
    h = tf.minimum(tf.sqrt(area * aspect), hw[0])
    w = tf.minimum(tf.sqrt(area / aspect), hw[1])
    top = tf.random.stateless_uniform([], s[2]) * (hw[0] - h)
    left = tf.random.stateless_uniform([], s[3]) * (hw[1] - w)
    box = _box(shape, [top + (h - 1) / 2, left + (w - 1) / 2],
               [h / 2, w / 2])
    x = tf.cast(image, tf.float32)
    # The pixel range, not the image's own (a dark image's noise was dark).
    noise = tf.random.stateless_uniform(shape, s[4], 0.0, 255.0 + 1e-6)
    erase = tf.random.stateless_uniform([], tf.reverse(s[4], [0])) < (
        probability)
    out = tf.where(box & erase, noise, x)
    return tf.cast(tf.round(out), tf.uint8) if image.dtype == tf.uint8 \
        else out
  return ops.on_image(fn)
