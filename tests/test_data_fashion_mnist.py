"""fashion_mnist prepared offline from Debian's dataset-fashion-mnist files;
`python -m vit_jax.data.prepare` without network."""

import os

import ml_collections
import numpy as np
import pytest
import requests

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
def test_prepare_offline_then_read(tmp_path, monkeypatch, capsys):
  # The command line, with the files in a folder of one's own, under ~.
  monkeypatch.setenv('HOME', str(tmp_path))
  os.makedirs(tmp_path / 'fm')
  for name in prepare.FASHION_MNIST_FILES:
    os.symlink(os.path.join(prepare.DEBIAN_DIR, name), tmp_path / 'fm' / name)
  data_dir = str(tmp_path / 'tfds')
  assert not prepare.is_prepared('fashion_mnist', '~/tfds')
  assert prepare.main(['fashion_mnist', '--data_dir=~/tfds',
                       '--source_dir=~/fm']) == 0
  path = os.path.join(data_dir, 'fashion_mnist', '3.0.1')
  assert capsys.readouterr().out.endswith(
      f'\nfashion_mnist is prepared in {path}\n')
  assert prepare.is_prepared('fashion_mnist', data_dir)
  assert prepare.prepare('fashion_mnist', data_dir=data_dir) == path
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


def test_source_dir_flag_expands_home(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv('HOME', str(tmp_path))
  assert prepare.main(['fashion_mnist', '--data_dir=~/tfds',
                       '--source_dir=~/fm']) == 1
  err = capsys.readouterr().err
  assert err.startswith(f'error: fashion_mnist: train-images-idx3-ubyte.gz')
  assert f'not found in {tmp_path}/fm;' in err and '~' not in err
  assert prepare.main(['mnist', '--source_dir=/x']) == 1
  assert capsys.readouterr().err == (
      'error: --source_dir is for fashion_mnist only (the folder of its four '
      '.gz files), not mnist\n')


def _offline(monkeypatch):
  """No network: every request fails as a name lookup does offline (tfds
  downloads with requests)."""
  def get(self, url, *args, **kwargs):
    raise requests.exceptions.ConnectionError(
        f"HTTPSConnectionPool(host='storage.googleapis.com', port=443): Max "
        f'retries exceeded with url: {url} (Caused by NameResolutionError)')
  monkeypatch.setattr(requests.Session, 'get', get)


def test_a_download_without_network_says_how_to_prepare_elsewhere(
    tmp_path, monkeypatch, capsys):
  """It used to end in a requests traceback, leaving `.tmp` folders."""
  _offline(monkeypatch)
  os.makedirs(tmp_path / 'tfds' / 'downloads' / 'mnist')
  (tmp_path / 'tfds' / 'downloads' / 'mnist' / 'x.gz.tmp.1').write_text('')
  assert prepare.main(['mnist', f'--data_dir={tmp_path}/tfds']) == 1
  err = capsys.readouterr().err
  error = [line for line in err.splitlines() if 'error' in line.lower()]
  assert error == [error[0]] and error[0].startswith(
      'error: mnist: cannot download mnist here: no network access')
  assert 'Traceback' not in err
  assert (f'then copy DIR/mnist/3.0.1 to {tmp_path}/tfds/mnist/3.0.1 here'
          in error[0])
  assert 'ConnectionError' in error[0] and 'storage.googleapis.com' in error[0]
  # Nothing of the attempt is left: only what was there before.
  assert [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
          ] == [f'{tmp_path}/tfds/downloads/mnist/x.gz.tmp.1']
  assert not os.path.exists(tmp_path / 'tfds' / 'mnist')

  # Training with input.prepare=True: the same error, raised.
  config = ml_collections.ConfigDict(dict(
      data='mnist', data_dir=str(tmp_path / 'fresh'), prepare=True))
  with pytest.raises(DatasetNotPreparedError,
                     match='cannot download mnist here: no network') as e:
    prepare.ensure_prepared(config)
  assert isinstance(e.value, ValueError) and e.value.__cause__ is None
  assert not os.path.exists(tmp_path / 'fresh')
