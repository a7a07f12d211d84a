"""ViT train step and eval forward: vit_jax against its peers, side by side.

    python -m benchmarks.peers [--model=ViT-B/16] [--batch=8] [--image_size=224]
        [--dtypes=float32,bfloat16] [--modes=train,infer] [--rounds=2]
        [--steps=5] [--peers=ours,flax_default,hf,timm] [--json=out.json]
        # peers: any of ours, flax_default, hf, timm, timm_compile

Every measurement runs in a fresh process (so that each reports its own peak
resident memory), one implementation after the other within a round, the
rounds interleaved (A B C, A B C): on a shared or throttling machine each
round sees the same conditions for all. `--huge_pages` (default `own`): each
implementation runs in the environment its own command runs in (ours, like
`python -m vit_jax.main`, with huge pages for host memory where they help,
`vit_jax.hugepages`); `all` gives them to PyTorch too; `none` to no one
(a huge-page tunable in this process's GLIBC_TUNABLES is not passed on).
Prints one markdown table with the machine, the date and every figure;
ratios against `ours` of the same round.

Implementations (same model size, batch, resolution and dtype; train =
softmax cross-entropy, AdamW (lr 1e-3, weight decay 0.1), global-norm
clipping at 1; infer = logits, no gradient):
  ours          `python -m vit_jax.bench` (the real train step / eval forward)
  flax_default  the same modules with flax's default matmul (`lax.dot_general`
                in the compute dtype: bf16 x bf16 -> bf16) in every product,
                the dense layers' and the CPU attention core's batched ones
                (`flax_default_matmul`), the form the reference
                vision_transformer code and big_vision's `dtype_mm` use; no
                CPU form of ours (oneDNN, f32 upcasts) is left in it. bf16
                only (in fp32 it is `ours`)
  hf            Hugging Face `transformers` ViTForImageClassification, PyTorch
                (bf16 training: float32 weights under `torch.autocast`
                bf16, the PyTorch AMP convention; bf16 inference: the
                model's weights and inputs converted to bf16, also under
                autocast, since ours serves bf16 matmul weights: both sides
                hold and read bf16 weights. PyTorch's LayerNorm parameters
                become bf16 too, ours stay float32: 0.05% of ViT-B/16's.)
  timm          `timm` vit_*_patch*_* , PyTorch, same conventions as hf
  timm_compile  the same timm model under `torch.compile` (compiled during
                the warm-up steps; give it --warmup >= 2)
A peer whose package is missing is reported as unavailable, with the reason.
On a machine with a GPU, JAX and PyTorch both run there (PyTorch on `cuda`,
timed after `torch.cuda.synchronize()`), and each row also reports the
device's peak memory (JAX `memory_stats`, `torch.cuda.max_memory_allocated`).
There float32 means TF32 matmuls on both sides (JAX's default precision
allows them; PyTorch's peers set `allow_tf32`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = ('ours', 'flax_default', 'hf', 'timm', 'timm_compile')

# vit_jax zoo name -> (hidden, mlp, heads, layers, patch) and timm name.
_DIMS = {'Ti': (192, 768, 3, 12), 'S': (384, 1536, 6, 12),
         'B': (768, 3072, 12, 12), 'L': (1024, 4096, 16, 24),
         'H': (1280, 5120, 16, 32)}
_TIMM = {'Ti': 'tiny', 'S': 'small', 'B': 'base', 'L': 'large', 'H': 'huge'}


def _dims(model: str):
  width, patch = model.split('-', 1)[1].split('/')
  return (*_DIMS[width], int(patch)), _TIMM[width]


# ---------------------------------------------------------------------------
# One measurement (child process).


def _peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _flax_batched(a, b, out_dtype, *, trans_a: bool = False,
                  trans_b: bool = False):
  """`matmul.cpu_batched` as flax's default computes it: one
  `lax.dot_general` in the operands' dtype (bf16 x bf16 -> bf16, no
  float32 result), the stored transposes folded into its dimension
  numbers, then cast to `out_dtype` (as flax's attention casts its bf16
  logits for the softmax)."""
  from jax import lax
  dn = (((1 if trans_a else 2,), (2 if trans_b else 1,)), ((0,), (0,)))
  return lax.dot_general(a, b, dn).astype(out_dtype)


@contextlib.contextmanager
def flax_default_matmul():
  """Inside, the modules' products are flax's default all through: the
  dense layers' `matmul.dot_general` and the CPU attention core's batched
  products (`matmul.cpu_batched`) are plain `lax.dot_general`s in the
  compute dtype, so no CPU form of ours (oneDNN's custom call, f32
  upcasts, float32 accumulation) is left in the step. Both are looked up
  in `matmul` at trace time (`matmul.dot_general_for`, `attention`)."""
  from jax import lax
  from vit_jax.models import matmul
  saved = matmul.dot_general, matmul.cpu_batched
  matmul.dot_general, matmul.cpu_batched = lax.dot_general, _flax_batched
  try:
    yield
  finally:
    matmul.dot_general, matmul.cpu_batched = saved


def _jax(args, flax_default: bool) -> Dict[str, Any]:
  from vit_jax import bench
  with (flax_default_matmul() if flax_default else contextlib.nullcontext()):
    return _jax_run(args, bench)


def _jax_run(args, bench) -> Dict[str, Any]:
  kw = dict(image_size=args.image_size, dtype=args.dtype, steps=args.steps,
            warmup=args.warmup, num_classes=args.num_classes,
            measure_peak=False)
  if args.mode == 'train':
    res = bench.bench_train_step(args.model, args.batch, **kw)
  else:
    res = bench.bench_infer(args.model, args.batch, **kw)
  out = {'img_per_s': res['img_per_s'], 'compile_s': res['compile_s'],
         'cpu_matmul_form': res.get('cpu_matmul_form'),
         'device_kind': res['device_kind'],
         'peak_host_memory_gb': _peak_rss_gb()}
  if 'peak_device_memory_gb' in res:
    out['peak_device_memory_gb'] = res['peak_device_memory_gb']
  return out


def torch_step(args, kind: str):
  """(step, sync, device): one train step or eval forward of the PyTorch
  peer `kind` ('hf', 'timm', 'timm_compile') as `args` describe it (model,
  batch, image_size, num_classes, dtype, mode); `sync()` waits for the
  device. Also what `benchmarks.op_profile --peer` profiles."""
  import torch
  torch.manual_seed(0)
  (hidden, mlp, heads, layers, patch), timm_width = _dims(args.model)
  if kind == 'hf':
    from transformers import ViTConfig, ViTForImageClassification
    model = ViTForImageClassification(ViTConfig(
        image_size=args.image_size, patch_size=patch, hidden_size=hidden,
        intermediate_size=mlp, num_attention_heads=heads,
        num_hidden_layers=layers, num_labels=args.num_classes))
    forward = lambda x: model(pixel_values=x).logits
  else:
    import timm
    # timm registers _224 and _384 variants only; img_size sets the size.
    model = timm.create_model(
        f'vit_{timm_width}_patch{patch}_224', pretrained=False,
        num_classes=args.num_classes, img_size=args.image_size)
    forward = model
    if kind == 'timm_compile':
      forward = torch.compile(model)
  device = 'cuda' if torch.cuda.is_available() else 'cpu'
  if device == 'cuda':
    # The same float32 work as ours: JAX's default precision lets XLA run
    # float32 matmuls and convolutions as TF32 on GPUs that have it;
    # PyTorch's default does not.
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
  # bf16 inference serves bf16 weights, as ours does (`vit_jax.bench`'s
  # infer mode stores its matmul weights in bf16 once, `serving_params`):
  # under autocast alone PyTorch would keep float32 weights and cast them
  # to bf16 at every forward (more memory, other work). Training keeps
  # float32 master weights under autocast on both sides.
  serve_bf16 = args.mode == 'infer' and args.dtype == 'bfloat16'
  weights = torch.bfloat16 if serve_bf16 else torch.float32
  model.to(device, dtype=weights)
  x = (torch.rand(args.batch, 3, args.image_size, args.image_size) * 2 - 1
       ).to(device, dtype=weights)
  y = torch.randint(0, args.num_classes, (args.batch,)).to(device)
  amp = torch.autocast(device, dtype=torch.bfloat16,
                       enabled=args.dtype == 'bfloat16')
  sync = torch.cuda.synchronize if device == 'cuda' else (lambda: None)
  if args.mode == 'train':
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def step():
      opt.zero_grad(set_to_none=True)
      with amp:
        loss = torch.nn.functional.cross_entropy(forward(x), y)
      loss.backward()
      torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
      opt.step()
  else:
    model.eval()

    def step():
      with torch.inference_mode(), amp:
        forward(x)
  return step, sync, device


def _torch(args, kind: str) -> Dict[str, Any]:
  import torch
  step, sync, device = torch_step(args, kind)
  times = []
  for i in range(args.warmup + args.steps):
    t = time.perf_counter()
    step()
    sync()
    if i >= args.warmup:
      times.append(time.perf_counter() - t)
  out = {'img_per_s': args.batch / statistics.median(times),
         'torch_threads': torch.get_num_threads(),
         'device_kind': (torch.cuda.get_device_name() if device == 'cuda'
                         else 'cpu'),
         'peak_host_memory_gb': _peak_rss_gb()}
  if device == 'cuda':
    out['peak_device_memory_gb'] = torch.cuda.max_memory_allocated() / 2**30
  return out


def _child(args) -> Dict[str, Any]:
  if args.peer in ('ours', 'flax_default'):
    return _jax(args, args.peer == 'flax_default')
  return _torch(args, args.peer)


# ---------------------------------------------------------------------------
# The comparison (parent process).


def _versions() -> Dict[str, str]:
  from importlib import metadata
  out = {}
  for name in ('jax', 'jaxlib', 'flax', 'torch', 'transformers', 'timm'):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  return out


def cpu_name() -> str:
  try:
    out = subprocess.run(['lscpu'], capture_output=True, text=True).stdout
    info = dict(l.split(':', 1) for l in out.splitlines() if ':' in l)
    name = info.get('Model name', '').strip()
    flags = set(info.get('Flags', '').split())
    extras = [f for f in ('avx512_bf16', 'amx_bf16', 'amx_tile') if f in flags]
    if 'avx512f' not in flags and 'avx2' in flags:
      extras.append('AVX2, no AVX512')  # No bf16 matmul instructions either.
    return (f'{name}, {os.cpu_count()} CPUs'
            + (f' ({", ".join(extras)})' if extras else ''))
  except OSError:
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
  """The first NVIDIA GPU's name (nvidia-smi), or None."""
  try:
    out = subprocess.run(['nvidia-smi', '--query-gpu=name,memory.total',
                          '--format=csv,noheader'], capture_output=True,
                         text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return None
  lines = out.stdout.strip().splitlines()
  return f'{len(lines)} x {lines[0]}' if out.returncode == 0 and lines else None


def _unavailable(peer: str) -> str | None:
  modules = {'hf': ('torch', 'transformers'), 'timm': ('torch', 'timm'),
             'timm_compile': ('torch', 'timm')}
  for module in modules.get(peer, ()):
    out = subprocess.run([sys.executable, '-c', f'import {module}'],
                         capture_output=True, text=True)
    if out.returncode:
      return f'import {module} fails: ' + (out.stderr.strip().splitlines()
                                           or ['?'])[-1][:160]
  return None


def _run_one(args, peer, mode, dtype) -> Dict[str, Any]:
  cmd = [sys.executable, '-m', 'benchmarks.peers', '--child', f'--peer={peer}',
         f'--mode={mode}', f'--dtype={dtype}', f'--model={args.model}',
         f'--batch={args.batch}', f'--image_size={args.image_size}',
         f'--steps={args.steps}', f'--warmup={args.warmup}',
         f'--num_classes={args.num_classes}']
  from vit_jax import hugepages
  huge = args.huge_pages == 'all' or (args.huge_pages == 'own'
                                      and peer in ('ours', 'flax_default'))
  base = hugepages.environ() if huge else dict(os.environ)
  if args.huge_pages == 'none':
    base[hugepages.ENV] = '0'
    hugepages.remove_tunable(base)
  env = dict(base, PYTHONPATH=ROOT + os.pathsep +
             os.environ.get('PYTHONPATH', ''), TF_CPP_MIN_LOG_LEVEL='2')
  out = subprocess.run(cmd, capture_output=True, text=True, env=env,
                       cwd=ROOT)
  if out.returncode:
    return {'error': out.stderr.strip()[-600:]}
  return json.loads(out.stdout.strip().splitlines()[-1])


def compare(args) -> Dict[str, Any]:
  peers = [p for p in args.peers.split(',') if p]
  unknown = sorted(set(peers) - set(PEERS))
  if unknown:
    raise SystemExit(f'--peers: unknown {unknown}; choose from {PEERS}')
  missing = {p: _unavailable(p) for p in peers}
  rows: Dict[str, List[Dict[str, Any]]] = {}
  meta = {'date': datetime.datetime.now(datetime.timezone.utc).strftime(
      '%Y-%m-%d %H:%M UTC'),
          'machine': ', '.join(filter(None, (gpu_name(), cpu_name()))),
          'versions': _versions(), 'load_before': os.getloadavg(),
          'command': 'python -m benchmarks.peers ' + ' '.join(sys.argv[1:])}
  for r in range(args.rounds):
    for mode in args.modes.split(','):
      for dtype in args.dtypes.split(','):
        for peer in peers:
          if missing[peer] or (peer == 'flax_default' and dtype != 'bfloat16'):
            continue
          res = _run_one(args, peer, mode, dtype)
          res.update(round=r)
          rows.setdefault(f'{peer}|{mode}|{dtype}', []).append(res)
          print(f'round {r} {peer:>12} {mode:>5} {dtype:>8}: '
                f'{res.get("img_per_s", float("nan")):.3f} img/s, '
                f'{res.get("peak_host_memory_gb", float("nan")):.2f} GB'
                + (f'  ERROR {res["error"]}' if 'error' in res else ''),
                file=sys.stderr, flush=True)
  meta['load_after'] = os.getloadavg()
  return {'meta': meta, 'rows': rows,
          'unavailable': {p: m for p, m in missing.items() if m}}


def table(result: Dict[str, Any], args) -> str:
  meta, rows = result['meta'], result['rows']
  lines = [
      f'{args.model}, batch {args.batch}, {args.image_size} px, '
      f'{args.steps} timed steps (median) per measurement, {args.rounds} '
      f'interleaved rounds. {meta["date"]}; {meta["machine"]}; load average '
      f'{meta["load_before"][0]:.1f} before, {meta["load_after"][0]:.1f} '
      f'after; ' + ', '.join(f'{k} {v}' for k, v in meta['versions'].items()),
      f'Command: `{meta["command"]}`', '',
      '| implementation | mode | dtype | img/s per round | vs ours (same '
      'round) | peak host memory GB | peak device memory GB |',
      '|---|---|---|---|---|---|---|']
  for key, runs in rows.items():
    peer, mode, dtype = key.split('|')
    ours = rows.get(f'ours|{mode}|{dtype}', [])
    speeds = [r.get('img_per_s') for r in runs]
    ratios = [f'{s / o["img_per_s"]:.2f}' for s, o in zip(speeds, ours)
              if s and o.get('img_per_s')]
    mem = max((r.get('peak_host_memory_gb', 0) for r in runs), default=0)
    dev = [r['peak_device_memory_gb'] for r in runs
           if 'peak_device_memory_gb' in r]
    form = runs[0].get('cpu_matmul_form') if peer == 'ours' else None
    name = peer + (f' (CPU matmul form {form})' if form else '')
    lines.append(
        f'| {name} | {mode} | {dtype} | '
        + ', '.join('error' if s is None else f'{s:.2f}' for s in speeds)
        + f' | {", ".join(ratios) if peer != "ours" else "1"} | {mem:.2f} | '
        + (f'{max(dev):.2f} |' if dev else '- |'))
  for peer, why in result['unavailable'].items():
    lines.append(f'\n{peer}: unavailable ({why})')
  return '\n'.join(lines)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--model', default='ViT-B/16')
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--image_size', type=int, default=224)
  p.add_argument('--num_classes', type=int, default=1000)
  p.add_argument('--dtypes', default='float32,bfloat16')
  p.add_argument('--modes', default='train,infer')
  p.add_argument('--peers', default='ours,flax_default,hf,timm')
  p.add_argument('--rounds', type=int, default=2)
  p.add_argument('--steps', type=int, default=5)
  p.add_argument('--warmup', type=int, default=2)
  p.add_argument('--json', default=None)
  p.add_argument(
      '--huge_pages', choices=('own', 'all', 'none'), default='own',
      help='own: each implementation in the environment its own command '
      'runs in (ours with huge pages for host memory where they help, '
      'vit_jax.hugepages; PyTorch as this process has it); all: every '
      'implementation with them; none: none (an inherited '
      'glibc.malloc.hugetlb tunable is removed, other tunables kept)')
  # One measurement (used by the comparison itself).
  p.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  p.add_argument('--peer', choices=PEERS, help=argparse.SUPPRESS)
  p.add_argument('--mode', choices=('train', 'infer'), help=argparse.SUPPRESS)
  p.add_argument('--dtype', choices=('float32', 'bfloat16'),
                 help=argparse.SUPPRESS)
  return p


def main(argv=None):
  args = _parser().parse_args(argv)
  if args.child:
    print(json.dumps(_child(args)))
    return
  result = compare(args)
  print(table(result, args))
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(result, f, indent=2)


if __name__ == '__main__':
  main()
