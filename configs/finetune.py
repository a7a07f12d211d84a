"""Fine-tuning rows of the paper's Table 4 (Tables 2 and 6 are made of them).

    configs/finetune.py:model=ViT-B/16,data=cifar10,lr=0.01,init=WORKDIR_OR_NPZ
    configs/finetune.py:model=ViT-L/16,data=imagenet2012,lr=0.03,init=...,pretrain=i21k
    configs/finetune.py:...,sweep=true   # LR sweep: train on train_dev, eval on dev
    configs/finetune.py:model=ViT-B/16,data=cifar10,smoke=true  # CPU, seconds
    configs/finetune.py:model=ViT-H/14,data=imagenet2012,lr=0.03,table2=true,init=...
    configs/finetune.py:...,ema=0.999   # Polyak averaging on any row

`table2=true`: Table 2's ImageNet fine-tuning of its best models (Sec. 4.1),
at 512 px (ViT-L/16) or 518 px (ViT-H/14) with Polyak averaging, factor
0.9999, applied literally (`optim.ema_warmup=False`: at step t the average
still holds 0.9999**t of the initial weights, 13.5% after 20k steps).
`ema=` adds averaging (with the default warm-up) to any row; evaluation
and summaries then report the averages (`eval_ema`).

All rows: SGD momentum 0.9, cosine decay, batch 512, no weight decay,
global-norm clipping at 1, resolution 384 (`res=`), the whole pre-training
head replaced by a zero-initialised linear layer, position embeddings
interpolated to the new grid. Pre-processing: resize 448 -> random crop 384
+ flip; evaluation a square resize to 384, no crop (as the reference). ImageNet also reports
ImageNet ReaL (`real_accuracy`).

`pretrain`, `pretrain_epochs` and `pretrain_opt` describe `init` for the
result tables (`python -m vit_jax.tables`); they change nothing else.
"""

from vit_jax.configs import common
from vit_jax import paper

# data: (steps, LR sweep) from Table 4 (VTAB has its own config).
TABLE4 = {data: (row['steps'], row['lr_sweep'])
          for data, row in paper.TABLE4.items() if data != 'vtab'}
RES = 384  # Table 4's fine-tuning resolution (`res=` changes it).
# Short names accepted for `data`.
ALIASES = {'imagenet': 'imagenet2012', 'i1k': 'imagenet2012',
           'pets': 'oxford_iiit_pet', 'flowers': 'oxford_flowers102'}


def get_config(arg=None):
  args = common.parse_arg(
      arg, model='ViT-B/16', data='cifar10', lr=0.0, init='', res=0,
      steps=0, sweep=False, pretrain='i21k', pretrain_epochs=0.0,
      pretrain_opt='adam', ema=0.0, table2=False, smoke=False)
  data = ALIASES.get(args.data, args.data)
  res = args.res or RES
  if args.table2:
    if args.model not in paper.TABLE2_FINETUNE_RES or data != 'imagenet2012':
      raise ValueError(
          'table2=true is ImageNet fine-tuning of '
          f'{" or ".join(paper.TABLE2_FINETUNE_RES)} (data=imagenet2012); '
          f'got model={args.model}, data={args.data}. Other rows: ema=0.9999')
    if args.res:  # It would be ignored: Table 2 fixes the resolution.
      table2 = ', '.join(f'{r} px for {m}'
                         for m, r in paper.TABLE2_FINETUNE_RES.items())
      raise ValueError(
          f'res={args.res} with table2=true: Table 2 fine-tunes at its own '
          f'resolution ({table2}); drop res=, or drop table2=true (ema=0.9999 '
          'adds Polyak averaging at any resolution)')
    res = paper.TABLE2_FINETUNE_RES[args.model]
  if data not in TABLE4:
    raise ValueError(f'data={args.data!r}: expected one of '
                     f'{sorted(TABLE4) + sorted(ALIASES)}')
  steps, sweep_lrs = TABLE4[data]
  lr = args.lr or 0.01
  if args.lr and args.lr not in sweep_lrs:
    print(f'note: lr={args.lr} is outside the paper sweep {sweep_lrs}')
  c = common.base()
  c.model.name = args.model
  c.num_classes = None  # The dataset's.
  c.input.data = data
  c.input.image_size = res
  c.input.batch_size = 512
  c.input.eval_batch_size = 512
  c.input.pp_train = 'finetune'  # resize 448 -> random crop 384 + flip.
  # Square resize to S, as the reference (the train preset squashes too).
  c.input.pp_eval = 'resize'
  if args.sweep:  # The paper's dev splits: 10% (Pets, Flowers), 2% (CIFAR),
    c.input.train_split = 'train_dev'  # 1% (ImageNet) of train held out.
    c.input.eval_split = 'dev'
  c.total_steps = args.steps or steps
  # Warm-up, not in the paper: the reference code's 500 steps, capped at
  # 10% of the run for the 500-step rows.
  common.table4_optim(c, lr, warmup_steps=min(500, c.total_steps // 10))
  if args.table2:
    c.optim.ema_decay = paper.TABLE2_POLYAK
    c.optim.ema_warmup = False
  if args.ema:
    c.optim.ema_decay = args.ema
  c.init = args.init or None
  c.checkpoint_every = 1000
  c.eval_every = 0
  if data == 'imagenet2012' and not args.sweep:
    # every: 0 evaluates at the end; --config.evals.real.every=N also
    # every N steps.
    c.evals.real = dict(type='classification', data='imagenet2012_real',
                        real_only=True, every=0)
  c.report = common.transfer_report(args, data, lr)
  if args.smoke:
    common.apply_smoke(c)
    # A 3x3 grid where pre-training (smoke) had 2x2: the position
    # embeddings are interpolated, as at 384 px.
    c.input.image_size = c.input.image_size * 3 // 2
    c.evals = {}  # No ImageNet ReaL offline.
  return c
