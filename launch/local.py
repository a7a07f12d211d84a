"""`--local-processes=N`: the multi-host launch path as N processes here.

Each process is `python -m vit_jax.main ... --coordinator=127.0.0.1:PORT
--num_processes=N --process_id=i` with JAX_PLATFORMS=cpu (jax.distributed
over gloo on CPU), exactly what every TPU worker runs, less the TPU. Process
0's output streams here; the others write logs to a temporary directory. If
one process fails the rest are stopped (they would wait for it forever) and
its exit status is returned.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from typing import Mapping, Optional, Sequence

from vit_jax.launch.runner import Process, Runner


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def process_argv(main_args: Sequence[str], env: Mapping[str, str], *,
                 num_processes: int, process_id: int, port: int) -> list:
  pairs = [f'{k}={v}' for k, v in {'JAX_PLATFORMS': 'cpu', **env}.items()]
  return ['env', *pairs, sys.executable, '-m', 'vit_jax.main', *main_args,
          f'--coordinator=127.0.0.1:{port}',
          f'--num_processes={num_processes}', f'--process_id={process_id}']


def run(runner: Runner, num_processes: int, main_args: Sequence[str],
        env: Mapping[str, str], cwd: str, poll_s: float = 0.5,
        grace_s: float = 10.0) -> int:
  """Runs the N processes to the end; 0, or the first failure's status."""
  port = free_port()
  log_dir = (os.path.join(tempfile.gettempdir(), 'vit_jax_local')
             if runner.dry_run else tempfile.mkdtemp(prefix='vit_jax_local_'))
  runner.note(f'{num_processes} local processes in {cwd}; process 0 streams '
              f'here, the others log to {log_dir}')
  procs, logs = {}, {}
  for i in list(range(1, num_processes)) + [0]:  # 0 last: a valid script.
    logs[i] = os.path.join(log_dir, f'process_{i}.log') if i else None
    procs[i] = runner.start(
        process_argv(main_args, env, num_processes=num_processes,
                     process_id=i, port=port), log=logs[i], cwd=cwd)
  failed = _wait_all(procs, poll_s, grace_s)
  if failed is None:
    return 0
  i, code = failed
  runner.note(f'process {i} failed (exit {code})')
  if logs[i]:
    runner.note(f'last lines of {logs[i]}:\n' + _tail(logs[i]))
  return code or 1


def _wait_all(procs: Mapping[int, Process], poll_s: float,
              grace_s: float) -> Optional[tuple]:
  """Waits for every process; (index, status) of the first to fail."""
  failed, deadline = None, None
  while True:
    codes = {i: p.wait(0) for i, p in procs.items()}
    if failed is None:
      failed = next(((i, c) for i, c in sorted(codes.items()) if c), None)
      if failed is not None:
        deadline = time.monotonic() + grace_s
    if all(c is not None for c in codes.values()):
      return failed
    if deadline is not None and time.monotonic() > deadline:
      for p in procs.values():
        p.stop()
      return failed
    time.sleep(poll_s)


def _tail(path: str, lines: int = 20) -> str:
  try:
    with open(path, errors='replace') as f:
      return ''.join(f.readlines()[-lines:]).rstrip()
  except OSError as e:
    return str(e)
