"""Every command in README.md and docs/*.md is checked against the code.

Commands in fenced code blocks are parsed and validated the cheap way: the
config spec and every `--config.*` override load, flags and arguments are
ones the module accepts, topology and dataset names exist. (What they do is
tested elsewhere: training, evaluation, tables, the launcher's dry runs.)
The README's test command must be what CI runs.
"""

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, 'README.md'),
        *sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md')))]


def _commands(path):
  """`python -m ...` commands in the file's fenced code blocks (not the
  ```text ones: synopses with placeholders)."""
  out, kind, lines = [], None, open(path).read().splitlines()
  i = 0
  while i < len(lines):
    line = lines[i]
    if line.startswith('```'):  # Opens (with its language) or closes.
      kind = (line[3:].strip() or 'plain') if kind is None else None
    elif kind not in (None, 'text'):
      while line.endswith('\\') and i + 1 < len(lines):
        i += 1
        line = line[:-1] + ' ' + lines[i].strip()
      line = re.sub(r'\s+#\s.*$', '', line)  # Trailing comments.
      for part in line.split('&&'):
        part = part.strip().strip('()').strip()
        if part.startswith('python -m ') and ' -- ' not in part:
          out.append(part)
    i += 1
  return out


ALL = [(os.path.relpath(p, ROOT), c) for p in DOCS for c in _commands(p)]


# Shell variables the docs' loops and scripts use, with sample values.
SHELL_VARS = {'$R': '/tmp/r', '$lr': '0.01'}


def _argv(command):
  for var, value in SHELL_VARS.items():
    command = command.replace(var, value)
  assert '$' not in command, f'unknown shell variable in {command}'
  return shlex.split(command)[2:]  # After `python -m`.


def _config(argv):
  from vit_jax.launch import tpu
  spec = next(a.split('=', 1)[1] for a in argv if a.startswith('--config='))
  overrides = [a for a in argv if a.startswith('--config.')]
  path, _, args = spec.partition(':')
  spec = os.path.join(ROOT, path) + (f':{args}' if args else '')
  return tpu.load_config(spec, overrides)


def check_main(argv):
  _config(argv)
  known = ('--config', '--workdir', '--coordinator', '--num_processes',
           '--process_id')
  for a in argv:
    assert a.startswith(known), f'unknown flag {a}'


def check_accounting(argv):
  if any(a.startswith('--config=') for a in argv):
    _config(argv)
  for a in argv:
    assert a.split('=')[0] in ('--config', '--table', '--devices',
                               '--hardware', '--utilization'), a


def check_topology(argv):
  from vit_jax.launch import topology
  topology.parse(argv[1] if argv[0] == 'launch.topology' else argv[0])
  if any(a.startswith('--config=') for a in argv):
    _config(argv)


def check_tpu(argv):
  from vit_jax.launch import tpu
  args = tpu.parse_args(argv)
  if getattr(args, 'config', None):
    _config([f'--config={args.config}'])


def check_tables(argv):
  from vit_jax import tables
  tables._parser().parse_args(argv)


def check_vtab(argv):
  from vit_jax.configs import vtab
  from vit_jax import vtab as driver
  flags = dict(a.lstrip('-').split('=', 1) for a in argv)
  assert set(flags) <= {'config_args', 'workdir', 'tasks'}, flags
  vtab.get_config(flags.get('config_args', ''))
  driver.tasks(flags.get('tasks', 'all').split(','))


def check_predict(argv):
  from vit_jax import predict
  predict._parser().parse_args(argv)


def check_export(argv):
  from vit_jax import export
  from vit_jax.export import __main__ as cli
  args = cli._parser().parse_args(argv)
  export.get(args.format)


def check_prepare(argv):
  from vit_jax.data import registry
  registry.get(argv[0])
  for a in argv[1:]:
    assert a.split('=')[0] in ('--data_dir', '--manual_dir'), a


def check_bench(argv):
  """Flags parse (absl, in a subprocess: its flags are module globals)."""
  code = ('import sys, vit_jax.bench; from absl import flags; '
          'flags.FLAGS(["bench"] + sys.argv[1:])')
  out = subprocess.run([sys.executable, '-c', code, *argv], cwd=ROOT,
                       capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert out.returncode == 0, out.stderr[-2000:]


def check_inspect(argv):
  from vit_jax.inspect import __main__ as cli
  cli._parser().parse_args(argv)


def check_peers(argv):
  from benchmarks import peers
  args = peers._parser().parse_args(argv)
  assert set(args.peers.split(',')) <= set(peers.PEERS), args.peers


def check_attention(argv):
  from benchmarks import attention
  args = attention._parser().parse_args(argv)
  assert set(args.peers) <= set(attention.PEERS), args.peers


def check_losses(argv):
  from benchmarks import losses
  losses._parser().parse_args(argv)


def check_max_batch(argv):
  from benchmarks import max_batch
  max_batch._parser().parse_args(argv)


def check_trace(argv):
  from benchmarks import trace
  trace._parser().parse_args(argv)


def check_op_profile(argv):
  from benchmarks import op_profile
  op_profile._parser().parse_args(argv)
  assert op_profile.category('ynn_fusion.3') != op_profile.category('copy.1')


CHECKS = {
    'vit_jax.main': check_main, 'vit_jax.accounting': check_accounting,
    'launch.topology': check_topology, 'launch.tpu': check_tpu,
    'vit_jax.tables': check_tables, 'vit_jax.vtab': check_vtab,
    'vit_jax.data.prepare': check_prepare, 'vit_jax.bench': check_bench,
    'vit_jax.models': lambda argv: None, 'vit_jax.inspect': check_inspect,
    'vit_jax.predict': check_predict, 'vit_jax.export': check_export,
    'benchmarks.peers': check_peers, 'benchmarks.op_profile': check_op_profile,
    'benchmarks.attention': check_attention,
    'benchmarks.losses': check_losses, 'benchmarks.max_batch': check_max_batch,
    'benchmarks.trace': check_trace,
    # Run as they are by CI (.ci/run) and the README's first command.
    'pip': lambda argv: None, 'pytest': lambda argv: None,
}


def test_the_docs_have_commands():
  modules = {_argv(c)[0] for _, c in ALL}
  assert {'vit_jax.main', 'launch.tpu', 'vit_jax.tables'} <= modules
  assert len(ALL) > 40


@pytest.mark.parametrize('where,command', ALL,
                         ids=[f'{w}:{c[:60]}' for w, c in ALL])
def test_doc_command_is_valid(where, command):
  argv = _argv(command)
  module, rest = argv[0], argv[1:]
  assert module in CHECKS, f'{where}: no check for python -m {module}'
  CHECKS[module](rest)


def test_readme_test_command_is_what_ci_runs():
  readme = open(os.path.join(ROOT, 'README.md')).read()
  ci = open(os.path.join(ROOT, '.ci', 'run')).read()
  command = next(l for l in ci.splitlines() if 'pytest' in l).strip()
  assert command in readme, (command, 'not in README.md')


def _table_rows(text):
  """Markdown table rows, cells stripped (column padding is no difference)."""
  return [tuple(c.strip() for c in l.strip().strip('|').split('|'))
          for l in text.splitlines() if l.startswith('| ')]


@pytest.mark.slow
@pytest.mark.parametrize('command,doc', [
    (['vit_jax.models'], 'README.md'),
    (['vit_jax.accounting', '--table'], os.path.join('docs', 'accounting.md')),
])
def test_printed_tables_in_the_docs_are_the_current_output(command, doc):
  """The README's zoo table and accounting.md's Table 1 / FLOP tables are
  pasted output: every row the command prints is in the page as printed
  (about a minute: XLA's cost analysis of every model)."""
  out = subprocess.run([sys.executable, '-m', *command], cwd=ROOT,
                       capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert out.returncode == 0, out.stderr[-2000:]
  page = set(_table_rows(open(os.path.join(ROOT, doc)).read()))
  rows = _table_rows(out.stdout)
  assert len(rows) > 10
  stale = [r for r in rows if r not in page]
  assert not stale, f'{doc} lacks these rows of {command}: {stale}'


def test_the_dataset_listing_the_docs_point_to_runs():
  """inspect.md and data.md send users to `python -m vit_jax.data` for the
  dataset names: it prints one row per registry name."""
  from vit_jax.data import registry
  out = subprocess.run([sys.executable, '-m', 'vit_jax.data'], cwd=ROOT,
                       capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert out.returncode == 0, out.stderr[-2000:]
  listed = [l.split('|')[1].strip() for l in out.stdout.splitlines()[2:]]
  # This process's registry may hold datasets other tests registered.
  assert listed == [n for n in registry.names() if n in listed]
  assert len(listed) >= 30 and 'vtab/dtd' in listed
  assert '| fashion_mnist | tfds | 10 | train | test | 28 |' in out.stdout
