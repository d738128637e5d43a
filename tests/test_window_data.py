"""WindowData against a float64 NumPy reimplementation of Caffe's window crops."""
import collections
import math
import os

import numpy
import pytest
from google.protobuf import text_format
from PIL import Image

import caffeplus
from caffeplus import rng
from caffeplus.blob import Blob
from caffeplus.errors import CaffeplusError, UnknownLayerError
from caffeplus.io import blobproto, prototxt
from caffeplus.layer import create_layer, layer_types
from caffeplus.proto import caffe_pb2
from conftest import ZOO, need

PASCAL = 'examples/finetune_pascal_detection/pascal_finetune_trainval_test.prototxt'


# -- files -------------------------------------------------------------------------
def write_png(path, pixels):
    """Save H x W x 3 (RGB) or H x W (grey) uint8 pixels; return the path."""
    Image.fromarray(pixels).save(str(path))
    return str(path)


def random_png(path, h, w, seed, grey=False):
    r = numpy.random.RandomState(seed)
    shape = (h, w) if grey else (h, w, 3)
    return write_png(path, r.randint(0, 256, shape, dtype=numpy.uint8))


def window_file(path, images):
    """images: [(image path, height, width, [(class, overlap, x1, y1, x2, y2)])]."""
    lines = []
    for index, (image, h, w, windows) in enumerate(images):
        lines += ['# %d' % index, image, '3', str(h), str(w), str(len(windows))]
        lines += ['%d %g %d %d %d %d' % win for win in windows]
    path.write_text('\n'.join(lines) + '\n')
    return str(path)


def mean_file(path, shape, seed=7):
    mean = numpy.random.RandomState(seed).uniform(0, 255, (1,) + shape).astype(numpy.float32)
    blobproto.write_blobproto(blobproto.array_to_blobproto(mean), str(path))
    return str(path), mean[0].astype(numpy.float64)


def make(source, window='', transform='crop_size: 16', phase=caffe_pb2.TRAIN, seed=1):
    rng.set_random_seed(seed)
    lp = text_format.Parse('name: "win" type: "WindowData" top: "data" top: "label" '
                           'transform_param { %s } window_data_param { source: "%s" %s }'
                           % (transform, source, window), caffe_pb2.LayerParameter())
    lp.phase = phase
    layer = create_layer(lp)
    tops = [Blob(name='data'), Blob(name='label')]
    try:
        layer.setup([], tops)
    except BaseException:
        if hasattr(layer, 'close'):
            layer.close()
        raise
    return layer, tops


def batches(layer, tops, n):
    out = []
    for _ in range(n):
        layer.forward([], tops)
        out.append((numpy.array(tops[0].data, copy=True), numpy.array(tops[1].data, copy=True)))
    return out


@pytest.fixture
def layers_to_close():
    made = []
    yield made
    for layer in made:
        layer.close()


# -- the float64 reference -----------------------------------------------------------
def c_round(x):
    return int(math.floor(x + 0.5)) if x >= 0 else -int(math.floor(-x + 0.5))


def bgr(path):
    """The image as OpenCV's imread(IMREAD_COLOR) gives it: H x W x 3, BGR, float64."""
    with Image.open(path) as img:
        rgb = numpy.asarray(img.convert('RGB'), dtype=numpy.float64)
    return rgb[:, :, ::-1]


def bilinear(img, out_h, out_w):
    """Bilinear resize with pixel centres at +0.5 and the border replicated."""
    def taps(n_in, n_out):
        pos = numpy.clip((numpy.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)
        lo = numpy.floor(pos).astype(int)
        hi = numpy.minimum(lo + 1, n_in - 1)
        return lo, hi, pos - lo
    ylo, yhi, fy = taps(img.shape[0], out_h)
    xlo, xhi, fx = taps(img.shape[1], out_w)
    rows = img[ylo] * (1 - fy)[:, None, None] + img[yhi] * fy[:, None, None]
    return rows[:, xlo] * (1 - fx)[None, :, None] + rows[:, xhi] * fx[None, :, None]


def reference_region(box, crop, pad, square, img_h, img_w, mirror):
    """(x1, y1, x2, y2), (out_h, out_w), (pad_h, pad_w) in float64."""
    x1, y1, x2, y2 = box
    if pad == 0 and not square:
        return (x1, y1, x2, y2), (crop, crop), (0, 0)
    grow = crop / (crop - 2.0 * pad)
    half_w, half_h = (x2 - x1 + 1) / 2.0, (y2 - y1 + 1) / 2.0
    cx, cy = x1 + half_w, y1 + half_h
    if square:
        half_w = half_h = max(half_w, half_h)
    x1, x2 = c_round(cx - half_w * grow), c_round(cx + half_w * grow)
    y1, y2 = c_round(cy - half_h * grow), c_round(cy + half_h * grow)
    full_w, full_h = x2 - x1 + 1, y2 - y1 + 1
    cut_left, cut_top = max(0, -x1), max(0, -y1)
    cut_right, cut_bottom = max(0, x2 - (img_w - 1)), max(0, y2 - (img_h - 1))
    x1, y1, x2, y2 = x1 + cut_left, y1 + cut_top, x2 - cut_right, y2 - cut_bottom
    sx, sy = crop / full_w, crop / full_h
    pad_h = c_round(cut_top * sy)
    pad_w = c_round((cut_right if mirror else cut_left) * sx)
    out_h = min(c_round((y2 - y1 + 1) * sy), crop - pad_h)
    out_w = min(c_round((x2 - x1 + 1) * sx), crop - pad_w)
    return (x1, y1, x2, y2), (out_h, out_w), (pad_h, pad_w)


def reference_crop(image, box, crop, pad=0, square=False, mirror=False, mean=None,
                   mean_values=None, scale=1.0):
    """C x crop x crop float64: Caffe's WindowData output for one window."""
    (x1, y1, x2, y2), (oh, ow), (ph, pw) = reference_region(
        box, crop, pad, square, image.shape[0], image.shape[1], mirror)
    warped = bilinear(image[y1:y2 + 1, x1:x2 + 1], oh, ow)
    if mirror:
        warped = warped[:, ::-1]
    out = numpy.zeros((3, crop, crop))
    values = warped.transpose(2, 0, 1)
    if mean is not None:
        off = (mean.shape[2] - crop) // 2
        centre = mean[:, off:off + crop, off:off + crop]
        values = values - centre[:, ph:ph + oh, pw:pw + ow]
    elif mean_values is not None:
        values = values - numpy.resize(numpy.asarray(mean_values, float), 3)[:, None, None]
    out[:, ph:ph + oh, pw:pw + ow] = values * scale
    return out


def close_to(got, want, scale=1.0):
    # OpenCV's bilinear works in 11-bit fixed point: within one grey level.
    return numpy.abs(got - want).max() <= 1.0 * abs(scale) + 1e-3


# -- crops against the reference ---------------------------------------------------
IMG_H, IMG_W = 40, 50
BOXES = [(10, 8, 29, 27),        # inside, square
         (5, 12, 40, 20),        # wide
         (20, 2, 26, 37),        # tall
         (0, 0, 12, 9),          # at the top-left corner: context runs outside
         (38, 30, 49, 39),       # at the bottom-right corner
         (0, 0, 49, 39)]         # the whole image
MODES = [('warp', 0, 'none'), ('warp', 3, 'file'), ('square', 0, 'values'),
         ('square', 4, 'file'), ('warp', 5, 'values'), ('square', 2, 'none')]


@pytest.mark.parametrize('crop_mode,context_pad,mean_kind', MODES)
def test_crops_match_the_float64_reference(tmp_path, layers_to_close, crop_mode, context_pad,
                                           mean_kind):
    crop, scale = 16, 0.5
    image = random_png(tmp_path / 'img.png', IMG_H, IMG_W, seed=3)
    pixels = bgr(image)
    transform = 'crop_size: %d mirror: true' % crop
    mean = mean_values = None
    if mean_kind == 'file':
        # Taller than wide: Caffe offsets both axes by the width's margin.
        path, mean = mean_file(tmp_path / 'mean.binaryproto', (3, 23, 20))
        transform += ' mean_file: "%s"' % path
    elif mean_kind == 'values':
        mean_values = [104.0, 117.0, 123.0]
        transform += ''.join(' mean_value: %g' % v for v in mean_values)
    for i, box in enumerate(BOXES):
        source = window_file(tmp_path / ('w%d.txt' % i), [(image, IMG_H, IMG_W,
                                                            [(1, 0.9) + box])])
        layer, tops = make(source, 'batch_size: 6 fg_fraction: 1 scale: %g context_pad: %d '
                                   'crop_mode: "%s"' % (scale, context_pad, crop_mode),
                           transform, seed=i)
        layers_to_close.append(layer)
        assert tops[0].shape == (6, 3, crop, crop)
        seen = set()
        for data, label in batches(layer, tops, 4):
            numpy.testing.assert_array_equal(label, numpy.ones(6))
            for item in data:
                matches = [m for m in (False, True)
                           if close_to(item, reference_crop(pixels, box, crop, context_pad,
                                                            crop_mode == 'square', m, mean,
                                                            mean_values, scale), scale)]
                assert len(matches) == 1, (box, crop_mode, context_pad)
                seen.add(matches[0])
        assert seen == {False, True}, 'mirror: 24 coins gave one side only'


def test_context_pads_at_the_right_offset(tmp_path, layers_to_close):
    """A window at the left edge: its context outside the image stays 0 on the left,
    and on the right when the crop is mirrored."""
    image = write_png(tmp_path / 'white.png', numpy.full((20, 20, 3), 200, numpy.uint8))
    source = window_file(tmp_path / 'w.txt', [(image, 20, 20, [(1, 0.9, 0, 5, 9, 14)])])
    layer, tops = make(source, 'batch_size: 8 fg_fraction: 1 context_pad: 4',
                       'crop_size: 16 mirror: true')
    layers_to_close.append(layer)
    # The box (x 0..9, y 5..14) grown by 16/8 = 2 about its centre (5, 10) is
    # x -5..15, y 0..20 (21 x 21): 5 columns left of the image and 1 row below,
    # which become round(5 * 16/21) = 4 columns and 0 rows of 0; the 16 x 20
    # pixels inside warp to round(16 * 16/21) = 12 columns by round(20 * 16/21)
    # = 15 rows, so the last output row stays 0 as well.
    sides = set()
    for data, _ in batches(layer, tops, 3):
        for item in data:
            zero_cols = numpy.flatnonzero((item == 0).all(axis=(0, 1)))
            assert list(zero_cols) in ([0, 1, 2, 3], [12, 13, 14, 15])
            sides.add(zero_cols[0])
            inside = [c for c in range(16) if c not in zero_cols]
            assert (item[:, :15, inside] == 200).all()
            assert (item[:, 15, :] == 0).all()
    assert sides == {0, 12}


def test_decoding_matches_imagedata(tmp_path, layers_to_close):
    """Colour images come out BGR, grey ones replicated to 3 channels."""
    r = numpy.random.RandomState(5)
    rgb = r.randint(0, 256, (12, 12, 3), dtype=numpy.uint8)
    grey = r.randint(0, 256, (12, 12), dtype=numpy.uint8)
    images = [write_png(tmp_path / 'c.png', rgb), write_png(tmp_path / 'g.png', grey)]
    expected = [rgb[:, :, ::-1].transpose(2, 0, 1), numpy.stack([grey] * 3)]
    for image, want in zip(images, expected):
        source = window_file(tmp_path / 'w.txt', [(image, 12, 12, [(3, 1.0, 0, 0, 11, 11)])])
        layer, tops = make(source, 'batch_size: 2 fg_fraction: 1', 'crop_size: 12')
        layers_to_close.append(layer)
        layer.forward([], tops)
        numpy.testing.assert_array_equal(tops[0].data, numpy.stack([want] * 2))


def test_scale_comes_from_window_data_param(tmp_path, layers_to_close, caplog_caffeplus):
    image = write_png(tmp_path / 'i.png', numpy.full((8, 8, 3), 100, numpy.uint8))
    source = window_file(tmp_path / 'w.txt', [(image, 8, 8, [(1, 1.0, 0, 0, 7, 7)])])
    layer, tops = make(source, 'batch_size: 1 fg_fraction: 1 scale: 0.25',
                       'crop_size: 8 scale: 10 mean_value: 20')
    layers_to_close.append(layer)
    layer.forward([], tops)
    assert (tops[0].data == (100 - 20) * 0.25).all()
    assert any('transform_param.scale (10) is not used' in m for m in caplog_caffeplus)


def test_legacy_window_data_param_fields(tmp_path, layers_to_close):
    """crop_size and mean_file of window_data_param count in a net never upgraded."""
    image = random_png(tmp_path / 'i.png', 20, 20, seed=2)
    path, mean = mean_file(tmp_path / 'm.binaryproto', (3, 12, 12))
    source = window_file(tmp_path / 'w.txt', [(image, 20, 20, [(2, 1.0, 2, 3, 15, 16)])])
    layer, tops = make(source, 'batch_size: 2 fg_fraction: 1 crop_size: 10 mean_file: "%s"'
                       % path, transform='')
    layers_to_close.append(layer)
    layer.forward([], tops)
    want = reference_crop(bgr(image), (2, 3, 15, 16), 10, mean=mean)
    assert tops[0].shape == (2, 3, 10, 10)
    assert all(close_to(item, want) for item in tops[0].data)


# -- sampling --------------------------------------------------------------------------
@pytest.mark.parametrize('batch_size,fg_fraction,num_fg', [(10, 0.25, 2), (8, 0.5, 4),
                                                           (5, 1.0, 5), (6, 0.0, 0),
                                                           (7, 0.3, 2), (128, 0.25, 32)])
def test_background_first_then_the_foreground_share(tmp_path, layers_to_close, batch_size,
                                                    fg_fraction, num_fg):
    image = random_png(tmp_path / 'i.png', 30, 30, seed=1)
    windows = [(4, 0.8, 0, 0, 9, 9), (7, 0.5, 5, 5, 20, 20), (2, 1.0, 10, 0, 29, 15),
               (3, 0.1, 0, 10, 9, 29), (0, 0.0, 15, 15, 29, 29)]
    source = window_file(tmp_path / 'w.txt', [(image, 30, 30, windows)])
    layer, tops = make(source, 'batch_size: %d fg_fraction: %g' % (batch_size, fg_fraction))
    layers_to_close.append(layer)
    labels = numpy.concatenate([label for _, label in batches(layer, tops, 40)])
    per_batch = labels.reshape(40, batch_size)
    assert (per_batch[:, :batch_size - num_fg] == 0).all()
    assert set(per_batch[:, batch_size - num_fg:].ravel()) <= {2, 4, 7}
    if num_fg * 40 >= 60:
        counts = collections.Counter(per_batch[:, batch_size - num_fg:].ravel())
        n = num_fg * 40
        # Uniform with replacement: each of the 3 near n/3.
        assert set(counts) == {2, 4, 7}
        assert all(abs(c - n / 3) < 5 * math.sqrt(n * 2 / 9) for c in counts.values())


def test_thresholds_pick_the_windows(tmp_path, layers_to_close):
    """fg: overlap >= fg_threshold; bg: overlap < bg_threshold (class forced to 0);
    windows in between are never used."""
    image = random_png(tmp_path / 'i.png', 40, 40, seed=4)
    boxes = {'fg_at': (0, 0, 9, 9), 'fg_above': (10, 0, 19, 9), 'between': (20, 0, 29, 9),
             'at_bg': (30, 0, 39, 9), 'bg_below': (0, 10, 9, 19), 'bg_labelled': (10, 10, 19, 19)}
    spec = {'fg_at': (5, 0.6), 'fg_above': (6, 0.95), 'between': (8, 0.45),
            'at_bg': (9, 0.3), 'bg_below': (0, 0.29), 'bg_labelled': (11, 0.1)}
    windows = [spec[k] + boxes[k] for k in boxes]
    source = window_file(tmp_path / 'w.txt', [(image, 40, 40, windows)])
    layer, tops = make(source, 'batch_size: 8 fg_fraction: 0.5 fg_threshold: 0.6 '
                               'bg_threshold: 0.3', 'crop_size: 8')
    layers_to_close.append(layer)
    pixels = bgr(image)
    refs = {k: reference_crop(pixels, b, 8) for k, b in boxes.items()}
    used = collections.defaultdict(set)
    for data, label in batches(layer, tops, 10):
        for item, lab in zip(data, label):
            names = [k for k, ref in refs.items() if close_to(item, ref)]
            assert len(names) == 1
            used[names[0]].add(float(lab))
    assert dict(used) == {'fg_at': {5.0}, 'fg_above': {6.0}, 'bg_below': {0.0},
                          'bg_labelled': {0.0}}


def test_root_folder_and_cache_images_give_the_same_batches(tmp_path, layers_to_close):
    os.mkdir(str(tmp_path / 'img'))
    names = ['a.png', 'b.png', 'c.jpg']
    for i, name in enumerate(names):
        r = numpy.random.RandomState(i)
        Image.fromarray(r.randint(0, 256, (30 + i, 36, 3), dtype=numpy.uint8)).save(
            str(tmp_path / 'img' / name), quality=90)
    windows = [(1, 0.8, 2, 3, 20, 25), (2, 0.6, 10, 0, 35, 29), (0, 0.1, 0, 0, 35, 29),
               (0, 0.2, 5, 5, 15, 15)]
    listing = [(name, 30 + i, 36, windows) for i, name in enumerate(names)]
    relative = window_file(tmp_path / 'rel.txt', listing)
    absolute = window_file(tmp_path / 'abs.txt', [(str(tmp_path / 'img' / n),) + rest[1:]
                                                 for n, rest in zip(names, listing)])
    common = 'batch_size: 6 fg_fraction: 0.5 context_pad: 2 crop_mode: "square"'
    runs = []
    for source, extra in ((absolute, ''), (relative, 'root_folder: "%s/img/"' % tmp_path),
                          (relative, 'root_folder: "%s/img/" cache_images: true' % tmp_path)):
        layer, tops = make(source, '%s %s' % (common, extra), 'crop_size: 12 mirror: true',
                           seed=11)
        layers_to_close.append(layer)
        runs.append(batches(layer, tops, 5))
    for run in runs[1:]:
        for (data, label), (want_data, want_label) in zip(run, runs[0]):
            numpy.testing.assert_array_equal(data, want_data)
            numpy.testing.assert_array_equal(label, want_label)
    assert not (runs[0][0][0] == runs[0][1][0]).all()


def test_resume_and_shards_continue_the_same_stream(tmp_path, layers_to_close):
    image = random_png(tmp_path / 'i.png', 24, 24, seed=6)
    windows = [(1, 0.9, 0, 0, 11, 11), (2, 0.7, 12, 12, 23, 23), (0, 0.0, 0, 12, 11, 23),
               (0, 0.1, 12, 0, 23, 11)]
    source = window_file(tmp_path / 'w.txt', [(image, 24, 24, windows)])
    params = 'batch_size: 4 fg_fraction: 0.5'
    layer, tops = make(source, params, 'crop_size: 8 mirror: true', seed=3)
    layers_to_close.append(layer)
    whole = batches(layer, tops, 6)
    # Resume after 2 batches.
    layer, tops = make(source, params, 'crop_size: 8 mirror: true', seed=3)
    layers_to_close.append(layer)
    batches(layer, tops, 2)
    state = layer.get_state()
    other, other_tops = make(source, params, 'crop_size: 8 mirror: true', seed=99)
    layers_to_close.append(other)
    other.set_state(state)
    for (data, label), (want, want_label) in zip(batches(other, other_tops, 4), whole[2:]):
        numpy.testing.assert_array_equal(data, want)
        numpy.testing.assert_array_equal(label, want_label)
    # Two ranks: rank r takes batches r, r + 2, ... of the unsharded stream.
    for rank in (0, 1):
        layer, tops = make(source, params, 'crop_size: 8 mirror: true', seed=3)
        layers_to_close.append(layer)
        layer.set_shard(rank, 2)
        for (data, _), (want, _) in zip(batches(layer, tops, 3), whole[rank::2]):
            numpy.testing.assert_array_equal(data, want)


def test_mirror_applies_in_test_phase_too(tmp_path, layers_to_close):
    image = random_png(tmp_path / 'i.png', 10, 10, seed=8)
    source = window_file(tmp_path / 'w.txt', [(image, 10, 10, [(1, 1.0, 0, 0, 9, 9)])])
    layer, tops = make(source, 'batch_size: 16 fg_fraction: 1', 'crop_size: 10 mirror: true',
                       phase=caffe_pb2.TEST)
    layers_to_close.append(layer)
    layer.forward([], tops)
    plain = bgr(image).transpose(2, 0, 1)
    flipped = [bool((item == plain[:, :, ::-1]).all()) for item in tops[0].data]
    assert all(f or (item == plain).all() for f, item in zip(flipped, tops[0].data))
    assert 0 < sum(flipped) < 16


# -- errors ------------------------------------------------------------------------------
def good_header(image):
    return '# 0\n%s\n3\n20\n20\n' % image


MALFORMED = [
    ('', None, 'Window file is empty'),
    ('0\n', 1, "expected '#'"),
    ('{head}2\n1 0.9 0 0 5 5\n', 7, 'ends after line 7 where a window class was expected'),
    ('{head}1\n1 high 0 0 5 5\n', 7, "expected a window overlap \\(a number\\), got 'high'"),
    ('{head}1\n1 0.9 0 0 5.5 5\n', 7, "expected window coordinate x2 \\(an integer\\), "
                                      "got '5.5'"),
    ('{head}1\n0 0.9 0 0 5 5\n', 7, 'foreground window .* needs a positive class, got 0'),
    ('{head}1\n1 0.9 6 0 5 5\n', 7, 'window 6 0 5 5 is empty'),
    ('# 1\n{img}\n3\n20\n20\n0\n', 1, 'image index 1 where 0 was expected'),
    ('# 0\n{img}\n1\n20\n20\n0\n', 3, 'image channels 1: WindowData reads images in colour'),
    ('{head}0\n# 1\n{img}\n3\n20\n-4\n0\n', 11, 'image width must be positive'),
]


@pytest.mark.parametrize('text,line,message', MALFORMED)
def test_malformed_window_files_name_the_file_and_line(tmp_path, text, line, message):
    image = random_png(tmp_path / 'i.png', 20, 20, seed=0)
    path = tmp_path / 'w.txt'
    path.write_text(text.format(head=good_header(image), img=image))
    with pytest.raises(CaffeplusError, match=message) as info:
        make(str(path), 'batch_size: 2')
    text = str(info.value)
    assert 'layer win' in text and str(path) in text
    if line is not None and 'ends after' not in message:
        assert 'line %d of window file' % line in text


def test_missing_files_are_named(tmp_path):
    with pytest.raises(CaffeplusError, match='layer win: window file not found: .*nope.txt'):
        make(str(tmp_path / 'nope.txt'), 'batch_size: 2')
    image = random_png(tmp_path / 'i.png', 20, 20, seed=0)
    source = window_file(tmp_path / 'w.txt', [(image, 20, 20, [(1, 0.9, 0, 0, 5, 5)]),
                                              ('gone.png', 20, 20, [(0, 0.0, 0, 0, 5, 5)])])
    for extra in ('', 'cache_images: true'):
        with pytest.raises(CaffeplusError, match="layer win: image 'gone.png' \\(line 9 of "
                                                 "window file .*w.txt\\): image file not found"):
            make(source, 'batch_size: 2 ' + extra)
    with pytest.raises(CaffeplusError, match="root_folder 'sub' is prepended as is"):
        make(source, 'batch_size: 2 root_folder: "sub"')


def test_a_window_outside_its_image_is_named_at_forward(tmp_path):
    image = random_png(tmp_path / 'i.png', 20, 20, seed=0)
    source = window_file(tmp_path / 'w.txt', [(image, 20, 20, [(1, 0.9, 10, 10, 25, 15)])])
    layer, tops = make(source, 'batch_size: 2 fg_fraction: 1')
    try:
        with pytest.raises(CaffeplusError, match='window 10 10 25 15 at line 7 of window file '
                                                 '.*w.txt .*not inside the image'):
            layer.forward([], tops)
    finally:
        layer.close()


@pytest.mark.parametrize('window,transform,message', [
    ('batch_size: 0', 'crop_size: 8', 'window_data_param.batch_size must be positive'),
    ('batch_size: 2 crop_mode: "Square"', 'crop_size: 8', "crop_mode is 'Square'"),
    ('batch_size: 2', '', 'transform_param.crop_size must be positive'),
    ('batch_size: 2 context_pad: 4', 'crop_size: 8', 'context_pad 4 leaves no room'),
    ('batch_size: 2 fg_fraction: 1.5', 'crop_size: 8', 'fg_fraction must lie in'),
    ('batch_size: 4 fg_threshold: 0.95', 'crop_size: 8', 'no foreground windows'),
    ('batch_size: 4 bg_threshold: 0.01', 'crop_size: 8', 'no background windows'),
    ('batch_size: 2', 'crop_size: 8 mean_value: 1 mean_value: 2', 'mean_value must be given'),
    ('batch_size: 2', 'crop_size: 8 mean_file: "{mean}"', 'mean_file .* holds a 3 x 12 x 6'),
])
def test_bad_settings_name_the_field(tmp_path, window, transform, message):
    image = random_png(tmp_path / 'i.png', 20, 20, seed=0)
    path, _ = mean_file(tmp_path / 'm.binaryproto', (3, 12, 6))
    source = window_file(tmp_path / 'w.txt', [(image, 20, 20, [(1, 0.9, 0, 0, 5, 5),
                                                               (0, 0.1, 3, 3, 9, 9)])])
    with pytest.raises(CaffeplusError, match=message) as info:
        make(source, window, transform.format(mean=path))
    assert 'layer win' in str(info.value)


def test_unknown_type_error_lists_the_registry():
    lp = caffe_pb2.LayerParameter(name='x', type='WindowDatum')
    with pytest.raises(UnknownLayerError) as info:
        create_layer(lp)
    known = str(info.value).split('Known types: ')[1]
    assert known.split(', ') == layer_types()
    assert 'WindowData' in layer_types()


# -- the zoo's R-CNN fine-tuning nets ----------------------------------------------------
def pascal_inputs(tmp_path):
    images = []
    for i, (h, w) in enumerate([(120, 160), (150, 100)]):
        path = random_png(tmp_path / ('p%d.png' % i), h, w, seed=20 + i)
        images.append((path, h, w, [(1 + i, 0.8, 10, 12, w - 20, h - 30),
                                    (0, 0.2, 0, 0, w // 2, h // 2),
                                    (3, 0.05, w // 3, h // 3, w - 1, h - 1)]))
    source = window_file(tmp_path / 'windows.txt', images)
    mean, _ = mean_file(tmp_path / 'imagenet_mean.binaryproto', (3, 256, 256))
    return source, mean


def rewire(param, source, mean, batch_size):
    found = 0
    for lp in param.layer:
        if lp.type == 'WindowData':
            lp.window_data_param.source = source
            lp.window_data_param.batch_size = batch_size
            lp.transform_param.mean_file = mean
            found += 1
    assert found


@pytest.mark.parametrize('rel', ['bvlc_caffe/' + PASCAL, 'bvlc_caffe_v1_2015/' + PASCAL,
                                 'bvlc_caffe_v0_2014/examples/pascal-finetuning/'
                                 'pascal_finetune_train.prototxt'])
def test_pascal_finetuning_net_builds_and_runs(tmp_path, rel):
    source, mean = pascal_inputs(tmp_path)
    param = prototxt.read_net_param(need(os.path.join(ZOO, rel)))
    rewire(param, source, mean, batch_size=2)
    rng.set_random_seed(5)
    net = caffeplus.Net(param, caffeplus.TRAIN)
    data_layer = net.layer_dict['data']
    try:
        assert data_layer.type == 'WindowData'
        p = data_layer.layer_param
        assert (p.transform_param.crop_size, p.transform_param.mirror) == (227, True)
        assert (p.window_data_param.context_pad, p.window_data_param.crop_mode) == (16, 'warp')
        assert tuple(net.blobs['data'].shape) == (2, 3, 227, 227)
        assert tuple(net.blobs['label'].shape) == (2,)
        assert tuple(net.blobs['fc8_pascal'].shape) == (2, 21)
        loss = net.forward_prefilled()
        # batch 2 at fg_fraction 0.25: both background.
        numpy.testing.assert_array_equal(net.blobs['label'].data, [0, 0])
        assert numpy.isfinite(loss) and loss > 0
    finally:
        data_layer.close()


def test_pascal_data_layer_top_shapes_at_full_batch(tmp_path):
    source, mean = pascal_inputs(tmp_path)
    param = prototxt.read_net_param(need(os.path.join(ZOO, 'bvlc_caffe/' + PASCAL)))
    rewire(param, source, mean, batch_size=128)
    for lp in param.layer:
        if lp.type == 'WindowData':
            lp.data_param.prefetch = 0
            lp.phase = caffe_pb2.TRAIN
            layer = create_layer(lp)
            tops = [Blob(name='data'), Blob(name='label')]
            layer.setup([], tops)
            try:
                assert tops[0].shape == (128, 3, 227, 227) and tops[1].shape == (128,)
            finally:
                layer.close()
