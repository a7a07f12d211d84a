"""The paper's data (vit_jax/paper.py) against what the code builds."""

import pytest

from vit_jax import models, paper

SIZES = {'ViT-Base': 'B', 'ViT-Large': 'L', 'ViT-Huge': 'H'}


@pytest.mark.parametrize('variant', sorted(paper.TABLE1))
def test_the_zoo_has_table1_variants(variant):
  row = paper.TABLE1[variant]
  names = [n for n in models.names()
           if n.startswith(f'ViT-{SIZES[variant]}/')]
  assert names, variant
  for name in names:
    spec = models.spec(name)
    assert (spec['num_layers'], spec['hidden_size'], spec['mlp_dim'],
            spec['num_heads']) == (row['layers'], row['hidden'], row['mlp'],
                                   row['heads']), name


def test_table3_lookups():
  assert paper.table3_row('ViT-L/16', 'jft')[0] == (7, 14)
  assert paper.table3_row('ViT-S/16', 'i1k')[1] == 3e-3  # 'ViT-*' row.
  assert paper.table3_row('BiT-R50x1', 'i21k') is None
  assert paper.default_epochs('i21k', 'ViT-L/16') == 90.0
  assert paper.default_epochs('i21k', 'BiT-R50x1') == 90.0  # No row.
  assert paper.default_epochs('cifar10') == 0.0
  assert paper.pretrain_images('i1k') == 1_281_167
