"""Evaluators: what a run measures besides its training loss.

Every run evaluates top-1 accuracy on `input.eval_split` (every `eval_every`
steps and at the end). `config.evals` adds more, one section each, keyed by
a name of your choice and built by the evaluator registered as its `type`:

    c.evals.real = dict(type='classification', data='imagenet2012_real',
                        real_only=True)  # ImageNet ReaL: `real_accuracy`
    c.evals.fewshot = dict(type='fewshot', datasets=('mnist5k',),
                           shots=(1, 5, 10, 25), seeds=3)

Every evaluator is built as `Cls(name, cfg, context)` (`base.py`); add one
with `@register('my_type')` (docs/evaluation.md). VTAB-1k is 19 fine-tuning
runs, not an evaluator of one run: see `configs/vtab.py` and
`python -m vit_jax.vtab`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import ml_collections

from vit_jax.evaluators.base import Context, Evaluator, get, register
from vit_jax.evaluators.classification import Classification
from vit_jax.evaluators.fewshot import FewShot
from vit_jax.evaluators.mpp import MaskedPatchEval
from vit_jax.ema_modes import EMA_MODES, RAW_PREFIX


# The name of every run's own evaluator (top-1 on input.eval_split, or
# MPP's): `build` adds it, and a config.evals section may not take it.
BUILT_IN = 'eval'


def build(config: ml_collections.ConfigDict, model, mesh, params_sharding,
          image_shape) -> List[Evaluator]:
  """The run's evaluators: top-1 on input.eval_split (for
  `objective='mpp'`: the masked-patch-prediction loss and accuracy there,
  labels unread), then config.evals. `image_shape`: the model's input
  (height, width, ...)."""
  h, w = image_shape[:2]
  context = Context(config=config, model=model, mesh=mesh,
                    params_sharding=params_sharding,
                    image_size=h if h == w else (h, w),
                    channels=int(image_shape[2]) if len(image_shape) > 2
                    else 3)
  first = (MaskedPatchEval if config.get('objective', 'supervised') == 'mpp'
           else Classification)
  evals = config.get('evals', {})
  if BUILT_IN in evals:
    # Results are kept by evaluator name (mode=eval's eval_summary.json and
    # its check of what may merge into summary.json): the section's would
    # replace the built-in's eval_accuracy, eval_loss, eval_examples.
    what = 'masked-patch' if first is MaskedPatchEval else 'top-1'
    raise ValueError(
        f'config.evals.{BUILT_IN} is the name of the run\'s own {what} '
        'evaluation (its eval_* metrics, on input.eval_split every '
        'eval_every steps): give the section another name')
  out: List[Evaluator] = [first(BUILT_IN, ml_collections.ConfigDict(
      dict(every=config.get('eval_every', 0))), context)]
  for name, cfg in sorted(evals.items()):
    if 'kind' in cfg:
      raise ValueError(f'config.evals.{name}.kind is now called type: '
                       f"config.evals.{name}.type={cfg.kind!r}")
    out.append(get(cfg.get('type'), name)(name, cfg, context))
  _check_distinct_metrics(out)
  return out


def _check_distinct_metrics(evaluators: List[Evaluator]) -> None:
  """Two evaluators writing one metric would overwrite each other's numbers
  in metrics.jsonl and summary.json, silently: refused, naming both."""
  written: Dict[str, Evaluator] = {}
  for evaluator in evaluators:
    for key in sorted(evaluator.metric_names() or ()):
      if key in written:
        first = written[key]
        what = ('masked-patch' if isinstance(first, MaskedPatchEval)
                else 'top-1')
        where = (f'the run\'s {what} evaluation (eval_*)'
                 if first.name == BUILT_IN
                 else f'config.evals.{first.name}')
        raise ValueError(
            f'config.evals.{evaluator.name} and {where} would both write '
            f'{key!r}, one over the other: give config.evals.'
            f'{evaluator.name} another prefix (or name), or drop one')
      written[key] = evaluator


def run_all(evaluators: List[Evaluator], params: Any) -> Dict[str, float]:
  metrics: Dict[str, float] = {}
  for evaluator in evaluators:
    metrics.update(evaluator.run(params))
  return metrics


def run_with_ema(evaluators: List[Evaluator], params: Any,
                 ema_params: Optional[Any] = None,
                 mode: str = 'ema') -> Dict[str, float]:
  """`run_all` on the parameters `config.eval_ema` names.

  'ema' (the default): the averages when there are any, else `params`;
  'raw': `params`; 'both': the averages under the usual metric names (what
  summaries and tables read) and `params` under 'raw/<name>'.
  """
  if mode not in EMA_MODES:
    raise ValueError(f'eval_ema={mode!r}: expected one of {EMA_MODES}')
  if ema_params is None or mode == 'raw':
    if mode == 'both':
      raise ValueError('eval_ema=both but there are no EMA parameters: set '
                       'optim.ema_decay (e.g. 0.9999), or eval_ema=raw')
    return run_all(evaluators, params)
  metrics = run_all(evaluators, ema_params)
  if mode == 'both':
    metrics.update({RAW_PREFIX + k: v
                    for k, v in run_all(evaluators, params).items()})
  return metrics


__all__ = ['BUILT_IN', 'Context', 'Evaluator', 'Classification', 'FewShot',
           'MaskedPatchEval', 'build',
           'get', 'register', 'run_all', 'run_with_ema', 'EMA_MODES']
