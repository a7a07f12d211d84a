"""Labels of the VTAB-1k structured tasks, computed from tfds features.

These tasks predict a quantity the tfds dataset stores as annotations
(object counts, distances, sprite positions); the functions below turn a
deserialised example (image still encoded) into `{'image', 'label'}` the
way google-research/task_adaptation defines each task.
"""

from __future__ import annotations

from typing import Callable, Dict

import numpy as np
import tensorflow as tf

Example = Dict[str, tf.Tensor]


def _bucket(value: tf.Tensor, thresholds) -> tf.Tensor:
  """Index of the last threshold below `value`."""
  below = tf.where(np.asarray(thresholds, np.float32) - value < 0)
  return tf.reduce_max(below)


def clevr_count(x: Example) -> Example:
  # 3..10 objects -> classes 0..7.
  return {'image': x['image'], 'label': tf.size(x['objects']['size']) - 3}


def clevr_distance(x: Example) -> Example:
  dist = tf.reduce_min(x['objects']['pixel_coords'][:, 2])
  return {'image': x['image'],
          'label': _bucket(dist, [0.0, 8.0, 8.5, 9.0, 9.5, 10.0, 100.0])}


def _dsprites(attribute: str, num_values: int, num_classes: int):
  factor = num_values / num_classes

  def fn(x: Example) -> Example:
    # Binary 0/1 masks: decode here and scale to 0/255 like a photo.
    image = x['image']
    if image.dtype == tf.string:
      image = tf.io.decode_png(image, channels=1)
    label = tf.cast(tf.math.floordiv(
        tf.cast(x[attribute], tf.float32), factor), tf.int64)
    return {'image': image * 255, 'label': label}
  return fn


def kitti_distance(x: Example) -> Example:
  """Distance to the closest vehicle: 3 bins, plus 'no vehicle'."""
  vehicles = tf.where(x['objects']['type'] < 3)  # Car, Van, Truck.
  z = tf.gather(x['objects']['location'][:, 2], vehicles)
  z = tf.concat([z, tf.constant([[1000.0]])], axis=0)
  return {'image': x['image'],
          'label': _bucket(tf.reduce_min(z), [-100.0, 8.0, 20.0, 999.0])}


TASKS: Dict[str, Callable[[Example], Example]] = {
    'clevr_count': clevr_count,
    'clevr_distance': clevr_distance,
    'dsprites_location': _dsprites('label_x_position', 32, 16),
    'dsprites_orientation': _dsprites('label_orientation', 40, 16),
    'kitti_distance': kitti_distance,
}
