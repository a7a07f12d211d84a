"""The built-in source kinds, and opening the source of a registry entry.

Importing this module registers the kinds `tfds`, `folder`, `tfrecord` and
`memory` (`sources.register`); kinds registered elsewhere open alike.
"""

from __future__ import annotations

import json
from typing import Dict

# Imported for their registrations.
from vit_jax.data import folder_source  # noqa: F401
from vit_jax.data import memory_source  # noqa: F401
from vit_jax.data import tfds_source  # noqa: F401
from vit_jax.data import tfrecord_source  # noqa: F401
from vit_jax.data import sources
from vit_jax.data.registry import DatasetSpec

_OPENED: Dict[tuple, sources.Source] = {}


def config_fields(input_config) -> dict:
  """The config's fields as a plain dict (references resolved)."""
  if hasattr(input_config, 'to_dict'):
    return input_config.to_dict()
  return dict(input_config)


def open_source(spec: DatasetSpec, input_config) -> sources.Source:
  """The source for a registry entry, configured by `input_config`.

  Sources are kept per configuration: a folder is listed (and a tfds
  builder loaded) once per process, however many iterators read it. The
  configuration is every field of `input_config` (a kind of one's own may
  read fields of its own, `input.npz_path`), so `settings.read` hands over
  the source's fields only, not the pipeline's (batch sizes,
  pre-processing, ...): changing those opens no new source.
  """
  key = (spec.name, id(spec), json.dumps(config_fields(input_config),
                                         sort_keys=True, default=repr))
  if key not in _OPENED:
    _OPENED[key] = sources.get_kind(spec.source, spec.name).open(spec,
                                                             input_config)
  return _OPENED[key]


def preparable(spec: DatasetSpec) -> bool:
  """Whether `spec`'s kind can be prepared (`vit_jax.data.prepare`)."""
  return sources.get_kind(spec.source, spec.name).preparable
