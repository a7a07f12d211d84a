"""Prepared tfds datasets, read shard by shard with an optional file order.

Images stay encoded (tfds `SkipDecoding`) until the `decode` op. For the
usual TFRecord format the process's shard is read from tfds' file
instructions directly, so that each epoch can read the files in its own
order (a stateless permutation keyed by a tensor, which tfds' reader cannot
take), and so that a resume starts at any example without reading the files
before it (`host_dataset_from`).
"""

from __future__ import annotations

import os
from typing import List, Optional

import tensorflow as tf
import tensorflow_datasets as tfds

from vit_jax.data import shuffle, vtab_tasks
from vit_jax.data.errors import DatasetNotPreparedError, UnknownSplitError
from vit_jax.data.registry import DatasetSpec
from vit_jax.data import tfrecord_source
from vit_jax.data.sources import Source, register

# Files read concurrently by one process; the order stays deterministic.
_CYCLE_LENGTH = 16


def _cycle_length(num_files: int) -> int:
  return max(1, min(_CYCLE_LENGTH, num_files))


def default_data_dir() -> str:
  """Where tfds reads and writes by default (`TFDS_DATA_DIR` or ~)."""
  return os.environ.get('TFDS_DATA_DIR') or os.path.expanduser(
      '~/tensorflow_datasets')


def load_builder(spec: DatasetSpec, data_dir: Optional[str]):
  """The prepared builder; a DatasetNotPreparedError names the fix."""
  where = data_dir or default_data_dir()
  try:
    builder = tfds.builder(spec.tfds_name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError:
    raise DatasetNotPreparedError(
        f'{spec.name}: no tfds dataset {spec.tfds_name!r} in {where}. '
        f'Prepare it: {spec.prepare}') from None
  if not builder.is_prepared():
    raise DatasetNotPreparedError(
        f'{spec.name}: tfds dataset {builder.info.full_name} is not prepared '
        f'in {where} (looked for {builder.data_dir}). Prepare it: '
        f'{spec.prepare}')
  return builder


@register('tfds')
class TfdsSource(Source):
  """A registry entry backed by a prepared tfds builder.

  ImageNet-21k has no public tfds builder: a `data_dir` holding its
  TFRecord files (`train-*`) is read by `tfrecord_source` instead.
  """

  preparable = True

  @classmethod
  def open(cls, spec: DatasetSpec, input_config) -> Source:
    if spec.name == 'imagenet21k' and tfrecord_source.has_records(
        input_config.get('data_dir')):
      return tfrecord_source.TFRecordSource(spec, input_config)
    return cls(spec, input_config)

  def __init__(self, spec: DatasetSpec, input_config):
    self.spec = spec
    self.builder = load_builder(spec, input_config.get('data_dir'))
    features = self.builder.info.features
    self._decoders = {k: tfds.decode.SkipDecoding()
                      for k, f in features.items()
                      if isinstance(f, tfds.features.Image)}
    self._task = vtab_tasks.TASKS[spec.task] if spec.task else None

  @property
  def num_classes(self) -> int:
    if self.spec.num_classes:
      return self.spec.num_classes
    return self.builder.info.features[self.spec.label_key].num_classes

  def split_names(self) -> List[str]:
    return list(self.builder.info.splits)

  def class_names(self) -> Optional[List[str]]:
    if self._task:  # VTAB label functions (counts, bins) have no names.
      return None
    feature = self.builder.info.features[self.spec.label_key]
    return list(feature.names) if hasattr(feature, 'names') else None

  def _shard(self, split: str, process_index: int, process_count: int):
    sub = tfds.even_splits(split, n=process_count)[process_index]
    try:
      return self.builder.info.splits[sub]
    except (KeyError, ValueError, AssertionError) as e:
      raise UnknownSplitError(
          f'{self.spec.name}: cannot read split {split!r} ({e}); its tfds '
          f'splits: {self.split_names()}') from None

  def host_size(self, split, process_index, process_count) -> int:
    return self._shard(split, process_index, process_count).num_examples

  def reads_in_one_order(self, split, process_index, process_count) -> bool:
    shard = self._shard(split, process_index, process_count)
    return (self.builder.info.file_format != tfds.core.FileFormat.TFRECORD
            or sum(f.take > 0 for f in shard.file_instructions) <= 1)

  def host_dataset(self, split, process_index, process_count, *,
                   order_key=None) -> tf.data.Dataset:
    shard = self._shard(split, process_index, process_count)
    info = self.builder.info
    if info.file_format != tfds.core.FileFormat.TFRECORD:
      # Other formats: tfds' reader, files in their stored order.
      sub = tfds.even_splits(split, n=process_count)[process_index]
      ds = self.builder.as_dataset(split=sub, shuffle_files=False,
                                   decoders=self._decoders)
      return ds.map(self._select, num_parallel_calls=tf.data.AUTOTUNE)
    return self._interleave(self._instructions(shard, order_key))

  def host_dataset_from(self, split, process_index, process_count, start, *,
                        order_key=None) -> tf.data.Dataset:
    """Skips the files read before `start` unopened (TFRecord format)."""
    shard = self._shard(split, process_index, process_count)
    if self.builder.info.file_format != tfds.core.FileFormat.TFRECORD:
      return super().host_dataset_from(split, process_index, process_count,
                                        start, order_key=order_key)
    columns = self._instructions(shard, order_key)
    names, skips, takes = (c.numpy().tolist() for c in columns)
    resumed = tfrecord_source.resume_columns(
        names, skips, takes, _cycle_length(len(takes)), start)
    if resumed is None:  # The whole pass lies before `start`.
      return self._interleave(columns).take(0)
    return self._interleave(resumed, len(takes))

  def _instructions(self, shard, order_key):
    """(file names, skips, takes): the shard's file instructions, in the
    order of `order_key` (a stateless permutation) or as stored."""
    instructions = [f for f in shard.file_instructions if f.take > 0]
    columns = (tf.constant([f.filename for f in instructions], tf.string),
               tf.constant([f.skip for f in instructions], tf.int64),
               tf.constant([f.take for f in instructions], tf.int64))
    if order_key is not None and len(instructions) > 1:
      order = shuffle.permutation(len(instructions), order_key)
      columns = tuple(tf.gather(c, order) for c in columns)
    return columns

  def _interleave(self, columns, num_files=None) -> tf.data.Dataset:
    """The records of `columns` (file, skip, take), interleaved as every
    pass over `num_files` files (the cycle length; default: as many as
    `columns` lists) is."""
    if num_files is None:
      num_files = int(columns[0].shape[0])
    files = tf.data.Dataset.from_tensor_slices(columns)
    records = files.interleave(
        lambda name, skip, take: tf.data.TFRecordDataset(
            name, buffer_size=8 << 20).skip(skip).take(take),
        cycle_length=_cycle_length(num_files),
        block_length=1, num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True)
    return records.map(self._parse, num_parallel_calls=tf.data.AUTOTUNE)

  def _parse(self, serialized: tf.Tensor):
    example = self.builder.info.features.deserialize_example(
        serialized, decoders=self._decoders)
    return self._select(example)

  def _select(self, example):
    spec = self.spec
    if self._task:
      out = self._task(example)
    else:
      out = {'image': example[spec.image_key],
             'label': example[spec.label_key]}
    if spec.real_label_key:
      real = tf.cast(example[spec.real_label_key], tf.int32)
      out['real_label'] = tf.math.bincount(
          real, minlength=self.num_classes, maxlength=self.num_classes) > 0
    return out
