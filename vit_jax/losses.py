"""The classification losses, one definition for training and evaluation.

`softmax`: softmax cross-entropy (one class per image). `sigmoid`: sigmoid
binary cross-entropy summed over the classes, the reference recipe of
ImageNet-21k and JFT pre-training (with a head bias of -10). The train step
averages them over the batch; evaluators report the mean over a split.
"""

from __future__ import annotations

import jax
import optax

LOSSES = ('softmax', 'sigmoid')


def check(kind: str) -> None:
  if kind not in LOSSES:
    raise ValueError(f'loss={kind!r}: expected one of {LOSSES}')


def per_example(logits: jax.Array, targets: jax.Array,
                kind: str = 'softmax') -> jax.Array:
  """(N,) losses of `logits` (N, K) against float `targets` (N, K): one-hot,
  soft (mixup, label smoothing) or multi-hot."""
  check(kind)
  if kind == 'softmax':
    return optax.softmax_cross_entropy(logits, targets)
  return optax.sigmoid_binary_cross_entropy(logits, targets).sum(-1)
