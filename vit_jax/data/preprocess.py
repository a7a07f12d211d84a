"""Pre-processing as configs write it: op lists, presets, one callable.

`input.pp_train` / `input.pp_eval` are one of

  * a preset name, expanded at `input.image_size` (S):

    | preset | ops |
    |---|---|
    | `inception` (pre-training) | `decode|inception_crop(S)|flip_lr|value_range(-1,1)` |
    | `finetune` | `decode|resize(R)|random_crop(S)|flip_lr|value_range(-1,1)`, R = S*448/384 (448 at 384) |
    | `resize` | `decode|resize(S)|value_range(-1,1)` |
    | `eval` | `decode|resize_small(S)|central_crop(S)|value_range(-1,1)` (bilinear; big_vision's resize_small is `method='area'`) |

  * an op string, ops joined by `|`, each `name` or `name(args)` with Python
    literal arguments or fractions of two numbers (`4/3`):
    `"decode|inception_crop(224, area_min=0.08, aspect_max=4/3)|flip_lr"`
    (strings quoted: `resize(224, method='area')`; a bare name is refused
    with that hint);
  * a list of such ops: `["decode", "resize(384)", "value_range(-1, 1)"]`.

Surrounding spaces are ignored (`' inception'`), and a one-item list naming
a preset (`['inception']`) is that preset; a preset among other ops is an
error (write its ops out).

The ops are in `vit_jax/data/ops.py`. `decode` directly followed by
`inception_crop` runs as the fused `decode_jpeg_and_inception_crop`, which
decodes only the crop window of a JPEG (same window, ~1.6x faster).
"""

from __future__ import annotations

import ast
import inspect
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


def _preset(spec: Spec) -> Optional[str]:
  """The preset `spec` names (`' inception '`, `['inception']`), or None."""
  if isinstance(spec, str):
    name = spec.strip()
  elif len(spec) == 1 and isinstance(spec[0], str):
    name = spec[0].strip()
  else:
    return None
  return name if name in PRESETS else None


def _preset_ops(name: str, image_size: int) -> str:
  return PRESETS[name].format(size=image_size,
                              resize=round(image_size * 448 / 384))


def expand(spec: Spec, image_size: int) -> List[str]:
  """The op strings of `spec` (a preset name, op string or op list)."""
  preset = _preset(spec)
  if preset is not None:
    spec = _preset_ops(preset, image_size)
  items = spec.split('|') if isinstance(spec, str) else list(spec)
  items = [s.strip() for s in items if s.strip()]
  if not items:
    raise ValueError(f'empty pre-processing spec {spec!r}')
  for item in items:
    if item in PRESETS and item not in ops.names():
      raise ValueError(
          f'pre-processing spec {spec!r}: {item!r} is a preset, which must be '
          'the whole spec; to combine it with other ops write its ops out '
          f'({_preset_ops(item, image_size)!r} at image_size={image_size})')
  return items


def _number(node: ast.AST) -> Union[int, float]:
  """A numeric literal, signed or not (`3`, `-0.5`); else ValueError."""
  value = ast.literal_eval(node)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ValueError(f'not a number: {ast.unparse(node)}')
  return value


def _argument(node: ast.AST):
  """A Python literal, or a fraction of two numeric literals (`4/3`,
  `1/0.3`, `-1/3`): the arguments that op signatures show. Nothing else is
  evaluated (no names, calls or other operators)."""
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
    numerator, denominator = _number(node.left), _number(node.right)
    if denominator == 0:
      raise ValueError(f'division by zero: {ast.unparse(node)}')
    return numerator / denominator
  if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
      and isinstance(node.operand, ast.BinOp)):  # -(4/3), -4/3 parses above.
    return -_argument(node.operand)
  return ast.literal_eval(node)


def _check_no_bare_names(call: ast.Call) -> None:
  """A bare name as an argument (`method=bicubic`) is almost always a string
  missing its quotes: say so, with the quoted form."""
  named = [(None, a) for a in call.args] + [(k.arg, k.value)
                                            for k in call.keywords]
  for keyword, node in named:
    if isinstance(node, ast.Name):
      quoted = f"{keyword + '=' if keyword else ''}'{node.id}'"
      raise ValueError(f'{node.id} is a bare name, not a literal: if it is '
                       f'a string, quote it: {quoted}')


def parse_op(text: str) -> Parsed:
  """`"resize(224, method='nearest')"` -> ('resize', (224,), {'method': ...}).

  Arguments are Python literals or fractions of two numbers (`4/3`).
  """
  problem = ''
  try:
    node = ast.parse(text.strip(), mode='eval').body
    if isinstance(node, ast.Name):
      return node.id, (), {}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
      if any(isinstance(a, ast.Starred) for a in node.args) or any(
          k.arg is None for k in node.keywords):
        raise ValueError('no *args or **kwargs')
      _check_no_bare_names(node)
      args = tuple(_argument(a) for a in node.args)
      kwargs = {k.arg: _argument(k.value) for k in node.keywords}
      return node.func.id, args, kwargs
  except (SyntaxError, ValueError, TypeError) as e:
    problem = f' ({e})'
  raise ValueError(f'cannot parse pre-processing op {text!r}{problem}: write '
                   'name or name(args) with literal arguments (numbers, '
                   'strings, fractions such as 4/3), e.g. resize(224) or '
                   'inception_crop(224, aspect_max=4/3)')


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


# What `output_range` returns: (in_min, in_max, vmin, vmax) of the last
# value_range op; (0, 255, 0, 255) where pixels keep their decoded values.
ValueMap = Tuple[float, float, float, float]
PIXELS: ValueMap = (0.0, 255.0, 0.0, 255.0)
# value_range(-1, 1): the models' usual inputs (public checkpoints, presets).
MINUS_ONE_TO_ONE: ValueMap = (0.0, 255.0, -1.0, 1.0)


def output_range(spec: Spec, image_size: int) -> Optional[ValueMap]:
  """How `spec` maps decoded [0, 255] pixel values: (in_min, in_max, vmin,
  vmax) of its last `value_range` op (its defaults filled in), `PIXELS`
  where it has none, or None where that is unknown (an op registered
  outside this package comes after the last value_range, or with none at
  all: it may rescale the pixels itself).

  Read from the op strings only, without building or running the ops.
  """
  parsed = [parse_op(s) for s in expand(spec, image_size)]
  value_map = PIXELS
  for name, args, kwargs in parsed:
    if name == 'value_range':
      bound = inspect.signature(ops.value_range).bind(*args, **kwargs)
      bound.apply_defaults()
      a = bound.arguments
      value_map = tuple(float(a[k]) for k in ('in_min', 'in_max', 'vmin',
                                               'vmax'))
    elif name in ops.names() and not ops.is_builtin(name):
      value_map = None
  return value_map


def describe_range(value_map: ValueMap) -> str:
  """'[-1, 1] (value_range(-1, 1))' or '[0, 255] pixel values (no
  value_range)', for error messages."""
  if value_map == PIXELS:
    return '[0, 255] pixel values (no value_range op)'
  _, _, vmin, vmax = value_map
  return f'[{vmin:g}, {vmax:g}] ({value_range_op(value_map)})'


def value_range_op(value_map: ValueMap) -> str:
  """The op making `value_map`: 'value_range(-1, 1)', with in_min / in_max
  where they are not 0 / 255."""
  in_min, in_max, vmin, vmax = value_map
  extra = ('' if (in_min, in_max) == (0, 255)
           else f', in_min={in_min:g}, in_max={in_max:g}')
  return f'value_range({vmin:g}, {vmax:g}{extra})'


def build(spec: Spec, image_size: int) -> Preprocess:
  """The pre-processing callable of `spec` at `image_size`."""
  return Preprocess(spec, image_size)
