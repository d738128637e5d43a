#!/usr/bin/env python3
"""What still holds a memory plan's old arena after a growing re-layout
(the case of tests/test_memory_apply.py::test_gpu_relayout_frees_the_old_arena):
prints the referrers of the old arena's views. GPU: run from the repo root."""
import gc
import sys
sys.path.insert(0, 'tests'); sys.path.insert(0, '.')
import caffeplus
from caffeplus.memory import placement
from caffeplus.memory.apply import apply_named_plan
from plan_helpers import sgd_run
import test_memory_apply as T


def search(when, on_old):
    """Print every container that holds an array on the old arena."""
    found = 0
    for holder in gc.get_objects():
        if isinstance(holder, dict):
            items = list(holder.items())
        elif isinstance(holder, (list, tuple, set)):
            items = list(enumerate(holder))
        elif getattr(type(holder), '__slots__', None):     # e.g. a blob's Storage
            items = [(n, getattr(holder, n, None)) for n in type(holder).__slots__]
        else:
            continue
        for key, value in items:
            if on_old(value):
                found += 1
                owners = [type(o).__name__ for o in gc.get_referrers(holder)][:4]
                print('held: %s[%r] (held by %s) shape %s'
                      % (type(holder).__name__, key, owners, value.shape))
    print('%s: %d arrays on the old arena found in containers' % (when, found))


gc.disable()
caffeplus.set_mode_gpu(0)
if True:
    net = T.small_net(text=T.BN_NET)
    apply_named_plan(net, 'offload', offload_policy='all', lookahead=1)
    sgd_run(net, 2)
    applied = net.applied_plan
    import cupy
    mem = applied.arena_base().data.mem     # held here: only to find who else holds it
    real_place = placement.place
    placement.place = lambda bufs, *a: (real_place(bufs, *a)[0], 2 * real_place(bufs, *a)[1])
    far = {it.entry.names: it.first_back - it.last_fwd for it in applied.runtime.items}
    applied.relayout(lookahead_steps=far)
    sgd_run(net, 1)

    def on_old(o):
        return isinstance(o, cupy.ndarray) and o.data.mem is mem

    # Before the cyclic collector runs (disabled above): a cycle of garbage
    # holding the old arena keeps it until the collector happens to run.
    search('before gc.collect()', on_old)
    gc.collect()
    search('after gc.collect()', on_old)
    print('arena now', applied.arena_bytes, 'old', mem.size)
