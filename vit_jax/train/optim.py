"""The optimiser and learning-rate schedule, built from `config.optim`.

Fields (PAPER.md Tables 3 and 4 map one-to-one onto them):
  name            'adam' (decoupled weight decay: AdamW) or 'sgd' (momentum)
  lr              base learning rate
  warmup_steps    linear warm-up from 0 to `lr`
  decay           'linear' (to `linear_end`), 'cosine' (to 0) or 'constant'
  linear_end      floor of the linear decay (e.g. 1e-5 for i21k pre-training)
  b1, b2, eps     Adam moments (0.9, 0.999)
  weight_decay    on kernels only. Adam: decoupled, multiplied by the
                  schedule (the optax.adamw convention: decay = lr_t *
                  weight_decay * w). SGD: an L2 term added to the gradient
                  before momentum (BiT's upstream recipe, Appendix D.1's
                  study)
  momentum        SGD momentum (0.9)
  grad_clip_norm  global-norm clipping (None or 0: off)
  mu_dtype        dtype of Adam's first moment / SGD's trace ('bfloat16' saves
                  memory; None: the parameters' dtype)
  frozen, lr_mults, layer_decay, schedules
                  per-parameter learning rates, schedules and freezing by
                  regex on parameter paths (param_groups.py)
  ema_decay       Polyak averaging / EMA of the parameters (None or 0: off;
                  the paper's Table 2 fine-tuning uses 0.9999), kept in the
                  train state beside them, in float32 even for bfloat16
                  parameters (`ema_init`, `ema_update`)
  ema_warmup      the decay used at step t is min(ema_decay, (1+t)/(10+t))
                  (tf.train.ExponentialMovingAverage's num_updates), so a
                  run shorter than 1/(1-ema_decay) steps averages its own
                  steps instead of its initialisation (default True)
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from absl import logging
from flax import traverse_util

from vit_jax.train import param_groups

NAMES = ('adam', 'sgd')
DECAYS = ('linear', 'cosine', 'constant')


def total_steps(config: Any, num_train: Optional[int]) -> int:
  """The run length: `total_steps`, else (unset or 0) `total_epochs`."""
  if config.get('total_steps'):
    if config.get('total_epochs'):
      # Both set is common (a smoke run shortens an epoch row): said, not
      # warned.
      logging.info('total_steps=%d wins over total_epochs=%s: training %d '
                   'steps (pass --config.total_steps=0 to train by epochs)',
                   config.total_steps, config.total_epochs,
                   config.total_steps)
    return int(config.total_steps)
  if config.get('total_epochs'):
    if not num_train:
      raise ValueError(
          f'total_epochs={config.total_epochs} needs the size of the train '
          f'split of {config.input.get("data")!r}, which neither its source '
          '(TFRecord files carry no count) nor the dataset registry knows: '
          'set --config.input.num_train_examples=N, or give the run length '
          'as --config.total_steps')
    return max(1, math.ceil(config.total_epochs * num_train /
                            config.input.batch_size))
  raise ValueError('config sets neither total_steps nor total_epochs')


def warmup_problem(warmup: int, total_steps: int) -> Optional[str]:
  """What is wrong with a warm-up as long as the run, else None (a 1-step
  run too: its only step would have learning rate 0 and change nothing)."""
  if warmup and warmup >= total_steps:
    return (f'--config.optim.warmup_steps={warmup} is not below the '
            f'{total_steps} total steps: shorten the warm-up, e.g. '
            f'--config.optim.warmup_steps={total_steps // 10}')
  return None


def schedule(cfg: Any,
             total_steps: int) -> optax.Schedule:
  """Linear warm-up, then linear-to-floor, cosine or constant decay."""
  if cfg.decay not in DECAYS:
    raise ValueError(f'optim.decay={cfg.decay!r}: expected one of {DECAYS}')
  warmup = int(cfg.get('warmup_steps', 0))
  problem = warmup_problem(warmup, total_steps)
  if problem:
    raise ValueError(problem)
  rest = max(total_steps - warmup, 1)
  if cfg.decay == 'linear':
    decay = optax.linear_schedule(cfg.lr, cfg.get('linear_end', 0.0), rest)
  elif cfg.decay == 'cosine':
    decay = optax.cosine_decay_schedule(cfg.lr, rest)
  else:
    decay = optax.constant_schedule(cfg.lr)
  if not warmup:
    return decay
  return optax.join_schedules(
      [optax.linear_schedule(0.0, cfg.lr, warmup), decay], [warmup])


class Settings(dict):
  """`config.optim` fields as a plain dict with attribute access, for callers
  without ml_collections (the benchmark): `make(Settings(name='adam', ...))`."""

  def __getattr__(self, key):
    try:
      return self[key]
    except KeyError:
      raise AttributeError(key) from None


def kernel_mask(params: Any) -> Any:
  """True for weight matrices and convolution kernels (weight decay targets)."""
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict(
      {k: k[-1] == 'kernel' for k in flat})


def make(cfg: Any, total_steps: int
         ) -> tuple[optax.GradientTransformation, Callable[[Any], Any]]:
  """(optimiser, learning-rate schedule) for `config.optim`."""
  if cfg.name not in NAMES:
    raise ValueError(f'optim.name={cfg.name!r}: expected one of {NAMES}')
  if cfg.lr <= 0:
    raise ValueError(f'optim.lr={cfg.lr} must be positive')
  lr = schedule(cfg, total_steps)
  parts = []
  if cfg.get('grad_clip_norm'):  # Over every trained parameter at once.
    parts.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
  groups = param_groups.schedule_groups(cfg)
  if groups:  # Each group: the same optimiser, with its own schedule.
    fields = {k: cfg.get(k) for k in cfg.keys()}
    txs = {param_groups.DEFAULT_GROUP: optax.chain(*_optimizer(cfg, lr))}
    for i, (_, over) in enumerate(groups):
      own = Settings({**fields, **over})
      if own.lr <= 0:
        raise ValueError(f'optim.schedules[{i}] lr={own.lr} must be '
                         'positive')
      txs[param_groups.group_name(i)] = optax.chain(*_optimizer(
          own, schedule(own, total_steps)))
    parts.append(optax.multi_transform(
        txs, param_groups.schedule_labels(groups)))
  else:  # One flat chain: the state layout of earlier checkpoints.
    parts.extend(_optimizer(cfg, lr))
  # Per-parameter learning rates and freezing (param_groups.py).
  return param_groups.wrap(optax.chain(*parts), cfg), lr


def _optimizer(cfg: Any, lr: optax.Schedule
               ) -> list[optax.GradientTransformation]:
  """AdamW (decoupled weight decay) or SGD (weight decay as an L2
  gradient term, before momentum), decay on kernels only, at `lr`, as the
  parts of a chain."""
  mu_dtype = cfg.get('mu_dtype')
  mu_dtype = jnp.dtype(mu_dtype) if mu_dtype else None
  if cfg.name == 'adam':
    return [optax.adamw(
        lr, b1=cfg.get('b1', 0.9), b2=cfg.get('b2', 0.999),
        eps=cfg.get('eps', 1e-8), mu_dtype=mu_dtype,
        weight_decay=cfg.get('weight_decay', 0.0), mask=kernel_mask)]
  parts = []
  if cfg.get('weight_decay'):
    parts.append(optax.masked(
        optax.add_decayed_weights(cfg.weight_decay), kernel_mask))
  parts.append(optax.sgd(lr, momentum=cfg.get('momentum', 0.9) or None,
                         nesterov=cfg.get('nesterov', False),
                         accumulator_dtype=mu_dtype))
  return parts


def ema_decay_at(cfg: Any, step: Any) -> jax.Array:
  """The EMA decay applied by the update that ends optimiser step `step`
  (0-based): `ema_decay`, or min(ema_decay, (1+step)/(10+step)) with
  `ema_warmup` (the default)."""
  decay = jnp.asarray(cfg.get('ema_decay') or 0.0, jnp.float32)
  if cfg.get('ema_warmup', True):
    t = jnp.asarray(step, jnp.float32)
    decay = jnp.minimum(decay, (1.0 + t) / (10.0 + t))
  return decay


def ema_init(params: Any) -> Any:
  """The averages at step 0: a float32 (or wider) copy of `params`.

  They are kept in at least float32 whatever `param_dtype` is: with
  bfloat16 parameters a bfloat16 average would never move, as
  (1 - 0.9999) * (p - e) rounds away against e's 8-bit mantissa."""
  def one(p):
    if jnp.issubdtype(p.dtype, jnp.floating):
      return jnp.asarray(p, jnp.promote_types(p.dtype, jnp.float32))
    return jnp.copy(p)
  return jax.tree.map(one, params)


def ema_update(ema: Any, params: Any, decay: jax.Array) -> Any:
  """ema <- decay * ema + (1 - decay) * params, leaf by leaf, in the EMA's
  dtype (float32 at least: `ema_init`)."""
  def one(e, p):
    return e + (1.0 - decay).astype(e.dtype) * (p.astype(e.dtype) - e)
  return jax.tree.map(one, ema, params)
