"""`export_model`: write a format, verify it, describe it.

The exported model's logits on a few images must equal the JAX model's
within `tolerance` (1e-4 at float32), at two batch sizes when the batch is
dynamic; formats embedding the pre-processing are also checked on encoded
JPEGs against our TF pre-processing + JAX model. Next to the format's files
go `labels.txt`, `export.json` (format, input, output activation,
pre-processing, verification, versions) and `MODEL_CARD.md`.

A new or empty `--out` (or an earlier export there, with --overwrite) is
written to a staging folder beside it, `.<name>.new-<host>-<pid>-<random>`,
and moved there once verified (an empty `--out` that is a mount point,
which cannot be replaced, is written into directly); one left behind by a
killed export is removed by the next export to the same `--out`.

Programs are traced inside `matmul.portable()`: a bf16 export's CPU program
takes the CPU matmul form 'bf16' whatever this host's (export.json's
`cpu_matmul_form`), so the same checkpoint exports to the same program and
logits on every host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from typing import Any, Dict, List, Optional

import jax
import numpy as np
from absl import logging

from vit_jax import outputs
from vit_jax.export import card, registry
from vit_jax.models import matmul

MANIFEST = 'export.json'
TOLERANCE = {'float32': 1e-4, 'bfloat16': 5e-2, 'float16': 1e-2}


class ExportError(RuntimeError):
  """An export that failed or whose outputs differ from the model's."""


@dataclasses.dataclass(frozen=True)
class _Target:
  """Where an export is written, and how it reaches `--out`."""
  folder: str             # Written into; `--out` itself when not staged.
  staged: bool            # Beside `--out`, moved there by `_publish`.
  # The earlier export's export.json (--overwrite; None: `--out` was
  # absent or empty), which must still be there when the new one replaces
  # it.
  earlier: Optional[bytes] = None
  # `--out` was an empty folder, which the staged export replaces.
  empty: bool = False


def check_out(out: str, overwrite: bool) -> Optional[bytes]:
  """Whether an export may go to `out`, without touching anything: an
  ExportError naming the problem and what to do where it may not. Returns
  the earlier export's export.json (--overwrite), None where `out` is new
  or empty. The command runs it before loading the checkpoint (seconds to
  minutes for a large one), `_target` again when the export starts."""
  _check_not_cwd(out)
  if os.path.exists(out) and not os.path.isdir(out):
    raise ExportError(f'--out={out} is a file: pass a folder (new or empty)')
  if not os.path.exists(out):
    above = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(above):
      above = os.path.dirname(above)
    if not os.path.isdir(above):
      raise ExportError(f'--out={out}: cannot create the folder: {above} is '
                        'a file')
    return None
  if not os.listdir(out):
    return None
  if not overwrite:
    raise ExportError(f'{out} exists and is not empty: pass a new --out, '
                      'or --overwrite to replace an earlier export there')
  earlier = _earlier_export(out)
  if earlier is None:
    raise ExportError(f'{out} is not an earlier export (no {MANIFEST}): '
                      'refusing to delete it; pass a new --out')
  extra = _unlisted(out)
  if extra:
    raise ExportError(
        f'{out} holds {_listed(extra)}. --overwrite replaces an earlier '
        'export and nothing else: move them out of the folder, or pass a '
        'new --out')
  return earlier


def _check_not_cwd(out: str) -> None:
  """ExportError where `out` is the current folder or one above it: the
  verified export replaces `out` by a rename (its earlier export, or the
  empty folder, is removed), which would leave the shell that ran the
  command in a deleted folder, seeing no files."""
  try:
    cwd = os.path.realpath(os.getcwd())
  except OSError:  # The current folder is gone already: nothing to keep.
    return
  real = os.path.realpath(out)
  if cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep):
    where = 'the current folder' if cwd == real else (
        f'a folder above the current one ({cwd})')
    raise ExportError(
        f'--out={out} is {where}: the export replaces that folder, which '
        'would leave this shell in a deleted one. Run it from another '
        'folder, or name another --out (e.g. a new folder in this one)')


def _target(out: str, overwrite: bool) -> _Target:
  """Where to export to `out` (`check_out` says whether it may).

  The export is staged beside `out`, so that a server watching it or its
  parent (TF Serving's version folders) never sees a half-written or
  unverified export: a new `out` is made by moving the verified export
  there, an empty one (a version folder made in advance) is replaced by
  it, and an earlier export there (with --overwrite) only once the new one
  is verified, so a failed export never loses a good one. Only an empty
  `out` that is a mount point, which no folder can replace, is exported
  into directly (said in a log line).
  """
  if os.path.isdir(out):
    _remove_stale(out)
  earlier = check_out(out, overwrite)
  if os.path.isdir(out) and earlier is None:  # Empty.
    if os.path.ismount(os.path.realpath(out)):
      logging.warning(
          '--out=%s is a mount point, which the verified export cannot be '
          'moved onto: writing the export into it directly, so a server '
          'watching it may see it before it is verified (removed if it '
          'fails). Export to a folder inside the mount to avoid that', out)
      return _Target(out, False)
    target = _Target(_staging(out), True, empty=True)
    _keep_mode(out, target.folder)
    return target
  if not os.path.exists(out):
    parent = os.path.dirname(os.path.abspath(out))
    try:
      os.makedirs(parent, exist_ok=True)
    except OSError as e:
      raise ExportError(f'--out={out}: cannot create the folder {parent}: '
                        f'{_why(e)}') from None
    _remove_stale(out)
  return _Target(_staging(out), True, earlier)


def _keep_mode(out: str, staging: str) -> None:
  """Gives `staging` the permissions (and, where allowed, the group) of
  the empty folder `out` it will replace: a version folder made in advance
  for a server may have been made readable to it so."""
  try:
    st = os.stat(out)
    os.chmod(staging, stat.S_IMODE(st.st_mode))
  except OSError:
    return
  try:
    os.chown(staging, -1, st.st_gid)
  except OSError:
    pass  # Not a group of this user: the folder keeps its default group.


def _earlier_export(out: str) -> Optional[bytes]:
  """The export.json of the export in `out` (None if it has none)."""
  try:
    with open(os.path.join(out, MANIFEST), 'rb') as f:
      return f.read()
  except OSError:
    return None


def _listed(extra: List[str]) -> str:
  """'N file(s) its earlier export did not write ...: a, b and 3 more'."""
  shown = ', '.join(extra[:4]) + (f' and {len(extra) - 4} more'
                                  if len(extra) > 4 else '')
  return (f'{len(extra)} file(s) its earlier export did not write (not in '
          f'its {MANIFEST}): {shown}')


def _host() -> str:
  """This machine's name as staging folders carry it (no '-')."""
  return re.sub(r'[^A-Za-z0-9.]', '_', socket.gethostname()) or 'host'


def _staging(out: str) -> str:
  """A new folder beside `out` (its real path: a symlink keeps pointing at
  the export) to write the export to first, named after this process."""
  real = os.path.realpath(out)
  try:
    staging = tempfile.mkdtemp(
        prefix=f'.{os.path.basename(real)}.new-{_host()}-{os.getpid()}-',
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


def _alive(host: Optional[str], pid: int) -> bool:
  """Whether process `pid` of `host` may still run (another machine's:
  cannot tell, so yes)."""
  if host is not None and host != _host():
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:  # Another user's process.
    return True
  return True


_OLD_FORMAT_AGE_S = 24 * 3600  # An earlier version's staging folder: stale.


def _age_s(path: str) -> float:
  try:
    return time.time() - os.path.getmtime(path)
  except OSError:
    return 0.0


def _remove_stale(out: str) -> None:
  """Removes what killed exports to `out` left beside it: staging folders
  (`.<name>.new-<host>-<pid>-<random>`, of earlier versions
  `.<name>.new-<random>`) and earlier exports moved aside for a swap that
  completed (`.<name>.old-<host>-<pid>`), of processes no longer running on
  this machine (an earlier version's, without a pid: once a day old).
  Nothing else is touched, nor folders of exports running."""
  real = os.path.realpath(out)
  parent, name = os.path.dirname(real), re.escape(os.path.basename(real))
  staging = re.compile(rf'\.{name}\.new-(?:(?P<host>[A-Za-z0-9._]+)-'
                       r'(?P<pid>\d+)-)?[a-z0-9_]{8}$')
  aside = re.compile(rf'\.{name}\.old-(?:(?P<host>[A-Za-z0-9._]+)-)?'
                     r'(?P<pid>\d+)$')
  try:
    entries = os.listdir(parent)
  except OSError:
    return
  for entry in sorted(entries):
    path = os.path.join(parent, entry)
    match = staging.match(entry) or aside.match(entry)
    if not match or os.path.islink(path) or not os.path.isdir(path):
      continue
    pid = match.group('pid')
    if pid is not None and _alive(match.group('host'), int(pid)):
      continue
    if pid is None and _age_s(path) < _OLD_FORMAT_AGE_S:
      continue  # An earlier version's (no pid): maybe still exporting.
    if match.re is aside and not os.path.isdir(real):
      logging.warning(
          'the earlier export of --out=%s is in %s: an export replacing it '
          'was killed between moving it aside and moving the new one in. '
          'Move it back to --out if you want it', out, path)
      continue
    logging.warning('removing %s: left by an export to --out=%s that was '
                    'killed', path, out)
    shutil.rmtree(path, ignore_errors=True)


def _keep(staging: str, out: str) -> str:
  """Moves the verified export in `staging`, which could not be published
  to `out`, to a visible name beside `out`; returns where it is."""
  real = os.path.realpath(out)
  kept = f'{real}.unpublished-{os.getpid()}'
  try:
    os.rename(staging, kept)
  except OSError:
    return staging
  return kept


def _publish(target: _Target, out: str) -> None:
  """Moves the verified export in `target.folder` to `out`: into a new or
  empty `out` only if it holds nothing meanwhile (an atomic rename, which
  replaces an empty folder and fails on one with files in it), or swapped
  in for the earlier export if that is still there as it was (which is put
  back if the swap fails). ExportError otherwise, naming where the
  verified export was kept."""
  staging, real = target.folder, os.path.realpath(out)
  changed = _changed(real, target.earlier)
  if changed:
    raise ExportError(
        f'--out={out} {changed} while this export ran (another export, or a '
        f'program writing there?): it is left as it is. The verified export '
        f'is in {_keep(staging, out)}: move it to --out yourself, or export '
        'again (with --overwrite to replace an earlier export there)')
  if target.earlier is None or not os.path.isdir(real):
    try:
      # Replaces an empty folder; fails on a non-empty one, and a file.
      os.rename(staging, real)
    except OSError as e:
      if target.empty and _empty_folder(real):
        _copy_into(staging, real, out, e)
        return
      what = ('appeared' if os.path.lexists(real) else
              f'could not be made ({_why(e)})')
      if target.empty and os.path.isdir(real):
        what = 'was written to'
      raise ExportError(
          f'--out={out} {what} while this export ran: it is left as it is. '
          f'The verified export is in {_keep(staging, out)}: move it to '
          '--out yourself') from e
    return
  old = os.path.join(os.path.dirname(real), f'.{os.path.basename(real)}'
                     f'.old-{_host()}-{os.getpid()}')
  try:
    os.rename(real, old)
  except OSError as e:
    raise ExportError(
        f'could not move the earlier export in --out={out} aside '
        f'({_why(e)}): it is unchanged, and the verified new one is in '
        f'{_keep(staging, out)}') from e
  try:
    os.rename(staging, real)
  except OSError as e:
    try:
      os.rename(old, real)
      where = f'is back in --out={out}'
    except OSError:
      where = f'is in {old}'
    raise ExportError(
        f'could not move the new export into --out={out} ({_why(e)}): the '
        f'earlier export {where}, and the verified new one is in '
        f'{_keep(staging, out)}') from e
  shutil.rmtree(old)


def _empty_folder(path: str) -> bool:
  try:
    return os.path.isdir(path) and not os.listdir(path)
  except OSError:
    return False


def _copy_into(staging: str, real: str, out: str, why: OSError) -> None:
  """Copies the verified export's files from `staging` into the empty
  folder `real`, which it could not replace (a mount point `ismount` does
  not see, such as a bind mount: EBUSY), then removes `staging`. A server
  watching `out` may see the files arrive one by one, all verified.
  ExportError if that fails: `out` emptied again, the export kept."""
  logging.warning(
      '--out=%s could not be replaced by the verified export (%s; a mount '
      'point?): copying its files into it instead, so a server watching it '
      'may see them arrive one by one', out, _why(why))
  try:
    for name in sorted(os.listdir(staging)):
      src, dst = os.path.join(staging, name), os.path.join(real, name)
      if os.path.isdir(src) and not os.path.islink(src):
        shutil.copytree(src, dst, symlinks=True)
      else:
        shutil.copy2(src, dst, follow_symlinks=False)
  except OSError as e:
    _clear(real)
    raise ExportError(
        f'could not copy the verified export into --out={out} ({_why(e)}): '
        f'it is left empty, and the export is in {_keep(staging, out)}: '
        'copy it to --out yourself') from e
  shutil.rmtree(staging, ignore_errors=True)


def _changed(real: str, earlier: Optional[bytes]) -> str:
  """How `real` differs from what `_target` found there: '' where it is
  unchanged (absent, empty, or the earlier export alone)."""
  if earlier is None:
    return ''  # Absent: the rename tells whether something appeared.
  if not os.path.isdir(real):
    return ''  # Gone: the export moves in.
  now = _earlier_export(real)
  if now != earlier:
    return ('holds another export now (its export.json changed)' if now
            else f'no longer holds the earlier export (no {MANIFEST})')
  try:
    extra = _unlisted(real)
  except ExportError as e:
    return f'no longer holds the earlier export alone ({e})'
  return f'holds {_listed(extra)} now' if extra else ''


def sample_images(trained, n: int, seed: int = 0) -> np.ndarray:
  """`n` float32 inputs in the model's input range (`Trained.input_range`,
  [-1, 1] for most; noise: every weight matters)."""
  rng = np.random.RandomState(seed)
  low, high = trained.input_range
  return rng.uniform(low, high, (n, *trained.image_shape)).astype(np.float32)


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
           options: registry.Options, tolerance: float,
           shown: Optional[str] = None) -> Dict[str, Any]:
  """Runs the export in `out` on a few inputs; ExportError if logits
  differ. Messages name `shown` (the `--out` a staged export is for)."""
  shown = out if shown is None else shown
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
      raise ExportError(f'{fmt.name} export to --out={shown}: {n} {what} '
                        f'gave logits of shape {theirs.shape}, expected '
                        f'{ours.shape}')
    diff = float(np.max(np.abs(theirs - ours)))
    diffs.append({'inputs': what, 'batch': n, 'max_abs_diff': diff})
    if not diff <= tolerance:
      raise ExportError(
          f'{fmt.name} export to --out={shown} is wrong: on {n} {what} its '
          f'logits differ from the JAX model\'s by up to {diff:.3g} '
          f'(tolerance {tolerance:g})')
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
  """{module: version} of vit_jax, JAX and what `fmt` needs, from their
  installed distributions' metadata (not all set `__version__`), and
  vit_jax's git commit where it runs from a checkout."""
  import importlib
  from importlib import metadata
  dists = metadata.packages_distributions()
  out = {}
  for module in ('vit_jax', 'jax', 'jaxlib') + tuple(fmt.requires):
    for dist in dists.get(module, []) + [module]:
      try:
        out[module] = metadata.version(dist)
        break
      except metadata.PackageNotFoundError:
        pass
    else:
      try:
        out[module] = str(importlib.import_module(module).__version__)
      except (ImportError, AttributeError):
        pass
  commit = _git_commit()
  if commit:
    out['vit_jax_git_commit'] = commit
  return out


def _git_commit() -> Optional[str]:
  """The commit of the git checkout vit_jax runs from (+ '-dirty' with
  uncommitted changes to tracked files), None if not one."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  if not os.path.exists(os.path.join(root, '.git')):
    return None
  try:
    head = subprocess.run(['git', '-C', root, 'rev-parse', 'HEAD'],
                          capture_output=True, text=True, timeout=10)
    dirty = subprocess.run(  # Reads only: no index refresh written.
        ['git', '--no-optional-locks', '-C', root, 'status', '--porcelain',
         '--untracked-files=no', '--', 'vit_jax'], capture_output=True,
        text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  if head.returncode != 0 or not head.stdout.strip():
    return None
  return head.stdout.strip() + ('-dirty' if dirty.returncode == 0 and
                                dirty.stdout.strip() else '')


def export_model(trained, fmt_name: str, out: str,
                 options: Optional[registry.Options] = None, *,
                 overwrite: bool = False,
                 tolerance: Optional[float] = None) -> Dict[str, Any]:
  """Exports `trained` (a `vit_jax.trained.Trained`) as `fmt_name` to
  `out`, verifies it and writes the model card; returns the manifest."""
  fmt = registry.get(fmt_name)
  registry.check_installed(fmt)
  options = registry.resolve(fmt, options or registry.Options(), trained)
  registry.check_options(fmt, options)
  registry.check_model(fmt, trained)
  if tolerance is None:
    tolerance = TOLERANCE.get(options.dtype, 1e-2)
  target = _target(out, overwrite)
  try:
    try:
      manifest = _export(fmt, trained, target.folder, options, tolerance,
                         shown=out)
    except OSError as e:  # Disk full, permissions, ... while writing.
      where = str(e.filename or target.folder)
      if target.staged and where.startswith(target.folder):  # --out's.
        where = out.rstrip('/') + where[len(target.folder):]
      raise ExportError(f'exporting to --out={out} failed at {where}: '
                        f'{_why(e)}') from e
  except BaseException:
    if target.staged:  # `out` is as it was: absent, empty, or the earlier
      # export.
      shutil.rmtree(target.folder, ignore_errors=True)
    else:  # `out` was empty: leave it so, ready for another try.
      _clear(target.folder)
    raise
  if target.staged:
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
  from vit_jax.train import run_files  # As trained.py: on use.
  mode = run_files.eval_mode(trained.config or {})
  evaluated = 'raw' if mode == 'raw' or not trained.has_ema else mode
  main = 'ema' if evaluated in ('ema', 'both') else 'raw'
  ema_decay = ((trained.config or {}).get('optim') or {}).get('ema_decay')
  return {'exported': trained.params_kind, 'evaluated': evaluated,
          'eval_ema': mode, 'ema_decay': ema_decay if trained.has_ema
          else None, 'matches': main == trained.params_kind}


def _export(fmt, trained, out: str, options, tolerance: float,
            shown: str) -> Dict[str, Any]:
  """Writes, verifies and documents the export in the folder `out` (for
  `--out=shown`, which messages name)."""
  # float32 means float32: no TF32 / bf16-pass matmuls on GPUs and TPUs,
  # neither in the exported graph nor in the reference it is checked with.
  precision = (jax.default_matmul_precision('highest')
               if options.dtype == 'float32' else contextlib.nullcontext())
  # The exported program runs elsewhere: no custom call of this process's
  # CPU matmul form, nor numerics this host chose (matmul.portable: its
  # CPU products take one form, whichever host exports).
  with precision, matmul.portable():
    start = time.time()
    info = fmt.export(trained, out, options)
    seconds = time.time() - start
    for name in info['files']:  # Some writers leave them private (0600).
      _as_created_tree(os.path.join(out, name.rstrip('/')))
    verification = verify(fmt, trained, out, options, tolerance, shown)
  with open(os.path.join(out, 'labels.txt'), 'w') as f:
    f.write('\n'.join(trained.labels) + '\n')
  s, c = trained.image_size, trained.channels
  shape = (options.batch or 'B', *({'NCHW': (c, s, s)}.get(fmt.layout)
                                   or (s, s, c)))
  details = {k: v for k, v in info.items() if k not in ('files', 'warnings')}
  warnings = list(info.get('warnings', ()))  # The command prints them.
  if trained.labels_are_placeholders:
    warnings.append(
        f'no class names: labels.txt holds placeholders ({trained.labels[0]}'
        f' ... {trained.labels[-1]}). Export with --labels=DATASET (e.g. '
        'imagenet2012, whose names are WordNet IDs) or --labels=FILE (one '
        'name per line, in logit order)')
  if fmt.dtypes and trained.compute_dtype() not in fmt.dtypes:
    warnings.append(
        f'the exported graph computes in {options.dtype}, the run in '
        f'{trained.compute_dtype()} (--format={fmt.name} exports '
        f'{" or ".join(fmt.dtypes)} only): its logits, and a few top-1 '
        'classes, may differ from the run\'s evaluation and predict\'s')
  manifest = {
      'format': fmt.name, 'model': trained.architecture,
      'source': trained.source, 'files': info['files'] + [
          'labels.txt', MANIFEST, 'MODEL_CARD.md'],
      'batch': options.batch or 'dynamic', 'dtype': options.dtype,
      # How its CPU program computes bf16 products (`matmul.portable`: the
      # same on every exporting host); None: the graph has none of them.
      'cpu_matmul_form': (matmul.PORTABLE_CPU_FORM
                          if options.dtype == 'bfloat16' else None),
      'input': ('encoded images (string [B]), pre-processing inside; '
                if options.with_preprocessing else '') +
               f'float32 [{", ".join(map(str, shape))}] {fmt.layout} '
               f'in {trained.input_range_text}'
               + ('' if options.batch else ', B >= 1'),
      'layout': fmt.layout,
      'image_size': trained.image_size,
      # The resolution its position embeddings were trained at (None: it
      # has none); another than image_size: interpolated (--image_size).
      'native_image_size': trained.native_image_size,
      'output_activation': trained.output_activation,
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
