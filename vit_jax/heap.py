"""Give the C library's freed heap memory back to the OS after one-off phases.

Initialising a model's parameters and compiling its train step allocate
and free hundreds of megabytes on the host (XLA's compiler, the init
program's random bits). glibc keeps most of that freed memory in its heap
for reuse, so the process's resident memory stays that much higher for the
whole run: a ViT-B/16 bf16 train step at batch 8 peaked at 2.36-2.38 GB
with it, 2.19 GB with it returned after state creation and after
compilation (2-vCPU Intel Xeon VM, docs/performance.md). `release()` asks
glibc to return it (`malloc_trim(0)`); the train loop and the benchmark
call it after those phases. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform


@functools.lru_cache(maxsize=None)
def _trim():
  """glibc's `malloc_trim`, or None where the C library is another."""
  if platform.libc_ver()[0] != 'glibc':
    return None
  try:
    return ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6').malloc_trim
  except (OSError, AttributeError):
    return None


def release() -> bool:
  """Returns freed heap memory to the OS; True if any was returned."""
  trim = _trim()
  return bool(trim(0)) if trim is not None else False
