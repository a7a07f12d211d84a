"""Lists the dataset registry: `python -m vit_jax.data`.

One row per name (`input.data`): its source kind, class count, default
train / eval splits and image size; how to get the data is in docs/data.md.
"""

from __future__ import annotations

from vit_jax.data import registry


def table() -> str:
  rows = ['| name | source | classes | train split | eval split | size |',
          '|---|---|---:|---|---|---:|']
  for name in registry.names():
    spec = registry.get(name)
    rows.append(
        f'| {name} | {spec.source} | {spec.num_classes or "from data"} | '
        f'{spec.train_split or "-"} | {spec.eval_split or "(source picks)"} '
        f'| {spec.image_size} |')
  return '\n'.join(rows)


if __name__ == '__main__':
  print(table())
