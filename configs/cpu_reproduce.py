"""The paper's pipeline at CPU scale on real offline data (docs/reproduce.md).

One config, one `step` per stage; later stages start from the pre-training
run (`init=` its workdir):

    python -m vit_jax.main --config=configs/cpu_reproduce.py:step=pretrain \
        --workdir=/tmp/repro/pretrain
    python -m vit_jax.main \
        --config=configs/cpu_reproduce.py:step=finetune_hires,init=/tmp/repro/pretrain \
        --workdir=/tmp/repro/finetune_hires

Steps:
  pretrain        ViT (patch 4, width 128, 6 layers) on Fashion-MNIST, 28 px,
                  7 epochs, Adam; evaluates 1/5/10/25-shot linear accuracy on
                  MNIST digits (mnist5k) and Fashion-MNIST at the end.
  finetune_hires  fine-tune it on Fashion-MNIST at 40 px (a 10x10 grid
                  instead of 7x7: position embeddings interpolated), SGD as in
                  the paper's Table 4 recipe.
  finetune_same   the same fine-tuning at 28 px (separates resolution from
                  extra training).
  transfer        fine-tune it on MNIST digits (mnist5k, 4000 train images);
                  `lr=` as in the paper's sweep (default 0.01).
  scratch         the same model, steps and batch on mnist5k from scratch.
  few_labels      fine-tune on 100 labelled Fashion-MNIST images per class (an
                  image folder: data_dir=, see docs/selfsup.md), test on the
                  full 10,000-image test split; init= optional (none: the
                  same recipe from scratch).
  vit_1ep, bit_1ep
                  equal pre-training compute: the ViT and a small BiT ResNet
                  (R26, width 0.5, at 64 px: 0.111 vs 0.129 forward GFLOPs
                  per image, `accounting.forward_flops`; BiT steps scaled to
                  equal total FLOPs, 544 for the ViT's 469), one ViT epoch
                  of Fashion-MNIST each.
smoke=true shrinks any step to seconds (tests run it): the model family's
smoke size (a ViT of width 32 and 2 layers at the step's own image size, so
fine-tuning at 40 px still resizes the position embeddings; the BiT at its
smoke size, 32 px), on small real data (scikit-learn's digits where the step
reads Fashion-MNIST or an image folder; the mnist5k steps keep mnist5k).
"""

import ml_collections

from vit_jax.configs import common
from vit_jax.data import registry

# The CPU-scale ViT: ViT-Ti/16's layout, narrower and shallower, patch 4.
VIT = dict(name='ViT-Ti/16', patch_size=4, hidden_size=128, mlp_dim=512,
           num_heads=4, num_layers=6, dtype='bfloat16')
# A small BiT ResNet-v2 of about the ViT's forward FLOPs (at 64 px).
BIT = dict(name='BiT-R50x1', depth=26, width_factor=0.5, dtype='bfloat16')
STEPS = ('pretrain', 'finetune_hires', 'finetune_same', 'transfer', 'scratch',
         'few_labels', 'vit_1ep', 'bit_1ep')


def equal_compute_steps(vit_steps: int) -> int:
  """The BiT's steps of the ViT's training compute in `vit_steps` steps
  of the same batch: each at its own resolution (28 / 64 px), its forward
  FLOPs as every estimate and `summary.json` count them (the float32
  model's, whatever it computes in: `accounting.forward_flops`)."""
  from vit_jax import accounting  # Traces both models: only when asked.
  vit, bit = (accounting.forward_flops(m['name'], size, 10,
                                      **accounting.counted_options(m))
              for m, size in ((VIT, 28), (BIT, 64)))
  return round(vit_steps * vit / bit)


def fewshot() -> ml_collections.ConfigDict:
  """The few-shot evaluation of the CPU runs (MNIST digits and
  Fashion-MNIST, 1-25 shots, 5 seeds)."""
  return common.fewshot(('mnist5k', 'fashion_mnist'), (1, 5, 10, 25),
                        seeds=5, pool_per_class=100)


def _pp(size: int, train: bool) -> str:
  flip = '|flip_lr' if train else ''
  return f'decode|resize({size}){flip}|value_range(-1,1)'


def _data(c, data: str, size: int) -> None:
  c.input.data = data
  c.input.prepare = True
  c.input.image_size = size
  c.input.pp_train = _pp(size, train=data == 'fashion_mnist')
  c.input.pp_eval = _pp(size, train=False)
  c.input.num_train_examples = registry.get(data).num_train_examples


def _adam(c, lr: float = 1e-3, warmup: int = 500) -> None:
  c.optim.update(dict(name='adam', lr=lr, warmup_steps=warmup,
                      decay='cosine', weight_decay=0.05, grad_clip_norm=1.0))
  c.label_smoothing = 0.1


def get_config(arg=None):
  args = common.parse_arg(arg, step='pretrain', init='', epochs=7.0,
                          lr=0.0, steps=0, data_dir='', smoke=False)
  if args.step not in STEPS:
    raise ValueError(f'step={args.step!r}: expected one of {", ".join(STEPS)}')
  if args.step in ('finetune_hires', 'finetune_same', 'transfer') and not (
      args.init or args.smoke):
    raise ValueError(f'step={args.step} starts from the pre-training run: '
                     'pass init=<its workdir>')
  c = common.base()
  c.model.update(BIT if args.step == 'bit_1ep' else VIT)
  c.input.batch_size = 128
  c.input.eval_batch_size = 500
  c.log_every = 100
  c.checkpoint_every = 500
  c.report = dict(model='ViT-cpu' if args.step != 'bit_1ep' else 'BiT-cpu',
                  pretrain='fashion_mnist', task=args.step)
  step = args.step
  if step == 'pretrain':
    _data(c, 'fashion_mnist', 28)
    c.total_epochs = args.epochs
    _adam(c)
    c.eval_every = 469  # About once per epoch.
    c.evals.fewshot = fewshot()
  elif step in ('finetune_hires', 'finetune_same'):
    _data(c, 'fashion_mnist', 40 if step == 'finetune_hires' else 28)
    c.total_steps = 300
    common.table4_optim(c, args.lr or 0.01, c.total_steps // 10)
  elif step == 'transfer':
    _data(c, 'mnist5k', 28)
    c.total_steps = 300
    common.table4_optim(c, args.lr or 0.01, c.total_steps // 10)
  elif step == 'few_labels':
    if not (args.data_dir or args.smoke):
      raise ValueError('step=few_labels reads an image folder of 100 '
                       'labelled images per class: pass data_dir=<folder> '
                       '(docs/selfsup.md writes one)')
    c.input.data = 'folder'
    c.input.data_dir = args.data_dir or None
    c.input.image_size = 28
    c.input.pp_train = _pp(28, train=True)
    c.input.pp_eval = _pp(28, train=False)
    c.input.train_split, c.input.eval_split = 'train', 'test'
    c.input.num_train_examples = 1000
    c.total_steps = args.steps or 150
    common.table4_optim(c, args.lr or 0.01, c.total_steps // 10)
  elif step == 'scratch':
    _data(c, 'mnist5k', 28)
    c.total_steps = 300
    _adam(c, warmup=30)
  else:  # vit_1ep / bit_1ep: one ViT epoch of compute each.
    vit_steps = 469
    _data(c, 'fashion_mnist', 64 if step == 'bit_1ep' else 28)
    c.total_steps = (vit_steps if step == 'vit_1ep' or args.smoke else
                     equal_compute_steps(vit_steps))
    _adam(c, warmup=50)
    c.evals.fewshot = fewshot()
  c.init = args.init or None
  if args.smoke:
    size = common.shrink_model(c.model)
    if step == 'bit_1ep':  # At 64 px its last stage runs XLA:CPU's slow form.
      _data(c, c.input.data, size)
    c.total_steps, c.total_epochs = 6, None
    c.optim.warmup_steps = 2
    c.checkpoint_every = 6
    c.eval_every = 0
    c.input.batch_size = 32
    c.input.prepare = False
    c.input.data = 'digits' if c.input.data in ('fashion_mnist', 'folder') \
        else c.input.data
    c.input.data_dir = None
    c.input.train_split = 'train[:256]'
    c.input.eval_split = 'test[:200]'
    c.input.eval_batch_size = 100
    if 'fewshot' in c.evals:
      c.evals.fewshot.update(dict(datasets=('digits',), shots=(1, 5),
                                  seeds=2, pool_per_class=5))
    c.report.smoke = True
  return c
