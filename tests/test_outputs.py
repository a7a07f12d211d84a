"""Where commands write (`vit_jax/outputs.py`): an empty path is refused, `~`
is expanded, a missing folder of an output file is made before the work."""

import json
import os
import subprocess
import sys

import pytest

from vit_jax import outputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_directories(tmp_path, monkeypatch):
  monkeypatch.setenv('HOME', str(tmp_path))
  assert outputs.directory('~/run') == str(tmp_path / 'run')
  assert outputs.directory('gs://b/~x') == 'gs://b/~x'
  with pytest.raises(outputs.OutputPathError, match='local files only'):
    outputs.directory('gs://b/x', '--out', remote=False)
  for empty in ('', '  ', None):
    with pytest.raises(outputs.OutputPathError, match='unset shell variable'):
      outputs.directory(empty)
  (tmp_path / 'f').write_text('x')
  with pytest.raises(outputs.OutputPathError, match='is a file'):
    outputs.directory(str(tmp_path / 'f'), '--out')


def test_files_get_their_folder_first(tmp_path):
  path = outputs.file(str(tmp_path / 'a' / 'b' / 'out.json'), '--json')
  assert os.path.isdir(tmp_path / 'a' / 'b') and not os.path.exists(path)
  with pytest.raises(outputs.OutputPathError, match='is a folder'):
    outputs.file(str(tmp_path / 'a'), '--json')
  with pytest.raises(outputs.OutputPathError, match='local files only'):
    outputs.file('gs://b/out.json', '--json')
  assert outputs.file('gs://b/t.md', '--output', remote=True) == 'gs://b/t.md'
  (tmp_path / 'a' / 'f').write_text('x')
  with pytest.raises(outputs.OutputPathError, match='cannot create'):
    outputs.file(str(tmp_path / 'a' / 'f' / 'out.json'), '--json')


def test_main_refuses_an_empty_workdir_before_writing_anything(tmp_path):
  out = subprocess.run(
      [sys.executable, '-m', 'vit_jax.main', '--workdir=',
       '--config=configs/smoke.py:data=digits,steps=2,batch=32'],
      cwd=tmp_path, capture_output=True, text=True,
      env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT))
  assert out.returncode == 1
  assert '--workdir is empty (an unset shell variable?)' in out.stderr
  assert os.listdir(tmp_path) == []


def test_tables_writes_into_a_new_folder(tmp_path):
  from vit_jax import tables
  summary = tmp_path / 'run' / 'summary.json'
  summary.parent.mkdir()
  summary.write_text(json.dumps({'eval_accuracy': 0.5, 'report': {
      'model': 'ViT-B/16', 'pretrain': 'imagenet21k', 'pretrain_epochs': 90,
      'task': 'cifar10'}}))
  target = tmp_path / 'new' / 'tables.md'
  assert tables.main([f'--workdirs={tmp_path / "run"}',
                      f'--output={target}', '--flops=analytic']) == 0
  assert target.read_text()
