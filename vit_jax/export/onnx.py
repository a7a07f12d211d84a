"""`--format=onnx`: an ONNX graph, converted with `jax2onnx`, run with
onnxruntime.

`jax2onnx` converts the model's jaxpr primitive by primitive (a maintained
path that works on the pinned JAX; the SavedModel route through tf2onnx
cannot convert jax2tf's `XlaCallModule` op). Writes `model.onnx`: input
`images` float32 [B, S, S, C] in the model's input range (export.json's
`input`: [-1, 1] for most; NHWC, as vit_jax; B dynamic unless --batch=N),
output the logits. Weights over 2 GiB go to `model.onnx.data` (ONNX external
data).

    session = onnxruntime.InferenceSession('model.onnx')
    logits = session.run(None, {'images': images})[0]
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os

import numpy as np

from vit_jax import models
from vit_jax.export.registry import Format, register

FILE = 'model.onnx'
OPSET = 21  # Runs on onnxruntime >= 1.20.


def not_convertible(trained) -> str:
  """Why jax2onnx cannot convert `trained` correctly ('' if it can)."""
  kw = models.options(trained.name, **trained.options)
  if (models.spec(trained.name)['cls'] is models.BiT
      or kw.get('resnet_layers') is not None):
    return (f'{trained.architecture} has weight-standardised ResNet '
            'convolutions, and jax2onnx 0.13 converts flax Conv layers from '
            'their raw kernel, dropping the standardisation (its logits were '
            'off by ~0.5 when tried; running flax\'s own Conv under it fails)')
  return ''


def export(trained, out: str, options):
  why = not_convertible(trained)
  if why:
    raise ValueError(f'--format=onnx cannot convert this model: {why}. '
                     'Export it with --format=savedmodel or stablehlo')
  import onnx
  from jax2onnx import to_onnx
  # jax2onnx converts primitive by primitive and has none for the
  # `lax.platform_dependent` switch through which "xla" attention picks its
  # CPU form; "explicit" attention is the same computation in plain ops.
  attention = ({'attention_impl': 'explicit'} if 'attention_impl' in
               models.spec(trained.name)['cls'].__dataclass_fields__ else {})
  fn = trained.apply_fn(options.dtype, **attention)
  params = trained.params
  batch = 'B' if options.batch is None else options.batch
  # jax2onnx imports all its plugins (some fail on this JAX, e.g. dm_pix's,
  # and are logged with tracebacks) and prints debugging lines to stdout:
  # keep both out of the command's output.
  quiet = logging.getLogger('jax2onnx')
  level = quiet.level
  quiet.setLevel(logging.ERROR)
  try:
    with contextlib.redirect_stdout(io.StringIO()):
      model = to_onnx(lambda images: fn(params, images),
                      [(batch, *trained.image_shape)], model_name='vit_jax',
                      opset=OPSET)
  finally:
    quiet.setLevel(level)
  graph = model.graph
  _rename(graph.input[0], graph, 'images')
  _rename(graph.output[0], graph, 'logits')
  path = os.path.join(out, FILE)
  large = model.ByteSize() > 2**31 - 2**26
  onnx.save_model(model, path, save_as_external_data=large,
                  location=FILE + '.data' if large else None)
  onnx.checker.check_model(path)
  return {'files': [FILE] + ([FILE + '.data'] if large else []),
          'opset': OPSET, 'input': 'images', 'output': 'logits'}


def _rename(value, graph, name: str) -> None:
  """Renames a graph input / output and every reference to it."""
  old = value.name
  if old == name:
    return
  for node in graph.node:
    node.input[:] = [name if x == old else x for x in node.input]
    node.output[:] = [name if x == old else x for x in node.output]
  value.name = name


@functools.lru_cache(maxsize=2)
def _session(path: str, stamp: float):
  del stamp  # Part of the cache key: a new export is loaded anew.
  import onnxruntime as ort
  return ort.InferenceSession(path, providers=['CPUExecutionProvider'])


def run(out: str, images: np.ndarray) -> np.ndarray:
  path = os.path.join(out, FILE)
  session = _session(path, os.path.getmtime(path))
  return session.run(None, {session.get_inputs()[0].name: images})[0]


register(Format(
    name='onnx', export=export, run=run,
    requires=('onnx', 'onnxruntime', 'jax2onnx'), unsupported=not_convertible,
    # Every export is verified, and onnxruntime has no bfloat16 Conv (nor
    # most bfloat16 kernels) on CPUs: such a graph could not be checked.
    dtypes=('float32',),
    other_dtypes='onnxruntime cannot run a bfloat16 graph on a CPU (it has '
    'no bfloat16 Conv), so it could not be verified: export bfloat16 as '
    '--format=stablehlo or savedmodel',
    no_preprocessing='ONNX has no JPEG / PNG decoder',
    description='ONNX graph (jax2onnx), checked with onnxruntime'))
