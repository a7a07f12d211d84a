"""Metric writers, progress and cost accounting during a run, summary.json.

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
import tensorflow as tf
from clu import metric_writers

from vit_jax import accounting


class JsonlWriter(metric_writers.LoggingWriter):
  """One JSON object per `write_scalars` call, in a file (local or gs://).

  Rows of an earlier run in the same workdir are kept (resume appends).
  The file is rewritten whole at each flush: object stores cannot append,
  and a run's metrics are small.
  """

  def __init__(self, path: str):
    super().__init__()
    self._path = path
    tf.io.gfile.makedirs(os.path.dirname(path))
    self._lines = []
    if tf.io.gfile.exists(path):
      with tf.io.gfile.GFile(path, 'r') as f:
        self._lines = [l for l in f.read().splitlines() if l.strip()]
    self._dirty = False

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    row = {'step': int(step)}
    row.update({k: float(np.asarray(v)) for k, v in scalars.items()})
    self._lines.append(json.dumps(row))
    self._dirty = True

  def write_hparams(self, hparams: Mapping[str, Any]):
    pass

  def flush(self):
    if self._dirty:
      _write_text(self._path, '\n'.join(self._lines) + '\n')
      self._dirty = False

  def close(self):
    self.flush()


def make_writer(workdir: str) -> metric_writers.MetricWriter:
  """TensorBoard + metrics.jsonl on process 0; logging only elsewhere."""
  if jax.process_index() != 0:
    return metric_writers.create_default_writer(None, just_logging=True)
  return metric_writers.MultiWriter([
      metric_writers.create_default_writer(workdir, asynchronous=True),
      JsonlWriter(os.path.join(workdir, 'metrics.jsonl')),
  ])


class Progress:
  """Throughput, ETA and compute consumed, from wall-clock and examples."""

  def __init__(self, *, total_steps: int, batch_size: int, start_step: int,
               forward_flops: float, num_devices: Optional[int] = None):
    self.total_steps = total_steps
    self.batch_size = batch_size
    self.flops_per_example = 3.0 * forward_flops
    self.num_devices = num_devices or jax.device_count()
    hw = accounting.detect_hardware(jax.devices()[0].device_kind)
    self.cores_per_device = hw.cores(1) if hw else 1.0
    self.hardware = hw.name if hw else jax.devices()[0].device_kind
    self.start_step = start_step
    self._t0 = time.perf_counter()
    self._last = (self._t0, start_step)
    self._waited = 0.0  # Seconds spent waiting for input since last report.

  def input_wait(self, seconds: float) -> None:
    self._waited += seconds

  def elapsed(self) -> float:
    return time.perf_counter() - self._t0

  def report(self, step: int) -> Dict[str, float]:
    """Rates since the last report and totals since this run started."""
    now = time.perf_counter()
    t, s = self._last
    self._last = (now, step)
    steps_per_s = (step - s) / max(now - t, 1e-9)
    wall = now - self._t0
    examples = (step - self.start_step) * self.batch_size
    device_hours = self.num_devices * wall / 3600
    remaining = self.total_steps - step
    waited, self._waited = self._waited, 0.0
    return {
        'input_wait_share': waited / max(now - t, 1e-9),
        'steps_per_s': steps_per_s,
        'img_per_s': steps_per_s * self.batch_size,
        'img_per_s_per_device': steps_per_s * self.batch_size / self.num_devices,
        'eta_hours': remaining / steps_per_s / 3600 if steps_per_s else 0.0,
        'device_hours': device_hours,
        'core_days': device_hours * self.cores_per_device / 24,
        'exaflops': examples * self.flops_per_example / 1e18,
    }


def write_json(workdir: str, name: str, content: Dict[str, Any]) -> str:
  """Writes `workdir/name` atomically (process 0 only); returns its path."""
  path = os.path.join(workdir, name)
  if jax.process_index() == 0:
    tf.io.gfile.makedirs(workdir)
    _write_text(path, json.dumps(content, indent=2, sort_keys=True) + '\n')
  return path


def write_summary(workdir: str, summary: Dict[str, Any]) -> str:
  """Writes summary.json atomically (process 0 only); returns its path.

  Keys of an earlier summary in the workdir that this one lacks (e.g. the
  final train metrics, when a finished run is resumed and only evaluates)
  are kept.
  """
  path = os.path.join(workdir, 'summary.json')
  if jax.process_index() == 0:
    if tf.io.gfile.exists(path):
      with tf.io.gfile.GFile(path, 'r') as f:
        summary = {**json.load(f), **summary}
    _write_text(path, json.dumps(summary, indent=2, sort_keys=True) + '\n')
  return path


def _write_text(path: str, text: str) -> None:
  """Writes via a temporary file and a rename (local or gs:// paths)."""
  tmp = path + '.tmp'
  with tf.io.gfile.GFile(tmp, 'w') as f:
    f.write(text)
  tf.io.gfile.rename(tmp, path, overwrite=True)
