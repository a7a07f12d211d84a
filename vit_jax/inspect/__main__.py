r"""`python -m vit_jax.inspect`: the paper's analysis figures for a checkpoint.

    python -m vit_jax.inspect --init=<workdir | file.npz | hf:DIR> \
        [--model=ViT-B/16] --data=<dataset name | image folder> \
        [--data_dir=DIR] [--images=128] [--image_size=224] [--raw] --out=DIR

Writes filters.png, position_similarity.png, attention_distance.png,
rollout.png, rollout_layers.png and inspect.json into --out (docs/inspect.md).
Exit status 1 with the reason on bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog='python -m vit_jax.inspect',
      description="The paper's analysis figures (§4.5) for a checkpoint.")
  p.add_argument('--init', required=True, help="a run's workdir (or its "
                 'checkpoints/<step>), an .npz checkpoint, or hf:DIR (a '
                 'Hugging Face ViTForImageClassification directory)')
  p.add_argument('--model', help='zoo name (python -m vit_jax.models); '
                 'needed for .npz files')
  p.add_argument('--data', required=True, help='a dataset name (python -m '
                 'vit_jax.data) or a folder of image files')
  p.add_argument('--data_dir', help='where a dataset named by --data is (as '
                 'input.data_dir; default: TFDS_DATA_DIR, else '
                 '~/tensorflow_datasets); fashion_mnist is prepared there '
                 'if missing, other datasets must be prepared first; '
                 'refused for an image folder')
  p.add_argument('--split', help='dataset split (default: its eval split); '
                 'dataset names only, refused for an image folder')
  p.add_argument('--images', type=int, default=128, help='images averaged '
                 'for the attention distances (the paper: 128)')
  p.add_argument('--image_size', type=int, help="input side in pixels; "
                 "default: the checkpoint's (others interpolate the position "
                 'embeddings; position_similarity.png still shows the '
                 "checkpoint's own). A plain ViT takes sizes that are not a "
                 'multiple of its patch, leaving out the last pixels')
  p.add_argument('--out', required=True, help="output folder; this run's "
                 'files replace those of an earlier run there (other files '
                 'are kept)')
  p.add_argument('--batch', type=int, default=32, help='images per forward '
                 'pass (memory grows with it)')
  p.add_argument('--rollout_images', type=int, default=8,
                 help='images in rollout.png')
  p.add_argument('--layer_images', type=int, default=4,
                 help='images in rollout_layers.png')
  p.add_argument('--random_init', action='store_true', help='inspect a '
                 "fresh random initialisation of the checkpoint's model (the "
                 'untrained baseline)')
  p.add_argument('--seed', type=int, help='seed of --random_init (default '
                 '0; refused without it)')
  p.add_argument('--raw', action='store_true', help='a run with Polyak '
                 'averaging (optim.ema_decay): its raw parameters instead of '
                 'the averages')
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  from absl import logging
  logging.set_verbosity(logging.INFO)
  from vit_jax.inspect import report
  try:
    report.run(args.init, args.data, args.out, model=args.model,
               image_size=args.image_size, images=args.images,
               split=args.split, batch=args.batch,
               rollout_images=args.rollout_images,
               layer_images=args.layer_images, random_init=args.random_init,
               seed=args.seed, raw=args.raw, data_dir=args.data_dir)
  except (FileNotFoundError, ValueError) as e:
    print(f'vit_jax.inspect: {e}', file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
