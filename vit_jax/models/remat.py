"""Rematerialisation (gradient checkpointing) policies, by name.

`remat` on a model is False / None (keep every activation for the backward
pass), True (= "nothing_saveable": recompute each block's forward in the
backward pass) or one of POLICIES, a `jax.checkpoint_policies` member that
says which intermediate values of a block are kept instead of recomputed.
docs/performance.md has their measured memory and speed.
"""

from __future__ import annotations

import jax

from vit_jax.models import matmul

POLICIES = (
    'nothing_saveable',  # Keep only each block's input: least memory.
    'dots_with_no_batch_dims_saveable',  # Keep the dense layers' outputs.
    'dots_saveable',  # Keep every matmul output (also attention's).
    'everything_saveable',  # Keep everything: remat's structure, no saving.
)


def check(remat) -> None:
  if remat in (None, False, True) or remat in POLICIES:
    return
  raise ValueError(f'remat={remat!r}: expected False, True (= '
                   f'"nothing_saveable") or a policy name: '
                   f'{", ".join(POLICIES)}')


def policy(remat):
  """The `jax.checkpoint` policy for a model's `remat` value (None: no remat
  when `remat` is falsy; see `enabled`).

  The dots policies also keep the bf16 products and the float32 dense ones
  of `matmul.dot_general`, which jax's own policies cannot see inside its
  custom VJP.
  """
  check(remat)
  name = 'nothing_saveable' if remat is True else remat
  if not name:
    return None
  cp = jax.checkpoint_policies
  named = {'dots_saveable': (matmul.NAME, matmul.BATCHED_NAME),
           'dots_with_no_batch_dims_saveable': (matmul.NAME,)}.get(name)
  base = getattr(cp, name)
  if named:
    return cp.save_from_both_policies(base, cp.save_only_these_names(*named))
  return base


def enabled(remat) -> bool:
  check(remat)
  return bool(remat)
