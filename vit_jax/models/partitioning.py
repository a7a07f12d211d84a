"""Logical-axis annotations of parameters, kept out of `init`'s result.

Modules name the axes of their parameters (`with_axes(init, names)`, like
flax's `nn.with_logical_partitioning`): e.g. a query kernel is ('embed', 'heads',
'kv'), a convolution kernel (None, None, 'conv_in', 'conv_out'). The names
say what a dimension is, not where it lives: `vit_jax.sharding` maps them to
mesh axes. `Module.init` strips the annotation boxes, so checkpoints,
optimisers, converters and `jax.eval_shape(model.init, ...)` see plain arrays;
`vit_jax.sharding.abstract_params` reads the boxes.
"""

from typing import Callable, Optional, Sequence

import flax.linen as nn


class Module(nn.Module):
  """A flax module whose `init` returns plain arrays (annotations stripped).

  Every registered model family derives from it.

  `drops_partial_patches`: whether the model takes images whose size is not
  a multiple of its stride, leaving the last pixels out (a plain ViT:
  `inputs.check_image_shape`; Mixer's stem pads them instead). Declared here, False, so that the
  image-size checks (`train.config_check`, `vit_jax.inspect`) read it from
  every family alike; families whose images must tile say nothing.
  """
  drops_partial_patches = False

  @nn.nowrap
  def init(self, *args, **kwargs):
    return nn.meta.unbox(super().init(*args, **kwargs))


class Axes(nn.LogicallyPartitioned):
  """A parameter with its logical axis names, for `vit_jax.sharding` only.

  Unlike flax's box it never applies a sharding constraint when unboxed: the
  names describe the parameter, the train step's explicit shardings place it
  (a constraint inside `init` or flax's apply-time shape check would apply
  the names to initialisers' intermediate shapes, e.g. DenseGeneral's flat
  kernel, and replicate weights at init).
  """

  def unbox(self, apply_constraint=True):
    del apply_constraint
    return self.value


def with_axes(init: Callable, names: Sequence[Optional[str]]) -> Callable:
  """`init` whose parameter carries logical axis `names` (one per dim)."""
  names = tuple(names)

  def boxed(*args, **kwargs):
    return Axes(init(*args, **kwargs), names)
  return boxed
