"""`--format=savedmodel`: a TensorFlow SavedModel, via `jax2tf`.

The JAX function is serialised natively (`jax2tf.convert`: StableHLO in an
`XlaCallModule` op, lowered for cpu, cuda and tpu); the weights are TF
variables, so the graph stays small at any model size. Signatures:

  * `serving_default`: float32 images [B, S, S, C] in the model's input
    range (export.json's `input`: [-1, 1] for most) ->
    {'logits', 'probabilities'} (B >= 1, dynamic unless --batch=N);
    `probabilities` as the run's loss read the logits
    (`Trained.output_activation`): softmax, or a sigmoid per class for
    `loss=sigmoid` runs;
  * with `--with-preprocessing`, `serving_default` takes encoded images
    (string [B]: JPEG / PNG / GIF / BMP bytes) and runs the model's eval
    pre-processing (the same TensorFlow ops vit_jax evaluates with) inside
    the graph; the float signature stays as `serving_images`.

Inputs of another shape (or an empty batch) fail with a message naming the
expected input, checked before the model runs (not XLA's shape errors).

TF Serving serves the directory as it is (`tensorflow_model_server
--model_base_path=DIR/..` with the directory named by a version number, see
docs/deploy.md). TFLite: `tf.lite.TFLiteConverter.from_saved_model` lowers
the StableHLO inside a fixed-batch export (`--batch=N`); it cannot convert
a dynamic batch (no dynamic gather).
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import numpy as np

from vit_jax.export.registry import Format, register

PLATFORMS = ('cpu', 'cuda', 'tpu')


def _activation(name: str):
  """`Trained.output_activation` in TensorFlow: logits -> probabilities."""
  import tensorflow as tf
  return {'softmax': lambda logits: tf.nn.softmax(logits, axis=-1),
          'sigmoid': tf.sigmoid}[name]


def _checked(values, expected, signature: str, what: str):
  """`values`, once its shape is `expected` (None: any size >= 1): an
  error naming the signature's input otherwise, before the model runs.

  `Assert` says what is expected where the batch is dynamic; grappler
  folds it away where the shape is fully static (--batch=N), and
  `EnsureShape`, which it keeps, checks there."""
  import tensorflow as tf
  shape = tf.raw_ops.Shape(input=values)
  rank = len(expected)
  padded = tf.concat([shape, tf.zeros([rank], tf.int32)], 0)[:rank]
  ok = tf.logical_and(tf.equal(tf.size(shape), rank), tf.reduce_all(
      padded >= 1))
  for i, size in enumerate(expected):
    if size is not None:
      ok = tf.logical_and(ok, tf.equal(padded[i], size))
  dims = ', '.join('B' if d is None else str(d) for d in expected)
  batch = 'B >= 1' if expected[0] is None else f'B = {expected[0]}'
  check = tf.debugging.Assert(
      ok, [f'{signature} takes {what} of shape [{dims}] ({batch}); got '
           'shape', shape])
  with tf.control_dependencies([check]):
    return tf.ensure_shape(tf.identity(values), expected,
                           name=f'{signature}_input_shape')


def export(trained, out: str, options):
  import tensorflow as tf
  from jax.experimental import jax2tf
  fn = trained.apply_fn(options.dtype)
  shape = (options.batch, *trained.image_shape)
  module = tf.Module()
  module.params = tf.nest.map_structure(
      lambda x: tf.Variable(np.asarray(x, np.float32), trainable=False),
      trained.params)
  poly = None if options.batch else '(b, ...)'
  tf_fn = jax2tf.convert(fn, polymorphic_shapes=[None, poly],
                         native_serialization_platforms=PLATFORMS,
                         with_gradient=False)

  activation = _activation(trained.output_activation)
  floats = (f'float32 images in {trained.input_range_text} (the output of '
            'the eval pre-processing in export.json)')

  def outputs(images):
    logits = tf_fn(module.params, images)
    return {'logits': logits, 'probabilities': activation(logits)}

  def from_images(images):
    signature = 'serving_images' if options.with_preprocessing else (
        'serving_default')
    return outputs(_checked(images, shape, signature, floats))

  images_fn = tf.function(
      from_images, autograph=False,
      input_signature=[tf.TensorSpec(shape, tf.float32, name='images')])
  signatures = {'serving_default': images_fn}
  if options.with_preprocessing:
    pp = trained.preprocess()

    def decode(data):
      return tf.cast(pp({'image': data})['image'], tf.float32)

    def from_bytes(encoded):
      encoded = _checked(encoded, (options.batch,), 'serving_default',
                         'encoded images (a string tensor of JPEG / PNG / '
                         'GIF / BMP bytes)')
      images = tf.map_fn(decode, encoded, fn_output_signature=tf.TensorSpec(
          trained.image_shape, tf.float32))
      return outputs(images)

    bytes_fn = tf.function(
        from_bytes, autograph=False, input_signature=[
            tf.TensorSpec([options.batch], tf.string, name='encoded_images')])
    signatures = {'serving_default': bytes_fn, 'serving_images': images_fn}
  module.serving_images = images_fn
  tf.saved_model.save(module, out, signatures=signatures)
  # saved_model.pb, variables/ and what this TF writes besides
  # (fingerprint.pb, assets/): `out` was empty before.
  files = sorted(n + '/' if os.path.isdir(os.path.join(out, n)) else n
                 for n in os.listdir(out))
  return {'files': files,
          'signatures': {k: _describe(v) for k, v in signatures.items()}}


def _describe(fn) -> str:
  spec = fn.input_signature[0]
  return f'{spec.name}: {spec.dtype.name} {spec.shape.as_list()}'


def _load(out: str):
  return _load_cached(out, os.path.getmtime(os.path.join(out,
                                                        'saved_model.pb')))


@functools.lru_cache(maxsize=2)
def _load_cached(out: str, stamp: float):
  """Loaded once per export (verification runs it several times)."""
  del stamp  # Part of the cache key: a new export in `out` is reloaded.
  import tensorflow as tf
  return tf.saved_model.load(out)


def run(out: str, images: np.ndarray) -> np.ndarray:
  import tensorflow as tf
  loaded = _load(out)
  sig = loaded.signatures.get('serving_images') or loaded.signatures[
      'serving_default']
  return sig(images=tf.constant(images))['logits'].numpy()


def run_bytes(out: str, encoded: Sequence[bytes]) -> np.ndarray:
  import tensorflow as tf
  sig = _load(out).signatures['serving_default']
  return sig(encoded_images=tf.constant(list(encoded)))['logits'].numpy()


register(Format(
    name='savedmodel', export=export, run=run, run_bytes=run_bytes,
    requires=('tensorflow',), embeds_preprocessing=True,
    incidental=('fingerprint.pb', 'assets/'),
    description='TensorFlow SavedModel (jax2tf; TF Serving); '
    '--with-preprocessing takes encoded JPEG/PNG bytes'))
