"""Train-state checkpoints with orbax: async, atomic, keep the last K, resume.

A checkpoint step directory holds the sharded `state` (every process writes
its own shards) and the input pipeline's position (`data`, JSON). Orbax
writes into a temporary directory and renames it when complete, so a run
killed mid-save keeps its previous checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging as logging_std
import os
import time
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from vit_jax.checkpoint.npz import CheckpointNotFoundError
from vit_jax.train import preemption


class DamagedCheckpointError(RuntimeError):
  """A checkpoint step that cannot be read completely."""

  def __init__(self, message: str, *, reason: str):
    self.reason = _first_line(reason)
    super().__init__(f'{message} ({self.reason})'
                     if self.reason not in message else message)


class ConfigChangedError(ValueError):
  """An intact checkpoint of another model or optimiser configuration."""


class CheckpointUnavailableError(RuntimeError):
  """A checkpoint that could not be read for a passing reason (storage
  unavailable or timing out, out of memory): nothing is moved aside."""


class CheckpointWriteError(RuntimeError):
  """A checkpoint that could not be written (a full disk, storage refusing
  writes) or a damaged one that could not be moved aside: the run stops
  with the complete checkpoints it keeps, instead of training on unsaved."""


# Status codes and messages of failures that say nothing about the files:
# gRPC / absl codes (TensorStore, GCS, XLA) and the usual OS wordings.
_TRANSIENT_CODES = ('UNAVAILABLE', 'DEADLINE_EXCEEDED', 'RESOURCE_EXHAUSTED',
                    'ABORTED', 'CANCELLED', 'Out of memory', 'out of memory',
                    'Connection reset', 'timed out', 'Too many open files')
_TRANSIENT_ERRNOS = {errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                     errno.ECONNABORTED, errno.EAGAIN, errno.EMFILE,
                     errno.ENFILE, errno.ENOMEM, errno.EHOSTUNREACH,
                     errno.ENETUNREACH}


def _first_line(text: Any) -> str:
  """The first line of `text`, cut at 240 characters: Orbax / TensorStore
  errors can span pages, and a message names one cause in one line."""
  lines = str(text).strip().splitlines() or ['']
  return lines[0][:240] + ('...' if len(lines[0]) > 240 else '')


def _chain(error: Optional[BaseException]):
  """`error`, then the one it was raised from (or while handling), and so
  on: the cause a wrapper (orbax, TensorStore) hides is further down."""
  seen = set()  # A chain can loop back on itself.
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def transient(error: BaseException) -> bool:
  """Whether `error` (or one it was raised from) is a passing failure of the
  storage or the host rather than a sign of damaged files."""
  return any(
      isinstance(e, (MemoryError, TimeoutError, ConnectionError))
      or (isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS)
      or any(code in str(e) for code in _TRANSIENT_CODES)
      for e in _chain(error))


def _unavailable(failed: str, reason: str) -> CheckpointUnavailableError:
  """The error for a read that `failed` for a passing `reason`, on this
  process or another: the checkpoint keeps its place, so running the same
  command again resumes from it."""
  return CheckpointUnavailableError(
      f'{failed} for a passing reason ({reason}). Nothing was moved or '
      'deleted: run the same command again once the storage (or memory) is '
      'available')


def _unreadable(step_dir: str, item: str, e: Exception) -> Exception:
  """The error for an item that failed to restore: damaged files, or a
  passing failure that must not cost the checkpoint its place."""
  if transient(e):
    return _unavailable(f'could not read {step_dir}/{item}',
                        _first_line(e) or type(e).__name__)
  return DamagedCheckpointError(f'cannot read {step_dir}/{item}',
                                reason=f'{item} item: {e}')


class Checkpointer:
  """Saves every `every` steps (and on demand); restores the latest."""

  def __init__(self, workdir: str, *, every: int, keep: int = 3,
               async_save: bool = True):
    if '://' not in workdir:  # Local: absolute. gs:// and others: as given.
      workdir = os.path.abspath(workdir)
    directory = checkpoint_dir(workdir)
    self.every = every
    self._saving = None  # The step of the newest save begun.
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
    self.wait()  # Orbax's save waits too: a failure is the earlier step's.
    try:
      saved = self.manager.save(
          step, args=ocp.args.Composite(
              state=ocp.args.StandardSave(state),
              data=ocp.args.JsonSave(data_state)), force=True)
    except Exception as e:  # pylint: disable=broad-except
      raise self._write_failed(step, e) from e
    self._saving = step
    return saved

  def restore(self, abstract_state: Any, shardings: Any,
              expect: Optional[dict] = None,
              loose: Optional[Dict[str, Iterable[str]]] = None
              ) -> Tuple[Optional[int], Any, Optional[dict]]:
    """(step, state, data_state) of the newest good checkpoint, or Nones.

    Walks back from the newest step: a step that cannot be read completely
    (missing or garbled metadata, truncated array files, a missing item, or
    non-finite parameters) is damaged; a passing failure (storage
    unavailable, out of memory: `transient`) is CheckpointUnavailableError,
    with nothing moved. Once an older step restores, the
    damaged ones are moved aside to `<workdir>/damaged_checkpoints/` (never
    deleted) and reported. A checkpoint that is intact but holds another
    layout (another model or optimiser) is `ConfigChangedError`, and
    `expect` entries (e.g. the model config) must equal the saved JSON,
    but for the fields `loose` names per entry (e.g. the model's
    `registry.COMPUTE_OPTIONS`: how it computes, not what), which the
    caller may let change.
    Several processes each read their own shards and agree on every
    outcome (`_agreed`): they walk back, stop or go on together.
    """
    damaged = []  # (step, reason)
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        result = self._restore_step(step, abstract_state, shardings, expect,
                                    loose or {})
      except DamagedCheckpointError as e:  # On every process alike.
        logging.warning('checkpoint step %d is damaged: %s', step, e.reason)
        damaged.append((step, e.reason))
        continue
      self._move_aside(damaged)
      return result
    if damaged:
      listing = '; '.join(f'step {s}: {r}' for s, r in damaged)
      raise DamagedCheckpointError(
          f'every checkpoint in {self.manager.directory} is damaged '
          f'({listing}). Nothing was moved or deleted. To start this run '
          'over, move the checkpoints/ folder aside (or use a new --workdir)',
          reason='every step damaged')
    return None, None, None

  def _restore_step(self, step, abstract_state, shardings, expect, loose):
    step_dir = f'{self.manager.directory}/{step}'
    saved = _agreed(lambda: _read_data(step_dir), f'{step_dir}/data')

    def compared(key, value):
      value = as_saved(value)
      if isinstance(value, dict) and key in loose:
        value = {k: v for k, v in value.items() if k not in loose[key]}
      return value

    # Every process read the same JSON: they refuse it alike.
    for key, value in (expect or {}).items():
      if key in saved and compared(key, saved[key]) != compared(key, value):
        raise ConfigChangedError(
            f'{self.manager.directory} holds a checkpoint (step {step}) of a '
            f'different {key}: {compared(key, saved[key])} there, '
            f'{compared(key, value)} in this config. '
            'Use a new --workdir, or start from those weights with '
            '--config.init=<that workdir>')
    _agreed(lambda: _check_layout(step_dir, abstract_state),
            f'{step_dir}/state')
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract_state, shardings)
    state = _agreed(lambda: _read_state(step_dir, target), f'{step_dir}/state')
    if not _all_finite(state.params):  # Every process agrees.
      raise DamagedCheckpointError(
          f'{step_dir} holds non-finite parameters', reason=_NON_FINITE)
    return step, state, saved

  def _move_aside(self, damaged) -> None:
    """Moves damaged steps to <workdir>/damaged_checkpoints/ (process 0).
    A step that cannot be moved (storage without renames, permissions)
    stops the run on every process (CheckpointWriteError): left in place it
    would never be saved anew (orbax keeps a step it lists), and readers
    would take its files."""
    if not damaged:
      return
    root = str(self.manager.directory).rstrip('/')
    aside = root.rsplit('/', 1)[0] + '/damaged_checkpoints'
    stuck = []  # (step, why) of those process 0 could not move.
    if jax.process_index() == 0:
      for step, reason in damaged:
        src = epath.Path(f'{root}/{step}')
        dst = epath.Path(f'{aside}/{step}-{int(time.time())}')
        try:
          dst.parent.mkdir(parents=True, exist_ok=True)
          src.rename(dst)
        except Exception as e:  # pylint: disable=broad-except
          stuck.append((step, f'{type(e).__name__}: {e}'))
          continue
        logging.warning('moved damaged checkpoint step %d (%s) to %s',
                        step, reason, dst)
    error = None
    if stuck:
      steps = ', '.join(f'{root}/{s} ({why})' for s, why in stuck)
      error = CheckpointWriteError(
          f'damaged checkpoint step(s) could not be moved aside: {steps}. '
          'Nothing was trained or deleted. Move each into '
          f'{aside}/ yourself (or delete it), then re-run the same command')
    _agreed(lambda: _raise(error), 'moving damaged checkpoints aside')
    self.manager.reload()

  def wait(self) -> None:
    """Waits for the save in progress; CheckpointWriteError if it failed."""
    try:
      self.manager.wait_until_finished()
    except preemption.RunInterrupted:
      raise  # A SIGTERM while waiting: the run stops (75), no write error.
    except Exception as e:  # pylint: disable=broad-except
      raise self._write_failed(self._saving, e) from e

  def close(self) -> None:
    self.wait()
    try:
      self.manager.close()
    except preemption.RunInterrupted:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise self._write_failed(self._saving, e) from e

  def _write_failed(self, step: Optional[int], e: Exception) -> Exception:
    """One line for a save that failed (orbax's errors span pages, and its
    asynchronous saves report them a save later): the step, the cause and
    the complete steps the run keeps, which a re-run resumes from."""
    try:
      kept = sorted(ocp.step.checkpoint_steps(self.manager.directory))
    except Exception:  # pylint: disable=broad-except
      kept = None
    if kept is None:  # Some may be kept: a re-run finds them.
      listing = 'the complete checkpoints kept could not be listed'
      resume = 'resume from its newest complete checkpoint'
    else:
      kept = [s for s in kept if s != step]
      listing = ('the complete checkpoints kept: steps '
                 + ', '.join(map(str, kept)) if kept else
                 'no complete checkpoint is kept yet')
      resume = f'resume from step {kept[-1]}' if kept else 'start again'
    return CheckpointWriteError(
        f'could not save checkpoint step {step} in {self.manager.directory} '
        f'({_write_cause(e)}); {listing}. Free space (or fix the storage) '
        f'and re-run the same command to {resume}')


_NON_FINITE = 'non-finite parameters (saved before finite checks)'


def _write_cause(error: BaseException) -> str:
  """What stopped a write, in a few words: a full disk or quota where any
  error in the chain says so (orbax puts it at the end of a long line),
  else the first line of the error."""
  for e in _chain(error):
    for number, words in ((errno.ENOSPC, 'No space left on device'),
                          (errno.EDQUOT, 'Disk quota exceeded')):
      if getattr(e, 'errno', None) == number or words in str(e):
        return words
  return _first_line(error) or type(error).__name__


def _read_data(step_dir: str) -> dict:
  """A step's `data` item (the run state's JSON), read by this process
  alone (no barrier: see `_agreed`)."""
  try:
    saved = ocp.JsonCheckpointHandler().restore(
        epath.Path(step_dir) / 'data', args=ocp.args.JsonRestore())
    if not isinstance(saved, dict):
      raise ValueError(f'not a JSON object: {saved!r:.80}')
  except Exception as e:  # Missing or garbled JSON item.
    raise _unreadable(step_dir, 'data', e) from e
  return saved


def _read_state(step_dir: str, target: Any) -> Any:
  """A step's `state` item into `target`'s shardings: this process's
  shards, read by the item's handler, without the barrier that orbax's
  `Checkpointer.restore` holds after reading (one process failing there
  would leave the others waiting on it for good: see `_agreed`)."""
  handler = ocp.StandardCheckpointHandler()
  try:
    return handler.restore(epath.Path(step_dir) / 'state',
                           args=ocp.args.StandardRestore(target))
  except Exception as e:  # Orbax raises many types for damaged files.
    raise _unreadable(step_dir, 'state', e) from e
  finally:
    handler.close()


def _raise(error: Optional[Exception]) -> None:
  if error is not None:
    raise error


# How reading an item went on a process, in the order in which the
# processes' outcomes combine (the highest wins).
_OK, _DAMAGED, _REFUSED, _UNAVAILABLE, _WRITE, _FAILED = range(6)
_MESSAGE_BYTES = 1024  # Of each process's error, gathered with its outcome.


def _outcome(error: Optional[BaseException]) -> int:
  for kind, code in ((type(None), _OK), (DamagedCheckpointError, _DAMAGED),
                     (ConfigChangedError, _REFUSED),
                     (CheckpointUnavailableError, _UNAVAILABLE),
                     (CheckpointWriteError, _WRITE)):
    if isinstance(error, kind):
      return code
  return _FAILED


def _agreed(read, what: str) -> Any:
  """`read()`'s result, once every process has read its part of `what`.

  Each process reads its own shards, so one may fail where the others
  succeed. Orbax's restore then deadlocks (its barrier waits for a process
  that has left with the error) until the distributed service aborts every
  process minutes later (exit 134, which launchers do not restart). Here
  every process reads alone, then all exchange their outcomes and act on
  the worst one together: damaged on any process, the step is damaged on
  all (they walk back alike); unavailable on any, every one stops with
  CheckpointUnavailableError (exit 75: run again). A single process raises
  its own error as it is."""
  try:
    result, error = read(), None
  except Exception as e:  # pylint: disable=broad-except
    result, error = None, e
  if jax.process_count() == 1:
    _raise(error)
    return result
  every = _gather(_outcome(error), _message(error))
  worst = max(code for code, _ in every)
  if worst == _OK:
    return result
  if _outcome(error) == worst:
    raise error
  raise _their_error(worst, what, every)


def _message(error: Optional[BaseException]) -> str:
  if error is None:
    return ''
  return getattr(error, 'reason', None) or f'{error}' or type(error).__name__


def _gather(code: int, message: str) -> list:
  """[(outcome, message)] of every process (a collective: every process
  calls it at the same point)."""
  mine = np.zeros(_MESSAGE_BYTES + 1, np.int32)
  text = message.encode()[:_MESSAGE_BYTES]
  mine[0], mine[1:1 + len(text)] = code, np.frombuffer(text, np.uint8)
  every = np.asarray(multihost_utils.process_allgather(mine))
  return [(int(row[0]), bytes(row[1:].astype(np.uint8)).rstrip(b'\0')
           .decode(errors='replace')) for row in every.reshape(
               -1, _MESSAGE_BYTES + 1)]


def _their_error(worst: int, what: str, every: list) -> Exception:
  """The error of a process whose own read went better than another's."""
  bad = [i for i, (code, _) in enumerate(every) if code == worst]
  theirs = every[bad[0]][1]
  who = f'process {bad[0]}' if len(bad) == 1 else f'processes {bad}'
  if worst == _DAMAGED:
    return DamagedCheckpointError(f'{what} is damaged as {who} reads it',
                                  reason=f'{theirs} ({who})')
  if worst == _REFUSED:
    return ConfigChangedError(f'{theirs} ({who})')
  if worst == _UNAVAILABLE:
    return _unavailable(f'{who} could not read {what}', theirs)
  if worst == _WRITE:
    return CheckpointWriteError(theirs)
  return RuntimeError(f'{who} failed reading {what} ({theirs}): its log has '
                      'the traceback')


def as_saved(value: Any) -> Any:
  """`value` as the run state's JSON gives it back (tuples become lists),
  without unset (None) dict entries, so that a config value compares equal
  to the one a checkpoint recorded, whichever unset fields either lists
  (`config.model` lists every model option, unset)."""
  def prune(v):
    if isinstance(v, dict):
      return {k: prune(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
      return [prune(x) for x in v]
    return v
  return prune(json.loads(json.dumps(value)))


def checkpoint_dir(workdir: str) -> str:
  """The folder of `workdir`'s checkpoint steps (the trainer's, and the one
  readers look in first)."""
  return workdir.rstrip('/') + '/checkpoints'


def saved_steps(workdir: str) -> list:
  """The finished checkpoint steps in `workdir` (none: [])."""
  directory = checkpoint_dir(workdir)
  if not epath.Path(directory).is_dir():
    return []
  return sorted(ocp.step.checkpoint_steps(directory))


def resolve(path: str) -> str:
  """The checkpoint step directory `path` names.

  `path` may be DIR (a workdir: its latest finished checkpoint),
  DIR/checkpoints, or DIR/checkpoints/<step>. Steps are listed by orbax
  (finished saves only: temporary directories and, on object stores, steps
  without their commit marker are skipped). A local path comes back
  absolute: orbax reads no metadata through a relative one.
  """
  path = path.rstrip('/')
  if '://' not in path:
    path = os.path.abspath(path)
  for directory in (checkpoint_dir(path), path):
    steps = sorted(ocp.step.checkpoint_steps(directory), reverse=True)
    if steps:
      # The newest step with its state/ (one half-copied by rsync or
      # gsutil lacks it: the trainer sets such a step aside and resumes
      # from the one before, and readers take that one too, saying so).
      whole = [s for s in steps
               if epath.Path(f'{directory}/{s}/state').is_dir()]
      path = f'{directory}/{(whole or steps)[0]}'
      if whole and whole[0] != steps[0]:
        logging.warning(
            '%s: step(s) %s have no state/ (an incomplete copy?): using '
            'step %d, the newest complete one', directory,
            ', '.join(map(str, steps[:steps.index(whole[0])])), whole[0])
      break
  if not epath.Path(path + '/state').is_dir():
    raise CheckpointNotFoundError(
        f'no orbax train state under {path}: expected a workdir, its '
        'checkpoints/ folder or checkpoints/<step> (or pass an .npz file)')
  return path


class _NoStepMetadataWarning(logging_std.Filter):
  """Orbax warns that an item folder (`<step>/state`, read on its own by
  `StandardCheckpointer`) has no step metadata file: it never has one."""

  def filter(self, record):
    return not str(record.msg).startswith('Metadata file does not exist')


@contextlib.contextmanager
def _reading_an_item():
  quiet = _NoStepMetadataWarning()
  logger = logging.get_absl_logger()
  logger.addFilter(quiet)
  try:
    yield
  finally:
    logger.removeFilter(quiet)


def _check_layout(step_dir: str, abstract_state: Any) -> None:
  """ConfigChangedError if the saved arrays do not fit `abstract_state`;
  DamagedCheckpointError if the saved metadata cannot be read."""
  try:
    with _reading_an_item():
      meta = ocp.StandardCheckpointer().metadata(
          f'{step_dir}/state').item_metadata.tree
  except Exception as e:  # Missing / garbled metadata or missing state/.
    if transient(e):  # The storage, not the files.
      raise _unreadable(step_dir, 'state', e) from e
    raise DamagedCheckpointError(
        f'cannot read the metadata of {step_dir}/state',
        reason=f'state metadata: {e}') from e
  def shapes(tree):
    return {'/'.join(map(str, k)): tuple(v.shape)
            for k, v in ocp.tree.to_flat_dict(tree).items()}
  saved, ours = shapes(meta), shapes(abstract_state)
  diff = sorted(set(saved) ^ set(ours)) or sorted(
      k for k in saved if saved[k] != ours[k])
  if diff:
    key = diff[0]
    if all(k.startswith('ema_params/') for k in diff):
      there = 'holds' if key in saved else 'has no'
      raise ConfigChangedError(
          f'{step_dir} {there} EMA parameters and this config '
          f'{"does not set" if key in saved else "sets"} optim.ema_decay: '
          'averages cannot be added to or dropped from a run on resume. '
          'Keep the setting, or use a new --workdir with '
          '--config.init=<this workdir> (it starts from the averages when '
          'the run has them)')
    raise ConfigChangedError(
        f'{step_dir} is intact but holds another model or optimiser layout '
        f'({len(diff)} arrays differ, e.g. {key}: {saved.get(key, "absent")} '
        f'there, {ours.get(key, "absent")} in this config). If the model or '
        'optimiser config changed, use a new --workdir (or start from these '
        'weights with --config.init)')


def _all_finite(tree: Any) -> bool:
  """Whether every float in `tree` is finite: one program over all of it
  (one eager reduction per sharded parameter, each a program with its own
  all-reduce, deadlocked XLA:CPU's simulated devices now and then, which
  aborts the process)."""
  leaves = [x for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return bool(_finite(leaves)) if leaves else True


@jax.jit
def _finite(leaves):
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _restore_on_host(state_dir: str,
                     keys: Optional[Sequence[str]] = None) -> Any:
  """The `keys` subtrees (those saved; None: all) of a saved state tree as
  host numpy arrays, whatever mesh or process count saved it. Only they are
  read (not the optimizer's moments: 3x the parameters' bytes with Adam),
  onto the CPU, so serving a ViT-H does not fill the first accelerator's
  memory."""
  try:  # The CPU; a process without a CPU backend: its first device.
    host = jax.local_devices(backend='cpu')[0]
  except RuntimeError:  # JAX_PLATFORMS=tpu or cuda.
    host = jax.local_devices()[0]
  try:
    with _reading_an_item():
      meta = ocp.StandardCheckpointer().metadata(state_dir).item_metadata.tree
      cpu = jax.sharding.SingleDeviceSharding(host)
      target = {k: jax.tree.map(
          lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu),
          meta[k]) for k in (meta if keys is None else keys) if k in meta}
      state = ocp.PyTreeCheckpointer().restore(
          state_dir, args=ocp.args.PyTreeRestore(
              item=target, partial_restore=True,
              restore_args=jax.tree.map(
                  lambda _: ocp.ArrayRestoreArgs(sharding=cpu), target)))
  except Exception as e:  # Orbax raises many types for damaged files.
    raise DamagedCheckpointError(
        f'cannot read the checkpoint {state_dir}; it is damaged: pass '
        'an earlier step, checkpoints/<step>, instead', reason=str(e)) from e
  return jax.tree.map(np.asarray, state)


def load_weights(path: str) -> Tuple[Any, Optional[Any]]:
  """(parameters, their Polyak averages or None) of a training workdir, its
  checkpoints dir or one step dir (see `resolve`), as host arrays, from one
  read of the checkpoint (of those two trees only)."""
  state_dir = resolve(path) + '/state'
  state = _restore_on_host(state_dir, ('params', 'ema_params'))
  if 'params' not in state:
    raise DamagedCheckpointError(
        f'{state_dir} holds no params; it is damaged: pass an earlier step, '
        'checkpoints/<step>, instead', reason='state without params')
  return state['params'], state.get('ema_params')


def load_params(path: str, ema: Optional[bool] = None) -> Any:
  """Parameters from a training workdir, its checkpoints dir or one step dir
  (see `resolve`). Returns a nested dict of host arrays.

  A run with `optim.ema_decay` saved Polyak averages beside its parameters:
  `ema=None` returns the averages when there are any, True requires them,
  False returns the raw parameters (fine-tuning, prediction and export
  take those the run's metrics describe: `run_files.described_params`).
  """
  params, averages = load_weights(path)
  if ema is False or (ema is None and averages is None):
    return params
  if averages is None:
    raise ValueError(f'{resolve(path)} holds no EMA parameters (its run did '
                     'not set optim.ema_decay): load its raw parameters '
                     'instead')
  logging.info('%s: using its EMA (Polyak-averaged) parameters', path)
  return averages


def load_run_state(path: str) -> dict:
  """The JSON saved next to a checkpoint (model spec, input position)."""
  import json
  meta = epath.Path(resolve(path)) / 'data' / 'metadata'
  try:
    return json.loads(meta.read_text())
  except (OSError, ValueError) as e:
    raise DamagedCheckpointError(
        f'cannot read {meta}; the checkpoint is damaged: pass an '
        'earlier step, checkpoints/<step>, instead', reason=str(e)) from e


def patch_grid(path: str) -> Optional[Tuple[int, int]]:
  """(rows, cols) of the patch grid a checkpoint's model was trained on, as
  its run recorded it; None for checkpoints of models without a grid (BiT)
  and those of earlier versions, which did not record it."""
  grid = load_run_state(path).get('patch_grid')
  return tuple(int(n) for n in grid) if grid else None
