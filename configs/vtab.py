"""VTAB-1k transfer (Table 2's VTAB row): one setting for all 19 tasks.

    configs/vtab.py:task=caltech101,model=ViT-L/16,init=WORKDIR_OR_NPZ
    python -m vit_jax.vtab --config_args=model=ViT-L/16,init=... --workdir=DIR

Each task trains on its 1000 examples (800 train + 200 val) and is evaluated
on its test split: SGD momentum 0.9, LR 0.01, cosine, 2,500 steps, batch 512,
384 px, no weight decay, clipping at 1, zero-initialised head.
`sweep=true` trains on the 800 and evaluates on the 200 (the paper's split
for choosing settings). `python -m vit_jax.vtab` runs all 19 and reports the
per-task accuracies with the Natural / Specialized / Structured means.
"""

from vit_jax.configs import common
from vit_jax import paper
from vit_jax.data import registry


def get_config(arg=None):
  args = common.parse_arg(
      arg, task='caltech101', model='ViT-B/16', init='',
      lr=paper.TABLE4['vtab']['lr_sweep'][0], steps=paper.TABLE4['vtab']['steps'],
      res=384, sweep=False, pretrain='i21k', pretrain_epochs=0.0,
      pretrain_opt='adam', smoke=False)
  data = args.task if args.task.startswith('vtab/') else f'vtab/{args.task}'
  if data not in registry.VTAB_TASKS:
    raise ValueError(f'task={args.task!r}: expected one of '
                     f'{", ".join(t[5:] for t in registry.VTAB_TASKS)}')
  c = common.base()
  c.model.name = args.model
  c.num_classes = None
  c.input.data = data
  c.input.image_size = args.res
  c.input.batch_size = 512
  c.input.eval_batch_size = 512
  c.input.num_train_examples = paper.VTAB_1K['train_examples']
  c.input.pp_train = 'resize'  # VTAB-1k: plain resize, no augmentation.
  c.input.pp_eval = 'resize'
  c.input.train_split = 'train800' if args.sweep else 'train800val200'
  c.input.eval_split = 'val200' if args.sweep else 'test'
  c.total_steps = args.steps
  common.table4_optim(c, args.lr, warmup_steps=min(200, args.steps // 10))
  c.init = args.init or None
  c.checkpoint_every = 500
  c.report = common.transfer_report(args, data, args.lr)
  if args.smoke:
    common.apply_smoke(c)
    # Offline stand-in with VTAB-1k's shape: 1000 training images (a
    # sweep: 800, evaluated on the next 200, never on test).
    c.input.train_split = 'train[:800]' if args.sweep else 'train[:1000]'
    c.input.eval_split = 'train[800:1000]' if args.sweep else 'test'
  return c
