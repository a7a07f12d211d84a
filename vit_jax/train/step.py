"""The train state and the pure, jitted train step.

`train_step(state, batch) -> (state, metrics)` is a plain function of its
inputs; the loop jits it once with explicit shardings (see
`compile_train_step`). Evaluation lives in `vit_jax/evaluators/`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from vit_jax import losses, selfsup
from vit_jax.models import platform_switch
from vit_jax import sharding as shd
from vit_jax.train import optim, param_groups



@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimiser steps taken.
  params: Any
  opt_state: Any
  rng: jax.Array  # uint32[2]: dropout/mixup randomness, folded with `step`.
  # Polyak averages of `params` (optim.ema_decay), sharded like them; None
  # without EMA (the checkpoints of such runs have no such entry).
  ema_params: Any = None


def loss_fn(logits: jax.Array, labels: jax.Array, kind: str = 'softmax',
            label_smoothing: float = 0.0) -> jax.Array:
  """Mean loss; `labels` are class ids (N,) or (soft / multi-hot) (N, K).

  K may be below the head's classes (mixup's labels have the dataset's
  class count, a head `config.num_classes` wide may have more): the extra
  classes are targets of zero, as class ids one-hot to the head's width."""
  losses.check(kind)
  if labels.ndim == 1:
    targets = jax.nn.one_hot(labels, logits.shape[-1])
  else:
    extra = logits.shape[-1] - labels.shape[-1]
    if extra < 0:
      raise ValueError(f'labels have {labels.shape[-1]} classes but the '
                       f'head only {logits.shape[-1]}: set num_classes to '
                       'at least the dataset\'s class count')
    targets = jnp.pad(labels.astype(jnp.float32), ((0, 0), (0, extra)))
  if label_smoothing:
    targets = optax.smooth_labels(targets, label_smoothing)
  return losses.per_example(logits, targets, kind).mean()


def create_state(model: nn.Module, tx: optax.GradientTransformation,
                 seed: int, image_shape, mesh: jax.sharding.Mesh,
                 fsdp_min_size: int = 2**18, *, rules=(), overrides=(),
                 ema: bool = False) -> Tuple[TrainState, Any]:
  """A fresh state, created already sharded; returns (state, shardings).

  Parameters are placed by the model's logical-axis annotations, `rules`
  and `overrides` (see `sharding.param_shardings`). `ema`: the state keeps
  Polyak averages of the parameters, starting equal to them.
  """
  _, shardings = planned_state(model, tx, image_shape, mesh, fsdp_min_size,
                               rules=rules, overrides=overrides, ema=ema)
  return init_state(model, tx, seed, image_shape, mesh, shardings,
                    ema=ema), shardings


def init_state(model: nn.Module, tx: optax.GradientTransformation,
               seed: int, image_shape, mesh: jax.sharding.Mesh, shardings,
               *, ema: bool = False) -> TrainState:
  """A fresh state computed straight into `shardings` (`planned_state`'s):
  no device ever holds more than its shard."""
  init = functools.partial(_init_state, model, tx, image_shape, ema=ema)
  with jax.set_mesh(mesh):
    return jax.jit(init, out_shardings=shardings)(seed)


def planned_state(model: nn.Module, tx: optax.GradientTransformation,
                  image_shape, mesh: jax.sharding.Mesh,
                  fsdp_min_size: int = 2**18, *, rules=(), overrides=(),
                  ema: bool = False) -> Tuple[TrainState, Any]:
  """(abstract state, shardings) of `create_state`'s state, nothing
  computed: for callers that fill the parameters themselves (a restore).
  The model's init is traced once, for the shapes and the axis names."""
  boxed = shd.abstract_params(model, image_shape)
  abstract = _abstract_state(tx, boxed, ema)
  return abstract, state_shardings(
      abstract, tx, mesh, fsdp_min_size, axes=shd.axes_of(boxed),
      rules=rules, overrides=overrides)


def abstract_state(model: nn.Module, tx: optax.GradientTransformation,
                   image_shape, *, ema: bool = False) -> TrainState:
  """The shapes and dtypes of `init_state`'s state, nothing computed."""
  return _abstract_state(tx, shd.abstract_params(model, image_shape), ema)


def _abstract_state(tx, boxed_params, ema: bool) -> TrainState:
  return jax.eval_shape(
      lambda p: _state_of(tx, p, jax.random.PRNGKey(0), ema=ema),
      nn.meta.unbox(boxed_params))


def _init_state(model, tx, image_shape, seed, ema=False):
  params_rng, step_rng = jax.random.split(jax.random.PRNGKey(seed))
  params = model.init(params_rng, jnp.zeros((1, *image_shape), jnp.float32),
                      train=False)['params']
  return _state_of(tx, params, step_rng, ema=ema)


def _state_of(tx, params, step_rng, ema=False):
  """The train state around fresh `params`."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=tx.init(params), rng=step_rng,
                    ema_params=optim.ema_init(params) if ema else None)


def state_shardings(abstract: TrainState, tx, mesh, fsdp_min_size=2**18, *,
                    axes=None, rules=(), overrides=()):
  """Shardings of a state: params by the rules, optimiser slots likewise."""
  params = shd.param_shardings(abstract.params, mesh, fsdp_min_size,
                               axes=axes, rules=rules, overrides=overrides)
  rep = shd.replicated(mesh)
  opt = _like_params(abstract.opt_state, abstract.params, params, rep)
  ema = params if abstract.ema_params is not None else None
  return TrainState(step=rep, params=params, opt_state=opt, rng=rep,
                    ema_params=ema)


def _dict_path(path) -> Tuple[str, ...]:
  """The trailing dict keys of a key path: a parameter's path inside any
  optimiser-state wrapper (chain index, field name, multi_transform group,
  masked subtree)."""
  keys = []
  for k in reversed(path):
    if not isinstance(k, jax.tree_util.DictKey):
      break
    keys.append(str(k.key))
  return tuple(reversed(keys))


def _like_params(opt_state, abstract_params, param_sh, default):
  """Shardings of an optimiser state: each slot that mirrors a parameter
  (same path and shape: Adam's mu / nu, momentum) is sharded like it, the
  rest (counts, scalars) gets `default`. Matching by path, not by calling
  the optimiser's init on placeholders, works for every wrapper: frozen or
  scheduled groups (multi_transform) and masks included."""
  by_path = {}
  for (path, a), (_, sh) in zip(
      jax.tree_util.tree_flatten_with_path(abstract_params)[0],
      jax.tree_util.tree_flatten_with_path(
          param_sh, is_leaf=lambda x: isinstance(x, NamedSharding))[0]):
    by_path[_dict_path(path)] = (tuple(a.shape), sh)

  def one(path, leaf):
    hit = by_path.get(_dict_path(path))
    return hit[1] if hit and hit[0] == tuple(leaf.shape) else default
  return jax.tree_util.tree_map_with_path(one, opt_state)


def train_step(state: TrainState, batch: Dict[str, jax.Array], *,
               model: nn.Module, tx: optax.GradientTransformation,
               lr_fn: Callable[[Any], Any], loss: str = 'softmax',
               label_smoothing: float = 0.0, accum_steps: int = 1,
               objective: str = 'supervised',
               ema: Optional[Mapping[str, Any]] = None,
               frozen: Optional[str] = None,
               ) -> Tuple[TrainState, Dict[str, jax.Array]]:
  """One optimiser step on a global batch (split in `accum_steps` parts).

  `frozen`: the optim config's regex of parameters never updated (`tx`
  zeroes their updates); `grad_norm` is the norm over the trained ones, the
  gradient the optimiser (and its clipping) sees.

  A state with `ema_params` also updates them, with the decay of
  `optim.ema_decay_at(ema, step)` (`ema`: the optim config's ema_decay and
  ema_warmup).

  `objective='supervised'`: `loss` on the model's logits and `batch['label']`;
  `'mpp'`: masked patch prediction (`model` is a
  `selfsup.MaskedPatchPrediction`; only `batch['image']` is read).
  """
  if state.ema_params is not None and not (ema or {}).get('ema_decay'):
    raise ValueError('the train state holds EMA parameters but no ema_decay '
                     'was given: pass the optim config as `ema`')
  rng = jax.random.fold_in(state.rng, state.step)

  def loss_of(params, mb, rng):
    if objective == 'mpp':
      dropout_rng, mpp_rng = jax.random.split(rng)
      with nn.logical_axis_rules(shd.ACTIVATION_RULES):
        outputs, selected = model.apply(
            {'params': params}, mb['image'], train=True,
            rngs={'dropout': dropout_rng, 'mpp': mpp_rng})
      return selfsup.loss_and_metrics(
          outputs, selected, mb['image'], target=model.target,
          stride=model.stride, bits=model.bits)
    with nn.logical_axis_rules(shd.ACTIVATION_RULES):
      logits = model.apply({'params': params}, mb['image'], train=True,
                           rngs={'dropout': rng})
    return loss_fn(logits, mb['label'], loss, label_smoothing), {}

  grad_fn = jax.value_and_grad(loss_of, has_aux=True)
  if accum_steps == 1:
    (value, aux), grads = grad_fn(state.params, batch, rng)
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
      (v, a), g = grad_fn(state.params, mb, jax.random.fold_in(rng, i))
      g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
      return jax.tree.map(jnp.add, carry, (v, a, g)), None

    aux_shape = jax.eval_shape(
        lambda: grad_fn(state.params, jax.tree.map(lambda x: x[0], micro),
                        rng)[0][1])
    # The gradient sum in float32 whatever the parameters' dtype: 16
    # bfloat16 micro-batch sums were ~1% off the one-batch update.
    zeros = (jnp.zeros((), jnp.float32),
             jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape),
             jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32),
                          state.params))
    (value, aux, grads), _ = jax.lax.scan(body, zeros,
                                          (jnp.arange(accum_steps), micro))
    value, aux, grads = jax.tree.map(lambda x: x / accum_steps,
                                     (value, aux, grads))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)

  if frozen:  # Before the update: XLA need not compute what is unused.
    trained = param_groups.trainable(grads, frozen)
    grads = jax.tree.map(lambda g, t: g if t else jnp.zeros_like(g), grads,
                         trained)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  # param_norm is finite only if every parameter is: with loss and
  # grad_norm it tells, on device and for one reduction, whether the new
  # state may be checkpointed (the loop checks it before every save).
  metrics = {'loss': value, 'grad_norm': optax.tree.norm(grads),
             'param_norm': optax.tree.norm(params),
             'lr': jnp.asarray(lr_fn(state.step), jnp.float32), **aux}
  ema_params = state.ema_params
  if ema_params is not None:
    ema_params = optim.ema_update(ema_params, params,
                                  optim.ema_decay_at(ema, state.step))
  return state.replace(step=state.step + 1, params=params,
                       opt_state=opt_state, ema_params=ema_params), metrics


def batch_keys(cfg: Mapping[str, Any]) -> Tuple[str, ...]:
  """The batch entries the train step reads: MPP never reads labels."""
  return (('image',) if cfg.get('objective', 'supervised') == 'mpp'
          else ('image', 'label'))


def _ema_settings(cfg: Mapping[str, Any]) -> Dict[str, Any]:
  """The optim config's EMA fields, as the train step reads them."""
  o = cfg.get('optim') or {}
  return {'ema_decay': o.get('ema_decay') or 0.0,
          'ema_warmup': o.get('ema_warmup', True)}


def compile_train_step(model, tx, lr_fn, state_sh, mesh,
                       cfg: Mapping[str, Any], label_ndim: int = 1):
  """The jitted train step with explicit shardings; the state is donated.

  `label_ndim` is 1 for class ids, 2 for soft or multi-hot training labels;
  `cfg` is the run's config or any mapping with its `loss`,
  `label_smoothing`, `accum_steps`, `objective` and `optim` (its
  `ema_decay`, `ema_warmup`) keys (defaults where absent). With
  `objective='mpp'` the batch is `{'image': ...}` only (see `batch_keys`).
  The step is the program for the mesh's platform: on CPUs it is traced
  with the models' CPU branches only (`platform_switch.tracing_for`), so
  export `jax.jit(partial(train_step, ...))` for other platforms, not this.
  """
  img = shd.batch_sharding(mesh, 4)
  lab = shd.batch_sharding(mesh, label_ndim)
  rep = shd.replicated(mesh)
  objective = cfg.get('objective', 'supervised')
  batch_sh = {k: {'image': img, 'label': lab}[k] for k in batch_keys(cfg)}
  step = functools.partial(train_step, model=model, tx=tx, lr_fn=lr_fn,
                           loss=cfg.get('loss', 'softmax'),
                           label_smoothing=cfg.get('label_smoothing', 0.0),
                           accum_steps=cfg.get('accum_steps', 1),
                           objective=objective, ema=_ema_settings(cfg),
                           frozen=(cfg.get('optim') or {}).get('frozen'))
  train = jax.jit(
      platform_switch.traced_for(shd.platform(mesh), step),
      in_shardings=(state_sh, batch_sh),
      out_shardings=(state_sh, rep), donate_argnums=(0,))
  return train
