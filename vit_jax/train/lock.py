"""One writer per workdir: `<workdir>/lock`, held while a run writes there.

The lock file is JSON naming its holder (host, process id, the process's
start time, the command line) and a heartbeat that a background thread
renews every `HEARTBEAT_S` seconds. A lock is stale, and is taken over with
a warning, when its holder is gone: on the same host, its process no longer
exists (or the pid now belongs to another process); from another host (a
preempted TPU VM that came back under another name), its heartbeat is older
than `STALE_S`. A SIGKILLed run therefore never leaves a workdir stuck.

Multi-host runs lock once, from process 0; the others learn the outcome.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import contextlib
import time
from typing import Dict, Iterator, Optional

import jax
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

HEARTBEAT_S = 30.0
STALE_S = 300.0  # 10 missed heartbeats: the holder is gone.


class WorkdirBusyError(RuntimeError):
  """Another live run holds the workdir."""


def _start_time(pid: int) -> Optional[str]:
  """The process's start time (Linux /proc), to tell pid reuse apart."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _alive(pid: int, start: Optional[str]) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # Exists, owned by someone else.
  return start is None or _start_time(pid) in (None, start)


def _parse(raw: str) -> dict:
  """A lock file's record; {} when half-written or garbled (judged by its
  age)."""
  try:
    held = json.loads(raw)
  except ValueError:
    return {}
  return held if isinstance(held, dict) else {}


class WorkdirNotWritableError(RuntimeError):
  """The workdir cannot be written (read-only storage, permissions)."""


class WorkdirLock:
  """`with WorkdirLock(workdir):` (or acquire/release) around a run."""

  def __init__(self, workdir: str, *, active: bool = True):
    self.path = epath.Path(workdir) / 'lock'
    self.active = active  # False on processes other than 0.
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None
    self._me = {'host': socket.gethostname(), 'pid': os.getpid(),
                'start': _start_time(os.getpid()),
                'command': ' '.join(sys.argv)}

  def _record(self) -> str:
    return json.dumps({**self._me, 'heartbeat': time.time()})

  def _read(self) -> Optional[str]:
    """The lock file's text, None if unlocked ('' if unreadable)."""
    try:
      return self.path.read_text()
    except FileNotFoundError:
      return None
    except OSError:
      return ''

  def holder(self) -> Optional[dict]:
    """The current lock's content, {} if unreadable, None if unlocked."""
    raw = self._read()
    return None if raw is None else _parse(raw)

  def _mine(self, held: Optional[dict]) -> bool:
    return bool(held) and (held.get('host'), held.get('pid')) == (
        self._me['host'], self._me['pid'])

  def _stale(self, held: dict) -> Optional[str]:
    """Why the lock `held` is stale, or None if its holder may be alive."""
    if held.get('host') == self._me['host'] and 'pid' in held:
      if not _alive(int(held['pid']), held.get('start')):
        return f'process {held["pid"]} on this host no longer runs'
      return None
    try:
      age = time.time() - float(held.get('heartbeat') or
                                self.path.stat().mtime)
    except (OSError, ValueError, TypeError):
      return 'unreadable lock'
    if age > STALE_S:
      return f'no heartbeat for {age:.0f} s'
    return None

  def acquire(self) -> Optional[str]:
    """Takes the lock; returns a note when a stale lock was taken over.

    Raises WorkdirBusyError naming the holder when a live run holds it.
    """
    if not self.active:
      return None
    self.path.parent.mkdir(parents=True, exist_ok=True)
    if '://' in str(self.path):
      note = self._acquire_remote()
    else:
      note = self._acquire_local()
    self._thread = threading.Thread(target=self._beat, daemon=True,
                                    name='workdir-lock-heartbeat')
    self._thread.start()
    return note

  def _busy(self, held: dict) -> WorkdirBusyError:
    who = (f'process {held.get("pid")} on host {held.get("host")} '
           f'({held.get("command", "?")})')
    return WorkdirBusyError(
        f'{self.path.parent} is in use by another run: {who}. Two runs in '
        'one workdir would overwrite each other\'s checkpoints and results. '
        'Use another --workdir, or wait for that run to end. If it is '
        f'certainly gone (its machine was deleted), delete {self.path}; a '
        f'lock whose heartbeat is older than {STALE_S:.0f} s is taken over '
        'automatically')

  def _acquire_local(self) -> Optional[str]:
    """Exclusive create; a stale lock is renamed away first, and only the
    lock that was judged stale is deleted: of two runs taking over the same
    stale lock, the slower one renames the winner's fresh lock, sees that
    it is not what it judged, and puts it back (then finds it busy)."""
    note = None
    for attempt in range(5):
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        raw = self._read()
        if raw is None:
          continue  # Released meanwhile.
        held = _parse(raw)
        why = self._stale(held)
        if why is None:
          raise self._busy(held) from None
        aside = f'{self.path}.stale-{os.getpid()}-{attempt}'
        try:
          os.rename(self.path, aside)
        except FileNotFoundError:
          continue  # Another run took it over first; try again.
        if epath.Path(aside).read_text() != raw:
          # Not the lock judged stale: a run that took it over meanwhile.
          try:
            os.link(aside, self.path)
          except FileExistsError:
            pass  # A third run locked meanwhile: it holds the workdir.
          os.remove(aside)
          continue
        os.remove(aside)
        note = (f'took over the stale lock of process {held.get("pid")} on '
                f'{held.get("host")} ({why})')
        continue
      with os.fdopen(fd, 'w') as f:
        f.write(self._record())
      return note
    raise self._busy(self.holder() or {})

  def _acquire_remote(self) -> Optional[str]:
    """Object stores have no exclusive create: write, wait, read back."""
    held = self.holder()
    note = None
    if held is not None:
      why = self._stale(held)
      if why is None:
        raise self._busy(held)
      note = f'took over a stale lock ({why})'
    self.path.write_text(self._record())
    time.sleep(1.0)
    held = self.holder() or {}
    if not self._mine(held):
      raise self._busy(held)
    return note

  def _beat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      try:
        held = self.holder()
        if held and not self._mine(held):
          # Taken over (our beats failed for STALE_S): never overwrite it.
          logging.error('The workdir lock %s now names another run (%s on '
                        '%s): this run no longer holds the workdir.',
                        self.path, held.get('pid'), held.get('host'))
          return
        self.path.write_text(self._record())
      except Exception as e:  # pylint: disable=broad-except
        # A transient storage error (OSError locally, tf.errors.* from
        # gs://): the next beat retries; the run goes on.
        logging.warning('Workdir lock heartbeat failed (%s); retrying in '
                        '%.0f s', e, HEARTBEAT_S)

  def release(self) -> None:
    if not self.active or self._thread is None:
      return
    self._stop.set()
    self._thread.join()
    self._thread = None
    if self._mine(self.holder()):
      self.path.unlink(missing_ok=True)

  def __enter__(self) -> 'WorkdirLock':
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()


# The workdirs this process holds (`hold` inside `hold` is a no-op:
# `python -m vit_jax.main` locks before it imports the trainer, which locks).
_HELD: Dict[str, WorkdirLock] = {}


@contextlib.contextmanager
def hold(workdir: str) -> Iterator[WorkdirLock]:
  """Holds `workdir`'s lock for a run: process 0 takes it, every process
  learns the outcome (and raises if it failed). Re-entrant within a
  process."""
  lock = WorkdirLock(workdir, active=jax.process_index() == 0)
  key = str(lock.path)
  key = key if '://' in key else os.path.abspath(key)
  if key in _HELD:
    yield _HELD[key]
    return
  error = None
  try:
    note = lock.acquire()
    if note:
      logging.warning('%s: %s', lock.path, note)
  except OSError as e:  # Read-only storage, permissions, no space.
    error = WorkdirNotWritableError(
        f'cannot write the lock of {lock.path.parent}: '
        f'{e.strerror or e}. Use a writable --workdir; to evaluate a run '
        'kept on read-only storage, pass it as --config.init with '
        '--config.mode=eval and a new --workdir')
  except Exception as e:  # pylint: disable=broad-except
    error = e
  if jax.process_count() > 1:
    ok = multihost_utils.broadcast_one_to_all(int(error is None))
    if not ok and error is None:
      error = WorkdirBusyError(f'process 0 could not lock {lock.path}; '
                               'its log says why')
  if error is not None:
    raise error
  _HELD[key] = lock
  try:
    yield lock
  finally:
    del _HELD[key]
    lock.release()
