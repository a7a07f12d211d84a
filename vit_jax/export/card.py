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


def _hardware(run: Dict[str, Any]) -> str:
  """'8 x tpu_v3'; a run resumed on other hardware lists each kind
  ('tpu_v3, cpu'), without the last part's device count."""
  hardware = str(run.get('hardware', '?'))
  if ', ' in hardware:
    return f'{hardware} (resumed on other hardware)'
  return f'{run.get("num_devices", "?")} x {hardware}'


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


_ORIGIN = {'workdir': 'trained with vit_jax',
           'npz': 'loaded from the .npz checkpoint',
           'hf': 'loaded from the Hugging Face directory'}


def _opening(trained, manifest: Dict[str, Any]) -> str:
  """The card's first sentence: what the model is and where it came from."""
  origin = _ORIGIN.get(trained.kind, f'loaded from {trained.kind}')
  if trained.kind != 'workdir':
    origin += f' `{trained.source}`'
  return (f'A {trained.family} image classifier {origin}, exported by '
          f'vit_jax as **{manifest["format"]}** on '
          f'{datetime.date.today().isoformat()}.')


def _output(trained, manifest: Dict[str, Any]) -> str:
  """The 'gives' row: the logits, and how they become probabilities."""
  probabilities = ('`probabilities` output' if manifest['format'] ==
                   'savedmodel' else 'probabilities')
  if trained.output_activation == 'sigmoid':
    how = (f'{probabilities} = sigmoid(logits), each class on its own '
           '(multi-label: they need not sum to 1' + (
               '; the run trained with loss=sigmoid' if trained.kind ==
               'workdir' else '') + ')')
  else:
    how = f'{probabilities} = softmax(logits) over the classes'
  return f'logits [B, {trained.num_classes}]; {how}'


def _not_known(trained, step, last) -> List[str]:
  """Why the run's summary.json results are not this export's (one
  paragraph per reason): another checkpoint than the one it describes, or
  another input size than the one they were measured at."""
  reasons = []
  if step is not None and last is not None and step != last:
    reasons.append(
        f'Not known for this checkpoint (step {step}): the run\'s '
        f'summary.json records the results of step {last}, which are not '
        f'this checkpoint\'s. Export checkpoints/{last} for a card with '
        'results.')
  measured = trained.run.get('image_size')
  if measured and measured != trained.image_size:
    native = trained.native_image_size
    resized = (f'; its position embeddings are interpolated from {native} '
               'px, as fine-tuning does, without training at that size'
               if native and native != trained.image_size else '')
    reasons.append(
        f'Not known at {trained.image_size} px: the run\'s summary.json '
        f'records results measured at {measured} px, and this export takes '
        f'{trained.image_size} px inputs (--image_size{resized}), so its '
        'accuracy may differ. Export without --image_size for a card with '
        f'results, or fine-tune at {trained.image_size} px '
        '(configs/finetune.py) and export that.')
  return reasons


def _computes_in(trained, manifest: Dict[str, Any]) -> str:
  """The 'computes in' row: the export's dtype, and the model's own."""
  own = trained.compute_dtype()
  if manifest['dtype'] != own:
    return f'{manifest["dtype"]} (the model computes in {own})'
  return (f'{own}, the model\'s own (as predict computes'
          + (' and the run evaluated' if trained.kind == 'workdir' else '')
          + '; --dtype exports another)')


def render(trained, manifest: Dict[str, Any]) -> str:
  run, config = trained.run, trained.config
  params = manifest.get('parameters') or {}
  # summary.json describes the run's last step at the run's resolution:
  # another checkpoint of it (--init=WORKDIR/checkpoints/<step>), or the
  # model at another --image_size, has no results of its own there.
  step, last = trained.step, run.get('steps')
  other_step = step is not None and last is not None and step != last
  not_known = _not_known(trained, step, last)
  s, c = trained.image_size, trained.channels
  native = trained.native_image_size
  layout = manifest.get('layout', 'NHWC')
  dims = f'{c}x{s}x{s}' if layout == 'NCHW' else f'{s}x{s}x{c}'
  lines = [f'# Model card: {trained.architecture}', '']
  lines += [
      _opening(trained, manifest), '',
      '## Model', '', '| | |', '|---|---|',
      _row('architecture', trained.architecture),
      _row('parameters', f'{trained.num_params():,}'),
      _row('classes', trained.num_classes),
      _row('input', f'{dims} float32, {layout}, values in '
           f'{trained.input_range_text}'),
  ]
  if native and native != s:
    lines.append(_row('position embeddings', f'interpolated from {native} '
                      f'px (the checkpoint\'s) to {s} px (--image_size), '
                      'without training at that size'))
  lines.append(_row('pre-processing (eval)',
                    '`' + '|'.join(trained.pp) + '`'))
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
  lines += ['', f'Classes: {shown}' + (
      ' (placeholders: no class names were given, see the warning below)'
      if trained.labels_are_placeholders else ''), '']
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
    if not_known:
      lines += '\n\n'.join(not_known).split('\n')
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
                _row('hardware', _hardware(run)),
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
            _row('gives', _output(trained, manifest)),
            _row('computes in', _computes_in(trained, manifest)),
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
            'here.']
  if manifest['dtype'] != trained.compute_dtype():
    lines.append(f'- The exported graph computes in {manifest["dtype"]}; '
                 f'the model in {trained.compute_dtype()}, so its logits, '
                 'and a few top-1 classes, may differ from the '
                 + ('run\'s evaluation.' if trained.kind == 'workdir' else
                    'JAX model\'s.'))
  if manifest['batch'] == 'dynamic':
    lines.append('- Batches hold at least one image: an empty batch is an '
                 'error (onnxruntime even crashes on one, with SIGFPE).')
  lines += ['']
  if config:
    lines += ['<details><summary>Full training config</summary>', '',
              '```json', json.dumps(config, indent=1, sort_keys=True), '```',
              '', '</details>', '']
  return '\n'.join(lines)
