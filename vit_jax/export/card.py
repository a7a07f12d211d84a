"""MODEL_CARD.md: what an exported model is, written from its run.

Architecture and parameters from the model; data, steps, final metrics and
compute (exaFLOPs, core-days, device-hours) from the run's `summary.json`;
the training command and config from its `config.json`; the export itself
(format, input, pre-processing, verification) from `export_model`.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Dict, List

from vit_jax import accounting


def _row(key: str, value: Any) -> str:
  cell = str(value).replace('|', '\\|')  # A | would end the cell.
  return f'| {key} | {cell} |'


def _fmt(value: Any) -> str:
  if isinstance(value, float):
    return f'{value:.4g}'
  return str(value)


def _metrics(run: Dict[str, Any]) -> List[str]:
  keys = sorted(k for k in run if isinstance(run[k], (int, float)) and (
      'accuracy' in k or 'loss' in k or k.endswith('shot') or 'real' in k))
  return [_row(k, _fmt(run[k])) for k in keys]


_KINDS = {'ema': 'the EMA (Polyak-averaged) parameters',
          'raw': 'the raw (not averaged) parameters'}


def _exported(params: Dict[str, Any]) -> str:
  """The 'weights' row: which parameters the export holds."""
  kind = params.get('exported')
  if kind is None:
    return 'as stored in the checkpoint'
  if kind == 'ema':
    return (f'EMA (Polyak averages, optim.ema_decay='
            f'{params.get("ema_decay")})')
  return ('raw (the run kept no Polyak averages)' if params.get(
      'ema_decay') is None else 'raw (not the run\'s Polyak averages)')


def _evaluated_note(params: Dict[str, Any]) -> List[str]:
  """What the results were measured on, where not the exported
  parameters."""
  kind, evaluated = params.get('exported'), params.get('evaluated')
  if kind is None or evaluated is None:
    return []
  if evaluated == 'both':
    return [f'The run evaluated both (eval_ema=both): the metrics named '
            f'raw/... are of the raw parameters, the others of the EMA '
            f'averages. This export holds {_KINDS[kind]}: its results are '
            + ('the raw/... ones.' if kind == 'raw' else
               'the ones without raw/.'), '']
  if params.get('matches'):
    return []
  return [f'**These results are not this export\'s**: the run evaluated '
          f'{_KINDS[evaluated]} (eval_ema={params.get("eval_ema")}), and '
          f'this export holds {_KINDS[kind]}, whose accuracy may differ. '
          f'Export with --params={evaluated} for the evaluated ones.', '']


def render(trained, manifest: Dict[str, Any]) -> str:
  run, config = trained.run, trained.config
  params = manifest.get('parameters') or {}
  # summary.json describes the run's last step: another checkpoint of it
  # (--init=WORKDIR/checkpoints/<step>) has no results of its own there.
  step, last = trained.step, run.get('steps')
  other_step = step is not None and last is not None and step != last
  s, c = trained.image_size, trained.channels
  layout = manifest.get('layout', 'NHWC')
  dims = f'{c}x{s}x{s}' if layout == 'NCHW' else f'{s}x{s}x{c}'
  lines = [f'# Model card: {trained.architecture}', '']
  lines += [
      f'A {trained.family} image classifier trained with vit_jax and '
      f'exported as **{manifest["format"]}** on '
      f'{datetime.date.today().isoformat()}.', '',
      '## Model', '', '| | |', '|---|---|',
      _row('architecture', trained.architecture),
      _row('parameters', f'{trained.num_params():,}'),
      _row('classes', trained.num_classes),
      _row('input', f'{dims} float32, {layout}, values in [-1, 1]'),
      _row('pre-processing (eval)', '`' + '|'.join(trained.pp) + '`'),
  ]
  try:
    flops = accounting.forward_flops(
        trained.name, trained.image_size, trained.num_classes,
        **trained.options)
    lines.append(_row('forward GFLOPs per image', f'{flops / 1e9:.4g}'))
  except Exception:  # pylint: disable=broad-except
    pass
  lines.append(_row('checkpoint', f'`{trained.source}`'))
  if step is not None:
    lines.append(_row('checkpoint step', step))
  lines.append(_row('weights', _exported(params)))
  names = trained.labels
  shown = ', '.join(names[:20]) + (f', ... ({len(names)} in labels.txt)'
                                   if len(names) > 20 else '')
  lines += ['', f'Classes: {shown}', '']
  lines += ['## Training', '']
  if trained.kind != 'workdir':
    lines += [f'Loaded from {trained.kind} `{trained.source}`: not a vit_jax '
              'training run, so its data, steps and metrics are not known '
              'here.', '']
  else:
    inp = config.get('input', {})
    splits = ''
    if trained.data:
      from vit_jax.data import registry
      entry = registry.get(trained.data)
      splits = (f' (train split {inp.get("train_split") or entry.train_split}'
                f', eval split {inp.get("eval_split") or entry.eval_split})')
    lines += ['| | |', '|---|---|',
              _row('data', f'{trained.data}{splits}'),
              _row('steps', f'{step} (this checkpoint; summary.json is of '
                   f'step {last})' if other_step else
                   run.get('steps', 'unknown (no summary.json)')),
              _row('batch size', run.get('batch_size', '?'))]
    if not other_step:
      lines.append(_row('examples seen', _fmt(run.get('examples_seen',
                                                      '?'))))
    lines += [
              _row('image size', run.get('image_size', trained.image_size)),
              _row('initialised from', run.get('init') or 'scratch')]
    optim = config.get('optim')
    if optim:
      lines.append(_row('optimiser', ', '.join(
          f'{k}={v}' for k, v in sorted(optim.items()) if v is not None)))
    lines += ['']
    metrics = _metrics(run)
    lines += ['## Results', '']
    if other_step:
      lines += [f'Not known for this checkpoint (step {step}): the run\'s '
                f'summary.json records the results of step {last}, which '
                f'are not this checkpoint\'s. Export checkpoints/{last} '
                'for a card with results.']
    else:
      lines += _evaluated_note(params)
      lines += (['| metric | value |', '|---|---|', *metrics] if metrics
                else ['No final metrics (the run has no summary.json yet).'])
    lines += ['', '## Compute', '']
    if run and other_step:
      lines += [f'Of the run up to step {last} (summary.json; this '
                f'checkpoint is step {step}):', '']
    if run:
      lines += ['| | |', '|---|---|',
                _row('hardware', f'{run.get("num_devices", "?")} x '
                     f'{run.get("hardware", "?")}'),
                _row('wall time', f'{run.get("wall_s", 0) / 3600:.3g} h'),
                _row('device-hours', _fmt(run.get('device_hours', '?'))),
                _row('core-days', _fmt(run.get('core_days', '?'))),
                _row('training exaFLOPs', _fmt(run.get('exaflops', '?')))]
    else:
      lines += ['Not recorded (no summary.json).']
    lines += ['', '## How it was trained', '']
    if trained.command:
      lines += ['```bash', trained.command, '```']
    else:
      lines += ['The run predates config.json: its command was not '
                'recorded.']
  lines += ['', '## This export', '', '| | |', '|---|---|',
            _row('format', manifest['format']),
            _row('files', ', '.join(f'`{f}`' for f in manifest['files'])),
            _row('batch size', manifest['batch']),
            _row('takes', manifest['input']),
            _row('weights', _exported(params)),
            _row('verified', manifest['verification']['summary'])]
  note = (manifest.get('details') or {}).get('processor_note')
  if note and note not in (manifest.get('warnings') or ()):  # Said below.
    lines.append(_row('pre-processing', note))
  for warning in manifest.get('warnings') or ():
    lines += ['', f'**Warning**: {warning}']
  lines += ['', 'See docs/deploy.md of vit_jax for serving it.', '',
            '## Limitations', '',
            '- Accuracy holds for images like the training data, '
            'pre-processed as above; it was measured only on the data named '
            'here.',
            f'- The exported graph computes in {manifest["dtype"]}'
            + ('.' if manifest['dtype'] == trained.dtype else
               f'; the run evaluated in {trained.dtype}, so logits differ '
               'from its evaluation in the last digits.'), '']
  if config:
    lines += ['<details><summary>Full training config</summary>', '',
              '```json', json.dumps(config, indent=1, sort_keys=True), '```',
              '', '</details>', '']
  return '\n'.join(lines)
