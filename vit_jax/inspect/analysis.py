"""The numbers behind the paper's analysis figures (§4.5; Figs 6-7, 10-11, 14).

All functions take host or device arrays and return numpy float32 arrays:

  * `attention_weights`: every block's softmax attention, one forward pass;
  * `attention_summary`: a batch's distances and rollout maps, reduced on
    the device (what the CLI uses: no full attention tensor on the host);
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

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.models.inputs import check_image_shape, patch_grid

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
  The whole tensor comes to the host: `attention_summary` reduces it on
  the device instead (what the CLI uses).
  """
  probe = _probe(model)
  _, state = _forward(probe, _variables(params), images)
  return np.stack([np.asarray(w, np.float32) for w in _sown(probe, state)])


def _probe(model):
  if not hasattr(model, 'capture_attention'):
    raise ValueError(f'{type(model).__name__} has no self-attention to '
                     'inspect (a ResNet); pass a ViT or hybrid (R50+ViT)')
  return model.clone(capture_attention=True, attention_impl='explicit')


def _sown(probe, state, collection: str = 'intermediates',
          path: Sequence[str] = ATTENTION):
  """Each block's value sown at `path` in `collection` (by default the
  attention weights, (batch, heads, T, T)), first layer first."""
  blocks = state[collection]['Transformer']
  if probe.scan_layers:
    node = blocks['encoderblock']
    for key in path:
      node = node[key]
    return [jax.tree.map(lambda a, i=i: a[i], node[0])
            for i in range(probe.num_layers)]
  per_layer = []
  for i in range(probe.num_layers):
    node = blocks[f'encoderblock_{i}']
    for key in path:
      node = node[key]
    per_layer.append(node[0])
  return per_layer


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, variables, images):
  return model.apply(variables, images, train=False,
                     mutable=['intermediates'])


# The reductions below are jnp functions of float32 weights, shared by the
# host-array API (`attention_rollout`, `mean_attention_distance`) and the
# on-device `attention_summary`: one definition of each number. Matmuls at
# HIGHEST precision (no TF32 / bf16 passes on accelerators).
_HIGHEST = jax.lax.Precision.HIGHEST


def _residual_normalised(w):
  """(..., heads, T, T) -> (..., T, T): heads averaged, the identity (the
  residual path) added, rows renormalised to sum 1."""
  a = w.mean(axis=-3) + jnp.eye(w.shape[-1], dtype=w.dtype)
  return a / a.sum(axis=-1, keepdims=True)


def _per_query_distance(w, distances, lead: int):
  """(..., T, T) weights -> (...,): the attention-weighted key distance of
  each patch query (patch keys only, each row renormalised over them),
  averaged over the queries. Written as fused multiply-and-sum over the
  whole rows (leading tokens weighted 0), not a slice and a matmul, so
  that no copy of `w` is made."""
  tokens = w.shape[-1]
  d = jnp.pad(distances.astype(w.dtype), ((lead, 0), (lead, 0)))
  patch_key = (jnp.arange(tokens) >= lead).astype(w.dtype)
  num = (w * d).sum(axis=-1)[..., lead:]
  den = (w * patch_key).sum(axis=-1)[..., lead:]
  return (num / jnp.maximum(den, 1e-30)).mean(axis=-1)


def _check_weights(shape) -> None:
  if len(shape) != 5 or shape[-1] != shape[-2]:
    raise ValueError('weights must be (layers, batch, heads, tokens, tokens), '
                     f'got shape {tuple(shape)}')


def _lead(tokens: int, grid_shape, leading_tokens: Optional[int] = None
          ) -> int:
  """The leading (non-patch) tokens before the grid's patch tokens.

  Without `leading_tokens`, 0 (no class token) or 1 (a class token): the
  only counts this repository's models have, so any other count means the
  grid is not the one the weights were computed on, and is refused rather
  than reading patches as leading tokens. With it, exactly that many (say
  so for a model with more, or to refuse a grid that counts the class
  token as a patch: (5, 5) on 24 patches and a class token)."""
  gh, gw = (int(g) for g in grid_shape)
  lead = tokens - gh * gw
  fix = 'pass the (rows, cols) grid of the images the weights were computed on'
  if lead < 0:
    raise ValueError(f'a {gh}x{gw} patch grid has {gh * gw} tokens but the '
                     f'attention has only {tokens}: {fix}')
  if leading_tokens is not None:
    if lead != leading_tokens:
      raise ValueError(
          f'a {gh}x{gw} patch grid and {leading_tokens} leading token(s) '
          f'make {gh * gw + leading_tokens} tokens, the attention has '
          f'{tokens}: {fix}')
  elif lead > 1:
    raise ValueError(
        f'a {gh}x{gw} patch grid leaves {lead} of the attention\'s {tokens} '
        'tokens as leading tokens (expected 0, or 1 for a class token): '
        f'{fix}, or leading_tokens= for a model with more')
  return lead


@functools.partial(jax.jit, static_argnames='per_layer')
def _rollout(w, per_layer: bool):
  a = _residual_normalised(w)  # (layers, batch, T, T)
  joint, out = a[0], [a[0]]
  for layer in a[1:]:
    joint = jnp.matmul(layer, joint, precision=_HIGHEST)
    out.append(joint)
  return jnp.stack(out) if per_layer else joint


def attention_rollout(weights, *, per_layer: bool = False) -> np.ndarray:
  """Attention rollout (Abnar & Zuidema 2020), as the paper's Appendix D.8.

  Per image: average the heads, add the identity (the residual path),
  renormalise each row to sum 1, and multiply through the layers with the
  last layer on the left. `weights`: (layers, batch, heads, T, T).

  Returns (batch, T, T); with `per_layer`, (layers, batch, T, T): the rollout
  up to and including each layer (Fig 14). Row i says how much each input
  token flows into output token i. Computed in float32.
  """
  _check_weights(np.shape(weights))
  return np.asarray(_rollout(jnp.asarray(weights, jnp.float32), per_layer),
                    np.float32)


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


@functools.partial(jax.jit, static_argnames='lead')
def _mean_distance(w, distances, lead: int):
  return _per_query_distance(w, distances, lead).mean(axis=1)


def mean_attention_distance(weights, grid_shape: Sequence[int],
                            pixels_per_token: float, *,
                            leading_tokens: Optional[int] = None
                            ) -> np.ndarray:
  """Attention distance in input pixels, (layers, heads).

  For each query patch, the distance to each key patch centre weighted by
  the attention weight; queries and keys are the grid's patch tokens only
  (leading tokens such as the class token are dropped and each query's
  weights renormalised over the patch keys). Averaged over queries and
  images. The paper's "attention distance", analogous to receptive field
  size in CNNs. Computed in float32.

  `grid_shape` is the images' (rows, cols) of patches; the weights alone
  cannot tell a transposed grid ((6, 4) for (4, 6)) from the right one, so
  the caller must get it right (`attention_summary` derives it from the
  images instead). The leading tokens are what the grid leaves: 0 or 1,
  else refused; `leading_tokens` states the count (1 for a class token).
  """
  shape = np.shape(weights)
  _check_weights(shape)
  lead = _lead(shape[-1], grid_shape, leading_tokens)
  d = pairwise_distances(tuple(int(g) for g in grid_shape), pixels_per_token)
  return np.asarray(_mean_distance(jnp.asarray(weights, jnp.float32),
                                   jnp.asarray(d, jnp.float32), lead),
                    np.float32)


def attention_summary(model, params, images,
                      grid_shape: Optional[Sequence[int]] = None,
                      pixels_per_token: Optional[float] = None, *,
                      class_token_row: bool
                      ) -> Tuple[np.ndarray, np.ndarray]:
  """What the figures need from a batch's attention, reduced on the device
  in float32, so no (layers, batch, heads, T, T) tensor reaches the host:

    * distance (layers, heads): `mean_attention_distance` over `images`;
    * maps (layers, batch, grid_h, grid_w): each image's rollout up to each
      layer (`attention_rollout(..., per_layer=True)`), read at the class
      token's row (`class_token_row`) or as the mean of the patch tokens'
      rows, over the patch tokens.

  The maps are rows of the rollout: a row vector is multiplied through the
  layers (vector x matrix), never the T x T products, so they cost little
  next to the forward pass and come for every image of the batch.

  The grid and the pixels per token are the images' (`models.patch_grid`)
  and the model's `stride`; `grid_shape` and `pixels_per_token`, when given,
  must equal them (a transposed grid would give wrong distances and maps
  of the wrong shape without any other error).
  """
  probe = _probe(model)
  (gh, gw), pixels_per_token = _images_grid(probe, np.shape(images),
                                            grid_shape, pixels_per_token)
  d = jnp.asarray(pairwise_distances((gh, gw), pixels_per_token), jnp.float32)
  distance, maps = _summary(probe, _variables(params), images, d,
                            (gh, gw), class_token_row)
  maps = np.asarray(maps, np.float32)
  return (np.asarray(distance, np.float32),
          maps.reshape(*maps.shape[:2], gh, gw))


def _images_grid(model, shape, grid_shape, pixels_per_token):
  """((rows, cols), pixels per token) `model` cuts images of `shape` into,
  or a ValueError if the caller's `grid_shape` / `pixels_per_token` say
  otherwise."""
  stride = model.stride
  check_image_shape(shape, stride, drops_partial=model.drops_partial_patches)
  grid = patch_grid(model, shape[1:])
  how = (f'{shape[1]}x{shape[2]}-pixel images cut into {stride}x{stride}-'
         f'pixel patches make a {grid[0]}x{grid[1]} (rows, cols) grid')
  if grid_shape is not None and tuple(int(g) for g in grid_shape) != grid:
    raise ValueError(f'grid_shape={tuple(grid_shape)} does not match the '
                     f'images: {how}; pass {grid} or leave grid_shape out')
  if pixels_per_token is not None and pixels_per_token != stride:
    raise ValueError(f'pixels_per_token={pixels_per_token} is not the '
                     f'model\'s {stride} pixels per token: pass {stride} or '
                     'leave it out')
  return grid, stride


REDUCED = ('MultiHeadDotProductAttention_0', 'attention_summary')


def _reduce_each_block(distances, lead: int, grid_shape):
  """A flax method interceptor: right after each attention module has sown
  its weights, reduce them to what `attention_summary` needs (per image:
  the distance per head and the head-averaged rollout matrix) and sow that
  beside them (in `intermediates`, the collection nn.scan carries). The
  block's output waits for the reduction (an optimisation barrier), so
  each layer's (batch, heads, T, T) weights die before the next layer's
  exist: the peak holds one layer's, not all of them."""
  def per_image(w):  # (heads, T, T), one image at a time: no temporaries
    w = w.astype(jnp.float32)  # of the whole batch's size.
    return _per_query_distance(w, distances, lead), _residual_normalised(w)

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    module = context.module
    if (context.method_name != '__call__'
        or not module.has_variable('intermediates', ATTENTION[-1])):
      return out
    weights = module.get_variable('intermediates', ATTENTION[-1])[-1]
    if weights.shape[-1] != distances.shape[0] + lead:
      raise ValueError(
          f'the attention has {weights.shape[-1]} tokens, a {grid_shape[0]}x'
          f'{grid_shape[1]} patch grid{" and a class token" * lead} make '
          f'{distances.shape[0] + lead}: pass the grid of the images')
    reduced = jax.lax.map(per_image, weights)
    out, reduced = jax.lax.optimization_barrier((out, reduced))
    module.sow('intermediates', REDUCED[-1], reduced)
    return out
  return interceptor


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _summary(probe, variables, images, distances, grid_shape,
             class_token_row):
  lead = 1 if 'cls' in variables['params'] else 0  # A class token.
  tokens = lead + distances.shape[0]
  with nn.intercept_methods(_reduce_each_block(distances, lead, grid_shape)):
    _, state = probe.apply(variables, images, train=False,
                           mutable=['intermediates'])
  per_layer = _sown(probe, state, 'intermediates', REDUCED)
  distance = jnp.stack([d.mean(axis=0) for d, _ in per_layer])
  # The map up to layer l is u A_l ... A_1 (u: the class token's
  # indicator, or the mean over the patch rows). Chain l starts at layer l;
  # walking down the layers, every started chain takes one step (chains
  # not started yet are zero and stay zero).
  if class_token_row and lead:
    u = jnp.zeros((tokens,), jnp.float32).at[0].set(1)
  else:
    u = jnp.zeros((tokens,), jnp.float32).at[lead:].set(1 / (tokens - lead))
  chains = jnp.zeros((images.shape[0], len(per_layer), tokens), jnp.float32)
  for l in reversed(range(len(per_layer))):
    a = per_layer[l][1]  # (batch, T, T)
    chains = jnp.einsum('bct,bts->bcs', chains.at[:, l].set(u), a,
                        precision=_HIGHEST)
  return distance, chains[..., lead:].transpose(1, 0, 2)


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
  if 'conv_root' in p:  # Whatever its patch size.
    raise ValueError(f'a hybrid model\'s "patch embedding" ({ph}x{pw}x{c}) '
                     'runs on ResNet features, not on the image: it has no '
                     'pixel filters')
  x = kernel.reshape(ph * pw * c, d).T  # (D filters, P*P*C)
  x = x - x.mean(axis=0, keepdims=True)
  _, _, vt = np.linalg.svd(x, full_matrices=False)
  vt = vt[:k]
  flip = np.sign(vt[np.arange(len(vt)), np.abs(vt).argmax(axis=1)])
  vt = vt * flip[:, None]
  return vt.reshape(-1, ph, pw, c).astype(np.float32)
