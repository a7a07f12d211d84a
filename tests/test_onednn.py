"""The CPU matmul form 'onednn': oneDNN's kernels through an XLA custom call
(vit_jax/models/onednn.py). Where the onednn extra is not installed, only
the message that says so is checked."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import xla_flags
from trained_workdir import smoke_workdir
from vit_jax import export, models
from vit_jax import trained as trained_lib
from vit_jax.models import matmul, onednn

OK, WHY = onednn.available()
needs_onednn = pytest.mark.skipif(
    not OK, reason=f'the oneDNN matmul is unavailable here: {WHY}')
HERE = os.path.dirname(os.path.abspath(__file__))


def _python(code, **env):
  """`code` run by a fresh interpreter on the CPU, with `env` added."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=os.path.dirname(HERE),
             **env)
  return subprocess.run([sys.executable, '-c', code], capture_output=True,
                        text=True, env=env)


def _bf16(rng, shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def _op(x, transposed):
  x = np.asarray(x, np.float64)
  return np.swapaxes(x, -1, -2) if transposed else x


def _assert_rounded_once(got, exact):
  """`got` is bf16(float32 sum of `exact`'s terms): within one bf16 ulp of
  the exact sum rounded (the float32 sum's own order may cross a rounding
  boundary), plus the float32 sum's error where it cancels."""
  rounded = np.asarray(jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16),
                       np.float64)
  got = np.asarray(got, np.float64)
  assert np.all(np.abs(got - rounded) <= np.abs(rounded) * 2.0**-7
                + 1e-5 * np.abs(exact).max())


@needs_onednn
@pytest.mark.parametrize('batch', [(), (3,)])
@pytest.mark.parametrize('trans_a,trans_b', [(False, False), (False, True),
                                             (True, False), (True, True)])
def test_kernel_is_the_float32_sum_rounded_once(trans_a, trans_b, batch):
  rng = np.random.default_rng(0)
  m, k, n = 37, 300, 53  # Sizes that fill no kernel block exactly.
  a = _bf16(rng, batch + ((k, m) if trans_a else (m, k)))
  b = _bf16(rng, batch + ((n, k) if trans_b else (k, n)))
  exact = _op(a, trans_a) @ _op(b, trans_b)
  call = functools.partial(onednn.matmul, trans_a=trans_a, trans_b=trans_b)
  got = jax.jit(call)(a, b)
  assert got.dtype == jnp.bfloat16 and got.shape == batch + (m, n)
  _assert_rounded_once(got, exact)
  f32 = jax.jit(functools.partial(call, out=jnp.float32))(a, b)
  assert f32.dtype == jnp.float32
  np.testing.assert_allclose(f32, exact, rtol=0, atol=1e-5 * np.abs(
      exact).max())


@needs_onednn
def test_gradients_are_oneDNN_products_rounded_once():
  rng = np.random.default_rng(1)
  a, b, c = _bf16(rng, (40, 96)), _bf16(rng, (96, 24)), _bf16(rng, (40, 24))

  def loss(a, b):  # The cotangent of the product is exactly `c`.
    return (onednn.dot(a, b).astype(jnp.float32) * c.astype(jnp.float32)
            ).sum()

  da, db = jax.jit(jax.grad(loss, (0, 1)))(a, b)
  c64 = np.asarray(c, np.float64)
  _assert_rounded_once(da, c64 @ _op(b, True))
  _assert_rounded_once(db, _op(a, True) @ c64)
  # Under vmap (per-example products): one call per example, same numbers.
  stacked = jax.vmap(onednn.dot)(jnp.stack([a, a]), jnp.stack([b, b]))
  np.testing.assert_array_equal(stacked[1], onednn.dot(a, b))


def _vit_grads(form, monkeypatch):
  monkeypatch.setenv(matmul.ENV, form)
  matmul.reset_cpu_form()
  model = models.create('ViT-test', num_classes=10, dtype=jnp.bfloat16)
  images = jnp.asarray(np.random.default_rng(2).uniform(
      -1, 1, (4, 28, 28, 3)), jnp.float32)
  params = model.init(jax.random.key(0), images, train=False)['params']

  def loss(params):
    logits = model.apply({'params': params}, images, train=False)
    return jax.nn.log_softmax(logits.astype(jnp.float32))[:, 0].mean()

  fn = jax.jit(jax.value_and_grad(loss))
  return fn(params), fn.lower(params).as_text()


@needs_onednn
def test_vit_trains_on_oneDNN_with_the_numbers_of_xla_bf16(monkeypatch):
  try:
    (loss, grads), text = _vit_grads('onednn', monkeypatch)
    assert onednn.TARGET in text
    # Traced inside `portable()`, the same program carries XLA's dots.
    with matmul.portable():
      _, portable_text = _vit_grads('onednn', monkeypatch)
    assert onednn.TARGET not in portable_text
    (ref_loss, ref_grads), ref_text = _vit_grads('bf16', monkeypatch)
    assert onednn.TARGET not in ref_text
  finally:
    matmul.reset_cpu_form()
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-2)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
    np.testing.assert_allclose(g, r, atol=0.03 * np.abs(r).max() + 1e-6)


@needs_onednn
def test_export_of_a_bf16_model_carries_no_custom_call(monkeypatch,
                                                        tmp_path_factory):
  """An exported program runs where nothing registered the custom call: the
  export traces under `matmul.portable()`."""
  trained = trained_lib.load(smoke_workdir(tmp_path_factory))
  monkeypatch.setenv(matmul.ENV, 'onednn')
  matmul.reset_cpu_form()
  try:
    out = str(tmp_path_factory.mktemp('onednn_export'))
    manifest = export.export_model(trained, 'stablehlo', out,
                                   export.Options(dtype='bfloat16'))
  finally:
    matmul.reset_cpu_form()
  assert manifest['dtype'] == 'bfloat16'
  texts = []
  for root, _, files in os.walk(out):
    for name in files:
      with open(os.path.join(root, name), 'rb') as f:
        texts.append(f.read())
  assert not any(onednn.TARGET.encode() in t for t in texts)


def test_unavailable_oneDNN_is_named_with_its_fix(tmp_path):
  """Asked for explicitly where it cannot load: the error names why and
  how to install it; 'auto' quietly measures the other forms."""
  code = ('import jax.numpy as jnp\n'
          'from vit_jax.models import matmul, onednn\n'
          'print(onednn.available())\n'
          'x = jnp.ones((2, 2), jnp.bfloat16)\n'
          'try:\n'
          '  onednn.matmul(x, x)\n'
          'except RuntimeError as e:\n'
          '  print("matmul:", e)\n'
          'matmul.cpu_form()\n')
  done = _python(code, VIT_JAX_ONEDNN_ROOT=str(tmp_path / 'absent'),
                 VIT_JAX_CPU_MATMUL='onednn')
  assert done.returncode != 0
  assert 'VIT_JAX_ONEDNN_ROOT' in done.stdout + done.stderr
  assert 'matmul: the oneDNN matmul is unavailable' in done.stdout
  assert 'VIT_JAX_CPU_MATMUL=onednn' in done.stderr
  assert 'pip install -e ".[onednn]"' in done.stderr


def test_a_cpu_without_bf16_matmuls_is_unavailable_and_auto_skips_it(
    tmp_path):
  """oneDNN 3.x has no bf16 matmul on AVX2-only CPUs (AMD EPYC Zen 3, for
  one): there the custom call is unavailable, with the reason, instead of
  failing inside a step, and 'auto' chooses among the other forms (without
  the check it timed the oneDNN form and failed). Checked on any machine
  with the extra installed by capping oneDNN's instruction set at AVX2."""
  if not OK and 'has no bf16 matmul' not in WHY:
    pytest.skip(f'the oneDNN extra is not usable here: {WHY}')
  code = ('from vit_jax.models import matmul, onednn\n'
          'ok, why = onednn.available()\n'
          'assert not ok, why\n'
          'print(why)\n'
          'try:\n'
          '  matmul.cpu_form()\n'
          'except ValueError as e:\n'
          '  print("forced:", e)\n')
  done = _python(code, ONEDNN_MAX_CPU_ISA='AVX2', VIT_JAX_CPU_MATMUL='onednn')
  assert done.returncode == 0, done.stderr
  assert 'has no bf16 matmul for this CPU' in done.stdout
  assert 'AVX512-BF16, AVX2-VNNI-2 or AMX' in done.stdout
  assert 'forced: VIT_JAX_CPU_MATMUL=onednn, but' in done.stdout
  done = _python('from vit_jax.models import matmul\n'
                 'print(matmul.cpu_form())\n', ONEDNN_MAX_CPU_ISA='AVX2',
                 VIT_JAX_CPU_MATMUL='auto',
                 VIT_JAX_CPU_MATMUL_CACHE=str(tmp_path / 'forms.json'))
  assert done.returncode == 0, done.stderr
  assert done.stdout.split()[-1] in ('f32', 'bf16'), done.stdout


@needs_onednn
@pytest.mark.parametrize('cxx,says', [
    ('false', 'building the oneDNN custom call failed'),
    ('/nonexistent/g++', 'FileNotFoundError')])
def test_a_failed_build_is_reported(cxx, says, tmp_path):
  """A compiler that fails, or is missing: unavailable, with a reason that
  says what was run and what went wrong."""
  code = ('from vit_jax.models import onednn\n'
          'ok, why = onednn.available()\n'
          'assert not ok\n'
          'print(why)\n')
  done = _python(code, CXX=cxx, VIT_JAX_ONEDNN_CACHE=str(tmp_path / 'cache'))
  assert done.returncode == 0, done.stderr[-2000:]
  assert says in done.stdout
  assert ('onednn_matmul.cc' in done.stdout) == (cxx == 'false')


@needs_onednn
def test_programs_over_several_cpu_devices_keep_xla_dots():
  """XLA's partitioner cannot split the custom call; with 2 CPU devices the
  form reads as 'bf16' and the sharded program carries no custom call."""
  code = ('import jax, jax.numpy as jnp\n'
          'from vit_jax.models import matmul, onednn\n'
          'assert matmul.cpu_form() == "bf16", matmul.cpu_form()\n'
          'x = jnp.ones((4, 8), jnp.bfloat16)\n'
          'f = jax.jit(lambda a: matmul.dot_general(a, a.T, '
          '(((1,), (0,)), ((), ()))))\n'
          'assert onednn.TARGET not in f.lower(x).as_text()\n'
          'print("ok")\n')
  done = _python(code, VIT_JAX_CPU_MATMUL='onednn',
                 XLA_FLAGS=xla_flags(2))
  assert done.returncode == 0 and 'ok' in done.stdout, done.stderr[-2000:]
