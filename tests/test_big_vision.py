"""big_vision's ViT checkpoints load into our ViTs and compute the same
logits.

The reference below is a small flax model written the way big_vision's
`models/vit.py` computes (position embeddings, learned or 2-D sine-cosine,
added to the patch tokens before the class token; linen module names; MAP
heads aside); its parameters, saved as big_vision saves them (flat `.npz`,
keys joined by `/`), are loaded by `vit_jax.checkpoint` into
`models.create('ViT-test', ...)`.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from conftest import perturb
from vit_jax import checkpoint, models, trained
from vit_jax.checkpoint import CheckpointError
from vit_jax.models import vit

WIDTH, MLP, HEADS, LAYERS, PATCH = 32, 64, 2, 2, 4  # ViT-test's dimensions.


def _reference_sincos(h, w, width, temperature=10_000.):
  """big_vision's formula, in float32 jnp as it computes it."""
  y, x = jnp.mgrid[:h, :w]
  omega = jnp.arange(width // 4) / (width // 4 - 1)
  omega = 1. / (temperature**omega)
  y = jnp.einsum('m,d->md', y.flatten(), omega)
  x = jnp.einsum('m,d->md', x.flatten(), omega)
  return jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)],
                         axis=1)[None]


class _Mlp(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(MLP)(x))  # Dense_0
    return nn.Dense(WIDTH)(x)  # Dense_1


class _Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    y = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(y, y)
    return x + _Mlp(name='MlpBlock_0')(nn.LayerNorm()(x))


class _Encoder(nn.Module):

  @nn.compact
  def __call__(self, x):
    for i in range(LAYERS):
      x = _Block(name=f'encoderblock_{i}')(x)
    return nn.LayerNorm(name='encoder_norm')(x)


class _MAPHead(nn.Module):

  @nn.compact
  def __call__(self, x):
    probe = self.param('probe', nn.initializers.normal(0.5), (1, 1, WIDTH))
    x = nn.MultiHeadDotProductAttention(num_heads=HEADS)(
        jnp.tile(probe, (x.shape[0], 1, 1)), x)
    y = nn.LayerNorm()(x)
    return (x + _Mlp(name='MlpBlock_0')(y))[:, 0]


class _BigVisionViT(nn.Module):
  pool_type: str  # 'tok', 'gap' or 'map'
  posemb: str  # 'learn' or 'sincos2d'
  num_classes: int = 5

  @nn.compact
  def __call__(self, image):
    x = nn.Conv(WIDTH, (PATCH, PATCH), strides=(PATCH, PATCH),
                padding='VALID', name='embedding')(image)
    n, h, w, c = x.shape
    x = jnp.reshape(x, (n, h * w, c))
    if self.posemb == 'learn':
      x = x + self.param('pos_embedding', nn.initializers.normal(0.5),
                         (1, h * w, c))
    else:
      x = x + _reference_sincos(h, w, c)
    if self.pool_type == 'tok':
      cls = self.param('cls', nn.initializers.normal(0.5), (1, 1, c))
      x = jnp.concatenate([jnp.tile(cls, (n, 1, 1)), x], axis=1)
    x = _Encoder(name='Transformer')(x)
    if self.pool_type == 'map':
      x = _MAPHead(name='MAPHead_0')(x)
    else:
      x = x[:, 0] if self.pool_type == 'tok' else jnp.mean(x, axis=1)
    return nn.Dense(self.num_classes, name='head')(x)


def _images(size, seed=0):
  return jnp.asarray(np.random.RandomState(seed).uniform(
      -1, 1, (2, size, size, 3)), jnp.float32)


def _big_vision_file(tmp_path, pool_type, posemb, prefix='', name='bv'):
  ref = _BigVisionViT(pool_type, posemb)
  params = ref.init(jax.random.key(1), _images(28))['params']
  flat = {prefix + '/'.join(k): np.asarray(v)
          for k, v in traverse_util.flatten_dict(params).items()}
  path = str(tmp_path / f'{name}.npz')
  np.savez(path, **flat)
  return path, ref, params


def _ours(pool_type, posemb, size=28):
  model = models.create('ViT-test', num_classes=5, posemb=posemb,
                        classifier={'tok': 'token'}.get(pool_type, pool_type))
  init = model.init(jax.random.key(0), _images(size))['params']
  return model, init


def _assert_same_logits(path, pool_type, posemb, ref, ref_params, seed,
                        size=28):
  """The file at `path`, loaded into our model (its head kept), computes
  the reference's logits on `size`-pixel images."""
  model, init = _ours(pool_type, posemb, size)
  params = checkpoint.load_pretrained(path, init, keep_head=True)
  images = _images(size, seed=seed)
  want = ref.apply({'params': ref_params}, images)
  assert float(jnp.std(want)) > 0.1  # Not a degenerate comparison.
  np.testing.assert_allclose(model.apply({'params': params}, images), want,
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('pool_type,posemb', [
    ('tok', 'learn'), ('gap', 'learn'), ('gap', 'sincos2d'),
    ('tok', 'sincos2d'), ('map', 'learn')])
def test_big_vision_vits_load_with_the_same_logits(tmp_path, pool_type,
                                                    posemb):
  path, ref, ref_params = _big_vision_file(tmp_path, pool_type, posemb)
  _assert_same_logits(path, pool_type, posemb, ref, ref_params, seed=2)


def test_a_sincos2d_model_runs_at_another_resolution_without_a_resize(
    tmp_path):
  path, ref, ref_params = _big_vision_file(tmp_path, 'gap', 'sincos2d')
  # A 9x9 grid, not the file's 7x7.
  _assert_same_logits(path, 'gap', 'sincos2d', ref, ref_params, seed=3,
                      size=36)


def test_sincos2d_values():
  np.testing.assert_allclose(vit.sincos2d((3, 5), 16),
                             _reference_sincos(3, 5, 16)[0], atol=1e-6)
  with pytest.raises(ValueError, match='divisible by 4'):
    vit.sincos2d((2, 2), 30)


def test_big_vision_training_checkpoints_and_the_predict_loader(tmp_path):
  """`params/`-prefixed files (its training checkpoints) load; an .npz
  given to `vit_jax.trained` (predict, export, inspect) gets its pooling
  and position embeddings from the file."""
  path, ref, ref_params = _big_vision_file(tmp_path, 'gap', 'sincos2d',
                                           prefix='params/')
  loaded = trained.load(path, model='ViT-test', image_size=28)
  assert loaded.options == {'classifier': 'gap', 'posemb': 'sincos2d'}
  model = models.create('ViT-test', num_classes=5, **loaded.options)
  images = _images(28, seed=4)
  np.testing.assert_allclose(
      model.apply({'params': loaded.params}, images),
      ref.apply({'params': ref_params}, images), rtol=1e-5, atol=1e-5)


def test_older_big_vision_files_with_the_encoders_position_embeddings(
    tmp_path):
  """`Transformer/pos_embedding` (its files before 2022): grid rows only
  (added before the class token) or one more (after it, as ours)."""
  path, ref, ref_params = _big_vision_file(tmp_path, 'tok', 'learn')
  flat = dict(np.load(path))
  flat['Transformer/pos_embedding'] = flat.pop('pos_embedding')  # 49 rows
  np.savez(path, **flat)
  _assert_same_logits(path, 'tok', 'learn', ref, ref_params, seed=5)

  # 50 rows: the class token's included, taken as they are.
  posemb = np.random.RandomState(0).normal(size=(1, 50, WIDTH))
  flat['Transformer/pos_embedding'] = posemb.astype(np.float32)
  np.savez(path, **flat)
  got = checkpoint.load_npz(path)['Transformer']['posembed_input']
  np.testing.assert_array_equal(got['pos_embedding'], flat[
      'Transformer/pos_embedding'])


def test_scanned_big_vision_files_load(tmp_path):
  """big_vision's `scan=True` layout: `Transformer/encoderblock/...` with a
  leading layer axis."""
  path, ref, ref_params = _big_vision_file(tmp_path, 'gap', 'learn')
  tree = traverse_util.unflatten_dict(
      {tuple(k.split('/')): v for k, v in np.load(path).items()})
  flat = {'/'.join(k): v for k, v in traverse_util.flatten_dict(
      checkpoint.stack_blocks(tree)).items()}
  assert 'Transformer/encoderblock/LayerNorm_0/scale' in flat
  np.savez(path, **flat)
  _assert_same_logits(path, 'gap', 'learn', ref, ref_params, seed=6)


def test_what_does_not_load_says_why(tmp_path):
  path, _, _ = _big_vision_file(tmp_path, 'gap', 'sincos2d')
  _, learned = _ours('gap', 'learn')
  with pytest.raises(CheckpointError, match="posemb='sincos2d'"):
    checkpoint.load_pretrained(path, learned)

  path, _, _ = _big_vision_file(tmp_path, 'gap', 'learn', name='learned')
  _, fixed = _ours('gap', 'sincos2d')
  with pytest.raises(CheckpointError, match="posemb='learn'"):
    checkpoint.load_pretrained(path, fixed)



def test_a_new_sincos2d_model_has_no_position_parameter_and_trains():
  """A fresh posemb='sincos2d' model has no position parameter and trains
  (its gradients reach every parameter)."""
  model, params = _ours('tok', 'sincos2d')
  assert 'posembed_input' not in params['Transformer']
  labels = jnp.array([1, 3])

  def loss(p):
    logits = model.apply({'params': p}, _images(28))
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(2), labels])

  grads = jax.grad(loss)(perturb(params))
  norms = {'/'.join(k): float(jnp.linalg.norm(v)) for k, v in
           traverse_util.flatten_dict(grads).items()}
  assert all(n > 0 for n in norms.values()), norms


def test_an_image_text_models_image_tower_loads(tmp_path):
  """SigLIP / LiT files hold `img/` and `txt/` towers (and `t`, `b`): the
  image tower loads, into a MAP-head ViT, with the same logits."""
  path, ref, ref_params = _big_vision_file(tmp_path, 'map', 'learn',
                                           prefix='params/img/')
  flat = dict(np.load(path))
  flat['params/txt/Encoder_0/encoder_norm/scale'] = np.ones(8, np.float32)
  flat['params/t'] = np.ones(1, np.float32)
  np.savez(path, **flat)
  loaded = trained.load(path, model='ViT-test')
  assert loaded.options == {'classifier': 'map'}
  model = models.create('ViT-test', num_classes=5, classifier='map')
  images = _images(28, seed=7)
  np.testing.assert_allclose(
      model.apply({'params': loaded.params}, images),
      ref.apply({'params': ref_params}, images), rtol=1e-5, atol=1e-5)


def test_a_map_head_is_fresh_or_dropped_as_pre_logits_are(tmp_path):
  """Fine-tuning a MAP checkpoint as a gap model drops its MAP head; a gap
  checkpoint starts a MAP model's fresh one; a kept head behind a fresh
  MAP head is refused."""
  path, _, _ = _big_vision_file(tmp_path, 'map', 'learn')
  _, gap = _ours('gap', 'learn')
  assert 'MAPHead_0' not in checkpoint.load_pretrained(path, gap)
  path, _, _ = _big_vision_file(tmp_path, 'gap', 'learn', name='gap')
  _, map_init = _ours('map', 'learn')
  params = checkpoint.load_pretrained(path, map_init)
  np.testing.assert_array_equal(params['MAPHead_0']['probe'],
                                map_init['MAPHead_0']['probe'])
  with pytest.raises(CheckpointError, match="no MAPHead_0 layer.*"
                     "classifier='map'"):
    checkpoint.load_pretrained(path, map_init, keep_head=True)


def test_map_head_flops_are_counted():
  from vit_jax import accounting
  spec = models.options('ViT-S/16', classifier='map')
  xla = accounting.module_forward_flops(
      models.create('ViT-S/16', num_classes=1000, classifier='map'),
      (224, 224, 3))
  analytic = vit.vit_flops(spec, 224, 224, 1000)
  gap = vit.vit_flops(models.options('ViT-S/16', classifier='gap'), 224,
                      224, 1000)
  assert 0.98 < analytic / xla < 1.02 and analytic > gap
