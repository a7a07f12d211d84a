"""The benchmark: train and infer modes on a tiny model, in a process where
TensorFlow, tfds, clu and ml_collections cannot be imported (the GPU
machines lack them)."""

import json
import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

BLOCKED = ('tensorflow', 'tensorflow_datasets', 'clu', 'ml_collections')

_SCRIPT = textwrap.dedent('''
    import importlib.abc, json, sys
    BLOCKED = %r

    class Block(importlib.abc.MetaPathFinder):
      def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in BLOCKED:
          raise ImportError(f'{name} is blocked in this test')
        return None

    sys.meta_path.insert(0, Block())
    from absl import flags
    from vit_jax import bench
    out = {}
    for mode in ('train', 'infer'):
      flags.FLAGS.unparse_flags()
      flags.FLAGS(['bench', '--model=ViT-test', '--batch=2',
                   '--image_size=28', '--num_classes=10', '--steps=1',
                   '--warmup=0', '--nomatmul_peak', f'--mode={mode}',
                   '--pipelined', f'--json={sys.argv[1]}'] +
                  (['--model_option=scan_layers=True'] if mode == 'infer'
                   else []))
      bench.main(['bench'])
      out[mode] = json.load(open(sys.argv[1]))
    out['loaded'] = sorted(m for m in sys.modules
                           if m.split('.')[0] in BLOCKED)
    print(json.dumps(out))
''') % (BLOCKED,)


def test_bench_runs_without_tensorflow_clu_ml_collections(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)
  out = subprocess.run(
      [sys.executable, '-c', _SCRIPT, str(tmp_path / 'res.json')],
      capture_output=True, text=True, env=env, cwd=str(tmp_path))
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads(out.stdout.strip().splitlines()[-1])
  assert res['loaded'] == []
  train, infer = res['train'], res['infer']
  assert train['mode'] == 'train' and infer['mode'] == 'infer'
  assert train['img_per_s'] > 0 and infer['img_per_s'] > 0
  assert 0 < train['loss'] < 10
  for r in (train, infer):
    assert r['img_per_s_pipelined'] == 2 / r['step_s_pipelined'] > 0
    assert r['peak_host_memory_gb'] > 0.1
    assert r['compiled_argument_gb'] > 0
  assert infer['model_options'] == 'scan_layers=True'
  assert 'model_options' not in train
  assert (train['steps'], train['warmup'], train['accum_steps']) == (1, 0, 1)
  # FLOPs of the model as built: --model_option=patch_size=2 is 4x the
  # tokens of ViT-test's 4 (the zoo name's count was kept).
  from vit_jax import bench
  small = bench.bench_infer('ViT-test', 1, image_size=28, num_classes=10,
                            steps=1, warmup=0, measure_peak=False,
                            model_options={'patch_size': 2})
  assert small['forward_gflops'] > 3 * infer['forward_gflops']
  # The train step holds Adam's two moments besides the parameters.
  assert train['compiled_argument_gb'] > 2.5 * infer['compiled_argument_gb']


def test_peers_table_ratios_per_round():
  from benchmarks import peers
  args = peers._parser().parse_args(['--rounds=2', '--steps=3'])
  rows = {
      'ours|train|float32': [{'img_per_s': 2.0, 'peak_host_memory_gb': 3.0},
                             {'img_per_s': 1.0, 'peak_host_memory_gb': 3.2}],
      'hf|train|float32': [{'img_per_s': 1.0, 'peak_host_memory_gb': 2.5,
                            'peak_device_memory_gb': 17.7},
                           {'img_per_s': 1.5, 'peak_host_memory_gb': 2.4,
                            'peak_device_memory_gb': 17.5}],
      'ours|train|bfloat16': [
          {'img_per_s': 3.0, 'peak_host_memory_gb': 2.0,
           'cpu_matmul_form': 'bf16'}, {'error': 'boom'}],
  }
  meta = {'date': 'today', 'machine': 'a CPU', 'versions': {'jax': '0'},
          'load_before': (1.0, 0, 0), 'load_after': (2.0, 0, 0),
          'command': 'python -m benchmarks.peers'}
  text = peers.table({'meta': meta, 'rows': rows,
                      'unavailable': {'timm': 'import timm fails'}}, args)
  assert '| ours | train | float32 | 2.00, 1.00 | 1 | 3.20 | - |' in text
  assert ('| hf | train | float32 | 1.00, 1.50 | 0.50, 1.50 | 2.50 | 17.70 |'
          in text)
  assert ('| ours (CPU matmul form bf16) | train | bfloat16 | 3.00, error |'
          in text)
  assert 'timm: unavailable (import timm fails)' in text
  assert 'a CPU' in text and 'load average 1.0 before, 2.0 after' in text


def test_model_options_parsed_and_bad_ones_named():
  import pytest
  from absl import app
  from vit_jax import bench
  assert bench._parse_options(['remat=dots_saveable', 'scan_layers=True',
                               'stochastic_depth=0.1', 'num_layers=2',
                               'representation_size=none',
                               'resnet_layers=(1,1,1)']) == {
      'remat': 'dots_saveable', 'scan_layers': True,
      'stochastic_depth': 0.1, 'num_layers': 2,
      'representation_size': None, 'resnet_layers': (1, 1, 1)}
  with pytest.raises(app.UsageError, match='remat.*key=value'):
    bench._parse_options(['remat'])


def test_variants_benchmark_runs():
  """`python -m benchmarks.variants` (docs/models.md's remat table) runs:
  the memory of each value (timing skipped: compiles only)."""
  out = subprocess.run(
      [sys.executable, '-m', 'benchmarks.variants', '--option=remat',
       '--values=nothing_saveable', '--model=ViT-test', '--batch=2',
       '--time_model='],
      capture_output=True, text=True, cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'remat=nothing_saveable' in out.stdout
  assert 'temporaries' in out.stdout


def test_op_profile_categorises_ops_by_what_they_compute():
  """XLA:CPU names reductions it hands to YNNPACK `ynn_fusion` like its
  matmuls; the profile's categories come from the compiled HLO instead."""
  import jax
  import jax.numpy as jnp
  from benchmarks import op_profile
  y = jnp.ones((8, 197, 64))
  text = jax.jit(lambda y: y.sum((0, 1))).lower(y).compile().as_text()
  ops = op_profile.fused_ops(text)
  reductions = {n: o for n, o in ops.items() if 'reduce' in o}
  assert any(n.startswith('ynn_fusion') for n in reductions)  # The trap.
  assert reductions and all(op_profile.category(n, o) == op_profile.REDUCTION
                            for n, o in reductions.items())
  text = jax.jit(lambda a, b: a @ b).lower(y[0], y[0].T).compile().as_text()
  ops = op_profile.fused_ops(text)
  assert op_profile.MATMUL in {op_profile.category(n, o)
                               for n, o in ops.items()}


def test_op_profile_profiles_the_eval_forward(capsys):
  """`--mode=infer` profiles the logits pass that `vit_jax.bench
  --mode=infer` times: no optimizer state, no backward ops."""
  from benchmarks import op_profile
  op_profile.main(['--model=ViT-Ti/16', '--batch=2', '--image_size=32',
                   '--dtype=float32', '--mode=infer', '--steps=1',
                   '--top=50'])
  out = capsys.readouterr().out
  assert 'float32 infer:' in out
  assert op_profile.MATMUL in out
  assert 'transpose(jvp' not in out  # Only train steps have a backward.


def test_op_profile_puts_pytorch_ops_in_the_same_categories():
  from benchmarks import op_profile as op
  expected = {
      'aten::mm': op.MATMUL, 'aten::addmm': op.MATMUL, 'aten::bmm': op.MATMUL,
      'aten::_scaled_dot_product_flash_attention_for_cpu_backward':
          op.ATTENTION,
      'aten::native_layer_norm_backward': op.REDUCTION,
      'aten::_softmax': op.REDUCTION, 'aten::linalg_vector_norm': op.REDUCTION,
      'aten::convolution_backward': 'convolution',
      'aten::_to_copy': op.CONVERT, 'aten::copy_': op.TRANSPOSE,
      'aten::gelu_backward': op.ELEMENTWISE, 'aten::addcdiv_': op.ELEMENTWISE,
      'aten::mul_': op.ELEMENTWISE,  # Not a matmul: a whole-name match.
      'Optimizer.step#AdamW.step': op.FRAMEWORK,
      'autograd::engine::evaluate_function: AddmmBackward0': op.FRAMEWORK,
  }
  assert {n: op.torch_category(n) for n in expected} == expected


def test_op_profile_profiles_a_pytorch_peer_in_the_same_categories(capsys):
  """`--peer=hf`: the Hugging Face step that `benchmarks.peers` times,
  under torch.profiler, with its matmuls, attention and optimizer found."""
  import pytest
  pytest.importorskip('torch')
  pytest.importorskip('transformers')
  from benchmarks import op_profile
  op_profile.main(['--peer=hf', '--model=ViT-Ti/16', '--batch=2',
                   '--image_size=32', '--dtype=float32', '--steps=1'])
  out = capsys.readouterr().out
  assert 'hf (PyTorch' in out and 'float32 train:' in out
  for cat in (op_profile.MATMUL, op_profile.ATTENTION, op_profile.REDUCTION,
              op_profile.FRAMEWORK):
    assert cat in out
  assert 'aten::addcdiv_' in out or 'aten::_foreach' in out  # AdamW ran.


def test_max_batch_stops_at_the_first_failure_and_names_the_largest(
    monkeypatch, capsys):
  from benchmarks import max_batch
  tried = []

  def run_one(args, batch):
    tried.append(batch)
    if batch >= 8:
      return {'batch': batch, 'error': 'RESOURCE_EXHAUSTED: Out of memory'}
    return {'batch': batch, 'img_per_s': 10.0 * batch, 'compile_s': 3.0,
            'device_kind': 'fake', 'mfu_nominal': 0.25,
            'peak_device_memory_gb': batch / 2}

  monkeypatch.setattr(max_batch, 'run_one', run_one)
  max_batch.main(['--batches=16,4,8,2'])
  out = capsys.readouterr().out
  assert tried == [2, 4, 8]  # Ascending; nothing after the failure.
  assert '| 4 | 40.0 | 25.0% | 2.0 | 3 |' in out
  assert '| 8 | failed: RESOURCE_EXHAUSTED' in out
  assert 'largest batch that ran: 4' in out


def test_loss_curves_compare_across_backends(tmp_path, capsys):
  """The curve runs the real train step on real digits, no TensorFlow; a
  curve compares equal to itself and a drifted one fails --rtol."""
  import pytest
  from benchmarks import losses
  batch = next(losses.digits_batches(8, 32, 1))
  assert batch['image'].shape == (8, 32, 32, 3)
  assert batch['image'].min() == -1.0 and batch['image'].max() == 1.0
  path = tmp_path / 'cpu.json'
  losses.main(['--model=ViT-test', '--image_size=32', '--batch=8',
               '--steps=2', f'--json={path}'])
  curve = json.loads(path.read_text())
  assert len(curve['losses']) == 2 and curve['backend'] == 'cpu'
  assert abs(curve['losses'][0] - 2.3026) < 0.05  # ln(10): a fresh head.
  drifted = dict(curve, losses=[x * 1.02 for x in curve['losses']])
  assert losses.compare(curve, curve, rtol=1e-2)
  assert not losses.compare(drifted, curve, rtol=1e-2)
  with pytest.raises(SystemExit, match='batch 16 vs 8'):
    losses.compare(dict(curve, batch=16), curve, rtol=1e-2)


def test_op_profile_reads_the_device_timeline():
  """On a GPU the device plane's kernels count (host events do not): a
  kernel replayed from a CUDA graph under the fusion it runs, a library
  kernel under its own name, categorised by what it computes."""
  from types import SimpleNamespace as NS
  from benchmarks import op_profile
  hlo = '\n'.join([
      'ENTRY %main (p: f32[4]) -> f32[4] {',
      '  %loop_add_fusion.3 = f32[4]{0} fusion(%p), kind=kLoop, '
      'calls=%fused_add.3',
      '  %custom-call.7 = (bf16[2,8]{1,0}, u8[0]{0}) custom-call(%a, %b), '
      'custom_call_target="__cudnn$fmhaSoftmax"',
      '}'])
  ev = lambda name, ns, **stats: NS(name=name, duration_ns=ns,
                                    stats=list(stats.items()))
  profile = NS(planes=[
      NS(name='/host:CPU', lines=[NS(name='python', events=[
          ev('loop_add_fusion.3', 10**9)])]),
      NS(name='/device:GPU:0', lines=[NS(name='Stream #14(Compute)', events=[
          ev('loop_add_fusion_3', 4000, hlo_op='command_buffer_2'),
          ev('loop_add_fusion_3', 2000),
          ev('nvjet_sm90_tst_128x128_64x6_2x1_v_bz_TNT', 6000,
             hlo_op='command_buffer_2'),
          ev('sdpa_flash_fprop', 8000, hlo_op='custom-call.7')])])])
  times = op_profile.op_times(profile, hlo, steps=2)
  assert times == {'loop_add_fusion.3': 3000,
                   'nvjet_sm90_tst_128x128_64x6_2x1_v_bz_TNT': 3000,
                   'custom-call.7': 4000}
  ops = op_profile.fused_ops(hlo)
  assert op_profile.category('custom-call.7', ops['custom-call.7']) == (
      op_profile.ATTENTION)
  assert op_profile.category(
      'nvjet_sm90_tst_128x128_64x6_2x1_v_bz_TNT') == op_profile.MATMUL
  # The CPU matmul form 'onednn': its products are custom calls.
  assert op_profile.category('ffi_call.3', frozenset(
      {'custom-call:vit_jax_onednn_matmul'})) == op_profile.MATMUL


def test_op_profile_counts_an_ops_thread_pool_tasks_on_cpu():
  """On XLA:CPU an Eigen dot's event covers only its dispatch; its blocks
  run as thread-pool tasks outside any op's event, on every thread. They
  count for the op that scheduled them, directly or through a task, and a
  thunk run inside a task counts for itself. YNNPACK kernels share their
  helpers: one works for the kernel running beside it."""
  from types import SimpleNamespace as NS
  from benchmarks import op_profile
  hlo = '\n'.join(['  %dot_general.4 = f32[8,8]{1,0} dot(%a, %b)',
                   '  %add_fusion.2 = f32[8]{0} fusion(%c), kind=kLoop',
                   '  %ynn_fusion.5 = f32[8,8]{1,0} fusion(%d), kind=kCustom',
                   '  %ynn_fusion.6 = f32[] fusion(%e), kind=kCustom'])
  start, stop, record = (f'ThreadpoolListener::{k}' for k in (
      'StartRegion', 'StopRegion', 'Record'))
  ev = lambda t, d, name, **stats: NS(start_ns=t, duration_ns=d, name=name,
                                      stats=list(stats.items()))
  a = [ev(0, 10, 'dot_general.4'), ev(5, 0, record, _p=1),  # In the dot.
       ev(20, 0, start, _c=2), ev(120, 0, stop),  # A grandchild task.
       ev(200, 0, start, _c=3), ev(210, 30, 'ThunkExecutor::Execute'),
       ev(210, 30, 'add_fusion.2'), ev(260, 0, stop),  # A thunk in a task.
       ev(300, 0, start, _c=9), ev(310, 0, stop),  # Nobody's.
       ev(390, 5, 'ynn_fusion.6'), ev(392, 0, record, _p=7),
       ev(410, 0, start, _c=7), ev(490, 0, stop)]  # Helps ynn_fusion.5.
  b = [ev(12, 0, start, _c=1), ev(15, 0, record, _p=2), ev(100, 0, stop),
       ev(150, 0, record, _p=3),  # Outside any op or task.
       ev(400, 70, 'ynn_fusion.5')]
  profile = NS(planes=[NS(name='/host:CPU', lines=[
      NS(name='tf_XLAEigen/1', events=a), NS(name='tf_XLAEigen/2', events=b),
      NS(name='python', events=[ev(0, 500, 'dot_general.4')])])])
  times = op_profile.op_times(profile, hlo, steps=2)
  assert times == {'dot_general.4': (10 + 88 + 100) / 2,
                   'add_fusion.2': 30 / 2,
                   'ynn_fusion.5': (70 + 60) / 2,  # The helper's overlap.
                   'ynn_fusion.6': (5 + 20) / 2,  # The rest of it.
                   op_profile.UNATTRIBUTED: (60 - 30 + 10) / 2}
  assert op_profile.category(op_profile.UNATTRIBUTED) == (
      op_profile.UNATTRIBUTED)


def test_peers_give_huge_pages_as_each_command_would(monkeypatch):
  """`--huge_pages=own`: ours in the environment `python -m vit_jax.main`
  restarts itself in, PyTorch in this process's; `all` and `none` give
  every implementation the same."""
  import subprocess
  from types import SimpleNamespace
  from benchmarks import peers
  from vit_jax import hugepages
  monkeypatch.delenv('GLIBC_TUNABLES', raising=False)
  monkeypatch.delenv(hugepages.ENV, raising=False)
  monkeypatch.setattr(hugepages, 'environ', lambda: {
      'GLIBC_TUNABLES': hugepages.TUNABLE})
  seen = {}

  def run(cmd, env, **kwargs):
    seen[cmd[4]] = env
    return SimpleNamespace(returncode=0, stdout='{}', stderr='')
  monkeypatch.setattr(subprocess, 'run', run)
  for choice, ours, hf in [('own', True, False), ('all', True, True),
                           ('none', False, False)]:
    args = peers._parser().parse_args([f'--huge_pages={choice}'])
    for peer in ('ours', 'hf'):
      peers._run_one(args, peer, 'train', 'float32')
    for peer, want in (('ours', ours), ('hf', hf)):
      env = seen[f'--peer={peer}']
      assert (env.get('GLIBC_TUNABLES') == hugepages.TUNABLE) == want, (
          choice, peer)
    assert (seen['--peer=hf'].get(hugepages.ENV) == '0') == (
        choice == 'none')


def test_attention_benchmark_times_each_peer_in_its_own_process():
  """`python -m benchmarks.attention` (docs/performance.md's attention
  table): every implementation and pass gets a figure per round, ours
  labelled with the attention implementation that ran; a peer that cannot
  run is named with the reason instead of failing the table."""
  from benchmarks import attention
  text = attention.main(['--batch=1', '--tokens=9', '--heads=2',
                         '--head_dim=8', '--rounds=2', '--repeats=2',
                         '--peers=ours'])
  rows = {line.split('|')[2].strip(): line.split('|')[3]
          for line in text.splitlines() if line.startswith('| ours (xla) |')}
  assert set(rows) == set(attention.PASSES)
  for figures in rows.values():
    assert len(figures.split(',')) == 2
    assert all(float(f) > 0 for f in figures.split(','))
  failed = attention.table({'torch': 'failed (no torch)'},
                           attention._parser().parse_args([]))
  assert '| torch | - | failed (no torch) |' in failed


def test_trace_benchmark_times_both_forms_of_the_step():
  from benchmarks import trace
  times = trace.measure('ViT-test', 'float32', batch=2, image_size=16,
                        rounds=1)
  assert set(times) == {'mesh step', 'platform switch'}
  assert all(len(v) == 1 and v[0] > 0 for v in times.values())


def test_arguments_that_cannot_be_measured_are_refused():
  """Zero or negative sizes and counts: the flag parser names the flag
  (not a ZeroDivisionError or an img/s for an image of no patches)."""
  import pytest
  from absl import flags as absl_flags
  from vit_jax import bench
  from vit_jax.models.inputs import check_image_shape
  for flag in ('batch', 'steps', 'image_size', 'accum_steps', 'num_classes'):
    with pytest.raises(absl_flags.IllegalFlagValueError):
      bench.FLAGS[flag].parse('0')
  with pytest.raises(absl_flags.IllegalFlagValueError):
    bench.FLAGS['warmup'].parse('-1')
  with pytest.raises(ValueError, match='at least one patch'):
    check_image_shape((1, 0, 0, 3), 16)


def test_an_objective_for_the_infer_mode_is_refused():
  """`--objective=mpp --mode=infer` timed the supervised classifier and
  said nothing; like `--accum_steps`, it is a usage error now."""
  import pytest
  from absl import app
  from absl import flags as absl_flags
  from absl.testing import flagsaver
  from vit_jax import bench
  if not absl_flags.FLAGS.is_parsed():
    absl_flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(objective='mpp', mode='infer', input_only=False):
    with pytest.raises(app.UsageError,
                       match=r'--objective=mpp applies to --mode=train'):
      bench.main(['bench'])


_FAKE_BENCH = '''
import json, os, sys
out = [a.split('=', 1)[1] for a in sys.argv if a.startswith('--json=')]
flags = os.environ.get('XLA_FLAGS', '')
if out:
  with open(out[0], 'w') as f:
    json.dump({'img_per_s': 100.0 + len(flags), 'xla_flags': flags,
               'other': os.environ.get('OTHER')}, f)
'''


def test_gpu_session_passes_each_flag_set_whole_and_writes_json_lines(
    tmp_path):
  """`TRIALS='XLA_FLAGS=--x=1 --y=2|...'` was word-split (`env $ENV`): the
  row ran with `--x=1` only. Each row now gets the whole value, logs the
  XLA_FLAGS it ran with, and json.txt has one JSON object per bench row,
  named, in the order run (it was the JSONs concatenated)."""
  import shutil
  import pytest
  if not shutil.which('bash'):
    pytest.skip('no bash')
  fake = tmp_path / 'fake_bench.py'
  fake.write_text(_FAKE_BENCH)
  out = tmp_path / 'out'
  env = dict(os.environ, OUT=str(out), BUDGET='300', HEAVY='0',
             BENCH=f'{sys.executable} {fake}',
             TRIALS='XLA_FLAGS=--x=1 --y=2| XLA_FLAGS=--z=3;OTHER=a b|BAD')
  env.pop('XLA_FLAGS', None)
  done = subprocess.run(['bash', 'benchmarks/gpu_session.sh'], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = [json.loads(l) for l in (out / 'json.txt').read_text().splitlines()]
  assert [r['name'] for r in rows] == [
      'train', 'trial_0', 'trial_1', 'trial_2', 'train_b', 'trial_0_b',
      'infer']
  by_name = {r['name']: r for r in rows}
  assert by_name['trial_0']['result']['xla_flags'] == '--x=1 --y=2'
  assert by_name['trial_0']['env'] == 'XLA_FLAGS=--x=1 --y=2'
  assert by_name['trial_1']['result'] == {
      'img_per_s': 105.0, 'xla_flags': '--z=3', 'other': 'a b'}
  assert by_name['trial_2']['result'] is None  # Not NAME=VALUE: refused.
  assert by_name['train']['result']['xla_flags'] == ''
  log = (out / 'log.txt').read_text()
  assert 'XLA_FLAGS=--x=1 --y=2\n' in log
  assert "bad variable 'BAD': expected NAME=VALUE" in log
