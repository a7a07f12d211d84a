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
  args = (x, 1.0, -1.0) + ((tf.constant([3, 4]),) if name == 'cutout' else ())
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
  floats = _run('value_range(-1,1)|random_erasing(1.0)')
  assert floats.min() >= -1 and floats.max() <= 1 + 1e-5
  rate = np.mean([not np.array_equal(_run('random_erasing(0.5)', seed=(i, 0)),
                                     PHOTO) for i in range(40)])
  assert 0.25 <= rate <= 0.75


@pytest.mark.parametrize('spec,match', [
    ('randaug(2, 31)', 'magnitude'), ('randaug(-1, 10)', 'num_layers'),
    ('random_erasing(1.5)', 'probability'), ('randaugment(2, 10)',
                                             'unknown pre-processing op'),
    ('random_erasing(area_min=0.5, area_max=0.1)', 'area_min')])
def test_bad_arguments_are_clear_errors(spec, match):
  with pytest.raises(ValueError, match=match):
    preprocess.build(spec, 128)
