"""RNN, LSTM and LSTMUnit: numerical gradients, Caffe's state and parameter rules.

The stock-Caffe numbers themselves are checked by test_reference_layers.py
(cases lstm, lstm_static, lstm_unit, rnn, rnn_expose_hidden).
"""
import numpy
import pytest
from google.protobuf import text_format

from caffeplus.blob import Blob
from caffeplus.errors import NetError
from caffeplus.layer import create_layer
from caffeplus.proto import caffe_pb2
from gradcheck import check_gradient

FILLERS = """
    weight_filler { type: "gaussian" std: 0.5 }
    bias_filler { type: "gaussian" std: 0.3 }
"""
# Sequence starts at t=0 in both streams (so the state carried between
# forwards never matters) and again in stream 1 at t=2 and stream 0 at t=3.
CONT = numpy.array([[0, 0], [1, 1], [1, 0], [0, 1]], dtype=numpy.float32)


def make_layer(kind, recurrent='', name='test'):
    text = 'name: "%s" type: "%s" recurrent_param { %s }' % (name, kind, recurrent)
    return create_layer(text_format.Parse(text, caffe_pb2.LayerParameter()))


def blobs(arrays):
    out = []
    for i, a in enumerate(arrays):
        b = Blob(a.shape, name='bottom_%d' % i)
        b.data = a
        out.append(b)
    return out


def tops(n):
    return [Blob(name='top_%d' % i) for i in range(n)]


def inputs(x_shape, static_shape=None, seed=3):
    rng = numpy.random.default_rng(seed)
    arrays = [rng.uniform(-1, 1, x_shape).astype(numpy.float32), CONT[:x_shape[0], :x_shape[1]]]
    if static_shape is not None:
        arrays.append(rng.uniform(-1, 1, static_shape).astype(numpy.float32))
    return arrays


# -- gradients -----------------------------------------------------------------
@pytest.mark.parametrize('static', [False, True])
def test_lstm_gradient(static):
    layer = make_layer('LSTM', 'num_output: 3 ' + FILLERS)
    bottom = blobs(inputs((4, 2, 3), (2, 2) if static else None))
    check_gradient(layer, bottom, check_bottom=[0, 2] if static else [0])
    shapes = [b.shape for b in layer.blobs]
    expect = [(12, 3), (12,)] + ([(12, 2)] if static else []) + [(12, 3)]
    assert shapes == expect


@pytest.mark.parametrize('static', [False, True])
def test_rnn_gradient(static):
    layer = make_layer('RNN', 'num_output: 3 ' + FILLERS)
    # x and x_static with extra axes: Caffe flattens them (InnerProduct axis 2 / 1).
    bottom = blobs(inputs((4, 2, 2, 2), (2, 1, 2) if static else None))
    check_gradient(layer, bottom, check_bottom=[0, 2] if static else [0])
    shapes = [b.shape for b in layer.blobs]
    expect = [(3, 4), (3,)] + ([(3, 2)] if static else []) + [(3, 3), (3, 3), (3,)]
    assert shapes == expect


def test_lstm_unit_gradient():
    layer = create_layer(text_format.Parse('name: "u" type: "LSTMUnit"', caffe_pb2.LayerParameter()))
    rng = numpy.random.default_rng(5)
    c_prev = rng.uniform(-1, 1, (1, 3, 4)).astype(numpy.float32)
    gates = rng.uniform(-2, 2, (1, 3, 16)).astype(numpy.float32)
    cont = numpy.array([[1, 0, 1]], dtype=numpy.float32)
    check_gradient(layer, blobs([c_prev, gates, cont]), check_bottom=[0, 1])


def test_lstm_unit_formulas():
    layer = create_layer(text_format.Parse('name: "u" type: "LSTMUnit"', caffe_pb2.LayerParameter()))
    rng = numpy.random.default_rng(6)
    c_prev = rng.uniform(-1, 1, (1, 2, 3))
    gates = rng.uniform(-2, 2, (1, 2, 12))
    cont = numpy.array([[0, 1]])
    bottom = blobs([c_prev.astype(numpy.float32), gates.astype(numpy.float32),
                    cont.astype(numpy.float32)])
    top = tops(2)
    layer.setup(bottom, top)
    layer.forward(bottom, top)
    sig = 1 / (1 + numpy.exp(-gates[0]))
    i, f, o, g = sig[:, :3], sig[:, 3:6] * cont[0][:, None], sig[:, 6:9], numpy.tanh(gates[0, :, 9:])
    c = f * c_prev[0] + i * g
    numpy.testing.assert_allclose(top[0].data[0], c, rtol=1e-5, atol=1e-6)
    numpy.testing.assert_allclose(top[1].data[0], o * numpy.tanh(c), rtol=1e-5, atol=1e-6)
    assert not layer.allow_force_backward(2)
    assert layer.allow_force_backward(0) and layer.allow_force_backward(1)


# -- Caffe's rules ---------------------------------------------------------------
@pytest.mark.parametrize('kind', ['LSTM', 'RNN'])
def test_param_diffs_accumulate_and_cont_takes_no_gradient(kind):
    layer = make_layer(kind, 'num_output: 3 ' + FILLERS)
    bottom = blobs(inputs((4, 2, 3)))
    top = tops(1)
    layer.setup(bottom, top)
    assert not layer.allow_force_backward(1) and layer.allow_force_backward(0)
    layer.forward(bottom, top)
    top[0].diff = numpy.random.default_rng(0).standard_normal(top[0].shape)
    for b in layer.blobs:
        b.diff[...] = 0
    bottom[1].diff[...] = 7
    layer.backward(top, [True, False], bottom)
    once = [b.diff.copy() for b in layer.blobs]
    x_diff = bottom[0].diff.copy()
    assert all(numpy.abs(d).max() > 0 for d in once)
    layer.backward(top, [True, False], bottom)
    for b, d in zip(layer.blobs, once):
        numpy.testing.assert_allclose(b.diff, 2 * d, rtol=1e-6, atol=1e-7)
    numpy.testing.assert_array_equal(bottom[0].diff, x_diff)   # bottom diffs overwrite
    assert (bottom[1].diff == 7).all()                          # cont untouched
    with pytest.raises(NetError, match='cont'):
        layer.backward(top, [True, True], bottom)


@pytest.mark.parametrize('kind,nstates', [('LSTM', 2), ('RNN', 1)])
def test_state_carries_over_between_forwards(kind, nstates):
    """Without expose_hidden the final states of one forward start the next;
    with it they come from bottoms and go to tops, matching the same run."""
    plain = make_layer(kind, 'num_output: 3 ' + FILLERS)
    exposed = make_layer(kind, 'num_output: 3 expose_hidden: true ' + FILLERS, name='e')
    x1, cont1 = inputs((4, 2, 3), seed=1)
    x2 = inputs((4, 2, 3), seed=2)[0]
    cont2 = numpy.ones((4, 2), dtype=numpy.float32)   # both streams continue
    bottom = blobs([x1, cont1])
    top = tops(1)
    plain.setup(bottom, top)
    zeros = [numpy.zeros((1, 2, 3), dtype=numpy.float32)] * nstates
    ebottom = blobs([x1, cont1] + zeros)
    etop = tops(1 + nstates)
    exposed.setup(ebottom, etop)
    for a, b in zip(exposed.blobs, plain.blobs):
        a.data = b.data
    plain.forward(bottom, top)
    exposed.forward(ebottom, etop)
    numpy.testing.assert_array_equal(etop[0].data, top[0].data)
    if kind == 'LSTM':   # hT is the last h (the RNN's top is o, not h)
        numpy.testing.assert_array_equal(etop[1].data[0], top[0].data[-1])
    final = [t.data.copy() for t in etop[1:]]

    # Second batch continues the sequences: plain starts from its carried state.
    bottom[0].data = x2
    bottom[1].data = cont2
    plain.forward(bottom, top)
    ebottom = blobs([x2, cont2] + final)
    exposed.forward(ebottom, etop)
    numpy.testing.assert_allclose(etop[0].data, top[0].data, rtol=1e-6, atol=1e-7)
    # A fresh start with zero states gives something else.
    ebottom = blobs([x2, cont2] + zeros)
    exposed.forward(ebottom, etop)
    assert numpy.abs(etop[0].data - top[0].data).max() > 1e-3


@pytest.mark.parametrize('kind,nstates', [('LSTM', 2), ('RNN', 1)])
def test_expose_hidden_gives_no_state_gradient(kind, nstates):
    """Caffe shares only the data of h0/c0 and hT/cT: h0/c0 get no gradient
    and the diffs on hT/cT are ignored."""
    layer = make_layer(kind, 'num_output: 3 expose_hidden: true ' + FILLERS)
    rng = numpy.random.default_rng(4)
    states = [rng.uniform(-1, 1, (1, 2, 3)).astype(numpy.float32) for _ in range(nstates)]
    x, cont = inputs((3, 2, 3))
    cont = numpy.ones_like(cont)
    bottom = blobs([x, cont] + states)
    top = tops(1 + nstates)
    layer.setup(bottom, top)
    layer.forward(bottom, top)
    top[0].diff = rng.standard_normal(top[0].shape)
    for t in top[1:]:
        t.diff[...] = 0
    for b in layer.blobs:
        b.diff[...] = 0
    for b in bottom[2:]:
        b.diff[...] = 5
    layer.backward(top, [True, False] + [True] * nstates, bottom)
    reference = [b.diff.copy() for b in layer.blobs] + [bottom[0].diff.copy()]
    for b in bottom[2:]:
        assert (b.diff == 0).all()
    for t in top[1:]:
        t.diff = rng.standard_normal(t.shape)
    for b in layer.blobs:
        b.diff[...] = 0
    layer.backward(top, [True, False] + [True] * nstates, bottom)
    for a, b in zip([b.diff for b in layer.blobs] + [bottom[0].diff], reference):
        numpy.testing.assert_array_equal(a, b)


def test_param_blobs_from_proto_are_kept():
    layer = make_layer('LSTM', 'num_output: 2')
    bottom = blobs(inputs((2, 2, 3)))
    top = tops(1)
    layer.setup(bottom, top)
    for k, b in enumerate(layer.blobs):
        b.data = numpy.full(b.shape, k + 1, dtype=numpy.float32)
    param = layer.to_proto()
    again = create_layer(param)
    again.setup(bottom, tops(1))
    for k, b in enumerate(again.blobs):
        assert (b.data == k + 1).all()
    # Without fillers Caffe's default is constant 0.
    fresh = make_layer('RNN', 'num_output: 2')
    fresh.setup(bottom, tops(1))
    assert len(fresh.blobs) == 5 and all((b.data == 0).all() for b in fresh.blobs)


@pytest.mark.parametrize('kind', ['LSTM', 'RNN'])
def test_bad_parameters(kind):
    bottom = blobs(inputs((2, 2, 3)))
    with pytest.raises(NetError, match=r'(?s)badrnn.*recurrent_param.num_output'):
        make_layer(kind, '', name='badrnn').setup(bottom, tops(1))
    with pytest.raises(NetError, match=r'(?s)badrnn.*weight_filler'):
        make_layer(kind, 'num_output: 2 weight_filler { type: "nope" }',
                   name='badrnn').setup(bottom, tops(1))
    bad_cont = blobs([inputs((2, 2, 3))[0], numpy.zeros((2, 3), dtype=numpy.float32)])
    with pytest.raises(NetError, match='cont'):
        make_layer(kind, 'num_output: 2').setup(bad_cont, tops(1))
    with pytest.raises(NetError, match='bottom'):
        make_layer(kind, 'num_output: 2 expose_hidden: true').setup(bottom, tops(1))


def test_lstm_unit_bad_shapes():
    layer = create_layer(text_format.Parse('name: "u" type: "LSTMUnit"', caffe_pb2.LayerParameter()))
    bottom = blobs([numpy.zeros((1, 2, 3), numpy.float32), numpy.zeros((1, 2, 8), numpy.float32),
                    numpy.zeros((1, 2), numpy.float32)])
    with pytest.raises(NetError, match='4 \\* 3'):
        layer.setup(bottom, tops(2))
