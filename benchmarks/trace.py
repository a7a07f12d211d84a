"""Seconds to trace the train step: the mesh's step against the platform switch.

    python -m benchmarks.trace [--model=ViT-B/16] [--dtype=float32]
        [--batch=8] [--image_size=224] [--rounds=3]

Traces (`jax.jit(...).trace`, abstract inputs: nothing is computed or
compiled) the train step two ways, alternated within each round in one
process: `step.compile_train_step` on a one-device mesh of this host's
default device (on a CPU: every model switch takes its CPU branch,
`vit_jax.models.platform_switch`), and the same `step.train_step` jitted
bare, where every switch is a `lax.platform_dependent` conditional. Prints
the seconds per round as a markdown table row with the machine.
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys
import time
from typing import Dict, List, Optional, Sequence


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog='python -m benchmarks.trace',
                              description=__doc__.splitlines()[0])
  p.add_argument('--model', default='ViT-B/16')
  p.add_argument('--dtype', default='float32',
                 choices=('float32', 'bfloat16'))
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--image_size', type=int, default=224)
  p.add_argument('--rounds', type=int, default=3)
  return p


def measure(model_name: str, dtype: str, batch: int, image_size: int,
            rounds: int) -> Dict[str, List[float]]:
  """{'mesh step': [s per round], 'platform switch': [...]}."""
  import jax
  import jax.numpy as jnp
  from vit_jax import models, sharding as shd
  from vit_jax.train import optim, step as step_lib
  model = models.create(model_name, num_classes=1000, dtype=jnp.dtype(dtype))
  tx, lr_fn = optim.make(optim.Settings(
      name='adam', lr=1e-3, warmup_steps=10, decay='cosine',
      weight_decay=0.1, grad_clip_norm=1.0), 100)
  mesh = shd.make_mesh(data=-1)
  shape = (image_size, image_size, 3)
  abstract, state_sh = step_lib.planned_state(model, tx, shape, mesh)
  batch_ = {'image': jax.ShapeDtypeStruct((batch, *shape), jnp.float32),
            'label': jax.ShapeDtypeStruct((batch,), jnp.int32)}
  makers = {
      'mesh step': lambda: step_lib.compile_train_step(
          model, tx, lr_fn, state_sh, mesh, {}),
      'platform switch': lambda: jax.jit(functools.partial(
          step_lib.train_step, model=model, tx=tx, lr_fn=lr_fn)),
  }
  out = {k: [] for k in makers}
  with jax.set_mesh(mesh):
    for _ in range(rounds):
      for kind, make in makers.items():
        fn = make()  # A fresh function: jit caches traces per function.
        start = time.perf_counter()
        fn.trace(abstract, batch_)
        out[kind].append(time.perf_counter() - start)
  return out


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  import jax
  times = measure(args.model, args.dtype, args.batch, args.image_size,
                  args.rounds)
  print(f'{args.model}, {args.dtype}, batch {args.batch}, '
        f'{args.image_size} px; {jax.devices()[0].platform}, '
        f'{platform.processor() or platform.machine()}, jax {jax.__version__}')
  print('| model | dtype | ' + ' | '.join(f'{k} (s)' for k in times) + ' |')
  print('|---|---|' + '---|' * len(times))
  print(f'| {args.model} | {args.dtype} | ' + ' | '.join(
      ', '.join(f'{t:.2f}' for t in v) for v in times.values()) + ' |')
  return 0


if __name__ == '__main__':
  sys.exit(main())
