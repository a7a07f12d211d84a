"""The corruption of masked patch prediction (BERT's recipe on patches).

`rate` of the patch positions of each image are selected (exactly
`floor(rate * N + 0.5)` per image, at least one, uniformly at random); each
selected position is independently replaced by the `[mask]` embedding (80%),
by the embedding of a random other patch of the same image (10%: uniform
over its other N - 1 patches, never itself; an image of one patch keeps it)
or left unchanged (10%). Unselected positions are never changed.

The "other patch" comes from the same image so that the corruption is local
to each image: with the batch sharded over devices, every device corrupts
its own rows without communication, and its memory does not grow with the
global batch (drawing from the whole batch gathered every device's patch
embeddings onto each device: 5 GB per device at ViT-B/16, batch 4096;
docs/selfsup.md).
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

MASK, RANDOM = 0.8, 0.1  # The rest (0.1) of selected positions: unchanged.


def check_rate(rate: float) -> None:
  if not 0.0 < rate <= 1.0:
    raise ValueError(f'rate={rate!r}: expected the fraction of patches to '
                     'select, in (0, 1] (the paper uses 0.5; BERT 0.15)')


def num_selected(num_patches: int, rate: float) -> int:
  """Positions selected per image: floor(rate * N + 0.5) (halves round
  up, unlike Python's round), at least one."""
  check_rate(rate)
  return min(num_patches, max(1, int(rate * num_patches + 0.5)))


def corrupt(rng: jax.Array, tokens: jax.Array, mask_token: jax.Array,
            rate: float = 0.5) -> Tuple[jax.Array, jax.Array]:
  """(corrupted tokens, bool (batch, N) selection) of `tokens` (batch, N, D).

  A pure function of `rng`: the same key gives the same corruption.
  """
  if tokens.ndim != 3 or mask_token.shape != tokens.shape[-1:]:
    raise ValueError(f'tokens must be (batch, N, D) and mask_token (D,), got '
                     f'{tuple(tokens.shape)} and {tuple(mask_token.shape)}')
  b, n, _ = tokens.shape
  k = num_selected(n, rate)
  r_select, r_kind, r_other = jax.random.split(rng, 3)
  order = jnp.argsort(jax.random.uniform(r_select, (b, n)), axis=1)[:, :k]
  selected = jnp.zeros((b, n), bool).at[
      jnp.arange(b)[:, None], order].set(True)
  kind = jax.random.uniform(r_kind, (b, n))
  use_mask = selected & (kind < MASK)
  use_other = selected & (kind >= MASK) & (kind < MASK + RANDOM)
  out = jnp.where(use_mask[..., None], mask_token.astype(tokens.dtype)[None,
                                                                       None],
                  tokens)
  if n > 1:
    # A uniform index over the image's other n - 1 patches; a gather along
    # the patch axis only, local to each (possibly sharded) batch row.
    other = jax.random.randint(r_other, (b, n), 0, n - 1)
    other = other + (other >= jnp.arange(n)[None])
    swapped = jnp.take_along_axis(tokens, other[..., None], axis=1)
    out = jnp.where(use_other[..., None], swapped, out)
  return out, selected
