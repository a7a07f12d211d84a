"""A `jax.profiler` trace of a window of train steps.

`--config.profile=<start>,<steps>` traces the steps after `start` steps
have run: steps start+1 .. start+steps (e.g. `10,5`: steps 11 to 15, after
compilation and warm-up; a start of 0 traces the first step, compilation
included). Every process traces its own host and devices into a folder of
its own, `<workdir>/profile/process_<i>/plugins/profile/<run>/` (JAX writes
one trace per folder: two processes in one folder overwrite each other's
files on one host and break the Perfetto export), for TensorBoard's profile
plugin (`*.xplane.pb`; `tensorboard --logdir=<workdir>/profile` lists each
process's run) and, where the workdir is a local path, Perfetto
(`perfetto_trace.json.gz`, open it at ui.perfetto.dev; JAX writes it with
`pathlib`, which cannot write to gs://). '' (the default) traces nothing.

A profiler that fails (to start, or to write its trace) logs a warning and
the run goes on untraced: a trace is never worth a run.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, ContextManager, Optional, Tuple

import jax
from absl import logging

EXAMPLE = '10,5 (trace steps 11 to 15)'


def parse(spec: Any) -> Optional[Tuple[int, int]]:
  """(start, steps) of `--config.profile`, or None for '' / None."""
  if spec is None or (isinstance(spec, str) and not spec.strip()):
    return None
  parts = (spec.split(',') if isinstance(spec, str) else list(spec))
  try:
    start, steps = (int(str(p).strip()) for p in parts)
  except ValueError:
    start = steps = None
  if start is None or start < 0 or steps < 1:
    raise ValueError(f'--config.profile={spec!r}: expected <start>,<steps> '
                     f'with start >= 0 steps already run and steps >= 1, '
                     f'e.g. {EXAMPLE}; or \'\' for no trace')
  return start, steps


def _no_timer(name: str) -> ContextManager[None]:
  del name
  return contextlib.nullcontext()


class Window:
  """Starts the trace before step start+1 and stops it (waiting for the
  traced steps to finish on the device) after step start+steps.

  `timed(name)`: a context manager that times what it wraps under `name`
  (the loop's `Progress.timed`): starting and writing the trace count as
  'profile', waiting for the traced steps as 'step', so that neither shows
  up as host overhead.
  """

  def __init__(self, spec: Any, workdir: str, first_step: int = 0,
               last_step: Optional[int] = None,
               timed: Callable[[str], ContextManager[None]] = _no_timer):
    window = parse(spec)
    self.directory = os.path.join(workdir, 'profile',
                                  f'process_{jax.process_index()}')
    # JAX's Perfetto export reads the trace back with `pathlib`: local only.
    self._perfetto = '://' not in workdir
    self._timed = timed
    self._start, self._stop = (None, None) if window is None else (
        window[0], window[0] + window[1])
    self._active = False
    if window is not None and first_step > self._start:
      logging.warning('profile window %s starts before step %d, where this '
                      'run resumes: no trace', spec, first_step)
      self._start = None
    elif (window is not None and last_step is not None
          and self._start >= last_step):
      logging.warning('profile window %s starts after the run\'s last step '
                      '(%d): no trace; pick a start below it', spec,
                      last_step)
      self._start = None
    elif (window is not None and last_step is not None
          and self._stop > last_step):
      # Cut at the last step: the final checkpoint and evaluation are not
      # train steps.
      logging.warning('profile window %s ends after the run\'s last step '
                      '(%d): tracing steps %d to %d', spec, last_step,
                      self._start + 1, last_step)
      self._stop = last_step

  @property
  def active(self) -> bool:
    return self._active

  def before_step(self, done: int) -> None:
    """Call before running a step, with the number of steps done."""
    if self._start is None or done != self._start or self._active:
      return
    with self._timed('profile'):
      try:
        jax.profiler.start_trace(self.directory,
                                 create_perfetto_trace=self._perfetto)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning('profiler could not start (%s: %s): no trace; the '
                        'run goes on', type(e).__name__, e)
        return
    self._active = True
    logging.info('profiling steps %d to %d into %s', done + 1, self._stop,
                 self.directory)

  def after_step(self, done: int, outputs: Any) -> None:
    """Call after dispatching a step, with the steps done and its outputs."""
    if self._active and done >= self._stop:
      with self._timed('step'):  # The traced steps' device time.
        jax.block_until_ready(outputs)
      self.close()

  def close(self) -> None:
    """Stops the trace and writes it, if one runs. A failure to write it
    is logged, never raised: the run goes on (and no other process waits
    for this one in a collective while it unwinds)."""
    if not self._active:
      return
    self._active = False
    with self._timed('profile'):
      try:
        jax.profiler.stop_trace()
      except Exception as e:  # pylint: disable=broad-except
        logging.warning('writing the profile trace to %s failed (%s: %s): '
                        'what is there may be incomplete; the run goes on',
                        self.directory, type(e).__name__, e)
        return
    logging.info('profile trace written to %s', self.directory)
