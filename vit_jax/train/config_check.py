"""Refuses config values that cannot work, before anything is compiled.

Each error names the key, the value and a valid one. Unknown keys are
refused earlier, by the locked config (`--config.optim.lrr=...`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Optional, Tuple

import jax.numpy as jnp
import ml_collections

from vit_jax.train import optim, profiling
from vit_jax import losses, models, selfsup, sharding
from vit_jax.ema_modes import EMA_MODES

# MPP colour bits per channel the head can take (2**15 RGB classes at 5).
MPP_MAX_BITS = 5

# key: (predicate, what a valid value is). Absent or None keys are skipped
# (the defaults apply); keys are dotted paths into the config.
_RULES: Tuple[Tuple[str, Callable[[Any], bool], str], ...] = (
    ('total_steps', lambda v: v >= 0, 'a step count, e.g. 1000 (0 or unset: '
     'total_epochs sets the length)'),
    ('total_epochs', lambda v: v > 0, 'a positive number, e.g. 7'),
    ('num_classes', lambda v: v > 0,
     'the dataset\'s class count (or unset: taken from the dataset)'),
    ('accum_steps', lambda v: v >= 1, '1 (no accumulation) or more'),
    ('log_every', lambda v: v >= 1, 'a positive step count, e.g. 50'),
    ('eval_every', lambda v: v >= 0, '0 (at the end only) or a step count'),
    ('checkpoint_every', lambda v: v >= 0,
     '0 (final save only) or a step count, e.g. 1000'),
    ('keep_checkpoints', lambda v: v >= 1, '1 or more, e.g. 3'),
    ('fsdp_min_size', lambda v: v >= 0, 'an element count, e.g. 262144'),
    ('label_smoothing', lambda v: 0 <= v < 1, 'in [0, 1), e.g. 0.1'),
    ('input.batch_size', lambda v: v > 0, 'a positive batch, e.g. 512'),
    ('input.eval_batch_size', lambda v: v > 0, 'a positive batch, e.g. 512'),
    ('input.image_size', lambda v: v > 0, 'a positive size, e.g. 224'),
    ('input.num_train_examples', lambda v: v > 0, 'the split\'s size'),
    ('input.shuffle_buffer', lambda v: v >= 1, 'e.g. 10000'),
    ('input.prefetch', lambda v: v >= 0, 'e.g. 2'),
    ('input.mixup', lambda v: v >= 0, '0 (off) or an alpha, e.g. 0.2'),
    ('input.cutmix', lambda v: v >= 0, '0 (off) or an alpha, e.g. 1.0'),
    ('optim.lr', lambda v: v > 0, 'a positive learning rate, e.g. 1e-3'),
    ('optim.warmup_steps', lambda v: v >= 0, '0 or a step count'),
    ('optim.weight_decay', lambda v: v >= 0, '0 (off) or e.g. 0.1'),
    ('optim.grad_clip_norm', lambda v: v >= 0, '0 or unset (off), or e.g. '
     '1.0'),
    ('optim.b1', lambda v: 0 <= v < 1, 'in [0, 1), e.g. 0.9'),
    ('optim.b2', lambda v: 0 <= v < 1, 'in [0, 1), e.g. 0.999'),
    ('optim.eps', lambda v: v > 0, 'e.g. 1e-8'),
    ('optim.momentum', lambda v: 0 <= v < 1, 'in [0, 1), e.g. 0.9'),
    ('optim.ema_decay', lambda v: 0 <= v < 1,
     'unset or 0 (off), or in (0, 1), e.g. 0.9999 (the paper\'s Polyak)'),
    ('mesh.data', lambda v: v == -1 or v >= 1, '-1 (fill) or a device count'),
    ('mesh.fsdp', lambda v: v == -1 or v >= 1, '-1 (fill) or a device count'),
    ('mesh.model', lambda v: v == -1 or v >= 1,
     '-1 (fill) or a device count'),
    ('mpp.rate', lambda v: 0 < v <= 1,
     'the fraction of patches corrupted, in (0, 1], e.g. 0.5'),
)


def _get(config: ml_collections.ConfigDict, dotted: str) -> Any:
  node = config
  for part in dotted.split('.'):
    if not isinstance(node, (dict, ml_collections.ConfigDict)) or (
        part not in node):
      return None
    node = node[part]
  return node


def problems(config: ml_collections.ConfigDict) -> Iterator[str]:
  """One line per config value that cannot work."""
  for key, ok, valid in _RULES:
    value = _get(config, key)
    if value is None:
      continue
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or (isinstance(value, float) and not math.isfinite(value)):
      yield f'--config.{key}={value!r} is not a number; expected {valid}'
    elif not ok(value):
      yield f'--config.{key}={value!r} cannot work; expected {valid}'
  try:
    profiling.parse(config.get('profile'))
  except ValueError as e:
    yield str(e)
  yield from sharding.rule_problems(config.get('sharding_rules'),
                                    config.get('sharding_overrides'))
  eval_ema = config.get('eval_ema', 'ema')
  if eval_ema not in EMA_MODES:
    yield (f'--config.eval_ema={eval_ema!r} cannot work; expected one of '
           f'{", ".join(EMA_MODES)}')
  elif (eval_ema == 'both' and config.get('mode', 'train') == 'train'
        and not _get(config, 'optim.ema_decay')):
    yield ('--config.eval_ema=both but optim.ema_decay is unset: there are no '
           'averages to evaluate; set e.g. --config.optim.ema_decay=0.9999')
  for key, choices in (('optim.name', optim.NAMES),
                       ('optim.decay', optim.DECAYS),
                       ('loss', losses.LOSSES)):
    value = _get(config, key)
    if value is not None and value not in choices:
      yield (f'--config.{key}={value!r} cannot work; expected one of '
             f'{", ".join(choices)}')
  for key in ('model.dtype', 'model.param_dtype'):
    value = _get(config, key)
    try:
      floating = value is None or jnp.issubdtype(jnp.dtype(value),
                                                 jnp.floating)
    except TypeError:
      floating = False
    if not floating:
      yield (f'--config.{key}={value!r} cannot work; expected a float dtype '
             'name: float32, bfloat16 or float16')
  name = _get(config, 'model.name')
  try:
    if name is not None:
      cls = models.spec(name)['cls']
      yield from _option_problems(config, name, cls)
  except ValueError as e:  # Names the close ones and every known one.
    yield f'--config.model.name={name!r}: {e}'
  if (config.get('mode', 'train') == 'train' and not config.get('total_steps')
      and not config.get('total_epochs')):
    yield ('the config sets neither total_steps nor total_epochs; set one, '
           'e.g. --config.total_steps=1000')
  steps, warmup = _known_steps(config), _get(config, 'optim.warmup_steps')
  if (config.get('mode', 'train') == 'train' and steps is not None
      and isinstance(warmup, int)):
    problem = optim.warmup_problem(warmup, steps)
    if problem:
      yield problem


def _known_steps(config: ml_collections.ConfigDict) -> Optional[int]:
  """The run's length where the config alone says it: `total_steps`, or
  `total_epochs` of a stated `input.num_train_examples` (else the data's
  size is known at setup, which checks it there)."""
  steps = config.get('total_steps')
  if isinstance(steps, int) and not isinstance(steps, bool) and steps:
    return steps
  epochs = config.get('total_epochs')
  num_train = _get(config, 'input.num_train_examples')
  batch = _get(config, 'input.batch_size')
  if (isinstance(epochs, (int, float)) and epochs > 0 and
      isinstance(num_train, int) and num_train > 0 and
      isinstance(batch, int) and batch > 0):
    return optim.total_steps(config, num_train)
  return None


def _option_problems(config: ml_collections.ConfigDict, name: str,
                     cls: type) -> Iterator[str]:
  """Model options the config sets (not None) that `name`'s family lacks,
  e.g. `model.remat` on a BiT ResNet (ViT options are not universal)."""
  fields = set(cls.__dataclass_fields__) - {'parent', 'name', 'num_classes'}
  for key, value in sorted(config.get('model', {}).items()):
    if key != 'name' and value is not None and key not in fields:
      yield (f'--config.model.{key}={value!r}: {name} ({cls.__name__}) has '
             f'no option {key}; its options: {", ".join(sorted(fields))}')


def _mpp_problems(config: ml_collections.ConfigDict) -> Iterator[str]:
  """Masked patch prediction: the options, a model with patch embeddings
  and an image size the patches tile."""
  objective = config.get('objective', 'supervised')
  if objective not in selfsup.OBJECTIVES:
    yield (f'--config.objective={objective!r} cannot work; expected one of '
           f'{", ".join(selfsup.OBJECTIVES)}')
    return
  if objective != 'mpp':
    return
  mpp = config.get('mpp', {})
  target = mpp.get('target', 'colour')
  bits = mpp.get('bits', 3)
  if target not in selfsup.TARGETS:
    yield (f'--config.mpp.target={target!r} cannot work; expected one of '
           f'{", ".join(selfsup.TARGETS)} (the paper reports colour)')
  if target != 'pixels' and (isinstance(bits, bool) or not isinstance(
      bits, int) or not 1 <= bits <= MPP_MAX_BITS):
    yield (f'--config.mpp.bits={bits!r} is out of range; expected an integer '
           f'from 1 to {MPP_MAX_BITS} (2**(3*bits) classes per RGB '
           'prediction: 512 at the paper\'s 3 bits)')
  rep = mpp.get('representation', 'token')
  if rep not in selfsup.REPRESENTATIONS:
    yield (f'--config.mpp.representation={rep!r} cannot work; expected '
           'token (the class token) or gap (mean of the patch tokens)')
  for field in ('mixup', 'cutmix'):
    if config.get('input', {}).get(field):
      yield (f'--config.input.{field} mixes labels, which objective=mpp '
             f'never reads (it would predict the colours of mixed images): '
             f'unset it (--config.input.{field}=None)')
  if config.get('mode', 'train') == 'train':
    yield from _mpp_unused_label_settings(config)
  if (config.get('model', {}).get('classifier') == 'map'
      and config.get('mode', 'train') == 'train'):  # Old runs evaluate.
    yield ("--config.model.classifier='map' pools a classifier's tokens with "
           'an attention head, which objective=mpp has none of (it predicts '
           "every patch): use classifier='token' or 'gap' (mpp.representation "
           'is what few-shot reads)')
  if rep == 'token' and config.get('model', {}).get('classifier') == 'gap':
    yield ("--config.mpp.representation='token' needs the class token that "
           "--config.model.classifier='gap' removes: set "
           "--config.mpp.representation=gap")
  name = config.model.get('name')
  if name not in models.names():
    return  # problems() names it.
  module = models.spec(name)['cls']
  if not issubclass(module, models.VisionTransformer):
    yield (f'--config.model.name={name!r} has no patch embeddings '
           f'({module.__name__}: no patch tokens to mask), so '
           'objective=mpp cannot work; pick a ViT, e.g. '
           '--config.model.name=ViT-B/16')
    return
  vit = _vit(config)
  if vit is not None:
    try:
      selfsup.from_vit(vit)
    except ValueError as e:
      yield f'--config.model.name={name!r}: {e}'
      return
  if config.model.get('representation_size'):
    yield ('--config.model.representation_size is set, but masked patch '
           'prediction trains no pre_logits layer: unset it '
           '(--config.model.representation_size=None) and add it when '
           'fine-tuning')
  stride = vit.stride if vit is not None else 0
  if stride and target == 'downsized' and stride % selfsup.model.DOWNSIZED:
    yield (f'--config.mpp.target=downsized needs a patch size divisible by '
           f'{selfsup.model.DOWNSIZED}; {name} has {stride}: use '
           '--config.mpp.target=colour')


def _mpp_unused_label_settings(config: ml_collections.ConfigDict
                               ) -> Iterator[str]:
  """Settings of the supervised loss that objective=mpp never reads (its
  loss is fixed by `mpp.target`: softmax cross-entropy over the colour
  classes, or L2 for pixels):
  a config that sets them would train as if they were unset while its
  config.json records them. Pre-training configs that become MPP by
  `--config.objective=mpp` reset them on the command line
  (docs/selfsup.md). Training only: an evaluation reads none of them.
  (A run of an earlier version that set them resumes with them reset: the
  loss is no model option, its change is logged.)"""
  loss = config.get('loss', 'softmax')
  if loss in losses.LOSSES and loss != 'softmax':
    yield (f'--config.loss={loss!r} is the labels\' loss, which '
           'objective=mpp does not use (it predicts each patch\'s colour '
           'with softmax cross-entropy, pixels with L2): set '
           '--config.loss=softmax')
  smoothing = config.get('label_smoothing')
  if isinstance(smoothing, (int, float)) and smoothing:
    yield (f'--config.label_smoothing={smoothing!r} smooths labels, which '
           'objective=mpp never reads (nor smooths its colour targets): set '
           '--config.label_smoothing=0')
  # `model.head_bias_init` is not read either (the mpp_head's bias starts
  # at 0), but not refused: it is a model option, which a checkpoint
  # records, so an MPP run started with it (the pre-training rows' -10)
  # could then neither keep it nor drop it to resume.


class ConfigError(ValueError):
  """Config values that cannot work (one line each)."""


def _vit(config):
  """The config's ViT module (None: not a ViT, or a bad option, which
  building the model names)."""
  name = config.model.get('name')
  if name not in models.names() or not issubclass(
      models.spec(name)['cls'], models.VisionTransformer):
    return None
  options = {k: v for k, v in config.model.items() if v is not None and k
             not in ('name', 'dtype', 'param_dtype', 'attention_impl')}
  try:  # The patch size and stem only: no dtype, attention or head.
    return models.create(name, num_classes=0, **options)
  except (TypeError, ValueError):
    return None


def _objective_model(config, vit):
  """The model the objective trains on `vit`'s architecture: `vit` itself,
  or its masked patch prediction (None if it cannot have one, which
  `_mpp_problems` names)."""
  if config.get('objective', 'supervised') != 'mpp':
    return vit
  try:
    return selfsup.from_vit(vit)
  except ValueError:
    return None


def _image_problems(config) -> Iterator[str]:
  """Images must tile into whole patches unless the model leaves the last
  pixels out (`drops_partial_patches`: a plain ViT, as the reference does
  for ViT-H/14 at the paper's 384 px)."""
  vit = _vit(config)
  size = config.get('input', {}).get('image_size')
  if vit is None or not isinstance(size, int) or size <= 0:
    return
  model = _objective_model(config, vit)
  stride = vit.stride
  if model is not None and size % stride and not model.drops_partial_patches:
    why = ('masked patch prediction predicts every pixel of each patch'
           if isinstance(model, selfsup.MaskedPatchPrediction)
           else 'its ResNet stem pads the image instead')
    yield (f'--config.input.image_size={size} is not divisible by the patch '
           f'size {stride} of {config.model.name} (pixels per token), so the '
           f'patches do not tile the image ({why}); use a multiple of '
           f'{stride}, e.g. {max(stride, size // stride * stride)}')


def check(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError listing every value that cannot work."""
  found = (list(problems(config)) + list(_image_problems(config)) +
           list(_mpp_problems(config)))
  if found:
    raise ConfigError('invalid config:\n  ' + '\n  '.join(found))
