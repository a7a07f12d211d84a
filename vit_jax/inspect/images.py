"""Images to inspect, pre-processed as the model was evaluated.

`load(data, n, trained)`: the first `n` images of a registered dataset's
eval split (or `split`), or of the image files under a folder (searched
recursively, sorted by path; `predict.list_images`). Either way they go
through the checkpoint's eval pre-processing (`trained.pp` at
`trained.image_size`, as `vit_jax.predict` does) and come back as float32
NHWC arrays. A folder's unreadable files are reported by name and skipped,
and so are the command's own outputs (`skip`): `--out` may lie inside
`--data`.
"""

from __future__ import annotations

import os
from typing import Callable, List, Optional, Tuple

import ml_collections
import numpy as np
from absl import logging


def _from_folder(folder: str, n: int, trained,
                 skip: Optional[Callable[[str], bool]] = None
                 ) -> Tuple[np.ndarray, List[str]]:
  from vit_jax import predict
  files = [f for f in predict.list_images([folder])
           if not (skip and skip(f))]
  if not files:
    raise FileNotFoundError(
        f'no images ({", ".join(predict.EXTENSIONS)}) under {folder}: pass '
        'a folder of image files or a dataset name (python -m vit_jax.data '
        'lists them)')
  load = predict.image_loader(trained)
  images, names = [], []
  for path in files:
    if len(images) == n:
      break
    try:
      images.append(load(path))
    except Exception as e:  # pylint: disable=broad-except
      logging.warning('skipping %s: %s', path, predict.error_reason(e))
      continue
    names.append(os.path.relpath(path, folder))
  if not images:
    raise ValueError(f'none of the {len(files)} image files under {folder} '
                     'could be read (see the warnings above)')
  return np.stack(images), names


def _from_dataset(name: str, n: int, trained, split: Optional[str],
                  data_dir: Optional[str]) -> Tuple[np.ndarray, List[str]]:
  from vit_jax.data import pipeline, prepare, registry
  registry.get(name)  # A clear error for unknown names.
  # Only what prepares offline is prepared here; anything else unprepared
  # is an error naming its prepare command (not a download of minutes).
  cfg = ml_collections.ConfigDict(dict(
      data=name, data_dir=data_dir, image_size=trained.image_size,
      eval_batch_size=min(n, 256), prepare=prepare.prepares_offline(name),
      pp_eval=list(trained.pp)))
  if split:
    cfg.eval_split = split
  prepare.ensure_prepared(cfg)
  images = []
  for batch in pipeline.eval_iterator(cfg):
    images.append(np.asarray(batch['image'])[np.asarray(batch['mask'])])
    if sum(len(x) for x in images) >= n:
      break
  x = np.concatenate(images)[:n].astype(np.float32)
  if x.shape[1:] != tuple(trained.image_shape):
    raise ValueError(f'{name} images come out as {x.shape[1:]}; the model '
                     f'takes {tuple(trained.image_shape)}')
  where = split or 'eval split'
  return x, [f'{name} ({where}) #{i}' for i in range(len(x))]


def check_source(data: str, split: Optional[str] = None,
                 data_dir: Optional[str] = None) -> None:
  """--split and --data_dir say where a named dataset's images are: for an
  image folder they would be ignored without a word, so they are refused
  (before the checkpoint is loaded)."""
  if not os.path.isdir(data):
    return
  given = [f'--{flag}={value}' for flag, value in (
      ('split', split), ('data_dir', data_dir)) if value]
  if given:
    raise ValueError(f'{" and ".join(given)} apply to dataset names only; '
                     f'--data={data} is an image folder, whose files are '
                     'all read: leave them out')


def load(data: str, n: int, trained, split: Optional[str] = None,
         data_dir: Optional[str] = None,
         skip: Optional[Callable[[str], bool]] = None
         ) -> Tuple[np.ndarray, List[str]]:
  """(images (n, H, W, C) as the model takes them, a name per image).
  `skip(path)`: True for a folder's files that are not inputs (the
  command's own figures, when --out is inside --data)."""
  if n < 1:
    raise ValueError(f'--images={n}: inspect at least one image')
  check_source(data, split, data_dir)
  if os.path.isdir(data):
    return _from_folder(data, n, trained, skip)
  if os.path.isfile(data):
    raise ValueError(f'--data={data} is a file: pass a folder of images or '
                     'a dataset name')
  from vit_jax.data import registry
  if (os.sep in data or data.startswith('.')) and (
      data not in registry.names()):  # vtab/cifar100 is a name.
    raise FileNotFoundError(f'--data={data}: no such folder')
  return _from_dataset(data, n, trained, split, data_dir)
