"""Huge pages for the command-line faces: when the restart happens, and
that it does (a real process restart, as `python -m vit_jax.main` gets)."""

import os
import platform
import subprocess
import sys

from vit_jax import hugepages

MADVISE = 'always [madvise] never\n'


def test_restart_only_where_the_tunable_helps():
  glibc = ('glibc', '2.36')
  assert hugepages.tunables_to_add({}, MADVISE, glibc) == hugepages.TUNABLE
  # Other tunables are kept.
  assert hugepages.tunables_to_add(
      {'GLIBC_TUNABLES': 'glibc.malloc.arena_max=2'}, MADVISE, glibc) == (
          'glibc.malloc.arena_max=2:' + hugepages.TUNABLE)
  for env, thp, libc in [
      ({hugepages.ENV: '0'}, MADVISE, glibc),  # Turned off.
      ({'GLIBC_TUNABLES': 'glibc.malloc.hugetlb=0'}, MADVISE, glibc),  # Set.
      ({}, '[always] madvise never', glibc),  # The kernel does it anyway.
      ({}, 'always madvise [never]', glibc),  # Nothing to ask for.
      ({}, None, glibc),  # Unreadable.
      ({}, MADVISE, ('glibc', '2.31')),  # No such tunable yet.
      ({}, MADVISE, ('', '')),  # musl, or unknown.
  ]:
    assert hugepages.tunables_to_add(env, thp, libc) is None, (env, thp, libc)


def test_reexec_restarts_the_process_once_with_the_tunable():
  try:
    with open(hugepages.THP_MODE, encoding='ascii') as f:
      thp = f.read()
  except OSError:
    thp = None
  env = {k: v for k, v in os.environ.items()
         if k not in ('GLIBC_TUNABLES', hugepages.ENV)}
  expected = hugepages.tunables_to_add(env, thp, platform.libc_ver())
  code = ('import os, sys; print("start", flush=True); '
          'from vit_jax import hugepages; hugepages.reexec(); '
          'print(os.environ.get("GLIBC_TUNABLES"), sys.argv[1:])')
  out = subprocess.run([sys.executable, '-c', code, 'arg'], env=env,
                       capture_output=True, text=True, check=True).stdout
  lines = out.splitlines()
  assert lines[-1] == f"{expected} ['arg']"
  assert lines.count('start') == (2 if expected else 1)
  off = subprocess.run([sys.executable, '-c', code, 'arg'],
                       env={**env, hugepages.ENV: '0'}, capture_output=True,
                       text=True, check=True).stdout.splitlines()
  assert off == ['start', "None ['arg']"]
