"""Where a train step's time goes, per XLA op, from a `jax.profiler` trace.

    python -m benchmarks.op_profile [--model=ViT-B/16] [--batch=8]
        [--image_size=224] [--dtype=bfloat16] [--steps=2] [--top=25]

Compiles the real train step (`vit_jax.bench`), runs it once, traces
`--steps` more with the host tracer at its most detailed level (on CPU every
XLA op is an event of the runtime's thread pool) and prints the time per op
category and the most expensive ops, summed over threads (so the total can
exceed wall time on several cores).
"""

from __future__ import annotations

import argparse
import collections
import glob
import tempfile
import time


def category(name: str) -> str:
  base = name.split('.')[0]
  if 'ynn' in base or 'xnn' in base or base.startswith('dot'):
    return 'matmul (library kernel / dot)'
  if base.startswith('convolution'):
    return 'convolution'
  if 'reduce' in base:
    return 'fusion with a reduction (LayerNorm, softmax, sums)'
  if base.startswith(('wrapped_convert', 'convert_convert', 'convert_bitcast',
                      'convert')) and base.count('_') <= 2:
    return 'dtype conversion'
  if 'transpose' in base or 'copy' in base:
    return 'transpose / copy'
  return 'other element-wise fusion'


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--model', default='ViT-B/16')
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--image_size', type=int, default=224)
  p.add_argument('--dtype', default='bfloat16')
  p.add_argument('--steps', type=int, default=2)
  p.add_argument('--top', type=int, default=25)
  args = p.parse_args(argv)

  import jax
  from vit_jax import bench
  from vit_jax.train import step as step_lib

  model, mesh, tx, lr_fn, state, sh, data = bench._setup(  # pylint: disable=protected-access
      args.model, args.batch, args.image_size, args.dtype, None, 1000, 1,
      optimizer=True)
  train = step_lib.compile_train_step(model, tx, lr_fn, sh, mesh, {})
  with jax.set_mesh(mesh), tempfile.TemporaryDirectory() as tmp:
    compiled = train.lower(state, data).compile()
    state, m = compiled(state, data)
    jax.block_until_ready(m)
    options = jax.profiler.ProfileOptions()
    options.host_tracer_level = 3
    jax.profiler.start_trace(tmp, profiler_options=options)
    t = time.perf_counter()
    for _ in range(args.steps):
      state, m = compiled(state, data)
    jax.block_until_ready((state, m))
    wall = (time.perf_counter() - t) / args.steps
    jax.profiler.stop_trace()
    [path] = glob.glob(f'{tmp}/plugins/profile/*/*.xplane.pb')
    profile = jax.profiler.ProfileData.from_file(path)
    per_op = collections.Counter()
    for plane in profile.planes:
      for line in plane.lines:
        if not line.name.startswith('tf_XLAEigen'):
          continue  # The XLA runtime's worker threads run the ops.
        for ev in line.events:
          if '::' not in ev.name:  # XLA ops, not the runtime's own events.
            per_op[ev.name] += ev.duration_ns / args.steps
  total = sum(per_op.values())
  by_cat = collections.Counter()
  for name, ns in per_op.items():
    by_cat[category(name)] += ns
  print(f'{args.model} batch {args.batch} {args.image_size} px {args.dtype}: '
        f'{wall:.3f} s/step wall, {total / 1e9:.3f} s of op time (all '
        'threads), per step')
  for cat, ns in by_cat.most_common():
    print(f'  {ns / 1e6:9.1f} ms  {100 * ns / total:5.1f}%  {cat}')
  print(f'top {args.top} ops:')
  for name, ns in per_op.most_common(args.top):
    print(f'  {ns / 1e6:9.1f} ms  {100 * ns / total:5.1f}%  {name}')


if __name__ == '__main__':
  main()
