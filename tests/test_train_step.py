"""The sharded train step: meshes agree, accumulation, optimiser, losses."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from conftest import xla_flags
from vit_jax.train import optim
from vit_jax import sharding as shd
from vit_jax.train import step as step_lib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # This checkout's vit_jax, not an installed one.


def _run(mesh, devices, **extra):
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS='cpu',
             PYTHONPATH=ROOT)
  out = subprocess.run(
      [sys.executable, os.path.join(HERE, 'mesh_steps.py'), json.dumps(mesh),
       json.dumps(extra)], capture_output=True, text=True, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope='module')
def single_device():
  return _run({'data': -1}, 1)


# Tolerance: float32 reductions are split differently across devices, so
# results agree to rounding (observed ~2e-7), not bitwise.
TOL = 1e-5


@pytest.mark.parametrize('mesh', [
    {'data': 8}, {'data': 1, 'fsdp': 8}, {'data': 4, 'model': 2},
    {'data': 2, 'fsdp': 2, 'model': 2},
], ids=['dp8', 'fsdp8', 'dp4-tp2', 'dp2-fsdp2-tp2'])
def test_meshes_match_one_device(single_device, mesh):
  res = _run(mesh, 8)
  assert res['devices'] == 8
  np.testing.assert_allclose(res['losses'], single_device['losses'], atol=TOL)
  assert res['losses'][-1] < res['losses'][0]  # It learns.
  for k, v in single_device['params'].items():
    np.testing.assert_allclose(res['params'][k], v, atol=TOL, err_msg=k)
  specs = res['specs']
  q = 'Transformer/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel'
  if mesh.get('model', 1) > 1:
    assert "'model'" in specs[q]  # Heads split over the model axis.
    assert "'model'" in specs['Transformer/encoderblock_0/MlpBlock_0/Dense_0/'
                              'kernel']
  if mesh.get('fsdp', 1) > 1:
    assert "'fsdp'" in specs[q]


def test_gradient_accumulation_matches(single_device):
  res = _run({'data': -1}, 1, accum=4)
  np.testing.assert_allclose(res['losses'], single_device['losses'], atol=TOL)


def test_fsdp_shards_largest_divisible_dim():
  # Logical axes as the ViT annotates its parameters.
  from flax import traverse_util
  from vit_jax import models
  axes = traverse_util.flatten_dict(shd.logical_axes(
      models.create('ViT-B/16', num_layers=1), (32, 32, 3)))
  mlp = axes[('Transformer', 'encoderblock_0', 'MlpBlock_0', 'Dense_0',
              'kernel')]
  mesh = shd.make_mesh(data=1, fsdp=1, model=1)
  assert shd.param_spec((768, 3072), mesh) == jax.sharding.PartitionSpec(None, None)
  assert shd.param_spec((768, 3072), mesh, mlp) == jax.sharding.PartitionSpec(
      None, None)

  class FakeMesh:
    shape = {'data': 1, 'fsdp': 4, 'model': 2}
  spec = shd.param_spec((768, 3072), FakeMesh(), mlp)
  assert tuple(spec) == ('fsdp', 'model')
  spec = shd.param_spec((16, 16, 3, 768), FakeMesh(), axes[('embedding',
                                                            'kernel')])
  assert tuple(spec) == (None, None, None, 'fsdp')
  # Small tensors stay replicated.
  assert tuple(shd.param_spec((1, 1, 768), FakeMesh(),
                              axes[('cls',)])) == (None,) * 3


def test_mesh_errors():
  n = jax.device_count()
  with pytest.raises(ValueError, match='at most one axis may be -1'):
    shd.make_mesh(data=-1, fsdp=-1)
  with pytest.raises(ValueError, match=f'needs {n * 2} devices'):
    shd.make_mesh(data=n, fsdp=2)


def _fake_mesh(data, fsdp, model, devices_per_process):
  """A mesh's shape and devices (process of each) as jax.make_mesh orders
  them: consecutive devices on one process."""
  import types
  devices = np.array([
      types.SimpleNamespace(process_index=i // devices_per_process)
      for i in range(data * fsdp * model)]).reshape(data, fsdp, model)
  return types.SimpleNamespace(
      shape={'data': data, 'fsdp': fsdp, 'model': model}, devices=devices)


def test_batch_not_divisible_is_a_clear_error():
  mesh = _fake_mesh(4, 2, 1, 8)
  with pytest.raises(ValueError, match=r'input.batch_size=100 is not '
                     r'divisible by the 8 devices.*multiple of 8, e.g. 96'):
    shd.check_batch_size(100, mesh, 'input.batch_size')
  shd.check_batch_size(96, mesh)


def test_processes_never_share_batch_rows():
  # 2 hosts x 4 devices: a model axis within a host is fine ...
  shd.check_batch_size(32, _fake_mesh(2, 1, 4, 4))
  shd.check_batch_size(32, _fake_mesh(1, 2, 4, 4))
  # ... one across hosts would feed one row different data on each.
  with pytest.raises(ValueError, match=r'processes \[0, 1\] hold the same '
                     r'batch rows.*model axis across hosts'):
    shd.check_batch_size(32, _fake_mesh(1, 1, 8, 4))


def _cfg(**kw):
  base = dict(name='adam', lr=1.0, warmup_steps=10, decay='linear',
              linear_end=0.01)
  base.update(kw)
  return ml_collections.ConfigDict(base)


def test_schedules():
  lr = optim.schedule(_cfg(), 110)
  assert float(lr(0)) == 0.0 and float(lr(5)) == pytest.approx(0.5)
  assert float(lr(10)) == pytest.approx(1.0)
  assert float(lr(110)) == pytest.approx(0.01)
  cos = optim.schedule(_cfg(decay='cosine'), 110)
  assert float(cos(60)) == pytest.approx(0.5, abs=1e-6)
  assert float(cos(110)) == pytest.approx(0.0, abs=1e-6)
  with pytest.raises(ValueError, match="optim.decay='step'"):
    optim.schedule(_cfg(decay='step'), 100)
  with pytest.raises(ValueError, match='warmup_steps=10 is not below'):
    optim.schedule(_cfg(), 10)


def test_weight_decay_only_on_kernels():
  params = {'dense': {'kernel': jnp.ones((2, 2)), 'bias': jnp.ones((2,))},
            'cls': jnp.ones((1, 1, 2))}
  tx, _ = optim.make(_cfg(lr=0.1, warmup_steps=0, decay='constant',
                          weight_decay=0.5), 10)
  grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(grads, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_allclose(new['dense']['kernel'], 1 - 0.1 * 0.5)
  np.testing.assert_array_equal(new['dense']['bias'], 1.0)
  np.testing.assert_array_equal(new['cls'], 1.0)


def test_sgd_momentum_and_clipping():
  params = {'w': {'kernel': jnp.zeros((3,))}}
  tx, _ = optim.make(_cfg(name='sgd', lr=1.0, warmup_steps=0,
                          decay='constant', momentum=0.9,
                          grad_clip_norm=1.0), 10)
  state = tx.init(params)
  g = {'w': {'kernel': jnp.array([30.0, 40.0, 0.0])}}  # Norm 50 -> clipped.
  u1, state = tx.update(g, state, params)
  np.testing.assert_allclose(u1['w']['kernel'], [-0.6, -0.8, 0.0], rtol=1e-6)
  u2, _ = tx.update(g, state, params)
  np.testing.assert_allclose(u2['w']['kernel'], [-1.14, -1.52, 0.0],
                             rtol=1e-6)


def test_bfloat16_moments():
  params = {'w': {'kernel': jnp.zeros((3,))}}
  tx, _ = optim.make(_cfg(mu_dtype='bfloat16'), 100)
  mu = optax.tree_utils.tree_get(tx.init(params), 'mu')
  assert mu['w']['kernel'].dtype == jnp.bfloat16


def test_bad_optimiser_name():
  with pytest.raises(ValueError, match="optim.name='lamb'"):
    optim.make(_cfg(name='lamb'), 10)


def test_losses():
  logits = jnp.array([[2.0, 0.0, -1.0]])
  labels = jnp.array([0])
  plain = step_lib.loss_fn(logits, labels)
  assert float(plain) == pytest.approx(
      float(-jax.nn.log_softmax(logits)[0, 0]), rel=1e-6)
  smooth = step_lib.loss_fn(logits, labels, label_smoothing=0.3)
  assert float(smooth) > float(plain)
  sig = step_lib.loss_fn(logits, labels, kind='sigmoid')
  expected = optax.sigmoid_binary_cross_entropy(
      logits, jnp.array([[1.0, 0.0, 0.0]])).sum()
  assert float(sig) == pytest.approx(float(expected), rel=1e-6)
  with pytest.raises(ValueError, match="loss='hinge'"):
    step_lib.loss_fn(logits, labels, kind='hinge')
  # Mixup's soft labels over the dataset's 2 classes, a head of 3: the third
  # class is a zero target, as for class ids.
  soft = jnp.array([[1.0, 0.0]])
  for kind in ('softmax', 'sigmoid'):
    for ls in (0.0, 0.3):
      assert float(step_lib.loss_fn(logits, soft, kind, ls)) == pytest.approx(
          float(step_lib.loss_fn(logits, labels, kind, ls)), rel=1e-6)
  with pytest.raises(ValueError, match='at least the dataset'):
    step_lib.loss_fn(logits[:, :1], soft)


def _free_port():
  import socket
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def test_two_processes_match_one_process_with_four_devices():
  one = _run({'data': 2, 'fsdp': 2}, 4)
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS=xla_flags(2))
  procs = [subprocess.Popen(
      [sys.executable, os.path.join(HERE, 'mesh_steps.py'),
       json.dumps({'data': 2, 'fsdp': 2}),
       json.dumps({'num_processes': 2, 'process_id': i,
                   'coordinator': f'127.0.0.1:{port}'})],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
      for i in range(2)]
  try:
    outs = [p.communicate(timeout=300) for p in procs]
  finally:  # Timed out or failed: no gloo process left to load the rest.
    for p in procs:
      p.kill()
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  results = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
  for res in results:
    assert res['processes'] == 2 and res['devices'] == 4
    np.testing.assert_allclose(res['losses'], one['losses'], atol=TOL)
    for k, v in one['params'].items():
      np.testing.assert_allclose(res['params'][k], v, atol=TOL, err_msg=k)


def test_activations_carry_logical_sharding_constraints():
  from vit_jax import models
  mesh = shd.make_mesh(data=-1)
  model = models.create('ViT-test', num_classes=10)
  tx, lr = optim.make(_cfg(warmup_steps=0, decay='constant'), 10)
  state, sh = step_lib.create_state(model, tx, 0, (16, 16, 3), mesh)
  train = step_lib.compile_train_step(model, tx, lr, sh, mesh,
                                    ml_collections.ConfigDict({}))
  batch = {'image': jnp.zeros((4, 16, 16, 3)),
           'label': jnp.zeros((4,), jnp.int32)}
  with jax.set_mesh(mesh):
    text = train.lower(state, batch).as_text()
  constraints = [l for l in text.splitlines() if 'sharding_constraint' in l]
  # Block inputs: batch over (data, fsdp); MLP hidden: also over model.
  assert any('[{"data", "fsdp"}, {}, {}]' in l for l in constraints)
  assert any('[{"data", "fsdp"}, {}, {"model"}]' in l for l in constraints)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_cpu_step_traces_only_cpu_branches_with_the_same_numbers(dtype):
  """On a CPU mesh the step is traced with the models' CPU branches only
  (no platform conditional: its linearisation and transpose cost every
  branch's), and computes bitwise what the platform switch computes."""
  import functools
  from vit_jax import models
  mesh = shd.make_mesh(data=-1)
  model = models.create('ViT-test', num_classes=10, dtype=jnp.dtype(dtype))
  tx, lr = optim.make(_cfg(warmup_steps=0, decay='constant'), 10)
  state, sh = step_lib.create_state(model, tx, 0, (16, 16, 3), mesh)
  batch = {'image': jnp.asarray(np.random.RandomState(0).uniform(
      -1, 1, (4, 16, 16, 3)), jnp.float32),
           'label': jnp.arange(4, dtype=jnp.int32)}
  direct = step_lib.compile_train_step(model, tx, lr, sh, mesh,
                                       ml_collections.ConfigDict({}))
  switched = jax.jit(functools.partial(step_lib.train_step, model=model,
                                       tx=tx, lr_fn=lr))
  with jax.set_mesh(mesh):
    assert 'platform_index' not in str(direct.trace(state, batch).jaxpr)
    assert 'platform_index' in str(switched.trace(state, batch).jaxpr)
    copy = jax.tree.map(jnp.copy, state)  # `direct` donates its state.
    (new_a, metrics_a), (new_b, metrics_b) = (direct(copy, batch),
                                              switched(state, batch))
  assert float(metrics_a['loss']) == float(metrics_b['loss'])
  for a, b in zip(jax.tree.leaves(new_a.params), jax.tree.leaves(new_b.params)):
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))
