"""Experiment configs: one file per family, rows picked by `file.py:args`."""

from __future__ import annotations

import os
from typing import Tuple

HERE = os.path.dirname(os.path.abspath(__file__))


def config_file(spec: str) -> Tuple[str, str]:
  """`path:args` -> (absolute path, ':args' or '').

  `configs/<name>.py` resolves to the installed copy of this folder when
  the command runs outside a checkout (a relative path that is not there);
  a file found nowhere is a ValueError listing the config files.
  """
  path, sep, arg = spec.partition(':')
  full = os.path.abspath(os.path.expanduser(path))
  if not os.path.isfile(full) and not os.path.isabs(path):
    installed = os.path.join(HERE, os.path.basename(path))
    if os.path.dirname(os.path.normpath(path)) == 'configs' and (
        os.path.isfile(installed)):
      full = installed
  if not os.path.isfile(full):
    files = sorted(f for f in os.listdir(HERE) if f.endswith('.py') and
                   not f.startswith('_') and
                   'def get_config(' in open(os.path.join(HERE, f)).read())
    raise ValueError(f'--config={spec}: no such file {full}. The config '
                     f'files are configs/{{{",".join(files)}}}')
  return full, sep + arg
