"""Estimated plans, and `auto`: the fastest plan that fits a memory budget.

    from caffeplus.memory import budget
    plan = budget.estimate_plan(net, 'shared')            # numbers without a GPU
    plan = budget.plan_for_budget(net, budget.parse_bytes('12G'))

`estimate_plan` is caffeplus.memory.plan.make_plan with the workspace and
"other" of caffeplus.memory.workspace_model, and an estimated iteration time
(`plan.est_iter_ms`).

`plan_for_budget` searches the knobs of the `shared` plan:
  * the set S of feature maps offloaded to host memory between their forward
    and backward use (vDNN), drawn from everything offload.choose(policy
    'all') allows, cheapest first (stall per byte), as prefixes of that order
    and the 'conv' policy's set; each held while its copy runs or lent at once
    (caffeplus.memory.offload_timing);
  * the maps made again in backward (caffeplus.memory.recompute): the cheap
    ones, then prefixes of the convolutions cheapest per byte, and for those
    whether their maps also leave between backward uses (split lives);
  * each convolution call's algorithm. Without a budget: the workspace
    arena's cap W, every call at its fastest candidate within W. Under a
    budget: every call takes the fastest candidate that fits what the
    option leaves at its half step (fit_calls; for the search by live
    bytes, for the placed plan by the largest hole below the arena's
    limit, the workspace placed after every other buffer), and the runtime
    keeps each call within those bytes (plan.call_workspace).
Candidates are cuDNN's measured ones where caffeplus.memory.calibration has
them (on the GPU auto times the net's convolutions before it plans), else
the model's (caffeplus.memory.workspace_model).
For each option the peak is parameters + diffs + history + other + the
busiest half step's live bytes and workspace, and the time is the layer-time
model under its algorithms plus the offload stalls and the forwards run
again. The option of least time whose peak fits is chosen (ties: the
smaller peak) and placed (the placed plans of the fastest few are
compared), and its set is then refined: maps are put back one at a time
while the placed plan still fits and gets faster (refine). If none fits,
CaffeplusError says the smallest budget that would.

Offload cost model: copying B bytes each way takes B / PCIE_BANDWIDTH
(50 GB/s, pinned host memory). The copy out overlaps the forward steps from
the one after the buffer is written through the one after its last forward
use; the copy back overlaps the step before its first backward use (the
prefetch distance offload.shorten plans for). Copies that share a window
share its time; a window's stall is what its copies take beyond its compute.
"""
import collections
import math
import re

from caffeplus.errors import CaffeplusError
from caffeplus.memory import calibration, cublas_pool, liveness, masks, placement, offload, \
    offload_timing, recompute, workspace_model as wm
from caffeplus.memory.kept_model import model_internals
from caffeplus.memory.plan import HISTORY_COPIES, make_plan, persistent_bytes
from caffeplus.memory.offload_timing import PCIE_BANDWIDTH
from caffeplus.solver import update_in_backward

_UNITS = {'': 1, 'k': 2 ** 10, 'm': 2 ** 20, 'g': 2 ** 30, 't': 2 ** 40}


def parse_bytes(text):
    """'12G', '800M', '1.5GiB', '512MB', '1073741824' -> bytes. K/M/G/T are
    binary (1G = 1GiB = 2**30 bytes) with or without 'i' and 'B'."""
    m = re.match(r'^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgGtT]?)(i?[bB])?\s*$', str(text or ''))
    if not m or (m.group(3) and m.group(3).lower() == 'ib' and not m.group(2)):
        raise CaffeplusError("cannot read '%s' as a memory size (examples: 12G, 800M, 1.5GiB, "
                             "1073741824)" % text)
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise CaffeplusError("memory size '%s' must be more than 0 bytes" % text)
    return value


def format_bytes(n):
    if n is None:
        return '-'
    n = int(n)
    if abs(n) >= 2 ** 30:
        return '%.2f GiB' % (n / 2 ** 30)
    if abs(n) >= 2 ** 20:
        return '%.1f MiB' % (n / 2 ** 20)
    if abs(n) >= 2 ** 10:
        return '%.1f KiB' % (n / 2 ** 10)
    return '%d B' % n


# -- time ---------------------------------------------------------------------------
def _windows(net, buf, L):
    """(out window, in window) of one offloaded buffer: lists of steps."""
    fwd, bwd = offload._uses(net, buf)
    first_write, last_fwd, first_back = min(fwd), max(fwd), min(bwd)
    out = list(range(first_write + 1, min(last_fwd + 1, 2 * L - 1) + 1))
    back = [max(first_back - 1, last_fwd + 1)]
    return out, back


def offload_windows(net, bufs, keys):
    """{buffer key: (out window, in window)} for the buffers in `keys`."""
    keys = set(keys)
    L = len(net.layers)
    return {b.key: (b.nbytes, _windows(net, b, L)) for b in bufs if b.key in keys}


def offload_stall_seconds(net, bufs, offloaded, steps, windows=None):
    """Seconds the copies of `offloaded` (buffer keys) add to an iteration
    whose steps take `steps` seconds (see the module docstring). `windows`:
    offload_windows() of a superset, to save recomputing them."""
    if windows is None:
        windows = offload_windows(net, bufs, offloaded)
    load = collections.defaultdict(float)
    for key in offloaded:
        nbytes, wins = windows[key]
        for window in wins:
            load[tuple(window)] += nbytes / PCIE_BANDWIDTH
    return sum(max(0.0, s - sum(steps[t] for t in w)) for w, s in load.items())


def iteration_seconds(net, choice=None, solver_type='SGD', stall=0.0):
    return sum(wm.step_seconds(net, choice)) + \
        wm.update_seconds(net, HISTORY_COPIES.get(solver_type, 1)) + stall


# -- estimated plans --------------------------------------------------------------
# The model's candidates in the terms of cuDNN's (caffeplus.cudnn.api.AlgoChoice),
# for the rule both choose by (workspace.within_headroom).
_Modelled = collections.namedtuple('_Modelled', 'memory time deterministic')


def placed_workspace_sizes(net, bufs, steps, training=True, cap=None, slowdown=None,
                           trade_share=None):
    """{layer index: (forward, backward data, backward filter) bytes}: the
    model's algorithms as the placed workspace chooses them at run time
    (caffeplus.memory.workspace.within_headroom): the fastest within `cap`,
    unless its workspace exceeds what the other buffers leave free below
    their peak at its step and a candidate at most 10% slower fits there.
    That exception needs real times: it is weighed for the calls cuDNN's
    measured candidates cover (caffeplus.memory.calibration); the model's
    own sliced and tiled candidates cost 1.02-1.08x where cuDNN's measured
    1.07-1.5x (VGG-16's 28-56 pixel maps, H100), so on them it found fits
    the runtime did not (VGG-16 b64 `offload` estimated 7.2% under the
    measured peak; with each call's fastest, 2.7%). (Plan auto under a
    budget fits every call to its step instead: fit_calls.) `slowdown`: the
    plan's share (workspace.headroom_slowdown; None: HEADROOM_SLOWDOWN);
    `trade_share`: its share of the convolution time for all trades
    (workspace.trade_time_share; None: none)."""
    from caffeplus.memory.workspace import HEADROOM_SLOWDOWN, trade_for_room
    if slowdown is None:
        slowdown = HEADROOM_SLOWDOWN
    if trade_share is None:
        trade_share = 0.0
    convs = wm.conv_layers(net)
    measured = {i for i, layer in convs if calibration.covers(layer)}
    room = liveness.headroom(net, bufs, steps, training) if measured else {}
    ranked = {}
    for i, layer in convs:
        for kind in wm.KINDS:
            cands = wm.candidates(layer, kind)
            if cap is not None:
                cands = [c for c in cands if c.bytes <= cap] or \
                    [min(cands, key=lambda c: c.bytes)]
            # Fastest first, the smaller of equally fast ones first; in
            # seconds, so that the trades of all the layers add up.
            base = wm.base_seconds(layer) or 1.0
            ranked[(i, kind)] = [_Modelled(c.bytes, c.time_factor * base, True)
                                 for c in sorted(cands, key=lambda c: (c.time_factor, c.bytes))]
    calls = [((i, kind), r, r[0],
              room.get((i, VIEW_PARTS[kind])) if i in measured else None)
             for (i, kind), r in ranked.items()]
    picks = trade_for_room(calls, trade_share, slowdown=slowdown)
    out = {i: tuple(picks[(i, kind)].memory for kind in wm.KINDS) for i, _ in convs}
    return out


def workspace_sizes(choice):
    """{layer index: (forward bytes, backward bytes)} of modelled algorithm
    choices, for make_plan's placed workspace (the model gives one size per
    layer for all three kinds)."""
    return {i: (c.bytes, c.bytes, c.bytes) for i, c in choice.items()}


def _finish(plan, net, name, workspace, other, seconds, choice):
    plan.breakdown['workspace'] = int(workspace)
    plan.breakdown['other'] = int(other)
    plan.est_iter_ms = seconds * 1e3
    plan.algorithms = collections.OrderedDict(
        (net.layers[i].name, c.name) for i, c in sorted(choice.items()))
    return plan


def estimate_plan(net, name, solver_type='SGD', keep=(), training=True, offload_policy='conv',
                  budget=None, host_budget=None):
    """A MemoryPlan for `name` with the workspace model's workspace and other
    and an estimated iteration time (`est_iter_ms`). 'auto' needs `budget`
    (None: no limit, the fastest plan)."""
    from caffeplus.memory.plan import check_plan_name
    check_plan_name(name)
    if name == 'auto':
        return plan_for_budget(net, budget, solver_type, keep, training, host_budget,
                               param_diffs=training and
                               update_in_backward.places_gradients(name, net=net))
    masks.for_plan(net, name)
    convs = wm.conv_layers(net)
    if name == 'stock':
        choice = {i: wm.stock_candidate(l) for i, l in convs}
        workspace = wm.stock_workspace(net)
    else:
        cap = wm.knee_cap(net)
        choice = {i: wm.fastest(l, cap) for i, l in convs}
        workspace = wm.arena_workspace(net, cap)
    steps_s = wm.step_seconds(net, choice)
    placing = name in ('shared', 'offload')
    kept = model_internals(net) if placing else None
    other = wm.other_bytes(net, name) - (sum(sum(k.values()) for k in kept.values())
                                         if placing else 0)
    hidden = None
    if name == 'offload' and offload_policy == 'free' and training:
        # What the runtime would choose from the steps it times, with the
        # same share of them (free_offload.step_share) on modelled steps.
        from caffeplus.memory import free_offload
        bufs = liveness.buffers(net, keep=keep, training=training)
        hidden = free_offload.choose_hidden(
            net, bufs, offload.choose(net, bufs, 'free', keep),
            free_offload.hiding_seconds(steps_s, free_offload.step_share()), PCIE_BANDWIDTH,
            host_budget=host_budget)

    # A solver updates the large parameters in backward under `shared` and `offload`
    # (caffeplus.solver.update_in_backward): their gradients are placed too.
    grads = training and update_in_backward.places_gradients(name, net=net)

    def placed(hidden):
        sizes = again = None
        if placing:
            bare = make_plan(net, name, solver_type=solver_type, keep=keep, training=training,
                             offload_policy=offload_policy, internals=kept,
                             offload_hidden=hidden, param_diffs=grads)
            from caffeplus.memory.workspace import headroom_slowdown, trade_time_share
            sizes = placed_workspace_sizes(net, bare.buffers, bare.steps, training, cap=cap,
                                           slowdown=headroom_slowdown(name),
                                           trade_share=trade_time_share(name))
            again = bare.recomputed
        return make_plan(net, name, solver_type=solver_type, keep=keep, training=training,
                         offload_policy=offload_policy, workspace=sizes,
                         internals=kept, other_bytes=other, offload_hidden=hidden,
                         param_diffs=grads, recomputed=again,
                         gemm_workspace=cublas_pool.modelled_arena_bytes(name))
    plan = placed(hidden)
    if hidden:
        # As the runtime (AppliedPlan.adopt_free_offload): the maps move
        # only if that lowers the peak (what stays may be made again instead).
        stay = placed({})
        if stay.peak_bytes <= plan.peak_bytes:
            plan = stay
    if placing:
        workspace = plan.breakdown['workspace']     # its share of the arena at the peak
        other = plan.breakdown['other']             # with the internals' share
    stall = 0.0
    if name == 'offload' and plan.offloaded and hidden is None:     # 'free': none by choice
        bufs = liveness.buffers(net, keep=keep, training=training)
        stall = offload_stall_seconds(net, bufs, plan.offloaded, steps_s)
    seconds = iteration_seconds(net, choice, solver_type, stall) + \
        again_seconds(net, liveness.buffers(net, keep=keep, training=training),
                      plan.recomputed, steps_s, getattr(plan, 'recompute_split', ()))
    return _finish(plan, net, name, workspace,
                   other if placing else wm.other_bytes(net, name), seconds, choice)


def again_seconds(net, bufs, chosen, steps_s, split=()):
    """What the maps made again add to an iteration: the forwards run again
    and the elementwise passes of the remakes."""
    return recompute.extra_seconds(net, bufs, chosen, steps_s, split) + \
        wm.remake_seconds(*recompute.remake_passes(bufs, chosen))


# -- auto -----------------------------------------------------------------------------
# `split`: keys of maps made again that also leave while a filter call
# alone reads them (recompute.again_lives).
Option = collections.namedtuple('Option', 'peak seconds cap offloaded arena host recompute held '
                                'split', defaults=((),))

# Offloaded maps wait in pinned host memory: a plan applied on this machine
# may pin at most this share of its physical memory (the rest is the
# program's, the page cache's, other processes').
HOST_SHARE = 0.75


def default_host_budget():
    """Bytes of pinned host memory a plan applied here may use (HOST_SHARE of
    the physical memory; None where the system does not say)."""
    import os
    try:
        return int(HOST_SHARE * os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))
    except (ValueError, OSError, AttributeError):
        return None


def _offload_sets(net, bufs, keep, steps, windows):
    """Candidate offload sets: prefixes of every offloadable buffer ordered
    by stall per byte, and the 'conv' policy's set."""
    keep = set(keep) | liveness.written_once(net)
    allowed = offload.choose(net, bufs, 'all', keep)

    def cost(key):
        nbytes = windows[key][0]
        return offload_stall_seconds(net, bufs, [key], steps, windows) / max(nbytes, 1), -nbytes

    order = sorted(allowed, key=cost)
    n = len(order)
    cuts = sorted({0, n} | {round(n * f / 8) for f in range(1, 8)})
    sets = [tuple(order[:k]) for k in cuts]
    conv = offload.choose(net, bufs, 'conv', keep)
    if conv and tuple(conv) not in sets:
        sets.append(tuple(conv))
    return sets


def _workspace_by_half_step(net, choice, steps, training):
    """Workspace bytes at each half step (liveness.live_bytes_by_half_step)
    for the algorithm `choice`."""
    ws = [0] * (2 * steps + 1)
    gemm = liveness.gemm_workspace_buffers(net, cublas_pool.modelled_arena_bytes('auto'),
                                           training)
    for b in liveness.workspace_buffers(net, workspace_sizes(choice), training) + gemm:
        h = int(round(2 * b.start))         # a filter call's at its half step
        ws[h] = max(ws[h], b.nbytes)
    return ws


# What the search weighs every option against (search_space).
# `budget`: the bytes plan auto plans within (planned_budget), or None;
# under one every convolution call takes the fastest algorithm that fits
# what the option leaves at its step (_fit_workspace).
_Space = collections.namedtuple('_Space', 'net keep training bufs steps kept fixed timing windows '
                                'budget calls', defaults=(None, None))


def search_space(net, solver_type='SGD', keep=(), training=True, budget=None, param_diffs=False):
    """What the search weighs every option against; `budget`: the bytes
    plan auto plans within (planned_budget), or None; `param_diffs`: the
    solver updates in backward, so the large gradients live in the arena
    (liveness.param_diff_buffers) beside every option's lives, not for the
    whole iteration."""
    bufs = liveness.buffers(net, keep=keep, training=training)
    steps = 2 * len(net.layers) if training else len(net.layers)
    kept = liveness.internal_buffers(net, model_internals(net), training)
    if param_diffs and training:
        kept = kept + liveness.param_diff_buffers(net)
    fixed = persistent_bytes(net, solver_type, training) + \
        wm.other_bytes(net, 'auto') - sum(b.nbytes for b in kept)
    convs = wm.conv_layers(net)
    timing = {}
    for cap in wm.workspace_levels(net):
        choice = {i: wm.fastest(l, cap) for i, l in convs}
        workspace = max([c.bytes for c in choice.values()] + [0])
        if workspace != cap:
            continue            # the same algorithms as a smaller cap
        steps_s = wm.step_seconds(net, choice)
        timing[cap] = (steps_s, iteration_seconds(net, choice, solver_type),
                       _workspace_by_half_step(net, choice, steps, training))
    windows = offload_windows(net, bufs, offload.choose(
        net, bufs, 'all', set(keep) | liveness.written_once(net))) if training else {}
    return _Space(net, keep, training, bufs, steps, kept, fixed, timing, windows, budget,
                  ConvCalls(net, training) if budget is not None else None)


def _options_of(space, offloaded, caps=None):
    """The options of one offload set: each workspace cap (all, or `caps`),
    without maps made again, with the cheap ones made again and with
    convolutions run again too (less memory, a little more time),
    and, with maps offloaded, with their bytes held while their copies run
    (offload_timing: no waiting, more memory) or lent at once."""
    net, bufs = space.net, space.bufs
    shortened = offload.shorten(bufs, offloaded, net) if offloaded else bufs
    again = {True: recompute.choose(net, bufs, space.training, offloaded)}
    for heads in _conv_prefixes(space, offloaded, again[True]):
        again[heads] = recompute.choose(net, bufs, space.training, offloaded, convs=heads)
    host = offload.host_bytes(bufs, offloaded)
    # Each set made again, and, for convolutions, with their maps also gone
    # between backward uses: none, the largest, the two largest, ... (more
    # room for the data calls; one more forward each).
    redos = [(False, ())]
    for r in again:
        if not again[r]:
            continue
        redos.append((r, ()))
        if r is not True:
            splits = recompute.splittable(net, bufs, again[r])
            redos.extend((r, tuple(splits[:k])) for k in range(1, min(len(splits), SPLITS) + 1))
    lent = {}           # live bytes by step of the lent lives, the same for every cap

    def live(lives, redo):
        """(live bytes by half step, {conv layer: half steps it runs again at})."""
        r, split = redo
        lives = recompute.shorten(lives, again[r], net, split) if r else lives
        reruns = rerun_steps(net, lives, again[r]) if r else {}
        return liveness.live_bytes_by_half_step(lives + space.kept, space.steps), reruns
    out = []
    for cap, (steps_s, seconds, ws) in space.timing.items():
        if caps is not None and cap not in caps:
            continue
        if space.budget is not None and caps is None and cap != max(space.timing):
            continue            # under a budget each call fits its own step (_fit_workspace)
        variants = [(False, None, offload_stall_seconds(net, bufs, offloaded, steps_s,
                                                       space.windows) if offloaded else 0.0)]
        if offloaded:
            holds, stall = offload_timing.schedule(net, bufs, offloaded, steps_s)
            variants.append((True, offload.shorten(bufs, offloaded, net, hidden=holds), stall))
        for held, lives, stall in variants:
            for redo in redos:
                if held:
                    by_step, reruns = live(lives, redo)
                else:
                    if redo not in lent:
                        lent[redo] = live(shortened, redo)
                    by_step, reruns = lent[redo]
                r, split = redo
                extra = again_seconds(net, bufs, again[r], steps_s, split) if r else 0.0
                if space.budget is None:
                    busiest = max(a + w for a, w in zip(by_step, ws))
                    total = seconds
                else:
                    busiest, total = _fit_workspace(space, by_step, space.fixed,
                                                    seconds - sum(steps_s), reruns)
                out.append(Option(space.fixed + busiest, total + stall + extra, cap,
                                  tuple(offloaded), busiest, host, r, held, split))
    return out


# Maps split between backward uses: at most this many (largest first) weighed.
SPLITS = 2


def _call_sites(net, training):
    """[(layer index, kind, half step)] of every convolution call: its
    forward at its step, backward-data at its backward step, backward-filter
    half a step before that (one bottom: liveness.FILTER_FIRST)."""
    L = len(net.layers)
    out = []
    for i, _ in wm.conv_layers(net):
        out.append((i, 'fwd', 2 * i))
        if training and net.layer_need_backward[i]:
            t = 2 * L - 1 - i
            if any(net.bottom_need_backward[i]):      # (liveness.workspace_buffers)
                out.append((i, 'bwd_data', 2 * t))
            out.append((i, 'bwd_filter', 2 * t - 1 if len(net.bottom_vecs[i]) == 1 else 2 * t))
    return out


class _LiveRoom:
    """Room by live bytes: `room` less what lives at the half step (the
    search's lower bound on a placement)."""

    def __init__(self, by_half_step, room):
        self.live, self.room = by_half_step, room
        self.ws = [0] * len(by_half_step)

    def free(self, h):
        return self.room - self.live[h] - self.ws[h]

    def take(self, h, nbytes):
        self.ws[h] += nbytes


class _PlacedRoom:
    """Room by placement: the largest hole below `limit` that the placed
    buffers (and calls already fitted) leave at the half step, as
    placement.place(last=('workspace',)) then fills it."""

    def __init__(self, buffers, offsets, limit):
        self.buffers, self.offsets, self.limit = buffers, offsets, limit
        self.taken = {}

    def free(self, h):
        return placement.free_at(self.buffers, self.offsets, h / 2.0, self.limit,
                                 self.taken.get(h, ()))

    def take(self, h, nbytes):
        at = placement.lowest_fit(self.buffers, self.offsets, h / 2.0, nbytes,
                                  self.taken.get(h, ()))
        self.taken.setdefault(h, []).append((at, nbytes))


class ConvCalls:
    """A net's convolution calls for fit_calls: each call's site (layer,
    kind, half step: _call_sites) and candidates (measured where
    caffeplus.memory.calibration has them), fastest first, and the
    iteration's time for per-layer factors (memoised: the search fits
    thousands of options)."""

    def __init__(self, net, training):
        self.net = net
        self.sites = _call_sites(net, training)
        self.cands = {(i, k): sorted(wm.candidates(net.layers[i], k),
                                     key=lambda c: (c.time_factor, c.bytes))
                      for i, k, _ in self.sites}
        self.smallest = {key: min(c, key=lambda c: (c.bytes, c.time_factor))
                         for key, c in self.cands.items()}
        self.base = {i: wm.base_seconds(l) for i, l in wm.conv_layers(net)}
        convs = set(self.base)
        fast = wm.step_seconds(net)
        L = len(net.layers)
        self.other = sum(fast[i] + fast[2 * L - 1 - i] for i in range(L) if i not in convs)
        self._conv = {}

    def best(self, i, kind, free):
        """The fastest candidate of the call within `free` bytes (else the least)."""
        for c in self.cands[(i, kind)]:
            if c.bytes <= free:
                return c
        return self.smallest[(i, kind)]

    def seconds(self, i, c):
        """The measured (or modelled) seconds of one call with candidate c."""
        return c.time_factor * self.base[i]

    def iteration_seconds(self, factors):
        """The steps' seconds with {conv layer: (forward, backward) factors}."""
        out = self.other
        for i, f in factors.items():
            key = (i,) + tuple(f)
            if key not in self._conv:
                self._conv[key] = wm.conv_step_seconds(self.net, i, f)
            out += self._conv[key]
        return out


def fit_calls(calls, room, reruns=None):
    """{(layer index, kind): Candidate}: every convolution call (ConvCalls)
    takes the fastest candidate that fits `room` (_LiveRoom or _PlacedRoom)
    at its half step (the least workspace where none fits: then over).
    `reruns`: {convolution: half steps it runs again at}: its forward's
    algorithm (the same, for the same bits) must fit there too, beside the
    call of that step."""
    picks = {}
    reruns = reruns or {}
    # The forwards run again first: the steps they share come after.
    sites = sorted(calls.sites, key=lambda site: not (site[1] == 'fwd' and site[0] in reruns))
    by_step = collections.defaultdict(list)
    for i, kind, h in sites:
        by_step[h].append((i, kind))
    for i, kind, h in sites:
        again = reruns.get(i, []) if kind == 'fwd' else []
        at = [h] + again
        free = min(room.free(t) for t in at)
        pick = calls.best(i, kind, free)
        if again:
            # Its bytes at the steps it runs again are the other calls'
            # there too: the least time of it (every run) and of them.
            def cost(c):
                out = calls.seconds(i, c) * len(at)
                for t in again:
                    out += sum(calls.seconds(j, calls.best(j, k, room.free(t) - c.bytes))
                               for j, k in by_step[t] if (j, k) != (i, kind))
                return out
            fits = [c for c in calls.cands[(i, kind)] if c.bytes <= free]
            pick = min(fits, key=lambda c: (cost(c), c.bytes)) if fits else pick
        picks[(i, kind)] = pick
        if pick.bytes:
            for t in at:
                room.take(t, pick.bytes)
    return picks


def _pick_factors(net, picks):
    """{conv layer: (forward, backward) time factors} of fit_calls' picks."""
    out = {}
    for i, _ in wm.conv_layers(net):
        fwd = picks[(i, 'fwd')].time_factor
        back = [picks[(i, k)].time_factor for k in ('bwd_data', 'bwd_filter') if (i, k) in picks]
        out[i] = (fwd, sum(back) / len(back) if back else fwd)
    return out


def _fit_workspace(space, by_half_step, fixed, update, reruns=None):
    """(busiest bytes, seconds) of an option under space.budget (fit_calls;
    `update`: the solver update's seconds)."""
    net = space.net
    room = _LiveRoom(by_half_step, space.budget - fixed)
    picks = fit_calls(space.calls, room, reruns)
    seconds = space.calls.iteration_seconds(_pick_factors(net, picks)) + update
    return max(a + w for a, w in zip(by_half_step, room.ws)), seconds


def rerun_steps(net, lives, chosen):
    """{convolution: half steps it runs again at} of a plan's buffers
    (recompute.shorten's lives) and maps made again."""
    out = {}
    for p, b in recompute.reruns(net, lives, chosen):
        out.setdefault(p, []).append(int(round(2 * b.start)))
    return out


# Convolutions run again: at most this many prefixes of their order weighed.
CONV_PREFIXES = 6


def _conv_prefixes(space, offloaded, cheap):
    """Sets of convolutions (tuples of layer indices) to run again, each a
    prefix of the eligible ones ordered by forward time per byte given
    back (cheapest first: VGG-16's conv1_1, 0.7 ms for 3.3 GB). `cheap`:
    what recompute.choose makes again without convolutions."""
    net, bufs = space.net, space.bufs
    every = recompute.choose(net, bufs, space.training, offloaded, convs=True)
    sizes = dict((b.key, b.nbytes) for b in bufs)
    steps = space.timing[max(space.timing)][0]
    heads = sorted({chain[0]: recompute.extra_seconds(net, bufs, {key: chain}, steps) /
                    sizes[key] for key, chain in every.items()
                    if key not in cheap and not recompute.is_remake(chain)}.items(),
                   key=lambda kv: kv[1])
    n = len(heads)
    cuts = sorted({n} | {int(math.ceil(n * f / CONV_PREFIXES))
                         for f in range(1, CONV_PREFIXES)} - {0})
    return [tuple(sorted(h for h, _ in heads[:k])) for k in cuts]


def search(net, solver_type='SGD', keep=(), training=True, space=None):
    """Every (cap, offload set) option the search weighs, as Option tuples.
    `peak` is a lower bound here (the most bytes live at one step, workspace
    placed at its layer's step); plan_for_budget places the ones it picks."""
    space = space or search_space(net, solver_type, keep, training)
    fastest_steps = space.timing[max(space.timing)][0]
    sets = _offload_sets(net, space.bufs, space.keep, fastest_steps, space.windows) \
        if training else [()]
    options = []
    for offloaded in sets:
        options.extend(_options_of(space, offloaded))
    return options


# Refining an offload set: its largest maps tried, at most this many rounds,
# at most this many placed a round.
REFINE_MAPS = 24
REFINE_ROUNDS = 32
REFINE_PLACED = 3


def refine(space, plan, option, budget, place):
    """Placed plans with fewer maps away than `plan` (the placed `option`),
    each faster than the last: the search's sets are prefixes of one order,
    and at VGG-16 b256 under 12 GiB the fastest that fits moves 12 maps
    (9.2 GB each way) where fewer fit. A round puts back the offloaded map
    whose return saves the most estimated time, of those whose peak, placed
    (`place`: option -> plan), still fits; the search's lower bound screens
    them first (same workspace cap)."""
    out = []
    sizes = dict((b.key, b.nbytes) for b in space.bufs)
    for _ in range(REFINE_ROUNDS):
        trials = []
        for key in sorted(option.offloaded, key=lambda k: -sizes.get(k, 0))[:REFINE_MAPS]:
            rest = [k for k in option.offloaded if k != key]
            trials.extend(o for o in _options_of(space, rest, caps=(option.cap,))
                          if o.peak <= budget and o.seconds < option.seconds)
        trials.sort(key=lambda o: o.seconds)
        for trial in trials[:REFINE_PLACED]:
            placed = place(trial)
            if placed.peak_bytes <= budget and placed.est_iter_ms < plan.est_iter_ms:
                option, plan = trial, placed
                out.append(plan)
                break
        else:
            break
    return out


def _auto_plan(net, option, solver_type, keep, training, budget=None, calls=None,
               param_diffs=False):
    """The placed plan of a search option. `budget` (planned_budget bytes):
    the placed workspace takes any slower algorithm that keeps the peak
    within it (as the runtime's does: apply._apply_workspace), and the
    estimated time counts the algorithms so taken (`calls`: the search's
    ConvCalls)."""
    budgeted = budget is not None
    names = sorted({n for key in option.offloaded for n in key[1]})
    convs = wm.conv_layers(net)
    choice = {i: wm.fastest(l, option.cap) for i, l in convs}
    kept = model_internals(net)
    holds = None
    if option.held:
        bufs = liveness.buffers(net, keep=keep, training=training)
        holds = offload_timing.schedule(net, bufs, option.offloaded,
                                        wm.step_seconds(net, choice))[0]
    bare = make_plan(net, 'offload', solver_type=solver_type, keep=keep, training=training,
                     offload_policy=names, internals=kept, recompute=option.recompute,
                     offload_holds=holds, recompute_split=option.split,
                     param_diffs=param_diffs)
    other = wm.other_bytes(net, 'auto') - sum(sum(k.values()) for k in kept.values())

    def placed(sizes):
        return make_plan(net, 'offload', solver_type=solver_type, keep=keep, training=training,
                         offload_policy=names, workspace=sizes, internals=kept,
                         recompute=option.recompute, offload_holds=holds,
                         recompute_split=option.split, other_bytes=other,
                         workspace_last=budgeted, param_diffs=param_diffs,
                         gemm_workspace=cublas_pool.modelled_arena_bytes('auto'))
    seconds = option.seconds
    call_bytes = None
    if budgeted:
        # Each call the fastest algorithm that fits the largest hole the
        # other buffers leave at its step below what the budget leaves the
        # arena; placed after them, into those holes.
        room = budget - other - persistent_bytes(net, solver_type, training) + \
            sum(b.nbytes for b in bare.buffers if b.kind == 'param_diff')   # in the arena
        reruns = rerun_steps(net, bare.buffers, bare.recomputed)
        picks = fit_calls(calls or ConvCalls(net, training),
                          _PlacedRoom(bare.buffers, bare.offsets, room), reruns)
        sizes = {i: tuple(picks[(i, k)].bytes if (i, k) in picks else 0 for k in wm.KINDS)
                 for i, _ in convs}
        plan = placed(sizes)
        if training:
            seconds = _placed_seconds(net, option, choice, _pick_factors(net, picks),
                                      solver_type, keep, bare.recomputed, holds)
        call_bytes = {(net._layer_names[i], VIEW_PARTS[k]): picks[(i, k)].bytes
                      for i, k in picks}
    else:
        plan = placed(placed_workspace_sizes(net, bare.buffers, bare.steps, training,
                                             cap=option.cap))
    plan.name = 'auto'
    plan = _finish(plan, net, 'auto', plan.breakdown['workspace'], plan.breakdown['other'],
                   seconds, choice)
    plan.workspace_cap = option.cap
    # Under a budget the runtime keeps each call within these bytes.
    plan.call_workspace = call_bytes
    return plan


# A call's kind -> the placed workspace's view of it (workspace.VIEW_NAMES).
VIEW_PARTS = {'fwd': 'forward', 'bwd_data': 'backward', 'bwd_filter': 'backward_filter'}


def _placed_seconds(net, option, choice, factors, solver_type, keep, again, holds=None):
    """An option's estimated time with the algorithms its placed workspace
    took (fit_calls' picks as factors); `again`: its maps made again;
    `holds`: its held maps (offload_timing)."""
    steps_s = wm.step_seconds(net, choice, factors)
    seconds = sum(steps_s) + wm.update_seconds(net, HISTORY_COPIES.get(solver_type, 1))
    bufs = liveness.buffers(net, keep=keep, training=True)
    if option.offloaded:
        if holds is not None:
            seconds += offload_timing.schedule(net, bufs, option.offloaded, steps_s,
                                               holds=holds)[1]
        else:
            seconds += offload_stall_seconds(net, bufs, option.offloaded, steps_s)
    return seconds + again_seconds(net, bufs, again, steps_s, option.split)


# Placed plans tried before giving up on a budget (each is a best-fit placement).
PLACEMENT_TRIES = 12
# A placed plan within this share of its option's time bound ends the tries.
PLACED_SLACK = 0.02
# The share of a budget plan auto leaves unplanned, for the estimate's error.
BUDGET_MARGIN = 0.02


def planned_budget(budget):
    """The bytes plan auto plans within under `budget` (BUDGET_MARGIN less)."""
    return int(budget * (1 - BUDGET_MARGIN))


def plan_for_budget(net, budget, solver_type='SGD', keep=(), training=True, host_budget=None,
                    param_diffs=False):
    """The `auto` MemoryPlan: least estimated time with peak <= budget
    (None: no limit), offloading at most `host_budget` bytes to pinned host
    memory (None: no limit). CaffeplusError with the smallest feasible
    budget when nothing fits. Convolutions the calibration table measured
    (caffeplus.memory.calibration) are weighed with their measured
    algorithms. `param_diffs`: the solver updates the large parameters in
    backward (caffeplus.solver.update_in_backward), so their gradients are
    placed in the arena too, as under `shared` and `offload`."""
    masks.for_plan(net, 'auto')
    with calibration.applied():
        return _plan_for_budget(net, budget, solver_type, keep, training, host_budget,
                                param_diffs)


def _plan_for_budget(net, budget, solver_type, keep, training, host_budget, param_diffs):
    space = search_space(net, solver_type, keep, training,
                         None if budget is None else planned_budget(budget), param_diffs)
    options = search(net, solver_type, keep, training, space)
    if host_budget is not None:
        options = [o for o in options if o.host <= host_budget] or \
            [min(options, key=lambda o: o.host)]
    # Under a budget, plan within BUDGET_MARGIN of it: the estimate is
    # within about 2% of the measured peak (VGG-16 b256 planned at 99.8% of
    # 12 GiB measured 1.9% over the estimate, over the budget).
    budget, asked = (None, None) if budget is None else (planned_budget(budget), budget)
    fits = [o for o in options if budget is None or o.peak <= budget]
    fits.sort(key=lambda o: (round(o.seconds, 9), o.peak))
    if budget is None:          # the fastest; every option fits
        plan = _auto_plan(net, fits[0], solver_type, keep, training, param_diffs=param_diffs)
        plan.budget = None
        return plan
    # Under a budget: the first of the search's choices that fits once
    # placed, then fewer maps away where that fits too (refine).

    def place(option):
        return _auto_plan(net, option, solver_type, keep, training, budget=budget,
                          calls=space.calls, param_diffs=param_diffs)
    # The fastest few first (the first that fits once placed), then, as a
    # lower bound can come out over the budget placed, the fastest that
    # fits of those with the least peaks.
    least_first = sorted(fits, key=lambda o: (o.peak, o.seconds))[:PLACEMENT_TRIES]
    for group in (fits[:PLACEMENT_TRIES], least_first):
        placed = []
        for option in group:
            plan = place(option)
            if plan.peak_bytes <= budget:
                placed.append((plan.est_iter_ms, len(placed), option, plan))
                # Placed, a call gets only the hole left at its step: the
                # fastest of them, unless one is as fast as its bound.
                if plan.est_iter_ms <= option.seconds * 1e3 * (1 + PLACED_SLACK):
                    break
        if not placed:
            continue
        _, _, option, plan = min(placed)
        if option.offloaded:
            plan = ([plan] + refine(space, plan, option, budget, place))[-1]
        plan.budget = asked
        return plan
    # Nothing fits once placed: the least peak any option reaches.
    # (Placed with no room to spare: every call at its least workspace.)

    def least_placed(option):
        return _auto_plan(net, option, solver_type, keep, training, budget=0,
                          calls=space.calls, param_diffs=param_diffs).peak_bytes
    least = min(sorted(options, key=lambda o: (o.peak, o.seconds))[:PLACEMENT_TRIES],
                key=least_placed)
    peak = least_placed(least)
    host = '' if host_budget is None else \
        ' with at most %s offloaded to host memory' % format_bytes(host_budget)
    raise CaffeplusError(
        'no plan for net %s fits a budget of %s (%d bytes)%s: the smallest peak any plan '
        'reaches is %s (%d bytes: shared, %d feature maps offloaded, %d made again, every '
        'convolution call at its least workspace); the smallest budget that fits is %s (%s '
        'leaves the estimate a margin)' % (net.name, format_bytes(asked), asked, host,
                                           format_bytes(peak), peak, len(least.offloaded),
                                           len(_made_again(net, least)),
                     _budget_string(peak / (1 - BUDGET_MARGIN)),
                     '%g%%' % (BUDGET_MARGIN * 100)))


def _made_again(net, option):
    """The maps an option makes again in backward."""
    if not option.recompute:
        return {}
    bufs = liveness.buffers(net, training=True)
    convs = False if option.recompute is True else option.recompute
    return recompute.choose(net, bufs, True, option.offloaded, convs=convs)


def _budget_string(n):
    """A budget string that parses back to at least n bytes (rounded up to 0.01 GiB)."""
    import math
    if n >= 2 ** 30:
        return '%.2fG' % (math.ceil(n / 2 ** 30 * 100) / 100)
    return '%.1fM' % (math.ceil(n / 2 ** 20 * 10) / 10)
