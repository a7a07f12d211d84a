"""TFRecord files of encoded images and labels (JFT-style, or ImageNet-21k).

Each record is a `tf.train.Example` with the encoded image bytes and an
int64 label list (the first label is the class); the feature names default
to `image/encoded` and `image/class/label` and can be set with
`input.image_key` / `input.label_key`. A record with an empty or missing
label list, or a label outside [0, num_classes), stops the pipeline with an
error naming its file (`explain_error`).

Files of split SPLIT, sorted: `DATA_DIR/SPLIT`, `DATA_DIR/SPLIT-<digit>...`
(`train-00000-of-01024`), `DATA_DIR/SPLIT.tfrecord[s]` alone or followed by
`-...` / `@...` (`train.tfrecord-00000-of-00008`), or every file of a folder
`DATA_DIR/SPLIT/` except hidden and `_`-prefixed ones (`_SUCCESS`). Other
names are not read: `train_dev-*`, `train-dev-*` or `train.bak` are not
`train` files.

Sharding: with at least as many files as processes, process i of n reads
files i, i+n, i+2n, ...; training then needs a file count divisible by n
(`check_train_split` says how to re-shard otherwise), evaluation does not
(it pads). With fewer files than processes every process reads every file
and keeps every n-th record of each.

Record counts: a process counts the records of the files it needs once,
reading but not parsing them: for training its own files; for evaluation
every file of the split (each process pads to the largest shard's batch
count without asking the others; `dataset_info` counts them all too). Each
file's count is cached in
`DATA_DIR/.record_counts/` (keyed by file name and size; a file whose size
changed is recounted; where DATA_DIR is read-only the counts are kept in
memory only, and computed again by the next run). Training needs them to
turn a batch count into a position and to resume there without reading the
files before it (`interleave_resume`), evaluation to pad. `count_records`
fills the cache ahead of time:

    python -c "from vit_jax.data import tfrecord_source as t; \\
        t.count_records('gs://bucket/jft', 'train')"
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import uuid
from typing import Dict, List, Optional, Sequence, Tuple

import tensorflow as tf
from absl import logging

from vit_jax.data import shuffle
from vit_jax.data.errors import (DataError, DatasetNotPreparedError,
                                 LabelRangeError, UnknownSplitError)
from vit_jax.data.registry import DatasetSpec
from vit_jax.data.sources import Source, register

_CYCLE_LENGTH = 16
_STAT_THREADS = 32
IMAGE_KEY, LABEL_KEY = 'image/encoded', 'image/class/label'
COUNTS_DIR = '.record_counts'
_LABEL_OUT_OF_RANGE = 'TFRecord label out of range'
_NO_LABEL = 'TFRecord record without a label'
# What may follow SPLIT in a file name: `-` and a digit (shard numbers), or
# `.tfrecord` / `.tfrecords` alone or followed by `-...` or `@...`.
_SUFFIX = r'(-\d.*|\.tfrecords?([-@].*)?)?'


def _is_split_file(name: str, split: str) -> bool:
  return re.fullmatch(re.escape(split) + _SUFFIX, name) is not None


def split_files(data_dir: str, split: str) -> List[str]:
  """The files of `split` under `data_dir`, sorted (module docstring)."""
  folder = os.path.join(data_dir, split)
  if tf.io.gfile.isdir(folder):
    return sorted(f for f in tf.io.gfile.glob(os.path.join(folder, '*'))
                  if not os.path.basename(f).startswith(('.', '_'))
                  and not tf.io.gfile.isdir(f))
  return sorted(f for f in tf.io.gfile.glob(os.path.join(data_dir, split)
                                            + '*')
                if _is_split_file(os.path.basename(f), split))


def has_records(data_dir: Optional[str]) -> bool:
  """Whether `data_dir` holds TFRecord files of a train split."""
  return bool(data_dir) and tf.io.gfile.isdir(data_dir) and bool(
      split_files(data_dir, 'train'))


# Record counts.

_COUNTS: Dict[str, int] = {}  # path -> records, for this process's life.


def _cache_file(data_dir: str, path: str) -> str:
  root = data_dir.rstrip('/') + '/'
  name = path[len(root):] if path.startswith(root) else path
  return os.path.join(data_dir, COUNTS_DIR,
                      name.replace('/', '%2F') + '.json')


def _read_cached(data_dir: str, path: str) -> Tuple[int, Optional[int]]:
  """(file size, cached record count or None)."""
  size = tf.io.gfile.stat(path).length
  try:
    with tf.io.gfile.GFile(_cache_file(data_dir, path)) as f:
      entry = json.load(f)
  except (tf.errors.OpError, OSError, ValueError):
    return size, None
  if entry.get('bytes') != size:
    return size, None  # The file changed since it was counted.
  return size, int(entry['records'])


def _write_cached(data_dir: str, path: str, size: int, records: int) -> bool:
  """Caches a count (written then renamed); False where that fails."""
  target = _cache_file(data_dir, path)
  temp = f'{target}.tmp-{uuid.uuid4().hex}'
  try:
    tf.io.gfile.makedirs(os.path.dirname(target))
    with tf.io.gfile.GFile(temp, 'w') as f:
      json.dump({'records': records, 'bytes': size}, f)
    tf.io.gfile.rename(temp, target, overwrite=True)
  except (tf.errors.OpError, OSError):
    return False
  return True


def _count_files(paths: Sequence[str]) -> List[int]:
  """Records in each file, files read in parallel, records not parsed."""
  def count(path):
    return tf.data.TFRecordDataset(path, buffer_size=8 << 20).reduce(
        tf.constant(0, tf.int64), lambda n, _: n + 1)
  ds = tf.data.Dataset.from_tensor_slices(list(paths)).map(
      count, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  return [int(n) for n in ds.as_numpy_iterator()]


def record_counts(data_dir: str, paths: Sequence[str]) -> List[int]:
  """Records in each of `paths` (files under `data_dir`), cached."""
  missing = [p for p in dict.fromkeys(paths) if p not in _COUNTS]
  if missing:
    with concurrent.futures.ThreadPoolExecutor(_STAT_THREADS) as pool:
      cached = list(pool.map(lambda p: _read_cached(data_dir, p), missing))
    to_count = [(p, size) for p, (size, n) in zip(missing, cached)
                if n is None]
    _COUNTS.update((p, n) for p, (_, n) in zip(missing, cached)
                   if n is not None)
    if to_count:
      counts = _count_files([p for p, _ in to_count])
      saved = [_write_cached(data_dir, p, size, n)
               for (p, size), n in zip(to_count, counts)]
      _COUNTS.update((p, n) for (p, _), n in zip(to_count, counts))
      logging.info('counted the records of %d TFRecord files in %s (%s)',
                   len(to_count), data_dir,
                   f'cached in {COUNTS_DIR}/' if all(saved) else
                   'could not cache the counts: read-only?')
  return [_COUNTS[p] for p in paths]


def count_records(data_dir: str, split: str) -> int:
  """Counts (and caches) the records of every file of `split`."""
  return sum(record_counts(data_dir, split_files(data_dir, split)))


# Continuing an interleave part-way.


def interleave_resume(lengths: Sequence[int], cycle_length: int,
                      start: int) -> List[Tuple[int, int]]:
  """Where an interleave of files stands after `start` of its elements.

  The files are read as `interleave(cycle_length=cycle_length,
  block_length=1, deterministic=True)`, file i giving `lengths[i]`
  elements. tf.data fills the slots lazily in turn; at a slot's turn an
  open file gives its next element (and the turn passes on), an exhausted
  one is closed (the turn passes on, no element), and an empty slot opens
  the next file and reads it in the same turn (passing on once the queue
  is empty). After `start` elements some files are open at some offset,
  some are queued and the turn is at some slot.

  Returns:
    [(file, offset)]: the open files from the slot whose turn is next,
    round the cycle, each empty slot taking the next queued file (offset
    0), then the rest of the queue. A fresh interleave of the same
    cycle length over these files, each from its offset, gives exactly
    the elements from `start` on (the cycle is round-robin, so rotating
    it to the next turn changes nothing), without reading the files that
    were finished. Finished files still open take a turn to close: they
    are listed with offset == length (read nothing, open nothing).

  Costs O(files x cycle_length) steps: whole rounds are counted at once.
  """
  total = sum(lengths)
  if not 0 <= start <= total:
    raise ValueError(f'cannot start at element {start} of {total}')
  slots: List[Optional[List[int]]] = [None] * cycle_length
  turn, queued, left = 0, 0, start
  while left:
    open_ = [s for s in slots if s is not None]
    if open_ and (queued == len(lengths) or len(open_) == cycle_length):
      # No slot will open a file this round: every open file gives one
      # element per round until the first of them is finished.
      rounds = min(min(lengths[f] - o for f, o in open_),
                   left // len(open_))
      if rounds:
        for s in open_:
          s[1] += rounds
        left -= rounds * len(open_)
        continue
    slot = slots[turn]
    if slot is None and queued < len(lengths):
      slots[turn] = [queued, 0]  # Read in this same turn.
      queued += 1
      continue
    if slot is not None and slot[1] < lengths[slot[0]]:
      slot[1] += 1
      left -= 1
    else:
      slots[turn] = None
    turn = (turn + 1) % cycle_length
  out = []
  for i in range(cycle_length):
    slot = slots[(turn + i) % cycle_length]
    if slot is not None:
      out.append(tuple(slot))
    elif queued < len(lengths):
      out.append((queued, 0))
      queued += 1
  return out + [(f, 0) for f in range(queued, len(lengths))]


def resume_columns(names: Sequence[str], skips: Sequence[int],
                   lengths: Sequence[int], cycle_length: int, start: int):
  """(file names, skips, takes) tensors of the files an interleave of
  `names` (file i from its record `skips[i]` on, `lengths[i]` records)
  still reads after `start` records, each from where it then stands
  (`interleave_resume`); None where the pass ends before `start`."""
  resume = interleave_resume(lengths, cycle_length, start)
  if not resume:
    return None
  return (tf.constant([names[f] for f, _ in resume], tf.string),
          tf.constant([skips[f] + o for f, o in resume], tf.int64),
          tf.constant([lengths[f] - o for f, o in resume], tf.int64))


def _records_of_shard(count: int, process_index: int,
                      process_count: int) -> int:
  """len(range(process_index, count, process_count))."""
  return max(0, -(-(count - process_index) // process_count))


@register('tfrecord')
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
      raise DataError(f'{spec.name}: TFRecords do not record their class '
                      'count: pass --config.input.num_classes=N (the labels '
                      'are checked against it as they are read)')
    # A tfds entry read from TFRecords (imagenet21k) has tfds' key names.
    own = spec.source == 'tfrecord'
    self.image_key = input_config.get('image_key') or (
        spec.image_key if own else IMAGE_KEY)
    self.label_key = input_config.get('label_key') or (
        spec.label_key if own else LABEL_KEY)
    multi = input_config.get('multi_label')
    self.multi_label = bool(spec.multi_label if multi is None else multi)

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
          f'{self.data_dir} (expected {split}-00000-of-..., '
          f'{split}.tfrecord... or {split}/*; splits found: '
          f'{self.split_names()}). TFRecord splits cannot be sliced; write '
          'the files of each split separately.')
    return files

  def _host_files(self, split, process_index, process_count):
    """(files, record-level sharding?) read by the process."""
    files = self.files(split)
    if len(files) >= process_count:
      return files[process_index::process_count], False
    return files, True

  def check_train_split(self, split, process_count) -> None:
    n = len(self.files(split))
    if n >= process_count and n % process_count:
      fewer, more = n - n % process_count, n + process_count - n % process_count
      raise DataError(
          f'{self.spec.name}: the {n} TFRecord files of split {split!r} do '
          f'not divide evenly among {process_count} processes, whose shards '
          'would differ by whole files. Re-shard the split into a multiple '
          f'of {process_count} files of similar size (e.g. {fewer} or '
          f'{more}), or train with a process count that divides {n}.')

  def host_size(self, split, process_index, process_count) -> None:
    return None  # Unknown without reading the files: see `count_host`.

  def count_host(self, split, process_index, process_count) -> int:
    files, by_record = self._host_files(split, process_index, process_count)
    counts = record_counts(self.data_dir, files)
    if by_record:
      return sum(_records_of_shard(c, process_index, process_count)
                 for c in counts)
    return sum(counts)

  def split_size(self, split: str) -> Optional[int]:
    return None

  def host_dataset(self, split, process_index, process_count, *,
                   order_key=None) -> tf.data.Dataset:
    files, by_record = self._host_files(split, process_index, process_count)
    names = tf.constant(files, tf.string)
    if order_key is not None and len(files) > 1:
      names = tf.gather(names, shuffle.permutation(len(files), order_key))
    zeros = tf.zeros([len(files)], tf.int64)
    return self._interleave(names, zeros, zeros - 1, len(files), by_record,
                            process_index, process_count)

  def host_dataset_from(self, split, process_index, process_count, start, *,
                        order_key=None) -> tf.data.Dataset:
    """Skips the files read before `start` unopened (counts are cached)."""
    files, by_record = self._host_files(split, process_index, process_count)
    counts = record_counts(self.data_dir, files)
    if by_record:
      counts = [_records_of_shard(c, process_index, process_count)
                for c in counts]
    order = list(range(len(files)))
    if order_key is not None and len(files) > 1:
      order = [int(i) for i in shuffle.permutation(len(files), order_key)]
    columns = resume_columns(
        [files[i] for i in order], [0] * len(files),
        [counts[i] for i in order], min(_CYCLE_LENGTH, len(files)), start)
    if columns is None:  # The whole pass lies before `start`.
      return self.host_dataset(split, process_index, process_count).take(0)
    return self._interleave(*columns, len(files), by_record, process_index,
                            process_count)

  def _interleave(self, names, offsets, takes, num_files, by_record,
                  process_index, process_count):
    """The process's records of each file from its offset (records of its
    shard), `take` of them (-1: all), interleaved as every pass is: over
    `num_files` files (the cycle length), whatever `names` lists."""

    def read(name, offset, take):
      records = tf.data.TFRecordDataset(name, buffer_size=8 << 20)
      if by_record:  # Its records process_index, +process_count, ...
        records = records.skip(offset * process_count).shard(
            process_count, process_index)
      else:
        records = records.skip(offset)
      return records.take(take).map(lambda r: (name, r))

    ds = tf.data.Dataset.from_tensor_slices((names, offsets, takes))
    ds = ds.interleave(
        read, cycle_length=min(_CYCLE_LENGTH, num_files), block_length=1,
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.map(self._parse, num_parallel_calls=tf.data.AUTOTUNE)

  def largest_label(self):
    where = ('input.num_classes' if self._num_classes != self.spec.num_classes
             else f'the registry: {self.spec.num_classes} classes')
    return self._num_classes - 1, where

  def _parse(self, name, serialized):
    x = tf.io.parse_single_example(serialized, {
        self.image_key: tf.io.FixedLenFeature([], tf.string),
        self.label_key: tf.io.VarLenFeature(tf.int64)})
    labels = x[self.label_key].values
    # Labels are only known by reading: each is checked on its way through
    # (`explain_error` names the file). An empty or missing label list
    # (e.g. another label feature name) would fail as a bare slice error.
    has_label = tf.debugging.Assert(tf.size(labels) > 0,
                                    [_NO_LABEL, name], summarize=1)
    if not self.multi_label:
      labels = labels[:1]  # The first label is the class.
    with tf.control_dependencies([has_label]):
      labels = tf.identity(labels)
    inside = (labels >= 0) & (labels < self._num_classes)
    outside = tf.boolean_mask(labels, ~inside)
    check = tf.debugging.Assert(
        tf.reduce_all(inside),
        [_LABEL_OUT_OF_RANGE, name, tf.concat([outside, [-1]], 0)[0]],
        summarize=3)
    with tf.control_dependencies([check]):
      labels = tf.identity(labels)
    if not self.multi_label:
      return {'image': x[self.image_key], 'label': labels[0]}
    # Multi-hot: every label of the image (duplicates count once).
    multi_hot = tf.reduce_max(
        tf.one_hot(labels, self._num_classes, dtype=tf.float32), axis=0)
    return {'image': x[self.image_key], 'label': multi_hot}

  def explain_error(self, error, split, process_index, process_count):
    message = str(getattr(error, 'message', error))
    match = re.search(_NO_LABEL + r'\]\s*\[(.*?)\]', message)
    if match is not None:
      return self._no_label_error(match.group(1))
    match = re.search(_LABEL_OUT_OF_RANGE + r'\]\s*\[(.*?)\]\s*\[(-?\d+)\]',
                      message)
    if match is None:
      return None
    return LabelRangeError(
        f'dataset {self.spec.name!r}: TFRecord file {match.group(1)} has '
        f'label {match.group(2)}, outside [0, num_classes={self._num_classes})'
        f' ({self.largest_label()[1]}): set input.num_classes (and '
        '--config.num_classes, or leave it None) to the class count of the '
        'files, or fix the labels of that file')

  def _no_label_error(self, path: str) -> DataError:
    """The error for a record of `path` without a label in `label_key`."""
    try:  # The int64 features of the file's first record, to choose from.
      first = next(iter(tf.data.TFRecordDataset(path).take(1)))
      feature = tf.train.Example.FromString(first.numpy()).features.feature
      ints = sorted(k for k, f in feature.items() if f.int64_list.value)
    except (tf.errors.OpError, ValueError, StopIteration):
      ints = None
    problem = (f'TFRecord file {path} has a record without a label: its '
               f'int64 list {self.label_key!r} (input.label_key) is empty or '
               'missing')
    if ints is not None and self.label_key in ints:
      fix = ('other records of the file have it: write a label (the first '
             'value of the list is the class) into every record, or leave '
             'the unlabelled ones out of the files')
    else:
      fix = ('set input.label_key to the feature that holds the labels (the '
             'first value of the list is the class); the first record of '
             f'the file has non-empty int64 features {ints}')
    return DataError(f'dataset {self.spec.name!r}: {problem}: {fix}')
