"""Stop (or warn) when a NaN or an Inf appears in the loss or a gradient.

Stock Caffe trains on with NaN weights, and a long run's log then shows
`loss = nan` for hours. caffeplus checks, after every iteration's forward
and backward and before the update (so the weights are still finite when it
stops):

  * the loss (every loss top of the train net);
  * every learnable parameter's gradient (diff).

When one is not finite it finds where the problem started: the first layer,
in forward order, whose top (or parameters) holds a NaN/Inf, else the first
layer, in backward order, whose bottom or parameter gradient does. Then, as
`mode` says:

  'stop'  raise NumericalError (a CaffeplusError: the CLI prints the message
          and exits non-zero); the last snapshot on disk is untouched;
  'warn'  log a warning with the same message once per iteration and go on
          (as stock Caffe, which does not check);
  'off'   no check at all.

The mode comes from the argument, else CAFFEPLUS_NAN_CHECK (stop, warn,
off), else the solver's caffeplus_param.nan_check when the schema has it,
else 'stop'.

The check is a solver callback, so it needs one line in the solver (or the
train command):

    nan_check.install(solver)

The steady-state cost is one reduction per parameter (the gradients) and per
loss top; the layer-by-layer search runs only once a problem is seen.
"""
import os

import numpy

from caffeplus import backend, log
from caffeplus.errors import CaffeplusError

MODES = ('stop', 'warn', 'off')
ENV = 'CAFFEPLUS_NAN_CHECK'


class NumericalError(CaffeplusError):
    """A NaN or Inf in the loss or a gradient stopped training."""

    def __init__(self, message, iteration=None, layer=None, what=None):
        super().__init__(message)
        self.iteration = iteration
        self.layer = layer
        self.what = what


def _finite(arr):
    """True when every value of a NumPy/CuPy array is finite."""
    if arr is None or arr.size == 0:
        return True
    xp = backend.get_array_module(arr)
    # A sum of a finite array is finite unless it overflows; checking the
    # sum first is one fast reduction, isfinite().all() confirms.
    s = arr.sum(dtype=numpy.float64) if xp is numpy else xp.sum(arr, dtype=numpy.float64)
    if bool(xp.isfinite(s)):
        return True
    return bool(xp.isfinite(arr).all())


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


def first_forward_problem(net):
    """(layer name, type, description) of the first layer in forward order
    whose top or parameter data is not finite, or None."""
    for i, layer in enumerate(net.layers):
        name = net._layer_names[i]
        for j, blob in enumerate(layer.blobs):
            data = _safe(lambda: blob.data)
            if not _finite(data):
                return name, layer.layer_param.type, 'parameter %d holds %s' % (j, _kind(data))
        for blob_id, top in zip(net.top_id_vecs[i], net.top_vecs[i]):
            data = _safe(lambda: top.data)
            if not _finite(data):
                return name, layer.layer_param.type, "its output '%s' holds %s" % (
                    net._blob_names[blob_id], _kind(data))
    return None


def first_backward_problem(net):
    """(layer name, type, description) of the first layer in backward order
    whose bottom or parameter gradient is not finite, or None."""
    for i in range(len(net.layers) - 1, -1, -1):
        if not net.layer_need_backward[i]:
            continue
        layer = net.layers[i]
        name = net._layer_names[i]
        for k, (blob_id, bottom) in enumerate(zip(net.bottom_id_vecs[i], net.bottom_vecs[i])):
            if not net.bottom_need_backward[i][k]:
                continue
            diff = _safe(lambda: bottom.diff)
            if not _finite(diff):
                return name, layer.layer_param.type, "the gradient of its input '%s' holds %s" % (
                    net._blob_names[blob_id], _kind(diff))
        for j, blob in enumerate(layer.blobs):
            diff = _safe(lambda: blob.diff)
            if not _finite(diff):
                return name, layer.layer_param.type, 'the gradient of its parameter %d holds %s' \
                    % (j, _kind(diff))
    return None


def check_net(net, iteration):
    """None if the train net's loss and gradients are finite, else a
    NumericalError (not raised) saying what, where and when."""
    bad_loss = []
    for blob_id, weight in enumerate(net._blob_loss_weights):
        if weight:
            data = _safe(lambda: net._blobs[blob_id].data)
            if not _finite(data):
                bad_loss.append("'%s' = %s" % (net._blob_names[blob_id], _kind(data)))
    bad_grad = []
    for learnable_id, blob in enumerate(net.learnable_params):
        diff = _safe(lambda: blob.diff)
        if not _finite(diff):
            bad_grad.append(learnable_id)
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
    where = first_forward_problem(net)
    direction = 'forward'
    if where is None:
        where = first_backward_problem(net)
        direction = 'backward'
    if where is not None:
        layer, kind, detail = where
        origin = ("; it first appears in the %s pass at layer '%s' (%s): %s"
                  % (direction, layer, kind, detail))
    else:
        layer = None
        origin = '; the layer where it started could not be found (its blobs were released)'
    message = ('Iteration %d: %s%s. Training stopped before the update, so the weights are '
               'still finite (lower base_lr, clip gradients with clip_gradients, or check the '
               'input data; set %s=warn to train on regardless).'
               % (iteration, ' and '.join(what), origin, ENV))
    return NumericalError(message, iteration, layer, ' and '.join(what))


class NanCheck:
    """A solver callback: checks after the gradients are ready, before the update."""

    def __init__(self, solver, mode='stop'):
        if mode not in MODES:
            raise CaffeplusError("nan check mode must be one of %s, not '%s'"
                                 % (', '.join(MODES), mode))
        self.solver = solver
        self.mode = mode
        self.problems = 0

    def on_start(self):
        pass

    def on_gradients_ready(self):
        if self.mode == 'off':
            return
        error = check_net(self.solver.net, self.solver.iter)
        if error is None:
            return
        self.problems += 1
        if self.mode == 'stop':
            raise error
        log.warning('%s', str(error).replace(
            'Training stopped before the update, so the weights are still finite',
            'Training goes on (%s=warn)' % ENV))


def configured_mode(solver=None, mode=None):
    if mode is None:
        mode = os.environ.get(ENV, '').strip().lower() or None
    if mode is None and solver is not None:
        cp = getattr(solver.param, 'caffeplus_param', None)
        if cp is not None and 'nan_check' in cp.DESCRIPTOR.fields_by_name and \
                cp.HasField('nan_check'):
            mode = cp.nan_check
    mode = mode or 'stop'
    if mode not in MODES:
        raise CaffeplusError("%s must be one of %s, not '%s'" % (ENV, ', '.join(MODES), mode))
    return mode


def install(solver, mode=None):
    """Add the check to `solver` (once); returns the NanCheck (None when off)."""
    for cb in solver.callbacks:
        if isinstance(cb, NanCheck):
            return cb
    mode = configured_mode(solver, mode)
    if mode == 'off':
        return None
    cb = NanCheck(solver, mode)
    solver.add_callback(cb)
    return cb
