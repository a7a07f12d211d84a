"""TFRecord files of encoded images and labels (JFT-style, or ImageNet-21k).

Each record is a `tf.train.Example` with the encoded image bytes and an
int64 label list (the first label is the class); the feature names default
to `image/encoded` and `image/class/label` and can be set with
`input.image_key` / `input.label_key`. A record without the image feature,
with an empty or missing label list, or with a label outside
[0, num_classes), stops the pipeline with an error naming its file
(`explain_error`); so does an image that cannot be decoded (the error names
the file and the record), unless `input.skip_bad_images` skips it.

Files of split SPLIT, sorted: `DATA_DIR/SPLIT`, `DATA_DIR/SPLIT-<digit>...`
(`train-00000-of-01024`), `DATA_DIR/SPLIT.tfrecord[s]` alone or followed by
`-...` / `@...` (`train.tfrecord-00000-of-00008`), or every file of a folder
`DATA_DIR/SPLIT/` except hidden and `_`-prefixed ones (`_SUCCESS`). Other
names are not read: `train_dev-*`, `train-dev-*` or `train.bak` are not
`train` files. Files are compressed where their names end in `.gz` / `.gzip`
(GZIP) or `.zlib` / `.deflate` (ZLIB), e.g. `train-00000-of-00008.gz` or
`train.tfrecord.gz`; others are read uncompressed.

Skipping undecodable images (`input.skip_bad_images=True`): in the train
split only. Before its first batch a process decodes every image of its
files once (logged; the bad record numbers are cached beside the counts
below, so later runs do not decode again), and its pass leaves those
records out: counts, positions and resumes are over the records kept.
Evaluation never skips (its counts stay exact): a bad image of an eval split
stops it with the error naming the record, whatever the setting (unless
the eval split is the train split itself).

Sharding: with at least as many files as processes, process i of n reads
files i, i+n, i+2n, ...; training then needs a file count divisible by n
(`check_train_split` says how to re-shard otherwise), evaluation does not
(it pads). With fewer files than processes every process reads every file
and keeps every n-th record of each. Each process cycles through its own
files: shares of very different sizes (by bytes, the largest over 1.1x the
smallest) oversample the smaller ones, and training logs a warning.

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

import numpy as np
import tensorflow as tf
from absl import logging

from vit_jax.data import shuffle
from vit_jax.data.errors import (BadImageError, DataError,
                                 DatasetNotPreparedError, LabelRangeError,
                                 UnknownSplitError)
from vit_jax.data.folder_source import is_decode_error
from vit_jax.data.registry import DatasetSpec
from vit_jax.data.sources import Source, register

_CYCLE_LENGTH = 16
# Processes' train shares (bytes) differing by more: logged as uneven.
_UNEVEN = 1.1
_STAT_THREADS = 32
IMAGE_KEY, LABEL_KEY = 'image/encoded', 'image/class/label'
COUNTS_DIR = '.record_counts'
_LABEL_OUT_OF_RANGE = 'TFRecord label out of range'
_NO_LABEL = 'TFRecord record without a label'
_NO_IMAGE = 'TFRecord record without an image'
_FEATURE_NOUN = {'bytes_list': 'bytes feature', 'int64_list': 'int64 list'}
_PATH = r'\]\s*\[(.*?)\](?=\s*(?:$|\n|\[\[))'  # `] [path]` of an Assert.
# What may follow SPLIT in a file name: `-` and a digit (shard numbers), or
# `.tfrecord` / `.tfrecords` alone or followed by `-...` or `@...`; then a
# compression suffix (`COMPRESSION`).
_SUFFIX = r'(-\d.*|\.tfrecords?([-@].*)?)?'
# File name endings of compressed files -> TFRecordDataset compression_type.
COMPRESSION = {'.gz': 'GZIP', '.gzip': 'GZIP', '.zlib': 'ZLIB',
               '.deflate': 'ZLIB'}


def compression_type(path: str) -> str:
  """'GZIP', 'ZLIB' or '' (uncompressed), from the file name's ending."""
  return COMPRESSION.get(os.path.splitext(path)[1].lower(), '')


def _is_split_file(name: str, split: str) -> bool:
  for ending in COMPRESSION:  # `train-00000.gz` is a `train-00000` file.
    if name.lower().endswith(ending):
      name = name[:-len(ending)]
      break
  return re.fullmatch(re.escape(split) + _SUFFIX, name) is not None


def _files_in(folder: str, keep) -> List[str]:
  """The files of `folder` whose names `keep` accepts, sorted: listed, not
  globbed (a folder name may hold glob characters, `runs/r[1]`). Folders
  are left out: gs:// lists them with a trailing / (no request per file),
  other file systems are asked."""
  names = [n for n in tf.io.gfile.listdir(folder)
           if not n.endswith('/') and keep(n)]
  ask = not folder.startswith('gs://')
  return sorted(os.path.join(folder, n) for n in names
                if not (ask and tf.io.gfile.isdir(os.path.join(folder, n))))


def split_files(data_dir: str, split: str) -> List[str]:
  """The files of `split` under `data_dir`, sorted (module docstring)."""
  folder = os.path.join(data_dir, split)
  if tf.io.gfile.isdir(folder):
    return _files_in(folder, lambda n: not n.startswith(('.', '_')))
  return _files_in(data_dir, lambda n: _is_split_file(n, split))


def has_records(data_dir: Optional[str]) -> bool:
  """Whether `data_dir` holds TFRecord files of a train split."""
  return bool(data_dir) and tf.io.gfile.isdir(data_dir) and bool(
      split_files(data_dir, 'train'))


# Record counts, and the records whose image cannot be decoded.

_COUNTS: Dict[str, int] = {}  # path -> records, for this process's life.
# (path, image_key) -> numbers of the records whose image cannot be decoded.
_UNDECODABLE: Dict[Tuple[str, str], List[int]] = {}
_UNDECODABLE_SUFFIX = '.undecodable.json'


def _cache_file(data_dir: str, path: str, suffix: str = '.json') -> str:
  root = data_dir.rstrip('/') + '/'
  name = path[len(root):] if path.startswith(root) else path
  return os.path.join(data_dir, COUNTS_DIR,
                      name.replace('/', '%2F') + suffix)


def _read_entry(data_dir: str, path: str,
                suffix: str = '.json') -> Tuple[int, Optional[dict]]:
  """(file size, the cached entry of `path` or None where there is none or
  the file changed since: its size differs)."""
  size = tf.io.gfile.stat(path).length
  try:
    with tf.io.gfile.GFile(_cache_file(data_dir, path, suffix)) as f:
      entry = json.load(f)
  except (tf.errors.OpError, OSError, ValueError):
    return size, None
  return size, (entry if entry.get('bytes') == size else None)


def _read_cached(data_dir: str, path: str) -> Tuple[int, Optional[int]]:
  """(file size, cached record count or None)."""
  size, entry = _read_entry(data_dir, path)
  return size, None if entry is None else int(entry['records'])


def _write_entry(data_dir: str, path: str, entry: dict,
                 suffix: str = '.json') -> bool:
  """Caches an entry (written then renamed); False where that fails."""
  target = _cache_file(data_dir, path, suffix)
  temp = f'{target}.tmp-{uuid.uuid4().hex}'
  try:
    tf.io.gfile.makedirs(os.path.dirname(target))
    with tf.io.gfile.GFile(temp, 'w') as f:
      json.dump(entry, f)
    tf.io.gfile.rename(temp, target, overwrite=True)
  except (tf.errors.OpError, OSError):
    return False
  return True


def _write_cached(data_dir: str, path: str, size: int, records: int) -> bool:
  return _write_entry(data_dir, path, {'records': records, 'bytes': size})


def _records(path, compression=None) -> tf.data.Dataset:
  """The records of one file: `path` and its `compression_type` may be
  string tensors (None: from the name of `path`, a Python string)."""
  if compression is None:
    compression = compression_type(path)
  return tf.data.TFRecordDataset(path, compression_type=compression,
                                 buffer_size=8 << 20)


def _files_dataset(paths: Sequence[str]) -> tf.data.Dataset:
  """(file number, path, compression type) of each of `paths`."""
  return tf.data.Dataset.from_tensor_slices(
      (tf.range(len(paths), dtype=tf.int64), tf.constant(paths, tf.string),
       tf.constant([compression_type(p) for p in paths], tf.string)))


def _count(records: tf.data.Dataset) -> tf.Tensor:
  return records.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1)


def _count_files(paths: Sequence[str]) -> List[int]:
  """Records in each file, files read in parallel, records not parsed."""
  ds = _files_dataset(list(paths)).map(
      lambda _, path, compression: _count(_records(path, compression)),
      num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  try:
    return [int(n) for n in ds.as_numpy_iterator()]
  except tf.errors.DataLossError:
    pass  # Explained below, file by file (outside the except: no chain).
  for path in paths:
    try:
      _count(_records(path))
    except tf.errors.DataLossError as e:
      raise _unreadable_file_error(path, e) from None
  raise AssertionError(f'counting {len(paths)} TFRecord files failed, each '
                       'alone did not')


def _unreadable_file_error(path: str, error: tf.errors.OpError) -> DataError:
  """What to do about a file that TensorFlow cannot read as TFRecords."""
  said = str(getattr(error, 'message', error)).strip().splitlines()[0]
  compression = compression_type(path)
  with tf.io.gfile.GFile(path, 'rb') as f:
    gzipped = f.read(2) == b'\x1f\x8b'
  endings = ', '.join(COMPRESSION)
  if gzipped and not compression:
    fix = (f'it starts like a GZIP file: compressed files must end in '
           f'{endings} to be read compressed; rename it (e.g. '
           f'{os.path.basename(path)}.gz)')
  elif compression:
    fix = (f'its name ends like a {compression}-compressed file but it '
           f'does not decompress as one: rename it to the compression it '
           f'has (uncompressed: no {endings} ending), or rewrite it')
  else:
    fix = ('read uncompressed (its name has none of the compressed endings '
           f'{endings}), it is cut short or not a TFRecord file: rewrite it, '
           "or move it out of the split's files")
  return DataError(f'cannot read TFRecord file {path} ({said}): {fix}')


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


def _scan_files(paths: Sequence[str], counts: Sequence[int],
                image_key: str) -> List[List[int]]:
  """For each file, the numbers of its records whose image TensorFlow
  cannot decode (each image decoded once, files in parallel). A record
  without the image feature is not counted: it is a wrong
  `input.image_key` or a broken writer, which the pipeline names."""
  def scan(index, path, compression):
    def decode(number, record):
      image = tf.io.parse_single_example(record, {
          image_key: tf.io.VarLenFeature(tf.string)})[image_key].values
      decoded = tf.cond(
          tf.size(image) == 1,
          lambda: tf.size(tf.io.decode_image(image[0], channels=3,
                                             expand_animations=False)),
          lambda: tf.constant(1))
      return index, number, decoded
    # Only the decoding map's failures are dropped: the records are read
    # (and counted) without errors before.
    return _records(path, compression).enumerate().map(
        decode, num_parallel_calls=tf.data.AUTOTUNE).ignore_errors()

  ds = _files_dataset(list(paths)).interleave(
      scan, cycle_length=max(1, min(_CYCLE_LENGTH, len(paths))),
      num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
  decoded = [np.zeros(n, bool) for n in counts]
  for files, numbers, _ in ds.batch(4096).as_numpy_iterator():
    for f in np.unique(files):
      decoded[f][numbers[files == f]] = True
  return [np.flatnonzero(~d).tolist() for d in decoded]


def undecodable_records(data_dir: str, paths: Sequence[str],
                        image_key: str) -> List[List[int]]:
  """For each of `paths`, the numbers (from 0) of its records whose image
  (feature `image_key`) cannot be decoded. Each file is decoded once: the
  numbers are cached beside its count (`DATA_DIR/.record_counts/`)."""
  missing = [p for p in dict.fromkeys(paths)
             if (p, image_key) not in _UNDECODABLE]
  if missing:
    counts = record_counts(data_dir, missing)
    to_scan = []
    for path, count in zip(missing, counts):
      size, entry = _read_entry(data_dir, path, _UNDECODABLE_SUFFIX)
      if entry is not None and entry.get('image_key') == image_key:
        _UNDECODABLE[(path, image_key)] = list(entry['records'])
      else:
        to_scan.append((path, count, size))
    if to_scan:
      logging.info('decoding the images of %d TFRecord files in %s once, to '
                   'find those that cannot be decoded', len(to_scan),
                   data_dir)
      found = _scan_files([p for p, _, _ in to_scan],
                          [n for _, n, _ in to_scan], image_key)
      for (path, _, size), numbers in zip(to_scan, found):
        _write_entry(data_dir, path, {'records': numbers, 'bytes': size,
                                      'image_key': image_key},
                     _UNDECODABLE_SUFFIX)
        _UNDECODABLE[(path, image_key)] = numbers
  return [_UNDECODABLE[(p, image_key)] for p in paths]


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
    # Undecodable images are skipped in the train split only (the split
    # expression, as `settings.read` resolves it): evaluation counts stay
    # exact. Settings refuse the option for sources without this attribute.
    self.skip_bad_images = bool(input_config.get('skip_bad_images', False))
    self._train_split = input_config.get('train_split')
    self._logged = set()

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
          f'{split}.tfrecord... or {split}/*, compressed ones ending in '
          f'{", ".join(COMPRESSION)}; splits found: {self.split_names()}). '
          'TFRecord splits cannot be sliced; write the files of each split '
          'separately.')
    return files

  def _host_files(self, split, process_index, process_count):
    """(files, record-level sharding?) read by the process."""
    files = self.files(split)
    if len(files) >= process_count:
      return files[process_index::process_count], False
    return files, True

  def reads_in_one_order(self, split, process_index, process_count) -> bool:
    return len(self._host_files(split, process_index, process_count)[0]) <= 1

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
    if process_count > 1 and n >= process_count:
      self._warn_uneven(split, process_count)

  def _warn_uneven(self, split: str, process_count: int) -> None:
    """Logs (once) where the processes' files differ much in size.

    Each process cycles through its own files: a process whose files hold
    fewer examples starts its next epoch sooner and sees each of them more
    often. Compared by bytes (one stat per file, no reading): the record
    counts of the other processes' files are not counted here.
    """
    key = ('uneven', split, process_count)
    if key in self._logged:
      return
    self._logged.add(key)
    files = self.files(split)
    with concurrent.futures.ThreadPoolExecutor(_STAT_THREADS) as pool:
      sizes = list(pool.map(lambda p: tf.io.gfile.stat(p).length, files))
    shares = [sum(sizes[p::process_count]) for p in range(process_count)]
    large, small = max(shares), min(shares)
    if not small or large <= _UNEVEN * small:
      return  # An empty share: its process refuses to train (no examples).
    logging.warning(
        '%s: the %d TFRecord files of split %r give the %d processes '
        'shares of very different sizes (process %d: %d bytes, %.1fx those '
        'of process %d): each process cycles through its own files, so the '
        'examples of a smaller share are seen more often (up to %.1fx as '
        'often as those of the largest: its epochs end sooner). Re-shard '
        'the split into a multiple of %d files of similar size.',
        self.spec.name, len(files), split, process_count,
        shares.index(large), large, large / small, shares.index(small),
        large / small, process_count)

  def _skipped(self, split, files, process_index,
               process_count) -> Optional[List[List[int]]]:
    """Per file, the records the pass leaves out (their images cannot be
    decoded); None where nothing is skipped (not the train split, or
    `skip_bad_images` off)."""
    if not (self.skip_bad_images and split == self._train_split):
      return None
    bad = undecodable_records(self.data_dir, files, self.image_key)
    key = (split, process_index, process_count)
    if key not in self._logged:
      self._logged.add(key)
      examples = [f'{path} record {n}' for path, numbers in zip(files, bad)
                  for n in numbers[:3]][:5]
      logging.log(
          logging.WARNING if examples else logging.INFO,
          'skip_bad_images: skipping %d records of %d TFRecord files of %s '
          'split %r (process %d/%d) whose image cannot be decoded%s',
          sum(map(len, bad)), len(files), self.data_dir, split,
          process_index, process_count,
          f', e.g. {examples}' if examples else '')
    return bad

  def _counts(self, split, process_index, process_count, *,
              skipping: bool = True) -> Tuple[List[str], List[int], bool]:
    """(files, the records the process reads of each, record sharding?)."""
    files, by_record = self._host_files(split, process_index, process_count)
    counts = record_counts(self.data_dir, files)
    bad = (self._skipped(split, files, process_index, process_count)
           if skipping else None)
    if bad is not None:
      counts = [c - len(b) for c, b in zip(counts, bad)]
    if by_record:
      counts = [_records_of_shard(c, process_index, process_count)
                for c in counts]
    return files, counts, by_record

  def host_size(self, split, process_index, process_count) -> None:
    return None  # Unknown without reading the files: see `count_host`.

  def count_host(self, split, process_index, process_count) -> int:
    return sum(self._counts(split, process_index, process_count)[1])

  def size_bound(self, split, process_index, process_count) -> int:
    # Skipped records included: no decoding of other processes' files.
    return sum(self._counts(split, process_index, process_count,
                            skipping=False)[1])

  def split_size(self, split: str) -> Optional[int]:
    return None

  def _columns(self, split, names, offsets, takes, process_index,
               process_count, *, skipping: bool = True
               ) -> Dict[str, tf.Tensor]:
    """The per-file inputs of `_interleave`: name, offset, take (-1: all),
    compression type and, where records are skipped, their numbers."""
    columns = {'name': tf.constant(names, tf.string),
               'offset': tf.cast(offsets, tf.int64),
               'take': tf.cast(takes, tf.int64),
               'compression': tf.constant(
                   [compression_type(n) for n in names], tf.string)}
    bad = (self._skipped(split, names, process_index, process_count)
           if skipping else None)
    if bad is not None:  # Sorted, padded with a number no record has.
      width = max([1] + [len(b) for b in bad])
      columns['skip'] = tf.constant(
          [b + [np.iinfo(np.int64).max] * (width - len(b)) for b in bad],
          tf.int64)
    return columns

  def element_spec(self, split: str):
    """Decodes nothing: with `skip_bad_images`, the structure needs no scan
    for undecodable records (which would decode every process's files on
    every process, before training)."""
    files, by_record = self._host_files(split, 0, 1)
    n = len(files)
    columns = self._columns(split, files, [0] * n, [-1] * n, 0, 1,
                            skipping=False)
    return self._interleave(columns, n, by_record, 0, 1).element_spec

  def host_dataset(self, split, process_index, process_count, *,
                   order_key=None) -> tf.data.Dataset:
    files, by_record = self._host_files(split, process_index, process_count)
    n = len(files)
    columns = self._columns(split, files, [0] * n, [-1] * n, process_index,
                            process_count)
    if order_key is not None and n > 1:
      order = shuffle.permutation(n, order_key)
      columns = {k: tf.gather(v, order) for k, v in columns.items()}
    return self._interleave(columns, n, by_record, process_index,
                            process_count)

  def host_dataset_from(self, split, process_index, process_count, start, *,
                        order_key=None) -> tf.data.Dataset:
    """Skips the files read before `start` unopened (counts are cached)."""
    files, counts, by_record = self._counts(split, process_index,
                                            process_count)
    order = list(range(len(files)))
    if order_key is not None and len(files) > 1:
      order = [int(i) for i in shuffle.permutation(len(files), order_key)]
    resumed = resume_columns(
        [files[i] for i in order], [0] * len(files),
        [counts[i] for i in order], min(_CYCLE_LENGTH, len(files)), start)
    if resumed is None:  # The whole pass lies before `start`.
      return self.host_dataset(split, process_index, process_count).take(0)
    names = [n.decode() for n in resumed[0].numpy()]
    columns = self._columns(split, names, resumed[1], resumed[2],
                            process_index, process_count)
    return self._interleave(columns, len(files), by_record, process_index,
                            process_count)

  def _interleave(self, columns, num_files, by_record, process_index,
                  process_count):
    """The process's records of each file of `columns` from its offset
    (records of its shard, skipped ones left out first), `take` of them,
    interleaved as every pass is: over `num_files` files (the cycle
    length), whatever `columns` lists."""

    def read(file):
      name = file['name']
      records = _records(name, file['compression'])
      if 'skip' in file:  # Its undecodable records, by number.
        skip = file['skip']

        def kept(number, _):
          at = tf.minimum(tf.searchsorted(skip, [number])[0],
                          tf.size(skip) - 1)
          return skip[at] != number

        records = records.enumerate().filter(kept).map(lambda _, r: r)
      if by_record:  # Its records process_index, +process_count, ...
        records = records.skip(file['offset'] * process_count).shard(
            process_count, process_index)
      else:
        records = records.skip(file['offset'])
      return records.take(file['take']).map(lambda r: (name, r))

    ds = tf.data.Dataset.from_tensor_slices(columns)
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
        self.image_key: tf.io.VarLenFeature(tf.string),
        self.label_key: tf.io.VarLenFeature(tf.int64)})
    # A missing image (e.g. another feature name) would fail as a bare
    # "Feature ... is required": checked here, so that the error names the
    # file (`explain_error`).
    images = x[self.image_key].values
    has_image = tf.debugging.Assert(tf.size(images) == 1,
                                    [_NO_IMAGE, name], summarize=1)
    with tf.control_dependencies([has_image]):
      image = tf.identity(images[0])
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
      return {'image': image, 'label': labels[0]}
    # Multi-hot: every label of the image (duplicates count once).
    multi_hot = tf.reduce_max(
        tf.one_hot(labels, self._num_classes, dtype=tf.float32), axis=0)
    return {'image': image, 'label': multi_hot}

  def explain_error(self, error, split, process_index, process_count):
    if is_decode_error(error):
      return self._bad_image_error(split, process_index, process_count)
    message = str(getattr(error, 'message', error))
    # `[tag] [path]` then the line's end or `[[node ...`: a path may hold
    # brackets (`runs/r[1]/train-00000`).
    match = re.search(_NO_IMAGE + _PATH, message)
    if match is not None:
      return self._no_image_error(match.group(1))
    match = re.search(_NO_LABEL + _PATH, message)
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

  def _bad_image_error(self, split, process_index,
                       process_count) -> Optional[BadImageError]:
    """The error for an image that cannot be decoded: the first of the
    process's files (in sorted order) holding such records, and which.
    Decodes the files in turn until one has; None if none has (then
    another decoder than TensorFlow's `decode_image` failed: a crop)."""
    files, _ = self._host_files(split, process_index, process_count)
    if self._skipped(split, files, process_index, process_count) is not None:
      return None  # Skipped already: the pipeline's decoder differs.
    for start in range(0, len(files), _CYCLE_LENGTH):
      chunk = files[start:start + _CYCLE_LENGTH]
      bad = undecodable_records(self.data_dir, chunk, self.image_key)
      found = [(path, numbers) for path, numbers in zip(chunk, bad)
               if numbers]
      if found:
        break
    else:
      return None
    path, numbers = found[0]
    shown = ', '.join(map(str, numbers[:5])) + (
        ' ...' if len(numbers) > 5 else '')
    problem = (f'dataset {self.spec.name!r}: cannot decode the image '
               f'({self.image_key!r}) of {len(numbers)} record(s) of '
               f'TFRecord file {path}: record {shown} (counted from 0)')
    if split == self._train_split:
      fix = ('Rewrite the file without them (or with readable images), or '
             'set input.skip_bad_images=True to skip the records of the '
             'train split whose image cannot be decoded (each process '
             'decodes its files once to find them; evaluation never skips). '
             'Skipping changes what is read: a training run that already '
             'saved a checkpoint cannot resume with it; start it afresh '
             'from its weights (a new --workdir with --config.init=<its '
             'workdir>).')
    else:
      fix = (f'Evaluation reads every record of split {split!r}, so that '
             'its counts stay exact (input.skip_bad_images skips in the '
             'train split only): rewrite the file without them, or with '
             'readable images.')
    return BadImageError(f'{problem}. {fix}', [path])

  def _first_features(self, path: str, kind: str) -> Optional[List[str]]:
    """The names of the first record's features of `path` holding values
    of `kind` ('bytes_list', 'int64_list'); None if unreadable."""
    try:
      first = next(iter(_records(path).take(1)))
      feature = tf.train.Example.FromString(first.numpy()).features.feature
    except (tf.errors.OpError, ValueError, StopIteration):
      return None
    return sorted(k for k, f in feature.items() if getattr(f, kind).value)

  def _no_image_error(self, path: str) -> DataError:
    """The error for a record of `path` without one image in `image_key`."""
    return self._missing_feature_error(
        path, 'an image', 'image_key', 'bytes_list',
        'is missing, empty or holds several values',
        present='write one encoded image into every record, or leave the '
        'others out of the files',
        absent='the encoded image')

  def _no_label_error(self, path: str) -> DataError:
    """The error for a record of `path` without a label in `label_key`."""
    return self._missing_feature_error(
        path, 'a label', 'label_key', 'int64_list', 'is empty or missing',
        present='write a label (the first value of the list is the class) '
        'into every record, or leave the unlabelled ones out of the files',
        absent='the labels (the first value of the list is the class)')

  def _missing_feature_error(self, path: str, what: str, option: str,
                             kind: str, how: str, *, present: str,
                             absent: str) -> DataError:
    """A record of `path` lacks its `what` (feature `input.<option>`, a
    `kind`): the fix depends on whether the file's first record has it."""
    key = getattr(self, option)
    names = self._first_features(path, kind)
    problem = (f'TFRecord file {path} has a record without {what}: its '
               f'{_FEATURE_NOUN[kind]} {key!r} (input.{option}) {how}')
    if names is not None and key in names:
      fix = f'other records of the file have it: {present}'
    else:
      fix = (f'set input.{option} to the feature that holds {absent}; the '
             f'first record of the file has non-empty '
             f'{kind.split("_")[0]} features {names}')
    return DataError(f'dataset {self.spec.name!r}: {problem}: {fix}')
