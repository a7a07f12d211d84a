"""The paper's numbers (docs: /work/shared/PAPER.md), as plain Python data.

Dosovitskiy et al., "An Image is Worth 16x16 Words: Transformers for Image
Recognition at Scale", ICLR 2021 (arXiv 2010.11929). Nothing here computes
beyond looking rows up: `configs/` read the recipes, `accounting.py` and
`tables.py` compare our runs and estimates with these. Dataset sizes and
class counts are the data registry's (`vit_jax/data/registry.py`).

Conventions:
  * models are named as our zoo spells them (`vit_jax.models.names()`):
    'ViT-B/16', 'BiT-R50x1' (the paper's ResNet50x1), 'R50+ViT-B/16' (the
    paper's R50x1+ViT-B/16). Models the zoo lacks keep a descriptive name.
  * datasets are keyed by their data registry names (`vit_jax.data.registry`):
    'imagenet2012', 'imagenet2012_real' (ImageNet with the ReaL labels),
    'cifar10', 'cifar100', 'oxford_iiit_pet', 'oxford_flowers102'; 'vtab' is
    the mean over the 19 VTAB-1k tasks.
  * accuracies are in percent, as printed in the paper; a cell the paper
    leaves empty is None.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Dict, Optional, Tuple

from vit_jax.data import registry

# Datasets of the fine-tuning tables, in the paper's row / column order.
IMAGENET = 'imagenet2012'
REAL = 'imagenet2012_real'
TABLE2_DATASETS = ('imagenet2012', 'imagenet2012_real', 'cifar10', 'cifar100',
                   'oxford_iiit_pet', 'oxford_flowers102', 'vtab')
TABLE6_DATASETS = TABLE2_DATASETS[:-1]
OPTIMIZER_DATASETS = ('imagenet2012', 'cifar10', 'cifar100',
                      'oxford_iiit_pet', 'oxford_flowers102')

# Table 2's best ImageNet numbers (Sec. 4.1): fine-tuned at a higher
# resolution per model, with Polyak & Juditsky averaging of the parameters.
TABLE2_FINETUNE_RES = {'ViT-L/16': 512, 'ViT-H/14': 518}
TABLE2_POLYAK = 0.9999

# Images in JFT-300M as Table 6 counts them ("303M images").
JFT_IMAGES = registry.get('jft').num_train_examples

# Pre-training data by the short names of configs/pretrain.py: the registry
# dataset, and the schedule (epochs) of models without a Table 3 row.
PRETRAIN_DATA = {'jft': 'jft', 'i21k': 'imagenet21k', 'i1k': 'imagenet2012'}
# Other spellings of the pre-training names (summaries, config args).
PRETRAIN_ALIASES = {'jft300m': 'jft', 'jft-300m': 'jft', 'imagenet21k': 'i21k',
                    'imagenet-21k': 'i21k', 'in21k': 'i21k',
                    'imagenet2012': 'i1k', 'imagenet': 'i1k',
                    'imagenet-1k': 'i1k', 'in1k': 'i1k'}
PRETRAIN_EPOCHS = {'jft': 7.0, 'i21k': 90.0, 'i1k': 300.0}


def pretrain_images(data: str) -> int:
  """Train images of pre-training data `data` ('jft', 'i21k', 'i1k')."""
  return registry.get(PRETRAIN_DATA[data]).num_train_examples

# --------------------------------------------------------------------------
# Table 1: model variants (params in millions, as printed).

TABLE1 = {
    'ViT-Base': {'layers': 12, 'hidden': 768, 'mlp': 3072, 'heads': 12,
                 'params_m': 86},
    'ViT-Large': {'layers': 24, 'hidden': 1024, 'mlp': 4096, 'heads': 16,
                  'params_m': 307},
    'ViT-Huge': {'layers': 32, 'hidden': 1280, 'mlp': 5120, 'heads': 16,
                 'params_m': 632},
}

# Exact counts at 224 px, 1000 classes, class-token head, no pre-logits (the
# public reference checkpoints).
TABLE1_PARAMS = {
    'ViT-Ti/16': 5_717_416, 'ViT-S/16': 22_050_664, 'ViT-S/32': 22_878_952,
    'ViT-B/8': 86_576_872, 'ViT-B/16': 86_567_656, 'ViT-B/32': 88_224_232,
    'ViT-L/16': 304_326_632, 'ViT-L/32': 306_535_400,
    'ViT-H/14': 632_045_800, 'R50+ViT-B/16': 98_659_112,
    'R50+ViT-L/32': 328_994_856,
}

# --------------------------------------------------------------------------
# Table 2: comparison to the state of the art (fine-tuned; mean of 3 runs).
# 'core_days': TPUv3-core-days of pre-training (2.5k -> 2500).

TABLE2 = {
    'ViT-H/14 (JFT)': {
        'imagenet2012': 88.55, 'imagenet2012_real': 90.72, 'cifar10': 99.50,
        'cifar100': 94.55, 'oxford_iiit_pet': 97.56,
        'oxford_flowers102': 99.68, 'vtab': 77.63, 'core_days': 2500},
    'ViT-L/16 (JFT)': {
        'imagenet2012': 87.76, 'imagenet2012_real': 90.54, 'cifar10': 99.42,
        'cifar100': 93.90, 'oxford_iiit_pet': 97.32,
        'oxford_flowers102': 99.74, 'vtab': 76.28, 'core_days': 680},
    'ViT-L/16 (I21k)': {
        'imagenet2012': 85.30, 'imagenet2012_real': 88.62, 'cifar10': 99.15,
        'cifar100': 93.25, 'oxford_iiit_pet': 94.67,
        'oxford_flowers102': 99.61, 'vtab': 72.72, 'core_days': 230},
    'BiT-L (R152x4)': {
        'imagenet2012': 87.54, 'imagenet2012_real': 90.54, 'cifar10': 99.37,
        'cifar100': 93.51, 'oxford_iiit_pet': 96.62,
        'oxford_flowers102': 99.63, 'vtab': 76.29, 'core_days': 9900},
    'Noisy Student (EffNet-L2)': {
        'imagenet2012': 88.5,  # Printed "88.4/88.5"; we keep 88.5.
        'imagenet2012_real': 90.55, 'cifar10': None, 'cifar100': None,
        'oxford_iiit_pet': None, 'oxford_flowers102': None, 'vtab': None,
        'core_days': 12300},
}

# The pre-training behind each ViT column of Table 2 (the baselines are not
# in the zoo). Epochs: the longest schedule of Tables 3 and 6 for that model
# and data (ViT-L/16 on ImageNet-21k: 30 or 90, Table 3; we take 90).
TABLE2_PRETRAIN = {
    'ViT-H/14 (JFT)': {'model': 'ViT-H/14', 'pretrain': 'jft', 'epochs': 14},
    'ViT-L/16 (JFT)': {'model': 'ViT-L/16', 'pretrain': 'jft', 'epochs': 14},
    'ViT-L/16 (I21k)': {'model': 'ViT-L/16', 'pretrain': 'i21k', 'epochs': 90},
}

# --------------------------------------------------------------------------
# Table 3: pre-training hyperparameters. All rows: batch 4096, 10k warm-up
# steps, resolution 224, Adam (0.9, 0.999); ImageNet(-21k) rows clip at
# global norm 1.

TABLE3 = [
    # models, dataset, epochs, optimizer, base LR, decay, weight decay, dropout
    (('ViT-B/16', 'ViT-B/32'), 'jft', (7,), 'adam', 8e-4, 'linear', 0.1, 0.0),
    (('ViT-L/32',), 'jft', (7,), 'adam', 6e-4, 'linear', 0.1, 0.0),
    (('ViT-L/16',), 'jft', (7, 14), 'adam', 4e-4, 'linear', 0.1, 0.0),
    (('ViT-H/14',), 'jft', (14,), 'adam', 3e-4, 'linear', 0.1, 0.0),
    (('BiT-R50x1', 'BiT-R50x2'), 'jft', (7,), 'adam', 1e-3, 'linear', 0.1,
     0.0),
    (('BiT-R101x1',), 'jft', (7,), 'adam', 8e-4, 'linear', 0.1, 0.0),
    (('BiT-R152x1', 'BiT-R152x2'), 'jft', (7,), 'adam', 6e-4, 'linear', 0.1,
     0.0),
    (('R50+ViT-B/16', 'R50+ViT-B/32'), 'jft', (7,), 'adam', 8e-4, 'linear',
     0.1, 0.0),
    (('R50+ViT-L/32',), 'jft', (7,), 'adam', 2e-4, 'linear', 0.1, 0.0),
    (('R50+ViT-L/16',), 'jft', (7, 14), 'adam', 4e-4, 'linear', 0.1, 0.0),
    (('ViT-B/16', 'ViT-B/32'), 'i21k', (90,), 'adam', 1e-3, 'linear', 0.03,
     0.1),
    (('ViT-L/16', 'ViT-L/32'), 'i21k', (30, 90), 'adam', 1e-3, 'linear', 0.03,
     0.1),
    (('ViT-*',), 'i1k', (300,), 'adam', 3e-3, 'cosine', 0.3, 0.1),
]
TABLE3_COMMON = {'batch_size': 4096, 'warmup_steps': 10_000,
                 'image_size': 224, 'adam_b1': 0.9, 'adam_b2': 0.999,
                 'imagenet_grad_clip_norm': 1.0}  # i21k and i1k rows.


def table3_row(model: str, data: str) -> Optional[Tuple]:
  """(epochs options, LR, decay, weight decay, dropout) of the Table 3 row
  for `model` on `data`, or None when the paper has no such row."""
  for models_, dataset, epochs, _, lr, decay, wd, dropout in TABLE3:
    if dataset == data and any(fnmatch.fnmatch(model, m) for m in models_):
      return epochs, lr, decay, wd, dropout
  if model == 'BiT-R200x3' and data == 'jft':  # Table 6 only: R152's row.
    return (14,), 6e-4, 'linear', 0.1, 0.0
  return None


def default_epochs(data: str, model: str = '') -> float:
  """The longest Table 3 schedule for `model` on `data` (the one Table 2
  reports), else the data's usual one; 0 for data outside Table 3."""
  row = table3_row(model, data)
  if row:
    return float(max(row[0]))
  return PRETRAIN_EPOCHS.get(data, 0.0)

# --------------------------------------------------------------------------
# Table 4: fine-tuning hyperparameters. `dev_percent`: share of the train
# split held out as the dev split of the LR sweep.

TABLE4 = {
    'imagenet2012': {'steps': 20_000, 'lr_sweep': (0.003, 0.01, 0.03, 0.06),
                     'dev_percent': 1},
    'cifar100': {'steps': 10_000, 'lr_sweep': (0.001, 0.003, 0.01, 0.03),
                 'dev_percent': 2},
    'cifar10': {'steps': 10_000, 'lr_sweep': (0.001, 0.003, 0.01, 0.03),
                'dev_percent': 2},
    'oxford_iiit_pet': {'steps': 500, 'lr_sweep': (0.001, 0.003, 0.01, 0.03),
                        'dev_percent': 10},
    'oxford_flowers102': {'steps': 500,
                          'lr_sweep': (0.001, 0.003, 0.01, 0.03),
                          'dev_percent': 10},
    'vtab': {'steps': 2_500, 'lr_sweep': (0.01,), 'dev_percent': None},
}
TABLE4_COMMON = {'optimizer': 'sgd', 'momentum': 0.9, 'decay': 'cosine',
                 'batch_size': 512, 'weight_decay': 0.0,
                 'grad_clip_norm': 1.0, 'image_size': 384}


def transfer_protocol(task: str, model: str = '',
                      table2: bool = False) -> Optional[Dict[str, Any]]:
  """The paper's fine-tuning of `task` (a Table 4 dataset, or a VTAB task
  `vtab/<name>`): {'steps', 'image_size', 'polyak'}; Table 2's ImageNet
  fine-tuning (`table2`) at 512/518 px with Polyak averaging. None for a
  task the paper does not fine-tune on, and for `table2` of a model it
  did not fine-tune so."""
  row = TABLE4.get('vtab' if task.startswith('vtab/') else task)
  if row is None or (table2 and model not in TABLE2_FINETUNE_RES):
    return None  # Not a fine-tuning the paper reports.
  if table2:
    return {'steps': row['steps'], 'image_size': TABLE2_FINETUNE_RES[model],
            'polyak': TABLE2_POLYAK}
  return {'steps': row['steps'], 'image_size': TABLE4_COMMON['image_size'],
          'polyak': None}


# VTAB-1k: 1000 training examples per task, 800 train / 200 val for the sweep.
VTAB_1K = {'train_examples': 1000, 'sweep_train': 800, 'sweep_val': 200}
FEWSHOT_SHOTS = (1, 5, 10, 25)

# --------------------------------------------------------------------------
# Table 6: scaling study, pre-trained on JFT-300M, fine-tuned at 384 px.
# Accuracies in percent; 'exaflops': pre-training compute.

TABLE6 = [
    {'model': 'ViT-B/32', 'epochs': 7, 'exaflops': 55,
     'imagenet2012': 80.73, 'imagenet2012_real': 86.27, 'cifar10': 98.61,
     'cifar100': 90.49, 'oxford_iiit_pet': 93.40, 'oxford_flowers102': 99.27},
    {'model': 'ViT-B/16', 'epochs': 7, 'exaflops': 224,
     'imagenet2012': 84.15, 'imagenet2012_real': 88.85, 'cifar10': 99.00,
     'cifar100': 91.87, 'oxford_iiit_pet': 95.80, 'oxford_flowers102': 99.56},
    {'model': 'ViT-L/32', 'epochs': 7, 'exaflops': 196,
     'imagenet2012': 84.37, 'imagenet2012_real': 88.28, 'cifar10': 99.19,
     'cifar100': 92.52, 'oxford_iiit_pet': 95.83, 'oxford_flowers102': 99.45},
    {'model': 'ViT-L/16', 'epochs': 7, 'exaflops': 783,
     'imagenet2012': 86.30, 'imagenet2012_real': 89.43, 'cifar10': 99.38,
     'cifar100': 93.46, 'oxford_iiit_pet': 96.81, 'oxford_flowers102': 99.66},
    {'model': 'ViT-L/16', 'epochs': 14, 'exaflops': 1567,
     'imagenet2012': 87.12, 'imagenet2012_real': 89.99, 'cifar10': 99.38,
     'cifar100': 94.04, 'oxford_iiit_pet': 97.11, 'oxford_flowers102': 99.56},
    {'model': 'ViT-H/14', 'epochs': 14, 'exaflops': 4262,
     'imagenet2012': 88.08, 'imagenet2012_real': 90.36, 'cifar10': 99.50,
     'cifar100': 94.71, 'oxford_iiit_pet': 97.11, 'oxford_flowers102': 99.71},
    {'model': 'BiT-R50x1', 'epochs': 7, 'exaflops': 50,
     'imagenet2012': 77.54, 'imagenet2012_real': 84.56, 'cifar10': 97.67,
     'cifar100': 86.07, 'oxford_iiit_pet': 91.11, 'oxford_flowers102': 94.26},
    {'model': 'BiT-R50x2', 'epochs': 7, 'exaflops': 199,
     'imagenet2012': 82.12, 'imagenet2012_real': 87.94, 'cifar10': 98.29,
     'cifar100': 89.20, 'oxford_iiit_pet': 93.43, 'oxford_flowers102': 97.02},
    {'model': 'BiT-R101x1', 'epochs': 7, 'exaflops': 96,
     'imagenet2012': 80.67, 'imagenet2012_real': 87.07, 'cifar10': 98.48,
     'cifar100': 89.17, 'oxford_iiit_pet': 94.08, 'oxford_flowers102': 95.95},
    {'model': 'BiT-R152x1', 'epochs': 7, 'exaflops': 141,
     'imagenet2012': 81.88, 'imagenet2012_real': 87.96, 'cifar10': 98.82,
     'cifar100': 90.22, 'oxford_iiit_pet': 94.17, 'oxford_flowers102': 96.94},
    {'model': 'BiT-R152x2', 'epochs': 7, 'exaflops': 563,
     'imagenet2012': 84.97, 'imagenet2012_real': 89.69, 'cifar10': 99.06,
     'cifar100': 92.05, 'oxford_iiit_pet': 95.37, 'oxford_flowers102': 98.62},
    {'model': 'BiT-R152x2', 'epochs': 14, 'exaflops': 1126,
     'imagenet2012': 85.56, 'imagenet2012_real': 89.89, 'cifar10': 99.24,
     'cifar100': 91.92, 'oxford_iiit_pet': 95.75, 'oxford_flowers102': 98.75},
    {'model': 'BiT-R200x3', 'epochs': 14, 'exaflops': 3306,
     'imagenet2012': 87.22, 'imagenet2012_real': 90.15, 'cifar10': 99.34,
     'cifar100': 93.53, 'oxford_iiit_pet': 96.32, 'oxford_flowers102': 99.04},
    {'model': 'R50+ViT-B/32', 'epochs': 7, 'exaflops': 106,
     'imagenet2012': 84.90, 'imagenet2012_real': 89.15, 'cifar10': 99.01,
     'cifar100': 92.24, 'oxford_iiit_pet': 95.75, 'oxford_flowers102': 99.46},
    {'model': 'R50+ViT-B/16', 'epochs': 7, 'exaflops': 274,
     'imagenet2012': 85.58, 'imagenet2012_real': 89.65, 'cifar10': 99.14,
     'cifar100': 92.63, 'oxford_iiit_pet': 96.65, 'oxford_flowers102': 99.40},
    {'model': 'R50+ViT-L/32', 'epochs': 7, 'exaflops': 246,
     'imagenet2012': 85.68, 'imagenet2012_real': 89.04, 'cifar10': 99.24,
     'cifar100': 92.93, 'oxford_iiit_pet': 96.97, 'oxford_flowers102': 99.43},
    {'model': 'R50+ViT-L/16', 'epochs': 7, 'exaflops': 859,
     'imagenet2012': 86.60, 'imagenet2012_real': 89.72, 'cifar10': 99.18,
     'cifar100': 93.64, 'oxford_iiit_pet': 97.03, 'oxford_flowers102': 99.40},
    {'model': 'R50+ViT-L/16', 'epochs': 14, 'exaflops': 1668,
     'imagenet2012': 87.12, 'imagenet2012_real': 89.76, 'cifar10': 99.31,
     'cifar100': 93.89, 'oxford_iiit_pet': 97.36, 'oxford_flowers102': 99.11},
]

# --------------------------------------------------------------------------
# Appendix D.1: ResNets pre-trained with Adam vs SGD (JFT, 7 epochs), then
# fine-tuned. Keys: (model, optimizer).

OPTIMIZER_STUDY_EPOCHS = 7
OPTIMIZER_STUDY = {
    ('BiT-R50x1', 'adam'): {
        'imagenet2012': 77.54, 'cifar10': 97.67, 'cifar100': 86.07,
        'oxford_iiit_pet': 91.11, 'oxford_flowers102': 94.26,
        'average': 89.33},
    ('BiT-R50x1', 'sgd'): {
        'imagenet2012': 78.24, 'cifar10': 97.46, 'cifar100': 85.17,
        'oxford_iiit_pet': 91.00, 'oxford_flowers102': 92.06,
        'average': 88.79},
    ('BiT-R152x2', 'adam'): {
        'imagenet2012': 84.97, 'cifar10': 99.06, 'cifar100': 92.05,
        'oxford_iiit_pet': 95.37, 'oxford_flowers102': 98.62,
        'average': 94.01},
    ('BiT-R152x2', 'sgd'): {
        'imagenet2012': 84.37, 'cifar10': 99.07, 'cifar100': 91.06,
        'oxford_iiit_pet': 94.79, 'oxford_flowers102': 99.32,
        'average': 93.72},
}
