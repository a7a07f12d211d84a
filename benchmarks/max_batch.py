"""The largest batch whose train step fits on this machine, and its speed.

    python -m benchmarks.max_batch --model=ViT-L/16 --dtype=bfloat16 \
        --batches=256,512,1024,2048 \
        --model_option=remat=nothing_saveable --model_option=scan_layers=True

Runs `python -m vit_jax.bench` for each batch in `--batches` (ascending), each
in a fresh process, until one fails (out of memory, or past `--timeout`);
prints one markdown row per batch: img/s, MFU against the nominal peak, the
device's peak memory and compile time, and which batch was the largest that
ran. On a GPU, JAX pre-allocates 75% of the device by default; this sets
`XLA_PYTHON_CLIENT_MEM_FRACTION` (default 0.95) for the runs so that the
largest batch is the card's, not the allocator's default share.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_one(args, batch: int) -> Dict[str, Any]:
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, 'res.json')
    cmd = [sys.executable, '-m', 'vit_jax.bench', f'--model={args.model}',
           f'--batch={batch}', f'--dtype={args.dtype}',
           f'--image_size={args.image_size}', f'--steps={args.steps}',
           f'--warmup={args.warmup}', '--nomatmul_peak', f'--json={out}',
           *(f'--model_option={o}' for o in args.model_option)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2',
               XLA_PYTHON_CLIENT_MEM_FRACTION=str(args.mem_fraction),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=args.timeout)
    except subprocess.TimeoutExpired:
      return {'batch': batch, 'error': f'over --timeout={args.timeout}s'}
    if proc.returncode or not os.path.exists(out):
      lines = proc.stderr.strip().splitlines()
      why = next((l for l in reversed(lines) if 'RESOURCE_EXHAUSTED' in l
                  or 'out of memory' in l.lower()), lines[-1] if lines else '?')
      return {'batch': batch, 'error': why.strip()[:300]}
    with open(out, encoding='utf-8') as f:
      return json.load(f)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--model', default='ViT-B/16')
  p.add_argument('--dtype', default='bfloat16',
                 choices=('float32', 'bfloat16'))
  p.add_argument('--image_size', type=int, default=224)
  p.add_argument('--batches', default='64,128,256,512,1024,2048')
  p.add_argument('--model_option', action='append', default=[],
                 help='As vit_jax.bench\'s, e.g. remat=nothing_saveable.')
  p.add_argument('--steps', type=int, default=3)
  p.add_argument('--warmup', type=int, default=1)
  p.add_argument('--timeout', type=float, default=300)
  p.add_argument('--mem_fraction', type=float, default=0.95)
  p.add_argument('--json', default=None)
  return p


def main(argv=None):
  args = _parser().parse_args(argv)
  batches = sorted(int(b) for b in args.batches.split(','))
  rows: List[Dict[str, Any]] = []
  for batch in batches:
    rows.append(run_one(args, batch))
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if 'error' in rows[-1]:
      break
  ok = [r for r in rows if 'error' not in r]
  print(f'{args.model}, {args.dtype}, {args.image_size} px, options '
        f'{" ".join(args.model_option) or "none"}; '
        f'device {ok[0]["device_kind"] if ok else "?"}\n')
  print('| batch | img/s | MFU (nominal) | peak device memory GiB | '
        'compile s |\n|---|---|---|---|---|')
  for r in rows:
    if 'error' in r:
      print(f'| {r["batch"]} | failed: {r["error"][:120]} | | | |')
      continue
    mfu = r.get('mfu_nominal')
    mem = r.get('peak_device_memory_gb')
    print(f'| {r["batch"]} | {r["img_per_s"]:.1f} | '
          + (f'{mfu:.1%}' if mfu is not None else '-') + ' | '
          + (f'{mem:.1f}' if mem is not None else '-')
          + f' | {r["compile_s"]:.0f} |')
  print(f'\nlargest batch that ran: {ok[-1]["batch"] if ok else "none"}'
        + ('' if len(ok) < len(rows) else ' (every batch tried ran)'))
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(rows, f, indent=2)


if __name__ == '__main__':
  main()
