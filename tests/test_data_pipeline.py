"""The data pipeline: parallel workers, the uint8 batch and its plan, decoding.

Data and ImageData read and decode with several worker threads
(caffeplus.io.workers) and transform whole batches at once
(caffeplus.io.batch_transform); the batches must not depend on the number
of workers, must resume and shard exactly, and must agree with independent
per-image references.
"""
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy
import pytest
from google.protobuf import text_format

import caffeplus
from caffeplus.blob import Blob
from caffeplus.errors import CaffeplusError
from caffeplus.io import batch_transform as bt
from caffeplus.io import datum as datum_io
from caffeplus.io import db as db_io
from caffeplus.io import workers
from caffeplus.io.blobproto import array_to_blobproto, write_blobproto
from caffeplus.io.transformer import DataTransformer
from caffeplus.layer import create_layer
from caffeplus.proto import caffe_pb2

Image = pytest.importorskip('PIL.Image')
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_COUNTS = (1, 2, 4)
# A subprocess that must stop gets this long before the test calls it hung.
STOP_DEADLINE_S = 60


# -- inputs ----------------------------------------------------------------------
def _images(n, shape=(3, 20, 24), seed=0):
    """Smooth-ish random C x H x W uint8 images (JPEG keeps them non-trivial)."""
    rs = numpy.random.RandomState(seed)
    c, h, w = shape
    out = []
    for _ in range(n):
        base = rs.randint(0, 256, (c, h // 4 + 1, w // 4 + 1)).astype(numpy.float64)
        big = numpy.kron(base, numpy.ones((1, 4, 4)))[:, :h, :w]
        noise = rs.randint(-20, 21, (c, h, w))
        out.append(numpy.clip(big + noise, 0, 255).astype(numpy.uint8))
    return out


def _encode(chw, fmt):
    hwc = chw.transpose(1, 2, 0)[:, :, ::-1]      # BGR -> RGB for Pillow
    if hwc.shape[2] == 1:
        hwc = hwc[:, :, 0]
    buf = io.BytesIO()
    Image.fromarray(numpy.ascontiguousarray(hwc)).save(buf, fmt, **(
        {'quality': 90} if fmt == 'JPEG' else {}))
    return buf.getvalue()


def _write_lmdb(path, images, encode=None, labels=None):
    with db_io.open_db(str(path), 'lmdb', 'new') as db:
        for i, img in enumerate(images):
            label = i % 7 if labels is None else labels[i]
            if encode:
                d = caffe_pb2.Datum(channels=img.shape[0], height=img.shape[1],
                                    width=img.shape[2], data=_encode(img, encode),
                                    encoded=True, label=label)
            else:
                d = datum_io.array_to_datum(img, label)
            db.put(b'%08d' % i, d.SerializeToString())
        db.commit()
    return str(path)


def _write_mean(path, shape, seed=5):
    mean = numpy.random.RandomState(seed).uniform(0, 255, (1,) + shape).astype(numpy.float32)
    write_blobproto(array_to_blobproto(mean), str(path))
    return str(path), mean[0]


def _make(text, phase=caffe_pb2.TRAIN, count=None, seed=1701):
    caffeplus.rng.set_random_seed(seed)
    lp = text_format.Parse(text, caffe_pb2.LayerParameter())
    lp.phase = phase
    layer = create_layer(lp)
    tops = [Blob(name='t%d' % i) for i in range(len(lp.top))]
    with workers.setting(count):
        layer.setup([], tops)
    return layer, tops


def _data_layer(source, transform, batch=5, count=None, extra='', phase=caffe_pb2.TRAIN,
                seed=1701):
    return _make('name: "data" type: "Data" top: "data" top: "label" '
                 'transform_param { %s } data_param { source: "%s" batch_size: %d '
                 'backend: LMDB %s }' % (transform, source, batch, extra), phase, count, seed)


def _image_layer(listfile, transform, batch=5, count=None, extra=''):
    return _make('name: "images" type: "ImageData" top: "data" top: "label" '
                 'transform_param { %s } image_data_param { source: "%s" batch_size: %d '
                 '%s }' % (transform, listfile, batch, extra), caffe_pb2.TRAIN, count)


def _run(layer, tops, n):
    out = []
    try:
        for _ in range(n):
            layer.forward([], tops)
            out.append(tuple(t.data.copy() for t in tops))
    finally:
        if hasattr(layer, 'close'):
            layer.close()
    return out


def _same_for_every_count(build, n=5):
    """Batches built with 1, 2 and 4 workers; asserts they are bit-identical."""
    results = {}
    for count in WORKER_COUNTS:
        layer, tops = build(count)
        assert layer.data_workers == count
        results[count] = _run(layer, tops, n)
    for count in WORKER_COUNTS[1:]:
        for a, b in zip(results[1], results[count]):
            for x, y in zip(a, b):
                assert x.dtype == y.dtype and x.shape == y.shape
                assert x.tobytes() == y.tobytes(), 'workers %d differ from 1' % count
    return results[1]


# -- the independent reference ----------------------------------------------------
def _reference_transform(img, do_mirror, h_off, w_off, crop, mean=None, mean_values=None,
                         scale=1.0):
    """One image, Caffe's formula in float64: crop, subtract, scale, mirror."""
    c, h, w = img.shape
    ch, cw = (crop, crop) if crop else (h, w)
    pix = img[:, h_off:h_off + ch, w_off:w_off + cw].astype(numpy.float64)
    if mean is not None:
        pix = pix - mean[:, h_off:h_off + ch, w_off:w_off + cw].astype(numpy.float64)
    elif mean_values is not None:
        pix = pix - numpy.asarray(mean_values, numpy.float64)[:, None, None]
    pix = pix * float(scale)
    return pix[:, :, ::-1] if do_mirror else pix


# -- apply_plan ------------------------------------------------------------------
@pytest.mark.parametrize('dtype', [numpy.uint8, numpy.float32])
def test_apply_plan_matches_a_float64_per_image_reference(dtype):
    rs = numpy.random.RandomState(3)
    n, c, h, w, crop = 7, 3, 13, 11, 8
    raw = (rs.randint(0, 256, (n, c, h, w)) if dtype == numpy.uint8
           else rs.uniform(-5, 300, (n, c, h, w))).astype(dtype)
    h_off = rs.randint(0, h - crop + 1, n)
    w_off = rs.randint(0, w - crop + 1, n)
    mirror = rs.randint(0, 2, n).astype(bool)
    mirror[:2] = [True, False]
    mean = rs.uniform(0, 255, (c, h, w)).astype(numpy.float32)
    scale = 0.0173
    cases = [dict(mean=mean), dict(mean_values=numpy.float32([104, 117, 123])), dict()]
    for case in cases:
        plan = bt.TransformPlan(h_off, w_off, mirror, crop, crop, scale=scale, **case)
        got = bt.apply_plan(numpy, raw, plan)
        assert got.dtype == numpy.float32 and got.shape == (n, c, crop, crop)
        for k in range(n):
            ref = _reference_transform(raw[k], mirror[k], h_off[k], w_off[k], crop,
                                       case.get('mean'), case.get('mean_values'), scale)
            numpy.testing.assert_allclose(got[k], ref, rtol=2e-6, atol=2e-6)
    # No crop: the whole image, offsets 0.
    plan = bt.TransformPlan(numpy.zeros(n), numpy.zeros(n), mirror, h, w, scale=2.0)
    got = bt.apply_plan(numpy, raw, plan)
    for k in range(n):
        numpy.testing.assert_allclose(got[k], _reference_transform(raw[k], mirror[k], 0, 0, 0,
                                                                   scale=2.0), rtol=1e-6)
    assert raw.flags.writeable and raw.dtype == dtype     # the input is left alone


def test_apply_plan_is_bit_identical_to_the_per_image_transformer():
    """The batch path and DataTransformer.transform (one image at a time)
    draw the same decisions and give the same float32 bits."""
    imgs = _images(9, (3, 17, 19))
    for text in ('crop_size: 11 mirror: true mean_value: 104 mean_value: 117 '
                 'mean_value: 123 scale: 0.017', 'mirror: true scale: 0.5',
                 'crop_size: 9 mean_value: 3'):
        param = text_format.Parse(text, caffe_pb2.TransformationParameter())
        caffeplus.rng.set_random_seed(11)
        one = DataTransformer(param, caffe_pb2.TRAIN)
        one.init_rand()
        expect = numpy.stack([one.transform(i) for i in imgs])
        caffeplus.rng.set_random_seed(11)
        batch = DataTransformer(param, caffe_pb2.TRAIN)
        batch.init_rand()
        pool = workers.WorkerPool(3)
        try:
            got = batch.transform_batch(imgs, pool=pool)
        finally:
            pool.close()
        assert got.tobytes() == expect.tobytes()


def test_apply_plan_rejects_a_plan_that_does_not_fit():
    raw = numpy.zeros((2, 3, 8, 8), numpy.uint8)
    with pytest.raises(ValueError, match='plan is for 3 images'):
        bt.apply_plan(numpy, raw, bt.TransformPlan([0, 0, 0], [0, 0, 0], [0, 0, 0], 4, 4))
    with pytest.raises(ValueError, match='larger than the images'):
        bt.apply_plan(numpy, raw, bt.TransformPlan([0, 0], [0, 0], [0, 0], 9, 9))


# -- determinism across worker counts ---------------------------------------------
TRANSFORM = 'crop_size: 16 mirror: true mean_value: 104 mean_value: 117 mean_value: 123 ' \
            'scale: 0.5'


@pytest.mark.parametrize('encode', [None, 'JPEG', 'PNG'])
def test_data_layer_batches_do_not_depend_on_the_worker_count(tmp_path, encode):
    imgs = _images(12)
    source = _write_lmdb(tmp_path / 'db', imgs, encode)
    batches = _same_for_every_count(
        lambda count: _data_layer(source, TRANSFORM, batch=5, count=count))
    # And they are what decoding each record alone and transforming it gives.
    caffeplus.rng.set_random_seed(1701)
    param = text_format.Parse(TRANSFORM, caffe_pb2.TransformationParameter())
    t = DataTransformer(param, caffe_pb2.TRAIN)
    t.init_rand()
    records = [v for _, v in db_io.open_db(source, 'lmdb').items()]
    for b, (data, label) in enumerate(batches):
        for i in range(5):
            k = (5 * b + i) % len(imgs)
            pixels = datum_io.datum_to_array(datum_io.parse_datum(records[k]))
            if encode is None:
                assert pixels.tobytes() == imgs[k].tobytes()
            assert data[i].tobytes() == t.transform(pixels).tobytes()
            assert label[i] == k % 7


def test_prefetching_starts_when_the_net_is_built_not_at_setup(tmp_path):
    """A data layer's prefetch thread starts once the net is built
    (Layer.net_ready, after "Network initialization done"), or at
    the first forward of a layer used alone; the batches are the same."""
    import logging
    from caffeplus import log
    path = str(tmp_path / 'db')
    _write_lmdb(path, _images(12))
    layer, tops = _data_layer(path, 'scale: 0.5', batch=4)
    assert layer._prefetcher._thread is None                  # set up, not started
    alone = _run(layer, tops, 2)
    text = ('name: "n" layer { name: "data" type: "Data" top: "data" top: "label" '
            'transform_param { scale: 0.5 } data_param { source: "%s" batch_size: 4 '
            'backend: LMDB } }' % path)
    started = []
    real = type(layer).net_ready

    def watch(self):
        started.append(self._prefetcher._thread)
        real(self)
        started.append(self._prefetcher._thread)
    lines = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append((record.getMessage(), len(started)))
    handler = Lines(logging.INFO)
    old_level = log.logger.level
    log.logger.addHandler(handler)
    log.logger.setLevel(logging.INFO)
    try:
        type(layer).net_ready = watch
        caffeplus.rng.set_random_seed(1701)
        net = caffeplus.Net(text_format.Parse(text, caffe_pb2.NetParameter()), caffeplus.TRAIN)
    finally:
        type(layer).net_ready = real
        log.logger.removeHandler(handler)
        log.logger.setLevel(old_level)
    assert started[0] is None and started[1] is not None and started[1].is_alive()
    # every line of the build came before, "Network initialization done" last
    assert [m for m, n in lines if n] == []
    assert lines[-1] == ('Network initialization done.', 0)
    data = net.layers[0]
    in_net = []
    for _ in range(2):
        net.forward()
        in_net.append((net.blobs['data'].data.copy(), net.blobs['label'].data.copy()))
    data.close()
    for (a, b), (c, d) in zip(alone, in_net):
        numpy.testing.assert_array_equal(a, c)
        numpy.testing.assert_array_equal(b, d)


def test_data_layer_mean_file_and_test_phase_centre_crop(tmp_path):
    imgs = _images(8)
    source = _write_lmdb(tmp_path / 'db', imgs, 'PNG')
    mean_path, mean = _write_mean(tmp_path / 'mean.binaryproto', imgs[0].shape)
    text = 'crop_size: 14 mirror: true mean_file: "%s" scale: 0.25' % mean_path
    batches = _same_for_every_count(
        lambda count: _data_layer(source, text, batch=3, count=count))
    # A TEST-phase net: centre crops, no randomness beyond the mirror.
    layer, tops = _data_layer(source, 'crop_size: 14 mean_file: "%s"' % mean_path, batch=4,
                              count=2, phase=caffe_pb2.TEST)
    (data, _), = _run(layer, tops, 1)
    for i in range(4):
        ref = _reference_transform(imgs[i], False, 3, 5, 14, mean)
        numpy.testing.assert_allclose(data[i], ref, rtol=1e-6, atol=1e-4)
    assert batches[0][0].shape == (3, 3, 14, 14)


def _write_image_list(tmp_path, imgs, fmt):
    lines = []
    for i, img in enumerate(imgs):
        name = 'img_%02d.%s' % (i, 'jpg' if fmt == 'JPEG' else 'png')
        (tmp_path / name).write_bytes(_encode(img, fmt))
        lines.append('%s %d' % (name, i))
    listfile = tmp_path / 'list.txt'
    listfile.write_text('\n'.join(lines) + '\n')
    return str(listfile)


@pytest.mark.parametrize('fmt', ['JPEG', 'PNG'])
def test_image_data_shuffle_crop_mirror_mean_do_not_depend_on_the_worker_count(tmp_path, fmt):
    imgs = _images(11)
    listfile = _write_image_list(tmp_path, imgs, fmt)
    extra = 'shuffle: true root_folder: "%s/"' % tmp_path
    batches = _same_for_every_count(
        lambda count: _image_layer(listfile, TRANSFORM, batch=4, count=count, extra=extra),
        n=6)
    # Every pass (11 images, crossed mid-batch) holds each image once.
    labels = numpy.concatenate([label for _, label in batches])
    assert sorted(labels[:11]) == list(range(11)) and sorted(labels[11:22]) == list(range(11))
    assert list(labels[:11]) != list(range(11))


def test_variable_sized_images_and_float_datums_keep_their_path(tmp_path):
    # Different sizes cropped to one: per image, same result for any count.
    imgs = _images(3, (3, 20, 24)) + _images(3, (3, 22, 18), seed=1)
    order = [0, 3, 1, 4, 2, 5]
    source = _write_lmdb(tmp_path / 'var', [imgs[i] for i in order], 'PNG')
    _same_for_every_count(lambda count: _data_layer(source, 'crop_size: 16 mirror: true',
                                                    batch=4, count=count), n=3)
    # float_data datums: float32 pixels, transformed exactly.
    floats = [numpy.random.RandomState(i).uniform(-1, 1, (2, 5, 6)).astype(numpy.float32)
              for i in range(4)]
    fsource = _write_lmdb(tmp_path / 'float', floats)
    (data, _), = _same_for_every_count(
        lambda count: _data_layer(fsource, 'scale: 3', batch=4, count=count), n=1)
    for i in range(4):
        assert data[i].tobytes() == (floats[i] * numpy.float32(3)).tobytes()


# -- resume and sharding ----------------------------------------------------------
def test_resumed_run_is_bit_identical_to_an_uninterrupted_one(tmp_path):
    imgs = _images(9)
    source = _write_lmdb(tmp_path / 'db', imgs, 'JPEG')
    whole = _run(*_data_layer(source, TRANSFORM, batch=4, count=2), n=7)
    layer, tops = _data_layer(source, TRANSFORM, batch=4, count=2)
    first = []
    for _ in range(3):
        layer.forward([], tops)
        first.append(tuple(t.data.copy() for t in tops))
    state = layer.get_state()
    layer.close()
    # A fresh layer, seeded differently, with another worker count.
    resumed, rtops = _data_layer(source, TRANSFORM, batch=4, count=4, seed=99)
    resumed.set_state(state)
    rest = _run(resumed, rtops, 4)
    for a, b in zip(whole, first + rest):
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


def test_image_data_resume_with_shuffle(tmp_path):
    listfile = _write_image_list(tmp_path, _images(7), 'PNG')
    extra = 'shuffle: true root_folder: "%s/"' % tmp_path
    whole = _run(*_image_layer(listfile, TRANSFORM, batch=3, count=2, extra=extra), n=6)
    layer, tops = _image_layer(listfile, TRANSFORM, batch=3, count=2, extra=extra)
    layer.forward([], tops)
    layer.forward([], tops)
    state = layer.get_state()
    layer.close()
    resumed, rtops = _image_layer(listfile, TRANSFORM, batch=3, count=1, extra=extra)
    resumed.set_state(state)
    rest = _run(resumed, rtops, 4)
    for a, b in zip(whole[2:], rest):
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


def test_in_place_lmdb_records_are_the_stored_bytes(tmp_path):
    """The Data layer's reader sees LMDB values in place (no copy of each
    image's bytes); keys, values, wrap-around and positions are as copied."""
    source = _write_lmdb(tmp_path / 'db', _images(3), None)
    copied = db_io.RecordReader(source, 'lmdb')
    in_place = db_io.RecordReader(source, 'lmdb', in_place=True)
    try:
        for _ in range(5):
            (k1, v1), (k2, v2) = copied.next(), in_place.next()
            assert isinstance(k2, bytes) and k1 == k2
            assert isinstance(v2, memoryview) and v2.readonly and bytes(v2) == v1
        assert in_place.state() == copied.state()
    finally:
        copied.close()
        in_place.close()


def test_sharding_by_rank_reads_interleaved_records(tmp_path):
    imgs = _images(12)
    source = _write_lmdb(tmp_path / 'db', imgs, 'PNG', labels=list(range(12)))
    world = 3
    seen = []
    for rank in range(world):
        layer, tops = _data_layer(source, 'scale: 1', batch=2, count=2)
        layer.set_shard(rank, world)
        batches = _run(layer, tops, 3)
        labels = [int(v) for _, label in batches for v in label]
        # Of every `world` consecutive records the rank-th, batch after batch.
        assert labels == [(rank + world * j) % 12 for j in range(6)]
        for (data, label) in batches:
            for i, k in enumerate(label.astype(int)):
                assert data[i].tobytes() == imgs[k].astype(numpy.float32).tobytes()
        seen += labels
    assert sorted(seen[:]) == sorted(list(range(12)) + list(range(6)))


# -- decoding --------------------------------------------------------------------
def test_libjpeg_turbo_path_decodes_the_pixels_pillow_decodes():
    """simplejpeg (the workers' JPEG path) and Pillow (the path before it, and
    the fallback) run libjpeg-turbo with the same defaults: same pixels."""
    pytest.importorskip('simplejpeg')
    rs = numpy.random.RandomState(2)
    for shape in ((3, 37, 91), (3, 64, 64), (1, 30, 41)):
        img = rs.randint(0, 256, shape).astype(numpy.uint8)
        for sub in ((0, 1, 2) if shape[0] == 3 else (0,)):
            hwc = img.transpose(1, 2, 0)
            buf = io.BytesIO()
            Image.fromarray(hwc[:, :, 0] if shape[0] == 1 else hwc).save(
                buf, 'JPEG', quality=85, subsampling=sub)
            data = buf.getvalue()
            for mode in (datum_io.COLOR, datum_io.GRAY, datum_io.UNCHANGED):
                fast = datum_io._decode_jpeg_turbo(data, mode, 'x')
                assert fast is not None
                pil = datum_io._decode_pil(Image.open(io.BytesIO(data)), mode, 'x')
                assert fast.shape == pil.shape and fast.tobytes() == pil.tobytes(), (shape, sub,
                                                                                   mode)


def test_exif_oriented_jpeg_goes_through_pillow(tmp_path):
    img = _images(1, (3, 16, 24))[0]
    exif = Image.Exif()
    exif[0x0112] = 6                         # rotate 90 degrees clockwise
    buf = io.BytesIO()
    Image.fromarray(img.transpose(1, 2, 0)).save(buf, 'JPEG', exif=exif.tobytes())
    data = buf.getvalue()
    assert datum_io._decode_jpeg_turbo(data, datum_io.COLOR, 'x') is None
    assert datum_io.decode_image(data, datum_io.COLOR).shape == (3, 24, 16)
    assert datum_io.decode_image(data, datum_io.UNCHANGED).shape == (3, 16, 24)


def _corrupt_lmdb(tmp_path, how):
    imgs = _images(6)
    source = _write_lmdb(tmp_path / 'bad_db', imgs, 'JPEG')
    env_db = db_io.open_db(source, 'lmdb', 'w')
    d = caffe_pb2.Datum(channels=3, height=20, width=24, encoded=True, label=0,
                        data=_encode(imgs[0], 'JPEG')[:60] if how == 'truncated'
                        else b'this is no image')
    env_db.put(b'00000004', d.SerializeToString())
    env_db.commit()
    env_db.close()
    return source


@pytest.mark.parametrize('how', ['truncated', 'garbage'])
def test_corrupt_record_names_database_key_and_reason(tmp_path, how):
    source = _corrupt_lmdb(tmp_path, how)
    # Other tests' nets may still hold idle worker threads: only this test's
    # must be gone at the end.
    before = set(threading.enumerate())
    for count in (1, 3):
        layer, tops = _data_layer(source, 'scale: 1', batch=2, count=count)
        try:
            layer.forward([], tops)
            layer.forward([], tops)
            with pytest.raises(CaffeplusError) as err:
                layer.forward([], tops)
            text = str(err.value)
            assert 'datum 00000004' in text and source in text
            assert 'cannot decode image' in text or 'cannot open image' in text
            # The workers were told to stop: no thread of the layer lingers.
            deadline = time.monotonic() + STOP_DEADLINE_S
            while layer.workers.running and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not layer.workers.running
        finally:
            layer.close()
    assert not [t for t in set(threading.enumerate()) - before
                if t.name.startswith('caffeplus-data-')]


def test_corrupt_image_file_names_list_line_and_reason(tmp_path):
    listfile = _write_image_list(tmp_path, _images(5), 'JPEG')
    (tmp_path / 'img_03.jpg').write_bytes(_encode(_images(1)[0], 'JPEG')[:100])
    for count in (1, 4):
        layer, tops = _image_layer(listfile, 'scale: 1', batch=5, count=count,
                                   extra='root_folder: "%s/"' % tmp_path)
        try:
            with pytest.raises(CaffeplusError) as err:
                layer.forward([], tops)
        finally:
            layer.close()
        text = str(err.value)
        assert 'img_03.jpg' in text and 'line 4 of image list %s' % listfile in text
        assert 'cannot' in text and 'truncated' in text.lower()


_SCRIPT = textwrap.dedent('''
    import sys
    sys.path.insert(0, {repo!r})
    from google.protobuf import text_format
    from caffeplus.blob import Blob
    from caffeplus.io import workers
    from caffeplus.layer import create_layer
    from caffeplus.proto import caffe_pb2
    lp = text_format.Parse({layer!r}, caffe_pb2.LayerParameter())
    layer = create_layer(lp)
    tops = [Blob(), Blob()]
    with workers.setting(4):
        layer.setup([], tops)
    layer.forward([], tops)
    print('READY', flush=True)
    while True:
        layer.forward([], tops)
''')


def _script(source, batch=4):
    text = ('name: "data" type: "Data" top: "data" top: "label" transform_param { crop_size: '
            '16 mirror: true } data_param { source: "%s" batch_size: %d backend: LMDB }'
            % (source, batch))
    return _SCRIPT.format(repo=REPO, layer=text)


def test_corrupt_record_stops_a_process_with_the_error_not_a_hang(tmp_path):
    source = _corrupt_lmdb(tmp_path, 'garbage')
    proc = subprocess.run([sys.executable, '-c', _script(source, batch=3)], cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=STOP_DEADLINE_S)
    assert proc.returncode != 0
    assert 'READY' in proc.stdout
    assert 'datum 00000004 of %s' % source in proc.stderr
    assert 'cannot' in proc.stderr


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_a_process_with_busy_workers(tmp_path, sig):
    source = _write_lmdb(tmp_path / 'db', _images(16), 'JPEG')
    # The log goes to a file: a pipe nobody reads fills up (a line every
    # pass over the 16 records) and the child then blocks writing, signal or
    # not, when the machine is slow to deliver it.
    with open(tmp_path / 'stderr.log', 'w') as log_file:
        # SIGINT as an interactive shell leaves it: a test run started in
        # the background by a non-interactive shell inherits it ignored, and
        # so would the child.
        proc = subprocess.Popen([sys.executable, '-c', _script(source)], cwd=str(tmp_path),
                                stdout=subprocess.PIPE, stderr=log_file, text=True,
                                preexec_fn=_default_sigint)
        try:
            assert proc.stdout.readline().strip() == 'READY'
            proc.send_signal(sig)
            try:
                proc.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                raise AssertionError('no exit %d s after signal %d; its log ends:\n%s' % (
                    STOP_DEADLINE_S, sig, (tmp_path / 'stderr.log').read_text()[-3000:]))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
    assert proc.returncode != 0


# -- settings --------------------------------------------------------------------
def test_data_workers_field_in_the_schema():
    solver = text_format.Parse('caffeplus_param { data_workers: 3 }',
                               caffe_pb2.SolverParameter())
    net = text_format.Parse('caffeplus_param { data_workers: 5 }', caffe_pb2.NetParameter())
    assert solver.caffeplus_param.data_workers == 3 and net.caffeplus_param.data_workers == 5
    fields = caffe_pb2.CaffeplusSolverParameter.DESCRIPTOR.fields_by_name
    assert fields['data_workers'].number == 16
    assert caffe_pb2.CaffeplusNetParameter.DESCRIPTOR.fields_by_name[
        'data_workers'].number == 16
    assert workers.proto_value(solver) == 3 and workers.proto_value(net) == 5
    assert workers.proto_value(caffe_pb2.SolverParameter()) is None


def test_worker_count_precedence(monkeypatch):
    from caffeplus import config
    monkeypatch.delenv(workers.ENV_VAR, raising=False)
    assert workers.resolve() == workers.host_cores()
    monkeypatch.setenv(workers.ENV_VAR, '7')
    config.reload_environment()             # (read once a process otherwise)
    assert workers.resolve() == 7
    with workers.setting(3):                # the solver's
        assert workers.resolve() == 3
        with workers.setting(5):            # the net's
            assert workers.resolve() == 5
        with workers.setting(None):         # a net without the field
            assert workers.resolve() == 3
    with workers.setting(2, cli=True):      # --data_workers over both
        with workers.setting(3), workers.setting(5):
            assert workers.resolve() == 2
    monkeypatch.setenv(workers.ENV_VAR, 'many')
    config.reload_environment()
    with pytest.raises(CaffeplusError, match=workers.ENV_VAR):
        workers.resolve()


def _lenet_with_data(tmp_path, source, net_extra=''):
    net = tmp_path / 'net.prototxt'
    net.write_text(textwrap.dedent('''
        name: "tiny" %s
        layer { name: "data" type: "Data" top: "data" top: "label"
                transform_param { crop_size: 16 mirror: true scale: 0.01 }
                data_param { source: "%s" batch_size: 4 backend: LMDB } }
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
                inner_product_param { num_output: 7 weight_filler { type: "xavier" } } }
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label"
                top: "loss" }
    ''' % (net_extra, source)))
    return str(net)


def test_solver_and_net_fields_reach_train_and_test_data_layers(tmp_path, monkeypatch):
    monkeypatch.delenv(workers.ENV_VAR, raising=False)
    source = _write_lmdb(tmp_path / 'db', _images(10), 'JPEG')
    net = _lenet_with_data(tmp_path, source)
    param = text_format.Parse('net: "%s" base_lr: 0.01 lr_policy: "fixed" max_iter: 2 '
                              'test_iter: 1 test_interval: 100 display: 0 '
                              'caffeplus_param { data_workers: 3 }' % net,
                              caffe_pb2.SolverParameter())
    from caffeplus.solver import get_solver
    solver = get_solver(param)
    try:
        assert solver.net.layers[0].data_workers == 3
        assert solver.test_nets[0].layers[0].data_workers == 3
        solver.step(1)
        solver.test_all()
    finally:
        for n in [solver.net] + list(solver.test_nets):
            n.layers[0].close()
    own = caffeplus.Net(_lenet_with_data(tmp_path, source, 'caffeplus_param { data_workers: '
                                         '2 }'), caffe_pb2.TEST)
    assert own.layers[0].data_workers == 2
    own.layers[0].close()


def test_cli_data_workers_flag(tmp_path):
    from caffeplus import cli
    source = _write_lmdb(tmp_path / 'db', _images(10), 'JPEG')
    net = _lenet_with_data(tmp_path, source)
    parser = cli.build_parser()
    for command in ('train', 'test', 'time'):
        args = parser.parse_args([command, '--data_workers', '3'])
        assert args.data_workers == 3
    assert cli.main(['time', '-model', net, '-iterations', '2', '--data_workers', '-1']) == 1
    args = parser.parse_args(['train', '--solver', 's.prototxt', '--data_workers', '3'])
    from caffeplus.commands.train import build_solver_param
    solver_file = tmp_path / 's.prototxt'
    solver_file.write_text('net: "%s" base_lr: 0.1 lr_policy: "fixed"' % net)
    args.solver = str(solver_file)
    assert build_solver_param(args).caffeplus_param.data_workers == 3


def test_time_shows_the_data_layer_apart(tmp_path, caplog_caffeplus):
    from caffeplus import cli
    source = _write_lmdb(tmp_path / 'db', _images(10), 'JPEG')
    net = _lenet_with_data(tmp_path, source, 'caffeplus_param { data_workers: 3 }')
    assert cli.main(['time', '-model', net, '-iterations', '2', '--data_workers', '2']) == 0
    wait = [m for m in caplog_caffeplus if 'prefetch wait:' in m]
    split = [m for m in caplog_caffeplus if 'read and decode:' in m]
    assert len(wait) == 1 and wait[0].split()[0] == 'data'
    assert len(split) == 1 and '2 data workers' in split[0] and 'transform:' in split[0]
    assert any(m.strip().startswith('data\tforward:') for m in caplog_caffeplus)


# -- the waiting warning -----------------------------------------------------------
def test_warning_when_the_net_waits_for_data(tmp_path, caplog_caffeplus, monkeypatch):
    from caffeplus.layers import data as data_layers
    monkeypatch.setattr(data_layers, 'DATA_WAIT_WINDOW', 4)
    monkeypatch.setattr(data_layers, 'DATA_WAIT_WARN_EVERY', 10)
    monkeypatch.setattr(workers, 'host_cores', lambda: 8)
    source = _write_lmdb(tmp_path / 'db', _images(8), 'PNG')
    layer, tops = _data_layer(source, 'scale: 1', batch=2, count=2)
    slow = layer.source.decode

    def slow_decode(record):
        time.sleep(0.02)                  # a starved pipeline: decoding is the bottleneck
        return slow(record)
    layer.source.decode = slow_decode
    try:
        for _ in range(30):
            layer.forward([], tops)
    finally:
        layer.close()
    warnings = [m for m in caplog_caffeplus if 'is slowing the net down' in m]
    # Once, then again only after DATA_WAIT_WARN_EVERY forwards: 30 forwards, 3 lines.
    assert 2 <= len(warnings) <= 3
    assert 'Data layer data' in warnings[0] and '--data_workers' in warnings[0]
    assert 'with 2 data workers' in warnings[0] and 'this host has 8 cores' in warnings[0]
    # With as many workers as cores, the advice says so instead.
    monkeypatch.setattr(workers, 'host_cores', lambda: 2)
    assert data_layers.DataTiming(layer).warn_if_starved(10, 0.5, 1.0, 0.6)
    assert 'already match this host\'s 2 cores' in caplog_caffeplus[-1]


def test_no_warning_when_the_data_keeps_up(tmp_path, caplog_caffeplus, monkeypatch):
    from caffeplus.layers import data as data_layers
    monkeypatch.setattr(data_layers, 'DATA_WAIT_WINDOW', 4)
    source = _write_lmdb(tmp_path / 'db', _images(8), None)
    layer, tops = _data_layer(source, 'scale: 1', batch=2, count=2)
    try:
        for _ in range(13):
            # The "net" is slow, so batches are ready; the pause is long enough
            # that a loaded CI host's scheduling stalls stay under 10% of it.
            time.sleep(0.2)
            layer.forward([], tops)
    finally:
        layer.close()
    assert not [m for m in caplog_caffeplus if 'is slowing the net down' in m]


# -- reading Datums in place --------------------------------------------------------
def _fields(d):
    return (d.channels, d.height, d.width, d.label, bool(d.encoded), bytes(d.data))


def test_datum_view_reads_what_protobuf_reads():
    rs = numpy.random.RandomState(4)
    samples = [datum_io.array_to_datum(rs.randint(0, 256, (3, 5, 4)).astype(numpy.uint8), -3),
               caffe_pb2.Datum(channels=1, height=2, width=2, data=b'abcd', label=2 ** 31 - 1),
               caffe_pb2.Datum(encoded=True, data=_encode(_images(1)[0], 'PNG'), label=7),
               caffe_pb2.Datum()]
    serialized = [d.SerializeToString() for d in samples]
    # Fields repeated (the last counts) and out of order, as protobuf allows.
    serialized.append(serialized[1] + caffe_pb2.Datum(label=-9, data=b'wxyz')
                      .SerializeToString())
    for s in serialized:
        view = datum_io.view_datum(s)
        assert view is not None
        assert _fields(view) == _fields(datum_io.parse_datum(s))
    # float_data takes protobuf's path.
    floats = datum_io.array_to_datum(numpy.ones((1, 2, 2), numpy.float32)).SerializeToString()
    assert datum_io.view_datum(floats) is None
    assert isinstance(datum_io.read_datum(floats), caffe_pb2.Datum)
    # Damaged records: whatever the view accepts, protobuf reads the same way.
    accepted = 0
    for trial in range(400):
        s = bytearray(serialized[trial % 3])
        for _ in range(1 + trial % 3):
            s[rs.randint(len(s))] = rs.randint(256)
        s = bytes(s[:len(s) - (trial % 5)])
        view = datum_io.view_datum(s)
        if view is None:
            continue
        accepted += 1
        try:
            parsed = datum_io.parse_datum(s)
        except CaffeplusError:
            raise AssertionError('view accepted a record protobuf rejects: %r' % s)
        assert _fields(view) == _fields(parsed)
    assert accepted > 50


def test_memory_data_decodes_added_datums_on_the_workers(tmp_path):
    imgs = _images(6)
    datums = [caffe_pb2.Datum(channels=3, height=20, width=24, encoded=True, label=i,
                              data=_encode(img, 'PNG')) for i, img in enumerate(imgs)]
    results = []
    for count in WORKER_COUNTS:
        layer, tops = _make('name: "m" type: "MemoryData" top: "data" top: "label" '
                            'transform_param { crop_size: 16 mirror: true scale: 0.5 } '
                            'memory_data_param { batch_size: 3 channels: 3 height: 16 '
                            'width: 16 }', count=count)
        assert layer.data_workers == count
        layer.add_datum_vector(datums)
        results.append([b[0] for b in _run(layer, tops, 2)])
    for other in results[1:]:
        assert all(a.tobytes() == b.tobytes() for a, b in zip(results[0], other))
    caffeplus.rng.set_random_seed(1701)
    t = DataTransformer(text_format.Parse('crop_size: 16 mirror: true scale: 0.5',
                                          caffe_pb2.TransformationParameter()))
    t.init_rand()
    expect = numpy.stack([t.transform(img) for img in imgs])
    assert numpy.concatenate(results[0]).tobytes() == expect.tobytes()


def test_hdf5_data_batches_across_files_match_row_by_row(tmp_path):
    h5py = pytest.importorskip('h5py')
    rs = numpy.random.RandomState(8)
    files, rows = [], []
    for k, n in enumerate((5, 3, 4)):
        data = rs.uniform(-1, 1, (n, 2, 3)).astype(numpy.float32)
        path = tmp_path / ('part%d.h5' % k)
        with h5py.File(str(path), 'w') as f:
            f['data'] = data
            f['label'] = numpy.arange(n, dtype=numpy.float32) + 10 * k
        files.append(str(path))
        rows.append(data)
    listfile = tmp_path / 'list.txt'
    listfile.write_text('\n'.join(files) + '\n')
    layer, tops = _make('name: "h" type: "HDF5Data" top: "data" top: "label" '
                        'hdf5_data_param { source: "%s" batch_size: 5 }' % listfile)
    got = _run(layer, tops, 4)
    order = [(k, i) for k in range(3) for i in range(len(rows[k]))]
    for b, (data, label) in enumerate(got):
        for i in range(5):
            k, r = order[(5 * b + i) % len(order)]
            assert label[i] == 10 * k + r
            assert data[i].tobytes() == rows[k][r].tobytes()


@pytest.mark.parametrize('crop,mirror,phase', [(5, True, 'TRAIN'), (5, False, 'TRAIN'),
                                               (0, True, 'TRAIN'), (5, True, 'TEST'),
                                               (0, False, 'TRAIN')])
def test_one_call_draws_what_draw_after_draw_gives(crop, mirror, phase):
    """plan_stacked draws a batch's decisions in one generator call; they
    must be those of drawing image by image (and leave the generator where
    image-by-image drawing leaves it)."""
    import caffeplus
    from caffeplus.io.transformer import DataTransformer
    from caffeplus.proto import caffe_pb2
    tp = caffe_pb2.TransformationParameter(crop_size=crop, mirror=mirror)
    ph = caffeplus.TRAIN if phase == 'TRAIN' else caffeplus.TEST
    one, many = DataTransformer(tp, ph), DataTransformer(tp, ph)
    one.init_rand()
    many._rng = numpy.random.Generator(numpy.random.PCG64(0))
    one._rng = numpy.random.Generator(numpy.random.PCG64(0))
    shape = (3, 9, 11)
    for n in (1, 7, 16):
        want = [one.draw(shape) for _ in range(n)]
        got = many.draw_many(n, shape)
        assert [tuple(map(int, d)) for d in got] == [tuple(map(int, d)) for d in want]
        plan = many.plan(got, shape)
        assert plan.mirror.tolist() == [bool(d[0]) for d in want]
    assert one.rand(1000) == many.rand(1000)


@pytest.mark.parametrize('count', [1, 2, 3, 8])
def test_map_chunked_keeps_order_and_raises_the_first_failure(count):
    from caffeplus.io.workers import WorkerPool
    pool = WorkerPool(count)
    try:
        assert pool.map_chunked(lambda x: x * x, range(23)) == [x * x for x in range(23)]

        def fails_at(x):
            if x in (17, 9, 21):
                raise ValueError('item %d' % x)
            return x
        with pytest.raises(ValueError, match='item 9'):
            pool.map_chunked(fails_at, range(23))
        assert pool.map_chunked(str, []) == []
    finally:
        pool.close()


@pytest.mark.parametrize('where', ['prefetch thread', 'worker'])
def test_a_data_layer_finalized_inside_its_loading_closes_its_database_after(tmp_path, where):
    """The collector can finalize a data layer in the thread loading its
    batch, or in a worker decoding for it (the CI suite crashed in
    caffeplus/io/datum.py: a worker read a record's view of an LMDB closed
    under it). The database closes once the batch in hand is loaded, never
    during it, and nothing waits on itself."""
    import threading
    path = str(tmp_path / 'db')
    _write_lmdb(path, _images(12))
    layer, tops = _data_layer(path, 'scale: 0.5', batch=4, count=2)
    source, events = layer.source, []
    real_close, real_load, real_decode = source.close, source.load_batch, source._decode_item

    def close():
        events.append('close')
        real_close()

    def finalize():
        layer.close()           # what the layer's finalizer runs
        events.append('finalized in %s' % where)

    loader = []

    def load():
        loader.append(threading.current_thread())
        if where == 'prefetch thread' and not events:
            finalize()
        batch = real_load()     # its records: views of the open database
        events.append('loaded')
        return batch

    def decode(record):
        if where == 'worker' and not events and threading.current_thread().name.startswith(
                'caffeplus-data-worker'):
            finalize()
        return real_decode(record)
    source.close, source.load_batch, source._decode_item = close, load, decode
    layer._prefetcher.start()
    for _ in range(3000):
        if loader:
            break
        time.sleep(0.01)
    loader[0].join(30)
    assert not loader[0].is_alive()
    assert events == ['finalized in %s' % where, 'loaded', 'close']
    assert not layer.workers.running


def test_stopping_the_prefetcher_from_its_own_thread_does_not_raise():
    """A data layer collected by a garbage collection that the prefetch
    thread triggered is finalized in that thread: stopping must not try to
    join the thread it runs in."""
    import threading
    from caffeplus.io.prefetch import Prefetcher

    class Source:
        def load_batch(self):
            return object()
    pre = Prefetcher(Source(), 1, 'test')
    pre.start()
    errors = []
    pre._thread.join(timeout=0)           # started
    done = threading.Event()

    def stop_here():
        try:
            pre.stop()
        except BaseException as exc:
            errors.append(exc)
        done.set()
    pre._thread = threading.Thread(target=stop_here)
    pre._thread.start()
    assert done.wait(30)
    assert errors == []
