"""The flat `.npz` format of the public ViT checkpoints.

Keys are module paths joined by `/` (`Transformer/encoderblock_0/
MultiHeadDotProductAttention_0/query/kernel`, `embedding/kernel`, `cls`,
`head/bias`, ...). Two namings exist in the wild and both load:

  * the older one, numbered across module types within a block
    (`LayerNorm_0`, `MultiHeadDotProductAttention_1`, `LayerNorm_2`,
    `MlpBlock_3`), as in the first public checkpoints;
  * the linen one, numbered per type (`LayerNorm_0`,
    `MultiHeadDotProductAttention_0`, `LayerNorm_1`, `MlpBlock_0`), which is
    what our models use and what `save_npz` writes.

Old hybrid checkpoints stored GroupNorm scales and biases as (1, 1, 1, C);
they are reshaped to (C,). Training checkpoints hold the model under a
prefix (`TRAINING_PREFIXES`): it is stripped, the optimizer state dropped.

The public BiT files (`BiT-M-R50x1.npz`, ..., google-research/big_transfer)
name the same parameters in their own way (`resnet/root_block/
standardized_conv2d/kernel`, `resnet/block1/unit01/a/group_norm/gamma`,
`.../a/proj/...`, `resnet/group_norm`, a 1x1 `resnet/head/conv2d`); they are
renamed to our BiT's (`conv_root`, `block1/unit1/gn1`, `conv_proj`,
`norm_pre_head`, a dense `head`) when read (`_from_big_transfer`).

big_vision's ViTs (`big_vision/models/vit.py`: its `.npz` files, e.g. the
plain ViT-S/16 ImageNet baselines) use the linen names too, but keep the
position embeddings at the top (`pos_embedding`; `Transformer/pos_embedding`
in its pre-2022 files) and add them to the patch tokens before the class
token, which gets none. They are moved to `Transformer/posembed_input/`,
with a zero row for the class token where the model has one: the same
numbers (`_from_big_vision`). Its `posemb="sincos2d"` models have no
position-embedding parameter and load into ours with `posemb="sincos2d"`;
its `pool_type="map"` models (`MAPHead_0`) into ours with
`classifier="map"`; of an image-text model (SigLIP, LiT: `img/` and `txt/`)
the image tower is read. Files are read with `allow_pickle=False` only.
"""

from __future__ import annotations

import io
import os
import tempfile
import zipfile
import zlib
from typing import Any, Dict, Mapping

import numpy as np
from absl import logging
from etils import epath
from flax import traverse_util
from flax.training.checkpoints import convert_pre_linen

from vit_jax import outputs
from vit_jax.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from vit_jax.checkpoint.layers import is_scanned, unstack_blocks

Params = Dict[str, Any]


def save_npz(params: Mapping[str, Any], path: str) -> None:
  """Writes `params` as a flat npz, atomically (a crash keeps the old file).

  Scanned encoders (`scan_layers`) are written unrolled, one
  `encoderblock_<i>` each: the public layout the reference code loads."""
  if is_scanned(params):
    params = unstack_blocks(params)
  flat = {'/'.join(k): _to_numpy(v)
          for k, v in traverse_util.flatten_dict(dict(params)).items()}
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, suffix='.npz.tmp')
  try:
    with os.fdopen(fd, 'wb') as f:
      np.savez(f, **flat)
      f.flush()
      os.fsync(f.fileno())  # On disk before it replaces the old file.
    outputs.as_created(tmp)  # Not mkstemp's 0600.
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def _to_numpy(x) -> np.ndarray:
  x = np.asarray(x)
  if x.dtype.kind == 'V' or x.dtype.name == 'bfloat16':
    # npz can only store numpy's own dtypes without pickling.
    x = x.astype(np.float32)
  return x


def load_npz(path: str) -> Params:
  """Reads a checkpoint into a nested dict of numpy arrays, linen naming."""
  flat = _model_params(read_flat(path), path)
  if any(k.startswith(BIG_TRANSFER_PREFIX) for k in flat):
    flat = _from_big_transfer(flat, path)
  params = traverse_util.unflatten_dict(
      {tuple(k.split('/')): v for k, v in flat.items()})
  return _from_big_vision(_fix_groupnorm(convert_pre_linen(params)), path)


def read_flat(path: str) -> Dict[str, np.ndarray]:
  """The file's arrays by key; errors name the file and what is wrong."""
  if '://' in path:  # gs:// and other stores: read whole, then as local.
    remote = epath.Path(path)
    if not remote.exists():
      raise CheckpointNotFoundError(f'checkpoint not found: {path}')
    return _read(io.BytesIO(remote.read_bytes()), path)
  if not os.path.exists(path):
    raise CheckpointNotFoundError(f'checkpoint not found: {path}')
  with open(path, 'rb') as f:
    return _read(f, path)


def _read(f, path: str) -> Dict[str, np.ndarray]:
  """`read_flat` of the open (seekable) file `f`."""
  head = f.read(64)
  f.seek(0)
  if not head.startswith((b'PK', b'\x93NUMPY')):  # zip (.npz) or .npy
    raise CheckpointError(
        f'{path} is not an .npz checkpoint: it starts with {head[:24]!r}, '
        'not a zip archive (an HTML page or a Git LFS pointer saved in '
        'place of the file?); download the checkpoint itself')
  try:
    with np.load(f, allow_pickle=False) as data:
      if not hasattr(data, 'files'):
        raise CheckpointError(
            f'{path} holds a single array, not an .npz checkpoint of named '
            'parameters')
      out = {}
      for key in data.files:
        out[key] = _read_array(data, key, path)
      return out
  except CheckpointError:
    raise
  except (zipfile.BadZipFile, EOFError, OSError) as e:
    raise CheckpointError(
        f'{path} is not a readable .npz checkpoint (truncated or corrupt '
        f'file?): {e}') from e
  except ValueError as e:
    raise CheckpointError(f'{path} is not an .npz checkpoint: {e}') from e


def _read_array(data, key, path):
  try:
    return data[key]
  except (zipfile.BadZipFile, EOFError, OSError, zlib.error) as e:
    raise CheckpointError(
        f'{path}: array {key!r} cannot be read (truncated or corrupt '
        f'file?): {e}') from e
  except ValueError as e:
    raise CheckpointError(
        f'{path}: array {key!r} is not a plain array (object arrays are '
        f'refused, allow_pickle=False): {e}') from e


# Training checkpoints hold the model's parameters under a prefix, beside
# the optimizer's state: vision_transformer's old Flax-optimizer ones under
# `opt/target/` (`opt/state/...` beside them), others under `params/` (in
# this layout; big_vision's ViT names its position embeddings otherwise).
TRAINING_PREFIXES = ('params/', 'opt/target/')


def _model_params(flat: Dict[str, np.ndarray],
                  path: str) -> Dict[str, np.ndarray]:
  """The model's parameters of a training checkpoint (`TRAINING_PREFIXES`),
  prefix stripped, the rest dropped (logged); other files unchanged."""
  for prefix in TRAINING_PREFIXES:
    if any(k.startswith(prefix) for k in flat):
      rest = sorted({k.split('/')[0] for k in flat if not k.startswith(prefix)})
      logging.info('%s is a training checkpoint: loading its %s* arrays as '
                   'the model%s', path, prefix,
                   f' (dropping {", ".join(rest)})' if rest else '')
      return {k[len(prefix):]: v for k, v in flat.items()
              if k.startswith(prefix)}
  return flat


BIG_TRANSFER_PREFIX = 'resnet/'
# Pre-activation unit parts of the BiT files: a = GroupNorm + 1x1 conv (and
# the projection of the shortcut), b = GroupNorm + 3x3, c = GroupNorm + 1x1.
_BIT_PARTS = {'a/group_norm': 'gn1', 'a/standardized_conv2d': 'conv1',
              'a/proj/standardized_conv2d': 'conv_proj',
              'b/group_norm': 'gn2', 'b/standardized_conv2d': 'conv2',
              'c/group_norm': 'gn3', 'c/standardized_conv2d': 'conv3'}
_BIT_LEAVES = {'gamma': 'scale', 'beta': 'bias', 'kernel': 'kernel',
               'bias': 'bias'}


def _from_big_transfer(flat: Dict[str, np.ndarray],
                       path: str) -> Dict[str, np.ndarray]:
  """A BiT file's arrays under our BiT's names (see the module text)."""
  out = {}
  for key, value in flat.items():
    name = _big_transfer_name(key)
    if name is None:
      raise CheckpointError(
          f'{path}: {key!r} is not a parameter of a BiT checkpoint '
          '(resnet/root_block, resnet/blockN/unitMM/{a,b,c}, '
          'resnet/group_norm, resnet/head)')
    if name == 'head/kernel':  # A 1x1 convolution: (1, 1, C, K).
      value = value.reshape(value.shape[-2:])
    elif value.ndim == 4 and name.endswith(('/scale', '/bias')):
      value = value.reshape(-1)
    out[name] = value
  return out


def _big_transfer_name(key: str):
  parts = key[len(BIG_TRANSFER_PREFIX):].split('/') if key.startswith(
      BIG_TRANSFER_PREFIX) else []
  if not parts or parts[-1] not in _BIT_LEAVES:
    return None
  leaf, body = _BIT_LEAVES[parts[-1]], '/'.join(parts[:-1])
  fixed = {'root_block/standardized_conv2d': 'conv_root',
           'group_norm': 'norm_pre_head', 'head/conv2d': 'head'}
  if body in fixed:
    return f'{fixed[body]}/{leaf}'
  if (len(parts) >= 4 and parts[0].startswith('block') and
      parts[1].startswith('unit') and parts[1][4:].isdigit()):
    part = _BIT_PARTS.get('/'.join(parts[2:-1]))
    if part:
      return f'{parts[0]}/unit{int(parts[1][4:])}/{part}/{leaf}'
  return None


def _from_big_vision(params: Params, path: str) -> Params:
  """A big_vision ViT's position embeddings where ours are, its image tower
  of an image-text model, its inlined MAP head in `MAPHead_0` (see the
  module text); other checkpoints unchanged."""
  if 'img' in params and 'Transformer' not in params:
    rest = sorted(k for k in params if k != 'img')
    logging.info('%s is an image-text model: loading its image tower (img)%s',
                 path, f', dropping {", ".join(rest)}' if rest else '')
    params = params['img']
  if 'probe' in params:  # Inlined in its early ViT-G development files.
    params = dict(params)
    params['MAPHead_0'] = {k: params.pop(k) for k in (
        'probe', 'MultiHeadDotProductAttention_0', 'LayerNorm_0',
        'MlpBlock_0') if k in params}
  encoder = dict(params.get('Transformer', {}))
  if 'pos_embedding' in params:
    params = dict(params)
    posemb, before_cls = params.pop('pos_embedding'), True
  elif 'pos_embedding' in encoder:
    posemb = encoder.pop('pos_embedding')
    # Its older files added them after the class token (a square grid and
    # one row more), as ours do.
    n = np.shape(posemb)[1]
    before_cls = not (_is_square(n - 1) and not _is_square(n))
  else:
    return params
  if 'cls' in params and before_cls:  # The class token gets nothing added.
    posemb = np.concatenate([np.zeros_like(posemb[:, :1]), posemb], axis=1)
  logging.info('%s has big_vision\'s position-embedding layout: moved to '
               'Transformer/posembed_input%s', path,
               ', a zero row added for the class token'
               if 'cls' in params and before_cls else '')
  encoder['posembed_input'] = {'pos_embedding': posemb}
  return {**params, 'Transformer': encoder}


def _is_square(n: int) -> bool:
  return n >= 0 and int(round(n ** 0.5)) ** 2 == n


def _fix_groupnorm(params: Params) -> Params:
  """Reshapes (1, 1, 1, C) GroupNorm scales/biases of old hybrids to (C,)."""
  flat = traverse_util.flatten_dict(params)
  for k, v in flat.items():
    if (len(k) >= 2 and k[-2].startswith('gn') and k[-1] in ('scale', 'bias')
        and v.ndim == 4):
      flat[k] = v.reshape(-1)
  return traverse_util.unflatten_dict(flat)


def check_params(expected: Mapping[str, Any], found: Mapping[str, Any],
                 what: str = 'checkpoint') -> None:
  """Raises CheckpointError naming every missing, extra or mis-shaped key."""
  exp = {'/'.join(k): tuple(np.shape(v)) for k, v in
         traverse_util.flatten_dict(dict(expected)).items()}
  got = {'/'.join(k): tuple(np.shape(v)) for k, v in
         traverse_util.flatten_dict(dict(found)).items()}
  kinds = {  # Each kind's first lines are shown: together, they tell why.
      'missing': [f'missing key {k} (expected shape {exp[k]})'
                  for k in sorted(set(exp) - set(got))],
      'unexpected': [f'unexpected key {k} (shape {got[k]})'
                     for k in sorted(set(got) - set(exp))],
      'mis-shaped': [f'shape mismatch for {k}: expected {exp[k]}, found '
                     f'{got[k]}' for k in sorted(set(exp) & set(got))
                     if exp[k] != got[k]],
  }
  total = sum(len(lines) for lines in kinds.values())
  if total:
    shown = []
    for kind, lines in kinds.items():
      shown += lines[:_SHOWN]
      if len(lines) > _SHOWN:
        shown.append(f'... and {len(lines) - _SHOWN} more {kind}')
    raise CheckpointError(
        f'{what} does not fit the model ({total} problem(s)):\n  '
        + '\n  '.join(shown))


_SHOWN = 8  # Lines `check_params` shows of each kind of problem.
