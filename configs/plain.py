"""Plain ViT baselines on ImageNet-1k: "Better plain ViT baselines for
ImageNet-1k" (Beyer, Zhai, Kolesnikov 2022, arXiv:2205.01580), big_vision's
configs/vit_s16_i1k.py.

    configs/plain.py                        # ViT-S/16, 90 epochs (76.5%)
    configs/plain.py:epochs=300             # the report's longer runs
    configs/plain.py:variant=B/16           # another width, same recipe
    configs/plain.py:smoke=true             # CPU, seconds

The recipe (big_vision's file as of commit 642c086e): ViT-S/16 with fixed
2-D sine-cosine position embeddings (`posemb='sincos2d'`), global average
pooling instead of a class token (`classifier='gap'`), a pre-logits layer
as wide as the model (its `rep_size=True`), a zero-initialised head;
softmax cross-entropy; batch 1024, 90 epochs; Adam (0.9, 0.999) with a
bfloat16 first moment, LR 1e-3, 10k warm-up steps then cosine decay,
global-norm clipping at 1, weight decay 0.1 in our convention (multiplied by
the LR; big_vision writes the product, wd=0.0001); inception crop 224 +
flip + RandAugment(2, 10), mixup 0.2 (AugReg's `light2`); evaluation
resize_small(256) (area) + central crop 224. Its checkpoints (`i1k-s16-90ep`
and others in big_vision's models/vit.py) load into this model
(docs/checkpoints.md).

One difference: big_vision trains on train[:99%] and keeps the rest as a
minival split; this trains on all of `train` (as configs/augreg.py does),
with `--config.input.train_split=train_dev` for theirs (set
`--config.input.num_train_examples=1268355` with it, so that an epoch is
theirs too).
"""

from vit_jax import models, paper
from vit_jax.configs import augreg, common

EPOCHS, BATCH, AUG = 90.0, 1024, 'light2'


def get_config(arg=None):
  args = common.parse_arg(arg, variant='S/16', epochs=EPOCHS, smoke=False)
  name = 'ViT-' + args.variant
  if name not in models.names():
    raise ValueError(f'variant={args.variant!r}: expected a ViT of the zoo, '
                     'e.g. S/16 or B/16')
  c = common.base()
  c.model.name = name
  c.model.posemb = 'sincos2d'
  c.model.classifier = 'gap'
  c.model.representation_size = models.spec(name)['hidden_size']
  c.input.data = paper.PRETRAIN_DATA['i1k']
  c.input.num_train_examples = paper.pretrain_images('i1k')
  c.input.batch_size = BATCH
  c.input.image_size = 224
  c.input.pp_train = augreg.pp_train(AUG)
  c.input.pp_eval = augreg.pp_eval()
  c.input.mixup = augreg.AUG[AUG][1]
  c.total_epochs = args.epochs
  c.loss = 'softmax'
  c.optim.update(dict(name='adam', lr=augreg.LR, warmup_steps=augreg.WARMUP,
                      decay='cosine', weight_decay=0.1, grad_clip_norm=1.0,
                      mu_dtype='bfloat16'))
  c.checkpoint_every = 1000
  c.report = dict(model=name, pretrain='i1k', pretrain_epochs=args.epochs,
                  pretrain_optimizer='adam', task='pretrain',
                  recipe='plain-vit')
  if args.smoke:
    common.apply_smoke(c)
    c.input.pp_train = augreg.pp_train(AUG, c.input.image_size)
    c.input.pp_eval = augreg.pp_eval(c.input.image_size)
  return c
