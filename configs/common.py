"""Shared defaults and argument parsing for every config file.

A config file is a function `get_config(arg)` returning an
`ml_collections.ConfigDict`; `arg` is what follows the `:` of the config spec,
e.g. `configs/pretrain.py:model=ViT-B/16,data=i21k`. Every field can then be
overridden on the command line (`--config.input.batch_size=256`).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Dict, List, Optional, Sequence

import ml_collections
from absl import logging

from vit_jax import models, paper, tables
from vit_jax.data import registry


def parse_arg(arg: Optional[str], **defaults) -> ml_collections.ConfigDict:
  """Parses `k=v,k=v` into a ConfigDict; keys must be among `defaults`.

  Values take the type of their default (bool accepts true/false/1/0).
  """
  out: Dict[str, Any] = dict(defaults)
  for item in filter(None, (arg or '').split(',')):
    if '=' not in item:
      raise ValueError(f'config arg {item!r} is not key=value (args: '
                       f'{", ".join(f"{k}=..." for k in defaults)})')
    key, value = item.split('=', 1)
    if key not in defaults:
      raise ValueError(f'unknown config arg {key!r}; this config takes: '
                       f'{", ".join(sorted(defaults))}')
    default = defaults[key]
    if isinstance(default, bool):
      if value.lower() not in ('true', 'false', '1', '0'):
        raise ValueError(f'config arg {key}={value!r}: expected true/false')
      out[key] = value.lower() in ('true', '1')
    elif default is None or isinstance(default, str):
      out[key] = value
    else:
      try:
        out[key] = type(default)(value)
      except ValueError:
        raise ValueError(f'config arg {key}={value!r}: expected '
                         f'{type(default).__name__}, e.g. {key}={default}'
                         ) from None
  return ml_collections.ConfigDict(out)


class ConfigSpecError(ValueError):
  """A `--config=` spec or `--config.<field>=` override on a command line
  that names no file, no config row or no field: one line that says so."""


def check_command_line(argv: Sequence[str]) -> List[str]:
  """`argv` with its `--config=<spec>` file found (`configs.config_file`:
  the installed configs/ outside a checkout), once the config it names has
  been built and every `--config.<field>=` override checked against it.

  Every entry point that takes `--config` (`vit_jax.main`,
  `vit_jax.accounting`, `launch.topology`) calls this before absl parses
  its flags, so that a missing file, a bad `:args` row or a misspelt field
  is a `ConfigSpecError` naming the problem rather than absl's chained
  tracebacks (config_flags builds the config again, from the same file).
  """
  from vit_jax.configs import config_file, unknown_field

  def found(spec):
    try:
      path, arg = config_file(spec)
    except ValueError as e:  # It names the config files there are.
      raise ConfigSpecError(str(e)) from None
    name = '_vit_jax_config_check'
    loader = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module  # As an import would (dataclasses need it).
    try:
      loader.loader.exec_module(module)
      built.append(module.get_config(*([arg[1:]] if arg else [])))
    except Exception as e:  # pylint: disable=broad-except
      raise ConfigSpecError(f'--config={spec}: {type(e).__name__}: {e}'
                            ) from None
    finally:
      del sys.modules[name]
    return path + arg

  built = []  # The config as config_flags will build it.
  out = list(argv)
  for i, arg in enumerate(out):
    if arg.startswith('--config='):
      out[i] = '--config=' + found(arg[len('--config='):])
    elif arg == '--config' and i + 1 < len(out):
      out[i + 1] = found(out[i + 1])
  if built:
    for arg in out:
      if arg.startswith('--config.'):
        problem = unknown_field(built[-1],
                                arg[len('--config.'):].split('=', 1)[0])
        if problem:
          raise ConfigSpecError(problem)
  return out


def model_section(name: str) -> ml_collections.ConfigDict:
  """`config.model`: `name` and every option of every model family, unset
  (None: the variant's default), so that `--config.model.<option>=...`
  (dtype, remat, representation_size, ...) works on any config. Any literal
  type: `=bfloat16`, `=True`, `=(1,1,1)` and `=None` all parse."""
  c = ml_collections.ConfigDict({'name': name})
  for option in models.option_names():
    c[option] = ml_collections.FieldReference(None, field_type=object)
  return c


def base() -> ml_collections.ConfigDict:
  """Fields every training config has (see docs/configs.md)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.mode = 'train'  # 'eval': evaluate workdir's checkpoint (or init) only.
  # `name` picks the model from the zoo; other fields override its options.
  c.model = model_section('ViT-B/16')
  # The model head's classes; None: the dataset's class count. Any literal
  # type, so that both --config.num_classes=None and =5 parse.
  c.num_classes = ml_collections.FieldReference(None, field_type=object)
  def none(kind):  # An optional field, overridable from the command line.
    return ml_collections.FieldReference(None, field_type=kind)
  # See docs/data.md; None: the dataset registry's default, or the input
  # pipeline's (vit_jax/data/settings.py: shuffle_buffer, cache, prefetch,
  # mixup, cutmix, skip_bad_images).
  c.input = ml_collections.ConfigDict(dict(
      data='imagenet2012', data_dir=none(str), image_size=224,
      batch_size=4096, eval_batch_size=1024,
      num_train_examples=none(int),  # None: the registry's.
      train_split=none(str), eval_split=none(str), pp_train=none(str),
      pp_eval=none(str), shuffle_buffer=none(int), cache=none(bool),
      prefetch=none(int), mixup=none(float), cutmix=none(float),
      skip_bad_images=none(bool),
      # TFRecords (data=tfrecord): their class count and feature names;
      # multi_label: every label of a record, multi-hot (None: the
      # registry's, True for jft).
      num_classes=none(int), image_key=none(str), label_key=none(str),
      multi_label=none(bool), prepare=False))
  # One of the two sets the run length.
  c.total_steps = ml_collections.FieldReference(None, field_type=int)
  c.total_epochs = ml_collections.FieldReference(None, field_type=float)
  c.loss = 'softmax'  # or 'sigmoid' (i21k and JFT pre-training).
  # 'supervised' (the labels, `loss`) or 'mpp': masked patch prediction,
  # self-supervised, labels never read (vit_jax/selfsup, docs/selfsup.md).
  c.objective = 'supervised'
  # MPP: target 'colour' (3-bit mean colour, the paper's), 'downsized' (4x4
  # cells per patch) or 'pixels' (L2); bits per channel; rate: fraction of
  # patches corrupted; representation: what few-shot reads, 'token' or 'gap'.
  c.mpp = ml_collections.ConfigDict(dict(target='colour', bits=3, rate=0.5,
                                         representation='token'))
  c.label_smoothing = 0.0
  c.accum_steps = 1  # Gradient accumulation: micro-batches per step.
  c.optim = ml_collections.ConfigDict(dict(
      name='adam', lr=1e-3, warmup_steps=10_000, decay='linear',
      linear_end=0.0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1,
      momentum=0.9, nesterov=False, grad_clip_norm=ml_collections.FieldReference(
          None, field_type=float), mu_dtype=ml_collections.FieldReference(
              None, field_type=str),
      # Per-parameter groups (vit_jax/train/param_groups.py): a regex of
      # frozen parameters, ((regex, lr multiplier), ...), layer-wise decay.
      frozen=ml_collections.FieldReference(None, field_type=str),
      lr_mults=ml_collections.FieldReference(None, field_type=object),
      layer_decay=ml_collections.FieldReference(None, field_type=float),
      # ((regex, {lr, warmup_steps, decay, linear_end}), ...): schedules of
      # their own for the matching parameters (param_groups.py).
      schedules=ml_collections.FieldReference(None, field_type=object),
      # Polyak averaging / EMA of the parameters (None: off), e.g. 0.9999;
      # warm-up: decay min(ema_decay, (1+t)/(10+t)) at step t (optim.py).
      ema_decay=ml_collections.FieldReference(None, field_type=float),
      ema_warmup=True))
  # With optim.ema_decay: evaluate the averages ('ema'), the raw parameters
  # ('raw'), or both (raw metrics as 'raw/<name>'); summaries, tables and
  # mode=eval read the 'ema' ones.
  c.eval_ema = 'ema'
  # Device mesh (-1 fills): batch over data x fsdp, heads/MLP over model.
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, model=1))
  c.fsdp_min_size = 2**18  # Smaller tensors stay replicated under FSDP.
  # Extra (logical axis, mesh axis) pairs before sharding.LOGICAL_RULES, e.g.
  # (('mlp', None),) keeps MLP kernels whole under tensor parallelism.
  c.sharding_rules = ()
  # (parameter path regex, logical axes) pairs replacing a model's
  # annotation, e.g. (('^head/kernel$', (None, 'mlp')),).
  c.sharding_overrides = ()
  # Pre-trained weights to start from (.npz); None: from scratch.
  c.init = ml_collections.FieldReference(None, field_type=str)
  # Extra evaluators by name (vit_jax/evaluators): type='classification'
  # (e.g. ImageNet ReaL) or type='fewshot' (docs/evaluation.md).
  c.evals = ml_collections.ConfigDict()
  # Where the run belongs in the paper's tables (see docs/tables.md): model,
  # pretrain, pretrain_epochs, pretrain_optimizer, task, lr, sweep.
  c.report = ml_collections.ConfigDict()
  c.log_every = 50
  c.eval_every = 0  # 0: evaluate at the end only.
  c.checkpoint_every = 1000
  c.keep_checkpoints = 3
  c.async_checkpoints = True
  # '<start>,<steps>': a jax.profiler trace of steps start+1..start+steps in
  # workdir/profile/process_<i> (TensorBoard, Perfetto), e.g. '10,5'; '': none.
  c.profile = ''
  # What `python -m vit_jax.accounting --config=...` estimates the run on.
  c.accounting = ml_collections.ConfigDict(dict(
      hardware='tpu_v3', num_devices=ml_collections.FieldReference(
          None, field_type=int), utilization=ml_collections.FieldReference(
              None, field_type=float)))
  return c


def fewshot(datasets, shots, seeds: int = 3,
            **fields) -> ml_collections.ConfigDict:
  """A few-shot evaluator's config section (`type='fewshot'`,
  docs/evaluation.md), with `l2_reg` listed so that
  `--config.evals.fewshot.l2_reg=...` can set it on the command line
  (ml_collections adds no field there). `l2_reg` None: the evaluator's
  default, big_vision's 2**10. `pp`, `data_dir` and `batch_size` likewise
  (None: `decode|resize({size})|value_range(-1,1)`, the run's
  `input.data_dir`, `input.eval_batch_size`). `fields`: `pool_per_class`,
  `every`, ..."""
  c = ml_collections.ConfigDict(dict(type='fewshot', datasets=tuple(datasets),
                                     shots=tuple(shots), seeds=seeds))
  c.l2_reg = ml_collections.FieldReference(None, field_type=float)
  c.pp = ml_collections.FieldReference(None, field_type=str)
  c.data_dir = ml_collections.FieldReference(None, field_type=str)
  c.batch_size = ml_collections.FieldReference(None, field_type=int)
  c.update(fields)
  return c


def table4_optim(c: ml_collections.ConfigDict, lr: float,
                 warmup_steps: int) -> None:
  """The paper's fine-tuning optimizer (Table 4): SGD momentum 0.9, cosine
  decay, no weight decay, global-norm clipping at 1."""
  t4 = paper.TABLE4_COMMON
  c.optim.update(dict(name=t4['optimizer'], momentum=t4['momentum'], lr=lr,
                      decay=t4['decay'], weight_decay=t4['weight_decay'],
                      grad_clip_norm=t4['grad_clip_norm'],
                      warmup_steps=warmup_steps))


def pretrain_data(name: str) -> str:
  """The short name (jft, i21k, i1k) of the pre-training data `name` names,
  in any case and in the other spellings the result tables read
  (`paper.PRETRAIN_ALIASES`: imagenet21k, jft300m, ...). Other data (your
  own pre-training) is recorded as given, lower case, with a warning: such
  a run fills no paper table."""
  key = str(name).strip().lower()
  key = paper.PRETRAIN_ALIASES.get(key, key)
  if key not in paper.PRETRAIN_DATA:
    aliases = ', '.join(sorted(paper.PRETRAIN_ALIASES))
    logging.warning(
        'pretrain=%r is none of %s (or %s): recorded as given; the run '
        'fills no paper table (the tables place runs by their pre-training '
        'data; a vit_jax workdir `init`\'s own report takes precedence at '
        'run time)', name, '|'.join(paper.PRETRAIN_DATA), aliases)
  return key


def transfer_report(args, task: str, lr: float) -> dict:
  """`config.report` of a transfer run: the pre-training its `init` is
  (args `pretrain`, normalised by `pretrain_data`, `pretrain_epochs`,
  `pretrain_opt`) and its task."""
  pretrain = pretrain_data(args.pretrain)
  epochs = args.pretrain_epochs or paper.default_epochs(pretrain, args.model)
  report = dict(model=args.model, pretrain=pretrain,
                pretrain_epochs=epochs, pretrain_optimizer=args.pretrain_opt,
                task=task, lr=lr, sweep=args.sweep, transfer=True)
  if args.get('table2'):  # Table 2's ImageNet fine-tuning (512/518 px).
    report['table2'] = True
  return report


def shrink_model(model: ml_collections.ConfigDict) -> int:
  """Shrinks `model` in place keeping its family and patch size (the family's
  registered `shrink`); returns an image size the small model takes."""
  kw = {k: v for k, v in model.items() if k != 'name' and v is not None}
  overrides, size = models.family(model.name).shrink(
      models.options(model.name, **kw))
  for k, v in overrides.items():
    model[k] = v
  return size


def apply_smoke(c: ml_collections.ConfigDict, steps: int = 10
                ) -> ml_collections.ConfigDict:
  """The `smoke` variant of a config: the same code path (model family,
  loss, optimizer, pre-processing presets, evaluators) with a tiny model on
  scikit-learn's real `digits`, for a few steps: seconds on a CPU."""
  size = shrink_model(c.model)
  c.model.dtype = None  # The variant's (float32); settable again.
  c.input.data = 'digits'
  c.input.data_dir = None
  c.input.image_size = size
  c.input.batch_size = 32
  c.input.eval_batch_size = 120
  c.input.num_train_examples = registry.get('digits').num_train_examples
  c.input.prepare = False
  # The paper's LR-sweep splits (finetune.py's sweep=true) are not digits':
  # 10% of its train split held out stands in for them.
  held_out = {'train_dev': 'train[:90%]', 'dev': 'train[90%:]'}
  for key in ('train_split', 'eval_split'):
    c.input[key] = held_out.get(c.input[key], c.input[key])
  c.num_classes = None  # digits' 10.
  c.total_steps = steps
  c.total_epochs = None
  c.optim.warmup_steps = 2
  c.accum_steps = 1
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, model=1))
  c.log_every = 5
  c.checkpoint_every = steps
  c.eval_every = 0
  c.report.smoke = True
  return c
