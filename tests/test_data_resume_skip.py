"""Resuming mid-epoch skips whole TFRecord files unread, exactly.

A resume at example i of an epoch starts the source at the block holding
i (`Source.host_dataset_from`). The TFRecord sources work out where their
file interleave stands after that many records
(`tfrecord_source.interleave_resume`) and read on from there. These tests
hold the result to today's stream, `host_dataset(...).skip(n)`, element for
element: first the arithmetic against tf.data's own interleave, then both
sources on tiny TFRecord files, then a trainer resume with the finished
files corrupted (a resume that read them would fail).
"""

import json
import random
from types import SimpleNamespace

import ml_collections
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from vit_jax.data import pipeline, settings, shuffle, tfds_source
from vit_jax.data import tfrecord_source
from conftest import assert_batches_equal, take

KEY = tf.constant([7, 8], tf.int64)


def _interleave(files, offsets, lengths, cycle):
  """tf.data's interleave, as the sources call it, of files[j] from
  offsets[j] on, file i holding elements (i, 0) ... (i, lengths[i] - 1)."""
  ds = tf.data.Dataset.from_tensor_slices(
      (files, offsets, tf.gather(tf.constant(lengths, tf.int64), files)))
  return ds.interleave(
      lambda f, o, n: tf.data.Dataset.range(o, n).map(lambda r: (f, r)),
      cycle_length=cycle, block_length=1,
      num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _continuations(resumes, lengths, cycle):
  """The interleave from each of `resumes` (lists of (file, offset)), one
  after another in one pipeline (one per start would be slow)."""
  width = max(1, max(len(r) for r in resumes))
  pad = lambda r, j: [x[j] for x in r] + [0] * (width - len(r))
  starts = tf.data.Dataset.from_tensor_slices((
      tf.constant([pad(r, 0) for r in resumes], tf.int64),
      tf.constant([pad(r, 1) for r in resumes], tf.int64),
      tf.constant([len(r) for r in resumes], tf.int64)))
  ds = starts.flat_map(lambda f, o, n: _interleave(f[:n], o[:n], lengths,
                                                   cycle))
  return [(int(f), int(r)) for f, r in ds.as_numpy_iterator()]


def _layouts(count, seed):
  """(lengths, cycle length): files of 0, 1 or a few elements."""
  rng = random.Random(seed)
  for _ in range(count):
    lengths = [rng.choice([0, 0, 1, 1, 2, 3, 5, 8])
               for _ in range(rng.randint(1, 7))]
    yield lengths, rng.randint(1, 4)


def test_interleave_resume_continues_tf_datas_interleave_exactly():
  # Every start point (0, the end, just before and after each file ends)
  # of many layouts: a fresh interleave from the computed state gives the
  # rest of the real one.
  layouts = [([3, 0, 1, 5, 2], 2), ([0, 0, 4], 3), ([1], 1), ([0], 2),
             ([2, 2, 2, 2, 2], 4), ([8, 1, 0, 1, 8], 3),
             *_layouts(24, seed=0)]
  for lengths, cycle in layouts:
    files = tf.range(len(lengths), dtype=tf.int64)
    full = [(int(f), int(r)) for f, r in _interleave(
        files, tf.zeros_like(files), lengths, cycle).as_numpy_iterator()]
    assert len(full) == sum(lengths)
    resumes = [tfrecord_source.interleave_resume(lengths, cycle, start)
               for start in range(len(full) + 1)]
    expected = [x for start in range(len(full) + 1) for x in full[start:]]
    assert _continuations(resumes, lengths, cycle) == expected, (
        lengths, cycle)


def test_interleave_resume_counts_rounds_not_records():
  # 10,000 files of 1,000 records, 16 slots: files open 16 at a time.
  # 5,000,123 = 312 groups of 16 files + 16 * 507 + 11 records.
  resume = tfrecord_source.interleave_resume([1000] * 10_000, 16, 5_000_123)
  group = list(range(4992, 5008))
  assert resume[:16] == [(f, 508 if i < 11 else 507)
                         for i, f in enumerate(group)][11:] + [
                             (f, 508) for f in group[:11]]
  assert resume[16:] == [(f, 0) for f in range(5008, 10_000)]
  with pytest.raises(ValueError, match='cannot start at element 11 of 10'):
    tfrecord_source.interleave_resume([4, 6], 2, 11)


def _write(path, ids):
  """A TFRecord file of one 4x4 PNG image per id, labelled with the id."""
  with tf.io.TFRecordWriter(path) as writer:
    for i in ids:
      image = tf.fill([4, 4, 3], tf.constant(i % 256, tf.uint8))
      writer.write(tf.train.Example(features=tf.train.Features(feature={
          'image/encoded': tf.train.Feature(bytes_list=tf.train.BytesList(
              value=[tf.io.encode_png(image).numpy()])),
          'image/class/label': tf.train.Feature(
              int64_list=tf.train.Int64List(value=[i])),
      })).SerializeToString())


def _write_files(directory, lengths):
  """train-* files of `lengths` records, ids 0, 1, ... in file order."""
  start = 0
  for i, n in enumerate(lengths):
    _write(f'{directory}/train-{i:05d}-of-{len(lengths):05d}',
           range(start, start + n))
    start += n
  return start


def _config(directory, num_classes, **kw):
  return ml_collections.ConfigDict({
      'data': 'tfrecord', 'data_dir': str(directory),
      'num_classes': num_classes, 'batch_size': 4, 'image_size': 8,
      'pp_train': 'inception', 'shuffle_buffer': 4, **kw})


def _labels(ds):
  return [int(x['label']) for x in ds.as_numpy_iterator()]


@pytest.mark.parametrize('lengths,cycle,process_count', [
    ([3, 0, 1, 5, 2, 1, 4], 3, 1),   # Empty and one-record files.
    ([6, 2, 0, 7, 3, 1], 2, 2),      # Every other file per process.
    ([5, 9], 4, 3),                  # Fewer files: every 3rd record.
])
def test_tfrecord_source_from_equals_reading_and_skipping(
    tmp_path, monkeypatch, lengths, cycle, process_count):
  monkeypatch.setattr(tfrecord_source, '_CYCLE_LENGTH', cycle)
  total = _write_files(tmp_path, lengths)
  source = settings.read(_config(tmp_path, total)).source
  for p in range(process_count):
    for key in (None, KEY):
      full = _labels(source.host_dataset('train', p, process_count,
                                         order_key=key))
      assert len(full) == source.count_host('train', p, process_count)
      # Every other start point (each file length is met at odd and even
      # points across the layouts), and the end.
      starts = ({*range(p % 2, len(full), 2), len(full)} if key is not None
                else {0, 1, len(full) // 2, len(full)})
      for start in starts:
        ds = source.host_dataset_from('train', p, process_count, start,
                                      order_key=key)
        assert _labels(ds) == full[start:], (p, key, start)


def test_tfds_source_from_equals_reading_and_skipping(tmp_path,
                                                      monkeypatch):
  # tfds file instructions: files read from `skip`, `take` records each.
  monkeypatch.setattr(tfds_source, '_CYCLE_LENGTH', 3)
  lengths = [4, 1, 6, 3, 5]
  _write_files(tmp_path, lengths)
  files = sorted(str(f) for f in tmp_path.glob('train-*'))
  instructions = [tfds.core.utils.shard_utils.FileInstruction(
      filename=f, skip=skip, take=take, examples_in_shard=n)
      for f, n, skip, take in zip(files, lengths, [1, 0, 2, 0, 0],
                                  [3, 1, 0, 3, 5])]
  source = object.__new__(tfds_source.TfdsSource)
  source.builder = SimpleNamespace(info=SimpleNamespace(
      file_format=tfds.core.FileFormat.TFRECORD))
  source._shard = lambda *_: SimpleNamespace(file_instructions=instructions)
  source._parse = lambda record: tf.io.parse_single_example(record, {
      'image/class/label': tf.io.FixedLenFeature([], tf.int64)})[
          'image/class/label']
  for key in (None, KEY):
    full = [int(x) for x in source.host_dataset(
        'train', 0, 1, order_key=key).as_numpy_iterator()]
    assert len(full) == 12
    for start in range(len(full) + 1):
      got = [int(x) for x in source.host_dataset_from(
          'train', 0, 1, start, order_key=key).as_numpy_iterator()]
      assert got == full[start:], (key, start)


def test_block_shuffle_from_a_function_equals_from_a_dataset():
  ds = tf.data.Dataset.range(23)
  for skip in (0, 4, 5, 13, 23):
    calls = []

    def from_element(start):
      calls.append(start)
      return ds.skip(start)

    expected = list(shuffle.block_shuffle(ds, 5, KEY, skip=skip)
                    .as_numpy_iterator())
    got = list(shuffle.block_shuffle(from_element, 5, KEY, skip=skip)
               .as_numpy_iterator())
    assert got == expected and calls == [skip // 5 * 5]


def test_resume_reads_no_file_finished_before_it(tmp_path, monkeypatch):
  # Files finished before the resume point's block are corrupted (same
  # size, so their cached record counts stay valid): the resumed run must
  # still give the uninterrupted run's batches, so it never read them.
  monkeypatch.setattr(tfrecord_source, '_CYCLE_LENGTH', 2)
  lengths = [9, 3, 7, 4, 6, 2, 8, 5]
  total = _write_files(tmp_path, lengths)  # 44 records: 11 batches.
  config = _config(tmp_path, total)
  run = pipeline.train_iterator(config, seed=3)
  take(run, 11)
  # Epoch 1 up to the block of example 28 (shuffle_buffer 4), in file order.
  labels_before = {int(l) for b in take(run, 7) for l in b['label']}
  state = json.loads(json.dumps(run.get_state()))
  assert (state['epoch'], state['index']) == (1, 28)
  expected = take(run, 3)  # The rest of epoch 1, within its last files.
  starts = np.cumsum([0] + lengths)
  finished = [i for i in range(len(lengths))
              if set(range(starts[i], starts[i + 1])) <= labels_before]
  assert len(finished) >= 3, finished
  files = sorted(tmp_path.glob('train-*'))
  for i in finished:
    files[i].write_bytes(b'\0' * files[i].stat().st_size)
  with pytest.raises(tf.errors.DataLossError):  # A reader would fail.
    _labels(tf.data.TFRecordDataset(str(files[finished[0]])))
  resumed = pipeline.train_iterator(config, seed=3)
  resumed.set_state(state)
  assert_batches_equal(take(resumed, 3), expected)


def test_resumes_across_an_epoch_are_exact(tmp_path, monkeypatch):
  # Process 0 of 2 reads files 0, 2, 4, 6 (5 + 9 + 6 + 7 = 27 records).
  monkeypatch.setattr(tfrecord_source, '_CYCLE_LENGTH', 3)
  total = _write_files(tmp_path, [5, 0, 9, 1, 6, 3, 7, 2])
  config = _config(tmp_path, total, batch_size=8, shuffle_buffer=3)
  run = pipeline.train_iterator(config, seed=2, process_count=2)
  stream = take(run, 9)  # Past the end of epoch 0 (27 examples).
  for batches in (2, 5, 8):
    epoch, index = divmod(batches * 4, 27)
    resumed = pipeline.train_iterator(config, seed=2, process_count=2)
    resumed.set_state({**run.get_state(), 'batches': batches,
                       'epoch': epoch, 'index': index})
    assert_batches_equal(take(resumed, 1), stream[batches:batches + 1])
