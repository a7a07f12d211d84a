"""CPU smoke run: pre-train a tiny ViT on real offline data, then evaluate.

    python -m vit_jax.main --config=configs/smoke.py --workdir=/tmp/vit_smoke
    python -m vit_jax.main --config=configs/smoke.py:data=digits,steps=100 ...
    ... --config=configs/smoke.py:fewshot=mnist5k  # + few-shot on MNIST

data=auto (default) uses Fashion-MNIST when Debian's `dataset-fashion-mnist`
is installed (prepared as the official tfds dataset on first use, offline)
and scikit-learn's real `digits` otherwise. Every code path of a real run is
used: tf.data pipeline, sharded jitted step, orbax checkpoints, metrics,
evaluation over every test example and summary.json.
"""

import os

from vit_jax.configs import common
from vit_jax.data import registry

FASHION_MNIST_DIR = '/usr/share/datasets/fashion-mnist'


def get_config(arg=None):
  args = common.parse_arg(arg, data='auto', steps=600, model='ViT-test',
                          batch=128, fewshot='', smoke=False)
  if args.smoke:  # Like every config: seconds, on scikit-learn's digits.
    args.data, args.steps, args.batch = 'digits', 20, 32
  data = args.data
  if data == 'auto':
    data = ('fashion_mnist' if os.path.isdir(FASHION_MNIST_DIR)
            else 'digits')
  c = common.base()
  c.model.name = args.model
  c.input.data = data
  c.input.prepare = True  # Offline datasets are prepared when missing.
  # 28x28 Fashion-MNIST as is; 8x8 digits resized to 16x16 (a 4x4 grid).
  c.input.image_size = 28 if data == 'fashion_mnist' else 16
  if data == 'fashion_mnist':
    # Native 28x28 for training and evaluation: random crops of small images
    # would train at a different object scale than the test images show.
    c.input.pp_train = 'decode|resize(28)|flip_lr|value_range(-1,1)'
    c.input.pp_eval = 'decode|resize(28)|value_range(-1,1)'
    # Prepared as one file, read in one order: a block as large as the
    # split permutes all of it every epoch (its file is 34 MB).
    c.input.shuffle_buffer = 60_000
  c.input.batch_size = args.batch
  c.input.eval_batch_size = 512  # Splits over 1, 2, 4, ... 512 devices.
  c.input.num_train_examples = registry.get(data).num_train_examples
  c.total_steps = args.steps
  c.optim.name = 'adam'
  c.optim.lr = 2e-3
  c.optim.warmup_steps = min(100, args.steps // 10)
  c.optim.decay = 'cosine'
  c.optim.weight_decay = 1e-4
  c.optim.grad_clip_norm = 1.0
  c.log_every = 100
  c.checkpoint_every = 300
  c.accounting.hardware = 'tpu_v3'
  if args.fewshot:  # E.g. fewshot=mnist5k or fewshot=digits+mnist5k.
    c.evals.fewshot = common.fewshot(args.fewshot.split('+'), (1, 5, 10),
                                     pool_per_class=20)
  return c
