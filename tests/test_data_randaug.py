"""RandAugment and random erasing ops on real photos: every operation keeps
the shape and value range, the ops are functions of their seed, and bad
arguments are clear errors."""

import numpy as np
import pytest
import skimage.data
import tensorflow as tf

from vit_jax.data import preprocess, randaug

PHOTO = skimage.data.astronaut()[::4, ::4]  # 128 x 128 x 3, uint8.
GREY = skimage.data.camera()[::4, ::4, None]  # 128 x 128 x 1.


def _run(spec, image=PHOTO, seed=(0, 7)):
  out = preprocess.build(spec, 128)({'image': tf.constant(image)},
                                    tf.constant(seed, tf.int64))
  return out['image'].numpy()


@pytest.mark.parametrize('name', sorted(randaug.OPERATIONS))
@pytest.mark.parametrize('image', [PHOTO, GREY], ids=['rgb', 'grey'])
def test_every_operation_keeps_shape_and_range_and_changes_the_image(
    name, image):
  x = tf.cast(tf.constant(image), tf.float32)
  fn = randaug.OPERATIONS[name]
  # Magnitude 7: solarize is the identity from magnitude 10 on, and the
  # enhance operations' factor 0.1 + 1.8 * level is 1 at magnitude 5.
  args = (x, 0.7, -1.0) + ((tf.constant([3, 4]),) if name == 'cutout' else ())
  out = fn(*args).numpy()
  assert out.shape == image.shape and out.dtype == np.float32
  assert out.min() >= 0 and out.max() <= 255
  unchanged = {'auto_contrast'} | ({'color'} if image.shape[-1] == 1 else set())
  if name not in unchanged:  # Photos span 0-255; grey has no colour.
    assert np.abs(out - image).mean() > 0.5, name


def test_randaug_is_a_function_of_its_seed():
  a = _run('randaug(2, 10)', seed=(1, 2))
  assert a.shape == PHOTO.shape and a.dtype == np.uint8
  np.testing.assert_array_equal(a, _run('randaug(2, 10)', seed=(1, 2)))
  outs = [_run('randaug(2, 10)', seed=(i, 2)) for i in range(8)]
  assert sum(not np.array_equal(o, PHOTO) for o in outs) >= 4
  assert len({o.tobytes() for o in outs}) >= 5


def test_magnitudes_above_10_extrapolate_like_the_reference():
  """AugReg's randaug(2, 15) / (2, 20) are stronger than (2, 10), as in
  big_vision's implementation (15 rotates by 45 degrees, 10 by 30)."""
  x = tf.cast(tf.constant(PHOTO), tf.float32)
  at = {level: randaug.OPERATIONS['rotate'](x, level, 1.0).numpy()
        for level in (1.0, 1.5, 3.0)}
  assert not np.array_equal(at[1.0], at[1.5])
  for level in (1.0, 1.5, 3.0):  # Every operation stays in range.
    for name, fn in randaug.OPERATIONS.items():
      args = (x, level, -1.0) + ((tf.constant([3, 4]),)
                                  if name == 'cutout' else ())
      out = fn(*args).numpy()
      assert out.min() >= 0 and out.max() <= 255, (name, level)
  seeds = [(i, 2) for i in range(8)]
  strong = [_run('randaug(2, 15)', seed=s) for s in seeds]
  light = [_run('randaug(2, 10)', seed=s) for s in seeds]
  assert sum(not np.array_equal(a, b) for a, b in zip(strong, light)) >= 3


def test_operations_take_the_references_arguments():
  """big_vision's / the TPU reference's level-to-argument maps."""
  x = tf.cast(tf.constant(PHOTO), tf.float32)
  op = randaug.OPERATIONS
  # Solarize inverts pixels >= int(256 * level): nothing from magnitude 10.
  np.testing.assert_array_equal(op['solarize'](x, 1.0, 1.0), PHOTO)
  half = op['solarize'](x, 0.5, 1.0).numpy()
  np.testing.assert_array_equal(half, np.where(PHOTO < 128, PHOTO,
                                               255 - PHOTO))
  # Posterize keeps int(4 * level) bits: 4 at 10, all 8 at 20.
  np.testing.assert_array_equal(op['posterize'](x, 1.0, 1.0), PHOTO & 0xF0)
  np.testing.assert_array_equal(op['posterize'](x, 2.0, 1.0), PHOTO)
  # Below magnitude 2.5, 0 bits: the reference's uint8 shift (clamped to 7)
  # keeps the top bit, not a black image.
  np.testing.assert_array_equal(op['posterize'](x, 0.0, 1.0),
                                np.where(PHOTO >= 128, 128, 0))
  # Enhance factors 0.1 + 1.8 * level, whatever the sign: brightness 1.9.
  for sign in (1.0, -1.0):
    np.testing.assert_allclose(op['brightness'](x, 1.0, sign),
                               np.minimum(PHOTO * 1.9, 255), atol=1e-3)
  # Shear x about the top-left corner: the first row stays.
  sheared = op['shear_x'](x, 1.0, 1.0).numpy()
  np.testing.assert_array_equal(sheared[0], PHOTO[0])
  assert not np.array_equal(sheared[-1], PHOTO[-1])
  # Cutout: a grey square of side 2 * 40/224 of the image's (80 px at 224).
  big = tf.zeros((224, 224, 3))
  grey = (op['cutout'](big, 1.0, 1.0, tf.constant([3, 4])).numpy()[..., 0]
          == randaug.GREY)
  rows, cols = np.nonzero(grey)
  side = min(rows.max() - rows.min(), cols.max() - cols.min()) + 1
  assert side >= 40 and max(rows.max() - rows.min(),
                            cols.max() - cols.min()) + 1 in (80, 81)


def test_every_layer_applies_its_operation():
  """The reference applies the chosen operation always (its per-operation
  probability is drawn and unused): one layer changes the photo unless it
  drew an operation that is the identity on it (solarize at 10)."""
  outs = [_run('randaug(1, 10)', seed=(i, 3)) for i in range(48)]
  changed = np.mean([not np.array_equal(o, PHOTO) for o in outs])
  assert changed >= 0.8, changed


def test_randaug_on_float_images_and_in_a_full_pipeline():
  out = _run('resize(64)|randaug(3, 15)|value_range(-1,1)')
  assert out.shape == (64, 64, 3) and out.dtype == np.float32
  assert out.min() >= -1 and out.max() <= 1
  np.testing.assert_array_equal(_run('randaug(0, 10)'), PHOTO)


def test_random_erasing_erases_one_box_in_range():
  out = _run('random_erasing(1.0)').astype(int)
  changed = np.any(out != PHOTO, axis=-1)
  rows, cols = np.nonzero(changed)
  box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
  assert 0.02 * 128 * 128 * 0.5 <= box <= 128 * 128 / 3 * 1.2
  assert changed.sum() >= 0.8 * box  # One filled rectangle of noise.
  np.testing.assert_array_equal(_run('random_erasing(0.0)'), PHOTO)
  # The noise spans the pixel range whatever the image holds (a dark
  # image's box is not dark noise), on pixels: before value_range.
  dark = np.full_like(PHOTO, 10)
  noise = _run('random_erasing(1.0)', image=dark)
  noise = noise[np.any(noise != dark, axis=-1)]
  assert noise.min() < 30 and noise.max() > 225
  with pytest.raises(ValueError, match='random_erasing'):
    _run('value_range(-1,1)|random_erasing(1.0)')
  rate = np.mean([not np.array_equal(_run('random_erasing(0.5)', seed=(i, 0)),
                                     PHOTO) for i in range(40)])
  assert 0.25 <= rate <= 0.75


@pytest.mark.parametrize('spec,match', [
    ('randaug(2, 31)', 'magnitude'), ('randaug(-1, 10)', 'num_layers'),
    ('random_erasing(1.5)', 'probability'), ('randaugment(2, 10)',
                                             'unknown pre-processing op'),
    ('random_erasing(area_min=0.5, area_max=0.1)', 'area_min'),
    ('value_range(-1,1)|randaug(2, 10)', 'put it before value_range')])
def test_bad_arguments_are_clear_errors(spec, match):
  with pytest.raises(ValueError, match=match):
    preprocess.build(spec, 128)
