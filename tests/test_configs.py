"""Configs: every paper row resolves to the paper's settings, bad arguments
fail clearly, and the `smoke` variant of every config file trains on CPU."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from vit_jax.configs import augreg, common, cpu_recipes, cpu_reproduce, plain
from vit_jax.configs import finetune, pretrain, smoke, vtab
from vit_jax import models, paper
from vit_jax.train import config_check
from vit_jax.data import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _head(c):
  """The head size the trainer builds: the config's, else the dataset's."""
  return c.num_classes or registry.get(c.input.data).num_classes


def _table3_rows():
  for models_, data, epochs, opt, lr, decay, wd, dropout in paper.TABLE3:
    for model in models_:
      model = 'ViT-B/32' if model == 'ViT-*' else model
      yield model, data, epochs, lr, decay, wd, dropout


@pytest.mark.parametrize('row', list(_table3_rows()), ids=str)
def test_pretrain_rows_follow_table3(row):
  model, data, epochs, lr, decay, wd, dropout = row
  c = pretrain.get_config(f'model={model},data={data}')
  assert c.input.batch_size == 4096 and c.input.image_size == 224
  assert c.optim.warmup_steps == 10_000 and c.optim.name == 'adam'
  assert (c.optim.b1, c.optim.b2) == (0.9, 0.999)
  assert (c.optim.lr, c.optim.decay, c.optim.weight_decay) == (lr, decay, wd)
  assert (c.model.get('dropout_rate') or 0.0) == dropout
  assert c.total_epochs == max(epochs)  # The longest: Table 2's schedule.
  assert (c.optim.grad_clip_norm == 1.0) == (data != 'jft')
  assert c.input.pp_train == 'inception'
  assert c.report.task == 'pretrain' and c.report.pretrain == data
  for e in epochs:
    assert pretrain.get_config(
        f'model={model},data={data},epochs={e}').total_epochs == e
  models.from_config(c.model, _head(c))


@pytest.mark.parametrize('model', pretrain.MODELS)
@pytest.mark.parametrize('data', sorted(pretrain.DATA))
def test_every_model_builds_on_every_data(model, data):
  c = pretrain.get_config(f'model={model},data={data}')
  # The pre-training head (Sec. 3.1): a pre-logits layer of width D for
  # ViTs and hybrids on every dataset; BiT has none.
  width = None if model.startswith('BiT') else models.spec(model)[
      'hidden_size']
  assert c.model.get('representation_size') == width
  models.from_config(c.model, _head(c))


def test_every_table6_row_is_a_pretrain_config():
  for row in paper.TABLE6:
    c = pretrain.get_config(f'model={row["model"]},data=jft,'
                            f'epochs={row["epochs"]}')
    assert c.total_epochs == row['epochs']
    assert c.input.num_train_examples == paper.JFT_IMAGES


def test_resnet_optimizer_study_rows():
  adam = pretrain.get_config('model=BiT-R152x2,data=jft')
  sgd = pretrain.get_config('model=BiT-R152x2,data=jft,opt=sgd')
  assert adam.optim.name == 'adam' and sgd.optim.name == 'sgd'
  assert sgd.report.pretrain_optimizer == 'sgd'
  with pytest.raises(ValueError, match='use a BiT-R'):
    pretrain.get_config('model=ViT-B/16,data=jft,opt=sgd')


@pytest.mark.parametrize('data', sorted(finetune.TABLE4))
def test_finetune_rows_follow_table4(data):
  steps, lrs = finetune.TABLE4[data]
  c = finetune.get_config(f'data={data},lr={lrs[0]},init=/x')
  assert c.total_steps == steps and c.optim.lr == lrs[0]
  assert (c.optim.name, c.optim.momentum, c.optim.decay) == ('sgd', 0.9,
                                                            'cosine')
  assert c.optim.weight_decay == 0 and c.optim.grad_clip_norm == 1.0
  assert c.input.batch_size == 512 and c.input.image_size == 384
  assert ('real' in c.evals) == (data == 'imagenet2012')
  sweep = finetune.get_config(f'data={data},sweep=true')
  assert (sweep.input.train_split, sweep.input.eval_split) == ('train_dev',
                                                               'dev')
  assert sweep.report.sweep and not sweep.evals
  registry.get(data).resolve_split('train_dev')
  # Its smoke variant holds out part of digits' train split instead.
  smoke = finetune.get_config(f'data={data},sweep=true,smoke=true')
  for split in (smoke.input.train_split, smoke.input.eval_split):
    registry.get('digits').resolve_split(split)


def test_vtab_one_setting_for_all_tasks():
  for task in registry.VTAB_TASKS:
    c = vtab.get_config(f'task={task[5:]}')
    assert (c.optim.lr, c.total_steps, c.input.image_size) == (0.01, 2500,
                                                               384)
    assert c.input.train_split == 'train800val200'
    assert c.report.task == task
  # Its sweep evaluates on the 200 held out, also in the smoke stand-in
  # (which evaluated on test).
  smoke = vtab.get_config('task=dtd,sweep=true,smoke=true')
  assert (smoke.input.train_split, smoke.input.eval_split) == (
      'train[:800]', 'train[800:1000]')
  for split in (smoke.input.train_split, smoke.input.eval_split):
    registry.get(smoke.input.data).resolve_split(split)


@pytest.mark.parametrize('make,arg,match', [
    (pretrain.get_config, 'data=jft300m', 'expected one of'),
    (pretrain.get_config, 'model=ViT-X/16', 'no Table 3 row'),
    (pretrain.get_config, 'modle=ViT-B/16', "unknown config arg 'modle'"),
    (finetune.get_config, 'data=svhn', 'expected one of'),
    (vtab.get_config, 'task=mnist', 'expected one of'),
    (cpu_reproduce.get_config, 'step=transfer', 'pass init='),
    (smoke.get_config, 'steps=ten', "steps='ten': expected int, e.g. steps="),
    (augreg.get_config, 'variant=H/14', 'expected one of Ti/16'),
    (augreg.get_config, 'aug=heavy', 'expected one of none, light1'),
    (finetune.get_config, 'model=ViT-B/16,data=i1k,table2=true',
     'table2=true is ImageNet fine-tuning of ViT-L/16 or ViT-H/14'),
    (cpu_recipes.get_config, 'ingredients=randaug+cutout',
     'expected names from randaug, mixup'),
    # Ignored before: the run trained at 518 px whatever res= said.
    (finetune.get_config, 'model=ViT-H/14,data=imagenet2012,table2=true,'
     'res=384', r'res=384 with table2=true: .*518 px for ViT-H/14.*drop res='),
])
def test_bad_config_args_say_what_is_allowed(make, arg, match):
  with pytest.raises(ValueError, match=match):
    make(arg)


@pytest.mark.parametrize('spelling,short', [
    ('i21k', 'i21k'), ('I21K', 'i21k'), ('imagenet21k', 'i21k'),
    ('ImageNet21k', 'i21k'), ('JFT', 'jft'), ('jft300m', 'jft'),
    ('jft-300m', 'jft'), ('imagenet2012', 'i1k'), ('i1k', 'i1k'),
    ('in21k', 'i21k'), ('ImageNet-1k', 'i1k')])
def test_transfer_rows_take_the_spellings_the_tables_read(spelling, short):
  """`pretrain=ImageNet21k` fills the same cells as `pretrain=i21k`: the
  report holds the short name and the epochs of its Table 3 row (0.0
  before: the run fell out of every table)."""
  for make, arg in ((finetune.get_config, 'model=ViT-L/16'),
                    (vtab.get_config, 'model=ViT-L/16,task=dtd')):
    report = make(f'{arg},pretrain={spelling}').report
    assert report.pretrain == short
    assert report.pretrain_epochs == paper.default_epochs(short, 'ViT-L/16')
    assert report.pretrain_epochs > 0


def test_other_pretraining_data_is_recorded_with_a_warning(caplog):
  """Your own pre-training (pretrain=laion): recorded as given, with a
  warning that the run fills no paper table (0 epochs: no Table 3 row)."""
  for make, arg in ((finetune.get_config, 'model=ViT-L/16'),
                    (vtab.get_config, 'model=ViT-L/16,task=dtd')):
    report = make(f'{arg},pretrain=LAION').report
    assert report.pretrain == 'laion' and report.pretrain_epochs == 0
  assert 'fills no paper table' in caplog.text


def test_bit_1ep_trains_the_vit_1ep_compute():
  """The equal-compute ViT-vs-BiT pair estimates to the same training
  FLOPs (within half a BiT step): the BiT's steps came from a stale
  constant, 94% of the ViT's compute. docs/reproduce.md names the steps."""
  from vit_jax import accounting
  vit, bit = (accounting.estimate_for_config(
      cpu_reproduce.get_config(f'step={step}')) for step in ('vit_1ep',
                                                           'bit_1ep'))
  bit_step = bit.exaflops / bit.examples_seen * 128
  assert abs(bit.exaflops - vit.exaflops) <= bit_step / 2
  with open(os.path.join(ROOT, 'docs', 'reproduce.md')) as f:
    assert f'the BiT {round(bit.examples_seen / 128)} steps' in ' '.join(
        f.read().split())


@pytest.mark.parametrize('model', pretrain.MODELS)
def test_smoke_shrinks_every_model_keeping_its_family(model):
  c = pretrain.get_config(f'model={model},data=i21k,smoke=true')
  m = models.from_config(c.model, 10)
  assert type(m) is models.spec(model)['cls']
  assert c.input.image_size % m.stride == 0
  # The smallest final map the family runs fast on: 2x2 tokens for the
  # ViTs; 1x1 for BiT, whose 3x3 convolutions on a 2x2 map fall off
  # XLA:CPU's library kernels (models/bit.py:bit_shrink).
  assert 1 <= c.input.image_size // m.stride <= 2
  assert c.input.data == 'digits' and c.total_steps == 10


@pytest.mark.parametrize('data', sorted(augreg.RECIPES))
def test_augreg_rows_carry_the_recipe_of_their_source(data):
  for variant, (aug, wd, dropout, sd) in augreg.RECIPES[data].items():
    c = augreg.get_config(f'variant={variant},data={data}')
    randaug, mixup = augreg.AUG[aug]
    assert c.model.name == 'ViT-' + variant
    if randaug is None:
      assert 'randaug' not in c.input.pp_train, (variant, c.input.pp_train)
    else:
      assert f'randaug({randaug[0]}, {randaug[1]})' in c.input.pp_train
    assert (c.input.mixup or 0.0) == mixup
    assert c.optim.weight_decay == wd and c.optim.lr == 1e-3
    assert (c.model.get('dropout_rate') or 0.0) == dropout
    assert (c.model.get('stochastic_depth') or 0.0) == sd
    # Sigmoid cross-entropy on both (big_vision's loss='sigmoid_xent'),
    # with the head bias of vit_i21k.py (-10) and vit_i1k.py (-6.9).
    assert c.loss == 'sigmoid'
    assert c.model.head_bias_init == (-10.0 if data == 'i21k' else -6.9)
    assert c.total_epochs == 300 and c.input.batch_size == 4096
  # Their own big_vision picks, e.g. B/16: medium1 (i21k), medium2 (i1k).
  c = augreg.get_config(f'variant=B/16,data={data}')
  assert 'randaug(2, 15)' in c.input.pp_train
  assert c.input.mixup == (0.2 if data == 'i21k' else 0.5)
  # S/32: vit_i1k.py at 5f95305c says medium1 (an earlier revision: light2).
  c = augreg.get_config(f'variant=S/32,data={data}')
  assert (augreg.RECIPES[data]['S/32'][0], c.input.mixup) == (
      ('none', None) if data == 'i21k' else ('medium1', 0.2))
  c = augreg.get_config(f'variant=L/16,data={data},aug=strong2')
  assert 'randaug(2, 20)' in c.input.pp_train and c.input.mixup == 0.8


def test_plain_vit_row_is_big_visions_vit_s16_i1k():
  """big_vision's configs/vit_s16_i1k.py, field by field; no cell of the
  paper's tables."""
  c = plain.get_config()
  assert c.model.name == 'ViT-S/16'
  assert (c.model.posemb, c.model.classifier,
          c.model.representation_size) == ('sincos2d', 'gap', 384)
  assert c.model.get('head_bias_init') in (None, 0.0)
  assert c.loss == 'softmax' and c.total_epochs == 90
  assert c.input.batch_size == 1024 and c.input.data == 'imagenet2012'
  assert 'randaug(2, 10)' in c.input.pp_train and c.input.mixup == 0.2
  assert 'inception_crop(224)' in c.input.pp_train
  assert c.input.pp_eval.startswith('decode|resize_small(256, method="area")')
  assert (c.optim.name, c.optim.lr, c.optim.warmup_steps, c.optim.decay,
          c.optim.weight_decay, c.optim.grad_clip_norm, c.optim.mu_dtype) == (
              'adam', 1e-3, 10_000, 'cosine', 0.1, 1.0, 'bfloat16')
  assert c.report.recipe == 'plain-vit'
  assert plain.get_config('epochs=300').total_epochs == 300
  assert plain.get_config('variant=B/16').model.representation_size == 768
  with pytest.raises(ValueError, match='expected a ViT of the zoo'):
    plain.get_config('variant=X/16')


def test_table2_finetuning_rows_use_polyak_at_the_papers_resolution():
  for model, res in paper.TABLE2_FINETUNE_RES.items():
    c = finetune.get_config(f'model={model},data=imagenet2012,table2=true')
    assert c.input.image_size == res and c.total_steps == 20_000
    assert c.optim.ema_decay == paper.TABLE2_POLYAK == 0.9999
    assert c.optim.ema_warmup is False and c.eval_ema == 'ema'
  c = finetune.get_config('model=ViT-B/16,data=cifar10,ema=0.999')
  assert c.optim.ema_decay == 0.999 and c.optim.ema_warmup is True
  assert finetune.get_config('model=ViT-B/16').optim.ema_decay is None


def test_cpu_recipe_ingredients_change_only_what_they_name():
  base = cpu_recipes.get_config('ingredients=none')
  assert base.to_dict() | {'report': None} == cpu_reproduce.get_config(
      'step=pretrain').to_dict() | {'report': None}
  c = cpu_recipes.get_config('ingredients=randaug+reg')
  assert c.input.pp_train == base.input.pp_train.replace(
      '|flip_lr', '|flip_lr|randaug(2, 10)')
  assert (c.model.dropout_rate, c.model.stochastic_depth) == (0.1, 0.1)
  assert c.input.mixup is None and c.optim.ema_decay is None
  c = cpu_recipes.get_config('ingredients=mixup+ema')
  assert c.input.mixup == 0.2 and c.optim.ema_decay == 0.999
  assert c.eval_ema == 'both' and c.input.pp_train == base.input.pp_train


def _run(workdir, spec, caplog):
  """Trains `spec` ('configs/<file>.py:<args>', the --config the CLI takes)
  in this process: the configs' test, not the CLI's (tests/test_loop.py
  runs `python -m vit_jax.main`), without an interpreter start-up per run."""
  import importlib
  from vit_jax.train import loop
  path, _, arg = spec.partition(':')
  assert path.startswith('configs/') and path.endswith('.py'), spec
  module = importlib.import_module(
      'vit_jax.configs.' + os.path.basename(path)[:-3])
  config = module.get_config(arg or None)
  config.async_checkpoints = False
  caplog.clear()
  with caplog.at_level('INFO'):
    loop.train_and_evaluate(config, workdir)
  summary = json.load(open(os.path.join(workdir, 'summary.json')))
  summary['_log'] = caplog.text
  return summary


@pytest.mark.parametrize('spec', [
    'configs/smoke.py:smoke=true',
    'configs/pretrain.py:model=BiT-R50x1,data=jft,opt=sgd,smoke=true',
    # The 3-stage hybrid: the 4-stage R50+ViT-B/32's smoke runs its last
    # stage on a 2x2 map, a form XLA:CPU runs 3-4x slower (models/bit.py).
    'configs/pretrain.py:model=R50+ViT-B/16,data=i1k,smoke=true',
    'configs/augreg.py:variant=B/16,data=i21k,smoke=true',
    'configs/plain.py:smoke=true',
    pytest.param('configs/finetune.py:model=ViT-L/16,data=imagenet2012,'
                 'table2=true,smoke=true', marks=pytest.mark.slow),
    pytest.param('configs/cpu_recipes.py:ingredients=randaug+mixup+cutmix+'
                 'reg+ema,smoke=true', marks=pytest.mark.slow),
    # configs/vtab.py's smoke row is test_vtab_driver_runs_...'s (dtd and
    # eurosat through `python -m vit_jax.vtab`). BiT training is the R50x1
    # row's above; this one runs with -m slow.
    pytest.param('configs/cpu_reproduce.py:step=bit_1ep,smoke=true',
                 marks=pytest.mark.slow),
])
def test_smoke_variant_trains(tmp_path, spec, caplog):
  summary = _run(str(tmp_path), spec, caplog)
  assert summary['steps'] > 0 and 0 <= summary['eval_accuracy'] <= 1
  if 'smoke.py' not in spec:
    assert summary['report']['smoke'] is True


def test_smoke_pretrain_then_finetune_at_higher_resolution(tmp_path, caplog):
  """i21k pre-training (sigmoid loss, pre-logits) then Table 4 fine-tuning
  from its workdir at 1.5x the resolution."""
  pre = _run(str(tmp_path / 'pre'),
             'configs/pretrain.py:model=ViT-B/16,data=i21k,smoke=true', caplog)
  assert pre['report']['task'] == 'pretrain'
  fine = _run(str(tmp_path / 'fine'),
              'configs/finetune.py:model=ViT-B/16,data=cifar10,smoke=true,'
              f'init={tmp_path / "pre"}', caplog)
  assert fine['report']['task'] == 'cifar10'
  assert fine['report']['pretrain_epochs'] == 90  # Table 3's i21k schedule.
  assert f'initialised from {tmp_path / "pre"}' in fine['_log']
  log = open(tmp_path / 'fine' / 'metrics.jsonl').read()
  assert 'eval_accuracy' in log


def test_smoke_cpu_reproduce_pretrain_with_fewshot(tmp_path, caplog):
  pre = _run(str(tmp_path / 'pre'),
             'configs/cpu_reproduce.py:step=pretrain,smoke=true', caplog)
  assert 0 <= pre['fewshot/digits/5shot'] <= 1


@pytest.mark.slow  # The transfer is test_smoke_pretrain_then_finetune's path.
def test_smoke_cpu_reproduce_pretrain_then_transfer(tmp_path, caplog):
  _run(str(tmp_path / 'pre'),
       'configs/cpu_reproduce.py:step=pretrain,smoke=true', caplog)
  transfer = _run(str(tmp_path / 'tr'),
                  'configs/cpu_reproduce.py:step=transfer,smoke=true,'
                  f'init={tmp_path / "pre"}', caplog)
  assert transfer['dataset'] == 'mnist5k'
  assert f'initialised from {tmp_path / "pre"}' in transfer['_log']


def test_vtab_driver_runs_skips_and_refuses_other_settings(tmp_path):
  """Runs tasks and reports means; a failing task costs none of the
  others; re-running skips finished tasks; other settings in the same
  workdir are an error rather than a silently reused result."""
  cmd = [sys.executable, '-m', 'vit_jax.vtab', f'--workdir={tmp_path}']
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  (tmp_path / 'caltech101').write_text('a file where its workdir goes')
  out = subprocess.run(cmd + ['--config_args=smoke=true',
                              '--tasks=caltech101,dtd,eurosat'],
                       cwd=ROOT, capture_output=True, text=True, env=env)
  assert out.returncode == 1, out.stderr[-4000:]
  assert 'vit_jax.vtab: caltech101 failed:' in out.stderr
  assert sorted(os.listdir(tmp_path)) == ['caltech101', 'dtd', 'eurosat']
  assert 'dtd' in out.stdout and 'eurosat' in out.stdout
  (tmp_path / 'caltech101').unlink()
  again = subprocess.run(cmd + ['--config_args=smoke=true', '--tasks=dtd'],
                         cwd=ROOT, capture_output=True, text=True, env=env)
  assert again.returncode == 0 and 'finished earlier, skipped' in again.stderr
  other = subprocess.run(cmd + ['--config_args=smoke=true,lr=0.03',
                                '--tasks=dtd'],
                         cwd=ROOT, capture_output=True, text=True, env=env)
  assert other.returncode != 0 and 'other settings (lr' in other.stderr
  typo = subprocess.run(cmd + ['--config_args=smoke=true,bogus=1',
                               '--tasks=dtd'],
                        cwd=ROOT, capture_output=True, text=True, env=env)
  assert typo.returncode == 1 and 'Traceback' not in typo.stderr
  assert "--config_args=smoke=true,bogus=1: unknown config arg 'bogus'" in (
      typo.stderr)
  bad = subprocess.run(cmd + ['--config_args=smoke=true', '--tasks=dtd',
                              '--set=input.bogus=1'],
                       cwd=ROOT, capture_output=True, text=True, env=env)
  assert bad.returncode == 1 and 'Traceback' not in bad.stderr
  assert "--set=input.bogus=1: config.input has no field 'bogus'" in (
      bad.stderr)


def test_vtab_driver_takes_task_names_as_the_config_does():
  """`--tasks=vtab/dtd` is the registry's spelling, which configs/vtab.py's
  `task=` accepts too; an unknown one is still refused by name."""
  from absl import app
  from vit_jax import vtab as driver  # Defines its flags: only here.
  assert driver.tasks(['vtab/caltech101', 'dtd']) == ['caltech101', 'dtd']
  # A task named twice is run (and re-evaluated) once.
  assert driver.tasks(['dtd', 'vtab/dtd', 'dtd']) == ['dtd']
  assert vtab.get_config('task=vtab/dtd').input.data == 'vtab/dtd'
  with pytest.raises(app.UsageError, match=r"unknown VTAB task\(s\) \['dtdd'\]"):
    driver.tasks(['vtab/dtdd'])


def test_vtab_set_overrides_every_tasks_config():
  """`--set=FIELD=VALUE` is the driver's `--config.FIELD=VALUE`: literals
  typed, paths as strings, wrong names and types refused by name."""
  from absl import app
  from vit_jax import vtab as driver  # Defines its flags: only here.
  config = vtab.get_config('task=dtd')
  driver.override(config, 'input.data_dir=gs://b/tfds')
  driver.override(config, 'input.batch_size=256')
  driver.override(config, 'optim.lr=0.03')
  assert (config.input.data_dir, config.input.batch_size,
          config.optim.lr) == ('gs://b/tfds', 256, 0.03)
  driver.override(config, 'input.data_dir=2024')  # A folder named 2024.
  assert config.input.data_dir == '2024'
  with pytest.raises(app.UsageError, match=r"--set=optim.lrr=1: config.optim "
                     r"has no field 'lrr' \(did you mean lr"):
    driver.override(config, 'optim.lrr=1')
  with pytest.raises(app.UsageError, match=r'--set=input.batch_size=big: '):
    driver.override(config, 'input.batch_size=big')
  with pytest.raises(app.UsageError, match='expected FIELD=VALUE'):
    driver.override(config, 'input.batch_size')


def test_common_parse_arg_types():
  args = common.parse_arg('a=2,b=true,c=x', a=1, b=False, c='y', d=0.5)
  assert (args.a, args.b, args.c, args.d) == (2, True, 'x', 0.5)


@pytest.mark.parametrize('spec', [
    'configs/smoke.py:fewshot=mnist5k',
    'configs/cpu_reproduce.py:step=pretrain',
    'configs/pretrain.py:model=ViT-B/16,data=i21k,fewshot=cifar100',
    'configs/mpp.py:data=cpu',
])
def test_fewshot_regulariser_is_set_on_the_command_line(spec):
  """Every config's few-shot section lists `l2_reg` (None: the evaluator's
  default), so the command line can set it: ml_collections adds no field
  there."""
  from absl import flags
  from ml_collections import config_flags

  def parse(*overrides):  # As main.py's --config flag parses them.
    argv = ['main', f'--config={os.path.join(ROOT, spec)}', *overrides]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file('config', flag_values=flag_values,
                                    sys_argv=argv)
    flag_values(argv)
    return flag_values.config.evals.fewshot

  assert parse().type == 'fewshot' and parse().l2_reg is None
  assert parse('--config.evals.fewshot.l2_reg=4').l2_reg == 4.0
  assert parse().batch_size is None  # The run's eval batch size.
  assert parse('--config.evals.fewshot.batch_size=40').batch_size == 40


def test_any_model_option_can_be_set_on_the_command_line():
  """`config.model` lists every model family's options, unset, so that
  docs/training.md's `--config.model.dtype=bfloat16` parses on any config
  (main's own flags, parsed as `python -m vit_jax.main` parses them)."""
  code = (
      'import sys\n'
      'from absl import flags\n'
      'from vit_jax import main\n'
      'sys.argv = ["main", "--config=configs/pretrain.py:model=ViT-B/16,'
      'data=i21k,smoke=true", '
      '"--workdir=unused", "--config.model.dtype=bfloat16", '
      '"--config.model.remat=True", "--config.model.resnet_layers=(1,1,1)", '
      '"--config.model.depth=26"]\n'
      'flags.FLAGS(sys.argv)\n'
      'm = main._CONFIG.value.model\n'
      'print(repr((m.dtype, m.remat, tuple(m.resnet_layers), m.depth)))\n')
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == repr(
      ('bfloat16', True, (1, 1, 1), 26))
  # Unset options are the variant's defaults: the model is unchanged.
  c = smoke.get_config('data=digits')
  assert set(models.option_names()) <= set(c.model.keys())
  assert models.from_config(c.model, 10) == models.create('ViT-test', 10)


@pytest.mark.parametrize('model', pretrain.MODELS)
def test_every_paper_model_fine_tunes_at_the_papers_384_px(model):
  """Table 4's resolution for every Table 2/6 model, ViT-H/14 included
  (27x27 patches of 14 px; the last 6 pixels left out, as the reference
  implementation does), on ImageNet, the other transfer sets and VTAB."""
  from vit_jax.train import loop
  for config in (
      finetune.get_config(f'model={model},data=imagenet2012,init=/x'),
      finetune.get_config(f'model={model},data=cifar10,pretrain=jft,init=/x'),
      vtab.get_config(f'task=caltech101,model={model},init=/x')):
    config_check.check(config)
    assert config.input.image_size == 384
    report = loop._report(config, 'supervised',
                          ran=(config.total_steps, (384, 384, 3)))
    assert 'overridden' not in report, report


@pytest.mark.parametrize('arg,ran,why', [
    ('data=cifar10', (10_000, 384), None),
    ('data=cifar10,sweep=true,lr=0.03', (10_000, 384), None),
    ('model=ViT-H/14,data=imagenet2012,table2=true', (20_000, 518), None),
    ('data=cifar10,steps=50,res=224', (50, 224),
     "50 steps, the paper's 10000; 224x224 px, the paper's 384"),
    ('model=ViT-H/14,data=imagenet2012,ema=0.999', (20_000, 384),
     'Polyak averaging 0.999, which the paper did not use here'),
    ('data=cifar10,smoke=true', (5, 48), None),
])
def test_a_fine_tune_off_the_paper_protocol_fills_no_cell(arg, ran, why):
  """The report records how the run fine-tuned (lr, steps, resolution,
  Polyak factor, Table 2's ImageNet setting); a run that left Table 4's
  protocol for its task (a 50-step 224 px debug run, Polyak averaging
  outside Table 2) is marked overridden instead of filling the paper's
  cell. Smoke stand-ins are not compared."""
  from vit_jax.train import loop
  config = finetune.get_config(arg + ',init=/x')
  steps, size = ran
  report = loop._report(config, 'supervised', ran=(steps, (size, size, 3)))
  assert report.get('overridden') == why
  assert (report['steps'], report['image_size']) == (steps, size)
  assert report['lr'] == config.optim.lr
  assert report.get('table2', False) == ('table2' in arg)


def test_a_transfer_report_records_the_lr_it_trained_with():
  """`--config.optim.lr=0.03` on a sweep row: the sweep table tells rows
  apart by lr, which said the config args' 0.01; a VTAB run evaluated on
  val200 without sweep=true is no test-split cell."""
  from vit_jax.train import loop
  config = vtab.get_config('task=dtd,init=/x')
  config.optim.lr = 0.03
  report = loop._report(config, 'supervised', ran=(2500, (384, 384, 3)))
  assert report['lr'] == 0.03 and 'overridden' not in report
  config.input.eval_split = 'val200'
  report = loop._report(config, 'supervised', ran=(2500, (384, 384, 3)))
  assert report['overridden'] == 'evaluated on val200, not test'


@pytest.mark.parametrize('config_args,field,value,why', [
    ('task=dtd', 'input.train_split', 'train800',
     'trained on train800, not train800val200'),
    ('task=dtd', 'input.batch_size', 256, "batch_size=256, the paper's 512"),
    ('task=dtd', 'optim.weight_decay', 0.1,
     "weight_decay=0.1, the paper's 0.0"),
    ('task=dtd', 'optim.grad_clip_norm', None,
     "grad_clip_norm=None, the paper's 1.0"),
    ('task=dtd', 'optim.name', 'adam', "optimizer=adam, the paper's sgd"),
    ('task=dtd', 'optim.layer_decay', 0.75,
     'optim.layer_decay=0.75, which the paper did not use'),
    ('task=dtd,sweep=true', 'input.eval_split', 'test',
     'evaluated on test, not val200 (a learning-rate sweep)'),
    ('task=dtd,sweep=true', 'input.train_split', 'train800val200',
     'trained on train800val200, not train800 (a learning-rate sweep)'),
    ('task=dtd', 'accum_steps', 2, None),  # 512 in two halves: the same.
])
def test_a_vtab_set_off_table4_fills_no_cell(config_args, field, value, why):
  """`--set` of a split, the batch or the optimizer (vit_jax.vtab's own
  docs showed `--set=input.batch_size=256`) left Table 4's protocol but
  filled the paper's VTAB cell; a sweep evaluated on test (or on data it
  trained on) chose the learning rate on it."""
  from vit_jax import vtab as vtab_driver
  from vit_jax.train import loop
  config = vtab.get_config(config_args + ',init=/x')
  vtab_driver.override(config, f'{field}={value}')
  report = loop._report(config, 'supervised', ran=(2500, (384, 384, 3)))
  assert report.get('overridden') == why


def test_a_run_on_other_data_than_its_cell_fills_no_cell():
  """`--config.input.data=folder` (your own images) under a paper row's
  config args: the run keeps the row's recipe but is not that cell's (the
  tables listed it as CIFAR-10's / ImageNet-21k's)."""
  from vit_jax.train import loop
  config = finetune.get_config('model=ViT-B/16,data=cifar10,init=/x')
  assert 'overridden' not in loop._report(config, 'supervised',
                                          ran=(10_000, (384, 384, 3)))
  config.input.data = 'folder'
  report = loop._report(config, 'supervised', ran=(10_000, (384, 384, 3)))
  assert report['overridden'] == 'input.data=folder'
  config = pretrain.get_config('model=ViT-B/16,data=i21k')
  assert 'overridden' not in loop._report(config)
  config.input.data = 'tfrecord'
  assert loop._report(config)['overridden'] == 'input.data=tfrecord'
  smoke = pretrain.get_config('model=ViT-B/16,data=i21k,smoke=true')
  assert 'overridden' not in loop._report(smoke)  # digits stands in.


def test_imagenet_pretraining_takes_any_vit_of_the_zoo():
  """Table 3's ImageNet row is `ViT-*`: ViT-S/16 on i1k is that row (it
  was refused as having none); on JFT it has no row."""
  c = pretrain.get_config('model=ViT-S/16,data=i1k')
  assert (c.total_epochs, c.optim.lr, c.optim.weight_decay) == (300, 3e-3,
                                                                0.3)
  with pytest.raises(ValueError, match='no Table 3 row'):
    pretrain.get_config('model=ViT-S/16,data=jft')


def test_a_table2_report_of_another_model_is_no_protocol_and_no_crash():
  """`--config.report.model` (or an init's own report) naming a model
  Table 2 did not fine-tune at 512/518 px: the run is summarised (a
  KeyError after the last step left the workdir stuck)."""
  from vit_jax.train import loop
  config = finetune.get_config(
      'model=ViT-L/16,data=imagenet2012,lr=0.03,table2=true,init=/w/pre')
  config.report.model = 'ViT-B/16'
  report = loop._report(config, 'supervised', ran=(20_000, (512, 512, 3)))
  assert report['table2'] and report['image_size'] == 512
  assert paper.transfer_protocol('imagenet2012', 'ViT-B/16', True) is None


@pytest.mark.parametrize('spec', ['configs/cpu_reproduce.py:step=pretrain,epochs=1',
                                  'configs/cpu_recipes.py:ingredients=ema,epochs=1'])
def test_an_epoch_row_warm_up_longer_than_the_run_is_refused_up_front(spec):
  """An epoch row with the data's size stated (469 steps of one
  Fashion-MNIST epoch) is checked before any set-up, as a step row is:
  one line naming the field and a warm-up that fits, not a traceback from
  the optimizer at setup."""
  module = {'cpu_reproduce': cpu_reproduce, 'cpu_recipes': cpu_recipes}[
      spec.split('/')[1].split('.')[0]]
  config = module.get_config(spec.split(':', 1)[1])
  with pytest.raises(config_check.ConfigError,
                     match=r'optim\.warmup_steps=500 is not below the 469 '
                     r'total steps.*warmup_steps=46'):
    config_check.check(config)
  config.optim.warmup_steps = 46
  config_check.check(config)
  config.total_steps = 1000  # Steps win over epochs: the warm-up fits them.
  config.optim.warmup_steps = 500
  config_check.check(config)


def test_optimizer_and_real_options_are_reachable_from_the_command_line():
  """Fields the code reads exist in the config, so the command line can set
  them: SGD's Nesterov momentum, and how often ImageNet's ReaL evaluation
  runs."""
  from vit_jax.train import optim
  config = finetune.get_config('data=imagenet2012,init=/x')
  assert config.optim.nesterov is False and config.evals.real.every == 0
  config.optim.nesterov = True
  config.evals.real.every = 1000
  config_check.check(config)
  params = {'w': np.ones((2,), np.float32)}
  grads = {'w': np.ones((2,), np.float32)}
  updates = []
  for nesterov in (False, True):
    config.optim.nesterov = nesterov
    tx, _ = optim.make(config.optim, 1000)
    state = tx.init(params)
    for _ in range(3):
      update, state = tx.update(grads, state, params)
    updates.append(float(update['w'][0]))
  assert updates[0] != updates[1]


def test_fine_tuning_evaluates_images_squashed_as_it_trains_them():
  """The `finetune` train preset squashes a 4:3 photo to a square (the
  reference's protocol); evaluation must too, not crop the unsquashed
  centre: a left quarter stays a quarter of the evaluated image."""
  import tensorflow as tf
  from vit_jax.data import preprocess
  config = finetune.get_config('data=oxford_iiit_pet,init=/x')
  image = np.zeros((48, 64, 3), np.uint8)
  image[:, :16] = 255  # The left quarter.
  out = preprocess.build(config.input.pp_eval, 32)(
      {'image': tf.constant(image)}, tf.constant((0, 0), tf.int64))['image']
  white = float(np.mean(out.numpy()[..., 0] > 0))
  assert abs(white - 0.25) < 0.04, white
  # The registry's defaults pair likewise; inception-trained (pre-training)
  # data keeps the centre crop.
  assert [registry.get(d).pp_eval for d in ('cifar10', 'folder')] == [
      'resize'] * 2
  assert {registry.get(d).pp_eval for d in (
      'imagenet2012', 'imagenet21k', 'jft', 'tfrecord')} == {'eval'}


def test_augreg_evaluates_with_big_visions_area_resize():
  """AugReg checkpoints are evaluated as big_vision does: its resize_small
  defaults to the area method (anti-aliased), not bilinear."""
  import tensorflow as tf
  from vit_jax.data import preprocess
  config = augreg.get_config('variant=B/16,data=i1k')
  rng = np.random.RandomState(0)
  image = rng.randint(0, 256, (300, 400, 3)).astype(np.uint8)
  out = preprocess.build(config.input.pp_eval, 224)(
      {'image': tf.constant(image)}, tf.constant((0, 0), tf.int64))['image']
  area = tf.image.resize(image, (256, 341), method='area')
  top, left = (256 - 224) // 2, (341 - 224) // 2
  want = area[top:top + 224, left:left + 224] / 127.5 - 1
  np.testing.assert_allclose(out.numpy(), want.numpy(), atol=1e-4)
