"""Memory plans as data: where every buffer lives and what the peak is.

Plans users pick:
  stock    what BVLC Caffe 1.0 does: every blob's data and (touched) diff kept
           for the whole run; every cuDNN convolution owns its workspace
  arena    stock blobs, one net-level workspace arena
  shared   the arena, plus data and diff buffers reused once dead (liveness)
  offload  shared, with feature maps moved to pinned host memory between
           their forward and backward use
  auto     the fastest plan that fits a budget

A plan is computed from the built net without running it; `breakdown` holds
bytes per category (parameters, parameter_diffs, solver_history,
activations, activation_diffs, workspace, other).
"""
import collections
import json

from caffeplus.errors import CaffeplusError
from caffeplus.memory import liveness, masks, placement
from caffeplus.memory.kept_model import model_internals

PLANS = ('stock', 'arena', 'shared', 'offload', 'auto')
# The plans that place buffers in one arena (the others keep Caffe's own blobs).
PLACING = ('shared', 'offload', 'auto')
CATEGORIES = ('parameters', 'parameter_diffs', 'solver_history', 'activations',
              'activation_diffs', 'workspace', 'other')
# Solver history blobs per learnable parameter (Caffe's solvers).
HISTORY_COPIES = {'SGD': 1, 'Nesterov': 1, 'AdaGrad': 1, 'RMSProp': 1, 'AdaDelta': 2, 'Adam': 2}


def check_plan_name(name):
    if name not in PLANS:
        raise CaffeplusError("unknown memory plan '%s': choose one of %s"
                             % (name, ', '.join(PLANS)))
    return name


class MemoryPlan:
    offload_policy = None       # the offload plan's policy (make_plan)
    offload_holds = {}          # {buffer key: free_offload.Hidden}: auto's held maps
    recomputed = {}             # {buffer key: producer layer indices}: maps made again
    recompute_split = ()        # keys of those also gone between backward uses
    masked = ()                 # names of the layers masked (caffeplus.memory.masks)
    param_diffs = False         # parameter gradients placed in the arena (applied in backward)

    def __init__(self, name, breakdown, buffers=(), offsets=None, arena_bytes=0,
                 offloaded=(), estimated=True, steps=0):
        self.name = name
        self.breakdown = collections.OrderedDict((c, int(breakdown.get(c, 0))) for c in CATEGORIES)
        self.buffers = list(buffers)
        self.offsets = dict(offsets or {})
        self.arena_bytes = arena_bytes
        self.offloaded = tuple(offloaded)
        self.estimated = estimated
        self.steps = steps

    @property
    def peak_bytes(self):
        return sum(self.breakdown.values())

    def to_dict(self):
        return {'peak_bytes': self.peak_bytes, 'breakdown': dict(self.breakdown),
                'arena_bytes': self.arena_bytes, 'estimated': self.estimated,
                'offloaded': list(self.offloaded),
                'recomputed': self.recomputed_names()}

    def recomputed_names(self):
        """The blobs whose maps the plan makes again in backward."""
        return sorted(n for key in self.recomputed for n in key[1])

    def to_json(self):
        return json.dumps(self.to_dict(), indent=1)

    def live_curve(self):
        """Activation bytes live at each of the 2L steps (forward then backward)."""
        return liveness.live_bytes_by_step(self.buffers, self.steps)


def _param_bytes(net):
    return sum(p.count for p in net.learnable_params) * liveness.FLOAT_BYTES


def persistent_bytes(net, solver_type='SGD', training=True):
    """Parameters, and in training their diffs and the solver's history:
    what every plan holds for the whole run (the breakdown's first three)."""
    copies = 1 + (1 + HISTORY_COPIES.get(solver_type, 1) if training else 0)
    return _param_bytes(net) * copies


def _stock_workspace(net):
    return sum(getattr(layer, 'stock_workspace_bytes', lambda: 0)() for layer in net.layers)


def _arena_workspace(net):
    """The largest workspace the layers' algorithms chosen so far need (a
    cuDNN convolution does not choose here: the plan's own workspace
    manager does, once the plan is applied)."""
    return max([getattr(layer, 'chosen_workspace_bytes', layer.workspace_bytes)()
                for layer in net.layers] + [0])


def make_plan(net, name, solver_type='SGD', keep=(), training=True, offload_policy='conv',
              other_bytes=0, workspace=None, internals=None, offload_hidden=None,
              recompute=True, offload_holds=None, recompute_split=(), workspace_last=False,
              param_diffs=False, gemm_workspace=0, recomputed=None):
    """Compute plan `name` for a built net. `workspace`: {layer index:
    (forward bytes, backward bytes)} of the convolutions' workspace; the
    reusing plans then place it in the arena beside the activations, live
    at its layer's step only (None: one separate workspace buffer of the
    largest layer's need, as the `arena` plan). `internals`: {layer index:
    {name: bytes}} of the buffers layers keep from forward to backward
    (caffeplus.memory.scratch); the reusing plans place them too, and count
    their share of the arena under 'other'. Offload policy 'free' offloads
    the maps of `offload_hidden` ({buffer key: free_offload.Hidden}, chosen
    from measured times by the runtime or from modelled ones by the
    estimate), nothing before they are chosen. `recompute`: the reusing
    plans make cheap maps again in backward (caffeplus.memory.recompute;
    'convs': convolutions too; a tuple of layer indices: those convolutions).
    `offload_holds`: {buffer key: free_offload.Hidden} of offloaded maps
    whose bytes stay theirs while their copies run (plan auto's
    caffeplus.memory.offload_timing). `recompute_split`: keys of maps made
    again that also leave while a filter call alone reads them
    (recompute.again_lives). `workspace_last`: the workspace is placed
    after every other buffer (plan auto under a budget sizes each call to
    the hole it gets, budget.fit_calls). `param_diffs`: the solver applies
    each parameter's update in backward (caffeplus.solver.update_in_backward),
    so the reusing plans place the parameter gradients in the arena too, live
    from their first backward write to that update (liveness.param_diff_spans).
    `gemm_workspace`: with `workspace`, the bytes of cuBLAS's workspace each
    InnerProduct call gets placed in the arena (caffeplus.memory.cublas_pool;
    liveness.gemm_workspace_buffers). `recomputed`: the maps made again as a
    plan of the same net and settings chose them (its `recomputed`; the
    choice does not depend on `workspace`), not chosen anew."""
    check_plan_name(name)
    if name == 'auto':
        raise CaffeplusError("plan 'auto' needs a budget: use caffeplus.memory.budget.plan_for_budget")
    # (stock and arena keep every diff in its own array: no overlays)
    bufs = liveness.buffers(net, keep=keep, training=training,
                            overlay=name not in ('stock', 'arena'))
    steps = 2 * len(net.layers) if training else len(net.layers)
    params = _param_bytes(net)
    breakdown = {
        'parameters': params,
        'parameter_diffs': params if training else 0,
        'solver_history': params * HISTORY_COPIES.get(solver_type, 1) if training else 0,
        'other': other_bytes,
    }
    data = [b for b in bufs if b.kind == 'data']
    diff = [b for b in bufs if b.kind == 'diff']
    if name in ('stock', 'arena'):
        breakdown['activations'] = sum(b.nbytes for b in data)
        breakdown['activation_diffs'] = sum(b.nbytes for b in diff)
        breakdown['workspace'] = _stock_workspace(net) if name == 'stock' else _arena_workspace(net)
        whole = [liveness.Buffer(b.key, b.kind, b.blobs, b.nbytes, 0, steps) for b in bufs]
        plan = MemoryPlan(name, breakdown, whole, steps=steps)
        plan.masked = masks.applied(net)
        return plan
    whole = bufs
    offloaded = ()
    if name == 'offload' and offload_policy == 'free':
        from caffeplus.memory import offload
        hidden = offload_hidden or {}
        offloaded = tuple(b.key for b in bufs if b.key in hidden)
        bufs = offload.shorten(bufs, offloaded, net, hidden=hidden)
    elif name == 'offload':
        from caffeplus.memory import offload
        offloaded = offload.choose(net, bufs, offload_policy, keep)
        offload_holds = {k: h for k, h in (offload_holds or {}).items() if k in offloaded}
        bufs = offload.shorten(bufs, offloaded, net, hidden=offload_holds)
    # Cheap maps made again in backward (after offload's choice: what it
    # moves stays its own).
    from caffeplus.memory import recompute as recompute_mod
    convs = True if recompute == 'convs' else recompute if isinstance(recompute, tuple) else False
    if recomputed is not None:
        again = dict(recomputed)
    elif not recompute:
        again = {}
    elif recompute_mod.enabled(name):
        again = recompute_mod.choose(net, whole, training, offloaded, convs=convs)
    else:       # `shared`: the normalized chains' tops and residual sums alone
        again = recompute_mod.choose(net, whole, training, offloaded, remakes_only=True)
    placed_diffs = liveness.param_diff_buffers(net) if param_diffs and training else []
    kept = liveness.internal_buffers(net, internals, training) if internals is not None else []

    def splits(again):
        return tuple(recompute_mod.splittable(net, whole, again)) \
            if recompute_mod.split_always() else tuple(k for k in recompute_split if k in again)
    if recomputed is None and name == 'shared' and recompute_mod.prunes():
        # `shared` promises `arena`'s time: a map is made again only where
        # that lowers the peak of the maps and the layers' kept buffers
        # (BatchNorm's copies: most of a residual net's), the model's where
        # the caller places them later (the runtime's AppliedPlan). The
        # workspace, fitted into the holes below that peak, is left out, so
        # that the estimate and the runtime choose alike.
        weighed = kept if internals is not None else \
            liveness.internal_buffers(net, model_internals(net), training)

        def peak_of(chosen):
            return placement.live_bound(recompute_mod.shorten(bufs, chosen, net, splits(chosen)) +
                                        weighed + placed_diffs)
        again = recompute_mod.prune(net, whole, again, peak_of)
    split = splits(again)
    bufs = recompute_mod.shorten(bufs, again, net, split)
    if workspace is not None:
        bufs = bufs + liveness.workspace_buffers(net, workspace, training) + \
            recompute_mod.workspace_buffers(net, bufs, again, workspace) + \
            liveness.gemm_workspace_buffers(net, gemm_workspace, training)
    bufs = bufs + kept + placed_diffs
    offsets, arena = placement.place(bufs, ('workspace',) if workspace_last else ())
    shares = shares_at_peak(bufs, steps)
    breakdown['activations'] = int(arena * shares['data'])
    in_arena = breakdown['activations']
    if workspace is not None:
        breakdown['workspace'] = int(arena * shares['workspace'])
        in_arena += breakdown['workspace']
    else:
        breakdown['workspace'] = _arena_workspace(net)
    if internals is not None:
        kept = int(arena * shares['internal'])
        breakdown['other'] += kept
        in_arena += kept
    if placed_diffs:
        in_grads = int(arena * shares['param_diff'])
        breakdown['parameter_diffs'] += in_grads - sum(b.nbytes for b in placed_diffs)
        in_arena += in_grads
    diffs = arena - in_arena
    if not shares['diff']:
        # No diff at the peak step: the bytes the shares' rounding left are the maps'.
        breakdown['activations'] += diffs
        diffs = 0
    breakdown['activation_diffs'] = diffs
    plan = MemoryPlan(name, breakdown, bufs, offsets, arena, offloaded, steps=steps)
    plan.param_diffs = bool(placed_diffs)
    plan.offload_policy = offload_policy if name == 'offload' else None
    plan.recomputed = again
    plan.recompute_split = split
    plan.masked = masks.applied(net)
    if name == 'offload' and offload_policy != 'free' and offload_holds:
        plan.offload_holds = dict(offload_holds)
    return plan


def shares_at_peak(bufs, steps):
    """{kind: share of the bytes live at the busiest step} (data, diff,
    workspace, internal, param_diff):
    how a reusing plan's one arena splits between the breakdown's categories."""
    live = liveness.live_bytes_by_step(bufs, steps)
    peak_step = max(range(len(live)), key=live.__getitem__) if live else 0
    total = max(live[peak_step] if live else 0, 1)
    out = dict.fromkeys(('data', 'diff', 'workspace', 'internal', 'param_diff'), 0.0)
    for b in bufs:
        if b.start <= peak_step <= b.end:
            out[b.kind] = out.get(b.kind, 0.0) + b.nbytes / float(total)
    if not live or not live[peak_step]:
        out['data'] = 1.0
    return out


def workspace_calls(plan):
    """{'layer/call': bytes} of the convolution workspace a placing plan
    holds (forward, backward, backward_filter), to set the estimate's
    algorithms beside the run's; empty for stock and arena."""
    return {'%s/%s' % buf.key[1:]: int(buf.nbytes)
            for buf in getattr(plan, 'buffers', None) or () if buf.kind == 'workspace'}
