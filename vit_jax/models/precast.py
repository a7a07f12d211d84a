"""Parameters cast once for serving: what a forward pass only ever narrows.

A model computing in bf16 keeps float32 parameters (the optimiser's) and
casts them to bf16 where it uses them, on every call. For inference that is
a full pass over the parameters per batch and a second, bf16, copy of them
alive during the call: on the Intel VM, 22% of ViT-B/16's bf16 forward time
(docs/performance.md). `cast_once` finds, from the forward pass's jaxpr, the
leaves whose every use is one conversion to a narrower dtype, and returns
the parameters with those leaves converted ahead of time. The model's own
conversions then do nothing, so the outputs are bitwise those of the float32
parameters; leaves used in float32 anywhere (LayerNorm statistics, a
float32 head) stay as they are. Uses inside the sub-programs that take
their operands in order are followed (custom VJPs, jit, remat, `scan` over
stacked layers); any other use (a while loop, a conditional) keeps the
leaf.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import numpy as np
from jax.extend import core as jex_core

_SUB_PROGRAMS = ('call_jaxpr', 'jaxpr')


def served_dtypes(fn: Callable[..., Any], params, *args):
  """The dtype each leaf of `params` is served in (a pytree like it): the
  one narrower dtype `fn(params, *args)` only ever converts it to, else its
  own. Call it where `fn` is traced (inside the mesh its sharding
  constraints name); `params` and `args` may be `jax.ShapeDtypeStruct`s."""
  leaves, treedef = jax.tree.flatten(params)
  jaxpr = jax.make_jaxpr(fn)(params, *args).jaxpr
  targets = [_only_narrowed_to(jaxpr, v) for v in jaxpr.invars[:len(leaves)]]
  return treedef.unflatten([np.dtype(x.dtype) if t is None else t
                            for x, t in zip(leaves, targets)])


def cast_once(fn: Callable[..., Any], params, *args):
  """`params` with each leaf in its `served_dtypes` dtype (module doc)."""
  return jax.tree.map(lambda x, t: x if x.dtype == t else x.astype(t),
                      params, served_dtypes(fn, params, *args))


def _only_narrowed_to(jaxpr, var) -> Optional[np.dtype]:
  """The dtype every use of `var` in `jaxpr` converts it to, if it is one
  and narrower than `var`'s; else None."""
  if any(v is var for v in jaxpr.outvars):
    return None
  found = set()
  for eqn in jaxpr.eqns:
    for i, v in enumerate(eqn.invars):
      if v is not var:
        continue
      if eqn.primitive.name == 'convert_element_type':
        found.add(np.dtype(eqn.params['new_dtype']))
        continue
      inner = _sub_program(eqn)
      if inner is None or len(inner.invars) != len(eqn.invars):
        return None
      target = _only_narrowed_to(inner, inner.invars[i])
      if target is None:
        return None
      found.add(target)
  if len(found) != 1:
    return None
  (target,) = found
  return target if target.itemsize < np.dtype(var.aval.dtype).itemsize else (
      None)


def _sub_program(eqn):
  """The jaxpr a call-like equation runs on its operands in order (custom
  VJP/JVP calls, nested jit, remat, scan), else None."""
  for name in _SUB_PROGRAMS:
    program = eqn.params.get(name)
    if isinstance(program, jex_core.ClosedJaxpr):
      return program.jaxpr
    if isinstance(program, jex_core.Jaxpr):
      return program
  return None
