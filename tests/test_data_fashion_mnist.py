"""fashion_mnist prepared offline from Debian's dataset-fashion-mnist files."""

import os

import ml_collections
import numpy as np
import pytest

from vit_jax.data import pipeline, prepare
from vit_jax.data.errors import DatasetNotPreparedError

HAVE_FILES = all(os.path.isfile(os.path.join(prepare.DEBIAN_DIR, f))
                 for f in prepare.FASHION_MNIST_FILES)


def test_missing_files_say_which_package(tmp_path):
  with pytest.raises(DatasetNotPreparedError,
                     match='apt-get install dataset-fashion-mnist'):
    prepare.prepare('fashion_mnist', data_dir=str(tmp_path / 'tfds'),
                    source_dir=str(tmp_path))
  assert not (tmp_path / 'tfds' / 'fashion_mnist').exists()
  with pytest.raises(ValueError, match='nothing to prepare'):
    prepare.prepare('digits')


def _tree(path):
  """{file: (size, mtime)} under `path`."""
  return {os.path.join(d, f): (os.path.getsize(os.path.join(d, f)),
                               os.path.getmtime(os.path.join(d, f)))
          for d, _, files in os.walk(path) for f in files}


@pytest.mark.skipif(not HAVE_FILES, reason='apt-get install '
                    'dataset-fashion-mnist')
def test_prepare_offline_then_read(tmp_path, monkeypatch):
  data_dir = str(tmp_path)
  assert not prepare.is_prepared('fashion_mnist', data_dir)
  path = prepare.prepare('fashion_mnist', data_dir=data_dir)
  assert path == os.path.join(data_dir, 'fashion_mnist', '3.0.1')
  assert prepare.is_prepared('fashion_mnist', data_dir)
  before = _tree(data_dir)

  def regenerate(*args, **kwargs):
    raise AssertionError('prepared again')

  with monkeypatch.context() as m:  # Already prepared: a no-op.
    m.setattr(prepare, 'check_fashion_mnist_files', regenerate)
    m.setattr(prepare, '_fashion_mnist_builder', regenerate)
    assert prepare.main(['fashion_mnist', f'--data_dir={data_dir}']) == 0
  assert _tree(data_dir) == before

  config = ml_collections.ConfigDict(dict(
      data='fashion_mnist', data_dir=data_dir, batch_size=128,
      eval_batch_size=1000, image_size=28))
  info = pipeline.dataset_info(config)
  assert (info.num_classes, info.num_train_examples,
          info.num_eval_examples) == (10, 60_000, 10_000)
  assert info.image_shape == (28, 28, 3)
  it = pipeline.train_iterator(config, seed=0, process_index=1,
                               process_count=2)
  batch = next(it)
  assert batch['image'].shape == (64, 28, 28, 3)
  assert -1 <= batch['image'].min() < batch['image'].max() <= 1
  ev = pipeline.eval_iterator(config, split='test[:2500]')
  batches = list(ev)
  assert len(batches) == 3 and int(batches[-1]['mask'].sum()) == 500
  labels = np.concatenate([b['label'][b['mask']] for b in batches])
  assert np.bincount(labels, minlength=10).min() > 200  # All 10 classes.
