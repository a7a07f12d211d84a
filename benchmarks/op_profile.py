"""Where a train step's time goes, per XLA op, from a `jax.profiler` trace.

    python -m benchmarks.op_profile [--model=ViT-B/16] [--batch=8]
        [--image_size=224] [--dtype=bfloat16] [--steps=2] [--top=25]
        [--mode=train|infer] [--trace_dir=DIR] [--peer=ours|hf|timm]

Compiles the real train step (`vit_jax.bench`), runs it once, traces
`--steps` more with the host tracer at its most detailed level and prints
the time per op category and the most expensive ops. On CPU an op's time is
the thread time spent on it, summed over the runtime's threads (so the
total can reach threads × wall time): its own event, plus the thread-pool
tasks it spawned (an Eigen dot's or a parallel loop's partitions, which run
outside any op's event), found through the pool's task records. On a GPU
or TPU the device's own timeline counts (kernels by the HLO op they run),
and wall time minus op time is the device's idle time. `--trace_dir` keeps
the trace (TensorBoard's profile plugin, or Perfetto through xprof).

`--peer=hf` or `--peer=timm` profiles the same step of that PyTorch peer
(`benchmarks.peers`; CPU only) with `torch.profiler` instead, in the same
categories, in the environment `benchmarks.peers` times it in (only ours
restarts with huge pages, `vit_jax.hugepages`). A PyTorch op runs on all
of its intra-op threads while the others wait, so its time is wall time:
compare it with this program's op time divided by the number of XLA:CPU
worker threads (XLA runs independent ops side by side, one thread each).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import os
import re
import tempfile
import time


MATMUL = 'matmul (library kernel / dot)'
ATTENTION = 'fused attention kernel (cuDNN; PyTorch SDPA)'
REDUCTION = 'fusion with a reduction (LayerNorm, softmax, sums)'
CONVERT = 'dtype conversion'
TRANSPOSE = 'transpose / copy'
ELEMENTWISE = 'other element-wise fusion'
# CPU thread time in thread-pool tasks that no op's event or task led to.
UNATTRIBUTED = 'thread-pool tasks of no op'
# PyTorch: the autograd engine's and the optimizer's own events (their
# self time: bookkeeping, dispatch), not an aten op's.
FRAMEWORK = 'framework (autograd engine, optimizer loop)'


def category(name: str, body_ops: frozenset = frozenset()) -> str:
  """An op's category from what its fused computation does (`body_ops`, the
  HLO opcodes in it, from `fused_ops`), else from its name."""
  if name == UNATTRIBUTED:
    return UNATTRIBUTED
  if body_ops:
    if any(op.startswith('custom-call:__cudnn$fmha') for op in body_ops):
      return ATTENTION
    if any(op.startswith(('custom-call:__cublas', 'custom-call:__triton_gemm',
                          'custom-call:vit_jax_onednn'))
           for op in body_ops):
      return MATMUL
    if any(op.startswith('custom-call:__cudnn$conv') for op in body_ops):
      return 'convolution'
    if body_ops & {'dot', 'convolution'}:
      return MATMUL if 'dot' in body_ops else 'convolution'
    if body_ops & {'reduce', 'reduce-window'}:
      return REDUCTION
    if body_ops <= {'convert', 'bitcast', 'parameter', 'reshape',
                    'broadcast', 'constant'}:
      return CONVERT if 'convert' in body_ops else TRANSPOSE
    if body_ops <= {'transpose', 'copy', 'bitcast', 'parameter', 'reshape',
                    'slice', 'concatenate', 'convert', 'broadcast'}:
      return TRANSPOSE
    return ELEMENTWISE
  base = name.split('.')[0]
  if re.search(r'sdpa|flash|fmha|cudnn::fusion', name):
    return ATTENTION
  if re.search(r'nvjet|gemm|cublas|xmma_g|sm\d+_xmma', name) and (
      'fprop' not in name and 'conv' not in name):
    return MATMUL
  if re.search(r'fprop|conv|nhwc', name):
    return 'convolution'
  if 'ynn' in base or 'xnn' in base or base.startswith('dot'):
    return MATMUL
  if base.startswith('convolution'):
    return 'convolution'
  if 'reduce' in base:
    return REDUCTION
  if base.startswith(('wrapped_convert', 'convert_convert', 'convert_bitcast',
                      'convert')) and base.count('_') <= 2:
    return CONVERT
  if 'transpose' in base or 'copy' in base:
    return TRANSPOSE
  return ELEMENTWISE


def torch_category(name: str) -> str:
  """A PyTorch CPU op's category (an event name of `torch.profiler`)."""
  if not name.startswith('aten::'):
    return FRAMEWORK
  op = name[len('aten::'):]
  if 'scaled_dot_product' in op or 'flash_attention' in op:
    return ATTENTION
  if re.fullmatch(r'_?(mm|addmm|bmm|baddbmm|matmul|linear|addmv|mv|dot|'
                  r'mkldnn_matmul|_addmm_activation)', op):
    return MATMUL
  if 'convolution' in op or op.startswith('conv'):
    return 'convolution'
  if re.search(r'layer_norm|softmax|^sum$|norm|^mean$|^var|^max$|^amax$|'
               r'^min$|nll_loss|cross_entropy', op):
    return REDUCTION
  if op in ('_to_copy', 'to'):
    return CONVERT
  if op in ('copy_', 'clone', 'contiguous', 'cat', 'transpose', 't',
            'permute', 'index', 'index_select', 'stack'):
    return TRANSPOSE
  return ELEMENTWISE


_HEADER = re.compile(r'^(?:ENTRY )?%?([\w.\-]+) \(.*\{$')
_INSTR = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = (?:\([^=]*?\)|\S+) '
                    r'([a-z][a-z0-9\-]*)\(')


def fused_ops(hlo_text: str) -> dict:
  """{instruction name: frozenset of the HLO opcodes it computes} from a
  compiled module's text (`as_text()`): a fusion's are those of the
  computation it calls; a custom call is `custom-call:<its target>` (GPU
  library calls: cuBLAS matmuls, cuDNN attention). YNNPACK fusions hold
  reductions as well as dots, so fusion names alone mislead."""
  bodies, current, instrs = {}, None, []
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = bodies.setdefault(header.group(1), set())
      continue
    instr = _INSTR.match(line)
    if instr:
      op = instr.group(2)
      if op == 'custom-call':
        target = re.search(r'custom_call_target="([^"]*)"', line)
        op = f'custom-call:{target.group(1) if target else "?"}'
      if current is not None:
        current.add(op)
      calls = re.search(r'calls=%?([\w.\-]+)', line)
      instrs.append((instr.group(1), op, calls.group(1) if calls else None))
  skip = {'parameter', 'tuple', 'get-tuple-element'}
  return {name: frozenset((bodies.get(calls, set()) if op == 'fusion'
                           else {op}) - skip)
          for name, op, calls in instrs}


def _source(hlo_text: str, name: str) -> str:
  """The jax operation an HLO instruction came from (its op_name's tail)."""
  m = re.search(r'%?' + re.escape(name) + r' = [^\n]*op_name="([^"]*)"',
                hlo_text)
  return '/'.join(m.group(1).split('/')[-3:]) if m else '?'


def _hlo_name(kernel: str, names) -> str:
  """The HLO instruction a GPU kernel runs, where its name says it; else
  the kernel's name (library kernels: cuBLAS, cuDNN). Kernels replayed from
  a CUDA graph carry the graph's `command_buffer` op as their `hlo_op`, and
  XLA's own kernels are named after their fusion: `loop_add_fusion_3` for
  `loop_add_fusion.3`."""
  dotted = re.sub(r'_(\d+)$', r'.\1', kernel)
  return dotted if dotted in names else kernel


def op_times(profile, hlo_text: str, steps: int) -> collections.Counter:
  """ns per step of each of the program's ops in a `jax.profiler` trace.

  A GPU's or TPU's plane (`/device:...`) is the device's timeline: its
  kernels count, each under the HLO op it runs (its `hlo_op` stat; a TPU's
  `XLA Ops` line names them so). On CPU the XLA runtime's worker threads
  (`tf_XLAEigen*`) run the ops (`cpu_thread_times`); a program small enough
  to run inline leaves them on the calling thread instead, so without
  worker-thread events every thread's events named after the program's
  instructions count."""
  names = set(re.findall(r'%([\w.\-]+) = ', hlo_text))
  device = collections.Counter()
  for plane in profile.planes:
    if not plane.name.startswith('/device:'):
      continue
    lines = list(plane.lines)
    ops = [l for l in lines if l.name == 'XLA Ops'] or [
        l for l in lines if l.name.startswith('Stream')]
    for line in ops:
      for ev in line.events:
        op = str(dict(ev.stats).get('hlo_op', ''))
        if not op or op.startswith('command_buffer'):
          op = _hlo_name(ev.name, names)
        device[op] += ev.duration_ns / steps
  if device:
    return device
  workers = cpu_thread_times(profile, names, steps)
  if workers:
    return workers
  anywhere = collections.Counter()
  for plane in profile.planes:
    for line in plane.lines:
      for ev in line.events:
        if ev.name in names:
          anywhere[ev.name] += ev.duration_ns / steps
  return anywhere


# XLA:CPU's YNNPACK/XNNPACK kernels share their helper tasks: a helper that
# one kernel scheduled works for whichever such kernel runs at the time.
_POOLED = re.compile(r'(ynn|xnn)_fusion')
_START, _STOP, _RECORD = (f'ThreadpoolListener::{k}'
                          for k in ('StartRegion', 'StopRegion', 'Record'))


def cpu_thread_times(profile, names, steps: int) -> collections.Counter:
  """ns per step of thread time per op on XLA:CPU's worker threads.

  An op's event covers only the thread that runs it. Its partitions on
  other threads (an Eigen dot's blocks, a parallel loop's chunks, a
  YNNPACK kernel's tiles) run as thread-pool tasks outside any op's event:
  a 20 ms Eigen dot shows a 0.1 ms event, and the rest looks like idle
  time. The pool's listener marks each task's scheduling (`Record`, id
  `_p`) and run (`StartRegion`, id `_c`, to `StopRegion`). A task belongs
  to the op whose event encloses its `Record`, or else to the owner of the
  task it was scheduled from; its run time outside any op's event is that
  op's. YNNPACK kernels' helpers are shared (Slinky's pool): a helper's time
  goes to the YNNPACK kernels running on other threads meanwhile, the rest
  to its owner. Tasks with no owner count as `UNATTRIBUTED`."""
  threads = {}
  for plane in profile.planes:
    for line in plane.lines:
      if line.name.startswith('tf_XLAEigen'):
        threads[line.name] = sorted(
            ((ev.start_ns, ev.duration_ns, ev.name, dict(ev.stats))
             for ev in line.events), key=lambda e: (e[0], -e[1]))
  times = collections.Counter()
  ops, regions, parent = {}, {}, {}
  for th, evs in threads.items():
    ops[th] = [(t, t + d, n) for t, d, n, _ in evs if n in names]
    for t, e, n in ops[th]:
      times[n] += e - t
    regions[th], open_ = [], None
    for t, _, n, stats in evs:
      if n == _START:
        open_ = (t, stats.get('_c'))
      elif n == _STOP and open_:
        regions[th].append((open_[0], t, open_[1]))
        open_ = None
  if not any(ops.values()):
    return collections.Counter()

  def enclosing(intervals, t):  # The innermost interval open at t.
    i = bisect.bisect_right(intervals, (t, float('inf'))) - 1
    for j in range(i, max(i - 8, -1), -1):  # Nested ones start later.
      if intervals[j][1] >= t:
        return intervals[j]
    return None

  for th, evs in threads.items():
    for t, _, n, stats in evs:
      if n == _RECORD:
        op = enclosing(ops[th], t)
        region = None if op else enclosing(regions[th], t)
        parent[stats.get('_p')] = (op and op[2], region and region[2])

  def owner(task):
    seen = set()
    while task in parent and task not in seen:
      seen.add(task)
      op, task = parent[task]
      if op:
        return op
    return UNATTRIBUTED

  pooled = {th: [o for o in ops[th] if _POOLED.match(o[2])] for th in ops}
  pooled_starts = {th: [o[0] for o in pooled[th]] for th in pooled}
  for th in threads:
    starts = [t for t, _, _ in ops[th]]
    for t, e, task in regions[th]:
      covered = 0  # By op events inside the task (a thunk run from it).
      for s2, e2, _ in ops[th][bisect.bisect_left(starts, t):]:
        if s2 >= e:
          break
        covered += max(0, min(e, e2) - s2)
      free, op = e - t - covered, owner(task)
      if free <= 0:
        continue
      if _POOLED.match(op):  # A helper: the kernels running meanwhile.
        for other in threads.keys() - {th}:
          j = bisect.bisect_left(pooled_starts[other], e) - 1
          while j >= 0 and pooled[other][j][1] > t:  # One thread's events
            s2, e2, n = pooled[other][j]             # do not overlap.
            share = min(free, min(e, e2) - max(t, s2))
            times[n] += share
            free -= share
            j -= 1
      times[op] += free
  return collections.Counter({n: v / steps for n, v in times.items()})


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--model', default='ViT-B/16')
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--image_size', type=int, default=224)
  p.add_argument('--dtype', default='bfloat16')
  p.add_argument('--steps', type=int, default=2)
  p.add_argument('--top', type=int, default=25)
  p.add_argument('--mode', choices=('train', 'infer'), default='train',
                 help='the train step, or the eval forward pass (logits)')
  p.add_argument('--trace_dir', default=None,
                 help='keep the trace here (default: a temporary folder)')
  p.add_argument('--peer', choices=('ours', 'hf', 'timm'), default='ours',
                 help='hf, timm: profile that PyTorch peer\'s same step '
                 '(benchmarks.peers) with torch.profiler instead')
  return p


def main(argv=None):
  args = _parser().parse_args(argv)
  if args.peer != 'ours':
    _profile_torch(args)
    return

  import jax
  from vit_jax import bench
  from vit_jax.train import step as step_lib

  train = args.mode == 'train'
  model, mesh, tx, lr_fn, state, sh, data = bench._setup(  # pylint: disable=protected-access
      args.model, args.batch, args.image_size, args.dtype, None, 1000, 1,
      optimizer=train, initialise=train)
  if train:  # The state is carried from step to step.
    fn, inputs = step_lib.compile_train_step(model, tx, lr_fn, sh, mesh, {}), [
        state, data]
  else:
    fn = bench.infer_fn(model, mesh, sh)
    with jax.set_mesh(mesh):
      inputs = [bench.serving_params(fn, state.params, sh.params,
                                     data['image']), data['image']]

  def run(compiled):
    out = compiled(*inputs)
    if train:
      inputs[0] = out[0]
    return out

  with jax.set_mesh(mesh), tempfile.TemporaryDirectory() as scratch:
    tmp = args.trace_dir or scratch
    compiled = fn.lower(*inputs).compile()
    jax.block_until_ready(run(compiled))
    options = jax.profiler.ProfileOptions()
    options.host_tracer_level = 3
    jax.profiler.start_trace(tmp, profiler_options=options)
    t = time.perf_counter()
    for _ in range(args.steps):
      out = run(compiled)
    jax.block_until_ready(out)
    wall = (time.perf_counter() - t) / args.steps
    jax.profiler.stop_trace()
    path = max(glob.glob(f'{tmp}/plugins/profile/*/*.xplane.pb'),
               key=os.path.getmtime)
    profile = jax.profiler.ProfileData.from_file(path)
  hlo = compiled.as_text()
  if args.trace_dir:  # The program the trace's op names refer to.
    with open(os.path.join(args.trace_dir, f'{args.mode}.hlo.txt'), 'w') as f:
      f.write(hlo)
  per_op = op_times(profile, hlo, args.steps)
  total = sum(per_op.values())
  ops = fused_ops(hlo)
  cats = {name: category(name, ops.get(name, frozenset())) for name in per_op}
  platform = jax.devices()[0].platform
  print(f'{args.model} batch {args.batch} {args.image_size} px {args.dtype} '
        f'{args.mode}: '
        f'{wall:.4f} s/step wall, {total / 1e9:.4f} s of op time (all '
        f'threads, or the device), per step, on {platform}')
  workers = sum(line.name.startswith('tf_XLAEigen')
                for plane in profile.planes for line in plane.lines)
  if platform == 'cpu' and workers:
    print(f'  {workers} XLA:CPU worker threads busy '
          f'{100 * total / 1e9 / (workers * wall):.0f}% of the wall time')
  _print_breakdown(per_op, cats, args.top,
                   source=lambda n: f' ({_source(hlo, n)})',
                   what=lambda n: f'  [{",".join(sorted(ops.get(n, ())))}]')


def _print_breakdown(per_op, cats, top: int, source=lambda n: '',
                     what=lambda n: '') -> None:
  """Time per category (with its three costliest ops) and the `top` ops;
  `source` / `what` annotate an op's name there."""
  total = sum(per_op.values())
  by_cat = collections.Counter()
  for name, ns in per_op.items():
    by_cat[cats[name]] += ns
  for cat, ns in by_cat.most_common():
    print(f'  {ns / 1e6:9.1f} ms  {100 * ns / total:5.1f}%  {cat}')
    costliest = [(n, t) for n, t in per_op.most_common()
                 if cats[n] == cat][:3]
    print('             ' + '; '.join(
        f'{n} {t / 1e6:.1f} ms{source(n)}' for n, t in costliest))
  print(f'top {top} ops:')
  for name, ns in per_op.most_common(top):
    print(f'  {ns / 1e6:9.1f} ms  {100 * ns / total:5.1f}%  {name}{what(name)}')


def _profile_torch(args) -> None:
  """The PyTorch peer's step, per op category (module doc)."""
  import torch
  from benchmarks import peers
  if torch.cuda.is_available():
    raise SystemExit('--peer profiles PyTorch on the CPU only; on this GPU '
                     'machine run it with CUDA_VISIBLE_DEVICES= or use '
                     'torch.profiler with ProfilerActivity.CUDA')
  args.num_classes = 1000
  step, sync, _ = peers.torch_step(args, args.peer)
  step()  # Warm-up.
  sync()
  with torch.profiler.profile(
      activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    t = time.perf_counter()
    for _ in range(args.steps):
      step()
    sync()
    wall = (time.perf_counter() - t) / args.steps
  per_op = collections.Counter()
  for e in prof.key_averages():
    per_op[e.key] += e.self_cpu_time_total * 1e3 / args.steps  # us -> ns
  total = sum(per_op.values())
  print(f'{args.peer} (PyTorch {torch.__version__}) {args.model} batch '
        f'{args.batch} {args.image_size} px {args.dtype} {args.mode}: '
        f'{wall:.4f} s/step wall, {total / 1e9:.4f} s of op time per step, '
        f'each op on all {torch.get_num_threads()} intra-op threads')
  _print_breakdown(per_op, {n: torch_category(n) for n in per_op}, args.top)


def wants_huge_pages(argv=None) -> bool:
  """Whether this run restarts itself with huge pages (`hugepages.reexec`):
  for ours only, as `vit_jax.bench` runs; a PyTorch peer is profiled in
  the environment `benchmarks.peers` times it in (`--huge_pages=own`: the
  calling shell's). Reads `--peer` alone (no help, no errors: `main`
  reports those, after the restart as before)."""
  p = argparse.ArgumentParser(add_help=False)
  p.add_argument('--peer', default='ours')
  args, _ = p.parse_known_args(argv)
  return args.peer == 'ours'


if __name__ == '__main__':
  if wants_huge_pages():
    from vit_jax import hugepages
    hugepages.reexec()  # As `vit_jax.bench` runs.
  main()
