"""Runs a few train steps of a tiny ViT under one mesh; prints JSON results.

Used by the tests in a subprocess, so that the number of simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=N) can differ per run:
    python tests/mesh_steps.py '{"data": -1, "fsdp": 1, "model": 1}'
With {"num_processes": 2, "process_id": i, "coordinator": "host:port"} as
second argument it is one process of a multi-process run (gloo collectives
on CPU); each process feeds its own rows of the same global batches.
"""

import json
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import jax  # noqa: E402
import ml_collections  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from vit_jax import models, selfsup  # noqa: E402
from vit_jax.train import optim  # noqa: E402
from vit_jax import sharding as shd  # noqa: E402
from vit_jax.train import step as step_lib  # noqa: E402


def digits_batches(batch, steps):
  """Real 8x8 digits, upscaled to 16x16, in [-1, 1], as 3 channels."""
  d = load_digits()
  x = np.kron(d.images, np.ones((2, 2)))[..., None] / 8.0 - 1.0
  x = np.repeat(x, 3, axis=-1).astype(np.float32)
  y = d.target.astype(np.int32)
  for i in range(steps):
    idx = np.arange(i * batch, (i + 1) * batch) % len(y)
    yield {'image': x[idx], 'label': y[idx]}


def main():
  mesh_cfg = json.loads(sys.argv[1])
  extra = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
  if extra.get('num_processes'):
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(extra['coordinator'], extra['num_processes'],
                               extra['process_id'])
  mesh = shd.make_mesh(**mesh_cfg)
  model = models.create('ViT-test', num_classes=10, hidden_size=32,
                        num_heads=4, mlp_dim=64, patch_size=4)
  objective = extra.get('objective', 'supervised')
  if objective == 'mpp':  # Masked patch prediction: images only.
    model = selfsup.from_vit(model)
  cfg = ml_collections.ConfigDict(dict(
      name='adam', lr=1e-3, warmup_steps=2, decay='cosine', weight_decay=0.1,
      grad_clip_norm=1.0))
  steps = 4
  tx, lr_fn = optim.make(cfg, steps)
  state, sh = step_lib.create_state(model, tx, 0, (16, 16, 3), mesh,
                                    fsdp_min_size=extra.get('fsdp_min', 1))
  train = step_lib.compile_train_step(
      model, tx, lr_fn, sh, mesh, ml_collections.ConfigDict(
          {'accum_steps': extra.get('accum', 1), 'objective': objective}))
  losses = []
  n, i = jax.process_count(), jax.process_index()
  with jax.set_mesh(mesh):
    for b in digits_batches(32, steps):
      b = {k: jax.make_array_from_process_local_data(
          shd.batch_sharding(mesh, v.ndim), np.split(v, n)[i])
           for k, v in b.items() if k in step_lib.batch_keys(
               ml_collections.ConfigDict({'objective': objective}))}
      state, m = train(state, b)
      losses.append(float(m['loss']))
  specs = {'/'.join(str(getattr(k, 'key', k)) for k in path): str(
      leaf.sharding.spec) for path, leaf in
      jax.tree_util.tree_flatten_with_path(state.params)[0]}
  gathered = multihost_utils.process_allgather(state.params, tiled=True)
  params = {k: np.asarray(v).ravel()[:8].tolist() for k, v in
            zip(specs, jax.tree.leaves(gathered))}
  print(json.dumps({'losses': losses, 'devices': jax.device_count(),
                    'processes': n,
                    'mesh': dict(mesh.shape), 'specs': specs,
                    'params': params}))


if __name__ == '__main__':
  main()
