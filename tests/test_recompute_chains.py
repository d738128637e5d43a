"""Normalized chains' tops made again in backward from BatchNorm's kept copy
(caffeplus.memory.recompute: BatchNorm -> Scale -> ReLU in place on a
convolution's top, read again by the next convolution's filter call):
which tops, the memory they give back, and training bit-identical to
`stock` on the CPU, through the fused kernels (emulated) and on the GPU."""
import os

import numpy
import pytest

import caffeplus
from caffeplus import backend, config, kernels, log, precision
from caffeplus.errors import CaffeplusError
from caffeplus.memory import recompute, shapes
from caffeplus.memory.plan import make_plan
from conftest import SHARED, emulating
from plan_helpers import param_of, sgd_run

# conv1 -> bn1 -> sc1 -> relu1 (in place): conv2's filter call reads it in
# backward; conv2 -> bn2 -> relu2 (no Scale): conv3's; conv3 -> bn3 -> sc3
# (no ReLU) feeds the pooling, whose backward reads only its argmax.
CHAIN_NET = '''
name: "chains"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { data_filler { type: "gaussian" std: 1 }
                           shape { dim: 4 dim: 3 dim: 12 dim: 12 }
                           data_filler { type: "uniform" min: 0 max: 2.99 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 bias_term: false
                            weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "sc1" type: "Scale" bottom: "conv1" top: "conv1"
        scale_param { bias_term: true filler { type: "gaussian" mean: 1 std: 0.3 }
                      bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 bias_term: false
                            weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn2" type: "BatchNorm" bottom: "conv2" top: "conv2" }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "conv3" type: "Convolution" bottom: "conv2" top: "conv3"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 bias_term: false
                            weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn3" type: "BatchNorm" bottom: "conv3" top: "conv3" }
layer { name: "sc3" type: "Scale" bottom: "conv3" top: "conv3" scale_param { bias_term: true } }
layer { name: "pool" type: "Pooling" bottom: "conv3" top: "pool"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''


@pytest.fixture(autouse=True)
def _quiet():
    config.set('recompute', '')         # the default: `shared` remakes chains only
    level = log.logger.level
    log.logger.setLevel(30)
    yield
    log.logger.setLevel(level)
    config.set('recompute', '')


def _param(text=CHAIN_NET, types=None, batch=None):
    param = param_of(text if batch is None else text.replace(
        'dim: 4 dim: 3 dim: 12 dim: 12', 'dim: %d dim: 3 dim: 12 dim: 12' % batch).replace(
            'shape { dim: 4 }', 'shape { dim: %d }' % batch))
    if types:
        precision.override(param, types)
    return param


def _build(param, memory=None):
    caffeplus.set_random_seed(5)
    return caffeplus.Net(param, caffeplus.TRAIN, memory=memory)


def _remade(plan):
    return sorted(n for key, chain in plan.recomputed.items() if recompute.is_remake(chain)
                  for n in key[1])


def _bench(name):
    path = os.path.join(SHARED, 'bench', name + '.prototxt')
    if not os.path.exists(path):
        pytest.fail('test data missing: %s' % path)
    return path


# -- which tops ------------------------------------------------------------------------
def test_the_tops_a_convolution_reads_again_are_made_again_from_the_copy():
    net = _build(_param())
    plan = make_plan(net, 'shared')
    assert _remade(plan) == ['conv1', 'conv2']
    names = net._layer_names
    chains = {key[1][0]: [names[i] for i in recompute.layers_of(chain)]
              for key, chain in plan.recomputed.items()}
    assert chains == {'conv1': ['bn1', 'sc1', 'relu1'], 'conv2': ['bn2', 'relu2']}
    # Nothing else in `shared`; nothing at all with the setting off.
    assert all(recompute.is_remake(c) for c in plan.recomputed.values())
    config.set('recompute', '0')
    assert not make_plan(net, 'shared').recomputed


def test_a_chain_without_a_kept_copy_or_with_another_writer_is_kept():
    # Global statistics keep no normalized copy; a Dropout after the ReLU
    # writes the top last.
    frozen = CHAIN_NET.replace('layer { name: "bn1" type: "BatchNorm" bottom: "conv1" '
                               'top: "conv1" }',
                               'layer { name: "bn1" type: "BatchNorm" bottom: "conv1" '
                               'top: "conv1" batch_norm_param { use_global_stats: true } }')
    assert frozen != CHAIN_NET
    assert _remade(make_plan(_build(_param(frozen)), 'shared')) == ['conv2']
    dropped = CHAIN_NET.replace(
        'layer { name: "conv2" type: "Convolution"',
        'layer { name: "drop1" type: "Dropout" bottom: "conv1" top: "conv1" }\n'
        'layer { name: "conv2" type: "Convolution"')
    assert _remade(make_plan(_build(_param(dropped)), 'shared')) == ['conv2']


def test_resnet50_remakes_every_convolution_chain_it_can():
    """ResNet-50 (the GPU's layers, shapes only): the top of every
    BatchNorm -> Scale -> ReLU chain a convolution reads again (conv1's is
    read by pool1's backward, made again as well), none of the branch tops
    the Eltwise reads, nor the sums; at batch 256 in FLOAT16 1.7 GB less
    than with the setting off."""
    param = shapes.load_net_param(_bench('resnet50_b64'), batch=256)
    precision.override(param, 'fp16')
    net = shapes.build_net(param)
    plan = make_plan(net, 'shared')
    remade = _remade(plan)
    assert len(remade) == 33 and 'conv1' in remade
    assert all(n.endswith(('branch2a', 'branch2b')) for n in remade if n != 'conv1')
    config.set('recompute', '0')
    off = make_plan(net, 'shared')
    assert off.peak_bytes - plan.peak_bytes > 1.6e9


# -- running ---------------------------------------------------------------------------------
@pytest.mark.parametrize('types', [None, 'fp16', 'bf16'])
def test_training_with_chains_made_again_is_bit_identical_to_stock(types):
    param = _param(types=types)
    stock = sgd_run(_build(param))
    net = _build(param, memory='shared')
    assert _remade(net.applied_plan.plan) == ['conv1', 'conv2']
    shared = sgd_run(net)
    assert stock[0] == shared[0]
    assert all(numpy.array_equal(a, b) for a, b in zip(stock[1], shared[1]))


def test_a_chain_top_made_again_is_released_in_between_and_says_so():
    net = _build(_param(), memory='shared')
    net.forward()
    with pytest.raises(CaffeplusError, match='layer bn1 makes it again'):
        net.blobs['conv1'].data
    net.backward()
    kept = caffeplus.Net(_param(), caffeplus.TRAIN, memory='shared', keep=['conv1'])
    assert _remade(kept.applied_plan.plan) == ['conv2']


def _train_emulated(memory, nhwc=False, types=None, iters=3):
    """Training through the GPU layers' fused kernels (emulated on the host)."""
    from caffeplus.layers import fused_chain
    calls = []
    real = fused_chain.GPUBatchNormLayer.remake_chain_top

    def counted(self):
        done = real(self)
        calls.append((self.name, done))
        return done
    fused_chain.GPUBatchNormLayer.remake_chain_top = counted
    try:
        net = _build(_param(types=types), memory='stock' if memory != 'stock' else None)
        if nhwc:
            for name in ('conv1', 'conv2', 'conv3'):
                net.blobs[name].layout = 'NHWC'
            net.reshape()
        if memory != 'stock':
            from caffeplus.memory.apply import apply_named_plan
            apply_named_plan(net, memory, training=True)
        losses, params = sgd_run(net, iters=iters)
        fused = [(c.fwd_done, c.bwd_done) for c in net._fused_chains]
        return losses, params, calls, fused
    finally:
        fused_chain.GPUBatchNormLayer.remake_chain_top = real


@pytest.mark.parametrize('nhwc', [False, True])
def test_fused_chains_made_again_give_the_forwards_bits_emulated(emulator, nhwc):
    """The fused pass with identity statistics writes what the chain's fused
    forward wrote: training under `shared` (conv1's top made again by the
    kernels each iteration; conv2's, whose BatchNorm -> ReLU is no fused
    chain, by its layers) equals `stock`'s bit for bit, NCHW and
    channels-last. (The 16-bit builds of those launches:
    test_half_kernels.py; on the host a 16-bit net runs its layers one by
    one, as test_training_with_chains_made_again_is_bit_identical_to_stock.)"""
    with emulating(emulator):
        stock = _train_emulated('stock', nhwc)
        shared = _train_emulated('shared', nhwc)
    assert shared[3] == stock[3] and shared[3][0] == (True, True)
    assert shared[2] == [('bn2', False), ('bn1', True)] * 3 and stock[2] == []
    assert stock[0] == shared[0]
    assert all(numpy.array_equal(a, b) for a, b in zip(stock[1], shared[1]))


def test_unfused_chains_are_made_again_by_their_layers_emulated(emulator):
    """A hook that watches the layers keeps the chains unfused: the remake
    then runs the layers' own forwards, with the same bits."""
    def train(memory):
        net = _build(_param(), memory=memory)
        net.after_layer_forward.append(lambda i: None)
        return sgd_run(net, iters=3)
    with emulating(emulator):
        stock, shared = train(None), train('shared')
    assert stock[0] == shared[0]
    assert all(numpy.array_equal(a, b) for a, b in zip(stock[1], shared[1]))


@pytest.mark.gpu
@pytest.mark.parametrize('types', [None, 'fp16', 'bf16'])
def test_gpu_chains_made_again_are_bit_identical(types):
    """On the GPU, against `arena` (nothing made again), deterministic math."""
    import sys
    from conftest import ROOT
    sys.path.insert(0, ROOT)
    from dev import check_plans_equal as cpe
    param = _param(CHAIN_NET.replace('num_output: 8', 'num_output: 32'), types=types, batch=32)
    arena, shared = [cpe.train(param, plan, 6, 0, gpu=0, math='deterministic')
                     for plan in ('arena', 'shared')]
    assert not cpe.differences(arena, shared), cpe.differences(arena, shared)
    backend.set_mode_gpu(0)
    try:
        net = shapes.build_net(param, virtual=False)
        assert _remade(make_plan(net, 'shared')) == ['conv1', 'conv2']
        assert kernels.active()
    finally:
        backend.set_mode_cpu()
