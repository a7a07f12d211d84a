"""Few-shot linear evaluation, as the paper defines it (Section 4.1).

The frozen pre-logits representation of k training images per class is
mapped onto {-1, 1}^K targets by regularised least squares, solved in closed
form; the accuracy of that linear map on the test split is the k-shot
accuracy. Reported for each dataset of the config, k in `shots`, averaged
over `seeds` draws of the k images.

Details the paper does not fix: the regression is big_vision's
(`fewshot_lsr`, the reference code's successor): each feature is
standardised with the k-shot set's mean and standard deviation (+1e-5), a
constant feature of 100 stands in for the bias (so it is barely
regularised), and `l2_reg` defaults to its 2**10. Ours: the k images of a
class are drawn from its first `pool_per_class` training images (the split
is read in order, the same order on any number of processes, and reading
stops once every class has its pool); for one seed the 1-, 5-, 10- and
25-shot sets are nested.
"""

from __future__ import annotations

import numbers
import re
from typing import Any, Dict, List, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from vit_jax.data import pipeline, preprocess, registry
from vit_jax.data.errors import DatasetNotPreparedError
from vit_jax.evaluators import base
from vit_jax import sharding as shd


def representation(params: Any, images: jax.Array, *,
                   model: nn.Module) -> jax.Array:
  """The model's pre-logits representation (what it sows), float32."""
  with nn.logical_axis_rules(shd.ACTIVATION_RULES):
    _, state = model.apply({'params': params}, images, train=False,
                           mutable=['intermediates'])
  return state['intermediates']['representation'][0].astype(jnp.float32)


# big_vision's constant bias feature: large, so its weight is barely
# regularised.
BIAS_FEATURE = 100.0
# Few-shot's pre-processing unless `evals.<name>.pp` says otherwise: the
# `resize` preset's ops, written out so that `{size}` can be (H, W).
DEFAULT_PP = preprocess.PRESETS['resize']
L2_REG = 2.0**10  # big_vision's default.
SHOTS = (1, 5, 10, 25)  # The paper's shot counts, `shots`' default.
SEEDS = 3  # Draws of each k-shot set, `seeds`' default.
POOL_PER_CLASS = 100  # First examples of each class drawn from.


# Test rows standardised and scored at a time: a float64 copy of the whole
# test set for each of a dataset's fits was most of fit_predict's memory at
# ImageNet scale (50k x 1024: 0.4 GB, twice, plus 50k x 1000 scores).
TEST_ROWS = 4096


def fit_predict(x_train: np.ndarray, y_train: np.ndarray,
                x_test: np.ndarray, num_classes: int,
                l2_reg: float = L2_REG) -> np.ndarray:
  """Closed-form ridge regression onto {-1, 1} targets of standardised
  features plus a constant bias feature (big_vision's); test predictions.

  The design matrix is built in place, and `x_test` is standardised and
  scored `TEST_ROWS` rows at a time (the same arithmetic as a whole, so
  massive activations lose nothing to cancellation), so memory beyond the
  inputs is one float64 copy of `x_train` and a block of `x_test`.
  """
  n, d = len(x_train), np.shape(x_train)[1]
  a = np.empty((n, d + 1))  # [standardised x_train, BIAS_FEATURE].
  a[:, :d] = x_train
  mean, std = a[:, :d].mean(0), a[:, :d].std(0) + 1e-5
  a[:, :d] -= mean
  a[:, :d] /= std
  a[:, d] = BIAS_FEATURE
  targets = 2.0 * np.eye(num_classes)[y_train] - 1.0
  if n <= d + 1:  # Dual form: an n x n system.
    w = a.T @ np.linalg.solve(a @ a.T + l2_reg * np.eye(n), targets)
  else:
    w = np.linalg.solve(a.T @ a + l2_reg * np.eye(d + 1), a.T @ targets)
  del a
  bias = BIAS_FEATURE * w[d]
  pred = np.empty(len(x_test), np.int64)
  for start in range(0, len(x_test), TEST_ROWS):
    block = (np.asarray(x_test[start:start + TEST_ROWS], np.float64) - mean
             ) / std
    pred[start:start + TEST_ROWS] = (block @ w[:d] + bias).argmax(-1)
  return pred


def draw(labels: np.ndarray, num_classes: int, shots: Sequence[int],
         seed: int) -> Dict[int, np.ndarray]:
  """Indices of k examples per class for every k (nested within a seed)."""
  rng = np.random.default_rng(seed)
  order = {c: rng.permutation(np.flatnonzero(labels == c))
           for c in range(num_classes)}
  return {k: np.concatenate([order[c][:k] for c in range(num_classes)])
          for k in shots}


@base.register('fewshot')
class FewShot(base.Evaluator):
  """k-shot linear accuracy of the frozen representation on some datasets.

  Config section (`config.evals.<name>`, `configs/common.fewshot`):
  `datasets` (registry names, or `name:train_split:test_split`; a dataset
  without a train split in the registry must name one, and the two splits
  must differ and hold examples), `shots`, `seeds`, `l2_reg` (None or
  absent: `L2_REG`), `pool_per_class`, `pp` (pre-processing, None:
  `DEFAULT_PP`; `{size}` as `base.section_ops` defines it; its value range
  must be the run's `input.pp_train`'s), `batch_size` (None or absent:
  `input.eval_batch_size`), `every`, `data_dir` (None: `input.data_dir`,
  the run's).
  Metrics: `fewshot/<dataset>/<k>shot` (mean over seeds) and `..._std`;
  a section not named `fewshot` writes `fewshot/<name>/<dataset>/...`, so
  that two sections never overwrite each other's numbers. Keys it does
  not read and values it cannot use (no datasets, a 0-shot count, no
  seeds, `l2_reg` <= 0, a `batch_size` below 1) are refused when it is
  built, naming the key.
  """

  KEYS = ('datasets', 'shots', 'seeds', 'l2_reg', 'pool_per_class', 'pp',
          'batch_size', 'data_dir')

  def __init__(self, name: str, cfg: ml_collections.ConfigDict,
               context: base.Context):
    super().__init__(name, cfg, context)
    input_config, image_size = context.config.input, context.image_size
    self._key = metric_prefix(name)
    model, mesh = context.model, context.mesh
    params_sharding = context.params_sharding
    self.shots = tuple(sorted(_counts(name, 'shots',
                                      cfg.get('shots', SHOTS))))
    self.seeds = _count(name, 'seeds', cfg.get('seeds', SEEDS))
    self.l2_reg = _l2_reg(name, cfg.get('l2_reg'))
    self.pool = _count(name, 'pool_per_class',
                       cfg.get('pool_per_class', POOL_PER_CLASS))
    if self.pool < self.shots[-1]:
      raise ValueError(f'evals.{name}.pool_per_class={self.pool} is below '
                       f'the largest shot count {self.shots[-1]}')
    self._mesh = mesh
    self._datasets = [_parse_dataset(d)
                      for d in _dataset_names(name, cfg.get('datasets'))]
    names = [data for data, _, _ in self._datasets]
    if len(set(names)) < len(names):  # Their metrics would share names.
      raise ValueError(f'evals.{name}.datasets={tuple(cfg.datasets)} names '
                       'a dataset twice; evaluate its other splits in a '
                       'section of their own (config.evals.<other name>)')
    self._pipelines: Dict[Tuple[str, str], pipeline.EvalIterable] = {}
    batch = cfg.get('batch_size')
    batch = ((input_config.get('eval_batch_size') or input_config.batch_size)
             if batch is None else _count(name, 'batch_size', batch))
    shd.check_batch_size(batch, mesh, f'evals.{name}.batch_size')
    pp = cfg.get('pp') or DEFAULT_PP
    ops = base.section_ops(name, pp, image_size)
    base.check_run_range(name, pp, ops, context, default=not cfg.get('pp'))
    self._input = ml_collections.ConfigDict(dict(
        data='',
        data_dir=cfg.get('data_dir') or input_config.get('data_dir'),
        # The ops are written out (`section_ops`): no input size to check
        # them against but the model's (`base.check_shape`).
        image_size=None,
        # Both splits' features come from these ops (not the dataset's
        # training augmentation, whose value range dataset_info compares).
        pp_train=ops, pp_eval=ops,
        eval_batch_size=batch, batch_size=batch))
    self._classes: Dict[str, int] = {}
    for data, train_split, test_split in self._datasets:  # Fail early.
      spec = registry.get(data)
      if not (train_split or spec.train_split):
        raise ValueError(
            f'evals.{name}: few-shot dataset {data!r} has no train split in '
            'the registry (it is for evaluation only): its k-shot images '
            'would be drawn from the split it scores. Name a train split '
            f'the test split does not overlap: {data}:TRAIN:TEST')
      cfg_ = ml_collections.ConfigDict(self._input.to_dict())
      cfg_.data = data
      if train_split:
        cfg_.train_split = train_split
      try:
        info = pipeline.dataset_info(cfg_, split=test_split or None)
      except DatasetNotPreparedError as e:
        where = ('evals.%s.data_dir=%s' % (name, cfg.data_dir)
                 if cfg.get('data_dir') else
                 f'the run\'s input.data_dir ({cfg_.data_dir}), as '
                 f'evals.{name}.data_dir is unset')
        raise DatasetNotPreparedError(
            f'evals.{name}: few-shot dataset {data!r} was looked for in '
            f'{where}: {e} (set --config.evals.{name}.data_dir to where it '
            'is)') from e
      if not info.num_classes:
        raise ValueError(f'evals.{name}: few-shot dataset {data!r} does not '
                         'fix its class count; few-shot needs labelled '
                         'classes')
      if info.multi_label:
        raise ValueError(f'evals.{name}: few-shot dataset {data!r} is '
                         'multi-label; few-shot draws k images of one class '
                         'each: pick a single-label dataset')
      base.check_shape(name, ops, info.eval_image_shape, context,
                       f'few-shot dataset {data!r}', default=DEFAULT_PP)
      if info.num_eval_examples == 0:
        raise _empty(name, data, info.eval_split)
      # The train split's pipeline, built now (its first use is at the
      # first evaluation): an empty one fails here, before training.
      train = self._batches(data, train_split or spec.train_split,
                            ordered=True, local=False)
      if not len(train):
        raise _empty(name, data, train.split)
      if train.split == info.eval_split:  # As resolved: 'folder:test:' too.
        raise _scored(name, data, train.split)
      self._classes[data] = info.num_classes
    rep = shd.replicated(mesh)
    def represent(params, batch):
      return {'x': representation(params, batch['image'], model=model),
              'label': batch['label'], 'mask': batch['mask']}
    # Replicated outputs: every process holds the whole global batch.
    self._represent = base.jit(represent, mesh,
                               in_shardings=(params_sharding, None),
                               out_shardings=rep)

  def _batches(self, data: str, split: str, ordered: bool = False,
               local: bool = True):
    """`split`'s local batches (`local=False`: its pipeline), the pipeline
    built once.

    `ordered`: global batch i is the split's examples [i * B, (i + 1) * B)
    in order, whatever the process count (each process reads the whole
    global batch and keeps its rows: the pool of the first examples of each
    class is then the same on 1 or n hosts, at n times the decoding);
    otherwise each process reads its own contiguous part
    (`base.eval_batches`), for splits read whole.
    """
    key = (data, split, ordered)
    if key not in self._pipelines:
      cfg = ml_collections.ConfigDict(self._input.to_dict())
      cfg.data = data
      self._pipelines[key] = (
          pipeline.eval_iterator(cfg, split=split) if ordered
          else base.eval_batches(cfg, split))
    batches = self._pipelines[key]
    if not local or not ordered or jax.process_count() == 1:
      return batches
    rows = self._input.eval_batch_size // jax.process_count()
    start = jax.process_index() * rows
    return ({k: v[start:start + rows] for k, v in batch.items()}
            for batch in batches)

  def _features(self, params, data: str, split: str, pool: int = 0
                ) -> Tuple[np.ndarray, np.ndarray]:
    """(features, labels) of `split`, in order; with `pool`, the first
    `pool` of each class, read until every class has them (only those are
    kept while reading: memory stays within pool x classes rows)."""
    num_classes = self._classes[data]
    feats: List[np.ndarray] = []
    labels: List[np.ndarray] = []
    counts = np.zeros(num_classes or 1, np.int64)
    for batch in self._batches(data, split, ordered=bool(pool)):
      batch = {k: batch[k] for k in ('image', 'label', 'mask')}
      out = jax.device_get(self._represent(
          params, shd.global_batch(batch, self._mesh)))
      keep = out['mask'].astype(bool)
      x, y = out['x'][keep], out['label'][keep].astype(np.int64)
      if pool:
        first = first_of_each_class(y, counts, pool)
        x, y = x[first], y[first]
      feats.append(x)
      labels.append(y)
      if pool and counts.min() >= pool:
        break  # Every process sees the same counts: all stop here.
    if not feats:  # An empty split whose size was not known at build.
      raise _empty(self.name, data, split)
    return np.concatenate(feats), np.concatenate(labels)

  def run(self, params: Any) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for data, train_split, test_split in self._datasets:
      spec = registry.get(data)
      train_split = train_split or spec.train_split
      test_split = test_split or spec.eval_split
      k = self._classes[data]
      x_train, y_train = self._features(params, data, train_split, self.pool)
      have = np.bincount(y_train, minlength=k)
      shot_counts = [n for n in self.shots if n <= have.min()]
      if len(shot_counts) < len(self.shots):
        # Found only now (the split is read at evaluation): the other
        # shot counts and the run's results are kept.
        logging.error(
            'few-shot %s: class %d has only %d examples in %r: no %s-shot '
            'result; lower evals.%s.shots (now %s) or pick a larger train '
            'split', data, int(have.argmin()), int(have.min()), train_split,
            '/'.join(str(n) for n in self.shots if n > have.min()),
            self.name, self.shots)
      if not shot_counts:
        continue
      x_test, y_test = self._features(params, data, test_split)
      if _not_finite(self.name, data, x_train, x_test):
        for shots in shot_counts:
          out[f'{self._key}{data}/{shots}shot'] = float('nan')
          out[f'{self._key}{data}/{shots}shot_std'] = float('nan')
        continue
      accs = {s: [] for s in shot_counts}
      for seed in range(self.seeds):
        for shots, idx in draw(y_train, k, shot_counts, seed).items():
          pred = fit_predict(x_train[idx], y_train[idx], x_test, k,
                             self.l2_reg)
          accs[shots].append(float(np.mean(pred == y_test)))
      for shots, values in accs.items():
        out[f'{self._key}{data}/{shots}shot'] = float(np.mean(values))
        out[f'{self._key}{data}/{shots}shot_std'] = float(np.std(values))
    return out

  def metric_names(self):
    return frozenset(f'{self._key}{data}/{k}shot{std}'
                     for data, _, _ in self._datasets for k in self.shots
                     for std in ('', '_std'))

  @classmethod
  def settings(cls, cfg, config):
    """Datasets, shots, seeds, regulariser, pool and pre-processing, with
    the evaluator's defaults (its batch size changes no number)."""
    del config  # The image size and value range are the run's own.
    l2_reg = cfg.get('l2_reg')
    return {'datasets': [list(_split_dataset(d))
                         for d in cfg.get('datasets', ())],
            'shots': sorted(int(k) for k in cfg.get('shots', SHOTS)),
            'seeds': int(cfg.get('seeds', SEEDS)),
            'l2_reg': L2_REG if l2_reg is None else float(l2_reg),
            'pool_per_class': int(cfg.get('pool_per_class', POOL_PER_CLASS)),
            'pp': cfg.get('pp') or DEFAULT_PP}


def first_of_each_class(labels: np.ndarray, counts: np.ndarray,
                        pool: int) -> np.ndarray:
  """Which of `labels` (one batch, in read order) are among the first `pool`
  of their class, `counts` (updated here) being how many of each class
  earlier batches kept. Labels outside [0, len(counts)) are never kept."""
  num_classes = len(counts)
  valid = (labels >= 0) & (labels < num_classes)
  y = np.where(valid, labels, num_classes)  # An extra class for the rest.
  order = np.argsort(y, kind='stable')
  ranked = y[order]
  rank = np.empty(len(y), np.int64)  # Earlier rows of its class here.
  rank[order] = np.arange(len(y)) - np.searchsorted(ranked, ranked)
  keep = valid & (np.append(counts, pool)[y] + rank < pool)
  counts += np.bincount(y[keep], minlength=num_classes)[:num_classes]
  return keep


def _scored(name: str, data: str, split: str) -> ValueError:
  """k-shot images drawn from the split the few-shot accuracy is of."""
  return ValueError(
      f'evals.{name}: few-shot dataset {data!r} would draw its k-shot '
      f'images from {split!r}, the split it scores. Name a train split the '
      f'test split does not overlap: {data}:TRAIN:TEST')


def _empty(name: str, data: str, split: str) -> ValueError:
  """An empty few-shot split: no k-shot set to draw, or nothing to score."""
  return ValueError(f'evals.{name}: split {split!r} of few-shot dataset '
                    f'{data!r} has no examples: name a non-empty one, '
                    f'{data}:TRAIN:TEST')


def _not_finite(name: str, data: str, x_train: np.ndarray,
                x_test: np.ndarray) -> bool:
  """Whether the representation is not finite (a diverged model), said in
  the log: its NaN scores would predict class 0 for every image, a
  chance-level accuracy that reads like a result; the metrics are NaN."""
  def bad(x):
    return int((~np.isfinite(x).all(axis=1)).sum())
  train, test = bad(x_train), bad(x_test)
  if train or test:
    logging.warning(
        'few-shot %s (evals.%s): NaN, as the representation is not finite '
        'for %d of %d train-pool and %d of %d test images (has the model '
        'diverged?)', data, name, train, len(x_train), test, len(x_test))
  return bool(train or test)


def _is_count(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _count(name: str, key: str, value: Any) -> int:
  """`evals.<name>.<key>`, a whole number >= 1."""
  if not _is_count(value) or value < 1:
    raise ValueError(f'evals.{name}.{key}={value!r}: expected a whole '
                     'number >= 1')
  return int(value)


def _counts(name: str, key: str, value: Any) -> List[int]:
  """`evals.<name>.shots`: a non-empty sequence of whole numbers >= 1 (a
  0-shot result would be a regression on no images)."""
  if (isinstance(value, (str, bytes)) or not isinstance(value, Sequence)
      or not value or not all(_is_count(k) and k >= 1 for k in value)):
    raise ValueError(f'evals.{name}.{key}={value!r}: expected a non-empty '
                     'sequence of whole numbers >= 1, e.g. (1, 5, 10, 25)')
  return [int(k) for k in value]


def _l2_reg(name: str, value: Any) -> float:
  """`evals.<name>.l2_reg`: None (`L2_REG`) or > 0. At 0 the regression of
  k-shot sets with repeated or collinear rows is singular."""
  if value is None:
    return L2_REG
  if (not isinstance(value, numbers.Real) or isinstance(value, bool)
      or not 0 < value < float('inf')):
    raise ValueError(f'evals.{name}.l2_reg={value!r}: expected a number '
                     f'> 0 (None: {L2_REG:g}, big_vision\'s)')
  return float(value)


def _dataset_names(name: str, value: Any) -> List[str]:
  """`evals.<name>.datasets`: a non-empty sequence of strings."""
  example = "e.g. datasets=('mnist5k', 'cifar10:train:test')"
  if value is None:
    raise ValueError(f'evals.{name}.datasets is not set: name the few-shot '
                     f'datasets, {example}')
  if isinstance(value, (str, bytes)):
    raise ValueError(f'evals.{name}.datasets={value!r} is one string: give '
                     f'a sequence of names, datasets=({value!r},)')
  if (not isinstance(value, Sequence) or not value
      or not all(isinstance(d, str) and d for d in value)):
    raise ValueError(f'evals.{name}.datasets={value!r}: expected a '
                     f'non-empty sequence of dataset names, {example}')
  return list(value)


def metric_prefix(name: str) -> str:
  """`fewshot/` for the section named `fewshot` (the result tables' columns
  `<dataset>`), `fewshot/<name>/` for any other (columns
  `<name>/<dataset>`). A dataset name may hold '/' (`vtab/caltech101`):
  the tables read all between `fewshot/` and `/<k>shot` as one name."""
  return 'fewshot/' if name == 'fewshot' else f'fewshot/{name}/'


def _split_dataset(item: str) -> Tuple[str, str, str]:
  """(name, train split, test split) of `NAME` ('' splits: the registry's)
  or `NAME:TRAIN:TEST`."""
  # Colons inside split expressions ('train[:30]') are not separators.
  parts = re.split(r':(?![^\[]*\])', item)
  if len(parts) not in (1, 3):
    raise ValueError(f'few-shot dataset {item!r}: expected NAME or '
                     'NAME:TRAIN_SPLIT:TEST_SPLIT')
  return (parts[0], parts[1], parts[2]) if len(parts) == 3 else (
      parts[0], '', '')


def _parse_dataset(item: str) -> Tuple[str, str, str]:
  parsed = _split_dataset(item)
  registry.get(parsed[0])  # Unknown names fail, with suggestions.
  return parsed
