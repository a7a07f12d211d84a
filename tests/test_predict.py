"""`python -m vit_jax.predict` and `vit_jax.trained.load` (issue 16).

A smoke-trained workdir (tests/trained_workdir.py) classifies PNG / JPEG
files pre-processed like its evaluation; bad files are reported and
skipped; class names come from the dataset, tfds info or a file.
"""

import io
import json
import os
import shutil
import sys

import numpy as np
import pytest

import trained_workdir
from trained_workdir import smoke_workdir
from vit_jax import predict, trained as trained_lib


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  return smoke_workdir(tmp_path_factory)


@pytest.fixture(scope='module')
def trained(workdir):
  return trained_lib.load(workdir)


@pytest.fixture(scope='module')
def images(tmp_path_factory):
  """Real digits as PNG (grey) and JPEG (colour), one corrupt file, one
  empty file, in a folder with a sub-folder."""
  from PIL import Image
  from sklearn.datasets import load_digits
  folder = tmp_path_factory.mktemp('images')
  (folder / 'more').mkdir()
  digits = load_digits()
  for i in range(1790, 1796):
    pixels = (digits.images[i] * 255 / 16).astype(np.uint8)
    Image.fromarray(pixels).resize((24, 24)).save(
        folder / f'{i}_digit{digits.target[i]}.png')
  pixels = (digits.images[1796] * 255 / 16).astype(np.uint8)
  Image.fromarray(np.stack([pixels] * 3, -1)).save(folder / 'more' / 'c.jpg')
  (folder / 'broken.jpg').write_bytes(b'\xff\xd8 not really a JPEG')
  (folder / 'empty.png').write_bytes(b'')
  (folder / 'notes.txt').write_text('not an image: ignored in folders')
  return folder


def test_workdir_loads_as_it_was_evaluated(trained, workdir):
  assert trained.kind == 'workdir' and trained.name == 'ViT-test'
  assert trained.pp == ['decode', 'resize(16)', 'value_range(-1,1)']
  assert trained.image_shape == (16, 16, 3) and trained.num_classes == 10
  assert trained.labels == [str(i) for i in range(10)]  # digits' names.
  assert trained.command.startswith('python')  # This process's argv.
  assert trained.run['steps'] == trained.config['total_steps']


def test_folder_with_corrupt_files_reports_them_and_classifies_the_rest(
    trained, images, tmp_path, capsys):
  out = tmp_path / 'new' / 'out.json'  # Its folder is made before the run.
  code = predict.main([f'--init={trained.workdir}', '--top=3', '--batch=4',
                       f'--json={out}', str(images)])
  captured = capsys.readouterr()
  assert code == 0, captured.err
  result = json.loads(out.read_text())
  assert result['output_activation'] == 'softmax'  # The run's loss.
  # The checkpoint that classified: its step and folder.
  assert result['step'] == trained.step and trained.step > 0
  assert result['source'] == trained.source
  assert result['source'].endswith(f'checkpoints/{trained.step}')
  files = sorted(os.path.basename(r['file']) for r in result['results'])
  assert files == sorted([f'{i}_digit{t}.png' for i, t in zip(
      range(1790, 1796), (8, 4, 9, 0, 8, 9))] + ['c.jpg'])
  skipped = {os.path.basename(s['file']): s['error']
             for s in result['skipped']}
  assert set(skipped) == {'broken.jpg', 'empty.png'}
  assert 'image' in skipped['broken.jpg'].lower(), skipped
  assert 'broken.jpg' in captured.err and 'empty.png' in captured.err
  assert '7 classified, 2 skipped' in captured.err
  for r in result['results']:
    probs = [t['probability'] for t in r['top']]
    assert len(probs) == 3 and probs == sorted(probs, reverse=True)
    assert all(t['label'] == str(t['index']) for t in r['top'])
  assert captured.out.count(': ') == 7


def test_ctrl_c_keeps_what_was_classified(trained, images, tmp_path,
                                          monkeypatch, capsys):
  real, calls = predict.top_k, []

  def top_k(*args, **kw):  # Ctrl-C while the 4th image's result is made.
    calls.append(1)
    if len(calls) == 4:
      raise KeyboardInterrupt
    return real(*args, **kw)
  monkeypatch.setattr(predict, 'top_k', top_k)
  out = tmp_path / 'out.json'
  code = predict.main([f'--init={trained.workdir}', '--batch=4',
                       f'--json={out}', str(images)])
  assert code == 130
  result = json.loads(out.read_text())
  assert result['interrupted'] and len(result['results']) == 3
  assert 'interrupted after' in capsys.readouterr().err


def test_a_closed_stdout_loses_neither_the_json_nor_the_status(
    trained, images, tmp_path, monkeypatch, capsys):
  """`predict ... --json=out.json photos/ | head -1`: stdout closes after
  one line; the JSON (written first) has every result and the exit status
  is the usual one, not a BrokenPipeError traceback."""

  class ClosedPipe(io.TextIOBase):
    def write(self, text):
      raise BrokenPipeError(32, 'Broken pipe')
  monkeypatch.setattr(sys, 'stdout', ClosedPipe())
  out = tmp_path / 'out.json'
  assert predict.main([f'--init={trained.workdir}', '--batch=4',
                       f'--json={out}', str(images)]) == 0
  assert len(json.loads(out.read_text())['results']) == 7
  assert '7 classified, 2 skipped' in capsys.readouterr().err


def test_a_few_files_compute_a_batch_of_their_count(trained, images):
  """One image computes one (rounded up to the devices), not a padded
  --batch of 64."""
  import jax
  predictor = predict.Predictor(trained, batch=64)
  shapes, fn = [], predictor._fn
  predictor._fn = lambda p, x: (shapes.append(x.shape), fn(p, x))[1]
  files = predict.list_images([str(images)])[:2]
  assert [status for status, _, _ in predictor(files)] == ['ok', 'ok']
  n = jax.local_device_count()
  assert shapes == [(-(-2 // n) * n, *trained.image_shape)]
  assert predictor.batch_for(1000) == predictor.batch >= 64


def test_repeated_predict_calls_reuse_one_predictor_until_new_weights(
    workdir, images, monkeypatch):
  """`predict.predict(trained, paths)` called again on the same model does
  not jit, trace and copy the weights to the devices again; new weights
  (`trained.params = ...`, or a sub-tree replaced in place) are computed
  with, by predict and `logits` alike, in one Predictor per setting."""
  fresh = trained_lib.load(workdir)
  traces, activate = [], fresh.activate
  predictors = lambda: [k for k in fresh._built if k[0] == 'predictor']  # pylint: disable=unnecessary-lambda-assignment,protected-access

  def counting(logits):
    traces.append(1)
    return activate(logits)
  monkeypatch.setattr(fresh, 'activate', counting)
  files = predict.list_images([str(images)])
  first, _ = predict.predict(fresh, files, batch=4)
  made = len(traces)
  second, _ = predict.predict(fresh, files, batch=4)
  assert made and len(traces) == made and first == second
  assert len(predictors()) == 1
  predict.predict(fresh, files, batch=4, dtype='bfloat16')  # Another one.
  assert len(predictors()) == 2
  # Another checkpoint: its head doubled doubles the logits.
  import jax
  load = predict.image_loader(fresh)
  x = np.stack([load(r['file']) for r in first])
  before, params = fresh.logits(x), fresh.params
  fresh.params = {**params, 'head': jax.tree.map(lambda a: a * 2,
                                                 params['head'])}
  np.testing.assert_allclose(fresh.logits(x), 2 * before, atol=1e-5)
  results, _ = predict.predict(fresh, files, batch=4, top=10)
  got = np.zeros_like(before)
  for i, r in enumerate(results):
    for t in r['top']:
      got[i, t['index']] = t['probability']
  np.testing.assert_allclose(got, jax.nn.softmax(2 * before), atol=1e-5)
  assert len(predictors()) == 1  # The old weights' are dropped.
  # A sub-tree replaced in place is found too (its leaves are new).
  fresh.params['head'] = jax.tree.map(np.zeros_like, params['head'])
  np.testing.assert_array_equal(fresh.logits(x), 0 * before)
  assert not predictors()
  # A copy sharing the caches: new weights in it leave the original's.
  import copy
  twin = copy.copy(fresh)
  twin.params = params
  assert np.abs(twin.logits(x) - before).max() < 1e-5
  np.testing.assert_array_equal(fresh.logits(x), 0 * before)


def test_a_file_name_that_is_not_utf8_is_classified(images, trained,
                                                    tmp_path, capsys):
  """A name with bytes that are not UTF-8 (Python's surrogate-escaped str)
  is read and classified, printed with \\xff, kept as is in the JSON."""
  folder = tmp_path / 'photos'
  folder.mkdir()
  name = os.fsdecode(b'bad\xff.png')
  shutil.copy(images / '1790_digit8.png', folder / name)
  out = tmp_path / 'out.json'
  assert predict.main([f'--init={trained.workdir}', f'--json={out}',
                       str(folder)]) == 0
  result = json.loads(out.read_text())
  assert [r['file'] for r in result['results']] == [str(folder / name)]
  assert 'bad\\xff.png: ' in capsys.readouterr().out


def test_image_size_must_be_positive(capsys):
  for bad in ('-16', '0'):
    with pytest.raises(SystemExit) as e:
      predict.main(['--init=nowhere', f'--image_size={bad}', 'x.jpg'])
    assert e.value.code == 2
    assert 'expected a positive integer' in capsys.readouterr().err
    with pytest.raises(trained_lib.TrainedModelError, match='positive'):
      trained_lib.load('nowhere', image_size=int(bad))


def test_python_callers_pass_one_path_or_path_objects(trained, workdir,
                                                      images, monkeypatch):
  """`predict(trained, 'photo.png')` classifies that file (not each
  character of its name), pathlib.Paths are paths, and `load` takes a
  Path and expands `~` (`--init=~/run` reaches it unexpanded)."""
  import pathlib
  one = str(images / 'more' / 'c.jpg')
  assert predict.list_images(one) == [one]
  assert predict.list_images(images) == predict.list_images([str(images)])
  results, skipped = predict.predict(trained, one, top=1)
  assert [r['file'] for r in results] == [one] and not skipped
  results, skipped = predict.predict(trained, [pathlib.Path(one)], top=1)
  assert [r['file'] for r in results] == [one] and not skipped
  monkeypatch.setenv('HOME', os.path.dirname(workdir))
  home = pathlib.Path('~') / os.path.basename(workdir)
  assert trained_lib.load(home).source == trained.source
  assert trained_lib._local_path('hf:~/x') == (
      f'hf:{os.path.dirname(workdir)}/x')


def test_folders_are_listed_through_links_and_urls(images, tmp_path,
                                                   monkeypatch):
  """A symlinked sub-folder is searched (each real folder once: a link to
  a folder above does not loop), a `scheme://` folder is listed with
  GFile, and local folders are listed without TensorFlow."""
  folder = tmp_path / 'photos'
  folder.mkdir()
  (folder / 'digits').symlink_to(images)
  (folder / 'again').symlink_to(images)  # The same folder: listed once.
  (folder / 'loop').symlink_to(folder)
  found = predict.list_images([str(folder)])
  mine = predict.list_images([str(images)])
  assert len(found) == len(mine) == 9, found
  real = os.path.realpath(images)
  assert sorted(os.path.relpath(os.path.realpath(f), real)
                for f in found) == sorted(os.path.relpath(f, images)
                                          for f in mine)
  assert predict.list_images([f'file://{images}']) == [
      f'file://{f}' for f in mine]
  monkeypatch.setitem(sys.modules, 'tensorflow', None)  # Not installed.
  assert predict.list_images([str(folder)]) == found


def test_tensorflow_logging_is_quieted_before_it_is_imported(monkeypatch):
  """TF_CPP_MIN_LOG_LEVEL is read when TensorFlow is imported, which
  `_parser()`'s imports do: it is set before."""
  monkeypatch.setenv('TF_CPP_MIN_LOG_LEVEL', '0')  # Restored afterwards.
  monkeypatch.delenv('TF_CPP_MIN_LOG_LEVEL')
  seen, parser = [], predict._parser

  def spy():
    seen.append(os.environ.get('TF_CPP_MIN_LOG_LEVEL'))
    return parser()
  monkeypatch.setattr(predict, '_parser', spy)
  assert predict.main(['--init=nowhere', 'x.jpg']) == 1
  assert seen == ['2']


def test_predict_equals_the_model_on_the_eval_pipeline(trained, images):
  """Batched, padded, device-sharded predictions = the plain model."""
  import jax
  files = predict.list_images([str(images)])
  results, skipped = predict.predict(trained, files, top=10, batch=3)
  assert len(results) == 7 and len(skipped) == 2
  loader = predict.Predictor(trained, batch=3)
  x = np.stack([loader.load(r['file']) for r in results])
  probs = np.asarray(jax.nn.softmax(
      jax.jit(trained.apply_fn())(trained.params, x)))
  got = np.zeros_like(probs)
  for i, r in enumerate(results):
    for t in r['top']:
      got[i, t['index']] = t['probability']
  np.testing.assert_allclose(got, probs, atol=1e-5)


def test_bfloat16_predictions_cast_the_weights_once(trained, images):
  """In bfloat16 the matmul kernels are served in bfloat16 (cast once, not
  per batch, docs/deploy.md), and the probabilities are the model's."""
  import jax
  import ml_dtypes
  predictor = predict.Predictor(trained, batch=2, dtype='bfloat16')
  kernels = [x for path, x in jax.tree_util.tree_leaves_with_path(
      predictor._params) if 'kernel' in jax.tree_util.keystr(path)]
  assert kernels and all(k.dtype == ml_dtypes.bfloat16 for k in kernels)
  files = predict.list_images([str(images)])[:2]  # Two digits.
  out = [value for status, _, value in predictor(files) if status == 'ok']
  x = np.stack([predictor.load(f) for f in files])
  want = np.asarray(jax.nn.softmax(trained.logits(x, 'bfloat16')))
  np.testing.assert_allclose(np.stack(out), want, atol=1e-6)


def test_labels_from_tfds_info_and_from_a_file(workdir, tmp_path):
  fashion = trained_lib.load(workdir, labels='fashion_mnist')
  assert fashion.labels[:2] == ['T-shirt/top', 'Trouser']
  names = tmp_path / 'names.txt'
  names.write_text('\n'.join(f'digit {i}' for i in range(10)) + '\n')
  assert trained_lib.load(workdir, labels=str(names)).labels[3] == 'digit 3'
  names.write_text('a\nb\n')
  with pytest.raises(trained_lib.TrainedModelError, match='2 names .* 10'):
    trained_lib.load(workdir, labels=str(names))
  with pytest.raises(trained_lib.TrainedModelError, match='no such file'):
    trained_lib.load(workdir, labels=str(tmp_path / 'nmaes.txt'))


def test_labels_of_a_dataset_named_by_its_files_say_how_to_get_them(
    workdir, tmp_path, monkeypatch):
  """cifar10's tfds code names its classes only once its files are
  prepared: the error says so, and how."""
  monkeypatch.setenv('TFDS_DATA_DIR', str(tmp_path / 'empty'))
  with pytest.raises(trained_lib.TrainedModelError,
                     match=r'until it is prepared .*python -m '
                     r'vit_jax\.data\.prepare cifar10\)'):
    trained_lib.load(workdir, labels='cifar10')


def test_class_names_are_the_ones_the_run_recorded(workdir, tmp_path):
  """The run records its class names when it starts (config.json): a
  renamed class folder, or data not on the machine that predicts, does not
  rename the model's classes; a record without them (runs before
  2026-11-29) reads the dataset's."""
  with open(os.path.join(workdir, 'config.json')) as f:
    assert json.load(f)['class_names'] == [str(i) for i in range(10)]
  run = trained_workdir.copy(workdir, tmp_path)
  path = os.path.join(run, 'config.json')
  with open(path) as f:
    recorded = json.load(f)
  recorded['class_names'] = [f'kind {i}' for i in range(10)]
  with open(path, 'w') as f:
    json.dump(recorded, f)
  assert trained_lib.load(run).labels[3] == 'kind 3'
  del recorded['class_names']
  with open(path, 'w') as f:
    json.dump(recorded, f)
  assert trained_lib.load(run).labels[3] == '3'


def test_npz_needs_a_model_name_and_predicts_alike(trained, tmp_path):
  from vit_jax.checkpoint import save_npz
  path = str(tmp_path / 'm.npz')
  save_npz(trained.params, path)
  with pytest.raises(trained_lib.TrainedModelError, match='--model=NAME'):
    trained_lib.load(path)
  npz = trained_lib.load(path, model='ViT-test', labels='digits')
  assert npz.image_size == 16  # From the position embeddings' grid.
  assert npz.pp == ['decode', 'resize(16)', 'value_range(-1,1)']
  x = np.random.RandomState(0).uniform(-1, 1, (2, 16, 16, 3)).astype('f4')
  import jax
  np.testing.assert_allclose(jax.jit(npz.apply_fn())(npz.params, x),
                             jax.jit(trained.apply_fn())(trained.params, x),
                             atol=1e-6)


def test_one_channel_pre_processing_makes_grey_images():
  size, channels = trained_lib._pp_output(
      ['decode(1)', 'resize(8)', 'value_range(-1,1)'], 8)
  assert (size, channels) == (8, 1)


def test_clear_errors(tmp_path, capsys):
  with pytest.raises(trained_lib.TrainedModelError, match='does not exist'):
    trained_lib.load(str(tmp_path / 'nowhere'))
  (tmp_path / 'empty_run').mkdir()
  with pytest.raises(trained_lib.TrainedModelError, match='no trained model'):
    trained_lib.load(str(tmp_path / 'empty_run'))
  assert predict.main([f'--init={tmp_path / "empty_run"}', 'x.jpg']) == 1
  assert 'no trained model' in capsys.readouterr().err


def test_an_init_file_that_is_not_npz_says_what_init_takes(tmp_path,
                                                          capsys):
  """A Hugging Face weights file or an image as --init: exit 1 with what
  --init takes (the weights' folder), not a checkpoint reader traceback."""
  hf = tmp_path / 'hf'
  hf.mkdir()
  (hf / 'model.safetensors').write_bytes(b'not read')
  (tmp_path / 'cat.jpg').write_bytes(b'\xff\xd8 an image')
  assert predict.main([f'--init={hf / "model.safetensors"}', 'x.jpg']) == 1
  err = capsys.readouterr().err
  assert f'pass its folder, --init={hf}' in err and 'Traceback' not in err
  assert predict.main([f'--init={tmp_path / "cat.jpg"}', 'x.jpg']) == 1
  err = capsys.readouterr().err
  assert 'is a file, not a model' in err and 'Hugging Face' in err
  with pytest.raises(trained_lib.TrainedModelError, match='not a model'):
    trained_lib.load(str(tmp_path / 'cat.jpg'))


# Orbax's failed read leaves a callback for its closed event loop.
@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
def test_a_relative_init_loads_and_a_damaged_one_is_a_message(
    workdir, tmp_path, monkeypatch, capsys):
  run = trained_workdir.copy(workdir, tmp_path)
  monkeypatch.chdir(os.path.dirname(run))
  name = os.path.basename(run)
  assert trained_lib.load(name).num_classes == 10  # Not called 'damaged'.
  ckpts = os.path.join(run, 'checkpoints')
  step = max(int(s) for s in os.listdir(ckpts) if s.isdigit())
  for root, _, files in os.walk(os.path.join(ckpts, str(step), 'state')):
    if os.path.basename(root) == 'd':  # The arrays' chunks.
      for f in files:
        with open(os.path.join(root, f), 'r+b') as fh:
          fh.truncate(10)
  assert predict.main([f'--init={name}', 'x.jpg']) == 1
  err = capsys.readouterr().err
  assert 'damaged' in err and 'earlier step' in err and 'Traceback' not in err


def test_weights_load_without_a_cpu_backend(workdir, monkeypatch):
  """JAX_PLATFORMS=tpu (or cuda): no CPU backend to restore onto; the
  weights come onto the first device, not a 'damaged checkpoint' error."""
  import jax
  from vit_jax.train import orbax_state
  devices = jax.local_devices

  def no_cpu(process_index=None, backend=None):
    if backend == 'cpu':
      raise RuntimeError('Unknown backend cpu. Available backends: [tpu]')
    return devices(process_index, backend)

  monkeypatch.setattr(jax, 'local_devices', no_cpu)
  params = orbax_state.load_params(workdir)
  assert 'head' in params


def test_a_newest_step_without_state_falls_back_to_the_complete_one(
    workdir, tmp_path, caplog):
  """A half-copied workdir (rsync / gsutil stopped): its newest step has no
  state/. The trainer would resume from the step before; predict reads that
  one too, and says so, instead of 'no trained model there'."""
  run = trained_workdir.copy(workdir, tmp_path)
  ckpts = os.path.join(run, 'checkpoints')
  step = max(int(s) for s in os.listdir(ckpts) if s.isdigit())
  shutil.copytree(os.path.join(ckpts, str(step)),
                  os.path.join(ckpts, str(step + 5)))
  shutil.rmtree(os.path.join(ckpts, str(step + 5), 'state'))
  loaded = trained_lib.load(run)
  assert loaded.source.endswith(f'checkpoints/{step}')
  assert f'step(s) {step + 5} have no state/' in caplog.text


def test_a_reinitialised_copy_has_fresh_weights_and_its_own_logits(trained):
  """`inspect --random_init`'s baseline: the same model, fresh weights,
  and the original's jitted logits untouched."""
  x = np.zeros((1, *trained.image_shape), np.float32)
  before = trained.logits(x)
  fresh = trained_lib.reinitialised(trained, seed=1)
  assert 'random init, seed 1' in fresh.source
  assert not np.allclose(fresh.params['embedding']['kernel'],
                         trained.params['embedding']['kernel'])
  assert not np.allclose(fresh.logits(x), before)
  np.testing.assert_array_equal(trained.logits(x), before)


def test_a_sigmoid_run_predicts_sigmoid_probabilities(workdir, images,
                                                     tmp_path, capsys):
  """loss=sigmoid (i21k / JFT pre-training, multi-label): probabilities
  are a sigmoid per class, as the run's loss read its logits, not a
  softmax; the JSON and stderr say which."""
  import jax
  run = trained_workdir.copy_with_config(workdir, tmp_path, loss='sigmoid')
  sigmoid = trained_lib.load(run)
  assert sigmoid.output_activation == 'sigmoid'
  out = tmp_path / 'out.json'
  assert predict.main([f'--init={run}', '--top=10', f'--json={out}',
                       str(images)]) == 0
  captured = capsys.readouterr()
  assert 'a sigmoid per class' in captured.err
  result = json.loads(out.read_text())
  assert result['output_activation'] == 'sigmoid'
  loader = predict.Predictor(sigmoid, batch=2)
  for r in result['results']:
    logits = sigmoid.logits(loader.load(r['file'])[None])[0]
    got = np.zeros_like(logits)
    for t in r['top']:
      got[t['index']] = t['probability']
    np.testing.assert_allclose(got, np.asarray(jax.nn.sigmoid(logits)),
                               rtol=1e-5)
  # --output_activation overrides the run's.
  assert predict.main([f'--init={run}', '--output_activation=softmax',
                       f'--json={out}', str(images)]) == 0
  assert json.loads(out.read_text())['output_activation'] == 'softmax'
