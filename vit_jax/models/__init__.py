"""The model zoo: `create("ViT-B/16", num_classes=1000)` returns a flax Module.

Every model maps NHWC float images in [-1, 1] to float32 logits:

    model = vit_jax.models.create("ViT-B/16", num_classes=10)
    params = model.init(jax.random.key(0), images)["params"]
    logits = model.apply({"params": params}, images, train=False)

`python -m vit_jax.models` prints every name with its parameter count and
forward GFLOPs at 224x224.
"""

from __future__ import annotations

import difflib
from typing import Any, Dict

import flax.linen as nn

from vit_jax.models.resnet import BiT
from vit_jax.models.vit import VisionTransformer

# Table 1 of the paper, plus the Ti and S widths of the public checkpoints.
_WIDTHS = {
    # width: (hidden_size, mlp_dim, num_heads, num_layers)
    'Ti': (192, 768, 3, 12),
    'S': (384, 1536, 6, 12),
    'B': (768, 3072, 12, 12),
    'L': (1024, 4096, 16, 24),
    'H': (1280, 5120, 16, 32),
}


def _vit(width: str, patch: int, **extra) -> Dict[str, Any]:
  hidden, mlp, heads, layers = _WIDTHS[width]
  return dict(cls=VisionTransformer, patch_size=patch, hidden_size=hidden,
              mlp_dim=mlp, num_heads=heads, num_layers=layers, **extra)


def _hybrid(width: str, patch: int) -> Dict[str, Any]:
  # /16: stage 4 dropped and stage 3 extended -> a 1/16 map; /32: full R50.
  layers = (3, 4, 9) if patch == 16 else (3, 4, 6, 3)
  return _vit(width, 1, resnet_layers=layers, resnet_width=1.0)


def _bit(depth: int, width: int) -> Dict[str, Any]:
  return dict(cls=BiT, depth=depth, width_factor=float(width))


VARIANTS: Dict[str, Dict[str, Any]] = {
    'ViT-Ti/16': _vit('Ti', 16),
    'ViT-S/16': _vit('S', 16),
    'ViT-S/32': _vit('S', 32),
    'ViT-B/32': _vit('B', 32),
    'ViT-B/16': _vit('B', 16),
    'ViT-B/8': _vit('B', 8),
    'ViT-L/32': _vit('L', 32),
    'ViT-L/16': _vit('L', 16),
    'ViT-H/14': _vit('H', 14),
    'R50+ViT-B/16': _hybrid('B', 16),
    'R50+ViT-B/32': _hybrid('B', 32),
    'R50+ViT-L/32': _hybrid('L', 32),
    'R50+ViT-L/16': _hybrid('L', 16),
    'BiT-R50x1': _bit(50, 1),
    'BiT-R50x2': _bit(50, 2),
    'BiT-R101x1': _bit(101, 1),
    'BiT-R152x1': _bit(152, 1),
    'BiT-R152x2': _bit(152, 2),
    'BiT-R200x3': _bit(200, 3),
    # A tiny ViT for CPU smoke runs (28x28 images give a 7x7 grid).
    'ViT-test': dict(cls=VisionTransformer, patch_size=4, hidden_size=32,
                     mlp_dim=64, num_heads=2, num_layers=2),
}


def names():
  """All model names, in the zoo's order."""
  return list(VARIANTS)


def spec(name: str) -> Dict[str, Any]:
  """The keyword arguments `create(name)` passes to the module class."""
  if name not in VARIANTS:
    close = difflib.get_close_matches(name, VARIANTS, n=3)
    hint = f' Did you mean {close}?' if close else ''
    raise ValueError(f'unknown model name {name!r}.{hint} '
                     f'Known names: {", ".join(VARIANTS)}')
  return dict(VARIANTS[name])


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


def from_config(model_config, num_classes: int) -> nn.Module:
  """The model a config's `model` field describes: `name` plus options
  (None = the variant's default; `dtype` / `param_dtype` by name)."""
  import jax.numpy as jnp
  kw = dict(model_config)
  name = kw.pop('name')
  for key in ('dtype', 'param_dtype'):
    if kw.get(key):
      kw[key] = jnp.dtype(kw[key])
  return create(name, num_classes=num_classes,
                **{k: v for k, v in kw.items() if v is not None})
