"""Blob: a shape plus `data` and `diff` arrays, as in Caffe.

A blob does not own its memory: it holds two Storage handles, and a memory
plan (or sharing, as in-place layers, Split and shared parameters need) can
point several blobs at one Storage or hand a Storage a view into an arena.
`data`/`diff` return views of the storage shaped like the blob, so writes
through them (pycaffe's `blob.data[...] = x`) reach the net.
"""
import numpy

from caffeplus import backend
from caffeplus.errors import CaffeplusError, FormatError, ValueCountError

MAX_BLOB_AXES = 32
# A bound for shapes read from files, so a corrupt header cannot make us
# allocate terabytes: 2**34 floats is 64 GiB.
MAX_BLOB_COUNT = 2 ** 34

FLOAT32 = numpy.dtype(numpy.float32)

# -- virtual allocation (shape-only builds) -----------------------------------
# The memory planner builds big nets on the CPU only to read their shapes
# (caffeplus.memory.shapes.shape_only()). While this switch is on, a CPU
# Storage gets a writable zero-strided view of a single float instead of
# `count` floats: every blob has its real shape and count but costs no
# memory, writes through `blob.data[...] = x` land in that one float, and
# Blob.data = x / Blob.diff = x skip the copy. A net built this way is for
# planning only: its values are meaningless and it must not be run.
_VIRTUAL = {'on': False}


def set_virtual_allocation(on):
    """Turn virtual allocation on or off; returns the previous setting."""
    previous = _VIRTUAL['on']
    _VIRTUAL['on'] = bool(on)
    return previous


def virtual_allocation():
    """Whether virtual allocation is on (a shape-only build)."""
    return _VIRTUAL['on']


def virtual_array(count):
    """A writable float32 array of `count` elements that all alias one float."""
    return numpy.lib.stride_tricks.as_strided(numpy.zeros(1, dtype=numpy.float32),
                                              shape=(max(int(count), 1),), strides=(0,))


def is_virtual(array):
    return isinstance(array, numpy.ndarray) and array.size > 1 and not any(array.strides)


# -- host mirror (pycaffe in GPU mode) -----------------------------------------
# Caffe's SyncedMemory: in GPU mode a Storage's `array` is a CuPy array and
# pycaffe's net.blobs[name].data reads a NumPy mirror, `host`. `head` says
# which copy is newer. Every device access (Blob.data/.diff, what layers use)
# may write, so it marks the device newer (Caffe's mutable_gpu_data); every
# host access through host_view() first copies device->host if the device
# is newer, then marks the host newer (pycaffe hands out mutable_cpu_data),
# so the next device access copies host->device first.
HEAD_SYNCED, HEAD_DEVICE, HEAD_HOST = 'synced', 'device', 'host'


def _on_device(array):
    return type(array).__module__.startswith('cupy')


class Storage:
    """A flat buffer that one or more blobs view: float32, or on the GPU the
    16-bit type a net's precision gives its activations (`dtype`)."""
    __slots__ = ('array', 'released_reason', 'host', 'head', 'dtype')

    def __init__(self):
        self.array = None
        self.released_reason = None
        self.host = None            # NumPy mirror of a device array (pycaffe)
        self.head = HEAD_SYNCED
        self.dtype = FLOAT32

    def ensure(self, count, xp):
        if _VIRTUAL['on'] and xp is numpy:      # see "virtual allocation" above
            if self.array is None or self.array.size < count:
                self.array = virtual_array(count)
            return self.array
        if self.head is HEAD_HOST:               # pycaffe wrote the host mirror
            self._push_host()
        # (16-bit storage is the GPU's: the CPU emulates it in float32.)
        dtype = self.dtype if xp is not numpy else FLOAT32
        if self.array is None or self.array.size < count or \
                backend.get_array_module(self.array) is not xp or self.array.dtype != dtype:
            old = self.array
            self.array = xp.zeros(max(count, 1), dtype=dtype)
            if old is not None and old.size:
                n = min(old.size, count)
                if backend.get_array_module(old) is xp:
                    self.array[:n] = old[:n]
                elif xp is numpy:
                    self.array[:n] = backend.to_numpy(old[:n])
                else:
                    self.array[:n] = xp.asarray(old[:n]).astype(dtype, copy=False)
        if xp is not numpy:
            self.head = HEAD_DEVICE
        return self.array

    def _push_host(self):
        """Host mirror -> device array (the host copy is newer)."""
        self.head = HEAD_SYNCED
        if self.host is not None and self.array is not None and _on_device(self.array):
            n = min(self.host.size, self.array.size)
            if self.array.dtype == FLOAT32:
                self.array[:n].set(self.host[:n])
            else:           # a 16-bit device array: its values, rounded on the device
                import cupy
                self.array[:n] = cupy.asarray(self.host[:n])

    def host_view(self, count):
        """The NumPy array pycaffe reads and writes: in CPU mode the array
        itself; in GPU mode the host mirror, synced from the device if the
        device is newer, and marked newer itself (pycaffe may write it)."""
        xp = backend.xp()
        if xp is numpy:
            return self.ensure(count, numpy)
        arr = self.array
        if arr is None or arr.size < count or not _on_device(arr):
            arr = self.ensure(count, xp)
        stale = self.head is HEAD_DEVICE
        if self.host is None or self.host.size != arr.size:
            self.host = numpy.empty(arr.size, dtype=numpy.float32)
            stale = True
        if stale:
            if arr.dtype == FLOAT32:
                arr.get(out=self.host)
            else:           # a 16-bit device array: pycaffe reads float32 values
                self.host[...] = arr.get()
        self.head = HEAD_HOST
        _host_views[0] += 1
        return self.host


# How many times a host mirror was handed out (and may have been written):
# a memory plan looks for newer mirrors only when this moved.
_host_views = [0]


def host_views():
    return _host_views[0]


def same_data(a, b):
    """Whether two blobs are one array (in place, or shared by a plan)."""
    return a is b or a.data_storage is b.data_storage


def same_diff(a, b):
    return a is b or a.diff_storage is b.diff_storage


def shape_string(shape):
    """Caffe's rendering: '64 20 24 24 (737280)', and '(1)' for a scalar."""
    return ''.join('%d ' % d for d in shape) + '(%d)' % _prod(shape)


def _prod(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


_shape_changes = [0]


def shape_changes():
    """How many times a blob's shape has changed in this process: a memory
    plan checks whether its buffers still fit only when this moved."""
    return _shape_changes[0]


class Blob:
    # The order of a 4-D blob's values in memory: 'NCHW' (Caffe's), or
    # 'NHWC' (channels-last, caffeplus.layout) under the same logical shape.
    layout = 'NCHW'

    def __init__(self, shape=(), name=''):
        self.name = name
        self._shape = ()
        self._count = 1
        self._data = Storage()
        self._diff = Storage()
        self.reshape(shape)

    # -- shape ---------------------------------------------------------------
    def reshape(self, *shape):
        if len(shape) == 1 and shape[0].__class__ is tuple and shape[0] == self._shape:
            # The shape it has (every forward reshapes every top, as Caffe's
            # does): checked when it was set.
            return
        if len(shape) == 1 and not isinstance(shape[0], (int, numpy.integer)):
            shape = tuple(shape[0])
        shape = tuple(int(d) for d in shape)
        if len(shape) > MAX_BLOB_AXES:
            raise CaffeplusError('blob %s: %d axes is more than the %d allowed'
                                 % (self.name, len(shape), MAX_BLOB_AXES))
        for d in shape:
            if d < 0:
                raise CaffeplusError('blob %s: negative dimension in shape %s'
                                     % (self.name, shape))
        check_count(shape, 'blob %s' % self.name)
        if shape != self._shape:
            _shape_changes[0] += 1
        self._shape = shape
        self._count = _prod(shape)

    def reshape_like(self, other):
        self.reshape(other.shape)

    @property
    def shape(self):
        return self._shape

    @property
    def count(self):
        return self._count

    def count_axes(self, start, end=None):
        end = self.num_axes if end is None else end
        return _prod(self._shape[start:end])

    @property
    def num_axes(self):
        return len(self._shape)

    def canonical_axis_index(self, axis):
        n = self.num_axes
        if not -n <= axis < n:
            raise CaffeplusError('axis %d out of range for %d-D blob %s with shape %s'
                                 % (axis, n, self.name, self.shape_string()))
        return axis + n if axis < 0 else axis

    def legacy_shape(self, index):
        """Caffe's num/channels/height/width: missing leading axes read as 1."""
        if self.num_axes > 4:
            raise CaffeplusError('blob %s has more than 4 axes' % self.name)
        if index >= self.num_axes or index < -self.num_axes:
            return 1
        return self._shape[index]

    num = property(lambda self: self.legacy_shape(0))
    channels = property(lambda self: self.legacy_shape(1))
    height = property(lambda self: self.legacy_shape(2))
    width = property(lambda self: self.legacy_shape(3))

    def shape_string(self):
        return shape_string(self._shape)

    # -- arrays --------------------------------------------------------------
    def _view(self, storage, which):
        if storage.released_reason is not None:
            raise CaffeplusError('blob %s: its %s was released by the memory plan (%s)'
                                 % (self.name, which, storage.released_reason))
        arr = storage.ensure(self._count, backend.xp())
        return arr[:self._count].reshape(self._shape)

    @property
    def data(self):
        return self._view(self._data, 'data')

    @data.setter
    def data(self, value):
        self._assign(self.data, value, 'data')

    @property
    def diff(self):
        return self._view(self._diff, 'diff')

    @diff.setter
    def diff(self, value):
        self._assign(self.diff, value, 'diff')

    def _assign(self, view, value, which):
        if _VIRTUAL['on'] and is_virtual(view):  # shape-only build: nothing to store
            if numpy.size(value) != view.size:
                raise CaffeplusError('cannot assign an array of shape %s to the %s of blob %s '
                                     'with shape %s' % (numpy.shape(value), which, self.name,
                                                        view.shape))
            return
        xp = backend.get_array_module(view)
        # Host values into a device blob go straight into its view (views
        # are contiguous): a device copy of them first (xp.asarray) would be
        # freed at once and its chunk of CuPy's pool split for later blobs,
        # leaving bytes no array uses that the pool cannot give back (fc6's
        # filled weights: 32 MiB of a 144 MiB chunk, dev/pool_census.py).
        host_to_device = xp is not numpy and backend.get_array_module(value) is numpy
        if xp is numpy:
            value = numpy.asarray(backend.to_numpy(value), dtype=numpy.float32)
        elif host_to_device:
            # (A 16-bit view takes its own type: CuPy copies only like to like.)
            value = numpy.ascontiguousarray(value, dtype=view.dtype)
        else:
            value = xp.asarray(value, dtype=view.dtype)
        if value.shape != view.shape and value.size != view.size:
            raise CaffeplusError('cannot assign an array of shape %s to the %s of blob %s '
                                 'with shape %s' % (value.shape, which, self.name, view.shape))
        if host_to_device:
            view.set(value.reshape(view.shape))
        else:
            view[...] = value.reshape(view.shape)

    def set_storage_dtype(self, dtype):
        """Store this blob's data and diff as `dtype` on the GPU: set before
        anything is allocated (a net sets its 16-bit activations up so,
        caffeplus.precision)."""
        self._data.dtype = self._diff.dtype = numpy.dtype(dtype)

    def share_data(self, other):
        if self._count != other._count:
            raise CaffeplusError('cannot share data of blob %s (%s) with %s (%s)'
                                 % (self.name, self.shape_string(), other.name, other.shape_string()))
        self._data = other._data

    def share_diff(self, other):
        if self._count != other._count:
            raise CaffeplusError('cannot share diff of blob %s with %s: counts differ'
                                 % (self.name, other.name))
        self._diff = other._diff

    @property
    def data_storage(self):
        return self._data

    @property
    def diff_storage(self):
        return self._diff

    # -- protobuf ------------------------------------------------------------
    def shape_equals(self, proto):
        if proto.HasField('num') or proto.HasField('channels') or \
                proto.HasField('height') or proto.HasField('width'):
            return (self.num_axes <= 4 and self.legacy_shape(-4) == proto.num and
                    self.legacy_shape(-3) == proto.channels and
                    self.legacy_shape(-2) == proto.height and
                    self.legacy_shape(-1) == proto.width)
        return tuple(proto.shape.dim) == self._shape

    def from_proto(self, proto, reshape=True):
        shape = proto_shape(proto)
        if reshape:
            self.reshape(shape)
        elif not self.shape_equals(proto):
            raise FormatError('blob %s: shape mismatch: stored %s, expected %s'
                              % (self.name, shape_string(shape), self.shape_string()))
        self.data = proto_array(proto, 'data', self._count).reshape(self._shape)
        diff = proto_array(proto, 'diff', self._count, required=False)
        if diff is not None:
            self.diff = diff.reshape(self._shape)

    def to_proto(self, proto, write_diff=False):
        proto.Clear()
        proto.shape.dim.extend(self._shape)
        proto.data.extend(backend.to_numpy(self.data).ravel().tolist())
        if write_diff:
            proto.diff.extend(backend.to_numpy(self.diff).ravel().tolist())
        return proto

    def __repr__(self):
        return '<Blob %s %s>' % (self.name, self._shape)


class HostBlob:
    """What pycaffe's net.blobs / net.params hand out in GPU mode: the Blob,
    with .data and .diff as host NumPy arrays kept in sync with the device
    (see "host mirror" above). Everything else is the Blob's own."""
    __slots__ = ('_blob',)

    def __init__(self, blob):
        object.__setattr__(self, '_blob', blob)

    def __getattr__(self, name):
        return getattr(self._blob, name)

    def __setattr__(self, name, value):
        if name in ('data', 'diff'):
            object.__setattr__(self, name, value)   # the properties below
        else:
            setattr(self._blob, name, value)

    def _host(self, storage, which):
        b = self._blob
        if storage.released_reason is not None:
            raise CaffeplusError('blob %s: its %s was released by the memory plan (%s)'
                                 % (b.name, which, storage.released_reason))
        view = storage.host_view(b.count)[:b.count]
        if b.layout == 'NHWC':         # Caffe's order, as a view of the channels-last values
            n, c, h, w = b.shape
            return view.reshape(n, h, w, c).transpose(0, 3, 1, 2)
        return view.reshape(b.shape)

    @property
    def data(self):
        return self._host(self._blob.data_storage, 'data')

    @data.setter
    def data(self, value):
        self._blob._assign(self.data, value, 'data')

    @property
    def diff(self):
        return self._host(self._blob.diff_storage, 'diff')

    @diff.setter
    def diff(self, value):
        self._blob._assign(self.diff, value, 'diff')

    @property
    def blob(self):
        """The wrapped Blob (device arrays)."""
        return self._blob

    def __repr__(self):
        return '<Blob %s %s (host view)>' % (self._blob.name, self._blob.shape)


def host_blob(blob):
    """pycaffe's view of `blob`: the Blob itself in CPU mode, a HostBlob in GPU mode."""
    return HostBlob(blob) if backend.mode() == backend.GPU else blob


def check_count(shape, what='blob'):
    """Refuse a shape that claims more than MAX_BLOB_COUNT values, before
    anything is allocated for it (a corrupt file, a typo in a prototxt).

    The product of the non-zero dimensions is bounded too: a shape such as
    (0, 2**62, 2**62) holds nothing but cannot be an array either."""
    limit = MAX_BLOB_COUNT
    nonzero = _prod(max(int(d), 1) for d in shape)
    if nonzero > limit:
        count = _prod(shape)
        raise CaffeplusError(
            '%s: shape %s claims %d values%s, more than the %d (%g GiB of float32) a blob '
            'may hold; is a dimension mistyped or the file corrupt?'
            % (what, ' x '.join(str(int(d)) for d in shape) or '()', count,
               ' (its non-zero dimensions %d)' % nonzero if count != nonzero else '',
               limit, limit * 4.0 / 2 ** 30))


def proto_shape(proto):
    """The shape a BlobProto describes: `shape`, or the legacy 4-D fields."""
    if proto.HasField('num') or proto.HasField('channels') or \
            proto.HasField('height') or proto.HasField('width'):
        shape = (proto.num, proto.channels, proto.height, proto.width)
    else:
        shape = tuple(proto.shape.dim)
    if len(shape) > MAX_BLOB_AXES or any(d < 0 for d in shape):
        raise FormatError('invalid blob shape %s' % (shape,))
    try:
        check_count(shape, 'blob')
    except CaffeplusError as exc:
        raise FormatError(str(exc))
    return shape


def proto_array(proto, which, count, required=True):
    """The float32 values of a BlobProto's data or diff: float, double, or
    the raw FLOAT16 / BFLOAT16 / FLOAT bytes NVCaffe can write."""
    single = getattr(proto, which)
    double = getattr(proto, 'double_' + which)
    raw = getattr(proto, 'raw_' + which)
    if len(double) > 0:
        values = numpy.asarray(double, dtype=numpy.float64).astype(numpy.float32)
    elif len(single) == 0 and raw:
        from caffeplus.precision import raw_blob_values
        try:
            values = raw_blob_values(proto, diff=(which == 'diff'))
        except CaffeplusError as exc:
            raise FormatError(str(exc))
    elif len(single) > 0 or count == 0:
        values = numpy.asarray(single, dtype=numpy.float32)
    elif required:
        raise FormatError('blob has no %s values (expected %d)' % (which, count))
    else:
        return None
    if values.size != count:
        if not required and values.size == 0:
            return None
        raise ValueCountError('blob holds %d %s values but its shape needs %d'
                              % (values.size, which, count))
    return values
