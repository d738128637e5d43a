"""Neuron layers (layers/neuron.py): gradients, forward values against float64
formulas, in-place runs, the declared backward reads, Dropout's statistics,
and the errors bad parameters give."""
import numpy
import pytest
from google.protobuf import text_format

import caffeplus
from caffeplus.blob import Blob
from caffeplus.errors import NetError
from caffeplus.layer import create_layer, layer_class
from caffeplus.proto import caffe_pb2
from gradcheck import check_gradient

F32 = numpy.float32


def make_layer(type_name, params='', phase=caffe_pb2.TRAIN, name='L'):
    lp = caffe_pb2.LayerParameter()
    text_format.Merge(params, lp)
    lp.name, lp.type, lp.phase = name, type_name, phase
    lp.bottom.append('x')
    lp.top.append('y')
    return create_layer(lp)


def blob(x, name='x'):
    b = Blob(numpy.shape(x), name=name)
    b.data = numpy.asarray(x, dtype=F32)
    return b


def away_from(x, points, margin=0.05):
    """Move values within `margin` of a kink to `1.5 * margin` from it."""
    for p in points:
        d = x - p
        close = numpy.abs(d) < margin
        x = numpy.where(close, p + numpy.where(d < 0, -1.5, 1.5) * margin, x)
    return x


def inputs(kind, shape, seed=0):
    r = numpy.random.default_rng(seed)
    if kind == 'pos':
        x = r.uniform(0.5, 2.0, size=shape)
    elif kind == 'wide':
        x = r.uniform(-3.0, 3.0, size=shape)
    elif kind == 'relu6':
        x = away_from(r.uniform(-2.0, 8.0, size=shape), [0.0, 6.0])
    elif kind == 'clip':
        x = away_from(r.uniform(-1.5, 1.5, size=shape), [-0.5, 0.7])
    else:   # 'kink': away from 0
        x = away_from(r.uniform(-1.0, 1.0, size=shape), [0.0])
    return x.astype(F32)


def sigmoid64(x):
    return 1.0 / (1.0 + numpy.exp(-x))


# (type, params, input kind, float64 forward of x)
CASES = [
    ('ReLU', '', 'kink', lambda x: numpy.maximum(x, 0)),
    ('ReLU', 'relu_param { negative_slope: 0.1 }', 'kink', lambda x: numpy.where(x > 0, x, 0.1 * x)),
    ('ReLU', 'relu_param { negative_slope: -0.3 }', 'kink', lambda x: numpy.where(x > 0, x, -0.3 * x)),
    ('ELU', '', 'wide', lambda x: numpy.where(x > 0, x, numpy.exp(x) - 1)),
    ('ELU', 'elu_param { alpha: 0.5 }', 'kink', lambda x: numpy.where(x > 0, x, 0.5 * (numpy.exp(x) - 1))),
    ('ELU', 'elu_param { alpha: -0.4 }', 'kink', lambda x: numpy.where(x > 0, x, -0.4 * (numpy.exp(x) - 1))),
    ('Sigmoid', '', 'wide', sigmoid64),
    ('TanH', '', 'wide', numpy.tanh),
    ('AbsVal', '', 'kink', numpy.abs),
    ('BNLL', '', 'wide', lambda x: numpy.log1p(numpy.exp(x))),
    ('Power', 'power_param { power: 2 scale: 0.5 shift: 1 }', 'wide', lambda x: (1 + 0.5 * x) ** 2),
    ('Power', 'power_param { power: 0.5 scale: 2 shift: 1 }', 'pos', lambda x: (1 + 2 * x) ** 0.5),
    ('Power', 'power_param { power: 3 scale: 1.5 }', 'kink', lambda x: (1.5 * x) ** 3),
    ('Power', 'power_param { power: -1 shift: 0.5 }', 'pos', lambda x: 1 / (0.5 + x)),
    ('Power', 'power_param { scale: -2 shift: 3 }', 'wide', lambda x: 3 - 2 * x),
    ('Power', 'power_param { power: 0 scale: 3 }', 'wide', lambda x: numpy.ones_like(x)),
    ('Power', 'power_param { power: 3 scale: 0 shift: 2 }', 'wide', lambda x: numpy.full_like(x, 8)),
    ('Exp', '', 'wide', numpy.exp),
    ('Exp', 'exp_param { base: 2 scale: 0.5 shift: 0.3 }', 'wide', lambda x: 2 ** (0.3 + 0.5 * x)),
    ('Exp', 'exp_param { base: 10 scale: -1 }', 'kink', lambda x: 10 ** -x),
    ('Log', '', 'pos', numpy.log),
    ('Log', 'log_param { base: 10 scale: 2 shift: 0.5 }', 'pos', lambda x: numpy.log10(0.5 + 2 * x)),
    ('Log', 'log_param { base: 2 shift: 1 }', 'pos', lambda x: numpy.log2(1 + x)),
    ('Clip', 'clip_param { min: -0.5 max: 0.7 }', 'clip', lambda x: numpy.clip(x, -0.5, 0.7)),
    ('Clip', 'clip_param { min: 0 max: 6 }', 'relu6', lambda x: numpy.clip(x, 0, 6)),
    ('Swish', '', 'wide', lambda x: x * sigmoid64(x)),
    ('Swish', 'swish_param { beta: 2.5 }', 'wide', lambda x: x * sigmoid64(2.5 * x)),
    ('Swish', 'swish_param { beta: 0 }', 'wide', lambda x: 0.5 * x),
    ('PReLU', '', 'kink', lambda x: numpy.where(x > 0, x, 0.25 * x)),
    ('PReLU', 'prelu_param { channel_shared: true }', 'kink', lambda x: numpy.where(x > 0, x, 0.25 * x)),
    ('Dropout', 'dropout_param { dropout_ratio: 0.3 }', 'wide', lambda x: x),    # TEST phase
]
SHAPES = [(2, 3, 4, 5), (3, 7), (1, 5, 3), (2, 3, 3, 1, 2)]


def case_id(case):
    return '%s-%s' % (case[0], case[1].replace(' ', '').replace('_param', '')[:40])


def phase_of(case):
    return caffe_pb2.TEST if case[0] == 'Dropout' else caffe_pb2.TRAIN


@pytest.mark.parametrize('case', CASES, ids=[case_id(c) for c in CASES])
def test_forward_matches_formula(case):
    type_name, params, kind, formula = case
    for i, shape in enumerate(SHAPES):
        x = inputs(kind, shape, seed=i)
        layer = make_layer(type_name, params, phase_of(case))
        bottom, top = [blob(x)], [Blob()]
        layer.setup(bottom, top)
        layer.forward(bottom, top)
        assert top[0].shape == shape
        numpy.testing.assert_allclose(top[0].data, formula(x.astype(numpy.float64)),
                                      rtol=2e-6, atol=2e-6, err_msg=str(shape))


@pytest.mark.parametrize('case', CASES, ids=[case_id(c) for c in CASES])
def test_gradient(case):
    type_name, params, kind, _ = case
    for i, shape in enumerate(SHAPES[:3] if type_name != 'Power' else SHAPES[:2]):
        layer = make_layer(type_name, params, phase_of(case))
        if type_name == 'PReLU':
            # Random slopes (some negative) instead of the constant 0.25.
            layer = make_layer(type_name, params + ' prelu_param { filler { type: "uniform" '
                               'min: -0.6 max: 0.8 } }')
        check_gradient(layer, [blob(inputs(kind, shape, seed=10 + i))],
                       step=1e-3 if kind == 'kink' else 1e-2, seed=i)


def run_layer(layer, x, dy, in_place, param_values=None):
    """Forward and backward once; returns (top, bottom diff, param diffs)."""
    bottom = [blob(x)]
    top = bottom if in_place else [Blob(name='y')]
    layer.setup(bottom, top)
    if param_values is not None:
        for b, v in zip(layer.blobs, param_values):
            b.data = v
    layer.forward(bottom, top)
    y = top[0].data.copy()
    top[0].diff = dy
    for b in layer.blobs:
        b.diff[...] = 0
    layer.backward(top, [True], bottom)
    return y, bottom[0].diff.copy(), [b.diff.copy() for b in layer.blobs]


@pytest.mark.parametrize('case', CASES, ids=[case_id(c) for c in CASES])
def test_in_place(case):
    """inplace_ok layers give the same tops and diffs in place as not."""
    type_name, params, kind, _ = case
    if not make_layer(type_name, params, phase_of(case)).inplace_ok:
        pytest.skip('not in-place capable (backward needs the original bottom)')
    shape = (2, 3, 4, 5)
    x = inputs(kind, shape, seed=3)
    dy = numpy.random.default_rng(4).standard_normal(shape).astype(F32)
    ref_layer = make_layer(type_name, params, phase_of(case))
    y0, dx0, dp0 = run_layer(ref_layer, x, dy, in_place=False)
    values = [b.data.copy() for b in ref_layer.blobs]
    y1, dx1, dp1 = run_layer(make_layer(type_name, params, phase_of(case)), x, dy,
                             in_place=True, param_values=values)
    numpy.testing.assert_array_equal(y1, y0)
    numpy.testing.assert_array_equal(dx1, dx0)
    for a, b in zip(dp1, dp0):
        numpy.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('case', CASES, ids=[case_id(c) for c in CASES])
def test_backward_reads_only_what_it_declares(case):
    """Arrays outside backward_reads may be gone (here: NaN) at backward time."""
    type_name, params, kind, _ = case
    shape = (2, 3, 4, 5)
    x = inputs(kind, shape, seed=5)
    dy = numpy.random.default_rng(6).standard_normal(shape).astype(F32)
    layer = make_layer(type_name, params, phase_of(case))
    bottom, top = [blob(x)], [Blob(name='y')]
    layer.setup(bottom, top)
    layer.forward(bottom, top)
    top[0].diff = dy
    layer.backward(top, [True], bottom)
    ref = bottom[0].diff.copy()
    ref_params = [b.diff.copy() for b in layer.blobs]
    reads = layer.backward_reads
    assert reads <= {'bottom_data', 'top_data'}
    if 'bottom_data' not in reads:
        bottom[0].data[...] = numpy.nan
    if 'top_data' not in reads:
        top[0].data[...] = numpy.nan
    bottom[0].diff[...] = numpy.nan
    for b in layer.blobs:
        b.diff[...] = 0
    layer.backward(top, [True], bottom)
    numpy.testing.assert_array_equal(bottom[0].diff, ref)
    for b, r in zip(layer.blobs, ref_params):
        numpy.testing.assert_array_equal(b.diff, r)


def test_declared_reads():
    reads = lambda t, p='': make_layer(t, p).backward_reads
    assert reads('ReLU') == {'top_data'}
    assert reads('ReLU', 'relu_param { negative_slope: -1 }') == {'bottom_data'}
    assert reads('Sigmoid') == reads('TanH') == reads('Exp') == reads('Swish') == {'top_data'}
    assert reads('Dropout') == reads('Threshold') == frozenset()
    assert reads('Power', 'power_param { scale: 3 shift: 1 }') == frozenset()
    assert reads('Power', 'power_param { power: 2 }') == {'bottom_data'}
    assert reads('Power', 'power_param { power: 3 shift: 1 }') == {'bottom_data', 'top_data'}
    assert reads('PReLU') == reads('AbsVal') == reads('Log') == reads('BNLL') == {'bottom_data'}
    assert reads('ELU') == {'top_data'}
    assert not make_layer('AbsVal').inplace_ok
    assert not make_layer('Clip', 'clip_param { min: 0 max: 1 }').inplace_ok
    assert make_layer('PReLU').inplace_ok and make_layer('Dropout').inplace_ok


def test_all_types_registered():
    for name in ('ReLU', 'PReLU', 'ELU', 'Sigmoid', 'TanH', 'AbsVal', 'BNLL', 'Power', 'Exp',
                 'Log', 'Threshold', 'Clip', 'Swish', 'Dropout'):
        assert layer_class(name) is not None, name


# -- Caffe's arithmetic and special cases ---------------------------------------------

def test_relu_backward_is_caffes_formula_exactly():
    x = numpy.array([[-2, -0.0, 0.0, 1e-30, -1e-30, 3]], F32)
    dy = numpy.array([[1, 2, 3, 4, 5, 6]], F32)
    for slope in (0.0, 0.1):
        layer = make_layer('ReLU', 'relu_param { negative_slope: %g }' % slope)
        y, dx, _ = run_layer(layer, x, dy, in_place=False)
        s = F32(slope)
        numpy.testing.assert_array_equal(y, numpy.maximum(x, 0) + s * numpy.minimum(x, 0))
        numpy.testing.assert_array_equal(dx, dy * ((x > 0) + s * (x <= 0)).astype(F32))


def test_prelu_param_diff_accumulates_and_shapes():
    layer = make_layer('PReLU')
    x = inputs('kink', (2, 4, 3), seed=1)
    dy = numpy.ones_like(x)
    bottom, top = [blob(x)], [Blob()]
    layer.setup(bottom, top)
    assert layer.blobs[0].shape == (4,)
    numpy.testing.assert_array_equal(layer.blobs[0].data, 0.25)
    layer.forward(bottom, top)
    top[0].diff = dy
    layer.blobs[0].diff[...] = 0
    layer.backward(top, [False], bottom)
    once = layer.blobs[0].diff.copy()
    numpy.testing.assert_allclose(once, (x * (x <= 0)).sum(axis=(0, 2)), rtol=1e-6)
    layer.backward(top, [False], bottom)
    numpy.testing.assert_allclose(layer.blobs[0].diff, 2 * once, rtol=1e-6)
    shared = make_layer('PReLU', 'prelu_param { channel_shared: true }')
    shared.setup([blob(x)], [Blob()])
    assert shared.blobs[0].shape == ()


def test_prelu_no_param_diff_when_frozen():
    layer = make_layer('PReLU')
    x = inputs('kink', (2, 3, 4), seed=2)
    bottom, top = [blob(x)], [Blob()]
    layer.setup(bottom, top)
    layer.set_param_propagate_down(0, False)
    layer.forward(bottom, top)
    top[0].diff = numpy.ones_like(x)
    layer.blobs[0].diff[...] = 0
    layer.backward(top, [True], bottom)
    numpy.testing.assert_array_equal(layer.blobs[0].diff, 0)


def test_power_special_cases():
    x = numpy.array([[-1.5, 0.5, 2.0]], F32)
    dy = numpy.array([[1.0, -2.0, 3.0]], F32)
    y, dx, _ = run_layer(make_layer('Power', 'power_param { power: 0 scale: 3 }'), x, dy, False)
    numpy.testing.assert_array_equal(y, 1)
    numpy.testing.assert_array_equal(dx, 0)
    y, dx, _ = run_layer(make_layer('Power', 'power_param { power: 2 scale: 0 shift: 3 }'),
                         x, dy, False)
    numpy.testing.assert_array_equal(y, 9)
    numpy.testing.assert_array_equal(dx, 0)
    y, dx, _ = run_layer(make_layer('Power', 'power_param { scale: -2 shift: 1 }'), x, dy, False)
    numpy.testing.assert_array_equal(y, 1 - 2 * x)
    numpy.testing.assert_array_equal(dx, -2 * dy)


def test_exp_base_minus_one_is_e_and_base_one_constant():
    x = numpy.linspace(-2, 2, 7, dtype=F32).reshape(1, 7)
    y, _, _ = run_layer(make_layer('Exp', 'exp_param { base: -1 }'), x, x, False)
    numpy.testing.assert_allclose(y, numpy.exp(x), rtol=1e-6)
    y, dx, _ = run_layer(make_layer('Exp', 'exp_param { base: 1 shift: 2 }'), x, x, False)
    numpy.testing.assert_array_equal(y, 1)
    numpy.testing.assert_array_equal(dx, 0)


def test_bnll_large_inputs_do_not_overflow():
    x = numpy.array([[-200, -60, 0, 60, 200]], F32)
    with numpy.errstate(over='raise', invalid='raise', divide='raise'):
        y, dx, _ = run_layer(make_layer('BNLL'), x, numpy.ones_like(x), False)
    numpy.testing.assert_allclose(y, [[0, 0, numpy.log(2), 60, 200]], atol=1e-6)
    numpy.testing.assert_allclose(dx, [[0, 0, 0.5, 1, 1]], atol=1e-6)


def test_sigmoid_and_elu_do_not_overflow():
    x = numpy.array([[-200, -90, 0, 90, 200]], F32)
    with numpy.errstate(over='raise', invalid='raise', divide='raise'):
        y, _, _ = run_layer(make_layer('Sigmoid'), x, numpy.ones_like(x), False)
        numpy.testing.assert_allclose(y, [[0, 0, 0.5, 1, 1]], atol=1e-7)
        y, _, _ = run_layer(make_layer('ELU'), x, numpy.ones_like(x), False)
        numpy.testing.assert_allclose(y, [[-1, -1, 0, 90, 200]], atol=1e-7)
        run_layer(make_layer('Swish'), x, numpy.ones_like(x), False)


def test_clip_gradient_passes_on_the_bounds():
    layer = make_layer('Clip', 'clip_param { min: -0.5 max: 0.7 }')
    x = numpy.array([[-0.6, -0.5, 0.0, 0.7, 0.8]], F32)
    y, dx, _ = run_layer(layer, x, numpy.ones_like(x), False)
    numpy.testing.assert_array_equal(y, numpy.array([[-0.5, -0.5, 0.0, 0.7, 0.7]], F32))
    numpy.testing.assert_array_equal(dx, [[0, 1, 1, 1, 0]])


def test_clip_in_place_behaves_like_caffe():
    # Caffe's backward reads the (overwritten) bottom: every clipped value is
    # inside [min, max], so in place the gradient passes everywhere.
    layer = make_layer('Clip', 'clip_param { min: -0.5 max: 0.7 }')
    x = numpy.array([[-0.6, 0.0, 0.8]], F32)
    y, dx, _ = run_layer(layer, x, numpy.ones_like(x), True)
    numpy.testing.assert_array_equal(y, numpy.array([[-0.5, 0.0, 0.7]], F32))
    numpy.testing.assert_array_equal(dx, 1)


def test_threshold_values_and_no_backward():
    layer = make_layer('Threshold', 'threshold_param { threshold: 0.2 }')
    x = numpy.array([[0.1, 0.2, 0.3, -1]], F32)
    bottom, top = [blob(x)], [Blob()]
    layer.setup(bottom, top)
    layer.forward(bottom, top)
    numpy.testing.assert_array_equal(top[0].data, [[0, 0, 1, 0]])
    assert layer.has_backward is False
    with pytest.raises(NetError):
        layer.backward(top, [True], bottom)
    layer.backward(top, [False], bottom)     # nothing to do
    b = blob(x)
    layer2 = make_layer('Threshold')
    layer2.setup([b], [b])
    layer2.forward([b], [b])
    numpy.testing.assert_array_equal(b.data, [[1, 1, 1, 0]])


# -- Dropout ---------------------------------------------------------------------------

def dropout_run(ratio, shape, phase=caffe_pb2.TRAIN, in_place=False, x=None):
    layer = make_layer('Dropout', 'dropout_param { dropout_ratio: %g }' % ratio, phase)
    x = numpy.ones(shape, F32) if x is None else x
    dy = numpy.random.default_rng(0).standard_normal(shape).astype(F32)
    y, dx, _ = run_layer(layer, x, dy, in_place)
    return layer, x, dy, y, dx


@pytest.mark.parametrize('ratio', [0.3, 0.5, 0.9])
def test_dropout_train_statistics(ratio):
    layer, x, dy, y, dx = dropout_run(ratio, (100, 1000))
    scale = F32(1.0 / (1.0 - F32(ratio)))
    kept = y != 0
    assert abs(kept.mean() - (1 - ratio)) < 0.006
    numpy.testing.assert_array_equal(y[kept], scale)
    numpy.testing.assert_array_equal(dx, dy * kept * scale)
    # The mean activation is preserved in expectation.
    assert abs(y.mean() - 1.0) < 0.05


def test_dropout_in_place_and_values():
    x = numpy.random.default_rng(1).uniform(0.5, 1.5, size=(4, 5, 6)).astype(F32)
    layer, _, dy, y, dx = dropout_run(0.4, x.shape, in_place=True, x=x)
    kept = y != 0
    scale = F32(1.0 / (1.0 - F32(0.4)))
    numpy.testing.assert_array_equal(y, x * kept * scale)
    numpy.testing.assert_array_equal(dx, dy * kept * scale)


def test_dropout_masks_follow_the_seed():
    caffeplus.set_random_seed(7)
    y1 = dropout_run(0.5, (50, 40))[3]
    y2 = dropout_run(0.5, (50, 40))[3]
    caffeplus.set_random_seed(7)
    y3 = dropout_run(0.5, (50, 40))[3]
    numpy.testing.assert_array_equal(y1, y3)
    assert (y1 != y2).any()


def test_dropout_test_phase_is_identity():
    x = numpy.random.default_rng(2).standard_normal((3, 4, 5)).astype(F32)
    for in_place in (False, True):
        _, _, dy, y, dx = dropout_run(0.3, x.shape, caffe_pb2.TEST, in_place, x=x)
        numpy.testing.assert_array_equal(y, x)
        numpy.testing.assert_array_equal(dx, dy)


def test_dropout_ratio_zero_is_identity_in_train():
    x = numpy.random.default_rng(3).standard_normal((3, 4)).astype(F32)
    _, _, dy, y, dx = dropout_run(0.0, x.shape, x=x)
    numpy.testing.assert_array_equal(y, x)
    numpy.testing.assert_array_equal(dx, dy)


# -- bad parameters ------------------------------------------------------------------

@pytest.mark.parametrize('type_name,params,field', [
    ('Dropout', 'dropout_param { dropout_ratio: 1 }', 'dropout_ratio'),
    ('Dropout', 'dropout_param { dropout_ratio: -0.1 }', 'dropout_ratio'),
    ('Exp', 'exp_param { base: -2 }', 'exp_param.base'),
    ('Exp', 'exp_param { base: 0 }', 'exp_param.base'),
    ('Log', 'log_param { base: 0 }', 'log_param.base'),
    ('Log', 'log_param { base: 1 }', 'log_param.base'),
    ('Clip', 'clip_param { min: 0 }', 'clip_param.max'),
])
def test_bad_parameters_name_layer_and_field(type_name, params, field):
    with pytest.raises(NetError) as info:
        make_layer(type_name, params, name='badlayer')
    assert 'badlayer' in str(info.value) and field in str(info.value)


def test_prelu_needs_two_axes_and_matching_slopes():
    with pytest.raises(NetError, match='badlayer'):
        make_layer('PReLU', name='badlayer').setup([blob(numpy.ones(5))], [Blob()])
    layer = make_layer('PReLU', name='badlayer')
    layer.setup([blob(numpy.ones((2, 3)))], [Blob()])
    with pytest.raises(NetError, match='channels'):
        layer.reshape([blob(numpy.ones((2, 4)))], [Blob()])


def test_in_a_net_relu_dropout_in_place():
    from caffeplus.io.prototxt import parse_text
    text = '''
    force_backward: true
    layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 4 dim: 6 } } }
    layer { name: "p" type: "Power" bottom: "x" top: "h" power_param { scale: 2 } }
    layer { name: "r" type: "ReLU" bottom: "h" top: "h" }
    layer { name: "d" type: "Dropout" bottom: "h" top: "h" }
    '''
    x = inputs('kink', (4, 6), seed=9)
    for phase in (caffeplus.TRAIN, caffeplus.TEST):
        net = caffeplus.Net(parse_text(text, caffe_pb2.NetParameter()), phase)
        out = net.forward(x=x)['h']
        dx = net.backward(h=numpy.ones((4, 6), F32))['x']
        if phase == caffeplus.TEST:
            numpy.testing.assert_array_equal(out, numpy.maximum(2 * x, 0))
            numpy.testing.assert_array_equal(dx, 2 * (x > 0))
        else:
            kept = out != 0
            numpy.testing.assert_array_equal(out, numpy.maximum(2 * x, 0) * kept * F32(2))
            numpy.testing.assert_array_equal(dx, 2 * (x > 0) * kept * F32(2))


# -- GPU (CuPy): the same code gives the CPU's numbers --------------------------------------

def _to_np(run_result):
    from caffeplus import backend
    y, dx, dp = run_result
    return backend.to_numpy(y), backend.to_numpy(dx), [backend.to_numpy(p) for p in dp]


@pytest.mark.gpu
@pytest.mark.parametrize('in_place', [False, True])
def test_gpu_matches_cpu(in_place):
    shape = (3, 4, 5, 6)
    dy = numpy.random.default_rng(4).standard_normal(shape).astype(F32)
    for case in CASES:
        type_name, params, kind, _ = case
        x = inputs(kind, shape, seed=3)
        caffeplus.set_mode_cpu()
        layer = make_layer(type_name, params, phase_of(case))
        if in_place and not layer.inplace_ok:
            continue
        cpu = _to_np(run_layer(layer, x, dy, in_place))
        values = [b.data.copy() for b in layer.blobs]
        caffeplus.set_mode_gpu()
        try:
            gpu = _to_np(run_layer(make_layer(type_name, params, phase_of(case)), x, dy, in_place,
                                   param_values=values))
        finally:
            caffeplus.set_mode_cpu()
        for a, b in zip([gpu[0], gpu[1]] + gpu[2], [cpu[0], cpu[1]] + cpu[2]):
            numpy.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=case_id(case))


@pytest.mark.gpu
def test_gpu_dropout_train():
    from caffeplus import backend
    caffeplus.set_mode_gpu()
    try:
        layer, x, dy, y, dx = dropout_run(0.3, (200, 500), in_place=True)
        y, dx = backend.to_numpy(y), backend.to_numpy(dx)
    finally:
        caffeplus.set_mode_cpu()
    kept = y != 0
    assert abs(kept.mean() - 0.7) < 0.006
    scale = F32(1.0 / (1.0 - F32(0.3)))
    numpy.testing.assert_array_equal(y[kept], scale)
    numpy.testing.assert_array_equal(dx, dy * kept * scale)
