"""When an offloaded map's copies run, on a timeline of step times: plan
`auto`'s held offload.

    holds, stall = schedule(net, bufs, offloaded, step_seconds)
    stall = schedule(net, bufs, offloaded, other_seconds, holds=holds)[1]

A map lent to the next buffers right after its last forward use makes
them wait for its copy out, and one fetched a step before its consumer
makes the consumer wait for its copy back. At VGG-16 b256 conv1_1's output
(3.3 GB, 66 ms each way) is used again 13 ms after it is written, and
fetched one step (a ReLU) before conv1_2's backward. Plan `auto` may
instead hold a map's bytes until its copy out is predicted done (while the
forward's later, smaller maps are live, below the backward's peak) and
fetch it as early as the copies back before it require; the placement of
the resulting lives then says whether that still fits the budget.

holds: {buffer key: free_offload.Hidden(release, prefetch)}, as
offload.shorten takes them: the map's bytes are its own until step
`release` and again from step `prefetch`. Copies out run one after
another in the order of their last forward use and copies back in the
order of their prefetch steps, each taking bytes / bandwidth * MARGIN (as
caffeplus.memory.offload_runtime issues them on two copy streams). A map
whose copy out cannot end before the step ahead of its consumer is not
held: it leaves after its last forward use and the compute waits.
"""
from caffeplus.memory import free_offload, offload

PCIE_BANDWIDTH = 50e9
MARGIN = free_offload.MARGIN


def _items(net, bufs, offloaded):
    """(key, bytes, last forward step, first backward step) of each
    offloaded buffer, in the order its copy out is issued."""
    keys = set(offloaded)
    items = []
    for b in bufs:
        if b.key in keys:
            fwd, bwd = offload._uses(net, b)
            items.append((b.key, b.nbytes, max(fwd), min(bwd)))
    items.sort(key=lambda it: (it[2], it[3]))
    return items


def _latest_step(starts, lo, hi, time):
    """The latest step in [lo, hi] that starts by `time` (None: none does)."""
    for s in range(hi, lo - 1, -1):
        if starts[s] <= time + 1e-12:
            return s
    return None


def _simulate(items, holds, step_seconds, bandwidth, margin):
    """Seconds the compute waits, stepping through the iteration as the
    runtime does: a step waits for the copies out of the maps whose bytes
    it may take (from `release` on) and for the copies back of the maps it
    consumes; each copy starts when issued and its stream is free."""
    release_at, fetch_at, consume_at, out_after = {}, {}, {}, {}
    for it in items:
        key, _, last_fwd, first_back = it
        release_at.setdefault(holds[key].release, []).append(it)
        fetch_at.setdefault(holds[key].prefetch, []).append(it)
        consume_at.setdefault(first_back, []).append(it)
        out_after.setdefault(last_fwd, []).append(it)
    t, link_out, link_in = 0.0, 0.0, 0.0
    out_end, back_end = {}, {}
    for s, seconds in enumerate(step_seconds):
        for key, _, _, _ in release_at.get(s, ()):
            t = max(t, out_end[key])
        for key, nbytes, _, _ in fetch_at.get(s, ()):
            link_in = max(link_in, t, out_end[key]) + nbytes * margin / bandwidth
            back_end[key] = link_in
        for key, _, _, _ in consume_at.get(s, ()):
            t = max(t, back_end[key])
        t += seconds
        for key, nbytes, _, _ in out_after.get(s, ()):
            link_out = max(link_out, t) + nbytes * margin / bandwidth
            out_end[key] = link_out
    return max(0.0, t - sum(step_seconds))


def schedule(net, bufs, offloaded, step_seconds, bandwidth=None, margin=MARGIN, holds=None):
    """(holds, seconds the compute waits for the copies). Given `holds`,
    only the wait of those holds under `step_seconds`."""
    if bandwidth is None:
        bandwidth = PCIE_BANDWIDTH
    step_seconds = list(step_seconds)
    items = _items(net, bufs, offloaded)
    if holds is None:
        holds = _choose(items, step_seconds, bandwidth, margin)
    return holds, _simulate(items, holds, step_seconds, bandwidth, margin)


def _choose(items, step_seconds, bandwidth, margin):
    """Holds on the timeline of `step_seconds` without waiting: release at
    the first step after the copy out's predicted end, prefetch at the
    latest step whose copy back still ends in time."""
    starts, ends = free_offload._timeline(step_seconds)
    release, prefetch = {}, {}
    link, out_end = 0.0, {}
    for key, nbytes, last_fwd, first_back in items:
        link = max(link, ends[last_fwd]) + nbytes * margin / bandwidth
        out_end[key] = link
        r = free_offload._first_step_from(starts, link, last_fwd + 1)
        release[key] = r if r is not None and r < first_back - 1 else last_fwd + 1
    # Latest consumer first: each copy back ends before its consumer starts
    # and before the next one back has to begin.
    must_end = float('inf')
    for key, nbytes, last_fwd, first_back in sorted(items, key=lambda it: -it[3]):
        latest = min(starts[first_back], must_end) - nbytes * margin / bandwidth
        s = _latest_step(starts, release[key], first_back - 1, latest)
        prefetch[key] = release[key] if s is None else s
        must_end = latest
    return {key: free_offload.Hidden(release[key], prefetch[key]) for key, _, _, _ in items}
