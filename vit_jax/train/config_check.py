"""Refuses config values that cannot work, before anything is compiled.

Each error names the key, the value and a valid one. Unknown keys are
refused earlier, by the locked config (`--config.optim.lrr=...`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Tuple

import ml_collections

from vit_jax.train import profiling

# key: (predicate, what a valid value is). Absent or None keys are skipped
# (the defaults apply); keys are dotted paths into the config.
_RULES: Tuple[Tuple[str, Callable[[Any], bool], str], ...] = (
    ('total_steps', lambda v: v > 0, 'a positive step count, e.g. 1000'),
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
    ('optim.grad_clip_norm', lambda v: v > 0, 'unset (off) or e.g. 1.0'),
    ('optim.b1', lambda v: 0 <= v < 1, 'in [0, 1), e.g. 0.9'),
    ('optim.b2', lambda v: 0 <= v < 1, 'in [0, 1), e.g. 0.999'),
    ('optim.eps', lambda v: v > 0, 'e.g. 1e-8'),
    ('optim.momentum', lambda v: 0 <= v < 1, 'in [0, 1), e.g. 0.9'),
    ('mesh.data', lambda v: v == -1 or v >= 1, '-1 (fill) or a device count'),
    ('mesh.fsdp', lambda v: v == -1 or v >= 1, '-1 (fill) or a device count'),
    ('mesh.model', lambda v: v == -1 or v >= 1,
     '-1 (fill) or a device count'),
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
  if (config.get('mode', 'train') == 'train' and not config.get('total_steps')
      and not config.get('total_epochs')):
    yield ('the config sets neither total_steps nor total_epochs; set one, '
           'e.g. --config.total_steps=1000')


def check(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError listing every value that cannot work."""
  found = list(problems(config))
  if found:
    raise ValueError('invalid config:\n  ' + '\n  '.join(found))
