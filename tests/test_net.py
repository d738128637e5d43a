"""Net construction as Caffe's Net::Init does it."""
import logging

import numpy
import pytest

import caffeplus
from caffeplus import log as caffe_log
from caffeplus.errors import CaffeplusError, NetError, UnknownLayerError
from caffeplus.io.prototxt import parse_text
from caffeplus.net import Net
from caffeplus.proto import caffe_pb2


@pytest.fixture
def caffe_log_text(caplog):
    """caplog for caffeplus's logger, which does not propagate to the root."""
    caffe_log.logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.INFO)
    yield lambda: caplog.text
    caffe_log.logger.removeHandler(caplog.handler)


def net_from_text(text, phase=caffeplus.TRAIN, **kw):
    param = parse_text(text, caffe_pb2.NetParameter())
    return Net(param, phase, **kw)


TWO_CONSUMERS = '''
name: "two"
layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "a" type: "Power" bottom: "x" top: "a" }
layer { name: "b" type: "Power" bottom: "x" top: "b" }
'''


def test_split_inserted_with_caffe_names():
    net = net_from_text(TWO_CONSUMERS)
    assert net._layer_names == ['data', 'x_data_0_split', 'a', 'b']
    assert net.bottom_names['a'] == ['x_data_0_split_0']
    assert net.bottom_names['b'] == ['x_data_0_split_1']
    assert net.outputs == ['a', 'b']
    assert net.inputs == ['x']


def test_split_shares_data_and_sums_diffs():
    text = TWO_CONSUMERS.replace('name: "two"', 'name: "two" force_backward: true')
    net = net_from_text(text)
    x = numpy.arange(6, dtype=numpy.float32).reshape(2, 3)
    out = net.forward(x=x)
    numpy.testing.assert_array_equal(out['a'], x)
    da = numpy.full((2, 3), 2, numpy.float32)
    db = numpy.full((2, 3), 3, numpy.float32)
    diffs = net.backward(a=da, b=db)
    numpy.testing.assert_array_equal(diffs['x'], da + db)


def test_loss_weight_on_shared_top_moves_to_split():
    text = '''
    layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 4 } } }
    layer { name: "p" type: "Power" bottom: "x" top: "y" loss_weight: 2 }
    layer { name: "q" type: "Power" bottom: "y" top: "z" }
    '''
    param = parse_text(text, caffe_pb2.NetParameter())
    from caffeplus.splits import insert_splits
    out = insert_splits(param)
    names = [l.name for l in out.layer]
    assert names == ['data', 'p', 'y_p_0_split', 'q']
    assert list(out.layer[1].loss_weight) == []
    assert list(out.layer[2].loss_weight) == [2, 0]
    assert out.layer[3].bottom[0] == 'y_p_0_split_1'


def test_in_place_layer_shares_the_blob(caffe_log_text):
    text = '''
    layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 2 dim: 2 } } }
    layer { name: "relu" type: "ReLU" bottom: "x" top: "x" }
    '''
    net = net_from_text(text)
    assert len(net._blobs) == 1
    assert 'relu -> x (in-place)' in caffe_log_text()


def test_netstate_filtering_phase_level_stages():
    text = '''
    layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 1 } } }
    layer { name: "train_only" type: "Power" bottom: "x" top: "t" include { phase: TRAIN } }
    layer { name: "test_only" type: "Power" bottom: "x" top: "u" include { phase: TEST } }
    layer { name: "level2" type: "Power" bottom: "x" top: "v" include { min_level: 2 } }
    layer { name: "staged" type: "Power" bottom: "x" top: "w" include { stage: "deploy" } }
    layer { name: "not_staged" type: "Power" bottom: "x" top: "y" include { not_stage: "deploy" } }
    layer { name: "excluded" type: "Power" bottom: "x" top: "z" exclude { phase: TEST } }
    '''
    train = net_from_text(text, caffeplus.TRAIN)
    assert 'train_only' in train._layer_names and 'test_only' not in train._layer_names
    assert 'excluded' in train._layer_names and 'level2' not in train._layer_names
    assert 'not_staged' in train._layer_names and 'staged' not in train._layer_names
    test = net_from_text(text, caffeplus.TEST, level=3, stages=['deploy'])
    assert 'test_only' in test._layer_names and 'excluded' not in test._layer_names
    assert 'level2' in test._layer_names and 'staged' in test._layer_names
    assert 'not_staged' not in test._layer_names


def test_include_and_exclude_together_is_an_error():
    text = '''
    layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 1 } }
            include { phase: TRAIN } exclude { phase: TEST } }
    '''
    with pytest.raises(NetError, match='either include rules or exclude rules'):
        net_from_text(text)


def test_missing_bottom_names_layer_and_blob():
    text = '''
    layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 1 } } }
    layer { name: "p" type: "Power" bottom: "nope" top: "y" }
    '''
    with pytest.raises(NetError, match="Unknown bottom blob 'nope' \\(layer 'p', bottom index 0\\)"):
        net_from_text(text)


def test_unknown_layer_type_lists_known_types():
    text = '''
    layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 1 } } }
    layer { name: "priors" type: "PriorBox" bottom: "x" top: "y" }
    '''
    with pytest.raises(UnknownLayerError) as info:
        net_from_text(text)
    msg = str(info.value)
    assert "'PriorBox'" in msg and "'priors'" in msg and 'Convolution' in msg


def test_top_produced_twice_is_an_error():
    text = '''
    layer { name: "d1" type: "Input" top: "x" input_param { shape { dim: 1 } } }
    layer { name: "d2" type: "Input" top: "x" input_param { shape { dim: 1 } } }
    '''
    with pytest.raises(NetError, match="produced by multiple sources"):
        net_from_text(text)


SHARED = '''
force_backward: true
layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "y1"
        param { name: "w" lr_mult: 2 } param { name: "b" }
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" } } }
layer { name: "ip2" type: "InnerProduct" bottom: "x" top: "y2"
        param { name: "w" } param { name: "b" }
        inner_product_param { num_output: 4 } }
'''


def test_shared_params_share_data_and_diff():
    net = net_from_text(SHARED)
    w1, w2 = net.params['ip1'][0], net.params['ip2'][0]
    assert w1.data_storage is w2.data_storage and w1.diff_storage is w2.diff_storage
    assert net.param_owners == [-1, -1, 0, 1]
    assert len(net.learnable_params) == 2
    assert net.params_lr == [2.0, 1.0]
    x = numpy.random.default_rng(0).standard_normal((2, 3)).astype(numpy.float32)
    out = net.forward(x=x)
    numpy.testing.assert_allclose(out['y1'], out['y2'])
    net.clear_param_diffs()
    g = numpy.ones((2, 4), numpy.float32)
    net.backward(y1=g, y2=g)
    # Both layers' gradients land in the one shared diff.
    numpy.testing.assert_allclose(w1.diff, 2 * g.T @ x, rtol=1e-6)


def test_shared_param_shape_mismatch_strict_and_permissive():
    bad = SHARED.replace('inner_product_param { num_output: 4 } }',
                         'inner_product_param { num_output: 6 } }')
    with pytest.raises(NetError, match="Cannot share param 'w'.*shape mismatch"):
        net_from_text(bad)
    text = '''
    layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 2 dim: 6 } } }
    layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "y1" param { name: "w" }
            inner_product_param { num_output: 2 bias_term: false } }
    layer { name: "ip2" type: "InnerProduct" bottom: "x" top: "y2"
            param { name: "w" share_mode: PERMISSIVE }
            inner_product_param { num_output: 2 bias_term: false transpose: true } }
    '''
    net = net_from_text(text)  # (2,6) vs (6,2): same count, allowed
    assert net.params['ip2'][0].shape == (6, 2)


def test_mismatched_shared_lr_mult_is_an_error():
    bad = SHARED.replace('param { name: "w" } param { name: "b" }\n        inner_product_param { num_output: 4 } }',
                         'param { name: "w" lr_mult: 3 } param { name: "b" }\n        inner_product_param { num_output: 4 } }')
    with pytest.raises(NetError, match='mismatched lr_mult'):
        net_from_text(bad)


LOSS_NET = '''
layer { name: "data" type: "Input" top: "x" top: "t" input_param { shape { dim: 2 dim: 3 } shape { dim: 2 dim: 3 } } }
layer { name: "frozen" type: "InnerProduct" bottom: "x" top: "h" param { lr_mult: 0 } param { lr_mult: 0 }
        inner_product_param { num_output: 3 } }
layer { name: "ip" type: "InnerProduct" bottom: "h" top: "y" inner_product_param { num_output: 3 } }
layer { name: "side" type: "Power" bottom: "x" top: "s" }
layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "t" top: "loss" }
'''


def test_backward_decision_and_loss_weight_default():
    net = net_from_text(LOSS_NET)
    need = dict(zip(net._layer_names, net.layer_need_backward))
    assert need == {'data': False, 'x_data_0_split': False, 'frozen': False, 'ip': True,
                    'side': False, 'loss': True}
    assert net.blob_loss_weights['loss'] == 1.0
    assert net.outputs == ['loss', 's']     # Caffe's order: sorted by name
    loss_bottom = dict(zip(net._layer_names, net.bottom_need_backward))['loss']
    assert loss_bottom == [True, False]


def test_force_backward_and_propagate_down():
    net = net_from_text('force_backward: true\n' + LOSS_NET)
    need = dict(zip(net._layer_names, net.layer_need_backward))
    assert need['frozen'] and need['side']
    # EuclideanLoss lets force_backward reach both bottoms, as in Caffe.
    assert dict(zip(net._layer_names, net.bottom_need_backward))['loss'] == [True, True]
    # A classification loss never sends a gradient to its labels, even forced.
    text = 'force_backward: true\n' + LOSS_NET.replace(
        'type: "EuclideanLoss" bottom: "y" bottom: "t"', 'type: "SoftmaxWithLoss" bottom: "y" bottom: "label"').replace(
        'top: "x" top: "t" input_param { shape { dim: 2 dim: 3 } shape { dim: 2 dim: 3 } }',
        'top: "x" top: "label" input_param { shape { dim: 2 dim: 3 } shape { dim: 2 } }')
    net = net_from_text(text)
    assert dict(zip(net._layer_names, net.bottom_need_backward))['loss'] == [True, False]
    text = LOSS_NET.replace('bottom: "h" top: "y"', 'bottom: "h" top: "y" propagate_down: false')
    net = net_from_text(text)
    assert dict(zip(net._layer_names, net.bottom_need_backward))['ip'] == [False]


def test_forward_returns_weighted_loss():
    text = LOSS_NET.replace('top: "loss" }', 'top: "loss" loss_weight: 0.5 }')
    net = net_from_text(text)
    rng = numpy.random.default_rng(1)
    net.blobs['x'].data = rng.standard_normal((2, 3))
    net.blobs['t'].data = rng.standard_normal((2, 3))
    loss = net.forward_prefilled()
    assert loss == pytest.approx(0.5 * float(net.blobs['loss'].data), rel=1e-6)


def test_memory_required_log_line(caffe_log_text):
    net_from_text(TWO_CONSUMERS)
    # x (6) + split tops 2*6 + a 6 + b 6 floats
    assert 'Memory required for data: %d' % (4 * 30) in caffe_log_text()
    assert 'Top shape: 2 3 (6)' in caffe_log_text()


def test_pycaffe_constructor_forms(tmp_path):
    path = tmp_path / 'n.prototxt'
    path.write_text(TWO_CONSUMERS)
    net = caffeplus.Net(str(path), caffeplus.TEST)
    assert net.phase == caffeplus.TEST
    net = caffeplus.Net(str(path), phase=caffeplus.TRAIN)
    assert net.phase == caffeplus.TRAIN
    with pytest.raises(CaffeplusError, match='phase'):
        caffeplus.Net(str(path), phase='VALIDATE')


def test_layer_hooks_run_at_the_layers_they_name():
    """A per-layer hook with `at` runs at those layers only, one without at
    every layer; the set is read as each pass starts (Net.hook_table)."""
    net = net_from_text('force_backward: true\n' + LOSS_NET)
    L = len(net.layers)
    calls = []

    def hook(kind):
        def fn(i):
            calls.append((kind, i))
        return fn
    everywhere, somewhere, after, before_back, done = (
        hook('every'), hook('some'), hook('after'), hook('back'), hook('done'))
    somewhere.at, after.at, before_back.at, done.at = {1, 3}, frozenset(), {0}, {2, L - 1}
    net.before_layer_forward.extend([everywhere, somewhere])
    net.after_layer_forward.append(after)
    net.before_layer_backward.append(before_back)
    net.on_layer_backward_done.append(done)
    net.blobs['x'].data = numpy.ones((2, 3))
    net.forward_prefilled()
    net.backward_all()
    assert [i for k, i in calls if k == 'every'] == list(range(L))
    assert [i for k, i in calls if k == 'some'] == [1, 3]
    assert [i for k, i in calls if k == 'after'] == []
    assert [i for k, i in calls if k == 'back'] == [0]
    assert [i for k, i in calls if k == 'done'] == [L - 1, 2]
    calls.clear()
    somewhere.at = None                 # every layer again, from the next pass on
    net.forward_prefilled()
    assert [i for k, i in calls if k == 'some'] == list(range(L))
