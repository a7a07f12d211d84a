"""What every evaluator shares: the interface, its context and the registry.

An evaluator is built once per run from its config section and the run's
`Context`, then called with the current parameters; it returns flat scalar
metrics (`{'fewshot/mnist5k/5shot': 0.81, ...}`) for metrics.jsonl and
summary.json. Each runs every `every` steps (0: at the end of training only)
and in `--config.mode=eval`.

Every evaluator has one constructor signature, `Cls(name, cfg, context)`,
and registers under the `type` its config sections name:

    @base.register('my_metric')
    class MyMetric(base.Evaluator):
      def __init__(self, name, cfg, context): ...
      def run(self, params): ...

    c.evals.mine = dict(type='my_metric', every=1000)
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
from typing import (Any, Callable, Dict, FrozenSet, Iterable, Optional,
                    Sequence, Tuple, Type, Union)

import jax
import ml_collections

from vit_jax import registration
from vit_jax import sharding as shd
from vit_jax.data import pipeline, preprocess, registry
from vit_jax.models import platform_switch


@dataclasses.dataclass(frozen=True)
class Context:
  """What a run gives every evaluator besides its own config section.

  Attributes:
    config: the run's whole config (`input`, `eval_every`, ...).
    model: the flax model.
    mesh: the device mesh.
    params_sharding: the shardings of the parameter tree `run` receives.
    image_size: the model's input side, or (height, width) for
      non-square inputs.
    channels: the model's input channels (1 for grey-scale data).
  """
  config: ml_collections.ConfigDict
  model: Any
  mesh: Any
  params_sharding: Any
  image_size: Union[int, Tuple[int, int]]
  channels: int = 3


class Evaluator(abc.ABC):
  """One evaluation of a set of parameters.

  Subclasses take `(name, cfg, context)`: the section's name in
  `config.evals`, the section itself and the run's `Context`. Check the
  settings there, so that a bad one fails before training, not after it.
  `KEYS`: the section keys the subclass reads besides `type` and `every`;
  any other is refused (`check_keys`). None: not checked.
  """

  KEYS: Optional[Tuple[str, ...]] = None

  def __init__(self, name: str, cfg: ml_collections.ConfigDict,
               context: Context):
    if self.KEYS is not None:
      check_keys(name, cfg, self.KEYS)
    self.name = name
    every = cfg.get('every') or 0
    if (isinstance(every, bool) or not isinstance(every, int)
        or every < 0):  # -5 ran every 5 steps; 2.5 was cut to 2.
      raise ValueError(f'evals.{name}.every={every!r}: 0 (at the end of '
                       'training only) or a whole number of steps')
    self.every = every
    self.context = context

  @abc.abstractmethod
  def run(self, params: Any) -> Dict[str, float]:
    """Metrics of `params` (a sharded parameter tree)."""

  def metric_names(self) -> Optional[FrozenSet[str]]:
    """The names `run` may return (`build` refuses two evaluators that
    would write the same one), or None where unknown until it runs."""
    return None

  @classmethod
  def settings(cls, cfg: Dict[str, Any], config: Dict[str, Any]
               ) -> Dict[str, Any]:
    """What this evaluator's numbers depend on, its defaults filled in, from
    its section `cfg` and the run's whole `config` (plain dicts, as a run's
    config.json records them). `--config.mode=eval` merges an evaluation
    into a run's summary only where these equal the run's own (an option
    missing from an older record counts as its default), and records them
    in eval_history.jsonl. This default: the section as written, less what
    changes no number (`every`, `data_dir`); override it where the section
    has defaults."""
    del config  # Unused here.
    return {k: v for k, v in cfg.items() if k not in _NOT_SETTINGS}

  def due(self, step: int, total_steps: int) -> bool:
    """Whether to run after `step` (the final step is handled by the loop)."""
    return bool(self.every) and step % self.every == 0 and step < total_steps


# Section keys that change where or when an evaluator runs, not its numbers.
_NOT_SETTINGS = ('every', 'data_dir')

TYPES: Dict[str, Type[Evaluator]] = {}


def eval_input(cfg: ml_collections.ConfigDict, context: Context,
               name: str = '<name>') -> ml_collections.ConfigDict:
  """The run's `input` config, re-aimed at the evaluator's `data` (another
  dataset: its own splits, not the training data's), `data_dir` (where
  that dataset lives, if not beside the run's) and `pp`, if set (as
  `section_ops` writes it out: `{size}` is the model's input size).
  `name`: the section's, for errors."""
  inp = ml_collections.ConfigDict(context.config.input.to_dict())
  if cfg.get('data', inp.data) != inp.data:
    inp.data = cfg.data
    inp.train_split = inp.eval_split = None
    # The run's skipping is for its own data (other kinds refuse it).
    inp.skip_bad_images = None
  if cfg.get('data_dir'):
    inp.data_dir = cfg.data_dir
  if cfg.get('pp'):
    inp.pp_eval = section_ops(name, cfg.pp, context.image_size)
  return inp


def section_ops(name: str, pp: Any, image_size: Union[int, Tuple[int, int]]
                ) -> str:
  """`evals.<name>.pp` as the op string its pipeline runs: `{size}`
  replaced with the model's input size ('H, W' for a non-square one, so
  that `resize({size})` is resize(H, W)), and for a square input a preset
  written out at that size. Written out, the ops need no `input.image_size`
  (whose checks would blame the run's config for the section's sizes); a
  preset on a non-square input stays (it makes square images, which
  `check_shape` refuses). The one place every evaluator's `{size}` is
  defined."""
  square = isinstance(image_size, int)
  size = image_size if square else '{}, {}'.format(*image_size)
  items = [pp] if isinstance(pp, str) else list(pp)
  try:
    items = [str(item).format(size=size) for item in items]
  except (KeyError, IndexError, ValueError) as e:
    raise ValueError(
        f'evals.{name}.pp={pp!r}: its one placeholder is {{size}} (the '
        f'model\'s input size), written with its braces only there '
        f'({type(e).__name__}: {e})') from None
  if not square:
    return '|'.join(items)
  try:
    return '|'.join(preprocess.expand(items, image_size))
  except ValueError as e:
    raise ValueError(f'evals.{name}.pp={pp!r}: {e}') from None


def check_run_range(name: str, pp: Any, ops: str, context: Context,
                    default: bool = False) -> None:
  """Images of `evals.<name>.pp` (`ops`: as `section_ops` writes it) must
  have the value range the model was trained on (the run's
  `input.pp_train`'s): [-1, 1] images for a model trained on [0, 1] ones
  give meaningless numbers, silently. Ranges that are unknown (an op of the
  user's own after the last value_range) are not compared. `default`: `pp`
  is the evaluator's default, not the section's."""
  inp = context.config.get('input') or {}
  train_pp = inp.get('pp_train') or (
      registry.get(inp.data).pp_train if inp.get('data') else None)
  # Only a preset's ops depend on the size, never their value range.
  size = context.image_size
  size = size if isinstance(size, int) else size[0]
  try:
    ours = preprocess.output_range(ops, size)
  except ValueError as e:  # Unparsable ops: named here, not as input.*.
    raise ValueError(f'evals.{name}.pp={pp!r}: {e}') from None
  if not train_pp:
    return
  try:
    trained = preprocess.output_range(train_pp, size)
  except ValueError:  # The run's own checks name a bad pp_train.
    return
  if trained is None or ours is None or trained == ours:
    return
  pp = pp if isinstance(pp, str) else '|'.join(pp)
  kept = [op for op in preprocess.PRESETS.get(pp.strip(), pp).split('|')
          if op.strip() and not op.strip().startswith('value_range')]
  if trained != preprocess.PIXELS:
    kept.append(preprocess.value_range_op(trained))
  raise ValueError(
      f'evals.{name}.pp={pp!r}{" (its default)" if default else ""} '
      'gives images in '
      f'{preprocess.describe_range(ours)} but the model was trained on '
      f'{preprocess.describe_range(trained)} (input.pp_train): set '
      f"--config.evals.{name}.pp='{'|'.join(kept)}'")


def check_shape(name: str, ops: str, shape: Sequence[int], context: Context,
                of: str, default: str = '') -> None:
  """Images of `evals.<name>.pp` (`ops`) must be the model's input shape:
  another size or channel count would fail at the first evaluation, after
  training. `of`: what the images are of; `default`: the section's pp when
  it sets none, for the hint."""
  size = context.image_size
  want = ((size, size) if isinstance(size, int) else tuple(size)) + (
      context.channels,)
  shape = tuple(shape)
  if shape == want:
    return
  if shape[:2] != want[:2]:
    hint = (f'write evals.{name}.pp with {{size}} where the size goes'
            + (f' (its default: {default})' if default else ''))
  else:
    hint = (f'set the channels in evals.{name}.pp: decode('
            f'{context.channels}) first (or to_rgb for 3)')
  raise ValueError(
      f'evals.{name}: pre-processing {ops!r} makes '
      f'{"x".join(map(str, shape))} images of {of}; the model takes '
      f'{"x".join(map(str, want))}: {hint}')


def split_info(name: str, cfg: ml_collections.ConfigDict,
               inp: ml_collections.ConfigDict, split: Optional[str],
               context: Context) -> pipeline.DatasetInfo:
  """`dataset_info` of the split an evaluator reads (`inp`: its
  `eval_input`), so that a bad dataset, split or pre-processing fails when
  it is built. The section's own `pp` is checked as the section's
  (`check_run_range`, `check_shape`, naming evals.<name>.pp), read without
  the run's `input.image_size`, whose checks would blame input.* for it."""
  if not cfg.get('pp'):
    return pipeline.dataset_info(inp, split=split)
  check_run_range(name, cfg.pp, inp.pp_eval, context)
  probe = ml_collections.ConfigDict(inp.to_dict())
  probe.image_size = None  # The run's train split stays: its splits' names.
  info = pipeline.dataset_info(probe, split=split, training=False)
  check_shape(name, inp.pp_eval, info.eval_image_shape, context,
              f'{inp.data!r} ({info.eval_split})')
  return info


def eval_batches(inp: ml_collections.ConfigDict,
                 split) -> pipeline.EvalIterable:
  """This process's batches of `split` of `inp`, one pipeline an evaluator
  keeps for all its evaluations (with `input.cache` the second and later
  read the split from memory)."""
  return pipeline.eval_iterator(inp, split=split,
                                process_index=jax.process_index(),
                                process_count=jax.process_count())


def jit(fn: Callable, mesh, **kwargs) -> Callable:
  """`jax.jit(fn, **kwargs)` of an evaluator's program on `mesh`, traced
  for the mesh's platform only (as the train step is): a bf16 evaluation
  on a GPU or TPU host does not trace the CPU branches (nor time the CPU
  matmul forms for them)."""
  return jax.jit(platform_switch.traced_for(shd.platform(mesh), fn),
                 **kwargs)


def register(type_name: str) -> Callable[[Type[Evaluator]], Type[Evaluator]]:
  """Class decorator: `config.evals.<name>.type=type_name` builds the class.

  A class a config file defines registers twice, as two class objects
  (`vit_jax.registration`): the later replaces the earlier when both are
  the same definition. Another class under a taken name is refused.
  """
  def add(cls: Type[Evaluator]) -> Type[Evaluator]:
    registration.check_free('evaluator type', type_name,
                            TYPES.get(type_name), cls)
    TYPES[type_name] = cls
    return cls
  return add


# Keys every section may set: what `build` and `Evaluator` read.
COMMON_KEYS = ('type', 'every')


def check_keys(name: str, cfg: ml_collections.ConfigDict,
               allowed: Iterable[str]) -> None:
  """A key the evaluator does not read (`splt`, `real_onyl`) would leave
  the setting meant at its default, silently: refused, with the nearest
  known key."""
  known = sorted(set(COMMON_KEYS) | set(allowed))
  for key in sorted(cfg.keys()):
    if key not in known:
      close = difflib.get_close_matches(key, known, n=1)
      hint = f' Did you mean evals.{name}.{close[0]}?' if close else ''
      raise ValueError(
          f'evals.{name}.{key} is not a setting of a type='
          f'{cfg.get("type")!r} evaluator.{hint} Its settings: '
          f'{", ".join(known)}')


def get(type_name: str, name: str) -> Type[Evaluator]:
  """The class registered as `type_name`; the error lists the known ones."""
  if type_name is None:
    raise ValueError(f'config.evals.{name}.type is not set: name the '
                     f'evaluator, one of {", ".join(sorted(TYPES))}')
  if type_name not in TYPES:
    close = difflib.get_close_matches(str(type_name), TYPES, n=2)
    hint = f' Did you mean {" or ".join(close)}?' if close else ''
    raise ValueError(
        f'config.evals.{name}.type={type_name!r} is not a registered '
        f'evaluator.{hint} Known types: {", ".join(sorted(TYPES))} (register '
        'one with @vit_jax.evaluators.register(TYPE))')
  return TYPES[type_name]
