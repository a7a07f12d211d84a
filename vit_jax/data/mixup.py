"""Batch-level mixing of train batches: mixup and CutMix.

Mixup (Zhang et al. 2018), as the reference ViT code does it.

Each batch is blended with itself reversed along the batch axis, with one
ratio r ~ Beta(alpha, alpha) per batch:

    image = r * image + (1 - r) * image[::-1]
    label = r * onehot(label) + (1 - r) * onehot(label)[::-1]

so labels become float32 [B, num_classes]. The ratio comes from a stateless
seed (the batch's position in the stream): resumed runs mix identically.

CutMix (Yun et al. 2019): one box per batch, of area (1 - r) of the image
with r ~ Beta(alpha, alpha) and a uniformly drawn centre (clipped at the
borders), is pasted from the reversed batch; labels are mixed by the pasted
area actually used. With both alphas set, each batch gets one or the other
with probability 1/2 (timm's `switch_prob`); only that one is computed.
"""

from __future__ import annotations

from typing import Dict

import tensorflow as tf


def soft_labels(labels: tf.Tensor, num_classes: int) -> tf.Tensor:
  """float32 [B, num_classes]: one-hot integer labels, or soft ones as they
  are (a batch mixed already)."""
  if labels.shape.rank == 1:
    labels = tf.one_hot(labels, num_classes, dtype=tf.float32)
  return tf.cast(labels, tf.float32)


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
  labels = soft_labels(batch['label'], num_classes)
  images = tf.cast(batch['image'], tf.float32)
  r = beta_ratio(alpha, seed)
  return {**batch,
          'image': r * images + (1 - r) * tf.reverse(images, axis=[0]),
          'label': r * labels + (1 - r) * tf.reverse(labels, axis=[0])}


def _paste(images: tf.Tensor, y0: tf.Tensor, y1: tf.Tensor, x0: tf.Tensor,
           x1: tf.Tensor) -> tf.Tensor:
  """`images` with rows [y0, y1) x columns [x0, x1) of each taken from the
  reversed batch.

  Built from slices and two concatenations: the pixels are copied, never
  computed, so any dtype passes bit for bit; it costs one copy of the batch
  (a broadcast `tf.where` over the full batch took about 3x longer).
  """
  strip = tf.reverse(images[:, y0:y1], axis=[0])
  middle = tf.concat([images[:, y0:y1, :x0], strip[:, :, x0:x1],
                      images[:, y0:y1, x1:]], axis=2)
  return tf.concat([images[:, :y0], middle, images[:, y1:]], axis=1)


def cutmix(batch: Dict[str, tf.Tensor], alpha: float, num_classes: int,
           seed: tf.Tensor) -> Dict[str, tf.Tensor]:
  """Pastes one box of the reversed batch into every image (see above)."""
  labels = soft_labels(batch['label'], num_classes)
  images = batch['image']
  s = tf.random.experimental.stateless_split(seed, 3)
  r = beta_ratio(alpha, s[0])
  h, w = tf.shape(images)[1], tf.shape(images)[2]
  hf, wf = tf.cast(h, tf.float32), tf.cast(w, tf.float32)
  side = tf.sqrt(1.0 - r)
  cut_h = tf.cast(tf.round(hf * side), tf.int32)
  cut_w = tf.cast(tf.round(wf * side), tf.int32)
  cy = tf.random.stateless_uniform([], s[1], 0, h, dtype=tf.int32)
  cx = tf.random.stateless_uniform([], s[2], 0, w, dtype=tf.int32)
  y0, y1 = tf.maximum(cy - cut_h // 2, 0), tf.minimum(cy + cut_h // 2, h)
  x0, x1 = tf.maximum(cx - cut_w // 2, 0), tf.minimum(cx + cut_w // 2, w)
  pasted = tf.cast((y1 - y0) * (x1 - x0), tf.float32) / (hf * wf)
  images = _paste(images, y0, y1, x0, x1)
  return {**batch, 'image': images,
          'label': (1 - pasted) * labels + pasted * tf.reverse(labels,
                                                               axis=[0])}


def mix(batch: Dict[str, tf.Tensor], mixup_alpha: float, cutmix_alpha: float,
        num_classes: int, seed: tf.Tensor) -> Dict[str, tf.Tensor]:
  """Mixup, CutMix, or (both set) one of them per batch."""
  if cutmix_alpha <= 0:
    return mixup(batch, mixup_alpha, num_classes, seed)
  if mixup_alpha <= 0:
    return cutmix(batch, cutmix_alpha, num_classes, seed)
  s = tf.random.experimental.stateless_split(seed, 2)
  use_cutmix = tf.random.stateless_uniform([], s[0]) < 0.5
  # Only the chosen branch runs (both share the seed s[1], as before).
  batch = {**batch, 'image': tf.cast(batch['image'], tf.float32)}
  return tf.cond(use_cutmix,
                 lambda: cutmix(batch, cutmix_alpha, num_classes, s[1]),
                 lambda: mixup(batch, mixup_alpha, num_classes, s[1]))
