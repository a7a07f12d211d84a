r"""Memory and speed of one train step across values of one model option.

    python -m benchmarks.variants --option=remat \
        --values=False,nothing_saveable,dots_with_no_batch_dims_saveable,dots_saveable \
        --model=ViT-B/16 --batch=32 --time_model=ViT-Ti/16 --time_batch=16
    python -m benchmarks.variants --option=attention_impl --values=xla,explicit \
        --model=ViT-B/16 --batch=8 --time_model=ViT-S/16 --time_batch=8

Memory: XLA's compiled memory analysis of the jitted train step (temporaries
= activations kept for the backward pass plus scratch), compile only, so
large models are measured without running them. Speed: img/s of the smaller
`--time_model`, every value timed in interleaved rounds in one process, so
the values share whatever else the machine is doing. Used for
docs/models.md (remat policies) and docs/performance.md (attention).
"""

import time

from absl import app, flags

_OPTION = flags.DEFINE_string('option', 'remat', 'Model option varied.')
_VALUES = flags.DEFINE_list('values', ['False', 'nothing_saveable'],
                            'Its values (True/False/None parsed).')
_MODEL = flags.DEFINE_string('model', 'ViT-B/16', 'Model for memory.')
_BATCH = flags.DEFINE_integer('batch', 32, 'Batch for memory.')
_DTYPE = flags.DEFINE_string('dtype', 'bfloat16', 'Compute dtype.')
_TIME_MODEL = flags.DEFINE_string('time_model', 'ViT-Ti/16', 'Model timed '
                                  '("" skips timing).')
_TIME_BATCH = flags.DEFINE_integer('time_batch', 16, 'Batch timed.')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Interleaved timing rounds.')
_STEPS = flags.DEFINE_integer('steps', 4, 'Timed steps per round.')


def _step(name, batch, dtype, option, value):
  import jax
  import jax.numpy as jnp
  import optax
  from vit_jax import models
  model = models.create(name, num_classes=1000, dtype=jnp.dtype(dtype),
                        scan_layers=True, **{option: value})
  x = jnp.zeros((batch, 224, 224, 3))
  y = jnp.zeros((batch,), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), x[:1]))
  tx = optax.adam(1e-3)
  opt = jax.eval_shape(tx.init, params)

  def step(params, opt, x, y):
    def loss(p):
      logits = model.apply(p, x, train=True)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    g = jax.grad(loss)(params)
    u, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, u), opt

  return jax.jit(step, donate_argnums=(0, 1)), params, opt, x, y


def main(_):
  import jax
  import numpy as np
  from vit_jax.models.registry import parse_option
  values = [parse_option(v) for v in _VALUES.value]
  option = _OPTION.value
  print(f'memory: {_MODEL.value}, batch {_BATCH.value}, {_DTYPE.value}, '
        f'scan_layers, compiled for {jax.devices()[0].device_kind}')
  for v in values:
    fn, params, opt, x, y = _step(_MODEL.value, _BATCH.value, _DTYPE.value,
                                  option, v)
    m = fn.lower(params, opt, x, y).compile().memory_analysis()
    print(f'  {option}={v!s:34} temporaries '
          f'{m.temp_size_in_bytes / 2**30:6.2f} GiB, arguments '
          f'{m.argument_size_in_bytes / 2**30:5.2f} GiB', flush=True)
  if not _TIME_MODEL.value:
    return
  print(f'speed: {_TIME_MODEL.value}, batch {_TIME_BATCH.value}, '
        f'{_DTYPE.value}, img/s per round', flush=True)
  runs = {}
  for v in values:
    fn, params, opt, x, y = _step(_TIME_MODEL.value, _TIME_BATCH.value,
                                  _DTYPE.value, option, v)
    rng = np.random.default_rng(0)
    # Weights' scale, never zeros (which can time faster); the optimiser
    # state starts at zero, as Adam's does.
    init = lambda s, scale: jax.tree.map(
        lambda a: (scale * rng.standard_normal(a.shape)).astype(a.dtype), s)
    state = list(fn(init(params, 0.02), init(opt, 0.0), x, y))
    jax.block_until_ready(state)
    runs[str(v)] = (fn, state, x, y)
  times = {k: [] for k in runs}
  for _ in range(_ROUNDS.value):
    for k, (fn, state, x, y) in runs.items():
      t = time.perf_counter()
      for _ in range(_STEPS.value):
        state[:] = fn(*state, x, y)
      jax.block_until_ready(state)
      times[k].append(_STEPS.value * x.shape[0] / (time.perf_counter() - t))
  for k, t in times.items():
    print(f'  {option}={k:34} ' + ', '.join(f'{v:.2f}' for v in t) +
          f'  (median {np.median(t):.2f})')


if __name__ == '__main__':
  app.run(main)
