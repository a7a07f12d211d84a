"""launch.tpu: exact gcloud commands, confirmation, preemption, local runs.

Offline: gcloud is never called (a recording runner, or a fake `gcloud` first
on PATH). The worker-side shell is run for real against a fake home
directory, and one test trains the smoke config as 2 local processes.

Commands of docs/tpu.md covered: every `python -m launch.tpu ...` line of its
bash blocks runs with --dry-run in `test_every_doc_command_runs_dry` (the
`--local-processes` one also for real in `test_local_processes_train`; the
`vit_jax.data.prepare` commands inside its `exec` lines have their flags
checked in `test_doc_prepare_flags_exist`); the other commands are listed in
`COVERED_ELSEWHERE` with the test that runs them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import xla_flags
from vit_jax.launch import commands, local, topology, tpu
from vit_jax.launch.runner import Process, Result, Runner
from vit_jax.train.preemption import EXIT_PREEMPTED

ROOT = tpu.ROOT
DOC = os.path.join(ROOT, 'docs', 'tpu.md')
B16 = 'configs/pretrain.py:model=ViT-B/16,data=i21k'
SMOKE = 'configs/smoke.py:data=digits,steps=8,batch=32'
COVERED_ELSEWHERE = {
    'python -m launch.topology v4-32 --config=' + B16:
        'tests/test_launch_topology.py::test_cli',
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path_factory):
  """Runs from the repo root, with a `gcloud` on PATH that only refuses."""
  monkeypatch.chdir(ROOT)
  bin_dir = tmp_path_factory.mktemp('no_gcloud')
  (bin_dir / 'gcloud').write_text('#!/bin/sh\necho "gcloud called in a '
                                  'test" >&2\nexit 97\n')
  (bin_dir / 'gcloud').chmod(0o755)
  monkeypatch.setenv('PATH', f'{bin_dir}{os.pathsep}{os.environ["PATH"]}')


class FakeProcess(Process):
  """A log stream whose wait() answers from a script (last answer repeats)."""

  def __init__(self, answers):
    super().__init__()
    self.answers, self.stopped = list(answers), False

  def wait(self, timeout=None):
    return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

  def stop(self, grace=10.0):
    self.stopped = True


class FakeRunner(Runner):
  """Records every command; describe answers `states` in turn; the n-th log
  stream answers `streams[n]`; worker 0's run state (`status_script`)
  answers `runs` in turn ('running', 'exited N'; once they are used up,
  worker 0 does not answer); asked on every worker, it answers `workers`
  (or, given, `idle` until a run is started: `_start` asks first too);
  commands matching `fail` exit 1."""

  def __init__(self, states=(), streams=(), fail=None, runs=(), workers='',
               idle=None):
    super().__init__(out=io.StringIO())
    self.calls, self.states, self.streams = [], list(states), list(streams)
    self.fail, self.processes, self.runs = fail, [], list(runs)
    self.workers, self.idle = workers, idle

  def _call(self, argv, capture):
    self.calls.append(argv)
    if 'describe' in argv:
      return Result(0, self.states.pop(0) + '\n')
    if any('$(hostname): $s' in a for a in argv) and '--worker=all' in argv:
      started = any(kind(c) == 'run' for c in self.calls)
      idle = self.idle is not None and not started
      return Result(0, self.idle if idle else self.workers)
    if any('$(hostname): $s' in a for a in argv):
      if not self.runs:
        return Result(255, '', 'Connection timed out')
      return Result(0, f'w-0: {self.runs.pop(0)} | step 10\n')
    failed = self.fail and self.fail(argv)
    if failed:  # `fail` may name the error (a str), else 'boom'.
      return Result(1, '', failed if isinstance(failed, str) else 'boom')
    if kind(argv) == 'pack':  # The archive a recreated TPU installs again.
      with open(argv[-1], 'w') as f:
        f.write('packed')
    return Result(0)

  def _spawn(self, argv, log, cwd):
    self.calls.append(argv)
    self.processes.append(FakeProcess(self.streams.pop(0)))
    return self.processes[-1]


def kind(argv) -> str:
  """A short name for a recorded command."""
  if argv[:2] == ['gcloud', 'storage']:
    return 'storage cp'
  if 'vit_jax.launch.pack' in argv:
    return 'pack'
  if argv[0] != 'gcloud':
    return argv[0]
  verb = argv[4]
  if verb != 'ssh':
    return verb
  command = next(a for a in argv if a.startswith('--command='))
  for word, name in (('vit_jax.main', 'run'), ('tail -n +1', 'logs'),
                     (f'tail -n {commands.REATTACH_LINES} ', 'logs'),
                     ('uv venv', 'install'), ('rm -rf', 'rm'),
                     ('$(hostname): $s', 'run state'),
                     ('$(hostname).log', 'save logs')):
    if word in command:
      return name
  return 'ssh'


def dry(argv):
  """main(VERB --dry-run ARGS) in-process: (exit status, output lines)."""
  runner = Runner(dry_run=True, out=io.StringIO())
  code = tpu.main([argv[0], '--dry-run', *argv[1:]], runner=runner)
  return code, runner.out.getvalue().splitlines()


def gcloud_lines(lines):
  return [shlex.split(line) for line in lines if not line.startswith('#')]


UP = ['up', '--name=vit', '--zone=us-central2-b', f'--config={B16}',
      '--workdir=gs://b/run']


# --------------------------------------------------------------------------
# Dry runs: the exact commands.


@pytest.mark.parametrize('topo,flags,create', [
    ('v3-8', [], ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', 'vit',
                  '--accelerator-type=v3-8', '--version=tpu-ubuntu2204-base',
                  '--zone=us-central2-b']),
    ('v3-32', ['--preemptible', '--project=p'], [
        'gcloud', 'compute', 'tpus', 'tpu-vm', 'create', 'vit',
        '--accelerator-type=v3-32', '--version=tpu-ubuntu2204-base',
        '--preemptible', '--zone=us-central2-b', '--project=p']),
    ('v4-32', ['--spot'], [
        'gcloud', 'compute', 'tpus', 'tpu-vm', 'create', 'vit',
        '--accelerator-type=v4-32', '--version=tpu-ubuntu2204-base', '--spot',
        '--zone=us-central2-b']),
    ('v5litepod-16', ['--spot', '--queued'], [
        'gcloud', 'compute', 'tpus', 'queued-resources', 'create', 'vit',
        '--node-id=vit', '--accelerator-type=v5litepod-16',
        '--runtime-version=v2-alpha-tpuv5-lite', '--spot',
        '--zone=us-central2-b']),
])
def test_dry_run_up(topo, flags, create):
  code, lines = dry(UP + [f'--topology={topo}', '--results=../out',
                          '--env', 'TFDS_DATA_DIR=gs://b/tfds', *flags])
  assert code == 0
  cmds = gcloud_lines(lines)
  assert [kind(c) for c in cmds] == [
      'create', 'pack', 'scp', 'install', 'run state', 'run', 'logs',
      'mkdir', 'storage cp', 'delete']
  assert cmds[0] == create
  zone = ['--zone=us-central2-b'] + [f for f in flags if 'project' in f]
  queued = '--queued' in flags
  tpu_vm = ['gcloud', 'compute', 'tpus', 'tpu-vm']
  archive = cmds[1][-1]
  assert cmds[1] == [sys.executable, '-m', 'vit_jax.launch.pack', ROOT,
                     archive]
  assert re.fullmatch(re.escape(tempfile.gettempdir()) +
                      r'/vit_jax_setup_\w+/vit\.tar\.gz', archive), archive
  assert cmds[2] == tpu_vm + ['scp', archive, 'vit:vit_jax_setup.tar.gz',
                              *zone, '--worker=all']
  for i, worker in zip((3, 4, 5, 6), ('all', 'all', 'all', '0')):
    c = cmds[i]
    assert c[:6] + c[-2:-1] == tpu_vm + ['ssh', 'vit', f'--worker={worker}']
    assert c[6:-2] == zone
  run = cmds[5][-1]
  assert ('env TFDS_DATA_DIR=gs://b/tfds $HOME/vit_jax_env/bin/python -m '
          f'vit_jax.main --config={B16} --workdir=gs://b/run &') in run
  assert 'nohup bash -c' in run and '> $HOME/vit_jax_run.log' in run
  assert cmds[8] == ['gcloud', 'storage', 'cp', '-r', 'gs://b/run',
                     '../out'] + [f for f in flags if 'project' in f]
  assert cmds[9] == (
      ['gcloud', 'compute', 'tpus', 'queued-resources', 'delete', 'vit',
       '--force', '--quiet', *zone] if queued else
      tpu_vm + ['delete', 'vit', '--quiet', *zone])
  # The estimate, as launch.topology computes it, before any command.
  t = topology.parse(topo)
  est = topology.estimate(tpu.load_config(B16), t)
  first = next(i for i, line in enumerate(lines) if not line.startswith('#'))
  head = lines[:first]
  assert (f'# {topo}: {t.chips} chips, {t.cores} TensorCores, {t.devices} '
          f'JAX devices on {t.hosts} host(s)') in head
  assert [f'#   {line}' for line in est.lines()] == [
      line for line in head if line.startswith('#   ')]
  assert any('core-days' in x for x in head) and any(
      'exaFLOPs' in x for x in head) and any(
          f'h on {t.devices} devices' in x for x in head)
  if queued:
    assert any('queued-resources describe vit' in x for x in lines)


def test_dry_run_output_is_a_shell_script():
  code, lines = dry(UP + ['--topology=v4-32', '--spot', '--results=../out'])
  assert code == 0
  subprocess.run(['bash', '-n'], input='\n'.join(lines), text=True,
                 check=True)


def test_runtime_version_defaults_and_override():
  assert commands.default_runtime_version('v6e-8') == 'v2-alpha-tpuv6e'
  assert commands.default_runtime_version('v5p-16') == 'v2-alpha-tpuv5'
  _, lines = dry(['create', '--name=t', '--zone=z', '--topology=v6e-8',
                  '--runtime-version=custom-image'])
  assert gcloud_lines(lines) == [[
      'gcloud', 'compute', 'tpus', 'tpu-vm', 'create', 't',
      '--accelerator-type=v6e-8', '--version=custom-image', '--zone=z']]


def test_config_overrides_reach_the_estimate_and_the_workers():
  _, lines = dry(UP + ['--topology=v4-32', '--config.input.batch_size=1024',
                       '--config.accum_steps=2'])
  est = topology.estimate(
      tpu.load_config(B16, ['--config.input.batch_size=1024']),
      topology.parse('v4-32'))
  assert f'#   {est.lines()[2]}' in lines  # Examples seen: 1024 x steps.
  run = next(c for c in gcloud_lines(lines) if kind(c) == 'run')[-1]
  assert ('--workdir=gs://b/run --config.input.batch_size=1024 '
          '--config.accum_steps=2 &') in run


def test_git_repo_is_cloned_on_every_worker():
  _, lines = dry(['setup', '--name=t', '--zone=z',
                  '--repo=https://github.com/me/vit.git#v1'])
  ask, cmd = gcloud_lines(lines)  # Every worker is asked for a run first.
  assert kind(ask) == 'run state' and '--worker=all' in ask
  assert cmd[:8] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 't',
                     '--zone=z', '--worker=all']
  assert cmd[8].startswith('--command=' + commands.idle_guard() + (
      ' && rm -rf $HOME/vit_jax && git clone -q '
      'https://github.com/me/vit.git $HOME/vit_jax && git -C $HOME/vit_jax '
      'checkout -q v1 && cd $HOME/vit_jax && '))
  assert "-e '.[data]' 'jax[tpu]' -c constraints.txt" in cmd[8]


def test_logs_status_exec_delete():
  _, lines = dry(['logs', '--name=t', '--zone=z', '--worker=2'])
  assert gcloud_lines(lines)[0][7] == '--worker=2'
  _, lines = dry(['status', '--name=t', '--zone=z'])
  assert [c[4] for c in gcloud_lines(lines)] == ['describe', 'ssh']
  _, lines = dry(['exec', '--name=t', '--zone=z', '--', 'python', '-V'])
  assert gcloud_lines(lines) == [[
      'gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 't', '--zone=z',
      '--worker=all', '--command=cd $HOME/vit_jax || exit 1; export '
      'PATH=$HOME/vit_jax_env/bin:$PATH; python -V']]
  _, lines = dry(['delete', '--name=t', '--zone=z', '--queued'])
  assert gcloud_lines(lines) == [[
      'gcloud', 'compute', 'tpus', 'queued-resources', 'delete', 't',
      '--force', '--quiet', '--zone=z']]


# --------------------------------------------------------------------------
# Bad input: clear errors, nothing run.


@pytest.mark.parametrize('argv,message', [
    (UP + ['--topology=v9-8'], "unknown TPU topology 'v9-8'"),
    (UP + ['--topology=v3-9'], 'even number'),
    (['up', '--topology=v4-32'], 'up needs --name, --zone, --config, '
     '--workdir'),
    (UP + ['--topology=v4-32', '--spot', '--preemptible'], 'exclude'),
    (UP + ['--topology=v4-32', '--queued', '--preemptible'], '--spot'),
    (UP + ['--topology=v4-32', '--env', 'NOPE'], 'expected KEY=VALUE'),
    (UP + ['--topology=v4-32', '--bogus'], 'unrecognized arguments: --bogus'),
    (['logs', '--name=t', '--zone=z', '--local-processes=2'],
     '--local-processes goes with run or up'),
    (['up', '--local-processes=2', f'--config={SMOKE}', '--workdir=/tmp/w',
      '--results=x'], '--results with --local-processes'),
    (['run', '--local-processes=2', f'--config={SMOKE}', '--workdir=/tmp/w',
      '--spot', '--max-restarts=3', f'--repo={ROOT}'],
     '--max-restarts, --spot, --repo with --local-processes'),
    (['logs', '--name=t', '--zone=z', '--', 'ls'], 'only exec does'),
    (['exec', '--name=t', '--zone=z'], 'exec runs the command after "--"'),
])
def test_bad_flags(argv, message, capsys):
  runner = FakeRunner()
  with pytest.raises(SystemExit) as e:
    tpu.main(argv, runner=runner)
  assert e.value.code == 2
  assert message in capsys.readouterr().err
  assert runner.calls == []


@pytest.mark.parametrize('extra,message', [
    (['--workdir=/tmp/run'], 'has 4 hosts: use a gs:// --workdir'),
    (['--config=/etc/hostname'], 'must be inside'),
    (['--config=configs/nope.py'], 'no such file'),
    (['--repo=/tmp'], 'no setup.py'),
    (['--config.no_such_field=1'], "config has no field 'no_such_field'"),
])
def test_bad_runs_fail_before_any_command(extra, message, capsys):
  runner = FakeRunner()
  assert tpu.main(UP + ['--topology=v4-32', '--yes', *extra],
                  runner=runner) == 2
  assert message in capsys.readouterr().err
  assert runner.calls == []


def test_a_config_git_ignores_is_refused_before_any_command(tmp_path,
                                                           capsys):
  """A config file in an ignored folder (workdirs/ is) passes every local
  check but is not in the archive `setup` copies: every worker would fail
  after the TPU was created. Refused first, naming the fix."""
  repo = tmp_path / 'repo'
  (repo / 'workdirs' / 'exp').mkdir(parents=True)
  (repo / 'configs').mkdir()
  (repo / 'setup.py').write_text('')
  (repo / '.gitignore').write_text('/workdirs/\n')
  smoke = open(os.path.join(ROOT, 'configs', 'smoke.py')).read()
  for path in ('workdirs/exp/cfg.py', 'configs/cfg.py'):
    (repo / path).write_text(smoke)
  subprocess.run(['git', '-C', str(repo), 'init', '-q'], check=True)
  runner = FakeRunner()
  argv = ['up', '--name=vit', '--zone=z', '--topology=v4-8',
          '--workdir=gs://b/r', f'--repo={repo}', '--yes']
  assert tpu.main(argv + [f'--config={repo}/workdirs/exp/cfg.py'],
                  runner=runner) == 2
  err = capsys.readouterr().err
  assert ('workdirs/exp/cfg.py is not shipped to the workers' in err and
          '.gitignore excludes this file' in err and 'add -f' in err), err
  assert runner.calls == []
  args = tpu.parse_args(argv + [f'--config={repo}/configs/cfg.py'])
  tpu._preflight(args, runner)  # Untracked, not ignored: shipped.


def test_single_host_local_workdir_warns():
  _, lines = dry(UP[:-1] + ['--workdir=/tmp/run', '--topology=v3-8'])
  assert any('lost when the TPU is deleted' in x for x in lines)


# --------------------------------------------------------------------------
# Confirmation: a real subprocess, with a fake gcloud first on PATH.


@pytest.fixture
def fake_gcloud(tmp_path):
  """PATH with a `gcloud` that appends its argv to a file and succeeds."""
  record = tmp_path / 'gcloud_calls'
  script = tmp_path / 'bin' / 'gcloud'
  script.parent.mkdir()
  script.write_text(f'#!/bin/sh\necho "$@" >> {record}\n')
  script.chmod(script.stat().st_mode | stat.S_IEXEC)
  env = dict(os.environ, PATH=f'{script.parent}{os.pathsep}'
             f'{os.environ["PATH"]}')
  return env, record


def _launch(argv, answer, env):
  return subprocess.run([sys.executable, '-m', 'launch.tpu', *argv],
                        input=answer, capture_output=True, text=True,
                        env=env, cwd=ROOT, timeout=120)


def test_refusing_aborts_before_any_command(fake_gcloud):
  env, record = fake_gcloud
  p = _launch(UP + ['--topology=v4-32', '--spot'], 'n\n', env)
  assert p.returncode == 1, p.stderr
  assert 'core-days' in p.stdout and 'Proceed? [y/N]' in p.stdout
  assert 'aborted' in p.stdout
  assert not record.exists()


def test_yes_proceeds(fake_gcloud):
  env, record = fake_gcloud
  p = _launch(['create', '--name=t', '--zone=z', '--topology=v3-8',
               f'--config={SMOKE}'], 'y\n', env)
  assert p.returncode == 0, p.stderr
  assert 'Proceed? [y/N]' in p.stdout and 'core-days' in p.stdout
  assert record.read_text().split() == [
      'compute', 'tpus', 'tpu-vm', 'create', 't', '--accelerator-type=v3-8',
      '--version=tpu-ubuntu2204-base', '--zone=z']


def test_end_of_input_aborts(monkeypatch):
  """No terminal to answer (a script, CI): aborted, naming --yes."""
  monkeypatch.setattr('sys.stdin', io.StringIO(''))
  runner = FakeRunner()
  assert tpu.main(['delete', '--name=t', '--zone=z'], runner=runner) == 1
  assert runner.calls == []
  assert 'pass --yes to run without asking' in runner.out.getvalue()


# --------------------------------------------------------------------------
# up: preemption, failures (a scripted runner).


@pytest.fixture(autouse=True)
def _no_lock_wait(monkeypatch):
  """Scripted `up` runs start again at once after a preemption (the wait
  for a dead run's lock is test_restart_waits_for_the_dead_runs_lock's)."""
  monkeypatch.setattr(tpu, 'LOCK_STALE_S', 0.0)


def _up(runner, *extra):
  return tpu.main(UP + ['--topology=v3-32', '--spot', '--yes',
                        '--poll-seconds=1e-9', *extra], runner=runner)


LAUNCH = ['create', 'pack', 'scp', 'install', 'run state', 'run']
RELAUNCH = [k for k in LAUNCH if k != 'pack']  # The archive packed at first.


def test_preemption_recreates_and_resumes():
  # Stream 1 still running when describe says PREEMPTED; stream 2 running at
  # the next poll (READY), then the run ends well.
  runner = FakeRunner(states=['PREEMPTED', 'READY'],
                      streams=[[None], [None, 0]])
  assert _up(runner, '--results=../out') == 0
  assert [kind(c) for c in runner.calls] == (
      LAUNCH + ['logs', 'describe', 'delete'] + RELAUNCH +
      ['logs', 'describe', 'mkdir', 'storage cp', 'delete'])
  creates = [c for c in runner.calls if kind(c) == 'create']
  runs = [c for c in runner.calls if kind(c) == 'run']
  assert len(runs) == 2 and runs[0] == runs[1]  # Same workdir: resumes.
  assert creates[0] == creates[1] and '--spot' in creates[0]
  assert runner.processes[0].stopped
  assert 'restart 1/5' in runner.out.getvalue()


def test_a_recreated_tpu_installs_the_code_the_run_started_with(
    monkeypatch, tmp_path):
  """The checkout is packed once per `up`: a TPU recreated after a
  preemption (days later, perhaps) installs the same archive, not what
  the checkout holds by then."""

  monkeypatch.setattr(tpu.tempfile, 'gettempdir', lambda: str(tmp_path))
  # FakeRunner's pack writes the archive, as the real one.
  runner = FakeRunner(states=['PREEMPTED', 'READY'],
                      streams=[[None], [None, 0]])
  assert _up(runner) == 0
  kinds = [kind(c) for c in runner.calls]
  assert kinds.count('pack') == 1 and kinds.count('create') == 2
  scps = [c for c in runner.calls if kind(c) == 'scp']
  assert len(scps) == 2 and scps[0] == scps[1]


def test_two_ups_of_one_name_keep_their_own_archives(tmp_path):
  """Each command packs into a folder of its own: a second `up` with the
  same --name (another zone, another checkout) neither overwrites the
  first one's archive nor, ending, removes it; an archive gone all the
  same fails loudly rather than packing the checkout as it is now."""
  import tarfile
  repos = []
  for i in (1, 2):
    repo = tmp_path / f'r{i}'
    repo.mkdir()
    (repo / 'setup.py').write_text('')
    (repo / 'train.py').write_text(f'code {i}')
    repos.append(str(repo))
  runner = Runner(out=io.StringIO())
  first, second = (argparse.Namespace(name='vit') for _ in repos)
  a1 = tpu._archive(runner, first, repos[0])
  a2 = tpu._archive(runner, second, repos[1])
  assert a1 != a2 and os.path.dirname(a1) != os.path.dirname(a2)
  shutil.rmtree(os.path.dirname(a2))  # The second one ends: its cleanup.
  again = tpu._archive(runner, first, repos[0])  # A recreated TPU's setup.
  assert again == a1
  with tarfile.open(again) as tar:
    assert tar.extractfile('train.py').read() == b'code 1'
  os.remove(a1)
  with pytest.raises(tpu.SetupArchiveGone, match='is gone .* not packing'):
    tpu._archive(runner, first, repos[0])


def test_restart_waits_for_the_dead_runs_lock(monkeypatch):
  """A run that died with its TPU holds the workdir's lock until it is
  stale: the new TPU's run starts after that, not to be refused as a
  second writer; a run that saved on SIGTERM released it: no wait."""
  slept = []
  monkeypatch.setattr(tpu, 'LOCK_STALE_S', 300.0)
  monkeypatch.setattr(tpu.time, 'sleep', slept.append)
  runner = FakeRunner(states=['PREEMPTED', 'READY'],
                      streams=[[None], [None, 0]])
  assert _up(runner) == 0
  assert any(250 < s <= 300 for s in slept), slept
  assert 'holds the workdir\'s lock until it is stale' in (
      runner.out.getvalue())
  slept.clear()
  runner = FakeRunner(states=['READY', 'READY'],
                      streams=[[EXIT_PREEMPTED], [0]])
  assert _up(runner) == 0
  assert not any(s > 1 for s in slept), slept  # No lock wait.


def test_follow_up_hints_name_the_project_and_polling_must_wait():
  """The printed logs / delete commands name --project (gcloud's default
  project may hold a TPU of the same name); --poll-seconds=0 would ask
  for the TPU state in a tight loop."""
  runner = FakeRunner()
  assert tpu.main(['run', '--name=vit', '--zone=us-central2-b',
                   '--project=p', '--workdir=gs://b/w', '--yes',
                   '--topology=v3-32', '--config=configs/smoke.py'],
                  runner=runner) == 0
  assert ('launch.tpu logs --name=vit --zone=us-central2-b --project=p'
          in runner.out.getvalue())
  with pytest.raises(SystemExit):
    tpu.main(UP + ['--topology=v3-32', '--yes', '--poll-seconds=0'],
             runner=FakeRunner())


def test_run_that_saved_on_sigterm_is_relaunched():
  # The run saved and exited 75 while the node still answers READY (a
  # checkpoint store that was unavailable, a SIGTERM that was no
  # preemption): run again on the same TPU, which resumes; deleting it
  # would give up its disks and its place (capacity may not come back).
  runner = FakeRunner(states=['READY', 'READY'],
                      streams=[[EXIT_PREEMPTED], [0]])
  assert _up(runner) == 0
  runs = [c for c in runner.calls if kind(c) == 'run']
  assert len(runs) == 2 and runs[0] == runs[1]
  assert 'preemption signal (exit 75)' in runner.out.getvalue()
  assert 'starting it again there' in runner.out.getvalue()
  kinds = [kind(c) for c in runner.calls]
  first, second = (i for i, k in enumerate(kinds) if k == 'run')
  assert 'delete' not in kinds[first:second]
  assert 'create' not in kinds[first:second]
  # Gone by the time it is asked (a spot preemption): recreated.
  runner = FakeRunner(states=['PREEMPTED', 'READY', 'READY'],
                      streams=[[EXIT_PREEMPTED], [0]])
  assert _up(runner) == 0
  kinds = [kind(c) for c in runner.calls]
  first, second = (i for i, k in enumerate(kinds) if k == 'run')
  assert 'delete' in kinds[first:second] and 'create' in kinds[first:second]


def test_a_run_killed_by_sigterm_on_a_ready_tpu_is_resumed():
  """A SIGTERM that ends the run before it can save (143: while it starts,
  before vit_jax.main catches it) on a TPU still READY is a preemption, as
  an exit 75 is: started again there (a restart), not failed and deleted."""
  runner = FakeRunner(states=['READY'] * 4, streams=[[143], [0]],
                      runs=['exited 143'])
  assert _up(runner) == 0
  kinds = [kind(c) for c in runner.calls]
  assert kinds.count('run') == 2 and 'create' not in kinds[1:]
  first, second = (i for i, k in enumerate(kinds) if k == 'run')
  assert 'delete' not in kinds[first:second]
  out = runner.out.getvalue()
  assert 'stopped by a SIGTERM (exit 143)' in out and 'restart 1/5' in out
  assert 'the run failed' not in out
  # Counted against --max-restarts like any other.
  runner = FakeRunner(states=['READY'] * 8, streams=[[143]] * 3,
                      runs=['exited 143'] * 3)
  assert _up(runner, '--max-restarts=1') == 1
  assert [kind(c) for c in runner.calls].count('run') == 2
  assert 'giving up (--max-restarts=1)' in runner.out.getvalue()


def test_run_starts_on_every_worker_or_on_none(capsys):
  """On a slice, a run still going on some workers (they stop at different
  moments) refuses the start everywhere, naming them: started on the idle
  workers only, it would wait forever for its busy peers."""
  argv = ['run', '--name=vit', '--zone=us-central2-b', f'--config={B16}',
          '--workdir=gs://b/run', '--topology=v4-32', '--yes']
  runner = FakeRunner(idle='Using ssh batch size of 1.\n'
                      't1v-n-1-w-0: exited 75 at 2026-11-28T10:04:41Z | x\n'
                      't1v-n-1-w-1: running, log idle 2s | saving\n'
                      't1v-n-1-w-2: no run | \n'
                      't1v-n-1-w-3: running, log idle 9s | saving\n')
  assert tpu.main(argv, runner=runner) == 1
  assert [kind(c) for c in runner.calls] == ['run state']
  assert '--worker=all' in runner.calls[0]
  err = capsys.readouterr().err
  assert ('a run is still going on t1v-n-1-w-1, t1v-n-1-w-3: started '
          'nothing') in err
  assert "-- 'kill $(cat ~/vit_jax_run.pid)'" in err
  runner = FakeRunner(idle='t1v-n-1-w-0: exited 75 at 2026-11-28T10:04:41Z '
                      '| x\nt1v-n-1-w-1: no run | \n')
  assert tpu.main(argv, runner=runner) == 0
  assert [kind(c) for c in runner.calls] == ['run state', 'run']


def test_a_restart_starts_the_command_the_run_started_with(tmp_path,
                                                           capsys):
  """`up` runs for days; meanwhile the --config file may be moved or
  removed here (a `git checkout` of another branch): a restart starts the
  command the run started with, pinned as the code archive is, not one
  rebuilt from the checkout (which failed, leaving the TPU billing)."""
  repo = tmp_path / 'repo'
  (repo / 'configs').mkdir(parents=True)
  (repo / 'setup.py').write_text('')
  config = repo / 'configs' / 'exp.py'
  config.write_text(open(os.path.join(ROOT, 'configs', 'smoke.py')).read())
  subprocess.run(['git', '-C', str(repo), 'init', '-q'], check=True)

  class Checkout(FakeRunner):
    def _spawn(self, argv, log, cwd):  # The run streams: the file goes.
      config.unlink(missing_ok=True)
      return super()._spawn(argv, log, cwd)

  runner = Checkout(states=['READY'], streams=[[EXIT_PREEMPTED], [0]])
  assert tpu.main(['up', '--name=vit', '--zone=z', '--topology=v4-8',
                   f'--config={config}:data=digits', f'--repo={repo}',
                   '--workdir=gs://b/w', '--yes', '--poll-seconds=1e-9'],
                  runner=runner) == 0, capsys.readouterr().err
  runs = [c for c in runner.calls if kind(c) == 'run']
  assert len(runs) == 2 and runs[0] == runs[1]
  assert '--config=configs/exp.py:data=digits ' in runs[1][-1]
  assert kind(runner.calls[-1]) == 'delete'


def test_an_unexpected_error_after_create_still_ends_the_run(monkeypatch,
                                                             capsys):
  """Whatever goes wrong once a TPU exists (a bug here, a checkout that
  changed), `up` ends as a failed run: logs saved, results copied, the
  TPU deleted, or with --keep the command to delete it printed. Before
  any TPU, the error goes out as it is: nothing to clean up."""
  def broken(*args):
    raise RuntimeError('a bug in the launcher')

  monkeypatch.setattr(tpu, '_watch', broken)
  runner = FakeRunner(workers='w-0: running | step 10\n', idle='')
  assert _up(runner, '--results=../out') == 1
  assert [kind(c) for c in runner.calls][-6:] == [
      'run', 'run state', 'save logs', 'mkdir', 'storage cp', 'delete']
  assert 'RuntimeError: a bug in the launcher' in capsys.readouterr().err
  runner = FakeRunner(workers='w-0: running | step 10\n', idle='')
  assert _up(runner, '--keep') == 1
  assert 'delete' not in [kind(c) for c in runner.calls]
  assert ('vit is kept (--keep); delete it with: python -m launch.tpu '
          'delete --name=vit --zone=us-central2-b') in runner.out.getvalue()
  monkeypatch.setattr(tpu, '_create', broken)
  runner = FakeRunner()
  with pytest.raises(RuntimeError, match='a bug in the launcher'):
    _up(runner)
  assert runner.calls == []


# A `launch.tpu up` whose gcloud is faked: the TPU is READY, worker 0's
# log streams until stopped; what it runs is printed as `# call VERB`.
UP_SCRIPT = """import signal, sys, time
# Ctrl-C reaches it as in a terminal, even where this test runs with SIGINT
# ignored (a background job of a non-interactive shell passes SIG_IGN on).
signal.signal(signal.SIGINT, signal.default_int_handler)
from vit_jax.launch import tpu
from vit_jax.launch.runner import Process, Result, Runner

class Stream(Process):
  def wait(self, timeout=None):
    time.sleep(0.05)
  def stop(self, grace=10.0):
    print('# stream stopped', flush=True)

class Gcloud(Runner):
  def _call(self, argv, capture):
    print('# call', argv[4] if argv[0] == 'gcloud' else argv[0], flush=True)
    return Result(0, 'READY\\n' if 'describe' in argv else '')
  def _spawn(self, argv, log, cwd):
    print('# streaming', flush=True)
    return Stream()

sys.exit(tpu.main(sys.argv[1:], Gcloud()))
"""


@pytest.mark.parametrize('sig,nohup', [
    ('SIGTERM', False), ('SIGHUP', False), ('SIGINT', False),
    ('SIGTERM', True)])
def test_a_signal_detaches_up_naming_its_tpu(tmp_path, sig, nohup):
  """SIGTERM or SIGHUP (`timeout`, a CI job's limit, a closed terminal)
  ends `up` as Ctrl-C does: the TPU and its run go on, the commands to
  follow and delete it are printed (by default the signal ended `up`
  silently), the log stream stops, and the status is 128 + the signal.
  Under `nohup` a SIGHUP stays ignored: `up` goes on."""
  out = tmp_path / 'out'
  ignore_hup = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)
  with open(out, 'w') as f:
    p = subprocess.Popen(
        [sys.executable, '-c', UP_SCRIPT, 'up', '--name=vit', '--zone=z',
         '--topology=v4-8', f'--config={SMOKE}', '--workdir=gs://b/w',
         '--yes', '--poll-seconds=0.05', '--hang-minutes=0'],
        stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
        env=dict(os.environ, JAX_PLATFORMS='cpu'),
        preexec_fn=ignore_hup if nohup else None)
  try:
    _wait_for(lambda: '# streaming' in out.read_text(), 'up to stream',
              seconds=120)
    if nohup:
      p.send_signal(signal.SIGHUP)
      with pytest.raises(subprocess.TimeoutExpired):
        p.wait(1)
    p.send_signal(getattr(signal, sig))
    p.wait(60)
  finally:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(p.pid, signal.SIGKILL)
  text = out.read_text()
  assert p.returncode == 128 + getattr(signal, sig), text
  assert (f'# {sig}: the TPU and its run go on. Follow: python -m '
          'launch.tpu logs --name=vit --zone=z; delete: python -m '
          'launch.tpu delete --name=vit --zone=z') in text
  assert '# stream stopped' in text and '# call delete' not in text


def test_an_interrupt_while_finishing_does_not_say_the_run_goes_on():
  """Ctrl-C while `up` deletes the ended run's TPU: the hint says the run
  ended and the TPU may still exist, not that the run goes on."""
  runner = FakeRunner(streams=[[0]])
  calls = runner._call

  def call(argv, capture):
    if kind(argv) == 'delete':
      raise KeyboardInterrupt
    return calls(argv, capture)
  runner._call = call
  assert _up(runner) == 130
  out = runner.out.getvalue()
  assert 'SIGINT while finishing (run done): the TPU may still exist' in out
  assert 'go on' not in out


def test_setup_installs_on_every_worker_or_on_none(capsys):
  """`setup` asks every worker first, as `run` does: a run going on one of
  them refuses the install on all (each worker's own guard alone would
  give the idle workers new code and leave the busy one's: a slice of
  mixed code)."""
  argv = ['setup', '--name=vit', '--zone=z']
  runner = FakeRunner(workers='t1v-n-1-w-0: exited 75 at 2026-11-28T10:04:'
                      '41Z | x\nt1v-n-1-w-1: running, log idle 2s | saving\n')
  assert tpu.main(argv, runner=runner) == 1
  assert [kind(c) for c in runner.calls] == ['run state']
  assert '--worker=all' in runner.calls[0]
  assert ('a run is still going on t1v-n-1-w-1: installed nothing'
          in capsys.readouterr().err)
  runner = FakeRunner(workers='t1v-n-1-w-0: no run | \n')
  assert tpu.main(argv, runner=runner) == 0
  assert [kind(c) for c in runner.calls] == [
      'run state', 'pack', 'scp', 'install']
  # Right after `create`, the new workers refuse the first ssh (255): the
  # question is asked again, as the install's steps are.
  runner = FakeRunner(workers='t1v-n-1-w-0: no run | \n')
  refused, calls = iter([True]), runner._call

  def call(argv, capture):
    if kind(argv) == 'run state' and next(refused, False):
      runner.calls.append(argv)
      return Result(255, '', 'Connection refused')
    return calls(argv, capture)
  runner._call = call
  assert tpu.main(argv + ['--poll-seconds=0.01'], runner=runner) == 0
  assert [kind(c) for c in runner.calls] == [
      'run state', 'run state', 'pack', 'scp', 'install']


def test_a_failed_setup_of_a_recreated_tpu_tries_again():
  """Setup worked on the first TPU; on the recreated one it fails (a PyPI
  hiccup) while the TPU is READY: `up` tries again (one restart) instead
  of ending the run's resumption and deleting the TPU."""
  installs = iter([False, True])
  runner = FakeRunner(
      states=['PREEMPTED', 'READY'], streams=[[None], [0]],
      fail=lambda argv: kind(argv) == 'install' and next(installs, False))
  assert _up(runner) == 0
  out = runner.out.getvalue()
  assert 'setting up the recreated vit failed' in out
  kinds = [kind(c) for c in runner.calls]
  assert kinds.count('create') == 3 and kinds.count('run') == 2
  assert 'restart 2/5' in out


def test_preemption_during_setup_recreates():
  fails = iter([True])
  runner = FakeRunner(
      states=['PREEMPTED'], streams=[[0]],
      fail=lambda argv: kind(argv) == 'install' and next(fails, False))
  assert _up(runner) == 0
  assert [kind(c) for c in runner.calls] == (
      LAUNCH[:4] + ['describe', 'delete'] + RELAUNCH + ['logs', 'delete'])


def test_no_capacity_to_recreate_is_retried_as_a_restart():
  """After a preemption the create can fail for want of capacity: the
  next restart tries again; the deletes of a TPU that is gone pass."""
  creates = iter([False, True])  # The recreate fails once.
  runner = FakeRunner(
      states=['PREEMPTED'], streams=[[None], [0]],
      fail=lambda argv: (kind(argv) == 'create' and next(creates, False)
                         and 'RESOURCE_EXHAUSTED: no capacity') or (
                             kind(argv) == 'delete' and 'NOT_FOUND'))
  assert _up(runner) == 0
  assert [kind(c) for c in runner.calls] == (
      LAUNCH + ['logs', 'describe', 'delete', 'create', 'delete'] + RELAUNCH +
      ['logs', 'delete'])
  out = runner.out.getvalue()
  assert 'recreating vit failed' in out and 'RESOURCE_EXHAUSTED' in out
  assert 'restart 2/5' in out and 'vit was already gone' in out
  assert 'trying to recreate vit again in 0 s (1 failed' in out


class GitRunner(FakeRunner):
  """FakeRunner whose `git ls-remote` answers `refs` (a str)."""

  def __init__(self, refs, **kw):
    super().__init__(**kw)
    self.refs = refs

  def _call(self, argv, capture):
    if 'ls-remote' in argv:
      self.calls.append(argv)
      return Result(0, self.refs) if self.refs else Result(
          128, '', 'fatal: could not read Username')
    return super()._call(argv, capture)


SHA = 'b' * 40


def test_up_pins_a_git_branch_to_its_commit_for_every_tpu(monkeypatch):
  """`--repo=URL#v1` is resolved once: the TPU recreated after a
  preemption installs the commit the run started with, not a branch that
  moved on."""
  runner = GitRunner(f'{"a" * 40}\trefs/heads/feature/v1\n'
                     f'{SHA}\trefs/heads/v1\n',
                     states=['PREEMPTED', 'READY'],
                     streams=[[None], [None, 0]])
  assert _up(runner, '--repo=https://github.com/me/vit.git#v1') == 0
  assert runner.calls[0][-4:] == ['git', 'ls-remote',
                                 'https://github.com/me/vit.git', 'v1']
  assert 'GIT_TERMINAL_PROMPT=0' in runner.calls[0]  # Never a prompt.
  installs = [c for c in runner.calls if kind(c) == 'install']
  assert len(installs) == 2
  for argv in installs:
    assert f'checkout -q {SHA}' in argv[-1] or any(
        f'checkout -q {SHA}' in a for a in argv)
  assert f'v1 of https://github.com/me/vit.git is {SHA}' in (
      runner.out.getvalue())
  # No ref: HEAD's commit. A commit already: nothing to resolve.
  runner = GitRunner(f'{SHA}\tHEAD\n', states=['READY'], streams=[[0]])
  assert _up(runner, '--repo=https://github.com/me/vit.git') == 0
  assert any(f'checkout -q {SHA}' in a for c in runner.calls for a in c)
  for commit in (SHA, '1a2b3c4', SHA.upper()):  # Short or upper case too.
    runner = GitRunner('', states=['READY'], streams=[[0]])
    assert _up(runner, f'--repo=https://github.com/me/vit.git#{commit}') == 0
    assert not any('ls-remote' in c for c in runner.calls)
    assert 'could not resolve' not in runner.out.getvalue()
  monkeypatch.setenv('GIT_SSH_COMMAND', 'ssh -i ~/.ssh/deploy')  # Kept.
  runner = GitRunner(f'{SHA}\trefs/heads/v1\n', states=['READY'],
                     streams=[[0]])
  assert _up(runner, '--repo=git@github.com:me/vit.git#v1') == 0
  assert ('GIT_SSH_COMMAND=ssh -i ~/.ssh/deploy -o BatchMode=yes'
          in runner.calls[0])
  monkeypatch.delenv('GIT_SSH_COMMAND')


def test_an_unresolvable_git_ref_warns_and_is_cloned_as_given():
  runner = GitRunner('', states=['READY'], streams=[[0]])
  assert _up(runner, '--repo=https://github.com/me/vit.git#v1') == 0
  out = runner.out.getvalue()
  assert 'could not resolve v1' in out and 'could not read Username' in out
  assert 'pin a commit, --repo=URL#<sha>' in out
  assert any('checkout -q v1' in a for c in runner.calls for a in c)


def test_failed_recreations_back_off(monkeypatch):
  """Capacity short after a preemption can take hours to return: failed
  recreations in a row wait --poll-seconds, doubled each time up to 30
  minutes, not one poll each (which would use up --max-restarts in
  minutes); a TPU that comes back resets the wait."""
  slept = []
  monkeypatch.setattr(tpu.time, 'sleep', slept.append)
  creates = iter([False, True, True, True, False, True])
  runner = FakeRunner(
      states=['PREEMPTED', 'PREEMPTED'], streams=[[None], [None], [0]],
      fail=lambda argv: (kind(argv) == 'create' and next(creates, False)
                         and 'RESOURCE_EXHAUSTED: no capacity') or (
                             kind(argv) == 'delete' and 'NOT_FOUND'))
  assert tpu.main(UP + ['--topology=v3-32', '--spot', '--yes',
                        '--poll-seconds=600', '--max-restarts=9'],
                  runner=runner) == 0
  waits = [s for s in slept if s >= 600 and s != tpu.LOCK_STALE_S]
  assert waits == [600, 1200, 1800, 600], slept
  assert [tpu._recreate_wait(argparse.Namespace(poll_seconds=60), k)
          for k in range(1, 8)] == [60, 120, 240, 480, 960, 1800, 1800]


def test_setup_tries_ssh_again_on_a_new_tpu():
  """ssh's own failures (255) are tried again, the copy of the archive
  together with its unpacking and install; the archive is packed once."""
  failures = {'install': iter([255, 255]), 'scp': iter([255])}
  runner = FakeRunner(streams=[[0]])
  calls = runner._call

  def call(argv, capture):
    code = next(failures.get(kind(argv), iter([])), 0)
    if code:
      runner.calls.append(argv)
      return Result(code, '', 'Connection refused')
    return calls(argv, capture)
  runner._call = call
  assert _up(runner) == 0
  kinds = [kind(c) for c in runner.calls]
  assert kinds[:9] == ['create', 'pack', 'scp', 'scp', 'install', 'scp',
                       'install', 'scp', 'install']
  assert runner.out.getvalue().count('ssh failed (exit 255)') == 3


def test_delete_of_a_missing_tpu_is_an_error(capsys):
  """By hand a NOT_FOUND is likely a wrong name or zone (the TPU may still
  run); only `up`'s own clean-up takes it as already gone."""
  runner = FakeRunner(fail=lambda argv: kind(argv) == 'delete' and (
      'NOT_FOUND: projects/p/locations/z/nodes/vit'))
  assert tpu.main(['delete', '--name=vit', '--zone=z', '--yes'],
                  runner=runner) == 1
  assert 'NOT_FOUND' in capsys.readouterr().err


def test_too_many_preemptions_give_up_and_delete():
  runner = FakeRunner(states=['PREEMPTED'] * 3, streams=[[None]] * 3)
  assert _up(runner, '--max-restarts=2') == 1
  assert [kind(c) for c in runner.calls].count('create') == 3
  assert kind(runner.calls[-1]) == 'delete'
  assert 'giving up' in runner.out.getvalue()


def test_failed_run_copies_results_and_deletes():
  runner = FakeRunner(states=['READY'], streams=[[1]], runs=['exited 1'])
  assert _up(runner, '--results=../out') == 1
  assert [kind(c) for c in runner.calls][-8:] == [
      'logs', 'describe', 'run state', 'run state', 'save logs', 'mkdir',
      'storage cp', 'delete']
  save = runner.calls[-4]
  assert save[-2] == '--worker=all' and 'gs://b/run/logs' in save[-1]
  out = runner.out.getvalue()
  assert 'the run failed (exit 1; TPU READY)' in out
  assert "every worker's log: gs://b/run/logs/" in out


def test_a_failed_run_names_the_worker_that_failed_first():
  """On a slice one worker's error (say, host memory) makes the others fail
  later, when their collectives lose it: the first is where the cause is,
  and it is seldom worker 0, whose log was streamed."""
  workers = (
      'Using ssh batch size of 1. Attempting to SSH into 1 nodes\n'
      't1v-n-1-w-0: exited 1 at 2026-11-28T10:04:41Z | jax.errors.'
      'JaxRuntimeError: UNAVAILABLE: task 2 heartbeat timeout\n'
      't1v-n-1-w-1: running | step 4000\n'
      't1v-n-1-w-2: exited 137 at 2026-11-28T10:02:57Z | Killed\n'
      't1v-n-1-w-3: exited 1 at 2026-11-28T10:04:40Z | same error\n')
  runner = FakeRunner(states=['READY'], streams=[[1]], runs=['exited 1'],
                      workers=workers, idle='')
  assert _up(runner) == 1
  out = runner.out.getvalue()
  assert ('first to fail: t1v-n-1-w-2, exit 137 at 2026-11-28T10:02:57Z; '
          'its last log line: Killed; failed after it: t1v-n-1-w-3, '
          't1v-n-1-w-0; still running: t1v-n-1-w-1') in out
  # Named before the TPU and its workers' logs go.
  assert out.index('first to fail') < out.index('every worker\'s log')


def test_logs_of_a_failed_run_name_the_worker_that_failed_first():
  class Stream(FakeRunner):
    def _call(self, argv, capture):
      if kind(argv) == 'logs':
        self.calls.append(argv)
        return Result(1)
      return super()._call(argv, capture)

  runner = Stream(workers='w-0: exited 1 at 2026-11-28T10:04:41Z | x\n'
                          'w-1: exited 1 at 2026-11-28T10:01:00Z | y\n')
  assert tpu.main(['logs', '--name=vit', '--zone=z'], runner=runner) == 1
  assert 'first to fail: w-1, exit 1 at 2026-11-28T10:01:00Z; its last ' \
         'log line: y; failed after it: w-0' in runner.out.getvalue()


def test_a_run_whose_log_stays_idle_fails_as_hung(monkeypatch):
  """A slice waiting forever (a collective missing a peer that neither died
  nor answers) bills every chip: after --hang-minutes without a log line
  on worker 0, `up` names it, saves the logs and deletes the TPU."""
  monkeypatch.setattr(tpu, 'HANG_CHECK_S', 0.0)
  runner = FakeRunner(
      states=['READY'] * 3, streams=[[None]],
      runs=['running, log idle 600s', 'running, log idle 3660s'],
      workers='w-0: running, log idle 3670s | step 10\n'
              'w-1: running, log idle 4210s | reading shard 17\n', idle='')
  assert _up(runner, '--hang-minutes=60') == 1
  kinds = [kind(c) for c in runner.calls]
  assert kinds[-8:] == ['logs', 'describe', 'run state', 'describe',
                        'run state', 'run state', 'save logs', 'delete']
  assert runner.processes[-1].stopped
  out = runner.out.getvalue()
  assert ("worker 0's log has not grown for 61 minutes (--hang-minutes=60; "
          'its last line: step 10): the run is taken as hung') in out
  assert ("no worker's run failed; the longest silent log: w-1's, 70 "
          'minutes; its last line: reading shard 17') in out


def test_hang_minutes_0_never_asks(monkeypatch):
  monkeypatch.setattr(tpu, 'HANG_CHECK_S', 0.0)
  runner = FakeRunner(states=['READY'] * 3, streams=[[None, None, 0]],
                      runs=['running, log idle 99999s'] * 3)
  assert _up(runner, '--hang-minutes=0') == 0
  kinds = [kind(c) for c in runner.calls]
  assert 'run state' not in kinds[kinds.index('logs'):]


def test_lost_connection_reattaches():
  runner = FakeRunner(states=['READY'], streams=[[255], [0]])
  assert _up(runner, '--keep') == 0
  assert [kind(c) for c in runner.calls][-4:] == [
      'logs', 'describe', 'run state', 'logs']
  # The first stream shows the log from its start; a reattach its last
  # lines only (not days of a run's output again).
  first, again = (next(a for a in c if a.startswith('--command='))
                  for c in runner.calls if kind(c) == 'logs')
  assert 'tail -n +1 ' in first and (
      f'tail -n {commands.REATTACH_LINES} ' in again)


def test_a_broken_log_stream_never_deletes_a_running_run():
  """gcloud's own failure (exit 1, e.g. a token refresh) ends the stream
  while the run goes on: reattach, as often as worker 0 says it runs."""
  runner = FakeRunner(states=['READY'] * 5, streams=[[1]] * 5 + [[0]],
                      runs=['running'] * 5)
  assert _up(runner) == 0
  kinds = [kind(c) for c in runner.calls]
  assert kinds.count('logs') == 6 and kinds[-2:] == ['logs', 'delete']
  assert 'run failed' not in runner.out.getvalue()


def test_worker_0_silent_for_long_fails():
  runner = FakeRunner(states=['READY'] * 4, streams=[[1]] * 4)
  assert _up(runner) == 1
  assert [kind(c) for c in runner.calls].count('logs') == 4
  assert 'did not answer 4 times in a row' in runner.out.getvalue()


@pytest.mark.parametrize('flag', ['--spot', '--preemptible'])
def test_up_that_may_recreate_refuses_a_workdir_on_the_worker(flag, capsys):
  runner = FakeRunner()
  argv = ['up', '--name=vit', '--zone=us-central2-b', f'--config={B16}',
          '--workdir=/home/me/run', '--topology=v3-8', flag, '--yes']
  assert tpu.main(argv, runner=runner) == 2
  assert runner.calls == []
  assert 'start again from step 0; use a gs:// --workdir' in (
      capsys.readouterr().err)


def test_relative_workdir_on_a_tpu_is_refused(capsys):
  runner = FakeRunner()
  argv = ['run', '--name=vit', '--zone=us-central2-b', f'--config={B16}',
          '--workdir=runs/a', '--topology=v3-8', '--yes']
  assert tpu.main(argv, runner=runner) == 2
  assert runner.calls == []
  assert '--workdir=runs/a is relative' in capsys.readouterr().err


def test_missing_gcloud_is_named(monkeypatch, capsys):
  monkeypatch.setenv('PATH', '/nonexistent')
  assert tpu.main(['status', '--name=vit', '--zone=z']) == 1
  err = capsys.readouterr().err
  assert 'gcloud not found on PATH: install the Google Cloud CLI' in err


def test_failed_create_deletes_nothing(capsys):
  runner = FakeRunner(fail=lambda argv: kind(argv) == 'create')
  assert _up(runner) == 1
  assert [kind(c) for c in runner.calls] == ['create']
  assert 'command failed' in capsys.readouterr().err


def test_failed_queued_resource_is_deleted(capsys):
  runner = FakeRunner(states=['WAITING_FOR_RESOURCES', 'FAILED'])
  assert _up(runner, '--queued') == 1
  assert [kind(c) for c in runner.calls] == [
      'create', 'describe', 'describe', 'delete']
  assert 'queued resource vit is FAILED' in capsys.readouterr().err


def test_queued_wait_stops_when_describe_keeps_failing(capsys):
  runner = FakeRunner()
  calls = runner._call

  def call(argv, capture):  # describe fails here (the fake answers states).
    if 'queued-resources' in argv and 'describe' in argv:
      runner.calls.append(argv)
      return Result(1, '', 'PERMISSION_DENIED: tpu.queuedResources.get')
    return calls(argv, capture)
  runner._call = call
  assert _up(runner, '--queued') == 1
  assert [kind(c) for c in runner.calls] == ['create'] + ['describe'] * 5 + [
      'delete']
  assert 'PERMISSION_DENIED' in capsys.readouterr().err


def test_queued_waits_for_active():
  runner = FakeRunner(states=['ACCEPTED', 'PROVISIONING', 'ACTIVE'],
                      streams=[[0]])
  assert _up(runner, '--queued') == 0
  assert [kind(c) for c in runner.calls][:4] == [
      'create', 'describe', 'describe', 'describe']
  assert runner.calls[1][3] == 'queued-resources'


# --------------------------------------------------------------------------
# The worker-side shell, run for real against a fake home directory.


def _wait_for(ready, what='the run to start', seconds=30.0):
  """`ready()`'s first truthy value, polled; fails after `seconds`."""
  deadline = time.monotonic() + seconds
  while not (value := ready()):
    assert time.monotonic() < deadline, f'waited {seconds:g} s for {what}'
    time.sleep(0.02)
  return value


# Tries of a race whose window is narrow: the old wrapper lost ~1 in 30
# under load (2 cores busy), fewer when idle.
RACE_TRIES = 150


def _ended(env):
  """The run's exit status once `status` says it has ended, else None."""
  (run,) = commands.parse_status(subprocess.run(
      ['bash', '-c', commands.status_script()], env=env, text=True,
      capture_output=True, timeout=60).stdout)
  return run.exit_code if run.state != 'running' else None


def _worker_home(tmp_path, python_script: str):
  """(home, env): a fake worker home whose environment's python is
  `python_script` (a shell script standing in for the run)."""
  home = tmp_path / 'home'
  (home / 'vit_jax_env' / 'bin').mkdir(parents=True)
  (home / 'vit_jax').mkdir()
  python = home / 'vit_jax_env' / 'bin' / 'python'
  python.write_text(python_script)
  python.chmod(0o755)
  return home, dict(os.environ, HOME=str(home))


def test_worker_scripts(tmp_path):
  home, env = _worker_home(
      # Runs for 4 s: the checks below made while it runs take up to ~1 s
      # on a loaded machine.
      tmp_path, '#!/bin/sh\necho "ran $@ in $(pwd) with $RUN_ENV"\n'
      'sleep 4\nexit 3\n')

  def sh(script):
    return subprocess.run(['bash', '-c', script], env=env, text=True,
                          capture_output=True, timeout=60)

  run = commands.run_script(['--config=c.py:a=1', '--workdir=gs://b/r'],
                            {'RUN_ENV': 'x y'})
  assert sh(run).returncode == 0
  second = sh(run)  # Refused while the first one runs.
  assert second.returncode == 1 and 'still going' in second.stdout
  (going,) = commands.parse_status(sh(commands.status_script()).stdout)
  assert going.state == 'running' and 0 <= going.log_idle_s < 30
  for setup in (commands.install_script(archive=commands.ARCHIVE),
                commands.install_script()):
    busy = sh(setup)  # Setup would replace the running run's code.
    assert busy.returncode == 1 and 'still going' in busy.stdout
  assert (home / 'vit_jax').is_dir() and (
      home / 'vit_jax_env' / 'bin' / 'python').exists()
  logs = sh(commands.logs_script())
  assert logs.returncode == 3  # The run's exit status.
  assert (f'ran -m vit_jax.main --config=c.py:a=1 --workdir=gs://b/r in '
          f'{home}/vit_jax with x y') in logs.stdout
  # A reattach starts from the last lines, not the whole log again.
  with open(home / 'vit_jax_run.log', 'a') as f:
    f.write('line 1\nline 2\nline 3\n')
  last = sh(commands.logs_script(last=2))
  assert last.returncode == 3 and last.stdout.splitlines() == [
      'line 2', 'line 3']
  (status,) = commands.parse_status(sh(commands.status_script()).stdout)
  assert (status.host, status.state, status.exit_code) == (
      socket.gethostname(), 'exited 3', 3)
  assert re.fullmatch(r'\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ', status.ended)
  wd = tmp_path / 'work dir'  # Before a failed run's TPU goes.
  assert sh(commands.save_logs_script(str(wd))).returncode == 0
  (saved,) = (wd / 'logs').iterdir()
  assert saved.name == socket.gethostname() + '.log'
  assert 'ran -m vit_jax.main' in saved.read_text()
  out = sh(commands.exec_script(['python', 'a;', 'echo', '$PWD'])).stdout
  assert out.splitlines()[0].startswith('ran a in')
  assert out.splitlines()[-1] == f'{home}/vit_jax'
  # docs/tpu.md's background exec: returns at once (the ssh session ends).
  start = time.monotonic()
  sh(commands.exec_script(['nohup python b > b.log 2>&1 < /dev/null &']))
  assert time.monotonic() - start < 1.5
  time.sleep(0.5)
  assert (home / 'vit_jax' / 'b.log').read_text().startswith('ran b in')


def test_a_run_sigterm_saves_and_its_exit_status_is_kept(tmp_path):
  """A VM shutting down (a preemption) signals every process, `pkill -f
  vit_jax.main` the wrapper shell too: the wrapper passes SIGTERM on and
  outlives the run's save, so the guard refuses a second run meanwhile,
  and the exit status (75: resume) is kept for `up`. Killed by a signal,
  the run's status is 128 + N."""
  home, env = _worker_home(  # Saves for 3 s on SIGTERM, exits 75.
      tmp_path, '#!/bin/sh\ntrap \'trap "" TERM; echo saving; sleep 3; '
      'echo saved; exit 75\' TERM\necho started\nwhile :; do sleep 0.05; '
      'done\n')

  def sh(script, **kw):
    return subprocess.run(['bash', '-c', script], env=env, text=True,
                          capture_output=True, timeout=60, **kw)

  groups = []

  def start():  # In a process group of its own, as an ssh session.
    assert sh(commands.run_script(['--workdir=/w'], {}),
              start_new_session=True).returncode == 0
    wrapper = int((home / 'vit_jax_run.pid').read_text())
    groups.append(os.getpgid(wrapper))
    _wait_for(lambda: 'started' in (home / 'vit_jax_run.log').read_text())
    return wrapper

  def exit_status():  # Once the wrapper has ended, as `status` says.
    return _wait_for(lambda: _ended(env), what='the wrapper to end')

  try:
    os.killpg(os.getpgid(start()), signal.SIGTERM)  # Every process.
    time.sleep(0.3)
    second = sh(commands.run_script(['--workdir=/w'], {}))
    assert second.returncode == 1 and 'still going' in second.stdout
    (saving,) = commands.parse_status(sh(commands.status_script()).stdout)
    assert saving.state == 'running'
    logs = sh(commands.logs_script())
    assert logs.returncode == EXIT_PREEMPTED and 'saved' in logs.stdout
    assert exit_status() == EXIT_PREEMPTED
    os.kill(start(), signal.SIGTERM)  # `kill PID` of the wrapper alone.
    assert exit_status() == EXIT_PREEMPTED
    wrapper = start()
    (run,) = subprocess.run(['pgrep', '-P', str(wrapper)], text=True,
                            capture_output=True).stdout.split()
    os.kill(int(run), signal.SIGKILL)  # Say, the kernel's OOM killer.
    assert exit_status() == 128 + signal.SIGKILL
  finally:  # Nothing left running, whatever failed.
    for group in groups:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)


def test_a_sigterm_as_the_run_starts_is_passed_on(tmp_path):
  """A SIGTERM that reaches the wrapper just after it started Python, before
  it knew Python's pid, still reaches Python (it was lost: the wrapper then
  waited forever on a run that never heard of it, and held the TPU). The
  window is narrow, so the wrapper is signalled as soon as the run prints,
  many times; each run must end with its saved status."""
  for i in range(RACE_TRIES):
    home, env = _worker_home(
        tmp_path / str(i), '#!/bin/sh\ntrap \'trap "" TERM; exit 75\' '
        'TERM\necho started\nwhile :; do sleep 0.05; done\n')
    log, exit_file = home / 'vit_jax_run.log', home / 'vit_jax_run.exit'
    subprocess.run(['bash', '-c', commands.run_script(['--workdir=/w'], {})],
                   env=env, check=True, timeout=60, start_new_session=True)
    wrapper = int((home / 'vit_jax_run.pid').read_text())
    try:
      _wait_for(lambda: log.exists() and 'started' in log.read_text())
      os.kill(wrapper, signal.SIGTERM)
      _wait_for(lambda: exit_file.exists() and exit_file.read_text(),
                what=f'the run to save and exit (try {i})', seconds=10)
      assert exit_file.read_text().strip() == str(EXIT_PREEMPTED)
    finally:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(os.getpgid(wrapper), signal.SIGKILL)


def test_a_run_sigterm_before_python_can_save_is_kept_as_143(tmp_path):
  """A SIGTERM that makes the run fail otherwise (exit 1 from an error it
  caused while starting) is recorded as 143, stopped by SIGTERM, which
  `up` resumes; its own status is said in the log."""
  home, env = _worker_home(
      tmp_path, '#!/bin/sh\ntrap \'echo broken; exit 1\' TERM\n'
      'echo started\nwhile :; do sleep 0.05; done\n')
  subprocess.run(['bash', '-c', commands.run_script(['--workdir=/w'], {})],
                 env=env, check=True, timeout=60, start_new_session=True)
  wrapper = int((home / 'vit_jax_run.pid').read_text())
  log = home / 'vit_jax_run.log'
  try:
    _wait_for(lambda: log.exists() and 'started' in log.read_text())
    os.kill(wrapper, signal.SIGTERM)
    _wait_for((home / 'vit_jax_run.exit').exists, what='the exit status')
    time.sleep(0.1)
    assert (home / 'vit_jax_run.exit').read_text().strip() == '143'
    assert 'exit 1 after a SIGTERM: recorded as 143' in log.read_text()
  finally:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(os.getpgid(wrapper), signal.SIGKILL)


def _sigterm_caught(pid: int) -> bool:
  """Whether process `pid` has a handler for SIGTERM (Linux /proc)."""
  with open(f'/proc/{pid}/status') as f:
    caught = next(line for line in f if line.startswith('SigCgt:'))
  return bool(int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


@pytest.mark.skipif(not sys.platform.startswith('linux'),
                    reason='reads /proc')
def test_vit_jax_main_stopped_by_sigterm_while_starting_exits_75(tmp_path):
  """A SIGTERM while vit_jax.main starts (its imports; on a pod also
  jax.distributed), before it can save anything: exit 75, which launchers
  resume, not death by the signal (143)."""
  env = dict(os.environ, VIT_JAX_HUGE_PAGES='0')  # No re-exec meanwhile.
  p = subprocess.Popen([sys.executable, '-m', 'vit_jax.main',
                        f'--config={SMOKE}', f'--workdir={tmp_path}'],
                       cwd=ROOT, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 60
    while not _sigterm_caught(p.pid):  # Its handler, first thing.
      assert p.poll() is None and time.monotonic() < deadline
      time.sleep(0.005)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
  finally:
    p.kill()
  assert p.returncode == EXIT_PREEMPTED, err
  assert ('stopped by SIGTERM outside training steps; nothing to save; '
          'exit 75 (restart)') in err


def test_a_sigterm_as_a_finished_run_exits_keeps_its_status(tmp_path):
  """A SIGTERM while a finished run's process unloads its modules (seconds
  with JAX and TensorFlow; Python has put the default action back by then)
  killed it with -15: launchers recorded 143 and resumed a finished run.
  Past `preemption.ignore_sigterm_once_done` it exits with its own status."""
  script = tmp_path / 'done.py'
  script.write_text(
      'import os, signal, sys, time\n'
      'from vit_jax import main\n'
      'from vit_jax.train import preemption\n'
      'signal.signal(signal.SIGTERM, main._stop_outside_training)\n'
      'if sys.argv[1] == "done":\n'
      '  preemption.ignore_sigterm_once_done()\n'
      'class Unloading:  # Slow to unload, as JAX and TensorFlow are.\n'
      '  def __del__(self):\n'
      '    print("unloading", flush=True)\n'
      '    time.sleep(3)\n'
      'modules = Unloading()\n')
  for done, status in (('done', 0), ('not', -signal.SIGTERM)):
    p = subprocess.Popen([sys.executable, str(script), done], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True)
    try:
      assert p.stdout.readline() == 'unloading\n'
      p.send_signal(signal.SIGTERM)
      p.communicate(timeout=60)
    finally:
      p.kill()
    assert p.returncode == status, done


def test_setup_packs_what_git_would_commit_and_unpacks_it(tmp_path):
  """`setup` copies an archive of the checkout, not the folder: tracked and
  untracked-but-not-ignored files, links as links; `.git`, ignored files
  (workdirs, environments) and deleted tracked files stay behind. The
  worker-side unpacking replaces ~/vit_jax with it."""
  from vit_jax.launch import pack
  repo = tmp_path / 'repo'
  (repo / 'configs').mkdir(parents=True)
  (repo / 'pkg').mkdir()
  for name in ('setup.py', 'configs/a.py', 'gone.py', 'new.py',
               '.gitignore'):
    (repo / name).write_text('workdirs/\n.venv/\n' if name == '.gitignore'
                             else name)
  os.symlink('../configs', repo / 'pkg' / 'configs')
  git = ['git', '-C', str(repo), '-c', 'user.name=t', '-c', 'user.email=t@t']
  subprocess.run(git + ['init', '-q'], check=True)
  subprocess.run(git + ['add', 'setup.py', 'configs', 'gone.py', 'pkg',
                        '.gitignore'], check=True)
  subprocess.run(git + ['commit', '-qm', 'x'], check=True)
  (repo / 'gone.py').unlink()
  for ignored in ('workdirs/run/ckpt', '.venv/bin/python'):
    (repo / ignored).parent.mkdir(parents=True)
    (repo / ignored).write_text('big')
  assert pack.files(str(repo)) == ['.gitignore', 'configs/a.py', 'new.py',
                                   'pkg/configs', 'setup.py']
  # A nested repository (or a submodule): git lists one path; its files
  # go by the same rule inside it, not an empty folder.
  nested = repo / 'third_party' / 'lib'
  nested.mkdir(parents=True)
  (nested / 'lib.py').write_text('x')
  (nested / '.gitignore').write_text('build/\n')
  (nested / 'build').mkdir()
  (nested / 'build' / 'big.o').write_text('x')
  subprocess.run(['git', '-C', str(nested), 'init', '-q'], check=True)
  assert [f for f in pack.files(str(repo)) if f.startswith('third_party')] == [
      'third_party/lib/.gitignore', 'third_party/lib/lib.py']
  shutil.rmtree(repo / 'third_party')
  home = tmp_path / 'home'
  (home / 'vit_jax' / 'stale').mkdir(parents=True)  # A previous setup's.
  code = subprocess.run(
      [sys.executable, '-m', 'vit_jax.launch.pack', str(repo),
       str(home / commands.ARCHIVE)], capture_output=True, text=True)
  assert code.returncode == 0 and 'packed 5 files' in code.stdout
  script = commands.install_script(archive=commands.ARCHIVE)
  unpack, sep, _ = script.partition(' && cd $HOME/vit_jax && ')
  assert sep  # The steps before the install proper.
  subprocess.run(['bash', '-c', unpack], check=True,
                 env=dict(os.environ, HOME=str(home)))
  got = home / 'vit_jax'
  assert sorted(str(p.relative_to(got)) for p in got.rglob('*')) == [
      '.gitignore', 'configs', 'configs/a.py', 'new.py', 'pkg',
      'pkg/configs', 'setup.py']
  assert os.readlink(got / 'pkg' / 'configs') == '../configs'
  # Outside git: everything but .git and __pycache__.
  shutil.rmtree(repo / '.git')
  (repo / '__pycache__').mkdir()
  (repo / '__pycache__' / 'x.pyc').write_text('')
  assert '.venv/bin/python' in pack.files(str(repo))
  assert not any('__pycache__' in f for f in pack.files(str(repo)))
  # A checkout whose setup.py git ignores cannot be installed: said so.
  bad = tmp_path / 'bad'
  bad.mkdir()
  code = subprocess.run([sys.executable, '-m', 'vit_jax.launch.pack',
                         str(bad), str(tmp_path / 'x.tar.gz')],
                        capture_output=True, text=True)
  assert code.returncode == 1 and 'setup.py is not among' in code.stderr


def test_a_project_inside_a_larger_repository_is_packed_by_git(tmp_path):
  """A checkout in a monorepo's subfolder has no .git of its own: git's
  rules (its .gitignore, the monorepo's) still keep its environment and
  workdirs out, and the paths are the project's own."""
  from vit_jax.launch import pack
  mono = tmp_path / 'mono'
  proj = mono / 'sub' / 'proj'
  proj.mkdir(parents=True)
  subprocess.run(['git', '-C', str(mono), 'init', '-q'], check=True)
  (mono / 'top.py').write_text('')
  (proj / 'setup.py').write_text('')
  (proj / '.gitignore').write_text('workdirs/\n.venv/\n')
  for ignored in ('workdirs/run/ckpt', '.venv/bin/python'):
    (proj / ignored).parent.mkdir(parents=True)
    (proj / ignored).write_text('big')
  subprocess.run(['git', '-C', str(mono), 'add', 'sub/proj/setup.py'],
                 check=True)
  (proj / 'new.py').write_text('')
  assert pack.files(str(proj)) == ['.gitignore', 'new.py', 'setup.py']


def test_a_git_failure_while_packing_says_what_git_said(tmp_path):
  """`git ls-files` refusing the checkout ("detected dubious ownership",
  a broken .git): its own message, which names the fix, is shown."""
  from vit_jax.launch import pack
  repo = tmp_path / 'repo'
  repo.mkdir()
  (repo / 'setup.py').write_text('')
  (repo / '.git').write_text('not a git file\n')
  with pytest.raises(ValueError, match=r'ls-files .* failed \(exit 128\): '
                     'fatal: invalid gitfile format'):
    pack.files(str(repo))
  p = subprocess.run([sys.executable, '-m', 'vit_jax.launch.pack', str(repo),
                      str(tmp_path / 'x.tar.gz')], capture_output=True,
                     text=True)
  assert p.returncode == 1 and 'invalid gitfile format' in p.stderr


# --------------------------------------------------------------------------
# --local-processes.


def test_local_processes_dry_run(monkeypatch, tmp_path):
  """The printed script runs as it is, pasted anywhere: it makes the log
  folder and goes to the folder the command was typed in first (here the
  checkout; with a fake python)."""
  python = tmp_path / 'python'
  python.write_text('#!/bin/sh\necho "$PWD $A $*" >> "$RECORD"\n')
  python.chmod(0o755)
  monkeypatch.setattr(sys, 'executable', str(python))
  monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path / 'tmp'))
  code, lines = dry(['run', '--local-processes=2', f'--config={SMOKE}',
                     '--workdir=rel/dir', '--env', 'A=b'])
  assert code == 0
  log_dir = str(tmp_path / 'tmp' / 'vit_jax_local')
  mkdir, cd, background, foreground = gcloud_lines(lines)
  assert mkdir == ['mkdir', '-p', log_dir] and cd == ['cd', ROOT]
  log = os.path.join(log_dir, 'process_1.log')
  assert background[-4:] == ['>', log, '2>&1', '&']
  port = re.search(r'--coordinator=127\.0\.0\.1:(\d+)', lines[-1]).group(1)
  for cmd, i in ((background[:-4], 1), (foreground, 0)):
    assert cmd == ['env', 'JAX_PLATFORMS=cpu', 'A=b', str(python), '-m',
                   'vit_jax.main', f'--config={ROOT}/{SMOKE}',
                   f'--workdir={ROOT}/rel/dir',
                   f'--coordinator=127.0.0.1:{port}', '--num_processes=2',
                   f'--process_id={i}']
  record = tmp_path / 'record'
  subprocess.run(['bash', '-e'], input='\n'.join(lines + ['wait']),
                 text=True, check=True, cwd=tmp_path, timeout=30,
                 env=dict(os.environ, RECORD=str(record)))
  ran = sorted(record.read_text().splitlines())
  assert [r.split()[0] for r in ran] == [ROOT, ROOT]
  assert [r.split()[-1] for r in ran] == ['--process_id=0', '--process_id=1']
  assert os.path.exists(log)


def test_local_processes_refuse_the_flags_of_a_tpu(capsys):
  """No TPU to name, watch or recreate: its flags are refused, named, even
  given as their defaults (--poll-seconds=60) or as 0, not ignored."""
  runner = FakeRunner()
  with pytest.raises(SystemExit) as e:
    tpu.main(['up', '--local-processes=2', f'--config={SMOKE}',
              '--workdir=/tmp/w', '--name=vit', '--zone=z', '--project=p',
              '--worker=0', '--poll-seconds=60', '--hang-minutes=0'],
             runner=runner)
  assert e.value.code == 2 and runner.calls == []
  assert ('--name, --zone, --project, --worker, --poll-seconds, '
          '--hang-minutes with --local-processes') in capsys.readouterr().err


def test_a_local_workdir_follows_vit_jax_mains_rule(monkeypatch, tmp_path,
                                                    capsys):
  """`--workdir=$UNSET` is refused (as vit_jax.main refuses it), not taken
  as this folder; `--workdir=~/run` is the home's run, not <cwd>/~/run."""
  with pytest.raises(SystemExit) as e:
    dry(['run', '--local-processes=2', f'--config={SMOKE}', '--workdir='])
  assert e.value.code == 2
  assert '--workdir is empty (an unset shell variable?)' in (
      capsys.readouterr().err)
  monkeypatch.setenv('HOME', str(tmp_path))
  code, lines = dry(['run', '--local-processes=2', f'--config={SMOKE}',
                     '--workdir=~/run'])
  assert code == 0
  assert f' --workdir={tmp_path}/run ' in lines[-1]


def test_an_installed_launcher_works_outside_its_package(monkeypatch,
                                                         tmp_path, capsys):
  """Installed (not editable), ROOT is site-packages/vit_jax: no checkout
  for `setup` to copy (the error names --repo), and no folder for local
  processes to run in (its inspect/ hides the standard library's: every
  process failed on import). They run where the command was typed, a
  --config relative to there included."""
  package = tmp_path / 'site' / 'vit_jax'
  package.mkdir(parents=True)
  monkeypatch.setattr(tpu, 'ROOT', str(package))
  monkeypatch.setitem(tpu.DEFAULTS, 'repo', str(package))
  runner = FakeRunner()
  assert tpu.main(UP + ['--topology=v4-8', '--yes'], runner=runner) == 2
  assert runner.calls == []
  assert (f'--repo={package}: no setup.py there (the default: where this '
          'launcher is installed, not a checkout); pass --repo=<your '
          'checkout of vit_jax>, or a git URL') in capsys.readouterr().err
  work = tmp_path / 'work'
  work.mkdir()
  shutil.copy(os.path.join(ROOT, 'configs', 'smoke.py'), work / 'exp.py')
  monkeypatch.chdir(work)
  code, lines = dry(['run', '--local-processes=2', '--config=exp.py:data='
                     'digits,steps=8,batch=32', '--workdir=run'])
  assert code == 0
  assert ['cd', str(work)] in gcloud_lines(lines)
  assert (f' --config={work}/exp.py:data=digits,steps=8,batch=32 '
          f'--workdir={work}/run ') in lines[-1]


def test_wait_all_stops_the_others_when_one_fails():
  waiting = FakeProcess([None])
  code = local._wait_all({0: waiting, 1: FakeProcess([7])}, poll_s=0,
                         grace_s=0)
  assert code == (1, 7) and waiting.stopped


class LoggingRunner(FakeRunner):
  """FakeRunner whose background processes write their logs, as real
  ones do."""

  def _spawn(self, argv, log, cwd):
    if log:
      with open(log, 'w') as f:
        f.write(f'process {argv[-1]} log\n')
    return super()._spawn(argv, log, cwd)


def test_local_exit_status_and_log_folder(monkeypatch, tmp_path):
  """A process killed by a signal gives 128 + N, as the shell (and the
  TPU workers' exit file) says: 137 for SIGKILL, not 247; its logs stay,
  and where is said. A run that ends well leaves no log folder behind."""
  monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))
  # Process 1 starts first: its stream is the first.
  runner = LoggingRunner(streams=[[-9], [None]])
  assert local.run(runner, 2, [], {}, cwd=ROOT, poll_s=0, grace_s=0) == 137
  (kept,) = tmp_path.iterdir()
  out = runner.out.getvalue()
  assert '# process 1 failed (exit 137)' in out
  assert f"# the processes' logs are kept in {kept}" in out
  assert runner.processes[1].stopped  # Process 0, which waited for it.
  shutil.rmtree(kept)
  runner = LoggingRunner(streams=[[0], [0]])
  assert local.run(runner, 2, [], {}, cwd=ROOT, poll_s=0) == 0
  assert not list(tmp_path.iterdir())


# A fake `python -m vit_jax.main ... --process_id=I`: on SIGTERM (or SIGINT)
# it saves for a second, then exits 75 (130); with $STUBBORN it ignores both.
FAKE_MAIN = r"""#!/bin/sh
for a; do id=${a#--process_id=}; done
save() { trap '' TERM INT; sleep 1; echo "$1" > "$MARK/saved_$id"; exit "$1"; }
if [ -n "$STUBBORN" ]; then trap '' TERM INT
else trap 'save 75' TERM; trap 'save 130' INT; fi
touch "$MARK/started_$id"
while :; do sleep 0.05; done
"""
# The launcher's `local.run` on the fake (sys.executable is what it starts).
LAUNCHER = """import signal, sys
# Ctrl-C reaches it as in a terminal, even where this test runs with SIGINT
# ignored (a background job of a non-interactive shell passes SIG_IGN on).
signal.signal(signal.SIGINT, signal.default_int_handler)
from vit_jax.launch import local
from vit_jax.launch.runner import Runner
sys.executable, mark, stubborn = sys.argv[1:]
sys.exit(local.run(Runner(), 2, [], {'MARK': mark, 'STUBBORN': stubborn},
                   cwd=mark, poll_s=0.05,
                   stop_grace_s=0.5 if stubborn else 20.0))
"""


def _fake_local_launch(tmp_path, tmp, stubborn, stdout):
  """`local.run` of 2 fake processes (FAKE_MAIN) in its own session, once
  both have started; their logs go to `tmp`."""
  fake = tmp_path / 'fake_python'
  fake.write_text(FAKE_MAIN)
  fake.chmod(0o755)
  launcher = subprocess.Popen(
      [sys.executable, '-c', LAUNCHER, str(fake), str(tmp_path), stubborn],
      stdout=stdout, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
      env=dict(os.environ, TMPDIR=str(tmp)), start_new_session=True)
  deadline = time.monotonic() + 30
  while not all((tmp_path / f'started_{i}').exists() for i in (0, 1)):
    if time.monotonic() > deadline or launcher.poll() is not None:
      os.killpg(launcher.pid, signal.SIGKILL)
      raise AssertionError('the fake processes did not start')
    time.sleep(0.05)
  return launcher


@pytest.mark.parametrize('how,stubborn,code', [
    ('SIGTERM to the launcher', '', 143),  # `timeout`, a CI job's limit.
    ('Ctrl-C in its terminal', '', 130),  # SIGINT to its process group.
    ('SIGTERM, processes that ignore it', '1', 143),
])
def test_an_interrupted_local_launch_stops_its_processes(tmp_path, how,
                                                        stubborn, code):
  """Interrupted, the launcher passes SIGTERM on to its processes (they
  save a checkpoint), waits for them (killing those that do not end in
  time) and only then returns, 128 + the signal: nothing goes on training
  behind it, or printing after the shell's prompt."""
  fake = tmp_path / 'fake_python'
  tmp = tmp_path / 'tmp'
  tmp.mkdir()
  launcher = _fake_local_launch(tmp_path, tmp, stubborn, subprocess.PIPE)
  try:
    if how.startswith('Ctrl-C'):
      os.killpg(launcher.pid, signal.SIGINT)
    else:
      launcher.send_signal(signal.SIGTERM)
    out, _ = launcher.communicate(timeout=30)
  finally:  # Its processes too (its group), whatever failed.
    with contextlib.suppress(ProcessLookupError):
      os.killpg(launcher.pid, signal.SIGKILL)
  assert launcher.returncode == code, out
  left = subprocess.run(['pgrep', '-f', str(fake)], capture_output=True,
                        text=True).stdout.split()
  assert not left, out  # Every process ended before the launcher.
  assert 'stopping the 2 processes' in out
  if stubborn:  # Killed: their logs stay, and where is said.
    assert 'process 0 exit 137, process 1 exit 137' in out
    (kept,) = tmp.iterdir()
    assert f"logs are kept in {kept}" in out
  else:  # Both saved; the log folder is gone.
    saved = sorted(f.read_text().strip() for f in tmp_path.glob('saved_*'))
    assert len(saved) == 2 and not list(tmp.iterdir())


@pytest.mark.skipif(not sys.platform.startswith('linux'),
                    reason='PR_SET_PDEATHSIG is Linux only')
def test_a_killed_local_launcher_takes_its_processes_with_it(tmp_path):
  """A SIGKILL to the launcher (a subprocess timeout, the OOM killer)
  cannot be passed on by it: each process was started asking the kernel
  for a SIGTERM when the launcher dies, so they save and stop, not go on
  orphaned."""
  launcher = _fake_local_launch(tmp_path, tmp_path, '', subprocess.DEVNULL)
  try:
    launcher.kill()
    launcher.wait(10)
    deadline = time.monotonic() + 20
    while len(list(tmp_path.glob('saved_*'))) < 2:
      assert time.monotonic() < deadline, 'the processes went on'
      time.sleep(0.05)
    assert sorted(f.read_text().strip()
                  for f in tmp_path.glob('saved_*')) == ['75', '75']
  finally:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(launcher.pid, signal.SIGKILL)


def _local_env(tmp_path):
  env = dict(os.environ, TMPDIR=str(tmp_path))  # The processes' logs.
  env['XLA_FLAGS'] = xla_flags()  # One CPU device per process.
  return env


def test_local_processes_fail(tmp_path):
  """A process that fails (here both, on a misspelt config field, before
  their start-up's imports): non-zero, the failure named. Stopping the
  others is test_wait_all_stops_the_others_when_one_fails's."""
  p = subprocess.run(
      [sys.executable, '-m', 'launch.tpu', 'run', '--local-processes=2',
       f'--config={SMOKE}', f'--workdir={tmp_path}', '--yes',
       '--config.optim.lrr=0.1'],
      capture_output=True, text=True, env=_local_env(tmp_path), cwd=ROOT,
      timeout=300)
  assert p.returncode != 0
  assert re.search(r'# process \d failed \(exit', p.stdout), p.stdout
  (kept,) = tmp_path.glob('vit_jax_local_*')  # Kept, and said where.
  assert f"logs are kept in {kept}" in p.stdout


def test_local_processes_train(tmp_path):
  """The multi-host path on this machine: 2 processes, 1 CPU device each."""
  workdir = tmp_path / 'run'
  p = subprocess.run(
      [sys.executable, '-m', 'launch.tpu', 'run', '--local-processes=2',
       f'--config={SMOKE}', f'--workdir={workdir}', '--yes'],
      capture_output=True, text=True, env=_local_env(tmp_path), cwd=ROOT,
      timeout=600)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  summary = json.loads((workdir / 'summary.json').read_text())
  assert summary['num_devices'] == 2 and summary['steps'] == 8
  assert 'eval_accuracy' in p.stdout  # Process 0's output streamed.
  assert not list(tmp_path.glob('vit_jax_local_*'))  # Logs not left over.


# --------------------------------------------------------------------------
# docs/tpu.md.


def _doc_blocks(lang):
  text = open(DOC).read()
  return re.findall(rf'```{lang}\n(.*?)```', text, re.S)


def doc_commands():
  return [line.strip() for block in _doc_blocks('bash')
          for line in block.strip().splitlines() if line.strip()]


def test_every_doc_command_runs_dry():
  cmds = doc_commands()
  assert len(cmds) > 20
  for cmd in cmds:
    if cmd in COVERED_ELSEWHERE:
      continue
    argv = shlex.split(cmd)
    assert argv[:3] == ['python', '-m', 'launch.tpu'], cmd
    code, lines = dry(argv[3:])
    assert code == 0, cmd
    assert any(not x.startswith('#') for x in lines), cmd


def test_doc_estimate_matches_the_launcher():
  first = doc_commands()[0]
  _, lines = dry(shlex.split(first)[3:])
  shown = _doc_blocks('text')[0].strip().splitlines()
  assert shown[-1] == 'Proceed? [y/N]'
  assert shown[:-1] == [x for x in lines if x.startswith('#')][:len(shown) - 1]


def test_doc_topology_table():
  rows = re.findall(r'^\| `([\w-]+)` \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| '
                    r'`([\w-]+)` \|$', open(DOC).read(), re.M)
  assert len(rows) >= 10
  for name, chips, cores, devices, hosts, version in rows:
    t = topology.parse(name)
    assert (t.chips, t.cores, t.devices, t.hosts) == tuple(
        map(int, (chips, cores, devices, hosts))), name
    assert commands.default_runtime_version(name) == version


def test_doc_prepare_flags_exist():
  prepares = [c for c in doc_commands() if 'vit_jax.data.prepare' in c]
  assert len(prepares) == 2
  out = subprocess.run([sys.executable, '-m', 'vit_jax.data.prepare',
                        '--help'], capture_output=True, text=True,
                       cwd=ROOT, check=True).stdout
  for cmd in prepares:
    for flag in re.findall(r'(--\w+)=', cmd.split('vit_jax.data.prepare')[1]):
      assert flag in out, flag


def test_batch_that_does_not_split_over_the_slice_fails_before_create():
  from vit_jax.launch import topology as topology_lib
  from vit_jax.launch import tpu
  smoke = os.path.join(ROOT, 'configs/smoke.py:data=digits')
  config = tpu.load_config(smoke, ['--config.input.batch_size=100'])
  with pytest.raises(ValueError, match='multiple of 32'):
    tpu.check_batches(config, topology_lib.parse('v4-64'))
  pre = os.path.join(ROOT, 'configs/pretrain.py:model=ViT-B/16,data=i21k')
  tpu.check_batches(tpu.load_config(pre), topology_lib.parse('v4-32'))
  # A model axis across hosts (v4-32: 4 hosts of 4 devices) is refused
  # before a TPU is created, as the trainer would refuse it on the slice.
  with pytest.raises(ValueError, match=r'mesh.model=8 puts the model axis '
                     'across hosts'):
    tpu.check_batches(tpu.load_config(pre, ['--config.mesh.model=8']),
                      topology_lib.parse('v4-32'))
  tpu.check_batches(tpu.load_config(pre, ['--config.mesh.model=4']),
                    topology_lib.parse('v4-32'))
  # A few-shot evaluator's own batch size is checked as well.
  few = os.path.join(ROOT, 'configs/pretrain.py:model=ViT-B/16,data=i21k,'
                     'fewshot=cifar100')
  with pytest.raises(ValueError, match=r'evals.fewshot.batch_size'):
    tpu.check_batches(tpu.load_config(
        few, ['--config.evals.fewshot.batch_size=100']),
                      topology_lib.parse('v4-64'))
  tpu.check_batches(tpu.load_config(
      few, ['--config.evals.fewshot.batch_size=256']),
                    topology_lib.parse('v4-64'))


def test_a_config_the_trainer_would_refuse_is_refused_before_create():
  from vit_jax.launch import tpu
  pre = os.path.join(ROOT, 'configs/pretrain.py:model=ViT-B/16,data=i21k')
  with pytest.raises(ValueError, match=r'optim.lr=-1.0 cannot work'):
    tpu.load_config(pre, ['--config.optim.lr=-1'])
  with pytest.raises(ValueError, match=r"^--config.optim.lrr: config.optim "
                     r"has no field 'lrr' \(did you mean lr\?\)"):
    tpu.load_config(pre, ['--config.optim.lrr=1'])


def test_results_inside_the_checkout_and_odd_workers_are_refused(capsys):
  # `setup` copies the checkout to every worker: results (checkpoints
  # included) inside it would go along.
  for argv, message in (
      (UP + ['--topology=v4-8', f'--results={ROOT}/results'],
       'is inside the checkout'),
      (['logs', '--name=vit', '--zone=us-central2-b', '--worker=abc'],
       '--worker=abc: expected all')):
    with pytest.raises(SystemExit) as stop:
      dry(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err
