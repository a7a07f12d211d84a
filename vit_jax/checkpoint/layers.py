"""Converting between the unrolled and the scanned encoder layouts.

Unrolled (the public checkpoints, `scan_layers=False`):
    Transformer/encoderblock_0/LayerNorm_0/scale   (D,)
    Transformer/encoderblock_1/LayerNorm_0/scale   (D,) ...
Scanned (`scan_layers=True`): one subtree with a leading layer axis:
    Transformer/encoderblock/LayerNorm_0/scale     (L, D)
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from vit_jax.checkpoint.errors import CheckpointError

_BLOCK = re.compile(r'^encoderblock_(\d+)$')


def is_scanned(params: Mapping[str, Any]) -> bool:
  return 'encoderblock' in params.get('Transformer', {})


def stack_blocks(params: Mapping[str, Any]) -> dict:
  """Unrolled -> scanned layout (no-op when already scanned)."""
  if is_scanned(params):
    return dict(params)
  enc = dict(params['Transformer'])
  idx = sorted(int(_BLOCK.match(k).group(1)) for k in enc if _BLOCK.match(k))
  if idx != list(range(len(idx))) or not idx:
    raise CheckpointError(f'encoder blocks are not numbered 0..L-1: {idx}')
  blocks = [enc.pop(f'encoderblock_{i}') for i in idx]
  enc['encoderblock'] = _tree_map(lambda *xs: np.stack(xs), *blocks)
  return {**params, 'Transformer': enc}


def unstack_blocks(params: Mapping[str, Any]) -> dict:
  """Scanned -> unrolled layout (no-op when already unrolled)."""
  if not is_scanned(params):
    return dict(params)
  enc = dict(params['Transformer'])
  stacked = enc.pop('encoderblock')
  n = len(next(iter(_leaves(stacked))))
  for i in range(n):
    enc[f'encoderblock_{i}'] = _tree_map(lambda x, i=i: np.asarray(x[i]),
                                         stacked)
  return {**params, 'Transformer': enc}


def _tree_map(fn, *trees):
  if isinstance(trees[0], Mapping):
    return {k: _tree_map(fn, *(t[k] for t in trees)) for k in trees[0]}
  return fn(*trees)


def _leaves(tree):
  if isinstance(tree, Mapping):
    for v in tree.values():
      yield from _leaves(v)
  else:
    yield tree
