"""Common layers: the ones that move, select, combine and reduce blobs.

Split, Silence, InnerProduct, Concat, Slice, Eltwise, Flatten, Reshape,
Softmax, ArgMax, Reduction, Tile, BatchReindex, Filter, Embed, Parameter
and Accuracy, with stock Caffe's semantics (shapes, checks, tie rules and
accumulation of parameter gradients).

Every computation is written against `xp`, the array module of the blobs
(NumPy or CuPy), and is vectorised: Python loops run only over bottoms or
tops, never over items or elements.
"""
import numpy

from caffeplus import backend
from caffeplus.blob import Blob
from caffeplus.errors import CaffeplusError, NetError
from caffeplus.fillers import fill
from caffeplus.functions import softmax
from caffeplus.im2col import scratch
from caffeplus.layer import Layer, register
from caffeplus.proto import caffe_pb2

_NOTHING = frozenset()
_BOTTOM = frozenset(('bottom_data',))
_TOP = frozenset(('top_data',))
_BOTH = frozenset(('bottom_data', 'top_data'))


# -- helpers ------------------------------------------------------------------
def _error(layer, message):
    """A NetError that names the layer and its type."""
    return NetError('layer %s (%s): %s' % (layer.name, layer.layer_param.type, message))


def _axis(layer, blob, axis, field):
    """Caffe's CanonicalAxisIndex, failing with the layer and field named."""
    try:
        return blob.canonical_axis_index(int(axis))
    except CaffeplusError:
        raise _error(layer, '%s = %d is out of range for a bottom of shape %s (%d axes)'
                     % (field, axis, blob.shape_string(), blob.num_axes))


def _xp(*arrays):
    return backend.get_array_module(*arrays)


def _prod(dims):
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _along(axis, start, stop):
    """An index selecting [start:stop) along `axis`."""
    return (slice(None),) * axis + (slice(start, stop),)


def _refuse_inplace(layer, bottom, top):
    for t in top:
        if any(t is b for b in bottom):
            raise _error(layer, 'does not allow in-place computation (top %s is a bottom)'
                         % t.name)


def _scatter_add(xp, target, indices, values):
    """target[indices] += values, adding repeated indices one after another."""
    add_at = getattr(xp.add, 'at', None)
    if add_at is not None:
        add_at(target, indices, values)
    else:   # CuPy before ufunc.at
        import cupyx
        cupyx.scatter_add(target, indices, values)


def _new_param_blob(layer, index, shape, filler=None):
    blob = Blob(shape, name='%s.%d' % (layer.name, index))
    if filler is not None:
        fill(blob, filler)
    return blob


def _check_param_shapes(layer, expected):
    """Blobs given in the layer definition must have the shapes the layer needs."""
    if len(layer.blobs) != len(expected):
        raise _error(layer, 'has %d parameter blob(s) in its definition but needs %d'
                     % (len(layer.blobs), len(expected)))
    for i, (blob, shape) in enumerate(zip(layer.blobs, expected)):
        if tuple(blob.shape) != tuple(shape):
            raise _error(layer, 'parameter blob %d has shape %s, expected %s'
                         % (i, blob.shape_string(), ' '.join(str(d) for d in shape)))


def _as_indices(layer, values, limit, what, check_integer=False):
    """Float index values -> int64 (C++ static_cast truncation), range-checked."""
    xp = _xp(values)
    if values.size:
        if bool(xp.any(values < 0)):
            raise _error(layer, '%s: negative index %g' % (what, float(values.min())))
        if bool(xp.any(values >= limit)):
            raise _error(layer, '%s: index %g is not below %d'
                         % (what, float(values.max()), limit))
    idx = values.astype(numpy.int64)
    if check_integer and values.size and bool(xp.any(idx != values)):
        raise _error(layer, '%s: non-integer index' % what)
    return idx


# -- Split and Silence ----------------------------------------------------------
@register
class SplitLayer(Layer):
    """One bottom copied to several tops; backward sums their diffs.

    The tops share the bottom's data (no copy), as in Caffe."""
    type = 'Split'
    layout_role = 'pointwise'     # (caffeplus.layout: any order of values)
    exact_num_bottom = 1
    min_num_top = 1
    backward_reads = _NOTHING

    def reshape(self, bottom, top):
        _refuse_inplace(self, bottom, top)
        for t in top:
            t.reshape(bottom[0].shape)
            t.share_data(bottom[0])

    def _forward(self, bottom, top):
        pass

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        diff = bottom[0].diff
        diff[...] = top[0].diff
        for t in top[1:]:
            diff += t.diff


@register
class SilenceLayer(Layer):
    """Consumes bottoms so they are not net outputs; no tops."""
    type = 'Silence'
    min_num_bottom = 1
    exact_num_top = 0
    backward_reads = _NOTHING

    def reshape(self, bottom, top):
        pass

    def _forward(self, bottom, top):
        pass

    def _backward(self, top, propagate_down, bottom):
        for b, prop in zip(bottom, propagate_down):
            if prop:
                b.diff[...] = 0


# -- InnerProduct -----------------------------------------------------------------
@register
class InnerProductLayer(Layer):
    """top = bottom (M x K) times W^T (W is N x K; K x N with transpose) + b.

    The bottom is seen as a matrix: the axes before `axis` form its rows,
    the rest its K columns. Parameter diffs accumulate (+=), as in Caffe."""
    type = 'InnerProduct'
    exact_num_bottom = 1
    exact_num_top = 1
    backward_reads = _BOTTOM

    def layer_setup(self, bottom, top):
        p = self.layer_param.inner_product_param
        self.num_output = int(p.num_output)
        if self.num_output <= 0:
            raise _error(self, 'inner_product_param.num_output must be positive (got %d)'
                         % self.num_output)
        self.bias_term = p.bias_term
        self.transpose = p.transpose
        axis = _axis(self, bottom[0], p.axis, 'inner_product_param.axis')
        self.K = bottom[0].count_axes(axis)
        n, k = self.num_output, self.K
        shapes = [(k, n) if self.transpose else (n, k)]
        if self.bias_term:
            shapes.append((n,))
        if self.blobs:
            _check_param_shapes(self, shapes)
        else:
            self.blobs = [_new_param_blob(self, 0, shapes[0], p.weight_filler)]
            if self.bias_term:
                self.blobs.append(_new_param_blob(self, 1, shapes[1], p.bias_filler))

    def reshape(self, bottom, top):
        p = self.layer_param.inner_product_param
        axis = _axis(self, bottom[0], p.axis, 'inner_product_param.axis')
        k = bottom[0].count_axes(axis)
        if k != self.K:
            raise _error(self, 'input size incompatible with inner product parameters: '
                         'bottom %s gives %d inputs from axis %d, the weights take %d'
                         % (bottom[0].shape_string(), k, axis, self.K))
        self.M = bottom[0].count_axes(0, axis)
        top[0].reshape(bottom[0].shape[:axis] + (self.num_output,))

    def gemm_rows(self):
        return getattr(self, 'M', None)

    def _weight_t(self):
        """W as a K x N matrix (a view, no copy)."""
        w = self.blobs[0].data
        return w if self.transpose else w.T

    def _forward(self, bottom, top):
        xp = _xp(bottom[0].data)
        x = bottom[0].data.reshape(self.M, self.K)
        y = top[0].data.reshape(self.M, self.num_output)
        xp.matmul(x, self._weight_t(), out=y)
        if self.bias_term:
            y += self.blobs[1].data

    def _backward(self, top, propagate_down, bottom):
        xp = _xp(top[0].diff)
        dy = top[0].diff.reshape(self.M, self.num_output)
        if self.param_needs_backward(0):
            x = bottom[0].data.reshape(self.M, self.K)
            w_diff = self.blobs[0].diff
            # Into a reused scratch buffer, then accumulate: a fresh temporary
            # the size of the weights each iteration costs more than the GEMM.
            grad = scratch(xp, w_diff.shape, 'ip_weight_diff')
            if self.transpose:
                xp.matmul(x.T, dy, out=grad)
            else:
                xp.matmul(dy.T, x, out=grad)
            w_diff += grad
        if self.bias_term and self.param_needs_backward(1):
            self.blobs[1].diff[...] += dy.sum(axis=0, dtype=self.blobs[1].diff.dtype)
        if propagate_down[0]:
            dx = bottom[0].diff.reshape(self.M, self.K)
            xp.matmul(dy, self._weight_t().T, out=dx)


# -- Concat and Slice ---------------------------------------------------------------
def _legacy_axis(layer, blob, param, axis_field, legacy_field, prefix):
    """The axis of Concat/Slice: `axis`, or the legacy non-negative *_dim."""
    if param.HasField(legacy_field):
        legacy = int(getattr(param, legacy_field))
        if legacy >= blob.num_axes:
            raise _error(layer, '%s.%s = %d is out of range for a bottom of shape %s'
                         % (prefix, legacy_field, legacy, blob.shape_string()))
        return legacy
    return _axis(layer, blob, getattr(param, axis_field), prefix + '.' + axis_field)


def _check_not_both(layer, param, prefix, legacy_field):
    if param.HasField('axis') and param.HasField(legacy_field):
        raise _error(layer, 'either %s.axis or %s.%s should be specified, not both'
                     % (prefix, prefix, legacy_field))


@register
class ConcatLayer(Layer):
    """Joins the bottoms along one axis."""
    type = 'Concat'
    min_num_bottom = 1
    exact_num_top = 1
    backward_reads = _NOTHING
    # caffeplus.layout: along the channels of 4-D maps either order, the
    # bottoms and the top alike (channels-last: rows of channels side by side).
    layout_role = 'tied'
    _four_d = False

    def channels_last_ok(self):
        return self._four_d and getattr(self, 'axis', None) == 1

    def _rows(self, blob):
        """The blob's values as (rows, channels) where it is channels-last
        (Caffe's concat axis is then the last in memory), else None."""
        if blob.layout != 'NHWC':
            return None
        return blob.count // blob.shape[1], blob.shape[1]

    def layer_setup(self, bottom, top):
        _check_not_both(self, self.layer_param.concat_param, 'concat_param', 'concat_dim')

    def reshape(self, bottom, top):
        _refuse_inplace(self, bottom, top)
        axis = _legacy_axis(self, bottom[0], self.layer_param.concat_param,
                            'axis', 'concat_dim', 'concat_param')
        shape = list(bottom[0].shape)
        for i, b in enumerate(bottom[1:], 1):
            same = b.num_axes == bottom[0].num_axes and all(
                d == e for j, (d, e) in enumerate(zip(b.shape, bottom[0].shape)) if j != axis)
            if not same:
                raise _error(self, 'all inputs must have the same shape, except at the concat '
                             'axis %d: bottom 0 (%s) is %s, bottom %d (%s) is %s'
                             % (axis, bottom[0].name, bottom[0].shape_string(), i, b.name,
                                b.shape_string()))
            shape[axis] += b.shape[axis]
        self.axis = axis
        self._four_d = len(shape) == 4
        top[0].reshape(tuple(shape))
        if len(bottom) == 1:
            top[0].share_data(bottom[0])
            top[0].share_diff(bottom[0])

    def _forward(self, bottom, top):
        if len(bottom) == 1:
            return
        rows = self._rows(top[0])
        out = top[0].data if rows is None else top[0].data.reshape(rows)
        offset = 0
        for b in bottom:
            n = b.shape[self.axis]
            if rows is None:
                out[_along(self.axis, offset, offset + n)] = b.data
            else:
                out[:, offset:offset + n] = b.data.reshape(rows[0], n)
            offset += n

    def _backward(self, top, propagate_down, bottom):
        if len(bottom) == 1:
            return
        rows = self._rows(top[0])
        diff = top[0].diff if rows is None else top[0].diff.reshape(rows)
        offset = 0
        for b, prop in zip(bottom, propagate_down):
            n = b.shape[self.axis]
            if prop and rows is None:
                b.diff[...] = diff[_along(self.axis, offset, offset + n)]
            elif prop:
                b.diff.reshape(rows[0], n)[...] = diff[:, offset:offset + n]
            offset += n


@register
class SliceLayer(Layer):
    """Cuts the bottom along one axis at slice_point's, or into equal parts."""
    type = 'Slice'
    exact_num_bottom = 1
    min_num_top = 1
    backward_reads = _NOTHING

    def layer_setup(self, bottom, top):
        _check_not_both(self, self.layer_param.slice_param, 'slice_param', 'slice_dim')

    def reshape(self, bottom, top):
        _refuse_inplace(self, bottom, top)
        p = self.layer_param.slice_param
        axis = _legacy_axis(self, bottom[0], p, 'axis', 'slice_dim', 'slice_param')
        dim = bottom[0].shape[axis]
        points = [int(x) for x in p.slice_point]
        if points:
            if len(points) != len(top) - 1:
                raise _error(self, 'slice_param.slice_point: %d point(s) given for %d tops '
                             '(need one less than the number of tops)' % (len(points), len(top)))
            if len(top) > dim:
                raise _error(self, '%d tops, but the slice axis %d of bottom %s has only %d'
                             % (len(top), axis, bottom[0].shape_string(), dim))
            sizes, prev = [], 0
            for pt in points:
                if pt <= prev:
                    raise _error(self, 'slice_param.slice_point must be increasing and '
                                 'positive (got %s)' % points)
                sizes.append(pt - prev)
                prev = pt
            if prev > dim:
                raise _error(self, 'slice_param.slice_point %d is past the end of axis %d '
                             '(size %d)' % (prev, axis, dim))
            sizes.append(dim - prev)
        else:
            if dim % len(top):
                raise _error(self, 'number of top blobs (%d) should evenly divide the input '
                             'slice axis %d (%d)' % (len(top), axis, dim))
            sizes = [dim // len(top)] * len(top)
        self.axis, self.sizes = axis, sizes
        for t, n in zip(top, sizes):
            shape = list(bottom[0].shape)
            shape[axis] = n
            t.reshape(shape)
        if len(top) == 1:
            top[0].share_data(bottom[0])
            top[0].share_diff(bottom[0])

    def _forward(self, bottom, top):
        if len(top) == 1:
            return
        data = bottom[0].data
        offset = 0
        for t, n in zip(top, self.sizes):
            t.data[...] = data[_along(self.axis, offset, offset + n)]
            offset += n

    def _backward(self, top, propagate_down, bottom):
        if len(top) == 1 or not propagate_down[0]:
            return
        diff = bottom[0].diff
        offset = 0
        for t, n in zip(top, self.sizes):
            diff[_along(self.axis, offset, offset + n)] = t.diff
            offset += n


# -- Eltwise --------------------------------------------------------------------
_PROD = caffe_pb2.EltwiseParameter.PROD
_SUM = caffe_pb2.EltwiseParameter.SUM
_MAX = caffe_pb2.EltwiseParameter.MAX


@register
class EltwiseLayer(Layer):
    """Element-wise PROD, SUM (with coefficients) or MAX of equal-shaped bottoms.

    MAX keeps, per element, the index of the winning bottom: bottom 1 wins a
    tie with bottom 0, a later bottom must be strictly greater to win (the
    order of Caffe's CPU comparisons)."""
    type = 'Eltwise'
    layout_role = 'pointwise'     # (caffeplus.layout: any order of values)
    min_num_bottom = 2
    exact_num_top = 1
    backward_reads = _BOTH

    def __init__(self, layer_param):
        super().__init__(layer_param)
        p = self.layer_param.eltwise_param
        self.op = p.operation
        if self.op == _SUM:
            self.backward_reads = _NOTHING
        elif self.op == _MAX:
            self.backward_reads = _NOTHING     # reads its own argmax mask
        elif self.op == _PROD:
            self.backward_reads = _BOTTOM if p.stable_prod_grad else _BOTH

    def layer_setup(self, bottom, top):
        p = self.layer_param.eltwise_param
        if self.op not in (_PROD, _SUM, _MAX):
            raise _error(self, 'unknown eltwise_param.operation %d' % self.op)
        if len(p.coeff) not in (0, len(bottom)):
            raise _error(self, 'eltwise_param.coeff: takes one coefficient per bottom blob '
                         '(%d given for %d bottoms)' % (len(p.coeff), len(bottom)))
        if self.op == _PROD and len(p.coeff):
            raise _error(self, 'eltwise_param.coeff: only SUM takes coefficients')
        coeffs = list(p.coeff) if len(p.coeff) else [1.0] * len(bottom)
        self.coeffs = [numpy.float32(c) for c in coeffs]
        self.stable_prod_grad = p.stable_prod_grad
        self.mask = None

    def reshape(self, bottom, top):
        for i, b in enumerate(bottom[1:], 1):
            if b.shape != bottom[0].shape:
                raise _error(self, 'all bottoms must have the same shape: bottom 0 (%s) is %s, '
                             'bottom %d (%s) is %s' % (bottom[0].name, bottom[0].shape_string(),
                                                       i, b.name, b.shape_string()))
        top[0].reshape(bottom[0].shape)

    def _forward(self, bottom, top):
        xp = _xp(bottom[0].data)
        if self.op == _PROD:
            out = bottom[0].data * bottom[1].data
            for b in bottom[2:]:
                out *= b.data
        elif self.op == _SUM:
            out = self.coeffs[0] * bottom[0].data
            for c, b in zip(self.coeffs[1:], bottom[1:]):
                if c == 1:
                    out += b.data
                else:
                    out += c * b.data
        else:
            a, b = bottom[0].data, bottom[1].data
            first = a > b
            out = xp.where(first, a, b)
            mask = xp.where(first, 0, 1).astype(numpy.int32)
            for i, blob in enumerate(bottom[2:], 2):
                d = blob.data
                wins = d > out
                out = xp.where(wins, d, out)
                mask[wins] = i
            self.mask = mask
        top[0].data[...] = out

    def _backward(self, top, propagate_down, bottom):
        dy = top[0].diff
        for i, (b, prop) in enumerate(zip(bottom, propagate_down)):
            if not prop:
                continue
            if self.op == _PROD:
                if self.stable_prod_grad:
                    grad = None
                    for j, other in enumerate(bottom):
                        if j == i:
                            continue
                        grad = other.data.copy() if grad is None else grad * other.data
                else:
                    grad = top[0].data / b.data
                b.diff[...] = grad * dy
            elif self.op == _SUM:
                c = self.coeffs[i]
                b.diff[...] = dy if c == 1 else c * dy
            else:
                b.diff[...] = dy * (self.mask == i)


# -- Flatten and Reshape: views of the bottom -------------------------------------
def _share_all(top, bottom):
    top.share_data(bottom)
    top.share_diff(bottom)


@register
class FlattenLayer(Layer):
    """Merges axes axis..end_axis into one. The top shares the bottom's data
    and diff, so forward and backward move nothing."""
    type = 'Flatten'
    exact_num_bottom = 1
    exact_num_top = 1
    backward_reads = _NOTHING

    def reshape(self, bottom, top):
        _refuse_inplace(self, bottom, top)
        p = self.layer_param.flatten_param
        start = _axis(self, bottom[0], p.axis, 'flatten_param.axis')
        end = _axis(self, bottom[0], p.end_axis, 'flatten_param.end_axis')
        if end + 1 < start:
            raise _error(self, 'flatten_param.end_axis (%d) comes before flatten_param.axis (%d)'
                         % (p.end_axis, p.axis))
        shape = bottom[0].shape
        top[0].reshape(shape[:start] + (_prod(shape[start:end + 1]),) + shape[end + 1:])
        _share_all(top[0], bottom[0])

    def _forward(self, bottom, top):
        _share_all(top[0], bottom[0])

    def _backward(self, top, propagate_down, bottom):
        pass


@register
class ReshapeLayer(Layer):
    """Gives the bottom's data a new shape: 0 copies a bottom dimension, -1
    is inferred; `axis`/`num_axes` pick the range of axes replaced. The top
    shares the bottom's data and diff."""
    type = 'Reshape'
    exact_num_bottom = 1
    exact_num_top = 1
    backward_reads = _NOTHING

    def layer_setup(self, bottom, top):
        _refuse_inplace(self, bottom, top)
        dims = [int(d) for d in self.layer_param.reshape_param.shape.dim]
        self.copy_axes, self.inferred_axis, self.constant_count = [], -1, 1
        for i, d in enumerate(dims):
            if d == 0:
                self.copy_axes.append(i)
            elif d == -1:
                if self.inferred_axis != -1:
                    raise _error(self, 'reshape_param.shape contains multiple -1 dims; at most '
                                 'a single (1) value of -1 may be specified')
                self.inferred_axis = i
            elif d < -1:
                raise _error(self, 'reshape_param.shape: invalid dimension %d' % d)
            else:
                self.constant_count *= d
        self.dims = dims

    def reshape(self, bottom, top):
        _refuse_inplace(self, bottom, top)
        p = self.layer_param.reshape_param
        b = bottom[0]
        start = p.axis if p.axis >= 0 else b.num_axes + p.axis + 1
        if not 0 <= start <= b.num_axes:
            raise _error(self, 'reshape_param.axis = %d is out of range for a bottom of shape %s'
                         % (p.axis, b.shape_string()))
        if p.num_axes < -1:
            raise _error(self, 'reshape_param.num_axes must be >= 0, or -1 for all (got %d)'
                         % p.num_axes)
        end = b.num_axes if p.num_axes == -1 else start + p.num_axes
        if end > b.num_axes:
            raise _error(self, 'reshape_param: end_axis = axis + num_axes (%d) is out of range '
                         'for a bottom of shape %s' % (end, b.shape_string()))
        shape = list(b.shape[:start]) + list(self.dims) + list(b.shape[end:])
        for i in self.copy_axes:
            if start + i >= b.num_axes:
                raise _error(self, 'reshape_param.shape contains a 0 at index %d, but there is '
                             'no corresponding bottom axis to copy' % i)
            shape[start + i] = b.shape[start + i]
        if self.inferred_axis >= 0:
            explicit = self.constant_count * b.count_axes(0, start) * b.count_axes(end)
            for i in self.copy_axes:
                explicit *= b.shape[start + i]
            if explicit == 0 or b.count % explicit:
                raise _error(self, 'bottom count (%d) must be divisible by the product of the '
                             'specified dimensions (%d)' % (b.count, explicit))
            shape[start + self.inferred_axis] = b.count // explicit
        if _prod(shape) != b.count:
            raise _error(self, 'output count must match input count: reshape_param.shape gives '
                         '%s (%d) for a bottom of shape %s'
                         % (' '.join(str(d) for d in shape), _prod(shape), b.shape_string()))
        top[0].reshape(shape)
        _share_all(top[0], b)

    def _forward(self, bottom, top):
        _share_all(top[0], bottom[0])

    def _backward(self, top, propagate_down, bottom):
        pass


# -- Softmax --------------------------------------------------------------------
@register
class SoftmaxLayer(Layer):
    """Softmax along `axis`; may run in place (backward reads only the top)."""
    type = 'Softmax'
    exact_num_bottom = 1
    exact_num_top = 1
    backward_reads = _TOP
    inplace_ok = True

    def reshape(self, bottom, top):
        self.axis = _axis(self, bottom[0], self.layer_param.softmax_param.axis,
                          'softmax_param.axis')
        top[0].reshape(bottom[0].shape)

    def _forward(self, bottom, top):
        top[0].data[...] = softmax(bottom[0].data, self.axis)

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y, dy = top[0].data, top[0].diff
        dot = (dy * y).sum(axis=self.axis, keepdims=True)
        bottom[0].diff[...] = (dy - dot) * y


# -- ArgMax -----------------------------------------------------------------------
def _ranked(xp, values, top_k):
    """Indices of the top_k largest entries along the last axis, ordered as
    sorting (value, index) pairs in decreasing order: ties go to the larger
    index first."""
    n = values.shape[-1]
    flipped = values[..., ::-1]
    order = xp.argsort(-flipped, axis=-1, kind='stable')[..., :top_k]
    return (n - 1) - order


@register
class ArgMaxLayer(Layer):
    """The indices (and with out_max_val the values) of the top_k largest
    entries, over all of an item's values or along `axis`. No backward."""
    type = 'ArgMax'
    exact_num_bottom = 1
    exact_num_top = 1
    backward_reads = _NOTHING
    has_backward = False

    def layer_setup(self, bottom, top):
        p = self.layer_param.argmax_param
        self.out_max_val = p.out_max_val
        self.top_k = int(p.top_k)
        if self.top_k < 1:
            raise _error(self, 'argmax_param.top_k must not be less than 1 (got %d)' % self.top_k)
        self.has_axis = p.HasField('axis')

    def reshape(self, bottom, top):
        b = bottom[0]
        if self.has_axis:
            self.axis = _axis(self, b, self.layer_param.argmax_param.axis, 'argmax_param.axis')
            if self.top_k > b.shape[self.axis]:
                raise _error(self, 'argmax_param.top_k (%d) must be less than or equal to the '
                             'dimension of the axis (%d)' % (self.top_k, b.shape[self.axis]))
            shape = list(b.shape)
            shape[self.axis] = self.top_k
        else:
            if self.top_k > b.count_axes(1):
                raise _error(self, 'argmax_param.top_k (%d) must be less than or equal to the '
                             'number of classes (%d)' % (self.top_k, b.count_axes(1)))
            shape = [1] * max(b.num_axes, 3)
            shape[0] = b.shape[0] if b.num_axes else 1
            shape[2] = self.top_k
            if self.out_max_val:
                shape[1] = 2
        top[0].reshape(shape)

    def _forward(self, bottom, top):
        xp = _xp(bottom[0].data)
        x = bottom[0].data
        if self.has_axis:
            moved = xp.moveaxis(x, self.axis, -1)
            idx = _ranked(xp, moved, self.top_k)
            if self.out_max_val:
                out = xp.take_along_axis(moved, idx, axis=-1)
            else:
                out = idx.astype(numpy.float32)
            top[0].data[...] = xp.moveaxis(out, -1, self.axis)
        else:
            flat = x.reshape(top[0].shape[0], -1)
            idx = _ranked(xp, flat, self.top_k)
            out = top[0].data.reshape(flat.shape[0], -1, self.top_k)
            out[:, 0] = idx
            if self.out_max_val:
                out[:, 1] = xp.take_along_axis(flat, idx, axis=-1)


# -- Reduction --------------------------------------------------------------------
_R = caffe_pb2.ReductionParameter


@register
class ReductionLayer(Layer):
    """SUM, ASUM, SUMSQ or MEAN over all axes from `axis` on, times coeff."""
    type = 'Reduction'
    exact_num_bottom = 1
    exact_num_top = 1
    backward_reads = _BOTTOM

    def __init__(self, layer_param):
        super().__init__(layer_param)
        self.op = self.layer_param.reduction_param.operation
        if self.op in (_R.SUM, _R.MEAN):
            self.backward_reads = _NOTHING

    def layer_setup(self, bottom, top):
        if self.op not in (_R.SUM, _R.ASUM, _R.SUMSQ, _R.MEAN):
            raise _error(self, 'unknown reduction_param.operation %d' % self.op)

    def reshape(self, bottom, top):
        p = self.layer_param.reduction_param
        axis = _axis(self, bottom[0], p.axis, 'reduction_param.axis')
        top[0].reshape(bottom[0].shape[:axis])
        self.num = bottom[0].count_axes(0, axis)
        self.dim = bottom[0].count_axes(axis)
        self.coeff = numpy.float32(p.coeff)
        if self.op == _R.MEAN:
            self.coeff = numpy.float32(self.coeff / numpy.float32(self.dim))

    def _forward(self, bottom, top):
        xp = _xp(bottom[0].data)
        x = bottom[0].data.reshape(self.num, self.dim)
        if self.op == _R.ASUM:
            r = xp.abs(x).sum(axis=1)
        elif self.op == _R.SUMSQ:
            r = (x * x).sum(axis=1)
        else:
            r = x.sum(axis=1)
        if self.coeff != 1:
            r *= self.coeff
        top[0].data.reshape(self.num)[...] = r

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        xp = _xp(top[0].diff)
        scale = (top[0].diff.reshape(self.num) * self.coeff)[:, None]
        dx = bottom[0].diff.reshape(self.num, self.dim)
        if self.op == _R.ASUM:
            dx[...] = xp.sign(bottom[0].data.reshape(self.num, self.dim)) * scale
        elif self.op == _R.SUMSQ:
            dx[...] = (2 * scale) * bottom[0].data.reshape(self.num, self.dim)
        else:
            dx[...] = scale


# -- Tile -------------------------------------------------------------------------
@register
class TileLayer(Layer):
    """Repeats the bottom `tiles` times along `axis`."""
    type = 'Tile'
    exact_num_bottom = 1
    exact_num_top = 1
    backward_reads = _NOTHING

    def reshape(self, bottom, top):
        p = self.layer_param.tile_param
        if not p.HasField('tiles'):
            raise _error(self, 'tile_param.tiles (the number of tiles) must be specified')
        if p.tiles <= 0:
            raise _error(self, 'tile_param.tiles must be positive (got %d)' % p.tiles)
        axis = _axis(self, bottom[0], p.axis, 'tile_param.axis')
        self.tiles = int(p.tiles)
        self.outer = bottom[0].count_axes(0, axis)
        self.inner = bottom[0].count_axes(axis)
        shape = list(bottom[0].shape)
        shape[axis] *= self.tiles
        top[0].reshape(shape)

    def _forward(self, bottom, top):
        out = top[0].data.reshape(self.outer, self.tiles, self.inner)
        out[...] = bottom[0].data.reshape(self.outer, 1, self.inner)

    def _backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            dy = top[0].diff.reshape(self.outer, self.tiles, self.inner)
            bottom[0].diff.reshape(self.outer, self.inner)[...] = dy.sum(axis=1)


# -- index-driven layers: BatchReindex, Filter, Embed -----------------------------
@register
class BatchReindexLayer(Layer):
    """top[i] = bottom0[bottom1[i]]; backward sums diffs of repeated indices.
    The index bottom takes no gradient."""
    type = 'BatchReindex'
    exact_num_bottom = 2
    exact_num_top = 1
    backward_reads = _NOTHING   # keeps its own copy of the indices

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1

    def reshape(self, bottom, top):
        if bottom[0].num_axes < 1:
            raise _error(self, 'the data bottom must have at least one axis (the one the '
                               'indices select from), got a scalar')
        if bottom[1].num_axes != 1:
            raise _error(self, 'the index bottom must be 1-D, got shape %s'
                         % bottom[1].shape_string())
        top[0].reshape(bottom[1].shape[:1] + bottom[0].shape[1:])

    def _forward(self, bottom, top):
        limit = bottom[0].shape[0] if bottom[0].num_axes else 1
        self.indices = _as_indices(self, bottom[1].data, limit, 'BatchReindex index')
        if top[0].count == 0:
            return
        top[0].data[...] = bottom[0].data[self.indices]

    def _backward(self, top, propagate_down, bottom):
        if propagate_down[1]:
            raise _error(self, 'cannot back-propagate to the index bottom')
        if not propagate_down[0]:
            return
        xp = _xp(top[0].diff)
        diff = bottom[0].diff
        diff[...] = 0
        _scatter_add(xp, diff, self.indices, top[0].diff)


@register
class FilterLayer(Layer):
    """Keeps the items (along axis 0) whose selector value, the last bottom,
    is non-zero. The selector takes no gradient; dropped items get zero."""
    type = 'Filter'
    min_num_bottom = 2
    min_num_top = 1
    backward_reads = _NOTHING   # keeps its own copy of the selected indices

    def allow_force_backward(self, bottom_index):
        return bottom_index != len(self.layer_param.bottom) - 1

    def layer_setup(self, bottom, top):
        if len(top) != len(bottom) - 1:
            raise _error(self, 'needs one top per filtered bottom (%d tops for %d bottoms; the '
                         'last bottom is the selector)' % (len(top), len(bottom)))
        self.first_reshape = True
        self.indices = None

    def _select(self, bottom):
        xp = _xp(bottom[-1].data)
        return xp.nonzero(bottom[-1].data.reshape(-1) != 0)[0]

    def _shape_tops(self, bottom, top, n):
        for b, t in zip(bottom, top):
            t.reshape((n,) + b.shape[1:])

    def reshape(self, bottom, top):
        sel = bottom[-1]
        if sel.num_axes < 1 or any(d != 1 for d in sel.shape[1:]):
            raise _error(self, 'selector blob dimensions must be singletons (1), except the '
                         'first; got %s' % sel.shape_string())
        for i, b in enumerate(bottom[:-1]):
            if b.num_axes < 1 or b.shape[0] != sel.shape[0]:
                raise _error(self, 'each bottom should have the same 0th dimension as the '
                             'selector blob: bottom %d is %s, the selector %s'
                             % (i, b.shape_string(), sel.shape_string()))
        if self.first_reshape:
            n = sel.shape[0]
            self.first_reshape = False
        else:
            n = int(self._select(bottom).size)
        self._shape_tops(bottom, top, n)

    def _forward(self, bottom, top):
        self.indices = self._select(bottom)
        self._shape_tops(bottom, top, int(self.indices.size))
        for b, t in zip(bottom, top):
            if t.count:
                t.data[...] = b.data[self.indices]

    def _backward(self, top, propagate_down, bottom):
        if propagate_down[-1]:
            raise _error(self, 'cannot back-propagate to the selector bottom')
        for b, t, prop in zip(bottom, top, propagate_down):
            if not prop:
                continue
            diff = b.diff
            diff[...] = 0
            if t.count:
                diff[self.indices] = t.diff


@register
class EmbedLayer(Layer):
    """A lookup table: top[..., :] = W[index] (+ bias) for integer indices in
    [0, input_dim). No gradient to the indices; weight diffs accumulate."""
    type = 'Embed'
    exact_num_bottom = 1
    exact_num_top = 1
    backward_reads = _NOTHING   # keeps its own copy of the indices

    def allow_force_backward(self, bottom_index):
        return False

    def layer_setup(self, bottom, top):
        p = self.layer_param.embed_param
        self.num_output, self.input_dim = int(p.num_output), int(p.input_dim)
        if self.num_output <= 0:
            raise _error(self, 'embed_param.num_output must be positive (got %d)'
                         % self.num_output)
        if self.input_dim <= 0:
            raise _error(self, 'embed_param.input_dim must be positive (got %d)' % self.input_dim)
        self.bias_term = p.bias_term
        shapes = [(self.input_dim, self.num_output)]
        if self.bias_term:
            shapes.append((self.num_output,))
        if self.blobs:
            _check_param_shapes(self, shapes)
        else:
            self.blobs = [_new_param_blob(self, 0, shapes[0], p.weight_filler)]
            if self.bias_term:
                self.blobs.append(_new_param_blob(self, 1, shapes[1], p.bias_filler))
        self.indices = None

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape + (self.num_output,))

    def _forward(self, bottom, top):
        self.indices = _as_indices(self, bottom[0].data.reshape(-1), self.input_dim,
                                   'Embed input', check_integer=True)
        out = top[0].data.reshape(-1, self.num_output)
        out[...] = self.blobs[0].data[self.indices]
        if self.bias_term:
            out += self.blobs[1].data

    def _backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            raise _error(self, 'cannot back-propagate to the Embed input')
        dy = top[0].diff.reshape(-1, self.num_output)
        if self.param_needs_backward(0):
            _scatter_add(_xp(dy), self.blobs[0].diff, self.indices, dy)
        if self.bias_term and self.param_needs_backward(1):
            self.blobs[1].diff[...] += dy.sum(axis=0, dtype=self.blobs[1].diff.dtype)


# -- Parameter ----------------------------------------------------------------------
@register
class ParameterLayer(Layer):
    """Exposes a learned blob of parameter_param.shape as its top.

    The top shares the blob's data (from setup, and again on every forward
    as in Caffe). Its diff is the top's own and backward copies it into the blob's
    diff: the values Caffe gets by sharing the diff too, including that a
    second backward before an update replaces the gradient instead of adding
    to it. (A separate diff keeps the gradient safe from code that clears
    parameter diffs after the top diff was written.)"""
    type = 'Parameter'
    exact_num_bottom = 0
    exact_num_top = 1
    backward_reads = _NOTHING

    def layer_setup(self, bottom, top):
        shape = tuple(int(d) for d in self.layer_param.parameter_param.shape.dim)
        if any(d < 0 for d in shape):
            raise _error(self, 'parameter_param.shape has a negative dimension: %s' % (shape,))
        if self.blobs:
            _check_param_shapes(self, [shape])
        else:
            self.blobs = [_new_param_blob(self, 0, shape)]
        top[0].reshape(shape)
        # Caffe shares only from the first forward on; sharing already here
        # lets a memory plan made before any forward see the alias.
        top[0].share_data(self.blobs[0])

    def reshape(self, bottom, top):
        pass

    def _forward(self, bottom, top):
        top[0].share_data(self.blobs[0])

    def _backward(self, top, propagate_down, bottom):
        if self.param_needs_backward(0):
            self.blobs[0].diff[...] = top[0].diff


# -- Accuracy -----------------------------------------------------------------------
@register
class AccuracyLayer(Layer):
    """Top-k classification accuracy (and per-class accuracy as a second top).

    An item counts as correct when fewer than top_k other classes score at
    least as high (>=) as the true class, Caffe's rule, so ties count
    against it. Items whose label is ignore_label are skipped. Not a loss;
    no backward."""
    type = 'Accuracy'
    exact_num_bottom = 2
    min_num_top = 1
    max_num_top = 2
    backward_reads = _NOTHING
    has_backward = False

    def layer_setup(self, bottom, top):
        p = self.layer_param.accuracy_param
        self.top_k = int(p.top_k)
        self.has_ignore = p.HasField('ignore_label')
        self.ignore_label = int(p.ignore_label)

    def reshape(self, bottom, top):
        p = self.layer_param.accuracy_param
        if bottom[1].count == 0 or self.top_k > bottom[0].count // bottom[1].count:
            raise _error(self, 'accuracy_param.top_k (%d) must be less than or equal to the '
                         'number of classes (%d)'
                         % (self.top_k, bottom[0].count // max(bottom[1].count, 1)))
        axis = _axis(self, bottom[0], p.axis, 'accuracy_param.axis')
        self.axis = axis
        self.outer = bottom[0].count_axes(0, axis)
        self.inner = bottom[0].count_axes(axis + 1)
        self.num_labels = bottom[0].shape[axis]
        if self.outer * self.inner != bottom[1].count:
            raise _error(self, 'number of labels must match number of predictions; e.g., if '
                         'label axis == 1 and prediction shape is (N, C, H, W), label count '
                         '(number of labels) must be N*H*W, with integer values in {0, 1, ..., '
                         'C-1}; got predictions %s and labels %s'
                         % (bottom[0].shape_string(), bottom[1].shape_string()))
        top[0].reshape(())
        if len(top) > 1:
            top[1].reshape((self.num_labels,))

    def _forward(self, bottom, top):
        xp = _xp(bottom[0].data)
        scores = bottom[0].data.reshape(self.outer, self.num_labels, self.inner)
        labels = bottom[1].data.reshape(self.outer, self.inner).astype(numpy.int64)
        valid = labels != self.ignore_label if self.has_ignore else \
            xp.ones(labels.shape, dtype=bool)
        checked = labels[valid]
        if checked.size and bool(xp.any((checked < 0) | (checked >= self.num_labels))):
            raise _error(self, 'label values must lie in [0, %d) (found %d..%d)'
                         % (self.num_labels, int(checked.min()), int(checked.max())))
        safe = xp.where(valid, labels, 0)
        truth = xp.take_along_axis(scores, safe[:, None, :], axis=1)
        better = (scores >= truth).sum(axis=1) - 1
        correct = (better < self.top_k) & valid
        count = int(valid.sum())
        hits = int(correct.sum())
        top[0].data[...] = numpy.float32(hits) / numpy.float32(count) if count else 0
        if len(top) > 1:
            n = self.num_labels
            per_label = xp.bincount(safe[valid], minlength=n)[:n].astype(numpy.float32)
            per_hit = xp.bincount(safe[correct], minlength=n)[:n].astype(numpy.float32)
            seen = per_label > 0
            top[1].data[...] = xp.where(seen, per_hit / xp.where(seen, per_label, 1), 0)
