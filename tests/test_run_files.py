"""A workdir's JSON files (`vit_jax/train/run_files.py`): atomic writes,
merged summaries, and an unreadable summary kept aside, never lost."""

import json
import os
import re
import subprocess
import sys

import ml_collections
import pytest

from vit_jax.train import run_files


def test_summaries_merge_and_writes_leave_no_temporary_file(tmp_path):
  """Metrics of one step merge (what `mode=eval` adds to the run's
  summary, a run resumed at its last step); a summary of another step, or
  of a run that trained since (`fresh`), replaces the earlier one whole:
  a run extended without its few-shot or ReaL evaluator shows none of the
  old step's numbers as the new step's."""
  workdir = str(tmp_path / 'run')  # Created on the first write.
  run_files.write_summary(workdir, {'train_loss': 1.5, 'steps': 10,
                                    'eval_accuracy': 0.4})
  run_files.write_summary(workdir, {'fewshot/cifar10/5shot': 0.7,
                                    'real_accuracy': 0.45})  # mode=eval
  run_files.write_summary(workdir, {'eval_accuracy': 0.5, 'steps': 10})
  assert run_files.read_summary(workdir) == {
      'train_loss': 1.5, 'eval_accuracy': 0.5, 'steps': 10,
      'fewshot/cifar10/5shot': 0.7, 'real_accuracy': 0.45}
  assert sorted(os.listdir(workdir)) == ['summary.json']
  run_files.write_summary(workdir, {'eval_accuracy': 0.6, 'steps': 20,
                                    'train_loss': 1.2})
  assert run_files.read_summary(workdir) == {
      'train_loss': 1.2, 'eval_accuracy': 0.6, 'steps': 20}
  run_files.write_summary(workdir, {'fewshot/cifar10/5shot': 0.8})
  run_files.write_summary(workdir, {'eval_accuracy': 0.3, 'steps': 20},
                          fresh=True)  # Trained again, from scratch.
  assert run_files.read_summary(workdir) == {'eval_accuracy': 0.3,
                                             'steps': 20}


@pytest.mark.parametrize('text', ['{"steps": 1', '[1, 2]', '\xff'])
def test_an_unreadable_summary_is_set_aside_not_lost(tmp_path, text):
  path = tmp_path / 'summary.json'
  path.write_text(text, encoding='latin-1')
  assert run_files.read_summary(str(tmp_path)) == {}
  aside = [p for p in os.listdir(tmp_path) if p.startswith(
      'summary.json.unreadable-')]
  assert len(aside) == 1 and not path.exists()
  assert (tmp_path / aside[0]).read_bytes() == text.encode('latin-1')
  run_files.write_summary(str(tmp_path), {'steps': 2})  # Written anew.
  assert json.loads(path.read_text()) == {'steps': 2}


def test_another_runs_unreadable_summary_is_left_alone(tmp_path):
  """Reading another run's workdir (an init, a model exported or
  predicted with) never renames its files: it may be on read-only storage,
  and it is not ours to rewrite."""
  from vit_jax.train import loop
  (tmp_path / 'checkpoints' / '5').mkdir(parents=True)
  (tmp_path / 'summary.json').write_text('{"steps": ')
  assert run_files.read_summary(str(tmp_path), own=False) == {}
  assert run_files.init_report(str(tmp_path / 'checkpoints' / '5')) is None  # pylint: disable=protected-access
  assert sorted(os.listdir(tmp_path)) == ['checkpoints', 'summary.json']
  # A step directory copied out of its workdir: the folder above is no
  # run's, its summary.json not the init's report.
  (tmp_path / 'summary.json').write_text(json.dumps(
      {'report': {'task': 'pretrain'}}))
  assert run_files.init_report(str(tmp_path / 'checkpoints' / '5')) == {  # pylint: disable=protected-access
      'task': 'pretrain'}
  (tmp_path / 'copy' / '5').mkdir(parents=True)
  (tmp_path / 'copy' / 'summary.json').write_text(json.dumps(
      {'report': {'task': 'pretrain'}}))
  assert run_files.init_report(str(tmp_path / 'copy' / '5')) is None  # pylint: disable=protected-access


def test_config_json_is_optional(tmp_path):
  assert run_files.read_config(str(tmp_path)) == {}
  (tmp_path / 'config.json').write_text('not json')
  assert run_files.read_config(str(tmp_path)) == {}
  config = ml_collections.ConfigDict(dict(model=dict(name='ViT-B/16')))
  run_files.write_config(str(tmp_path), config, command='python -m x')
  assert run_files.read_config(str(tmp_path)) == {
      'command': 'python -m x', 'config': {'model': {'name': 'ViT-B/16'}}}


def test_vtab_treats_an_unreadable_summary_as_unfinished(tmp_path):
  """`python -m vit_jax.vtab` re-trains that task (a traceback before)."""
  from vit_jax import vtab  # Defines the driver's flags: only here.
  (tmp_path / 'summary.json').write_text('{"steps": ')
  config = ml_collections.ConfigDict(dict(
      report=dict(task='dtd'), init='/w', total_steps=10,
      input=dict(image_size=32)))
  assert vtab._finished(str(tmp_path), config) is False  # pylint: disable=protected-access


def _vtab_task(tmp_path, init, **report):
  """A finished VTAB task's workdir (summary.json) and its config."""
  from vit_jax.configs import vtab as vtab_config
  config = vtab_config.get_config('task=dtd,smoke=true')
  config.init = init
  recorded = {**config.report.to_dict(), 'lr': float(config.optim.lr),
              **report}
  workdir = str(tmp_path / 'dtd')
  run_files.write_config(workdir, config, command='test')
  run_files.write_summary(workdir, {
      'steps': config.total_steps, 'eval_accuracy': 0.5, 'init': init,
      'image_size': config.input.image_size, 'report': recorded})
  return workdir, config


def _other(config, **report):
  other = config.copy_and_resolve_references()
  for key, value in report.items():
    other.report[key] = value
  return other


def test_vtab_skips_its_finished_task_whose_init_named_its_pretraining(
    tmp_path):
  """The trainer writes the init run's own pre-training fields into the
  report (30 epochs, where the config args said 90): the same command run
  again skips that task instead of calling it other settings; another
  init, or another lr, is still refused."""
  from absl import app
  from vit_jax import vtab
  pre = str(tmp_path / 'pre')
  run_files.write_summary(pre, {'report': dict(
      model='ViT-B/16', pretrain='i21k', pretrain_epochs=30.0,
      pretrain_optimizer='adam', task='pretrain')})
  # A record of before `pretrain_from_init`: the init run's report says.
  workdir, config = _vtab_task(tmp_path, pre, pretrain_epochs=30.0)
  assert vtab._finished(workdir, config) is True  # pylint: disable=protected-access
  for field, value in (('init', '/w/other'), ('optim.lr', 0.03)):
    other = config.copy_and_resolve_references()
    if field == 'init':
      other.init = value
    else:  # The lr trained with (`--set=optim.lr=`), whatever the args said.
      other.optim.lr = value
    with pytest.raises(app.UsageError, match='other settings'):
      vtab._finished(workdir, other)  # pylint: disable=protected-access


def test_vtab_compares_input_cache_only_for_an_interrupted_task(tmp_path):
  """`input.cache` changes the input stream (epochs in one order), not a
  finished result: an interrupted task re-run with it was let through,
  then its resume failed after set-up; now the driver refuses it first."""
  from absl import app
  from vit_jax import vtab
  workdir, config = _vtab_task(tmp_path, None)
  cached = config.copy_and_resolve_references()
  cached.input.cache = True
  moved = config.copy_and_resolve_references()
  moved.input.data_dir = '/elsewhere'
  assert vtab._finished(workdir, cached) is True  # pylint: disable=protected-access
  os.remove(os.path.join(workdir, 'summary.json'))
  os.makedirs(os.path.join(workdir, 'checkpoints', '5'))
  assert vtab._finished(workdir, moved) is False  # pylint: disable=protected-access
  with pytest.raises(app.UsageError, match=r'interrupted VTAB run .*'
                     r'\(input.cache: None there, True now\)'):
    vtab._finished(workdir, cached)  # pylint: disable=protected-access
  # How the model computes may change on resume (the trainer logs it).
  lighter = config.copy_and_resolve_references()
  lighter.model.remat, lighter.model.dtype = True, 'float32'
  assert vtab._finished(workdir, lighter) is False  # pylint: disable=protected-access


def test_vtab_refuses_a_task_of_another_pretraining_from_an_npz(tmp_path):
  """An .npz init has no report of its own: the task's report is its
  config args' pre-training, and a command naming another (jft for a task
  recorded as i21k) is refused, not skipped as finished under the wrong
  label; a recorded `pretrain_from_init` decides where present."""
  from absl import app
  from vit_jax import vtab
  npz = '/ckpt/ViT-B_16.npz'
  workdir, config = _vtab_task(tmp_path, npz)
  assert vtab._finished(workdir, config) is True  # pylint: disable=protected-access
  with pytest.raises(app.UsageError, match=re.escape(
      "other settings (pretrain, pretrain_epochs: ['i21k', 90.0] there, "
      "['jft', 7.0] now)")):
    vtab._finished(workdir, _other(config, pretrain='jft',  # pylint: disable=protected-access
                                   pretrain_epochs=7.0))
  workdir, config = _vtab_task(tmp_path / 'b', '/w/pre',
                               pretrain_from_init=True)
  assert vtab._finished(workdir, _other(config, pretrain='jft')) is True  # pylint: disable=protected-access
  workdir, config = _vtab_task(tmp_path / 'c', '/w/pre',
                               pretrain_from_init=False)
  with pytest.raises(app.UsageError, match='other settings'):
    vtab._finished(workdir, _other(config, pretrain='jft'))  # pylint: disable=protected-access


def test_vtab_reads_a_task_recorded_before_a_report_key_existed(tmp_path):
  """A task finished before `report.transfer` existed is compared over
  the keys its record has, and skipped, not refused."""
  from vit_jax import vtab
  workdir, config = _vtab_task(tmp_path, None)
  summary = run_files.read_summary(workdir)
  del summary['report']['transfer']
  run_files.write_json(workdir, run_files.SUMMARY, summary)
  assert vtab._finished(workdir, config) is True  # pylint: disable=protected-access


def test_vtab_refuses_to_resume_an_interrupted_task_under_other_settings(
    tmp_path):
  """A task interrupted after a checkpoint (config.json, no summary yet)
  would resume half-trained at the old settings: another lr or init is
  refused as for a finished task; the same settings resume; one that
  failed before its first save starts afresh."""
  from absl import app
  from vit_jax import vtab
  workdir, config = _vtab_task(tmp_path, '/w/pre')
  os.remove(os.path.join(workdir, 'summary.json'))
  assert vtab._finished(workdir, config) is False  # pylint: disable=protected-access
  lower = config.copy_and_resolve_references()
  lower.optim.lr = 0.003
  assert vtab._finished(workdir, lower) is False  # No checkpoint: afresh.  # pylint: disable=protected-access
  os.makedirs(os.path.join(workdir, 'checkpoints', '500'))
  assert vtab._finished(workdir, config) is False  # Resumes.  # pylint: disable=protected-access
  with pytest.raises(app.UsageError, match=re.escape(
      'holds an interrupted VTAB run (a checkpoint, no summary.json yet) '
      'with other settings (lr: [0.01] there, [0.003] now)')):
    vtab._finished(workdir, lower)  # pylint: disable=protected-access
  other = config.copy_and_resolve_references()
  other.init = '/w/other'
  with pytest.raises(app.UsageError, match=r'other settings \(init'):
    vtab._finished(workdir, other)  # pylint: disable=protected-access


def test_vtab_refuses_a_task_trained_with_other_set_values(tmp_path):
  """A finished task whose config.json records other settings than this
  command's (`--set=input.batch_size=...`, an optimizer field) is an error
  naming the field, not a silent skip; where the data lives is no
  setting."""
  from absl import app
  from vit_jax import vtab
  from vit_jax.configs import vtab as vtab_config
  workdir = str(tmp_path)
  config = vtab_config.get_config('task=dtd,smoke=true')
  run_files.write_config(workdir, config, command='test')
  run_files.write_summary(workdir, {
      'steps': config.total_steps, 'eval_accuracy': 0.5, 'init': config.init,
      'image_size': config.input.image_size,
      'report': {**config.report.to_dict(), 'lr': float(config.optim.lr)}})
  assert vtab._finished(workdir, config) is True  # pylint: disable=protected-access
  moved = config.copy_and_resolve_references()
  vtab.override(moved, 'input.data_dir=/data/elsewhere')
  assert vtab._finished(workdir, moved) is True  # pylint: disable=protected-access
  for item, field in (('input.batch_size=7', 'input.batch_size: '),
                      ('optim.weight_decay=0.5', 'optim.weight_decay: '),
                      ('seed=3', 'seed: 0 there, 3 now')):
    other = config.copy_and_resolve_references()
    vtab.override(other, item)
    with pytest.raises(app.UsageError, match=re.escape(
        f'other settings ({field}')):
      vtab._finished(workdir, other)  # pylint: disable=protected-access


def test_reading_a_workdir_loads_no_tensorflow(tmp_path):
  run_files.write_summary(str(tmp_path), {'steps': 1})
  code = ('import sys; from vit_jax.train import run_files; '
          f'assert run_files.read_summary({str(tmp_path)!r}) == '
          "{'steps': 1}; print('tensorflow' in sys.modules)")
  out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == 'False'


def test_class_names_are_kept_only_by_a_resumed_run(tmp_path):
  """A resumed run records the names it started with; a fresh start (an
  attempt that saved no checkpoint, a reused workdir) reads the data's."""
  from vit_jax.configs import smoke
  from vit_jax.train import loop
  config = smoke.get_config('data=digits')
  run_files.write_config(str(tmp_path), config, command='test',
                         class_names=['cat', 'dog'])
  assert loop._class_names(config, str(tmp_path), resuming=True) == [
      'cat', 'dog']
  assert loop._class_names(config, str(tmp_path), resuming=False) == [
      str(i) for i in range(10)]
