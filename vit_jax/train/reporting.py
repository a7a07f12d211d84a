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
from clu import metric_writers

from vit_jax import accounting


class JsonlWriter(metric_writers.LoggingWriter):
  """Appends one JSON object per `write_scalars` call to a file."""

  def __init__(self, path: str):
    super().__init__()
    self._path = path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    self._file = open(path, 'a', encoding='utf-8')

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    row = {'step': int(step)}
    row.update({k: float(np.asarray(v)) for k, v in scalars.items()})
    self._file.write(json.dumps(row) + '\n')

  def write_hparams(self, hparams: Mapping[str, Any]):
    pass

  def flush(self):
    self._file.flush()

  def close(self):
    self._file.close()


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
    self.steps_this_run = 0

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
    return {
        'steps_per_s': steps_per_s,
        'img_per_s': steps_per_s * self.batch_size,
        'img_per_s_per_device': steps_per_s * self.batch_size / self.num_devices,
        'eta_hours': remaining / steps_per_s / 3600 if steps_per_s else 0.0,
        'device_hours': device_hours,
        'core_days': device_hours * self.cores_per_device / 24,
        'exaflops': examples * self.flops_per_example / 1e18,
    }


def write_summary(workdir: str, summary: Dict[str, Any]) -> str:
  """Writes summary.json atomically (process 0 only); returns its path."""
  path = os.path.join(workdir, 'summary.json')
  if jax.process_index() != 0:
    return path
  tmp = path + '.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    json.dump(summary, f, indent=2, sort_keys=True)
  os.replace(tmp, path)
  return path
