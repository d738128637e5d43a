"""The 16-bit builds of the map kernels (caffeplus.kernels' 'core16' and
'corebf16': CORE with CP_A __half or __nv_bfloat16), emulated on the host
with dev.kernel_emu's __half and __nv_bfloat16: they convert as CUDA's do (so
NVRTC's type errors are g++'s too) and round a float to the nearest 16-bit
value, ties to even, as CUDA's do. Each kernel is checked against NumPy
(ml_dtypes for BFLOAT16): float32 math on the 16-bit inputs, rounded once
where the map is stored, float64 for the BatchNorm references."""
import numpy
import pytest

from caffeplus import kernels
from caffeplus.kernel_sources import COMMON, CORE
from caffeplus.kernel_sources_extra import EXTRA
from caffeplus.kernel_sources_nhwc import CHANNELS_LAST_BATCHNORM
from conftest import build_emulator, emulating

F32 = numpy.float32
# The 16-bit types under test (CUDA's name, NumPy's type): each test runs
# once for each, F16 naming the one of the current run (the `sixteen` fixture).
try:
    import ml_dtypes
    _BF16 = [('__nv_bfloat16', ml_dtypes.bfloat16, 2 ** -8, 2 ** -8)]
except ImportError:
    _BF16 = []
# (..., HALF_ULP: half the spacing of values in [1, 2), the relative error of
# one rounding; TINY: the absolute error allowed beside it)
SIXTEEN_BIT = [('__half', numpy.float16, 2 ** -11, 2 ** -14)] + _BF16
F16, HALF_ULP, TINY = numpy.float16, 2 ** -11, 2 ** -14


@pytest.fixture(scope='module', autouse=True, params=SIXTEEN_BIT, ids=lambda p: p[0])
def sixteen(request):
    global F16, HALF_ULP, TINY
    F16, HALF_ULP, TINY = request.param[1:]
    yield request.param[0]
    F16, HALF_ULP, TINY = SIXTEEN_BIT[0][1:]


@pytest.fixture(scope='module')
def half(sixteen):
    return build_emulator('#define CP_A %s\n' % sixteen + COMMON + CORE)


@pytest.fixture(scope='module')
def half_extra(sixteen):
    """EXTRA's 16-bit build: its BatchNorm kernels over several blocks a channel."""
    return build_emulator('#define CP_A %s\n' % sixteen + COMMON + EXTRA +
                          CHANNELS_LAST_BATCHNORM)


@pytest.fixture(scope='module')
def float_extra():
    return build_emulator(COMMON + EXTRA + CHANNELS_LAST_BATCHNORM)


def _maps(r, *shape, scale=1.0):
    return (scale * r.standard_normal(shape)).astype(F16)


def _offset(a, k):
    """A copy of `a` that starts k values into a fresh buffer (misaligned
    for k not a multiple of 8: the kernels' scalar loop)."""
    buf = numpy.empty(a.size + k, a.dtype)
    buf[k:] = a
    return buf[k:]


@pytest.mark.parametrize('n,shift', [(1000, 0), (1003, 0), (1003, 1)])
def test_relu_forward_and_backward(half, n, shift):
    """Aligned maps take the 16-byte vector loop (its tail the scalar one),
    misaligned ones the scalar loop; the same values either way."""
    r = numpy.random.RandomState(1)
    x, dy = _offset(_maps(r, n), shift), _offset(_maps(r, n), shift)
    assert (x.ctypes.data % 16 == 0) == (shift == 0)
    y = _offset(numpy.empty(n, F16), shift)
    half.kernel('cp_relu_fwd')((4,), (64,), (x, y, numpy.uint32(n), F32(0)))
    numpy.testing.assert_array_equal(y, numpy.where(x >= 0, x, F16(0)))
    dx = _offset(numpy.empty(n, F16), shift)
    half.kernel('cp_relu_bwd')((4,), (64,), (dy, y, dx, numpy.uint32(n), F32(0)))
    numpy.testing.assert_array_equal(dx, numpy.where(y > 0, dy, F16(0)))
    # A leaky slope: the product in float32, rounded once.
    half.kernel('cp_relu_fwd')((4,), (64,), (x, y, numpy.uint32(n), F32(0.1)))
    want = numpy.where(x > 0, x.astype(F32), x.astype(F32) * F32(0.1)).astype(F16)
    numpy.testing.assert_array_equal(y, want)


@pytest.mark.parametrize('shift', [0, 3])
def test_axpby_and_scale2(half, shift):
    r = numpy.random.RandomState(2)
    n = 777
    a, b = _offset(_maps(r, n, scale=100), shift), _offset(_maps(r, n, scale=100), shift)
    y = _offset(numpy.empty(n, F16), shift)
    half.kernel('cp_axpby')((3,), (64,), (a, b, y, numpy.uint32(n), F32(0.5), F32(-2),
                                          numpy.int32(1)))
    t = (F32(0.5) * a.astype(F32)) + (F32(-2) * b.astype(F32))
    numpy.testing.assert_array_equal(y, numpy.maximum(t, F32(0)).astype(F16))
    # cp_scale2: every flag combination, aligned (the vector loop and its
    # tail: 777 is not a multiple of 8) and misaligned (the scalar loop).
    for flags in (1, 3, 4, 5, 7):
        g, ref = _offset(_maps(r, n), shift), _offset(_maps(r, n), shift)
        d0, d1 = (_offset(numpy.full(n, F16(9)), shift) for _ in range(2))
        g_before = g.copy()
        masked = numpy.where(ref > 0, g, F16(0)) if flags & 4 else g.copy()
        half.kernel('cp_scale2')((3,), (64,), (g, d0, d1, ref, numpy.uint32(n), F32(3),
                                               F32(0.25), numpy.int32(flags)))
        numpy.testing.assert_array_equal(g, masked if flags & 4 else g_before)
        numpy.testing.assert_array_equal(
            d0, (F32(3) * masked.astype(F32)).astype(F16) if flags & 1 else F16(9))
        numpy.testing.assert_array_equal(
            d1, (F32(0.25) * masked.astype(F32)).astype(F16) if flags & 2 else F16(9))


@pytest.mark.parametrize('shift', [0, 3])
def test_sum_scale2_is_axpby_then_scale2(half, shift):
    """cp_sum_scale2 (a Split's backward and the Eltwise SUM -> ReLU's in
    one pass) gives the bits of cp_axpby(a, b, 1, 1) into g and cp_scale2
    on g, the layers' own kernels; g itself only with flags & 8."""
    r = numpy.random.RandomState(5)
    n = 777
    for flags in (4, 5, 7, 12, 13, 15):
        a, b, ref = (_offset(_maps(r, n, scale=50), shift) for _ in range(3))
        g, d0, d1 = (_offset(numpy.full(n, F16(9)), shift) for _ in range(3))
        half.kernel('cp_sum_scale2')((3,), (64,), (a, b, g, d0, d1, ref, numpy.uint32(n),
                                                   F32(3), F32(0.25), numpy.int32(flags)))
        summed = (a.astype(F32) + b.astype(F32)).astype(F16)
        masked = numpy.where(ref > 0, summed, F16(0))
        numpy.testing.assert_array_equal(g, masked if flags & 8 else F16(9))
        numpy.testing.assert_array_equal(
            d0, (F32(3) * masked.astype(F32)).astype(F16) if flags & 1 else F16(9))
        numpy.testing.assert_array_equal(
            d1, (F32(0.25) * masked.astype(F32)).astype(F16) if flags & 2 else F16(9))
        # The two kernels it replaces, one after the other.
        g2, e0, e1 = (_offset(numpy.full(n, F16(9)), shift) for _ in range(3))
        half.kernel('cp_axpby')((3,), (64,), (a, b, g2, numpy.uint32(n), F32(1), F32(1),
                                              numpy.int32(0)))
        half.kernel('cp_scale2')((3,), (64,), (g2, e0, e1, ref, numpy.uint32(n), F32(3),
                                               F32(0.25), numpy.int32(flags & 7)))
        for got, want in ((d0, e0), (d1, e1)) + (((g, g2),) if flags & 8 else ()):
            numpy.testing.assert_array_equal(got.view(numpy.uint16), want.view(numpy.uint16))


@pytest.mark.parametrize('add_flags', [2, 3, 1])
def test_bn_apply_add_is_apply_then_axpby(half, half_extra, add_flags):
    """cp_bn_apply_add_nhwc_vec (a residual branch's BatchNorm -> Scale
    normalize pass with the Eltwise SUM after it) gives the bits of
    cp_bn_apply_nhwc_vec and then cp_axpby on the top it stored; the top
    itself only with add_flags & 1, the ReLU with add_flags & 2."""
    r = numpy.random.RandomState(7)
    m, c = 37, 16
    x, other = _maps(r, m, c, scale=3), _maps(r, m, c, scale=3)
    ms, sd = r.standard_normal(c).astype(F32), (r.rand(c) + 0.5).astype(F32)
    sc, bi = r.standard_normal(c).astype(F32), r.standard_normal(c).astype(F32)
    flags = 2 | 4 | 8                   # keep the normalized copy; scale; bias
    args = lambda y, xn: (x, y, xn, ms, sd, sc, bi, numpy.uint32(m), numpy.uint32(c),
                          numpy.int32(flags))
    y1, xn1, e1 = (numpy.full((m, c), F16(9)) for _ in range(3))
    half_extra.kernel('cp_bn_apply_nhwc_vec')((3,), (8,), args(y1, xn1))
    half.kernel('cp_axpby')((3,), (64,), (other, y1, e1, numpy.uint32(m * c), F32(0.5),
                                          F32(-2), numpy.int32(add_flags >> 1)))
    y2, xn2, e2 = (numpy.full((m, c), F16(9)) for _ in range(3))
    half_extra.kernel('cp_bn_apply_add_nhwc_vec')((3,), (8,), args(y2, xn2) + (
        other, e2, F32(0.5), F32(-2), numpy.int32(add_flags)))
    bits = lambda a: a.view(numpy.uint16)
    numpy.testing.assert_array_equal(bits(xn2), bits(xn1))
    numpy.testing.assert_array_equal(bits(e2), bits(e1))
    numpy.testing.assert_array_equal(bits(y2), bits(y1) if add_flags & 1 else bits(
        numpy.full((m, c), F16(9))))
    assert (e1 < 0).any() != bool(add_flags & 2)


def _bn_state(c):
    """Zeroed mean, variance, count and std buffers of a c-channel BatchNorm."""
    return numpy.zeros(c, F32), numpy.zeros(c, F32), numpy.zeros(1, F32), numpy.zeros(c, F32)


def _bn_forward(half, x, flags, sc=None, bi=None):
    n, c, s = x.shape
    y = numpy.empty_like(x)
    xn = numpy.empty(x.shape, F16)          # the kept copy is a map: 16-bit
    b0, b1, b2, std = _bn_state(c)
    sc = sc if sc is not None else numpy.ones(c, F32)
    bi = bi if bi is not None else numpy.zeros(c, F32)
    m = n * s
    half.kernel('cp_bn_fwd')((c,), (64,), (
        x, y, xn, b0, b1, b2, std, sc, bi, numpy.uint32(n), numpy.uint32(c), numpy.uint32(s),
        numpy.int32(flags), F32(0.9), F32(1e-5), F32(m / (m - 1))))
    return y, xn, std, (b0, b1, b2)


# What cp_channel_width picks for runs of S values at a pointer k values
# into an aligned buffer: the loop width (values) each BatchNorm kernel takes.
WIDTH_PROBE = '''
extern "C" __global__ void cp_width_probe(const unsigned S, const CP_A* a, int* out) {
    out[0] = cp_channel_width(S, a, nullptr, nullptr);
}
'''


@pytest.mark.parametrize('dtype', ['half', 'float'])
def test_channel_loops_take_the_widest_aligned_vector(sixteen, dtype):
    """16-byte vectors where a run is a multiple of them and the maps are
    16-byte aligned, else 8-byte ones (ResNet-50's 14 x 14 maps, 196 values
    a run), else one value at a time."""
    head = '#define CP_A %s\n' % sixteen if dtype == 'half' else ''
    emu = build_emulator(head + COMMON + CORE + WIDTH_PROBE)
    t = F16 if dtype == 'half' else F32
    v = 16 // numpy.dtype(t).itemsize            # values in 16 bytes

    def width(s, k):
        a = _offset(numpy.zeros(64, t), k)
        out = numpy.zeros(1, numpy.int32)
        emu.kernel('cp_width_probe')((1,), (1,), (numpy.uint32(s), a, out))
        return int(out[0])
    assert width(196 if dtype == 'half' else 198, 0) == v // 2
    assert width(4 * v, 0) == v
    assert width(4 * v, v // 2) == v // 2          # 8-byte aligned only
    assert width(4 * v + v // 2, 0) == v // 2
    assert width(49, 0) == 1
    assert width(4 * v, 1) == 1                    # misaligned


@pytest.mark.parametrize('s', [50, 48, 52])
def test_batchnorm_chain_forward_and_backward(half, s):
    """s = 48: runs of 8 values, the 16-byte vector loops; 52: runs of 4
    (8-byte loops); 50: the scalar ones."""
    r = numpy.random.RandomState(3)
    n, c = 4, 3
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
    # The normalized values rounded once to FLOAT16 (2^-11 relative), the
    # top computed from those rounded values (so the backward's ReLU mask,
    # recomputed from the kept copy, is the forward's).
    assert xn.dtype == F16
    numpy.testing.assert_allclose(xn, norm, rtol=HALF_ULP, atol=2 ** -24)
    numpy.testing.assert_allclose(std, numpy.sqrt(var + 1e-5), rtol=1e-6)
    numpy.testing.assert_allclose(b0, mean, rtol=1e-6)
    xr = xn.astype(F32)
    top = numpy.maximum(xr * sc[None, :, None] + bi[None, :, None], F32(0))
    assert y.dtype == F16
    assert y.tobytes() == top.astype(F16).tobytes()

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
    numpy.testing.assert_allclose(dx.astype(numpy.float64), want, rtol=2 * HALF_ULP,
                                  atol=4 * HALF_ULP * numpy.abs(want).max())



@pytest.mark.parametrize('s', [48, 50])
def test_the_identity_statistics_pass_remakes_the_chains_top(half, half_extra, s):
    """A normalized chain's top made again from the kept copy
    (fused_chain.GPUBatchNormLayer.remake_chain_top): the normalize pass with
    mean 0 and deviation sqrt(1 + 0) reads the copy as its input and writes
    the forward's top bit for bit, through each kernel the layer launches:
    cp_bn_fwd, cp_bn_fwd_apply (P blocks a channel), cp_bn_apply_nhwc and
    its vector form on the channels-last order of the same values."""
    r = numpy.random.RandomState(17)
    n, c, P = 4, 8, 3
    u32, i32 = numpy.uint32, numpy.int32
    x = _maps(r, n, c, s, scale=30)
    x[0, 0, :3] = (-0.0, numpy.inf, -numpy.inf)
    sc = r.standard_normal(c).astype(F32)
    bi = r.standard_normal(c).astype(F32)
    chain = kernels.BN_SCALE | kernels.BN_BIAS | kernels.BN_RELU
    y, xn, _, _ = _bn_forward(half, x, kernels.BN_BATCH | kernels.BN_KEEP | chain, sc, bi)
    assert (y == 0).any() and (y > 0).any() and numpy.isnan(y.astype(F32)).any()
    zeros, ones, std = numpy.zeros(c, F32), numpy.ones(c, F32), numpy.empty(c, F32)
    identity = (zeros, ones, ones, std, sc, bi)

    def same(got, want):
        assert got.view(numpy.uint16).tobytes() == want.view(numpy.uint16).tobytes()
    got = numpy.full_like(y, numpy.nan)
    half.kernel('cp_bn_fwd')((c,), (64,), (xn, got, got) + identity + (
        u32(n), u32(c), u32(s), i32(chain), F32(0), F32(0), F32(1)))
    same(got, y)
    assert (std == 1).all()
    got[...] = numpy.nan
    part, kv = numpy.zeros(2 * c * P, numpy.float64), numpy.zeros(c, F32)
    half_extra.kernel('cp_bn_fwd_apply')((c * P,), (64,), (xn, got, got) + identity + (
        part, kv, u32(n), u32(c), u32(s), u32(P), i32(chain), F32(0), F32(0), F32(1)))
    same(got, y)
    last = lambda a: numpy.ascontiguousarray(a.transpose(0, 2, 1))
    xl, yl, m = last(xn), last(y), n * s
    for name, grid, block in (('cp_bn_apply_nhwc', (7,), (64,)),
                              ('cp_bn_apply_nhwc_vec', (2,), (8,))):
        got = numpy.full_like(yl, numpy.nan)
        half_extra.kernel(name)(grid, block, (xl, got, got, zeros, ones, sc, bi, u32(m), u32(c),
                                              i32(chain)))
        same(got, yl)


@pytest.mark.parametrize('in_place', [False, True])
def test_scale_forward_and_backward_on_16_bit_maps(half, in_place):
    """An unchained Scale (no BatchNorm before it) on 16-bit maps: the
    product and bias in float32, rounded once; in place, the kept copy of
    the bottom is the 16-bit map itself; the parameters' gradients summed
    in double from the 16-bit values, dx rounded once."""
    r = numpy.random.RandomState(11)
    outer, dim, inner = 3, 5, 37
    x = _maps(r, outer, dim, inner, scale=30)
    sc = r.standard_normal(dim).astype(F32)
    bi = r.standard_normal(dim).astype(F32)
    keep = numpy.zeros_like(x)
    y = x if in_place else numpy.empty_like(x)
    x0 = x.copy()
    flags = kernels.SC_BIAS | (kernels.SC_KEEP if in_place else 0)
    dims = (numpy.uint32(outer), numpy.uint32(dim), numpy.uint32(inner))
    half.kernel('cp_scale_fwd')((4,), (64,), (x, y, keep, sc, bi) + dims + (numpy.int32(flags),))
    want = (x0.astype(F32) * sc[None, :, None] + bi[None, :, None]).astype(F16)
    assert y.dtype == F16 and y.tobytes() == want.tobytes()
    if in_place:
        assert keep.tobytes() == x0.tobytes()
    dy = _maps(r, outer, dim, inner)
    dx = numpy.empty_like(dy)
    dsc, dbi = numpy.ones(dim, F32), numpy.zeros(dim, F32)
    bflags = kernels.SC_DSCALE | kernels.SC_DSCALE_ACC | kernels.SC_DBIAS | kernels.SC_DX
    half.kernel('cp_scale_bwd')((dim,), (64,), (dy, keep if in_place else x0, sc, dx, dsc, dbi)
                                + dims + (numpy.int32(bflags),))
    d64, x64 = dy.astype(numpy.float64), x0.astype(numpy.float64)
    numpy.testing.assert_allclose(dsc, 1 + (d64 * x64).sum(axis=(0, 2)), rtol=1e-6)
    numpy.testing.assert_allclose(dbi, d64.sum(axis=(0, 2)), rtol=1e-6, atol=1e-6)
    assert dx.dtype == F16
    assert dx.tobytes() == (dy.astype(F32) * sc[None, :, None]).astype(F16).tobytes()


@pytest.mark.parametrize('s', [70, 64, 68])
def test_batchnorm_split_kernels_on_16_bit_maps(half, half_extra, s):
    """The kernels that share a channel among P blocks (a big map, few
    channels: ResNet's first BatchNorm) read and write 16-bit maps, with the
    one-block kernel's statistics and its results to FLOAT16's rounding
    (s = 64: the vector loops, shares in whole runs of 8; s = 68: the 8-byte
    loops, in runs of 4)."""
    r = numpy.random.RandomState(9)
    n, c, P = 3, 2, 3
    x = _maps(r, n, c, s, scale=1500)
    sc = numpy.array([1.25, -0.75], F32)
    bi = numpy.array([0.5, -0.25], F32)
    flags = kernels.BN_BATCH | kernels.BN_KEEP | kernels.BN_SCALE | kernels.BN_BIAS | \
        kernels.BN_RELU
    y1, xn1, std1, stats1 = _bn_forward(half, x, flags, sc, bi)
    y = numpy.empty_like(x)
    xn = numpy.empty(x.shape, F16)
    b0, b1, b2, std = _bn_state(c)
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
    # The one-block kernel's values (its float32 sums may differ from these
    # in the last bit, and a different float32 may round to the next FLOAT16).
    numpy.testing.assert_allclose(xn.astype(F32), xn1.astype(F32), rtol=2 * HALF_ULP, atol=2 ** -24)
    assert y.dtype == F16
    numpy.testing.assert_allclose(y.astype(F32), y1.astype(F32), rtol=2 * HALF_ULP, atol=TINY)

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
    numpy.testing.assert_allclose(dx.astype(F32), dx1.astype(F32), rtol=2 * HALF_ULP,
                                  atol=TINY * numpy.abs(dx1.astype(F32)).max())


@pytest.mark.parametrize('ave', [0, 1])
def test_pooling_with_caffes_windows_on_16_bit_maps(half_extra, float_extra, ave):
    """Max and average pooling with Caffe's windows (3 x 3, stride 2, pad 1:
    GoogLeNet's, where cuDNN's output size differs) on 16-bit maps: each
    value the float32 build's on the same inputs, rounded once to FLOAT16;
    the same argmax; backward likewise."""
    r = numpy.random.RandomState(11)
    n, c, h, w = 2, 3, 9, 8
    kh = kw = 3
    sh = sw = 2
    ph = pw = 1
    oh = -(-(h + 2 * ph - kh) // sh) + 1
    ow = -(-(w + 2 * pw - kw) // sw) + 1
    x = _maps(r, n * c, h, w, scale=30)
    geometry = (numpy.uint32(n * c), numpy.int32(h), numpy.int32(w), numpy.int32(oh),
                numpy.int32(ow), numpy.int32(kh), numpy.int32(kw), numpy.int32(sh),
                numpy.int32(sw), numpy.int32(ph), numpy.int32(pw), numpy.int32(ave))
    runs = {}
    for name, emu, dtype in (('16', half_extra, F16), ('32', float_extra, F32)):
        xs = x.astype(dtype)
        y = numpy.full((n * c, oh, ow), numpy.nan, dtype)
        arg = numpy.full((n * c, oh, ow), -7, numpy.int32)
        emu.kernel('cp_pool_fwd')((4,), (64,), (xs, y, arg) + geometry)
        dy = _maps(numpy.random.RandomState(12), n * c, oh, ow).astype(dtype)
        dx = numpy.full(x.shape, numpy.nan, dtype)
        emu.kernel('cp_pool_bwd')((4,), (64,), (dy, arg if not ave else dy, dx) + geometry)
        runs[name] = (y, arg, dx)
    (y16, arg16, dx16), (y32, arg32, dx32) = runs['16'], runs['32']
    assert y16.dtype == dx16.dtype == F16
    assert y16.tobytes() == y32.astype(F16).tobytes()
    assert dx16.tobytes() == dx32.astype(F16).tobytes()
    if not ave:
        numpy.testing.assert_array_equal(arg16, arg32)
        # Independent of the kernels: every output is its window's maximum.
        pad = numpy.pad(x.astype(F32), ((0, 0), (ph, ph + sh), (pw, pw + sw)),
                        constant_values=-numpy.inf)
        for i in range(oh):
            for j in range(ow):
                win = pad[:, i * sh:i * sh + kh, j * sw:j * sw + kw]
                numpy.testing.assert_array_equal(y16[:, i, j], win.max(axis=(1, 2)))


def test_softmax_loss_on_16_bit_scores(half_extra, float_extra):
    """SoftmaxWithLoss's kernels on 16-bit scores (an InnerProduct's top in a
    FLOAT16 net): the float32 build's per-row losses on the same values, bit
    for bit; the score gradient its value rounded once to FLOAT16; the
    losses against a float64 softmax."""
    r = numpy.random.RandomState(13)
    outer, classes, inner = 5, 7, 3
    x = _maps(r, outer, classes, inner, scale=4)
    label = r.randint(0, classes, size=(outer, inner)).astype(F32)
    args = (numpy.uint32(outer), numpy.uint32(classes), numpy.uint32(inner), numpy.int32(0),
            numpy.int32(0))
    rows = outer * inner
    info = numpy.array([rows, 0, 0, 0, 0], F32)        # normalizer, no label error
    top_diff = numpy.array([2.0], F32)
    runs = {}
    for name, emu, dtype in (('16', half_extra, F16), ('32', float_extra, F32)):
        xs = x.astype(dtype)
        rowloss, rowvalid, err = (numpy.zeros(rows, F32), numpy.zeros(rows, F32),
                                  numpy.zeros(2, F32))
        emu.kernel('cp_softmax_loss_rows')((rows,), (32,), (xs, label, rowloss, rowvalid, err) +
                                           args)
        dx = numpy.full(x.shape, numpy.nan, dtype)
        emu.kernel('cp_softmax_loss_bwd')((rows,), (32,), (xs, label, top_diff, info, dx) + args)
        runs[name] = rowloss, rowvalid, dx
    assert runs['16'][0].tobytes() == runs['32'][0].tobytes()
    assert (runs['16'][1] == 1).all()
    assert runs['16'][2].dtype == F16
    assert runs['16'][2].tobytes() == runs['32'][2].astype(F16).tobytes()
    x64 = x.astype(numpy.float64)
    p = numpy.exp(x64 - x64.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    want = -numpy.log(numpy.take_along_axis(p, label.astype(int)[:, None, :], axis=1))[:, 0, :]
    numpy.testing.assert_allclose(runs['16'][0], want.reshape(-1), rtol=1e-5)


def test_bias_gradient_sums_and_filter_accumulation_read_16_bit_maps(half_extra, float_extra):
    """A 16-bit convolution's parameter gradients: the bias gradient's
    channel sums read the 16-bit top diff into FP32, the same bits as the
    float32 build on the same values and a float64 sum within float32's
    rounding; cp_accumulate adds a 16-bit filter gradient to FP32's."""
    r = numpy.random.RandomState(14)
    n, c, s, p = 3, 5, 37, 4
    dy = _maps(r, n, c, s, scale=50)
    db0 = r.standard_normal(c).astype(F32)
    runs = {}
    for name, emu, dtype in (('16', half_extra, F16), ('32', float_extra, F32)):
        db = db0.copy()
        part = numpy.full(c * p, numpy.nan)
        emu.kernel('cp_channel_sum_part')((c * p,), (64,), (
            dy.astype(dtype), part, numpy.uint32(n), numpy.uint32(c), numpy.uint32(s),
            numpy.uint32(p)))
        emu.kernel('cp_channel_sum_apply')((1,), (32,), (part, db, numpy.uint32(c),
                                                         numpy.uint32(p)))
        runs[name] = db
    assert runs['16'].tobytes() == runs['32'].tobytes()
    want = db0.astype(numpy.float64) + dy.astype(numpy.float64).sum(axis=(0, 2))
    numpy.testing.assert_allclose(runs['16'], want, rtol=1e-6)
    m = 1000
    g, acc = _maps(r, m, scale=1000), r.standard_normal(m).astype(F32)
    out = acc.copy()
    half_extra.kernel('cp_accumulate')((3,), (64,), (g, out, numpy.uint32(m)))
    numpy.testing.assert_array_equal(out, acc + g.astype(F32))


@pytest.mark.parametrize('m, c, p, threads', [(37, 5, 4, 32), (600, 70, 3, 64), (9, 3, 9, 32),
                                              (1000, 40, 3, 256), (500, 192, 3, 256)])
def test_channels_last_bias_gradient_sums_each_channel_over_the_rows(
        half_extra, float_extra, m, c, p, threads):
    """cp_channel_sum_part_nhwc: a channels-last top diff (m rows of c)
    summed per channel into FP32, a block's threads across the channels
    (fewer threads than channels too), within float32's rounding of a
    float64 sum; the 16-bit build gives the float32 build's bits on the
    same values, as Caffe's order's kernel does. With fewer channels than
    threads (40 of 256) a block adds 6 rows at once; with 192 the 64
    threads past them stay idle (and write nothing)."""
    r = numpy.random.RandomState(m + c)
    dy = _maps(r, m, c, scale=50)
    db0 = r.standard_normal(c).astype(F32)
    runs = {}
    for name, emu, dtype in (('16', half_extra, F16), ('32', float_extra, F32)):
        db = db0.copy()
        part = numpy.full(c * p, numpy.nan)
        emu.kernel('cp_channel_sum_part_nhwc')((p,), (threads,), (
            dy.astype(dtype), part, numpy.uint32(m), numpy.uint32(c), numpy.uint32(p)))
        emu.kernel('cp_channel_sum_apply_rows')(((c + 31) // 32,), (1024,), (
            part, db, numpy.uint32(c), numpy.uint32(p)))
        runs[name] = db
    assert runs['16'].tobytes() == runs['32'].tobytes()
    want = db0.astype(numpy.float64) + dy.astype(numpy.float64).sum(axis=0)
    numpy.testing.assert_allclose(runs['16'], want, rtol=1e-6)
    # The partials in rows of c (a block's row, then the next block's), each
    # its share of the rows' sum.
    # (Block q takes rows m q // p up to m (q + 1) // p.)
    bounds = [m * q // p for q in range(p + 1)]
    want_rows = [dy[lo:hi].astype(numpy.float64).sum(axis=0) for lo, hi in zip(bounds, bounds[1:])]
    numpy.testing.assert_allclose(part.reshape(p, c), want_rows, rtol=1e-12)


@pytest.mark.parametrize('c, p', [(40, 70), (5, 3)])
def test_the_bias_gradients_partials_are_added_in_a_fixed_order(float_extra, c, p):
    """cp_channel_sum_apply_rows: db[c] += the partials of channel c, 32
    channels a block (two blocks for 40), warp j adding the partials j,
    j + 32, ... and the first warp the 32 warps' sums in order: the same
    doubles as that order in Python, rounded once into db."""
    r = numpy.random.RandomState(c * p)
    part = r.standard_normal((p, c)) * 10.0 ** r.randint(-3, 4, size=(p, c))
    if p > 32:
        # Channel 0 tells the orders apart: in p's order 1e20 swallows the
        # 1, in the warps' order the two 1e20s cancel first.
        part[:, 0] = 0.0
        part[0, 0], part[1, 0], part[32, 0] = 1e20, 1.0, -1e20
    db0 = r.standard_normal(c).astype(F32)
    db = db0.copy()
    float_extra.kernel('cp_channel_sum_apply_rows')(((c + 31) // 32,), (1024,), (
        part.ravel(), db, numpy.uint32(c), numpy.uint32(p)))
    want = []
    for k in range(c):
        warps = []
        for j in range(32):
            a = 0.0
            for q in range(j, p, 32):
                a += float(part[q, k])
            warps.append(a)
        s = 0.0
        for a in warps:
            s += a
        want.append(numpy.float32(db0[k]) + numpy.float32(s))
    assert db.tobytes() == numpy.array(want, dtype=F32).tobytes()
    if p > 32:
        assert db[0] == db0[0] + 1


@pytest.mark.parametrize('m, c, shift', [(30, 16, 0), (30, 16, 3), (7, 5, 0)])
def test_channels_last_bias_add_adds_each_channels_value(half_extra, float_extra, m, c, shift):
    """cp_bias_nhwc: y (m rows of c) + b[c] in float32, rounded once to
    the map's type; 16 channels aligned take the vector loop, misaligned
    or 5 channels the scalar one, with the same values."""
    r = numpy.random.RandomState(m * c + shift)
    y0 = r.standard_normal((m, c)).astype(F32) * 30
    b0 = r.standard_normal(c).astype(F32) * 30
    for emu, dtype in ((half_extra, F16), (float_extra, F32)):
        y = _offset(y0.astype(dtype).ravel(), shift)
        b = _offset(b0.astype(dtype), shift)
        assert (y.ctypes.data % 16 == 0) == (b.ctypes.data % 16 == 0) == (shift == 0)
        want = (y.astype(F32).reshape(m, c) + b.astype(F32)).astype(dtype)
        # With the ReLU after it: the two layers' values, bit for bit.
        want_relu = numpy.maximum(want, dtype(0))
        y_relu = _offset(y, shift)
        emu.kernel('cp_bias_nhwc')((2,), (32,), (y, b, numpy.uint64(m), numpy.uint32(c),
                                                 numpy.uint32(0)))
        assert y.reshape(m, c).tobytes() == want.tobytes()
        emu.kernel('cp_bias_nhwc')((2,), (32,), (y_relu, b, numpy.uint64(m), numpy.uint32(c),
                                                 numpy.uint32(1)))
        assert y_relu.reshape(m, c).tobytes() == want_relu.tobytes()
        assert (want < 0).any() and (want > 0).any()


def test_a_channels_last_filter_gradient_adds_to_the_master_in_caffes_order(half_extra):
    """cp_accumulate_krsc: cuDNN's channels-last filter gradient (K, kh, kw,
    C) added, value for value, to the FP32 master's (K, C, kh, kw)."""
    r = numpy.random.RandomState(16)
    k, c, kh, kw = 4, 3, 5, 2
    g = _maps(r, k, kh, kw, c, scale=10)
    acc = r.standard_normal((k, c, kh, kw)).astype(F32)
    out = acc.copy()
    half_extra.kernel('cp_accumulate_krsc')((2,), (32,), (
        g, out, numpy.uint32(k), numpy.uint32(c), numpy.uint32(kh * kw)))
    numpy.testing.assert_array_equal(out, acc + g.astype(F32).transpose(0, 3, 1, 2))


@pytest.mark.filterwarnings('ignore:overflow encountered in cast:RuntimeWarning')
def test_one_launch_casts_many_weight_arrays_to_16_bits(half):
    """cp_cast_many: each float32 array rounded to the nearest 16-bit value into its
    own copy (NumPy's astype, ties to even), arrays of different sizes in
    one launch; nothing written past a copy's end."""
    r = numpy.random.RandomState(15)
    sizes = [5, 1, 300, 64]
    src = [(r.standard_normal(m) * 10 ** r.uniform(-6, 4.9, m)).astype(F32) for m in sizes]
    src[0][:2] = [65520.0, 2.0 ** -25]          # overflows to inf; rounds to 0 (a tie)
    dst = [numpy.full(m + 1, 7, F16) for m in sizes]      # one guard value each
    ptrs = lambda arrays: numpy.array([a.ctypes.data for a in arrays], numpy.uint64)  # noqa: E731
    offsets = numpy.concatenate([[0], numpy.cumsum(sizes)]).astype(numpy.int64)
    half.kernel('cp_cast_many')((3,), (64,), (ptrs(src), ptrs(dst), offsets,
                                              numpy.int32(len(sizes)), numpy.int64(offsets[-1])))
    for s, d in zip(src, dst):
        assert d[:-1].tobytes() == s.astype(F16).tobytes()
        assert d[-1] == 7
    if F16 is numpy.float16:        # (FLOAT16's range; BFLOAT16 has float32's)
        assert numpy.isinf(dst[0][0]) and dst[0][1] == 0


@pytest.mark.parametrize('grid, threads', [((1,), (32,)), ((2,), (8,)), ((3,), (64,))])
def test_one_launch_zeroes_many_arrays_whatever_their_sizes(half, grid, threads):
    """cp_zero_many: every word of every array zeroed, nothing past an
    array's end, whether a thread's next word lies in the same array, the
    next one or several arrays on (tiny arrays between larger ones), and
    whatever the launch's stride."""
    sizes = [1, 2, 40, 3, 1, 1, 33, 7, 64, 1, 5]
    arrays = [numpy.full(m + 1, 7, numpy.uint32) for m in sizes]     # one guard word each
    ptrs = numpy.array([a.ctypes.data for a in arrays], numpy.uint64)
    offsets = numpy.concatenate([[0], numpy.cumsum(sizes)]).astype(numpy.int64)
    half.kernel('cp_zero_many')(grid, threads, (ptrs, offsets, numpy.int32(len(sizes)),
                                                numpy.int64(offsets[-1])))
    for a in arrays:
        assert not a[:-1].any() and a[-1] == 7


def test_one_launch_casts_filters_into_channels_last_order(half):
    """cp_cast_many_krsc: (K, C, kh, kw) float32 filters of different shapes
    rounded into (K, kh, kw, P) 16-bit copies in one launch (what cuDNN's
    channels-last convolutions read; P > C for an image convolution's
    filters padded to 4 channels, the channels past C zero): NumPy's
    transpose, zero padding and astype; nothing written past a copy's end."""
    r = numpy.random.RandomState(16)
    shapes = [(4, 3, 3, 3), (2, 5, 1, 1), (3, 2, 2, 3), (1, 1, 1, 1), (6, 3, 5, 5)]
    padded = [3, 5, 2, 1, 4]
    src = [r.standard_normal(s).astype(F32) for s in shapes]
    want = []
    for a, p in zip(src, padded):
        w = numpy.zeros(a.shape[:1] + a.shape[2:] + (p,), F32)
        w[..., :a.shape[1]] = a.transpose(0, 2, 3, 1)
        want.append(w.astype(F16))
    dst = [numpy.full(w.size + 1, 7, F16) for w in want]
    ptrs = lambda arrays: numpy.array([a.ctypes.data for a in arrays], numpy.uint64)  # noqa: E731
    cs = numpy.array([(s[1] << 40) | (p << 20) | (s[2] * s[3]) for s, p in zip(shapes, padded)],
                     numpy.uint64)
    sizes = [w.size for w in want]
    offsets = numpy.concatenate([[0], numpy.cumsum(sizes)]).astype(numpy.int64)
    half.kernel('cp_cast_many_krsc')((2,), (32,), (
        ptrs(src), ptrs(dst), cs, offsets, numpy.int32(len(sizes)), numpy.int64(offsets[-1])))
    for w, d in zip(want, dst):
        assert d[:-1].tobytes() == w.tobytes()
        assert d[-1] == 7


@pytest.mark.parametrize('kh, sh, ph, size', [(3, 2, 0, 9), (2, 2, 0, 8), (3, 1, 1, 6),
                                              (3, 3, 0, 10)])
@pytest.mark.parametrize('c', [5, 16])
def test_channels_last_max_pooling_kernels_follow_caffes_order(half_extra, kh, sh, ph, size, c):
    """cp_mpool_*_nhwc: on channels-last maps the same maxima, argmax and
    gradients, value for value, as the Caffe-order kernels on the same
    (transposed) values: overlapping, padded, tiling and clipped windows
    (Caffe's ceil rule leaves a partial last window at size 10). 16
    channels take the kernels' 8-channel vector loops, 5 their scalar ones."""
    r = numpy.random.RandomState(kh * 10 + size)
    n, h, w = 2, size, size if (kh, sh) == (2, 2) else size - 1
    oh = -(-(h + 2 * ph - kh) // sh) + 1
    ow = -(-(w + 2 * ph - kh) // sh) + 1
    geometry = tuple(numpy.int32(v) for v in (h, w, oh, ow, kh, kh, sh, sh, ph, ph))
    x = _maps(r, n, c, h, w, scale=20)
    x[0, 0, :2, :2] = x[0, 0, 0, 0]                     # ties: the first in scan order wins
    dy = _maps(r, n, c, oh, ow)
    total_out, total_in = numpy.uint64(n * c * oh * ow), numpy.uint64(x.size)
    caffe = {'y': numpy.full((n, c, oh, ow), numpy.nan, F16),
             'arg': numpy.full((n, c, oh, ow), 7, numpy.uint8),
             'dx': numpy.full(x.shape, numpy.nan, F16)}
    half_extra.kernel('cp_mpool_fwd')((3,), (64,), (x, caffe['y'], caffe['arg'], total_out) +
                                      geometry)
    half_extra.kernel('cp_mpool_bwd')((3,), (64,), (dy, caffe['arg'], caffe['dx'], total_in) +
                                      geometry)
    last = lambda a: numpy.ascontiguousarray(a.transpose(0, 2, 3, 1))    # NCHW -> NHWC
    nhwc = {'y': numpy.full((n, oh, ow, c), numpy.nan, F16),
            'arg': numpy.full((n, oh, ow, c), 7, numpy.uint8),
            'dx': numpy.full((n, h, w, c), numpy.nan, F16)}
    channels = (numpy.int32(c),)
    assert all(a.ctypes.data % 16 == 0 for a in nhwc.values())     # (the vector loops' need)
    half_extra.kernel('cp_mpool_fwd_nhwc')((3,), (64,), (last(x), nhwc['y'], nhwc['arg'],
                                                         total_out) + channels + geometry)
    half_extra.kernel('cp_mpool_bwd_nhwc')((3,), (64,), (last(dy), nhwc['arg'], nhwc['dx'],
                                                         total_in) + channels + geometry)
    for key in ('y', 'arg', 'dx'):
        assert nhwc[key].tobytes() == last(caffe[key]).tobytes(), key
    if kh == sh and ph == 0 and h == oh * kh and w == ow * kh:
        tiled = numpy.full((n, h, w, c), numpy.nan, F16)
        half_extra.kernel('cp_mpool_bwd_tiled_nhwc')((3,), (64,), (
            last(dy), nhwc['arg'], tiled, total_out) + channels + geometry[2:6])
        assert tiled.tobytes() == last(caffe['dx']).tobytes()
    else:
        assert (kh, sh) != (2, 2)        # (the tiling case above is the 2x2 one)


@pytest.mark.parametrize('c, vec, threads', [(37, False, 0), (40, False, 0), (40, True, 256),
                                             (40, True, 16)])
@pytest.mark.parametrize('p', [1, 3])
def test_channels_last_batchnorm_kernels_follow_the_split_kernels(float_extra, half_extra, p,
                                                                  c, vec, threads):
    """cp_bn_*_nhwc (32-channel tiles; and the _vec forms, CP_V channels a
    thread, where C is a multiple of it) on channels-last maps against the
    split kernels (cp_bn_stats_part, _fwd_apply, _bwd_part, _bwd_apply) on
    the same values in Caffe's order: forward with batch statistics, the
    kept normalized copy and the chain's Scale, bias and ReLU; backward
    with the scale and bias gradients and dx; the moving sums and std alike
    (float32 build, to float32's rounding of sums taken in another order);
    the 16-bit build within a 16-bit step of the float32 one. The vector
    forms with blocks of 16 threads too, so that a thread's rows run
    through their several-rows-at-a-time loops and not only the rest's."""
    r = numpy.random.RandomState(40 + p + c)
    n, h, w = 3, 4, 3
    m, s_ = n * h * w, h * w
    u32, i32 = numpy.uint32, numpy.int32
    maf, eps, corr = F32(0.999), F32(1e-5), F32(m / (m - 1))
    x = (3 * r.standard_normal((n, c, h, w)) + 1).astype(F32)
    dy = r.standard_normal((n, c, h, w)).astype(F32)
    sc, bi = r.standard_normal(c).astype(F32), r.standard_normal(c).astype(F32)
    stats0 = [r.random_sample(c).astype(F32), r.random_sample(c).astype(F32),
              numpy.array([2.0], F32)]
    last = lambda a: numpy.ascontiguousarray(a.transpose(0, 2, 3, 1))
    fwd_flags, bwd_flags = 1 | 2 | 4 | 8 | 16, 1 | 4 | 8 | 16 | 32 | 64 | 128

    def caffe_order(emu, dtype):
        xs, y, xn = x.astype(dtype), numpy.empty(x.shape, dtype), numpy.empty(x.shape, dtype)
        b0, b1, b2 = (a.copy() for a in stats0)
        part, kv, std = numpy.empty(2 * c * p), numpy.empty(c, F32), numpy.empty(c, F32)
        emu.kernel('cp_bn_stats_part')((c * p,), (32,), (xs, part, kv, u32(n), u32(c), u32(s_),
                                                         u32(p)))
        emu.kernel('cp_bn_fwd_apply')((c * p,), (32,), (
            xs, y, xn, b0, b1, b2, std, sc, bi, part, kv, u32(n), u32(c), u32(s_), u32(p),
            i32(fwd_flags), maf, eps, corr))
        dx, dsc, dbi = numpy.empty(x.shape, dtype), numpy.zeros(c, F32), numpy.zeros(c, F32)
        emu.kernel('cp_bn_bwd_part')((c * p,), (32,), (
            dy.astype(dtype), xn, sc, bi, part, u32(n), u32(c), u32(s_), u32(p), i32(bwd_flags)))
        emu.kernel('cp_bn_bwd_apply')((c * p,), (32,), (
            dy.astype(dtype), xn, std, dx, sc, bi, dsc, dbi, part, u32(n), u32(c), u32(s_),
            u32(p), i32(bwd_flags)))
        return {'y': last(y), 'xn': last(xn), 'dx': last(dx), 'b0': b0, 'b1': b1, 'b2': b2,
                'std': std, 'dsc': dsc, 'dbi': dbi}

    def channels_last(emu, dtype):
        xs, y, xn = last(x).astype(dtype), numpy.empty((n, h, w, c), dtype), \
            numpy.empty((n, h, w, c), dtype)
        b0, b1, b2 = (a.copy() for a in stats0)
        part, kv = numpy.empty(2 * c * p), numpy.empty(c, F32)
        std, ms = numpy.empty(c, F32), numpy.empty(c, F32)
        if vec:                 # fused_chain's launch: CP_V channels a thread
            groups = c // (16 // numpy.dtype(dtype).itemsize)
            lanes = max(1, threads // min(groups, threads))
            block, sums, passes, name = (min(groups, threads) * lanes,), (p,), (2,), '%s_nhwc_vec'
        else:
            tiles = (c + 31) // 32
            block, sums, passes, name = (64,), (tiles * p,), (tiles * 7,), '%s_nhwc'
        emu.kernel(name % 'cp_bn_stats_part')(sums, block, (xs, part, kv, u32(m), u32(c), u32(p)))
        float_extra.kernel('cp_bn_stats_nhwc')((c,), (64,), (
            part, kv, b0, b1, b2, std, ms, u32(m), u32(c), u32(p), i32(fwd_flags), maf, eps,
            corr))
        emu.kernel(name % 'cp_bn_apply')(passes, block, (xs, y, xn, ms, std, sc, bi, u32(m),
                                                         u32(c), i32(fwd_flags)))
        dx, dsc, dbi = numpy.empty((n, h, w, c), dtype), numpy.zeros(c, F32), numpy.zeros(c, F32)
        md = numpy.empty(2 * c, F32)
        dys = last(dy).astype(dtype)
        emu.kernel(name % 'cp_bn_bwd_part')(sums, block, (
            dys, xn, sc, bi, part, u32(m), u32(c), u32(p), i32(bwd_flags)))
        float_extra.kernel('cp_bn_bwd_stats_nhwc')((c,), (64,), (
            part, sc, dsc, dbi, md, u32(m), u32(c), u32(p), i32(bwd_flags)))
        emu.kernel(name % 'cp_bn_dx')(passes, block, (dys, xn, std, dx, sc, bi, md, u32(m),
                                                      u32(c), i32(bwd_flags)))
        return {'y': y, 'xn': xn, 'dx': dx, 'b0': b0, 'b1': b1, 'b2': b2, 'std': std,
                'dsc': dsc, 'dbi': dbi}

    want, got = caffe_order(float_extra, F32), channels_last(float_extra, F32)
    assert (got['y'] == 0).any() and (got['y'] > 0).any()        # the chain's ReLU cuts
    for key in want:
        numpy.testing.assert_allclose(got[key], want[key], rtol=2e-6, atol=2e-6, err_msg=key)
    half = channels_last(half_extra, F16)
    for key in ('y', 'xn', 'dx'):
        assert half[key].dtype == F16
        close = numpy.isclose(half[key].astype(F32), got[key], rtol=8 * HALF_ULP,
                              atol=8 * HALF_ULP)
        # dx: where the rounded x_norm * scale + bias lands on the other side
        # of 0, the chain's ReLU passes another gradient (2 of 1,332 in BF16).
        assert close.all() if key != 'dx' else close.mean() > 0.995, key


def test_mask_kernels_on_16_bit_maps(half_extra, float_extra):
    """The masks' kernels (caffeplus.memory.masks) on FLOAT16 maps: max
    pooling with a one-byte argmax, overlapping (3x3, stride 2) and tiling
    (2x2) windows, and ReLU with sign bits: the float32 build's results on
    the same values, each rounded once to FLOAT16, the same argmax and bits."""
    r = numpy.random.RandomState(16)
    n, c, h, w = 2, 3, 8, 8
    x = _maps(r, n * c, h, w, scale=20)
    for kh, sh in ((3, 2), (2, 2)):
        oh = ow = (h - kh) // sh + 1
        geometry = tuple(numpy.int32(v) for v in (h, w, oh, ow, kh, kh, sh, sh, 0, 0))
        total_out, total_in = numpy.uint64(n * c * oh * ow), numpy.uint64(x.size)
        dy = _maps(numpy.random.RandomState(17), n * c, oh, ow)
        runs = {}
        for name, emu, dtype in (('16', half_extra, F16), ('32', float_extra, F32)):
            y = numpy.full((n * c, oh, ow), numpy.nan, dtype)
            arg = numpy.full((n * c, oh, ow), 7, numpy.uint8)
            emu.kernel('cp_mpool_fwd')((3,), (64,), (x.astype(dtype), y, arg, total_out) +
                                       geometry)
            dx = numpy.full(x.shape, numpy.nan, dtype)
            emu.kernel('cp_mpool_bwd')((3,), (64,), (dy.astype(dtype), arg, dx, total_in) +
                                       geometry)
            outs = [y, arg, dx]
            if kh == sh:
                dxt = numpy.full(x.shape, numpy.nan, dtype)
                emu.kernel('cp_mpool_bwd_tiled')((3,), (64,), (
                    dy.astype(dtype), arg, dxt, total_out) + geometry[2:6])
                outs.append(dxt)
            runs[name] = outs
        assert runs['16'][0].dtype == runs['16'][2].dtype == F16
        numpy.testing.assert_array_equal(runs['16'][1], runs['32'][1])
        for got, want in zip(runs['16'][:1] + runs['16'][2:], runs['32'][:1] + runs['32'][2:]):
            assert got.tobytes() == want.astype(F16).tobytes()
    m = 1000
    v, g = _maps(r, m), _maps(r, m)
    v[:5] = [0, -0.0, numpy.nan, numpy.inf, -numpy.inf]
    runs = {}
    for name, emu, dtype in (('16', half_extra, F16), ('32', float_extra, F32)):
        y = numpy.empty(m, dtype)
        bits = numpy.zeros((m + 31) // 32, numpy.uint32)
        emu.kernel('cp_relu_bits_fwd')((2,), (64,), (v.astype(dtype), y, bits, numpy.uint64(m)))
        dx = numpy.empty(m, dtype)
        emu.kernel('cp_relu_bits_bwd')((2,), (64,), (g.astype(dtype), bits, dx, numpy.uint64(m)))
        runs[name] = y, bits, dx
    numpy.testing.assert_array_equal(runs['16'][1], runs['32'][1])
    assert runs['16'][0].tobytes() == runs['32'][0].astype(F16).tobytes()
    assert runs['16'][2].tobytes() == runs['32'][2].astype(F16).tobytes()
    numpy.testing.assert_array_equal(runs['16'][2], numpy.where(runs['16'][0] > 0, g, F16(0)))


def _lrn_reference(x, dy, n, alpha, beta, k):
    """Caffe's ACROSS_CHANNELS LRN in float64: y and dx for (N, C, H, W) maps."""
    x, dy = x.astype(numpy.float64), dy.astype(numpy.float64)
    pre = (n - 1) // 2
    c = x.shape[1]

    def window_sum(v):
        padded = numpy.pad(v, ((0, 0), (pre, pre), (0, 0), (0, 0)))
        return sum(padded[:, j:j + c] for j in range(n))
    scale = k + alpha / n * window_sum(x * x)
    y = x * scale ** -beta
    dx = dy * scale ** -beta - 2 * alpha * beta / n * x * window_sum(dy * y / scale)
    return y, dx


def test_lrn_reference_gradient_is_the_numerical_one():
    r = numpy.random.RandomState(5)
    x, dy = r.standard_normal((1, 4, 2, 1)), r.standard_normal((1, 4, 2, 1))
    n, alpha, beta, k = 3, 0.7, 0.75, 1.5
    _, dx = _lrn_reference(x, dy, n, alpha, beta, k)
    numeric = numpy.zeros_like(x)
    eps = 1e-6
    for i in numpy.ndindex(x.shape):
        hi, lo = x.copy(), x.copy()
        hi[i] += eps
        lo[i] -= eps
        numeric[i] = ((_lrn_reference(hi, dy, n, alpha, beta, k)[0] * dy).sum() -
                      (_lrn_reference(lo, dy, n, alpha, beta, k)[0] * dy).sum()) / (2 * eps)
    numpy.testing.assert_allclose(dx, numeric, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize('c, n, chunk', [(7, 5, 16), (7, 5, 2), (3, 5, 1), (16, 1, 3),
                                         (9, 3, 4), (12, 7, 5), (40, 15, 16), (40, 15, 7)])
def test_lrn_kernels_on_16_bit_maps(half_extra, float_extra, c, n, chunk):
    """cp_lrn_fwd/cp_lrn_bwd (the LRN of BFLOAT16 maps, which cuDNN lacks):
    the float32 build against Caffe's formula in float64, windows wider
    than the channels and chunks of channels (a thread's) of every size
    included; the 16-bit build the float32 build's values on the same
    inputs, rounded once, bit for bit."""
    r = numpy.random.RandomState(21 + c)
    shape = (2, c, 3, 5)
    alpha, beta, k = 1e-1, 0.75, 2.0
    x = _maps(r, *shape, scale=3)
    dy = _maps(r, *shape)
    chunks = -(-c // chunk)
    args = (numpy.uint32(shape[0] * chunks * shape[2] * shape[3]), numpy.int32(c),
            numpy.uint32(shape[2] * shape[3]), numpy.int32(n), F32(alpha / n), F32(k), F32(beta),
            numpy.int32(chunk))
    runs = {}
    for name, emu, dtype in (('16', half_extra, F16), ('32', float_extra, F32)):
        y = numpy.full(shape, numpy.nan, dtype)
        dx = numpy.full(shape, numpy.nan, dtype)
        emu.kernel('cp_lrn_fwd')((2,), (8,), (x.astype(dtype), y) + args)
        emu.kernel('cp_lrn_bwd')((3,), (4,), (x.astype(dtype), y, dy.astype(dtype), dx) + args)
        runs[name] = (y, dx)
    (y16, dx16), (y32, dx32) = runs['16'], runs['32']
    y_ref, dx_ref = _lrn_reference(x, dy, n, alpha, beta, k)
    numpy.testing.assert_allclose(y32, y_ref, rtol=2e-6, atol=1e-6)
    numpy.testing.assert_allclose(dx32, dx_ref, rtol=1e-5, atol=1e-5)
    assert y16.dtype == dx16.dtype == F16
    # The 16-bit backward read its own rounded y: the float32 build's on that y.
    dx32_on_y16 = numpy.full(shape, numpy.nan, F32)
    float_extra.kernel('cp_lrn_bwd')((3,), (4,), (x.astype(F32), y16.astype(F32),
                                                  dy.astype(F32), dx32_on_y16) + args)
    assert y16.tobytes() == y32.astype(F16).tobytes()
    assert dx16.tobytes() == dx32_on_y16.astype(F16).tobytes()


def test_the_lrn_layer_launches_its_kernels_as_they_read_their_arguments(float_extra):
    """CuDNNLRNLayer._run_kernel (its BFLOAT16 route) on float32 maps, the
    kernels emulated: the same top and bottom gradient as the generic LRN
    layer, channels over two chunks and one left over."""
    from caffeplus.blob import Blob
    from caffeplus.layers.cudnn_lrn import KERNEL_CHANNEL_CHUNK, CuDNNLRNLayer
    from caffeplus.layers.vision import LRNLayer
    from caffeplus.proto import caffe_pb2
    param = caffe_pb2.LayerParameter(name='norm', type='LRN')
    param.lrn_param.local_size = 5
    param.lrn_param.alpha = 0.5
    shape = (2, 2 * KERNEL_CHANNEL_CHUNK + 3, 3, 4)
    r = numpy.random.RandomState(17)
    x = (2 * r.standard_normal(shape)).astype(F32)
    dy = r.standard_normal(shape).astype(F32)
    got = {}
    for name, cls in (('kernel', CuDNNLRNLayer), ('generic', LRNLayer)):
        layer = cls(param)
        bottom, top = Blob(shape), Blob()
        layer.setup([bottom], [top])
        bottom.data[...] = x
        if name == 'kernel':
            with emulating(float_extra):
                assert layer._run_kernel('cp_lrn_fwd', shape, (bottom, False), (top, False))
                top.diff[...] = dy
                assert layer._run_kernel('cp_lrn_bwd', shape, (bottom, False), (top, False),
                                         (top, True), (bottom, True))
        else:
            layer.forward([bottom], [top])
            top.diff[...] = dy
            layer.backward([top], [True], [bottom])
        got[name] = top.data.copy(), bottom.diff.copy()
    numpy.testing.assert_allclose(got['kernel'][0], got['generic'][0], rtol=1e-5, atol=1e-6)
    numpy.testing.assert_allclose(got['kernel'][1], got['generic'][1], rtol=1e-4, atol=1e-5)


def test_im2col_16_bit_build_copies_the_maps_values(half_extra, float_extra):
    """cp_im2col's 16-bit build (the cuBLAS convolution of a 16-bit layer):
    the float32 build's columns, each value the 16-bit map's own (zero
    padding included), bit for bit."""
    i32 = kernels.i32
    n, c, h, w = 3, 2, 7, 6
    kh, kw, sh, sw, ph, pw, dh, dw = 3, 2, 2, 1, 1, 0, 1, 2
    oh = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    ow = (w + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    x = _maps(numpy.random.RandomState(31), n, c, h, w)
    for n0, nb in ((0, n), (1, 2)):
        total = c * kh * kw * nb * oh * ow
        args = (numpy.uint64(total), i32(n0), i32(nb), i32(c), i32(h), i32(w), i32(kh), i32(kw),
                i32(oh), i32(ow), i32(sh), i32(sw), i32(ph), i32(pw), i32(dh), i32(dw))
        col16 = numpy.full(total, numpy.nan, F16)
        col32 = numpy.full(total, numpy.nan, F32)
        half_extra.kernel('cp_im2col')((2,), (32,), (x.reshape(-1), col16) + args)
        float_extra.kernel('cp_im2col')((2,), (32,), (x.astype(F32).reshape(-1), col32) + args)
        assert (col32 == 0).any()                   # the padding
        assert col16.tobytes() == col32.astype(F16).tobytes()


_DIV_RCP = r'''
extern "C" __global__ void cp_test_div_rcp(const float* a, const float* b, float* q,
                                           const unsigned n) {
    for (unsigned i = 0; i < n; ++i) q[i] = cp_div_rcp(a[i], b[i], __frcp_rn(b[i]));
}
'''


def test_division_by_a_channels_reciprocal_rounds_as_a_division(sixteen):
    """cp_div_rcp (BatchNorm's channels-last kernels: one reciprocal a
    channel, a product and a correction step a value) gives the correctly
    rounded float quotient, bit for bit NumPy's float32 division, for
    numerators across float's range, denominators across BatchNorm's
    deviations (2^-30 to 2^60), zeros of both signs, infinities and NaN
    (of either); quotients past 1e37 and values under 1e-30 within two units
    in the last place."""
    if sixteen != SIXTEEN_BIT[0][0]:
        pytest.skip('no map type involved: run once')
    emu = build_emulator(COMMON + _DIV_RCP)
    r = numpy.random.RandomState(7)
    n = 400000
    a = (r.uniform(1, 2, n) * numpy.exp2(r.randint(-149, 128, n))).astype(F32)
    a *= numpy.where(r.rand(n) < 0.5, -1, 1).astype(F32)
    b = (r.uniform(1, 2, n) * numpy.exp2(r.randint(-30, 61, n))).astype(F32)
    specials = numpy.array([0.0, -0.0, numpy.inf, -numpy.inf, numpy.nan, 1e-45, -1e-45,
                            1.17e-38, 3.4e38, 1.0], F32)
    a[:len(specials) * 3] = numpy.tile(specials, 3)
    b[:len(specials) * 3] = numpy.repeat(numpy.array([1.5, 0.0, numpy.inf], F32),
                                         len(specials))
    q = numpy.empty(n, F32)
    emu.kernel('cp_test_div_rcp')((1,), (1,), (a, b, q, numpy.uint32(n)))
    with numpy.errstate(divide='ignore', invalid='ignore', over='ignore', under='ignore'):
        want = a / b
    nan = numpy.isnan(want)
    assert (numpy.isnan(q) == nan).all()
    tiny = ((numpy.abs(a) < 1e-30) | (numpy.abs(want) < 1e-30) |
            ((numpy.abs(want) >= 1e37) & numpy.isfinite(want)))
    exact = ~nan & ~tiny
    assert exact.sum() > 0.6 * n and tiny.sum() > 0.1 * n
    assert (q[exact].view(numpy.uint32) == want[exact].view(numpy.uint32)).all(), \
        (a[exact][q[exact] != want[exact]][:5], b[exact][q[exact] != want[exact]][:5])
    ulps = numpy.abs(q[tiny].view(numpy.int32).astype(numpy.int64) -
                     want[tiny].view(numpy.int32).astype(numpy.int64))
    assert ulps.max() <= 2
    assert numpy.signbit(q[a == 0]).tolist() == numpy.signbit(want[a == 0]).tolist()


@pytest.mark.parametrize('n, c', [(5, 37), (1, 3), (3, 16), (15, 20)])
def test_the_channels_last_lrn_gives_caffes_orders_bits(half_extra, float_extra, n, c):
    """cp_lrn_fwd_nhwc / cp_lrn_bwd_nhwc (a thread a value, its window read
    from its pixel's consecutive channels) against cp_lrn_fwd / cp_lrn_bwd
    over the same maps in Caffe's order: the same bits, in the 16-bit
    build and the float32 one (windows cut by both ends of the channels;
    windows wider than the channels)."""
    r = numpy.random.RandomState(n * 100 + c)
    shape = (2, c, 3, 5)
    hw = 15
    alpha_n, k, beta = F32(0.7 / n), F32(1.5), F32(0.75)
    for emu, dtype in ((half_extra, F16), (float_extra, F32)):
        x = (2 * r.standard_normal(shape)).astype(dtype)
        dy = r.standard_normal(shape).astype(dtype)
        chunks = -(-c // 16)
        y, dx = numpy.empty_like(x), numpy.empty_like(x)
        emu.kernel('cp_lrn_fwd')((4,), (64,), (x, y, numpy.uint32(2 * chunks * hw), numpy.int32(c),
                                             numpy.uint32(hw), numpy.int32(n), alpha_n, k, beta,
                                             numpy.int32(16)))
        emu.kernel('cp_lrn_bwd')((4,), (64,), (x, y, dy, dx, numpy.uint32(2 * chunks * hw),
                                               numpy.int32(c), numpy.uint32(hw), numpy.int32(n),
                                               alpha_n, k, beta, numpy.int32(16)))

        def nhwc(a):
            return numpy.ascontiguousarray(a.transpose(0, 2, 3, 1))
        xl, dyl = nhwc(x), nhwc(dy)
        yl, dxl = numpy.empty_like(xl), numpy.empty_like(xl)
        total = numpy.uint32(x.size)
        emu.kernel('cp_lrn_fwd_nhwc')((3,), (64,), (xl, yl, total, numpy.int32(c), numpy.int32(n),
                                                    alpha_n, k, beta))
        emu.kernel('cp_lrn_bwd_nhwc')((3,), (64,), (xl, yl, dyl, dxl, total, numpy.int32(c),
                                                    numpy.int32(n), alpha_n, k, beta))
        assert yl.tobytes() == nhwc(y).tobytes()
        assert dxl.tobytes() == nhwc(dx).tobytes()


def test_the_lrn_layer_runs_channels_last_maps_on_its_kernels(float_extra):
    """CuDNNLRNLayer over channels-last blobs (caffeplus.layout stores them
    so where its CHANNELS_LAST rule allows), the kernels emulated: the
    generic layer's top and bottom gradient, in the blobs' order."""
    from caffeplus.blob import Blob
    from caffeplus.layers.cudnn_lrn import CuDNNLRNLayer
    from caffeplus.layers.vision import LRNLayer
    from caffeplus.proto import caffe_pb2
    param = caffe_pb2.LayerParameter(name='norm', type='LRN')
    param.lrn_param.local_size = 5
    param.lrn_param.alpha = 0.5
    shape = (2, 21, 3, 4)
    r = numpy.random.RandomState(23)
    x = (2 * r.standard_normal(shape)).astype(F32)
    dy = r.standard_normal(shape).astype(F32)
    want = LRNLayer(param)
    bottom, top = Blob(shape), Blob()
    want.setup([bottom], [top])
    bottom.data[...] = x
    want.forward([bottom], [top])
    top.diff[...] = dy
    want.backward([top], [True], [bottom])
    layer = CuDNNLRNLayer(param)
    b, t = Blob(shape), Blob()
    layer.setup([b], [t])
    b.layout = t.layout = 'NHWC'

    def stored(a):      # a map's values as a channels-last blob stores them
        return a.transpose(0, 2, 3, 1).reshape(shape)
    b.data[...] = stored(x)
    with emulating(float_extra):
        layer.forward([b], [t])
        t.diff[...] = stored(dy)
        layer.backward([t], [True], [b])
    numpy.testing.assert_allclose(t.data, stored(top.data), rtol=1e-5, atol=1e-6)
    numpy.testing.assert_allclose(b.diff, stored(bottom.diff), rtol=1e-4, atol=1e-5)
