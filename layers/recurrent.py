"""Recurrent layers: RNN, LSTM and LSTMUnit.

Stock Caffe builds RNN and LSTM as an internal "unrolled" net of
InnerProduct/Eltwise/Scale/TanH/LSTMUnit layers, one group per time step.
Here the same recurrences are computed directly: the input-to-hidden
products for all time steps are one matrix product, and only the
hidden-to-hidden part loops over time. The numbers, the parameter blobs
(order and shapes) and the gradient rules are Caffe's:

Bottoms: x (T, N, ...), cont (T, N), optional x_static (N, ...), and with
recurrent_param.expose_hidden the initial states (h0 for RNN; h0, c0 for
LSTM, each (1, N, num_output)). Tops: the sequence output (T, N, num_output)
and, with expose_hidden, the final states (hT; hT, cT).

  LSTM  gates_t = W_xc x_t + b_c [+ W_xc_static x_static] + W_hc (cont_t h_{t-1})
        laid out as [i, f, o, g] blocks of num_output each;
        i, o = sigmoid; f = cont_t * sigmoid; g = tanh
        c_t = f * c_{t-1} + i * g;  h_t = o * tanh(c_t);  top = h
        params: W_xc (4H, D), b_c (4H), [W_xc_static (4H, Ds)], W_hc (4H, H)
  RNN   h_t = tanh(W_xh x_t + b_h [+ W_xh_static x_static] + W_hh (cont_t h_{t-1}))
        o_t = tanh(W_ho h_t + b_o);  top = o
        params: W_xh (H, D), b_h (H), [W_xh_static (H, Ds)], W_hh (H, H),
                W_ho (H, H), b_o (H)

Behaviours kept from Caffe on purpose:
  * Without expose_hidden, the final states of one forward are the initial
    states of the next (zeros before the first forward, and again whenever
    the batch shape changes); a sequence start (cont = 0) cuts them off.
  * No gradient ever reaches cont (its bottom refuses force_backward), nor
    the exposed h0/c0 bottoms (they read as a zero diff), and the diffs put
    on the exposed hT/cT tops are ignored: Caffe shares only their data.
    Gradients do not flow across forward calls.
  * Parameter diffs accumulate (+=); bottom diffs are overwritten.
  * LSTMUnit's forget-gate derivative is Caffe's CPU rule f * (1 - f) with
    f = cont * sigmoid(.), which is the exact derivative for the 0/1 cont
    values sequences use.
"""
import numpy

from caffeplus import backend
from caffeplus.blob import Blob
from caffeplus.errors import NetError
from caffeplus.fillers import fill
from caffeplus.layer import Layer, register

FLOAT = numpy.float32


# -- shared math ---------------------------------------------------------------
def _sigmoid(xp, x):
    if xp is numpy:
        with numpy.errstate(over='ignore'):
            return 1.0 / (1.0 + numpy.exp(-x))
    return 1.0 / (1.0 + xp.exp(-x))


def _lstm_cell(xp, c_prev, gates, cont, acts=None):
    """One LSTM step for a batch: c_prev (N, H), gates (N, 4H), cont (N,).

    Returns (acts, c, tanh_c, h) where acts (N, 4H, written into `acts` when
    given) holds i, f, o, g, f already multiplied by cont."""
    hdim = c_prev.shape[-1]
    if acts is None:
        acts = xp.empty_like(gates)
    acts[:, :3 * hdim] = _sigmoid(xp, gates[:, :3 * hdim])
    acts[:, hdim:2 * hdim] *= cont[:, None]
    acts[:, 3 * hdim:] = xp.tanh(gates[:, 3 * hdim:])
    i = acts[:, :hdim]
    f = acts[:, hdim:2 * hdim]
    o = acts[:, 2 * hdim:3 * hdim]
    g = acts[:, 3 * hdim:]
    c = f * c_prev + i * g
    tanh_c = xp.tanh(c)
    h = o * tanh_c
    return acts, c, tanh_c, h


def _lstm_cell_backward(xp, acts, c_prev, tanh_c, dc, dh, dgates):
    """Backward of _lstm_cell: fills dgates (N, 4H) with the pre-activation
    diffs and returns the diff for c_prev. dc, dh: diffs of c and h."""
    hdim = c_prev.shape[-1]
    i = acts[:, :hdim]
    f = acts[:, hdim:2 * hdim]
    o = acts[:, 2 * hdim:3 * hdim]
    g = acts[:, 3 * hdim:]
    c_term = dc + dh * o * (1 - tanh_c * tanh_c)
    dgates[:, :hdim] = c_term * g * i * (1 - i)
    dgates[:, hdim:2 * hdim] = c_term * c_prev * f * (1 - f)
    dgates[:, 2 * hdim:3 * hdim] = dh * tanh_c * o * (1 - o)
    dgates[:, 3 * hdim:] = c_term * i * (1 - g * g)
    return c_term * f


def _shape_str(shape):
    return '(%s)' % ', '.join(str(int(d)) for d in shape)


# -- RNN and LSTM ------------------------------------------------------------------
class _RecurrentLayer(Layer):
    """What RNN and LSTM share: bottoms/tops, parameters, state carry-over."""
    # Caffe's names for the recurrent state blobs (for messages).
    state_names = ()
    backward_reads = frozenset(('bottom_data',))

    def __init__(self, layer_param):
        super().__init__(layer_param)
        rp = self.layer_param.recurrent_param
        self.expose_hidden = bool(rp.expose_hidden)
        nrec = len(self.state_names) if self.expose_hidden else 0
        self.min_num_bottom = 2 + nrec
        self.max_num_bottom = 3 + nrec
        self.exact_num_top = 1 + nrec
        self._carry = None      # carried states (tuple of (N, H) arrays)
        self._saved = None      # what the last forward kept for backward

    # -- parameters ------------------------------------------------------------
    def _fail(self, what):
        raise NetError('layer %s (%s): %s' % (self.name, self.layer_param.type, what))

    def allow_force_backward(self, bottom_index):
        # The sequence-continuation flags never take a gradient.
        return bottom_index != 1

    def _input_gradients(self, d, x2, xs2, h_cont, recurrent, propagate_down, bottom):
        """From d (steps, N, G), the gradient of the pre-activations that
        W_x x + b (+ W_s x_static) + W_h h_cont feed: the gradients of those
        weights (blob `recurrent` is W_h) and of the inputs x and x_static."""
        steps, num = d.shape[0], d.shape[1]
        d2 = d.reshape(steps * num, d.shape[2])
        if self.param_needs_backward(0):
            self.blobs[0].diff[...] += d2.T @ x2
        if self.param_needs_backward(1):
            self.blobs[1].diff[...] += d2.sum(axis=0)
        if self.param_needs_backward(recurrent):
            self.blobs[recurrent].diff[...] += d2.T @ h_cont.reshape(steps * num, -1)
        if self.static_input and (self.param_needs_backward(2) or propagate_down[2]):
            dsum = d.sum(axis=0)
            if self.param_needs_backward(2):
                self.blobs[2].diff[...] += dsum.T @ xs2
            if propagate_down[2]:
                bottom[2].diff[...] = (dsum @ self.blobs[2].data).reshape(bottom[2].shape)
        if propagate_down[0]:
            bottom[0].diff[...] = (d2 @ self.blobs[0].data).reshape(bottom[0].shape)

    def param_specs(self, hdim, in_dim, static_dim):
        """[(Caffe's name, shape, 'weight' or 'bias')] in blob order."""
        raise NotImplementedError

    def layer_setup(self, bottom, top):
        rp = self.layer_param.recurrent_param
        self.num_output = int(rp.num_output)
        if self.num_output <= 0:
            self._fail('recurrent_param.num_output must be positive (got %d)' % self.num_output)
        x = bottom[0]
        if x.num_axes < 2:
            self._fail('bottom 0 (x) must have at least 2 axes (T, N, ...), got shape %s'
                       % _shape_str(x.shape))
        nrec = len(self.state_names) if self.expose_hidden else 0
        self.static_input = len(bottom) > 2 + nrec
        self.input_dim = x.count_axes(2)
        self.static_dim = None
        if self.static_input:
            xs = bottom[2]
            if xs.num_axes < 1:
                self._fail('bottom 2 (static input) must have at least 1 axis (N, ...)')
            self.static_dim = xs.count_axes(1)
        specs = self.param_specs(self.num_output, self.input_dim, self.static_dim)
        self.param_names = [s[0] for s in specs]
        if self.blobs:
            if len(self.blobs) != len(specs):
                self._fail('expected %d parameter blobs (%s), got %d'
                           % (len(specs), ', '.join(self.param_names), len(self.blobs)))
            for b, (pname, shape, _) in zip(self.blobs, specs):
                if tuple(b.shape) != tuple(shape):
                    self._fail('parameter %s has shape %s, expected %s'
                               % (pname, _shape_str(b.shape), _shape_str(shape)))
        else:
            for k, (pname, shape, kind) in enumerate(specs):
                field = 'weight_filler' if kind == 'weight' else 'bias_filler'
                b = Blob(shape, name='%s.%d' % (self.name, k))
                try:
                    fill(b, getattr(rp, field))
                except NetError as exc:
                    self._fail('recurrent_param.%s: %s' % (field, exc))
                self.blobs.append(b)

    def reshape(self, bottom, top):
        x, cont = bottom[0], bottom[1]
        if x.num_axes < 2:
            self._fail('bottom 0 (x) must have at least 2 axes (T, N, ...), got shape %s'
                       % _shape_str(x.shape))
        steps, num = x.shape[0], x.shape[1]
        if x.count_axes(2) != self.input_dim:
            self._fail('bottom 0 (x) has %d values per time step and stream; the parameters '
                       'were made for %d' % (x.count_axes(2), self.input_dim))
        if tuple(cont.shape) != (steps, num):
            self._fail('bottom 1 (cont) must have shape (T, N) = %s, got %s'
                       % (_shape_str((steps, num)), _shape_str(cont.shape)))
        offset = 2
        if self.static_input:
            xs = bottom[2]
            if xs.num_axes < 1 or xs.shape[0] != num or xs.count_axes(1) != self.static_dim:
                self._fail('bottom 2 (static input) must have shape (N, ...) with N = %d and '
                           '%d values per stream, got %s'
                           % (num, self.static_dim, _shape_str(xs.shape)))
            offset = 3
        state_shape = (1, num, self.num_output)
        if self.expose_hidden:
            for k, sname in enumerate(self.state_names):
                b = bottom[offset + k]
                if tuple(b.shape) != state_shape:
                    self._fail('bottom %d (initial state %s) must have shape %s, got %s'
                               % (offset + k, sname, _shape_str(state_shape),
                                  _shape_str(b.shape)))
        top[0].reshape((steps, num, self.num_output))
        for t in top[1:]:
            t.reshape(state_shape)

    # -- helpers ---------------------------------------------------------------
    def _inputs(self, bottom):
        """(x2d, cont, xs2d or None, [initial state blobs])."""
        x = bottom[0].data
        steps, num = x.shape[0], x.shape[1]
        x2 = x.reshape(steps * num, self.input_dim)
        cont = bottom[1].data
        xs2 = None
        offset = 2
        if self.static_input:
            xs2 = bottom[2].data.reshape(num, self.static_dim)
            offset = 3
        return x2, cont, xs2, bottom[offset:]

    def _initial_states(self, xp, bottom_states, num):
        """The h0 (and c0) of this forward, each (N, H)."""
        shape = (num, self.num_output)
        if self.expose_hidden:
            return [b.data.reshape(shape) for b in bottom_states]
        carry = self._carry
        if carry is None or any(s.shape != shape or backend.get_array_module(s) is not xp
                                for s in carry):
            carry = [xp.zeros(shape, dtype=FLOAT) for _ in self.state_names]
        return carry

    def _clear_state_diffs(self, propagate_down, bottom):
        # Caffe shares only the data of h0/c0 with its unrolled net, so no
        # gradient reaches them; they read as zero.
        offset = 3 if self.static_input else 2
        for k in range(offset, len(bottom)):
            if propagate_down[k]:
                bottom[k].diff[...] = 0

    def _check_cont_backward(self, propagate_down):
        if len(propagate_down) > 1 and propagate_down[1]:
            self._fail('cannot back-propagate to the sequence continuation indicators '
                       '(bottom 1, cont)')

    def reset_state(self):
        """Forget the states carried between forwards (start from zeros)."""
        self._carry = None


@register
class LSTMLayer(_RecurrentLayer):
    type = 'LSTM'
    state_names = ('h_0', 'c_0')

    def param_specs(self, hdim, in_dim, static_dim):
        specs = [('W_xc', (4 * hdim, in_dim), 'weight'), ('b_c', (4 * hdim,), 'bias')]
        if static_dim is not None:
            specs.append(('W_xc_static', (4 * hdim, static_dim), 'weight'))
        specs.append(('W_hc', (4 * hdim, hdim), 'weight'))
        return specs

    def _forward(self, bottom, top):
        x2, cont, xs2, state_blobs = self._inputs(bottom)
        xp = backend.get_array_module(x2)
        steps, num = bottom[0].shape[0], bottom[0].shape[1]
        hdim = self.num_output
        w_x, b = self.blobs[0].data, self.blobs[1].data
        w_h = self.blobs[-1].data
        pre_x = (x2 @ w_x.T + b).reshape(steps, num, 4 * hdim)
        pre_s = xs2 @ self.blobs[2].data.T if self.static_input else None
        h_prev, c_prev = self._initial_states(xp, state_blobs, num)

        acts = xp.empty((steps, num, 4 * hdim), dtype=FLOAT)
        cells = xp.empty((steps + 1, num, hdim), dtype=FLOAT)   # c_0 .. c_T
        tanh_c = xp.empty((steps, num, hdim), dtype=FLOAT)
        h_cont = xp.empty((steps, num, hdim), dtype=FLOAT)      # cont_t * h_{t-1}
        out = top[0].data
        cells[0] = c_prev
        for t in range(steps):
            h_cont[t] = cont[t][:, None] * h_prev
            gates = h_cont[t] @ w_h.T + pre_x[t]
            if pre_s is not None:
                gates += pre_s
            _, c, tc, h = _lstm_cell(xp, cells[t], gates, cont[t], acts[t])
            cells[t + 1] = c
            tanh_c[t] = tc
            out[t] = h
            h_prev = out[t]
        h_last = out[steps - 1].copy() if steps else h_prev.copy()
        c_last = cells[steps].copy()
        if self.expose_hidden:
            top[1].data[...] = h_last.reshape(top[1].shape)
            top[2].data[...] = c_last.reshape(top[2].shape)
        else:
            self._carry = [h_last, c_last]
        self._saved = (acts, cells, tanh_c, h_cont)

    def _backward(self, top, propagate_down, bottom):
        self._check_cont_backward(propagate_down)
        self._clear_state_diffs(propagate_down, bottom)
        if self._saved is None:
            self._fail('backward called before forward')
        acts, cells, tanh_c, h_cont = self._saved
        x2, cont, xs2, _ = self._inputs(bottom)
        xp = backend.get_array_module(x2)
        steps, num = acts.shape[0], acts.shape[1]
        hdim = self.num_output
        w_h = self.blobs[-1].data
        top_diff = top[0].diff
        dgates = xp.empty((steps, num, 4 * hdim), dtype=FLOAT)
        dh_next = xp.zeros((num, hdim), dtype=FLOAT)
        dc_next = xp.zeros((num, hdim), dtype=FLOAT)
        for t in range(steps - 1, -1, -1):
            dh = top_diff[t] + dh_next
            dc_next = _lstm_cell_backward(xp, acts[t], cells[t], tanh_c[t], dc_next, dh,
                                          dgates[t])
            if t > 0:
                dh_next = (dgates[t] @ w_h) * cont[t][:, None]
        self._input_gradients(dgates, x2, xs2, h_cont, len(self.blobs) - 1, propagate_down,
                              bottom)


@register
class RNNLayer(_RecurrentLayer):
    type = 'RNN'
    state_names = ('h_0',)

    def param_specs(self, hdim, in_dim, static_dim):
        specs = [('W_xh', (hdim, in_dim), 'weight'), ('b_h', (hdim,), 'bias')]
        if static_dim is not None:
            specs.append(('W_xh_static', (hdim, static_dim), 'weight'))
        specs += [('W_hh', (hdim, hdim), 'weight'), ('W_ho', (hdim, hdim), 'weight'),
                  ('b_o', (hdim,), 'bias')]
        return specs

    def _forward(self, bottom, top):
        x2, cont, xs2, state_blobs = self._inputs(bottom)
        xp = backend.get_array_module(x2)
        steps, num = bottom[0].shape[0], bottom[0].shape[1]
        hdim = self.num_output
        k = 3 if self.static_input else 2
        w_hh, w_ho, b_o = self.blobs[k].data, self.blobs[k + 1].data, self.blobs[k + 2].data
        pre_x = (x2 @ self.blobs[0].data.T + self.blobs[1].data).reshape(steps, num, hdim)
        pre_s = xs2 @ self.blobs[2].data.T if self.static_input else None
        (h_prev,) = self._initial_states(xp, state_blobs, num)

        hidden = xp.empty((steps, num, hdim), dtype=FLOAT)
        h_cont = xp.empty((steps, num, hdim), dtype=FLOAT)
        for t in range(steps):
            h_cont[t] = cont[t][:, None] * h_prev
            a = h_cont[t] @ w_hh.T + pre_x[t]
            if pre_s is not None:
                a += pre_s
            hidden[t] = xp.tanh(a)
            h_prev = hidden[t]
        h2 = hidden.reshape(steps * num, hdim)
        out = xp.tanh(h2 @ w_ho.T + b_o)
        top[0].data[...] = out.reshape(top[0].shape)
        h_last = h_prev.copy()
        if self.expose_hidden:
            top[1].data[...] = h_last.reshape(top[1].shape)
        else:
            self._carry = [h_last]
        self._saved = (hidden, h_cont, out)

    def _backward(self, top, propagate_down, bottom):
        self._check_cont_backward(propagate_down)
        self._clear_state_diffs(propagate_down, bottom)
        if self._saved is None:
            self._fail('backward called before forward')
        hidden, h_cont, out = self._saved
        x2, cont, xs2, _ = self._inputs(bottom)
        xp = backend.get_array_module(x2)
        steps, num, hdim = hidden.shape
        k = 3 if self.static_input else 2
        w_hh, w_ho = self.blobs[k].data, self.blobs[k + 1].data
        h2 = hidden.reshape(steps * num, hdim)
        d_o = top[0].diff.reshape(steps * num, hdim) * (1 - out * out)
        if self.param_needs_backward(k + 1):
            self.blobs[k + 1].diff[...] += d_o.T @ h2
        if self.param_needs_backward(k + 2):
            self.blobs[k + 2].diff[...] += d_o.sum(axis=0)
        dh_out = (d_o @ w_ho).reshape(steps, num, hdim)
        da = xp.empty((steps, num, hdim), dtype=FLOAT)
        dh_next = xp.zeros((num, hdim), dtype=FLOAT)
        for t in range(steps - 1, -1, -1):
            dh = dh_out[t] + dh_next
            da[t] = dh * (1 - hidden[t] * hidden[t])
            if t > 0:
                dh_next = (da[t] @ w_hh) * cont[t][:, None]
        self._input_gradients(da, x2, xs2, h_cont, k, propagate_down, bottom)


# -- LSTMUnit ------------------------------------------------------------------------
@register
class LSTMUnitLayer(Layer):
    """One LSTM step: bottoms c_prev (1, N, H), gates (1, N, 4H), cont (1, N);
    tops c (1, N, H), h (1, N, H). Gate blocks [i, f, o, g]."""
    type = 'LSTMUnit'
    exact_num_bottom = 3
    exact_num_top = 2
    backward_reads = frozenset(('bottom_data',))

    def allow_force_backward(self, bottom_index):
        return bottom_index != 2

    def _fail(self, what):
        raise NetError('layer %s (LSTMUnit): %s' % (self.name, what))

    def reshape(self, bottom, top):
        c_prev, gates, cont = bottom
        for k, (b, axes) in enumerate(((c_prev, 3), (gates, 3), (cont, 2))):
            if b.num_axes != axes:
                self._fail('bottom %d must have %d axes, got shape %s'
                           % (k, axes, _shape_str(b.shape)))
            if b.shape[0] != 1:
                self._fail('bottom %d must hold a single time step (first axis 1), got shape %s'
                           % (k, _shape_str(b.shape)))
            if b.shape[1] != c_prev.shape[1]:
                self._fail('bottom %d has %d streams, bottom 0 has %d'
                           % (k, b.shape[1], c_prev.shape[1]))
        if gates.shape[2] != 4 * c_prev.shape[2]:
            self._fail('bottom 1 (gates) must have 4 * %d = %d channels, got %d'
                       % (c_prev.shape[2], 4 * c_prev.shape[2], gates.shape[2]))
        top[0].reshape(c_prev.shape)
        top[1].reshape(c_prev.shape)

    def _forward(self, bottom, top):
        c_prev = bottom[0].data[0]
        xp = backend.get_array_module(c_prev)
        _, c, _, h = _lstm_cell(xp, c_prev, bottom[1].data[0], bottom[2].data[0])
        top[0].data[0] = c
        top[1].data[0] = h

    def _backward(self, top, propagate_down, bottom):
        if propagate_down[2]:
            self._fail('cannot back-propagate to the sequence continuation indicators '
                       '(bottom 2, cont)')
        if not (propagate_down[0] or propagate_down[1]):
            return
        c_prev = bottom[0].data[0]
        xp = backend.get_array_module(c_prev)
        acts, _, tanh_c, _ = _lstm_cell(xp, c_prev, bottom[1].data[0], bottom[2].data[0])
        dgates = xp.empty_like(acts)
        dc_prev = _lstm_cell_backward(xp, acts, c_prev, tanh_c, top[0].diff[0],
                                      top[1].diff[0], dgates)
        if propagate_down[0]:
            bottom[0].diff[0] = dc_prev
        if propagate_down[1]:
            bottom[1].diff[0] = dgates
