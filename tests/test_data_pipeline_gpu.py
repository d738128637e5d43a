"""Data and ImageData in GPU mode: the uint8 batch goes to the device and is
transformed there (caffeplus.io.device_transform.DeviceStager); the batches
must be the CPU path's bit for bit, for any worker count, across a resume,
and the staging memory must stay bounded however many batches pass."""
import gc
import numpy
import pytest

import caffeplus
from caffeplus.io import device_transform
from test_data_pipeline import (TRANSFORM, _data_layer, _image_layer, _images, _write_image_list,
                                _write_lmdb, _write_mean)

pytestmark = pytest.mark.gpu


def _host(a):
    return a.get() if hasattr(a, 'get') else numpy.asarray(a)


def _batches(layer, tops, n, close=True):
    out = []
    try:
        for _ in range(n):
            layer.forward([], tops)
            out.append(tuple(_host(t.data).copy() for t in tops))
    finally:
        if close:
            layer.close()
    return out


def _cpu_then_gpu(build, counts=(1, 4), n=5):
    """The CPU batches (one worker), then the GPU batches for each count;
    asserts the GPU layers took the device path."""
    caffeplus.set_mode_cpu()
    layer, tops = build(1)
    assert layer.stager is None
    want = _batches(layer, tops, n)
    caffeplus.set_mode_gpu()
    got = {}
    for count in counts:
        layer, tops = build(count)
        assert isinstance(layer.stager, device_transform.DeviceStager)
        got[count] = _batches(layer, tops, n)
    return want, got


def _assert_same(want, got):
    for count, batches in got.items():
        assert len(batches) == len(want)
        for b, (w, g) in enumerate(zip(want, batches)):
            for x, y in zip(w, g):
                assert x.shape == y.shape and x.dtype == y.dtype
                assert x.tobytes() == y.tobytes(), 'batch %d, %d workers' % (b, count)


@pytest.mark.parametrize('encode', [None, 'JPEG'])
def test_data_gpu_batches_are_the_cpu_batches(tmp_path, gpu, encode):
    imgs = _images(13)
    source = _write_lmdb(tmp_path / 'db', imgs, encode)
    mean_path, _ = _write_mean(tmp_path / 'mean.binaryproto', imgs[0].shape)
    for transform in (TRANSFORM, 'crop_size: 14 mirror: true mean_file: "%s" scale: 0.25'
                      % mean_path, 'mirror: true'):
        want, got = _cpu_then_gpu(
            lambda count: _data_layer(source, transform, batch=5, count=count))
        _assert_same(want, got)


def test_image_data_gpu_batches_are_the_cpu_batches(tmp_path, gpu):
    imgs = _images(11)
    listfile = _write_image_list(tmp_path, imgs, 'JPEG')
    mean_path, _ = _write_mean(tmp_path / 'mean.binaryproto', imgs[0].shape)
    extra = 'shuffle: true root_folder: "%s/"' % tmp_path
    for transform in (TRANSFORM, 'crop_size: 12 mirror: true mean_file: "%s"' % mean_path):
        want, got = _cpu_then_gpu(
            lambda count: _image_layer(listfile, transform, batch=4, count=count, extra=extra),
            n=6)
        _assert_same(want, got)


def test_float_datums_and_variable_shapes_keep_the_host_path(tmp_path, gpu):
    floats = [numpy.random.RandomState(i).uniform(-1, 1, (2, 5, 6)).astype(numpy.float32)
              for i in range(4)]
    layer, tops = _data_layer(_write_lmdb(tmp_path / 'float', floats), 'scale: 3', batch=4)
    (data, _), = _batches(layer, tops, 1)
    for i in range(4):
        assert data[i].tobytes() == (floats[i] * numpy.float32(3)).tobytes()


def test_gpu_resume_is_bit_identical(tmp_path, gpu):
    source = _write_lmdb(tmp_path / 'db', _images(9), 'JPEG')
    whole = _batches(*_data_layer(source, TRANSFORM, batch=4, count=2), n=7)
    layer, tops = _data_layer(source, TRANSFORM, batch=4, count=2)
    first = _batches(layer, tops, 3, close=False)
    state = layer.get_state()
    layer.close()
    resumed, rtops = _data_layer(source, TRANSFORM, batch=4, count=4, seed=99)
    resumed.set_state(state)
    _assert_same(whole, {4: first + _batches(resumed, rtops, 4)})


def test_staging_memory_stays_bounded(tmp_path, gpu):
    """Many batches, and restores that drop batches loaded ahead: the pinned
    buffers and device slots do not grow, nor CuPy's pools."""
    cupy = gpu
    source = _write_lmdb(tmp_path / 'db', _images(10), None)
    layer, tops = _data_layer(source, TRANSFORM, batch=4, count=2)
    try:
        _batches(layer, tops, 10, close=False)
        # What earlier tests left for the collector is freed now, not
        # while this test counts the pools.
        gc.collect()
        cupy.cuda.Device().synchronize()
        pool, pinned = cupy.get_default_memory_pool(), cupy.get_default_pinned_memory_pool()
        used, pinned_free = pool.used_bytes(), pinned.n_free_blocks()
        slots = len(layer.stager.slots)
        for k in range(8):
            _batches(layer, tops, 20, close=False)
            layer.set_state(layer.get_state())
        cupy.cuda.Device().synchronize()
        prefetch = layer.layer_param.data_param.prefetch
        assert slots <= len(layer.stager.slots) <= prefetch + 2
        assert layer.stager.pinned_buffers == 2
        # A restore may leave slots in flight, so that a few more are made
        # (bounded above); beyond their bytes (CuPy rounds to 512) the pool
        # holds nothing new.
        slot_bytes = -(-layer.stager.layout.nbytes // 512) * 512
        grown = len(layer.stager.slots) - slots
        assert pool.used_bytes() <= used + grown * slot_bytes + 1024
        assert pinned.n_free_blocks() == pinned_free
    finally:
        layer.close()


def test_data_on_host_setting_keeps_the_host_transform(tmp_path, gpu, monkeypatch):
    from caffeplus.layers import data as data_layers
    monkeypatch.setattr(data_layers, 'TRANSFORM_ON_HOST', True)
    source = _write_lmdb(tmp_path / 'db', _images(6), None)
    layer, tops = _data_layer(source, TRANSFORM, batch=3)
    assert layer.stager is None
    layer.close()
