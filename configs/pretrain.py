"""Pre-training rows of the paper's Table 3 (and the Table 6 / optimizer-study
pre-training runs).

    configs/pretrain.py:model=ViT-B/16,data=i21k
    configs/pretrain.py:model=ViT-L/16,data=jft,epochs=14
    configs/pretrain.py:model=BiT-R50x1,data=jft,opt=sgd   # Appendix D.1
    configs/pretrain.py:model=R50+ViT-B/16,data=jft,smoke=true  # CPU, seconds

data: jft (JFT-300M-style TFRecords), i21k (ImageNet-21k), i1k (ImageNet).
All rows: batch 4096, 10k warm-up steps, resolution 224, Adam (0.9, 0.999).
opt=sgd (ResNets only) uses BiT's upstream recipe instead: SGD momentum 0.9,
LR 0.03 per 256 images, weight decay 1e-4 (Kolesnikov et al. 2020; the
paper reports the study, not these settings).
"""

from vit_jax.configs import common
from vit_jax import models, paper

# Models with a JFT-300M row in Table 3 (or, for BiT-R200x3, in Table 6).
MODELS = tuple(sorted({m for row in paper.TABLE3 if row[1] == 'jft'
                       for m in row[0]} | {'BiT-R200x3'}))
# Pre-training data by short name (classes and sizes: the data registry).
DATA = paper.PRETRAIN_DATA
BATCH = paper.TABLE3_COMMON['batch_size']


def get_config(arg=None):
  args = common.parse_arg(arg, model='ViT-B/16', data='i21k', epochs=0.0,
                          opt='adam', fewshot='', smoke=False)
  if args.data not in DATA:
    raise ValueError(f'data={args.data!r}: expected one of {sorted(DATA)}')
  if args.model not in MODELS and not (
      args.model in models.names() and paper.table3_row(args.model,
                                                         args.data)):
    raise ValueError(f'model={args.model!r} has no Table 3 row; one of '
                     f'{", ".join(MODELS)}, or for data=i1k any ViT of the '
                     'zoo (Table 3\'s ViT-* row)')
  if args.opt not in ('adam', 'sgd'):
    raise ValueError(f'opt={args.opt!r}: expected adam or sgd')
  if args.opt == 'sgd' and not args.model.startswith('BiT'):
    raise ValueError('opt=sgd is the ResNet optimizer study (Appendix D.1): '
                     'use a BiT-R* model')
  row = paper.table3_row(args.model, args.data)
  if row is None:  # E.g. BiT on ImageNet-21k: that data's ViT recipe.
    vit_row = paper.table3_row('ViT-B/16', args.data)
    row = ((paper.PRETRAIN_EPOCHS[args.data],), *vit_row[1:])
  epoch_options, lr, decay, wd, dropout = row
  c = common.base()
  c.model.name = args.model
  c.input.data = DATA[args.data]
  c.input.num_train_examples = paper.pretrain_images(args.data)
  c.input.batch_size = BATCH
  c.input.image_size = paper.TABLE3_COMMON['image_size']
  c.input.pp_train = 'inception'  # Inception crop + flip at 224.
  c.input.pp_eval = 'eval'
  c.total_epochs = args.epochs or float(max(epoch_options))
  c.optim.name = 'adam'
  c.optim.lr = lr
  c.optim.warmup_steps = paper.TABLE3_COMMON['warmup_steps']
  c.optim.decay = decay
  c.optim.weight_decay = wd
  if args.data != 'jft':
    c.optim.grad_clip_norm = 1.0  # ImageNet runs clip at global norm 1.
  if not args.model.startswith('BiT'):
    # The pre-training head (Sec. 3.1): a tanh "pre-logits" layer of width D
    # before the classifier, on every pre-training dataset (fine-tuning
    # drops it). 768 for ViT-B, as the reference i21k recipe's; 1024 / 1280
    # for ViT-L / ViT-H, as the public i21k checkpoints'.
    c.model.representation_size = models.spec(args.model)['hidden_size']
    if dropout:
      c.model.dropout_rate = dropout
  if args.data in ('i21k', 'jft'):
    # The reference pre-training loss on both multi-label datasets (public
    # issue threads: vision_transformer #34, big_transfer #26): sigmoid
    # cross-entropy over every label of the image (JFT's TFRecords give
    # multi-hot labels, `multi_label` in the registry), head bias -10.
    c.model.head_bias_init = -10.0
    c.loss = 'sigmoid'
  if args.data == 'i21k':
    c.optim.linear_end = 1e-5  # The reference i21k recipe's linear decay end.
  if args.opt == 'sgd':
    c.optim.name = 'sgd'
    c.optim.lr = 0.03 * BATCH / 256
    c.optim.momentum = 0.9
    c.optim.weight_decay = 1e-4
  c.checkpoint_every = 2000
  c.report = dict(model=args.model, pretrain=args.data,
                  pretrain_epochs=c.total_epochs, pretrain_optimizer=args.opt,
                  task='pretrain')
  if args.fewshot:  # E.g. fewshot=imagenet2012+cifar100+oxford_iiit_pet
    c.evals.fewshot = common.fewshot(args.fewshot.split('+'),
                                     paper.FEWSHOT_SHOTS, every=10_000)
  if args.smoke:
    common.apply_smoke(c)
    if 'fewshot' in c.evals:
      c.evals.fewshot.update(dict(datasets=('digits',), shots=(1, 5),
                                  pool_per_class=10, every=0))
  return c
