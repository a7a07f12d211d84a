"""Input throughput: how many images per second the host pipeline delivers.

    from vit_jax.data import input_bench
    input_bench.measure_input(config.input, steps=50)   # {'img_per_s': ..., ...}

`synthetic_jpeg_records` writes ImageNet-like JPEG TFRecords (crops of
scikit-image's sample photos, up to 500x375, quality 90) for measuring
where no real dataset is at hand:

    d = bench.synthetic_jpeg_records('/tmp/jpegs', num_images=2048)
    input_bench.measure_input(ml_collections.ConfigDict(dict(
        data='tfrecord', data_dir=d, num_classes=1000, batch_size=256,
        image_size=224, pp_train='inception')), steps=40)
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict

import numpy as np
import tensorflow as tf

from vit_jax.data import pipeline

_PHOTOS = ('astronaut', 'coffee', 'chelsea', 'rocket', 'hubble_deep_field',
           'immunohistochemistry', 'cat', 'retina')


def measure_input(input_config, steps: int, *, warmup: int = 3,
                  seed: int = 0) -> Dict[str, Any]:
  """Times `steps` train batches of process 0 of 1 after `warmup` batches.

  Args:
    input_config: the `input` ConfigDict, as for `pipeline.train_iterator`.
    steps: batches to time.
    warmup: batches taken first, untimed (pipeline start, shuffle buffer).
    seed: the input seed.

  Returns:
    {'img_per_s', 'batches_per_s', 'batch_size', 'steps', 'seconds',
     'image_shape', 'cpu_count'}.
  """
  it = pipeline.train_iterator(input_config, seed=seed)
  for _ in range(warmup):
    batch = next(it)
  start = time.perf_counter()
  for _ in range(steps):
    batch = next(it)
  seconds = time.perf_counter() - start
  images = steps * it.local_batch_size
  return {'img_per_s': images / seconds, 'batches_per_s': steps / seconds,
          'batch_size': it.local_batch_size, 'steps': steps,
          'seconds': seconds, 'image_shape': tuple(batch['image'].shape[1:]),
          'cpu_count': os.cpu_count()}


def synthetic_jpeg_records(directory: str, num_images: int = 2048, *,
                           num_files: int = 4, num_classes: int = 1000,
                           size=(375, 500), seed: int = 0) -> str:
  """Writes `train-*` TFRecords of JPEG photo crops; returns `directory`.

  Records are `image/encoded` + `image/class/label`, as the `tfrecord`
  registry entry reads them. Needs scikit-image (the test extra).
  """
  import skimage.data  # Only for this helper: a test-time dependency.
  rng = np.random.RandomState(seed)
  photos = []
  for name in _PHOTOS:
    photo = np.asarray(getattr(skimage.data, name)())
    if photo.ndim == 2:
      photo = np.stack([photo] * 3, -1)
    photos.append(photo[..., :3])
  os.makedirs(directory, exist_ok=True)
  writers = [tf.io.TFRecordWriter(os.path.join(
      directory, f'train-{i:05d}-of-{num_files:05d}')) for i in range(num_files)]
  for n in range(num_images):
    photo = photos[n % len(photos)]
    h, w = int(photo.shape[0]), int(photo.shape[1])
    ch, cw = min(h, size[0]), min(w, size[1])
    y, x = rng.randint(0, h - ch + 1), rng.randint(0, w - cw + 1)
    crop = photo[y:y + ch, x:x + cw]
    if rng.rand() < 0.5:
      crop = crop[:, ::-1]
    data = tf.io.encode_jpeg(np.ascontiguousarray(crop), quality=90).numpy()
    example = tf.train.Example(features=tf.train.Features(feature={
        'image/encoded': tf.train.Feature(
            bytes_list=tf.train.BytesList(value=[data])),
        'image/class/label': tf.train.Feature(
            int64_list=tf.train.Int64List(value=[n % num_classes]))}))
    writers[n % num_files].write(example.SerializeToString())
  for w in writers:
    w.close()
  return directory
