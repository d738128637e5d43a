"""Each parameter's update right after the backward that completes its gradient.

Caffe updates every parameter after the whole backward pass, so every
parameter gradient is held for the whole iteration: 528 MiB on VGG-16, at
the end of backward, where its peak is. Under plans `shared`, `offload` and `auto`
the solver instead updates a parameter as soon as the last layer that owns it
has run its backward, and the plan places the gradients in its arena, live
from their first write in backward to that update only
(caffeplus.memory.liveness.param_diff_spans): fc6's 392 MiB are gone before
the convolutions' backward starts.

The numbers are Caffe's: the same per-parameter arithmetic
(caffeplus.solver.sgd: normalization, weight decay, the rule, data -= diff)
on the same gradient, only earlier; the learning rate is computed before
forward (and logged where Caffe logs it). A gradient's life starts with
zeros (Caffe's ClearParamDiffs), written by the plan's applier before the
layer's backward (caffeplus.memory.apply).

Which: gradients of at least liveness.MIN_APPLIED_GRADIENT_BYTES (each layer
updated in backward costs kernel launches; small ones are updated together
at the end, as before).

When: the train net's plan placed the gradients (plan.param_diffs: plans
`shared`, `offload` and `auto` under a solver, unless the update_in_backward
setting is off: caffeplus.config)
and nothing needs all of them at once: iter_size 1 (accumulation over
passes), no clip_gradients (a global norm), no debug_info (it logs every
gradient after backward), no snapshot_diff (a snapshot holds the gradients,
as Caffe's update leaves them), and no solver callback but the NaN check (a
data-parallel sync averages the gradients across GPUs before the update).
Solver.step checks before every iteration; when one of these stops holding,
the plan is placed again with the gradients kept whole, and a log line says
why.

The NaN check ('stop', caffeplus.solver.nan_check): before a layer's update
its gradients are checked on the device (one pass, gpu_kernels); a value
that is not finite sets a guard every later update reads, so nothing is
updated from there on and no weight takes a non-finite value (parameters
updated before, of later layers, keep their update); the check after
backward names the first parameters whose gradient was not finite (and,
as before, any of the gradients kept whole). Its 'warn' mode keeps the gradients whole: it trains on as Caffe,
and looks for the NaN's origin by running the iteration again before the
update, when the weights are still those that made it.
"""

import numpy

from caffeplus import backend, kernels, log
from caffeplus.memory import liveness
from caffeplus.memory.plan import PLACING
from caffeplus.solver.nan_check import installed_mode

ENV = 'CAFFEPLUS_UPDATE_IN_BACKWARD'     # (named in messages; caffeplus.config reads it)


def enabled(solver=None):
    """Whether the plans place the gradients for a solver (the
    update_in_backward setting, caffeplus.config; `solver`'s own field counts)."""
    from caffeplus import config
    return config.get('update_in_backward', solver=getattr(solver, 'param', None))


def places_gradients(plan_name, solver=None, net=None):
    """Whether plan `plan_name` places the large gradients: for `solver` when
    given (nothing blocks it now), else for the estimate's plain SGD solver
    training `net`, which adds a loss scaler (a blocker) to a FLOAT16 net
    that asks for loss scaling."""
    if plan_name not in PLACING:
        return False
    if solver is not None:
        return not blockers(solver)
    if net is not None:
        from caffeplus import precision
        if precision.loss_scaling(net) is not None:
            return False
    return enabled()


def blockers(solver):
    """Why `solver` cannot update in backward now (empty: it can)."""
    p = solver.param
    out = []
    if not enabled(solver):
        from caffeplus import config
        out.append('update_in_backward is off (%s)'
                   % config.lookup('update_in_backward', solver=p)[1])
    if p.iter_size > 1:
        out.append('iter_size %d accumulates gradients over passes' % p.iter_size)
    if p.clip_gradients >= 0:
        out.append('clip_gradients needs the norm of every gradient')
    if p.debug_info:
        out.append('debug_info logs every gradient after backward')
    if p.snapshot_diff:
        out.append('snapshot_diff writes every gradient with the snapshot')
    from caffeplus.solver.nan_check import NanCheck, installed_mode
    if installed_mode(solver) == 'warn':
        out.append("the NaN check's warn mode looks for a NaN's origin before the update")
    others = [cb for cb in solver.callbacks if not isinstance(cb, NanCheck)]
    if others:
        out.append('a solver callback (%s) reads the gradients before the update'
                   % type(others[0]).__name__)
    if solver.applies_own_update():
        # (A rule of its own, compute_update_value, is fine: update_params calls it.)
        out.append('the solver has its own apply_update')
    return out


class UpdateInBackward:
    """A solver's per-layer update hook on its train net (Solver.in_backward)."""

    def __init__(self, solver):
        self.solver = solver
        self.pending = False        # this iteration updates in backward
        self.updating = False       # the step's own backward is running
        self.rate = None
        self.groups = {}            # layer index -> learnable ids whose gradient it completes
        self.order = {}             # layer index -> its group's place in backward order
        self.rest = []              # learnable ids no backward writes
        self.stopping = False       # the NaN check stops: updates are guarded
        self.guard = None           # float64 scalar: NaN once a gradient was not finite
        self.flags = None           # int32 per group: its gradient was not finite
        self._hooked = None
        self._hook_fn = None        # the per-layer hook on _hooked (its `at`: the groups' layers)
        self._laid_out = None
        self._flag_views = []

    # -- set up ----------------------------------------------------------------------
    def _plan(self):
        return getattr(getattr(self.solver.net, 'applied_plan', None), 'plan', None)

    def ready(self):
        """Before an iteration: True if it updates in backward. A plan that
        placed the gradients for a solver that can no longer (a callback
        added since, a setting changed) is placed again without them."""
        if not getattr(self._plan(), 'param_diffs', False):
            return False
        why = blockers(self.solver)
        if why:
            log.info('Memory plan: parameter gradients kept whole: %s', '; '.join(why))
            self.solver.net.applied_plan.keep_param_diffs()
            return False
        return True

    def _layout(self):
        """Which parameters each layer's backward completes (once per plan)."""
        plan = self._plan()
        if plan is not None and self._laid_out is plan:
            return
        net = self.solver.net
        spans = liveness.param_diff_spans(net)
        L = len(net.layers)
        self.groups = {}
        for k, (_, last) in spans.items():
            self.groups.setdefault(2 * L - 1 - last, []).append(k)
        for ids in self.groups.values():
            ids.sort()
        self.order = {i: g for g, i in enumerate(sorted(self.groups, reverse=True))}
        self.rest = [k for k in range(len(net.learnable_params)) if k not in spans]
        self.guard = self.flags = None
        self._laid_out = plan

    def _hook(self):
        net = self.solver.net
        if self._hooked is net:
            return
        self._unhook()

        def after_layer(i):         # a function, so that it can carry `at`
            self._after_layer(i)
        # The same launches every pass; what they read from the host is the
        # CUDA graph's key (Solver.graph_key, caffeplus.pass_graph).
        after_layer.graph_safe = True
        net.on_layer_backward_done.append(after_layer)
        self._hooked, self._hook_fn = net, after_layer

    def _unhook(self):
        fn = self._hook_fn
        if self._hooked is not None and fn in self._hooked.on_layer_backward_done:
            self._hooked.on_layer_backward_done.remove(fn)
        self._hooked, self._hook_fn = None, None

    # -- one iteration -------------------------------------------------------------------
    def begin(self):
        """Before forward: the learning rate (as apply_update will log it),
        the guard, the hook; the gradients no backward writes are zeroed
        (the placed ones start at zero at their first step)."""
        solver = self.solver
        self._layout()
        self._hook()
        self._hook_fn.at = frozenset(self.groups)   # the layers with updates (Net.hook_table)
        self.rate = solver.peek_learning_rate()
        params = solver.net.learnable_params
        xp = backend.get_array_module(params[0].data) if params else numpy
        self.stopping = installed_mode(solver) == 'stop'
        if self.stopping and (self.guard is None or
                              backend.get_array_module(self.guard) is not xp):
            self.guard = xp.zeros((), dtype=numpy.float64)
            self.flags = xp.zeros(max(len(self.groups), 1), dtype=numpy.int32)
            # Each group's flag as a view, made once (a slice a layer costs
            # the host a few microseconds where the GPU may wait for it).
            self._flag_views = [self.flags[g:g + 1] for g in range(len(self.flags))]
        cleared = (self.guard, self.flags) if self.stopping else ()
        # On the GPU one launch for all (a launch each cost `shared` 0.3 ms of
        # host time an iteration on AlexNet, where the GPU waits for it).
        if xp is numpy or not kernels.active() or \
                not kernels.zero_diffs([params[k] for k in self.rest], also=cleared):
            for a in cleared:
                a.fill(0)
            for k in self.rest:
                params[k].diff[...] = 0
        self.pending = True
        self.updating = True

    def backward_done(self):
        """After the step's backward: later passes (the NaN check's re-run)
        update nothing."""
        self.updating = False

    def _after_layer(self, i):
        if not self.updating:
            return
        ids = self.groups.get(i)
        if not ids:
            return
        if self.stopping:
            self.solver.update_params(ids, self.rate, self.guard,
                                      self._flag_views[self.order[i]])
        else:
            self.solver.update_params(ids, self.rate)

    def finish(self, rate):
        """In apply_update: the parameters no backward wrote."""
        self.pending = self.updating = False
        self.solver.update_params(self.rest, rate, self.guard if self.stopping else None)

    def bad_gradients(self):
        """Learnable ids of the first group (in backward) whose gradient was
        not finite (nothing was updated from there on), or []."""
        if not self.stopping or numpy.isfinite(float(self.guard)):
            return []
        flags = backend.to_numpy(self.flags)
        for i, g in sorted(self.order.items(), key=lambda item: item[1]):
            if flags[g]:
                return list(self.groups[i])
        return []
