"""The attention core alone (q, k, v -> output): ours against PyTorch's.

    python -m benchmarks.attention [--batch=8] [--tokens=197] [--heads=12]
        [--head_dim=64] [--dtype=bfloat16] [--rounds=3] [--repeats=20]
        [--peers=ours,torch] [--attention_impl=auto]

`ours` is the function the encoder blocks call (`attention.attention_fn`
with the backward pass recomputing, as in training, and the implementation
`--attention_impl` names: `auto`, the default, is what `attention.resolve`
picks for this platform; the table names the one that ran); `torch` is
`torch.nn.functional.scaled_dot_product_attention` (PyTorch picks its
kernel). Each measurement runs in a fresh process (JAX's and PyTorch's
thread pools in one process slowed both, by up to 2.5x), on the same
inputs, one implementation after the other within a round, the rounds
interleaved; all processes get this one's environment (huge pages where
`vit_jax.hugepages` adds them). "forward" is the output alone;
"forward + backward" the output and the gradients of q, k and v for a fixed
random cotangent. Each figure is the median of `--repeats` calls, in ms. The
defaults are one ViT-B/16 layer at batch 8. Prints a markdown table with the
machine and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = ('ours', 'torch')
PASSES = ('forward', 'forward + backward')


def _median_ms(fn: Callable[[], None], repeats: int) -> float:
  fn()  # Compiled / warmed up outside the timing.
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return 1e3 * statistics.median(times)


def _inputs(args):
  import numpy as np
  rng = np.random.default_rng(0)
  shape = (args.batch, args.tokens, args.heads, args.head_dim)
  return [rng.standard_normal(shape, dtype=np.float32) for _ in range(4)]


def ours(args) -> Dict[str, Callable[[], None]]:
  """The two passes of our attention core, compiled, as callables."""
  import jax
  import jax.numpy as jnp
  from vit_jax.models import attention

  dtype = jnp.dtype(args.dtype)
  impl = attention.resolve(args.attention_impl, jax.devices()[0].platform,
                           dtype)
  args.ran = impl
  fn = attention.attention_fn(impl, recompute=True)
  q, k, v, g = (jnp.asarray(x, dtype) for x in _inputs(args))
  forward = jax.jit(lambda q, k, v: fn(q, k, v))
  both = jax.jit(lambda q, k, v, g: jax.vjp(fn, q, k, v)[1](g))
  return {'forward': lambda: jax.block_until_ready(forward(q, k, v)),
          'forward + backward': lambda: jax.block_until_ready(
              both(q, k, v, g))}


def torch_sdpa(args) -> Dict[str, Callable[[], None]]:
  """The same two passes with PyTorch's scaled_dot_product_attention."""
  import torch
  device = 'cuda' if torch.cuda.is_available() else 'cpu'
  dtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16}[args.dtype]
  # PyTorch's layout: (batch, heads, tokens, head_dim).
  q, k, v, g = (torch.from_numpy(x).to(device, dtype).transpose(1, 2)
                .contiguous() for x in _inputs(args))
  sdpa = torch.nn.functional.scaled_dot_product_attention

  def sync():
    if device == 'cuda':
      torch.cuda.synchronize()

  def forward():
    with torch.no_grad():
      sdpa(q, k, v)
    sync()

  leaves = [x.detach().requires_grad_() for x in (q, k, v)]

  def both():
    out = sdpa(*leaves)
    torch.autograd.grad(out, leaves, g)
    sync()
  return {'forward': forward, 'forward + backward': both}


_PEERS = {'ours': ours, 'torch': torch_sdpa}


def _child(args) -> Dict[str, float]:
  fns = _PEERS[args.peer](args)
  times = {name: _median_ms(fns[name], args.repeats) for name in PASSES}
  return dict(times, ran=getattr(args, 'ran', None))


def _run_one(args, peer: str):
  """{pass: ms} from a fresh process, or a string saying why not."""
  cmd = [sys.executable, '-m', 'benchmarks.attention', '--child',
         f'--peer={peer}', f'--batch={args.batch}', f'--tokens={args.tokens}',
         f'--heads={args.heads}', f'--head_dim={args.head_dim}',
         f'--dtype={args.dtype}', f'--repeats={args.repeats}',
         f'--attention_impl={args.attention_impl}']
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                        check=False)
  lines = proc.stdout.strip().splitlines()
  if proc.returncode or not lines:
    last = (proc.stderr.strip().splitlines() or ['no output'])[-1]
    return f'failed ({last})'
  return json.loads(lines[-1])


def compare(args) -> Dict[str, Any]:
  """{row label: {pass: [ms per round]}}, or {label: why it did not run};
  ours is labelled with the attention implementation that ran."""
  result: Dict[str, Any] = {p: {n: [] for n in PASSES} for p in args.peers}
  ran: Dict[str, str] = {}
  for _ in range(args.rounds):
    for peer in args.peers:
      if isinstance(result[peer], str):
        continue
      got = _run_one(args, peer)
      if isinstance(got, str):
        result[peer] = got
        continue
      for name in PASSES:
        result[peer][name].append(got[name])
      if got.get('ran'):
        ran[peer] = got['ran']
  return {(f'{p} ({ran[p]})' if p in ran else p): rows
          for p, rows in result.items()}


def _threads(result) -> str:
  if not isinstance(result.get('torch', ''), dict):
    return ''
  import torch
  return f'; PyTorch {torch.__version__}, {torch.get_num_threads()} threads'


def table(result, args) -> str:
  from benchmarks import peers
  when = datetime.datetime.now(datetime.timezone.utc).strftime(
      '%Y-%m-%d %H:%M UTC')
  lines = [
      f'{args.batch} x {args.tokens} tokens, {args.heads} heads of '
      f'{args.head_dim}, {args.dtype}; median of {args.repeats} calls per '
      f'figure, {args.rounds} interleaved rounds. {when}; '
      f'{peers.cpu_name()} ({platform.machine()}){_threads(result)}', '',
      '| implementation | pass | ms per round |', '|---|---|---|']
  for peer, rows in result.items():
    if isinstance(rows, str):
      lines.append(f'| {peer} | - | {rows} |')
      continue
    for name, ms in rows.items():
      lines.append(f'| {peer} | {name} | '
                   f'{", ".join(f"{m:.2f}" for m in ms)} |')
  return '\n'.join(lines)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--tokens', type=int, default=197)
  p.add_argument('--heads', type=int, default=12)
  p.add_argument('--head_dim', type=int, default=64)
  p.add_argument('--dtype', choices=('float32', 'bfloat16'),
                 default='bfloat16')
  p.add_argument('--rounds', type=int, default=3)
  p.add_argument('--repeats', type=int, default=20)
  p.add_argument('--peers', default=','.join(PEERS),
                 type=lambda s: [x for x in s.split(',') if x])
  p.add_argument('--attention_impl', default='auto',
                 help='ours: auto, xla, cudnn or explicit')
  p.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  p.add_argument('--peer', choices=PEERS, help=argparse.SUPPRESS)
  return p


def main(argv=None) -> str:
  args = _parser().parse_args(argv)
  if args.child:
    print(json.dumps(_child(args)))
    return ''
  unknown = sorted(set(args.peers) - set(PEERS))
  if unknown:
    raise SystemExit(f'--peers: unknown {unknown}; choose from {PEERS}')
  from vit_jax.models import attention
  try:
    attention.check(args.attention_impl)
  except ValueError as e:
    raise SystemExit(f'--attention_impl: {e}') from None
  text = table(compare(args), args)
  print(text)
  return text


if __name__ == '__main__':
  from vit_jax import hugepages
  hugepages.reexec()  # As `vit_jax.bench` runs.
  main()
