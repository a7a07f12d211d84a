"""Progress reports and metrics.jsonl rows of a run, resumed ones included."""

import json

import pytest

from vit_jax.train import reporting


def test_a_resumed_runs_cost_counts_from_step_zero():
  """exaFLOPs and device-hours in the progress rows are the run's so far,
  as summary.json has them, not restarted at the resumed step."""
  progress = reporting.Progress(total_steps=400, batch_size=8, start_step=100,
                                forward_flops=1e9, every_steps=50,
                                num_devices=2, prior_wall_s=3600.0)
  for step in range(101, 151):
    progress(step)
  assert progress.scalars['exaflops'] == pytest.approx(150 * 8 * 3e9 / 1e18)
  assert 2.0 <= progress.scalars['device_hours'] < 2.1


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
