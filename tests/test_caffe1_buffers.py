"""The `stock` plan's Caffe 1.0 layer buffers (caffeplus.memory.caffe1), the
estimate that counts them, `caffeplus time --memory` and
benchmarks/bench_stock_memory.py.

The expected buffers are worked out here from Caffe 1.0's layer classes
(batch_norm_layer.cu, scale_layer.cu, pooling_layer.cpp with
layer_factory.cpp's engine choice, dropout_layer.cu, softmax_loss_layer.cu)
and the shapes of the built net, independently of caffe1's own table."""
import gc
import json
import logging
import os
import stat
import sys

import numpy
import pytest
from google.protobuf import text_format

import caffeplus
from caffeplus import backend
from caffeplus.memory import caffe1, shapes, thread_stack, workspace_model as wm
from caffeplus.proto import caffe_pb2

from conftest import REFERENCE, SHARED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(SHARED, 'bench')
BENCH_NETS = ['alexnet_b128', 'googlenet_b64', 'vgg16_b64', 'resnet50_b32', 'resnet50_b64',
              'vgg16_b256']
MiB = 2 ** 20


def bench_net(name):
    path = os.path.join(BENCH, name + '.prototxt')
    if not os.path.exists(path):
        pytest.fail('test data missing: %s' % path)
    return shapes.build_net(shapes.load_net_param(path, phase=caffe_pb2.TRAIN))


def _prod(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def caffe_rules(net):
    """{(layer, buffer): (shape, dtype, bytes)} by Caffe 1.0's rules, for the
    layer kinds of the bench nets."""
    out = {}

    def add(lp, name, shape, dtype):
        out[(lp.name, name)] = (tuple(shape), dtype, 4 * _prod(shape))
    for i, layer in enumerate(net.layers):
        lp = layer.layer_param
        bottom, top = net.bottom_vecs[i], net.top_vecs[i]
        if lp.type == 'BatchNorm':
            add(lp, 'temp_', bottom[0].shape, 'float32')
            add(lp, 'x_norm_', bottom[0].shape, 'float32')
            if bottom[0] is top[0] and net.layer_need_backward[i] and net.phase == caffe_pb2.TRAIN:
                add(lp, 'x_norm_.diff', bottom[0].shape, 'float32')
        elif lp.type == 'Scale' and bottom[0] is top[0]:
            add(lp, 'temp_', bottom[0].shape, 'float32')
        elif lp.type == 'Pooling' and lp.pooling_param.pool == 0 and len(top) == 1:
            add(lp, 'max_idx_', top[0].shape, 'int32')
        elif lp.type == 'Dropout' and lp.phase == caffe_pb2.TRAIN:
            add(lp, 'rand_vec_', bottom[0].shape, 'uint32')
        elif lp.type == 'SoftmaxWithLoss':
            add(lp, 'prob_', bottom[0].shape, 'float32')
            add(lp, 'prob_.diff', bottom[0].shape, 'float32')
        elif lp.type in ('LRN', 'Eltwise'):
            assert lp.lrn_param.local_size <= 16 and lp.eltwise_param.operation != 2
    return out


def caffe_handles(net):
    """Layers that are a cuDNN class in Caffe 1.0 (bench nets: no engine set)."""
    return [l.layer_param.name for i, l in enumerate(net.layers)
            if l.layer_param.type in ('ReLU', 'LRN', 'SoftmaxWithLoss') or
            (l.layer_param.type == 'Pooling' and l.layer_param.pooling_param.pool == 1)]


def listed(net):
    return {(b.layer, b.name): (b.shape, b.dtype, b.nbytes) for b in caffe1.stock_buffers(net)}


# -- the list ----------------------------------------------------------------------------
@pytest.mark.parametrize('name', BENCH_NETS)
def test_bench_net_buffers_follow_caffes_rules(name):
    net = bench_net(name)
    assert listed(net) == caffe_rules(net)
    assert [net.layers[i].layer_param.name for i in caffe1.handle_layers(net)] == \
        caffe_handles(net)
    # every one is missing from our layers: attach adds them all
    assert caffe1.own_bytes(net) == 0
    assert caffe1.extra_bytes(net) == sum(v[2] for v in caffe_rules(net).values())


def test_bench_figures_by_hand():
    alex = listed(bench_net('alexnet_b128'))
    assert alex[('pool1', 'max_idx_')] == ((128, 96, 27, 27), 'int32', 35831808)
    assert alex[('drop6', 'rand_vec_')] == ((128, 4096), 'uint32', 128 * 4096 * 4)
    assert alex[('loss', 'prob_.diff')] == ((128, 1000), 'float32', 512000)
    assert ('norm1', 'scale_') not in alex          # cuDNN LRN: nothing
    res = bench_net('resnet50_b64')
    buf = listed(res)
    assert buf[('bn_conv1', 'x_norm_.diff')] == ((64, 64, 112, 112), 'float32', 205520896)
    assert buf[('scale_conv1', 'temp_')][2] == 205520896
    # BatchNorm: three bottom-sized buffers, Scale: one; all 53 in place
    bn = sum(4 * res.bottom_vecs[i][0].count for i, l in enumerate(res.layers)
             if l.layer_param.type == 'BatchNorm')
    assert sum(v[2] for (layer, _), v in buf.items() if layer.startswith('bn')) == 3 * bn
    assert sum(v[2] for (layer, _), v in buf.items() if layer.startswith('scale')) == bn
    assert caffe1.handle_count(res) == 49 + 1 + 1  # ReLUs, pool5 (AVE), the loss's softmax
    assert caffe1.handle_count(bench_net('googlenet_b64')) == 61 + 2 + 3 + 3


SMALL = '''
name: "small"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1
    weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "bn_a" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "sc_a" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "bn_b" type: "BatchNorm" bottom: "conv" top: "bnb" }
layer { name: "sc_b" type: "Scale" bottom: "bnb" top: "scb" }
layer { name: "relu" type: "ReLU" bottom: "scb" top: "scb" }
layer { name: "pmax" type: "Pooling" bottom: "scb" top: "pmax"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "pave" type: "Pooling" bottom: "scb" top: "pave"
  pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "pmask" type: "Pooling" bottom: "scb" top: "pmask" top: "pmask_idx"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "psto" type: "Pooling" bottom: "scb" top: "psto"
  pooling_param { pool: STOCHASTIC kernel_size: 2 stride: 2 } }
layer { name: "lrn5" type: "LRN" bottom: "pave" top: "lrn5" lrn_param { local_size: 5 } }
layer { name: "lrn17" type: "LRN" bottom: "pave" top: "lrn17" lrn_param { local_size: 17 } }
layer { name: "lrn_caffe" type: "LRN" bottom: "pave" top: "lrn_caffe"
  lrn_param { local_size: 3 engine: CAFFE } }
layer { name: "lcn" type: "LRN" bottom: "pave" top: "lcn"
  lrn_param { local_size: 3 norm_region: WITHIN_CHANNEL } }
layer { name: "mvn" type: "MVN" bottom: "pmask" top: "mvn" }
layer { name: "emax" type: "Eltwise" bottom: "pmax" bottom: "psto" top: "emax"
  eltwise_param { operation: MAX } }
layer { name: "esum" type: "Eltwise" bottom: "pmax" bottom: "mvn" top: "esum" }
layer { name: "sig" type: "Sigmoid" bottom: "esum" top: "sig" }
layer { name: "tanh" type: "TanH" bottom: "esum" top: "tanh" tanh_param { engine: CAFFE } }
layer { name: "fc" type: "InnerProduct" bottom: "emax" top: "fc"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "drop" type: "Dropout" bottom: "fc" top: "fc" }
layer { name: "soft" type: "Softmax" bottom: "fc" top: "soft" softmax_param { engine: CAFFE } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
'''


def small_net(phase=caffe_pb2.TRAIN, text=SMALL):
    param = caffe_pb2.NetParameter()
    text_format.Parse(text, param)
    return caffeplus.Net(param, phase)


def test_small_net_buffers_train():
    net = small_net()
    f = 'float32'
    want = {
        ('bn_a', 'temp_'): ((2, 4, 8, 8), f, 2048, 'caffe1'),
        ('bn_a', 'x_norm_'): ((2, 4, 8, 8), f, 2048, 'caffe1'),
        ('bn_a', 'x_norm_.diff'): ((2, 4, 8, 8), f, 2048, 'caffe1'),     # in place
        ('sc_a', 'temp_'): ((2, 4, 8, 8), f, 2048, 'caffe1'),            # in place
        ('bn_b', 'temp_'): ((2, 4, 8, 8), f, 2048, 'caffe1'),
        ('bn_b', 'x_norm_'): ((2, 4, 8, 8), f, 2048, 'caffe1'),          # not in place: no diff
        ('pmax', 'max_idx_'): ((2, 4, 4, 4), 'int32', 512, 'caffe1'),
        ('psto', 'rand_idx_'): ((2, 4, 4, 4), f, 512, 'caffe1'),
        ('lrn17', 'scale_'): ((2, 4, 4, 4), f, 512, 'layer'),            # Caffe's LRNLayer
        ('lrn_caffe', 'scale_'): ((2, 4, 4, 4), f, 512, 'layer'),
        ('lcn', 'tempData1'): ((2, 4, 4, 4), f, 512, 'layer'),           # cuDNN LCN
        ('lcn', 'tempData2'): ((2, 4, 4, 4), f, 512, 'caffe1'),
        ('mvn', 'temp_'): ((2, 4, 4, 4), f, 512, 'caffe1'),
        ('emax', 'max_idx_'): ((2, 4, 4, 4), 'int32', 512, 'layer'),
        ('drop', 'rand_vec_'): ((2, 5), 'uint32', 40, 'caffe1'),
        ('loss', 'prob_'): ((2, 5), f, 40, 'caffe1'),
        ('loss', 'prob_.diff'): ((2, 5), f, 40, 'caffe1'),
    }
    got = {(b.layer, b.name): (b.shape, b.dtype, b.nbytes, b.holder)
           for b in caffe1.stock_buffers(net)}
    assert got == want
    assert caffe1.extra_bytes(net) == sum(v[2] for v in want.values() if v[3] == 'caffe1')
    assert caffe1.own_bytes(net) == 4 * 512
    names = [net.layers[i].layer_param.name for i in caffe1.handle_layers(net)]
    assert names == ['relu', 'pave', 'lrn5', 'lcn', 'sig', 'loss']


def test_small_net_buffers_test_phase():
    net = small_net(caffe_pb2.TEST)
    got = {(b.layer, b.name) for b in caffe1.stock_buffers(net)}
    assert ('bn_a', 'x_norm_') in got and ('bn_a', 'temp_') in got   # every forward
    assert ('bn_a', 'x_norm_.diff') not in got          # no backward in TEST
    assert ('drop', 'rand_vec_') not in got and ('psto', 'rand_idx_') not in got
    assert ('loss', 'prob_.diff') in got and ('pmax', 'max_idx_') in got


def test_adopting_layers_name_their_buffers():
    net = small_net()
    adopt = {(b.layer, b.name): b.adopt for b in caffe1.stock_buffers(net) if b.adopt}
    assert adopt == {('drop', 'rand_vec_'): 'mask_buffer'}
    role = {(b.layer, b.name): b.role for b in caffe1.stock_buffers(net) if b.role}
    assert role == {('bn_a', 'x_norm_'): 'x_norm', ('bn_b', 'x_norm_'): 'x_norm',
                    ('sc_a', 'temp_'): 'bottom_copy', ('pmax', 'max_idx_'): 'argmax',
                    ('drop', 'rand_vec_'): 'mask'}


# -- the estimate ----------------------------------------------------------------------------
def expected_stock_other(net):
    return wm.RUNTIME_BYTES + wm.HANDLE_BYTES * (wm.stock_handles(net) +
                                                 len(caffe_handles(net))) + \
        sum(v[2] for v in caffe_rules(net).values())


@pytest.mark.parametrize('name', ['alexnet_b128', 'resnet50_b32'])
def test_estimate_counts_the_buffers(name):
    net = bench_net(name)
    assert wm.other_bytes(net, 'stock') == expected_stock_other(net)
    assert wm.internals(net, 'stock') == caffe1.own_bytes(net) + caffe1.extra_bytes(net)
    # the other plans keep our layers' own model, under a smaller thread
    # stack and one cuBLAS buffer instead of two
    saved = (thread_stack.CUDA_DEFAULT_BYTES - thread_stack.THREAD_STACK_BYTES) * 132 * 2048 + \
        32 * 2 ** 20
    # and ResNet-50's 1 x 1 convolutions, run as GEMMs with no workspace
    # placed, hold cuBLAS's own buffer (AlexNet has none)
    gemm = 32 * 2 ** 20 if name == 'resnet50_b32' else 0
    assert wm.other_bytes(net, "arena") == wm.RUNTIME_BYTES - saved + wm.internals(net) + gemm


def test_memory_estimate_json_stock_other(capsys):
    from caffeplus.cli import main
    path = os.path.join(BENCH, 'resnet50_b32.prototxt')
    if not os.path.exists(path):
        pytest.fail('test data missing')
    assert main(['memory', '-model', path, '--estimate', '--plans', 'stock,arena',
                 '--json']) == 0
    doc = json.loads(capsys.readouterr().out)
    net = bench_net('resnet50_b32')
    stock = doc['plans']['stock']['breakdown']
    assert stock['other'] == expected_stock_other(net)
    # ResNet-50: BatchNorm/Scale buffers make stock's "other" gigabytes above arena's
    extra = sum(v[2] for v in caffe_rules(net).values())
    assert extra > 4 * 2 ** 30
    assert stock['other'] - doc['plans']['arena']['breakdown']['other'] > extra - 3 * 2 ** 30


def test_small_net_estimate_includes_own_and_extra():
    net = small_net()
    assert wm.internals(net, 'stock') == caffe1.own_bytes(net) + caffe1.extra_bytes(net)


# -- the CPU allocates nothing ---------------------------------------------------------------
def _no_caffe1_state(net):
    for layer in net.layers:
        for attr in (caffe1.ATTR, caffe1.ADOPTED, caffe1.HANDLE):
            assert attr not in layer.__dict__, (layer.layer_param.name, attr)
    assert all(getattr(l, 'mask_buffer', None) is None for l in net.layers)


def test_cpu_stock_plan_allocates_nothing():
    param = caffe_pb2.NetParameter()
    text_format.Parse(SMALL, param)
    net = caffeplus.Net(param, caffeplus.TRAIN, memory='stock')
    assert caffe1.attach(net) == 0
    net.forward_prefilled()
    net.backward_all()
    _no_caffe1_state(net)


def test_workspace_plan_hooks(monkeypatch):
    from caffeplus.memory import workspace
    net = small_net()
    calls = []
    monkeypatch.setattr(caffe1, 'attach', lambda n: calls.append(('attach', n)) or 0)
    monkeypatch.setattr(caffe1, 'detach', lambda n: calls.append(('detach', n)))
    workspace.apply_workspace_plan(net, 'stock')
    workspace.apply_workspace_plan(net, 'arena')
    assert calls == [('attach', net), ('detach', net)]


def test_attach_lends_and_detach_takes_back():
    """attach with host arrays (as the GPU does with device ones): each layer
    holds its buffers; adopting layers get them under their own names."""
    net = small_net()
    total = caffe1.attach(net, xp=numpy)
    assert total == caffe1.extra_bytes(net)
    layers = dict(zip(net._layer_names, net.layers))
    held = caffe1.held(layers['bn_a'])
    assert sorted(held) == ['temp_', 'x_norm_', 'x_norm_.diff']
    kept = layers['bn_a'].__dict__[caffe1.KEPT]['x_norm']     # BatchNorm declares x_norm
    assert numpy.shares_memory(kept, held['x_norm_']) and kept.dtype == numpy.float32
    assert held['temp_'].nbytes == 2048 and not held['temp_'].any()       # zero-filled
    assert layers['drop'].mask_buffer is caffe1.held(layers['drop'])['rand_vec_']
    assert layers['drop'].mask_buffer.dtype == numpy.uint32
    assert not caffe1.held(layers['emax'])          # ours keeps its own mask
    caffe1.detach(net)
    _no_caffe1_state(net)
    assert not layers['bn_a'].__dict__.get(caffe1.KEPT)


def test_attach_lends_declared_kept_buffers():
    """Layers that declare what they keep (internal_buffers(), the
    caffeplus.memory.scratch convention) get Caffe's buffer as their own kept
    one, in the dtype they declare."""
    net = small_net()
    layers = dict(zip(net._layer_names, net.layers))
    declares = {'bn_a': {'x_norm': (512, numpy.float32)},
                'sc_a': {'bottom_copy': (512, numpy.float32)},
                'pmax': {'argmax': (128, numpy.int8)},          # generic: the small dtype
                'drop': {'mask': (10, numpy.bool_)},
                'bn_b': {'x_norm': (4096, numpy.float32)}}       # more than Caffe's: not lent
    for name, kept in declares.items():
        layers[name].internal_buffers = (lambda k: lambda: k)(kept)
    caffe1.attach(net, xp=numpy)
    own = {n: layers[n].__dict__.get(caffe1.KEPT, {}) for n in declares}
    assert own['bn_a']['x_norm'] is not None and \
        numpy.shares_memory(own['bn_a']['x_norm'], caffe1.held(layers['bn_a'])['x_norm_'])
    assert own['sc_a']['bottom_copy'].dtype == numpy.float32
    assert own['pmax']['argmax'].dtype == numpy.int8 and own['pmax']['argmax'].size == 512
    assert own['drop']['mask'].dtype == numpy.bool_ and own['drop']['mask'].size == 40
    assert 'x_norm' not in own['bn_b']
    caffe1.detach(net)
    assert all(not layers[n].__dict__.get(caffe1.KEPT) for n in declares)


def test_dropout_mask_in_a_lent_buffer_changes_nothing():
    def run(lend):
        caffeplus.set_random_seed(5)
        net = small_net()
        if lend:
            caffe1.attach(net, xp=numpy)
        losses = []
        for _ in range(2):
            losses.append(net.forward_prefilled())
            net.backward_all()
        drop = net.layers[net.layer_index('drop')]
        return net, losses, backend.to_numpy(net.blobs['fc'].diff).copy(), drop.mask
    _, la, da, ma = run(False)
    net, lb, db, mb = run(True)
    assert la == lb and numpy.array_equal(da, db) and numpy.array_equal(ma, mb)
    buf = caffe1.held(net.layers[net.layer_index('drop')])['rand_vec_']
    assert mb.base is not None and numpy.shares_memory(mb, buf)


# -- the lent buffers under the fused GPU paths (kernels emulated on the host) ---------------
FUSED = '''
name: "fused"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 dim: 10 dim: 10 } shape { dim: 4 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 6 kernel_size: 3 pad: 1 bias_term: false
    weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "sc1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "sc2" type: "Scale" bottom: "pool1" top: "pool1"
  scale_param { filler { type: "gaussian" mean: 1 std: 0.2 } } }
layer { name: "bn3" type: "BatchNorm" bottom: "pool1" top: "bn3" }
layer { name: "fc" type: "InnerProduct" bottom: "bn3" top: "fc"
  inner_product_param { num_output: 7 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "drop" type: "Dropout" bottom: "fc" top: "fc" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
'''


def _train_fused(lend, iters=2):
    caffeplus.set_random_seed(3)
    net = small_net(text=FUSED)
    if lend:
        # On the GPU the fused max pooling declares its int32 argmax (on the host
        # the generic code's smaller type): declare what the device would.
        pool = net.layers[net.layer_index('pool1')]
        pool.internal_buffers = lambda: {'argmax': (4 * 6 * 5 * 5, numpy.int32)}
        caffe1.attach(net, xp=numpy)
    losses = []
    for _ in range(iters):
        net.clear_param_diffs()
        losses.append(net.forward_prefilled())
        net.backward_all()
    out = [backend.to_numpy(b.data).copy() for b in net.blobs.values()] + \
        [backend.to_numpy(b.diff).copy() for b in net.blobs.values()] + \
        [backend.to_numpy(p.diff).copy() for p in net.learnable_params]
    return net, losses, out


def test_fused_paths_compute_in_the_lent_buffers(emulated):
    _, la, want = _train_fused(False)
    net, lb, got = _train_fused(True)
    assert la == lb
    assert all(numpy.array_equal(a, b) for a, b in zip(want, got))
    layers = dict(zip(net._layer_names, net.layers))
    assert [(c.bn.layer_param.name, c.scale.layer_param.name) for c in net._fused_chains] == \
        [('bn1', 'sc1')]

    def lent(layer, name):
        return caffe1.held(layers[layer])[name]
    # BatchNorm's normalized copy, max pooling's argmax (ceil-rounded windows: not
    # cuDNN's), the out-of-chain Scale's bottom copy, Dropout's mask: in Caffe's buffers
    assert numpy.shares_memory(layers['bn3']._x_norm, lent('bn3', 'x_norm_'))
    assert numpy.shares_memory(layers['bn1']._x_norm, lent('bn1', 'x_norm_'))
    assert numpy.shares_memory(layers['pool1'].pool.arg, lent('pool1', 'max_idx_'))
    assert numpy.shares_memory(layers['sc2']._bottom_copy, lent('sc2', 'temp_'))
    assert numpy.shares_memory(layers['drop'].mask, lent('drop', 'rand_vec_'))
    assert lent('bn3', 'x_norm_').any() and lent('pool1', 'max_idx_').any()


def test_time_passes_run_the_chains_backward(emulated):
    """caffeplus time's timed passes reset the fused chains per pass, so the
    chain's backward runs every iteration (it was skipped after the first)."""
    from caffeplus.commands import time as time_cmd
    caffeplus.set_random_seed(3)
    net = small_net(text=FUSED)
    net.forward_prefilled()
    net.backward_all()
    net.clear_param_diffs()
    n = len(net.layers)
    timer = time_cmd._Timer()
    caffeplus.set_random_seed(9)            # the same data and dropout masks below
    time_cmd._forward_pass(net, timer, [0] * n)
    time_cmd._backward_pass(net, timer, [0] * n)
    assert net._fused_chains[0].bwd_done
    got = [backend.to_numpy(p.diff).copy() for p in net.learnable_params]
    net.clear_param_diffs()
    caffeplus.set_random_seed(9)
    net.forward_prefilled()
    net.backward_all()
    want = [backend.to_numpy(p.diff).copy() for p in net.learnable_params]
    assert all(numpy.array_equal(a, b) for a, b in zip(got, want))


# -- caffeplus time --memory ---------------------------------------------------------------
def test_time_memory_flag_parsing():
    from caffeplus.cli import build_parser, normalize_flags
    from caffeplus.commands import time as time_cmd
    from caffeplus.errors import CaffeplusError
    args = build_parser().parse_args(normalize_flags(['time', '-model', 'm', '-memory',
                                                      'stock']))
    assert args.memory == 'stock'
    assert build_parser().parse_args(['time', '--model', 'm']).memory == ''
    assert time_cmd.parse_memory('') is None and time_cmd.parse_memory(None) is None
    assert time_cmd.parse_memory('Shared') == 'shared'
    with pytest.raises(CaffeplusError, match="unknown memory plan 'tiny'"):
        time_cmd.parse_memory('tiny')


def _lenet(tmp_path):
    src = os.path.join(REFERENCE, 'cli', 'lenet_dummy_b64.prototxt')
    if not os.path.exists(src):
        pytest.fail('test data missing: %s' % src)
    return src


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize('plan', ['stock', 'shared', 'offload'])
def test_time_memory_runs_each_plan(tmp_path, plan):
    from caffeplus import log
    from caffeplus.cli import main
    cap = _Messages()
    log.logger.addHandler(cap)
    try:
        assert main(['time', '-model', _lenet(tmp_path), '-iterations', '2',
                     '-memory', plan]) == 0
    finally:
        log.logger.removeHandler(cap)
    assert 'Memory plan: %s' % plan in cap.messages
    assert '*** Benchmark ends ***' in cap.messages


def test_time_memory_unknown_plan(tmp_path, capsys):
    from caffeplus.cli import main
    assert main(['time', '-model', _lenet(tmp_path), '-memory', 'bogus']) == 1
    assert "unknown memory plan 'bogus'" in capsys.readouterr().err


# -- benchmarks/bench_stock_memory.py (with stand-ins for nvidia-smi and caffeplus) -------------
def _script(path, text):
    path.write_text('#!%s\n%s' % (sys.executable, text))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


FAKE_SMI = '''import sys, time
args = sys.argv[1:]
if any(a.startswith('--query-gpu=name') for a in args):
    print('Fake GPU, 81559 MiB'); sys.exit(0)
if '-lms' in args:
    v = 100
    try:
        while True:
            print(v, flush=True); v = min(v + 700, 2800); time.sleep(0.02)
    except KeyboardInterrupt:
        sys.exit(0)
print(100)
'''
FAKE_CAFFEPLUS = '''import sys, time
model = sys.argv[sys.argv.index('-model') + 1]
assert sys.argv[1:4] == ['-m', 'caffeplus', 'time'] and '--memory' in sys.argv
if 'googlenet' in model:
    print('out of GPU memory in layer x', file=sys.stderr); sys.exit(1)
time.sleep(3600 if 'vgg16_b64' in model else 0.4)   # VGG: until the timeout kills it
print('I1122 time.py] Average Forward-Backward: 12.5 ms.')
'''


def test_bench_stock_memory_script(tmp_path, monkeypatch, capsys):
    if not os.path.exists(os.path.join(BENCH, 'README.md')):
        pytest.fail('test data missing')
    sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
    import bench_stock_memory as bench
    fake = tmp_path / 'bin'
    fake.mkdir()
    _script(fake / 'nvidia-smi', FAKE_SMI)
    py = _script(tmp_path / 'fakepy', FAKE_CAFFEPLUS)
    monkeypatch.setenv('PATH', str(fake) + os.pathsep + os.environ['PATH'])
    out_json, out_md = tmp_path / 'o.json', tmp_path / 'o.md'
    rc = bench.main(['alexnet_b128', 'GoogLeNet b64', 'vgg16_b64', 'nope', '--bench-dir', BENCH,
                     '--python', py, '--timeout', '10', '--settle', '0.5', '--interval-ms', '20',
                     '--json', str(out_json), '--md', str(out_md),
                     '--log-dir', str(tmp_path / 'logs')])
    assert rc == 1
    doc = json.loads(out_json.read_text())
    r = {x['net']: x for x in doc['results']}
    assert list(r) == ['AlexNet b128', 'GoogLeNet b64', 'VGG-16 b64', 'nope']
    alex = r['AlexNet b128']
    assert alex['peak_mib'] == 2800 and alex['caffe_mib'] == 2781 and alex['pass']
    assert alex['ratio'] == pytest.approx(2800 / 2781, abs=1e-4) and alex['fwd_bwd_ms'] == 12.5
    assert alex['samples'] > 3 and alex['baseline_mib'] == 100
    assert not r['GoogLeNet b64']['pass'] and 'out of GPU memory' in r['GoogLeNet b64']['error']
    assert r['VGG-16 b64']['timed_out'] and 'timed out' in r['VGG-16 b64']['error']
    assert 'no prototxt' in r['nope']['error']
    md = out_md.read_text()
    assert '| AlexNet b128 | 2,800 MiB | 2,781 MiB | 1.007 | yes |' in md
    assert '1 of 4 nets within 5% of stock Caffe' in capsys.readouterr().out


def test_bench_stock_memory_peak_phases():
    """The peak is split at the timed iterations' start and placed after the
    last output line that arrived before its sample."""
    sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
    import bench_stock_memory as bench
    lines = [(1.0, 'Performing Forward'), (2.0, 'Initial loss: 6.9'),
             (3.0, '*** Benchmark begins ***'), (4.0, 'Iteration: 1 forward-backward time')]
    trace = [(0.5, 500), (1.5, 2400), (2.5, 1900), (3.5, 2000), (4.5, 1990)]
    got = bench.peak_phases(trace, lines)
    assert got == {'setup_peak_mib': 2400, 'timed_peak_mib': 2000,
                   'peak_after': 'Performing Forward'}
    # A run that never reached the timed iterations: all of it is setup.
    got = bench.peak_phases(trace, lines[:2])
    assert got['setup_peak_mib'] == 2400 and got['timed_peak_mib'] is None
    assert bench.peak_phases([], [])['peak_after'] is None


def test_bench_readme_table():
    sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
    import bench_stock_memory as bench
    path = os.path.join(BENCH, 'README.md')
    if not os.path.exists(path):
        pytest.fail('test data missing')
    with open(path) as f:
        rows = dict(bench.parse_readme(f.read()))
    assert rows == {'AlexNet b128': 2781, 'GoogLeNet b64': 7835, 'VGG-16 b64': 10009,
                    'ResNet-50 b32': 14023, 'ResNet-50 b64': 24503, 'VGG-16 b256': 33331}
    assert bench.net_key('ResNet-50 b32') == bench.net_key('resnet50_b32.prototxt')


# -- on the GPU -----------------------------------------------------------------------------
GPU_NET = FUSED.replace('name: "fused"', 'name: "gpu"').replace(
    'layer { name: "fc"',
    'layer { name: "pave" type: "Pooling" bottom: "bn3" top: "pave" '
    'pooling_param { pool: AVE kernel_size: 2 stride: 1 } }\n'
    'layer { name: "fc"').replace('bottom: "bn3" top: "fc"', 'bottom: "pave" top: "fc"')


def _gpu_run(plan, iters=2):
    caffeplus.set_mode_gpu()
    caffeplus.set_random_seed(7)
    param = caffe_pb2.NetParameter()
    text_format.Parse(GPU_NET, param)
    net = caffeplus.Net(param, caffeplus.TRAIN, memory=plan)
    losses = []
    for _ in range(iters):
        net.clear_param_diffs()
        losses.append(net.forward_prefilled())
        net.backward_all()
    out = {'data ' + k: backend.to_numpy(b.data).copy() for k, b in net.blobs.items()}
    out.update({'diff ' + k: backend.to_numpy(b.diff).copy() for k, b in net.blobs.items()})
    out.update({'pdiff %d' % i: backend.to_numpy(p.diff).copy()
                for i, p in enumerate(net.learnable_params)})
    return net, losses, out


@pytest.mark.gpu
def test_gpu_stock_plan_holds_caffes_buffers():
    import cupy
    try:
        net, _, _ = _gpu_run('stock')
        bufs = caffe1.stock_buffers(net)
        assert {b.name for b in bufs} >= {'temp_', 'x_norm_', 'x_norm_.diff', 'max_idx_',
                                          'rand_vec_', 'prob_', 'prob_.diff'}
        for b in bufs:
            if b.holder != 'caffe1':
                continue
            layer = net.layers[b.layer_index]
            array = caffe1.held(layer)[b.name]
            assert isinstance(array, cupy.ndarray)
            assert array.nbytes == b.nbytes and array.dtype.name == b.dtype
            if b.adopt is not None:
                assert getattr(layer, b.adopt) is array
            declared = getattr(layer, 'internal_buffers', dict)()
            if b.role is not None and b.role in declared:
                # the layer computes in Caffe's buffer (its kept one)
                kept = layer.__dict__[caffe1.KEPT][b.role]
                assert kept.data.ptr == array.data.ptr, (b.layer, b.role)
        for i in caffe1.handle_layers(net):
            assert caffe1.HANDLE in net.layers[i].__dict__
        assert [net.layers[i].layer_param.name for i in caffe1.handle_layers(net)] == \
            ['relu1', 'pave', 'loss']
        # another plan gives them back
        from caffeplus.memory.apply import apply_named_plan
        apply_named_plan(net, 'arena')
        _no_caffe1_state(net)
    finally:
        caffeplus.set_mode_cpu()


@pytest.mark.gpu
def test_gpu_stock_plan_holds_the_bytes():
    import cupy
    try:
        caffeplus.set_mode_gpu()
        param = caffe_pb2.NetParameter()
        text_format.Parse(GPU_NET, param)
        net = caffeplus.Net(param, caffeplus.TRAIN)
        caffe1.detach(net)
        # Garbage of earlier tests collected in between would lower the
        # pool's count (in a full GPU run, 37 KB below `before`).
        gc.collect()
        pool = cupy.get_default_memory_pool()
        before = pool.used_bytes()
        held = caffe1.attach(net)
        grown = pool.used_bytes() - before
        n = sum(1 for b in caffe1.stock_buffers(net) if b.holder == 'caffe1')
        assert held == caffe1.extra_bytes(net)
        assert held <= grown <= held + 512 * n         # CuPy rounds each to 512 bytes
        caffe1.detach(net)
        assert pool.used_bytes() == before
    finally:
        caffeplus.set_mode_cpu()


@pytest.mark.gpu
def test_gpu_stock_results_match_arena():
    try:
        _, la, arena = _gpu_run('arena')
        _, lb, stock = _gpu_run('stock')
    finally:
        caffeplus.set_mode_cpu()
    assert la == pytest.approx(lb, rel=1e-4)
    for key in arena:
        numpy.testing.assert_allclose(stock[key], arena[key], rtol=1e-3, atol=1e-5,
                                      err_msg=key)


@pytest.mark.parametrize('plan,search', [('shared', 'auto'), ('offload', 'auto'),
                                         ('stock', None), ('', None)])
def test_time_searches_as_training_does(tmp_path, monkeypatch, plan, search):
    """On the GPU, `time` with a reusing plan times its convolution algorithms
    as `train` does (so its peak is training's), stock keeps Caffe's rule, and
    the setting is the run's alone."""
    from caffeplus import config
    from caffeplus.cli import main
    from caffeplus.commands import time as time_cmd
    seen = []
    monkeypatch.delenv('CAFFEPLUS_CUDNN_SEARCH', raising=False)
    monkeypatch.setattr(time_cmd, 'parse_gpus', lambda text: [0])
    # The CPU stands in for the GPU: record the search the run would use.
    monkeypatch.setattr(time_cmd, 'use_device', lambda gpus, style: seen.append(
        config.get('cudnn_search')))
    argv = ['time', '-model', _lenet(tmp_path), '-iterations', '1', '-gpu', '0']
    assert main(argv + (['-memory', plan] if plan else [])) == 0
    assert seen == [search or 'heuristic']
    assert config.get('cudnn_search') == 'heuristic'
