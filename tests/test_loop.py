"""The training loop end to end: summary, metrics, resume after SIGKILL, NaN.

Runs `python -m vit_jax.main` on scikit-learn's real `digits` in subprocesses
(the way users run it).
"""

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import xla_flags
import trained_workdir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = trained_workdir.CLI_BASE


def _main(workdir, *flags, env=None, **kw):
  cmd = [sys.executable, '-m', 'vit_jax.main', f'--workdir={workdir}',
         *BASE, *flags]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ, JAX_PLATFORMS='cpu', **(env or {})),
                        **kw)


def _final_params(workdir):
  ckpt_dir = os.path.join(workdir, 'checkpoints')
  step = max(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
  state = ocp.StandardCheckpointer().restore(
      os.path.join(ckpt_dir, str(step), 'state'))
  return step, state['params']


def _leaves(tree, prefix=''):
  if isinstance(tree, dict):
    for k in sorted(tree):
      yield from _leaves(tree[k], f'{prefix}/{k}')
  else:
    yield prefix, np.asarray(tree)


@pytest.fixture(scope='module')
def reference_run(tmp_path_factory):
  """A 40-step run with BASE, tracing steps 13 to 15, made once per session
  (`trained_workdir.cli_reference_run`, test_robustness's too): tests that
  write to a workdir copy it first (`trained_workdir.copy`)."""
  workdir = trained_workdir.cli_reference_run(tmp_path_factory)
  out = subprocess.CompletedProcess(
      [], 0, open(f'{workdir}.stdout').read(), open(f'{workdir}.stderr').read())
  return workdir, out


def test_run_writes_summary_metrics_and_checkpoints(reference_run):
  workdir, out = reference_run
  summary = json.load(open(os.path.join(workdir, 'summary.json')))
  assert summary['steps'] == 40 and summary['dataset'] == 'digits'
  assert summary['eval_examples'] == 360  # Every test image, once.
  assert 0.0 <= summary['eval_accuracy'] <= 1.0
  for key in ('train_loss', 'eval_loss', 'eval_accuracy', 'exaflops',
              'core_days', 'wall_s'):
    assert isinstance(summary[key], float), key
  rows = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  train = [r for r in rows if 'loss' in r]
  assert [r['step'] for r in train] == [10, 20, 30, 40]
  for key in ('img_per_s', 'img_per_s_per_device', 'eta_hours', 'lr',
              'grad_norm', 'core_days', 'exaflops', 'steps_per_s'):
    assert key in train[-1], key
  assert train[-1]['loss'] < train[0]['loss']
  assert any(f.startswith('events.out.tfevents') for f in os.listdir(workdir))
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == [
      '20', '30', '40']  # keep_checkpoints=3.
  assert 'eval_accuracy' in out.stdout


def test_profile_trace_and_step_time_split(reference_run):
  workdir, out = reference_run
  runs = os.path.join(workdir, 'profile', 'process_0', 'plugins', 'profile')
  [run] = os.listdir(runs)
  files = os.listdir(os.path.join(runs, run))
  assert any(f.endswith('.xplane.pb') for f in files), files  # TensorBoard.
  assert 'perfetto_trace.json.gz' in files, files
  assert 'profiling steps 13 to 15' in out.stderr
  rows = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  train = {r['step']: r for r in rows if 'loss' in r}
  row = train[40]
  parts = [row[k] for k in ('input_wait_s_per_step', 'step_s_per_step',
                            'host_s_per_step')]
  assert all(p >= 0 for p in parts) and row['step_s_per_step'] > 0
  assert sum(parts) <= row['step_time_s'] * 1.001 + 1e-6
  last = re.search(r'step 40: [\d.]+ s/step = input wait [\d.]+ \+ step '
                   r'[\d.]+ \+ host [\d.]+.*', out.stderr)
  assert last
  # Starting and writing the trace (steps 13 to 15) is no host overhead:
  # its own part, in the log line of that interval only.
  assert train[20]['profile_s_per_step'] > 0 and row['profile_s_per_step'] == 0
  assert re.search(r'step 20: .* \+ profile [\d.]+', out.stderr)
  assert '+ profile' not in last[0]


def test_bad_profile_window_is_a_clear_error():
  from vit_jax.configs import smoke
  from vit_jax.train import config_check
  config = smoke.get_config('smoke=true')
  for bad in ('5', '5,0', '-1,3', 'a,b', '1,2,3'):
    config.profile = bad
    with pytest.raises(ValueError, match=r'--config\.profile=.*10,5'):
      config_check.check(config)
  config.profile = '0,2'
  config_check.check(config)


def test_rerun_in_same_workdir_resumes(reference_run, tmp_path):
  workdir = trained_workdir.copy(reference_run[0], tmp_path)
  path = os.path.join(workdir, 'summary.json')
  before = json.load(open(path))
  # As if trained on TPUs: evaluating on this CPU adds no hardware kind.
  json.dump({**before, 'hardware': 'tpu_v3'}, open(path, 'w'))
  out = _main(workdir)
  assert out.returncode == 0, out.stderr[-4000:]
  assert 'resumed from step 40' in out.stderr
  after = json.load(open(os.path.join(workdir, 'summary.json')))
  assert after['train_loss'] == before['train_loss']
  assert after['eval_accuracy'] == before['eval_accuracy']
  # Evaluating again trains nothing: the run's cost stays what it was.
  for key in ('wall_s', 'device_hours', 'core_days'):
    assert after[key] == before[key], key
  assert after['hardware'] == 'tpu_v3'


def test_a_finished_run_without_its_checkpoints_is_not_trained_over(
    reference_run, tmp_path):
  """checkpoints/ removed after a sweep: training again from scratch would
  replace the run's summary.json and metrics.jsonl rows. Refused."""
  workdir = trained_workdir.copy(reference_run[0], tmp_path)
  shutil.rmtree(os.path.join(workdir, 'checkpoints'))
  kept = {name: open(os.path.join(workdir, name), 'rb').read()
          for name in ('summary.json', 'metrics.jsonl')}
  out = _main(workdir)
  assert out.returncode == 1, out.stderr[-3000:]
  assert out.stderr.strip().splitlines()[-1] == (
      f'vit_jax: ResultsWithoutCheckpointError: {workdir} holds a finished '
      "run's results (summary.json, step 40) but no checkpoint to resume "
      'from: training here would start over and replace them. Use a new '
      '--workdir, or move summary.json and metrics.jsonl aside to train '
      'again here')
  for name, content in kept.items():
    assert open(os.path.join(workdir, name), 'rb').read() == content, name
  assert not os.path.exists(os.path.join(workdir, 'checkpoints'))


def test_sigkill_and_restart_matches_uninterrupted_run(reference_run,
                                                       tmp_path):
  ref_dir, _ = reference_run
  workdir = str(tmp_path / 'killed')
  cmd = [sys.executable, '-m', 'vit_jax.main', f'--workdir={workdir}', *BASE]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL,
                          env=dict(os.environ, JAX_PLATFORMS='cpu'))
  ckpt_dir = os.path.join(workdir, 'checkpoints')
  # Kill at a random moment after the first checkpoint (steps 10 or 20 ...).
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if os.path.isdir(os.path.join(ckpt_dir, '10')):
      break
    time.sleep(0.05)
  time.sleep(random.uniform(0.0, 0.3))
  proc.send_signal(signal.SIGKILL)
  assert proc.wait() == -signal.SIGKILL, 'the run ended before the kill'
  assert not os.path.isfile(os.path.join(workdir, 'summary.json'))
  out = _main(workdir)
  assert out.returncode == 0, out.stderr[-4000:]
  step, params = _final_params(workdir)
  ref_step, ref = _final_params(ref_dir)
  assert step == ref_step == 40
  for (k, a), (_, b) in zip(_leaves(params), _leaves(ref)):
    np.testing.assert_array_equal(a, b, err_msg=k)  # Bitwise on CPU.
  assert json.load(open(os.path.join(workdir, 'summary.json')))[
      'eval_accuracy'] == json.load(open(os.path.join(
          ref_dir, 'summary.json')))['eval_accuracy']


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  workdir = str(tmp_path / 'nan')
  out = _main(workdir, '--config.optim.lr=1e12',
              '--config.optim.grad_clip_norm=1e30',
              '--config.checkpoint_every=1', '--config.log_every=1')
  assert out.returncode != 0
  # The loss, gradient norm or parameter norm went non-finite first.
  assert re.search(r'(loss|grad_norm|param_norm)=-?(nan|inf) at step',
                   out.stderr), out.stderr[-2000:]
  assert 'last good checkpoint' in out.stderr
  steps = [int(d) for d in os.listdir(os.path.join(workdir, 'checkpoints'))
           if d.isdigit()]
  assert steps, 'no checkpoint kept'
  _, params = _final_params(workdir)
  assert all(np.all(np.isfinite(v)) for _, v in _leaves(params))


def test_batch_not_divisible_by_devices_is_a_clear_error(tmp_path):
  out = _main(str(tmp_path / 'bad'), '--config.input.batch_size=30',
              env={'XLA_FLAGS': xla_flags(4)})
  assert out.returncode != 0
  assert 'input.batch_size=30 is not divisible by the 4 devices' in out.stderr


def test_unknown_config_field_is_refused(tmp_path):
  out = _main(str(tmp_path / 'bad'), '--config.optim.lrr=0.1')
  assert out.returncode != 0
  assert 'lrr' in out.stderr


def test_fine_tune_from_earlier_run_at_new_resolution(reference_run, tmp_path):
  ref_dir, _ = reference_run
  ft = ['--config.input.image_size=24', '--config.total_steps=2',
        '--config.optim.name=sgd', '--config.optim.lr=0.001',
        '--config.optim.warmup_steps=0']
  out = _main(str(tmp_path / 'ft'), f'--config.init={ref_dir}', *ft)
  assert out.returncode == 0, out.stderr[-4000:]
  # The step it read, not only the workdir (whose run may save more).
  step_dir = os.path.join(ref_dir, 'checkpoints', '40')
  assert f'initialised from {step_dir}' in out.stderr
  with open(tmp_path / 'ft' / 'summary.json') as f:
    summary = json.load(f)
  assert summary['init'] == ref_dir and summary['init_from'] == step_dir
  assert summary['objective'] == summary['init_objective'] == 'supervised'
  _, ref = _final_params(ref_dir)
  _, tuned = _final_params(str(tmp_path / 'ft'))
  pe = lambda p: np.asarray(p['Transformer']['posembed_input']['pos_embedding'])
  assert pe(ref).shape == (1, 17, 32) and pe(tuned).shape == (1, 37, 32)
  np.testing.assert_allclose(pe(tuned)[:, 0], pe(ref)[:, 0], atol=1e-3)
  # Two tiny SGD steps later the encoder still holds the pre-trained weights
  # (a fresh initialisation, an independent draw, would differ by about
  # 1.4x their spread); the head was reset to zeros first.
  key = lambda p: np.asarray(p['Transformer']['encoderblock_1']['MlpBlock_0']
                             ['Dense_0']['kernel'])
  moved = np.abs(key(tuned) - key(ref)).max()
  assert moved < 0.05 * key(ref).std(), (moved, key(ref).std())
  assert np.abs(np.asarray(tuned['head']['kernel'])).max() < 0.05


def test_fine_tune_at_a_non_square_size(reference_run, tmp_path):
  """16x16 -> 16x24 images: the 4x4 grid's position embeddings are resized
  to 4x6 (25 rows with the class token, which is no 5x5 grid); few-shot
  evaluates at 16x24 too."""
  ref_dir, _ = reference_run
  config = tmp_path / 'non_square.py'
  config.write_text(
      'from configs import smoke\n'
      'def get_config(arg=None):\n'
      '  c = smoke.get_config("data=digits,steps=2,batch=32,"\n'
      '                       "fewshot=digits")\n'
      '  c.input.image_size = None  # The op strings give the size.\n'
      '  c.input.pp_train = c.input.pp_eval = (\n'
      '      "decode|resize(16,24)|value_range(-1,1)")\n'
      '  return c\n')
  out = subprocess.run(
      [sys.executable, '-m', 'vit_jax.main', f'--config={config}',
       f'--workdir={tmp_path / "ft"}', f'--config.init={ref_dir}',
       '--config.optim.name=sgd', '--config.optim.lr=1e-6',
       '--config.optim.warmup_steps=0', '--config.async_checkpoints=false'],
      cwd=ROOT, capture_output=True, text=True,
      env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT))
  assert out.returncode == 0, out.stderr[-4000:]
  _, ref = _final_params(ref_dir)
  _, tuned = _final_params(str(tmp_path / 'ft'))
  pe = lambda p: np.asarray(p['Transformer']['posembed_input']['pos_embedding'])
  assert pe(tuned).shape == (1, 25, 32)
  import scipy.ndimage
  want = scipy.ndimage.zoom(pe(ref)[0, 1:].reshape(4, 4, 32), (1, 1.5, 1),
                            order=1)
  np.testing.assert_allclose(pe(tuned)[0, 1:].reshape(4, 6, 32), want,
                             atol=1e-4)
  np.testing.assert_allclose(pe(tuned)[0, 0], pe(ref)[0, 0], atol=1e-4)
  # The checkpoint records its grid: loaded at 24x16 (a 6x4 grid, the same
  # 25 rows) its embeddings are resized, not copied transposed.
  from vit_jax import checkpoint
  from vit_jax.train import orbax_state
  recorded = orbax_state.patch_grid(str(tmp_path / 'ft'))
  assert recorded == (4, 6)
  assert orbax_state.patch_grid(ref_dir) == (4, 4)
  turned = checkpoint.load_pretrained(tuned, tuned, grid=(6, 4),
                                      source_grid=recorded, keep_head=True)
  want = scipy.ndimage.zoom(pe(tuned)[0, 1:].reshape(4, 6, 32),
                            (1.5, 4 / 6, 1), order=1)
  np.testing.assert_allclose(pe(turned)[0, 1:].reshape(6, 4, 32), want,
                             atol=1e-6)
  # Few-shot evaluated the 16x24 model on 16x24 images.
  summary = json.loads((tmp_path / 'ft' / 'summary.json').read_text())
  assert 0 <= summary['fewshot/digits/1shot'] <= 1


def test_missing_init_is_a_clear_error(tmp_path):
  out = _main(str(tmp_path / 'ft'), f'--config.init={tmp_path}/nothing')
  assert out.returncode != 0
  assert 'no orbax train state' in out.stderr


def test_workdir_of_a_different_model_is_a_clear_error(reference_run,
                                                      tmp_path):
  ref_dir = trained_workdir.copy(reference_run[0], tmp_path)
  record = open(os.path.join(ref_dir, 'config.json')).read()
  out = _main(ref_dir, '--config.model.name=ViT-Ti/16')
  assert out.returncode != 0
  assert 'holds a checkpoint (step 40) of a different model' in out.stderr
  assert 'ViT-Ti/16' in out.stderr
  # The run's record (predict and export rebuild the model from it) stays.
  assert open(os.path.join(ref_dir, 'config.json')).read() == record


def test_a_finished_run_is_not_re_evaluated_with_other_settings(
    reference_run, tmp_path):
  """Started again, a finished run evaluates again into its summary.json:
  with another eval pre-processing it is refused, and its results and
  config.json stay; with its own settings it runs."""
  ref_dir = trained_workdir.copy(reference_run[0], tmp_path)
  record = open(os.path.join(ref_dir, 'config.json')).read()
  summary = open(os.path.join(ref_dir, 'summary.json')).read()
  out = _main(ref_dir, '--config.input.pp_eval='
              'decode|resize(20)|central_crop(16)|value_range(-1,1)')
  assert out.returncode == 1, out.stderr[-3000:]
  assert 'finished at step 40; config.input.pp_eval is' in out.stderr
  assert '--config.mode=eval' in out.stderr
  assert open(os.path.join(ref_dir, 'config.json')).read() == record
  assert open(os.path.join(ref_dir, 'summary.json')).read() == summary


def test_a_finished_run_is_not_recorded_with_settings_it_never_trained(
    reference_run, tmp_path):
  """A sweep's command pointed at another LR's finished workdir trains
  nothing: refused, its config.json and summary.json (the report's LR,
  which the sweep table reads) kept; no 'Training continues' log."""
  ref_dir = trained_workdir.copy(reference_run[0], tmp_path)
  record = open(os.path.join(ref_dir, 'config.json')).read()
  summary = open(os.path.join(ref_dir, 'summary.json')).read()
  out = _main(ref_dir, '--config.optim.lr=0.5')
  assert out.returncode == 1, out.stderr[-3000:]
  assert 'finished at step 40; optim differs from what it trained with' in (
      out.stderr)
  assert "'lr': (" in out.stderr and 'DELIBERATE CHANGE' not in out.stderr
  assert open(os.path.join(ref_dir, 'config.json')).read() == record
  assert open(os.path.join(ref_dir, 'summary.json')).read() == summary


def test_a_finished_runs_length_and_report_are_compared(tmp_path):
  """Fewer steps than it trained, a setting turned on, or another report
  (its config file's other row) is no re-evaluation of this run; the same
  settings are, and so are fields added to the configs since it was
  recorded (config.json lacks them; it records unset ones as null)."""
  import ml_collections
  from vit_jax.train import loop, run_files
  config = ml_collections.ConfigDict({
      'optim': {'lr': 0.1, 'ema_decay': None}, 'loss': 'softmax',
      'label_smoothing': 0.0, 'accum_steps': 1,
      'report': {'lr': 0.1, 'task': 'transfer'}})
  run_files.write_config(str(tmp_path), config)
  run = lambda steps, start=40: type('Run', (), {
      'saved': {}, 'steps': steps, 'start': start})()
  why = lambda: loop._trained_otherwise(config, str(tmp_path), run(40))
  assert why() is None
  assert 'it trained 40 steps and this config asks for 20' in (
      loop._trained_otherwise(config, str(tmp_path), run(20)))
  # Stopped at step 20 of 40, ended there: evaluated, not refused.
  assert loop._trained_otherwise(config, str(tmp_path), run(20, 20)) is None
  # Fields added to the configs since the run was recorded are no change.
  config.optim.ema_warmup = True
  config.report.transfer = True
  assert why() is None
  config.optim.ema_decay = 0.9999  # Recorded unset (null): turned on.
  assert "optim differs from what it trained with (was -> now: " \
      "{'ema_decay': (None, 0.9999)})" in why()
  config.optim.ema_decay = None
  config.report.lr = 0.03
  assert "report differs from what it trained with (was -> now: " \
      "{'lr': (0.1, 0.03)})" in why()


def test_resume_compares_tuples_as_the_checkpoint_recorded_them(monkeypatch):
  """The run state is JSON: a tuple comes back a list. Neither the model
  check nor the optimiser's change log may take that for a change."""
  import ml_collections
  from vit_jax.train import loop, orbax_state
  config = ml_collections.ConfigDict(
      {'optim': {'lr_mults': (('head', 10.0),), 'lr': 0.1},
       'model': {'name': 'ViT-test'}})
  saved = json.loads(json.dumps(
      {'optim': config.optim.to_dict(), 'total_steps': 10}))
  warnings = []
  monkeypatch.setattr(loop.logging, 'warning',
                      lambda *a: warnings.append(a))
  loop._log_changes(saved, config, 10, 5)
  assert not warnings
  config.optim.lr = 0.2  # A real change is still logged.
  loop._log_changes(saved, config, 10, 5)
  assert len(warnings) == 1 and 'DELIBERATE CHANGE' in warnings[0][0]
  # The loss is recorded too: a changed loss or smoothing is logged.
  saved = json.loads(json.dumps({**saved, **loop._training(config)}))
  warnings.clear()
  loop._log_changes(saved, config, 10, 5)
  assert [w[2] for w in warnings] == ['optim']
  config.loss, config.label_smoothing = 'sigmoid', 0.1
  warnings.clear()
  loop._log_changes(saved, config, 10, 5)
  assert sorted(w[2] for w in warnings) == ['label_smoothing', 'loss', 'optim']
  assert orbax_state.as_saved({'resnet_layers': (1, 1, 1)}) == json.loads(
      json.dumps({'resnet_layers': [1, 1, 1]}))


def test_a_profile_window_after_the_last_step_is_named(tmp_path, caplog):
  from vit_jax.train import profiling
  with caplog.at_level('WARNING', logger='absl'):
    window = profiling.Window('100,5', str(tmp_path), 0, 40)
  assert "starts after the run's last step (40): no trace" in caplog.text
  window.before_step(100)
  assert not window.active and not (tmp_path / 'profile').exists()
  # One that runs past it stops at the last step: the final checkpoint and
  # evaluation are no train steps.
  caplog.clear()
  with caplog.at_level('WARNING', logger='absl'):
    window = profiling.Window('38,5', str(tmp_path), 0, 40)
  assert "ends after the run's last step (40): tracing steps 39 to 40" in (
      caplog.text)
  window.before_step(38)
  assert window.active
  window.after_step(40, None)
  assert not window.active and (tmp_path / 'profile').exists()


def test_each_process_traces_into_its_own_folder_and_a_failing_profiler_never_ends_the_run(
    tmp_path, monkeypatch, caplog):
  """Processes sharing `<workdir>/profile` broke JAX's Perfetto export
  (`Invalid trace folder`), which ended process 0 and left the others
  waiting in the next step; on gs:// that export cannot work at all. Each
  process now has its own folder, Perfetto is asked for on local paths
  only, and a profiler failure is a warning. Starting and writing the
  trace are timed as 'profile', waiting for the traced steps as 'step'."""
  import jax
  from vit_jax.train import profiling
  monkeypatch.setattr(jax, 'process_index', lambda: 1)
  started, timed = [], []

  def start_trace(directory, create_perfetto_trace=False):
    started.append((directory, create_perfetto_trace))

  def stop_trace():
    raise ValueError('Invalid trace folder: .../plugins/profile/2026_01_01')

  monkeypatch.setattr(jax.profiler, 'start_trace', start_trace)
  monkeypatch.setattr(jax.profiler, 'stop_trace', stop_trace)

  def recorder(name):
    timed.append(name)
    return contextlib.nullcontext()

  window = profiling.Window('3,2', str(tmp_path), 0, 10, timed=recorder)
  window.before_step(3)
  assert started == [(str(tmp_path / 'profile' / 'process_1'), True)]
  assert window.active
  with caplog.at_level('WARNING', logger='absl'):
    window.after_step(5, None)  # Does not raise.
  assert not window.active
  assert 'Invalid trace folder' in caplog.text and 'run goes on' in caplog.text
  assert timed == ['profile', 'step', 'profile']
  window.close()  # Nothing left to stop.

  started.clear()
  profiling.Window('0,1', 'gs://bucket/run', 0, 10).before_step(0)
  assert started == [('gs://bucket/run/profile/process_1', False)]

  def cannot_start(directory, create_perfetto_trace=False):
    raise RuntimeError('Profile has already been started.')

  monkeypatch.setattr(jax.profiler, 'start_trace', cannot_start)
  caplog.clear()
  window = profiling.Window('0,1', str(tmp_path), 0, 10)
  with caplog.at_level('WARNING', logger='absl'):
    window.before_step(0)
  assert not window.active and 'profiler could not start' in caplog.text
  window.after_step(1, None)  # No stop_trace: nothing was started.


def test_tensorboard_failures_are_logged_not_raised(caplog):
  """A full disk under TensorBoard's event file no longer ends the run:
  the first failure is a warning; metrics.jsonl keeps the rows."""
  from vit_jax.train import reporting

  class Failing:
    def write_scalars(self, step, scalars):
      raise OSError(28, 'No space left on device')
    close = write_scalars
  writer = reporting.TolerantWriter(Failing(), 'TensorBoard events')
  with caplog.at_level('WARNING', logger='absl'):
    writer.write_scalars(1, {'loss': 1.0})
    writer.write_scalars(2, {'loss': 1.0})
    writer.close()
  assert caplog.text.count('TensorBoard events could not be written') == 1
  assert 'No space left on device' in caplog.text


def test_a_checkpoint_is_saved_before_the_evaluation_it_owes(tmp_path):
  """A checkpoint due with an evaluation is saved first, recording it as
  owed: a run killed while evaluating resumes from that step (and
  evaluates first) rather than from the checkpoint before."""
  workdir = tmp_path / 'run'
  out = subprocess.run(
      [sys.executable, '-m', 'vit_jax.main', f'--workdir={workdir}',
       '--config=configs/smoke.py:data=digits,steps=4,batch=32',
       '--config.checkpoint_every=2', '--config.eval_every=2',
       '--config.keep_checkpoints=3', '--config.async_checkpoints=false'],
      cwd=ROOT, capture_output=True, text=True,
      env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert out.returncode == 0, out.stderr[-3000:]
  data = workdir / 'checkpoints' / '2' / 'data'
  saved = json.loads((data / 'metadata').read_text())  # Orbax's JsonSave.
  assert saved['evals_owed'] == ['eval']
  rows = [json.loads(l) for l in open(workdir / 'metrics.jsonl')]
  assert [r['step'] for r in rows if 'eval_accuracy' in r] == [2, 4]
