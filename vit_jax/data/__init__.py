"""The input pipeline: datasets -> pre-processing -> per-process batches.

  * `pipeline.py`: `train_iterator`, `eval_iterator`, `dataset_info` - what
    the training loop calls;
  * `registry.py`: every dataset by name (tfds builders, VTAB-1k splits,
    folders, TFRecords, in-memory digits / mnist5k); `settings.py`: the `input` config fields;
  * `sources.py`: the source interface and its registry of kinds;
    `*_source.py`: the kinds (tfds, folder, TFRecord, in-memory), each
    reading one process's shard; `kinds.py`: opens the source of an entry;
  * `shuffle.py`: stateless permutations and the block shuffle;
  * `ops.py`, `preprocess.py`, `mixup.py`: pre-processing;
  * `prepare.py`: `python -m vit_jax.data.prepare NAME` (fashion_mnist
    offline); `input_bench.py`: input throughput.

Importing this package is cheap; TensorFlow loads with `pipeline`:

    from vit_jax.data import pipeline
"""
