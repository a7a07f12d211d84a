"""vit_jax.tables: summaries -> Markdown tables beside the paper's numbers.

Estimates use the analytic FLOP count (no model lowering) except where a
test checks the XLA path on one small model, so the whole file runs in
seconds.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from vit_jax import accounting, paper, tables
from vit_jax.data import registry

VTAB = [t.split('/', 1)[1] for t in registry.VTAB_TASKS]


def _write(root, name, summary):
  d = root / name
  d.mkdir(parents=True)
  (d / 'summary.json').write_text(json.dumps(summary))
  return d


def _report(model, task, pretrain='jft', epochs=7.0, **kw):
  return {'model': model, 'pretrain': pretrain, 'pretrain_epochs': epochs,
          'task': task, 'sweep': False, 'lr': 0.01, **kw}


def _run(model, task, acc=None, **kw):
  summary = {'model': model, 'dataset': task, 'steps': 10,
             'report': _report(model, task, **kw)}
  if acc is not None:
    summary['eval_accuracy'] = acc
  return summary


def _vtab_acc(i):
  return 0.40 + 0.02 * i


@pytest.fixture(scope='module')
def runs_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp('runs')
  # Table 6, ViT-B/32 (JFT, 7 epochs): pre-training on an H100 with few-shot
  # metrics; ImageNet with ReaL; two CIFAR-10 runs; a sweep on CIFAR-100.
  _write(root, 'b32/pretrain', {
      **_run('ViT-B/32', 'pretrain'), 'core_days': 1.5, 'exaflops': 50.0,
      'hardware': 'h100', 'fewshot/cifar10/5shot': 0.75,
      'fewshot/imagenet2012/1shot': 0.3})
  _write(root, 'b32/i1k', {**_run('ViT-B/32', 'imagenet2012', 0.8123),
                           'real_accuracy': 0.8650})
  _write(root, 'b32/c10_a', _run('ViT-B/32', 'cifar10', 0.9850))
  _write(root, 'b32/c10_b', _run('ViT-B/32', 'cifar10', 0.9870))
  c100 = _run('ViT-B/32', 'cifar100', 0.9000)
  c100['report']['smoke'] = True
  _write(root, 'b32/c100', c100)
  sweep = _run('ViT-B/32', 'cifar100', 0.9990)
  sweep['report']['sweep'] = True
  _write(root, 'b32/c100_sweep', sweep)
  # Optimizer study: BiT-R50x1 pre-trained with SGD.
  _write(root, 'r50_sgd/i1k', _run('BiT-R50x1', 'imagenet2012', 0.7800,
                                   pretrain_optimizer='sgd'))
  # VTAB: all 19 tasks for ViT-L/16 (I21k, 90 epochs), 5 for ViT-H/14 (JFT).
  for i, task in enumerate(VTAB):
    _write(root, f'vtab_l16/{task}', _run(
        'ViT-L/16', f'vtab/{task}', _vtab_acc(i), pretrain='i21k',
        epochs=90))
  for task in VTAB[:5]:
    _write(root, f'vtab_h14/{task}', _run(
        'ViT-H/14', f'vtab/{task}', 0.5, epochs=14))
  # No report; a report without a paper cell.
  _write(root, 'misc/no_report', {'model': 'ViT-test', 'dataset': 'digits',
                                  'eval_accuracy': 0.5, 'core_days': 0.001})
  _write(root, 'misc/i1k_b16', _run('ViT-B/16', 'cifar10', 0.97,
                                    pretrain='i1k', epochs=300))
  _write(root, 'misc/no_epochs', _run('ViT-B/32', 'cifar10', 0.99,
                                      epochs=None))
  return root


@pytest.fixture(scope='module')
def rendered(runs_dir):
  runs = tables.load_runs([str(runs_dir)])
  return tables.render(runs, flops='analytic')


def _section(md, title):
  """The lines of the `## title...` section."""
  parts = md.split('\n## ')
  match = [p for p in parts if p.startswith(title)]
  assert match, (title, [p.splitlines()[0] for p in parts])
  return match[0].splitlines()


def _row(md, title, *first):
  """Cells of the table row in section `title` starting with `first`."""
  for line in _section(md, title):
    cells = _cells(line)
    if tuple(cells[:len(first)]) == first:
      return cells
  raise AssertionError(f'no row {first} in {title}')


def _col(md, title, column, *first):
  """The cell under `column` of the row starting with `first`."""
  header = next(_cells(line) for line in _section(md, title)
                if line.startswith('|'))
  return _row(md, title, *first)[header.index(column)]


def _cells(line):
  return [c.strip() for c in line.strip().strip('|').split('|')]


def test_load_runs_finds_every_summary(runs_dir):
  runs = tables.load_runs([str(runs_dir)])
  assert len(runs) == 7 + 19 + 5 + 3
  assert sum(r.sweep for r in runs) == 1
  # Globs and comma-separated strings work too.
  assert len(tables.load_runs(f'{runs_dir}/b32/c10_*,{runs_dir}/misc')) == 5


def test_table6_cells(rendered):
  title = 'Table 6'
  row = _row(rendered, title, 'ViT-B/32', '7')
  assert _col(rendered, title, 'ImageNet', 'ViT-B/32', '7') == (
      '80.73 / 81.23 (+0.50)')
  assert _col(rendered, title, 'ReaL', 'ViT-B/32', '7') == (
      '86.27 / 86.50 (+0.23)')
  # Two runs for the cell: their mean and standard deviation (as the
  # paper's Table 2), never the best on the test set.
  assert _col(rendered, title, 'C10', 'ViT-B/32', '7') == (
      '98.61 / 98.60 (-0.01; mean of 2 ± 0.14)')
  # The sweep run (99.90) is left out.
  assert _col(rendered, title, 'C100', 'ViT-B/32', '7') == (
      '90.49 / 90.00 (-0.49; smoke)')
  assert _col(rendered, title, 'Pets', 'ViT-B/32', '7') == '93.40 / —'
  # Measured compute of the pre-training run, with its hardware.
  assert _col(rendered, title, 'exaFLOPs', 'ViT-B/32', '7') == '55 / 50 (-5.0)'
  assert _col(rendered, title, 'core-days', 'ViT-B/32', '7') == (
      '1.5 (on h100)')
  assert len(row) == 10
  # Rows without runs: paper numbers and the estimate.
  assert _col(rendered, title, 'ImageNet', 'ViT-B/16', '7') == '84.15 / —'
  assert 'est.' in _col(rendered, title, 'exaFLOPs', 'ViT-B/16', '7')


def test_optimizer_study(rendered):
  title = 'ResNet optimizer study'
  assert _col(rendered, title, 'BiT-R50x1 SGD', 'ImageNet') == (
      '78.24 / 78.00 (-0.24)')
  assert _col(rendered, title, 'BiT-R50x1 SGD', 'average') == (
      '88.79 / 1/5 datasets')
  assert _col(rendered, title, 'BiT-R50x1 Adam', 'ImageNet') == '77.54 / —'
  # The SGD run is not a Table 6 (Adam) run.
  assert _col(rendered, 'Table 6', 'ImageNet', 'BiT-R50x1', '7') == (
      '77.54 / —')


def test_table2_and_vtab_means(rendered):
  mean = 100 * sum(_vtab_acc(i) for i in range(19)) / 19
  title = 'Table 2'
  vtab = _col(rendered, title, 'ViT-L/16 (I21k)', 'VTAB (19 tasks)')
  assert vtab == f'72.72 / {mean:.2f} ({mean - 72.72:+.2f})'
  assert _col(rendered, title, 'ViT-H/14 (JFT)', 'VTAB (19 tasks)') == (
      '77.63 / 5/19 tasks')
  assert _col(rendered, title, 'BiT-L (R152x4)', 'CIFAR-10') == '99.37'
  assert _col(rendered, title, 'Noisy Student (EffNet-L2)', 'ImageNet') == (
      '88.50')
  assert 'est.' in _col(rendered, title, 'ViT-H/14 (JFT)', 'TPUv3-core-days')

  title = 'VTAB-1k'
  col = 'ViT-L/16 (i21k, 90 ep)'
  assert _col(rendered, title, col, 'caltech101') == f'{100 * _vtab_acc(0):.2f}'
  groups = {}
  for i, task in enumerate(VTAB):
    groups.setdefault(registry.get(f'vtab/{task}').group, []).append(
        _vtab_acc(i))
  for group, name in tables.VTAB_GROUPS:
    accs = groups[group]
    assert _col(rendered, title, col, f'**{name} mean**') == (
        f'{100 * sum(accs) / len(accs):.2f}')
  assert _col(rendered, title, col, '**VTAB mean (19)**') == vtab
  h14 = 'ViT-H/14 (jft, 14 ep)'
  assert _col(rendered, title, h14, '**Natural mean**') == '5/7 tasks'
  assert _col(rendered, title, h14, 'kitti_distance') == '—'


def test_fewshot_and_other_runs(rendered):
  assert _col(rendered, 'Few-shot', 'cifar10 5-shot', *_workdir(
      rendered, 'b32/pretrain')) == '75.00'
  assert _col(rendered, 'Few-shot', 'imagenet2012 1-shot', *_workdir(
      rendered, 'b32/pretrain')) == '30.00'
  # Its top-1 too: the run is marked used, so no other table shows it.
  top1 = _col(rendered, 'Few-shot', 'top-1', *_workdir(rendered,
                                                        'b32/pretrain'))
  assert top1 not in ('', None)
  other = '\n'.join(_section(rendered, 'Other runs'))
  assert 'misc/no_report' in other and 'no report' in other
  assert 'misc/i1k_b16' in other and 'no paper cell' in other
  # Runs shown elsewhere (also the second-best and the sweep) are not here.
  assert 'c10_a' not in other and 'sweep' not in other and 'vtab' not in other
  assert 'LR-sweep runs left out: 1.' in rendered
  assert 'report lacks pretrain_epochs' in other


def _workdir(md, suffix):
  for line in _section(md, 'Few-shot'):
    first = _cells(line)[0]
    if first.endswith(suffix):
      return (first,)
  raise AssertionError(suffix)


def test_paper_only_lists_table6_with_estimates():
  md = tables.paper_only(flops='analytic')
  for r in paper.TABLE6:
    cells = _row(md, 'Table 6', r['model'], str(r['epochs']))
    assert cells[2] == f'{r["imagenet2012"]:.2f}'
    ref, ours = cells[8].split(' / ')
    assert ref == f'{r["exaflops"]:,}' and 'est.' in ours
    ours = float(ours.split(' est.')[0].replace(',', ''))
    assert abs(ours / r['exaflops'] - 1) < 0.05, (r, cells[8])
    assert cells[9].endswith('est.')
  assert 'VTAB-1k' not in md and 'Other runs' not in md
  only2 = tables.paper_only(tables='2', flops='analytic')
  assert 'Table 6' not in only2 and '2,500 / ' in only2


def test_xla_estimate_matches_accounting():
  ef, days = tables.estimate('ViT-B/32', 'jft', 7.0)
  assert ef == pytest.approx(accounting.table6_exaflops('ViT-B/32', 7))
  est = accounting.estimate('ViT-B/32', 7 * accounting.JFT_IMAGES,
                            utilization=accounting.paper_utilization())
  assert days == pytest.approx(est.core_days)
  assert tables.estimate('EffNet-L2', 'jft', 7.0) is None


def test_errors(tmp_path):
  with pytest.raises(tables.TablesError, match='no summary.json.*empty'):
    (tmp_path / 'empty').mkdir()
    tables.load_runs([str(tmp_path / 'empty')])
  bad = _write(tmp_path, 'bad', {})
  (bad / 'summary.json').write_text('{"eval_accuracy": 0.5,')
  with pytest.raises(tables.TablesError, match=f'malformed {bad}'):
    tables.load_runs([str(bad)])
  (bad / 'summary.json').write_text(json.dumps(
      {'report': _report('ViT-B/16', 'cifar10', epochs='seven')}))
  with pytest.raises(tables.TablesError, match='bad report'):
    tables.load_runs([str(bad)])
  (bad / 'summary.json').write_text(json.dumps(
      {'report': _report('ViT-B/16', 'cifar10'), 'eval_accuracy': 'n/a'}))
  with pytest.raises(tables.TablesError, match="eval_accuracy='n/a' is not"):
    tables.load_runs([str(bad)])
  # With a `skipped` list (the command line): the others are read.
  good = _write(tmp_path, 'good', {})
  skipped = []
  runs = tables.load_runs([str(bad), str(good)], skipped=skipped)
  assert [r.workdir for r in runs] == [str(good)]
  assert len(skipped) == 1 and str(bad) in skipped[0]
  # A run still going (config.json, checkpoints, no summary yet) among
  # finished ones: said so, and the others' table is made.
  going = tmp_path / 'going'
  (going / 'checkpoints' / '500').mkdir(parents=True)
  (going / 'config.json').write_text('{}')
  with pytest.raises(tables.TablesError, match='its run has not finished'):
    tables.load_runs([str(going)])
  skipped = []
  runs = tables.load_runs([str(going), str(good)], skipped=skipped)
  assert [r.workdir for r in runs] == [str(good)]
  assert len(skipped) == 1 and 'has not finished' in skipped[0]
  with pytest.raises(tables.TablesError, match='unknown tables'):
    tables.paper_only(tables='2,7')


def test_gfile_paths(runs_dir, monkeypatch):
  # gs:// paths go through tf.io.gfile; the same code on local paths.
  import tensorflow as tf
  monkeypatch.setattr(tables, '_fs', lambda path: tf.io.gfile)
  runs = tables.load_runs([str(runs_dir / 'b32')])
  assert len(runs) == 6
  md = tables.render(runs, tables='6', flops='analytic')
  assert '98.61 / 98.60 (-0.01; mean of 2 ± 0.14)' in md


def test_main_writes_output(runs_dir, tmp_path):
  out = tmp_path / 'tables.md'
  assert tables.main([f'--workdirs={runs_dir}/b32', '--tables=6',
                      '--flops=analytic', f'--output={out}']) == 0
  assert '98.61 / 98.60' in out.read_text()


def _cli(*args):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, '-m', 'vit_jax.tables', *args],
                        capture_output=True, text=True, env=env,
                        check=False)


def test_cli(runs_dir):
  proc = _cli(f'--workdirs={runs_dir}/b32/*,{runs_dir}/misc', '--tables=6,other',
              '--flops=analytic')
  assert proc.returncode == 0, proc.stderr
  assert '| ViT-B/32 | 7 | 80.73 / 81.23 (+0.50) |' in proc.stdout
  assert 'no report' in proc.stdout
  proc = _cli(f'--workdirs={runs_dir}/nowhere')
  assert proc.returncode != 0
  assert f"no summary.json found at or below '{runs_dir}/nowhere'" in (
      proc.stderr)


def _sweep_rows(md):
  """{(setting, task, lr): (dev accuracy, mark)} of the LR-sweep table."""
  rows = {}
  for line in _section(md, 'LR sweeps'):
    cells = _cells(line)
    if line.startswith('| ') and len(cells) == 6 and cells[2] not in (
        'lr', '---:'):
      rows[tuple(cells[:3])] = tuple(cells[3:5])
  return rows


def _sweep(lr, acc, task='cifar10', **kw):
  run = _run('ViT-B/16', task, acc, lr=lr, sweep=True, **kw)
  return run


def test_sweep_table_marks_the_best_lr(tmp_path):
  """The best of a group's runs with a dev accuracy; a tie says so; a
  group without any marks none best; an incomplete Table 4 grid is
  counted; overridden sweeps of two pre-trainings are two groups, labelled
  with how they fine-tuned and why they are overridden."""
  for lr, acc in ((0.001, 0.91), (0.003, 0.95), (0.01, 0.93), (0.03, 0.90)):
    _write(tmp_path, f'c10/{lr}', _sweep(lr, acc))
  for lr, acc in ((0.001, 0.80), (0.003, 0.85), (0.01, 0.85)):
    _write(tmp_path, f'c100/{lr}', _sweep(lr, acc, task='cifar100'))
  for lr in (0.001, 0.003):
    _write(tmp_path, f'pets/{lr}', _sweep(lr, None, task='oxford_iiit_pet'))
  why = "1000 steps, the paper's 500"
  _write(tmp_path, 'flowers_jft/0.01', _sweep(
      0.01, 0.70, task='oxford_flowers102', steps=1000, overridden=why))
  _write(tmp_path, 'flowers_i21k/0.003', _sweep(
      0.003, 0.90, task='oxford_flowers102', steps=1000, overridden=why,
      pretrain='i21k', epochs=90))
  rows = _sweep_rows(tables.render(tables.load_runs([str(tmp_path)]),
                                   tables='sweep'))
  jft = 'ViT-B/16 (jft, 7 ep)'
  assert rows[(jft, 'cifar10', '0.003')] == ('95.00', 'best')
  assert [m for (s, t, _), (_, m) in rows.items() if t == 'cifar10'] == [
      '', 'best', '', '']
  tie = 'tie; 3/4 LRs (none at 0.03)'
  assert rows[(jft, 'cifar100', '0.003')] == ('85.00', tie)
  assert rows[(jft, 'cifar100', '0.01')] == ('85.00', tie)
  assert rows[(jft, 'oxford_iiit_pet', '0.001')] == (
      '—', 'no dev accuracy; 0/4 LRs (none at 0.001, 0.003, 0.01, 0.03)')
  assert rows[(jft, 'oxford_iiit_pet', '0.003')] == ('—', '')
  label = f' [1000 steps; overridden: {why}]'
  assert rows[(jft + label, 'oxford_flowers102', '0.01')][1].startswith(
      'best; 1/4 LRs')
  assert rows[('ViT-B/16 (i21k, 90 ep)' + label, 'oxford_flowers102',
               '0.003')][1].startswith('best; 1/4 LRs')


def test_real_cell_of_a_run_on_imagenet2012_real_is_its_real_accuracy(
    tmp_path):
  # Such a run's eval_accuracy is top-1 on the original labels.
  _write(tmp_path, 'real', {**_run('ViT-B/32', paper.REAL, 0.80),
                            'real_accuracy': 0.88})
  match = tables.Matcher(tables.load_runs([str(tmp_path)]))
  value, pick = match.accuracy(tables._setting('ViT-B/32', 'jft', 7.0),
                               paper.REAL)
  assert pick.run is not None and value == pytest.approx(88.0)


def test_an_mpp_run_of_a_pretrain_config_is_not_its_supervised_cell():
  """`configs/pretrain.py:... --config.objective=mpp` keeps the pre-training
  report; summary.json's task names the objective, so the tables do not
  show it as the supervised run's compute."""
  import ml_collections
  from vit_jax.train import loop
  cell = dict(model='ViT-L/16', pretrain='i21k', pretrain_epochs=90,
              task='pretrain')
  config = ml_collections.ConfigDict(dict(
      objective='mpp', mpp=dict(target='colour'), report=cell))
  assert loop._report(config)['task'] == 'mpp_colour'
  config.objective = 'supervised'
  assert loop._report(config) == cell
  config.objective, config.report.task = 'mpp', 'mpp_colour'  # configs/mpp.py
  assert loop._report(config)['task'] == 'mpp_colour'
  config.mpp.target = 'pixels'  # --config.mpp.target=pixels: what it trained.
  assert loop._report(config)['task'] == 'mpp_pixels'


def test_a_run_whose_model_was_overridden_fills_no_cell():
  """`pretrain.py:model=ViT-B/16,...` with `--config.model.name=ViT-test`:
  the report the config args made is marked, and no table cell takes it."""
  import ml_collections
  from vit_jax.train import loop
  cell = dict(model='ViT-B/16', pretrain='jft', pretrain_epochs=7,
              task='pretrain')
  config = ml_collections.ConfigDict(dict(
      model=dict(name='ViT-test'), report=cell))
  report = loop._report(config)
  assert report['overridden'] == 'model.name=ViT-test'
  run = tables.Run('w/summary.json', {'report': report})
  assert run.setting is None
  assert tables.Run('w/summary.json', {'report': cell}).setting is not None
  # The run length the config args set, overridden.
  config = ml_collections.ConfigDict(dict(
      model=dict(name='ViT-B/16'), report=cell, total_epochs=7.0,
      total_steps=ml_collections.FieldReference(None, field_type=int)))
  assert 'overridden' not in loop._report(config)
  config.total_epochs = 14.0
  assert loop._report(config)['overridden'].startswith('total_epochs=14.0')
  config.total_epochs, config.total_steps = 7.0, 4
  assert loop._report(config)['overridden'].endswith('total_steps=4')


def test_an_augreg_pre_training_and_its_fine_tunes_fill_no_paper_cell():
  """AugReg's ViT-L/16 i21k 90-epoch run has the Table 3 run's model, data
  and epochs but another recipe: neither it nor a fine-tune from it (which
  takes the init's pre-training fields) is a paper cell."""
  from vit_jax.configs import augreg, finetune
  from vit_jax.train import loop
  pre = augreg.get_config('variant=L/16,data=i21k,epochs=90')
  pre_report = loop._report(pre)
  assert pre_report['recipe'].startswith('augreg:')
  assert tables.Run('a/summary.json', {'report': pre_report}).setting is None
  ft = finetune.get_config('model=ViT-L/16,data=cifar10,pretrain=i21k,'
                           'init=/x')
  report = loop._report(ft, 'supervised', init_report=pre_report,
                        ran=(10_000, (384, 384, 3)))
  assert report['recipe'] == pre_report['recipe']
  assert tables.Run('f/summary.json', {'report': report}).setting is None
  plain = loop._report(ft, 'supervised', init_report={
      k: v for k, v in pre_report.items() if k != 'recipe'},
                       ran=(10_000, (384, 384, 3)))
  assert tables.Run('p/summary.json', {'report': plain}).setting is not None
  md = tables.render([tables.Run('/r/a/summary.json', {
      'report': report, 'eval_accuracy': 0.99})], tables='2,other',
                     flops='analytic')
  assert _col(md, 'Other runs', 'why here', '/r/a') == (
      f"recipe {pre_report['recipe']}, not the paper's")


def test_smoke_runs_never_average_with_real_ones():
  cell = dict(model='ViT-L/16', pretrain='i21k', pretrain_epochs=90,
              task='vtab/dtd')
  real = tables.Run('real/summary.json', {'report': cell,
                                          'eval_accuracy': 0.9})
  smoke = tables.Run('smoke/summary.json', {
      'report': {**cell, 'smoke': True}, 'eval_accuracy': 0.39})
  match = tables.Matcher([real, smoke])
  pick = match.pick(real.setting, 'vtab/dtd')
  assert pick.runs == (real,) and 'smoke' not in pick.note()
  alone = tables.Matcher([smoke]).pick(real.setting, 'vtab/dtd')
  assert alone.runs == (smoke,) and 'smoke' in alone.note()
  assert tables._vtab_smoke(tables.Matcher([smoke]), real.setting)
  assert not tables._vtab_smoke(match, real.setting)


def test_a_transfer_run_without_init_fills_no_cell():
  """finetune.py / vtab.py rows are fine-tuning from `pretrain`: without
  init (and not a smoke run) the run trained from scratch."""
  from vit_jax.configs import finetune
  from vit_jax.train import loop
  config = finetune.get_config('data=cifar10,lr=0.01')
  assert loop._report(config)['overridden'] == 'no init: trained from scratch'
  config.init = '/runs/b16'
  assert 'overridden' not in loop._report(config)
  assert 'overridden' not in loop._report(config, 'supervised')
  # Fine-tuning an MPP run is not fine-tuning the supervised pre-training.
  assert loop._report(config, 'mpp')['overridden'].startswith(
      'init is a mpp run')
  smoke = finetune.get_config('data=cifar10,lr=0.01,smoke=true')
  assert 'overridden' not in loop._report(smoke)


def test_a_transfer_run_takes_its_pretraining_from_the_init_run(tmp_path):
  """finetune.py's args default ViT-L/16 on JFT to 14 epochs; fine-tuning
  a 7-epoch run's workdir is credited to the 7-epoch row, the init run's
  own report; an overridden init run makes the transfer overridden."""
  from vit_jax.configs import finetune
  from vit_jax.train import loop, run_files
  config = finetune.get_config(
      'model=ViT-L/16,data=cifar10,lr=0.01,pretrain=jft')
  assert config.report.pretrain_epochs == 14.0
  workdir = tmp_path / 'l16_7ep'
  init = dict(model='ViT-L/16', pretrain='jft', pretrain_epochs=7.0,
              pretrain_optimizer='adam', task='pretrain')
  run_files.write_summary(str(workdir), {'report': init})
  config.init = str(workdir)
  found = run_files.init_report(str(workdir / 'checkpoints' / '40'))
  assert found == init
  report = loop._report(config, 'supervised', found)
  assert report['pretrain_epochs'] == 7.0 and 'overridden' not in report
  assert loop._report(config, 'supervised', None)['pretrain_epochs'] == 14.0
  assert run_files.init_report('/runs/ViT-L_16.npz') is None
  bad = {**init, 'overridden': 'model.name=ViT-test'}
  assert loop._report(config, 'supervised', bad)['overridden'] == (
      'init run: model.name=ViT-test')


def test_a_vtab_cell_of_several_runs_says_so_and_names_their_lrs(tmp_path):
  """Two runs of one task at different learning rates are averaged into
  its cell (the matcher keys by setting and task): the cell names the
  count, the spread and the learning rates instead of a silent mean."""
  for name, acc, lr in (('a', 0.40, 0.01), ('b', 0.36, 0.03)):
    _write(tmp_path, f'{name}/dtd', _run('ViT-L/16', 'vtab/dtd', acc,
                                         pretrain='i21k', epochs=90, lr=lr))
  md = tables.render(tables.load_runs([str(tmp_path)]), flops='analytic')
  cell = _col(md, 'VTAB-1k', 'ViT-L/16 (i21k, 90 ep)', 'dtd')
  assert cell.startswith('38.00 (mean of 2 ± 2.83') and 'lr 0.01, 0.03' in cell


def test_vtab_means_of_tasks_trained_at_different_lrs_say_so(tmp_path):
  """The protocol trains every task at one learning rate: group and overall
  means over tasks fine-tuned at different rates (each task's cell a single
  run, so with no note of its own) name the rates instead of passing for
  the protocol's number."""
  for i, task in enumerate(VTAB):
    _write(tmp_path, task, _run('ViT-L/16', f'vtab/{task}', 0.7,
                                pretrain='i21k', epochs=90,
                                lr=0.01 if i % 2 else 0.03))
  md = tables.render(tables.load_runs([str(tmp_path)]), flops='analytic')
  col = 'ViT-L/16 (i21k, 90 ep)'
  assert _col(md, 'VTAB-1k', col, 'dtd') == '70.00'
  for row in ('**Natural mean**', '**Structured mean**',
              '**VTAB mean (19)**'):
    assert _col(md, 'VTAB-1k', col, row).endswith('lr 0.01, 0.03)'), row
  (table2,) = [line for line in md.splitlines()
               if line.startswith('| VTAB (19 tasks)')]
  assert '70.00 (' in table2 and 'lr 0.01, 0.03)' in table2


def test_vtab_sweep_picks_one_learning_rate_on_the_val200_mean(tmp_path):
  """The protocol's choice: the rate with the best mean val200 accuracy
  over all 19 tasks; a rate swept on some tasks only is listed, not
  picked, however good its mean."""
  for lr, base in ((0.003, 0.50), (0.01, 0.55), (0.03, 0.90)):
    for i, task in enumerate(VTAB if lr != 0.03 else VTAB[:3]):
      summary = _run('ViT-B/16', f'vtab/{task}', base + 0.01 * (i % 3),
                     pretrain='i21k', epochs=90.0, lr=lr, sweep=True)
      _write(tmp_path, f'sweep_{lr}/{task}', summary)
  text = tables.render(tables.load_runs([str(tmp_path)]), ['sweep'])
  vtab = text.split('### VTAB: one learning rate')[1]
  rows = {line.split('|')[2].strip(): line for line in vtab.splitlines()
          if line.startswith('| ViT-B/16')}
  assert sorted(rows) == ['0.003', '0.01', '0.03']
  assert '19/19' in rows['0.01'] and rows['0.01'].rstrip('| ').endswith(
      'best')
  assert '3/19' in rows['0.03'] and 'best' not in rows['0.03']
  assert 'best' not in rows['0.003']
  mean = 100 * sum(0.55 + 0.01 * (i % 3) for i in range(19)) / 19
  assert f'{mean:.2f}' in rows['0.01']


def test_table2_imagenet_cells_take_only_table2_runs(tmp_path):
  """Table 2's ImageNet fine-tuning of ViT-L/16 and ViT-H/14 (512/518 px,
  Polyak averaging: `report.table2`) and Table 6's 384 px runs of the same
  setting and task are different cells, never averaged together; runs
  without the key (older ones) are not table2 runs."""
  def imagenet(model, acc, real, table2, **kw):
    summary = {**_run(model, paper.IMAGENET, acc, **kw),
               'real_accuracy': real}
    if table2:
      summary['report']['table2'] = True
    return summary
  _write(tmp_path, 'h14/i1k_384', imagenet('ViT-H/14', 0.8808, 0.9036, False,
                                           epochs=14))
  _write(tmp_path, 'h14/i1k_518', imagenet('ViT-H/14', 0.8855, 0.9072, True,
                                           epochs=14))
  _write(tmp_path, 'h14/c10', _run('ViT-H/14', 'cifar10', 0.9950, epochs=14))
  # Only a 384 px run of ViT-L/16 (JFT): Table 6's, not Table 2's.
  _write(tmp_path, 'l16/i1k_384', imagenet('ViT-L/16', 0.8712, 0.8999, False,
                                           epochs=14))
  runs = tables.load_runs([str(tmp_path)])
  md = tables.render(runs, tables='2,6,other', flops='analytic')
  t2, t6 = 'Table 2', 'Table 6'
  assert _col(md, t2, 'ViT-H/14 (JFT)', 'ImageNet') == '88.55 / 88.55 (+0.00)'
  assert _col(md, t2, 'ViT-H/14 (JFT)', 'ImageNet ReaL') == (
      '90.72 / 90.72 (+0.00)')
  assert _col(md, t2, 'ViT-H/14 (JFT)', 'CIFAR-10') == '99.50 / 99.50 (+0.00)'
  assert _col(md, t2, 'ViT-L/16 (JFT)', 'ImageNet') == '87.76 / —'
  assert _col(md, t2, 'ViT-L/16 (JFT)', 'ImageNet ReaL') == '90.54 / —'
  assert _col(md, t6, 'ImageNet', 'ViT-H/14', '14') == '88.08 / 88.08 (+0.00)'
  assert _col(md, t6, 'ReaL', 'ViT-H/14', '14') == '90.36 / 90.36 (+0.00)'
  assert _col(md, t6, 'ImageNet', 'ViT-L/16', '14') == '87.12 / 87.12 (+0.00)'
  assert 'Other runs' not in md  # Every run has its cell.
  # Without Table 2, the table2 run is listed under `other`, saying why.
  md = tables.render(runs, tables='6,other', flops='analytic')
  other = '\n'.join(_section(md, 'Other runs'))
  assert 'i1k_518' in other and (
      'cell in Table 2 (not rendered: --tables=2)') in other
  assert 'i1k_384' not in other and 'c10' not in other
  # The matcher's rule: Table 2's ImageNet / ReaL cells of those models.
  h14 = tables._setting('ViT-H/14', 'jft', 14)
  assert tables.Matcher.variant(h14, paper.REAL, table2=True) == 'table2'
  assert tables.Matcher.variant(h14, 'cifar10', table2=True) == ''
  assert tables.Matcher.variant(h14, paper.IMAGENET) == ''
  b16 = tables._setting('ViT-B/16', 'i21k', 90)
  assert tables.Matcher.variant(b16, paper.IMAGENET, table2=True) == ''


def test_pretrain_cost_is_the_mean_cost_with_its_own_spread(tmp_path):
  """Two pre-training runs of one setting: the cost cells are their mean
  cost with the cost's spread (not the first run's cost with the
  accuracy's spread in %)."""
  for name, ef, days, acc in (('a', 50.0, 20.0, 0.40),
                              ('b', 70.0, 40.0, 0.50)):
    _write(tmp_path, name, {**_run('ViT-B/32', 'pretrain', acc),
                            'exaflops': ef, 'core_days': days,
                            'hardware': 'tpu_v3'})
  def costs():  # (exaFLOPs, core-days) cells of the row.
    md = tables.render(tables.load_runs([str(tmp_path)]), tables='6',
                       flops='analytic')
    return tuple(_col(md, 'Table 6', key, 'ViT-B/32', '7')
                 for key in ('exaFLOPs', 'core-days'))
  assert costs() == ('55 / 60 (+5.0; mean of 2 ± 14)', '30 (mean of 2 ± 14)')
  # Hardware other than TPU v3 among them is named; a run without the
  # cost is counted out.
  _write(tmp_path, 'c', {**_run('ViT-B/32', 'pretrain', 0.45),
                         'core_days': 3.0, 'hardware': 'h100'})
  assert costs() == ('55 / 60 (+5.0; mean of 2 of 3 runs ± 14)',
                     '21 (on h100, tpu_v3; mean of 3 ± 19)')


def test_table2_core_days_of_other_hardware_have_no_difference(tmp_path):
  """Table 2's TPUv3-core-days beside an H100 run's device-days: shown,
  named, without a difference ("-80") that reads as a saving; a TPU v3
  run's keeps its difference."""
  def row(hardware):
    _write(tmp_path, hardware, {
        **_run('ViT-L/16', 'pretrain', pretrain='i21k', epochs=90),
        'core_days': 150.0, 'exaflops': 470.0, 'hardware': hardware})
    md = tables.render(tables.load_runs([str(tmp_path / hardware)]),
                       tables='2', flops='analytic')
    (line,) = [l for l in md.splitlines() if l.startswith('| TPUv3-core')]
    return line
  assert '| 230 / 150 (on h100) |' in row('h100')
  assert '| 230 / 150 (-80) |' in row('tpu_v3')


def test_load_runs_reads_a_file_once_and_expands_home(tmp_path, monkeypatch):
  """`--workdirs=runs,./runs/c10` (or a symlink) names one run once;
  `~` is expanded (the shell leaves `--workdirs=~/runs` alone)."""
  _write(tmp_path, 'runs/c10', _run('ViT-B/32', 'cifar10', 0.985))
  (tmp_path / 'alias').symlink_to(tmp_path / 'runs')
  monkeypatch.chdir(tmp_path)
  assert len(tables.load_runs('runs,./runs/c10')) == 1
  assert len(tables.load_runs(['runs', 'alias/c10/summary.json'])) == 1
  monkeypatch.setenv('HOME', str(tmp_path))
  runs = tables.load_runs('~/runs')
  assert [r.path for r in runs] == [str(tmp_path / 'runs/c10/summary.json')]
  md = tables.render(tables.load_runs('~/runs,runs/c10'), tables='6',
                     flops='analytic')
  assert _col(md, 'Table 6', 'C10', 'ViT-B/32', '7') == '98.61 / 98.50 (-0.11)'


def _doc(name):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, 'docs', name)) as f:
    return f.read()


def test_a_malformed_summary_is_skipped_with_a_warning_as_documented(
    tmp_path, capsys):
  _write(tmp_path, 'good', _run('ViT-B/32', 'cifar10', 0.98))
  bad = _write(tmp_path, 'bad', {})
  (bad / 'summary.json').write_text('{"eval_accuracy": 0.5,')
  assert tables.main([f'--workdirs={tmp_path}', '--tables=6',
                      '--flops=analytic']) == 0
  out, err = capsys.readouterr()
  assert f'warning: skipped malformed {bad}/summary.json' in err
  assert '98.61 / 98.00 (-0.61)' in out
  doc = ' '.join(_doc('tables.md').split())
  assert 'or a malformed one, is an error' not in doc
  assert ('A malformed `summary.json` is skipped with a warning on stderr '
          'naming its path') in doc
  assert 'the command exits 0' in doc


def test_docs_excerpt_is_the_paper_only_output(monkeypatch):
  """docs/tables.md's excerpt is what `--paper-only` prints (XLA counts,
  the default), down to its `...`."""
  doc = _doc('tables.md')
  excerpt = doc.split('## Excerpt of `--paper-only`')[1].split(
      '```markdown\n')[1].split('\n...\n```')[0].splitlines()
  rows = [l for l in excerpt[excerpt.index(next(
      l for l in excerpt if l.startswith('## Table 6'))):]
          if l.startswith('| ') and _cells(l)[1].isdigit()]
  # Only the excerpt's Table 6 rows: lowering all 18 models takes a minute.
  monkeypatch.setattr(paper, 'TABLE6', paper.TABLE6[:len(rows)])
  md = tables.paper_only(tables='2,6').splitlines()[:len(excerpt)]
  # Estimates come from XLA's count of each lowered model, which may move
  # by a fraction of a percent with the XLA:CPU build or machine: their
  # numbers agree within 1%, everything else exactly.
  assert len(md) == len(excerpt)
  number = re.compile(r'-?\d[\d,]*\.?\d*')
  for got, want in zip(md, excerpt):
    if 'est.' not in want:
      assert got == want
      continue
    assert number.sub('#', got) == number.sub('#', want), (got, want)
    for g, w in zip(number.findall(got), number.findall(want)):
      g, w = float(g.replace(',', '')), float(w.replace(',', ''))
      assert g == pytest.approx(w, rel=0.01, abs=0.05), (got, want)


def test_a_smoke_stand_in_counts_as_missing_in_group_means(tmp_path):
  """18 real tasks and a smoke stand-in are no complete Structured or VTAB
  mean (Table 2 would compare it with the paper); the stand-in's cell
  says smoke; a column of stand-ins only has means marked smoke. The
  optimizer study's average likewise."""
  l16 = dict(pretrain='i21k', epochs=90)
  for i, task in enumerate(VTAB[:-1]):
    _write(tmp_path, f'l16/{task}', _run('ViT-L/16', f'vtab/{task}', 0.70,
                                         **l16))
  _write(tmp_path, f'l16/{VTAB[-1]}', _run(
      'ViT-L/16', f'vtab/{VTAB[-1]}', 0.99, smoke=True, **l16))
  for task in VTAB:
    _write(tmp_path, f'b16/{task}', _run('ViT-B/16', f'vtab/{task}', 0.30,
                                         smoke=True, **l16))
  for i, dataset in enumerate(paper.OPTIMIZER_DATASETS):
    _write(tmp_path, f'r50/{dataset}', _run(
        'BiT-R50x1', dataset, 0.9, pretrain_optimizer='sgd', smoke=i == 0))
  md = tables.render(tables.load_runs([str(tmp_path)]),
                     tables='2,optim,vtab', flops='analytic')
  col = 'ViT-L/16 (i21k, 90 ep) (smoke)'
  last = VTAB[-1]
  assert registry.get(f'vtab/{last}').group == 'vtab-structured'
  assert _col(md, 'VTAB-1k', col, last) == '99.00 (smoke)'
  assert _col(md, 'VTAB-1k', col, '**Structured mean**') == (
      '7/8 tasks + 1 smoke')
  assert _col(md, 'VTAB-1k', col, '**Natural mean**') == '70.00'
  assert _col(md, 'VTAB-1k', col, '**VTAB mean (19)**') == (
      '72.72 / 18/19 tasks + 1 smoke')
  assert _col(md, 'Table 2', 'ViT-L/16 (I21k)', 'VTAB (19 tasks)') == (
      '72.72 / 18/19 tasks + 1 smoke')
  smoke = 'ViT-B/16 (i21k, 90 ep) (smoke)'
  assert _col(md, 'VTAB-1k', smoke, '**Natural mean**') == '30.00 (smoke)'
  assert _col(md, 'VTAB-1k', smoke, '**VTAB mean (19)**') == '30.00 (smoke)'
  assert _col(md, 'ResNet optimizer study', 'BiT-R50x1 SGD', 'average') == (
      '88.79 / 4/5 datasets + 1 smoke')


def test_a_cell_averaging_runs_of_different_lrs_names_them(tmp_path):
  """Table 2 / 6 / optimizer cells, like VTAB's, say when the runs they
  average were trained at different learning rates."""
  _write(tmp_path, 'a', _run('ViT-B/32', 'cifar10', 0.98, lr=0.01))
  _write(tmp_path, 'b', _run('ViT-B/32', 'cifar10', 0.99, lr=0.003))
  md = tables.render(tables.load_runs([str(tmp_path)]), tables='6',
                     flops='analytic')
  assert _col(md, 'Table 6', 'C10', 'ViT-B/32', '7') == (
      '98.61 / 98.50 (-0.11; mean of 2 ± 0.71; lr 0.003, 0.01)')


def test_a_copied_workdir_counts_once_with_a_warning(tmp_path, capsys):
  """`cp -r runs backup`: the same run's identical summary (the trainer's
  wall-clock seconds too) is read once, naming both paths."""
  summary = {**_run('ViT-B/32', 'cifar10', 0.98), 'wall_s': 1234.5}
  _write(tmp_path, 'runs/c10', summary)
  _write(tmp_path, 'backup/c10', summary)
  _write(tmp_path, 'runs/c10_again', {**summary, 'wall_s': 1200.0})
  skipped = []
  runs = tables.load_runs([str(tmp_path)], skipped=skipped)
  assert sorted(r.workdir for r in runs) == [
      str(tmp_path / 'backup/c10'), str(tmp_path / 'runs/c10_again')]
  assert skipped == [f'{tmp_path}/runs/c10/summary.json: a copy of '
                     f'{tmp_path}/backup/c10/summary.json (an identical '
                     'summary.json); counted once']
  assert tables.main([f'--workdirs={tmp_path}', '--tables=6',
                      '--flops=analytic']) == 0
  out, err = capsys.readouterr()
  assert 'mean of 2 ±' in out and 'mean of 3' not in out
  assert 'a copy of' in err
  with pytest.warns(UserWarning, match='a copy of'):
    assert len(tables.load_runs([str(tmp_path)])) == 2
  # gs:// paths are told apart by their text: `dir/` and `dir` list one file.
  assert tables._file_key('gs://b/runs//c10/summary.json') == (
      tables._file_key('gs://b/runs/c10/summary.json'))


def test_other_names_the_table_not_rendered_that_has_the_runs_cell(tmp_path):
  _write(tmp_path, 'c10', _run('ViT-B/32', 'cifar10', 0.98))
  _write(tmp_path, 'i1k', _run('ViT-B/16', 'cifar10', 0.97, pretrain='i1k',
                               epochs=300))
  md = tables.render(tables.load_runs([str(tmp_path)]), tables='2,other',
                     flops='analytic')
  assert _col(md, 'Other runs', 'why here', str(tmp_path / 'c10')) == (
      'cell in Table 6 (not rendered: --tables=6)')
  assert _col(md, 'Other runs', 'why here', str(tmp_path / 'i1k')) == (
      'no paper cell')


def test_unreadable_and_out_of_range_summaries_are_skipped(tmp_path, capsys):
  """A dangling summary.json symlink, an accuracy in percent or above 1:
  skipped with a warning naming the path, as docs/tables.md promises."""
  _write(tmp_path, 'good', _run('ViT-B/32', 'cifar10', 0.98))
  (tmp_path / 'gone').mkdir()
  (tmp_path / 'gone' / 'summary.json').symlink_to(tmp_path / 'nowhere.json')
  _write(tmp_path, 'percent', _run('ViT-B/32', 'cifar10', 98.6))
  _write(tmp_path, 'fewshot', {**_run('ViT-B/32', 'cifar100', 0.9),
                               'fewshot/cifar10/5shot': 75.0})
  assert tables.main([f'--workdirs={tmp_path}', '--tables=6',
                      '--flops=analytic']) == 0
  out, err = capsys.readouterr()
  assert f'warning: skipped malformed {tmp_path}/gone/summary.json' in err
  assert (f'warning: skipped malformed {tmp_path}/percent/summary.json: '
          'eval_accuracy=98.6 is not a fraction in [0, 1]') in err
  assert 'fewshot/cifar10/5shot=75.0 is not a fraction' in err
  assert '98.61 / 98.00 (-0.61)' in out and '9,860' not in out
  assert '90.49 / —' in out


def test_a_polyak_table2_run_evaluated_raw_fills_no_cell():
  """Table 2's ImageNet fine-tuning reports the Polyak averages: a run
  that evaluated the raw parameters (`eval_ema=raw`) is marked
  overridden, and its report says which parameters it evaluated."""
  from vit_jax.configs import finetune
  from vit_jax.train import loop
  config = finetune.get_config('model=ViT-L/16,data=imagenet2012,lr=0.01,'
                               'table2=true,pretrain=jft')
  config.init = '/runs/l16'
  ran = (config.total_steps, (config.input.image_size,) * 2 + (3,))
  report = loop._report(config, 'supervised', None, ran=ran)
  assert report['eval_ema'] == 'ema' and 'overridden' not in report
  config.eval_ema = 'raw'
  report = loop._report(config, 'supervised', None, ran=ran)
  assert report['eval_ema'] == 'raw'
  assert 'eval_ema=raw' in report['overridden']
  assert tables.Run('w/summary.json', {'report': report}).setting is None


def test_the_vtab_driver_lists_runs_no_cell_takes(tmp_path):
  """`python -m vit_jax.vtab` with its own `steps=` (or a --set off the
  paper's protocol) trains overridden runs: its output lists them with
  their accuracy and the reason instead of an empty table."""
  from vit_jax import vtab as driver  # Defines its flags: only here.
  why = "300 steps, the paper's 2500"
  for task in VTAB[:2]:
    _write(tmp_path, task, _run('ViT-B/16', f'vtab/{task}', 0.6,
                                pretrain='i21k', epochs=90, overridden=why))
  md = driver.report(str(tmp_path))
  assert _col(md, 'Other runs', 'why here', str(tmp_path / VTAB[0])) == (
      f'overridden: {why}')
  assert _col(md, 'Other runs', 'eval_accuracy (%)',
              str(tmp_path / VTAB[1])) == '60.00'


def test_fewshot_of_a_dataset_whose_name_holds_a_slash(tmp_path):
  """Few-shot on `vtab/caltech101` writes `fewshot/vtab/caltech101/5shot`
  (4 parts): only 3-part keys were read, and the result never reached the
  few-shot table. The dataset is what lies between `fewshot/` and
  `/<k>shot`; a section not named fewshot shows as `<name>/<dataset>`."""
  _write(tmp_path, 'run', {**_run('ViT-B/32', 'pretrain', 0.5),
                           'fewshot/digits/1shot': 0.25,
                           'fewshot/vtab/caltech101/5shot': 0.5,
                           'fewshot/vtab/caltech101/5shot_std': 0.01,
                           'fewshot/mine/digits/5shot': 0.75})
  run, = tables.load_runs([str(tmp_path)])
  assert run.fewshot() == {('digits', 1): 0.25, ('vtab/caltech101', 5): 0.5,
                           ('mine/digits', 5): 0.75}
  md = tables.render([run], tables='fewshot')
  first = _workdir(md, 'run')
  assert _col(md, 'Few-shot', 'vtab/caltech101 5-shot', *first) == '50.00'
  assert _col(md, 'Few-shot', 'mine/digits 5-shot', *first) == '75.00'
  assert _col(md, 'Few-shot', 'digits 1-shot', *first) == '25.00'


def test_a_nan_fewshot_accuracy_is_a_missing_cell_not_a_malformed_run(
    tmp_path):
  """The few-shot evaluator writes NaN for a diverged model's features
  (not a chance-level number): the whole summary was skipped as
  malformed. Shown as '—', as a missing cell is; a NaN top-1 is still
  malformed."""
  _write(tmp_path, 'run', {**_run('ViT-B/32', 'pretrain', 0.5),
                           'fewshot/digits/1shot': 0.25,
                           'fewshot/digits/5shot': float('nan'),
                           'fewshot/digits/5shot_std': float('nan')})
  run, = tables.load_runs([str(tmp_path)])
  assert run.fewshot() == {('digits', 1): 0.25, ('digits', 5): None}
  md = tables.render([run], tables='fewshot')
  first = _workdir(md, 'run')
  assert _col(md, 'Few-shot', 'digits 5-shot', *first) == '—'
  assert _col(md, 'Few-shot', 'digits 1-shot', *first) == '25.00'
  bad = _write(tmp_path, 'bad', {**_run('ViT-B/32', 'pretrain', 0.5),
                                 'eval_accuracy': float('nan')})
  with pytest.raises(tables.TablesError, match='eval_accuracy=nan is not a '
                     r'fraction in \[0, 1\]'):
    tables.load_runs([str(bad)])
