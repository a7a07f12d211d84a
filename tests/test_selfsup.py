"""Masked patch prediction (issue 13): targets, corruption, the MPP model and
its training runs (smoke, fine-tuning from it, resume after SIGKILL)."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from absl.testing import absltest  # noqa: F401 (absl logging handlers)

from conftest import perturb, xla_flags
from vit_jax import models, selfsup
from vit_jax.checkpoint import load_pretrained
from vit_jax.configs import mpp as mpp_config
from vit_jax.data.errors import DataError
from vit_jax.train import config_check, orbax_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS='cpu')
# The CPU-scale MPP config, shrunk (8x8 digits, 2x2 grid of 4x4 patches).
BASE = ['--config=configs/mpp.py:data=cpu,smoke=true',
        '--config.total_steps=40', '--config.log_every=10',
        '--config.checkpoint_every=10', '--config.async_checkpoints=false',
        '--config.optim.warmup_steps=5']


def _main(workdir, *flags, base=BASE):
  return subprocess.run(
      [sys.executable, '-m', 'vit_jax.main', f'--workdir={workdir}', *base,
       *flags], cwd=ROOT, capture_output=True, text=True, env=ENV)


def _rows(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(l) for l in f if l.strip()]


def _summary(workdir):
  with open(os.path.join(workdir, 'summary.json')) as f:
    return json.load(f)


# 1. Targets.

def _np_colour(images, p, bits):
  b, h, w, c = images.shape
  x = images.astype(np.float64).reshape(b, h // p, p, w // p, p, c)
  means = x.mean(axis=(2, 4)).reshape(b, -1, c)  # Row-major grid.
  levels = 2 ** bits
  q = np.minimum(np.floor((means + 1) / 2 * levels), levels - 1).astype(int)
  out = np.zeros(q.shape[:2], int)
  for i in range(c):
    out = out * levels + q[..., i]
  return out


def test_colour_targets_of_known_patches():
  img = -np.ones((1, 32, 48, 3), np.float32)  # Black: class 0.
  img[0, :16, 16:32] = 1.0  # Saturated white: 7,7,7 -> 511.
  img[0, 16:, :16, 0] = 1.0  # Pure red: 7,0,0 -> 7 * 64 = 448.
  img[0, 16:, 32:, 2] = 1.0  # Pure blue: 0,0,7 -> 7.
  t = np.asarray(selfsup.patch_colour_targets(jnp.asarray(img), 16))
  assert t.dtype == np.int32 and t.shape == (1, 6)
  assert t.tolist() == [[0, 511, 0, 448, 0, 7]]
  # Mid-grey (0.0 -> 0.5 -> level 4 of 8) and 1 bit (2 levels).
  grey = np.zeros((1, 16, 16, 3), np.float32)
  assert int(selfsup.patch_colour_targets(grey, 16)[0, 0]) == 4 * 73
  assert int(selfsup.patch_colour_targets(grey, 16, bits=1)[0, 0]) == 7


def test_colour_targets_match_numpy_on_mixed_patches(rng):
  img = rng.uniform(-1, 1, (3, 24, 16, 3)).astype(np.float32)
  img[0, :8, :8] = 1.0  # A saturated patch among random ones.
  for bits in (1, 3, 5):
    got = np.asarray(selfsup.patch_colour_targets(jnp.asarray(img), 8, bits))
    np.testing.assert_array_equal(got, _np_colour(img, 8, bits))
  assert got[0, 0] == 2**15 - 1


def test_one_channel_images_have_2_to_the_bits_classes(rng):
  img = rng.uniform(-1, 1, (2, 8, 8, 1)).astype(np.float32)
  got = np.asarray(selfsup.patch_colour_targets(img, 4))
  np.testing.assert_array_equal(got, _np_colour(img, 4, 3))
  assert got.max() < 8 and selfsup.num_classes(3, 1) == 8
  assert np.asarray(selfsup.patch_colour_targets(
      np.ones((1, 4, 4, 1), np.float32), 4)).tolist() == [[7]]


def test_downsized_and_pixel_targets(rng):
  img = rng.uniform(-1, 1, (2, 16, 16, 3)).astype(np.float32)
  got = np.asarray(selfsup.downsized_targets(img, 8, bits=3, size=4))
  assert got.shape == (2, 4, 16)
  # Each 2x2 cell of an 8x8 patch is one colour class.
  patch = img[1, 8:, :8]  # Grid position 2 (row 1, col 0).
  cells = patch.reshape(4, 2, 4, 2, 3).mean(axis=(1, 3)).reshape(1, 16, 3)
  want = _np_colour(cells.reshape(1, 4, 4, 3).repeat(1, 0), 1, 3)
  np.testing.assert_array_equal(got[1, 2], want[0])
  pix = np.asarray(selfsup.pixel_targets(img, 8))
  assert pix.shape == (2, 4, 8 * 8 * 3)
  np.testing.assert_array_equal(pix[1, 2], img[1, 8:, :8].reshape(-1))


def test_target_errors_name_the_problem():
  img = np.zeros((1, 28, 28, 3), np.float32)
  for bits in (0, 9, 2.5):
    with pytest.raises(ValueError, match='out of range'):
      selfsup.patch_colour_targets(img, 4, bits)
  with pytest.raises(ValueError, match='not divisible by the patch size 16'):
    selfsup.patch_colour_targets(img, 16)
  with pytest.raises(ValueError, match='divisible by 4'):
    selfsup.downsized_targets(np.zeros((1, 12, 12, 3)), 6)


# 2. Corruption.

def _tokens(b, n, d=4):
  """Token i of the flattened batch is (i, i, ...): identifiable."""
  return jnp.tile(jnp.arange(b * n, dtype=jnp.float32).reshape(b, n, 1),
                  (1, 1, d))


def test_corruption_proportions_over_a_large_batch():
  b, n = 512, 196
  tokens = _tokens(b, n)
  mask = jnp.full((4,), -1.0)
  out, sel = selfsup.corrupt(jax.random.key(0), tokens, mask, rate=0.5)
  out, sel, tok = np.asarray(out), np.asarray(sel), np.asarray(tokens)
  assert sel.dtype == bool and sel.shape == (b, n)
  assert (sel.sum(1) == 98).all()  # Exactly 50% of each image's patches.
  masked = (out == -1).all(-1)
  kept = (out == tok).all(-1)
  swapped = ~masked & ~kept
  total = sel.sum()
  assert not (masked | swapped)[~sel].any()
  np.testing.assert_array_equal(out[~sel], tok[~sel])  # Unselected intact.
  assert abs(masked.sum() / total - 0.8) < 0.01
  assert abs(swapped.sum() / total - 0.1) < 0.01
  assert abs((kept & sel).sum() / total - 0.1) < 0.01
  # Swapped-in embeddings are other patches of the same image, never the
  # position's own, drawn from all of the image's other positions.
  src = out[swapped][:, 0].astype(int)
  own = np.arange(b * n).reshape(b, n)[swapped]
  assert (src // n == own // n).all() and (src != own).all()
  counts = np.bincount(src % n, minlength=n)  # About 26 per position.
  assert counts.min() > 0 and counts.max() < 3 * counts.mean()
  # Every position is selected about equally often.
  assert sel.mean(0).min() > 0.35 and sel.mean(0).max() < 0.65


def test_an_image_of_one_patch_is_masked_or_kept_never_swapped():
  tokens = _tokens(64, 1)
  out, sel = selfsup.corrupt(jax.random.key(0), tokens, jnp.full((4,), -1.0))
  out, tok = np.asarray(out)[:, 0], np.asarray(tokens)[:, 0]
  assert np.asarray(sel).all()
  masked, kept = (out == -1).all(-1), (out == tok).all(-1)
  assert (masked | kept).all() and masked.any() and kept.any()


# The corruption and its gradient, compiled for the batch sharded over
# `devices` of 8 simulated CPU devices at 4 images per device; prints (JSON)
# the per-device temporary bytes and the compiled program's collectives with
# the number of elements each moves.
_SHARDED_CORRUPTION = r"""
import json, math, re, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from vit_jax import selfsup
devices = int(sys.argv[1])
mesh = Mesh(np.array(jax.devices()[:devices]), ('data',))
rows, cols = NamedSharding(mesh, P('data')), NamedSharding(mesh, P())
tokens = jax.ShapeDtypeStruct((4 * devices, 16, 64), jnp.float32,
                              sharding=rows)
mask = jax.ShapeDtypeStruct((64,), jnp.float32, sharding=cols)
def loss(t, m, key):
  return jnp.sum(selfsup.corrupt(key, t, m)[0] ** 2)
step = jax.jit(jax.grad(loss, argnums=(0, 1)), out_shardings=(rows, cols))
compiled = step.lower(tokens, mask, jax.random.key(0)).compile()
ops = [(op, math.prod(int(x) for x in dims.split(',') if x)) for dims, op in
       re.findall(r'= \w+\[([\d,]*)\]\S* (all-gather|all-to-all|'
                  r'all-reduce|collective-permute|reduce-scatter)',
                  compiled.as_text())]
print(json.dumps([compiled.memory_analysis().temp_size_in_bytes, ops]))
"""


def test_sharded_corruption_is_local_to_each_device():
  """With the batch sharded, each device corrupts its own images: no
  patch embeddings cross devices (at most the `[mask]` gradient is summed)
  and its memory does not grow with the global batch."""
  env = dict(ENV, PYTHONPATH=ROOT, XLA_FLAGS=xla_flags(8))
  found = {}
  for devices in (2, 8):
    out = subprocess.run([sys.executable, '-c', _SHARDED_CORRUPTION,
                          str(devices)], capture_output=True, text=True,
                         env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    found[devices] = json.loads(out.stdout.strip().splitlines()[-1])
  for devices, (_, ops) in found.items():
    # The token shard alone is 4 x 16 x 64 elements; the mask 64.
    assert all(size <= 64 for _, size in ops), (devices, ops)
  assert found[8][0] == found[2][0], found  # 4x the global batch.


def test_corruption_is_a_pure_function_of_the_rng():
  tokens = _tokens(8, 49)
  mask = jnp.zeros((4,))
  a = selfsup.corrupt(jax.random.key(3), tokens, mask)
  b = jax.jit(selfsup.corrupt, static_argnums=3)(jax.random.key(3), tokens,
                                                 mask, 0.5)
  c = selfsup.corrupt(jax.random.key(4), tokens, mask)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert not np.array_equal(np.asarray(a[1]), np.asarray(c[1]))
  sel = selfsup.corrupt(jax.random.key(0), tokens, mask, rate=0.15)[1]
  assert (np.asarray(sel).sum(1) == 7).all()  # round(0.15 * 49).
  with pytest.raises(ValueError, match='in \\(0, 1\\]'):
    selfsup.corrupt(jax.random.key(0), tokens, mask, rate=0.0)


# 3. The model and its checkpoint.

def _mpp_model(**kw):
  return selfsup.from_vit(models.create('ViT-test', num_classes=0), **kw)


def test_the_evaluation_corrupts_an_image_the_same_in_any_batch():
  """The held-out MPP evaluation draws each image's corruption from its
  pixels: its sums do not depend on the eval batch size, the image's place
  in the batch or the padding."""
  from vit_jax.evaluators import mpp as mpp_eval
  model = _mpp_model(rate=0.25)
  images = np.random.default_rng(0).uniform(-1, 1, (6, 28, 28, 3)).astype(
      np.float32)
  params = model.init(jax.random.key(0), images[:1])['params']
  params = jax.tree.map(  # A head that predicts something.
      lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape),
      params)
  sums = lambda im, mask: mpp_eval.batch_sums(
      params, {'image': jnp.asarray(im), 'mask': jnp.asarray(mask)},
      jax.random.key(7), model=model)
  whole = sums(images, np.ones(6, bool))
  first = sums(images[3::-1], np.ones(4, bool))  # Reversed.
  padded = np.concatenate([images[4:], np.zeros_like(images[:2])])
  rest = sums(padded, np.array([1, 1, 0, 0], bool))
  assert float(whole['count']) == float(first['count'] + rest['count']) > 0
  for key in ('loss', 'correct', 'examples'):
    assert float(whole[key]) == pytest.approx(
        float(first[key] + rest[key]), rel=1e-5), key
  keys = selfsup.image_keys(jax.random.key(7), jnp.asarray(images))
  again = selfsup.image_keys(jax.random.key(7), jnp.asarray(images[::-1]))
  data = jax.random.key_data
  np.testing.assert_array_equal(data(keys), data(again)[::-1])
  assert len({tuple(np.asarray(k).ravel()) for k in data(keys)}) == 6


def test_mpp_params_initialise_a_classifier_without_head_or_mask(caplog):
  images = jnp.zeros((2, 28, 28, 3))
  params = _mpp_model().init(jax.random.key(0), images)['params']
  assert params['mask_token'].shape == (32,)
  assert params['mpp_head']['kernel'].shape == (32, 512)
  params = jax.tree.map(lambda x: np.asarray(x) + 1.0, params)
  vit = models.create('ViT-test', num_classes=10)
  init = vit.init(jax.random.key(1), images)['params']
  # On absl's logger: an earlier in-process absl flag parse in this worker
  # sets its level to WARNING, which the root level would not override.
  with caplog.at_level('INFO', logger='absl'):
    loaded = load_pretrained(params, init)
  assert 'mask_token, mpp_head' in caplog.text
  assert set(loaded) == set(init)
  np.testing.assert_array_equal(loaded['head']['kernel'], 0.0)  # Fresh head.
  np.testing.assert_array_equal(loaded['embedding']['kernel'],
                                params['embedding']['kernel'])
  vit.apply({'params': loaded}, images)  # Runs as a classifier.
  # With a representation layer the MPP model lacks: a fresh one (as
  # config_check advises for a pre-training row's pre-logits).
  rep = models.create('ViT-test', num_classes=10, representation_size=16)
  init = rep.init(jax.random.key(1), images)['params']
  with caplog.at_level('INFO', logger='absl'):
    loaded = load_pretrained(params, init)
  assert 'has no pre_logits' in caplog.text
  np.testing.assert_array_equal(loaded['pre_logits']['kernel'],
                                init['pre_logits']['kernel'])
  # The other way: a classifier's weights continued as MPP get a fresh
  # mask token and head.
  mpp_init = _mpp_model().init(jax.random.key(2), images)['params']
  loaded = load_pretrained(init, mpp_init)
  np.testing.assert_array_equal(loaded['mask_token'], mpp_init['mask_token'])
  np.testing.assert_array_equal(loaded['embedding']['kernel'],
                                init['embedding']['kernel'])


def test_forward_without_rng_is_uncorrupted_and_sows_the_representation():
  images = jax.random.uniform(jax.random.key(0), (2, 28, 28, 3), minval=-1)
  for rep in ('token', 'gap'):
    model = _mpp_model(representation=rep, target='downsized')
    params = model.init(jax.random.key(0), images)['params']
    (out, sel), state = model.apply({'params': params}, images,
                                    mutable=['intermediates'])
    assert out.shape == (2, 49, 16, 512) and not np.asarray(sel).any()
    assert state['intermediates']['representation'][0].shape == (2, 32)
    _, sel = model.apply({'params': params}, images,
                         rngs={'mpp': jax.random.key(1)})
    assert (np.asarray(sel).sum(1) == 25).all()
  out, _ = _mpp_model(target='pixels').apply(
      {'params': _mpp_model(target='pixels').init(
          jax.random.key(0), images)['params']}, images)
  assert out.shape == (2, 49, 4 * 4 * 3)


def test_mpp_refuses_a_size_that_leaves_pixels_out(caplog):
  """The targets cut every pixel into patches, so the model refuses a size
  a plain ViT would take (logging the pixels it leaves out): one error,
  naming the fix, and no "not seen" warning before it."""
  model = _mpp_model()
  assert not model.drops_partial_patches
  with caplog.at_level('WARNING'), pytest.raises(
      ValueError, match=r'30x30 is not divisible by the patch size 4.*'
      r'e\.g\. 32x32'):
    jax.eval_shape(lambda: model.init(jax.random.key(0),
                                      jnp.zeros((1, 30, 30, 3))))
  assert 'not seen' not in caplog.text


def test_mpp_forward_flops_count_the_head():
  plain = __import__('vit_jax.accounting', fromlist=['x'])
  base = plain.forward_flops('ViT-test', 28, 0)
  mpp = plain.mpp_forward_flops('ViT-test', 28)
  head = 2 * 49 * 32 * 512  # 49 patch tokens through a 32 -> 512 head.
  assert 0.99 * head < mpp - base < 1.2 * head


# The objective: the loss over the selected positions, each output token
# scored against its own patch.

def _np_pixels(images, p):
  b, h, w, c = images.shape
  x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, (h // p) * (w // p), p * p * c)  # Row-major grid.


@pytest.mark.parametrize('target', ['colour', 'pixels'])
def test_the_loss_is_over_the_selected_positions_only(rng, target):
  """The loss (and accuracy) is the mean over the corrupted (selected)
  positions of each one's cross-entropy (L2 for pixels), computed here by
  hand; the other positions' outputs get exactly zero gradient (the model
  is not trained to copy the patches it sees)."""
  images = rng.uniform(-1, 1, (3, 8, 12, 3)).astype(np.float32)  # 2x3 grid.
  selected = np.zeros((3, 6), bool)
  selected[0, [1, 4]] = selected[1, 0] = selected[2, [2, 3, 5]] = True
  if target == 'colour':
    tgt = _np_colour(images, 4, 3)
    logits = rng.normal(0, 3, (3, 6, 512))
    logits[0, 1, tgt[0, 1]] += 30.0  # One selected position right...
    logits[1, 3, tgt[1, 3]] += 30.0  # ... and one unselected.
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    per = -np.take_along_axis(logp, tgt[..., None], -1)[..., 0]
    outputs = logits[:, :, None].astype(np.float32)  # One prediction each.
  else:
    outputs = rng.normal(0, 1, (3, 6, 4 * 4 * 3)).astype(np.float32)
    outputs[~selected] += 2.0  # Worse where unselected.
    per = np.mean(np.square(outputs - _np_pixels(images, 4)), -1)
  assert abs(per[selected].mean() - per.mean()) > 0.05  # Tells them apart.

  def loss_of(out):
    return selfsup.loss_and_metrics(out, jnp.asarray(selected),
                                    jnp.asarray(images), target=target,
                                    stride=4, bits=3)

  loss, metrics = loss_of(jnp.asarray(outputs))
  assert float(loss) == pytest.approx(per[selected].mean(), rel=1e-5)
  if target == 'colour':
    assert float(metrics['mpp_accuracy']) == pytest.approx(1 / 6)
  else:
    assert metrics == {}
  grad = np.asarray(jax.grad(lambda o: loss_of(o)[0])(jnp.asarray(outputs)))
  assert not grad[~selected].any()
  assert (np.abs(grad[selected]).reshape(6, -1).max(-1) > 0).all()


@pytest.mark.parametrize('classifier', ['token', 'gap'])
def test_each_output_token_is_scored_against_its_own_patch(rng, classifier):
  """Output i is patch i's prediction. Without encoder blocks
  (num_layers=0: no attention mixes the tokens) recolouring one patch
  changes its target, the model's output and the loss at that position
  only; an output sliced off by one (the class token scored as patch 0)
  or transposed (a 2x3 grid: row-major 2 is column-major 4) would move
  the change to another position than its target's."""
  model = selfsup.from_vit(
      models.create('ViT-test', num_classes=0, num_layers=0,
                    classifier=classifier), representation=classifier)
  images = rng.uniform(-1, 1, (2, 8, 12, 3)).astype(np.float32)
  params = perturb(model.init(jax.random.key(0), images)['params'], 0.5)
  recoloured = images.copy()
  recoloured[0, :4, 8:] = 1.0  # Image 0, row 0, column 2: white.
  targets = [np.asarray(selfsup.make_targets(x, 'colour', 4, 3))[..., 0]
             for x in (images, recoloured)]
  changed = targets[0] != targets[1]
  assert np.argwhere(changed).tolist() == [[0, 2]]  # Row-major patch 2.
  outputs = [model.apply({'params': params}, jnp.asarray(x))[0]
             for x in (images, recoloured)]
  moved = np.abs(np.asarray(outputs[1] - outputs[0])).reshape(2, 6, -1)
  np.testing.assert_array_equal(moved.max(-1) > 0, changed)
  for i in range(6):
    at = np.zeros((2, 6), bool)
    at[0, i] = True
    loss = [float(selfsup.loss_and_metrics(
        out, jnp.asarray(at), jnp.asarray(x), target='colour', stride=4,
        bits=3)[0]) for out, x in zip(outputs, (images, recoloured))]
    assert (loss[0] != loss[1]) == (i == 2), (i, loss)


# 4. Bad input fails before compiling.

def _cfg(arg='data=cpu,smoke=true', **flags):
  c = mpp_config.get_config(arg)
  for k, v in flags.items():
    node = c
    *path, last = k.split('.')
    for p in path:
      node = node[p]
    node[last] = v
  return c


@pytest.mark.parametrize('flags,message', [
    (dict(**{'mpp.bits': 0}), 'mpp.bits=0 is out of range'),
    (dict(**{'mpp.bits': 9}), 'mpp.bits=9 is out of range'),
    (dict(**{'mpp.rate': 1.5}), 'mpp.rate=1.5 cannot work'),
    (dict(**{'mpp.target': 'depth'}), "mpp.target='depth' cannot work"),
    (dict(**{'input.image_size': 10}),
     'image_size=10 is not divisible by the patch size 4'),
    (dict(**{'model.name': 'BiT-R50x1', 'model.patch_size': None,
             'model.hidden_size': None, 'model.mlp_dim': None,
             'model.num_heads': None, 'model.num_layers': None}),
     'has no patch embeddings'),
    (dict(**{'model.name': 'R50+ViT-B/16', 'model.patch_size': None,
             'model.resnet_layers': (1, 1, 1), 'model.resnet_width': 0.25}),
     'hybrid .R50\\+ViT. cannot work'),
    (dict(objective='byol'), "objective='byol' cannot work"),
    (dict(**{'input.cutmix': 1.0}), 'input.cutmix mixes labels'),
    (dict(**{'model.classifier': 'gap'}),
     "representation='token' needs the class token"),
    (dict(**{'model.classifier': 'map'}),
     "classifier='map' pools a classifier's tokens"),
    # The supervised loss and head's settings, which MPP never reads.
    (dict(loss='sigmoid'), "loss='sigmoid' is the labels' loss.*"
     'set --config.loss=softmax'),
    (dict(label_smoothing=0.1), 'label_smoothing=0.1 smooths labels.*'
     'set --config.label_smoothing=0'),
])
def test_bad_mpp_configs_fail_before_compiling(flags, message):
  with pytest.raises(ValueError, match=message):
    config_check.check(_cfg(**flags))
  config_check.check(_cfg())  # The unmodified config is fine.


def test_mpp_refuses_the_supervised_settings_for_training_only():
  """Evaluating a checkpoint reads none of them, so `mode=eval` of a run
  of an earlier version that set them is not refused; zero or unset
  values are fine. The head bias, a model option a checkpoint records, is
  not refused: an MPP run started with one must still resume."""
  c = _cfg(loss='sigmoid', label_smoothing=0.1,
           **{'model.head_bias_init': -10.0})
  with pytest.raises(config_check.ConfigError) as e:
    config_check.check(c)
  assert len(str(e.value).splitlines()) == 3  # Both at once.
  assert 'head_bias_init' not in str(e.value)
  c.mode = 'eval'
  config_check.check(c)
  config_check.check(_cfg(loss='softmax', label_smoothing=0.0,
                          **{'model.head_bias_init': -10.0}))


def test_mpp_images_must_be_in_minus_one_to_one():
  """Colour targets quantise [-1, 1]: other ranges are refused before
  training (they trained on a few levels, or on one constant class); the
  pixel regression takes any."""
  c = _cfg()
  selfsup.check_value_range(c.input, 'colour')  # The config's own: fine.
  for pp, message in (('decode|resize(28)|value_range(0,1)', r'\[0, 1\]'),
                      ('decode|resize(28)', 'no value_range op'),
                      # [-1, 1], but from pixels in [0, 1]: saturated.
                      ('decode|resize(28)|value_range(-1, 1, 0, 1)',
                       'in_min=0, in_max=1')):
    c.input.pp_train = pp
    for target in ('colour', 'downsized'):
      # A DataError: the trainer prints its one line, no traceback.
      with pytest.raises(DataError, match=r'input.pp_train=.*' + message):
        selfsup.check_value_range(c.input, target)
    selfsup.check_value_range(c.input, 'pixels')


def test_a_classification_evaluator_of_an_mpp_run_is_refused_when_built():
  """An MPP model has no head: the evaluator is refused when it is built,
  naming the ones that work, not by a TypeError at its first run."""
  import ml_collections
  from vit_jax import evaluators, sharding as shd
  c = mpp_config.get_config('smoke=true')
  c.evals.cls = ml_collections.ConfigDict(dict(type='classification'))
  mesh = shd.make_mesh(**c.mesh)
  model = selfsup.model_from_config(c, 0, 'cpu')
  size = c.input.image_size
  with pytest.raises(ValueError, match=r"evals\.cls: type=classification .*"
                     r"has none: set evals\.cls\.type='mpp' .* or "
                     r"'fewshot'"):
    evaluators.build(c, model, mesh, shd.replicated(mesh), (size, size, 3))


def test_an_mpp_run_on_other_pixel_values_stops_before_training(tmp_path):
  out = _main(str(tmp_path / 'bad'),
              '--config.input.pp_train=decode|resize(8)|value_range(0,1)')
  assert out.returncode == 1, out.stderr[-3000:]
  assert ('end input.pp_train with value_range(-1, 1) as input.pp_eval '
          'does') in out.stderr
  assert not os.path.exists(tmp_path / 'bad' / 'checkpoints')


def test_configs_follow_the_paper_row():
  c = mpp_config.get_config()
  assert c.objective == 'mpp' and c.model.name == 'ViT-B/16'
  assert c.input.data == 'jft' and c.input.batch_size == 4096
  assert c.total_steps == 1_000_000
  assert (c.optim.name, c.optim.lr, c.optim.warmup_steps, c.optim.decay) == (
      'adam', 2e-4, 10_000, 'cosine')
  assert c.mpp.to_dict() == dict(target='colour', bits=3, rate=0.5,
                                 representation='token')
  assert mpp_config.get_config('data=i21k').input.data == 'imagenet21k'
  assert mpp_config.get_config('data=i1k,epochs=300').total_epochs == 300
  assert mpp_config.get_config('target=pixels').mpp.target == 'pixels'
  with pytest.raises(ValueError, match='data='):
    mpp_config.get_config('data=coco')
  for arg in ('', 'data=i21k,target=downsized', 'data=cpu'):
    config_check.check(mpp_config.get_config(arg))


# 5. Runs: smoke (loss decreases, no labels), fine-tuning from it, resume.

@pytest.fixture(scope='module')
def mpp_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('mpp') / 'run')
  out = _main(workdir)
  assert out.returncode == 0, out.stderr[-4000:]
  return workdir


def test_smoke_mpp_run_decreases_its_loss(mpp_run):
  train = [r for r in _rows(mpp_run) if 'loss' in r]
  assert [r['step'] for r in train] == [10, 20, 30, 40]
  assert train[-1]['loss'] < train[0]['loss'] - 0.5, train
  s = _summary(mpp_run)
  assert s['eval_examples'] == 200 and 0 < s['eval_mpp_accuracy'] <= 1
  assert 'eval_accuracy' not in s  # No labels, no classifier accuracy.
  assert 'fewshot/digits/5shot' in s  # The encoder's representation.
  assert s['forward_gflops'] > 0 and s['exaflops'] > 0
  params = orbax_state.load_params(mpp_run)
  assert {'mask_token', 'mpp_head'} <= set(params) and 'head' not in params


def test_mpp_workdir_initialises_a_classifier(mpp_run):
  params = orbax_state.load_params(mpp_run)
  c = _cfg()
  vit = models.from_config(c.model, 10)
  init = vit.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))['params']
  loaded = load_pretrained(params, init)
  assert 'mask_token' not in loaded and 'mpp_head' not in loaded
  np.testing.assert_array_equal(loaded['Transformer']['encoder_norm']['scale'],
                                params['Transformer']['encoder_norm']['scale'])


def test_mode_eval_refuses_an_mpp_checkpoint_on_other_pixel_values(
    mpp_run, tmp_path):
  """`--config.mode=eval` checks the pixel range as training does (it
  reported a meaningless colour accuracy of [0, 1] images), before it
  reads the data or the weights."""
  from vit_jax.train import eval_run
  c = _cfg(mode='eval', init=mpp_run)
  size = c.input.image_size
  c.input.pp_train = c.input.pp_eval = (
      f'decode|resize({size})|value_range(0,1)')
  workdir = str(tmp_path / 'eval')
  with pytest.raises(ValueError, match=r'objective=mpp predicts colours of '
                     r'pixels in \[-1, 1\], but input\.pp_train=.*\[0, 1\]'):
    eval_run.evaluate_run(c, workdir)
  assert not os.path.exists(os.path.join(workdir, 'eval_summary.json'))


@pytest.mark.slow
def test_fine_tuning_and_eval_start_from_the_mpp_workdir(mpp_run, tmp_path):
  out = _main(str(tmp_path / 'ft'), '--config.init=' + mpp_run,
              '--config.total_steps=10',
              base=['--config=configs/cpu_reproduce.py:step=transfer,'
                    'smoke=true', '--config.input.data=digits',
                    '--config.input.image_size=8',
                    '--config.input.pp_train=decode|resize(8)|'
                    'value_range(-1,1)',
                    '--config.input.pp_eval=decode|resize(8)|'
                    'value_range(-1,1)', '--config.model.hidden_size=32',
                    '--config.model.mlp_dim=64', '--config.model.num_heads=2',
                    '--config.model.num_layers=2'])
  assert out.returncode == 0, out.stderr[-4000:]
  assert 'masked-patch-prediction model: dropping its mask_token, mpp_head' \
      in out.stderr
  assert f'initialised from {mpp_run}' in out.stderr
  ft = _summary(str(tmp_path / 'ft'))
  assert 0 <= ft['eval_accuracy'] <= 1 and ft['init_objective'] == 'mpp'
  # --config.mode=eval of the MPP workdir: held-out MPP loss and few-shot.
  ev = _main(str(tmp_path / 'ev'), '--config.mode=eval',
             '--config.init=' + mpp_run, '--config.mpp.representation=gap')
  assert ev.returncode == 0, ev.stderr[-4000:]
  with open(os.path.join(str(tmp_path / 'ev'), 'eval_summary.json')) as f:
    res = json.load(f)
  assert res['eval_mpp_loss'] == pytest.approx(
      _summary(mpp_run)['eval_mpp_loss'], rel=1e-5)
  assert 'fewshot/digits/5shot' in res


def _final_params(workdir):
  d = os.path.join(workdir, 'checkpoints')
  step = max(int(s) for s in os.listdir(d) if s.isdigit())
  state = ocp.StandardCheckpointer().restore(os.path.join(d, str(step),
                                                          'state'))
  return step, jax.tree.leaves(state['params'])


@pytest.mark.slow
@pytest.mark.timeout(1800)  # Its own deadline (900 s) and two runs' time.
def test_sigkill_and_resume_matches_the_uninterrupted_mpp_run(mpp_run,
                                                             tmp_path):
  workdir = str(tmp_path / 'killed')
  proc = subprocess.Popen(
      [sys.executable, '-m', 'vit_jax.main', f'--workdir={workdir}', *BASE],
      cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  first = os.path.join(workdir, 'checkpoints', '10')
  deadline = time.time() + 900  # Generous: CI machines can be loaded.
  while time.time() < deadline and proc.poll() is None:
    if os.path.isdir(first):
      break
    time.sleep(0.05)
  assert os.path.isdir(first), 'no checkpoint before the deadline'
  time.sleep(random.uniform(0.0, 0.3))
  proc.send_signal(signal.SIGKILL)
  assert proc.wait() == -signal.SIGKILL, 'the run ended before the kill'
  out = _main(workdir)
  assert out.returncode == 0, out.stderr[-4000:]
  assert 'resumed from step' in out.stderr
  step, got = _final_params(workdir)
  ref_step, ref = _final_params(mpp_run)
  assert step == ref_step == 40
  for a, b in zip(got, ref):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert _summary(workdir)['train_loss'] == _summary(mpp_run)['train_loss']
  assert _summary(workdir)['eval_mpp_loss'] == _summary(mpp_run)[
      'eval_mpp_loss']


@pytest.mark.slow
def test_mpp_step_under_a_mesh_matches_one_device():
  """The corruption (a gather within each image) and the loss agree
  between one device and dp2-fsdp2-tp2 over 8 simulated devices."""
  here = os.path.join(ROOT, 'tests')

  def run(mesh, devices):
    env = dict(ENV, PYTHONPATH=ROOT, XLA_FLAGS=xla_flags(devices))
    out = subprocess.run(
        [sys.executable, os.path.join(here, 'mesh_steps.py'),
         json.dumps(mesh), json.dumps({'objective': 'mpp'})],
        capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])

  one = run({'data': -1}, 1)
  many = run({'data': 2, 'fsdp': 2, 'model': 2}, 8)
  assert many['devices'] == 8
  np.testing.assert_allclose(many['losses'], one['losses'], atol=1e-5)
  assert one['losses'][-1] < one['losses'][0]
  for k, v in one['params'].items():
    np.testing.assert_allclose(many['params'][k], v, atol=1e-5, err_msg=k)


def test_few_labels_step_of_the_cpu_pipeline():
  from vit_jax.configs import cpu_reproduce
  with pytest.raises(ValueError, match='data_dir='):
    cpu_reproduce.get_config('step=few_labels')
  c = cpu_reproduce.get_config('step=few_labels,data_dir=/d,init=/w,steps=90')
  assert (c.input.data, c.input.data_dir, c.init) == ('folder', '/d', '/w')
  assert (c.input.train_split, c.input.eval_split) == ('train', 'test')
  assert c.total_steps == 90 and c.optim.name == 'sgd'
  assert cpu_reproduce.get_config(
      'step=few_labels,data_dir=/d').init is None  # From scratch.
  assert cpu_reproduce.get_config(
      'step=few_labels,smoke=true').input.data == 'digits'


@pytest.mark.parametrize('arg', ['data=cpu,model=ViT-L/16',
                                 'data=cpu,fewshot=cifar100'])
def test_cpu_mpp_refuses_the_paper_rows_arguments_it_would_ignore(arg):
  """data=cpu trains the CPU reproduction's ViT and few-shot sets: a model=
  or fewshot= there would be silently ignored."""
  with pytest.raises(ValueError, match='would be ignored'):
    mpp_config.get_config(arg)
  mpp_config.get_config('data=cpu')
