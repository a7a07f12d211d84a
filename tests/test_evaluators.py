"""Evaluators: few-shot least squares, ReaL accuracy, and mode=eval."""

import json
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from vit_jax import evaluators, models
from vit_jax.data.errors import DatasetNotPreparedError
from vit_jax.evaluators import classification, fewshot
from vit_jax import sharding as shd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fewshot(cfg, inp, model, mesh, sh, image_size, channels=3):
  """A few-shot evaluator built as `evaluators.build` builds it."""
  return fewshot.FewShot('fewshot', cfg, evaluators.Context(
      config=ml_collections.ConfigDict(dict(input=inp)), model=model,
      mesh=mesh, params_sharding=sh, image_size=image_size,
      channels=channels))


def _fewshot_on(model, params, image_size, *, input_data_dir=None,
                **section):
  """(evaluator, run) of a few-shot `section` (its batch_size is also the
  input's eval batch size) on one device; `run()` evaluates `params`."""
  mesh = shd.make_mesh()
  sh = shd.param_shardings(params, mesh)
  inp = ml_collections.ConfigDict(dict(eval_batch_size=section['batch_size'],
                                       data_dir=input_data_dir))
  ev = _fewshot(ml_collections.ConfigDict(section), inp, model, mesh, sh,
                image_size)

  def run():
    with jax.set_mesh(mesh):
      return ev.run(jax.device_put(params, sh))
  return ev, run


def _big_vision_ridge(x, y, xt, k, l2):
  """big_vision's fewshot_lsr written out: features standardised with the
  training set's mean and std (+1e-5), a constant bias feature of 100,
  ridge regression (every weight regularised) onto {-1, 1} targets."""
  mean, std = x.mean(0), x.std(0) + 1e-5
  a = np.c_[(x - mean) / std, np.full(len(x), 100.0)]
  t = 2 * np.eye(k)[y] - 1
  w = np.linalg.solve(a.T @ a + l2 * np.eye(a.shape[1]), a.T @ t)
  return (np.c_[(xt - mean) / std, np.full(len(xt), 100.0)] @ w).argmax(-1)


def test_fit_predict_is_big_visions_ridge_in_primal_and_dual_form(rng):
  k, d = 4, 6
  x = rng.randn(40, d)
  y = rng.randint(0, k, 40)
  xt = rng.randn(25, d)
  for n in (40, 5):  # n > d: primal form; n <= d + 1: dual form.
    np.testing.assert_array_equal(
        fewshot.fit_predict(x[:n], y[:n], xt, k, 0.5),
        _big_vision_ridge(x[:n], y[:n], xt, k, 0.5))
  assert fewshot.L2_REG == 2.0**10  # big_vision's default.


def test_fit_predict_ignores_the_scale_of_each_feature(rng):
  """Standardised features: a ViT's few very large feature dimensions do
  not dominate the regression (they did when features were only centred
  and scaled as a whole)."""
  centres = rng.randn(5, 16)
  y = np.repeat(np.arange(5), 5)
  x = centres[y] + 0.3 * rng.randn(25, 16)
  yt = np.repeat(np.arange(5), 40)
  xt = centres[yt] + 0.3 * rng.randn(200, 16)
  scales = np.exp(rng.uniform(-4, 4, 16))
  np.testing.assert_array_equal(
      fewshot.fit_predict(x * scales, y, xt * scales, 5, 1.0),
      fewshot.fit_predict(x, y, xt, 5, 1.0))


def test_fit_predict_separates_clusters(rng):
  centres = rng.randn(5, 16) * 5
  y = np.repeat(np.arange(5), 3)
  x = centres[y] + rng.randn(15, 16)
  yt = np.repeat(np.arange(5), 40)
  xt = centres[yt] + rng.randn(200, 16)
  assert np.mean(fewshot.fit_predict(x, y, xt, 5, 1.0) == yt) > 0.95


def test_draw_k_per_class_nested_and_seeded():
  labels = np.repeat(np.arange(3), 30)
  a = fewshot.draw(labels, 3, (1, 5, 10), seed=0)
  b = fewshot.draw(labels, 3, (1, 5, 10), seed=1)
  for k, idx in a.items():
    assert np.all(np.bincount(labels[idx], minlength=3) == k)
    assert len(set(idx)) == len(idx)
  assert set(a[1]) <= set(a[5]) <= set(a[10])  # Nested within a seed.
  assert set(a[10]) != set(b[10])


class _Fixed(nn.Module):
  """Logits = the first K pixels of the image's first row."""

  @nn.compact
  def __call__(self, x, train=False):
    self.param('unused', nn.initializers.zeros, (1,))
    return x[:, 0, :4, 0]


def test_real_accuracy_uses_label_sets_and_skips_empty(rng):
  model = _Fixed()
  preds = np.array([0, 1, 2, 3, 1])
  images = np.zeros((5, 4, 4, 1), np.float32)
  images[np.arange(5), 0, preds, 0] = 1.0
  real = np.zeros((5, 4), bool)
  real[0, [0, 2]] = True   # Prediction 0 in the set: correct.
  real[1, 3] = True        # Prediction 1 not in {3}: wrong.
  real[2, 2] = True        # Correct.
  # Row 3: empty set, left out of ReaL. Row 4: padding (mask False).
  real[4, 1] = True
  batch = {'image': images, 'label': np.array([0, 0, 2, 3, 1]),
           'real_label': real, 'mask': np.array([1, 1, 1, 1, 0], bool)}
  out = jax.device_get(classification.batch_sums(
      {'unused': jnp.zeros(1)}, jax.tree.map(jnp.asarray, batch),
      model=model))
  assert out['count'] == 4 and out['correct'] == 3  # Original labels.
  assert out['real_count'] == 3 and out['real_correct'] == 2


def test_eval_loss_is_the_runs_loss(rng):
  """A sigmoid-trained run (i21k, JFT) reports the sigmoid loss in eval
  too, comparable with its train loss; padding rows count for nothing."""
  model = _Fixed()
  images = rng.randn(3, 4, 4, 1).astype(np.float32)
  labels = np.array([2, 0, 1])
  batch = jax.tree.map(jnp.asarray, {
      'image': images, 'label': labels, 'mask': np.array([1, 1, 0], bool)})
  logits = images[:2, 0, :4, 0].astype(np.float64)
  onehot = np.eye(4)[labels[:2]]
  sigmoid = (np.logaddexp(0, logits) - onehot * logits).sum()
  softmax = (np.log(np.exp(logits).sum(-1)) - (onehot * logits).sum(-1)).sum()
  for loss, want in (('sigmoid', sigmoid), ('softmax', softmax)):
    out = classification.batch_sums({'unused': jnp.zeros(1)}, batch,
                                    model=model, loss=loss)
    assert float(out['loss']) == pytest.approx(want, rel=1e-5), loss


@pytest.fixture(scope='module')
def digits_model():
  model = models.create('ViT-test', num_classes=10)
  params = model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)))['params']
  return model, params


def test_fewshot_on_digits_with_random_features(digits_model):
  _, run = _fewshot_on(*digits_model, 16, datasets=('digits',),
                       shots=(1, 5, 10), seeds=2, pool_per_class=20,
                       batch_size=100)
  out = run()
  assert set(out) == {f'fewshot/digits/{k}shot{s}' for k in (1, 5, 10)
                      for s in ('', '_std')}
  # Even a random ViT-test's features are well above chance (10%).
  assert out['fewshot/digits/10shot'] > 0.2


def test_fewshot_of_a_non_square_model():
  """A 16x24 model: the few-shot images are resized to 16x24 too (a square
  resize gave the position embeddings another token count)."""
  model = models.create('ViT-test', num_classes=10)
  params = model.init(jax.random.key(0), jnp.zeros((1, 16, 24, 3)))['params']
  _, run = _fewshot_on(model, params, (16, 24), datasets=('digits',),
                       shots=(1,), seeds=1, pool_per_class=2, batch_size=100)
  out = run()
  assert 0 <= out['fewshot/digits/1shot'] <= 1
  # A pre-processing that cannot follow the model's shape (a preset makes
  # square images) is refused when the run starts, not at its first
  # evaluation; so are images with other channels than the model's.
  with pytest.raises(ValueError, match=r'makes \d+x\d+x3 images of few-shot '
                     r"dataset 'digits'; the model takes 16x24x3: write "
                     r'evals.fewshot.pp with \{size\}'):
    _fewshot_on(model, params, (16, 24), datasets=('digits',), shots=(1,),
                pool_per_class=2, batch_size=100, pp='resize')
  mesh = shd.make_mesh()
  grey = models.create('ViT-test', num_classes=10)
  grey_params = grey.init(jax.random.key(0), jnp.zeros((1, 16, 16, 1)))
  with pytest.raises(ValueError, match=r'makes 16x16x3 images .* the model '
                     r'takes 16x16x1: set the channels in evals.fewshot.pp: '
                     r'decode\(1\)'):
    fewshot.FewShot('fewshot', ml_collections.ConfigDict(dict(
        datasets=('digits',), shots=(1,), pool_per_class=2)),
        evaluators.Context(config=ml_collections.ConfigDict(dict(
            input=dict(eval_batch_size=100, data_dir=None))), model=grey,
            mesh=mesh, params_sharding=shd.param_shardings(
                grey_params['params'], mesh), image_size=16, channels=1))


def test_fewshot_split_expressions_and_too_few_examples(digits_model, caplog):
  """`NAME:TRAIN:TEST` takes split expressions with colons; a class with
  fewer examples than the largest shot count (found when the split is read,
  at evaluation) costs only those shot counts, logged, not the run."""
  _, run = _fewshot_on(*digits_model, 16,
                       datasets=('digits:train[:50]:test[:60]',),
                       shots=(1, 2, 20), seeds=1, pool_per_class=20,
                       batch_size=60)
  with caplog.at_level('ERROR'):
    out = run()
  assert sorted(k for k in out if not k.endswith('_std')) == [
      'fewshot/digits/1shot', 'fewshot/digits/2shot']
  assert "no 20-shot result; lower evals.fewshot.shots" in caplog.text


def test_fewshot_on_a_folder_dataset(digits_model, tmp_path):
  """A folder of class sub-folders knows its classes: few-shot reads it."""
  from PIL import Image
  from sklearn.datasets import load_digits
  d = load_digits()
  for split, rows in (('train', range(0, 120)), ('test', range(300, 360))):
    for i in rows:
      if d.target[i] < 3:
        (tmp_path / split / f'c{d.target[i]}').mkdir(parents=True,
                                                      exist_ok=True)
        Image.fromarray((d.images[i] * 255 / 16).astype(np.uint8)).save(
            tmp_path / split / f'c{d.target[i]}' / f'{i}.png')
  _, run = _fewshot_on(*digits_model, 16, datasets=('folder:train:test',),
                       shots=(1, 5), seeds=1, pool_per_class=5,
                       batch_size=20, data_dir=str(tmp_path))
  out = run()
  assert sorted(out) == ['fewshot/folder/1shot', 'fewshot/folder/1shot_std',
                         'fewshot/folder/5shot', 'fewshot/folder/5shot_std']
  assert 0 <= out['fewshot/folder/5shot'] <= 1


def test_fewshot_pool_is_read_in_split_order_on_any_process_count(
    digits_model, monkeypatch):
  """The pool (each class's first examples) comes from global batches that
  hold the split's examples in order on 1 or n processes: with contiguous
  per-process parts it was drawn from the start of each part, and the same
  checkpoint scored differently on 1 and 4 hosts."""
  ev, _ = _fewshot_on(*digits_model, 16, datasets=('digits',), shots=(1,),
                      seeds=1, pool_per_class=5, batch_size=40)
  one = [b['label'] for b in ev._batches('digits', 'train', ordered=True)]
  for n in (2, 4):
    parts = []
    for p in range(n):
      monkeypatch.setattr(jax, 'process_count', lambda n=n: n)
      monkeypatch.setattr(jax, 'process_index', lambda p=p: p)
      parts.append([b['label'] for b in
                    ev._batches('digits', 'train', ordered=True)])
    for i, rows in enumerate(one):
      np.testing.assert_array_equal(
          np.concatenate([part[i] for part in parts]), rows)


def test_fewshot_missing_dataset_names_its_data_dir(digits_model, tmp_path):
  """A few-shot dataset that is not where it is looked for names the
  config field that says where (`evals.<name>.data_dir`)."""
  section = dict(datasets=('folder:train:test',), shots=(1,), seeds=1,
                 pool_per_class=5, batch_size=20)
  nowhere = str(tmp_path / 'nowhere')
  with pytest.raises(DatasetNotPreparedError,
                     match=r"evals\.fewshot.*input\.data_dir.*nowhere.*"
                           r"--config\.evals\.fewshot\.data_dir"):
    _fewshot_on(*digits_model, 16, input_data_dir=nowhere, **section)
  with pytest.raises(DatasetNotPreparedError,
                     match=r"evals\.fewshot\.data_dir=.*elsewhere"):
    _fewshot_on(*digits_model, 16, input_data_dir=nowhere,
                data_dir=str(tmp_path / 'elsewhere'), **section)


class _Pixels(nn.Module):
  """Represents an image by its pixels (to check the evaluator's plumbing
  against few-shot regression computed here directly)."""

  @nn.compact
  def __call__(self, x, train=False):
    self.param('unused', nn.initializers.zeros, (1,))
    self.sow('intermediates', 'representation', x.reshape(len(x), -1))
    return jnp.zeros((len(x), 10))


def test_fewshot_pp_with_its_own_value_range_is_not_refused():
  """evals.<name>.pp is the few-shot features' only pipeline: its value
  range is not compared with the dataset's training augmentation."""
  model = _Pixels()
  params = {'unused': jnp.zeros(1)}
  mesh = shd.make_mesh()
  sh = shd.param_shardings(params, mesh)
  cfg = ml_collections.ConfigDict(dict(
      datasets=('digits',), shots=(1,), seeds=1, pool_per_class=2,
      batch_size=64, pp='decode(1)|resize({size})|value_range(0,1)'))
  inp = ml_collections.ConfigDict(dict(eval_batch_size=64, data_dir=None))
  with jax.set_mesh(mesh):
    out = _fewshot(cfg, inp, model, mesh, sh, image_size=8,
                   channels=1).run(jax.device_put(params, sh))
  assert 0 <= out['fewshot/digits/1shot'] <= 1


def test_fewshot_equals_direct_regression_on_pixels():
  from vit_jax.data import memory_source
  model = _Pixels()
  params = {'unused': jnp.zeros(1)}
  mesh = shd.make_mesh()
  sh = shd.param_shardings(params, mesh)
  cfg = ml_collections.ConfigDict(dict(
      datasets=('digits',), shots=(1, 5, 10), seeds=2, pool_per_class=20,
      batch_size=64, pp='decode(1)|resize({size})|value_range(-1,1)'))
  inp = ml_collections.ConfigDict(dict(eval_batch_size=64, data_dir=None))
  with jax.set_mesh(mesh):
    out = _fewshot(cfg, inp, model, mesh, sh, image_size=8,
                   channels=1).run(
        jax.device_put(params, sh))
  data = memory_source.load('digits')
  x, y = data['train']
  pool = np.sort(np.concatenate([np.flatnonzero(y == c)[:20]
                                 for c in range(10)]))
  # The pixels as the pipeline's value_range(-1,1) makes them (float32).
  pixels = lambda a: np.float32(-1) + (a.reshape(len(a), -1).astype(
      np.float32) - np.float32(0)) * np.float32(2 / 255)
  x, y = pixels(x[pool]), y[pool]
  xt, yt = data['test']
  xt = pixels(xt)
  for k in (1, 5, 10):
    accs = [np.mean(fewshot.fit_predict(x[i], y[i], xt, 10) == yt)
            for i in (fewshot.draw(y, 10, (k,), s)[k] for s in (0, 1))]
    assert out[f'fewshot/digits/{k}shot'] == pytest.approx(np.mean(accs))
  # Pixels suffice for digits (standardised, big_vision's regulariser:
  # 0.68 here; far above chance).
  assert out['fewshot/digits/10shot'] > 0.6


def test_fewshot_errors_name_the_fix(digits_model):
  model, params = digits_model
  mesh = shd.make_mesh()
  sh = shd.param_shardings(params, mesh)
  inp = ml_collections.ConfigDict(dict(eval_batch_size=100, data_dir=None))
  bad_pool = ml_collections.ConfigDict(dict(datasets=('digits',),
                                            shots=(1, 25), pool_per_class=10))
  with pytest.raises(ValueError, match='pool_per_class=10'):
    _fewshot(bad_pool, inp, model, mesh, sh, image_size=16)
  with pytest.raises(Exception, match='Did you mean'):
    _fewshot(ml_collections.ConfigDict(dict(datasets=('digts',))),
             inp, model, mesh, sh, image_size=16)


def test_fewshot_regulariser_from_a_config_section(digits_model):
  """`configs/common.fewshot`'s `l2_reg` None is big_vision's 2**10; a
  number replaces it."""
  from vit_jax.configs import common
  model, params = digits_model
  mesh = shd.make_mesh()
  sh = shd.param_shardings(params, mesh)
  inp = ml_collections.ConfigDict(dict(eval_batch_size=100, data_dir=None))
  cfg = common.fewshot(('digits',), (1, 5), pool_per_class=10)
  assert _fewshot(cfg, inp, model, mesh, sh, 16).l2_reg == fewshot.L2_REG
  cfg.l2_reg = 4.0
  assert _fewshot(cfg, inp, model, mesh, sh, 16).l2_reg == 4.0


def test_evaluators_read_their_own_data_dir(digits_model, tmp_path):
  """A few-shot or classification section's `data_dir` replaces the run's
  (few-shot datasets stored apart from the training data)."""
  from vit_jax.configs import common
  model, params = digits_model
  mesh = shd.make_mesh()
  sh = shd.param_shardings(params, mesh)
  inp = ml_collections.ConfigDict(dict(eval_batch_size=100, data='digits',
                                       data_dir=str(tmp_path / 'run')))
  cfg = common.fewshot(('mnist',), (1, 5))
  cfg.data_dir = str(tmp_path / 'elsewhere')
  with pytest.raises(FileNotFoundError, match='elsewhere'):
    _fewshot(cfg, inp, model, mesh, sh, 16)
  ctx = evaluators.Context(config=ml_collections.ConfigDict(dict(input=inp)),
                           model=model, mesh=mesh, params_sharding=sh,
                           image_size=16)
  section = ml_collections.ConfigDict(dict(data='mnist',
                                           data_dir=str(tmp_path / 'x')))
  assert evaluators.base.eval_input(section, ctx).data_dir == str(
      tmp_path / 'x')
  assert evaluators.base.eval_input(ml_collections.ConfigDict(
      dict(data='mnist')), ctx).data_dir == str(tmp_path / 'run')


def test_cached_eval_splits_are_read_once_across_evaluations(
    digits_model, tmp_path):
  """With input.cache the evaluator's pipeline outlives one evaluation: the
  second one reads the decoded split from memory, not the files (deleted
  here), and gives the same numbers."""
  import skimage.data
  import tensorflow as tf
  model, params = digits_model
  photo = skimage.data.astronaut()[::8, ::8]
  for c in range(3):
    os.makedirs(tmp_path / 'd' / str(c))
    for i in range(4):
      (tmp_path / 'd' / str(c) / f'{i}.png').write_bytes(
          tf.io.encode_png(photo[i:, c:]).numpy())
  inp = ml_collections.ConfigDict(dict(
      data='folder', data_dir=str(tmp_path / 'd'), eval_split='train',
      image_size=16, batch_size=4, eval_batch_size=4, cache=True))
  mesh = shd.make_mesh()
  ev = classification.Classification('eval', ml_collections.ConfigDict(),
                                     evaluators.Context(
      config=ml_collections.ConfigDict(dict(input=inp)), model=model,
      mesh=mesh, params_sharding=shd.param_shardings(params, mesh),
      image_size=16))
  first = ev.run(params)
  assert first['eval_examples'] == 12
  for f in (tmp_path / 'd').rglob('*.png'):
    f.unlink()
  assert ev.run(params) == first


def test_mode_eval_evaluates_a_finished_run(tmp_path, monkeypatch):
  """Train briefly, then `mode=eval` with a few-shot evaluator added:
  metrics merge into summary.json, the trained head is kept. (In-process;
  main.py's dispatch to eval_run runs in the test below.)"""
  from vit_jax.configs import smoke
  from vit_jax.train import eval_run, loop

  def config(extra='', **fields):
    c = smoke.get_config('data=digits,steps=30,batch=32' + extra)
    c.async_checkpoints = False
    for k, v in fields.items():
      node, *rest = k.split('__')
      if rest:
        c[node][rest[0]] = v
      else:
        c[k] = v
    return c

  workdir = str(tmp_path)
  trained = loop.train_and_evaluate(config(), workdir)
  evaluated = eval_run.evaluate_run(config(',fewshot=digits', mode='eval'),
                                    workdir)
  assert json.load(open(os.path.join(workdir, 'eval_summary.json'))) == (
      json.loads(json.dumps(evaluated)))
  assert evaluated['evaluated_checkpoint'].endswith('checkpoints/30')
  # Same checkpoint, same eval split: the same top-1 as the run's own eval.
  assert evaluated['eval_accuracy'] == pytest.approx(
      trained['eval_accuracy'])
  # The run's own checkpoint at its resolution: merged into summary.json.
  summary = json.load(open(os.path.join(workdir, 'summary.json')))
  assert 0 < summary['fewshot/digits/5shot'] <= 1
  assert summary['steps'] == 30  # Keys of the training summary are kept.

  # At another resolution, on another split, with the raw parameters:
  # eval_summary.json only; the run's results stay.
  for changed in (dict(input__image_size=24),
                  dict(input__eval_split='train[:64]'), dict(eval_ema='raw')):
    eval_run.evaluate_run(config(',fewshot=digits', mode='eval', **changed),
                          workdir)
    assert json.load(open(os.path.join(workdir, 'summary.json'))) == summary
  written = json.load(open(os.path.join(workdir, 'eval_summary.json')))
  assert written['eval_ema'] == 'raw' and written['data'] == 'digits'
  # A run stopped before its end has no results to merge into.
  os.remove(os.path.join(workdir, 'summary.json'))
  eval_run.evaluate_run(config(mode='eval'), workdir)
  assert not os.path.exists(os.path.join(workdir, 'summary.json'))
  with open(os.path.join(workdir, 'summary.json'), 'w') as f:
    json.dump(summary, f)
  # A section the run did not have, measuring few-shot another way, does
  # not replace the few-shot numbers merged above.
  other = config(',fewshot=digits', mode='eval')
  other.evals.fewshot.l2_reg = 1e-3
  eval_run.evaluate_run(other, workdir)
  assert json.load(open(os.path.join(workdir, 'summary.json'))) == summary
  # Every evaluation is in eval_history.jsonl with its settings, whether
  # merged, and why not.
  history = [json.loads(line) for line in open(
      os.path.join(workdir, 'eval_history.jsonl'))]
  assert [h['merged'] for h in history] == [True] + [False] * 5
  assert [h['eval_ema'] for h in history[1:4]] == ['ema', 'ema', 'raw']
  assert history[1]['image_size'] == 24 and history[0]['step'] == 30
  assert history[2]['eval_split'] == 'train[:64]'
  assert 'no summary.json' in history[4]['not_merged_because']
  assert history[5]['settings']['evals']['fewshot']['l2_reg'] == 1e-3
  assert "writes 'fewshot/digits/" in history[5]['not_merged_because']
  assert history[5]['fewshot/digits/5shot'] != summary['fewshot/digits/5shot']

  # No checkpoint in a new workdir: config.init is evaluated, into
  # eval_summary.json only (it is not that workdir's run).
  fresh = os.path.join(workdir, 'new')
  eval_run.evaluate_run(config(',fewshot=digits', mode='eval',
                               init=workdir), fresh)
  assert sorted(os.listdir(fresh)) == ['eval_history.jsonl',
                                       'eval_summary.json']
  assert json.load(open(os.path.join(fresh, 'eval_summary.json')))[
      'eval_accuracy'] == pytest.approx(trained['eval_accuracy'])

  # A different model than the checkpoint's: refused.
  with pytest.raises(ValueError, match='is a checkpoint of model'):
    eval_run.evaluate_run(config(',fewshot=digits', mode='eval',
                                 model__name='ViT-Ti/16'), workdir)
  # A bad evaluator setting fails before the weights are read.
  bad = config(',fewshot=digits', mode='eval')
  bad.evals.fewshot.datasets = ('imagenet2012_real',)
  def load(*args, **kwargs):
    raise AssertionError('the weights were read first')
  monkeypatch.setattr(eval_run, '_load', load)
  with pytest.raises(ValueError, match='has no train split'):
    eval_run.evaluate_run(bad, workdir)


def test_mode_eval_without_checkpoint_explains(tmp_path):
  out = subprocess.run(
      [sys.executable, '-m', 'vit_jax.main', f'--workdir={tmp_path}',
       '--config=configs/smoke.py:data=digits', '--config.mode=eval'],
      cwd=ROOT, capture_output=True, text=True,
      env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert out.returncode != 0
  assert 'has no checkpoint and config.init is not set' in out.stderr


def _free_port():
  import socket
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.mark.slow  # ~90 s; multi-process training runs by default (test_train_step).
def test_two_processes_evaluate_like_one(tmp_path):
  """A 2-process run (gloo, one CPU device each) evaluates top-1 and
  few-shot; one process re-evaluating its checkpoint gets the same numbers
  (each example counted once, the same few-shot pool and draws)."""
  workdir = str(tmp_path)
  config = ['--config=configs/smoke.py:data=digits,steps=8,batch=32,'
            'fewshot=digits', '--config.async_checkpoints=false']
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  procs = [subprocess.Popen(
      [sys.executable, '-m', 'vit_jax.main', f'--workdir={workdir}', *config,
       f'--coordinator=127.0.0.1:{port}', '--num_processes=2',
       f'--process_id={i}'], cwd=ROOT, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
  try:
    outs = [p.communicate(timeout=600) for p in procs]
  finally:  # Timed out or failed: no process left to load the rest.
    for p in procs:
      p.kill()
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  multi = json.load(open(os.path.join(workdir, 'summary.json')))
  assert multi['num_devices'] == 2 and multi['eval_examples'] == 360
  out = subprocess.run(
      [sys.executable, '-m', 'vit_jax.main', f'--workdir={workdir}', *config,
       '--config.mode=eval'], cwd=ROOT, capture_output=True, text=True,
      env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  single = json.load(open(os.path.join(workdir, 'eval_summary.json')))
  assert single['eval_accuracy'] == pytest.approx(multi['eval_accuracy'])
  for k in (1, 5, 10):
    key = f'fewshot/digits/{k}shot'
    assert single[key] == pytest.approx(multi[key], abs=1e-6), key


@evaluators.register('test_mean_confidence')
class MeanConfidence(evaluators.Evaluator):
  """An evaluator from outside the package: the mean top softmax score on
  the first `batches` batches of the run's eval split."""

  def __init__(self, name, cfg, context):
    super().__init__(name, cfg, context)
    from vit_jax.data import pipeline
    self._batches = cfg.get('batches', 1)
    self._iterator = pipeline.eval_iterator(context.config.input)
    self._mesh = context.mesh
    self._apply = jax.jit(lambda p, x: jax.nn.softmax(context.model.apply(
        {'params': p}, x, train=False)).max(-1).mean())

  def run(self, params):
    scores = []
    for i, batch in enumerate(self._iterator):
      if i == self._batches:
        break
      scores.append(float(self._apply(params, batch['image'])))
    return {f'{self.name}/confidence': float(np.mean(scores))}


def _digits_run(digits_model, **evals):
  """(config, model, params, mesh, params sharding) of a run on digits."""
  model, params = digits_model
  mesh = shd.make_mesh()
  config = ml_collections.ConfigDict(dict(
      input=dict(data='digits', image_size=16, batch_size=60,
                 eval_batch_size=60), eval_every=0, evals=evals))
  return config, model, params, mesh, shd.param_shardings(params, mesh)


def test_an_evaluator_registered_outside_runs_from_a_config(digits_model):
  config, model, params, mesh, sh = _digits_run(
      digits_model, conf=dict(type='test_mean_confidence', batches=2,
                              every=5))
  built = evaluators.build(config, model, mesh, sh, (16, 16, 3))
  assert [type(e).__name__ for e in built] == ['Classification',
                                               'MeanConfidence']
  assert built[1].due(5, 100) and not built[1].due(6, 100)
  with jax.set_mesh(mesh):
    metrics = evaluators.run_all(built, jax.device_put(params, sh))
  assert 0.1 - 1e-4 <= metrics['conf/confidence'] <= 1.0  # 10 classes.
  assert metrics['eval_examples'] == 360  # The built-in top-1 ran too.


def test_evaluators_trace_for_the_meshs_platform_only(monkeypatch):
  """As the train step: a bf16 evaluation traces the mesh's platform's
  branches only (on a GPU or TPU host it traced the CPU ones too, and could
  time the CPU matmul forms for them)."""
  from vit_jax.models import platform_switch
  model = models.create('ViT-test', num_classes=10, dtype='bfloat16')
  params = model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)))['params']
  seen = []
  switch = platform_switch.switch
  def recording(*args, **kwargs):
    seen.append(platform_switch.targets())
    return switch(*args, **kwargs)
  monkeypatch.setattr(platform_switch, 'switch', recording)
  config, model, params, mesh, sh = _digits_run(
      (model, params), fewshot=dict(type='fewshot', datasets=('digits',),
                                    shots=(1,), seeds=1, pool_per_class=2,
                                    every=0))
  built = evaluators.build(config, model, mesh, sh, (16, 16, 3))
  with jax.set_mesh(mesh):
    evaluators.run_all(built, jax.device_put(params, sh))
  assert seen and set(seen) == {('cpu',)}, set(seen)


def test_a_classification_eval_with_more_classes_than_the_head_is_refused():
  """Top-1 on another dataset whose labels a 3-class head cannot score
  would log eval loss NaN after training: refused when built."""
  from vit_jax.data.errors import LabelRangeError
  model = models.create('ViT-test', num_classes=3)
  params = model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)))['params']
  config, _, _, mesh, sh = _digits_run(
      (model, params), other=dict(type='classification', data='digits'))
  with pytest.raises(LabelRangeError, match=r'\(digits\).*num_classes=3'):
    evaluators.build(config, model, mesh, sh, (16, 16, 3))


def test_evaluator_types_say_what_is_known(digits_model):
  config, model, _, mesh, sh = _digits_run(digits_model,
                                           x=dict(type='fewshoot'))
  with pytest.raises(ValueError, match="Did you mean fewshot.*Known types: "
                     'classification, fewshot'):
    evaluators.build(config, model, mesh, sh, (16, 16, 3))
  config.evals.x = dict(kind='fewshot')
  with pytest.raises(ValueError, match='now called type'):
    evaluators.build(config, model, mesh, sh, (16, 16, 3))


def test_an_mpp_evaluation_with_other_settings_is_not_the_runs(tmp_path):
  """`mode=eval` merges into summary.json only the run's own evaluation:
  for MPP also its objective settings (rate, representation, ...) and its
  corruption's version; not the eval batch size (corruption per image)."""
  from configs import mpp as mpp_config
  from vit_jax.train import eval_run, run_files
  config = mpp_config.get_config('data=cpu,smoke=true')
  workdir = str(tmp_path)
  run_files.write_config(workdir, config, command='test')
  summary = {'steps': 10, 'image_size': 28, 'num_processes': 2,
             'mpp_eval_corruption': 'per_image'}
  run_files.write_summary(workdir, summary)
  same = lambda c: eval_run._not_the_runs_evaluation(c, workdir, 10, 28)
  assert same(config) is None  # Another process count is the same.
  for field, value in (('mpp.rate', 0.25), ('mpp.representation', 'gap'),
                       ('objective', 'supervised')):
    other = config.copy_and_resolve_references()
    section, _, key = field.rpartition('.')
    setattr(other.get(section) if section else other, key, value)
    assert same(other) and field.split('.')[0] in same(other), field
  bigger = config.copy_and_resolve_references()
  bigger.input.eval_batch_size = 64
  assert same(bigger) is None
  # A run of an earlier version drew its corruption per global batch: its
  # numbers are not this version's.
  del summary['mpp_eval_corruption']
  run_files.write_json(workdir, run_files.SUMMARY, summary)
  assert 'drew its corruption per global batch' in same(config)
  # A supervised run's accuracy does not depend on the eval batch size.
  from configs import smoke
  supervised = smoke.get_config('data=digits,steps=10,batch=32')
  run_files.write_config(workdir, supervised, command='test')
  run_files.write_summary(workdir, {'steps': 10, 'image_size': 16})
  bigger = supervised.copy_and_resolve_references()
  bigger.input.eval_batch_size = 64
  assert eval_run._not_the_runs_evaluation(bigger, workdir, 10, 16) is None


def test_multi_hot_labels_score_precision_at_1():
  """Multi-label data (JFT-style TFRecords): a prediction is right when it
  is one of the image's labels; the loss takes every label as a target."""
  model = _Fixed()
  preds = np.array([0, 1, 2])
  images = np.zeros((3, 4, 4, 1), np.float32)
  images[np.arange(3), 0, preds, 0] = 1.0
  labels = np.zeros((3, 3), np.float32)  # The head is 4 wide: padded.
  labels[0, [0, 2]] = 1  # Prediction 0 among {0, 2}: right.
  labels[1, 2] = 1  # Prediction 1 not in {2}: wrong.
  labels[2, [1, 2]] = 1  # Right.
  batch = jax.tree.map(jnp.asarray, {'image': images, 'label': labels,
                                     'mask': np.ones(3, bool)})
  out = classification.batch_sums({'unused': jnp.zeros(1)}, batch,
                                  model=model, loss='sigmoid')
  assert float(out['correct']) == 2 and float(out['count']) == 3
  logits = images[:, 0, :4, 0].astype(np.float64)
  targets = np.pad(labels, ((0, 0), (0, 1)))
  want = (np.logaddexp(0, logits) - targets * logits).sum()
  assert float(out['loss']) == pytest.approx(want, rel=1e-5)


def test_settings_an_older_record_lacks_are_not_compared(tmp_path):
  """A run recorded by an earlier version has no `objective` or `mpp` in
  its config.json: that is no difference (its evaluation may be merged,
  and a finished run started again is not refused for it)."""
  from configs import smoke
  from vit_jax.train import eval_run, run_files
  config = smoke.get_config('data=digits,steps=10,batch=32')
  run_files.write_config(str(tmp_path), config, command='test')
  record = json.load(open(tmp_path / 'config.json'))
  for key in ('objective', 'mpp'):
    record['config'].pop(key, None)
  (tmp_path / 'config.json').write_text(json.dumps(record))
  assert eval_run.differs_from_run(config, str(tmp_path)) is None
  other = config.copy_and_resolve_references()
  other.input.pp_eval = 'decode|resize(20)|central_crop(16)|value_range(-1,1)'
  assert 'input.pp_eval' in eval_run.differs_from_run(other, str(tmp_path))
  # An option an evaluator gained since (its record lacks the key) counts
  # as its default: no difference where the config keeps the default, one
  # where it sets another value; a value the record has still counts.
  config = smoke.get_config('data=digits,steps=10,batch=32,fewshot=digits')
  run_files.write_config(str(tmp_path), config, command='test')
  record = json.load(open(tmp_path / 'config.json'))
  for key in ('pp', 'l2_reg', 'batch_size'):
    del record['config']['evals']['fewshot'][key]
  (tmp_path / 'config.json').write_text(json.dumps(record))
  assert eval_run.differs_from_run(config, str(tmp_path)) is None
  config.evals.fewshot.l2_reg = 1.0
  assert 'config.evals.fewshot.l2_reg is 1.0' in eval_run.differs_from_run(
      config, str(tmp_path))
  config.evals.fewshot.l2_reg = None
  record['config']['evals']['fewshot']['seeds'] = 7
  (tmp_path / 'config.json').write_text(json.dumps(record))
  assert ("config.evals.fewshot.seeds is 3, the run's was 7" in
          eval_run.differs_from_run(config, str(tmp_path)))


def test_two_sections_keep_both_their_results(digits_model):
  """Two few-shot sections (another regulariser, say) each keep their
  numbers: a section not named `fewshot` writes `fewshot/<name>/...`;
  sections that would still write one metric are refused when built."""
  from vit_jax.configs import common
  a = common.fewshot(('digits',), (1, 5), seeds=1, pool_per_class=10)
  b = common.fewshot(('digits',), (1, 5), seeds=1, pool_per_class=10)
  b.l2_reg = 1e-3
  config, model, params, mesh, sh = _digits_run(digits_model, fewshot=a,
                                                fs_b=b)
  built = evaluators.build(config, model, mesh, sh, (16, 16, 3))
  with jax.set_mesh(mesh):
    out = evaluators.run_all(built[1:], jax.device_put(params, sh))
  assert sorted(k for k in out if not k.endswith('_std')) == [
      'fewshot/digits/1shot', 'fewshot/digits/5shot',
      'fewshot/fs_b/digits/1shot', 'fewshot/fs_b/digits/5shot']
  assert out['fewshot/digits/5shot'] != out['fewshot/fs_b/digits/5shot']
  # A top-1 section with the built-in one's prefix: refused by name.
  config.evals.x = dict(type='classification', prefix='eval_')
  with pytest.raises(ValueError, match=r"config.evals.x and the run's top-1 "
                     r"evaluation \(eval_\*\) would both write 'eval_"):
    evaluators.build(config, model, mesh, sh, (16, 16, 3))
  # ReaL-only sections: `real_accuracy` for the one named real (the
  # tables'), `<name>_real_accuracy` for another.
  real_only = ml_collections.ConfigDict(dict(real_only=True))
  assert classification._prefix('real', real_only) == ''  # pylint: disable=protected-access
  assert classification._prefix('real2', real_only) == 'real2_'  # pylint: disable=protected-access
  with pytest.raises(ValueError, match='names a dataset twice'):
    _fewshot_on(*digits_model, 16, datasets=('digits', 'digits:train:test'),
                shots=(1,), batch_size=60)


def test_fewshot_images_have_the_runs_value_range(digits_model):
  """A run trained on [0, 1] images gets [0, 1] few-shot images or a
  refusal naming the pp to set, never [-1, 1] ones silently; `pp` is a
  field of `common.fewshot`, so the command line can set it."""
  from vit_jax.configs import common
  section = common.fewshot(('digits',), (1,), seeds=1, pool_per_class=2)
  config, model, _, mesh, sh = _digits_run(digits_model, fewshot=section)
  config.input.pp_train = config.input.pp_eval = (
      'decode|resize(16)|value_range(0,1)')
  with pytest.raises(ValueError, match=re.escape(
      "[0, 1] (value_range(0, 1)) (input.pp_train): set --config.evals."
      "fewshot.pp='decode|resize({size})|value_range(0, 1)'")):
    evaluators.build(config, model, mesh, sh, (16, 16, 3))
  config.lock()  # As --config.evals.fewshot.pp=... sets it.
  config.evals.fewshot.pp = 'decode|resize({size})|value_range(0, 1)'
  evaluators.build(config, model, mesh, sh, (16, 16, 3))


def test_fewshot_never_draws_its_shots_from_the_split_it_scores(
    digits_model):
  """A dataset with no train split (ImageNet ReaL: validation only) would
  draw its k-shot images from the split it scores: refused unless a train
  split is named."""
  with pytest.raises(ValueError, match=r"'imagenet2012_real' has no train "
                     r'split .* imagenet2012_real:TRAIN:TEST'):
    _fewshot_on(*digits_model, 16, datasets=('imagenet2012_real',),
                shots=(1,), batch_size=60)
  with pytest.raises(DatasetNotPreparedError):  # Past that check.
    _fewshot_on(*digits_model, 16, datasets=(
        'imagenet2012_real:validation[:100]:validation[100:]',),
                shots=(1,), batch_size=60)


def test_an_evaluation_measured_otherwise_is_not_the_runs(tmp_path):
  """`mode=eval` replaces none of a run's results with numbers measured
  another way: an evaluator option its record lacks counts as its default
  (a plain-dict section records only what it sets), the loss is compared,
  and a new section may not write a metric the run already has."""
  from configs import smoke
  from vit_jax.train import eval_run, run_files
  workdir = str(tmp_path)
  config = smoke.get_config('data=digits,steps=10,batch=32')
  config.evals.fewshot = dict(type='fewshot', datasets=('digits',),
                              shots=(1, 5), pool_per_class=20)
  run_files.write_config(workdir, config, command='test')
  record = json.load(open(tmp_path / 'config.json'))
  del record['config']['loss']  # Recorded before `loss` existed: softmax.
  (tmp_path / 'config.json').write_text(json.dumps(record))
  run_files.write_summary(workdir, {'steps': 10, 'image_size': 16,
                                    'fewshot/digits/5shot': 0.24})
  same = lambda c, m=None: eval_run._not_the_runs_evaluation(  # pylint: disable=protected-access
      c, workdir, 10, 16, m)
  now = config.copy_and_resolve_references()
  now.evals.fewshot.l2_reg = float(fewshot.L2_REG)  # The default, written.
  now.evals.fewshot.shots = (5, 1)
  assert same(config) is None and same(now) is None
  for field, value, why in (
      ('pp', 'decode|resize({size})|value_range(0,1)',
       "config.evals.fewshot.pp is 'decode|resize({size})|value_range(0,1)'"
       ", the run's was 'decode|resize({size})|value_range(-1,1)'"),
      ('l2_reg', 1.0, 'config.evals.fewshot.l2_reg is 1.0'),
      ('seeds', 5, 'config.evals.fewshot.seeds is 5, the run\'s was 3')):
    other = config.copy_and_resolve_references()
    other.evals.fewshot[field] = value
    assert why in same(other), field
  sigmoid = config.copy_and_resolve_references()
  sigmoid.loss = 'sigmoid'
  assert "config.loss is 'sigmoid', the run's was 'softmax'" in same(sigmoid)
  # A new section: its new metrics may join the run's, never replace one.
  new = config.copy_and_resolve_references()
  new.evals.fs_l2 = dict(type='fewshot', datasets=('digits',), l2_reg=1.0)
  assert same(new, {'eval': {'eval_accuracy': 0.3},
                    'fs_l2': {'fewshot/fs_l2/digits/5shot': 0.4}}) is None
  assert "config.evals.fs_l2 is not one of the run's evaluators (fewshot) " \
      "but writes 'fewshot/digits/5shot'" in same(
          new, {'fs_l2': {'fewshot/digits/5shot': 0.44}})


def test_another_datasets_evaluator_does_not_inherit_skip_bad_images():
  """A folder run skipping bad files evaluates on cifar10 / digits too:
  their kinds refuse the option, which is the run's, not theirs."""
  import types
  from vit_jax.evaluators import base
  config = ml_collections.ConfigDict(dict(input=dict(
      data='folder', data_dir='/x', skip_bad_images=True,
      train_split='train[:90%]', eval_split='train[90%:]')))
  context = types.SimpleNamespace(config=config)
  inp = base.eval_input(ml_collections.ConfigDict(dict(data='digits')),
                        context)
  assert inp.data == 'digits' and not inp.skip_bad_images
  assert base.eval_input(ml_collections.ConfigDict({}),
                         context).skip_bad_images  # Its own data: kept.


def test_a_folder_run_of_the_earlier_file_order_is_not_merged(tmp_path):
  """Folder runs before 2026-11-29 held out other images of a slice:
  `mode=eval` of such a run writes eval_summary.json only."""
  from configs import smoke
  from vit_jax.train import eval_run, run_files
  config = smoke.get_config('data=digits,steps=10,batch=32')
  config.input.data, config.input.data_dir = 'folder', str(tmp_path)
  config.input.train_split, config.input.eval_split = ('train[:90%]',
                                                       'train[90%:]')
  workdir = str(tmp_path)
  run_files.write_config(workdir, config, command='test')
  summary = {'steps': 10, 'image_size': 16}
  run_files.write_json(workdir, run_files.SUMMARY, summary)
  same = lambda: eval_run._not_the_runs_evaluation(config, workdir, 10, 16)
  assert 'in the order before 2026-11-29' in same()
  run_files.write_json(workdir, run_files.SUMMARY,
                       {**summary, 'file_order': 'path_hash'})
  assert same() is None


_TWICE = '''
from vit_jax import evaluators


@evaluators.register('test_twice')
class Twice(evaluators.Evaluator):
  def run(self, params):
    return {}


def get_config(arg=None):
  import ml_collections
  return ml_collections.ConfigDict()
'''


def test_an_evaluator_defined_in_a_config_file_survives_its_second_run(
    tmp_path):
  """A config file runs twice per run (check_command_line, then
  config_flags): its evaluator class registers twice, as two class objects
  of one definition, and the run starts; another class under the name is
  still refused."""
  import importlib.util
  from vit_jax.configs import common
  from vit_jax.evaluators import base
  path = tmp_path / 'my_eval.py'
  path.write_text(_TWICE)
  try:
    common.check_command_line(['prog', f'--config={path}'])
    first = base.TYPES['test_twice']
    # As config_flags loads it: another module of the same file.
    spec = importlib.util.spec_from_file_location('my_eval_config', path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
      spec.loader.exec_module(module)
    finally:
      del sys.modules[spec.name]
    assert base.TYPES['test_twice'] is module.Twice is not first
    other = tmp_path / 'other.py'  # One class name, another file.
    other.write_text(_TWICE)
    spec = importlib.util.spec_from_file_location('other_eval', other)
    with pytest.raises(ValueError, match=r"'test_twice' is already "
                       r'registered by my_eval_config.Twice .*my_eval.py'):
      spec.loader.exec_module(importlib.util.module_from_spec(spec))

    class Twice(evaluators.Evaluator):  # Another class, this file.
      def run(self, params):
        return {}
    with pytest.raises(ValueError, match='under another name'):
      evaluators.register('test_twice')(Twice)
    assert base.TYPES['test_twice'] is module.Twice
  finally:
    base.TYPES.pop('test_twice', None)


@pytest.mark.parametrize('name,section,error', [
    ('x', dict(type='fewshot'), r'evals\.x\.datasets is not set'),
    ('x', dict(type='fewshot', datasets=('digits',), shots=()),
     r'evals\.x\.shots=\(\): expected a non-empty'),
    ('x', dict(type='fewshot', datasets='digits', shots=(1,)),
     r"evals\.x\.datasets='digits' is one string.*datasets=\('digits',\)"),
    ('x', dict(type='fewshot', datasets=('digits', 3)),
     r"evals\.x\.datasets=\('digits', 3\): expected"),
    ('x', dict(type='fewshot', datasets=('digits',), shots=(0, 1)),
     r'evals\.x\.shots=\(0, 1\)'),
    ('x', dict(type='fewshot', datasets=('digits',), shots=(1.5,)),
     r'evals\.x\.shots=\(1\.5,\)'),
    ('x', dict(type='fewshot', datasets=('digits',), seeds=0),
     r'evals\.x\.seeds=0: expected a whole number >= 1'),
    ('x', dict(type='fewshot', datasets=('digits',), l2_reg=-5),
     r'evals\.x\.l2_reg=-5: expected a number > 0'),
    ('x', dict(type='fewshot', datasets=('digits',), l2_reg=0.0),
     r'evals\.x\.l2_reg=0\.0'),
    ('x', dict(type='fewshot', datasets=('digits',), pool_per_class=0),
     r'evals\.x\.pool_per_class=0'),
    ('x', dict(type='fewshot', datasets=('digits',), shot=(1,)),
     r"evals\.x\.shot is not a setting of a type='fewshot' evaluator\. "
     r'Did you mean evals\.x\.shots\?'),
    ('x', dict(type='classification', splt='test'),
     r'evals\.x\.splt is not a setting.*Did you mean evals\.x\.split\?'),
    ('x', dict(datasets=('digits',)), r'config\.evals\.x\.type is not set'),
    # Plain top-1 written as `real_accuracy`, which the tables read as ReaL.
    ('real', dict(type='classification', real_onyl=True),
     r'Did you mean evals\.real\.real_only\?'),
    ('real', dict(type='classification'),
     r"evals\.real would write its plain top-1 accuracy as 'real_accuracy'"
     r'.*evals\.real\.real_only=True'),
    ('x', dict(type='classification', prefix='real_'),
     r"evals\.x would write its plain top-1 accuracy as 'real_accuracy'"),
])
def test_a_section_the_evaluator_cannot_use_is_refused_by_key(
    digits_model, name, section, error):
  """Misspelt keys and unusable values fail when the run starts, naming
  `evals.<name>.<key>`, not as a crash or a silent default later."""
  config, model, _, mesh, sh = _digits_run(digits_model, **{name: section})
  with pytest.raises(ValueError, match=error):
    evaluators.build(config, model, mesh, sh, (16, 16, 3))


def test_a_section_named_real_may_measure_top_1_under_its_own_prefix(
    digits_model):
  config, model, _, mesh, sh = _digits_run(digits_model, real=dict(
      type='classification', prefix='top1_'))
  built = evaluators.build(config, model, mesh, sh, (16, 16, 3))
  names = built[1].metric_names()
  assert 'top1_accuracy' in names and 'real_accuracy' not in names


def test_two_mpp_evaluations_writing_one_metric_are_refused():
  """An mpp section names the metrics it writes, so that one with the
  run's own `eval_` prefix is refused when built (it overwrote the run's
  numbers); the names are the ones `run` writes."""
  from configs import mpp as mpp_config
  from vit_jax import selfsup
  config = mpp_config.get_config('data=cpu,smoke=true')
  model = selfsup.model_from_config(config, 10)
  s = config.input.image_size
  params = model.init(jax.random.key(0), jnp.zeros((1, s, s, 3)),
                      train=False)['params']
  mesh = shd.make_mesh()
  sh = shd.param_shardings(params, mesh)
  config.evals = dict(other=dict(type='mpp', prefix='eval_', seed=1))
  with pytest.raises(ValueError, match=r"config\.evals\.other and the run's "
                     r"masked-patch evaluation \(eval_\*\) would both write "
                     r"'eval_examples'"):
    evaluators.build(config, model, mesh, sh, (s, s, 3))
  config.evals = dict(other=dict(type='mpp', sed=1))
  with pytest.raises(ValueError, match=r'Did you mean evals\.other\.seed\?'):
    evaluators.build(config, model, mesh, sh, (s, s, 3))
  config.evals = dict(other=dict(type='mpp', seed=1))
  built = evaluators.build(config, model, mesh, sh, (s, s, 3))
  assert built[1].metric_names() == {
      'other_mpp_loss', 'other_mpp_accuracy', 'other_mpp_positions',
      'other_examples'}
  with jax.set_mesh(mesh):
    assert set(built[0].run(jax.device_put(params, sh))) == (
        built[0].metric_names())


def test_fewshot_of_non_finite_features_is_nan_not_chance(digits_model,
                                                          caplog):
  """A diverged model's NaN features would predict class 0 for every
  image, a chance-level accuracy that reads like a result: NaN, logged
  naming the dataset and shot."""
  model, params = digits_model
  nan_params = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
  _, run = _fewshot_on(model, nan_params, 16, datasets=('digits',),
                       shots=(1, 5), seeds=2, pool_per_class=5,
                       batch_size=60)
  with caplog.at_level('WARNING'):
    out = run()
  assert all(np.isnan(v) for v in out.values()), out
  assert re.search(r'few-shot digits \(evals\.fewshot\): NaN.*not '
                   r'finite for 50 of 50 train-pool', caplog.text)


def test_fit_predict_scores_the_test_set_in_blocks(rng):
  """The test set is standardised and scored a block at a time, not copied
  to float64 whole for each fit (at ImageNet scale 1.4 GB per fit): the
  memory beyond the inputs stays below the test set's own size, and the
  predictions are big_vision's."""
  import tracemalloc
  k, d = 10, 256
  centres = rng.normal(size=(k, d)) * 0.3
  y = np.repeat(np.arange(k), 5)
  yt = rng.randint(0, k, 40000)
  x = (centres[y] + rng.normal(size=(len(y), d))).astype(np.float32)
  xt = (centres[yt] + rng.normal(size=(len(yt), d))).astype(np.float32)
  x[:, :3] += 1e4  # Massive activations: standardised before scoring.
  xt[:, :3] += 1e4
  tracemalloc.start()
  try:
    pred = fewshot.fit_predict(x, y, xt, k, 1.0)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert peak < xt.nbytes, (peak, xt.nbytes)
  want = _big_vision_ridge(x.astype(np.float64), y, xt.astype(np.float64),
                           k, 1.0)
  np.testing.assert_array_equal(pred, want)
  assert np.mean(pred == yt) > 0.5


def test_the_pool_keeps_only_the_first_of_each_class_while_reading(rng):
  """`first_of_each_class`, applied batch by batch, keeps what selecting
  each class's first `pool` rows of the whole split keeps (labels outside
  the classes never), so only pool x classes rows are held while reading."""
  k, pool = 7, 4
  labels = rng.randint(-1, k + 2, 300)
  counts = np.zeros(k, np.int64)
  kept = []
  for start in range(0, len(labels), 23):
    batch = labels[start:start + 23]
    kept.append(start + np.flatnonzero(
        fewshot.first_of_each_class(batch, counts, pool)))
  want = np.sort(np.concatenate([np.flatnonzero(labels == c)[:pool]
                                 for c in range(k)]))
  np.testing.assert_array_equal(np.concatenate(kept), want)
  np.testing.assert_array_equal(
      counts, np.minimum(np.bincount(labels[(labels >= 0) & (labels < k)],
                                     minlength=k), pool))


def test_the_pool_read_is_the_first_of_each_class_of_the_split(digits_model):
  ev, _ = _fewshot_on(*digits_model, 16, datasets=('digits',), shots=(1,),
                      seeds=1, pool_per_class=5, batch_size=60)
  model, params = digits_model
  mesh = shd.make_mesh()
  with jax.set_mesh(mesh):
    p = jax.device_put(params, shd.param_shardings(params, mesh))
    x, y = ev._features(p, 'digits', 'train', pool=5)  # pylint: disable=protected-access
    x_all, y_all = ev._features(p, 'digits', 'train')  # pylint: disable=protected-access
  sel = np.sort(np.concatenate([np.flatnonzero(y_all == c)[:5]
                                for c in range(10)]))
  np.testing.assert_array_equal(y, y_all[sel])
  np.testing.assert_allclose(x, x_all[sel], rtol=1e-6)


def test_a_section_named_eval_is_refused_as_the_built_ins_name(
    digits_model):
  """`mode=eval` keeps results by evaluator name: a section named `eval`
  replaced the built-in top-1's eval_accuracy, eval_loss and eval_examples
  in eval_summary.json (and was skipped as the run's own in the merge
  check). Refused when built; the built-in keeps the name."""
  section = dict(type='fewshot', datasets=('digits',), shots=(1,), seeds=1,
                 pool_per_class=2, batch_size=60)
  config, model, _, mesh, sh = _digits_run(digits_model, eval=section)
  with pytest.raises(ValueError, match=r"config\.evals\.eval is the name of "
                     r"the run's own top-1 evaluation .*another name"):
    evaluators.build(config, model, mesh, sh, (16, 16, 3))
  config, model, _, mesh, sh = _digits_run(digits_model, fs=section)
  built = evaluators.build(config, model, mesh, sh, (16, 16, 3))
  assert [e.name for e in built] == [evaluators.BUILT_IN, 'fs']


@pytest.mark.parametrize('dataset', ['digits:test:test', 'digits:test:'])
def test_fewshot_refuses_to_draw_shots_from_the_split_it_scores(
    digits_model, dataset):
  """A train split equal to the test split (`digits:test:test`, or `test`
  beside the registry's eval split) drew the k-shot images from the
  images scored, silently."""
  with pytest.raises(ValueError, match=r"evals\.fewshot: few-shot dataset "
                     r"'digits' would draw its k-shot images from .*test.*, "
                     r'the split it scores.*digits:TRAIN:TEST'):
    _fewshot_on(*digits_model, 16, datasets=(dataset,), shots=(1,),
                seeds=1, pool_per_class=2, batch_size=60)


def test_fewshot_compares_the_splits_as_resolved(digits_model, tmp_path):
  """`folder:test:` scores the folder's default eval split, `test`: the
  same split as its k-shot images, though the strings differ."""
  from PIL import Image
  for split in ('train', 'test'):
    for c in range(3):
      (tmp_path / split / f'c{c}').mkdir(parents=True)
      for i in range(2):
        Image.fromarray(np.full((8, 8, 3), 40 * c + i, np.uint8)).save(
            tmp_path / split / f'c{c}' / f'{i}.png')
  with pytest.raises(ValueError, match=r"would draw its k-shot images from "
                     r"'test', the split it scores"):
    _fewshot_on(*digits_model, 16, datasets=('folder:test:',), shots=(1,),
                seeds=1, pool_per_class=2, batch_size=60,
                data_dir=str(tmp_path))


@pytest.mark.parametrize('dataset,split', [
    ('digits:train:test[:0]', 'test[:0]'),
    ('digits:train[:0]:test', 'train[:0]')])
def test_an_empty_fewshot_split_is_refused_when_built(digits_model, dataset,
                                                      split):
  """An empty split was accepted and failed after training with numpy's
  'need at least one array to concatenate'."""
  with pytest.raises(ValueError, match=(
      rf"evals\.fewshot: split '{re.escape(split)}' of few-shot dataset "
      r"'digits' has no examples")):
    _fewshot_on(*digits_model, 16, datasets=(dataset,), shots=(1,),
                seeds=1, pool_per_class=2, batch_size=60)
  # A split whose size was not known when built: said when it is read.
  ev, run = _fewshot_on(*digits_model, 16, datasets=('digits',), shots=(1,),
                        seeds=1, pool_per_class=2, batch_size=60)
  ev._pipelines[('digits', 'train', True)] = []
  with pytest.raises(ValueError, match=r"evals\.fewshot: split 'train' of "
                     r"few-shot dataset 'digits' has no examples"):
    run()


def test_fewshot_batch_size_is_checked_when_built(digits_model):
  """-8 was accepted (and failed at the first evaluation naming
  input.eval_batch_size), 0 fell back to input.eval_batch_size silently;
  None (or absent) is input.eval_batch_size."""
  model, params = digits_model
  mesh = shd.make_mesh()
  sh = shd.param_shardings(params, mesh)
  inp = ml_collections.ConfigDict(dict(eval_batch_size=60, data_dir=None))
  for bad in (-8, 0, 2.5, True, '60'):
    cfg = ml_collections.ConfigDict(dict(
        datasets=('digits',), shots=(1,), seeds=1, pool_per_class=2,
        batch_size=bad))
    with pytest.raises(ValueError, match=re.escape(
        f'evals.fewshot.batch_size={bad!r}: expected a whole number >= 1')):
      _fewshot(cfg, inp, model, mesh, sh, 16)
  for unset in (dict(batch_size=None), {}):
    ev = _fewshot(ml_collections.ConfigDict(dict(
        datasets=('digits',), shots=(1,), seeds=1, pool_per_class=2,
        **unset)), inp, model, mesh, sh, 16)
    assert ev._input.eval_batch_size == 60


def test_a_sections_every_is_a_step_count(digits_model):
  """every=-5 ran every 5 steps and 2.5 every 2; None is 0 (the end)."""
  model, params = digits_model
  mesh = shd.make_mesh()
  sh = shd.param_shardings(params, mesh)
  inp = ml_collections.ConfigDict(dict(eval_batch_size=60, data_dir=None))
  section = dict(datasets=('digits',), shots=(1,), seeds=1, pool_per_class=2)
  for bad in (-5, 2.5, True):
    with pytest.raises(ValueError, match=re.escape(
        f'evals.fewshot.every={bad!r}: 0 (at the end of training only)')):
      _fewshot(ml_collections.ConfigDict(dict(section, every=bad)), inp,
               model, mesh, sh, 16)
  assert _fewshot(ml_collections.ConfigDict(dict(section, every=None)), inp,
                  model, mesh, sh, 16).every == 0


def test_a_sections_pp_is_checked_as_the_sections(digits_model):
  """A classification section's `pp` of another size or value range was
  blamed on --config.input.image_size / input.pp_eval, and its `{size}`
  (which few-shot's takes) was a parse error; a few-shot pp of another
  size was blamed on input.image_size too. Both name evals.<name>.pp and
  take `{size}`, one definition (`base.section_ops`)."""
  def build(**section):
    config, model, _, mesh, sh = _digits_run(digits_model, fs=section)
    return evaluators.build(config, model, mesh, sh, (16, 16, 3))[1]
  with pytest.raises(ValueError, match=(
      r"evals\.fs: pre-processing 'decode\|resize\(24\)\|value_range\(-1,1\)'"
      r" makes 24x24x3 images of 'digits' \(test\); the model takes "
      r'16x16x3: write evals\.fs\.pp with \{size\}')):
    build(type='classification', pp='decode|resize(24)|value_range(-1,1)')
  with pytest.raises(ValueError, match=(
      r"evals\.fs\.pp='decode\|resize\(16\)\|value_range\(0,1\)' gives "
      r'images in \[0, 1\].*trained on \[-1, 1\].*'
      r"--config\.evals\.fs\.pp='decode\|resize\(16\)\|value_range\(-1, 1\)'")):
    build(type='classification', pp='decode|resize(16)|value_range(0,1)')
  ev = build(type='classification', pp='decode|resize({size})|value_range'
             '(-1,1)')
  assert ev._input.pp_eval == 'decode|resize(16)|value_range(-1,1)'
  assert build(type='classification', pp='eval')._input.pp_eval == (
      'decode|resize_small(16)|central_crop(16)|value_range(-1,1)')
  with pytest.raises(ValueError, match=r"makes 24x24x3 images of few-shot "
                     r"dataset 'digits'; the model takes 16x16x3: write "
                     r'evals\.fs\.pp with \{size\}'):
    build(type='fewshot', datasets=('digits',), shots=(1,), seeds=1,
          pool_per_class=2, pp='decode|resize(24)|value_range(-1,1)')
  for section in (dict(type='classification'),
                  dict(type='fewshot', datasets=('digits',))):
    with pytest.raises(ValueError, match=r"evals\.fs\.pp='resize\(\{resize\}"
                       r"\)': its one placeholder is \{size\}"):
      build(**section, pp='resize({resize})')
  assert evaluators.base.section_ops('x', 'resize({size})', (16, 24)) == (
      'resize(16, 24)')


def test_eval_ema_both_of_a_checkpoint_without_averages(
    smoke_workdir, tmp_path, monkeypatch):
  """`mode=eval` with eval_ema=both of a checkpoint without Polyak averages
  said 'set optim.ema_decay' (the averages come from the checkpoint: no
  config can add them), after reading the weights. Its record says so:
  refused before the load, pointing at eval_ema=raw; a record that does
  not say gets the same message after it."""
  import trained_workdir
  from vit_jax.configs import smoke
  from vit_jax.train import eval_run
  workdir = trained_workdir.copy(smoke_workdir, tmp_path)
  config = smoke.get_config(
      f'data=digits,steps={trained_workdir.STEPS},batch=32')
  config.input.eval_batch_size = 120
  config.mode, config.eval_ema = 'eval', 'both'
  config.optim.ema_decay = 0.999  # Changes nothing: not the checkpoint's.
  load = eval_run._load
  def no_load(*args, **kwargs):
    raise AssertionError('the weights were read first')
  monkeypatch.setattr(eval_run, '_load', no_load)
  message = (r'eval_ema=both: .*checkpoints/8 holds no Polyak \(EMA\) '
             r'averages.*--config\.eval_ema=raw')
  with pytest.raises(ValueError, match=message):
    eval_run.evaluate_run(config, workdir)
  monkeypatch.setattr(eval_run, '_load', load)
  monkeypatch.setattr(eval_run, '_has_averages', lambda source: None)
  with pytest.raises(ValueError, match=message):
    eval_run.evaluate_run(config, workdir)
  assert not os.path.exists(os.path.join(workdir, 'eval_summary.json'))


def test_a_sections_pp_on_a_run_with_its_own_split_names(tmp_path):
  """A section with its own `pp` on the run's data is read with the run's
  splits (TFRecords `mytrain-*` / `myval-*`), not the registry's 'train'."""
  from test_data_tfrecord import _write
  for split in ('mytrain', 'myval'):
    _write(str(tmp_path / f'{split}-00000'), list(range(5)), size=(8, 8))
  model = models.create('ViT-test', num_classes=5)
  params = model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)))['params']
  mesh = shd.make_mesh()
  ops = 'decode|resize(16)|value_range(-1,1)'
  config = ml_collections.ConfigDict(dict(input=dict(
      data='tfrecord', data_dir=str(tmp_path), num_classes=5,
      train_split='mytrain', eval_split='myval', image_size=16, batch_size=5,
      eval_batch_size=5, pp_train=ops, pp_eval=ops), eval_every=0,
      evals=dict(sec=dict(type='classification',
                          pp='decode|resize({size})|value_range(-1,1)'))))
  built = evaluators.build(config, model, mesh,
                           shd.param_shardings(params, mesh), (16, 16, 3))
  assert [e.name for e in built] == ['eval', 'sec']
