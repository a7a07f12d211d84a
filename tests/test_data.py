"""The registry, per-process sharding, exact-once evaluation and resuming.

The pipeline runs on scikit-learn's real `digits` (1797 8x8 images, all
distinct, so an image identifies its example).
"""

import json
import logging
import re
import weakref

import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from vit_jax.data import pipeline, registry, settings, sources
from vit_jax.data.errors import (DataError, DatasetNotPreparedError,
                                 UnknownDatasetError, UnknownSplitError)
from vit_jax.data.memory_source import load
from conftest import assert_batches_equal, no_cyclic_gc, take


def _config(**kw):
  base = dict(data='digits', batch_size=64, eval_batch_size=64)
  return ml_collections.ConfigDict({**base, **kw})


def _ids(images):
  """Image -> bytes of its uint8 pixels (the identity of a digits example)."""
  pixels = np.round((np.asarray(images)[..., 0] + 1) * 127.5)
  return [p.astype(np.uint8).tobytes() for p in pixels]


DIGITS = np.concatenate([load()['train'][0], load()['test'][0]])
TRAIN_IDS = set(_ids(DIGITS[:1437] / 127.5 - 1))
TEST_IDS = _ids(DIGITS[1437:] / 127.5 - 1)


# The registry.

def test_registry_covers_the_papers_datasets():
  names = registry.names()
  for name in ('imagenet2012', 'imagenet2012_real', 'imagenet21k', 'jft',
               'cifar10', 'cifar100', 'oxford_iiit_pet', 'oxford_flowers102',
               'fashion_mnist', 'mnist', 'digits', 'folder', 'tfrecord'):
    assert name in names
  assert len(registry.VTAB_TASKS) == 19
  groups = [registry.get(t).group for t in registry.VTAB_TASKS]
  assert (groups.count('vtab-natural'), groups.count('vtab-specialized'),
          groups.count('vtab-structured')) == (7, 4, 8)
  i1k = registry.get('imagenet2012')
  assert (i1k.num_classes, i1k.num_train_examples) == (1000, 1_281_167)
  assert i1k.pp_train == 'inception' and i1k.splits['dev'] == 'train[99%:]'
  assert registry.get('cifar10').splits['train_dev'] == 'train[:98%]'
  assert registry.get('imagenet2012_real').real_label_key == 'real_label'
  assert registry.get('imagenet21k').num_classes == 21_843


def test_vtab_1k_splits():
  for name in registry.VTAB_TASKS:
    spec = registry.get(name)
    assert spec.train_split == 'train800val200' and spec.eval_split == 'test'
    assert spec.splits['train800'] == 'train[:800]'
    assert spec.splits['train800val200'] == (
        'train[:800]+' + spec.splits['val200'])
    for split in spec.splits.values():
      assert spec.resolve_split(split) == split  # Over its base splits.
  assert registry.get('vtab/cifar100').splits['val200'] == (
      'train[45000:45200]')
  assert registry.get('vtab/dtd').splits['val200'] == 'validation[:200]'
  assert registry.get('vtab/eurosat').splits['test'] == 'train[21600:]'
  assert registry.get('vtab/smallnorb_azimuth').splits['test'] == (
      'test[50%:]')
  assert registry.get('vtab/clevr_count').splits['test'] == 'validation'


def test_unknown_names_list_the_known_ones():
  with pytest.raises(UnknownDatasetError, match='cifar10.*Known datasets'):
    registry.get('cifar_10')
  spec = registry.get('vtab/dtd')
  with pytest.raises(UnknownSplitError, match="named splits.*train800"):
    spec.resolve_split('train900')
  assert spec.resolve_split('val200') == 'validation[:200]'
  assert spec.resolve_split('train[:10%]+test') == 'train[:10%]+test'
  with pytest.raises(UnknownDatasetError):
    pipeline.train_iterator(_config(data='nope'), seed=0)
  with pytest.raises(UnknownSplitError, match="'digits' has no split 'validation'"):
    pipeline.dataset_info(_config(eval_split='validation'))


def test_missing_tfds_data_names_the_prepare_command(tmp_path):
  with pytest.raises(DatasetNotPreparedError,
                     match='python -m vit_jax.data.prepare cifar10'):
    pipeline.dataset_info(_config(data='cifar10', data_dir=str(tmp_path)))
  with pytest.raises(DatasetNotPreparedError, match='image folder|folder'):
    pipeline.dataset_info(_config(data='folder',
                                  data_dir=str(tmp_path / 'none')))


def test_every_prepare_hint_is_a_command_prepare_accepts():
  """The command a missing dataset's error prints names a registry dataset
  whose tfds builder is the one read (VTAB tasks: vtab/<task>, not the
  tfds name, which prepare refuses)."""
  from vit_jax.data import prepare
  checked = 0
  for name in registry.names():
    spec = registry.get(name)
    if spec.source != 'tfds' or not (spec.prepare or '').startswith(
        registry.PREPARE_CMD):
      continue
    named = spec.prepare[len(registry.PREPARE_CMD):].split()[0]
    assert prepare._builder_name(named) == spec.tfds_name, (name, named)  # pylint: disable=protected-access
    checked += 1
  assert checked >= 20  # ImageNet, CIFAR, ... and the 19 VTAB tasks.


def test_batch_must_divide_over_processes():
  with pytest.raises(ValueError, match='not divisible by the process count 3'):
    pipeline.train_iterator(_config(batch_size=64), seed=0, process_index=0,
                            process_count=3)
  with pytest.raises(ValueError, match='eval_batch_size'):
    pipeline.eval_iterator(_config(eval_batch_size=10), process_count=4)
  with pytest.raises(ValueError, match='process_index'):
    pipeline.train_iterator(_config(), seed=0, process_index=2,
                            process_count=2)


# The pipeline.

def test_dataset_info():
  info = pipeline.dataset_info(_config(image_size=16))
  assert (info.num_classes, info.num_train_examples,
          info.num_eval_examples) == (10, 1437, 360)
  assert info.image_shape == info.eval_image_shape == (16, 16, 3)
  info = pipeline.dataset_info(_config(train_split='train[:100]'),
                               split='train[100:150]')
  assert (info.num_train_examples, info.num_eval_examples) == (100, 50)


def test_train_batches():
  it = pipeline.train_iterator(_config(pp_train='finetune', image_size=16),
                               seed=0)
  for _ in range(3):
    batch = next(it)
    assert set(batch) == {'image', 'label'}
    assert batch['image'].shape == (64, 16, 16, 3)
    assert batch['image'].dtype == np.float32
    assert -1 <= batch['image'].min() < batch['image'].max() <= 1
    assert batch['label'].shape == (64,) and batch['label'].dtype == np.int32
  assert json.loads(json.dumps(it.get_state())) == it.get_state()


@pytest.mark.parametrize('kw', [{}, {'mixup': 0.2}])
def test_a_dropped_iterator_is_freed_at_once(kw):
  """No reference cycle: the running tf.data iterator and its threads go
  when the last reference does, not at some later cyclic collection (which
  would stall whatever runs then, for seconds on a busy host)."""
  with no_cyclic_gc():
    train = pipeline.train_iterator(_config(image_size=16, **kw), seed=0)
    next(train)
    evals = iter(pipeline.eval_iterator(_config(image_size=16)))
    next(evals)
    refs = [weakref.ref(train), weakref.ref(train._iterator),
            weakref.ref(evals)]
    del train, evals
    assert [r() for r in refs] == [None] * 3


def _first_epoch(process_index, process_count, **kw):
  """The examples one process reads in its first pass over its shard."""
  config = _config(batch_size=32 * process_count, **kw)
  it = pipeline.train_iterator(config, seed=3, process_index=process_index,
                               process_count=process_count)
  ids = []
  while it.get_state()['epoch'] == 0:
    ids += _ids(next(it)['image'])
  size = len(ids) - it.get_state()['index']
  return ids[:size]


@pytest.mark.parametrize('cache', [False, True])
def test_two_processes_read_disjoint_shards_covering_the_split(cache):
  shards = [_first_epoch(p, 2, cache=cache) for p in (0, 1)]
  assert [len(s) for s in shards] == [719, 718]
  assert all(len(set(s)) == len(s) for s in shards)  # No repeats.
  assert not set(shards[0]) & set(shards[1])
  assert set(shards[0]) | set(shards[1]) == TRAIN_IDS


def test_epochs_and_seeds_reshuffle():
  it = pipeline.train_iterator(_config(batch_size=1437), seed=0)
  e0, e1 = (_ids(next(it)['image']) for _ in range(2))
  assert set(e0) == set(e1) == TRAIN_IDS and e0 != e1
  other = _ids(next(pipeline.train_iterator(_config(batch_size=1437),
                                            seed=1))['image'])
  assert other != e0


@pytest.mark.parametrize('process_count,eval_batch', [(1, 64), (2, 64),
                                                     (3, 96), (7, 56)])
def test_eval_sees_every_example_once(process_count, eval_batch):
  config = _config(eval_batch_size=eval_batch)
  seen, lengths = [], []
  for p in range(process_count):
    batches = list(pipeline.eval_iterator(config, process_index=p,
                                          process_count=process_count))
    lengths.append(len(batches))
    for batch in batches:
      assert batch['image'].shape == (eval_batch // process_count, 8, 8, 3)
      assert batch['mask'].dtype == bool
      assert not batch['image'][~batch['mask']].any()  # Zero padding.
      seen += _ids(batch['image'][batch['mask']])
  assert len(set(lengths)) == 1  # Same step count on every process.
  assert sorted(seen) == sorted(TEST_IDS)


def test_eval_pads_the_last_batch_and_iterates_again():
  ev = pipeline.eval_iterator(_config(eval_batch_size=100, cache=True))
  for _ in range(2):
    batches = list(ev)
    assert len(batches) == len(ev) == 4
    assert [int(b['mask'].sum()) for b in batches] == [100, 100, 100, 60]
    labels = np.concatenate([b['label'][b['mask']] for b in batches])
    np.testing.assert_array_equal(labels, load()['test'][1])


@pytest.mark.parametrize('kw', [
    dict(), dict(pp_train='finetune', image_size=12, cache=True),
    dict(mixup=0.5, shuffle_buffer=100),
    dict(mixup=0.5, cutmix=1.0, image_size=8)])
def test_resume_gives_the_batches_of_an_uninterrupted_run(kw):
  config = _config(batch_size=100, **kw)
  run = pipeline.train_iterator(config, seed=7)
  take(run, 20)  # Past the end of the first epoch (1437 examples).
  state = json.loads(json.dumps(run.get_state()))
  assert state['epoch'] == 1 and state['batches'] == 20
  expected = take(run, 5)
  resumed = pipeline.train_iterator(config, seed=7)
  resumed.set_state(state)
  assert_batches_equal(take(resumed, 5), expected)
  assert resumed.get_state() == run.get_state()
  if kw.get('mixup'):
    assert expected[0]['label'].shape == (100, 10)


def test_process_zero_state_restores_every_process():
  config = _config(batch_size=60, pp_train='finetune', image_size=8)
  runs = [pipeline.train_iterator(config, seed=1, process_index=p,
                                  process_count=2) for p in (0, 1)]
  for run in runs:
    take(run, 30)
  state = runs[0].get_state()
  expected = take(runs[1], 3)
  resumed = pipeline.train_iterator(config, seed=1, process_index=1,
                                    process_count=2)
  resumed.set_state(state)
  assert_batches_equal(take(resumed, 3), expected)


# Not `data_dir`: the same files elsewhere resume, logged
# (test_data_tfrecord.py::test_tfrecord_resume).
@pytest.mark.parametrize('field,value', [
    ('batch_size', 32), ('shuffle_buffer', 100), ('cache', True),
    ('mixup', 0.2)])
def test_resume_with_other_settings_is_refused(field, value):
  run = pipeline.train_iterator(_config(), seed=0)
  next(run)
  other = pipeline.train_iterator(_config(**{field: value}), seed=0)
  with pytest.raises(ValueError, match=f'other settings.*{field}'):
    other.set_state(run.get_state())


def test_resume_from_an_older_state_format_is_refused():
  run = pipeline.train_iterator(_config(), seed=0)
  state = {**run.get_state(), 'format': 1}
  with pytest.raises(ValueError, match='format 1.*afresh'):
    run.set_state(state)


@pytest.mark.parametrize('cache', [False, True])
def test_stream_ignores_tensorflows_global_seed(cache):
  config = _config(batch_size=500, shuffle_buffer=300, cache=cache,
                   pp_train='finetune', image_size=8)

  def batches(global_seed):
    if global_seed is not None:
      tf.random.set_seed(global_seed)
    try:
      return take(pipeline.train_iterator(config, seed=2), 4)  # 1+ epoch.
    finally:
      tf.random.set_seed(None)

  assert_batches_equal(batches(5), batches(None))


def test_shards_of_a_sum_of_splits_are_one_range_per_part():
  sizes = {'train': 1000, 'validation': 500}
  split = 'train[:800]+validation[:200]'
  ranges = [sources.host_ranges(split, sizes, p, 3) for p in range(3)]
  assert ranges[1] == [('train', 267, 534), ('validation', 67, 134)]
  assert [sum(b - a for _, a, b in r) for r in ranges] == [334, 334, 332]


def test_prefetch_zero_means_none_and_unset_means_two():
  from vit_jax.data import settings
  assert settings.read(_config(prefetch=0)).prefetch == 0
  assert settings.read(_config()).prefetch == settings.DEFAULT_PREFETCH == 2


def test_shuffle_buffer_none_is_the_default_and_zero_is_refused():
  """0 used to become 10_000 silently (`or DEFAULT`)."""
  from vit_jax.data import settings
  assert settings.read(_config()).shuffle_buffer == 10_000
  assert settings.read(_config(shuffle_buffer=None)).shuffle_buffer == 10_000
  assert settings.read(_config(shuffle_buffer=1)).shuffle_buffer == 1
  for value in (0, -5, 2.5, True):
    with pytest.raises(ValueError, match=rf'input.shuffle_buffer={value!r}: '
                       r'expected an integer >= 1.*Use 1 to keep the read '
                       'order'):
      pipeline.train_iterator(_config(shuffle_buffer=value), seed=0)


def test_image_size_is_whole_pixels():
  for value in (8.5, 0, -8):
    with pytest.raises(ValueError, match=rf'input.image_size={value!r} is '
                       'not a positive whole number'):
      pipeline.dataset_info(_config(image_size=value))
  assert pipeline.dataset_info(_config(image_size=8.0)).image_shape == (
      8, 8, 3)


def _dataset_ops(ds):
  """The op types of the top-level nodes of `ds`'s graph, in order."""
  graph = tf.compat.v1.GraphDef.FromString(ds._as_serialized_graph().numpy())
  return [node.op for node in graph.node]


def test_mixing_runs_several_batches_at_once_in_order():
  """Mixup/CutMix is a batch-level map: run serially it capped the whole
  pipeline at one core. It runs in parallel; its seed is the batch's own
  position, so the stream is the same (resume exactness: above)."""
  it = pipeline.train_iterator(_config(mixup=0.2, cutmix=1.0, image_size=8),
                               seed=0)
  kinds = _dataset_ops(it.dataset())
  assert kinds.count('ParallelMapDatasetV2') == 2, kinds  # pp, then mixing.
  assert 'MapDataset' not in kinds, kinds
  assert it.dataset().options().deterministic


@pytest.mark.parametrize('pp_eval', ['decode|resize(8)',
                                     'decode|resize(8)|value_range(0, 1)'])
def test_an_eval_value_range_other_than_trains_is_refused(pp_eval):
  """Train images in [-1, 1], eval images in [0, 255] or [0, 1]: the
  evaluation would be garbage without any error."""
  with pytest.raises(DataError, match=(
      r'input.pp_eval=.* gives images in \[0, (255|1)\].*input.pp_train='
      r".*value_range\(-1,1\)' gives \[-1, 1\].*Fix: end input.pp_eval "
      r'with value_range\(-1, 1\)')):
    pipeline.dataset_info(_config(image_size=8, pp_eval=pp_eval))


def test_a_train_range_off_the_usual_names_pp_train_as_the_one_to_fix():
  """Eval in the models' usual [-1, 1], train in [0, 1]: the fix is the
  train pipeline's (moving eval to [0, 1] would break MPP's colour targets
  and every public checkpoint)."""
  with pytest.raises(DataError, match=(
      r'Fix: end input.pp_train with value_range\(-1, 1\) as input.pp_eval '
      'does')):
    pipeline.dataset_info(_config(
        image_size=8, pp_train='decode|resize(8)|value_range(0, 1)',
        pp_eval='resize'))


@pytest.mark.parametrize('pp_train,pp_eval', [
    ('resize', 'decode|resize(8)|value_range(-1, 1, 0, 255, False)'),
    ('decode|resize(8)', 'decode|resize(8)'),
    ('decode|value_range(0, 1)|resize(8)', 'decode|resize(8)|value_range(0,1)'),
])
def test_same_value_ranges_are_accepted(pp_train, pp_eval):
  info = pipeline.dataset_info(_config(image_size=8, pp_train=pp_train,
                                       pp_eval=pp_eval))
  assert info.image_shape == info.eval_image_shape == (8, 8, 3)


@pytest.mark.parametrize('pp_train', [
    'decode|inception_crop|value_range(-1,1)',
    'decode|resize_small(8)|value_range(-1,1)'])
def test_train_images_of_varying_size_are_refused(tmp_path, pp_train):
  for c in range(2):
    (tmp_path / f'c{c}').mkdir()
    for i in range(3):
      png = tf.io.encode_png(tf.zeros([8 + i, 12, 3], tf.uint8))
      tf.io.write_file(str(tmp_path / f'c{c}' / f'{i}.png'), png)
  it = pipeline.train_iterator(ml_collections.ConfigDict(dict(
      data='folder', data_dir=str(tmp_path), batch_size=2, image_size=8,
      pp_train=pp_train, eval_split='train')), seed=0)
  with pytest.raises(DataError, match=(
      r"train feature 'image' has shape \(None, None, 3\) per example: "
      r'input.pp_train must produce fixed-size images.*inception_crop\(S\)')):
    next(it)


def test_skip_bad_images_is_refused_where_the_source_cannot_skip():
  """It was silently ignored by tfds and in-memory data."""
  with pytest.raises(DataError, match=r"skip_bad_images=True: dataset "
                     r"'digits' cannot skip undecodable images.*arrays in "
                     r'memory.*skip_bad_images=False'):
    pipeline.dataset_info(_config(skip_bad_images=True))


@pytest.mark.parametrize('train_split,eval_split,fix', [
    (None, 'train[90%:]', 'train[:90%]'),
    (None, 'train[:10%]', 'train[10%:]'),
    ('train[:95%]', 'train[90%:]', 'train[:90%]'),
    (None, 'train[100:200]', 'train[:100]+train[200:]'),
    ('train', 'test+train[-5:]', 'train[:1432]')])
def test_an_eval_split_inside_the_train_split_is_refused(train_split,
                                                         eval_split, fix):
  """`eval_split='train[90%:]'` beside the default `train` trained on the
  examples it was evaluated on, silently."""
  config = _config(train_split=train_split, eval_split=eval_split)
  st = settings.read(config)
  with pytest.raises(DataError, match=re.escape(
      f'input.eval_split={eval_split!r} shares ') + r'\d+ of its \d+ '
      r'examples with .*Fix: hold them out of training: '
      + re.escape(f'input.train_split={fix!r}')):
    st.check_held_out()
  config.train_split = fix
  settings.read(config).check_held_out()  # The fix is held out.
  if train_split is None and eval_split == 'train[90%:]':  # Training: too.
    with pytest.raises(DataError, match='shares'):
      pipeline.train_iterator(_config(eval_split=eval_split), seed=0)


def test_evaluating_the_train_split_itself_is_allowed(caplog, monkeypatch):
  """A deliberate check of the fit (or an explicit split, as evaluators
  and evaluation runs pass) is not refused; the first is logged (once per
  process: forget what was logged before)."""
  monkeypatch.setattr(settings, '_LOGGED', set())
  with caplog.at_level(logging.WARNING, logger='absl'):
    settings.read(_config(eval_split='train')).check_held_out()
  assert ("input.eval_split='train' is the train split 'train' (the "
          'default') in caplog.text
  settings.read(_config(), eval_split='train[:64]').check_held_out()
  settings.read(_config(train_split='train[:90%]',
                        eval_split='train[90%:]')).check_held_out()
