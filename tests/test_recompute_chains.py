"""Normalized chains' tops made again in backward from BatchNorm's kept copy
(caffeplus.memory.recompute: BatchNorm -> Scale -> ReLU in place on a
convolution's top, read again by the next convolution's filter call):
which tops, the memory they give back, and training bit-identical to
`stock` on the CPU, through the fused kernels (emulated) and on the GPU."""
import os
import re

import pytest

import caffeplus
from caffeplus import backend, config, kernels, log, precision
from caffeplus.errors import CaffeplusError
from caffeplus.memory import budget, liveness, placement, recompute, shapes
from caffeplus.memory.plan import make_plan
from conftest import SHARED, emulating
from plan_helpers import assert_same_run, param_of, sgd_run

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

# Two residual sums, Scale layers (not in place: their backward reads their
# bottom, as a convolution's filter call does) standing in for the
# convolutions, so that the channels-last kernels run them on the host too:
# x0's chain feeds the first block's branch (c1 -> bn1 -> sc1) and its
# projection (p1 -> bnp -> scp); sum1 = b + a feeds the second block's
# branch (c2 -> bn2 -> sc2) and sum2 = sum1 + a2.
SUM_NET = '''
name: "sums"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { data_filler { type: "gaussian" std: 1 }
                           shape { dim: 4 dim: 8 dim: 3 dim: 5 }
                           data_filler { type: "uniform" min: 0 max: 2.99 } shape { dim: 4 } } }
layer { name: "c0" type: "Scale" bottom: "data" top: "x0"
        scale_param { bias_term: true filler { type: "gaussian" mean: 1 std: 0.3 } } }
layer { name: "bn0" type: "BatchNorm" bottom: "x0" top: "x0" }
layer { name: "sc0" type: "Scale" bottom: "x0" top: "x0"
        scale_param { bias_term: true filler { type: "gaussian" mean: 1 std: 0.3 }
                      bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu0" type: "ReLU" bottom: "x0" top: "x0" }
layer { name: "c1" type: "Scale" bottom: "x0" top: "a"
        scale_param { bias_term: true filler { type: "gaussian" mean: 1 std: 0.3 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "a" top: "a" }
layer { name: "sc1" type: "Scale" bottom: "a" top: "a"
        scale_param { bias_term: true filler { type: "gaussian" mean: 1 std: 0.3 }
                      bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "p1" type: "Scale" bottom: "x0" top: "b"
        scale_param { bias_term: true filler { type: "gaussian" mean: 1 std: 0.3 } } }
layer { name: "bnp" type: "BatchNorm" bottom: "b" top: "b" }
layer { name: "scp" type: "Scale" bottom: "b" top: "b"
        scale_param { bias_term: true filler { type: "gaussian" mean: 1 std: 0.3 }
                      bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "sum1" type: "Eltwise" bottom: "a" bottom: "b" top: "sum1" }
layer { name: "relu1" type: "ReLU" bottom: "sum1" top: "sum1" }
layer { name: "c2" type: "Scale" bottom: "sum1" top: "a2"
        scale_param { bias_term: true filler { type: "gaussian" mean: 1 std: 0.3 } } }
layer { name: "bn2" type: "BatchNorm" bottom: "a2" top: "a2" }
layer { name: "sc2" type: "Scale" bottom: "a2" top: "a2"
        scale_param { bias_term: true filler { type: "gaussian" mean: 1 std: 0.3 }
                      bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "sum2" type: "Eltwise" bottom: "sum1" bottom: "a2" top: "sum2"
        eltwise_param { coeff: 0.5 coeff: 2 } }
layer { name: "relu2" type: "ReLU" bottom: "sum2" top: "sum2" }
layer { name: "pool" type: "Pooling" bottom: "sum2" top: "pool"
        pooling_param { pool: AVE global_pooling: true } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''
SUM_REMADE = {'x0': ['bn0', 'sc0', 'relu0'], 'a': ['bn1', 'sc1'], 'b': ['bnp', 'scp'],
              'sum1': ['sum1', 'relu1'], 'a2': ['bn2', 'sc2'], 'sum2': ['sum2', 'relu2']}


@pytest.fixture(autouse=True)
def _quiet(request, monkeypatch):
    config.set('recompute', '')         # the default: `shared` remakes chains only
    if 'prune' not in request.node.name:
        # These nets are small enough that keeping any one map would not
        # raise their peak, so `shared` would make none again
        # (recompute.prune, tested on its own below).
        monkeypatch.setattr(recompute, 'prunes', lambda: False)
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


def _remade_chains(net, plan):
    names = net._layer_names
    return {key[1][0]: [names[i] for i in recompute.layers_of(chain)]
            for key, chain in plan.recomputed.items()}


def test_residual_sums_are_made_again_from_their_bottoms():
    """sum1 from its two branch tops (each made again from its copy for
    that step), sum2 from sum1 (made again first) and its branch top; the
    branch tops live for that step alone, the sums from the first backward
    read of either."""
    net = _build(_param(SUM_NET))
    plan = make_plan(net, 'shared')
    assert _remade_chains(net, plan) == SUM_REMADE
    lives = {b.key[1][0]: (b.start, b.end) for b in plan.buffers
             if b.kind == 'data' and b.key[-1] == 'again'}
    L = len(net.layers)
    back = lambda name: 2 * L - 1 - net._layer_names.index(name)
    # sum2's first backward read: relu2's; sum1's own, c2's filter call,
    # comes later, so sum1 comes back with sum2.
    assert lives['sum2'][0] == lives['sum1'][0] == back('relu2') - 0.5
    assert lives['a2'] == lives['a'] == lives['b'] == (lives['sum2'][0],) * 2
    assert lives['x0'][0] == back('p1') - 0.5
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


def test_resnet50_remakes_every_chain_and_sum_it_can():
    """ResNet-50 (the GPU's layers, shapes only): the top of every
    BatchNorm -> Scale -> ReLU chain (conv1's, read by pool1's backward, and
    each block's branch2a and branch2b) and every block's sum, with the
    branch tops (branch2c, and branch1 where a stage starts) made again for
    their sums; at batch 256 in FLOAT16 3.5 GB less than with the setting off."""
    param = shapes.load_net_param(_bench('resnet50_b64'), batch=256)
    precision.override(param, 'fp16')
    net = shapes.build_net(param)
    plan = make_plan(net, 'shared')
    chains = _remade_chains(net, plan)
    blocks = [n[3:] for n in net._layer_names if n.startswith('res') and '_' not in n]
    assert len(blocks) == 16
    sums = {'res' + b for b in blocks}
    branches = {'res%s_branch%s' % (b, k) for b in blocks for k in ('2a', '2b', '2c')} | \
        {'res%sa_branch1' % s for s in '2345'}
    assert set(chains) == {'conv1'} | sums | branches
    assert all(chains['res' + b] == ['res' + b, 'res%s_relu' % b] for b in blocks)
    assert chains['res3a_branch1'] == ['bn3a_branch1', 'scale3a_branch1']
    # The estimate (BatchNorm's kept copies placed too): 10.53 GiB off.
    on = budget.estimate_plan(net, 'shared').peak_bytes
    config.set('recompute', '0')
    off = budget.estimate_plan(net, 'shared').peak_bytes
    assert off - on > 3.4e9 and on < 0.7 * off


def test_prune_keeps_each_group_whose_remaking_does_not_lower_the_peak():
    """recompute.prune, with a peak given as a function of what is made
    again: sum2 goes with a2 (made again only for it), sum1 with a and b;
    largest first, a group stays made again only where dropping it would
    raise the peak."""
    net = _build(_param(SUM_NET))
    bufs = liveness.buffers(net)
    chosen = recompute.choose(net, bufs, remakes_only=True)
    name = {key: key[1][0] for key in chosen}
    groups = [sorted(name[k] for k in g) for g in recompute.groups(net, bufs, chosen)]
    assert sorted(groups) == [['a', 'b', 'sum1'], ['a2', 'sum2'], ['x0']]
    # Only sum2's group lowers the peak; x0's dropped raises it by nothing.
    tried = []

    def peak_of(c):
        tried.append(sorted(name[k] for k in chosen if k not in c))
        return 100 - 10 * any(name[k] == 'sum2' for k in c)
    kept = recompute.prune(net, bufs, chosen, peak_of)
    assert sorted(name[k] for k in kept) == ['a2', 'sum2']
    # The whole choice first, then each group largest first (sum1's three maps).
    assert tried[0] == [] and tried[1] == ['a', 'b', 'sum1']
    assert recompute.prune(net, bufs, {}, peak_of) == {}


def test_prune_keeps_resnet50s_maps_that_are_not_at_its_peak():
    """ResNet-50 b256 in FLOAT16 (shapes only, the estimate's plan: its
    workspace and BatchNorm's kept copies placed too): stage 5's chains and
    sums are made again at no gain in peak and stay kept; stage 4's first
    sums, made again, would come back together in backward above the
    forward's peak, and stay kept too. The peak falls by more than 300 MB, fewer bytes
    are written again, and each group that stays made again is one whose
    keeping would raise the placed bytes' bound."""
    param = shapes.load_net_param(_bench('resnet50_b64'), batch=256)
    precision.override(param, 'fp16')
    net = shapes.build_net(param)
    pruned = budget.estimate_plan(net, 'shared')
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recompute, 'prunes', lambda: False)
        every = budget.estimate_plan(net, 'shared')
    assert set(pruned.recomputed) < set(every.recomputed)
    # The runtime's plan (no kept buffers given: it places them itself)
    # weighs them as the model does, and chooses as the estimate.
    assert set(make_plan(net, 'shared').recomputed) == set(pruned.recomputed)
    assert set(make_plan(net, 'shared', param_diffs=True).recomputed) == set(pruned.recomputed)
    made = {key[1][0] for key in pruned.recomputed}
    assert not any(n.startswith('res5') for n in made)
    assert {'conv1', 'res2c', 'res3d', 'res4b_branch2a'} <= made
    assert every.peak_bytes - pruned.peak_bytes > 300e6
    whole = liveness.buffers(net)
    assert recompute.remake_passes(whole, pruned.recomputed)[0] < \
        0.9 * recompute.remake_passes(whole, every.recomputed)[0]
    assert pruned.est_iter_ms < every.est_iter_ms
    bound = lambda plan: placement.live_bound(plan.buffers)
    for group in recompute.groups(net, whole, pruned.recomputed):
        names = {k[1][0] for k in group}
        if not names & {'conv1', 'res2c', 'res3d', 'res4b_branch2a'}:
            continue        # (a sample: each estimate takes a second)
        less = {k: v for k, v in pruned.recomputed.items() if k not in group}
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(recompute, 'choose', lambda *a, **k: less)
            mp.setattr(recompute, 'prunes', lambda: False)
            assert bound(budget.estimate_plan(net, 'shared')) > bound(pruned), names


# -- running ---------------------------------------------------------------------------------
@pytest.mark.parametrize('types', [None, 'fp16', 'bf16'])
def test_training_with_chains_made_again_is_bit_identical_to_stock(types):
    param = _param(types=types)
    stock = sgd_run(_build(param))
    net = _build(param, memory='shared')
    assert _remade(net.applied_plan.plan) == ['conv1', 'conv2']
    shared = sgd_run(net)
    assert_same_run(stock, shared)


def test_a_chain_top_made_again_is_released_in_between_and_says_so():
    net = _build(_param(), memory='shared')
    net.forward()
    with pytest.raises(CaffeplusError, match='layer bn1 makes it again'):
        net.blobs['conv1'].data
    net.backward()
    kept = caffeplus.Net(_param(), caffeplus.TRAIN, memory='shared', keep=['conv1'])
    assert _remade(kept.applied_plan.plan) == ['conv2']


def _train_emulated(memory, nhwc=False, types=None, iters=3, text=CHAIN_NET):
    """Training through the GPU layers' fused kernels (emulated on the host)."""
    from caffeplus.layers import fused_chain
    calls = []
    real = fused_chain.GPUBatchNormLayer.remake_chain_top
    real_sum = fused_chain.GPUEltwiseLayer.remake_with_branch

    def counted(self, real=real):
        done = real(self)
        calls.append((self.name, done))
        return done
    fused_chain.GPUBatchNormLayer.remake_chain_top = counted
    fused_chain.GPUEltwiseLayer.remake_with_branch = \
        lambda self: counted(self, real=real_sum)
    try:
        net = _build(_param(text, types=types), memory='stock' if memory != 'stock' else None)
        if nhwc:
            for name, blob in net.blobs.items():
                if blob.num_axes == 4 and name not in ('data', 'pool'):
                    blob.layout = 'NHWC'
            net.reshape()
        if memory != 'stock':
            from caffeplus.memory.apply import apply_named_plan
            apply_named_plan(net, memory, training=True)
        losses, params = sgd_run(net, iters=iters)
        fused = [(c.fwd_done, c.bwd_done) for c in net._fused_chains]
        return losses, params, calls, fused
    finally:
        fused_chain.GPUBatchNormLayer.remake_chain_top = real
        fused_chain.GPUEltwiseLayer.remake_with_branch = real_sum


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
    assert_same_run(stock, shared)


@pytest.mark.parametrize('types', [None, 'fp16', 'bf16'])
def test_training_with_sums_made_again_is_bit_identical_to_stock(types):
    param = _param(SUM_NET, types=types)
    stock = sgd_run(_build(param))
    net = _build(param, memory='shared')
    assert _remade_chains(net, net.applied_plan.plan) == SUM_REMADE
    shared = sgd_run(net)
    assert_same_run(stock, shared)
    net.forward()
    with pytest.raises(CaffeplusError, match='layer sum1 makes it again'):
        net.blobs['sum1'].data


@pytest.mark.parametrize('nhwc', [False, True])
def test_fused_sums_made_again_give_the_forwards_bits_emulated(emulator, nhwc):
    """Through the fused kernels: the branch tops by the identity-statistics
    pass, the sums by their Eltwise -> ReLU chains' one pass; channels-last,
    each sum and the branch paired with it (bnp -> scp for sum1, bn2 -> sc2
    for sum2) in the one normalize-and-add pass the forward ran, the other
    branch (bn1) first on its own. Every chain fused both ways, training
    bit for bit `stock`'s."""
    with emulating(emulator):
        stock = _train_emulated('stock', nhwc, text=SUM_NET)
        shared = _train_emulated('shared', nhwc, text=SUM_NET)
    assert all(done == (True, True) for done in shared[3]) and shared[3] == stock[3]
    per_iteration = [('bn1', True), ('sum1', True), ('sum2', True), ('bn0', True)] if nhwc \
        else [('bn1', True), ('sum1', False), ('bnp', True), ('sum2', False), ('bn2', True),
              ('bn0', True)]
    assert shared[2] == per_iteration * 3 and stock[2] == []
    assert_same_run(stock, shared)


def _keeping(monkeypatch, kept):
    """`shared`'s prune keeps the groups holding the maps named in `kept`
    and makes the rest again (the mixes a real net's peak leads to)."""
    monkeypatch.setattr(recompute, 'prunes', lambda: True)

    def prune(net, bufs, chosen, peak_of):
        drop = {k for g in recompute.groups(net, bufs, chosen) for k in g
                if any(key[1][0] in kept for key in g)}
        return {k: v for k, v in chosen.items() if k not in drop}
    monkeypatch.setattr(recompute, 'prune', prune)


@pytest.mark.parametrize('kept', ['sum1', 'sum2', 'x0'])
def test_prune_mixes_of_kept_and_remade_sums_train_as_stock(monkeypatch, emulator, kept):
    """sum2 made again from sum1 kept, sum1 made again with sum2 kept, or
    x0's chain kept: on the host and through the fused kernels
    channels-last, training stays bit for bit `stock`'s."""
    param = _param(SUM_NET)
    stock = sgd_run(_build(param))
    _keeping(monkeypatch, {kept})
    net = _build(param, memory='shared')
    made = _remade_chains(net, net.applied_plan.plan)
    group = {'sum1': {'sum1', 'a', 'b'}, 'sum2': {'sum2', 'a2'}, 'x0': {'x0'}}[kept]
    assert set(made) == set(SUM_REMADE) - group
    assert_same_run(stock, sgd_run(net))
    with emulating(emulator):
        fused_stock = _train_emulated('stock', True, text=SUM_NET)
        fused = _train_emulated('shared', True, text=SUM_NET)
    assert fused[2] and all(done == (True, True) for done in fused[3])
    assert_same_run(fused_stock, fused)


def test_unfused_chains_are_made_again_by_their_layers_emulated(emulator):
    """A hook that watches the layers keeps the chains unfused: the remake
    then runs the layers' own forwards, with the same bits."""
    def train(memory):
        net = _build(_param(), memory=memory)
        net.after_layer_forward.append(lambda i: None)
        return sgd_run(net, iters=3)
    with emulating(emulator):
        stock, shared = train(None), train('shared')
    assert_same_run(stock, shared)


def _with_convolutions(text, channels=32):
    """SUM_NET with its stand-in Scale layers made 3x3 convolutions."""
    for name in ('c0', 'c1', 'p1', 'c2'):
        head = 'layer { name: "%s" type: "Scale"' % name
        start = text.index(head)
        end = text.index('} } }', start) + 5
        bottom, top = re.search(r'bottom: "(\w+)" top: "(\w+)"', text[start:end]).groups()
        text = text[:start] + (
            'layer { name: "%s" type: "Convolution" bottom: "%s" top: "%s" '
            'convolution_param { num_output: %d kernel_size: 3 pad: 1 bias_term: false '
            'weight_filler { type: "gaussian" std: 0.05 } } }' % (name, bottom, top, channels)) \
            + text[end:]
    return text.replace('dim: 4 dim: 8 dim: 3 dim: 5', 'dim: 16 dim: %d dim: 16 dim: 16'
                        % channels).replace(
        'shape { dim: 4 }', 'shape { dim: 16 }')


def test_the_gpu_residual_net_remakes_what_the_host_one_does():
    param = _param(_with_convolutions(SUM_NET))
    net = _build(param)
    assert [layer.layer_param.type for layer in net.layers].count('Convolution') == 4
    assert _remade_chains(net, make_plan(net, 'shared')) == SUM_REMADE


@pytest.mark.gpu
@pytest.mark.parametrize('types, layout', [(None, 'nchw'), ('fp16', 'nchw'), ('fp16', 'nhwc'),
                                           ('bf16', 'nhwc')])
def test_gpu_sums_made_again_are_bit_identical(types, layout):
    """A two-block residual net of convolutions on the GPU, `shared` (every
    chain and sum made again) against `arena`, deterministic math, bit for
    bit; channels-last through the normalize-and-add pass."""
    import sys
    from conftest import ROOT
    sys.path.insert(0, ROOT)
    from dev import check_plans_equal as cpe
    param = _param(_with_convolutions(SUM_NET), types=types)
    with config.using(layout=layout):
        arena, shared = [cpe.train(param, plan, 6, 0, gpu=0, math='deterministic')
                         for plan in ('arena', 'shared')]
    assert not cpe.differences(arena, shared), cpe.differences(arena, shared)


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
        # cuDNN's max pooling backward reads its bottom (gpu_backward_reads),
        # so on the GPU conv3's top is read again too and made again.
        assert _remade(make_plan(net, 'shared')) == ['conv1', 'conv2', 'conv3']
        assert kernels.active()
    finally:
        backend.set_mode_cpu()
