"""Offload at run time (vDNN): feature maps wait in pinned host memory
between their last forward use and their first backward use.

The plan (caffeplus.memory.offload) gives every offloaded data Storage two
device lives in the arena: F, from its first write to its last forward use
(step f), and B, from `lookahead` steps before its first backward use (step
b) to its last use. Other buffers may take F's bytes after step f and B's
bytes before B begins. This runtime makes that safe with a copy stream and
events, through the net's per-layer hooks (Net.before_layer_forward,
after_layer_forward, before_layer_backward):

  after forward step f   record `ready` on the compute stream; the copy-out
                         stream waits on it and copies F -> a pinned host
                         buffer; record `copied` on the copy-out stream.
  before a step whose    the compute stream waits on `copied` (once): the
  writers land on F      layer may overwrite F's bytes only after the copy
                         has read them.
  before step B.start    record `free` on the compute stream (everything
                         that used B's bytes before is done, the copies out
                         of maps that lay there included: the compute stream
                         waited for those); the copy-in stream waits on it
                         and on `copied` (the host copy is whole), copies
                         host -> B; record `fetched`; the Storage now
                         points at B.
  before step b          the compute stream waits on `fetched`.
  a new iteration        the compute stream waits for both copy streams'
                         tails (nothing of the last iteration still runs),
                         every offloaded Storage points at F again.

Copies out and copies in run on two streams, so that the two directions of
the link (separate copy engines) work at once: backward's prefetches need
not queue behind forward's last copies out.

Pinned buffers come from a pool (one buffer per offloaded Storage, kept
across iterations and handed to the next runtime after a re-layout).

Look-ahead. Fixed (an int, 1 by default on the CPU) or 'auto' (the default
on the GPU): the runtime times one iteration (events around every step,
and the host->device copies it makes; an iteration that captured CUDA
graphs is timed again, up to MAX_RETIMES times), then, for each buffer,
takes the least k such that the k steps before its consumer take longer
than copying it back (bytes / measured bandwidth, with a 25% margin), at
most the gap since its last forward use; if that changes anything, the
arena is placed again at the start of the next full forward pass (which
rewrites every buffer before reading it).

Plan `auto`'s held maps (caffeplus.memory.offload_timing) keep the lives
it planned: the calibrated look-ahead never fetches one later than planned.

Policy 'free'. The plan starts with nothing offloaded; the runtime times
FREE_SAMPLES iterations the same way (the link's bandwidth measured by a
pinned copy), chooses the maps whose copies the per-step median times, times
free_offload.STEP_SHARE, hide (caffeplus.memory.free_offload) and hands them
over as `pending_offload`;
AppliedPlan.adopt_free_offload places the arena again with them, holding
each map's bytes until its copy out is predicted done.

On the CPU there is no copy engine: the same logic runs over simulated
streams (SimDevice) whose copies run at once ('eager') or only when
someone waits on them ('lazy', the slowest legal copy engine, each stream
on its own: a missing wait shows up as wrong numbers).
"""
import ctypes
import math
import statistics
import time

import numpy

from caffeplus.errors import CaffeplusError

MARGIN = 1.25
CALIBRATE_AT = 2            # the iteration whose times choose the look-ahead
MAX_RETIMES = 3             # later ones, while an iteration captured CUDA graphs
# Policy 'free' chooses on the per-step median of this many timed iterations:
# one iteration's times moved GoogLeNet's choice between 12 and 20 maps
# from run to run (1,827 against 1,661 MiB).
FREE_SAMPLES = 3
_POOL = {}                  # (device kind, count) -> [host float32 arrays]


def _captures():
    """CUDA graphs captured so far (caffeplus.cudnn.api's replays): an
    iteration that captures some spends host time the device waits for, so
    its step times are not the run's."""
    try:
        from caffeplus.cudnn import api
    except ImportError:          # no ctypes cuDNN bindings here: nothing captures
        return 0
    return api.graph_stats()['captured']


def choose_lookahead(step_seconds, last_fwd, first_back, nbytes, bandwidth, margin=MARGIN):
    """Least k >= 1 such that the k steps before `first_back` take at least
    the copy's time (nbytes / bandwidth * margin); at most the gap."""
    need = nbytes / float(max(bandwidth, 1.0)) * margin
    max_k = max(first_back - last_fwd - 1, 1)
    k, acc = 0, 0.0
    while k < max_k and acc < need:
        k += 1
        acc += step_seconds[first_back - k]
    return max(k, 1)


def _hook(method, chain_safe):
    """The runtime's per-layer hook. Marked chain_safe (option fused_chains,
    the default) it lets the fused layer chains (layers/fused_chain.py) stay
    fused, as they are under the plans without offload, so offload runs
    `shared`'s arithmetic. (fused_chains=False runs them layer by layer.
    A chain's backward writes at its last member's step, which the planner
    must know (liveness.buffers, kernels.chain_heads): otherwise an
    Eltwise->ReLU chain's top data could be placed where the chain writes
    the Eltwise's bottom diffs.)"""
    def hook(i):
        return method(i)
    hook.chain_safe = bool(chain_safe)
    return hook


# -- devices ----------------------------------------------------------------------------
class CupyDevice:
    """Streams, events and pinned memory of the current GPU."""
    kind = 'cuda'

    def __init__(self, delay=None):
        import cupy
        self.cupy = cupy
        self.out_stream = cupy.cuda.Stream(non_blocking=True)      # device -> host
        self.in_stream = cupy.cuda.Stream(non_blocking=True)       # host -> device
        self.delay = delay          # tests: callable(stream), enqueued before each copy

    def compute(self):
        return self.cupy.cuda.get_current_stream()

    def record(self, stream, timing=False):
        ev = self.cupy.cuda.Event(disable_timing=not timing)
        ev.record(stream)
        return ev

    def wait(self, stream, event):
        stream.wait_event(event)

    def host_buffer(self, count):
        mem = self.cupy.cuda.alloc_pinned_memory(max(count, 1) * 4)
        return numpy.frombuffer(mem, numpy.float32, max(count, 1))

    def d2h(self, view, host):
        if self.delay is not None:
            self.delay(self.out_stream)
        view.data.copy_to_host_async(ctypes.c_void_p(host.ctypes.data), view.nbytes,
                                     stream=self.out_stream)

    def h2d(self, host, view):
        if self.delay is not None:
            self.delay(self.in_stream)
        view.data.copy_from_host_async(ctypes.c_void_p(host.ctypes.data), view.nbytes,
                                       stream=self.in_stream)

    def synchronize(self):
        self.out_stream.synchronize()
        self.in_stream.synchronize()
        self.compute().synchronize()

    def seconds(self, a, b):
        return self.cupy.cuda.get_elapsed_time(a, b) / 1e3

    def measure_bandwidth(self, nbytes=64 << 20):
        """Bytes a second of the slower direction of a pinned copy of `nbytes`
        (policy 'free' times an iteration with no copies of its own)."""
        cupy = self.cupy
        count = nbytes // 4
        host = self.host_buffer(count)
        dev = cupy.empty(count, numpy.float32)
        worst = 0.0
        for _ in range(2):          # the first pair warms up
            a = self.record(self.out_stream, timing=True)
            self.d2h(dev, host)
            b = self.record(self.out_stream, timing=True)
            self.wait(self.in_stream, b)
            self.h2d(host, dev)
            c = self.record(self.in_stream, timing=True)
            c.synchronize()
            worst = max(self.seconds(a, b), self.seconds(b, c))
        del dev, host
        # The probe's block would stay in CuPy's pool, in the process's
        # footprint, where no re-layout follows (AlexNet's `free`: 64 MiB).
        from caffeplus.backend import release_cached
        release_cached(cupy)
        return nbytes / worst if worst > 0 else None


class _SimEvent:
    __slots__ = ('done', 'time', 'stream')

    def __init__(self, done=False):
        self.done = done
        self.time = time.perf_counter() if done else None
        self.stream = None


class SimDevice:
    """CPU stand-in: compute is synchronous; each copy stream is a queue of
    copies run at once ('eager') or when waited on ('lazy'), the two
    streams independent of each other but for the waits between them."""
    kind = 'sim'
    COMPUTE = 'compute'

    def __init__(self, mode='eager', bandwidth=None):
        if mode not in ('eager', 'lazy'):
            raise CaffeplusError("offload simulation mode must be 'eager' or 'lazy', not %r"
                                 % (mode,))
        self.mode = mode
        self.out_stream, self.in_stream = 'out', 'in'
        # per stream: callables and _SimEvent markers, in order
        self.queues = {self.out_stream: [], self.in_stream: []}
        self.bandwidth = bandwidth
        self.copies = 0

    def compute(self):
        return self.COMPUTE

    def record(self, stream, timing=False):
        if stream == self.COMPUTE or not self.queues[stream]:
            return _SimEvent(True)
        ev = _SimEvent(False)
        ev.stream = stream
        self.queues[stream].append(ev)
        return ev

    def wait(self, stream, event):
        if event.done:
            return
        if stream == self.COMPUTE:
            self._run_until(event.stream, event)
        elif event.stream != stream:
            # Later work on `stream` runs only after the other stream's event.
            self.queues[stream].append(lambda: self._run_until(event.stream, event))
        # (Compute's events are done when recorded: compute is synchronous.)

    def _run_until(self, stream, event=None):
        queue = self.queues[stream]
        while queue:
            op = queue.pop(0)
            if isinstance(op, _SimEvent):
                op.done = True
                op.time = time.perf_counter()
                if op is event:
                    return
            else:
                op()

    def _enqueue(self, stream, op):
        self.copies += 1
        if self.mode == 'eager':
            self._run_until(stream)
            op()
        else:
            self.queues[stream].append(op)

    def host_buffer(self, count):
        return numpy.empty(max(count, 1), numpy.float32)

    def d2h(self, view, host):
        def op():
            host[:view.size] = view
        self._enqueue(self.out_stream, op)

    def h2d(self, host, view):
        def op():
            view[...] = host[:view.size]
        self._enqueue(self.in_stream, op)

    def synchronize(self):
        while any(self.queues.values()):
            for stream in self.queues:
                self._run_until(stream)

    def seconds(self, a, b):
        return (b.time or 0.0) - (a.time or 0.0)


def make_device(arena, options):
    if type(arena).__module__.startswith('cupy'):
        return CupyDevice(delay=options.get('delay'))
    return SimDevice(options.get('simulate', 'eager'), options.get('bandwidth'))


def _host_buffer(device, count):
    free = _POOL.get((device.kind, count))
    if free:
        return free.pop()
    return device.host_buffer(count)


def _give_back(device, count, host):
    _POOL.setdefault((device.kind, count), []).append(host)


def clear_pool():
    """Drop the pooled host buffers no runtime holds (pinned memory goes back
    to CuPy's pinned pool); returns their bytes."""
    freed = sum(h.nbytes for hosts in _POOL.values() for h in hosts)
    _POOL.clear()
    return freed


# -- the runtime --------------------------------------------------------------------
class _Item:
    """One offloaded Storage and this iteration's copies of it."""
    __slots__ = ('entry', 'F', 'B', 'last_fwd', 'issue', 'first_back', 'count', 'host',
                 'copied', 'copied_ev', 'copied_waited', 'fetched', 'fetched_ev', 'consumed')

    def __init__(self, entry, last_fwd, first_back, issue):
        self.entry = entry
        self.F, self.B = entry.lives[0], entry.lives[1]
        # The copy out follows the last forward use (a data layer's batch:
        # its write, offload.copy_out_step); F may end later (policy 'free'
        # holds its bytes until the copy is predicted done).
        self.last_fwd = last_fwd
        self.issue = issue
        self.first_back = first_back
        # Host buffers are float32 arrays: enough of them for the view's
        # bytes (a 16-bit map's half its values); the copies move bytes.
        self.count = -(-self.F.view.nbytes // 4)
        self.host = None
        self.reset()

    def reset(self):
        self.copied = self.fetched = self.consumed = self.copied_waited = False
        self.copied_ev = self.fetched_ev = None

    @property
    def bstart(self):
        return self.B.start

    @property
    def name(self):
        return self.entry.name


class OffloadRuntime:
    """Copies for the offloaded storages of an AppliedPlan (see the module docstring).
    Options: simulate ('eager'|'lazy', CPU), delay (GPU tests: callable(stream)
    enqueued before every copy), bandwidth (bytes/s for the CPU model),
    calibrate_at (iteration whose times choose an 'auto' look-ahead),
    fused_chains (True: keep the fused layer chains; see _hook)."""

    def __init__(self, applied, **options):
        from caffeplus.memory import offload
        self.applied = applied
        self.options = options
        net = applied.net
        self.L = applied.L
        self.device = make_device(applied.arena, options)
        self.items = []
        for e in applied.entries:
            if e.offloaded:
                fwd, bwd = offload._uses(net, e.lives[0].buf)
                self.items.append(_Item(e, max(fwd), min(bwd),
                                        offload.copy_out_step(net, e.lives[0].buf)))
        for it in self.items:
            it.host = _host_buffer(self.device, it.count)
        self._schedule()
        self.iteration = 0
        # Policy 'free' before its choice: time FREE_SAMPLES iterations, then choose.
        self.choosing = applied.choosing_free_offload
        if self.choosing:
            from caffeplus.memory import free_offload
            self.step_share = free_offload.step_share()
        self.pending_offload = None
        self.calibrated = applied.options.get('lookahead') != 'auto' and not self.choosing
        self.bandwidth = None
        self.step_seconds = None
        self._timing = None
        self._free_samples = []     # policy 'free': (step seconds, bandwidth) per timed iteration
        self._probe = None
        self._tail = None
        self._next = 0
        self.pending_lookahead = None
        self.stats = {'copies_out': 0, 'copies_in': 0, 'bytes_out': 0, 'bytes_in': 0}
        safe = options.get('fused_chains', True)
        self._hooks = [(net.before_layer_forward, _hook(self._before_forward_layer, safe)),
                       (net.after_layer_forward, _hook(self._after_forward_layer, safe)),
                       (net.before_layer_backward, _hook(self._before_backward_layer, safe))]
        for hooks, fn in self._hooks:
            hooks.append(fn)
        self._aim_hooks()

    def _schedule(self):
        from caffeplus.memory.placement import _align
        steps = 2 * self.L
        self.out_at = [[] for _ in range(steps)]
        self.consume_at = [[] for _ in range(steps)]
        self.wait_copied_at = [[] for _ in range(steps)]
        lives = [life for e in self.applied.entries for life in e.lives]
        # Every region that starts being written at some step: buffer lives,
        # and the workspace views and kept layer buffers placed beside them.
        # (A filter call's workspace, half a step early, lands during its step.)
        regions = [(int(math.ceil(z.start)), z.offset, z.buf.nbytes, z) for z in lives] + \
            [(int(math.ceil(start)), offset, nbytes, None)
             for start, offset, nbytes in getattr(self.applied, 'extra_regions', ())]
        for it in self.items:
            self.out_at[it.issue].append(it)
            self.consume_at[it.first_back].append(it)
            lo, hi = it.F.offset, it.F.offset + _align(it.F.buf.nbytes)
            for start, offset, nbytes, z in regions:
                if z is it.F or start <= it.last_fwd or start >= steps:
                    continue
                zlo, zhi = offset, offset + _align(nbytes)
                if zlo < hi and lo < zhi and it not in self.wait_copied_at[start]:
                    self.wait_copied_at[start].append(it)
        self.by_bstart = sorted(self.items, key=lambda it: it.bstart)
        # The steps whose hook has work (a wait, a prefetch to issue, a
        # consumer): the others return at once. GoogLeNet's 13 moved maps
        # ran the hook before each of its ~300 layer steps, a few
        # microseconds of host time each, on a net whose GPU waits for the
        # host a third of an iteration.
        self.busy_at = [bool(self.wait_copied_at[s] or self.consume_at[s]) for s in range(steps)]
        for it in self.items:
            s = max(int(math.ceil(it.bstart)), 0)
            if s < steps:
                self.busy_at[s] = True

    def _aim_hooks(self):
        """Tell the net at which layers each hook has work (Net's hook_table):
        the steps busy_at names, where copies go out, and every step of an
        iteration whose steps are timed. (The schedule is fixed for the
        runtime's life: a re-layout makes a new runtime.)"""
        if not self._hooks:             # closed
            return
        L = self.L
        (_, before_forward), (_, after_forward), (_, before_backward) = self._hooks
        timing = self._timing is not None
        before_forward.at = None if timing else \
            frozenset(i for i in range(L) if self.busy_at[i])
        before_backward.at = None if timing else \
            frozenset(i for i in range(L) if self.busy_at[2 * L - 1 - i])
        after_forward.at = frozenset(i for i in range(L) if self.out_at[i])

    # -- hooks ----------------------------------------------------------------------
    def _before_forward_layer(self, i):
        self._before(i)

    def _before_backward_layer(self, i):
        self._before(2 * self.L - 1 - i)

    def _after_forward_layer(self, i):
        for it in self.out_at[i]:
            self._copy_out(it)

    def _before(self, s):
        if self._timing is None and not self.busy_at[s]:
            return
        dev = self.device
        compute = dev.compute()
        if self._timing is not None:
            self._timing['steps'].append((s, dev.record(compute, timing=True)))
        for it in self.wait_copied_at[s]:
            if it.copied and not it.copied_waited:
                dev.wait(compute, it.copied_ev)
                it.copied_waited = True
        order = self.by_bstart
        while self._next < len(order) and order[self._next].bstart <= s:
            it = order[self._next]
            self._next += 1
            if it.copied and not it.fetched:
                self._prefetch(it)
        for it in self.consume_at[s]:
            if not it.fetched:
                if not it.copied:
                    raise CaffeplusError(
                        "memory plan '%s': backward needs blob %s, which this iteration's "
                        "forward did not reach (offloaded feature maps need a forward pass "
                        "through layer %s first)" % (self.applied.name, it.name,
                                                      self.applied.net._layer_names[it.last_fwd]))
                self._prefetch(it)
            dev.wait(compute, it.fetched_ev)
            it.consumed = True

    def _copy_out(self, it):
        dev = self.device
        ready = dev.record(dev.compute())
        dev.wait(dev.out_stream, ready)
        dev.d2h(it.F.view, it.host)
        it.copied_ev = dev.record(dev.out_stream)
        it.copied, it.copied_waited, it.fetched, it.consumed = True, False, False, False
        self.stats['copies_out'] += 1
        self.stats['bytes_out'] += it.F.view.nbytes

    def _prefetch(self, it):
        dev = self.device
        free = dev.record(dev.compute())
        dev.wait(dev.in_stream, free)
        dev.wait(dev.in_stream, it.copied_ev)      # the host copy is whole
        timing = self._timing is not None
        start = dev.record(dev.in_stream, timing=True) if timing else None
        dev.h2d(it.host, it.B.view)
        it.fetched_ev = dev.record(dev.in_stream, timing=timing)
        if timing:
            self._timing['copies'].append((it.B.view.nbytes, start, it.fetched_ev))
        it.entry.storage.array = it.B.view
        it.fetched = True
        self.stats['copies_in'] += 1
        self.stats['bytes_in'] += it.B.view.nbytes

    # -- passes (called by AppliedPlan) --------------------------------------------
    def begin_forward(self, start, end):
        if start != 0:
            return
        dev = self.device
        if self._tail is not None:
            for ev in self._tail:                   # last iteration's copies are done
                dev.wait(dev.compute(), ev)
            self._tail = None
        for it in self.items:
            it.reset()
            it.entry.storage.array = it.F.view
        self._next = 0              # into by_bstart: the next prefetch to issue
        self.iteration += 1
        if (not self.calibrated and self.iteration >= self.options.get('calibrate_at',
                                                                       CALIBRATE_AT)) or \
                self._probe is not None:
            self._timing = {'steps': [], 'copies': [], 'captures': _captures()}
            self._aim_hooks()

    def _pause(self):
        dev = self.device
        compute = dev.compute()
        for it in self.items:
            if it.fetched and not it.consumed:
                dev.wait(compute, it.fetched_ev)        # the user may read it now
        self._tail = (dev.record(dev.out_stream), dev.record(dev.in_stream))

    def end_forward(self, start, end):
        if self._timing is not None:
            self._timing['end_forward'] = self.device.record(self.device.compute(), timing=True)
        self._pause()

    def begin_backward(self, start, end):
        pass

    def end_backward(self, start, end):
        timing = self._timing
        if timing is not None:
            timing['end_backward'] = self.device.record(self.device.compute(), timing=True)
        self._pause()
        if timing is not None and end == 0 and self._probe is not None:
            self._timing, probe, self._probe = None, self._probe, None
            self._aim_hooks()
            probe(self._seconds(timing))
            return
        if timing is not None and end == 0:
            self._timing = None
            self._aim_hooks()
            retries = self.iteration - self.options.get('calibrate_at', CALIBRATE_AT)
            if _captures() != timing['captures'] and retries < MAX_RETIMES:
                return      # CUDA graphs were captured in it: not a typical iteration
            self._calibrate(timing)

    # -- look-ahead ------------------------------------------------------------------
    def _seconds(self, timing):
        """Seconds of each of the 2L steps of a timed iteration."""
        dev = self.device
        dev.synchronize()
        L = self.L
        seconds = [0.0] * (2 * L)
        marks = timing['steps']
        for k, (s, ev) in enumerate(marks):
            if k + 1 < len(marks) and marks[k + 1][0] == s + 1 and s != L - 1:
                nxt = marks[k + 1][1]
            else:
                nxt = timing.get('end_forward' if s < L else 'end_backward')
            if nxt is not None:
                seconds[s] = max(dev.seconds(ev, nxt), 0.0)
        return seconds

    def time_next_iteration(self, done):
        """Probes: time the next full iteration's steps, as calibration does,
        and call done(step seconds) after its backward (nothing changes)."""
        self._probe = done

    def _calibrate(self, timing):
        dev = self.device
        seconds = self._seconds(timing)
        copy_bytes = sum(c[0] for c in timing['copies'])
        copy_s = sum(max(dev.seconds(a, b), 0.0) for _, a, b in timing['copies'])
        bandwidth = self.options.get('bandwidth') or \
            (copy_bytes / copy_s if copy_s > 0 else None)
        if bandwidth is None and hasattr(dev, 'measure_bandwidth'):
            bandwidth = dev.measure_bandwidth()
        if bandwidth is None:
            from caffeplus.memory.offload_timing import PCIE_BANDWIDTH
            bandwidth = PCIE_BANDWIDTH
        if self.choosing:
            self._free_samples.append((seconds, bandwidth))
            if len(self._free_samples) < FREE_SAMPLES:
                return          # not calibrated yet: the next iteration is timed too
            seconds = [statistics.median(step) for step in
                       zip(*(times for times, _ in self._free_samples))]
            bandwidth = statistics.median(b for _, b in self._free_samples)
        self.bandwidth, self.step_seconds = bandwidth, seconds
        self.calibrated = True
        if self.choosing:
            self.pending_offload = self._choose_free(seconds, bandwidth)
            return
        choice = {}
        for it in self.items:
            choice[it.entry.names] = max(
                choose_lookahead(seconds, it.last_fwd, it.first_back, it.F.view.nbytes,
                                 bandwidth),
                self.applied.planned_lookahead(it.entry))
        current = {it.entry.names: it.first_back - it.bstart for it in self.items}
        if choice != current:
            # Placed again at the start of the next full forward (AppliedPlan).
            self.pending_lookahead = choice

    def _choose_free(self, seconds, bandwidth):
        """Policy 'free': the maps whose copies these times hide
        (caffeplus.memory.free_offload), within the pinned-memory share of
        this machine."""
        from caffeplus.memory import free_offload, liveness, offload
        from caffeplus.memory.budget import default_host_budget
        applied = self.applied
        net = applied.net
        keep = applied.options.get('keep', ())
        bufs = liveness.buffers(net, keep=keep, training=applied.training)
        candidates = offload.choose(net, bufs, 'free', keep)
        host = self.options.get('host_budget', default_host_budget())
        modelled = free_offload.modelled_step_seconds(net) \
            if self.device.kind == 'cuda' and free_offload.model_bound() else None
        return free_offload.choose_hidden(net, bufs, candidates,
                                          free_offload.hiding_seconds(seconds, self.step_share,
                                                                      modelled),
                                          bandwidth, host_budget=host)

    def lookaheads(self):
        return {it.name: it.first_back - it.bstart for it in self.items}

    # -- lifetime ---------------------------------------------------------------------
    def state_for_relayout(self):
        return {'iteration': self.iteration, 'calibrated': self.calibrated,
                'bandwidth': self.bandwidth, 'step_seconds': self.step_seconds,
                'stats': dict(self.stats), 'free_samples': list(self._free_samples)}

    def restore_after_relayout(self, state):
        self.iteration = state['iteration']
        self.calibrated = state['calibrated']
        self.bandwidth = state['bandwidth']
        self.step_seconds = state['step_seconds']
        self.stats = state['stats']
        self._free_samples = list(state.get('free_samples', ()))

    def close(self):
        """Finish every copy, unhook, give the pinned buffers back to the pool."""
        self.device.synchronize()
        for hooks, fn in self._hooks:
            if fn in hooks:
                hooks.remove(fn)
        self._hooks = []
        for it in self.items:
            if it.host is not None:
                _give_back(self.device, it.count, it.host)
                it.host = None
