"""TFRecord files of encoded images and labels (JFT-style, or ImageNet-21k).

Each record is a `tf.train.Example` with the encoded image bytes and an
int64 label list (the first label is the class); the feature names default
to `image/encoded` and `image/class/label` and can be set with
`input.image_key` / `input.label_key`. The files of split SPLIT are
`DATA_DIR/SPLIT`, `DATA_DIR/SPLIT-*`, `DATA_DIR/SPLIT.*`, `DATA_DIR/SPLIT_*`
or `DATA_DIR/SPLIT/*`, sorted. Processes read every n-th file (or, with
fewer files than processes, every n-th record). Record counts are unknown
without reading the files: evaluation counts them once, training uses
`input.num_train_examples` (or the registry's) where it needs a size.
"""

from __future__ import annotations

import functools
import os
from typing import List, Optional

import tensorflow as tf

from vit_jax.data.errors import DatasetNotPreparedError, UnknownSplitError
from vit_jax.data.registry import DatasetSpec
from vit_jax.data.sources import Source

_CYCLE_LENGTH = 16
IMAGE_KEY, LABEL_KEY = 'image/encoded', 'image/class/label'


def split_files(data_dir: str, split: str) -> List[str]:
  """The files of `split` under `data_dir`, sorted."""
  folder = os.path.join(data_dir, split)
  if tf.io.gfile.isdir(folder):
    return sorted(f for f in tf.io.gfile.glob(os.path.join(folder, '*'))
                  if not tf.io.gfile.isdir(f))
  out = []
  for f in tf.io.gfile.glob(os.path.join(data_dir, split) + '*'):
    name = os.path.basename(f)
    if name == split or name[len(split):len(split) + 1] in ('-', '.', '_'):
      out.append(f)
  return sorted(out)


def has_records(data_dir: Optional[str]) -> bool:
  """Whether `data_dir` holds TFRecord files of a train split."""
  return bool(data_dir) and tf.io.gfile.isdir(data_dir) and bool(
      split_files(data_dir, 'train'))


@functools.lru_cache(maxsize=None)
def _count_records(path: str) -> int:
  return int(tf.data.TFRecordDataset(path).reduce(
      tf.constant(0, tf.int64), lambda n, _: n + 1))


class TFRecordSource(Source):
  """Examples from TFRecord files; see the module docstring."""

  def __init__(self, spec: DatasetSpec, input_config):
    self.spec = spec
    self.data_dir = input_config.get('data_dir')
    if not self.data_dir or not tf.io.gfile.isdir(self.data_dir):
      raise DatasetNotPreparedError(
          f'{spec.name}: input.data_dir must be the folder of the TFRecord '
          f'files, got {self.data_dir!r} ({spec.prepare})')
    self._num_classes = input_config.get('num_classes') or spec.num_classes
    if not self._num_classes:
      raise ValueError(f'{spec.name}: set input.num_classes for TFRecords')
    # A tfds entry read from TFRecords (imagenet21k) has tfds' key names.
    own = spec.source == 'tfrecord'
    self.image_key = input_config.get('image_key') or (
        spec.image_key if own else IMAGE_KEY)
    self.label_key = input_config.get('label_key') or (
        spec.label_key if own else LABEL_KEY)

  @property
  def num_classes(self) -> int:
    return self._num_classes

  def split_names(self) -> List[str]:
    return [s for s in ('train', 'validation', 'val', 'test')
            if split_files(self.data_dir, s)]

  def files(self, split: str) -> List[str]:
    files = split_files(self.data_dir, split)
    if not files:
      raise UnknownSplitError(
          f'{self.spec.name}: no TFRecord files for split {split!r} in '
          f'{self.data_dir} (expected {split}-*, {split}.* or {split}/*; '
          f'splits found: {self.split_names()}). TFRecord splits cannot be '
          'sliced; write the files of each split separately.')
    return files

  def _host_files(self, split, process_index, process_count):
    """(files, record-level sharding?) read by the process."""
    files = self.files(split)
    if len(files) >= process_count:
      return files[process_index::process_count], False
    return files, True

  def host_size(self, split, process_index, process_count) -> None:
    return None

  def count_host(self, split, process_index, process_count) -> int:
    files, by_record = self._host_files(split, process_index, process_count)
    total = sum(_count_records(f) for f in files)
    if by_record:
      return total // process_count + (process_index < total % process_count)
    return total

  def split_size(self, split: str) -> Optional[int]:
    return None

  def host_dataset(self, split, process_index, process_count, *,
                   order_seed=None) -> tf.data.Dataset:
    files, by_record = self._host_files(split, process_index, process_count)
    if by_record:
      ds = tf.data.TFRecordDataset(files).shard(process_count, process_index)
    else:
      ds = tf.data.Dataset.from_tensor_slices(files)
      if order_seed is not None and len(files) > 1:
        ds = ds.shuffle(len(files), seed=order_seed)
      ds = ds.interleave(
          lambda f: tf.data.TFRecordDataset(f, buffer_size=8 << 20),
          cycle_length=min(_CYCLE_LENGTH, len(files)), block_length=1,
          num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.map(self._parse, num_parallel_calls=tf.data.AUTOTUNE)

  def _parse(self, serialized):
    x = tf.io.parse_single_example(serialized, {
        self.image_key: tf.io.FixedLenFeature([], tf.string),
        self.label_key: tf.io.VarLenFeature(tf.int64)})
    labels = tf.sparse.to_dense(x[self.label_key])
    return {'image': x[self.image_key], 'label': labels[0]}
