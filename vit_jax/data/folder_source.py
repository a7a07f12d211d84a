"""A user's own images: a folder of class sub-folders of image files.

Two layouts (local paths or gs://):

    DATA_DIR/CLASS/*.jpg                 one split, `train`
    DATA_DIR/SPLIT/CLASS/*.jpg           split folders, see SPLIT_DIRS

Split folder names are matched in any case, with common aliases:
`train`/`training` hold split `train`, `test`/`testing` split `test`,
`validation`/`valid` split `validation`, and `val` split `val` (its own name,
as before the aliases). Two folders for one split (`train/` and `Training/`)
are an error.

Image files are those TensorFlow's `decode_image` decodes, known by their
extension (any case): JPEG, PNG, BMP, GIF (first frame) and WebP; other
files (`.tif`, `.txt`, ...) are ignored. Images in folders inside a class
folder (`CLASS/2019/*.jpg`) belong to that class, as torchvision's
ImageFolder reads them.

Labels are the indices of the sorted class names of the train split. Each
split's files are ordered by a keyed hash of their path inside the split
folder (`cat/001.jpg`): the same order on every machine, every class in
proportion in any slice such as `train[90%:]` (a class-sorted list would
leave the last classes only in `train[90%:]`, and a cached pass one class
per block), and a file's place does not depend on the other files: adding
or removing images moves only the files near a slice's boundary in or out
of `train[90%:]`, instead of reshuffling which images are held out.

Folders and files whose names start with `.` or `_` (`.ipynb_checkpoints`,
`__MACOSX`, macOS `._x.jpg`) are ignored; what is ignored (those, other
files, files outside class folders) is logged once per split, at INFO, with
a few names. Split folder names next to other folders (`DATA_DIR/train`
beside `DATA_DIR/cats`) are an error: the layout would be ambiguous. So are
"classes" that look like split folders (`Fold1/`, `train_set/`) whose
sub-folders repeat from one to the next (`Fold1/cat`, `Fold2/cat`): a
split level taken for classes would train a model to tell the splits
apart.

A file that cannot be decoded stops the pipeline with an error naming it;
with `input.skip_bad_images` such files are found by decoding each image
of the process's shard once (when a train or eval iterator first reads
it), skipped, and counted in the logs. Split sizes (`split_size`,
`dataset_info`) count files without decoding, bad ones included.
"""

from __future__ import annotations

import collections
import hashlib
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

# What `tf.io.decode_image` decodes (the `decode` op; TensorFlow names JPEG,
# PNG, GIF, BMP and WebP). TIFF is not among them.
EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp', '.gif', '.webp')
# Split folder names, lower-cased -> the split they hold.
SPLIT_DIRS = {'train': 'train', 'training': 'train',
              'validation': 'validation', 'valid': 'validation',
              'val': 'val', 'test': 'test', 'testing': 'test'}
# Keys the hash that orders each split's files: changing it changes which
# files every slice (`train[90%:]`) of every folder dataset holds.
_ORDER_KEY = b'vit_jax.folder_source'
# Names that order (`FolderSource.file_order`), recorded in pipeline states
# and summary.json: runs before 2026-11-29 read their files in a seeded
# permutation of the whole list, whose slices hold other files.
FILE_ORDER = 'path_hash'
# Words of folder names that look like a split level rather than classes.
_SPLIT_WORDS = re.compile(
    r'^(train.*|test.*|val|valid.*|eval.*|dev|holdout|folds?|split)$')
_SHOWN = 5  # Names shown in errors and logs.


def _join(*parts: str) -> str:
  return os.path.join(*parts)


def _shown(names: Sequence[str]) -> str:
  return ', '.join(names[:_SHOWN]) + (' ...' if len(names) > _SHOWN else '')


def _ignored(name: str) -> bool:
  """Hidden and tool folders/files: `.ipynb_checkpoints`, `__MACOSX`, ..."""
  return name.startswith(('.', '_'))


class _Skipped:
  """What listing a folder left out, logged once (paths relative to it)."""

  def __init__(self, folder: str):
    self.folder = folder
    self.hidden: List[str] = []   # Named .* or _*.
    self.other: List[str] = []    # Files that are not images.
    self.outside: List[str] = []  # Images outside any class folder.

  def add(self, kind: str, path: str) -> None:
    prefix = _join(self.folder, '')
    getattr(self, kind).append(path[len(prefix):] if path.startswith(prefix)
                               else path)

  def log(self, what: str) -> None:
    parts = [f'{len(names)} {label} (e.g. {_shown(sorted(names))})'
             for names, label in (
                 (self.other, 'file(s) that are not '
                  f'{"/".join(e[1:] for e in EXTENSIONS)} images'),
                 (self.hidden, 'file(s) or folder(s) named .* or _*'),
                 (self.outside, 'image(s) outside any class folder'))
             if names]
    if parts:
      logging.info('folder dataset %s: %s ignores %s', self.folder, what,
                   '; '.join(parts))


def _names_in(path: str) -> List[str]:
  """`tf.io.gfile.listdir(path)`, or a clear error for a name that is not
  UTF-8 (TensorFlow's listing raises a bare UnicodeDecodeError)."""
  try:
    return tf.io.gfile.listdir(path)
  except UnicodeDecodeError:
    pass  # Explained below, outside the except: no chained traceback.
  bad = []
  if '://' not in path:  # Local: the raw names say which.
    for raw in os.listdir(os.fsencode(path)):
      try:
        raw.decode('utf-8')
      except UnicodeDecodeError:
        bad.append(raw.decode('utf-8', 'backslashreplace'))
  which = (f'{len(bad)} name(s) that are not UTF-8: {_shown(sorted(bad))}'
           if bad else 'a name that is not UTF-8')
  raise DatasetNotPreparedError(
      f'folder dataset: {path} holds {which}, which TensorFlow cannot list. '
      'Rename each such file or folder to a UTF-8 name (by hand, or e.g. '
      'convmv -f latin1 -t utf-8 -r --notest DATA_DIR), or move it out of '
      'the dataset.')


def _listing(path: str, skipped: Optional[_Skipped] = None
             ) -> Tuple[List[str], List[str]]:
  """(image files, folder names) directly in `path`; what else is there
  goes to `skipped`."""
  images, folders = [], []
  for name in _names_in(path):
    # By name, without a request per file (gfile.walk stats every entry:
    # hours for a million images on gs://): an image file, a folder
    # (gs:// lists them with a trailing /), else asked.
    bare = name.rstrip('/')
    full = _join(path, bare)
    if _ignored(bare):
      if skipped:
        skipped.add('hidden', full + ('/' if name.endswith('/') else ''))
    elif not name.endswith('/') and bare.lower().endswith(EXTENSIONS):
      images.append(full)
    elif name.endswith('/') or tf.io.gfile.isdir(full):
      folders.append(bare)
    elif skipped:
      skipped.add('other', full)
  return sorted(images), sorted(folders)


def _subdirs(path: str, skipped: Optional[_Skipped] = None) -> List[str]:
  """The folders in `path`; its files are outside any class folder."""
  images, folders = _listing(path, skipped)
  for image in images if skipped else ():
    skipped.add('outside', image)
  return folders


def _images(path: str, skipped: Optional[_Skipped] = None) -> List[str]:
  """The image files in `path` and, at any depth, in its folders (as
  torchvision's ImageFolder reads a class folder), hidden and tool ones
  left out."""
  out, folders = _listing(path, skipped)
  for folder in folders:
    out += _images(_join(path, folder), skipped)
  return sorted(out)


def _split_of(folder: str) -> Optional[str]:
  return SPLIT_DIRS.get(folder.lower())


def split_dirs(root: str, skipped: Optional[_Skipped] = None
               ) -> Dict[str, str]:
  """{split: folder}: `root`'s split folders, or {'train': root}.

  Raises:
    DatasetNotPreparedError: split folders (train, test, ...) beside other
      folders, two folders of one split, or split folders without `train`.
  """
  top = _subdirs(root, skipped)
  splits = [d for d in top if _split_of(d)]
  if not splits:
    return {'train': root}
  others = [d for d in top if not _split_of(d)]
  layouts = ('use either DATA_DIR/CLASS/*.jpg (one train split) or '
             'DATA_DIR/SPLIT/CLASS/*.jpg with SPLIT one of '
             f'{", ".join(SPLIT_DIRS)} (any case)')
  if others:
    raise DatasetNotPreparedError(
        f'{root} mixes split folders ({", ".join(splits)}) with other '
        f'folders ({_shown(others)}): {layouts}. Move the other folders into '
        'the split folders, or rename a class that is called like a split.')
  by_split = collections.defaultdict(list)
  for d in splits:
    by_split[_split_of(d)].append(d)
  twice = {s: ds for s, ds in by_split.items() if len(ds) > 1}
  if twice:
    raise DatasetNotPreparedError(
        f'{root}: ' + '; '.join(f'folders {", ".join(ds)} all hold split {s}'
                                for s, ds in sorted(twice.items()))
        + ': keep one folder per split (merge or rename the others).')
  if 'train' not in by_split:
    raise DatasetNotPreparedError(
        f'{root} has split folders ({", ".join(splits)}) but no train/ '
        f'folder, whose sub-folders name the classes: {layouts}')
  return {_split_of(d): _join(root, d) for d in splits}


def _looks_like_split(name: str) -> bool:
  return any(_SPLIT_WORDS.match(w) for w in re.findall('[a-z]+', name.lower()))


def _check_classes_are_not_splits(path: str,
                                  layout: Dict[str, Tuple[bool, List[str]]]
                                  ) -> None:
  """Refuses a split level read as classes (`Fold1/cat`, `Fold2/cat`).

  Args:
    path: the folder whose sub-folders were taken as classes.
    layout: {class: (whether it holds images directly, its folders)}.
  """
  if (len(layout) < 2 or any(direct for direct, _ in layout.values())
      or not all(folders for _, folders in layout.values())):
    return
  counts = collections.Counter(f for _, folders in layout.values()
                               for f in folders)
  shared = sorted(f for f, n in counts.items() if n > 1)
  if not shared:
    return
  classes = sorted(layout)
  if any(_looks_like_split(c) for c in classes):
    raise DatasetNotPreparedError(
        f'{path}: its folders {_shown(classes)} look like splits, not '
        f'classes: each holds only folders, and the same ones '
        f'({_shown(shared)}). Read as classes, the model would learn to '
        'tell the splits apart. Name the split folders train/, test/ and '
        'validation/ (any case; training/, testing/, valid/ and val/ work '
        'too), one per split: DATA_DIR/train/CLASS/*.jpg; or, for one '
        'split, move the class folders up to DATA_DIR/CLASS/.')
  logging.warning(
      '%s: every class folder (%s) holds only folders, and the same ones '
      '(%s); their images are read as the classes %s. If these folders are '
      'splits, name them train/ and test/ (or validation/).', path,
      _shown(classes), _shown(shared), _shown(classes))


def file_order(relative_paths: Sequence[str]) -> np.ndarray:
  """The order of a split's files: by a keyed hash of each path inside the
  split folder, so that a file's place does not depend on the others
  (ties, practically never, keep the listing's order)."""
  digests = b''.join(hashlib.blake2b(p.encode('utf-8'), digest_size=8,
                                     key=_ORDER_KEY).digest()
                     for p in relative_paths)
  return np.argsort(np.frombuffer(digests, '>u8'), kind='stable')


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

  file_order = FILE_ORDER  # What orders its files (pipeline states record it).

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
    top = _Skipped(root)
    folders = split_dirs(root, top)
    # {split: its folder's name}, for errors: `Valid/` holds `validation`.
    self._folders = {s: os.path.basename(p) for s, p in folders.items()
                     if p != root}
    skips = {s: top if p == root else _Skipped(p) for s, p in folders.items()}
    if folders['train'] != root:
      top.log('the folder of the split folders')
    self.classes = _subdirs(folders['train'],
                            None if folders['train'] == root else
                            skips['train'])
    if not self.classes:
      raise DatasetNotPreparedError(f'{root}: no class sub-folders')
    index = {c: i for i, c in enumerate(self.classes)}
    self._files: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
    self._unlabelled: Dict[str, str] = {}  # {split: why it is not one}
    # The train split first: its layout check comes before other errors.
    for split in sorted(folders, key=lambda s: s != 'train'):
      path, skipped = folders[split], skips[split]
      paths, labels, layout = [], [], {}
      listed = self.classes if split == 'train' else _subdirs(path, skipped)
      for cls in listed:
        if cls not in index:
          raise DatasetNotPreparedError(
              f'{path}/{cls}: class {cls!r} is not a class of the train '
              f'split ({len(self.classes)} classes)')
        direct, inner = _listing(_join(path, cls), skipped)
        layout[cls] = (bool(direct), inner)
        files = sorted(direct + [f for d in inner for f in _images(
            _join(path, cls, d), skipped)])
        if not files:
          logging.warning('%s/%s has no %s files: class %r has no %s '
                          'examples', path, cls, '/'.join(EXTENSIONS), cls,
                          split)
        paths += files
        labels += [index[cls]] * len(files)
      if split == 'train':
        _check_classes_are_not_splits(path, layout)
      skipped.log(f'split {split!r}')
      if not listed:
        # E.g. Kaggle's `test/` of unlabelled images: no split to read, and
        # no reason to refuse the others (`_ranges` names it if asked for).
        self._unlabelled[split] = (
            f'{path} has no class sub-folders (images directly in it have '
            'no label)')
        logging.warning('%s: not a split', self._unlabelled[split])
        continue
      if not paths:
        raise DatasetNotPreparedError(
            f'{path}: no {"/".join(EXTENSIONS)} files in its class folders')
      prefix = _join(path, '')
      order = file_order([p[len(prefix):] for p in paths])
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
        "input.train_split), e.g. 'train[90%:]' and 'train[:90%]'"
        + ''.join(f' ({why})' for why in self._unlabelled.values()))

  def _ranges(self, split, process_index, process_count):
    sizes = {s: len(p) for s, (p, _) in self._files.items()}
    try:
      return host_ranges(split, sizes, process_index, process_count)
    except ValueError as e:
      named = [f'{f}/ holds split {s}' for s, f in self._folders.items()
               if f != s and s in self._files]
      named += self._unlabelled.values()
      raise UnknownSplitError(
          f'{self.root}: {e}' + (f' ({"; ".join(named)})' if named else '')
      ) from None

  def host_files(self, split: str, process_index: int,
                 process_count: int) -> Tuple[np.ndarray, np.ndarray]:
    """(paths, labels) of the shard, in the split's order, without skipped
    files."""
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
