"""`vit_jax.inspect`: attention, rollout, distances, similarities, filters and
the CLI that draws the paper's analysis figures from a checkpoint."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import perturb
from vit_jax import checkpoint, inspect as vi, models
from vit_jax.checkpoint import stack_blocks
from vit_jax.inspect import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _images(n=2, size=28, c=3, seed=0):
  return np.random.RandomState(seed).uniform(-1, 1, (n, size, size, c)).astype(
      np.float32)


def _model_and_params(name='ViT-Ti/16', size=32, **overrides):
  model = models.create(name, num_classes=5, **overrides)
  x = _images(2, size)
  params = perturb(model.init(jax.random.key(0), jnp.asarray(x))['params'],
                   scale=0.2)
  return model, params, x


def test_attention_weights_equal_hugging_face_eager_attention(tmp_path):
  """A Hugging Face ViT saved with save_pretrained, opened as `hf:DIR` (the
  zoo model found from its config): our weights equal transformers' eager
  attention probabilities."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  from vit_jax import trained
  torch.manual_seed(0)
  cfg = checkpoint.hf_config('ViT-test', num_classes=5, image_size=28)
  cfg.initializer_range = 0.3  # Far from uniform attention.
  cfg._attn_implementation = 'eager'
  hf = transformers.ViTForImageClassification(cfg).eval()
  hf.save_pretrained(tmp_path / 'hf')
  t = trained.load(f'hf:{tmp_path / "hf"}')
  assert (t.name, t.kind, t.image_size, t.num_classes) == ('ViT-test', 'hf',
                                                           28, 5)
  x = _images(3, 28)
  ours = vi.attention_weights(t.model(), t.params, x)
  assert ours.shape == (2, 3, 2, 50, 50) and ours.dtype == np.float32
  with torch.no_grad():
    out = hf(pixel_values=torch.from_numpy(x.transpose(0, 3, 1, 2)),
             output_attentions=True)
  theirs = np.stack([a.numpy() for a in out.attentions])
  assert ours.std() > 0.01  # Not uniform: the comparison means something.
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_attention_weights_of_scanned_model_equal_unrolled():
  model, params, x = _model_and_params('ViT-test', 28)
  scanned = model.clone(scan_layers=True)
  a = vi.attention_weights(model, params, x)
  b = vi.attention_weights(scanned, stack_blocks(params), x)
  np.testing.assert_allclose(a, b, atol=1e-6)
  np.testing.assert_allclose(a.sum(-1), 1, atol=1e-5)


def test_explicit_attention_equals_the_fused_default():
  """The train/eval path (jax.nn.dot_product_attention) computes what the
  explicit softmax path does, fp32 and bf16."""
  model, params, x = _model_and_params('ViT-test', 28)
  for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 0.05)):
    fused = model.clone(dtype=dtype)
    explicit = fused.clone(attention_impl='explicit')
    assert fused.attention_impl == 'xla'
    a = fused.apply({'params': params}, x)
    b = explicit.apply({'params': params}, x)
    np.testing.assert_allclose(a, b, atol=tol * float(np.abs(b).max()))


def test_explicit_attention_keeps_float32_logits_and_softmax_in_bf16():
  """Logits of tens (a trained model's) in bf16 step by 0.125: the explicit
  path (inspection, attention dropout, ONNX) must take them and the
  softmax in float32 as the fused path does, not lose 2x its accuracy."""
  from vit_jax.models import attention
  rng = np.random.RandomState(0)
  b, l, n, h = 2, 50, 3, 64
  q, k, v = (jnp.asarray(rng.normal(size=(b, l, n, h)) * s, jnp.bfloat16)
             for s in (1.5, 1.5, 1.0))
  qf, kf, vf = (np.asarray(t, np.float64) for t in (q, k, v))
  logits = np.einsum('bqnd,bknd->bnqk', qf, kf) / np.sqrt(h)
  assert np.abs(logits).max() > 8
  p = np.exp(logits - logits.max(-1, keepdims=True))
  ref = np.einsum('bnqk,bknd->bqnd', p / p.sum(-1, keepdims=True), vf)
  err = {impl: np.abs(np.asarray(attention.attention_fn(impl)(
      q, k, v, deterministic=True, dtype=jnp.bfloat16), np.float64)
                      - ref).max() for impl in ('xla', 'explicit')}
  assert err['explicit'] <= 1.1 * err['xla'], err


def test_the_default_forward_sows_no_attention_weights():
  """Training and evaluation never pay for inspection: only a model cloned
  with capture_attention records weights."""
  model, params, x = _model_and_params('ViT-test', 28)
  _, state = model.apply({'params': params}, x, train=False,
                         mutable=['intermediates'])
  assert list(state['intermediates']) == ['representation']


def test_models_resolve_auto_attention_from_the_platform_not_the_host():
  cfg = dict(name='ViT-test', dtype='bfloat16')
  assert models.from_config(cfg, 10, 'gpu').attention_impl == 'cudnn'
  assert models.from_config(cfg, 10, 'tpu').attention_impl == 'xla'
  assert models.from_config(dict(name='ViT-test'), 10,
                            'gpu').attention_impl == 'xla'  # fp32.
  with pytest.raises(ValueError, match='attention_impl'):
    models.from_config(dict(cfg, attention_impl='flash'), 10, 'cpu')


def test_rollout_and_distance_of_identity_attention():
  t, grid = 1 + 9, (3, 3)
  w = np.broadcast_to(np.eye(t), (4, 2, 3, t, t))
  np.testing.assert_allclose(vi.attention_rollout(w)[0], np.eye(t), atol=1e-6)
  np.testing.assert_allclose(vi.mean_attention_distance(w, grid, 16), 0,
                             atol=1e-9)


def test_distance_of_uniform_attention_is_the_mean_pairwise_distance():
  # 2x2 grid, 16 px patches: from any patch, keys at 0, 16, 16, 16*sqrt(2).
  t = 1 + 4
  w = np.full((2, 3, 4, t, t), 1.0 / t)
  w[..., 0] = 0.7  # Class-token keys are dropped and rows renormalised.
  d = vi.mean_attention_distance(w, (2, 2), 16)
  assert d.shape == (2, 4)
  np.testing.assert_allclose(d, (16 + 16 + 16 * np.sqrt(2)) / 4, rtol=1e-6)
  # Larger grids against a direct double loop over patch centres.
  centres = [((i + .5) * 8, (j + .5) * 8) for i in range(3) for j in range(5)]
  direct = np.mean([np.hypot(a[0] - b[0], a[1] - b[1])
                    for a in centres for b in centres])
  w = np.full((1, 1, 1, 15, 15), 1 / 15)
  np.testing.assert_allclose(vi.mean_attention_distance(w, (3, 5), 8), direct,
                             rtol=1e-6)


def test_a_grid_leaving_other_than_0_or_1_leading_tokens_is_refused():
  """25 tokens are a 5x5 grid or 24 patches and a class token: a grid that
  leaves 5 of them as "leading tokens" is a wrong grid, not a model with 5
  class tokens, unless the caller says so."""
  w = np.full((1, 1, 1, 25, 25), 1 / 25)
  with pytest.raises(ValueError, match='leaves 5 of the attention.s 25 '
                     'tokens as leading tokens.*0, or 1 for a class token'):
    vi.mean_attention_distance(w, (4, 5), 4)
  assert vi.mean_attention_distance(w, (4, 5), 4, leading_tokens=5).shape == (
      1, 1)
  # A 5x5 grid would read a class token as a patch: refused when the
  # caller says there is one.
  with pytest.raises(ValueError, match='5x5 patch grid and 1 leading token'):
    vi.mean_attention_distance(w, (5, 5), 4, leading_tokens=1)
  np.testing.assert_allclose(
      vi.mean_attention_distance(w, (4, 6), 4, leading_tokens=1),
      vi.mean_attention_distance(w, (4, 6), 4))
  with pytest.raises(ValueError, match='has only 25'):
    vi.mean_attention_distance(w, (6, 5), 4)


def test_summary_takes_the_grid_from_the_images_and_refuses_another():
  """16x24 images of 4-pixel patches are a 4x6 grid (rows, cols): the
  transposed (6, 4) has the same token count and would give wrong
  distances and maps without any other error."""
  model = models.create('ViT-test', num_classes=5)
  x = np.random.RandomState(1).uniform(-1, 1, (2, 16, 24, 3)).astype(
      np.float32)
  params = perturb(model.init(jax.random.key(0), jnp.asarray(x))['params'],
                   scale=0.2)
  with pytest.raises(ValueError, match=r'16x24-pixel images cut into 4x4-'
                     r'pixel patches make a 4x6 \(rows, cols\) grid; pass '
                     r'\(4, 6\)'):
    vi.attention_summary(model, params, x, (6, 4), 4, class_token_row=True)
  with pytest.raises(ValueError, match="not the model's 4 pixels per token"):
    vi.attention_summary(model, params, x, (4, 6), 8, class_token_row=True)
  with pytest.raises(ValueError, match='need at least one patch'):
    vi.attention_summary(model, params, x[:, :3], class_token_row=True)
  d, maps = vi.attention_summary(model, params, x, class_token_row=True)
  assert maps.shape == (2, 2, 4, 6)
  w = vi.attention_weights(model, params, x)
  np.testing.assert_allclose(d, vi.mean_attention_distance(
      w, (4, 6), 4, leading_tokens=1), rtol=1e-5)
  given = vi.attention_summary(model, params, x, (4, 6), 4,
                               class_token_row=True)
  np.testing.assert_array_equal(given[0], d)


def test_rollout_multiplies_layers_last_on_the_left():
  rng = np.random.RandomState(0)
  w = rng.dirichlet(np.ones(5), size=(3, 1, 2, 5))  # (L, B, H, T, T)
  a = [(w[l, 0].mean(0) + np.eye(5)) / (w[l, 0].mean(0) + np.eye(5)).sum(
      -1, keepdims=True) for l in range(3)]
  expected = a[2] @ a[1] @ a[0]
  np.testing.assert_allclose(vi.attention_rollout(w)[0], expected, rtol=1e-5)
  per_layer = vi.attention_rollout(w, per_layer=True)
  np.testing.assert_allclose(per_layer[1, 0], a[1] @ a[0], rtol=1e-5)
  np.testing.assert_allclose(per_layer[-1], vi.attention_rollout(w))


def test_position_similarity_excludes_the_class_token_and_is_cosine():
  rng = np.random.RandomState(0)
  pe = rng.normal(size=(1, 1 + 12, 8))
  params = {'cls': np.zeros((1, 1, 8)),
            'Transformer': {'posembed_input': {'pos_embedding': pe}}}
  sim = vi.position_similarity(params, (3, 4))
  assert sim.shape == (3, 4, 3, 4)
  p = pe[0, 1:] / np.linalg.norm(pe[0, 1:], axis=1, keepdims=True)
  np.testing.assert_allclose(sim.reshape(12, 12), p @ p.T, rtol=1e-5)
  with pytest.raises(ValueError, match='needs 16'):
    vi.position_similarity(params, (4, 4))


def test_filter_components_are_the_principal_axes_largest_first():
  model, params, _ = _model_and_params('ViT-test', 28)
  comps = vi.embedding_filter_components(params, k=5)
  assert comps.shape == (5, 4, 4, 3)
  flat = comps.reshape(5, -1)
  np.testing.assert_allclose(flat @ flat.T, np.eye(5), atol=1e-5)
  x = np.asarray(params['embedding']['kernel']).reshape(48, -1).T
  x = x - x.mean(0)
  var = ((x @ flat.T) ** 2).sum(0)
  assert np.all(np.diff(var) <= 1e-9)  # Largest variance first.
  top = np.linalg.eigh(x.T @ x)[1][:, -1]  # The top principal axis.
  assert abs(abs(top @ flat[0]) - 1) < 1e-5


def _inspect(*flags):
  cmd = [sys.executable, '-m', 'vit_jax.inspect', *flags]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ, JAX_PLATFORMS='cpu',
                                 PYTHONPATH=ROOT))


def test_cli_writes_every_figure_from_a_smoke_trained_workdir(
    smoke_workdir, tmp_path):
  out = tmp_path / 'figs'
  res = _inspect(f'--init={smoke_workdir}', '--data=digits', '--images=6',
                 '--rollout_images=2', '--layer_images=2', f'--out={out}')
  assert res.returncode == 0, res.stderr[-3000:]
  for name in report.FILES:
    assert (out / name).stat().st_size > 1000, name
  info = json.loads((out / 'inspect.json').read_text())
  assert info['model'] == 'ViT-test' and info['images'] == 6
  assert np.shape(info['attention_distance']['per_layer_per_head']) == (2, 2)
  assert info['image_size'] == info['checkpoint_image_size']
  assert np.shape(info['rollout']['maps']) == (2, *info['grid'])
  assert 'mean attention distance per layer' in res.stdout


@pytest.mark.parametrize('case', ['empty_folder', 'other_model', 'bad_grid',
                                  'unprepared', 'data_file', 'out_file'])
def test_bad_input_is_a_clear_error_before_compiling(case, smoke_workdir,
                                                     tmp_path):
  kw = dict(init=smoke_workdir, data='digits', out=str(tmp_path / 'o'),
            images=2)
  if case == 'empty_folder':
    (tmp_path / 'imgs').mkdir()
    (tmp_path / 'imgs' / 'notes.txt').write_text('no images here')
    kw['data'], error, match = str(tmp_path / 'imgs'), FileNotFoundError, (
        'no images')
  elif case == 'other_model':
    kw['model'], error, match = 'ViT-B/16', ValueError, (
        'is a checkpoint of ViT-test')
  elif case == 'data_file':
    (tmp_path / 'one.png').write_bytes(b'')
    kw['data'], error, match = str(tmp_path / 'one.png'), ValueError, (
        'is a file: pass a folder of images or a dataset name')
  elif case == 'out_file':
    (tmp_path / 'o').write_text('a file, not a folder')
    error, match = ValueError, 'is a file; pass a folder'
  elif case == 'unprepared':  # Named with its prepare command, no download.
    kw['data'], kw['data_dir'] = 'mnist', str(tmp_path / 'tfds')
    error, match = FileNotFoundError, 'vit_jax.data.prepare mnist'
  else:
    kw['image_size'], error, match = 3, ValueError, (
        'images need at least one patch')
  with pytest.raises(error, match=match):
    report.run(**kw)
  assert (tmp_path / 'o').is_file() if case == 'out_file' else not (
      tmp_path / 'o').exists()


@pytest.mark.parametrize('name,options', [
    ('Mixer-S/32', dict(hidden_dim=8, num_blocks=1, tokens_mlp_dim=4,
                        channels_mlp_dim=8)),
    ('BiT-R50x1', dict())])
def test_a_model_without_attention_is_refused_before_loading_images(
    name, options, monkeypatch, tmp_path):
  """BiT and Mixer have nothing to inspect: said right after the checkpoint
  is opened, not after a dataset was downloaded or prepared (here an
  unprepared one, whose error would otherwise come first)."""
  from vit_jax import trained as trained_lib
  model = models.create(name, num_classes=5, **options)
  zeros = jax.tree.map(lambda a: np.zeros(a.shape, np.float32), jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))))
  t = trained_lib._build(name, options, 5, 32, 'resize', zeros['params'],
                         'x.npz', 'npz')  # Shapes only: nothing is run.
  monkeypatch.setattr(trained_lib, 'load', lambda *a, **k: t)
  with pytest.raises(ValueError, match=f'{name} has no self-attention'):
    report.run('x.npz', 'mnist', str(tmp_path / 'o'), model=name, images=2,
               data_dir=str(tmp_path / 'tfds'))
  assert not (tmp_path / 'o').exists()


def test_a_resized_model_reports_its_checkpoints_resolution(tmp_path):
  """inspect.json's checkpoint_image_size and the interpolation flag read
  the resolution of the checkpoint, not of its resized parameters."""
  from vit_jax import trained
  _, params, _ = _model_and_params('ViT-test', 28)
  path = str(tmp_path / 'test.npz')
  checkpoint.save_npz(params, path)
  native = trained.load(path, model='ViT-test')
  assert (native.image_size, native.native_image_size) == (28, 28)
  at_40 = trained.load(path, model='ViT-test', image_size=40)
  assert (at_40.image_size, at_40.native_image_size) == (40, 28)
  again = trained.resized(at_40, 48)
  assert (again.image_size, again.native_image_size) == (48, 28)
  pe = again.params['Transformer']['posembed_input']['pos_embedding']
  assert pe.shape[1] == 1 + 12 * 12
  # 30 px makes the checkpoint's own 7x7 grid (the last 2 pixels unseen, as
  # ViT-H/14 at 384 px): that is its size, nothing interpolated.
  at_30 = trained.load(path, model='ViT-test', image_size=30)
  assert (at_30.image_size, at_30.native_image_size) == (30, 30)


def test_npz_of_another_model_names_the_mismatch(tmp_path):
  from vit_jax import trained
  _, params, _ = _model_and_params('ViT-test', 28)
  path = str(tmp_path / 'test.npz')
  checkpoint.save_npz(params, path)
  with pytest.raises(ValueError, match='pos_embedding|kernel'):
    trained.load(path, model='ViT-Ti/16')
  with pytest.raises(ValueError, match='--model'):
    trained.load(path)


@pytest.mark.slow
def test_cli_on_a_public_layout_vit_b16_npz_at_another_resolution(tmp_path):
  """ViT-B/16 in the public checkpoints' layout (random weights: nothing can
  be downloaded here), inspected at 160 px: position embeddings are
  interpolated from the 14x14 grid to 10x10."""
  model = models.create('ViT-B/16', num_classes=1000, representation_size=768)
  shapes = jax.eval_shape(lambda: model.init(
      jax.random.key(0), jnp.zeros((1, 224, 224, 3))))['params']
  rng = np.random.RandomState(0)
  params = jax.tree.map(
      lambda s: (0.02 * rng.standard_normal(s.shape)).astype(np.float32),
      shapes)
  path = str(tmp_path / 'ViT-B_16.npz')
  checkpoint.save_npz(params, path)
  from skimage import data as photos  # scikit-image's real photos.
  from PIL import Image
  folder = tmp_path / 'photos'
  folder.mkdir()
  for name in ('astronaut', 'coffee', 'chelsea'):
    Image.fromarray(getattr(photos, name)()).save(folder / f'{name}.png')
  (folder / 'broken.jpg').write_bytes(b'not a jpeg')
  out = tmp_path / 'figs'
  res = _inspect(f'--init={path}', '--model=ViT-B/16', f'--data={folder}',
                 '--image_size=160', f'--out={out}')
  assert res.returncode == 0, res.stderr[-3000:]
  assert 'broken.jpg' in res.stderr  # Reported and skipped.
  info = json.loads((out / 'inspect.json').read_text())
  assert info['images'] == 3 and info['grid'] == [10, 10]
  assert info['checkpoint_image_size'] == 224
  assert info['position_embeddings_interpolated']
  assert np.shape(info['attention_distance']['per_layer_per_head']) == (12, 12)
  for name in report.FILES:
    assert (out / name).exists(), name


@pytest.mark.parametrize('name,options,size', [
    ('ViT-test', dict(classifier='gap'), 28),
    pytest.param('R50+ViT-B/16', dict(
        resnet_layers=(1, 1, 1), resnet_width=0.5, hidden_size=32,
        mlp_dim=64, num_heads=2, num_layers=2), 64,
                 marks=pytest.mark.slow),  # ~10 s of ResNet compiles.
])
def test_gap_and_hybrid_models_say_what_they_show(name, options, size,
                                                  tmp_path):
  """gap models: the rollout is the mean of all tokens' rows, and the figure
  says so; hybrids: distances in input pixels (the stem's stride x patch),
  filters.png skipped with its reason."""
  from vit_jax import trained as trained_lib
  model = models.create(name, num_classes=5, **options)
  params = perturb(jax.jit(model.init)(jax.random.key(0), jnp.asarray(
      _images(1, size)))['params'], scale=0.2)
  t = trained_lib._build(name, options, 5, size, trained_lib.NPZ_PP, params,
                         'test', 'npz')
  out = str(tmp_path / 'o')
  info = report.inspect_model(t, _images(3, size), ['a', 'b', 'c'], out,
                              rollout_images=2, layer_images=1)
  grid = info['grid']
  if options.get('classifier') == 'gap':
    assert info['rollout']['method'].startswith('mean over all tokens')
    assert grid == [7, 7] and info['pixels_per_token'] == 4
  else:
    assert info['pixels_per_token'] == 16 and grid == [4, 4]
    assert 'filters.png' in info['skipped']
    assert not os.path.exists(os.path.join(out, 'filters.png'))
    assert info['rollout']['method'] == 'class-token row'
  # Distances in input pixels: bounded by the image's diagonal.
  d = np.asarray(info['attention_distance']['per_layer_per_head'])
  assert 0 < d.min() and d.max() < size * np.sqrt(2)
  assert np.shape(info['rollout']['maps']) == (2, *grid)


def test_a_sincos2d_model_has_no_learned_position_figure(tmp_path):
  """Fixed 2-D sine-cosine position embeddings (big_vision's baselines):
  every attention figure, position_similarity.png skipped with its reason,
  at any image size without an interpolation."""
  from vit_jax import trained as trained_lib
  options = dict(posemb='sincos2d')
  model = models.create('ViT-test', num_classes=5, **options)
  params = perturb(jax.jit(model.init)(jax.random.key(0), jnp.asarray(
      _images(1, 28)))['params'], scale=0.2)
  t = trained_lib._build('ViT-test', options, 5, 36, trained_lib.NPZ_PP,
                         params, 'test', 'npz')
  info = report.inspect_model(t, _images(2, 36), ['a', 'b'],
                              str(tmp_path / 'o'), rollout_images=1,
                              layer_images=1)
  assert 'fixed' in info['skipped']['position_similarity.png']
  # An .npz of one does not record its size: unknown, not the inspected one.
  assert info['grid'] == [9, 9] and info['checkpoint_grid'] is None
  assert info['checkpoint_image_size'] is None
  assert not info['position_embeddings_interpolated']
  assert {'attention_distance.png', 'rollout.png'} <= set(info['files'])


def test_a_sincos2d_npz_needs_its_image_size(tmp_path):
  from vit_jax import trained as trained_lib
  model = models.create('ViT-test', num_classes=5, posemb='sincos2d')
  path = str(tmp_path / 'sincos.npz')
  checkpoint.save_npz(model.init(jax.random.key(0), jnp.asarray(
      _images(1, 28)))['params'], path)
  photos = _photos(tmp_path / 'photos', 2)
  with pytest.raises(trained_lib.ImageSizeUnknown, match='--image_size'):
    report.run(path, str(photos), str(tmp_path / 'o'), model='ViT-test')
  info = report.run(path, str(photos), str(tmp_path / 'o'), model='ViT-test',
                    image_size=28, rollout_images=1, layer_images=1)
  assert info['image_size'] == 28 and info['checkpoint_image_size'] is None


def test_registered_names_with_a_slash_are_datasets_not_folders(tmp_path):
  """vtab/cifar100 reaches the registry (here: not prepared, named with
  its prepare command), not 'no such folder'."""
  from vit_jax.inspect import images as images_lib
  with pytest.raises(Exception, match='vit_jax.data.prepare vtab/cifar100'):
    images_lib.load('vtab/cifar100', 2, _trained(),
                    data_dir=str(tmp_path / 'empty'))
  with pytest.raises(FileNotFoundError, match='no such folder'):
    images_lib.load('no/such/folder', 2, _trained())


def test_seed_without_random_init_is_refused(tmp_path):
  with pytest.raises(ValueError, match='--seed=5 seeds --random_init'):
    report.run('x.npz', str(tmp_path), str(tmp_path / 'o'), seed=5)


def test_large_grids_keep_every_cell_of_the_similarity_mosaic(tmp_path):
  """A 32x32 grid (ViT-L/16 at 512 px): every cell of a mosaic row is
  drawn, none dropped by downsampling."""
  import matplotlib.pyplot as plt
  from PIL import Image
  from vit_jax.inspect import figures
  g = 32
  path = figures.position_similarity(np.zeros((g, g, g, g)),
                                     str(tmp_path / 'p.png'), 'x')
  a = np.asarray(Image.open(path).convert('RGB')).astype(float)
  cell = np.array(plt.get_cmap('viridis')(0.5)[:3]) * 255
  row = (np.abs(a - cell).sum(-1) < 12)
  row = row[row.sum(1).argmax()]
  runs = int(np.sum(row[1:] & ~row[:-1]) + row[0])
  assert runs >= g  # The cells, and the colour bar's band of that colour.


def _reference_summary(w, grid, ppt, token_row):
  """The full-tensor, float64 computation the CLI did before reducing on
  the device: distance (layers, heads), maps (layers, batch, gh, gw)."""
  w = np.asarray(w, np.float64)
  n = grid[0] * grid[1]
  lead = w.shape[-1] - n
  p = w[..., lead:, lead:]
  p = p / p.sum(-1, keepdims=True)
  distance = np.einsum('lbhqk,qk->lbhq', p, vi.pairwise_distances(
      grid, ppt)).mean(axis=(1, 3))
  a = w.mean(axis=2) + np.eye(w.shape[-1])
  a /= a.sum(-1, keepdims=True)
  joint, per_layer = a[0], [a[0]]
  for layer in a[1:]:
    joint = layer @ joint
    per_layer.append(joint)
  per_layer = np.stack(per_layer)
  rows = (per_layer[:, :, 0, lead:] if token_row and lead else
          per_layer[:, :, lead:, lead:].mean(axis=2))
  return distance, rows.reshape(*rows.shape[:2], *grid)


@pytest.mark.parametrize('classifier,scan', [('token', False),
                                             ('gap', False), ('token', True)])
def test_on_device_summary_equals_the_full_tensor_computation(classifier,
                                                               scan):
  """What the CLI reduces per batch on the device (float32, one layer's
  weights at a time, rollout rows instead of T x T products) equals the
  float64 computation from the whole (layers, batch, heads, T, T) tensor,
  and the public full-tensor functions (now float32) agree with it too."""
  model, params, _ = _model_and_params('ViT-test', 28, classifier=classifier)
  x = _images(3, 28, seed=1)
  w = vi.attention_weights(model, params, x)
  assert w.std() > 0.01  # Far from uniform: the comparison means something.
  ref_d, ref_maps = _reference_summary(w, (7, 7), 4, classifier == 'token')
  probe, p = ((model.clone(scan_layers=True), stack_blocks(params)) if scan
              else (model, params))
  d, maps = vi.attention_summary(probe, p, x, (7, 7), 4,
                                 class_token_row=classifier == 'token')
  assert d.shape == (2, 2) and maps.shape == (2, 3, 7, 7)
  assert d.dtype == maps.dtype == np.float32
  np.testing.assert_allclose(d, ref_d, rtol=1e-5)
  np.testing.assert_allclose(maps, ref_maps, rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(vi.mean_attention_distance(w, (7, 7), 4), ref_d,
                             rtol=1e-5)
  rollout = vi.attention_rollout(w, per_layer=True)
  lead = 1 if classifier == 'token' else 0
  rows = (rollout[:, :, 0, lead:] if lead else
          rollout[:, :, :, :].mean(axis=2))
  np.testing.assert_allclose(rows.reshape(maps.shape), ref_maps, rtol=1e-4,
                             atol=1e-7)


def _trained(name='ViT-test', size=28, pp='resize', **options):
  from vit_jax import trained as trained_lib
  model = models.create(name, num_classes=5, **options)
  params = perturb(jax.jit(model.init)(jax.random.key(0), jnp.asarray(
      _images(1, size)))['params'], scale=0.2)
  return trained_lib._build(name, options, 5, size, pp, params, 'runs/x',
                            'npz')


def test_figure_titles_name_the_architecture_inspected(monkeypatch,
                                                       tmp_path):
  """A run's options (here a gap classifier) change the model: each
  figure's title names what was inspected, not only the zoo name."""
  from vit_jax.inspect import figures
  t = _trained(classifier='gap')
  assert t.architecture == 'ViT-test (classifier=gap)'
  titles, save = {}, figures._save

  def saved(fig, path, *dpi):  # The figure's title, or its single axes'.
    texts = [ax.get_title() for ax in fig.axes]
    titles[os.path.basename(path)] = '\n'.join(
        texts + [fig._suptitle.get_text()] if fig._suptitle else texts)
    return save(fig, path, *dpi)
  monkeypatch.setattr(figures, '_save', saved)
  info = report.inspect_model(t, _images(2, 28), ['a', 'b'],
                              str(tmp_path / 'o'), rollout_images=1,
                              layer_images=1)
  assert sorted(titles) == sorted(n for n in report.FILES
                                  if n.endswith('.png'))
  for name, title in titles.items():
    assert 'ViT-test (classifier=gap)' in title, (name, title)
  assert info['architecture'] == 'ViT-test (classifier=gap)'


def test_a_reused_out_keeps_no_stale_figure_and_lists_what_was_written(
    tmp_path, monkeypatch):
  """A run that skips filters.png (as for a hybrid, here without its ResNet
  compiles) removes the filters.png an earlier run left in the same --out
  rather than pass it off as its own; files that are not ours stay.
  inspect.json lists the files written; a failed run leaves the earlier
  results untouched."""
  out = tmp_path / 'o'
  out.mkdir()
  for name in ('filters.png', 'rollout.png', 'notes.txt'):
    (out / name).write_text('an earlier run')
  t, x = _trained(), _images(2, 28)
  with pytest.raises(ValueError, match='--batch=0'):
    report.inspect_model(t, x, ['a', 'b'], str(out), batch=0)
  assert sorted(os.listdir(out)) == ['filters.png', 'notes.txt',
                                     'rollout.png']  # Untouched.

  def no_filters(params):
    raise ValueError('no pixel filters here')
  monkeypatch.setattr(report.analysis, 'embedding_filter_components',
                      no_filters)
  info = report.inspect_model(t, x, ['a', 'b'], str(out), rollout_images=1,
                              layer_images=1)
  assert info['skipped'] == {'filters.png': 'no pixel filters here'}
  written = [n for n in report.FILES if n != 'filters.png']
  assert info['files'] == written
  assert sorted(os.listdir(out)) == sorted(written + ['notes.txt'])
  assert (out / 'notes.txt').read_text() == 'an earlier run'
  assert (out / 'rollout.png').read_bytes()[:4] == b'\x89PNG'
  assert json.loads((out / 'inspect.json').read_text())['files'] == written


@pytest.mark.parametrize('name,patch', [('R50+ViT-B/16', 1),
                                        ('R50+ViT-B/32', 2)])
def test_hybrids_have_no_pixel_filters_whatever_their_patch_size(name, patch):
  options = dict(resnet_layers=(1, 1, 1), resnet_width=0.5, hidden_size=32,
                 mlp_dim=64, num_heads=2, num_layers=2, patch_size=patch)
  model = models.create(name, num_classes=5, **options)
  shapes = jax.eval_shape(lambda: model.init(
      jax.random.key(0), jnp.zeros((1, 64, 64, 3))))['params']
  params = jax.tree.map(lambda s: np.ones(s.shape, np.float32), shapes)
  assert params['embedding']['kernel'].shape[:2] == (patch, patch)
  with pytest.raises(ValueError, match='runs on ResNet features'):
    vi.embedding_filter_components(params)


def test_literal_eval_ops_follow_another_image_size():
  """A run whose input.pp_eval is an op string (and a 1-channel Hugging
  Face model's ops) can be inspected at another size: the op that makes
  the side is rewritten; only ops with nothing to rewrite are refused."""
  from vit_jax import trained as trained_lib
  follow = trained_lib.follow_size
  assert follow(['decode(1)', 'resize(28)', 'value_range(-1,1)'], 28, 56) == [
      'decode(1)', 'resize(56)', 'value_range(-1,1)']
  assert follow(['decode', 'resize_small(256)', 'central_crop(224)'], 224,
                384) == ['decode', 'resize_small(439)', 'central_crop(384)']
  assert follow(["resize(28, 28, method='nearest')"], 28, 40) == [
      "resize(40, 40, method='nearest')"]
  assert follow(['decode', 'resize(30)', 'value_range(-1,1)'], 28, 40) is None
  t = _trained(pp='decode|resize_small(32)|central_crop(28)|value_range(-1,1)')
  at_40 = trained_lib.resized(t, 40)
  assert (at_40.image_size, at_40.pp[1:3]) == (
      40, ['resize_small(46)', 'central_crop(40)'])
  t = _trained(pp='decode|resize(32)|random_crop(28)|value_range(-1,1)')
  with pytest.raises(ValueError, match='makes 28x28 images whatever'):
    trained_lib.resized(t, 40)


def test_a_one_channel_hugging_face_model_at_another_image_size(tmp_path):
  pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  from vit_jax import trained as trained_lib
  cfg = checkpoint.hf_config('ViT-test', num_classes=5, image_size=28,
                             num_channels=1)
  transformers.ViTForImageClassification(cfg).save_pretrained(tmp_path / 'hf')
  t = trained_lib.load(f'hf:{tmp_path / "hf"}', image_size=56)
  assert (t.image_size, t.channels) == (56, 1)
  assert t.pp == ['decode(1)', 'resize(56)', 'value_range(-1,1)']
  pe = t.params['Transformer']['posembed_input']['pos_embedding']
  assert pe.shape[1] == 1 + 14 * 14


@pytest.mark.parametrize('flag,value,match', [
    ('batch', 0, 'pass a whole number'),
    ('rollout_images', 0, 'pass a whole number'),
    ('layer_images', 0, 'pass a whole number'),
    ('images', 0, 'pass a whole number'),
    # 0 was silently the checkpoint's size, -8 a TensorFlow traceback.
    ('image_size', 0, "pass a positive side in pixels, or leave it out for "
     "the checkpoint's"),
    ('image_size', -8, 'pass a positive side in pixels')])
def test_counts_below_one_are_refused_before_loading(flag, value, match,
                                                     tmp_path):
  with pytest.raises(ValueError, match=f'--{flag}={value}: {match}'):
    report.run(str(tmp_path / 'no_such_run'), 'digits', str(tmp_path / 'o'),
               **{flag: value})
  assert not (tmp_path / 'o').exists()


def test_an_out_under_a_file_and_a_tilde_data_folder(tmp_path, monkeypatch):
  """--out below a file fails before loading (not a NotADirectoryError
  after); --data=~/x is expanded as --out is."""
  (tmp_path / 'f').write_text('a file')
  with pytest.raises(ValueError, match=r'f is a file, not a folder'):
    report.run(str(tmp_path / 'no_such_run'), 'digits',
               str(tmp_path / 'f' / 'o'))
  monkeypatch.setenv('HOME', str(tmp_path))
  (tmp_path / 'imgs').mkdir()
  (tmp_path / 'imgs' / 'notes.txt').write_text('no images here')
  from vit_jax.inspect import images as images_lib
  monkeypatch.setattr(images_lib, '_from_dataset', None)  # Never reached.
  t = _trained()
  monkeypatch.setattr('vit_jax.trained.load', lambda *a, **k: t)
  with pytest.raises(FileNotFoundError, match=f'no images .* under '
                     f'{tmp_path / "imgs"}'):
    report.run('x.npz', '~/imgs', str(tmp_path / 'o'), model='ViT-test')


@pytest.mark.parametrize('flag,reason', [
    ('--batch=0', 'pass a whole number'),
    ('--image_size=-8', 'pass a positive side in pixels')])
def test_cli_bad_counts_exit_1_with_the_reason_and_no_traceback(flag, reason,
                                                                tmp_path):
  res = _inspect(f'--init={tmp_path}', '--data=digits', flag,
                 f'--out={tmp_path / "o"}')
  assert res.returncode == 1
  assert f'vit_jax.inspect: {flag}: {reason}' in res.stderr
  assert 'Traceback' not in res.stderr


def _photos(folder, n=3, size=20):
  """`n` random-noise PNG files in `folder` (created)."""
  from PIL import Image
  folder.mkdir(parents=True, exist_ok=True)
  rng = np.random.RandomState(0)
  for i in range(n):
    Image.fromarray(rng.randint(0, 255, (size, size, 3), np.uint8)).save(
        folder / f'im{i}.png')
  return folder


def test_position_similarity_is_of_the_checkpoints_own_embeddings(tmp_path):
  """At twice the checkpoint's size the position embeddings are
  interpolated: i.i.d. random ones then score their neighbours about 0.76,
  measuring the interpolation. The figure and numbers are of the
  checkpoint's own 7x7 embeddings (near 0 here), and --random_init's
  baseline is initialised at the checkpoint's size the same way."""
  model, params, _ = _model_and_params('ViT-test', 28)
  posembed = params['Transformer']['posembed_input']
  posembed['pos_embedding'] = np.random.RandomState(1).normal(
      size=posembed['pos_embedding'].shape).astype(np.float32)
  path = str(tmp_path / 'iid.npz')
  checkpoint.save_npz(params, path)
  photos = _photos(tmp_path / 'photos', 2)
  for random_init in (False, True):
    info = report.run(path, str(photos), str(tmp_path / f'o{random_init}'),
                      model='ViT-test', image_size=56, images=2,
                      rollout_images=1, layer_images=1,
                      random_init=random_init)
    assert info['grid'] == [14, 14] and info['checkpoint_grid'] == [7, 7]
    assert info['position_embeddings_interpolated']
    assert info['checkpoint_image_size'] == 28
    sim = info['position_similarity']
    assert sim['grid'] == [7, 7], random_init
    assert abs(sim['neighbours']) < 0.1, (random_init, sim)
  # The library without the checkpoint's own size: skipped, with the reason.
  from vit_jax import trained as trained_lib
  t = trained_lib.load(path, model='ViT-test', image_size=56)
  out = report.inspect_model(t, _images(1, 56), ['a'], str(tmp_path / 'lib'))
  assert 'interpolated from the checkpoint\'s 7x7 grid to 14x14' in out[
      'skipped']['position_similarity.png']
  assert 'position_similarity' not in out


def test_figures_in_an_out_inside_the_data_folder_are_not_read_back(
    tmp_path, monkeypatch):
  """--data=photos --out=photos/inspect (or --out=photos): the second run
  reads the same 3 photos, not the first run's figures."""
  t = _trained()
  monkeypatch.setattr('vit_jax.trained.load', lambda *a, **k: t)
  for sub in ('inspect', '.'):
    photos = _photos(tmp_path / f'photos{len(sub)}')
    for _ in range(2):
      info = report.run('x.npz', str(photos), str(photos / sub),
                        model='ViT-test', images=20, rollout_images=1,
                        layer_images=1)
      assert info['image_names'] == ['im0.png', 'im1.png', 'im2.png'], sub
  assert report.is_output(str(photos), str(photos / 'rollout.png'))
  assert not report.is_output(str(photos), str(photos / 'im0.png'))
  # The docs' trained-vs-random pair: --out=photos/trained, then
  # --out=photos/random reads neither the photos' sibling figures.
  photos = _photos(tmp_path / 'pair')
  for sub in ('trained', 'random'):
    info = report.run('x.npz', str(photos), str(photos / sub),
                      model='ViT-test', images=20, rollout_images=1,
                      layer_images=1)
    assert info['image_names'] == ['im0.png', 'im1.png', 'im2.png'], sub
  # A figure's name in a folder this command never wrote is an input.
  other = _photos(tmp_path / 'other')
  (other / 'rollout.png').write_bytes((other / 'im0.png').read_bytes())
  assert not report.is_output(str(other / 'o'), str(other / 'rollout.png'))


@pytest.mark.parametrize('flag', ['split', 'data_dir'])
def test_dataset_flags_with_an_image_folder_are_refused_before_loading(
    flag, tmp_path):
  photos = _photos(tmp_path / 'photos', 1)
  with pytest.raises(ValueError, match=f'--{flag}=x apply to dataset names '
                     'only; --data=.* is an image folder'):
    report.run(str(tmp_path / 'no_such_run'), str(photos),
               str(tmp_path / 'o'), **{flag: 'x'})
  assert not (tmp_path / 'o').exists()


def test_upsampled_maps_give_each_patch_its_own_pixels():
  """30 px of 4-pixel patches: 7 patches of exactly 4 pixels, the last 2
  pixels (never seen by the model) NaN; not 5-pixel patches with the
  last one cut off."""
  from vit_jax.inspect import figures
  m = np.tile(np.arange(7.), (7, 1))
  up = figures._upsample(m, 30, 4)
  np.testing.assert_array_equal(up[0, :28], np.repeat(np.arange(7.), 4))
  assert np.isnan(up[:, 28:]).all() and np.isnan(up[28:]).all()
  assert not np.isnan(up[:28, :28]).any()
  np.testing.assert_array_equal(figures._upsample(m, 28, 4)[::4, ::4], m)


def test_a_plain_vit_run_at_a_size_not_a_multiple_of_its_patch(
    smoke_workdir, tmp_path):
  """A run fine-tuned at 18 px with 4-pixel patches (as ViT-H/14 at 384 px:
  27x27 patches, the last 6 pixels unseen) is inspected at its own size by
  default: a 4x4 grid, nothing interpolated, the last 2 pixels left out."""
  import trained_workdir
  workdir = trained_workdir.copy(smoke_workdir, tmp_path)
  cfg_path = os.path.join(workdir, 'config.json')
  with open(cfg_path) as f:
    recorded = json.load(f)
  recorded['config']['input']['image_size'] = 18
  with open(cfg_path, 'w') as f:
    json.dump(recorded, f)
  out = tmp_path / 'o'
  info = report.run(workdir, 'digits', str(out), images=3,
                    rollout_images=1, layer_images=1)
  assert (info['image_size'], info['grid'], info['pixels_per_token']) == (
      18, [4, 4], 4)
  assert info['checkpoint_image_size'] == 18
  assert info['checkpoint_grid'] == [4, 4]
  assert not info['position_embeddings_interpolated']
  assert info['pixels_not_seen'] == 2
  assert (out / 'rollout.png').stat().st_size > 1000


def test_a_hybrid_at_a_size_not_a_multiple_of_its_patch_is_refused():
  """A hybrid's ResNet stem pads rather than leaving pixels out: its
  images must tile exactly (shapes only: nothing is compiled)."""
  from vit_jax import trained as trained_lib
  name = 'R50+ViT-B/16'
  options = dict(resnet_layers=(1, 1, 1), resnet_width=0.5, hidden_size=32,
                 mlp_dim=64, num_heads=2, num_layers=2)
  model = models.create(name, num_classes=5, **options)
  zeros = jax.tree.map(lambda a: np.zeros(a.shape, np.float32), jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, 64, 64, 3)))))
  t = trained_lib._build(name, options, 5, 64, 'resize', zeros['params'],
                         'x.npz', 'npz')
  with pytest.raises(ValueError, match=r"--image_size=72 does not cut into "
                     r"the model's 16x16-pixel patches \(a hybrid needs "
                     r'whole ones\): use a multiple of 16, e.g. 64'):
    report.check_inputs(t, np.zeros((1, 72, 72, 3), np.float32))
  report.check_inputs(t, np.zeros((1, 64, 64, 3), np.float32))
