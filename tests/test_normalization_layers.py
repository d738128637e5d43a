"""Normalization layers (layers/normalization.py): BatchNorm, MVN, Bias, Scale.
Gradients, forward values against float64 formulas, Caffe's statistics
bookkeeping, in-place runs, the declared backward reads, and errors."""
import re

import numpy
import pytest
from google.protobuf import text_format

import caffeplus
from caffeplus.blob import Blob
from caffeplus.errors import NetError
from caffeplus.io.prototxt import parse_text
from caffeplus.layer import create_layer
from caffeplus.proto import caffe_pb2
from gradcheck import check_gradient

F32 = numpy.float32
TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


def make_layer(type_name, params='', phase=TRAIN, name='L', num_bottom=1):
    lp = caffe_pb2.LayerParameter()
    text_format.Merge(params, lp)
    lp.name, lp.type, lp.phase = name, type_name, phase
    lp.bottom.extend('b%d' % i for i in range(num_bottom))
    lp.top.append('t')
    return create_layer(lp)


def blob(x, name='b'):
    b = Blob(numpy.shape(x), name=name)
    b.data = numpy.asarray(x, dtype=F32)
    return b


def rand(shape, seed=0, low=-1.0, high=1.0):
    return numpy.random.default_rng(seed).uniform(low, high, size=shape).astype(F32)


def run(layer, xs, dy=None, in_place=False, params=None, propagate=None):
    """Set up, (set params), forward, and backward if dy is given.
    Returns (top, bottom diffs, param diffs) as numpy copies."""
    bottom = [blob(x, 'b%d' % i) for i, x in enumerate(xs)]
    top = [bottom[0]] if in_place else [Blob(name='t')]
    layer.setup(bottom, top)
    if params is not None:
        for b, v in zip(layer.blobs, params):
            b.data = v
    layer.forward(bottom, top)
    y = top[0].data.copy()
    if dy is None:
        return y, None, None
    top[0].diff = dy
    for b in layer.blobs:
        b.diff[...] = 0
    layer.backward(top, propagate or [True] * len(bottom), bottom)
    return y, [b.diff.copy() for b in bottom], [b.diff.copy() for b in layer.blobs]


def assert_same_run(a, b, exact=True):
    check = numpy.testing.assert_array_equal if exact else \
        (lambda u, v: numpy.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-7))
    check(a[0], b[0])
    for u, v in zip(a[1], b[1]):
        check(u, v)
    for u, v in zip(a[2], b[2]):
        check(u, v)


# -- BatchNorm -------------------------------------------------------------------------
BN_SHAPES = [(2, 3, 4, 5), (5, 4), (3, 2, 3), (2, 3, 2, 3, 2)]


def bn_reference(x, mean, var, eps):
    c = x.shape[1] if x.ndim > 1 else 1
    shape = (1, c) + (1,) * (x.ndim - 2)
    return (x - mean.reshape(shape)) / numpy.sqrt(var.reshape(shape) + eps)


@pytest.mark.parametrize('shape', BN_SHAPES)
def test_batchnorm_train_forward_and_statistics(shape):
    x = rand(shape, 1, -2, 3)
    layer = make_layer('BatchNorm', 'batch_norm_param { moving_average_fraction: 0.9 eps: 0.001 }')
    y, _, _ = run(layer, [x])
    x64 = x.astype(numpy.float64)
    axes = (0,) + tuple(range(2, x.ndim))
    mean, var = x64.mean(axis=axes), x64.var(axis=axes)
    numpy.testing.assert_allclose(y, bn_reference(x64, mean, var, 0.001), rtol=1e-4, atol=1e-5)
    m = x.size // shape[1]
    numpy.testing.assert_allclose(layer.blobs[0].data, mean, rtol=1e-5, atol=1e-6)
    numpy.testing.assert_allclose(layer.blobs[1].data, var * m / (m - 1), rtol=1e-5, atol=1e-6)
    numpy.testing.assert_array_equal(layer.blobs[2].data, [1])
    # A second forward: moving sums with fraction 0.9.
    x2 = rand(shape, 2)
    bottom, top = [blob(x2)], [Blob()]
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    x2 = x2.astype(numpy.float64)
    numpy.testing.assert_allclose(layer.blobs[0].data, 0.9 * mean + x2.mean(axis=axes),
                                  rtol=1e-5, atol=1e-6)
    numpy.testing.assert_allclose(layer.blobs[1].data,
                                  (0.9 * var + x2.var(axis=axes)) * m / (m - 1), rtol=1e-5, atol=1e-6)
    numpy.testing.assert_allclose(layer.blobs[2].data, [1.9], rtol=1e-7)


@pytest.mark.parametrize('shape', BN_SHAPES)
def test_batchnorm_train_gradient(shape):
    layer = make_layer('BatchNorm', 'batch_norm_param { use_global_stats: false }')
    check_gradient(layer, [blob(rand(shape, 3))], check_params=False, step=1e-2,
                   rtol=2e-2, atol=2e-3)
    numpy.testing.assert_array_equal(layer.blobs[0].diff, 0)


def set_stats(layer, c, factor=2.5, seed=4):
    r = numpy.random.default_rng(seed)
    layer.blobs[0].data = r.uniform(-1, 1, c) * factor
    layer.blobs[1].data = r.uniform(0.2, 2, c) * factor
    layer.blobs[2].data = [factor]


@pytest.mark.parametrize('shape', BN_SHAPES)
def test_batchnorm_global_stats_forward_and_gradient(shape):
    c = shape[1]
    layer = make_layer('BatchNorm', phase=TEST)
    assert layer.use_global_stats
    x = rand(shape, 5)
    bottom, top = [blob(x)], [Blob()]
    layer.setup(bottom, top)
    set_stats(layer, c)
    layer.forward(bottom, top)
    mean = layer.blobs[0].data / 2.5
    var = layer.blobs[1].data / 2.5
    numpy.testing.assert_allclose(top[0].data, bn_reference(x.astype(numpy.float64), mean, var, 1e-5),
                                  rtol=1e-5, atol=1e-6)
    before = [b.data.copy() for b in layer.blobs]
    check_gradient(layer, bottom, top, check_params=False)
    for b, v in zip(layer.blobs, before):
        numpy.testing.assert_array_equal(b.data, v)     # TEST never updates the statistics


def test_batchnorm_zero_scale_factor_means_zero_statistics():
    layer = make_layer('BatchNorm', 'batch_norm_param { use_global_stats: true eps: 0.25 }')
    x = rand((2, 3, 2), 6)
    bottom, top = [blob(x)], [Blob()]
    layer.setup(bottom, top)
    layer.blobs[0].data = [5, 6, 7]
    layer.blobs[1].data = [5, 6, 7]
    layer.forward(bottom, top)
    numpy.testing.assert_allclose(top[0].data, x / numpy.sqrt(F32(0.25)), rtol=1e-6)


def test_batchnorm_use_global_stats_default_follows_phase():
    assert not make_layer('BatchNorm', phase=TRAIN).use_global_stats
    assert make_layer('BatchNorm', phase=TEST).use_global_stats
    assert make_layer('BatchNorm', 'batch_norm_param { use_global_stats: true }', TRAIN).use_global_stats
    assert not make_layer('BatchNorm', 'batch_norm_param { use_global_stats: false }',
                          TEST).use_global_stats


@pytest.mark.parametrize('phase', [TRAIN, TEST])
def test_batchnorm_in_place_matches(phase):
    shape = (3, 4, 2, 3)
    x = rand(shape, 7)
    dy = rand(shape, 8)
    stats = [rand(4, 9), rand(4, 10, 0.5, 2), numpy.array([1.5], F32)]
    a = run(make_layer('BatchNorm', phase=phase), [x], dy, params=stats)
    b = run(make_layer('BatchNorm', phase=phase), [x], dy, in_place=True, params=stats)
    assert_same_run(a, b)


def test_batchnorm_blobs_are_not_learnable():
    layer = make_layer('BatchNorm')
    layer.setup([blob(rand((2, 3), 0))], [Blob()])
    assert [b.shape for b in layer.blobs] == [(3,), (3,), (1,)]
    assert [p.lr_mult for p in layer.layer_param.param] == [0, 0, 0]
    partial = make_layer('BatchNorm', 'param { lr_mult: 0 decay_mult: 0 }')
    partial.setup([blob(rand((2, 3), 0))], [Blob()])
    assert [p.lr_mult for p in partial.layer_param.param] == [0, 0, 0]
    bad = make_layer('BatchNorm', 'param { lr_mult: 0 } param { lr_mult: 1 }', name='bn_bad')
    with pytest.raises(NetError, match='bn_bad.*lr_mult'):
        bad.setup([blob(rand((2, 3), 0))], [Blob()])


def test_batchnorm_in_a_net_solver_sees_lr_zero_and_diffs_stay_zero():
    text = '''
    force_backward: true
    layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 4 dim: 3 dim: 2 } } }
    layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x" }
    layer { name: "sc" type: "Scale" bottom: "x" top: "x" scale_param { bias_term: true } }
    '''
    net = caffeplus.Net(parse_text(text, caffe_pb2.NetParameter()), caffeplus.TRAIN)
    assert net.params_lr[:3] == [0, 0, 0] and net.has_params_lr[:3] == [True] * 3
    assert net.has_params_lr[3:] == [False, False]
    net.forward(x=rand((4, 3, 2), 1))
    net.backward(x=rand((4, 3, 2), 2))
    for p in net.learnable_params[:3]:
        numpy.testing.assert_array_equal(p.diff, 0)
    assert numpy.abs(net.learnable_params[3].diff).sum() > 0


def test_batchnorm_loaded_blobs_checked():
    lp = caffe_pb2.LayerParameter(name='bn_load', type='BatchNorm')
    for shape in [(4,), (4,), (1,)]:
        lp.blobs.add().shape.dim.extend(shape)
        lp.blobs[-1].data.extend([1.0] * shape[0])
    layer = create_layer(lp)
    with pytest.raises(NetError, match='bn_load'):
        layer.setup([blob(rand((2, 3), 0))], [Blob()])
    ok = create_layer(lp)
    ok.setup([blob(rand((2, 4), 0))], [Blob()])


# -- NVCaffe's scale_bias: BatchNorm with its own scale and bias ----------------------------
SCALE_BIAS = 'batch_norm_param { scale_bias: true }'


def test_batchnorm_scale_bias_blobs_fillers_and_param_specs():
    layer = make_layer('BatchNorm', SCALE_BIAS)
    layer.setup([blob(rand((2, 3, 4), 0))], [Blob()])
    assert [b.shape for b in layer.blobs] == [(3,), (3,), (1,), (3,), (3,)]
    numpy.testing.assert_array_equal(layer.blobs[3].data, 1)    # NVCaffe's default fillers
    numpy.testing.assert_array_equal(layer.blobs[4].data, 0)
    # Only the statistics are kept off the solver.
    assert [p.lr_mult for p in layer.layer_param.param] == [0, 0, 0]
    filled = make_layer('BatchNorm', 'batch_norm_param { scale_bias: true scale_filler { '
                        'type: "constant" value: 0.5 } bias_filler { type: "constant" value: -2 } }')
    filled.setup([blob(rand((2, 3), 0))], [Blob()])
    numpy.testing.assert_array_equal(filled.blobs[3].data, 0.5)
    numpy.testing.assert_array_equal(filled.blobs[4].data, -2)


@pytest.mark.parametrize('phase', [TRAIN, TEST])
def test_batchnorm_scale_bias_forward_against_float64(phase):
    shape = (3, 4, 2, 5)
    x = rand(shape, 11, -2, 3)
    gamma, beta = rand(4, 12, 0.5, 2), rand(4, 13)
    stats = [rand(4, 14), rand(4, 15, 0.5, 2), numpy.array([1.5], F32)]
    layer = make_layer('BatchNorm', SCALE_BIAS, phase=phase)
    y, _, _ = run(layer, [x], params=stats + [gamma, beta])
    x64 = x.astype(numpy.float64)
    if phase == TRAIN:
        mean, var = x64.mean(axis=(0, 2, 3)), x64.var(axis=(0, 2, 3))
    else:
        mean, var = stats[0] / 1.5, stats[1] / 1.5
    want = bn_reference(x64, mean, var, 1e-5) * gamma.reshape(1, 4, 1, 1) + \
        beta.reshape(1, 4, 1, 1)
    numpy.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('phase', [TRAIN, TEST])
def test_batchnorm_scale_bias_gradient(phase):
    layer = make_layer('BatchNorm', SCALE_BIAS, phase=phase)
    x = blob(rand((3, 2, 3, 2), 16))
    top = [Blob()]
    layer.setup([x], top)
    layer.blobs[1].data = numpy.abs(layer.blobs[1].data) + 1
    layer.blobs[2].data = [1.0]
    layer.blobs[3].data = rand(2, 17, 0.5, 2)
    layer.blobs[4].data = rand(2, 18)
    # Numerical gradients of the bottom, the scale and the bias (the
    # statistics are not parameters: their diffs stay zero).
    check_gradient(layer, [x], top, check_params=False, rtol=2e-2, atol=2e-3)
    stats = [b.data.copy() for b in layer.blobs[:3]]
    for i in (3, 4):
        param = layer.blobs[i]
        rng = numpy.random.default_rng(i)
        w = rng.standard_normal(top[0].shape)

        def objective():
            for b, v in zip(layer.blobs[:3], stats):
                b.data = v          # TRAIN forwards move the moving sums
            layer.forward([x], top)
            return float((top[0].data.astype(numpy.float64) * w).sum())
        objective()
        top[0].diff = w.astype(F32)
        for b in layer.blobs:
            b.diff[...] = 0
        layer.backward(top, [False], [x])
        analytic = param.diff.astype(numpy.float64).copy()
        for j in range(param.count):
            keep = param.data[j]
            param.data[j] = keep + F32(1e-2)
            plus = objective()
            param.data[j] = keep - F32(1e-2)
            minus = objective()
            param.data[j] = keep
            numpy.testing.assert_allclose(analytic[j], (plus - minus) / 2e-2, rtol=2e-2,
                                          atol=2e-3, err_msg='blob %d[%d]' % (i, j))
        for b in layer.blobs[:3]:
            numpy.testing.assert_array_equal(b.diff, 0)


@pytest.mark.parametrize('phase', [TRAIN, TEST])
def test_batchnorm_scale_bias_equals_batchnorm_then_scale(phase):
    """BatchNorm { scale_bias } is BatchNorm followed by Scale { bias_term }."""
    def net(fused):
        text = '''
        force_backward: true
        layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 4 dim: 3 dim: 5 } } }
        %s
        ''' % ('layer { name: "bn" type: "BatchNorm" bottom: "x" top: "y" %s }' % SCALE_BIAS
                 if fused else
                 'layer { name: "bn" type: "BatchNorm" bottom: "x" top: "y" } '
                 'layer { name: "sc" type: "Scale" bottom: "y" top: "y" '
                 'scale_param { bias_term: true } }')
        n = caffeplus.Net(parse_text(text, caffe_pb2.NetParameter()), phase)
        stats = [rand(3, 21), rand(3, 22, 0.5, 2), numpy.array([2.0], F32)]
        for b, v in zip(n.layers[1].blobs, stats):
            b.data = v
        affine = [rand(3, 23, 0.5, 2), rand(3, 24)]
        for b, v in zip(n.layers[1].blobs[3:] if fused else n.layers[2].blobs, affine):
            b.data = v
        return n

    a, b = net(True), net(False)
    x, dy = rand((4, 3, 5), 25), rand((4, 3, 5), 26)
    ya = a.forward(x=x)['y'].copy()
    yb = b.forward(x=x)['y'].copy()
    numpy.testing.assert_allclose(ya, yb, rtol=1e-6, atol=1e-6)
    a.backward(y=dy)
    b.backward(y=dy)
    numpy.testing.assert_allclose(a.blobs['x'].diff, b.blobs['x'].diff, rtol=1e-5, atol=1e-6)
    for pa, pb in zip(a.layers[1].blobs[3:], b.layers[2].blobs):
        numpy.testing.assert_allclose(pa.diff, pb.diff, rtol=1e-5, atol=1e-5)
    # The solver learns the scale and the bias, never the statistics.
    assert a.params_lr == [0, 0, 0, 1, 1]


def test_batchnorm_scale_bias_loaded_blobs_checked():
    lp = caffe_pb2.LayerParameter(name='bn_sb', type='BatchNorm')
    lp.batch_norm_param.scale_bias = True
    for n in (3, 3, 1):
        lp.blobs.add().shape.dim.append(n)
        lp.blobs[-1].data.extend([1.0] * n)
    with pytest.raises(NetError, match='bn_sb.*5 blobs.*scale and bias'):
        create_layer(lp).setup([blob(rand((2, 3), 0))], [Blob()])


# -- ResNet-style in-place chain: BatchNorm -> Scale -> ReLU ------------------------------------

CHAIN = '''
force_backward: true
layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 3 dim: 4 dim: 2 dim: 3 } } }
layer { name: "pre" type: "Power" bottom: "x" top: "a" power_param { scale: 1.5 shift: 0.2 } }
layer { name: "bn" type: "BatchNorm" bottom: "a" top: "%s" }
layer { name: "sc" type: "Scale" bottom: "%s" top: "%s"
        scale_param { bias_term: true filler { type: "gaussian" mean: 1 std: 0.3 }
                      bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu" type: "ReLU" bottom: "%s" top: "%s" }
'''


@pytest.mark.parametrize('phase', [caffeplus.TRAIN, caffeplus.TEST])
def test_resnet_style_in_place_chain(phase):
    nets = []
    for names in [('a',) * 5, ('b', 'b', 'c', 'c', 'd')]:
        caffeplus.set_random_seed(3)
        nets.append(caffeplus.Net(parse_text(CHAIN % names, caffe_pb2.NetParameter()), phase))
    x, dy = rand((3, 4, 2, 3), 1), rand((3, 4, 2, 3), 2)
    results = []
    for net, out in zip(nets, ['a', 'd']):
        stats = [rand(4, 3), rand(4, 4, 0.5, 1.5), numpy.array([2.0], F32)]
        for b, v in zip(net.params['bn'], stats):
            b.data = v
        y = net.forward(x=x)[out].copy()
        dx = net.backward(**{out: dy})['x'].copy()
        results.append((y, [dx], [p.diff.copy() for p in net.learnable_params]))
    assert_same_run(results[0], results[1])


# -- MVN -------------------------------------------------------------------------------
MVN_PARAMS = ['', 'mvn_param { across_channels: true }', 'mvn_param { normalize_variance: false }',
              'mvn_param { across_channels: true normalize_variance: false }']
MVN_SHAPES = [(2, 3, 4, 5), (3, 4), (2, 3, 5)]


def mvn_reference(x, across, normalize, eps):
    n = x.shape[0] if across else x.shape[0] * x.shape[1]
    r = x.reshape(n, -1).astype(numpy.float64)
    r = r - r.mean(axis=1, keepdims=True)
    if normalize:
        r = r / (numpy.sqrt((r * r).mean(axis=1, keepdims=True)) + eps)
    return r.reshape(x.shape)


@pytest.mark.parametrize('params', MVN_PARAMS)
@pytest.mark.parametrize('shape', MVN_SHAPES)
def test_mvn_forward_and_gradient(params, shape):
    layer = make_layer('MVN', params)
    x = rand(shape, 11, -1, 2)
    y, _, _ = run(layer, [x])
    numpy.testing.assert_allclose(
        y, mvn_reference(x, 'across' in params, 'normalize_variance: false' not in params, 1e-9),
        rtol=1e-4, atol=1e-5)
    check_gradient(make_layer('MVN', params), [blob(x)], step=1e-2, rtol=2e-2, atol=2e-3)


def test_mvn_backward_is_caffes_formula_with_large_eps():
    x = rand((2, 2, 3, 4), 12)
    dy = rand((2, 2, 3, 4), 13)
    y, dx, _ = run(make_layer('MVN', 'mvn_param { eps: 0.1 }'), [x], dy)
    r = x.reshape(4, 12).astype(numpy.float64)
    r = r - r.mean(axis=1, keepdims=True)
    sigma = numpy.sqrt((r * r).mean(axis=1, keepdims=True)) + 0.1
    yy = r / sigma
    g = dy.reshape(4, 12).astype(numpy.float64)
    want = (g - g.mean(axis=1, keepdims=True) - yy * (g * yy).mean(axis=1, keepdims=True)) / sigma
    numpy.testing.assert_allclose(dx[0], want.reshape(x.shape), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('params', MVN_PARAMS)
def test_mvn_in_place_matches(params):
    x, dy = rand((2, 3, 4), 14), rand((2, 3, 4), 15)
    assert_same_run(run(make_layer('MVN', params), [x], dy),
                    run(make_layer('MVN', params), [x], dy, in_place=True))


# -- Bias and Scale ------------------------------------------------------------------------
# (bottom shape, params, shape of the learned blob)
LEARNED = [
    ((2, 3, 4, 5), '', (3,)),
    ((2, 3, 4), 'axis: 0 num_axes: -1', (2, 3, 4)),
    ((2, 3, 4, 5), 'axis: -2 num_axes: 2', (4, 5)),
    ((2, 3, 4), 'num_axes: 0', ()),
    ((2, 3, 4, 5), 'axis: 2 num_axes: 1', (4,)),
    ((5, 3), '', (3,)),
    ((2, 3, 5), 'axis: 1 num_axes: -1', (3, 5)),
]
# (bottom 0 shape, bottom 1 shape, params)
GIVEN = [
    ((2, 3, 4, 5), (3,), ''),
    ((2, 3, 4, 5), (2, 3), 'axis: 0'),
    ((2, 3, 4, 5), (4, 5), 'axis: 2'),
    ((2, 3, 4), (), ''),
    ((2, 3, 4, 5), (3, 4, 5), 'axis: -3'),
    ((3, 5), (5,), 'axis: -1'),
]


def broadcast(x_shape, p, axis):
    p = numpy.asarray(p)
    if p.ndim == 0:
        return p
    axis = axis % len(x_shape)
    return p.reshape((1,) * axis + p.shape + (1,) * (len(x_shape) - axis - p.ndim))


def axis_of(params):
    found = re.search(r'(?<!num_)axis: (-?\d+)', params)
    return int(found.group(1)) if found else 1


@pytest.mark.parametrize('type_name', ['Scale', 'Bias'])
@pytest.mark.parametrize('case', LEARNED, ids=[c[1] or 'default' for c in LEARNED])
def test_learned_forward_and_gradient(type_name, case):
    shape, params, pshape = case
    field = type_name.lower() + '_param'
    text = '%s { %s filler { type: "uniform" min: -1.5 max: 1.5 } }' % (field, params)
    layer = make_layer(type_name, text)
    x = rand(shape, 20)
    y, _, _ = run(layer, [x])
    assert layer.blobs[0].shape == pshape
    p = broadcast(shape, layer.blobs[0].data, axis_of(params) if pshape else 0)
    want = x * p if type_name == 'Scale' else x + p
    numpy.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-7)
    check_gradient(make_layer(type_name, text), [blob(x)])


@pytest.mark.parametrize('type_name', ['Scale', 'Bias'])
@pytest.mark.parametrize('case', GIVEN, ids=[str(c[1]) for c in GIVEN])
def test_given_forward_and_gradient(type_name, case):
    shape0, shape1, params = case
    field = type_name.lower() + '_param'
    layer = make_layer(type_name, '%s { %s }' % (field, params), num_bottom=2)
    x, s = rand(shape0, 21), rand(shape1, 22, -1.5, 1.5)
    y, _, _ = run(layer, [x, s])
    assert layer.blobs == []
    p = broadcast(shape0, s, axis_of(params) if shape1 else 0)
    want = x * p if type_name == 'Scale' else x + p
    numpy.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-7)
    check_gradient(make_layer(type_name, '%s { %s }' % (field, params), num_bottom=2),
                   [blob(x), blob(s)])


@pytest.mark.parametrize('given', [False, True])
def test_scale_bias_term_gradient(given):
    fillers = 'filler { type: "gaussian" mean: 1 std: 0.5 } bias_filler { type: "gaussian" std: 0.5 }'
    if given:
        layer = make_layer('Scale', 'scale_param { axis: 1 bias_term: true %s }' % fillers,
                           num_bottom=2)
        bottoms = [blob(rand((2, 3, 4, 2), 23)), blob(rand((3, 4), 24))]
        run(layer, [b.data for b in bottoms])
        assert [b.shape for b in layer.blobs] == [(3, 4)]
    else:
        layer = make_layer('Scale', 'scale_param { bias_term: true num_axes: 2 %s }' % fillers)
        bottoms = [blob(rand((2, 3, 4, 2), 23))]
        run(layer, [bottoms[0].data])
        assert [b.shape for b in layer.blobs] == [(3, 4), (3, 4)]
    check_gradient(layer, bottoms)


def test_default_fillers():
    x = rand((2, 3, 4), 25)
    scale = make_layer('Scale', 'scale_param { bias_term: true }')
    y, _, _ = run(scale, [x])
    numpy.testing.assert_array_equal(scale.blobs[0].data, 1)
    numpy.testing.assert_array_equal(scale.blobs[1].data, 0)
    numpy.testing.assert_array_equal(y, x)
    bias = make_layer('Bias')
    y, _, _ = run(bias, [x])
    numpy.testing.assert_array_equal(bias.blobs[0].data, 0)
    numpy.testing.assert_array_equal(y, x)


@pytest.mark.parametrize('type_name,params,num_bottom,shapes', [
    ('Scale', 'scale_param { bias_term: true filler { type: "gaussian" std: 1 } '
     'bias_filler { type: "gaussian" std: 1 } }', 1, [(2, 3, 4)]),
    ('Scale', 'scale_param { filler { type: "gaussian" std: 1 } }', 1, [(2, 3, 4)]),
    ('Scale', 'scale_param { bias_term: true bias_filler { type: "gaussian" std: 1 } }', 2,
     [(2, 3, 4), (3,)]),
    ('Scale', 'scale_param { axis: 0 }', 2, [(2, 3, 4), (2, 3)]),
    ('Bias', 'bias_param { filler { type: "gaussian" std: 1 } }', 1, [(2, 3, 4)]),
    ('Bias', 'bias_param { axis: 2 }', 2, [(2, 3, 4), (4,)]),
])
def test_scale_bias_in_place_match(type_name, params, num_bottom, shapes):
    xs = [rand(s, 30 + i) for i, s in enumerate(shapes)]
    dy = rand(shapes[0], 40)
    caffeplus.set_random_seed(5)
    a = run(make_layer(type_name, params, num_bottom=num_bottom), xs, dy)
    caffeplus.set_random_seed(5)
    b = run(make_layer(type_name, params, num_bottom=num_bottom), xs, dy, in_place=True)
    # In place, bottom 0's diff is the top diff's buffer; the rest must agree.
    assert_same_run(a, b)


def test_scale_param_diffs_accumulate():
    layer = make_layer('Scale', 'scale_param { bias_term: true }')
    x, dy = rand((2, 3, 4), 50), rand((2, 3, 4), 51)
    bottom, top = [blob(x)], [Blob()]
    layer.setup(bottom, top)
    layer.forward(bottom, top)
    top[0].diff = dy
    for b in layer.blobs:
        b.diff[...] = 0
    layer.backward(top, [True], bottom)
    once = [b.diff.copy() for b in layer.blobs]
    numpy.testing.assert_allclose(once[0], (dy * x).sum(axis=(0, 2)), rtol=1e-5)
    numpy.testing.assert_allclose(once[1], dy.sum(axis=(0, 2)), rtol=1e-5)
    layer.backward(top, [True], bottom)
    for b, o in zip(layer.blobs, once):
        numpy.testing.assert_allclose(b.diff, 2 * o, rtol=1e-6)


def test_scale_in_place_frozen_keeps_no_copy():
    layer = make_layer('Scale', 'scale_param { filler { type: "constant" value: 2 } }')
    x, dy = rand((2, 3, 4), 52), rand((2, 3, 4), 53)
    b = blob(x)
    layer.setup([b], [b])
    layer.set_param_propagate_down(0, False)
    layer.forward([b], [b])
    assert layer._bottom_copy is None
    b.diff = dy
    layer.blobs[0].diff[...] = 0
    layer.backward([b], [True], [b])
    numpy.testing.assert_array_equal(b.diff, dy * 2)
    numpy.testing.assert_array_equal(layer.blobs[0].diff, 0)


@pytest.mark.parametrize('type_name,params,xs', [
    ('BatchNorm', '', [(2, 3, 4)]),
    ('BatchNorm', 'batch_norm_param { use_global_stats: true }', [(2, 3, 4)]),
    ('MVN', '', [(2, 3, 4)]),
    ('MVN', 'mvn_param { normalize_variance: false }', [(2, 3, 4)]),
    ('Bias', '', [(2, 3, 4)]),
    ('Bias', '', [(2, 3, 4), (3,)]),
    ('Scale', 'scale_param { bias_term: true }', [(2, 3, 4)]),
    ('Scale', '', [(2, 3, 4), (3,)]),
])
def test_backward_reads_only_what_it_declares(type_name, params, xs):
    layer = make_layer(type_name, params, num_bottom=len(xs))
    bottom = [blob(rand(s, 60 + i), 'b%d' % i) for i, s in enumerate(xs)]
    top = [Blob(name='t')]
    layer.setup(bottom, top)
    if type_name == 'BatchNorm':
        set_stats(layer, 3)
    layer.forward(bottom, top)
    top[0].diff = rand(xs[0], 70)
    layer.backward(top, [True] * len(bottom), bottom)
    ref = [b.diff.copy() for b in bottom] + [b.diff.copy() for b in layer.blobs]
    reads = layer.backward_reads
    if 'bottom_data' not in reads:
        bottom[0].data[...] = numpy.nan
    if 'top_data' not in reads:
        top[0].data[...] = numpy.nan
    for b in layer.blobs:
        b.diff[...] = 0
    layer.backward(top, [True] * len(bottom), bottom)
    for r, b in zip(ref, bottom + layer.blobs):
        numpy.testing.assert_array_equal(b.diff, r)


@pytest.mark.parametrize('type_name,params,shapes,match', [
    ('Scale', '', [(2, 3, 4), (4,)], 'dimension mismatch'),
    ('Bias', 'bias_param { axis: 1 }', [(2, 3, 4), (3, 5)], 'dimension mismatch'),
    ('Scale', 'scale_param { axis: 2 }', [(2, 3, 4), (4, 2)], 'extends past'),
    ('Scale', 'scale_param { axis: 3 }', [(2, 3, 4)], 'scale_param.axis'),
    ('Bias', 'bias_param { axis: -4 }', [(2, 3, 4)], 'bias_param.axis'),
    ('Scale', 'scale_param { num_axes: -2 }', [(2, 3, 4)], 'scale_param.num_axes'),
    ('Bias', 'bias_param { axis: 1 num_axes: 3 }', [(2, 3, 4)], 'bias_param.num_axes'),
])
def test_bad_parameters(type_name, params, shapes, match):
    layer = make_layer(type_name, params, name='badlayer', num_bottom=len(shapes))
    with pytest.raises(NetError, match=match) as info:
        layer.setup([blob(rand(s)) for s in shapes], [Blob()])
    assert 'badlayer' in str(info.value)


# -- GPU (CuPy): the same code gives the CPU's numbers --------------------------------------

GPU_CASES = [
    ('BatchNorm', '', TRAIN, [(4, 3, 5, 6)]),
    ('BatchNorm', '', TEST, [(4, 3, 5, 6)]),
    ('BatchNorm', '', TRAIN, [(7, 5)]),
    ('MVN', '', TRAIN, [(2, 3, 4, 5)]),
    ('MVN', 'mvn_param { across_channels: true normalize_variance: false }', TRAIN, [(2, 3, 4, 5)]),
    ('Bias', 'bias_param { filler { type: "gaussian" std: 1 } }', TRAIN, [(2, 3, 4, 5)]),
    ('Bias', 'bias_param { axis: 2 }', TRAIN, [(2, 3, 4, 5), (4, 5)]),
    ('Scale', 'scale_param { bias_term: true filler { type: "gaussian" std: 1 } '
     'bias_filler { type: "gaussian" std: 1 } }', TRAIN, [(2, 3, 4, 5)]),
    ('Scale', 'scale_param { axis: 0 }', TRAIN, [(2, 3, 4, 5), (2, 3)]),
    ('Scale', 'scale_param { num_axes: 0 }', TRAIN, [(2, 3, 4, 5), ()]),
]


@pytest.mark.gpu
@pytest.mark.parametrize('in_place', [False, True])
@pytest.mark.parametrize('case', GPU_CASES, ids=['%s-%d' % (c[0], i) for i, c in enumerate(GPU_CASES)])
def test_gpu_matches_cpu(case, in_place):
    from caffeplus import backend
    type_name, params, phase, shapes = case
    xs = [rand(s, 80 + i) for i, s in enumerate(shapes)]
    dy = rand(shapes[0], 90)
    results = []
    for mode in ('cpu', 'gpu'):
        caffeplus.set_random_seed(5)
        caffeplus.set_mode_gpu() if mode == 'gpu' else caffeplus.set_mode_cpu()
        try:
            layer = make_layer(type_name, params, phase, num_bottom=len(shapes))
            c = shapes[0][1]
            stats = [rand(c, 9), rand(c, 10, 0.5, 2), numpy.array([1.5], F32)] \
                if type_name == 'BatchNorm' else None
            y, dxs, dps = run(layer, xs, dy, in_place=in_place, params=stats)
            after = [backend.to_numpy(b.data) for b in layer.blobs]
            results.append([backend.to_numpy(a) for a in [y] + dxs + dps] + after)
        finally:
            caffeplus.set_mode_cpu()
    for a, b in zip(results[1], results[0]):
        numpy.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
