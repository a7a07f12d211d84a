"""Where a command writes, checked before the work starts.

An empty value (an unset shell variable: `--workdir=$WORKDIR`) would write
into the current directory, and `--workdir=~/run` reaches the program
unexpanded (the shell expands `~` only at the start of a word): the first
is refused, the second expanded. A file where a folder is expected, or a
folder where a file is, is refused; a missing parent folder of an output
file is created, so results computed for minutes are never lost to it.
"""

from __future__ import annotations

import os


class OutputPathError(ValueError):
  """An output path that cannot work; the message names the fix."""


def _expanded(path, flag: str, example: str, remote: bool) -> str:
  if path is None or not str(path).strip():
    raise OutputPathError(
        f'{flag} is empty (an unset shell variable?); pass where to write, '
        f'e.g. {flag}={example}')
  path = str(path)
  if '://' in path and not remote:
    raise OutputPathError(f'{flag}={path}: this command writes local files '
                          'only; write locally and copy (gsutil / gcloud '
                          'storage cp)')
  return path if '://' in path else os.path.expanduser(path)


def directory(path, flag: str = '--workdir', *, remote: bool = True) -> str:
  """`path` as a folder to write into (new or existing; gs:// where
  `remote`)."""
  path = _expanded(path, flag, '/tmp/run', remote)
  if '://' not in path and os.path.exists(path) and not os.path.isdir(path):
    raise OutputPathError(f'{flag}={path} is a file; pass a folder')
  return path


def file(path, flag: str, *, remote: bool = False) -> str:
  """`path` as a file to write (gs:// where `remote`): a local one's folder
  is created now."""
  path = _expanded(path, flag, '/tmp/out.json', remote)
  if '://' in path:
    return path
  if os.path.isdir(path):
    raise OutputPathError(f'{flag}={path} is a folder; pass a file name in '
                          'it')
  parent = os.path.dirname(os.path.abspath(path))
  try:
    os.makedirs(parent, exist_ok=True)
  except OSError as e:
    raise OutputPathError(f'{flag}={path}: cannot create its folder: {e}'
                          ) from None
  if not os.access(parent, os.W_OK):
    raise OutputPathError(f'{flag}={path}: {parent} is not writable')
  return path


def as_created(path: str, *, folder: bool = False) -> None:
  """Gives `path` the mode `open()` (or `os.makedirs`) would have: files
  made through `tempfile` (and by libraries that use it, e.g. safetensors)
  are private (0600 / 0700), which other users and serving containers
  reading an export cannot open."""
  mask = os.umask(0)
  os.umask(mask)
  os.chmod(path, (0o777 if folder else 0o666) & ~mask)
