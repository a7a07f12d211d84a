"""Experiment configs: one file per family, rows picked by `file.py:args`."""

from __future__ import annotations

import os
from typing import Optional, Tuple

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


def unknown_field(config, path: str) -> Optional[str]:
  """What is wrong with `--config.<path>` when it names no field of
  `config` (config_flags would raise a traceback), else None."""
  import difflib
  node, done = config, []
  for key in path.split('.'):
    if '[' in key:
      return None  # An element of a sequence: config_flags' own business.
    keys = list(node.keys()) if hasattr(node, 'keys') else []
    if key not in keys:
      close = difflib.get_close_matches(key, keys, n=3)
      where = '.'.join(['config'] + done)
      return (f'--config.{path}: {where} has no field {key!r}'
              + (f' (did you mean {" or ".join(close)}?)' if close else '')
              + (f'; its fields: {", ".join(sorted(keys))}' if keys else
                 f' ({where} is empty: its entries are added in a config '
                 'file, e.g. configs/smoke.py:fewshot=digits for evals; '
                 'see docs/configs.md)' if hasattr(node, 'keys') else
                 f' ({where} is a value, not a section)'))
    node, done = node[key], done + [key]
  return None
