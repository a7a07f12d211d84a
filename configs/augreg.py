"""AugReg pre-training recipes: "How to train your ViT? Data, Augmentation,
and Regularization in Vision Transformers" (Steiner et al. 2021,
arXiv:2106.10270), for ViT-Ti/S/B/L on ImageNet-1k and ImageNet-21k.

    configs/augreg.py:variant=B/16,data=i21k
    configs/augreg.py:variant=S/16,data=i1k
    configs/augreg.py:variant=L/16,data=i21k,aug=medium2   # another setting
    configs/augreg.py:variant=B/16,data=i21k,smoke=true     # CPU, seconds

Where each number comes from:
  Shared (the paper's Sec. 3, and big_vision's configs/vit_i1k.py and
  vit_i21k.py, its public configs): 300 epochs, batch 4096, 224 px, Adam
  (0.9, 0.999) with a bfloat16 first moment, LR 1e-3, 10k warm-up steps
  then cosine decay, global-norm clipping at 1, inception crop + flip, then
  RandAugment; evaluation resize 256 (area, big_vision's resize_small
  default) + central crop 224.
  Weight decay: the paper's values (0.1 or 0.03) are multiplied by the
  learning rate, our optim.weight_decay's convention (optax.adamw);
  big_vision writes the product (wd=0.0001 for 0.1 at LR 1e-3).
  AUG: the augmentation settings of both big_vision configs (the paper's
  Table 1 / Fig. 4 names): RandAugment (layers, magnitude) and mixup alpha.
  I21K: the paper's recommended ImageNet-21k checkpoints per variant, as
  big_vision/models/vit.py names them ("howto-i21k-*": aug, weight decay,
  dropout, stochastic depth); sigmoid cross-entropy with head bias -10
  (big_vision's vit_i21k.py).
  I1K: big_vision's configs/vit_i1k.py as of commit 5f95305c: its
  per-variant augmentation (its comment: a good average between 30 and 300
  epochs), weight decay 0.1 (its wd=0.0001), no dropout or stochastic
  depth, a pre-logits layer as wide as the model (rep_size=True), and
  sigmoid cross-entropy with head bias -6.9 (its loss='sigmoid_xent',
  init_head_bias=-6.9: about -log(1000), a prior of 1/1000 per class).
  Earlier revisions of that file (e.g. 21bd6ebe) had softmax cross-entropy
  and S/32 at light2; `aug=light2 --config.loss=softmax
  --config.model.head_bias_init=0` trains that one.
One difference: big_vision's vit_i1k.py trains on train[:99%] (the rest is
its minival) and vit_i21k.py on full[51200:]; this trains on all of
`train`. For their ImageNet-1k split: `--config.input.train_split=train_dev
--config.input.num_train_examples=1268355` (an epoch is theirs too).
`python -m vit_jax.accounting --config=configs/augreg.py:...` estimates a
row's cost (docs/recipes.md lists them).
"""

from vit_jax.configs import common
from vit_jax import models, paper

# name: (RandAugment (layers, magnitude) or None, mixup alpha).
AUG = {
    'none': (None, 0.0),
    'light1': ((2, 0), 0.0),  # randaug(2, 0) still applies its operations.
    'light2': ((2, 10), 0.2),
    'medium1': ((2, 15), 0.2),
    'medium2': ((2, 15), 0.5),
    'strong1': ((2, 20), 0.5),
    'strong2': ((2, 20), 0.8),
}
# variant: (aug, weight decay, dropout, stochastic depth).
I21K = {
    'Ti/16': ('none', 0.03, 0.0, 0.0),
    'S/32': ('none', 0.1, 0.0, 0.0),
    'S/16': ('light1', 0.03, 0.0, 0.0),
    'B/32': ('light1', 0.1, 0.0, 0.0),
    'B/16': ('medium1', 0.1, 0.0, 0.0),
    'L/16': ('strong1', 0.1, 0.0, 0.0),
}
I1K = {
    'Ti/16': ('light1', 0.1, 0.0, 0.0),
    'S/32': ('medium1', 0.1, 0.0, 0.0),
    'S/16': ('medium2', 0.1, 0.0, 0.0),
    'B/32': ('medium2', 0.1, 0.0, 0.0),
    'B/16': ('medium2', 0.1, 0.0, 0.0),
    'L/16': ('medium2', 0.1, 0.0, 0.0),
}
# data: (loss, head bias init) of big_vision's vit_i1k.py / vit_i21k.py.
LOSS = {'i1k': ('sigmoid', -6.9), 'i21k': ('sigmoid', -10.0)}
RECIPES = {'i1k': I1K, 'i21k': I21K}
EPOCHS, BATCH, LR, WARMUP = 300.0, 4096, 1e-3, 10_000


def pp_train(aug: str, size: int = 224) -> str:
  randaug, _ = AUG[aug]
  ra = f'|randaug({randaug[0]}, {randaug[1]})' if randaug else ''
  return f'decode|inception_crop({size})|flip_lr{ra}|value_range(-1,1)'


def pp_eval(size: int = 224) -> str:
  """big_vision's: resize the short side to 256/224 of the crop with its
  `resize_small`'s default area method (anti-aliased), crop."""
  return (f'decode|resize_small({round(size * 256 / 224)}, method="area")|'
          f'central_crop({size})|value_range(-1,1)')


def get_config(arg=None):
  args = common.parse_arg(arg, variant='B/16', data='i21k', aug='',
                          epochs=0.0, smoke=False)
  if args.data not in RECIPES:
    raise ValueError(f'data={args.data!r}: expected i1k or i21k')
  recipes = RECIPES[args.data]
  if args.variant not in recipes:
    raise ValueError(f'variant={args.variant!r}: expected one of '
                     f'{", ".join(recipes)}')
  if args.aug and args.aug not in AUG:
    raise ValueError(f'aug={args.aug!r}: expected one of {", ".join(AUG)}')
  aug, wd, dropout, sd = recipes[args.variant]
  aug = args.aug or aug
  c = common.base()
  c.model.name = 'ViT-' + args.variant
  c.input.data = paper.PRETRAIN_DATA[args.data]
  c.input.num_train_examples = paper.pretrain_images(args.data)
  c.input.batch_size = BATCH
  c.input.image_size = 224
  c.input.pp_train = pp_train(aug)
  c.input.pp_eval = pp_eval()
  c.input.mixup = AUG[aug][1] or None
  c.total_epochs = args.epochs or EPOCHS
  c.optim.update(dict(name='adam', lr=LR, warmup_steps=WARMUP,
                      decay='cosine', weight_decay=wd, grad_clip_norm=1.0,
                      mu_dtype='bfloat16'))
  if dropout:
    c.model.dropout_rate = dropout
  if sd:
    c.model.stochastic_depth = sd
  c.loss, c.model.head_bias_init = LOSS[args.data]
  if args.data == 'i1k':
    c.model.representation_size = models.spec(c.model.name)['hidden_size']
  c.checkpoint_every = 2000
  c.report = dict(model=c.model.name, pretrain=args.data,
                  pretrain_epochs=c.total_epochs, pretrain_optimizer='adam',
                  task='pretrain', recipe=f'augreg:{aug}')
  if args.smoke:
    common.apply_smoke(c)
    c.input.pp_train = pp_train(aug, c.input.image_size)
    c.input.pp_eval = pp_eval(c.input.image_size)
  return c
