"""Checkpoint formats users already have, and the knowledge to convert them.

  * `load_npz` / `save_npz`: the flat .npz of the public ViT checkpoints
    (both module namings; hybrid GroupNorm shapes fixed) - `npz.py`;
  * `load_pretrained`: pre-trained weights into a fine-tuning model (head
    reset, pre-logits dropped, position embeddings resized) - `pretrained.py`;
  * `from_hf` / `from_hf_model` / `to_hf` / `hf_config`: Hugging Face
    `transformers` ViTs (state dicts with 4.x and 5.x key names; tanh or erf
    GELU) - `hf.py`;
  * `stack_blocks` / `unstack_blocks`: unrolled <-> scanned (`scan_layers`)
    encoder layouts - `layers.py`.
"""

from vit_jax.checkpoint.hf import from_hf, from_hf_model, hf_config, to_hf
from vit_jax.checkpoint.layers import stack_blocks, unstack_blocks
from vit_jax.checkpoint.npz import (CheckpointError, CheckpointNotFoundError,
                                    check_params, load_npz, save_npz)
from vit_jax.checkpoint.pretrained import load_pretrained, resize_posemb

__all__ = [
    'CheckpointError', 'CheckpointNotFoundError', 'check_params', 'from_hf', 'from_hf_model',
    'hf_config', 'load_npz',
    'load_pretrained', 'resize_posemb', 'save_npz', 'stack_blocks', 'to_hf',
    'unstack_blocks',
]
