"""Pre-training rows of the paper's Table 3.

    configs/pretrain.py:model=ViT-B/16,data=i21k
    configs/pretrain.py:model=ViT-L/16,data=jft,epochs=14

data: jft (JFT-300M-style TFRecords), i21k (ImageNet-21k), i1k (ImageNet).
All rows: batch 4096, 10k warm-up steps, resolution 224, Adam (0.9, 0.999).
"""

from configs import common

# Base learning rates on JFT-300M, by model (Table 3).
JFT_LR = {
    'ViT-B/16': 8e-4, 'ViT-B/32': 8e-4, 'ViT-L/32': 6e-4, 'ViT-L/16': 4e-4,
    'ViT-H/14': 3e-4, 'BiT-R50x1': 1e-3, 'BiT-R50x2': 1e-3,
    'BiT-R101x1': 8e-4, 'BiT-R152x1': 6e-4, 'BiT-R152x2': 6e-4,
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


def get_config(arg=None):
  args = common.parse_arg(arg, model='ViT-B/16', data='i21k', epochs=0.0)
  if args.data not in DATA:
    raise ValueError(f'data={args.data!r}: expected one of {sorted(DATA)}')
  if args.model not in JFT_LR:
    raise ValueError(f'model={args.model!r} has no Table 3 row; one of '
                     f'{sorted(JFT_LR)}')
  dataset, classes, examples, epochs = DATA[args.data]
  c = common.base()
  c.model.name = args.model
  c.num_classes = classes
  c.input.data = dataset
  c.input.num_train_examples = examples
  c.input.batch_size = 4096
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
    # layer, head bias -10, sigmoid cross-entropy, linear decay to 1e-5.
    c.model.representation_size = 768
    c.model.head_bias_init = -10.0
    c.loss = 'sigmoid'
    c.optim.linear_end = 1e-5
  return c
