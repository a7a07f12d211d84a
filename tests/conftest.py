"""Shared test set-up: quiet TF/JAX logs, CPU only, fixed seeds."""

import contextlib
import gc
import os
import shutil
import tempfile

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# The bf16 CPU matmul form measured once per test session (its workers
# share the file; writes are atomic), not read from or written to this
# machine's cache (vit_jax/models/matmul.py); removed when the session ends.
_MATMUL_CACHE = os.path.join(tempfile.gettempdir(),
                             f'vit_jax_tests_cpu_matmul_{os.getpid()}.json')
os.environ.setdefault('VIT_JAX_CPU_MATMUL_CACHE', _MATMUL_CACHE)

# One persistent XLA compilation cache per test session: set by the process
# that loads this first (pytest, or xdist's controller), inherited by the
# xdist workers and the processes tests start, and removed by that process
# when the session ends. The suite compiles the same smoke programs in many
# tests and processes; a cache hit is the same executable.
_CACHE = os.path.join(tempfile.gettempdir(),
                      f'vit_jax_tests_xla_cache_{os.getpid()}')
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', _CACHE)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.5')

# XLA:CPU compiling, not running, is most of this suite's time: it compiles
# hundreds of small programs and runs each a few times. LLVM at -O0 and
# XLA's loop emitters (no fusion emitters) compile them about 40% faster.
# Neither changes what a program computes (no fast-math either way); the
# products and convolutions are library calls, compiled the same. Added to
# whatever XLA_FLAGS the caller set (a flag the caller set wins), and
# inherited by the workers and the processes tests start (`xla_flags`).
_TEST_XLA_FLAGS = ('--xla_backend_optimization_level=0',
                   '--xla_cpu_use_fusion_emitters=false')
_given = os.environ.get('XLA_FLAGS', '')
os.environ['XLA_FLAGS'] = ' '.join([_given] + [
    f for f in _TEST_XLA_FLAGS if f.split('=')[0] not in _given]).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
  del session, exitstatus
  if os.environ.get('JAX_COMPILATION_CACHE_DIR') == _CACHE:
    shutil.rmtree(_CACHE, ignore_errors=True)
  if os.environ.get('VIT_JAX_CPU_MATMUL_CACHE') == _MATMUL_CACHE:
    for path in (_MATMUL_CACHE, _MATMUL_CACHE + '.lock'):
      with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def xla_flags(devices=None):
  """XLA_FLAGS for a process a test starts: the suite's flags, with
  `devices` simulated CPU devices (None: the default, one)."""
  flags = [f for f in os.environ.get('XLA_FLAGS', '').split()
           if not f.startswith('--xla_force_host_platform_device_count')]
  if devices:
    flags.append(f'--xla_force_host_platform_device_count={devices}')
  return ' '.join(flags)


@pytest.fixture
def rng():
  return np.random.RandomState(0)


def perturb(params, scale=0.05, seed=1):
  """Random non-zero weights everywhere (a zero head makes logits vacuous)."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [
      np.asarray(x) + scale * np.asarray(jax.random.normal(k, np.shape(x)))
      for x, k in zip(leaves, keys)])


def take(it, n):
  """The next `n` batches of an iterator."""
  return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
  """Two lists of batches (dicts of arrays) are identical."""
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@contextlib.contextmanager
def no_cyclic_gc():
  """Python's cyclic collector off: inside, an object whose last reference
  goes is freed at once only if no reference cycle holds it."""
  gc.collect()
  gc.disable()
  try:
    yield
  finally:
    gc.enable()



@pytest.fixture(scope='session')
def smoke_workdir(tmp_path_factory):
  """A tiny ViT trained for a few steps on real data (one per test session,
  shared by the xdist workers; tests/trained_workdir.py). Read it only."""
  import trained_workdir
  return trained_workdir.smoke_workdir(tmp_path_factory)
