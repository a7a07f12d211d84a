"""Metric writers, progress and cost accounting during a run.

Only process 0 writes (TensorBoard event files + `metrics.jsonl` in the
workdir); other processes log. Progress adds what a run costs so far: img/s
(total and per device), device-hours, TPU-core-days (cores per device
handled) and exaFLOPs (3 x forward FLOPs x examples seen).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Mapping, Optional

import jax
import numpy as np
from absl import logging
from clu import metric_writers, periodic_actions, platform
from etils import epath

from vit_jax import accounting
from vit_jax.train.run_files import write_text


class JsonlWriter(metric_writers.LoggingWriter):
  """One JSON object per `write_scalars` call, in a file (local or gs://).

  Rows of an earlier run in the same workdir are kept up to `resume_step`
  (the checkpoint this run resumes from); later rows were written after
  that checkpoint by an interrupted run and are written again as this run
  re-computes those steps. A row with the step and keys of an existing row
  (e.g. the final evaluation, repeated when a run resumes at its last step)
  replaces it. So no step appears twice with the same metrics.

  Every `write_scalars` writes the file (whole: object stores cannot
  append, and a run's metrics are small); `make_writer` runs it on clu's
  AsyncWriter thread, so the train loop never waits for the store. A write
  that fails there (a store's transient error) is logged and retried at
  the next row; only `flush` and `close` raise, once the rows cannot be
  written at all.
  """

  def __init__(self, path: str, resume_step: Optional[int] = None):
    super().__init__()
    self._path = path
    epath.Path(path).parent.mkdir(parents=True, exist_ok=True)
    self._lines = []
    if epath.Path(path).exists():
      self._lines = [l for l in epath.Path(path).read_text().splitlines()
                     if l.strip()]
      if resume_step is not None:
        self._lines = [l for l in self._lines
                       if _row_step(l) is None or _row_step(l) <= resume_step]
    self._dirty = False

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    row = {'step': int(step)}
    row.update({k: float(np.asarray(v)) for k, v in scalars.items()})
    line = json.dumps(row)
    for i in range(len(self._lines) - 1, -1, -1):  # Rows are in step order.
      earlier = _row_step(self._lines[i])
      if earlier is not None and earlier < row['step']:
        self._lines.append(line)
        break
      if earlier == row['step'] and set(json.loads(self._lines[i])) == set(
          row):
        self._lines[i] = line
        break
    else:
      self._lines.append(line)
    self._dirty = True
    try:
      self.flush()
    except Exception as e:  # pylint: disable=broad-except
      logging.warning('%s could not be written (%s: %s); trying again with '
                      'the next row', self._path, type(e).__name__, e)

  def write_hparams(self, hparams: Mapping[str, Any]):
    pass

  def flush(self):
    if self._dirty:
      write_text(self._path, '\n'.join(self._lines) + '\n')
      self._dirty = False

  def close(self):
    try:
      self.flush()
    except Exception as e:
      raise OSError(f'{self._path} could not be written ({type(e).__name__}: '
                    f'{e}); its rows are in this run\'s log and TensorBoard '
                    'events') from e


def _row_step(line: str) -> Optional[int]:
  try:
    return int(json.loads(line)['step'])
  except (ValueError, KeyError, TypeError):
    return None  # A torn last line of a killed write: kept as is.


class TolerantWriter:
  """A writer whose failures (TensorBoard's event file on a full disk or a
  failing store) are logged, the first one as a warning, not raised: the
  run goes on, and metrics.jsonl, which raises only once its rows cannot be
  written at all, and the log keep the rows."""

  def __init__(self, inner, what: str):
    self._inner, self._what, self._failed = inner, what, False

  def __getattr__(self, name):
    method = getattr(self._inner, name)

    def call(*args, **kwargs):
      try:
        return method(*args, **kwargs)
      except Exception as e:  # pylint: disable=broad-except
        if not self._failed:
          logging.warning('%s could not be written (%s: %s); the run goes '
                          'on, its metrics are in metrics.jsonl and the log',
                          self._what, type(e).__name__, e)
        self._failed = True
    return call


def make_writer(workdir: str, resume_step: Optional[int] = None
                ) -> metric_writers.MetricWriter:
  """TensorBoard + metrics.jsonl on process 0; logging only elsewhere.

  Both write on a thread of their own: `write_scalars` returns at once, and
  a row reaches metrics.jsonl as soon as it is written (TensorBoard's event
  file within TensorFlow's flush interval); `flush` and `close` wait for
  both. TensorBoard's failures are logged (`TolerantWriter`);
  metrics.jsonl's are retried, and raised by `flush` / `close`.

  `resume_step`: the step a training run starts from (see JsonlWriter).
  """
  if jax.process_index() != 0:
    return metric_writers.create_default_writer(None, just_logging=True)
  return metric_writers.MultiWriter([
      TolerantWriter(metric_writers.create_default_writer(
          workdir, asynchronous=True), 'TensorBoard events'),
      metric_writers.AsyncWriter(
          JsonlWriter(os.path.join(workdir, 'metrics.jsonl'), resume_step)),
  ])


# A run's cost figures (summary.json's; the progress log's but wall_s).
COST_KEYS = ('wall_s', 'device_hours', 'core_days')


def cost(wall_s: float, num_devices: int, cores_per_device: float
         ) -> Dict[str, float]:
  """`COST_KEYS` of `wall_s` seconds on `num_devices` devices of
  `cores_per_device` cores each (TPU cores per chip; 1 elsewhere)."""
  device_hours = num_devices * wall_s / 3600
  return {'wall_s': wall_s, 'device_hours': device_hours,
          'core_days': device_hours * cores_per_device / 24}


def carried_cost(saved: Dict[str, Any], num_devices: int,
                 cores_per_device: float) -> Dict[str, float]:
  """`COST_KEYS` of a resumed run's earlier parts, from its checkpoint's
  run state (zero for a new run). Each part is costed on its own devices
  (a run moved from 8 devices to 1 is not billed as 1 device throughout);
  a checkpoint saved before 2026-11-30 recorded only `wall_s`, which is
  costed on this part's devices, as it was then."""
  if all(isinstance(saved.get(k), (int, float)) for k in COST_KEYS):
    return {k: float(saved[k]) for k in COST_KEYS}
  return cost(float(saved.get('wall_s', 0.0)), num_devices, cores_per_device)


def hardware_so_far(earlier: Optional[str], now: str) -> str:
  """The hardware a run trained on, each kind once in the order used
  ('tpu_v3, cpu' for a run resumed on CPUs): `earlier` is the checkpoint's
  record (None for a new run or one saved before 2026-11-30)."""
  kinds = earlier.split(', ') if earlier else []
  return ', '.join(kinds + ([now] if now not in kinds else []))


def format_seconds(seconds: float) -> str:
  """'42s', '7m05s', '3h02m', '2d04h': seconds below a minute (a smoke run's
  ETA is not '0m'), two units above."""
  s = int(round(max(seconds, 0.0)))
  if s < 60:
    return f'{s}s'
  if s < 3600:
    return f'{s // 60}m{s % 60:02d}s'
  if s < 86400:
    return f'{s // 3600}h{s % 3600 // 60:02d}m'
  return f'{s // 86400}d{s % 86400 // 3600:02d}h'


class Progress(periodic_actions.ReportProgress):
  """clu's progress report (steps/s, ETA, time per timed part) plus what the
  run costs: img/s (total and per device), device-hours, TPU-core-days and
  exaFLOPs so far. Call it after every step; after a step where it
  triggered (every `every_steps` and at the last step), `scalars` holds the
  values since the previous report, e.g. `input_wait_share` (time in
  `timed('input_wait')` over wall time) and the seconds per step split into
  `input_wait_s_per_step`, `step_s_per_step` (dispatch and waiting for the
  device), `host_s_per_step` (the rest of the loop) and any other timed
  part (`eval_s_per_step`, `checkpoint_s_per_step`, `profile_s_per_step`:
  starting a `--config.profile` trace and writing it), summing to
  `step_time_s`."""

  def __init__(self, *, total_steps: int, batch_size: int, start_step: int,
               forward_flops: float, every_steps: int,
               num_devices: Optional[int] = None,
               prior: Optional[Dict[str, Any]] = None):
    super().__init__(num_train_steps=total_steps, every_steps=every_steps,
                     every_secs=None)
    self.total_steps = total_steps
    self.batch_size = batch_size
    self.flops_per_example = 3.0 * forward_flops
    self.num_devices = num_devices or jax.device_count()
    hw = accounting.detect_hardware(jax.devices()[0].device_kind)
    self.cores_per_device = hw.cores(1) if hw else 1.0
    self.hardware = hw.name if hw else jax.devices()[0].device_kind
    self.start_step = start_step
    # The run's cost before this process (a resumed run's checkpoint: its
    # run state), so that reports are of the run so far, like summary.json.
    self.prior = carried_cost(prior or {}, self.num_devices,
                              self.cores_per_device)
    self.scalars: Dict[str, float] = {}
    self._parts_before: Dict[str, float] = {}
    self(start_step)  # Starts the clock (the first call never reports).

  def elapsed(self) -> float:
    return time.monotonic() - self._t0

  def spent(self, elapsed: Optional[float] = None) -> Dict[str, float]:
    """`COST_KEYS` of the run so far: the earlier parts' plus this
    process's `elapsed` seconds (now) on its own devices."""
    now = cost(self.elapsed() if elapsed is None else elapsed,
               self.num_devices, self.cores_per_device)
    return {k: self.prior[k] + now[k] for k in COST_KEYS}

  def _apply(self, step: int, t: float):
    # Not clu's own line: its shares are of the whole process's time, its
    # times whole minutes ("ETA: 0m"), beside this interval's metrics.
    interval = max(t - self._previous_time, 1e-9)
    steps_per_s = (step - self._previous_step) / interval
    spent_so_far = self.spent(t - self._t0)
    wall = spent_so_far['wall_s']
    examples = step * self.batch_size  # Since step 0, resumes included.
    parts = dict(self._time_per_part)
    spent = {name: parts[name] - self._parts_before.get(name, 0.0)
             for name in parts}
    shares = {f'{name}_share': dt / interval for name, dt in spent.items()}
    self._parts_before = parts
    # Per step: input wait, step (dispatch + waiting for the device), the
    # rest of the loop (host overhead: reporting, bookkeeping), and evals /
    # checkpoints / the profiler's start and export where they ran (in the
    # log line only then).
    steps = max(step - self._previous_step, 1)
    split = {f'{name}_s_per_step': dt / steps for name, dt in spent.items()}
    split['host_s_per_step'] = max(interval - sum(spent.values()), 0.0) / steps
    split['step_time_s'] = interval / steps
    logging.info(
        'step %d: %.4f s/step = input wait %.4f + step %.4f + host %.4f%s',
        step, split['step_time_s'], split.get('input_wait_s_per_step', 0.0),
        split.get('step_s_per_step', 0.0), split['host_s_per_step'],
        ''.join(f' + {n} {split[f"{n}_s_per_step"]:.4f}' for n in spent
                if n not in ('input_wait', 'step') and spent[n] > 0))
    remaining = self.total_steps - step
    eta = remaining / steps_per_s if steps_per_s else 0.0
    platform.work_unit().set_notes(
        f'{steps_per_s:.2f} steps/s, {100 * step / self.total_steps:.1f}% '
        f'({step}/{self.total_steps}), ETA {format_seconds(eta)}, elapsed '
        f'{format_seconds(wall)}; since the last report: '
        + ', '.join(f'{100 * dt / interval:.1f}% {name}'
                    for name, dt in sorted(spent.items())))
    self.scalars = {
        'input_wait_share': 0.0, **shares,
        'steps_per_s': steps_per_s,
        'img_per_s': steps_per_s * self.batch_size,
        'img_per_s_per_device': steps_per_s * self.batch_size / self.num_devices,
        'eta_hours': remaining / steps_per_s / 3600 if steps_per_s else 0.0,
        'device_hours': spent_so_far['device_hours'],
        'core_days': spent_so_far['core_days'],
        'exaflops': examples * self.flops_per_example / 1e18,
        **split,
    }
