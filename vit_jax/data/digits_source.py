"""scikit-learn's `digits`: 1797 real 8x8 handwritten digits, in memory.

A tiny dataset for tests and CPU smoke runs that flows through the same
tf.data code as every other source. Pixels (0..16) are scaled to uint8
0..255, one channel; `train` is the first 1437 images, `test` the last 360.
"""

from __future__ import annotations

import functools
from typing import List, Tuple

import numpy as np
import tensorflow as tf

from vit_jax.data.errors import UnknownSplitError
from vit_jax.data.registry import DatasetSpec
from vit_jax.data.sources import Source, host_ranges

NUM_TRAIN = 1437


@functools.lru_cache(maxsize=1)
def load() -> Tuple[np.ndarray, np.ndarray]:
  """(images uint8 [1797, 8, 8, 1], labels int64 [1797])."""
  from sklearn import datasets  # Test-time dependency; imported on use.
  digits = datasets.load_digits()
  images = np.round(digits.images * (255 / 16)).astype(np.uint8)[..., None]
  return images, digits.target.astype(np.int64)


class DigitsSource(Source):
  """The digits arrays, split and sharded like any other source."""

  def __init__(self, spec: DatasetSpec):
    self.spec = spec
    images, labels = load()
    self._splits = {'train': (images[:NUM_TRAIN], labels[:NUM_TRAIN]),
                    'test': (images[NUM_TRAIN:], labels[NUM_TRAIN:])}

  @property
  def num_classes(self) -> int:
    return 10

  def split_names(self) -> List[str]:
    return list(self._splits)

  def _ranges(self, split, process_index, process_count):
    sizes = {k: len(v[1]) for k, v in self._splits.items()}
    try:
      return host_ranges(split, sizes, process_index, process_count)
    except ValueError as e:
      raise UnknownSplitError(f'digits: {e}') from None

  def host_size(self, split, process_index, process_count) -> int:
    return sum(b - a for _, a, b in self._ranges(
        split, process_index, process_count))

  def host_dataset(self, split, process_index, process_count, *,
                   order_key=None) -> tf.data.Dataset:
    del order_key  # In memory: the pipeline's block shuffle is the order.
    parts = [(self._splits[s][0][a:b], self._splits[s][1][a:b])
             for s, a, b in self._ranges(split, process_index, process_count)]
    images = np.concatenate([i for i, _ in parts])
    labels = np.concatenate([l for _, l in parts])
    return tf.data.Dataset.from_tensor_slices(
        {'image': images, 'label': labels})
