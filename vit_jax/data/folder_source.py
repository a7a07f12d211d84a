"""A user's own images: a folder of class sub-folders of JPEG/PNG files.

Two layouts (local paths or gs://):

    DATA_DIR/CLASS/*.jpg                 one split, `train`
    DATA_DIR/SPLIT/CLASS/*.jpg           SPLIT in train, validation, val, test

Labels are the indices of the sorted class names of the train split; files
are read in sorted order, so splits such as `train[:90%]` are reproducible.
A file that cannot be decoded stops the pipeline with an error naming it;
with `input.skip_bad_images` such files are found by decoding each image
of the process's shard once, skipped, and counted in the logs.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from absl import logging

from vit_jax.data.errors import (BadImageError, DatasetNotPreparedError,
                                 UnknownSplitError)
from vit_jax.data.registry import DatasetSpec
from vit_jax.data.sources import Source, host_ranges

EXTENSIONS = ('.jpg', '.jpeg', '.png')
SPLIT_DIRS = ('train', 'validation', 'val', 'test')


def _join(*parts: str) -> str:
  return os.path.join(*parts)


def _subdirs(path: str) -> List[str]:
  return sorted(d.rstrip('/') for d in tf.io.gfile.listdir(path)
                if tf.io.gfile.isdir(_join(path, d.rstrip('/'))))


def _images(path: str) -> List[str]:
  return sorted(_join(path, f) for f in tf.io.gfile.listdir(path)
                if f.lower().endswith(EXTENSIONS))


def unreadable(paths: Sequence[str]) -> List[str]:
  """The paths that TensorFlow cannot decode as images (all decoded once)."""
  if not paths:
    return []
  ds = tf.data.Dataset.from_tensor_slices(list(paths))
  ds = ds.map(lambda p: (p, tf.shape(tf.io.decode_image(
      tf.io.read_file(p), channels=3, expand_animations=False))),
              num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
  ok = {p.decode() for p, _ in ds.ignore_errors().as_numpy_iterator()}
  return [p for p in paths if p not in ok]


class FolderSource(Source):
  """Class sub-folders of images; see the module docstring."""

  def __init__(self, spec: DatasetSpec, root: Optional[str], *,
               skip_bad_images: bool = False):
    self.spec = spec
    if not root or not tf.io.gfile.isdir(root):
      raise DatasetNotPreparedError(
          f'{spec.name}: input.data_dir must be a folder of class '
          f'sub-folders of images, got {root!r} ({spec.prepare})')
    self.root = root
    self.skip_bad_images = skip_bad_images
    top = _subdirs(root)
    if 'train' in top and set(top) <= set(SPLIT_DIRS):
      split_dirs = {s: _join(root, s) for s in top}
    else:
      split_dirs = {'train': root}
    self.classes = _subdirs(split_dirs['train'])
    if not self.classes:
      raise DatasetNotPreparedError(f'{root}: no class sub-folders')
    index = {c: i for i, c in enumerate(self.classes)}
    self._files: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
    for split, path in split_dirs.items():
      paths, labels = [], []
      for cls in _subdirs(path):
        if cls not in index:
          raise DatasetNotPreparedError(
              f'{path}/{cls}: class {cls!r} is not a class of the train '
              f'split ({len(self.classes)} classes)')
        files = _images(_join(path, cls))
        paths += files
        labels += [index[cls]] * len(files)
      if not paths:
        raise DatasetNotPreparedError(
            f'{path}: no {"/".join(EXTENSIONS)} files in its class folders')
      self._files[split] = (np.array(paths), np.array(labels, np.int64))
    self._good: Dict[tuple, Tuple[np.ndarray, np.ndarray]] = {}

  @property
  def num_classes(self) -> int:
    return len(self.classes)

  def split_names(self) -> List[str]:
    return list(self._files)

  def element_spec(self, split: str):
    return {'image': tf.TensorSpec([], tf.string),
            'label': tf.TensorSpec([], tf.int64)}

  def default_eval_split(self) -> str:
    for split in ('test', 'validation', 'val'):
      if split in self._files:
        return split
    raise UnknownSplitError(
        f'{self.root} has only a train split: set input.eval_split (and '
        "input.train_split), e.g. 'train[90%:]' and 'train[:90%]'")

  def _ranges(self, split, process_index, process_count):
    sizes = {s: len(p) for s, (p, _) in self._files.items()}
    try:
      return host_ranges(split, sizes, process_index, process_count)
    except ValueError as e:
      raise UnknownSplitError(f'{self.root}: {e}') from None

  def host_files(self, split: str, process_index: int,
                 process_count: int) -> Tuple[np.ndarray, np.ndarray]:
    """(paths, labels) of the shard, sorted order, without skipped files."""
    key = (split, process_index, process_count)
    if key not in self._good:
      parts = [(self._files[s][0][a:b], self._files[s][1][a:b])
               for s, a, b in self._ranges(*key)]
      paths = np.concatenate([p for p, _ in parts])
      labels = np.concatenate([l for _, l in parts])
      if self.skip_bad_images:
        bad = set(unreadable([str(p) for p in paths]))
        if bad:
          logging.warning(
              'skip_bad_images: skipped %d of %d images of %s split %r '
              '(process %d/%d) that cannot be decoded, e.g. %s', len(bad),
              len(paths), self.root, split, process_index, process_count,
              sorted(bad)[:5])
          keep = np.array([str(p) not in bad for p in paths], bool)
          paths, labels = paths[keep], labels[keep]
      self._good[key] = (paths, labels)
    return self._good[key]

  def host_size(self, split, process_index, process_count) -> int:
    return len(self.host_files(split, process_index, process_count)[0])

  def size_bound(self, split, process_index, process_count) -> int:
    # Before skipping bad files: known alike on every process.
    return sum(b - a for _, a, b in self._ranges(
        split, process_index, process_count))

  def host_dataset(self, split, process_index, process_count, *,
                   order_seed=None) -> tf.data.Dataset:
    paths, labels = self.host_files(split, process_index, process_count)
    ds = tf.data.Dataset.from_tensor_slices({'path': paths, 'label': labels})
    if order_seed is not None and len(paths) > 1:
      ds = ds.shuffle(len(paths), seed=order_seed)
    return ds.map(lambda x: {'image': tf.io.read_file(x['path']),
                             'label': x['label']},
                  num_parallel_calls=tf.data.AUTOTUNE)

  def explain_error(self, error, split, process_index, process_count):
    if not isinstance(error, (tf.errors.InvalidArgumentError,
                              tf.errors.DataLossError)):
      return None
    paths, _ = self.host_files(split, process_index, process_count)
    bad = unreadable([str(p) for p in paths])
    if not bad:
      return None
    shown = ', '.join(bad[:5]) + (' ...' if len(bad) > 5 else '')
    return BadImageError(
        f'cannot decode {len(bad)} image file(s) of folder dataset '
        f'{self.root}: {shown}. Remove or replace them, or set '
        'input.skip_bad_images=True to skip such files (they are counted in '
        'the logs).', bad)
