"""The kernels that move 16-bit maps between layouts and sum them per
channel: caffeplus.kernels.transpose (a map between Caffe's order and
channels-last, an image padded to 4 channels), copy_rows (Concat's bottoms
into their column ranges of its top) and channel_sums_nhwc (a channels-last
convolution's bias gradient). Each against NumPy: the moves bit for bit
(NaN payloads included), the sums against float64. Emulated on the host
(dev/kernel_emu.py) at small sizes, and on the GPU at the bench nets' sizes."""
import numpy
import pytest

from caffeplus import kernels
from conftest import emulating


def _bits(rng, shape, itemsize):
    """Random values of 2 or 4 bytes as any bit pattern (NaNs and
    infinities included), as float16 or float32 arrays."""
    kind = numpy.uint16 if itemsize == 2 else numpy.uint32
    info = numpy.iinfo(kind)
    raw = rng.integers(0, info.max, size=shape, dtype=kind, endpoint=True)
    return raw.view(numpy.float16 if itemsize == 2 else numpy.float32)


def _same_bits(a, b):
    assert a.shape == b.shape
    assert a.tobytes() == b.tobytes()


# (n, a, b, lds, ldd, pad): dst (n, b, ldd)[..., :a] = src (n, a, lds)[..., :b].T
TRANSPOSES = [
    (2, 37, 45, None, None, False),     # tiles cut at both edges
    (1, 64, 32, None, None, False),     # whole tiles
    (3, 3, 50, None, 4, True),          # an image padded to 4 channels
    (2, 50, 3, 4, None, False),         # the padded image's diff back
    (1, 1, 1, None, None, False),
    # dst rows of up to kernels.NARROW_ROWS values (cp_transpose_narrow):
    (2, 5, 40, None, 8, False),         # past a left as it was
    (2, 6, 33, 40, None, False),        # src rows longer than b
    (2, 9, 33, None, None, False),      # just past it: tiles
]


def _transpose_case(xp, rng, itemsize, n, a, b, lds, ldd, pad):
    lds_, ldd_ = lds or b, ldd or a
    src = _bits(rng, (n, a, lds_), itemsize)
    # The destination starts as NaN bits: every value the call must write
    # (padding included) is then checked, and none past it is touched.
    fill = numpy.uint16(0x7e01) if itemsize == 2 else numpy.uint32(0x7fc00001)
    dst = numpy.full((n, b, ldd_), fill).view(src.dtype)
    out = xp.asarray(dst.reshape(-1))
    kernels.transpose(xp.asarray(src.reshape(-1)), out, n, a, b, lds=lds, ldd=ldd, pad=pad)
    got = numpy.asarray(out.get() if hasattr(out, 'get') else out).reshape(dst.shape)
    want = dst.copy()
    want[:, :, :a] = src[:, :, :b].transpose(0, 2, 1)
    if pad:
        want[:, :, a:] = 0
    _same_bits(got, want)


@pytest.mark.parametrize('itemsize', [2, 4])
@pytest.mark.parametrize('case', TRANSPOSES)
def test_a_transpose_moves_every_value_bit_for_bit(emulator, itemsize, case):
    with emulating(emulator):
        _transpose_case(numpy, numpy.random.default_rng(sum(case[:3])), itemsize, *case)


def test_a_transpose_refuses_values_it_cannot_move(emulator):
    with emulating(emulator):
        with pytest.raises(TypeError, match='2- or 4-byte'):
            kernels.transpose(numpy.zeros(4), numpy.zeros(4), 1, 2, 2)


# (rows, width, src_off, src_pitch, dst_off, dst_pitch) in bytes: 16-byte
# rows, then addresses, pitches or widths that allow 8, 4, 2 and 1 bytes.
ROW_COPIES = [
    (5, 32, 0, 32, 16, 96),
    (7, 24, 8, 24, 0, 40),
    (3, 12, 4, 12, 12, 28),
    (4, 6, 2, 10, 6, 14),
    (6, 5, 1, 5, 3, 11),
    (1, 48, 0, 48, 0, 48),
]


def _row_copy_case(xp, rows, width, src_off, src_pitch, dst_off, dst_pitch):
    rng = numpy.random.default_rng(rows * width)
    src = rng.integers(0, 256, size=src_off + rows * src_pitch, dtype=numpy.uint8)
    dst = rng.integers(0, 256, size=dst_off + rows * dst_pitch, dtype=numpy.uint8)
    out = xp.asarray(dst)
    kernels.copy_rows(xp.asarray(src), src_off, src_pitch, out, dst_off, dst_pitch, width, rows)
    want = dst.copy()
    for r in range(rows):
        want[dst_off + r * dst_pitch:dst_off + r * dst_pitch + width] = \
            src[src_off + r * src_pitch:src_off + r * src_pitch + width]
    _same_bits(numpy.asarray(out.get() if hasattr(out, 'get') else out), want)


@pytest.mark.parametrize('case', ROW_COPIES)
def test_rows_are_copied_into_their_columns_and_nothing_else(emulator, case):
    with emulating(emulator):
        _row_copy_case(numpy, *case)


def test_rows_past_the_kernels_count_are_copied_in_pieces(emulator, monkeypatch):
    """A copy of 2**32 bytes or more runs in launches of fewer (the kernel
    counts in 32 bits); here the bound is cut to two rows of 16 bytes."""
    monkeypatch.setattr(kernels, 'COPY_ROWS_BYTES', 32)
    launches = []
    real = kernels.kernel

    def counted(name, dtype=None):
        k = real(name, dtype)

        def launch(grid, block, args):
            launches.append(int(args[7]))
            return k(grid, block, args)
        return launch
    with emulating(emulator):
        monkeypatch.setattr(kernels, 'kernel', counted)
        _row_copy_case(numpy, 5, 16, 0, 16, 8, 40)
    assert launches == [2, 2, 1]


# (m rows, c channels): fewer channels than a block's threads (several rows
# a thread at once, added across the block), more (two passes), one row,
# and 192 (one row at a time, 64 threads idle).
NHWC_SUMS = [(1000, 40), (203, 300), (37, 5), (1, 7), (5000, 16), (2000, 192)]


def _nhwc_sums_case(xp, m, c):
    rng = numpy.random.default_rng(m + c)
    dy = (50 * rng.standard_normal((m, c))).astype(numpy.float32)
    db0 = rng.standard_normal(c).astype(numpy.float32)
    results = []
    for _ in range(2):
        db = xp.asarray(db0.copy())
        kernels.channel_sums_nhwc(xp.asarray(dy.reshape(-1)), db, m, c)
        results.append(numpy.asarray(db.get() if hasattr(db, 'get') else db))
    want = db0.astype(numpy.float64) + dy.astype(numpy.float64).sum(axis=0)
    numpy.testing.assert_allclose(results[0], want, rtol=1e-6, atol=1e-6)
    _same_bits(results[0], results[1])       # a fixed order for a launch shape


@pytest.mark.parametrize('m, c', NHWC_SUMS)
def test_channels_last_bias_sums_over_rows_and_blocks(emulator, m, c):
    with emulating(emulator):
        _nhwc_sums_case(numpy, m, c)


def test_the_bias_partials_fill_the_device_within_their_cap():
    """nhwc_sum_blocks: about NHWC_SUM_ROWS rows a thread (GoogLeNet's 7 x 7
    maps at b64: 196 blocks where one thread a channel walking 256 rows a
    block made 12), at most 4,096 blocks and 2**19 partials."""
    assert kernels.nhwc_sum_blocks(64 * 7 * 7, 384) == 196
    assert kernels.nhwc_sum_blocks(64 * 7 * 7, 64) == 49          # 4 rows at once
    assert kernels.nhwc_sum_blocks(64 * 112 * 112, 64) == 4096
    assert kernels.nhwc_sum_blocks(64 * 28 * 28, 512) == 2 ** 19 // 512
    assert kernels.nhwc_sum_blocks(3, 1000) == 1
    # The scratch the estimate counts: a double partial a channel a block,
    # 4 MiB at the cap.
    assert kernels.nhwc_sum_scratch_bytes(64 * 7 * 7, 384) == 8 * 384 * 196
    assert kernels.nhwc_sum_scratch_bytes(64 * 28 * 28, 512) == 8 * 2 ** 19


@pytest.mark.gpu
@pytest.mark.parametrize('itemsize', [2, 4])
@pytest.mark.parametrize('case', TRANSPOSES + [(64, 64, 112 * 112, None, None, False),
                                               (64, 12544, 64, None, None, False),
                                               (128, 3, 227 * 227, None, 4, True),
                                               (64, 192, 28 * 28, None, None, False)])
def test_a_transpose_on_the_gpu(gpu, itemsize, case):
    import cupy
    kernels.reset_kernels()
    _transpose_case(cupy, numpy.random.default_rng(sum(case[:3])), itemsize, *case)


@pytest.mark.gpu
@pytest.mark.parametrize('case', ROW_COPIES + [(64 * 28 * 28, 128, 0, 128, 256, 512),
                                               (64 * 7 * 7, 768, 0, 768, 0, 2048)])
def test_rows_copied_on_the_gpu(gpu, case):
    import cupy
    kernels.reset_kernels()
    _row_copy_case(cupy, *case)


@pytest.mark.gpu
@pytest.mark.parametrize('m, c', NHWC_SUMS + [(64 * 112 * 112, 64), (64 * 7 * 7, 384),
                                              (64 * 28 * 28, 512), (128 * 55 * 55, 96)])
def test_channels_last_bias_sums_on_the_gpu(gpu, m, c):
    import cupy
    kernels.reset_kernels()
    _nhwc_sums_case(cupy, m, c)


def test_a_kernel_path_falls_back_for_good_after_its_first_failure():
    """layers/cudnn_common.KernelPath, which the relayouts, Concat's rows and
    the convolution's bias kernels take: the kernel runs while it works; its
    first failure is noted once and from then on the caller's fallback runs
    without trying the kernel again."""
    from caffeplus.layers.cudnn_common import KernelPath
    calls = []

    def works(x):
        calls.append(x)

    def fails(x):
        calls.append(x)
        raise RuntimeError('no module')
    before = len(kernels.failures())
    path = KernelPath('a test kernel (cp_test)')
    assert path.run(works, 1) and path.ok
    assert not path.run(fails, 2) and not path.ok
    assert not path.run(works, 3)
    assert calls == [1, 2]
    assert kernels.failures()[before:] == [('a test kernel (cp_test)', 'RuntimeError: no module')]


@pytest.mark.parametrize('nhwc', [True, False])
def test_the_convolutions_bias_gradient_takes_the_channel_sums(emulator, nhwc):
    """layers/cudnn_conv._bias_gradient over a top in either order (the
    kernels emulated): db gains the top diff's per-channel sums."""
    from types import SimpleNamespace
    from caffeplus.layers import cudnn_conv
    n, c, h, w = 3, 5, 4, 2
    rng = numpy.random.default_rng(5)
    dy = rng.standard_normal((n, c, h, w)).astype(numpy.float32)
    stored = dy.transpose(0, 2, 3, 1) if nhwc else dy
    cd = SimpleNamespace(nhwc=nhwc, top_full=(n, c, h, w), batch_chunks=1, top_off=0,
                         bias_part=None)
    db0 = rng.standard_normal(c).astype(numpy.float32)
    db = db0.copy()
    with emulating(emulator):
        cudnn_conv._bias_gradient(cd, numpy.ascontiguousarray(stored).reshape(-1), db)
    numpy.testing.assert_allclose(db, db0 + dy.astype(numpy.float64).sum(axis=(0, 2, 3)),
                                  rtol=1e-6)
