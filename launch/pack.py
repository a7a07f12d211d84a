"""Packs a checkout for the workers: `python -m vit_jax.launch.pack REPO OUT`.

`launch.tpu setup` copies one archive to every worker instead of the whole
folder: in a git checkout (or a folder of a larger repository, a monorepo),
what git would commit (tracked files and untracked ones that .gitignore
does not exclude; `.git`, virtual environments and workdirs listed in
.gitignore stay behind; submodules and nested repositories by the same
rule, inside them); in a folder that is not in a git work tree, every file
but `.git` and `__pycache__`.
Symbolic links are kept as links. A tar.gz archive, written with Python's
`tarfile` so that it is the same on Linux and macOS.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from typing import List, Sequence

SKIPPED_DIRS = ('.git', '__pycache__')  # Outside git: never worth copying.


def _is_git_checkout(repo: str) -> bool:
  """Whether `repo` is in a git work tree: its own, or a larger
  repository's (a project in a monorepo's subfolder, whose .gitignore rules
  and the monorepo's apply: its environments and workdirs stay behind)."""
  if os.path.exists(os.path.join(repo, '.git')):
    return True  # git's own errors about it (ls-files) are worth showing.
  argv = ['git', '-C', repo, 'rev-parse', '--is-inside-work-tree']
  try:  # LC_ALL=C: git's message below in English, whatever the locale.
    p = subprocess.run(argv, capture_output=True, text=True,
                       env=dict(os.environ, LC_ALL='C', LANGUAGE='C'))
  except FileNotFoundError:
    return False  # No git here: it cannot read a checkout either.
  if p.returncode == 0:
    return p.stdout.strip() == 'true'  # 'false': inside a .git folder.
  if 'not a git repository' in p.stderr:
    return False
  # E.g. "detected dubious ownership": packing the folder as plain files
  # would ship everything .gitignore keeps out.
  raise ValueError(f'`{" ".join(argv)}` failed (exit {p.returncode}): '
                   f'{p.stderr.strip()}')


def files(repo: str) -> List[str]:
  """Paths relative to `repo` that the workers get, sorted (`git -C repo
  ls-files` lists them relative to `repo`, also in a subfolder of a larger
  repository)."""
  if _is_git_checkout(repo):
    argv = ['git', '-C', repo, 'ls-files', '-z', '--cached', '--others',
            '--exclude-standard']
    try:
      listed = subprocess.run(argv, check=True, capture_output=True).stdout
    except subprocess.CalledProcessError as e:
      # git's own words say what is wrong and how to fix it (e.g. "detected
      # dubious ownership ... git config --global --add safe.directory").
      raise ValueError(
          f'`{" ".join(argv)}` failed (exit {e.returncode}): '
          f'{e.stderr.decode(errors="replace").strip()}') from None
    names = {n.rstrip('/') for n in listed.decode().split('\0') if n}
    out = []
    for name in names:
      path = os.path.join(repo, name)
      if not os.path.lexists(path):
        continue  # Tracked but deleted in the working tree.
      if os.path.isdir(path) and not os.path.islink(path):
        # A submodule or a nested repository: git lists it as one path;
        # its own files are read the same way.
        out += [os.path.join(name, f) for f in files(path)]
      else:
        out.append(name)
    return sorted(out)
  out = []
  for top, dirs, names in os.walk(repo):
    dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
    rel = os.path.relpath(top, repo)
    out += [os.path.normpath(os.path.join(rel, n)) for n in names]
    # A link to a folder is not walked into: kept as a link.
    out += [os.path.normpath(os.path.join(rel, d)) for d in dirs
            if os.path.islink(os.path.join(top, d))]
  return sorted(out)


def ships(repo: str, relpath: str) -> bool:
  """Whether `relpath` (inside `repo`) reaches the workers: among `files`,
  itself or under a packed link to a folder (kept as a link, so with all
  it holds)."""
  packed = set(files(repo))
  if relpath in packed:
    return True
  parts = relpath.split(os.sep)
  return any(os.path.islink(os.path.join(repo, *parts[:i])) and
             os.path.join(*parts[:i]) in packed for i in range(1, len(parts)))


def pack(repo: str, out: str) -> List[str]:
  """Writes the archive of `files(repo)` to `out`; returns those files."""
  names = files(repo)
  if 'setup.py' not in names:
    raise ValueError(f'{repo}: setup.py is not among the files to copy '
                     '(untracked and ignored?)')
  tmp = out + '.partial'
  # A dry run's printed folder (a fresh temporary one) is gone by the time
  # its commands are pasted.
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with tarfile.open(tmp, 'w:gz') as tar:
    for name in names:
      tar.add(os.path.join(repo, name), arcname=name, recursive=False)
  os.replace(tmp, out)
  return names


def main(argv: Sequence[str]) -> int:
  if len(argv) != 2:
    print('usage: python -m vit_jax.launch.pack REPO OUT.tar.gz',
          file=sys.stderr)
    return 2
  repo, out = argv
  try:
    names = pack(repo, out)
  except (ValueError, OSError) as e:
    print(f'cannot pack {repo}: {e}', file=sys.stderr)
    return 1
  print(f'packed {len(names)} files of {repo} into {out} '
        f'({os.path.getsize(out) / 1e6:.1f} MB)')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
