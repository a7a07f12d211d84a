"""A trained model from any checkpoint a user has, ready to run.

`load(init, model=None, image_size=None)` accepts:

  * a training run's workdir (or its `checkpoints/<step>`): the model is the
    one the run saved with its checkpoint (`--model` may be left out);
  * an `.npz` in the public checkpoints' layout: `--model` names it; its
    class-token / gap classifier and pre-logits width are read from the file;
  * `hf:DIR`, a Hugging Face `ViTForImageClassification` directory
    (`save_pretrained`); the model is named by `--model` or found in the zoo
    from the directory's config.

At another `image_size` than the checkpoint's, position embeddings are
interpolated exactly as fine-tuning does (`checkpoint.load_pretrained`). A
checkpoint that does not fit the model is a `CheckpointError` naming every
missing, extra or mis-shaped array.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax import models
from vit_jax.checkpoint import load_npz, load_pretrained
from vit_jax.checkpoint.npz import CheckpointError

HF_PREFIX = 'hf:'


@dataclasses.dataclass
class Trained:
  """A model, its parameters and where they came from."""
  model: Any  # A flax Module (float32 compute unless asked otherwise).
  params: Dict[str, Any]  # Host numpy arrays, fitted to `image_size`.
  name: str  # The zoo name (`model_spec` has the options).
  model_spec: Dict[str, Any]
  source: str  # The checkpoint read (step directory, file, HF dir).
  kind: str  # 'workdir', 'npz' or 'hf'.
  image_size: int  # The side the params are fitted to.
  native_image_size: Optional[int]  # The checkpoint's own (None: no posemb).
  channels: int  # Input channels (1: grey, 3: RGB).
  num_classes: Optional[int]

  @property
  def stride(self) -> int:
    return getattr(self.model, 'stride', 1)


def _kind(init: str) -> str:
  if init.startswith(HF_PREFIX):
    return 'hf'
  if init.endswith('.npz'):
    return 'npz'
  return 'workdir'


def _options_from_params(flat_top: Dict[str, Any]) -> Dict[str, Any]:
  """ViT options a public-layout checkpoint implies."""
  out = {}
  if 'Transformer' in flat_top:
    out['classifier'] = 'token' if 'cls' in flat_top else 'gap'
    pre = flat_top.get('pre_logits')
    out['representation_size'] = (int(np.shape(pre['kernel'])[1])
                                  if pre is not None else None)
  return out


def _channels(params) -> int:
  if 'conv_root' in params:
    return int(np.shape(params['conv_root']['kernel'])[2])
  if 'embedding' in params:
    return int(np.shape(params['embedding']['kernel'])[2])
  if 'root_block' in params:  # BiT.
    return int(np.shape(params['root_block']['conv_root']['kernel'])[2])
  return 3


def _native_size(params, stride: int) -> Optional[int]:
  pe = params.get('Transformer', {}).get('posembed_input', {}).get(
      'pos_embedding')
  if pe is None:
    return None
  n = np.shape(pe)[1] - (1 if 'cls' in params else 0)
  side = math.isqrt(n)
  return side * stride if side * side == n else None


def _hf(directory: str, name: Optional[str]):
  try:
    import transformers
  except ImportError as e:
    raise ImportError('hf: checkpoints need transformers: pip install -e '
                      '".[torch]" -c constraints.txt') from e
  from vit_jax.checkpoint import hf
  if not os.path.isfile(os.path.join(directory, 'config.json')):
    raise FileNotFoundError(f'{directory} is not a Hugging Face model '
                            'directory (no config.json)')
  hf_model = transformers.ViTForImageClassification.from_pretrained(directory)
  name = name or _zoo_name(hf_model.config)
  model, params = hf.from_hf_model(hf_model, name)
  spec = dict(name=name, gelu_approximate=model.gelu_approximate)
  return name, spec, params


def _zoo_name(cfg) -> str:
  want = (cfg.patch_size, cfg.hidden_size, cfg.intermediate_size,
          cfg.num_attention_heads, cfg.num_hidden_layers)
  for name in models.names():
    s = models.spec(name)
    if s.get('resnet_layers') or 'hidden_size' not in s:
      continue
    if (s['patch_size'], s['hidden_size'], s['mlp_dim'], s['num_heads'],
        s['num_layers']) == want:
      return name
  raise ValueError(f'no zoo model has the Hugging Face config\'s dimensions '
                   f'(patch, hidden, mlp, heads, layers) = {want}: pass '
                   '--model=<name> (see python -m vit_jax.models)')


def load(init: str, model: Optional[str] = None,
         image_size: Optional[int] = None, *, dtype: str = 'float32',
         **overrides) -> Trained:
  """Opens `init` (see the module doc); `overrides` change model options
  (e.g. `scan_layers=True`); compute in `dtype` (float32 by default, also
  for a model trained in bfloat16)."""
  kind = _kind(init)
  if kind == 'hf':
    directory = init[len(HF_PREFIX):]
    name, spec, loaded = _hf(directory, model)
    source = directory
  elif kind == 'npz':
    if not model:
      raise ValueError(f'{init} is an .npz checkpoint: name its model with '
                       '--model (e.g. ViT-B/16; python -m vit_jax.models '
                       'lists them)')
    if not os.path.exists(init):
      raise FileNotFoundError(f'no such checkpoint file: {init}')
    loaded = load_npz(init)
    name, spec, source = model, dict(name=model), init
    spec.update(_options_from_params(loaded))
  else:
    from vit_jax.train import orbax_state  # Workdirs are orbax train states.
    source = orbax_state.resolve(init)
    spec = dict(orbax_state.load_run_state(source).get('model') or {})
    if not spec.get('name'):
      if not model:
        raise ValueError(f'{source} does not record its model: pass --model')
      spec['name'] = model
    if model and model != spec['name']:
      raise CheckpointError(
          f'{source} is a checkpoint of {spec["name"]} '
          f'({spec}); --model={model} differs: leave --model out to use '
          'the checkpoint\'s model')
    name = spec['name']
    loaded = orbax_state.load_params(source)

  spec = {**spec, **overrides, 'dtype': dtype}
  head = loaded.get('head')
  num_classes = int(np.shape(head['bias'])[0]) if head is not None else None
  net = models.from_config(spec, num_classes)
  stride = getattr(net, 'stride', None)
  if stride is None and hasattr(net, 'patch_size'):
    stride = net.patch_size
  native = _native_size(loaded, stride or 1)
  size = int(image_size or native or 224)
  channels = _channels(loaded)
  abstract = jax.eval_shape(
      lambda: net.init(jax.random.key(0),
                       jnp.zeros((1, size, size, channels)), train=False))
  host = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype),
                      abstract['params'])
  params = load_pretrained(loaded, host, keep_head=True)
  return Trained(model=net, params=params, name=name, model_spec=spec,
                 source=source, kind=kind, image_size=size,
                 native_image_size=native, channels=channels,
                 num_classes=num_classes)



def reinitialised(trained: Trained, seed: int = 0) -> Trained:
  """`trained`'s model with freshly initialised parameters (the model's own
  initialisers, `seed`): what training started from."""
  x = jnp.zeros((1, trained.image_size, trained.image_size, trained.channels))
  params = trained.model.init(jax.random.key(seed), x, train=False)['params']
  return dataclasses.replace(
      trained, params=jax.tree.map(np.asarray, params),
      source=f'{trained.source} (random init, seed {seed})')
