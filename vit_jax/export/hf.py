"""`--format=hf`: a `save_pretrained` directory for Hugging Face
`transformers` (PyTorch), with the class names.

Writes `config.json` (a `ViTConfig` computing exactly what our ViT does:
activation, LayerNorm epsilon, `id2label` / `label2id`, `problem_type`:
multi-label for `loss=sigmoid` runs), `model.safetensors`
and `preprocessor_config.json` (the eval pre-processing where a
transformers image processor has it: a `ViTImageProcessor` for
`resize(S)`, a `BitImageProcessor` for `resize_small(S)|central_crop(C)`;
rescaled and normalised onto the run's value range, `Trained.value_map`:
[-1, 1] for most, [0, 1] for a `value_range(0,1)` run). Loads with

    model = transformers.ViTForImageClassification.from_pretrained(DIR)

Only plain class-token ViTs without a pre-logits layer have a counterpart
there (`vit_jax.checkpoint.hf`): hybrids (R50+ViT), BiT ResNets, `gap`
classifiers and pre-logits layers are refused with the reason.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from vit_jax.checkpoint import hf as hf_checkpoint
from vit_jax.export.registry import Format, register


def not_expressible(trained) -> str:
  """Why `trained` has no ViTForImageClassification form ('' if it has):
  `checkpoint.hf.no_counterpart`, the one definition."""
  return hf_checkpoint.no_counterpart(trained.name, trained.options)


def export(trained, out: str, options):
  why = not_expressible(trained)
  if why:
    raise ValueError(
        f'--format=hf cannot express this model: {why}. Export it with '
        '--format=onnx, savedmodel or stablehlo instead')
  import torch
  from transformers import ViTForImageClassification
  from transformers.utils import logging as hf_logging
  hf_logging.disable_progress_bar()
  from vit_jax import trained as trained_lib
  from vit_jax.checkpoint import hf_config, to_hf
  config = hf_config(trained.name, num_classes=trained.num_classes,
                     image_size=trained.image_size,
                     num_channels=trained.channels, **trained.options)
  config.id2label = dict(enumerate(trained.labels))
  config.label2id = {name: i for i, name in enumerate(trained.labels)}
  # Multi-label (a sigmoid per class) for loss=sigmoid runs: transformers'
  # loss and pipelines, and `vit_jax.trained.load`, read it back.
  config.problem_type = trained_lib.hf_problem_type(trained)
  config.vit_jax_model = trained.name
  config.vit_jax_options = dict(trained.options)
  model = ViTForImageClassification(config)
  model.load_state_dict(to_hf(trained.params, trained.name,
                              **trained.options), strict=True)
  model.eval()
  with torch.no_grad():
    model.save_pretrained(out, safe_serialization=True)
  processor, note, same_ops = _processor(trained)
  processor.save_pretrained(out)
  return {'files': ['config.json', 'model.safetensors',
                    'preprocessor_config.json'],
          'processor_note': note,
          # Another pipeline than the one evaluated with: said loudly.
          'warnings': [] if same_ops else [note]}


def _pipeline(trained):
  """The eval ops as ('resize', S) (`decode|resize(S)|value_range(a,b)`),
  ('crop', S, C) (`decode|resize_small(S)|central_crop(C)|value_range(a,
  b)`) or None: the pipelines a transformers image processor runs too
  (bilinear resizes, PIL antialiasing them; any value range of the 0-255
  pixels, which its rescale and normalisation make: `_normalisation`)."""
  from vit_jax.data import preprocess
  parsed = [preprocess.parse_op(op) for op in trained.pp]

  def bilinear(kwargs):
    return (set(kwargs) <= {'method', 'antialias'}
            and kwargs.get('method', 'bilinear') == 'bilinear')

  def side(name, args, kwargs):
    """S of `name(S)`, `name(S, S)` (or h=/w=/size=) with bilinear kwargs."""
    kwargs = dict(kwargs)
    sides = list(args[:2]) + [kwargs.pop(k) for k in ('h', 'size', 'w')
                              if k in kwargs]
    if (not bilinear(kwargs) or len(args) > 2 or not sides
        or any(s != sides[0] or not isinstance(s, int) for s in sides)):
      return None
    return sides[0]

  # Its value_range (the last op) from the pixels' full 0-255 range (the
  # default in_min / in_max), which a processor's affine map makes exactly:
  # nothing is clipped.
  if (not parsed or parsed[0][0] != 'decode'
      or parsed[-1][0] != 'value_range' or trained.value_map[:2] != (0, 255)):
    return None
  if parsed[0][1:] not in (((), {}), ((trained.channels,), {}),
                           ((), {'channels': trained.channels})):
    return None
  middle = parsed[1:-1]
  names = [name for name, _, _ in middle]
  sides = [side(*op) for op in middle]
  if names == ['resize'] and sides[0] == trained.image_size:
    return ('resize', trained.image_size)
  if (names == ['resize_small', 'central_crop'] and sides[0]
      and sides[1] == trained.image_size and sides[0] >= sides[1]):
    return ('crop', sides[0], trained.image_size)
  return None


def _processor(trained):
  """(the transformers image processor running the eval pre-processing,
  what it does compared with it, whether it runs the same ops).

  `resize(S)` is a ViTImageProcessor; `resize_small(S)|central_crop(C)` a
  BitImageProcessor (shortest edge S, centre crop C); any other pipeline
  gets the plain resize with a warning."""
  from transformers import BitImageProcessor, ViTImageProcessor
  pipeline = _pipeline(trained)
  mean, std = _normalisation(trained)
  values = trained.input_range_text
  common = dict(
      # RGB models: grey, RGBA and CMYK images are converted. The processors
      # cannot make grey images: 1-channel models take mode 'L' ones.
      do_convert_rgb=trained.channels == 3, do_resize=True, resample=2,
      do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
      image_mean=[mean] * trained.channels, image_std=[std] * trained.channels)
  grey = (' It takes grey (mode "L") images: convert others with '
          'image.convert("L") first.' if trained.channels == 1 else '')
  antialias = ('with PIL\'s bilinear resize, which antialiases when it '
               'shrinks an image and ours does not: from a 512-px photo to '
               '224 pixels differ by 2.8 of 255 on average, up to 85 '
               '(docs/deploy.md).')
  if pipeline and pipeline[0] == 'crop':
    _, small, crop = pipeline
    return BitImageProcessor(
        size={'shortest_edge': small}, do_center_crop=True,
        crop_size={'height': crop, 'width': crop}, **common), (
            f'preprocessor_config.json (a BitImageProcessor: load it with '
            f'AutoImageProcessor) resizes the shorter side to {small}, '
            f'crops the central {crop}x{crop} and maps to {values} like the '
            'eval pre-processing, but ' + antialias + ' Its longer side is '
            'rounded down where ours is rounded, so the crop may sit one '
            'pixel off.' + grey), True
  processor = ViTImageProcessor(
      size={'height': trained.image_size, 'width': trained.image_size},
      **common)
  if pipeline:
    return processor, (
        'preprocessor_config.json resizes to '
        f'{trained.image_size} and maps to {values} like the eval '
        'pre-processing, but ' + antialias + grey), True
  return processor, (
      f'preprocessor_config.json only resizes to {trained.image_size}x'
      f'{trained.image_size} and maps to {values}, but the model was '
      f'evaluated with {"|".join(trained.pp)}: transformers\' image '
      'processors have no such pipeline (they resize, or resize the '
      'shorter side and crop the centre, bilinearly), so its inputs '
      'differ from the evaluation\'s and so may the accuracy. For '
      'matching inputs apply those ops yourself and pass pixel_values '
      '(docs/deploy.md), or export --format=savedmodel '
      '--with-preprocessing.' + grey), False


def _normalisation(trained):
  """(image_mean, image_std) of a processor that, after rescaling pixels x
  by 1/255, computes the eval pre-processing's value_range: vmin + (x -
  in_min) * (vmax - vmin) / (in_max - in_min) (`Trained.value_map`), i.e.
  mean -vmin / (vmax - vmin), std 1 / (vmax - vmin) for the default in_min
  = 0, in_max = 255: (0.5, 0.5) for [-1, 1], (0, 1) for [0, 1]. vit_jax
  reads them back as that value_range (`trained._hf_value_range`)."""
  in_min, in_max, vmin, vmax = trained.value_map
  span = 255 * (vmax - vmin)
  return ((in_min * (vmax - vmin) - vmin * (in_max - in_min)) / span,
          (in_max - in_min) / span)


@functools.lru_cache(maxsize=2)
def _model(out: str, stamp: float):
  del stamp  # Part of the cache key: a new export is loaded anew.
  from transformers import ViTForImageClassification
  from transformers.utils import logging as hf_logging
  hf_logging.disable_progress_bar()
  return ViTForImageClassification.from_pretrained(out).eval()


def run(out: str, images: np.ndarray) -> np.ndarray:
  import torch
  model = _model(out, os.path.getmtime(os.path.join(out,
                                                    'model.safetensors')))
  with torch.no_grad():
    pixels = torch.from_numpy(np.ascontiguousarray(
        images.transpose(0, 3, 1, 2)))
    return model(pixel_values=pixels).logits.numpy()


register(Format(
    name='hf', export=export, run=run,
    requires=('torch', 'transformers', 'safetensors'),
    unsupported=not_expressible,
    dtypes=('float32',), layout='NCHW',
    other_dtypes='export float32 and load it in transformers with '
    'from_pretrained(DIR, torch_dtype=torch.bfloat16) (or float16) to run '
    'it in half precision',
    no_preprocessing='transformers models take pixel tensors; the '
    'preprocessor_config.json written with every hf export resizes (and '
    'crops) and normalises for AutoImageProcessor',
    description='Hugging Face transformers ViTForImageClassification '
    '(save_pretrained: config.json + model.safetensors, with label names)'))
