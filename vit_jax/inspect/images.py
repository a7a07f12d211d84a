"""Images to inspect: the first N of a registered dataset's eval split, or
the JPEG/PNG files of a folder (searched recursively, sorted by path).

Both give float32 NHWC arrays in [-1, 1] at the model's resolution and
channel count (grey images are repeated to RGB for RGB models; RGB images
averaged to grey for 1-channel models). A folder's unreadable files are
reported by name and skipped.
"""

from __future__ import annotations

import os
from typing import List, Tuple

import ml_collections
import numpy as np
from absl import logging

EXTENSIONS = ('.jpg', '.jpeg', '.png')


def _fit_channels(x: np.ndarray, channels: int) -> np.ndarray:
  if x.shape[-1] == channels:
    return x
  if channels == 1:
    return x.mean(axis=-1, keepdims=True)
  return np.repeat(x[..., :1], channels, axis=-1)


def folder_files(folder: str) -> List[str]:
  out = []
  for root, dirs, files in os.walk(folder):
    dirs[:] = sorted(d for d in dirs if not d.startswith(('.', '_')))
    out += [os.path.join(root, f) for f in sorted(files)
            if f.lower().endswith(EXTENSIONS) and not f.startswith(('.', '_'))]
  return out


def _from_folder(folder: str, n: int, size: int,
                 channels: int) -> Tuple[np.ndarray, List[str]]:
  from PIL import Image  # matplotlib's dependency.
  files = folder_files(folder)
  if not files:
    raise FileNotFoundError(
        f'no images ({"/".join(EXTENSIONS)}) under {folder}: pass a folder '
        'of JPEG/PNG files or a dataset name (python -m vit_jax.data lists '
        'them)')
  images, names = [], []
  for path in files:
    if len(images) == n:
      break
    try:
      with Image.open(path) as im:
        im = im.convert('L' if channels == 1 else 'RGB')
        w, h = im.size
        scale = size / min(w, h)  # Shorter side to `size`, centre crop.
        im = im.resize((max(size, round(w * scale)),
                        max(size, round(h * scale))), Image.BILINEAR)
        w, h = im.size
        left, top = (w - size) // 2, (h - size) // 2
        im = im.crop((left, top, left + size, top + size))
        x = np.asarray(im, np.float32).reshape(size, size, channels)
    except (OSError, ValueError) as e:
      logging.warning('skipping %s: not a readable image (%s)', path, e)
      continue
    images.append(x / 127.5 - 1)
    names.append(os.path.relpath(path, folder))
  if not images:
    raise ValueError(f'none of the {len(files)} image files under {folder} '
                     'could be read (see the warnings above)')
  return np.stack(images), names


def _from_dataset(name: str, n: int, size: int, channels: int,
                  split: str = None) -> Tuple[np.ndarray, List[str]]:
  from vit_jax.data import pipeline, prepare, registry
  registry.get(name)  # A clear error for unknown names.
  cfg = ml_collections.ConfigDict(dict(
      data=name, image_size=size, eval_batch_size=min(n, 256), prepare=True,
      pp_eval=f'decode|resize({size})|value_range(-1,1)'))
  if split:
    cfg.eval_split = split
  prepare.ensure_prepared(cfg)
  images = []
  for batch in pipeline.eval_iterator(cfg):
    images.append(np.asarray(batch['image'])[np.asarray(batch['mask'])])
    if sum(len(x) for x in images) >= n:
      break
  x = np.concatenate(images)[:n].astype(np.float32)
  used = split or 'its eval split'
  return _fit_channels(x, channels), [f'{name} ({used}) #{i}'
                                      for i in range(len(x))]


def load(data: str, n: int, size: int, channels: int,
         split: str = None) -> Tuple[np.ndarray, List[str]]:
  """(images (n, size, size, channels) in [-1, 1], a name per image)."""
  if n < 1:
    raise ValueError(f'--images={n}: inspect at least one image')
  if os.path.isdir(data):
    return _from_folder(data, n, size, channels)
  if os.sep in data or data.startswith('.'):
    raise FileNotFoundError(f'no such folder: {data}')
  return _from_dataset(data, n, size, channels, split)
