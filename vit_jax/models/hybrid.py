"""The hybrid ResNet+ViT models: a ViT on the feature map of a ResNet stem.

The module is `vit.VisionTransformer` with `resnet_layers` set
(`resnet.hybrid_stem`); its FLOP count and smoke shrinking are the ViT's,
which include the stem. The paper's R50+ViT use patch size 1 on the stem's
map; AugReg's public hybrids (Steiner et al. 2021, vision_transformer's
`R+Ti_16` and `R26+S_32`) are the root block alone with 8x8 patches, and a
ResNet-26 (2, 2, 2, 2) with patch size 1.
"""

from vit_jax.models import registry, vit


def _hybrid(width: str, patch: int):
  # /16: stage 4 dropped and stage 3 extended -> a 1/16 map; /32: full R50.
  layers = (3, 4, 9) if patch == 16 else (3, 4, 6, 3)
  return vit.dims(width, 1, resnet_layers=layers, resnet_width=1.0)


registry.register(
    registry.Family('R50+ViT', vit.VisionTransformer, vit.vit_flops,
                    vit.vit_shrink),
    {f'R50+ViT-{width}/{patch}': _hybrid(width, patch)
     for width, patch in (('B', 16), ('B', 32), ('L', 32), ('L', 16))})

registry.register(
    registry.Family('AugReg hybrid', vit.VisionTransformer, vit.vit_flops,
                    vit.vit_shrink),
    {'R+ViT-Ti/16': vit.dims('Ti', 8, resnet_layers=(), resnet_width=1.0),
     'R26+ViT-S/32': vit.dims('S', 1, resnet_layers=(2, 2, 2, 2),
                              resnet_width=1.0)})
