r"""Memory and speed of each remat policy for one train step (docs/performance.md).

    python benchmarks/remat.py --model=ViT-B/16 --batch=32 --dtype=bfloat16 \
        --time_model=ViT-Ti/16 --time_batch=16

Memory: XLA's compiled memory analysis of the jitted train step (temporaries
= activations kept for the backward pass plus scratch), compile only, so
large models are measured without running them. Speed: steps/s of the
smaller `--time_model`, each policy timed in interleaved rounds.
"""

import time

from absl import app, flags

_MODEL = flags.DEFINE_string('model', 'ViT-B/16', 'Model for memory.')
_BATCH = flags.DEFINE_integer('batch', 32, 'Batch for memory.')
_DTYPE = flags.DEFINE_string('dtype', 'bfloat16', 'Compute dtype.')
_TIME_MODEL = flags.DEFINE_string('time_model', 'ViT-Ti/16', 'Model timed.')
_TIME_BATCH = flags.DEFINE_integer('time_batch', 16, 'Batch timed.')
_ROUNDS = flags.DEFINE_integer('rounds', 2, 'Interleaved timing rounds.')
_STEPS = flags.DEFINE_integer('steps', 4, 'Timed steps per round.')

POLICIES = (False, 'nothing_saveable', 'dots_with_no_batch_dims_saveable',
            'dots_saveable')


def _step(name, batch, dtype, remat):
  import jax
  import jax.numpy as jnp
  import optax
  from vit_jax import models
  model = models.create(name, num_classes=1000, dtype=jnp.dtype(dtype),
                        scan_layers=True, remat=remat)
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
  print(f'memory: {_MODEL.value}, batch {_BATCH.value}, {_DTYPE.value}, '
        f'scan_layers, compiled for {jax.devices()[0].device_kind}')
  for remat in POLICIES:
    fn, params, opt, x, y = _step(_MODEL.value, _BATCH.value, _DTYPE.value,
                                  remat)
    m = fn.lower(params, opt, x, y).compile().memory_analysis()
    print(f'  remat={remat!s:34} temporaries {m.temp_size_in_bytes / 2**30:6.2f}'
          f' GiB, arguments {m.argument_size_in_bytes / 2**30:5.2f} GiB')
  print(f'speed: {_TIME_MODEL.value}, batch {_TIME_BATCH.value}, '
        f'{_DTYPE.value}, img/s per round')
  runs = {}
  for remat in POLICIES:
    fn, params, opt, x, y = _step(_TIME_MODEL.value, _TIME_BATCH.value,
                                  _DTYPE.value, remat)
    init = lambda s: jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), s)
    state = [init(params), init(opt)]
    state = list(fn(*state, x, y))
    jax.block_until_ready(state)
    runs[remat] = (fn, state, x, y)
  times = {r: [] for r in POLICIES}
  for _ in range(_ROUNDS.value):
    for remat, (fn, state, x, y) in runs.items():
      t = time.perf_counter()
      for _ in range(_STEPS.value):
        state[:] = fn(*state, x, y)
      jax.block_until_ready(state)
      times[remat].append(_STEPS.value * x.shape[0] /
                          (time.perf_counter() - t))
  for remat, t in times.items():
    print(f'  remat={remat!s:34} ' + ', '.join(f'{v:.2f}' for v in t))


if __name__ == '__main__':
  app.run(main)
