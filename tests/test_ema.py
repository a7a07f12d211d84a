"""Polyak averaging / EMA of the parameters (optim.ema_decay)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import evaluators, models
from vit_jax import sharding as shd
from vit_jax.train import config_check, optim, orbax_state
from vit_jax.train import step as step_lib


def _sgd(**kw):
  return optim.Settings(name='sgd', lr=0.1, warmup_steps=0, decay='constant',
                        momentum=0.9, weight_decay=0.0, **kw)


@pytest.mark.parametrize('warmup', [True, False])
def test_ema_in_the_train_step_matches_a_hand_computation(warmup):
  """e_0 = p_0; e_{t+1} = d_t e_t + (1 - d_t) p_{t+1}, with
  d_t = min(decay, (1+t)/(10+t)) under warm-up, over three real steps."""
  decay = 0.99 if warmup else 0.5
  cfg = {'ema_decay': decay, 'ema_warmup': warmup}
  expected_d = [min(decay, (1 + t) / (10 + t)) if warmup else decay
                for t in range(3)]
  for t, d in enumerate(expected_d):
    assert float(optim.ema_decay_at(cfg, t)) == pytest.approx(d, rel=1e-6)
  mesh = shd.make_mesh(data=-1)
  model = models.create('ViT-test', num_classes=10)
  tx, lr = optim.make(_sgd(), 3)
  state, sh = step_lib.create_state(model, tx, 0, (16, 16, 3), mesh, ema=True)
  train = step_lib.compile_train_step(model, tx, lr, sh, mesh,
                                      {'optim': cfg})
  rng = np.random.RandomState(0)
  host = jax.device_get(state.params)
  ema = jax.tree.map(np.float64, host)
  np.testing.assert_array_equal(  # Starts equal to the parameters.
      jax.device_get(state.ema_params)['head']['bias'], host['head']['bias'])
  with jax.set_mesh(mesh):
    for d in expected_d:
      batch = {'image': jnp.asarray(rng.uniform(-1, 1, (4, 16, 16, 3)),
                                    jnp.float32),
               'label': jnp.asarray(rng.randint(0, 10, (4,)), jnp.int32)}
      state, _ = train(state, batch)
      params = jax.device_get(state.params)
      ema = jax.tree.map(lambda e, p, d=d: d * e + (1 - d) * p, ema, params)
  got = jax.device_get(state.ema_params)
  for path, want in jax.tree_util.tree_leaves_with_path(ema):
    value = got
    for k in path:
      value = value[k.key]
    np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-7,
                               err_msg=jax.tree_util.keystr(path))
  # The averages differ from both the initial and the final parameters.
  final = jax.tree.leaves(params)
  assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(got),
                                                   final))
  assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(got),
                                                   jax.tree.leaves(host)))


def test_bfloat16_parameters_have_float32_averages_that_move():
  """A bfloat16 average would never move at decay 0.9999: 1e-4 * (p - e)
  rounds away against e. The state's averages are float32, they move with
  the parameters, and the EMA model evaluates."""
  mesh = shd.make_mesh(data=-1)
  model = models.create('ViT-test', num_classes=10,
                        param_dtype=jnp.bfloat16)
  tx, _ = optim.make(_sgd(), 3)
  state, _ = step_lib.create_state(model, tx, 0, (16, 16, 3), mesh, ema=True)
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {
      jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(state.ema_params)} == {
      jnp.dtype(jnp.float32)}
  # One step's parameter change of about 1% (a bf16 step apart).
  stepped = jax.tree.map(lambda p: (p * 1.01 + 0.01).astype(p.dtype),
                         state.params)
  after = optim.ema_update(state.ema_params, stepped, jnp.float32(0.9999))
  moved = [not np.array_equal(a, b) for a, b in
           zip(jax.tree.leaves(state.ema_params), jax.tree.leaves(after))]
  assert all(moved)
  x = jnp.asarray(np.random.RandomState(0).uniform(-1, 1, (2, 16, 16, 3)),
                  jnp.float32)
  logits = model.apply({'params': after}, x, train=False)
  assert np.isfinite(np.asarray(logits, np.float32)).all()


def test_a_state_with_averages_needs_the_decay():
  mesh = shd.make_mesh(data=-1)
  model = models.create('ViT-test', num_classes=10)
  tx, lr = optim.make(_sgd(), 3)
  state, sh = step_lib.create_state(model, tx, 0, (16, 16, 3), mesh, ema=True)
  with pytest.raises(ValueError, match='no ema_decay'):
    step_lib.train_step(
        state, {'image': jnp.zeros((2, 16, 16, 3)),
                'label': jnp.zeros((2,), jnp.int32)},
        model=model, tx=tx, lr_fn=lr)


def _config(steps, **optim_kw):
  from vit_jax.configs import smoke
  c = smoke.get_config(f'data=digits,steps={steps},batch=32')
  c.optim.update(dict(decay='constant', warmup_steps=0, ema_decay=0.9,
                      **optim_kw))
  c.eval_ema = 'both'
  c.log_every = 3
  c.checkpoint_every = 3
  c.async_checkpoints = False
  c.input.eval_batch_size = 120
  return c


def test_ema_is_checkpointed_resumed_exactly_and_evaluated(tmp_path):
  """6 steps straight == 3 steps, then resumed to 6 (EMA included, bitwise);
  the summary reports the averages (raw as raw/...), mode=eval and
  load_params read them."""
  from vit_jax.train import eval_run, loop
  straight = str(tmp_path / 'straight')
  summary = loop.train_and_evaluate(_config(6), straight)
  resumed = str(tmp_path / 'resumed')
  loop.train_and_evaluate(_config(3), resumed)
  again = loop.train_and_evaluate(_config(6), resumed)  # Resumes at 3.
  assert again['eval_accuracy'] == summary['eval_accuracy']

  def state(workdir):
    return orbax_state._restore_on_host(orbax_state.resolve(workdir) + '/state')
  a, b = state(straight), state(resumed)
  for key in ('params', 'ema_params'):
    for x, y in zip(jax.tree.leaves(a[key]), jax.tree.leaves(b[key])):
      np.testing.assert_array_equal(x, y, err_msg=key)
  assert any(not np.array_equal(x, y) for x, y in
             zip(jax.tree.leaves(a['params']),
                 jax.tree.leaves(a['ema_params'])))
  # The summary's main metrics are the averages', raw ones beside them.
  assert 'raw/eval_accuracy' in summary and 'eval_accuracy' in summary
  for x, y in zip(jax.tree.leaves(orbax_state.load_params(straight)),
                  jax.tree.leaves(a['ema_params'])):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(jax.tree.leaves(orbax_state.load_params(straight,
                                                          ema=False)),
                  jax.tree.leaves(a['params'])):
    np.testing.assert_array_equal(x, y)
  # What predict, export and inspect load (vit_jax.trained): the averages.
  from vit_jax import trained
  for x, y in zip(jax.tree.leaves(trained.load(straight).params),
                  jax.tree.leaves(a['ema_params'])):
    np.testing.assert_array_equal(x, y)
  raw = trained.load(straight, ema=False)  # inspect --raw.
  assert raw.source.endswith('(raw parameters)')
  for x, y in zip(jax.tree.leaves(raw.params), jax.tree.leaves(a['params'])):
    np.testing.assert_array_equal(x, y)
  with pytest.raises(trained.TrainedModelError, match='not a training workd'):
    trained.load(str(tmp_path / 'public.npz'), model='ViT-B/16', ema=False)
  # mode=eval: the same numbers from the checkpoint alone.
  c = _config(6)
  c.mode = 'eval'
  result = eval_run.evaluate_run(c, straight)
  assert result['eval_accuracy'] == pytest.approx(summary['eval_accuracy'])
  assert result['raw/eval_accuracy'] == pytest.approx(
      summary['raw/eval_accuracy'])
  # Turning EMA off on resume: refused, with what to do.
  c = _config(9)
  c.optim.ema_decay = None
  c.eval_ema = 'ema'
  with pytest.raises(orbax_state.ConfigChangedError,
                     match='holds EMA parameters.*new --workdir'):
    loop.train_and_evaluate(c, straight)
  assert json.load(open(os.path.join(straight, 'summary.json')))[
      'steps'] == 6  # The run and its results are untouched.


def test_averages_of_a_run_started_from_init_stay_float32(tmp_path):
  """--config.init with bfloat16 parameters: the averages start at the
  init in float32 (bfloat16 ones would not move at decay 0.9999) and stay
  float32 across a resume, as in a run without init."""
  from vit_jax.train import loop
  first = str(tmp_path / 'first')
  loop.train_and_evaluate(_config(3), first)
  c = _config(3, ema_warmup=False)
  c.optim.ema_decay = 0.9999
  c.model.param_dtype = 'bfloat16'
  c.init = first
  c.eval_ema = 'ema'
  c.eval_every = 0
  run = str(tmp_path / 'from_init')
  loop.train_and_evaluate(c, run)
  state = orbax_state._restore_on_host(orbax_state.resolve(run) + '/state')
  assert {x.dtype for x in jax.tree.leaves(state['params'])} == {
      np.dtype(jnp.bfloat16)}
  averages = jax.tree.leaves(state['ema_params'])
  assert {x.dtype for x in averages} == {np.dtype(np.float32)}
  start = jax.tree.leaves(orbax_state.load_params(first, ema=False))
  # 3 steps at 0.9999 move every average a little, not 0 (bfloat16 would).
  moved = [np.mean(a != np.asarray(s, jnp.bfloat16).astype(np.float32))
           for a, s in zip(averages, start) if a.size > 100]
  assert min(moved) > 0.5, moved


def test_bad_ema_settings_are_clear_errors():
  c = _config(6)
  c.optim.ema_decay = 1.0
  with pytest.raises(ValueError, match=r'optim.ema_decay=1.0 cannot work'):
    config_check.check(c)
  c = _config(6)
  c.eval_ema = 'polyak'
  with pytest.raises(ValueError, match="eval_ema='polyak'.*ema, raw, both"):
    config_check.check(c)
  c = _config(6)
  c.optim.ema_decay = None
  with pytest.raises(ValueError, match='eval_ema=both but optim.ema_decay'):
    config_check.check(c)
  with pytest.raises(ValueError, match='no EMA parameters'):
    evaluators.run_with_ema([], {}, None, 'both')
