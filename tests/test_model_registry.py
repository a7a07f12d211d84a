"""A model family registered from outside the package: one module and one
`models.register` call, and `create`, accounting, smoke shrinking and
sharding all know it."""

from __future__ import annotations

import math
import os
import re
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import pytest

from configs import common
from shard_specs import shard_specs
from vit_jax import accounting, models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example(path: str, marker: str) -> str:
  """The ```python block of docs file `path` that contains `marker`."""
  with open(os.path.join(ROOT, path), encoding='utf-8') as f:
    blocks = re.findall(r'```python\n(.*?)```', f.read(), re.S)
  return next(b for b in blocks if marker in b)


# docs/models.md's example, run as a user would copy it: it defines TinyMLP,
# flops and shrink, and registers TinyMLP-S and TinyMLP-L.
_NAMES = {}
exec(compile(_example('docs/models.md', 'class TinyMLP'), 'docs/models.md',
             'exec', dont_inherit=True), _NAMES)
TinyMLP, flops, shrink = _NAMES['TinyMLP'], _NAMES['flops'], _NAMES['shrink']


def test_created_by_name():
  assert {'TinyMLP-S', 'TinyMLP-L'} <= set(models.names())
  model = models.create('TinyMLP-L', num_classes=10)
  assert isinstance(model, TinyMLP) and model.hidden == 256
  assert models.family('TinyMLP-L').name == 'TinyMLP'
  x = jnp.ones((2, 32, 32, 3))
  params = model.init(jax.random.key(0), x)['params']
  assert params['hidden']['kernel'].shape == (32 * 32 * 3, 256)
  assert isinstance(params['hidden']['kernel'], jax.Array)  # Plain arrays.
  assert model.apply({'params': params}, x).shape == (2, 10)
  cfg = ml_collections.ConfigDict(dict(name='TinyMLP-S', hidden=None))
  assert models.from_config(cfg, 5).hidden == 64


def test_accounting_uses_its_flop_count():
  ana = accounting.analytic_forward_flops('TinyMLP-L', 32, num_classes=10)
  assert ana == 2.0 * 32 * 32 * 3 * 256 + 2.0 * 256 * 10
  xla = accounting.forward_flops('TinyMLP-L', 32, num_classes=10)
  assert abs(xla / ana - 1) < 0.02  # Bias and ReLU on top of the matmuls.
  assert accounting.param_count('TinyMLP-L', num_classes=10,
                                image_size=32) == 3072 * 256 + 256 + 2570


def test_smoke_shrinks_it():
  cfg = ml_collections.ConfigDict(dict(name='TinyMLP-L', hidden=None))
  size = common.shrink_model(cfg)
  assert (size, cfg.hidden) == (8, 16)
  model = models.from_config(cfg, 10)
  x = jnp.ones((1, size, size, 3))
  out = model.apply(model.init(jax.random.key(0), x), x)
  assert out.shape == (1, 10)


def test_sharded_from_its_annotations():
  tp = shard_specs('TinyMLP-L', {'data': 1, 'model': 8}, (32, 32, 3),
                   module='test_model_registry')
  assert tp['hidden/kernel'][0] == [None, 'model']
  assert tp['hidden/bias'][0] == ['model']
  assert tp['head/kernel'][0] == ['model', None]
  fsdp = shard_specs('TinyMLP-L', {'data': 1, 'fsdp': 8}, (32, 32, 3),
                     module='test_model_registry')
  assert math.prod(fsdp['hidden/kernel'][1]) >= 2**18
  assert fsdp['hidden/kernel'][0] == ['fsdp', None]  # Largest dim, 3072.


def test_registration_errors_are_clear():
  with pytest.raises(ValueError, match="'TinyMLP-S' is already registered"):
    models.register(models.Family('Again', TinyMLP, flops, shrink),
                    {'TinyMLP-S': {}})
  with pytest.raises(ValueError, match=r"sets \['width'\]"):
    models.register(models.Family('Bad', TinyMLP, flops, shrink),
                    {'TinyMLP-X': dict(width=3)})

  class Plain(nn.Module):
    num_classes: Optional[int] = None
  with pytest.raises(TypeError, match='must derive from vit_jax.models.Module'):
    models.register(models.Family('Plain', Plain, flops, shrink),
                    {'Plain-1': {}})
  assert 'TinyMLP-X' not in models.names()
  assert 'Plain-1' not in models.names()


@pytest.mark.parametrize('name', ['ViT-test', 'Mixer-S/32', 'BiT-R50x1',
                                  'R+ViT-Ti/16'])
def test_compute_options_keep_the_parameters(name):
  """A run may resume with other `registry.COMPUTE_OPTIONS` (the restore
  lets them change): each must leave the parameter tree, shapes and
  dtypes as they were, or the resumed run would read another model."""
  family = models.registry.family(name)
  other = {'dtype': jnp.bfloat16, 'attention_impl': 'explicit',
           'remat': 'dots_saveable', 'recompute_internals': False}
  options = [o for o in models.registry.COMPUTE_OPTIONS
             if o in family.module.__dataclass_fields__]
  assert set(options) <= set(other) and 'dtype' in options
  overrides, size = family.shrink(models.registry.options(name))
  images = jnp.zeros((1, size, size, 3))

  def tree(**changed):
    model = models.create(name, num_classes=10, **overrides, **changed)
    params = jax.eval_shape(model.init, jax.random.key(0), images)
    return jax.tree.map(lambda a: (a.shape, a.dtype), params)

  base = tree()
  for option in options:
    assert tree(**{option: other[option]}) == base, option
