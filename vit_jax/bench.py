"""Benchmark the train step, the eval forward pass or the input pipeline.

    python -m vit_jax.bench --model=ViT-B/16 --batch=8 [--dtype=bfloat16]
        [--mode=train|infer] [--mesh=data=-1,fsdp=1,model=1] [--steps=10]
        [--json=out.json] [--objective=mpp]  # MPP's train step instead
        [--pipelined]  # also steps dispatched back to back, one wait
        [--model_option=remat=dots_saveable ...]  # model options, repeatable
    python -m vit_jax.bench --input-only --data=imagenet2012 [--data_dir=DIR]
        [--batch=256] [--image_size=224]

`--mode=train` (default) times the real train step (Adam + global-norm
clipping); `--mode=infer` the eval forward pass (`train=False`, the number
to compare for serving). Reports compile time, the median step time after
warm-up, img/s, achieved TFLOP/s (train: 3 x, infer: 1 x the XLA forward
FLOPs per image, the paper's convention), MFU against a matmul peak measured
in the same run for the same dtype (and against the nominal peak where the
hardware is known), and peak memory: the device's peak where the backend
reports one (GPU, TPU), the process's peak resident host memory always, and
XLA's compiled footprint of the step.

The model, step and benchmark need only jax, flax, optax and numpy (no
TensorFlow, tfds, clu or ml_collections; `--input_only` needs TensorFlow).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from typing import Any, Dict

from absl import app, flags

from vit_jax import heap, hugepages, outputs

FLAGS = flags.FLAGS
flags.DEFINE_string('model', 'ViT-B/16', 'Model name from the zoo.')
flags.DEFINE_integer('batch', 8, 'Global batch size.', lower_bound=1)
flags.DEFINE_integer('image_size', 224, 'Image side in pixels.',
                     lower_bound=1)
flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'],
                  'Compute dtype (parameters stay float32).')
flags.DEFINE_enum('mode', 'train', ['train', 'infer'],
                  'train: the train step; infer: the eval forward pass.')
flags.DEFINE_string('mesh', 'data=-1', 'Mesh axes, e.g. data=-1,fsdp=2.')
flags.DEFINE_integer('steps', 10, 'Timed steps.', lower_bound=1)
flags.DEFINE_integer('warmup', 2, 'Untimed steps after compilation.',
                     lower_bound=0)
flags.DEFINE_integer('accum_steps', 1, 'Gradient accumulation steps.',
                     lower_bound=1)
flags.DEFINE_integer('num_classes', 1000, 'Head size.', lower_bound=1)
flags.DEFINE_bool('matmul_peak', True, 'Measure the matmul peak for MFU '
                  '(seconds); --nomatmul_peak reports no MFU.')
flags.DEFINE_enum('objective', 'supervised', ['supervised', 'mpp'],
                  'Train step objective: supervised or masked patch '
                  'prediction (3-bit mean colour, 50% corrupted).')
flags.DEFINE_multi_string('model_option', [], 'A model option as key=value '
                          '(repeatable), e.g. remat=dots_saveable, '
                          'recompute_internals=False, scan_layers=True.')
flags.DEFINE_bool('pipelined', False, 'Also time --steps steps dispatched '
                  'back to back with one wait at the end, as a training '
                  'loop runs them (img_per_s_pipelined); the median step '
                  'waits for each.')
flags.DEFINE_string('json', None, 'Write the figures as JSON here.')
flags.DEFINE_bool('input_only', False, 'Benchmark the input pipeline only.')
flags.DEFINE_string('pp', None, '--input_only: the train pre-processing (a '
                    'preset or op string; default: the dataset\'s, '
                    '"inception" for jpeg_records), e.g. '
                    '"decode|inception_crop(224)|flip_lr|randaug(2,15)|'
                    'value_range(-1,1)"')
flags.DEFINE_alias('input-only', 'input_only')
flags.DEFINE_string('data', 'imagenet2012', 'Dataset for --input_only; '
                    '"jpeg_records": 4096 JPEG photo crops (skimage) written '
                    'as TFRecords to a temporary folder, 224-px inception '
                    'pre-processing.')
flags.DEFINE_string('data_dir', None, 'tfds data dir for --input_only.')

MODES = ('train', 'infer')


def _parse_options(items) -> Dict[str, Any]:
  """['remat=dots_saveable', 'scan_layers=True'] -> {name: value}."""
  from vit_jax.models import registry
  out = {}
  for item in items:
    key, sep, text = item.partition('=')
    if not sep or not key:
      raise app.UsageError(f'--model_option {item!r}: expected key=value, '
                           'e.g. remat=dots_saveable')
    out[key] = registry.parse_option(text)
  return out


def _parse_mesh(spec: str) -> Dict[str, int]:
  out = {}
  for item in filter(None, spec.split(',')):
    key, _, value = item.partition('=')
    if key not in ('data', 'fsdp', 'model') or not value.lstrip('-').isdigit():
      raise app.UsageError(f'--mesh item {item!r}: expected data=N, fsdp=N '
                           'or model=N (one of them may be -1)')
    out[key] = int(value)
  from vit_jax import sharding as shd
  try:
    shd.make_mesh(**out)  # A mesh that does not fit: before any compile.
  except ValueError as e:
    raise app.UsageError(f'--mesh={spec}: {e}') from None
  return out


def _check_model(name: str) -> bool:
  from vit_jax import models
  try:
    models.spec(name)
  except ValueError as e:  # Names the close ones and every known one.
    raise flags.ValidationError(str(e)) from None
  return True


flags.register_validator('model', _check_model)


def matmul_peak(dtype, n: int | None = None, repeats: int = 5) -> float:
  """Best FLOP/s of an n x n x n matmul on all local devices together.

  It uses the models' own matmul (`vit_jax.models.matmul.dot_general`: for
  bf16, bf16 operands with float32 accumulation, in the form the platform
  uses), so MFU compares the step with the fastest matmul the model itself
  can run.
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
  """The device's peak bytes in use where the backend tracks it (GPU, TPU;
  the largest over local devices) and the process's peak resident host
  memory (Linux `ru_maxrss`, KiB), in GiB."""
  import jax
  out = {}
  peaks = [(d.memory_stats() or {}).get('peak_bytes_in_use')
           for d in jax.local_devices()]
  peaks = [p for p in peaks if p is not None]
  if peaks:
    out['peak_device_memory_gb'] = max(peaks) / 2**30
  out['peak_host_memory_gb'] = (
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
  return out


def compiled_memory(compiled) -> Dict[str, Any]:
  """XLA's memory plan of a compiled step, per device, in GiB: arguments
  (parameters, optimiser state, batch), outputs, temporaries."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  (not every backend)
    return {}
  if m is None:
    return {}
  return {f'compiled_{k}_gb': getattr(m, f'{k}_size_in_bytes') / 2**30
          for k in ('argument', 'output', 'temp')
          if hasattr(m, f'{k}_size_in_bytes')}


def _setup(model_name, batch, image_size, dtype, mesh_axes, num_classes,
           accum_steps, optimizer: bool, objective: str = 'supervised',
           model_options=None, lr: float = 1e-3, initialise: bool = True):
  """(model, mesh, tx, lr_fn, state, state shardings, device batch); with
  `initialise=False` the state is abstract (shapes and dtypes only)."""
  import jax
  import numpy as np
  import optax

  from vit_jax import models
  from vit_jax import sharding as shd
  from vit_jax.train import optim
  from vit_jax.train import step as step_lib

  mesh = shd.make_mesh(**(mesh_axes or {}))
  shd.check_batch_size(batch, mesh, '--batch', accum_steps)
  # Attention as a training run picks it on this mesh (cuDNN on GPUs).
  model = models.from_config(
      dict(model_options or {}, name=model_name, dtype=dtype), num_classes,
      shd.platform(mesh))
  if objective == 'mpp':
    from vit_jax import selfsup
    model = selfsup.from_vit(model)
  if optimizer:
    tx, lr_fn = optim.make(optim.Settings(
        name='adam', lr=lr, warmup_steps=0, decay='constant',
        weight_decay=0.1, grad_clip_norm=1.0), 1000)
  else:
    tx, lr_fn = optax.identity(), None
  shape = (image_size, image_size, 3)
  if initialise:
    state, state_sh = step_lib.create_state(model, tx, 0, shape, mesh)
  else:
    state, state_sh = step_lib.planned_state(model, tx, shape, mesh)
  rng = np.random.RandomState(0)
  host = {'image': rng.uniform(-1, 1, (batch, *shape)).astype(np.float32),
          'label': rng.randint(0, num_classes, (batch,)).astype(np.int32)}
  keys = step_lib.batch_keys({'objective': objective})
  data = {k: jax.device_put(v, shd.batch_sharding(mesh, v.ndim))
          for k, v in host.items() if k in keys}
  return model, mesh, tx, lr_fn, state, state_sh, data


def _time_steps(compiled, args, steps, warmup, carry: bool):
  """Runs `compiled` warm-up + timed times; with `carry`, its first output
  replaces the first argument (the train state). Returns (times, outputs)."""
  import jax
  args = list(args)
  out = None
  for i in range(warmup + steps):
    t = time.perf_counter()
    out = compiled(*args)
    jax.block_until_ready(out)
    dt = time.perf_counter() - t
    if carry:
      args[0] = out[0]
    if i >= warmup:
      yield dt, out


def _time_pipelined(compiled, args, steps, carry: bool) -> float:
  """Seconds per step of `steps` calls dispatched back to back (the host
  runs ahead, as in a training loop), waited for once at the end."""
  import jax
  args = list(args)
  jax.block_until_ready(args)
  t = time.perf_counter()
  out = None
  for _ in range(steps):
    out = compiled(*args)
    if carry:
      args[0] = out[0]
  jax.block_until_ready(out)
  return (time.perf_counter() - t) / steps


def bench_train_step(model_name: str, batch: int, *, image_size: int = 224,
                     dtype: str = 'float32', mesh_axes=None, steps: int = 10,
                     warmup: int = 2, accum_steps: int = 1,
                     num_classes: int = 1000, measure_peak: bool = True,
                     objective: str = 'supervised',
                     model_options=None,
                     pipelined: bool = False) -> Dict[str, Any]:
  """Measures the train step of one configuration; returns the figures.
  `model_options`: model options beside the zoo's (e.g. {'remat': True});
  `pipelined`: also the steps dispatched back to back (`--pipelined`)."""
  import jax

  from vit_jax.train import step as step_lib

  model, mesh, tx, lr_fn, state, state_sh, data = _setup(
      model_name, batch, image_size, dtype, mesh_axes, num_classes,
      accum_steps, optimizer=True, objective=objective,
      model_options=model_options)
  train = step_lib.compile_train_step(
      model, tx, lr_fn, state_sh, mesh,
      {'accum_steps': accum_steps, 'objective': objective})
  with jax.set_mesh(mesh):
    t = time.perf_counter()
    compiled = train.lower(state, data).compile()
    compile_s = time.perf_counter() - t
    heap.release()  # As the train loop does after compiling.
    runs = list(_time_steps(compiled, (state, data), steps, warmup,
                            carry=True))
    times = [dt for dt, _ in runs]
    metrics = runs[-1][1][1]
    extra = {'loss': float(metrics['loss']), 'objective': objective,
             'accum_steps': accum_steps, 'steps': steps, 'warmup': warmup}
    if pipelined:
      extra['step_s_pipelined'] = _time_pipelined(
          compiled, (runs[-1][1][0], data), steps, carry=True)
  return _report('train', model_name, batch, image_size, dtype, mesh,
                 compile_s, times, compiled, extra, measure_peak, model)


def infer_fn(model, mesh, state_sh):
  """The eval forward pass `bench_infer` times, jitted: fn(params, images)
  -> logits (`train=False`), sharded as the state and the batch are."""
  import jax
  import flax.linen as nn

  from vit_jax import sharding as shd

  def forward(params, images):
    with nn.logical_axis_rules(shd.ACTIVATION_RULES):
      return model.apply({'params': params}, images, train=False)

  return jax.jit(forward, in_shardings=(state_sh.params,
                                        shd.batch_sharding(mesh, 4)),
                 out_shardings=shd.batch_sharding(mesh, 2))


def serving_params(fwd, abstract, shardings, images, seed: int = 0):
  """Parameters of `abstract`'s shapes as a server holds them: placed leaf
  by leaf from the host, as a checkpoint restore places them (no training
  initialisation program runs: its random-bit temporaries are no part of
  serving), each in the dtype `fwd` uses it in (the bf16 matmul weights of
  a bf16 model cast once, `vit_jax.models.precast`). Values: normal,
  stddev 0.02 (weights' scale; never zeros, which can time faster)."""
  import jax
  import numpy as np

  from vit_jax.models import precast
  rng = np.random.default_rng(seed)

  def place(leaf, dtype, sharding):
    host = (0.02 * rng.standard_normal(leaf.shape, np.float32)).astype(dtype)
    return jax.make_array_from_callback(leaf.shape, sharding,
                                        lambda index: host[index])
  return jax.tree.map(place, abstract,
                      precast.served_dtypes(fwd, abstract, images), shardings)


def bench_infer(model_name: str, batch: int, *, image_size: int = 224,
                dtype: str = 'float32', mesh_axes=None, steps: int = 10,
                warmup: int = 2, num_classes: int = 1000,
                measure_peak: bool = True,
                model_options=None,
                pipelined: bool = False) -> Dict[str, Any]:
  """Measures the eval forward pass (logits of a batch, `train=False`)."""
  import jax

  model, mesh, _, _, abstract, state_sh, data = _setup(
      model_name, batch, image_size, dtype, mesh_axes, num_classes, 1,
      optimizer=False, model_options=model_options, initialise=False)

  fwd = infer_fn(model, mesh, state_sh)
  with jax.set_mesh(mesh):
    params = serving_params(fwd, abstract.params, state_sh.params,
                            data['image'])
    t = time.perf_counter()
    compiled = fwd.lower(params, data['image']).compile()
    compile_s = time.perf_counter() - t
    heap.release()
    times = [dt for dt, _ in _time_steps(
        compiled, (params, data['image']), steps, warmup, carry=False)]
    extra = {'steps': steps, 'warmup': warmup}
    if pipelined:
      extra['step_s_pipelined'] = _time_pipelined(
          compiled, (params, data['image']), steps, carry=False)
  return _report('infer', model_name, batch, image_size, dtype, mesh,
                 compile_s, times, compiled, extra, measure_peak, model)


def _report(mode, model_name, batch, image_size, dtype, mesh,
            compile_s, times, compiled, extra, measure_peak,
            model) -> Dict[str, Any]:
  import jax
  import jax.numpy as jnp

  from vit_jax import accounting
  from vit_jax.models import matmul, onednn

  # First: the peaks are of the whole process so far, and the FLOP count's
  # lowering and the matmul probe below are not the step's.
  memory = peak_memory_bytes()
  step_s = statistics.median(times)
  # The model as built (its --model_option patch size, MPP's head, ...),
  # counted as every platform computes it: float32, unrolled, XLA's
  # attention without cuDNN's padded token (`accounting.COUNTED_AS`).
  fwd = accounting.module_forward_flops(model, (image_size, image_size, 3))
  passes = 3.0 if mode == 'train' else 1.0
  achieved = passes * fwd * batch / step_s
  device = jax.devices()[0]
  hw = accounting.detect_hardware(device.device_kind)
  out = {
      'mode': mode, 'model': model_name, 'batch': batch,
      'image_size': image_size, 'dtype': dtype, 'mesh': dict(mesh.shape),
      'devices': jax.device_count(), 'device_kind': device.device_kind,
      'compile_s': compile_s,
      'step_s_median': step_s, 'step_s_min': min(times),
      'img_per_s': batch / step_s,
      'img_per_s_per_device': batch / step_s / jax.device_count(),
      'forward_gflops': fwd / 1e9, 'achieved_tflops': achieved / 1e12,
  }
  if measure_peak:
    peak = matmul_peak(jnp.dtype(dtype))
    out.update(matmul_peak_tflops=peak / 1e12, mfu=achieved / peak)
  if device.platform == 'cpu' and dtype == 'bfloat16':
    out['cpu_matmul_form'] = matmul.cpu_form()
    if out['cpu_matmul_form'] == 'onednn':
      out['onednn'] = onednn.available()[1]
    out.update({f'cpu_probe_{k}_ms': v * 1e3
                for k, v in matmul.MEASURED.items()})
  out.update(extra)
  if 'step_s_pipelined' in out:
    out['img_per_s_pipelined'] = batch / out['step_s_pipelined']
  if hw:
    precision = jax.config.jax_default_matmul_precision
    if dtype != 'bfloat16':
      out['fp32_matmul_precision'] = precision or 'default'
    nominal = (hw.peak_bf16_per_chip if dtype == 'bfloat16'
               else hw.fp32_matmul_peak(precision))
    chips = jax.device_count() / hw.devices_per_chip
    out['mfu_nominal'] = achieved / (nominal * chips)
    if 'step_s_pipelined' in out:
      out['mfu_nominal_pipelined'] = out['mfu_nominal'] * step_s / out[
          'step_s_pipelined']
  out.update(compiled_memory(compiled))
  out.update(memory)
  return out


def _bench_input() -> Dict[str, Any]:
  import tempfile

  import ml_collections
  from vit_jax.data import input_bench as data_bench
  cfg = dict(data=FLAGS.data, data_dir=FLAGS.data_dir,
             batch_size=FLAGS.batch, image_size=FLAGS.image_size)
  if FLAGS.pp:
    cfg['pp_train'] = FLAGS.pp
  if FLAGS.data != 'jpeg_records':
    return data_bench.measure_input(ml_collections.ConfigDict(cfg),
                                    FLAGS.steps)
  with tempfile.TemporaryDirectory(prefix='jpeg_records_') as tmp:
    cfg.update(data='tfrecord', num_classes=1000,
               pp_train=FLAGS.pp or 'inception',
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
  options = _parse_options(FLAGS.model_option)
  if FLAGS.json:  # Before the measurement, not after it.
    try:
      FLAGS.json = outputs.file(FLAGS.json, '--json')
    except outputs.OutputPathError as e:
      raise app.UsageError(str(e)) from None
  if FLAGS.input_only:
    res = _bench_input()
  elif FLAGS.mode == 'infer':
    if FLAGS.accum_steps != 1:
      raise app.UsageError('--accum_steps applies to --mode=train only')
    if FLAGS.objective != 'supervised':
      raise app.UsageError(
          f'--objective={FLAGS.objective} applies to --mode=train only: '
          '--mode=infer times the supervised classifier\'s eval forward '
          'pass; drop --objective, or time the MPP train step with '
          '--mode=train')
    res = bench_infer(
        FLAGS.model, FLAGS.batch, image_size=FLAGS.image_size,
        dtype=FLAGS.dtype, mesh_axes=_parse_mesh(FLAGS.mesh),
        steps=FLAGS.steps, warmup=FLAGS.warmup,
        num_classes=FLAGS.num_classes, measure_peak=FLAGS.matmul_peak,
        model_options=options, pipelined=FLAGS.pipelined)
  else:
    res = bench_train_step(
        FLAGS.model, FLAGS.batch, image_size=FLAGS.image_size,
        dtype=FLAGS.dtype, mesh_axes=_parse_mesh(FLAGS.mesh),
        steps=FLAGS.steps, warmup=FLAGS.warmup,
        accum_steps=FLAGS.accum_steps, num_classes=FLAGS.num_classes,
        measure_peak=FLAGS.matmul_peak, objective=FLAGS.objective,
        model_options=options, pipelined=FLAGS.pipelined)
  if FLAGS.model_option:
    res['model_options'] = ' '.join(FLAGS.model_option)
  _print_table(res)
  if FLAGS.json:
    with open(FLAGS.json, 'w', encoding='utf-8') as f:
      json.dump(res, f, indent=2)


if __name__ == '__main__':
  hugepages.reexec()  # First: restarts the process where it helps.
  app.run(main)
