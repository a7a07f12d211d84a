"""Per-parameter learning rates and freezing, by regex on parameter paths.

Parameter paths are the '/'-joined names of the params tree, e.g.
`Transformer/encoderblock_3/MlpBlock_0/Dense_0/kernel` (`encoderblock/...`
with `scan_layers`). `config.optim` fields:

  frozen       regex; matching parameters are never updated and get no
               optimiser state (a linear probe by gradient descent:
               `frozen='^(?!head/)'` trains only the head)
  lr_mults     ((regex, multiplier), ...): the first match scales that
               parameter's learning rate (its update; with AdamW also its
               decoupled weight decay, which follows the learning rate)
  layer_decay  MAE / BEiT layer-wise decay d: encoder block i of L gets
               d ** (L - i), the patch/position embeddings and class token
               d ** (L + 1), the final norm and head 1; multiplies lr_mults
  schedules    ((regex, {lr, warmup_steps, decay, linear_end}), ...): the
               first match gives that parameter a schedule of its own (the
               fields it names replace optim's; big_vision's `schedule`
               list), e.g. a head without warm-up beside a warmed-up body:
               (('^head/', {'warmup_steps': 0}),). Each group gets its own
               optimiser state; unmatched parameters keep optim's schedule

Gradient clipping and the optimiser see only the trained parameters. A
regex that matches no parameter is an error naming it (a typo would
otherwise silently train everything).
"""

from __future__ import annotations

import re
from typing import Dict, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

# Parameters below the encoder blocks, for `layer_decay`.
_EMBEDDING = re.compile(r'^(embedding|cls|conv_root|gn_root|block\d+|'
                        r'Transformer/posembed_input)(/|$)')
_BLOCK = re.compile(r'^Transformer/encoderblock(_(\d+))?/')


# What a `schedules` entry may set (the rest of optim is shared).
SCHEDULE_FIELDS = ('lr', 'warmup_steps', 'decay', 'linear_end')
DEFAULT_GROUP = 'default'


class ParamGroupError(ValueError):
  """An `optim.frozen` / `lr_mults` / `layer_decay` / `schedules` setting
  that does not fit the model's parameters (the message names it)."""


def enabled(cfg) -> bool:
  return bool(cfg.get('frozen') or cfg.get('lr_mults') or
              cfg.get('layer_decay') or cfg.get('schedules'))


def schedule_groups(cfg) -> Tuple[Tuple[str, Dict[str, object]], ...]:
  """`optim.schedules` as ((regex, overrides), ...), checked."""
  out = []
  for entry in cfg.get('schedules') or ():
    try:
      rx, over = entry
      over = dict(over)
    except (TypeError, ValueError):
      raise ParamGroupError(
          f'optim.schedules entry {entry!r}: expected (regex, dict of '
          f'{", ".join(SCHEDULE_FIELDS)}), e.g. '
          "('^head/', {'warmup_steps': 0})") from None
    bad = sorted(set(over) - set(SCHEDULE_FIELDS))
    if bad or not over:
      raise ParamGroupError(
          f'optim.schedules entry {rx!r}: {bad or "no fields"}; a group '
          f'schedule sets some of {", ".join(SCHEDULE_FIELDS)}')
    re.compile(rx)
    out.append((rx, over))
  return tuple(out)


def group_name(i: int) -> str:
  return f'schedule{i}'


def schedule_labels(groups):
  """A function params -> tree of group names (first matching regex;
  `DEFAULT_GROUP` for the rest), for `optax.multi_transform`. A regex that
  matches no (trained) parameter is an error."""
  rxs = [re.compile(rx) for rx, _ in groups]

  def labels(params):
    # Dict traversal, like `trainable`: leaves may be placeholders (optax's
    # tree_map_params) or MaskedNodes (frozen parameters), not arrays.
    paths = _paths(params)
    flat = {k: next((group_name(i) for i, rx in enumerate(rxs)
                     if rx.search(p)), DEFAULT_GROUP)
            for k, p in paths.items()}
    trained = {k for k, v in traverse_util.flatten_dict(params).items()
               if not isinstance(v, optax.MaskedNode)}
    used = {flat[k] for k in trained}
    unused = [rx for i, (rx, _) in enumerate(groups)
              if group_name(i) not in used]
    if unused:
      raise ParamGroupError(
          f'optim.schedules regex(es) {unused} match no trained parameter '
          '(or an earlier entry takes them); paths look like '
          f'{sorted(paths.values())[:3]}')
    return traverse_util.unflatten_dict(flat)
  return labels


def _paths(params) -> Dict[Tuple[str, ...], str]:
  return {k: '/'.join(k) for k in traverse_util.flatten_dict(params)}


def trainable(params, frozen: str):
  """Tree of bools: False where the path matches `frozen`."""
  paths = _paths(params)
  rx = re.compile(frozen)
  flags = {k: not rx.search(p) for k, p in paths.items()}
  if all(flags.values()):
    raise ParamGroupError(f'optim.frozen={frozen!r} matches no parameter; '
                          f'paths look like {sorted(paths.values())[:3]}')
  if not any(flags.values()):
    raise ParamGroupError(f'optim.frozen={frozen!r} matches every '
                          'parameter: nothing would train')
  return traverse_util.unflatten_dict(flags)


class Multipliers:
  """`mult(path, ndim)`: the learning-rate multiplier of one parameter (a
  float, or an (L, 1, ...) array for scanned blocks under layer_decay).
  Built from the params tree, whose regexes it checks."""

  def __init__(self, params, lr_mults: Sequence[Tuple[str, float]] = (),
               layer_decay: float = 0.0):
    flat = traverse_util.flatten_dict(params)
    paths = {'/'.join(k): v for k, v in flat.items()}
    # Under optim.frozen this sees the trained parameters only: the frozen
    # ones are optax MaskedNodes (no array, never updated).
    trained = {p: v for p, v in paths.items()
               if not isinstance(v, optax.MaskedNode)}
    self.rules = [(re.compile(rx), float(m)) for rx, m in lr_mults]
    unused = [rx for rx, _ in lr_mults
              if not any(re.search(rx, p) for p in trained)]
    if unused:
      raise ParamGroupError(
          f'optim.lr_mults regex(es) {unused} match no trained parameter '
          '(frozen ones never move); paths look like '
          f'{sorted(trained)[:3]}')
    self.decay = float(layer_decay)
    blocks = [_BLOCK.match(p) for p in paths]
    scanned = [np.shape(v)[0] for p, v in trained.items()
               if (m := _BLOCK.match(p)) and m.group(2) is None]
    unrolled = [int(m.group(2)) for m in blocks if m and m.group(2)]
    self.layers = (int(scanned[0]) if scanned else
                   max(unrolled) + 1 if unrolled else 0)
    if self.decay and not self.layers:
      raise ParamGroupError(
          'optim.layer_decay needs trained encoder blocks '
          '(Transformer/encoderblock...): a ViT or hybrid whose blocks are '
          'not all frozen (optim.frozen); else use optim.lr_mults')
    if self.decay and not 0 < self.decay <= 1:
      raise ParamGroupError(
          f'optim.layer_decay={self.decay}: a factor in (0, 1] (MAE / BEiT '
          'fine-tuning: 0.65-0.75)')

  def __call__(self, path: str, ndim: int):
    mult = next((m for rx, m in self.rules if rx.search(path)), 1.0)
    if not self.decay:
      return mult
    block = _BLOCK.match(path)
    if block and block.group(2) is not None:
      return mult * self.decay ** (self.layers - int(block.group(2)))
    if block:  # Scanned: one multiplier per layer on the leading axis.
      per_layer = self.decay ** (self.layers - np.arange(self.layers))
      return (mult * per_layer).reshape(
          (self.layers,) + (1,) * (ndim - 1)).astype(np.float32)
    if _EMBEDDING.match(path):
      return mult * self.decay ** (self.layers + 1)
    return mult


def _path(keys) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'name', k)))
                  for k in keys)


def scale_by_multipliers(lr_mults, layer_decay
                         ) -> optax.GradientTransformation:
  """Multiplies each update by its parameter's multiplier (no state: the
  multipliers are fixed by the parameter paths seen at `init`)."""
  built = {}

  def init(params):
    built['fn'] = Multipliers(params, lr_mults, layer_decay)
    return optax.EmptyState()

  def update(updates, state, params=None):
    fn = built['fn']
    out = jax.tree_util.tree_map_with_path(
        lambda keys, u: u * jnp.asarray(fn(_path(keys), u.ndim), u.dtype),
        updates)
    return out, state

  return optax.GradientTransformation(init, update)


def wrap(tx: optax.GradientTransformation, cfg) -> optax.GradientTransformation:
  """`tx` with `cfg`'s multipliers and frozen parameters applied."""
  lr_mults = tuple(tuple(x) for x in (cfg.get('lr_mults') or ()))
  decay = float(cfg.get('layer_decay') or 0.0)
  if lr_mults or decay:
    tx = optax.chain(tx, scale_by_multipliers(lr_mults, decay))
  frozen = cfg.get('frozen')
  if not frozen:
    return tx
  labels = lambda params: jax.tree.map(
      lambda t: 'train' if t else 'frozen', trainable(params, frozen))
  return optax.multi_transform({'train': tx, 'frozen': optax.set_to_zero()},
                               labels)
