"""The numbers behind the paper's analysis figures (§4.5; Figs 6, 7, 10, 11, 14).

All functions take host or device arrays and return numpy float32 arrays:

  * `attention_weights`: every block's softmax attention, one forward pass;
  * `attention_rollout`: Abnar & Zuidema's rollout (Fig 6, Fig 14);
  * `mean_attention_distance`: attention-weighted query-key distance in
    input pixels, per layer and head (Fig 7 right, Fig 11);
  * `position_similarity`: cosine similarity of position embeddings
    (Fig 7 centre, Fig 10);
  * `embedding_filter_components`: principal components of the patch
    embedding filters (Fig 7 left).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import jax
import numpy as np

POSEMB = ('Transformer', 'posembed_input', 'pos_embedding')
ATTENTION = ('MultiHeadDotProductAttention_0', 'attention_weights')


def _variables(params):
  return params if 'params' in params else {'params': params}


def attention_weights(model, params, images) -> np.ndarray:
  """Softmax attention of every encoder block: float32
  (layers, batch, heads, tokens, tokens), rows (queries) summing to 1.

  The same deterministic forward pass as `model.apply(..., train=False)`,
  with each block's weights computed explicitly and sown into the
  `intermediates` collection; the train and eval steps never do this.
  """
  if not hasattr(model, 'capture_attention'):
    raise ValueError(f'{type(model).__name__} has no self-attention to '
                     'inspect (a ResNet); pass a ViT or hybrid (R50+ViT)')
  probe = model.clone(capture_attention=True, attention_impl='explicit')
  _, state = _forward(probe, _variables(params), images)
  blocks = state['intermediates']['Transformer']
  if model.scan_layers:
    node = blocks['encoderblock']
    for key in ATTENTION:
      node = node[key]
    stacked = node[0]  # (layers, batch, heads, tokens, tokens)
  else:
    per_layer = []
    for i in range(model.num_layers):
      node = blocks[f'encoderblock_{i}']
      for key in ATTENTION:
        node = node[key]
      per_layer.append(node[0])
    stacked = np.stack([np.asarray(w) for w in per_layer])
  return np.asarray(stacked, np.float32)


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, variables, images):
  return model.apply(variables, images, train=False,
                     mutable=['intermediates'])


def attention_rollout(weights, *, per_layer: bool = False) -> np.ndarray:
  """Attention rollout (Abnar & Zuidema 2020), as the paper's Appendix D.8.

  Per image: average the heads, add the identity (the residual path),
  renormalise each row to sum 1, and multiply through the layers with the
  last layer on the left. `weights`: (layers, batch, heads, T, T).

  Returns (batch, T, T); with `per_layer`, (layers, batch, T, T): the rollout
  up to and including each layer (Fig 14). Row i says how much each input
  token flows into output token i.
  """
  w = np.asarray(weights, np.float64)
  if w.ndim != 5 or w.shape[-1] != w.shape[-2]:
    raise ValueError('weights must be (layers, batch, heads, tokens, tokens), '
                     f'got shape {w.shape}')
  a = w.mean(axis=2) + np.eye(w.shape[-1])
  a /= a.sum(axis=-1, keepdims=True)
  out, joint = [], a[0]
  out.append(joint)
  for layer in a[1:]:
    joint = layer @ joint
    out.append(joint)
  result = np.stack(out) if per_layer else joint
  return result.astype(np.float32)


def _patch_centres(grid_shape: Tuple[int, int],
                   pixels_per_token: float) -> np.ndarray:
  gh, gw = grid_shape
  rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing='ij')
  return (np.stack([rows.ravel(), cols.ravel()], -1) + 0.5) * pixels_per_token


def pairwise_distances(grid_shape: Tuple[int, int],
                       pixels_per_token: float) -> np.ndarray:
  """(N, N) Euclidean distances in pixels between patch centres, row-major."""
  c = _patch_centres(grid_shape, pixels_per_token)
  return np.sqrt(((c[:, None, :] - c[None, :, :]) ** 2).sum(-1))


def mean_attention_distance(weights, grid_shape: Sequence[int],
                            pixels_per_token: float) -> np.ndarray:
  """Attention distance in input pixels, (layers, heads).

  For each query patch, the distance to each key patch centre weighted by
  the attention weight; queries and keys are the grid's patch tokens only
  (leading tokens such as the class token are dropped and each query's
  weights renormalised over the patch keys). Averaged over queries and
  images. The paper's "attention distance", analogous to receptive field
  size in CNNs.
  """
  w = np.asarray(weights, np.float64)
  gh, gw = (int(g) for g in grid_shape)
  n = gh * gw
  if w.ndim != 5 or w.shape[-1] != w.shape[-2]:
    raise ValueError('weights must be (layers, batch, heads, tokens, tokens), '
                     f'got shape {w.shape}')
  lead = w.shape[-1] - n
  if lead < 0:
    raise ValueError(f'a {gh}x{gw} patch grid has {n} tokens but the '
                     f'attention has only {w.shape[-1]}: pass the grid of '
                     'the images the weights were computed on')
  w = w[..., lead:, lead:]
  w = w / np.maximum(w.sum(-1, keepdims=True), 1e-30)
  d = pairwise_distances((gh, gw), pixels_per_token)
  per_query = np.einsum('lbhqk,qk->lbhq', w, d)
  return per_query.mean(axis=(1, 3)).astype(np.float32)


def grid_of(params, tokens: Optional[int] = None) -> Tuple[Tuple[int, int],
                                                            int]:
  """((grid_h, grid_w), leading tokens) of the position embeddings in
  `params`, for a square grid (leading: 1 with a class token)."""
  p = _variables(params)['params']
  lead = 1 if 'cls' in p else 0
  n = (tokens if tokens is not None else _get(p, POSEMB).shape[1]) - lead
  side = int(round(np.sqrt(n)))
  if side * side != n:
    raise ValueError(f'{n} position embeddings do not form a square grid; '
                     'pass grid_shape=(rows, cols)')
  return (side, side), lead


def _get(tree, path):
  for key in path:
    if key not in tree:
      raise ValueError(f'the params have no {"/".join(path)}: not a '
                       'ViT checkpoint (see vit_jax.models)')
    tree = tree[key]
  return np.asarray(tree)


def position_similarity(params, grid_shape: Optional[Sequence[int]] = None
                        ) -> np.ndarray:
  """Cosine similarity between the patch position embeddings:
  (grid_h, grid_w, grid_h, grid_w); [i, j] is the map of patch (i, j)'s
  similarity with every other patch (class-token row excluded)."""
  p = _variables(params)['params']
  pe = _get(p, POSEMB)[0].astype(np.float64)
  lead = 1 if 'cls' in p else 0
  if grid_shape is None:
    (gh, gw), lead = grid_of(params)
  else:
    gh, gw = (int(g) for g in grid_shape)
    if pe.shape[0] - lead != gh * gw:
      raise ValueError(f'grid {gh}x{gw} needs {gh * gw} patch position '
                       f'embeddings; the checkpoint has {pe.shape[0] - lead}')
  pe = pe[lead:]
  pe = pe / np.maximum(np.linalg.norm(pe, axis=-1, keepdims=True), 1e-12)
  return (pe @ pe.T).reshape(gh, gw, gh, gw).astype(np.float32)


def embedding_filter_components(params, k: int = 28) -> np.ndarray:
  """The top-k principal components of the patch-embedding filters,
  (k, P, P, C), largest variance first.

  Each of the D filters of the `embedding` convolution is a P*P*C vector;
  they are mean-centred and decomposed with an SVD. A component's sign is
  arbitrary; it is fixed here so that its largest-magnitude entry is
  positive. Fewer than k are returned when P*P*C or D is smaller.
  """
  p = _variables(params)['params']
  kernel = _get(p, ('embedding', 'kernel')).astype(np.float64)
  ph, pw, c, d = kernel.shape
  if ph == 1 and pw == 1 and 'conv_root' in p:
    raise ValueError('a hybrid model\'s "patch embedding" is a 1x1 '
                     'projection of ResNet features: it has no pixel filters')
  x = kernel.reshape(ph * pw * c, d).T  # (D filters, P*P*C)
  x = x - x.mean(axis=0, keepdims=True)
  _, _, vt = np.linalg.svd(x, full_matrices=False)
  vt = vt[:k]
  flip = np.sign(vt[np.arange(len(vt)), np.abs(vt).argmax(axis=1)])
  vt = vt * flip[:, None]
  return vt.reshape(-1, ph, pw, c).astype(np.float32)
