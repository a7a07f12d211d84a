"""The data layer's extension points, used from outside the package.

A source kind, a dataset of that kind and a pre-processing op are all
registered here, in the test, and feed `pipeline.train_iterator` and
`pipeline.eval_iterator` as a built-in dataset would.
"""

import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from vit_jax.data import ops, pipeline, registry, settings, sources
from vit_jax.data.errors import LabelRangeError


@sources.register('test_arrays')
class ArraySource(sources.Source):
  """Squares of one grey level per class, held in memory."""

  def __init__(self, spec, input_config):
    self.spec = spec
    levels = np.arange(60) % 4
    images = np.broadcast_to((levels * 60).astype(np.uint8)[:, None, None,
                                                            None],
                             (60, 6, 6, 1)).copy()
    self._splits = {'train': (images[:48], levels[:48]),
                    'test': (images[48:], levels[48:])}

  @property
  def num_classes(self):
    return 4

  def split_names(self):
    return list(self._splits)

  def _ranges(self, split, process_index, process_count):
    sizes = {k: len(v[1]) for k, v in self._splits.items()}
    return sources.host_ranges(split, sizes, process_index, process_count)

  def host_size(self, split, process_index, process_count):
    return sum(b - a for _, a, b in self._ranges(split, process_index,
                                                 process_count))

  def host_dataset(self, split, process_index, process_count, *,
                   order_key=None):
    del order_key
    parts = [(self._splits[s][0][a:b], self._splits[s][1][a:b])
             for s, a, b in self._ranges(split, process_index, process_count)]
    return tf.data.Dataset.from_tensor_slices({
        'image': np.concatenate([i for i, _ in parts]),
        'label': np.concatenate([l for _, l in parts]).astype(np.int64)})


@ops.register('test_invert')
def invert():
  """255 - pixel: proves the op ran (grey level 0 becomes 255)."""
  def fn(features, seed):
    del seed
    return {**features, 'image': 255 - tf.cast(features['image'],
                                               tf.float32)}
  return fn


registry.register(registry.DatasetSpec(
    name='test_squares', source='test_arrays', num_classes=4,
    num_train_examples=48, pp_train='resize', pp_eval='resize',
    image_size=6))


def _config(**kw):
  return ml_collections.ConfigDict({
      'data': 'test_squares', 'batch_size': 8, 'eval_batch_size': 8, **kw})


def test_registered_source_and_op_feed_the_pipeline():
  config = _config(pp_train='decode(1)|resize(4)|test_invert',
                   pp_eval='decode(1)|resize(4)')
  info = pipeline.dataset_info(config)
  assert (info.num_classes, info.num_train_examples,
          info.num_eval_examples) == (4, 48, 12)
  assert info.image_shape == (4, 4, 1)
  it = pipeline.train_iterator(config, seed=0)
  seen = 0
  for _ in range(6):  # One epoch: every example once.
    batch = next(it)
    assert batch['image'].shape == (8, 4, 4, 1)
    np.testing.assert_allclose(batch['image'][:, 0, 0, 0],
                               255.0 - 60.0 * batch['label'])
    seen += len(batch['label'])
  assert seen == 48
  labels = np.concatenate([b['label'][b['mask']]
                           for b in pipeline.eval_iterator(config)])
  np.testing.assert_array_equal(labels, np.arange(48, 60) % 4)
  pipeline.check_num_classes(config, 4)
  with pytest.raises(LabelRangeError, match="'test_squares'"):
    pipeline.check_num_classes(config, 3)


def test_unknown_kinds_and_taken_names_are_errors():
  registry.register(registry.DatasetSpec(name='test_nowhere',
                                         source='test_missing',
                                         num_classes=2))
  with pytest.raises(ValueError, match="unknown source kind 'test_missing'"
                     '.*test_arrays'):
    pipeline.dataset_info(_config(data='test_nowhere'))
  with pytest.raises(ValueError, match='already registered'):
    registry.register(registry.DatasetSpec(name='digits', source='memory',
                                           num_classes=3))
  with pytest.raises(ValueError, match='already registered'):
    sources.register('folder')(ArraySource)


@sources.register('test_own_field')
class OwnFieldSource(ArraySource):
  """`input.test_levels` grey levels (classes); counts its openings."""

  opened = []

  def __init__(self, spec, input_config):
    super().__init__(spec, input_config)
    OwnFieldSource.opened.append(dict(input_config))
    self._levels = input_config.get('test_levels')
    self._splits = {k: (images, labels % self._levels)
                    for k, (images, labels) in self._splits.items()}

  @property
  def num_classes(self):
    return self._levels


registry.register(registry.DatasetSpec(
    name='test_own_field', source='test_own_field', num_classes=None,
    pp_train='resize', pp_eval='resize', image_size=6))


def test_a_kinds_own_field_opens_its_own_source():
  """Sources were kept per six built-in fields: a kind reading a field of
  its own got the source of the first value for the whole process."""
  config = _config(data='test_own_field', test_levels=2)
  assert pipeline.dataset_info(config).num_classes == 2
  config.test_levels = 3
  assert pipeline.dataset_info(config).num_classes == 3
  labels = np.concatenate([b['label'][b['mask']]
                           for b in pipeline.eval_iterator(config)])
  np.testing.assert_array_equal(labels, np.arange(48, 60) % 4 % 3)
  # The pipeline's own fields are not the source's: one opening each.
  config.batch_size, config.image_size = 4, 3
  pipeline.dataset_info(config)
  assert [o['test_levels'] for o in OwnFieldSource.opened] == [2, 3]
  assert not set(settings.PIPELINE_FIELDS) & set(OwnFieldSource.opened[0])


_REGISTERS = '''
import tensorflow as tf
from vit_jax import models
from vit_jax.data import ops, sources


@sources.register('test_twice_kind')
class TwiceSource(sources.Source):
  def host_dataset(self, split, process_index, process_count, *,
                   order_key=None):
    raise NotImplementedError


@ops.register('test_twice_op')
def twice_op():
  return lambda features, seed: features


class TwiceNet(models.Module):
  num_classes: int = 0

  def __call__(self, images, *, train=False):
    return images


models.register(models.Family('TwiceNet', TwiceNet, lambda *a: 0.0,
                              lambda spec: (spec, 1)),
                {'TwiceNet-test': {}})
'''


def test_a_config_file_registering_extensions_runs_twice(tmp_path):
  """A config file runs twice per run (check_command_line, then
  config_flags): the source kind, op and model family it registers arrive
  as new objects of the same definitions and replace themselves; the same
  names from another file are refused, and so is a built-in op's name."""
  import runpy
  from vit_jax import models
  path, other = tmp_path / 'mine.py', tmp_path / 'other.py'
  path.write_text(_REGISTERS)
  other.write_text(_REGISTERS)
  try:
    first = runpy.run_path(str(path))
    second = runpy.run_path(str(path))
    assert first['TwiceSource'] is not second['TwiceSource']
    assert sources.KINDS['test_twice_kind'] is second['TwiceSource']
    assert ops.names().count('test_twice_op') == 1
    assert models.create('TwiceNet-test', 0).__class__ is second['TwiceNet']
    with pytest.raises(ValueError, match=r"source kind 'test_twice_kind' is "
                       r'already registered by .*TwiceSource .*mine\.py'):
      runpy.run_path(str(other))
    with pytest.raises(ValueError, match="op 'resize' is already registered"):
      ops.register('resize')(second['twice_op'])
  finally:
    sources.KINDS.pop('test_twice_kind', None)
    ops._FACTORIES.pop('test_twice_op', None)  # pylint: disable=protected-access
    models.registry.VARIANTS.pop('TwiceNet-test', None)
    models.registry._FAMILY.pop('TwiceNet-test', None)  # pylint: disable=protected-access
