"""Where examples come from: the interface every source implements.

A source turns (split, process) into a tf.data pass over that process's
shard, in a fixed order, of `{'image': encoded bytes or uint8 HxWxC,
'label': int}` (plus `real_label` for ImageNet ReaL). Shards follow
`tfds.even_splits(split, n)`, which splits each `+` part of a split on its
own: process i of n reads the i-th contiguous range of every part, so its
shard is one range per part (one contiguous range for a plain split). The
shards are disjoint and together cover the split; within one part their
sizes differ by at most one, so shard sizes differ by at most the number of
parts (`train[:800]+validation[:200]` on 3 processes: 267+67, 267+67,
266+66 = 334, 334, 332). TFRecord sources give each process every n-th file
instead (see `tfrecord_source.py`).

Each implementation registers the source kind that registry entries name
(`DatasetSpec.source`) with `@register(kind)`: `tfds_source.py` (prepared
tfds datasets), `folder_source.py` (a user's folder of class sub-folders),
`tfrecord_source.py` (JFT-style TFRecords), `memory_source.py` (digits and
mnist5k, in memory). `kinds.py` imports them and opens sources.
"""

from __future__ import annotations

import abc
import types
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Type

import tensorflow as tf
import tensorflow_datasets as tfds

from vit_jax import registration
from vit_jax.data.errors import LabelRangeError
from vit_jax.data.registry import DatasetSpec


class Source(abc.ABC):
  """One dataset's examples, split by split and process by process."""

  spec: DatasetSpec
  # Whether `python -m vit_jax.data.prepare` (and `input.prepare`) can
  # prepare this kind's data; the others need none or are the user's own.
  preparable = False

  @abc.abstractmethod
  def __init__(self, spec: DatasetSpec, input_config):
    """Every kind is built from its registry entry and the `input` config."""

  @classmethod
  def open(cls, spec: DatasetSpec, input_config) -> 'Source':
    """The source to read `spec` with (a kind may hand over to another)."""
    return cls(spec, input_config)

  @property
  @abc.abstractmethod
  def num_classes(self) -> int:
    """Number of classes."""

  @abc.abstractmethod
  def split_names(self) -> List[str]:
    """The base splits that exist (for error messages)."""

  @abc.abstractmethod
  def host_size(self, split: str, process_index: int,
                process_count: int) -> Optional[int]:
    """Examples in the process's shard; None if unknown without reading."""

  def count_host(self, split: str, process_index: int,
                 process_count: int) -> int:
    """Examples in the process's shard, reading the data if it must."""
    size = self.host_size(split, process_index, process_count)
    assert size is not None, type(self).__name__
    return size

  def size_bound(self, split: str, process_index: int,
                 process_count: int) -> int:
    """At least `host_size`, and computed alike on every process.

    Evaluation pads every process to the batch count of the largest bound,
    so that all processes run the same number of steps.
    """
    return self.count_host(split, process_index, process_count)

  def split_size(self, split: str) -> Optional[int]:
    """Examples in the whole split (all processes); None if unknown.

    Cheap: `dataset_info` calls it on every process before training.
    """
    return self.host_size(split, 0, 1)

  def reads_in_one_order(self, split: str, process_index: int,
                         process_count: int) -> bool:
    """Whether `host_dataset` ignores `order_key` for this shard: one file,
    or arrays in memory. Every epoch then cuts the shard into the same
    blocks of `shuffle_buffer` examples (the pipeline warns)."""
    del split, process_index, process_count
    return False

  def check_train_split(self, split: str, process_count: int) -> None:
    """Raises a DataError if `process_count` processes cannot train on it.

    E.g. TFRecord files that do not divide evenly among the processes.
    """
    del split, process_count

  @abc.abstractmethod
  def host_dataset(self, split: str, process_index: int, process_count: int,
                   *, order_key: Optional[tf.Tensor] = None
                   ) -> tf.data.Dataset:
    """One pass over the process's shard of `split`.

    Args:
      split: a split expression (registry named splits already resolved).
      process_index: this process, in [0, process_count).
      process_count: number of processes reading the split.
      order_key: optional int64 [2] stateless key (may be a tensor): permute
        the coarse read order (files, paths) with `shuffle.permutation`;
        cheap, no examples held in memory.

    Returns:
      A dataset of example dicts; same order for the same arguments.
    """

  def host_dataset_from(self, split: str, process_index: int,
                        process_count: int, start: int, *,
                        order_key: Optional[tf.Tensor] = None
                        ) -> tf.data.Dataset:
    """`host_dataset` from its element `start` on: what a resume reads.

    This default reads the first `start` examples and drops them (cheap in
    memory, not for large shards read from files). The TFRecord sources
    override it to open only the files that hold examples from `start` on,
    skipping within them (`tfrecord_source.interleave_resume`). Called
    eagerly: `start` is a Python int and `order_key` holds values.

    Returns:
      Exactly `host_dataset(...).skip(start)`, element for element.
    """
    return self.host_dataset(split, process_index, process_count,
                             order_key=order_key).skip(start)

  def element_spec(self, split: str):
    """The structure of `host_dataset` elements (reads no data)."""
    return self.host_dataset(split, 0, 1).element_spec

  def default_eval_split(self) -> str:
    split = self.spec.eval_split
    if split is None:
      raise ValueError(f'{self.spec.name}: set input.eval_split')
    return split

  def class_names(self) -> Optional[List[str]]:
    """The name of each label, in label order; None where the data has none
    (from metadata: tfds features, class folders; reads no examples)."""
    return None

  def largest_label(self) -> Tuple[int, str]:
    """(the largest label the data can hold, where that is known from).

    From metadata (class folders, tfds features, the registry, the loaded
    arrays): cheap, reads no examples.
    """
    return self.num_classes - 1, 'its class count'

  def check_labels(self, num_classes: int) -> None:
    """Raises a LabelRangeError if a label can reach `num_classes` or more.

    A label outside the head would train silently (one-hot of zeros, NaN
    loss in evaluation); sources whose labels are only known by reading
    also check each example in `host_dataset`.
    """
    largest, known_from = self.largest_label()
    if largest >= num_classes:
      raise LabelRangeError(
          f'dataset {self.spec.name!r} has labels up to {largest} '
          f'({known_from}) but the model head has num_classes={num_classes}: '
          f'set --config.num_classes={largest + 1} or leave it None (the '
          "dataset's class count)")

  def explain_error(self, error: Exception, split: str, process_index: int,
                    process_count: int) -> Optional[Exception]:
    """A clearer error for a failure while reading, or None to re-raise."""
    del error, split, process_index, process_count
    return None


def host_ranges(split: str, sizes: Mapping[str, int], process_index: int,
                process_count: int) -> List[Tuple[str, int, int]]:
  """(base split, start, stop) ranges of `split` read by one process.

  The same arithmetic as `tfds.even_splits` applies to tfds datasets, so
  every source shards and slices alike ('train[:800]', 'test[50%:]', '+').
  """
  sub = tfds.even_splits(split, n=process_count)[process_index]
  infos = {name: types.SimpleNamespace(num_examples=n, shard_lengths=[n])
           for name, n in sizes.items()}
  try:
    absolute = sub.to_absolute(infos)
  except (ValueError, AssertionError) as e:
    raise ValueError(f'split {split!r}: {e} (splits: {dict(sizes)})') from e
  return [(a.splitname, a.from_ or 0, sizes[a.splitname] if a.to is None
           else a.to) for a in absolute]


KINDS: Dict[str, Type[Source]] = {}


def register(kind: str) -> Callable[[Type[Source]], Type[Source]]:
  """Class decorator: registry entries with `source=kind` open the class.

  The class is built as `cls.open(spec, input_config)` (by default
  `cls(spec, input_config)`), once per configuration.
  """
  def add(cls: Type[Source]) -> Type[Source]:
    # The same definition run again (a config file runs twice) replaces
    # itself: `vit_jax.registration`.
    registration.check_free('source kind', kind, KINDS.get(kind), cls)
    KINDS[kind] = cls
    return cls
  return add


def get_kind(name: str, dataset: str = '') -> Type[Source]:
  """The class registered as source kind `name`."""
  if name not in KINDS:
    raise ValueError(f'{dataset}: unknown source kind {name!r}; registered: '
                     f'{", ".join(sorted(KINDS))} (register one with '
                     '@vit_jax.data.sources.register(KIND))')
  return KINDS[name]
