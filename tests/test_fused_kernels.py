"""The fused GPU layer paths (caffeplus.kernels, layers/cudnn_*.py and
layers/fused_*.py) against the
generic CPU layers.

Each case runs twice: with the kernels emulated on the host
(dev/kernel_emu.py: the CUDA source compiled with g++, one thread per CUDA
thread, NumPy arrays standing in for device arrays), which needs no GPU, and
on the GPU itself (marker gpu). Layer cases compare tops, bottom diffs,
parameter diffs and BatchNorm's statistics blobs; net cases train a small
residual net (BatchNorm -> Scale -> ReLU chains, Eltwise SUM, Split) for two
iterations and compare every blob, diff and parameter, and check that the
chains ran fused.
"""
import os
import sys
import zlib

import numpy
import pytest
from google.protobuf import text_format

import caffeplus
from caffeplus import backend, kernels
from caffeplus.blob import Blob
from caffeplus.layer import create_layer
from caffeplus.proto import caffe_pb2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LAYER_CASES = [
    # (id, prototxt, bottom shapes, in place, learned blobs to randomise)
    ('bn_train', 'type: "BatchNorm"', [(4, 3, 5, 6)], False),
    ('bn_train_inplace', 'type: "BatchNorm"', [(4, 3, 5, 6)], True),
    ('bn_train_2d', 'type: "BatchNorm"', [(7, 5)], False),
    ('bn_train_big', 'type: "BatchNorm"', [(3, 2, 40, 50)], True),
    ('bn_global', 'type: "BatchNorm" batch_norm_param { use_global_stats: true }',
     [(4, 3, 5, 6)], False),
    ('bn_maf_eps', 'type: "BatchNorm" batch_norm_param { moving_average_fraction: 0.9 '
     'eps: 0.001 }', [(2, 4, 3, 3)], True),
    # NVCaffe's BatchNorm with its own scale and bias
    ('bn_scale_bias', 'type: "BatchNorm" batch_norm_param { scale_bias: true }',
     [(4, 3, 5, 6)], False),
    ('bn_scale_bias_inplace', 'type: "BatchNorm" batch_norm_param { scale_bias: true }',
     [(3, 2, 40, 50)], True),
    ('bn_scale_bias_global', 'type: "BatchNorm" batch_norm_param { use_global_stats: true '
     'scale_bias: true }', [(4, 3, 5, 6)], False),
    ('scale_learned_bias', 'type: "Scale" scale_param { bias_term: true }', [(4, 3, 5, 6)],
     False),
    ('scale_learned_bias_inplace', 'type: "Scale" scale_param { bias_term: true }',
     [(4, 3, 5, 6)], True),
    ('scale_learned', 'type: "Scale"', [(4, 3, 5, 6)], True),
    ('scale_axis2', 'type: "Scale" scale_param { axis: 2 num_axes: 2 bias_term: true }',
     [(2, 3, 4, 5)], False),
    ('scale_bottom', 'type: "Scale"', [(4, 3, 5, 6), (3,)], False),
    ('scale_bottom_bias', 'type: "Scale" scale_param { bias_term: true }',
     [(4, 3, 5, 6), (3, 5)], False),
    ('scale_scalar', 'type: "Scale" scale_param { num_axes: 0 }', [(2, 3, 4)], False),
    ('relu', 'type: "ReLU"', [(3, 4, 5, 6)], False),
    ('relu_inplace', 'type: "ReLU"', [(3, 4, 5, 6)], True),
    ('relu_leaky', 'type: "ReLU" relu_param { negative_slope: 0.1 }', [(3, 4, 5)], False),
    ('relu_leaky_inplace', 'type: "ReLU" relu_param { negative_slope: 0.2 }', [(3, 4, 5)],
     True),
    ('relu_negative_slope', 'type: "ReLU" relu_param { negative_slope: -0.5 }', [(3, 4, 5)],
     False),
    ('eltwise_sum', 'type: "Eltwise"', [(3, 4, 5, 6), (3, 4, 5, 6)], False),
    ('eltwise_sum_coeff3', 'type: "Eltwise" eltwise_param { operation: SUM coeff: 0.5 '
     'coeff: -2 coeff: 3 }', [(3, 4, 5), (3, 4, 5), (3, 4, 5)], False),
    ('eltwise_sum4', 'type: "Eltwise"', [(2, 3, 7)] * 4, False),
    ('eltwise_prod', 'type: "Eltwise" eltwise_param { operation: PROD }',
     [(3, 4, 5), (3, 4, 5)], False),
    ('split2', 'type: "Split"', [(3, 4, 5)], False),
    ('split3', 'type: "Split"', [(3, 4, 5)], False),
    # Caffe's ceil rule, where cuDNN's windows differ: caffeplus.kernels' pooling
    ('pool_max_ceil', 'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }',
     [(2, 3, 8, 8)], False),
    ('pool_max_ceil_odd', 'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }',
     [(2, 3, 12, 9)], False),
    ('pool_max_pad_ceil', 'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 '
     'pad: 1 }', [(2, 2, 8, 7)], False),
    ('pool_max_rect', 'type: "Pooling" pooling_param { pool: MAX kernel_h: 2 kernel_w: 3 '
     'stride_h: 3 stride_w: 2 }', [(2, 2, 10, 9)], False),
    ('pool_max_mask', 'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }',
     [(2, 3, 8, 8)], False),
    ('pool_ave_ceil', 'type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 2 }',
     [(2, 3, 6, 6)], False),
    ('pool_ave_pad_ceil', 'type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 2 '
     'pad: 1 }', [(2, 3, 8, 6)], False),
    ('ip', 'type: "InnerProduct" inner_product_param { num_output: 7 }', [(5, 3, 4)], False),
    ('ip_transpose_nobias', 'type: "InnerProduct" inner_product_param { num_output: 6 '
     'transpose: true bias_term: false }', [(4, 9)], False),
    ('softmax_loss', 'type: "SoftmaxWithLoss"', [(6, 10), ('labels', (6,), 10)], False),
    ('softmax_loss_1000', 'type: "SoftmaxWithLoss"', [(3, 1000), ('labels', (3,), 1000)],
     False),
    ('softmax_loss_spatial', 'type: "SoftmaxWithLoss"', [(2, 5, 3, 4), ('labels', (2, 3, 4), 5)],
     False),
    ('softmax_loss_ignore', 'type: "SoftmaxWithLoss" loss_param { ignore_label: 2 }',
     [(8, 4), ('labels', (8,), 4)], False),
    ('softmax_loss_ignore_full', 'type: "SoftmaxWithLoss" loss_param { ignore_label: 1 '
     'normalization: FULL }', [(8, 4), ('labels', (8,), 4)], False),
    ('softmax_loss_batch', 'type: "SoftmaxWithLoss" loss_param { normalization: BATCH_SIZE }',
     [(2, 4, 3), ('labels', (2, 3), 4)], False),
    ('softmax_loss_none_axis2', 'type: "SoftmaxWithLoss" loss_param { normalization: NONE } '
     'softmax_param { axis: 2 }', [(2, 3, 5), ('labels', (2, 3), 5)], False),
]
SPLIT_TOPS = {'split2': 2, 'split3': 3, 'pool_max_mask': 2}


def _param(text):
    lp = caffe_pb2.LayerParameter()
    text_format.Parse('name: "t" ' + text, lp)
    return lp


def _run(case, gpu, fused, seed):
    name, text, shapes, in_place = case
    caffeplus.set_mode_gpu() if gpu else caffeplus.set_mode_cpu()
    previous = kernels.set_enabled(fused)
    try:
        rng = numpy.random.default_rng(seed)
        lp = _param(text)
        layer = create_layer(lp)
        bottom = []
        for i, shape in enumerate(shapes):
            if shape[0] == 'labels':
                b = Blob(shape[1], name='label')
                b.data = rng.integers(0, shape[2], size=shape[1]).astype(numpy.float32)
            else:
                b = Blob(shape, name='b%d' % i)
                b.data = rng.standard_normal(shape).astype(numpy.float32)
            bottom.append(b)
        ntop = SPLIT_TOPS.get(name, 1)
        top = bottom[:1] if in_place else [Blob(name='t%d' % i) for i in range(ntop)]
        layer.setup(bottom, top)
        for b in layer.blobs:
            b.data = rng.standard_normal(b.shape).astype(numpy.float32) + \
                (2.0 if lp.type == 'BatchNorm' else 0.0)
        if lp.type == 'BatchNorm' and layer.blobs:       # a positive scale factor
            layer.blobs[2].data = numpy.array([1.7], numpy.float32)
            layer.blobs[1].data = numpy.abs(backend.to_numpy(layer.blobs[1].data))
        out = {}
        for it in range(2):         # twice: statistics accumulate, reused buffers
            x_before = [backend.to_numpy(b.data).copy() for b in bottom]
            layer.reshape(bottom, top)
            layer.forward(bottom, top)
            out['top%d' % it] = [backend.to_numpy(t.data).copy() for t in top]
            for t in top:
                t.diff = rng.standard_normal(t.shape).astype(numpy.float32)
            for b in layer.blobs:
                b.diff = numpy.full(b.shape, 0.25, numpy.float32)     # diffs accumulate
            loss = lp.type.endswith('Loss')
            layer.backward(top, [True] + [not loss] * (len(bottom) - 1), bottom)
            out['bdiff%d' % it] = [backend.to_numpy(b.diff).copy() for b in bottom]
            out['pdiff%d' % it] = [backend.to_numpy(b.diff).copy() for b in layer.blobs]
            out['pdata%d' % it] = [backend.to_numpy(b.data).copy() for b in layer.blobs]
            for b, x in zip(bottom, x_before):      # fresh bottoms for the next pass
                if b.name != 'label':
                    b.data = x + numpy.float32(0.5)
        return layer, out
    finally:
        kernels.set_enabled(previous)
        caffeplus.set_mode_cpu()


def _compare(got, want, tol, what):
    for key in want:
        for i, (a, b) in enumerate(zip(got[key], want[key])):
            scale = max(float(numpy.abs(b).max()) if b.size else 1.0, 1.0)
            numpy.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale,
                                          err_msg='%s %s[%d]' % (what, key, i))


def _check_layer_case(case, gpu):
    seed = zlib.crc32(case[0].encode())
    _, want = _run(case, gpu=False, fused=False, seed=seed)
    layer, got = _run(case, gpu=gpu, fused=True, seed=seed)
    assert type(layer).__name__.startswith(('GPU', 'CuDNN')), type(layer)
    _compare(got, want, 2e-5, case[0])


@pytest.mark.parametrize('case', LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_layer_emulated(case, emulated):
    _check_layer_case(case, gpu=False)


@pytest.mark.gpu
@pytest.mark.parametrize('case', LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_layer_gpu(case):
    kernels.reset_kernels()
    before = len(kernels.failures())
    _check_layer_case(case, gpu=True)
    assert kernels.failures()[before:] == []


def test_fused_off_on_cpu_is_generic():
    """Without an emulator, CPU mode never takes a fused path."""
    assert not kernels.active()
    case = LAYER_CASES[0]
    _, a = _run(case, gpu=False, fused=True, seed=1)
    _, b = _run(case, gpu=False, fused=False, seed=1)
    _compare(a, b, 0, 'cpu')


# -- nets -------------------------------------------------------------------------
RESNET = '''
name: "tiny_resnet"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 dim: 9 dim: 9 } shape { dim: 4 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 bias_term: false
    weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "sc1" type: "Scale" bottom: "conv1" top: "conv1"
  scale_param { bias_term: true filler { type: "gaussian" std: 0.3 mean: 1 }
    bias_filler { type: "gaussian" std: 0.2 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 bias_term: false
    weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "bn2" type: "BatchNorm" bottom: "conv2" top: "conv2" }
layer { name: "sc2" type: "Scale" bottom: "conv2" top: "conv2"
  scale_param { bias_term: true filler { type: "gaussian" std: 0.3 mean: 1 }
    bias_filler { type: "gaussian" std: 0.2 } } }
layer { name: "sum" type: "Eltwise" bottom: "conv1" bottom: "conv2" top: "sum" }
layer { name: "relu2" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "bn3" type: "BatchNorm" bottom: "sum" top: "bn3" }
layer { name: "sc3" type: "Scale" bottom: "bn3" top: "bn3" scale_param { bias_term: true } }
layer { name: "relu3" type: "ReLU" bottom: "bn3" top: "bn3" }
layer { name: "sum2" type: "Eltwise" bottom: "sum" bottom: "bn3" top: "sum2"
  eltwise_param { coeff: 0.5 coeff: 2 } }
layer { name: "relu4" type: "ReLU" bottom: "sum2" top: "sum2" }
layer { name: "pool" type: "Pooling" bottom: "sum2" top: "pool"
  pooling_param { pool: AVE global_pooling: true } }
layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
'''


def _net(text=RESNET, memory=None):
    """The TRAIN net of `text`, its fillers seeded as every case here seeds them."""
    caffeplus.set_random_seed(11)
    return caffeplus.Net(text_format.Parse(text, caffe_pb2.NetParameter()), caffeplus.TRAIN,
                         memory=memory)

def _train(gpu, fused, iters=2, hook=False):
    caffeplus.set_mode_gpu() if gpu else caffeplus.set_mode_cpu()
    previous = kernels.set_enabled(fused)
    try:
        net = _net()
        if hook:
            net.after_layer_forward.append(lambda i: None)
        rng = numpy.random.default_rng(4)
        net.blobs['data'].data[...] = rng.standard_normal(net.blobs['data'].shape)
        seen = []
        for _ in range(iters):
            net.clear_param_diffs()
            net.forward_from_to(1, len(net.layers) - 1)
            net.backward_from_to(len(net.layers) - 1, 1)
            chains = net.__dict__.get('_fused_chains') or []
            seen.append([(c.fwd_done, c.bwd_done) for c in chains])
            for p in net.learnable_params:      # plain SGD, through host copies
                d, g = backend.to_numpy(p.data), backend.to_numpy(p.diff)
                p.data = d - numpy.float32(0.1) * g
        out = {'blob ' + k: [backend.to_numpy(b.data).copy()] for k, b in net.blobs.items()}
        out.update({'diff ' + k: [backend.to_numpy(b.diff).copy()] for k, b in net.blobs.items()})
        for name, layer in zip(net._layer_names, net.layers):
            out['param ' + name] = [backend.to_numpy(b.data).copy() for b in layer.blobs]
            out['pdiff ' + name] = [backend.to_numpy(b.diff).copy() for b in layer.blobs]
        return net, out, seen
    finally:
        kernels.set_enabled(previous)
        caffeplus.set_mode_cpu()


def _check_net(gpu, hook=False):
    _, want, _ = _train(gpu=False, fused=False)
    net, got, seen = _train(gpu=gpu, fused=True, hook=hook)
    names = [(c.bn.name, c.scale.name, c.relu.name if c.relu else None) if hasattr(c, 'bn')
             else (c.eltwise.name, c.relu.name, c.split.name if c.split else None)
             for c in net._fused_chains]
    # (bn3 is not in place; sum's Split feeds bn3 and sum2's shortcut)
    assert names == [('bn1', 'sc1', 'relu1'), ('bn2', 'sc2', None),
                     ('sum', 'relu2', 'sum_relu2_0_split'), ('sum2', 'relu4', None)]
    expect = [(not hook, not hook)] * 4
    assert seen == [expect, expect]
    _compare(got, want, 1e-4, 'tiny resnet')


def test_net_emulated(emulated):
    _check_net(gpu=False)


def test_net_emulated_hooks_unfuse_chains(emulated):
    _check_net(gpu=False, hook=True)


def test_net_partial_forward_is_unfused(emulated):
    """forward up to BatchNorm leaves BatchNorm's own top, as Caffe."""
    net = _net()
    bn = net.layer_index('bn1')
    net.forward_from_to(0, bn)
    chain = net._fused_chains[0]
    assert not chain.fwd_done
    y = backend.to_numpy(net.blobs['conv1'].data)
    assert abs(float(y.mean())) < 1e-4 and abs(float(y.std()) - 1) < 1e-2


@pytest.mark.gpu
def test_net_gpu():
    before = len(kernels.failures())
    _check_net(gpu=True)
    assert kernels.failures()[before:] == []


@pytest.mark.gpu
def test_zero_diffs_gpu():
    caffeplus.set_mode_gpu()
    try:
        blobs = [Blob((3, 4)), Blob((5,))]
        for b in blobs:
            b.diff[...] = 7
        assert kernels.zero_diffs(blobs)
        for b in blobs:
            assert float(abs(backend.to_numpy(b.diff)).max()) == 0
    finally:
        caffeplus.set_mode_cpu()


def test_zero_diffs_in_one_launch_emulated(emulated):
    """Every diff and every extra array (a float64 guard, int32 flags) is
    zeroed by one cp_zero_many launch; values beside them stay."""
    blobs = [Blob((3, 4)), Blob((5,)), Blob((0,))]
    for b in blobs:
        b.diff[...] = 7
    store = numpy.full(16, 5, numpy.float32)
    blobs[0].diff_storage.array = store            # a storage larger than the blob
    guard = numpy.full((), numpy.nan)
    flags = numpy.ones(3, numpy.int32)
    launches = []
    real = kernels.kernel

    def spy(name):
        launches.append(name)
        return real(name)
    try:
        kernels.kernel = spy
        for _ in range(2):                          # the second reuses the tables
            for b in blobs:
                b.diff[...] = 7
            guard[...], flags[...] = numpy.nan, 1
            assert kernels.zero_diffs(blobs, also=(guard, flags))
    finally:
        kernels.kernel = real
    assert launches == ['cp_zero_many'] * 2
    assert not blobs[0].diff.any() and not blobs[1].diff.any()
    assert float(guard) == 0.0 and not flags.any()
    assert not store[:12].any() and (store[12:] == 5).all()


@pytest.mark.parametrize('name', ['relu_leaky', 'eltwise_sum_coeff3', 'scale_learned_bias',
                                  'split3'])
def test_grid_stride_loops_emulated(name, emulated, monkeypatch):
    """Few blocks for many values: every grid-stride step and its tail."""
    monkeypatch.setattr(kernels, 'MAX_BLOCKS', 1)
    case = [c for c in LAYER_CASES if c[0] == name][0]
    case = (case[0], case[1], [(3,) + tuple(s[1:]) + (23,) if len(s) > 1 else s
                               for s in case[2]], case[3])
    if name == 'scale_learned_bias':
        case = (case[0], case[1], [(3, 3, 5, 6, 23)], case[3])
    _check_layer_case(case, gpu=False)


def test_softmax_loss_bad_label_emulated(emulated):
    from caffeplus.errors import NetError
    lp = _param('type: "SoftmaxWithLoss"')
    layer = create_layer(lp)
    x, lab = Blob((3, 4)), Blob((3,))
    x.data = numpy.zeros((3, 4), numpy.float32)
    lab.data = numpy.array([1, 7, 2], numpy.float32)
    top = [Blob()]
    layer.setup([x, lab], top)
    with pytest.raises(NetError, match='label value 7 is out of range'):
        layer.forward([x, lab], top)
    lab.data = numpy.array([1, 3, 2], numpy.float32)       # the error flag was cleared
    layer.forward([x, lab], top)
    assert abs(float(top[0].data) - numpy.log(4)) < 1e-6


def test_pooling_paths_emulated(emulated):
    """cuDNN-agreeing pools stay on cuDNN (here: generic on the CPU); the
    others take the kernels."""
    case = [c for c in LAYER_CASES if c[0] == 'pool_max_ceil'][0]
    layer, _ = _run(case, gpu=False, fused=True, seed=3)
    assert layer._fused_arg and layer.pool.arg.dtype == numpy.int32


def test_loss_and_pool_take_the_kernels_emulated(emulated, monkeypatch):
    calls = []
    real = kernels.kernel

    def spy(name, dtype=None):
        calls.append(name)
        return real(name, dtype)
    monkeypatch.setattr(kernels, 'kernel', spy)
    for name in ('softmax_loss_spatial', 'pool_ave_pad_ceil', 'pool_max_rect'):
        case = [c for c in LAYER_CASES if c[0] == name][0]
        _run(case, gpu=False, fused=True, seed=5)
    for k in ('cp_softmax_loss_rows', 'cp_softmax_loss_total', 'cp_softmax_loss_bwd',
              'cp_pool_fwd', 'cp_pool_bwd'):
        assert k in calls, k


@pytest.mark.parametrize('name', ['bn_train', 'bn_train_inplace', 'bn_global', 'bn_train_big',
                                  'bn_maf_eps'])
def test_batchnorm_split_over_blocks_emulated(name, emulated, monkeypatch):
    """Few channels: each channel over several blocks (two launches each way)."""
    monkeypatch.setattr(kernels, 'SPLIT_CHANNELS', 16)
    monkeypatch.setattr(kernels, 'SPLIT_MIN_VALUES', 7)
    calls = []
    real = kernels.kernel
    monkeypatch.setattr(kernels, 'kernel', lambda k, dtype=None: calls.append(k) or real(k, dtype))
    case = [c for c in LAYER_CASES if c[0] == name][0]
    _check_layer_case(case, gpu=False)
    assert 'cp_bn_fwd_apply' in calls and 'cp_bn_bwd_apply' in calls
    assert 'cp_bn_fwd' not in calls and 'cp_bn_bwd' not in calls


def test_net_split_batchnorm_emulated(emulated, monkeypatch):
    monkeypatch.setattr(kernels, 'SPLIT_CHANNELS', 32)
    monkeypatch.setattr(kernels, 'SPLIT_MIN_VALUES', 20)
    _check_net(gpu=False)


def test_batchnorm_layers_share_one_partial_sums_buffer_emulated(emulated, monkeypatch):
    """Split over blocks, each BatchNorm keeps only its per-channel values;
    the per-block partial sums, read back by the layer's next kernel, are
    one buffer for all of them, as large as the largest layer asks."""
    from caffeplus.layers import fused_chain
    monkeypatch.setattr(kernels, 'SPLIT_CHANNELS', 32)
    monkeypatch.setattr(kernels, 'SPLIT_MIN_VALUES', 20)
    monkeypatch.setattr(kernels, '_EMULATED_SCRATCH', {})
    net, _, _ = _train(gpu=False, fused=True)
    bns = [layer for layer in net.layers if layer.layer_param.type == 'BatchNorm']
    assert len(bns) >= 2
    asked = []
    for bn in bns:
        n, c, s = bn._cfg
        assert bn._split_bufs.size == c
        asked.append(2 * c * kernels.blocks_per_channel(c, n * s))
    shared = kernels._EMULATED_SCRATCH[(fused_chain.PARTIAL_SUMS, numpy.dtype(numpy.float64))]
    assert shared.size == max(asked) and min(asked) > 2


def test_scratch_grows_to_the_largest_ask_and_hands_out_its_start(emulated):
    first = kernels.scratch('test slot', 5, numpy.float64)
    first[:] = 1
    bigger = kernels.scratch('test slot', 9, numpy.float64)
    again = kernels.scratch('test slot', 3, numpy.float64)
    assert (first.size, bigger.size, again.size) == (5, 9, 3)
    assert again.base is bigger.base and again.dtype == numpy.float64
    assert kernels.scratch('test slot', 3, numpy.float32).base is not bigger.base


@pytest.mark.gpu
def test_net_split_batchnorm_gpu(monkeypatch):
    monkeypatch.setattr(kernels, 'SPLIT_CHANNELS', 32)
    monkeypatch.setattr(kernels, 'SPLIT_MIN_VALUES', 20)
    before = len(kernels.failures())
    _check_net(gpu=True)
    assert kernels.failures()[before:] == []


@pytest.mark.gpu
@pytest.mark.parametrize('name', ['bn_train', 'bn_train_inplace', 'bn_global', 'bn_train_big'])
def test_batchnorm_split_over_blocks_gpu(name, monkeypatch):
    monkeypatch.setattr(kernels, 'SPLIT_CHANNELS', 16)
    monkeypatch.setattr(kernels, 'SPLIT_MIN_VALUES', 7)
    before = len(kernels.failures())
    case = [c for c in LAYER_CASES if c[0] == name][0]
    _check_layer_case(case, gpu=True)
    assert kernels.failures()[before:] == []


# -- convolution as im2col + GEMM (layers/conv_gemm.py _GemmConv) --------------------------
class _FakeConvLayer:
    """The attributes _GemmConv reads off a convolution layer."""

    def __init__(self, n, c, hw, m, kernel, stride, pad, dilation):
        from caffeplus.im2col import ConvGeometry
        self.geom = ConvGeometry(tuple(kernel), tuple(stride), tuple(pad), tuple(dilation))
        self.num, self.channels, self.in_spatial, self.num_output = n, c, tuple(hw), m
        self.out_spatial = self.geom.conv_out_shape(hw)
        self.reverse, self.group, self.num_spatial = False, 1, 2


GEMM_GEOMS = [(3, 2, (7, 6), 4, (3, 2), (2, 1), (1, 0), (1, 2)),
              (5, 3, (11, 11), 6, (5, 5), (4, 4), (2, 2), (1, 1)),
              (2, 1, (4, 5), 3, (1, 1), (1, 1), (0, 0), (1, 1))]


def _caffe_columns(x, layer):
    """Caffe's per-image columns (N, K, P) from the generic im2col."""
    from caffeplus.im2col import im2col_forward
    n = x.shape[0]
    oh, ow = layer.out_spatial
    out = numpy.empty((n, layer.channels * layer.geom.kernel_count, oh, ow), numpy.float32)
    im2col_forward(x, layer.geom, out)
    return out.reshape(n, out.shape[1], oh * ow)


@pytest.mark.parametrize('geom', GEMM_GEOMS)
def test_im2col_kernel_emulated(geom, emulated):
    """cp_im2col writes image b's Caffe columns at rows (k*B + b) of the chunk."""
    layer = _FakeConvLayer(*geom)
    x = numpy.random.default_rng(21).standard_normal(
        (layer.num, layer.channels) + layer.in_spatial).astype(numpy.float32)
    cols = _caffe_columns(x, layer)
    K, P = cols.shape[1], cols.shape[2]
    k = kernels.kernel('cp_im2col')
    for n0, nb in [(0, layer.num), (1, layer.num - 1)]:
        col = numpy.full(K * nb * P, numpy.nan, numpy.float32)
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (layer.geom.kernel, layer.geom.stride,
                                                  layer.geom.pad, layer.geom.dilation)
        oh, ow = layer.out_spatial
        i32 = kernels.i32
        k((2,), (64,), (x.reshape(-1), col, numpy.uint64(col.size), i32(n0), i32(nb),
                        i32(layer.channels), i32(layer.in_spatial[0]), i32(layer.in_spatial[1]),
                        i32(kh), i32(kw), i32(oh), i32(ow), i32(sh), i32(sw), i32(ph), i32(pw),
                        i32(dh), i32(dw)))
        want = cols[n0:n0 + nb].transpose(1, 0, 2).reshape(-1)
        numpy.testing.assert_array_equal(col, want)


class _FlatMemory:
    """Device memory stood in for by one byte array: 'pointers' are byte
    offsets; im2col and the column-major cuBLAS calls (operands of the type
    they name, sums in float64, rounded once to C's type) as NumPy."""

    def __init__(self, nbytes):
        self.mem = numpy.zeros(nbytes + 8, numpy.uint8)

    def _typed(self, addr, n, dtype):
        dtype = numpy.dtype(dtype)
        return self.mem[addr:addr + n * dtype.itemsize].view(dtype)

    def put(self, addr, a):
        self._typed(addr, a.size, a.dtype)[...] = a.reshape(-1)

    def get(self, addr, n, dtype=numpy.float32):
        return self._typed(addr, n, dtype).copy()

    def _mat(self, addr, rows, cols, ld, trans, dtype):
        """Column-major rows x cols matrix at addr (op applied)."""
        i = numpy.arange(rows)[:, None] + numpy.arange(cols)[None, :] * ld
        a = self._typed(addr, int(i.max()) + 1, dtype)[i]
        return a.T if trans else a

    def im2col(self, x, col, n0, nb, g):
        layer = _FakeConvLayer(g.n, g.c, (g.h, g.w), g.m, (g.kh, g.kw), (g.sh, g.sw),
                               (g.ph, g.pw), (g.dh, g.dw))
        xs = self.get(x, g.n * g.c * g.h * g.w, g.dtype).reshape(g.n, g.c, g.h, g.w)
        cols = _caffe_columns(xs.astype(numpy.float32), layer)[n0:n0 + nb]
        self.put(col, cols.transpose(1, 0, 2).astype(g.dtype))

    def gemm_strided_batched(self, ta, tb, m, n, k, a, lda, sa, b, ldb, sb, c, ldc, sc, batch,
                             beta=0.0, tf32=None, ab_type='float32', c_type='float32'):
        ea, ec = numpy.dtype(_numpy_type(ab_type)).itemsize, numpy.dtype(
            _numpy_type(c_type)).itemsize
        for i in range(batch):
            self.gemm(ta, tb, m, n, k, a + ea * i * sa, lda, b + ea * i * sb, ldb,
                      c + ec * i * sc, ldc, beta=beta, ab_type=ab_type, c_type=c_type)

    def gemm(self, ta, tb, m, n, k, a, lda, b, ldb, c, ldc, beta=0.0, tf32=None,
             ab_type='float32', c_type='float32'):
        at, ct = _numpy_type(ab_type), _numpy_type(c_type)
        A = self._mat(a, k if ta else m, m if ta else k, lda, ta, at).astype(numpy.float64)
        B = self._mat(b, n if tb else k, k if tb else n, ldb, tb, at).astype(numpy.float64)
        idx = numpy.arange(m)[:, None] + numpy.arange(n)[None, :] * ldc
        out = self._typed(c, int(idx.max()) + 1, ct)
        out[idx] = (A @ B + beta * out[idx].astype(numpy.float64)).astype(ct)


def _numpy_type(name):
    if name == 'bfloat16':
        return pytest.importorskip('ml_dtypes').bfloat16
    return numpy.dtype(name)


@pytest.mark.parametrize('geom', GEMM_GEOMS)
@pytest.mark.parametrize('chunk', [None, 2])
def test_gemm_convolution_plan(geom, chunk, monkeypatch):
    """_GemmConv's cuBLAS calls (operands, leading dimensions, strides,
    chunks) compute the convolution and its filter gradient."""
    from caffeplus import im2col
    from caffeplus.layers import conv_gemm as L
    layer = _FakeConvLayer(*geom)
    if chunk:       # column buffer for `chunk` images
        monkeypatch.setattr(L, 'GEMM_CHUNK_BYTES',
                            chunk * layer.channels * layer.geom.kernel_count *
                            int(numpy.prod(layer.out_spatial)) * 4)
    g = L._GemmConv(layer)
    assert g.B == (chunk or layer.num)
    rng = numpy.random.default_rng(22)
    x = rng.standard_normal((layer.num, layer.channels) + layer.in_spatial).astype(numpy.float32)
    w = rng.standard_normal((layer.num_output, layer.channels) + layer.geom.kernel
                            ).astype(numpy.float32)
    y_shape = (layer.num, layer.num_output) + tuple(layer.out_spatial)
    dy = rng.standard_normal(y_shape).astype(numpy.float32)
    dw0 = rng.standard_normal(w.shape).astype(numpy.float32)
    sizes = [x.nbytes, w.nbytes, dy.nbytes, dy.nbytes, w.nbytes, g.memory('bwd_filter'), 4 * g.B]
    addrs = numpy.cumsum([0] + [-(-s // 256) * 256 for s in sizes])
    mem = _FlatMemory(int(addrs[-1]))
    X, W, Y, DY, DW, WS, ONES = (int(a) for a in addrs[:-1])
    mem.put(X, x)
    mem.put(W, w)
    mem.put(DY, dy)
    mem.put(DW, dw0)
    mem.put(ONES, numpy.ones(g.B, numpy.float32))
    g.forward(X, W, Y, WS, ops=mem)
    want = numpy.empty(y_shape, numpy.float32)
    im2col.conv_forward(x, w, None, layer.geom, 1, want)
    numpy.testing.assert_allclose(mem.get(Y, dy.size).reshape(y_shape), want, rtol=1e-5,
                                  atol=1e-5)
    g.backward_filter(X, DY, DW, WS, ops=mem, ones=ONES)
    dw = dw0.copy()
    im2col.conv_backward(x, w, dy, layer.geom, 1, dw=dw)
    numpy.testing.assert_allclose(mem.get(DW, w.size).reshape(w.shape), dw, rtol=1e-4,
                                  atol=1e-4)


@pytest.mark.parametrize('geom', GEMM_GEOMS)
@pytest.mark.parametrize('type_name, rtol', [('float16', 2 ** -10), ('bfloat16', 2 ** -7)])
@pytest.mark.parametrize('chunk', [None, 2])
def test_gemm_convolution_plan_on_16_bit_maps(geom, type_name, rtol, chunk, monkeypatch):
    """A 16-bit layer's cuBLAS variant: 16-bit maps, columns (half the
    workspace) and weights; each output the float64 convolution of those
    16-bit values rounded once; the filter gradient added, from float32
    partials, to the float32 master's."""
    from caffeplus.layers import conv_gemm as L
    dtype = _numpy_type(type_name)
    layer = _FakeConvLayer(*geom)
    g32 = L._GemmConv(layer)
    if chunk:       # column buffer (or partials, 1x1) for `chunk` images
        per_image = layer.num_output * layer.channels * 4 if g32.direct else \
            layer.channels * layer.geom.kernel_count * int(numpy.prod(layer.out_spatial)) * 2
        monkeypatch.setattr(L, 'GEMM_CHUNK_BYTES', chunk * per_image)
    g = L._GemmConv(layer, dtype)
    assert g.B == (chunk or layer.num)
    assert g.type_name == type_name and g.itemsize == 2
    if not g.direct:
        assert g.col_bytes < g32.col_bytes and g.memory('bwd_filter') < g32.memory('bwd_filter')
    rng = numpy.random.default_rng(24)
    x = rng.standard_normal((layer.num, layer.channels) + layer.in_spatial).astype(dtype)
    w = rng.standard_normal((layer.num_output, layer.channels) + layer.geom.kernel
                            ).astype(dtype)
    y_shape = (layer.num, layer.num_output) + tuple(layer.out_spatial)
    dy = rng.standard_normal(y_shape).astype(dtype)
    dw0 = rng.standard_normal(w.shape).astype(numpy.float32)
    sizes = [x.nbytes, w.nbytes, dy.nbytes, dy.nbytes, 2 * w.nbytes, g.memory('bwd_filter'),
             4 * g.B]
    addrs = numpy.cumsum([0] + [-(-s // 256) * 256 for s in sizes])
    mem = _FlatMemory(int(addrs[-1]))
    X, W, Y, DY, DW, WS, ONES = (int(a) for a in addrs[:-1])
    for addr, a in ((X, x), (W, w), (DY, dy), (DW, dw0), (ONES, numpy.ones(g.B, numpy.float32))):
        mem.put(addr, a)
    g.forward(X, W, Y, WS, ops=mem)
    # float64 reference on the 16-bit values
    cols = _caffe_columns(x.astype(numpy.float64), layer)          # (N, K, P)
    w64 = w.astype(numpy.float64).reshape(layer.num_output, -1)
    want = numpy.einsum('mk,nkp->nmp', w64, cols).reshape(y_shape)
    got = mem.get(Y, dy.size, dtype).reshape(y_shape)
    numpy.testing.assert_allclose(got.astype(numpy.float64), want, rtol=rtol,
                                  atol=rtol * numpy.abs(want).max())
    g.backward_filter(X, DY, DW, WS, ops=mem, ones=ONES)
    dy64 = dy.astype(numpy.float64).reshape(layer.num, layer.num_output, -1)
    dw = dw0 + numpy.einsum('nmp,nkp->mk', dy64, cols).reshape(w.shape)
    numpy.testing.assert_allclose(mem.get(DW, w.size).reshape(w.shape), dw, rtol=1e-5,
                                  atol=1e-5)


@pytest.mark.parametrize('n,c,hw,m,parts', [(3, 4, (5, 6), 7, 2), (2, 6, (3, 3), 5, None),
                                              (4, 2, (1, 9), 3, 3)])
def test_gemm_1x1_convolution_plan(n, c, hw, m, parts, monkeypatch):
    """A 1x1 stride-1 convolution as cuBLAS calls straight on the images (no
    im2col): forward, data gradient and filter gradient (partials of
    `parts` images at a time) against the generic CPU convolution."""
    from caffeplus import im2col
    from caffeplus.layers import conv_gemm as L
    layer = _FakeConvLayer(n, c, hw, m, (1, 1), (1, 1), (0, 0), (1, 1))
    if parts:
        monkeypatch.setattr(L, 'GEMM_CHUNK_BYTES', parts * m * c * 4)
    g = L._GemmConv(layer)
    assert g.direct and g.memory('fwd') == 0 and g.memory('bwd_data') == 0
    assert g.B == (parts or n) and g.kinds() == ('fwd', 'bwd_data', 'bwd_filter')
    rng = numpy.random.default_rng(23)
    x = rng.standard_normal((n, c) + hw).astype(numpy.float32)
    w = rng.standard_normal((m, c, 1, 1)).astype(numpy.float32)
    y_shape = (n, m) + hw
    dy = rng.standard_normal(y_shape).astype(numpy.float32)
    dw0 = rng.standard_normal(w.shape).astype(numpy.float32)
    sizes = [x.nbytes, w.nbytes, dy.nbytes, dy.nbytes, w.nbytes, x.nbytes,
             g.memory('bwd_filter'), 4 * g.B]
    addrs = numpy.cumsum([0] + [-(-s // 256) * 256 for s in sizes])
    mem = _FlatMemory(int(addrs[-1]))
    X, W, Y, DY, DW, DX, WS, ONES = (int(a) for a in addrs[:-1])
    for addr, a in ((X, x), (W, w), (DY, dy), (DW, dw0), (ONES, numpy.ones(g.B, numpy.float32))):
        mem.put(addr, a)
    geom = layer.geom
    g.forward(X, W, Y, None, ops=mem)
    want = numpy.empty(y_shape, numpy.float32)
    im2col.conv_forward(x, w, None, geom, 1, want)
    numpy.testing.assert_allclose(mem.get(Y, dy.size).reshape(y_shape), want, rtol=1e-5,
                                  atol=1e-5)
    g.backward_data(DY, W, DX, ops=mem)
    dw, dx = dw0.copy(), numpy.empty_like(x)
    im2col.conv_backward(x, w, dy, geom, 1, dw=dw, dx=dx)
    numpy.testing.assert_allclose(mem.get(DX, x.size).reshape(x.shape), dx, rtol=1e-4,
                                  atol=1e-4)
    g.backward_filter(X, DY, DW, WS, ops=mem, ones=ONES)
    numpy.testing.assert_allclose(mem.get(DW, w.size).reshape(w.shape), dw, rtol=1e-4,
                                  atol=1e-4)


@pytest.mark.parametrize('type_name, rtol', [('float32', 1e-5), ('float16', 2 ** -10),
                                             ('bfloat16', 2 ** -7)])
@pytest.mark.parametrize('n,c,hw,m', [(3, 4, (5, 6), 7), (2, 8, (1, 1), 3)])
def test_gemm_1x1_convolution_plan_on_channels_last_maps(n, c, hw, m, type_name, rtol):
    """Over channels-last maps a 1x1 stride-1 convolution is one cuBLAS call
    each way on the N*H*W x C matrix: forward, data gradient (written) and
    filter gradient (added in float32 to the master's), against float64
    sums of the same (rounded) values, transposed from Caffe's order."""
    from caffeplus.layers import conv_gemm as L
    dtype = _numpy_type(type_name)
    layer = _FakeConvLayer(n, c, hw, m, (1, 1), (1, 1), (0, 0), (1, 1))
    g = L._GemmConv(layer, dtype, nhwc=True)
    assert g.nhwc and g.direct and all(g.memory(k) == 0 for k in g.kinds())
    rng = numpy.random.default_rng(25)
    last = lambda a: numpy.ascontiguousarray(a.transpose(0, 2, 3, 1))    # noqa: E731
    x = rng.standard_normal((n, c) + hw).astype(dtype)
    w = rng.standard_normal((m, c, 1, 1)).astype(dtype)
    dy = rng.standard_normal((n, m) + hw).astype(dtype)
    dw0 = rng.standard_normal(w.shape).astype(numpy.float32)
    sizes = [x.nbytes, w.nbytes, dy.nbytes, dy.nbytes, 2 * w.nbytes, x.nbytes]
    addrs = numpy.cumsum([0] + [-(-s // 256) * 256 for s in sizes])
    mem = _FlatMemory(int(addrs[-1]))
    X, W, Y, DY, DW, DX = (int(a) for a in addrs[:-1])
    for addr, a in ((X, last(x)), (W, w), (DY, last(dy)), (DW, dw0)):
        mem.put(addr, a)
    x64, w64, dy64 = (a.astype(numpy.float64) for a in (x, w[:, :, 0, 0], dy))

    def close(got, want):
        numpy.testing.assert_allclose(got.astype(numpy.float64), want, rtol=rtol,
                                      atol=rtol * numpy.abs(want).max())
    g.forward(X, W, Y, None, ops=mem)
    close(mem.get(Y, dy.size, dtype).reshape(last(dy).shape),
          last(numpy.einsum('mc,nchw->nmhw', w64, x64)))
    g.backward_data(DY, W, DX, ops=mem)
    close(mem.get(DX, x.size, dtype).reshape(last(x).shape),
          last(numpy.einsum('mc,nmhw->nchw', w64, dy64)))
    g.backward_filter(X, DY, DW, None, ops=mem)
    numpy.testing.assert_allclose(
        mem.get(DW, w.size).reshape(w.shape),
        dw0 + numpy.einsum('nmhw,nchw->mc', dy64, x64)[:, :, None, None], rtol=1e-5, atol=1e-5)
    # Any other channels-last convolution is im2row from an image in Caffe's
    # order (tests/test_conv_rows.py), where its taps can be indexed.
    assert L._GemmConv(_FakeConvLayer(n, c, hw, m, (3, 3), (1, 1), (1, 1), (1, 1)), dtype,
                       nhwc=True).rows
    with pytest.raises(ValueError):
        L._GemmConv(_FakeConvLayer(n, c, (600, 600), m, (3, 3), (1, 1), (1, 1), (1, 200)),
                    dtype, nhwc=True)


def _train_plan(plan, **options):
    from caffeplus.memory.apply import apply_named_plan
    net = _net(memory='stock')
    apply_named_plan(net, plan, training=True, **options)
    losses, fused = [], []
    for _ in range(4):
        net.clear_param_diffs()
        losses.append(float(backend.to_numpy(net.forward_prefilled())))
        net.backward_all()
        fused.append([(c.fwd_done, c.bwd_done) for c in net._fused_chains])
        for p in net.learnable_params:
            d, g = backend.to_numpy(p.data), backend.to_numpy(p.diff)
            p.data = d - numpy.float32(0.1) * g
    return losses, [backend.to_numpy(p.data).copy() for p in net.learnable_params], fused


def test_offload_keeps_chains_fused_and_matches_shared_emulated(emulated):
    """The offload runtime's per-layer hooks (copies and waits at step
    boundaries) leave the BatchNorm->Scale->ReLU chains fused: offload runs
    the arithmetic of `shared` and stays bit-identical to it."""
    shared = _train_plan('shared')
    off = _train_plan('offload', offload_policy='all', lookahead=1,
                      runtime_options={'simulate': 'lazy'})
    assert all(done == (True, True) for step in off[2] for done in step)
    assert off[0] == shared[0]
    for a, b in zip(off[1], shared[1]):
        assert numpy.array_equal(a, b)


def test_offload_without_fused_chains_emulated(emulated):
    """Runtime option fused_chains=False: offload runs the chains' layers one
    by one (the generic GPU layers): the same training as shared up to
    rounding."""
    shared = _train_plan('shared')
    off = _train_plan('offload', offload_policy='all', lookahead=1,
                      runtime_options={'simulate': 'lazy', 'fused_chains': False})
    assert not any(done[0] or done[1] for step in off[2] for done in step)
    numpy.testing.assert_allclose(off[0], shared[0], rtol=1e-4)
    for a, b in zip(off[1], shared[1]):
        numpy.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


def test_offload_relayout_frees_the_old_arena_with_chains_emulated(emulated, monkeypatch):
    """A re-layout that keeps no values lets the old arena go before taking
    a larger one, fused chains included: a chained Scale holds BatchNorm's
    kept normalized copy (a view of the arena) and must forget it too
    (otherwise it keeps ResNet-50's 4.6 GB old arena alive)."""
    import weakref
    from caffeplus.memory import placement
    from caffeplus.memory.apply import apply_named_plan
    net = _net(memory='stock')
    apply_named_plan(net, 'offload', training=True, offload_policy='all', lookahead=1,
                     runtime_options={'simulate': 'lazy', 'fused_chains': True})
    net.forward_prefilled()
    net.backward_all()
    assert any(c.fwd_done and c.bwd_done for c in net._fused_chains)
    applied = net.applied_plan
    old = weakref.ref(applied.arena_base())
    real_place = placement.place
    monkeypatch.setattr(placement, 'place', lambda bufs, *a: (real_place(bufs, *a)[0],
                                                          2 * real_place(bufs, *a)[1]))
    # On the GPU the plan knows the chains, so a chained Scale keeps nothing
    # of its own (no views of its own), yet holds BatchNorm's normalized copy.
    from caffeplus.memory import scratch
    chained = [l for l in net.layers if l.type == 'Scale' and l._chain is not None]
    for sc in chained:
        sc.__dict__.pop(scratch.VIEWS, None)
    assert any(sc._bottom_copy is not None and sc._bottom_copy.base is old()
               for sc in chained)
    applied.relayout(lookahead_steps={})
    assert old() is None


def test_liveness_knows_a_chain_writes_at_its_head_step(emulated):
    """An Eltwise->ReLU chain's backward runs at the ReLU's step and writes
    the Eltwise's bottom diffs there, a step before the Eltwise's own: the
    planner must start those diffs' lives there (otherwise offload can place
    the ReLU's top data in the same bytes, and the fused backward read it
    while overwriting it)."""
    from caffeplus.memory import liveness
    net = _net()
    L = len(net.layers)
    names = net._layer_names
    relu, elt = names.index('relu2'), names.index('sum')
    bottoms = [net._blob_names[b] for b in net.bottom_id_vecs[elt]]

    def starts():
        return {n: b.start for b in liveness.buffers(net) if b.kind == 'diff'
                for n in b.blobs if n in bottoms}
    assert all(s <= 2 * L - 1 - relu < 2 * L - 1 - elt for s in starts().values())
    previous = kernels.set_enabled(False)        # unfused: the Eltwise's own step
    try:
        assert starts()['conv2'] == 2 * L - 1 - elt
    finally:
        kernels.set_enabled(previous)


CHANNEL_SUM_SHAPES = [(1, 1, 1), (2, 3, 5), (4, 7, 33), (3, 2, 700), (128, 5, 1)]


def _check_channel_sums(xp, shape, min_values, monkeypatch):
    """kernels.channel_sums: db += dy summed over batch and space, per channel
    (a convolution's bias gradient), over one or several blocks a channel."""
    monkeypatch.setattr(kernels, 'SUM_MIN_VALUES', min_values)
    n, c, s = shape
    rng = numpy.random.default_rng(n * 100 + c * 10 + s)
    dy = rng.standard_normal(shape).astype(numpy.float32)
    db0 = rng.standard_normal(c).astype(numpy.float32)
    p = kernels.sum_blocks_per_channel(c, n * s)
    results = []
    for _ in range(2):
        db = xp.asarray(db0.copy())
        part = kernels.empty(c * p, numpy.float64)
        kernels.channel_sums(xp.asarray(dy.reshape(-1)), part, db, n, c, s, p)
        results.append(numpy.asarray(db.get() if hasattr(db, 'get') else db))
    want = (db0.astype(numpy.float64) + dy.astype(numpy.float64).sum(axis=(0, 2)))
    numpy.testing.assert_allclose(results[0], want, rtol=2e-7, atol=1e-6)
    numpy.testing.assert_array_equal(results[0], results[1])     # deterministic
    return p


@pytest.mark.parametrize('shape', CHANNEL_SUM_SHAPES)
@pytest.mark.parametrize('min_values', [4096, 16])
def test_channel_sums_emulated(shape, min_values, emulated, monkeypatch):
    p = _check_channel_sums(numpy, shape, min_values, monkeypatch)
    if min_values == 16 and shape[0] * shape[2] >= 64:
        assert p > 1        # the case covers several blocks a channel


@pytest.mark.gpu
@pytest.mark.parametrize('shape', CHANNEL_SUM_SHAPES + [(128, 96, 3025), (64, 384, 169)])
def test_channel_sums_gpu(shape, monkeypatch):
    cupy = pytest.importorskip('cupy')
    kernels.reset_kernels()
    _check_channel_sums(cupy, shape, kernels.SUM_MIN_VALUES, monkeypatch)


@pytest.mark.parametrize('name', ['relu', 'relu_inplace', 'relu_leaky', 'relu_negative_slope'])
def test_relu_over_the_kernels_count_runs_in_pieces(name, emulated, monkeypatch):
    # Blobs of 2**31 values or more (VGG-16's conv1 tops from batch 668 on)
    # run the elementwise kernels piece by piece: here pieces of 17 values.
    monkeypatch.setattr(kernels, 'MAX_COUNT', 17)
    launches = []
    real_kernel = kernels.kernel

    def counting(kernel_name, dtype=None):
        k = real_kernel(kernel_name, dtype)
        if not kernel_name.startswith('cp_relu'):
            return k

        def launch(*args, **kw):
            launches.append(kernel_name)
            return k(*args, **kw)
        return launch
    monkeypatch.setattr(kernels, 'kernel', counting)
    case = [c for c in LAYER_CASES if c[0] == name][0]
    _check_layer_case(case, gpu=False)
    count = int(numpy.prod(case[2][0]))
    pieces = -(-count // 17)
    # Two passes, each one launch a piece forward and one backward (the
    # generic code, which the old path fell back to, launches none).
    assert launches.count('cp_relu_fwd') == 2 * pieces
    assert launches.count('cp_relu_bwd') == 2 * pieces


def test_the_im2col_gemm_search_switches_by_layer_type_and_setting(
        monkeypatch):
    from caffeplus.cudnn import algo_search
    from caffeplus.layers import conv_gemm
    monkeypatch.setattr(algo_search, 'GEMM_SEARCH', False)
    monkeypatch.setattr(algo_search, 'GEMM_SEARCH_SIXTEEN_BIT', True)
    layer = _FakeConvLayer(2, 3, (9, 9), 4, (3, 3), (2, 2), (0, 0), (1, 1))
    assert not conv_gemm._GemmConv.eligible(layer)            # an FP32 layer
    layer.activation_dtype = numpy.dtype(numpy.float16)
    assert conv_gemm._GemmConv.eligible(layer)
    layer.channels = conv_gemm.GEMM_MAX_CHANNELS + 1          # not an image layer
    assert not conv_gemm._GemmConv.eligible(layer)
    from caffeplus import config
    for value, want in (('on', True), ('off', False)):
        with config.using(gemm_search=value):
            assert algo_search._gemm_search() is want
            assert algo_search._gemm_search(sixteen_bit=True) is want


def test_split_sum_chain_matches_the_layers_bit_for_bit_emulated(emulated, monkeypatch):
    """The Split -> ReLU -> Eltwise backward in one kernel (cp_sum_scale2)
    gives every blob, diff and parameter that the Split's kernel and the
    Eltwise -> ReLU chain's give one after the other, the summed diff
    included."""
    from caffeplus.layers import fused_chain
    net, fused, seen = _train(gpu=False, fused=True)
    chain = net._fused_chains[2]
    assert chain.split is not None and chain.store_sum_diff
    assert seen[-1][2] == (True, True)
    # Without Splits in chains: the same net, the Split running cp_axpby.
    monkeypatch.setattr(fused_chain, 'GPUSplitLayer', type('NoSplit', (), {}))
    net, apart, _ = _train(gpu=False, fused=True)
    assert net._fused_chains[2].split is None
    assert apart.keys() == fused.keys()
    for key in apart:
        for a, b in zip(apart[key], fused[key]):
            assert a.tobytes() == b.tobytes(), key


def test_split_sum_chain_stores_the_summed_diff_only_where_a_plan_keeps_it_emulated(emulated):
    """Under `shared` the Eltwise top's diff is dead once the chain has run,
    so the kernel leaves it unwritten; training stays bit for bit `stock`'s.
    Kept (`keep`), it is written."""
    def chain_of(plan, keep=()):
        from caffeplus.memory.apply import apply_named_plan
        net = _net(memory='stock')
        apply_named_plan(net, plan, training=True, keep=keep)
        net.forward_prefilled()
        net.backward_all()
        chain = net._fused_chains[2]
        assert chain.bwd_done
        return net, chain.store_sum_diff
    assert chain_of('stock')[1] is True
    assert chain_of('shared')[1] is False
    net, stored = chain_of('shared', keep=['sum'])
    assert stored is True
    assert numpy.abs(backend.to_numpy(net.blobs['sum'].diff)).max() > 0
    stock, shared = _train_plan('stock'), _train_plan('shared')
    assert all(done == (True, True) for step in shared[2] for done in step)
    assert stock[0] == shared[0]
    for a, b in zip(stock[1], shared[1]):
        assert a.tobytes() == b.tobytes()


def test_liveness_starts_a_split_chains_bottom_diffs_at_the_split(emulated):
    """The Eltwise's bottom diffs are written at the Split's backward step
    when the three layers run as one chain."""
    from caffeplus.memory import liveness
    net = _net()
    L = len(net.layers)
    split = net._layer_names.index('sum_relu2_0_split')
    bottoms = {net._blob_names[b] for b in net.bottom_id_vecs[net._layer_names.index('sum')]}
    starts = {n: b.start for b in liveness.buffers(net) if b.kind == 'diff'
              for n in b.blobs if n in bottoms}
    assert starts and all(s <= 2 * L - 1 - split for s in starts.values())


def test_split_sum_chain_leaves_a_masked_relu_to_its_bits_emulated(emulated):
    """With the ReLU masked (its backward reads one bit a value; a plan may
    let the map go), the three layers run one by one, the same training."""
    from caffeplus.memory import masks

    def train(mask):
        net = _net()
        assert masks.apply(net, ['relu2'] if mask else []) == (('relu2',) if mask else ())
        out = []
        for _ in range(2):
            net.clear_param_diffs()
            out.append(float(backend.to_numpy(net.forward_prefilled())))
            net.backward_all()
            out.append(net._fused_chains[2].bwd_done)
            for p in net.learnable_params:
                p.data = backend.to_numpy(p.data) - numpy.float32(0.1) * backend.to_numpy(p.diff)
        return out, [backend.to_numpy(p.data).tobytes() for p in net.learnable_params]
    plain, masked = train(False), train(True)
    assert plain[0][1::2] == [True, True] and masked[0][1::2] == [False, False]
    assert plain[0][::2] == masked[0][::2] and plain[1] == masked[1]


def _train_paired(monkeypatch, pair=True, partner_fails=False):
    """_train with the Eltwise chains' hand-over of the gradient to the
    BatchNorm -> Scale chain before them (pair), or without; with
    partner_fails, that chain's fused backward declines (its layers run one
    by one)."""
    from caffeplus.layers import fused_chain
    with monkeypatch.context() as m:
        if not pair:
            m.setattr(fused_chain, '_pair_sum_chains', lambda chains: None)
        if partner_fails:
            real = fused_chain._Chain.backward
            m.setattr(fused_chain._Chain, 'backward',
                      lambda self: False if self.scale.name == 'sc2' else real(self))
        net, out, _ = _train(gpu=False, fused=True)
    return net, out


@pytest.mark.parametrize('partner_fails', [False, True])
def test_sum_chain_hands_its_gradient_to_the_branch_chain_emulated(monkeypatch, emulated,
                                                                  partner_fails):
    """sum's coefficients are 1, so its two bottom diffs are the same values:
    the chain writes the shortcut's only and bn2 -> sc2 reads its gradient
    from there, every blob, diff and parameter as without the hand-over.
    When that chain falls back to its layers, the gradient is copied to
    them first."""
    net, paired = _train_paired(monkeypatch, True, partner_fails)
    sums = [c for c in net._fused_chains if hasattr(c, 'eltwise')]
    assert [c.eltwise.name for c in sums if c.can_share_diff] == ['sum']
    assert sums[0].branch.scale.name == 'sc2' and sums[0].shares_diff
    _, apart = _train_paired(monkeypatch, False, partner_fails)
    assert apart.keys() == paired.keys()
    for key in apart:
        for a, b in zip(apart[key], paired[key]):
            assert a.tobytes() == b.tobytes(), key


# A residual sum whose branch ends in BatchNorm -> Scale, its maps labelled
# channels-last by hand (the emulator's layers otherwise keep Caffe's order;
# the values need not mean anything for runs compared with each other).
NHWC_SUM = '''
name: "nhwc_sum"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 8 dim: 3 dim: 5 } shape { dim: 4 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "pre" type: "Scale" bottom: "data" top: "x"
  scale_param { bias_term: true filler { type: "gaussian" std: 0.3 mean: 1 } } }
layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x" }
layer { name: "sc" type: "Scale" bottom: "x" top: "x"
  scale_param { bias_term: true filler { type: "gaussian" std: 0.3 mean: 1 }
    bias_filler { type: "gaussian" std: 0.2 } } }
layer { name: "sum" type: "Eltwise" bottom: "data" bottom: "x" top: "sum"
  eltwise_param { coeff: 0.5 coeff: 2 } }
layer { name: "relu" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "post" type: "Scale" bottom: "sum" top: "z"
  scale_param { bias_term: true filler { type: "gaussian" std: 0.3 mean: 1 } } }
layer { name: "sum2" type: "Eltwise" bottom: "sum" bottom: "z" top: "s2" }
layer { name: "pool" type: "Pooling" bottom: "s2" top: "pool"
  pooling_param { pool: AVE global_pooling: true } }
layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
'''
NHWC_BLOBS = ('data', 'x', 'sum', 'z', 's2', 'sum_relu_0_split_0', 'sum_relu_0_split_1',
              'data_data_0_split_0', 'data_data_0_split_1')


def _train_nhwc_sum(monkeypatch, pair=True, plan=None, iters=2):
    from caffeplus.layers import fused_chain
    from caffeplus.memory.apply import apply_named_plan
    with monkeypatch.context() as m:
        if not pair:
            m.setattr(fused_chain, '_pair_sum_chains', lambda chains: None)
        adds = []
        real = fused_chain.GPUBatchNormLayer.apply_deferred
        m.setattr(fused_chain.GPUBatchNormLayer, 'apply_deferred',
                  lambda self, *a, **k: (adds.append(bool(a)), real(self, *a, **k))[1])
        net = _net(NHWC_SUM, memory='stock' if plan else None)
        for name in NHWC_BLOBS:
            net.blobs[name].layout = 'NHWC'
        net.reshape()
        if plan:
            apply_named_plan(net, plan, training=True)
        losses = []
        for _ in range(iters):
            net.clear_param_diffs()
            losses.append(float(backend.to_numpy(net.forward_prefilled())))
            net.backward_all()
            for p in net.learnable_params:
                p.data = backend.to_numpy(p.data) - numpy.float32(0.1) * backend.to_numpy(p.diff)
        chain = next(c for c in net._fused_chains if getattr(c, 'eltwise', None) is not None
                     and c.eltwise.name == 'sum')
        params = [backend.to_numpy(p.data).tobytes() for p in net.learnable_params]
        return net, chain, adds, losses, params


def test_branch_normalize_pass_runs_with_the_sum_emulated(monkeypatch, emulated):
    """Channels-last: the branch's BatchNorm -> Scale normalize pass waits for
    the Eltwise SUM after it and runs with it and its ReLU
    (cp_bn_apply_add_nhwc_vec): every blob's values, the branch's top
    stored, and training bit for bit as the kernels one after another."""
    net, chain, adds, losses, params = _train_nhwc_sum(monkeypatch)
    assert net.layers[net._layer_names.index('bn')]._nhwc
    assert chain.branch is not None and chain.branch.scale.name == 'sc'
    assert adds == [True, True] and chain.store_branch_top
    values = {k: backend.to_numpy(b.data).tobytes() for k, b in net.blobs.items()}
    net, _, adds, losses_apart, params_apart = _train_nhwc_sum(monkeypatch, pair=False)
    assert adds == [] and losses_apart == losses and params_apart == params
    assert values == {k: backend.to_numpy(b.data).tobytes() for k, b in net.blobs.items()}


def test_branch_top_is_left_unstored_where_the_plan_drops_it_emulated(monkeypatch, emulated):
    """Under `shared` the branch's top dies at the sum: the fused pass leaves
    it unwritten, and trains bit for bit as under `stock`."""
    _, chain, adds, losses, params = _train_nhwc_sum(monkeypatch, plan='shared')
    assert adds == [True, True] and not chain.store_branch_top
    _, chain, _, stock_losses, stock_params = _train_nhwc_sum(monkeypatch, plan='stock')
    assert chain.store_branch_top
    assert stock_losses == losses and stock_params == params


def test_a_declined_sum_pass_runs_the_branchs_deferred_pass_first_emulated(monkeypatch,
                                                                          emulated):
    """If the Eltwise cannot take the branch's normalize pass (a misaligned
    map), that pass runs first on its own, then the Eltwise: the same
    training as without the deferral."""
    from caffeplus.layers import fused_chain
    monkeypatch.setattr(fused_chain._SumChain, 'forward_with_branch', lambda self: False)
    _, _, adds, losses, params = _train_nhwc_sum(monkeypatch)
    assert adds == [False, False]
    _, _, _, apart_losses, apart_params = _train_nhwc_sum(monkeypatch, pair=False)
    assert losses == apart_losses and params == apart_params


def test_a_branch_ending_in_relu_is_not_paired_with_the_sum_emulated(emulated):
    """A BatchNorm -> Scale -> ReLU chain right before the sum stays the
    sum's bottom as it is (a masked ReLU would read a top not yet written)."""
    text = RESNET.replace('layer { name: "sum" type: "Eltwise"',
                          'layer { name: "relu_c2" type: "ReLU" bottom: "conv2" top: "conv2" }\n'
                          'layer { name: "sum" type: "Eltwise"')
    net = _net(text)
    net.forward_prefilled()
    chains = net._fused_chains
    bn2 = next(c for c in chains if getattr(c, 'bn', None) is not None and c.bn.name == 'bn2')
    assert bn2.relu is not None and bn2.relu.name == 'relu_c2'
    assert all(c.branch is None for c in chains if hasattr(c, 'eltwise'))
