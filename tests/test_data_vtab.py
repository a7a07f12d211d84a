"""Labels of the VTAB-1k structured tasks from tfds-style features."""

import numpy as np
import tensorflow as tf

from vit_jax.data import vtab_tasks


def test_clevr_labels():
  x = {'image': tf.constant(b'jpeg'), 'objects': {
      'size': tf.constant([0, 1, 1, 0, 1]),
      'pixel_coords': tf.constant([[1., 2., 9.2], [3., 4., 12.], [0, 0, 11],
                                   [0, 0, 15], [0, 0, 20]])}}
  assert int(vtab_tasks.clevr_count(x)['label']) == 2  # 5 objects -> class 2.
  assert int(vtab_tasks.clevr_distance(x)['label']) == 3  # 9.2 in [9, 9.5).


def test_dsprites_labels_and_image():
  png = tf.io.encode_png(np.eye(64, dtype=np.uint8)[..., None])
  for task, attr, value, label in [('dsprites_location', 'label_x_position',
                                    31, 15),
                                   ('dsprites_orientation',
                                    'label_orientation', 39, 15),
                                   ('dsprites_orientation',
                                    'label_orientation', 5, 2)]:
    out = vtab_tasks.TASKS[task]({'image': png, attr: tf.constant(value, tf.int64)})
    assert int(out['label']) == label
    image = out['image'].numpy()
    assert image.shape == (64, 64, 1) and set(np.unique(image)) == {0, 255}


def test_kitti_closest_vehicle():
  def label(types, z):
    x = {'image': tf.constant(b''), 'objects': {
        'type': tf.constant(types, tf.int64),
        'location': tf.constant([[0., 0., v] for v in z], tf.float32)}}
    return int(vtab_tasks.kitti_distance(x)['label'])
  assert label([0, 4], [5.0, 1.0]) == 0     # Car at 5 m (pedestrian ignored).
  assert label([2], [15.0]) == 1
  assert label([1, 0], [30.0, 40.0]) == 2
  assert label([4, 5], [3.0, 4.0]) == 3     # No vehicle.
