"""Whether an entry registered again under a taken name is the same one.

A config file runs twice per run (`configs.common.check_command_line`
checks the command line with it, then ml_collections' config_flags builds
the config from it), so a class or function it defines and registers (an
evaluator, a data source kind, a pre-processing op, a model family) arrives
twice, as two objects. The extension registries take the second for the
first when it is the same definition (qualified name and source file) and
refuse anything else under a taken name.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Optional


def source_file(obj: Any) -> Optional[str]:
  """The file defining class or function `obj`, or None. A class's from its
  methods' code first: its module name may by now be another module's (a
  config file's, loaded under one fixed name each time)."""
  functions = [obj] if not isinstance(obj, type) else [
      getattr(v, '__func__', v) for v in vars(obj).values()]
  for function in functions:
    code = getattr(function, '__code__', None)
    if code is not None:
      return os.path.realpath(code.co_filename)
  try:
    return os.path.realpath(inspect.getfile(obj))
  except (TypeError, OSError):
    return None


def same_definition(first: Any, second: Any) -> bool:
  """Whether `second` is `first`, or its definition run again."""
  if first is second:
    return True
  where = source_file(first)
  return bool(where and getattr(first, '__qualname__', None) ==
              getattr(second, '__qualname__', None) and
              where == source_file(second))


def describe(obj: Any) -> str:
  """`module.QualName (file)`, for the error naming both entries."""
  return (f'{getattr(obj, "__module__", "?")}.'
          f'{getattr(obj, "__qualname__", obj)} '
          f'({source_file(obj) or "source unknown"})')


def check_free(what: str, name: str, first: Any, new: Any) -> None:
  """Refuses `new` as the `what` (e.g. 'evaluator type') `name` when
  `first`, already registered under it, is not the same definition
  (None: the name is free)."""
  if first is not None and not same_definition(first, new):
    raise ValueError(f'{what} {name!r} is already registered by '
                     f'{describe(first)}; register {describe(new)} under '
                     'another name')
