"""A user's folder of class sub-folders: real JPEG/PNG/BMP/GIF/WebP photos,
a corrupt file, split folders as people name them."""

import io
import logging
import os
import weakref

import ml_collections
import numpy as np
import pytest
import skimage.data
import tensorflow as tf
from PIL import Image

from vit_jax.data import (folder_source, kinds, ops, pipeline, registry,
                          settings)
from vit_jax.data.errors import (BadImageError, DataError,
                                 DatasetNotPreparedError, UnknownSplitError)
from conftest import no_cyclic_gc

# class -> (photo, format) of its images.
PHOTOS = {
    'animals': [('chelsea', 'jpg'), ('cat', 'png'), ('chelsea', 'png')],
    'objects': [('coffee', 'jpg'), ('camera', 'png'), ('coffee', 'jpeg')],
    'space': [('astronaut', 'jpg'), ('rocket', 'jpg'), ('astronaut', 'png'),
              ('rocket', 'png')],
}


def _write(folder, corrupt=True):
  n = 0
  for cls, photos in PHOTOS.items():
    os.makedirs(folder / cls)
    for photo, fmt in photos:
      image = getattr(skimage.data, photo)()
      image = image[..., None] if image.ndim == 2 else image
      image = image[n % 7:, n % 5:]  # Every file different.
      data = (tf.io.encode_png(image) if fmt == 'png'
              else tf.io.encode_jpeg(image, quality=90)).numpy()
      (folder / cls / f'{photo}_{n}.{fmt.upper() if n == 2 else fmt}'
       ).write_bytes(data)
      n += 1
  (folder / 'objects' / 'notes.txt').write_text('not an image')
  if corrupt:
    good = (folder / 'space' / 'rocket_7.jpg').read_bytes()
    (folder / 'space' / 'bad.jpg').write_bytes(good[:len(good) // 3])
  return n


def _config(folder, **kw):
  return ml_collections.ConfigDict(dict(
      data='folder', data_dir=str(folder), batch_size=4, eval_batch_size=4,
      image_size=32, **kw))


def test_folder_classes_splits_and_batches(tmp_path):
  n = _write(tmp_path, corrupt=False)
  config = _config(tmp_path, train_split='train[:80%]',
                   eval_split='train[80%:]')
  info = pipeline.dataset_info(config)
  assert info.num_classes == 3 and info.image_shape == (32, 32, 3)
  assert (info.num_train_examples, info.num_eval_examples) == (8, 2)
  it = pipeline.train_iterator(config, seed=0)
  for _ in range(5):
    batch = next(it)
    assert batch['image'].shape == (4, 32, 32, 3)
    assert set(batch['label']) <= {0, 1, 2}
  labels = np.concatenate([b['label'][b['mask']]
                           for b in pipeline.eval_iterator(config)])
  # The listing is in one fixed hashed order, not class by class: the
  # two splits are disjoint and together hold every file.
  train = np.concatenate([b['label'][b['mask']] for b in pipeline.eval_iterator(
      _config(tmp_path, eval_split='train[:80%]'))])
  assert sorted(np.concatenate([train, labels])) == sorted(
      np.concatenate([b['label'][b['mask']] for b in pipeline.eval_iterator(
          _config(tmp_path, eval_split='train'))]))
  source = settings.read(config).source
  held_out = source.host_files('train[80%:]', 0, 1)[0]
  class_sorted = sorted(source.host_files('train', 0, 1)[0])
  assert len(held_out) == 2 and sorted(held_out) != class_sorted[-2:]
  assert n == 10
  with pytest.raises(UnknownSplitError, match='set input.eval_split'):
    pipeline.eval_iterator(_config(tmp_path))


def test_a_missing_eval_split_error_keeps_nothing_alive(tmp_path):
  """The error is raised afresh each time: no traceback stored with the
  settings holds the caller's frame, and with it a running iterator."""
  _write(tmp_path, corrupt=False)

  def train_then_ask_for_eval():  # Its frame ends holding the iterator.
    it = pipeline.train_iterator(_config(tmp_path), seed=0)
    next(it)
    with pytest.raises(UnknownSplitError, match='set input.eval_split'):
      pipeline.eval_iterator(_config(tmp_path))
    return weakref.ref(it)

  with no_cyclic_gc():
    assert train_then_ask_for_eval()() is None


def test_split_folders_layout(tmp_path):
  _write(tmp_path / 'train', corrupt=False)
  _write(tmp_path / 'test', corrupt=False)
  info = pipeline.dataset_info(_config(tmp_path))
  assert (info.num_classes, info.eval_split) == (3, 'test')
  assert info.num_eval_examples == 10


def test_an_unlabelled_test_folder_is_no_split_and_blocks_nothing(
    tmp_path, caplog):
  """Kaggle's layout, `train/<class>/` beside a `test/` of unlabelled
  images, refused the whole dataset; now `test` is no split (a warning),
  the others are read, and asking for it says why it is none."""
  _write(tmp_path / 'train', corrupt=False)
  (tmp_path / 'test').mkdir()
  (tmp_path / 'test' / 'a.png').write_bytes(
      (tmp_path / 'train' / 'animals' / 'cat_1.png').read_bytes())
  config = _config(tmp_path, train_split='train[:80%]',
                   eval_split='train[80%:]')
  with caplog.at_level(logging.WARNING):
    info = pipeline.dataset_info(config)
  assert (info.num_train_examples, info.num_eval_examples) == (8, 2)
  assert 'images directly in it have no label' in caplog.text
  for split in ('test', None):  # Asked for, and the default eval split.
    with pytest.raises(UnknownSplitError,
                       match=r'test has no class sub-folders'):
      pipeline.eval_iterator(_config(tmp_path, eval_split=split))
  # Class folders without images are still an error, not "unlabelled".
  (tmp_path / 'test' / 'animals').mkdir()
  kinds._OPENED.clear()  # pylint: disable=protected-access  (listed afresh)
  with pytest.raises(DatasetNotPreparedError, match='no .* files in its '
                     'class folders'):
    pipeline.dataset_info(config)


def test_hidden_and_underscore_folders_are_not_classes(tmp_path, caplog):
  _write(tmp_path, corrupt=False)
  junk = (tmp_path / 'animals' / 'chelsea_0.jpg').read_bytes()
  for folder in ('.ipynb_checkpoints', '__MACOSX/animals', '_tmp'):
    os.makedirs(tmp_path / folder)
    (tmp_path / folder / 'x.jpg').write_bytes(junk)
  (tmp_path / 'animals' / '._chelsea_0.jpg').write_bytes(b'AppleDouble')
  (tmp_path / 'objects' / '_coffee.jpg').write_bytes(junk)
  with caplog.at_level(logging.INFO, logger='absl'):
    info = pipeline.dataset_info(_config(tmp_path, eval_split='train'))
  assert (info.num_classes, info.num_train_examples) == (3, 10)
  # Said once, with names: nothing is dropped silently.
  said = [r.getMessage() for r in caplog.records if 'ignores' in r.getMessage()]
  assert said == [
      f"folder dataset {tmp_path}: split 'train' ignores 1 file(s) that are "
      'not jpg/jpeg/png/bmp/gif/webp images (e.g. objects/notes.txt); 5 '
      'file(s) or folder(s) named .* or _* (e.g. .ipynb_checkpoints, '
      '__MACOSX, _tmp, animals/._chelsea_0.jpg, objects/_coffee.jpg)']


def test_a_class_folder_without_images_is_named(tmp_path, caplog):
  """A class with no images at any depth would have no examples: named."""
  _write(tmp_path, corrupt=False)
  os.makedirs(tmp_path / 'empty' / 'deeper')
  (tmp_path / 'empty' / 'deeper' / 'notes.txt').write_text('no image')
  with caplog.at_level(logging.WARNING):
    info = pipeline.dataset_info(_config(tmp_path, eval_split='train'))
  assert info.num_classes == 4
  assert "class 'empty' has no train examples" in caplog.text


def test_images_in_folders_inside_a_class_folder_are_its_own(tmp_path,
                                                            monkeypatch):
  """As torchvision's ImageFolder: `CLASS/2019/*.jpg` belongs to CLASS,
  beside images directly in it (they were left out, silently); hidden and
  tool folders inside it are not read."""
  _write(tmp_path, corrupt=False)
  photo = (tmp_path / 'animals' / 'chelsea_0.jpg').read_bytes()
  for folder in ('animals/2019', 'animals/2019/march', 'animals/.cache'):
    os.makedirs(tmp_path / folder)
    (tmp_path / folder / 'x.jpg').write_bytes(photo)
  info = pipeline.dataset_info(_config(tmp_path, eval_split='train'))
  assert (info.num_classes, info.num_train_examples) == (3, 12)
  # Image files are known by name: no request per file (on gs:// a walk
  # that stats every entry takes hours for a million images).
  from vit_jax.data import folder_source
  asked = []
  isdir = tf.io.gfile.isdir
  def counting(path):
    asked.append(path)
    return isdir(path)
  monkeypatch.setattr(tf.io.gfile, 'isdir', counting)
  files = folder_source._images(str(tmp_path / 'animals'))  # pylint: disable=protected-access
  assert len(files) == 5 and sorted(map(os.path.basename, asked)) == [
      '2019', 'march']


@pytest.mark.parametrize('folders', [
    ('Train', 'Test'), ('training', 'testing'), ('train', 'valid', 'test'),
    ('TRAIN', 'Validation'), ('train', 'val')])
def test_split_folders_in_any_case_and_common_names(tmp_path, folders):
  """Kaggle's Train/Test, training/testing, Roboflow's valid/: split
  folders, not two classes `Test` and `Train` of one train split."""
  for folder in folders:
    _write(tmp_path / folder, corrupt=False)
  config = _config(tmp_path)
  info = pipeline.dataset_info(config)
  expected = {'train': 'train', 'training': 'train', 'test': 'test',
              'testing': 'test', 'valid': 'validation',
              'validation': 'validation', 'val': 'val'}
  splits = [expected[f.lower()] for f in folders]
  assert sorted(settings.read(config).source.split_names()) == sorted(splits)
  assert (info.num_classes, info.num_train_examples) == (3, 10)
  assert info.eval_split == splits[-1] and info.num_eval_examples == 10
  assert pipeline.class_names(config) == ['animals', 'objects', 'space']
  if 'valid' in folders:  # The folder's own name says where it went.
    with pytest.raises(UnknownSplitError,
                       match=r"valid/ holds split validation"):
      pipeline.dataset_info(_config(tmp_path, eval_split='valid'))


def test_two_folders_of_one_split_are_refused(tmp_path):
  for folder in ('train', 'Training', 'test'):
    _write(tmp_path / folder, corrupt=False)
  with pytest.raises(DatasetNotPreparedError,
                     match='folders Training, train all hold split train'):
    pipeline.dataset_info(_config(tmp_path))


@pytest.mark.parametrize('folders', [('Fold1', 'Fold2'),
                                     ('test_set', 'training_set')])
def test_a_split_level_read_as_classes_is_refused(tmp_path, folders):
  """Folders that look like splits, each holding the same class folders,
  would train a model to tell the splits apart."""
  for folder in folders:
    _write(tmp_path / folder, corrupt=False)
  with pytest.raises(DatasetNotPreparedError,
                     match=rf'{tmp_path}: its folders {", ".join(folders)} '
                     r'look like splits, not classes: each holds only '
                     r'folders, and the same ones \(animals, objects, '
                     r'space\).*Name the split folders train/, test/ and '
                     r'validation/ \(any case'):
    pipeline.dataset_info(_config(tmp_path, eval_split='train'))


def test_classes_sorted_into_the_same_folders_are_read(tmp_path, caplog):
  """`CLASS/2019/*.jpg` in every class is still a layout of classes (with
  a warning that says how split folders are named)."""
  for year in ('2019', '2020'):
    _write(tmp_path / year, corrupt=False)
  for year in ('2019', '2020'):
    for cls in PHOTOS:
      os.renames(tmp_path / year / cls, tmp_path / cls / year)
  with caplog.at_level(logging.WARNING):
    info = pipeline.dataset_info(_config(tmp_path, eval_split='train'))
  assert (info.num_classes, info.num_train_examples) == (3, 20)
  assert ('every class folder (animals, objects, space) holds only folders, '
          'and the same ones (2019, 2020)') in caplog.text


def _image_folder(root, names):
  """Tiny files, not decoded: the listing is what is under test."""
  for name in names:
    os.makedirs(os.path.dirname(root / name), exist_ok=True)
    (root / name).write_bytes(b'')


def _listing(root):
  """(train[:90%], train[90%:], the split's order) of a fresh listing."""
  config = _config(root, train_split='train[:90%]', eval_split='train[90%:]')
  source = folder_source.FolderSource(registry.get('folder'), config)
  return (set(source.host_files('train[:90%]', 0, 1)[0].tolist()),
          set(source.host_files('train[90%:]', 0, 1)[0].tolist()),
          source.host_files('train', 0, 1)[0].tolist())


def test_held_out_images_stay_held_out_when_files_change(tmp_path):
  """A file's place in the split does not depend on the other files: after
  adding 9 and removing 1 of 100 images, `train[90%:]` holds 11 images of
  which the first run trained on 1 here (at most 2 for any such change;
  9 here with the old seeded permutation of the whole list)."""
  _image_folder(tmp_path, [f'{c}/{i:03d}.png' for c in ('cat', 'dog')
                           for i in range(50)])
  train0, eval0, order0 = _listing(tmp_path)
  assert (len(train0), len(eval0)) == (90, 10)
  assert {os.path.basename(os.path.dirname(p)) for p in eval0} == {
      'cat', 'dog'}  # Both classes held out, not the last one only.
  _image_folder(tmp_path, [f'cat/{i:03d}.png' for i in range(50, 59)])
  os.remove(tmp_path / 'cat' / '000.png')
  _, eval1, order1 = _listing(tmp_path)
  assert len(eval1) == 11 and len(eval1 & train0) <= 1
  kept = set(order0) & set(order1)  # In the same order in both listings.
  assert [p for p in order0 if p in kept] == [p for p in order1 if p in kept]


def _encoded(fmt, seed):
  image = np.random.default_rng(seed).integers(0, 255, (12, 10, 3), np.uint8)
  out = io.BytesIO()
  Image.fromarray(image).save(out, fmt)
  return out.getvalue()


def test_bmp_gif_webp_are_read_and_tiff_is_named(tmp_path, caplog):
  """Every format the `decode` op decodes is read (they were skipped
  silently); TIFF, which it cannot decode, is left out and named."""
  names = []
  for i, fmt in enumerate(('BMP', 'GIF', 'WEBP', 'PNG', 'JPEG')):
    names.append(f'{"ab"[i % 2]}/{i}.{fmt.lower()}')
    _image_folder(tmp_path, names[-1:])
    (tmp_path / names[-1]).write_bytes(_encoded(fmt, i))
  (tmp_path / 'a' / 'scan.TIF').write_bytes(_encoded('TIFF', 9))
  config = _config(tmp_path, eval_split='train')
  with caplog.at_level(logging.INFO, logger='absl'):
    source = settings.read(config).source
  paths = source.host_files('train', 0, 1)[0]
  assert sorted(os.path.relpath(p, tmp_path) for p in paths) == sorted(names)
  assert ("ignores 1 file(s) that are not jpg/jpeg/png/bmp/gif/webp images "
          '(e.g. a/scan.TIF)') in caplog.text
  for path in paths:  # The pixels Pillow reads (JPEG: up to IDCT rounding).
    image = ops.decode_image(tf.io.read_file(path)).numpy().astype(int)
    pillow = np.asarray(Image.open(path).convert('RGB')).astype(int)
    assert np.abs(image - pillow).max() <= (3 if 'jpeg' in path else 0), path
  batches = list(pipeline.eval_iterator(_config(
      tmp_path, eval_split='train', pp_eval='decode|resize(8)|'
      'value_range(-1,1)', pp_train='decode|resize(8)|value_range(-1,1)')))
  assert sum(int(b['mask'].sum()) for b in batches) == 5


def test_split_folders_beside_other_folders_are_refused(tmp_path):
  _write(tmp_path / 'train', corrupt=False)
  os.makedirs(tmp_path / 'cats')
  with pytest.raises(DatasetNotPreparedError,
                     match=r'mixes split folders \(train\) with other '
                     r'folders \(cats\)'):
    pipeline.dataset_info(_config(tmp_path))
  os.rename(tmp_path / 'train', tmp_path / 'test')
  os.rmdir(tmp_path / 'cats')
  with pytest.raises(DatasetNotPreparedError, match='no train/ folder'):
    pipeline.dataset_info(_config(tmp_path))


def test_dataset_info_counts_files_without_decoding(tmp_path, monkeypatch):
  _write(tmp_path / 'train')
  _write(tmp_path / 'test', corrupt=False)

  def decode(paths):
    raise AssertionError(f'decoded {len(paths)} images')

  monkeypatch.setattr(folder_source, 'unreadable', decode)
  info = pipeline.dataset_info(_config(tmp_path, skip_bad_images=True))
  assert (info.num_train_examples, info.num_eval_examples) == (11, 10)


def test_corrupt_image_error_names_the_file(tmp_path):
  _write(tmp_path)
  it = pipeline.train_iterator(_config(tmp_path), seed=0)
  with pytest.raises(BadImageError, match=r'bad\.jpg.*skip_bad_images') as e:
    for _ in range(10):
      next(it)
  assert [os.path.basename(p) for p in e.value.paths] == ['bad.jpg']
  del e, it  # A cycle (error, traceback, this frame) would hold `it`.
  with pytest.raises(BadImageError, match=r'bad\.jpg'):
    list(pipeline.eval_iterator(_config(tmp_path, eval_split='train')))


def test_skip_bad_images_skips_and_logs(tmp_path, caplog):
  _write(tmp_path)
  config = _config(tmp_path, skip_bad_images=True, eval_split='train')
  with caplog.at_level(logging.WARNING):
    # bad.jpg is in process 0's half of the split's (hashed) order.
    it = pipeline.train_iterator(config, seed=0, process_index=0,
                                 process_count=2)
    for _ in range(6):  # Over two epochs of the 5 good images of process 0.
      next(it)
  assert 'skipped 1 of 6 images' in caplog.text and 'bad.jpg' in caplog.text
  total = 0
  for p in range(2):
    for batch in pipeline.eval_iterator(config, process_index=p,
                                        process_count=2):
      total += int(batch['mask'].sum())
  assert total == 10  # Every good image once.


def test_a_crop_error_does_not_decode_the_shard(tmp_path, monkeypatch):
  """Only a decoding failure makes the source decode every image of the
  shard to find the bad files; a crop larger than the images says what to
  do at once."""
  _write(tmp_path, corrupt=False)

  def scan(paths):
    raise AssertionError('decoded the whole shard for a non-decoding error')

  monkeypatch.setattr(folder_source, 'unreadable', scan)
  config = _config(tmp_path, eval_split='train',
                   pp_train='decode|random_crop(640)|value_range(-1,1)',
                   pp_eval='decode|central_crop(640)|value_range(-1,1)')
  with pytest.raises(DataError, match=r'input\.pp_train: pre-processing op '
                     r'random_crop\(640, 640\) got a \d+x\d+ image, smaller '
                     'than the crop: resize first'):
    next(pipeline.train_iterator(config, seed=0))
  with pytest.raises(DataError, match=r'input\.pp_eval: .*central_crop'):
    list(pipeline.eval_iterator(config))


def test_only_decoder_errors_look_like_bad_files(tmp_path):
  for data in (b'not an image', PNG_HEADER + b'x' * 40):
    with pytest.raises(tf.errors.InvalidArgumentError) as e:
      tf.data.Dataset.from_tensors(data).map(
          lambda d: tf.io.decode_image(d, expand_animations=False)
      ).get_single_element()
    assert folder_source.is_decode_error(e.value)
  with pytest.raises(tf.errors.InvalidArgumentError) as e:
    tf.data.Dataset.from_tensors(tf.zeros([2])).map(
        lambda x: tf.gather(x, 5)).get_single_element()
  assert not folder_source.is_decode_error(e.value)
  assert not folder_source.is_decode_error(ValueError('Decode'))


PNG_HEADER = b'\x89PNG\r\n\x1a\n'


def test_a_state_saved_with_the_earlier_file_order_is_refused(tmp_path):
  """Folder runs before 2026-11-29 read their files in another order: a
  checkpoint of one would resume on other train / held-out slices."""
  _write(tmp_path, corrupt=False)
  config = _config(tmp_path, train_split='train[:80%]',
                   eval_split='train[80%:]')
  it = pipeline.train_iterator(config, seed=0)
  next(it)
  state = it.get_state()
  assert state['file_order'] == folder_source.FILE_ORDER
  pipeline.train_iterator(config, seed=0).set_state(state)  # Same order.
  del state['file_order']  # As an earlier version saved it.
  with pytest.raises(DataError, match='read its files in another order'):
    pipeline.train_iterator(config, seed=0).set_state(state)
