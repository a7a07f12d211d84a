"""npz checkpoints (both namings, hybrids), load_pretrained, and bad files."""

import os
import re
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
from flax import traverse_util

from conftest import perturb
from vit_jax import checkpoint, models
from vit_jax.checkpoint import CheckpointError

# Linen name -> name in the first public checkpoints (numbered across types).
OLD_NAMES = {'LayerNorm_0': 'LayerNorm_0',
             'MultiHeadDotProductAttention_0': 'MultiHeadDotProductAttention_1',
             'LayerNorm_1': 'LayerNorm_2', 'MlpBlock_0': 'MlpBlock_3'}

TINY_HYBRID = dict(hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2,
                   resnet_layers=(1, 1, 1))


def _init(model, shape):
  return model.init(jax.random.key(0), jnp.zeros(shape))['params']


def _images(shape, seed=0):
  return jnp.asarray(np.random.RandomState(seed).uniform(-1, 1, shape),
                     jnp.float32)


def _flat(params):
  return {'/'.join(k): np.asarray(v)
          for k, v in traverse_util.flatten_dict(params).items()}


def _write_flat(path, flat):
  np.savez(path, **flat)


def _assert_trees_equal(a, b):
  fa, fb = _flat(a), _flat(b)
  assert sorted(fa) == sorted(fb)
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


@pytest.fixture
def vit():
  model = models.create('ViT-test', num_classes=5, representation_size=16)
  return model, perturb(_init(model, (1, 28, 28, 3)))


def test_public_key_layout_of_b16():
  model = models.create('ViT-B/16', num_classes=1000)
  shapes = {'/'.join(k): v.shape for k, v in traverse_util.flatten_dict(
      jax.eval_shape(lambda: _init(model, (1, 224, 224, 3)))).items()}
  assert shapes['Transformer/encoderblock_0/MultiHeadDotProductAttention_0/'
                'query/kernel'] == (768, 12, 64)
  assert shapes['embedding/kernel'] == (16, 16, 3, 768)
  assert shapes['Transformer/posembed_input/pos_embedding'] == (1, 197, 768)
  assert shapes['cls'] == (1, 1, 768)
  assert shapes['head/kernel'] == (768, 1000)


def test_npz_round_trip(tmp_path, vit):
  model, params = vit
  path = str(tmp_path / 'ckpt.npz')
  checkpoint.save_npz(params, path)
  loaded = checkpoint.load_npz(path)
  _assert_trees_equal(loaded, params)
  with np.load(path, allow_pickle=False) as f:
    assert 'Transformer/encoderblock_1/MlpBlock_0/Dense_1/kernel' in f.files
  x = _images((2, 28, 28, 3))
  np.testing.assert_array_equal(model.apply({'params': loaded}, x),
                                model.apply({'params': params}, x))


def test_scanned_params_save_in_the_public_unrolled_layout(tmp_path, vit):
  """A scan_layers run's parameters are written one encoderblock_<i> each,
  the layout the reference code (and every public .npz) has."""
  _, params = vit
  path = str(tmp_path / 'scanned.npz')
  checkpoint.save_npz(checkpoint.stack_blocks(jax.device_get(params)), path)
  with np.load(path, allow_pickle=False) as f:
    assert 'Transformer/encoderblock_1/MlpBlock_0/Dense_1/kernel' in f.files
    assert not any('encoderblock/' in k for k in f.files)
  _assert_trees_equal(checkpoint.load_npz(path), params)


def test_bfloat16_params_save_as_float32(tmp_path, vit):
  _, params = vit
  bf = jax.tree.map(lambda p: jnp.asarray(p, jnp.bfloat16), params)
  checkpoint.save_npz(bf, str(tmp_path / 'bf.npz'))
  loaded = checkpoint.load_npz(str(tmp_path / 'bf.npz'))
  assert {v.dtype for v in jax.tree.leaves(loaded)} == {np.dtype('float32')}


def test_old_naming_loads(tmp_path, vit):
  model, params = vit
  old = {}
  for k, v in _flat(params).items():
    for new, name in OLD_NAMES.items():
      k = re.sub(rf'(encoderblock_\d+)/{new}/', rf'\1/@{name}/', k)
    old[k.replace('@', '')] = v
  assert 'Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel' in old
  path = str(tmp_path / 'old.npz')
  _write_flat(path, old)
  loaded = checkpoint.load_npz(path)
  _assert_trees_equal(loaded, params)
  x = _images((2, 28, 28, 3))
  np.testing.assert_array_equal(model.apply({'params': loaded}, x),
                                model.apply({'params': params}, x))


def test_hybrid_checkpoint_with_old_groupnorm_shapes(tmp_path):
  model = models.create('R50+ViT-B/16', num_classes=3, **TINY_HYBRID)
  params = perturb(_init(model, (1, 32, 32, 3)))
  flat = _flat(params)
  assert flat['conv_root/kernel'].shape == (7, 7, 3, 64)
  assert flat['block2/unit1/gn_proj/scale'].shape == (512,)
  old = {k: (v.reshape(1, 1, 1, -1) if re.search(r'/?gn\w*/(scale|bias)$', k)
             else v) for k, v in flat.items()}
  path = str(tmp_path / 'hybrid.npz')
  _write_flat(path, old)
  loaded = checkpoint.load_npz(path)
  checkpoint.check_params(params, loaded)
  _assert_trees_equal(loaded, params)


def test_load_pretrained_new_resolution_and_classes(tmp_path, vit):
  model, params = vit  # 28 px -> 7x7 grid, 5 classes, pre-logits 16.
  path = str(tmp_path / 'pre.npz')
  checkpoint.save_npz(params, path)
  target = models.create('ViT-test', num_classes=3)  # No pre-logits.
  init = _init(target, (1, 48, 48, 3))  # 12x12 grid.
  new = checkpoint.load_pretrained(path, init)

  assert 'pre_logits' not in new
  np.testing.assert_array_equal(new['head']['kernel'], np.zeros((32, 3)))
  old_pe = np.asarray(params['Transformer']['posembed_input']['pos_embedding'])
  pe = new['Transformer']['posembed_input']['pos_embedding']
  assert pe.shape == (1, 145, 32)
  np.testing.assert_array_equal(pe[:, 0], old_pe[:, 0])  # Class token row.
  # The reference code's corner-aligned bilinear resize (scipy's order-1
  # zoom there), computed independently by TensorFlow.
  ref = tf.compat.v1.image.resize_bilinear(
      old_pe[None, 0, 1:].reshape(1, 7, 7, 32), (12, 12),
      align_corners=True).numpy()[0]
  np.testing.assert_allclose(pe[0, 1:].reshape(12, 12, 32), ref, atol=1e-5)
  # Everything else is the pre-trained weights.
  blk = 'Transformer/encoderblock_1/MlpBlock_0/Dense_0/kernel'
  np.testing.assert_array_equal(_flat(new)[blk], _flat(params)[blk])
  logits = target.apply({'params': new}, _images((2, 48, 48, 3)))
  assert logits.shape == (2, 3) and np.all(np.isfinite(logits))


def test_load_pretrained_b16_224_to_384():
  model = models.create('ViT-B/16', num_classes=10)
  shapes = jax.eval_shape(lambda: _init(model, (1, 384, 384, 3)))
  pe = np.random.RandomState(0).normal(size=(1, 197, 768)).astype(np.float32)
  new = checkpoint.resize_posemb(pe, shapes['Transformer']['posembed_input'][
      'pos_embedding'].shape)
  assert new.shape == (1, 577, 768)
  ref = tf.compat.v1.image.resize_bilinear(
      pe[:, 1:].reshape(1, 14, 14, 768), (24, 24),
      align_corners=True).numpy()[0]
  np.testing.assert_allclose(new[0, 1:].reshape(24, 24, 768), ref, atol=1e-5)
  # Corner rows of the grid land on the new grid's corners unchanged.
  old_grid, new_grid = pe[0, 1:].reshape(14, 14, 768), new[0, 1:].reshape(
      24, 24, 768)
  for i, j in ((0, 0), (0, -1), (-1, 0), (-1, -1)):
    np.testing.assert_allclose(new_grid[i, j], old_grid[i, j], atol=1e-6)


def test_load_pretrained_token_checkpoint_into_gap_model(vit, caplog):
  """A class-token checkpoint starts a "gap" model: its cls and the
  class-token position row are dropped (logged), the grid kept; the
  reverse cannot be done and says so."""
  _, params = vit
  target = models.create('ViT-test', num_classes=3, classifier='gap')
  init = _init(target, (1, 28, 28, 3))
  with caplog.at_level('INFO'):
    new = checkpoint.load_pretrained(params, init)
  assert 'dropping its cls' in caplog.text and 'cls' not in new
  old_pe = np.asarray(params['Transformer']['posembed_input']['pos_embedding'])
  np.testing.assert_array_equal(
      new['Transformer']['posembed_input']['pos_embedding'], old_pe[:, 1:])
  with pytest.raises(CheckpointError, match='no class token'):
    checkpoint.load_pretrained(new, _init(models.create(
        'ViT-test', num_classes=3), (1, 28, 28, 3)))


def test_load_pretrained_non_square_grids(vit):
  """A non-square target grid is resized to (rows, cols), also when its
  row count equals the checkpoint's (4x4 + cls = 2x8 + cls) or looks like
  a square grid without class token (14x16 + cls = 15x15): the class-token
  rows are read from the `cls` parameters, not guessed from counts."""
  _, params = vit  # 7x7 grid + cls.
  old_pe = np.asarray(params['Transformer']['posembed_input']['pos_embedding'])
  model = models.create('ViT-test', num_classes=5, representation_size=16)
  for (h, w) in ((8, 32), (28, 36), (16, 16)):  # 2x8, 7x9, 4x4 grids.
    target = _init(model, (1, h, w, 3))
    grid = models.patch_grid(model, (h, w, 3))
    assert grid == (h // 4, w // 4)
    new = checkpoint.load_pretrained(params, target, grid=grid,
                                     keep_head=True)
    pe = new['Transformer']['posembed_input']['pos_embedding']
    np.testing.assert_array_equal(pe[:, 0], old_pe[:, 0])
    ref = tf.compat.v1.image.resize_bilinear(
        old_pe[None, 0, 1:].reshape(1, 7, 7, 32), grid,
        align_corners=True).numpy()[0]
    np.testing.assert_allclose(pe[0, 1:].reshape(*grid, 32), ref, atol=1e-5)
  # The same row count: 4x4 + cls resized to 2x8 + cls, not copied.
  small = _init(model, (1, 16, 16, 3))
  target = _init(model, (1, 8, 32, 3))
  new = checkpoint.load_pretrained(small, target, keep_head=True,
                                   grid=models.patch_grid(model, (8, 32)))
  old4 = np.asarray(small['Transformer']['posembed_input']['pos_embedding'])
  ref = tf.compat.v1.image.resize_bilinear(
      old4[None, 0, 1:].reshape(1, 4, 4, 32), (2, 8),
      align_corners=True).numpy()[0]
  np.testing.assert_allclose(new['Transformer']['posembed_input'][
      'pos_embedding'][0, 1:].reshape(2, 8, 32), ref, atol=1e-5)
  # 225 rows with a class token: a 14x16 grid, not 15x15 without one.
  pe = np.random.RandomState(0).normal(size=(1, 197, 8)).astype(np.float32)
  new = checkpoint.resize_posemb(pe, (1, 225, 8), (14, 16), tokens=(1, 1))
  np.testing.assert_array_equal(new[:, 0], pe[:, 0])
  with pytest.raises(CheckpointError, match=r'not square; pass grid'):
    checkpoint.resize_posemb(pe, (1, 225, 8), tokens=(1, 1))


def test_resize_posemb_from_a_recorded_grid():
  """A checkpoint's recorded grid decides how its rows are read: 7x9 into
  9x7 is resized (not copied, which would transpose it), 4x16 into 8x8
  resized (not read as 8x8), and a grid that does not fit the rows is an
  error."""
  rng = np.random.RandomState(0)
  pe = rng.normal(size=(1, 1 + 63, 8)).astype(np.float32)
  new = checkpoint.resize_posemb(pe, (1, 64, 8), (9, 7), tokens=(1, 1),
                                 source_grid=(7, 9))
  ref = tf.compat.v1.image.resize_bilinear(
      pe[:, 1:].reshape(1, 7, 9, 8), (9, 7), align_corners=True).numpy()[0]
  np.testing.assert_allclose(new[0, 1:].reshape(9, 7, 8), ref, atol=1e-5)
  np.testing.assert_array_equal(new[:, 0], pe[:, 0])
  # Without the record the counts decide (the documented old guess).
  np.testing.assert_array_equal(
      checkpoint.resize_posemb(pe, (1, 64, 8), (9, 7), tokens=(1, 1)), pe)
  pe = rng.normal(size=(1, 64, 8)).astype(np.float32)
  new = checkpoint.resize_posemb(pe, (1, 64, 8), (8, 8), tokens=(0, 0),
                                 source_grid=(4, 16))
  ref = tf.compat.v1.image.resize_bilinear(
      pe.reshape(1, 4, 16, 8), (8, 8), align_corners=True).numpy()[0]
  np.testing.assert_allclose(new[0].reshape(8, 8, 8), ref, atol=1e-5)
  np.testing.assert_array_equal(checkpoint.resize_posemb(
      pe, (1, 64, 8), (4, 16), tokens=(0, 0), source_grid=(4, 16)), pe)
  with pytest.raises(CheckpointError, match=r'not its recorded grid \(5, 5\)'):
    checkpoint.resize_posemb(pe, (1, 64, 8), (8, 8), tokens=(0, 0),
                             source_grid=(5, 5))


def test_load_pretrained_keep_head(vit):
  _, params = vit
  target = models.create('ViT-test', num_classes=5, representation_size=16)
  new = checkpoint.load_pretrained(params, _init(target, (1, 28, 28, 3)),
                                   keep_head=True)
  _assert_trees_equal(new, params)


def test_load_pretrained_keep_head_refuses_a_new_pre_logits_layer():
  """A fine-tuned checkpoint without pre_logits into a model with one of the
  same width: the shapes fit, but the kept head would read a new random
  layer's outputs (other logits), so it is refused."""
  source = models.create('ViT-test', num_classes=5)
  params = perturb(_init(source, (1, 28, 28, 3)))
  target = models.create('ViT-test', num_classes=5, representation_size=32)
  init = _init(target, (1, 28, 28, 3))
  with pytest.raises(CheckpointError, match=r'no pre_logits layer, the target '
                     r'model has one .*without representation_size.*'
                     r'keep_head=False'):
    checkpoint.load_pretrained(params, init, keep_head=True)
  # A new head (fine-tuning) starts with the fresh pre_logits, as before.
  new = checkpoint.load_pretrained(params, init)
  _assert_trees_equal(new['pre_logits'], init['pre_logits'])


def test_load_pretrained_takes_the_targets_dtypes(tmp_path, vit):
  """A float32 .npz starting a bfloat16-parameter model gives bfloat16
  parameters everywhere (not float32 weights beside a bfloat16 head)."""
  _, params = vit
  path = str(tmp_path / 'pre.npz')
  checkpoint.save_npz(params, path)
  target = models.create('ViT-test', num_classes=3, param_dtype=jnp.bfloat16)
  init = _init(target, (1, 28, 28, 3))
  new = checkpoint.load_pretrained(path, init)
  assert {v.dtype for v in _flat(new).values()} == {jnp.dtype(jnp.bfloat16)}
  blk = 'Transformer/encoderblock_1/MlpBlock_0/Dense_0/kernel'
  np.testing.assert_array_equal(
      _flat(new)[blk], _flat(params)[blk].astype(jnp.bfloat16))


def test_load_pretrained_names_shape_mismatch(vit):
  _, params = vit
  target = models.create('ViT-test', num_classes=3, mlp_dim=48)
  with pytest.raises(CheckpointError, match=r'shape mismatch for Transformer/'
                     r'encoderblock_0/MlpBlock_0/Dense_0/kernel: expected '
                     r'\(32, 48\), found \(32, 64\)'):
    checkpoint.load_pretrained(params, _init(target, (1, 28, 28, 3)))


def test_load_pretrained_names_missing_key(vit):
  _, params = vit
  params = dict(params)
  del params['embedding']
  target = models.create('ViT-test', num_classes=3)
  with pytest.raises(CheckpointError,
                     match=r'missing key embedding/kernel \(expected shape '
                     r'\(4, 4, 3, 32\)\)'):
    checkpoint.load_pretrained(params, _init(target, (1, 28, 28, 3)))


@pytest.mark.parametrize('prefix,others', [
    ('params/', {}),  # Our layout under a training prefix.
    ('opt/target/', {'opt/state/step': np.int64(7)}),  # Flax optimizer.
])
def test_training_checkpoints_load_without_their_prefix(tmp_path, vit, caplog,
                                                        prefix, others):
  """The model's arrays under a training checkpoint's prefix load as the
  model; the optimizer's state beside them is dropped."""
  model, params = vit
  path = str(tmp_path / 'train.npz')
  _write_flat(path, {**{prefix + k: v for k, v in _flat(params).items()},
                     **others})
  with caplog.at_level('INFO'):
    _assert_trees_equal(checkpoint.load_npz(path), params)
  assert f'loading its {prefix}* arrays' in caplog.text
  new = checkpoint.load_pretrained(path, _init(model, (1, 28, 28, 3)),
                                   keep_head=True)
  _assert_trees_equal(new, params)


def test_mismatch_error_shows_missing_and_unexpected_keys(tmp_path, vit):
  """Every key under an unknown prefix: the error shows the unexpected keys
  (the cause) beside the missing ones, not 20 missing keys alone."""
  model, params = vit
  path = str(tmp_path / 'odd.npz')
  _write_flat(path, {'model/' + k: v for k, v in _flat(params).items()})
  with pytest.raises(CheckpointError) as e:
    checkpoint.load_pretrained(path, _init(model, (1, 28, 28, 3)))
  text = str(e.value)
  assert 'missing key Transformer/' in text
  assert 'unexpected key model/Transformer/' in text
  assert re.search(r'\.\.\. and \d+ more missing', text)
  assert re.search(r'\.\.\. and \d+ more unexpected', text)


def test_npz_on_an_object_store(tmp_path, vit, monkeypatch):
  """`config.init=gs://.../ViT-B_16.npz` (how the public checkpoints are
  published): read through etils' epath, as gs:// is on a TPU VM."""
  from etils import epath
  from vit_jax.checkpoint import npz
  _, params = vit
  checkpoint.save_npz(params, str(tmp_path / 'ckpt.npz'))

  real = epath.Path

  def store(path):  # gs://bucket/... -> tmp_path/...
    return real(str(path).replace('gs://bucket', str(tmp_path)))
  monkeypatch.setattr(npz.epath, 'Path', store)
  _assert_trees_equal(checkpoint.load_npz('gs://bucket/ckpt.npz'), params)
  with pytest.raises(FileNotFoundError, match='not found: gs://bucket/no'):
    checkpoint.load_npz('gs://bucket/no.npz')


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match='checkpoint not found'):
    checkpoint.load_npz(str(tmp_path / 'nope.npz'))


def test_truncated_file(tmp_path, vit):
  _, params = vit
  path = str(tmp_path / 'ckpt.npz')
  checkpoint.save_npz(params, path)
  data = open(path, 'rb').read()
  with open(path, 'wb') as f:
    f.write(data[:len(data) // 2])
  with pytest.raises(CheckpointError, match='truncated or corrupt'):
    checkpoint.load_npz(path)


def test_corrupt_member(tmp_path, vit):
  _, params = vit
  path = str(tmp_path / 'ckpt.npz')
  with zipfile.ZipFile(path, 'w', compression=zipfile.ZIP_DEFLATED) as z:
    z.writestr('cls.npy', b'\x93NUMPY garbage that is not an array header')
  with pytest.raises(CheckpointError, match=r"ckpt.npz.*'cls'"):
    checkpoint.load_npz(path)


def test_not_an_npz(tmp_path):
  path = str(tmp_path / 'weights.npz')
  with open(path, 'w') as f:
    f.write('this is text, not a checkpoint')
  with pytest.raises(CheckpointError, match='not an .npz checkpoint') as e:
    checkpoint.load_npz(path)
  assert 'not a zip archive' in str(e.value)
  assert 'allow_pickle' not in str(e.value)  # No hint to load it unsafely.


def test_pickled_arrays_refused(tmp_path):
  path = str(tmp_path / 'evil.npz')
  np.savez(path, cls=np.array([{'a': 1}], dtype=object))
  with pytest.raises(CheckpointError, match='allow_pickle=False'):
    checkpoint.load_npz(path)


def test_save_is_atomic(tmp_path, vit, monkeypatch):
  _, params = vit
  path = str(tmp_path / 'ckpt.npz')
  checkpoint.save_npz(params, path)
  before = open(path, 'rb').read()

  def boom(*a, **k):
    raise OSError('disk full')
  monkeypatch.setattr(np, 'savez', boom)
  with pytest.raises(OSError, match='disk full'):
    checkpoint.save_npz(params, path)
  assert open(path, 'rb').read() == before
  assert os.listdir(tmp_path) == ['ckpt.npz']


def test_layouts_convert_both_ways(tmp_path, vit):
  model, params = vit
  scanned = models.create('ViT-test', num_classes=5, representation_size=16,
                          scan_layers=True)
  init = _init(scanned, (1, 28, 28, 3))
  path = str(tmp_path / 'unrolled.npz')
  checkpoint.save_npz(params, path)
  new = checkpoint.load_pretrained(path, init, keep_head=True)
  x = _images((2, 28, 28, 3))
  np.testing.assert_allclose(scanned.apply({'params': new}, x),
                             model.apply({'params': params}, x), atol=1e-5)
  _assert_trees_equal(checkpoint.unstack_blocks(new), params)


def _as_big_transfer(params) -> dict:
  """Our BiT params under the public BiT files' names (big_transfer's
  `resnet/...` layout, as timm's `resnetv2._load_weights` reads it)."""
  parts = {'gn1': 'a/group_norm', 'conv1': 'a/standardized_conv2d',
           'conv_proj': 'a/proj/standardized_conv2d', 'gn2': 'b/group_norm',
           'conv2': 'b/standardized_conv2d', 'gn3': 'c/group_norm',
           'conv3': 'c/standardized_conv2d'}
  leaves = {'scale': 'gamma', 'bias': 'beta', 'kernel': 'kernel'}
  out = {}
  for key, value in _flat(params).items():
    *path, leaf = key.split('/')
    if path == ['conv_root']:
      name = 'root_block/standardized_conv2d/kernel'
    elif path == ['norm_pre_head']:
      name = f'group_norm/{leaves[leaf]}'
    elif path == ['head']:
      name = f'head/conv2d/{leaf}'
      value = value.reshape(1, 1, *value.shape) if leaf == 'kernel' else value
    else:
      block, unit, part = path
      name = (f'{block}/unit{int(unit[4:]):02d}/{parts[part]}/'
              f'{leaves[leaf]}')
    out[f'resnet/{name}'] = value
  return out


def test_public_bit_files_load(tmp_path):
  """A file in the public BiT layout (`BiT-M-R101x1.npz`: unit01 ... unit23,
  a/b/c parts, a 1x1 conv head) loads as our BiT's params. The model itself
  matches timm's `resnetv2_50x1_bit` through such a file:
  `test_bit_matches_timm` (where timm is installed)."""
  model = models.create('BiT-R101x1', num_classes=7)
  shapes = jax.eval_shape(lambda: _init(model, (1, 32, 32, 3)))
  rng = np.random.RandomState(0)
  params = jax.tree.map(
      lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)
  public = _as_big_transfer(params)
  assert 'resnet/block3/unit23/c/standardized_conv2d/kernel' in public
  np.savez(tmp_path / 'BiT-M-R101x1.npz', **public)
  _assert_trees_equal(checkpoint.load_npz(str(tmp_path / 'BiT-M-R101x1.npz')),
                      params)
  public['resnet/block1/unit01/d/group_norm/gamma'] = np.zeros(4)
  np.savez(tmp_path / 'odd.npz', **public)
  with pytest.raises(CheckpointError, match='unit01/d/group_norm/gamma.*is '
                     'not a parameter of a BiT checkpoint'):
    checkpoint.load_npz(str(tmp_path / 'odd.npz'))


def test_bit_matches_timm(tmp_path):
  """Our BiT-R50x1 computes timm's `resnetv2_50x1_bit` (an independent
  implementation of big_transfer's model): its weights written in the BiT
  file layout, read back by timm's own loader and by ours."""
  timm = pytest.importorskip('timm')
  torch = pytest.importorskip('torch')
  from timm.models.resnetv2 import _load_weights
  torch.manual_seed(0)
  ref = timm.create_model('resnetv2_50x1_bit', pretrained=False,
                          num_classes=10).eval()
  with torch.no_grad():  # Non-trivial norms and head.
    for name, p in ref.named_parameters():
      if 'norm' in name or 'head' in name:
        p.copy_(torch.randn_like(p) * 0.5 + float(
            'norm' in name and name.endswith('weight')))
  model = models.create('BiT-R50x1', num_classes=10)
  shapes = jax.eval_shape(lambda: _init(model, (1, 32, 32, 3)))
  # timm's parameters in order of its loader = ours under the BiT names.
  hwio = lambda w: w.detach().numpy().transpose(2, 3, 1, 0)
  public = {'resnet/root_block/standardized_conv2d/kernel':
                hwio(ref.stem.conv.weight),
            'resnet/group_norm/gamma': ref.norm.weight.detach().numpy(),
            'resnet/group_norm/beta': ref.norm.bias.detach().numpy(),
            'resnet/head/conv2d/kernel': hwio(ref.head.fc.weight),
            'resnet/head/conv2d/bias': ref.head.fc.bias.detach().numpy()}
  for i, stage in enumerate(ref.stages):
    for j, b in enumerate(stage.blocks):
      q = f'resnet/block{i + 1}/unit{j + 1:02d}/'
      for part, conv, norm in (('a', b.conv1, b.norm1),
                               ('b', b.conv2, b.norm2),
                               ('c', b.conv3, b.norm3)):
        public[f'{q}{part}/standardized_conv2d/kernel'] = hwio(conv.weight)
        public[f'{q}{part}/group_norm/gamma'] = norm.weight.detach().numpy()
        public[f'{q}{part}/group_norm/beta'] = norm.bias.detach().numpy()
      if b.downsample is not None:
        public[f'{q}a/proj/standardized_conv2d/kernel'] = hwio(
            b.downsample.conv.weight)
  path = str(tmp_path / 'BiT-M-R50x1.npz')
  np.savez(path, **public)
  again = timm.create_model('resnetv2_50x1_bit', pretrained=False,
                            num_classes=10).eval()
  with torch.no_grad():
    _load_weights(again, path)  # The file is in timm's (BiT's) layout.
  x = np.asarray(_images((2, 128, 128, 3)))
  with torch.no_grad():
    want = ref(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()
    np.testing.assert_allclose(
        again(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy(), want)
  params = checkpoint.load_npz(path)
  checkpoint.check_params(shapes, params)
  got = np.asarray(model.apply({'params': params}, x))
  np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max() * 10)
