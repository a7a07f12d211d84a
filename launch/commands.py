"""gcloud command lines and the shell run on TPU workers (pure functions).

Each function returns an argv list (or, for the `*_script` ones, one line of
shell for `tpu-vm ssh --command`); nothing here runs anything. On every
worker: the project in ~/vit_jax, a Python 3.11 virtual environment in
~/vit_jax_env (TPU VM images ship Python 3.10; the pinned jax needs 3.11, so
`uv` provides it), and the run's log, pid and exit status in
~/vit_jax_run.{log,pid,exit}.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from typing import Mapping, Optional, Sequence

from vit_jax.train.preemption import EXIT_PREEMPTED

# The packed checkout (`launch.pack`), relative to the home directory.
ARCHIVE = 'vit_jax_setup.tar.gz'
_HOME_DIR = '$HOME/vit_jax'
_VENV = '$HOME/vit_jax_env'
_PYTHON = f'{_VENV}/bin/python'
_UV = '$HOME/.local/bin/uv'
LOG, PID, EXIT = ('$HOME/vit_jax_run.log', '$HOME/vit_jax_run.pid',
                  '$HOME/vit_jax_run.exit')
EXTRAS = '.[data]'  # scikit-learn's digits: smoke configs run on a TPU too.
# A run's exit status when a SIGTERM ended it: 128 + SIGTERM, as the shell
# counts (Python killed by it), or recorded so by `run_script`'s wrapper.
EXIT_SIGTERM = 143

# TPU generation (the accelerator type's prefix) -> default runtime version.
RUNTIME_VERSIONS = {
    'v2': 'tpu-ubuntu2204-base',
    'v3': 'tpu-ubuntu2204-base',
    'v4': 'tpu-ubuntu2204-base',
    'v5litepod': 'v2-alpha-tpuv5-lite',
    'v5p': 'v2-alpha-tpuv5',
    'v6e': 'v2-alpha-tpuv6e',
}


def default_runtime_version(accelerator_type: str) -> str:
  return RUNTIME_VERSIONS[accelerator_type.split('-')[0]]


@dataclasses.dataclass(frozen=True)
class Tpu:
  """A TPU VM (or queued resource) `name` in `zone`."""
  name: str
  zone: str
  project: Optional[str] = None
  queued: bool = False

  def flags(self) -> list:
    return [f'--zone={self.zone}'] + (
        [f'--project={self.project}'] if self.project else [])


_TPU_VM = ['gcloud', 'compute', 'tpus', 'tpu-vm']
_QUEUED = ['gcloud', 'compute', 'tpus', 'queued-resources']


def create(tpu: Tpu, accelerator_type: str, version: str, *,
           spot: bool = False, preemptible: bool = False) -> list:
  """`tpu-vm create` (waits until READY) or `queued-resources create`."""
  if tpu.queued:
    argv = _QUEUED + ['create', tpu.name, f'--node-id={tpu.name}',
                      f'--accelerator-type={accelerator_type}',
                      f'--runtime-version={version}']
  else:
    argv = _TPU_VM + ['create', tpu.name,
                      f'--accelerator-type={accelerator_type}',
                      f'--version={version}']
  return (argv + ['--spot'] * spot + ['--preemptible'] * preemptible
          + tpu.flags())


def describe(tpu: Tpu) -> list:
  """Prints the node's state: READY, CREATING, PREEMPTED, ..."""
  return _TPU_VM + ['describe', tpu.name, '--format=value(state)'] + (
      tpu.flags())


def describe_queued(tpu: Tpu) -> list:
  """Prints the queued resource's state: ACCEPTED, ..., ACTIVE, FAILED."""
  return _QUEUED + ['describe', tpu.name, '--format=value(state.state)'] + (
      tpu.flags())


def delete(tpu: Tpu) -> list:
  """Deletes the node (a queued resource together with its node)."""
  if tpu.queued:
    return _QUEUED + ['delete', tpu.name, '--force', '--quiet'] + tpu.flags()
  return _TPU_VM + ['delete', tpu.name, '--quiet'] + tpu.flags()


def ssh(tpu: Tpu, command: str, worker: str = 'all') -> list:
  return _TPU_VM + ['ssh', tpu.name] + tpu.flags() + [
      f'--worker={worker}', f'--command={command}']


def scp_to_workers(tpu: Tpu, src: str, dest: str) -> list:
  return _TPU_VM + ['scp', src, f'{tpu.name}:{dest}'] + (
      tpu.flags() + ['--worker=all'])


def scp_from_worker(tpu: Tpu, src: str, dest: str, worker: str = '0') -> list:
  return _TPU_VM + ['scp', '--recurse', f'{tpu.name}:{src}', dest] + (
      tpu.flags() + [f'--worker={worker}'])


def storage_cp(src: str, dest: str, project: Optional[str] = None) -> list:
  return ['gcloud', 'storage', 'cp', '-r', src, dest] + (
      [f'--project={project}'] if project else [])


# --------------------------------------------------------------------------
# Shell run on the workers (one line each: dry runs print one command a line).


def idle_guard() -> str:
  """Exits 1 (naming the run) where a run is still going on the worker:
  before starting another, or replacing its code and environment."""
  return (f'if [ -f {PID} ] && kill -0 "$(cat {PID})" 2>/dev/null; then '
          f'echo "$(hostname): a run is still going (pid $(cat {PID}))"; '
          'exit 1; fi')


def install_script(git_url: Optional[str] = None,
                   ref: Optional[str] = None,
                   archive: Optional[str] = None) -> str:
  """Installs ~/vit_jax: cloned from `git_url`, or unpacked from `archive`
  (copied to the home directory, `launch.pack`), else already there."""
  steps = [idle_guard()]
  if archive:
    steps += [f'rm -rf {_HOME_DIR}', f'mkdir {_HOME_DIR}',
              f'tar -xzf $HOME/{shlex.quote(archive)} -C {_HOME_DIR}']
  elif git_url:
    steps += [f'rm -rf {_HOME_DIR}',
              f'git clone -q {shlex.quote(git_url)} {_HOME_DIR}']
    if ref:
      steps.append(f'git -C {_HOME_DIR} checkout -q {shlex.quote(ref)}')
  steps += [
      f'cd {_HOME_DIR}',
      'python3 -m pip install -q --user -U uv',
      f'rm -rf {_VENV}',
      f'{_UV} venv -q --python 3.11 {_VENV}',
      f'{_UV} pip install -q --python {_PYTHON} -e {shlex.quote(EXTRAS)} '
      "'jax[tpu]' -c constraints.txt",
      f'v=$({_PYTHON} -c \'import jax, vit_jax; print(jax.__version__)\')',
      'echo "$(hostname): jax $v"',
  ]
  return ' && '.join(steps)


def run_script(main_args: Sequence[str], env: Mapping[str, str]) -> str:
  """Starts `python -m vit_jax.main ARGS` in the background (nohup).

  Refuses to start a second run while one is going on the worker. The exit
  status lands in ~/vit_jax_run.exit when the run ends (128+N for a run
  killed by signal N, as the shell counts).

  The wrapper shell (its pid in ~/vit_jax_run.pid: what the idle guard,
  `status_script` and `logs_script` watch) outlives Python: a SIGTERM to
  it (a VM shutting down on preemption signals every process; `pkill -f
  vit_jax.main` matches the wrapper's command line too) is passed on to
  Python, and the wrapper waits again until Python has saved and exited.
  Killed with Python still saving, the wrapper would leave no exit status
  (`up` would take the run as failed instead of resuming it) and the guard
  would let another run or `setup` start under the saving one.

  A run that got a SIGTERM and then exited with neither 0 nor 75 (an
  error the signal caused while it started or saved) is recorded as
  `EXIT_SIGTERM` (143), its own status said in the log: `up` takes it as
  stopped by a preemption, to be resumed, not as a failure.
  """
  words = ['env', *(f'{k}={v}' for k, v in env.items())] if env else []
  cmd = ' '.join([*map(shlex.quote, words), _PYTHON, '-m', 'vit_jax.main',
                  *map(shlex.quote, main_args)])
  # A trapped signal ends `wait` early (status > 128): `t` says to wait
  # again; bash keeps a waited child's status, so a second `wait` on one
  # that has ended gives it too; `g` remembers that a SIGTERM came. The
  # trap is set before Python starts. A SIGTERM between Python's start and
  # `c=$!` finds no pid to pass on: it is passed on once `c` is set (else
  # Python would never hear of it and the wrapper would wait forever).
  inner = (f'cd {_HOME_DIR} || {{ echo 1 > {EXIT}; exit 1; }}; t=0; g=0; '
           "c=; trap 't=1; g=1; [ -n \"$c\" ] && kill -TERM $c "
           "2>/dev/null' TERM; "
           f'{cmd} & c=$!; [ $g = 1 ] && kill -TERM $c 2>/dev/null; '
           'wait $c; s=$?; '
           'while [ $t = 1 ]; do t=0; wait $c; s=$?; done; '
           f'if [ $g = 1 ] && [ $s != 0 ] && [ $s != {EXIT_PREEMPTED} ] && '
           f'[ $s != {EXIT_SIGTERM} ]; then echo "vit_jax_run: exit $s '
           f'after a SIGTERM: recorded as {EXIT_SIGTERM} (stopped by '
           f'SIGTERM)"; s={EXIT_SIGTERM}; fi; '
           f'echo $s > {EXIT}')
  return (f'{idle_guard()}; rm -f {EXIT}; nohup bash -c {shlex.quote(inner)} '
          f'> {LOG} 2>&1 < /dev/null & echo $! > {PID}')


# Lines of context a reattached log stream starts with (the whole log
# again would repeat days of a long run's output on every reattach).
REATTACH_LINES = 20


def logs_script(last: Optional[int] = None) -> str:
  """Follows the run's log until it ends, from its start (or its `last`
  lines); exits with the run's status."""
  start = '+1' if last is None else str(int(last))
  return (f'test -f {PID} || {{ echo "$(hostname): no run started"; '
          f'exit 2; }}; tail -n {start} -F --pid="$(cat {PID})" {LOG}; '
          f'exit "$(cat {EXIT} 2>/dev/null || echo 1)"')


def status_script() -> str:
  """One line per worker: running (and for how many seconds its log has
  not grown) / exited N at TIME (UTC, when the run ended) / no run, and the
  last log line."""
  idle = f'$(( $(date +%s) - $(stat -c %Y {LOG} 2>/dev/null || date +%s) ))'
  return (f'if [ -f {PID} ] && kill -0 "$(cat {PID})" 2>/dev/null; then '
          f's="running, log idle {idle}s"; '
          f'elif [ -f {EXIT} ]; then s="exited $(cat {EXIT}) at '
          f'$(date -u -r {EXIT} +%Y-%m-%dT%H:%M:%SZ)"; '
          'else s="no run"; fi; '
          f'echo "$(hostname): $s | $(tail -n 1 {LOG} 2>/dev/null)"')


@dataclasses.dataclass(frozen=True)
class WorkerRun:
  """One line of `status_script`'s output."""
  host: str
  state: str  # 'running', 'exited N' or 'no run'.
  exit_code: Optional[int] = None
  ended: str = ''  # When it exited: UTC, ISO 8601 (sorts by time).
  last_line: str = ''
  log_idle_s: Optional[int] = None  # Running: since its log last grew.


_STATUS_LINE = re.compile(
    r'^(\S+): (running(?:, log idle (-?\d+)s)?|exited (-?\d+)(?: at (\S+))?'
    r'|no run) \|(?: (.*))?$')


def parse_status(text: str) -> list:
  """`status_script`'s lines (from one or every worker) as WorkerRuns;
  lines that are not its (gcloud's own messages) are skipped."""
  runs = []
  for line in text.splitlines():
    found = _STATUS_LINE.match(line.strip())
    if found:
      host, state, idle, code, ended, last = found.groups()
      runs.append(WorkerRun(
          host, re.sub(r'(, log idle| at) .*', '', state),
          None if code is None else int(code), ended or '', last or '',
          None if idle is None else int(idle)))
  return runs


def save_logs_script(workdir: str) -> str:
  """Copies the worker's run log to `<workdir>/logs/<hostname>.log` (a
  gs:// workdir through the worker's gcloud), before the TPU is deleted."""
  dest = f'{workdir.rstrip("/")}/logs'
  target = f'{shlex.quote(dest)}/"$(hostname).log"'
  if workdir.startswith('gs://'):
    copy = (f'gcloud storage cp -q {LOG} {target} || '
            f'gsutil -q cp {LOG} {target}')
  else:
    copy = f'mkdir -p {shlex.quote(dest)} && cp {LOG} {target}'
  return f'test -f {LOG} && {{ {copy}; }}'


def exec_script(command: Sequence[str]) -> str:
  """Runs `command` (joined with spaces, as ssh does) in ~/vit_jax with the
  project's environment first on PATH (`python` is its Python)."""
  # `;`, not `&&`: a trailing `&` then backgrounds the command alone.
  return (f'cd {_HOME_DIR} || exit 1; export PATH={_VENV}/bin:$PATH; '
          + ' '.join(command))
