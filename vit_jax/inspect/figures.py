"""The paper's analysis figures drawn with matplotlib (files, no display).

Each function takes the arrays `vit_jax.inspect.analysis` returns and writes
one PNG; titles, axis labels and colour bars make each readable on its own.
"""

from __future__ import annotations

from typing import Optional, Sequence

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is set)
import numpy as np  # noqa: E402

DPI = 110


def _save(fig, path: str) -> str:
  fig.savefig(path, dpi=DPI, bbox_inches='tight')
  plt.close(fig)
  return path


def _show_image(ax, image):
  """An NHWC image in [-1, 1] (1 or 3 channels)."""
  x = np.clip((np.asarray(image, np.float32) + 1) / 2, 0, 1)
  if x.shape[-1] == 1:
    ax.imshow(x[..., 0], cmap='gray', vmin=0, vmax=1)
  else:
    ax.imshow(x)
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
  return _save(fig, path)


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


def _upsample(m: np.ndarray, size: int) -> np.ndarray:
  reps = -(-size // m.shape[0])
  return np.kron(m, np.ones((reps, reps)))[:size, :size]


def rollout(images: np.ndarray, maps: np.ndarray, path: str,
            title: str) -> str:
  """Fig 6: each input image, its rollout map (patch grid) and the image
  weighted by the map (normalised to max 1)."""
  n = len(images)
  fig, axes = plt.subplots(n, 3, figsize=(6.3, 2.1 * n + 0.9), squeeze=False,
                           layout='constrained')
  for i in range(n):
    m = maps[i] / max(float(maps[i].max()), 1e-12)
    _show_image(axes[i, 0], images[i])
    im = axes[i, 1].imshow(m, cmap='inferno', vmin=0, vmax=1,
                           interpolation='nearest')
    axes[i, 1].set_xticks([])
    axes[i, 1].set_yticks([])
    up = _upsample(m, images.shape[1])[..., None]
    _show_image(axes[i, 2], (np.asarray(images[i]) + 1) * up - 1)
    if i == 0:
      axes[i, 0].set_title('Input', fontsize=9)
      axes[i, 1].set_title('Attention rollout', fontsize=9)
      axes[i, 2].set_title('Input x rollout', fontsize=9)
  fig.colorbar(im, ax=axes[-1, :].tolist(), location='bottom', shrink=0.6,
               label='Attention rollout (each map scaled to max = 1)')
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
