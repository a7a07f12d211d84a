"""Benchmark the train step (or the input pipeline): `python -m vit_jax.bench`.

    python -m vit_jax.bench --model=ViT-B/16 --batch=8 [--dtype=bfloat16]
        [--mesh=data=-1,fsdp=1,model=1] [--steps=10] [--json=out.json]
        [--objective=mpp]  # masked patch prediction's step instead
    python -m vit_jax.bench --input-only --data=imagenet2012 [--data_dir=DIR]
        [--batch=256] [--image_size=224]

Reports compile time, the median train-step time after warm-up, img/s,
achieved TFLOP/s (3 x XLA forward FLOPs per image, the paper's convention),
MFU against a matmul peak measured in the same run for the same dtype (and
against the nominal peak where the hardware is known), and peak memory.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from typing import Any, Dict

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string('model', 'ViT-B/16', 'Model name from the zoo.')
flags.DEFINE_integer('batch', 8, 'Global batch size.')
flags.DEFINE_integer('image_size', 224, 'Image side in pixels.')
flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'],
                  'Compute dtype (parameters stay float32).')
flags.DEFINE_string('mesh', 'data=-1', 'Mesh axes, e.g. data=-1,fsdp=2.')
flags.DEFINE_integer('steps', 10, 'Timed steps.')
flags.DEFINE_integer('warmup', 2, 'Untimed steps after compilation.')
flags.DEFINE_integer('accum_steps', 1, 'Gradient accumulation steps.')
flags.DEFINE_integer('num_classes', 1000, 'Head size.')
flags.DEFINE_enum('objective', 'supervised', ['supervised', 'mpp'],
                  'Train step objective: supervised or masked patch '
                  'prediction (3-bit mean colour, 50% corrupted).')
flags.DEFINE_string('json', None, 'Write the figures as JSON here.')
flags.DEFINE_bool('input_only', False, 'Benchmark the input pipeline only.')
flags.DEFINE_alias('input-only', 'input_only')
flags.DEFINE_string('data', 'imagenet2012', 'Dataset for --input_only; '
                    '"jpeg_records": 4096 JPEG photo crops (skimage) written '
                    'as TFRecords to a temporary folder, 224-px inception '
                    'pre-processing.')
flags.DEFINE_string('data_dir', None, 'tfds data dir for --input_only.')


def _parse_mesh(spec: str) -> Dict[str, int]:
  out = {}
  for item in filter(None, spec.split(',')):
    key, _, value = item.partition('=')
    if key not in ('data', 'fsdp', 'model') or not value.lstrip('-').isdigit():
      raise app.UsageError(f'--mesh item {item!r}: expected data=N, fsdp=N '
                           'or model=N (one of them may be -1)')
    out[key] = int(value)
  return out


def matmul_peak(dtype, n: int | None = None, repeats: int = 5) -> float:
  """Best FLOP/s of an n x n x n matmul on all local devices together.

  It uses the models' own matmul (`vit_jax.models.matmul.dot_general`: for
  bf16, bf16 operands with float32 accumulation), so MFU compares the step
  with the fastest matmul the model itself can run.
  """
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from vit_jax.models import matmul

  devices = jax.local_devices()
  n = n or (2048 if devices[0].platform == 'cpu' else 8192)
  mesh = jax.make_mesh((len(devices),), ('d',), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,))
  sh = NamedSharding(mesh, P('d'))
  a = jax.device_put(jnp.ones((len(devices), n, n), dtype), sh)
  f = jax.jit(jax.vmap(lambda x: matmul.dot_general(
      x, x, (((1,), (0,)), ((), ())))))
  f(a).block_until_ready()
  best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(repeats))
  return 2.0 * n**3 * len(devices) / best


def _timed(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def peak_memory_bytes() -> Dict[str, Any]:
  import jax
  stats = jax.local_devices()[0].memory_stats() or {}
  if 'peak_bytes_in_use' in stats:
    return {'peak_device_memory_gb': stats['peak_bytes_in_use'] / 2**30}
  # CPU: the process's peak resident memory (Linux reports KiB).
  return {'peak_host_memory_gb':
          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def bench_train_step(model_name: str, batch: int, *, image_size: int = 224,
                     dtype: str = 'float32', mesh_axes=None, steps: int = 10,
                     warmup: int = 2, accum_steps: int = 1,
                     num_classes: int = 1000,
                     objective: str = 'supervised') -> Dict[str, Any]:
  """Measures one configuration; returns the figures as a dict."""
  import jax
  import jax.numpy as jnp
  import ml_collections
  import numpy as np

  from vit_jax import accounting, models
  from vit_jax.train import optim
  from vit_jax import sharding as shd
  from vit_jax.train import step as step_lib

  mesh = shd.make_mesh(**(mesh_axes or {}))
  shd.check_batch_size(batch, mesh, '--batch', accum_steps)
  model = models.create(model_name, num_classes=num_classes,
                        dtype=jnp.dtype(dtype))
  if objective == 'mpp':
    from vit_jax import selfsup
    model = selfsup.from_vit(model)
  tx, lr_fn = optim.make(ml_collections.ConfigDict(dict(
      name='adam', lr=1e-3, warmup_steps=0, decay='constant',
      weight_decay=0.1, grad_clip_norm=1.0)), 1000)
  shape = (image_size, image_size, 3)
  state, state_sh = step_lib.create_state(model, tx, 0, shape, mesh)
  train = step_lib.compile_train_step(
      model, tx, lr_fn, state_sh, mesh,
      ml_collections.ConfigDict({'accum_steps': accum_steps,
                                 'objective': objective}))
  rng = np.random.RandomState(0)
  host = {'image': rng.uniform(-1, 1, (batch, *shape)).astype(np.float32),
          'label': rng.randint(0, num_classes, (batch,)).astype(np.int32)}
  data = {k: jax.device_put(v, shd.batch_sharding(mesh, v.ndim))
          for k, v in host.items() if k in step_lib.batch_keys(
              ml_collections.ConfigDict({'objective': objective}))}

  with jax.set_mesh(mesh):
    t = time.perf_counter()
    compiled = train.lower(state, data).compile()
    compile_s = time.perf_counter() - t
    for _ in range(warmup):
      state, m = compiled(state, data)
    jax.block_until_ready(state)
    times = []
    for _ in range(steps):
      t = time.perf_counter()
      state, m = compiled(state, data)
      jax.block_until_ready((state, m))
      times.append(time.perf_counter() - t)

  step_s = statistics.median(times)
  fwd = (accounting.module_forward_flops(model, shape) if objective == 'mpp'
         else accounting.forward_flops(model_name, image_size, num_classes))
  achieved = 3.0 * fwd * batch / step_s
  peak = matmul_peak(jnp.dtype(dtype))
  hw = accounting.detect_hardware(jax.devices()[0].device_kind)
  out = {
      'model': model_name, 'objective': objective, 'batch': batch, 'image_size': image_size,
      'dtype': dtype, 'mesh': dict(mesh.shape), 'devices': jax.device_count(),
      'device_kind': jax.devices()[0].device_kind, 'compile_s': compile_s,
      'step_s_median': step_s, 'step_s_min': min(times),
      'img_per_s': batch / step_s,
      'img_per_s_per_device': batch / step_s / jax.device_count(),
      'forward_gflops': fwd / 1e9, 'achieved_tflops': achieved / 1e12,
      'matmul_peak_tflops': peak / 1e12, 'mfu': achieved / peak,
      'loss': float(m['loss']),
  }
  if hw:
    nominal = hw.peak_bf16_per_chip if dtype == 'bfloat16' else (
        hw.peak_fp32_per_chip or hw.peak_bf16_per_chip)
    chips = jax.device_count() / hw.devices_per_chip
    out['mfu_nominal'] = achieved / (nominal * chips)
  out.update(peak_memory_bytes())
  return out


def _bench_input() -> Dict[str, Any]:
  import tempfile

  import ml_collections
  from vit_jax.data import input_bench as data_bench
  cfg = dict(data=FLAGS.data, data_dir=FLAGS.data_dir,
             batch_size=FLAGS.batch, image_size=FLAGS.image_size)
  if FLAGS.data != 'jpeg_records':
    return data_bench.measure_input(ml_collections.ConfigDict(cfg),
                                    FLAGS.steps)
  with tempfile.TemporaryDirectory(prefix='jpeg_records_') as tmp:
    cfg.update(data='tfrecord', num_classes=1000, pp_train='inception',
               data_dir=data_bench.synthetic_jpeg_records(tmp, 4096))
    return data_bench.measure_input(ml_collections.ConfigDict(cfg),
                                    FLAGS.steps)


def _print_table(res: Dict[str, Any]) -> None:
  width = max(len(k) for k in res)
  for k, v in res.items():
    v = f'{v:.4g}' if isinstance(v, float) else v
    print(f'{k:>{width}}  {v}')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  if FLAGS.input_only:
    res = _bench_input()
  else:
    res = bench_train_step(
        FLAGS.model, FLAGS.batch, image_size=FLAGS.image_size,
        dtype=FLAGS.dtype, mesh_axes=_parse_mesh(FLAGS.mesh),
        steps=FLAGS.steps, warmup=FLAGS.warmup,
        accum_steps=FLAGS.accum_steps, num_classes=FLAGS.num_classes,
        objective=FLAGS.objective)
  _print_table(res)
  if FLAGS.json:
    with open(FLAGS.json, 'w', encoding='utf-8') as f:
      json.dump(res, f, indent=2)


if __name__ == '__main__':
  app.run(main)
