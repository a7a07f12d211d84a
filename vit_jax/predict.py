"""Classify images with a trained model: `python -m vit_jax.predict`.

    python -m vit_jax.predict --init=/tmp/vit_smoke photo.jpg
    python -m vit_jax.predict --init=/tmp/vit_smoke --top=3 --json=out.json photos/
    python -m vit_jax.predict --init=ViT-B_16.npz --model=ViT-B/16 --labels=imagenet2012 cat.jpg

`--init` is a training workdir, an .npz checkpoint or a Hugging Face
directory (see `vit_jax/trained.py`). Images are pre-processed exactly as
the run evaluated them (its `input.pp_eval` at its `input.image_size`:
decode, resize / crop, value range; a 1-channel model gets grey images).
Folders are searched recursively for .jpg/.jpeg/.png/.gif/.bmp/.webp
files, into symlinked sub-folders too (each folder once); `gs://` (any
`scheme://`) folders are listed with TensorFlow's GFile. `~` in `--init`
is expanded.
A file that cannot be read or decoded is reported by name and skipped; the
others are classified. Batches are split over the local devices (CPU, GPU or
TPU cores); the last one is padded, so one program is compiled per call
(a call with fewer files than `--batch` computes only a batch of their
count, rounded up to the devices').

Prints `FILE: label (probability), ...` per image (top `--top`) and writes
the same as JSON with `--json`. Probabilities are as the run's loss read its
logits (`Trained.output_activation`, recorded in the JSON): a softmax over
the classes, or for `loss=sigmoid` runs (multi-label) a sigmoid per class,
which need not sum to 1. Exit status: 0 when at least one image was
classified, 1 when none was (every file unreadable, or an error). The JSON
is written before anything is printed: a closed stdout (`| head`) loses
neither it nor the exit status.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import sys
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from vit_jax import hugepages, outputs

EXTENSIONS = ('.jpg', '.jpeg', '.png', '.gif', '.bmp', '.webp')


Paths = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


def list_images(paths: Paths) -> List[str]:
  """The image files among `paths` (one path, str or os.PathLike, or a
  sequence of them), folders searched recursively (sorted): symlinked
  sub-folders are followed, each real folder listed once (a link to a
  folder above does not loop); `scheme://` folders (gs://, ...) are listed
  with TensorFlow's GFile."""
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]  # One path, not its characters.
  out = []
  for path in map(os.fspath, paths):
    remote = '://' in path
    if _gfile().isdir(path) if remote else os.path.isdir(path):
      out += _folder_images(path, remote)
    else:
      out.append(path)  # Named explicitly: tried whatever its extension.
  return out


def _gfile():
  """tf.io.gfile, imported only for `scheme://` paths: listing local
  folders needs no TensorFlow."""
  import tensorflow as tf
  return tf.io.gfile


def _folder_images(path: str, remote: bool) -> List[str]:
  """The image files under the folder `path`, hidden ones left out. Local
  folders are walked into symlinked sub-folders, each real folder once
  (its real path remembered): a link to a folder above, or two links to
  one folder, neither loop nor classify a file twice."""
  out, seen = [], set()
  walk = _gfile().walk(path) if remote else os.walk(path, followlinks=True)
  for folder, dirs, files in walk:
    if not remote:
      real = os.path.realpath(folder)
      if real in seen:  # Reached again through a link: listed already.
        dirs[:] = []
        continue
      seen.add(real)
    dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
    out += [os.path.join(folder, f) for f in sorted(files)
            if f.lower().endswith(EXTENSIONS) and not f.startswith('.')]
  return out


class Predictor:
  """Batched, device-sharded classification of encoded images.

  `predictor(files)` yields ('ok', file, probabilities) or ('skipped',
  file, reason) in the order of `files`.
  """

  def __init__(self, trained, *, batch: int = 64,
               dtype: Optional[str] = None, workers: int = 4):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from vit_jax.data import pipeline
    from vit_jax.models import precast
    pipeline.hide_accelerators_from_tf()
    self.trained = trained
    devices = jax.local_devices()
    self._devices = len(devices)
    self.batch = self._rounded(batch)
    mesh = Mesh(np.array(devices), ('data',))
    self._data_sh = NamedSharding(mesh, P('data'))
    replicated = NamedSharding(mesh, P())
    apply = trained.apply_fn(dtype)

    def fn(p, x):
      return trained.activate(apply(p, x))
    # The weights the forward pass only narrows (bf16 matmul kernels) are
    # cast once here, not on every batch (`vit_jax.models.precast`).
    params = precast.cast_once(
        fn, trained.params, np.zeros((1, *trained.image_shape), np.float32))
    self._params = jax.device_put(params, replicated)
    self._fn = jax.jit(fn, in_shardings=(replicated, self._data_sh),
                       out_shardings=replicated)
    self._load = image_loader(trained)
    self._workers = workers

  def load(self, path: str) -> np.ndarray:
    """One file -> the model's input (float32 HxWxC); raises on bad files."""
    return self._load(path)

  def _rounded(self, n: int) -> int:
    """`n` rounded up to a multiple of the device count (at least one each)."""
    return max(1, -(-n // self._devices)) * self._devices

  def batch_for(self, count: int) -> int:
    """The batch `count` files are computed in: `batch`, or for fewer files
    their count (device-rounded), so one image computes one, not a padded
    64 (60x the time for ViT-S/16 on a CPU)."""
    return min(self.batch, self._rounded(count))

  def _read(self, path: str) -> Tuple[str, object]:
    try:
      return 'ok', self._load(path)
    except Exception as e:  # pylint: disable=broad-except
      return 'skipped', error_reason(e)

  def __call__(self, files: Sequence[str]
               ) -> Iterator[Tuple[str, str, object]]:
    import jax
    batch = self.batch_for(len(files))
    with concurrent.futures.ThreadPoolExecutor(self._workers) as pool:
      for start in range(0, len(files), batch):
        chunk = files[start:start + batch]
        loaded = list(pool.map(self._read, chunk))
        good = [x for status, x in loaded if status == 'ok']
        probs = iter(())
        if good:
          images = np.zeros((batch, *self.trained.image_shape), np.float32)
          images[:len(good)] = np.stack(good)
          out = self._fn(self._params,
                         jax.device_put(images, self._data_sh))
          probs = iter(np.asarray(out)[:len(good)])
        for path, (status, x) in zip(chunk, loaded):
          yield (status, path, next(probs) if status == 'ok' else x)


def image_loader(trained):
  """`path -> float32 HxWxC`: read the file, then the eval pre-processing."""
  import tensorflow as tf
  pp = trained.preprocess()

  @tf.function(input_signature=[tf.TensorSpec([], tf.string)])
  def process(data):
    return tf.cast(pp({'image': data})['image'], tf.float32)

  def load(path: str) -> np.ndarray:
    data = read_bytes(path)
    if not data:
      raise ValueError('empty file')
    image = process(tf.constant(data)).numpy()
    if image.shape != trained.image_shape:
      raise ValueError(f'pre-processed to {image.shape}, the model takes '
                       f'{trained.image_shape}')
    return image
  return load


def read_bytes(path: str) -> bytes:
  """The file's bytes: local paths with `open`, which takes any name the
  OS does (GFile refuses the surrogate-escaped str of a name that is not
  valid UTF-8), `scheme://` ones (gs://, ...) with TensorFlow's GFile."""
  if '://' in path:
    import tensorflow as tf
    with tf.io.gfile.GFile(path, 'rb') as f:
      return f.read()
  with open(path, 'rb') as f:
    return f.read()


def shown(path: str) -> str:
  """`path` printable on any stream: bytes of a name that are not valid
  UTF-8 (surrogate-escaped by Python) as `\\xff`, not an encode error."""
  return os.fsencode(path).decode('utf-8', 'backslashreplace')


def error_reason(error: Exception) -> str:
  """The error's message without TensorFlow's graph traceback."""
  text = getattr(error, 'message', None) or str(error)
  lines = [re.sub(r'^\{\{function_node [^}]*\}\}\s*', '', l).strip()
           for l in text.splitlines()
           if l.strip() and not l[0].isspace() and not l.startswith(
               ('Graph execution error', 'Detected at node'))]
  return f'{type(error).__name__}: {(lines or [""])[-1][:200]}'


def top_k(probs: np.ndarray, labels: Sequence[str], k: int) -> List[Dict]:
  order = np.argsort(-probs, kind='stable')[:k]
  return [{'label': labels[i], 'index': int(i),
           'probability': float(probs[i])} for i in order]


def predict(trained, paths: Paths, *, top: int = 5, batch: int = 64,
            dtype: Optional[str] = None, progress: bool = False,
            results: Optional[List[Dict]] = None,
            skipped: Optional[List[Dict]] = None
            ) -> Tuple[List[Dict], List[Dict]]:
  """([{'file', 'top': [{'label', 'index', 'probability'}]}], [{'file',
  'error'}]) for the images among `paths` (files and folders: one path, a
  str or os.PathLike, or a sequence of them; `list_images`). Given
  `results` / `skipped` lists, they grow as images are classified (what
  an interrupted call had done is in them)."""
  files = list_images(paths)
  predictor = cached_predictor(trained, batch=batch, dtype=dtype)
  results = [] if results is None else results
  skipped = [] if skipped is None else skipped
  bar = _progress(len(files)) if progress else None
  for status, path, value in predictor(files):
    if status == 'ok':
      results.append({'file': path,
                      'top': top_k(value, trained.labels, top)})
    else:
      skipped.append({'file': path, 'error': value})
      print(f'skipped {shown(path)}: {value}', file=sys.stderr)
    if bar is not None:
      bar.update(1)
  if bar is not None:
    bar.close()
  return results, skipped


def cached_predictor(trained, *, batch: int = 64,
                     dtype: Optional[str] = None) -> Predictor:
  """The Predictor `predict()` uses, made once per model and setting (kept
  on `trained`): building one jits the model, traces the pre-processing and
  copies the weights to the devices (1.7 s for ViT-S/16, reused 0.08 s).
  Keyed by what it reads from `trained` (changing its activation or
  pre-processing makes a new one) and kept only while its parameters stay
  those it was built from (`Trained.cached`, as `Trained.logits`): new
  weights replace it, and the old ones' device copies are freed."""
  key = ('predictor', batch, trained.compute_dtype(dtype),
         trained.output_activation, tuple(trained.pp), trained.image_shape)
  return trained.cached(
      key, lambda: Predictor(trained, batch=batch, dtype=dtype))


def _progress(total: int):
  try:
    from tqdm import tqdm
  except ImportError:
    return None
  return tqdm(total=total, unit='img', file=sys.stderr,
              disable=total <= 1 or not sys.stderr.isatty())


def positive_int(value: str) -> int:
  """argparse type of the commands' counts and sizes (predict's --top,
  --batch, --image_size; export's --image_size): 0 or a negative number is
  refused as the flag is parsed, before any checkpoint is loaded."""
  try:
    n = int(value)
  except ValueError:
    n = 0
  if n < 1:
    raise argparse.ArgumentTypeError(f'{value!r}: expected a positive '
                                     'integer')
  return n


def _parser() -> argparse.ArgumentParser:
  from vit_jax import trained as trained_lib
  p = argparse.ArgumentParser(
      prog='python -m vit_jax.predict',
      description='Top-k classes of images, pre-processed as the model was '
      'evaluated.')
  p.add_argument('--init', required=True, help='training workdir (or its '
                 'checkpoints/<step>), .npz checkpoint or Hugging Face dir')
  p.add_argument('--model', help='zoo name (needed for .npz files)')
  p.add_argument('--labels', help='dataset name or a text file of class '
                 'names, one per line (default: the run\'s dataset)')
  p.add_argument('--image_size', type=positive_int, help='input resolution '
                 '(default: the run\'s, or the checkpoint\'s position '
                 'embeddings\'); ViT position embeddings are interpolated '
                 'as fine-tuning does, without training at that size')
  p.add_argument('--top', type=positive_int, default=5,
                 help='classes per image')
  p.add_argument('--batch', type=positive_int, default=64,
                 help='images per batch (rounded up to a multiple of the '
                 'local devices)')
  p.add_argument('--dtype', choices=('float32', 'bfloat16', 'float16'),
                 help="compute dtype (default: the run's)")
  p.add_argument('--params', default='auto', choices=('auto', 'ema', 'raw'),
                 help='workdirs of runs with optim.ema_decay: classify with '
                 'the EMA (Polyak) averages or the raw parameters; auto '
                 '(default): those the run\'s metrics describe (the '
                 'averages unless it set eval_ema=raw)')
  p.add_argument('--output_activation', choices=trained_lib.ACTIVATIONS,
                 help='how logits become probabilities (default: as the '
                 'run\'s loss read them; softmax for .npz and Hugging Face '
                 'models, unless its config.json says multi_label_'
                 'classification)')
  p.add_argument('--json', help='also write the results to this file')
  p.add_argument('paths', nargs='+', help='image files and folders')
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  # Before `_parser()`, whose imports load TensorFlow (read at its import).
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  args = _parser().parse_args(argv)
  from vit_jax import trained as trained_lib
  try:
    if args.json is not None:  # Checked first: never lose the results.
      args.json = outputs.file(args.json, '--json')
    trained = trained_lib.load(args.init, model=args.model,
                               labels=args.labels,
                               image_size=args.image_size,
                               ema={'auto': None, 'ema': True,
                                    'raw': False}[args.params],
                               output_activation=args.output_activation)
  except (trained_lib.TrainedModelError, FileNotFoundError, ValueError) as e:
    print(f'vit_jax.predict: {e}', file=sys.stderr)
    return 1
  files = list_images(args.paths)
  if not files:
    print(f'vit_jax.predict: no image files in {args.paths}',
          file=sys.stderr)
    return 1
  results, skipped, interrupted = [], [], False
  try:
    predict(trained, files, top=args.top, batch=args.batch, dtype=args.dtype,
            progress=True, results=results, skipped=skipped)
  except KeyboardInterrupt:  # Keep what was classified: print and save it.
    interrupted = True
    print(f'interrupted after {len(results) + len(skipped)} of {len(files)} '
          'images', file=sys.stderr)
  if args.json:  # First: printing can fail (a closed pipe), this must not.
    write_json(args.json, args.init, trained, results, skipped, interrupted)
  try:
    for r in results:
      print(f'{shown(r["file"])}: ' + ', '.join(
          f'{t["label"]} ({t["probability"]:.3g})' for t in r['top']))
    sys.stdout.flush()
  except BrokenPipeError:  # `| head`: the reader has what it wanted.
    _stdout_to_devnull()
  if trained.output_activation == 'sigmoid':
    print('probabilities: a sigmoid per class, as the run\'s loss=sigmoid '
          'read its logits (they need not sum to 1)', file=sys.stderr)
  print(f'{len(results)} classified, {len(skipped)} skipped'
        + (': ' + ', '.join(shown(s['file']) for s in skipped)
           if skipped else ''), file=sys.stderr)
  if interrupted:
    return 130
  return 0 if results else 1


def write_json(path: str, init: str, trained, results: List[Dict],
               skipped: List[Dict], interrupted: bool) -> None:
  """`--json`: the results with what made them (model, checkpoint and its
  step, pre-processing, parameters, activation)."""
  with open(path, 'w') as f:
    json.dump({'model': trained.architecture, 'init': init,
               'source': trained.source, 'step': trained.step,
               'pre_processing': '|'.join(trained.pp),
               'params': trained.params_kind,
               'output_activation': trained.output_activation,
               'results': results, 'skipped': skipped,
               **({'interrupted': True} if interrupted else {})}, f,
              indent=2)


def _stdout_to_devnull() -> None:
  """After a BrokenPipeError: stdout's file descriptor onto /dev/null, so
  flushing what is still buffered at exit does not fail again (Python's
  advice, docs.python.org/3/library/signal.html#note-on-sigpipe)."""
  try:
    fd = sys.stdout.fileno()
  except (AttributeError, OSError, ValueError):  # Not a file (a test's).
    return
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, fd)
  os.close(devnull)


if __name__ == '__main__':
  hugepages.reexec()  # First: restarts the process where it helps.
  sys.exit(main())
