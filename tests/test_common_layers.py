"""Common layers (layers/common.py): gradients, forward values, Caffe's
tie rules and shape quirks, and the errors bad parameters give."""
import numpy
import pytest
from google.protobuf import text_format

from caffeplus.blob import Blob
from caffeplus.errors import NetError
from caffeplus.layer import create_layer
from caffeplus.proto import caffe_pb2
from gradcheck import check_gradient, make_blobs


def make_layer(type_name, params='', name='L', num_bottom=1):
    lp = caffe_pb2.LayerParameter()
    text_format.Parse(params, lp)
    lp.name, lp.type = name, type_name
    lp.bottom.extend('b%d' % i for i in range(num_bottom))
    return create_layer(lp)


def blobs_from(*arrays):
    out = []
    for i, a in enumerate(arrays):
        b = Blob(numpy.shape(a), name='b%d' % i)
        b.data = numpy.asarray(a, dtype=numpy.float32)
        out.append(b)
    return out


def tops(n):
    return [Blob(name='t%d' % i) for i in range(n)]


def setup(layer, bottom, ntop=1):
    top = tops(ntop)
    layer.setup(bottom, top)
    return top


def run(layer, bottom, ntop=1):
    top = setup(layer, bottom, ntop)
    layer.forward(bottom, top)
    return top


def rng(seed=0):
    return numpy.random.default_rng(seed)


def f64(blob):
    return blob.data.astype(numpy.float64)


# -- InnerProduct -------------------------------------------------------------------
IP_CASES = [
    ((2, 3, 4, 5), 'num_output: 6', 1),
    ((3, 7), 'num_output: 4 bias_term: false', 1),
    ((2, 3, 5), 'num_output: 3 axis: 2', 2),
    ((2, 3, 5), 'num_output: 3 axis: -1', 2),
    ((3, 2, 3), 'num_output: 5 transpose: true', 1),
    ((2, 3, 5), 'num_output: 2 axis: -2 transpose: true', 1),
    ((4, 3), 'num_output: 3 axis: 0', 0),
]
FILLERS = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "uniform" min: -1 max: 1 }'


@pytest.mark.parametrize('shape,params,axis', IP_CASES)
def test_inner_product_forward_and_gradient(shape, params, axis):
    layer = make_layer('InnerProduct', 'inner_product_param { %s %s }' % (params, FILLERS))
    bottom = make_blobs([shape], rng())
    top = run(layer, bottom)
    p = layer.layer_param.inner_product_param
    m = int(numpy.prod(shape[:axis]))
    x = f64(bottom[0]).reshape(m, -1)
    w = f64(layer.blobs[0])
    assert layer.blobs[0].shape == ((x.shape[1], p.num_output) if p.transpose
                                    else (p.num_output, x.shape[1]))
    y = x @ (w if p.transpose else w.T)
    if p.bias_term:
        assert layer.blobs[1].shape == (p.num_output,)
        y += f64(layer.blobs[1])
    else:
        assert len(layer.blobs) == 1
    assert top[0].shape == tuple(shape[:axis]) + (p.num_output,)
    numpy.testing.assert_allclose(top[0].data.reshape(m, -1), y, rtol=1e-5, atol=1e-5)
    check_gradient(layer, bottom, top)


def test_inner_product_param_diffs_accumulate():
    layer = make_layer('InnerProduct', 'inner_product_param { num_output: 3 %s }' % FILLERS)
    bottom = make_blobs([(4, 5)], rng(1))
    top = run(layer, bottom)
    top[0].diff = rng(2).standard_normal((4, 3))
    for b in layer.blobs:
        b.diff[...] = 0
    layer.backward(top, [True], bottom)
    once = [b.diff.copy() for b in layer.blobs]
    numpy.testing.assert_allclose(once[0], top[0].diff.T @ bottom[0].data, rtol=1e-5, atol=1e-6)
    numpy.testing.assert_allclose(once[1], top[0].diff.sum(0), rtol=1e-5, atol=1e-6)
    layer.backward(top, [True], bottom)
    for b, d in zip(layer.blobs, once):
        numpy.testing.assert_allclose(b.diff, 2 * d, rtol=1e-5, atol=1e-6)


def test_inner_product_skips_frozen_params():
    layer = make_layer('InnerProduct', 'inner_product_param { num_output: 3 %s }' % FILLERS)
    bottom = make_blobs([(4, 5)], rng(1))
    top = run(layer, bottom)
    layer.set_param_propagate_down(0, False)
    layer.set_param_propagate_down(1, False)
    top[0].diff = numpy.ones((4, 3))
    layer.backward(top, [True], bottom)
    assert not layer.blobs[0].diff.any() and not layer.blobs[1].diff.any()


def test_inner_product_errors():
    with pytest.raises(NetError, match='L .*num_output'):
        run(make_layer('InnerProduct', ''), make_blobs([(2, 3)], rng()))
    with pytest.raises(NetError, match='L .*inner_product_param.axis'):
        run(make_layer('InnerProduct', 'inner_product_param { num_output: 2 axis: 3 }'),
            make_blobs([(2, 3)], rng()))
    layer = make_layer('InnerProduct', 'inner_product_param { num_output: 2 }')
    bottom = make_blobs([(2, 3)], rng())
    top = run(layer, bottom)
    bottom[0].reshape(2, 4)
    with pytest.raises(NetError, match='L .*incompatible'):
        layer.reshape(bottom, top)


# -- Concat and Slice -----------------------------------------------------------------
@pytest.mark.parametrize('shapes,params,axis', [
    ([(2, 2, 3), (2, 3, 3), (2, 1, 3)], '', 1),
    ([(1, 3, 2), (2, 3, 2)], 'concat_param { axis: 0 }', 0),
    ([(2, 3, 1), (2, 3, 4)], 'concat_param { axis: -1 }', 2),
    ([(2, 3, 1), (2, 3, 2)], 'concat_param { concat_dim: 2 }', 2),
])
def test_concat(shapes, params, axis):
    layer = make_layer('Concat', params, num_bottom=len(shapes))
    bottom = make_blobs(shapes, rng())
    top = run(layer, bottom)
    numpy.testing.assert_array_equal(
        top[0].data, numpy.concatenate([b.data for b in bottom], axis=axis))
    check_gradient(layer, bottom, top)


def test_concat_single_bottom_shares():
    layer = make_layer('Concat', '')
    bottom = make_blobs([(2, 3)], rng())
    top = run(layer, bottom)
    assert top[0].data_storage is bottom[0].data_storage
    assert top[0].diff_storage is bottom[0].diff_storage


def test_concat_errors():
    layer = make_layer('Concat', '', name='joiner', num_bottom=2)
    with pytest.raises(NetError, match='joiner.*same shape'):
        run(layer, make_blobs([(2, 3, 4), (2, 3, 5)], rng()))
    with pytest.raises(NetError, match='joiner.*same shape'):
        run(make_layer('Concat', '', name='joiner', num_bottom=2),
            make_blobs([(2, 3, 4), (2, 3)], rng()))
    with pytest.raises(NetError, match='joiner.*not both'):
        run(make_layer('Concat', 'concat_param { axis: 1 concat_dim: 1 }', name='joiner',
                       num_bottom=2), make_blobs([(2, 3), (2, 3)], rng()))
    with pytest.raises(NetError, match='concat_param.concat_dim'):
        run(make_layer('Concat', 'concat_param { concat_dim: 2 }', num_bottom=2),
            make_blobs([(2, 3), (2, 3)], rng()))


@pytest.mark.parametrize('shape,params,sizes,axis', [
    ((2, 5, 3), 'slice_param { slice_point: 1 slice_point: 3 }', [1, 2, 2], 1),
    ((2, 3, 6), 'slice_param { axis: -1 }', [2, 2, 2], 2),
    ((4, 3), 'slice_param { slice_dim: 0 slice_point: 3 }', [3, 1], 0),
])
def test_slice(shape, params, sizes, axis):
    layer = make_layer('Slice', params)
    bottom = make_blobs([shape], rng())
    top = run(layer, bottom, len(sizes))
    pieces = numpy.split(bottom[0].data, numpy.cumsum(sizes)[:-1], axis=axis)
    for t, piece in zip(top, pieces):
        numpy.testing.assert_array_equal(t.data, piece)
    check_gradient(layer, bottom, top)


def test_slice_errors():
    bad = [('slice_param { slice_point: 2 }', 3, 'slice_point'),
           ('slice_param { slice_point: 2 slice_point: 2 }', 3, 'increasing'),
           ('slice_param { slice_point: 7 }', 2, 'past the end'),
           ('', 4, 'evenly divide'),
           ('slice_param { axis: 1 slice_dim: 1 }', 2, 'not both')]
    for params, ntop, message in bad:
        layer = make_layer('Slice', params, name='cutter')
        with pytest.raises(NetError, match='cutter.*' + message):
            run(layer, make_blobs([(2, 6)], rng()), ntop)


# -- Split and Silence --------------------------------------------------------------
def test_split_gradient_and_inplace_refused():
    layer = make_layer('Split', '')
    bottom = make_blobs([(2, 3, 2)], rng())
    top = run(layer, bottom, 3)
    for t in top:
        numpy.testing.assert_array_equal(t.data, bottom[0].data)
    check_gradient(layer, bottom, top)
    layer = make_layer('Split', '', name='splitter')
    with pytest.raises(NetError, match='splitter.*in-place'):
        layer.setup(bottom, [bottom[0]])


def test_silence_zeroes_bottom_diffs():
    layer = make_layer('Silence', '', num_bottom=2)
    bottom = make_blobs([(2, 3), (4,)], rng())
    for b in bottom:
        b.diff[...] = 5
    setup(layer, bottom, 0)
    layer.forward(bottom, [])
    layer.backward([], [True, False], bottom)
    assert not bottom[0].diff.any() and (bottom[1].diff == 5).all()


# -- Eltwise ------------------------------------------------------------------------
def separated(shape, count, seed=0):
    """Bottoms whose values differ pairwise by >= 0.1 (no MAX ties)."""
    r = rng(seed)
    base = r.permutation(count * int(numpy.prod(shape))).reshape((count,) + shape)
    vals = (base * 0.1 - 0.05 * base.size * 0.1).astype(numpy.float32)
    return blobs_from(*vals)


@pytest.mark.parametrize('params,count', [
    ('', 2), ('eltwise_param { operation: SUM coeff: 0.5 coeff: -2 coeff: 3 }', 3),
    ('eltwise_param { operation: PROD }', 3),
    ('eltwise_param { operation: PROD stable_prod_grad: false }', 3),
    ('eltwise_param { operation: MAX }', 2), ('eltwise_param { operation: MAX }', 4),
])
def test_eltwise(params, count):
    layer = make_layer('Eltwise', params, num_bottom=count)
    op = layer.layer_param.eltwise_param.operation
    shape = (2, 3, 3)
    if op == caffe_pb2.EltwiseParameter.MAX:
        bottom = separated(shape, count)
    else:
        bottom = make_blobs([shape] * count, rng(3), 0.3, 1.5)
        for b in bottom[1::2]:
            b.data = -b.data
    top = run(layer, bottom)
    xs = numpy.stack([f64(b) for b in bottom])
    coeff = list(layer.layer_param.eltwise_param.coeff) or [1.0] * count
    expected = {caffe_pb2.EltwiseParameter.SUM: numpy.tensordot(coeff, xs, 1),
                caffe_pb2.EltwiseParameter.PROD: xs.prod(0),
                caffe_pb2.EltwiseParameter.MAX: xs.max(0)}[op]
    numpy.testing.assert_allclose(top[0].data, expected, rtol=1e-5, atol=1e-6)
    check_gradient(layer, bottom, top, step=1e-3)


def test_eltwise_max_ties_follow_caffe():
    # Bottom 1 wins a tie with bottom 0; bottom 2 must be strictly greater.
    layer = make_layer('Eltwise', 'eltwise_param { operation: MAX }', num_bottom=3)
    bottom = blobs_from([1.0, 2.0, 0.0, 5.0], [1.0, 1.0, 3.0, 5.0], [1.0, 2.0, 3.0, 5.0])
    top = run(layer, bottom)
    numpy.testing.assert_array_equal(top[0].data, [1, 2, 3, 5])
    numpy.testing.assert_array_equal(layer.mask, [1, 0, 1, 1])
    top[0].diff = [10.0, 20.0, 30.0, 40.0]
    layer.backward(top, [True] * 3, bottom)
    numpy.testing.assert_array_equal(bottom[0].diff, [0, 20, 0, 0])
    numpy.testing.assert_array_equal(bottom[1].diff, [10, 0, 30, 40])
    numpy.testing.assert_array_equal(bottom[2].diff, [0, 0, 0, 0])


def test_eltwise_backward_reads_and_errors():
    reads = {p: make_layer('Eltwise', 'eltwise_param { %s }' % p, num_bottom=2).backward_reads
             for p in ('operation: SUM', 'operation: MAX', 'operation: PROD',
                       'operation: PROD stable_prod_grad: false')}
    assert reads == {'operation: SUM': frozenset(), 'operation: MAX': frozenset(),
                     'operation: PROD': {'bottom_data'},
                     'operation: PROD stable_prod_grad: false': {'bottom_data', 'top_data'}}
    with pytest.raises(NetError, match='adder.*coeff'):
        run(make_layer('Eltwise', 'eltwise_param { coeff: 1 }', name='adder', num_bottom=2),
            make_blobs([(2,), (2,)], rng()))
    with pytest.raises(NetError, match='adder.*coeff'):
        run(make_layer('Eltwise', 'eltwise_param { operation: PROD coeff: 1 coeff: 2 }',
                       name='adder', num_bottom=2), make_blobs([(2,), (2,)], rng()))
    with pytest.raises(NetError, match='adder.*same shape'):
        run(make_layer('Eltwise', '', name='adder', num_bottom=2),
            make_blobs([(2, 3), (3, 2)], rng()))


# -- Flatten and Reshape --------------------------------------------------------------
@pytest.mark.parametrize('params,out', [
    ('', (2, 60)), ('flatten_param { axis: 1 end_axis: 2 }', (2, 12, 5)),
    ('flatten_param { axis: -2 }', (2, 3, 20)), ('flatten_param { axis: 0 }', (120,)),
    ('flatten_param { axis: 2 end_axis: 1 }', (2, 3, 1, 4, 5)),
])
def test_flatten(params, out):
    layer = make_layer('Flatten', params)
    bottom = make_blobs([(2, 3, 4, 5)], rng())
    top = run(layer, bottom)
    assert top[0].shape == out
    numpy.testing.assert_array_equal(top[0].data.ravel(), bottom[0].data.ravel())
    check_gradient(layer, bottom, top, max_checks=30)


def test_flatten_errors():
    layer = make_layer('Flatten', '', name='flat')
    b = make_blobs([(2, 3)], rng())
    with pytest.raises(NetError, match='flat.*in-place'):
        layer.setup(b, [b[0]])
    with pytest.raises(NetError, match='flat.*flatten_param.end_axis'):
        run(make_layer('Flatten', 'flatten_param { axis: 2 end_axis: 0 }', name='flat'),
            make_blobs([(2, 3, 4)], rng()))


@pytest.mark.parametrize('params,out', [
    ('shape { dim: 0 dim: -1 dim: 2 }', (2, 30, 2)),
    ('shape { dim: -1 } axis: 1 num_axes: 2', (2, 12, 5)),
    ('shape { dim: 6 dim: 20 }', (6, 20)),
    ('shape { dim: 1 dim: 1 } axis: -1 num_axes: 0', (2, 3, 4, 5, 1, 1)),
    ('shape { dim: 0 dim: 0 dim: -1 dim: 1 } axis: 1', (2, 3, 4, 5, 1)),
    ('shape { dim: 1 dim: 3 } axis: 1 num_axes: 1', (2, 1, 3, 4, 5)),
])
def test_reshape(params, out):
    layer = make_layer('Reshape', 'reshape_param { %s }' % params)
    bottom = make_blobs([(2, 3, 4, 5)], rng())
    top = run(layer, bottom)
    assert top[0].shape == out
    assert top[0].data_storage is bottom[0].data_storage
    numpy.testing.assert_array_equal(top[0].data.ravel(), bottom[0].data.ravel())
    check_gradient(layer, bottom, top, max_checks=30)


@pytest.mark.parametrize('params,message', [
    ('shape { dim: -1 dim: -1 }', 'multiple -1'),
    ('shape { dim: 7 dim: -1 }', 'divisible'),
    ('shape { dim: 5 dim: 5 }', 'count'),
    ('shape { dim: 0 dim: 0 dim: 0 dim: 0 dim: 0 }', 'no corresponding bottom axis'),
    ('shape { dim: 2 } axis: 5', 'reshape_param.axis'),
    ('shape { dim: 2 } axis: 1 num_axes: 4', 'out of range'),
])
def test_reshape_errors(params, message):
    layer = make_layer('Reshape', 'reshape_param { %s }' % params, name='rs')
    with pytest.raises(NetError, match='rs.*' + message):
        run(layer, make_blobs([(2, 3, 4, 5)], rng()))


# -- Softmax ------------------------------------------------------------------------
@pytest.mark.parametrize('shape,axis', [((2, 5, 3), 1), ((3, 4), -1), ((2, 3, 3, 2), 2),
                                         ((4, 3), 0)])
def test_softmax(shape, axis):
    layer = make_layer('Softmax', 'softmax_param { axis: %d }' % axis)
    bottom = make_blobs([shape], rng(), -3, 3)
    top = run(layer, bottom)
    x = f64(bottom[0])
    e = numpy.exp(x - x.max(axis, keepdims=True))
    numpy.testing.assert_allclose(top[0].data, e / e.sum(axis, keepdims=True),
                                  rtol=1e-5, atol=1e-7)
    check_gradient(layer, bottom, top, step=1e-3)


def test_softmax_in_place():
    layer = make_layer('Softmax', '')
    ref = make_layer('Softmax', '')
    x = rng().standard_normal((3, 4)).astype(numpy.float32)
    dy = rng(1).standard_normal((3, 4)).astype(numpy.float32)
    blob = blobs_from(x)[0]
    layer.setup([blob], [blob])
    layer.forward([blob], [blob])
    blob.diff = dy
    layer.backward([blob], [True], [blob])
    b2 = blobs_from(x)
    t2 = run(ref, b2)
    t2[0].diff = dy
    ref.backward(t2, [True], b2)
    numpy.testing.assert_allclose(blob.data, t2[0].data, rtol=1e-6)
    numpy.testing.assert_allclose(blob.diff, b2[0].diff, rtol=1e-6, atol=1e-7)


# -- ArgMax -------------------------------------------------------------------------
def test_argmax_shapes_quirk():
    x = make_blobs([(2, 5, 2, 2)], rng())
    assert run(make_layer('ArgMax', ''), x)[0].shape == (2, 1, 1, 1)
    assert run(make_layer('ArgMax', 'argmax_param { top_k: 3 out_max_val: true }'),
               x)[0].shape == (2, 2, 3, 1)
    assert run(make_layer('ArgMax', 'argmax_param { top_k: 2 }'),
               make_blobs([(4, 6)], rng()))[0].shape == (4, 1, 2)
    assert run(make_layer('ArgMax', ''), make_blobs([(2, 3, 2, 2, 2)], rng()))[0].shape == \
        (2, 1, 1, 1, 1)
    # with an axis, out_max_val gives the values only
    assert run(make_layer('ArgMax', 'argmax_param { axis: 1 top_k: 2 out_max_val: true }'),
               x)[0].shape == (2, 2, 2, 2)


def test_argmax_values_and_ties():
    x = numpy.array([[1, 3, 3, 2, 3], [0, -1, 4, 4, 0]], dtype=numpy.float32)
    top = run(make_layer('ArgMax', 'argmax_param { top_k: 4 out_max_val: true }'),
              blobs_from(x))
    # (value, index) pairs in decreasing order: equal values, larger index first
    numpy.testing.assert_array_equal(top[0].data[:, 0], [[4, 2, 1, 3], [3, 2, 4, 0]])
    numpy.testing.assert_array_equal(top[0].data[:, 1], [[3, 3, 3, 2], [4, 4, 0, 0]])


@pytest.mark.parametrize('axis', [0, 1, 2, -1])
def test_argmax_axis(axis):
    x = rng().standard_normal((3, 4, 5)).astype(numpy.float32)
    idx = run(make_layer('ArgMax', 'argmax_param { axis: %d top_k: 2 }' % axis),
              blobs_from(x))[0].data
    val = run(make_layer('ArgMax', 'argmax_param { axis: %d top_k: 2 out_max_val: true }'
                         % axis), blobs_from(x))[0].data
    order = numpy.flip(numpy.argsort(x, axis=axis), axis=axis)
    expected = numpy.take(order, [0, 1], axis=axis)
    numpy.testing.assert_array_equal(idx, expected)
    numpy.testing.assert_array_equal(val, numpy.take_along_axis(x, expected, axis=axis))


def test_argmax_errors_and_no_backward():
    with pytest.raises(NetError, match='am.*top_k'):
        run(make_layer('ArgMax', 'argmax_param { top_k: 7 }', name='am'),
            make_blobs([(2, 6)], rng()))
    with pytest.raises(NetError, match='am.*top_k'):
        run(make_layer('ArgMax', 'argmax_param { axis: 0 top_k: 3 }', name='am'),
            make_blobs([(2, 6)], rng()))
    with pytest.raises(NetError, match='am.*top_k'):
        run(make_layer('ArgMax', 'argmax_param { top_k: 0 }', name='am'),
            make_blobs([(2, 6)], rng()))
    layer = make_layer('ArgMax', '', name='am')
    b = make_blobs([(2, 6)], rng())
    top = run(layer, b)
    assert not layer.has_backward
    with pytest.raises(NetError, match='am'):
        layer.backward(top, [True], b)


# -- Reduction ------------------------------------------------------------------------
@pytest.mark.parametrize('op', ['SUM', 'ASUM', 'SUMSQ', 'MEAN'])
@pytest.mark.parametrize('shape,axis,coeff', [((2, 3, 4), 0, 1.0), ((2, 3, 5), 1, -0.5),
                                              ((3, 2, 3), -1, 2.5)])
def test_reduction(op, shape, axis, coeff):
    layer = make_layer('Reduction', 'reduction_param { operation: %s axis: %d coeff: %g }'
                       % (op, axis, coeff))
    r = rng()
    x = (r.uniform(0.2, 1.0, shape) * r.choice([-1, 1], shape)).astype(numpy.float32)
    bottom = blobs_from(x)
    top = run(layer, bottom)
    a = axis % len(shape)
    flat = x.astype(numpy.float64).reshape(int(numpy.prod(shape[:a])), -1)
    expected = {'SUM': flat.sum(1), 'ASUM': numpy.abs(flat).sum(1),
                'SUMSQ': (flat ** 2).sum(1), 'MEAN': flat.mean(1)}[op] * coeff
    assert top[0].shape == shape[:a]
    numpy.testing.assert_allclose(top[0].data.reshape(-1), expected, rtol=1e-5, atol=1e-6)
    check_gradient(layer, bottom, top, step=1e-3)
    assert layer.backward_reads == (frozenset() if op in ('SUM', 'MEAN') else {'bottom_data'})


# -- Tile -----------------------------------------------------------------------------
@pytest.mark.parametrize('shape,axis,tiles', [((2, 3, 4), 1, 3), ((3, 2), 0, 2),
                                              ((2, 3, 2), -1, 4), ((2, 1, 3), 2, 1)])
def test_tile(shape, axis, tiles):
    layer = make_layer('Tile', 'tile_param { axis: %d tiles: %d }' % (axis, tiles))
    bottom = make_blobs([shape], rng())
    top = run(layer, bottom)
    numpy.testing.assert_array_equal(top[0].data,
                                     numpy.concatenate([bottom[0].data] * tiles, axis=axis))
    check_gradient(layer, bottom, top)


def test_tile_errors():
    with pytest.raises(NetError, match='tl.*tiles'):
        run(make_layer('Tile', '', name='tl'), make_blobs([(2, 3)], rng()))
    with pytest.raises(NetError, match='tl.*tiles'):
        run(make_layer('Tile', 'tile_param { tiles: 0 }', name='tl'), make_blobs([(2, 3)], rng()))


# -- BatchReindex, Filter, Embed --------------------------------------------------------
def test_batch_reindex():
    layer = make_layer('BatchReindex', '', num_bottom=2)
    bottom = make_blobs([(4, 3, 2)], rng()) + blobs_from([3, 0, 3, 1, 3, 2.7])
    top = run(layer, bottom)
    idx = [3, 0, 3, 1, 3, 2]
    numpy.testing.assert_array_equal(top[0].data, bottom[0].data[idx])
    check_gradient(layer, bottom, top, check_bottom=[0])
    assert layer.allow_force_backward(0) and not layer.allow_force_backward(1)
    top[0].diff = rng(5).standard_normal(top[0].shape)
    layer.backward(top, [True, False], bottom)
    expected = numpy.zeros((4, 3, 2))
    numpy.add.at(expected, idx, top[0].diff.astype(numpy.float64))
    numpy.testing.assert_allclose(bottom[0].diff, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(NetError, match='L.*index'):
        layer.backward(top, [True, True], bottom)


@pytest.mark.parametrize('bad', [[0, 4], [-1, 0]])
def test_batch_reindex_bad_index(bad):
    layer = make_layer('BatchReindex', '', num_bottom=2)
    with pytest.raises(NetError, match='L.*index'):
        run(layer, make_blobs([(4, 3)], rng()) + blobs_from(bad))


def test_filter():
    layer = make_layer('Filter', '', num_bottom=3)
    bottom = make_blobs([(5, 3, 2), (5, 4)], rng()) + blobs_from([[0], [1], [0], [2.5], [1]])
    top = setup(layer, bottom, 2)
    assert top[0].shape == (5, 3, 2)   # Caffe's first reshape keeps the batch size
    layer.forward(bottom, top)
    for t, b in zip(top, bottom):
        numpy.testing.assert_array_equal(t.data, b.data[[1, 3, 4]])
    check_gradient(layer, bottom, top, check_bottom=[0, 1])
    assert [layer.allow_force_backward(i) for i in range(3)] == [True, True, False]
    top[0].diff = numpy.ones(top[0].shape)
    layer.backward(top, [True, False, False], bottom)
    numpy.testing.assert_array_equal(bottom[0].diff[:, 0, 0], [0, 1, 0, 1, 1])
    # nothing selected: empty tops, zero diffs
    bottom[2].data = numpy.zeros((5, 1))
    layer.forward(bottom, top)
    assert top[0].shape == (0, 3, 2) and top[1].shape == (0, 4)
    layer.backward(top, [True, True, False], bottom)
    assert not bottom[0].diff.any() and not bottom[1].diff.any()


def test_filter_errors():
    with pytest.raises(NetError, match='flt.*one top per'):
        run(make_layer('Filter', '', name='flt', num_bottom=2),
            make_blobs([(3, 2), (3,)], rng()), 2)
    with pytest.raises(NetError, match='flt.*0th dimension'):
        run(make_layer('Filter', '', name='flt', num_bottom=2), make_blobs([(3, 2), (4,)], rng()))
    with pytest.raises(NetError, match='flt.*singletons'):
        run(make_layer('Filter', '', name='flt', num_bottom=2),
            make_blobs([(3, 2), (3, 2)], rng()))


def test_embed():
    layer = make_layer('Embed', 'embed_param { num_output: 4 input_dim: 5 %s }' % FILLERS)
    idx = numpy.array([[0, 4, 2], [4, 4, 1]], dtype=numpy.float32)
    bottom = blobs_from(idx)
    top = run(layer, bottom)
    w, bias = f64(layer.blobs[0]), f64(layer.blobs[1])
    assert layer.blobs[0].shape == (5, 4) and top[0].shape == (2, 3, 4)
    numpy.testing.assert_allclose(top[0].data, w[idx.astype(int)] + bias, rtol=1e-6, atol=1e-7)
    check_gradient(layer, bottom, top, check_bottom=[])
    assert not layer.allow_force_backward(0)
    # weight diffs accumulate, repeated indices add up
    top[0].diff = rng(4).standard_normal(top[0].shape)
    for b in layer.blobs:
        b.diff[...] = 1
    layer.backward(top, [False], bottom)
    expected = numpy.ones((5, 4))
    numpy.add.at(expected, idx.astype(int).ravel(), top[0].diff.reshape(-1, 4))
    numpy.testing.assert_allclose(layer.blobs[0].diff, expected, rtol=1e-6, atol=1e-6)
    numpy.testing.assert_allclose(layer.blobs[1].diff, 1 + top[0].diff.reshape(-1, 4).sum(0),
                                  rtol=1e-5, atol=1e-6)
    with pytest.raises(NetError, match='L.*Embed input'):
        layer.backward(top, [True], bottom)


@pytest.mark.parametrize('bad', [[5.0], [-1.0], [1.5]])
def test_embed_bad_index(bad):
    layer = make_layer('Embed', 'embed_param { num_output: 2 input_dim: 5 }')
    with pytest.raises(NetError, match='L.*index'):
        run(layer, blobs_from(bad))


def test_embed_errors():
    with pytest.raises(NetError, match='em.*input_dim'):
        run(make_layer('Embed', 'embed_param { num_output: 2 }', name='em'), blobs_from([0.0]))
    with pytest.raises(NetError, match='em.*num_output'):
        run(make_layer('Embed', 'embed_param { input_dim: 2 }', name='em'), blobs_from([0.0]))


# -- Parameter ------------------------------------------------------------------------
def test_parameter():
    layer = make_layer('Parameter', 'parameter_param { shape { dim: 2 dim: 3 } }', num_bottom=0)
    top = setup(layer, [], 1)
    assert layer.blobs[0].shape == (2, 3) and top[0].shape == (2, 3)
    layer.blobs[0].data = numpy.arange(6).reshape(2, 3)
    layer.forward([], top)
    assert top[0].data_storage is layer.blobs[0].data_storage
    numpy.testing.assert_array_equal(top[0].data, numpy.arange(6).reshape(2, 3))
    check_gradient(layer, [], top)


# -- Accuracy -----------------------------------------------------------------------
def accuracy_reference(scores, labels, top_k, ignore=None):
    """Plain loops over items: Caffe's counting rule."""
    n, c = scores.shape[:2]
    s = scores.reshape(n, c, -1)
    lab = labels.reshape(n, -1).astype(int)
    hits, count = 0, 0
    per_hits, per_count = numpy.zeros(c), numpy.zeros(c)
    for i in range(n):
        for j in range(s.shape[2]):
            y = lab[i, j]
            if ignore is not None and y == ignore:
                continue
            better = sum(s[i, k, j] >= s[i, y, j] for k in range(c)) - 1
            count += 1
            per_count[y] += 1
            if better < top_k:
                hits += 1
                per_hits[y] += 1
    per = numpy.where(per_count > 0, per_hits / numpy.maximum(per_count, 1), 0)
    return hits / count if count else 0.0, per


@pytest.mark.parametrize('shape,params', [
    ((8, 5), ''), ((8, 6), 'accuracy_param { top_k: 3 }'),
    ((3, 4, 2, 3), 'accuracy_param { ignore_label: 2 }'),
    ((6, 4), 'accuracy_param { ignore_label: 1 top_k: 2 }'),
])
def test_accuracy(shape, params):
    layer = make_layer('Accuracy', params, num_bottom=2)
    r = rng(7)
    scores = r.integers(0, 3, shape).astype(numpy.float32)   # many ties
    labels = r.integers(0, shape[1], (shape[0],) + shape[2:]).astype(numpy.float32)
    top = run(layer, blobs_from(scores, labels), 2)
    p = layer.layer_param.accuracy_param
    acc, per = accuracy_reference(scores, labels, p.top_k,
                                  p.ignore_label if p.HasField('ignore_label') else None)
    assert top[0].shape == () and top[1].shape == (shape[1],)
    assert float(top[0].data) == pytest.approx(acc, rel=1e-6)
    numpy.testing.assert_allclose(top[1].data, per, rtol=1e-6)


def test_accuracy_ties_count_against():
    scores = numpy.array([[1, 2, 2], [3, 1, 3], [0, 5, 1]], dtype=numpy.float32)
    top = run(make_layer('Accuracy', '', num_bottom=2), blobs_from(scores, [1, 0, 1]))
    assert float(top[0].data) == pytest.approx(1 / 3.)
    top = run(make_layer('Accuracy', 'accuracy_param { top_k: 2 }', num_bottom=2),
              blobs_from(scores, [1, 0, 1]))
    assert float(top[0].data) == 1.0


def test_accuracy_axis_and_all_ignored():
    scores = rng().standard_normal((2, 3, 4)).astype(numpy.float32)
    labels = numpy.argmax(scores, axis=2).astype(numpy.float32)
    top = run(make_layer('Accuracy', 'accuracy_param { axis: 2 }', num_bottom=2),
              blobs_from(scores, labels))
    assert float(top[0].data) == 1.0
    top = run(make_layer('Accuracy', 'accuracy_param { ignore_label: 0 }', num_bottom=2),
              blobs_from(scores[:, :, 0], [0, 0]), 2)
    assert float(top[0].data) == 0 and not top[1].data.any()


def test_accuracy_errors():
    with pytest.raises(NetError, match='acc.*number of labels'):
        run(make_layer('Accuracy', '', name='acc', num_bottom=2),
            make_blobs([(4, 3), (3,)], rng()))
    with pytest.raises(NetError, match='acc.*top_k'):
        run(make_layer('Accuracy', 'accuracy_param { top_k: 4 }', name='acc', num_bottom=2),
            make_blobs([(4, 3), (4,)], rng()))
    with pytest.raises(NetError, match='acc.*label'):
        run(make_layer('Accuracy', '', name='acc', num_bottom=2), blobs_from([[0, 1]], [2]))
    layer = make_layer('Accuracy', '', name='acc', num_bottom=2)
    assert not layer.has_backward


# -- through a Net --------------------------------------------------------------------
NET = """
name: "n"
layer { name: "in" type: "Input" top: "x" top: "y"
        input_param { shape { dim: 4 dim: 3 dim: 2 } shape { dim: 4 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "h"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "sm" type: "Softmax" bottom: "h" top: "h" }
layer { name: "r" type: "Reduction" bottom: "h" top: "loss" loss_weight: 1
        reduction_param { operation: SUMSQ } }
layer { name: "acc" type: "Accuracy" bottom: "h" bottom: "y" top: "acc" }
"""


def test_net_with_common_layers(tmp_path):
    import caffeplus
    path = tmp_path / 'net.prototxt'
    path.write_text(NET)
    net = caffeplus.Net(str(path), caffeplus.TRAIN)
    x = rng().standard_normal((4, 3, 2)).astype(numpy.float32)
    net.blobs['x'].data = x
    net.blobs['y'].data = [0, 1, 2, 3]
    net.forward()
    w = net.params['ip'][0].data.astype(numpy.float64)
    h = x.reshape(4, 6) @ w.T
    e = numpy.exp(h - h.max(1, keepdims=True))
    p = e / e.sum(1, keepdims=True)
    assert float(net.blobs['loss'].data) == pytest.approx((p ** 2).sum(), rel=1e-5)
    net.clear_param_diffs()
    net.backward()
    assert net.params['ip'][0].diff.any()
    path.write_text('force_backward: true\n' + NET)
    forced = caffeplus.Net(str(path), caffeplus.TRAIN)
    forced.forward()
    with pytest.raises(caffeplus.CaffeplusError, match='acc'):
        forced.backward()


# -- the same numbers under CuPy ---------------------------------------------------
def _gpu_cases():
    r = rng(11)
    x4 = r.standard_normal((2, 3, 4, 5)).astype(numpy.float32)
    x3 = r.standard_normal((2, 6, 3)).astype(numpy.float32)
    ties = r.integers(0, 3, (4, 5, 3)).astype(numpy.float32)
    labels = r.integers(0, 5, (4, 3)).astype(numpy.float32)
    return [
        ('InnerProduct', 'inner_product_param { num_output: 4 %s }' % FILLERS, [x4], 1),
        ('InnerProduct', 'inner_product_param { num_output: 3 axis: -1 transpose: true %s }'
         % FILLERS, [x4], 1),
        ('Concat', 'concat_param { axis: 1 }', [x3, x3[:, :2]], 1),
        ('Slice', 'slice_param { axis: 1 slice_point: 1 slice_point: 4 }', [x3], 3),
        ('Split', '', [x3], 2),
        ('Eltwise', 'eltwise_param { coeff: 0.5 coeff: -2 }', [x3, 2 * x3], 1),
        ('Eltwise', 'eltwise_param { operation: PROD }', [x3, x3 + 1, x3 - 1], 1),
        ('Eltwise', 'eltwise_param { operation: PROD stable_prod_grad: false }', [x3, x3 + 2], 1),
        ('Eltwise', 'eltwise_param { operation: MAX }', [ties, ties[::-1], ties + 1], 1),
        ('Flatten', 'flatten_param { axis: 1 end_axis: 2 }', [x4], 1),
        ('Reshape', 'reshape_param { shape { dim: 0 dim: -1 dim: 2 } }', [x4], 1),
        ('Softmax', 'softmax_param { axis: 2 }', [x4], 1),
        ('ArgMax', 'argmax_param { top_k: 3 out_max_val: true }', [ties], 1),
        ('ArgMax', 'argmax_param { axis: 1 top_k: 2 }', [ties], 1),
        ('Reduction', 'reduction_param { operation: ASUM axis: 1 coeff: 0.5 }', [x4], 1),
        ('Reduction', 'reduction_param { operation: SUMSQ axis: -1 }', [x4], 1),
        ('Reduction', 'reduction_param { operation: MEAN axis: 0 }', [x4], 1),
        ('Tile', 'tile_param { axis: 1 tiles: 3 }', [x3], 1),
        ('BatchReindex', '', [x3, numpy.float32([1, 0, 1, 1])], 1),
        ('Filter', '', [x3, x4, numpy.float32([[0], [3]])], 2),
        ('Embed', 'embed_param { num_output: 3 input_dim: 4 %s }' % FILLERS,
         [numpy.float32([[0, 3, 3], [1, 0, 3]])], 1),
        ('Parameter', 'parameter_param { shape { dim: 2 dim: 3 } }', [], 1),
        ('Accuracy', 'accuracy_param { top_k: 2 ignore_label: 4 }',
         [ties.transpose(0, 2, 1).reshape(12, 5), labels.reshape(12)], 2),
        ('Accuracy', '', [ties, labels[:, :3]], 2),
    ]


def _run_mode(mode, type_name, params, inputs, ntop, params_from=None):
    import caffeplus
    from caffeplus import backend
    caffeplus.set_mode_gpu() if mode == 'gpu' else caffeplus.set_mode_cpu()
    layer = make_layer(type_name, params, num_bottom=len(inputs))
    bottom = blobs_from(*inputs)
    top = setup(layer, bottom, ntop)
    if params_from is not None:
        for mine, theirs in zip(layer.blobs, params_from.blobs):
            mine.data = backend.to_numpy(theirs.data)
    layer.forward(bottom, top)
    out = [backend.to_numpy(t.data).copy() for t in top]
    if layer.has_backward:
        r = rng(12)
        for t in top:
            t.diff = r.standard_normal(t.shape).astype(numpy.float32)
        for b in layer.blobs:
            b.diff[...] = 0
        prop = [layer.allow_force_backward(i) for i in range(len(bottom))]
        layer.backward(top, prop, bottom)
        out += [backend.to_numpy(b.diff).copy() for b, p in zip(bottom, prop) if p]
        out += [backend.to_numpy(b.diff).copy() for b in layer.blobs]
    if type_name == 'Eltwise' and layer.mask is not None:
        out.append(backend.to_numpy(layer.mask))
    return layer, out


@pytest.mark.gpu
@pytest.mark.parametrize('case', range(len(_gpu_cases())))
def test_gpu_matches_cpu(case):
    import caffeplus
    type_name, params, inputs, ntop = _gpu_cases()[case]
    try:
        cpu_layer, cpu = _run_mode('cpu', type_name, params, inputs, ntop)
        _, gpu = _run_mode('gpu', type_name, params, inputs, ntop, params_from=cpu_layer)
    finally:
        caffeplus.set_mode_cpu()
    assert len(cpu) == len(gpu)
    for a, b in zip(cpu, gpu):
        assert a.shape == b.shape
        numpy.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
