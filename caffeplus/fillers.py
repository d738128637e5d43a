"""Caffe's weight fillers (FillerParameter): constant, uniform, gaussian
(with sparse), positive_unitball, xavier, msra, bilinear.

Values come from caffeplus.rng, so a seeded net is repeatable; they are not
Caffe's own random numbers (boost's generators are not reproduced).

A filler's fields are checked before drawing (a negative or non-finite std,
min > max, a sparse count below -1 are NetErrors naming the field), and the
shape against caffeplus.blob.check_count before anything is allocated for
it (a layer may fill an array before any Blob of that shape exists).
"""
import math

import numpy

from caffeplus import rng
from caffeplus.errors import NetError


def _fans(shape):
    count = int(numpy.prod(shape)) if len(shape) else 1
    fan_in = count // shape[0] if len(shape) >= 1 and shape[0] else count
    fan_out = count // shape[1] if len(shape) > 1 and shape[1] else count
    return fan_in, fan_out


def _variance_n(param, shape):
    from caffeplus.proto import caffe_pb2
    fan_in, fan_out = _fans(shape)
    if param.variance_norm == caffe_pb2.FillerParameter.AVERAGE:
        return (fan_in + fan_out) / 2.0
    if param.variance_norm == caffe_pb2.FillerParameter.FAN_OUT:
        return fan_out
    return fan_in


def _bad(kind, field, value, rule):
    return NetError("%s filler: %s is %s; %s (FillerParameter.%s)"
                    % (kind, field, value, rule, field))


def _check_param(param):
    """Caffe's CHECKs on a filler's fields, as NetErrors naming the field."""
    kind = param.type
    if kind == 'uniform':
        for field in ('min', 'max'):
            if not math.isfinite(getattr(param, field)):
                raise _bad(kind, field, getattr(param, field), 'it must be a finite number')
        if param.min > param.max:
            raise _bad(kind, 'min', param.min, 'it must not exceed max (%g)' % param.max)
    elif kind == 'gaussian':
        if not math.isfinite(param.std) or param.std < 0:
            raise _bad(kind, 'std', param.std, 'it must be a finite number >= 0')
        if not math.isfinite(param.mean):
            raise _bad(kind, 'mean', param.mean, 'it must be a finite number')
        if param.sparse < -1:
            raise _bad(kind, 'sparse', param.sparse, 'it must be -1 (dense) or >= 0')


def fill_array(param, shape):
    """A float32 array of `shape` filled as FillerParameter `param` says."""
    from caffeplus.blob import check_count
    shape = tuple(int(d) for d in shape)
    kind = param.type
    if any(d < 0 for d in shape):
        raise NetError('%s filler: negative dimension in shape %s' % (kind, shape))
    check_count(shape, '%s filler' % kind)      # before allocating or drawing
    _check_param(param)
    if kind not in _KINDS:
        raise NetError("Unknown filler name: '%s'" % kind)
    if 0 in shape:
        return numpy.zeros(shape, dtype=numpy.float32)      # nothing to draw
    g = rng.get()
    if kind == 'constant':
        out = numpy.full(shape, param.value, dtype=numpy.float32)
    elif kind == 'uniform':
        out = g.uniform(param.min, param.max, size=shape)
    elif kind == 'gaussian':
        # Drawn in float32 directly: half the cost of float64 draws.
        out = g.standard_normal(size=shape, dtype=numpy.float32) * numpy.float32(param.std) \
            + numpy.float32(param.mean)
        if param.sparse >= 0:
            if len(shape) < 1:
                raise NetError('sparse gaussian filler needs a blob with at least one axis '
                               '(FillerParameter.sparse)')
            num_outputs = shape[0]
            prob = param.sparse / float(num_outputs)
            out = out * (g.random(size=shape) < prob)
    elif kind == 'positive_unitball':
        out = g.uniform(0, 1, size=shape)
        num = shape[0] if shape else 1
        flat = out.reshape(num, -1)
        flat /= flat.sum(axis=1, keepdims=True)
        out = flat.reshape(shape)
    elif kind == 'xavier':
        scale = math.sqrt(3.0 / _variance_n(param, shape))
        out = g.uniform(-scale, scale, size=shape)
    elif kind == 'msra':
        std = math.sqrt(2.0 / _variance_n(param, shape))
        out = g.standard_normal(size=shape, dtype=numpy.float32) * numpy.float32(std)
    elif kind == 'bilinear':
        if len(shape) != 4 or shape[2] != shape[3]:
            raise NetError('bilinear filler needs a 4-D blob with square kernels, got %s'
                           % (shape,))
        width = shape[3]
        f = math.ceil(width / 2.0)
        c = (2 * f - 1 - f % 2) / (2.0 * f)
        idx = numpy.arange(int(numpy.prod(shape)))
        x = idx % width
        y = (idx // width) % shape[2]
        out = ((1 - numpy.abs(x / f - c)) * (1 - numpy.abs(y / f - c))).reshape(shape)
    else:
        raise NetError("Unknown filler name: '%s'" % kind)
    return numpy.asarray(out, dtype=numpy.float32)


_KINDS = ('constant', 'uniform', 'gaussian', 'positive_unitball', 'xavier', 'msra', 'bilinear')


def fill(blob, param):
    """Fill a Blob's data in place."""
    blob.data = fill_array(param, blob.shape)
