"""Dropout's GPU kernels (caffeplus.kernels cp_dropout_fwd / cp_dropout_bwd):
the mask drawn from Philox4x32-10 with its state on the device, checked
against a NumPy Philox (itself checked against Random123's known answers)
with the kernels emulated on the host, and on the GPU."""
import numpy
import pytest

import caffeplus
from caffeplus.proto import caffe_pb2
from caffeplus.layer import create_layer

F32 = numpy.float32
_LOW = numpy.uint64(0xffffffff)


def philox4x32_10(counter, key):
    """Philox4x32-10 of counters (four uint32 arrays) under key (two uint32)."""
    c = [numpy.asarray(x, numpy.uint64) for x in counter]
    k0, k1 = numpy.uint64(key[0]), numpy.uint64(key[1])
    for _ in range(10):
        p0, p1 = numpy.uint64(0xD2511F53) * c[0], numpy.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> numpy.uint64(32)) ^ c[1] ^ k0, p1 & _LOW,
             (p0 >> numpy.uint64(32)) ^ c[3] ^ k1, p0 & _LOW]
        k0, k1 = (k0 + numpy.uint64(0x9E3779B9)) & _LOW, (k1 + numpy.uint64(0xBB67AE85)) & _LOW
    return [x.astype(numpy.uint32) for x in c]


def reference_dropout(x, seed, offset, ratio):
    """(y, mask) as Caffe's Dropout with u from word i of Philox at counter
    (i / 4, offset), key seed."""
    i = numpy.arange(x.size, dtype=numpy.uint64)
    words = philox4x32_10([i >> numpy.uint64(2), i >> numpy.uint64(34),
                           numpy.full_like(i, offset & 0xffffffff),
                           numpy.full_like(i, offset >> 32)],
                          [seed & 0xffffffff, seed >> 32])
    word = numpy.choose((i & numpy.uint64(3)).astype(numpy.intp), words)
    u = (word >> 8).astype(F32) * F32(1.0 / 16777216.0)
    mask = u >= F32(ratio)
    scale = F32(1.0 / (1.0 - float(F32(ratio))))
    with numpy.errstate(invalid='ignore'):      # (inf * 0: NaN, as the kernel's)
        y = x.ravel() * mask.astype(F32) * scale
    return y.reshape(x.shape), mask.reshape(x.shape)


def test_numpy_philox_gives_random123s_known_answers():
    full = 0xffffffff
    cases = [([0, 0, 0, 0], [0, 0], [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]),
             ([full] * 4, [full, full], [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]),
             ([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0],
              [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1])]
    for counter, key, words in cases:
        assert [int(w) for w in philox4x32_10(counter, key)] == words


def _dropout(ratio):
    lp = caffe_pb2.LayerParameter(name='drop', type='Dropout')
    lp.dropout_param.dropout_ratio = ratio
    lp.phase = caffe_pb2.TRAIN
    return create_layer(lp)


def _run(layer, x, dy):
    from caffeplus.blob import Blob
    bottom, top = Blob(x.shape), Blob(x.shape)
    bottom.data[...] = x
    layer.setup([bottom], [top])
    layer.forward([bottom], [top])
    top.diff[...] = dy
    layer.backward([top], [True], [bottom])
    return top.data.copy(), layer.mask, bottom.diff


def test_the_kernels_draw_philox_masks_and_move_the_offset(emulated):
    from caffeplus.layers import neuron
    caffeplus.set_random_seed(11)
    r = numpy.random.default_rng(3)
    x = r.standard_normal((3, 5, 7, 11)).astype(F32)
    dy = r.standard_normal(x.shape).astype(F32)
    x.ravel()[:4] = [numpy.nan, -0.0, numpy.inf, -1.0]
    layer = _dropout(0.3)
    state = neuron._philox_state()
    seed, offset = int(state[0]), int(state[1])
    for step in range(2):
        y, mask, dx = _run(layer, x, dy)
        ref_y, ref_mask = reference_dropout(x, seed, offset + step, 0.3)
        numpy.testing.assert_array_equal(mask, ref_mask)
        assert y.tobytes() == ref_y.astype(F32).tobytes()       # NaN, signed zeros too
        ref_dx = dy * ref_mask.astype(F32) * F32(1 / (1 - F32(0.3)))
        assert numpy.asarray(dx).tobytes() == ref_dx.astype(F32).tobytes()
        assert int(state[1]) == offset + step + 1
    assert abs(mask.mean() - 0.7) < 0.05


def test_a_new_seed_draws_again_from_its_start(emulated):
    from caffeplus.layers import neuron
    x = numpy.ones((40, 50), F32)
    dy = numpy.ones_like(x)
    masks = []
    for seed in (5, 5, 6):
        caffeplus.set_random_seed(seed)
        masks.append(_run(_dropout(0.5), x, dy)[1].copy())
        assert int(neuron._philox_state()[1]) == 1
    assert numpy.array_equal(masks[0], masks[1]) and not numpy.array_equal(masks[0], masks[2])


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', ['float32', 'float16'])
def test_on_the_gpu_the_masks_are_numpy_philoxs(gpu, dtype):
    from caffeplus.layers import neuron
    caffeplus.set_random_seed(11)
    x = numpy.random.default_rng(4).standard_normal((64, 4096)).astype(F32)
    layer = _dropout(0.5)
    from caffeplus.blob import Blob
    bottom, top = Blob(x.shape), Blob(x.shape)
    if dtype == 'float16':
        bottom._data.dtype = top._data.dtype = bottom._diff.dtype = top._diff.dtype = \
            numpy.dtype('float16')
    bottom.data[...] = gpu.asarray(x)
    layer.setup([bottom], [top])
    state = neuron._philox_state()
    seed, offset = int(state[0].get()), int(state[1].get())
    layer.forward([bottom], [top])
    ref_y, ref_mask = reference_dropout(x.astype(dtype).astype(F32), seed, offset, 0.5)
    numpy.testing.assert_array_equal(layer.mask.get(), ref_mask)
    assert top.data.get().tobytes() == ref_y.astype(dtype).tobytes()
    assert int(state[1].get()) == offset + 1
