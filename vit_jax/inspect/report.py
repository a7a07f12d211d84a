"""One inspection: a trained model + images -> the figures and inspect.json.

`inspect_model(trained, images, out)` computes every analysis that applies
to the model and writes its figure; what does not apply (pixel filters of a
hybrid, whose patch embedding runs on ResNet features) is skipped with a
one-line reason, recorded in inspect.json. Attention is computed in batches
and reduced on the device (`analysis.attention_summary`), so `--images=128`
at 384 px never holds a (layers, batch, heads, T, T) tensor on the host.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from typing import Any, Dict, Optional, Sequence

import numpy as np
from absl import logging

from vit_jax import models
from vit_jax.inspect import analysis, figures

FILES = ('filters.png', 'position_similarity.png', 'attention_distance.png',
         'rollout.png', 'rollout_layers.png', 'inspect.json')


def similarity_summary(sim: np.ndarray) -> Dict[str, float]:
  """How much 2-D structure the position embeddings learned: mean cosine
  similarity of distinct positions in the same row, the same column and
  neither; its correlation with the spatial distance; and the similarity of
  each position's nearest neighbours (4-neighbourhood) vs all others."""
  gh, gw = sim.shape[:2]
  r, c = np.meshgrid(np.arange(gh), np.arange(gw), indexing='ij')
  r, c = r.ravel(), c.ravel()
  s = sim.reshape(gh * gw, gh * gw)
  off = ~np.eye(gh * gw, dtype=bool)
  same_row = (r[:, None] == r[None]) & off
  same_col = (c[:, None] == c[None]) & off
  neither = off & ~same_row & ~same_col
  dist = np.sqrt((r[:, None] - r[None]) ** 2 + (c[:, None] - c[None]) ** 2)
  neighbour = (dist == 1)
  mean = lambda m: float(s[m].mean()) if m.any() else float('nan')
  corr = (float(np.corrcoef(s[off], dist[off])[0, 1])
          if off.sum() > 1 else float('nan'))
  return dict(same_row=mean(same_row), same_column=mean(same_col),
              neither=mean(neither), neighbours=mean(neighbour),
              non_neighbours=mean(off & ~neighbour),
              correlation_with_distance=corr)


def _title(trained, what: str) -> str:
  """`what`, then the model inspected (its options too: a smoke run's
  shrunk ViT is not the zoo's) and where it came from."""
  where = '/'.join(trained.source.rstrip('/').split('/')[-3:])
  return f'{what}\n{trained.architecture} ({where})'


def inspect_model(trained, images: np.ndarray, names: Sequence[str],
                  out: str, *, batch: int = 32, rollout_images: int = 8,
                  layer_images: int = 4, native=None) -> Dict[str, Any]:
  """Writes the figures and inspect.json into `out`; returns the JSON.

  `native`: the checkpoint at its own resolution, when `trained` is it at
  another (`trained.resized`): the position similarity is computed from
  its embeddings, as trained, not from their interpolation to `trained`'s
  grid (which makes neighbours similar whatever was learned). Without it,
  a `trained` whose embeddings were interpolated skips that figure.

  The files are written into a temporary folder inside `out` and moved
  into place at the end, after this run's known names (`FILES`) are
  cleared from `out`: a failed run leaves the previous results as they
  were, a finished one leaves no figure of an earlier run beside its own
  (e.g. filters.png of a model whose filters this run skips). The names
  written are `result['files']`."""
  for flag, value in (('batch', batch), ('rollout_images', rollout_images),
                      ('layer_images', layer_images)):
    _check_count(flag, value)
  os.makedirs(out, exist_ok=True)
  staging = tempfile.mkdtemp(prefix='.inspect-', dir=out)
  try:
    result = _inspect_into(staging, trained, images, names, batch=batch,
                           rollout_images=rollout_images,
                           layer_images=layer_images, native=native)
    for name in FILES:
      path = os.path.join(out, name)
      if os.path.isfile(path) or os.path.islink(path):
        os.remove(path)
    for name in result['files']:
      os.replace(os.path.join(staging, name), os.path.join(out, name))
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  logging.info('wrote %s into %s', ', '.join(result['files']), out)
  return result


def _checkpoint_grid(trained):
  """The (rows, cols) patch grid of the checkpoint's own position
  embeddings, before any resize (from `native_image_size`, the smallest
  side that makes it); None when unknown."""
  if trained.native_image_size is None:
    return None
  side = trained.native_image_size // trained.stride
  return (side, side)


def _at_own_size(trained, native):
  """The checkpoint at its own resolution: `native`, or `trained` itself
  when its position embeddings are the checkpoint's (same grid: nothing
  was interpolated); None when they were interpolated and `native` is
  unknown."""
  if native is not None:
    return native
  own = analysis.grid_of(trained.params)[0]
  return trained if _checkpoint_grid(trained) in (None, own) else None


def _inspect_into(out: str, trained, images: np.ndarray,
                  names: Sequence[str], *, batch: int, rollout_images: int,
                  layer_images: int, native=None) -> Dict[str, Any]:
  model, params = trained.model('float32'), trained.params
  size = images.shape[1]
  ppt = trained.stride
  grid = models.patch_grid(model, (size, size))
  # Fixed position embeddings (posemb='sincos2d') are defined at any grid:
  # nothing was learned, nothing interpolated.
  fixed = getattr(model, 'posemb', 'learn') != 'learn'
  if fixed:  # Its own size is known only where the run recorded it.
    native, native_grid = trained, _checkpoint_grid(trained)
  else:
    native = _at_own_size(trained, native)
    native_grid = (analysis.grid_of(native.params)[0] if native is not None
                   else _checkpoint_grid(trained))
  result: Dict[str, Any] = dict(
      model=trained.name, architecture=trained.architecture,
      checkpoint=trained.source, checkpoint_kind=trained.kind,
      image_size=size,
      checkpoint_image_size=(native.image_size
                             if native is not None and not fixed
                             else trained.native_image_size),
      checkpoint_grid=list(native_grid) if native_grid else None,
      position_embeddings_interpolated=not fixed and native_grid != grid,
      grid=list(grid), pixels_per_token=ppt,
      pixels_not_seen=size - grid[0] * ppt, images=len(images),
      image_names=list(names), skipped={}, files=[])
  written = result['files']
  classifier = getattr(model, 'classifier', 'token')

  # Fig 7 (left): embedding filters.
  try:
    comps = analysis.embedding_filter_components(params)
    kernel = np.asarray(params['embedding']['kernel'], np.float64)
    x = kernel.reshape(-1, kernel.shape[-1]).T
    sv = np.linalg.svd(x - x.mean(0), compute_uv=False) ** 2
    result['filters'] = dict(
        components=len(comps), shape=list(comps.shape[1:]),
        explained_variance=[float(v) for v in sv[:len(comps)] / sv.sum()])
    if comps.shape[-1] not in (1, 3):
      raise ValueError(f'{comps.shape[-1]}-channel filters cannot be drawn '
                       'as RGB or grey patches (their numbers are in '
                       'inspect.json)')
    figures.filters(comps, os.path.join(out, 'filters.png'), _title(
        trained, f'Top-{len(comps)} principal components of the '
        'patch-embedding filters'))
    written.append('filters.png')
  except ValueError as e:
    _skip(result, 'filters.png', str(e))

  # Fig 7 (centre) / Fig 10: position-embedding similarity, of the
  # embeddings as the checkpoint learned them (not their interpolation).
  try:
    if fixed:
      raise ValueError(
          f'the model\'s position embeddings are fixed (posemb='
          f'{model.posemb!r}), not learned: the figure would show the '
          'formula, not what training learned')
    result['position_similarity'] = _position_similarity(
        out, trained, native, native_grid, grid)
    written.append('position_similarity.png')
  except ValueError as e:
    _skip(result, 'position_similarity.png', str(e))

  # Attention, batch by batch, reduced on the device: distances over all
  # images, rollout maps kept for the images drawn.
  token_row = classifier == 'token'  # 'gap' models have no class token.
  total = np.zeros((model.num_layers, model.num_heads))
  drawn = max(rollout_images, layer_images)
  roll = []
  for start in range(0, len(images), batch):
    x = images[start:start + batch]
    distance, maps = analysis.attention_summary(
        model, params, x, grid, ppt, class_token_row=token_row)
    total += distance * len(x)
    if start < drawn:
      roll.append(maps[:, :drawn - start])
  distance = total / len(images)
  figures.attention_distance(
      distance, os.path.join(out, 'attention_distance.png'),
      _title(trained, f'Mean attention distance ({len(images)} images)'),
      image_size=size)
  written.append('attention_distance.png')
  result['attention_distance'] = dict(
      per_layer_per_head=distance.round(3).tolist(),
      mean_per_layer=distance.mean(1).round(3).tolist(),
      min_per_layer=distance.min(1).round(3).tolist(),
      max_per_layer=distance.max(1).round(3).tolist(),
      uniform_attention=float(analysis.pairwise_distances(grid, ppt).mean()))

  maps = np.concatenate(roll, axis=1)  # (layers, n, grid_h, grid_w)
  how = ('class-token row' if token_row else
         'mean over all tokens\' rows (no class token)')
  n = min(rollout_images, len(images))
  figures.rollout(images[:n], maps[-1, :n],
                  os.path.join(out, 'rollout.png'),
                  _title(trained, f'Attention rollout: {how}'),
                  pixels_per_token=ppt)
  k = min(layer_images, len(images))
  figures.rollout_layers(
      images[:k], maps[:, :k], os.path.join(out, 'rollout_layers.png'),
      _title(trained, f'Attention rollout after each layer: {how}'),
      [f'Layer {l + 1}' for l in range(model.num_layers)])
  written.extend(['rollout.png', 'rollout_layers.png'])
  result['rollout'] = dict(
      method=how, images=list(names[:n]),
      maps=maps[-1, :n].round(5).tolist(),
      per_layer_images=list(names[:k]))

  written.append('inspect.json')
  with open(os.path.join(out, 'inspect.json'), 'w') as f:
    json.dump(result, f, indent=1)
  return result


def _position_similarity(out: str, trained, native, native_grid,
                         grid) -> Dict[str, Any]:
  """Draws position_similarity.png from the checkpoint's own embeddings
  (`native`) and returns its summary, with the grid it is of. At another
  image size the interpolated embeddings would score their neighbours
  high whatever the checkpoint learned (i.i.d. random ones: 0.76 at twice
  the size), and a fresh initialisation at that size would not: the
  trained-vs-random comparison would be biased."""
  if native is None:
    raise ValueError(
        f'the position embeddings were interpolated from the checkpoint\'s '
        f'{native_grid[0]}x{native_grid[1]} grid to {grid[0]}x{grid[1]}: '
        'their similarity would show the interpolation; pass native= (the '
        'checkpoint at its own size) to draw it')
  gh, gw = native_grid
  sim = analysis.position_similarity(native.params, native_grid)
  what = f'the checkpoint\'s {gh}x{gw} grid'
  if native_grid != grid:
    what += (f', as trained\n(inspected at {grid[0]}x{grid[1]}, the '
             'embeddings interpolated)')
  figures.position_similarity(
      sim, os.path.join(out, 'position_similarity.png'),
      _title(trained, f'Position embedding similarity (cosine): {what}'))
  return dict(grid=[gh, gw], **similarity_summary(sim))


def _skip(result: Dict[str, Any], name: str, reason: str) -> None:
  reason = reason.splitlines()[0]
  logging.warning('skipping %s: %s', name, reason)
  result['skipped'][name] = reason


def run(init: str, data: str, out: str, *, model: str = None,
        image_size: int = None, images: int = 128, split: str = None,
        batch: int = 32, rollout_images: int = 8, layer_images: int = 4,
        random_init: bool = False, seed: Optional[int] = None,
        raw: bool = False, data_dir: str = None) -> Dict[str, Any]:
  """`python -m vit_jax.inspect`: open the checkpoint, check that the model
  has attention, read the images, check them against the model, then
  `inspect_model`. With `random_init`, the checkpoint only names the
  model: a fresh initialisation (`seed`, default 0; refused without
  `random_init`) of it is inspected, the baseline
  trained figures are compared with; at another `image_size` it is made
  at the checkpoint's size and resized as the checkpoint is, so that both
  are measured alike. `raw`:
  a run's raw parameters instead of its Polyak averages. `data_dir`: where
  a dataset named by `data` is (as `input.data_dir`)."""
  from vit_jax import outputs, trained as trained_lib
  from vit_jax.inspect import images as images_lib
  # Every flag checked before any work (loading a checkpoint takes seconds
  # to minutes; the counts would only fail after all the computing).
  for flag, value in (('images', images), ('batch', batch),
                      ('rollout_images', rollout_images),
                      ('layer_images', layer_images)):
    _check_count(flag, value)
  _check_image_size(image_size)
  if seed is not None and not random_init:
    raise ValueError(f'--seed={seed} seeds --random_init\'s initialisation '
                     'only: add --random_init, or leave --seed out')
  out = _output_folder(outputs.directory(out, '--out', remote=False))
  data = os.path.expanduser(data)  # --data=~/photos reaches us unexpanded.
  data_dir = os.path.expanduser(data_dir) if data_dir else data_dir
  images_lib.check_source(data, split, data_dir)
  # The checkpoint at its own size first: its position embeddings as
  # trained are what position_similarity.png shows (Fig 7 centre).
  load = functools.partial(trained_lib.load, init, model=model,
                           require_head=False, ema=False if raw else None)
  try:
    native = load()
  except trained_lib.ImageSizeUnknown:
    if not image_size:
      raise
    native = load(image_size=image_size)  # Its own size: unknown.
  if random_init:
    native = trained_lib.reinitialised(native, seed or 0)
  # Before the images: a dataset may need downloading or preparing first,
  # work (or an error about it) wasted on a model with nothing to inspect.
  check_model(native)
  trained = (trained_lib.resized(native, image_size)
             if image_size and image_size != native.image_size else native)
  x, names = images_lib.load(data, images, trained, split, data_dir,
                             skip=functools.partial(is_output, out))
  check_inputs(trained, x)
  result = inspect_model(trained, x, names, out, batch=batch,
                         rollout_images=rollout_images,
                         layer_images=layer_images, native=native)
  d = result['attention_distance']['mean_per_layer']
  print(f'{trained.architecture} from {trained.source}: {len(x)} images '
        f'at {trained.image_size}px; mean attention distance per layer (px): '
        f'{", ".join(f"{v:.1f}" for v in d)}; wrote '
        f'{", ".join(result["files"])} into {out}')
  return result


def _check_count(flag: str, value: int) -> None:
  if not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f'--{flag}={value}: pass a whole number of at least 1')


def _check_image_size(image_size) -> None:
  """None is the checkpoint's size; 0 would silently be taken as that, a
  negative one fail deep in the pre-processing."""
  if image_size is not None and (
      not isinstance(image_size, (int, np.integer)) or image_size < 1):
    raise ValueError(f'--image_size={image_size}: pass a positive side in '
                     'pixels, or leave it out for the checkpoint\'s')


def is_output(out: str, path: str) -> bool:
  """Whether `path` is one of the files this command writes (`FILES`) in
  `out` or in another folder it wrote (one holding its `inspect.json`):
  with `--out` inside `--data` (or the same folder), this or an earlier
  run's figures, e.g. `--out=photos/trained` then `--random_init
  --out=photos/random`, are not read back as images to inspect. (The
  staging folder, `.inspect-*`, is hidden: image folders are listed
  without hidden folders.) Only those names: the photos beside them are
  inputs."""
  folder, name = os.path.split(os.path.realpath(path))
  return name in FILES and (
      folder == os.path.realpath(out)
      or os.path.isfile(os.path.join(folder, 'inspect.json')))


def _output_folder(out: str) -> str:
  """`out`, or a clear error now if it can never be created: a file where
  one of its parent folders should be, or a read-only parent."""
  parent = os.path.abspath(out)
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise ValueError(f'--out={out}: {parent} is a file, not a folder; pass '
                     'a folder path under a folder')
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ValueError(f'--out={out}: {parent} is not writable; pass a folder '
                     'you can write to')
  return out


def check_model(trained) -> None:
  """A clear error for a model without self-attention (BiT, Mixer): there
  is nothing to inspect, whatever the images."""
  if not hasattr(trained.model(), 'capture_attention'):
    raise ValueError(f'{trained.name} has no self-attention to inspect (a '
                     f'{trained.family} model); pass a ViT or hybrid '
                     '(R50+ViT)')


def check_inputs(trained, images: np.ndarray) -> None:
  """Clear errors before any compile: a model without attention, or images
  whose size does not cut into the patches of a model that needs whole
  ones (a hybrid: its ResNet stem pads). A plain ViT takes any size, as it
  was trained: size // patch patches per side, the last size % patch rows
  and columns of pixels left out (ViT-H/14 at 384 px: 27x27)."""
  check_model(trained)
  size, ppt = images.shape[1], trained.stride
  if size % ppt and not trained.model().drops_partial_patches:
    raise ValueError(f'--image_size={size} does not cut into the model\'s '
                     f'{ppt}x{ppt}-pixel patches (a hybrid needs whole '
                     f'ones): use a multiple of {ppt}, '
                     f'e.g. {size // ppt * ppt or ppt}')


