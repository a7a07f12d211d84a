"""Platform-dependent model code: `lax.platform_dependent`, over the
branches of the platforms a caller says it traces for where it says so.

The models write platform-specific computations (the CPU matmul layouts,
the CPU attention core, GPU bias gradients) as `switch(..., cpu=...,
default=...)`. By default that is `lax.platform_dependent`: every branch is
traced and the one for the platform the program is lowered for is kept, so
a program traced on a CPU host and exported for a TPU is the TPU program.
No decision is ever taken from the tracing host's `jax.default_backend()`.

A caller that knows where its program will run from explicit configuration
(the train step: its mesh's devices; an export: its platforms) traces it
inside `tracing_for(platforms)`, and every switch then traces only the
branches that can run there:

  * for "cpu" alone, just its CPU branch: what lowering would keep anyway,
    without a conditional whose linearisation and transpose cost every
    branch's. ViT-B/16's train step traced in 2.0-2.6 s instead of 3.7-4.0 s
    in float32, 2.3-3.9 s instead of 5.9-7.4 s in bf16 (AMD EPYC Zen 3 VM,
    docs/performance.md, `python -m benchmarks.trace`);
  * otherwise `lax.platform_dependent` over the branches of those platforms
    (and `default`): the programs stay exactly the ones measured there (a
    GPU's branch key would also need CUDA told apart from ROCm, so "gpu"
    keeps both). A program traced for TPUs or GPUs only never traces a
    CPU branch: no CPU code runs while tracing it (deciding the CPU matmul
    form, `matmul.cpu_form`, may time the CPU for seconds, and a process
    started with JAX_PLATFORMS=tpu has no CPU backend to time).

So a program traced inside `tracing_for("cpu")` is a CPU program: export
for other platforms what is traced outside it (`jax.jit` of
`step.train_step` itself, as `tests/test_export_lowering.py` does), or
inside `tracing_for` of the export's platforms, never
`compile_train_step`'s result. The setting is not part of any jit cache
key: a function jitted on its own that calls `switch` would keep the trace
made in the first context it met; only whole programs are traced inside it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Callable, Optional, Sequence, Tuple, Union

from jax import lax

# Platforms whose branch is taken directly inside `tracing_for`.
DIRECT = ('cpu',)
# `lax.platform_dependent`'s branch keys a device platform runs.
_KEYS = {'gpu': ('cuda', 'rocm')}

_local = threading.local()


def targets() -> Optional[Tuple[str, ...]]:
  """The platforms this thread traces for (`tracing_for`), else None."""
  return getattr(_local, 'platforms', None)


@contextlib.contextmanager
def tracing_for(platforms: Union[None, str, Sequence[str]]):
  """Traces inside (this thread) are for `platforms`: a platform or several
  ("cpu", "gpu", "tpu": a mesh's devices; "cuda", "rocm": jax.export's
  names), or None: unknown, as outside."""
  if platforms is not None:
    platforms = (platforms,) if isinstance(platforms, str) else tuple(
        platforms)
    if not platforms or not all(isinstance(p, str) and p
                                for p in platforms):
      raise ValueError(f'tracing_for({platforms!r}): give platform names '
                       '("cpu", "gpu", "tpu", "cuda", "rocm") or None')
    platforms = tuple(p.lower() for p in platforms)
  before = targets()
  _local.platforms = platforms
  try:
    yield
  finally:
    _local.platforms = before


def traced_for(platforms: Union[None, str, Sequence[str]],
               fn: Callable) -> Callable:
  """`fn`, traced inside `tracing_for(platforms)`: for `jax.jit`, which
  traces at the first call rather than where the function is built."""

  def wrapped(*args, **kwargs):
    with tracing_for(platforms):
      return fn(*args, **kwargs)
  # jit names its program after the function (logs, profiles, HLO dumps).
  inner = fn.func if isinstance(fn, functools.partial) else fn
  wrapped.__name__ = wrapped.__qualname__ = getattr(
      inner, '__name__', 'traced_for')
  # ... and its arguments after fn's (donation and sharding messages).
  wrapped.__signature__ = inspect.signature(fn)
  return wrapped


def _runs_on(key: str, platforms: Tuple[str, ...]) -> bool:
  """Whether the branch for `key` can run on one of `platforms`."""
  return any(key == p or key in _KEYS.get(p, ()) for p in platforms)


def switch(*args, default: Callable, **branches: Callable):
  """`lax.platform_dependent(*args, default=default, **branches)`; inside
  `tracing_for`, over the branches of its platforms only: for a platform
  of DIRECT alone, that platform's branch (or `default`) applied to
  `args`."""
  platforms = targets()
  if platforms is None:
    return lax.platform_dependent(*args, default=default, **branches)
  if len(platforms) == 1 and platforms[0] in DIRECT:
    return branches.get(platforms[0], default)(*args)
  kept = {k: b for k, b in branches.items() if _runs_on(k, platforms)}
  return lax.platform_dependent(*args, default=default, **kept)
