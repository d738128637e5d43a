"""Offload policy 'free' (caffeplus.memory.free_offload): only the feature
maps whose copies the step times hide.

The choice is checked against a replay of the runtime's two copy streams
written here (each stream runs its copies one after another in issue order;
a copy back starts when issued and when its copy out has ended), so a
choice whose copies would make compute wait fails; training under the
policy is checked bit-identical to `shared` on the CPU (simulated copies).
"""
import numpy
import pytest

import caffeplus

from caffeplus import config
from caffeplus.memory import free_offload, liveness, offload
from caffeplus.memory.apply import apply_named_plan
from caffeplus.memory.budget import estimate_plan
from test_memory_apply import small_net, sgd_run

# A chain of equal maps: its peak is where forward turns into backward (every
# conv input kept), so maps away from there can leave the device.
CONVS = 7
CHAIN = 'name: "chain"\n' \
    'layer { name: "data" type: "DummyData" top: "data" top: "label" dummy_data_param { ' \
    'data_filler { type: "gaussian" std: 1 } shape { dim: 4 dim: 6 dim: 10 dim: 10 } ' \
    'data_filler { type: "uniform" min: 0 max: 4.99 } shape { dim: 4 } } }\n' + ''.join(
        'layer { name: "c%d" type: "Convolution" bottom: "%s" top: "c%d" convolution_param { '
        'num_output: 6 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }\n'
        'layer { name: "r%d" type: "ReLU" bottom: "c%d" top: "c%d" }\n'
        % (i, 'data' if i == 1 else 'c%d' % (i - 1), i, i, i, i) for i in range(1, CONVS + 1)) + \
    'layer { name: "ip" type: "InnerProduct" bottom: "c%d" top: "ip" inner_product_param { ' \
    'num_output: 5 weight_filler { type: "xavier" } } }\n' \
    'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }\n' \
    % CONVS


def _setup(seconds=None):
    net = small_net()
    bufs = liveness.buffers(net, training=True)
    cands = offload.choose(net, bufs, 'all')
    L = len(net.layers)
    steps = seconds or [1.0] * (2 * L)
    return net, bufs, cands, steps


def _replay(net, bufs, hidden, steps, bandwidth, margin=free_offload.MARGIN):
    """Each chosen map's copies as the runtime issues them: (out end, release
    start, back end, consumer start); asserts the streams never overlap."""
    starts = [sum(steps[:s]) for s in range(len(steps))]
    uses = {b.key: (offload._uses(net, b), b.nbytes) for b in bufs if b.key in hidden}
    out_order = sorted(hidden, key=lambda k: (max(uses[k][0][0]), min(uses[k][0][1])))
    t, out_end = 0.0, {}
    for k in out_order:
        (fwd, _), n = uses[k]
        t = max(t, starts[max(fwd)] + steps[max(fwd)]) + n * margin / bandwidth
        out_end[k] = t
    t, result = 0.0, {}
    for k in sorted(hidden, key=lambda k: hidden[k].prefetch):
        (_, bwd), n = uses[k]
        t = max(t, starts[hidden[k].prefetch], out_end[k]) + n * margin / bandwidth
        result[k] = (out_end[k], starts[hidden[k].release], t, starts[min(bwd)])
    return result


def test_fast_link_offloads_every_map_with_an_idle_gap():
    net, bufs, cands, steps = _setup()
    hidden = free_offload.choose_hidden(net, bufs, cands, steps, 1e18)
    assert hidden
    for b in bufs:
        if b.key in cands:
            fwd, bwd = offload._uses(net, b)
            # Copies take no time: only a gap of fewer than 3 steps stops it.
            assert (b.key in hidden) == (min(bwd) - max(fwd) >= 3), b.key


def test_no_link_offloads_nothing():
    net, bufs, cands, steps = _setup()
    assert free_offload.choose_hidden(net, bufs, cands, steps, 0) == {}
    assert free_offload.choose_hidden(net, bufs, cands, steps, 1e-3) == {}


@pytest.mark.parametrize('bandwidth', [300.0, 1000.0, 3000.0, 1e4])
def test_chosen_copies_end_in_time(bandwidth):
    """With a link that hides some copies but not all, every chosen copy
    out ends before its bytes are released, every copy back before its
    consumer, and each map leaves the device for at least a step."""
    net, bufs, cands, steps = _setup([0.5 + 0.1 * (i % 5) for i in range(2 * len(
        small_net().layers))])
    hidden = free_offload.choose_hidden(net, bufs, cands, steps, bandwidth)
    for key, (out_end, released, back_end, needed) in _replay(
            net, bufs, hidden, steps, bandwidth).items():
        assert out_end <= released + 1e-9, key
        assert back_end <= needed + 1e-9, key
        assert hidden[key].release < hidden[key].prefetch
    every = free_offload.choose_hidden(net, bufs, cands, steps, 1e18)
    assert set(hidden) <= set(every)


def test_a_slower_link_hides_fewer_bytes():
    net, bufs, cands, steps = _setup()
    size = {b.key: b.nbytes for b in bufs}
    hidden_bytes = [sum(size[k] for k in free_offload.choose_hidden(net, bufs, cands, steps, bw))
                    for bw in (100.0, 1000.0, 1e4, 1e18)]
    assert hidden_bytes == sorted(hidden_bytes) and hidden_bytes[0] < hidden_bytes[-1]


def test_host_budget_limits_the_choice():
    net, bufs, cands, steps = _setup()
    size = {b.key: b.nbytes for b in bufs}
    every = free_offload.choose_hidden(net, bufs, cands, steps, 1e18)
    cap = sum(size[k] for k in every) - 1
    some = free_offload.choose_hidden(net, bufs, cands, steps, 1e18, host_budget=cap)
    assert sum(size[k] for k in some) <= cap and len(some) < len(every)


def _free_beside_shared(iters, mode='lazy', bandwidth=1e15):
    """Train CHAIN under `shared` and under offload 'free' (simulated copies)
    for `iters` iterations; assert the same losses and weights bit for bit.
    Returns (free net, shared net)."""
    shared_net = small_net(memory='shared', text=CHAIN)
    shared = sgd_run(shared_net, iters=iters)
    net = small_net(text=CHAIN)
    apply_named_plan(net, 'offload', offload_policy='free',
                     runtime_options={'simulate': mode, 'bandwidth': bandwidth})
    got = sgd_run(net, iters=iters)
    assert shared[0] == got[0]
    assert all(numpy.array_equal(a, b) for a, b in zip(shared[1], got[1]))
    return net, shared_net


@pytest.mark.parametrize('bandwidth,mode', [(1e15, 'lazy'), (1e15, 'eager'), (1.0, 'lazy')])
def test_free_policy_trains_bit_identical_to_shared(bandwidth, mode):
    """The runtime times an early iteration without offload, chooses, places
    the arena again and trains on with the chosen maps offloaded."""
    net, shared_net = _free_beside_shared(6, mode, bandwidth)
    applied = net.applied_plan
    chosen = applied.options['plan_overrides']['offload_hidden']
    assert applied.replans == (1 if bandwidth > 1e9 else 0)    # none: the layout stays
    if bandwidth > 1e9:
        assert chosen and applied.runtime.stats['copies_in'] > 0
        assert set(applied.info()['offloaded']) == {n for k in chosen for n in k[1]}
        assert applied.arena_bytes < shared_net.applied_plan.arena_bytes
        # A fresh arena of that size, not a view of the larger one before.
        assert applied.arena_base().size == max(applied.arena_bytes // 4, 1)
    else:
        assert chosen == {} and applied.runtime is None


@pytest.mark.parametrize('placed_first', [False, True])
def test_free_policy_offloads_nothing_where_the_arena_would_not_shrink(monkeypatch,
                                                                      placed_first):
    """Maps chosen but whose absences do not lower the placed arena (here:
    each is absent only where the arena is not at its peak) stay on the
    device: the plans' placement says so before any re-layout, or (when
    that check is passed over) the placed arena does, and the plan goes
    back to no offload."""
    from caffeplus.memory.apply import AppliedPlan
    if placed_first:
        monkeypatch.setattr(AppliedPlan, '_free_offload_shrinks', lambda self, hidden: True)
    L = len(small_net().layers)
    real = free_offload.choose_hidden

    def no_gain(*args, **kw):
        hidden = real(*args, **kw)
        # absent only during the first step of backward, far from the peak
        return {k: free_offload.Hidden(L, L + 1) for k, h in hidden.items()
                if h.release <= L < L + 1 < h.prefetch}
    monkeypatch.setattr(free_offload, 'choose_hidden', no_gain)
    shared_net = small_net(memory='shared')
    shared = sgd_run(shared_net, iters=5)
    net = small_net()
    apply_named_plan(net, 'offload', offload_policy='free',
                     runtime_options={'simulate': 'lazy', 'bandwidth': 1e15})
    got = sgd_run(net, iters=5)
    assert shared[0] == got[0]
    applied = net.applied_plan
    assert applied.options['plan_overrides']['offload_hidden'] == {}
    assert applied.runtime is None and applied.replans == (2 if placed_first else 0)
    assert applied.arena_bytes == shared_net.applied_plan.arena_bytes


def test_free_estimate_adds_no_time_and_no_memory(monkeypatch):
    net = small_net()
    shared = estimate_plan(net, 'shared')
    free = estimate_plan(net, 'offload', offload_policy='free')
    # A map offloaded is not made again (caffeplus.memory.recompute): that
    # forward's time is saved.
    assert free.est_iter_ms <= shared.est_iter_ms
    config.set('recompute', '0')
    assert estimate_plan(net, 'offload', offload_policy='free').est_iter_ms == \
        pytest.approx(estimate_plan(net, 'shared').est_iter_ms)
    # The offload runtime holds no device memory of its own.
    assert free.peak_bytes <= shared.peak_bytes
    assert free.breakdown['other'] == shared.breakdown['other']


def test_copy_out_follows_the_last_forward_use_even_when_bytes_are_held_into_backward(
        monkeypatch):
    """A slow copy out holds its map's bytes into backward (release >= L): the
    copy must still be issued after the map's last forward use, not at the
    end of the held life."""
    L = len(small_net(text=CHAIN).layers)
    real = free_offload.choose_hidden
    held = []

    def held_long(*args, **kw):
        hidden = real(*args, **kw)
        first = min(hidden, key=lambda k: hidden[k].release)     # the others lower the peak
        held.append(first)
        hidden[first] = free_offload.Hidden(L + 1, hidden[first].prefetch)
        return hidden
    monkeypatch.setattr(free_offload, 'choose_hidden', held_long)
    net, _ = _free_beside_shared(5)
    rt = net.applied_plan.runtime
    assert rt.items and rt.stats['copies_out'] == rt.stats['copies_in'] > 0
    (it,) = [it for it in rt.items if it.entry.names == held[0][1]]
    assert it.last_fwd < L <= it.F.end and it.F.end + 1 < it.B.start


def test_an_estimated_free_plan_starts_without_offload():
    """caffeplus memory applies the estimate's plan; its modelled choice must
    not be what the runtime times: the runtime starts from no offload."""
    from caffeplus.memory.apply import apply_plan
    net = small_net(text=CHAIN)
    plan = estimate_plan(net, 'offload', offload_policy='free')
    assert plan.offloaded            # the model hides some
    apply_plan(net, plan, runtime_options={'simulate': 'lazy', 'bandwidth': 1e15})
    applied = net.applied_plan
    assert applied.info()['offloaded'] == [] and applied.runtime.choosing


def test_a_relayout_before_the_timing_keeps_the_choice_to_come():
    """A re-layout before the timed iteration (the placed workspace's, after
    the algorithm search) must not mark the runtime calibrated: policy
    'free' still times and chooses."""
    net = small_net(text=CHAIN)
    apply_named_plan(net, 'offload', offload_policy='free',
                     runtime_options={'simulate': 'lazy', 'bandwidth': 1e15})
    sgd_run(net, iters=1)
    net.applied_plan.relayout()
    sgd_run(net, iters=5)
    assert net.applied_plan.options['plan_overrides']['offload_hidden']


def test_the_choice_takes_the_median_of_several_timed_iterations(monkeypatch):
    """One iteration's step times move from run to run (GoogLeNet's choice
    went between 12 and 20 maps): 'free' chooses on the per-step median of
    FREE_SAMPLES timed iterations, a re-layout between them keeping those
    taken, and chooses once."""
    from caffeplus.memory import offload_runtime as rt
    net = small_net(text=CHAIN)
    apply_named_plan(net, 'offload', offload_policy='free',
                     runtime_options={'simulate': 'lazy', 'bandwidth': 1e15})
    steps = 2 * len(net.layers)
    scripted = [[0.001 * (k + 1)] * steps for k in (0, 4, 1)]     # medians: 0.002
    scripted[1][0] = 1.0        # one step's outlier (a stall) in the middle sample
    timed, chosen = [], []
    monkeypatch.setattr(rt.OffloadRuntime, '_seconds',
                        lambda self, timing: timed.append(1) or list(scripted[len(timed) - 1]))

    def choose(self, seconds, bandwidth):
        chosen.append(seconds)
        return {}
    monkeypatch.setattr(rt.OffloadRuntime, '_choose_free', choose)
    sgd_run(net, iters=rt.CALIBRATE_AT + 1)
    net.applied_plan.relayout()         # (the placed workspace's, say) between two samples
    sgd_run(net, iters=rt.FREE_SAMPLES + 2)
    assert len(timed) == rt.FREE_SAMPLES == 3
    assert chosen == [[0.002] * steps]


def test_step_share_defaults_and_setting(monkeypatch):
    from caffeplus.errors import CaffeplusError
    assert free_offload.step_share() == free_offload.STEP_SHARE == 0.8
    monkeypatch.setattr(free_offload, 'STEP_SHARE', 1)
    assert free_offload.step_share() == 1.0
    for bad in (0, 1.5, -0.2, 'most'):
        monkeypatch.setattr(free_offload, 'STEP_SHARE', bad)
        with pytest.raises(CaffeplusError, match='STEP_SHARE must be a share'):
            free_offload.step_share()


@pytest.mark.parametrize('share', [1, 0.5])
def test_runtime_and_estimate_hide_copies_behind_the_share_of_the_steps(monkeypatch, share):
    """The runtime chooses on its measured step times and the estimate on
    its modelled ones, both times the share: the times choose_hidden sees."""
    monkeypatch.setattr(free_offload, 'STEP_SHARE', share)
    real, seen = free_offload.choose_hidden, []

    def spy(net, bufs, candidates, step_seconds, *args, **kw):
        seen.append(list(step_seconds))
        return real(net, bufs, candidates, step_seconds, *args, **kw)
    monkeypatch.setattr(free_offload, 'choose_hidden', spy)
    from caffeplus.memory import workspace_model as wm
    net = small_net(text=CHAIN)
    estimate_plan(net, 'offload', offload_policy='free')
    convs = wm.conv_layers(net)
    modelled = wm.step_seconds(net, {i: wm.fastest(l, wm.knee_cap(net)) for i, l in convs})
    assert seen[-1] == pytest.approx([t * float(share) for t in modelled])
    from caffeplus.memory.offload_runtime import OffloadRuntime
    real_choose, measured = OffloadRuntime._choose_free, []

    def choose(self, seconds, bandwidth):
        measured.append(list(seconds))
        return real_choose(self, seconds, bandwidth)
    monkeypatch.setattr(OffloadRuntime, '_choose_free', choose)
    net = small_net(text=CHAIN)
    apply_named_plan(net, 'offload', offload_policy='free',
                     runtime_options={'simulate': 'eager', 'bandwidth': 1e15})
    seen.clear()
    sgd_run(net, iters=4)
    assert len(measured) == 1 and len(seen) == 1
    assert len(seen[0]) == 2 * len(net.layers)
    assert seen[0] == pytest.approx([t * float(share) for t in measured[0]])


def test_on_the_gpu_a_step_hides_copies_behind_at_most_its_modelled_time(monkeypatch):
    """A measured GPU step includes the host's gaps (a host-bound net): the
    runtime hides copies behind min(measured, modelled) times the share;
    the simulated CPU device keeps its measured steps; the setting lifts it."""
    from caffeplus.memory import workspace_model as wm
    from caffeplus.memory.offload_runtime import OffloadRuntime
    monkeypatch.setattr(free_offload, 'STEP_SHARE', 0.5)
    assert free_offload.hiding_seconds([2.0, 1.0, 4.0], 0.5) == [1.0, 0.5, 2.0]
    assert free_offload.hiding_seconds([2.0, 1.0, 4.0], 0.5, [1.0, 3.0, 0.0]) == [0.5, 0.5, 0.0]
    net = small_net(text=CHAIN)
    convs = wm.conv_layers(net)
    modelled = wm.step_seconds(net, {i: wm.fastest(l, wm.knee_cap(net)) for i, l in convs})
    assert free_offload.modelled_step_seconds(net) == pytest.approx(modelled)
    seen = []

    def spy(net, bufs, candidates, step_seconds, *args, **kw):
        seen.append(list(step_seconds))
        return {}
    monkeypatch.setattr(free_offload, 'choose_hidden', spy)
    apply_named_plan(net, 'offload', offload_policy='free',
                     runtime_options={'simulate': 'eager', 'bandwidth': 1e15})
    rt = net.applied_plan.runtime
    measured = [m * 1e3 + 1.0 for m in modelled]       # a host far slower than the model
    for kind, bound, want in (('sim', True, [t * 0.5 for t in measured]),
                              ('cuda', True, [t * 0.5 for t in modelled]),
                              ('cuda', False, [t * 0.5 for t in measured])):
        monkeypatch.setattr(rt.device, 'kind', kind)
        monkeypatch.setattr(free_offload, 'MODEL_BOUND', bound)
        OffloadRuntime._choose_free(rt, measured, 1e9)
        assert seen[-1] == pytest.approx(want), kind


def test_the_data_layers_batch_can_leave_and_its_copy_goes_out_after_the_data_layer():
    """Policy 'free' also weighs the data layer's batch (read again only by
    the first convolution's filter gradient): its copy is issued after the
    data layer, beside the first convolution's forward, it comes back for
    that backward and stays readable after the iteration; training stays
    bit-identical to `shared`. The other policies leave it."""
    net = small_net(text=CHAIN)
    bufs = liveness.buffers(net, training=True)
    batch = [b for b in bufs if b.blobs == ('data',)][0]
    assert batch.key in offload.choose(net, bufs, 'free')
    assert batch.key not in offload.choose(net, bufs, 'all')
    fwd, bwd = offload._uses(net, batch)
    assert (max(fwd), offload.copy_out_step(net, batch)) == (1, 0)
    c1 = [b for b in bufs if b.blobs == ('c1',)][0]
    assert offload.copy_out_step(net, c1) == max(offload._uses(net, c1)[0])
    # One step of the data layer hides its copy issued there, not one issued
    # after conv1's (a long step: the copy would end only after c3's forward).
    L = len(net.layers)
    steps = [1.0] * (2 * L)
    steps[1] = 10.0
    nbytes = batch.nbytes * free_offload.MARGIN
    hidden = free_offload.choose_hidden(net, bufs, [batch.key], steps, nbytes / 0.9)
    assert hidden[batch.key].release == 2
    net, _ = _free_beside_shared(6)
    applied = net.applied_plan
    assert 'data' in applied.info()['offloaded']
    # Moved into the arena, the batch no longer counts outside it: the
    # choice is weighed on the arena and those storages together.
    assert not any('data' in e.names for e in applied.persistent)
    assert applied.placed_bytes() == applied.arena_bytes + sum(
        e.lives[0].buf.nbytes for e in applied.persistent)
    ref = small_net(memory='shared', text=CHAIN)
    for n in (ref, net):
        caffeplus.set_random_seed(11)
        n.forward()
        n.backward()
    assert numpy.array_equal(ref.blobs['data'].data, net.blobs['data'].data)


def test_the_chosen_layout_gets_a_fresh_arena_of_its_size(monkeypatch):
    """The old arena, were it at most SPARE_SLACK larger, would serve a new
    layout again and keep the bytes the choice saves: adopting the choice
    takes an arena of exactly the new size."""
    from caffeplus.memory import apply as apply_mod
    monkeypatch.setattr(apply_mod, 'SPARE_SLACK', 0.125)    # any old arena up to 9x the size
    net = small_net(text=CHAIN)
    apply_named_plan(net, 'offload', offload_policy='free',
                     runtime_options={'simulate': 'lazy', 'bandwidth': 1e15})
    before = net.applied_plan.arena_base().size
    sgd_run(net, iters=6)
    applied = net.applied_plan
    assert applied.options['plan_overrides']['offload_hidden']
    assert applied.arena_bytes // 4 < before <= 9 * (applied.arena_bytes // 4)
    assert applied.arena_base().size == applied.arena_bytes // 4


def test_an_offloaded_16_bit_map_gets_a_host_buffer_of_its_bytes():
    """The pinned host copy of an offloaded map holds its bytes, not a
    float32 per value: half the values' count for a FLOAT16 map."""
    import types
    from caffeplus.memory.offload_runtime import _Item

    def entry(view):
        live = types.SimpleNamespace(view=view, start=3)
        return types.SimpleNamespace(lives=(live, live))
    assert _Item(entry(numpy.zeros(7, numpy.float32)), 1, 3, 1).count == 7
    assert _Item(entry(numpy.zeros(7, numpy.float16)), 1, 3, 1).count == 4
    assert _Item(entry(numpy.zeros(8, numpy.float16)), 1, 3, 1).count == 4
