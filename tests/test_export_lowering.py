"""The train step lowers for accelerators from this CPU host, carrying no
CPU-only construct; ViT-L/16 with scan + remat holds 1/8 of its state per
device on an 8-device FSDP mesh (compiled, never run: abstract shapes)."""

import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import export

from conftest import xla_flags
from vit_jax import models
from vit_jax import sharding as shd
from vit_jax.models import matmul
from vit_jax.models import platform_switch
from vit_jax.train import optim
from vit_jax.train import step as step_lib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# bf16 x bf16 -> bf16 dot_general: on TPU and GPU accumulated in float32 by
# the matrix units and rounded once (vit_jax.models.matmul).
BF16_DOT = re.compile(r'stablehlo\.dot_general[^\n]*\(tensor<[^>]*xbf16>, '
                      r'tensor<[^>]*xbf16>\) -> tensor<[^>]*xbf16>')
# A bias gradient as ones x cotangent rows, accumulated in float32.
BIAS_SUM = re.compile(r'stablehlo\.dot_general[^\n]*\(tensor<8x\d+xbf16>, '
                      r'tensor<\d+x\d+xbf16>\) -> tensor<8x\d+xf32>')
F32_DOT = re.compile(r'stablehlo\.dot_general[^\n]*\(tensor<[^>]*xf32>, '
                     r'tensor<[^>]*xf32>\)')


def _bf16_step(**options):
  model = models.create('ViT-test', num_classes=10, dtype=jnp.bfloat16,
                        **options)
  tx, lr_fn = optim.make(optim.Settings(
      name='adam', lr=1e-3, warmup_steps=0, decay='constant',
      weight_decay=0.1, grad_clip_norm=1.0), 100)
  shape = (28, 28, 3)
  abstract = step_lib.abstract_state(model, tx, shape)
  train = functools.partial(step_lib.train_step, model=model, tx=tx,
                            lr_fn=lr_fn)
  batch = {'image': jax.ShapeDtypeStruct((4, *shape), jnp.float32),
           'label': jax.ShapeDtypeStruct((4,), jnp.int32)}
  return train, abstract, batch


@pytest.fixture(scope='module')
def bf16_step():
  """(bf16 train step of the default tiny ViT, abstract state, abstract
  batch). Its `recompute_internals` are custom VJPs, not `jax.checkpoint`s:
  no optimisation barrier of their own to mistake for the CPU-only one."""
  return _bf16_step()


def _module(step, platforms):
  train, abstract, batch = step
  # A fresh function each time: jit caches traces per function, and a
  # trace keeps the CPU form it was made with (one per process normally,
  # see matmul.cpu_form; these tests change it).
  fresh = functools.partial(train)
  with jax.set_mesh(shd.make_mesh()):
    exp = export.export(jax.jit(fresh), platforms=platforms)(abstract, batch)
  assert tuple(exp.platforms) == tuple(platforms)
  return exp.mlir_module()


@pytest.mark.parametrize('platforms', [('tpu',), ('cuda',), ('tpu', 'cuda')])
def test_bf16_train_step_exports_for_accelerators(bf16_step, platforms,
                                                  monkeypatch):
  # Whatever this host's CPU form, the accelerator program is the same.
  monkeypatch.setenv(matmul.ENV, 'f32')
  matmul.reset_cpu_form()
  try:
    text = _module(bf16_step, platforms)
  finally:
    matmul.reset_cpu_form()
  # No CPU-only barrier: on NVIDIA GPUs the only ones are those that keep
  # the bias gradients' ones a product's operand (`dense.bias_gradient`):
  # every block Dense's bias (q, k, v, out, MLP x 2; 2 layers) is summed by
  # such a product there, on TPUs by a reduction.
  barriers = re.findall(r'stablehlo\.optimization_barrier [^\n]*', text)
  assert all(re.search(r': tensor<8x\d+xbf16>', b) for b in barriers), barriers
  bias_sums = BIAS_SUM.findall(text)
  if 'cuda' in platforms:
    assert len(bias_sums) >= 6 * 2 and len(barriers) >= 6 * 2
  else:
    assert not bias_sums and not barriers
  # Every dense matmul of the blocks (q, k, v, out, MLP x 2) runs as a bf16
  # dot, forward and backward (2 layers), with no float32 result written out
  # to be converted; none was upcast to float32. (Attention's q.k and
  # weights.v are jax.nn.dot_product_attention's own.)
  assert len(BF16_DOT.findall(text)) >= 6 * 3 * 2, text[:2000]
  assert not F32_DOT.findall(text)


def test_cpu_export_keeps_its_cpu_form(bf16_step, monkeypatch):
  """The CPU lowering does carry the barrier: the test above can fail."""
  monkeypatch.setenv(matmul.ENV, 'bf16')
  matmul.reset_cpu_form()
  try:
    assert 'optimization_barrier' in _module(bf16_step, ('cpu',))
  finally:
    matmul.reset_cpu_form()


@pytest.fixture
def cpu_form_undecided(monkeypatch, tmp_path):
  """A fresh machine whose CPU has bf16 dot instructions: 'auto' would time
  the CPU matmul forms (no cache yet)."""
  monkeypatch.delenv(matmul.ENV, raising=False)
  monkeypatch.setenv(matmul.CACHE_ENV, str(tmp_path / 'cpu_matmul.json'))
  monkeypatch.setattr(matmul, 'cpu_bf16_flags', lambda: {'avx512_bf16'})
  matmul.reset_cpu_form()
  yield tmp_path / 'cpu_matmul.json'
  matmul.reset_cpu_form()


def _no_cpu_backend(monkeypatch):
  """As in a process started with JAX_PLATFORMS=tpu (or cuda): jax knows
  no CPU backend (jax.devices('cpu') raises as xla_bridge does)."""
  devices = jax.devices

  def without_cpu(backend=None):
    if backend == 'cpu':
      raise RuntimeError('Unknown backend cpu requested, but no platforms '
                         'that are instances of cpu are present.')
    return devices(backend)
  monkeypatch.setattr(jax, 'devices', without_cpu)


@pytest.mark.parametrize('platform,traced_for', [('tpu', 'tpu'),
                                                 ('cuda', 'gpu'),
                                                 ('tpu', None)])
def test_bf16_step_exports_for_accelerators_without_a_cpu_backend(
    bf16_step, cpu_form_undecided, monkeypatch, platform, traced_for):
  """A process with no CPU backend exports the bf16 train step for its
  accelerator, traced for it (`platform_switch.tracing_for`: no CPU branch
  traced) or not (the CPU branches take the form 'bf16', unmeasured); it
  used to fail timing the CPU matmul forms while tracing."""
  _no_cpu_backend(monkeypatch)
  with platform_switch.tracing_for(traced_for):
    text = _module(bf16_step, (platform,))
  assert len(BF16_DOT.findall(text)) >= 6 * 3 * 2
  # Decided (unmeasured, uncached) only where a CPU branch was traced.
  assert matmul._chosen.get('form') == (None if traced_for else 'bf16')
  assert not matmul.MEASURED and not cpu_form_undecided.exists()


@pytest.mark.parametrize('platforms,traced_for', [(('tpu',), 'tpu'),
                                                  (('cuda',), 'gpu'),
                                                  (('tpu', 'cuda'),
                                                   ('tpu', 'cuda'))])
def test_tracing_for_accelerators_runs_no_cpu_code(
    bf16_step, cpu_form_undecided, monkeypatch, platforms, traced_for):
  """Traced for TPUs or GPUs, no CPU branch is traced: the CPU matmul form
  is never decided (no seconds of timing the CPU on a fresh machine), and
  the program has the bf16 dots and bias-gradient products of the one
  traced with every branch."""
  del cpu_form_undecided
  decide = matmul._decide

  def refuse():
    raise AssertionError('a program for TPUs/GPUs decided the CPU form')

  monkeypatch.setattr(matmul, '_decide', refuse)
  with platform_switch.tracing_for(traced_for):
    text = _module(bf16_step, platforms)
  # Every branch traced, for comparison (a CPU form given: not measured).
  monkeypatch.setattr(matmul, '_decide', decide)
  monkeypatch.setenv(matmul.ENV, 'f32')
  everything = _module(bf16_step, platforms)
  for pattern in (BF16_DOT, BIAS_SUM):
    assert len(pattern.findall(text)) == len(pattern.findall(everything))
  assert not F32_DOT.findall(text)


def test_multi_platform_export_keeps_the_cpu_branch(bf16_step, monkeypatch):
  """Traced for CPUs and TPUs, the program keeps both branches: the CPU
  lowering carries the CPU form's barrier, the TPU one none."""
  monkeypatch.setenv(matmul.ENV, 'bf16')
  matmul.reset_cpu_form()
  try:
    with platform_switch.tracing_for(('cpu', 'tpu')):
      text = _module(bf16_step, ('cpu', 'tpu'))
    assert 'optimization_barrier' in text
    with platform_switch.tracing_for('tpu'):
      assert 'optimization_barrier' not in _module(bf16_step, ('tpu',))
  finally:
    matmul.reset_cpu_form()


def test_tracing_for_names_platforms():
  with pytest.raises(ValueError, match='give platform names'):
    with platform_switch.tracing_for(('tpu', 3)):
      pass
  with platform_switch.tracing_for('GPU'):
    assert platform_switch.targets() == ('gpu',)
  assert platform_switch.targets() is None


def fsdp_memory(name, mesh, overrides, batch=8, image_size=224):
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT,
             XLA_FLAGS=xla_flags(8))
  out = subprocess.run(
      [sys.executable, os.path.join(HERE, 'fsdp_memory.py'), name,
       json.dumps(mesh), json.dumps(overrides), str(batch), str(image_size)],
      capture_output=True, text=True, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_vit_l16_scan_remat_fsdp8_holds_an_eighth_per_device():
  res = fsdp_memory('ViT-L/16', {'data': 1, 'fsdp': 8},
                    {'scan_layers': True, 'remat': True})
  assert res['devices'] == 8
  eighth = res['state_bytes'] / 8
  # Parameters and both Adam moments: ~1/8 per device (a few small tensors,
  # below fsdp_min_size, stay replicated), in and out of the step.
  assert eighth <= res['state_bytes_per_device'] < 1.03 * eighth
  assert res['out_state_bytes_per_device'] == res['state_bytes_per_device']
  assert res['argument_bytes'] <= (res['state_bytes_per_device']
                                   + res['batch_bytes_per_device'] + 2**16)
  assert res['output_bytes'] < 1.03 * eighth + 2**16
  # XLA's own plan: the whole state is never gathered on one device (scan
  # gathers one layer's weights at a time).
  assert res['temp_bytes'] < 0.5 * res['param_bytes']


def test_portable_traces_take_the_bf16_form_undecided(monkeypatch):
  """Inside `matmul.portable()` (exports) the CPU form is 'bf16' whatever
  this host's would be, and it is not decided there (no timing of the
  CPU): an exported program must not depend on the host that traced it.
  A bf16 dense product traced there has no float32 dot, where this host
  takes 'f32'."""
  monkeypatch.setenv(matmul.ENV, 'f32')
  matmul.reset_cpu_form()

  def refuse():
    raise AssertionError('portable() decided the host CPU form')

  try:
    with monkeypatch.context() as m:
      m.setattr(matmul, '_decide', refuse)
      with matmul.portable():
        assert matmul.cpu_form() == matmul.PORTABLE_CPU_FORM == 'bf16'
        x = jnp.ones((4, 8), jnp.bfloat16)
        text = jax.jit(lambda a, b: matmul.dot_general(
            a, b, (((1,), (0,)), ((), ())))).lower(x, x.T).as_text()
    bf16_to_f32 = re.compile(r'stablehlo\.dot_general[^\n]*\(tensor<[^>]*'
                             r'xbf16>, tensor<[^>]*xbf16>\) -> '
                             r'tensor<[^>]*xf32>')
    assert not F32_DOT.findall(text) and bf16_to_f32.findall(text), text
    assert matmul.cpu_form() == 'f32'  # Outside: this host's form.
  finally:
    matmul.reset_cpu_form()
