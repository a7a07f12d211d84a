"""Batch-level mixup (Zhang et al. 2018), as the reference ViT code does it.

Each batch is blended with itself reversed along the batch axis, with one
ratio r ~ Beta(alpha, alpha) per batch:

    image = r * image + (1 - r) * image[::-1]
    label = r * onehot(label) + (1 - r) * onehot(label)[::-1]

so labels become float32 [B, num_classes]. The ratio comes from a stateless
seed (the batch's position in the stream): resumed runs mix identically.
"""

from __future__ import annotations

from typing import Dict

import tensorflow as tf


def beta_ratio(alpha: float, seed: tf.Tensor) -> tf.Tensor:
  """One sample of Beta(alpha, alpha) from two stateless Gamma samples."""
  g = tf.random.stateless_gamma([2], seed=seed, alpha=tf.constant(
      alpha, tf.float64), dtype=tf.float64)
  total = g[0] + g[1]
  # Both Gammas can underflow to 0 for tiny alpha: fall back to 1/2.
  ratio = tf.where(total > 0, g[0] / tf.maximum(total, 1e-300), 0.5)
  return tf.cast(ratio, tf.float32)


def mixup(batch: Dict[str, tf.Tensor], alpha: float, num_classes: int,
          seed: tf.Tensor) -> Dict[str, tf.Tensor]:
  """Mixes `batch['image']` and one-hot `batch['label']` (see above)."""
  labels = batch['label']
  if labels.shape.rank == 1:
    labels = tf.one_hot(labels, num_classes, dtype=tf.float32)
  labels = tf.cast(labels, tf.float32)
  images = tf.cast(batch['image'], tf.float32)
  r = beta_ratio(alpha, seed)
  return {**batch,
          'image': r * images + (1 - r) * tf.reverse(images, axis=[0]),
          'label': r * labels + (1 - r) * tf.reverse(labels, axis=[0])}
