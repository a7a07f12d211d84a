"""A run's state is never corrupted, overwritten or stuck (issue 10).

Each case runs `python -m vit_jax.main` in subprocesses on real data
(scikit-learn's `digits`) with real orbax directories, the way users hit
them: NaN states, two runs on one workdir, damaged checkpoints, a kill
between the last checkpoint and the summary, SIGTERM / Ctrl-C.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

import trained_workdir

from vit_jax.train import config_check, lock, loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = trained_workdir.CLI_BASE
ENV = dict(os.environ, JAX_PLATFORMS='cpu')


def _cmd(workdir, *flags, base=BASE):
  return [sys.executable, '-m', 'vit_jax.main', f'--workdir={workdir}',
          *base, *flags]


def _main(workdir, *flags, base=BASE):
  return subprocess.run(_cmd(workdir, *flags, base=base), cwd=ROOT,
                        capture_output=True, text=True, env=ENV)


# `python -m vit_jax.main` that says at exit whether it loaded TensorFlow.
_TRACKED = ('import atexit, sys\n'
            'atexit.register(lambda: print("loaded tensorflow:", '
            '"tensorflow" in sys.modules, file=sys.stderr))\n'
            'from absl import app\nfrom vit_jax import main\n'
            'app.run(main.main)\n')


def _main_tracked(workdir, *flags):
  """`_main`; a refusal before training must not load TensorFlow (~7 s)."""
  cmd = [sys.executable, '-c', _TRACKED, *_cmd(workdir, *flags)[3:]]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                        env=ENV)


# `python -m vit_jax.main` whose metrics store fails every write.
_BROKEN_STORE = ('from vit_jax.train import reporting\n'
                 'def broken(path, text): raise OSError("store unavailable")\n'
                 'reporting.write_text = broken\n'
                 'from absl import app\nfrom vit_jax import main\n'
                 'app.run(main.main)\n')


def _steps(workdir):
  d = os.path.join(workdir, 'checkpoints')
  return sorted(int(s) for s in os.listdir(d) if s.isdigit())


def _params(workdir, step):
  state = ocp.StandardCheckpointer().restore(
      os.path.join(workdir, 'checkpoints', str(step), 'state'))
  return jax_leaves(state['params'])


def jax_leaves(tree):
  if isinstance(tree, dict):
    return [x for k in sorted(tree) for x in jax_leaves(tree[k])]
  return [np.asarray(tree)]


def _summary(workdir):
  with open(os.path.join(workdir, 'summary.json')) as f:
    return json.load(f)


def _rows(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(l) for l in f if l.strip()]


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """test_loop's 40-step run with BASE, made once per session: read it,
  or copy it first (`trained_workdir.copy`)."""
  workdir = trained_workdir.cli_reference_run(tmp_path_factory)
  assert _steps(workdir) == [20, 30, 40]
  assert not os.path.exists(os.path.join(workdir, 'lock'))  # Released.
  return workdir


# 1. A NaN state is never saved, and a lower LR resumes.

def test_non_finite_gradient_or_params_stop_before_saving(tmp_path):
  class Ckpt:  # What _check_finite needs of a Checkpointer.
    manager = type('M', (), {'directory': '/w/checkpoints'})()
    wait = lambda self: None
    latest_step = lambda self: 3
  ok = {'loss': 1.0, 'grad_norm': 2.0, 'param_norm': 3.0, 'lr': 0.1}
  assert loop._check_finite(4, ok, Ckpt())['grad_norm'] == 2.0
  for key in ('loss', 'grad_norm', 'param_norm'):
    with pytest.raises(loop.NonFiniteLossError, match=f'{key}=nan at step 4.*'
                       r'last good checkpoint \(step 3\)'):
      loop._check_finite(4, {**ok, key: float('nan')}, Ckpt())


def test_diverged_run_keeps_only_finite_checkpoints_and_resumes(tmp_path):
  # Adam moves every parameter by ~lr: the first step past warm-up start
  # makes parameters that overflow while the loss it logs is still finite.
  # Its metrics store fails too: that is logged, and the divergence is
  # still the error the run ends with.
  workdir = str(tmp_path / 'nan')
  cmd = [sys.executable, '-c', _BROKEN_STORE, *_cmd(
      workdir, '--config.optim.lr=1e30', '--config.checkpoint_every=1',
      '--config.log_every=1')[3:]]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=ENV)
  assert out.returncode == 1, out.stderr[-3000:]
  assert 'metrics.jsonl could not be written' in out.stderr
  last = out.stderr.strip().splitlines()[-1]
  assert 'NonFiniteLossError' in last, out.stderr[-3000:]
  assert 'last good checkpoint' in out.stderr or 'No checkpoint' in out.stderr
  for step in _steps(workdir):
    assert all(np.isfinite(x).all() for x in _params(workdir, step)), step
  out = _main(workdir, '--config.optim.lr=1e-3')
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'DELIBERATE CHANGE' in out.stderr and "'lr'" in out.stderr
  assert _summary(workdir)['steps'] == 40


# 2. One writer per workdir; SIGTERM / Ctrl-C save and exit.

def _start(workdir, *flags):
  return subprocess.Popen(_cmd(workdir, *flags), cwd=ROOT, env=ENV,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def _wait_for_row(workdir, proc, timeout=240):
  path = os.path.join(workdir, 'metrics.jsonl')
  deadline = time.time() + timeout
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(path) and os.path.getsize(path):
      return
    time.sleep(0.1)
  raise AssertionError(f'no metrics row: {proc.poll()}')


@pytest.mark.parametrize('sig,code', [
    (signal.SIGTERM, 75),
    pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)])
def test_busy_workdir_is_refused_and_a_signal_saves(tmp_path, sig, code):
  workdir = str(tmp_path / 'run')
  long = ['--config.total_steps=100000', '--config.checkpoint_every=0',
          '--config.eval_every=1']
  first = _start(workdir, *long)
  try:
    _wait_for_row(workdir, first)
    second = _main_tracked(workdir, *long, '--config.optim.lr=0.01')
    assert second.returncode == 1
    assert 'is in use by another run' in second.stderr
    assert 'loaded tensorflow: False' in second.stderr
    assert f'process {first.pid}' in second.stderr
    first.send_signal(sig)
    _, err = first.communicate(timeout=120)
  finally:
    first.kill()
  assert first.returncode == code, err[-3000:]
  name = signal.Signals(sig).name
  # Said when the signal arrives, then when the save is done.
  assert f'received {name}: saving a checkpoint after the current step' in err
  assert f'received {name}: saved a checkpoint at step' in err
  saved = _steps(workdir)
  assert len(saved) == 1 and saved[0] >= 10  # checkpoint_every=0: the stop.
  assert not os.path.exists(os.path.join(workdir, 'lock'))
  # The first run's rows are intact: nothing of the second was written.
  assert all(r.get('lr', 0) != 0.01 for r in _rows(workdir))
  # The stop's checkpoint is a whole one (resuming from one is
  # test_loop.py's SIGKILL test; this saves an interpreter start-up).
  assert all(np.isfinite(x).all() for x in _params(workdir, saved[0]))
  if sig != signal.SIGTERM:
    return
  # The stop put off the evaluation due at its step: the resumed run does
  # it first.
  def evaluated():
    try:
      return any(r['step'] == saved[0] and 'eval_accuracy' in r
                 for r in _rows(workdir))
    except ValueError:  # A row being written.
      return False
  assert not evaluated()
  resumed = _start(workdir, *long)
  try:
    deadline = time.time() + 240
    while not evaluated():
      assert time.time() < deadline and resumed.poll() is None
      time.sleep(0.2)
    resumed.send_signal(signal.SIGTERM)
    resumed.communicate(timeout=120)
  finally:
    resumed.kill()


def test_a_multi_process_ctrl_c_goes_to_the_preemption_service(monkeypatch):
  """Several processes: SIGINT becomes a SIGTERM to the process itself (what
  JAX's preemption service watches), and the stop it then reports says
  Ctrl-C (130); a second Ctrl-C stops at once. Without it, Ctrl-C raised
  KeyboardInterrupt in a collective: no save, and the others aborted."""
  import jax
  from vit_jax.train import preemption
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  terms = []  # Stands in for JAX's SIGTERM handler (C++, in a real run).
  ctrl_c = signal.getsignal(signal.SIGINT)  # Ignored in xdist's workers.
  previous = signal.signal(signal.SIGTERM, lambda *a: terms.append(a[0]))
  try:
    stops = preemption.StopRequests(lambda step: bool(terms))
    with stops:
      assert stops.requested(3) is None
      try:
        os.kill(os.getpid(), signal.SIGINT)
      except KeyboardInterrupt:
        pytest.fail('Ctrl-C raised KeyboardInterrupt: no save')
      assert terms == [signal.SIGTERM]
      stop = stops.requested(4)
      assert stop.exit_code == 130 and 'received SIGINT' in str(stop)
      with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is ctrl_c  # Restored.
    # Another process of the run, told by the service: a preemption.
    with preemption.StopRequests(lambda step: True) as other:
      assert other.requested(4).exit_code == 75
  finally:
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow  # ~20 s: two processes compile and train.
def test_ctrl_c_on_one_of_two_processes_saves_the_same_step(tmp_path):
  workdir = str(tmp_path / 'run')
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  procs = [_start(workdir, '--config.total_steps=100000',
                  '--config.checkpoint_every=0',
                  f'--coordinator=127.0.0.1:{port}', '--num_processes=2',
                  f'--process_id={i}') for i in range(2)]
  try:
    _wait_for_row(workdir, procs[0])
    procs[0].send_signal(signal.SIGINT)
    errs = [p.communicate(timeout=180)[1] for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert [p.returncode for p in procs] == [130, 75], errs[1][-3000:]
  step = _steps(workdir)
  assert len(step) == 1 and step[0] >= 1
  assert f'received SIGINT: saved a checkpoint at step {step[0]}' in errs[0]
  assert f'preemption notice: saved a checkpoint at step {step[0]}' in errs[1]


def test_stale_locks_are_taken_over_and_live_ones_refused(tmp_path):
  done = subprocess.run(['true'])
  dead = subprocess.Popen(['true'])
  dead.wait()
  path = tmp_path / 'lock'
  me = socket.gethostname()
  path.write_text(json.dumps({'host': me, 'pid': dead.pid, 'start': 'x',
                              'heartbeat': time.time()}))
  held = lock.WorkdirLock(str(tmp_path))
  assert 'no longer runs' in held.acquire()
  with pytest.raises(lock.WorkdirBusyError, match='in use by another run'):
    lock.WorkdirLock(str(tmp_path)).acquire()
  held.release()
  assert not path.exists() and done.returncode == 0
  # Another host: judged by its heartbeat.
  path.write_text(json.dumps({'host': 'elsewhere', 'pid': 1,
                              'heartbeat': time.time()}))
  with pytest.raises(lock.WorkdirBusyError, match='elsewhere'):
    lock.WorkdirLock(str(tmp_path)).acquire()
  path.write_text(json.dumps({'host': 'elsewhere', 'pid': 1,
                              'heartbeat': time.time() - lock.STALE_S - 1}))
  held = lock.WorkdirLock(str(tmp_path))
  assert 'no heartbeat' in held.acquire()
  held.release()


def test_two_runs_taking_over_one_stale_lock_do_not_both_hold_it(tmp_path):
  """B takes the stale lock over between A's judgment and A's rename: A
  must put B's fresh lock back and refuse, not delete it and lock too."""
  path = tmp_path / 'lock'
  path.write_text(json.dumps({'host': 'elsewhere', 'pid': 1,
                              'heartbeat': time.time() - lock.STALE_S - 1}))
  b = lock.WorkdirLock(str(tmp_path))

  class Slow(lock.WorkdirLock):
    raced = False

    def _stale(self, held):
      why = super()._stale(held)
      if why and not self.raced:
        self.raced = True
        assert 'no heartbeat' in b.acquire()  # B wins meanwhile.
      return why

  a = Slow(str(tmp_path))
  a._me = {**a._me, 'pid': a._me['pid'] + 1}  # Another run of this host.
  with pytest.raises(lock.WorkdirBusyError, match='in use by another run'):
    a.acquire()
  assert json.loads(path.read_text())['pid'] == os.getpid()  # B's lock.
  assert sorted(p.name for p in tmp_path.iterdir()) == ['lock']
  b.release()
  assert not path.exists()


def test_the_heartbeat_survives_storage_errors_and_never_overwrites_a_taker(
    tmp_path, monkeypatch):
  monkeypatch.setattr(lock, 'HEARTBEAT_S', 0.02)
  held = lock.WorkdirLock(str(tmp_path))
  held.acquire()
  writes, real, outage = [], type(held.path).write_text, []
  storage = threading.Lock()  # One write at a time, as a store's are.

  def flaky(self, text):
    with storage:
      writes.append(text)
      if len(writes) == 1 or outage:  # What tf.io.gfile raises on gs://.
        raise RuntimeError('UnavailableError: 503')
      return real(self, text)

  monkeypatch.setattr(type(held.path), 'write_text', flaky)
  deadline = time.time() + 10
  while len(writes) < 3 and time.time() < deadline:
    time.sleep(0.02)
  assert len(writes) >= 3 and held._thread.is_alive()  # Kept beating.
  taker = json.dumps({'host': 'elsewhere', 'pid': 7,
                      'heartbeat': time.time()})
  with storage:  # Its beats fail from now on: taken over after an outage.
    outage.append(True)
    real(held.path, taker)
  held._thread.join(timeout=10)
  assert not held._thread.is_alive()  # It stopped; the taker's lock stays.
  assert held.path.read_text() == taker
  held.release()
  assert held.path.read_text() == taker


@pytest.mark.parametrize('flags,message', [
    (['--config=configs/smok.py'], 'no such file'),
    (['--config=configs/smoke.py:data=digits,steps=ten'],
     "steps='ten': expected int"),
    (['--config.model.name=ViT-B16'], "Did you mean ['ViT-B/16'"),
    (['--config.model.dtyp=bfloat16'],
     "config.model has no field 'dtyp' (did you mean dtype?)"),
    (['--config.input.image_size=18', '--config.objective=mpp'],
     'not divisible by the patch size 4'),
    (['--config.mode=eval'], 'has no checkpoint and config.init is not set'),
    (["--config.optim.lr_mults=(('^nope', 5.0),)"],
     "optim.lr_mults regex(es) ['^nope'] match no"),
])
def test_mistakes_get_one_message_not_a_traceback(tmp_path, flags, message):
  out = _main(str(tmp_path / 'run'), *flags)
  assert out.returncode == 1, out.stderr[-3000:]
  assert message in out.stderr and 'Traceback' not in out.stderr


def test_a_process_holding_the_lock_may_hold_it_again(tmp_path):
  """`main` locks before it imports the trainer, which locks again."""
  path = tmp_path / 'lock'
  with lock.hold(str(tmp_path)) as outer:
    with lock.hold(os.path.relpath(tmp_path)) as inner:
      assert inner is outer
    assert path.exists()  # The inner exit keeps the outer's lock.
    with pytest.raises(lock.WorkdirBusyError):
      lock.WorkdirLock(str(tmp_path)).acquire()  # Still refuses others.
  assert not path.exists()


# 3. A damaged newest checkpoint: restore the previous good one.

def _truncate_arrays(step_dir):
  for root, _, files in os.walk(os.path.join(step_dir, 'state')):
    if os.path.basename(root) == 'd':
      for f in files:
        with open(os.path.join(root, f), 'r+b') as fh:
          fh.truncate(10)


DAMAGE = {
    'truncated arrays': _truncate_arrays,
    'metadata deleted': lambda d: os.remove(os.path.join(d, 'state',
                                                         '_METADATA')),
    'metadata garbled': lambda d: open(os.path.join(
        d, 'state', '_METADATA'), 'w').write('{"tree": [garbage'),
    'state deleted': lambda d: shutil.rmtree(os.path.join(d, 'state')),
    'data garbled': lambda d: open(os.path.join(
        d, 'data', 'metadata'), 'w').write('not json'),
}


# Two kinds by default (and every step's metadata deleted below); all five
# with -m slow.
FAST = ('data garbled', 'truncated arrays')


@pytest.mark.parametrize('damage', [
    d if d in FAST else pytest.param(d, marks=pytest.mark.slow)
    for d in sorted(DAMAGE)])
def test_damaged_newest_checkpoint_falls_back(reference, tmp_path, damage):
  workdir = trained_workdir.copy(reference, tmp_path)
  os.remove(os.path.join(workdir, 'summary.json'))
  DAMAGE[damage](os.path.join(workdir, 'checkpoints', '40'))
  out = _main(workdir)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'checkpoint step 40 is damaged' in out.stderr
  assert 'resumed from step 30' in out.stderr
  aside = os.listdir(os.path.join(workdir, 'damaged_checkpoints'))
  assert len(aside) == 1 and aside[0].startswith('40-')  # Kept, not deleted.
  assert _steps(workdir) == [20, 30, 40]
  for a, b in zip(_params(workdir, 40), _params(reference, 40)):
    np.testing.assert_array_equal(a, b)  # Steps 31-40 again, bitwise.
  assert _summary(workdir)['train_loss'] == _summary(reference)['train_loss']
  steps = [r['step'] for r in _rows(workdir) if 'loss' in r]
  assert steps == [10, 20, 30, 40]  # No step twice.


def test_changed_optimiser_is_not_called_damage(reference, tmp_path):
  workdir = trained_workdir.copy(reference, tmp_path)
  out = _main(workdir, '--config.optim.name=sgd')
  assert out.returncode == 1
  assert 'intact but holds another model or optimiser layout' in out.stderr
  assert 'damaged' not in out.stderr.split('ConfigChangedError')[-1]
  assert not os.path.exists(os.path.join(workdir, 'damaged_checkpoints'))
  assert _steps(workdir) == [20, 30, 40]


def test_every_checkpoint_damaged_is_an_error_that_moves_nothing(
    reference, tmp_path):
  workdir = trained_workdir.copy(reference, tmp_path)
  for step in (20, 30, 40):
    os.remove(os.path.join(workdir, 'checkpoints', str(step), 'state',
                           '_METADATA'))
  out = _main(workdir)
  assert out.returncode == 1
  assert 'every checkpoint in' in out.stderr and 'is damaged' in out.stderr
  assert _steps(workdir) == [20, 30, 40]


# 4. Killed between the last checkpoint and the summary.

def test_summary_complete_after_kill_before_it(reference, tmp_path):
  workdir = trained_workdir.copy(reference, tmp_path)
  os.remove(os.path.join(workdir, 'summary.json'))  # Killed in final eval.
  out = _main(workdir)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'resumed from step 40' in out.stderr
  ref, got = _summary(reference), _summary(workdir)
  for key in ('train_loss', 'train_grad_norm', 'train_lr', 'eval_accuracy',
              'steps', 'exaflops'):
    assert got[key] == ref[key], key
  rows = _rows(workdir)
  assert len(rows) == len(_rows(reference))  # The final eval replaced.
  assert len({(r['step'], tuple(sorted(r))) for r in rows}) == len(rows)


# 7. Values that cannot work are refused before compiling.

def test_a_workdir_that_cannot_be_written_says_so(tmp_path, monkeypatch):
  """Read-only storage (or permissions) is one message naming the fix, not
  an OSError traceback from the lock file."""
  import errno

  def read_only(self):
    raise OSError(errno.EROFS, 'Read-only file system', str(self.path))
  monkeypatch.setattr(lock.WorkdirLock, '_acquire_local', read_only)
  with pytest.raises(lock.WorkdirNotWritableError,
                     match='Read-only file system. Use a writable --workdir'):
    with lock.hold(str(tmp_path / 'run')):
      pass


def test_config_values_that_cannot_work_are_refused(tmp_path):
  from vit_jax.configs import smoke
  config = smoke.get_config('data=digits')
  config_check.check(config)
  for key, value in [('total_steps', -1), ('input.batch_size', -8),
                     ('optim.lr', 0.0), ('keep_checkpoints', 0),
                     ('label_smoothing', 1.5), ('mesh.fsdp', 0)]:
    bad = config.copy_and_resolve_references()
    node = bad
    *path, last = key.split('.')
    for part in path:
      node = node[part]
    node[last] = value
    with pytest.raises(ValueError, match=f'--config.{key}={value}'):
      config_check.check(bad)
  # Names the code would only refuse deep in setup or in the step's trace.
  for key, value in [('optim.name', 'adamw'), ('optim.decay', 'cos'),
                     ('loss', 'softmaxx'), ('model.dtype', 'bfloat1')]:
    bad = config.copy_and_resolve_references()
    section, _, field = key.rpartition('.')
    (bad[section] if section else bad)[field] = value
    with pytest.raises(ValueError, match=f"--config.{key}='{value}' cannot "
                       'work; expected'):
      config_check.check(bad)
  # An option the model's family lacks (a ResNet has no remat).
  bit = config.copy_and_resolve_references()
  bit.model.name, bit.model.remat = 'BiT-R50x1', True
  with pytest.raises(ValueError, match='--config.model.remat=True: BiT-R50x1 '
                     r'\(BiT\) has no option remat; its options: depth, '):
    config_check.check(bit)
  # 0 switches clipping off, and lets total_epochs set the length.
  off = config.copy_and_resolve_references()
  off.optim.grad_clip_norm, off.total_steps, off.total_epochs = 0.0, 0, 1.0
  with pytest.raises(ValueError, match='warmup_steps=60 is not below the 12 '
                     'total steps'):  # One epoch of the stated train size.
    config_check.check(off)
  off.optim.warmup_steps = 2
  config_check.check(off)
  long_warmup = config.copy_and_resolve_references()
  long_warmup.total_steps, long_warmup.optim.warmup_steps = 10, 10
  with pytest.raises(ValueError, match='warmup_steps=10 is not below the 10 '
                     'total steps'):
    config_check.check(long_warmup)
  # One step of a warm-up has learning rate 0: it trained nothing, silently.
  long_warmup.total_steps = 1
  with pytest.raises(ValueError, match='warmup_steps=10 is not below the 1 '
                     'total steps: .*warmup_steps=0'):
    config_check.check(long_warmup)
  # A size the explicit pre-processing would ignore (it resizes to 16).
  from vit_jax.data import pipeline
  ignored = config.copy_and_resolve_references()
  ignored.input.image_size = 32
  ignored.input.pp_train = 'decode|resize(16)|value_range(-1,1)'
  with pytest.raises(ValueError, match=r"input.image_size=32 is ignored: "
                     r"input.pp_train=.* makes 16x16 images. Set "
                     r"--config.input.image_size=16"):
    pipeline.dataset_info(ignored.input)
  # Non-square images: image_size is a square size, so None is the fix.
  ignored.input.pp_train = 'decode|resize(16,24)|value_range(-1,1)'
  with pytest.raises(ValueError, match=r"makes 16x24 images. input.image_size"
                     r" is a square size: .* set it to None"):
    pipeline.dataset_info(ignored.input)
  out = _main_tracked(str(tmp_path / 'bad'), '--config.total_steps=-5',
                      '--config.eval_ema=last')
  assert out.returncode == 1
  assert '--config.total_steps=-5 cannot work' in out.stderr
  assert "--config.eval_ema='last' cannot work" in out.stderr
  assert 'loaded tensorflow: False' in out.stderr  # Refused in seconds.
  assert not os.path.exists(tmp_path / 'bad' / 'checkpoints')


def _steps_1_and_2(tmp_path):
  """(Checkpointer with steps 1 and 2 saved, abstract state, shardings,
  failing) where `failing(error)` is a `StandardCheckpointHandler.restore`
  (what reads a step's state) that raises `error` reading step 2's."""
  import flax
  import jax
  import jax.numpy as jnp
  from vit_jax.train import orbax_state

  @flax.struct.dataclass
  class State:
    params: dict

  ckpt = orbax_state.Checkpointer(str(tmp_path), every=1, async_save=False)
  state = State(params={'w': jnp.arange(4.0)})
  for step in (1, 2):
    ckpt.maybe_save(step, state, {'position': step})
  ckpt.wait()
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          state)
  shardings = jax.tree.map(lambda a: a.sharding, state)
  real = ocp.StandardCheckpointHandler.restore

  def failing(error):
    def restore(self, directory, *args, **kwargs):
      if directory.parent.name == '2':
        raise error
      return real(self, directory, *args, **kwargs)
    return restore
  return ckpt, abstract, shardings, failing


def test_a_passing_restore_failure_moves_nothing_aside(tmp_path, monkeypatch):
  """Storage unavailable or out of memory says nothing about the files: the
  newest checkpoint stays where it is (a damaged one is moved aside)."""
  import errno
  from vit_jax.train import orbax_state
  ckpt, abstract, shardings, failing = _steps_1_and_2(tmp_path)

  for error in (ValueError('UNAVAILABLE: GCS returned 503'), MemoryError(),
                OSError(errno.ETIMEDOUT, 'Connection timed out')):
    monkeypatch.setattr(ocp.StandardCheckpointHandler, 'restore',
                        failing(error))
    with pytest.raises(orbax_state.CheckpointUnavailableError,
                       match='Nothing was moved'):
      ckpt.restore(abstract, shardings)
    assert (tmp_path / 'checkpoints' / '2').exists()
  monkeypatch.setattr(ocp.StandardCheckpointHandler, 'restore', failing(
      ValueError('DATA_LOSS: truncated chunk')))
  step, restored, data = ckpt.restore(abstract, shardings)
  assert (step, data) == (1, {'position': 1})
  assert not (tmp_path / 'checkpoints' / '2').exists()
  assert list((tmp_path / 'damaged_checkpoints').iterdir())
  ckpt.close()


def test_a_compute_option_may_change_on_resume_and_is_logged(tmp_path,
                                                             caplog):
  """`--config.model.remat=True` after moving to smaller devices (the
  memory advice of docs/troubleshooting.md) was refused as "a different
  model", pointing at `--config.init`, which loses the optimiser state,
  schedule and data position. How a model computes may change (logged);
  what it is may not."""
  import logging
  import flax
  import jax
  import jax.numpy as jnp
  import ml_collections
  from vit_jax import models
  from vit_jax.train import loop, orbax_state

  @flax.struct.dataclass
  class State:
    params: dict

  ckpt = orbax_state.Checkpointer(str(tmp_path), every=1, async_save=False)
  state = State(params={'w': jnp.arange(4.0)})
  saved = {'name': 'ViT-test', 'remat': None, 'dtype': 'float32'}
  ckpt.maybe_save(2, state, {'model': saved, 'optim': {'lr': 0.1}})
  ckpt.wait()
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          state)
  shardings = jax.tree.map(lambda a: a.sharding, state)
  loose = {'model': models.registry.COMPUTE_OPTIONS}
  now = dict(saved, remat='dots_saveable', dtype='bfloat16')
  step, _, data = ckpt.restore(abstract, shardings, expect={'model': now},
                               loose=loose)
  assert step == 2
  with pytest.raises(orbax_state.ConfigChangedError, match='different model'):
    ckpt.restore(abstract, shardings, expect={'model': now})  # Not loose.
  with pytest.raises(orbax_state.ConfigChangedError,
                     match=r"different model: \{'name': 'ViT-test'\} there, "
                     r"\{'name': 'ViT-test', 'hidden_size': 32\} in this"):
    ckpt.restore(abstract, shardings, loose=loose,
                 expect={'model': dict(now, hidden_size=32)})
  config = ml_collections.ConfigDict({
      'model': now, 'optim': data.get('optim', {}), 'loss': None})
  with caplog.at_level(logging.WARNING):
    loop._log_changes(data, config, 10, 2)  # pylint: disable=protected-access
  assert "DELIBERATE CHANGE on resume from step 2: model was" in caplog.text
  assert "'remat': (None, 'dots_saveable')" in caplog.text
  ckpt.close()


def _as_process(monkeypatch, index, others=()):
  """What orbax_state sees as process `index` of a run with one more
  process per `others` entry: (outcome, message) that process reports at
  each agreement (`orbax_state._gather`)."""
  import types
  import jax
  from vit_jax.train import orbax_state
  fake = types.SimpleNamespace(**{k: getattr(jax, k) for k in dir(jax)
                                  if not k.startswith('__')})
  count = 1 + len(others)
  fake.process_count, fake.process_index = (lambda: count), (lambda: index)
  monkeypatch.setattr(orbax_state, 'jax', fake)
  monkeypatch.setattr(
      orbax_state, '_gather',
      lambda code, message: (list(others[:index]) + [(code, message)]
                             + list(others[index:])))


def test_processes_agree_on_how_reading_a_step_went(monkeypatch):
  """Each process reads its own shards, so one may fail where the others
  read whole. Every process acts on the worst outcome: damaged on one is
  damaged on all (they walk back together), unavailable on one stops all
  (exit 75), instead of one leaving orbax's barrier with its error and the
  others waiting until the distributed service aborts them all (134)."""
  from vit_jax.train import orbax_state
  ok = lambda: 'read'
  def damaged():
    raise orbax_state.DamagedCheckpointError('cannot read s/state',
                                             reason='state item: DATA_LOSS')
  def unavailable():
    raise orbax_state.CheckpointUnavailableError('could not read s/state')
  OK, DAMAGED, UNAVAILABLE = (orbax_state._OK, orbax_state._DAMAGED,
                              orbax_state._UNAVAILABLE)

  _as_process(monkeypatch, 0, [(OK, '')])
  assert orbax_state._agreed(ok, 's/state') == 'read'
  _as_process(monkeypatch, 0, [(DAMAGED, 'state item: DATA_LOSS x')])
  with pytest.raises(orbax_state.DamagedCheckpointError,
                     match='s/state is damaged as process 1 reads it') as e:
    orbax_state._agreed(ok, 's/state')
  assert e.value.reason == 'state item: DATA_LOSS x (process 1)'
  _as_process(monkeypatch, 1, [(OK, '')])  # The process that found it.
  with pytest.raises(orbax_state.DamagedCheckpointError, match='DATA_LOSS'):
    orbax_state._agreed(damaged, 's/state')
  # A passing failure anywhere outranks damage: nothing is moved aside.
  _as_process(monkeypatch, 0, [(UNAVAILABLE, 'UNAVAILABLE: 503'),
                               (DAMAGED, 'state item: DATA_LOSS')])
  with pytest.raises(orbax_state.CheckpointUnavailableError,
                     match=r'process 1 could not read s/state for a passing '
                     r'reason \(UNAVAILABLE: 503\). Nothing was moved'):
    orbax_state._agreed(damaged, 's/state')
  _as_process(monkeypatch, 1, [(DAMAGED, 'x')])
  with pytest.raises(orbax_state.CheckpointUnavailableError,
                     match='could not read s/state$'):  # Its own.
    orbax_state._agreed(unavailable, 's/state')
  # Another layout found by one: refused by all, with its message.
  _as_process(monkeypatch, 0, [(orbax_state._REFUSED, 'holds another model')])
  with pytest.raises(orbax_state.ConfigChangedError,
                     match=r'holds another model \(process 1\)'):
    orbax_state._agreed(ok, 's/state')


def test_outcomes_are_gathered_with_their_messages(monkeypatch):
  from vit_jax.train import orbax_state
  monkeypatch.setattr(orbax_state.multihost_utils, 'process_allgather',
                      lambda mine: np.stack([mine, mine * 0]))
  got = orbax_state._gather(orbax_state._DAMAGED, 'state item: é' + 'x' * 2000)
  assert got[0][0] == orbax_state._DAMAGED
  assert got[0][1].startswith('state item: éxxx')
  assert len(got[0][1].encode()) == orbax_state._MESSAGE_BYTES
  assert got[1] == (orbax_state._OK, '')


def test_a_step_one_process_finds_damaged_is_walked_back_by_all(
    tmp_path, monkeypatch):
  """Process 0 reads step 2 whole, process 1 finds its shards damaged: both
  skip step 2 in the same start, restore step 1, and process 0 moves step 2
  aside; it is saved anew when the run gets there."""
  from vit_jax.train import orbax_state
  ckpt, abstract, shardings, _ = _steps_1_and_2(tmp_path)
  real = orbax_state._gather
  def process_1_reports(code, message):
    # Process 1 reads step 2's data and metadata, not its shards.
    if '/2/state' in process_1_reports.what:
      return [(code, message), (orbax_state._DAMAGED, 'state item: DATA_LOSS')]
    return [(code, message), (orbax_state._OK, '')]
  _as_process(monkeypatch, 0, [(orbax_state._OK, '')])
  agreed = orbax_state._agreed
  def tracking(read, what):
    process_1_reports.what = what
    return agreed(read, what)
  monkeypatch.setattr(orbax_state, '_agreed', tracking)
  monkeypatch.setattr(orbax_state, '_gather', process_1_reports)
  step, _, data = ckpt.restore(abstract, shardings)
  assert (step, data) == (1, {'position': 1})
  aside, = (tmp_path / 'damaged_checkpoints').iterdir()
  assert aside.name.startswith('2-')
  monkeypatch.undo()
  assert orbax_state._gather is real
  _, state, data = ckpt.restore(abstract, shardings)
  ckpt.maybe_save(2, state, data)  # The resumed run saves step 2 anew.
  ckpt.wait()
  assert ckpt.restore(abstract, shardings)[0] == 2
  ckpt.close()


def test_a_damaged_step_that_cannot_be_moved_aside_stops_the_run(
    tmp_path, monkeypatch):
  """Left in place, a damaged step is never saved anew (orbax keeps a step
  it lists): the run would finish with it. It stops before training,
  naming the folder to move; nothing is deleted."""
  from etils import epath
  from vit_jax.train import orbax_state
  ckpt, abstract, shardings, failing = _steps_1_and_2(tmp_path)
  monkeypatch.setattr(ocp.StandardCheckpointHandler, 'restore', failing(
      ValueError('DATA_LOSS: truncated chunk')))
  def no_rename(self, target):
    raise OSError(95, 'Operation not supported')
  monkeypatch.setattr(type(epath.Path(str(tmp_path))), 'rename', no_rename)
  with pytest.raises(orbax_state.CheckpointWriteError,
                     match=r'damaged checkpoint step\(s\) could not be moved '
                     r'aside: .*/checkpoints/2 \(OSError: .*Operation not '
                     r'supported\). Nothing was trained or deleted. Move each '
                     r'into .*/damaged_checkpoints/ yourself \(or delete it\)'):
    ckpt.restore(abstract, shardings)
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['1', '2']
  ckpt.close()


def test_a_failed_save_is_one_line_naming_the_step_and_the_steps_kept(
    tmp_path, monkeypatch):
  """A full disk: orbax's error (pages of it, a save late when saving in
  the background) becomes one line with the step, the cause, the complete
  steps kept and the fix."""
  from vit_jax.train import orbax_state
  ckpt, _, _, _ = _steps_1_and_2(tmp_path)
  full = ValueError('RESOURCE_EXHAUSTED: Error writing "opt_state/0" in '
                    'OCDBT database at local file "/w/...": ' + 'x' * 300 +
                    ' No space left on device [os_error_code=\'28\']')
  def failing(*args, **kwargs):
    raise full
  monkeypatch.setattr(ckpt.manager, 'save', failing)
  with pytest.raises(orbax_state.CheckpointWriteError) as e:
    ckpt.maybe_save(3, None, {}, force=True)
  assert str(e.value) == (
      f'could not save checkpoint step 3 in {tmp_path}/checkpoints (No space '
      'left on device); the complete checkpoints kept: steps 1, 2. Free '
      'space (or fix the storage) and re-run the same command to resume '
      'from step 2')
  def unlistable(*args, **kwargs):  # The storage fails the listing too.
    raise OSError('Input/output error')
  monkeypatch.setattr(orbax_state.ocp.step, 'checkpoint_steps', unlistable)
  with pytest.raises(orbax_state.CheckpointWriteError) as e:
    ckpt.maybe_save(3, None, {}, force=True)
  assert str(e.value).endswith(  # Steps may be kept all the same.
      'the complete checkpoints kept could not be listed. Free space (or fix '
      'the storage) and re-run the same command to resume from its newest '
      'complete checkpoint')
  monkeypatch.undo()
  monkeypatch.setattr(ckpt.manager, 'wait_until_finished', failing)
  ckpt._saving = 2  # A background save that failed after it began.
  with pytest.raises(orbax_state.CheckpointWriteError,
                     match='could not save checkpoint step 2 .* kept: steps '
                     '1. Free space'):
    ckpt.close()
  # A SIGTERM while the last save is waited for stops the run (75), not a
  # write error (1): the launcher resumes it.
  from vit_jax.train import preemption
  def stopped(*args, **kwargs):
    raise preemption.StoppedBeforeTraining('SIGTERM')
  monkeypatch.setattr(ckpt.manager, 'wait_until_finished', stopped)
  with pytest.raises(preemption.StoppedBeforeTraining):
    ckpt.close()


# `python -m vit_jax.main` on storage without renames of checkpoint steps.
_NO_RENAME = ('from etils import epath\n'
              'Path = type(epath.Path("/"))\n'
              'real = Path.rename\n'
              'def rename(self, target):\n'
              '  if "/checkpoints/" in str(self):\n'
              '    raise OSError(95, "Operation not supported")\n'
              '  return real(self, target)\n'
              'Path.rename = rename\n'
              'from absl import app\nfrom vit_jax import main\n'
              'app.run(main.main)\n')

# `python -m vit_jax.main` on a disk that fills up after step 40's save.
_DISK_FULL = ('import orbax.checkpoint as ocp\n'
              'real = ocp.CheckpointManager.save\n'
              'def save(self, step, *args, **kwargs):\n'
              '  if step > 40:\n'
              '    raise ValueError("RESOURCE_EXHAUSTED: Error writing ... '
              'No space left on device [os_error_code=28]")\n'
              '  return real(self, step, *args, **kwargs)\n'
              'ocp.CheckpointManager.save = save\n'
              'from absl import app\nfrom vit_jax import main\n'
              'app.run(main.main)\n')


def _main_with(script, workdir, *flags):
  cmd = [sys.executable, '-c', script, *_cmd(workdir, *flags)[3:]]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                        env=ENV)


def test_a_damaged_step_left_in_place_stops_before_training(
    reference, tmp_path):
  workdir = trained_workdir.copy(reference, tmp_path)
  os.remove(os.path.join(workdir, 'summary.json'))
  _truncate_arrays(os.path.join(workdir, 'checkpoints', '40'))
  rows = _rows(workdir)
  out = _main_with(_NO_RENAME, workdir)
  assert out.returncode == 1, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith('vit_jax: CheckpointWriteError: damaged checkpoint '
                         f'step(s) could not be moved aside: {workdir}/'
                         'checkpoints/40 (OSError: '), last
  assert last.endswith(f'Nothing was trained or deleted. Move each into '
                       f'{workdir}/damaged_checkpoints/ yourself (or delete '
                       'it), then re-run the same command'), last
  assert _steps(workdir) == [20, 30, 40]
  assert _rows(workdir) == rows  # Nothing trained.


def test_a_full_disk_stops_with_one_line_keeping_the_steps_saved(
    reference, tmp_path):
  workdir = trained_workdir.copy(reference, tmp_path)
  out = _main_with(_DISK_FULL, workdir, '--config.total_steps=50')
  assert out.returncode == 1, out.stderr[-3000:]
  assert out.stderr.strip().splitlines()[-1] == (
      'vit_jax: CheckpointWriteError: could not save checkpoint step 50 in '
      f'{workdir}/checkpoints (No space left on device); the complete '
      'checkpoints kept: steps 20, 30, 40. Free space (or fix the storage) '
      'and re-run the same command to resume from step 40')
  assert 'Traceback' not in out.stderr
  assert _steps(workdir) == [20, 30, 40]
  assert _summary(workdir) == _summary(reference)


def _truncate_one_shard(step_dir, process):
  shards = os.path.join(step_dir, 'state', f'ocdbt.process_{process}', 'd')
  name = sorted(os.listdir(shards))[0]
  with open(os.path.join(shards, name), 'r+b') as f:
    f.truncate(10)


@pytest.mark.slow  # ~70 s: two processes train, then resume.
def test_a_step_damaged_on_one_of_two_processes_is_walked_back_by_both(
    tmp_path):
  """Each process reads its own shards: process 1 finds step 20 damaged,
  process 0 reads its part whole. Both walk back to step 10 in the same
  start and finish (orbax's collective restore left process 0 waiting
  until the distributed service aborted both, exit 134, minutes later)."""
  workdir = str(tmp_path / 'run')
  base = ['--config=configs/smoke.py:data=digits,steps=20,batch=32',
          *BASE[1:], '--config.mesh.data=1', '--config.mesh.fsdp=2',
          '--config.fsdp_min_size=1']

  def both():
    with socket.socket() as s:
      s.bind(('127.0.0.1', 0))
      port = s.getsockname()[1]
    procs = [subprocess.Popen(
        _cmd(workdir, f'--coordinator=127.0.0.1:{port}', '--num_processes=2',
             f'--process_id={i}', base=base), cwd=ROOT, env=ENV,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
      errs = [p.communicate(timeout=240)[1] for p in procs]
    finally:
      for p in procs:
        p.kill()
    return [p.returncode for p in procs], errs

  codes, errs = both()
  assert codes == [0, 0], errs[1][-3000:]
  assert _steps(workdir) == [10, 20]
  os.remove(os.path.join(workdir, 'summary.json'))
  _truncate_one_shard(os.path.join(workdir, 'checkpoints', '20'), 1)
  started = time.time()
  codes, errs = both()
  assert codes == [0, 0], (errs[0][-3000:], errs[1][-3000:])
  assert time.time() - started < 200  # Not the 300 s shutdown timeout.
  for err in errs:
    assert 'checkpoint step 20 is damaged' in err
    assert 'resumed from step 10' in err
  aside = os.listdir(os.path.join(workdir, 'damaged_checkpoints'))
  assert len(aside) == 1 and aside[0].startswith('20-')
  assert _steps(workdir) == [10, 20]
  assert _summary(workdir)['steps'] == 20


def test_sigterm_outside_the_steps_stops_at_once_with_75(monkeypatch):
  """Setup (data, restore, compiling) takes minutes, longer than a
  preemption notice: a SIGTERM then ends the run at once with 75, which
  launchers re-run, not with -15, which they take as a failure. While the
  steps run `StopRequests` decides (save first); several processes leave
  SIGTERM to JAX's preemption service."""
  import jax
  from vit_jax.train import preemption
  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(preemption.StoppedBeforeTraining) as stopped:
    with preemption.stop_at_once_outside_steps():
      with preemption.StopRequests(lambda step: False) as stops:
        os.kill(os.getpid(), signal.SIGTERM)  # During the steps: a save.
        assert stops.requested(3).exit_code == 75
      os.kill(os.getpid(), signal.SIGTERM)  # After them: at once.
      time.sleep(5)
      pytest.fail('SIGTERM outside the steps did not stop')
  assert stopped.value.exit_code == 75
  assert isinstance(stopped.value, preemption.RunInterrupted)  # vtab's catch.
  assert 'nothing trained since the last checkpoint' in str(stopped.value)
  assert signal.getsignal(signal.SIGTERM) is before
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  with preemption.stop_at_once_outside_steps():
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.filterwarnings(
    'ignore::pytest.PytestUnraisableExceptionWarning')  # What Python prints.
def test_a_sigterm_swallowed_by_a_del_still_stops_the_run():
  """A SIGTERM whose StoppedBeforeTraining is raised inside a `__del__`
  (TensorFlow's garbage collectors run them during set-up) is only printed
  by Python and the run went on, training and exiting 0 through a
  preemption: it stops the run when the steps would start, or at the end
  of the block."""
  from vit_jax.train import preemption

  class Collected:
    def __del__(self):  # The handler runs here; its exception is lost.
      os.kill(os.getpid(), signal.SIGTERM)
      for _ in range(1000):
        pass

  with pytest.raises(preemption.StoppedBeforeTraining):
    with preemption.stop_at_once_outside_steps():
      Collected()
      with preemption.StopRequests(lambda step: False):
        pytest.fail('the steps started after a SIGTERM')
  went_on = []
  with pytest.raises(preemption.StoppedBeforeTraining):
    with preemption.stop_at_once_outside_steps():  # Evaluating, say.
      Collected()
      went_on.append(True)
  assert went_on
  with preemption.stop_at_once_outside_steps():  # The next task's: clear.
    pass


def test_a_stop_signal_with_stderr_gone_still_saves(monkeypatch):
  """The acknowledgement goes to stderr from the signal handler: a stderr
  that is gone (`... | tee log`, the tee killed by the same Ctrl-C) must
  not raise into the training loop, which then could not save."""
  from vit_jax.train import preemption

  def broken(fd, data):
    raise BrokenPipeError(32, 'Broken pipe')
  monkeypatch.setattr(preemption.os, 'write', broken)
  with preemption.StopRequests(lambda step: False) as stops:
    os.kill(os.getpid(), signal.SIGTERM)
    stop = stops.requested(3)
  assert stop is not None and stop.exit_code == 75
