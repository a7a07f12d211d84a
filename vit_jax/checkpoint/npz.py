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
they are reshaped to (C,). Files are read with `allow_pickle=False` only.
"""

from __future__ import annotations

import io
import os
import tempfile
import zipfile
import zlib
from typing import Any, Dict, Mapping

import numpy as np
from etils import epath
from flax import traverse_util
from flax.training.checkpoints import convert_pre_linen

from vit_jax import outputs

Params = Dict[str, Any]


class CheckpointError(ValueError):
  """A checkpoint file that cannot be read or does not fit the model."""


class CheckpointNotFoundError(FileNotFoundError):
  """No checkpoint where one was asked for (the message says what to pass)."""


def save_npz(params: Mapping[str, Any], path: str) -> None:
  """Writes `params` as a flat npz, atomically (a crash keeps the old file)."""
  flat = {'/'.join(k): _to_numpy(v)
          for k, v in traverse_util.flatten_dict(dict(params)).items()}
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, suffix='.npz.tmp')
  try:
    with os.fdopen(fd, 'wb') as f:
      np.savez(f, **flat)
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
  flat = read_flat(path)
  params = traverse_util.unflatten_dict(
      {tuple(k.split('/')): v for k, v in flat.items()})
  return _fix_groupnorm(convert_pre_linen(params))


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
  problems = []
  for k in sorted(set(exp) - set(got)):
    problems.append(f'missing key {k} (expected shape {exp[k]})')
  for k in sorted(set(got) - set(exp)):
    problems.append(f'unexpected key {k} (shape {got[k]})')
  for k in sorted(set(exp) & set(got)):
    if exp[k] != got[k]:
      problems.append(f'shape mismatch for {k}: expected {exp[k]}, '
                      f'found {got[k]}')
  if problems:
    shown = '\n  '.join(problems[:20])
    more = f'\n  ... and {len(problems) - 20} more' if len(problems) > 20 else ''
    raise CheckpointError(
        f'{what} does not fit the model ({len(problems)} problem(s)):\n  '
        f'{shown}{more}')
