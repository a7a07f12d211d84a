"""The model zoo: names, exact parameter counts, options, dtypes, init, errors."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import perturb
from vit_jax import accounting, models


@pytest.mark.parametrize('name', sorted(accounting.TABLE1_PARAMS))
def test_param_counts_equal_paper(name):
  # jax.eval_shape inside param_count: no weights are materialised.
  assert accounting.param_count(name) == accounting.TABLE1_PARAMS[name]


def _init(model, shape, seed=0):
  x = jnp.zeros(shape, jnp.float32)
  return jax.jit(model.init)(jax.random.key(seed), x)['params']


def test_vit_logits_shape_and_dtype():
  model = models.create('ViT-test', num_classes=7)
  x = jnp.asarray(np.random.RandomState(0).uniform(-1, 1, (2, 28, 28, 3)),
                  jnp.float32)
  params = _init(model, x.shape)
  logits = model.apply({'params': params}, x, train=False)
  chex.assert_shape(logits, (2, 7))
  chex.assert_type(logits, jnp.float32)
  # Zero-initialised head: logits start at exactly zero.
  np.testing.assert_array_equal(logits, 0.0)


def test_reference_initialisation():
  model = models.create('ViT-S/16', num_classes=10)
  p = _init(model, (1, 224, 224, 3))
  np.testing.assert_array_equal(p['head']['kernel'], 0.0)
  np.testing.assert_array_equal(p['head']['bias'], 0.0)
  np.testing.assert_array_equal(p['cls'], 0.0)
  pe = p['Transformer']['posembed_input']['pos_embedding']
  assert abs(float(np.std(pe)) - 0.02) < 0.001
  # lecun-normal patch embedding: std = 1/sqrt(fan_in) (truncated normal).
  emb = np.asarray(p['embedding']['kernel'])
  assert abs(emb.std() - 1 / np.sqrt(16 * 16 * 3)) < 0.1 / np.sqrt(768)
  # xavier-uniform attention and MLP kernels: |w| <= sqrt(6/(fan_in+fan_out)).
  blk = p['Transformer']['encoderblock_0']
  q = np.asarray(blk['MultiHeadDotProductAttention_0']['query']['kernel'])
  bound = np.sqrt(6 / (384 + 384))
  assert np.abs(q).max() <= bound and np.abs(q).max() > 0.9 * bound
  d0 = np.asarray(blk['MlpBlock_0']['Dense_0']['kernel'])
  bound = np.sqrt(6 / (384 + 1536))
  assert np.abs(d0).max() <= bound and np.abs(d0).max() > 0.9 * bound


def test_head_bias_init():
  model = models.create('ViT-test', num_classes=5, head_bias_init=-10.0)
  p = _init(model, (1, 28, 28, 3))
  np.testing.assert_array_equal(p['head']['bias'], -10.0)


def test_gap_classifier_has_no_class_token():
  model = models.create('ViT-test', num_classes=3, classifier='gap')
  p = _init(model, (1, 28, 28, 3))
  assert 'cls' not in p
  chex.assert_shape(p['Transformer']['posembed_input']['pos_embedding'],
                    (1, 49, 32))


def test_representation_size_adds_tanh_pre_logits(rng):
  model = models.create('ViT-test', num_classes=3, representation_size=16)
  x = jnp.asarray(rng.uniform(-1, 1, (2, 28, 28, 3)), jnp.float32)
  p = _init(model, x.shape)
  chex.assert_shape(p['pre_logits']['kernel'], (32, 16))
  _, state = model.apply({'params': p}, x, mutable=['intermediates'])
  (pre,) = state['intermediates']['representation']
  chex.assert_shape(pre, (2, 16))
  assert np.all(np.abs(pre) <= 1.0)


def test_any_multiple_of_patch_and_one_channel(rng):
  model = models.create('ViT-test', num_classes=4)
  for shape in [(1, 32, 48, 1), (2, 16, 16, 3)]:
    p = _init(model, shape)
    n = (shape[1] // 4) * (shape[2] // 4) + 1
    chex.assert_shape(p['Transformer']['posembed_input']['pos_embedding'],
                      (1, n, 32))
    out = model.apply({'params': p}, jnp.ones(shape))
    chex.assert_shape(out, (shape[0], 4))


def test_plain_vit_leaves_out_pixels_past_the_last_whole_patch(rng):
  # As the reference's VALID patch convolution does: ViT-H/14 at the paper's
  # 384 px is a 27x27 grid over 378x378 pixels.
  model = models.create('ViT-test', num_classes=3)
  x = jnp.asarray(rng.uniform(-1, 1, (2, 30, 23, 3)), jnp.float32)
  p = _init(model, x.shape)
  chex.assert_shape(p['Transformer']['posembed_input']['pos_embedding'],
                    (1, 7 * 5 + 1, 32))
  noise = jnp.asarray(rng.uniform(-1, 1, x.shape), jnp.float32)
  beyond = x.at[:, 28:].set(noise[:, 28:]).at[:, :, 20:].set(
      noise[:, :, 20:])
  np.testing.assert_array_equal(model.apply({'params': p}, x),
                                model.apply({'params': p}, beyond))
  np.testing.assert_allclose(model.apply({'params': p}, x),
                             model.apply({'params': p}, x[:, :28, :20]),
                             rtol=1e-6, atol=1e-6)
  h14 = models.create('ViT-H/14', num_classes=4)
  shapes = jax.eval_shape(lambda: _init(h14, (1, 384, 384, 3)))
  chex.assert_shape(shapes['Transformer']['posembed_input']['pos_embedding'],
                    (1, 27 * 27 + 1, 1280))
  with pytest.raises(ValueError, match='at least one patch'):
    jax.eval_shape(lambda: _init(model, (1, 3, 8, 3)))


def test_hybrid_needs_multiple_of_16():
  # Its ResNet stem pads rather than leaving pixels out: sizes must tile.
  model = models.create('R50+ViT-B/16', num_classes=4)
  with pytest.raises(ValueError, match=r'40x40 is not divisible by the patch '
                     r'size 16.*e\.g\. 48x48'):
    jax.eval_shape(lambda: _init(model, (1, 40, 40, 3)))


def test_every_family_says_whether_it_drops_partial_patches():
  """`Module.drops_partial_patches` (False) is read from any family: True
  only where a VALID patch convolution leaves the last pixels out (Mixer's
  stem pads them)."""
  from vit_jax.models.partitioning import Module
  want = {'ViT-B/16': True, 'Mixer-B/16': False, 'R50+ViT-B/16': False,
          'R+ViT-Ti/16': False, 'BiT-R50x1': False}
  for name in models.names():
    assert issubclass(models.spec(name)['cls'], Module), name
  got = {n: models.create(n, num_classes=2).drops_partial_patches
         for n in want}
  assert got == want


def _dtypes_of_intermediates(model, params, x):
  from vit_jax.models.dense import DenseParams  # Returns parameters (float32).
  _, state = model.apply(
      {'params': params}, x, mutable=['intermediates'],
      capture_intermediates=lambda m, method: (
          method == '__call__' and type(m) is not DenseParams))
  out = {}
  for path, v in jax.tree_util.tree_flatten_with_path(
      state['intermediates'])[0]:
    out[jax.tree_util.keystr(path)] = v.dtype
  return out


@pytest.mark.parametrize('name,overrides,size', [
    ('ViT-test', {}, 28),
    ('R50+ViT-B/16', dict(hidden_size=32, mlp_dim=64, num_heads=2,
                          num_layers=1, resnet_layers=(1, 1, 1)), 32),
    ('BiT-R50x1', dict(width_factor=0.5), 32),
])
def test_compute_dtype_honoured_by_every_layer(name, overrides, size):
  model = models.create(name, num_classes=3, dtype=jnp.bfloat16, **overrides)
  x = jnp.zeros((1, size, size, 3), jnp.float32)
  params = model.init(jax.random.key(0), x)['params']
  # Parameters stay float32 ...
  assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype('float32')}
  dtypes = _dtypes_of_intermediates(model, params, x)
  assert len(dtypes) > 5
  # ... every layer computes in bfloat16 but the head: the logits are f32.
  f32 = ("['__call__'][0]", "['head']['__call__'][0]")
  wrong = {k: v for k, v in dtypes.items()
           if v != jnp.bfloat16 and k not in f32}
  assert not wrong, wrong
  assert [dtypes[k] for k in f32] == [jnp.float32] * 2


@pytest.mark.parametrize('name,size', [
    ('ViT-test', 28),
    pytest.param('BiT-R50x1', 32, marks=pytest.mark.slow)])  # 20 s; same head.
def test_bf16_models_give_logits_not_rounded_to_bf16(name, size, rng):
  """The head computes in float32: bf16 logits would step by 0.0625 at 10,
  and tie or reorder classes (the loss and top-1 see it)."""
  kw = dict(width_factor=0.5) if name.startswith('BiT') else {}
  model = models.create(name, num_classes=100, dtype=jnp.bfloat16, **kw)
  x = jnp.asarray(rng.uniform(-1, 1, (4, size, size, 3)), jnp.float32)
  p = _init(model, x.shape)
  p['head']['kernel'] = jnp.asarray(
      rng.normal(size=p['head']['kernel'].shape) * 3, jnp.float32)
  logits = np.asarray(model.apply({'params': p}, x))
  assert logits.dtype == np.float32 and np.abs(logits).max() > 1
  rounded = np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float32)
  assert np.mean(logits != rounded) > 0.5


def test_dropout_active_only_in_training(rng):
  model = models.create('ViT-test', num_classes=3, dropout_rate=0.5,
                        attention_dropout_rate=0.5)
  x = jnp.asarray(rng.uniform(-1, 1, (2, 28, 28, 3)), jnp.float32)
  p = _init(model, x.shape)
  p['head']['kernel'] = jnp.ones_like(p['head']['kernel'])
  a = model.apply({'params': p}, x, train=False)
  b = model.apply({'params': p}, x, train=False)
  np.testing.assert_array_equal(a, b)
  c = model.apply({'params': p}, x, train=True,
                  rngs={'dropout': jax.random.key(1)})
  assert not np.allclose(a, c)


def test_bit_forward_and_zero_head(rng):
  model = models.create('BiT-R50x1', num_classes=5, width_factor=0.5)
  x = jnp.asarray(rng.uniform(-1, 1, (2, 64, 64, 3)), jnp.float32)
  p = _init(model, x.shape)
  assert 'norm_pre_head' in p and 'unit3' in p['block1']
  out = jax.jit(model.apply)({'params': p}, x)
  chex.assert_shape(out, (2, 5))
  np.testing.assert_array_equal(out, 0.0)


def test_standardised_conv_kernel_is_standardised():
  # Two kernels that differ by scale and offset give the same output.
  from vit_jax.models.resnet import StdConv
  conv = StdConv(4, (3, 3), use_bias=False)
  x = jnp.asarray(np.random.RandomState(0).normal(size=(1, 8, 8, 3)),
                  jnp.float32)
  p = conv.init(jax.random.key(0), x)['params']
  k2 = {'kernel': 3.0 * p['kernel'] + 0.7}
  np.testing.assert_allclose(conv.apply({'params': p}, x),
                             conv.apply({'params': k2}, x), rtol=1e-3)


def test_unknown_name_and_option_are_clear_errors():
  with pytest.raises(ValueError, match=r"unknown model name 'ViT-B/61'.*ViT-B/16"):
    models.create('ViT-B/61')
  with pytest.raises(ValueError, match=r"no option\(s\) \['hiden_size'\]"):
    models.create('ViT-B/16', hiden_size=3)
  model = models.create('ViT-test', num_classes=2, classifier='cls')
  with pytest.raises(ValueError, match="one of \('token', 'gap', 'map'\)"):
    _init(model, (1, 28, 28, 3))


def test_create_returns_linen_module():
  assert isinstance(models.create('ViT-B/16'), nn.Module)


def test_scan_and_remat_compute_the_same(rng):
  from vit_jax.checkpoint import stack_blocks
  x = jnp.asarray(rng.uniform(-1, 1, (2, 28, 28, 3)), jnp.float32)
  plain = models.create('ViT-test', num_classes=5)
  scanned = models.create('ViT-test', num_classes=5, scan_layers=True,
                          remat=True)
  p = jax.tree.map(lambda a: a + 0.05 * rng.normal(size=a.shape),
                   _init(plain, x.shape))
  ps = stack_blocks(jax.device_get(p))
  assert jax.tree.structure(ps) == jax.tree.structure(
      _init(scanned, x.shape))
  chex.assert_shape(ps['Transformer']['encoderblock']['MlpBlock_0']['Dense_0']
                    ['kernel'], (2, 32, 64))
  np.testing.assert_allclose(jax.jit(scanned.apply)({'params': ps}, x),
                             jax.jit(plain.apply)({'params': p}, x),
                             atol=1e-5)
  loss = lambda m, q: m.apply({'params': q}, x, train=True).sum()
  g = stack_blocks(jax.device_get(
      jax.jit(jax.grad(lambda q: loss(plain, q)))(p)))
  gs = jax.jit(jax.grad(lambda q: loss(scanned, q)))(ps)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gs)):
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize('policy', ['dots_saveable',
                                    'dots_with_no_batch_dims_saveable'])
def test_named_remat_policies_give_the_same_gradients(rng, policy):
  x = jnp.asarray(rng.uniform(-1, 1, (2, 28, 28, 3)), jnp.float32)
  plain = models.create('ViT-test', num_classes=5)
  p = jax.tree.map(lambda a: a + 0.05 * rng.normal(size=a.shape),
                   _init(plain, x.shape))
  loss = lambda m: jax.jit(jax.grad(
      lambda q: m.apply({'params': q}, x, train=True).sum()))(p)
  for a, b in zip(jax.tree.leaves(loss(plain)),
                  jax.tree.leaves(loss(plain.clone(remat=policy)))):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_recompute_gives_fn_values_and_gradients(rng):
  from vit_jax.models.recompute import recompute

  def fn(x, pair, mask, steps):  # Pytrees, None and integer inputs pass.
    w, b = pair
    y = jnp.tanh(x @ w + b) * steps
    return y if mask is None else jnp.where(mask, y, 0.0)
  x, w, b = (jnp.asarray(rng.normal(size=s), jnp.float32)
             for s in ((3, 4), (4, 5), (5,)))
  steps = jnp.int32(2)
  loss = lambda f: lambda x, p: (f(x, p, None, steps) ** 2).sum()
  np.testing.assert_array_equal(recompute(fn)(x, (w, b), None, steps),
                                fn(x, (w, b), None, steps))
  for a, e in zip(jax.tree.leaves(jax.grad(loss(recompute(fn)), (0, 1))(
      x, (w, b))), jax.tree.leaves(jax.grad(loss(fn), (0, 1))(x, (w, b)))):
    np.testing.assert_allclose(a, e, rtol=1e-6)
  # A NaN cotangent gives NaN gradients, as it does without recompute.
  nan = jax.vjp(lambda x: recompute(fn)(x, (w, b), None, steps), x)[1](
      jnp.full((3, 5), jnp.nan))[0]
  assert np.isnan(nan).all()


@pytest.mark.parametrize('dtype', [
    'float32', pytest.param('bfloat16', marks=pytest.mark.slow)])
def test_recomputed_internals_give_the_same_numbers_with_less_memory(
    rng, dtype):
  """LayerNorm / GELU / attention recomputed in the backward pass: the same
  logits and gradients as keeping every intermediate, a smaller compiled
  footprint (float32; unrolled and under scan), the same parameter tree."""
  x = jnp.asarray(rng.uniform(-1, 1, (4, 32, 32, 3)), jnp.float32)
  lean = models.create('ViT-test', num_classes=5, dtype=jnp.dtype(dtype))
  assert lean.recompute_internals  # The default.
  full = lean.clone(recompute_internals=False)
  p = jax.tree.map(lambda a: a + 0.05 * rng.normal(size=a.shape),
                   _init(lean, x.shape))
  assert jax.tree.structure(p) == jax.tree.structure(_init(full, x.shape))
  grad = lambda m, q: jax.jit(jax.grad(
      lambda q: m.apply({'params': q}, x, train=True).sum()))(q)
  logits = lambda m: jax.jit(m.apply)({'params': p}, x)
  np.testing.assert_array_equal(logits(lean), logits(full))
  if dtype == 'float32':
    for a, b in zip(jax.tree.leaves(grad(lean, p)),
                    jax.tree.leaves(grad(full, p))):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  else:  # Rounded differently; as close to the float32 gradients as before.
    ref = jax.tree.leaves(grad(lean.clone(dtype=jnp.float32), p))
    err = lambda m: np.array([
        np.linalg.norm(np.float32(a) - b) / np.linalg.norm(b)
        for a, b in zip(jax.tree.leaves(grad(m, p)), ref)
        if np.linalg.norm(b) > 1e-4])  # Not the key biases' (exactly 0).
    assert err(lean).max() < 0.05 and err(full).max() < 0.05
    assert err(lean).mean() < 1.2 * err(full).mean()
    return

  def temp_bytes(model, scan):
    model = model.clone(scan_layers=scan)
    q = jax.eval_shape(lambda: _init(model, x.shape))
    return jax.jit(lambda q: grad(model, q)).lower(q).compile(
        ).memory_analysis().temp_size_in_bytes
  for scan in (False, True):  # Unrolled too: no backend's schedule undoes it.
    assert temp_bytes(lean, scan) < 0.8 * temp_bytes(full, scan), scan


@pytest.mark.parametrize('scan,remat', [(False, False), (True, True)])
def test_stochastic_depth_is_identity_in_eval_and_random_in_training(
    rng, scan, remat):
  from vit_jax.checkpoint import stack_blocks
  x = jnp.asarray(rng.uniform(-1, 1, (4, 28, 28, 3)), jnp.float32)
  plain = models.create('ViT-test', num_classes=5)
  p = jax.tree.map(lambda a: a + 0.05 * rng.normal(size=a.shape),
                   _init(plain, x.shape))
  sd = models.create('ViT-test', num_classes=5, stochastic_depth=0.5,
                     scan_layers=scan, remat=remat)
  q = stack_blocks(jax.device_get(p)) if scan else p
  np.testing.assert_allclose(sd.apply({'params': q}, x),
                             plain.apply({'params': p}, x), atol=1e-5)
  run = lambda seed: sd.apply({'params': q}, x, train=True,
                              rngs={'dropout': jax.random.key(seed)})
  assert not np.allclose(run(1), run(2))
  np.testing.assert_array_equal(run(1), run(1))  # A function of the rng.


def test_drop_path_drops_at_its_rate_and_keeps_the_mean():
  from vit_jax.models.vit import DropPath, depth_rates
  y = jnp.ones((40_000, 3, 4))
  out = DropPath().apply({}, y, 0.3, deterministic=False,
                         rngs={'dropout': jax.random.key(0)})
  rows = np.asarray(out).reshape(len(y), -1)
  assert np.all((rows == 0).all(1) | np.isclose(rows, 1 / 0.7).all(1))
  assert abs((rows[:, 0] == 0).mean() - 0.3) < 0.01
  assert abs(rows.mean() - 1.0) < 0.02
  np.testing.assert_allclose(depth_rates(0.1, 5), [0, .025, .05, .075, .1])
  with pytest.raises(ValueError, match='stochastic_depth=1.0'):
    depth_rates(1.0, 12)


def test_unknown_remat_policy_names_the_choices():
  with pytest.raises(ValueError, match='nothing_saveable.*dots_saveable'):
    _init(models.create('ViT-test', num_classes=5, remat='dots'),
          (1, 28, 28, 3))


@pytest.mark.parametrize('bit', [False, True])
def test_weight_standardisation_matches_reference_formula(bit):
  # A kernel of small variance, where (std + eps) and sqrt(var + eps) differ:
  # the hybrid follows vision_transformer's models_resnet.py, (w - mean) /
  # (std + 1e-5); BiT follows big_transfer / big_vision bit_paper.py,
  # (w - mean) / sqrt(var + 1e-10).
  from vit_jax.models.resnet import StdConv
  rs = np.random.RandomState(0)
  k = (1e-4 * rs.normal(size=(3, 3, 2, 4))).astype(np.float64)
  x = jnp.asarray(rs.normal(size=(1, 5, 5, 2)), jnp.float32)
  conv = StdConv(4, (3, 3), use_bias=False, padding='VALID', bit=bit)
  c = k - k.mean(axis=(0, 1, 2), keepdims=True)
  if bit:
    ref = c / np.sqrt((c**2).mean(axis=(0, 1, 2), keepdims=True) + 1e-10)
  else:
    ref = c / (c.std(axis=(0, 1, 2), keepdims=True) + 1e-5)
  want = jax.lax.conv_general_dilated(
      x, jnp.asarray(ref, jnp.float32), (1, 1), 'VALID',
      dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  got = conv.apply({'params': {'kernel': jnp.asarray(k, jnp.float32)}}, x)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  assert np.abs(np.asarray(want)).max() > 1  # Not a degenerate kernel.


@pytest.mark.parametrize('features,in_axes', [(6, 1), ((2, 3), 1), (5, 2)])
def test_dense_has_flax_parameters_and_a_float32_bias_gradient(features,
                                                               in_axes):
  """`models.dense.Dense` is flax's DenseGeneral (same parameters from the
  same key, same outputs); in bf16 its bias gradient is the float32 sum of
  the cotangent, not a bf16 one."""
  from vit_jax.models import dense
  x = jax.random.normal(jax.random.key(1), (3, 7, 4, 2))
  init = dict(kernel_init=nn.initializers.xavier_uniform(),
              bias_init=nn.initializers.normal(stddev=0.5))
  names = (None,) * (in_axes + len(np.atleast_1d(features)))
  ours = dense.Dense(features, names, in_axes=in_axes, **init)
  theirs = nn.DenseGeneral(features, axis=tuple(range(-in_axes, 0)), **init)
  params = ours.init(jax.random.key(0), x)
  chex.assert_trees_all_equal(nn.meta.unbox(params),
                              theirs.init(jax.random.key(0), x))
  np.testing.assert_allclose(ours.apply(params, x), theirs.apply(params, x),
                             rtol=1e-6)
  kernel, bias = nn.meta.unbox(params)['params'].values()
  g = jax.random.normal(jax.random.key(2), (3, 7, 4, 2)[:4 - in_axes] +
                        np.shape(bias)).astype(jnp.bfloat16)
  xb = x.astype(jnp.bfloat16)
  _, vjp = jax.vjp(lambda b: dense.apply(xb, kernel, b, jnp.bfloat16), bias)
  lead = tuple(range(g.ndim - np.ndim(bias)))
  np.testing.assert_array_equal(vjp(g)[0], g.astype(jnp.float32).sum(lead))


def test_gpu_bias_gradient_product_is_the_float32_sum():
  """On NVIDIA GPUs a bf16 bias gradient is ones x cotangent rows, bf16
  products accumulated in float32 (`dense.bias_gradient`): the float32 sum
  up to summation order; float32 cotangents keep the plain sum."""
  from vit_jax.models import dense
  g = jax.random.normal(jax.random.key(0), (4, 33, 3, 8)).astype(jnp.bfloat16)
  want = g.astype(jnp.float32).sum((0, 1))
  got = dense._by_product(g, 2)
  assert got.dtype == jnp.float32 and got.shape == (3, 8)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(dense.bias_gradient(g, 2), want)  # CPU.
  f32 = g.astype(jnp.float32)
  lowered = jax.jit(lambda g: dense.bias_gradient(g, 2)).trace(f32).lower(
      lowering_platforms=('cuda',)).as_text()
  assert 'dot_general' not in lowered and 'reduce' in lowered


def test_odd_sequence_padding_keeps_attention_and_its_gradients():
  """cuDNN's backward pass needs even lengths: `even_lengths` pads a ViT's
  odd token count by one hidden key and one dropped query. Checked here
  through the same padding with XLA's kernel (cuDNN needs a GPU)."""
  from vit_jax.models import attention
  rng = np.random.RandomState(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 7, 3, 8)), jnp.float32)
             for _ in range(3))

  def loss(fn, q, k, v):
    return jnp.sum(jnp.sin(fn(q, k, v)))

  plain = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, implementation='xla')
  padded = lambda q, k, v: attention.even_lengths(q, k, v, None, 'xla')
  np.testing.assert_allclose(padded(q, k, v), plain(q, k, v), atol=1e-6)
  assert padded(q, k, v).shape == (2, 7, 3, 8)
  for a, b in zip(jax.grad(functools.partial(loss, padded), (0, 1, 2))(q, k, v),
                  jax.grad(functools.partial(loss, plain), (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize('impl,scan', [('xla', False), ('xla', True),
                                       ('explicit', False)])
def test_encoder_pads_odd_token_counts_once_with_the_same_numbers(impl, scan):
  """`Encoder(even_tokens=True)` pads 7 tokens to 8 once, hides the pad as
  every block's key and slices it off: the outputs and the gradients (of
  the parameters and the input) are those of the unpadded encoder. With
  cuDNN attention that is the default (a GPU is needed to run it)."""
  from vit_jax.models import vit
  x = jax.random.normal(jax.random.key(0), (2, 7, 16))
  make = lambda even: vit.Encoder(
      num_layers=2, mlp_dim=32, num_heads=2, attention_impl=impl,
      scan_layers=scan, even_tokens=even)
  params = make(False).init(jax.random.key(1), x, train=False)

  def loss(even, params, x):
    return jnp.sum(jnp.sin(make(even).apply(params, x, train=True)))

  # Jitted: op by op, the two encoders' gradients took 10-17 s.
  infer = lambda even: jax.jit(
      lambda p, x: make(even).apply(p, x, train=False))(params, x)
  out = infer(True)
  assert out.shape == (2, 7, 16)
  np.testing.assert_allclose(out, infer(False), atol=1e-5)
  grad = lambda even: jax.jit(jax.grad(functools.partial(loss, even),
                                       (0, 1)))(params, x)
  chex.assert_trees_all_close(grad(True), grad(False), atol=1e-5)


def test_explicit_attention_scales_float32_logits_as_xla():
  """"explicit" attention (the softmax weights as an array, for `inspect`,
  attention dropout and ONNX) computes "xla"'s numbers in bf16: the
  1 / sqrt(head_dim) scale multiplies the float32 logits. Scaling the bf16
  queries first (flax's way) put ViT-H/14's head_dim 80 output 0.5% from
  "xla"; the sown weights are the float32 softmax of the scaled logits,
  masked keys get none."""
  from vit_jax.models import attention
  q, k, v = (3 * jax.random.normal(jax.random.key(i), (2, 197, 2, 80)
                                   ).astype(jnp.bfloat16) for i in range(3))
  run = lambda impl, **kw: jax.jit(lambda q, k, v: attention.attention_fn(
      impl)(q, k, v, deterministic=True, dtype=jnp.bfloat16, **kw))(q, k, v)
  xla = np.asarray(run('xla'), np.float32)
  explicit = np.asarray(run('explicit'), np.float32)
  assert np.linalg.norm(explicit - xla) <= 1e-3 * np.linalg.norm(xla)

  class Sow(nn.Module):
    @nn.compact
    def __call__(self, q, k, v, mask):
      return attention.attention_fn('explicit')(
          q, k, v, mask, deterministic=True, dtype=jnp.bfloat16, module=self)

  mask = (jnp.arange(197) < 150)[None, None, None, :]
  _, sown = Sow().apply({}, q, k, v, mask, mutable='intermediates')
  weights = sown['intermediates']['attention_weights'][0]
  logits = jnp.einsum('bqhd,bkhd->bhqk', q.astype(jnp.float32),
                      k.astype(jnp.float32)) / np.sqrt(80)
  expected = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf))
  assert weights.dtype == jnp.float32
  np.testing.assert_allclose(weights, expected, atol=1e-5)
  assert not np.asarray(weights)[..., 150:].any()


def test_encoder_pads_only_for_cudnn_attention_by_default():
  from vit_jax.models import vit
  pads = lambda train=True, **kw: vit.Encoder(
      num_layers=1, mlp_dim=8, num_heads=1, **kw)._pads(197, train)
  assert pads(attention_impl='cudnn')
  assert not pads(attention_impl='xla')
  assert not pads(attention_impl='cudnn', capture_attention=True)
  assert not pads(attention_impl='cudnn', attention_dropout_rate=0.1)
  assert pads(False, attention_impl='cudnn', attention_dropout_rate=0.1)
  assert not pads(attention_impl='cudnn', even_tokens=False)
  assert pads(attention_impl='xla', even_tokens=True)
  assert not vit.Encoder(num_layers=1, mlp_dim=8, num_heads=1,
                         attention_impl='cudnn')._pads(196, True)


@pytest.mark.parametrize('form', ['bf16', 'onednn'])
@pytest.mark.parametrize('kv_len', [9, 5])
def test_cpu_attention_core_is_jax_xla_attention(kv_len, form, monkeypatch,
                                                 request):
  """On CPUs "xla" attention runs as canonical-layout batched matmuls with
  flash attention's backward pass (`attention._cpu_core`, token axes padded
  there): float32 equals `jax.nn.dot_product_attention`'s XLA
  implementation, with and without a mask, for self- and cross-attention
  (fewer keys than queries); bf16 outputs within one bf16 step, gradients
  (bf16 cotangents in the backward matmuls) within 2%, in each CPU matmul
  form that runs bf16 products (the batched products on XLA's kernel or on
  oneDNN's). The recomputing variant the encoder uses is the same function
  on CPUs."""
  from vit_jax.models import attention, matmul, onednn
  if form == 'onednn' and not onednn.available()[0]:
    pytest.skip(f'the oneDNN matmul is unavailable: {onednn.available()[1]}')
  monkeypatch.setenv(matmul.ENV, form)
  matmul.reset_cpu_form()
  request.addfinalizer(matmul.reset_cpu_form)
  rng = np.random.RandomState(1)
  q, g = (jnp.asarray(rng.normal(size=(2, 9, 3, 8)), jnp.float32)
          for _ in range(2))
  k, v = (jnp.asarray(rng.normal(size=(2, kv_len, 3, 8)), jnp.float32)
          for _ in range(2))
  mask = jnp.asarray(rng.uniform(size=(2, 1, 9, kv_len)) > 0.3
                     ).at[..., 0].set(True)
  for m, recomputed in ((None, False), (mask, False), (mask, True)):
    ref = functools.partial(jax.nn.dot_product_attention, mask=m,
                            implementation='xla')
    ours = lambda q, k, v, m=m, r=recomputed: attention._xla(q, k, v, m, r)
    for dtype, atol, rtol in ((jnp.float32, 1e-6, 1e-5),
                              (jnp.bfloat16, 2**-8, 0.02)):
      args = [x.astype(dtype) for x in (q, k, v)]
      a, b = jax.jit(ref)(*args), jax.jit(ours)(*args)
      assert b.dtype == dtype and b.shape == a.shape
      scale = float(jnp.abs(a.astype(jnp.float32)).max())
      np.testing.assert_allclose(np.asarray(b, np.float32),
                                 np.asarray(a, np.float32), atol=atol * scale)
      grads = [jax.jit(lambda *x, f=f: jax.vjp(f, *x)[1](g.astype(dtype)))(
          *args) for f in (ref, ours)]
      for x, y in zip(*grads):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        np.testing.assert_allclose(y, x, atol=rtol * np.abs(x).max())


def test_root_block_only_hybrid():
  """AugReg's R+Ti/16: the ResNet root block alone (resnet_layers=()), 4x
  down-sampling, then 8x8 patches: stride 32, `conv_root` / `gn_root`
  present (an empty tuple used to drop the ResNet silently)."""
  model = models.create('ViT-Ti/16', num_classes=3, patch_size=8,
                        resnet_layers=(), resnet_width=1.0)
  assert model.stride == 32
  params = jax.eval_shape(lambda: _init(model, (1, 64, 64, 3)))
  assert {'conv_root', 'gn_root'} <= set(params) and not any(
      k.startswith('block') for k in params)
  assert params['embedding']['kernel'].shape == (8, 8, 64, 192)
  assert params['Transformer']['posembed_input'][
      'pos_embedding'].shape == (1, 5, 192)


def test_mixer_matches_the_papers_parameter_counts():
  """MLP-Mixer (Tolstikhin et al. 2021, Table 1): S/32 19M, S/16 18M, B/32
  60M, B/16 59M, L/32 206M, L/16 207M; the public checkpoints' names."""
  from vit_jax import accounting
  counts = {name: accounting.param_count(name) / 1e6 for name in (
      'Mixer-S/32', 'Mixer-S/16', 'Mixer-B/32', 'Mixer-B/16', 'Mixer-L/32',
      'Mixer-L/16')}
  assert [round(c) for c in counts.values()] == [19, 19, 60, 60, 207, 208]
  model = models.create('Mixer-B/16', num_classes=10)
  params = jax.eval_shape(lambda: _init(model, (1, 224, 224, 3)))
  block = params['MixerBlock_11']
  assert params['stem']['kernel'].shape == (16, 16, 3, 768)
  assert block['token_mixing']['Dense_0']['kernel'].shape == (196, 384)
  assert block['channel_mixing']['Dense_1']['kernel'].shape == (3072, 768)
  assert set(block) == {'LayerNorm_0', 'token_mixing', 'LayerNorm_1',
                        'channel_mixing'}
  assert {'pre_head_layer_norm', 'head'} <= set(params)


def test_mixer_matches_timm():
  """Our Mixer computes timm's `MlpMixer` (an independent implementation,
  with the reference's tanh GELU) from the same weights."""
  torch = pytest.importorskip('torch')
  mlp_mixer = pytest.importorskip('timm.models.mlp_mixer')
  import functools
  model = models.create('Mixer-S/16', num_classes=10, hidden_dim=32,
                        num_blocks=2, tokens_mlp_dim=16, channels_mlp_dim=128)
  params = _init(model, (1, 64, 64, 3))
  rng = np.random.RandomState(0)
  params = jax.tree.map(lambda p: p + 0.1 * rng.normal(size=p.shape), params)
  ref = mlp_mixer.MlpMixer(
      num_classes=10, img_size=64, patch_size=16, num_blocks=2, embed_dim=32,
      mlp_ratio=(0.5, 4.0),
      act_layer=functools.partial(torch.nn.GELU, approximate='tanh')).eval()
  t = lambda a: torch.from_numpy(np.asarray(a, np.float32))
  state = {'stem.proj.weight': t(params['stem']['kernel']).permute(3, 2, 0, 1),
           'stem.proj.bias': t(params['stem']['bias']),
           'norm.weight': t(params['pre_head_layer_norm']['scale']),
           'norm.bias': t(params['pre_head_layer_norm']['bias']),
           'head.weight': t(params['head']['kernel']).T,
           'head.bias': t(params['head']['bias'])}
  for i in range(2):
    b = params[f'MixerBlock_{i}']
    for norm, ln in (('norm1', 'LayerNorm_0'), ('norm2', 'LayerNorm_1')):
      state[f'blocks.{i}.{norm}.weight'] = t(b[ln]['scale'])
      state[f'blocks.{i}.{norm}.bias'] = t(b[ln]['bias'])
    for mlp, ours in (('mlp_tokens', 'token_mixing'),
                      ('mlp_channels', 'channel_mixing')):
      for fc, dense in (('fc1', 'Dense_0'), ('fc2', 'Dense_1')):
        state[f'blocks.{i}.{mlp}.{fc}.weight'] = t(b[ours][dense]['kernel']).T
        state[f'blocks.{i}.{mlp}.{fc}.bias'] = t(b[ours][dense]['bias'])
  ref.load_state_dict(state)
  x = rng.uniform(-1, 1, (2, 64, 64, 3)).astype(np.float32)
  with torch.no_grad():
    want = ref(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()
  got = np.asarray(model.apply({'params': params}, x))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('overrides', [
    {}, dict(attention_impl='explicit', representation_size=8,
             scan_layers=True)])
def test_float32_without_recomputed_internals_has_forward_mode_autodiff(
    rng, overrides):
  """float32 with `recompute_internals=False` traces no custom VJP
  (`recompute.plain_autodiff`): `jax.jvp` agrees with a finite difference,
  `jax.jacfwd` with `jax.jacrev`, and a forward-over-reverse
  Hessian-vector product with reverse-over-reverse. Each raised "can't
  apply forward-mode autodiff (jvp) to a custom_vjp function"."""
  model = models.create('ViT-test', num_classes=3, recompute_internals=False,
                        **overrides)
  x = jnp.asarray(rng.uniform(-1, 1, (2, 12, 12, 3)), jnp.float32)
  p = jax.tree.map(lambda a: a + 0.1 * rng.normal(size=a.shape),
                   _init(model, x.shape))
  v = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape),
                                         jnp.float32), p)
  f = lambda q: model.apply({'params': q}, x)
  _, tangent = jax.jit(lambda q, t: jax.jvp(f, (q,), (t,)))(p, v)
  eps = 3e-4  # Central difference: error ~eps^2 (0.15 at 1e-2), ~2e-4 here.
  step = lambda s: jax.jit(f)(jax.tree.map(lambda a, b: a + s * eps * b,
                                           p, v))
  difference = (step(1) - step(-1)) / (2 * eps)
  np.testing.assert_allclose(tangent, difference,
                             atol=3e-3 * float(jnp.abs(difference).max()))
  of_x = lambda y: model.apply({'params': p}, y)
  np.testing.assert_allclose(jax.jit(jax.jacfwd(of_x))(x),
                             jax.jit(jax.jacrev(of_x))(x), atol=1e-5)
  loss = lambda q: (f(q) ** 2).sum()
  fwd_rev = jax.jit(lambda q: jax.jvp(jax.grad(loss), (q,), (v,))[1])(p)
  rev_rev = jax.jit(jax.grad(lambda q: jax.tree.reduce(
      lambda a, b: a + b, jax.tree.map(lambda g, t: (g * t).sum(),
                                       jax.grad(loss)(q), v))))(p)
  for a, b in zip(jax.tree.leaves(fwd_rev), jax.tree.leaves(rev_rev)):
    np.testing.assert_allclose(a, b, atol=1e-4 * (1 + float(
        jnp.abs(b).max())))


def test_attention_decides_plain_autodiff_by_its_dtype_field(rng):
  """`recompute.plain_autodiff` takes each layer's `dtype` field (None:
  float32), never its input's: attention with dtype=None on bf16 inputs
  computes in float32 with its float32 parameters, and is plain autodiff
  there as the MLP beside it is (`jax.jvp` raised on its custom VJP when it
  decided by the input's bf16)."""
  from vit_jax.models import attention
  layer = attention.MultiHeadDotProductAttention(num_heads=2, dtype=None)
  x = jnp.asarray(rng.uniform(-1, 1, (2, 5, 8)), jnp.bfloat16)
  p = layer.init(jax.random.key(0), x, deterministic=True)
  f = lambda q: layer.apply(q, x, deterministic=True)
  t = jax.tree.map(jnp.ones_like, p)
  out, tangent = jax.jvp(f, (p,), (t,))
  assert out.dtype == tangent.dtype == jnp.float32


@pytest.mark.parametrize('targets', ['cuda', 'gpu'])
def test_cudnn_attention_traced_for_gpus_is_cudnn_or_an_error(targets):
  """A program traced for NVIDIA GPUs with "cudnn" attention carries cuDNN's
  call, or, on a host where jax cannot build it (no GPU or cuDNN: this CPU
  host), is an error naming the choice: it used to be XLA attention, with a
  warning, so that the program depended on the host that traced it."""
  from vit_jax.models import platform_switch
  model = models.create('ViT-test', num_classes=3, dtype=jnp.bfloat16,
                        attention_impl='cudnn')
  x = jnp.zeros((2, 8, 8, 3))
  p = _init(model, x.shape)
  fn = jax.jit(lambda q: model.apply({'params': q}, x))
  try:
    with platform_switch.tracing_for(targets):
      text = fn.trace(p).lower(lowering_platforms=('cuda',)).as_text()
  except ValueError as e:
    assert "attention_impl='cudnn'" in str(e)
    assert "attention_impl='xla'" in str(e)  # The fix.
  else:
    assert '__cudnn$fmha' in text


def test_cudnn_attention_elsewhere_is_xla_whatever_the_host(monkeypatch,
                                                            caplog):
  """Traced for platforms without NVIDIA GPUs, "cudnn" attention is "xla"
  without asking jax for cuDNN's call (which would succeed on a GPU host and
  put a cuDNN call into a CPU or TPU program); where the platforms are
  unknown, jax is asked (a call it cannot build falls back to "xla")."""
  from vit_jax.models import attention, platform_switch
  model = models.create('ViT-test', num_classes=3, dtype=jnp.bfloat16,
                        attention_impl='cudnn')
  x = jnp.asarray(np.random.RandomState(0).uniform(-1, 1, (2, 8, 8, 3)),
                  jnp.float32)
  p = _init(model, x.shape)
  want = model.clone(attention_impl='xla').apply({'params': p}, x)
  asked = []
  build = attention._valid_only
  monkeypatch.setattr(attention, '_valid_only', lambda *a: (
      asked.append(a[-1]), build(*a))[1])
  with caplog.at_level('WARNING'):
    with platform_switch.tracing_for('cpu'):
      got = model.apply({'params': p}, x)
  assert 'cudnn' not in asked and 'NVIDIA GPUs only' in caplog.text
  np.testing.assert_allclose(got, want, atol=1e-6)  # One padded token.
  model.apply({'params': p}, x)  # Platforms unknown: this host decides.
  assert 'cudnn' in asked


@pytest.mark.parametrize('scan', [False, True])
def test_params_of_another_image_size_name_the_resize(scan):
  """Position embeddings of another token count (parameters made at 8 px,
  applied at 12 px) are a ValueError with both counts and the resize to
  use, not flax's shape error about an initializer."""
  model = models.create('ViT-test', num_classes=3, scan_layers=scan)
  p = _init(model, (1, 8, 8, 3))  # 2x2 patches + the class token.
  with pytest.raises(ValueError, match='resize_posemb') as e:
    model.apply({'params': p}, jnp.zeros((1, 12, 12, 3)))
  assert 'holds 5 positions' in str(e.value) and '10 tokens' in str(e.value)
  assert 'trained.resized' in str(e.value)


def test_mixer_pads_a_partial_patch_as_the_reference_does():
  """The reference Mixer's stem is flax's default SAME convolution: at 200
  px with /16 patches it has 13x13 tokens (its token-mixing kernel 169
  wide), every pixel seen; its FLOPs count those tokens."""
  model = models.create('Mixer-S/16', num_classes=10, hidden_dim=32,
                        num_blocks=1, tokens_mlp_dim=16, channels_mlp_dim=64)
  params = _init(model, (1, 200, 200, 3))
  assert params['MixerBlock_0']['token_mixing']['Dense_0']['kernel'].shape == (
      169, 16)
  x = np.zeros((1, 200, 200, 3), np.float32)
  corner = x.copy()
  corner[:, -1, -1] = 1.0  # A pixel of the last, partial patch.
  out = [model.apply({'params': perturb(params)}, jnp.asarray(v))
         for v in (x, corner)]
  assert not np.allclose(out[0], out[1])
  spec = models.options('Mixer-S/16', hidden_dim=32, num_blocks=1,
                        tokens_mlp_dim=16, channels_mlp_dim=64)
  analytic = models.family('Mixer-S/16').flops(spec, 200, 200, 10)
  xla = accounting.module_forward_flops(model, (200, 200, 3))
  assert 0.9 < analytic / xla < 1.1, (analytic, xla)


@pytest.mark.parametrize('name', ['ViT-B/16', 'R50+ViT-B/16', 'BiT-R50x1',
                                  'Mixer-B/16'])
def test_nchw_images_are_named_as_such(name):
  """PyTorch-layout (N, 3, H, W) images: the error says NCHW and the
  transpose, not a size problem."""
  model = models.create(name, num_classes=5)
  with pytest.raises(ValueError, match=r'look NCHW.*transpose\(0, 2, 3, 1\)'):
    jax.eval_shape(model.init, jax.random.key(0),
                   jnp.zeros((2, 3, 224, 224)))
