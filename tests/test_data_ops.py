"""Every pre-processing op on real photos: shapes, value ranges, determinism."""

import numpy as np
import pytest
import skimage.data
import tensorflow as tf

from vit_jax.data import mixup, ops, preprocess
from vit_jax.data.errors import DataError

PHOTO = skimage.data.astronaut()            # 512 x 512 x 3
WIDE = skimage.data.coffee()                 # 400 x 600 x 3
GRAY = skimage.data.camera()                 # 512 x 512
JPEG = tf.io.encode_jpeg(WIDE, quality=95)
PNG = tf.io.encode_png(PHOTO)
GRAY_PNG = tf.io.encode_png(GRAY[..., None])


def _seed(i=0):
  return tf.constant([i, 7], tf.int64)


def _run(spec, image, seed=None, size=224, label=3):
  out = preprocess.build(spec, size)(
      {'image': image, 'label': tf.constant(label, tf.int64)},
      _seed() if seed is None else seed)
  return {k: v.numpy() for k, v in out.items()}


@pytest.mark.parametrize('data,shape', [
    (JPEG, (400, 600, 3)), (PNG, (512, 512, 3)), (GRAY_PNG, (512, 512, 3))])
def test_decode_gives_uint8_rgb(data, shape):
  image = _run('decode', data)['image']
  assert image.shape == shape and image.dtype == np.uint8
  if data is PNG:
    np.testing.assert_array_equal(image, PHOTO)  # PNG is lossless.


def test_decode_keeps_one_channel_and_passes_decoded_images():
  np.testing.assert_array_equal(_run('decode(1)', GRAY_PNG)['image'][..., 0],
                                GRAY)
  image = _run('decode', tf.constant(GRAY[..., None]))['image']
  assert image.shape == (512, 512, 3)
  np.testing.assert_array_equal(image[..., 2], GRAY)
  np.testing.assert_array_equal(_run('decode|to_rgb', PNG)['image'], PHOTO)


@pytest.mark.parametrize('fmt,mode', [
    ('GIF', 'RGB'), ('BMP', 'RGB'), ('WEBP', 'RGB'), ('JPEG', 'CMYK'),
    ('PNG', 'RGBA'), ('JPEG', 'L')])
def test_every_format_decodes_to_one_or_three_channels(fmt, mode):
  import io
  from PIL import Image
  data = io.BytesIO()
  Image.fromarray(WIDE).convert(mode).save(data, fmt)
  for channels in (1, 3):
    image = _run(f'decode({channels})', tf.constant(data.getvalue()))['image']
    assert image.shape == (400, 600, channels) and image.dtype == np.uint8


@pytest.mark.parametrize('spec', [
    'decode|inception_crop(224)', 'decode|to_rgb|inception_crop(224)',
    'decode|inception_crop|resize(224)'])
def test_inception_crop(spec):
  outs = [_run(spec, JPEG, _seed(i))['image'] for i in range(6)]
  for out in outs:
    assert out.shape == (224, 224, 3) and out.dtype == np.float32
    assert 0 <= out.min() and out.max() <= 255
  np.testing.assert_array_equal(outs[0], _run(spec, JPEG, _seed(0))['image'])
  assert len({o.tobytes() for o in outs}) == 6  # Different crops.


def test_inception_crop_area_range_is_respected():
  shapes = [_run('decode|inception_crop(area_min=0.5, area_max=0.6)', PNG,
                 _seed(i))['image'].shape for i in range(20)]
  areas = [h * w / 512**2 for h, w, _ in shapes]
  # Rounding of the sampled box moves the area by a few pixel rows at most.
  assert all(0.48 <= a <= 0.62 for a in areas), areas
  with pytest.raises(ValueError, match='area_min'):
    preprocess.build('inception_crop(224, area_min=0)', 224)
  # big_vision's percent: named, with the fraction to write.
  with pytest.raises(ValueError, match=r'not percent .*area_min=0\.05 here'):
    preprocess.build('inception_crop(224, area_min=5)', 224)


def test_fused_jpeg_crop_matches_decode_then_crop():
  """Same window; pixels agree up to JPEG chroma upsampling at its edges."""
  fused = preprocess.build('decode|inception_crop(224)', 224)
  assert fused.ops == ['decode_jpeg_and_inception_crop']
  for i in range(5):
    seed = _seed(i)
    a = fused({'image': JPEG}, seed)['image'].numpy()
    sub = tf.random.experimental.stateless_split(seed, 1)[0]
    decoded = ops.make('decode')({'image': JPEG}, None)
    b = ops.make('inception_crop', 224)(decoded, sub)['image'].numpy()
    assert np.abs(a - b).mean() < 0.5, i
  png = fused({'image': PNG}, _seed())['image'].numpy()  # Non-JPEG path.
  assert png.shape == (224, 224, 3)


def test_resize_and_resize_small():
  assert _run('decode|resize(100, 50)', JPEG)['image'].shape == (100, 50, 3)
  out = _run('decode|resize_small(200)', JPEG)['image']
  assert out.shape == (200, 300, 3) and out.dtype == np.float32
  assert 0 <= out.min() and out.max() <= 255
  np.testing.assert_allclose(out.mean(), WIDE.mean(), atol=2)


def test_random_crop_is_a_crop_and_seeded():
  crops = [_run('decode|random_crop(64, 32)', PNG, _seed(i))['image']
           for i in range(4)]
  for crop in crops:
    assert crop.shape == (64, 32, 3) and crop.dtype == np.uint8
    # Found in the photo at some offset.
    hits = [(y, x) for y in range(512 - 63) for x in range(512 - 31)
            if (PHOTO[y, x] == crop[0, 0]).all()
            and np.array_equal(PHOTO[y:y + 64, x:x + 32], crop)]
    assert hits
  np.testing.assert_array_equal(
      crops[1], _run('decode|random_crop(64, 32)', PNG, _seed(1))['image'])
  assert len({c.tobytes() for c in crops}) == 4


def test_central_crop():
  out = _run('decode|central_crop(100)', PNG)['image']
  np.testing.assert_array_equal(out, PHOTO[206:306, 206:306])
  with pytest.raises(DataError, match='smaller than the crop: resize first'):
    _run('decode|central_crop(600)', PNG)


@pytest.mark.parametrize('op', ['random_crop', 'central_crop'])
def test_a_crop_larger_than_the_image_says_resize_first(op):
  small = tf.zeros([32, 40, 3], tf.uint8)
  with pytest.raises(DataError, match=rf'{op}\(64, 64\) gets 32x40 images, '
                     'smaller than the crop: resize first'):
    _run(f'{op}(64)', small)
  # Sizes known only while running: a tagged assertion, which
  # `explain_error` turns into the DataError naming the config field.
  fn = tf.function(lambda x: preprocess.build(f'{op}(64)', 64)(
      {'image': x}, _seed())['image'],
                   input_signature=[tf.TensorSpec([None, None, 3], tf.uint8)])
  with pytest.raises(tf.errors.InvalidArgumentError) as e:
    fn(small)
  error = ops.explain_error(e.value, 'input.pp_eval')
  assert isinstance(error, DataError)
  assert str(error).startswith(f'input.pp_eval: pre-processing op {op}(64, 64)'
                               ' got a 32x40 image, smaller than the crop: '
                               'resize first')
  assert fn(tf.zeros([64, 70, 3], tf.uint8)).shape == (64, 64, 3)
  assert ops.explain_error(ValueError('other'), 'input.pp_eval') is None


def test_sizes_are_whole_pixels():
  assert _run('decode|resize(100.0)', PNG)['image'].shape == (100, 100, 3)
  for spec in ('resize(8.5)', 'resize(8, 7.5)', 'resize_small(224.5)',
               'random_crop(0)', 'central_crop(True)', "resize('224')",
               'inception_crop(100.5)'):
    with pytest.raises(ValueError, match='positive whole number of pixels'):
      preprocess.build(spec, 224)


def test_flip_lr_flips_about_half_the_time():
  flipped = []
  for i in range(40):
    out = _run('decode|flip_lr', PNG, _seed(i))['image']
    assert np.array_equal(out, PHOTO) or np.array_equal(out, PHOTO[:, ::-1])
    flipped.append(np.array_equal(out, PHOTO[:, ::-1]))
  assert 8 <= sum(flipped) <= 32
  again = [np.array_equal(_run('decode|flip_lr', PNG, _seed(i))['image'],
                          PHOTO[:, ::-1]) for i in range(40)]
  assert again == flipped


def test_value_range():
  out = _run('decode|value_range(-1, 1)', PNG)['image']
  assert out.dtype == np.float32 and out.min() == -1 and out.max() == 1
  np.testing.assert_allclose(out, PHOTO / 127.5 - 1, atol=1e-6)
  out = _run('decode|value_range(0, 1)', PNG)['image']
  np.testing.assert_allclose(out, PHOTO / 255, atol=1e-6)


def test_onehot_and_keep():
  out = _run('decode|onehot(5)|keep("label")', PNG, label=2)
  assert list(out) == ['label']
  np.testing.assert_array_equal(out['label'], [0, 0, 1, 0, 0])


@pytest.mark.parametrize('preset,size', [
    ('inception', 224), ('finetune', 384), ('resize', 96), ('eval', 384)])
def test_presets_give_model_inputs(preset, size):
  for data in (JPEG, PNG, GRAY_PNG):
    out = _run(preset, data, size=size)['image']
    assert out.shape == (size, size, 3) and out.dtype == np.float32
    assert -1 <= out.min() < 0 < out.max() <= 1


def test_preset_expansions():
  assert preprocess.expand('finetune', 384) == [
      'decode', 'resize(448)', 'random_crop(384)', 'flip_lr',
      'value_range(-1,1)']
  assert preprocess.expand('eval', 224) == [
      'decode', 'resize_small(224)', 'central_crop(224)', 'value_range(-1,1)']
  assert preprocess.expand(['decode', ' resize(8) '], 8) == [
      'decode', 'resize(8)']


def test_random_pipeline_is_deterministic_per_seed():
  spec = 'finetune'
  a = _run(spec, JPEG, _seed(5), size=384)['image']
  b = _run(spec, JPEG, _seed(5), size=384)['image']
  c = _run(spec, JPEG, _seed(6), size=384)['image']
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_presets_ignore_spaces_and_a_one_item_list():
  inception = preprocess.expand('inception', 224)
  for spec in (' inception', 'inception ', '\tinception\n', ['inception'],
               [' inception '], ('inception',)):
    assert preprocess.expand(spec, 224) == inception, spec
    assert preprocess.build(spec, 224).ops == [
        'decode_jpeg_and_inception_crop', 'flip_lr', 'value_range']
  with pytest.raises(ValueError, match=r"'inception' is a preset, which must "
                     r"be the whole spec; .*write its ops out "
                     r"\('decode\|inception_crop\(224\)"):
    preprocess.build(['inception', 'randaug(2, 15)'], 224)


def test_fraction_arguments_as_the_signatures_write_them():
  assert preprocess.parse_op(
      'inception_crop(224, area_min=0.08, aspect_max=4/3)') == (
          'inception_crop', (224,), {'area_min': 0.08, 'aspect_max': 4 / 3})
  assert preprocess.parse_op('random_erasing(area_max=1/3, aspect_max=1/0.3)'
                             ) == ('random_erasing', (),
                                   {'area_max': 1 / 3, 'aspect_max': 1 / 0.3})
  assert preprocess.parse_op('value_range(-1/2, 1/2)')[1] == (-0.5, 0.5)
  assert preprocess.parse_op('f(-(4/3), 3/-4)')[1] == (-4 / 3, -0.75)
  preprocess.build('decode|inception_crop(224, area_min=0.08, aspect_max=4/3)'
                   '|random_erasing(area_max=1/3)|value_range(-1,1)', 224)
  # Only a division of two numbers: no names, calls or other operators.
  for text in ('f(4*3)', 'f(1+2)', 'f(a/3)', 'f(1/3/2)', 'f((1/3)/2)',
               "f(__import__('os').getpid())", 'f(True/2)', "f('a'/2)",
               'f(1/0)', 'f(2**8)', 'f(*[1])', 'f(**{})'):
    with pytest.raises(ValueError, match='cannot parse pre-processing op'):
      preprocess.parse_op(text)


def test_spec_errors_are_clear():
  with pytest.raises(ValueError, match='unknown pre-processing op.*known'):
    preprocess.build('decode|sharpen', 224)
  with pytest.raises(ValueError, match='bad arguments for op resize'):
    preprocess.build('resize(1, 2, 3, 4, 5)', 224)
  with pytest.raises(ValueError, match='cannot parse'):
    preprocess.build('resize(size)', 224)


def test_mixup_blends_images_and_one_hot_labels():
  images = tf.constant(np.stack([PHOTO, PHOTO[::-1]]), tf.float32)
  batch = {'image': images, 'label': tf.constant([0, 2], tf.int32)}
  out = mixup.mixup(batch, 0.2, 3, _seed(1))
  labels = out['label'].numpy()
  r = labels[0, 0]
  assert 0 <= r <= 1
  np.testing.assert_allclose(labels, [[r, 0, 1 - r], [1 - r, 0, r]],
                             atol=1e-6)
  np.testing.assert_allclose(out['image'].numpy()[0],
                             r * PHOTO + (1 - r) * PHOTO[::-1], atol=1e-2)
  again = mixup.mixup(batch, 0.2, 3, _seed(1))['label'].numpy()
  np.testing.assert_array_equal(labels, again)
  ratios = [float(mixup.beta_ratio(0.2, _seed(i))) for i in range(200)]
  assert all(0 <= x <= 1 for x in ratios)
  assert np.mean([x < 0.1 or x > 0.9 for x in ratios]) > 0.4  # U-shaped.


def test_cutmix_pastes_a_box_and_mixes_labels_by_its_area():
  a, b = np.zeros((64, 48, 3), np.float32), np.full((64, 48, 3), 9.0,
                                                     np.float32)
  batch = {'image': tf.constant(np.stack([a, b])),
           'label': tf.constant([0, 2], tf.int32)}
  fractions = []
  for i in range(20):
    out = mixup.cutmix(batch, 1.0, 3, _seed(i))
    images, labels = out['image'].numpy(), out['label'].numpy()
    np.testing.assert_allclose(labels.sum(1), 1, atol=1e-6)
    pasted = (images[0] == 9).all(-1)  # Image 0 got image 1's pixels.
    rows, cols = np.nonzero(pasted)
    if pasted.any():  # One rectangle.
      assert pasted.sum() == (np.ptp(rows) + 1) * (np.ptp(cols) + 1)
    np.testing.assert_allclose(labels[0], [1 - pasted.mean(), 0,
                                           pasted.mean()], atol=1e-6)
    np.testing.assert_array_equal(pasted, (images[1] == 0).all(-1))
    fractions.append(pasted.mean())
  assert 0.2 < np.mean(fractions) < 0.8  # Beta(1, 1): half on average.
  again = mixup.cutmix(batch, 1.0, 3, _seed(3))['image'].numpy()
  np.testing.assert_array_equal(
      again, mixup.cutmix(batch, 1.0, 3, _seed(3))['image'].numpy())
  both = [mixup.mix(batch, 0.2, 1.0, 3, _seed(i)) for i in range(20)]
  boxes = sum(bool(np.isin(o['image'].numpy()[0], [0, 9]).all())
              for o in both)
  assert 3 <= boxes <= 17  # CutMix on about half the batches, mixup else.


@pytest.mark.parametrize('box', [(10, 40, 5, 30), (0, 64, 0, 48),
                                 (20, 20, 3, 9), (0, 1, 47, 48)])
@pytest.mark.parametrize('dtype', [np.float32, np.uint8])
def test_cutmix_paste_copies_the_box_bit_for_bit(box, dtype):
  images = np.random.default_rng(0).integers(0, 255, (3, 64, 48, 2))
  images = images.astype(dtype) / (255 if dtype == np.float32 else 1)
  images = images.astype(dtype)
  y0, y1, x0, x1 = box
  expected = images.copy()
  expected[:, y0:y1, x0:x1] = images[::-1, y0:y1, x0:x1]
  out = mixup._paste(tf.constant(images), *map(tf.constant, box)).numpy()
  assert out.dtype == dtype
  np.testing.assert_array_equal(out, expected)


def test_mix_with_both_runs_only_the_chosen_one():
  """With mixup and CutMix both set, only the method drawn for the batch
  runs (a conditional), not both with one result thrown away; its result
  is the chosen method's with the shared seed, as resumed runs rely on."""
  batch = {'image': tf.random.uniform([4, 16, 12, 3], seed=1),
           'label': tf.constant([0, 1, 2, 1], tf.int32)}
  graph = tf.function(lambda b: mixup.mix(b, 0.8, 1.0, 3, _seed(5))
                      ).get_concrete_function(batch).graph
  kinds = {op.type for op in graph.get_operations()}
  assert kinds & {'If', 'StatelessIf'}, sorted(kinds)
  chosen = set()
  for i in range(12):
    out = mixup.mix(batch, 0.8, 1.0, 3, _seed(i))
    s = tf.random.experimental.stateless_split(_seed(i), 2)
    cut = bool(tf.random.stateless_uniform([], s[0]) < 0.5)
    ref = (mixup.cutmix if cut else mixup.mixup)(
        batch, 1.0 if cut else 0.8, 3, s[1])
    for k in ('image', 'label'):
      np.testing.assert_array_equal(out[k].numpy(), ref[k].numpy())
    chosen.add(cut)
  assert chosen == {True, False}


def test_bare_names_in_arguments_say_quote_them():
  with pytest.raises(ValueError, match="cannot parse.*bicubic is a bare "
                     "name.*quote it: method='bicubic'"):
    preprocess.parse_op('resize(224, method=bicubic)')
  with pytest.raises(ValueError, match="quote it: 'area'"):
    preprocess.parse_op('resize_small(224, area)')
  with pytest.raises(ValueError, match=r"resize\(224, method='bicubic'\)"):
    preprocess.build("decode|resize(224, 'bicubic')", 224)


def test_sizes_as_an_h_w_pair_as_big_vision_writes_them():
  for op in ('resize', 'central_crop', 'random_crop'):
    pre = 'decode|resize(300)|' if op != 'resize' else 'decode|'
    pair = _run(f'{pre}{op}((64, 48))', PNG)['image']
    assert pair.shape == (64, 48, 3)
    np.testing.assert_array_equal(pair, _run(f'{pre}{op}(64, 48)',
                                             PNG)['image'])
    np.testing.assert_array_equal(_run(f'{pre}{op}([64, 48])', PNG)['image'],
                                  pair)
  for bad in ('resize((64, 48), 32)', 'resize((64, 48, 3))'):
    with pytest.raises(ValueError, match=r'resize\(h, w\), resize\(\(h, w\)'
                       r'\) or resize\(side\)'):
      preprocess.build(bad, 224)
  with pytest.raises(ValueError, match=r'square crops.*inception_crop\(224\)'):
    preprocess.build('decode|inception_crop((224, 224))', 224)
  with pytest.raises(ValueError, match=r'one side, not an \(h, w\) pair'):
    preprocess.build('resize_small((224, 224))', 224)


@pytest.mark.parametrize('spec,match', [
    ('inception_crop(224, aspect_min=4/3, aspect_max=3/4)',
     'aspect_min=1.33333, aspect_max=0.75: swap them'),
    ('decode|inception_crop(224, aspect_min=4/3, aspect_max=3/4)',
     'swap them'),  # The fused op.
    ('inception_crop(224, aspect_min=0)', '0 < aspect_min <= aspect_max'),
    ('inception_crop(224, aspect_min=-1, aspect_max=-1/2)', 'width/height'),
    ("resize(224, method='bicubc')", "method='bicubc' is not one of"),
    ("resize_small(224, antialias='yes')", 'antialias=True or antialias='),
    ('value_range(-1, 1, 0, 0)', 'in_min = in_max = 0'),
])
def test_bad_op_arguments_are_refused_when_built(spec, match):
  with pytest.raises(ValueError, match=match):
    preprocess.build(spec, 224)


def test_output_range_reads_the_last_value_range():
  out = preprocess.output_range
  assert out('inception', 224) == (0, 255, -1, 1)
  assert out('decode|resize(8)', 8) == preprocess.PIXELS
  assert out('decode|value_range(0, 1)|resize(8)|value_range(-1, 1, 0, 1)',
             8) == (0, 1, -1, 1)
  assert out('decode|resize(8)|value_range(vmax=2, vmin=0)', 8) == (0, 255,
                                                                     0, 2)


@ops.register('test_data_ops_rescale')
def _user_rescale() -> ops.OpFn:  # An op of a user's own module.
  return ops.on_image(lambda image, seed: image / 2)


def test_output_range_is_unknown_after_a_users_own_op():
  assert not ops.is_builtin('test_data_ops_rescale')
  assert ops.is_builtin('value_range') and ops.is_builtin('randaug')
  assert preprocess.output_range(
      'decode|value_range(-1, 1)|test_data_ops_rescale', 8) is None
  assert preprocess.output_range(
      'decode|test_data_ops_rescale|value_range(-1, 1)', 8) == (0, 255, -1, 1)
