"""`export_model`: write a format, verify it, describe it.

The exported model's logits on a few images must equal the JAX model's
within `tolerance` (1e-4 at float32), at two batch sizes when the batch is
dynamic; formats embedding the pre-processing are also checked on encoded
JPEGs against our TF pre-processing + JAX model. Next to the format's files
go `labels.txt`, `export.json` (format, input, pre-processing, verification,
versions) and `MODEL_CARD.md`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import jax
import numpy as np

from vit_jax import outputs
from vit_jax.export import card, registry
from vit_jax.models import matmul

MANIFEST = 'export.json'
TOLERANCE = {'float32': 1e-4, 'bfloat16': 5e-2, 'float16': 1e-2}


class ExportError(RuntimeError):
  """An export that failed or whose outputs differ from the model's."""


def _target(out: str, overwrite: bool) -> Tuple[str, bool]:
  """(the folder to export into, whether it is staged: written beside
  `out` and moved there once verified, by `_publish`).

  A new `out` is staged: a server watching its parent (TF Serving's
  version folders) never sees a half-written or unverified export. An
  empty existing `out` (perhaps a mount point, which cannot be renamed
  onto) is exported into directly. An earlier export there (with
  --overwrite) is replaced only once the new one is verified, so a failed
  export never loses a good one.
  """
  if os.path.exists(out) and not os.path.isdir(out):
    raise ExportError(f'--out={out} is a file: pass a folder (new or empty)')
  if os.path.isdir(out) and not os.listdir(out):
    return out, False
  if not os.path.exists(out):
    parent = os.path.dirname(os.path.abspath(out))
    above = parent
    while not os.path.exists(above):
      above = os.path.dirname(above)
    if not os.path.isdir(above):
      raise ExportError(f'--out={out}: cannot create the folder: {above} is '
                        'a file')
    try:
      os.makedirs(parent, exist_ok=True)
    except OSError as e:
      raise ExportError(f'--out={out}: cannot create the folder {parent}: '
                        f'{_why(e)}') from None
    return _staging(out), True
  if not overwrite:
    raise ExportError(f'{out} exists and is not empty: pass a new --out, '
                      'or --overwrite to replace an earlier export there')
  if not os.path.exists(os.path.join(out, MANIFEST)):
    raise ExportError(f'{out} is not an earlier export (no {MANIFEST}): '
                      'refusing to delete it; pass a new --out')
  extra = _unlisted(out)
  if extra:
    shown = ', '.join(extra[:4]) + (f' and {len(extra) - 4} more'
                                    if len(extra) > 4 else '')
    raise ExportError(
        f'{out} holds {len(extra)} file(s) its earlier export did not write '
        f'(not in its {MANIFEST}): {shown}. --overwrite replaces an earlier '
        'export and nothing else: move them out of the folder, or pass a '
        'new --out')
  return _staging(out), True


def _staging(out: str) -> str:
  """A new folder beside `out` (its real path: a symlink keeps pointing at
  the export) to write the export to first."""
  real = os.path.realpath(out)
  try:
    staging = tempfile.mkdtemp(prefix=f'.{os.path.basename(real)}.new-',
                               dir=os.path.dirname(real))
  except OSError as e:
    raise ExportError(f'--out={out}: cannot make a folder beside {real} to '
                      f'write the export to first: {_why(e)}') from None
  outputs.as_created(staging, folder=True)  # Not mkdtemp's 0700.
  return staging


def _why(e: OSError) -> str:
  """An OSError's reason (its strerror, else its message)."""
  return e.strerror or str(e)


def _unlisted(out: str) -> List[str]:
  """Files and folders in the earlier export `out` that its manifest does
  not list (what a user added), relative to `out`, folders ending in /."""
  path = os.path.join(out, MANIFEST)
  try:
    with open(path) as f:
      manifest = json.load(f)
    listed = [str(x) for x in manifest['files']]
    fmt = registry.FORMATS.get(manifest.get('format'))
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ExportError(f'{path} cannot be read ({e}): cannot tell the earlier '
                      'export from other files, so refusing to replace the '
                      'folder; pass a new --out') from None
  # Files an earlier version wrote without listing them.
  listed += list(fmt.incidental if fmt else ()) + [MANIFEST]
  names = {x.rstrip('/') for x in listed}
  trees = tuple(x.rstrip('/') + '/' for x in listed if x.endswith('/'))
  extra = []
  for folder, dirs, files in os.walk(out):
    rel_dir = os.path.relpath(folder, out)
    rel_dir = '' if rel_dir == '.' else rel_dir + '/'
    inside = [d for d in sorted(dirs) if (rel_dir + d + '/').startswith(
        trees)]  # A folder the export wrote: all in it is its.
    for d in sorted(dirs):
      path = os.path.join(folder, d)
      if d not in inside and rel_dir + d not in names and (
          os.path.islink(path) or not os.listdir(path)):
        extra.append(rel_dir + d + '/')  # Empty, or a link (not entered).
    dirs[:] = [d for d in dirs if d not in inside]
    for f in sorted(files):
      rel = rel_dir + f
      if rel not in names and not rel.startswith(trees):
        extra.append(rel)
  return sorted(extra)


def _publish(staging: str, out: str) -> None:
  """Moves the verified export in `staging` to `out`, swapping it in for an
  earlier one there (which is put back if the swap fails, `staging` then
  kept)."""
  real = os.path.realpath(out)
  if not os.path.exists(real):
    try:
      os.rename(staging, real)
    except OSError as e:
      raise ExportError(f'could not move the verified export in {staging} '
                        f'to {real}: {_why(e)}') from e
    return
  old = os.path.join(os.path.dirname(real),
                     f'.{os.path.basename(real)}.old-{os.getpid()}')
  failed = (f'the earlier export in {real} is unchanged, and the verified new '
            f'one is in {staging}')
  try:
    os.rename(real, old)
  except OSError as e:
    raise ExportError(f'could not move {real} aside ({e}): {failed}') from e
  try:
    os.rename(staging, real)
  except OSError as e:
    os.rename(old, real)
    raise ExportError(f'could not move the new export in ({e}): {failed}'
                      ) from e
  shutil.rmtree(old)


def sample_images(trained, n: int, seed: int = 0) -> np.ndarray:
  """`n` float32 inputs in [-1, 1] (smooth noise: every weight matters)."""
  rng = np.random.RandomState(seed)
  return rng.uniform(-1, 1, (n, *trained.image_shape)).astype(np.float32)


def sample_jpegs(trained, n: int, seed: int = 0) -> List[bytes]:
  """`n` encoded JPEGs of assorted sizes, colour or grey."""
  import tensorflow as tf
  rng = np.random.RandomState(seed)
  out = []
  for i in range(n):
    h, w = trained.image_size + 7 * i + 3, trained.image_size + 11 * i + 5
    pixels = rng.randint(0, 256, (h, w, 3 if i % 2 == 0 else 1), np.uint8)
    out.append(tf.io.encode_jpeg(pixels).numpy())
  return out


def _reference(trained, images: np.ndarray, dtype: str) -> np.ndarray:
  return trained.logits(images, dtype)


def _reference_bytes(trained, encoded: List[bytes], dtype: str) -> np.ndarray:
  import tensorflow as tf
  pp = trained.preprocess()
  images = np.stack([tf.cast(pp({'image': tf.constant(e)})['image'],
                             tf.float32).numpy() for e in encoded])
  return _reference(trained, images, dtype)


def verify(fmt: registry.Format, trained, out: str,
           options: registry.Options, tolerance: float) -> Dict[str, Any]:
  """Runs the export on a few inputs; ExportError if logits differ."""
  sizes = [options.batch] if options.batch else [1, 3]
  checks = []
  for i, n in enumerate(sizes):
    images = sample_images(trained, n, seed=i)
    ours = _reference(trained, images, options.dtype)
    theirs = np.asarray(fmt.run(out, images), np.float32)
    checks.append(('images', n, ours, theirs))
  if options.with_preprocessing and fmt.run_bytes:
    n = options.batch or 3
    encoded = sample_jpegs(trained, n)
    checks.append(('encoded JPEGs', n,
                   _reference_bytes(trained, encoded, options.dtype),
                   np.asarray(fmt.run_bytes(out, encoded), np.float32)))
  diffs = []
  for what, n, ours, theirs in checks:
    if theirs.shape != ours.shape:
      raise ExportError(f'{fmt.name} export in {out}: {n} {what} gave '
                        f'logits of shape {theirs.shape}, expected '
                        f'{ours.shape}')
    diff = float(np.max(np.abs(theirs - ours)))
    diffs.append({'inputs': what, 'batch': n, 'max_abs_diff': diff})
    if not diff <= tolerance:
      raise ExportError(
          f'{fmt.name} export in {out} is wrong: on {n} {what} its logits '
          f'differ from the JAX model\'s by up to {diff:.3g} (tolerance '
          f'{tolerance:g})')
  worst = max(d['max_abs_diff'] for d in diffs)
  summary = (f'max |logit difference| {worst:.2g} vs the JAX model on '
             + ', '.join(f'{d["batch"]} {d["inputs"]}' for d in diffs)
             + f' (tolerance {tolerance:g})')
  return {'checks': diffs, 'max_abs_diff': worst, 'tolerance': tolerance,
          'summary': summary}


def _size(out: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f))
             for d, _, files in os.walk(out) for f in files)


def _versions(fmt: registry.Format) -> Dict[str, str]:
  import importlib
  out = {'jax': jax.__version__}
  for name in fmt.requires + ('jaxlib',):
    try:
      out[name] = importlib.import_module(name).__version__
    except (ImportError, AttributeError):
      pass
  return out


def export_model(trained, fmt_name: str, out: str,
                 options: Optional[registry.Options] = None, *,
                 overwrite: bool = False,
                 tolerance: Optional[float] = None) -> Dict[str, Any]:
  """Exports `trained` (a `vit_jax.trained.Trained`) as `fmt_name` to
  `out`, verifies it and writes the model card; returns the manifest."""
  options = options or registry.Options()
  fmt = registry.get(fmt_name)
  registry.check_installed(fmt)
  registry.check_options(fmt, options)
  registry.check_model(fmt, trained)
  tolerance = tolerance or TOLERANCE.get(options.dtype, 1e-2)
  target, staged = _target(out, overwrite)
  try:
    try:
      manifest = _export(fmt, trained, target, options, tolerance)
    except OSError as e:  # Disk full, permissions, ... while writing.
      where = str(e.filename or target)
      if staged and where.startswith(target):  # Where it was going to be.
        where = out.rstrip('/') + where[len(target):]
      raise ExportError(f'exporting to --out={out} failed at {where}: '
                        f'{_why(e)}') from e
  except BaseException:
    if staged:  # `out` is as it was: absent, or the earlier export.
      shutil.rmtree(target, ignore_errors=True)
    else:  # `out` was empty: leave it so, ready for another try.
      _clear(target)
    raise
  if staged:
    _publish(target, out)
  return manifest


def _clear(folder: str) -> None:
  """Deletes what a failed export wrote into `folder`."""
  for name in os.listdir(folder):
    path = os.path.join(folder, name)
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)
    else:
      os.remove(path)


def _as_created_tree(path: str) -> None:
  """`outputs.as_created` on `path` and, for a folder, all inside it."""
  if os.path.islink(path):
    return
  if not os.path.isdir(path):
    outputs.as_created(path)
    return
  outputs.as_created(path, folder=True)
  for folder, dirs, files in os.walk(path):
    for d in dirs:
      if not os.path.islink(os.path.join(folder, d)):
        outputs.as_created(os.path.join(folder, d), folder=True)
    for f in files:
      if not os.path.islink(os.path.join(folder, f)):
        outputs.as_created(os.path.join(folder, f))


def parameters(trained) -> Dict[str, Any]:
  """Which parameters `trained` holds, and which the run evaluated.

  'exported': 'ema' (Polyak averages) or 'raw' for training workdirs, None
  for other checkpoints; 'evaluated': what the run's summary metrics were
  measured on ('ema', 'raw', or 'both': the averages under the usual
  names, the raw parameters under raw/<name>); 'matches': whether the
  usual metric names describe the exported parameters."""
  if trained.kind != 'workdir' or trained.params_kind is None:
    return {'exported': None, 'evaluated': None, 'matches': None}
  mode = (trained.config or {}).get('eval_ema') or 'ema'
  evaluated = 'raw' if mode == 'raw' or not trained.has_ema else mode
  main = 'ema' if evaluated in ('ema', 'both') else 'raw'
  ema_decay = ((trained.config or {}).get('optim') or {}).get('ema_decay')
  return {'exported': trained.params_kind, 'evaluated': evaluated,
          'eval_ema': mode, 'ema_decay': ema_decay if trained.has_ema
          else None, 'matches': main == trained.params_kind}


def _export(fmt, trained, out: str, options, tolerance: float
            ) -> Dict[str, Any]:
  """Writes, verifies and documents the export in the folder `out`."""
  # float32 means float32: no TF32 / bf16-pass matmuls on GPUs and TPUs,
  # neither in the exported graph nor in the reference it is checked with.
  precision = (jax.default_matmul_precision('highest')
               if options.dtype == 'float32' else contextlib.nullcontext())
  # The exported program runs elsewhere: no custom call of this process's
  # CPU matmul form (matmul.portable) in it.
  with precision, matmul.portable():
    start = time.time()
    info = fmt.export(trained, out, options)
    seconds = time.time() - start
    for name in info['files']:  # Some writers leave them private (0600).
      _as_created_tree(os.path.join(out, name.rstrip('/')))
    verification = verify(fmt, trained, out, options, tolerance)
  with open(os.path.join(out, 'labels.txt'), 'w') as f:
    f.write('\n'.join(trained.labels) + '\n')
  s, c = trained.image_size, trained.channels
  shape = (options.batch or 'B', *({'NCHW': (c, s, s)}.get(fmt.layout)
                                   or (s, s, c)))
  details = {k: v for k, v in info.items() if k not in ('files', 'warnings')}
  warnings = list(info.get('warnings', ()))  # The command prints them.
  manifest = {
      'format': fmt.name, 'model': trained.architecture,
      'source': trained.source, 'files': info['files'] + [
          'labels.txt', MANIFEST, 'MODEL_CARD.md'],
      'batch': options.batch or 'dynamic', 'dtype': options.dtype,
      'input': ('encoded images (string [B]), pre-processing inside; '
                if options.with_preprocessing else '') +
               f'float32 {list(shape)} {fmt.layout} in [-1, 1]',
      'layout': fmt.layout,
      'pre_processing': '|'.join(trained.pp),
      'num_classes': trained.num_classes, 'labels': 'labels.txt',
      'checkpoint_step': trained.step,
      'parameters': parameters(trained),
      'export_seconds': round(seconds, 2), 'bytes': _size(out),
      'verification': verification, 'details': details,
      'warnings': warnings,
      'versions': _versions(fmt),
  }
  with open(os.path.join(out, 'MODEL_CARD.md'), 'w') as f:
    f.write(card.render(trained, manifest))
  manifest['bytes'] = _size(out)  # Every file but export.json itself.
  with open(os.path.join(out, MANIFEST), 'w') as f:
    json.dump(manifest, f, indent=2, default=str)
  return manifest
