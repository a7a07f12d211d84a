"""One smoke-trained workdir shared by the predict and export tests.

A tiny ViT trained for a few steps on scikit-learn's real `digits`
(in-process: no interpreter start-up), made once per test session and
shared by pytest-xdist workers through a file lock.
"""

import json
import os

import filelock

STEPS = 8


def smoke_workdir(tmp_path_factory) -> str:
  root = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    root = root.parent  # Shared by the workers of one session.
  workdir = str(root / 'export_smoke_run')
  with filelock.FileLock(workdir + '.lock'):
    if not os.path.exists(os.path.join(workdir, 'summary.json')):
      _train(workdir)
  return workdir


def _train(workdir: str) -> None:
  from vit_jax.configs import smoke
  from vit_jax.train import loop
  config = smoke.get_config(f'data=digits,steps={STEPS},batch=32')
  config.log_every = STEPS
  config.checkpoint_every = 0
  config.async_checkpoints = False
  config.input.eval_batch_size = 120
  summary = loop.train_and_evaluate(config, workdir)
  assert summary['steps'] == STEPS, json.dumps(summary)
