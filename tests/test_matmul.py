"""The models' mixed-precision matmul: float32 accumulation, exact fallback."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from vit_jax.models import matmul, onednn

DN_DENSE = (((2,), (0,)), ((), ()))  # (B, N, D) x (D, F), as nn.Dense.
DN_OUT = (((2, 3), (0, 1)), ((), ()))  # (B, N, H, d) x (H, d, D), attention out.


def _inputs(seed, *shapes):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return [jax.random.normal(k, s) / np.sqrt(s[0] if i else 1)
          for i, (k, s) in enumerate(zip(keys, shapes))]


def test_float32_is_exactly_lax():
  x, w = _inputs(0, (2, 5, 8), (8, 6))
  np.testing.assert_array_equal(matmul.dot_general(x, w, DN_DENSE),
                                lax.dot_general(x, w, DN_DENSE))


def test_float32_dense_gradients_are_autodiffs_with_a_copied_transpose():
  """On CPUs a float32 dense product's backward pass takes the weight
  gradient's transposed activation as a copy, or for rows of 4 KiB and more
  reads it transposed in place (each the faster there, docs/performance.md):
  autodiff's gradients within float32 rounding; exports (`portable()`) keep
  the plain dot."""
  for dn, shapes in [(DN_DENSE, ((4, 33, 64), (64, 96))),
                     (DN_DENSE, ((2, 9, 1100), (1100, 5))),
                     (DN_OUT, ((4, 33, 3, 16), (3, 16, 40)))]:
    x, w = _inputs(2, *shapes)
    grad = jax.jit(jax.grad(_loss(matmul.dot_general, dn, jnp.float32),
                            (0, 1)))
    g_ref = jax.grad(_loss(lax.dot_general, dn, jnp.float32), (0, 1))(x, w)
    for a, b in zip(grad(x, w), g_ref):
      np.testing.assert_allclose(a, b, rtol=1e-5,
                                 atol=1e-5 * float(jnp.abs(b).max()))
    # Rows of 4 KiB and more are read transposed in place (no copy).
    wide = x.shape[-1] * 4 >= matmul.WIDE_ROW_BYTES
    assert ('optimization_barrier' in grad.lower(x, w).as_text()) != wide
    with matmul.portable():
      text = jax.jit(jax.grad(_loss(matmul.dot_general, dn, jnp.float32),
                              (0, 1))).lower(x, w).as_text()
    assert 'optimization_barrier' not in text


def _loss(dot, dn, dtype):
  return lambda x, w: (dot(x.astype(dtype), w.astype(dtype), dn)
                       .astype(jnp.float32) ** 2).sum()


def test_bf16_forward_and_gradients_match_float32():
  for dn, shapes in [(DN_DENSE, ((4, 33, 64), (64, 96))),
                     (DN_OUT, ((4, 33, 3, 16), (3, 16, 40)))]:
    x, w = _inputs(1, *shapes)
    ours = matmul.dot_general(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                              dn)
    assert ours.dtype == jnp.bfloat16
    ref = lax.dot_general(x, w, dn)
    np.testing.assert_allclose(np.asarray(ours, np.float32), ref,
                               atol=0.02 * float(jnp.abs(ref).max()))
    g = jax.grad(_loss(matmul.dot_general, dn, jnp.bfloat16), (0, 1))(x, w)
    g_ref = jax.grad(_loss(lax.dot_general, dn, jnp.float32), (0, 1))(x, w)
    for a, b in zip(g, g_ref):
      assert a.shape == b.shape
      err = float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.abs(b).max())
      assert err < 0.02, err


def test_bf16_result_is_the_float32_sum_rounded_once():
  x, w = _inputs(3, (64, 4096), (4096, 32))
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  ours = matmul.dot_general(xb, wb, (((1,), (0,)), ((), ())))
  exact = np.asarray(xb, np.float64) @ np.asarray(wb, np.float64)
  rounded = np.asarray(jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16),
                       np.float64)
  ulp = np.abs(rounded) * 2.0**-7
  assert np.all(np.abs(np.asarray(ours, np.float64) - rounded) <= ulp + 1e-30)


def test_batched_attention_einsums():
  q, k = _inputs(2, (2, 7, 3, 8), (2, 9, 3, 8))
  for spec in ('bqhd,bkhd->bhqk', 'bhqk,bkhd->bqhd'):
    a, b = (q, k) if spec.startswith('bqhd') else (
        jnp.einsum('bqhd,bkhd->bhqk', q, k), k)

    def loss(dot, dtype):
      return lambda a, b: (jnp.einsum(spec, a.astype(dtype), b.astype(dtype),
                                      _dot_general=dot).astype(jnp.float32)
                           ** 2).sum()
    ours = jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                      _dot_general=matmul.dot_general)
    ref = jnp.einsum(spec, a, b)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(np.asarray(ours, np.float32), ref,
                               atol=0.02 * float(jnp.abs(ref).max()))
    g = jax.grad(loss(matmul.dot_general, jnp.bfloat16), (0, 1))(a, b)
    g_ref = jax.grad(loss(lax.dot_general, jnp.float32), (0, 1))(a, b)
    for x, y in zip(g, g_ref):
      err = float(jnp.abs(x.astype(jnp.float32) - y).max() / jnp.abs(y).max())
      assert err < 0.02, (spec, err)


def test_cpu_bf16_flags_from_cpuinfo(tmp_path):
  info = tmp_path / 'cpuinfo'
  info.write_text('processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n')
  assert matmul.cpu_bf16_flags(str(info)) == {'avx512_bf16'}
  info.write_text('processor\t: 0\nflags\t\t: fpu avx2 avx512f\n')
  assert matmul.cpu_bf16_flags(str(info)) == set()
  assert matmul.cpu_bf16_flags(str(tmp_path / 'absent')) is None
  # ARM (Graviton 3) lists `Features`, bf16 among them: unknown, not "none".
  info.write_text(_ARM_CPUINFO)
  assert matmul.cpu_bf16_flags(str(info)) is None


_ARM_CPUINFO = (
    'processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes '
    'pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma '
    'lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc '
    'flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng\n'
    'CPU implementer\t: 0x41\nCPU part\t: 0xd40\n')


def test_cpu_form_auto_measures_on_arm(monkeypatch, tmp_path):
  """An ARM /proc/cpuinfo has no x86 `flags` line: 'auto' measures the
  forms there (bf16-capable cores exist, Graviton 3's `bf16`) instead of
  taking 'f32' as on an x86 CPU without bf16 instructions."""
  info = tmp_path / 'cpuinfo'
  info.write_text(_ARM_CPUINFO)
  flags = matmul.cpu_bf16_flags
  monkeypatch.delenv(matmul.ENV, raising=False)
  monkeypatch.setenv(matmul.CACHE_ENV, str(tmp_path / 'cpu_matmul.json'))
  monkeypatch.setattr(matmul, 'cpu_bf16_flags', lambda: flags(str(info)))
  measured = []
  monkeypatch.setattr(matmul, '_measure_forms', lambda: (
      measured.append(1), {'bf16': 1.0, 'f32': 2.0})[1])
  matmul.reset_cpu_form()
  try:
    assert matmul.cpu_form() == 'bf16' and measured
  finally:
    matmul.reset_cpu_form()


def test_cpu_form_cache_first_writer_wins(monkeypatch, tmp_path):
  """Two processes measuring at once: the one that records its choice
  first sets the machine's form, and the other takes it rather than its
  own measurement, so that a process resuming either's run later runs the
  same numerics. Simulated by an entry that appears while this process
  measures; the write leaves no temporary file behind."""
  cache = tmp_path / 'cpu_matmul.json'
  monkeypatch.delenv(matmul.ENV, raising=False)
  monkeypatch.setenv(matmul.CACHE_ENV, str(cache))
  monkeypatch.setattr(matmul, 'cpu_bf16_flags', lambda: {'avx512_bf16'})
  key = matmul._cache_key({'avx512_bf16'})
  other = {'another machine': 'onednn'}
  cache.write_text(json.dumps(other))

  def measure():  # Another process finishes first and records 'f32'.
    cache.write_text(json.dumps({**other, key: 'f32'}))
    return {'bf16': 1.0, 'f32': 2.0}

  monkeypatch.setattr(matmul, '_measure_forms', measure)
  matmul.reset_cpu_form()
  try:
    assert matmul.cpu_form() == 'f32'
    assert json.loads(cache.read_text()) == {**other, key: 'f32'}
    # No entry yet: this process's choice is recorded, the others kept.
    cache.write_text(json.dumps(other))
    monkeypatch.setattr(matmul, '_measure_forms',
                        lambda: {'bf16': 1.0, 'f32': 2.0})
    matmul.reset_cpu_form()
    assert matmul.cpu_form() == 'bf16'
    assert json.loads(cache.read_text()) == {**other, key: 'bf16'}
  finally:
    matmul.reset_cpu_form()
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      'cpu_matmul.json', 'cpu_matmul.json.lock']


def test_cpu_form_cache_write_waits_for_the_lock(tmp_path, monkeypatch):
  """A writer waits while another holds the cache's lock (a separate open
  of the lock file, as another process's), then finds that one's entry
  and adopts it."""
  import threading
  pytest.importorskip('fcntl')
  cache = tmp_path / 'cpu_matmul.json'
  monkeypatch.setenv(matmul.CACHE_ENV, str(cache))
  got = []
  with matmul._cache_locked(str(cache)):
    writer = threading.Thread(target=lambda: got.append(
        matmul._write_cache('key', 'bf16')))
    writer.start()
    writer.join(0.5)
    assert writer.is_alive() and not got  # Blocked on the lock.
    cache.write_text(json.dumps({'key': 'onednn'}))
  writer.join(30)
  assert got == ['onednn']
  assert json.loads(cache.read_text()) == {'key': 'onednn'}


def test_cpu_form_from_environment(monkeypatch):
  x, w = _inputs(4, (4, 33, 64), (64, 96))
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  results = {}
  try:
    for form in matmul.CPU_FORMS:
      if form == 'onednn' and not onednn.available()[0]:
        continue  # tests/test_onednn.py checks the message it gives.
      monkeypatch.setenv(matmul.ENV, form)
      matmul.reset_cpu_form()
      assert matmul.cpu_form() == form
      f = jax.jit(jax.value_and_grad(
          _loss(matmul.dot_general, DN_DENSE, jnp.bfloat16), (0, 1)))
      results[form] = f(xb, wb)
      text = f.lower(xb, wb).as_text()
      # The bf16 form's backward materialises the transposed activation;
      # the oneDNN form reads it transposed in place, in its custom call.
      assert ('optimization_barrier' in text) == (form == 'bf16'), form
      assert (onednn.TARGET in text) == (form == 'onednn'), form
    for form in results:
      for a, b in zip(jax.tree.leaves(results[form]),
                      jax.tree.leaves(results['f32'])):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, atol=0.02 * np.abs(b).max())
    monkeypatch.setenv(matmul.ENV, 'fast')
    matmul.reset_cpu_form()
    with pytest.raises(ValueError, match='VIT_JAX_CPU_MATMUL'):
      matmul.cpu_form()
  finally:
    matmul.reset_cpu_form()


def test_cpu_bf16_weight_gradient_of_wide_rows(monkeypatch):
  """Rows of 4 KiB and more (the MLP's GELU output) are transposed inside a
  conditional so that XLA:CPU cannot fuse their producer into the transpose
  (`matmul._transposed`); the weight gradient is still the float32 sum
  rounded once, narrow rows keep the barrier, and a NaN first element still
  gives a NaN gradient."""
  monkeypatch.setenv(matmul.ENV, 'bf16')
  matmul.reset_cpu_form()
  try:
    for k, wide in ((2048, True), (1024, False)):
      x, w = _inputs(5, (2, 40, k), (k, 16))
      xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
      c = jax.random.normal(jax.random.key(6), (2, 40, 16)).astype(
          jnp.bfloat16)

      def loss(x, w):  # The cotangent of the product is exactly `c`.
        # A computed (exactly doubled) operand, as the MLP's GELU output.
        y = matmul.dot_general(x * 2, w, DN_DENSE).astype(jnp.float32)
        return (y * c.astype(jnp.float32)).sum()

      f = jax.jit(jax.grad(loss, 1))
      hlo = f.lower(xb, wb).compile().as_text()
      assert ('conditional(' in hlo) == wide, k
      h = 2 * np.asarray(xb, np.float64).reshape(-1, k)
      exact = h.T @ np.asarray(c, np.float64).reshape(-1, 16)
      rounded = np.asarray(
          jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16), np.float64)
      ours = np.asarray(f(xb, wb), np.float64)
      # One bf16 rounding of a float32 sum (its own error ~1e-7 of the
      # terms, visible where the sum cancels).
      assert np.all(np.abs(ours - rounded) <= np.abs(rounded) * 2.0**-7
                    + 1e-5 * np.abs(exact).max()), k
      assert np.isnan(np.asarray(f(xb.at[0, 0, 0].set(jnp.nan), wb),
                                 np.float32)).any(), k
  finally:
    matmul.reset_cpu_form()


def test_cpu_form_auto_measures_inside_a_trace(monkeypatch, tmp_path):
  """'auto' times both forms in a thread of its own: tracing a jitted
  function that triggers it leaks no tracer."""
  monkeypatch.delenv(matmul.ENV, raising=False)
  monkeypatch.setenv(matmul.CACHE_ENV, str(tmp_path / 'cpu_matmul.json'))
  monkeypatch.setattr(matmul, 'cpu_bf16_flags', lambda: {'avx512_bf16'})
  monkeypatch.setattr(matmul, '_time_forms', lambda: (
      jax.block_until_ready(jax.jit(lambda a: a @ a)(jnp.ones((8, 8)))),
      {'bf16': 2.0, 'f32': 1.0})[1])
  matmul.reset_cpu_form()
  try:
    x, w = _inputs(5, (3, 8), (8, 4))
    jax.jit(lambda a, b: matmul.dot_general(
        a, b, (((1,), (0,)), ((), ()))))(x.astype(jnp.bfloat16),
                                          w.astype(jnp.bfloat16))
    assert matmul.cpu_form() == 'f32'
    assert matmul.MEASURED == {'bf16': 2.0, 'f32': 1.0}
    # Later processes on this machine reuse the choice without measuring:
    # a busy machine cannot flip a resumed run's numerics.
    matmul.reset_cpu_form()
    monkeypatch.setattr(matmul, '_time_forms', lambda: {'bf16': 1.0,
                                                        'f32': 2.0})
    assert matmul.cpu_form() == 'f32' and not matmul.MEASURED
    (tmp_path / 'cpu_matmul.json').unlink()  # Forgotten: measured again.
    matmul.reset_cpu_form()
    assert matmul.cpu_form() == 'bf16'
    monkeypatch.setattr(matmul, 'cpu_bf16_flags', lambda: set())
    matmul.reset_cpu_form()
    assert matmul.cpu_form() == 'f32' and not matmul.MEASURED
  finally:
    matmul.reset_cpu_form()


def test_cpu_form_auto_measures_only_where_programs_run_on_the_cpu(
    monkeypatch, tmp_path, caplog):
  """A process without a CPU backend (JAX_PLATFORMS=tpu) never times its
  CPU: the CPU branches it traces take 'bf16' (XLA's dots, float32
  accumulation), cached nowhere; a process whose measurement fails falls
  back to 'bf16' with a warning instead of failing the trace. JAX's
  default backend is not consulted."""
  monkeypatch.delenv(matmul.ENV, raising=False)
  cache = tmp_path / 'cpu_matmul.json'
  monkeypatch.setenv(matmul.CACHE_ENV, str(cache))
  monkeypatch.setattr(matmul, 'cpu_bf16_flags', lambda: {'avx512_bf16'})
  measure = matmul._measure_forms

  def refuse():
    raise AssertionError('measured the CPU forms')

  monkeypatch.setattr(matmul, '_measure_forms', refuse)
  devices = jax.devices

  def no_cpu(backend=None):
    if backend == 'cpu':
      raise RuntimeError('Unknown backend cpu')
    return devices(backend)

  monkeypatch.setattr(jax, 'devices', no_cpu)
  monkeypatch.setattr(jax, 'default_backend', refuse)
  matmul.reset_cpu_form()
  try:
    assert matmul.cpu_form() == 'bf16' and not cache.exists()
    # No bf16 instructions: 'f32', as on a CPU host (no timing either).
    monkeypatch.setattr(matmul, 'cpu_bf16_flags', lambda: set())
    matmul.reset_cpu_form()
    assert matmul.cpu_form() == 'f32'
    monkeypatch.setattr(matmul, 'cpu_bf16_flags', lambda: {'avx512_bf16'})
    monkeypatch.setattr(jax, 'devices', devices)

    def broken():
      raise ValueError('the probe broke')

    monkeypatch.setattr(matmul, '_time_forms', broken)
    monkeypatch.setattr(matmul, '_measure_forms', measure)
    matmul.reset_cpu_form()
    with caplog.at_level('WARNING'):
      assert matmul.cpu_form() == 'bf16'
    assert 'the probe broke' in caplog.text and 'VIT_JAX_CPU_MATMUL' in (
        caplog.text)
    assert not cache.exists()
  finally:
    matmul.reset_cpu_form()


def test_cpu_form_probe_times_every_form_it_can_run():
  times = matmul._time_forms(m=64, k=32, n=48, repeats=1)
  assert set(times) == {'bf16', 'f32'} | (
      {'onednn'} if onednn.available()[0] else set())
  assert all(0 < t < 60 for t in times.values())


def test_a_float32_model_never_decides_the_cpu_form(monkeypatch):
  """The form is for bf16 products: tracing a float32 ViT's train gradient
  (the CPU attention core's transposed products included) must not run the
  probe, which costs a float32 run seconds and would cache a choice."""
  from vit_jax import models

  def refuse():
    raise AssertionError('a float32 program decided the CPU matmul form')

  monkeypatch.setattr(matmul, '_decide', refuse)
  matmul.reset_cpu_form()
  try:
    model = models.from_config(
        dict(name='ViT-Ti/16', dtype='float32'), 10, 'cpu')
    x = jnp.ones((2, 32, 32, 3))
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), x,
                                               train=False))

    def loss(p):
      return model.apply(p, x, train=False).sum()

    jax.jit(jax.grad(loss)).lower(params)
    q = jnp.ones((2, 5, 4))
    jax.jit(lambda a, b: matmul.cpu_batched(a, b, jnp.float32, trans_b=True)
            ).lower(q, q)
  finally:
    matmul.reset_cpu_form()


def test_plain_dot_general_has_forward_mode_autodiff():
  """`dot_general`'s float32 CPU layout is a custom VJP, traced wherever the
  program runs (a platform branch): no `jax.jvp`. `plain_dot_general`, what
  plain-autodiff models take, is `lax.dot_general` itself, forward mode
  included; bf16 products keep `dot_general`'s."""
  x, w = _inputs(6, (2, 5, 8), (8, 6))
  f = lambda dot: lambda x: dot(x, w, DN_DENSE)
  with pytest.raises(TypeError, match='forward-mode'):
    jax.jvp(f(matmul.dot_general), (x,), (x,))
  got = jax.jvp(f(matmul.plain_dot_general), (x,), (x,))
  want = jax.jvp(f(lax.dot_general), (x,), (x,))
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  np.testing.assert_array_equal(
      matmul.plain_dot_general(xb, wb, DN_DENSE),
      matmul.dot_general(xb, wb, DN_DENSE))


def test_cpu_export_of_the_onednn_form_traces_inside_portable(monkeypatch):
  """`jax.export` of a bf16 model for CPUs, in a process whose CPU form is
  'onednn': inside `matmul.portable()` (as docs/models.md says, and
  `vit_jax.export` does) it serialises, with XLA's dots; outside, jax
  refuses the oneDNN custom call, which has no compatibility guarantee
  (its error names the call)."""
  from vit_jax import models
  if not onednn.available()[0]:
    pytest.skip(f'the oneDNN matmul is unavailable: {onednn.available()[1]}')
  monkeypatch.setenv(matmul.ENV, 'onednn')
  matmul.reset_cpu_form()
  try:
    model = models.create('ViT-test', num_classes=3, dtype=jnp.bfloat16)
    x = jnp.zeros((2, 8, 8, 3))
    p = jax.jit(model.init)(jax.random.key(0), x)['params']
    # A jit of its own per export: jit keeps a function's first trace.
    fn = lambda: jax.jit(lambda p, x: model.apply({'params': p}, x))
    with matmul.portable():
      exported = jax.export.export(fn(), platforms=['cpu'])(p, x)
    assert exported.serialize()
    assert onednn.TARGET not in exported.mlir_module()
    with pytest.raises(ValueError, match=onednn.TARGET):
      jax.export.export(fn(), platforms=['cpu'])(p, x)
  finally:
    matmul.reset_cpu_form()
