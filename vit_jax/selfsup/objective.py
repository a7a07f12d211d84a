"""The masked-patch-prediction loss over the selected positions."""

from __future__ import annotations

from typing import Dict, Optional

import jax
import jax.numpy as jnp
import optax

from vit_jax.selfsup import targets as targets_lib
from vit_jax.selfsup.model import DOWNSIZED


def make_targets(images, target: str, stride: int, bits: int):
  """(batch, N, predictions) int32 classes, or (batch, N, values) float32."""
  if target == 'colour':
    return targets_lib.patch_colour_targets(images, stride, bits)[..., None]
  if target == 'downsized':
    return targets_lib.downsized_targets(images, stride, bits, DOWNSIZED)
  return targets_lib.pixel_targets(images, stride)


def sums(outputs: jax.Array, selected: jax.Array, images: jax.Array, *,
         target: str, stride: int, bits: int,
         weights: Optional[jax.Array] = None) -> Dict[str, jax.Array]:
  """Sums over the selected positions (of rows with weight 1): `loss`,
  `correct` (fraction of a position's predictions that are right; 0 for
  'pixels') and `count` (selected positions)."""
  sel = selected.astype(jnp.float32)
  if weights is not None:
    sel = sel * weights.astype(jnp.float32)[:, None]
  tgt = make_targets(images, target, stride, bits)
  if target == 'pixels':
    per = jnp.mean(jnp.square(outputs - tgt), axis=-1)
    correct = jnp.zeros_like(per)
  else:
    per = optax.softmax_cross_entropy_with_integer_labels(outputs, tgt)
    per = jnp.mean(per, axis=-1)
    correct = jnp.mean((jnp.argmax(outputs, -1) == tgt).astype(jnp.float32),
                       axis=-1)
  return {'loss': jnp.sum(per * sel), 'correct': jnp.sum(correct * sel),
          'count': jnp.sum(sel)}


def loss_and_metrics(outputs, selected, images, *, target: str, stride: int,
                     bits: int):
  """(mean loss over selected positions, {'mpp_accuracy': ...})."""
  s = sums(outputs, selected, images, target=target, stride=stride,
           bits=bits)
  count = jnp.maximum(s['count'], 1.0)
  metrics = {} if target == 'pixels' else {
      'mpp_accuracy': s['correct'] / count}
  return s['loss'] / count, metrics
