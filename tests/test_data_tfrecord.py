"""JFT-style TFRecords: file matching, sharding, resuming, exact-once eval.

`records`: 60 JPEG photos in 3 train files and 25 records in 2 validation
files. `shards`: 8 train files of 10, 11, ..., 17 small images (label =
record id), so that two processes' shards differ in size (52 and 56).
"""

import json
import logging
import os
import shutil

import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from vit_jax.data import input_bench, pipeline, tfrecord_source
from vit_jax.data.errors import BadImageError, DataError, UnknownSplitError
from conftest import assert_batches_equal, take


def _example(image, label):
  return tf.train.Example(features=tf.train.Features(feature={
      'image/encoded': tf.train.Feature(bytes_list=tf.train.BytesList(
          value=[tf.io.encode_png(image).numpy()])),
      'image/class/label': tf.train.Feature(
          int64_list=tf.train.Int64List(value=[label, 99])),
  })).SerializeToString()


def _write(path, labels, size=(40, 50)):
  """A TFRecord file of one image per label (pixels from the label)."""
  rng = np.random.RandomState(len(labels))
  with tf.io.TFRecordWriter(path) as writer:
    for label in labels:
      image = (rng.randint(0, 40, (*size, 3)) + label * 2).astype(np.uint8)
      writer.write(_example(image, label))


@pytest.fixture(scope='module')
def records(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp('jpeg_records'))
  input_bench.synthetic_jpeg_records(directory, num_images=60, num_files=3,
                               num_classes=60, size=(96, 128))
  # A validation split of 25 records in 2 files, labels 0..24.
  for i, labels in enumerate([range(0, 13), range(13, 25)]):
    _write(f'{directory}/validation-{i:05d}-of-00002', labels)
  return directory


SHARD_SIZES = [10 + i for i in range(8)]  # Process 0: 52, process 1: 56.


@pytest.fixture(scope='module')
def shards(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp('shards'))
  start = 0
  for i, n in enumerate(SHARD_SIZES):
    _write(f'{directory}/train-{i:05d}-of-00008', range(start, start + n),
           size=(12, 12))
    start += n
  return directory


def _file_of(label):
  return int(np.searchsorted(np.cumsum(SHARD_SIZES), label, side='right'))


def _shards_config(directory, **kw):
  base = dict(data='tfrecord', data_dir=directory, num_classes=108,
              batch_size=12, image_size=8, pp_train='inception',
              shuffle_buffer=10)
  return ml_collections.ConfigDict({**base, **kw})


def _config(directory, **kw):
  base = dict(data='tfrecord', data_dir=directory, num_classes=60,
              batch_size=8, eval_batch_size=8, image_size=32,
              num_train_examples=60)
  return ml_collections.ConfigDict({**base, **kw})


def test_split_files_match_only_the_split(tmp_path):
  names = ['train', 'train-00000-of-00002', 'train-00001-of-00002',
           'train.tfrecord', 'train.tfrecord-00000-of-00004', 'train_dev-00000',
           'train-dev-00000', 'train.bak', 'train.tfrecord.bak', 'trainval',
           'validation-00000']
  for name in names:
    (tmp_path / name).write_bytes(b'')
  found = [os.path.basename(f)
           for f in tfrecord_source.split_files(str(tmp_path), 'train')]
  assert found == sorted(names[:5])
  folder = tmp_path / 'test'
  folder.mkdir()
  for name in ['part-0', 'part-1', '_SUCCESS', '.part-2.crc']:
    (folder / name).write_bytes(b'')
  found = tfrecord_source.split_files(str(tmp_path), 'test')
  assert [os.path.basename(f) for f in found] == ['part-0', 'part-1']
  # Compressed files: the same names with a compression ending.
  for name in ['validation-00000.gz', 'validation.tfrecord.zlib',
               'validation.bak.gz', 'validation-dev-00000.gz']:
    (tmp_path / name).write_bytes(b'')
  found = tfrecord_source.split_files(str(tmp_path), 'validation')
  assert [os.path.basename(f) for f in found] == [
      'validation-00000', 'validation-00000.gz', 'validation.tfrecord.zlib']


def test_record_counts_are_cached_next_to_the_data(tmp_path, monkeypatch):
  _write(str(tmp_path / 'train-00000'), range(3), size=(4, 4))
  _write(str(tmp_path / 'train-00001'), range(5), size=(4, 4))
  assert tfrecord_source.count_records(str(tmp_path), 'train') == 8
  cache = tmp_path / tfrecord_source.COUNTS_DIR
  assert sorted(os.listdir(cache)) == ['train-00000.json', 'train-00001.json']
  monkeypatch.setattr(tfrecord_source, '_COUNTS', {})

  def fail(paths):
    raise AssertionError(f'counted {paths} again')

  with monkeypatch.context() as m:
    m.setattr(tfrecord_source, '_count_files', fail)
    assert tfrecord_source.count_records(str(tmp_path), 'train') == 8
  _write(str(tmp_path / 'train-00001'), range(6), size=(4, 4))  # Changed.
  monkeypatch.setattr(tfrecord_source, '_COUNTS', {})
  assert tfrecord_source.count_records(str(tmp_path), 'train') == 9


def test_a_wrong_record_count_is_detected(tmp_path, monkeypatch):
  _write(str(tmp_path / 'train-00000'), range(3), size=(4, 4))
  _write(str(tmp_path / 'train-00001'), range(3, 8), size=(4, 4))
  path = str(tmp_path / 'train-00001')
  cache = tfrecord_source._cache_file(str(tmp_path), path)
  os.makedirs(os.path.dirname(cache))
  with open(cache, 'w') as f:  # Right size, wrong count.
    json.dump({'records': 4, 'bytes': os.path.getsize(path)}, f)
  monkeypatch.setattr(tfrecord_source, '_COUNTS', {})
  it = pipeline.train_iterator(_config(str(tmp_path), batch_size=4,
                                       num_classes=8), seed=0)
  next(it)
  with pytest.raises(DataError, match='counted as 7 examples.*record_counts'):
    next(it)


def test_train_processes_read_their_own_files(records):
  labels = []
  for p in range(3):  # Three files: one per process.
    it = pipeline.train_iterator(_config(records, batch_size=30), seed=0,
                                 process_index=p, process_count=3)
    batch = next(it)
    assert batch['image'].shape == (10, 32, 32, 3)
    assert -1 <= batch['image'].min() < batch['image'].max() <= 1
    labels.append(set(batch['label'].tolist()))  # 20 examples per file.
  assert all(len(s) == 10 for s in labels)
  assert not (labels[0] & labels[1] or labels[1] & labels[2])
  assert all(l % 3 == p for p, s in enumerate(labels) for l in s)


def test_uneven_files_fail_for_training_but_not_for_eval(records):
  config = _config(records, batch_size=8, eval_batch_size=8)
  with pytest.raises(DataError, match=r'3 TFRecord files.*2 processes.*'
                     r'Re-shard.*multiple of 2 files'):
    pipeline.train_iterator(config, seed=0, process_index=0, process_count=2)
  seen = []
  for p in range(2):
    for b in pipeline.eval_iterator(config, split='train', process_index=p,
                                    process_count=2):
      seen += b['label'][b['mask']].tolist()
  assert sorted(seen) == list(range(60))


def _first_epoch(directory, process_index, **kw):
  """Labels of one process's first pass over its shard (2 processes)."""
  it = pipeline.train_iterator(_shards_config(directory, **kw), seed=3,
                               process_index=process_index, process_count=2)
  labels = []
  while it.get_state()['epoch'] == 0:
    labels += next(it)['label'].tolist()
  return labels[:len(labels) - it.get_state()['index']]


def test_two_processes_read_disjoint_shards_covering_the_split(shards):
  epochs = [_first_epoch(shards, p) for p in (0, 1)]
  assert [len(e) for e in epochs] == [52, 56]
  for p, labels in enumerate(epochs):
    assert len(set(labels)) == len(labels)
    assert {_file_of(l) % 2 for l in labels} == {p}  # Its own files.
  assert sorted(epochs[0] + epochs[1]) == list(range(108))


def test_each_epoch_reads_the_files_in_its_own_order(shards):
  # No example shuffle: 4 files read round-robin, in the epoch's file order.
  it = pipeline.train_iterator(_shards_config(shards, shuffle_buffer=1,
                                              batch_size=104), seed=0,
                               process_index=0, process_count=2)
  orders = [tuple(_file_of(l) for l in next(it)['label'][:4])
            for _ in range(4)]  # An epoch is 52 examples: 1 batch.
  assert all(sorted(o) == [0, 2, 4, 6] for o in orders)
  assert len(set(orders)) > 1


def test_process_zero_state_resumes_both_processes_exactly(shards):
  config = _shards_config(shards)
  runs = [pipeline.train_iterator(config, seed=5, process_index=p,
                                  process_count=2) for p in (0, 1)]
  for run in runs:
    take(run, 13)  # 78 examples: epoch 1 on both, at different indices.
  state = json.loads(json.dumps(runs[0].get_state()))
  assert (state['epoch'], state['index']) == (1, 26)
  assert runs[1].get_state()['index'] == 22
  expected = [take(run, 10) for run in runs]  # Into epoch 2.
  for p in (0, 1):
    resumed = pipeline.train_iterator(config, seed=5, process_index=p,
                                      process_count=2)
    resumed.set_state(state)
    assert_batches_equal(take(resumed, 10), expected[p])
    assert resumed.get_state() == runs[p].get_state()


def test_stream_ignores_tensorflows_global_seed(shards):
  def batches(global_seed):
    if global_seed is not None:
      tf.random.set_seed(global_seed)
    try:
      it = pipeline.train_iterator(_shards_config(shards), seed=1,
                                   process_index=1, process_count=2)
      return take(it, 12)  # Two epochs.
    finally:
      tf.random.set_seed(None)

  assert_batches_equal(batches(5), batches(None))


def test_tfrecord_resume(records, tmp_path, caplog):
  """Also from a copy of the files elsewhere (data moved to a bucket
  between preemptions): the same stream, no longer refused, but said."""
  config = _config(records, pp_train='inception')
  run = pipeline.train_iterator(config, seed=4)
  for _ in range(9):
    next(run)
  state = run.get_state()
  expected = [next(run) for _ in range(3)]
  shutil.copytree(records, tmp_path / 'moved')
  resumed = pipeline.train_iterator(
      _config(str(tmp_path / 'moved'), pp_train='inception'), seed=4)
  with caplog.at_level(logging.WARNING, logger='absl'):
    resumed.set_state(state)
  assert f'input.data_dir was {records} and is now {tmp_path}/moved' in (
      caplog.text)
  for a in expected:
    b = next(resumed)
    np.testing.assert_array_equal(a['image'], b['image'])
    np.testing.assert_array_equal(a['label'], b['label'])


@pytest.mark.parametrize('process_count', [1, 2, 4])
def test_eval_counts_records_and_sees_each_once(records, process_count):
  config = _config(records, eval_batch_size=4 * process_count,
                   pp_eval='resize')
  assert pipeline.dataset_info(config).num_eval_examples == 25
  seen, lengths = [], []
  for p in range(process_count):
    batches = list(pipeline.eval_iterator(config, process_index=p,
                                          process_count=process_count))
    lengths.append(len(batches))
    seen += [int(l) for b in batches for l in b['label'][b['mask']]]
  assert len(set(lengths)) == 1
  assert sorted(seen) == list(range(25))


def test_missing_split_and_classes(records):
  with pytest.raises(UnknownSplitError, match="split 'test'"):
    pipeline.eval_iterator(_config(records), split='test')
  with pytest.raises(DataError, match='pass --config.input.num_classes=N'):
    pipeline.train_iterator(_config(records, num_classes=None), seed=0)
  # ... which every config has, with the feature names, for the command line.
  from vit_jax.configs import smoke
  config = smoke.get_config('data=digits')
  config.lock()
  config.input.update(num_classes=10, image_key='image/encoded',
                      label_key='image/class/label')


def test_measure_input(records):
  result = input_bench.measure_input(_config(records, pp_train='inception',
                                       image_size=64), steps=3, warmup=1)
  assert result['img_per_s'] > 0 and result['image_shape'] == (64, 64, 3)
  assert result['batch_size'] == 8 and result['steps'] == 3


def test_epochs_of_tfrecords_need_their_size(records):
  """The base config does not carry ImageNet's size into another dataset:
  total_epochs of TFRecords (no count in the files) is a clear error until
  input.num_train_examples says how many there are."""
  from vit_jax.configs import common
  from vit_jax.train import optim
  c = common.base()
  c.input.unlock()
  c.input.update(data='tfrecord', data_dir=records, num_classes=60,
                 image_size=32, batch_size=8, eval_batch_size=8)
  c.total_epochs = 2.0
  info = pipeline.dataset_info(c.input)
  assert info.num_train_examples is None
  with pytest.raises(ValueError, match='num_train_examples=N'):
    optim.total_steps(c, info.num_train_examples)
  c.input.num_train_examples = 60
  assert optim.total_steps(
      c, pipeline.dataset_info(c.input).num_train_examples) == 15


def _labelled(labels, key='image/class/label'):
  """A record whose int64 list `key` holds `labels` (None: no such key)."""
  feature = {'image/encoded': tf.train.Feature(bytes_list=tf.train.BytesList(
      value=[tf.io.encode_png(np.zeros((8, 8, 3), np.uint8)).numpy()]))}
  if labels is not None:
    feature[key] = tf.train.Feature(
        int64_list=tf.train.Int64List(value=labels))
  return tf.train.Example(features=tf.train.Features(
      feature=feature)).SerializeToString()


@pytest.mark.parametrize('missing', [[], None])
def test_a_record_without_a_label_names_the_file_and_label_key(tmp_path,
                                                               missing):
  """An empty or absent label list used to fail as "slice index 0 of
  dimension 0 out of bounds", naming neither the file nor the fix."""
  for i, labels in enumerate([[[1], [2]], [[3], missing, [4]]]):
    with tf.io.TFRecordWriter(str(tmp_path / f'train-{i:05d}')) as writer:
      for label in labels:
        writer.write(_labelled(label))
  config = ml_collections.ConfigDict(dict(
      data='tfrecord', data_dir=str(tmp_path), num_classes=5, batch_size=5,
      eval_batch_size=5, image_size=8, pp_train='resize', pp_eval='resize',
      eval_split='train'))
  with pytest.raises(DataError, match=r"TFRecord file \S*train-00001 has a "
                     r"record without a label: its int64 list "
                     r"'image/class/label' \(input.label_key\) is empty or "
                     'missing: other records of the file have it: write a '
                     'label') as e:
    next(pipeline.train_iterator(config, seed=0))
  del e  # Its traceback and this frame are a cycle holding the iterator.
  with pytest.raises(DataError, match='train-00001 has a record without'):
    list(pipeline.eval_iterator(config))


def test_another_label_feature_name_says_set_label_key(tmp_path):
  with tf.io.TFRecordWriter(str(tmp_path / 'train-00000')) as writer:
    for label in range(3):
      writer.write(_labelled([label], key='label'))
  config = ml_collections.ConfigDict(dict(
      data='tfrecord', data_dir=str(tmp_path), num_classes=5, batch_size=3,
      image_size=8, pp_train='resize'))
  with pytest.raises(DataError, match=r"train-00000 has a record without a "
                     r"label: .*set input.label_key to the feature that holds "
                     r".*has non-empty int64 features \['label'\]"):
    next(pipeline.train_iterator(config, seed=0))
  config.label_key = 'label'
  batch = next(pipeline.train_iterator(config, seed=0))
  assert sorted(batch['label']) == [0, 1, 2]


def _write_multi(path, label_lists, size=(12, 12)):
  with tf.io.TFRecordWriter(path) as writer:
    for labels in label_lists:
      image = np.full((*size, 3), 10 * labels[0], np.uint8)
      writer.write(tf.train.Example(features=tf.train.Features(feature={
          'image/encoded': tf.train.Feature(bytes_list=tf.train.BytesList(
              value=[tf.io.encode_png(image).numpy()])),
          'image/class/label': tf.train.Feature(
              int64_list=tf.train.Int64List(value=list(labels))),
      })).SerializeToString())


def test_multi_label_records_give_multi_hot_labels(tmp_path):
  """`input.multi_label` (the registry's for jft): every label of a record
  is the image's, a multi-hot float label (the reference's JFT/i21k
  pre-training with sigmoid cross-entropy); without it the first label is
  the class. A label out of range anywhere in the list names the file."""
  lists = [(i % 5, (i + 2) % 5) if i % 3 else (i % 5,) for i in range(12)]
  _write_multi(str(tmp_path / 'train-00000-of-00001'), lists)
  _write_multi(str(tmp_path / 'validation-00000-of-00001'), lists[:5])
  config = _shards_config(str(tmp_path), num_classes=5, batch_size=12,
                          pp_train='decode|resize(8)|value_range(-1,1)',
                          pp_eval='decode|resize(8)|value_range(-1,1)',
                          num_train_examples=12, shuffle_buffer=1)
  config.multi_label = True
  info = pipeline.dataset_info(config)
  assert info.multi_label and info.num_classes == 5
  batch = next(iter(pipeline.train_iterator(config, seed=0)))
  assert batch['label'].shape == (12, 5) and batch['label'].dtype == np.float32
  want = {tuple(sorted(set(l))) for l in lists}
  got = {tuple(np.flatnonzero(row)) for row in batch['label']}
  assert got == want
  (evals,) = list(pipeline.eval_iterator(config))
  assert evals['label'].shape == (12, 5)  # 5 images, padded to the batch.
  single = config.copy_and_resolve_references()
  single.multi_label = False
  assert not pipeline.dataset_info(single).multi_label
  first = next(iter(pipeline.train_iterator(single, seed=0)))['label']
  assert first.shape == (12,) and set(first) <= {l[0] for l in lists}
  _write_multi(str(tmp_path / 'train-00000-of-00001'), [(1, 7)] * 12)
  with pytest.raises(DataError, match=r'train-00000-of-00001 has label 7'):
    next(iter(pipeline.train_iterator(config, seed=0)))
  assert not pipeline.dataset_info(single).multi_label


def _record(encoded, label, key='image/encoded'):
  return tf.train.Example(features=tf.train.Features(feature={
      key: tf.train.Feature(bytes_list=tf.train.BytesList(value=[encoded])),
      'image/class/label': tf.train.Feature(
          int64_list=tf.train.Int64List(value=[label])),
  })).SerializeToString()


def _write_jpegs(path, labels, bad=(), options=None):
  """One 8x8 JPEG per label; those of the records numbered in `bad` are
  cut short (TensorFlow cannot decode them)."""
  with tf.io.TFRecordWriter(path, options=options) as writer:
    for i, label in enumerate(labels):
      encoded = tf.io.encode_jpeg(np.full((8, 8, 3), 20 * label,
                                          np.uint8)).numpy()
      writer.write(_record(encoded[:40] if i in bad else encoded, label))


def _jpeg_config(directory, **kw):
  return ml_collections.ConfigDict({
      'data': 'tfrecord', 'data_dir': str(directory), 'num_classes': 12,
      'batch_size': 2, 'eval_batch_size': 2, 'image_size': 8,
      'shuffle_buffer': 3, 'pp_train': 'decode|resize(8)',
      'pp_eval': 'decode|resize(8)', **kw})


def test_undecodable_images_are_named_and_skipped_in_training_only(
    tmp_path, monkeypatch, caplog):
  """A corrupt JPEG stopped training with a bare `jpeg::Uncompress failed`,
  naming no file, and `input.skip_bad_images=True` was ignored. Now the
  error names the file and the record; with the option the train split's
  bad records are left out (counts and resumes over the others) and
  evaluation still reads every record."""
  monkeypatch.setattr(tfrecord_source, '_COUNTS', {})
  monkeypatch.setattr(tfrecord_source, '_UNDECODABLE', {})
  _write_jpegs(str(tmp_path / 'train-00000-of-00002'), range(6), bad=[2])
  _write_jpegs(str(tmp_path / 'train-00001-of-00002'), range(6, 12),
               bad=[4])
  _write_jpegs(str(tmp_path / 'validation-00000-of-00001'), range(4),
               bad=[1])
  with pytest.raises(BadImageError, match=r'record\(s\) of TFRecord file '
                     r'\S*train-00000-of-00002: record 2 \(counted from 0\)'
                     r'.*input.skip_bad_images=True') as e:
    take(pipeline.train_iterator(_jpeg_config(tmp_path), seed=0), 6)
  del e  # Its traceback and this frame are a cycle holding the iterator.

  config = _jpeg_config(tmp_path, skip_bad_images=True)
  with caplog.at_level(logging.INFO, logger='absl'):
    run = pipeline.train_iterator(config, seed=0)
    epoch = take(run, 5)  # The 10 good records, each once.
  assert 'skipping 2 records of 2 TFRecord files' in caplog.text
  labels = sorted(l for b in epoch for l in b['label'].tolist())
  assert labels == [0, 1, 3, 4, 5, 6, 7, 8, 9, 11]
  for batch in epoch:  # The images are the records' own.
    np.testing.assert_allclose(batch['image'][:, 4, 4, 0],
                               20 * batch['label'], atol=3)
  state = run.get_state()
  expected = take(run, 4)  # Across the epoch's end.
  resumed = pipeline.train_iterator(config, seed=0)
  resumed.set_state(state)
  assert_batches_equal(take(resumed, 4), expected)
  with pytest.raises(DataError, match='other settings.*skip_bad_images'):
    pipeline.train_iterator(_jpeg_config(tmp_path), seed=0).set_state(state)

  # Evaluation never skips: its counts stay exact.
  with pytest.raises(BadImageError, match=r'validation-00000-of-00001: '
                     r'record 1 .*Evaluation reads every record'):
    list(pipeline.eval_iterator(config))

  # Each file is decoded once: the record numbers are cached beside the
  # counts.
  assert os.path.exists(tmp_path / tfrecord_source.COUNTS_DIR /
                        'train-00000-of-00002.undecodable.json')
  monkeypatch.setattr(tfrecord_source, '_UNDECODABLE', {})

  def scan(*args):
    raise AssertionError('decoded the files again')

  monkeypatch.setattr(tfrecord_source, '_scan_files', scan)
  again = pipeline.train_iterator(_jpeg_config(tmp_path, skip_bad_images=True,
                                               batch_size=10), seed=0)
  assert sorted(next(again)['label'].tolist()) == labels


def test_skip_bad_images_decodes_only_the_files_a_process_reads(
    tmp_path, monkeypatch):
  """`dataset_info` (every process, before training) built its element
  spec by opening the train split as the only process: with
  `skip_bad_images` each host decoded every file of the split, not 1/n."""
  monkeypatch.setattr(tfrecord_source, '_COUNTS', {})
  monkeypatch.setattr(tfrecord_source, '_UNDECODABLE', {})
  for i in range(2):
    _write_jpegs(str(tmp_path / f'train-0000{i}-of-00002'), range(4))
  _write_jpegs(str(tmp_path / 'validation-00000-of-00001'), range(2))
  os.chmod(tmp_path, 0o555)  # No shared cache of what was decoded.
  decoded = []
  scan = tfrecord_source._scan_files

  def spy(paths, *args):
    decoded.extend(os.path.basename(p) for p in paths)
    return scan(paths, *args)

  monkeypatch.setattr(tfrecord_source, '_scan_files', spy)
  try:
    config = _jpeg_config(tmp_path, skip_bad_images=True)
    pipeline.dataset_info(config)
    assert decoded == []
    next(pipeline.train_iterator(config, seed=0, process_index=1,
                                 process_count=2))
    assert decoded == ['train-00001-of-00002']
  finally:
    os.chmod(tmp_path, 0o755)


@pytest.mark.parametrize('names', [
    ('train-00000-of-00002.gz', 'train-00001-of-00002.gz', 'validation.gz'),
    ('train.tfrecord.gz', 'train.tfrecord.zlib', 'validation.tfrecord.gz')])
def test_compressed_files_are_read(tmp_path, names):
  """GZIP files failed as "corrupted record" (`*-of-*.gz`) or were not
  found at all (`train.tfrecord.gz`)."""
  for i, name in enumerate(names):
    options = tfrecord_source.compression_type(name)
    _write_jpegs(str(tmp_path / name), range(4 * i, 4 * i + 4),
                 options=options)
  config = _jpeg_config(tmp_path, batch_size=8, eval_batch_size=4)
  assert pipeline.dataset_info(config).num_eval_examples == 4
  assert sorted(next(pipeline.train_iterator(config, seed=0))['label']) == (
      list(range(8)))
  (evals,) = list(pipeline.eval_iterator(config))
  assert sorted(evals['label']) == list(range(8, 12))


def test_a_compressed_file_without_its_ending_is_named(tmp_path):
  _write_jpegs(str(tmp_path / 'train-00000-of-00001'), range(4),
               options='GZIP')
  with pytest.raises(DataError, match=r'cannot read TFRecord file \S*'
                     r'train-00000-of-00001 .*starts like a GZIP file.*'
                     r'\.gz'):
    pipeline.train_iterator(_jpeg_config(tmp_path), seed=0)


def test_a_data_dir_with_glob_characters(tmp_path):
  """`runs/r[1]` was read as a glob pattern: no files found."""
  directory = tmp_path / 'r[1]'
  directory.mkdir()
  _write_jpegs(str(directory / 'train-00000-of-00001'), range(4))
  config = _jpeg_config(directory, batch_size=4)
  assert sorted(next(pipeline.train_iterator(config, seed=0))['label']) == (
      [0, 1, 2, 3])


def test_another_image_feature_name_says_set_image_key(tmp_path):
  """A wrong `input.image_key` failed as TensorFlow's "Feature: image
  (data type: string) is required but could not be found", naming neither
  the file nor the option."""
  directory = tmp_path / 'r[2]'  # A path with brackets is named whole.
  directory.mkdir()
  _write_jpegs(str(directory / 'train-00000-of-00001'), range(4))
  config = _jpeg_config(directory, batch_size=4, image_key='image',
                        eval_split='train')
  match = (r"TFRecord file \S*r\[2\]/train-00000-of-00001 has a record "
           r"without an image: its bytes feature 'image' \(input.image_key\)"
           r".*set input.image_key.*bytes features \['image/encoded'\]")
  with pytest.raises(DataError, match=match) as e:
    next(pipeline.train_iterator(config, seed=0))
  del e
  with pytest.raises(DataError, match=match):
    list(pipeline.eval_iterator(config))
