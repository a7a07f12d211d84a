"""Masked patch prediction (MPP) pre-training: the paper's self-supervision
experiment (§4.6, Appendix B.1.2). Labels are never read.

    configs/mpp.py                        # ViT-B/16 on JFT: the paper's row
    configs/mpp.py:data=i21k              # the same recipe on ImageNet-21k
    configs/mpp.py:data=i1k,epochs=300    # ... or ImageNet
    configs/mpp.py:target=downsized       # Appendix B.1.2's alternatives:
    configs/mpp.py:target=pixels          #   4x4 downsized patch, L2 pixels
    configs/mpp.py:data=cpu               # CPU scale, Fashion-MNIST images
    configs/mpp.py:smoke=true             # seconds on a CPU

The paper's row: ViT-B/16, 1M steps (about 14 epochs of JFT-300M) at batch
4096, Adam (0.9, 0.999) LR 2e-4, 10k warm-up steps, cosine decay; 50% of
the patches corrupted (80% `[mask]`, 10% another patch, 10% kept), 3-bit
mean colour of each (512 classes). `data=i21k` / `data=i1k` keep that
recipe and the same number of steps' worth of epochs unless `epochs=` says
otherwise. Weight decay and clipping are not given for MPP; we use the
paper's supervised JFT values (0.1, no clipping) on JFT and clip at 1
elsewhere, as its ImageNet runs do.

data=cpu: the CPU-scale ViT of configs/cpu_reproduce.py (patch 4, width
128, 6 layers) on the 60,000 Fashion-MNIST training images at 28 px, with
that config's supervised optimiser (Adam 1e-3, cosine, weight decay 0.05,
clip 1, batch 128), but warm-up steps/7 (468; the supervised run: 500),
few-shot on mnist5k and
Fashion-MNIST at the end: docs/selfsup.md's evidence. model= and fewshot=
are the paper rows' (refused with data=cpu). Fine-tune the result with
configs/cpu_reproduce.py (init=<this workdir>).

Any dataset of the registry works (`--config.input.data=...`); the train
step reads only the images (`input.data=folder` needs class sub-folders:
one folder of all images is fine).
"""

import math

from vit_jax.configs import common, cpu_reproduce
from vit_jax import paper
from vit_jax.data import registry

# The paper's MPP row (PAPER.md "Self-supervision").
STEPS = 1_000_000
BATCH = 4096
LR = 2e-4
WARMUP = 10_000
DATA = {**paper.PRETRAIN_DATA, 'cpu': 'fashion_mnist'}


def get_config(arg=None):
  args = common.parse_arg(arg, model='ViT-B/16', data='jft', epochs=0.0,
                          target='colour', bits=3, rate=0.5,
                          representation='token', fewshot='', smoke=False)
  if args.data not in DATA:
    raise ValueError(f'data={args.data!r}: expected one of {sorted(DATA)}')
  c = common.base()
  c.objective = 'mpp'
  c.mpp.update(dict(target=args.target, bits=args.bits, rate=args.rate,
                    representation=args.representation))
  c.seed = 0
  if args.data == 'cpu':
    if args.model != 'ViT-B/16' or args.fewshot:
      raise ValueError(
          f'data=cpu trains the CPU reproduction\'s ViT with its own few-shot '
          f'sets: model={args.model!r} / fewshot={args.fewshot!r} would be '
          'ignored; drop them, or set --config.model.* and '
          '--config.evals.fewshot.* on the command line')
    c.model.update(cpu_reproduce.VIT)
    c.input.data = 'fashion_mnist'
    c.input.prepare = True
    c.input.image_size = 28
    c.input.pp_train = 'decode|resize(28)|flip_lr|value_range(-1,1)'
    c.input.pp_eval = 'decode|resize(28)|value_range(-1,1)'
    c.input.num_train_examples = registry.get('fashion_mnist').num_train_examples
    c.input.batch_size = 128
    c.input.eval_batch_size = 500
    c.total_epochs = args.epochs or 7.0
    steps = math.ceil(c.total_epochs * c.input.num_train_examples / 128)
    c.optim.update(dict(name='adam', lr=1e-3, warmup_steps=min(500, steps //
                                                               7),
                        decay='cosine', weight_decay=0.05,
                        grad_clip_norm=1.0))
    c.log_every = 100
    c.checkpoint_every = 500
    c.eval_every = 469  # About once per epoch.
    c.evals.fewshot = cpu_reproduce.fewshot()
  else:
    c.model.name = args.model
    c.input.data = DATA[args.data]
    c.input.num_train_examples = paper.pretrain_images(args.data)
    c.input.batch_size = BATCH
    c.input.image_size = paper.TABLE3_COMMON['image_size']
    c.input.pp_train = 'inception'
    c.input.pp_eval = 'eval'
    if args.epochs:
      c.total_epochs = args.epochs
    else:
      c.total_steps = STEPS
    c.optim.update(dict(name='adam', lr=LR, warmup_steps=WARMUP,
                        decay='cosine', weight_decay=0.1))
    if args.data != 'jft':
      c.optim.grad_clip_norm = 1.0
    c.checkpoint_every = 2000
    c.eval_every = 10_000
    if args.fewshot:  # E.g. fewshot=imagenet2012+cifar100
      c.evals.fewshot = common.fewshot(args.fewshot.split('+'),
                                       paper.FEWSHOT_SHOTS, every=10_000)
  c.report = dict(model='ViT-cpu' if args.data == 'cpu' else args.model,
                  pretrain=args.data, pretrain_optimizer='adam',
                  task=f'mpp_{args.target}')
  if args.smoke:
    common.apply_smoke(c)
    if args.data == 'cpu':  # The explicit 28-px ops, at the smoke size.
      size = c.input.image_size
      c.input.pp_train = f'decode|resize({size})|flip_lr|value_range(-1,1)'
      c.input.pp_eval = f'decode|resize({size})|value_range(-1,1)'
      c.input.eval_split = 'test[:200]'
    if 'fewshot' in c.evals:
      c.evals.fewshot.update(dict(datasets=('digits',), shots=(1, 5),
                                  seeds=2, pool_per_class=5, every=0))
  return c
