"""The benchmarks' like-for-like checks: loss curves that diverged or stopped
early fail the comparison, `flax_default` is flax's default in every
product, PyTorch's bf16 inference serves bf16 weights as ours does, and
huge pages go only where each implementation's own command takes them."""

import re
import subprocess
from types import SimpleNamespace

import pytest

from benchmarks import losses


def _curve(values, **kw):
  out = {'model': 'ViT-test', 'image_size': 32, 'batch': 8, 'dtype':
         'bfloat16', 'lr': 1e-4, 'backend': 'cpu', 'device_kind': 'cpu',
         'steps': len(values), 'losses': list(values)}
  out.update(kw)
  return out


def test_loss_compare_fails_on_non_finite_losses(capsys):
  """NaN never exceeds a tolerance (max(0.0, nan) is 0.0, nan <= rtol is
  False only where it is looked at): a curve that diverged must fail,
  whichever side it is on, with a line naming the step."""
  good = _curve([2.30, 2.20, 2.10])
  nan = _curve([2.30, float('nan'), float('nan')], backend='gpu',
               device_kind='H200')
  inf = _curve([2.30, 2.20, float('inf')])
  assert losses.compare(good, good, rtol=1e-2)
  capsys.readouterr()
  assert not losses.compare(nan, good, rtol=1e-2)
  out = capsys.readouterr().out
  assert 'FAIL: the H200 (gpu) curve has non-finite losses at steps [1, 2]' in (
      out)
  assert not losses.compare(good, nan, rtol=1e-2)
  assert not losses.compare(good, inf, rtol=1e-2)
  assert 'non-finite losses at steps [2]' in capsys.readouterr().out


def test_loss_compare_fails_on_curves_of_other_lengths(capsys):
  """A run that stopped early is not compared on its first steps only:
  other `steps` is a settings mismatch, and a curve with fewer losses than
  its steps fails. Curves saved before `steps` was recorded count their
  losses."""
  good = _curve([2.30, 2.20, 2.10])
  with pytest.raises(SystemExit, match='steps 2 vs 3'):
    losses.compare(_curve([2.30, 2.20]), good, rtol=1e-2)
  stopped = _curve([2.30, 2.20], steps=3, device_kind='H200')
  assert not losses.compare(stopped, good, rtol=1e-2)
  assert 'FAIL: the H200 (cpu) curve has 2 losses for its 3 steps' in (
      capsys.readouterr().out)
  old = {k: v for k, v in good.items() if k != 'steps'}
  assert losses.compare(old, good, rtol=1e-2)
  with pytest.raises(SystemExit, match='steps 2 vs 3'):
    losses.compare(dict(old, losses=[2.30, 2.20]), good, rtol=1e-2)


def test_loss_curve_records_its_steps(tmp_path):
  path = tmp_path / 'cpu.json'
  losses.main(['--model=ViT-test', '--image_size=16', '--batch=4',
               '--steps=2', f'--json={path}'])
  import json
  curve = json.loads(path.read_text())
  assert curve['steps'] == 2 == len(curve['losses'])


def _dot_dtypes(text):
  """(operand, operand, result) element types of every dot_general."""
  out = []
  for line in text.splitlines():
    if 'stablehlo.dot_general' in line:
      out.append(tuple(re.findall(r'tensor<(?:[0-9?]+x)*([a-z]\w*)>',
                                  line.rsplit(' : ', 1)[1])))
  return out


def test_flax_default_row_has_no_product_of_ours(monkeypatch):
  """`flax_default` replaces the CPU attention core's batched products too
  (`matmul.cpu_batched`), not only the dense layers': its lowered bf16
  train gradient has no oneDNN custom call and every product is a
  bf16 x bf16 -> bf16 dot_general, whatever this process's CPU form (here
  forced to 'onednn' where it can run, else to 'f32': float32 dots)."""
  import jax
  import jax.numpy as jnp
  from benchmarks import peers
  from vit_jax import models
  from vit_jax.models import matmul, onednn
  form = 'onednn' if onednn.available()[0] else 'f32'
  monkeypatch.setenv(matmul.ENV, form)
  matmul.reset_cpu_form()
  try:
    model = models.from_config(dict(name='ViT-test', dtype='bfloat16'), 10,
                               'cpu')
    x = jnp.ones((2, 16, 16, 3))
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), x,
                                               train=False))

    def loss(p):
      return model.apply(p, x, train=False).astype(jnp.float32).sum()

    with peers.flax_default_matmul():
      text = jax.jit(jax.grad(loss)).lower(params).as_text()
    assert matmul.cpu_batched is not peers._flax_batched  # Restored.
    ours = jax.jit(jax.grad(loss)).lower(params).as_text()
  finally:
    matmul.reset_cpu_form()
  assert text.count('vit_jax_onednn') == 0
  dots = _dot_dtypes(text)
  assert dots and set(dots) == {('bf16', 'bf16', 'bf16')}, set(dots)
  # The control: ours has its CPU form in the same program.
  assert ('vit_jax_onednn' in ours if form == 'onednn'
          else ('f32', 'f32', 'f32') in _dot_dtypes(ours))


def test_flax_batched_is_the_transposed_products():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from benchmarks import peers
  a, b = (jax.random.normal(jax.random.key(i), (2, 3, 4)).astype(
      jnp.bfloat16) for i in range(2))
  f32 = lambda x: np.asarray(x, np.float32)
  want = f32(a) @ np.swapaxes(f32(b), 1, 2)  # (2, 3, 3)
  got = peers._flax_batched(a, b, jnp.float32, trans_b=True)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
  got = peers._flax_batched(a, b, jnp.bfloat16, trans_a=True)  # aᵀ b
  np.testing.assert_allclose(f32(got), np.swapaxes(f32(a), 1, 2) @ f32(b),
                             rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize('mode, want', [('infer', 'bfloat16'),
                                        ('train', 'float32')])
def test_torch_peer_serves_bf16_weights_in_bf16_inference(monkeypatch, mode,
                                                          want):
  """bf16 inference: PyTorch's linear layers read bf16 weights, as ours
  serves them (`bench.serving_params`); bf16 training keeps float32 master
  weights under autocast on both sides."""
  torch = pytest.importorskip('torch')
  pytest.importorskip('transformers')
  from benchmarks import peers
  seen = set()
  linear = torch.nn.functional.linear

  def spy(x, weight, bias=None):
    seen.add(str(weight.dtype).split('.')[-1])
    return linear(x, weight, bias)

  monkeypatch.setattr(torch.nn.functional, 'linear', spy)
  args = SimpleNamespace(model='ViT-Ti/16', batch=1, image_size=16,
                         num_classes=10, dtype='bfloat16', mode=mode)
  step, sync, _ = peers.torch_step(args, 'hf')
  step()
  sync()
  assert seen == {want}


def test_peers_huge_pages_none_strips_an_inherited_tunable(monkeypatch):
  """`--huge_pages=none`: a glibc.malloc.hugetlb tunable this process
  inherited is not passed on (other tunables are); `own` leaves PyTorch's
  environment as this process has it."""
  from benchmarks import peers
  from vit_jax import hugepages
  seen = {}

  def run(cmd, env, **kwargs):
    seen[cmd[4]] = env
    return SimpleNamespace(returncode=0, stdout='{}', stderr='')

  monkeypatch.setattr(subprocess, 'run', run)
  for inherited, left in [
      ('glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1',
       'glibc.malloc.arena_max=2'),
      ('glibc.malloc.hugetlb=2', None)]:
    monkeypatch.setenv('GLIBC_TUNABLES', inherited)
    args = peers._parser().parse_args(['--huge_pages=none'])
    for peer in ('ours', 'hf'):
      peers._run_one(args, peer, 'train', 'float32')
      assert seen[f'--peer={peer}'].get('GLIBC_TUNABLES') == left, peer
      assert seen[f'--peer={peer}'][hugepages.ENV] == '0'
    args = peers._parser().parse_args(['--huge_pages=own'])
    peers._run_one(args, 'hf', 'train', 'float32')
    assert seen['--peer=hf']['GLIBC_TUNABLES'] == inherited


@pytest.mark.parametrize('argv, restarts', [
    (['--peer=ours'], True), ([], True), (['--peer=hf'], False),
    (['--peer', 'timm', '--steps=1'], False)])
def test_op_profile_restarts_with_huge_pages_for_ours_only(
    monkeypatch, capsys, argv, restarts):
  """`python -m benchmarks.op_profile --peer=hf/timm` profiles PyTorch in
  the environment `benchmarks.peers` times it in (no huge pages of ours);
  ours restarts as `vit_jax.bench` does. Run as __main__ with --help, so
  that nothing is profiled."""
  import runpy
  import sys
  import warnings
  from vit_jax import hugepages
  calls = []
  monkeypatch.setattr(hugepages, 'reexec', lambda: calls.append(1))
  monkeypatch.setattr(sys, 'argv', ['op_profile', *argv, '--help'])
  with warnings.catch_warnings(), pytest.raises(SystemExit):
    warnings.simplefilter('ignore', RuntimeWarning)  # Already imported.
    runpy.run_module('benchmarks.op_profile', run_name='__main__')
  assert 'usage' in capsys.readouterr().out
  assert bool(calls) == restarts
