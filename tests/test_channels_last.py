"""caffeplus.layout: which maps a net stores channels-last, and pycaffe's
view of such a blob (Caffe's order). The GPU's calls over them are checked
in tests/test_gpu_layers.py."""
import os

import numpy
import pytest
from google.protobuf import text_format

import caffeplus
from caffeplus import config, layout, precision
from caffeplus.blob import Blob, HostBlob
from caffeplus.proto import caffe_pb2

from conftest import SHARED

# The roles the GPU's layers take in a 16-bit net (cuDNN's convolution and
# pooling read and write either order; ReLU, Dropout, Split and Eltwise are
# pointwise; BatchNorm and a per-channel Scale read either order, bottom and
# top alike); the CPU's convolutions take none.
GPU_ROLES = {'Convolution': 'channels_last', 'Pooling': 'channels_last', 'ReLU': 'pointwise',
             'Dropout': 'pointwise', 'Split': 'pointwise', 'Eltwise': 'pointwise',
             'BatchNorm': 'tied', 'Scale': 'tied', 'Concat': 'tied'}

HEAD = '''name: "t"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 2 dim: 3 dim: 12 dim: 12 } shape { dim: 2 } } }
'''


def _conv(name, bottom, top=None):
    return ('layer { name: "%s" type: "Convolution" bottom: "%s" top: "%s" '
            'convolution_param { num_output: 8 kernel_size: 3 pad: 1 } }\n'
            % (name, bottom, top or name))


def _layer(name, type_, bottoms, tops, extra=''):
    return 'layer { name: "%s" type: "%s" %s %s %s }\n' % (
        name, type_, ' '.join('bottom: "%s"' % b for b in bottoms),
        ' '.join('top: "%s"' % t for t in tops), extra)


POOL = 'pooling_param { pool: MAX kernel_size: 2 stride: 2 }'
IP_LOSS = (_layer('ip', 'InnerProduct', ['pool2'], ['ip'], 'inner_product_param { num_output: 2 }')
           + _layer('loss', 'SoftmaxWithLoss', ['ip', 'label'], ['loss']))
VGG_LIKE = (HEAD + _conv('conv1', 'data') + _layer('relu1', 'ReLU', ['conv1'], ['conv1'])
            + _conv('conv2', 'conv1') + _layer('relu2', 'ReLU', ['conv2'], ['conv2'])
            + _layer('pool1', 'Pooling', ['conv2'], ['pool1'], POOL)
            + _conv('conv3', 'pool1') + _layer('drop3', 'Dropout', ['conv3'], ['drop3'])
            + _layer('pool2', 'Pooling', ['drop3'], ['pool2'], POOL) + IP_LOSS)


def _channels_last(text, fixed_outputs=True):
    net = caffeplus.Net(text_format.Parse(text, caffe_pb2.NetParameter()), caffeplus.TRAIN)
    roles = {i: GPU_ROLES.get(layer.type) for i, layer in enumerate(net.layers)}
    shapes = {i: b.shape for i, b in enumerate(net._blobs)}
    fixed = set(net.output_blob_indices) if fixed_outputs else set()
    ids = layout.channels_last_blobs(net.layers, net.bottom_id_vecs, net.top_id_vecs, shapes,
                                     fixed, roles)
    return {net._blob_names[i] for i in ids}


def test_a_chain_of_convolutions_and_pointwise_layers_goes_channels_last():
    """VGG-16's shape: every map between the first convolution and the
    pooling that feeds the InnerProduct; the data (DummyData's) and the
    pooled map the InnerProduct reads stay in Caffe's order, the layout
    changing across the first convolution and the last pooling."""
    assert _channels_last(VGG_LIKE) == {'conv1', 'conv2', 'pool1', 'conv3', 'drop3'}


def test_a_map_any_other_layer_reads_keeps_caffes_order_with_its_pointwise_kin():
    """A convolution's map that a Split also hands to an InnerProduct: the
    split's tops share the map's storage, so the whole tied group stays."""
    alone = (HEAD + _conv('conv1', 'data') + _layer('relu1', 'ReLU', ['conv1'], ['r1'])
             + _conv('conv2', 'r1') + _conv('conv2b', 'conv2')
             + _layer('pool2', 'Pooling', ['conv2b'], ['pool2'], POOL) + IP_LOSS)
    assert _channels_last(alone) == {'conv1', 'r1', 'conv2', 'conv2b'}
    shared = alone + (
        _layer('ip0', 'InnerProduct', ['r1'], ['ip0'], 'inner_product_param { num_output: 2 }')
        + _layer('loss0', 'SoftmaxWithLoss', ['ip0', 'label'], ['loss0']))
    # r1 (and its split's tops) stay; conv2 would then read Caffe's order
    # and write channels-last, so its maps stay too, and conv2b's after them.
    assert _channels_last(shared) == set()


def test_a_residual_block_goes_channels_last_and_eltwise_ties_its_bottoms():
    """The Eltwise's bottoms and top are one group, channels-last only if
    all of them can be; an LRN (Caffe's order only) in one branch keeps the
    whole block in Caffe's order."""
    block = (HEAD + _conv('conv1', 'data')
             + _conv('conv2', 'conv1') + _conv('conv3', 'conv1')
             + _layer('sum', 'Eltwise', ['conv2', 'conv3'], ['sum'])
             + _layer('relu', 'ReLU', ['sum'], ['sum']) + _conv('conv4', 'sum')
             + _layer('pool2', 'Pooling', ['conv4'], ['pool2'], POOL) + IP_LOSS)
    got = _channels_last(block)
    assert {'conv1', 'conv2', 'conv3', 'sum', 'conv4'} <= got
    assert all(n.startswith('conv1_') for n in got - {'conv1', 'conv2', 'conv3', 'sum', 'conv4'})
    # An LRN in a branch reads conv1's map: that stays in Caffe's order, so
    # conv2 beside it would change the layout; nothing moves.
    with_lrn = block.replace(_conv('conv3', 'conv1'), _layer(
        'norm3', 'LRN', ['conv1'], ['n3']) + _conv('conv3', 'n3'))
    assert _channels_last(with_lrn) == set()


def test_resnets_batchnorm_scale_relu_chains_go_channels_last():
    """conv -> BatchNorm -> Scale -> ReLU in place, twice, and the sum with
    the shortcut: every map of the block channels-last."""
    def unit(name, bottom):
        return (_conv(name, bottom)
                + _layer('bn_' + name, 'BatchNorm', [name], [name])
                + _layer('sc_' + name, 'Scale', [name], [name], 'scale_param { bias_term: true }')
                + _layer('relu_' + name, 'ReLU', [name], [name]))
    text = (HEAD + unit('conv1', 'data') + unit('a', 'conv1') + unit('b', 'a')
            + _layer('sum', 'Eltwise', ['b', 'conv1'], ['sum'])
            + _layer('relu', 'ReLU', ['sum'], ['sum']) + unit('c', 'sum')
            + _layer('pool2', 'Pooling', ['c'], ['pool2'], POOL) + IP_LOSS)
    got = _channels_last(text)
    assert {'conv1', 'a', 'b', 'sum', 'c'} <= got
    assert all(n in ('conv1', 'a', 'b', 'sum', 'c') or n.startswith('conv1_') for n in got)


def test_the_nets_outputs_keep_caffes_order():
    """conv2's map is the net's output: it stays, and conv1's map, then
    read by no convolution that writes channels-last, stays too."""
    text = (HEAD + _conv('conv1', 'data') + _layer('relu1', 'ReLU', ['conv1'], ['conv1'])
            + _conv('conv2', 'conv1'))
    assert _channels_last(text, fixed_outputs=False) == {'conv1', 'conv2'}
    assert _channels_last(text) == set()


def test_an_inceptions_branches_and_their_concat_go_channels_last_together():
    """GoogLeNet's inception: a Concat along the channels ties its bottoms
    and its top (channels-last, rows of channels side by side), so the
    branches' convolutions run channels-last; where the Concat's map is
    read in Caffe's order (an InnerProduct), the convolutions writing it
    would change the layout, and the whole inception stays."""
    inception = (HEAD + _layer('pool0', 'Pooling', ['data'], ['pool0'], POOL)
                 + _conv('reduce', 'pool0') + _layer('relu_r', 'ReLU', ['reduce'], ['reduce'])
                 + _conv('conv3x3', 'reduce') + _conv('conv1x1', 'pool0')
                 + _layer('concat', 'Concat', ['conv3x3', 'conv1x1'], ['concat']))
    text = inception + _layer('pool2', 'Pooling', ['concat'], ['pool2'], POOL) + IP_LOSS
    assert _channels_last(text) == {'reduce', 'conv3x3', 'conv1x1', 'concat'}
    read_so = inception + IP_LOSS.replace('bottom: "pool2"', 'bottom: "concat"')
    assert 'bottom: "concat"' in read_so
    assert _channels_last(read_so) == set()


def test_concat_on_channels_last_blobs_computes_caffes_values():
    """The generic Concat (what the CPU runs, and the GPU falls back on)
    over channels-last bottoms and top: the values and gradients of the
    same layer in Caffe's order, transposed."""
    from caffeplus.layer import create_layer
    lp = text_format.Parse('name: "c" type: "Concat" bottom: "a" bottom: "b" top: "y"',
                           caffe_pb2.LayerParameter())
    r = numpy.random.default_rng(8)
    xs = [r.standard_normal((2, c, 3, 4)).astype(numpy.float32) for c in (3, 5)]
    dy = r.standard_normal((2, 8, 3, 4)).astype(numpy.float32)
    last = lambda a: numpy.ascontiguousarray(a.transpose(0, 2, 3, 1))
    runs = {}
    for name in ('NCHW', 'NHWC'):
        layer = create_layer(lp)
        bottom, top = [Blob(x.shape, name=n) for x, n in zip(xs, 'ab')], [Blob(name='y')]
        for b in bottom + top:
            b.layout = name
        layer.setup(bottom, top)
        assert layer.channels_last_ok()
        order = (lambda a: a) if name == 'NCHW' else last
        for b, x in zip(bottom, xs):
            b.data[...] = order(x).reshape(x.shape)
        layer.forward(bottom, top)
        top[0].diff[...] = order(dy).reshape(dy.shape)
        layer.backward(top, [True, True], bottom)
        runs[name] = (top[0].data.copy(), [b.diff.copy() for b in bottom])
    (y, dxs), (y_cl, dxs_cl) = runs['NCHW'], runs['NHWC']
    assert numpy.array_equal(y, numpy.concatenate(xs, axis=1))
    assert numpy.array_equal(y_cl.reshape(-1), last(y).reshape(-1))
    for dx, dx_cl in zip(dxs, dxs_cl):
        assert numpy.array_equal(dx_cl.reshape(-1), last(dx).reshape(-1))


def test_the_cpus_layers_move_nothing():
    """On the CPU no layer reads channels-last maps (the default setting
    asks for them; tests/test_channels_last_gpu.py has nchw move nothing)."""
    param = text_format.Parse(VGG_LIKE, caffe_pb2.NetParameter())
    assert config.get('layout') == 'nhwc'
    net = caffeplus.Net(param, caffeplus.TRAIN)
    assert all(b.layout == 'NCHW' for b in net._blobs)
    assert layout.layout_role(net.layers[net._layer_names.index('conv1')]) is None
    assert layout.layout_role(net.layers[net._layer_names.index('relu1')]) == 'pointwise'


def test_pycaffe_sees_a_channels_last_blob_in_caffes_order():
    """HostBlob (pycaffe's net.blobs): the logical (N, C, H, W) values,
    read and written through the channels-last storage."""
    blob = Blob((2, 3, 4, 5), name='m')
    blob.layout = 'NHWC'
    stored = numpy.arange(blob.count, dtype=numpy.float32)
    blob.data[...] = stored.reshape(blob.shape)          # the raw storage, in memory order
    view = HostBlob(blob).data
    assert view.shape == (2, 3, 4, 5)
    numpy.testing.assert_array_equal(view, stored.reshape(2, 4, 5, 3).transpose(0, 3, 1, 2))
    want = numpy.random.default_rng(3).standard_normal((2, 3, 4, 5)).astype(numpy.float32)
    HostBlob(blob).data = want
    numpy.testing.assert_array_equal(HostBlob(blob).data, want)
    numpy.testing.assert_array_equal(blob.data.reshape(-1),
                                     want.transpose(0, 2, 3, 1).reshape(-1))


@pytest.mark.parametrize('value', ['nhcw', 'channels_last', ''])
def test_the_layout_setting_names_its_choices(value):
    with pytest.raises(caffeplus.errors.CaffeplusError, match='nchw, nhwc'):
        with config.using(layout=value):
            pass


@pytest.mark.parametrize('type_', ['BatchNorm', 'Scale'])
def test_batchnorm_and_scale_on_channels_last_blobs_compute_caffes_values(type_):
    """The generic layers (what the GPU falls back on) over a channels-last
    blob: the values and gradients of the same layer in Caffe's order,
    transposed."""
    from caffeplus.layer import create_layer
    extra = 'scale_param { bias_term: true }' if type_ == 'Scale' else ''
    lp = text_format.Parse('name: "l" type: "%s" bottom: "x" top: "y" %s' % (type_, extra),
                           caffe_pb2.LayerParameter())
    r = numpy.random.default_rng(5)
    x = (2 * r.standard_normal((4, 3, 5, 6)) + 1).astype(numpy.float32)
    dy = r.standard_normal(x.shape).astype(numpy.float32)
    last = lambda a: numpy.ascontiguousarray(a.transpose(0, 2, 3, 1))
    params = [r.standard_normal(3).astype(numpy.float32) for _ in range(2)]
    runs = {}
    for name in ('NCHW', 'NHWC'):
        caffeplus.set_random_seed(3)
        layer = create_layer(lp)
        bottom, top = [Blob(x.shape, name='x')], [Blob(name='y')]
        bottom[0].layout = top[0].layout = name
        layer.setup(bottom, top)
        if type_ == 'Scale':                    # the same scale and bias, not 1 and 0
            for b, v in zip(layer.blobs, params):
                b.data[...] = v
        stored = x if name == 'NCHW' else last(x)
        bottom[0].data[...] = stored.reshape(x.shape)
        layer.forward(bottom, top)
        top[0].diff[...] = (dy if name == 'NCHW' else last(dy)).reshape(x.shape)
        layer.backward(top, [True], bottom)
        runs[name] = (top[0].data.copy(), bottom[0].diff.copy(),
                      [b.diff.copy() for b in layer.blobs])
    (y, dx, dp), (y_cl, dx_cl, dp_cl) = runs['NCHW'], runs['NHWC']
    numpy.testing.assert_allclose(y_cl.reshape(-1), last(y).reshape(-1), rtol=1e-5, atol=1e-5)
    numpy.testing.assert_allclose(dx_cl.reshape(-1), last(dx).reshape(-1), rtol=1e-5, atol=1e-5)
    for a, b in zip(dp_cl, dp):
        numpy.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_batchnorm_and_scale_take_channels_last_maps_only_where_switched_on(monkeypatch):
    """layout.CHANNELS_LAST_BATCHNORM (on by default): off, a BatchNorm net
    keeps Caffe's order around its BatchNorms."""
    text = (HEAD + _conv('conv1', 'data') + _layer('bn', 'BatchNorm', ['conv1'], ['conv1'])
            + _layer('sc', 'Scale', ['conv1'], ['conv1'], 'scale_param { bias_term: true }')
            + _layer('pool2', 'Pooling', ['conv1'], ['pool2'], POOL) + IP_LOSS)
    net = caffeplus.Net(text_format.Parse(text, caffe_pb2.NetParameter()), caffeplus.TRAIN)
    bn, sc = (net.layers[net._layer_names.index(n)] for n in ('bn', 'sc'))
    assert layout.CHANNELS_LAST_BATCHNORM
    assert layout.layout_role(bn) == 'tied' and layout.layout_role(sc) == 'tied'
    monkeypatch.setattr(layout, 'CHANNELS_LAST_BATCHNORM', False)
    assert layout.layout_role(bn) is None and layout.layout_role(sc) is None


def test_channels_last_batchnorm_kernels_build_in_a_module_of_their_own():
    """A failure to build them (a GPU where NVRTC rejects them) must leave
    the kernels every net uses (caffeplus.kernels' core and extra modules);
    their BatchNorms then run the generic code."""
    from caffeplus import kernels
    assert kernels._group('cp_bn_apply_nhwc_vec') == kernels._group('cp_bn_stats_nhwc') == 'nhwc'
    assert kernels._group('cp_mpool_fwd_nhwc') == 'extra'
    assert kernels._group('cp_bn_fwd') == 'core'
    assert {'nhwc', 'nhwc16', 'nhwcbf16'} <= set(kernels.SOURCES)
    assert 'cp_bn_dx_nhwc_vec' not in kernels.SOURCES['extra']


def _bench_fp16(path):
    from caffeplus.memory import shapes
    param = shapes.load_net_param(path, phase=caffe_pb2.TRAIN)
    precision.override(param, 'fp16')
    return shapes.build_net(param)


@pytest.mark.parametrize('net_name, between, count, kept', [
    # (Caffe's order: the data, the map an InnerProduct reads, the losses')
    ('resnet50_b64', False, 102, {'data', 'pool5', 'fc1000'}),
    ('vgg16_b64', False, 17, {'data', 'pool5', 'fc6'}),
    # the LRN reads conv1's map; grouped convolutions read the rest
    ('alexnet_b128', True, 0, {'data', 'conv1', 'norm1', 'pool1', 'conv2'}),
    # pool2, a ceil-rule max pooling on the argmax kernels, ties the
    # inceptions to the stem's LRN in Caffe's order; where it may write its
    # top in the other order (transposed after its kernels), the inceptions
    # go channels-last and the stem and the auxiliary classifiers' maps stay
    ('googlenet_b64', False, 0, {'conv1/7x7_s2', 'pool2/3x3_s2', 'inception_3a/output'}),
    ('googlenet_b64', True, 113, {'conv1/7x7_s2', 'pool1/norm1', 'conv2/norm2',
                                  'loss1/ave_pool'})])
def test_the_gpus_layout_is_modelled_on_a_net_built_on_the_cpu(net_name, between, count, kept,
                                                               monkeypatch):
    """caffeplus.layout.modelled_blobs, what the estimate reads: the blobs
    a GPU build stores channels-last (layout.apply), from the GPU layers'
    roles, on a net built here, where nothing is moved."""
    from caffeplus.layers import cudnn_pooling
    monkeypatch.setattr(cudnn_pooling, 'ARGMAX_BETWEEN_ORDERS', between)
    net = _bench_fp16(os.path.join(SHARED, 'bench', net_name + '.prototxt'))
    assert all(b.layout == 'NCHW' for b in net._blobs)
    with config.using(layout='nhwc'):
        moved = {net._blob_names[i] for i in layout.modelled_blobs(net)}
    assert len(moved) == count and not moved & kept
    with config.using(layout='nchw'):
        assert layout.modelled_blobs(net) == set()


@pytest.mark.parametrize('grouped, lrn, count', [(False, False, 0), (True, False, 4),
                                                  (False, True, 0), (True, True, 9)])
def test_lrn_and_grouped_convolutions_channels_last_where_their_switches_allow(
        grouped, lrn, count, monkeypatch):
    """layers/cudnn_lrn.CHANNELS_LAST (an LRN on caffeplus's channels-last
    kernels, bottom and top in one order) and
    layers/cudnn_conv.GROUPED_CHANNELS_LAST: BVLC AlexNet goes channels-last
    from conv1 to pool5's bottom with both (from pool2's top with the
    grouped one alone: norm2 holds its bottom), none with the LRN one alone
    (its grouped convolutions tie the rest); GoogLeNet's stem joins its
    inceptions. Under the stock plan a grouped convolution runs Caffe's
    per-group calls, in Caffe's order only."""
    from caffeplus.layers import cudnn_conv, cudnn_lrn
    monkeypatch.setattr(cudnn_conv, 'GROUPED_CHANNELS_LAST', grouped)
    monkeypatch.setattr(cudnn_lrn, 'CHANNELS_LAST', lrn)
    net = _bench_fp16(os.path.join(SHARED, 'bench', 'alexnet_b128.prototxt'))
    with config.using(layout='nhwc'):
        moved = {net._blob_names[i] for i in layout.modelled_blobs(net)}
    assert len(moved) == count
    if count == 9:
        assert moved == {'conv1', 'norm1', 'pool1', 'conv2', 'norm2', 'pool2', 'conv3',
                         'conv4', 'conv5'}
        google = _bench_fp16(os.path.join(SHARED, 'bench', 'googlenet_b64.prototxt'))
        with config.using(layout='nhwc'):
            stem = {google._blob_names[i] for i in layout.modelled_blobs(google)}
        assert len(stem) == 119 and {'conv1/7x7_s2', 'pool1/norm1', 'conv2/norm2'} <= stem
    conv2 = net.layers[net._layer_names.index('conv2')]
    assert conv2.group == 2 and conv2.gpu_channels_last_ok() == grouped
    conv2.memory_plan = 'stock'
    assert not conv2.gpu_channels_last_ok()


def test_the_estimate_counts_an_image_convolutions_relaid_maps(monkeypatch):
    """A 16-bit image convolution with a channels-last top runs channels-last
    on the GPU, its image padded to 4 channels (VGG-16's conv1_1); where its
    top stays in Caffe's order (BVLC AlexNet's conv1, read by an LRN) it
    runs so where IMAGE_CHANNELS_LAST, its top written channels-last first:
    the estimate's shared scratch counts those buffers, and the double
    partial sums of the largest channels-last bias gradient (conv1's 96
    channels over 4,096 blocks; VGG-16's 512-channel convolutions reach the
    cap of 2**19), and none under `--layout nchw`. The image is counted
    relaid channels-last only where timed search weighs no calls that read
    it as it is for both the forward and the filter gradient (space-to-depth
    for AlexNet's strided conv1; im2row, switched on, for any image layer)."""
    from caffeplus.cudnn import algo_search
    from caffeplus.layers import cudnn_conv
    from caffeplus.memory import workspace_model as wm
    net = _bench_fp16(os.path.join(SHARED, 'bench', 'alexnet_b128.prototxt'))
    image = net.blobs['data']
    top = net.blobs['conv1']
    n, c, h, w = image.shape
    assert c == 3 and tuple(top.shape) == (128, 96, 55, 55)
    relaid = 2 * n * 4 * h * w
    with config.using(layout='nhwc'):
        monkeypatch.setattr(cudnn_conv, 'IMAGE_CHANNELS_LAST', False)
        assert wm.shared_scratch_bytes(net, 'shared') == 0
        monkeypatch.setattr(cudnn_conv, 'IMAGE_CHANNELS_LAST', True)
        assert wm.shared_scratch_bytes(net, 'shared') == 2 * top.count + 8 * 96 * 4096
        monkeypatch.setattr(algo_search, 'S2D_SEARCH_SIXTEEN_BIT', False)
        assert wm.shared_scratch_bytes(net, 'shared') == \
            relaid + 2 * top.count + 8 * 96 * 4096
        with config.using(gemm_search='on'):
            assert wm.shared_scratch_bytes(net, 'shared') == 2 * top.count + 8 * 96 * 4096
    with config.using(layout='nchw'):
        assert wm.shared_scratch_bytes(net, 'shared') == 0
    vgg = _bench_fp16(os.path.join(SHARED, 'bench', 'vgg16_b64.prototxt'))
    n, c, h, w = vgg.blobs['data'].shape
    with config.using(layout='nhwc'):      # (conv1_1's top goes channels-last itself)
        assert wm.shared_scratch_bytes(vgg, 'shared') == 2 * n * 4 * h * w + 8 * 2 ** 19
        with config.using(gemm_search='on'):
            assert wm.shared_scratch_bytes(vgg, 'shared') == 8 * 2 ** 19


@pytest.mark.parametrize('spec, settings', [
    ('on', dict(image=True, argmax=True, lrn=True, grouped=True)),
    ('off', dict(image=False, argmax=False, lrn=False, grouped=False)),
    ('lrn=on,grouped=on', dict(lrn=True, grouped=True)), ('image=off', dict(image=False)),
    ('default', {})])
def test_the_layout_switches_reach_the_script_they_run(spec, settings):
    """dev/layout_switches.py sets the switches a SPEC names in the Python
    process it starts (through a sitecustomize module, so processes that one
    spawns too), the others as the code has them; an unknown name fails."""
    import subprocess
    import sys
    from caffeplus.layers import cudnn_conv, cudnn_lrn, cudnn_pooling
    want = dict(image=cudnn_conv.IMAGE_CHANNELS_LAST, argmax=cudnn_pooling.ARGMAX_BETWEEN_ORDERS,
                lrn=cudnn_lrn.CHANNELS_LAST, grouped=cudnn_conv.GROUPED_CHANNELS_LAST)
    want.update(settings)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, 'dev', 'layout_switches.py')
    code = ('from caffeplus.layers import cudnn_conv as c, cudnn_lrn as l, cudnn_pooling as p; '
            'print(c.IMAGE_CHANNELS_LAST, p.ARGMAX_BETWEEN_ORDERS, l.CHANNELS_LAST, '
            'c.GROUPED_CHANNELS_LAST)')
    out = subprocess.run([sys.executable, script, spec, '-c', code], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split('\n')[-2] == ' '.join(
        str(want[k]) for k in ('image', 'argmax', 'lrn', 'grouped'))
    bad = subprocess.run([sys.executable, script, 'lrm=on', '-c', 'pass'], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "unknown switch setting 'lrm=on'" in bad.stderr
