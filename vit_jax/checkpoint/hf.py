"""Interop with Hugging Face `transformers`' `ViTForImageClassification`.

    state = to_hf(params, "ViT-B/16")          # -> torch state dict
    hf_model = ViTForImageClassification(hf_config("ViT-B/16", num_classes=10))
    hf_model.load_state_dict(state)
    params = from_hf(hf_model.state_dict(), "ViT-B/16")

transformers 5 renamed the ViT state-dict keys of 4.x (`vit.encoder.layer.N.
attention.attention.query` became `vit.layers.N.attention.q_proj`, ...); the
Hub's files still use the 4.x names. `from_hf` reads both; `to_hf` writes the
naming of the installed transformers (or the one asked for).

Activation: the public JAX checkpoints use the tanh GELU, Hub ViTs mostly the
exact one (`hidden_act="gelu"`). Our ViT has both (`gelu_approximate`):
`hf_config(name, gelu_approximate=...)` declares the matching `hidden_act`
(and `layer_norm_eps=1e-6`), and `from_hf_model(hf_model, name)` builds the
model whose activation matches the source's. Only plain class-token ViTs
without a pre-logits layer exist on the HF side.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np
from flax import traverse_util

from vit_jax import models
from vit_jax.checkpoint.layers import unstack_blocks
from vit_jax.checkpoint.npz import CheckpointError

# Per block: HF (transformers 5) key suffix -> (our path, kind).
_BLOCK = {
    'attention.q_proj': ('MultiHeadDotProductAttention_0/query', 'qkv'),
    'attention.k_proj': ('MultiHeadDotProductAttention_0/key', 'qkv'),
    'attention.v_proj': ('MultiHeadDotProductAttention_0/value', 'qkv'),
    'attention.o_proj': ('MultiHeadDotProductAttention_0/out', 'out'),
    'layernorm_before': ('LayerNorm_0', 'norm'),
    'layernorm_after': ('LayerNorm_1', 'norm'),
    'mlp.fc1': ('MlpBlock_0/Dense_0', 'dense'),
    'mlp.fc2': ('MlpBlock_0/Dense_1', 'dense'),
}
# HF `hidden_act` -> our `gelu_approximate`.
HIDDEN_ACTS = {'gelu': False, 'gelu_new': True, 'gelu_pytorch_tanh': True}

# transformers 4.x block names -> 5.x.
_V4_TO_V5 = {
    'attention.attention.query': 'attention.q_proj',
    'attention.attention.key': 'attention.k_proj',
    'attention.attention.value': 'attention.v_proj',
    'attention.output.dense': 'attention.o_proj',
    'intermediate.dense': 'mlp.fc1',
    'output.dense': 'mlp.fc2',
    'layernorm_before': 'layernorm_before',
    'layernorm_after': 'layernorm_after',
}


def installed_naming() -> str:
  """'v5' or 'v4': the state-dict naming the installed transformers loads."""
  try:
    import transformers
  except ImportError:
    return 'v5'
  return 'v4' if int(transformers.__version__.split('.')[0]) < 5 else 'v5'


def no_counterpart(name: str, options: Mapping[str, Any]) -> str:
  """Why model `name` with `options` has no ViTForImageClassification form
  ('' if it has): only plain class-token ViTs with learned position
  embeddings and no pre-logits layer convert."""
  kw = models.options(name, **options)
  cls, family = models.spec(name)['cls'], models.family(name).name
  if cls is models.BiT:
    return (f'{name} is a {family} ResNet: transformers\' '
            'ViTForImageClassification has no convolutional trunk (and its '
            'BiT port uses other layer names and padding)')
  if cls is not models.VisionTransformer:
    return (f'{name} is a {family} model: transformers has no '
            'ViTForImageClassification (or other) counterpart of it')
  if kw.get('resnet_layers') is not None:
    return (f'{name} is a hybrid: its ResNet stem (GroupNorm, weight '
            'standardisation) has no ViTForImageClassification counterpart')
  if kw.get('classifier', 'token') != 'token':
    return (f'classifier={kw["classifier"]!r}: ViTForImageClassification '
            'classifies the class token only')
  if kw.get('posemb', 'learn') != 'learn':
    return (f'posemb={kw["posemb"]!r}: ViTForImageClassification has '
            'learned position embeddings only')
  if kw.get('representation_size'):
    return ('a pre-logits layer (representation_size='
            f'{kw["representation_size"]}): ViTForImageClassification has '
            'none (fine-tune without it, or drop it with load_pretrained)')
  return ''


def _vit_spec(name: str, overrides: Mapping[str, Any]) -> Dict[str, Any]:
  why = no_counterpart(name, overrides)
  if why:
    raise ValueError(f'{name} with {dict(overrides)} has no Hugging Face '
                     f'ViTForImageClassification counterpart: {why}')
  kw = models.spec(name)
  kw.update(overrides)
  return kw


# Our ViT option -> the Hugging Face `ViTConfig` field declaring the same
# dimension. The weights' shapes show all but the head count: the attention
# weights split into any number of heads dividing the width, so a wrong
# count loads and computes something else; the config is compared instead.
_DIMS = {
    'hidden_size': 'hidden_size',
    'num_layers': 'num_hidden_layers',
    'num_heads': 'num_attention_heads',
    'mlp_dim': 'intermediate_size',
    'patch_size': 'patch_size',
}


def config_dims(hf_cfg) -> Dict[str, int]:
  """The dimensions of HF config `hf_cfg`, as our ViT's option names."""
  return {ours: int(getattr(hf_cfg, theirs)) for ours, theirs in _DIMS.items()}


def zoo_name(hf_cfg) -> Optional[str]:
  """The zoo ViT with the dimensions of HF config `hf_cfg` (None: none)."""
  dims = config_dims(hf_cfg)
  for name in models.names():
    kw = models.options(name)
    if (models.spec(name)['cls'] is models.VisionTransformer
        and kw.get('resnet_layers') is None
        and not kw.get('representation_size')
        and kw.get('classifier', 'token') == 'token'
        and all(kw.get(k) == v for k, v in dims.items())):
      return name
  return None


def dims_mismatch(hf_cfg, name: str,
                  overrides: Mapping[str, Any]) -> Dict[str, Tuple[int, Any]]:
  """The dimensions in which `create(name, **overrides)` differs from HF
  config `hf_cfg`: our option name -> (the config's value, the model's);
  empty where they agree."""
  kw = _vit_spec(name, overrides)
  return {k: (v, kw.get(k)) for k, v in config_dims(hf_cfg).items()
          if kw.get(k) != v}


def describe_mismatch(wrong: Mapping[str, Tuple[int, Any]], name: str) -> str:
  """`dims_mismatch`'s result in words, e.g. 'the Hugging Face model has
  num_attention_heads=4, ViT-test has num_heads=2'."""
  return ('the Hugging Face model has '
          + ', '.join(f'{_DIMS[k]}={v}' for k, (v, _) in wrong.items())
          + f', {name} has '
          + ', '.join(f'{k}={ours}' for k, (_, ours) in wrong.items()))


def check_config(hf_cfg, name: str, **overrides) -> None:
  """CheckpointError unless `create(name, **overrides)` has the dimensions
  HF config `hf_cfg` declares (the head count, which the weights do not
  show, included)."""
  wrong = dims_mismatch(hf_cfg, name, overrides)
  if not wrong:
    return
  fits = zoo_name(hf_cfg)
  raise CheckpointError(
      f'{describe_mismatch(wrong, name)}: it would not compute what the '
      'Hugging Face model does. Load it ' + (f'as {fits!r}, or ' if fits
                                               else '')
      + f'as {name!r} with the overrides '
      + ', '.join(f'{k}={v}' for k, (v, _) in wrong.items()))


def model_options(hf_cfg) -> Dict[str, Any]:
  """`create` options making our ViT compute what HF config `hf_cfg` does."""
  act = hf_cfg.hidden_act
  if act not in HIDDEN_ACTS:
    raise ValueError(f'Hugging Face hidden_act={act!r} has no counterpart in '
                     f'our ViT; supported: {sorted(HIDDEN_ACTS)}')
  # Our LayerNorms add 1e-6 to the variance. The Hub's 1e-12 changes the
  # normalised activations (variance ~1) by ~5e-7 relative: accepted; a
  # larger epsilon would compute something else.
  eps = float(getattr(hf_cfg, 'layer_norm_eps', 1e-6))
  if eps > 2e-6:
    raise ValueError(f'Hugging Face layer_norm_eps={eps:g}: our ViT\'s '
                     'LayerNorms use 1e-6 (the JAX checkpoints\'), so it '
                     'would not compute what that model does; models with '
                     'an epsilon up to 2e-6 (the Hub\'s 1e-12) convert')
  return {'gelu_approximate': HIDDEN_ACTS[act]}


def hf_config(name: str, num_classes: int = 1000, image_size: int = 224,
              num_channels: int = 3, **overrides):
  """A `transformers.ViTConfig` computing exactly what `create(name)` does."""
  from transformers import ViTConfig
  kw = _vit_spec(name, overrides)
  return ViTConfig(
      hidden_size=kw['hidden_size'], num_hidden_layers=kw['num_layers'],
      num_attention_heads=kw['num_heads'], intermediate_size=kw['mlp_dim'],
      hidden_act=('gelu_pytorch_tanh' if kw.get('gelu_approximate', True)
                  else 'gelu'),
      layer_norm_eps=1e-6,
      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
      image_size=image_size, patch_size=kw['patch_size'],
      num_channels=num_channels, num_labels=num_classes, qkv_bias=True)


def to_hf(params: Mapping[str, Any], name: str, *,
          naming: Optional[str] = None, **overrides) -> Dict[str, Any]:
  """Our params -> a state dict for `ViTForImageClassification`.

  Returns torch tensors (numpy arrays where torch is not installed).
  `naming` is 'v5' or 'v4'; default: what the installed transformers loads.
  """
  kw = _vit_spec(name, overrides)
  naming = naming or installed_naming()
  if naming not in ('v4', 'v5'):
    raise ValueError(f"naming must be 'v4' or 'v5', got {naming!r}")
  p = {'/'.join(k): np.asarray(v, np.float32)
       for k, v in traverse_util.flatten_dict(
           unstack_blocks(params)).items()}  # Scanned runs too.
  _check_convertible(p, name)
  d = kw['hidden_size']
  out = {
      'vit.embeddings.cls_token': p['cls'],
      'vit.embeddings.position_embeddings':
          p['Transformer/posembed_input/pos_embedding'],
      'vit.embeddings.patch_embeddings.projection.weight':
          p['embedding/kernel'].transpose(3, 2, 0, 1),
      'vit.embeddings.patch_embeddings.projection.bias': p['embedding/bias'],
      'vit.layernorm.weight': p['Transformer/encoder_norm/scale'],
      'vit.layernorm.bias': p['Transformer/encoder_norm/bias'],
  }
  if 'head/kernel' in p:
    out['classifier.weight'] = p['head/kernel'].T
    out['classifier.bias'] = p['head/bias']
  v5_to_v4 = {v: k for k, v in _V4_TO_V5.items()}
  for i in range(kw['num_layers']):
    for hf, (ours, kind) in _BLOCK.items():
      src = f'Transformer/encoderblock_{i}/{ours}'
      prefix = (f'vit.layers.{i}.{hf}' if naming == 'v5' else
                f'vit.encoder.layer.{i}.{v5_to_v4[hf]}')
      if kind == 'norm':
        w, b = p[f'{src}/scale'], p[f'{src}/bias']
      elif kind == 'qkv':  # (D, heads, head_dim) -> (out, in)
        w, b = p[f'{src}/kernel'].reshape(d, d).T, p[f'{src}/bias'].reshape(d)
      elif kind == 'out':  # (heads, head_dim, D) -> (out, in)
        w, b = p[f'{src}/kernel'].reshape(d, d).T, p[f'{src}/bias']
      else:
        w, b = p[f'{src}/kernel'].T, p[f'{src}/bias']
      out[f'{prefix}.weight'], out[f'{prefix}.bias'] = w, b
  try:
    import torch
  except ImportError:
    return {k: np.ascontiguousarray(v) for k, v in out.items()}
  return {k: torch.from_numpy(np.array(v, np.float32)) for k, v in out.items()}


def _check_convertible(p: Mapping[str, Any], name: str) -> None:
  """The params themselves (not only `name` and its options) must be a
  plain class-token ViT's: a pre-logits layer, a MAP head or a hybrid stem
  left out would change the logits without an error (a `pre_logits` as
  wide as the model even gives a classifier of the right shape)."""
  plain = ('cls', 'embedding/', 'Transformer/', 'head/')
  extra = sorted({k.split('/')[0] for k in p
                  if not k.startswith(plain) and k != 'cls'})
  missing = [k for k in ('cls', 'Transformer/posembed_input/pos_embedding')
             if k not in p]
  if extra or missing:
    raise ValueError(
        f'these params of {name} have no Hugging Face '
        'ViTForImageClassification counterpart: '
        + '; '.join(filter(None, (
            f'{", ".join(extra)} would be left out' if extra else '',
            f'no {", ".join(missing)} (a gap, MAP or sincos2d model?)'
            if missing else '')))
        + ': only plain class-token ViTs with learned position embeddings '
        'and without a pre-logits layer convert (drop pre_logits with '
        'load_pretrained and fine-tune)')


def from_hf(state_dict: Mapping[str, Any], name: str, *, config=None,
            **overrides) -> dict:
  """A `ViTForImageClassification` state dict (4.x or 5.x keys) -> params.

  The result fits `models.create(name, num_classes=<classifier rows>)`.
  The weights do not show the head count: pass the model's `config`
  (`hf_model.config`) to have it and the other dimensions checked against
  `name`'s (`from_hf_model` always does).
  """
  kw = _vit_spec(name, overrides)
  if config is not None:
    check_config(config, name, **overrides)
  sd = {_v5_key(k): _numpy(v) for k, v in state_dict.items()}
  d, heads = kw['hidden_size'], kw['num_heads']
  used = set()

  def take(key):
    if key not in sd:
      raise CheckpointError(f'Hugging Face state dict has no key {key} '
                            f'(is it a {name}?)')
    used.add(key)
    return sd[key]

  def expect(key, shape):
    v = take(key)
    if v.shape != tuple(shape):
      raise CheckpointError(f'shape mismatch for {key}: expected '
                            f'{tuple(shape)} for {name}, found {v.shape}')
    return v

  p = kw['patch_size']
  flat = {
      'cls': expect('vit.embeddings.cls_token', (1, 1, d)),
      'Transformer/posembed_input/pos_embedding':
          take('vit.embeddings.position_embeddings'),
      'embedding/kernel': take(
          'vit.embeddings.patch_embeddings.projection.weight').transpose(
              2, 3, 1, 0),
      'embedding/bias': expect(
          'vit.embeddings.patch_embeddings.projection.bias', (d,)),
      'Transformer/encoder_norm/scale': expect('vit.layernorm.weight', (d,)),
      'Transformer/encoder_norm/bias': expect('vit.layernorm.bias', (d,)),
  }
  if flat['embedding/kernel'].shape[:2] != (p, p):
    raise CheckpointError(
        f'patch embedding is {flat["embedding/kernel"].shape[:2]}, but {name} '
        f'uses {p}x{p} patches')
  if 'classifier.weight' in sd:
    flat['head/kernel'] = take('classifier.weight').T
    flat['head/bias'] = take('classifier.bias')
  # `qkv_bias=False` (a ViTConfig option): no q/k/v biases, which are zero
  # biases in our layout (the same numbers).
  qkv_bias = getattr(config, 'qkv_bias', True) if config is not None else (
      f'vit.layers.0.{next(iter(_BLOCK))}.bias' in sd)
  for i in range(kw['num_layers']):
    for hf, (ours, kind) in _BLOCK.items():
      dst = f'Transformer/encoderblock_{i}/{ours}'
      w = take(f'vit.layers.{i}.{hf}.weight')
      b = (take(f'vit.layers.{i}.{hf}.bias') if qkv_bias or kind != 'qkv'
           else np.zeros(w.shape[0], np.float32))
      if kind == 'norm':
        flat[f'{dst}/scale'], flat[f'{dst}/bias'] = w, b
      elif kind == 'qkv':
        flat[f'{dst}/kernel'] = w.T.reshape(d, heads, d // heads)
        flat[f'{dst}/bias'] = b.reshape(heads, d // heads)
      elif kind == 'out':
        flat[f'{dst}/kernel'] = w.T.reshape(heads, d // heads, d)
        flat[f'{dst}/bias'] = b
      else:
        flat[f'{dst}/kernel'], flat[f'{dst}/bias'] = w.T, b
  unused = sorted(set(sd) - used)
  if unused:
    raise CheckpointError(
        f'Hugging Face state dict has keys {name} has no place for: '
        f'{unused[:10]}{" ..." if len(unused) > 10 else ""} (more layers than '
        f'{kw["num_layers"]}, or a pooler / pre-logits layer?)')
  return traverse_util.unflatten_dict(
      {tuple(k.split('/')): np.ascontiguousarray(v) for k, v in flat.items()})


def from_hf_model(hf_model, name: str, **overrides):
  """A `ViTForImageClassification` -> (our model, its params).

  The model's activation follows `hf_model.config.hidden_act`; its head has
  as many classes as the HF classifier (none without one). CheckpointError
  where `name` (with `overrides`) has other dimensions than the HF config.
  """
  options = dict(overrides)
  options.update(model_options(hf_model.config))
  params = from_hf(hf_model.state_dict(), name, config=hf_model.config,
                   **options)
  num_classes = params['head']['bias'].shape[0] if 'head' in params else None
  return models.create(name, num_classes=num_classes, **options), params


def _v5_key(key: str) -> str:
  """Renames a transformers 4.x ViT key to its 5.x name (others unchanged)."""
  m = re.match(r'vit\.encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$', key)
  if m and m.group(2) in _V4_TO_V5:
    return f'vit.layers.{m.group(1)}.{_V4_TO_V5[m.group(2)]}.{m.group(3)}'
  return key


def _numpy(v) -> np.ndarray:
  if hasattr(v, 'detach'):  # torch.Tensor
    v = v.detach().cpu().float().numpy()
  return np.asarray(v, np.float32)
