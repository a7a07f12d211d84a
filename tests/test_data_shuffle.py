"""Stateless permutations and the block shuffle (`vit_jax/data/shuffle.py`)."""

import numpy as np
import pytest
import tensorflow as tf

from vit_jax.data import shuffle

KEY = tf.constant([3, 4], tf.int64)


def _dataset(n=23):
  """Elements {'x': i, 'v': [i] * (i % 3 + 1)}: a varying shape."""
  return tf.data.Dataset.range(n).map(
      lambda i: {'x': i, 'v': tf.fill([i % 3 + 1], i)})


def _xs(ds):
  return [int(e['x']) for e in ds.as_numpy_iterator()]


def test_blocks_are_permuted_in_place():
  out = _xs(shuffle.block_shuffle(_dataset(), 5, KEY))
  for b in range(0, 23, 5):
    assert sorted(out[b:b + 5]) == list(range(b, min(b + 5, 23)))
  assert out != list(range(23))


@pytest.mark.parametrize('skip', [0, 3, 5, 7, 22, 23])
def test_skip_gives_the_rest_of_the_same_order(skip):
  full = _xs(shuffle.block_shuffle(_dataset(), 5, KEY))
  assert _xs(shuffle.block_shuffle(_dataset(), 5, KEY, skip=skip)) == (
      full[skip:])


def test_varying_shapes_survive():
  for e in shuffle.block_shuffle(_dataset(), 4, KEY).as_numpy_iterator():
    np.testing.assert_array_equal(e['v'], [e['x']] * (e['x'] % 3 + 1))


def test_orders_depend_on_the_key_only():
  def order(key):
    return shuffle.permutation(50, tf.constant(key, tf.int64)).numpy()
  first = order([1, 2])
  tf.random.set_seed(5)
  try:
    np.testing.assert_array_equal(order([1, 2]), first)
  finally:
    tf.random.set_seed(None)
  assert sorted(first) == list(range(50))
  assert not np.array_equal(order([1, 3]), first)
