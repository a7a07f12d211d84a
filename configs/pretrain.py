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

from configs import common

# Base learning rates on JFT-300M, by model (Table 3).
JFT_LR = {
    'ViT-B/16': 8e-4, 'ViT-B/32': 8e-4, 'ViT-L/32': 6e-4, 'ViT-L/16': 4e-4,
    'ViT-H/14': 3e-4, 'BiT-R50x1': 1e-3, 'BiT-R50x2': 1e-3,
    'BiT-R101x1': 8e-4, 'BiT-R152x1': 6e-4, 'BiT-R152x2': 6e-4,
    # Table 6 has R200x3 (14 epochs) but Table 3 no LR for it: R152's.
    'BiT-R200x3': 6e-4,
    'R50+ViT-B/16': 8e-4, 'R50+ViT-B/32': 8e-4, 'R50+ViT-L/32': 2e-4,
    'R50+ViT-L/16': 4e-4,
}
# (learning rate or None for JFT_LR, decay, weight decay, dropout) per data.
RECIPE = {
    'jft': (None, 'linear', 0.1, 0.0),
    'i21k': (1e-3, 'linear', 0.03, 0.1),
    'i1k': (3e-3, 'cosine', 0.3, 0.1),
}
DATA = {
    # data: (dataset, classes, train images, default epochs)
    'jft': ('jft', 18_291, 303_000_000, 7.0),
    'i21k': ('imagenet21k', 21_843, 14_197_122, 90.0),
    'i1k': ('imagenet2012', 1000, 1_281_167, 300.0),
}
BATCH = 4096


def default_epochs(data: str) -> float:
  """Table 3's schedule for `data` (0 for data outside Table 3)."""
  return DATA[data][3] if data in DATA else 0.0


def get_config(arg=None):
  args = common.parse_arg(arg, model='ViT-B/16', data='i21k', epochs=0.0,
                          opt='adam', smoke=False)
  if args.data not in DATA:
    raise ValueError(f'data={args.data!r}: expected one of {sorted(DATA)}')
  if args.model not in JFT_LR:
    raise ValueError(f'model={args.model!r} has no Table 3 row; one of '
                     f'{sorted(JFT_LR)}')
  if args.opt not in ('adam', 'sgd'):
    raise ValueError(f'opt={args.opt!r}: expected adam or sgd')
  if args.opt == 'sgd' and not args.model.startswith('BiT'):
    raise ValueError('opt=sgd is the ResNet optimizer study (Appendix D.1): '
                     'use a BiT-R* model')
  dataset, classes, examples, epochs = DATA[args.data]
  c = common.base()
  c.model.name = args.model
  c.num_classes = classes
  c.input.data = dataset
  c.input.num_train_examples = examples
  c.input.batch_size = BATCH
  c.input.image_size = 224
  c.total_epochs = args.epochs or epochs
  lr, decay, wd, dropout = RECIPE[args.data]
  c.optim.name = 'adam'
  c.optim.lr = lr or JFT_LR[args.model]
  c.optim.warmup_steps = 10_000
  c.optim.decay = decay
  c.optim.weight_decay = wd
  if args.data != 'jft':
    c.optim.grad_clip_norm = 1.0  # ImageNet runs clip at global norm 1.
  if dropout and not args.model.startswith('BiT'):
    c.model.dropout_rate = dropout
  if args.data == 'i21k':
    # The reference i21k recipe (public issue threads): a 768-wide pre-logits
    # layer (ViTs), head bias -10, sigmoid cross-entropy, linear decay to
    # 1e-5.
    if not args.model.startswith('BiT'):
      c.model.representation_size = 768
    c.model.head_bias_init = -10.0
    c.loss = 'sigmoid'
    c.optim.linear_end = 1e-5
  if args.opt == 'sgd':
    c.optim.name = 'sgd'
    c.optim.lr = 0.03 * BATCH / 256
    c.optim.momentum = 0.9
    c.optim.weight_decay = 1e-4
  c.checkpoint_every = 2000
  c.report = dict(model=args.model, pretrain=args.data,
                  pretrain_epochs=c.total_epochs, pretrain_optimizer=args.opt,
                  task='pretrain')
  if args.smoke:
    common.apply_smoke(c)
  return c
