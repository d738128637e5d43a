"""Measure a memory plan on the GPU: one training iteration, its real peak.

    from caffeplus.memory.measure import measure_plan
    result = measure_plan(net_param, plan, gpu=0)
    result['peak_bytes'], result['breakdown'], result['iter_ms']

What runs: the net of `net_param` (TRAIN, data layers already swapped for
DummyData by the caller) is built on the GPU inside a solver of
`solver_type`; the plan is applied; then training iterations (clear param
diffs, forward, backward, solver update): a plain first one (and, under
offload, the ones until its look-ahead is calibrated and the buffers placed
again), `iterations` timed ones (`iter_ms`: their mean), and last one
synchronised after every step to record the live-memory curve (outside the
peak: its per-layer hooks turn the fused kernel chains off).

What is measured:
  peak_bytes      the device's used memory (total - free, cudaMemGetInfo),
                  highest of the samples taken after every step and whenever
                  CuPy's pool grabs new device memory: the whole process as
                  nvidia-smi sees it (CUDA context, cuDNN/cuBLAS handles,
                  CuPy's pool with its cached blocks) - assumes no other
                  process uses the GPU
  pool_peak_bytes the most bytes live in CuPy's pool at any moment (a
                  MemoryHook sees every malloc and free)
  steady_peak_bytes, steady_pool_peak_bytes
                  the same over the timed iterations only, once the plan has
                  settled (offload 'free' times its first iterations without
                  offload, so its run's peak is shared's)
  startup_peak_bytes
                  the device's used memory from the solver's construction
                  through the first iterations: plan auto's algorithm
                  timing and planning, the arena's placement, the first
                  iteration's searches (the hooks' samples and a thread's,
                  caffeplus.memory.sampler.DeviceSampler, every 10 ms)
  process_peak_bytes
                  the whole run's peak, start-up included (peak_bytes is the
                  training iterations')
  breakdown       parameters, parameter_diffs, solver_history, activations,
                  activation_diffs: the device memory behind the net's and
                  the solver's arrays after the iteration (each allocation
                  counted once); workspace: what the plan applier reports;
                  other: peak_bytes minus all of those (context, handles,
                  layer-internal buffers, temporaries, pool caching)
  arena_bytes, arena_held_bytes, arena_bound_bytes
                  the placed arena's layout, the device bytes behind it (an
                  old arena may serve a smaller new layout), and the bytes
                  live at its busiest step
  live_curve      device bytes in use after each of the 2L steps and the
                  update (the device's used memory less what CuPy's pool
                  holds unused), in a stepped iteration run last

How a plan is applied: by `caffeplus.memory.apply.apply_plan(net, plan)`
when the GPU runtime provides it (it owns the offload copies); until then by
`apply_static` here, which handles what needs no runtime support: `stock`
and `arena` (caffeplus's default storage: one array per blob, allocated when
first touched) and plans without offloaded buffers (`shared`, an `auto` that
offloads nothing): every planned data and diff buffer becomes a view at its
offset in one device arena. The convolution workspace goes through
caffeplus.memory.workspace.apply_workspace_plan (stock: a buffer and 3 x
group cuDNN handles per layer; the other plans: one arena, capped for
`auto` at the cap its search chose).
"""
import gc
import time

from caffeplus import backend
from caffeplus.errors import CaffeplusError
from caffeplus.memory import liveness, thread_stack
from caffeplus.memory.plan import CATEGORIES, workspace_calls

FLOAT_BYTES = 4
# True: each plan's entry also lists the buffers its arena placed (as
# dev/arena_layout.py --json writes them), to place again without a GPU.
LIST_ARENA_LAYOUT = False
LAYOUT_FIELDS = ('name', 'kind', 'nbytes', 'start', 'end', 'offset')


def _cupy():
    try:
        import cupy
    except ImportError as exc:
        raise CaffeplusError('measuring memory on the GPU needs CuPy (%s); use --estimate '
                             'for numbers without a GPU' % exc)
    return cupy


def device_used_bytes():
    cupy = _cupy()
    free, total = cupy.cuda.runtime.memGetInfo()
    return int(total - free)


def device_total_bytes(gpu):
    """The memory of GPU `gpu` in bytes."""
    cupy = _cupy()
    try:
        with cupy.cuda.Device(gpu):
            return int(cupy.cuda.runtime.memGetInfo()[1])
    except Exception as exc:  # CUDA errors come in several types
        raise CaffeplusError('cannot use GPU %d: %s' % (gpu, exc))


def device_name(gpu):
    """GPU `gpu`'s model name (as nvidia-smi shows it)."""
    name = _cupy().cuda.runtime.getDeviceProperties(gpu)['name']
    return name.decode() if isinstance(name, bytes) else str(name)


def _sync():
    _cupy().cuda.Device().synchronize()


class PeakTracker:
    """A CuPy MemoryHook recording the pool's live bytes and peak, and the
    device's used memory whenever the pool grows (sampled, not hooked, for
    allocations outside CuPy)."""

    def __init__(self):
        cupy = _cupy()

        class _Hook(cupy.cuda.MemoryHook):
            name = 'CaffeplusPeakTracker'

            def malloc_postprocess(hook, **kw):
                # A block handed out again was freed unseen (hooks are per
                # thread): its old size is not live any more.
                self.live -= self._mine.get(kw['mem_ptr'], 0)
                self._mine[kw['mem_ptr']] = kw['mem_size']
                self.live += kw['mem_size']
                self.pool_peak = max(self.pool_peak, self.live)

            def free_postprocess(hook, **kw):
                # Only blocks taken while tracking: arrays of earlier work
                # freed meanwhile (a garbage collection) would drive the
                # count below zero.
                self.live -= self._mine.pop(kw['mem_ptr'], 0)

            def alloc_postprocess(hook, **kw):
                self.sample()

        self._hook = _Hook()
        self._mine = {}             # device pointer -> bytes, of blocks taken while tracking
        self.live = 0
        self.pool_peak = 0
        self.device_peak = 0

    def sample(self):
        used = device_used_bytes()
        self.device_peak = max(self.device_peak, used)
        return used

    def reset(self):
        self.pool_peak = self.live
        self.device_peak = 0
        self.sample()

    def __enter__(self):
        self._hook.__enter__()
        return self

    def __exit__(self, *exc):
        self._hook.__exit__(*exc)


# -- applying a plan -----------------------------------------------------------------
def _optional_module(name):
    import importlib
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return None


def _raw_blobs(net):
    """name -> Blob (not the host-mirroring wrappers net.blobs gives in GPU mode)."""
    return dict(zip(net._blob_names, net._blobs))


def apply_plan(net, plan):
    """Apply `plan` to a net built on the GPU; returns a dict with at least
    'applier' and, when known, 'workspace_bytes' and 'arena' (the device
    array holding the planned buffers)."""
    runtime = _optional_module('caffeplus.memory.apply')
    if runtime is not None and hasattr(runtime, 'apply_plan'):
        info = runtime.apply_plan(net, plan) or {}
        info = dict(info) if isinstance(info, dict) else {'handle': info}
        info.setdefault('applier', 'caffeplus.memory.apply')
        return info
    info = apply_static(net, plan)
    info['workspace_manager'] = apply_workspace(net, plan)
    return info


def apply_workspace(net, plan):
    """Give the net's cuDNN convolutions the plan's workspace through
    caffeplus.memory.workspace (when this build has it): `stock` one buffer
    per layer as Caffe 1.0, the others one arena, capped for `auto` at the
    cap the search chose. Returns the manager (None: stock, or no module)."""
    ws = _optional_module('caffeplus.memory.workspace')
    if ws is None or not hasattr(ws, 'apply_workspace_plan'):
        return None
    limit = 0
    if plan.name == 'auto':
        # 0 would mean "what the GPU spares"; a cap of 0 means no workspace.
        limit = max(int(getattr(plan, 'workspace_cap', 0)), 1)
    return ws.apply_workspace_plan(net, plan.name, limit)


def workspace_bytes(net):
    """Device bytes of the workspace managers the net and its layers hold."""
    seen, total = set(), 0
    for manager in [getattr(net, 'workspace', None)] + \
            [layer.workspace_manager() for layer in net.layers]:
        if manager is None or id(manager) in seen:
            continue
        seen.add(id(manager))
        total += int(getattr(manager, 'nbytes', 0) or 0)
    return total


def apply_static(net, plan, xp=None):
    """Place every planned buffer at its offset in one device arena (see the
    module docstring); stock and arena plans need nothing. `xp`: the array
    module of the arena (default CuPy; NumPy lets a test check a plan on the
    CPU: a wrong overlap changes the numbers)."""
    if plan.name in ('stock', 'arena'):
        return {'applier': 'static', 'arena': None}
    cupy = xp if xp is not None else _cupy()
    if plan.offloaded or getattr(plan, 'recomputed', None):
        raise CaffeplusError(
            "measuring plan '%s' needs the GPU runtime's plan applier "
            "(caffeplus.memory.apply.apply_plan), which copies offloaded feature maps to the "
            "host and back and makes released ones again; this build has none" % plan.name)
    params = {id(p.data_storage) for p in net.learnable_params} | \
        {id(p.diff_storage) for p in net.learnable_params}
    arena = cupy.zeros(max(plan.arena_bytes // FLOAT_BYTES + 1, 1), dtype='float32')
    blobs = _raw_blobs(net)
    for buf in plan.buffers:
        if not buf.blobs:
            continue        # workspace: the layers' own arena here
        offset = plan.offsets[buf.key] // FLOAT_BYTES
        count = buf.nbytes // FLOAT_BYTES
        view = arena[offset:offset + count]
        # (Two storages where diffs overlay: liveness.diff_overlays.)
        for storage, _ in liveness.buffer_storages(buf, blobs):
            if id(storage) in params:
                continue    # a Parameter layer's top: the parameter stays where it is
            old = storage.array
            if old is not None and old.size and buf.start <= 0:
                # Live from setup on (DummyData's tops, loss weights in diffs):
                # keep what setup wrote. Such buffers never share bytes.
                n = min(count, old.size)
                view[:n] = cupy.asarray(old[:n])
            storage.array = view
    return {'applier': 'static', 'arena': arena}


# -- running ----------------------------------------------------------------------------
def _solver(net_param, solver_type, iterations):
    from caffeplus.proto import caffe_pb2
    from caffeplus.solver import get_solver
    sp = caffe_pb2.SolverParameter()
    sp.net_param.CopyFrom(net_param)
    sp.type = solver_type
    sp.base_lr = 1.0 if solver_type == 'AdaDelta' else 1e-3
    sp.lr_policy = 'fixed'
    if solver_type in ('SGD', 'Nesterov', 'AdaDelta', 'Adam'):
        sp.momentum = 0.95 if solver_type == 'AdaDelta' else 0.9
    sp.weight_decay = 5e-4
    sp.max_iter = iterations + 2
    sp.display = 0
    sp.snapshot = 0
    sp.snapshot_after_train = False
    sp.random_seed = 1701
    # No plan of the solver's own: the caller applies the one it measures
    # (at VGG-16 batch 1536 a 'shared' arena alone would not fit the GPU).
    return get_solver(sp, memory_plans=False)


def run_iteration(net, solver, after_step=None):
    """One training iteration, step by step: forward of every layer, backward
    of every layer (the 2L steps of caffeplus.memory.liveness), the update.
    It runs through the net's passes, so that an applied plan's hooks run
    (caffeplus.memory.apply: offload copies, release marks); `after_step(t)`
    follows each step as a per-layer hook."""
    L = len(net.layers)
    start = getattr(solver, 'start_gradients', None)
    if start is not None:
        start()                     # or prepares the update in backward
    else:
        net.clear_param_diffs()
    hooks = []
    if after_step:
        def after_forward(i):
            after_step(i)

        def after_backward(i):
            after_step(2 * L - 1 - i)
        # At step boundaries, on whole buffers: the fused layer chains stay
        # fused (layers/fused_chain.py), as in a run without the hook.
        after_forward.chain_safe = after_backward.chain_safe = True
        hooks = [(net.after_layer_forward, after_forward),
                 (net.on_layer_backward_done, after_backward)]
        for where, hook in hooks:
            where.append(hook)
    try:
        net.forward_from_to(0, L - 1)
        net.backward_from_to(L - 1, 0)
        if hasattr(solver, 'end_backward'):
            solver.end_backward()
    finally:
        for where, hook in hooks:
            where.remove(hook)
    solver.apply_update()
    if after_step:
        after_step(2 * L)


def _mem_of(array):
    """(key, bytes) of the device allocation behind a CuPy array."""
    mem = array.data.mem
    return mem.ptr, mem.size


def measured_breakdown(net, solver, info, plan, peak_bytes):
    """Bytes per category of the arrays the net and solver hold (each device
    allocation counted once, in the first category that holds it)."""
    seen = set()
    out = dict.fromkeys(CATEGORIES, 0)
    arena = info.get('arena')
    arena_key = _mem_of(arena)[0] if arena is not None else None

    def add(category, arrays):
        for a in arrays:
            if a is None or not hasattr(a, 'data') or not hasattr(a.data, 'mem'):
                continue
            key, size = _mem_of(a)
            if key in seen:
                continue
            seen.add(key)
            if key == arena_key:
                # One arena for data, diff (and placed workspace) buffers:
                # split by their shares at the applied plan's busiest step.
                shares = info.get('arena_shares')
                if shares is None:
                    act, diff = plan.breakdown['activations'], plan.breakdown['activation_diffs']
                    shares = {'data': act / float(act + diff) if act + diff else 1.0}
                act = int(size * shares.get('data', 0))
                ws = int(size * shares.get('workspace', 0))
                grads = int(size * shares.get('param_diff', 0))   # applied in backward
                out['activations'] += act
                out['workspace'] += ws
                out['parameter_diffs'] += grads
                out['activation_diffs'] += size - act - ws - grads
            else:
                out[category] += size

    params = net.learnable_params
    add('parameters', [p.data_storage.array for p in params])
    add('parameter_diffs', [p.diff_storage.array for p in params])
    history = []
    for attr in ('history', 'update_buf', 'temp'):
        history += [b.data_storage.array for b in getattr(solver, attr, [])]
    add('solver_history', history)
    blobs = list(net._blobs)
    add('activations', [b.data_storage.array for b in blobs])
    add('activation_diffs', [b.diff_storage.array for b in blobs])
    if 'arena_shares' not in info:
        out['workspace'] = int(info['workspace_bytes']) if 'workspace_bytes' in info \
            else workspace_bytes(net)
    else:
        ws = getattr(net, 'workspace', None)
        own = getattr(ws, '_buffer', None)     # calls the layout missed: a buffer of their own
        out['workspace'] += own.nbytes if own is not None else 0
    out['other'] = max(0, int(peak_bytes) - sum(v for k, v in out.items() if k != 'other'))
    return out


MAX_SETTLING = 6


def plan_settled(net):
    """Whether the applied plan will keep its layout: no offload runtime, or
    one whose look-ahead is calibrated with no re-layout pending."""
    runtime = getattr(getattr(net, 'applied_plan', None), 'runtime', None)
    return runtime is None or (runtime.calibrated and not runtime.pending_lookahead and
                               runtime.pending_offload is None)


def settle(net, solver):
    """The iterations before the timed ones: a plain one (algorithm search,
    first-touch allocations), then, as offload calibrates its look-ahead on
    an early iteration and places the buffers again at the next, those until
    the plan has settled (at most MAX_SETTLING) and the new layout's first."""
    run_iteration(net, solver)
    settling = 0
    while not plan_settled(net) and settling < MAX_SETTLING:
        run_iteration(net, solver)
        settling += 1
    if settling:
        run_iteration(net, solver)


def settled_net(path, plan_name, offload_policy='free', max_iter=20):
    """(net, solver) of the TRAIN net at `path`, built as `caffeplus memory`
    builds it (SGD solver, the estimated plan applied) in the current mode,
    after settle(): what the probes in dev/ look at."""
    from caffeplus.memory import budget, shapes
    from caffeplus.proto import caffe_pb2
    param = shapes.load_net_param(path, phase=caffe_pb2.TRAIN)
    with shapes.quiet():
        solver = _solver(param, 'SGD', max_iter)
        net = solver.net
        apply_plan(net, budget.estimate_plan(shapes.build_net(param), plan_name,
                                             offload_policy=offload_policy))
        settle(net, solver)
    return net, solver


def measure_plan(net_param, plan, gpu, solver_type='SGD', iterations=1, apply=None):
    """Run one stepped iteration and then `iterations` timed ones of
    `net_param` on GPU `gpu` with `plan` applied; return the measurements
    (see the module docstring) in the shape of a plan's JSON entry, with
    'estimated': False; iter_ms is the mean of the timed iterations.
    `apply`: net -> info, planning on the GPU instead (plan auto weighs the
    algorithms it measures there: caffeplus.memory.calibration)."""
    from caffeplus.memory.shapes import quiet
    cupy = _cupy()
    if iterations < 1:
        raise CaffeplusError('iterations must be at least 1')
    previous_mode = backend.mode()
    backend.set_mode_gpu(gpu)
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    _sync()
    baseline = device_used_bytes()
    solver = net = info = None
    from caffeplus.memory.sampler import DeviceSampler
    sampler = DeviceSampler(gpu)
    try:
        with PeakTracker() as tracker, quiet(), sampler:
            solver = _solver(net_param, solver_type, iterations)
            net = solver.net
            if apply is not None:
                info = dict(apply(net))
                plan = net.applied_plan.plan
            else:
                info = apply_plan(net, plan)
            # Hold no reference to the arena: a re-layout (offload's
            # calibrated look-ahead) must be able to free the old one.
            info.pop('arena', None)
            _sync()
            pool.free_all_blocks()          # what construction left cached
            startup_peak = tracker.device_peak    # construction, algorithm timing, planning
            tracker.reset()
            curve = [0] * (2 * len(net.layers) + 1)

            def after_step(t):
                _sync()
                used = tracker.sample()
                curve[t] = used - (pool.total_bytes() - pool.used_bytes())

            # A plain iteration first (algorithm search, first-touch
            # allocations: a real run pays them too), then the timed ones;
            # the peak is theirs. The stepped iteration that records the
            # curve runs last and outside the peak (it synchronises at
            # every step).
            settle(net, solver)
            _sync()
            tracker.sample()
            warm_peak, warm_pool = tracker.device_peak, tracker.pool_peak
            sampler.set_phase('training')
            tracker.reset()
            t0 = time.perf_counter()
            for _ in range(iterations):
                run_iteration(net, solver)
            _sync()
            iter_ms = (time.perf_counter() - t0) * 1e3 / iterations
            tracker.sample()
            # The run's peak counts the first iterations (and offload 'free'
            # times them without offload); the steady one only the timed.
            steady_peak, steady_pool = tracker.device_peak, tracker.pool_peak
            peak, pool_peak = max(warm_peak, steady_peak), max(warm_pool, steady_pool)
            sampler.set_phase('curve')          # the stepped iteration: outside the peaks
            startup_peak = max(startup_peak, warm_peak, sampler.peak('startup'))
            process_peak = max(startup_peak, peak, sampler.peak('training'))
            run_iteration(net, solver, after_step)
            _sync()
            applied = getattr(net, 'applied_plan', None)
            if applied is not None and hasattr(applied, 'info'):
                info = dict(info, **applied.info())     # the arena in use now
            breakdown = measured_breakdown(net, solver, info, plan, peak)
            # Plan auto plans here, on measured algorithms (calibration):
            # its own estimate, not the CPU-side one, goes beside the run.
            ran = getattr(applied, 'plan', None)
            planned = {'peak_bytes': int(ran.peak_bytes), 'est_iter_ms': ran.est_iter_ms,
                       'recomputed': ran.recomputed_names(), 'masked': list(ran.masked)} \
                if ran is not None and ran.name == 'auto' else None
            result = {
                'planned': planned,
                'peak_bytes': int(peak),
                'breakdown': breakdown,
                'iter_ms': iter_ms,
                'estimated': False,
                'pool_peak_bytes': int(pool_peak),
                'steady_peak_bytes': int(steady_peak),
                'steady_pool_peak_bytes': int(steady_pool),
                # The whole process, start-up (construction, algorithm
                # timing, the first iterations) included.
                'startup_peak_bytes': int(startup_peak),
                'process_peak_bytes': int(process_peak),
                'baseline_bytes': int(baseline),
                'live_curve': curve,
                'applier': info.get('applier'),
                'device': gpu,
                'device_name': device_name(gpu),
                # As applied (offload 'free' chooses its maps at run time).
                'arena_bytes': int(info.get('arena_bytes') or 0),
                'arena_held_bytes': int(info.get('arena_held_bytes') or 0),
                'arena_bound_bytes': int(info.get('arena_bound_bytes') or 0),
                'offloaded': list(info.get('offloaded') or []),
                'offload_bandwidth': getattr(getattr(applied, 'runtime', None),
                                             'bandwidth', None),
                'thread_stack_bytes': thread_stack.current_bytes(),
                # The algorithms' workspace as the run placed it.
                'workspace_calls': dict(getattr(applied, 'workspace_calls', None) or
                                        (workspace_calls(ran) if ran is not None else {})),
            }
            if LIST_ARENA_LAYOUT and \
                    hasattr(applied, 'placed_rows'):
                # Every placed buffer, to place again on a machine without a GPU.
                result['arena_layout'] = [dict(zip(LAYOUT_FIELDS, row))
                                          for row in applied.placed_rows()]
            return result
    finally:
        del solver, net, info
        gc.collect()                    # layers hold cycles; free their arrays now
        pool.free_all_blocks()
        if previous_mode != backend.GPU:
            backend.set_mode_cpu()
