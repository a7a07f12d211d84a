"""Markdown tables of finished runs, laid out like the paper's, beside its numbers.

Every run's trainer writes `summary.json` in its workdir; its `report` dict
(set by the config) says which paper cell the run fills:

    report = {'model': 'ViT-L/16', 'pretrain': 'jft', 'pretrain_epochs': 14,
              'pretrain_optimizer': 'adam', 'task': 'cifar10', 'sweep': False}

`task` is 'pretrain' for a pre-training run, else the downstream dataset's
registry name ('imagenet2012', 'vtab/caltech101', ...). A run fills the cell
of (model, pretrain, pretrain_epochs, pretrain_optimizer, task); LR-sweep runs
(`sweep`: evaluated on a dev split) are left out; several runs for one cell
are averaged ("mean of n ± s", as the paper's Table 2 averages three
fine-tuning runs). Table 2's ImageNet fine-tuning of ViT-L/16 and ViT-H/14
(512/518 px with Polyak averaging: `report.table2`) is a variant of the
cell: only Table 2's ImageNet and ReaL cells of those models take such runs,
and only they (`Matcher.variant`). Tables: '2' (state of the
art), '6' (scaling study), 'optim' (ResNets, Adam vs SGD), 'vtab' (per task),
'fewshot', 'sweep' (LR sweeps by group) and 'other' (summaries no rendered
table shows, and why). Smoke stand-ins (`report.smoke`) fill a cell only
where no real run does, marked, and count as missing in group means.

Comparison cells read `paper / ours (ours - paper)`, accuracies in percent.
Where no pre-training run exists, exaFLOPs and TPUv3-core-days are our
accounting estimates (`vit_jax.accounting`, at the paper-implied TPUv3
utilisation), marked "est.".

    python -m vit_jax.tables --workdirs='/runs,gs://bucket/vtab/*'
    python -m vit_jax.tables --paper-only --tables=2,6 --output=paper.md
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from vit_jax import outputs, paper
from vit_jax.data import registry

TABLES = ('2', '6', 'optim', 'vtab', 'fewshot', 'sweep', 'other')
SUMMARY = 'summary.json'
VTAB_GROUPS = (('vtab-natural', 'Natural'), ('vtab-specialized', 'Specialized'),
               ('vtab-structured', 'Structured'))
DATASET_LABELS = {
    'imagenet2012': 'ImageNet', 'imagenet2012_real': 'ImageNet ReaL',
    'cifar10': 'CIFAR-10', 'cifar100': 'CIFAR-100',
    'oxford_iiit_pet': 'Oxford-IIIT Pets',
    'oxford_flowers102': 'Oxford Flowers-102', 'vtab': 'VTAB (19 tasks)'}
SHORT_LABELS = {
    'imagenet2012': 'ImageNet', 'imagenet2012_real': 'ReaL',
    'cifar10': 'C10', 'cifar100': 'C100', 'oxford_iiit_pet': 'Pets',
    'oxford_flowers102': 'Flowers'}
# Other spellings of the pre-training data in `report.pretrain`.
PRETRAIN_ALIASES = paper.PRETRAIN_ALIASES
REPORT_KEYS = ('model', 'pretrain', 'pretrain_epochs', 'task')
# The cell variant of Table 2's ImageNet fine-tuning (`report.table2`).
TABLE2 = 'table2'


class TablesError(ValueError):
  """A path without summaries, a malformed summary or a bad argument."""


# --------------------------------------------------------------------------
# Loading summaries.


class _LocalFS:
  """The part of `tf.io.gfile` used here, for local paths.

  TensorFlow takes seconds to import; it is only loaded for URLs (gs://...).
  """
  glob = staticmethod(glob.glob)
  isdir = staticmethod(os.path.isdir)
  exists = staticmethod(os.path.exists)
  walk = staticmethod(os.walk)
  GFile = staticmethod(open)


def _fs(path: str):
  """`tf.io.gfile` for URLs such as gs://bucket/dir, `_LocalFS` otherwise."""
  if '://' not in path:
    return _LocalFS
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.io.gfile


class Setting(NamedTuple):
  """A pre-trained model: what a paper row or column stands for."""
  model: str
  pretrain: str
  epochs: float
  optimizer: str = 'adam'

  def label(self) -> str:
    opt = '' if self.optimizer == 'adam' else f', {self.optimizer.upper()}'
    return f'{self.model} ({self.pretrain}, {self.epochs:g} ep{opt})'


def _setting(model, pretrain, epochs, optimizer='adam') -> Setting:
  pretrain = str(pretrain).lower()
  return Setting(str(model), PRETRAIN_ALIASES.get(pretrain, pretrain),
                 round(float(epochs), 3), str(optimizer or 'adam').lower())


@dataclasses.dataclass(frozen=True)
class Run:
  """One summary.json: its path and contents."""
  path: str
  summary: Mapping[str, Any]

  @property
  def workdir(self) -> str:
    return os.path.dirname(self.path)

  @property
  def report(self) -> Mapping[str, Any]:
    return self.summary.get('report') or {}

  @property
  def missing(self) -> tuple[str, ...]:
    """Report keys a table needs that this run's report lacks."""
    return tuple(k for k in REPORT_KEYS if self.report.get(k) is None)

  @property
  def sweep(self) -> bool:
    return bool(self.report.get('sweep', False))

  @property
  def variant(self) -> str:
    """TABLE2 for Table 2's ImageNet fine-tuning (512/518 px, Polyak
    averaging: `report.table2`; runs older than the key are not), else ''."""
    return TABLE2 if self.report.get('table2', False) else ''

  @property
  def setting(self) -> Setting | None:
    # `overridden`: the command line trained another model than the
    # config args the report was made from: no table cell is this run's.
    # Nor is one pre-trained (or fine-tuned from one pre-trained) by
    # another recipe than the paper's (`recipe`: AugReg's augmentation,
    # weight decay and schedule).
    if (not self.report or self.missing or self.report.get('overridden')
        or self.report.get('recipe')):
      return None
    r = self.report
    return _setting(r['model'], r['pretrain'], r['pretrain_epochs'],
                    r.get('pretrain_optimizer'))

  @property
  def task(self) -> str | None:
    return self.report.get('task')

  @property
  def accuracy(self) -> float | None:
    return self.summary.get('eval_accuracy')

  @property
  def real_accuracy(self) -> float | None:
    s = self.summary
    return s.get('real_accuracy', s.get('eval_real_accuracy'))

  def fewshot(self) -> dict[tuple[str, int], float | None]:
    """{(dataset, shots): accuracy} from `fewshot/<dataset>/<k>shot` keys
    (`_fewshot_key`); None for a NaN one (a diverged model's, which the
    evaluator writes rather than a chance-level number)."""
    out = {}
    for key, value in self.summary.items():
      cell = _fewshot_key(key)
      if cell is not None:
        out[cell] = None if _is_nan(value) else value
    return out


def _fewshot_key(key: str) -> tuple[str, int] | None:
  """(dataset, k) of a `fewshot/<dataset>/<k>shot` metric, else None. The
  dataset may hold '/' (`vtab/caltech101`; and a section not named
  `fewshot` writes `fewshot/<name>/<dataset>/...`: its column is
  `<name>/<dataset>`)."""
  parts = key.split('/')
  if (len(parts) >= 3 and parts[0] == 'fewshot' and all(parts[1:-1])
      and parts[-1].endswith('shot') and parts[-1][:-4].isdigit()):
    return '/'.join(parts[1:-1]), int(parts[-1][:-4])
  return None


def _is_nan(value: Any) -> bool:
  return isinstance(value, float) and math.isnan(value)


def _summary_files(path: str) -> list[str]:
  """summary.json files at `path`: a file, a directory (recursive) or a glob."""
  fs = _fs(path)
  found = []
  for match in sorted(fs.glob(path)):
    if fs.isdir(match):
      for root, _, files in fs.walk(match):
        found += [os.path.join(root, f) for f in files if f == SUMMARY]
    elif os.path.basename(match) == SUMMARY:
      found.append(match)
  if not found:
    unfinished = any(fs.exists(os.path.join(m, name))
                     for m in fs.glob(path) if fs.isdir(m)
                     for name in ('config.json', 'checkpoints'))
    raise TablesError(f'no {SUMMARY} found at or below {path!r}' + (
        ': its run has not finished (a config.json or checkpoints, no '
        'summary yet); leave it out, or finish it' if unfinished else ''))
  return sorted(set(found))


def _read_errors(path: str) -> tuple[type[BaseException], ...]:
  """What reading `path` raises when it cannot be read (a dangling
  symlink, no permission, an object gone from its bucket)."""
  errors = (json.JSONDecodeError, UnicodeDecodeError, OSError)
  if '://' in path:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    errors += (tf.errors.OpError,)
  return errors


def _read_run(path: str) -> Run:
  try:
    with _fs(path).GFile(path, 'r') as f:
      summary = json.load(f)
  except _read_errors(path) as e:
    raise TablesError(f'malformed {path}: {e}') from e
  if not isinstance(summary, dict):
    raise TablesError(f'malformed {path}: expected a JSON object, got '
                      f'{type(summary).__name__}')
  metrics = sorted(k for k, v in summary.items()
                   if ('accuracy' in k or k.startswith('fewshot/')) and (
                       isinstance(v, bool) or not isinstance(v, (int, float))))
  if metrics:
    raise TablesError(f'malformed {path}: {metrics[0]}='
                      f'{summary[metrics[0]]!r} is not a number')
  # Accuracies are fractions (a percent would render as 9,860.00). A
  # few-shot NaN is the evaluator's for a diverged model: shown as '—'.
  metrics = sorted(k for k, v in summary.items()
                   if ('accuracy' in k or k.startswith('fewshot/'))
                   and not 0 <= v <= 1
                   and not (k.startswith('fewshot/') and _is_nan(v)))
  if metrics:
    raise TablesError(f'malformed {path}: {metrics[0]}='
                      f'{summary[metrics[0]]!r} is not a fraction in [0, 1]')
  report = summary.get('report')
  if report is not None and not isinstance(report, dict):
    raise TablesError(f'malformed {path}: "report" must be an object, got '
                      f'{report!r}')
  run = Run(path, summary)
  try:
    _ = run.setting
  except (TypeError, ValueError) as e:
    raise TablesError(f'malformed {path}: bad report {report!r}: {e}') from e
  return run


def load_runs(paths: Iterable[str] | str, *,
              skipped: list[str] | None = None) -> list[Run]:
  """Every summary.json at or below `paths` (files, directories or globs).

  A malformed one (or a path with none) is a TablesError, or with a
  `skipped` list, its message is appended there and the others are read
  (an error if none is left).
  """
  if isinstance(paths, str):
    paths = [p for p in paths.split(',') if p]
  files, seen = [], set()
  for path in paths:
    # `--workdirs=~/runs` reaches us unexpanded (the shell expands `~` only
    # at the start of a word). `outputs` expands it for folders to write
    # into, refusing files; a path here may be a file or a glob.
    if '://' not in path:
      path = os.path.expanduser(path)
    try:
      found = _summary_files(path)
    except TablesError as e:  # Nothing there: with the others, skipped.
      if skipped is None:
        raise
      skipped.append(str(e))
      continue
    for f in found:
      # One file given twice (`runs,./runs/c10`, a symlink) is one run.
      key = _file_key(f)
      if key not in seen:
        seen.add(key)
        files.append(f)
  runs, copies = [], {}
  for f in files:
    try:
      run = _read_run(f)
    except TablesError as e:
      if skipped is None:
        raise
      skipped.append(str(e))
      continue
    # A copy of a workdir (`cp -r runs backup`) is the same run: identical
    # summaries with the trainer's wall-clock seconds are never two runs.
    key = (json.dumps(run.summary, sort_keys=True, default=str)
           if 'wall_s' in run.summary else None)
    if key in copies:
      why = (f'{f}: a copy of {copies[key]} (an identical summary.json); '
             'counted once')
      if skipped is None:
        warnings.warn(why)
      else:
        skipped.append(why)
      continue
    if key is not None:
      copies[key] = f
    runs.append(run)
  if not runs and skipped:
    raise TablesError('; '.join(skipped))
  return runs


def _file_key(path: str) -> str:
  """One spelling of a summary file: its real path (local: symlinks,
  `./`), or the URL with its slashes collapsed (`gs://b/runs/` and
  `gs://b/runs` list `gs://b/runs//c10/...` and `gs://b/runs/c10/...`)."""
  if '://' not in path:
    return os.path.realpath(path)
  scheme, rest = path.split('://', 1)
  return f'{scheme}://{re.sub("/+", "/", rest)}'


# --------------------------------------------------------------------------
# Matching runs to cells.


@dataclasses.dataclass(frozen=True)
class Pick:
  """The runs of a cell: their accuracies (and a pre-training cell's
  costs) are averaged, as the paper's Table 2 averages three fine-tuning
  runs (never the best of them: that would select on the test set); `run`
  is one of them (the first by path), or none."""
  run: Run | None = None
  runs: tuple[Run, ...] = ()

  @property
  def n(self) -> int:
    return len(self.runs)

  @property
  def smoke(self) -> bool:
    """Whether smoke stand-ins make the cell (never mixed with real runs:
    `_cell_runs`)."""
    return any(r.report.get('smoke') for r in self.runs)

  def _values(self, value: Callable[[Run], float | None]) -> list[float]:
    return [v for v in map(value, self.runs) if v is not None]

  def mean(self, value: Callable[[Run], float | None]) -> float | None:
    values = self._values(value)
    return sum(values) / len(values) if values else None

  def note(self, value: Callable[[Run], float | None] | None = None, *,
           percent: bool = True) -> str:
    """'mean of n ± std' (of `value`: in % of a fraction where `percent`,
    else in its own units), 'lr a, b' (the learning rates of runs averaged
    although they differ) and 'smoke' (a `report.smoke` stand-in run), if
    so."""
    notes = []
    if self.n > 1:
      value = value or (lambda r: r.accuracy)
      values, mean = self._values(value), self.mean(value)
      if len(values) > 1:
        std = math.sqrt(sum((v - mean) ** 2 for v in values)
                        / (len(values) - 1))
        # The count of values averaged, and of the runs where some lack one.
        of = f' of {self.n} runs' if len(values) < self.n else ''
        notes.append(f'mean of {len(values)}{of} ± '
                     + (f'{100 * std:.2f}' if percent else _num(std)))
      else:
        notes.append(f'1 of {self.n} runs reported')
    notes.append(_lr_note(self.runs))
    if self.smoke:
      notes.append('smoke')
    return '; '.join(n for n in notes if n)


def _lr_note(runs: Sequence[Run]) -> str:
  """'lr a, b' where `runs` (averaged together) trained at different
  learning rates, else ''."""
  lrs = {r.report.get('lr') for r in runs}
  if len(lrs) < 2:
    return ''
  numbers = sorted(lr for lr in lrs if isinstance(lr, (int, float)))
  return 'lr ' + ', '.join([f'{lr:g}' for lr in numbers] + [
      '?' for lr in lrs if not isinstance(lr, (int, float))])


def _cell_runs(runs: Sequence[Run]) -> Pick:
  # A smoke run (an offline stand-in) never averages with real runs: it
  # fills a cell only where there is none, marked `smoke`.
  runs = [r for r in runs if not r.report.get('smoke')] or runs
  runs = tuple(sorted(runs, key=lambda r: r.path))
  return Pick(runs[0], runs) if runs else Pick()


class Matcher:
  """Runs by (setting, task, variant); remembers which runs a table has
  shown."""

  def __init__(self, runs: Sequence[Run]):
    self.runs = list(runs)
    self.used = set()
    self._cells: dict[tuple[Setting, str, str], list[Run]] = {}
    for run in self.runs:
      if run.setting is not None and not run.sweep:
        self._cells.setdefault((run.setting, run.task, run.variant),
                               []).append(run)

  @staticmethod
  def variant(setting: Setting, dataset: str, table2: bool = False) -> str:
    """The runs a cell takes (`Run.variant`): Table 2's ImageNet and ReaL
    cells of the models it fine-tuned at 512/518 px with Polyak averaging
    (`paper.TABLE2_FINETUNE_RES`) take only those runs (TABLE2); every
    other cell, Table 2's included, only the others (Table 6's 384 px).
    The one place this rule is written."""
    if (table2 and dataset in (paper.IMAGENET, paper.REAL)
        and setting.model in paper.TABLE2_FINETUNE_RES):
      return TABLE2
    return ''

  def pick(self, setting: Setting, task: str, variant: str = '') -> Pick:
    return self._pick(self._cells.get((setting, task, variant), []))

  def _pick(self, runs: Sequence[Run]) -> Pick:
    self.used.update(r.path for r in runs)
    return _cell_runs(runs)

  @staticmethod
  def measure(dataset: str) -> Callable[[Run], float | None]:
    """What a cell of `dataset` averages: top-1, or ReaL accuracy (a run on
    'imagenet2012_real' reports top-1 on the original labels as its
    accuracy; the ReaL cell is its ReaL accuracy)."""
    if dataset == paper.REAL:
      return lambda r: r.real_accuracy
    return lambda r: r.accuracy

  def accuracy(self, setting: Setting, dataset: str, *,
               table2: bool = False) -> tuple[float | None, Pick]:
    """Our mean top-1 in percent for a paper dataset key (ReaL: of the
    ImageNet runs with ReaL labels; or of runs on 'imagenet2012_real'), in
    Table 2 (`table2`) or another table: see `variant`."""
    variant = self.variant(setting, dataset, table2)
    pick = Pick()
    if dataset == paper.REAL:
      pick = self._with_real(setting, variant)
    if pick.run is None:
      pick = self.pick(setting, dataset, variant)
    value = pick.mean(self.measure(dataset))
    return (None if value is None else 100 * value), pick

  def _with_real(self, setting: Setting, variant: str) -> Pick:
    return self._pick([r for r in self._cells.get(
        (setting, paper.IMAGENET, variant), []) if r.real_accuracy is not None])

  def settings(self, task_prefix: str) -> list[Setting]:
    """Settings with runs whose task starts with `task_prefix`."""
    return sorted({s for s, t, v in self._cells if not v and t and
                   t.startswith(task_prefix)})

  def unused(self) -> list[Run]:
    return [r for r in self.runs if not r.sweep and r.path not in self.used]


# --------------------------------------------------------------------------
# Estimates from vit_jax.accounting (imported here only: it loads JAX).


def _flops_fn(flops: str) -> Callable[[str], float]:
  from vit_jax import accounting  # pylint: disable=g-import-not-at-top
  if flops == 'xla':
    return accounting.forward_flops
  if flops == 'analytic':
    return accounting.analytic_forward_flops
  raise TablesError(f'flops={flops!r}: expected xla or analytic')


@functools.cache
def estimate(model: str, pretrain: str, epochs: float,
             flops: str = 'xla') -> tuple[float, float] | None:
  """(exaFLOPs, TPUv3-core-days) of pre-training, or None if unknown.

  As `accounting.estimate`: 3 x forward FLOPs at 224 x epochs x images, at
  `accounting.paper_utilization()` of TPUv3's peak. `flops='analytic'`
  counts matmuls and convolutions by hand instead of lowering the model
  (instant; within ~3% of XLA).
  """
  from vit_jax import accounting, models  # pylint: disable=g-import-not-at-top
  images = accounting.PRETRAIN_IMAGES.get(pretrain)
  if images is None or model not in models.names():
    return None
  total = accounting.training_flops(_flops_fn(flops)(model), epochs * images)
  return total / 1e18, accounting.flops_core_days(
      total, accounting.HARDWARE['tpu_v3'], accounting.paper_utilization())


# --------------------------------------------------------------------------
# Formatting.


def _num(x: float, decimals: int | None = None) -> str:
  """`decimals` fixed, or by magnitude: 2,153 / 45 / 4.5 / 0.45 / 0.045."""
  if decimals is None:
    a = abs(x)
    decimals = 0 if a >= 10 or a == 0 else 1 - math.floor(math.log10(a))
  return f'{x:,.{decimals}f}'


def _delta(ours: float, ref: float, decimals: int | None) -> str:
  d = ours - ref
  return ('+' if d >= 0 else '-') + _num(abs(d), decimals)


def cell(ref: float | None, ours: float | None = None, *,
         decimals: int | None = 2, compare: bool = True, est: bool = False,
         note: str = '', missing: str = '—', delta: bool = True) -> str:
  """`ref / ours (delta; note)`, with "est." after an estimate.

  `ref` alone when not comparing; `ours (note)` where the paper has no
  number; no delta where the two are not of one unit (`delta=False`).
  """
  ref_s = '–' if ref is None else _num(ref, decimals)
  if not compare:
    return ref_s
  if ours is None:
    return missing if ref is None else f'{ref_s} / {missing}'
  ours_s = _num(ours, decimals) + (' est.' if est else '')
  extras = ([] if ref is None or not delta else [_delta(ours, ref, decimals)]) + (
      [note] if note else [])
  tail = f' ({"; ".join(extras)})' if extras else ''
  return (ours_s if ref is None else f'{ref_s} / {ours_s}') + tail


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]],
              align: str | None = None) -> list[str]:
  align = align or ('l' + 'r' * (len(header) - 1))
  rule = ['---:' if a == 'r' else '---' for a in align]
  return [_md_row(header), _md_row(rule)] + [_md_row(r) for r in rows]


def _md_row(cells: Sequence[str]) -> str:
  return '| ' + ' | '.join(str(c) for c in cells) + ' |'


def _pct(x: float | None) -> str:
  return '—' if x is None else f'{100 * x:.2f}'


# --------------------------------------------------------------------------
# Cells shared by the tables.


@dataclasses.dataclass
class _Ctx:
  """What the table builders share: runs, mode and the FLOPs counter."""
  match: Matcher
  compare: bool = True  # False: --paper-only.
  flops: str = 'xla'
  # The tables being rendered (`other` says where a run's cell is in
  # another), and whether cost cells without a run estimate (the probe of
  # `_unrendered_cells` needs none).
  rendered: tuple[str, ...] = TABLES
  estimates: bool = True

  def acc_cell(self, ref, setting: Setting, dataset: str,
               table2: bool = False) -> str:
    ours, pick = self.match.accuracy(setting, dataset, table2=table2)
    return cell(ref, ours, compare=self.compare,
                note=pick.note(self.match.measure(dataset)))

  def pretrain_cost(self, setting: Setting, key: str, ref=None) -> str:
    """Measured `key` ('exaflops' / 'core_days') or the estimate (est.)."""
    pick = self.match.pick(setting, 'pretrain')
    cost = lambda r: r.summary.get(key)  # pylint: disable=unnecessary-lambda-assignment
    # Several pre-training runs of one setting (reruns, seeds): the mean
    # cost, as the cell's accuracies are means. It is what one such run
    # costs, comparable with the paper's one run, where the first run's
    # (or the sum) would be an arbitrary pick (or not one run's cost); the
    # spread is of the cost, in its own units.
    value = pick.mean(cost)
    if value is not None:
      notes = []
      hardware = sorted({r.summary.get('hardware') or 'tpu_v3'
                         for r in pick.runs if cost(r) is not None})
      # Another accelerator's device-days beside TPUv3 core-days: shown,
      # without a difference that would read as a saving or a cost.
      other = key == 'core_days' and hardware != ['tpu_v3']
      if other:
        notes.append('on ' + ', '.join(map(str, hardware)))
      note = pick.note(cost, percent=False)
      notes += [note] if note else []
      return cell(ref, value, decimals=None, note='; '.join(notes),
                  delta=not other)
    if not self.estimates:
      return ''
    est = estimate(setting.model, setting.pretrain, setting.epochs,
                   self.flops)
    if est is None:
      return cell(ref, None, decimals=None, compare=self.compare)
    value = est[0] if key == 'exaflops' else est[1]
    return cell(ref, value, decimals=None, est=True)

  def vtab_cell(self, ref, setting: Setting) -> str:
    """The mean of the 19 tasks (see `_aggregate`) beside `ref`."""
    if not self.compare:
      return cell(ref, compare=False)
    values, lrs = _vtab_values(self.match, setting, _vtab_tasks())
    mean, note = _aggregate(values, 'tasks')
    if mean is not None:
      return cell(ref, 100 * mean, note='; '.join(n for n in (note, lrs) if n))
    return cell(ref, None, missing=note if any(
        v is not None for v, _ in values) else '—')


def _aggregate(values: Sequence[tuple[float | None, bool]],
               unit: str) -> tuple[float | None, str]:
  """(mean, note) of a group mean's `values`, (value or None, whether a
  smoke stand-in's): the mean where every one is a real run's; where every
  one is a stand-in's, their mean noted 'smoke'; else no mean, and the note
  says what there is, a stand-in counted as missing: '18/19 tasks + 1
  smoke' (a stand-in's number averaged with real ones would pass for a
  real group mean)."""
  real = [v for v, smoke in values if v is not None and not smoke]
  smoke = [v for v, is_smoke in values if v is not None and is_smoke]
  if values and len(real) == len(values):
    return sum(real) / len(real), ''
  if values and len(smoke) == len(values):
    return sum(smoke) / len(smoke), 'smoke'
  note = f'{len(real)}/{len(values)} {unit}'
  return None, note + (f' + {len(smoke)} smoke' if smoke else '')


def _vtab_tasks() -> tuple[str, ...]:
  return tuple(_vtab_name(t) for t in registry.VTAB_TASKS)


def _vtab_name(task: str) -> str:
  return task if task.startswith('vtab/') else f'vtab/{task}'


def _vtab_group(task: str) -> str:
  return registry.get(_vtab_name(task)).group


def _vtab_smoke(match: Matcher, setting: Setting) -> bool:
  """Whether smoke runs stand in for any of `setting`'s VTAB tasks."""
  return any(match.pick(setting, task).smoke for task in _vtab_tasks())


def _vtab_values(match: Matcher, setting: Setting, tasks: Sequence[str]
                 ) -> tuple[list[tuple[float | None, bool]], str]:
  """(mean top-1 fraction or None, whether smoke stand-ins') of each of
  `tasks` for `setting` (what `_aggregate` takes), and 'lr a, b' where the
  runs averaged trained at different learning rates (the protocol trains
  every task at one)."""
  picks = [match.pick(setting, task) for task in tasks]
  return ([(p.mean(lambda r: r.accuracy), p.smoke) for p in picks],
          _lr_note([r for p in picks for r in p.runs]))


# --------------------------------------------------------------------------
# The tables.

_CELLS_NOTE = ('Cells: paper / ours (ours − paper); accuracies in %; '
               '"mean of n ± s": the mean and standard deviation of n runs '
               'for the cell (as the paper\'s Table 2); "smoke": a '
               'smoke-test stand-in run (report.smoke); "—": no run.')
_COSTS_NOTE = ('Compute: measured on the pre-training run (several: their '
               'mean, "± s" in the cost\'s units), else our '
               'accounting estimate ("est.": 3 x forward FLOPs x images seen, '
               'TPUv3 at the utilisation the paper implies).')
_PAPER_NOTE = 'Paper numbers (accuracies in %).'
_PAPER_COSTS_NOTE = ('Compute: paper / our accounting estimate (ours − paper);'
                     ' "est.": 3 x forward FLOPs x images seen, TPUv3 at the '
                     'utilisation the paper implies.')
_TABLE2_NOTE = ('BiT-L and Noisy Student: paper only (Noisy Student ImageNet: '
                '"88.4/88.5" in the paper).')
_TABLE2_VTAB_NOTE = (' VTAB: mean of the 19 tasks, once all have a run (a '
                     'smoke stand-in counts as missing).')
_TABLE2_COMPARE_NOTE = (
    _TABLE2_VTAB_NOTE + ' ImageNet and ReaL of '
    f'{" and ".join(paper.TABLE2_FINETUNE_RES)}: only runs of Table 2\'s '
    'fine-tuning (`table2=true`: 512/518 px, Polyak averaging), which no '
    'other cell takes.')
_TABLE6_NOTE = ('core-days: of the pre-training run, TPUv3 cores unless noted '
                '(the paper prints none for Table 6).')
_VTAB_NOTE = ('Group means only when all of the group\'s tasks have a run '
              '(a smoke stand-in counts as missing: "18/19 tasks + 1 smoke"; '
              'a mean of stand-ins only says "smoke"); '
              'the overall mean shows paper / ours (ours − paper) where '
              'Table 2 has the model.')


def _note(ctx: _Ctx, costs: bool = False) -> str:
  if ctx.compare:
    return _CELLS_NOTE + (' ' + _COSTS_NOTE if costs else '')
  return _PAPER_NOTE + (' ' + _PAPER_COSTS_NOTE if costs else '')


def table2(ctx: _Ctx) -> list[str]:
  """Table 2: the ViT columns against BiT-L and Noisy Student."""
  settings = {label: _setting(p['model'], p['pretrain'], p['epochs'])
              for label, p in paper.TABLE2_PRETRAIN.items()}
  rows = [_table2_row(ctx, d, settings) for d in paper.TABLE2_DATASETS]
  rows.append(['TPUv3-core-days'] + [
      cell(values['core_days'], decimals=0, compare=False)
      if label not in settings else
      ctx.pretrain_cost(settings[label], 'core_days', values['core_days'])
      for label, values in paper.TABLE2.items()])
  pretrain = ', '.join(f'{k}: {s.label()}' for k, s in settings.items())
  return ['## Table 2: comparison to the state of the art', '',
          _note(ctx, costs=True),
          _TABLE2_NOTE + (_TABLE2_COMPARE_NOTE if ctx.compare else ''),
          f'Pre-training: {pretrain}.',
          '', *_md_table([''] + list(paper.TABLE2), rows)]


def _table2_row(ctx: _Ctx, dataset: str,
                settings: Mapping[str, Setting]) -> list[str]:
  row = [DATASET_LABELS[dataset]]
  for label, values in paper.TABLE2.items():
    ref, s = values[dataset], settings.get(label)
    if s is None:
      row.append(cell(ref, compare=False))
    elif dataset == 'vtab':
      row.append(ctx.vtab_cell(ref, s))
    else:
      row.append(ctx.acc_cell(ref, s, dataset, table2=True))
  return row


def table6(ctx: _Ctx) -> list[str]:
  """Table 6: the scaling study on JFT-300M."""
  header = (['model', 'epochs'] + [SHORT_LABELS[d]
                                   for d in paper.TABLE6_DATASETS]
            + ['exaFLOPs', 'core-days'])
  rows = []
  for r in paper.TABLE6:
    s = _setting(r['model'], 'jft', r['epochs'])
    rows.append([r['model'], str(r['epochs'])]
                + [ctx.acc_cell(r[d], s, d) for d in paper.TABLE6_DATASETS]
                + [ctx.pretrain_cost(s, 'exaflops', r['exaflops']),
                   ctx.pretrain_cost(s, 'core_days')])
  return ['## Table 6: scaling study (JFT-300M pre-training, fine-tuned at 384)',
          '', _note(ctx, costs=True), _TABLE6_NOTE, '',
          *_md_table(header, rows, 'lr' + 'r' * (len(header) - 2))]


def table_optim(ctx: _Ctx) -> list[str]:
  """Appendix D.1: ResNets pre-trained with Adam vs SGD."""
  keys = list(paper.OPTIMIZER_STUDY)
  settings = [_setting(m, 'jft', paper.OPTIMIZER_STUDY_EPOCHS, o)
              for m, o in keys]
  rows = [[DATASET_LABELS[d]] + [
      ctx.acc_cell(paper.OPTIMIZER_STUDY[k][d], s, d)
      for k, s in zip(keys, settings)] for d in paper.OPTIMIZER_DATASETS]
  rows.append(['average'] + [_average_cell(ctx, paper.OPTIMIZER_STUDY[k],
                                           s) for k, s in zip(keys, settings)])
  header = [''] + [f'{m} {o.upper() if o == "sgd" else "Adam"}'
                   for m, o in keys]
  return ['## ResNet optimizer study: Adam vs SGD (JFT, 7 epochs)', '',
          _note(ctx), '', *_md_table(header, rows)]


def _average_cell(ctx: _Ctx, ref: Mapping[str, float],
                  setting: Setting) -> str:
  """The mean of the study's datasets (see `_aggregate`) beside `ref`."""
  if not ctx.compare:
    return cell(ref['average'], compare=False)
  values = []
  for dataset in paper.OPTIMIZER_DATASETS:
    acc, pick = ctx.match.accuracy(setting, dataset)
    values.append((acc, pick.smoke))
  mean, note = _aggregate(values, 'datasets')
  if mean is not None:
    return cell(ref['average'], mean, note=note)
  return cell(ref['average'], None, missing=note if any(
      a is not None for a, _ in values) else '—')


def table_vtab(ctx: _Ctx) -> list[str]:
  """Per-task VTAB-1k accuracy of every pre-trained model with VTAB runs."""
  settings = ctx.match.settings('vtab/')
  if not settings:
    return []
  rows = []
  for group, name in VTAB_GROUPS:
    tasks = [t for t in _vtab_tasks() if _vtab_group(t) == group]
    rows += [[t[len('vtab/'):], name] + [
        _vtab_task_cell(ctx.match.pick(s, t)) for s in settings]
             for t in tasks]
  for group, name in VTAB_GROUPS:
    tasks = [t for t in _vtab_tasks() if _vtab_group(t) == group]
    rows.append([f'**{name} mean**', ''] + [
        _mean_of(ctx.match, s, tasks) for s in settings])
  rows.append(['**VTAB mean (19)**', ''] + [
      _vtab_mean_cell(ctx, s) for s in settings])
  labels = [s.label() + (' (smoke)' if _vtab_smoke(ctx.match, s) else '')
            for s in settings]
  return ['## VTAB-1k (top-1 %)', '', _VTAB_NOTE, '',
          *_md_table(['task', 'group'] + labels, rows,
                     'll' + 'r' * len(settings))]


def _vtab_task_cell(pick: Pick) -> str:
  """A task's accuracy; where several runs make it, their count and
  spread, and their learning rates when they differ (runs of another LR
  are averaged in: the note says so); 'smoke' for a stand-in's."""
  value = pick.mean(lambda r: r.accuracy)
  note = pick.note() if value is not None else ''
  return f'{_pct(value)} ({note})' if note else _pct(value)


def _mean_of(match: Matcher, setting: Setting, tasks: Sequence[str]) -> str:
  """The mean of `tasks` (see `_aggregate`), else what there is."""
  values, lrs = _vtab_values(match, setting, tasks)
  mean, note = _aggregate(values, 'tasks')
  if mean is None:
    return note
  note = '; '.join(n for n in (note, lrs) if n)
  return _pct(mean) + (f' ({note})' if note else '')


def _vtab_mean_cell(ctx: _Ctx, setting: Setting) -> str:
  for label, p in paper.TABLE2_PRETRAIN.items():
    if _setting(p['model'], p['pretrain'], p['epochs']) == setting:
      return ctx.vtab_cell(paper.TABLE2[label]['vtab'], setting)
  return _mean_of(ctx.match, setting, _vtab_tasks())


def table_fewshot(ctx: _Ctx) -> list[str]:
  """Few-shot linear accuracy (%) of every run that reports it."""
  runs = [r for r in ctx.match.runs if not r.sweep and r.fewshot()]
  if not runs:
    return []
  cols = sorted({k for r in runs for k in r.fewshot()})
  rows = []
  for run in runs:
    ctx.match.used.add(run.path)  # Its top-1 is in this table too.
    shots = run.fewshot()
    rows.append([run.workdir, _run_label(run), _pct(run.accuracy)] + [
        _pct(shots.get(c)) for c in cols])
  header = ['workdir', 'run', 'top-1'] + [f'{d} {k}-shot' for d, k in cols]
  return ['## Few-shot linear accuracy (%)', '',
          *_md_table(header, rows, 'llr' + 'r' * len(cols))]


def _run_label(run: Run) -> str:
  """The run's table setting and task, with the architecture it trained
  where that is not the setting's model (a shrunk or stand-in model), and
  `smoke` for smoke runs."""
  s = run.setting
  trained = run.summary.get('architecture') or run.summary.get('model', '?')
  smoke = ' (smoke)' if run.report.get('smoke') else ''
  if not s:
    return f'{trained}{smoke}'
  extra = f' [{trained}]' if trained != s.model else ''
  return f'{s.label()} → {run.task}{extra}{smoke}'


# How `other` names the tables by their `--tables` key.
_TABLE_NAMES = {'2': 'Table 2', '6': 'Table 6', 'optim': 'the optimizer study',
                'vtab': 'the VTAB table', 'fewshot': 'the few-shot table'}


def _unrendered_cells(ctx: _Ctx) -> dict[str, list[str]]:
  """{run path: the `--tables` keys of the tables not rendered that would
  show it}: each such table built on the side (no estimates), its runs
  noted."""
  out: dict[str, list[str]] = {}
  for name in _TABLE_NAMES:
    if name in ctx.rendered:
      continue
    probe = _Ctx(Matcher(ctx.match.runs), compare=True, flops=ctx.flops,
                 estimates=False)
    BUILDERS[name](probe)
    for path in probe.match.used:
      out.setdefault(path, []).append(name)
  return out


def table_other(ctx: _Ctx) -> list[str]:
  """Runs no other table shows: no report, no paper cell, or a cell in a
  table not rendered."""
  runs = ctx.match.unused()
  if not runs:
    return []
  elsewhere = _unrendered_cells(ctx)
  rows = []
  for run in runs:
    s = run.summary
    if not run.report:
      why = 'no report'
    elif run.missing:
      why = f'report lacks {", ".join(run.missing)}'
    elif run.report.get('overridden'):
      why = f'overridden: {run.report["overridden"]}'
    elif run.report.get('recipe'):
      why = f'recipe {run.report["recipe"]}, not the paper\'s'
    elif run.path in elsewhere:
      names = elsewhere[run.path]
      why = (f'cell in {", ".join(_TABLE_NAMES[n] for n in names)} (not '
             f'rendered: --tables={",".join(names)})')
    elif run.variant == TABLE2:  # Another model's: no table takes it.
      why = ('table2 run: only Table 2\'s ImageNet / ReaL cells of '
             f'{", ".join(paper.TABLE2_FINETUNE_RES)} take it')
    else:
      why = 'no paper cell'
    days = s.get('core_days')
    rows.append([run.workdir, s.get('model') or run.report.get('model', ''),
                 s.get('dataset') or run.report.get('task', ''),
                 _pct(run.accuracy),
                 '—' if days is None else _num(days), why])
  return ['## Other runs', '', *_md_table(
      ['workdir', 'model', 'dataset', 'eval_accuracy (%)', 'core_days',
       'why here'], rows, 'lllrrl')]


def _sweep_label(run: Run) -> str:
  """The group of a sweep run: the pre-training its report names (also
  where the command line overrode the run), with how it fine-tuned (steps,
  resolution, `table2`), the architecture trained where it is not the
  report's model, `smoke` and the reason it is `overridden`. Runs of one
  label differ only in their learning rate."""
  r = run.report
  trained = run.summary.get('architecture') or run.summary.get('model', '?')
  try:
    base = _setting(r['model'], r['pretrain'], r['pretrain_epochs'],
                    r.get('pretrain_optimizer')).label()
  except (KeyError, TypeError, ValueError):  # No report, or part of one.
    base = str(trained)
  parts = []
  if r.get('steps') is not None:
    parts.append(f'{r["steps"]} steps')
  size = r.get('image_size')
  if size is not None:
    parts.append(('x'.join(map(str, size)) if isinstance(size, list)
                  else str(size)) + ' px')
  if r.get('table2'):
    parts.append('table2')
  if r.get('model') is not None and trained != r.get('model'):
    parts.append(f'trained {trained}')
  if r.get('smoke'):
    parts.append('smoke')
  if r.get('overridden'):
    parts.append(f'overridden: {r["overridden"]}')
  return base + (f' [{"; ".join(parts)}]' if parts else '')


def _lr(run: Run) -> float | None:
  lr = run.report.get('lr')
  return float(lr) if isinstance(lr, (int, float)) else None


def table_sweep(ctx: _Ctx) -> list[str]:
  """LR-sweep runs (dev-split accuracy) by setting and task; the LR to
  run on the full train split is the best of each group."""
  groups: dict[tuple[str, str], list[Run]] = {}
  for run in ctx.match.runs:
    if run.sweep:
      groups.setdefault((_sweep_label(run), str(run.task)), []).append(run)
  if not groups:
    return []
  rows = []
  for (label, task), runs in sorted(groups.items()):
    runs = sorted(runs, key=lambda r: (_lr(r) is None, _lr(r) or 0.0,
                                       r.path))
    marks = _sweep_marks(task, runs)
    for run in runs:
      rows.append([label, task, str(run.report.get('lr', '?')),
                   _pct(run.accuracy), marks.get(run.path, ''),
                   run.workdir])
  return ['## LR sweeps (dev-split accuracy, %)', '',
          'Each group: one setting and task, as the run was fine-tuned '
          '(steps, px; overridden runs with the reason); "best" among its '
          'runs with a dev accuracy ("tie" where several share it), with the '
          'paper\'s grid (Table 4) swept so far where incomplete.', '',
          *_md_table(['setting', 'task', 'lr', 'dev accuracy', '',
                      'workdir'], rows, 'llrrll')] + _vtab_sweep(ctx)


def _sweep_marks(task: str, runs: Sequence[Run]) -> dict[str, str]:
  """{run path: mark} of a sweep group (`runs` by LR): 'best' on the run
  with the best dev accuracy, 'tie' on each where several share it, 'no
  dev accuracy' on the first where none has one; where the paper's Table 4
  grid for `task` is not swept yet (no dev accuracy at some of its rates),
  the mark says so: 'best; 2/4 LRs (none at 0.01, 0.03)'."""
  scored = [r for r in runs if r.accuracy is not None]
  top = max((r.accuracy for r in scored), default=None)
  tied = [r for r in scored if r.accuracy == top]
  marks = {r.path: 'best' if len(tied) == 1 else 'tie' for r in tied}
  if not marks:
    marks[runs[0].path] = 'no dev accuracy'
  grid = paper.TABLE4.get(task, {}).get('lr_sweep') or ()
  swept = {_lr(r) for r in scored}
  missing = [lr for lr in grid if lr not in swept]
  if len(grid) > 1 and missing:
    incomplete = (f'{len(grid) - len(missing)}/{len(grid)} LRs (none at '
                  f'{", ".join(f"{lr:g}" for lr in missing)})')
    marks = {p: f'{m}; {incomplete}' for p, m in marks.items()}
  return marks


def _vtab_sweep(ctx: _Ctx) -> list[str]:
  """VTAB's choice: one learning rate for all 19 tasks, the one with the
  best mean val200 accuracy (the paper's protocol, Appendix B.1.1). A
  rate is picked only among those swept on every task; the mean of
  several runs of one task at one rate counts once."""
  groups: dict[tuple[str, float], dict[str, list[float]]] = {}
  for run in ctx.match.runs:
    task = str(run.task)
    # `vtab/cifar100`, not the Table 4 dataset `cifar100`.
    if run.sweep and run.accuracy is not None and task in _vtab_tasks():
      key = (_sweep_label(run), _lr(run) or 0.0)
      groups.setdefault(key, {}).setdefault(task, []).append(
          run.accuracy)
  if not groups:
    return []
  means = {key: sum(sum(v) / len(v) for v in tasks.values()) / len(tasks)
           for key, tasks in groups.items()}
  complete = [k for k, tasks in groups.items()
              if len(tasks) == len(_vtab_tasks())]
  top = {}
  for key in complete:
    top[key[0]] = max(top.get(key[0], means[key]), means[key])
  marks = {}
  for key in complete:
    if means[key] == top[key[0]]:
      tied = sum(means[k] == means[key] for k in complete if k[0] == key[0])
      marks[key] = 'best' if tied == 1 else 'tie'
  rows = [[label, f'{lr:g}', f'{len(groups[(label, lr)])}/'
           f'{len(_vtab_tasks())}', _pct(means[(label, lr)]),
           marks.get((label, lr), '')]
          for label, lr in sorted(groups)]
  return ['', '### VTAB: one learning rate for all tasks (mean val200 '
          'accuracy, %)', '', *_md_table(
              ['setting', 'lr', 'tasks', 'mean dev accuracy', ''], rows,
              'lrrrl'), '', 'The best rate among those swept on all '
          f'{len(_vtab_tasks())} tasks is the one to train on train800val200 '
          '(`python -m vit_jax.vtab --config_args=...,lr=<best>`); a rate '
          'with tasks missing is not picked.']


BUILDERS = {'2': table2, '6': table6, 'optim': table_optim,
            'vtab': table_vtab, 'fewshot': table_fewshot,
            'sweep': table_sweep, 'other': table_other}


# --------------------------------------------------------------------------
# Rendering.


def _parse_tables(tables: Iterable[str] | str) -> list[str]:
  if isinstance(tables, str):
    tables = [t.strip() for t in tables.split(',') if t.strip()]
  tables = list(tables)
  bad = [t for t in tables if t not in BUILDERS]
  if bad or not tables:
    raise TablesError(f'unknown tables {bad or tables}: choose from '
                      f'{", ".join(TABLES)}')
  return [t for t in TABLES if t in tables]  # 'other' last.


def _render(ctx: _Ctx, tables, header: list[str]) -> str:
  blocks = [header]
  ctx.rendered = tuple(_parse_tables(tables))
  for name in ctx.rendered:
    block = BUILDERS[name](ctx)
    if block:
      blocks.append(block)
  return '\n\n'.join('\n'.join(b) for b in blocks) + '\n'


def render(runs: Sequence[Run], tables: Iterable[str] | str = TABLES,
           flops: str = 'xla') -> str:
  """Markdown of `tables` comparing `runs` with the paper."""
  ctx = _Ctx(Matcher(runs), compare=True, flops=flops)
  sweeps = sum(r.sweep for r in runs)
  header = ['# Reproduction vs paper', '',
            f'{len(runs)} run summaries; LR-sweep runs left out: {sweeps}.']
  return _render(ctx, tables, header)


def paper_only(tables: Iterable[str] | str = TABLES,
               flops: str = 'xla') -> str:
  """The paper's tables with our accounting estimates, and no runs."""
  ctx = _Ctx(Matcher([]), compare=False, flops=flops)
  header = ['# The paper\'s numbers (and our compute estimates)']
  return _render(ctx, tables, header)


# --------------------------------------------------------------------------
# Command line.


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog='python -m vit_jax.tables',
      description='Markdown tables of finished runs next to the paper\'s.')
  p.add_argument('--workdirs', default='',
                 help='Comma-separated workdirs, parent dirs or globs; '
                 'every summary.json below them is read.')
  p.add_argument('--paper-only', action='store_true',
                 help='No runs: the paper\'s numbers and our estimates.')
  p.add_argument('--tables', default=','.join(TABLES),
                 help=f'Comma-separated subset of {",".join(TABLES)}.')
  p.add_argument('--output', default='', help='Markdown file; else stdout.')
  p.add_argument('--flops', default='xla', choices=('xla', 'analytic'),
                 help='Forward FLOPs of the estimates: XLA cost analysis '
                 '(lowers each model, seconds) or the analytic count.')
  return p


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    if args.output:  # Checked first: never lose the tables.
      args.output = outputs.file(args.output, '--output', remote=True)
    if args.paper_only:
      text = paper_only(args.tables, flops=args.flops)
    elif args.workdirs:
      skipped = []  # One bad summary among many does not cost the table.
      runs = load_runs(args.workdirs, skipped=skipped)
      for why in skipped:
        print(f'warning: skipped {why}', file=sys.stderr)
      text = render(runs, args.tables, flops=args.flops)
    else:
      raise TablesError('nothing to do: pass --workdirs=DIR[,DIR...] or '
                        '--paper-only')
  except (TablesError, outputs.OutputPathError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if args.output:
    with _fs(args.output).GFile(args.output, 'w') as f:
      f.write(text)
  else:
    sys.stdout.write(text)
  return 0


if __name__ == '__main__':
  sys.exit(main())
