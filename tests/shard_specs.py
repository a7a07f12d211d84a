"""Prints the parameter shardings of a model under one mesh as JSON.

Run in a subprocess (`shard_specs(...)` below) so that the number of
simulated CPU devices can differ from the test process:
    python tests/shard_specs.py BiT-R50x1 '{"model": 8}' '[64, 64, 3]' [module]
`module` (optional) is imported first: a test file registering a family.
"""

import importlib
import json
import os
import subprocess
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import jax  # noqa: E402
import numpy as np  # noqa: E402

from vit_jax import models  # noqa: E402
from vit_jax import sharding as shd  # noqa: E402


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # This checkout's vit_jax, not an installed one.


def shard_specs(name, mesh, image_shape, module=None):
  """{path: [spec, shape]} of `name`'s parameters on 8 simulated devices."""
  from conftest import xla_flags  # Not when run as the subprocess.
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT,
             XLA_FLAGS=xla_flags(8))
  args = [sys.executable, os.path.abspath(__file__), name, json.dumps(mesh),
          json.dumps(list(image_shape))]
  out = subprocess.run(args + ([module] if module else []),
                       capture_output=True, text=True, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads(out.stdout.strip().splitlines()[-1])
  assert res['devices'] == 8
  return res['params']


def main():
  name, mesh_cfg, image_shape = sys.argv[1], json.loads(sys.argv[2]), tuple(
      json.loads(sys.argv[3]))
  if len(sys.argv) > 4:
    sys.path.insert(0, HERE)
    importlib.import_module(sys.argv[4])
  mesh = shd.make_mesh(**mesh_cfg)
  model = models.create(name, num_classes=16)
  abstract = jax.eval_shape(model.init, jax.random.key(0),
                            np.zeros((1, *image_shape), np.float32))['params']
  sh = shd.param_shardings(abstract, mesh,
                           axes=shd.logical_axes(model, image_shape))
  flat = jax.tree_util.tree_flatten_with_path(sh)[0]
  shapes = jax.tree.leaves(abstract)
  out = {'/'.join(str(getattr(k, 'key', k)) for k in path): [
      list(s.spec) + [None] * (len(a.shape) - len(s.spec)), list(a.shape)]
         for (path, s), a in zip(flat, shapes)}
  print(json.dumps({'devices': jax.device_count(), 'params': out}))


if __name__ == '__main__':
  main()
