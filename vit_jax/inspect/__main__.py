r"""`python -m vit_jax.inspect`: the paper's analysis figures for a checkpoint.

    python -m vit_jax.inspect --init=<workdir | file.npz | hf:DIR> \
        [--model=ViT-B/16] --data=<dataset name | image folder> \
        [--images=128] [--image_size=224] --out=DIR

Writes filters.png, position_similarity.png, attention_distance.png,
rollout.png, rollout_layers.png and inspect.json into --out (docs/inspect.md).
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from absl import app, flags, logging  # noqa: E402

_INIT = flags.DEFINE_string(
    'init', None, 'A run\'s workdir, an .npz checkpoint, or hf:<directory> '
    '(Hugging Face ViTForImageClassification).', required=True)
_MODEL = flags.DEFINE_string(
    'model', None, 'Zoo name (python -m vit_jax.models); needed for .npz, '
    'optional for workdirs and hf: directories.')
_DATA = flags.DEFINE_string(
    'data', None, 'A dataset name (python -m vit_jax.data) or a folder of '
    'JPEG/PNG images.', required=True)
_SPLIT = flags.DEFINE_string('split', None, 'Dataset split (default: its '
                             'eval split).')
_IMAGES = flags.DEFINE_integer('images', 128, 'Images averaged for the '
                               'attention distances (the paper: 128).')
_SIZE = flags.DEFINE_integer('image_size', None, 'Input side; default: the '
                             'checkpoint\'s (other sizes interpolate the '
                             'position embeddings).')
_OUT = flags.DEFINE_string('out', None, 'Output folder.', required=True)
_BATCH = flags.DEFINE_integer('batch', 32, 'Images per forward pass.')
_ROLLOUT = flags.DEFINE_integer('rollout_images', 8, 'Images in rollout.png.')
_LAYERS = flags.DEFINE_integer('layer_images', 4, 'Images in '
                               'rollout_layers.png.')
_RANDOM = flags.DEFINE_bool(
    'random_init', False, 'Inspect a fresh random initialisation of the '
    'checkpoint\'s model instead of its weights (the untrained baseline).')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of --random_init.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  from vit_jax.inspect import report
  report.run(_INIT.value, _DATA.value, _OUT.value, model=_MODEL.value,
             image_size=_SIZE.value, images=_IMAGES.value, split=_SPLIT.value,
             batch=_BATCH.value, rollout_images=_ROLLOUT.value,
             layer_images=_LAYERS.value, random_init=_RANDOM.value,
             seed=_SEED.value)


if __name__ == '__main__':
  logging.set_verbosity(logging.INFO)
  app.run(main)
