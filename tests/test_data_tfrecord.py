"""JFT-style TFRecords of JPEG photos: sharding, exact-once eval, throughput."""

import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from vit_jax.data import bench, pipeline
from vit_jax.data.errors import UnknownSplitError


@pytest.fixture(scope='module')
def records(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp('jpeg_records'))
  bench.synthetic_jpeg_records(directory, num_images=60, num_files=3,
                               num_classes=60, size=(96, 128))
  # A validation split of 25 records in 2 files, labels 0..24.
  for i, labels in enumerate([range(0, 13), range(13, 25)]):
    with tf.io.TFRecordWriter(f'{directory}/validation-{i:05d}-of-00002') \
        as writer:
      for label in labels:
        image = np.full((40, 50, 3), label * 10, np.uint8)
        writer.write(tf.train.Example(features=tf.train.Features(feature={
            'image/encoded': tf.train.Feature(bytes_list=tf.train.BytesList(
                value=[tf.io.encode_jpeg(image).numpy()])),
            'image/class/label': tf.train.Feature(
                int64_list=tf.train.Int64List(value=[label, 99])),
        })).SerializeToString())
  return directory


def _config(directory, **kw):
  base = dict(data='tfrecord', data_dir=directory, num_classes=60,
              batch_size=8, eval_batch_size=8, image_size=32,
              num_train_examples=60)
  return ml_collections.ConfigDict({**base, **kw})


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


def test_tfrecord_resume(records):
  config = _config(records, pp_train='inception')
  run = pipeline.train_iterator(config, seed=4)
  for _ in range(9):
    next(run)
  state = run.get_state()
  expected = [next(run) for _ in range(3)]
  resumed = pipeline.train_iterator(config, seed=4)
  resumed.set_state(state)
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
  with pytest.raises(ValueError, match='num_classes'):
    pipeline.train_iterator(_config(records, num_classes=None), seed=0)


def test_measure_input(records):
  result = bench.measure_input(_config(records, pp_train='inception',
                                       image_size=64), steps=3, warmup=1)
  assert result['img_per_s'] > 0 and result['image_shape'] == (64, 64, 3)
  assert result['batch_size'] == 8 and result['steps'] == 3
