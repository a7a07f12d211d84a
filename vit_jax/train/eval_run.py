"""`--config.mode=eval`: evaluate a finished (or running) run's checkpoint.

Loads the latest checkpoint of `workdir` (or, when it has none,
`config.init`: an .npz file or another run's workdir), runs top-1 on
`input.eval_split` and every `config.evals` evaluator, and merges the
metrics into `workdir/summary.json`. The head is kept, so a fine-tuned
checkpoint can be evaluated at another resolution (position embeddings are
resized).
"""

from __future__ import annotations

import functools
from typing import Any, Dict

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging

from vit_jax import evaluators
from vit_jax.checkpoint import load_pretrained
from vit_jax.data import pipeline
from vit_jax.train import checkpoints, loop, reporting
from vit_jax.train import sharding as shd


def _source(config, workdir: str) -> str:
  """The checkpoint to evaluate: workdir's latest, else config.init."""
  try:
    return checkpoints.resolve(workdir)
  except FileNotFoundError:
    if config.get('init'):
      init = config.init
      return init if init.endswith('.npz') else checkpoints.resolve(init)
    raise FileNotFoundError(
        f'--config.mode=eval: {workdir} has no checkpoint and config.init is '
        'not set; pass the workdir of a training run or '
        '--config.init=PATH(.npz or workdir)') from None


def evaluate_run(config: ml_collections.ConfigDict,
                 workdir: str) -> Dict[str, Any]:
  """Evaluates a checkpoint; returns the summary written to workdir."""
  loop.ensure_prepared(config.input)
  mesh = shd.make_mesh(**config.get('mesh', {}))
  shd.check_batch_size(config.input.eval_batch_size, mesh,
                       'input.eval_batch_size')
  info = pipeline.dataset_info(config.input)
  num_classes = config.get('num_classes') or info.num_classes
  model = loop.model_from_config(config, num_classes)
  image_shape = tuple(info.eval_image_shape)
  init = functools.partial(model.init, train=False)
  abstract = jax.eval_shape(init, jax.random.PRNGKey(0),
                            jnp.zeros((1, *image_shape), jnp.float32))
  params_sh = shd.param_shardings(abstract['params'], mesh,
                                  config.get('fsdp_min_size', 2**18))
  source = _source(config, workdir)
  loaded = (source if source.endswith('.npz')
            else checkpoints.load_params(source))
  host = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                      abstract['params'])
  params = jax.device_put(load_pretrained(loaded, host, keep_head=True),
                          params_sh)
  logging.info('evaluating %s', source)
  evals = evaluators.build(config, model, mesh, params_sh, image_shape[0])
  with jax.set_mesh(mesh):
    metrics = evaluators.run_all(evals, params)
  step = int(source.rstrip('/').rsplit('/', 1)[-1]) if (
      source.rstrip('/').rsplit('/', 1)[-1].isdigit()) else 0
  writer = reporting.make_writer(workdir)
  writer.write_scalars(step, metrics)
  writer.close()
  summary = {'evaluated_checkpoint': source, 'model': config.model.name,
             'report': config.report.to_dict() if 'report' in config else {},
             **metrics}
  path = reporting.write_summary(workdir, summary)
  logging.info('summary written to %s: %s', path, metrics)
  return summary
