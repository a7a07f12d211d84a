"""The masked-patch-prediction model: a ViT encoder with a `[mask]` token and
a per-patch prediction head.

Parameters: the ViT's own (`embedding`, `cls`, `Transformer/...`, same
names and shapes, so an MPP checkpoint initialises a plain ViT through
`load_pretrained`), plus `mask_token` (hidden,) and `mpp_head`, which
fine-tuning drops.

Forward: patch projection -> corruption (only when the `mpp` rng is given:
training and the held-out MPP evaluation) -> class token and position
embeddings -> encoder -> `mpp_head` on every patch token. Called without an
`mpp` rng (init, few-shot, accounting) the images are not corrupted.

The sown `representation` (what the few-shot evaluator reads) is the class
token's output with `representation='token'` or the mean of the patch
tokens' outputs with `'gap'`. MPP never trains the class token's output on
anything: its input embedding is learned only through what the patch tokens
read from it by attention, so its output is an attention-pooled summary the
objective never asked for; `'gap'` averages the outputs the objective did
train.
"""

from __future__ import annotations

import math
from typing import Tuple

import flax.linen as nn
import jax.numpy as jnp

from vit_jax.models import dense, vit
from vit_jax.models.partitioning import with_axes
from vit_jax.selfsup import targets as targets_lib
from vit_jax.selfsup.corruption import check_rate, corrupt, corrupt_each

TARGETS = ('colour', 'downsized', 'pixels')
REPRESENTATIONS = ('token', 'gap')
DOWNSIZED = 4  # Cells per side of the downsized-patch target.
PARAMS = ('mask_token', 'mpp_head')  # What fine-tuning drops.


def check_options(target: str, bits: int, rate: float,
                  representation: str = 'token') -> None:
  if target not in TARGETS:
    raise ValueError(f'mpp target={target!r}: expected one of {TARGETS} '
                     "(the paper's: 'colour', the 3-bit mean colour)")
  if representation not in REPRESENTATIONS:
    raise ValueError(f'mpp representation={representation!r}: expected one '
                     f'of {REPRESENTATIONS}')
  if target != 'pixels':
    targets_lib.num_classes(bits, 1)  # Checks bits.
  check_rate(rate)


def output_shape(target: str, bits: int, channels: int,
                 stride: int) -> Tuple[int, ...]:
  """Per-patch prediction shape: (predictions, classes) or (values,)."""
  if target == 'colour':
    return (1, targets_lib.num_classes(bits, channels))
  if target == 'downsized':
    return (DOWNSIZED**2, targets_lib.num_classes(bits, channels))
  return (stride * stride * channels,)


class MaskedPatchPrediction(vit.VisionTransformer):
  """A ViT trained by masked patch prediction (see the module docstring).

  Extra attributes: `target` ('colour', 'downsized' or 'pixels'), `bits`,
  `rate` (fraction of patches selected) and `representation` ('token' or
  'gap'). `num_classes` is unused (there is no classification head).
  """
  target: str = 'colour'
  bits: int = 3
  rate: float = 0.5
  representation: str = 'token'

  # Its targets cut every pixel of the images into patches
  # (`targets_lib.patches`): a size that leaves pixels out is refused here,
  # by `vit.embed_patches`, not logged and then refused by the targets.
  drops_partial_patches = False

  @nn.compact
  def __call__(self, images, *, train: bool = False, corruption_keys=None):
    """(predictions, selected): float32 (batch, N, *output_shape) and the
    bool (batch, N) corrupted positions (all False without an `mpp` rng or
    `corruption_keys`). `corruption_keys` (one key per image, e.g.
    `corruption.image_keys`) corrupts each image with its own key instead
    of the `mpp` rng's one key for the batch."""
    check_options(self.target, self.bits, self.rate, self.representation)
    if self.representation == 'token' and self.classifier != 'token':
      raise ValueError("mpp representation='token' needs a class token: "
                       "use representation='gap' with classifier='gap'")
    tokens, grid = vit.embed_patches(self, images)
    mask_token = self.param(
        'mask_token', with_axes(nn.initializers.normal(stddev=0.02),
                                ('embed',)),
        (tokens.shape[-1],), self.param_dtype)
    if corruption_keys is not None:
      tokens, selected = corrupt_each(corruption_keys, tokens, mask_token,
                                      self.rate)
    elif self.has_rng('mpp'):
      tokens, selected = corrupt(self.make_rng('mpp'), tokens, mask_token,
                                 self.rate)
    else:
      selected = jnp.zeros(tokens.shape[:2], bool)
    x = vit.encode(self, tokens, grid, train=train)
    patch_out = x[:, 1:] if self.classifier == 'token' else x
    rep = x[:, 0] if self.representation == 'token' else jnp.mean(
        patch_out, axis=1)
    self.sow('intermediates', 'representation', rep)
    shape = output_shape(self.target, self.bits, images.shape[-1],
                         self.stride)
    out = dense.head(self, math.prod(shape), name='mpp_head')(patch_out)
    out = jnp.reshape(out, (*out.shape[:2], *shape))
    return out, selected


def from_vit(model: nn.Module, target: str = 'colour', bits: int = 3,
             rate: float = 0.5, representation: str = 'token'
             ) -> MaskedPatchPrediction:
  """The MPP model with `model`'s (a plain ViT's) architecture."""
  if not isinstance(model, vit.VisionTransformer):
    raise ValueError(
        f'masked patch prediction needs a model with patch embeddings (a '
        f'ViT); {type(model).__name__} has none (BiT ResNets have no patch '
        'tokens to mask): pick e.g. --config.model.name=ViT-B/16, or train '
        'it with --config.objective=supervised')
  if getattr(model, 'resnet_layers', None) is not None:
    raise ValueError(
        'masked patch prediction of a hybrid (R50+ViT) cannot work: its '
        'tokens are ResNet features whose receptive fields span the '
        'neighbouring patches, so the unmasked tokens already hold the '
        'masked pixels and the objective is trivial. Pick a plain ViT '
        '(e.g. --config.model.name=ViT-B/16, as the paper), or train the '
        'hybrid with --config.objective=supervised')
  check_options(target, bits, rate, representation)
  fields = {f: getattr(model, f) for f in model.__dataclass_fields__
            if f not in ('parent', 'name')}
  fields['num_classes'] = 0
  return MaskedPatchPrediction(target=target, bits=bits, rate=rate,
                               representation=representation, **fields)
