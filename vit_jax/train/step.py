"""The train state and the pure, jitted train step.

`train_step(state, batch) -> (state, metrics)` is a plain function of its
inputs; the loop jits it once with explicit shardings (see
`compile_train_step`). Evaluation lives in `vit_jax/evaluators/`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Mapping, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from vit_jax import sharding as shd

LOSSES = ('softmax', 'sigmoid')


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimiser steps taken.
  params: Any
  opt_state: Any
  rng: jax.Array  # uint32[2]: dropout/mixup randomness, folded with `step`.


def loss_fn(logits: jax.Array, labels: jax.Array, kind: str = 'softmax',
            label_smoothing: float = 0.0) -> jax.Array:
  """Mean loss; `labels` are class ids (N,) or (soft / multi-hot) (N, K)."""
  if kind not in LOSSES:
    raise ValueError(f'loss={kind!r}: expected one of {LOSSES}')
  targets = (jax.nn.one_hot(labels, logits.shape[-1])
             if labels.ndim == 1 else labels.astype(jnp.float32))
  if label_smoothing:
    targets = optax.smooth_labels(targets, label_smoothing)
  if kind == 'softmax':
    per_example = optax.softmax_cross_entropy(logits, targets)
  else:
    per_example = optax.sigmoid_binary_cross_entropy(logits, targets).sum(-1)
  return per_example.mean()


def create_state(model: nn.Module, tx: optax.GradientTransformation,
                 seed: int, image_shape, mesh: jax.sharding.Mesh,
                 fsdp_min_size: int = 2**18, *, rules=(), overrides=()
                 ) -> Tuple[TrainState, Any]:
  """A fresh state, created already sharded; returns (state, shardings).

  Parameters are placed by the model's logical-axis annotations, `rules`
  and `overrides` (see `sharding.param_shardings`).
  """
  init = functools.partial(_init_state, model, tx, image_shape)
  abstract = jax.eval_shape(init, seed)
  shardings = state_shardings(
      abstract, tx, mesh, fsdp_min_size,
      axes=shd.logical_axes(model, image_shape), rules=rules,
      overrides=overrides)
  with jax.set_mesh(mesh):
    state = jax.jit(init, out_shardings=shardings)(seed)
  return state, shardings


def _init_state(model, tx, image_shape, seed):
  params_rng, step_rng = jax.random.split(jax.random.PRNGKey(seed))
  params = model.init(params_rng, jnp.zeros((1, *image_shape), jnp.float32),
                      train=False)['params']
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=tx.init(params), rng=step_rng)


def abstract_state(model, tx, image_shape, seed: int = 0) -> TrainState:
  return jax.eval_shape(functools.partial(_init_state, model, tx, image_shape),
                        seed)


def state_shardings(abstract: TrainState, tx, mesh, fsdp_min_size=2**18, *,
                    axes=None, rules=(), overrides=()):
  """Shardings of a state: params by the rules, optimiser slots likewise."""
  params = shd.param_shardings(abstract.params, mesh, fsdp_min_size,
                               axes=axes, rules=rules, overrides=overrides)
  rep = shd.replicated(mesh)
  opt = optax.tree_map_params(
      tx, lambda _, s: s, abstract.opt_state, params,
      transform_non_params=lambda _: rep,
      is_leaf=lambda x: isinstance(x, NamedSharding))
  return TrainState(step=rep, params=params, opt_state=opt, rng=rep)


def train_step(state: TrainState, batch: Dict[str, jax.Array], *,
               model: nn.Module, tx: optax.GradientTransformation,
               lr_fn: Callable[[Any], Any], loss: str = 'softmax',
               label_smoothing: float = 0.0, accum_steps: int = 1
               ) -> Tuple[TrainState, Dict[str, jax.Array]]:
  """One optimiser step on a global batch (split in `accum_steps` parts)."""
  rng = jax.random.fold_in(state.rng, state.step)

  def loss_of(params, images, labels, rng):
    with nn.logical_axis_rules(shd.ACTIVATION_RULES):
      logits = model.apply({'params': params}, images, train=True,
                           rngs={'dropout': rng})
    return loss_fn(logits, labels, loss, label_smoothing)

  grad_fn = jax.value_and_grad(loss_of)
  if accum_steps == 1:
    value, grads = grad_fn(state.params, batch['image'], batch['label'], rng)
  else:
    # Micro-batch i takes examples i, i + accum, ...: every device keeps
    # feeding every micro-batch from its own shard.
    def split(x):
      x = x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:])
      x = jnp.swapaxes(x, 0, 1)
      return jax.lax.with_sharding_constraint(
          x, P(None, shd.BATCH, *([None] * (x.ndim - 2))))
    micro = jax.tree.map(split, batch)

    def body(carry, xs):
      i, mb = xs
      v, g = grad_fn(state.params, mb['image'], mb['label'],
                     jax.random.fold_in(rng, i))
      return jax.tree.map(jnp.add, carry, (v, g)), None

    zeros = (jnp.zeros((), jnp.float32),
             jax.tree.map(jnp.zeros_like, state.params))
    (value, grads), _ = jax.lax.scan(body, zeros,
                                     (jnp.arange(accum_steps), micro))
    value, grads = jax.tree.map(lambda x: x / accum_steps, (value, grads))

  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  # param_norm is finite only if every parameter is: with loss and
  # grad_norm it tells, on device and for one reduction, whether the new
  # state may be checkpointed (the loop checks it before every save).
  metrics = {'loss': value, 'grad_norm': optax.tree.norm(grads),
             'param_norm': optax.tree.norm(params),
             'lr': jnp.asarray(lr_fn(state.step), jnp.float32)}
  return state.replace(step=state.step + 1, params=params,
                       opt_state=opt_state), metrics


def compile_train_step(model, tx, lr_fn, state_sh, mesh,
                       cfg: Mapping[str, Any], label_ndim: int = 1):
  """The jitted train step with explicit shardings; the state is donated.

  `label_ndim` is 1 for class ids, 2 for soft or multi-hot training labels;
  `cfg` is the run's config or any mapping with its `loss`,
  `label_smoothing` and `accum_steps` keys (defaults where absent).
  """
  img = shd.batch_sharding(mesh, 4)
  lab = shd.batch_sharding(mesh, label_ndim)
  rep = shd.replicated(mesh)
  train = jax.jit(
      functools.partial(train_step, model=model, tx=tx, lr_fn=lr_fn,
                        loss=cfg.get('loss', 'softmax'),
                        label_smoothing=cfg.get('label_smoothing', 0.0),
                        accum_steps=cfg.get('accum_steps', 1)),
      in_shardings=(state_sh, {'image': img, 'label': lab}),
      out_shardings=(state_sh, rep), donate_argnums=(0,))
  return train
