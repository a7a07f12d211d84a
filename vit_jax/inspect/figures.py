"""The paper's analysis figures drawn with matplotlib (files, no display).

Each function takes the arrays `vit_jax.inspect.analysis` returns and writes
one PNG; titles, axis labels and colour bars make each readable on its own.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import matplotlib
import matplotlib.patches  # noqa: F401  (matplotlib.patches.Rectangle)

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is set)
import numpy as np  # noqa: E402

DPI = 110


def _save(fig, path: str, dpi: float = DPI) -> str:
  fig.savefig(path, dpi=dpi, bbox_inches='tight')
  plt.close(fig)
  return path


def _show_image(ax, image):
  """An HWC image in [-1, 1] (1 or 3 channels); NaN pixels (those the
  model never sees) are drawn hatched over the background."""
  x = np.asarray(image, np.float32)
  unseen = np.isnan(x).any(-1)
  x = np.clip((np.nan_to_num(x, nan=-1) + 1) / 2, 0, 1)
  if x.shape[-1] == 1:
    x = np.repeat(x, 3, axis=-1)
  ax.imshow(np.concatenate([x, (~unseen)[..., None].astype(np.float32)],
                           axis=-1))
  if unseen.any():  # The bottom rows and right columns past the patches.
    h, w = unseen.shape
    seen_h = int(np.flatnonzero(~unseen.all(1)).max(initial=-1)) + 1
    seen_w = int(np.flatnonzero(~unseen.all(0)).max(initial=-1)) + 1
    for xy, width, height in (((seen_w - .5, -.5), w - seen_w, h),
                              ((-.5, seen_h - .5), seen_w, h - seen_h)):
      if width and height:
        ax.add_patch(matplotlib.patches.Rectangle(
            xy, width, height, fill=False, hatch='////', edgecolor='0.5',
            linewidth=0))
  ax.set_xticks([])
  ax.set_yticks([])


def filters(components: np.ndarray, path: str, title: str) -> str:
  """Fig 7 (left): each principal component of the patch-embedding filters
  as a P x P patch (RGB, or grey for 1-channel models), each scaled to its
  own min/max."""
  k = len(components)
  cols = min(7, k)
  rows = -(-k // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(1.3 * cols, 1.3 * rows + 0.6),
                           squeeze=False)
  for i, ax in enumerate(axes.ravel()):
    ax.axis('off')
    if i >= k:
      continue
    c = components[i]
    c = (c - c.min()) / max(float(c.max() - c.min()), 1e-12)
    ax.imshow(c[..., 0] if c.shape[-1] == 1 else c,
              cmap='gray' if c.shape[-1] == 1 else None,
              interpolation='nearest')
    ax.set_title(f'PC {i + 1}', fontsize=7)
  fig.suptitle(title, fontsize=10)
  return _save(fig, path)


def position_similarity(sim: np.ndarray, path: str, title: str) -> str:
  """Fig 7 (centre) / Fig 10: for each patch position (row i, column j), a
  small map of its position embedding's cosine similarity with every
  other position."""
  gh, gw = sim.shape[:2]
  pad = 1
  mosaic = np.full((gh * (gh + pad) - pad, gw * (gw + pad) - pad), np.nan)
  for i in range(gh):
    for j in range(gw):
      r, c = i * (gh + pad), j * (gw + pad)
      mosaic[r:r + gh, c:c + gw] = sim[i, j]
  size = min(10.0, 2.0 + 0.5 * max(gh, gw))
  fig, ax = plt.subplots(figsize=(size + 1.2, size))
  cmap = plt.get_cmap('viridis').with_extremes(bad='white')
  im = ax.imshow(mosaic, cmap=cmap, vmin=-1, vmax=1, interpolation='nearest')
  step = gh + pad
  ax.set_yticks([i * step + (gh - 1) / 2 for i in range(gh)])
  ax.set_yticklabels([str(i + 1) for i in range(gh)], fontsize=7)
  step = gw + pad
  ax.set_xticks([j * step + (gw - 1) / 2 for j in range(gw)])
  ax.set_xticklabels([str(j + 1) for j in range(gw)], fontsize=7)
  ax.set_xlabel('Input patch column')
  ax.set_ylabel('Input patch row')
  fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label='Cosine similarity')
  ax.set_title(title, fontsize=10)
  # At least one output pixel per mosaic pixel: fewer drop whole cells and
  # separators of large grids (ViT-L/16 at 512 px: 32x32).
  fig.canvas.draw()
  box = ax.get_window_extent().transformed(fig.dpi_scale_trans.inverted())
  dpi = max(DPI, math.ceil(1.1 * max(mosaic.shape[1] / box.width,
                                     mosaic.shape[0] / box.height)))
  return _save(fig, path, dpi)


def attention_distance(distance: np.ndarray, path: str, title: str,
                       image_size: Optional[int] = None) -> str:
  """Fig 7 (right) / Fig 11: one dot per head, mean attention distance in
  pixels against the layer (network depth)."""
  layers, heads = distance.shape
  fig, ax = plt.subplots(figsize=(5.5, 4))
  colours = plt.get_cmap('tab20')(np.linspace(0, 1, max(heads, 2)))
  for h in range(heads):
    ax.scatter(np.arange(1, layers + 1), distance[:, h], s=14,
               color=colours[h], label=f'Head {h + 1}')
  ax.set_xlabel('Network depth (layer)')
  ax.set_ylabel('Mean attention distance (pixels)')
  ax.set_xticks(range(1, layers + 1))
  if image_size:
    ax.set_ylim(0, image_size)
  if heads <= 16:
    ax.legend(fontsize=6, ncol=2, loc='lower right')
  ax.grid(alpha=0.3)
  ax.set_title(title, fontsize=10)
  return _save(fig, path)


def _upsample(m: np.ndarray, size: int, stride: int) -> np.ndarray:
  """A (grid_h, grid_w) map on `size` x `size` pixels: each patch covers
  exactly its `stride` x `stride` pixels, as the model cut them; the last
  size - grid * stride rows and columns, which no patch covers (a plain
  ViT at a size that is not a multiple of its patch), are NaN."""
  gh, gw = m.shape
  if gh * stride > size or gw * stride > size:
    raise ValueError(f'a {gh}x{gw} grid of {stride}-pixel patches does not '
                     f'fit in {size} pixels')
  out = np.full((size, size), np.nan)
  out[:gh * stride, :gw * stride] = np.kron(m, np.ones((stride, stride)))
  return out


def rollout(images: np.ndarray, maps: np.ndarray, path: str,
            title: str, pixels_per_token: Optional[int] = None) -> str:
  """Fig 6: each input image, its rollout map (patch grid) and the image
  weighted by the map (normalised to max 1). `pixels_per_token`: the
  model's patch side in pixels (default: the image side over the grid's,
  right when the patches tile the image); pixels past the last patch are
  hatched in the weighted image: the model never saw them."""
  n = len(images)
  stride = pixels_per_token or images.shape[1] // maps.shape[1]
  fig, axes = plt.subplots(n, 3, figsize=(6.3, 2.1 * n + 0.9), squeeze=False,
                           layout='constrained')
  for i in range(n):
    m = maps[i] / max(float(maps[i].max()), 1e-12)
    _show_image(axes[i, 0], images[i])
    im = axes[i, 1].imshow(m, cmap='inferno', vmin=0, vmax=1,
                           interpolation='nearest')
    axes[i, 1].set_xticks([])
    axes[i, 1].set_yticks([])
    up = _upsample(m, images.shape[1], stride)[..., None]
    _show_image(axes[i, 2], (np.asarray(images[i]) + 1) * up - 1)
    if i == 0:
      axes[i, 0].set_title('Input', fontsize=9)
      axes[i, 1].set_title('Attention rollout', fontsize=9)
      axes[i, 2].set_title('Input x rollout', fontsize=9)
  label = 'Attention rollout (each map scaled to max = 1)'
  unseen = images.shape[1] - maps.shape[1] * stride
  if unseen:
    label += (f'\nhatched: the last {unseen} pixel rows and columns, past '
              'the last whole patch, which the model does not see')
  fig.colorbar(im, ax=axes[-1, :].tolist(), location='bottom', shrink=0.6,
               label=label)
  fig.suptitle(title, fontsize=10)
  return _save(fig, path)


def rollout_layers(images: np.ndarray, maps: np.ndarray, path: str,
                   title: str, layer_labels: Sequence[str]) -> str:
  """Fig 14: per image (rows), the rollout up to each layer (columns)."""
  layers, n = maps.shape[:2]
  fig, axes = plt.subplots(n, layers + 1,
                           figsize=(1.5 * (layers + 1) + 0.8, 1.6 * n + 1.2),
                           squeeze=False, layout='constrained')
  for i in range(n):
    _show_image(axes[i, 0], images[i])
    for l in range(layers):
      m = maps[l, i] / max(float(maps[l, i].max()), 1e-12)
      im = axes[i, l + 1].imshow(m, cmap='inferno', vmin=0, vmax=1,
                                 interpolation='nearest')
      axes[i, l + 1].set_xticks([])
      axes[i, l + 1].set_yticks([])
      if i == 0:
        axes[i, l + 1].set_title(layer_labels[l], fontsize=8)
  axes[0, 0].set_title('Input', fontsize=8)
  fig.colorbar(im, ax=axes[-1, :].tolist(), location='bottom', shrink=0.5,
               label='Attention rollout (each map scaled to max = 1)')
  fig.suptitle(title, fontsize=10)
  return _save(fig, path)
