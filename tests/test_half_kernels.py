"""The 16-bit build of the map kernels (caffeplus.kernels' 'core16': CORE with
CP_A a 16-bit float), emulated on the host with g++'s _Float16 standing in
for CUDA's __half (both round a float to the nearest 16-bit value, ties to
even). Each kernel is checked against NumPy: float32 math on the float16
inputs, rounded once to float16 where the map is stored, float64 for the
BatchNorm references."""
import numpy
import pytest

from caffeplus import kernels
from caffeplus.kernel_sources import COMMON, CORE, EXTRA
from conftest import build_emulator

F16, F32 = numpy.float16, numpy.float32


@pytest.fixture(scope='module')
def half():
    return build_emulator('#define CP_A _Float16\n' + COMMON + CORE)


@pytest.fixture(scope='module')
def half_extra():
    """EXTRA's 16-bit build: its BatchNorm kernels over several blocks a channel."""
    return build_emulator('#define CP_A _Float16\n' + COMMON + EXTRA)


def _maps(r, *shape, scale=1.0):
    return (scale * r.standard_normal(shape)).astype(F16)


def test_relu_forward_and_backward(half):
    r = numpy.random.RandomState(1)
    n = 1000
    x, dy = _maps(r, n), _maps(r, n)
    y = numpy.empty(n, F16)
    half.kernel('cp_relu_fwd')((4,), (64,), (x, y, numpy.uint32(n), F32(0)))
    numpy.testing.assert_array_equal(y, numpy.where(x >= 0, x, F16(0)))
    dx = numpy.empty(n, F16)
    half.kernel('cp_relu_bwd')((4,), (64,), (dy, y, dx, numpy.uint32(n), F32(0)))
    numpy.testing.assert_array_equal(dx, numpy.where(y > 0, dy, F16(0)))
    # A leaky slope: the product in float32, rounded once.
    half.kernel('cp_relu_fwd')((4,), (64,), (x, y, numpy.uint32(n), F32(0.1)))
    want = numpy.where(x > 0, x.astype(F32), x.astype(F32) * F32(0.1)).astype(F16)
    numpy.testing.assert_array_equal(y, want)


def test_axpby_and_scale2(half):
    r = numpy.random.RandomState(2)
    n = 777
    a, b = _maps(r, n, scale=100), _maps(r, n, scale=100)
    y = numpy.empty(n, F16)
    half.kernel('cp_axpby')((3,), (64,), (a, b, y, numpy.uint32(n), F32(0.5), F32(-2),
                                          numpy.int32(1)))
    t = (F32(0.5) * a.astype(F32)) + (F32(-2) * b.astype(F32))
    numpy.testing.assert_array_equal(y, numpy.maximum(t, F32(0)).astype(F16))
    g, ref = _maps(r, n), _maps(r, n)
    d0, d1 = numpy.empty(n, F16), numpy.empty(n, F16)
    want_g = numpy.where(ref > 0, g, F16(0))
    half.kernel('cp_scale2')((3,), (64,), (g, d0, d1, ref, numpy.uint32(n), F32(3), F32(0.25),
                                           numpy.int32(7)))
    numpy.testing.assert_array_equal(g, want_g)
    numpy.testing.assert_array_equal(d0, (F32(3) * want_g.astype(F32)).astype(F16))
    numpy.testing.assert_array_equal(d1, (F32(0.25) * want_g.astype(F32)).astype(F16))


def _bn_forward(half, x, flags, sc=None, bi=None):
    n, c, s = x.shape
    y = numpy.empty_like(x)
    xn = numpy.empty(x.shape, F32)
    b0, b1, b2, std = (numpy.zeros(c, F32), numpy.zeros(c, F32), numpy.zeros(1, F32),
                       numpy.zeros(c, F32))
    sc = sc if sc is not None else numpy.ones(c, F32)
    bi = bi if bi is not None else numpy.zeros(c, F32)
    m = n * s
    half.kernel('cp_bn_fwd')((c,), (64,), (
        x, y, xn, b0, b1, b2, std, sc, bi, numpy.uint32(n), numpy.uint32(c), numpy.uint32(s),
        numpy.int32(flags), F32(0.9), F32(1e-5), F32(m / (m - 1))))
    return y, xn, std, (b0, b1, b2)


def test_batchnorm_chain_forward_and_backward(half):
    r = numpy.random.RandomState(3)
    n, c, s = 4, 3, 50
    # Values in the thousands: their squares are past FLOAT16's range, the
    # kernel's sums are in double.
    x = _maps(r, n, c, s, scale=2000)
    sc = numpy.array([1.5, -0.5, 2.0], F32)
    bi = numpy.array([0.1, 0.2, -0.3], F32)
    flags = kernels.BN_BATCH | kernels.BN_KEEP | kernels.BN_SCALE | kernels.BN_BIAS | \
        kernels.BN_RELU
    y, xn, std, (b0, b1, b2) = _bn_forward(half, x, flags, sc, bi)
    x64 = x.astype(numpy.float64)
    mean = x64.mean(axis=(0, 2))
    var = x64.var(axis=(0, 2))
    norm = (x64 - mean[None, :, None]) / numpy.sqrt(var + 1e-5)[None, :, None]
    numpy.testing.assert_allclose(xn, norm, rtol=1e-5, atol=1e-5)
    numpy.testing.assert_allclose(std, numpy.sqrt(var + 1e-5), rtol=1e-6)
    numpy.testing.assert_allclose(b0, mean, rtol=1e-6)
    top = numpy.maximum(norm * sc[None, :, None] + bi[None, :, None], 0)
    # The top is stored in FLOAT16: within its rounding (2^-11 relative).
    assert y.dtype == F16
    numpy.testing.assert_allclose(y.astype(numpy.float64), top, rtol=2 ** -10, atol=1e-3)

    # Backward through ReLU, Scale and BatchNorm: dx, and the Scale's gradients.
    dy = _maps(r, n, c, s)
    dx = numpy.empty_like(dy)
    dsc, dbi = numpy.zeros(c, F32), numpy.zeros(c, F32)
    bflags = kernels.BN_BATCH | kernels.BN_SCALE | kernels.BN_BIAS | kernels.BN_RELU | \
        kernels.BN_DSCALE | kernels.BN_DBIAS | kernels.BN_DX
    half.kernel('cp_bn_bwd')((c,), (64,), (
        dy, xn, std, dx, sc, bi, dsc, dbi, numpy.uint32(n), numpy.uint32(c), numpy.uint32(s),
        numpy.int32(bflags)))
    xn64 = xn.astype(numpy.float64)
    g = dy.astype(numpy.float64) * (xn64 * sc[None, :, None] + bi[None, :, None] > 0)
    numpy.testing.assert_allclose(dsc, (g * xn64).sum(axis=(0, 2)), rtol=1e-4, atol=1e-4)
    numpy.testing.assert_allclose(dbi, g.sum(axis=(0, 2)), rtol=1e-4, atol=1e-4)
    gs = g * sc[None, :, None]
    want = (gs - gs.mean(axis=(0, 2))[None, :, None] -
            xn64 * (gs * xn64).mean(axis=(0, 2))[None, :, None]) / std[None, :, None]
    numpy.testing.assert_allclose(dx.astype(numpy.float64), want, rtol=2 ** -10,
                                  atol=2e-3 * numpy.abs(want).max())



def test_batchnorm_split_kernels_on_16_bit_maps(half, half_extra):
    """The kernels that share a channel among P blocks (a big map, few
    channels: ResNet's first BatchNorm) read and write 16-bit maps, with the
    one-block kernel's statistics and its results to FLOAT16's rounding."""
    r = numpy.random.RandomState(9)
    n, c, s, P = 3, 2, 70, 3
    x = _maps(r, n, c, s, scale=1500)
    sc = numpy.array([1.25, -0.75], F32)
    bi = numpy.array([0.5, -0.25], F32)
    flags = kernels.BN_BATCH | kernels.BN_KEEP | kernels.BN_SCALE | kernels.BN_BIAS | \
        kernels.BN_RELU
    y1, xn1, std1, stats1 = _bn_forward(half, x, flags, sc, bi)
    y = numpy.empty_like(x)
    xn = numpy.empty(x.shape, F32)
    b0, b1, b2, std = (numpy.zeros(c, F32), numpy.zeros(c, F32), numpy.zeros(1, F32),
                       numpy.zeros(c, F32))
    part, kv = numpy.zeros(2 * c * P, numpy.float64), numpy.zeros(c, F32)
    m = n * s
    dims = (numpy.uint32(n), numpy.uint32(c), numpy.uint32(s), numpy.uint32(P))
    half_extra.kernel('cp_bn_stats_part')((c * P,), (64,), (x, part, kv) + dims)
    half_extra.kernel('cp_bn_fwd_apply')((c * P,), (64,), (
        x, y, xn, b0, b1, b2, std, sc, bi, part, kv) + dims + (
        numpy.int32(flags), F32(0.9), F32(1e-5), F32(m / (m - 1))))
    x64 = x.astype(numpy.float64)
    mean, var = x64.mean(axis=(0, 2)), x64.var(axis=(0, 2))
    numpy.testing.assert_allclose(b0, mean, rtol=1e-6)
    numpy.testing.assert_allclose(std, numpy.sqrt(var + 1e-5), rtol=1e-6)
    numpy.testing.assert_allclose(xn, xn1, rtol=1e-5, atol=1e-6)
    assert y.dtype == F16
    numpy.testing.assert_allclose(y.astype(F32), y1.astype(F32), rtol=2 ** -10, atol=2 ** -14)

    dy = _maps(r, n, c, s)
    bflags = kernels.BN_BATCH | kernels.BN_SCALE | kernels.BN_BIAS | kernels.BN_RELU | \
        kernels.BN_DSCALE | kernels.BN_DBIAS | kernels.BN_DX
    dx1 = numpy.empty_like(dy)
    d1 = numpy.zeros(c, F32), numpy.zeros(c, F32)
    half.kernel('cp_bn_bwd')((c,), (64,), (
        dy, xn, std, dx1, sc, bi, d1[0], d1[1], numpy.uint32(n), numpy.uint32(c),
        numpy.uint32(s), numpy.int32(bflags)))
    dx = numpy.empty_like(dy)
    dsc, dbi = numpy.zeros(c, F32), numpy.zeros(c, F32)
    part[...] = 0
    half_extra.kernel('cp_bn_bwd_part')((c * P,), (64,), (dy, xn, sc, bi, part) + dims +
                                        (numpy.int32(bflags),))
    half_extra.kernel('cp_bn_bwd_apply')((c * P,), (64,), (
        dy, xn, std, dx, sc, bi, dsc, dbi, part) + dims + (numpy.int32(bflags),))
    assert dx.dtype == F16
    numpy.testing.assert_allclose(dsc, d1[0], rtol=1e-5, atol=1e-5)
    numpy.testing.assert_allclose(dbi, d1[1], rtol=1e-5, atol=1e-5)
    numpy.testing.assert_allclose(dx.astype(F32), dx1.astype(F32), rtol=2 ** -10,
                                  atol=2 ** -14 * numpy.abs(dx1.astype(F32)).max())
