"""Top-1 accuracy over every example of a split exactly once, and ReaL.

ImageNet ReaL (Beyer et al. 2020): a prediction is correct when it is in the
image's set of real labels; images whose set is empty are left out of the
ReaL accuracy (they still count for the original-label top-1). The data
pipeline provides the set as `real_label` (bool [B, 1000]) for datasets with
a `real_label_key` (`imagenet2012_real`).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from vit_jax import losses, selfsup
from vit_jax.data import pipeline, registry
from vit_jax.evaluators import base
from vit_jax import sharding as shd


def batch_sums(params: Any, batch: Dict[str, jax.Array], *,
               model: nn.Module, loss: str = 'softmax'
               ) -> Dict[str, jax.Array]:
  """Sums over the real (mask=True) rows of one padded eval batch; `loss`
  is the run's (`config.loss`), so that eval and train losses compare."""
  with nn.logical_axis_rules(shd.ACTIVATION_RULES):
    logits = model.apply({'params': params}, batch['image'], train=False)
  mask = batch['mask'].astype(jnp.float32)
  labels = batch['label']
  pred = jnp.argmax(logits, -1)
  if labels.ndim == 2:  # Multi-hot: precision@1, the top class is a label.
    targets = jnp.pad(labels.astype(jnp.float32),
                      ((0, 0), (0, logits.shape[-1] - labels.shape[-1])))
    correct = jnp.take_along_axis(targets, pred[:, None], -1)[:, 0] > 0
  else:
    targets = jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32)
    correct = pred == labels
  correct = correct.astype(jnp.float32)
  nll = losses.per_example(logits.astype(jnp.float32), targets, loss)
  out = {'correct': (correct * mask).sum(), 'loss': (nll * mask).sum(),
         'count': mask.sum()}
  if 'real_label' in batch:
    real = batch['real_label'].astype(bool)
    has_real = real.any(-1).astype(jnp.float32) * mask
    # Predictions beyond the label set's classes are misses (take_along_axis
    # would fill them with True).
    hit = jnp.take_along_axis(real, jnp.minimum(pred, real.shape[-1] - 1)[
        :, None], -1)[:, 0] & (pred < real.shape[-1])
    out['real_correct'] = (hit.astype(jnp.float32) * has_real).sum()
    out['real_count'] = has_real.sum()
  return out


@base.register('classification')
class Classification(base.Evaluator):
  """Accuracy and loss of the model's own head on one split.

  Config section (`config.evals.<name>`, all optional): `data` (another
  registry dataset; its own splits then), `split` (default: the dataset's
  eval split), `pp` (eval pre-processing, default the run's
  `input.pp_eval`; `{size}` as `base.section_ops` defines it; its size,
  channels and value range must be the model's), `prefix` (default
  `<name>_`), `real_only`, `every`. Every run has one named `eval`
  (`evaluators.BUILT_IN`, prefix `eval_`; no section may take the name) on
  `input.eval_split`, every `eval_every` steps.

  Metrics: `{prefix}accuracy` (precision@1 for multi-label data: the top
  class is one of the image's labels), `{prefix}loss` (the run's `config.loss`:
  softmax, or sigmoid summed over classes), `{prefix}examples`, and with
  ReaL labels `{prefix}real_accuracy`, `{prefix}real_examples`; with
  `real_only` just `{prefix}real_accuracy` and `{prefix}real_examples`,
  where a section named `real` has no prefix (`real_accuracy`, what the
  tables read) unless it sets one: two sections never share a metric.
  A section whose plain top-1 would be named `real_accuracy` (one named
  `real` without `real_only`, or with `prefix='real_'`) is refused.
  The keys, dataset and split are checked when the evaluator is built, so
  a bad setting fails before training, not after it; so is a masked patch
  prediction model (objective=mpp), which has no head to score (its
  evaluators: type='mpp', 'fewshot').
  """

  KEYS = ('data', 'data_dir', 'split', 'pp', 'prefix', 'real_only')

  def __init__(self, name: str, cfg: ml_collections.ConfigDict,
               context: base.Context):
    super().__init__(name, cfg, context)
    if isinstance(context.model, selfsup.MaskedPatchPrediction):
      # Its outputs are (per-patch predictions, selection), not logits:
      # refused here, not by a TypeError at the first evaluation.
      raise ValueError(
          f'evals.{name}: type=classification scores a classifier\'s head, '
          'but objective=mpp trains a masked patch prediction model, which '
          f"has none: set evals.{name}.type='mpp' (its masked patch "
          "prediction loss and accuracy) or 'fewshot' (linear few-shot "
          'accuracy of its representation)')
    self._real_only = bool(cfg.get('real_only', False))
    self.prefix = _prefix(name, cfg)
    _check_not_posing_as_real(name, self.prefix, self._real_only)
    self._split: Optional[str] = cfg.get('split')
    self._mesh = context.mesh
    inp = base.eval_input(cfg, context, name)
    self._input = inp
    spec = registry.get(inp.data)
    if self._real_only and not spec.real_label_key:
      raise ValueError(f'evals.{name}: real_only needs a dataset with ReaL '
                       f'labels (imagenet2012_real), not {spec.name}')
    base.split_info(name, cfg, inp, self._split, context)  # Fails early.
    head = getattr(context.model, 'num_classes', None)
    if isinstance(head, int) and head > 0:  # Labels the head cannot score.
      try:
        pipeline.check_num_classes(inp, head)
      except ValueError as e:
        raise type(e)(f'evals.{name} ({inp.data}): {e}') from None
    self._batches = base.eval_batches(inp, self._split)
    self._sums = base.jit(
        functools.partial(batch_sums, model=context.model,
                          loss=context.config.get('loss', 'softmax')),
        context.mesh, in_shardings=(context.params_sharding, None),
        out_shardings=shd.replicated(context.mesh))

  def run(self, params: Any) -> Dict[str, float]:
    sums = None
    for batch in self._batches:
      out = self._sums(params, shd.global_batch(batch, self._mesh))
      sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
    if sums is None:
      raise ValueError(f'evals.{self.name}: split {self._split!r} of '
                       f'{self._input.data} has no examples')
    sums = {k: float(v) for k, v in jax.device_get(sums).items()}
    p = self.prefix
    if self._real_only:
      return {f'{p}real_accuracy': sums['real_correct'] /
              max(sums['real_count'], 1.0), f'{p}real_examples':
              sums['real_count']}
    metrics = {f'{p}accuracy': sums['correct'] / sums['count'],
               f'{p}loss': sums['loss'] / sums['count'],
               f'{p}examples': sums['count']}
    if 'real_count' in sums:
      metrics[f'{p}real_accuracy'] = (sums['real_correct'] /
                                      max(sums['real_count'], 1.0))
      metrics[f'{p}real_examples'] = sums['real_count']
    return metrics

  def metric_names(self):
    real = {f'{self.prefix}real_accuracy', f'{self.prefix}real_examples'}
    return frozenset(real if self._real_only else real | {
        f'{self.prefix}{k}' for k in ('accuracy', 'loss', 'examples')})

  @classmethod
  def settings(cls, cfg, config):
    """The data, split and pre-processing it reads (the run's where the
    section names none) and `real_only`; the loss is the run's."""
    inp = config.get('input') or {}
    same_data = cfg.get('data') in (None, inp.get('data'))
    return {'data': cfg.get('data') or inp.get('data'),
            'split': cfg.get('split') or (inp.get('eval_split') if same_data
                                          else None),
            'pp': cfg.get('pp') or inp.get('pp_eval'),
            'real_only': bool(cfg.get('real_only', False))}


def _prefix(name: str, cfg) -> str:
  """The section's metric prefix: `prefix`, else `<name>_`; none for a
  `real_only` section named `real` (its `real_accuracy` is what the result
  tables read)."""
  if cfg.get('prefix') is not None:
    return cfg.prefix
  return '' if name == 'real' and cfg.get('real_only') else f'{name}_'


def _check_not_posing_as_real(name: str, prefix: str, real_only: bool
                              ) -> None:
  """The result tables read `real_accuracy` as the ImageNet ReaL accuracy;
  a section without `real_only` and the prefix `real_` (one named `real`
  whose `real_only` is missing or misspelt, say) would write its plain
  top-1 accuracy there."""
  if prefix == 'real_' and not real_only:
    raise ValueError(
        f'evals.{name} would write its plain top-1 accuracy as '
        "'real_accuracy', which the result tables read as the ImageNet ReaL "
        f'accuracy: set evals.{name}.real_only=True for ReaL (with '
        f"data='imagenet2012_real'), or evals.{name}.prefix to another "
        "prefix (or name the section otherwise) for plain top-1")
