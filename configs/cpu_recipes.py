"""AugReg-style ingredients on the CPU-scale ViT (docs/recipes.md).

The reproduce.md pre-training run (ViT, patch 4, width 128, 6 layers, on
Fashion-MNIST at 28 px, 7 epochs, Adam) with training ingredients added,
one at a time or together, at the same budget:

    python -m vit_jax.main --config=configs/cpu_recipes.py:ingredients=none \
        --workdir=/tmp/recipes/none
    python -m vit_jax.main \
        --config=configs/cpu_recipes.py:ingredients=randaug+mixup+reg+ema \
        --workdir=/tmp/recipes/all

Ingredients ('+'-joined; strengths: AugReg's "light2" augmentation and its
regularisation setting, Steiner et al. 2021, Sec. 3.3 / big_vision's
vit_i1k.py; EMA sized for a 3,282-step run):
  randaug   randaug(2, 10) after the flip
  mixup     mixup, alpha 0.2
  cutmix    CutMix, alpha 1.0 (DeiT's; not an AugReg ingredient)
  dropout   dropout 0.1 (AugReg's "reg" with sd)
  sd        stochastic depth 0.1, linear in depth
  reg       dropout + sd
  ema       Polyak averaging, decay 0.999 (with the default warm-up);
            evaluates both: the averages as eval_accuracy, raw as
            raw/eval_accuracy
  none      the baseline (= cpu_reproduce.py:step=pretrain)
smoke=true shrinks it to seconds (tests run it).
"""

from vit_jax.configs import common
from vit_jax.configs import cpu_reproduce

INGREDIENTS = ('randaug', 'mixup', 'cutmix', 'dropout', 'sd', 'reg', 'ema',
               'none')
RANDAUG = 'randaug(2, 10)'
MIXUP, CUTMIX = 0.2, 1.0
DROPOUT = STOCHASTIC_DEPTH = 0.1
EMA_DECAY = 0.999


def parse(ingredients: str) -> tuple:
  """'randaug+reg' -> ('randaug', 'dropout', 'sd'); refuses unknown names."""
  names = [n for n in ingredients.split('+') if n]
  bad = [n for n in names if n not in INGREDIENTS]
  if bad or not names:
    raise ValueError(f'ingredients={ingredients!r}: expected names from '
                     f'{", ".join(INGREDIENTS)} joined by +, e.g. '
                     'randaug+mixup+reg+ema')
  out = []
  for n in names:
    for m in (('dropout', 'sd') if n == 'reg' else () if n == 'none'
              else (n,)):
      if m not in out:
        out.append(m)
  return tuple(out)


def get_config(arg=None):
  args = common.parse_arg(arg, ingredients='none', epochs=7.0, smoke=False)
  chosen = parse(args.ingredients)
  c = cpu_reproduce.get_config(
      f'step=pretrain,epochs={args.epochs},smoke={args.smoke}')
  if 'randaug' in chosen:
    c.input.pp_train = c.input.pp_train.replace(
        '|flip_lr', f'|flip_lr|{RANDAUG}')
    assert RANDAUG in c.input.pp_train, c.input.pp_train
  if 'mixup' in chosen:
    c.input.mixup = MIXUP
  if 'cutmix' in chosen:
    c.input.cutmix = CUTMIX
  if 'dropout' in chosen:
    c.model.dropout_rate = DROPOUT
  if 'sd' in chosen:
    c.model.stochastic_depth = STOCHASTIC_DEPTH
  if 'ema' in chosen:
    c.optim.ema_decay = EMA_DECAY
    c.eval_ema = 'both'
  c.report.task = 'recipes:' + ('+'.join(chosen) or 'none')
  return c
