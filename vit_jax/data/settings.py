"""The `input` config fields, their defaults, and their checks.

| field | default | meaning |
|---|---|---|
| `data` | required | registry name (`vit_jax/data/registry.py`) |
| `data_dir` | tfds default (`TFDS_DATA_DIR`) | tfds data dir, image folder or TFRecord folder; may be gs://; a leading `~` is expanded |
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
| `skip_bad_images` | False | skip undecodable images instead of failing: folder datasets (every split), TFRecords (the train split only); refused for other kinds |
| `num_classes` | the registry's | generic TFRecords only |
| `num_train_examples` | the registry's | `dataset_info` train size where the source does not know it (TFRecords) |
| `image_key`, `label_key` | the registry's | TFRecord feature names |
| `multi_label` | the registry's (jft: True) | TFRecords: every label of a record, as a multi-hot float [classes] label (else the first is the class) |

A source sees every field but the pipeline's own (`PIPELINE_FIELDS`), with
`train_split` resolved (a registry name replaced by its expression); fields
of a source kind of one's own (`input.npz_path`) reach it too, and each
configuration of those fields opens its own source (`kinds.open_source`).

Held-out evaluation: where the eval split (`input.eval_split`, or the
dataset's default where it is unset) shares examples with the train split
without being that split (`train[90%:]` beside the default `train`;
`train_split='train+test'` beside the default `test`), `read` logs a
warning and `Settings.check_held_out` (called before training) raises a
DataError naming the train split that leaves them out. Evaluating the train
split itself is only noted in the logs where `input.eval_split` names it (a
deliberate fit check), refused where the default is it; a split passed to
`read` (an evaluator's own, `eval_iterator(split=...)`) is not checked.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
import os
from typing import List, Optional, Tuple

import ml_collections
from absl import logging

from vit_jax.data import kinds, ops, registry, sources
from vit_jax.data.errors import DataError

DEFAULT_SHUFFLE_BUFFER = 10_000
DEFAULT_PREFETCH = 2
# Fields the pipeline (and `prepare`) reads, never a source: left out of the
# config a source is opened with, so changing them opens no new source.
PIPELINE_FIELDS = ('eval_split', 'batch_size', 'eval_batch_size',
                   'image_size', 'pp_train', 'pp_eval', 'shuffle_buffer',
                   'cache', 'prefetch', 'mixup', 'cutmix',
                   'num_train_examples', 'prepare')
_LOGGED = set()  # Held-out warnings already logged by this process.


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
  held_out_error: Optional[Exception] = None

  def require_eval_split(self) -> str:
    """The eval split, or the error saying how to set one."""
    if self.eval_split is None:
      # A fresh copy each time: the stored error raised itself would carry
      # its callers' frames (and what they hold: iterators, their threads)
      # in a traceback kept alive by these settings.
      raise copy.copy(self.eval_split_error)
    return self.eval_split

  def check_held_out(self) -> None:
    """Before training: raises a DataError if the eval split
    (`input.eval_split`, or the dataset's default) shares examples with
    the train split without being it (module docstring)."""
    if self.held_out_error is not None:
      raise copy.copy(self.held_out_error)  # As in `require_eval_split`.


def read(input_config, *, eval_split: Optional[str] = None) -> Settings:
  """Fills defaults, opens the source and resolves the splits."""
  name = input_config.get('data')
  if not name:
    raise ValueError('input.data is not set; known datasets: '
                     f'{", ".join(registry.names())}')
  spec = registry.get(name)
  train = input_config.get('train_split') or spec.train_split
  train = spec.resolve_split(train) if train else None
  source = kinds.open_source(spec, source_config(input_config, train))
  skip_bad_images = bool(input_config.get('skip_bad_images', False))
  if skip_bad_images and not getattr(source, 'skip_bad_images', False):
    raise DataError(_cannot_skip(spec))
  evals, error = eval_split or input_config.get('eval_split'), None
  if not evals:
    try:
      evals = source.default_eval_split()
    except ValueError as e:  # Only evaluation needs it.
      error = e.with_traceback(None)  # Kept: no frames (no cycle) with it.
  resolved = spec.resolve_split(evals) if evals else None
  held_out = None
  if train and resolved and not eval_split:
    held_out = _held_out(source, input_config, train, resolved, evals)
  image_size = input_config.get('image_size')
  image_size = ops.pixels(spec.image_size if image_size is None
                          else image_size, 'input.image_size')
  batch = input_config.get('batch_size')
  return Settings(
      spec=spec, source=source,
      train_split=train,
      eval_split=resolved,
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
      data_dir=expand_data_dir(input_config.get('data_dir')),
      skip_bad_images=skip_bad_images,
      eval_split_error=error,
      held_out_error=held_out)


def source_config(input_config,
                  train_split: Optional[str]) -> ml_collections.ConfigDict:
  """What a source is opened with: the input config without
  `PIPELINE_FIELDS`, `train_split` resolved to its split expression."""
  fields = kinds.config_fields(input_config)
  out = {k: v for k, v in fields.items() if k not in PIPELINE_FIELDS}
  out['train_split'] = train_split
  if out.get('data_dir'):
    out['data_dir'] = expand_data_dir(out['data_dir'])
  return ml_collections.ConfigDict(out)


def expand_data_dir(data_dir: Optional[str]) -> Optional[str]:
  """`input.data_dir` with a leading `~` expanded; URLs (`gs://`) as given.

  A shell leaves `--config.input.data_dir=~/tfds` as typed (`~` is expanded
  only at the start of a word), and `prepare` expands it: unexpanded, every
  source would look for a folder literally named `~` and say the data is
  not prepared in the folder `prepare` had just filled.
  """
  if not data_dir or '://' in data_dir:
    return data_dir
  return os.path.expanduser(data_dir)


def _cannot_skip(spec: registry.DatasetSpec) -> str:
  why = {
      'tfds': 'tfds datasets are decoded once when prepared; a decoding '
              f'error means a broken preparation: prepare it again '
              f'({spec.prepare})',
      'memory': 'its images are arrays in memory, decoded already',
  }.get(spec.source, f'source kind {spec.source!r} does not read the '
        'option (a kind that skips such images says so with a true '
        '`skip_bad_images` attribute)')
  return (f'input.skip_bad_images=True: dataset {spec.name!r} cannot skip '
          'undecodable images, only folder datasets (their files) and '
          'TFRecords (the records of the train split) can: '
          f'{why}. Set input.skip_bad_images=False (or leave it None)')


def _bases(split: str) -> set:
  """The base splits a resolved split expression reads."""
  return {part.split('[')[0].strip() for part in split.split('+')}


def _ranges(split: str, sizes) -> Optional[List[Tuple[str, int, int]]]:
  try:
    return sources.host_ranges(split, sizes, 0, 1)
  except ValueError:
    return None  # An invalid slice: reading the split says so.


def _minus(ranges, cut) -> List[Tuple[str, int, int]]:
  """The examples of `ranges` outside `cut` ((split, start, stop) each)."""
  out = []
  for split, start, stop in ranges:
    pieces = [(start, stop)]
    for other, a, b in cut:
      if other == split:
        pieces = [(x, y) for p, q in pieces
                  for x, y in ((p, min(q, a)), (max(p, b), q)) if x < y]
    out += [(split, x, y) for x, y in pieces]
  return out


def _spell(ranges, sizes, evals: str) -> str:
  """A split expression of `ranges`: the eval split's bound the other way
  round where that is it (`train[90%:]` -> `train[:90%]`), else in
  example counts (`train[:1293]`)."""
  if '+' not in evals and evals.endswith(']') and '[' in evals:
    base, inside = evals[:-1].split('[', 1)
    start, _, stop = inside.partition(':')
    flipped = (f'{base}[:{start}]' if start and not stop else
               f'{base}[{stop}:]' if stop and not start else None)
    if flipped and _ranges(flipped, sizes) == ranges:
      return flipped
  return '+'.join(
      name if (a, b) == (0, sizes[name]) else
      f'{name}[{a or ""}:{"" if b == sizes[name] else b}]'
      for name, a, b in ranges)


def _held_out(source, input_config, train: str, evals: str,
              named: str) -> Optional[DataError]:
  """The error for an eval split sharing examples with the train split
  without being it (logged too); None where it does not.

  The eval split is `input.eval_split`, or the dataset's default (`named`,
  resolved to `evals`): `train_split='train+test'` trains on the default
  `test` as surely as a typed one. Evaluating the train split itself is
  only logged where `input.eval_split` says so (a deliberate fit check),
  refused where the default happens to be it.
  """
  if not _bases(train) & _bases(evals):
    return None
  typed = bool(input_config.get('eval_split'))
  names = (f'input.eval_split={input_config.get("eval_split")!r}' if typed
           else f'the default eval split {named!r} ('
           + (f'{evals!r}; ' if evals != named else '')
           + 'input.eval_split is unset)',
           f'input.train_split={input_config.get("train_split")!r}'
           if input_config.get('train_split') else
           f'the train split {train!r} (the default: input.train_split is '
           'unset)')
  same = train == evals
  if not same:
    try:
      sizes = {b: source.split_size(b) for b in _bases(train) | _bases(evals)}
    except (ValueError, KeyError, AssertionError):
      return None  # Not a split of the source: reading it says so.
    if any(n is None for n in sizes.values()):
      return None  # Unknown without reading (TFRecords: no slices anyway).
    train_ranges, eval_ranges = _ranges(train, sizes), _ranges(evals, sizes)
    if train_ranges is None or eval_ranges is None:
      return None
    same = sorted(train_ranges) == sorted(eval_ranges)
  if same and typed:
    _log_once(f'{names[0]} is {names[1]}: the eval metrics measure how well '
              'the model fits its training examples, not held-out accuracy')
    return None
  if same:
    message = (
        f'{names[0]} is {names[1]}: a run trained on this config is '
        'evaluated on the examples it trains on. Fix: train on other '
        'examples (input.train_split), or set input.eval_split to examples '
        f'outside it; to measure the fit on purpose, set input.eval_split='
        f'{named!r} explicitly')
    _log_once(message)
    return DataError(message)
  shared = sum(max(0, min(b, d) - max(a, c))
               for s, a, b in train_ranges for t, c, d in eval_ranges
               if s == t)
  if not shared:
    return None
  kept = _minus(train_ranges, eval_ranges)
  fix = (f'hold them out of training: input.train_split='
         f'{_spell(kept, sizes, evals)!r}' if kept else
         'evaluate on examples outside the train split')
  message = (
      f'{names[0]} shares {shared} of its '
      f'{sum(b - a for _, a, b in eval_ranges)} examples with {names[1]}: a '
      f'run trained on this config is evaluated on examples it trains on. '
      f'Fix: {fix}. To measure accuracy on training examples on purpose, '
      'evaluate the train split itself (input.eval_split equal to '
      'input.train_split) or add an evaluator with its own split '
      '(config.evals.<name>.split)')
  _log_once(message)
  return DataError(message)


def _log_once(message: str) -> None:
  if message not in _LOGGED:
    _LOGGED.add(message)
    logging.warning('%s', message)


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
