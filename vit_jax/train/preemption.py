"""Stop cleanly on SIGTERM / SIGINT / TPU preemption: save, then exit.

A preempted TPU VM or spot GPU gets SIGTERM seconds to a minute before it
dies; a user presses Ctrl-C. Either way the loop finishes the step it is in,
saves a checkpoint, waits for the save, and exits with `EXIT_PREEMPTED` (75)
or `EXIT_INTERRUPTED` (130), which launchers read as "re-run the same
command to resume". A second Ctrl-C stops at once, without saving.

Single-process runs catch the signals here. Multi-process runs ask JAX's
preemption service (`multihost_utils.reached_preemption_sync_point`, via
orbax): every process reaches the same step before saving, which a signal
that reaches hosts at different moments could not guarantee. That service
watches SIGTERM only, so there a Ctrl-C is passed on to it as a SIGTERM to
the process itself (before, it raised KeyboardInterrupt in the middle of a
collective: the run lost everything since its last checkpoint and the
other processes aborted).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Callable, Optional

# No JAX import at module level: launchers read the exit codes without it.

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: try again (the launcher relaunches).
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention.


class RunInterrupted(Exception):
  """The run saved a checkpoint at `step` and stopped on request."""

  def __init__(self, step: int, reason: str, exit_code: int):
    super().__init__(
        f'{reason}: saved a checkpoint at step {step} and stopped. Re-run the '
        'same command (same --workdir) to resume from it.')
    self.step = step
    self.exit_code = exit_code


class StoppedBeforeTraining(RunInterrupted):
  """SIGTERM came before the steps started (reading data, restoring,
  compiling) or after they ended: nothing trained since the last checkpoint
  is lost."""

  def __init__(self, name: str):  # pylint: disable=super-init-not-called
    Exception.__init__(
        self, f'received {name} outside the training steps: stopped at '
        'once, nothing trained since the last checkpoint is lost. Re-run '
        'the same command (same --workdir) to resume.')
    self.step = None
    self.exit_code = EXIT_PREEMPTED


def ignore_sigterm_once_done():
  """The run is done (its summary written): a SIGTERM from here on (a VM
  shutting down as the run ends) is ignored, and the process exits with
  the run's status. Python restores the default action of the handlers it
  installed before it unloads its modules, which takes JAX and TensorFlow
  seconds: such a SIGTERM killed a finished run with -15, which launchers
  record as 143 and resume. An ignored signal stays ignored."""
  signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def stop_at_once_outside_steps():
  """Single-process runs: SIGTERM outside the training loop (setup can
  take minutes, longer than a preemption notice; writing the summary after
  it) ends the run at once with EXIT_PREEMPTED, which launchers re-run,
  instead of killing it with -15, which they take as a failure.
  `StopRequests` takes over for the loop (its steps and evaluations).
  Multi-process runs leave SIGTERM to JAX's preemption service."""
  import jax
  if (jax.process_count() > 1 or
      threading.current_thread() is not threading.main_thread()):
    yield
    return

  global _received_outside_steps

  def stop(signum, frame):  # pylint: disable=unused-argument
    # Kept as well as raised: raised inside a `__del__` (a garbage
    # collector's), the exception is only printed and the run goes on.
    global _received_outside_steps
    _received_outside_steps = signal.Signals(signum).name
    raise StoppedBeforeTraining(_received_outside_steps)

  _received_outside_steps = None
  previous = signal.signal(signal.SIGTERM, stop)
  try:
    yield
    if _received_outside_steps:  # Swallowed on its way: stop now.
      raise StoppedBeforeTraining(_received_outside_steps)
  finally:
    signal.signal(signal.SIGTERM, previous)
    _received_outside_steps = None  # Acted on: not the next block's.


# A SIGTERM `stop_at_once_outside_steps` caught (its name), or None: a stop
# whose exception was swallowed still stops the run, at the steps' start
# (`StopRequests`) or at the block's end.
_received_outside_steps: Optional[str] = None


class StopRequests:
  """Signal handlers installed for the duration of a `with` block."""

  def __init__(self, reached_preemption: Callable[[int], bool]):
    self._reached_preemption = reached_preemption
    self._reason: Optional[str] = None
    self._code = 0
    self._previous = {}
    self._multi = False
    self._ctrl_c = False  # Multi-process: a Ctrl-C passed on as SIGTERM.

  def _pass_on(self, signum, frame):  # pylint: disable=unused-argument
    """Multi-process SIGINT: JAX's preemption service takes it as SIGTERM
    (it tells every process, which all save at the same step)."""
    if self._ctrl_c:
      raise KeyboardInterrupt  # Second Ctrl-C: stop now, no save.
    self._ctrl_c = True
    os.kill(os.getpid(), signal.SIGTERM)

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    if signum == signal.SIGINT and self._reason is not None:
      raise KeyboardInterrupt  # Second Ctrl-C: stop now, no save.
    name = signal.Signals(signum).name
    self._reason = f'received {name}'
    self._code = (EXIT_INTERRUPTED if signum == signal.SIGINT
                  else EXIT_PREEMPTED)
    # Said at once (a step or an evaluation may take long); os.write, as
    # logging's locks may be held by the code the signal interrupted.
    again = (' (Ctrl-C again: stop now, without saving)'
             if signum == signal.SIGINT else '')
    try:  # A stderr that is gone (`| tee` killed by the same Ctrl-C).
      os.write(2, (f'vit_jax: received {name}: saving a checkpoint after '
                   f'the current step, then stopping{again}\n').encode())
    except OSError:
      pass

  def __enter__(self) -> 'StopRequests':
    import jax
    self._multi = jax.process_count() > 1
    if threading.current_thread() is threading.main_thread():
      if self._multi:
        # Python cannot see JAX's SIGTERM handler (installed from C++, it
        # reads as SIG_DFL here), so this cannot check that it is there.
        # With the service off (`jax_enable_preemption_service`), SIGTERM
        # ends the process, as the KeyboardInterrupt did before.
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT,
                                                      self._pass_on)
      else:
        if _received_outside_steps:  # During set-up; its stop swallowed.
          raise StoppedBeforeTraining(_received_outside_steps)
        for sig in (signal.SIGTERM, signal.SIGINT):
          self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  def requested(self, step: int) -> Optional[RunInterrupted]:
    """A RunInterrupted to raise once step `step` is saved, or None."""
    if self._reason is None and self._multi:
      if self._reached_preemption(step):
        self._reason, self._code = (
            ('received SIGINT', EXIT_INTERRUPTED) if self._ctrl_c
            else ('preemption notice', EXIT_PREEMPTED))
    if self._reason is None:
      return None
    return RunInterrupted(step, self._reason, self._code)
