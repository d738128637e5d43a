"""Maps made again in backward (caffeplus.memory.recompute): which ones, the
memory they give back, and training that stays bit-identical to stock."""
import math
import os
import sys

import numpy
import pytest

import caffeplus
from caffeplus import config
from caffeplus import log
from caffeplus.errors import CaffeplusError
from caffeplus.memory import budget, liveness, recompute, shapes
from caffeplus.memory.plan import make_plan
from plan_helpers import assert_same_run, param_of, sgd_run
from conftest import ROOT, SHARED

sys.path.insert(0, ROOT)
from dev import check_plans_equal as cpe  # noqa: E402

# conv1 -> ReLU -> LRN -> conv2: conv2's backward reads the LRN's output,
# the LRN's backward its input (conv1), so norm1 can be made again from
# conv1 just before conv2's backward.
LRN_NET = '''
name: "lrn"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { data_filler { type: "gaussian" std: 1 }
                           shape { dim: 4 dim: 3 dim: 14 dim: 14 }
                           data_filler { type: "uniform" min: 0 max: 2.99 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1"
        lrn_param { local_size: 5 alpha: 0.1 beta: 0.75 } }
layer { name: "conv2" type: "Convolution" bottom: "norm1" top: "conv2"
        convolution_param { num_output: 8 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "conv3" type: "Convolution" bottom: "conv2" top: "conv3"
        convolution_param { num_output: 4 kernel_size: 3 stride: 2
                            weight_filler { type: "xavier" } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv3" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    # Most cases here plan `shared`, which makes maps again only when asked.
    config.set('recompute', '1')
    level = log.logger.level
    log.logger.setLevel(30)
    yield
    log.logger.setLevel(level)


def bench_path(name):
    path = os.path.join(SHARED, 'bench', name + '.prototxt')
    if not os.path.exists(path):
        pytest.fail('test data missing: %s' % path)
    return path


def build(text=LRN_NET, memory=None, keep=None, seed=3):
    caffeplus.set_random_seed(seed)
    return caffeplus.Net(param_of(text), caffeplus.TRAIN, memory=memory, keep=keep)


def chosen_names(net, keep=(), offloaded=()):
    bufs = liveness.buffers(net, keep=keep)
    return {n for key in recompute.choose(net, bufs, True, offloaded) for n in key[1]}


# -- which maps ------------------------------------------------------------------------------
def test_an_lrn_output_read_again_by_a_convolution_is_made_again(monkeypatch):
    net = build()
    assert chosen_names(net) == {'norm1'}
    plan = make_plan(net, 'shared')
    lives = [b for b in plan.buffers if b.blobs == ('norm1',) and b.kind == 'data']
    L = len(net.layers)
    conv2 = net._layer_names.index('conv2')
    # Until conv2's forward, then from (half a step before) conv2's backward.
    back = 2 * L - 1 - conv2        # (the CPU's LRN backward reads its input only)
    assert [(b.start, b.end) for b in lives] == [
        (conv2 - 1, conv2), (back - liveness.FILTER_FIRST, back)]
    # Not when kept, not under the plans that keep everything, not when off.
    assert chosen_names(net, keep=('norm1',)) == set()
    assert not make_plan(net, 'stock').recomputed and not make_plan(net, 'arena').recomputed
    config.set('recompute', '0')
    assert chosen_names(net) == set() and not make_plan(net, 'shared').recomputed


def test_what_offload_moves_is_not_made_again():
    net = build()
    bufs = liveness.buffers(net)
    norm1 = [b.key for b in bufs if b.blobs == ('norm1',) and b.kind == 'data']
    conv1 = [b.key for b in bufs if b.blobs == ('conv1',) and b.kind == 'data']
    assert chosen_names(net, offloaded=norm1) == set()
    # Nor a map whose producer's input is offloaded (it would not be there).
    assert chosen_names(net, offloaded=conv1) == set()
    plan = make_plan(net, 'offload', offload_policy='conv')     # conv2's input: norm1
    assert any(k[1] == ('norm1',) for k in plan.offloaded) and not plan.recomputed


# The LRN reads one of two Split tops (which share conv1's memory); the
# other branch runs a convolution on it, after a TanH in place on it when
# `late` is set.
SPLIT_NET = LRN_NET.replace(
    'layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1"',
    'layer { name: "split" type: "Split" bottom: "conv1" top: "a" top: "b" }\n'
    'layer { name: "norm1" type: "LRN" bottom: "a" top: "norm1"').replace(
    'layer { name: "ip" type: "InnerProduct" bottom: "conv3"',
    'layer { name: "conv3b" type: "Convolution" bottom: "b" top: "conv3b"\n'
    '        convolution_param { num_output: 4 kernel_size: 5 stride: 2\n'
    '                            weight_filler { type: "xavier" } } }\n'
    'layer { name: "sum" type: "Eltwise" bottom: "conv3" bottom: "conv3b" top: "s" }\n'
    'layer { name: "ip" type: "InnerProduct" bottom: "s"')


def test_a_producer_whose_input_changes_later_is_not_run_again():
    assert chosen_names(build(SPLIT_NET)) == {'norm1'}
    # The TanH changes the LRN's input in place after the LRN ran (through
    # the other Split top): run again, the LRN would see other values.
    late = SPLIT_NET.replace(
        'layer { name: "conv2"',
        'layer { name: "late" type: "TanH" bottom: "b" top: "b" }\nlayer { name: "conv2"')
    assert chosen_names(build(late)) == set()
    stock = sgd_run(build(late), 3)
    shared = sgd_run(build(late, memory='shared'), 3)
    assert stock[0] == shared[0]


def test_random_producers_are_not_made_again():
    # STOCHASTIC pooling draws random numbers; MAX pooling would be made
    # again only where its input stays (on the CPU its backward reads an argmax).
    pooled = LRN_NET.replace(
        'type: "LRN" bottom: "conv1" top: "norm1"\n        lrn_param { local_size: 5 alpha: 0.1 '
        'beta: 0.75 }',
        'type: "Pooling" bottom: "conv1" top: "norm1"\n        pooling_param { pool: STOCHASTIC '
        'kernel_size: 3 stride: 1 }')
    assert 'STOCHASTIC' in pooled
    assert chosen_names(build(pooled)) == set()


def test_a_map_or_its_producers_input_not_both(monkeypatch):
    """AlexNet (GPU reads): norm1 -> pool1 -> conv2. Both norm1's and pool1's
    outputs qualify, but pool1 made again reads norm1, so only the larger,
    norm1, is; norm2 likewise. The estimate gives the bytes back."""
    net = shapes.build_net(shapes.load_net_param(bench_path('alexnet_b128')))
    assert chosen_names(net) == {'norm1', 'norm2'}
    with_ = budget.estimate_plan(net, 'shared')
    config.set('recompute', '0')
    without = budget.estimate_plan(net, 'shared')
    norm_bytes = sum(net.blobs[n].count * 4 for n in ('norm1', 'norm2'))
    assert with_.peak_bytes <= without.peak_bytes - norm_bytes // 2
    # The second forwards of the two LRNs are in the estimated time.
    extra = recompute.extra_seconds(net, liveness.buffers(net), with_.recomputed,
                                    budget.wm.step_seconds(net, {
        i: budget.wm.fastest(l, budget.wm.knee_cap(net)) for i, l in budget.wm.conv_layers(net)}))
    assert with_.est_iter_ms == pytest.approx(without.est_iter_ms + extra * 1e3)
    assert extra > 0


def test_small_maps_are_not_worth_a_forward():
    net = shapes.build_net(shapes.load_net_param(bench_path('googlenet_b64')))
    bufs = liveness.buffers(net)
    peak = max(liveness.live_bytes_by_step(bufs, 2 * len(net.layers)))
    again = recompute.choose(net, bufs)
    sizes = {b.key: b.nbytes for b in bufs}
    assert again and all(sizes[k] >= recompute.MIN_SHARE * peak for k in again)
    assert 'loss1/ave_pool' not in {n for k in again for n in k[1]}


# -- running ---------------------------------------------------------------------------------
def test_training_with_maps_made_again_is_bit_identical_to_stock():
    stock = sgd_run(build())
    net = build(memory='shared')
    assert net.applied_plan.plan.recomputed
    shared = sgd_run(net)
    assert_same_run(stock, shared)


def test_a_map_made_again_is_released_in_between_and_says_so():
    net = build(memory='shared')
    net.forward()
    with pytest.raises(CaffeplusError) as info:
        net.blobs['norm1'].data
    msg = str(info.value)
    assert 'norm1' in msg and 'makes it again' in msg and 'keep' in msg
    net.backward()
    # Kept, it stays readable with stock's values.
    kept = build(memory='shared', keep=['norm1'])
    assert not kept.applied_plan.plan.recomputed
    kept.forward()
    stock = build()
    stock.forward()
    assert numpy.array_equal(kept.blobs['norm1'].data, stock.blobs['norm1'].data)


def test_partial_passes_check_the_map_made_again():
    net = build(memory='shared')
    net.forward()
    net.backward()
    # conv2's forward reads norm1, whose first life was reused in backward.
    with pytest.raises(CaffeplusError, match='norm1'):
        net.forward(start='conv2')
    # Backward in two halves: the second starts below conv2, where norm1
    # was made again by the first. (Each net built and run in turn: the
    # DummyData refills draw from the seeded generator.)

    def halves(memory):
        n = build(memory=memory)
        n.forward()
        n.backward(end='conv2')
        n.backward(start='norm1')
        return [p.diff.copy() for p in n.learnable_params]
    for a, b in zip(halves('shared'), halves(None)):
        assert numpy.array_equal(a, b)


def test_offload_beside_maps_made_again_is_bit_identical(tmp_path):
    """GoogLeNet on the CPU: shared makes norm2 and the large pools again;
    offload 'all' (simulated, lazy copies) moves the rest."""
    if not os.path.exists(cpe.model_path('googlenet')):
        pytest.fail('test data missing')
    param, test_nets = cpe.net_param('googlenet', str(tmp_path), 2)
    stock = cpe.train(param, 'stock', 2, test_nets)
    shared = cpe.train(param, 'shared', 2, test_nets)
    assert not cpe.differences(stock, shared)


# -- GPU -------------------------------------------------------------------------------------
ALEX_LIKE = '''
name: "alexlike"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { data_filler { type: "gaussian" std: 1 }
                           shape { dim: 8 dim: 3 dim: 31 dim: 31 }
                           data_filler { type: "uniform" min: 0 max: 4.99 } shape { dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 16 kernel_size: 5 stride: 2
                            weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1"
        lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 } }
layer { name: "pool1" type: "Pooling" bottom: "norm1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 16 kernel_size: 3 pad: 1
                            weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "ip" type: "InnerProduct" bottom: "conv2" top: "ip"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''


@pytest.mark.gpu
def test_gpu_lrn_made_again_for_cudnn_pooling_is_bit_identical(tmp_path):
    """On the GPU cuDNN's pooling backward reads norm1 (its input): shared
    makes it again from conv1 before pool1's backward. Against arena (same
    algorithms), deterministic math, bit for bit."""
    param = param_of(ALEX_LIKE)
    arena, shared = [cpe.train(param, plan, 10, 0, gpu=0, math='deterministic')
                     for plan in ('arena', 'shared')]
    assert not cpe.differences(arena, shared), cpe.differences(arena, shared)
    from caffeplus import backend
    backend.set_mode_gpu(0)
    try:
        net = shapes.build_net(param, virtual=False)
        plan = make_plan(net, 'shared')
        assert {n for k in plan.recomputed for n in k[1]} == {'norm1'}
    finally:
        backend.set_mode_cpu()


# -- convolutions run again (plan auto's search, or CAFFEPLUS_RECOMPUTE=convs) ---------------
# conv1's output (16 channels) is read by conv2's forward and, after the
# pooling, inner product and loss, by conv2's and relu1's backward; its
# input (data) stays for conv1's own backward.
CONV_NET = '''
name: "convs"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { data_filler { type: "gaussian" std: 1 }
                           shape { dim: 4 dim: 3 dim: 14 dim: 14 }
                           data_filler { type: "uniform" min: 0 max: 2.99 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 16 kernel_size: 3 pad: 1
                            weight_filler { type: "xavier" } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool" type: "Pooling" bottom: "conv2" top: "pool"
        pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''


def chosen_chains(net, convs):
    bufs = liveness.buffers(net)
    return {key[1]: tuple(net._layer_names[i] for i in chain)
            for key, chain in recompute.choose(net, bufs, True, convs=convs).items()}


def test_a_convolution_and_its_relu_run_again_only_when_asked(monkeypatch):
    net = build(CONV_NET)
    # (The average pool's output, read by the inner product's backward, is
    # made again either way.)
    assert chosen_chains(net, convs=False) == {('pool',): ('pool',)}
    assert chosen_chains(net, convs=True) == {('pool',): ('pool',),
                                              ('conv1',): ('conv1', 'relu1')}
    assert 'conv1' not in make_plan(net, 'shared').recomputed_names()
    assert 'conv1' in make_plan(net, 'shared', recompute='convs').recomputed_names()
    config.set('recompute', 'convs')
    assert 'conv1' in make_plan(net, 'shared').recomputed_names()
    # In place after the convolution, only layers whose forward depends on
    # the map alone: TanH is not on the list, BatchNorm would move its
    # running averages twice.
    tanh = CONV_NET.replace('name: "relu1" type: "ReLU"', 'name: "relu1" type: "TanH"')
    assert ('conv1',) not in chosen_chains(build(tanh), convs=True)


def test_a_convolution_run_again_gets_its_forward_workspace_at_that_step():
    """conv1's map is read in backward by conv2's filter call alone, then by
    relu1: it is made again for the one (gone while conv2's data call writes
    conv1's diff) and again for the other, each run with its own workspace."""
    net = build(CONV_NET)
    conv1 = net._layer_names.index('conv1')
    L = len(net.layers)
    u1 = 2 * L - 1 - net._layer_names.index('conv2')
    u2 = 2 * L - 1 - net._layer_names.index('relu1')
    plan = make_plan(net, 'shared', recompute='convs', workspace={conv1: (1000, 2000, 3000)},
                     recompute_split=[('data', ('conv1',))])
    assert plan.recompute_split == (('data', ('conv1',)),)
    back = sorted((b for b in plan.buffers if b.blobs == ('conv1',) and b.kind == 'data'
                   and b.key[-1] != 'forward'), key=lambda b: b.start)
    half = liveness.FILTER_FIRST
    assert [(b.start, b.end) for b in back] == [(u1 - half, u1 - half), (u2 - half, back[1].end)]
    diff = [b for b in plan.buffers if b.blobs == ('conv1',) and b.kind == 'diff'][0]
    assert diff.start == u1         # written by conv2's data call, after the first life
    again = sorted((b for b in plan.buffers if b.key[:2] == ('workspace', 'conv1')
                    and b.key[2].startswith('again')), key=lambda b: b.start)
    assert [(b.key[2], b.nbytes, b.start) for b in again] == [
        ('again@%d' % u1, 1000, u1 - half), ('again@%d' % u2, 1000, u2 - half)]
    assert plan.recomputed and recompute.extra_seconds(
        net, liveness.buffers(net), plan.recomputed, [1.0] * (2 * L),
        plan.recompute_split) == 2 * 2 + 1   # + pool
    # Not split: one life in backward, one run again.
    whole = make_plan(net, 'shared', recompute='convs', workspace={conv1: (1000, 2000, 3000)})
    assert [b.key[-1] for b in whole.buffers if b.blobs == ('conv1',) and b.kind == 'data'] \
        == ['forward', 'again']
    # Each placed apart from everything live then.
    for w in again:
        lo, hi = plan.offsets[w.key], plan.offsets[w.key] + w.nbytes
        for b in plan.buffers:
            if b is not w and b.start <= w.start <= b.end:
                o = plan.offsets[b.key]
                assert o + b.nbytes <= lo or o >= hi, b.key


@pytest.mark.parametrize('chunked', [False, True])
def test_training_with_convolutions_run_again_is_bit_identical_to_stock(monkeypatch, chunked):
    """conv2's backward reads conv1's map in its filter call, then writes
    conv1's diff where the plan may have put that map: `chunked` runs the
    CPU convolution image by image, so every filter read must come first."""
    if chunked:
        from caffeplus import im2col
        monkeypatch.setitem(im2col.CPU_CHUNK_BYTES, 'col', 1)
    stock = sgd_run(build(CONV_NET))
    config.set('recompute', 'split')
    net = build(CONV_NET, memory='shared')
    assert net.applied_plan.plan.recomputed_names() == ['conv1', 'pool']
    shared = sgd_run(net)
    assert_same_run(stock, shared)
    net.forward()
    with pytest.raises(CaffeplusError, match='layer conv1 makes it again'):
        net.blobs['conv1'].data


def test_auto_runs_convolutions_again_where_that_beats_the_host_link(monkeypatch):
    """VGG-16 b256 within 11.8 GiB: conv1_1's output (3.3 GB, 66 ms each way
    over the link) is made again from the data in 0.7 ms. (At 12 GiB,
    since the plans' smaller thread stack, little has to leave at all.)
    Since the placement's search (placement._search) the plan without
    convolutions made again fits with fewer maps moved (377 against 450 ms
    estimated), and at 11.45 GiB only the plan that makes them again fits
    (11.5 before InnerProduct's cuBLAS workspace moved into the arena)."""
    net = shapes.build_net(shapes.load_net_param(bench_path('vgg16_b64'), batch=256))
    limit = budget.parse_bytes('11.8G')
    plan = budget.plan_for_budget(net, limit)
    assert plan.peak_bytes <= limit
    assert 'conv1_1' in plan.recomputed_names()
    # Not every convolution that could: the cheapest per byte first.
    every = recompute.choose(net, liveness.buffers(net), True, plan.offloaded, convs=True)
    heads = {chain[0] for chain in plan.recomputed.values()}
    assert len(heads) < len({chain[0] for chain in every.values()})
    monkeypatch.setattr(recompute, 'CONV_TYPES', ())
    without = budget.plan_for_budget(net, limit)
    assert without.peak_bytes <= limit and 'conv1_1' not in without.recomputed_names()
    assert plan.est_iter_ms < 0.97 * without.est_iter_ms
    assert host_bytes(net, plan) < host_bytes(net, without)
    with pytest.raises(CaffeplusError, match='smallest budget that fits'):
        budget.plan_for_budget(net, budget.parse_bytes('11.45G'))
    monkeypatch.undo()
    tight = budget.plan_for_budget(net, budget.parse_bytes('11.45G'))
    assert tight.peak_bytes <= budget.parse_bytes('11.45G')
    assert 'conv1_1' in tight.recomputed_names()


def test_a_chosen_set_of_convolutions_runs_again_and_no_other():
    net = build(CONV_NET)
    conv1 = net._layer_names.index('conv1')
    bufs = liveness.buffers(net)
    assert ('conv1',) in {k[1] for k in recompute.choose(net, bufs, True, convs=(conv1,))}
    assert ('conv1',) not in {k[1] for k in recompute.choose(net, bufs, True, convs=(conv1 + 2,))}
    assert 'conv1' in make_plan(net, 'shared', recompute=(conv1,)).recomputed_names()


def host_bytes(net, plan):
    return budget.offload.host_bytes(liveness.buffers(net), plan.offloaded)


@pytest.mark.gpu
@pytest.mark.parametrize('mode', ['convs', 'split'])
def test_gpu_convolutions_run_again_are_bit_identical(tmp_path, monkeypatch, mode):
    """cuDNN: conv1 and relu1 run again before conv2's backward, conv1's
    forward call in its own ('again') workspace view (split: again after
    conv2's filter call, for relu1's backward). Against arena, with
    deterministic math, bit for bit."""
    param = param_of(CONV_NET.replace('dim: 4 dim: 3 dim: 14 dim: 14',
                                      'dim: 16 dim: 3 dim: 64 dim: 64').replace(
                                          'shape { dim: 4 }', 'shape { dim: 16 }'))
    config.set('recompute', mode)
    arena, shared = [cpe.train(param, plan, 10, 0, gpu=0, math='deterministic')
                     for plan in ('arena', 'shared')]
    assert not cpe.differences(arena, shared), cpe.differences(arena, shared)
    from caffeplus import backend
    backend.set_mode_gpu(0)
    try:
        net = shapes.build_net(param, virtual=False)
        plan = make_plan(net, 'shared')
        assert 'conv1' in plan.recomputed_names()
        assert bool(plan.recompute_split) == (mode == 'split')
    finally:
        backend.set_mode_cpu()


def test_the_cpu_convolution_reads_every_input_before_it_writes_a_gradient(monkeypatch):
    """dx laid one image ahead of x in the same memory (as a plan may lend
    x's bytes to dx): image by image, dw must still see every x unchanged."""
    from caffeplus import im2col
    monkeypatch.setitem(im2col.CPU_CHUNK_BYTES, 'col', 1)
    rng = numpy.random.RandomState(0)
    n, c, m = 4, 3, 5
    geom = im2col.ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1))
    w = rng.randn(m, c, 3, 3).astype(numpy.float32)
    dy = rng.randn(n, m, 6, 6).astype(numpy.float32)
    arena = rng.randn(n + 1, c, 6, 6).astype(numpy.float32)
    x = arena[:-1].copy()
    want_dw, want_dx = numpy.zeros_like(w), numpy.zeros_like(x)
    im2col.conv_backward(x, w, dy, geom, 1, dx=want_dx, dw=want_dw)
    dw = numpy.zeros_like(w)
    im2col.conv_backward(arena[:-1], w, dy, geom, 1, dx=arena[1:], dw=dw)
    assert numpy.array_equal(dw, want_dw) and numpy.array_equal(arena[1:], want_dx)


@pytest.mark.gpu
def test_gpu_a_convolution_and_its_relu_run_again_in_one_pass_give_the_same_bits():
    """forward_then_relu (bias and ReLU in one pass over the top, for a
    convolution run again) against the convolution's forward and the
    ReLU's, bit for bit."""
    import caffeplus
    from caffeplus import backend
    from caffeplus.memory.recompute import bias_relu_pair
    param = param_of(CONV_NET.replace('dim: 4 dim: 3 dim: 14 dim: 14',
                                      'dim: 8 dim: 3 dim: 32 dim: 32').replace(
                                          'shape { dim: 4 }', 'shape { dim: 8 }'))
    caffeplus.set_mode_gpu()
    try:
        net = caffeplus.Net(param, caffeplus.TRAIN, memory='stock')
        conv, relu = net._layer_names.index('conv1'), net._layer_names.index('relu1')
        assert bias_relu_pair(net, [conv, relu])
        net.layers[conv].blobs[1].data[...] = backend.xp().linspace(-1, 1, 16, dtype='float32')
        net.forward()
        top = net.top_vecs[conv][0]
        want = top.data.copy()
        assert float((want == 0).mean()) > 0.1       # the ReLU cut some
        top.data[...] = float('nan')
        assert net.layers[conv].forward_then_relu(net.bottom_vecs[conv], net.top_vecs[conv])
        got = top.data.copy()
        assert backend.xp().array_equal(got.view('int32'), want.view('int32'))
    finally:
        backend.set_mode_cpu()


def test_headroom_counts_a_split_map_gone_during_the_data_call():
    """Split lives: conv1's map is live for conv2's filter call (half a step
    early) and gone for its data call, which writes conv1's diff instead;
    the headroom of each call counts exactly what lives at its half step."""
    net = build(CONV_NET)
    L = len(net.layers)
    conv2 = net._layer_names.index('conv2')
    t = 2 * L - 1 - conv2
    plan = make_plan(net, 'shared', recompute='convs', recompute_split=[('data', ('conv1',))])
    live = liveness.live_bytes_by_half_step(plan.buffers, plan.steps)
    room = liveness.headroom(net, plan.buffers, plan.steps)

    def at(h, key):
        return any(b.key[:2] == key and math.ceil(2 * b.start) <= h <= math.floor(2 * b.end)
                   for b in plan.buffers)
    assert at(2 * t - 1, ('data', ('conv1',))) and not at(2 * t, ('data', ('conv1',)))
    assert at(2 * t, ('diff', ('conv1',))) and not at(2 * t - 1, ('diff', ('conv1',)))
    assert room[(conv2, 'backward_filter')] == max(live) - live[2 * t - 1]
    assert room[(conv2, 'backward')] == max(live) - live[2 * t]


# -- which plans ----------------------------------------------------------------------
@pytest.mark.parametrize('setting, shared, offload', [('', False, True), ('1', True, True),
                                                      ('0', False, False)])
def test_shared_makes_maps_again_only_when_asked(monkeypatch, setting, shared, offload):
    """`shared` keeps `arena`'s iteration time: no forward runs twice
    unless CAFFEPLUS_RECOMPUTE=1; `offload` makes AlexNet's LRN maps again."""
    path = bench_path('alexnet_b128')
    config.set('recompute', setting)
    net = shapes.build_net(shapes.load_net_param(path))
    assert bool(make_plan(net, 'shared').recomputed) == shared
    assert bool(make_plan(net, 'offload', offload_policy='conv').recomputed) == offload
