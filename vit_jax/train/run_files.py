"""A workdir's JSON files: config.json, summary.json, eval_summary.json.

Written atomically (a temporary file, then a rename) by process 0, read by
every reader of a workdir: the trainer, `mode=eval`, `python -m
vit_jax.vtab` (is a task done?), predict and export (`vit_jax.trained`).
Local or gs:// paths through `etils.epath`, which loads TensorFlow only for
gs:// (its `tf.io.gfile` backend): reading a local workdir loads none.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from typing import Any, Dict, Optional, Sequence

import jax
from absl import logging
from etils import epath

SUMMARY = 'summary.json'
CONFIG = 'config.json'
EVAL_SUMMARY = 'eval_summary.json'


# What a transfer run's report says of its pre-training; the init run's own
# report (when `init` is a workdir of ours) is the authority on it: the
# trainer writes those into summary.json (`loop._report`). `recipe`: a
# pre-training recipe other than the paper's (AugReg's), which no paper
# cell is (`tables.Run.setting`).
PRETRAIN_FIELDS = ('model', 'pretrain', 'pretrain_epochs',
                   'pretrain_optimizer', 'recipe')

def write_text(path: str, text: str) -> None:
  """Writes via a temporary file and a rename (local or gs:// paths)."""
  tmp = epath.Path(path + '.tmp')
  tmp.write_text(text)
  tmp.replace(path)


def write_json(workdir: str, name: str, content: Dict[str, Any]) -> str:
  """Writes `workdir/name` atomically (process 0 only); returns its path."""
  path = os.path.join(workdir, name)
  if jax.process_index() == 0:
    epath.Path(workdir).mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(content, indent=2, sort_keys=True) + '\n')
  return path


def write_summary(workdir: str, summary: Dict[str, Any], *,
                  fresh: bool = False) -> str:
  """Writes summary.json atomically (process 0 only); returns its path.

  An earlier summary in the workdir is merged in (its keys this one lacks
  are kept) only where both describe one step of one training: this one
  names no `steps` (the evaluator metrics `mode=eval` merges, after checking
  that they are of the step the run finished at) or the earlier one's, and
  the writer does not say `fresh` (a run that trained since it was written:
  `loop.summarise`). Otherwise it is replaced whole: a finished run extended
  by more steps, or trained again, keeps none of the earlier step's metrics
  (a few-shot or ReaL accuracy of other parameters shown as the new step's).
  """
  if jax.process_index() == 0:
    earlier = read_summary(workdir)
    then, now = earlier.get('steps'), summary.get('steps')
    if earlier and (fresh or (now is not None and then != now)):
      dropped = sorted(set(earlier) - set(summary))
      if dropped:
        logging.info('%s/%s of step %s replaced by step %s\'s: dropped %s',
                     workdir, SUMMARY, then, now, ', '.join(dropped))
      earlier = {}
    summary = {**earlier, **summary}
  return write_json(workdir, SUMMARY, summary)


def write_config(workdir: str, config, command: Optional[str] = None,
                 class_names: Optional[Sequence[str]] = None) -> str:
  """Writes `workdir/config.json`: the run's full config and the command
  that started it (process 0 only), read back by `read_config` (predict,
  export and the model card rebuild the evaluated model from it), and the
  name of each label the run trained on (`class_names`, where the data has
  names): a class folder renamed, or data not on the machine that predicts,
  does not rename the model's classes."""
  if command is None:
    script = sys.argv[0] if sys.argv else ''
    package = os.path.basename(os.path.dirname(os.path.abspath(script)))
    module = os.path.splitext(os.path.basename(script))[0]
    prog = (['python', '-m', f'{package}.{module}'] if package == 'vit_jax'
            else ['python', script])
    command = shlex.join(prog + sys.argv[1:])
  content = {'command': command,
             'config': json.loads(config.to_json_best_effort())}
  if class_names:
    content['class_names'] = [str(n) for n in class_names]
  return write_json(workdir, CONFIG, content)


def read_config(workdir: str) -> Dict[str, Any]:
  """`workdir/config.json` ({'command', 'config'}), {} if absent or
  unreadable (runs of earlier versions did not write it)."""
  try:
    content = json.loads((epath.Path(workdir) / CONFIG).read_text())
  except (ValueError, OSError):  # FileNotFoundError is an OSError.
    return {}
  return content if isinstance(content, dict) else {}


def first_difference(then: Any, now: Any, path: str = '', *,
                     skip: frozenset = frozenset(),
                     skip_keys: frozenset = frozenset()):
  """The first field where config values `now` differ from the recorded
  `then`, as (dotted path, then, now), else None. Dicts are compared over
  the keys `then` has (a record of an earlier version, written before a
  field existed, lacks it: not compared); fields whose path is in `skip`,
  or whose own key is in `skip_keys` at any depth, are not compared.
  Values compare as JSON gives them back (tuples equal lists)."""
  if isinstance(then, dict) and isinstance(now, dict):
    for key in sorted(then):
      field = f'{path}.{key}' if path else key
      if field in skip or key in skip_keys:
        continue
      found = first_difference(then[key], now.get(key), field, skip=skip,
                               skip_keys=skip_keys)
      if found:
        return found
    return None
  as_json = lambda v: json.loads(json.dumps(v, default=str))
  return None if as_json(then) == as_json(now) else (path, then, now)


def init_report(path: Optional[str]) -> Optional[Dict[str, Any]]:
  """The `report` of the vit_jax run `path` is (a workdir) or one of whose
  checkpoint steps it is (`WORKDIR/checkpoints/<step>`): its summary.json's,
  else its config.json's; None for an .npz, a step directory copied out of
  its run's workdir, or anything else (another project's checkpoint)."""
  if not path or str(path).endswith('.npz'):
    return None
  path = str(path).rstrip('/')
  checkpoints = os.path.dirname(path)
  if os.path.basename(checkpoints) == 'checkpoints':
    workdir = os.path.dirname(checkpoints)
  elif any((epath.Path(path) / name).exists() for name in (SUMMARY, CONFIG)):
    workdir = path  # A workdir itself (what `init=` names).
  else:
    return None
  report = read_summary(workdir, own=False).get('report')
  if report is None:
    report = (read_config(workdir).get('config') or {}).get('report')
  return report if isinstance(report, dict) and report else None


def eval_mode(config: Dict[str, Any]) -> str:
  """The `eval_ema` mode a run's (recorded) `config` evaluated with: 'ema'
  where unset (runs before the field, and the default)."""
  return config.get('eval_ema') or 'ema'


def described_params(config: Dict[str, Any]) -> Optional[bool]:
  """The `ema=` of `orbax_state.load_params` / `trained.load` that gives the
  parameters a run's metrics describe, from its recorded `config`: False
  (the raw ones) where it evaluated only those (`eval_ema='raw'`), else
  None (its Polyak averages where it has any). What predict, export,
  inspect and `init=` read by default."""
  return False if eval_mode(config) == 'raw' else None


def read_summary(workdir: str, *, own: bool = True) -> Dict[str, Any]:
  """`workdir/summary.json` as a dict ({} if absent). An unreadable one
  (edited by hand, a foreign file) is never silently dropped: in the run's
  own workdir (`own`, where it is about to be written anew) it is renamed
  aside with a warning; another run's (an init, a model being exported,
  perhaps on read-only storage) is left as it is, with a warning."""
  path = epath.Path(workdir) / SUMMARY
  if not path.exists():
    return {}
  try:
    content = json.loads(path.read_text())
    if not isinstance(content, dict):
      raise ValueError('not a JSON object')
    return content
  except (ValueError, UnicodeDecodeError) as e:
    if not own:
      logging.warning('%s is unreadable (%s); read as empty', path, e)
      return {}
    aside = f'{path}.unreadable-{int(time.time())}'
    logging.warning('%s is unreadable (%s); renamed to %s and written anew',
                    path, e, aside)
    if jax.process_index() == 0:
      path.replace(aside)
    return {}
