"""Progress reports and metrics.jsonl rows of a run, resumed ones included."""

import json
import threading

import pytest

from vit_jax.train import reporting


def test_a_resumed_runs_cost_counts_from_step_zero():
  """exaFLOPs and device-hours in the progress rows are the run's so far,
  as summary.json has them, not restarted at the resumed step. A
  checkpoint saved before its cost was (only `wall_s`) is costed on this
  part's devices."""
  progress = reporting.Progress(total_steps=400, batch_size=8, start_step=100,
                                forward_flops=1e9, every_steps=50,
                                num_devices=2, prior={'wall_s': 3600.0})
  for step in range(101, 151):
    progress(step)
  assert progress.scalars['exaflops'] == pytest.approx(150 * 8 * 3e9 / 1e18)
  assert 2.0 <= progress.scalars['device_hours'] < 2.1


def test_each_part_of_a_resumed_run_is_costed_on_its_own_devices():
  """A run trained an hour on 8 devices, resumed on 1: its total wall time
  times the last part's device count billed it as 1 device throughout."""
  before = reporting.cost(3600.0, 8, 1.0)
  progress = reporting.Progress(total_steps=400, batch_size=8, start_step=100,
                                forward_flops=1e9, every_steps=50,
                                num_devices=1, prior=before)
  for step in range(101, 151):
    progress(step)
  assert 8.0 <= progress.scalars['device_hours'] < 8.01
  spent = progress.spent()
  assert spent['wall_s'] > 3600 and spent['core_days'] == pytest.approx(
      spent['device_hours'] / 24)
  assert reporting.hardware_so_far('tpu_v3', 'cpu') == 'tpu_v3, cpu'
  assert reporting.hardware_so_far('tpu_v3, cpu', 'cpu') == 'tpu_v3, cpu'
  assert reporting.hardware_so_far(None, 'cpu') == 'cpu'


def test_jsonl_keeps_rows_up_to_the_resumed_step(tmp_path):
  path = str(tmp_path / 'metrics.jsonl')
  first = reporting.JsonlWriter(path)
  for step in (10, 20, 30):
    first.write_scalars(step, {'loss': step / 10})
  first.close()
  resumed = reporting.JsonlWriter(path, resume_step=20)
  resumed.write_scalars(30, {'loss': 0.5})
  resumed.close()
  rows = [json.loads(l) for l in open(path)]
  assert [(r['step'], r['loss']) for r in rows] == [(10, 1.0), (20, 2.0),
                                                    (30, 0.5)]


def test_a_slow_store_does_not_hold_up_the_train_loop(tmp_path, monkeypatch):
  """On gs:// each metrics.jsonl write is an upload: `write_scalars` (the
  train loop's call, made while the device waits for the next step) must
  not wait for it, and `close` must wait until the rows are there."""
  stored, release = threading.Event(), threading.Event()
  write_text = reporting.write_text

  def slow_store(path, text):
    release.wait(30)
    write_text(path, text)
    stored.set()

  monkeypatch.setattr(reporting, 'write_text', slow_store)
  writer = reporting.make_writer(str(tmp_path))
  writer.write_scalars(50, {'loss': 2.0})
  writer.write_scalars(100, {'loss': 1.0})  # Returns with the store blocked.
  assert not stored.is_set()
  release.set()
  writer.close()
  rows = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  assert [(r['step'], r['loss']) for r in rows] == [(50, 2.0), (100, 1.0)]


def test_a_failed_write_is_retried_with_the_next_row(tmp_path, monkeypatch):
  """A store's transient error loses no row and stops no run; rows that
  cannot be written at all raise at `close`, naming the file."""
  path = str(tmp_path / 'metrics.jsonl')
  write_text = reporting.write_text
  failures = iter([True, False, True])

  def flaky(p, text):
    if next(failures, True):
      raise OSError('503 Service Unavailable')
    write_text(p, text)

  monkeypatch.setattr(reporting, 'write_text', flaky)
  writer = reporting.JsonlWriter(path)
  writer.write_scalars(10, {'loss': 3.0})  # Fails: kept for the next.
  writer.write_scalars(20, {'loss': 2.0})  # Writes both.
  rows = [json.loads(l) for l in open(path)]
  assert [r['step'] for r in rows] == [10, 20]
  writer.write_scalars(30, {'loss': 1.0})  # Fails, and so does close.
  with pytest.raises(OSError, match='metrics.jsonl could not be written.*503'):
    writer.close()


def test_profiler_time_is_its_own_part_not_host_overhead(caplog):
  """Starting and writing a `--config.profile` trace (seconds) showed as
  host overhead; it is `profile_s_per_step`, in the log line of the
  interval where it ran and only there."""
  import time
  progress = reporting.Progress(total_steps=20, batch_size=8, start_step=0,
                                forward_flops=1e9, every_steps=10,
                                num_devices=1)
  with caplog.at_level('INFO', logger='absl'):
    for step in range(1, 21):
      if step == 3:
        with progress.timed('profile', wait_jax_async_dispatch=False):
          time.sleep(0.2)
      progress(step)
      if step == 10:
        first = dict(progress.scalars)
  assert first['profile_s_per_step'] == pytest.approx(0.02, rel=0.5)
  assert first['host_s_per_step'] < 0.01
  assert progress.scalars['profile_s_per_step'] == 0
  lines = [r.getMessage() for r in caplog.records if 's/step' in r.getMessage()]
  assert len(lines) == 2
  assert '+ profile 0.0' in lines[0] and 'profile' not in lines[1]


def test_the_progress_line_gives_this_intervals_shares_and_short_times(
    caplog):
  """One progress line, of the interval its metrics row is of (not clu's
  shares since the process started beside them), with an ETA in seconds
  below a minute (not '0m')."""
  import time
  progress = reporting.Progress(total_steps=20, batch_size=8, start_step=0,
                                forward_flops=1e9, every_steps=10,
                                num_devices=1)
  with caplog.at_level('INFO', logger='absl'):
    for step in range(1, 21):
      with progress.timed('input_wait', wait_jax_async_dispatch=False):
        time.sleep(0.02 if step <= 10 else 0.0)
      if step > 10:
        time.sleep(0.02)  # The second interval waits elsewhere.
      progress(step)
  notes = [r.getMessage() for r in caplog.records
           if 'steps/s' in r.getMessage()]
  assert len(notes) == 2, notes
  assert '(10/20), ETA ' in notes[0] and 'ETA 0s' in notes[1]
  first, second = (float(n.split('% input_wait')[0].rsplit(' ', 1)[1])
                   for n in notes)
  assert first > 80 and second < 20  # Each interval's own share.
  assert [reporting.format_seconds(s) for s in (0.4, 42, 425, 10920,
                                                187200)] == [
      '0s', '42s', '7m05s', '3h02m', '2d04h']
