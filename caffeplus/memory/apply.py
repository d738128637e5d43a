"""Apply a memory plan to a built net: one arena, every planned buffer a view.

    from caffeplus.memory.apply import apply_named_plan
    apply_named_plan(net, 'shared', keep=['conv1'])        # or caffe.Net(..., memory='shared')

What applying does. `caffeplus.memory.plan.make_plan` says, for every data
and diff Storage of the net's activations, when it is live (its interval
over the 2L forward/backward steps) and, for the reusing plans, which ones
may share bytes. `apply_plan` allocates one arena (NumPy on the CPU, CuPy in
GPU mode) and points every planned Storage's `array` at its view; blobs that
share a Storage (in-place tops, Split outputs, Reshape) follow by themselves.
What must outlive an iteration keeps its own memory, outside the arena:
parameters and their diffs (never planned), and every buffer live for the
whole iteration (loss-weight diffs, inputs, net outputs, kept blobs, diffs a
backward reads before anything writes them, DummyData's constant tops). The
remaining buffers are placed again (best fit, caffeplus.memory.placement)
without those, so the arena is at most plan.arena_bytes.

Plans: `stock` and `arena` place nothing (every blob its own memory, as
Caffe); `shared` reuses dead buffers; `offload` also moves chosen feature
maps to pinned host memory between their forward and backward use
(caffeplus.memory.offload_runtime); `auto` is whichever of these
caffeplus.memory.budget picks for a budget. On the GPU the plan also sets
the cuDNN workspace (caffeplus.memory.workspace): `stock` one buffer per
layer, `arena` one buffer for the net, and the reusing plans views in their
own arena, each live at its call's step only (PlacedWorkspace,
liveness.workspace_buffers). The buffers layers keep from forward to
backward (max pooling's argmax, BatchNorm's normalized copy: declared by
`internal_buffers()`, taken through caffeplus.memory.scratch) are placed in
the arena too, live from the layer's forward to its backward. A map the
plan makes again in backward (caffeplus.memory.recompute: an LRN's or a
pooling layer's output) has two lives like an offloaded one; a backward
hook points its Storage at the second and runs the producing layer's
forward into it just before its first backward use. Under the reusing plans with a
solver that updates in backward (caffeplus.solver.update_in_backward) the
large parameter gradients are placed too, each zeroed by a hook just before
the first backward step that writes it.

Release tracking. Net.forward_from_to / backward_from_to call the applied
plan before and after they run (Net.applied_plan). Before: every release
mark is cleared, so layers touch their blobs freely during the pass (they
may, for shapes; they only read values their `backward_reads` declare), and
the plan is placed again if a blob outgrew its view (a reshape; Net.reshape
re-applies at once). After: a pass that stopped after step t marks every
planned Storage not live at t (Storage.released_reason); reading it through
blob.data/.diff (or pycaffe's net.blobs) then raises a CaffeplusError naming
the blob and how to keep it, never stale numbers. A pass that starts in the
middle (forward(start=...)) first checks that what it reads from before its
start is still there.
"""
import math
import weakref

import numpy

from caffeplus import backend, log
from caffeplus import blob as blob_mod
from caffeplus.backend import release_cached
from caffeplus.blob import HEAD_DEVICE, HEAD_HOST
from caffeplus.errors import CaffeplusError
from caffeplus.memory import (cublas_pool, liveness, masks, placement, recompute, scratch,
                              thread_stack)
from caffeplus.memory.plan import PLACING, PLANS, check_plan_name, make_plan
from caffeplus.memory.plan_options import (_net_keep, _offload_policy,  # noqa: F401
                                          _training_default, check_keep)
from caffeplus.memory.storage_lives import ANY, _Entry, _Life, _OverLimit, storage_uses

FLOAT_BYTES = liveness.FLOAT_BYTES
FLOAT32 = numpy.dtype(numpy.float32)
KEEP_HINT = ('add it to `keep` (caffe.Net(..., keep=[...]) / caffeplus_param { keep: ... }) '
             'to read it')

__all__ = ['apply_plan', 'apply_named_plan', 'remove_plan', 'check_keep', 'AppliedPlan',
           'PLANS']


# -- the applied plan -----------------------------------------------------------------
SPARE_SLACK = 16        # an old arena serves a new layout if at most 1/16 larger


class AppliedPlan:
    """What apply_plan leaves on the net (net.applied_plan): the arena, the
    planned storages and the release bookkeeping; the offload runtime when
    the plan moves feature maps to the host."""

    def __init__(self, net, plan, options):
        self._net = weakref.ref(net)
        self.options = dict(options)
        self.plan = None
        self.name = plan.name
        self.arena = None
        self.arena_bytes = 0
        self.entries = []
        self._planned = {}
        self._pass_tables = {}
        self._marked = []
        self._host_views_seen = None
        self.runtime = None
        self.pause = None           # the step after which the last pass stopped
        self.workspace_bytes = 0    # of the arena: the placed workspace views
        self.internals = {}
        self.internal_views = {}
        self.replans = 0
        self._recompute_hook = None
        self._layout_limit = None   # adopt_lookahead: refuse a larger layout untaken
        # The most the arena may take when a calibrated look-ahead would
        # place it again: plan 'auto' keeps within its budget (what the
        # parameters, history and runtime leave of it); None: no bound but
        # the device's.
        budget = getattr(plan, 'budget', None)
        if budget:
            from caffeplus.memory.budget import planned_budget
            budget = planned_budget(budget)         # as the plan was made
        self.arena_limit = int(budget - plan.peak_bytes + plan.arena_bytes) \
            if budget and plan.arena_bytes else None
        self._build(plan)

    @property
    def net(self):
        return self._net()

    @property
    def training(self):
        return self.options.get('training', True)

    @property
    def choosing_free_offload(self):
        """Offload policy 'free' before its maps are chosen: the runtime times
        an iteration of the plan without offload, then chooses."""
        return getattr(self.plan, 'offload_policy', None) == 'free' and \
            'offload_hidden' not in self.options.get('plan_overrides', {})

    def placed_bytes(self):
        """The arena and the planned storages kept outside it for the whole
        iteration (the data layer's batch): what an offload that moves one
        of those into the arena must lower."""
        return self.arena_bytes + sum(e.lives[0].buf.nbytes for e in self.persistent)

    def _free_offload_shrinks(self, hidden):
        """Whether offloading `hidden` lowers the placed feature maps' arena
        (the plans' own placement, before the workspace joins it)."""
        make = self.options['make_plan']
        overrides = dict(self.options.get('plan_overrides', {}))
        now = make(self.net, **dict(overrides, offload_hidden={}))
        then = make(self.net, **dict(overrides, offload_hidden=dict(hidden)))
        return then.arena_bytes < now.arena_bytes

    def adopt_free_offload(self, hidden):
        """Policy 'free': offload the maps of `hidden` ({buffer key:
        free_offload.Hidden}) from now on; placed again at once (called at
        the start of a full forward, which rewrites every buffer)."""
        from caffeplus.memory.budget import format_bytes
        overrides = dict(self.options.get('plan_overrides', {}))
        overrides.update(offload_policy='free', offload_hidden=dict(hidden))
        self.options['plan_overrides'] = overrides
        if not hidden:
            self._no_free_offload('no feature map\'s copies hide in the measured steps')
            return
        if not self._free_offload_shrinks(hidden):
            # The absences fall where the arena is not at its peak (VGG's
            # and AlexNet's peaks end backward).
            self._no_free_offload('%d feature maps could move unseen, none where the arena '
                                  'peaks' % len(hidden))
            return
        bandwidth = getattr(self.runtime, 'bandwidth', None) or 0
        before = self.placed_bytes()
        # A fresh arena of the new size: the old one, up to 1/16 larger
        # (SPARE_SLACK), would serve again and keep what the choice saves
        # (ResNet-50's 6,346 MiB layout in its old 6,682 MiB on the H200).
        self.relayout(replan=True, reuse=False)     # _set_lookahead takes the prefetch steps
        if self.placed_bytes() >= before:
            # Placed with the workspace, the held and returning lives
            # fragment the arena more than the absences save.
            self._no_free_offload('placed, the arena would not shrink (%s, was %s)'
                                  % (format_bytes(self.placed_bytes()), format_bytes(before)))
            self.relayout(replan=True)
            return
        log.info('Memory plan %s: offload policy free: %d feature maps (%s) move to host memory '
                 'while the measured steps hide their copies (link %s/s); arena %s, was %s',
                 self.name, len(hidden), format_bytes(sum(
                     e.lives[0].buf.nbytes for e in self.entries if e.offloaded)),
                 format_bytes(bandwidth), format_bytes(self.placed_bytes()), format_bytes(before))

    def adopt_lookahead(self, steps):
        """Place the buffers again with the calibrated prefetch steps; if the
        arena that takes does not fit the device, or exceeds arena_limit
        (plan 'auto''s budget), keep the look-ahead it had (prefetches may
        then wait on the link; VGG-16 b1792 under 76 GiB wanted a 98 GB
        arena)."""
        from caffeplus.memory import workspace
        from caffeplus.memory.budget import format_bytes
        before = dict(self.options.get('lookahead_steps') or {})
        before_bytes = self.arena_bytes
        state = self.runtime.state_for_relayout() if self.runtime is not None else None
        why = None
        # (An arena already over the limit may keep its size: the limit is
        # the model's, and the real workspace can come out larger.)
        limit = None if self.arena_limit is None else max(self.arena_limit, before_bytes)
        # Refused before it is taken: VGG-16 b256 under 12 GiB briefly held
        # a 3 GiB larger arena, over the budget, only to give it back.
        self._layout_limit = limit
        try:
            self.relayout(lookahead_steps=steps)
        except _OverLimit as over:
            why = 'takes %s, over the %s the budget leaves' % (
                format_bytes(over.args[0]), format_bytes(limit))
        except Exception as exc:        # CuPy's and CUDA's out-of-memory types
            if not workspace.is_out_of_memory(exc):
                raise
            why = 'does not fit the device (%s)' % workspace.requested_bytes(exc)
        finally:
            self._layout_limit = None
        if why is None:
            return
        log.info('Memory plan %s: the calibrated offload look-ahead is not used: its arena %s; '
                 'prefetches keep their planned steps', self.name, why)
        self.relayout(lookahead_steps=before, reuse=False)
        if self.runtime is not None:
            if state is not None:       # calibrated: it proposes nothing again
                self.runtime.restore_after_relayout(state)
            self.runtime.pending_lookahead = None

    def _no_free_offload(self, why):
        """Policy 'free' keeps every map on the device from now on."""
        log.info('Memory plan %s: offload policy free: %s; no map moves', self.name, why)
        self.options['plan_overrides']['offload_hidden'] = {}
        if self.runtime is not None and not any(e.offloaded for e in self.entries):
            self.runtime.close()        # it only timed: nothing to copy
            self.runtime = None

    # -- layout ---------------------------------------------------------------------
    def _build(self, plan, spare=None):
        """Place the plan's buffers in an arena. `spare`: a list holding an
        old arena whose values are dead (the only reference to it); it
        serves again when the layout fits in it, else it is let go before
        the new arena is taken, so two arenas never coexist."""
        net = self.net
        self.plan = plan
        L = len(net.layers)
        self.L = L
        self.steps = plan.steps or (2 * L if self.training else L)
        xp = backend.xp()
        self.xp = xp
        blobs = dict(zip(net._blob_names, net._blobs))
        params = {id(p.data_storage) for p in net.param_blobs} | \
            {id(p.diff_storage) for p in net.param_blobs}
        by_storage = {}
        offloaded = set(plan.offloaded)
        again = getattr(plan, 'recomputed', None) or {}
        for buf in plan.buffers:
            if buf.kind in ('workspace', 'internal'):
                continue        # the real ones come from the layers (self.workspace, scratch)
            if buf.kind == 'param_diff':
                # A parameter's gradient, applied in backward (update_in_backward).
                param = net.learnable_params[buf.key[1]]
                entry = by_storage[id(param.diff_storage)] = _Entry(
                    param.diff_storage, buf.kind, (self._param_name(buf.key[1]),), [param])
                entry.lives.append(_Life(buf))
                continue
            # One storage, or two whose diffs overlay (liveness.diff_overlays):
            # one life, one place in the arena, shared by both.
            life = _Life(buf)
            for storage, names in liveness.buffer_storages(buf, blobs):
                if id(storage) in params:
                    continue        # a Parameter layer's top: the parameter stays where it is
                entry = by_storage.get(id(storage))
                if entry is None:
                    entry = by_storage[id(storage)] = _Entry(
                        storage, buf.kind, tuple(names), [blobs[n] for n in names])
                entry.lives.append(life)
                if buf.key[:2] in offloaded or buf.key in offloaded:
                    entry.offloaded = True
                if buf.key[:2] in again:
                    entry.producer = again[buf.key[:2]]
        if self.training:
            for step, top, _ in liveness.overlay_steps(net):
                entry = by_storage.get(id(blobs[top].diff_storage))
                if entry is not None and len(entry.lives) == 1 and \
                        entry.lives[0].buf.start < step < entry.lives[0].buf.end:
                    entry.overwritten_at = step
        entries = list(by_storage.values())
        uses = storage_uses(net, self.training)
        for e in entries:
            e.uses = tuple(sorted(uses.get(id(e.storage), ())))
            # (A use by a filter call alone may end a life half a step early:
            # recompute.again_lives.)
            outside = [u for u in e.uses if e.live_at(u) is None and
                       not any(life.end == u - liveness.FILTER_FIRST for life in e.lives)]
            if outside:
                # e.g. a plan made on the CPU's layers applied to the GPU's,
                # whose backward reads more: values would be overwritten.
                raise CaffeplusError(
                    "memory plan '%s' does not fit net %s: blob %s (%s) is used at step %d "
                    "(%s), outside its planned lives %s; make the plan on this net"
                    % (plan.name, net.name, e.name, e.kind, outside[0],
                       self._step_name(outside[0]),
                       ', '.join('%g-%g' % (life.start, life.end) for life in e.lives)))
            e.lives.sort(key=lambda life: life.start)
            e.persistent = len(e.lives) == 1 and e.lives[0].start <= 0 and \
                e.lives[0].end >= self.steps
        if any(e.offloaded for e in entries):
            self._set_lookahead(entries, self.options.get('lookahead_steps') or {})
        placed = list({id(life): life for e in entries if not e.persistent
                       for life in e.lives}.values())
        # An offloaded map's return copy is issued before its first step's
        # layer runs, so it must not share bytes with a filter call's
        # workspace placed half a step early (liveness.FILTER_FIRST).
        returning = {id(e.lives[1]) for e in entries if e.offloaded and len(e.lives) > 1}
        bufs = [liveness.Buffer(('life', i), 'x', (), life.buf.nbytes,
                                math.ceil(life.start) - liveness.FILTER_FIRST
                                if id(life) in returning else life.start, life.end)
                for i, life in enumerate(placed)]
        ws_bufs = self._workspace_buffers(bufs)
        unfused = any(e.offloaded for e in entries) and \
            not self.options.get('runtime', {}).get('fused_chains', True)
        kept_bufs = self._internal_buffers(unfused)
        last = ('workspace',) if getattr(self.plan, 'call_workspace', None) else ()
        offsets, arena_bytes = placement.place_refitted(bufs + ws_bufs + kept_bufs, last)
        # What was placed and where, for dev/arena_layout.py: ('life', i) is placed[i].
        self.layout = (bufs + ws_bufs + kept_bufs, placed, offsets)
        if self._layout_limit is not None and arena_bytes > self._layout_limit:
            raise _OverLimit(arena_bytes)
        self.arena_bytes = arena_bytes
        count = max(arena_bytes // FLOAT_BYTES, 1)
        old = spare.pop() if spare else None
        # (Not when much larger: a view would keep all of it allocated.)
        if old is not None and count <= old.size <= count + count // SPARE_SLACK and \
                backend.get_array_module(old) is xp:
            # A re-layout that keeps no values: the old arena's bytes serve
            # again (layers' cached views of it stay harmless).
            old[:count].fill(0)
            self.arena = old[:count]
        else:
            if old is not None:
                del old                 # the last reference: back to the device first
                release_cached(xp)
            self.arena = xp.zeros(count, dtype=numpy.float32)
        dtypes = {id(life): e.storage.dtype if xp is not numpy else FLOAT32
                  for e in entries if not e.persistent for life in e.lives}
        for b, life in zip(bufs, placed):
            life.offset = offsets[b.key]
            # Each life in its storage's type (16-bit activations on the GPU).
            dtype = dtypes.get(id(life), FLOAT32)
            life.view = scratch.view_of(self.arena, life.offset,
                                        life.buf.nbytes // dtype.itemsize, dtype)
        self._place_workspace(ws_bufs, offsets)
        self._place_internals(kept_bufs, offsets)
        # Bytes the workspace views and kept buffers take from their first
        # step: the offload runtime lets them land only after the copies
        # out of an offloaded feature map that lay there have read it.
        self.extra_regions = [(b.start, offsets[b.key], b.nbytes) for b in ws_bufs + kept_bufs]
        from caffeplus.memory.plan import shares_at_peak
        typed = [b._replace(kind=life.buf.kind) for b, life in zip(bufs, placed)] + ws_bufs + \
            kept_bufs
        self.shares = shares_at_peak(typed, self.steps)
        for e in entries:
            if e.persistent:
                continue
            st = e.storage
            st.array = e.lives[0].view
            st.released_reason = None
            # A host mirror (pycaffe in GPU mode) describes the old array.
            st.host = None
            if st.head == HEAD_HOST:
                st.head = HEAD_DEVICE
        self.entries = [e for e in entries if not e.persistent]
        self.persistent = [e for e in entries if e.persistent]
        self._planned = {id(e.storage): e for e in self.entries}
        self._reasons()
        if any(e.offloaded for e in self.entries) or self.choosing_free_offload:
            from caffeplus.memory import offload_runtime
            self.runtime = offload_runtime.OffloadRuntime(self, **self.options.get('runtime', {}))
        self._hook_recompute()
        self._hook_param_diffs()
        self.pause = None
        self._pass_tables = {}      # (s0, t) -> _pass_table's, for these entries
        self._marked = []           # storages _mark released, for _unmark to clear
        self._host_views_seen = None

    def read_after(self, storage, step):
        """Whether the plan keeps a blob's data or diff `storage` past step
        `step`; False where every life of it ends by then (reading it later
        raises), so a fused kernel need not store it."""
        entry = self._planned.get(id(storage))
        if entry is None:
            return True
        # (A later life of a map made again holds what its producer writes then.)
        lives = entry.lives[:1] if entry.producer is not None else entry.lives
        return any(life.end > step for life in lives)

    # -- parameter gradients applied in backward (caffeplus.solver.update_in_backward) ----
    def _param_name(self, k):
        net = self.net
        owner = net.learnable_param_ids.index(k)
        layer_id, index = net.param_layer_indices[owner]
        return '%s[%d]' % (net._layer_names[layer_id], index)

    def _hook_param_diffs(self):
        """A placed gradient starts at zero (Caffe's ClearParamDiffs) just
        before the first backward step that writes it: hooked after the
        offload runtime's, which first waits for copies out of those bytes."""
        self._unhook_param_diffs()
        L = self.L
        starts = {}
        for e in self.entries:
            if e.kind == 'param_diff':
                step = int(math.ceil(e.lives[0].start))
                starts.setdefault(2 * L - 1 - step, []).append(e)
        if not starts:
            return
        xp = self.xp

        def zero_before(i):
            todo = starts.get(i)
            if not todo:
                return
            from caffeplus import kernels
            blobs = [e.blobs[0] for e in todo]
            if xp is numpy or not kernels.zero_diffs(blobs):
                for b in blobs:
                    b.diff[...] = 0
        # At step boundaries, on whole gradients a chain's first step writes
        # (liveness.param_diff_spans counts the chains): fused chains stay fused.
        zero_before.chain_safe = True
        zero_before.graph_safe = True           # the same memsets every pass (caffeplus.pass_graph)
        zero_before.at = frozenset(starts)      # called at those layers only (Net.hook_table)
        self._zero_hook = zero_before
        self.net.before_layer_backward.append(zero_before)

    def _unhook_param_diffs(self):
        hook = getattr(self, '_zero_hook', None)
        net = self._net()
        if hook is not None and net is not None and hook in net.before_layer_backward:
            net.before_layer_backward.remove(hook)
        self._zero_hook = None

    def keep_param_diffs(self):
        """Place again with every parameter gradient kept whole (the solver
        can no longer update in backward)."""
        self.options.setdefault('plan_overrides', {})['param_diffs'] = False
        self.relayout(replan=True)

    # -- maps made again in backward (caffeplus.memory.recompute) ------------------------
    def _hook_recompute(self):
        """Hook the backward steps at which a map made again is first read.
        After the offload runtime's hooks: a copy out of a map that lay in
        the same bytes must have read them before the producer writes there."""
        self._unhook_recompute()
        at = {}
        for e in self.entries:
            if e.producer is not None and len(e.lives) >= 2:
                for life in e.lives[1:]:
                    at.setdefault(int(math.ceil(life.start)), []).append((e, life))
        for todo in at.values():
            # In forward order: a residual sum after the maps it adds.
            todo.sort(key=lambda item: recompute.layers_of(item[0].producer)[0])
        self.recompute_at = at
        if not at:
            return

        def hook(i, _self=weakref.ref(self)):
            applied = _self()
            if applied is not None:
                applied._recompute_before(i)
        hook.chain_safe = True          # it runs no layer of a fused chain
        hook.graph_safe = True          # the same layers again every pass
        hook.at = frozenset(2 * self.L - 1 - step for step in at)
        self._recompute_hook = hook
        self.net.before_layer_backward.append(hook)

    def _unhook_recompute(self):
        hook, self._recompute_hook = self._recompute_hook, None
        net = self.net
        if hook is not None and net is not None and hook in net.before_layer_backward:
            net.before_layer_backward.remove(hook)

    def _recompute_before(self, i):
        """Before backward step 2L-1-i: the maps first read there made again
        into those lives (recompute.make_again)."""
        recompute.make_again(self.net, self.recompute_at.get(2 * self.L - 1 - i, ()),
                             self.workspace)

    # -- the convolution workspace, placed with the buffers ----------------------------
    @property
    def workspace(self):
        """The net's PlacedWorkspace (GPU mode), or None."""
        ws = self.options.get('workspace')
        return ws if ws is not None and hasattr(ws, 'set_views') else None

    def _workspace_buffers(self, bufs):
        """The workspace views' buffers; first the manager learns, for each
        layer's forward and backward step, how many bytes the other buffers
        leave free below their peak, so that where a nearly-as-fast
        algorithm fits there it need not raise the peak."""
        gemm = liveness.gemm_workspace_buffers(self.net, self._gemm_bytes(), self.training)
        ws = self.workspace
        if ws is None:
            return gemm
        net = self.net
        layers = net.layers
        calls = getattr(self.plan, 'call_workspace', None)
        if calls:
            # Plan auto under a budget: each call within the bytes it planned
            # for it (budget.fit_calls: the fastest that fits its step).
            index = {name: i for i, name in enumerate(net._layer_names)}
            room = {(id(layers[index[name]]), part): n for (name, part), n in calls.items()}
        else:
            room = {(id(layers[i]), part): n for (i, part), n in
                    liveness.headroom(net, bufs, self.steps, self.training).items()}
        if room != getattr(ws, 'headroom', None):
            ws.headroom = room
            ws._dirty = True            # choose again with the new room
        if ws.search_pending():
            # A timed search is to run, before the arena is taken: it may
            # use the bytes the placed maps will hold (search_limit).
            ws.search_room = placement.place(bufs)[1]
        sizes = ws.sizes(net)
        plan = self.plan
        again = getattr(plan, 'recomputed', {})
        return liveness.workspace_buffers(net, sizes, self.training) + \
            recompute.workspace_buffers(net, plan.buffers, again, sizes) + gemm

    def _gemm_bytes(self):
        """cuBLAS's workspace for each InnerProduct call, placed in the
        arena (caffeplus.memory.cublas_pool), or 0 (CPU; not this GPU; a
        layer that runs GEMMs through CuPy)."""
        if backend.mode() != backend.GPU or cublas_pool.cupy_gemm_layers(self.net):
            return 0
        import cupy
        return cublas_pool.arena_bytes(self.plan.name, cupy.cuda.Device().compute_capability)

    def _place_workspace(self, ws_bufs, offsets):
        net = self.net
        layers = {name: layer for name, layer in zip(net._layer_names, net.layers)}
        base = int(self.arena.data.ptr) if hasattr(self.arena, 'data') and \
            hasattr(self.arena.data, 'ptr') else 0
        views, gemm_views = {}, {}
        for b in ws_bufs:
            _, layer_name, pass_kind = b.key
            layer = layers[layer_name]
            view = (base + offsets[b.key], b.nbytes)
            if liveness.takes_gemm_workspace(layer):
                gemm_views.setdefault(layer_name, {})[pass_kind] = view
            else:
                views[(id(layer), pass_kind)] = view
        _set_gemm_views(net, gemm_views)
        self.workspace_bytes = sum(b.nbytes for b in ws_bufs)
        # As the memory command reports them (plan.workspace_calls).
        self.workspace_calls = {'%s/%s' % b.key[1:]: int(b.nbytes) for b in ws_bufs}
        ws = self.workspace
        if ws is None:
            return
        ws.set_views(views)

    # -- buffers layers keep from forward to backward (caffeplus.memory.scratch) -------
    def _internal_buffers(self, unfused=False):
        net = self.net
        if backend.mode() == backend.GPU:
            # Which layers run as fused chains decides what they keep
            # (layers/fused_chain.py: a chained Scale keeps nothing of its own).
            # Offload with fused_chains=False unfuses them
            # (offload_runtime._hook): a hook that is not chain-safe stands
            # in for its hooks while deciding.
            from caffeplus import kernels
            stand_in = (lambda i: None) if unfused else None
            if stand_in is not None:
                net.before_layer_forward.append(stand_in)
            try:
                kernels.begin_pass(net, 0, len(net.layers) - 1, False)
            finally:
                if stand_in is not None:
                    net.before_layer_forward.remove(stand_in)
        self.internals = {}         # layer index -> {name: (count, dtype)}
        for i, layer in enumerate(net.layers):
            declared = scratch.declared(layer)
            if declared:
                self.internals[i] = declared
        sizes = {i: {name: scratch.nbytes(c, d) for name, (c, d) in named.items()}
                 for i, named in self.internals.items()}
        return liveness.internal_buffers(net, sizes, self.training)

    def _place_internals(self, kept_bufs, offsets):
        net = self.net
        views = {}
        for b in kept_bufs:
            _, layer_name, name = b.key
            i = net._layer_names.index(layer_name)
            count, dtype = self.internals[i][name]
            views.setdefault(i, {})[name] = scratch.view_of(self.arena, offsets[b.key],
                                                            count, dtype)
        for i, layer in enumerate(net.layers):
            if i in views or scratch.VIEWS in layer.__dict__:
                scratch.set_views(layer, views.get(i, {}))
        self.internal_views = views
        self._fits = None          # placed anew: check again

    def _internals_outgrown(self):
        net = self.net
        for i, layer in enumerate(net.layers):
            have = getattr(self, 'internal_views', {}).get(i, {})
            for name, (count, dtype) in scratch.declared(layer).items():
                view = have.get(name)
                if view is None or view.size < count or view.dtype != dtype:
                    return True
        return False

    def _set_workspace_pass(self, pass_kind, start):
        """Before a pass: the views it checks out; placed again first if the
        algorithms changed since (a reshape), keeping what a pass that
        starts in the middle reads."""
        ws = self.workspace
        if ws is None:
            return
        ws.ensure_planned()
        if ws.layout_stale:
            self.relayout(preserve=start > 0 or pass_kind == 'backward')
        ws.pass_kind = pass_kind

    def planned_lookahead(self, e):
        """The prefetch distance plan `auto` planned for an offloaded entry
        whose bytes it holds (offload_timing), else 0."""
        held = getattr(self.plan, 'offload_holds', None) or {}
        h = held.get(e.lives[0].buf.key[:2])        # the key before shorten's suffix
        if h is None:
            return 0
        from caffeplus.memory import offload
        return min(offload._uses(self.net, e.lives[0].buf)[1]) - h.prefetch

    def _set_lookahead(self, entries, lookahead_steps):
        """Offloaded storages: their backward life starts `lookahead` steps
        before the first backward use (per storage when calibrated; policy
        'free': at the prefetch step it chose; maps plan `auto` holds: at
        least as early as it planned)."""
        from caffeplus.memory import offload
        net = self.net
        default = self.options.get('lookahead') or 1
        if not isinstance(default, int):
            default = 1
        hidden = self.options.get('plan_overrides', {}).get('offload_hidden') or {}
        for e in entries:
            if not e.offloaded or len(e.lives) != 2:
                e.offloaded = False
                continue
            fwd, bwd = offload._uses(net, e.lives[0].buf)
            last_fwd, first_back = e.lives[0].end, min(bwd)
            chosen = hidden.get(e.lives[0].buf.key[:2])      # the key before shorten's suffix
            planned = self.planned_lookahead(e)
            if chosen is not None:
                k = first_back - chosen.prefetch
            elif e.names in lookahead_steps:
                k = max(int(lookahead_steps[e.names]), planned)
            else:
                k = planned or default
            e.lives[1].start = max(first_back - max(k, 1), last_fwd + 1)

    def _reasons(self):
        net = self.net
        L = self.L

        def where(step):
            step = int(math.ceil(step))     # (a branch top made again lives half a step)
            if step < L:
                return 'forward', net._layer_names[step]
            return 'backward', net._layer_names[2 * L - 1 - step]

        for e in self.entries:
            first, last = e.lives[0], e.lives[-1]
            if e.kind == 'param_diff':
                hint = 'update_in_backward: false in the solver\'s caffeplus_param (or ' \
                    'CAFFEPLUS_UPDATE_IN_BACKWARD=0) keeps every parameter gradient after ' \
                    'the iteration'
                e.reasons['after'] = (
                    "parameter gradient applied by the solver's update in backward (after layer "
                    "%s), then its memory lent to other blobs by memory plan '%s'; %s"
                    % (where(last.end)[1], self.name, hint))
                e.reasons['before'] = (
                    "parameter gradient not written yet: memory plan '%s' lends its memory to "
                    "other blobs until backward of layer %s; %s"
                    % (self.name, where(int(math.ceil(first.start)))[1], hint))
                continue
            phase, layer = where(min(last.end, 2 * L - 1))
            e.reasons['after'] = (
                "released by memory plan '%s' after its last use in %s (layer %s); %s"
                % (self.name, phase, layer, KEEP_HINT))
            phase, layer = where(max(first.start, 0))
            e.reasons['before'] = (
                "not written yet at this point of the iteration: memory plan '%s' lends its "
                "memory to other blobs until %s of layer %s; %s"
                % (self.name, phase, layer, KEEP_HINT))
            back = int(math.ceil(e.lives[1].start)) if len(e.lives) > 1 else None
            if back is not None and e.producer is not None:
                maker = net._layer_names[recompute.layers_of(e.producer)[0]]
                e.reasons['between'] = (
                    "released by memory plan '%s' after its last forward use (layer %s); layer "
                    "%s makes it again for backward (layer %s); %s"
                    % (self.name, where(first.end)[1], maker, where(back)[1], KEEP_HINT))
            elif back is not None:
                e.reasons['between'] = (
                    "offloaded to host memory by memory plan '%s' between its last forward use "
                    "(layer %s) and its return for backward (layer %s); %s"
                    % (self.name, where(first.end)[1], where(back)[1], KEEP_HINT))

    def _step_name(self, t):
        L = self.L
        names = self.net._layer_names
        return 'forward of %s' % names[t] if t < L else 'backward of %s' % names[2 * L - 1 - t]

    def _reason_at(self, e, t):
        if t < e.lives[0].start:
            return e.reasons['before']
        if t > e.lives[-1].end:
            return e.reasons['after']
        return e.reasons.get('between', e.reasons['after'])

    def detach(self, copy=True):
        """Forget the plan: every arena storage gets its own copy of its
        view (`copy`), or no array (allocated again when first touched)."""
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None
        self._unhook_recompute()
        self._unhook_param_diffs()
        for e in self.entries:
            st = e.storage
            st.released_reason = None
            arr = st.array
            if arr is not None and any(arr is life.view for life in e.lives):
                st.array = arr.copy() if copy else None
        self.entries = []
        self._planned = {}
        self._pass_tables = {}
        if self.net is not None:
            _set_gemm_views(self.net, {})
        for layer in self.net.layers if self.net is not None else ():
            if scratch.VIEWS in layer.__dict__:
                scratch.set_views(layer, {})
        self.internal_views = {}
        self._fits = None          # placed anew: check again
        self.arena = None

    def relayout(self, lookahead_steps=None, replan=False, preserve=False, reuse=True):
        """Place the buffers again (new shapes, a new offload look-ahead).
        `preserve`: storages holding values keep them (copied over); else
        the new arena starts as a fresh plan's (nothing computed yet), in
        the old arena's bytes where they fit, unless `reuse` is False (a
        refused larger arena must go)."""
        if lookahead_steps is not None:
            self.options['lookahead_steps'] = dict(lookahead_steps)
        plan = self.plan
        if replan:
            plan = self.options['make_plan'](self.net, **self.options.get('plan_overrides', {}))
        kept = {}
        if preserve:
            for e in self.entries:
                if e.valid is not None and e.storage.array is not None:
                    index = None if e.valid is ANY else e.lives.index(e.valid)
                    kept[id(e.storage)] = (e.storage.array, index)
        kept_internals = {}
        if preserve:
            for i, named in getattr(self, 'internal_views', {}).items():
                for name, view in named.items():
                    kept_internals[(i, name)] = view.copy()
        runtime_state = self.runtime.state_for_relayout() if self.runtime is not None else None
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None
        for e in self.entries:
            e.storage.released_reason = None
        old_entries, spare = self.entries, []
        if not preserve:
            spare.append(self.arena_base() if reuse else None)
            self._drop_views(old_entries)
        self.arena = None
        self._build(plan, spare)
        planned = {id(e.storage) for e in self.entries}
        for e in old_entries:
            # Persistent now (e.g. no longer reused after a reshape): its own copy.
            arr = e.storage.array
            if arr is not None and id(e.storage) not in planned and \
                    any(arr is life.view for life in e.lives):
                e.storage.array = arr.copy()
        for e in self.entries:
            old = kept.get(id(e.storage))
            if old is None:
                continue
            array, index = old
            life = e.lives[min(index or 0, len(e.lives) - 1)]
            n = min(array.size, life.view.size)
            life.view[:n] = array[:n]
            e.storage.array = life.view
            e.valid = ANY if index is None else life
        for (i, name), old in kept_internals.items():
            view = self.internal_views.get(i, {}).get(name)
            if view is not None and view.dtype == old.dtype:
                n = min(view.size, old.size)
                view[:n] = old[:n]
        if runtime_state is not None and self.runtime is not None:
            self.runtime.restore_after_relayout(runtime_state)
        self.replans += 1
        del kept, kept_internals, old_entries
        release_cached(self.xp)         # the old arena, when the values came over

    def arena_base(self):
        """The whole array behind the arena (a reused arena is a view of it)."""
        arena = self.arena
        if arena is None:
            return None
        return arena.base if arena.base is not None else arena

    def _drop_views(self, entries):
        """Before a re-layout that keeps no values: let go of every view of
        the old arena, so that it is freed before the new one is taken (two
        arenas at once would be the peak), unless it serves again (_build)."""
        for e in entries:
            arr = e.storage.array
            if arr is not None and any(arr is life.view for life in e.lives):
                e.storage.array = None
        # (Only then: overlaid diffs share a life, liveness.diff_overlays.)
        for e in entries:
            for life in e.lives:
                life.view = None
        _set_gemm_views(self.net, {})
        for layer in self.net.layers:
            # Every layer: one in a fused chain may hold a view of another's
            # kept buffer (a chained Scale, BatchNorm's normalized copy).
            scratch.forget(layer)
        self.internal_views = {}
        self._fits = None          # placed anew: check again
        release_cached(self.xp)

    _fits = None        # the state in which the buffers were last seen to fit

    def _outgrown(self):
        if backend.xp() is not self.xp:
            return True
        # What the buffers' sizes follow: the blobs' shapes, and the layers'
        # kept buffers (their shapes, the fused kernels, the passes' hooks).
        # Checking costs a pass over every buffer and layer (0.86 ms of host
        # time on ResNet-50, where the GPU waits for each iteration's start).
        from caffeplus import kernels
        net = self.net
        state = (blob_mod.shape_changes(), kernels.active(), len(net.before_layer_forward),
                 len(net.after_layer_forward), len(net.before_layer_backward),
                 len(net.on_layer_backward_done))
        if state == self._fits:
            return False
        if self._internals_outgrown():
            return True
        for e in self.entries:
            if e.needed() > e.capacity():
                return True
        self._fits = state
        return False

    # -- the net's hooks ----------------------------------------------------------
    def _unmark(self, first_step):
        """Clear the release marks before a pass that starts at `first_step`;
        a host mirror newer than the device (pycaffe wrote it) goes to the
        device now if the storage is live there, else it is dropped: later it
        could land on bytes another buffer owns."""
        for st in self._marked:
            st.released_reason = None
        self._marked = []
        if blob_mod.host_views() == self._host_views_seen:
            return              # no mirror handed out since the last look: none is newer
        self._host_views_seen = blob_mod.host_views()
        for e in self.entries:
            st = e.storage
            if st.head == HEAD_HOST:
                if e.live_at(first_step) is not None and st.array is not None:
                    st._push_host()
                else:
                    st.host = None
                    st.head = HEAD_DEVICE

    def _pass_table(self, s0, t):
        """What _check_start and _mark look up for a pass over steps s0..t,
        worked out once per layout (the entries and their lives change only
        in _build): the entries the pass reads before writing them, with
        their life at s0, and each entry's life at t (None: released then,
        with why), and whether the pass overwrites it. A training iteration
        asks for the same two passes every time: on a host-bound net
        (GoogLeNet at small batches) each pass over ~340 entries cost the
        GPU's wait about 0.2 ms."""
        key = (s0, t)
        table = self._pass_tables.get(key)
        if table is None:
            reads = []
            if s0 > 0:
                for e in self.entries:
                    life = e.live_at(s0)
                    if life is not None and life.start < s0 and \
                            any(s0 <= u <= t for u in e.uses):
                        reads.append((e, life))
            ends = []
            for e in self.entries:
                life = e.live_at(t)
                overwritten = e.overwritten_at is not None and s0 <= e.overwritten_at <= t
                ends.append((e, life, overwritten,
                             self._reason_at(e, t) if life is None else None))
            table = self._pass_tables[key] = (reads, ends)
        return table

    def _check_start(self, s0, t, what):
        """A pass over steps s0..t reads, before writing them, the storages
        written before s0 that it uses: they must hold their values still."""
        if s0 <= 0:
            return
        bad = [e for e, life in self._pass_table(s0, t)[0]
               if not (e.valid is ANY or e.valid is life)]
        if bad:
            e = bad[0]
            reason = e.storage.released_reason or e.stale or self._reason_at(e, self.pause)
            raise CaffeplusError(
                'cannot run %s: it reads %s, whose memory is not intact; blob %s: %s'
                % (what, ', '.join('blob %s (%s)' % (b.name, b.kind) for b in bad), e.name,
                   reason))

    def _mark(self, s0, t, what):
        """After a pass over steps s0..t: what each storage holds now; mark
        the ones released (not live at t, or live but not rewritten by this
        pass after the plan reused them)."""
        self.pause = t
        marked = self._marked
        for e, life, overwritten, released in self._pass_table(s0, t)[1]:
            if overwritten:
                e.valid = None
                marked.append(e.storage)
                e.stale = e.storage.released_reason = (
                    "overwritten in the backward of layer %s, which memory plan '%s' lets "
                    "write its bottom's gradient where this one was; %s"
                    % (self.net._layer_names[2 * self.L - 1 - e.overwritten_at], self.name,
                       KEEP_HINT))
            elif life is None:
                e.valid = None
                marked.append(e.storage)
                e.storage.released_reason = released
            elif life.start >= s0 or e.valid is ANY or e.valid is life:
                e.valid = life
                e.storage.released_reason = None
            else:
                e.valid = None
                marked.append(e.storage)
                e.stale = e.storage.released_reason = (
                    "not recomputed by the last pass (%s), which started after it was "
                    "written, while memory plan '%s' had reused its memory; run the pass from "
                    "an earlier layer, or %s" % (what, self.name, KEEP_HINT))

    def before_forward(self, start, end):
        if self._outgrown():
            log.info('Memory plan %s: blobs changed size; placing the buffers again', self.name)
            self.relayout(replan=True, preserve=start > 0)
        elif start == 0 and self.runtime is not None and \
                self.runtime.pending_offload is not None:
            self.adopt_free_offload(self.runtime.pending_offload)
        elif start == 0 and self.runtime is not None and self.runtime.pending_lookahead:
            # A full forward rewrites every buffer before reading it: the
            # arena may move now (the offload look-ahead was calibrated).
            self.adopt_lookahead(self.runtime.pending_lookahead)
        self._set_workspace_pass('forward', start)
        what = 'forward from layer %s' % self.net._layer_names[start]
        self._check_start(start, end, what)
        self._unmark(start)
        for e in self.entries:
            if e.producer is not None and start <= recompute.layers_of(e.producer)[0]:
                e.storage.array = e.lives[0].view       # forward writes its first life
        if self.runtime is not None:
            self.runtime.begin_forward(start, end)

    def after_forward(self, start, end):
        if self.runtime is not None:
            self.runtime.end_forward(start, end)
        self._mark(start, end, 'forward from layer %s' % self.net._layer_names[start])

    def _backward_steps(self, start, end):
        return 2 * self.L - 1 - start, 2 * self.L - 1 - end

    def before_backward(self, start, end):
        if not self.training:
            raise CaffeplusError(
                "net %s: memory plan '%s' was made for forward passes only (a TEST net); "
                "backward would read blobs it reused. Build the net with memory='stock', or "
                "in phase TRAIN / with force_backward" % (self.net.name, self.name))
        self._set_workspace_pass('backward', start)
        s0, t = self._backward_steps(start, end)
        self._check_start(s0, t, 'backward from layer %s' % self.net._layer_names[start])
        self._unmark(s0)
        if self.runtime is not None:
            self.runtime.begin_backward(start, end)

    def after_backward(self, start, end):
        if self.runtime is not None:
            self.runtime.end_backward(start, end)
        s0, t = self._backward_steps(start, end)
        self._mark(s0, t, 'backward from layer %s' % self.net._layer_names[start])

    def reshaped(self):
        """Net.reshape() ran: place the buffers for the new sizes if they grew."""
        if self._outgrown():
            self.relayout(replan=True, preserve=True)

    def placed_rows(self):
        """[(name, kind, nbytes, start, end, offset)] of every buffer the
        layout placed (the lives, named by their storages; the workspace
        and layer buffers by their keys)."""
        bufs, placed, offsets = self.layout
        names = {}
        for e in self.entries:
            for life in e.lives:
                names.setdefault(id(life), []).append('%s(%s)' % (e.name, e.kind))
        rows = []
        for b in bufs:
            if b.key[0] == 'life':
                life = placed[b.key[1]]
                name, kind = ','.join(names.get(id(life), ['?'])), life.buf.kind
            else:
                name, kind = '/'.join(str(k) for k in b.key), b.kind
            rows.append((name, kind, b.nbytes, b.start, b.end, offsets[b.key]))
        return rows

    def info(self):
        base = self.arena_base()
        return {'applier': 'caffeplus.memory.apply', 'plan': self.name, 'arena': self.arena,
                'arena_bytes': self.arena_bytes,
                # What the device holds for it (an old arena serving a new
                # layout may be up to 1/SPARE_SLACK larger) and the bytes
                # live at the layout's busiest step (no placement is smaller).
                'arena_held_bytes': int(base.nbytes) if base is not None else 0,
                'arena_bound_bytes': int(placement.live_bound(self.layout[0])),
                'arena_shares': dict(self.shares),
                'planned_storages': len(self.entries),
                'persistent_storages': len(self.persistent),
                'offloaded': [e.name for e in self.entries if e.offloaded]}


# -- entry points -------------------------------------------------------------------
def _set_gemm_views(net, views):
    """Give each InnerProduct its cuBLAS workspace views ({layer name:
    {'forward' | 'backward': (pointer, bytes)}}; a layer not named gets
    none, and runs its GEMMs on CuPy's handle)."""
    for name, layer in zip(net._layer_names, net.layers):
        if liveness.takes_gemm_workspace(layer):
            if views.get(name) or layer.__dict__.get('gemm_views'):
                layer.gemm_views = dict(views.get(name, {}))


def remove_plan(net, keep_values=True):
    """Undo an applied plan: every blob owns its memory again (with its
    values, or, without `keep_values`, allocated anew when first touched)."""
    applied = getattr(net, 'applied_plan', None)
    if applied is not None:
        applied.detach(copy=keep_values)
    net.applied_plan = None


def _apply_workspace(net, plan, limit):
    """GPU mode: the plan's cuDNN workspace (stock: per layer; else one arena)."""
    if backend.mode() != backend.GPU:
        return None
    try:
        from caffeplus.memory import workspace as ws
    except ImportError:
        return None
    if not hasattr(ws, 'apply_workspace_plan') or not ws.workspace_layers(net):
        return None
    limit = int(limit or 0)
    if plan.name == 'auto' and not limit:
        # 0 would mean "what the GPU spares"; the search chose a cap.
        limit = max(int(getattr(plan, 'workspace_cap', 0)), 1)
    manager = ws.apply_workspace_plan(net, 'stock' if plan.name == 'stock' else plan.name, limit)
    if plan.name == 'auto' and getattr(plan, 'budget', None) and manager is not None:
        # Under a budget no workspace may raise the placed peak while a
        # slower algorithm fits (VGG-16 b1536 at 76 GiB: the 10%-slower rule
        # left 10 GiB of workspace at the peak, 7 GiB more than planned).
        manager.headroom_slowdown = float('inf')
    return manager


def apply_plan(net, plan, keep=(), training=None, workspace_limit=None, lookahead=None,
               make=None, runtime_options=None):
    """Apply MemoryPlan `plan` (caffeplus.memory.plan.make_plan or
    budget.plan_for_budget) to the built `net`; returns a dict with
    'applier', 'arena' (the array holding the planned buffers, None for
    stock/arena), 'arena_bytes', 'workspace_manager'. Any previous plan is
    removed first. `keep`, `training` and `make` (net -> plan) say how to
    plan again after a reshape; `lookahead`: offload prefetch distance in
    layers (int, or 'auto': measured; default 1 on the CPU, 'auto' on the GPU)."""
    check_plan_name(plan.name)
    remove_plan(net, keep_values=False)     # what the arena held is dead between passes
    if backend.mode() == backend.GPU:
        thread_stack.apply(plan.name)
        cublas_pool.apply(plan.name)
        cublas_pool.claim_first_handle(net, plan.name)
    masks.apply(net, plan.masked)           # the layers as the plan saw them
    if training is None:
        training = plan.steps == 2 * len(net.layers) if plan.steps else _training_default(net)
    if plan.name not in PLACING:
        manager = _apply_workspace(net, plan, workspace_limit)
        release_cached(backend.xp())    # e.g. the net's first workspace, now replaced
        return {'applier': 'caffeplus.memory.apply', 'plan': plan.name, 'arena': None,
                'arena_bytes': 0, 'workspace_manager': manager}
    if make is None:
        offloaded = sorted({n for key in plan.offloaded for n in key[1]})
        name = 'offload' if plan.offloaded else 'shared'
        if plan.offload_policy == 'free':
            offloaded, name = 'free', 'offload'

        def make(n, _keep=tuple(keep), _training=training, **overrides):
            kw = dict(offload_policy=offloaded or 'conv', param_diffs=plan.param_diffs)
            kw.update(overrides)
            return make_plan(n, name, keep=_keep, training=_training, **kw)
    if plan.offload_policy == 'free' and plan.offloaded:
        # An estimate's choice (modelled times): the runtime chooses from
        # measured ones, timing the plan without offload first.
        plan = make(net, offload_policy='free')
    if lookahead is None:
        lookahead = 'auto' if backend.mode() == backend.GPU else 1
    # The workspace first: on the GPU the reusing plans place it in their
    # arena (caffeplus.memory.workspace.PlacedWorkspace), beside the buffers.
    manager = _apply_workspace(net, plan, workspace_limit)
    options = {'keep': tuple(keep), 'training': training, 'make_plan': make,
               'lookahead': lookahead, 'runtime': dict(runtime_options or {}),
               'workspace': manager}
    applied = AppliedPlan(net, plan, options)
    net.applied_plan = applied
    release_cached(backend.xp())    # the arrays the arena replaced
    info = applied.info()
    info['workspace_manager'] = manager
    return info


def apply_named_plan(net, name, keep=(), offload_policy='conv', workspace_limit=None,
                     training=None, solver_type='SGD', budget=None, lookahead=None,
                     runtime_options=None, host_budget=None, param_diffs=False):
    """Plan `name` (stock, arena, shared, offload, auto) for `net` and apply
    it. `keep`: blob names that stay readable (with the net's own
    caffeplus_param.keep); `offload_policy`: conv, all or blob names;
    `budget`: bytes for auto (None: the fastest plan); `host_budget`: the
    most auto may offload to pinned host memory (None: default_host_budget);
    `training`: plan the backward too (default: TRAIN phase or
    force_backward); `param_diffs`: the net's solver updates in backward,
    so `shared`, `offload` and `auto` place the parameter gradients too."""
    check_plan_name(name)
    keep = check_keep(net, list(check_keep(net, keep)) + _net_keep(net))
    if training is None:
        training = _training_default(net)

    def make(n, **overrides):
        if name == 'auto':
            from caffeplus.memory import budget as budget_module, calibration
            if backend.mode() == backend.GPU and calibration.measuring():
                # The search weighs cuDNN's measured algorithms, not the model's.
                calibration.measure_net(n, limit=budget or None)
            # Applied here: the offloaded maps must fit this machine's memory.
            return budget_module.plan_for_budget(
                n, budget or None, solver_type, keep, training,
                host_budget=host_budget or budget_module.default_host_budget(),
                param_diffs=overrides.get('param_diffs', param_diffs))
        kw = dict(offload_policy=offload_policy, param_diffs=param_diffs)
        kw.update(overrides)
        masks.for_plan(n, name)
        return make_plan(n, name, solver_type=solver_type, keep=keep, training=training, **kw)

    plan = make(net)
    return apply_plan(net, plan, keep=keep, training=training, workspace_limit=workspace_limit,
                      lookahead=lookahead, make=make, runtime_options=runtime_options)
