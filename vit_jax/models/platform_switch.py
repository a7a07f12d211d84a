"""Platform-dependent model code: `lax.platform_dependent`, or one branch
where the caller says which platform it traces for.

The models write platform-specific computations (the CPU matmul layouts,
the CPU attention core, GPU bias gradients) as `switch(..., cpu=...,
default=...)`. By default that is `lax.platform_dependent`: every branch is
traced and the one for the platform the program is lowered for is kept, so
a program traced on a CPU host and exported for a TPU is the TPU program.
No decision is ever taken from the tracing host's `jax.default_backend()`.

A caller that knows where its program will run from explicit configuration
(the train step: its mesh's devices) traces it inside
`tracing_for(platform)`. For "cpu" every switch then traces only its CPU
branch: what lowering would keep anyway, without a conditional whose
linearisation and transpose cost every branch's. ViT-B/16's train step
traced in 2.0-2.6 s instead of 3.7-4.0 s in float32, 2.3-3.9 s instead of
5.9-7.4 s in bf16 (AMD EPYC Zen 3 VM, docs/performance.md,
`python -m benchmarks.trace`). Other platforms keep `lax.platform_dependent`
(their programs stay exactly the ones measured there; a GPU's branch key
would also need CUDA told apart from ROCm).

So a program traced inside `tracing_for("cpu")` is a CPU program: export
for other platforms what is traced outside it (`jax.jit` of
`step.train_step` itself, as `tests/test_export_lowering.py` does), never
`compile_train_step`'s result. The setting is not part of any jit cache
key: a function jitted on its own that calls `switch` would keep the trace
made in the first context it met; only whole programs are traced inside it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Callable, Optional

from jax import lax

# Platforms whose branch is taken directly inside `tracing_for`.
DIRECT = ('cpu',)

_local = threading.local()


def target() -> Optional[str]:
  """The platform this thread traces for (`tracing_for`), else None."""
  return getattr(_local, 'platform', None)


@contextlib.contextmanager
def tracing_for(platform: Optional[str]):
  """Traces inside (this thread) are for `platform` ("cpu", "gpu", "tpu":
  a mesh's devices; None: unknown, as outside)."""
  before = target()
  _local.platform = platform
  try:
    yield
  finally:
    _local.platform = before


def traced_for(platform: Optional[str], fn: Callable) -> Callable:
  """`fn`, traced inside `tracing_for(platform)`: for `jax.jit`, which
  traces at the first call rather than where the function is built."""

  def wrapped(*args, **kwargs):
    with tracing_for(platform):
      return fn(*args, **kwargs)
  # jit names its program after the function (logs, profiles, HLO dumps).
  inner = fn.func if isinstance(fn, functools.partial) else fn
  wrapped.__name__ = wrapped.__qualname__ = getattr(
      inner, '__name__', 'traced_for')
  # ... and its arguments after fn's (donation and sharding messages).
  wrapped.__signature__ = inspect.signature(fn)
  return wrapped


def switch(*args, default: Callable, **branches: Callable):
  """`lax.platform_dependent(*args, default=default, **branches)`; inside
  `tracing_for` a platform of DIRECT, that platform's branch (or
  `default`) applied to `args`."""
  platform = target()
  if platform in DIRECT:
    return branches.get(platform, default)(*args)
  return lax.platform_dependent(*args, default=default, **branches)
