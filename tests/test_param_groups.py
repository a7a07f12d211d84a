"""Per-parameter learning rates and freezing (vit_jax/train/param_groups.py):
frozen parameters stay bit-identical and get no optimiser state; multipliers
and layer-wise decay give the expected per-layer learning rates."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import traverse_util

from vit_jax import models
from vit_jax.checkpoint import stack_blocks
from vit_jax.train import optim


def _cfg(**kw):
  return ml_collections.ConfigDict({
      **dict(name='sgd', lr=0.1, warmup_steps=0, decay='constant',
             momentum=0.0), **kw})


def _setup(scan=False):
  model = models.create('ViT-test', num_classes=3, scan_layers=scan)
  x = jnp.asarray(np.random.RandomState(0).uniform(-1, 1, (4, 28, 28, 3)),
                  jnp.float32)
  plain = models.create('ViT-test', num_classes=3)
  params = jax.tree.map(lambda a: a + 0.1, plain.init(jax.random.key(0), x)[
      'params'])
  if scan:
    params = stack_blocks(jax.device_get(params))
  loss = lambda p: (model.apply({'params': p}, x) ** 2).mean()
  return params, loss


def _steps(cfg, params, loss, n=3):
  tx, _ = optim.make(cfg, 100)
  state = tx.init(params)
  for _ in range(n):
    g = jax.grad(loss)(params)
    u, state = tx.update(g, state, params)
    params = optax.apply_updates(params, u)
  return params, state


def test_frozen_parameters_are_bit_identical_and_have_no_state():
  params, loss = _setup()
  cfg = _cfg(name='adam', weight_decay=0.1, frozen='^(?!head/)')
  new, state = _steps(cfg, params, loss)
  flat_old = traverse_util.flatten_dict(params)
  flat_new = traverse_util.flatten_dict(new)
  for k in flat_old:
    if k[0] == 'head':
      assert not np.array_equal(flat_old[k], flat_new[k]), k
    else:
      np.testing.assert_array_equal(flat_old[k], flat_new[k], err_msg=str(k))
  n_params = sum(np.size(x) for x in jax.tree.leaves(params))
  head = sum(np.size(x) for x in jax.tree.leaves(params['head']))
  n_state = sum(np.size(x) for x in jax.tree.leaves(state)
                if np.ndim(x) > 0)
  assert n_state == 2 * head < n_params  # Adam's mu, nu for the head only.


@pytest.mark.parametrize('scan', [False, True])
def test_layer_decay_and_multipliers_scale_each_parameters_learning_rate(
    scan):
  params, loss = _setup(scan)
  g = jax.grad(loss)(params)
  cfg = _cfg(layer_decay=0.5, lr_mults=(('^head/', 3.0),))
  tx, _ = optim.make(cfg, 100)
  updates, _ = tx.update(g, tx.init(params), params)
  step = jax.tree.map(lambda u: -u, updates)  # SGD: lr * multiplier * g.

  def check(path, mult, index=None):
    got, grad = np.asarray(_get(step, path)), np.asarray(_get(g, path))
    if index is not None:
      got, grad = got[index], grad[index]
    assert np.abs(grad).max() > 0, path
    np.testing.assert_allclose(got, 0.1 * mult * grad, rtol=1e-3,
                               atol=1e-3 * 0.1 * mult * np.abs(grad).max())

  check('head/kernel', 3.0)
  check('Transformer/encoder_norm/scale', 1.0)
  check('embedding/kernel', 0.5 ** 3)
  key = 'Transformer/encoderblock{}/MlpBlock_0/Dense_0/kernel'
  if scan:
    check(key.format(''), 0.5 ** 2, 0)
    check(key.format(''), 0.5, 1)
  else:
    check(key.format('_0'), 0.5 ** 2)
    check(key.format('_1'), 0.5)


def _get(tree, path):
  for k in path.split('/'):
    tree = tree[k]
  return tree


@pytest.mark.parametrize('field,value,match', [
    ('frozen', '^nothing_here', 'matches no parameter'),
    ('frozen', '.*', 'nothing would train'),
    ('lr_mults', (('^hed/', 2.0),), "'\\^hed/'.*match no"),
    ('layer_decay', 1.5, 'layer_decay=1.5'),
    ('schedules', (('^hed/', {'warmup_steps': 0}),),
     "'\\^hed/'.*match no trained"),
    ('schedules', (('^head/', {'momentum': 0.5}),),
     "\\['momentum'\\]; a group schedule sets some of lr, warmup_steps"),
    ('schedules', ('^head/',), 'expected \\(regex, dict of lr')])
def test_bad_groups_are_clear_errors(field, value, match):
  params, _ = _setup()
  with pytest.raises(ValueError, match=match):
    tx, _ = optim.make(_cfg(**{field: value}), 100)
    tx.init(params)


@pytest.mark.parametrize('frozen', [None, '^embedding/'])
def test_groups_follow_their_own_schedules(frozen):
  """A head without warm-up and at 10x the LR beside a warmed-up body
  (SGD, no momentum: update = -lr_group(t) * gradient); grad clipping spans
  all groups; frozen parameters stay out."""
  params, loss = _setup()
  cfg = _cfg(warmup_steps=4, decay='linear', linear_end=0.0, frozen=frozen,
             schedules=(('^head/', {'warmup_steps': 0, 'lr': 1.0}),
                        ('encoder_norm', {'decay': 'constant'})))
  tx, lr = optim.make(cfg, 10)
  state = tx.init(params)
  g = jax.grad(loss)(params)
  for t in range(3):
    updates, state = tx.update(g, state, params)
    body = 0.1 * t / 4  # Linear warm-up to 0.1 over 4 steps.
    head = 1.0 * (1 - t / 10)  # No warm-up: linear decay from 1.0.
    assert float(lr(t)) == pytest.approx(body)
    for path, want in (('head/kernel', head),
                       ('Transformer/encoder_norm/scale', body),
                       ('Transformer/encoderblock_0/MlpBlock_0/Dense_0/'
                        'kernel', body)):
      np.testing.assert_allclose(np.asarray(_get(updates, path)),
                                 -want * np.asarray(_get(g, path)),
                                 rtol=1e-5, atol=1e-8, err_msg=f'{path} {t}')
    emb = np.asarray(_get(updates, 'embedding/kernel'))
    if frozen:
      np.testing.assert_array_equal(emb, 0.0)
    else:
      np.testing.assert_allclose(
          emb, -body * np.asarray(_get(g, 'embedding/kernel')), rtol=1e-5)


def test_a_run_with_frozen_scheduled_and_decayed_groups_trains(tmp_path):
  """Through the trainer (sharded state, checkpoint, resume layout): the
  frozen body is bit-identical in the checkpoint, the head moved."""
  from vit_jax.configs import smoke
  from vit_jax.train import loop, orbax_state
  c = smoke.get_config('data=digits,steps=4,batch=32')
  c.optim.frozen = '^embedding/'
  c.optim.layer_decay = 0.7
  c.optim.schedules = (('^head/', {'warmup_steps': 0, 'lr': 0.01}),)
  c.async_checkpoints = False
  c.input.eval_batch_size = 120
  summary = loop.train_and_evaluate(c, str(tmp_path))
  assert summary['steps'] == 4
  state = orbax_state._restore_on_host(
      orbax_state.resolve(str(tmp_path)) + '/state')
  trained = state['params']
  # A fresh init of the same seed: what the run started from.
  from vit_jax.train import step as step_lib
  from vit_jax import selfsup
  model = selfsup.model_from_config(c, 10, 'cpu')
  tx, _ = optim.make(c.optim, 4)
  size = c.input.image_size
  fresh = jax.jit(lambda: step_lib._init_state(
      model, tx, (size, size, 3), c.seed))()
  np.testing.assert_array_equal(trained['embedding']['kernel'],
                                fresh.params['embedding']['kernel'])
  assert not np.array_equal(trained['head']['kernel'],
                            fresh.params['head']['kernel'])


def test_grad_norm_is_the_trained_parameters_gradient():
  """With the zero-initialised head frozen, every trained parameter's
  gradient is 0 (it flows through the head): so is the logged grad_norm,
  the norm clipping sees, not the frozen head's."""
  import functools
  from vit_jax import sharding as shd
  from vit_jax.train import step as step_lib
  model = models.create('ViT-test', num_classes=3)
  batch = {'image': jnp.asarray(np.random.RandomState(0).uniform(
      -1, 1, (4, 16, 16, 3)), jnp.float32),
           'label': jnp.asarray([0, 1, 2, 0])}
  norms = {}
  for frozen in (None, '^head/'):
    tx, lr = optim.make(_cfg(frozen=frozen, grad_clip_norm=1.0), 100)
    state, _ = step_lib.create_state(model, tx, 0, (16, 16, 3),
                                     shd.make_mesh())
    step = jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx,
                                     lr_fn=lr, frozen=frozen))
    norms[frozen] = float(step(state, batch)[1]['grad_norm'])
  assert norms[None] > 0 and norms['^head/'] == 0


def test_multipliers_under_frozen_parameters():
  """An lr_mults regex that matches only frozen parameters is refused (it
  would do nothing); layer_decay with every scanned block frozen says so."""
  params, _ = _setup(scan=True)
  for cfg, message in (
      (_cfg(frozen='^embedding/', lr_mults=(('^embedding/', 2.0),)),
       r"lr_mults regex\(es\) \['\^embedding/'\] match no trained"),
      (_cfg(frozen='^Transformer/encoderblock/', layer_decay=0.5),
       'layer_decay needs trained encoder blocks')):
    tx, _ = optim.make(cfg, 100)
    with pytest.raises(ValueError, match=message):
      tx.init(params)
