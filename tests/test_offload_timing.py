"""Plan auto's held offload (caffeplus.memory.offload_timing): a map's bytes
stay its own while its copy out runs, and it comes back as early as the
copies back need. Waits are checked against hand-worked timelines; a plan
with holds trains bit-identical to `shared` (lazily simulated copies)."""
import numpy
import pytest

from caffeplus.memory import free_offload, liveness, offload, offload_timing
from caffeplus.memory.apply import apply_plan
from caffeplus.memory.plan import make_plan
from test_free_offload import CHAIN, _replay
from test_memory_apply import small_net, sgd_run

MARGIN = offload_timing.MARGIN


def _chain():
    net = small_net(text=CHAIN)
    bufs = liveness.buffers(net, training=True)
    return net, bufs, 2 * len(net.layers)


def _key(bufs, blob):
    return [b for b in bufs if b.kind == 'data' and b.blobs == (blob,)][0].key


def _bandwidth_for(bufs, key, seconds):
    """The bandwidth at which the map's copy takes `seconds` (with the margin)."""
    nbytes = [b.nbytes for b in bufs if b.key == key][0]
    return nbytes * MARGIN / seconds


def test_one_map_held_by_hand():
    """c1's map: written at step 1, last read in forward at step 3 (c2),
    first read in backward at step 30 (c2's backward). Steps of 1 s, copies
    of 2.5 s: out from t=4 to 6.5, so its bytes are lent from step 7; back
    from step 27 (t=27 to 29.5), before step 30 starts. Nothing waits."""
    net, bufs, steps = _chain()
    key = _key(bufs, 'c1')
    bw = _bandwidth_for(bufs, key, 2.5)
    holds, stall = offload_timing.schedule(net, bufs, [key], [1.0] * steps, bw)
    assert holds == {key: free_offload.Hidden(7, 27)} and stall == pytest.approx(0.0)
    # Lent at once (release at step 4) and fetched one step ahead (29):
    # step 4 waits 2.5 s for the copy out; the copy back, issued at step
    # 29's start (now t=31.5), ends at 34, 1.5 s after step 30 was due.
    lent = {key: free_offload.Hidden(4, 29)}
    assert offload_timing.schedule(net, bufs, [key], [1.0] * steps, bw, holds=lent) == \
        (lent, pytest.approx(4.0))


def test_a_copy_too_long_to_hold_leaves_at_once_and_waits():
    """A 27 s copy of c1's map cannot end before step 29: it is not held
    (lent from step 4), and step 4 waits for it."""
    net, bufs, steps = _chain()
    key = _key(bufs, 'c1')
    bw = _bandwidth_for(bufs, key, 27.0)
    holds, stall = offload_timing.schedule(net, bufs, [key], [1.0] * steps, bw)
    assert holds[key].release == 4
    assert stall >= 27.0 - 1e-9


@pytest.mark.parametrize('seconds', [0.2, 1.0, 3.0])
def test_held_copies_end_in_time_where_the_link_keeps_up(seconds):
    """The chain's maps idle for 3 steps or more, each copy `seconds` long: the
    held maps' copies out end before their bytes are lent, the copies back
    before their consumers (the runtime's two streams replayed), and then
    nothing waits."""
    net, bufs, steps = _chain()
    candidates = offload.choose(net, bufs, 'all')
    gap = {b.key: min(offload._uses(net, b)[1]) - max(offload._uses(net, b)[0])
           for b in bufs if b.key in candidates}
    # (A map read again two steps later cannot be held and away at once.)
    keys = [k for k in candidates if gap[k] >= 4]
    assert len(keys) >= 3
    step_seconds = [1.0 + 0.1 * (i % 3) for i in range(steps)]
    bw = _bandwidth_for(bufs, keys[0], seconds)         # the maps are of one size
    holds, stall = offload_timing.schedule(net, bufs, keys, step_seconds, bw)
    late = False
    for key, (out_end, released, back_end, needed) in _replay(
            net, bufs, holds, step_seconds, bw).items():
        fwd, _ = offload._uses(net, [b for b in bufs if b.key == key][0])
        if holds[key].release > max(fwd) + 1:
            assert out_end <= released + 1e-9, key
        late = late or out_end > released + 1e-9 or back_end > needed + 1e-9
    assert (stall > 1e-9) == late
    if seconds <= 1.0:
        assert stall == pytest.approx(0.0)


def test_a_plan_with_held_maps_trains_bit_identical_to_shared():
    shared = sgd_run(small_net(memory='shared', text=CHAIN), iters=5)
    net = small_net(text=CHAIN)
    bufs = liveness.buffers(net, training=True)
    keys = offload.choose(net, bufs, 'all')
    steps = 2 * len(net.layers)
    holds, _ = offload_timing.schedule(net, bufs, keys, [1.0] * steps,
                                       _bandwidth_for(bufs, keys[0], 2.5))
    assert any(h.release > 4 for h in holds.values())
    plan = make_plan(net, 'offload', offload_policy='all', offload_holds=holds)
    assert plan.offload_holds == holds
    apply_plan(net, plan, runtime_options={'simulate': 'lazy'})
    applied = net.applied_plan
    for e in applied.entries:
        if e.offloaded:
            h = holds[e.lives[0].buf.key[:2]]
            # The planned lives, not the default look-ahead of one step.
            assert (e.lives[0].end, e.lives[1].start) == (h.release - 1, h.prefetch)
    got = sgd_run(net, iters=5)
    assert shared[0] == got[0]
    assert all(numpy.array_equal(a, b) for a, b in zip(shared[1], got[1]))
    assert applied.runtime.stats['copies_in'] > 0
