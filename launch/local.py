"""`--local-processes=N`: the multi-host launch path as N processes here.

Each process is `python -m vit_jax.main ... --coordinator=127.0.0.1:PORT
--num_processes=N --process_id=i` with JAX_PLATFORMS=cpu (jax.distributed
over gloo on CPU), exactly what every TPU worker runs, less the TPU. Process
0's output streams here; the others write logs to a temporary directory,
removed at the end unless a process failed (then its path is printed). If
one process fails the rest are stopped (they would wait for it forever) and
its exit status is returned.

Interrupted (Ctrl-C, or SIGTERM / SIGHUP: `timeout`, a CI job's limit, a
closed terminal), the launcher passes SIGTERM on to every process (each
saves a checkpoint at the same step, as on a preempted TPU), waits for them
(killing them after STOP_GRACE_S; a second Ctrl-C kills them at once) and
returns 128 + the signal's number: nothing goes on training, or printing
after the shell's prompt, behind it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Iterator, Mapping, Optional, Sequence

from vit_jax.launch.runner import Process, Runner
from vit_jax.train.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED

# Seconds the processes get to save a checkpoint and exit when the launcher
# is interrupted, before they are killed.
STOP_GRACE_S = 60.0
# A process's exit status after a clean stop on request: its logs are
# removed with the rest.
_STOPPED_CLEANLY = (0, EXIT_PREEMPTED, EXIT_INTERRUPTED)


class Interrupted(Exception):
  """The launcher got SIGTERM or SIGHUP (Ctrl-C is KeyboardInterrupt)."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


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


def exit_status(code: int) -> int:
  """A process's exit status as the shell reports it: 128 + N for one
  killed by signal N (Popen says -N)."""
  return 128 - code if code < 0 else code


def run(runner: Runner, num_processes: int, main_args: Sequence[str],
        env: Mapping[str, str], cwd: str, poll_s: float = 0.5,
        grace_s: float = 10.0, stop_grace_s: float = STOP_GRACE_S) -> int:
  """Runs the N processes to the end; 0, or the first failure's status
  (128 + N for a signal N: the launcher's, when it was interrupted)."""
  port = free_port()
  if runner.dry_run:  # A script that runs as printed, from any folder.
    log_dir = os.path.join(tempfile.gettempdir(), 'vit_jax_local')
    runner.show(['mkdir', '-p', log_dir])
    runner.show(['cd', cwd])
  else:
    log_dir = tempfile.mkdtemp(prefix='vit_jax_local_')
  runner.note(f'{num_processes} local processes in {cwd}; process 0 streams '
              f'here, the others log to {log_dir} (removed at the end unless '
              'a process failed)')
  procs, logs = {}, {}
  try:
    with signals_interrupt():
      try:
        for i in list(range(1, num_processes)) + [0]:  # 0 last: a script.
          logs[i] = os.path.join(log_dir, f'process_{i}.log') if i else None
          procs[i] = runner.start(
              process_argv(main_args, env, num_processes=num_processes,
                           process_id=i, port=port), log=logs[i], cwd=cwd)
        failed = _wait_all(procs, poll_s, grace_s)
      except (KeyboardInterrupt, Interrupted) as e:
        signum = getattr(e, 'signum', signal.SIGINT)
        _stop_on_signal(runner, procs, signum, stop_grace_s, log_dir)
        return 128 + signum
  except BaseException:
    # Starting a process failed (CommandError), or a second signal came
    # while they were stopped: none must be left running.
    _stop_all(procs, 0.0)
    raise
  if failed is None:
    _keep_or_remove(runner, log_dir, keep=False)
    return 0
  i, code = failed
  runner.note(f'process {i} failed (exit {exit_status(code)})')
  if logs[i]:
    runner.note(f'last lines of {logs[i]}:\n' + _tail(logs[i]))
  _keep_or_remove(runner, log_dir, keep=True)
  return exit_status(code) or 1


def _stop_on_signal(runner: Runner, procs: Mapping[int, Process],
                    signum: int, grace_s: float, log_dir: str) -> None:
  """The launcher got `signum`: its processes save and stop first."""
  runner.note(f'{signal.Signals(signum).name}: stopping the {len(procs)} '
              f'processes (SIGTERM: they save a checkpoint; killed after '
              f'{grace_s:g} s, or at once on another Ctrl-C)')
  codes = _stop_all(procs, grace_s)
  runner.note('stopped: ' + ', '.join(
      f'process {i} exit {exit_status(c)}' for i, c in sorted(codes.items())
      if c is not None))
  _keep_or_remove(runner, log_dir, keep=any(
      c not in _STOPPED_CLEANLY for c in codes.values()))


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
  """SIGTERM and SIGHUP raise `Interrupted` (by default they would end the
  launcher at once, its processes left running; `launch.tpu up` silently,
  naming neither its TPU nor how to delete it). One the launcher was
  started ignoring stays ignored: `nohup` ignores SIGHUP so that a long
  `up` outlives its terminal."""
  if threading.current_thread() is not threading.main_thread():
    yield  # Signal handlers can only be set from the main thread.
    return

  def interrupt(signum, frame):  # pylint: disable=unused-argument
    raise Interrupted(signum)

  previous = {sig: signal.getsignal(sig)
              for sig in (signal.SIGTERM, signal.SIGHUP)}
  for sig, handler in previous.items():
    if handler is not signal.SIG_IGN:
      signal.signal(sig, interrupt)
  try:
    yield
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def _stop_all(procs: Mapping[int, Process], grace_s: float) -> dict:
  """Stops every process at once (SIGTERM, SIGKILL after `grace_s`) and
  waits for them; their exit statuses. One by one, each would wait out
  its own grace while the others had not been told yet."""
  threads = [threading.Thread(target=p.stop, args=(grace_s,), daemon=True)
             for p in procs.values()]
  for t in threads:
    t.start()
  try:
    for t in threads:
      t.join()
  except (KeyboardInterrupt, Interrupted):
    for p in procs.values():  # Asked again: no more waiting.
      p.stop(0.0)
  return {i: p.wait(0) for i, p in procs.items()}


def _keep_or_remove(runner: Runner, log_dir: str, keep: bool) -> None:
  """Removes the processes' log directory (one per launch would pile up in
  /tmp), or, with `keep` (a process failed), says where it stays."""
  if runner.dry_run:
    return
  if keep and os.listdir(log_dir):
    runner.note(f'the processes\' logs are kept in {log_dir}')
  else:
    shutil.rmtree(log_dir, ignore_errors=True)


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
      _stop_all(procs, grace_s)
      return failed
    time.sleep(poll_s)


def _tail(path: str, lines: int = 20) -> str:
  try:
    with open(path, errors='replace') as f:
      return ''.join(f.readlines()[-lines:]).rstrip()
  except OSError as e:
    return str(e)
