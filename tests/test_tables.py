"""vit_jax.tables: summaries -> Markdown tables beside the paper's numbers.

Estimates use the analytic FLOP count (no model lowering) except where a
test checks the XLA path on one small model, so the whole file runs in
seconds.
"""

import json
import os
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


def test_sweep_table_marks_the_best_lr(tmp_path):
  for lr, acc in ((0.001, 0.91), (0.003, 0.95), (0.01, 0.93)):
    run = _run('ViT-B/16', 'cifar10', acc, lr=lr)
    run['report']['sweep'] = True
    _write(tmp_path, f'sweep_{lr}', run)
  text = tables.render(tables.load_runs([str(tmp_path)]), tables='sweep')
  rows = [l for l in text.splitlines() if l.startswith('| ViT-B/16')]
  assert len(rows) == 3
  best = [l for l in rows if '| best |' in l]
  assert len(best) == 1 and '| 0.003 |' in best[0] and '95.00' in best[0]


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
  found = loop._init_report(str(workdir / 'checkpoints' / '40'))
  assert found == init
  report = loop._report(config, 'supervised', found)
  assert report['pretrain_epochs'] == 7.0 and 'overridden' not in report
  assert loop._report(config, 'supervised', None)['pretrain_epochs'] == 14.0
  assert loop._init_report('/runs/ViT-L_16.npz') is None
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
