"""Workdirs trained once per test session: the smoke run the predict, export
and inspect tests read (`smoke_workdir`), and `once` for others.

A tiny ViT trained for a few steps on scikit-learn's real `digits`
(in-process: no interpreter start-up), made once per test session and
shared by pytest-xdist workers through a file lock.
"""

import json
import os
import shutil

import filelock

STEPS = 8


def once(tmp_path_factory, name: str, make) -> str:
  """`make(path)` run once per test session, however many pytest-xdist
  workers ask (the others wait on a file lock); returns `path`. Tests read
  what it wrote; one that writes copies it first."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    root = root.parent  # Shared by the workers of one session.
  path = str(root / name)
  with filelock.FileLock(path + '.lock'):
    if not os.path.exists(path + '.done'):
      make(path)
      open(path + '.done', 'w').close()
  return path


def copy(workdir: str, tmp_path) -> str:
  """A copy of a shared workdir (tmp_path/run), for a test that writes."""
  out = str(tmp_path / 'run')
  shutil.copytree(workdir, out)
  return out


def smoke_workdir(tmp_path_factory) -> str:
  return once(tmp_path_factory, 'export_smoke_run', _train)


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
