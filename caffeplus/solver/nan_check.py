"""Stop (or warn) when a NaN or an Inf appears in the loss or a gradient.

Stock Caffe trains on with NaN weights, and a long run's log then shows
`loss = nan` for hours. caffeplus checks, after every iteration's forward
and backward and before the update (so the weights are still finite when it
stops):

  * the loss (every loss top of the train net);
  * every learnable parameter's gradient (diff).

When one is not finite it finds where the problem started: it re-runs the
iteration (same inputs, same random draws) checking each layer as it runs,
and names the first layer, in forward order, whose output (or parameters)
holds a NaN/Inf, else the first layer, in backward order, whose input or
parameter gradient does. Then, as `mode` says:

  'stop'  raise NumericalError (a CaffeplusError: the CLI prints the message
          and exits non-zero); the last snapshot on disk is untouched;
  'warn'  log a warning with the same message once per iteration and go on
          (as stock Caffe, which does not check);
  'off'   no check at all.

The mode comes from the argument, else the nan_check setting (stop, warn,
off; caffeplus.config: --nan_check, the solver's caffeplus_param.nan_check,
CAFFEPLUS_NAN_CHECK), else 'stop'.

The check is a solver callback; every solver installs it when it is built
(Solver._init calls nan_check.install(self)); install(solver, mode) changes
its mode afterwards.

The steady-state cost is, on the GPU, one kernel over the loss tops and
every gradient and one read of its guard (a reduction per array cost AlexNet
10% of an iteration and ResNet-50 more), on the CPU one reduction per array,
plus saving the random stream's state at each iteration's start; the full
check runs only when a value is not finite, and the layer-by-layer re-run
only once a problem is seen (it leaves parameters, gradients and layer state
as they were).

The guard is read after the update is queued, where the solver allows it
(Solver.guarded_update: 'stop', no display that iteration, an SGD-family
update with no gradient clipping): the update kernels skip on a guard that
is not finite, so the weights stay as they were, and the GPU is not left
idle while the host reads the verdict and then launches the update
(NanCheck.after_update; the iteration count goes back to the stopped one).
"""

import numpy

from caffeplus import backend, log
from caffeplus.errors import CaffeplusError

MODES = ('stop', 'warn', 'off')
STOPPED = 'Training stopped before the update, so the weights are still finite'
ENV = 'CAFFEPLUS_NAN_CHECK'     # (named in messages; caffeplus.config reads it)


class NumericalError(CaffeplusError):
    """A NaN or Inf in the loss or a gradient stopped training."""

    def __init__(self, message, iteration=None, layer=None, what=None):
        super().__init__(message)
        self.iteration = iteration
        self.layer = layer
        self.what = what


def _finite(arr):
    """True when every value of a NumPy/CuPy array is finite. (A float64
    sum of float32 values cannot overflow, so it is finite exactly when
    they all are: one reduction, no temporary array.)"""
    return _all_finite([arr])


def _all_finite(arrays):
    """True when every value of every array is finite: one reduction per
    array and, on a GPU, one synchronisation for the lot."""
    sums = {}
    for arr in arrays:
        if arr is None or arr.size == 0:
            continue
        xp = backend.get_array_module(arr)
        sums.setdefault(xp, []).append(xp.sum(arr, dtype=numpy.float64))
    for xp, values in sums.items():
        if not bool(xp.isfinite(xp.stack(values)).all()):
            return False
    return True


def _reported(guard_value):
    """Whether a guard's value is the check's verdict that something is not
    finite (NaN). +inf is a loss scaler's overflow (caffeplus.precision): the
    update skipped and the scale lowered, nothing to report."""
    return numpy.isnan(guard_value)


def _kind(arr):
    a = backend.to_numpy(arr)
    if numpy.isnan(a).any():
        return 'NaN'
    if numpy.isposinf(a).any() and numpy.isneginf(a).any():
        return '+Inf and -Inf'
    return '+Inf' if numpy.isposinf(a).any() else '-Inf'


def _safe(get):
    """A blob's array, or None where the memory plan released it."""
    try:
        return get()
    except CaffeplusError:
        return None


# Layers whose forward reads the next input (a re-run would move on to
# another batch); the diagnosis keeps their tops as they are.
_SOURCE_TYPES = frozenset(('Data', 'ImageData', 'HDF5Data', 'MemoryData', 'WindowData', 'Input',
                           'Python'))


def _top_problem(net, i):
    layer = net.layers[i]
    for j, blob in enumerate(layer.blobs):
        data = _safe(lambda: blob.data)
        if not _finite(data):
            return 'parameter %d holds %s' % (j, _kind(data))
    for blob_id, top in zip(net.top_id_vecs[i], net.top_vecs[i]):
        data = _safe(lambda: top.data)
        if not _finite(data):
            return "its output '%s' holds %s" % (net._blob_names[blob_id], _kind(data))
    return None


def _bottom_diff_problem(net, i):
    layer = net.layers[i]
    if not net.layer_need_backward[i]:
        return None
    for k, (blob_id, bottom) in enumerate(zip(net.bottom_id_vecs[i], net.bottom_vecs[i])):
        if not net.bottom_need_backward[i][k]:
            continue
        diff = _safe(lambda: bottom.diff)
        if not _finite(diff):
            return "the gradient of its input '%s' holds %s" % (net._blob_names[blob_id],
                                                               _kind(diff))
    for j, blob in enumerate(layer.blobs):
        if not layer.param_needs_backward(j):
            continue
        diff = _safe(lambda: blob.diff)
        if not _finite(diff):
            return 'the gradient of its parameter %d holds %s' % (j, _kind(diff))
    return None


def locate(net, rng_state=None):
    """Where a NaN/Inf first appears: re-run the iteration's forward and
    backward (the same inputs: layers that read data keep their outputs;
    the random stream rewound to `rng_state`, the iteration's start, so
    Dropout draws the same masks), checking each layer right after it ran
    (memory plans reuse blobs, so the values of a finished pass are not all
    there to look at). Parameters, their gradients, layer state and the
    random stream are put back afterwards.

    Returns (direction, layer name, type, detail) or None."""
    from caffeplus import rng
    n = len(net.layers)
    start = 0
    while start < n and not net.bottom_vecs[start] and \
            net.layers[start].layer_param.type in _SOURCE_TYPES:
        start += 1
    if start >= n:
        return None
    saved = []
    for layer in net.layers:
        for blob in layer.blobs:
            saved.append((blob, _copy(lambda: blob.data), _copy(lambda: blob.diff)))
    rng_after = rng.get_state()
    found = []

    def after_forward(i):
        if not found:
            problem = _top_problem(net, i)
            if problem:
                found.append(('forward', i, problem))

    def after_backward(i):
        if not found:
            problem = _bottom_diff_problem(net, i)
            if problem:
                found.append(('backward', i, problem))
    net.after_layer_forward.append(after_forward)
    net.on_layer_backward_done.append(after_backward)
    try:
        if rng_state is not None:
            rng.set_state(rng_state)
        with numpy.errstate(all='ignore'):
            net.forward_from_to(start, n - 1)
            if not found:
                net.backward_from_to(n - 1, 0)
    except CaffeplusError:
        pass       # (a memory plan that released what the re-run needs)
    finally:
        net.after_layer_forward.remove(after_forward)
        net.on_layer_backward_done.remove(after_backward)
        for blob, data, diff in saved:
            if data is not None:
                blob.data = data
            if diff is not None:
                blob.diff = diff
        rng.set_state(rng_after)
    if not found:
        return None
    direction, i, detail = found[0]
    return direction, net._layer_names[i], net.layers[i].layer_param.type, detail


def _copy(get):
    arr = _safe(get)
    return None if arr is None else arr.copy()


def check_net(net, iteration, rng_state=None, applied=None):
    """None if the train net's loss and gradients are finite, else a
    NumericalError (not raised) saying what, where (see locate()) and when.
    `applied`: the solver updated in backward (caffeplus.solver.
    update_in_backward); the learnable ids whose gradient it found not
    finite (the gradients themselves are gone)."""
    bad_loss = []
    for blob_id, weight in enumerate(net._blob_loss_weights):
        if weight:
            data = _safe(lambda: net._blobs[blob_id].data)
            if not _finite(data):
                bad_loss.append("'%s' = %s" % (net._blob_names[blob_id], _kind(data)))
    # (Gradients already applied in backward are released: _safe gives None.)
    diffs = [_safe(lambda: blob.diff) for blob in net.learnable_params]
    if not bad_loss and not applied and _all_finite(diffs):
        return None
    bad_grad = sorted(set(applied or ()) |
                      {learnable_id for learnable_id, diff in enumerate(diffs)
                       if not _finite(diff)})
    if not bad_loss and not bad_grad:
        return None
    what = []
    if bad_loss:
        what.append('the loss is not finite (%s)' % ', '.join(bad_loss))
    if bad_grad:
        names = []
        for learnable_id in bad_grad:
            # The owner: the net parameter of this learnable id that shares from no one.
            owner = next(i for i, lid in enumerate(net.learnable_param_ids)
                         if lid == learnable_id and net.param_owners[i] == -1)
            layer_id, index = net.param_layer_indices[owner]
            names.append('%s[%d]' % (net._layer_names[layer_id], index))
        what.append('%d parameter gradient(s) are not finite (%s)'
                    % (len(bad_grad), ', '.join(names[:8]) + (' ...' if len(names) > 8 else '')))
    where = locate(net, rng_state)
    if where is not None:
        direction, layer, kind, detail = where
        origin = ("; it first appears in the %s pass at layer '%s' (%s): %s"
                  % (direction, layer, kind, detail))
    else:
        layer = None
        origin = '; the layer where it started could not be found again'
    stopped = STOPPED
    if applied:
        # The update in backward had applied the later layers' finite
        # gradients when it met these; nothing was updated from there on.
        stopped = STOPPED.replace('before the update', 'before updating these parameters and '
                                  'the layers before them (the layers after them were updated '
                                  'in backward)')
    message = ('Iteration %d: %s%s. %s (lower base_lr, clip gradients with clip_gradients, or '
               'check the input data; set %s=warn to train on regardless).'
               % (iteration, ' and '.join(what), origin, stopped, ENV))
    error = NumericalError(message, iteration, layer, ' and '.join(what))
    error.stopped = stopped         # the sentence warn mode replaces
    return error


class NanCheck:
    """A solver callback: checks after the gradients are ready, before the update
    (after the other callbacks: Solver.add_callback keeps it last)."""

    runs_last = True

    def __init__(self, solver, mode='stop'):
        if mode not in MODES:
            raise CaffeplusError("nan check mode must be one of %s, not '%s'"
                                 % (', '.join(MODES), mode))
        self.solver = solver
        self.mode = mode
        self.problems = 0

    def on_start(self):
        if self.mode != 'off':
            from caffeplus import rng
            self._rng_state = rng.get_state()

    _queued = None      # (guard, updated in backward, lr step): a verdict read in after_update

    @property
    def guards_update(self):
        """Whether this check guards the update (Solver.step then reads the
        losses and the verdict after queuing it)."""
        return self.mode == 'stop'

    def on_gradients_ready(self):
        if self.mode == 'off':
            return
        ub = getattr(self.solver, 'in_backward', None)
        pending = ub is not None and ub.pending
        self._queued = None
        if self.mode == 'stop' and self.solver.guarded_update:
            # The verdict stays on the device: the update skips on its guard,
            # and after_update reads it once the update is queued.
            guard = self._queue_check(ub if pending else None)
            if guard is not None:
                self._queued = (guard, pending, getattr(self.solver, 'current_step', None))
                if not pending:
                    self.solver.update_guard = guard
                return
        if self._all_finite_on_device(ub if pending else None):
            return
        self._report(self.solver.iter, ub.bad_gradients() if pending else None)

    def after_update(self, iteration):
        """After the update of `iteration` is queued: read a queued verdict.
        A value that was not finite skipped the update (its guard): the
        iteration did not happen, and the full check says what and where."""
        queued = self._take_skipped(iteration)
        if queued is not None:
            pending = queued[1]
            ub = self.solver.in_backward if pending else None
            self._report(iteration, ub.bad_gradients() if pending else None)

    def discard_update(self, iteration):
        """The iteration stopped on another error after its update was
        queued: a skipped update did not happen (no report of our own)."""
        self._take_skipped(iteration)

    def _take_skipped(self, iteration):
        """The queued verdict, if it skipped the update (the solver's
        iteration count and learning-rate step put back); else None."""
        queued, self._queued = self._queued, None
        if queued is None or not _reported(float(queued[0])):
            return None
        self.solver.iter = iteration
        if queued[2] is not None:
            self.solver.current_step = queued[2]
        return queued

    def _report(self, iteration, applied):
        error = check_net(self.solver.net, iteration, getattr(self, '_rng_state', None), applied)
        if error is None:
            return
        self.problems += 1
        if self.mode == 'stop':
            raise error
        log.warning('%s', str(error).replace(error.stopped, 'Training goes on (%s=warn)' % ENV))

    # -- the common case on the GPU: everything finite -----------------------------------
    _fused = None
    _guard = None
    _flag = None

    def _checked_arrays(self):
        """The loss tops and every gradient still held (an update in backward
        released those it applied)."""
        net = self.solver.net
        arrays = [_safe(lambda: net._blobs[blob_id].data)
                  for blob_id, weight in enumerate(net._blob_loss_weights) if weight]
        arrays += [_safe(lambda: blob.diff) for blob in net.learnable_params]
        return [a for a in arrays if a is not None and a.size]

    def _guard_for(self, xp, in_backward):
        """The guard the verdict goes into: an update in backward's (its
        checks of the gradients it applied have set it), else the check's own
        (cleared)."""
        if in_backward is not None and in_backward.guard is not None:
            return in_backward.guard
        shared = self.solver.update_guard
        if shared is not None and backend.get_array_module(shared) is xp:
            return shared       # a loss scaler's, set this iteration: +inf on its overflow
        if self._guard is None or backend.get_array_module(self._guard) is not xp:
            self._guard = xp.zeros((), dtype=numpy.float64)
        self._guard.fill(0)
        return self._guard

    def _run_kernel(self, arrays, guard):
        import cupy
        from caffeplus.solver import gpu_kernels
        if self._fused is None:
            self._fused = gpu_kernels.MultiTensorCheck()
            self._flag = cupy.zeros(1, dtype=numpy.int32)
        self._fused.run(arrays, guard, self._flag)

    def _queue_check(self, in_backward=None):
        """The guard, NaN where the loss or a gradient held is not finite,
        set without reading anything back on the GPU (one check kernel); on
        the CPU the same verdict, made now. None where neither applies
        (arrays of mixed kinds)."""
        arrays = self._checked_arrays()
        if backend.on_device_float32(arrays):
            guard = self._guard_for(backend.get_array_module(arrays[0]), in_backward)
            self._run_kernel(arrays, guard)
            return guard
        if any(backend.get_array_module(a) is not numpy for a in arrays):
            return None
        guard = self._guard_for(numpy, in_backward)
        if not _all_finite(arrays):
            guard[...] = numpy.nan
        return guard

    def _all_finite_on_device(self, in_backward=None):
        """True when the loss and every gradient still held are finite, known
        from one check kernel over all of them and one read of its guard.
        False where that cannot tell (not all CuPy float32 arrays; a value
        not finite): the full check then runs and says what and where."""
        arrays = self._checked_arrays()
        if not backend.on_device_float32(arrays):
            return False
        guard = self._guard_for(backend.get_array_module(arrays[0]), in_backward)
        self._run_kernel(arrays, guard)
        return not _reported(float(guard))


def installed_mode(solver):
    """The mode of the check installed on `solver` ('off' without one)."""
    modes = [cb.mode for cb in solver.callbacks if isinstance(cb, NanCheck)]
    return modes[0] if modes else 'off'


def configured_mode(solver=None, mode=None):
    """`mode` if given (checked), else the nan_check setting (caffeplus.config:
    --nan_check, the solver's caffeplus_param.nan_check, CAFFEPLUS_NAN_CHECK)."""
    from caffeplus import config
    if mode is not None:
        checked = config.setting('nan_check').check(mode, 'the NaN check mode')
        return checked or 'stop'
    return config.get('nan_check', solver=getattr(solver, 'param', None))


def install(solver, mode=None):
    """Add the check to `solver` (once); returns the NanCheck (None when off).
    Every solver installs it when built (Solver._init, mode from the
    environment or the solver file); calling install again with a `mode`
    changes the mode of that check ('off' removes it)."""
    existing = [cb for cb in solver.callbacks if isinstance(cb, NanCheck)]
    if existing and mode is None:
        return existing[0]
    mode = configured_mode(solver, mode)
    if mode == 'off':
        for cb in existing:
            solver.callbacks.remove(cb)
        return None
    if existing:
        existing[0].mode = mode
        return existing[0]
    cb = NanCheck(solver, mode)
    solver.add_callback(cb)
    return cb
