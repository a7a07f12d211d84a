"""`python -m vit_jax.export --init=... --format=NAME --out=DIR`.

    python -m vit_jax.export --init=/tmp/vit_smoke --format=onnx --out=/tmp/vit_onnx
    python -m vit_jax.export --init=/tmp/vit_smoke --format=savedmodel --with-preprocessing --out=/tmp/vit_sm/1
    python -m vit_jax.export --init=ViT-B_16.npz --model=ViT-B/16 --labels=imagenet2012 --format=hf --out=/tmp/b16_hf

Prints where the export went, its size and time, and how far its logits
are from the JAX model's (the export fails if further than the tolerance).
Exit status 0 on success, 1 with a message naming the problem otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence


def _batch(value: str):
  """--batch: 'dynamic' (None) or `predict.positive_int`'s count."""
  from vit_jax.predict import positive_int
  if value == 'dynamic':
    return None
  try:
    return positive_int(value)
  except argparse.ArgumentTypeError:
    raise argparse.ArgumentTypeError(
        f'--batch={value}: expected dynamic or a positive integer') from None


def _parser() -> argparse.ArgumentParser:
  from vit_jax import trained as trained_lib
  from vit_jax.export import registry
  from vit_jax.predict import positive_int  # predict's --image_size's.
  p = argparse.ArgumentParser(
      prog='python -m vit_jax.export',
      description='Export a trained model and verify it against JAX.')
  p.add_argument('--init', required=True, help='training workdir (or its '
                 'checkpoints/<step>), .npz checkpoint or Hugging Face dir')
  p.add_argument('--model', help='zoo name (needed for .npz files)')
  p.add_argument('--format', required=True,
                 help='one of: savedmodel, stablehlo, onnx, hf')
  p.add_argument('--out', required=True, help='output directory (new or '
                 'empty; --overwrite replaces an earlier export)')
  p.add_argument('--batch', type=_batch, default=None,
                 help='dynamic (default) or a fixed batch size')
  p.add_argument('--with-preprocessing', action='store_true',
                 help='savedmodel: take encoded JPEG/PNG bytes and run the '
                 'eval pre-processing in the graph')
  p.add_argument('--labels', help='dataset name or a text file of class '
                 'names (default: the run\'s dataset)')
  p.add_argument('--image_size', type=positive_int,
                 help='input resolution (default: the run\'s, or the '
                 'checkpoint\'s position embeddings\'); ViT position '
                 'embeddings are interpolated as fine-tuning does, without '
                 'training at that size, so a workdir\'s card then shows '
                 'no results (they were measured at the run\'s)')
  p.add_argument('--dtype', choices=('float32', 'bfloat16', 'float16'),
                 help='compute dtype of the exported model (default: the '
                 'run\'s, as predict computes and the run evaluated; '
                 'float32 for formats that export float32 only)')
  p.add_argument('--output_activation', choices=trained_lib.ACTIVATIONS,
                 help='how its logits become probabilities, recorded in '
                 'export.json and the card, and the SavedModel\'s '
                 'probabilities output (default: as the run\'s loss read '
                 'them; softmax for .npz and Hugging Face models, unless '
                 'its config.json says multi_label_classification)')
  p.add_argument('--params', default='auto', choices=('auto', 'ema', 'raw'),
                 help='workdirs of runs with optim.ema_decay: export the '
                 'EMA (Polyak) averages or the raw parameters; auto '
                 '(default): those the run\'s metrics describe (the '
                 'averages unless it set eval_ema=raw)')
  p.add_argument('--overwrite', action='store_true')
  del registry
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  from vit_jax import trained as trained_lib
  from vit_jax import export, outputs
  from vit_jax.data import pipeline
  pipeline.hide_accelerators_from_tf()
  try:
    args.out = outputs.directory(args.out, '--out', remote=False)
    fmt = export.get(args.format)
    options = export.Options(batch=args.batch,
                             with_preprocessing=args.with_preprocessing,
                             dtype=args.dtype)
    export.registry.check_installed(fmt)
    export.registry.check_options(fmt, options)
    # Before loading the checkpoint (minutes for a large one): a refused
    # --out is said at once. `export_model` checks it again as it starts.
    export.run.check_out(args.out, args.overwrite)
    trained = trained_lib.load(args.init, model=args.model,
                               labels=args.labels,
                               image_size=args.image_size,
                               ema={'auto': None, 'ema': True,
                                    'raw': False}[args.params],
                               output_activation=args.output_activation)
    manifest = export.export_model(
        trained, fmt.name, args.out, options, overwrite=args.overwrite)
  except (export.ExportError, trained_lib.TrainedModelError, ImportError,
          ValueError, FileNotFoundError) as e:
    print(f'vit_jax.export: {e}', file=sys.stderr)
    return 1
  print(f'exported {manifest["model"]} as {manifest["format"]} to '
        f'{args.out}: {manifest["bytes"] / 1e6:.2f} MB in '
        f'{manifest["export_seconds"]:.1f} s')
  print(f'verified: {manifest["verification"]["summary"]}')
  for warning in manifest.get('warnings') or ():
    print(f'warning: {warning}', file=sys.stderr)
  print(f'model card: {os.path.join(args.out, "MODEL_CARD.md")}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
