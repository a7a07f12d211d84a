"""Hugging Face transformers interop: logits agree both ways (fp32)."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import perturb
from vit_jax import checkpoint, models
from vit_jax.checkpoint import CheckpointError

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

# Ti/16 and a B/16-shaped model (B/16 widths and heads, fewer layers).
CASES = [('ViT-Ti/16', {}), ('ViT-B/16', {'num_layers': 2})]


# Our float32 logits agree with the Hugging Face model's, run in float64
# (`_hf_logits`), to float32 rounding: typically 2e-6 (Ti/16) to 6e-6
# (B/16). PyTorch's own float32 logits drifted from ours by up to 4.2e-5 in
# one image late in a long test process (its kernels summing in another
# order), so the reference is computed in float64. The two GELUs' logits
# differ by 3.5e-4 and more (below), so the tolerance still tells them apart.
TOL = 4e-5


def _hf_logits(hf_model, x):
  """The model's logits for NHWC images `x`, computed in float64 (the
  model's float32 weights, exactly), from a copy of the model."""
  exact = copy.deepcopy(hf_model).double()
  with torch.no_grad():
    return exact(pixel_values=torch.from_numpy(
        np.asarray(x, np.float64).transpose(0, 3, 1, 2))).logits.numpy()


def _images(n=2, size=224):
  return np.random.RandomState(0).uniform(-1, 1, (n, size, size, 3)).astype(
      np.float32)


# Both activations: tanh GELU (the JAX checkpoints) and erf GELU (the Hub's
# hidden_act="gelu").
ACTS = [True, False]


@pytest.mark.parametrize('approx', ACTS, ids=['tanh', 'erf'])
@pytest.mark.parametrize('name,overrides', CASES)
def test_ours_to_hf(name, overrides, approx):
  overrides = dict(overrides, gelu_approximate=approx)
  model = models.create(name, num_classes=10, **overrides)
  x = _images()
  params = perturb(model.init(jax.random.key(0), jnp.asarray(x))['params'],
                   scale=0.05)
  ours = np.asarray(model.apply({'params': params}, x))
  assert np.abs(ours).max() > 0.1  # Non-trivial logits.
  cfg = checkpoint.hf_config(name, num_classes=10, **overrides)
  assert cfg.hidden_act == ('gelu_pytorch_tanh' if approx else 'gelu')
  hf = transformers.ViTForImageClassification(cfg).eval()
  hf.load_state_dict(checkpoint.to_hf(params, name, **overrides), strict=True)
  np.testing.assert_allclose(_hf_logits(hf, x), ours, atol=TOL, rtol=0)


@pytest.mark.parametrize('act', ['gelu', 'gelu_new', 'gelu_pytorch_tanh'])
@pytest.mark.parametrize('name,overrides', CASES)
def test_hf_to_ours(name, overrides, act):
  torch.manual_seed(0)
  cfg = checkpoint.hf_config(name, num_classes=10, **overrides)
  cfg.initializer_range = 0.05
  cfg.hidden_act = act
  hf = transformers.ViTForImageClassification(cfg).eval()
  x = _images()
  theirs = _hf_logits(hf, x)
  assert np.abs(theirs).max() > 0.1
  model, params = checkpoint.from_hf_model(hf, name, **overrides)
  assert model.gelu_approximate == (act != 'gelu')
  np.testing.assert_allclose(np.asarray(model.apply({'params': params}, x)),
                             theirs, atol=TOL, rtol=0)
  # The state-dict path with the options `model_options` derives.
  options = checkpoint.hf.model_options(cfg)
  params = checkpoint.from_hf(hf.state_dict(), name, **overrides, **options)
  model = models.create(name, num_classes=10, **overrides, **options)
  np.testing.assert_allclose(np.asarray(model.apply({'params': params}, x)),
                             theirs, atol=TOL, rtol=0)


def test_a_model_without_qkv_biases_loads_with_zero_ones():
  """`ViTConfig(qkv_bias=False)`: no q/k/v bias keys; zero biases in our
  layout give the same logits."""
  torch.manual_seed(0)
  cfg = checkpoint.hf_config('ViT-test', num_classes=5, image_size=28)
  cfg.qkv_bias, cfg.initializer_range = False, 0.05
  hf = transformers.ViTForImageClassification(cfg).eval()
  assert not any(k.endswith('q_proj.bias') or k.endswith('query.bias')
                 for k in hf.state_dict())
  x = _images(2, 28)
  model, params = checkpoint.from_hf_model(hf, 'ViT-test')
  np.testing.assert_allclose(np.asarray(model.apply({'params': params}, x)),
                             _hf_logits(hf, x), atol=TOL, rtol=0)


def test_params_with_more_than_a_plain_vit_are_refused_not_dropped():
  """A pre-logits layer as wide as the model gives a classifier of the
  right shape: left out, the logits would change without an error."""
  for options in (dict(representation_size=32), dict(classifier='gap'),
                  dict(classifier='map')):
    model = models.create('ViT-test', num_classes=5, **options)
    params = model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 3)))[
        'params']
    with pytest.raises(ValueError, match='no Hugging Face'):
      checkpoint.to_hf(params, 'ViT-test')


def test_activations_differ_enough_to_matter():
  # The two GELUs give different logits: the activation test above has teeth.
  name, overrides = CASES[0]
  x = _images(2)
  tanh = models.create(name, num_classes=10, **overrides)
  erf = models.create(name, num_classes=10, gelu_approximate=False,
                      **overrides)
  params = perturb(tanh.init(jax.random.key(0), jnp.asarray(x))['params'],
                   scale=0.1)
  diff = np.abs(np.asarray(tanh.apply({'params': params}, x))
                - np.asarray(erf.apply({'params': params}, x))).max()
  assert diff > 10 * TOL


def test_unknown_hidden_act_is_a_clear_error():
  cfg = checkpoint.hf_config('ViT-Ti/16', 4, num_layers=1)
  cfg.hidden_act = 'relu'
  with pytest.raises(ValueError, match="hidden_act='relu' has no counterpart"):
    checkpoint.hf.model_options(cfg)


def test_layer_norm_epsilon_beyond_ours_is_refused():
  """The Hub's 1e-12 converts (its effect is ~5e-7 relative); a model
  trained with a larger epsilon would compute something else."""
  cfg = checkpoint.hf_config('ViT-Ti/16', 4, num_layers=1)
  for eps in (1e-12, 1e-6):
    cfg.layer_norm_eps = eps
    checkpoint.hf.model_options(cfg)
  cfg.layer_norm_eps = 1e-5
  with pytest.raises(ValueError, match='layer_norm_eps=1e-05'):
    checkpoint.hf.model_options(cfg)


def test_transformers_4x_key_names_load():
  name = 'ViT-Ti/16'
  model = models.create(name, num_classes=4, num_layers=1)
  params = perturb(model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)))
                   ['params'])
  v4 = checkpoint.to_hf(params, name, naming='v4', num_layers=1)
  assert 'vit.encoder.layer.0.attention.attention.query.weight' in v4
  assert 'vit.encoder.layer.0.intermediate.dense.weight' in v4
  back = checkpoint.from_hf(v4, name, num_layers=1)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, np.asarray(b, np.float32))


def test_to_hf_writes_installed_naming():
  model = models.create('ViT-Ti/16', num_classes=4, num_layers=1)
  params = model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)))['params']
  state = checkpoint.to_hf(params, 'ViT-Ti/16', num_layers=1)
  hf = transformers.ViTForImageClassification(
      checkpoint.hf_config('ViT-Ti/16', 4, num_layers=1))
  assert set(state) == set(hf.state_dict())


def test_to_hf_takes_scanned_parameters():
  model = models.create('ViT-Ti/16', num_classes=4, num_layers=2)
  params = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))['params']
  scanned = checkpoint.stack_blocks(jax.device_get(params))
  plain = checkpoint.to_hf(params, 'ViT-Ti/16', num_layers=2)
  stacked = checkpoint.to_hf(scanned, 'ViT-Ti/16', num_layers=2)
  assert set(stacked) == set(plain)
  for k in plain:
    np.testing.assert_array_equal(np.asarray(stacked[k]),
                                  np.asarray(plain[k]), err_msg=k)


def test_models_without_hf_counterpart_are_refused():
  with pytest.raises(ValueError, match='pre-logits'):
    checkpoint.to_hf({}, 'ViT-B/16', representation_size=768)
  with pytest.raises(ValueError, match='no Hugging Face'):
    checkpoint.hf_config('R50+ViT-B/16')
  with pytest.raises(ValueError, match='learned position embeddings'):
    checkpoint.to_hf({}, 'ViT-B/16', posemb='sincos2d')


def test_from_hf_wrong_model_is_a_clear_error():
  hf = transformers.ViTForImageClassification(
      checkpoint.hf_config('ViT-Ti/16', 4, num_layers=1))
  with pytest.raises(CheckpointError, match=r'shape mismatch for '
                     r'vit.embeddings.cls_token: expected \(1, 1, 384\)'):
    checkpoint.from_hf(hf.state_dict(), 'ViT-S/16', num_layers=1)
  with pytest.raises(CheckpointError, match='no key vit.layers.1'):
    checkpoint.from_hf(hf.state_dict(), 'ViT-Ti/16', num_layers=2)
  with pytest.raises(CheckpointError, match='no place for'):
    checkpoint.from_hf(hf.state_dict(), 'ViT-Ti/16', num_layers=0)


def _four_heads():
  """A ViT-test-shaped HF model (hidden 32, 2 layers) with 4 heads, not 2."""
  torch.manual_seed(0)
  cfg = checkpoint.hf_config('ViT-test', num_classes=5, image_size=28,
                             num_heads=4)
  cfg.initializer_range = 0.3
  return transformers.ViTForImageClassification(cfg).eval()


def test_a_wrong_head_count_is_refused_not_loaded():
  """The weights fit any head count dividing the width: loaded as ViT-test
  (2 heads) a 4-head model would give other logits, so it is refused, and
  the override the error names gives the HF model's logits."""
  hf = _four_heads()
  with pytest.raises(CheckpointError, match=r'num_attention_heads=4, '
                     r'ViT-test has num_heads=2.*overrides num_heads=4'):
    checkpoint.from_hf_model(hf, 'ViT-test')
  with pytest.raises(CheckpointError, match='num_attention_heads=4'):
    checkpoint.from_hf(hf.state_dict(), 'ViT-test', config=hf.config)
  model, params = checkpoint.from_hf_model(hf, 'ViT-test', num_heads=4)
  x = _images(2, 28)
  theirs = _hf_logits(hf, x)
  assert np.abs(theirs).max() > 0.1
  np.testing.assert_allclose(np.asarray(model.apply({'params': params}, x)),
                             theirs, atol=TOL, rtol=0)


def test_a_directory_of_other_dimensions_than_model_is_refused(tmp_path):
  """predict --init=<HF dir> --model=NAME: a NAME of other dimensions is
  refused, naming the --model that fits, or the Python call where none
  does."""
  from vit_jax import trained
  _four_heads().save_pretrained(str(tmp_path / 'heads'))
  with pytest.raises(trained.TrainedModelError,
                     match=r"num_attention_heads=4, ViT-test has num_heads=2.*"
                     r"from_hf_model\(hf_model, 'ViT-test', num_heads=4\)"):
    trained.load(str(tmp_path / 'heads'), model='ViT-test')
  cfg = checkpoint.hf_config('ViT-test', num_classes=5, image_size=28)
  transformers.ViTForImageClassification(cfg).save_pretrained(
      str(tmp_path / 'test'))
  with pytest.raises(trained.TrainedModelError,
                     match='hidden_size=32.*pass --model=ViT-test'):
    trained.load(str(tmp_path / 'test'), model='ViT-Ti/16')
  assert trained.load(str(tmp_path / 'test')).name == 'ViT-test'


def test_a_directory_without_a_classifier_is_not_given_a_random_one(
    tmp_path, caplog):
  """A ViTModel's save_pretrained (how ImageNet-21k pre-trainings are
  published): transformers would fill in a random classifier and drop the
  pooler. predict refuses it (no head); loading without a head (inspect)
  keeps none and says the pooler is left out; weights of another
  architecture are refused, not ignored."""
  from vit_jax import trained
  cfg = checkpoint.hf_config('ViT-test', num_classes=10, image_size=16)
  transformers.ViTModel(cfg, add_pooling_layer=True).save_pretrained(
      str(tmp_path / 'bare'))
  with pytest.raises(trained.TrainedModelError,
                     match='has no classification head .*ViTModel'):
    trained.load(str(tmp_path / 'bare'))
  headless = trained.load(str(tmp_path / 'bare'), require_head=False)
  assert headless.num_classes is None and 'head' not in headless.params
  assert 'pooler' in caplog.text and 'left out' in caplog.text
  # A checkpoint of another task's model: its weights have no place here.
  other = transformers.ViTForMaskedImageModeling(cfg)
  other.save_pretrained(str(tmp_path / 'mim'))
  with pytest.raises(trained.TrainedModelError,
                     match="does not hold a ViTForImageClassification's"):
    trained.load(str(tmp_path / 'mim'), require_head=False)


@pytest.mark.parametrize('processor,values', [
    (dict(image_mean=[0.5] * 3, image_std=[0.5] * 3), 'value_range(-1,1)'),
    # A mean per channel (ImageNet's): no value_range computes it.
    (dict(image_mean=[0.485, 0.456, 0.406], image_std=[0.5] * 3), None),
    (dict(do_normalize=False), 'value_range(0,1)'),
    # An export of a value_range(0,1) run.
    (dict(image_mean=[0.0] * 3, image_std=[1.0] * 3), 'value_range(0,1)'),
    # x / 127.5 - 1: the same map, written otherwise.
    (dict(rescale_factor=1 / 127.5, image_mean=[1.0] * 3,
          image_std=[1.0] * 3), 'value_range(-1,1)'),
    (dict(rescale_factor=1 / 127.5, image_mean=[0.5] * 3,
          image_std=[0.5] * 3), 'value_range(-1,3)'),
    (dict(do_rescale=False), 'value_range(-1,509)'),
])
def test_a_processor_feeds_its_value_range_or_is_warned_about(
    tmp_path, caplog, processor, values):
  """What the directory's processor feeds (x * rescale_factor - mean) /
  std, is what predict feeds (the value_range op computing it); one no
  value_range computes is warned about."""
  from vit_jax import trained
  cfg = checkpoint.hf_config('ViT-test', num_classes=10, image_size=16)
  transformers.ViTForImageClassification(cfg).save_pretrained(str(tmp_path))
  transformers.ViTImageProcessor(**processor).save_pretrained(str(tmp_path))
  loaded = trained.load(str(tmp_path))
  assert loaded.pp[-1] == (values or 'value_range(-1,1)')
  assert ('feeds its model other values' in caplog.text) == (values is None)


def test_a_directory_without_config_or_with_damaged_weights_is_a_message(
    tmp_path):
  """No config.json (transformers would build a default ViT-B/16 and fail
  on its shapes) or a truncated model.safetensors: a TrainedModelError
  naming the folder (predict and export print it), not a traceback."""
  from vit_jax import trained
  cfg = checkpoint.hf_config('ViT-test', num_classes=10, image_size=16)
  for name in ('nocfg', 'trunc'):
    transformers.ViTForImageClassification(cfg).save_pretrained(
        str(tmp_path / name))
  (tmp_path / 'nocfg' / 'config.json').unlink()
  with pytest.raises(trained.TrainedModelError, match='no config.json'):
    trained.load(str(tmp_path / 'nocfg'))
  weights = tmp_path / 'trunc' / 'model.safetensors'
  weights.write_bytes(weights.read_bytes()[:1000])
  with pytest.raises(trained.TrainedModelError,
                     match='trunc: cannot read the Hugging Face model'):
    trained.load(str(tmp_path / 'trunc'))
