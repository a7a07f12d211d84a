"""Compute accounting: parameters, FLOPs, exaFLOPs and accelerator core-days.

Conventions (those of the paper's Table 6): a multiply-add is 2 FLOPs, forward
FLOPs are counted per image at the pre-training resolution, and training costs
3 x forward FLOPs per example seen (forward + backward ~ 2 x forward).

    param_count("ViT-B/16")            -> 86_567_656
    forward_flops("ViT-B/16")          -> ~35.2e9  (XLA's cost analysis)
    analytic_forward_flops("ViT-B/16") -> ~35.1e9  (matmuls and convs only)

Command line:
    python -m vit_jax.accounting --table
    python -m vit_jax.accounting --config=configs/pretrain.py:model=ViT-B/16,data=i21k
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax import models
from vit_jax import paper as paper_data
from vit_jax import selfsup
from vit_jax.data import registry

SECONDS_PER_DAY = 86400.0


# --------------------------------------------------------------------------
# Parameters and FLOPs of the real model.


def _abstract(name, num_classes, image_size, channels=3, **overrides):
  model = models.create(name, num_classes=num_classes, **overrides)
  h, w = _hw(image_size)
  images = jax.ShapeDtypeStruct((1, h, w, channels), jnp.float32)
  params = jax.eval_shape(
      lambda x: model.init(jax.random.key(0), x), images)['params']
  return model, params, images


def _hw(image_size):
  if isinstance(image_size, int):
    return image_size, image_size
  return tuple(image_size)


@functools.lru_cache(maxsize=None)
def _param_count(name, num_classes, image_size, overrides):
  _, params, _ = _abstract(name, num_classes, image_size, **dict(overrides))
  return int(sum(math.prod(p.shape) for p in jax.tree.leaves(params)))


def param_count(name: str, num_classes: int = 1000, image_size=224,
                **overrides) -> int:
  """Number of parameters, from `jax.eval_shape` (no weights materialised)."""
  return _param_count(name, num_classes, image_size,
                      tuple(sorted(overrides.items())))


@functools.lru_cache(maxsize=None)
def _forward_flops(name, image_size, num_classes, overrides):
  model, params, images = _abstract(name, num_classes, image_size,
                                    **dict(overrides))
  return _flops(model, params, images)


def _flops(model, params, images) -> float | None:
  """XLA's cost analysis of the forward pass, traced on the host's CPU
  device wherever this runs (where JAX has one): the count is the model's, not a backend's (GPU
  backends count nothing for a fused kernel's custom call). The lowered
  module's analysis where JAX gives one, else the compiled module's; None
  where neither does."""
  try:
    cpu = jax.sharding.SingleDeviceSharding(jax.devices('cpu')[0])
    on_cpu = lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=cpu)
  except RuntimeError:  # JAX_PLATFORMS without cpu: the default device.
    on_cpu = lambda t: t
  lowered = jax.jit(lambda p, x: model.apply({'params': p}, x)).lower(
      jax.tree.map(on_cpu, params), on_cpu(images))
  for analyse in (lowered.cost_analysis,
                  lambda: lowered.compile().cost_analysis()):
    cost = analyse()
    if isinstance(cost, (list, tuple)):  # Older JAX returned one per device.
      cost = cost[0] if cost else None
    if cost and 'flops' in cost:
      return float(cost['flops'])
  return None


# Model options that change how the model computes, not what: its FLOPs
# are those of the model with these values (float32, unrolled, XLA's
# attention), the same on every platform. XLA's cost analysis misses most
# bfloat16 dots (`matmul.dot_general`'s per-platform forms: a bfloat16
# ViT-B/16 counted 0.53 GFLOPs, not 35.3) and counts a scanned stack's body
# once, not per layer. cuDNN's attention (a half-precision model on a GPU,
# `attention.resolve`) makes the encoder pad 197 tokens to 198
# (`vit.Encoder`'s `even_tokens`): ViT-B/16 counted 35.451 GFLOPs, not the
# model's 35.260, and the CPU that traces the count has no cuDNN kernel.
COUNTED_AS = {'dtype': jnp.float32, 'param_dtype': jnp.float32,
              'scan_layers': False, 'attention_impl': 'xla'}


def counted_options(options) -> Dict[str, object]:
  """The model options a FLOP count depends on: `options` (a config's
  `model` section or keyword overrides) less `name`, unset (None) ones and
  those `COUNTED_AS` fixes. Every count here goes through it, so that a config's
  estimate and the trainer's `summary.json` count the same model."""
  return {k: v for k, v in dict(options).items()
          if k != 'name' and k not in COUNTED_AS and v is not None}


def forward_flops(name: str, image_size=224, num_classes: int = 1000,
                  **overrides) -> float:
  """Forward FLOPs per image from XLA's cost analysis of the real model.

  Counts every HLO op (matmuls with multiply-add = 2, plus normalisations,
  activations and softmax), so it is slightly above `analytic_forward_flops`,
  which it falls back to where this JAX gives no cost analysis. The count
  is the same whatever the model computes in (`counted_options`).
  """
  overrides = counted_options(overrides)
  flops = _forward_flops(name, image_size, num_classes,
                         tuple(sorted(overrides.items())))
  if flops is None:
    return analytic_forward_flops(name, image_size, num_classes, **overrides)
  return flops


def module_forward_flops(model, image_shape: Sequence[int]) -> float:
  """Forward FLOPs per image of a built module (XLA's cost analysis), e.g.
  a masked-patch-prediction model, whose per-patch head is part of its
  forward; `image_shape` is (height, width, channels)."""
  images = jax.ShapeDtypeStruct((1, *image_shape), jnp.float32)
  # The float32, unrolled model with XLA's attention, as `forward_flops`
  # counts (`COUNTED_AS`).
  changes = {key: value for key, value in COUNTED_AS.items()
             if getattr(model, key, None) not in (None, value)}
  if changes:
    model = model.clone(**changes)
  params = jax.eval_shape(
      lambda x: model.init(jax.random.key(0), x), images)['params']
  flops = _flops(model, params, images)
  if flops is None:
    raise RuntimeError('XLA gave no cost analysis for this module, lowered '
                       f'or compiled (jax {jax.__version__}); its FLOPs are '
                       'unknown')
  return flops


def mpp_forward_flops(name: str, image_size=224, *, target: str = 'colour',
                      bits: int = 3, channels: int = 3,
                      **overrides) -> float:
  """Forward FLOPs per image of `name` trained by masked patch prediction
  (encoder plus the per-patch `mpp_head`; no classification head)."""
  h, w = _hw(image_size)
  model = selfsup.from_vit(models.create(name, num_classes=0, **overrides),
                           target=target, bits=bits)
  return module_forward_flops(model, (h, w, channels))


def analytic_forward_flops(name: str, image_size=224,
                           num_classes: int = 1000, **overrides) -> float:
  """Matmul and convolution FLOPs per image, counted by hand (cross-check):
  the model family's registered count (`models.registry.Family.flops`)."""
  h, w = _hw(image_size)
  return models.family(name).flops(
      models.options(name, **counted_options(overrides)), h, w, num_classes)


def training_flops(forward: float, examples_seen: float) -> float:
  """3 x forward FLOPs x examples (the paper's Table 6 convention)."""
  return 3.0 * forward * examples_seen


# --------------------------------------------------------------------------
# Hardware: peaks and how JAX devices map onto chips and cores.


@dataclasses.dataclass(frozen=True)
class Hardware:
  """Dense bf16 peak per chip; cores per chip; JAX devices per chip.

  TPU v2/v3 and TPU7x expose each TensorCore as a JAX device; on v4 and v5p
  the two TensorCores of a chip form one "megacore" device; v5e/v6e chips
  have one core. "Core-days" are counted in TensorCores, as the paper does
  for TPUv3. GPUs count one core per chip.
  """
  name: str
  peak_bf16_per_chip: float  # FLOP/s
  cores_per_chip: int
  devices_per_chip: int
  peak_fp32_per_chip: Optional[float] = None
  # GPUs from Ampere on: what float32 matmuls run at under JAX's default
  # precision, which lets XLA use TF32 there (`fp32_matmul_peak`).
  peak_tf32_per_chip: Optional[float] = None

  def fp32_matmul_peak(self, precision: Optional[str]) -> float:
    """The peak float32 matmuls run at under `precision`
    (`jax_default_matmul_precision`): full float32 only for 'highest' /
    'float32'; otherwise TF32 on GPUs that have it, and on TPUs bf16
    passes (their default), whose peak stands in."""
    if str(precision).lower() in ('highest', 'float32'):
      return self.peak_fp32_per_chip or self.peak_bf16_per_chip
    return (self.peak_tf32_per_chip or self.peak_fp32_per_chip
            or self.peak_bf16_per_chip)

  @property
  def peak_per_core(self) -> float:
    return self.peak_bf16_per_chip / self.cores_per_chip

  def cores(self, num_devices: int) -> float:
    """TensorCores behind `num_devices` JAX devices."""
    return num_devices * self.cores_per_chip / self.devices_per_chip


HARDWARE: Dict[str, Hardware] = {h.name: h for h in [
    Hardware('tpu_v2', 45e12, 2, 2),
    Hardware('tpu_v3', 123e12, 2, 2),
    Hardware('tpu_v4', 275e12, 2, 1),
    Hardware('tpu_v5e', 197e12, 1, 1),
    Hardware('tpu_v5p', 459e12, 2, 1),
    Hardware('tpu_v6e', 918e12, 1, 1),
    # Google Cloud's TPU7x page: 2,307 TFLOP/s bf16 per chip; its two
    # TensorCores are two JAX devices (no megacore; JAX's pallas
    # `tpu_info.ChipVersion`).
    Hardware('tpu7x', 2307e12, 2, 2),
    # Dense peaks (NVIDIA's data sheets print sparse ones beside them, twice
    # as large).
    Hardware('v100', 125e12, 1, 1, 15.7e12),
    Hardware('a100', 312e12, 1, 1, 19.5e12, 156e12),
    Hardware('l4', 121e12, 1, 1, 30.3e12, 60e12),
    Hardware('l40s', 362e12, 1, 1, 91.6e12, 183e12),
    Hardware('h100', 989e12, 1, 1, 67e12, 495e12),  # SXM.
    Hardware('h100_pcie', 756e12, 1, 1, 51e12, 378e12),
    # The H100 data sheet's NVL column: 1,671 bf16 / 835 TF32 TFLOP/s with
    # sparsity, 60 float32.
    Hardware('h100_nvl', 835.5e12, 1, 1, 60e12, 417.5e12),
    # H100 SXM's chip and peaks; NVLink at 400 GB/s, not 900 (export
    # variant), which a multi-GPU step may feel, its MFU does not.
    Hardware('h800', 989e12, 1, 1, 67e12, 495e12),
    # Grace Hopper: its GPU has H100 SXM's peaks (the GH200 data sheet).
    Hardware('gh200', 989e12, 1, 1, 67e12, 495e12),
    Hardware('h200', 989e12, 1, 1, 67e12, 495e12),
]}


def hardware(name: str) -> Hardware:
  key = name.lower().replace('-', '_').replace('tpuv', 'tpu_v')
  if key not in HARDWARE:
    raise ValueError(f'unknown hardware {name!r}; known: {", ".join(HARDWARE)}')
  return HARDWARE[key]



def detect_hardware(device_kind: str) -> Optional[Hardware]:
  """The table entry for a JAX `device.device_kind`, or None (e.g. a CPU)."""
  kind = device_kind.lower()
  # Whole words: "NVIDIA L40S" is no L4, an "H100 PCIe" or "H100 NVL" no
  # H100 SXM; an H800 PCIe is an H100 PCIe's chip.
  for pattern, name in ((r'v6 lite', 'tpu_v6e'), (r'v6e', 'tpu_v6e'),
                        (r'v5 lite', 'tpu_v5e'), (r'v5e', 'tpu_v5e'),
                        (r'v5p', 'tpu_v5p'), (r'tpu v5\b', 'tpu_v5p'),
                        (r'tpu v4', 'tpu_v4'), (r'tpu v3', 'tpu_v3'),
                        (r'tpu v2', 'tpu_v2'), (r'\btpu7x\b', 'tpu7x'),
                        (r'\bgh200\b', 'gh200'), (r'\bh200\b', 'h200'),
                        (r'\bh100 pcie\b', 'h100_pcie'),
                        (r'\bh100 nvl\b', 'h100_nvl'), (r'\bh100\b', 'h100'),
                        (r'\bh800 pcie\b', 'h100_pcie'), (r'\bh800\b', 'h800'),
                        (r'\ba100\b', 'a100'), (r'\bv100\b', 'v100'),
                        (r'\bl40s\b', 'l40s'), (r'\bl4\b', 'l4')):
    if re.search(pattern, kind):
      return HARDWARE[name]
  return None

# --------------------------------------------------------------------------
# The paper's numbers (from vit_jax/paper.py) and the utilisation they imply.

JFT_IMAGES = paper_data.JFT_IMAGES
PRETRAIN_IMAGES = {data: paper_data.pretrain_images(data)
                   for data in paper_data.PRETRAIN_DATA}

# Table 1 / public checkpoints: exact counts at 224, 1000 classes, no pre-logits.
TABLE1_PARAMS = paper_data.TABLE1_PARAMS

# Table 6: (model, JFT epochs, exaFLOPs).
TABLE6 = [(r['model'], r['epochs'], r['exaflops']) for r in paper_data.TABLE6]

# Table 2, ViT columns: (label, model, dataset images, epochs, TPUv3-core-days).
# Epochs: the longest schedule of Tables 3 and 6 for that model and data.
TABLE2 = [(label, p['model'], PRETRAIN_IMAGES[p['pretrain']], p['epochs'],
           paper_data.TABLE2[label]['core_days'])
          for label, p in paper_data.TABLE2_PRETRAIN.items()]


def table6_exaflops(name: str, epochs: float) -> float:
  """Our Table 6 figure: 3 x XLA forward FLOPs at 224 x epochs x 303M."""
  return training_flops(forward_flops(name), epochs * JFT_IMAGES) / 1e18


def implied_utilization(exaflops: float, core_days: float,
                        hw: Hardware) -> float:
  """Share of peak that `exaflops` in `core_days` on `hw` cores means."""
  achieved = exaflops * 1e18 / (core_days * SECONDS_PER_DAY)
  return achieved / hw.peak_per_core


def paper_utilization() -> float:
  """The TPUv3 utilisation implied by the paper's own numbers.

  The two Table 2 ViT rows trained on JFT have their training cost printed in
  Table 6 (ViT-H/14 14 epochs: 4262 exaFLOPs; ViT-L/16 14 epochs: 1567); with
  Table 2's core-days they imply 32.1% and 43.4% of TPUv3's 61.5 TFLOP/s per
  core. We use their geometric mean (a least-squares fit in log space), 37.3%.
  """
  table6 = {(m, e): ef for m, e, ef in TABLE6}
  tpu = HARDWARE['tpu_v3']
  utils = [implied_utilization(table6[(model, epochs)], days, tpu)
           for _, model, images, epochs, days in TABLE2
           if images == JFT_IMAGES and (model, epochs) in table6]
  return float(np.exp(np.mean(np.log(utils))))


# --------------------------------------------------------------------------
# Estimates for a run.


@dataclasses.dataclass
class Estimate:
  model: str
  image_size: int
  examples_seen: float
  forward_gflops: float
  exaflops: float
  hardware: str
  utilization: float
  core_days: float
  num_devices: Optional[int] = None
  wall_hours: Optional[float] = None

  def lines(self) -> Sequence[str]:
    out = [
        f'model              {self.model} at {self.image_size}px',
        f'forward            {_figure(self.forward_gflops)} GFLOPs / image '
        '(XLA)',
        f'examples seen      {self.examples_seen:,.0f}',
        f'training compute   {_figure(self.exaflops, 3)} exaFLOPs '
        '(3 x forward x examples)',
        f'hardware           {self.hardware}, {self.utilization:.1%} of bf16 peak',
        f'core-days          {_figure(self.core_days)}',
    ]
    if self.wall_hours is not None:
      out.append(f'wall-clock         {_figure(self.wall_hours)} h on '
                 f'{self.num_devices} devices')
    return out


def _figure(x: float, decimals: int = 2) -> str:
  """`x` with `decimals` places, or 3 significant digits where those would
  print a CPU-scale run's 0.13 GFLOPs x 420k images as 0.000 exaFLOPs."""
  if x == 0 or abs(x) >= 10 ** (2 - decimals):
    return f'{x:,.{decimals}f}'
  return f'{x:.3g}'


def flops_core_days(total_flops: float, hw: Hardware,
                    utilization: float) -> float:
  """Core-days computing `total_flops` at `utilization` of `hw`'s peak."""
  return total_flops / (hw.peak_per_core * utilization) / SECONDS_PER_DAY


def estimate(name: str, examples_seen: float, *, image_size: int = 224,
             hardware_name: str = 'tpu_v3',
             utilization: Optional[float] = None,
             num_devices: Optional[int] = None, num_classes: int = 1000,
             forward: Optional[float] = None, **overrides) -> Estimate:
  """Training cost of `examples_seen` images through `name` on `hardware`
  (`forward`: FLOPs per image when not the classifier's, e.g. MPP's)."""
  hw = hardware(hardware_name)
  util = paper_utilization() if utilization is None else utilization
  if not 0 < util <= 1:
    raise ValueError(f'utilization must be in (0, 1], got {util}')
  fwd = forward or forward_flops(name, image_size, num_classes, **overrides)
  total = training_flops(fwd, examples_seen)
  core_days = flops_core_days(total, hw, util)
  wall = None
  if num_devices:
    wall = core_days * 24 / hw.cores(num_devices)
  return Estimate(name, image_size, examples_seen, fwd / 1e9, total / 1e18,
                  hw.name, util, core_days, num_devices, wall)


def estimate_for_config(config, *, hardware_name: Optional[str] = None,
                        num_devices: Optional[int] = None,
                        utilization: Optional[float] = None) -> Estimate:
  """The estimate for a training config (see configs/common.py's fields)."""
  model_cfg = dict(config.model)
  name = model_cfg.pop('name')
  batch = config.input.batch_size
  if config.get('total_steps'):
    examples = config.total_steps * batch
  elif config.get('total_epochs'):
    num_train = registry.num_train_examples(config.input)
    if not num_train:
      raise ValueError(f'total_epochs with input.data={config.input.data!r}, '
                       'whose size the registry does not know: set '
                       'input.num_train_examples')
    examples = config.total_epochs * num_train
  else:
    raise ValueError('config sets neither total_steps nor total_epochs: '
                     'set one of them to estimate the cost of the run')
  acc = config.get('accounting', {})
  options = counted_options(model_cfg)
  forward = None
  if config.get('objective', 'supervised') == 'mpp':
    mpp = config.get('mpp', {})
    forward = mpp_forward_flops(
        name, config.input.image_size, target=mpp.get('target', 'colour'),
        bits=mpp.get('bits', 3), **options)
  return estimate(
      name, examples, image_size=config.input.image_size,
      hardware_name=hardware_name or acc.get('hardware', 'tpu_v3'),
      utilization=utilization if utilization is not None else acc.get(
          'utilization'),
      num_devices=num_devices or acc.get('num_devices'), forward=forward,
      num_classes=(config.get('num_classes')
                   or registry.get(config.input.data).num_classes or 1000),
      **options)


# --------------------------------------------------------------------------
# The paper's tables, reproduced.


def table_markdown() -> str:
  """Table 1 (parameters) and the forward FLOPs behind Table 6, ours beside
  the paper's. Tables 6 and 2 themselves (exaFLOPs, core-days) are rendered
  by `python -m vit_jax.tables --paper-only --tables=6,2`."""
  out = ['## Table 1: parameters (224 px, 1000 classes, no pre-logits)', '',
         '| model | paper | ours | ratio |', '|---|---:|---:|---:|']
  for name, paper in TABLE1_PARAMS.items():
    ours = param_count(name)
    out.append(f'| {name} | {paper:,} | {ours:,} | {ours / paper:.4f} |')

  out += ['', '## Forward FLOPs of the Table 6 models (224 px)', '',
          '| model | fwd GFLOPs (XLA) | fwd GFLOPs (analytic) | ratio |',
          '|---|---:|---:|---:|']
  for name in dict.fromkeys(name for name, _, _ in TABLE6):
    fwd, ana = forward_flops(name), analytic_forward_flops(name)
    out.append(f'| {name} | {fwd / 1e9:.2f} | {ana / 1e9:.2f} '
               f'| {ana / fwd:.3f} |')
  tpu = HARDWARE['tpu_v3']
  out += ['', f'Utilisation {paper_utilization():.1%} of '
          f'{tpu.peak_per_core / 1e12:.1f} TFLOP/s per core: the geometric '
          'mean of what Table 6 exaFLOPs / Table 2 core-days imply for the '
          'two JFT rows (see paper_utilization). Tables 6 and 2 with our '
          'estimates: python -m vit_jax.tables --paper-only --tables=6,2']
  return '\n'.join(out)


# --------------------------------------------------------------------------
# Command line.


def _main(argv):
  from absl import flags
  del argv
  f = flags.FLAGS
  if f.table:
    print(table_markdown())
  if f.config is not None:
    try:
      est = estimate_for_config(f.config, hardware_name=f.hardware,
                                num_devices=f.devices,
                                utilization=f.utilization)
    except ValueError as e:  # A model, dataset or length the config names.
      raise SystemExit(f'vit_jax.accounting: {e}') from None
    print('\n'.join(est.lines()))
  if not f.table and f.config is None:
    raise SystemExit('nothing to do: pass --table and/or --config=<spec>')


if __name__ == '__main__':
  from absl import app, flags
  from ml_collections import config_flags
  flags.DEFINE_bool('table', False, "Print Tables 1, 6 and 2: paper vs ours.")
  config_flags.DEFINE_config_file('config', None, 'Config spec to estimate, '
                                  'e.g. configs/pretrain.py:model=ViT-B/16.')
  flags.DEFINE_string('hardware', None, f'One of {", ".join(HARDWARE)} '
                      '(TPUv4, tpu-v4, H100 also do); default: the config\'s '
                      'accounting.hardware or tpu_v3.')
  flags.DEFINE_integer('devices', None, 'JAX devices, for wall-clock hours.',
                       lower_bound=1)
  flags.DEFINE_float('utilization', None, 'Share of bf16 peak; default: the '
                     "paper-implied TPUv3 utilisation.")
  def _known(name):
    try:
      return name is None or bool(hardware(name))
    except ValueError:
      return False
  flags.register_validator(
      'hardware', _known, f'expected one of {", ".join(HARDWARE)}')
  flags.register_validator(
      'utilization', lambda u: u is None or 0 < u <= 1,
      '--utilization is a share of the peak in (0, 1], e.g. 0.45 (not a '
      'percentage)')
  import sys
  from vit_jax.configs import common
  try:  # configs/... from any directory, checked as vit_jax.main does.
    argv = common.check_command_line(sys.argv)
  except common.ConfigSpecError as e:
    raise SystemExit(f'vit_jax.accounting: {e}') from None
  app.run(_main, argv=argv)
