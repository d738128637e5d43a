"""Channels-last maps on the GPU (caffeplus.layout, the `layout` setting):
a 16-bit net stored so computes what the same net in Caffe's order does,
within the 16-bit type's rounding (the two take different cuDNN kernels),
with the same weights and inputs; pycaffe sees Caffe's order either way."""
import numpy
import pytest
from google.protobuf import text_format

import caffeplus
from caffeplus import config, precision
from caffeplus.proto import caffe_pb2

pytestmark = pytest.mark.gpu

# VGG-16's layer kinds: the Input (Caffe's order) read by the first
# convolution, in-place ReLUs, a convolution without bias and a 1x1 one,
# max pooling between convolutions (tiling 2x2 windows, and overlapping
# padded 3x3 ones: caffeplus's argmax kernels) and average pooling into the
# InnerProduct (cuDNN's, channels-last in, Caffe's order out);
# force_backward so the data's gradient runs through the first
# convolution's re-laid copy.
NET = """
name: "vgg_like" force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 8 dim: 3 dim: 20 dim: 20 } shape { dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1
    weight_filler { type: "gaussian" std: 0.2 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1
    weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool1" type: "Pooling" bottom: "conv2" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv3" type: "Convolution" bottom: "pool1" top: "conv3"
  convolution_param { num_output: 32 kernel_size: 3 pad: 1 bias_term: false
    weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu3" type: "ReLU" bottom: "conv3" top: "conv3" }
layer { name: "pool3" type: "Pooling" bottom: "conv3" top: "pool3"
  pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 } }
layer { name: "conv4" type: "Convolution" bottom: "pool3" top: "conv4"
  convolution_param { num_output: 24 kernel_size: 1
    weight_filler { type: "gaussian" std: 0.2 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "pool2" type: "Pooling" bottom: "conv4" top: "pool2"
  pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""
CHANNELS_LAST = ('conv1', 'conv2', 'pool1', 'conv3', 'pool3', 'conv4')
TOLERANCE = {'fp16': 2e-2, 'bf16': 6e-2}
# The residual net's Scale gradients are sums of small products that cancel:
# their FP16 rounding over two kernels' orders reached 2.8% on the H200.
RESIDUAL_TOLERANCE = {'fp16': 4e-2, 'bf16': 6e-2}


def _net(sixteen, layout, weights=None, text=NET):
    param = text_format.Parse(text, caffe_pb2.NetParameter())
    with precision.setting(sixteen), config.using(layout=layout):
        net = caffeplus.Net(param, caffe_pb2.TRAIN)
    if weights is not None:
        for p, w in zip(net.learnable_params, weights):
            p.data = w
    return net


def _run(net, x, label):
    loss, grads = _one_pass(net, x, label)
    maps = {n: net.blobs[n].data.copy() for n in CHANNELS_LAST + ('pool2',)}
    maps['data diff'] = net.blobs['data'].diff.copy()
    maps['conv2 diff'] = net.blobs['conv2'].diff.copy()
    return loss, grads, maps


def _relative(a, b):
    return float(numpy.linalg.norm(a - b) / max(numpy.linalg.norm(b), 1e-30))


@pytest.mark.parametrize('search', ['heuristic', 'timed'])
@pytest.mark.parametrize('sixteen', ['fp16', 'bf16'])
def test_a_channels_last_net_computes_what_caffes_order_does(gpu, sixteen, search):
    if sixteen == 'bf16':
        pytest.importorskip('ml_dtypes')
    from caffeplus.memory import workspace
    previous = workspace.set_search(search)
    try:
        ref = _net(sixteen, 'nchw')
        weights = [p.data.get().copy() for p in ref.learnable_params]
        nets = {'nchw': ref, 'nhwc': _net(sixteen, 'nhwc', weights)}
        r = numpy.random.RandomState(7)
        x = r.standard_normal((8, 3, 20, 20)).astype(numpy.float32)
        label = r.randint(0, 5, size=8).astype(numpy.float32)
        runs = {k: _run(net, x, label) for k, net in nets.items()}
    finally:
        workspace.set_search(previous)
    moved = {n for n, b in nets['nhwc']._blob_dict.items() if b.layout == 'NHWC'}
    assert moved == set(CHANNELS_LAST)
    assert all(b.layout == 'NCHW' for b in ref._blobs)
    layers = {l.layer_param.name: l for l in nets['nhwc'].layers}
    assert all(l._cd is not None and l._cd.nhwc for l in layers.values()
               if l.type == 'Convolution')
    # The image's 3 channels padded to 4 for cuDNN's first-layer kernels
    assert layers['conv1'].padded_channels == 4 and layers['conv1']._cd.x_full[1] == 4
    assert layers['conv1']._cd.w_shape == (16, 4, 3, 3) and layers['conv2'].padded_channels == 0
    assert layers['pool1']._argmax_kernels() and layers['pool3']._argmax_kernels()
    assert not layers['pool2']._argmax_kernels()        # (AVE: cuDNN's)
    tol = TOLERANCE[sixteen]
    (loss, grads, maps), (loss_cl, grads_cl, maps_cl) = runs['nchw'], runs['nhwc']
    assert loss_cl == pytest.approx(loss, rel=tol)
    for p, g, g_cl in zip(ref.learnable_params, grads, grads_cl):
        assert _relative(g_cl, g) < tol, p.name
    for name, m in maps.items():            # pycaffe's views: Caffe's order
        assert maps_cl[name].shape == m.shape
        assert _relative(maps_cl[name], m) < tol, name
    from caffeplus import kernels
    assert not kernels.failures()


def test_a_channels_last_convolution_applies_its_relu_in_the_bias_pass(gpu):
    """A convolution with a bias and an in-place ReLU after it adds the bias
    and applies the ReLU in one pass (fused_chain._ConvReLUChain); the maps
    and gradients are those of the two layers run one by one (a hook
    between layers keeps them apart), bit for bit."""
    from caffeplus.backend import mathmode
    mathmode.set_math_mode('deterministic')
    try:
        apart = _net('fp16', 'nhwc')
        weights = [p.data.get().copy() for p in apart.learnable_params]
        fused = _net('fp16', 'nhwc', weights)
        apart.before_layer_forward.append(lambda i: None)    # not chain_safe
        r = numpy.random.RandomState(11)
        x = r.standard_normal((8, 3, 20, 20)).astype(numpy.float32)
        label = r.randint(0, 5, size=8).astype(numpy.float32)
        (loss_a, grads_a, maps_a), (loss_f, grads_f, maps_f) = \
            _run(apart, x, label), _run(fused, x, label)
    finally:
        mathmode.set_math_mode('strict')
    layers = {l.layer_param.name: l for l in fused.layers}
    for name in ('conv1', 'conv2'):
        ch = layers[name]._chain
        assert type(ch).__name__ == '_ConvReLUChain' and ch.fwd_done, name
        assert not {l.layer_param.name: l for l in apart.layers}[name]._chain.fwd_done
    assert layers['conv3']._chain is None           # no bias: its ReLU runs alone
    assert (maps_f['conv1'] > 0).any() and (maps_f['conv1'] == 0).any()
    assert loss_f == loss_a
    for name, m in maps_a.items():
        assert maps_f[name].tobytes() == m.tobytes(), name
    for g_a, g_f in zip(grads_a, grads_f):
        assert g_f.tobytes() == g_a.tobytes()
    from caffeplus import kernels
    assert not kernels.failures()


# ResNet's layer kinds: the image's convolution, BatchNorm -> Scale -> ReLU
# in place (the fused chains), a max pooling with Caffe's ceil rule (cuDNN's
# windows differ: caffeplus's argmax kernels), a bottleneck with its
# shortcut summed by an Eltwise, and the average pooling into the
# InnerProduct.
def _unit(name, bottom, out, k, relu=True):
    return ('layer { name: "%s" type: "Convolution" bottom: "%s" top: "%s" convolution_param {'
            ' num_output: %d kernel_size: %d pad: %d bias_term: false'
            ' weight_filler { type: "msra" } } }\n'
            'layer { name: "bn_%s" type: "BatchNorm" bottom: "%s" top: "%s" }\n'
            'layer { name: "sc_%s" type: "Scale" bottom: "%s" top: "%s"'
            ' scale_param { bias_term: true } }\n' % (name, bottom, name, out, k, k // 2,
                                                       name, name, name, name, name, name)
            + ('layer { name: "relu_%s" type: "ReLU" bottom: "%s" top: "%s" }\n'
               % (name, name, name) if relu else ''))


RESNET_LIKE = ("""
name: "resnet_like" force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 8 dim: 3 dim: 24 dim: 24 } shape { dim: 8 } } }
""" + _unit('conv1', 'data', 16, 3) + """
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
""" + _unit('a', 'pool1', 8, 1) + _unit('b', 'a', 8, 3) + _unit('c', 'b', 16, 1, relu=False) + """
layer { name: "sum" type: "Eltwise" bottom: "pool1" bottom: "c" top: "sum" }
layer { name: "relu_sum" type: "ReLU" bottom: "sum" top: "sum" }
""" + _unit('d', 'sum', 16, 3) + """
layer { name: "pool2" type: "Pooling" bottom: "d" top: "pool2"
  pooling_param { pool: AVE kernel_size: 12 stride: 1 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
""")


def _both_layouts(text, sixteen):
    """The net of `text` in Caffe's order and channels-last, the second
    with the first's weights."""
    nchw = _net(sixteen, 'nchw', text=text)
    return {'nchw': nchw, 'nhwc': _net(sixteen, 'nhwc', [q.data.get() for q in
                                                          nchw.learnable_params], text=text)}


def _one_pass(n, x, label):
    """Forward and backward once: the loss and the parameter gradients."""
    n.blobs['data'].data[...] = x
    n.blobs['label'].data[...] = label
    n.clear_param_diffs()
    n.forward_prefilled()
    n.backward_all()
    return float(n.blobs['loss'].data), [p.diff.get().copy() for p in n.learnable_params]


@pytest.mark.parametrize('sixteen', ['fp16', 'bf16'])
def test_a_channels_last_residual_net_computes_what_caffes_order_does(gpu, sixteen, monkeypatch):
    """BatchNorm (its statistics, the moving sums, the fused chain with
    Scale and ReLU, both ways), Eltwise and the ceil-rule max pooling over
    channels-last maps (switched on: layout.CHANNELS_LAST_BATCHNORM): the
    loss, every gradient and the moving sums of the same net in Caffe's
    order, within the type's rounding."""
    if sixteen == 'bf16':
        pytest.importorskip('ml_dtypes')
    from caffeplus import layout as layout_module
    monkeypatch.setattr(layout_module, 'CHANNELS_LAST_BATCHNORM', True)
    nets = _both_layouts(RESNET_LIKE, sixteen)
    ref, net = nets['nchw'], nets['nhwc']
    moved = {n for n, b in net._blob_dict.items() if b.layout == 'NHWC'}
    assert {'conv1', 'pool1', 'a', 'b', 'c', 'sum', 'd'} <= moved
    assert not {'data', 'pool2', 'ip1'} & moved
    r = numpy.random.RandomState(9)
    x = r.standard_normal((8, 3, 24, 24)).astype(numpy.float32)
    label = r.randint(0, 5, size=8).astype(numpy.float32)
    out = {}
    for name, n in nets.items():
        out[name] = _one_pass(n, x, label) + (
            [b.data.get().copy() for l in n.layers if l.type == 'BatchNorm' for b in l.blobs],
            n.blobs['data'].diff.copy(), n.blobs['sum'].data.copy())
    tol = RESIDUAL_TOLERANCE[sixteen]
    (loss, grads, stats, ddata, sums), (loss_cl, grads_cl, stats_cl, ddata_cl, sums_cl) = \
        out['nchw'], out['nhwc']
    assert loss_cl == pytest.approx(loss, rel=tol)
    for p, g, g_cl in zip(ref.learnable_params, grads, grads_cl):
        assert _relative(g_cl, g) < tol, p.name
    for a, b in zip(stats_cl, stats):
        numpy.testing.assert_allclose(a, b, rtol=tol, atol=1e-3)
    assert _relative(ddata_cl, ddata) < tol and _relative(sums_cl, sums) < tol
    from caffeplus import kernels
    assert not kernels.failures()


# (At 0.05 the loss leapt from 4.4 to 9.5 in a step: a run that chaotic
# takes FP16's rounding differences from 1e-3 at step 3 to 5% at step 4.)
LR = 0.01


def test_channels_last_training_follows_caffes_order(gpu):
    """Five SGD steps from the same weights: the same losses within FP16's
    rounding (the 16-bit channels-last filter copies follow the updated
    masters), and the weights moved alike (the filter gradients went back
    to the masters in Caffe's order)."""
    ref = _net('fp16', 'nchw')
    weights = [p.data.get().copy() for p in ref.learnable_params]
    nets = {'nchw': ref, 'nhwc': _net('fp16', 'nhwc', weights)}
    start = [w.copy() for w in weights]
    r = numpy.random.RandomState(11)
    x = r.standard_normal((8, 3, 20, 20)).astype(numpy.float32)
    label = r.randint(0, 5, size=8).astype(numpy.float32)
    losses = {}
    for name, net in nets.items():
        losses[name] = []
        for _ in range(5):
            loss, grads, _ = _run(net, x, label)
            losses[name].append(loss)
            for p in net.learnable_params:
                p.data -= LR * p.diff
    assert losses['nchw'][-1] < losses['nchw'][0]
    numpy.testing.assert_allclose(losses['nhwc'], losses['nchw'], rtol=3e-2)
    # The two runs' steps drift apart in FP16 (ReLUs flip at different
    # rounding); a gradient in the wrong order would move the weights
    # another way altogether.
    for p, q, w in zip(nets['nhwc'].learnable_params, ref.learnable_params, start):
        assert _relative(p.data.get() - w, q.data.get() - w) < 0.15, q.name


def test_channels_last_1x1_convolution_on_cublas_computes_what_cudnn_does(gpu, monkeypatch):
    """A 1x1 convolution between channels-last maps as cuBLAS's GEMMs on the
    N*H*W x C matrix (timed search's variant, forced here for all three
    calls): the loss, gradients and maps of the same net in Caffe's order
    on cuDNN's calls, within FP16's rounding."""
    from caffeplus.layers import conv_gemm
    from caffeplus.memory import workspace
    ref = _net('fp16', 'nchw')
    weights = [p.data.get().copy() for p in ref.learnable_params]
    monkeypatch.setattr(conv_gemm._GemmConv, 'time', lambda self, *a, **k: 0.0)
    previous = workspace.set_search('timed')
    try:
        net = _net('fp16', 'nhwc', weights)
        r = numpy.random.RandomState(13)
        x = r.standard_normal((8, 3, 20, 20)).astype(numpy.float32)
        label = r.randint(0, 5, size=8).astype(numpy.float32)
        loss_cl, grads_cl, maps_cl = _run(net, x, label)
    finally:
        workspace.set_search(previous)
    loss, grads, maps = _run(ref, x, label)
    conv4 = {l.layer_param.name: l for l in net.layers}['conv4']
    assert conv4._gemm is not None and conv4._gemm.nhwc and conv4._cd.nhwc
    assert all(conv4._sites[k].choice.variant == 2 for k in ('fwd', 'bwd_data', 'bwd_filter'))
    tol = TOLERANCE['fp16']
    assert loss_cl == pytest.approx(loss, rel=tol)
    for p, g, g_cl in zip(ref.learnable_params, grads, grads_cl):
        assert _relative(g_cl, g) < tol, p.name
    for name, m in maps.items():
        assert _relative(maps_cl[name], m) < tol, name


# RESNET_LIKE's block followed by an identity block: `sum` feeds a Split
# (the next block's branch and its shortcut), and each sum's second bottom
# ends in BatchNorm -> Scale (ResNet-50's branch2c).
RESNET_SPLIT = RESNET_LIKE.replace(
    _unit('d', 'sum', 16, 3),
    _unit('d', 'sum', 16, 3, relu=False) + """
layer { name: "sum2" type: "Eltwise" bottom: "sum" bottom: "d" top: "sum2" }
layer { name: "relu_sum2" type: "ReLU" bottom: "sum2" top: "sum2" }
""").replace('bottom: "d" top: "pool2"', 'bottom: "sum2" top: "pool2"')


@pytest.mark.parametrize('plan', ['stock', 'shared'])
@pytest.mark.parametrize('sixteen', ['fp16', 'bf16'])
def test_residual_sums_fused_with_their_neighbours_change_no_bit(gpu, sixteen, plan,
                                                                 monkeypatch):
    """Channels-last, three steps of SGD: the branch's normalize pass run
    with the Eltwise SUM (cp_bn_apply_add_nhwc_vec), the Split's backward
    with the SUM's (cp_sum_scale2) and the SUM's gradient handed to the
    branch's BatchNorm chain give the losses, weights and BatchNorm
    statistics of the same net with those kernels one after another."""
    if sixteen == 'bf16':
        pytest.importorskip('ml_dtypes')
    from caffeplus import kernels
    from caffeplus.layers import fused_chain
    r = numpy.random.RandomState(13)
    x = r.standard_normal((8, 3, 24, 24)).astype(numpy.float32)
    label = r.randint(0, 5, size=8).astype(numpy.float32)
    runs = {}
    for fused in (True, False):
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(fused_chain, '_pair_sum_chains', lambda chains: None)
                m.setattr(fused_chain, 'GPUSplitLayer', type('NoSplit', (), {}))
            caffeplus.set_random_seed(5)
            with precision.setting(sixteen), config.using(layout='nhwc'):
                net = caffeplus.Net(text_format.Parse(RESNET_SPLIT, caffe_pb2.NetParameter()),
                                    caffe_pb2.TRAIN, memory=plan)
            sums = [c for c in net._fused_chains if getattr(c, 'eltwise', None) is not None]
            assert [(c.split is not None, c.branch is not None) for c in sums] == \
                ([(True, True), (False, True)] if fused else [(False, False), (False, False)])
            assert net._blob_dict['c'].layout == 'NHWC'
            losses = []
            for _ in range(3):
                net.blobs['data'].data[...] = x
                net.blobs['label'].data[...] = label
                net.clear_param_diffs()
                net.forward_prefilled()
                losses.append(float(net.blobs['loss'].data))
                net.backward_all()
                for p in net.learnable_params:
                    p.data = p.data.get() - numpy.float32(LR) * p.diff.get()
            runs[fused] = (losses, [p.data.get().tobytes() for p in net.learnable_params],
                           [b.data.get().tobytes() for l in net.layers
                            if l.type == 'BatchNorm' for b in l.blobs])
    assert runs[True] == runs[False]
    assert not kernels.failures()


# GoogLeNet's inception: four branches (a 1x1 convolution, 1x1 -> 3x3, 1x1
# -> 5x5 and a 3x3 max pooling -> 1x1) joined by a Concat along the channels,
# twice; average pooling into the InnerProduct.
INCEPTION_LIKE = """
name: "inception_like" force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 8 dim: 3 dim: 16 dim: 16 } shape { dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1
    weight_filler { type: "gaussian" std: 0.2 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
""" + ''.join("""
layer { name: "%(m)s/1x1" type: "Convolution" bottom: "%(b)s" top: "%(m)s/1x1"
  convolution_param { num_output: 8 kernel_size: 1 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "%(m)s/3x3_reduce" type: "Convolution" bottom: "%(b)s" top: "%(m)s/3x3_reduce"
  convolution_param { num_output: 8 kernel_size: 1 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "%(m)s/relu_r" type: "ReLU" bottom: "%(m)s/3x3_reduce" top: "%(m)s/3x3_reduce" }
layer { name: "%(m)s/3x3" type: "Convolution" bottom: "%(m)s/3x3_reduce" top: "%(m)s/3x3"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1
    weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "%(m)s/5x5" type: "Convolution" bottom: "%(m)s/3x3_reduce" top: "%(m)s/5x5"
  convolution_param { num_output: 8 kernel_size: 5 pad: 2
    weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "%(m)s/pool" type: "Pooling" bottom: "%(b)s" top: "%(m)s/pool"
  pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 } }
layer { name: "%(m)s/pool_proj" type: "Convolution" bottom: "%(m)s/pool" top: "%(m)s/pool_proj"
  convolution_param { num_output: 8 kernel_size: 1 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "%(m)s/output" type: "Concat" top: "%(m)s/output" bottom: "%(m)s/1x1"
  bottom: "%(m)s/3x3" bottom: "%(m)s/5x5" bottom: "%(m)s/pool_proj" }
layer { name: "%(m)s/relu" type: "ReLU" bottom: "%(m)s/output" top: "%(m)s/output" }
""" % {'m': m, 'b': b} for m, b in (('i1', 'conv1'), ('i2', 'i1/output'))) + """
layer { name: "pool5" type: "Pooling" bottom: "i2/output" top: "pool5"
  pooling_param { pool: AVE kernel_size: 4 stride: 4 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool5" top: "ip1"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize('sixteen', ['fp16', 'bf16'])
def test_a_channels_last_inception_computes_what_caffes_order_does(gpu, sixteen):
    """Concat along the channels of channels-last maps (one 2-D copy a
    bottom, rows of channels side by side): the inceptions' convolutions
    and their Concats channels-last, the loss, every gradient and the
    Concats' maps (pycaffe's views) those of Caffe's order within the
    type's rounding."""
    if sixteen == 'bf16':
        pytest.importorskip('ml_dtypes')
    nets = _both_layouts(INCEPTION_LIKE, sixteen)
    ref, net = nets['nchw'], nets['nhwc']
    moved = {n for n, b in net._blob_dict.items() if b.layout == 'NHWC'}
    assert {'conv1', 'i1/output', 'i1/3x3', 'i1/pool', 'i2/output', 'i2/pool_proj'} <= moved
    assert not {'data', 'pool5', 'ip1'} & moved
    r = numpy.random.RandomState(21)
    x = r.standard_normal((8, 3, 16, 16)).astype(numpy.float32)
    label = r.randint(0, 5, size=8).astype(numpy.float32)
    out = {}
    for name, n in nets.items():
        out[name] = _one_pass(n, x, label) + (
            [n.blobs[b].data.copy() for b in ('i1/output', 'i2/output')],
            n.blobs['data'].diff.copy())
    tol = TOLERANCE[sixteen]
    (loss, grads, maps, ddata), (loss_cl, grads_cl, maps_cl, ddata_cl) = out['nchw'], out['nhwc']
    assert loss_cl == pytest.approx(loss, rel=tol)
    for p, g, g_cl in zip(ref.learnable_params, grads, grads_cl):
        assert _relative(g_cl, g) < tol, p.name
    for m, m_cl in zip(maps, maps_cl):
        assert _relative(m_cl, m) < tol
    assert _relative(ddata_cl, ddata) < tol
    from caffeplus import kernels
    assert not kernels.failures()


def _assert_layouts_agree(nets, x, label, sixteen, maps):
    """Two passes of each of `nets` ('nchw', 'nhwc'; the second replays the
    captured calls): the loss, every parameter gradient, the data's gradient
    and the maps `maps` (pycaffe's views) agree within the type's rounding."""
    out = {}
    for name, n in nets.items():
        for _ in range(2):
            loss, grads = _one_pass(n, x, label)
        out[name] = (loss, grads, [n.blobs[b].data.copy() for b in maps],
                     n.blobs['data'].diff.copy())
    tol = TOLERANCE[sixteen]
    (loss, grads, values, ddata), (loss_cl, grads_cl, values_cl, ddata_cl) = \
        out['nchw'], out['nhwc']
    assert loss_cl == pytest.approx(loss, rel=tol)
    for p, g, g_cl in zip(nets['nchw'].learnable_params, grads, grads_cl):
        assert _relative(g_cl, g) < tol, p.name
    for b, v, v_cl in zip(maps, values, values_cl):
        assert (v > 0).any() and _relative(v_cl, v) < tol, b
    assert _relative(ddata_cl, ddata) < tol
    from caffeplus import kernels
    assert not kernels.failures()


# BVLC AlexNet's first layer: an image convolution whose top an LRN reads in
# Caffe's order. Its calls still run channels-last (the image padded to 4
# channels, the top transposed after them and its diff before backward).
ALEXNET_STEM = """
name: "alexnet_stem" force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 8 dim: 3 dim: 39 dim: 39 } shape { dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 16 kernel_size: 11 stride: 4
    weight_filler { type: "gaussian" std: 0.05 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1"
  lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 } }
layer { name: "pool1" type: "Pooling" bottom: "norm1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize('sixteen', ['fp16', 'bf16'])
def test_an_image_convolution_runs_channels_last_where_its_top_cannot(gpu, sixteen,
                                                                     monkeypatch):
    """Every blob stays in Caffe's order, yet the first convolution's calls
    run channels-last on its padded image; its top, every gradient and the
    data's gradient (through the relaid bottom's diff) are Caffe's order's
    within the type's rounding."""
    if sixteen == 'bf16':
        pytest.importorskip('ml_dtypes')
    from caffeplus.layers import cudnn_conv
    monkeypatch.setattr(cudnn_conv, 'IMAGE_CHANNELS_LAST', True)
    nets = _both_layouts(ALEXNET_STEM, sixteen)
    ref, net = nets['nchw'], nets['nhwc']
    assert all(b.layout == 'NCHW' for b in net._blobs)
    conv = {l.layer_param.name: l for l in net.layers}['conv1']
    assert conv.compute_nhwc and conv._top_relaid and conv._cd.nhwc and \
        conv.padded_channels == 4
    assert not {l.layer_param.name: l for l in ref.layers}['conv1'].compute_nhwc
    r = numpy.random.RandomState(23)
    x = r.standard_normal((8, 3, 39, 39)).astype(numpy.float32)
    label = r.randint(0, 5, size=8).astype(numpy.float32)
    _assert_layouts_agree(nets, x, label, sixteen, ['conv1'])


# GoogLeNet's stem into its inceptions: an LRN in Caffe's order, then a max
# pooling whose ceil-rule windows cuDNN's do not give (20 -> 10, 3x3 stride
# 2): its argmax kernels run in the bottom's order and their output is
# transposed into the channels-last top the convolutions after it read.
STEM_INTO_INCEPTION = """
name: "googlenet_stem" force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 8 dim: 3 dim: 20 dim: 20 } shape { dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1
    weight_filler { type: "gaussian" std: 0.2 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1"
  lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 } }
layer { name: "pool2" type: "Pooling" bottom: "norm1" top: "pool2"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool2" top: "conv2"
  convolution_param { num_output: 16 kernel_size: 1
    weight_filler { type: "gaussian" std: 0.2 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "conv3" type: "Convolution" bottom: "conv2" top: "conv3"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1
    weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "pool3" type: "Pooling" bottom: "conv3" top: "pool3"
  pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool3" top: "ip1"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize('sixteen', ['fp16', 'bf16'])
def test_a_ceil_rule_max_pooling_changes_the_order_between_its_maps(gpu, sixteen, monkeypatch):
    """pool2 reads the LRN's map in Caffe's order and writes channels-last
    (its argmax kernels' output transposed, and its top's diff before
    backward); the loss, every gradient, pool2's map and the data's gradient
    are Caffe's order's within the type's rounding."""
    if sixteen == 'bf16':
        pytest.importorskip('ml_dtypes')
    from caffeplus.layers import cudnn_pooling
    monkeypatch.setattr(cudnn_pooling, 'ARGMAX_BETWEEN_ORDERS', True)
    nets = _both_layouts(STEM_INTO_INCEPTION, sixteen)
    net = nets['nhwc']
    moved = {n for n, b in net._blob_dict.items() if b.layout == 'NHWC'}
    assert moved == {'pool2', 'conv2', 'conv3'}
    pool2 = {l.layer_param.name: l for l in net.layers}['pool2']
    assert pool2._top_relaid() and pool2._argmax_kernels()
    r = numpy.random.RandomState(29)
    x = r.standard_normal((8, 3, 20, 20)).astype(numpy.float32)
    label = r.randint(0, 5, size=8).astype(numpy.float32)
    assert nets['nchw'].blobs['pool2'].shape == (8, 16, 10, 10)
    _assert_layouts_agree(nets, x, label, sixteen, ['pool2'])


# BVLC AlexNet's pattern: LRNs after the image convolution and after a grouped
# one. With layers/cudnn_lrn.CHANNELS_LAST and
# layers/cudnn_conv.GROUPED_CHANNELS_LAST every map from conv1 to pool2's
# bottom is channels-last (pool1, a ceil-rule max pooling, on the argmax
# kernels; pool2 on cuDNN's, its top in Caffe's order for the InnerProduct).
ALEXNET_GROUPED = ALEXNET_STEM.replace('name: "alexnet_stem"', 'name: "alexnet_grouped"').replace(
    'layer { name: "ip1" type: "InnerProduct" bottom: "pool1"', '''
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 32 kernel_size: 3 pad: 1 group: 2
    weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "norm2" type: "LRN" bottom: "conv2" top: "norm2"
  lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 } }
layer { name: "pool2" type: "Pooling" bottom: "norm2" top: "pool2"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2"''')


@pytest.mark.parametrize('sixteen', ['fp16', 'bf16'])
def test_lrns_and_grouped_convolutions_run_channels_last(gpu, sixteen, monkeypatch):
    """The LRNs on their channels-last kernels and the grouped convolution
    through cuDNN's group count over channels-last descriptors: the loss,
    every gradient, the maps and the data's gradient are Caffe's order's
    within the type's rounding, over two passes (the second replayed)."""
    if sixteen == 'bf16':
        pytest.importorskip('ml_dtypes')
    from caffeplus.layers import cudnn_conv, cudnn_lrn
    monkeypatch.setattr(cudnn_conv, 'GROUPED_CHANNELS_LAST', True)
    monkeypatch.setattr(cudnn_lrn, 'CHANNELS_LAST', True)
    nets = _both_layouts(ALEXNET_GROUPED, sixteen)
    net = nets['nhwc']
    moved = {n for n, b in net._blob_dict.items() if b.layout == 'NHWC'}
    assert moved == {'conv1', 'norm1', 'pool1', 'conv2', 'norm2'}
    conv2 = {l.layer_param.name: l for l in net.layers}['conv2']
    assert conv2.compute_nhwc and conv2._cd.nhwc and conv2._cd.loops == 1
    r = numpy.random.RandomState(31)
    x = r.standard_normal((8, 3, 39, 39)).astype(numpy.float32)
    label = r.randint(0, 5, size=8).astype(numpy.float32)
    _assert_layouts_agree(nets, x, label, sixteen, ['norm1', 'conv2', 'norm2'])
