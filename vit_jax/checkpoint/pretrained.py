"""Starting a fine-tuning run from pre-trained weights (the paper's §3.2).

`load_pretrained(pretrained, init_params)` returns `init_params` filled with
the pre-trained weights, adapted to the new model:

  * the pre-training head goes: the target's own zero-initialised `head` is
    kept (new class count), and `pre_logits` (or a MAP head, `MAPHead_0`) is
    dropped when the target model has none; one the target has and the
    checkpoint lacks starts fresh;
  * position embeddings are resized in 2-D (bilinear, corner-aligned, as
    the reference code) when the patch grid changes, e.g. 224 -> 384
    turns a 14x14 grid into 24x24, or 224 -> 224x256 into 14x16 (`grid`;
    the checkpoint's own grid is `source_grid`, which vit_jax checkpoints
    record, else a square one);
    the class-token row is kept as is, or dropped, with `cls`, for a target
    without a class token (a "gap" classifier);
  * a masked-patch-prediction model's `mask_token` and `mpp_head` are
    dropped (logged); what the target has and the checkpoint lacks of
    `pre_logits`, `mask_token` and `mpp_head` keeps its fresh value (logged);
  * everything else must match exactly, else the error lists each missing,
    extra or mis-shaped key;
  * every array takes the target's dtype (its `param_dtype`);
  * a ViT with fixed position embeddings (`posemb='sincos2d'`, no
    parameter) loads into one with them, at any grid; learned ones on one
    side and fixed on the other are an error naming the option.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
from absl import logging
from flax import traverse_util

from vit_jax.checkpoint.layers import is_scanned, stack_blocks, unstack_blocks
from vit_jax.checkpoint.npz import CheckpointError, check_params, load_npz

POSEMB = ('Transformer', 'posembed_input', 'pos_embedding')
# Parameters only a self-supervised (masked patch prediction) model has:
# dropped when it initialises a classifier (`vit_jax.selfsup.PARAMS`).
SELF_SUPERVISED = ('mask_token', 'mpp_head')
# What a classifier has between its encoder and its head, by the option
# that makes it: fresh where the checkpoint lacks it, dropped where the
# target does (neither with the checkpoint's head kept).
BEFORE_HEAD = {'pre_logits': 'representation_size',
               'MAPHead_0': "classifier='map'"}


def load_pretrained(pretrained: Union[str, Mapping[str, Any]],
                    init_params: Mapping[str, Any], *,
                    keep_head: bool = False,
                    grid: Optional[Tuple[int, int]] = None,
                    source_grid: Optional[Sequence[int]] = None) -> dict:
  """Pre-trained weights (an .npz path or a params tree) for `init_params`.

  Args:
    pretrained: path of an .npz checkpoint, or a nested dict of arrays.
    init_params: freshly initialised params of the target model (their shapes
      and their zero head are what is returned where the checkpoint differs).
    keep_head: keep the checkpoint's head instead (same class count), e.g. to
      evaluate a fine-tuned checkpoint at another resolution; the checkpoint
      and the target must then agree on having a `pre_logits` layer.
    grid: (rows, cols) of the target's patch grid
      (`vit_jax.models.patch_grid`); required when it is not square. Whether
      either side has a class-token row is read from its `cls` parameter.
    source_grid: (rows, cols) of the checkpoint's patch grid, as a vit_jax
      checkpoint records it (`orbax_state.patch_grid`); None: not recorded
      (.npz files, older checkpoints), see `resize_posemb`.

  Returns:
    A nested dict of numpy arrays shaped like `init_params`, in its dtypes.
  """
  source = pretrained if isinstance(pretrained, str) else 'pretrained params'
  loaded = load_npz(pretrained) if isinstance(pretrained, str) else pretrained
  # Match the target's encoder layout (unrolled or scanned).
  loaded = (stack_blocks(loaded) if is_scanned(init_params)
            else unstack_blocks(loaded))
  loaded = traverse_util.flatten_dict(dict(loaded))
  target = traverse_util.flatten_dict(dict(init_params))
  _check_posemb_kind(loaded, target, source)

  dropped = sorted({k[0] for k in loaded
                    if k[0] in SELF_SUPERVISED and k not in target})
  if dropped:
    logging.info('%s is a masked-patch-prediction model: dropping its %s '
                 '(not part of the classifier)', source, ', '.join(dropped))
    loaded = {k: v for k, v in loaded.items() if k[0] not in dropped}
  tokens = int(('cls',) in loaded), int(('cls',) in target)
  if tokens == (1, 0) and POSEMB in loaded and POSEMB in target:
    # A class-token checkpoint starting a "gap" model: the grid is kept.
    logging.info('%s has a class token, the target model none: dropping '
                 'its cls and class-token position row', source)
    loaded = {k: v for k, v in loaded.items() if k != ('cls',)}
  # Parts the target adds to what the checkpoint was trained with start
  # fresh: a representation layer or a MAP head on a checkpoint without
  # one, or MPP's mask token and head on a classifier's weights (continued
  # as MPP).
  fresh = sorted({k[0] for k in target
                  if k[0] in (*BEFORE_HEAD, *SELF_SUPERVISED)
                  and not any(j[0] == k[0] for j in loaded)})
  for part in fresh:
    if keep_head and part in BEFORE_HEAD:
      # The checkpoint's head would read a new random layer's outputs.
      raise CheckpointError(
          f'{source} has no {part} layer, the target model has one '
          f'({BEFORE_HEAD[part]}): its head kept behind a new random {part} '
          f'would not give its logits. Load it into a model without '
          f'{BEFORE_HEAD[part]}, or train a new head (keep_head=False)')
  dropped = sorted({k[0] for k in loaded if k[0] in BEFORE_HEAD
                    and not any(j[0] == k[0] for j in target)})
  if dropped and not keep_head:
    logging.info('%s: its %s dropped (the target model has none; a new head '
                 'follows)', source, ', '.join(dropped))
  if fresh:
    logging.info('%s has no %s: the target model\'s fresh %s kept',
                 source, ', '.join(fresh), 'ones are' if len(fresh) > 1
                 else 'one is')
  out = {}
  for key, init in target.items():
    if (key[0] == 'head' and not keep_head) or key[0] in fresh:
      out[key] = np.asarray(init)
    elif key == POSEMB and key in loaded:
      out[key] = resize_posemb(np.asarray(loaded[key]), np.shape(init), grid,
                               tokens=tokens, source_grid=source_grid)
    elif key in loaded:
      out[key] = np.asarray(loaded[key])
  # `pre_logits` and a MAP head are dropped when the target has none (a new
  # head follows); with the head kept they would change the logits: an
  # error, like any extra.
  extra = {k: v for k, v in loaded.items()
           if k not in target and not (k[0] in (*BEFORE_HEAD, 'head')
                                       and not keep_head)}
  check_params(init_params,
               traverse_util.unflatten_dict({**out, **extra}), what=source)
  # The target's dtypes (its param_dtype): a float32 .npz starting a
  # bfloat16-parameter model must not train float32 parameters beside a
  # bfloat16 head, nor change dtype at the first resume.
  out = {k: v.astype(target[k].dtype, copy=False) for k, v in out.items()}
  return traverse_util.unflatten_dict(out)


def _check_posemb_kind(loaded, target, source: str) -> None:
  """Learned position embeddings on one side and fixed ones (no parameter,
  `posemb='sincos2d'`) on the other: an error naming the option, not a
  missing or extra key."""
  encoders = all(any(k[0] == 'Transformer' for k in tree)
                 for tree in (loaded, target))
  if not encoders or (POSEMB in loaded) == (POSEMB in target):
    return
  name = '/'.join(POSEMB)
  if POSEMB in target:
    raise CheckpointError(
        f'{source} has no learned position embeddings ({name}): a ViT with '
        "fixed ones, such as big_vision's posemb='sincos2d' models. Load it "
        "into a model with posemb='sincos2d' (--config.model.posemb="
        'sincos2d)')
  raise CheckpointError(
      f'{source} has learned position embeddings ({name}), the target '
      "model fixed ones (posemb='sincos2d'): load it into a model with "
      "posemb='learn' (the default)")


def resize_posemb(posemb: np.ndarray, new_shape: Sequence[int],
                  grid: Optional[Tuple[int, int]] = None, *,
                  tokens: Optional[Tuple[int, int]] = None,
                  source_grid: Optional[Sequence[int]] = None) -> np.ndarray:
  """Bilinearly resizes (1, tokens, D) position embeddings to `new_shape`,
  as the reference code does (corner-aligned: `scipy.ndimage.zoom`, order 1).

  Args:
    posemb: the checkpoint's position embeddings; the class-token row (if
      any) first, then its grid, row by row.
    new_shape: the target's shape (1, rows, D).
    grid: the target's (rows, cols) patch grid; None: a square one.
    tokens: (checkpoint, target) class-token rows, 0 or 1 each; None: read
      from the row counts, where a square grid plus one row is taken as a
      class token (ambiguous: `load_pretrained` passes them).
    source_grid: the checkpoint's (rows, cols), as vit_jax checkpoints
      record it. None (public .npz files, which are all square, and
      checkpoints of earlier versions): a square grid where the row count
      is a square, else the target's grid when the counts match. Without
      it, 7x9 into 9x7 would load transposed and 4x16 would read as 8x8.

  Returns:
    `new_shape`'s embeddings: the class-token row kept (or dropped for a
    target without one), the grid resized; unchanged when the grids match.
  """
  _, n_old, d = posemb.shape
  _, n_new, d_new = new_shape
  if d != d_new:
    raise CheckpointError(
        f'shape mismatch for {"/".join(POSEMB)}: expected {tuple(new_shape)}, '
        f'found {posemb.shape} (hidden sizes differ: a different model?)')
  if tokens is None:
    tokens = (_split_grid(n_old)[1],
              _split_grid(n_new, what='target')[1] if grid is None
              else n_new - grid[0] * grid[1])
  tok_old, tok_new = tokens
  if tok_new not in (0, 1):
    raise CheckpointError(
        f'target position embeddings have {n_new} rows: not grid {grid} '
        'plus 0 or 1 class token row')
  if tok_new > tok_old:
    raise CheckpointError(
        'the checkpoint has no class token (a "gap" model): it cannot start '
        'a model with one (classifier "token"); use a "gap" classifier')
  if grid is None:
    side = math.isqrt(n_new - tok_new)
    if side * side != n_new - tok_new:
      raise CheckpointError(
          f'target position embeddings have {n_new} rows: {tok_new} class '
          f'token row(s) and a grid that is not square; pass '
          'grid=(rows, cols)')
    grid = (side, side)
  if grid[0] * grid[1] + tok_new != n_new:
    raise CheckpointError(
        f'target position embeddings have {n_new} rows, not grid {grid} '
        f'plus {tok_new} class token row(s)')
  if source_grid is not None:
    old_grid = tuple(int(n) for n in source_grid)
    if old_grid[0] * old_grid[1] != n_old - tok_old:
      raise CheckpointError(
          f'checkpoint position embeddings have {n_old} rows: not its '
          f'recorded grid {old_grid} plus {tok_old} class token row(s)')
  else:
    g_old = math.isqrt(n_old - tok_old)
    if g_old * g_old == n_old - tok_old and g_old > 0:
      old_grid = (g_old, g_old)
    elif n_old - tok_old == grid[0] * grid[1]:
      # A non-square checkpoint: its grid is taken to be the target's.
      old_grid = tuple(grid)
    else:
      raise CheckpointError(
          f'checkpoint position embeddings have {n_old} rows: {tok_old} '
          f'class token row(s) and a grid that is not square, which cannot '
          f'be resized to {grid} (its own grid is not recorded)')
  if old_grid == tuple(grid):
    return posemb[:, tok_old - tok_new:]
  tok = posemb[:, :tok_new]
  pe = posemb[0, tok_old:].reshape(*old_grid, d)
  # The reference's interpolation (vision_transformer's load_pretrained,
  # big_vision's resample_posemb): order-1 spline zoom, which maps the old
  # grid's corner rows onto the new grid's corners. Imported here: 0.3 s
  # that processes which never resize need not pay.
  import scipy.ndimage  # pylint: disable=g-import-not-at-top
  pe = scipy.ndimage.zoom(np.asarray(pe, np.float32),
                          (grid[0] / old_grid[0], grid[1] / old_grid[1], 1),
                          order=1)
  if pe.shape != (*grid, d):  # Rounding of the zoomed size.
    raise CheckpointError(f'position embeddings resized to {pe.shape[:2]}, '
                          f'not {grid}')
  pe = pe.astype(posemb.dtype).reshape(1, grid[0] * grid[1], d)
  return np.concatenate([tok, pe], axis=1)


def _split_grid(n: int, what: str = 'checkpoint') -> Tuple[int, int]:
  """(side, token rows) of `n` position rows: a square grid (+1 class token)."""
  for ntok in (1, 0):
    g = math.isqrt(max(n - ntok, 0))
    if g > 0 and g * g == n - ntok:
      return g, ntok
  raise CheckpointError(
      f'{what} position embeddings have {n} rows: neither a square grid '
      'nor a square grid plus a class token (pass grid=(rows, cols) for a '
      'non-square target)')
