"""bf16 matmuls on oneDNN's CPU kernels: an optional CPU matmul form.

On CPUs with AMX (Intel Xeon 4th generation and later) oneDNN 3.x, the
library PyTorch's CPU matmuls run on, multiplies ViT-B/16's dense-layer
shapes about twice as fast as XLA:CPU's own bf16 kernel (measured side by
side in one process on a 2-vCPU Intel Xeon VM with AMX, against XLA and
PyTorch: docs/performance.md). XLA cannot be told to use it, so
this module hands the dense layers' 2-D bf16 products, and the CPU
attention core's batched ones, to oneDNN through an XLA FFI custom call
(`onednn_matmul.cc`, next to this file).

It is opt-in by installation: `pip install -e ".[onednn]"` brings Intel's
`onednn` and `onednn-devel` wheels (the library and its headers; about
2 GB with the SYCL and OpenCL CPU runtimes they depend on). The first use
compiles the custom call with the system's C++ compiler (`$CXX`, else
`g++`) against those headers and jaxlib's FFI headers, once per source,
jaxlib and oneDNN (a few seconds; kept in `VIT_JAX_ONEDNN_CACHE`, default
~/.cache/vit_jax/onednn). `VIT_JAX_ONEDNN_ROOT` names another installation
prefix (with include/oneapi/dnnl and lib/libdnnl.so.3).

`vit_jax.models.matmul` offers it as the CPU form 'onednn'
(`VIT_JAX_CPU_MATMUL=onednn`), and 'auto' times it against the other forms
where `available()`. Programs that carry it run only in a process that
registered the custom call: exports (`vit_jax.export`) use XLA's own form
(`matmul.portable`).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import shutil
import site
import subprocess
import sys
import tempfile
import threading
from typing import Tuple

import jax
import jax.numpy as jnp

TARGET = 'vit_jax_onednn_matmul'
ROOT_ENV = 'VIT_JAX_ONEDNN_ROOT'
CACHE_ENV = 'VIT_JAX_ONEDNN_CACHE'
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      'onednn_matmul.cc')
INSTALL_HINT = ('install it with `pip install -e ".[onednn]"` (Intel\'s '
                'onednn and onednn-devel wheels), or set '
                f'{ROOT_ENV} to a oneDNN 3.x prefix')

_lock = threading.Lock()
_state: dict = {}


def available() -> Tuple[bool, str]:
  """(True, what was loaded) once the custom call is registered for the CPU
  and oneDNN has a bf16 matmul for this CPU (none for AVX2-only ones); (False,
  why not) otherwise. Builds and loads it on the first call."""
  with _lock:
    if 'result' not in _state:
      try:
        _state['result'] = (True, _load())
      except _Unavailable as e:
        _state['result'] = (False, str(e))
      except OSError as e:  # A library or the compiler that cannot load/run.
        _state['result'] = (False, f'{type(e).__name__}: {e}')
    return _state['result']


def matmul(a, b, *, trans_a: bool = False, trans_b: bool = False,
           out=jnp.bfloat16):
  """op(a) x op(b) of bf16 arrays on oneDNN, f32-accumulated, in `out`
  (bf16 or f32): 2-D, or 3-D with a leading batch axis; op transposes the
  last two axes where asked (a stored (..., K, M), b (..., N, K)). For
  programs that run on the CPU (a `lax.platform_dependent` CPU branch).
  Registers the custom call first (`available()`), or says why it cannot."""
  ok, why = available()
  if not ok:
    raise RuntimeError(f'the oneDNN matmul is unavailable: {why}')
  m = a.shape[-1] if trans_a else a.shape[-2]
  n = b.shape[-2] if trans_b else b.shape[-1]
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(a.shape[:-2] + (m, n),
                                                       out),
                          vmap_method='sequential')
  return call(a, b, trans_a=trans_a, trans_b=trans_b)


@jax.custom_vjp
def dot(a, b):
  """(M, K) x (K, N) bf16 -> bf16, float32-accumulated, forward and
  backward on oneDNN. The backward pass rounds the cotangent to bf16 and
  reads the saved operands transposed in place (no transposed copy)."""
  return matmul(a, b)


def _dot_fwd(a, b):
  return matmul(a, b), (a, b)


def _dot_bwd(res, g):
  a, b = res
  g = g.astype(jnp.bfloat16)
  return matmul(g, b, trans_b=True), matmul(a, g, trans_a=True)


dot.defvjp(_dot_fwd, _dot_bwd)


class _Unavailable(Exception):
  pass


def _prefix() -> str:
  root = os.environ.get(ROOT_ENV)
  if root:
    if not os.path.isdir(root):
      raise _Unavailable(f'{ROOT_ENV}={root!r} is not a directory: '
                         + INSTALL_HINT)
    return root
  # pip puts the wheels' lib/ and include/ under the environment's prefix,
  # or under the user base for `pip install --user`.
  for prefix in (sys.prefix, site.getuserbase()):
    if os.path.exists(_header(prefix)):
      return prefix
  return sys.prefix


def _header(prefix: str) -> str:
  return os.path.join(prefix, 'include', 'oneapi', 'dnnl', 'dnnl.hpp')


def _load() -> str:
  if not sys.platform.startswith('linux'):
    raise _Unavailable('the oneDNN matmul is built for Linux only')
  prefix = _prefix()
  libs = sorted(glob.glob(os.path.join(prefix, 'lib', 'libdnnl.so.3*')))
  if not os.path.exists(_header(prefix)) or not libs:
    raise _Unavailable(f'no oneDNN 3.x headers and library under {prefix}: '
                       + INSTALL_HINT)
  libdir = os.path.join(prefix, 'lib')
  # Intel's wheels run oneDNN's CPU engine on their OpenCL CPU runtime; the
  # OpenCL loader finds it through this variable (read when it first loads).
  icd = os.path.join(libdir, 'libintelocl.so')
  if os.path.exists(icd) and not os.environ.get('OCL_ICD_FILENAMES'):
    os.environ['OCL_ICD_FILENAMES'] = icd
  path = _build(prefix, libdir, libs[-1])
  lib = ctypes.CDLL(path)
  message = ctypes.create_string_buffer(512)
  status = lib.vit_jax_onednn_check(message, len(message))
  said = message.value.decode(errors='replace')
  if status == 1:
    raise _Unavailable(f'oneDNN could not create its CPU engine: {said}')
  if status != 0:
    raise _Unavailable(
        'oneDNN has no bf16 matmul for this CPU (it needs AVX512-BF16, '
        'AVX2-VNNI-2 or AMX; here bf16 matmuls run as float32, the CPU form '
        f'f32, which VIT_JAX_CPU_MATMUL=auto picks on such a CPU): {said}')
  jax.ffi.register_ffi_target(
      TARGET, jax.ffi.pycapsule(lib.VitJaxOnednnMatmul), platform='cpu')
  return said


def _build(prefix: str, libdir: str, lib: str) -> str:
  """The compiled custom call for this source, jaxlib and oneDNN: built once
  into the cache directory (atomically: concurrent processes may race)."""
  cxx = os.environ.get('CXX') or shutil.which('g++') or shutil.which('c++')
  if not cxx:
    raise _Unavailable('no C++ compiler to build the oneDNN custom call '
                       '(install g++ or set CXX)')
  with open(SOURCE, 'rb') as f:
    source = f.read()
  stat = os.stat(lib)
  key = hashlib.sha256(b'|'.join([
      source, jax.ffi.include_dir().encode(), jax.__version__.encode(),
      os.path.realpath(lib).encode(), str(stat.st_size).encode(),
      str(int(stat.st_mtime)).encode(), cxx.encode()])).hexdigest()[:16]
  cache = os.environ.get(CACHE_ENV) or os.path.join(
      os.path.expanduser('~'), '.cache', 'vit_jax', 'onednn')
  out = os.path.join(cache, f'vit_jax_onednn_{key}.so')
  if os.path.exists(out):
    return out
  os.makedirs(cache, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix='.so', dir=cache)
  os.close(fd)
  cmd = [cxx, '-O2', '-std=c++17', '-shared', '-fPIC', '-w',
         '-I', os.path.join(prefix, 'include'), '-I', jax.ffi.include_dir(),
         SOURCE, '-o', tmp, '-L', libdir, '-l:' + os.path.basename(lib),
         # DT_RPATH (not RUNPATH): also searched for libdnnl's own
         # dependencies (TBB, the SYCL runtime) in the same directory.
         '-Wl,--disable-new-dtags,-rpath,' + libdir]
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
      raise _Unavailable('building the oneDNN custom call failed:\n'
                         + ' '.join(cmd) + '\n' + done.stderr[-2000:])
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return out
