"""Configs and data the pipeline must refuse, or warn about, before a run
goes wrong: a default eval split inside the train split, `~` in data_dir,
a shard that changed size, non-UTF-8 file names, train and eval images of
different shapes, placeholder class names, uneven TFRecord shares and
shards read in one order every epoch."""

import json
import logging
import os
import re
from types import SimpleNamespace

import ml_collections
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from vit_jax.data import (kinds, memory_source, pipeline, registry, settings,
                          tfds_source)
from vit_jax.data.errors import DataError, DatasetNotPreparedError
from conftest import assert_batches_equal, take


def _digits(**kw):
  return ml_collections.ConfigDict({**dict(
      data='digits', batch_size=64, eval_batch_size=64), **kw})


def _image_folder(root, counts, size=(6, 5)):
  """root/CLASS/i.png: `counts[c]` distinct small PNGs per class."""
  n = 0
  for c, count in enumerate(counts):
    os.makedirs(root / f'c{c}', exist_ok=True)
    for _ in range(count):
      image = np.full((*size, 3), n, np.uint8)
      (root / f'c{c}' / f'{n}.png').write_bytes(
          tf.io.encode_png(image).numpy())
      n += 1
  return root


def _folder(root, **kw):
  return ml_collections.ConfigDict({**dict(
      data='folder', data_dir=str(root), batch_size=4, eval_batch_size=4,
      image_size=8, pp_train='resize', pp_eval='resize'), **kw})


# 1. The held-out check covers the default eval split.

def test_a_default_eval_split_inside_the_train_split_is_refused():
  """digits with train_split='train+test' (eval: the default `test`)
  trained on its test set: only a typed eval_split was checked."""
  with pytest.raises(DataError, match=re.escape(
      "the default eval split 'test' (input.eval_split is unset) shares "
      "360 of its 360 examples with input.train_split='train+test'")
      + r".*Fix: hold them out of training: input.train_split='train'"):
    pipeline.train_iterator(_digits(train_split='train+test'), seed=0)
  # The train split itself as the default: refused too (a typed one is a
  # deliberate fit check, only logged).
  with pytest.raises(DataError, match=re.escape(
      "the default eval split 'test' (input.eval_split is unset) is "
      "input.train_split='test'") + r'.*input.eval_split=\'test\' '
      'explicitly'):
    settings.read(_digits(train_split='test')).check_held_out()
  settings.read(_digits(train_split='test',
                        eval_split='test')).check_held_out()
  # An evaluator's own split is not checked; the defaults are held out.
  settings.read(_digits(train_split='train+test'),
                eval_split='test').check_held_out()
  settings.read(_digits()).check_held_out()


def test_a_default_eval_split_cut_from_train_is_refused(monkeypatch):
  """As VTAB's eurosat, resisc45 and dsprites: their `test` is a slice of
  `train` (`train[21600:]`), so train_split='train' trains on it."""
  spec = registry.DatasetSpec(
      name='cut_test', source='memory', num_classes=10,
      splits={'test': 'train[1237:]'}, image_size=8, pp_train='resize',
      pp_eval='resize')
  monkeypatch.setitem(registry.DATASETS, spec.name, spec)
  monkeypatch.setitem(memory_source.LOADERS, spec.name,
                      memory_source.LOADERS['digits'])
  with pytest.raises(DataError, match=re.escape(
      "the default eval split 'test' ('train[1237:]'; input.eval_split is "
      "unset) shares 200 of its 200 examples with input.train_split="
      "'train'") + '.*' + re.escape("Fix: hold them out of training: "
                                    "input.train_split='train[:1237]'")):
    pipeline.train_iterator(_digits(data='cut_test', train_split='train'),
                            seed=0)
  pipeline.train_iterator(_digits(data='cut_test',
                                  train_split='train[:1237]'), seed=0)


# 2. `~` in input.data_dir.

def test_a_data_dir_under_home_is_expanded(tmp_path, monkeypatch):
  """bash leaves `--config.input.data_dir=~/imgs` as typed; `prepare`
  expanded it, the sources did not: "not prepared in ~/tfds" forever."""
  monkeypatch.setenv('HOME', str(tmp_path))
  _image_folder(tmp_path / 'imgs', [3, 3])
  config = _folder('~/imgs', eval_split='train')
  info = pipeline.dataset_info(config)
  assert info.num_train_examples == 6
  st = settings.read(config)
  assert st.data_dir == st.source.root == str(tmp_path / 'imgs')
  assert settings.expand_data_dir('gs://b/~x') == 'gs://b/~x'
  assert settings.expand_data_dir(None) is None


# 3. A shard that changed size within the first epoch.

def test_resume_refuses_a_shard_that_changed_size_in_its_first_epoch(
    tmp_path, monkeypatch):
  """Before the first wrap the saved (epoch, index) fit any new size: the
  run resumed silently on other examples."""
  root = _image_folder(tmp_path, [10, 10])
  config = _folder(root, eval_split='train', shuffle_buffer=100)
  run = pipeline.train_iterator(config, seed=0)
  take(run, 2)
  state = json.loads(json.dumps(run.get_state()))
  assert (state['epoch'], state['index']) == (0, 8)
  expected = take(run, 3)
  # An older state (no host_size) resumes as before on the same data.
  old = {k: v for k, v in state.items() if k != 'host_size'}
  resumed = pipeline.train_iterator(config, seed=0)
  resumed.set_state(old)
  assert_batches_equal(take(resumed, 3), expected)
  _image_folder(tmp_path / 'more', [3])  # Three more images of class c0.
  for f in (tmp_path / 'more' / 'c0').iterdir():
    f.rename(root / 'c0' / f'new_{f.name}')
  monkeypatch.setattr(kinds, '_OPENED', {})  # A new process lists afresh.
  changed = pipeline.train_iterator(config, seed=0)
  with pytest.raises(DataError, match=re.escape(
      'the shard of process 0 changed size since the state was saved (20 '
      'examples then, 23 now)')):
    changed.set_state(state)
  assert state['host_size'] == 20


# 4. Non-UTF-8 file names.

def test_a_file_name_that_is_not_utf8_is_named(tmp_path):
  root = _image_folder(tmp_path, [3, 3])
  good = (root / 'c0' / '0.png').read_bytes()
  with open(os.path.join(os.fsencode(root / 'c0'), b'caf\xe9.png'),
            'wb') as f:
    f.write(good)
  with pytest.raises(DatasetNotPreparedError, match=re.escape(
      f'{root}/c0 holds 1 name(s) that are not UTF-8: caf\\xe9.png, which '
      'TensorFlow cannot list. Rename each such file or folder to a UTF-8 '
      'name')):
    pipeline.dataset_info(_folder(root, eval_split='train'))


# 5. Train and eval images of different shapes.

def test_train_and_eval_images_of_different_sizes_are_refused():
  """Unset image_size: train 16x16, eval 8x8 was accepted, and the model
  failed at its first evaluation, after training steps ran."""
  with pytest.raises(DataError, match=re.escape(
      "input.pp_train='decode|resize(16)|value_range(-1,1)' makes 16x16x3 "
      "images but input.pp_eval='decode|resize(8)|value_range(-1,1)' makes "
      '8x8x3') + '.*Fix: resize them to one size'):
    pipeline.dataset_info(_digits(
        pp_train='decode|resize(16)|value_range(-1,1)'))
  info = pipeline.dataset_info(_digits(
      pp_train='decode|resize(16)|value_range(-1,1)',
      pp_eval='decode|resize(16)|value_range(-1,1)'))
  assert info.image_shape == info.eval_image_shape == (16, 16, 3)
  # `mode=eval` resizes the model to its eval images: no training, no check.
  info = pipeline.dataset_info(_digits(
      pp_train='decode|resize(16)|value_range(-1,1)'), training=False)
  assert (info.image_shape, info.eval_image_shape) == ((16, 16, 3),
                                                       (8, 8, 3))


# 6. Placeholder class names.

def test_placeholder_class_names_of_an_unprepared_dataset_are_none(
    tmp_path):
  """cifar10's builder reads its names from the download: unprepared, its
  code says '0'..'9', which predict showed as the class names."""
  def names(data):
    return pipeline.class_names(ml_collections.ConfigDict(dict(
        data=data, data_dir=str(tmp_path / 'tfds'))))
  assert names('cifar10') is None
  assert names('mnist') == [str(i) for i in range(10)]  # Its real names.
  assert names('fashion_mnist')[:2] == ['T-shirt/top', 'Trouser']
  assert pipeline.class_names(_digits()) == [str(i) for i in range(10)]


# 7. TFRecord shares of very different sizes.

def _records(directory, lengths):
  label = 0
  for i, n in enumerate(lengths):
    with tf.io.TFRecordWriter(
        f'{directory}/train-{i:05d}-of-{len(lengths):05d}') as writer:
      for _ in range(n):
        image = tf.io.encode_png(tf.fill([4, 4, 3], tf.constant(
            label % 256, tf.uint8))).numpy()
        writer.write(tf.train.Example(features=tf.train.Features(feature={
            'image/encoded': tf.train.Feature(
                bytes_list=tf.train.BytesList(value=[image])),
            'image/class/label': tf.train.Feature(
                int64_list=tf.train.Int64List(value=[label]))})
        ).SerializeToString())
        label += 1
  return label


def _tfrecords(directory, **kw):
  return ml_collections.ConfigDict({**dict(
      data='tfrecord', data_dir=str(directory), num_classes=1000,
      batch_size=4, image_size=4, pp_train='resize', pp_eval='resize'),
      **kw})


@pytest.mark.parametrize('lengths,warned', [
    ([40, 4], True), ([10, 11, 12, 10], False)])
def test_uneven_tfrecord_shares_are_logged(tmp_path, caplog, lengths,
                                           warned):
  """Each process cycles through its own files: the examples of a small
  share were oversampled, silently."""
  _records(tmp_path, lengths)
  with caplog.at_level(logging.WARNING, logger='absl'):
    for p in range(2):
      pipeline.train_iterator(_tfrecords(tmp_path), seed=0, process_index=p,
                              process_count=2)
  said = [r.getMessage() for r in caplog.records
          if 'shares of very different sizes' in r.getMessage()]
  assert len(said) == (1 if warned else 0), said
  if warned:
    assert re.search(r'process 0: \d+ bytes, \d+\.\dx those of process 1\).*'
                     r'seen more often.*Re-shard the split into a multiple '
                     r'of 2 files of similar size', said[0]), said[0]


# 8. Shards read in one order every epoch.

def _one_order_warnings(caplog):
  return [r.getMessage() for r in caplog.records
          if 'in one order every epoch' in r.getMessage()]


def test_a_shard_read_in_one_order_with_blocks_is_logged(tmp_path, caplog):
  """One file (fashion_mnist) or arrays in memory: every epoch cuts the
  shard into the same blocks, only their order within changes."""
  for name, lengths in (('one', [30]), ('many', [10, 10, 10])):
    os.makedirs(tmp_path / name)
    _records(tmp_path / name, lengths)
  with caplog.at_level(logging.WARNING, logger='absl'):
    pipeline.train_iterator(_digits(shuffle_buffer=300), seed=0)
    said = _one_order_warnings(caplog)
    assert len(said) == 1 and re.search(
        r"shuffle_buffer=300: process 0 reads its 1437 examples of digits "
        r"split 'train' in one order.*Set shuffle_buffer >= 1437", said[0])
    caplog.clear()
    pipeline.train_iterator(_digits(), seed=0)  # One block: a permutation.
    pipeline.train_iterator(_tfrecords(tmp_path / 'many', shuffle_buffer=5),
                            seed=0)  # Files in a new order every epoch.
    assert not _one_order_warnings(caplog)
    pipeline.train_iterator(_tfrecords(tmp_path / 'one', shuffle_buffer=5),
                            seed=0)
    assert len(_one_order_warnings(caplog)) == 1


def test_tfds_shards_of_one_file_read_in_one_order():
  def source(takes, file_format=tfds.core.FileFormat.TFRECORD):
    src = object.__new__(tfds_source.TfdsSource)
    src.builder = SimpleNamespace(info=SimpleNamespace(
        file_format=file_format))
    src._shard = lambda *_: SimpleNamespace(file_instructions=[
        SimpleNamespace(take=t) for t in takes])
    return src
  assert source([60000]).reads_in_one_order('train', 0, 1)
  assert source([0, 500, 0]).reads_in_one_order('train', 0, 1)
  assert not source([300, 200]).reads_in_one_order('train', 0, 1)
  assert source([300, 200], tfds.core.FileFormat.ARRAY_RECORD
                ).reads_in_one_order('train', 0, 1)
