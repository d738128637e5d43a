"""A training iteration's passes launched as one CUDA graph.

On the GPU each kernel launch costs the host about 7 us and each layer's
Python more, so nets of many small layers (ResNet-50 at batch 64,
GoogLeNet) wait on the host: ResNet-50 b64 in FP16 takes 22.1 ms an
iteration eager and 13.0 ms replayed on an H200 (docs/precision.md). After WARMUP eager
iterations (cuDNN's timed search, buffers made on first use, the memory
plan settled) the solver captures, on a stream of its own, what follows the
data layers: the parameter gradients' zeroing, the forward with the loss
layers, and the backward. From then on an iteration runs its data layers,
then launches the graph: the same kernels with the same arguments in the
same order as eager (hence the same bits), for a few microseconds of host
time.

A graph keeps every pointer, shape and scalar the capture saw. It is
captured again when one that can change does: the data layers' tops (shape,
memory) and the memory plan's layout (after WARMUP eager iterations
again), the loss scale (once the new one came twice); an iteration after a
host view of a blob was handed out (pycaffe may have written it: the eager
pass copies it to the device) runs eagerly. What a replay cannot repeat
blocks graphs, and the net runs eagerly, with one log line saying why:
layers not known to be capturable (CAPTURABLE), per-layer hooks not marked
`graph_safe` (a gradient sync overlapped with backward), debug_info,
iter_size > 1, the offload runtime, the CPU. An update in backward is
captured with the pass, its learning rate and rule constants part of the
key (a rate that changes every iteration keeps the passes eager). A
capture that fails (a layer that reads a value back to the host) turns
graphs off for the net, with its reason, and the iteration runs eagerly.

Memory made during the capture comes from a pool of the graph's own, kept
while the graph lives: CuPy's pool could otherwise hand bytes the graph
uses to something else; so the graph also keeps the multi-array kernels'
device tables it reads (caffeplus.kernels.holding_tables), which their
cache may drop, and the scratch buffers layers share
(caffeplus.backend.device_scratch), which a larger ask replaces. A
capturable layer keeps the device buffers it reuses across iterations for
as long as their sizes stay (a replaced one would
leave the graph reading freed memory). cuBLAS runs on caffeplus's handle over a workspace
of the graph's (CuPy refuses its own cuBLAS calls during a capture), of
the size an eager call without workspace gets (caffeplus.backend.blas),
hence the same bits; cuDNN's per-call replays (caffeplus.cudnn.api) run
their calls directly into the capture.
"""
from caffeplus import backend, log
from caffeplus.deferred_loss import DeferredLoss

# Eager iterations before the capture.
WARMUP = 2
# Layer types whose forward and backward on the GPU launch the same kernels
# with the same arguments every iteration, never reading a value back
# (Dropout's masks come from a generator whose state is on the device).
CAPTURABLE = frozenset((
    'Convolution', 'Deconvolution', 'InnerProduct', 'Pooling', 'LRN', 'BatchNorm', 'Scale',
    'Bias', 'ReLU', 'Sigmoid', 'TanH', 'Eltwise', 'Concat', 'Split', 'Flatten', 'Reshape',
    'Softmax', 'SoftmaxWithLoss', 'Silence', 'Dropout'))
HOOK_LISTS = ('before_layer_forward', 'after_layer_forward', 'before_layer_backward',
              'on_layer_backward_done')


def enabled(solver_param=None):
    """The cuda_graphs setting (caffeplus.config)."""
    from caffeplus import config
    return config.get('cuda_graphs', solver=solver_param)


def first_compute_layer(net):
    """The index of the first layer after the leading layers without bottoms
    (the data layers, run eagerly each iteration)."""
    i = 0
    while i < len(net.layers) and not net.bottom_vecs[i]:
        i += 1
    return i


def layer_blockers(net, first):
    """Why the layers from `first` on cannot be captured (empty: they can)."""
    types = sorted({net.layers[i].type for i in range(first, len(net.layers))} - CAPTURABLE)
    if types:
        return ['layer types not known to be capturable: %s' % ', '.join(types)]
    if first >= len(net.layers):
        return ['no layer after the data layers']
    return []


def hook_blockers(net):
    """The per-layer hooks a replay would not run (their functions' names)."""
    names = []
    for kind in HOOK_LISTS:
        for hook in getattr(net, kind):
            if not getattr(hook, 'graph_safe', False):
                names.append('%s (%s)' % (getattr(hook, '__qualname__', repr(hook)), kind))
    return ['per-layer hooks a replay would skip: %s' % ', '.join(names)] if names else []


def renewed(term, event):
    """A deferred loss term of the capture, made to read the replay that
    `event` follows: a report kept in host memory (the fused loss layer's)
    is renewed; a callable reading device values reads them again, and a
    number stays as it is."""
    owner = getattr(term, '__self__', None)
    renew = getattr(owner, 'renewed', None)
    if renew is not None:
        return getattr(renew(event), term.__name__)
    return term


class PassGraph:
    """The graph of one training net's passes; run() is one iteration's
    forward and backward (with the gradients' zeroing), eager or replayed."""

    def __init__(self, net, name='train net'):
        self.net = net
        self.name = name
        self.first = first_compute_layer(net)
        self.static_blockers = layer_blockers(net, self.first)
        self.off = None             # a reason graphs stay off for this net
        self.eager_runs = 0
        self.graph = None
        self.key = None
        self._structure = self._previous = None
        self.captures = 0
        self.replays = 0
        self._said = None
        self._pool = self._gemm_workspace = self._stream = None
        self._terms = ()
        self._tables = ()           # the kernels' device tables the graph reads
        self._arrays = ()
        self._scratch = ()
        self._host_views = None
        self._reports = []

    # -- whether this iteration is replayed ---------------------------------------------
    def blockers(self, solver=None):
        """Why this iteration cannot use the graph (empty: it can)."""
        if backend.mode() != backend.GPU:
            return ['the CPU backend']
        if self.off:
            return [self.off]
        why = list(self.static_blockers)
        net = self.net
        if net.debug_info or (solver is not None and solver.param.debug_info):
            why.append('debug_info')
        if solver is not None and solver.param.iter_size != 1:
            why.append('iter_size %d' % solver.param.iter_size)
        plan = net.applied_plan
        if plan is not None and plan.runtime is not None:
            why.append('the offload runtime')
        return why + hook_blockers(net)

    def usable(self, solver=None):
        """Whether run() will try the graph this iteration (logs why not, once
        for each new reason)."""
        why = self.blockers(solver)
        if why:
            said = '; '.join(why)
            if said != self._said and backend.mode() == backend.GPU:
                log.info('CUDA graphs: the %s runs eagerly: %s', self.name, said)
            self._said = said
            self.graph = None
            return False
        self._said = None
        return True

    # -- one iteration ------------------------------------------------------------------
    def run(self, data=True, clear=True, extra=None):
        """One iteration: the data layers (unless `data` is False: their tops
        hold this iteration's batch already), the parameter gradients zeroed
        (unless `clear` is False: an update in backward zeroes its own), the
        rest of the net forward and the whole net backward; replayed when the
        graph fits, else eagerly (capturing once WARMUP eager runs in a row
        saw the same key). `extra`: values the per-layer hooks read from the
        host this iteration (an update in backward's learning rate), part of
        the key. Returns the loss, a caffeplus.deferred_loss.DeferredLoss."""
        from caffeplus import blob
        net = self.net
        if data and self.first:
            net.forward_from_to(0, self.first - 1, defer_loss=True)
        structure = self._structure_key()
        key = (structure, self._scale(), clear, extra)
        if structure != self._structure:    # new memory: the eager runs settle it first
            self._structure, self.eager_runs, self.graph = structure, 0, None
        if self.graph is not None and key != self.key:
            self.graph = None
        # A capture pays off only for a key that comes again: one that changes
        # every iteration (Adam's bias correction) keeps the passes eager.
        repeated, self._previous = key == self._previous, key
        views = blob.host_views()
        fresh_views, self._host_views = views != self._host_views, views
        if self.graph is not None and not fresh_views:
            loss = self._replay()
            if loss is not None:
                return loss
        elif self.graph is None and self.eager_runs >= WARMUP and repeated and \
                not fresh_views:
            loss = self._capture(clear)
            if loss is not None:
                self.key = key
                return loss
        self.eager_runs += 1
        return self._eager(clear)

    def _eager(self, clear):
        net = self.net
        if clear:
            net.clear_param_diffs()
        loss = net.forward_from_to(self.first, len(net.layers) - 1, defer_loss=True)
        net.backward_from_to(len(net.layers) - 1, 0)
        return loss

    def _structure_key(self):
        """The memory the graph's pointers lead to: the data tops' shapes and
        addresses, the memory plan's layout. Reading each data top's device
        array also sends a newer host copy (a data layer that filled it on
        the host) there."""
        net = self.net
        tops = []
        for ids in net.top_id_vecs[:self.first]:
            for i in ids:
                b = net._blobs[i]
                tops.append((tuple(b._shape), b.data.data.ptr))
        plan = net.applied_plan
        return tuple(tops), id(getattr(plan, 'layout', None)) if plan is not None else None

    def _scale(self):
        """The loss scale the loss layers' backward multiplies by."""
        return getattr(getattr(self.net, 'precision', None), 'scale', None)

    # -- capture and replay -------------------------------------------------------------
    def _capture(self, clear):
        """Capture this iteration's passes, then launch them; None (graphs
        off for the net, with a log line) if they cannot be captured: the
        caller runs the iteration eagerly."""
        import cupy
        from caffeplus import kernels
        from caffeplus.backend import blas
        from caffeplus.cudnn import api
        net = self.net
        cupy.cuda.get_current_stream().synchronize()
        if self._stream is None:
            self._stream = cupy.cuda.Stream(non_blocking=True)
            self._pool = cupy.cuda.MemoryPool()
            self._gemm_workspace = cupy.empty(blas.FALLBACK_BYTES, cupy.uint8)
            blas.own_handle()
        self.graph, self._terms = None, ()
        stream, graph, loss, failed = self._stream, None, None, []
        replays = api.set_graphs(False)     # cuDNN's calls go into this capture
        try:
            with cupy.cuda.using_allocator(self._pool.malloc), stream, \
                    blas.capture_workspace((self._gemm_workspace.data.ptr,
                                            self._gemm_workspace.nbytes)), \
                    kernels.holding_tables() as tables:
                stream.begin_capture()
                try:
                    loss = self._eager(clear)
                except Exception as exc:    # (ending the capture then fails too)
                    failed.append(exc)
                    raise
                finally:
                    graph = stream.end_capture()
        except Exception as exc:    # noqa: BLE001 -- any failure: eager from now on, said why
            first = failed[0] if failed else exc
            self.off = 'capture failed: %s: %s' % (
                type(first).__name__, (str(first).splitlines() or [''])[0])
            log.info('CUDA graphs: the %s runs eagerly: %s', self.name, self.off)
            self._said = self.off
            return None
        finally:
            api.set_graphs(replays)
        plan = net.applied_plan
        self._arrays = tuple((e.storage, e.storage.array) for e in plan.entries) \
            if plan is not None else ()
        self.graph, self._terms, self._tables = graph, tuple(loss.terms), tables
        # The scratch layers share (backend.device_scratch) as the capture
        # read it: another net's larger ask replaces a buffer, and the graph
        # must not read freed memory.
        self._scratch = backend.scratch_buffers()
        self.captures += 1
        log.info('CUDA graphs: captured the %s from layer %s on (%d layers)', self.name,
                 net._layer_names[self.first], len(net.layers) - self.first)
        return self._launch()

    def _replay(self):
        """The passes' bookkeeping as eager passes do it (the memory plan's
        marks), the graph launched, and the storages' arrays set as the
        capture's pass left them; None if the plan placed its buffers again
        (the caller runs the iteration eagerly; the next captures anew)."""
        net = self.net
        plan = net.applied_plan
        last = len(net.layers) - 1
        if plan is not None:
            layout = getattr(plan, 'layout', None)
            plan.before_forward(self.first, last)
            if getattr(plan, 'layout', None) is not layout:
                self.graph = self._structure = None
                return None
            plan.after_forward(self.first, last)
            plan.before_backward(last, 0)
            plan.after_backward(last, 0)
        for storage, array in self._arrays:
            storage.array = array
        self.replays += 1
        return self._launch()

    def _launch(self):
        import cupy
        for report in self._reports:        # the pinned buffers are written again
            report.read()
        stream = cupy.cuda.get_current_stream()
        self.graph.launch(stream)
        done = cupy.cuda.Event(disable_timing=True)
        done.record(stream)
        loss = DeferredLoss()
        self._reports = []
        for term in self._terms:
            fresh = renewed(term, done)
            if fresh is not term:
                self._reports.append(fresh.__self__)
            loss.add(fresh)
        return loss
