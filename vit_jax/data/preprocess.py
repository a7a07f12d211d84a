"""Pre-processing as configs write it: op lists, presets, one callable.

`input.pp_train` / `input.pp_eval` are one of

  * a preset name, expanded at `input.image_size` (S):

    | preset | ops |
    |---|---|
    | `inception` (pre-training) | `decode|inception_crop(S)|flip_lr|value_range(-1,1)` |
    | `finetune` | `decode|resize(R)|random_crop(S)|flip_lr|value_range(-1,1)`, R = S*448/384 (448 at 384) |
    | `resize` | `decode|resize(S)|value_range(-1,1)` |
    | `eval` | `decode|resize_small(S)|central_crop(S)|value_range(-1,1)` |

  * an op string, ops joined by `|`, each `name` or `name(args)` with Python
    literal arguments: `"decode|inception_crop(224, area_min=0.08)|flip_lr"`;
  * a list of such ops: `["decode", "resize(384)", "value_range(-1, 1)"]`.

The ops are in `vit_jax/data/ops.py`. `decode` directly followed by
`inception_crop` runs as the fused `decode_jpeg_and_inception_crop`, which
decodes only the crop window of a JPEG (same window, ~1.6x faster).
"""

from __future__ import annotations

import ast
from typing import List, Optional, Sequence, Tuple, Union

import tensorflow as tf

from vit_jax.data import ops
from vit_jax.data import randaug  # noqa: F401  (registers its ops)

Spec = Union[str, Sequence[str]]
Parsed = Tuple[str, tuple, dict]

PRESETS = {
    'inception': 'decode|inception_crop({size})|flip_lr|value_range(-1,1)',
    'finetune': ('decode|resize({resize})|random_crop({size})|flip_lr|'
                 'value_range(-1,1)'),
    'resize': 'decode|resize({size})|value_range(-1,1)',
    'eval': ('decode|resize_small({size})|central_crop({size})|'
             'value_range(-1,1)'),
}


def expand(spec: Spec, image_size: int) -> List[str]:
  """The op strings of `spec` (a preset name, op string or op list)."""
  if isinstance(spec, str):
    if spec in PRESETS:
      resize = round(image_size * 448 / 384)
      spec = PRESETS[spec].format(size=image_size, resize=resize)
    items = spec.split('|')
  else:
    items = list(spec)
  items = [s.strip() for s in items if s.strip()]
  if not items:
    raise ValueError(f'empty pre-processing spec {spec!r}')
  return items


def parse_op(text: str) -> Parsed:
  """`"resize(224, method='nearest')"` -> ('resize', (224,), {'method': ...})."""
  try:
    node = ast.parse(text, mode='eval').body
    if isinstance(node, ast.Name):
      return node.id, (), {}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
      args = tuple(ast.literal_eval(a) for a in node.args)
      kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
      return node.func.id, args, kwargs
  except (SyntaxError, ValueError):
    pass
  raise ValueError(f'cannot parse pre-processing op {text!r}: write name or '
                   'name(args) with literal arguments, e.g. resize(224)')


def _fuse(parsed: List[Parsed]) -> List[Parsed]:
  """decode + inception_crop -> decode_jpeg_and_inception_crop."""
  out: List[Parsed] = []
  for op in parsed:
    if out and out[-1][0] == 'decode' and op[0] == 'inception_crop':
      _, dargs, dkwargs = out.pop()
      channels = dargs[0] if dargs else dkwargs.get('channels', 3)
      if not channels:  # Fusion needs a known channel count.
        out.extend([('decode', dargs, dkwargs), op])
        continue
      out.append(('decode_jpeg_and_inception_crop', op[1],
                  {**op[2], 'channels': channels}))
    else:
      out.append(op)
  return out


class Preprocess:
  """`pp(features, seed)`: the ops of a spec, in order.

  `seed` (shape [2] integers) is split into one seed per random op; with
  `seed=None` random ops get a fixed seed. `ops` lists the op names run.
  """

  def __init__(self, spec: Spec, image_size: int):
    parsed = _fuse([parse_op(s) for s in expand(spec, image_size)])
    self.ops = [name for name, _, _ in parsed]
    self._fns = [ops.make(name, *args, **kwargs)
                 for name, args, kwargs in parsed]
    for i, name in enumerate(self.ops):
      if ops.needs_pixels(name) and 'value_range' in self.ops[:i]:
        raise ValueError(
            f'pre-processing op {name} comes after value_range, but it works '
            'on [0, 255] pixel values (it would clip [-1, 1] images to '
            f'[0, 1]): put it before value_range, e.g. '
            f'...|flip_lr|{name}(...)|value_range(-1,1)')
    self._random = [ops.is_random(name) for name in self.ops]

  def __call__(self, features: ops.Features,
               seed: Optional[tf.Tensor] = None) -> ops.Features:
    if seed is None:
      seed = tf.constant([0, 0], tf.int64)
    num_random = sum(self._random)
    seeds = (tf.random.experimental.stateless_split(seed, num_random)
             if num_random else None)
    i = 0
    for fn, is_random in zip(self._fns, self._random):
      if is_random:
        features = fn(features, seeds[i])
        i += 1
      else:
        features = fn(features, None)
    return features


def build(spec: Spec, image_size: int) -> Preprocess:
  """The pre-processing callable of `spec` at `image_size`."""
  return Preprocess(spec, image_size)
