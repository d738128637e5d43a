"""Buffers a layer keeps from its forward to its backward (max pooling's
argmax, BatchNorm's normalised copy): declared, so the memory planner can
place them like blobs, and handed out by the applied plan.

A layer declares them with `internal_buffers()` -> {name: (count, dtype)}
for its current shapes (what its next forward keeps), and takes them with
`scratch.get(layer, name, count, dtype, xp)` (in each forward): a 1-D array of `count`
elements, the plan's view when a reusing plan placed the buffer (live from
the layer's forward step to its backward step, its bytes lent to other
buffers the rest of the iteration), else an array of the layer's own, kept
and grown when needed (the stock and arena plans, and the CPU).
"""
import numpy

OWN = '_scratch_own'
VIEWS = '_scratch_views'


def declared(layer):
    """{name: (count, numpy dtype)} the layer keeps between its passes."""
    fn = getattr(layer, 'internal_buffers', None)
    if not callable(fn):
        return {}
    return {name: (int(count), numpy.dtype(dtype)) for name, (count, dtype) in fn().items()
            if int(count) > 0}


def nbytes(count, dtype):
    return int(count) * numpy.dtype(dtype).itemsize


def get(layer, name, count, dtype, xp):
    """The layer's buffer `name`: `count` elements of `dtype` in module `xp`."""
    dtype = numpy.dtype(dtype)
    views = layer.__dict__.get(VIEWS)
    if views:
        view = views.get(name)
        if view is not None and view.dtype == dtype and view.size >= count and \
                type(view).__module__.split('.')[0] == xp.__name__.split('.')[0]:
            return view[:count]
    own = layer.__dict__.setdefault(OWN, {})
    array = own.get(name)
    if array is None or array.dtype != dtype or array.size < count or \
            type(array).__module__.split('.')[0] != xp.__name__.split('.')[0]:
        array = own[name] = xp.empty(count, dtype=dtype)
    return array[:count]


def set_views(layer, views):
    """The applied plan's views for the layer ({} gives the layer its own
    buffers back); the layer's own arrays are dropped once views cover them."""
    layer.__dict__[VIEWS] = dict(views)
    own = layer.__dict__.get(OWN)
    if own:
        for name in list(own):
            if name in views:
                del own[name]


def forget(layer):
    """The plan's views are dead (a re-layout that keeps no values): drop
    them, and every copy of them the layer cached (its
    `forget_kept_buffers()`), so nothing holds the old arena's memory; the
    layer's next forward takes its buffers anew."""
    layer.__dict__[VIEWS] = {}
    fn = getattr(layer, 'forget_kept_buffers', None)
    if callable(fn):
        fn()


def view_of(arena, offset_bytes, count, dtype):
    """`count` elements of `dtype` at byte `offset_bytes` of a float32 arena."""
    dtype = numpy.dtype(dtype)
    raw = arena.view(numpy.uint8)
    return raw[offset_bytes:offset_bytes + count * dtype.itemsize].view(dtype)
