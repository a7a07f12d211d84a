"""Self-supervised pre-training: masked patch prediction (MPP, paper §4.6 and
Appendix B.1.2). One job per module:

  targets.py     what is predicted per patch (mean colour, 4x4 downsized
                 colours, raw pixels)
  corruption.py  which patch embeddings are masked / swapped / kept
  model.py       the ViT with a `[mask]` token and a per-patch head
  objective.py   the loss and accuracy over the selected positions

Training with it: `--config.objective=mpp` (options under `config.mpp`);
see configs/mpp.py and docs/selfsup.md.
"""

from vit_jax import models
from vit_jax.selfsup.corruption import (corrupt, corrupt_each, image_keys,
                                         num_selected)
from vit_jax.selfsup.model import (PARAMS, REPRESENTATIONS, TARGETS,
                                   MaskedPatchPrediction, check_options,
                                   from_vit, output_shape)
from vit_jax.selfsup.objective import loss_and_metrics, make_targets, sums
from vit_jax.selfsup.targets import (check_value_range, downsized_targets,
                                     num_classes, patch_colour_targets,
                                     pixel_targets, quantise)

OBJECTIVES = ('supervised', 'mpp')


def model_from_config(config, num_classes: int, platform: str = None):
  """The model `config` trains: the zoo model (with a `num_classes` head),
  or for `config.objective == 'mpp'` its MPP version (no head)."""
  objective = config.get('objective', 'supervised')
  if objective not in OBJECTIVES:
    raise ValueError(f'objective={objective!r}: expected one of '
                     f'{OBJECTIVES}')
  base = models.from_config(config.model,
                            0 if objective == 'mpp' else num_classes,
                            platform)
  if objective == 'supervised':
    return base
  mpp = config.get('mpp', {})
  return from_vit(base, target=mpp.get('target', 'colour'),
                  bits=mpp.get('bits', 3), rate=mpp.get('rate', 0.5),
                  representation=mpp.get('representation', 'token'))


__all__ = ['MaskedPatchPrediction', 'OBJECTIVES', 'PARAMS',
           'REPRESENTATIONS', 'TARGETS', 'check_options',
           'check_value_range', 'corrupt',
           'corrupt_each', 'downsized_targets', 'from_vit', 'image_keys',
           'loss_and_metrics',
           'make_targets', 'model_from_config', 'num_classes',
           'num_selected', 'output_shape', 'patch_colour_targets',
           'pixel_targets', 'quantise', 'sums']
