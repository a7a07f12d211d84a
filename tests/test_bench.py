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
                   '--warmup=0', f'--mode={mode}', f'--json={sys.argv[1]}'])
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
    assert r['peak_host_memory_gb'] > 0.1
    assert r['compiled_argument_gb'] > 0
  # The train step holds Adam's two moments besides the parameters.
  assert train['compiled_argument_gb'] > 2.5 * infer['compiled_argument_gb']
