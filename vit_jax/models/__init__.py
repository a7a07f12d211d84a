"""The model zoo: `create("ViT-B/16", num_classes=1000)` returns a flax Module.

Every model maps NHWC float images in [-1, 1] to float32 logits:

    model = vit_jax.models.create("ViT-B/16", num_classes=10)
    params = model.init(jax.random.key(0), images)["params"]
    logits = model.apply({"params": params}, images, train=False)

`python -m vit_jax.models` prints every name with its parameter count and
forward GFLOPs at 224x224. A new family registers itself with `register`
(see `registry.py` and docs/models.md).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

# Registration order is the zoo's order: ViT, hybrids, BiT, Mixer.
from vit_jax.models import vit, hybrid, bit, mixer  # noqa: F401 (registration)
from vit_jax.models import attention
from vit_jax.models.bit import BiT
from vit_jax.models.inputs import patch_grid
from vit_jax.models.partitioning import Module, with_axes
from vit_jax.models.registry import (VARIANTS, Family, family, names,
                                     option_names, options, register, spec)
from vit_jax.models.vit import VisionTransformer

# A tiny ViT for CPU smoke runs (28x28 images give a 7x7 grid).
register(vit.FAMILY, {'ViT-test': dict(patch_size=4, hidden_size=32,
                                       mlp_dim=64, num_heads=2,
                                       num_layers=2)})

__all__ = ['BiT', 'Family', 'Module', 'VARIANTS', 'VisionTransformer',
           'create', 'family', 'from_config', 'names', 'option_names',
           'options', 'patch_grid', 'register', 'spec', 'with_axes']


def create(name: str, num_classes: int | None = 1000, **overrides) -> nn.Module:
  """Builds the named model; `overrides` replace any module attribute.

  E.g. `create("ViT-B/16", num_classes=10, dtype=jnp.bfloat16,
  representation_size=768, classifier="gap", dropout_rate=0.1)`.
  """
  kwargs = spec(name)
  cls = kwargs.pop('cls')
  kwargs.update(overrides)
  fields = set(cls.__dataclass_fields__) - {'parent', 'name'}
  unknown = sorted(set(kwargs) - fields)
  if unknown:
    raise ValueError(f'{name} ({cls.__name__}) has no option(s) {unknown}; '
                     f'valid options: {sorted(fields - {"num_classes"})}')
  return cls(num_classes=num_classes, **kwargs)


def from_config(model_config, num_classes: int,
                platform: str | None = None) -> nn.Module:
  """The model a config's `model` field describes: `name` plus options
  (None = the variant's default; `dtype` / `param_dtype` by name).

  `platform` is where the model will run ("cpu", "gpu", "tpu": the mesh's
  devices, or an export target); it turns `attention_impl="auto"` (the
  default) into cuDNN flash attention for half-precision GPU models and XLA's
  attention elsewhere. None: XLA's.
  """
  kw = dict(model_config)
  name = kw.pop('name')
  for key in ('dtype', 'param_dtype'):
    if kw.get(key):
      kw[key] = jnp.dtype(kw[key])
  if 'attention_impl' in spec(name)['cls'].__dataclass_fields__:
    kw['attention_impl'] = attention.resolve(
        kw.get('attention_impl'), platform or 'cpu',
        kw.get('dtype') or jnp.float32)
  return create(name, num_classes=num_classes,
                **{k: v for k, v in kw.items() if v is not None})
