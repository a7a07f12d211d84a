"""The import graph of vit_jax/, configs/ and launch/ is one-way.

Every module's imports are read with `ast`, those inside functions included
(an import moved into a function hides a cycle, it does not remove it).
"""

import ast
import os
from typing import Dict, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ('vit_jax', 'configs', 'launch')


def _modules() -> Dict[str, str]:
  """{dotted module name: file} of every module of PACKAGES."""
  out = {}
  for package in PACKAGES:
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
      for name in files:
        if not name.endswith('.py'):
          continue
        path = os.path.join(folder, name)
        parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
        if parts[-1] == '__init__':
          parts = parts[:-1]
        out['.'.join(parts)] = path
  return out


MODULES = _modules()


def _resolve(name: str) -> str:
  """The project module that importing `name` runs last (None: external)."""
  if name.startswith('vit_jax.configs') or name.startswith('vit_jax.launch'):
    name = name[len('vit_jax.'):]  # Installed names of configs/, launch/.
  while name and name not in MODULES:
    name = name.rpartition('.')[0]
  return name or None


def imports(module: str) -> Set[str]:
  """Project modules `module` imports, anywhere in its file."""
  tree = ast.parse(open(MODULES[module]).read())
  package = module if MODULES[module].endswith('__init__.py') else (
      module.rpartition('.')[0])
  out = set()
  for node in ast.walk(tree):
    names: List[str] = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        anchor = package.split('.')[:len(package.split('.')) - node.level + 1]
        base = '.'.join(anchor + ([base] if base else []))
      # `from pkg import mod` runs pkg/__init__ too, but a package that
      # re-exports its modules is not a cycle: only the module counts.
      names = [f'{base}.{a.name}' if f'{base}.{a.name}' in MODULES else base
               for a in node.names]
    for name in names:
      target = _resolve(name)
      if target and target != module:
        out.add(target)
  return out


GRAPH = {m: imports(m) for m in MODULES}


def _cycles() -> List[List[str]]:
  """One cycle through each strongly connected group of modules."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(GRAPH[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        found.append(sorted(group))

  for v in sorted(GRAPH):
    if v not in index:
      visit(v)
  return found


def test_the_graph_sees_function_level_imports():
  assert 'vit_jax.data.pipeline' in GRAPH['vit_jax.train.loop']
  assert len(MODULES) > 50


def test_no_import_cycles():
  assert _cycles() == [], 'modules that import each other (directly or ' \
      'through others); move what both need below them'


def _reaches(start: str) -> Set[str]:
  seen, todo = set(), [start]
  while todo:
    for w in GRAPH[todo.pop()]:
      if w not in seen:
        seen.add(w)
        todo.append(w)
  return seen


def test_evaluators_do_not_import_the_trainer():
  for module in MODULES:
    if module.startswith('vit_jax.evaluators'):
      bad = sorted(m for m in _reaches(module)
                   if m.startswith('vit_jax.train'))
      assert not bad, f'{module} imports {bad}'

