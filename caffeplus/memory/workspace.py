"""cuDNN workspace: one arena per net (plan `arena`) or one buffer per layer
(plan `stock`, as BVLC Caffe 1.0).

Call sites. A cuDNN convolution layer has three call sites per bottom
geometry: 'fwd', 'bwd_data' and 'bwd_filter'. At reshape the layer lists,
for each site, its candidate algorithms with the workspace each needs
(caffeplus.cudnn.api.AlgoChoice: cuDNN's _v7 heuristics, best first, or
timed with cudnnFind*AlgorithmEx in the arena when `set_search('timed')`)
and registers them with its workspace manager.

Arena (the default). The arena picks, for every call site, the first
(fastest) candidate whose workspace fits the budget, and sizes its one
device buffer to the largest choice. Only one cuDNN call runs at a time, so
the buffer is shared by every site of every layer of the net: a layer checks
out the buffer for one call (`with arena.checkout(layer, kind) as (ptr,
nbytes)`) and gives it back. The budget is `limit` bytes when given (the
solver's caffeplus_param.workspace_limit, --workspace_limit), else what the
GPU can spare after the net's other memory (blobs not yet allocated, with a
margin), lowered where timed candidates show the extra workspace buys less
than KNEE_TOLERANCE (7%) of the convolutions' time (knee_budget). A reshape
that changes a layer's candidates marks the arena for a re-plan before the
next checkout.

Placed (the reusing plans: shared, offload, auto). The algorithms are
chosen as the arena chooses them, then the memory plan places each layer's
forward, backward-data and backward-filter workspace in its own arena, live
at that call's step only (PlacedWorkspace); under `offload` and `auto`,
where the fastest algorithm would raise the plan's peak, a timed one that
fits the bytes left free there and is at most 10% slower is used (`shared`
keeps every call's fastest: headroom_slowdown).

Stock. Each convolution layer owns its workspace, sized exactly as Caffe
1.0's CuDNNConvolutionLayer::Reshape sizes it: per kind, the first _v7
heuristic result whose workspace is <= 8 MiB; the layer allocates
max(fwd, bwd_data, bwd_filter) * group * CUDNN_STREAMS_PER_GROUP (3) bytes,
growing only. Under deterministic math every plan takes the first
deterministic algorithm within its limit, and where none fits, the
deterministic one needing least (over_budget), so stock and the arena run
the same algorithms. The layer also creates 3 * group cuDNN handles and CUDA
streams, as Caffe does, so that the process's other memory matches stock.
"""
import contextlib
import weakref

from caffeplus import backend, log
from caffeplus.errors import CaffeplusError
from caffeplus.memory.call_sites import VIEW_NAMES, forward_kinds, view_part  # noqa: F401
from caffeplus.memory.oom import (is_out_of_memory, out_of_memory_error,  # noqa: F401
                                 requested_bytes)

STOCK_WORKSPACE_LIMIT = 8 * 1024 * 1024     # Caffe 1.0's workspace_limit_bytes
CUDNN_STREAMS_PER_GROUP = 3
# What the arena leaves free when it sizes itself from the device's free
# memory: a fixed reserve plus a share of the device (CUDA context growth,
# cuBLAS workspaces, CuPy pool fragmentation).
MARGIN_BYTES = 512 * 1024 * 1024
MARGIN_FRACTION = 0.05
# Without a user's limit the arena stops growing where more workspace
# would buy less than this share of the convolutions' time (knee_budget).
# Measured on VGG-16 b64 (FP32, H100): 3,529 MiB for the fastest, 891 MiB
# within 2.5%, 477 MiB within 6.9%, 230 MiB within 26%; at 7% the `arena`
# plan peaks 4% under `stock` (at 3% it ties: 891 MiB is about what stock
# Caffe's per-layer handles and buffers take beside the same blobs).
KNEE_TOLERANCE = 0.07
# A timed search's scratch and candidates stay within the bytes the placed
# maps will hold (search_limit); False lets a candidate take any size.
SEARCH_WITHIN_ROOM = True
# A site whose own scratch takes most of that room (a small net's first
# convolution: torchvision's AlexNet's conv1 at b128 in FP16, 96 MiB of
# copies against a room of 71) would time only algorithms that need no
# workspace and keep one for the whole run: its backward data took 184 ms
# a call, and that time let the trades (trade_time_share) move the other
# convolutions to slow algorithms too; the iteration took 18.2 ms, 6.0 with
# this floor (dev/search_room_probe.py, H200). Such a site may take this
# share of the room beside its scratch. Plan auto under a budget times
# within what the budget leaves (caffeplus.memory.calibration): 0 there.
SEARCH_ROOM_FLOOR = 0.5
KINDS = ('fwd', 'bwd_data', 'bwd_filter')
WORKSPACE_PLANS = ('stock', 'arena')

_search = {'mode': 'heuristic'}


def set_search(mode):
    """'heuristic' (cuDNN's _v7 ranking, the default) or 'timed' (FindEx)."""
    if mode not in ('heuristic', 'timed'):
        raise CaffeplusError("algorithm search must be 'heuristic' or 'timed', not '%s'" % mode)
    previous = _search['mode']
    _search['mode'] = mode
    return previous


def search_mode():
    return _search['mode']


# =============================================================================
# Choosing algorithms (pure: testable without a GPU)
# =============================================================================
class Site:
    """One call site: (layer, kind, index). `candidates` best first; `choice`
    set by the workspace manager's plan."""
    __slots__ = ('kind', 'index', 'candidates', 'choice', 'timer')

    def __init__(self, kind, candidates, index=0, timer=None):
        self.kind, self.index = kind, index
        self.candidates = list(candidates)
        self.choice = None
        self.timer = timer          # callable(ws_ptr, ws_bytes) -> timed candidates

    def __repr__(self):
        return '<Site %s[%d] %s>' % (self.kind, self.index, self.choice)


def call_site_name(layer, kind):
    """How errors and warnings name a convolution's call site: 'layer conv1
    bwd_filter' (one spelling, so that over_budget says each site once
    whichever path chose for it)."""
    return 'layer %s %s' % (getattr(getattr(layer, 'layer_param', None), 'name', '?'), kind)


def choose(candidates, budget, deterministic=False, what='call site'):
    """The first (fastest) candidate whose workspace is <= budget (and, with
    `deterministic`, that cuDNN reports deterministic). None fitting: under
    deterministic math the deterministic one needing least (over_budget);
    otherwise a CaffeplusError naming the site and the bytes."""
    pool = [c for c in candidates if not deterministic or c.deterministic]
    if not pool:
        raise CaffeplusError('%s: cuDNN offers no deterministic algorithm (math mode '
                             "'deterministic'); candidates: %s" % (what, candidates))
    for c in pool:
        if c.memory <= budget:
            return c
    smallest = min(pool, key=lambda c: c.memory)
    if deterministic:
        return over_budget(smallest, budget, what)
    raise CaffeplusError('%s: every cuDNN algorithm needs more workspace than the budget of '
                         '%d bytes (the smallest, %s, needs %d); raise the workspace limit '
                         '(--workspace_limit / caffeplus_param.workspace_limit)'
                         % (what, budget, getattr(smallest, 'name', smallest), smallest.memory))


_over_budget_said = set()


def over_budget(choice, budget, what):
    """Deterministic math outranks the workspace limit, under every plan:
    where no deterministic algorithm fits (GoogLeNet's and ResNet-50's
    filter gradients need 13-16 MB against Caffe's 8 MiB), the call takes
    the deterministic one needing least, as stock Caffe's fallback runs the
    least-workspace algorithm whatever the limit. Said once per call site."""
    key = (what, budget, choice.memory)
    if key not in _over_budget_said:
        _over_budget_said.add(key)
        log.warning('%s: no deterministic cuDNN algorithm fits the workspace limit of %d bytes; '
                    'using %s, which needs %d (math mode deterministic)',
                    what, budget, getattr(choice, 'name', choice), choice.memory)
    return choice


def choose_stock(candidates, limit=STOCK_WORKSPACE_LIMIT, deterministic=None,
                 what='call site'):
    """Caffe 1.0: the first heuristic result whose workspace is <= 8 MiB; if
    none fits, the one needing least (Caffe's zero-workspace fallback). In
    the 'deterministic' math mode the arena's rule (choose): only
    deterministic algorithms count, so the plans run the same algorithms."""
    if deterministic is None:
        from caffeplus.backend import mathmode
        deterministic = mathmode.deterministic()
    if not candidates:
        return None
    if deterministic:
        return choose(candidates, limit, True, what)
    for c in candidates:
        if c.memory <= limit:
            return c
    return min(candidates, key=lambda c: c.memory)


def stock_bytes(choices, group):
    """Caffe 1.0's per-layer allocation: max(fwd, bwd_data, bwd_filter)
    * group * CUDNN_STREAMS_PER_GROUP."""
    biggest = max([c.memory for c in choices if c is not None] + [0])
    return biggest * group * CUDNN_STREAMS_PER_GROUP


def _timed_pool(site, deterministic):
    pool = [c for c in site.candidates if not deterministic or c.deterministic]
    if not pool or any(c.time is None or c.time <= 0 for c in pool):
        return None
    return pool


def knee_budget(sites, budget, deterministic=False, tolerance=None):
    """The least workspace at which the sites' summed time (each site's
    fastest candidate within it) stays within `tolerance` of their time
    within `budget`. Extra workspace past that point buys almost no speed
    (on VGG-16, 3.7 GB instead of 0.9 GB for 2%), and the arena's buffer
    is memory every other buffer of the net competes with. Only timed
    candidates carry times: with any site untimed (cuDNN's heuristics)
    the budget stands."""
    if tolerance is None:
        tolerance = knee_tolerance()
    pools = [_timed_pool(s, deterministic) for s in sites]
    if tolerance < 0 or not pools or any(p is None for p in pools):
        return budget
    knee = least_within([[(c.memory, c.time) for c in p] for p in pools], tolerance, budget)
    return budget if knee is None else knee


def least_within(sites, tolerance, limit=None):
    """The least workspace level at which `sites` (per site, its candidates
    as (bytes, time) pairs) take, each at its fastest candidate within the
    level, at most (1 + tolerance) times their summed time within `limit`
    (None: no limit). None when there is no such level. Shared by the
    arena's knee (knee_budget) and the estimate's (workspace_model.knee_cap)."""
    def total(level):
        times = [min((t for b, t in site if level is None or b <= level), default=None)
                 for site in sites]
        return None if None in times else sum(times)

    best = total(limit)
    if not sites or best is None:
        return None
    for level in sorted({b for site in sites for b, _ in site if limit is None or b <= limit}):
        t = total(level)
        if t is not None and t <= best * (1.0 + tolerance):
            return level
    return None


def knee_tolerance():
    """KNEE_TOLERANCE (a fraction; a negative one turns the knee off: the
    fastest that fits, whatever it takes)."""
    return KNEE_TOLERANCE


def plan_sites(sites, budget, deterministic=False, names=None):
    """Choose for every site; returns the buffer size (the largest choice)."""
    size = 0
    for i, s in enumerate(sites):
        what = names[i] if names else '%s site' % s.kind
        s.choice = choose(s.candidates, budget, deterministic, what)
        size = max(size, s.choice.memory)
    return size


# =============================================================================
# Device helpers
# =============================================================================
def _cupy():
    import cupy
    return cupy


class _Buffer:
    """A device byte buffer that grows or shrinks to an exact size."""

    def __init__(self):
        self.array = None

    @property
    def nbytes(self):
        return 0 if self.array is None else int(self.array.nbytes)

    def resize(self, nbytes, owner, plan):
        nbytes = int(nbytes)
        if nbytes == self.nbytes:
            return
        cupy = _cupy()
        self.array = None           # give the old one back first
        if nbytes == 0:
            return
        try:
            self.array = cupy.empty(nbytes, dtype=cupy.uint8)
        except Exception as exc:
            if is_out_of_memory(exc):
                raise out_of_memory_error(owner, 'workspace allocation', exc, plan, nbytes) from exc
            raise

    @property
    def ptr(self):
        return 0 if self.array is None else int(self.array.data.ptr)


# =============================================================================
# The arena
# =============================================================================
class _Lease:
    """What checkout returns: `with` it yields the call's (pointer, bytes)
    and keeps the manager busy until the call is done. (A class: a
    generator's context manager costs several calls more each time.)"""
    __slots__ = ('manager', 'view', 'who')

    def __init__(self, manager, view, who):
        self.manager, self.view, self.who = manager, view, who

    def __enter__(self):
        self.manager._busy = self.who
        return self.view

    def __exit__(self, *exc):
        self.manager._busy = None
        return False


# A call that needs no workspace and has no view: the manager's own buffer,
# whatever it holds then.
_WHOLE_BUFFER = object()


class WorkspaceArena:
    """One device buffer for every cuDNN call site of a net."""
    plan_name = 'arena'
    checkout_name = 'workspace arena'       # (in errors)

    def __init__(self, limit=0, net=None, name='arena'):
        self.limit = int(limit or 0)
        self._net = weakref.ref(net) if net is not None else None
        self.name = name
        self._layers = {}           # id(layer) -> (weakref(layer), [Site])
        self._buffer = _Buffer()
        self._dirty = False
        self._busy = None
        self.budget = None          # the budget of the last plan
        self.replans = 0

    # -- registration --------------------------------------------------------
    def register(self, layer, sites):
        self._layers[id(layer)] = (weakref.ref(layer), list(sites))
        self._dirty = True

    def unregister(self, layer):
        if self._layers.pop(id(layer), None) is not None:
            self._dirty = True

    def sites(self):
        out = []
        for key, (ref, sites) in list(self._layers.items()):
            layer = ref()
            if layer is None:
                del self._layers[key]
                continue
            out.extend((layer, s) for s in sites)
        return out

    # -- planning ------------------------------------------------------------
    def spare_bytes(self):
        """What the GPU can spare for workspace: free device memory plus
        CuPy's cached free blocks plus this arena's own buffer, less the
        net's blobs not allocated yet and a margin."""
        cupy = _cupy()
        free, total = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        spare = free + pool.free_bytes() + self._buffer.nbytes
        net = self._net() if self._net is not None else None
        if net is not None:
            spare -= pending_blob_bytes(net)
        spare -= MARGIN_BYTES + int(MARGIN_FRACTION * total)
        return max(int(spare), 0)

    def plan(self):
        """Choose every site's algorithm and size the buffer to the largest."""
        budget, pairs, size = self._choose()
        owner = pairs[0][0] if pairs else self
        self._buffer.resize(size, owner, self.plan_name)
        log.info('Workspace arena: %d call sites, budget %d bytes, buffer %d bytes',
                 len(pairs), budget, size)
        return size

    def _choose(self):
        """Every site's algorithm within the budget (timed first where the
        search asks for it): (budget, [(layer, site)], the largest choice)."""
        from caffeplus.backend import mathmode
        budget = self.limit if self.limit > 0 else self.spare_bytes()
        pairs = self.sites()
        if self._timing_wanted(pairs):
            self._time_sites(pairs, budget)
        names = [call_site_name(layer, s.kind) for layer, s in pairs]
        sites = [s for _, s in pairs]
        if self.limit <= 0:         # the user set no limit: stop at the knee
            budget = knee_budget(sites, budget, mathmode.deterministic())
        size = plan_sites(sites, budget, mathmode.deterministic(), names)
        self.budget = budget
        self._dirty = False
        self.replans += 1
        return budget, pairs, size

    def _timing_wanted(self, pairs):
        """set_search('timed'); the auto search times through the layers
        (_CudnnConvolutionMixin._ensure_planned)."""
        return search_mode() == 'timed'

    def _time_sites(self, pairs, budget):
        """FindEx every site that can be timed, one site at a time: the
        buffer sized to what that site's largest candidate needs within the
        budget and the site's search room (search_limit), and its scratch
        given back to the device before the next site, so the search holds
        one site's workspace and scratch at once, not the largest workspace
        of the net beside every site's scratch. (What bounds VGG-16 b64's
        search, 7.7 GB against 4.4 GB an iteration, is the room:
        PlacedWorkspace.search_limit.)"""
        from caffeplus.memory import calibration
        pool = _cupy().get_default_memory_pool()
        for layer, s in pairs:
            if s.timer is None:
                continue
            # (The limit itself where it cuts the site's candidates: the
            # sliced and per-group variants timed beside them need less.)
            needs = [c.memory for c in s.candidates] + [getattr(s.timer, 'variant_bytes', 0)]
            want = min(max([0] + [n for n in needs if n <= budget]), self.search_limit(s))
            if want != self._buffer.nbytes:
                # The old buffer back to the device before the new one is
                # taken: CuPy's pool would keep it cached beside a larger one.
                self._buffer.resize(0, layer, self.plan_name)
                pool.free_all_blocks()
            self._buffer.resize(want, layer, self.plan_name)
            timed = s.timer(self._buffer.ptr, self._buffer.nbytes)
            pool.free_all_blocks()              # the site's scratch
            if timed:
                s.candidates = timed
                s.timer = None          # timed once per geometry
                # For plan auto's search in this process (and a saved table).
                if hasattr(layer, 'geom'):
                    calibration.record(layer, s.kind, timed)

    def search_limit(self, site):
        """The most workspace a timed search may give `site`'s candidates
        (the arena: no bound but the budget)."""
        return float('inf')

    def search_pending(self):
        """Whether a site still waits for its timed search."""
        return any(s.timer is not None for _, s in self.sites())

    def ensure_planned(self):
        if self._dirty:
            self.plan()

    @property
    def nbytes(self):
        return self._buffer.nbytes

    def workspace_bytes(self):
        return self._buffer.nbytes

    def checkout(self, layer=None, kind=None):
        """The buffer for one cuDNN call: `with arena.checkout(layer, kind)
        as (device pointer, bytes)`."""
        self.ensure_planned()
        self._check_free(layer, kind)
        return _Lease(self, (self._buffer.ptr, self._buffer.nbytes), (layer, kind))

    def _check_free(self, layer, kind):
        if self._busy is not None:
            raise CaffeplusError('%s checked out twice (by %s, then %s %s)'
                                 % (self.checkout_name, self._busy, layer, kind))

    def release(self):
        self._buffer.resize(0, self, self.plan_name)
        self._dirty = True


class PlacedWorkspace(WorkspaceArena):
    """The workspace of the reusing plans (shared, offload, auto): the
    algorithms are chosen as the arena chooses them, but each layer's
    forward call and backward calls get a view of the plan's own arena,
    live at that layer's step only (caffeplus.memory.liveness
    .workspace_buffers), so workspace takes bytes that activations leave
    dead then instead of a buffer of its own beside the peak. The applied
    plan (caffeplus.memory.apply) places the views and tells this manager
    which pass runs; a call the layout does not cover (a reshape chose
    bigger algorithms mid-pass) gets a private buffer until the plan is
    placed again before the next pass."""
    plan_name = 'shared'
    checkout_name = 'workspace'

    def __init__(self, limit=0, net=None, name='placed workspace'):
        super().__init__(limit, net, name)
        self.views = {}             # (id(layer), VIEW_NAMES[part]) -> (ptr, bytes)
        # (id(layer), pass) -> bytes the plan's buffers leave free at that
        # step below their peak (set by the applied plan before it plans).
        self.headroom = {}
        self.pass_kind = 'forward'
        # How much slower an algorithm that fits the headroom may be than the
        # fastest (within_headroom); plan 'auto' under a budget: any.
        self.headroom_slowdown = headroom_slowdown(self.plan_name)
        # And how much of the net's convolution time all such trades may
        # add beyond that (trade_time_share).
        self.trade_share = trade_time_share(self.plan_name)
        self.layout_stale = True    # the choices changed since the views were placed
        # (id(layer), kind, again) -> the call's (ptr, bytes) view in the
        # layout, or _WHOLE_BUFFER; forgotten when the choices or views change.
        self._resolved = {}
        self.outside = {}           # (layer name, kind) -> bytes of calls the layout missed
        # A convolution's forward run again in backward (caffeplus.memory
        # .recompute): the name of its view, placed at that step ('again@t').
        self.again = None
        # Bytes the plan's feature maps take placed (set by the applied plan
        # before it places the workspace): the timed search's bound.
        self.search_room = None
        self.search_floor = SEARCH_ROOM_FLOOR

    def _timing_wanted(self, pairs):
        # Planned from the applied plan, not from a layer's first call: the
        # layers' auto search (timed under a net's own workspace) asks here.
        return search_mode() == 'timed' or any(l.auto_timed_search() for l, _ in pairs)

    def _time_sites(self, pairs, budget):
        previous = set_search('timed')
        try:
            super()._time_sites(pairs, budget)
        finally:
            set_search(previous)
        # The GEMM candidates' cuBLAS workspace, should no chosen one need it.
        from caffeplus.backend import blas
        blas.release_fallback()
        self._buffer.resize(0, self, self.plan_name)
        _cupy().get_default_memory_pool().free_all_blocks()   # timing's scratch
        # The candidates raised the per-thread stack past what the chosen
        # kernels need (caffeplus.memory.thread_stack.settle).
        from caffeplus.memory import thread_stack
        thread_stack.settle(self.plan_name)

    def search_limit(self, site):
        """The search runs before the plan's arena is taken (AppliedPlan
        ._build), so it may use the bytes the placed feature maps will hold
        anyway (search_room): a site's scratch and candidate workspace
        together at most that. A candidate past it would take more than the
        maps' arena just to be timed; the ones chosen fit far within it
        (VGG-16 b64: 3.4 GB candidates for conv1_2, none chosen above 477 MB).
        A site whose scratch leaves less than search_floor of the room gets
        that share (SEARCH_ROOM_FLOOR)."""
        room = self.search_room
        if room is None or not SEARCH_WITHIN_ROOM:
            return float('inf')
        return max(room - getattr(site.timer, 'scratch_bytes', 0),
                   int(room * self.search_floor), 0)

    def plan(self):
        """Choose as the arena does; then, where the fastest choice's
        workspace exceeds what the plan leaves free at its step, a nearly
        as fast one that fits (within_headroom). The views are placed by
        the applied plan afterwards (layout_stale)."""
        from caffeplus.backend import mathmode
        budget, pairs, size = self._choose()
        calls = [(i, s.candidates, s.choice,
                  self.headroom.get((id(layer), VIEW_NAMES[view_part(layer, s.kind)])))
                 for i, (layer, s) in enumerate(pairs)]
        picks = trade_for_room(calls, self.trade_share, mathmode.deterministic(),
                               self.headroom_slowdown)
        for i, (_, s) in enumerate(pairs):
            s.choice = picks[i]
        self._resolved = {}         # new choices: every call's need again
        self.layout_stale = True
        log.info('Workspace placed in the memory plan: %d call sites, budget %d bytes, '
                 'largest call %d bytes', len(pairs), budget, size)
        return size

    def sizes(self, net):
        """{layer index: (forward, backward, backward filter-call) bytes} of
        the chosen algorithms (liveness.workspace_buffers)."""
        self.ensure_planned()
        index = {id(layer): i for i, layer in enumerate(net.layers)}
        out = {}
        for layer, s in self.sites():
            i = index.get(id(layer))
            if i is None or s.choice is None:
                continue
            sizes = list(out.get(i, (0, 0, 0)))
            part = view_part(layer, s.kind)
            sizes[part] = max(sizes[part], s.choice.memory)
            out[i] = tuple(sizes)
        return out

    def set_views(self, views):
        self.views = dict(views)
        self._resolved = {}
        self.layout_stale = False
        # The private buffer served calls the old layout missed: the new one
        # covers them, so it goes (else it stays beside the arena for good).
        self._buffer.resize(0, self, self.plan_name)

    def workspace_bytes(self):
        return max([n for _, n in self.views.values()] + [self._buffer.nbytes])

    def _need(self, layer, kind):
        sites = self._layers.get(id(layer), (None, ()))[1]
        return max([s.choice.memory for s in sites if s.kind == kind and s.choice is not None]
                   + [0])

    def checkout(self, layer=None, kind=None):
        """Each call's view, worked out once per plan and layout (a
        GoogLeNet iteration makes ~270 calls, and on a host-bound net the
        GPU waits for each)."""
        self.ensure_planned()
        self._check_free(layer, kind)
        key = (id(layer), kind, self.again)
        view = self._resolved.get(key)
        if view is None:
            view = self._resolve(layer, kind, key)
        elif view is _WHOLE_BUFFER:
            view = (self._buffer.ptr, self._buffer.nbytes)
        return _Lease(self, view, (layer, kind))

    def _resolve(self, layer, kind, key):
        need = self._need(layer, kind)
        part = VIEW_NAMES[view_part(layer, kind)]
        if self.again is not None and part == 'forward':
            part = self.again
        view = self.views.get((id(layer), part))
        if need == 0 and view is None:
            # A call that needs no workspace has no view in the layout.
            self._resolved[key] = _WHOLE_BUFFER
            view = (self._buffer.ptr, self._buffer.nbytes)
        elif view is None or view[1] < need:
            # Not in the layout (yet): a buffer of its own for this call.
            if self._buffer.nbytes < need:
                self._buffer.resize(need, layer, self.plan_name)
            name = (getattr(getattr(layer, 'layer_param', None), 'name', None) or str(layer),
                    kind)
            if name not in self.outside:
                log.info('Placed workspace: layer %s %s needs %d bytes, its view in the plan '
                         'has %d: a buffer of its own until the plan is placed again',
                         name[0], kind, need, 0 if view is None else view[1])
            self.outside[name] = max(self.outside.get(name, 0), need)
            view = (self._buffer.ptr, self._buffer.nbytes)
        else:
            self._resolved[key] = view
        return view

    def release(self):
        super().release()
        self.views = {}
        self._resolved = {}
        self.layout_stale = True


# A timed algorithm this much slower than the fastest still counts as fast
# when it fits where the fastest would raise the plan's peak. (An allowance
# of 1% of the net's convolution time on top slows AlexNet's `shared`
# iterations from 14.6 to 17-19 ms on an H100 for no memory saved.)
HEADROOM_SLOWDOWN = 0.10
# A share that replaces every plan's own (PLAN_SLOWDOWN, HEADROOM_SLOWDOWN)
# when set (0: every call keeps its fastest); None: each plan's.
SLOWDOWN_FOR_EVERY_PLAN = None
# Plan `shared` promises `arena`'s iteration time: its calls keep their
# fastest algorithms. The trade saves nothing there: with none of it,
# shared's peaks are the same to the MiB on AlexNet, GoogLeNet, VGG-16 and
# ResNet-50.
PLAN_SLOWDOWN = {'shared': 0.0}
# Beside that share of each call's own time, the trades of a plan may add
# up to this share of the net's convolution time (the sum of every call's
# fastest) in all (trade_for_room). AlexNet b128's conv3 backward-data fits
# its step only over half batches, 1.2x its fastest (0.637 against 0.531
# ms), conv4's only per group (x1.24): 0.1 ms each for 33 MiB less at
# `free`'s peak, which a 10% rule refuses and a 20% one takes or not by
# timing noise. At 4% the timings still leave conv3's or
# conv4's filter call whole in 2 of 6 runs (1,399 and 1,427 MiB against
# 1,383-1,389); interleaved, `free` ran x1.031 of `shared` without trades
# and x1.034 with them (benchmarks/time_plans.py). `shared` trades nothing.
TRADE_TIME_SHARE = 0.06
PLAN_TRADE_SHARE = {'shared': 0.0}
# A share that replaces every plan's own (PLAN_TRADE_SHARE, TRADE_TIME_SHARE)
# when set; None: each plan's.
TRADE_SHARE_FOR_EVERY_PLAN = None


def _share_setting(name, value):
    """`value` (a share, 0 or more) checked, or None where unset."""
    if value is None:
        return None
    if not value >= 0:
        raise CaffeplusError('%s=%r: give a share, 0 or more' % (name, value))
    return value


def headroom_slowdown(plan_name=None):
    """How much slower than its fastest a call's algorithm may be where it
    fits its step's room: SLOWDOWN_FOR_EVERY_PLAN if set (0: every call
    keeps its fastest), else the plan's (PLAN_SLOWDOWN), else
    HEADROOM_SLOWDOWN."""
    share = _share_setting('SLOWDOWN_FOR_EVERY_PLAN', SLOWDOWN_FOR_EVERY_PLAN)
    return PLAN_SLOWDOWN.get(plan_name, HEADROOM_SLOWDOWN) if share is None else share


def trade_time_share(plan_name=None):
    """The share of the net's convolution time a plan's trades may add
    beyond each call's own slowdown: TRADE_SHARE_FOR_EVERY_PLAN if set,
    else the plan's (PLAN_TRADE_SHARE), else TRADE_TIME_SHARE."""
    share = _share_setting('TRADE_SHARE_FOR_EVERY_PLAN', TRADE_SHARE_FOR_EVERY_PLAN)
    return PLAN_TRADE_SHARE.get(plan_name, TRADE_TIME_SHARE) if share is None else share


def _timed(choice):
    t = getattr(choice, 'time', None)
    return t is not None and t > 0


def trade_for_room(calls, share, deterministic=False, slowdown=HEADROOM_SLOWDOWN):
    """{key: choice} for `calls` [(key, candidates, best, room)]: each call
    as within_headroom chooses within its own `slowdown` (room None: its
    best); then, where that still raises the peak, trades beyond it that
    add at most `share` of the calls' summed best times in all. The peak
    is the plan's buffers' plus the largest overflow left, so the trades go
    largest overflow first and stop at the first one the time left cannot
    pay for: trading a smaller one after it would cost time for nothing."""
    picks, offenders = {}, []
    left = share * sum(best.time for _, _, best, _ in calls if _timed(best))
    for key, cands, best, room in calls:
        pick = best if room is None else \
            within_headroom(cands, best, room, deterministic, slowdown)
        picks[key] = pick
        if room is None or pick is None or pick.memory <= room or not _timed(best):
            continue
        alt = within_headroom(cands, best, room, deterministic, slowdown, allowance=left)
        if alt.memory < pick.memory:
            offenders.append((pick.memory - room, key, best, alt))
    for _, key, best, alt in sorted(offenders, key=lambda o: -o[0]):
        cost = alt.time - best.time
        if cost > left:
            break
        picks[key] = alt
        left -= cost
    return picks


def within_headroom(candidates, best, room, deterministic=False, slowdown=HEADROOM_SLOWDOWN,
                    allowance=0.0):
    """`best` (the fastest within the budget), unless its workspace exceeds
    `room` (what the plan's buffers leave free at the call's step, so more
    would raise the peak): then, of the timed candidates at most `slowdown`
    slower (or at most `allowance` slower, in the times' unit: what the
    plan's trades have left, trade_for_room), the one that raises the peak
    least (the fastest of those; one that fits raises it not at all).
    Untimed candidates (heuristics: no times) keep `best`, except where any
    slowdown will do (plan auto under a budget): then where nothing timed
    fits, the first candidate, in cuDNN's order, within the room."""
    if best is None or best.memory <= room:
        return best
    pick = best
    if _timed(best):
        limit = max(best.time * (1 + slowdown), best.time + allowance)
        near = [c for c in candidates if 0 < getattr(c, 'time', -1) <= limit
                and (c.deterministic or not deterministic)]
        if near:
            least = min(near, key=lambda c: (max(c.memory - room, 0), c.time))
            if max(least.memory - room, 0) < best.memory - room:
                pick = least
    if pick.memory > room and slowdown == float('inf'):
        pick = next((c for c in candidates if c.memory <= room and
                     (c.deterministic or not deterministic)), pick)
    return pick


class StockWorkspace:
    """Caffe 1.0: a layer's own workspace, grown to max(ws) * group * 3."""
    plan_name = 'stock'

    def __init__(self, layer, group):
        self._layer = weakref.ref(layer)
        self.group = int(group)
        self._buffer = _Buffer()
        self._sites = []
        self._dirty = False
        self.handles, self.streams = [], []

    def create_handles(self):
        """3 * group cuDNN handles and CUDA streams, as Caffe's LayerSetUp."""
        if self.handles:
            return
        from caffeplus.cudnn import api
        cupy = _cupy()
        for _ in range(self.group * CUDNN_STREAMS_PER_GROUP):
            stream = cupy.cuda.Stream(non_blocking=True)
            self.streams.append(stream)
            self.handles.append(api.Handle().bind(stream.ptr))

    def register(self, layer, sites):
        self._sites = list(sites)
        self._dirty = True

    def unregister(self, layer):
        self._sites = []

    def plan(self):
        layer = self._layer()
        for s in self._sites:
            s.choice = choose_stock(s.candidates, what=call_site_name(layer, s.kind))
        need = stock_bytes([s.choice for s in self._sites], self.group)
        if need > self._buffer.nbytes:         # Caffe only ever grows it
            self._buffer.resize(need, layer, self.plan_name)
        self._dirty = False

    def ensure_planned(self):
        if self._dirty:
            self.plan()

    @property
    def nbytes(self):
        return self._buffer.nbytes

    def workspace_bytes(self):
        self.ensure_planned()
        return stock_bytes([s.choice for s in self._sites], self.group)

    @contextlib.contextmanager
    def checkout(self, layer=None, kind=None):
        """Caffe hands each group/stream its slice of max_workspace bytes;
        we run the groups one after another, so slice 0 serves them all."""
        self.ensure_planned()
        per_slice = self._buffer.nbytes // max(self.group * CUDNN_STREAMS_PER_GROUP, 1)
        yield self._buffer.ptr, per_slice

    def release(self):
        self._buffer.resize(0, self._layer(), self.plan_name)


# =============================================================================
# Net level
# =============================================================================
_default = {}


def default_arena():
    """The arena layers use before a net adopts them (one per device)."""
    dev = backend.device()
    arena = _default.get(dev)
    if arena is None:
        arena = _default[dev] = WorkspaceArena(name='default arena')
    return arena


def pending_blob_bytes(net):
    """Bytes of the net's data/diff storages not yet on the device."""
    seen, total = set(), 0
    blobs = list(getattr(net, '_blobs', [])) + list(getattr(net, 'learnable_params', []))
    for b in blobs:
        for st in (b.data_storage, b.diff_storage):
            if id(st) in seen:
                continue
            seen.add(id(st))
            arr = st.array
            if arr is None or not type(arr).__module__.startswith('cupy') or arr.size < b.count:
                total += b.count * 4
    return total


def workspace_layers(net):
    """The net's layers that take part in a workspace plan (cuDNN convolutions)."""
    return [l for l in net.layers if l.workspace_calls]


def apply_workspace_plan(net, plan_name='arena', limit=0):
    """Give a built net's cuDNN layers their workspace: plan 'stock' (each
    layer its own, Caffe 1.0) or 'arena' (one buffer for the net, within
    `limit` bytes, 0: what the GPU spares). The other memory plans (shared,
    offload, auto) use the arena for workspace. Returns the manager (the
    arena, or None for stock)."""
    from caffeplus.memory import plan as plan_module
    plan_module.check_plan_name(plan_name)
    layers = workspace_layers(net)
    old = getattr(net, 'workspace', None)
    if old is not None and hasattr(old, 'release'):
        old.release()
    if plan_name == 'stock':
        for layer in layers:
            mgr = StockWorkspace(layer, getattr(layer, 'group', 1))
            layer.set_workspace_manager(mgr, 'stock')
        net.workspace = None
        net.memory_plan = 'stock'
        for layer in net.layers:
            layer.memory_plan = 'stock'
        from caffeplus.memory import caffe1     # Caffe 1.0's layer buffers too
        caffe1.attach(net)
        return None
    from caffeplus.memory import caffe1
    caffe1.detach(net)                          # a previous stock plan's
    cls = WorkspaceArena if plan_name == 'arena' else PlacedWorkspace
    arena = cls(limit=limit, net=net, name='%s workspace of net %s' % (plan_name, net.name))
    if cls is PlacedWorkspace:
        arena.headroom_slowdown = headroom_slowdown(plan_name)
        arena.trade_share = trade_time_share(plan_name)
        if plan_name == 'auto':
            arena.search_floor = 0.0
    for layer in layers:
        layer.set_workspace_manager(arena, plan_name)
    net.workspace = arena
    net.memory_plan = plan_name
    for layer in net.layers:
        layer.memory_plan = plan_name
    return arena


def attach_default(net):
    """Net construction's hook: in GPU mode the net gets its own arena
    (plan 'arena', budget: what the GPU spares)."""
    if backend.mode() != backend.GPU or not workspace_layers(net):
        net.workspace = None
        return None
    return apply_workspace_plan(net, 'arena', 0)
