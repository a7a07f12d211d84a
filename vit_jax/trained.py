"""A trained model, as `predict` and `export` use it: `load(init)`.

    trained = load('/tmp/vit_smoke')              # a training workdir
    trained = load('ViT-B_16.npz', model='ViT-B/16', labels='imagenet2012')
    trained = load('exported/hf')                 # a save_pretrained directory
    logits = trained.apply_fn()(trained.params, images)   # NHWC, input_range

`init` is a training workdir (its latest checkpoint; or `checkpoints/<step>`),
an `.npz` checkpoint or a Hugging Face `save_pretrained` directory (also
written `hf:DIR`). At an `image_size` other than the checkpoint's, position
embeddings are interpolated exactly as fine-tuning does. What
comes back is everything needed to classify an encoded image the way the
model was evaluated:

  * the model: zoo name, the options the run set (e.g. a smoke run's shrunk
    ViT), the class count and the run's compute dtype;
  * the pre-processing: the run's `input.pp_eval` at its `input.image_size`
    (recorded in `workdir/config.json`; runs without one fall back to the
    dataset's registry default); `.npz` models use
    `decode|resize(S)|value_range(-1,1)` as their training code did,
    Hugging Face models their `preprocessor_config.json`'s resize (or
    shorter-side resize and crop) and the value range its rescale and
    normalisation make (`value_range(-1,1)` without one);
  * class names: `labels=` (a dataset name or a text file, one name per
    line), else the run's dataset (tfds info, class folders), the Hugging
    Face `id2label`, else `class_0`, `class_1`, ... (`placeholder_labels`);
  * how its logits become probabilities (`output_activation`): as the
    run's loss read them (`config.loss`: softmax over the classes, or a
    sigmoid per class); `.npz` and Hugging Face models: softmax unless told
    (`output_activation=`, or a Hugging Face config with
    `problem_type=multi_label_classification`);
  * the run's record (summary.json, config.json) for the model card.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import traverse_util

from vit_jax import losses, models
from vit_jax.checkpoint import load_npz, load_pretrained
from vit_jax.models import precast

NPZ_PP = 'resize'  # decode|resize(S)|value_range(-1,1): the public checkpoints'.
HF_PREFIX = 'hf:'  # Optional: `hf:DIR` says DIR is a Hugging Face model.
_HF_WEIGHTS = ('model.safetensors', 'pytorch_model.bin')
# How logits become class probabilities, named after the loss that trained
# them (`vit_jax.losses`): 'softmax' over the classes (one class per image),
# 'sigmoid' per class (multi-label: they need not sum to 1).
ACTIVATIONS = losses.LOSSES
DEFAULT_ACTIVATION = 'softmax'  # Runs before `config.loss`, .npz, HF (unless told).
_HF_MULTI_LABEL = 'multi_label_classification'  # Its sigmoid problem_type.


class TrainedModelError(ValueError):
  """An `init` that is not a usable trained model; the message says why."""


class ImageSizeUnknown(TrainedModelError):
  """An .npz whose parameters do not show the image size it was trained at
  (fixed position embeddings): `image_size` must be given."""


@dataclasses.dataclass
class Trained:
  """A classifier with its pre-processing, labels and provenance."""
  name: str                  # Zoo name, e.g. 'ViT-B/16'.
  options: Dict[str, Any]    # Module options beyond the variant's (no dtype).
  num_classes: Optional[int]  # None: no head (the model returns features).
  image_size: int
  channels: int
  pp: List[str]              # Eval ops: encoded image -> model input.
  labels: List[str]
  params: Any                # Host numpy arrays, float32.
  source: str                # The checkpoint read (step dir, file, folder).
  kind: str                  # 'workdir', 'npz' or 'hf'.
  dtype: str = 'float32'     # The run's compute dtype.
  data: Optional[str] = None  # The dataset it was trained / evaluated on.
  run: Dict[str, Any] = dataclasses.field(default_factory=dict)
  config: Dict[str, Any] = dataclasses.field(default_factory=dict)
  command: Optional[str] = None
  workdir: Optional[str] = None
  pp_spec: Any = None        # `pp` before expansion (a preset follows size).
  # The resolution the checkpoint's position embeddings were trained at
  # (None: the model has none), read before any resize (`_build`).
  native_image_size: Optional[int] = None
  # Workdirs: the training step of the checkpoint read (None: unknown).
  step: Optional[int] = None
  # Workdirs: 'ema' (the Polyak averages were loaded) or 'raw' (the
  # parameters, also those of runs without averages); None otherwise.
  params_kind: Optional[str] = None
  has_ema: bool = False      # The checkpoint holds Polyak averages.
  # How its logits become probabilities (`ACTIVATIONS`): the run's loss.
  output_activation: str = DEFAULT_ACTIVATION
  # What is built from `params` (`cached`), by key: `logits`' jitted
  # function and cast parameters per dtype, and `vit_jax.predict.
  # cached_predictor`'s jitted, device-placed Predictor per (batch, dtype,
  # ...), so repeated calls on one model neither re-trace nor copy the
  # weights to the devices again. Replaced by an empty one when `params`
  # is assigned, or when its leaves are found to be other objects than
  # those the entries were built from (`_built_from`).
  _built: Dict[Any, Any] = dataclasses.field(
      default_factory=dict, init=False, repr=False, compare=False)
  _built_from: Optional[List[Any]] = dataclasses.field(
      default=None, init=False, repr=False, compare=False)

  def __setattr__(self, name, value):
    """Assigning `params` (the next checkpoint's weights) drops what was
    built from the old ones at once: their jitted copies on the devices are
    freed, and no later call computes with them."""
    super().__setattr__(name, value)
    if name == 'params' and '_built_from' in self.__dict__:
      self._drop_built()

  def _drop_built(self) -> None:
    # A new dict, not the old one cleared: a copy (`copy.copy`) sharing the
    # old one keeps its entries, built from its own (the old) parameters.
    self._built = {}
    self._built_from = None

  def cached(self, key, make: Callable[[], Any]):
    """`make()`, kept under `key` while the parameters stay those it was
    built from.

    Assigning `params` drops every entry (`__setattr__`); a sub-tree
    replaced in place (`trained.params['head'] = new_head`) is found too,
    as the leaves are compared by identity (the old ones are kept
    alive with the entries, so no new array can take an old one's id).
    Arrays whose values are overwritten in place (`kernel[...] = 0`) are
    not noticed: assign new arrays, or a new `params`. Threads calling it
    at once may each build an entry (one is kept), never fail."""
    leaves = jax.tree.leaves(self.params)
    built, entries = self._built_from, self._built
    if built is None or len(built) != len(leaves) or any(
        a is not b for a, b in zip(built, leaves)):
      entries = {}
      self._built, self._built_from = entries, leaves
    entry = entries.get(key)
    if entry is None:
      entry = entries[key] = make()
    return entry

  @property
  def stride(self) -> int:
    """Input pixels per token side (ViTs and hybrids; 1 for others)."""
    return int(getattr(self.model(), 'stride', 1))

  @property
  def image_shape(self):
    return (self.image_size, self.image_size, self.channels)

  @property
  def value_map(self) -> Tuple[float, float, float, float]:
    """How the eval pre-processing maps decoded pixel values: (in_min,
    in_max, vmin, vmax) of its last `value_range` op (`vit_jax.data.
    preprocess.output_range`; (0, 255, 0, 255) where it has none), the one
    definition of the model's input range that exports write (export.json,
    the card, a Hugging Face processor's rescale and normalisation). Where
    an op of the user's own follows it, the range is not known: the usual
    value_range(-1, 1)."""
    from vit_jax.data import preprocess
    found = preprocess.output_range(self.pp, self.image_size)
    return tuple(found or preprocess.MINUS_ONE_TO_ONE)

  @property
  def input_range(self) -> Tuple[float, float]:
    """(low, high) of the values the model takes (`value_map`): (-1, 1)
    for most models, (0, 1) for runs ending in value_range(0, 1)."""
    _, _, vmin, vmax = self.value_map
    return min(vmin, vmax), max(vmin, vmax)

  @property
  def input_range_text(self) -> str:
    """`input_range` as the card and export.json write it: '[-1, 1]'."""
    low, high = self.input_range
    return f'[{low:g}, {high:g}]'

  @property
  def architecture(self) -> str:
    extra = ', '.join(f'{k}={v}' for k, v in sorted(self.options.items()))
    return self.name + (f' ({extra})' if extra else '')

  @property
  def family(self) -> str:
    return models.family(self.name).name

  @property
  def labels_are_placeholders(self) -> bool:
    """No class names were found: `labels` are `class_0`, `class_1`, ..."""
    return bool(self.labels) and self.labels == placeholder_labels(
        len(self.labels))

  def compute_dtype(self, dtype: Optional[str] = None) -> str:
    """The dtype the model computes in: `dtype` if given, else the run's
    (what predict, export and the run's evaluation use by default)."""
    return jnp.dtype(dtype or self.dtype).name

  def activate(self, logits: jax.Array) -> jax.Array:
    """The probabilities of `logits` [..., K] (`output_activation`)."""
    if self.output_activation == 'sigmoid':
      return jax.nn.sigmoid(logits)
    return jax.nn.softmax(logits, axis=-1)

  def model(self, dtype: Optional[str] = None, **overrides):
    """The flax module computing in `dtype` (default: the run's);
    `overrides`: model options replacing the run's (same parameters)."""
    return models.create(self.name, num_classes=self.num_classes,
                         dtype=jnp.dtype(self.compute_dtype(dtype)),
                         **{**self.options, **overrides})

  def logits(self, images: np.ndarray, dtype: Optional[str] = None
             ) -> np.ndarray:
    """float32 logits of `images` (NHWC, in `input_range`), jitted once per
    dtype and parameters (`cached`), with the parameters that dtype's
    forward pass only narrows cast once (`vit_jax.models.precast`: the same
    logits, no per-call casts)."""
    key = self.compute_dtype(dtype)

    def make():
      fn = jax.jit(self.apply_fn(key))
      return fn, precast.cast_once(fn, self.params, images)
    fn, params = self.cached(('logits', key), make)
    return np.asarray(fn(params, images), np.float32)

  def apply_fn(self, dtype: Optional[str] = None, **overrides
               ) -> Callable[[Any, jax.Array], jax.Array]:
    """`fn(params, images) -> float32 logits` (images NHWC, in
    `input_range`); `overrides`: as for `model`."""
    model = self.model(dtype, **overrides)

    def fn(params, images):
      logits = model.apply({'params': params}, images, train=False)
      return logits.astype(jnp.float32)
    return fn

  def preprocess(self):
    """`pp({'image': encoded bytes or uint8 HxWxC}) -> {'image': ...}`."""
    from vit_jax.data import preprocess
    return preprocess.build(self.pp, self.image_size)

  def num_params(self) -> int:
    return int(sum(np.size(x) for x in jax.tree.leaves(self.params)))


def load(init: Union[str, os.PathLike], *, model: Optional[str] = None,
         labels: Optional[str] = None,
         image_size: Optional[int] = None,
         require_head: bool = True,
         ema: Optional[bool] = None,
         output_activation: Optional[str] = None) -> Trained:
  """The trained model at `init` (workdir, .npz or Hugging Face directory).

  Args:
    init: what to load (a str or os.PathLike; `~` is expanded).
    model: the zoo name; required for .npz files, checked against the
      checkpoint's record for workdirs.
    labels: a dataset name or a text file of class names (one per line).
    image_size: the input side; default: the run's (workdirs) or the
      position embeddings' (ViT .npz); ViT position embeddings are resized.
    require_head: refuse checkpoints without a classification head (e.g.
      a self-supervised pre-training); False loads them without one.
    ema: for workdirs of runs with Polyak averaging: True loads the
      averages, False the raw parameters, None (default) those the run's
      metrics describe (the averages unless its eval_ema was 'raw').
    output_activation: how logits become probabilities ('softmax' or
      'sigmoid'); default: the run's loss (workdirs), a Hugging Face
      config's problem_type, else softmax.
  """
  if output_activation is not None and output_activation not in ACTIVATIONS:
    raise TrainedModelError(
        f'output activation {output_activation!r}: expected one of '
        f'{", ".join(ACTIVATIONS)}')
  if not init:
    raise TrainedModelError('--init is required: a training workdir, an .npz '
                            'checkpoint or a Hugging Face directory')
  init = _local_path(init)
  if image_size is not None and image_size < 1:
    raise TrainedModelError(f'image size {image_size}: expected a positive '
                            'number of pixels (the input side)')
  _check_not_a_stray_file(init)
  if ema is not None and (init.startswith(HF_PREFIX) or init.endswith('.npz')
                          or _is_hf_dir(init)):
    raise TrainedModelError(f'{init} is not a training workdir: only runs '
                            'with optim.ema_decay have raw and averaged '
                            'parameters to choose from')
  if init.startswith(HF_PREFIX):
    init = init[len(HF_PREFIX):]
    if not _is_hf_dir(init):
      raise TrainedModelError(f'{init} is not a Hugging Face model '
                              'directory (no config.json / weights)')
    trained = _from_hf(init, model, require_head)
  elif init.endswith('.npz'):
    trained = _from_npz(init, model, image_size, require_head)
  elif _is_hf_dir(init):
    trained = _from_hf(init, model, require_head)
  else:
    trained = _from_workdir(init, model, require_head, ema)
  if image_size and image_size != trained.image_size:
    trained = resized(trained, image_size)
  trained.labels = _labels(labels, trained)
  if output_activation:
    trained.output_activation = output_activation
  return trained


def _local_path(init) -> str:
  """`init` as a str (a pathlib.Path works too) with a leading `~` (after
  any `hf:`) expanded: `--init=~/run` reaches the program unexpanded (the
  shell expands `~` only at the start of a word)."""
  init = os.fspath(init)
  prefix = HF_PREFIX if init.startswith(HF_PREFIX) else ''
  return prefix + os.path.expanduser(init[len(prefix):])


def _check_not_a_stray_file(init: str) -> None:
  """A local file other than an .npz is no model `load` reads: say what
  is, instead of the checkpoint reader's NotADirectoryError. The weights
  file of a Hugging Face model (model.safetensors, pytorch_model.bin) is
  read through its folder, with config.json beside it."""
  if (init.startswith(HF_PREFIX) or init.endswith('.npz') or '://' in init
      or not os.path.isfile(init)):
    return
  folder = os.path.dirname(os.path.abspath(init))
  hint = (f' {os.path.basename(init)} is a Hugging Face model\'s weights: '
          f'pass its folder, --init={folder}.'
          if os.path.basename(init) in _HF_WEIGHTS else '')
  raise TrainedModelError(
      f'--init={init} is a file, not a model.{hint} --init takes a training '
      'workdir, one of its checkpoints/<step> folders, an .npz checkpoint '
      '(with --model=NAME) or a Hugging Face save_pretrained folder')


def resized(trained: Trained, image_size: int) -> Trained:
  """`trained` at another input side: the eval ops' resize target and the
  position embeddings (interpolated as fine-tuning does).

  A preset spec follows the size by itself; a literal one (a run's
  `input.pp_eval` op string, a 1-channel Hugging Face model's ops) has its
  `resize(N)` / `central_crop(N)` that make the N-pixel output rewritten
  to the new side (`follow_size`); one with none is refused."""
  from vit_jax.data import preprocess
  spec = trained.pp_spec if trained.pp_spec is not None else trained.pp
  if (preprocess.expand(spec, image_size)
      == preprocess.expand(spec, trained.image_size)):  # Does not follow.
    spec = follow_size(trained.pp, trained.image_size, image_size) or spec
  out = _build(trained.name, trained.options, trained.num_classes,
               image_size, spec, trained.params, trained.source,
               trained.kind, dtype=trained.dtype)
  if out.image_size != image_size:
    raise TrainedModelError(
        f'image size {image_size}: the eval pre-processing of {trained.source} '
        f'({"|".join(trained.pp)}) makes {out.image_size}x{out.image_size} '
        f'images whatever the size asked for, and has no '
        f'resize({trained.image_size}) or central_crop({trained.image_size}) '
        f'to change; use {out.image_size}, or a run whose input.pp_eval '
        'follows input.image_size (a preset name)')
  return dataclasses.replace(trained, image_size=out.image_size,
                             channels=out.channels, pp=out.pp,
                             params=out.params)


_SIDE_OPS = ('resize', 'central_crop')  # (h[, w]): the output's side.


def follow_size(ops: List[str], old: int, new: int) -> Optional[List[str]]:
  """`ops` (literal eval ops making `old`-pixel squares) making `new`-pixel
  ones: each `resize(old)` / `central_crop(old)` (also `(old, old)`) gets
  `new`; a `resize(M)` or `resize_small(M)` before a rewritten
  `central_crop` is scaled with it (M * new / old), so the crop keeps its
  share of the image. None when there is no such op to rewrite."""
  from vit_jax.data import preprocess
  parsed = [preprocess.parse_op(op) for op in ops]

  def side(args, kwargs):
    h = args[0] if args else kwargs.get('h', kwargs.get('size'))
    w = args[1] if len(args) > 1 else kwargs.get('w', h)
    return h if h == w and isinstance(h, int) else None

  def with_side(i, fn):
    name, args, kwargs = parsed[i]
    args = tuple(fn(a) if j < 2 and isinstance(a, int) else a
                 for j, a in enumerate(args))
    kwargs = {k: fn(v) if k in ('h', 'w', 'size') else v
              for k, v in kwargs.items()}
    return _op_string(name, args, kwargs)

  hits = [i for i, (name, args, kwargs) in enumerate(parsed)
          if name in _SIDE_OPS and side(args, kwargs) == old]
  if not hits:
    return None
  out = list(ops)
  for i in hits:
    out[i] = with_side(i, lambda _: new)
  crops = [i for i in hits if parsed[i][0] == 'central_crop']
  for i in range(crops[-1] if crops else 0):
    if i not in hits and parsed[i][0] in ('resize', 'resize_small'):
      out[i] = with_side(i, lambda m: max(new, round(m * new / old)))
  return out


def _op_string(name: str, args, kwargs) -> str:
  items = [repr(a) for a in args] + [f'{k}={v!r}' for k, v in kwargs.items()]
  return f'{name}({", ".join(items)})' if items else name


def reinitialised(trained: Trained, seed: int = 0) -> Trained:
  """`trained`'s model with fresh parameters from its own initialisers
  (`seed`): what training started from, the baseline of inspections."""
  x = jnp.zeros((1, *trained.image_shape))
  params = trained.model().init(jax.random.key(seed), x,
                                train=False)['params']
  return dataclasses.replace(
      trained, params=jax.tree.map(np.asarray, params),
      source=f'{trained.source} (random init, seed {seed})')


# --- workdirs ----------------------------------------------------------------


def _from_workdir(path: str, model: Optional[str],
                  require_head: bool = True,
                  ema: Optional[bool] = None) -> Trained:
  from vit_jax.train import orbax_state, run_files
  try:
    source = orbax_state.resolve(path)
  except FileNotFoundError:
    if not os.path.exists(path) and '://' not in path:
      raise TrainedModelError(f'--init={path} does not exist') from None
    raise TrainedModelError(
        f'--init={path}: no trained model there. Pass a training workdir '
        'with a finished checkpoint (its checkpoints/ folder is empty or '
        'missing: let the run save one, e.g. re-run it to resume), '
        'checkpoints/<step>, an .npz file or a Hugging Face '
        'save_pretrained directory') from None
  workdir = source.rstrip('/').rsplit('/', 2)[0]  # .../checkpoints/<step>
  recorded = run_files.read_config(workdir)
  config = recorded.get('config') or {}
  run = run_files.read_summary(workdir, own=False)
  try:
    saved = orbax_state.load_run_state(source)
  except orbax_state.DamagedCheckpointError as e:
    raise TrainedModelError(str(e)) from None
  spec = dict(saved.get('model') or config.get('model') or {})
  if not spec.get('name'):
    raise TrainedModelError(f'{source} does not record its model; load it '
                            'with vit_jax.train.orbax_state.load_params')
  if model and model != spec['name']:
    raise TrainedModelError(
        f'--model={model}, but {source} is a checkpoint of {spec["name"]}: '
        'leave --model out for workdirs')
  name = spec.pop('name')
  dtype = spec.pop('dtype', None) or 'float32'
  spec.pop('param_dtype', None)
  # How the run executed, not what it computes: exported and predicting
  # models use the plain layout (load_pretrained unstacks scanned blocks).
  # The attention kernel is chosen for the platform that serves ('auto'
  # could not be built, 'cudnn' would tie an export to GPUs).
  for key in ('scan_layers', 'remat', 'recompute_internals', 'attention_impl'):
    spec.pop(key, None)
  options = {k: v for k, v in spec.items() if v is not None}
  try:
    raw, averages = orbax_state.load_weights(source)
  except orbax_state.DamagedCheckpointError as e:
    raise TrainedModelError(str(e)) from None
  if ema and averages is None:
    raise TrainedModelError(
        f'{source} holds no EMA parameters (its run did not set '
        'optim.ema_decay): load its raw parameters instead')
  if ema is None:  # The parameters the run's metrics describe.
    ema = run_files.described_params(config)
  use_ema = averages is not None and ema is not False
  params = averages if use_ema else raw
  if ema is False:
    source += ' (raw parameters)'
  num_classes = _head_classes(params, source, require_head)
  inp = dict(config.get('input') or {})
  data = inp.get('data') or run.get('dataset')
  if data:
    from vit_jax.data import registry
    entry = registry.get(data)
    size = int(inp.get('image_size') or entry.image_size)
    pp = inp.get('pp_eval') or entry.pp_eval
    if not config:
      size = int(run.get('image_size') or size)
      logging.warning(
          '%s has no config.json (written by runs since predict/export '
          'exist): using %s\'s default eval pre-processing %r at %d px',
          workdir, data, pp, size)
  else:
    size, pp = _posemb_size(name, options, params) or 224, NPZ_PP
  grid = saved.get('patch_grid')
  trained = _build(name, options, num_classes, size, pp, params, source,
                   'workdir', dtype=dtype,
                   source_grid=tuple(grid) if grid else None)
  if trained.native_image_size is None and options.get('posemb') == (
      'sincos2d') and data:
    trained.native_image_size = size  # The run's: no embeddings tell it.
  trained.data, trained.run, trained.config = data, run, config
  trained.command = recorded.get('command')
  trained.workdir = workdir
  trained.step = _checkpoint_step(source)
  trained.params_kind = 'ema' if use_ema else 'raw'
  trained.has_ema = averages is not None
  trained.labels = _run_labels(recorded.get('class_names'), inp, data,
                               workdir)
  trained.output_activation = _run_activation(config, source)
  return trained


def _run_activation(config: Dict[str, Any], source: str) -> str:
  """How the run's loss read its logits (`config.loss`; softmax for runs
  that predate the field)."""
  loss = config.get('loss') or DEFAULT_ACTIVATION
  if loss not in ACTIVATIONS:
    logging.warning('%s: its config.loss=%r is none of %s: its logits are '
                    'read with %s', source, loss, ACTIVATIONS,
                    DEFAULT_ACTIVATION)
    return DEFAULT_ACTIVATION
  return loss


def _checkpoint_step(source: str) -> Optional[int]:
  """The step of a `.../checkpoints/<step>` folder (None if not one)."""
  name = source.split(' (')[0].rstrip('/').rsplit('/', 1)[-1]
  return int(name) if name.isdigit() else None


def _head_classes(params, source: str, required: bool = True
                  ) -> Optional[int]:
  head = params.get('head') if isinstance(params, dict) else None
  if (not head or 'bias' not in head) and not required:
    return None
  if not head or 'bias' not in head:
    raise TrainedModelError(
        f'{source} has no classification head (a pre-training objective '
        'without one): fine-tune it on labelled data first '
        '(configs/finetune.py with init=...)')
  return int(np.shape(head['bias'])[0])


def _run_labels(recorded: Optional[List[str]], inp: Dict[str, Any],
                data: Optional[str], workdir: str) -> List[str]:
  """The class names the run recorded when it started (config.json), else
  those of its dataset now (runs before 2026-11-29 recorded none)."""
  if recorded:
    return [str(n) for n in recorded]
  return _dataset_labels(inp or ({'data': data} if data else {}))


def _dataset_labels(input_config) -> List[str]:
  if not input_config.get('data'):
    return []
  from vit_jax.data import pipeline
  try:
    return list(pipeline.class_names(input_config) or [])
  except Exception as e:  # pylint: disable=broad-except
    logging.warning('no class names for %s (%s); pass --labels=FILE',
                    input_config.get('data'), e)
    return []


# --- .npz files --------------------------------------------------------------


def _from_npz(path: str, model: Optional[str], image_size: Optional[int],
              require_head: bool = True) -> Trained:
  if not model:
    raise TrainedModelError(
        f'--init={path} is an .npz file: say which model it holds with '
        f'--model=NAME (one of {", ".join(models.names())})')
  params = load_npz(path)
  options = {}
  if 'MAPHead_0' in params:
    options['classifier'] = 'map'  # big_vision's attention pooling.
  elif 'Transformer' in params and 'cls' not in params:
    options['classifier'] = 'gap'  # No class token.
  if 'Transformer' in params and 'posembed_input' not in params[
      'Transformer']:
    options['posemb'] = 'sincos2d'  # Fixed ones (big_vision's baselines).
  if 'pre_logits' in params:  # Pre-training checkpoints keep their head's.
    options['representation_size'] = int(
        np.shape(params['pre_logits']['kernel'])[-1])
  if options.get('posemb') == 'sincos2d' and not image_size:
    raise ImageSizeUnknown(
        f'{path} has fixed position embeddings (posemb=\'sincos2d\', '
        'big_vision\'s plain ViTs), which do not record the image size it '
        'was trained at: pass --image_size (224 for big_vision\'s '
        'ImageNet models)')
  num_classes = _head_classes(params, path, require_head)
  size = image_size or _posemb_size(model, options, params) or 224
  return _build(model, options, num_classes, size, NPZ_PP, params, path,
                'npz')


def _posemb_size(name: str, options, params) -> Optional[int]:
  """The resolution a ViT's position embeddings were trained at."""
  try:
    pe = params['Transformer']['posembed_input']['pos_embedding']
  except (KeyError, TypeError):
    return None
  kw = models.options(name, **options)
  rows = np.shape(pe)[1] - (1 if kw.get('classifier', 'token') == 'token'
                            else 0)
  grid = int(round(max(rows, 0) ** 0.5))
  stride = getattr(models.create(name, num_classes=1, **options), 'stride',
                   None)
  if not stride:
    return None
  return grid * stride if grid * grid == rows else None


# --- Hugging Face directories ------------------------------------------------


def _is_hf_dir(path: str) -> bool:
  if not os.path.isdir(path):
    return False
  if any(os.path.exists(os.path.join(path, f)) for f in _HF_WEIGHTS):
    return True
  try:
    with open(os.path.join(path, 'config.json')) as f:
      return 'model_type' in json.load(f)
  except (OSError, ValueError):
    return False


def _from_hf(path: str, model: Optional[str],
             require_head: bool = True) -> Trained:
  try:
    from transformers import ViTForImageClassification
  except ImportError:
    raise TrainedModelError(
        f'--init={path} is a Hugging Face directory: install the torch extra '
        '(pip install -e ".[torch]" -c constraints.txt)') from None
  from vit_jax.checkpoint import from_hf_model
  if not os.path.isfile(os.path.join(path, 'config.json')):
    # Else transformers builds a default ViT-B/16 and reports its weights'
    # shapes as a mismatch.
    raise TrainedModelError(
        f'{path} has Hugging Face weights but no config.json, which says '
        'what model they are: copy the whole save_pretrained folder '
        '(config.json, model.safetensors, preprocessor_config.json)')
  try:
    hf_model, info = ViTForImageClassification.from_pretrained(
        path, output_loading_info=True)
  except Exception as e:  # pylint: disable=broad-except
    # Truncated or damaged weights (safetensors' SafetensorError, torch's
    # RuntimeError), an unreadable config.json (OSError, ValueError), ...
    raise TrainedModelError(
        f'{path}: cannot read the Hugging Face model ({e})') from e
  headless = _check_hf_weights(path, info)
  cfg = hf_model.config
  name = model or getattr(cfg, 'vit_jax_model', None) or _zoo_name(cfg)
  options = dict(getattr(cfg, 'vit_jax_options', None) or {})
  _check_hf_dims(path, cfg, name, options)
  module, params = from_hf_model(hf_model, name, **options)
  if headless:  # transformers initialised a classifier at random: not ours.
    params.pop('head', None)
    if require_head:
      raise TrainedModelError(
          f'{path} has no classification head (a ViTModel, e.g. an '
          'ImageNet-21k pre-training without its classifier): fine-tune it '
          'on labelled data first (configs/finetune.py with init=...)')
  options['gelu_approximate'] = module.gelu_approximate
  if options['gelu_approximate'] == models.options(name).get(
      'gelu_approximate', True):
    del options['gelu_approximate']
  num_classes = _head_classes(params, path, require_head)
  channels = int(getattr(cfg, 'num_channels', 3))
  proc = _hf_processor_config(path)
  pp = _hf_ops(proc, channels, int(cfg.image_size))
  trained = _build(name, options, num_classes, int(cfg.image_size), pp,
                   params, path, 'hf')
  names = [cfg.id2label.get(i, cfg.id2label.get(str(i)))
           for i in range(num_classes)] if cfg.id2label and num_classes else []
  if names and not all(n == f'LABEL_{i}' for i, n in enumerate(names)):
    trained.labels = [str(n) for n in names]
  if getattr(cfg, 'problem_type', None) == _HF_MULTI_LABEL:
    trained.output_activation = 'sigmoid'
  _check_hf_processor(path, proc)
  return trained


def _check_hf_weights(path: str, info: dict) -> bool:
  """Whether the directory's classifier is missing (a ViTModel: headless);
  TrainedModelError if other weights are missing or left unused (a pooler,
  the pre-logits layer fine-tuning drops, is left out with a note)."""
  missing = sorted(info.get('missing_keys') or ())
  unused = sorted(info.get('unexpected_keys') or ())
  trunk = [k for k in missing if not k.startswith('classifier.')]
  extra = [k for k in unused if not k.startswith('pooler.')]
  if trunk or extra:
    raise TrainedModelError(
        f'{path} does not hold a ViTForImageClassification\'s weights: '
        + (f'missing {trunk[:5]}' if trunk else '')
        + ('; ' if trunk and extra else '')
        + (f'unused {extra[:5]}' if extra else '')
        + ' (another architecture, or a damaged model.safetensors?)')
  if unused:
    logging.warning(
        '%s: its pooler (%s), the pre-logits layer, is left out: '
        'ViTForImageClassification has none, and fine-tuning replaces it '
        'with the new head as the paper does', path, ', '.join(unused))
  return any(k.startswith('classifier.') for k in missing)


def _zoo_name(cfg) -> str:
  """The zoo ViT with the Hugging Face config's dimensions."""
  from vit_jax.checkpoint import hf
  name = hf.zoo_name(cfg)
  if name is None:
    raise TrainedModelError(
        'no zoo ViT has the dimensions of this Hugging Face config ('
        + _options_text(hf.config_dims(cfg)) + '): from Python, '
        "vit_jax.checkpoint.from_hf_model(hf_model, 'ViT-B/16', "
        '**those_options) (any ViT name) loads it')
  return name


def _check_hf_dims(path: str, cfg, name: str, options) -> None:
  """TrainedModelError where `name` (with `options`) has other dimensions
  than the Hugging Face config: its weights may even load (a head count is
  not in them) and compute something else."""
  from vit_jax.checkpoint import hf
  wrong = hf.dims_mismatch(cfg, name, options)
  if not wrong:
    return
  fits = hf.zoo_name(cfg)
  raise TrainedModelError(
      f'{path} is not a {name}: {hf.describe_mismatch(wrong, name)}, so it '
      'would not compute what the Hugging Face model does; '
      + (f'pass --model={fits}' if fits else
         'no zoo ViT has its dimensions: from Python, vit_jax.checkpoint.'
         f'from_hf_model(hf_model, {name!r}, '
         + _options_text({k: v for k, (v, _) in wrong.items()})
         + ') loads it'))


def _options_text(options) -> str:
  return ', '.join(f'{k}={v}' for k, v in options.items())


def _hf_processor_config(path: str) -> dict:
  """A Hugging Face directory's preprocessor_config.json ({} if none)."""
  try:
    with open(os.path.join(path, 'preprocessor_config.json')) as f:
      proc = json.load(f)
  except (OSError, ValueError):
    return {}
  return proc if isinstance(proc, dict) else {}


def _hf_ops(proc: dict, channels: int, size: int) -> str:
  """The eval ops of a Hugging Face model: its processor's shorter-side
  resize and central crop where it has them (a BitImageProcessor, as
  `--format=hf` writes for `resize_small|central_crop` runs), else a resize
  to its image size (ViTImageProcessor); then the value range its rescale
  and normalisation make (`_hf_value_range`: [-1, 1] for most, [0, 1] for
  an export of a value_range(0,1) run)."""
  decode = 'decode' if channels == 3 else f'decode({channels})'
  values = _hf_value_range(proc) or _MINUS_ONE_TO_ONE
  sizes = proc.get('size')
  short = sizes.get('shortest_edge') if isinstance(sizes, dict) else None
  crop = proc.get('crop_size')
  crop = (crop.get('height'), crop.get('width')) if isinstance(
      crop, dict) else (crop, crop)
  if (proc.get('do_resize', True) and proc.get('do_center_crop')
      and isinstance(short, int) and short >= size and crop == (size, size)):
    return (f'{decode}|resize_small({short})|central_crop({size})|{values}')
  if channels == 3 and values == _MINUS_ONE_TO_ONE:
    return NPZ_PP  # The preset: it follows --image_size by itself.
  return f'{decode}|resize({size})|{values}'


_MINUS_ONE_TO_ONE = 'value_range(-1,1)'


def _hf_value_range(proc: dict) -> Optional[str]:
  """The `value_range(vmin,vmax)` op computing what the processor feeds
  (pixel x becomes (x * rescale_factor - mean) / std, one affine map; x *
  2/255 - 1, [-1, 1], where there is no processor config), None where no
  value_range op does (a mean or std per channel: ImageNet's)."""
  if not proc:
    return _MINUS_ONE_TO_ONE
  try:
    factor = (float(proc.get('rescale_factor', 1 / 255))
              if proc.get('do_rescale', True) else 1.0)
    mean, std = proc.get('image_mean', [0.5]), proc.get('image_std', [0.5])
    mean = [float(m) for m in (mean if isinstance(mean, list) else [mean])]
    std = [float(d) for d in (std if isinstance(std, list) else [std])]
    if proc.get('do_normalize', True) is False:
      mean, std = [0.0], [1.0]
    ends = {(round(-m / d, 6), round((255 * factor - m) / d, 6))
            for m, d in zip(mean, std)}
  except (TypeError, ValueError, ZeroDivisionError):
    return None
  if len(ends) != 1:
    return None
  ((vmin, vmax),) = ends
  return f'value_range({vmin + 0.0:g},{vmax + 0.0:g})'  # No '-0'.


def _check_hf_processor(path: str, proc: dict) -> None:
  """Warns where the directory's processor feeds values no value_range op
  computes (`_hf_value_range`: a mean or std per channel), which vit_jax's
  pre-processing then does not match: [-1, 1] is fed."""
  if not proc or _hf_value_range(proc) is not None:
    return
  logging.warning(
      '%s feeds its model other values than vit_jax can (do_rescale=%s, '
      'rescale_factor=%s, do_normalize=%s, mean %s, std %s: one value range '
      'for all channels only; vit_jax feeds pixel * 2/255 - 1, i.e. [-1, '
      "1]): its predictions here may differ from transformers'", path,
      proc.get('do_rescale', True), proc.get('rescale_factor', 1 / 255),
      proc.get('do_normalize', True), proc.get('image_mean'),
      proc.get('image_std'))


# --- shared ------------------------------------------------------------------


def _build(name, options, num_classes, size, pp, params, source, kind,
           dtype='float32', source_grid=None) -> Trained:
  """Checks the params against the model (resizing position embeddings to
  `size` from `source_grid`, the checkpoint's recorded patch grid) and the
  pre-processing's output shape."""
  from vit_jax.data import preprocess
  ops = preprocess.expand(pp, size)
  size, channels = _pp_output(ops, size)
  module = models.create(name, num_classes=num_classes, **options)
  abstract = jax.eval_shape(
      lambda: module.init(jax.random.PRNGKey(0),
                          jnp.zeros((1, size, size, channels)),
                          train=False))['params']
  host = jax.tree.map(lambda a: np.zeros(a.shape, np.float32), abstract)
  try:
    loaded = load_pretrained(params, host, keep_head=True,
                             grid=models.patch_grid(module, (size, size)),
                             source_grid=source_grid)
  except ValueError as e:
    raise TrainedModelError(f'{source} does not fit {name} with {options} '
                            f'at {size}x{size}x{channels}: {e}') from e
  loaded = jax.tree.map(lambda a: np.asarray(a, np.float32), loaded)
  return Trained(name=name, options=dict(options), num_classes=num_classes,
                 image_size=size, channels=channels, pp=ops, labels=[],
                 params=loaded, source=source, kind=kind, dtype=dtype,
                 pp_spec=pp,
                 native_image_size=_native_size(
                     _posemb_size(name, options, params), size,
                     getattr(module, 'stride', None)))


def _native_size(posemb_size: Optional[int], size: int,
                 stride: Optional[int]) -> Optional[int]:
  """The checkpoint's own resolution: `size` when its position embeddings'
  grid is `size`'s (a ViT-H/14 fine-tuned at 384 px has a 27x27 grid,
  which 378 px also makes: 384 is its size, as its run recorded), else the
  smallest side making its grid (`posemb_size`)."""
  if posemb_size and stride and posemb_size // stride == size // stride:
    return size
  return posemb_size


def _pp_output(ops: List[str], size: int):
  """(side, channels) of what the eval ops make of an encoded image."""
  import tensorflow as tf
  from vit_jax.data import pipeline, preprocess
  pipeline.hide_accelerators_from_tf()
  png = tf.io.encode_png(tf.zeros([2 * size + 3, 2 * size + 1, 3], tf.uint8))
  out = preprocess.build(ops, size)({'image': png})['image']
  if out.shape.rank != 3 or None in out.shape.as_list():
    raise TrainedModelError(
        f'eval pre-processing {"|".join(ops)} makes images of shape '
        f'{out.shape}, not square ones of a fixed size')
  if out.shape[0] != out.shape[1]:
    raise TrainedModelError(
        f'eval pre-processing {"|".join(ops)} makes {out.shape[0]}x'
        f'{out.shape[1]} images: predict and export take square models '
        'only (an S x S input, position embeddings for a square grid). '
        'Fine-tune it at a square size (configs/finetune.py with '
        'init=THIS_RUN, input.image_size=S and a square input.pp_eval, e.g. '
        'decode|resize(S)|value_range(-1,1)) and export that; '
        'docs/deploy.md')
  return int(out.shape[0]), int(out.shape[2])


def _labels(labels: Optional[str], trained: Trained) -> List[str]:
  """Class names: `labels` (dataset or file), else what was found."""
  if trained.num_classes is None:
    return []
  names = list(trained.labels)
  if labels:
    if os.path.isfile(os.path.expanduser(labels)):
      labels = os.path.expanduser(labels)
      with open(labels) as f:
        names = [l.strip() for l in f.read().splitlines() if l.strip()]
      where = labels
    else:
      from vit_jax.data import registry
      if labels not in registry.DATASETS and (
          labels.startswith(('/', '.', '~')) or labels.endswith('.txt')):
        raise TrainedModelError(f'--labels={labels}: no such file (a text '
                                'file of class names, one per line, or a '
                                'dataset name)')
      registry.get(labels)  # An unknown name lists the known ones.
      names = _dataset_labels({'data': labels})
      where = f'dataset {labels}'
      if not names:
        from vit_jax.data import pipeline
        later = (f' until it is prepared (its names come with its files: '
                 f'python -m vit_jax.data.prepare {labels})'
                 if registry.get(labels).tfds_name
                 in pipeline.NAMES_FROM_DOWNLOAD else '')
        raise TrainedModelError(f'{where} has no class names{later}; pass '
                                'a text file with one name per line')
    if len(names) != trained.num_classes:
      raise TrainedModelError(
          f'--labels={labels}: {len(names)} names from {where}, but the '
          f'model has {trained.num_classes} classes')
  if len(names) != trained.num_classes:
    if names:
      logging.warning('%d class names for %d classes: using class_<i>',
                      len(names), trained.num_classes)
    names = placeholder_labels(trained.num_classes)
  return names


def placeholder_labels(n: int) -> List[str]:
  """The names of `n` classes whose names are not known."""
  return [f'class_{i}' for i in range(n)]


def hf_problem_type(trained: Trained) -> str:
  """The Hugging Face `problem_type` of `trained`'s output activation
  (read back by `load`)."""
  return (_HF_MULTI_LABEL if trained.output_activation == 'sigmoid'
          else 'single_label_classification')


def flat_params(params) -> Dict[str, np.ndarray]:
  """{'a/b/c': array}: the flat naming of .npz checkpoints."""
  return {'/'.join(k): np.asarray(v)
          for k, v in traverse_util.flatten_dict(dict(params)).items()}
