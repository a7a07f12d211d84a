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

Training draws one key per step (`corrupt`). The held-out evaluation draws
one key per image from the image's pixels (`image_keys`, `corrupt_each`):
an image is corrupted the same way whatever batch, batch size or process
count it is evaluated in, so its numbers compare across all of them.
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


def image_keys(key: jax.Array, images: jax.Array) -> jax.Array:
  """One key per image of `images` (batch, ...): `key` folded with a hash
  of the image's float32 bits, so a function of `key` and the pixels only.

  The hash is a sum of the bits times fixed odd multipliers in uint32
  (wrapping): integer arithmetic, exact in any order, so the same on every
  batch size, sharding and platform.
  """
  bits = jax.lax.bitcast_convert_type(images.astype(jnp.float32), jnp.uint32)
  bits = bits.reshape(images.shape[0], -1)
  mult = jax.random.bits(jax.random.PRNGKey(0), bits.shape[1:], jnp.uint32)
  digest = jnp.sum(bits * (mult | 1), axis=1, dtype=jnp.uint32)
  return jax.vmap(lambda d: jax.random.fold_in(key, d))(digest)


def corrupt_each(keys: jax.Array, tokens: jax.Array, mask_token: jax.Array,
                 rate: float = 0.5) -> Tuple[jax.Array, jax.Array]:
  """`corrupt` of each image of `tokens` (batch, N, D) with its own key of
  `keys` (batch keys, e.g. `image_keys`): the same image and key give the
  same corruption in any batch."""
  if tokens.ndim != 3 or keys.shape[0] != tokens.shape[0]:
    raise ValueError(f'expected one key per image: {keys.shape[0]} keys for '
                     f'tokens {tuple(tokens.shape)}')

  def one(key, row):
    out, selected = corrupt(key, row[None], mask_token, rate)
    return out[0], selected[0]

  return jax.vmap(one)(keys, tokens)


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
