"""Vision layers: Convolution, Deconvolution, Pooling, SPP, LRN, Im2col, Crop.

Shape rules and forwards against float64 NumPy references written with
direct loops, numerical gradient checks over awkward geometries, and the
Caffe behaviours the reference cases do not pin down (param diffs
accumulate, skipped gradients, parameter errors, stochastic pooling).
"""
import itertools
import math

import numpy
import pytest
from google.protobuf import text_format

import caffeplus
from caffeplus.blob import Blob
from caffeplus.errors import NetError
from caffeplus.im2col import ConvGeometry, c_div
from caffeplus.layer import create_layer
from caffeplus.proto import caffe_pb2
from gradcheck import check_gradient

import caffeplus.layers  # noqa: F401  (registers the layer types)
from caffeplus.layers import vision


def make_layer(text, phase=caffe_pb2.TRAIN):
    lp = caffe_pb2.LayerParameter()
    text_format.Merge(text, lp)
    if not lp.name:
        lp.name = 'test'
    lp.phase = phase
    return create_layer(lp)


def blobs_from(*arrays):
    out = []
    for i, a in enumerate(arrays):
        b = Blob(a.shape, name='bottom_%d' % i)
        b.data = a
        out.append(b)
    return out


def setup(layer, bottom, num_top=1):
    top = [Blob(name='top_%d' % i) for i in range(num_top)]
    layer.setup(bottom, top)
    return top


def run_forward(layer, *arrays, num_top=1):
    bottom = blobs_from(*arrays)
    top = setup(layer, bottom, num_top)
    layer.forward(bottom, top)
    return bottom, top


def distinct(rng, shape, spacing=0.05):
    """Values with no near-ties (MAX pooling gradients are checked by finite
    differences, which must not move the argmax)."""
    n = int(numpy.prod(shape))
    v = (rng.permutation(n) - n / 2.0) * spacing
    return v.reshape(shape).astype(numpy.float32)


# =============================================================================
# float64 references
# =============================================================================
def ref_conv(x, w, b, stride, pad, dil, group):
    x = x.astype(numpy.float64)
    w = w.astype(numpy.float64)
    n, c = x.shape[:2]
    m = w.shape[0]
    nd = x.ndim - 2
    k = w.shape[2:]
    out = [(x.shape[2 + i] + 2 * pad[i] - (dil[i] * (k[i] - 1) + 1)) // stride[i] + 1
           for i in range(nd)]
    xp = numpy.zeros((n, c) + tuple(x.shape[2 + i] + 2 * pad[i] for i in range(nd)))
    xp[(slice(None), slice(None)) + tuple(slice(p, p + s) for p, s in zip(pad, x.shape[2:]))] = x
    y = numpy.zeros((n, m) + tuple(out))
    cg, mg = c // group, m // group
    for o in itertools.product(*[range(d) for d in out]):
        win = xp[(slice(None), slice(None)) +
                 tuple(slice(o[i] * stride[i], o[i] * stride[i] + dil[i] * (k[i] - 1) + 1, dil[i])
                       for i in range(nd))]
        for g in range(group):
            patch = win[:, g * cg:(g + 1) * cg].reshape(n, -1)
            y[(slice(None), slice(g * mg, (g + 1) * mg)) + o] = \
                patch @ w[g * mg:(g + 1) * mg].reshape(mg, -1).T
    if b is not None:
        y += b.reshape((1, -1) + (1,) * nd)
    return y


def ref_deconv(x, w, b, stride, pad, dil, group):
    x = x.astype(numpy.float64)
    w = w.astype(numpy.float64)
    n, c = x.shape[:2]
    nd = x.ndim - 2
    k = w.shape[2:]
    m = w.shape[1] * group
    cg, mg = c // group, m // group
    out = [stride[i] * (x.shape[2 + i] - 1) + dil[i] * (k[i] - 1) + 1 - 2 * pad[i]
           for i in range(nd)]
    full = numpy.zeros((n, m) + tuple(out[i] + 2 * pad[i] for i in range(nd)))
    for i_pos in itertools.product(*[range(d) for d in x.shape[2:]]):
        for kk in itertools.product(*[range(d) for d in k]):
            pos = tuple(i_pos[a] * stride[a] + kk[a] * dil[a] for a in range(nd))
            for g in range(group):
                xv = x[(slice(None), slice(g * cg, (g + 1) * cg)) + i_pos]         # (n, cg)
                wv = w[(slice(g * cg, (g + 1) * cg), slice(None)) + kk]          # (cg, mg)
                full[(slice(None), slice(g * mg, (g + 1) * mg)) + pos] += xv @ wv
    y = full[(slice(None), slice(None)) + tuple(slice(p, p + o) for p, o in zip(pad, out))]
    if b is not None:
        y = y + b.reshape((1, -1) + (1,) * nd)
    return y


def ref_pool(x, method, k, s, p, ceil_mode=True):
    """Caffe's CPU pooling loops, in float64."""
    n, c, h, w = x.shape
    oh, ow = vision.pool_output_shape(h, w, vision.PoolGeometry(k, s, p), ceil_mode)
    y = numpy.zeros((n, c, oh, ow))
    mask = numpy.zeros((n, c, oh, ow), dtype=numpy.int64)
    for i in range(oh):
        for j in range(ow):
            hs, ws = i * s[0] - p[0], j * s[1] - p[1]
            he, we = min(hs + k[0], h + p[0]), min(ws + k[1], w + p[1])
            size = (he - hs) * (we - ws)
            hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
            win = x[:, :, hs:he, ws:we].astype(numpy.float64).reshape(n, c, -1)
            if method == 'max':
                a = win.argmax(axis=2)
                y[:, :, i, j] = win.max(axis=2)
                mask[:, :, i, j] = (hs + a // (we - ws)) * w + ws + a % (we - ws)
            else:
                y[:, :, i, j] = win.sum(axis=2) / size
    return y, mask


# =============================================================================
# Convolution
# =============================================================================
CONV_CASES = [
    # (bottom shape, convolution_param text)
    ((2, 3, 7, 6), 'num_output: 4 kernel_size: 3'),
    ((1, 4, 9, 8), 'num_output: 6 kernel_size: 3 pad: 1 stride: 2 group: 2'),
    ((2, 2, 9, 7), 'num_output: 3 kernel_size: 3 pad: 2 dilation: 2'),
    ((2, 3, 7, 9), 'num_output: 2 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0'),
    ((2, 3, 8, 8), 'num_output: 4 kernel_size: 4 pad: 2 stride: 3'),
    ((1, 6, 5, 5), 'num_output: 3 kernel_size: 1 group: 3 bias_term: false'),
    ((2, 2, 5, 6, 5), 'num_output: 3 kernel_size: 3'),
    ((1, 2, 5, 7, 6), 'num_output: 2 kernel_size: 3 kernel_size: 2 kernel_size: 3 '
                      'stride: 2 stride: 1 stride: 2 pad: 1 pad: 0 pad: 1 '
                      'dilation: 1 dilation: 2 dilation: 1'),
    ((2, 3, 11), 'num_output: 2 kernel_size: 4 stride: 3 pad: 2'),
    ((2, 2, 4, 30), 'num_output: 3 kernel_size: 3 pad: 1'),          # wide rows: batch-major
]

FILLERS = ' weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.5 }'


def _conv_args(layer):
    g = layer.geom
    return g.stride, g.pad, g.dilation, layer.group


@pytest.mark.parametrize('shape,param', CONV_CASES)
def test_conv_forward_matches_float64_reference(shape, param):
    rng = numpy.random.default_rng(1)
    x = rng.standard_normal(shape).astype(numpy.float32)
    layer = make_layer('type: "Convolution" convolution_param { %s %s }' % (param, FILLERS))
    _, top = run_forward(layer, x)
    w = layer.blobs[0].data
    b = layer.blobs[1].data if len(layer.blobs) > 1 else None
    expect = ref_conv(x, w, b, *_conv_args(layer))
    assert top[0].shape == expect.shape
    numpy.testing.assert_allclose(top[0].data, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('shape,param', [
    ((2, 3, 4, 5), 'num_output: 4 kernel_size: 3 stride: 2 pad: 1'),
    ((1, 4, 4, 4), 'num_output: 6 kernel_size: 4 stride: 2 pad: 1 group: 2'),
    ((2, 2, 3, 4), 'num_output: 2 kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 3 dilation: 2'),
    ((1, 2, 3, 2, 3), 'num_output: 2 kernel_size: 2 stride: 2'),
])
def test_deconv_forward_matches_float64_reference(shape, param):
    rng = numpy.random.default_rng(2)
    x = rng.standard_normal(shape).astype(numpy.float32)
    layer = make_layer('type: "Deconvolution" convolution_param { %s %s }' % (param, FILLERS))
    _, top = run_forward(layer, x)
    w = layer.blobs[0].data
    b = layer.blobs[1].data if len(layer.blobs) > 1 else None
    expect = ref_deconv(x, w, b, *_conv_args(layer))
    assert top[0].shape == expect.shape
    numpy.testing.assert_allclose(top[0].data, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('in_size,k,s,p,d', [
    (7, 3, 1, 0, 1), (8, 3, 2, 1, 1), (9, 3, 1, 2, 2), (8, 4, 3, 2, 1), (5, 5, 1, 0, 1),
    (10, 3, 4, 0, 1), (6, 2, 2, 0, 3), (227, 11, 4, 0, 1), (13, 3, 1, 1, 1),
])
def test_conv_and_deconv_output_size_rules(in_size, k, s, p, d):
    g = ConvGeometry((k,), (s,), (p,), (d,))
    extent = d * (k - 1) + 1
    out = g.conv_out_shape((in_size,))[0]
    assert out == (in_size + 2 * p - extent) // s + 1
    assert g.deconv_out_shape((out,))[0] == s * (out - 1) + extent - 2 * p
    layer = make_layer('type: "Convolution" convolution_param { num_output: 1 '
                       'kernel_size: %d stride: %d pad: %d dilation: %d }' % (k, s, p, d))
    top = setup(layer, [Blob((1, 1, in_size, in_size))])
    assert top[0].shape == (1, 1, out, out)


def test_c_division_truncates_toward_zero():
    assert c_div(-1, 2) == 0 and c_div(-3, 2) == -1 and c_div(7, 2) == 3


def test_conv_too_small_input_is_an_error():
    layer = make_layer('name: "c" type: "Convolution" convolution_param { num_output: 1 '
                       'kernel_size: 5 }')
    with pytest.raises(NetError, match='c'):
        setup(layer, [Blob((1, 1, 3, 3))])


def test_deconv_is_adjoint_of_conv():
    """<conv(x; W), y> == <x, deconv(y; W)> for the same weights."""
    rng = numpy.random.default_rng(3)
    param = 'num_output: 4 kernel_size: 3 stride: 2 pad: 1 group: 2 bias_term: false'
    conv = make_layer('type: "Convolution" convolution_param { %s }' % param)
    x = rng.standard_normal((2, 6, 7, 8)).astype(numpy.float32)
    _, ytop = run_forward(conv, x)
    deconv = make_layer('type: "Deconvolution" convolution_param { num_output: 6 '
                        'kernel_size: 3 stride: 2 pad: 1 group: 2 bias_term: false }')
    y = rng.standard_normal(ytop[0].shape).astype(numpy.float32)
    bottom = blobs_from(y)
    top = setup(deconv, bottom)
    assert deconv.blobs[0].shape == conv.blobs[0].shape
    deconv.blobs[0].data = conv.blobs[0].data
    deconv.forward(bottom, top)
    # the deconv output of a 4x4 input is 7x7: compare on that region
    assert top[0].shape == (2, 6, 7, 7)
    lhs = float(numpy.dot(ytop[0].data.astype(numpy.float64).ravel(), y.ravel()))
    rhs = float(numpy.dot(x[:, :, :7, :7].astype(numpy.float64).ravel(),
                          top[0].data.astype(numpy.float64).ravel()))
    assert abs(lhs - rhs) < 1e-3 * max(1.0, abs(lhs))


GRAD_CONV = [
    ((2, 3, 5, 4), 'Convolution', 'num_output: 2 kernel_size: 3'),
    ((1, 4, 5, 5), 'Convolution', 'num_output: 4 kernel_size: 3 pad: 1 stride: 2 group: 2'),
    ((1, 2, 7, 6), 'Convolution', 'num_output: 2 kernel_size: 3 pad: 1 dilation: 2'),
    ((2, 2, 5, 6), 'Convolution',
     'num_output: 3 kernel_h: 3 kernel_w: 2 stride_h: 2 pad_w: 1 pad_h: 0 stride_w: 1'),
    ((1, 2, 4, 5, 4), 'Convolution', 'num_output: 2 kernel_size: 2 pad: 1 stride: 2'),
    ((2, 3, 6), 'Convolution', 'num_output: 2 kernel_size: 3 stride: 2'),
    ((2, 1, 3, 27), 'Convolution', 'num_output: 2 kernel_size: 2 pad: 1'),
    ((2, 1, 2, 26), 'Deconvolution', 'num_output: 2 kernel_size: 3'),
    ((2, 2, 3, 4), 'Deconvolution', 'num_output: 3 kernel_size: 3 stride: 2 pad: 1'),
    ((1, 4, 3, 3), 'Deconvolution', 'num_output: 2 kernel_size: 4 stride: 2 pad: 1 group: 2'),
    ((1, 2, 2, 3, 2), 'Deconvolution', 'num_output: 2 kernel_size: 2 stride: 2 dilation: 1'),
]


@pytest.mark.parametrize('shape,kind,param', GRAD_CONV)
def test_conv_gradients(shape, kind, param):
    rng = numpy.random.default_rng(4)
    layer = make_layer('type: "%s" convolution_param { %s %s }' % (kind, param, FILLERS))
    bottom = blobs_from(rng.uniform(-1, 1, shape).astype(numpy.float32))
    check_gradient(layer, bottom, max_checks=60)


def test_conv_axis_and_two_bottoms():
    """axis 2: leading axes are batch; two bottoms share the weights and
    their weight gradients add."""
    rng = numpy.random.default_rng(5)
    layer = make_layer('type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 '
                       'axis: 2 %s }' % FILLERS)
    a = rng.standard_normal((2, 3, 2, 5, 5)).astype(numpy.float32)
    b = rng.standard_normal((2, 3, 2, 5, 5)).astype(numpy.float32)
    bottom = blobs_from(a, b)
    top = setup(layer, bottom, 2)
    assert top[0].shape == (2, 3, 2, 3, 3) and layer.blobs[0].shape == (2, 2, 3, 3)
    layer.forward(bottom, top)
    w, bias = layer.blobs[0].data, layer.blobs[1].data
    for x, t in zip((a, b), top):
        ref = ref_conv(x.reshape(6, 2, 5, 5), w, bias, (1, 1), (0, 0), (1, 1), 1)
        numpy.testing.assert_allclose(t.data.reshape(ref.shape), ref, rtol=1e-5, atol=1e-5)
    check_gradient(layer, bottom, top=top, max_checks=40)


def test_param_diffs_accumulate_and_skips():
    rng = numpy.random.default_rng(6)
    layer = make_layer('type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 '
                       'pad: 1 %s }' % FILLERS)
    bottom, top = run_forward(layer, rng.standard_normal((2, 3, 5, 5)).astype(numpy.float32))
    top[0].diff = rng.standard_normal(top[0].shape).astype(numpy.float32)
    layer.backward(top, [True], bottom)
    w1, b1, x1 = layer.blobs[0].diff.copy(), layer.blobs[1].diff.copy(), bottom[0].diff.copy()
    layer.backward(top, [True], bottom)
    numpy.testing.assert_allclose(layer.blobs[0].diff, 2 * w1, rtol=1e-6)
    numpy.testing.assert_allclose(layer.blobs[1].diff, 2 * b1, rtol=1e-6)
    numpy.testing.assert_array_equal(bottom[0].diff, x1)          # bottom diff overwritten
    # no bottom gradient, no weight gradient: only the bias diff moves
    bottom[0].diff[...] = 7
    layer.set_param_propagate_down(0, False)
    layer.backward(top, [False], bottom)
    assert (bottom[0].diff == 7).all()
    numpy.testing.assert_allclose(layer.blobs[0].diff, 2 * w1, rtol=1e-6)
    numpy.testing.assert_allclose(layer.blobs[1].diff, 3 * b1, rtol=1e-6)


def test_conv_filler_defaults_and_existing_blobs():
    layer = make_layer('type: "Convolution" convolution_param { num_output: 3 kernel_size: 2 }')
    setup(layer, [Blob((1, 2, 4, 4))])
    assert layer.blobs[0].shape == (3, 2, 2, 2) and layer.blobs[1].shape == (3,)
    assert not layer.blobs[0].data.any() and not layer.blobs[1].data.any()   # constant 0
    layer = make_layer('type: "Deconvolution" convolution_param { num_output: 4 kernel_size: 2 '
                       'group: 2 bias_term: false }')
    setup(layer, [Blob((1, 6, 4, 4))])
    assert len(layer.blobs) == 1 and layer.blobs[0].shape == (6, 2, 2, 2)
    # blobs in the LayerParameter are kept (and checked)
    lp = caffe_pb2.LayerParameter()
    text_format.Merge('name: "c" type: "Convolution" convolution_param { num_output: 1 '
                      'kernel_size: 1 bias_term: false }', lp)
    Blob((1, 2, 1, 1)).to_proto(lp.blobs.add())
    lp.blobs[0].data[:] = [3.0, 4.0]
    layer = create_layer(lp)
    setup(layer, [Blob((1, 2, 2, 2))])
    assert layer.blobs[0].data.ravel().tolist() == [3.0, 4.0]
    lp.blobs[0].shape.dim[1] = 1
    del lp.blobs[0].data[1:]
    with pytest.raises(NetError, match='weight shape'):
        setup(create_layer(lp), [Blob((1, 2, 2, 2))])


@pytest.mark.parametrize('param,bottom_shape,field', [
    ('num_output: 2', (1, 1, 5, 5), 'kernel_size'),
    ('num_output: 2 kernel_size: 3 kernel_size: 3 kernel_size: 3', (1, 1, 5, 5), 'kernel_size'),
    ('num_output: 2 kernel_size: 3 kernel_h: 3 kernel_w: 3', (1, 1, 5, 5), 'kernel_size'),
    ('num_output: 2 kernel_h: 3 kernel_w: 3', (1, 1, 5, 5, 5), 'kernel_h'),
    ('num_output: 2 kernel_size: 0', (1, 1, 5, 5), 'kernel_size'),
    ('num_output: 2 kernel_size: 3 stride: 0', (1, 1, 5, 5), 'stride'),
    ('num_output: 2 kernel_size: 3 stride: 1 stride_h: 2 stride_w: 2', (1, 1, 5, 5), 'stride'),
    ('kernel_size: 3', (1, 1, 5, 5), 'num_output'),
    ('num_output: 3 kernel_size: 3 group: 2', (1, 4, 5, 5), 'num_output'),
    ('num_output: 2 kernel_size: 3 group: 2', (1, 3, 5, 5), 'group'),
    ('num_output: 2 kernel_size: 3 dilation: 1 dilation: 1 dilation: 1', (1, 1, 5, 5), 'dilation'),
])
def test_conv_bad_parameters(param, bottom_shape, field):
    layer = make_layer('name: "conv1" type: "Convolution" convolution_param { %s }' % param)
    with pytest.raises(NetError, match=r'conv1.*%s' % field):
        setup(layer, [Blob(bottom_shape)])


def test_conv_reshape_checks_channels():
    layer = make_layer('name: "conv1" type: "Convolution" convolution_param { num_output: 2 '
                       'kernel_size: 3 }')
    bottom = [Blob((1, 3, 5, 5))]
    top = setup(layer, bottom)
    bottom[0].reshape((2, 3, 7, 6))
    layer.reshape(bottom, top)
    assert top[0].shape == (2, 2, 5, 4)
    bottom[0].reshape((2, 4, 7, 6))
    with pytest.raises(NetError, match='conv1'):
        layer.reshape(bottom, top)


def test_conv_backward_reads_and_workspace():
    layer = make_layer('type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 }')
    setup(layer, [Blob((2, 3, 5, 5))])
    assert layer.backward_reads == {'bottom_data'} and not layer.inplace_ok
    assert layer.workspace_bytes() == 4 * 27 * 2 * 9


# =============================================================================
# Im2col
# =============================================================================
def test_im2col_layout_is_caffes_column_buffer():
    x = numpy.arange(2 * 2 * 4 * 5, dtype=numpy.float32).reshape(2, 2, 4, 5)
    layer = make_layer('type: "Im2col" convolution_param { kernel_size: 2 stride: 2 pad: 1 }')
    _, top = run_forward(layer, x)
    assert top[0].shape == (2, 8, 3, 3)
    col = top[0].data.reshape(2, 2, 2, 2, 3, 3)   # n, c, kh, kw, oh, ow
    for n, c, i, j, oh, ow in itertools.product(range(2), range(2), range(2), range(2),
                                                range(3), range(3)):
        h, w = oh * 2 - 1 + i, ow * 2 - 1 + j
        expect = x[n, c, h, w] if 0 <= h < 4 and 0 <= w < 5 else 0
        assert col[n, c, i, j, oh, ow] == expect


@pytest.mark.parametrize('shape,param', [
    ((2, 2, 5, 6), 'kernel_size: 3 pad: 1 stride: 2'),
    ((1, 2, 6, 5), 'kernel_h: 2 kernel_w: 3 dilation: 2'),
    ((1, 1, 4, 3, 4), 'kernel_size: 2 stride: 1'),
])
def test_im2col_gradients(shape, param):
    rng = numpy.random.default_rng(7)
    layer = make_layer('type: "Im2col" convolution_param { %s }' % param)
    check_gradient(layer, blobs_from(rng.uniform(-1, 1, shape).astype(numpy.float32)),
                   max_checks=60)


# =============================================================================
# Pooling
# =============================================================================
@pytest.mark.parametrize('h,k,s,p,ceil_mode,expect', [
    (7, 3, 2, 1, True, 4), (6, 3, 2, 0, True, 3), (5, 2, 2, 1, True, 3), (5, 2, 2, 0, True, 3),
    (7, 2, 2, 0, False, 3), (6, 3, 2, 0, False, 2), (55, 3, 2, 0, True, 27), (4, 3, 3, 1, True, 2),
    (6, 6, 1, 0, True, 1),
])
def test_pool_output_size_rule(h, k, s, p, ceil_mode, expect):
    g = vision.PoolGeometry((k, k), (s, s), (p, p))
    assert vision.pool_output_shape(h, h, g, ceil_mode) == (expect, expect)


POOL_CASES = [
    ((2, 3, 7, 7), 'kernel_size: 3 stride: 2 pad: 1'),
    ((2, 2, 6, 6), 'kernel_size: 3 stride: 2'),
    ((1, 2, 5, 5), 'kernel_size: 2 stride: 2 pad: 1'),
    ((1, 2, 7, 8), 'kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3 pad_h: 1 pad_w: 1'),
    ((1, 2, 5, 6), 'global_pooling: true'),
    ((1, 2, 7, 7), 'kernel_size: 2 stride: 2 round_mode: FLOOR'),
    ((1, 2, 4, 4), 'kernel_size: 3 stride: 3 pad: 1'),
    ((1, 1, 5, 5), 'kernel_size: 3 stride: 1'),
]


@pytest.mark.parametrize('shape,param', POOL_CASES)
@pytest.mark.parametrize('method', ['MAX', 'AVE'])
def test_pool_forward_matches_reference(shape, param, method):
    rng = numpy.random.default_rng(8)
    x = rng.standard_normal(shape).astype(numpy.float32)
    layer = make_layer('type: "Pooling" pooling_param { pool: %s %s }' % (method, param))
    _, top = run_forward(layer, x, num_top=2 if method == 'MAX' else 1)
    g = layer.pool.geom
    ceil_mode = 'FLOOR' not in param
    y, mask = ref_pool(x, method.lower(), g.kernel, g.stride, g.pad, ceil_mode)
    assert top[0].shape == y.shape
    numpy.testing.assert_allclose(top[0].data, y, rtol=1e-6, atol=1e-6)
    if method == 'MAX':
        numpy.testing.assert_array_equal(top[1].data, mask)


@pytest.mark.parametrize('shape,param', POOL_CASES)
@pytest.mark.parametrize('method', ['MAX', 'AVE'])
def test_pool_gradients(shape, param, method):
    rng = numpy.random.default_rng(9)
    layer = make_layer('type: "Pooling" pooling_param { pool: %s %s }' % (method, param))
    check_gradient(layer, blobs_from(distinct(rng, shape)), max_checks=80)


def test_max_pool_ties_take_the_first_in_scan_order():
    x = numpy.zeros((1, 1, 4, 4), dtype=numpy.float32)
    x[0, 0, 1, 0] = x[0, 0, 0, 1] = 5   # tie in window (0, 0): (0,1) comes first
    layer = make_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }')
    bottom, top = run_forward(layer, x, num_top=2)
    assert top[1].data[0, 0, 0, 0] == 1
    assert top[1].data[0, 0, 1, 1] == 10       # all zeros: the first cell
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    assert bottom[0].diff[0, 0, 0, 1] == 1 and bottom[0].diff[0, 0, 1, 0] == 0
    assert bottom[0].diff.sum() == 4


def test_max_pool_overlapping_windows_sum_their_diffs():
    x = numpy.zeros((1, 1, 3, 3), dtype=numpy.float32)
    x[0, 0, 1, 1] = 1    # the centre is the max of all four 2x2 windows
    layer = make_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 1 }')
    bottom, top = run_forward(layer, x)
    top[0].diff = numpy.array([1, 2, 3, 4], dtype=numpy.float32).reshape(1, 1, 2, 2)
    layer.backward(top, [True], bottom)
    assert bottom[0].diff[0, 0, 1, 1] == 10 and bottom[0].diff.sum() == 10


def test_pool_top_counts_and_reads():
    layer = make_layer('type: "Pooling" pooling_param { pool: AVE kernel_size: 2 }')
    with pytest.raises(NetError):
        setup(layer, [Blob((1, 1, 4, 4))], num_top=2)
    layer = make_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 }')
    setup(layer, [Blob((1, 1, 4, 4))], num_top=2)
    assert layer.backward_reads == frozenset()


@pytest.mark.parametrize('param,field', [
    ('pool: MAX', 'kernel_size'),
    ('pool: MAX kernel_h: 2', 'kernel_h'),
    ('pool: MAX kernel_size: 2 kernel_h: 2 kernel_w: 2', 'kernel_size'),
    ('pool: MAX global_pooling: true kernel_size: 2', 'kernel_size'),
    ('pool: MAX global_pooling: true stride: 2', 'stride'),
    ('pool: MAX kernel_size: 2 pad: 2', 'pad'),
    ('pool: MAX kernel_size: 2 pad: 1 pad_h: 1 pad_w: 1', 'pad'),
    ('pool: MAX kernel_size: 2 stride_h: 1', 'stride'),
    ('pool: STOCHASTIC kernel_size: 3 pad: 1', 'pad'),
    ('pool: MAX kernel_size: 2 stride: 0', 'stride'),
])
def test_pool_bad_parameters(param, field):
    layer = make_layer('name: "pool1" type: "Pooling" pooling_param { %s }' % param)
    with pytest.raises(NetError, match=r'pool1.*%s' % field):
        setup(layer, [Blob((1, 1, 6, 6))])


def test_pool_needs_4d_input():
    layer = make_layer('name: "p" type: "Pooling" pooling_param { pool: MAX kernel_size: 2 }')
    with pytest.raises(NetError, match='4 axes'):
        setup(layer, [Blob((1, 1, 6))])


def test_stochastic_pool_train_and_test():
    rng = numpy.random.default_rng(10)
    x = rng.uniform(0, 1, (2, 3, 7, 6)).astype(numpy.float32)
    param = 'type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 3 stride: 2 }'
    # TEST: sum(x^2) / sum(x) per (clipped) window
    layer = make_layer(param, phase=caffe_pb2.TEST)
    _, top = run_forward(layer, x)
    assert top[0].shape == (2, 3, 3, 3)
    for i, j in itertools.product(range(3), range(3)):
        win = x[:, :, 2 * i:2 * i + 3, 2 * j:2 * j + 3].astype(numpy.float64)
        expect = (win ** 2).sum(axis=(2, 3)) / win.sum(axis=(2, 3))
        numpy.testing.assert_allclose(top[0].data[:, :, i, j], expect, rtol=1e-5)
    # TRAIN: every output is one value of its window; the gradient goes there
    layer = make_layer(param, phase=caffe_pb2.TRAIN)
    bottom, top = run_forward(layer, x)
    top[0].diff = rng.standard_normal(top[0].shape).astype(numpy.float32)
    layer.backward(top, [True], bottom)
    expect_diff = numpy.zeros_like(x)
    for n, c, i, j in itertools.product(range(2), range(3), range(3), range(3)):
        win = x[n, c, 2 * i:2 * i + 3, 2 * j:2 * j + 3]
        hits = numpy.argwhere(win == top[0].data[n, c, i, j])
        assert len(hits) == 1
        h, w = hits[0]
        expect_diff[n, c, 2 * i + h, 2 * j + w] += top[0].diff[n, c, i, j]
    numpy.testing.assert_allclose(bottom[0].diff, expect_diff, rtol=1e-6, atol=1e-7)


def test_stochastic_pool_samples_by_probability():
    x = numpy.array([1, 3, 0, 4], dtype=numpy.float32).reshape(1, 1, 2, 2)
    x = numpy.tile(x, (2000, 1, 1, 1))
    layer = make_layer('type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 2 }')
    caffeplus.set_random_seed(3)
    _, top = run_forward(layer, x)
    vals, counts = numpy.unique(top[0].data, return_counts=True)
    assert 0 not in vals
    freq = dict(zip(vals.tolist(), (counts / 2000.0).tolist()))
    for v, p in ((1, 0.125), (3, 0.375), (4, 0.5)):
        assert abs(freq[v] - p) < 0.05


# =============================================================================
# SPP
# =============================================================================
@pytest.mark.parametrize('method', ['MAX', 'AVE'])
def test_spp_matches_poolings(method):
    rng = numpy.random.default_rng(11)
    x = distinct(rng, (2, 3, 7, 9))
    layer = make_layer('type: "SPP" spp_param { pyramid_height: 3 pool: %s }' % method)
    bottom, top = run_forward(layer, x)
    assert top[0].shape == (2, 3 * (1 + 4 + 16))
    parts = []
    for level in range(3):
        bins = 2 ** level
        kh, kw = math.ceil(7 / bins), math.ceil(9 / bins)
        ph, pw = (kh * bins - 7 + 1) // 2, (kw * bins - 9 + 1) // 2
        y, _ = ref_pool(x, method.lower(), (kh, kw), (kh, kw), (ph, pw))
        assert y.shape[2:] == (bins, bins)
        parts.append(y.reshape(2, -1))
    numpy.testing.assert_allclose(top[0].data, numpy.concatenate(parts, axis=1), rtol=1e-6,
                                  atol=1e-6)
    check_gradient(layer, bottom, top=top, max_checks=80)


def test_spp_height_one_is_4d():
    layer = make_layer('type: "SPP" spp_param { pyramid_height: 1 pool: AVE }')
    _, top = run_forward(layer, numpy.ones((2, 3, 5, 4), dtype=numpy.float32))
    assert top[0].shape == (2, 3, 1, 1) and (top[0].data == 1).all()


@pytest.mark.parametrize('method', ['MAX', 'AVE', 'STOCHASTIC'])
@pytest.mark.parametrize('param, raw', [
    # stride past the input: windows after the first read only padding
    ('kernel_size: 3 stride: 20', ((3, 3), (20, 20), (0, 0))),
    ('kernel_h: 2 kernel_w: 3 stride_h: 30 stride_w: 2', ((2, 3), (30, 2), (0, 0))),
    # kernel past the padded input (the ceil rule allows up to stride - 1 more)
    ('kernel_size: 9 stride: 3', ((9, 9), (3, 3), (0, 0))),
    ('kernel_size: 11 stride: 5 pad: 1', ((11, 11), (5, 5), (1, 1))),
])
def test_pooling_geometry_clipped_to_the_input_is_exact(method, param, raw):
    """The layer clips stride and kernel to the padded input
    (vision.clip_pool_geometry): the same outputs, gradients and mask as the
    raw geometry, bit for bit."""
    if method == 'STOCHASTIC' and raw[2] != (0, 0):
        return
    x = distinct(numpy.random.default_rng(3), (2, 3, 8, 7))
    layer = make_layer('type: "Pooling" pooling_param { pool: %s %s }' % (method, param),
                       phase=caffe_pb2.TEST)
    bottom, top = run_forward(layer, x, num_top=2 if method == 'MAX' else 1)
    geom = vision.PoolGeometry(*raw)
    assert tuple(layer.pool.geom) != tuple(geom)       # it was clipped
    y = numpy.empty(top[0].shape, numpy.float32)
    arg = vision.new_arg(numpy, y.shape, geom) if method != 'AVE' else None
    m = getattr(vision, method)
    vision.pool_forward(m, x, geom, y, arg, train=False)
    numpy.testing.assert_array_equal(top[0].data, y)
    dy = numpy.random.default_rng(4).standard_normal(y.shape).astype(numpy.float32)
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    dx = numpy.empty(x.shape, numpy.float32)
    if method != 'STOCHASTIC':
        vision.pool_backward(m, dy, geom, dx, arg)
        numpy.testing.assert_array_equal(bottom[0].diff, dx)
    if method == 'MAX':
        numpy.testing.assert_array_equal(top[1].data, vision.max_pool_mask(arg, geom, (8, 7)))


# =============================================================================
# LRN
# =============================================================================
def ref_lrn(x, size, alpha, beta, k, region):
    x = x.astype(numpy.float64)
    n, c, h, w = x.shape
    pre = (size - 1) // 2
    if region == 'ACROSS_CHANNELS':
        pad = numpy.zeros((n, c + size - 1, h, w))
        pad[:, pre:pre + c] = x ** 2
        s = k + alpha / size * sum(pad[:, o:o + c] for o in range(size))
    else:
        pad = numpy.zeros((n, c, h + 2 * pre, w + 2 * pre))
        pad[:, :, pre:pre + h, pre:pre + w] = x ** 2
        s = 1 + alpha / size ** 2 * sum(pad[:, :, i:i + h, j:j + w]
                                        for i in range(size) for j in range(size))
    return x * s ** -beta


LRN_CASES = [
    ((2, 7, 3, 4), 'local_size: 5 alpha: 0.5 beta: 0.75 k: 2', 'ACROSS_CHANNELS'),
    ((1, 2, 3, 3), 'local_size: 5 alpha: 1.5 beta: 0.75 k: 1', 'ACROSS_CHANNELS'),
    ((1, 4, 2, 3), 'local_size: 1 alpha: 2 beta: 0.5 k: 1', 'ACROSS_CHANNELS'),
    ((2, 2, 5, 4), 'local_size: 3 alpha: 0.3 beta: 0.6 k: 5', 'WITHIN_CHANNEL'),
    ((1, 2, 6, 5), 'local_size: 5 alpha: 2 beta: 0.75', 'WITHIN_CHANNEL'),
    # windows wider than the input: only the offsets that reach it are visited
    ((1, 3, 3, 4), 'local_size: 9 alpha: 4 beta: 0.75 k: 1.5', 'ACROSS_CHANNELS'),
    ((2, 2, 3, 4), 'local_size: 9 alpha: 4 beta: 0.75', 'WITHIN_CHANNEL'),
    ((1, 2, 1, 6), 'local_size: 7 alpha: 3 beta: 0.5', 'WITHIN_CHANNEL'),
]


@pytest.mark.parametrize('shape,param,region', LRN_CASES)
def test_lrn_forward_and_gradients(shape, param, region):
    rng = numpy.random.default_rng(12)
    x = rng.uniform(-1.5, 1.5, shape).astype(numpy.float32)
    layer = make_layer('type: "LRN" lrn_param { %s norm_region: %s }' % (param, region))
    bottom, top = run_forward(layer, x)
    p = layer.layer_param.lrn_param
    expect = ref_lrn(x, p.local_size, p.alpha, p.beta, p.k, region)
    numpy.testing.assert_allclose(top[0].data, expect, rtol=1e-5, atol=1e-6)
    check_gradient(layer, bottom, top=top, max_checks=80)


def test_lrn_even_size_is_an_error():
    layer = make_layer('name: "norm1" type: "LRN" lrn_param { local_size: 4 }')
    with pytest.raises(NetError, match='norm1.*local_size'):
        setup(layer, [Blob((1, 3, 4, 4))])


# =============================================================================
# Crop
# =============================================================================
@pytest.mark.parametrize('shape_a,shape_b,param,expect_slices', [
    ((2, 3, 8, 9), (2, 3, 5, 6), 'axis: 2 offset: 1 offset: 2',
     (slice(None), slice(None), slice(1, 6), slice(2, 8))),
    ((2, 4, 6, 6), (1, 2, 3, 3), 'axis: 1 offset: 1', (slice(None), slice(1, 3), slice(1, 4), slice(1, 4))),
    ((3, 4, 5), (2, 2, 2), 'axis: 0', (slice(0, 2), slice(0, 2), slice(0, 2))),
    ((2, 3, 7, 5), (9, 9, 4, 3), 'axis: -2 offset: 3 offset: 0',
     (slice(None), slice(None), slice(3, 7), slice(0, 3))),
])
def test_crop(shape_a, shape_b, param, expect_slices):
    rng = numpy.random.default_rng(13)
    a = rng.standard_normal(shape_a).astype(numpy.float32)
    b = rng.standard_normal(shape_b).astype(numpy.float32)
    layer = make_layer('type: "Crop" crop_param { %s }' % param)
    bottom, top = run_forward(layer, a, b)
    numpy.testing.assert_array_equal(top[0].data, a[expect_slices])
    assert not layer.allow_force_backward(1) and layer.allow_force_backward(0)
    bottom[1].diff[...] = 5
    top[0].diff = rng.standard_normal(top[0].shape).astype(numpy.float32)
    layer.backward(top, [True, True], bottom)
    expect = numpy.zeros_like(a)
    expect[expect_slices] = top[0].diff
    numpy.testing.assert_array_equal(bottom[0].diff, expect)
    assert (bottom[1].diff == 5).all()
    check_gradient(layer, bottom, top=top, check_bottom=[0], max_checks=40)


@pytest.mark.parametrize('param,shape_b', [
    ('axis: 1 offset: 1 offset: 1', (2, 3, 4, 4)),     # 2 offsets for 3 axes
    ('axis: 2 offset: 3', (2, 3, 4, 4)),                # 3 + 4 > 6
])
def test_crop_bad_parameters(param, shape_b):
    layer = make_layer('name: "crop" type: "Crop" crop_param { %s }' % param)
    with pytest.raises(NetError, match='crop.*offset'):
        setup(layer, [Blob((2, 3, 6, 6)), Blob(shape_b)])


# =============================================================================
# Through a Net
# =============================================================================
def test_vision_layers_in_a_net(tmp_path):
    net_text = '''
    force_backward: true
    layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 9 dim: 9 } } }
    layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
            convolution_param { num_output: 4 kernel_size: 3 pad: 1
              weight_filler { type: "gaussian" std: 0.1 } } }
    layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" top: "mask"
            pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
    layer { name: "norm" type: "LRN" bottom: "pool" top: "norm" lrn_param { local_size: 3 } }
    layer { name: "up" type: "Deconvolution" bottom: "norm" top: "up"
            convolution_param { num_output: 2 kernel_size: 3 stride: 2
              weight_filler { type: "gaussian" std: 0.1 } } }
    layer { name: "crop" type: "Crop" bottom: "up" bottom: "data" top: "crop" crop_param { axis: 2 } }
    '''
    path = tmp_path / 'net.prototxt'
    path.write_text(net_text)
    net = caffeplus.Net(str(path), caffeplus.TRAIN)
    net.blobs['data'].data = numpy.random.default_rng(0).standard_normal((2, 3, 9, 9))
    net.forward()
    assert net.blobs['pool'].shape == (2, 4, 4, 4)
    assert net.blobs['up'].shape == (2, 2, 9, 9)
    assert net.blobs['crop'].shape == (2, 2, 9, 9)
    net.blobs['crop'].diff[...] = 1
    net.backward()
    assert numpy.isfinite(net.blobs['data'].diff).all()
    assert net.layer_dict['conv'].blobs[0].diff.any()


# =============================================================================
# CPU cache blocking gives the same numbers
# =============================================================================
@pytest.mark.parametrize('kind,param,shape', [
    ('Convolution', 'num_output: 4 kernel_size: 3 pad: 1 stride: 2 group: 2', (5, 4, 7, 6)),
    ('Deconvolution', 'num_output: 4 kernel_size: 3 stride: 2 pad: 1 group: 2', (5, 4, 4, 3)),
    ('Convolution', 'num_output: 3 kernel_size: 3 pad: 1 dilation: 2', (5, 2, 7, 6)),
    ('Convolution', 'num_output: 3 kernel_size: 1', (4, 2, 3, 5)),
    ('Convolution', 'num_output: 2 kernel_size: 2 pad: 1', (3, 2, 4, 3, 5)),
    ('Deconvolution', 'num_output: 3 kernel_size: 3 pad: 1', (5, 2, 4, 5)),
    ('Pooling', 'pool: MAX kernel_size: 3 stride: 2', (3, 5, 9, 8)),
    ('Pooling', 'pool: AVE kernel_size: 3 stride: 2 pad: 1', (3, 5, 9, 8)),
    ('LRN', 'local_size: 3 norm_region: WITHIN_CHANNEL', (3, 5, 6, 7)),
])
def test_chunked_cpu_paths_match(monkeypatch, kind, param, shape):
    from caffeplus import im2col
    field = {'Convolution': 'convolution_param', 'Deconvolution': 'convolution_param',
             'Pooling': 'pooling_param', 'LRN': 'lrn_param'}[kind]
    text = 'type: "%s" %s { %s %s }' % (kind, field, param,
                                        FILLERS if field == 'convolution_param' else '')
    rng = numpy.random.default_rng(14)
    x = distinct(rng, shape)
    results = []
    for budget in (None, 1):
        if budget:
            monkeypatch.setitem(im2col.CPU_CHUNK_BYTES, 'col', budget)
            monkeypatch.setitem(im2col.CPU_CHUNK_BYTES, 'plane', budget)
        caffeplus.set_random_seed(5)
        layer = make_layer(text)
        bottom, top = run_forward(layer, x)
        top[0].diff = numpy.linspace(-1, 1, top[0].count).reshape(top[0].shape)
        for b in layer.blobs:
            b.diff[...] = 0
        layer.backward(top, [True], bottom)
        results.append([top[0].data.copy(), bottom[0].diff.copy()] +
                       [b.diff.copy() for b in layer.blobs])
    for a, b in zip(*results):
        numpy.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# =============================================================================
# GPU (CuPy): the same code through xp gives Caffe's numbers
# =============================================================================
def _vision_cases():
    import os
    from conftest import REFERENCE
    from reference_cases import case_names
    layers_dir = os.path.join(REFERENCE, 'layers')
    return [c for c in case_names(layers_dir)
            if c.startswith(('conv', 'deconv', 'pool', 'spp', 'lrn', 'im2col', 'crop'))]


VISION_CLASSES = {'Convolution': vision.ConvolutionLayer, 'Deconvolution': vision.DeconvolutionLayer,
                  'Pooling': vision.PoolingLayer, 'SPP': vision.SPPLayer, 'LRN': vision.LRNLayer,
                  'Im2col': vision.Im2colLayer, 'Crop': vision.CropLayer}


@pytest.mark.gpu
@pytest.mark.parametrize('case', _vision_cases())
def test_reference_case_on_gpu(case):
    """This module's generic code on CuPy arrays (the class itself, not the
    cuDNN engine a GPU-mode net may choose) against stock Caffe's numbers."""
    import os
    from conftest import REFERENCE
    from reference_cases import tolerances
    from caffeplus import backend
    from caffeplus.io.prototxt import read_net_param
    layers_dir = os.path.join(REFERENCE, 'layers')
    d = numpy.load(os.path.join(layers_dir, case + '.npz'))
    param = read_net_param(os.path.join(layers_dir, case + '.prototxt'))
    lp = [l for l in param.layer if l.name == str(d['layer_name'])][0]
    lp.phase = caffe_pb2.TRAIN if str(d['phase']) == 'TRAIN' else caffe_pb2.TEST
    out_tol, diff_tol = tolerances(str(d['layer_type']), case)
    out_tol = (max(out_tol[0], 1e-4), max(out_tol[1], 1e-5))      # another device's float32
    diff_tol = (max(diff_tol[0], 1e-4), max(diff_tol[1], 1e-4))
    caffeplus.set_mode_gpu()
    try:
        layer = VISION_CLASSES[lp.type](lp)
        nb = len(d['bottom_names'])
        bottom = blobs_from(*[d['bottom_%d' % i] for i in range(nb)])
        top = setup(layer, bottom, len(d['top_names']))
        k = 0
        while 'param_%d' % k in d:
            layer.blobs[k].data = d['param_%d' % k]
            k += 1
        layer.forward(bottom, top)
        assert backend.get_array_module(top[0].data).__name__ == 'cupy'
        for k, t in enumerate(top):
            numpy.testing.assert_allclose(backend.to_numpy(t.data), d['top_%d' % k],
                                          rtol=out_tol[0], atol=out_tol[1])
        if str(d['backward_mode']) == 'none':
            return
        for k, t in enumerate(top):
            t.diff = d['top_diff_%d' % k]
        for b in layer.blobs:
            b.diff[...] = 0
        with_diff = [int(x) for x in d['bottoms_with_diff']]
        layer.backward(top, [i in with_diff for i in range(nb)], bottom)
        for i in with_diff:
            numpy.testing.assert_allclose(backend.to_numpy(bottom[i].diff), d['bottom_diff_%d' % i],
                                          rtol=diff_tol[0], atol=diff_tol[1])
        k = 0
        while 'param_diff_%d' % k in d:
            numpy.testing.assert_allclose(backend.to_numpy(layer.blobs[k].diff),
                                          d['param_diff_%d' % k],
                                          rtol=diff_tol[0], atol=diff_tol[1])
            k += 1
    finally:
        caffeplus.set_mode_cpu()


@pytest.mark.gpu
def test_stochastic_pool_on_gpu():
    from caffeplus import backend
    x = numpy.random.default_rng(3).uniform(0, 1, (2, 3, 7, 6)).astype(numpy.float32)
    caffeplus.set_mode_gpu()
    try:
        for phase in (caffe_pb2.TRAIN, caffe_pb2.TEST):
            layer = make_layer('type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 3 '
                               'stride: 2 }', phase=phase)
            bottom, top = run_forward(layer, x)
            y = backend.to_numpy(top[0].data)
            assert y.shape == (2, 3, 3, 3) and (y > 0).all() and (y <= 1).all()
            top[0].diff[...] = 1
            layer.backward(top, [True], bottom)
            assert float(backend.to_numpy(bottom[0].diff).sum()) == \
                (54 if phase == caffe_pb2.TRAIN else 0)
    finally:
        caffeplus.set_mode_cpu()
