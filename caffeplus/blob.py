"""Blob: a shape plus `data` and `diff` arrays, as in Caffe.

A blob does not own its memory: it holds two Storage handles, and a memory
plan (or sharing, as in-place layers, Split and shared parameters need) can
point several blobs at one Storage or hand a Storage a view into an arena.
`data`/`diff` return views of the storage shaped like the blob, so writes
through them (pycaffe's `blob.data[...] = x`) reach the net.
"""
import numpy

from caffeplus import backend
from caffeplus.errors import CaffeplusError, FormatError

MAX_BLOB_AXES = 32
# A bound for shapes read from files, so a corrupt header cannot make us
# allocate terabytes: 2**34 floats is 64 GiB.
MAX_BLOB_COUNT = 2 ** 34

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


def virtual_array(count):
    """A writable float32 array of `count` elements that all alias one float."""
    return numpy.lib.stride_tricks.as_strided(numpy.zeros(1, dtype=numpy.float32),
                                              shape=(max(int(count), 1),), strides=(0,))


def is_virtual(array):
    return isinstance(array, numpy.ndarray) and array.size > 1 and not any(array.strides)


class Storage:
    """A flat float32 buffer that one or more blobs view."""
    __slots__ = ('array', 'released_reason')

    def __init__(self):
        self.array = None
        self.released_reason = None

    def ensure(self, count, xp):
        if _VIRTUAL['on'] and xp is numpy:      # see "virtual allocation" above
            if self.array is None or self.array.size < count:
                self.array = virtual_array(count)
            return self.array
        if self.array is None or self.array.size < count or \
                backend.get_array_module(self.array) is not xp:
            old = self.array
            self.array = xp.zeros(max(count, 1), dtype=numpy.float32)
            if old is not None and old.size:
                n = min(old.size, count)
                if backend.get_array_module(old) is xp:
                    self.array[:n] = old[:n]
                elif xp is numpy:
                    self.array[:n] = backend.to_numpy(old[:n])
                else:
                    self.array[:n] = xp.asarray(old[:n])
        return self.array


def shape_string(shape):
    """Caffe's rendering: '64 20 24 24 (737280)', and '(1)' for a scalar."""
    return ''.join('%d ' % d for d in shape) + '(%d)' % _prod(shape)


def _prod(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


class Blob:
    def __init__(self, shape=(), name=''):
        self.name = name
        self._shape = ()
        self._count = 1
        self._data = Storage()
        self._diff = Storage()
        self.reshape(shape)

    # -- shape ---------------------------------------------------------------
    def reshape(self, *shape):
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
        if not -n <= axis < max(n, 1):
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
        value = xp.asarray(value, dtype=numpy.float32) if xp is not numpy \
            else numpy.asarray(backend.to_numpy(value), dtype=numpy.float32)
        if value.shape != view.shape and value.size != view.size:
            raise CaffeplusError('cannot assign an array of shape %s to the %s of blob %s '
                                 'with shape %s' % (value.shape, which, self.name, view.shape))
        view[...] = value.reshape(view.shape)

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


def proto_shape(proto):
    """The shape a BlobProto describes: `shape`, or the legacy 4-D fields."""
    if proto.HasField('num') or proto.HasField('channels') or \
            proto.HasField('height') or proto.HasField('width'):
        shape = (proto.num, proto.channels, proto.height, proto.width)
    else:
        shape = tuple(proto.shape.dim)
    if len(shape) > MAX_BLOB_AXES or any(d < 0 for d in shape):
        raise FormatError('invalid blob shape %s' % (shape,))
    if _prod(shape) > MAX_BLOB_COUNT:
        raise FormatError('blob shape %s claims %d values, more than the %d allowed'
                          % (shape, _prod(shape), MAX_BLOB_COUNT))
    return shape


def proto_array(proto, which, count, required=True):
    """The float32 values of a BlobProto's data or diff (float or double)."""
    single = getattr(proto, which)
    double = getattr(proto, 'double_' + which)
    if len(double) > 0:
        values = numpy.asarray(double, dtype=numpy.float64).astype(numpy.float32)
    elif len(single) > 0 or count == 0:
        values = numpy.asarray(single, dtype=numpy.float32)
    elif required:
        raise FormatError('blob has no %s values (expected %d)' % (which, count))
    else:
        return None
    if values.size != count:
        if not required and values.size == 0:
            return None
        raise FormatError('blob holds %d %s values but its shape needs %d'
                          % (values.size, which, count))
    return values
