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
fails (exit 1) when one exceeds `--rtol`, when either curve has a
non-finite loss (a run that diverged is no match, whatever the other one
did), or when the curves differ in settings or length (`steps` included:
a run that stopped early is not compared on its first steps only).
"""

from __future__ import annotations

import argparse
import json
import math
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
          'steps': steps, 'dtype': dtype, 'lr': lr,
          'backend': jax.default_backend(),
          'device_kind': jax.devices()[0].device_kind, 'losses': losses}


def _steps(c: Dict[str, Any]) -> int:
  """The steps a curve was run for (curves saved before `steps` was
  recorded: the length of their losses)."""
  return c.get('steps', len(c['losses']))


def _problems(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
  """Why two curves of the same settings cannot pass, one line per reason:
  a curve shorter or longer than its steps, or a non-finite loss (NaN
  never exceeds a tolerance in a comparison, so it must be looked for)."""
  out = []
  for c in (a, b):
    name = f'the {c.get("device_kind", "?")} ({c.get("backend", "?")}) curve'
    if len(c['losses']) != _steps(c):
      out.append(f'{name} has {len(c["losses"])} losses for its '
                 f'{_steps(c)} steps')
    bad = [i for i, x in enumerate(c['losses']) if not math.isfinite(x)]
    if bad:
      out.append(f'{name} has non-finite losses at steps {bad[:10]}'
                 + (f' and {len(bad) - 10} more' if len(bad) > 10 else ''))
  return out


def compare(a: Dict[str, Any], b: Dict[str, Any], rtol: float) -> bool:
  """Prints a step-by-step table of two curves; True when every step is
  within rtol. Curves of other settings (model, size, batch, steps, dtype,
  lr) are an error (SystemExit); a non-finite loss or a curve of another
  length than its steps fails, with a line saying why."""
  keys = ('model', 'image_size', 'batch', 'steps', 'dtype', 'lr')
  values = {k: (_steps(a), _steps(b)) if k == 'steps' else (a[k], b[k])
            for k in keys}
  if any(x != y for x, y in values.values()):
    raise SystemExit('--compare: the curves differ in settings: '
                     + ', '.join(f'{k} {x} vs {y}'
                                 for k, (x, y) in values.items() if x != y))
  print(f'| step | {a["device_kind"]} | {b["device_kind"]} | abs diff | '
        'rel diff |\n|---|---|---|---|---|')
  worst = 0.0
  for i, (x, y) in enumerate(zip(a['losses'], b['losses'])):
    rel = abs(x - y) / max(abs(y), 1e-12)
    if math.isfinite(rel):
      worst = max(worst, rel)
    print(f'| {i} | {x:.4f} | {y:.4f} | {abs(x - y):.2e} | {rel:.2e} |')
  problems = _problems(a, b)
  for line in problems:
    print(f'FAIL: {line}')
  ok = worst <= rtol and not problems
  print(f'largest relative difference {worst:.2e} of finite losses '
        f'({"within" if worst <= rtol else "OVER"} rtol {rtol:g})'
        + ('; failed: ' + '; '.join(problems) if problems else ''))
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
