"""Neuron layers: one bottom, one top of the same shape, element by element.

ReLU, PReLU, ELU, Sigmoid, TanH, AbsVal, BNLL, Power, Exp, Log, Threshold,
Clip, Swish and Dropout, with Caffe's arithmetic (its order of float32
operations, its special cases) so results match stock Caffe.

In place (top is bottom) every layer computes what Caffe computes. Where a
backward needs the original bottom and Caffe would read the overwritten one
(AbsVal, BNLL, Log, Clip, Power with bottom reads, ReLU/ELU with a negative
slope/alpha), the layer says `inplace_ok = False` so the memory planner never
makes it in place by itself; a net written in place still runs, as in Caffe.
PReLU keeps its own copy of the bottom when in place, as Caffe does.

`backward_reads` is as narrow as the math allows: ReLU with a non-negative
slope and ELU with a non-negative alpha decide the branch from the top
(top > 0 exactly where bottom > 0), so their bottoms need not be kept.
"""
import numpy

from caffeplus import backend, rng
from caffeplus.blob import Blob, same_data, same_diff
from caffeplus.fillers import fill
from caffeplus.functions import keep_in
from caffeplus.layer import NeuronLayer, layer_error, register
from caffeplus.proto import caffe_pb2

F32 = numpy.float32
NO_READS = frozenset()
READS_BOTTOM = frozenset(('bottom_data',))
READS_TOP = frozenset(('top_data',))
READS_BOTH = frozenset(('bottom_data', 'top_data'))


def _xp(a):
    return backend.get_array_module(a)


def _fail(layer, message):
    raise layer_error(layer, message)






@register
class ReLULayer(NeuronLayer):
    """top = max(x, 0) + negative_slope * min(x, 0)."""
    type = 'ReLU'
    layout_role = 'pointwise'     # (caffeplus.layout: any order of values)

    def __init__(self, layer_param):
        super().__init__(layer_param)
        self.slope = F32(self.layer_param.relu_param.negative_slope)
        if self.slope >= 0:
            # With slope >= 0, top > 0 exactly where bottom > 0: read the top.
            self.backward_reads = READS_TOP
        else:
            self.backward_reads = READS_BOTTOM
            self.inplace_ok = False

    def _forward(self, bottom, top):
        x, y = bottom[0].data, top[0].data
        xp = _xp(x)
        if self.slope == 0:
            xp.maximum(x, 0, out=y)
        else:
            y[...] = xp.where(x > 0, x, x * self.slope)

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        ref = top[0].data if self.slope >= 0 else bottom[0].data
        dy = top[0].diff
        xp = _xp(dy)
        if self.slope == 0:
            # Caffe's dy * (x > 0), written in place without temporaries.
            xp.multiply(dy, ref > 0, out=bottom[0].diff)
        else:
            bottom[0].diff[...] = xp.where(ref > 0, dy, dy * self.slope)


@register
class PReLULayer(NeuronLayer):
    """ReLU with a learned slope per channel (axis 1), or one shared slope."""
    type = 'PReLU'
    backward_reads = READS_BOTTOM

    def layer_setup(self, bottom, top):
        p = self.layer_param.prelu_param
        if bottom[0].num_axes < 2:
            _fail(self, 'the bottom needs at least 2 axes (got shape %s)'
                  % bottom[0].shape_string())
        self.channel_shared = p.channel_shared
        channels = bottom[0].shape[1]
        want = 1 if self.channel_shared else channels
        if self.blobs:
            if len(self.blobs) != 1 or self.blobs[0].count != want:
                _fail(self, 'expected one slope blob of %d value(s), found %s'
                      % (want, [b.shape_string() for b in self.blobs]))
        else:
            if p.HasField('filler'):
                filler = p.filler
            else:
                filler = caffe_pb2.FillerParameter(type='constant', value=0.25)
            shape = () if self.channel_shared else (channels,)
            blob = Blob(shape, name='%s.0' % self.name)
            fill(blob, filler)
            self.blobs.append(blob)
        self._bottom_copy = None

    def reshape(self, bottom, top):
        if bottom[0].num_axes < 2:
            _fail(self, 'the bottom needs at least 2 axes (got shape %s)'
                  % bottom[0].shape_string())
        if not self.channel_shared and bottom[0].shape[1] != self.blobs[0].count:
            _fail(self, 'bottom has %d channels but the slope blob has %d values'
                  % (bottom[0].shape[1], self.blobs[0].count))
        super().reshape(bottom, top)
        # In place, the bottom is kept for backward in a buffer the memory
        # plan places, and backward reads that, not the blob.
        in_place = same_data(bottom[0], top[0])
        self._kept = {'bottom_copy': (bottom[0].count, bottom[0].data_storage.dtype)} \
            if in_place else {}
        self.backward_reads = NO_READS if in_place else READS_BOTTOM

    def internal_buffers(self):
        return getattr(self, '_kept', {})

    def forget_kept_buffers(self):
        """caffeplus.memory.scratch.forget: the kept bottom copy is dead."""
        self._bottom_copy = None

    def _slope(self, ndim):
        s = self.blobs[0].data
        if self.channel_shared:
            return s.reshape(())
        return s.reshape((1, -1) + (1,) * (ndim - 2))

    def _forward(self, bottom, top):
        x = bottom[0].data
        xp = _xp(x)
        if same_data(bottom[0], top[0]):
            # In place: keep the bottom for backward, as Caffe does.
            self._bottom_copy = keep_in(self, 'bottom_copy', x)
        else:
            self._bottom_copy = None
        top[0].data[...] = xp.where(x > 0, x, x * self._slope(x.ndim))

    def _backward(self, top, propagate_down, bottom):
        x = self._bottom_copy if self._bottom_copy is not None else bottom[0].data
        dy = top[0].diff
        xp = _xp(dy)
        if self.param_needs_backward(0):
            contrib = dy * x * (x <= 0)
            if self.channel_shared:
                g = contrib.sum()
            else:
                axes = (0,) + tuple(range(2, x.ndim))
                g = contrib.sum(axis=axes)
            self.blobs[0].diff[...] += g.reshape(self.blobs[0].shape)
        if propagate_down[0]:
            bottom[0].diff[...] = xp.where(x > 0, dy, dy * self._slope(x.ndim))


@register
class ELULayer(NeuronLayer):
    """top = x for x > 0, alpha * (exp(x) - 1) otherwise."""
    type = 'ELU'

    def __init__(self, layer_param):
        super().__init__(layer_param)
        self.alpha = F32(self.layer_param.elu_param.alpha)
        if self.alpha >= 0:
            # top > 0 exactly where bottom > 0, so the top alone decides.
            self.backward_reads = READS_TOP
        else:
            self.backward_reads = READS_BOTH
            self.inplace_ok = False

    def _forward(self, bottom, top):
        x = bottom[0].data
        xp = _xp(x)
        neg = xp.exp(xp.minimum(x, F32(0)))
        neg -= F32(1)
        neg *= self.alpha
        neg += xp.maximum(x, F32(0))
        top[0].data[...] = neg

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y, dy = top[0].data, top[0].diff
        xp = _xp(y)
        positive = (y > 0) if self.alpha >= 0 else (bottom[0].data > 0)
        bottom[0].diff[...] = xp.where(positive, dy, dy * (y + self.alpha))


def _sigmoid(x):
    # Caffe's formula: 0.5 * tanh(0.5 * x) + 0.5 (no overflow for any x).
    xp = _xp(x)
    s = xp.tanh(x * F32(0.5))
    s *= F32(0.5)
    s += F32(0.5)
    return s


@register
class SigmoidLayer(NeuronLayer):
    type = 'Sigmoid'
    backward_reads = READS_TOP

    def _forward(self, bottom, top):
        top[0].data[...] = _sigmoid(bottom[0].data)

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y = top[0].data
        bottom[0].diff[...] = top[0].diff * y * (F32(1) - y)


@register
class TanHLayer(NeuronLayer):
    type = 'TanH'
    backward_reads = READS_TOP

    def _forward(self, bottom, top):
        x = bottom[0].data
        _xp(x).tanh(x, out=top[0].data)

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y = top[0].data
        bottom[0].diff[...] = top[0].diff * (F32(1) - y * y)


@register
class AbsValLayer(NeuronLayer):
    type = 'AbsVal'
    backward_reads = READS_BOTTOM
    inplace_ok = False      # backward needs the sign of the original bottom

    def _forward(self, bottom, top):
        x = bottom[0].data
        _xp(x).abs(x, out=top[0].data)

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = bottom[0].data
        bottom[0].diff[...] = top[0].diff * _xp(x).sign(x)


@register
class BNLLLayer(NeuronLayer):
    """top = log(1 + exp(x)), computed without overflow."""
    type = 'BNLL'
    backward_reads = READS_BOTTOM
    inplace_ok = False
    THRESHOLD = F32(50)

    def _forward(self, bottom, top):
        x = bottom[0].data
        xp = _xp(x)
        # x > 0: x + log(1 + exp(-x)); else log(1 + exp(x)); i.e. max(x,0) + log1p(exp(-|x|)).
        y = xp.log1p(xp.exp(-xp.abs(x)))
        y += xp.maximum(x, F32(0))
        top[0].data[...] = y

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = bottom[0].data
        xp = _xp(x)
        e = xp.exp(xp.minimum(x, self.THRESHOLD))
        bottom[0].diff[...] = top[0].diff * (e / (e + F32(1)))


@register
class PowerLayer(NeuronLayer):
    """top = (shift + scale * x) ^ power, with Caffe's special cases."""
    type = 'Power'

    def __init__(self, layer_param):
        super().__init__(layer_param)
        p = self.layer_param.power_param
        self.power, self.scale, self.shift = F32(p.power), F32(p.scale), F32(p.shift)
        self.diff_scale = F32(self.power * self.scale)
        if self.diff_scale == 0 or self.power == 1:
            self.backward_reads = NO_READS
        elif self.power == 2:
            self.backward_reads = READS_BOTTOM
            self.inplace_ok = False
        else:
            self.backward_reads = READS_BOTH
            self.inplace_ok = False

    def _forward(self, bottom, top):
        y = top[0].data
        if self.diff_scale == 0:
            y[...] = F32(1) if self.power == 0 else F32(self.shift ** self.power)
            return
        x = bottom[0].data
        xp = _xp(x)
        t = x * self.scale if self.scale != 1 else x.copy()
        if self.shift != 0:
            t += self.shift
        if self.power != 1:
            t = xp.power(t, self.power)
        y[...] = t

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].diff
        if self.diff_scale == 0:
            dx[...] = 0
            return
        dy = top[0].diff
        if self.power == 1:
            dx[...] = dy * self.diff_scale
            return
        x = bottom[0].data
        if self.power == 2:
            # d/dx = 2 * scale * (shift + scale * x)
            g = x * F32(self.diff_scale * self.scale)
            if self.shift != 0:
                g += F32(self.diff_scale * self.shift)
        elif self.shift == 0:
            # d/dx = power * y / x
            g = top[0].data / x
            g *= self.power
        else:
            # d/dx = diff_scale * y / (shift + scale * x)
            g = x * self.scale if self.scale != 1 else x.copy()
            g += self.shift
            g = top[0].data / g
            if self.diff_scale != 1:
                g *= self.diff_scale
        dx[...] = dy * g


def _log_base(layer, base, field, allow_zero):
    """log(base) in float32, 1 for base -1 (meaning e); bad bases are refused."""
    if base == -1:
        return F32(1)
    if not base > 0:
        _fail(layer, '%s.base must be strictly positive, or -1 for e (got %g)' % (field, base))
    log_base = numpy.log(F32(base))
    if not numpy.isfinite(log_base) or (log_base == 0 and not allow_zero):
        _fail(layer, '%s.base %g gives log(base) = %g' % (field, base, log_base))
    return log_base


@register
class ExpLayer(NeuronLayer):
    """top = base ^ (shift + scale * x); base -1 means e."""
    type = 'Exp'
    backward_reads = READS_TOP

    def __init__(self, layer_param):
        super().__init__(layer_param)
        p = self.layer_param.exp_param
        base = F32(p.base)
        log_base = _log_base(self, base, 'exp_param', allow_zero=True)
        scale, shift = F32(p.scale), F32(p.shift)
        self.inner_scale = F32(log_base * scale)
        if shift == 0:
            self.outer_scale = F32(1)
        elif base == -1:
            self.outer_scale = F32(numpy.exp(shift))
        else:
            self.outer_scale = F32(base ** shift)

    def _forward(self, bottom, top):
        x = bottom[0].data
        xp = _xp(x)
        y = top[0].data
        if self.inner_scale == 1:
            xp.exp(x, out=y)
        else:
            xp.exp(x * self.inner_scale, out=y)
        if self.outer_scale != 1:
            y *= self.outer_scale

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        g = top[0].data * top[0].diff
        if self.inner_scale != 1:
            g *= self.inner_scale
        bottom[0].diff[...] = g


@register
class LogLayer(NeuronLayer):
    """top = log_base(shift + scale * x); base -1 means e."""
    type = 'Log'
    backward_reads = READS_BOTTOM
    inplace_ok = False

    def __init__(self, layer_param):
        super().__init__(layer_param)
        p = self.layer_param.log_param
        log_base = _log_base(self, F32(p.base), 'log_param', allow_zero=False)
        self.base_scale = F32(F32(1) / log_base)
        self.input_scale, self.input_shift = F32(p.scale), F32(p.shift)
        self.backward_num_scale = F32(self.input_scale / log_base)

    def _shifted(self, x):
        t = x * self.input_scale if self.input_scale != 1 else x.copy()
        if self.input_shift != 0:
            t += self.input_shift
        return t

    def _forward(self, bottom, top):
        x = bottom[0].data
        xp = _xp(x)
        y = top[0].data
        if self.input_scale == 1 and self.input_shift == 0:
            xp.log(x, out=y)
        else:
            y[...] = xp.log(self._shifted(x))
        if self.base_scale != 1:
            y *= self.base_scale

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        g = F32(1) / self._shifted(bottom[0].data)
        if self.backward_num_scale != 1:
            g *= self.backward_num_scale
        bottom[0].diff[...] = top[0].diff * g


@register
class ThresholdLayer(NeuronLayer):
    """top = 1 where x > threshold, else 0. No backward (as in Caffe)."""
    type = 'Threshold'
    backward_reads = NO_READS
    has_backward = False

    def _forward(self, bottom, top):
        thr = F32(self.layer_param.threshold_param.threshold)
        top[0].data[...] = bottom[0].data > thr


@register
class ClipLayer(NeuronLayer):
    """top = max(min, min(x, max)); the gradient passes where min <= x <= max."""
    type = 'Clip'
    backward_reads = READS_BOTTOM
    inplace_ok = False

    def __init__(self, layer_param):
        super().__init__(layer_param)
        p = self.layer_param.clip_param
        for field in ('min', 'max'):
            if not p.HasField(field):
                _fail(self, 'clip_param.%s is required' % field)
        self.min, self.max = F32(p.min), F32(p.max)

    def _forward(self, bottom, top):
        x = bottom[0].data
        xp = _xp(x)
        y = top[0].data
        xp.minimum(x, self.max, out=y)
        xp.maximum(y, self.min, out=y)

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = bottom[0].data
        inside = (x >= self.min) & (x <= self.max)
        bottom[0].diff[...] = top[0].diff * inside


@register
class SwishLayer(NeuronLayer):
    """top = x * sigmoid(beta * x); keeps the sigmoid for backward, as Caffe does."""
    type = 'Swish'
    backward_reads = READS_TOP

    def __init__(self, layer_param):
        super().__init__(layer_param)
        self.beta = F32(self.layer_param.swish_param.beta)
        self._sig = None

    def _forward(self, bottom, top):
        x = bottom[0].data
        s = _sigmoid(x * self.beta)
        self._sig = s
        xp = _xp(x)
        xp.multiply(x, s, out=top[0].data)

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        by = top[0].data * self.beta
        s = self._sig
        g = s * (F32(1) - by)
        g += by
        bottom[0].diff[...] = top[0].diff * g


_gpu_rng = {'source': None, 'state': None, 'philox': None, 'philox_source': None}


def _philox_state():
    """The fused Dropout kernels' device state [seed, offset] (uint64; the
    kernels move the offset on the device), seeded from caffeplus.rng and
    again when its seed is reset."""
    from caffeplus import kernels
    g = rng.get()
    state = _gpu_rng['philox']
    if state is None or _gpu_rng['philox_source'] is not g or \
            (kernels.emulating() != isinstance(state, numpy.ndarray)):
        seed = numpy.array([g.integers(0, 2 ** 63 - 1), 0], numpy.uint64)
        xp = kernels.array_module()
        state = _gpu_rng['philox'] = xp.asarray(seed)
        _gpu_rng['philox_source'] = g
    return state


def _uniform(shape, xp):
    """Uniform [0, 1) float32 numbers of `shape` in array module xp.

    On the CPU they come straight from caffeplus.rng; on the GPU from a CuPy
    generator seeded from caffeplus.rng (reseeded when the seed is reset)."""
    g = rng.get()
    if xp is numpy:
        return g.random(size=shape, dtype=numpy.float32)
    if _gpu_rng['source'] is not g:
        _gpu_rng['state'] = xp.random.RandomState(int(g.integers(0, 2 ** 63 - 1)))
        _gpu_rng['source'] = g
    return _gpu_rng['state'].random_sample(size=shape, dtype=numpy.float32)


@register
class DropoutLayer(NeuronLayer):
    """TRAIN: top = x * mask / (1 - ratio), mask ~ Bernoulli(1 - ratio); TEST: identity."""
    type = 'Dropout'
    layout_role = 'pointwise'     # (caffeplus.layout: any order of values)
    backward_reads = NO_READS
    # A device array of at least count bytes the TRAIN mask is written into
    # (the `stock` plan lends Caffe 1.0's uint32 rand_vec_: caffeplus.memory.caffe1).
    mask_buffer = None

    def __init__(self, layer_param):
        super().__init__(layer_param)
        ratio = F32(self.layer_param.dropout_param.dropout_ratio)
        if not 0 <= ratio < 1:
            _fail(self, 'dropout_param.dropout_ratio must be in [0, 1) (got %g)' % ratio)
        self.ratio = ratio
        self.scale = F32(1.0 / (1.0 - float(ratio)))
        self.mask = None

    def _forward(self, bottom, top):
        x = bottom[0].data
        xp = _xp(x)
        if self.phase == caffe_pb2.TRAIN and self._fused_forward(bottom, top):
            return
        if self.phase == caffe_pb2.TRAIN:
            self.mask = self._new_mask(_uniform(x.shape, xp), xp)
            y = top[0].data
            xp.multiply(x, self.mask, out=y)
            y *= self.scale
        else:
            self.mask = None
            if not same_data(bottom[0], top[0]):
                top[0].data[...] = x

    def _new_mask(self, u, xp):
        """u >= ratio, in mask_buffer's bytes when it is lent and large enough."""
        buf = self.mask_buffer
        if buf is None or backend.get_array_module(buf) is not xp or buf.nbytes < u.size:
            return u >= self.ratio
        mask = buf.view(numpy.bool_)[:u.size].reshape(u.shape)
        return xp.greater_equal(u, self.ratio, out=mask)

    # -- on the GPU: the mask from a counter-based generator (caffeplus.kernels'
    # cp_dropout_fwd), whose state stays on the device: one kernel each way,
    # and a CUDA graph of the pass (caffeplus.pass_graph) draws new masks.
    _mask_store = None

    def _fused_forward(self, bottom, top):
        from caffeplus import kernels as K
        if not K.active():
            return False
        arrays, dtype = K.maps((bottom[0], False), (top[0], False))
        n = bottom[0].count
        if arrays is None or not 0 < n <= K.MAX_COUNT:
            return False
        x, y = arrays
        buf = self.mask_buffer
        if buf is not None and K.is_device(buf) and buf.nbytes >= n:
            store = buf.view(numpy.uint8)
        else:
            store = self._mask_store
            if store is None or store.size < n or not K.is_device(store):
                store = self._mask_store = K.empty(n, numpy.uint8)
        state = _philox_state()
        K.kernel('cp_dropout_fwd', dtype)(K.elementwise_grid(n), (K.ELEMENTWISE_THREADS,), (
            x, y, store, state, K.u32(n), K.f32(self.ratio), K.f32(self.scale)))
        K.kernel('cp_dropout_step')((1,), (1,), (state,))
        self.mask = store[:n].view(numpy.bool_).reshape(bottom[0].shape)
        return True

    def _fused_backward(self, top, bottom):
        from caffeplus import kernels as K
        mask = self.mask
        if not K.active() or mask is None or not K.is_device(mask) or \
                mask.dtype != numpy.bool_ or not mask.flags.c_contiguous:
            return False
        arrays, dtype = K.maps((top[0], True), (bottom[0], True))
        if arrays is None:
            return False
        dy, dx = arrays
        n = mask.size
        K.kernel('cp_dropout_bwd', dtype)(K.elementwise_grid(n), (K.ELEMENTWISE_THREADS,), (
            dy, mask.reshape(-1).view(numpy.uint8), dx, K.u32(n), K.f32(self.scale)))
        return True

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff
        if self.phase == caffe_pb2.TRAIN:
            if self.mask is None or self.mask.shape != dy.shape:
                _fail(self, 'backward without a TRAIN forward of the same shape')
            if self._fused_backward(top, bottom):
                return
            dx = bottom[0].diff
            _xp(dy).multiply(dy, self.mask, out=dx)
            dx *= self.scale
        elif not same_diff(bottom[0], top[0]):
            bottom[0].diff[...] = dy
