"""Masked-patch-prediction loss and accuracy on held-out images (no labels).

The run's `eval` evaluator when `config.objective='mpp'`: every image of the
split (`input.eval_split`, or `split` / `data` of its section) is corrupted
exactly as in training, with a fixed key per batch (so every evaluation of
every checkpoint sees the same corruption), and the loss and accuracy over
the selected positions are averaged over all of them. As in training, the
corruption of a batch is drawn from one key for the whole global batch (the
"other patch" of the 10% replacements comes from the same image), so which
positions an image gets depends on its place in the batch: numbers are
comparable at the same `input.eval_batch_size` and process count, not
across them.

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
from vit_jax.data import pipeline
from vit_jax.evaluators import base
from vit_jax import sharding as shd


def batch_sums(params: Any, batch: Dict[str, jax.Array], key: jax.Array, *,
               model: nn.Module) -> Dict[str, jax.Array]:
  """Sums over the selected positions of the real rows of one batch."""
  with nn.logical_axis_rules(shd.ACTIVATION_RULES):
    outputs, selected = model.apply({'params': params}, batch['image'],
                                    train=False, rngs={'mpp': key})
  out = selfsup.sums(outputs, selected, batch['image'], target=model.target,
                     stride=model.stride, bits=model.bits,
                     weights=batch['mask'])
  out['examples'] = batch['mask'].astype(jnp.float32).sum()
  return out


@base.register('mpp')
class MaskedPatchEval(base.Evaluator):
  """MPP loss / accuracy of an MPP model on a split. Section keys (all
  optional): `data`, `split`, `pp`, `prefix` (default `<name>_`), `seed`,
  `every`."""

  def __init__(self, name: str, cfg: ml_collections.ConfigDict,
               context: base.Context):
    super().__init__(name, cfg, context)
    if not isinstance(context.model, selfsup.MaskedPatchPrediction):
      raise ValueError(f'evals.{name}: type=mpp evaluates a masked patch '
                       'prediction model; set --config.objective=mpp')
    self.prefix = cfg.get('prefix', f'{name}_')
    self._split: Optional[str] = cfg.get('split')
    self._seed = int(cfg.get('seed', 0))
    self._mesh = context.mesh
    inp = base.eval_input(cfg, context)
    self._input = inp
    pipeline.dataset_info(inp, split=self._split)  # Fails early.
    self._batches = base.eval_batches(inp, self._split)
    rep = shd.replicated(context.mesh)
    self._sums = jax.jit(
        functools.partial(batch_sums, model=context.model),
        in_shardings=(context.params_sharding, None, rep),
        out_shardings=rep)

  def run(self, params: Any) -> Dict[str, float]:
    sums = None
    key = jax.random.PRNGKey(self._seed)
    for i, batch in enumerate(self._batches):
      batch = {'image': batch['image'], 'mask': batch['mask']}
      out = self._sums(params, shd.global_batch(batch, self._mesh),
                       jax.random.fold_in(key, i))
      sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
    if sums is None:
      raise ValueError(f'evals.{self.name}: split {self._split!r} of '
                       f'{self._input.data} has no examples')
    sums = {k: float(v) for k, v in jax.device_get(sums).items()}
    p, count = self.prefix, max(sums['count'], 1.0)
    metrics = {f'{p}mpp_loss': sums['loss'] / count,
               f'{p}mpp_positions': sums['count'],
               f'{p}examples': sums['examples']}
    if self.context.model.target != 'pixels':
      metrics[f'{p}mpp_accuracy'] = sums['correct'] / count
    return metrics
