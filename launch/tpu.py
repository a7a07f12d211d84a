"""Launch training on Cloud TPU VMs and pods: `python -m launch.tpu VERB`.

    python -m launch.tpu up --name=vit --topology=v4-32 --zone=us-central2-b \\
        --config=configs/pretrain.py:model=ViT-B/16,data=i21k \\
        --workdir=gs://bucket/b16 --env TFDS_DATA_DIR=gs://bucket/tfds --spot

Verbs: create, setup (install the project on every worker), run (start the
config on every worker), logs (follow worker 0's log), status, exec (a
command on the workers), delete, and up (create + setup + run + logs, on
preemption delete + create + setup + run again -- the run resumes from its
checkpoint in the same workdir -- then copy results back and delete).
--dry-run prints the gcloud commands (a pasteable script) and runs nothing;
--local-processes=N runs the same launch as N CPU processes on this machine.
See docs/tpu.md.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Optional, Sequence

from vit_jax import outputs
from vit_jax.configs import config_file
from vit_jax.launch import commands, local, pack
from vit_jax.launch import topology as topology_lib
from vit_jax.launch.runner import CommandError, Result, Runner
from vit_jax.train import lock
from vit_jax.train.preemption import EXIT_PREEMPTED

# realpath: in a checkout this file is also reached as vit_jax/launch/tpu.py.
ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
VERBS = ('up', 'create', 'setup', 'run', 'logs', 'status', 'exec', 'delete')
_TPU_FLAGS = ('name', 'zone')
REQUIRED = {
    'up': _TPU_FLAGS + ('topology', 'config', 'workdir'),
    'create': _TPU_FLAGS + ('topology',),
    'setup': _TPU_FLAGS,
    'run': _TPU_FLAGS + ('topology', 'config', 'workdir'),
    'logs': _TPU_FLAGS,
    'status': _TPU_FLAGS,
    'exec': _TPU_FLAGS,
    'delete': _TPU_FLAGS,
}
LOCAL_REQUIRED = ('config', 'workdir')
# What a TPU run has and N local processes do not (no TPU to name, watch
# or recreate, no results to copy, no other checkout to install): refused
# with --local-processes, named, rather than ignored.
LOCAL_REFUSED = ('name', 'zone', 'project', 'worker', 'results',
                 'max_restarts', 'poll_seconds', 'hang_minutes', 'spot',
                 'preemptible', 'queued', 'repo', 'keep', 'runtime_version')
# Defaults filled in after `_validate` (None there: the flag was not given,
# which is how LOCAL_REFUSED tells a flag given, even as its default).
DEFAULTS = {'repo': ROOT, 'max_restarts': 5, 'poll_seconds': 60.0,
            'hang_minutes': 60.0}
GONE = ('PREEMPTED', 'TERMINATED')  # The node must be deleted and recreated.
SSH_FAILED = 255  # ssh's own exit status: connection lost or refused.
# A run that died with its TPU keeps the workdir's lock this long: a run
# started sooner on the new TPU would be refused as a second writer.
LOCK_STALE_S = lock.STALE_S
MAX_REATTACH = 3
RECREATE_WAIT_MAX_S = 1800.0  # Longest wait between failed recreations.
HANG_CHECK_S = 300.0  # How often `up` asks worker 0 how long its log is idle.
MAX_DESCRIBE_ERRORS = 5  # In a row, waiting for a queued resource.


# --------------------------------------------------------------------------
# Command line.


def _topology(name: str) -> topology_lib.Topology:
  try:
    return topology_lib.parse(name)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def _env_pair(text: str) -> tuple:
  key, sep, value = text.partition('=')
  if not sep or not re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*', key):
    raise argparse.ArgumentTypeError(f'{text!r}: expected KEY=VALUE')
  return key, value


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog='python -m launch.tpu', allow_abbrev=False,
      description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog='Unknown --config.FIELD=VALUE flags are passed to vit_jax.main; '
      'exec runs the command after "--".')
  a = p.add_argument
  a('verb', choices=VERBS)
  a('--name', help='TPU VM (and queued resource) name')
  a('--zone', help='e.g. us-central2-b')
  a('--project', help='gcloud project (default: gcloud\'s)')
  a('--topology', type=_topology, help='TPU slice, e.g. v3-8, v4-32, '
    'v5litepod-16 (see python -m launch.topology)')
  a('--runtime-version', help='TPU VM image (default per generation: '
    + ', '.join(f'{k}: {v}' for k, v in commands.RUNTIME_VERSIONS.items())
    + ')')
  a('--spot', action='store_true', help='spot VM (preemptible, no time limit)')
  a('--preemptible', action='store_true', help='preemptible VM (at most 24 h)')
  a('--queued', action='store_true', help='create through a queued resource '
    '(waits for capacity)')
  a('--config', help='config spec for vit_jax.main, e.g. configs/smoke.py:'
    'data=digits (its file must be inside the repo)')
  a('--workdir', help='vit_jax.main --workdir; gs://... on multi-host slices')
  a('--repo', help='what setup installs: a local checkout (copied; '
    'default: this one) or a git URL, optionally URL#REF')
  a('--results', help='local dir to copy the workdir into when the run ends')
  a('--env', action='append', type=_env_pair, default=[], metavar='KEY=VALUE',
    help='environment of the run (repeatable), e.g. TFDS_DATA_DIR=gs://b/tfds')
  a('--max-restarts', type=int, help='up: restarts after preemption '
    f'before giving up (default {DEFAULTS["max_restarts"]})')
  a('--poll-seconds', type=float, help='how often up checks the TPU state '
    f'(and a queued resource\'s; default {DEFAULTS["poll_seconds"]:g})')
  a('--hang-minutes', type=float, help='up: a run whose worker-0 log has '
    'not grown for this long is taken as hung and fails (logs saved, the '
    f'TPU deleted unless --keep; default {DEFAULTS["hang_minutes"]:g}); 0: '
    'never')
  a('--worker', help='logs (default 0) and exec (default all): which worker')
  a('--keep', action='store_true', help='up: do not delete the TPU at the end')
  a('--local-processes', type=int, metavar='N', help='run/up: N local CPU '
    'processes (jax.distributed on 127.0.0.1) instead of a TPU')
  a('--dry-run', action='store_true', help='print the commands, run nothing')
  a('--yes', '-y', action='store_true', help='do not ask for confirmation')
  return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  argv = list(argv)
  rest = []
  if '--' in argv:
    i = argv.index('--')
    argv, rest = argv[:i], argv[i + 1:]
  parser = _parser()
  args, unknown = parser.parse_known_args(argv)
  bad = [u for u in unknown if not re.match(r'--config\.\w.*=', u)]
  if bad:
    parser.error(f'unrecognized arguments: {" ".join(bad)} (config fields '
                 'are passed as --config.FIELD=VALUE)')
  args.overrides, args.command = unknown, rest
  try:
    _validate(args)
  except ValueError as e:
    parser.error(str(e))
  return args


def _flag(field: str) -> str:
  return f'--{field.replace("_", "-")}'


def _validate(args: argparse.Namespace) -> None:
  if args.local_processes is not None:
    if args.verb not in ('run', 'up'):
      raise ValueError('--local-processes goes with run or up')
    if args.local_processes < 1:
      raise ValueError('--local-processes must be at least 1')
    # `is not`: a value that equals False (--hang-minutes=0) was given too.
    refused = [_flag(f) for f in LOCAL_REFUSED
               if getattr(args, f) is not None and getattr(args, f)
               is not False]
    if refused:
      raise ValueError(
          f'{", ".join(refused)} with --local-processes: the processes run '
          'this checkout on this machine, once, writing straight to '
          '--workdir (no TPU to name, make spot, watch, restart or delete, '
          'no results to copy back); drop the flag(s), or launch on a TPU')
    required = LOCAL_REQUIRED
  else:
    required = REQUIRED[args.verb]
  for field, default in DEFAULTS.items():
    if getattr(args, field) is None:
      setattr(args, field, default)
  missing = [_flag(f) for f in required if getattr(args, f) is None]
  if missing:
    raise ValueError(f'{args.verb} needs {", ".join(missing)}')
  if args.local_processes:
    # vit_jax.main's own rule (`outputs`): an empty one (an unset shell
    # variable) refused, not taken as this folder; `~/x` expanded, not
    # made <cwd>/~/x by `_main_args`. A TPU's workdir is the workers'.
    args.workdir = outputs.directory(args.workdir)
  if args.spot and args.preemptible:
    raise ValueError('--spot and --preemptible exclude each other')
  if args.queued and args.preemptible:
    raise ValueError('queued resources take --spot, not --preemptible')
  if (args.command or args.verb == 'exec') and not (
      args.verb == 'exec' and args.command):
    raise ValueError('exec runs the command after "--" (and only exec does)')
  if args.results and not args.workdir:
    raise ValueError('--results needs --workdir (what to copy)')
  if args.results and os.path.isdir(args.repo):
    results, repo = (os.path.realpath(p) for p in (args.results, args.repo))
    if os.path.commonpath([results, repo]) == repo:
      raise ValueError(
          f'--results={args.results} is inside the checkout {repo}, which '
          '`setup` copies to every worker (these results, checkpoints '
          'included, with it): put them outside, e.g. ../results')
  if args.worker is not None and not re.fullmatch(r'all|\d+(,\d+)*',
                                                  args.worker):
    raise ValueError(f'--worker={args.worker}: expected all, a worker '
                     'number or numbers separated by commas (0,2)')
  if args.max_restarts < 0 or args.hang_minutes < 0:
    raise ValueError('--max-restarts and --hang-minutes must be >= 0')
  if not args.poll_seconds > 0:
    raise ValueError(f'--poll-seconds={args.poll_seconds:g}: must be > 0 '
                     '(0 would ask gcloud for the TPU state in a tight loop)')


# --------------------------------------------------------------------------
# What the run is: config, workdir, estimate, confirmation.


def _tpu(args) -> commands.Tpu:
  return commands.Tpu(args.name, args.zone, args.project, args.queued)


def _runtime_version(args) -> str:
  return args.runtime_version or commands.default_runtime_version(
      args.topology.name.strip().lower())


def _main_args(args, remote: bool) -> list:
  """vit_jax.main's flags: the config (path as the workers / processes see
  it), the workdir and the --config.FIELD overrides."""
  full, arg = config_file(args.config)
  path, workdir = full, args.workdir
  if remote:
    repo = _repo(args.repo)[0] or ROOT  # A git URL: assume the same layout.
    path = os.path.relpath(full, repo)
    if path.startswith('..'):
      raise ValueError(f'--config={args.config}: the file must be inside '
                       f'{repo}, the checkout the workers get')
  elif not workdir.startswith('gs://'):
    workdir = os.path.abspath(workdir)
  return [f'--config={path}{arg}', f'--workdir={workdir}', *args.overrides]


def load_config(spec: str, overrides: Sequence[str] = ()):
  """The config exactly as vit_jax.main builds it from the same flags."""
  from absl import flags
  from ml_collections import config_flags
  from vit_jax.configs import common
  from vit_jax.train import config_check

  def build(argv):
    fv = flags.FlagValues()
    # The --config.FIELD flags are defined from `sys_argv`, as in main.py.
    config_flags.DEFINE_config_file('config', None, flag_values=fv,
                                    lock_config=True, sys_argv=argv)
    try:
      fv(argv)
      return fv.config
    except Exception as e:  # Whatever the file or an override raises.
      raise ValueError(f'{" ".join(argv[1:])}: {type(e).__name__}: {e}'
                       ) from e

  # A missing file, a bad `:args` row or a misspelt field: one message, as
  # vit_jax.main gives (the same check).
  try:
    argv = common.check_command_line(
        ['launch.tpu', f'--config={spec}', *overrides])
  except common.ConfigSpecError as e:
    raise ValueError(str(e)) from None
  config = build(argv)
  # What vit_jax.main would refuse on the workers, refused before a TPU.
  config_check.check(config)
  return config


def check_batches(config, topo) -> None:
  """The batch sizes must split over the slice's devices: the trainer's
  check (`sharding.check_batch_size`), here before a TPU is created."""
  from vit_jax import sharding  # Loads JAX: only when a config is checked.
  mesh = sharding.abstract_mesh(topo.devices, **config.get('mesh', {}))
  model, per_host = mesh.shape['model'], topo.devices_per_host
  if per_host % model:  # The trainer's check of real devices, by numbers.
    raise ValueError(
        f'{topo.name} ({topo.hosts} hosts of {per_host} JAX devices): '
        f'--config.mesh.model={model} puts the model axis across hosts, '
        'whose processes would feed the same batch rows different data. '
        f'Use a model axis that divides {per_host}, or shard parameters '
        'with --config.mesh.fsdp')
  accum = max(1, int(config.get('accum_steps', 1)))
  # The evaluators' own batch sizes too (few-shot's `batch_size`).
  fields = [(f'input.{f}', config.input.get(f), steps) for f, steps in (
      ('batch_size', accum), ('eval_batch_size', 1))] + [
          (f'evals.{name}.batch_size', section.get('batch_size'), 1)
          for name, section in sorted((config.get('evals') or {}).items())
          if hasattr(section, 'get')]
  for field, size, steps in fields:
    if size:
      try:
        sharding.check_batch_size(size, mesh, field, steps)
      except ValueError as e:
        raise ValueError(f'{topo.name} ({topo.devices} JAX devices): {e} '
                         f'(--config.{field}=...)') from None


def describe_launch(args) -> list:
  """The lines shown before asking: slice, TPU, and the cost estimate."""
  lines, topo = [], args.topology
  if args.local_processes:
    lines.append(f'local: {args.local_processes} processes of vit_jax.main '
                 'on this machine (JAX_PLATFORMS=cpu)')
  if topo:
    lines.append(f'{topo.name}: {topo.chips} chips, {topo.cores} TensorCores,'
                 f' {topo.devices} JAX devices on {topo.hosts} host(s)')
  if topo and not args.local_processes:
    kind = ('spot' if args.spot else 'preemptible' if args.preemptible
            else 'on-demand') + (', queued resource' if args.queued else '')
    lines.append(f'TPU {args.name} in {args.zone}: {kind}, runtime '
                 f'{_runtime_version(args)}')
  if topo and args.config:
    config = load_config(''.join(config_file(args.config)), args.overrides)
    if not args.local_processes:
      check_batches(config, topo)
    lines.append(f'estimate for {args.config} on {topo.name}:')
    lines += ['  ' + line for line in
              topology_lib.estimate(config, topo).lines()]
  return lines


def confirm(args, runner: Runner, lines: Sequence[str]) -> bool:
  for line in lines:
    runner.note(line)
  if args.yes or args.dry_run:
    return True
  print('Proceed? [y/N] ', end='', flush=True, file=runner.out)
  try:
    answer = input()
  except EOFError:  # No terminal (a script, CI, nohup): nobody to ask.
    print(file=runner.out)
    runner.note('aborted: nothing was run (no answer: standard input ended; '
                'pass --yes to run without asking)')
    return False
  if answer.strip().lower() in ('y', 'yes'):
    return True
  runner.note('aborted: nothing was run')
  return False


def _check_config_shipped(args) -> None:
  """The --config file must be in the archive `setup` copies (what git
  would commit, `launch.pack`): one in an ignored folder (workdirs/ is)
  passes every check here and is missing on every worker, which then
  fails only after the TPU was created."""
  repo = _repo(args.repo)[0]
  if not repo:
    return  # A git URL: the workers clone it; this machine cannot tell.
  full, _ = config_file(args.config)
  relpath = os.path.relpath(full, repo)
  if not pack.ships(repo, relpath):
    raise ValueError(
        f'--config={args.config}: {relpath} is not shipped to the workers: '
        f'the archive of {repo} holds what git would commit, and '
        '.gitignore excludes this file (or it is otherwise left out, e.g. '
        'in a nested repository). Move it into the repository\'s tracked '
        f'tree (e.g. configs/), or add it: git -C {shlex.quote(repo)} add -f '
        f'{shlex.quote(relpath)}')


def _preflight(args, runner: Runner) -> None:
  """Checks what a TPU run needs before anything is created, and pins the
  workers' vit_jax.main flags (`args.main_args`), as the code archive is
  pinned: every restart of a days-long `up` starts the same command, even
  after the --config file was moved or removed here (a `git checkout`)."""
  _repo(args.repo)
  args.main_args = _main_args(args, remote=True)
  _check_config_shipped(args)
  if args.workdir.startswith('gs://'):
    return
  if args.topology.hosts > 1:
    raise ValueError(f'{args.topology.name} has {args.topology.hosts} hosts: '
                     'use a gs:// --workdir (every worker writes checkpoint '
                     'shards to it)')
  if not os.path.isabs(args.workdir):
    raise ValueError(f'--workdir={args.workdir} is relative: the run starts '
                     'in ~/vit_jax, which setup replaces; use a gs:// '
                     'workdir or an absolute path on worker 0')
  if args.verb == 'up' and (args.spot or args.preemptible):
    raise ValueError(f'--workdir={args.workdir} is on worker 0\'s disk, '
                     'which a preemption deletes: `up` would recreate the TPU '
                     'and start again from step 0; use a gs:// --workdir')
  runner.note(f'warning: --workdir={args.workdir} is on worker 0\'s disk and '
              'is lost when the TPU is deleted or recreated')


# --------------------------------------------------------------------------
# Steps.


def _state(runner: Runner, args) -> str:
  """The node's state, e.g. READY or PREEMPTED; NOT_FOUND; '?' if unknown."""
  res = runner.run(commands.describe(_tpu(args)), capture=True, check=False,
                   dry_stdout='READY', echo=False)
  if res.returncode:
    return 'NOT_FOUND' if 'NOT_FOUND' in res.stderr else '?'
  return (res.stdout.strip().splitlines() or ['?'])[0]


def _gone(args) -> tuple:
  # A preempted queued resource is suspended and its node removed.
  return GONE + ('NOT_FOUND',) if args.queued else GONE


def _create(runner: Runner, args, created: Optional[list] = None) -> None:
  """Creates the TPU (noted in `created`, `up`'s record of what it made:
  'tpu' per TPU created, 'run' per run started)."""
  runner.run(commands.create(
      _tpu(args), args.topology.name.strip().lower(), _runtime_version(args),
      spot=args.spot, preemptible=args.preemptible))
  if created is not None:
    created.append('tpu')
  if args.queued:
    _wait_active(runner, args)


def _wait_active(runner: Runner, args) -> None:
  """A queued resource is ACTIVE (its node exists) once capacity is found."""
  argv = commands.describe_queued(_tpu(args))
  runner.note(f'waiting for ACTIVE, polling every {args.poll_seconds:g} s: '
              + shlex.join(argv))
  last, errors = None, 0
  while True:
    res = runner.run(argv, capture=True, check=False, dry_stdout='ACTIVE',
                     echo=False)
    errors = errors + 1 if res.returncode else 0
    if errors == MAX_DESCRIBE_ERRORS:  # E.g. no permission, wrong project.
      raise CommandError(argv, res)
    state = res.stdout.strip() or '?'
    if state != last:
      runner.note(f'queued resource {args.name}: {state}')
      last = state
    if state == 'ACTIVE':
      return
    if state in ('FAILED', 'SUSPENDED', 'SUSPENDING', 'DELETING'):
      raise CommandError(argv, Result(1, stderr=f'queued resource '
                                      f'{args.name} is {state}'))
    time.sleep(args.poll_seconds)


def _repo(repo: str) -> tuple:
  """(local dir, None, None) or (None, git URL, ref)."""
  if os.path.isdir(repo):
    if not os.path.isfile(os.path.join(repo, 'setup.py')):
      # The default, ROOT, is no checkout where vit_jax is installed (it is
      # site-packages/vit_jax then).
      default = (' (the default: where this launcher is installed, not a '
                 'checkout)' if os.path.abspath(repo) == ROOT else '')
      raise ValueError(f'--repo={repo}: no setup.py there{default}; pass '
                       '--repo=<your checkout of vit_jax>, or a git URL '
                       '(--repo=URL#REF)')
    return os.path.abspath(repo), None, None
  if '://' in repo or repo.startswith('git@') or repo.split('#')[0].endswith(
      '.git'):
    url, _, ref = repo.partition('#')
    return None, url, ref or None
  raise ValueError(f'--repo={repo}: neither a directory nor a git URL')


def _setup(runner: Runner, args) -> None:
  tpu = _tpu(args)
  path, url, ref = _repo(args.repo)
  if not path:
    _run_reconnecting(runner, args,
                      commands.ssh(tpu, commands.install_script(url, ref)))
    return
  _run_reconnecting(
      runner, args,
      commands.scp_to_workers(tpu, _archive(runner, args, path),
                              commands.ARCHIVE),
      commands.ssh(tpu, commands.install_script(archive=commands.ARCHIVE)))


class SetupArchiveGone(RuntimeError):
  """The archive `up` packed when it started is no longer there."""


def _archive(runner: Runner, args, path: str) -> str:
  """One archive of what git would commit in `path` (`launch.pack`), not the
  folder: .git, environments and ignored workdirs stay here. Packed once
  per command: every TPU `up` recreates installs the code the run started
  with, not what the checkout holds by then. Into a folder of this
  command's own (removed when it ends): another `up` of the same --name
  neither overwrites nor removes it. An archive that has gone all the same
  (a temporary-file cleaner) fails: packing again would install what the
  checkout holds now."""
  archive = getattr(args, 'setup_archive', None)
  if archive:
    if runner.dry_run or os.path.exists(archive):
      return archive
    raise SetupArchiveGone(
        f'{archive}, the archive of {path} packed when this command '
        'started, is gone (removed by hand or by a temporary-file cleaner); '
        'not packing the checkout again, which may hold other code by now. '
        'Start `up` again (the run resumes from its checkpoint)')
  folder = tempfile.mkdtemp(prefix='vit_jax_setup_')
  atexit.register(shutil.rmtree, folder, ignore_errors=True)
  archive = os.path.join(folder, f'{args.name}.tar.gz')
  runner.run([sys.executable, '-m', 'vit_jax.launch.pack', path, archive])
  args.setup_archive = archive
  return archive


def _run_reconnecting(runner: Runner, args, *argvs,
                      capture: bool = False) -> Result:
  """Runs ssh/scp steps in order, all of them again where ssh itself failed
  (exit 255: a new TPU's workers often refuse the first connections while
  its keys propagate), at most MAX_REATTACH more times; the last step's
  result (its output kept with `capture`). The steps together must be
  safe to repeat."""
  for attempt in range(MAX_REATTACH + 1):
    for argv in argvs:
      res = runner.run(argv, check=False, capture=capture)
      if res.returncode:
        break
    if res.returncode != SSH_FAILED or attempt == MAX_REATTACH:
      break
    runner.note(f'ssh failed (exit {SSH_FAILED}): trying again in '
                f'{args.poll_seconds:g} s')
    time.sleep(args.poll_seconds)
  if res.returncode:
    raise CommandError(argv, res)
  return res


def _all_idle(runner: Runner, args, refused: str) -> None:
  """Asks every worker whether a run is going; one going on any of them
  (a slice's workers stop at different moments) refuses the step on all,
  naming them (`refused`: what was done, e.g. 'started nothing'). Each
  worker's own guard (`commands.idle_guard`) alone would act on the idle
  workers and refuse on the busy ones: a slice half running, its
  collectives waiting for peers that never come, or with mixed code.
  (Reconnecting: `setup` right after `create` asks a new TPU's workers.)"""
  ask = commands.ssh(_tpu(args), commands.status_script())
  res = _run_reconnecting(runner, args, ask, capture=True)
  busy = [r for r in commands.parse_status(res.stdout)
          if r.state == 'running']
  if busy:
    raise CommandError(ask, Result(1, stderr=(
        f'a run is still going on {", ".join(r.host for r in busy)}: '
        f'{refused}. Wait for it to end (python -m launch.tpu logs '
        f'{_where(args)} --worker=N), or stop it, saving a checkpoint: '
        f'python -m launch.tpu exec {_where(args)} -- '
        '\'kill $(cat ~/vit_jax_run.pid)\'')))


def _start(runner: Runner, args) -> None:
  """Starts the run on every worker, or on none (`_all_idle`), with the
  flags `_preflight` pinned."""
  _all_idle(runner, args, 'started nothing')
  runner.run(commands.ssh(_tpu(args), commands.run_script(
      args.main_args, dict(args.env))))


def _logs_argv(args, last: Optional[int] = None) -> list:
  return commands.ssh(_tpu(args), commands.logs_script(last),
                      worker=args.worker or '0')


def _delete(runner: Runner, args, missing_ok: bool = True) -> None:
  """Deletes the TPU; with `missing_ok` (`up`'s own TPU), one that is
  already gone (NOT_FOUND) is no error."""
  argv = commands.delete(_tpu(args))
  res = runner.run(argv, check=False, capture=True)
  if res.returncode and missing_ok and 'NOT_FOUND' in res.stderr:
    runner.note(f'{args.name} was already gone')
  elif res.returncode:
    raise CommandError(argv, res)


def _copy_results(runner: Runner, args) -> None:
  runner.run(['mkdir', '-p', args.results])
  if args.workdir.startswith('gs://'):
    runner.run(commands.storage_cp(args.workdir, args.results, args.project))
  else:
    runner.run(commands.scp_from_worker(_tpu(args), args.workdir,
                                        args.results))


def _worker_0(runner: Runner, args) -> Optional[commands.WorkerRun]:
  """Worker 0's run (running, exited N or no run); None if it did not
  answer."""
  res = runner.run(commands.ssh(_tpu(args), commands.status_script(),
                                worker='0'),
                   capture=True, check=False, echo=False,
                   dry_stdout='w-0: running | ')
  runs = commands.parse_status(res.stdout)
  return runs[0] if not res.returncode and runs else None


def _run_state(runner: Runner, args) -> Optional[str]:
  """Worker 0's run: 'running', 'exited N' or 'no run'; None if it did not
  answer."""
  run = _worker_0(runner, args)
  return run.state if run else None


def _hung(runner: Runner, args) -> bool:
  """Whether worker 0's run has written no log line for --hang-minutes: a
  slice whose run waits forever (a collective missing a peer that neither
  died nor answers, a stalled input read) bills every chip until someone
  looks."""
  run = _worker_0(runner, args)
  idle = run.log_idle_s if run and run.state == 'running' else None
  if idle is None or idle < args.hang_minutes * 60:
    return False
  runner.note(f'worker 0\'s log has not grown for {idle / 60:.0f} minutes '
              f'(--hang-minutes={args.hang_minutes:g}; its last line: '
              f'{run.last_line or "(empty)"}): the run is taken as hung')
  return True


def _ended(runner: Runner, exit_code: int, state: str) -> str:
  """The outcome of a run that exited with `exit_code` on a TPU in
  `state`. A run ended by a SIGTERM (143: before vit_jax.main could catch
  it, or its wrapper's trap fired) on a READY TPU was stopped, not
  broken (a preemption's SIGTERM comes while the node still reads READY):
  resumed, as one that saved."""
  if exit_code == 0:
    return 'done'
  if exit_code == EXIT_PREEMPTED:
    runner.note('the run saved a checkpoint on a preemption signal '
                f'(exit {exit_code})')
    return 'saved'
  if exit_code == commands.EXIT_SIGTERM and state == 'READY':
    runner.note(f'the run was stopped by a SIGTERM (exit {exit_code}), '
                'before it could save: taken as a preemption; it resumes '
                'from its last checkpoint')
    return 'saved'
  runner.note(f'the run failed (exit {exit_code}; TPU {state})')
  return 'failed'


def _watch(runner: Runner, args) -> str:
  """Streams worker 0's log to the end: 'done', 'failed', 'saved' (the run
  saved and exited on a preemption signal) or 'preempted' (the TPU went).

  Every --poll-seconds while it streams, the node's state is read. When the
  stream ends on a healthy node, worker 0 is asked how the run ended: a
  stream that broke (ssh or gcloud failing, the run going on) reattaches;
  only a run that exited non-zero fails. A few reattaches in a row without
  worker 0 answering fail too, and so does a run whose worker-0 log has not
  grown for --hang-minutes (asked every HANG_CHECK_S).
  """
  runner.note(f'while the log streams, the TPU state is read every '
              f'{args.poll_seconds:g} s: ' + shlex.join(
                  commands.describe(_tpu(args))) + f'; on '
              f'{"/".join(_gone(args))}: delete, create, setup and run '
              f'again (at most {args.max_restarts} times)' + (
                  f'; a run whose worker-0 log stays idle for '
                  f'{args.hang_minutes:g} minutes fails as hung'
                  if args.hang_minutes else ''))
  reattached = 0
  hang_check_every = max(HANG_CHECK_S, args.poll_seconds)
  hang_checked = time.monotonic()
  stream = runner.start(_logs_argv(args))
  try:
    while True:
      code = stream.wait(args.poll_seconds)
      if code in (0, EXIT_PREEMPTED):  # Done, or saved on SIGTERM / a notice.
        stream.stop()
        return _ended(runner, code, 'READY')
      state = _state(runner, args)
      if state in _gone(args):
        stream.stop()
        runner.note(f'{args.name} is {state}')
        return 'preempted'
      if code is None:
        if (args.hang_minutes and state == 'READY' and
            time.monotonic() - hang_checked >= hang_check_every):
          hang_checked = time.monotonic()
          if _hung(runner, args):
            stream.stop()
            return 'failed'
        continue
      run = _run_state(runner, args) if state == 'READY' else None
      if run is not None and run.startswith('exited'):
        return _ended(runner, int(run.split()[1]), state)
      if run == 'no run':
        runner.note(f'no run on worker 0 (log stream exit {code})')
        return 'failed'
      if run == 'running':
        reattached = 0  # Worker 0 answered: only the stream broke.
      elif reattached == MAX_REATTACH:
        runner.note(f'worker 0 did not answer {MAX_REATTACH + 1} times in a '
                    f'row (exit {code}; TPU {state}): the run failed')
        return 'failed'
      else:
        reattached += 1
      runner.note(f'lost worker 0\'s log (exit {code}; TPU {state}; run '
                  f'{run or "unknown"}): reattaching (from its last '
                  f'{commands.REATTACH_LINES} lines; the whole log stays on '
                  'the worker: launch.tpu logs)')
      time.sleep(args.poll_seconds)
      stream = runner.start(_logs_argv(args, last=commands.REATTACH_LINES))
  except BaseException:  # Interrupted: no more log lines after the hint.
    stream.stop()
    raise


# --------------------------------------------------------------------------
# Verbs.


def cmd_create(args, runner: Runner) -> int:
  if not confirm(args, runner, describe_launch(args)):
    return 1
  _create(runner, args)
  return 0


def cmd_setup(args, runner: Runner) -> int:
  """Installs on every worker or on none (`_all_idle`): a run going on one
  keeps its code, the others would get new code under the same slice.
  (`up` installs only on a TPU it has just created, where no run can be,
  and whose new workers may refuse the first ssh connections.)"""
  _all_idle(runner, args, 'installed nothing')
  _setup(runner, args)
  return 0


def _begin(args, runner: Runner) -> Optional[int]:
  """Pre-flight, estimate and confirmation shared by `run` and `up`; an
  exit code when there is nothing more to do (refused, or ran locally)."""
  if not args.local_processes:
    _preflight(args, runner)
  if not confirm(args, runner, describe_launch(args)):
    return 1
  if args.local_processes:
    return _run_local(args, runner)
  return None


def _where(args) -> str:
  """The arguments that name this TPU in a follow-up command (its project
  too: gcloud's default one may hold a TPU of the same name)."""
  return shlex.join([f'--name={args.name}', f'--zone={args.zone}'] + (
      [f'--project={args.project}'] if args.project else []))


def cmd_run(args, runner: Runner) -> int:
  code = _begin(args, runner)
  if code is not None:
    return code
  _start(runner, args)
  runner.note(f'started on every worker of {args.name}; follow worker 0 '
              f'with: python -m launch.tpu logs {_where(args)}')
  return 0


def _run_local(args, runner: Runner) -> int:
  """In this command's folder, as a `python -m vit_jax.main` typed here
  would run (the processes import vit_jax as this launcher did; relative
  paths in --config.FIELD values mean the same), never ROOT: installed,
  that is the package's own folder, where vit_jax/inspect/ hides the
  standard library's `inspect`. The --config file and --workdir are made
  absolute (`_main_args`)."""
  return local.run(runner, args.local_processes,
                   _main_args(args, remote=False), dict(args.env),
                   cwd=os.getcwd())


def cmd_logs(args, runner: Runner) -> int:
  code = runner.run(_logs_argv(args), check=False).returncode
  if code not in (0, EXIT_PREEMPTED):
    _first_failure(runner, args)
  if args.results:
    _copy_results(runner, args)
  return code


def cmd_status(args, runner: Runner) -> int:
  res = runner.run(commands.describe(_tpu(args)), check=False, capture=True,
                   dry_stdout='READY')
  state = res.stdout.strip() or res.stderr.strip()
  runner.note(f'{args.name}: {state}')
  if res.returncode or state != 'READY':
    return res.returncode or 1
  return runner.run(commands.ssh(_tpu(args), commands.status_script()),
                    check=False).returncode


def cmd_exec(args, runner: Runner) -> int:
  return runner.run(commands.ssh(
      _tpu(args), commands.exec_script(args.command),
      worker=args.worker or 'all'), check=False).returncode


def cmd_delete(args, runner: Runner) -> int:
  what = 'queued resource and TPU' if args.queued else 'TPU'
  if not confirm(args, runner, [f'delete {what} {args.name} in {args.zone}']):
    return 1
  _delete(runner, args, missing_ok=False)  # NOT_FOUND: a wrong name or zone?
  return 0


def _launch(runner: Runner, args, created: list,
            start_after: float = 0.0) -> str:
  """create + setup + run: 'started', 'preempted' if the TPU went, or
  'unavailable' if, recreating one, it could not be created (no capacity
  after a preemption is common: the next restart tries again, later). The
  run starts no earlier than `start_after` (`time.monotonic()`)."""
  first = not created
  try:
    _create(runner, args, created)
  except CommandError as e:
    if first:  # Nothing to resume: the user's settings are likely wrong.
      raise
    runner.note(f'recreating {args.name} failed: {e}')
    return 'unavailable'
  try:
    _setup(runner, args)
    wait = start_after - time.monotonic()
    if wait > 0 and not runner.dry_run:
      runner.note(f'waiting {wait:.0f} s before starting: the run that died '
                  'with the old TPU holds the workdir\'s lock until it is '
                  f'stale ({LOCK_STALE_S:g} s without a heartbeat)')
      time.sleep(wait)
    _start(runner, args)
    created.append('run')  # A run started: its logs are worth keeping.
  except CommandError as e:
    if runner.dry_run:
      raise
    if _state(runner, args) in _gone(args):
      return 'preempted'
    if first:  # Nothing to resume: the user's settings are likely wrong.
      raise
    # A recreated TPU whose setup failed (a PyPI or network hiccup): the
    # same command worked before; try again with a fresh TPU.
    runner.note(f'setting up the recreated {args.name} failed: {e}')
    return 'preempted'
  return 'started'


def _recreate_wait(args, failures: int) -> float:
  """Seconds before recreating after `failures` (>= 1) failed recreations
  in a row: --poll-seconds, doubled each time, at most RECREATE_WAIT_MAX_S
  (capacity that is short after a preemption often takes hours to return;
  asking every poll would use up --max-restarts in minutes)."""
  return min(args.poll_seconds * 2 ** (failures - 1),
             max(args.poll_seconds, RECREATE_WAIT_MAX_S))


def _up_loop(runner: Runner, args, created: list) -> str:
  restarts, start_after, unavailable = 0, 0.0, 0
  outcome = _launch(runner, args, created, start_after)
  while True:
    if outcome == 'started':
      unavailable = 0
      outcome = _watch(runner, args)
      if outcome == 'preempted':  # The run died with its TPU, unsaved.
        start_after = time.monotonic() + LOCK_STALE_S
    if outcome not in ('preempted', 'saved', 'unavailable'):
      return outcome
    if restarts == args.max_restarts:
      runner.note(f'stopped again after {restarts} restart(s): giving up '
                  f'(--max-restarts={args.max_restarts})')
      return 'failed'
    restarts += 1
    if outcome == 'unavailable':
      unavailable += 1
      wait = _recreate_wait(args, unavailable)
      runner.note(f'trying to recreate {args.name} again in {wait:.0f} s '
                  f'({unavailable} failed recreation(s) in a row; the wait '
                  f'doubles up to {RECREATE_WAIT_MAX_S / 60:.0f} minutes)')
      if not runner.dry_run:
        time.sleep(wait)
    if outcome == 'saved':
      # A preemption's SIGTERM comes while the node still reads READY: ask
      # again after a poll. Still READY (a checkpoint store that was
      # unavailable, a SIGTERM that was no preemption): run again on it,
      # keeping its disks and place; a deleted slice may not come back.
      if not runner.dry_run:
        time.sleep(args.poll_seconds)
      state = _state(runner, args)
      if state == 'READY':
        runner.note(f'the run stopped on {args.name}, which is '
                    f'still READY: starting it again there; it resumes from '
                    f'its checkpoint in {args.workdir} (restart {restarts}/'
                    f'{args.max_restarts})')
        try:
          _start(runner, args)
          outcome = 'started'
          continue
        except CommandError as e:
          runner.note(f'starting it again on {args.name} failed: {e}')
    runner.note(f'{"" if outcome == "unavailable" else "preempted: "}'
                f'recreating {args.name}; the run resumes from '
                f'its checkpoint in {args.workdir} (restart {restarts}/'
                f'{args.max_restarts})')
    _delete(runner, args)
    outcome = _launch(runner, args, created, start_after)


def _pin_repo(runner: Runner, args) -> None:
  """A `--repo=URL#REF` (or URL: its HEAD) names its commit now, so every
  TPU `up` recreates clones the code the run started with, not a branch
  that moved on (`git ls-remote` here; unresolved: a warning)."""
  _, url, ref = _repo(args.repo)
  if not url or (ref and re.fullmatch(r'[0-9a-fA-F]{7,40}', ref)):
    return  # A commit already (a branch named like a sha would be too).
  want = ref or 'HEAD'
  # Never a prompt (a private repository's password, an unknown host key):
  # an answer or a failure, and then the warning below. Your own
  # GIT_SSH_COMMAND (a key) is kept, in batch mode.
  ssh = os.environ.get('GIT_SSH_COMMAND') or 'ssh'
  try:
    result = runner.run(['env', 'GIT_TERMINAL_PROMPT=0',
                         f'GIT_SSH_COMMAND={ssh} -o BatchMode=yes', 'git',
                         'ls-remote', url, want], capture=True, check=False)
  except CommandError as e:  # No git here.
    result = e.result
  found = dict(reversed(line.split('\t', 1)) for line in
               result.stdout.splitlines() if '\t' in line)
  sha = next((found[name] for name in (
      want, f'refs/heads/{want}', f'refs/tags/{want}^{{}}',
      f'refs/tags/{want}') if name in found), None)
  if runner.dry_run:
    return
  if result.returncode or not sha:
    runner.note(f'warning: could not resolve {want} of {url} to a commit '
                f'here ({(result.stderr or "no such ref").strip()[-200:]}); '
                'a recreated TPU clones it again and may get newer code: '
                'pin a commit, --repo=URL#<sha>')
    return
  args.repo = f'{url}#{sha}'
  runner.note(f'--repo: {want} of {url} is {sha} now; every TPU this `up` '
              'creates installs that commit')


def _delete_hint(args) -> str:
  return (f'python -m launch.tpu delete {_where(args)}' +
          ' --queued' * args.queued)


def cmd_up(args, runner: Runner) -> int:
  """Ctrl-C, SIGTERM or SIGHUP (`timeout`, a CI job's limit, a closed
  terminal) detach: the TPU and its run go on, the commands to follow and
  delete it are printed, and the exit status is 128 + the signal's number
  (130, 143, 129), as a local launch's."""
  code = _begin(args, runner)
  if code is not None:
    return code
  _pin_repo(runner, args)
  created, outcome = [], None
  with local.signals_interrupt():
    try:
      outcome = _up_outcome(runner, args, created)
      if outcome is None:
        return 1
      return _finish(runner, args, outcome, ran='run' in created)
    except (KeyboardInterrupt, local.Interrupted) as e:
      signum = getattr(e, 'signum', signal.SIGINT)
      name = signal.Signals(signum).name
      if outcome is None:
        runner.note(f'{name}: the TPU and its run go on. Follow: python -m '
                    f'launch.tpu logs {_where(args)}; delete: '
                    f'{_delete_hint(args)}')
      else:  # While saving logs, copying results or deleting.
        runner.note(f'{name} while finishing (run {outcome}): the TPU '
                    f'may still exist. Check: python -m launch.tpu status '
                    f'{_where(args)}; delete: {_delete_hint(args)}')
      return 128 + signum


def _up_outcome(runner: Runner, args, created: list) -> Optional[str]:
  """`_up_loop`'s outcome; an error once a TPU was created is a failed
  run (`_finish` then saves the logs, copies the results and deletes the
  TPU), whatever raised it: a failed command, or the unexpected (a bug, a
  checkout that changed under a days-long `up`) that would otherwise
  leave the TPU billing. None: it failed before any TPU was created."""
  try:
    return _up_loop(runner, args, created)
  except local.Interrupted:
    raise
  except (CommandError, SetupArchiveGone) as e:
    print(f'error: {e}', file=sys.stderr)
  except Exception:  # pylint: disable=broad-except
    if not created:
      raise  # Nothing to clean up: `main` says what went wrong.
    traceback.print_exc()
  return 'failed' if created else None


def _first_failure(runner: Runner, args) -> None:
  """Names the worker whose run failed first, with its last log line: on a
  slice the others fail after it (their collectives lose a peer), and
  worker 0's log, the one streamed, seldom holds the cause."""
  res = runner.run(commands.ssh(_tpu(args), commands.status_script()),
                   capture=True, check=False, echo=False,
                   dry_stdout='w-0: exited 1 at 2026-01-01T00:00:00Z | ')
  runs = commands.parse_status(res.stdout)
  failed = sorted((r for r in runs if r.exit_code not in (None, 0)),
                  key=lambda r: r.ended)
  if not failed:  # Hung: the worker whose log went quiet first.
    quiet = max((r for r in runs if r.log_idle_s is not None),
                key=lambda r: r.log_idle_s, default=None)
    if quiet:
      runner.note(f'no worker\'s run failed; the longest silent log: '
                  f'{quiet.host}\'s, {quiet.log_idle_s / 60:.0f} minutes; its '
                  f'last line: {quiet.last_line or "(empty)"}')
    return
  first = failed[0]
  others = [r.host for r in failed[1:]]
  running = [r.host for r in runs if r.state == 'running']
  runner.note(
      f'first to fail: {first.host}, exit {first.exit_code} at '
      f'{first.ended or "an unknown time"}; its last log line: '
      f'{first.last_line or "(empty)"}'
      + (f'; failed after it: {", ".join(others)}' if others else '')
      + (f'; still running: {", ".join(running)}' if running else ''))


def _finish(runner: Runner, args, outcome: str, ran: bool = False) -> int:
  if outcome == 'failed' and ran:  # Before the TPU goes.
    _first_failure(runner, args)
  if outcome == 'failed' and ran and not args.keep:
    res = runner.run(commands.ssh(_tpu(args),
                                  commands.save_logs_script(args.workdir)),
                     check=False)
    if not res.returncode:
      runner.note(f'every worker\'s log: {args.workdir.rstrip("/")}/logs/')
  if args.results:
    try:
      _copy_results(runner, args)
    except CommandError as e:
      print(f'error: {e}', file=sys.stderr)
  if args.keep:
    runner.note(f'{args.name} is kept (--keep); delete it with: '
                f'{_delete_hint(args)}')
  else:
    _delete(runner, args)
  if not runner.dry_run:
    runner.note(f'run {outcome}')
  return 0 if outcome == 'done' else 1


COMMANDS = {'up': cmd_up, 'create': cmd_create, 'setup': cmd_setup,
            'run': cmd_run, 'logs': cmd_logs, 'status': cmd_status,
            'exec': cmd_exec, 'delete': cmd_delete}


def main(argv: Optional[Sequence[str]] = None,
         runner: Optional[Runner] = None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  runner = runner or Runner(dry_run=args.dry_run)
  runner.dry_run = runner.dry_run or args.dry_run
  try:
    return COMMANDS[args.verb](args, runner)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  except CommandError as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    return 130


if __name__ == '__main__':
  sys.exit(main())
