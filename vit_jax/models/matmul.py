"""Mixed-precision matmuls for the dense layers: bf16 in, f32 accumulate.

`dot_general` is a drop-in for `lax.dot_general` (flax's `dot_general=` and
`einsum_dot_general=` hooks). For float32 operands it computes what
`lax.dot_general` does; on CPUs a dense (unbatched) product's backward pass
takes the layout of the bf16 form below (`_cpu_f32_dot`), a custom VJP;
`plain_dot_general` leaves them to `lax.dot_general` (models that need
forward-mode autodiff, `recompute.plain_autodiff`). For bfloat16
operands every product is accumulated in float32, forward and
backward, and the result is rounded to bfloat16 once (what TPUs and GPUs do
for bf16 matmuls anyway; plain autodiff would give bf16-accumulated or
float32 backward matmuls).

How that matmul is written depends on the platform the program is lowered
for, chosen with `lax.platform_dependent` (`platform_switch.switch`; never
by asking which backend this process happens to have while tracing, so a
step exported on a CPU host for TPU or GPU carries no CPU-only construct;
a train step built for a CPU mesh is traced as the CPU program):

  * TPU, GPU: bf16 x bf16 -> bf16 dots. Their matrix units accumulate
    bf16 products in float32 and round once (the same numbers), and an f32
    result would be written to device memory only to be converted: without
    it ViT-B/16's inference ran 30% faster on an H100, training 8%
    (docs/performance.md). In the canonical layout (M, K) x (K, N); the
    backward pass is autodiff's, dots of the same kind;
  * CPU: one of two forms, per process (`cpu_form()`):
    - 'bf16': the same dots; on CPUs with bf16 dot-product instructions
      (AVX512-BF16, AMX) XLA hands exactly bf16 x bf16 -> f32 with the
      contracted dimension last in the left operand to its fast library
      kernels (YNNPACK); any other form is upcast to float32 first. XLA
      folds transposes into a dot's dimension numbers, so the weight
      gradient's transposed activation is materialised behind an
      optimisation barrier, or for rows of 4 KiB and more inside a
      conditional (`_transposed`; CPU branch only);
    - 'f32': operands upcast to float32, a float32 matmul, the result
      rounded to bf16: for CPUs whose bf16 matmul is no faster than float32
      (no bf16 instructions, or slow ones).
    - 'onednn': the 2-D products (every dense layer) and the CPU
      attention core's batched ones (`cpu_batched`) on oneDNN's kernels
      through an XLA custom call (`vit_jax.models.onednn`: optional, needs
      its install extra; twice XLA's rate on an AMX Intel Xeon VM,
      docs/performance.md). Other products
      (batched `dot_general`s) as 'bf16'. Programs that carry it run only
      in a process that registered the custom call; programs over several
      CPU devices take 'bf16' (XLA cannot partition a custom call).
    Exports trace under `portable()`, where the form is always 'bf16'
    (whatever this host or the setting below would pick): the program
    runs on other CPUs than this one, and must not depend on which host
    exported it.
    `VIT_JAX_CPU_MATMUL=bf16|f32|onednn|auto` chooses; 'auto' (the default)
    takes 'f32' on an x86 CPU without bf16 dot instructions (/proc/cpuinfo
    flags `avx512_bf16`, `amx_bf16`) and otherwise (those flags, or no x86
    `flags` line to read them from: ARM, not Linux) times the forms this
    process can run ('onednn' where `onednn.available()`) once on a
    ViT-B/16 MLP-shaped matmul, forward and backward, and keeps the
    fastest. The choice applies to programs this process compiles for the
    CPU it runs on. The measured choice is remembered per machine (CPU
    model, its bf16 flags, jax and oneDNN versions) in
    `VIT_JAX_CPU_MATMUL_CACHE` (default ~/.cache/vit_jax/cpu_matmul.json),
    so that every later process there runs the same numerics: a run
    resumed on a busy machine stays bitwise the uninterrupted one (the
    forms round differently). Where processes measure at once, the first
    to record its choice wins and the others take it (`_write_cache`,
    under a lock on the file's `.lock` neighbour). Delete the file to
    measure again.

    A process without a CPU backend (JAX_PLATFORMS=tpu or cuda) cannot
    measure: 'auto' takes 'bf16' there (XLA's dots, the same float32
    accumulation) for the CPU branches of programs traced without naming
    their platforms; a measurement that fails falls back to 'bf16' with a
    warning. Nothing is read from `jax.default_backend()`, and a program
    traced for TPUs or GPUs only (`platform_switch.tracing_for`, as the
    train step on a TPU or GPU mesh is) traces no CPU branch, so it never
    asks for
    the form (an eval_shape of a bf16 model outside it took 11.7 s on a
    fresh machine, timing the CPU once; later ones read the cache).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import tempfile
import threading
import time
from typing import Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from vit_jax.models import onednn
from vit_jax.models import platform_switch

F32 = jnp.float32
BF16 = jnp.bfloat16
# `checkpoint_name`s of the bf16 products and the float32 dense ones (see
# `vit_jax.models.remat`).
NAME, BATCHED_NAME = 'bf16_matmul', 'bf16_batched_matmul'

ENV = 'VIT_JAX_CPU_MATMUL'
CACHE_ENV = 'VIT_JAX_CPU_MATMUL_CACHE'
CPU_FORMS = ('bf16', 'f32', 'onednn')
BF16_CPU_FLAGS = ('avx512_bf16', 'amx_bf16')


def dot_general(lhs, rhs, dimension_numbers, precision=None,
                preferred_element_type=None, **kwargs):
  """`lax.dot_general`, with float32 accumulation for bf16 x bf16 and a
  CPU layout of its own for float32 dense products (module doc)."""
  dn = tuple(tuple(map(tuple, pair)) for pair in dimension_numbers)
  if (lhs.dtype == rhs.dtype == F32 and not dn[1][0] and not kwargs
      and precision is None and preferred_element_type in (None, F32)
      and not _in_portable()):
    return checkpoint_name(platform_switch.switch(
        lhs, rhs, cpu=functools.partial(_cpu_f32_dot, dn=dn),
        default=lambda a, b: lax.dot_general(a, b, dn)), NAME)
  if (lhs.dtype != BF16 or rhs.dtype != BF16
      or preferred_element_type not in (None, BF16)):
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type,
                           **kwargs)
  out = platform_switch.switch(
      lhs, rhs, cpu=functools.partial(_cpu_dot, dn=dn),
      default=functools.partial(_accelerator_dot, dn=dn))
  # Named so that remat policies can keep it: the platform switch and the
  # custom VJP hide the dot_general that `checkpoint_policies.dots_*` see.
  return checkpoint_name(out, BATCHED_NAME if dn[1][0] else NAME)


def plain_dot_general(lhs, rhs, dimension_numbers, precision=None,
                      preferred_element_type=None, **kwargs):
  """`dot_general` for models written in plain autodiff
  (`recompute.plain_autodiff`: float32 without `recompute_internals`):
  float32 products are `lax.dot_general` itself on every platform, as
  under `portable()`. `dot_general`'s CPU layout has a custom VJP, and
  `lax.platform_dependent` traces the CPU branch wherever the program runs,
  so forward-mode autodiff (`jax.jvp`, `jax.jacfwd`, Hessian-vector
  products) would fail on every platform. Other dtypes as `dot_general`."""
  if lhs.dtype == rhs.dtype == F32:
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type,
                           **kwargs)
  return dot_general(lhs, rhs, dimension_numbers, precision=precision,
                     preferred_element_type=preferred_element_type, **kwargs)


def dot_general_for(plain: bool):
  """The product of a model in plain autodiff (`plain_dot_general`) or not
  (`dot_general`)."""
  return plain_dot_general if plain else dot_general


def _accelerator_dot(lhs, rhs, *, dn):
  """TPU, GPU: a bf16 dot in the canonical layout. Their matrix units (MXU;
  cuBLAS and XLA's Triton GEMMs, compute type float32) accumulate bf16
  products in float32 and round the result once, so no f32 result is
  written out to be converted; autodiff's backward dots are the same kind.
  Flattened to (M, K) x (K, N) first: as autodiff's dot_generals over
  several axes they got transposes around them on an H100
  (docs/performance.md)."""
  return _canonical(lhs, rhs, dn, lambda a, b: _dot(
      a, b, ((a.ndim - 1,), (b.ndim - 2,)), accumulate=BF16))


def _cpu_dot(lhs, rhs, *, dn):
  form = cpu_form()
  if form == 'f32':
    return lax.dot_general(lhs.astype(F32), rhs.astype(F32), dn).astype(BF16)
  if form == 'onednn':
    return _canonical(lhs, rhs, dn, _onednn_matmul)
  return _bf16_dot(lhs, rhs, dn=dn, barrier=True)


def _cpu_f32_dot(lhs, rhs, *, dn):
  """A float32 dense product on a CPU: canonical layout, and a backward
  pass that takes the weight gradient's transposed activation as a
  materialised copy, as the bf16 form does, except for rows of 4 KiB and
  more, which XLA's float32 kernel reads transposed faster (`_matmul`).
  Autodiff's transposed products ran a ViT-B/16 MLP layer's float32
  forward and backward in 140 ms against 87 ms this way, and the train step
  10-12% slower (Intel Xeon VM, docs/performance.md)."""
  return _canonical(lhs, rhs, dn, lambda a, b: _matmul(a, b, True, F32))


def _onednn_matmul(a, b):
  """2-D products on oneDNN (forward and backward); batched ones as 'bf16'."""
  return onednn.dot(a, b) if a.ndim == 2 else _matmul(a, b, True, BF16)


def _bf16_dot(lhs, rhs, *, dn, barrier: bool):
  """bf16 x bf16 -> f32-accumulated bf16 in canonical layout; `barrier`
  materialises the backward pass's transposed operand (CPU)."""
  return _canonical(lhs, rhs, dn,
                    lambda a, b: _matmul(a, b, barrier, BF16))


def _canonical(lhs, rhs, dn, matmul_fn):
  """`lax.dot_general(lhs, rhs, dn)` as `matmul_fn` of (M, K) x (K, N)
  operands, or (B, M, K) x (B, K, N) where `dn` has batch axes."""
  (lc, rc), (lb, rb) = dn
  lfree = [i for i in range(lhs.ndim) if i not in lc + lb]
  rfree = [i for i in range(rhs.ndim) if i not in rc + rb]
  k = math.prod(lhs.shape[i] for i in lc)
  batch = [lhs.shape[i] for i in lb]
  a = jnp.transpose(lhs, list(lb) + lfree + list(lc))
  b = jnp.transpose(rhs, list(rb) + list(rc) + rfree)
  if batch:
    out = matmul_fn(a.reshape(math.prod(batch), -1, k),
                    b.reshape(math.prod(batch), k, -1))
  else:
    out = matmul_fn(a.reshape(-1, k), b.reshape(k, -1))
  return out.reshape(batch + [lhs.shape[i] for i in lfree] +
                     [rhs.shape[i] for i in rfree])


def _dot(a, b, contract, out=BF16, accumulate=F32):
  """a x b contracting a's axis `contract[0]` with b's `contract[1]`, the
  dot's result in `accumulate`, returned in `out`; 3-D operands have a
  leading batch axis."""
  batch = ((0,), (0,)) if a.ndim == 3 else ((), ())
  return lax.dot_general(a, b, (contract, batch),
                         preferred_element_type=accumulate).astype(out)


# Row length (bytes) from which the CPU branch transposes inside a
# conditional (see `_transposed`).
WIDE_ROW_BYTES = 4096


def _wide_rows(x) -> bool:
  return x.shape[-1] * x.dtype.itemsize >= WIDE_ROW_BYTES


def _transposed(x, barrier: bool):
  """x with its last two axes swapped; with `barrier` (the CPU branch),
  materialised in row-major order for the library kernel (module doc).

  XLA:CPU fuses the element-wise producer of `x` (the GELU recomputed for
  the MLP's weight gradient) into the transpose, and that loop reads `x`
  down its columns: once a row is 4 KiB or longer, every read lands on
  another page, and the fused transpose of a ViT-B/16 MLP activation took
  31 ms where the producer and a plain transpose take 2 ms each (Intel Xeon,
  docs/performance.md). Such rows are transposed inside a `lax.cond`, which
  no fusion crosses: the producer is materialised first, the branch is a
  plain transpose. Its other branch (NaNs) runs only when x's first element
  is NaN, where the weight gradient is NaN anyway. Shorter rows keep the
  fused form, which is cheaper for them.
  """
  if not barrier:
    return jnp.swapaxes(x, -1, -2)
  if _wide_rows(x):
    first = x[(0,) * x.ndim]
    shape = x.shape[:-2] + x.shape[-2:][::-1]
    return lax.cond(first == first, lambda v: jnp.swapaxes(v, -1, -2),
                    lambda v: jnp.full(shape, jnp.nan, v.dtype), x)
  # The barrier keeps XLA from folding the transpose into the dot's
  # dimension numbers (the library kernel takes the canonical layout only).
  t = jnp.swapaxes(x, -1, -2)
  return lax.optimization_barrier(t.reshape(-1)).reshape(t.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(a, b, barrier, out):
  """(..., M, K) x (..., K, N) -> (..., M, N) in dtype `out`; `...` is one
  batch axis or none. The backward pass rounds the cotangent to the
  operands' dtype (bf16 or float32) and gives gradients in it."""
  del barrier
  return _dot(a, b, ((a.ndim - 1,), (b.ndim - 2,)), out)


def _matmul_fwd(a, b, barrier, out):
  return _matmul(a, b, barrier, out), (a, b)


def _matmul_bwd(barrier, out, res, g):
  del out
  a, b = res
  g = g.astype(a.dtype)
  last = g.ndim - 1
  da = _dot(g, b, ((last,), (last,)), a.dtype)  # (M, N) x (K, N)^T
  if a.dtype == F32 and _wide_rows(a):
    # XLA:CPU's float32 kernel reads a wide activation transposed in place
    # faster than `_transposed` copies it (27-36 ms against 48 ms for a
    # ViT-B/16 MLP's second weight gradient, docs/performance.md).
    db = _dot(a, g, ((last - 1,), (last - 1,)), a.dtype)  # (M,K)^T x (M,N)
  else:
    db = _dot(_transposed(a, barrier), g, ((last,), (last - 1,)),
              a.dtype)  # (K, M) x (M, N)
  return da, db


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def cpu_batched(a, b, out_dtype, *, trans_a: bool = False,
                trans_b: bool = False):
  """(B, M, K) x (B, K, N) -> (B, M, N) in `out_dtype`, for a program that
  runs on a CPU (call it inside a `lax.platform_dependent` CPU branch), by a
  caller that writes its own backward pass in the same canonical layout
  (`attention`'s CPU core): autodiff's would fold transposes into the
  products. bf16 operands take this process's CPU form: float32
  accumulation, the result rounded once to `out_dtype` (float32 keeps the
  accumulator); the 'onednn' form runs it on oneDNN. Other dtypes:
  `lax.dot_general`.

  `trans_a` / `trans_b`: that operand is stored with its last two axes
  swapped, (B, K, M) / (B, N, K). The 'onednn' form reads it so in place.
  The others take a transposed copy of `b`; for `a` they compute the
  transposed product, bᵀ·a, of a transposed copy of `b` and transpose that
  (M, N) result: XLA:CPU's kernel has no bf16 form for a contraction over
  the rows of both operands."""
  # The dtypes first: a float32 program never needs the form (deciding it
  # may run the probe).
  if ((trans_a or trans_b) and a.dtype == b.dtype == BF16
      and out_dtype in (BF16, F32) and cpu_form() == 'onednn'):
    return onednn.matmul(a, b, trans_a=trans_a, trans_b=trans_b,
                         out=out_dtype)
  if trans_b:
    b = transposed_copy(b)
  if trans_a:
    # The barrier keeps XLA from folding the transpose of the result back
    # into the product (the form the kernel lacks).
    out = lax.optimization_barrier(
        cpu_batched(transposed_copy(b), a, F32))
    return jnp.swapaxes(out, 1, 2).astype(out_dtype)
  dn = (((2,), (1,)), ((0,), (0,)))
  if a.dtype != BF16 or b.dtype != BF16:
    return lax.dot_general(a, b, dn, preferred_element_type=out_dtype)
  form = cpu_form()
  if form == 'f32':
    return lax.dot_general(a.astype(F32), b.astype(F32), dn).astype(out_dtype)
  if form == 'onednn' and out_dtype in (BF16, F32):
    return onednn.matmul(a, b, out=out_dtype)
  return _dot(a, b, ((2,), (1,)), out_dtype)


def transposed_copy(x):
  """x with its last two axes swapped, materialised in row-major order (CPU
  branches: see `_transposed`). XLA otherwise folds a transpose into the
  consuming dot's dimension numbers, and some of the forms that result
  reach XLA:CPU's library kernel only after their bf16 operands were upcast
  to float32 (the attention logits of heads-major keys: 4x slower,
  docs/performance.md)."""
  return _transposed(x, True)


# ---------------------------------------------------------------------------
# The CPU form: configuration, capability check, measurement.

_lock = threading.Lock()
_chosen: Dict[str, str] = {}
_portable = threading.local()
# The CPU form of every trace inside `portable()`.
PORTABLE_CPU_FORM = 'bf16'
# What `cpu_form` measured (seconds per form), for the benchmark's report.
MEASURED: Dict[str, float] = {}


def cpu_bf16_flags(cpuinfo: str = '/proc/cpuinfo') -> Optional[set]:
  """The bf16 dot-product flags this CPU advertises (a subset of
  BF16_CPU_FLAGS: empty on an x86 CPU without them); None where that is
  unknown, so that 'auto' measures: /proc/cpuinfo unreadable (not Linux),
  or without an x86 `flags` line (ARM lists its extensions, `bf16`
  among them on bf16-capable cores such as Graviton 3, as `Features`)."""
  try:
    with open(cpuinfo, encoding='utf-8', errors='replace') as f:
      for line in f:
        if line.split(':', 1)[0].strip() == 'flags':
          return set(line.split(':', 1)[1].split()) & set(BF16_CPU_FLAGS)
  except OSError:
    return None
  return None


def cpu_form() -> str:
  """'bf16', 'f32' or 'onednn': how bf16 matmuls run on this process's CPU
  (see the module doc); decided once per process. Where the CPU backend has
  several devices, 'onednn' reads as 'bf16'. Inside `portable()` it is
  always `PORTABLE_CPU_FORM`, undecided: an exported program runs on other
  CPUs, so this host's choice (its bf16 instructions, a timing,
  VIT_JAX_CPU_MATMUL) must not change it."""
  if _in_portable():
    return PORTABLE_CPU_FORM
  with _lock:
    if 'form' not in _chosen:
      _chosen['form'] = _decide()
    form = _chosen['form']
  if form == 'onednn' and _several_cpu_devices():
    return 'bf16'
  return form


def _several_cpu_devices() -> bool:
  """XLA's SPMD partitioner cannot split a custom call: in a program over
  several CPU devices (simulated ones, or processes) it would gather every
  operand of the oneDNN product onto each device."""
  try:
    return len(jax.devices('cpu')) > 1
  except RuntimeError:  # No CPU backend (JAX_PLATFORMS=tpu): no CPU program.
    return False


def _in_portable() -> bool:
  """Whether this thread traces inside `portable()`."""
  return bool(getattr(_portable, 'depth', 0))


@contextlib.contextmanager
def portable():
  """Traces inside (this thread) are the same on every host: bf16 products
  take the CPU form `PORTABLE_CPU_FORM` ('bf16': XLA's own dot, which runs
  on every CPU, with the float32 accumulation and single rounding of the
  TPU and GPU branches) whatever this host's `cpu_form()`, so they carry
  no custom call of this process ('onednn') and no host-chosen numerics
  ('f32' rounds differently: the same checkpoint exported on two hosts gave
  other logits and top-1 classes); float32 dense products are plain
  `lax.dot_general`s (no platform switch, which converters such as ONNX's
  cannot read). For programs serialised to run elsewhere (exports)."""
  _portable.depth = getattr(_portable, 'depth', 0) + 1
  try:
    yield
  finally:
    _portable.depth -= 1


def reset_cpu_form() -> None:
  """Forgets the decision (tests; a changed VIT_JAX_CPU_MATMUL)."""
  with _lock:
    _chosen.clear()
    MEASURED.clear()


def _decide() -> str:
  setting = os.environ.get(ENV, 'auto').strip().lower()
  if setting == 'onednn':
    ok, why = onednn.available()
    if not ok:
      raise ValueError(f'{ENV}=onednn, but the oneDNN matmul is unavailable: '
                       f'{why}. Or set {ENV}=bf16 or auto.')
    return setting
  if setting in CPU_FORMS:
    return setting
  if setting != 'auto':
    raise ValueError(f'{ENV}={setting!r}: expected one of '
                     f'{CPU_FORMS + ("auto",)}')
  flags = cpu_bf16_flags()
  if flags is not None and not flags:
    return 'f32'  # No bf16 dot instructions: bf16 matmuls are upcast anyway.
  elsewhere = _runs_elsewhere()
  if elsewhere:
    logging.info("%s: bf16 matmuls of CPU programs take the CPU form 'bf16' "
                 'without measuring (set %s to choose)', elsewhere, ENV)
    return 'bf16'
  key = _cache_key(flags)
  cached = _read_cache().get(key)
  if cached in CPU_FORMS:
    return cached
  try:
    times = _measure_forms()
  except RuntimeError as e:
    logging.warning("%s; this process's CPU programs take the form 'bf16'",
                    e)
    return 'bf16'
  form = min(times, key=lambda f: (times[f], f != 'f32'))
  return _write_cache(key, form)


def _runs_elsewhere() -> Optional[str]:
  """Why this process cannot run CPU programs (no CPU backend: the module
  doc), or None where it can. A capability check, not a guess from
  `jax.default_backend()`: a GPU host's first trace of a CPU branch still
  measures its CPU once (cached), as that CPU may run the program."""
  try:
    jax.devices('cpu')
  except RuntimeError as e:
    return f'no CPU backend ({e})'
  return None


def _cache_path() -> str:
  return os.environ.get(CACHE_ENV) or os.path.join(
      os.path.expanduser('~'), '.cache', 'vit_jax', 'cpu_matmul.json')


def _machine_key(flags) -> str:
  """The CPU model (x86 `model name`; ARM, which has none, its `CPU
  implementer` and `CPU part`), its bf16 flags and jax's version."""
  model = ''
  try:
    with open('/proc/cpuinfo', encoding='utf-8', errors='replace') as f:
      info = {}
      for line in f:
        name, _, value = line.partition(':')
        info.setdefault(name.strip(), value.strip())
    model = info.get('model name') or ' '.join(
        info[k] for k in ('CPU implementer', 'CPU part') if info.get(k))
  except OSError:
    pass
  return f'{model}|{",".join(sorted(flags or ()))}|jax {jax.__version__}'


def _cache_key(flags) -> str:
  """This machine's entry in the cache: `_machine_key` and the oneDNN
  version this process can run (or "no oneDNN")."""
  ok, what = onednn.available()
  return f'{_machine_key(flags)}|{what if ok else "no oneDNN"}'


def _read_cache() -> Dict[str, str]:
  try:
    with open(_cache_path(), encoding='utf-8') as f:
      data = json.load(f)
    return data if isinstance(data, dict) else {}
  except (OSError, ValueError):
    return {}


@contextlib.contextmanager
def _cache_locked(path: str):
  """Holds an exclusive lock on `path`.lock (`fcntl.flock`, released when
  the process ends, however it ends) while re-reading and writing the
  cache; where there is no fcntl (Windows), no lock: the re-read alone
  then narrows the race to the write itself."""
  try:
    import fcntl  # pylint: disable=import-outside-toplevel
  except ImportError:
    yield
    return
  with open(f'{path}.lock', 'a', encoding='utf-8') as lock:
    fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _write_cache(key: str, form: str) -> str:
  """Records `form`, this process's measured choice, under `key`, unless
  another process recorded one for `key` while this one measured: the
  first writer wins, and the form returned (the recorded one) is what this
  process runs. Two processes measuring at once otherwise each kept their
  own choice and the last to write set the cache, so a later process
  resuming the first one's run could run other numerics (the forms round
  differently). Under `_cache_locked`; written to a temporary file in the
  cache's folder and renamed over it, so that readers see the old file or
  the new one, never a part. Best effort: a read-only home only costs a
  re-measurement, and this process keeps `form`."""
  path = _cache_path()
  folder = os.path.dirname(path) or '.'
  try:
    os.makedirs(folder, exist_ok=True)
    with _cache_locked(path):
      data = _read_cache()
      if data.get(key) in CPU_FORMS:
        if data[key] != form:
          logging.info("CPU matmul form: measured '%s', but another process "
                       "recorded '%s' for this machine first (%s); taking "
                       'that', form, data[key], path)
        return data[key]
      data[key] = form
      fd, tmp = tempfile.mkstemp(prefix='.cpu_matmul.', suffix='.tmp',
                                 dir=folder)
      try:
        with os.fdopen(fd, 'w', encoding='utf-8') as f:
          json.dump(data, f, indent=1)
        os.chmod(tmp, 0o644)  # Readable to all, as before (mkstemp: 0600).
        os.replace(tmp, path)
      except BaseException:
        with contextlib.suppress(OSError):
          os.remove(tmp)
        raise
  except OSError:
    pass
  return form


def _measure_forms() -> Dict[str, float]:
  """Best seconds of each form this process can run, on one CPU device; run
  in a thread of its own, so that it never lands in a trace that triggered
  it."""
  out: Dict[str, float] = {}
  errors = []

  def work():
    try:
      out.update(_time_forms())
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  t = threading.Thread(target=work, name='vit_jax-cpu-matmul-probe')
  t.start()
  t.join()
  if errors:
    raise RuntimeError(f'measuring the CPU matmul forms failed ({errors[0]}); '
                       f'set {ENV}=bf16, f32 or onednn to skip it') from (
                           errors[0])
  MEASURED.update(out)
  return out


def _time_forms(m: int = 1576, k: int = 768, n: int = 3072,
                repeats: int = 7, warmup: int = 2) -> Dict[str, float]:
  """Forward + backward of an (m, k) x (k, n) bf16 matmul (ViT-B/16's MLP
  at batch 8) in each CPU form this process can run; the best of `repeats`
  per form, the forms taking turns (a VM whose speed drifts while it
  measures slows them all alike: on a fresh Intel VM the first process's
  best-of-3 per form, one form after the other, kept 'bf16' where 'onednn'
  ran the train step 1.2-1.5x faster, docs/performance.md)."""
  cpu = jax.devices('cpu')[0]
  rng = np.random.default_rng(0)
  x = jax.device_put(rng.standard_normal((m, k), np.float32), cpu)
  w = jax.device_put(rng.standard_normal((k, n), np.float32) / 30, cpu)
  x, w = x.astype(BF16), w.astype(BF16)
  dn = (((1,), (0,)), ((), ()))
  forms = {
      'bf16': functools.partial(_bf16_dot, dn=dn, barrier=True),
      'f32': lambda a, b: lax.dot_general(a.astype(F32), b.astype(F32),
                                          dn).astype(BF16),
  }
  if onednn.available()[0]:
    forms['onednn'] = onednn.dot
  steps = {}
  for name, dot in forms.items():
    steps[name] = jax.jit(jax.value_and_grad(
        lambda a, b, dot=dot: dot(a, b).astype(F32).sum(), (0, 1)))
    for _ in range(warmup):
      jax.block_until_ready(steps[name](x, w))
  times = {name: math.inf for name in steps}
  for _ in range(repeats):
    for name, step in steps.items():
      t = time.perf_counter()
      jax.block_until_ready(step(x, w))
      times[name] = min(times[name], time.perf_counter() - t)
  return times
