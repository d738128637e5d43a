"""Offload that costs no time (offload policy 'free'): the feature maps
whose copies the measured step times hide.

    hidden = choose_hidden(net, bufs, candidates, step_seconds, bandwidth)
    # {buffer key: Hidden(release, prefetch)}

vDNN's copies are free only while the link keeps up with the compute. This
chooses maps by the runtime's own rules (caffeplus.memory.offload_runtime),
on a timeline of step times (the measured ones times STEP_SHARE, below):
  * a map's copy out is issued when its last forward step f ends (a data
    layer's batch: when the data layer's step ends, offload.copy_out_step)
    and runs on the copy-out stream, one copy after another in issue order, taking
    bytes / bandwidth * MARGIN;
  * its device bytes stay reserved until `release`, the first step that
    starts after the copy's predicted end, so no later buffer has to wait
    for the copy (the runtime still waits, should a copy be slower);
  * its copy back runs on the copy-in stream, in issue order, issued at the
    start of step `prefetch` and not before its copy out ended; it must end
    before its first backward step b starts. `prefetch` is the latest step
    that lets it, given the copies back that follow it.
Maps are taken in the order of their last forward use (vDNN's order: the
earliest have the longest idle gap), each only if with it every taken
map's copies still end in time and it leaves the device for at least one
step (release < prefetch).
"""
import collections

from caffeplus.errors import CaffeplusError
from caffeplus.memory import offload

MARGIN = 1.25
# Copies hide behind this share of the step times (the runtime's measured
# ones, the estimate's modelled ones; in (0, 1]). Behind the whole steps the copies are not hidden:
# interleaved with `shared` (benchmarks/time_plans.py) GoogLeNet runs x1.30 and
# ResNet-50 x1.04-1.08, the layers' stream waiting about 1.5 ms an iteration
# in forward for copies out still running (dev/trace_plans.py --offload
# free); at 0.9 x1.12 and x1.02, at 0.8 x1.02 and x1.01, for 7% (GoogLeNet)
# and 2.5% (ResNet-50) more memory.
STEP_SHARE = 0.8


def step_share():
    """The share of the step times copies hide behind (STEP_SHARE, checked)."""
    share = STEP_SHARE
    if not isinstance(share, (int, float)) or not 0.0 < share <= 1.0:
        raise CaffeplusError('STEP_SHARE must be a share of the step times in (0, 1], not %r'
                             % (share,))
    return share


Hidden = collections.namedtuple('Hidden', 'release prefetch')

# On the GPU a measured step is the time between the compute stream's marks,
# which on a net whose GPU waits for the host (GoogLeNet: idle a third of an
# iteration) includes the host's gaps; a copy hidden only behind those runs
# into the compute once the host runs faster, and host speed moves by 15-30%
# between runs. So on the GPU a step hides copies behind at most its modelled
# device time (caffeplus.memory.workspace_model, what the estimate hides
# behind). Behind its measured steps GoogLeNet's runtime moves about 900 MB
# each way an iteration and runs x1.07-1.14 of `shared`; the model hides
# none of them. False lifts the bound.
MODEL_BOUND = True


def model_bound():
    return MODEL_BOUND


def modelled_step_seconds(net):
    """The 2L steps' modelled device seconds (the estimate's: each
    convolution at the fastest algorithm within the arena's knee)."""
    from caffeplus.memory import workspace_model as wm
    cap = wm.knee_cap(net)
    return wm.step_seconds(net, {i: wm.fastest(l, cap) for i, l in wm.conv_layers(net)})


def hiding_seconds(measured, share, modelled=None):
    """The seconds copies may hide behind at each step: `share` of the
    measured step, and with `modelled` (the GPU) at most `share` of its
    modelled device time."""
    if modelled is None:
        return [t * share for t in measured]
    return [min(t, m) * share for t, m in zip(measured, modelled)]


def _timeline(step_seconds):
    starts, t = [], 0.0
    for s in step_seconds:
        starts.append(t)
        t += s
    return starts, starts[1:] + [t]


def _first_step_from(starts, time, lo):
    """The first step >= lo that starts at or after `time` (None: none does)."""
    for s in range(lo, len(starts)):
        if starts[s] >= time - 1e-12:
            return s
    return None


def _plan_copies(items, starts, ends, bandwidth, margin, issue):
    """{key: Hidden} for `items` ((key, nbytes, last_fwd, first_back), in
    issue order of their copies out), or None when some copy cannot end in
    time. `issue`: {key: step} after which each copy out is issued
    (offload.copy_out_step; before the last forward use for a data layer's
    batch, whose bytes are still held until that use)."""
    out_end, link = {}, 0.0
    release = {}
    for key, nbytes, last_fwd, first_back in items:
        link = max(link, ends[issue[key]]) + nbytes * margin / bandwidth
        out_end[key] = link
        r = _first_step_from(starts, link, last_fwd + 1)
        if r is None or r >= first_back:
            return None
        release[key] = r
    # Copies back, latest consumer first: each must end before its consumer
    # starts and before the next copy back (in issue order) has to begin.
    prefetch, must_end = {}, float('inf')
    for key, nbytes, last_fwd, first_back in sorted(items, key=lambda it: -it[3]):
        dur = nbytes * margin / bandwidth
        latest_start = min(starts[first_back], must_end) - dur
        if latest_start < out_end[key] - 1e-12:
            return None
        s = None
        for step in range(first_back - 1, release[key], -1):   # absent >= 1 step
            if starts[step] <= latest_start + 1e-12:
                s = step
                break
        if s is None:
            return None
        prefetch[key] = s
        must_end = latest_start
    # The runtime issues copies back in order of their steps (ties: the
    # order of issue out); check the whole schedule in that order.
    order = sorted(items, key=lambda it: prefetch[it[0]])
    link = 0.0
    for key, nbytes, last_fwd, first_back in order:
        link = max(link, starts[prefetch[key]], out_end[key]) + nbytes * margin / bandwidth
        if link > starts[first_back] + 1e-12:
            return None
    return {key: Hidden(release[key], prefetch[key]) for key, _, _, _ in items}


def choose_hidden(net, bufs, candidates, step_seconds, bandwidth, margin=MARGIN,
                  host_budget=None):
    """{buffer key: Hidden(release, prefetch)} of the maps among `candidates`
    (buffer keys, offload.choose's) whose copies the times hide; see the
    module docstring. `step_seconds`: the 2L steps' measured (or modelled)
    seconds; `bandwidth`: bytes a second each way; `host_budget`: the most
    bytes the chosen maps may take in pinned host memory (None: no limit)."""
    if not bandwidth or bandwidth <= 0:
        return {}
    starts, ends = _timeline(list(step_seconds))
    candidates = set(candidates)
    items, issue = [], {}
    for b in bufs:
        if b.key not in candidates:
            continue
        fwd, bwd = offload._uses(net, b)
        if fwd and bwd:
            items.append((b.key, b.nbytes, max(fwd), min(bwd)))
            issue[b.key] = offload.copy_out_step(net, b)
    items.sort(key=lambda it: (issue[it[0]], it[2], it[3]))
    taken, plan, host = [], {}, 0
    for item in items:
        if host_budget is not None and host + item[1] > host_budget:
            continue
        trial = _plan_copies(taken + [item], starts, ends, bandwidth, margin, issue)
        if trial is None:
            continue
        taken.append(item)
        plan = trial
        host += item[1]
    return plan
