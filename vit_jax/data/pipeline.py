"""What the training loop calls: per-process train and eval batches.

    it = train_iterator(config.input, seed=0, process_index=i, process_count=n)
    batch = next(it)            # {'image': f32 [B/n, H, W, C], 'label': i32 [B/n]}
    state = it.get_state()      # JSON; it.set_state(state) resumes exactly
    for batch in eval_iterator(config.input, process_index=i, process_count=n):
      ...                       # + 'mask': False on padding; every example once
    info = dataset_info(config.input)

Training stream of one process: epochs 0, 1, 2, ... of its shard; epoch e
reads the files in a stateless permutation keyed by (seed, process, e),
permutes each block of `shuffle_buffer` consecutive examples with a key
derived likewise (`shuffle.py`), and numbers the examples 0, 1, ...;
example (e, i) is pre-processed with random ops seeded by (seed, process,
e, i). Batches run across epoch ends, none is dropped. No op reads
TensorFlow's global seed, so the stream is a pure function of (seed,
process_index, process_count, config). The shard size S is known (counted
once for TFRecords), so after B batches of b examples the position is
(e, i) = divmod(B*b, S) on every process: a resume rebuilds epoch e from
the block of `shuffle_buffer` examples holding example i. The source starts
there (`Source.host_dataset_from`): TFRecord sources open only the files
still being read at that point, skipping within them; other sources read
and drop the examples before it (not decoded).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import tensorflow as tf
from absl import logging

from vit_jax.data import mixup as mixup_lib
from vit_jax.data import ops
from vit_jax.data import preprocess
from vit_jax.data import registry
from vit_jax.data import settings as settings_lib
from vit_jax.data import shuffle
from vit_jax.data.errors import DataError, DatasetNotPreparedError

_EPOCH, _INDEX = '_epoch', '_index'
_STATE_FORMAT = 2  # 2: stateless block shuffles; more identity fields.
_hidden = False


def hide_accelerators_from_tf() -> None:
  """tf.data runs on the host CPU; keep TensorFlow off GPUs JAX uses.

  Called first by every entry point here, by `prepare.ensure_prepared`, by
  `python -m vit_jax.main` once it has loaded TensorFlow and by
  `runtime.setup` where TensorFlow is loaded already (`python -m
  vit_jax.vtab` skips finished tasks without loading it): it only works
  before TensorFlow runs an op (a no-op with tensorflow-cpu).
  """
  global _hidden
  if not _hidden:
    _hidden = True
    try:
      tf.config.set_visible_devices([], 'GPU')
    except (RuntimeError, ValueError):  # Already initialised: nothing to do.
      pass


_fold = shuffle.fold


def _keys(seed: int, process_index: int) -> Dict[str, np.ndarray]:
  """Independent stateless keys for each use, per (seed, process)."""
  base = tf.constant([seed, process_index], tf.int64)
  return {name: tf.random.experimental.stateless_fold_in(base, i).numpy()
          for i, name in enumerate(('order', 'shuffle', 'pp', 'mixup'))}


def _finalize(features: Dict[str, tf.Tensor]) -> Dict[str, tf.Tensor]:
  out = dict(features)
  out['image'] = tf.cast(out['image'], tf.float32)
  if out['label'].dtype.is_integer:
    out['label'] = tf.cast(out['label'], tf.int32)
  return out


def _options() -> tf.data.Options:
  options = tf.data.Options()
  options.deterministic = True
  options.threading.max_intra_op_parallelism = 1
  return options


def _check_fixed_size(ds: tf.data.Dataset, kind: str, pp_field: str) -> None:
  """Batches need one shape per feature: refuse a pipeline whose images
  vary in size, naming the field (TensorFlow's batching error would not)."""
  for name, spec in ds.element_spec.items():
    if name in (_EPOCH, _INDEX):
      continue
    if not spec.shape[1:].is_fully_defined():
      raise DataError(
          f'{kind} feature {name!r} has shape {spec.shape[1:]} per example: '
          f'input.{pp_field} must produce fixed-size images (end it with '
          'resize(S), central_crop(S), random_crop(S) or inception_crop(S))')


def _raise_explained(st: settings_lib.Settings, error: tf.errors.OpError,
                     split: str, process_index: int, process_count: int,
                     pp_field: str):
  """Re-raises a reading error, replaced by a clearer one: a pre-processing
  op's (cheap: it reads the message) or else the source's."""
  better = (ops.explain_error(error, f'input.{pp_field}')
            or st.source.explain_error(error, split, process_index,
                                       process_count))
  try:
    if better is None:
      raise error
    raise better from error
  finally:
    # The raised error's traceback holds this frame: were the errors still
    # its locals, they, the caller's iterator and its tf.data threads would
    # be a reference cycle, alive until a later cyclic collection.
    del better, error


class TrainIterator:
  """Endless local train batches with an exact, cheap, resumable position.

  `get_state()` is a small JSON dict; `set_state(state)` makes the next
  batch the one an uninterrupted run would have produced next. The position
  (epoch, index) is a pure function of the batch count and the process's
  shard size (counted at construction; TFRecord counts are cached next to
  the data), so the state of process 0 restores every process exactly.
  """

  def __init__(self, st: settings_lib.Settings, *, seed: int,
               process_index: int, process_count: int):
    self._st = st
    self._seed = int(seed)
    self._pi, self._pc = process_index, process_count
    self._local = settings_lib.local_batch_size(st.batch_size, process_count,
                                                'batch_size')
    if st.train_split is None:
      raise DataError(f'{st.spec.name} has no train split (evaluation only)')
    st.source.check_train_split(st.train_split, process_count)
    self._host_size = st.source.count_host(st.train_split, process_index,
                                           process_count)
    if self._host_size == 0:
      raise DataError(
          f'{st.spec.name} split {st.train_split!r} has no examples for '
          f'process {process_index} of {process_count}')
    self._block = max(1, min(st.shuffle_buffer, self._host_size))
    if self._block < self._host_size and (
        st.cache or st.source.reads_in_one_order(
            st.train_split, process_index, process_count)):
      logging.warning(
          'input.shuffle_buffer=%d: process %d reads its %d examples of %s '
          'split %r in one order every epoch (%s), so every epoch cuts them '
          'into the same blocks of %d consecutive examples and permutes only '
          'within each block: examples more than a block apart never share '
          'a batch. Set shuffle_buffer >= %d for a full permutation per '
          'epoch (that many encoded examples in memory)%s',
          st.shuffle_buffer, process_index, self._host_size, st.spec.name,
          st.train_split, 'input.cache' if st.cache else
          'one file, or arrays in memory', self._block, self._host_size,
          '' if st.cache else ', or write the data in more files')
    self._pp = preprocess.build(st.pp_train, st.image_size)
    self._keys = _keys(self._seed, process_index)
    self._num_classes = st.source.num_classes
    self._batches = 0
    self._iterator: Optional[Iterator[Dict[str, np.ndarray]]] = None

  @property
  def local_batch_size(self) -> int:
    return self._local

  def _position(self) -> Tuple[int, int]:
    """(epoch, index) of the next example: from the batch count alone."""
    epoch, index = divmod(self._batches * self._local, self._host_size)
    return int(epoch), int(index)

  def dataset(self, epoch: int = 0, index: int = 0) -> tf.data.Dataset:
    """The batched stream starting at example `index` of epoch `epoch`."""
    # The functions below capture locals, never `self`: a traced function
    # holding `self` would tie this object, its running iterator and the
    # tf.data threads in a reference cycle that only a later cyclic garbage
    # collection frees, stalling whatever runs then for seconds.
    st, keys, pp, block = self._st, self._keys, self._pp, self._block
    source, split = st.source, st.train_split
    pi, pc = self._pi, self._pc
    local, num_classes = self._local, self._num_classes
    cached = (source.host_dataset(split, pi, pc).cache() if st.cache
              else None)

    def one_epoch(e, start=0):
      """Epoch `e` (int64) from example `start` (a Python int): the first
      epoch is built eagerly, so that a resume can skip the source's files
      before `start` unread; the later ones in `flat_map`."""
      if cached is not None:  # In memory: the block shuffle is the order.
        ds = cached  # Read (and cached) up to `start` on a resume.
      elif start:
        order_key = _fold(keys['order'], e)

        def ds(first):  # From the block holding `start`: files skipped.
          return source.host_dataset_from(split, pi, pc, first,
                                          order_key=order_key)
      else:
        ds = source.host_dataset(split, pi, pc,
                                 order_key=_fold(keys['order'], e))
      ds = shuffle.block_shuffle(ds, block, _fold(keys['shuffle'], e),
                                 skip=start)
      # (e, (i, example)): numbered without a serial map.
      return tf.data.Dataset.zip((tf.data.Dataset.from_tensors(e).repeat(),
                                  ds.enumerate(start=start)))

    def process(e, numbered):
      i, features = numbered
      out = _finalize(pp(features, _fold(keys['pp'], e, i)))
      return {**out, _EPOCH: e, _INDEX: i}

    ds = one_epoch(tf.constant(epoch, tf.int64), int(index)).concatenate(
        tf.data.Dataset.range(epoch + 1, 2**62).flat_map(one_epoch))
    ds = ds.map(process, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.batch(local, drop_remainder=True)
    _check_fixed_size(ds, 'train', 'pp_train')
    if st.mixup > 0 or st.cutmix > 0:
      # Several batches at once (each op of it runs on one thread): the
      # seed is the batch's own (epoch, index), so the output is the same
      # whatever the parallelism, and `deterministic` keeps the order.
      def mix(b):
        return mixup_lib.mix(b, st.mixup, st.cutmix, num_classes,
                             _fold(keys['mixup'], b[_EPOCH][0], b[_INDEX][0]))
      ds = ds.map(mix, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(st.prefetch).with_options(_options())

  def __iter__(self) -> 'TrainIterator':
    return self

  def __next__(self) -> Dict[str, np.ndarray]:
    if self._iterator is None:
      self._iterator = self.dataset(*self._position()).as_numpy_iterator()
    try:
      batch = next(self._iterator)
    except tf.errors.OpError as e:
      _raise_explained(self._st, e, self._st.train_split, self._pi, self._pc,
                       'pp_train')
    epoch, index = batch.pop(_EPOCH)[-1], batch.pop(_INDEX)[-1]
    self._batches += 1
    self._check_position(int(epoch), int(index) + 1)
    return batch

  def _check_position(self, epoch: int, index: int) -> None:
    """The stream is where the batch count says (else the data changed)."""
    if index == self._host_size:
      epoch, index = epoch + 1, 0
    if (epoch, index) != self._position():
      raise DataError(
          f'{self._st.spec.name} split {self._st.train_split!r}: process '
          f'{self._pi} read to epoch {epoch}, example {index}, but its shard '
          f'was counted as {self._host_size} examples (position '
          f'{self._position()}): the data changed since it was counted '
          '(TFRecords: delete DATA_DIR/.record_counts to count again)')

  def _identity(self) -> Dict[str, Any]:
    """What fixes the stream besides the process; a state must match it."""
    st = self._st
    return {'data': st.spec.name, 'split': st.train_split, 'seed': self._seed,
            'batch_size': st.batch_size, 'process_count': self._pc,
            'pp': preprocess.expand(st.pp_train, st.image_size),
            'shuffle_buffer': st.shuffle_buffer, 'cache': st.cache,
            'mixup': st.mixup, 'skip_bad_images': st.skip_bad_images,
            # Not `data_dir` (`get_state` records it, `set_state` logs a
            # change): data moved (to a bucket) is the same stream; changed
            # counts are caught by `host_size` and `_check_position`.
            # Only when on: states saved before CutMix existed still match.
            **({'cutmix': st.cutmix} if st.cutmix else {}),
            # Sources whose file order changed between versions (folders).
            **({'file_order': st.source.file_order}
               if getattr(st.source, 'file_order', None) else {})}

  def get_state(self) -> Dict[str, Any]:
    """The position after the last batch returned, JSON-serialisable."""
    epoch, index = self._position()
    return {'format': _STATE_FORMAT, 'batches': self._batches,
            'epoch': epoch, 'index': index, 'process_index': self._pi,
            'host_size': self._host_size, **self._identity(),
            # Recorded, not compared (`set_state` logs a change).
            'data_dir': self._st.data_dir}

  def set_state(self, state: Dict[str, Any]) -> None:
    """Continues from `state` (from `get_state` of any process)."""
    if state.get('format') != _STATE_FORMAT:
      raise DataError(
          f'cannot resume the input pipeline exactly: the saved state has '
          f'format {state.get("format")!r}, this version writes '
          f'{_STATE_FORMAT} (its stream differs). Start afresh from its '
          'weights: a new --workdir with --config.init=<this workdir> (the '
          'encoder carries over; head, optimiser and schedule restart).')
    mine = self._identity()
    diff = {k: (state.get(k), v) for k, v in mine.items()
            if state.get(k) != v}
    if 'file_order' in diff:
      raise DataError(
          'cannot resume the input pipeline exactly: the run read its '
          f'files in another order ({diff["file_order"][0]!r}; image '
          'folders are ordered by a hash of each path since 2026-11-29), so '
          'its train and held-out slices hold other images now. Start '
          'afresh from its weights: a new --workdir with --config.init='
          '<this workdir> (the encoder carries over; head, optimiser and '
          'schedule restart).')
    if diff:
      raise DataError(
          'cannot resume the input pipeline exactly: the saved state was '
          f'made with other settings (saved, now): {diff}. Resume with the '
          'same input config, seed and process count; or start afresh from '
          'its weights: a new --workdir with --config.init=<this workdir> '
          '(the encoder carries over; head, optimiser and schedule '
          'restart).')
    previous, self._batches = self._batches, int(state['batches'])
    saved = (state.get('epoch'), state.get('index'))
    # The saved shard size where the state has it: the position alone
    # matches any size until the first epoch ends (divmod(B*b, S) is
    # (0, B*b) for every S > B*b). Older states have only the position.
    size = state.get('host_size')
    if state.get('process_index') == self._pi and (
        saved != self._position()
        or size is not None and size != self._host_size):
      self._batches = previous
      counted = (f'{size} examples then, {self._host_size} now'
                 if size is not None else
                 f'saved position {saved}, now {self._position()}')
      raise DataError(
          f'cannot resume the input pipeline exactly: the shard of process '
          f'{self._pi} changed size since the state was saved ({counted}): '
          'the examples the run has not read yet are others now. Resume '
          'with the same data; or start afresh from its weights: a new '
          '--workdir with --config.init=<this workdir> (the encoder carries '
          'over; head, optimiser and schedule restart).')
    if 'data_dir' in state and state['data_dir'] != self._st.data_dir:
      # Files copied elsewhere (to a bucket between preemptions) are the
      # same stream; other files of the same count are not, and only the
      # user can tell them apart: said loudly.
      logging.warning(
          '*** DELIBERATE CHANGE on resume: input.data_dir was %s and is '
          'now %s. The run continues its stream there, which is exact only '
          'if the files are the same (a changed count is refused). ***',
          state['data_dir'], self._st.data_dir)
    self._iterator = None


def train_iterator(input_config, *, seed: int, process_index: int = 0,
                   process_count: int = 1) -> TrainIterator:
  """Endless train batches of this process's shard; see `TrainIterator`.

  Args:
    input_config: the `input` ConfigDict (fields: `settings.py`).
    seed: the run's seed; with the process index it seeds file order,
      shuffling and random pre-processing.
    process_index: this process, in [0, process_count).
    process_count: number of processes; `input.batch_size` must divide.

  Returns:
    An iterator of {'image': float32 [B/n, H, W, C], 'label': int32 [B/n]}
    (label float32 [B/n, classes] with mixup), with get_state / set_state.
  """
  hide_accelerators_from_tf()
  settings_lib.check_process(process_index, process_count)
  st = settings_lib.read(input_config)
  st.check_held_out()  # Training on the examples it evaluates: refused.
  return TrainIterator(st, seed=seed, process_index=process_index,
                       process_count=process_count)


class EvalIterable:
  """Fixed-size local eval batches; each pass sees every example once.

  Every process yields `num_batches` batches (the same number on every
  process), the last ones padded with zeros and `mask` False; together the
  processes' unmasked rows are exactly the split. Iterating again makes a
  new pass (reusing the in-memory cache with `input.cache`).
  """

  def __init__(self, st: settings_lib.Settings, *, process_index: int,
               process_count: int):
    self._st = st
    self._pi, self._pc = process_index, process_count
    self.split = st.require_eval_split()
    self.local_batch_size = settings_lib.local_batch_size(
        st.eval_batch_size, process_count, 'eval_batch_size')
    source = st.source
    bound = max(source.size_bound(self.split, p, process_count)
                for p in range(process_count))
    self.num_batches = math.ceil(bound / self.local_batch_size)
    self._dataset = self._build()

  def _build(self) -> tf.data.Dataset:
    st = self._st
    pp = preprocess.build(st.pp_eval, st.image_size)
    ds = st.source.host_dataset(self.split, self._pi, self._pc)
    if st.cache:
      ds = ds.cache()
    key = tf.constant([0, 0], tf.int64)
    ds = ds.enumerate().map(lambda i, x: _finalize(pp(x, _fold(key, i))),
                            num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.batch(self.local_batch_size)
    _check_fixed_size(ds, 'eval', 'pp_eval')
    return ds.prefetch(st.prefetch).with_options(_options())

  def __len__(self) -> int:
    return self.num_batches

  def _padding(self, n: int) -> Dict[str, np.ndarray]:
    return {name: np.zeros((n, *spec.shape[1:]), spec.dtype.as_numpy_dtype)
            for name, spec in self._dataset.element_spec.items()}

  def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
    b = self.local_batch_size
    done = 0
    iterator = self._dataset.as_numpy_iterator()
    while True:
      try:
        batch = next(iterator)
      except StopIteration:
        break
      except tf.errors.OpError as e:
        _raise_explained(self._st, e, self.split, self._pi, self._pc,
                         'pp_eval')
      if done == self.num_batches:  # Processes would fall out of step.
        raise AssertionError(f'{self.split}: more than the {done} eval '
                             'batches counted')
      n = len(batch['label'])
      if n < b:
        pad = self._padding(b - n)
        batch = {k: np.concatenate([v, pad[k]]) for k, v in batch.items()}
      batch['mask'] = np.arange(b) < n
      done += 1
      yield batch
    for _ in range(self.num_batches - done):
      batch = self._padding(b)
      batch['mask'] = np.zeros(b, bool)
      yield batch


def eval_iterator(input_config, *, split: Optional[str] = None,
                  process_index: int = 0,
                  process_count: int = 1) -> EvalIterable:
  """Local eval batches {'image', 'label', 'mask'} covering `split` once.

  Args:
    input_config: the `input` ConfigDict.
    split: a split to evaluate instead of `input.eval_split`.
    process_index: this process, in [0, process_count).
    process_count: number of processes; `input.eval_batch_size` must divide.

  Returns:
    A re-iterable of batches of `eval_batch_size // process_count` rows;
    `mask` is False on padding rows. ImageNet ReaL adds `real_label`
    (bool [B, 1000]).
  """
  hide_accelerators_from_tf()
  settings_lib.check_process(process_index, process_count)
  st = settings_lib.read(input_config, eval_split=split)
  return EvalIterable(st, process_index=process_index,
                      process_count=process_count)


def check_num_classes(input_config, num_classes) -> None:
  """Raises a clear error before training if labels can reach the head size.

  Args:
    input_config: the `input` ConfigDict.
    num_classes: the model head's class count (`config.num_classes`, or the
      dataset's when that is None).

  Raises:
    ValueError: `num_classes` is not a positive integer.
    LabelRangeError: the dataset's labels (from its metadata: class folders,
      tfds features, the registry, in-memory arrays, `input.num_classes` of
      TFRecords) go up to `num_classes` or beyond. TFRecord labels are also
      checked example by example as they are read, naming the file.
  """
  if (isinstance(num_classes, bool) or not isinstance(num_classes, int)
      or num_classes < 1):
    raise ValueError(
        f'num_classes={num_classes!r}: expected a positive integer, or '
        "--config.num_classes=None for the dataset's class count")
  settings_lib.read(input_config).source.check_labels(num_classes)


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What the trainer needs to know before the first batch."""
  name: str
  num_classes: int
  num_train_examples: Optional[int]
  num_eval_examples: int
  image_shape: Tuple[int, int, int]
  eval_image_shape: Tuple[int, int, int]
  train_split: Optional[str]
  eval_split: str
  # Labels are multi-hot float [classes] (multi-label TFRecords), not ids.
  multi_label: bool = False


def _output_shape(st: settings_lib.Settings, split: str, pp_spec):
  pp = preprocess.build(pp_spec, st.image_size)
  spec = st.source.element_spec(split)
  fn = tf.function(lambda x: _finalize(pp(x, tf.constant([0, 0], tf.int64))))
  shape = fn.get_concrete_function(spec).structured_outputs['image'].shape
  if not shape.is_fully_defined():
    raise DataError(f'pre-processing {pp_spec!r} gives images of shape '
                    f'{shape}: end it with resize(S) or a crop to S')
  return tuple(shape.as_list())


def _check_size_used(input_config, field: str, shape) -> None:
  """A config that sets both `input.image_size` and an op string making
  images of another size: the size would be silently ignored."""
  size, spec = input_config.get('image_size'), input_config.get(field)
  if size and spec and tuple(shape[:2]) != (int(size), int(size)):
    fix = (f'Set --config.input.image_size={shape[0]}' if shape[0] == shape[1]
           else 'input.image_size is a square size: for non-square images '
           'set it to None in the config file (the op strings give the '
           'size)')
    raise DataError(
        f'input.image_size={size} is ignored: input.{field}={spec!r} makes '
        f'{shape[0]}x{shape[1]} images. {fix}, or change the size in the op '
        "string (presets such as 'resize' or 'inception' use "
        'input.image_size)')


def _check_same_range(st: settings_lib.Settings) -> None:
  """Train and eval images must end in one value range: a pp_eval without
  the train pipeline's value_range(-1,1) would evaluate on [0, 255] pixels,
  silently, with garbage results. Pipelines whose range is unknown (an op
  of the user's own after the last value_range) are not compared."""
  train = preprocess.output_range(st.pp_train, st.image_size)
  evaluate = preprocess.output_range(st.pp_eval, st.image_size)
  if train is None or evaluate is None or train == evaluate:
    return
  ops_of = lambda spec: '|'.join(preprocess.expand(spec, st.image_size))
  # The side to change: the one off the models' usual [-1, 1] (the public
  # checkpoints', the presets', MPP's colour targets'), else pp_eval.
  standard = preprocess.MINUS_ONE_TO_ONE
  if evaluate == standard:
    wrong, right, target = 'pp_train', 'pp_eval', evaluate
  else:
    wrong, right, target = 'pp_eval', 'pp_train', train
  if target == preprocess.PIXELS:
    fix = f'remove value_range from input.{wrong} (as input.{right})'
  else:
    fix = (f'end input.{wrong} with {preprocess.value_range_op(target)} '
           f'as input.{right} does')
    if target == standard:
      fix += " (the presets 'eval', 'resize' and 'inception' do)"
  raise DataError(
      f'input.pp_eval={ops_of(st.pp_eval)!r} gives images in '
      f'{preprocess.describe_range(evaluate)} but input.pp_train='
      f'{ops_of(st.pp_train)!r} gives {preprocess.describe_range(train)}: '
      'the model would be evaluated on other values than it is trained on. '
      f'Fix: {fix}')


def _check_same_shape(st: settings_lib.Settings, train, evaluate) -> None:
  """Train and eval images must have one shape: the model takes one input
  size, so a mismatch (`pp_train='decode|resize(16)|...'` beside the
  preset at the registry's 8) would fail at the first evaluation, after
  steps ran. With `input.image_size` set, `_check_size_used` names the
  pipeline that ignores it first."""
  if tuple(train) == tuple(evaluate):
    return
  ops_of = lambda spec: '|'.join(preprocess.expand(spec, st.image_size))
  shape = lambda s: 'x'.join(map(str, s))
  fix = ('resize them to one size: end both with resize(S) (or a crop to '
         'S), or set input.image_size=S and use presets (resize, eval, '
         'inception, ...) that take it'
         if tuple(train[:2]) != tuple(evaluate[:2]) else
         'decode to one channel count in both (decode(C) first, or to_rgb)')
  raise DataError(
      f'input.pp_train={ops_of(st.pp_train)!r} makes {shape(train)} images '
      f'but input.pp_eval={ops_of(st.pp_eval)!r} makes {shape(evaluate)}: '
      'the model takes one input shape, so it would fail at its first '
      f'evaluation, after training steps ran. Fix: {fix}')


def dataset_info(input_config, *, split: Optional[str] = None,
                 training: bool = True) -> DatasetInfo:
  """Classes, split sizes and the model's input shape for `input_config`.

  `split` replaces `input.eval_split` (as in `eval_iterator`). `training`:
  for a run that trains on `input_config` (not `mode=eval`, which resizes
  the model to its eval images, nor an evaluator's own `split`), whose
  train and eval images must have one shape.
  """
  hide_accelerators_from_tf()
  st = settings_lib.read(input_config, eval_split=split)
  source = st.source
  num_train = None
  if st.train_split:
    num_train = source.split_size(st.train_split) or st.num_train_examples
  eval_split = st.require_eval_split()
  num_eval = source.split_size(eval_split)
  if num_eval is None:
    num_eval = source.count_host(eval_split, 0, 1)
  eval_shape = _output_shape(st, eval_split, st.pp_eval)
  train_shape = (_output_shape(st, st.train_split, st.pp_train)
                 if st.train_split else eval_shape)
  _check_size_used(input_config, 'pp_eval', eval_shape)
  if st.train_split:
    _check_size_used(input_config, 'pp_train', train_shape)
    _check_same_range(st)
    if training and split is None:
      _check_same_shape(st, train_shape, eval_shape)
  return DatasetInfo(
      name=st.spec.name, num_classes=source.num_classes,
      num_train_examples=num_train, num_eval_examples=num_eval,
      image_shape=train_shape, eval_image_shape=eval_shape,
      train_split=st.train_split, eval_split=eval_split,
      multi_label=bool(getattr(source, 'multi_label', False)))


def class_names(input_config) -> Optional[List[str]]:
  """The name of each label of `input.data`, in label order; None where the
  data has none (VTAB label functions, TFRecords).

  From metadata only: tfds feature info (read from the code of the builder
  when the dataset is not prepared here), class folder names, '0'..'9' for
  digits and mnist5k. The code of a builder that reads its names from the
  downloaded files (`NAMES_FROM_DOWNLOAD`) has placeholders '0', '1', ...
  instead: None then, so that callers say no names are known (predict's
  `class_<i>`, export's warning) rather than show the placeholders as
  names (mnist's or svhn's '0'..'9' are their real names).
  """
  hide_accelerators_from_tf()
  try:
    return settings_lib.read(input_config).source.class_names()
  except DatasetNotPreparedError:
    spec = registry.get(input_config.get('data'))
    if spec.source != 'tfds' or spec.task or not spec.tfds_name:
      raise
    import tensorflow_datasets as tfds
    feature = tfds.builder(spec.tfds_name).info.features[spec.label_key]
    names = getattr(feature, 'names', None)
    if not names or spec.tfds_name in NAMES_FROM_DOWNLOAD:
      return None  # None, or placeholders (real ones once prepared).
    return list(names)


# tfds builders whose class names come from the downloaded files: before
# it, their code names the classes '0', '1', ...
NAMES_FROM_DOWNLOAD = frozenset({'cifar10', 'cifar100'})
