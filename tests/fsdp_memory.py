"""Compiles (never runs) a train step on simulated devices; prints per-device
memory as JSON. No weights are materialised: the state is abstract
(`jax.ShapeDtypeStruct`s carrying their shardings).

    python tests/fsdp_memory.py ViT-L/16 '{"data": 1, "fsdp": 8}' \
        '{"scan_layers": true, "remat": true}' [batch] [image_size]
(run with XLA_FLAGS=--xla_force_host_platform_device_count=8).
"""

import json
import math
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from vit_jax import models  # noqa: E402
from vit_jax import sharding as shd  # noqa: E402
from vit_jax.train import optim  # noqa: E402
from vit_jax.train import step as step_lib  # noqa: E402


def _bytes(tree, per_device: bool) -> int:
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = (leaf.sharding.shard_shape(leaf.shape) if per_device
             else leaf.shape)
    total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
  return total


def main():
  name, mesh_cfg, overrides = sys.argv[1], json.loads(sys.argv[2]), (
      json.loads(sys.argv[3]))
  batch = int(sys.argv[4]) if len(sys.argv) > 4 else 8
  size = int(sys.argv[5]) if len(sys.argv) > 5 else 224
  mesh = shd.make_mesh(**mesh_cfg)
  model = models.create(name, num_classes=1000, dtype=jnp.bfloat16,
                        **overrides)
  tx, lr_fn = optim.make(optim.Settings(
      name='adam', lr=1e-3, warmup_steps=0, decay='constant',
      weight_decay=0.1, grad_clip_norm=1.0), 1000)
  shape = (size, size, 3)
  abstract = step_lib.abstract_state(model, tx, shape)
  sh = step_lib.state_shardings(abstract, tx, mesh,
                                axes=shd.logical_axes(model, shape))
  state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract, sh)
  batch_in = {
      'image': jax.ShapeDtypeStruct((batch, *shape), jnp.float32,
                                    sharding=shd.batch_sharding(mesh, 4)),
      'label': jax.ShapeDtypeStruct((batch,), jnp.int32,
                                    sharding=shd.batch_sharding(mesh, 1))}
  train = step_lib.compile_train_step(model, tx, lr_fn, sh, mesh, {})
  with jax.set_mesh(mesh):
    compiled = train.lower(state, batch_in).compile()
  mem = compiled.memory_analysis()
  out_state = compiled.output_shardings[0]
  state_bytes = _bytes(state, per_device=False)
  print(json.dumps({
      'devices': jax.device_count(), 'mesh': dict(mesh.shape),
      'param_bytes': _bytes(state.params, per_device=False),
      'state_bytes': state_bytes,
      'state_bytes_per_device': _bytes(state, per_device=True),
      'out_state_bytes_per_device': sum(
          math.prod(s.shard_shape(a.shape)) * jnp.dtype(a.dtype).itemsize
          for a, s in zip(jax.tree.leaves(abstract),
                          jax.tree.leaves(out_state))),
      'batch_bytes_per_device': _bytes(batch_in, per_device=True),
      'argument_bytes': mem.argument_size_in_bytes,
      'output_bytes': mem.output_size_in_bytes,
      'temp_bytes': mem.temp_size_in_bytes,
  }))


if __name__ == '__main__':
  main()
