"""An image layer's convolution as im2row + cuBLAS (layers/conv_gemm.py,
`rows`), on the host: cp_im2row, emulated in float32 and the 16-bit types,
writes each output pixel's window in Caffe's (c, i, j) order, zeros past
the window and the padding; the cuBLAS calls over those rows give the
channels-last top and the filter gradient of the float64 convolution;
which layers timed search offers it to."""
import numpy
import pytest

from caffeplus import config
from caffeplus.cudnn import algo_search
from caffeplus.kernel_sources import COMMON
from caffeplus.kernel_sources_extra import EXTRA
from caffeplus.layers import conv_gemm
from conftest import build_emulator
from test_fused_kernels import _caffe_columns, _FakeConvLayer, _FlatMemory, _numpy_type

try:
    import ml_dtypes
    _BF16 = [('__nv_bfloat16', ml_dtypes.bfloat16)]
except ImportError:
    _BF16 = []
TYPES = [('float', numpy.float32), ('__half', numpy.float16)] + _BF16

# n, c, (h, w), m, kernel, stride, pad, dilation: AlexNet's conv1 shrunk,
# a padded stem, a dilated one, a single channel.
GEOMS = [(3, 3, (23, 19), 5, (11, 11), (4, 4), (0, 0), (1, 1)),
         (2, 3, (17, 18), 4, (7, 7), (2, 2), (3, 3), (1, 1)),
         (2, 2, (9, 10), 3, (3, 2), (2, 1), (1, 0), (2, 3)),
         (3, 1, (6, 7), 2, (3, 3), (1, 2), (1, 1), (1, 1))]


@pytest.fixture(scope='module', params=TYPES, ids=lambda t: t[0])
def typed(request):
    """(emulator of EXTRA with CP_A the type, NumPy's type)."""
    cuda_type, dtype = request.param
    head = '' if cuda_type == 'float' else '#define CP_A %s\n' % cuda_type
    return build_emulator(head + COMMON + EXTRA), dtype


def _want_rows(x, layer, n0, nb, kp):
    """Rows (nb*P, kp) of images n0..n0+nb-1: Caffe's columns, zero past K."""
    cols = _caffe_columns(x.astype(numpy.float32), layer)[n0:n0 + nb]     # (nb, K, P)
    rows = numpy.zeros((nb * cols.shape[2], kp), numpy.float32)
    rows[:, :cols.shape[1]] = cols.transpose(0, 2, 1).reshape(-1, cols.shape[1])
    return rows


def _taps(g):
    taps = numpy.full(g.KP, -1, numpy.int32)
    c, i, j = numpy.unravel_index(numpy.arange(g.K), (g.c, g.kh, g.kw))
    taps[:g.K] = c << 16 | i << 8 | j * g.dw
    return taps


@pytest.mark.parametrize('geom', GEOMS)
def test_im2row_kernel_writes_each_pixels_window(typed, geom):
    emu, dtype = typed
    layer = _FakeConvLayer(*geom)
    g = conv_gemm._GemmConv(layer, dtype, nhwc=True)
    assert g.rows and g.KP % 8 == 0 and g.K <= g.KP < g.K + 8
    x = numpy.random.default_rng(geom[0] * 10 + geom[1]).standard_normal(
        (layer.num, layer.channels) + layer.in_spatial).astype(dtype)
    taps = _taps(g)
    i32 = numpy.int32
    for n0, nb in [(0, layer.num), (1, layer.num - 1)]:
        rows = numpy.full(nb * g.P * g.KP, 7, dtype)      # every value written
        emu.kernel('cp_im2row')((nb * g.oh,), (32,), (
            x.reshape(-1), rows, i32(n0), i32(g.c), i32(g.h), i32(g.w), i32(g.kh), i32(g.oh),
            i32(g.ow), i32(g.sh), i32(g.sw), i32(g.ph), i32(g.pw), i32(g.dh),
            i32(g.w + 2 * g.pw), i32(g.KP), taps))
        want = _want_rows(x, layer, n0, nb, g.KP)
        assert rows.astype(numpy.float32).tobytes() == want.tobytes()


class _RowsMemory(_FlatMemory):
    """_FlatMemory with im2row on the host."""

    def im2row(self, x, rows, n0, nb, g):
        layer = _FakeConvLayer(g.n, g.c, (g.h, g.w), g.m, (g.kh, g.kw), (g.sh, g.sw),
                               (g.ph, g.pw), (g.dh, g.dw))
        xs = self.get(x, g.n * g.c * g.h * g.w, g.dtype).reshape(g.n, g.c, g.h, g.w)
        self.put(rows, _want_rows(xs, layer, n0, nb, g.KP).astype(g.dtype))


@pytest.mark.parametrize('geom', GEOMS)
@pytest.mark.parametrize('type_name, rtol', [('float16', 2 ** -10), ('bfloat16', 2 ** -7)])
@pytest.mark.parametrize('chunk', [None, 2])
def test_rows_convolution_plan(geom, type_name, rtol, chunk, monkeypatch):
    """The cuBLAS calls over the rows, chunk by chunk: the channels-last
    top is the float64 convolution of the 16-bit values rounded once, and
    the filter gradient (float32, Caffe's order) adds dy^T rows to the
    master's, the rows' padding never read into it."""
    dtype = _numpy_type(type_name)
    layer = _FakeConvLayer(*geom)
    kp = -(-layer.channels * layer.geom.kernel_count // 8) * 8
    if chunk:
        monkeypatch.setattr(conv_gemm, 'ROWS_CHUNK_BYTES',
                            chunk * kp * int(numpy.prod(layer.out_spatial)) * 2)
    g = conv_gemm._GemmConv(layer, dtype, nhwc=True)
    chunks = list(g.chunks())
    assert g.kinds() == ('fwd', 'bwd_filter') and g.part_bytes == 0
    assert sum(nb for _, nb in chunks) == layer.num
    assert len(chunks) == (-(-layer.num // chunk) if chunk else 1)
    assert g.memory('fwd') == g.memory('bwd_filter') >= g.B * g.P * g.KP * 2
    m, k, p = layer.num_output, g.K, g.P
    rng = numpy.random.default_rng(27)
    x = rng.standard_normal((layer.num, layer.channels) + layer.in_spatial).astype(dtype)
    w = rng.standard_normal((m, k)).astype(dtype)
    wrows = numpy.full((m, g.KP), 0, dtype)
    wrows[:, :k] = w
    dy = rng.standard_normal((layer.num, p, m)).astype(dtype)        # channels-last
    dw0 = rng.standard_normal((m, k)).astype(numpy.float32)
    sizes = [x.nbytes, wrows.nbytes, dy.nbytes, dy.nbytes, dw0.nbytes, g.memory('fwd')]
    addrs = numpy.cumsum([0] + [-(-s // 256) * 256 for s in sizes])
    mem = _RowsMemory(int(addrs[-1]))
    X, W, Y, DY, DW, WS = (int(a) for a in addrs[:-1])
    for addr, a in ((X, x), (W, wrows), (DY, dy), (DW, dw0)):
        mem.put(addr, a)
    g.forward(X, W, Y, WS, ops=mem)
    cols = _caffe_columns(x.astype(numpy.float64), layer)               # (N, K, P)
    want = numpy.einsum('mk,nkp->npm', w.astype(numpy.float64), cols)
    got = mem.get(Y, dy.size, dtype).reshape(want.shape).astype(numpy.float64)
    numpy.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * numpy.abs(want).max())
    g.backward_filter(X, DY, DW, WS, ops=mem)
    dw = dw0 + numpy.einsum('npm,nkp->mk', dy.astype(numpy.float64), cols)
    numpy.testing.assert_allclose(mem.get(DW, dw0.size).reshape(dw.shape), dw, rtol=1e-5,
                                  atol=1e-5)


@pytest.fixture
def rows_weighed():
    with config.using(gemm_search='on'):
        yield


def test_which_layers_take_rows(rows_weighed):
    """Image layers (at most GEMM_MAX_CHANNELS channels, group 1, not 1x1)
    whose taps fit im2row's packing; the gemm_search setting 'off' stops it,
    and 'plan' leaves it to algo_search.GEMM_ROWS_SEARCH (off)."""
    stem = _FakeConvLayer(*GEOMS[0])
    assert conv_gemm._GemmConv.eligible(stem, rows=True)
    wide = _FakeConvLayer(2, 16, (9, 9), 4, (3, 3), (1, 1), (1, 1), (1, 1))
    assert not conv_gemm._GemmConv.eligible(wide, rows=True)
    far = _FakeConvLayer(2, 3, (600, 600), 4, (3, 3), (1, 1), (0, 0), (1, 128))
    assert not conv_gemm._GemmConv.eligible(far, rows=True)
    with pytest.raises(ValueError):
        conv_gemm._GemmConv(far, numpy.float16, nhwc=True)
    # The input rows one output row covers must fit the kernel's shared tile:
    # a 3-channel 11x11 filter over rows of 372 values, not 373.
    for width, ok in ((372, True), (373, False)):
        wide_image = _FakeConvLayer(1, 3, (20, width), 4, (11, 11), (4, 4), (0, 0), (1, 1))
        assert conv_gemm._GemmConv.eligible(wide_image, rows=True) == ok, width
    grouped = _FakeConvLayer(*GEOMS[0])
    grouped.group = 3
    assert not conv_gemm._GemmConv.eligible(grouped, rows=True)
    with config.using(gemm_search='off'):
        assert not conv_gemm._GemmConv.eligible(stem, rows=True)
    with config.using(gemm_search='plan'):
        assert conv_gemm._GemmConv.eligible(stem, rows=True) == \
            bool(algo_search.GEMM_ROWS_SEARCH)
