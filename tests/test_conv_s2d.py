"""The space-to-depth convolution variant (layers/conv_s2d.py) on the host:
its kernels (cp_space_to_depth, cp_s2d_filter, cp_s2d_filter_grad),
emulated in float32 and the 16-bit types, regroup an image and its filters
so that a stride-1 convolution over the blocks gives the strided
convolution's top, and fold the blocks' filter gradient back into the
strided one's; checked against float64 NumPy convolutions. Which layers
timed search offers it to."""
import types

import numpy
import pytest

from caffeplus.kernel_sources import COMMON
from caffeplus.kernel_sources_extra import EXTRA
from caffeplus.layers import conv_s2d
from conftest import build_emulator

try:
    import ml_dtypes
    _BF16 = [('__nv_bfloat16', ml_dtypes.bfloat16, 2 ** -8)]
except ImportError:
    _BF16 = []
TYPES = [('float', numpy.float32, 2 ** -24), ('__half', numpy.float16, 2 ** -11)] + _BF16


@pytest.fixture(scope='module', params=TYPES, ids=lambda t: t[0])
def typed(request):
    """(emulator of EXTRA with CP_A the type, NumPy's type, half its ulp)."""
    cuda_type, dtype, half_ulp = request.param
    head = '' if cuda_type == 'float' else '#define CP_A %s\n' % cuda_type
    return build_emulator(head + COMMON + EXTRA), dtype, half_ulp


def _ops(emu):
    class EmulatedOps(conv_s2d._DeviceOps):
        @staticmethod
        def kernel(name, dtype):
            return emu.kernel(name)
    return EmulatedOps


def _layer(n, c, h, w, m, k, s, p):
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    geom = types.SimpleNamespace(kernel=(k, k), stride=(s, s), pad=(p, p), dilation=(1, 1))
    return types.SimpleNamespace(geom=geom, num=n, channels=c, in_spatial=(h, w),
                                 num_output=m, out_spatial=(oh, ow), reverse=False, group=1,
                                 num_spatial=2)


def _descs(layer, dtype, nhwc, cx=None):
    x_full = (layer.num, cx or layer.channels) + tuple(layer.in_spatial)
    return types.SimpleNamespace(dtype=numpy.dtype(dtype), nhwc=nhwc, x_full=x_full, y=None,
                                 math=0, loops=1)


def _strided_conv(x, w, s, p):
    """float64 cross-correlation, Caffe's: (N, C, H, W) by (K, C, kh, kw)."""
    n, c, h, wd = x.shape
    k, _, kh, kw = w.shape
    xp = numpy.zeros((n, c, h + 2 * p, wd + 2 * p))
    xp[:, :, p:p + h, p:p + wd] = x
    oh, ow = (h + 2 * p - kh) // s + 1, (wd + 2 * p - kw) // s + 1
    y = numpy.zeros((n, k, oh, ow))
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s]
            y += numpy.einsum('nchw,kc->nkhw', patch, w[:, :, i, j])
    return y, xp


CASES = [  # n, c, h, w, m, k, s, p: AlexNet's conv1 shrunk, ResNet's, odd ones
    (2, 3, 23, 19, 5, 11, 4, 0),
    (2, 3, 17, 18, 4, 7, 2, 3),
    (1, 1, 9, 10, 2, 3, 2, 1),
    (2, 2, 12, 13, 3, 5, 3, 2),
]


@pytest.mark.parametrize('nhwc', [False, True], ids=['caffe_order', 'channels_last'])
@pytest.mark.parametrize('case', CASES)
def test_blocks_convolved_at_stride_one_give_the_strided_convolution(typed, case, nhwc):
    emu, dtype, half_ulp = typed
    n, c, h, w, m, k, s, p = case
    ops = _ops(emu)
    r = numpy.random.RandomState(sum(case))
    x = r.standard_normal((n, c, h, w)).astype(dtype)
    wt = r.standard_normal((m, c, k, k)).astype(dtype)
    layer = _layer(n, c, h, w, m, k, s, p)
    # Channels-last, the image padded to 4 channels as the layer pads it;
    # the padding's values (and filter taps) must not be read.
    cx = 4 if nhwc else c
    g = conv_s2d._SpaceToDepthConv(layer, _descs(layer, dtype, nhwc, cx))
    if nhwc:
        xs = numpy.full((n, h, w, cx), 7, dtype)
        xs[..., :c] = x.transpose(0, 2, 3, 1)
        ws = numpy.full((m, k, k, cx), 7, dtype)
        ws[..., :c] = wt.transpose(0, 2, 3, 1)
    else:
        xs, ws = x, wt
    # The blocks in the layer's order: channels-last, or Caffe's.
    order = (0, 3, 1, 2) if nhwc else (0, 1, 2, 3)
    x2 = numpy.full((n, g.h2, g.w2, g.c2) if nhwc else (n, g.c2, g.h2, g.w2), 7, dtype)
    w2 = numpy.full(g.w2_shape, 7, dtype)                   # every value written
    ops.space_to_depth(xs.ravel(), x2.ravel(), g)
    ops.filters(ws.ravel(), w2.ravel(), g)
    # The bottom read in its own order (the other one, c channels) where
    # the layer would relay it: the same blocks.
    own = numpy.ascontiguousarray(x if nhwc else x.transpose(0, 2, 3, 1))
    x2_own = numpy.full(x2.shape, 7, dtype)
    ops.space_to_depth(own.ravel(), x2_own.ravel(), g, own_order=True)
    assert x2_own.tobytes() == x2.tobytes()
    x2_64 = x2.astype(numpy.float64).transpose(order)       # (N, C s^2, H2, W2)
    w2_64 = w2.astype(numpy.float64).transpose(order)
    want, xp = _strided_conv(x.astype(numpy.float64), wt.astype(numpy.float64), s, p)
    got = _strided_conv(x2_64, w2_64, 1, 0)[0]
    assert got.shape == want.shape
    numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # The filter gradient: over the blocks (as cuDNN writes it, in the
    # maps' type), folded into a float32 one that holds a value already.
    dy = r.standard_normal(want.shape)
    dw2 = numpy.einsum('nkyx,nqyxab->kqab', dy, numpy.lib.stride_tricks.sliding_window_view(
        x2_64, (g.kh2, g.kw2), axis=(2, 3))[:, :, :want.shape[2], :want.shape[3]])
    dw2 = numpy.ascontiguousarray(dw2.transpose(0, 2, 3, 1) if nhwc else dw2).astype(dtype)
    acc = numpy.full((m, c, k, k), 0.5, numpy.float32)
    ops.filter_gradient(dw2.ravel(), acc.ravel(), g)
    oh, ow = want.shape[2:]
    dw = numpy.zeros((m, c, k, k))
    for i in range(k):
        for j in range(k):
            patch = xp[:, :, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s]
            dw[:, :, i, j] = numpy.einsum('nchw,nkhw->kc', patch, dy)
    scale = numpy.abs(dw).max()
    numpy.testing.assert_allclose(acc, 0.5 + dw, rtol=0, atol=4 * half_ulp * scale + 1e-6)


@pytest.mark.parametrize('nhwc', [False, True], ids=['caffe_order', 'channels_last'])
def test_a_slice_of_the_batch_gives_its_share_of_the_blocks(typed, nhwc):
    """The variant over the batch in slices: each slice's blocks, made from
    the bottom at the slice's offset (either order), are the whole batch's
    for those images."""
    emu, dtype, _ = typed
    ops = _ops(emu)
    n, c, h, w, m, k, s, p = 8, 3, 23, 19, 5, 11, 4, 0
    layer = _layer(n, c, h, w, m, k, s, p)
    g = conv_s2d._SpaceToDepthConv(layer, _descs(layer, dtype, nhwc, 4 if nhwc else c))
    assert g.slicings == (1, 2, 4)
    x = numpy.random.RandomState(5).standard_normal((n, c, h, w)).astype(dtype)
    calls = numpy.zeros((n, h, w, 4), dtype) if nhwc else x
    if nhwc:
        calls[..., :c] = x.transpose(0, 2, 3, 1)
    own = numpy.ascontiguousarray(x.transpose(0, 2, 3, 1) if not nhwc else x)
    per_image = g.h2 * g.w2 * g.c2
    whole = numpy.zeros(n * per_image, dtype)
    ops.space_to_depth(calls.ravel(), whole, g)
    for slices in (2, 4):
        for own_order, bottom in ((False, calls), (True, own)):
            nb, x_step, y_step = g.slices(slices, own_order)
            assert nb == n // slices and y_step == nb * m * g.oh * g.ow * x.itemsize
            flat = bottom.ravel()
            for i in range(slices):
                part = numpy.full(nb * per_image, 7, dtype)
                ops.space_to_depth(flat[i * x_step // x.itemsize:], part, g, own_order, nb)
                assert part.tobytes() == whole[i * nb * per_image:(i + 1) * nb * per_image].tobytes()
        assert g.x2_bytes(slices) >= nb * per_image * x.itemsize
        assert g.need('bwd_filter', slices) == g.x2_bytes(slices) + g.dw2_bytes
    assert g.memory('fwd') == g.x2_bytes(1) and g.least_memory('fwd') == g.x2_bytes(4)


def test_timed_search_offers_it_to_strided_image_convolutions(monkeypatch):
    from caffeplus.cudnn import algo_search
    eligible = conv_s2d._SpaceToDepthConv.eligible
    layer = _layer(2, 3, 23, 19, 5, 11, 4, 0)
    half = _descs(layer, numpy.float16, True, 4)
    assert eligible(layer, half) and eligible(layer, _descs(layer, numpy.float32, False))
    monkeypatch.setattr(algo_search, 'S2D_SEARCH_SIXTEEN_BIT', False)
    assert not eligible(layer, half) and eligible(layer, _descs(layer, numpy.float32, False))
    monkeypatch.setattr(algo_search, 'S2D_SEARCH_SIXTEEN_BIT', True)
    for change in ({'channels': conv_s2d.S2D_MAX_CHANNELS + 1}, {'group': 3},
                   {'reverse': True}):
        other = _layer(2, 3, 23, 19, 5, 11, 4, 0)
        other.__dict__.update(change)
        assert not eligible(other, half), change
    for geom in ({'stride': (1, 1)}, {'stride': (4, 2)}, {'dilation': (2, 2)},
                 {'kernel': (3, 3), 'stride': (4, 4)}):
        other = _layer(2, 3, 23, 19, 5, 11, 4, 0)
        other.geom.__dict__.update(geom)
        assert not eligible(other, half), geom
    sliced = _descs(layer, numpy.float16, True, 4)
    sliced.loops = 2
    assert not eligible(layer, sliced)


def test_its_choices_carry_the_slicing_and_the_inner_algorithm():
    """A variant's choice names cuDNN's algorithm of its inner call and the
    batch slicing."""
    from caffeplus.cudnn import algo_search, api
    for j, slices, suffix in ((0, 1, '/space-to-depth '), (1, 2, '/space-to-depth/halves'),
                              (3, 8, '/space-to-depth/eighths')):
        c = api.AlgoChoice('fwd', algo_search.S2D_ALGO + 10 * j + 1, 1024, 0.1, True,
                           api.TENSOR_OP_MATH, variant=algo_search.S2D_VARIANT)
        assert api.s2d_parts(c.algo) == (slices, 1)
        assert c.name == 'IMPLICIT_PRECOMP_GEMM'
        assert suffix in repr(c)
        assert conv_s2d.SLICINGS[j] == slices
