"""Normalization layers: BatchNorm, MVN, Bias, Scale.

BatchNorm follows Caffe's three statistics blobs (mean sum, variance sum,
scale factor), which the solver never changes: the layer adds `lr_mult: 0`
ParamSpecs for them and never writes their diffs. MVN reproduces Caffe's
backward formula (exact only for negligible eps). Bias and Scale broadcast a
learned blob or a second bottom over the axes [axis, axis + num_axes).

BatchNorm, Bias, Scale and MVN all run in place. BatchNorm keeps its own copy
of the normalized top for a batch-statistics backward (the top itself may be
overwritten by a following in-place Scale); Scale keeps a copy of the bottom
when in place and its scale gradient may be needed, as Caffe does. MVN in
place gives the same numbers as out of place (Caffe's own in-place MVN
backward overwrites the top diff it still reads, so it is not reproduced).
"""
import numpy

from caffeplus import backend
from caffeplus.blob import Blob, same_data as _same_data, same_diff as _same_diff
from caffeplus.errors import CaffeplusError
from caffeplus.fillers import fill
from caffeplus.functions import keep_in
from caffeplus.layer import Layer, layer_error, register
from caffeplus.proto import caffe_pb2

F32 = numpy.float32


def _xp(a):
    return backend.get_array_module(a)


def _fail(layer, message):
    raise layer_error(layer, message)


def _prod(dims):
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _new_blob(layer, index, shape, filler):
    blob = Blob(shape, name='%s.%d' % (layer.layer_param.name, index))
    if filler is None:
        blob.data[...] = 0
    else:
        fill(blob, filler)
    return blob


# -- BatchNorm -----------------------------------------------------------------

@register
class BatchNormLayer(Layer):
    """Normalize each channel (axis 1) by batch statistics (TRAIN) or stored
    ones; with NVCaffe's scale_bias, then scale and shift each channel by
    learnable blobs 3 and 4 (a Scale layer with a bias, inside)."""
    type = 'BatchNorm'
    exact_num_bottom = 1
    exact_num_top = 1
    inplace_ok = True
    # The batch-statistics backward reads the layer's own copy of the
    # normalized data; the global-statistics backward only the saved std.
    backward_reads = frozenset()

    def __init__(self, layer_param):
        super().__init__(layer_param)
        p = self.layer_param.batch_norm_param
        if p.HasField('use_global_stats'):
            self.use_global_stats = bool(p.use_global_stats)
        else:
            self.use_global_stats = self.phase == caffe_pb2.TEST
        self.maf = F32(p.moving_average_fraction)
        self.eps = F32(p.eps)
        self.scale_bias = bool(p.scale_bias)
        self._x_norm = None
        self._std = None

    @property
    def learns_scale_bias(self):
        """Whether scale_bias's scale or bias takes a gradient."""
        return self.scale_bias and len(self.blobs) == 5 and (
            self.param_needs_backward(3) or self.param_needs_backward(4))

    @property
    def keeps_normalized(self):
        """Whether forward keeps a copy of the normalized data for backward:
        the batch-statistics gradient reads it, and so do scale_bias's
        scale gradients."""
        return not self.use_global_stats or self.learns_scale_bias

    def _channels(self, bottom):
        if bottom.num_axes < 1:
            _fail(self, 'the bottom needs at least one axis (got a scalar)')
        return 1 if bottom.num_axes == 1 else bottom.shape[1]

    def layer_setup(self, bottom, top):
        channels = self._channels(bottom[0])
        expected = [channels, channels, 1] + ([channels, channels] if self.scale_bias else [])
        if self.blobs:
            counts = [b.count for b in self.blobs]
            if counts != expected:
                _fail(self, 'expected %d blobs of %s values (statistics%s), found %s'
                      % (len(expected), expected, ', scale and bias' if self.scale_bias else '',
                         [b.shape_string() for b in self.blobs]))
        else:
            for i, shape in enumerate([(channels,), (channels,), (1,)]):
                self.blobs.append(_new_blob(self, i, shape, None))
            if self.scale_bias:
                p = self.layer_param.batch_norm_param
                one = caffe_pb2.FillerParameter(type='constant', value=1)
                self.blobs.append(_new_blob(self, 3, (channels,),
                                            p.scale_filler if p.HasField('scale_filler') else one))
                self.blobs.append(_new_blob(self, 4, (channels,),
                                            p.bias_filler if p.HasField('bias_filler') else None))
        # The first three blobs are statistics, not parameters: keep the
        # solver off them (scale_bias's scale and bias learn as any parameter).
        params = self.layer_param.param
        for i in range(3):
            if i == len(params):
                params.add().lr_mult = 0
            elif params[i].lr_mult != 0:
                _fail(self, 'param[%d].lr_mult is %g: batch normalization statistics cannot '
                      'be configured as learnable parameters (lr_mult must be 0)'
                      % (i, params[i].lr_mult))
        for i in range(3):
            self.set_param_propagate_down(i, False)

    def reshape(self, bottom, top):
        self._four_d = bottom[0].num_axes == 4
        if self._channels(bottom[0]) != self.blobs[0].count:
            _fail(self, 'bottom has %d channels but the statistics have %d'
                  % (self._channels(bottom[0]), self.blobs[0].count))
        top[0].reshape(bottom[0].shape)
        # Kept in the top's storage type: a 16-bit net's copy is 16-bit, as
        # its maps (on the CPU, which emulates 16 bits, float32 arrays).
        self._kept = {'x_norm': (top[0].count, top[0].data_storage.dtype)} \
            if self.keeps_normalized else {}

    def internal_buffers(self):
        """The normalized output, kept for backward (in place, later layers
        overwrite the top); placed by the memory plan (caffeplus.memory.scratch)."""
        return getattr(self, '_kept', {})

    def forget_kept_buffers(self):
        """caffeplus.memory.scratch.forget: the kept normalized copy is dead."""
        self._x_norm = None

    def _dims(self, blob):
        n = blob.shape[0]
        c = self.blobs[0].count
        if blob.layout == 'NHWC':       # channels-last (caffeplus.layout): rows of c values
            return blob.count // max(c, 1), c, 1
        return n, c, blob.count // max(n * c, 1)

    # caffeplus.layout: per-channel over either order, bottom and top alike.
    layout_role = 'tied'

    def channels_last_ok(self):
        from caffeplus import layout
        return layout.CHANNELS_LAST_BATCHNORM and getattr(self, '_four_d', False)

    def _forward(self, bottom, top):
        n, c, s = self._dims(bottom[0])
        x = bottom[0].data.reshape(n, c, s)
        y = top[0].data.reshape(n, c, s)
        if x.dtype != F32 or y.dtype != F32:
            # 16-bit maps (a FLOAT16 net on the GPU): the statistics and the
            # normalized values in float32, rounded once into the top.
            y32 = _xp(x).empty(y.shape, F32)
            self._forward_arrays(x.astype(F32), y32, n, c, s)
            y[...] = y32
            return
        self._forward_arrays(x, y, n, c, s)

    def _forward_arrays(self, x, y, n, c, s):
        xp = _xp(x)
        if self.use_global_stats:
            factor = self.blobs[2].data.reshape(())
            scale = xp.where(factor == 0, F32(0), F32(1) / xp.where(factor == 0, F32(1), factor))
            mean = self.blobs[0].data * scale
            var = self.blobs[1].data * scale
            xp.subtract(x, mean.reshape(1, c, 1), out=y)
        else:
            m = n * s
            mean = x.mean(axis=(0, 2), dtype=numpy.float32) if m else xp.zeros(c, F32)
            xp.subtract(x, mean.reshape(1, c, 1), out=y)
            var = (y * y).mean(axis=(0, 2), dtype=numpy.float32) if m else xp.zeros(c, F32)
            # Moving sums: Caffe's mean sum, unbiased variance sum, scale factor.
            b0, b1, b2 = self.blobs[0].data, self.blobs[1].data, self.blobs[2].data
            b2 *= self.maf
            b2 += F32(1)
            b0 *= self.maf
            b0 += mean
            correction = F32(m) / F32(m - 1) if m > 1 else F32(1)
            b1 *= self.maf
            b1 += var * correction
        std = xp.sqrt(var + self.eps)
        y /= std.reshape(1, c, 1)
        self._std = std
        self._x_norm = keep_in(self, 'x_norm', y) if self.keeps_normalized else None
        if self.scale_bias:
            y *= self.blobs[3].data.reshape(1, c, 1)
            y += self.blobs[4].data.reshape(1, c, 1)

    def round_kept(self, rounding, top):
        # The GPU keeps the normalized copy in the maps' type and computes
        # the top from the rounded copy (layers/fused_chain.py).
        if self._x_norm is None:
            return
        rounding(self._x_norm)
        if self.scale_bias:
            n, c, s = self._dims(top[0])
            y = top[0].data.reshape(n, c, s)
            numpy.multiply(self._x_norm, self.blobs[3].data.reshape(1, c, 1), out=y)
            y += self.blobs[4].data.reshape(1, c, 1)

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0] and not self.learns_scale_bias:
            return
        n, c, s = self._dims(top[0])
        dy = top[0].diff.reshape(n, c, s)
        if dy.dtype != F32:
            dy = dy.astype(F32)         # a 16-bit gradient: the sums in float32
        y = self._x_norm
        if self.keeps_normalized and (y is None or y.shape != dy.shape):
            _fail(self, 'backward without a forward of the same shape')
        if self.scale_bias:
            if self.param_needs_backward(3):
                self.blobs[3].diff += (dy * y).sum(axis=(0, 2), dtype=numpy.float32)
            if self.param_needs_backward(4):
                self.blobs[4].diff += dy.sum(axis=(0, 2), dtype=numpy.float32)
            # The gradient reaching the normalized data.
            dy = dy * self.blobs[3].data.reshape(1, c, 1)
        if not propagate_down[0]:
            return
        std = self._std.reshape(1, c, 1)
        if self.use_global_stats:
            dx = dy / std
        else:
            if dy.size == 0:
                return
            # (dy - mean(dy) - y * mean(dy * y)) / std, means over N and spatial axes.
            mean_dyy = (dy * y).mean(axis=(0, 2), dtype=numpy.float32).reshape(1, c, 1)
            mean_dy = dy.mean(axis=(0, 2), dtype=numpy.float32).reshape(1, c, 1)
            dx = y * mean_dyy
            dx += mean_dy
            dx = dy - dx
            dx /= std
        bottom[0].diff[...] = dx.reshape(bottom[0].shape)


# -- MVN -------------------------------------------------------------------------

@register
class MVNLayer(Layer):
    """Subtract the mean (and divide by std + eps) per sample and channel,
    or per sample across channels."""
    type = 'MVN'
    exact_num_bottom = 1
    exact_num_top = 1
    inplace_ok = True

    def __init__(self, layer_param):
        super().__init__(layer_param)
        p = self.layer_param.mvn_param
        self.normalize_variance = bool(p.normalize_variance)
        self.across_channels = bool(p.across_channels)
        self.eps = F32(p.eps)
        self.backward_reads = frozenset(('top_data',)) if self.normalize_variance \
            else frozenset()
        self._std = None

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape)

    def _rows(self, blob):
        shape = blob.shape
        n = shape[0] if shape else 1
        if not self.across_channels:
            n *= shape[1] if len(shape) > 1 else 1
        return n, blob.count // max(n, 1)

    def _forward(self, bottom, top):
        num, dim = self._rows(bottom[0])
        x = bottom[0].data.reshape(num, dim)
        y = top[0].data.reshape(num, dim)
        xp = _xp(x)
        if dim == 0:
            return
        mean = x.mean(axis=1, keepdims=True, dtype=numpy.float32)
        xp.subtract(x, mean, out=y)
        if self.normalize_variance:
            var = (y * y).mean(axis=1, keepdims=True, dtype=numpy.float32)
            std = xp.sqrt(var)
            std += self.eps
            y /= std
            self._std = std

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        num, dim = self._rows(top[0])
        if dim == 0:
            return
        dy = top[0].diff.reshape(num, dim)
        if self.normalize_variance:
            # Caffe's formula: (dy - mean(dy) - y * mean(dy * y)) / (std + eps).
            y = top[0].data.reshape(num, dim)
            sum_dyy = (dy * y).sum(axis=1, keepdims=True, dtype=numpy.float32)
            sum_dy = dy.sum(axis=1, keepdims=True, dtype=numpy.float32)
            g = y * sum_dyy
            g += sum_dy
            g *= F32(-1.0 / dim)
            g += dy
            g /= self._std
        else:
            g = dy - dy.mean(axis=1, keepdims=True, dtype=numpy.float32)
        bottom[0].diff[...] = g.reshape(bottom[0].shape)


# -- Bias and Scale --------------------------------------------------------------

def _canonical_axis(layer, blob, axis, field):
    n = blob.num_axes
    if not -n <= axis < n:
        _fail(layer, '%s %d is out of range for a bottom with %d axes (shape %s)'
              % (field, axis, n, blob.shape_string()))
    return axis + n if axis < 0 else axis


def _learned_shape(layer, bottom0, axis, num_axes, prefix):
    """Shape of a learned blob covering bottom0's axes [axis, axis + num_axes)."""
    axis = _canonical_axis(layer, bottom0, axis, prefix + '.axis')
    if num_axes < -1:
        _fail(layer, '%s.num_axes must be non-negative, or -1 to extend to the end of the '
              'bottom (got %d)' % (prefix, num_axes))
    if num_axes >= 0 and bottom0.num_axes < axis + num_axes:
        _fail(layer, '%s.num_axes %d starting at axis %d extends past the bottom shape %s'
              % (prefix, num_axes, axis, bottom0.shape_string()))
    end = bottom0.num_axes if num_axes == -1 else axis + num_axes
    return bottom0.shape[axis:end]


def _channels_last(blob, dims):
    """(outer, dim, inner) of a per-channel operand over `blob` as stored:
    channels-last (caffeplus.layout), rows of the channels."""
    if blob.layout != 'NHWC':
        return dims
    outer, dim, inner = dims
    if outer != blob.shape[0] or dim != blob.shape[1]:
        raise CaffeplusError('blob %s is stored channels-last: only a per-channel operand '
                             'applies to it' % blob.name)
    return outer * inner, dim, 1


def _broadcast_dims(layer, bottom0, operand, axis, prefix, what):
    """(outer, dim, inner) for broadcasting `operand` over bottom0 at `axis`."""
    if operand.num_axes == 0:
        axis = 0
    else:
        axis = _canonical_axis(layer, bottom0, axis, prefix + '.axis')
    k = operand.num_axes
    if bottom0.num_axes < axis + k:
        _fail(layer, "the %s blob's shape %s extends past bottom[0]'s shape %s when applied "
              'at axis %d' % (what, operand.shape_string(), bottom0.shape_string(), axis))
    for i in range(k):
        if bottom0.shape[axis + i] != operand.shape[i]:
            _fail(layer, "dimension mismatch between bottom[0] axis %d (%d) and the %s blob's "
                  'axis %d (%d)' % (axis + i, bottom0.shape[axis + i], what, i, operand.shape[i]))
    shape = bottom0.shape
    return _prod(shape[:axis]), operand.count, _prod(shape[axis + k:])


@register
class BiasLayer(Layer):
    """top = bottom[0] + b, b = bottom[1] or a learned blob, broadcast at `axis`."""
    type = 'Bias'
    min_num_bottom = 1
    max_num_bottom = 2
    exact_num_top = 1
    inplace_ok = True
    backward_reads = frozenset()

    def layer_setup(self, bottom, top):
        p = self.layer_param.bias_param
        if len(bottom) == 1 and not self.blobs:
            shape = _learned_shape(self, bottom[0], p.axis, p.num_axes, 'bias_param')
            filler = p.filler if p.HasField('filler') else \
                caffe_pb2.FillerParameter(type='constant', value=0)
            self.blobs.append(_new_blob(self, 0, shape, filler))
        elif len(bottom) == 1 and len(self.blobs) != 1:
            _fail(self, 'expected one bias blob, found %d' % len(self.blobs))

    def reshape(self, bottom, top):
        bias = bottom[1] if len(bottom) > 1 else self.blobs[0]
        self.dims = _broadcast_dims(self, bottom[0], bias, self.layer_param.bias_param.axis,
                                    'bias_param', 'bias')
        top[0].reshape(bottom[0].shape)

    def _forward(self, bottom, top):
        bias = bottom[1] if len(bottom) > 1 else self.blobs[0]
        outer, dim, inner = self.dims
        b = bias.data.reshape(1, dim, 1)
        y = top[0].data.reshape(outer, dim, inner)
        if _same_data(bottom[0], top[0]):
            y += b
        else:
            _xp(y).add(bottom[0].data.reshape(outer, dim, inner), b, out=y)

    def _backward(self, top, propagate_down, bottom):
        dy = top[0].diff
        if propagate_down[0] and not _same_diff(bottom[0], top[0]):
            bottom[0].diff[...] = dy
        outer, dim, inner = self.dims
        if len(bottom) > 1:
            if propagate_down[1]:
                g = dy.reshape(outer, dim, inner).sum(axis=(0, 2), dtype=numpy.float32)
                bottom[1].diff[...] = g.reshape(bottom[1].shape)
        elif self.param_needs_backward(0):
            g = dy.reshape(outer, dim, inner).sum(axis=(0, 2), dtype=numpy.float32)
            self.blobs[0].diff[...] += g.reshape(self.blobs[0].shape)


_READS_NOTHING, _READS_BOTTOM = frozenset(), frozenset(('bottom_data',))


@register
class ScaleLayer(Layer):
    """top = bottom[0] * s (+ b), s = bottom[1] or a learned blob, broadcast at `axis`;
    bias_term adds a learned bias of the same shape."""
    type = 'Scale'
    min_num_bottom = 1
    max_num_bottom = 2
    exact_num_top = 1
    inplace_ok = True
    backward_reads = _READS_BOTTOM
    # caffeplus.layout: a per-channel Scale over either order (channels_last_ok).
    layout_role = 'tied'
    _per_channel = False

    def channels_last_ok(self):
        """One bottom of 4 axes, the scale (and bias) over its channels only."""
        from caffeplus import layout
        return layout.CHANNELS_LAST_BATCHNORM and len(self.layer_param.bottom) == 1 and \
            self._per_channel

    def layer_setup(self, bottom, top):
        p = self.layer_param.scale_param
        if len(bottom) == 1 and not self.blobs:
            shape = _learned_shape(self, bottom[0], p.axis, p.num_axes, 'scale_param')
            filler = p.filler if p.HasField('filler') else \
                caffe_pb2.FillerParameter(type='constant', value=1)
            self.blobs.append(_new_blob(self, 0, shape, filler))
        self.bias_param_id = None
        if p.bias_term:
            if len(self.blobs) + len(bottom) < 3:
                num_axes = bottom[1].num_axes if len(bottom) > 1 else p.num_axes
                shape = _learned_shape(self, bottom[0], p.axis, num_axes, 'scale_param')
                # An absent bias_filler is the default FillerParameter: constant 0.
                self.blobs.append(_new_blob(self, len(self.blobs), shape, p.bias_filler))
            self.bias_param_id = len(self.blobs) - 1
        want = (1 if len(bottom) == 1 else 0) + (1 if p.bias_term else 0)
        if len(self.blobs) != want:
            _fail(self, 'expected %d parameter blob(s) (scale_param.bias_term %s, %d bottoms), '
                  'found %d' % (want, p.bias_term, len(bottom), len(self.blobs)))
        self._bottom_copy = None

    def reshape(self, bottom, top):
        p = self.layer_param.scale_param
        scale = bottom[1] if len(bottom) > 1 else self.blobs[0]
        dims = _broadcast_dims(self, bottom[0], scale, p.axis, 'scale_param', 'scale')
        shape = bottom[0].shape
        self._per_channel = len(shape) == 4 and dims[:2] == tuple(shape[:2])
        self.dims = _channels_last(bottom[0], dims)
        if self.bias_param_id is not None:
            self.bias_dims = _channels_last(bottom[0], _broadcast_dims(
                self, bottom[0], self.blobs[self.bias_param_id], p.axis, 'scale_param', 'bias'))
        top[0].reshape(bottom[0].shape)
        copies = _same_data(bottom[0], top[0]) and (len(bottom) > 1 or
                                                     self.param_needs_backward(0))
        # Kept in the maps' type: a 16-bit map's values are exact in 16 bits.
        self._kept = {'bottom_copy': (bottom[0].count, bottom[0].data_storage.dtype)} \
            if copies else {}
        # In place on its one bottom, backward reads no blob's values: the
        # scale gradient reads the kept copy (or is not wanted), the bottom
        # gradient the top diff and the learned scale. The blob may then die
        # at its last forward reader (a residual branch's chain top at the
        # Eltwise) instead of living to this backward.
        self.backward_reads = _READS_NOTHING if len(bottom) == 1 and \
            _same_data(bottom[0], top[0]) else _READS_BOTTOM

    def internal_buffers(self):
        """In place, the bottom the scale gradient needs (caffeplus.memory.scratch)."""
        return getattr(self, '_kept', {})

    def forget_kept_buffers(self):
        """caffeplus.memory.scratch.forget: the kept bottom copy is dead."""
        self._bottom_copy = None

    def _scale_blob(self, bottom):
        return bottom[1] if len(bottom) > 1 else self.blobs[0]

    def _forward(self, bottom, top):
        outer, dim, inner = self.dims
        x = bottom[0].data.reshape(outer, dim, inner)
        xp = _xp(x)
        if _same_data(bottom[0], top[0]) and (len(bottom) > 1 or self.param_needs_backward(0)):
            # In place: the scale gradient needs the bottom that is overwritten now.
            self._bottom_copy = keep_in(self, 'bottom_copy', x)
        else:
            self._bottom_copy = None
        y = top[0].data.reshape(outer, dim, inner)
        xp.multiply(x, self._scale_blob(bottom).data.reshape(1, dim, 1), out=y)
        if self.bias_param_id is not None:
            bo, bd, bi = self.bias_dims
            y = top[0].data.reshape(bo, bd, bi)
            y += self.blobs[self.bias_param_id].data.reshape(1, bd, 1)

    def _backward(self, top, propagate_down, bottom):
        outer, dim, inner = self.dims
        dy = top[0].diff
        bid = self.bias_param_id
        if bid is not None and self.param_needs_backward(bid):
            bo, bd, bi = self.bias_dims
            g = dy.reshape(bo, bd, bi).sum(axis=(0, 2), dtype=numpy.float32)
            self.blobs[bid].diff[...] += g.reshape(self.blobs[bid].shape)
        dy3 = dy.reshape(outer, dim, inner)
        learned = len(bottom) == 1
        if (learned and self.param_needs_backward(0)) or (not learned and propagate_down[1]):
            if _same_data(bottom[0], top[0]):
                if self._bottom_copy is None:
                    _fail(self, 'in place, the scale gradient needs the forward to keep a copy '
                          'of the bottom; none was kept')
                x = self._bottom_copy
            else:
                x = bottom[0].data.reshape(outer, dim, inner)
            # (A 16-bit product could overflow: the products in float32.)
            g = (dy3.astype(F32, copy=False) * x).sum(axis=(0, 2), dtype=numpy.float32)
            if learned:
                self.blobs[0].diff[...] += g.reshape(self.blobs[0].shape)
            else:
                bottom[1].diff[...] = g.reshape(bottom[1].shape)
        if propagate_down[0]:
            s = self._scale_blob(bottom).data.reshape(1, dim, 1)
            dx = bottom[0].diff.reshape(outer, dim, inner)
            _xp(dx).multiply(dy3, s, out=dx)
