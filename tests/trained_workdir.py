"""Workdirs trained once per test session: the smoke run the predict, export
and inspect tests read (`smoke_workdir`), the command-line run test_loop and
test_robustness start from (`cli_reference_run`), and `once` for others.

A tiny ViT trained for a few steps on scikit-learn's real `digits`
(in-process: no interpreter start-up), made once per test session and
shared by pytest-xdist workers through a file lock.
"""

import json
import os
import shutil
import subprocess
import sys

import filelock

STEPS = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `python -m vit_jax.main` flags of test_loop's and test_robustness's runs.
CLI_BASE = ['--config=configs/smoke.py:data=digits,steps=40,batch=32',
            '--config.log_every=10', '--config.checkpoint_every=10',
            '--config.async_checkpoints=false']


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


def copy_with_config(workdir: str, tmp_path, **fields) -> str:
  """A copy of a shared workdir whose recorded config.json has `fields`
  set (e.g. loss='sigmoid': what predict and export read of the run)."""
  out = copy(workdir, tmp_path)
  path = os.path.join(out, 'config.json')
  with open(path) as f:
    recorded = json.load(f)
  recorded['config'].update(fields)
  with open(path, 'w') as f:
    json.dump(recorded, f)
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


def cli_reference_run(tmp_path_factory) -> str:
  """`python -m vit_jax.main` with CLI_BASE, profiling steps 13 to 15: 40
  steps, checkpoints 20, 30 and 40 kept. Its stdout and stderr lie beside
  it (`<path>.stdout`, `<path>.stderr`)."""
  def make(workdir):
    out = subprocess.run(
        [sys.executable, '-m', 'vit_jax.main', f'--workdir={workdir}',
         *CLI_BASE, '--config.profile=12,3'], cwd=ROOT, capture_output=True,
        text=True, env=dict(os.environ, JAX_PLATFORMS='cpu'))
    assert out.returncode == 0, out.stderr[-4000:]
    for name in ('stdout', 'stderr'):
      with open(f'{workdir}.{name}', 'w') as f:
        f.write(getattr(out, name))
  return once(tmp_path_factory, 'cli_reference_run', make)
