"""`python -m vit_jax.export`: every format round-trips a smoke-trained
workdir (issue 16).

Each export is checked twice: by `export_model` itself (its logits vs the
JAX model's at batch sizes 1 and 3) and here, independently, with the
target runtime at another batch size (dynamic batch): jax.export,
TensorFlow, onnxruntime, transformers. A format's tests skip only when its
packages (the `export` / `torch` extras) are not installed.
"""

import dataclasses
import json
import os
import time

import jax
import numpy as np
import pytest

from trained_workdir import smoke_workdir
from vit_jax import export, trained as trained_lib
from vit_jax.export import __main__ as cli
from vit_jax.export import hf as hf_format
from vit_jax.export import registry

TOL = 1e-4


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  return trained_lib.load(smoke_workdir(tmp_path_factory))


def _needs(name):
  lacking = registry.missing(export.get(name))
  if lacking:
    pytest.skip(f'--format={name} needs {lacking}: {registry.INSTALL}')


def _ours(trained, images):
  return trained.logits(images, 'float32')


def _images(trained, n, seed=7):
  return np.random.RandomState(seed).uniform(
      -1, 1, (n, *trained.image_shape)).astype(np.float32)


def _stablehlo(out, x):
  with open(os.path.join(out, 'model.jax_exported'), 'rb') as f:
    exp = jax.export.deserialize(bytearray(f.read()))
  return np.asarray(exp.call(x))


def _savedmodel(out, x):
  import tensorflow as tf
  sig = tf.saved_model.load(out).signatures['serving_default']
  result = sig(images=tf.constant(x))
  np.testing.assert_allclose(result['probabilities'].numpy().sum(-1), 1,
                             rtol=1e-5)
  return result['logits'].numpy()


def _onnx(out, x):
  import onnxruntime as ort
  session = ort.InferenceSession(os.path.join(out, 'model.onnx'),
                                 providers=['CPUExecutionProvider'])
  assert [i.name for i in session.get_inputs()] == ['images']
  assert session.get_inputs()[0].shape[0] == 'B'  # Dynamic batch.
  return session.run(['logits'], {'images': x})[0]


def _hf(out, x):
  import torch
  from transformers import ViTForImageClassification
  model = ViTForImageClassification.from_pretrained(out).eval()
  assert model.config.id2label[3] == '3'
  with torch.no_grad():
    return model(pixel_values=torch.from_numpy(
        x.transpose(0, 3, 1, 2).copy())).logits.numpy()


RUNTIMES = {'stablehlo': _stablehlo, 'savedmodel': _savedmodel,
            'onnx': _onnx, 'hf': _hf}


@pytest.fixture(scope='module')
def exports(trained, tmp_path_factory):
  """format -> (directory, manifest), each format exported once."""
  done = {}

  def get(fmt):
    if fmt not in done:
      out = str(tmp_path_factory.mktemp('exports') / fmt)
      done[fmt] = out, export.export_model(trained, fmt, out)
    return done[fmt]
  return get


FAST = ['hf', 'savedmodel', 'stablehlo']


@pytest.mark.parametrize('fmt', FAST + ['onnx'])  # jax2onnx: ~20 s.
def test_format_round_trips_the_workdir(trained, exports, fmt):
  _needs(fmt)
  out, manifest = exports(fmt)
  check = manifest['verification']
  print(f'{fmt}: {manifest["bytes"]} bytes, {manifest["export_seconds"]} s, '
        f'{check["summary"]}')
  assert [c['batch'] for c in check['checks']] == [1, 3]
  assert check['max_abs_diff'] <= TOL
  x = _images(trained, 5)
  diff = np.abs(RUNTIMES[fmt](out, x) - trained.logits(x)).max()
  print(f'{fmt}: independent check on 5 images: max |diff| {diff:.3g}')
  assert diff <= TOL
  for name in manifest['files']:
    assert os.path.exists(os.path.join(out, name.rstrip('/'))), name
  assert open(os.path.join(out, 'labels.txt')).read().split() == [
      str(i) for i in range(10)]


def test_model_card_describes_the_run(trained, exports):
  out, _ = exports('stablehlo')
  text = open(os.path.join(out, 'MODEL_CARD.md')).read()
  run = trained.run
  for needle in ('ViT-test', f'{trained.num_params():,}', 'digits',
                 f'| steps | {run["steps"]} |', 'eval_accuracy',
                 f'{run["eval_accuracy"]:.4g}', 'core-days',
                 'training exaFLOPs', trained.command,
                 r'decode\|resize(16)\|value_range(-1,1)', 'stablehlo',
                 'max \\|logit difference\\|'):
    assert needle in text, needle
  manifest = json.load(open(os.path.join(out, 'export.json')))
  assert manifest['batch'] == 'dynamic' and manifest['num_classes'] == 10
  assert manifest['pre_processing'] == 'decode|resize(16)|value_range(-1,1)'


def test_fixed_batch(trained, tmp_path):
  out = str(tmp_path / 'fixed')
  manifest = export.export_model(trained, 'stablehlo', out,
                                 export.Options(batch=2))
  assert manifest['batch'] == 2
  assert manifest['input'] == 'float32 [2, 16, 16, 3] NHWC in [-1, 1]'
  assert _stablehlo(out, _images(trained, 2)).shape == (2, 10)
  with pytest.raises(Exception, match='shape'):
    _stablehlo(out, _images(trained, 3))


@pytest.mark.slow
def test_savedmodel_with_preprocessing_takes_jpeg_bytes(trained, tmp_path):
  import tensorflow as tf
  _needs('savedmodel')
  out = str(tmp_path / 'sm')
  manifest = export.export_model(trained, 'savedmodel', out,
                                 export.Options(with_preprocessing=True))
  checks = manifest['verification']['checks']
  assert checks[-1]['inputs'] == 'encoded JPEGs', checks
  loaded = tf.saved_model.load(out)
  assert set(loaded.signatures) == {'serving_default', 'serving_images'}
  png = tf.io.encode_png(np.full((40, 30, 1), 200, np.uint8)).numpy()
  got = loaded.signatures['serving_default'](
      encoded_images=tf.constant([png]))['logits'].numpy()
  pp = trained.preprocess()({'image': tf.constant(png)})['image'].numpy()
  np.testing.assert_allclose(got, _ours(trained, pp[None]), atol=TOL)


def test_hf_export_loads_back_with_labels(trained, tmp_path, capsys):
  _needs('hf')
  names = tmp_path / 'names.txt'
  names.write_text('\n'.join(f'digit {i}' for i in range(10)))
  out = str(tmp_path / 'hf')
  relabelled = trained_lib.load(trained.workdir, labels=str(names))
  export.export_model(relabelled, 'hf', out)
  back = trained_lib.load(out)
  assert back.kind == 'hf' and back.name == 'ViT-test'
  for name in os.listdir(out):  # safetensors writes 0600 files.
    assert oct(os.stat(os.path.join(out, name)).st_mode & 0o777) == oct(
        0o666 & ~_umask()), name
  assert back.labels[4] == 'digit 4'
  x = _images(trained, 2)
  np.testing.assert_allclose(_ours(back, x), _ours(trained, x), atol=TOL)


def test_hf_processor_takes_any_photo_and_one_channel_models_load_back(
    trained, exports, tmp_path):
  _needs('hf')
  from PIL import Image
  from transformers import ViTImageProcessor
  out, _ = exports('hf')
  processor = ViTImageProcessor.from_pretrained(out)
  photo = Image.fromarray(np.random.RandomState(0).randint(
      0, 255, (40, 30, 3), np.uint8))
  for mode in ('L', 'RGBA', 'CMYK', 'RGB'):
    pixels = processor(photo.convert(mode), return_tensors='np')
    assert pixels['pixel_values'].shape == (1, 3, 16, 16), mode
  # A grey model (decode(1)): its channels survive the round trip.
  params = jax.tree.map(lambda a: a, trained.params)
  kernel = params['embedding']['kernel']
  params['embedding'] = {**params['embedding'],
                         'kernel': kernel.sum(2, keepdims=True)}
  grey = dataclasses.replace(
      trained, channels=1, params=params,
      pp=['decode(1)', 'resize(16)', 'value_range(-1,1)'],
      pp_spec='decode(1)|resize(16)|value_range(-1,1)')
  export.export_model(grey, 'hf', str(tmp_path / 'grey'))
  back = trained_lib.load(str(tmp_path / 'grey'))
  assert back.channels == 1 and back.pp[0] == 'decode(1)'
  x = _images(grey, 2)
  np.testing.assert_allclose(_ours(back, x), _ours(grey, x), atol=TOL)
  processor = ViTImageProcessor.from_pretrained(str(tmp_path / 'grey'))
  assert processor(photo.convert('L'), return_tensors='np')[
      'pixel_values'].shape == (1, 1, 16, 16)


def test_formats_refuse_models_they_cannot_express(trained, tmp_path):
  for name, reason in (('BiT-R50x1', 'ResNet'), ('R50+ViT-B/16', 'hybrid')):
    other = dataclasses.replace(trained, name=name, options={})
    assert reason in hf_format.not_expressible(other)
    with pytest.raises(ValueError, match=f'cannot express.*{reason}.*'
                       'onnx, savedmodel or stablehlo'):
      hf_format.export(other, str(tmp_path), registry.Options())
    out = tmp_path / 'onnx'
    with pytest.raises(ValueError, match='onnx cannot export this model: .*'
                       'weight-standardised.*savedmodel or stablehlo'):
      export.export_model(other, 'onnx', str(out))
    assert not out.exists()  # Refused before anything is written.
  gap = dataclasses.replace(trained, options={'classifier': 'gap'})
  assert 'class token' in hf_format.not_expressible(gap)


def test_a_mixer_exports_to_onnx_and_stablehlo(tmp_path):
  """MLP-Mixer (no attention, no standardised convolutions): ONNX and
  StableHLO verify against JAX; Hugging Face has no class for it."""
  _needs('onnx')
  import jax.numpy as jnp
  from vit_jax import models
  options = dict(hidden_dim=32, num_blocks=2, tokens_mlp_dim=16,
                 channels_mlp_dim=64)
  model = models.create('Mixer-S/16', num_classes=10, **options)
  params = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))['params']
  params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(
      jax.random.key(1), p.shape), params)  # A non-zero head.
  mixer = trained_lib._build('Mixer-S/16', options, 10, 32,
                             'decode|resize(32)|value_range(-1,1)', params,
                             'test', 'npz')
  for fmt in ('onnx', 'stablehlo'):
    manifest = export.export_model(mixer, fmt, str(tmp_path / fmt))
    assert manifest['verification']['max_abs_diff'] <= TOL, fmt
  assert 'Mixer model' in hf_format.not_expressible(mixer)


@pytest.mark.slow
@pytest.mark.parametrize('name', ['BiT-R50x1', 'R50+ViT-B/16'])
def test_resnet_families_export_to_savedmodel_and_stablehlo(name, tmp_path):
  from conftest import perturb
  from vit_jax import models
  over, size = models.family(name).shrink(models.options(name))
  model = models.create(name, num_classes=5, **over)
  params = perturb(jax.device_get(model.init(
      jax.random.key(0), np.zeros((1, size, size, 3), np.float32))['params']))
  small = trained_lib._build(name, over, 5, size, 'resize', params, 'test',
                             'npz')
  small.labels = [f'c{i}' for i in range(5)]
  for fmt in ('savedmodel', 'stablehlo'):
    manifest = export.export_model(small, fmt, str(tmp_path / fmt))
    assert manifest['verification']['max_abs_diff'] <= TOL


def test_a_bfloat16_export_computes_in_bfloat16(trained, tmp_path):
  out = str(tmp_path / 'bf16')
  manifest = export.export_model(trained, 'stablehlo', out,
                                 registry.Options(dtype='bfloat16'))
  assert manifest['dtype'] == 'bfloat16'
  assert manifest['verification']['max_abs_diff'] <= 5e-2
  x = _images(trained, 2)
  got = _stablehlo(out, x)
  np.testing.assert_allclose(got, _ours(trained, x), atol=5e-2)
  assert np.abs(got - _ours(trained, x)).max() > 0  # Not float32's numbers.


def _npz_format(trained, name, offset=lambda: 0.0):
  """A format registered from outside: the params as an .npz file; its
  runtime adds `offset()` to the logits (non-zero: a wrong export)."""
  from vit_jax.checkpoint import load_npz, save_npz

  def write(t, out, options):
    save_npz(t.params, os.path.join(out, 'params.npz'))
    return {'files': ['params.npz']}

  def run(out, images):
    loaded = dataclasses.replace(
        trained, params=load_npz(os.path.join(out, 'params.npz')))
    return loaded.logits(images) + offset()

  return export.register(export.Format(name=name, export=write, run=run))


def test_a_format_registered_from_outside(trained, tmp_path):
  fmt = _npz_format(trained, 'npz-test')
  try:
    manifest = export.export_model(trained, 'npz-test', str(tmp_path / 'n'))
    assert manifest['verification']['max_abs_diff'] <= TOL
    assert 'npz-test' in export.names()
  finally:
    registry.FORMATS.pop(fmt.name)


def test_a_failed_overwrite_keeps_the_earlier_export(trained, tmp_path):
  """--overwrite replaces an export only once the new one is verified."""
  broken = []
  fmt = _npz_format(trained, 'npz-overwrite',
                    lambda: 1.0 if broken else 0.0)
  out = tmp_path / 'n'
  try:
    export.export_model(trained, fmt.name, str(out))
    before = {p: (out / p).read_bytes() for p in os.listdir(out)}
    broken.append(True)
    with pytest.raises(export.ExportError, match='is wrong'):
      export.export_model(trained, fmt.name, str(out), overwrite=True)
    assert {p: (out / p).read_bytes() for p in os.listdir(out)} == before
    assert os.listdir(tmp_path) == ['n']  # No staging folder left behind.
    broken.clear()
    export.export_model(trained, fmt.name, str(out), overwrite=True)
    assert sorted(os.listdir(out)) == sorted(before)
    assert os.listdir(tmp_path) == ['n']
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o777 & ~_umask())
    assert oct(os.stat(out / 'params.npz').st_mode & 0o777) == oct(
        0o666 & ~_umask())  # save_npz's file, not mkstemp's 0600.
    broken.append(True)
    # A failed export to a new or an empty folder leaves it as it was.
    with pytest.raises(export.ExportError, match='is wrong'):
      export.export_model(trained, fmt.name, str(tmp_path / 'new'))
    (tmp_path / 'empty').mkdir()
    with pytest.raises(export.ExportError, match='is wrong'):
      export.export_model(trained, fmt.name, str(tmp_path / 'empty'))
    assert sorted(os.listdir(tmp_path)) == ['empty', 'n']
    assert not os.listdir(tmp_path / 'empty')
  finally:
    registry.FORMATS.pop(fmt.name)


def test_a_new_out_appears_only_once_verified(trained, tmp_path):
  """A new --out (TF Serving's next version folder) is written beside it
  and moved there once verified: a server watching the parent never sees a
  half-written or wrong export."""
  seen = []
  fmt = _npz_format(trained, 'npz-staged',
                    lambda: seen.append(os.path.exists(out)) or 0.0)
  out = tmp_path / 'models' / '2'
  try:
    export.export_model(trained, fmt.name, str(out))
    assert seen and not any(seen)  # Absent while it was verified.
    assert sorted(os.listdir(out)) == sorted(
        ['params.npz', 'export.json', 'labels.txt', 'MODEL_CARD.md'])
    assert os.listdir(tmp_path / 'models') == ['2']
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o777 & ~_umask())
  finally:
    registry.FORMATS.pop(fmt.name)


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def test_command_line(trained, tmp_path, capsys):
  out = str(tmp_path / 'cli')
  args = [f'--init={trained.workdir}', '--format=stablehlo', f'--out={out}']
  assert cli.main(args) == 0
  printed = capsys.readouterr().out
  assert 'verified: max |logit difference|' in printed and 'MB in' in printed
  assert cli.main(args) == 1  # Not empty: no silent overwrite.
  assert 'not empty' in capsys.readouterr().err
  for bad, message in (
      (['--format=tflite'], "unknown export format 'tflite'"),
      (['--format=onnx', '--with-preprocessing'], 'no JPEG / PNG decoder'),
      (['--batch=0', '--format=onnx'], 'a positive integer'),
      (['--format=hf', f'--init={tmp_path}/none'], 'does not exist'),
      (['--format=stablehlo', '--dtype=float16'], 'Export --dtype=bfloat16'),
      (['--format=hf', '--dtype=bfloat16'], 'torch_dtype=torch.bfloat16'),
      (['--format=onnx', '--dtype=bfloat16'], 'no bfloat16 Conv'),
      (['--format=stablehlo', '--image_size=0'], 'a positive integer')):
    argv = [f'--init={trained.workdir}', f'--out={tmp_path}/x'] + bad
    try:
      assert cli.main(argv) == 1, bad
    except SystemExit as e:  # argparse's own errors.
      assert e.code == 2, bad
    assert message in capsys.readouterr().err, bad


@pytest.mark.slow
def test_fixed_batch_savedmodel_converts_to_tflite(trained, tmp_path):
  import tensorflow as tf
  out = str(tmp_path / 'sm1')
  export.export_model(trained, 'savedmodel', out, export.Options(batch=1))
  tflite = tf.lite.TFLiteConverter.from_saved_model(out).convert()
  runner = tf.lite.Interpreter(model_content=tflite).get_signature_runner()
  x = _images(trained, 1)
  np.testing.assert_allclose(runner(images=x)['logits'], _ours(trained, x),
                             atol=TOL)


# --- Review fixes: permissions, provenance, overwrite, layouts, errors. -----


def _ema_workdir(tmp_path_factory) -> str:
  """4 steps with Polyak averages, evaluated on the raw parameters
  (eval_ema=raw); checkpoints at steps 2 and 4."""
  from trained_workdir import once

  def make(workdir):
    from vit_jax.configs import smoke
    from vit_jax.train import loop
    c = smoke.get_config('data=digits,steps=4,batch=32')
    c.optim.update(dict(decay='constant', warmup_steps=0, ema_decay=0.9))
    c.eval_ema = 'raw'
    c.log_every = 4
    c.checkpoint_every = 2
    c.keep_checkpoints = 3
    c.async_checkpoints = False
    c.input.eval_batch_size = 120
    assert loop.train_and_evaluate(c, workdir)['steps'] == 4
  return once(tmp_path_factory, 'export_ema_run', make)


def _modes(out):
  """{relative path: mode} of `out`'s folders (ending in /) and files."""
  found = {}
  for folder, dirs, files in os.walk(out):
    rel = os.path.relpath(folder, out)
    for d in dirs:
      found[os.path.normpath(os.path.join(rel, d)) + '/'] = os.stat(
          os.path.join(folder, d)).st_mode & 0o777
    for f in files:
      found[os.path.normpath(os.path.join(rel, f))] = os.stat(
          os.path.join(folder, f)).st_mode & 0o777
  return found


def test_a_savedmodel_export_is_readable_by_everyone(exports):
  """variables/ is a folder: 0755 (umask 022), not a file's 0644."""
  _needs('savedmodel')
  out, manifest = exports('savedmodel')
  modes = _modes(out)
  assert 'variables/' in modes and 'variables/variables.index' in modes
  for rel, mode in modes.items():
    want = (0o777 if rel.endswith('/') else 0o666) & ~_umask()
    assert oct(mode) == oct(want), rel
  # Every file and folder TF wrote is listed (fingerprint.pb, assets/).
  listed = {f.rstrip('/') for f in manifest['files']}
  assert set(os.listdir(out)) == listed


def test_savedmodel_overwrite_replaces_what_tf_wrote(trained, exports,
                                                     tmp_path):
  """Also an export of a version whose manifest did not list
  fingerprint.pb and assets/."""
  import shutil
  _needs('savedmodel')
  out = str(tmp_path / 'sm')
  shutil.copytree(exports('savedmodel')[0], out)
  path = os.path.join(out, 'export.json')
  manifest = json.load(open(path))
  manifest['files'] = ['saved_model.pb', 'variables/', 'labels.txt',
                       'export.json', 'MODEL_CARD.md']
  json.dump(manifest, open(path, 'w'))
  export.export_model(trained, 'savedmodel', out, overwrite=True)
  assert os.path.exists(os.path.join(out, 'saved_model.pb'))


def test_overwrite_refuses_a_folder_with_files_of_the_user(trained,
                                                           tmp_path):
  out = tmp_path / 'sh'
  export.export_model(trained, 'stablehlo', str(out))
  (out / 'NOTES.md').write_text('mine')
  (out / 'client').mkdir()
  (out / 'client' / 'app.py').write_text('mine too')
  with pytest.raises(export.ExportError, match=r'2 file\(s\).*not in its '
                     r'export.json.*NOTES.md.*client/app.py.*nothing else: '
                     'move them out'):
    export.export_model(trained, 'stablehlo', str(out), overwrite=True)
  assert (out / 'NOTES.md').read_text() == 'mine'
  assert (out / 'client' / 'app.py').read_text() == 'mine too'
  assert (out / 'model.jax_exported').exists()
  assert sorted(os.listdir(tmp_path)) == ['sh']  # Nothing staged.
  (out / 'NOTES.md').unlink()
  import shutil
  shutil.rmtree(out / 'client')
  export.export_model(trained, 'stablehlo', str(out), overwrite=True)


def test_hf_input_is_nchw_and_others_nhwc(trained, exports):
  _needs('hf')
  out, manifest = exports('hf')
  assert manifest['layout'] == 'NCHW'
  # Shapes as [B, 3, 16, 16], not a Python list's ['B', 3, 16, 16].
  assert manifest['input'] == (
      'float32 [B, 3, 16, 16] NCHW in [-1, 1], B >= 1')
  card_text = open(os.path.join(out, 'MODEL_CARD.md')).read()
  assert '| input | 3x16x16 float32, NCHW, values in [-1, 1] |' in card_text
  assert ('| takes | float32 [B, 3, 16, 16] NCHW in [-1, 1], B >= 1 |'
          in card_text)
  out, manifest = exports('stablehlo')
  assert manifest['input'] == (
      'float32 [B, 16, 16, 3] NHWC in [-1, 1], B >= 1')
  assert '| input | 16x16x3 float32, NHWC' in open(
      os.path.join(out, 'MODEL_CARD.md')).read()


def test_an_out_path_that_cannot_be_made_is_a_message(trained, tmp_path,
                                                      capsys):
  (tmp_path / 'afile').write_text('in the way')
  out = str(tmp_path / 'afile' / 'sub')
  with pytest.raises(export.ExportError,
                     match=f'--out={out}: cannot create the folder'):
    export.export_model(trained, 'stablehlo', out)
  assert cli.main([f'--init={trained.workdir}', '--format=stablehlo',
                   f'--out={out}']) == 1
  assert f'--out={out}: cannot create' in capsys.readouterr().err


def test_a_bfloat16_stablehlo_export_bakes_bfloat16_weights(
    trained, tmp_path, monkeypatch):
  from vit_jax.export import stablehlo
  f32 = stablehlo._bytes(stablehlo._baked(trained, 'float32')[1])
  bf16 = stablehlo._bytes(stablehlo._baked(trained, 'bfloat16')[1])
  assert bf16 < 0.6 * f32
  # A model over the limit in float32 but not in bfloat16: the advice
  # holds, and the bfloat16 export is made (and verified).
  monkeypatch.setattr(stablehlo, 'MAX_BYTES', (f32 + bf16) // 2)
  with pytest.raises(ValueError, match='--format=savedmodel.*or '
                     '--dtype=bfloat16'):
    export.export_model(trained, 'stablehlo', str(tmp_path / 'f32'))
  manifest = export.export_model(trained, 'stablehlo', str(tmp_path / 'bf'),
                                 registry.Options(dtype='bfloat16'))
  assert manifest['verification']['max_abs_diff'] <= 5e-2
  # Over the limit in bfloat16 too: no advice that cannot help.
  monkeypatch.setattr(stablehlo, 'MAX_BYTES', bf16 // 2)
  with pytest.raises(ValueError, match='savedmodel') as e:
    export.export_model(trained, 'stablehlo', str(tmp_path / 'f32b'))
  assert 'bfloat16' not in str(e.value).split('Use')[-1]


def test_hf_export_of_a_cropping_run_crops_like_its_eval(trained, tmp_path):
  """The `eval` preset (resize_small|central_crop) becomes a
  BitImageProcessor that AutoImageProcessor loads; its pixels are ours up
  to PIL's antialiasing, and the directory loads back with those ops."""
  _needs('hf')
  import io
  import tensorflow as tf
  from PIL import Image
  from transformers import AutoImageProcessor
  from vit_jax.data import preprocess
  cropping = dataclasses.replace(
      trained, pp=preprocess.expand('eval', trained.image_size),
      pp_spec='eval')
  out = str(tmp_path / 'hf')
  manifest = export.export_model(cropping, 'hf', out)
  assert not manifest['warnings']
  assert 'crops the central 16x16' in manifest['details']['processor_note']
  processor = AutoImageProcessor.from_pretrained(out)
  assert type(processor).__name__.startswith('BitImageProcessor')
  # A wide photo: a plain 16x16 resize would squeeze it, the crop does not.
  yy, xx = np.mgrid[0:48, 0:120]
  photo = np.stack([xx * 2, yy * 5, xx + yy], -1).astype(np.uint8)
  hf_pixels = processor(Image.fromarray(photo), return_tensors='np')[
      'pixel_values'][0].transpose(1, 2, 0)
  buf = io.BytesIO()
  Image.fromarray(photo).save(buf, format='PNG')
  ours = cropping.preprocess()({'image': tf.constant(buf.getvalue())})[
      'image'].numpy()
  assert hf_pixels.shape == ours.shape == (16, 16, 3)
  assert np.abs(hf_pixels - ours).mean() < 0.01  # PIL antialiases; a smooth
  # ramp differs little. The squeezed resize is far off:
  squeezed = np.asarray(Image.fromarray(photo).resize((16, 16), 2),
                        np.float32) / 127.5 - 1
  assert np.abs(squeezed - ours).mean() > 0.1
  back = trained_lib.load(out)
  assert back.pp == cropping.pp


def test_a_0_to_1_run_exports_its_range_and_predicts_alike_from_hf(
    trained, tmp_path):
  """A run whose eval ends in value_range(0,1): export.json and the card
  say [0, 1], the processor feeds [0, 1] (mean 0, std 1 after x / 255),
  and predict, reading the directory back, feeds [0, 1] too: the run's
  logits on the same file."""
  _needs('hf')
  from PIL import Image
  from vit_jax import predict
  ops = ['decode', 'resize(16)', 'value_range(0,1)']
  run = dataclasses.replace(trained, pp=ops, pp_spec='|'.join(ops))
  out = str(tmp_path / 'hf')
  manifest = export.export_model(run, 'hf', out)
  assert manifest['input'] == 'float32 [B, 3, 16, 16] NCHW in [0, 1], B >= 1'
  assert not manifest['warnings']
  assert 'values in [0, 1]' in open(os.path.join(out, 'MODEL_CARD.md')).read()
  proc = json.load(open(os.path.join(out, 'preprocessor_config.json')))
  assert proc['image_mean'] == [0.0] * 3 and proc['image_std'] == [1.0] * 3
  back = trained_lib.load(out)
  assert back.pp == ops
  photo = str(tmp_path / 'photo.png')
  Image.fromarray(np.random.RandomState(0).randint(
      0, 256, (20, 30, 3), np.uint8)).save(photo)
  x = predict.image_loader(run)(photo)[None]
  assert 0 <= x.min() and x.max() <= 1
  np.testing.assert_allclose(_ours(back, predict.image_loader(back)(photo)[
      None]), _ours(run, x), atol=TOL)


def test_hf_export_of_another_pipeline_warns_in_the_card(
    trained, tmp_path, capsys, monkeypatch):
  _needs('hf')
  other = dataclasses.replace(  # An area resize: no processor has it.
      trained, pp=['decode', "resize_small(16, method='area')",
                   'central_crop(16)', 'value_range(-1,1)'],
      pp_spec="decode|resize_small(16, method='area')|central_crop(16)|"
      'value_range(-1,1)')
  out = str(tmp_path / 'hf')
  manifest = export.export_model(other, 'hf', out)
  (warning,) = manifest['warnings']
  assert "method='area'" in warning and 'differ' in warning
  text = open(os.path.join(out, 'MODEL_CARD.md')).read()
  assert f'**Warning**: {warning}' in text
  assert text.count(warning) == 1  # Not also as the pre-processing row.
  assert cli.main([f'--init={trained.workdir}', '--format=hf',
                   f'--out={tmp_path}/cli']) == 0  # Resizes: no warning.
  assert 'warning:' not in capsys.readouterr().err
  monkeypatch.setattr(trained_lib, 'load', lambda *a, **k: other)
  assert cli.main([f'--init={trained.workdir}', '--format=hf',
                   f'--out={tmp_path}/cli2']) == 0
  assert f'warning: {warning}' in capsys.readouterr().err
  # A plain-resize run: a note in the card, no warning.
  manifest = export.export_model(trained, 'hf', str(tmp_path / 'plain'))
  assert not manifest['warnings']
  assert '| pre-processing | preprocessor_config.json' in open(
      str(tmp_path / 'plain' / 'MODEL_CARD.md')).read()


@pytest.mark.parametrize('ops,pipeline', [
    (['decode', 'resize(16)', 'value_range(-1,1)'], ('resize', 16)),
    (['decode', 'resize(16, 16)', 'value_range(-1, 1)'], ('resize', 16)),
    (['decode', 'resize_small(20)', 'central_crop(16)', 'value_range()'],
     ('crop', 20, 16)),
    (['decode', 'resize_small(size=20, antialias=True)', 'central_crop(16)',
      'value_range(-1,1)'], ('crop', 20, 16)),
    (['decode', "resize(16, method='nearest')", 'value_range(-1,1)'], None),
    (['decode', 'resize(20)', 'central_crop(16)', 'value_range(-1,1)'], None),
    (['decode', 'resize(16)', 'value_range(0,1)'], ('resize', 16)),
    # Clips pixels above 1: no processor's affine map does.
    (['decode', 'resize(16)', 'value_range(0, 1, in_min=0, in_max=1)'],
     None),
    (['decode(1)', 'resize(16)', 'value_range(-1,1)'], None),  # 3 channels.
])
def test_hf_processor_pipelines(trained, ops, pipeline):
  assert hf_format._pipeline(dataclasses.replace(trained, pp=ops)) == pipeline


def test_a_non_square_model_is_refused_with_what_to_do():
  with pytest.raises(trained_lib.TrainedModelError,
                     match='16x24 images: predict and export take square '
                     'models only.*Fine-tune it at a square size'):
    trained_lib._pp_output(['decode', 'resize(16, 24)', 'value_range(-1,1)'],
                           16)


@pytest.fixture(scope='module')
def ema_workdir(tmp_path_factory):
  return _ema_workdir(tmp_path_factory)


def test_card_of_an_earlier_checkpoint_has_no_results_of_the_last(
    ema_workdir, tmp_path):
  last = trained_lib.load(ema_workdir)
  assert last.step == last.run['steps'] == 4
  earlier = trained_lib.load(os.path.join(ema_workdir, 'checkpoints', '2'))
  assert earlier.step == 2
  out = tmp_path / 'sh'
  manifest = export.export_model(earlier, 'stablehlo', str(out))
  assert manifest['checkpoint_step'] == 2
  text = (out / 'MODEL_CARD.md').read_text()
  assert '| steps | 2 (this checkpoint; summary.json is of step 4) |' in text
  assert 'Not known for this checkpoint (step 2)' in text
  assert f'{last.run["eval_accuracy"]:.4g}' not in text.split(
      '## Compute')[0].split('## Results')[1]
  assert 'examples seen' not in text
  out = tmp_path / 'last'
  export.export_model(last, 'stablehlo', str(out))
  text = (out / 'MODEL_CARD.md').read_text()
  assert '| steps | 4 |' in text and 'eval_accuracy' in text


def test_params_choice_is_stated_next_to_the_results(ema_workdir, tmp_path,
                                                     capsys):
  """The run evaluated its raw parameters (eval_ema=raw): auto exports
  those, which its results describe; --params=ema exports the averages and
  the card says the results are not theirs."""
  out = str(tmp_path / 'auto')
  assert cli.main([f'--init={ema_workdir}', '--format=stablehlo',
                   f'--out={out}']) == 0
  manifest = json.load(open(os.path.join(out, 'export.json')))
  assert manifest['parameters'] == {
      'exported': 'raw', 'evaluated': 'raw', 'eval_ema': 'raw',
      'ema_decay': 0.9, 'matches': True}
  text = open(os.path.join(out, 'MODEL_CARD.md')).read()
  assert "not this export's" not in text
  assert "| weights | raw (not the run's Polyak averages) |" in text
  ema = trained_lib.load(ema_workdir, ema=True)
  raw = trained_lib.load(ema_workdir)
  assert raw.params_kind == 'raw' and ema.params_kind == 'ema'
  x = _images(ema, 2)
  np.testing.assert_allclose(_stablehlo(out, x), raw.logits(x), atol=TOL)
  out = str(tmp_path / 'ema')
  assert cli.main([f'--init={ema_workdir}', '--format=stablehlo',
                   '--params=ema', f'--out={out}']) == 0
  manifest = json.load(open(os.path.join(out, 'export.json')))
  assert manifest['parameters']['exported'] == 'ema'
  assert manifest['parameters']['matches'] is False
  text = open(os.path.join(out, 'MODEL_CARD.md')).read()
  assert '| weights | EMA (Polyak averages, optim.ema_decay=0.9) |' in text
  assert ("**These results are not this export's**: the run evaluated the "
          'raw') in text and '--params=raw' in text
  np.testing.assert_allclose(_stablehlo(out, x), ema.logits(x), atol=TOL)
  assert np.abs(raw.logits(x) - ema.logits(x)).max() > 10 * TOL
  # predict: the same choice, recorded in its JSON.
  from vit_jax import predict
  from PIL import Image
  image = str(tmp_path / 'digit.png')
  Image.fromarray(np.full((8, 8), 128, np.uint8)).save(image)
  for flag, kind in (([], 'raw'), (['--params=ema'], 'ema')):
    report = str(tmp_path / f'{kind}.json')
    assert predict.main([f'--init={ema_workdir}', f'--json={report}',
                         *flag, image]) == 0
    assert json.load(open(report))['params'] == kind


def test_init_from_a_run_takes_the_parameters_its_metrics_describe(
    ema_workdir):
  """--config.init=<run that set eval_ema=raw>: its raw parameters, as
  predict and export take (the averages it did not evaluate otherwise)."""
  import ml_collections
  from vit_jax.train import loop, orbax_state
  params, _, _ = loop._init_weights(
      ml_collections.ConfigDict({'init': ema_workdir}))
  raw = orbax_state.load_params(ema_workdir, ema=False)
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(raw)):
    np.testing.assert_array_equal(x, y)


def test_params_ema_on_a_run_without_averages_is_a_message(trained,
                                                           tmp_path, capsys):
  assert trained.params_kind == 'raw' and not trained.has_ema
  assert cli.main([f'--init={trained.workdir}', '--format=stablehlo',
                   '--params=ema', f'--out={tmp_path}/x']) == 1
  assert 'holds no EMA parameters' in capsys.readouterr().err


def test_a_full_disk_is_a_message_naming_the_file(trained, tmp_path):
  import errno

  def write(t, out, options):
    path = os.path.join(out, 'params.npz')
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

  fmt = export.register(export.Format(name='npz-full', export=write,
                                      run=lambda out, images: None))
  out = tmp_path / 'full'
  try:
    with pytest.raises(export.ExportError, match=(
        f'--out={out} failed at {out}/params.npz: No space left')):
      export.export_model(trained, fmt.name, str(out))
  finally:
    registry.FORMATS.pop(fmt.name)
  assert not out.exists()  # A new --out stays new.


# --- Review fixes: output activation, publishing, cards, dtypes, inputs. ---


@pytest.fixture(scope='module')
def sigmoid_run(tmp_path_factory):
  """The smoke run recorded as trained with loss=sigmoid (i21k's recipe)."""
  import trained_workdir
  return trained_workdir.copy_with_config(
      smoke_workdir(tmp_path_factory), tmp_path_factory.mktemp('sigmoid'),
      loss='sigmoid')


def test_a_sigmoid_run_exports_sigmoid_probabilities(sigmoid_run, tmp_path):
  """loss=sigmoid (multi-label): the SavedModel's probabilities are a
  sigmoid per class, as the run's loss read the logits, and export.json,
  the card and a Hugging Face export say so."""
  import tensorflow as tf
  _needs('savedmodel')
  sigmoid = trained_lib.load(sigmoid_run)
  assert sigmoid.output_activation == 'sigmoid'
  out = str(tmp_path / 'sm')
  manifest = export.export_model(sigmoid, 'savedmodel', out)
  assert manifest['output_activation'] == 'sigmoid'
  assert json.load(open(os.path.join(out, 'export.json')))[
      'output_activation'] == 'sigmoid'
  x = _images(sigmoid, 3)
  result = tf.saved_model.load(out).signatures['serving_default'](
      images=tf.constant(x))
  logits = result['logits'].numpy()
  np.testing.assert_allclose(result['probabilities'].numpy(),
                             1 / (1 + np.exp(-logits)), rtol=1e-5)
  assert not np.allclose(result['probabilities'].numpy().sum(-1), 1)
  text = open(os.path.join(out, 'MODEL_CARD.md')).read()
  assert ('`probabilities` output = sigmoid(logits), each class on its own '
          '(multi-label: they need not sum to 1; the run trained with '
          'loss=sigmoid)') in text
  if not registry.missing(export.get('hf')):  # Read back as multi-label.
    export.export_model(sigmoid, 'hf', str(tmp_path / 'hf'))
    config = json.load(open(tmp_path / 'hf' / 'config.json'))
    assert config['problem_type'] == 'multi_label_classification'
    assert trained_lib.load(str(tmp_path / 'hf')).output_activation == (
        'sigmoid')


def test_softmax_is_the_default_and_can_be_told(trained, exports,
                                                tmp_path):
  out, manifest = exports('stablehlo')
  assert trained.output_activation == 'softmax'
  assert manifest['output_activation'] == 'softmax'
  assert 'probabilities = softmax(logits) over the classes' in open(
      os.path.join(out, 'MODEL_CARD.md')).read()
  from vit_jax.checkpoint import save_npz
  path = str(tmp_path / 'm.npz')
  save_npz(trained.params, path)
  assert trained_lib.load(path, model='ViT-test').output_activation == (
      'softmax')
  assert trained_lib.load(path, model='ViT-test',
                          output_activation='sigmoid').output_activation == (
                              'sigmoid')
  with pytest.raises(trained_lib.TrainedModelError, match='expected one of '
                     'softmax, sigmoid'):
    trained_lib.load(path, model='ViT-test', output_activation='tanh')


def _writing_format(trained, name, during):
  """A format (params as .npz) that calls `during(staging folder)` while it
  writes: what another process does meanwhile."""
  from vit_jax.checkpoint import load_npz, save_npz

  def write(t, out, options):
    during(out)
    save_npz(t.params, os.path.join(out, 'params.npz'))
    return {'files': ['params.npz']}

  def run(out, images):
    return dataclasses.replace(trained, params=load_npz(
        os.path.join(out, 'params.npz'))).logits(images)

  return export.register(export.Format(name=name, export=write, run=run))


def test_an_out_that_appears_during_the_export_is_left_alone(trained,
                                                             tmp_path):
  """--out was new: a folder another program (or export) put there while
  this export ran is not deleted; the verified export is kept beside it."""
  out = tmp_path / 'models' / '1'

  def someone_writes(_):
    out.mkdir()
    (out / 'precious.txt').write_text('theirs')

  fmt = _writing_format(trained, 'npz-appears', someone_writes)
  try:
    with pytest.raises(export.ExportError, match=(
        f'--out={out} appeared while this export ran.*left as it is.*'
        f'verified export is in {out}.unpublished-{os.getpid()}')):
      export.export_model(trained, fmt.name, str(out))
  finally:
    registry.FORMATS.pop(fmt.name)
  assert os.listdir(out) == ['precious.txt']
  assert (out / 'precious.txt').read_text() == 'theirs'
  kept = tmp_path / 'models' / f'1.unpublished-{os.getpid()}'
  assert sorted(os.listdir(kept)) == sorted(
      ['params.npz', 'export.json', 'labels.txt', 'MODEL_CARD.md'])


def test_overwrite_replaces_only_the_earlier_export_it_found(trained,
                                                             tmp_path):
  """--overwrite: if --out no longer holds the earlier export alone when
  the new one is verified (another export replaced it, a user added a
  file), it is left as it is."""
  out = tmp_path / 'n'
  export.export_model(trained, 'stablehlo', str(out))

  def another_export(_):
    manifest = json.loads((out / 'export.json').read_text())
    manifest['export_seconds'] += 1  # Another export's export.json.
    (out / 'export.json').write_text(json.dumps(manifest))

  def a_user_adds(_):
    (out / 'NOTES.md').write_text('mine')

  for during, message in ((another_export, 'holds another export now'),
                          (a_user_adds, r'holds 1 file\(s\) its earlier '
                           'export did not write.*NOTES.md')):
    before = {p: (out / p).read_bytes() for p in os.listdir(out)}
    fmt = _writing_format(trained, 'npz-meanwhile', during)
    try:
      with pytest.raises(export.ExportError, match=f'--out={out} {message}'):
        export.export_model(trained, fmt.name, str(out), overwrite=True)
    finally:
      registry.FORMATS.pop(fmt.name)
    after = {p: (out / p).read_bytes() for p in os.listdir(out)}
    assert 'model.jax_exported' in after  # Not replaced.
    changed = {p for p in after if after[p] != before.get(p)}
    assert changed == ({'export.json'} if during is another_export
                       else {'NOTES.md'})
    kept = tmp_path / f'n.unpublished-{os.getpid()}'
    assert (kept / 'params.npz').exists()
    import shutil
    shutil.rmtree(kept)


def _dead_pid() -> int:
  import subprocess
  import sys
  process = subprocess.Popen([sys.executable, '-c', 'pass'])
  process.wait()
  return process.pid


def test_failures_name_out_and_killed_exports_leave_nothing_for_long(
    trained, tmp_path, caplog):
  """Messages name --out, not the staging folder beside it; the staging
  folders of killed exports to --out are removed by the next export to it,
  and nothing else is."""
  from vit_jax.export import run as run_lib
  host, dead = run_lib._host(), _dead_pid()
  stale = [f'.n.new-{host}-{dead}-abcd_123', '.n.new-k2j4h5g6']  # Legacy.
  kept = [f'.n.new-{host}-{os.getpid()}-running1',  # A running export's.
          '.n.new-otherhost-1-abcdefgh',  # Another machine's: unknown.
          '.n.new-young123',  # An earlier version's, maybe still running.
          '.n.newer', '.m.new-abcdefgh', 'n.new-abcdefgh']  # Not ours.
  for name in stale + kept:
    (tmp_path / name).mkdir()
    (tmp_path / name / 'file').write_text('x')
  two_days_ago = time.time() - 2 * 86400  # An earlier version's, long dead.
  os.utime(tmp_path / '.n.new-k2j4h5g6', (two_days_ago, two_days_ago))
  broken = []
  fmt = _npz_format(trained, 'npz-named', lambda: 1.0 if broken else 0.0)
  out = tmp_path / 'n'
  try:
    broken.append(True)
    with pytest.raises(export.ExportError) as e:
      export.export_model(trained, fmt.name, str(out))
    assert str(e.value).startswith(f'npz-named export to --out={out} is '
                                   'wrong: on 1 images')
    assert '.new-' not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == sorted(kept)
    assert f'left by an export to --out={out} that was killed' in caplog.text
    broken.clear()
    export.export_model(trained, fmt.name, str(out))
  finally:
    registry.FORMATS.pop(fmt.name)
  assert sorted(os.listdir(tmp_path)) == sorted(kept + ['n'])


def test_tolerance_zero_means_exact(trained, tmp_path):
  fmt = _npz_format(trained, 'npz-exact', lambda: 1e-6)
  try:
    with pytest.raises(export.ExportError, match=r'tolerance 0\)'):
      export.export_model(trained, fmt.name, str(tmp_path / 'a'),
                          tolerance=0.0)
  finally:
    registry.FORMATS.pop(fmt.name)
  fmt = _npz_format(trained, 'npz-exact', lambda: 0.0)
  try:
    manifest = export.export_model(trained, fmt.name, str(tmp_path / 'b'),
                                   tolerance=0.0)
  finally:
    registry.FORMATS.pop(fmt.name)
  assert manifest['verification']['tolerance'] == 0


def test_card_at_another_image_size_has_no_results(trained, exports,
                                                   tmp_path):
  """--image_size on a workdir: the run's results were measured at its own
  resolution, so the card of the interpolated model shows none."""
  out = tmp_path / 'at32'
  assert cli.main([f'--init={trained.workdir}', '--format=stablehlo',
                   '--image_size=32', f'--out={out}']) == 0
  manifest = json.loads((out / 'export.json').read_text())
  assert manifest['image_size'] == 32 and manifest['native_image_size'] == 16
  text = (out / 'MODEL_CARD.md').read_text()
  results = text.split('## Results')[1].split('## Compute')[0]
  assert 'Not known at 32 px' in results and 'measured at 16 px' in results
  assert 'eval_accuracy' not in results
  assert ('| position embeddings | interpolated from 16 px (the '
          "checkpoint's) to 32 px") in text
  assert 'no results' in cli._parser().format_help()  # Not '.npz only'.
  # At its own size: results, no note.
  text = open(os.path.join(exports('stablehlo')[0], 'MODEL_CARD.md')).read()
  assert 'eval_accuracy' in text and 'position embeddings' not in text


def test_default_dtype_is_the_runs(trained, tmp_path, monkeypatch, capsys):
  """A bfloat16 run exports a bfloat16 graph by default, as predict and
  its evaluation compute; formats that export float32 only say they
  differ."""
  bf16 = dataclasses.replace(trained, dtype='bfloat16')
  monkeypatch.setattr(trained_lib, 'load', lambda *a, **k: bf16)
  out = tmp_path / 'bf'
  assert cli.main([f'--init={trained.workdir}', '--format=stablehlo',
                   f'--out={out}']) == 0
  manifest = json.loads((out / 'export.json').read_text())
  assert manifest['dtype'] == 'bfloat16' and not manifest['warnings']
  assert manifest['verification']['tolerance'] == 5e-2
  assert ("| computes in | bfloat16, the model's own (as predict computes "
          'and the run evaluated') in (out / 'MODEL_CARD.md').read_text()
  x = _images(trained, 2)
  np.testing.assert_allclose(_stablehlo(str(out), x),
                             bf16.logits(x), atol=1e-6)
  assert export.export_model(trained, 'stablehlo', str(tmp_path / 'f'))[
      'dtype'] == 'float32'  # A float32 run: float32.
  _needs('hf')
  manifest = export.export_model(bf16, 'hf', str(tmp_path / 'hf'))
  assert manifest['dtype'] == 'float32'
  (warning,) = manifest['warnings']
  assert 'computes in float32, the run in bfloat16 (--format=hf exports ' \
      'float32 only)' in warning


def test_savedmodel_input_errors_name_the_expected_input(trained, exports,
                                                         tmp_path):
  """A wrong shape or an empty batch: a message naming the input, not
  pages of MLIR; also with a fixed batch and encoded images."""
  import tensorflow as tf
  _needs('savedmodel')
  out, _ = exports('savedmodel')
  sig = tf.saved_model.load(out).signatures['serving_default']
  expected = (r'serving_default takes float32 images in \[-1, 1\] \(the '
              r'output of the eval pre-processing in export.json\) of shape '
              r'\[B, 16, 16, 3\] \(B >= 1\); got shape\] \[')
  for shape in ((2, 32, 32, 3), (0, 16, 16, 3), (2, 16, 16)):
    with pytest.raises(tf.errors.InvalidArgumentError, match=expected) as e:
      sig(images=tf.zeros(shape))
    assert 'refinement' not in str(e.value) and len(str(e.value)) < 1000
  out = str(tmp_path / 'fixed')
  export.export_model(trained, 'savedmodel', out, export.Options(
      batch=2, with_preprocessing=True))
  loaded = tf.saved_model.load(out)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r'Shape of tensor images \[3,16,16,3\] is not '
                     r'compatible with expected shape \[2,16,16,3\]'):
    loaded.signatures['serving_images'](images=tf.zeros((3, 16, 16, 3)))
  png = tf.io.encode_png(np.zeros((4, 4, 3), np.uint8))
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r'expected shape \[2\]'):
    loaded.signatures['serving_default'](encoded_images=tf.stack([png] * 3))


def test_versions_come_from_the_installed_packages(exports):
  from importlib import metadata
  _needs('onnx')
  _, manifest = exports('onnx')
  versions = manifest['versions']
  assert versions['jax2onnx'] == metadata.version('jax2onnx')  # No
  assert versions['vit_jax'] == metadata.version('vit_jax')  # __version__.
  assert versions['onnxruntime'] == metadata.version('onnxruntime')


def test_card_of_an_npz_says_where_it_came_from_and_warns_of_placeholders(
    trained, tmp_path, capsys):
  from vit_jax.checkpoint import save_npz
  path = str(tmp_path / 'm.npz')
  save_npz(trained.params, path)
  out = tmp_path / 'npz'
  assert cli.main([f'--init={path}', '--model=ViT-test', '--format=stablehlo',
                   f'--out={out}']) == 0
  err = capsys.readouterr().err
  assert ('warning: no class names: labels.txt holds placeholders (class_0 '
          '... class_9). Export with --labels=DATASET') in err
  text = (out / 'MODEL_CARD.md').read_text()
  assert text.split('\n')[2].startswith(
      f'A ViT image classifier loaded from the .npz checkpoint `{path}`, '
      'exported by vit_jax as **stablehlo**')
  assert 'trained with vit_jax' not in text
  assert '**Warning**: no class names' in text
  assert 'class_9 (placeholders' in text
  assert ('- Batches hold at least one image: an empty batch is an error '
          '(onnxruntime even crashes on one, with SIGFPE).') in text
  # With names: no warning.
  assert cli.main([f'--init={path}', '--model=ViT-test', '--labels=digits',
                   '--format=stablehlo', f'--out={tmp_path}/named']) == 0
  assert 'warning' not in capsys.readouterr().err


# --- Review fixes: portable CPU form, empty --out, Options.batch, CLI. ---


def test_a_bfloat16_export_is_the_same_program_on_every_host(
    trained, tmp_path, monkeypatch):
  """A bf16 export's CPU program takes the CPU matmul form 'bf16' whatever
  the exporting host's: forced by VIT_JAX_CPU_MATMUL, or what 'auto' picks
  on a CPU without bf16 dot instructions ('f32': its products used to be
  upcast, other logits and top-1 classes than another host's export of
  the same checkpoint). The programs are byte-identical, and export.json
  says which form they carry; the host's form is never even decided."""
  from vit_jax.models import matmul
  hosts = {'forced bf16': ('bf16', {'avx512_bf16'}),
           'forced f32': ('f32', {'avx512_bf16'}),
           'auto, no bf16 instructions': ('auto', set())}
  programs, decided, manifests = {}, {}, {}
  try:
    for host, (setting, flags) in hosts.items():
      monkeypatch.setenv(matmul.ENV, setting)
      monkeypatch.setattr(matmul, 'cpu_bf16_flags', lambda f=flags: f)
      matmul.reset_cpu_form()
      out = tmp_path / setting
      manifests[host] = export.export_model(
          trained, 'stablehlo', str(out), registry.Options(dtype='bfloat16'))
      programs[host] = ((out / 'model.jax_exported').read_bytes(),
                        (out / 'model.mlir').read_text())
      decided[host] = matmul._chosen.get('form')
  finally:
    matmul.reset_cpu_form()
  first = programs['forced bf16']
  for host, program in programs.items():
    assert program[1] == first[1], f'{host}: another CPU program'
    assert program[0] == first[0], host
  assert not any(decided.values()), decided  # Not this host's choice.
  assert {m['cpu_matmul_form'] for m in manifests.values()} == {'bf16'}
  float32 = export.export_model(trained, 'stablehlo',
                                str(tmp_path / 'float32'))
  assert float32['cpu_matmul_form'] is None  # No bf16 products.


def test_an_empty_out_is_replaced_only_once_verified(trained, tmp_path,
                                                     monkeypatch):
  """An existing empty --out (TF Serving's next version folder, made in
  advance) is staged beside as a new one is: while the export is verified
  it is still empty, so a server watching it never loads an unverified
  export (it used to hold a complete saved_model.pb then, deleted only
  after a failed verification). The verified export replaces the folder,
  keeping its permissions."""
  from vit_jax.export import run
  models = tmp_path / 'models'
  out = models / '2'
  out.mkdir(parents=True)
  out.chmod(0o750)
  seen = []
  verify = run.verify

  def spy(fmt, trained, folder, *args, **kwargs):
    seen.append(sorted(os.listdir(out)))
    if len(seen) == 1:
      raise export.ExportError('simulated verification failure')
    return verify(fmt, trained, folder, *args, **kwargs)

  monkeypatch.setattr(run, 'verify', spy)
  with pytest.raises(export.ExportError, match='simulated'):
    export.export_model(trained, 'stablehlo', str(out))
  assert seen == [[]], 'the unverified export was in --out'
  assert os.listdir(models) == ['2'] and not os.listdir(out)
  export.export_model(trained, 'stablehlo', str(out))
  assert seen == [[], []]
  assert sorted(os.listdir(out)) == sorted(
      ['model.jax_exported', 'model.mlir', 'export.json', 'labels.txt',
       'MODEL_CARD.md'])
  assert os.listdir(models) == ['2']  # No staging folder left.
  assert oct(os.stat(out).st_mode & 0o777) == oct(0o750)


def test_an_empty_out_written_to_meanwhile_is_left_alone(trained, tmp_path):
  """A file put in the empty --out while the export ran stops it from
  replacing the folder: --out is left as it is, the export kept beside."""
  out = tmp_path / 'models' / '1'
  out.mkdir(parents=True)
  fmt = _writing_format(trained, 'npz-written-to', lambda _: (
      out / 'precious.txt').write_text('theirs'))
  try:
    with pytest.raises(export.ExportError, match=(
        f'--out={out} was written to while this export ran.*left as it is')):
      export.export_model(trained, fmt.name, str(out))
  finally:
    registry.FORMATS.pop(fmt.name)
  assert os.listdir(out) == ['precious.txt']


def test_an_empty_mount_point_is_written_into_directly(trained, tmp_path,
                                                       monkeypatch, caplog):
  """A folder cannot replace a mount point: an empty --out that is one is
  exported into directly (as before), and a log line says what that
  means; a failed export leaves it empty."""
  from vit_jax.export import run
  mounts = {str(tmp_path / 'mnt'), str(tmp_path / 'mnt2')}
  for mount in mounts:
    os.mkdir(mount)
  ismount = os.path.ismount
  monkeypatch.setattr(os.path, 'ismount',
                      lambda p: os.fspath(p) in mounts or ismount(p))
  out = tmp_path / 'mnt'
  seen = []
  fmt = _npz_format(trained, 'npz-mount',
                    lambda: seen.append(os.listdir(out)) or 0.0)

  def fails(*args, **kwargs):
    raise export.ExportError('simulated verification failure')

  try:
    export.export_model(trained, fmt.name, str(out))
    assert seen and 'params.npz' in seen[0]  # Written in place.
    assert f'--out={out} is a mount point' in caplog.text
    monkeypatch.setattr(run, 'verify', fails)
    with pytest.raises(export.ExportError, match='simulated'):
      export.export_model(trained, fmt.name, str(tmp_path / 'mnt2'))
  finally:
    registry.FORMATS.pop(fmt.name)
  assert not os.listdir(tmp_path / 'mnt2')
  assert sorted(os.listdir(tmp_path)) == ['mnt', 'mnt2']


def test_an_empty_out_that_cannot_be_replaced_gets_the_files(
    trained, tmp_path, monkeypatch, caplog):
  """An empty --out the verified export cannot be moved onto (a bind
  mount that `os.path.ismount` does not see: EBUSY) gets the verified
  files copied in, with a log line saying so; nothing is left beside it."""
  import errno
  out = tmp_path / 'bind'
  out.mkdir()
  rename = os.rename

  def busy(src, dst, *args, **kwargs):
    if os.fspath(dst) == str(out):
      raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(dst))
    return rename(src, dst, *args, **kwargs)

  monkeypatch.setattr(os, 'rename', busy)
  fmt = _npz_format(trained, 'npz-bind')
  try:
    export.export_model(trained, fmt.name, str(out))
  finally:
    registry.FORMATS.pop(fmt.name)
  assert sorted(os.listdir(out)) == sorted(
      ['params.npz', 'export.json', 'labels.txt', 'MODEL_CARD.md'])
  assert os.listdir(tmp_path) == ['bind']
  assert f'--out={out} could not be replaced' in caplog.text
  assert oct(os.stat(out / 'params.npz').st_mode & 0o777) == oct(
      0o666 & ~_umask())


@pytest.mark.parametrize('batch', [0, -2, 2.0, '3', True])
def test_options_refuse_a_batch_no_export_can_take(batch):
  """`Options.batch` from Python: a size no export takes is a ValueError
  naming it and what is allowed (it was a ZeroDivisionError, a reshape's
  TypeError or a runtime's error inside a format)."""
  with pytest.raises(ValueError, match=(
      rf'Options\(batch={batch!r}\): expected None \(a dynamic batch size\) '
      r'or an integer >= 1')):
    registry.Options(batch=batch)


def test_options_take_a_dynamic_or_positive_batch():
  assert registry.Options().batch is None
  assert registry.Options(batch=1).batch == 1
  fixed = registry.Options(batch=np.int64(4))
  assert fixed.batch == 4 and type(fixed.batch) is int  # noqa: E721


def test_command_line_refuses_an_out_before_loading_the_checkpoint(
    trained, tmp_path, monkeypatch, capsys):
  """A refused --out is said before the checkpoint is loaded (minutes for
  a large one), by the check `export_model` runs too."""
  def load(*args, **kwargs):
    raise AssertionError('the checkpoint was loaded first')

  monkeypatch.setattr(trained_lib, 'load', load)
  full = tmp_path / 'full'
  full.mkdir()
  (full / 'notes.txt').write_text('mine')
  (tmp_path / 'afile').write_text('in the way')
  # The shell's folder, or one above it, would be replaced by a rename.
  (tmp_path / 'here' / 'sub').mkdir(parents=True)
  monkeypatch.chdir(tmp_path / 'here' / 'sub')
  for out, more, message in (
      ('.', [], '--out=. is the current folder'),
      ('..', ['--overwrite'], 'a folder above the current one'),
      (full, [], f'{full} exists and is not empty'),
      (full, ['--overwrite'], f'{full} is not an earlier export'),
      (tmp_path / 'afile', [], 'is a file'),
      (tmp_path / 'afile' / 'sub', [], 'cannot create the folder')):
    assert cli.main([f'--init={trained.workdir}', '--format=stablehlo',
                     f'--out={out}'] + more) == 1, out
    assert message in capsys.readouterr().err, out
  assert os.listdir(full) == ['notes.txt']
  assert os.listdir(tmp_path / 'here') == ['sub']
