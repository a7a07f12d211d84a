"""Parameter sharding from the models' logical-axis annotations (8 simulated
CPU devices): ViT heads / MLP and BiT convolution output channels over
`model`, the largest free dimension over `fsdp`; config rules and overrides."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from conftest import xla_flags
from shard_specs import ROOT, HERE, shard_specs
from vit_jax import models
from vit_jax import sharding as shd


def _sharded_share(specs, prefix=''):
  """Share of the parameters (by count) that are split over some axis."""
  total = split = 0
  for path, (spec, shape) in specs.items():
    if path.startswith(prefix):
      total += math.prod(shape)
      split += math.prod(shape) * any(spec)
  return split / total


@pytest.fixture(scope='module')
def bit_tp():
  return shard_specs('BiT-R50x1', {'data': 1, 'model': 8}, (64, 64, 3))


def test_bit_conv_kernels_split_over_model_on_output_channels(bit_tp):
  kernels = {p: v for p, v in bit_tp.items() if p.endswith('kernel')
             and p != 'head/kernel'}
  assert len(kernels) == 1 + 3 * 16 + 4  # Root, 3 per unit, 4 projections.
  for path, (spec, shape) in kernels.items():
    assert spec == [None, None, None, 'model'], path
    assert shape[-1] % 8 == 0
  assert _sharded_share(bit_tp) > 0.95


def test_bit_conv_kernels_split_under_fsdp():
  specs = shard_specs('BiT-R50x1', {'data': 1, 'fsdp': 8}, (64, 64, 3))
  spec, shape = specs['block4/unit1/conv2/kernel']  # (3, 3, 512, 512)
  assert 'fsdp' in spec and shape[spec.index('fsdp')] == 512
  # Every kernel of at least fsdp_min_size elements is split.
  for path, (spec, shape) in specs.items():
    if math.prod(shape) >= 2**18:
      assert 'fsdp' in spec, path


def test_bit_conv_kernels_split_over_model_and_fsdp():
  specs = shard_specs('BiT-R50x1', {'data': 1, 'fsdp': 2, 'model': 4},
                      (64, 64, 3))
  spec, _ = specs['block4/unit1/conv2/kernel']
  assert spec == [None, None, 'fsdp', 'model']


def test_hybrid_stem_and_vit_split_over_model():
  # B/16 has 12 heads: model=4 divides them (8 would leave them whole).
  specs = shard_specs('R50+ViT-B/16', {'data': 2, 'model': 4}, (64, 64, 3))
  assert _sharded_share(specs, 'block') > 0.95  # The ResNet stem.
  assert specs['conv_root/kernel'][0] == [None, None, None, 'model']
  q = 'Transformer/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel'
  assert specs[q][0] == [None, 'model', None]  # Heads.
  assert specs['Transformer/encoderblock_0/MlpBlock_0/Dense_0/kernel'][0] == [
      None, 'model']


def test_scanned_layers_keep_their_axes():
  model = models.create('ViT-test', num_classes=10, scan_layers=True)
  axes = traverse_util.flatten_dict(shd.logical_axes(model, (28, 28, 3)))
  q = ('Transformer', 'encoderblock', 'MultiHeadDotProductAttention_0',
       'query', 'kernel')
  assert axes[q] == ('layers', 'embed', 'heads', 'kv')


def _family_cases():
  """(variant, overrides, image shape): the first variant of every model
  family, shrunk as smoke runs shrink it; ViTs with a representation layer,
  and once with scanned layers."""
  from vit_jax.models import registry
  first = {}
  for name in registry.names():
    family = registry.family(name)
    # Built-in families only: tests and doc examples register their own
    # (docs/models.md's TinyMLP) in the same process.
    if family.module.__module__.startswith('vit_jax.models.'):
      first.setdefault(family.name, name)
  cases = []
  for family, name in sorted(first.items()):
    overrides, size = registry.family(name).shrink(registry.spec(name))
    if 'hidden_size' in overrides:  # The ViT families.
      overrides['representation_size'] = 16
    cases.append(pytest.param(name, overrides, (size, size, 3), id=family))
  vit = 'ViT-Ti/16'
  overrides, size = registry.family(vit).shrink(registry.spec(vit))
  cases.append(pytest.param(vit, dict(overrides, scan_layers=True),
                            (size, size, 3), id='ViT-scan'))
  return cases


@pytest.mark.parametrize('name,overrides,shape', _family_cases())
def test_every_zoo_parameter_names_its_axes(name, overrides, shape):
  """Tensor parallelism and config rules see every parameter: each one
  names its axes (one name or None per dimension, at least one name),
  LayerNorm / GroupNorm vectors and the representation layer included."""
  model = models.create(name, num_classes=10, **overrides)
  axes = traverse_util.flatten_dict(shd.logical_axes(model, shape),
                                    is_leaf=lambda _, v: isinstance(v, tuple))
  params = traverse_util.flatten_dict(jax.eval_shape(
      model.init, jax.random.key(0), jnp.zeros((1, *shape)))['params'])
  assert set(axes) == set(params)
  unnamed = ['/'.join(k) for k, names in axes.items()
             if len(names) != len(params[k].shape) or not any(names)]
  assert not unnamed, unnamed
  if overrides.get('representation_size'):
    assert axes[('pre_logits', 'kernel')] == ('embed', 'mlp')


def test_init_returns_plain_arrays():
  # Checkpoints, optimisers and converters never see annotation boxes.
  for name, shape in (('ViT-test', (28, 28, 3)), ('BiT-R50x1', (32, 32, 3))):
    model = models.create(name, num_classes=3, width_factor=0.5,
                          depth=26) if name.startswith('BiT') else \
        models.create(name, num_classes=3)
    if name == 'ViT-test':  # Concrete too (BiT: abstract only, fast).
      params = model.init(jax.random.key(0), jnp.zeros((1, *shape)))['params']
      for leaf in jax.tree.leaves(params):
        assert isinstance(leaf, jax.Array), type(leaf)
    abstract = jax.eval_shape(model.init, jax.random.key(0),
                              jnp.zeros((1, *shape)))['params']
    for leaf in jax.tree.leaves(abstract):
      assert isinstance(leaf, jax.ShapeDtypeStruct), type(leaf)


class FakeMesh:
  shape = {'data': 1, 'fsdp': 1, 'model': 4}


def test_config_rules_and_overrides():
  model = models.create('ViT-test', num_classes=8)
  axes = shd.logical_axes(model, (28, 28, 3))
  flat = traverse_util.flatten_dict(axes)
  mlp = flat[('Transformer', 'encoderblock_0', 'MlpBlock_0', 'Dense_0',
              'kernel')]
  assert tuple(shd.param_spec((32, 64), FakeMesh(), mlp)) == (None, 'model')
  # A rule taking precedence: MLP kernels stay whole.
  rules = (('mlp', None),) + shd.LOGICAL_RULES
  assert tuple(shd.param_spec((32, 64), FakeMesh(), mlp, rules=rules)) == (
      None, None)
  # Through param_shardings on a real (1-device) mesh.
  mesh = shd.make_mesh(data=1, devices=jax.devices()[:1])
  abstract = jax.eval_shape(model.init, jax.random.key(0),
                            jnp.zeros((1, 28, 28, 3)))['params']
  sh = shd.param_shardings(abstract, mesh, axes=axes,
                           overrides=(('^head/kernel$', (None, 'mlp')),))
  assert sh['head']['kernel'].spec == jax.sharding.PartitionSpec(None, None)


def test_wrong_override_is_a_clear_error():
  model = models.create('ViT-test', num_classes=8)
  abstract = jax.eval_shape(model.init, jax.random.key(0),
                            jnp.zeros((1, 28, 28, 3)))['params']
  mesh = shd.make_mesh(data=1, devices=jax.devices()[:1])
  with pytest.raises(ValueError, match=r'parameter head/kernel: logical axes '
                     r"\('mlp',\) do not match a parameter of shape"):
    shd.param_shardings(abstract, mesh,
                        overrides=(('^head/kernel$', ('mlp',)),))
  # A misspelled logical axis ('mpl') was silently taken as replicated.
  with pytest.raises(ValueError, match=r"logical axis 'mpl', which no rule "
                     r"knows; the known ones are \[.*'mlp'"):
    shd.param_shardings(abstract, mesh,
                        overrides=(('MlpBlock_0/Dense_0/kernel$',
                                    ('embed', 'mpl')),))


def test_unknown_mesh_axis_in_rules_is_a_clear_error():
  with pytest.raises(ValueError, match="mesh axis 'modle'.*fix sharding_rules"):
    shd.param_spec((32, 64), FakeMesh(), ('embed', 'mlp'),
                   rules=(('mlp', 'modle'),))


@pytest.mark.parametrize('rules,overrides,what', [
    (('mlp', None), (), "sharding_rules=('mlp', None) cannot work; expected "
     'a tuple of pairs'),
    ((('mlp', 'model', 'x'),), (), 'expected a tuple of pairs'),
    ((('mlp', 'modle'),), (), "entry ('mlp', 'modle') cannot work"),
    ((), (('^head/kernel$', (None, 'mlp')),), None),
    ((), ('^head/kernel$', (None, 'mlp')), 'sharding_overrides='),
    ((), (('^head/kernel$', 'mlp'),), "entry ('^head/kernel$', 'mlp')"),
    ((), (('(', (None,)),), "entry ('(', (None,))"),
])
def test_malformed_rules_are_refused_before_set_up(rules, overrides, what):
  """A rule or override not in the nested form (one pair without its
  trailing comma) failed in set-up, after the data was read, with
  "'NoneType' object is not iterable" or an error blaming a parameter."""
  from vit_jax.train import config_check
  from configs import smoke
  config = smoke.get_config('data=digits')
  config.sharding_rules, config.sharding_overrides = rules, overrides
  found = [p for p in config_check.problems(config) if 'sharding' in p]
  if what is None:
    assert not found
  else:
    assert len(found) == 1 and what in found[0], found


def test_a_rule_or_override_that_changes_nothing_is_said(caplog):
  """A misspelt path or logical axis name matches nothing: the run went on
  sharded as if it were not there, silently."""
  model = models.create('ViT-test', num_classes=8)
  abstract = jax.eval_shape(model.init, jax.random.key(0),
                            jnp.zeros((1, 28, 28, 3)))['params']
  mesh = shd.make_mesh(data=1, devices=jax.devices()[:1])
  axes = shd.logical_axes(model, (28, 28, 3))
  with caplog.at_level('WARNING'):
    shd.param_shardings(abstract, mesh, axes=axes,
                        rules=(('mpl', None), ('mlp', None)),
                        overrides=(('^head/kernal$', (None, None)),
                                   ('^head/kernel$', (None, None))))
  said = caplog.text
  assert "'^head/kernal$' matches no parameter path" in said
  assert "'^head/kernel$' matches" not in said
  assert "logical axis 'mpl'" in said and "logical axis 'mlp'" not in said


class FsdpMesh:
  shape = {'data': 1, 'fsdp': 4, 'model': 2}


def test_a_rule_naming_fsdp_is_not_applied_twice():
  """A sharding rule that puts 'fsdp' on a dimension (('embed', 'fsdp'),
  or a tuple with it) leaves FSDP's own pick out: the spec named fsdp twice
  and startup failed with DuplicateSpecError, naming no parameter."""
  rules = (('embed', 'fsdp'),) + shd.LOGICAL_RULES
  spec = shd.param_spec((768, 12, 64), FsdpMesh(), ('embed', 'heads', 'kv'),
                        1, rules)
  assert tuple(spec) == ('fsdp', 'model', None)
  rules = (('embed', ('data', 'fsdp')),) + shd.LOGICAL_RULES
  spec = shd.param_spec((768, 12, 64), FsdpMesh(), ('embed', 'heads', 'kv'),
                        1, rules)
  assert tuple(spec) == (('data', 'fsdp'), 'model', None)
  # Without the rule FSDP shards the largest free dimension itself.
  assert tuple(shd.param_spec((768, 12, 64), FsdpMesh(),
                              ('embed', 'heads', 'kv'), 1)) == (
                                  'fsdp', 'model', None)


_KNOWN_BIT_FAILURE = pytest.mark.xfail(strict=True, reason=(
    'open bug, found 2026-11-25: with numpy-drawn parameters, batch 4-way x '
    'model 2-way gives block1 gradients 3.7% off the one-device ones (the '
    'loss agrees; dp2-tp4, data8, fsdp8, replicated parameters and small '
    'input perturbations agree to 1e-4). Sharding only '
    'block1/unit1/conv3/kernel over model already gives 29%; sharding it '
    'with conv_proj (or unit2/conv1) does not. A 1x1 einsum + GroupNorm + '
    'residual model does not reproduce it. Our rules or XLA SPMD: not yet '
    'known'))


@pytest.mark.parametrize('mesh,init', [
    pytest.param({'data': 2, 'model': 4}, 'jax', marks=pytest.mark.slow),
    ({'data': 1, 'fsdp': 4, 'model': 2}, 'jax'),
    pytest.param({'data': 4, 'model': 2}, 'numpy',
                 marks=[pytest.mark.slow, _KNOWN_BIT_FAILURE]),
], ids=['dp2-tp4', 'fsdp4-tp2', 'dp4-tp2-numpy-init'])
def test_bit_sharded_gradients_match_one_device(mesh, init):
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT,
             XLA_FLAGS=xla_flags(8))
  out = subprocess.run(
      [sys.executable, os.path.join(HERE, 'tp_grads.py'), json.dumps(mesh),
       init], capture_output=True, text=True, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads(out.stdout.strip().splitlines()[-1])
  assert res['devices'] == 8 and res['conv_spec'][-1] == 'model'
  np.testing.assert_allclose(*res['loss'], atol=1e-5)
  # float32 rounding through 26 layers (observed ~3e-5 of each leaf's max).
  assert res['grad_rel_diff'] < 2e-4


def test_rule_dimension_the_model_axis_does_not_divide_is_logged(caplog):
  """ViT-B/16 with model=8: the 12 heads of q/k/v do not divide by 8 and
  stayed replicated without a word."""
  mesh = shd.abstract_mesh(8, data=1, model=8)
  params = {'query': {'kernel': jax.ShapeDtypeStruct((768, 12, 64),
                                                     jnp.float32)},
            'mlp': {'kernel': jax.ShapeDtypeStruct((768, 3072),
                                                   jnp.float32)}}
  axes = {'query': {'kernel': ('embed', 'heads', 'kv')},
          'mlp': {'kernel': ('embed', 'mlp')}}
  with caplog.at_level('WARNING'):
    sh = shd.param_shardings(params, mesh, axes=axes)
  assert sh['query']['kernel'].spec == jax.sharding.PartitionSpec(
      None, None, None)
  assert sh['mlp']['kernel'].spec == jax.sharding.PartitionSpec(None, 'model')
  warnings = [r.getMessage() for r in caplog.records
              if r.levelname == 'WARNING']
  assert len(warnings) == 1, warnings
  assert "query/kernel (768, 12, 64) dim 'heads'=12 over 'model' of size 8" \
      in warnings[0]
  assert 'mlp/kernel' not in warnings[0]


def test_parameters_fsdp_leaves_whole_are_logged(caplog):
  """`mesh.fsdp=5` (e.g. -1 on 5 devices) divides no ViT width: 99% of
  the parameters stayed whole on every device without a word, where the
  model axis had a warning for the same case."""
  mesh = shd.abstract_mesh(5, data=1, fsdp=5)
  params = {'mlp': {'kernel': jax.ShapeDtypeStruct((768, 3072), jnp.float32)},
            'head': {'kernel': jax.ShapeDtypeStruct((768, 1000),
                                                    jnp.float32)},
            'bias': jax.ShapeDtypeStruct((3072,), jnp.float32)}
  with caplog.at_level('WARNING'):
    sh = shd.param_shardings(params, mesh)
  assert sh['head']['kernel'].spec == jax.sharding.PartitionSpec(None, 'fsdp')
  assert sh['mlp']['kernel'].spec == jax.sharding.PartitionSpec(None, None)
  warnings = [r.getMessage() for r in caplog.records
              if r.levelname == 'WARNING']
  assert len(warnings) == 1, warnings
  assert ('FSDP: 1 parameter(s) of at least fsdp_min_size=262144 elements, '
          '75.4% of the model, stay whole on every device: the fsdp axis '
          'size 5 divides none of their dimensions (e.g. mlp/kernel '
          '(768, 3072))') in warnings[0]
  # Sharded over another axis, it is not whole: no warning.
  caplog.clear()
  mesh = shd.abstract_mesh(10, data=1, fsdp=5, model=2)
  with caplog.at_level('WARNING'):
    sh = shd.param_shardings(params, mesh, axes={
        'mlp': {'kernel': ('embed', 'mlp')}})
  assert sh['mlp']['kernel'].spec == jax.sharding.PartitionSpec(None, 'model')
  assert 'stay whole' not in caplog.text

