"""The `input` config fields, their defaults, and their checks.

| field | default | meaning |
|---|---|---|
| `data` | required | registry name (`vit_jax/data/registry.py`) |
| `data_dir` | tfds default (`TFDS_DATA_DIR`) | tfds data dir, image folder or TFRecord folder; may be gs:// |
| `train_split`, `eval_split` | the registry's | named split or tfds split expression |
| `batch_size` | required for training | global train batch (all processes) |
| `eval_batch_size` | `batch_size` | global eval batch |
| `image_size` | the registry's | side of the square model input (whole pixels) |
| `pp_train`, `pp_eval` | the registry's preset | preset name, op string or op list (`preprocess.py`) |
| `shuffle_buffer` | 10_000 (None) | examples per shuffle block (each block is permuted); an integer >= 1, 1: no shuffle within the epoch's file order |
| `cache` | False | keep the (still encoded) examples in memory after the first pass (epochs then reuse its order: no per-epoch file-order shuffle) |
| `prefetch` | 2 | batches prepared ahead (0: none) |
| `mixup` | 0.0 | mixup alpha; > 0 mixes each train batch, labels become [B, classes] |
| `cutmix` | 0.0 | CutMix alpha; > 0 pastes a box between train images, labels become [B, classes] (with `mixup` too: one or the other per batch) |
| `skip_bad_images` | False | folder datasets: skip undecodable files instead of failing |
| `num_classes` | the registry's | generic TFRecords only |
| `num_train_examples` | the registry's | `dataset_info` train size where the source does not know it (TFRecords) |
| `image_key`, `label_key` | the registry's | TFRecord feature names |
| `multi_label` | the registry's (jft: True) | TFRecords: every label of a record, as a multi-hot float [classes] label (else the first is the class) |
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from typing import Optional

from vit_jax.data import kinds, ops, registry, sources

DEFAULT_SHUFFLE_BUFFER = 10_000
DEFAULT_PREFETCH = 2


@dataclasses.dataclass
class Settings:
  """An input config with defaults filled in and names resolved."""
  spec: registry.DatasetSpec
  source: sources.Source
  train_split: Optional[str]
  eval_split: Optional[str]
  image_size: int
  batch_size: Optional[int]
  eval_batch_size: Optional[int]
  pp_train: object
  pp_eval: object
  shuffle_buffer: int
  cache: bool
  prefetch: int
  mixup: float
  num_train_examples: Optional[int]
  data_dir: Optional[str] = None
  skip_bad_images: bool = False
  cutmix: float = 0.0
  eval_split_error: Optional[Exception] = None

  def require_eval_split(self) -> str:
    """The eval split, or the error saying how to set one."""
    if self.eval_split is None:
      # A fresh copy each time: the stored error raised itself would carry
      # its callers' frames (and what they hold: iterators, their threads)
      # in a traceback kept alive by these settings.
      raise copy.copy(self.eval_split_error)
    return self.eval_split


def read(input_config, *, eval_split: Optional[str] = None) -> Settings:
  """Fills defaults, opens the source and resolves the splits."""
  name = input_config.get('data')
  if not name:
    raise ValueError('input.data is not set; known datasets: '
                     f'{", ".join(registry.names())}')
  spec = registry.get(name)
  source = kinds.open_source(spec, input_config)
  train = input_config.get('train_split') or spec.train_split
  evals, error = eval_split or input_config.get('eval_split'), None
  if not evals:
    try:
      evals = source.default_eval_split()
    except ValueError as e:  # Only evaluation needs it.
      error = e.with_traceback(None)  # Kept: no frames (no cycle) with it.
  image_size = input_config.get('image_size')
  image_size = ops.pixels(spec.image_size if image_size is None
                          else image_size, 'input.image_size')
  batch = input_config.get('batch_size')
  return Settings(
      spec=spec, source=source,
      train_split=spec.resolve_split(train) if train else None,
      eval_split=spec.resolve_split(evals) if evals else None,
      image_size=image_size,
      batch_size=batch,
      eval_batch_size=input_config.get('eval_batch_size') or batch,
      pp_train=input_config.get('pp_train') or spec.pp_train,
      pp_eval=input_config.get('pp_eval') or spec.pp_eval,
      shuffle_buffer=shuffle_buffer(input_config.get('shuffle_buffer')),
      cache=bool(input_config.get('cache', False)),
      prefetch=int(DEFAULT_PREFETCH if input_config.get('prefetch') is None
                   else input_config.get('prefetch')),  # 0: none ahead.
      mixup=float(input_config.get('mixup') or 0.0),
      cutmix=float(input_config.get('cutmix') or 0.0),
      num_train_examples=registry.num_train_examples(input_config),
      data_dir=input_config.get('data_dir'),
      skip_bad_images=bool(input_config.get('skip_bad_images', False)),
      eval_split_error=error)


def shuffle_buffer(value) -> int:
  """`input.shuffle_buffer`: None is the default, other values must be >= 1.

  0 is refused rather than guessed: it reads as "no shuffling" to some and
  as "no limit" to others, and `or DEFAULT` used to make it 10_000.
  """
  if value is None:
    return DEFAULT_SHUFFLE_BUFFER
  if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
      or value < 1):
    raise ValueError(
        f'input.shuffle_buffer={value!r}: expected an integer >= 1, the '
        'examples per shuffle block (None: the default, '
        f'{DEFAULT_SHUFFLE_BUFFER}). Use 1 to keep the read order within '
        'each epoch (files are still read in a new order each epoch), or '
        'the shard size or more for a full permutation of every epoch')
  return int(value)


def local_batch_size(global_batch: Optional[int], process_count: int,
                     field: str) -> int:
  """The per-process batch; global batches must split evenly."""
  if not global_batch or global_batch <= 0:
    raise ValueError(f'input.{field} must be a positive integer, got '
                     f'{global_batch!r}')
  if global_batch % process_count:
    raise ValueError(
        f'input.{field}={global_batch} is not divisible by the process count '
        f'{process_count}: use a multiple of {process_count}, e.g. '
        f'{max(1, round(global_batch / process_count)) * process_count}')
  return global_batch // process_count


def check_process(process_index: int, process_count: int) -> None:
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f'process_index={process_index} must be in '
                     f'[0, process_count={process_count})')
