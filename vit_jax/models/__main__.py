"""`python -m vit_jax.models`: every model with parameters and GFLOPs at 224."""

from vit_jax import accounting, models


def main():
  print(f'| {"model":<14} | {"params":>13} | {"GFLOPs@224":>10} |')
  print(f'|{"-" * 16}|{"-" * 14}:|{"-" * 11}:|')
  for name in models.names():
    params = accounting.param_count(name)
    gflops = accounting.forward_flops(name) / 1e9
    print(f'| {name:<14} | {params:>13,} | {gflops:>10.2f} |')
  print('\nParameters: 1000 classes, no pre-logits layer. GFLOPs: forward, '
        'one 224x224 image, multiply-add = 2 (XLA cost analysis).')


if __name__ == '__main__':
  main()
