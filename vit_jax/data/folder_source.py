"""A user's own images: a folder of class sub-folders of JPEG/PNG files.

Two layouts (local paths or gs://):

    DATA_DIR/CLASS/*.jpg                 one split, `train`
    DATA_DIR/SPLIT/CLASS/*.jpg           SPLIT in train, validation, val, test

Images in folders inside a class folder (`CLASS/2019/*.jpg`) belong to that
class, as torchvision's ImageFolder reads them.

Labels are the indices of the sorted class names of the train split. Each
split's files are listed in sorted order and then put in one fixed random
order (the same on every machine), so splits such as `train[:90%]` are
reproducible and hold every class in proportion (a class-sorted list would
leave the last classes only in `train[90%:]`, and a cached pass one class
per block).
Folders and files whose names start with `.` or `_` (`.ipynb_checkpoints`,
`__MACOSX`, macOS `._x.jpg`) are ignored. Split folder names next to other
folders (`DATA_DIR/train` beside `DATA_DIR/cats`) are an error: the layout
would be ambiguous.

A file that cannot be decoded stops the pipeline with an error naming it;
with `input.skip_bad_images` such files are found by decoding each image
of the process's shard once (when a train or eval iterator first reads
it), skipped, and counted in the logs. Split sizes (`split_size`,
`dataset_info`) count files without decoding, bad ones included.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from absl import logging

from vit_jax.data import shuffle
from vit_jax.data.errors import (BadImageError, DatasetNotPreparedError,
                                 UnknownSplitError)
from vit_jax.data.registry import DatasetSpec
from vit_jax.data.sources import Source, host_ranges, register

EXTENSIONS = ('.jpg', '.jpeg', '.png')
SPLIT_DIRS = ('train', 'validation', 'val', 'test')


def _join(*parts: str) -> str:
  return os.path.join(*parts)


def _ignored(name: str) -> bool:
  """Hidden and tool folders/files: `.ipynb_checkpoints`, `__MACOSX`, ..."""
  return name.startswith(('.', '_'))


def _subdirs(path: str) -> List[str]:
  names = (d.rstrip('/') for d in tf.io.gfile.listdir(path))
  return sorted(d for d in names if not _ignored(d)
                and tf.io.gfile.isdir(_join(path, d)))


def _images(path: str) -> List[str]:
  """The image files in `path` and, at any depth, in its folders (as
  torchvision's ImageFolder reads a class folder), hidden and tool ones
  left out."""
  out = []
  for name in tf.io.gfile.listdir(path):
    # By name, without a request per file (gfile.walk stats every entry:
    # hours for a million images on gs://): an image file, a folder
    # (gs:// lists them with a trailing /), else asked.
    bare = name.rstrip('/')
    if _ignored(bare):
      continue
    if not name.endswith('/') and bare.lower().endswith(EXTENSIONS):
      out.append(_join(path, bare))
    elif name.endswith('/') or tf.io.gfile.isdir(_join(path, bare)):
      out += _images(_join(path, bare))
  return sorted(out)


def split_dirs(root: str) -> Dict[str, str]:
  """{split: folder}: `root`'s split folders, or {'train': root}.

  Raises:
    DatasetNotPreparedError: split folders (train, test, ...) beside other
      folders, or split folders without `train`.
  """
  top = _subdirs(root)
  splits = [d for d in top if d in SPLIT_DIRS]
  if not splits:
    return {'train': root}
  others = [d for d in top if d not in SPLIT_DIRS]
  layouts = ('use either DATA_DIR/CLASS/*.jpg (one train split) or '
             f'DATA_DIR/{{{",".join(SPLIT_DIRS)}}}/CLASS/*.jpg')
  if others:
    shown = ', '.join(others[:5]) + (' ...' if len(others) > 5 else '')
    raise DatasetNotPreparedError(
        f'{root} mixes split folders ({", ".join(splits)}) with other '
        f'folders ({shown}): {layouts}. Move the other folders into the '
        'split folders, or rename a class that is called like a split.')
  if 'train' not in splits:
    raise DatasetNotPreparedError(
        f'{root} has split folders ({", ".join(splits)}) but no train/ '
        f'folder, whose sub-folders name the classes: {layouts}')
  return {d: _join(root, d) for d in splits}


def unreadable(paths: Sequence[str]) -> List[str]:
  """The paths that TensorFlow cannot decode as images (all decoded once)."""
  if not paths:
    return []
  ds = tf.data.Dataset.from_tensor_slices(list(paths))
  ds = ds.map(lambda p: (p, tf.shape(tf.io.decode_image(
      tf.io.read_file(p), channels=3, expand_animations=False))),
              num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
  ok = {p.decode() for p, _ in ds.ignore_errors().as_numpy_iterator()}
  return [p for p in paths if p not in ok]


# What TensorFlow's image decoders say about bytes they cannot decode: the
# failing node (DecodeImage, DecodePng, DecodeAndCropJpeg, ExtractJpegShape,
# ...) and the messages of the decoders.
_DECODE_FAILURE = re.compile(
    r'\{\{node [^}]*(Decode[A-Za-z]*|ExtractJpegShape)\}\}'
    r'|Unknown image file format|Invalid (JPEG|PNG|GIF|BMP)|jpeg::|png::')


def is_decode_error(error: Exception) -> bool:
  """Whether a tf.data error is an image decoder's failure."""
  return (isinstance(error, (tf.errors.InvalidArgumentError,
                             tf.errors.DataLossError))
          and _DECODE_FAILURE.search(str(getattr(error, 'message', error)))
          is not None)


@register('folder')
class FolderSource(Source):
  """Class sub-folders of images; see the module docstring."""

  def __init__(self, spec: DatasetSpec, input_config):
    self.spec = spec
    root = input_config.get('data_dir')
    skip_bad_images = bool(input_config.get('skip_bad_images', False))
    if not root or not tf.io.gfile.isdir(root):
      raise DatasetNotPreparedError(
          f'{spec.name}: input.data_dir must be a folder of class '
          f'sub-folders of images, got {root!r} ({spec.prepare})')
    self.root = root
    self.skip_bad_images = skip_bad_images
    folders = split_dirs(root)
    self.classes = _subdirs(folders['train'])
    if not self.classes:
      raise DatasetNotPreparedError(f'{root}: no class sub-folders')
    index = {c: i for i, c in enumerate(self.classes)}
    self._files: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
    for split, path in folders.items():
      paths, labels = [], []
      for cls in _subdirs(path):
        if cls not in index:
          raise DatasetNotPreparedError(
              f'{path}/{cls}: class {cls!r} is not a class of the train '
              f'split ({len(self.classes)} classes)')
        files = _images(_join(path, cls))
        if not files:
          logging.warning('%s/%s has no %s files: class %r has no %s '
                          'examples', path, cls, '/'.join(EXTENSIONS), cls,
                          split)
        paths += files
        labels += [index[cls]] * len(files)
      if not paths:
        raise DatasetNotPreparedError(
            f'{path}: no {"/".join(EXTENSIONS)} files in its class folders')
      order = np.random.default_rng(0).permutation(len(paths))
      self._files[split] = (np.array(paths)[order],
                            np.array(labels, np.int64)[order])
    self._good: Dict[tuple, Tuple[np.ndarray, np.ndarray]] = {}

  @property
  def num_classes(self) -> int:
    return len(self.classes)

  def class_names(self) -> List[str]:
    return list(self.classes)

  def largest_label(self):
    return len(self.classes) - 1, (
        f'{len(self.classes)} class folders in {self.root}, the last '
        f'{self.classes[-1]!r}')

  def split_names(self) -> List[str]:
    return list(self._files)

  def element_spec(self, split: str):
    return {'image': tf.TensorSpec([], tf.string),
            'label': tf.TensorSpec([], tf.int64)}

  def default_eval_split(self) -> str:
    for split in ('test', 'validation', 'val'):
      if split in self._files:
        return split
    raise UnknownSplitError(
        f'{self.root} has only a train split: set input.eval_split (and '
        "input.train_split), e.g. 'train[90%:]' and 'train[:90%]'")

  def _ranges(self, split, process_index, process_count):
    sizes = {s: len(p) for s, (p, _) in self._files.items()}
    try:
      return host_ranges(split, sizes, process_index, process_count)
    except ValueError as e:
      raise UnknownSplitError(f'{self.root}: {e}') from None

  def host_files(self, split: str, process_index: int,
                 process_count: int) -> Tuple[np.ndarray, np.ndarray]:
    """(paths, labels) of the shard, sorted order, without skipped files."""
    key = (split, process_index, process_count)
    if key not in self._good:
      parts = [(self._files[s][0][a:b], self._files[s][1][a:b])
               for s, a, b in self._ranges(*key)]
      paths = np.concatenate([p for p, _ in parts])
      labels = np.concatenate([l for _, l in parts])
      if self.skip_bad_images:
        bad = set(unreadable([str(p) for p in paths]))
        if bad:
          logging.warning(
              'skip_bad_images: skipped %d of %d images of %s split %r '
              '(process %d/%d) that cannot be decoded, e.g. %s', len(bad),
              len(paths), self.root, split, process_index, process_count,
              sorted(bad)[:5])
          keep = np.array([str(p) not in bad for p in paths], bool)
          paths, labels = paths[keep], labels[keep]
      self._good[key] = (paths, labels)
    return self._good[key]

  def host_size(self, split, process_index, process_count) -> int:
    return len(self.host_files(split, process_index, process_count)[0])

  def size_bound(self, split, process_index, process_count) -> int:
    # Before skipping bad files: known alike on every process.
    return sum(b - a for _, a, b in self._ranges(
        split, process_index, process_count))

  def split_size(self, split: str) -> int:
    # Files, bad ones included: decoding every image here would be slow.
    return self.size_bound(split, 0, 1)

  def host_dataset(self, split, process_index, process_count, *,
                   order_key=None) -> tf.data.Dataset:
    paths, labels = self.host_files(split, process_index, process_count)
    columns = {'path': tf.constant(paths, tf.string),
               'label': tf.constant(labels, tf.int64)}
    if order_key is not None and len(paths) > 1:
      order = shuffle.permutation(len(paths), order_key)
      columns = {k: tf.gather(v, order) for k, v in columns.items()}
    ds = tf.data.Dataset.from_tensor_slices(columns)
    return ds.map(lambda x: {'image': tf.io.read_file(x['path']),
                             'label': x['label']},
                  num_parallel_calls=tf.data.AUTOTUNE)

  def explain_error(self, error, split, process_index, process_count):
    # Finding the bad files decodes the whole shard: only for a decoding
    # failure, not for any other error (a crop larger than the images).
    if not is_decode_error(error):
      return None
    paths, _ = self.host_files(split, process_index, process_count)
    bad = unreadable([str(p) for p in paths])
    if not bad:
      return None
    shown = ', '.join(bad[:5]) + (' ...' if len(bad) > 5 else '')
    return BadImageError(
        f'cannot decode {len(bad)} image file(s) of folder dataset '
        f'{self.root}: {shown}. Remove or replace them, or set '
        'input.skip_bad_images=True to skip such files (they are counted in '
        'the logs). Skipping changes what is read: an evaluation then covers '
        'the readable images only, and a training run that already saved a '
        'checkpoint cannot resume with it; start it afresh from its weights '
        '(a new --workdir with --config.init=<its workdir>).', bad)
