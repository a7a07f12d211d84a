"""Masked-patch-prediction loss and accuracy on held-out images (no labels).

The run's `eval` evaluator when `config.objective='mpp'`: every image of the
split (`input.eval_split`, or `split` / `data` of its section) is corrupted
as in training, but with its own key drawn from `seed` and its pixels
(`selfsup.image_keys`), and the loss and accuracy over the selected
positions are averaged over all of them. An image gets the same corruption
in every evaluation of every checkpoint, whatever the eval batch size, its
place in the batch or the process count, so the numbers compare across all
of them. Runs record this as `mpp_eval_corruption: 'per_image'` in
summary.json (`CORRUPTION`); earlier versions drew one key per global batch
and their numbers differ.

Metrics: `{prefix}mpp_loss`, `{prefix}mpp_accuracy` (the fraction of the
selected positions' predictions that are right; absent for the 'pixels'
target) and `{prefix}mpp_positions`, `{prefix}examples`.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from vit_jax import selfsup
from vit_jax.evaluators import base
from vit_jax import sharding as shd

CORRUPTION = 'per_image'  # What summary.json's `mpp_eval_corruption` says.


def batch_sums(params: Any, batch: Dict[str, jax.Array], key: jax.Array, *,
               model: nn.Module) -> Dict[str, jax.Array]:
  """Sums over the selected positions of the real rows of one batch, each
  image corrupted with its own key (`selfsup.image_keys(key, ...)`)."""
  keys = selfsup.image_keys(key, batch['image'])
  with nn.logical_axis_rules(shd.ACTIVATION_RULES):
    outputs, selected = model.apply({'params': params}, batch['image'],
                                    train=False, corruption_keys=keys)
  out = selfsup.sums(outputs, selected, batch['image'], target=model.target,
                     stride=model.stride, bits=model.bits,
                     weights=batch['mask'])
  out['examples'] = batch['mask'].astype(jnp.float32).sum()
  return out


@base.register('mpp')
class MaskedPatchEval(base.Evaluator):
  """MPP loss / accuracy of an MPP model on a split. Section keys (all
  optional): `data`, `data_dir`, `split`, `pp`, `prefix` (default
  `<name>_`), `seed`, `every`."""

  KEYS = ('data', 'data_dir', 'split', 'pp', 'prefix', 'seed')

  def __init__(self, name: str, cfg: ml_collections.ConfigDict,
               context: base.Context):
    super().__init__(name, cfg, context)
    if not isinstance(context.model, selfsup.MaskedPatchPrediction):
      raise ValueError(f'evals.{name}: type=mpp evaluates a masked patch '
                       'prediction model; set --config.objective=mpp')
    prefix = cfg.get('prefix')
    self.prefix = f'{name}_' if prefix is None else prefix
    self._split: Optional[str] = cfg.get('split')
    self._seed = int(cfg.get('seed', 0))
    self._mesh = context.mesh
    inp = base.eval_input(cfg, context, name)
    self._input = inp
    base.split_info(name, cfg, inp, self._split, context)  # Fails early.
    self._batches = base.eval_batches(inp, self._split)
    rep = shd.replicated(context.mesh)
    self._sums = base.jit(
        functools.partial(batch_sums, model=context.model), context.mesh,
        in_shardings=(context.params_sharding, None, rep),
        out_shardings=rep)

  def run(self, params: Any) -> Dict[str, float]:
    sums = None
    key = jax.random.PRNGKey(self._seed)
    for batch in self._batches:
      batch = {'image': batch['image'], 'mask': batch['mask']}
      out = self._sums(params, shd.global_batch(batch, self._mesh), key)
      sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
    if sums is None:
      raise ValueError(f'evals.{self.name}: split {self._split!r} of '
                       f'{self._input.data} has no examples')
    sums = {k: float(v) for k, v in jax.device_get(sums).items()}
    count = max(sums['count'], 1.0)
    values = {'mpp_loss': sums['loss'] / count,
              'mpp_positions': sums['count'], 'examples': sums['examples'],
              'mpp_accuracy': sums['correct'] / count}
    return {self.prefix + k: values[k] for k in self._metric_keys()}

  def _metric_keys(self):
    """What `run` writes, less the prefix: a pixel regression has no
    accuracy."""
    keys = ('mpp_loss', 'mpp_positions', 'examples')
    if self.context.model.target != 'pixels':
      keys += ('mpp_accuracy',)
    return keys

  def metric_names(self):
    """So that `build` refuses two sections (or a section and the run's own
    `eval`) writing one metric."""
    return frozenset(self.prefix + k for k in self._metric_keys())
