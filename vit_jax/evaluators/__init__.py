"""Evaluators: what a run measures besides its training loss.

Every run evaluates top-1 accuracy on `input.eval_split` (every `eval_every`
steps and at the end). `config.evals` adds more, one section each, keyed by
a name of your choice and built by its `kind`:

    c.evals.real = dict(kind='classification', data='imagenet2012_real',
                        real_only=True)  # ImageNet ReaL: `real_accuracy`
    c.evals.fewshot = dict(kind='fewshot', datasets=('mnist5k',),
                           shots=(1, 5, 10, 25), seeds=3)

VTAB-1k is 19 fine-tuning runs, not an evaluator of one run: see
`configs/vtab.py` and `python -m vit_jax.vtab`.
"""

from __future__ import annotations

from typing import Any, Dict, List

import ml_collections

from vit_jax.evaluators.base import Evaluator
from vit_jax.evaluators.classification import Classification
from vit_jax.evaluators.fewshot import FewShot

KINDS = ('classification', 'fewshot')


def build(config: ml_collections.ConfigDict, model, mesh, params_sharding,
          image_size: int) -> List[Evaluator]:
  """The run's evaluators: top-1 on input.eval_split, then config.evals."""
  out: List[Evaluator] = [Classification(
      config.input, model, mesh, params_sharding,
      every=config.get('eval_every', 0))]
  for name, cfg in sorted(config.get('evals', {}).items()):
    kind = cfg.get('kind')
    if kind == 'classification':
      inp = ml_collections.ConfigDict(config.input.to_dict())
      if cfg.get('data', inp.data) != inp.data:
        # Another dataset: its own splits, not the training data's.
        inp.data = cfg.data
        inp.train_split = inp.eval_split = None
      if cfg.get('pp'):
        inp.pp_eval = cfg.pp
      out.append(Classification(
          inp, model, mesh, params_sharding, split=cfg.get('split'),
          prefix=cfg.get('prefix', f'{name}_'), every=cfg.get('every', 0),
          name=name, real_only=cfg.get('real_only', False)))
    elif kind == 'fewshot':
      out.append(FewShot(cfg, config.input, model, mesh, params_sharding,
                         image_size=image_size, name=name))
    else:
      raise ValueError(f'config.evals.{name}.kind={kind!r}: expected one of '
                       f'{", ".join(KINDS)}')
  return out


def run_all(evaluators: List[Evaluator], params: Any) -> Dict[str, float]:
  metrics: Dict[str, float] = {}
  for evaluator in evaluators:
    metrics.update(evaluator.run(params))
  return metrics


__all__ = ['Evaluator', 'Classification', 'FewShot', 'build', 'run_all']
