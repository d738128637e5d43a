"""The convolution workspace placed in a reusing plan's arena
(caffeplus.memory.workspace.PlacedWorkspace, liveness.workspace_buffers):
each layer's forward and backward call gets bytes live at its own step only.

CPU tests drive the planner and the applied plan with a stand-in manager
(the layout is checked against every buffer live at the same step, and
training stays bit-identical); the `gpu` tests run real cuDNN convolutions
out of the placed views and compare with the `arena` plan.
"""
import numpy
import pytest

import caffeplus
from caffeplus import log
from caffeplus.errors import CaffeplusError
from caffeplus.io.prototxt import parse_text
from caffeplus.memory import liveness, placement
from caffeplus.memory.apply import apply_plan
from caffeplus.memory.plan import make_plan
from caffeplus.memory.workspace import PlacedWorkspace, Site, forward_kinds
from caffeplus.proto import caffe_pb2

NET = '''
name: "convs"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { data_filler { type: "gaussian" std: 1 }
                           shape { dim: 4 dim: 3 dim: 16 dim: 16 }
                           data_filler { type: "uniform" min: 0 max: 4.99 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool" type: "Pooling" bottom: "conv2" top: "pool"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv3" type: "Convolution" bottom: "pool" top: "conv3"
        convolution_param { num_output: 6 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv3" top: "ip"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''
KB = 1024


@pytest.fixture(autouse=True)
def _quiet():
    level = log.logger.level
    log.logger.setLevel(30)
    yield
    log.logger.setLevel(level)


def build(memory=None, seed=5):
    caffeplus.set_random_seed(seed)
    return caffeplus.Net(parse_text(NET, caffe_pb2.NetParameter()), caffeplus.TRAIN,
                         memory=memory)


def conv_indices(net):
    return [i for i, l in enumerate(net.layers) if l.layer_param.type == 'Convolution']


def check_layout(bufs, offsets):
    placement.validate(bufs, offsets)       # no two buffers live at once share bytes


# -- the planner ----------------------------------------------------------------------
def test_workspace_buffers_live_at_their_layer_step_only():
    net = build()
    L = len(net.layers)
    sizes = {i: (10 * KB * (i + 1), 20 * KB) for i in conv_indices(net)}
    bufs = liveness.workspace_buffers(net, sizes, training=True)
    for b in bufs:
        _, name, pass_kind = b.key
        i = net._layer_names.index(name)
        step = i if pass_kind == 'forward' else 2 * L - 1 - i
        assert (b.start, b.end, b.kind) == (step, step, 'workspace')
        assert b.nbytes == sizes[i][0 if pass_kind == 'forward' else 1]
    # Every call's buffer, but the data gradient of a layer whose bottoms take
    # none (the first convolution's: that call never runs).
    takes = [i for i in sizes if any(net.bottom_need_backward[i])]
    assert takes and len(takes) < len(sizes)
    assert len(bufs) == len(sizes) + len(takes)
    # Forward only (a TEST net): no backward workspace.
    assert all(b.key[2] == 'forward'
               for b in liveness.workspace_buffers(net, sizes, training=False))


def test_placed_workspace_costs_at_most_a_separate_buffer():
    net = build()
    base = make_plan(net, 'shared')
    big = 64 * KB
    sizes = {i: (big, big) for i in conv_indices(net)}
    plan = make_plan(net, 'shared', workspace=sizes)
    check_layout(plan.buffers, plan.offsets)
    # Never worse than the old layout (activations arena + one workspace buffer)...
    assert base.arena_bytes <= plan.arena_bytes <= base.arena_bytes + big + 512
    # ...and the breakdown adds up to the arena.
    b = plan.breakdown
    assert b['activations'] + b['activation_diffs'] + b['workspace'] == plan.arena_bytes
    # Workspace of the first convolution's forward, when little else is live,
    # costs nothing extra when it fits the bytes dead then.
    first = conv_indices(net)[0]
    small = {first: (512, 0)}
    assert make_plan(net, 'shared', workspace=small).arena_bytes == base.arena_bytes


def test_estimate_places_modelled_workspace_for_reusing_plans():
    from caffeplus.memory import budget
    net = build()
    shared = budget.estimate_plan(net, 'shared')
    placed = [b for b in shared.buffers if b.kind == 'workspace']
    # 3x3 stride-1 convolutions: the model's fastest candidate needs workspace;
    # the InnerProduct's GEMMs get cuBLAS's (caffeplus.memory.cublas_pool).
    assert {b.key[1] for b in placed} == {'conv1', 'conv2', 'conv3', 'ip'}
    assert {b.nbytes for b in placed if b.key[1] == 'ip'} == {32 * 2 ** 20}
    # Its share of the arena at the busiest step (the arena has alignment gaps).
    assert 0 <= shared.breakdown["workspace"] <= 1.25 * max(b.nbytes for b in placed)
    stock = budget.estimate_plan(net, 'stock')
    assert 'workspace' not in {b.kind for b in stock.buffers}


def test_filter_call_workspace_shares_bytes_with_the_diff_it_precedes():
    """conv2's backward: the filter call (before the bottom's diff exists)
    may use the bytes conv1's diff takes a moment later."""
    net = build()
    L = len(net.layers)
    conv2 = net._layer_names.index('conv2')
    t = 2 * L - 1 - conv2
    big = 256 * KB
    plan = make_plan(net, 'shared', workspace={conv2: (0, 0, big)})
    check_layout(plan.buffers, plan.offsets)
    early = [b for b in plan.buffers if b.key == ('workspace', 'conv2', 'backward_filter')]
    assert len(early) == 1 and early[0].start == t - liveness.FILTER_FIRST
    bottom_diff = [b for b in plan.buffers if b.kind == 'diff' and 'conv1' in b.blobs]
    assert bottom_diff and bottom_diff[0].start == t
    # Placed as a data call's workspace (at step t, beside that diff) it costs more.
    late = make_plan(net, 'shared', workspace={conv2: (0, big, 0)})
    assert plan.arena_bytes < late.arena_bytes


# -- the manager (no GPU: a limit, views given) -------------------------------------------
class Cand:
    def __init__(self, algo, memory, deterministic=True):
        self.algo, self.memory, self.deterministic = algo, memory, deterministic
        self.name = 'A%d' % algo


class FakeConv:
    def __init__(self, name, reverse=False):
        self.reverse = reverse
        self.layer_param = caffe_pb2.LayerParameter(name=name, type='Convolution')

    def auto_timed_search(self):        # of the memory planner's contract (caffeplus.layer)
        return False


class FakeNet:
    def __init__(self, layers):
        self.layers = layers


def test_placed_workspace_sizes_and_checkout():
    conv, deconv = FakeConv('c'), FakeConv('d', reverse=True)
    net = FakeNet([object(), conv, deconv])
    ws = PlacedWorkspace(limit=10 ** 9)
    ws.register(conv, [Site('fwd', [Cand(1, 300)]), Site('bwd_data', [Cand(2, 700)]),
                       Site('bwd_filter', [Cand(3, 500)])])
    ws.register(deconv, [Site('fwd', [Cand(4, 100)]), Site('bwd_data', [Cand(5, 900)]),
                         Site('bwd_filter', [Cand(6, 50)])])
    assert forward_kinds(conv) == ('fwd',) and forward_kinds(deconv) == ('bwd_data',)
    # A Deconvolution's forward is the convolution's backward-data.
    # (forward, backward data call, backward filter call): the filter call
    # has a view of its own (it runs before the bottom's diff is written).
    assert ws.sizes(net) == {1: (300, 700, 500), 2: (900, 100, 50)}
    assert ws.layout_stale
    ws.set_views({(id(conv), 'forward'): (4096, 300), (id(conv), 'backward'): (8192, 700),
                  (id(conv), 'backward_filter'): (16384, 500)})
    assert not ws.layout_stale
    ws.pass_kind = 'forward'
    with ws.checkout(conv, 'fwd') as (ptr, nbytes):
        assert (ptr, nbytes) == (4096, 300)
    ws.pass_kind = 'backward'
    with ws.checkout(conv, 'bwd_data') as (ptr, nbytes):
        assert (ptr, nbytes) == (8192, 700)
    with ws.checkout(conv, 'bwd_filter') as (ptr, nbytes):
        assert (ptr, nbytes) == (16384, 500)
    # A call needing no workspace has no view: it gets the private buffer,
    # as an unplaced call would, but is not counted as one the layout missed.
    ws.register(deconv, [Site('fwd', [Cand(4, 0)]), Site('bwd_data', [Cand(5, 0)]),
                         Site('bwd_filter', [Cand(6, 0)])])
    ws.ensure_planned()
    ws.pass_kind = 'forward'
    with ws.checkout(deconv, 'bwd_data') as (ptr, nbytes):
        assert nbytes == 0
    assert ws.outside == {}
    # A call the layout missed that needs bytes is counted.

    class Buffer:                                   # (the device buffer, on the CPU)
        ptr, nbytes = 0, 0

        def resize(self, n, layer, plan):
            self.ptr, self.nbytes = 1 << 20, n
    ws._buffer = Buffer()
    ws.register(deconv, [Site('fwd', [Cand(4, 0)]), Site('bwd_data', [Cand(5, 64)]),
                         Site('bwd_filter', [Cand(6, 0)])])
    ws.ensure_planned()
    with ws.checkout(deconv, 'bwd_data') as (ptr, nbytes):
        assert nbytes == 64
    assert ws.outside == {('d', 'bwd_data'): 64}
    # A reshape re-registers: re-planned on the next checkout, the layout stale again.
    ws.register(conv, [Site('fwd', [Cand(1, 200)]), Site('bwd_data', [Cand(2, 100)]),
                       Site('bwd_filter', [Cand(3, 100)])])
    ws.ensure_planned()
    assert ws.layout_stale and ws.sizes(net)[1] == (200, 100, 100)


# -- the applied plan (CPU, a stand-in manager) ---------------------------------------------
class StandIn:
    """What AppliedPlan needs of a PlacedWorkspace, with fixed sizes."""

    def __init__(self, sizes):
        self._sizes = dict(sizes)
        self.views = {}
        self.layout_stale = True
        self.pass_kind = None
        self.passes = []
        self.planned = 0

    def sizes(self, net):
        return dict(self._sizes)

    def ensure_planned(self):
        self.planned += 1

    def set_views(self, views):
        self.views = dict(views)
        self.layout_stale = False

    def search_pending(self):
        return False


def apply_with(net, name, sizes):
    stand_in = StandIn(sizes)
    plan = make_plan(net, name)
    apply_plan(net, plan, training=True)
    applied = net.applied_plan
    applied.options['workspace'] = stand_in
    applied.relayout()
    return applied, stand_in


def train(net, iters=3):
    losses = []
    for _ in range(iters):
        net.clear_param_diffs()
        losses.append(float(host(net.forward_prefilled())))
        net.backward_all()
        for p in net.learnable_params:
            p.data[...] -= numpy.float32(0.05) * p.diff
    return losses, [host(p.data).copy() for p in net.learnable_params]


def host(a):
    return a.get() if hasattr(a, 'get') else numpy.asarray(a)


@pytest.mark.parametrize('name', ['shared', 'offload'])
def test_applied_plan_places_views_apart_from_live_buffers(name):
    net = build('stock')
    sizes = {i: (32 * KB, 48 * KB) for i in conv_indices(net)}
    applied, stand_in = apply_with(net, name, sizes)
    L = len(net.layers)
    runs = {i: ('forward', 'backward') if any(net.bottom_need_backward[i]) else ('forward',)
            for i in sizes}     # (the first convolution's data gradient never runs)
    assert set(stand_in.views) == {(id(net.layers[i]), k) for i in sizes for k in runs[i]}
    # Every view lies in the arena, apart from every buffer live at its step.
    arena_end = applied.arena_bytes
    for (layer_id, pass_kind), (offset, nbytes) in stand_in.views.items():
        i = [id(l) for l in net.layers].index(layer_id)
        step = i if pass_kind == 'forward' else 2 * L - 1 - i
        assert nbytes == sizes[i][0 if pass_kind == 'forward' else 1]
        assert 0 <= offset and offset + nbytes <= arena_end
        for e in applied.entries:
            for life in e.lives:
                if life.start <= step <= life.end:
                    lo = life.offset
                    hi = lo + life.buf.nbytes
                    assert hi <= offset or offset + nbytes <= lo, (e.name, pass_kind, i)
    assert applied.workspace_bytes == sum(sizes[i][0] + (sizes[i][1] if len(runs[i]) > 1 else 0)
                                          for i in sizes)
    shares = applied.info()['arena_shares']
    assert abs(sum(shares.values()) - 1.0) < 1e-9


def test_inner_products_get_cublas_workspace_views_apart_from_live_buffers(monkeypatch):
    """Where the GPU runs InnerProduct's GEMMs on arena bytes
    (caffeplus.memory.cublas_pool), the plan places a view for the layer's
    forward step and its backward step; removing the plan takes them away."""
    from caffeplus.memory.apply import AppliedPlan, remove_plan
    monkeypatch.setattr(AppliedPlan, '_gemm_bytes', lambda self: 8 * KB)
    net = build('stock')
    sizes = {i: (16 * KB, 16 * KB) for i in conv_indices(net)}
    applied, stand_in = apply_with(net, 'shared', sizes)
    L = len(net.layers)
    i = net._layer_names.index('ip')
    ip = net.layers[i]
    assert set(ip.gemm_views) == {'forward', 'backward'}
    assert all((id(ip), k) not in stand_in.views for k in ('forward', 'backward'))
    for pass_kind, (offset, nbytes) in ip.gemm_views.items():
        step = i if pass_kind == 'forward' else 2 * L - 1 - i
        assert nbytes == 8 * KB and 0 <= offset and offset + nbytes <= applied.arena_bytes
        for e in applied.entries:
            for life in e.lives:
                if life.start <= step <= life.end:
                    assert life.offset + life.buf.nbytes <= offset or \
                        offset + nbytes <= life.offset, (e.name, pass_kind)
        assert applied.workspace_calls['ip/' + pass_kind] == 8 * KB
    placement.validate(applied.layout[0], applied.layout[2])
    remove_plan(net)
    assert ip.gemm_views == {}


def test_passes_name_their_kind_and_training_is_unchanged():
    ref = train(build('stock'))
    net = build('stock')
    sizes = {i: (16 * KB, 16 * KB) for i in conv_indices(net)}
    applied, stand_in = apply_with(net, 'shared', sizes)
    seen = []
    net.before_layer_forward.append(lambda i: seen.append(stand_in.pass_kind))
    net.before_layer_backward.append(lambda i: seen.append(stand_in.pass_kind))
    got = train(net)
    assert 'forward' in seen and 'backward' in seen
    assert seen.index('backward') > seen.index('forward')
    assert got[0] == ref[0]
    for a, b in zip(got[1], ref[1]):
        assert numpy.array_equal(a, b)


def test_stale_layout_is_placed_again_before_the_next_pass():
    net = build('stock')
    # (A convolution whose data gradient runs: the first one's does not.)
    conv = [i for i in conv_indices(net) if any(net.bottom_need_backward[i])][0]
    applied, stand_in = apply_with(net, 'shared', {conv: (KB, KB)})
    before = applied.replans
    stand_in._sizes = {conv: (4 * KB, 8 * KB)}
    stand_in.layout_stale = True
    net.forward_prefilled()
    assert applied.replans == before + 1 and not stand_in.layout_stale
    assert stand_in.views[(id(net.layers[conv]), 'backward')][1] == 8 * KB


def test_a_pending_timed_search_is_given_the_maps_arena_as_its_room():
    """Before the arena is taken the timed search may use what the placed
    maps will hold, and no more (PlacedWorkspace.search_limit); nothing is
    computed when no search waits."""
    net = build('stock')
    sizes = {i: (32 * KB, 32 * KB) for i in conv_indices(net)}
    applied, stand_in = apply_with(net, 'shared', sizes)
    assert not hasattr(stand_in, 'search_room')
    stand_in.search_pending = lambda: True
    stand_in.search_room = None
    applied.relayout()
    assert 0 < stand_in.search_room < applied.arena_bytes
    # The same net and plan with no workspace: the maps and the few bytes
    # layers keep (pooling's, dropout's), which the room leaves out.
    bare, _ = apply_with(build('stock'), 'shared', {i: (0, 0) for i in sizes})
    assert bare.arena_bytes - 4 * KB <= stand_in.search_room <= bare.arena_bytes


# -- on the GPU -----------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_shared_plan_runs_convolutions_in_placed_views():
    from caffeplus.backend import mathmode
    mathmode.set_math_mode('deterministic')
    try:
        caffeplus.set_mode_gpu()
        ref_net = build('arena')
        ref = train(ref_net)
        net = build('shared')
        ws = net.workspace
        assert isinstance(ws, PlacedWorkspace)
        got = train(net)
        assert ws.views, 'no placed views'
        assert ws._buffer.nbytes == 0, 'a call fell back to a private buffer'
        import cupy
        if cupy.cuda.Device().compute_capability[:-1] == '9':
            # and InnerProduct's GEMMs on the arena's bytes (cublas_pool)
            ip = net.layers[net._layer_names.index('ip')]
            assert set(ip.gemm_views) == {'forward', 'backward'}
        assert numpy.allclose(got[0], ref[0], rtol=0, atol=0)
        for a, b in zip(got[1], ref[1]):
            assert numpy.array_equal(a, b)
    finally:
        mathmode.set_math_mode('strict')
        caffeplus.set_mode_cpu()


def test_within_headroom_trades_a_little_time_for_the_peak():
    from caffeplus.memory.workspace import within_headroom

    class Timed(Cand):
        def __init__(self, algo, memory, time, deterministic=True):
            super().__init__(algo, memory, deterministic)
            self.time = time

    fast, near, slow = Timed(1, 900, 1.00), Timed(2, 100, 1.08), Timed(3, 0, 1.50)
    cands = [fast, near, slow]
    assert within_headroom(cands, fast, 1000) is fast          # fits: the fastest
    assert within_headroom(cands, fast, 500) is near           # 8% slower, fits the room
    # Only a 50% slower one fits: the 8% slower one raises the peak least.
    assert within_headroom(cands, fast, 50) is near
    assert within_headroom(cands, fast, 50, slowdown=0.6) is slow
    assert within_headroom(cands, fast, 50, slowdown=float('inf')) is slow    # auto's budget
    assert within_headroom([fast, Timed(4, 950, 1.05)], fast, 50) is fast   # no better
    assert within_headroom([Timed(1, 900, 1.0), Timed(2, 10, 1.01, deterministic=False)],
                           cands[0], 100, deterministic=True) is cands[0]
    # Heuristic candidates carry no times: keep the fastest.
    untimed = [Timed(1, 900, -1), Timed(2, 0, -1)]
    assert within_headroom(untimed, untimed[0], 10) is untimed[0]
    # Unless any slowdown will do (auto's budget): the first within the room.
    assert within_headroom(untimed, untimed[0], 10, slowdown=float('inf')) is untimed[1]


def test_trades_past_each_calls_share_spend_one_allowance_for_the_net(monkeypatch):
    """AlexNet b128 on the H200: conv3's backward-data, fastest
    0.531 ms with 193.5 MiB, fits its step only over half batches (0.637
    ms, x1.2); conv4's, 0.468 ms with 226 MiB, only per group (0.580 ms).
    The 10% rule refuses both. Trades beyond it share one allowance, a
    share of the calls' summed best times, largest overflow first; when the
    time left cannot pay for the next one, none after it is made either
    (the peak would stay where that one puts it)."""
    from caffeplus.memory import workspace
    from caffeplus.memory.workspace import (PLAN_TRADE_SHARE, trade_for_room,
                                            trade_time_share, within_headroom)

    class Timed(Cand):
        def __init__(self, algo, memory, time):
            super().__init__(algo, memory, True)
            self.time = time

    c3, c3_halves = Timed(1, 193, 0.531), Timed(2, 103, 0.637)
    c4, c4_groups = Timed(3, 226, 0.468), Timed(4, 113, 0.580)
    others = [Timed(9, 0, 1.0) for _ in range(9)]             # the rest of the net: 9 ms
    rest = [('c%d' % k, [t], t, 500) for k, t in enumerate(others)]
    assert within_headroom([c3, c3_halves], c3, 150, slowdown=0.10) is c3
    calls = [('conv3', [c3, c3_halves], c3, 150), ('conv4', [c4, c4_groups], c4, 186)] + rest
    total = 0.531 + 0.468 + 9.0
    # 3% (0.30 ms) pays for both (0.106 + 0.112)
    picks = trade_for_room(calls, 0.03, slowdown=0.10)
    assert picks['conv3'] is c3_halves and picks['conv4'] is c4_groups
    assert all(picks[k] is v for k, _, v, _ in rest)
    # 1.5% (0.15 ms) pays for one: conv3's overflow (43) is the larger,
    # traded first; conv4's (40) then finds 0.044 ms left and stays
    picks = trade_for_room(calls, 0.015, slowdown=0.10)
    assert picks['conv3'] is c3_halves and picks['conv4'] is c4
    # 1% pays for the largest overflow's trade (0.112) not at all: none
    calls[1] = ('conv4', [c4, c4_groups], c4, 180)          # 46 over: now first
    picks = trade_for_room(calls, 0.01, slowdown=0.10)
    assert 0.01 * total < 0.112 and picks['conv3'] is c3 and picks['conv4'] is c4
    # nothing to trade for: every call its best, whatever the share
    assert trade_for_room([('conv3', [c3, c3_halves], c3, 200)], 1.0)['conv3'] is c3
    # within the call's own share a fitting one is taken for nothing
    near = Timed(5, 100, 0.55)
    assert trade_for_room([('conv3', [c3, near], c3, 150)], 0.0, slowdown=0.10)['conv3'] is near
    # untimed (heuristic) choices: nothing to weigh, kept
    untimed = [Timed(1, 900, -1), Timed(2, 0, -1)]
    assert trade_for_room([('h', untimed, untimed[0], 10)], 1.0)['h'] is untimed[0]
    # per plan, and the setting
    assert trade_time_share('shared') == PLAN_TRADE_SHARE['shared'] == 0.0
    assert trade_time_share('offload') == trade_time_share('auto') > 0
    monkeypatch.setattr(workspace, 'TRADE_SHARE_FOR_EVERY_PLAN', 0.05)
    assert trade_time_share('shared') == 0.05
    monkeypatch.setattr(workspace, 'TRADE_SHARE_FOR_EVERY_PLAN', -0.5)
    with pytest.raises(CaffeplusError, match='TRADE_SHARE_FOR_EVERY_PLAN'):
        trade_time_share('offload')


# -- buffers layers keep from forward to backward (caffeplus.memory.scratch) -----------------
def test_kept_layer_buffers_are_placed_with_their_lifetimes():
    from caffeplus.memory import scratch
    net = build('shared')
    applied = net.applied_plan
    L = len(net.layers)
    pool = net._layer_names.index('pool')
    assert scratch.declared(net.layers[pool]) == {'argmax': (4 * 8 * 8 * 8, numpy.dtype('int8'))}
    view = applied.internal_views[pool]['argmax']
    assert net.layers[pool]._scratch_views['argmax'] is view
    base = applied.arena.ctypes.data
    lo = view.ctypes.data - base
    hi = lo + view.nbytes
    # Live from the pooling's forward to its backward: no buffer live then shares its bytes.
    for e in applied.entries:
        for life in e.lives:
            if life.end < pool or life.start > 2 * L - 1 - pool:
                continue
            assert life.offset + life.buf.nbytes <= lo or hi <= life.offset, e.name
    # Training through the placed argmax is bit-identical to stock.
    ref = train(build('stock'))
    net = build('shared')
    got = train(net)
    assert got[0] == ref[0]
    for a, b in zip(got[1], ref[1]):
        assert numpy.array_equal(a, b)
    # Without the plan the layer keeps a buffer of its own again.
    from caffeplus.memory.apply import remove_plan
    remove_plan(net)
    assert net.layers[pool]._scratch_views == {}
    net.forward_prefilled()
    assert net.layers[pool]._scratch_own['argmax'].size == 4 * 8 * 8 * 8


def test_offload_runtime_waits_before_a_filter_calls_half_step_workspace():
    """The offload runtime schedules waits per whole step: a workspace view
    half a step early lands during its layer's step."""
    from caffeplus.memory import offload_runtime
    ref = train(build('stock'))
    net = build('stock')
    sizes = {i: (8 * KB, 8 * KB, 64 * KB) for i in conv_indices(net)}
    plan = make_plan(net, 'offload', offload_policy='all')
    apply_plan(net, plan, training=True, runtime_options={'simulate': 'lazy'}, lookahead=1)
    applied = net.applied_plan
    applied.options['workspace'] = StandIn(sizes)
    applied.relayout()
    assert any(start != int(start) for start, _, _ in applied.extra_regions)
    assert isinstance(applied.runtime, offload_runtime.OffloadRuntime)
    got = train(net)
    assert got[0] == ref[0]


def test_relayout_without_values_reuses_the_arena_when_it_fits():
    """Offload's calibrated look-ahead places the buffers again: the old
    arena's bytes serve again when the new layout fits, so two arenas never
    coexist; training stays bit-identical."""
    import weakref
    ref = train(build('stock'))
    net = build('stock')
    plan = make_plan(net, 'offload', offload_policy='all')
    apply_plan(net, plan, training=True, runtime_options={'simulate': 'lazy'}, lookahead=1)
    applied = net.applied_plan
    net.clear_param_diffs()
    base = applied.arena_base()
    applied.relayout(lookahead_steps={e.names: 1 for e in applied.entries if e.offloaded})
    assert applied.arena_base() is base                # same size: the same bytes
    assert applied.arena.size * 4 >= applied.arena_bytes
    old = weakref.ref(base)
    del base
    applied.relayout(lookahead_steps={e.names: 4 for e in applied.entries if e.offloaded})
    import gc
    gc.collect()
    # Reused when it fits, else gone: never two arenas.
    assert old() is None or applied.arena_base() is old()
    got = train(net)
    assert got[0] == ref[0]
    for a, b in zip(got[1], ref[1]):
        assert numpy.array_equal(a, b)


def test_headroom_is_what_the_buffers_leave_below_their_peak():
    net = build()
    plan = make_plan(net, 'shared')
    live = liveness.live_bytes_by_step(plan.buffers, plan.steps)
    room = liveness.headroom(net, plan.buffers, plan.steps)
    L = len(net.layers)
    conv2 = net._layer_names.index('conv2')
    t = 2 * L - 1 - conv2
    assert room[(conv2, 'forward')] == max(live) - live[conv2]
    assert room[(conv2, 'backward')] == max(live) - live[t]
    # The filter call runs before conv1's diff (written by conv2's backward) exists.
    written = sum(b.nbytes for b in plan.buffers if b.start == t)
    assert written > 0
    assert room[(conv2, 'backward_filter')] == room[(conv2, 'backward')] + written
    assert (conv2, 'backward') not in liveness.headroom(net, plan.buffers, plan.steps,
                                                         training=False)


def test_shared_keeps_each_calls_fastest_algorithm(monkeypatch):
    """Plan `shared` promises `arena`'s time: its calls never trade their
    fastest algorithm for a slower one that fits (the trade saved no memory
    on the H100's bench nets); `offload` and `auto` trade up to 10%;
    SLOWDOWN_FOR_EVERY_PLAN sets another share, and a bad one is named."""
    from caffeplus.errors import CaffeplusError
    from caffeplus.memory import workspace
    assert workspace.headroom_slowdown('shared') == 0.0
    assert workspace.headroom_slowdown('offload') == workspace.headroom_slowdown('auto') == 0.10
    monkeypatch.setattr(workspace, 'SLOWDOWN_FOR_EVERY_PLAN', 0.05)
    assert workspace.headroom_slowdown('shared') == workspace.headroom_slowdown('offload') == 0.05
    for bad in (-1, float('nan')):
        monkeypatch.setattr(workspace, 'SLOWDOWN_FOR_EVERY_PLAN', bad)
        with pytest.raises(CaffeplusError, match='SLOWDOWN_FOR_EVERY_PLAN'):
            workspace.headroom_slowdown('shared')
    # What within_headroom does with either share: a 5% slower candidate
    # that fits is taken at 10%, not at 0.
    from collections import namedtuple
    C = namedtuple('C', 'memory time deterministic')
    fast, near = C(1000, 1.0, True), C(10, 1.05, True)
    assert workspace.within_headroom([fast, near], fast, 100, slowdown=0.10) is near
    assert workspace.within_headroom([fast, near], fast, 100, slowdown=0.0) is fast
