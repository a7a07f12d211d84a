"""Stateless shuffling: orders that are pure functions of a key.

`tf.data.Dataset.shuffle(seed=...)` combines its seed with TensorFlow's
global seed (`tf.random.set_seed`), so a stream built with it changes when
the user's code sets one. Here every order comes from an explicit stateless
key (int64 [2]) instead:

  * `permutation(n, key)`: a permutation of [0, n), e.g. of a file list;
  * `block_shuffle(ds, block_size, key)`: consecutive blocks of `block_size`
    elements, each permuted by its own key. A block is held in memory while
    it is read out, and the next ones fill meanwhile: up to about three
    blocks (TF's `shuffle` holds one buffer).

Both give the same result for the same key whatever the global seed, the
parallelism or the machine.
"""

from __future__ import annotations

import operator
from typing import Callable, Optional, Tuple

import tensorflow as tf

_MAX_BLOCKS = 2**62


def fold(key: tf.Tensor, *data: tf.Tensor) -> tf.Tensor:
  """A new stateless key from `key` and integer scalars `data`."""
  for d in data:
    key = tf.random.experimental.stateless_fold_in(key, d)
  return key


def permutation(n, key: tf.Tensor) -> tf.Tensor:
  """int32 [n]: a permutation of [0, n), a pure function of (n, key)."""
  return tf.random.experimental.stateless_shuffle(
      tf.range(tf.cast(n, tf.int32)), seed=key)


def _batchable(spec) -> Tuple[Optional[Callable], Optional[Callable]]:
  """(encode, decode) making every element of `spec` a fixed-shape tensor.

  Components whose shape is not fully defined (e.g. decoded images of
  varying size) travel as serialized scalar strings through `batch`;
  (None, None) where every shape is already fixed.
  """
  leaves = tf.nest.flatten(spec)
  for s in leaves:
    if not isinstance(s, tf.TensorSpec):
      raise TypeError(f'block_shuffle supports dense tensors only, got {s}')
  varying = [not s.shape.is_fully_defined() for s in leaves]
  if not any(varying):
    return None, None

  def encode(x):
    flat = [tf.io.serialize_tensor(t) if v else t
            for t, v in zip(tf.nest.flatten(x), varying)]
    return tf.nest.pack_sequence_as(spec, flat)

  def decode(x):
    flat = []
    for t, v, s in zip(tf.nest.flatten(x), varying, leaves):
      if v:
        t = tf.io.parse_tensor(t, s.dtype)
        t.set_shape(s.shape)
      flat.append(t)
    return tf.nest.pack_sequence_as(spec, flat)

  return encode, decode


def _emit_permuted(block, key: tf.Tensor) -> tf.data.Dataset:
  """The elements of a batched `block` in a permuted order.

  One element at a time (a string copy each): `tf.gather` of a whole block
  of encoded images is several times slower.
  """
  n = tf.shape(tf.nest.flatten(block)[0])[0]
  return tf.data.Dataset.from_tensor_slices(permutation(n, key)).map(
      lambda j: tf.nest.map_structure(lambda t: t[j], block))


def block_shuffle(ds, block_size: int, key: tf.Tensor,
                  skip=0) -> tf.data.Dataset:
  """`ds` with each block of `block_size` consecutive elements permuted.

  Block b (elements b*block_size ... of `ds`) is permuted by
  `fold(key, b)`; the last block may be shorter.

  Args:
    ds: a finite dataset of dense tensors (nests allowed); or a function
      `start -> dataset` giving that dataset from its element `start` (a
      Python int) on, e.g. a source that skips whole files unread
      (`Source.host_dataset_from`); `skip` must then be a Python int.
    block_size: elements per block (held in memory while read out).
    key: int64 [2] stateless key (may be a tensor).
    skip: int64 scalar (may be a tensor for a dataset `ds`): start at this
      element of the result. Whole blocks before it are not shuffled: a
      dataset skips them by reading them (not held), a function is asked
      to start at the block holding element `skip`.

  Returns:
    The shuffled elements from position `skip` on.
  """
  if isinstance(ds, tf.data.Dataset):
    skip = tf.cast(skip, tf.int64)
    from_element = ds.skip
  else:
    skip = operator.index(skip)
    from_element = ds
  if block_size == 1:
    return from_element(skip)
  first = skip // block_size
  ds = from_element(first * block_size)
  encode, decode = _batchable(ds.element_spec)
  if encode is not None:
    ds = ds.map(encode)
  blocks = tf.data.Dataset.zip((tf.data.Dataset.range(first, _MAX_BLOCKS),
                                ds.batch(block_size).prefetch(1)))
  ds = blocks.flat_map(lambda b, x: _emit_permuted(x, fold(key, b)))
  ds = ds.skip(skip - first * block_size)
  return ds if decode is None else ds.map(decode)
