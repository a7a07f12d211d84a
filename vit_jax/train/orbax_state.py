"""Train-state checkpoints with orbax: async, atomic, keep the last K, resume.

A checkpoint step directory holds the sharded `state` (every process writes
its own shards) and the input pipeline's position (`data`, JSON). Orbax
writes into a temporary directory and renames it when complete, so a run
killed mid-save keeps its previous checkpoint.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves every `every` steps (and on demand); restores the latest."""

  def __init__(self, workdir: str, *, every: int, keep: int = 3,
               async_save: bool = True):
    if '://' not in workdir:  # Local: absolute. gs:// and others: as given.
      workdir = os.path.abspath(workdir)
    directory = workdir.rstrip('/') + '/checkpoints'
    self.every = every
    self.manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True,
            enable_async_checkpointing=async_save),
        item_names=('state', 'data'))

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def due(self, step: int) -> bool:
    """Whether `step` is a multiple of `every` (0: only final saves)."""
    return self.every > 0 and step % self.every == 0

  def maybe_save(self, step: int, state: Any, data_state: dict, *,
                 force: bool = False) -> bool:
    """Saves when `due(step)` (or when forced); returns whether it did."""
    if not force and not self.due(step):
      return False
    if step in self.manager.all_steps():
      return False
    return self.manager.save(
        step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state)), force=True)

  def restore(self, abstract_state: Any, shardings: Any,
              expect: Optional[dict] = None
              ) -> Tuple[Optional[int], Any, Optional[dict]]:
    """(step, state, data_state) of the latest checkpoint, or (None, ...).

    `expect`: entries the saved JSON item must hold with equal values (e.g.
    the model config); a difference is an error naming both values.
    """
    step = self.manager.latest_step()
    if step is None:
      return None, None, None
    saved = self.manager.restore(step, args=ocp.args.Composite(
        data=ocp.args.JsonRestore()))['data']
    for key, value in (expect or {}).items():
      if key in saved and saved[key] != value:
        raise ValueError(
            f'{self.manager.directory} holds a checkpoint (step {step}) of a '
            f'different {key}: {saved[key]} there, {value} in this config. '
            'Use a new --workdir, or start from those weights with '
            '--config.init=<that workdir>')
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract_state, shardings)
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target),
          data=ocp.args.JsonRestore()))
    except Exception as e:  # Orbax raises many types; name the directory.
      raise RuntimeError(
          f'cannot restore checkpoint step {step} from '
          f'{self.manager.directory}: {e}. If the model or optimiser config '
          'changed, use a new --workdir (or start from these weights with '
          '--config.init)') from e
    return step, restored['state'], restored['data']

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def resolve(path: str) -> str:
  """The checkpoint step directory `path` names.

  `path` may be DIR (a workdir: its latest checkpoint), DIR/checkpoints, or
  DIR/checkpoints/<step>.
  """
  import tensorflow as tf
  path = path.rstrip('/')
  for directory in (path + '/checkpoints', path):
    if tf.io.gfile.isdir(directory):
      # Only finished saves: on object stores (gs://) orbax writes into the
      # step directory and marks it complete with commit_success.txt last.
      steps = [int(d.rstrip('/')) for d in tf.io.gfile.listdir(directory)
               if d.rstrip('/').isdigit() and tf.io.gfile.exists(
                   f'{directory}/{d.rstrip("/")}/commit_success.txt')]
      if steps:
        path = f'{directory}/{max(steps)}'
        break
  if not tf.io.gfile.isdir(path + '/state'):
    raise FileNotFoundError(
        f'no orbax train state under {path}: expected a workdir, its '
        'checkpoints/ folder or checkpoints/<step> (or pass an .npz file)')
  return path


def _restore_on_host(state_dir: str) -> Any:
  """A saved state tree as host numpy arrays, whatever mesh or process
  count saved it (each process reads whole arrays onto one local device)."""
  import numpy as np
  meta = ocp.StandardCheckpointer().metadata(state_dir).item_metadata.tree
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = jax.tree.map(
      lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
  state = ocp.StandardCheckpointer().restore(state_dir, target)
  return jax.tree.map(np.asarray, state)


def load_params(path: str) -> Any:
  """Parameters from a training workdir, its checkpoints dir or one step dir
  (see `resolve`). Returns a nested dict of host arrays."""
  return _restore_on_host(resolve(path) + '/state')['params']


def load_run_state(path: str) -> dict:
  """The JSON saved next to a checkpoint (model spec, input position)."""
  import json

  import tensorflow as tf
  with tf.io.gfile.GFile(resolve(path) + '/data/metadata') as f:
    return json.load(f)
