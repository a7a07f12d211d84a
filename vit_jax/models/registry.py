"""The open registry of model families and their named variants.

A family is a flax module class plus the two facts about it the rest of the
framework needs without building it:
  * `flops(spec, height, width, num_classes)`: analytic forward FLOPs per
    image (matmuls and convolutions, multiply-add = 2) of the module built
    with keyword arguments `spec`; `accounting` cross-checks XLA with it;
  * `shrink(spec) -> (overrides, image_size)`: module options that make a
    tiny member of the family (seconds on a CPU) and an image size it takes;
    the `smoke` configs use it.
The module derives from `partitioning.Module` (`models.Module`); parameter
sharding needs no entry: it comes from the logical-axis annotations in the
module (`partitioning.with_axes`, read by `vit_jax.sharding`).

    registry.register(Family('MyNet', MyNet, my_flops, my_shrink),
                      {'MyNet-S': dict(width=64), 'MyNet-L': dict(width=256)})
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
from typing import Any, Callable, Dict, List, Mapping, Tuple

from vit_jax import registration
from vit_jax.models.partitioning import Module

Spec = Dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family: its module class, FLOP count and smoke shrinking."""
  name: str
  module: type  # A flax.linen.Module subclass taking `num_classes`.
  flops: Callable[[Spec, int, int, int], float]
  shrink: Callable[[Spec], Tuple[Spec, int]]


# Module options that change how a model computes, not its parameters or
# the function it computes (up to rounding): a run may resume with other
# values (e.g. `remat` after moving to smaller devices; the change is
# logged). `scan_layers` and `param_dtype` are not: they change the saved
# arrays.
COMPUTE_OPTIONS = ('dtype', 'attention_impl', 'remat', 'recompute_internals')

# name -> the module's keyword arguments, plus `cls` (the module class).
VARIANTS: Dict[str, Spec] = {}
_FAMILY: Dict[str, Family] = {}


def register(family: Family, variants: Mapping[str, Mapping[str, Any]]
             ) -> None:
  """Adds `variants` (name -> module keyword arguments) of `family`."""
  if not (isinstance(family.module, type)
          and issubclass(family.module, Module)):
    raise TypeError(f'family {family.name}: {family.module!r} must derive '
                    'from vit_jax.models.Module (flax linen, `init` returning '
                    'plain arrays): write `class MyNet(models.Module)`')
  fields = set(family.module.__dataclass_fields__)
  if 'num_classes' not in fields:
    raise TypeError(f'family {family.name}: {family.module.__name__} needs a '
                    '`num_classes` attribute (0 or None: no head)')
  for name, kwargs in variants.items():
    if name in VARIANTS and not _registered_again(name, family, kwargs):
      raise ValueError(f'model name {name!r} is already registered (family '
                       f'{_FAMILY[name].name}); choose another name')
    unknown = sorted(set(kwargs) - fields)
    if unknown:
      raise ValueError(f'variant {name!r} of family {family.name} sets '
                       f'{unknown}, which {family.module.__name__} does not '
                       'have')
  for name, kwargs in variants.items():
    VARIANTS[name] = dict(cls=family.module, **kwargs)
    _FAMILY[name] = family


def _registered_again(name: str, family: Family,
                      kwargs: Mapping[str, Any]) -> bool:
  """Whether variant `name` of `family` is the registered one, its
  definition run again (a config file runs twice: `vit_jax.registration`)."""
  first = _FAMILY[name]
  spec = {k: v for k, v in VARIANTS[name].items() if k != 'cls'}
  return (first.name == family.name and spec == dict(kwargs) and
          registration.same_definition(first.module, family.module))


def names() -> List[str]:
  """All model names, in registration order."""
  return list(VARIANTS)


def option_names() -> List[str]:
  """Every module option of every registered family (what `create` may
  override), sorted."""
  fields = set()
  for kw in VARIANTS.values():
    fields |= set(kw['cls'].__dataclass_fields__)
  return sorted(fields - {'parent', 'name', 'num_classes'})


def _check(name: str) -> None:
  if name not in VARIANTS:
    close = difflib.get_close_matches(name, VARIANTS, n=3)
    hint = f' Did you mean {close}?' if close else ''
    raise ValueError(f'unknown model name {name!r}.{hint} '
                     f'Known names: {", ".join(VARIANTS)}')


def spec(name: str) -> Spec:
  """The keyword arguments `create(name)` passes to the module class, with
  the class under `cls`."""
  _check(name)
  return dict(VARIANTS[name])


def family(name: str) -> Family:
  """The family a model name belongs to."""
  _check(name)
  return _FAMILY[name]


def options(name: str, **overrides) -> Spec:
  """The module keyword arguments of `name` with `overrides` (no `cls`)."""
  kw = spec(name)
  del kw['cls']
  kw.update(overrides)
  return kw


def parse_option(text: str):
  """A model option's value from command-line text: True / False / None, a
  number, a tuple (`resnet_layers=(1,1,1)`; a list gives a tuple too), or
  the string itself (`--model_option=remat=dots_saveable`)."""
  named = {'true': True, 'false': False, 'none': None}
  if text.lower() in named:
    return named[text.lower()]
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text
  if isinstance(value, list):
    value = tuple(value)
  if isinstance(value, (int, float, tuple)) and not isinstance(value, bool):
    return value
  return text
