"""Labels outside the model head fail before training, for every source kind.

A 3-class folder trained with `num_classes=2` used to exit 0 with
`eval_loss: nan`; configs now take the class count from the dataset unless
`--config.num_classes` sets it.
"""

import os
import subprocess
import sys
import weakref

import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from vit_jax.configs import smoke
from vit_jax import models
from vit_jax.data import pipeline, prepare
from vit_jax.data.errors import LabelRangeError
from vit_jax.train import loop, step as step_lib
from conftest import no_cyclic_gc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSES = ('cats', 'dogs', 'owls')


def _folder(root, per_class=4):
  rng = np.random.RandomState(0)
  for cls in CLASSES:
    os.makedirs(root / cls)
    for i in range(per_class):
      image = rng.randint(0, 255, (20, 20, 3)).astype(np.uint8)
      (root / cls / f'{i}.png').write_bytes(tf.io.encode_png(image).numpy())
  return str(root)


def _smoke_on_folder(data_dir, *overrides):
  c = smoke.get_config('data=folder,steps=2,batch=4')
  c.input.data_dir = data_dir
  c.input.eval_split = 'train'
  c.input.eval_batch_size = 4
  for key, value in overrides:
    c[key] = value
  return c


def test_folder_labels_beyond_the_head_fail_before_compiling(tmp_path,
                                                             monkeypatch):
  config = _smoke_on_folder(_folder(tmp_path / 'data'), ('num_classes', 2))

  def compile_(*args, **kwargs):
    raise AssertionError('compiled a train step for a head too small')

  monkeypatch.setattr(step_lib, 'compile_train_step', compile_)
  monkeypatch.setattr(step_lib, 'init_state', compile_)
  with pytest.raises(LabelRangeError) as e:
    loop.train_and_evaluate(config, str(tmp_path / 'work'))
  message = str(e.value)
  assert "'folder'" in message and 'labels up to 2' in message
  assert 'num_classes=2' in message and "'owls'" in message
  assert '--config.num_classes=3' in message


def test_smoke_config_takes_the_class_count_from_the_dataset(tmp_path,
                                                             monkeypatch):
  config = _smoke_on_folder(_folder(tmp_path / 'data'))
  assert config.num_classes is None
  heads = []
  from_config = models.from_config

  def spy(model_config, num_classes, *args):
    heads.append(num_classes)
    return from_config(model_config, num_classes, *args)

  monkeypatch.setattr(models, 'from_config', spy)
  summary = loop.train_and_evaluate(config, str(tmp_path / 'work'))
  assert heads == [3]
  assert np.isfinite(summary['eval_loss'])


def test_in_memory_labels_beyond_the_head():
  config = ml_collections.ConfigDict(dict(data='digits'))
  pipeline.check_num_classes(config, 10)
  with pytest.raises(LabelRangeError, match=r"'digits' has labels up to 9 "
                     r'.*num_classes=5'):
    pipeline.check_num_classes(config, 5)


@pytest.mark.parametrize('bad', [0, -3, 'ten', 2.5, True])
def test_num_classes_must_be_a_positive_integer(bad):
  config = ml_collections.ConfigDict(dict(data='digits'))
  with pytest.raises(ValueError, match='positive integer'):
    pipeline.check_num_classes(config, bad)


@pytest.mark.skipif(not os.path.isdir(prepare.DEBIAN_DIR),
                    reason='apt-get install dataset-fashion-mnist')
def test_tfds_labels_beyond_the_head(tmp_path):
  prepare.prepare('fashion_mnist', data_dir=str(tmp_path))
  config = ml_collections.ConfigDict(dict(data='fashion_mnist',
                                          data_dir=str(tmp_path)))
  pipeline.check_num_classes(config, 10)
  with pytest.raises(LabelRangeError, match='labels up to 9'):
    pipeline.check_num_classes(config, 7)


def _record(label):
  image = tf.io.encode_png(np.zeros((8, 8, 3), np.uint8)).numpy()
  return tf.train.Example(features=tf.train.Features(feature={
      'image/encoded': tf.train.Feature(bytes_list=tf.train.BytesList(
          value=[image])),
      'image/class/label': tf.train.Feature(
          int64_list=tf.train.Int64List(value=[label])),
  })).SerializeToString()


def test_tfrecord_labels_checked_by_metadata_and_while_reading(tmp_path):
  for i, labels in enumerate([(0, 1, 2), (3, 7, 4)]):
    with tf.io.TFRecordWriter(str(tmp_path / f'train-{i:05d}')) as writer:
      for label in labels:
        writer.write(_record(label))
  config = ml_collections.ConfigDict(dict(
      data='tfrecord', data_dir=str(tmp_path), num_classes=5, batch_size=6,
      eval_batch_size=6, image_size=8, eval_split='train'))
  pipeline.check_num_classes(config, 5)  # What the metadata says...
  with pytest.raises(LabelRangeError, match='num_classes=4'):
    pipeline.check_num_classes(config, 4)
  with pytest.raises(LabelRangeError) as e:  # ... and what the files hold.
    next(pipeline.train_iterator(config, seed=0))
  assert 'train-00001' in str(e.value) and 'label 7' in str(e.value)
  del e  # Its traceback and this frame are a cycle holding the iterator.
  with pytest.raises(LabelRangeError, match='train-00001'):
    list(pipeline.eval_iterator(config))


def test_a_reading_error_leaves_no_iterator_behind(tmp_path):
  """Caught and dropped, the error does not keep the iterator (and its
  tf.data threads) alive in a reference cycle through its traceback."""
  with tf.io.TFRecordWriter(str(tmp_path / 'train-00000')) as writer:
    writer.write(_record(7))
  config = ml_collections.ConfigDict(dict(
      data='tfrecord', data_dir=str(tmp_path), num_classes=5, batch_size=1,
      image_size=8))
  with no_cyclic_gc():
    it = pipeline.train_iterator(config, seed=0)
    try:
      next(it)
    except LabelRangeError:
      pass
    ref = weakref.ref(it)
    del it
    assert ref() is None


@pytest.mark.parametrize('value, expected', [('None', 'None'), ('5', '5')])
def test_num_classes_flag_takes_none_and_integers(value, expected):
  code = ('from absl import app, flags\n'
          'from ml_collections import config_flags\n'
          "config_flags.DEFINE_config_file('config')\n"
          "app.run(lambda _: print('HEAD', flags.FLAGS.config.num_classes))")
  out = subprocess.run(
      [sys.executable, '-c', code, '--config=configs/smoke.py:data=digits',
       f'--config.num_classes={value}'], cwd=ROOT, capture_output=True,
      text=True)
  assert out.returncode == 0, out.stderr[-2000:]
  assert f'HEAD {expected}' in out.stdout
