"""The train step's loss curve on fixed real data, to compare backends.

    python -m benchmarks.losses [--model=ViT-Ti/16] [--image_size=64]
        [--batch=32] [--steps=30] [--dtype=bfloat16] [--json=cpu.json]
    python -m benchmarks.losses ... --compare=cpu.json  # on the GPU

Runs the real train step (`vit_jax.bench`'s set-up: Adam, lr 1e-3, weight
decay 0.1, global-norm clipping at 1; lr 1e-4 by default, where the
curve descends steadily, so that differences are not amplified by chaotic
steps) from the same seed on scikit-learn's
1,797 real 8x8 `digits` (bundled with scikit-learn, so it runs with no
download and no TensorFlow), each image scaled up to `image_size` and
repeated over three channels, in a fixed order. Parameters are drawn with
threefry, which gives the same numbers on every backend, so two backends
start from the same state and see the same batches: their losses differ only
by the backends' arithmetic. With `--compare`, prints the per-step absolute
and relative differences against a curve saved on another backend and
fails (exit 1) when one exceeds `--rtol`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List


def digits_batches(batch: int, image_size: int, steps: int):
  """`steps` batches of scikit-learn digits in [-1, 1], (B, S, S, 3)."""
  import numpy as np
  from sklearn.datasets import load_digits
  d = load_digits()
  images = d.images.astype(np.float32) / 8.0 - 1.0  # 0..16 -> [-1, 1]
  reps = -(-image_size // 8)
  images = np.repeat(np.repeat(images, reps, 1), reps, 2)[
      :, :image_size, :image_size, None].repeat(3, -1)
  order = np.random.RandomState(0).permutation(len(images))
  for i in range(steps):
    idx = np.take(order, range(i * batch, (i + 1) * batch), mode='wrap')
    yield {'image': images[idx], 'label': d.target[idx].astype(np.int32)}


def curve(model: str, image_size: int, batch: int, steps: int,
          dtype: str, lr: float) -> Dict[str, Any]:
  import jax

  from vit_jax import bench
  from vit_jax import sharding as shd
  from vit_jax.train import step as step_lib

  net, mesh, tx, lr_fn, state, state_sh, _ = bench._setup(  # pylint: disable=protected-access
      model, batch, image_size, dtype, None, 10, 1, optimizer=True, lr=lr)
  train = step_lib.compile_train_step(net, tx, lr_fn, state_sh, mesh, {})
  losses: List[float] = []
  with jax.set_mesh(mesh):
    for host in digits_batches(batch, image_size, steps):
      data = {k: jax.device_put(v, shd.batch_sharding(mesh, v.ndim))
              for k, v in host.items()}
      state, metrics = train(state, data)
      losses.append(float(metrics['loss']))
  return {'model': model, 'image_size': image_size, 'batch': batch,
          'dtype': dtype, 'lr': lr, 'backend': jax.default_backend(),
          'device_kind': jax.devices()[0].device_kind, 'losses': losses}


def compare(a: Dict[str, Any], b: Dict[str, Any], rtol: float) -> bool:
  """Prints a step-by-step table of two curves; True when within rtol."""
  keys = ('model', 'image_size', 'batch', 'dtype', 'lr')
  if any(a[k] != b[k] for k in keys):
    raise SystemExit('--compare: the curves differ in settings: '
                     + ', '.join(f'{k} {a[k]} vs {b[k]}' for k in keys
                                 if a[k] != b[k]))
  print(f'| step | {a["device_kind"]} | {b["device_kind"]} | abs diff | '
        'rel diff |\n|---|---|---|---|---|')
  worst = 0.0
  for i, (x, y) in enumerate(zip(a['losses'], b['losses'])):
    rel = abs(x - y) / max(abs(y), 1e-12)
    worst = max(worst, rel)
    print(f'| {i} | {x:.4f} | {y:.4f} | {abs(x - y):.2e} | {rel:.2e} |')
  ok = worst <= rtol
  print(f'largest relative difference {worst:.2e} '
        f'({"within" if ok else "OVER"} rtol {rtol:g})')
  return ok


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--model', default='ViT-Ti/16')
  p.add_argument('--image_size', type=int, default=64)
  p.add_argument('--batch', type=int, default=32)
  p.add_argument('--steps', type=int, default=30)
  p.add_argument('--dtype', default='bfloat16',
                 choices=('float32', 'bfloat16'))
  p.add_argument('--lr', type=float, default=1e-4)
  p.add_argument('--json', default=None, help='Write the curve here.')
  p.add_argument('--compare', default=None,
                 help='A curve saved on another backend.')
  p.add_argument('--rtol', type=float, default=1e-2)
  return p


def main(argv=None):
  args = _parser().parse_args(argv)
  out = curve(args.model, args.image_size, args.batch, args.steps, args.dtype,
              args.lr)
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(out, f, indent=2)
  if args.compare:
    with open(args.compare, encoding='utf-8') as f:
      other = json.load(f)
    if not compare(out, other, args.rtol):
      sys.exit(1)
  else:
    print(json.dumps(out))


if __name__ == '__main__':
  main()
