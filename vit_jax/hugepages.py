"""Transparent huge pages for the command-line faces' host memory (Linux).

XLA:CPU allocates each call's temporary buffer afresh (0.5 GB for a ViT-B/16
bf16 train step at batch 8), and glibc hands allocations that large out as
new mappings, so every step touches them one 4 KiB page at a time: 1.28 M
minor page faults for a 5-step benchmark on a 2-vCPU Intel VM. Where the
kernel gives huge pages only on request (`transparent_hugepage` set to
`madvise`, the common default), glibc >= 2.35 requests them for its
mappings under the tunable `glibc.malloc.hugetlb=1`: 0.29 M faults and a
7-13% faster bf16 step there (docs/performance.md).

Tunables are read when a process starts, so `reexec()`, called first in
the `__main__` of `vit_jax.main`, `vit_jax.vtab`, `vit_jax.bench` and
`vit_jax.predict`, restarts the process once with the tunable added where
it would help. Library imports never do this. `VIT_JAX_HUGE_PAGES=0` turns
it off.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Dict, Mapping, Optional

ENV = 'VIT_JAX_HUGE_PAGES'
TUNABLE = 'glibc.malloc.hugetlb=1'
_TUNABLE_NAME = TUNABLE.split('=', 1)[0]
THP_MODE = '/sys/kernel/mm/transparent_hugepage/enabled'


def tunables_to_add(environ: Mapping[str, str], thp_mode: Optional[str],
                    libc: tuple) -> Optional[str]:
  """The GLIBC_TUNABLES value to restart with, or None to leave the process
  as it is: off by `ENV`, already set, huge pages always or never given
  (`thp_mode`, the kernel's setting text, None if unreadable), or a C
  library without the tunable (`libc`: `platform.libc_ver()`)."""
  current = environ.get('GLIBC_TUNABLES', '')
  if environ.get(ENV, '1') == '0' or _TUNABLE_NAME in current:
    return None
  if not thp_mode or '[madvise]' not in thp_mode:
    return None
  name, version = libc
  try:
    if name != 'glibc' or tuple(map(int, version.split('.')[:2])) < (2, 35):
      return None
  except ValueError:
    return None
  return f'{current}:{TUNABLE}' if current else TUNABLE


def remove_tunable(env: Dict[str, str]) -> None:
  """Removes glibc's huge-page tunable (any value) from `env`'s
  GLIBC_TUNABLES, keeping the others (and dropping the variable when none
  is left): for a child that must run without huge pages whatever this
  process inherited (`benchmarks.peers --huge_pages=none`)."""
  kept = [t for t in env.get('GLIBC_TUNABLES', '').split(':')
          if t and t.split('=', 1)[0].strip() != _TUNABLE_NAME]
  if kept:
    env['GLIBC_TUNABLES'] = ':'.join(kept)
  else:
    env.pop('GLIBC_TUNABLES', None)


def environ() -> Dict[str, str]:
  """This process's environment with `TUNABLE` added where it helps (for a
  child process: `benchmarks.peers` gives every implementation the same)."""
  env = dict(os.environ)
  if not sys.platform.startswith('linux'):
    return env
  try:
    with open(THP_MODE, encoding='ascii') as f:
      thp_mode = f.read()
  except OSError:
    thp_mode = None
  value = tunables_to_add(env, thp_mode, platform.libc_ver())
  if value is not None:
    env['GLIBC_TUNABLES'] = value
  return env


def reexec() -> None:
  """Restarts this process with `TUNABLE` where it helps (see `environ`);
  returns otherwise."""
  env = environ()
  argv = getattr(sys, 'orig_argv', None)
  if env.get('GLIBC_TUNABLES') == os.environ.get('GLIBC_TUNABLES') or (
      not argv):
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *argv[1:]], env)
