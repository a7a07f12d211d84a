"""The one place `launch.tpu` runs commands (gcloud, and local processes).

Every command is echoed before it runs: `+ cmd` for real runs; with
`dry_run=True` only the command is printed, shell-quoted with `shlex` (one per
line, ready to paste), and nothing runs. Everything else printed goes out as
`# ...` lines, so a dry run's output is itself a shell script. Tests subclass
`Runner` and override `_call` and `_spawn` to script the replies.
"""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
from typing import Optional, Sequence, TextIO


class CommandError(RuntimeError):
  """A command exited non-zero where success was needed."""

  def __init__(self, argv: Sequence[str], result: 'Result'):
    self.argv, self.result = list(argv), result
    detail = (result.stderr or '').strip().splitlines()[-3:]
    super().__init__(f'command failed (exit {result.returncode}): '
                     f'{shlex.join(argv)}' +
                     ''.join(f'\n  {line}' for line in detail))


@dataclasses.dataclass
class Result:
  returncode: int
  stdout: str = ''
  stderr: str = ''


class Process:
  """A started command: `wait(timeout)` -> exit code, or None if running."""

  def __init__(self, popen: Optional[subprocess.Popen] = None,
               returncode: Optional[int] = None):
    self._popen, self._returncode = popen, returncode

  def wait(self, timeout: Optional[float] = None) -> Optional[int]:
    if self._popen is None:
      return self._returncode
    try:
      return self._popen.wait(timeout)
    except subprocess.TimeoutExpired:
      return None

  def stop(self, grace: float = 10.0) -> None:
    """Terminate (then kill after `grace` seconds) if still running."""
    if self._popen is None or self._popen.poll() is not None:
      return
    self._popen.terminate()
    try:
      self._popen.wait(grace)
    except subprocess.TimeoutExpired:
      self._popen.kill()
      self._popen.wait()


class Runner:
  """Runs (or, with `dry_run`, prints) commands given as argv lists."""

  def __init__(self, dry_run: bool = False, out: Optional[TextIO] = None):
    self.dry_run = dry_run
    self._out = out

  @property
  def out(self) -> TextIO:
    return self._out or sys.stdout

  def show(self, argv: Sequence[str], suffix: str = '') -> None:
    line = shlex.join(argv) + suffix
    print(line if self.dry_run else f'+ {line}', file=self.out, flush=True)

  def note(self, text: str = '') -> None:
    for line in (text.splitlines() or ['']):
      print(f'# {line}'.rstrip(), file=self.out, flush=True)

  def run(self, argv: Sequence[str], *, capture: bool = False,
          check: bool = True, dry_stdout: str = '',
          echo: bool = True) -> Result:
    """Runs to completion; `capture` keeps stdout/stderr (else they stream).

    `dry_stdout` is what a dry run answers (e.g. the state a poll waits for);
    `echo=False` keeps a repeated poll out of the output.
    """
    if echo:
      self.show(argv)
    if self.dry_run:
      return Result(0, dry_stdout)
    result = self._call(list(argv), capture)
    if check and result.returncode:
      raise CommandError(argv, result)
    return result

  def start(self, argv: Sequence[str], *, log: Optional[str] = None,
            cwd: Optional[str] = None) -> Process:
    """Starts in the background; output streams here or goes to `log`."""
    self.show(argv, f' > {shlex.quote(log)} 2>&1 &' if log else '')
    if self.dry_run:
      return Process(returncode=0)
    return self._spawn(list(argv), log, cwd)

  # Overridden by tests.

  def _call(self, argv, capture) -> Result:
    try:
      p = subprocess.run(argv, text=True, capture_output=capture)
    except FileNotFoundError as e:
      raise CommandError(argv, _not_found(argv)) from e
    return Result(p.returncode, p.stdout or '', p.stderr or '')

  def _spawn(self, argv, log, cwd) -> Process:
    try:
      if log is None:
        return Process(subprocess.Popen(argv, cwd=cwd,
                                        preexec_fn=_term_with_parent))
      with open(log, 'w') as f:
        return Process(subprocess.Popen(argv, cwd=cwd, stdout=f,
                                        stderr=subprocess.STDOUT,
                                        preexec_fn=_term_with_parent))
    except FileNotFoundError as e:
      raise CommandError(argv, _not_found(argv)) from e


def _prctl():
  """libc's `prctl` (Linux), or None: looked up in the parent, as loading
  a library in a forked child may wait forever on a lock another of the
  parent's threads held when it forked."""
  if not sys.platform.startswith('linux'):
    return None
  import ctypes
  try:
    return ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    return None


_PRCTL = _prctl()


def _term_with_parent() -> None:
  """In a started child, before it runs (Linux): a SIGTERM when the
  process that started it dies, even by SIGKILL, which it cannot pass on
  (a local run's processes then save and stop, a log stream ends, instead
  of going on orphaned). Elsewhere nothing."""
  if _PRCTL is not None:
    _PRCTL(1, 15)  # PR_SET_PDEATHSIG, SIGTERM.


def _not_found(argv) -> Result:
  hint = (': install the Google Cloud CLI (https://cloud.google.com/sdk/'
          'docs/install) and run `gcloud auth login`'
          if argv[0] == 'gcloud' else '')
  return Result(127, '', f'{argv[0]} not found on PATH{hint}')
