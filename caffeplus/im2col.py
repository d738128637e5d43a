"""Convolution arithmetic shared by Convolution, Deconvolution and Im2col.

Everything here is written against `xp` (numpy or cupy, whichever the
arrays belong to), works for any number of spatial axes, and never loops
over pixels or batch items:

* im2col is one strided copy out of a (zero-padded) window view of the
  input, built with as_strided;
* the product with the filters is ONE batched matmul per batch chunk, shaped
  (G, M/G, Kg) x (G, Kg, n*P), so BLAS sees many images at once; on the GPU
  the chunk is the whole batch, on the CPU a chunk's columns take about
  CPU_CHUNK_BYTES['col'] (cache blocking: measured faster than one chunk);
* col2im (the adjoint) accumulates the column buffer back into the image
  one kernel offset at a time (prod(kernel) vectorised adds).

Shapes (G = group, n = images in a chunk, P = prod(output spatial),
Kg = C/G*prod(kernel)): images (n, C, *spatial); gemm columns (G, Kg, n*P),
whose n*P order is batch-minor for stride-1 convolutions (see "layouts");
Caffe's own per-image column buffer is (C*prod(kernel), *out), which the
Im2col layer exposes (im2col_forward).

Scratch arrays on the CPU come from a small per-thread pool so the large
column buffers are not page-faulted in afresh on every call; on the GPU,
CuPy's memory pool plays that role.
"""
import collections
import threading

import numpy

from caffeplus import backend

FLOAT = numpy.float32


# -- geometry ----------------------------------------------------------------
def c_div(a, b):
    """Integer division truncating toward zero, as C++ does."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


class ConvGeometry(collections.namedtuple('ConvGeometry', 'kernel stride pad dilation')):
    """Per-spatial-axis kernel, stride, pad and dilation (tuples of ints)."""
    __slots__ = ()

    @property
    def nd(self):
        return len(self.kernel)

    def extent(self, i):
        return self.dilation[i] * (self.kernel[i] - 1) + 1

    @property
    def kernel_count(self):
        n = 1
        for k in self.kernel:
            n *= k
        return n

    def conv_out_shape(self, in_shape):
        """Caffe's rule: (in + 2p - extent) / s + 1, C integer division."""
        return tuple(c_div(in_shape[i] + 2 * self.pad[i] - self.extent(i), self.stride[i]) + 1
                     for i in range(self.nd))

    def deconv_out_shape(self, in_shape):
        """The inverse of the convolution rule: s*(in - 1) + extent - 2p."""
        return tuple(self.stride[i] * (in_shape[i] - 1) + self.extent(i) - 2 * self.pad[i]
                     for i in range(self.nd))

    @property
    def is_1x1(self):
        return all(k == 1 for k in self.kernel) and all(s == 1 for s in self.stride) and \
            all(p == 0 for p in self.pad)


def _prod(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


# -- scratch -----------------------------------------------------------------
_local = threading.local()


def scratch(xp, shape, slot, zero=False):
    """A float32 array of `shape` for temporary use inside one call.

    On the CPU it is a view of a per-thread buffer named `slot` (grown as
    needed and reused), so two arrays in use at once must use two slots."""
    shape = tuple(int(d) for d in shape)
    if xp is not numpy:
        return xp.zeros(shape, FLOAT) if zero else xp.empty(shape, FLOAT)
    pool = getattr(_local, 'pool', None)
    if pool is None:
        pool = _local.pool = {}
    n = _prod(shape)
    buf = pool.get(slot)
    if buf is None or buf.size < n:
        buf = pool[slot] = numpy.empty(max(n, 1), FLOAT)
    out = buf[:n].reshape(shape)
    if zero:
        out.fill(0)
    return out


def release_scratch():
    """Drop this thread's cached scratch buffers."""
    _local.pool = {}


def scratch_bytes():
    pool = getattr(_local, 'pool', None) or {}
    return sum(b.nbytes for b in pool.values())


# -- batch chunks (CPU cache blocking) --------------------------------------
# On the CPU, the column buffer of a whole batch (tens of MB) would stream
# through memory between im2col, the GEMM and col2im; chunks of the batch
# whose columns fit in the last-level cache run faster and need less scratch.
# On the GPU one chunk (the whole batch) keeps the device busy.
CPU_CHUNK_BYTES = {'col': 8 << 20, 'plane': 2 << 20}


def batch_chunks(xp, n, item_bytes, kind='col'):
    """Slices of range(n) whose items take about CPU_CHUNK_BYTES[kind]
    (None there: one chunk, e.g. one GEMM over the whole batch)."""
    budget = CPU_CHUNK_BYTES.get(kind)
    if xp is not numpy or n <= 1 or budget is None:
        return [slice(0, n)]
    step = max(1, int(budget // max(1, item_bytes)))
    if step >= n:
        return [slice(0, n)]
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


# -- layouts -----------------------------------------------------------------
# The gemm columns of a batch chunk of n images come in one of two orders:
#   batch-minor  (C, *kernel, *out, n): with stride 1, each output row of
#                each kernel offset is one contiguous run of out[-1]*n values
#                in the (C, *padded, n) image, so im2col and col2im move long
#                runs instead of rows of a few floats;
#   batch-major  (C, *kernel, n, *out): strided convolutions, and rows that
#                are long anyway (measured: batch-minor wins below ~24).
# The gemm does not care about the order of its N*P columns; to_groups and
# from_groups convert images from and to the same order.
BATCH_MINOR_MAX_ROW = 24


def batch_minor(geom, col_spatial):
    return all(s == 1 for s in geom.stride) and geom.nd > 0 and \
        col_spatial[-1] < BATCH_MINOR_MAX_ROW


def _img_shape(x_shape, geom, minor):
    """The channel-major padded image buffer's shape for x (n, C, *S)."""
    n, c = x_shape[:2]
    padded = tuple(x_shape[2 + i] + 2 * geom.pad[i] for i in range(geom.nd))
    return (c,) + padded + (n,) if minor else (c, n) + padded


def _img_interior(x_shape, geom, minor):
    inner = tuple(slice(p, p + s) for p, s in zip(geom.pad, x_shape[2:]))
    return (slice(None),) + inner + (slice(None),) if minor else \
        (slice(None), slice(None)) + inner


def _img_perm(nd, minor):
    """Axes taking an (n, C, *S) array to the image buffer's order."""
    return (1,) + tuple(range(2, 2 + nd)) + (0,) if minor else (1, 0) + tuple(range(2, 2 + nd))


def _img_unperm(nd, minor):
    """Axes taking an image buffer's interior back to (n, C, *S)."""
    return (1 + nd, 0) + tuple(range(1, 1 + nd)) if minor else (1, 0) + tuple(range(2, 2 + nd))


def _channel_major_padded(x, geom, minor, slot='pad'):
    """x (n, C, *S) copied into a zero-padded, channel-major scratch image."""
    xp = backend.get_array_module(x)
    out = scratch(xp, _img_shape(x.shape, geom, minor), slot, zero=any(geom.pad))
    out[_img_interior(x.shape, geom, minor)] = x.transpose(_img_perm(geom.nd, minor))
    return out


def _col_view_shape(c, n, geom, out_shape, minor):
    k, o = tuple(geom.kernel), tuple(out_shape)
    return (c,) + k + o + (n,) if minor else (c,) + k + (n,) + o


def _offset_slices(geom, out_shape):
    """(kernel index, spatial slices into the padded image) per kernel offset."""
    nd = geom.nd
    for idx in numpy.ndindex(*geom.kernel):
        yield idx, tuple(slice(idx[i] * geom.dilation[i],
                               idx[i] * geom.dilation[i] + (out_shape[i] - 1) * geom.stride[i] + 1,
                               geom.stride[i]) for i in range(nd))


# -- im2col / col2im ---------------------------------------------------------
def _padded(x, geom, slot):
    """x (N, C, *S) with `geom.pad` zeros around each spatial axis."""
    if not any(geom.pad):
        return x
    xp = backend.get_array_module(x)
    nd = geom.nd
    shape = x.shape[:2] + tuple(x.shape[2 + i] + 2 * geom.pad[i] for i in range(nd))
    out = scratch(xp, shape, slot, zero=True)
    out[(slice(None), slice(None)) + tuple(slice(p, p + s) for p, s in
                                           zip(geom.pad, x.shape[2:]))] = x
    return out


def window_view(xpad, geom, out_shape, minor=None):
    """A read-only strided view of every kernel window of a padded image; no
    copy. xpad (A, B, *S) gives (A, B, *kernel, *out) with element
    [a, b, k.., o..] = xpad[a, b, o*stride + k*dilation] (minor None);
    a channel-major image buffer gives the gemm column order of `minor`."""
    xp = backend.get_array_module(xpad)
    nd = geom.nd
    st = xpad.strides
    sp0 = 1 if minor else 2
    for i in range(nd):
        last = (geom.kernel[i] - 1) * geom.dilation[i] + (out_shape[i] - 1) * geom.stride[i]
        if out_shape[i] < 1 or last >= xpad.shape[sp0 + i] or last < 0:
            raise ValueError('window out of range on spatial axis %d' % i)
    kshape, oshape = tuple(geom.kernel), tuple(out_shape)
    kst = tuple(st[sp0 + i] * geom.dilation[i] for i in range(nd))
    ost = tuple(st[sp0 + i] * geom.stride[i] for i in range(nd))
    if minor is None:
        shape = tuple(xpad.shape[:2]) + kshape + oshape
        strides = tuple(st[:2]) + kst + ost
    elif minor:       # (C, *Sp, n) -> (C, *k, *o, n)
        shape = (xpad.shape[0],) + kshape + oshape + (xpad.shape[-1],)
        strides = (st[0],) + kst + ost + (st[-1],)
    else:             # (C, n, *Sp) -> (C, *k, n, *o)
        shape = (xpad.shape[0],) + kshape + (xpad.shape[1],) + oshape
        strides = (st[0],) + kst + (st[1],) + ost
    return xp.lib.stride_tricks.as_strided(xpad, shape=shape, strides=strides)


def unfold(x, geom, out_shape, group, minor, slot='col'):
    """im2col of x (n, C, *S) into gemm columns (G, Kg, n*P)."""
    xp = backend.get_array_module(x)
    n, c = x.shape[:2]
    if geom.is_1x1:
        return to_groups(x, group, minor, slot)
    img = _channel_major_padded(x, geom, minor)
    col = scratch(xp, _col_view_shape(c, n, geom, out_shape, minor), slot)
    col[...] = window_view(img, geom, out_shape, minor)
    return col.reshape(group, (c // group) * geom.kernel_count, n * _prod(out_shape))


def fold(col, x_shape, geom, out_shape, minor, out=None, slot='pad'):
    """col2im, the adjoint of unfold: gemm columns (G, Kg, n*P) summed back
    into an (n, C, *S) image, written into `out` (overwritten) if given."""
    xp = backend.get_array_module(col)
    n, c = x_shape[:2]
    nd = geom.nd
    if out is None:
        out = xp.empty(tuple(x_shape), FLOAT)
    if geom.is_1x1:
        return from_groups(col, out, None, minor)
    colv = col.reshape(_col_view_shape(c, n, geom, out_shape, minor))
    acc = scratch(xp, _img_shape(x_shape, geom, minor), slot, zero=True)
    for idx, sl in _offset_slices(geom, out_shape):
        dst = (slice(None),) + sl + (slice(None),) if minor else (slice(None), slice(None)) + sl
        acc[dst] += colv[(slice(None),) + idx]
    out[...] = acc[_img_interior(x_shape, geom, minor)].transpose(_img_unperm(nd, minor))
    return out


def fold_view(colv, x_shape, geom, out_shape, out=None, slot='pad'):
    """col2im from an (n, C, *kernel, *out) view (any strides), e.g. Caffe's
    own column layout."""
    xp = backend.get_array_module(colv)
    nd = geom.nd
    padded = any(geom.pad)
    if out is None:
        out = xp.empty(tuple(x_shape), FLOAT)
    if padded:
        pshape = tuple(x_shape[:2]) + tuple(x_shape[2 + i] + 2 * geom.pad[i] for i in range(nd))
        acc = scratch(xp, pshape, slot, zero=True)
    else:
        acc = out
        acc.fill(0)
    lead = (slice(None), slice(None))
    for idx, sl in _offset_slices(geom, out_shape):
        acc[lead + sl] += colv[lead + idx]
    if padded:
        out[...] = acc[lead + tuple(slice(p, p + s) for p, s in zip(geom.pad, x_shape[2:]))]
    return out


def to_groups(y, group, minor, slot):
    """(n, C, *S) -> (G, C/G, n*P), in the gemm column order of `minor`."""
    xp = backend.get_array_module(y)
    n, c = y.shape[:2]
    p = _prod(y.shape[2:])
    if n == 1:
        return y.reshape(group, c // group, p)
    if minor:
        out = scratch(xp, (c, p, n), slot)
        out[...] = y.reshape(n, c, p).transpose(1, 2, 0)
    else:
        out = scratch(xp, (c, n, p), slot)
        out[...] = y.reshape(n, c, p).transpose(1, 0, 2)
    return out.reshape(group, c // group, n * p)


def from_groups(yg, y, bias, minor):
    """Write gemm output yg (G, C/G, n*P) into y (n, C, *S), adding bias (C,)."""
    xp = backend.get_array_module(y)
    n, c = y.shape[:2]
    p = _prod(y.shape[2:])
    if minor:
        src = yg.reshape(c, p, n).transpose(2, 0, 1)
    else:
        src = yg.reshape(c, n, p).transpose(1, 0, 2)
    dst = y.reshape(n, c, p)
    if bias is None:
        dst[...] = src
    else:
        xp.add(src, bias.reshape(1, c, 1), out=dst)
    return y


def _matmul(a, b, out):
    xp = backend.get_array_module(a)
    return xp.matmul(a, b, out=out)


# -- convolution -------------------------------------------------------------
def _col_item_bytes(channels_im, geom, col_spatial):
    return 4 * channels_im * geom.kernel_count * _prod(col_spatial)


def conv_forward(x, w, b, geom, group, y):
    """y[...] = conv(x, w) + b. x (N, C, *S), w (M, C/G, *k), b (M,) or None,
    y (N, M, *O) with O = geom.conv_out_shape(S)."""
    xp = backend.get_array_module(x)
    m = w.shape[0]
    out_shape = y.shape[2:]
    minor = batch_minor(geom, out_shape)
    wg = w.reshape(group, m // group, -1)
    for sl in batch_chunks(xp, x.shape[0], _col_item_bytes(x.shape[1], geom, out_shape)):
        col = unfold(x[sl], geom, out_shape, group, minor)       # (G, Kg, n*P)
        yg = scratch(xp, (group, m // group, col.shape[2]), 'gemm')
        _matmul(wg, col, yg)
        from_groups(yg, y[sl], b, minor)
    return y


def conv_backward(x, w, dy, geom, group, dx=None, dw=None, db=None):
    """Gradients of conv_forward. dx (overwritten), dw and db (accumulated,
    as Caffe's param diffs) are computed only when given."""
    xp = backend.get_array_module(dy)
    m = w.shape[0]
    out_shape = dy.shape[2:]
    minor = batch_minor(geom, out_shape)
    if db is not None:
        db += dy.reshape(dy.shape[0], m, -1).sum(axis=(0, 2), dtype=FLOAT)
    if dw is None and dx is None:
        return
    wg = w.reshape(group, m // group, -1)
    dwg = dw.reshape(wg.shape) if dw is not None else None
    chunks = list(batch_chunks(xp, x.shape[0], _col_item_bytes(x.shape[1], geom, out_shape)))
    # Every read of x before the first write of dx, as cuDNN's filter call
    # before its data call: a memory plan may put dx where x was
    # (caffeplus.memory.recompute.again_lives).
    passes = [(True, False), (False, True)] if len(chunks) > 1 and dwg is not None and \
        dx is not None else [(True, True)]
    for want_dw, want_dx in passes:
        for sl in chunks:
            dyg = to_groups(dy[sl], group, minor, 'dy')           # (G, M/G, n*P)
            if dwg is not None and want_dw:
                col = unfold(x[sl], geom, out_shape, group, minor)
                dwg += xp.matmul(dyg, col.transpose(0, 2, 1))     # (G, M/G, Kg)
            if dx is not None and want_dx:
                dcol = scratch(xp, (group, wg.shape[2], dyg.shape[2]), 'col')
                _matmul(wg.transpose(0, 2, 1), dyg, dcol)
                fold(dcol, x[sl].shape, geom, out_shape, minor, out=dx[sl])


def deconv_forward(x, w, b, geom, group, y):
    """Caffe's Deconvolution: the transpose of conv. x (N, C, *S),
    w (C, M/G, *k), y (N, M, *O) with O = geom.deconv_out_shape(S)."""
    xp = backend.get_array_module(x)
    c = x.shape[1]
    minor = batch_minor(geom, x.shape[2:])
    wg = w.reshape(group, c // group, -1)                         # (G, C/G, Kg)
    for sl in batch_chunks(xp, x.shape[0], _col_item_bytes(y.shape[1], geom, x.shape[2:])):
        xg = to_groups(x[sl], group, minor, 'dy')                 # (G, C/G, n*P)
        col = scratch(xp, (group, wg.shape[2], xg.shape[2]), 'col')
        _matmul(wg.transpose(0, 2, 1), xg, col)
        fold(col, y[sl].shape, geom, x.shape[2:], minor, out=y[sl])
    if b is not None:
        y += b.reshape((1, -1) + (1,) * geom.nd)
    return y


def deconv_backward(x, w, dy, geom, group, dx=None, dw=None, db=None):
    xp = backend.get_array_module(dy)
    c = x.shape[1]
    m = dy.shape[1]
    minor = batch_minor(geom, x.shape[2:])
    if db is not None:
        db += dy.reshape(dy.shape[0], m, -1).sum(axis=(0, 2), dtype=FLOAT)
    if dw is None and dx is None:
        return
    wg = w.reshape(group, c // group, -1)
    dwg = dw.reshape(wg.shape) if dw is not None else None
    for sl in batch_chunks(xp, x.shape[0], _col_item_bytes(m, geom, x.shape[2:])):
        col = unfold(dy[sl], geom, x.shape[2:], group, minor)     # (G, Kg, n*P)
        if dwg is not None:
            xg = to_groups(x[sl], group, minor, 'dy')
            dwg += xp.matmul(xg, col.transpose(0, 2, 1))          # (G, C/G, Kg)
        if dx is not None:
            dxg = scratch(xp, (group, c // group, col.shape[2]), 'gemm')
            _matmul(wg, col, dxg)
            from_groups(dxg, dx[sl], None, minor)


# -- Caffe's column buffer (the Im2col layer) --------------------------------
def im2col_forward(x, geom, y):
    """y (N, C*prod(k), *O) = Caffe's per-image im2col of x (N, C, *S)."""
    n, c = x.shape[:2]
    out_shape = y.shape[2:]
    view = window_view(_padded(x, geom, 'pad'), geom, out_shape)
    y.reshape((n, c) + tuple(geom.kernel) + tuple(out_shape))[...] = view
    return y


def im2col_backward(dy, geom, dx):
    """col2im of dy (N, C*prod(k), *O) into dx (N, C, *S) (overwritten)."""
    n, c = dx.shape[:2]
    out_shape = dy.shape[2:]
    colv = dy.reshape((n, c) + tuple(geom.kernel) + tuple(out_shape))
    return fold_view(colv, dx.shape, geom, out_shape, out=dx)


def conv_workspace_bytes(x_shape, out_shape, geom, channels_im, xp=numpy):
    """Bytes of the column buffer one call uses (one batch chunk's worth)."""
    item = _col_item_bytes(channels_im, geom, out_shape)
    chunks = batch_chunks(xp, x_shape[0], item)
    return item * (chunks[0].stop - chunks[0].start)
