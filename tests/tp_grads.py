"""Loss and gradients of a small BiT on one device and under a mesh; JSON.

Run in a subprocess with 8 simulated CPU devices (see test_sharding.py):
    python tests/tp_grads.py '{"data": 2, "model": 4}' [jax|numpy]
`numpy` draws the parameters from numpy instead of the model's init (see
test_sharding.py's known failure).
A gradient comparison, not a training run: Adam turns float32 rounding in
near-zero early gradients into O(lr) steps, which hides what sharding did.
"""

import json
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from vit_jax import models  # noqa: E402
from vit_jax import sharding as shd  # noqa: E402
from vit_jax.train import step as step_lib  # noqa: E402


def numpy_init(model, x, rs):
  """Numpy values of the model's shapes: normal kernels scaled by fan-in,
  scales near 1, small non-zero biases (the known-failure case)."""
  def value(path, leaf):
    n = rs.standard_normal(leaf.shape).astype(np.float32)
    name = jax.tree_util.keystr(path[-1:])
    if 'kernel' in name:
      return n / np.sqrt(np.prod(leaf.shape[:-1]))
    return (1.0 if 'scale' in name else 0.0) + 0.05 * n

  shapes = jax.eval_shape(model.init, jax.random.key(0), x)['params']
  return jax.tree_util.tree_map_with_path(value, shapes)


def main():
  mesh = shd.make_mesh(**json.loads(sys.argv[1]))
  init_name = sys.argv[2] if len(sys.argv) > 2 else 'jax'
  model = models.create('BiT-R50x1', num_classes=10, depth=26,
                        width_factor=0.5)
  rs = np.random.RandomState(0)
  x = jnp.asarray(rs.uniform(-1, 1, (8, 32, 32, 3)), jnp.float32)
  y = jnp.arange(8) % 10

  @jax.jit  # One program: eagerly, init compiles ~1,300 small ones (15 s).
  def init():
    params = model.init(jax.random.key(0), x)['params']
    return jax.tree.map(  # A non-zero head, so every gradient is non-zero.
        lambda a: a + 0.05 * jax.random.normal(jax.random.key(1), a.shape),
        params)

  params = init() if init_name == 'jax' else numpy_init(model, x, rs)
  grad = jax.jit(jax.value_and_grad(
      lambda p, x: step_lib.loss_fn(model.apply({'params': p}, x), y)))
  loss1, g1 = grad(params, x)
  sh = shd.param_shardings(params, mesh,
                           axes=shd.logical_axes(model, (32, 32, 3)))
  with jax.set_mesh(mesh):
    loss2, g2 = grad(jax.device_put(params, sh),
                     jax.device_put(x, shd.batch_sharding(mesh)))
  rel = max(float(np.abs(a - np.asarray(b)).max() / np.abs(a).max())
            for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)))
  print(json.dumps({'devices': jax.device_count(), 'loss': [float(loss1),
                                                            float(loss2)],
                    'grad_rel_diff': rel,
                    'conv_spec': list(sh['block3']['unit1']['conv2']
                                      ['kernel'].spec)}))


if __name__ == '__main__':
  main()
