"""docs/colab.ipynb runs headless on CPU with SMOKE=True: smoke pre-training,
fine-tuning from it, accounting, tables, loading the result, .npz export."""

import json
import os

import pytest

import nbclient
import nbformat

from vit_jax import checkpoint

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), 'docs', 'colab.ipynb')


@pytest.mark.slow  # ~60 s; suite budget (the same APIs run in test_docs).
def test_colab_notebook_smoke_on_cpu(tmp_path, monkeypatch):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  code = [c for c in nb.cells if c.cell_type == 'code']
  assert not any(c.outputs for c in code), 'commit the notebook without outputs'
  [params] = [c for c in code if 'parameters' in c.metadata.get('tags', [])]
  workdir = str(tmp_path / 'run')
  params.source += f'\nSMOKE = True\nINSTALL = False\nWORKDIR = {workdir!r}\n'
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  monkeypatch.setenv('TF_CPP_MIN_LOG_LEVEL', '2')
  nbclient.NotebookClient(nb, timeout=300, kernel_name='python3', resources={
      'metadata': {'path': str(tmp_path)}}).execute()  # Raises on an error.

  summary = json.load(open(os.path.join(workdir, 'cifar10', 'summary.json')))
  assert 0 <= summary['eval_accuracy'] <= 1
  assert summary['init'] == os.path.join(workdir, 'pretrain')
  text = lambda c: ''.join(o.get('text', '') for o in c.outputs)
  assert 'top-1 accuracy' in text(code[-2]) and '| ViT-B/16 |' in text(code[-2])
  assert 'predicted' in text(code[-1])
  params = checkpoint.load_npz(os.path.join(workdir, 'vit_b16_cifar10.npz'))
  assert params['head']['kernel'].shape == (32, 10)  # Smoke width, 10 classes.
