"""Prepares registry datasets as tfds datasets: `python -m vit_jax.data.prepare`.

    python -m vit_jax.data.prepare fashion_mnist [--data_dir=DIR] [--source_dir=DIR]
    python -m vit_jax.data.prepare imagenet2012 --data_dir=gs://b/tfds --manual_dir=DIR
    python -m vit_jax.data.prepare vtab/dtd --data_dir=DIR

Preparing is idempotent: a dataset already in `data_dir` is left alone.
`data_dir` defaults to tfds' (`TFDS_DATA_DIR`, else ~/tensorflow_datasets).

fashion_mnist needs no network. It is the official tfds `fashion_mnist`
(same builder, version, features and example order) built from the IDX
files of Debian's `dataset-fashion-mnist` package, installed in
/usr/share/datasets/fashion-mnist. Those gzip files differ in their headers
from the ones tfds' checksums name, so instead of downloading, the builder
gets a download manager that hands it the local files (after checking the
SHA-256 of their uncompressed contents) and extracts them to a temporary
directory (`--source_dir` names another folder of those four files). Other
tfds datasets download with tfds as usual (ImageNet from the tars in
`--manual_dir`); without network access that fails with one error naming
the way round it: prepare on a connected machine and copy the dataset's
`DATA_DIR/NAME/VERSION` folder here. `~` in the paths is expanded.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import posixpath
import sys
import tempfile
from typing import Dict, Optional

from absl import logging

from vit_jax.data import registry
from vit_jax.data.errors import DatasetNotPreparedError

DEBIAN_DIR = '/usr/share/datasets/fashion-mnist'
APT_HINT = 'apt-get install dataset-fashion-mnist'

# SHA-256 and size of the uncompressed IDX files (identical to upstream's;
# only the gzip wrappers differ).
FASHION_MNIST_FILES: Dict[str, tuple] = {
    'train-images-idx3-ubyte.gz': (
        'c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888',
        47_040_016),
    'train-labels-idx1-ubyte.gz': (
        'bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9',
        60_008),
    't10k-images-idx3-ubyte.gz': (
        '5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b',
        7_840_016),
    't10k-labels-idx1-ubyte.gz': (
        '0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34',
        10_008),
}

NOTHING_TO_PREPARE = ('digits', 'mnist5k', 'folder', 'tfrecord', 'jft')


def check_fashion_mnist_files(source_dir: str = DEBIAN_DIR) -> None:
  """Raises unless `source_dir` holds the four intact Fashion-MNIST files."""
  missing = [f for f in FASHION_MNIST_FILES
             if not os.path.isfile(os.path.join(source_dir, f))]
  if missing:
    raise DatasetNotPreparedError(
        f'fashion_mnist: {", ".join(missing)} not found in {source_dir}; '
        f'install the Debian package with: {APT_HINT}')
  for name, (digest, size) in FASHION_MNIST_FILES.items():
    sha, n = hashlib.sha256(), 0
    with gzip.open(os.path.join(source_dir, name), 'rb') as f:
      for block in iter(lambda: f.read(1 << 20), b''):
        sha.update(block)
        n += len(block)
    if (sha.hexdigest(), n) != (digest, size):
      raise DatasetNotPreparedError(
          f'fashion_mnist: {os.path.join(source_dir, name)} is not the '
          f'Fashion-MNIST file (uncompressed sha256 {sha.hexdigest()}, '
          f'{n} bytes; expected {digest}, {size}); reinstall: {APT_HINT}')


class _LocalFiles:
  """Stands in for tfds' download manager: URLs -> extracted local files."""

  def __init__(self, dl_manager, source_dir: str):
    self._dl_manager = dl_manager
    self._source_dir = source_dir

  def download_and_extract(self, urls):
    paths = {k: os.path.join(self._source_dir, posixpath.basename(u))
             for k, u in urls.items()}
    return self._dl_manager.extract(paths)


# The one tfds builder prepared from local files (Debian's package).
OFFLINE_BUILDER = 'fashion_mnist'


def _fashion_mnist_builder(data_dir: Optional[str], source_dir: str):
  """The official builder, reading its sources from `source_dir`."""
  from tensorflow_datasets.image_classification import mnist

  class FashionMnist(mnist.FashionMNIST, skip_registration=True):
    name = 'fashion_mnist'
    # Nothing is downloaded, so no checksums: tfds would look for them next
    # to this file (which needs importlib_resources, absent in some setups).
    url_infos = None

    def _split_generators(self, dl_manager):
      return super()._split_generators(_LocalFiles(dl_manager, source_dir))

  return FashionMnist(data_dir=data_dir)


def _builder_name(name: str) -> str:
  spec = registry.get(name)
  if spec.name in NOTHING_TO_PREPARE or spec.source != 'tfds':
    raise ValueError(f'{name}: nothing to prepare ({spec.prepare})')
  if spec.name == 'imagenet21k':
    raise ValueError(f'imagenet21k has no tfds builder: {spec.prepare}')
  return spec.tfds_name


def _expand(path: Optional[str]) -> Optional[str]:
  return os.path.expanduser(path) if path else path


def prepares_offline(name: str) -> bool:
  """Whether `prepare(name)` needs no network (fashion_mnist, from Debian's
  package); `vit_jax.inspect` prepares only these on demand."""
  try:
    return _builder_name(name) == OFFLINE_BUILDER
  except ValueError:  # Nothing to prepare.
    return False


def is_prepared(name: str, data_dir: Optional[str] = None) -> bool:
  """Whether registry dataset `name` is ready to read from `data_dir`."""
  import tensorflow_datasets as tfds
  return tfds.builder(_builder_name(name),
                      data_dir=_expand(data_dir)).is_prepared()


def _download_errors() -> tuple:
  """What a download raises when the network or the server fails."""
  import urllib.error
  import requests
  import tensorflow_datasets as tfds
  return (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
          urllib.error.URLError, tfds.download.DownloadError)


def _partial_downloads(builder) -> list:
  """tfds' unfinished downloads of `builder` (`*.tmp.*` folders)."""
  import tensorflow as tf
  folder = os.path.join(str(builder.data_dir_root), 'downloads', builder.name)
  return [p for pattern in ('*.tmp.*', '*/*.tmp.*')
          for p in tf.io.gfile.glob(os.path.join(folder, pattern))]


def _download_and_prepare(name: str, builder, manual_dir: Optional[str]):
  """Downloads and prepares `builder`; a failed download leaves nothing of
  its own behind and raises a DatasetNotPreparedError saying what to do."""
  import tensorflow as tf
  import tensorflow_datasets as tfds
  root = str(builder.data_dir_root)
  downloads = os.path.join(root, 'downloads')
  # Folders the attempt may create, deepest first.
  made = [os.path.join(downloads, builder.name),
          os.path.join(downloads, 'extracted'), downloads,
          os.path.join(root, builder.name), root]
  made = [d for d in made if not tf.io.gfile.exists(d)]
  before = set(_partial_downloads(builder))
  try:
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
        manual_dir=manual_dir))
  except _download_errors() as e:
    for path in set(_partial_downloads(builder)) - before:
      tf.io.gfile.rmtree(path)
    for d in made:
      if tf.io.gfile.isdir(d) and not tf.io.gfile.listdir(d):
        tf.io.gfile.rmtree(d)
    reason = ' '.join(f'{type(e).__name__}: {e}'.split())
    reason = reason[:300] + (' ...' if len(reason) > 300 else '')
    raise DatasetNotPreparedError(
        f'{name}: cannot download {builder.name} here: no network access, '
        f'or the server cannot be reached or refused ({reason}). Prepare it '
        'on a machine with network access (python -m vit_jax.data.prepare '
        f'{name} --data_dir=DIR), then copy DIR/{builder.info.full_name} to '
        f'{builder.data_dir} here (or point input.data_dir at the copy\'s '
        'DIR)') from None


def prepare(name: str, *, data_dir: Optional[str] = None,
            manual_dir: Optional[str] = None,
            source_dir: str = DEBIAN_DIR) -> str:
  """Prepares registry dataset `name` in `data_dir`; returns its directory.

  Args:
    name: a registry name (`fashion_mnist`, `cifar10`, `vtab/dtd`, ...).
    data_dir: tfds data dir (local or gs://); None: tfds' default.
    manual_dir: where manually downloaded files are (ImageNet tars).
    source_dir: fashion_mnist only: the folder of the four .gz IDX files.
    (`~` is expanded in the three folders.)

  Returns:
    The prepared dataset's directory (`data_dir/name/version`).

  Raises:
    DatasetNotPreparedError: missing or damaged fashion_mnist files, or a
      download that fails (no network): the message says what to do.
  """
  import tensorflow_datasets as tfds
  data_dir, manual_dir = _expand(data_dir), _expand(manual_dir)
  source_dir = _expand(source_dir)
  builder_name = _builder_name(name)
  if builder_name == OFFLINE_BUILDER:
    builder = tfds.builder(builder_name, data_dir=data_dir)
    if builder.is_prepared():
      return str(builder.data_dir)
    check_fashion_mnist_files(source_dir)
    builder = _fashion_mnist_builder(data_dir, source_dir)
    with tempfile.TemporaryDirectory(prefix='fashion_mnist_') as tmp:
      builder.download_and_prepare(
          download_dir=tmp, download_config=tfds.download.DownloadConfig(
              try_download_gcs=False))
    return str(builder.data_dir)
  builder = tfds.builder(builder_name, data_dir=data_dir)
  if not builder.is_prepared():
    _download_and_prepare(name, builder, manual_dir)
  return str(builder.data_dir)


def ensure_prepared(input_config) -> None:
  """With `input.prepare`, prepares a missing dataset (process 0 of a
  multi-process run; the others wait for it).

  Raises:
    DatasetNotPreparedError: it cannot be prepared here (e.g. no network to
      download it); the message says how to prepare it elsewhere.
  """
  if not input_config.get('prepare'):
    return
  import jax
  from jax.experimental import multihost_utils
  name, data_dir = input_config.data, input_config.get('data_dir')
  from vit_jax.data import kinds  # Loads TensorFlow: only when preparing.
  if not kinds.preparable(registry.get(name)):
    return  # Folders, TFRecords and in-memory data need no preparation.
  if jax.process_index() == 0 and not _is_prepared(name, data_dir):
    logging.info('preparing %s in %s', name, data_dir or 'the tfds data dir')
    from vit_jax.data import pipeline
    pipeline.hide_accelerators_from_tf()  # Before tfds runs a TF op.
    prepare(name, data_dir=data_dir)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices('dataset prepared')


def _is_prepared(name, data_dir) -> bool:
  try:
    return is_prepared(name, data_dir)
  except ValueError:  # No tfds builder (e.g. a user-prepared i21k): leave it.
    return True

def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog='python -m vit_jax.data.prepare',
      description='Prepares a registry dataset as a tfds dataset.')
  parser.add_argument('name', help='registry name, e.g. fashion_mnist')
  parser.add_argument('--data_dir', default=None,
                      help='tfds data dir (default: TFDS_DATA_DIR or '
                      '~/tensorflow_datasets)')
  parser.add_argument('--manual_dir', default=None,
                      help='manually downloaded files (ImageNet tars)')
  parser.add_argument('--source_dir', default=None,
                      help='fashion_mnist only: the folder of its four .gz '
                      f'IDX files (default: {DEBIAN_DIR}, from Debian\'s '
                      'dataset-fashion-mnist package)')
  args = parser.parse_args(argv)
  try:
    if args.source_dir and _builder_name(args.name) != OFFLINE_BUILDER:
      raise ValueError(f'--source_dir is for {OFFLINE_BUILDER} only (the '
                       f'folder of its four .gz files), not {args.name}')
    path = prepare(args.name, data_dir=args.data_dir,
                   manual_dir=args.manual_dir,
                   source_dir=args.source_dir or DEBIAN_DIR)
  except (ValueError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  print(f'{args.name} is prepared in {path}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
