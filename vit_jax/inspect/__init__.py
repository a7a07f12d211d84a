"""See inside a ViT: the paper's analysis figures (§4.5) from any checkpoint.

    python -m vit_jax.inspect --init=<workdir | .npz | hf:DIR> [--model=...] \
        --data=<dataset name | image folder> --out=DIR

writes filters.png, position_similarity.png, attention_distance.png,
rollout.png, rollout_layers.png and inspect.json (docs/inspect.md). The
numbers come from `analysis`; the figures from `figures`.
"""

from vit_jax.inspect.analysis import (attention_rollout, attention_summary,
                                      attention_weights,
                                      embedding_filter_components,
                                      mean_attention_distance,
                                      pairwise_distances, position_similarity)

__all__ = ['attention_rollout', 'attention_summary', 'attention_weights',
           'embedding_filter_components', 'mean_attention_distance',
           'pairwise_distances', 'position_similarity']
