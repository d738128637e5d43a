"""Array functions several layers share, written once for numpy and cupy."""
import numpy

from caffeplus import backend
from caffeplus.memory import scratch


def softmax(x, axis):
    """Softmax along `axis`, max-subtracted as Caffe does (an empty axis
    gives an empty result: there is nothing to normalize)."""
    xp = backend.get_array_module(x)
    if x.shape[axis] == 0:
        return x.copy()
    e = xp.exp(x - x.max(axis=axis, keepdims=True))
    e /= e.sum(axis=axis, keepdims=True)
    return e


def keep_in(layer, name, x):
    """A copy of x in the layer's kept buffer `name` (its own, or the memory
    plan's view: caffeplus.memory.scratch), in the type the layer declares
    it (internal_buffers); float32 on the CPU, which emulates 16 bits. For
    layers that must remember an input across forward and backward."""
    xp = backend.get_array_module(x)
    dtype = numpy.float32 if xp is numpy else \
        layer.internal_buffers().get(name, (0, numpy.float32))[1]
    buf = scratch.get(layer, name, x.size, dtype, xp)
    buf = buf.reshape(x.shape)
    buf[...] = x
    return buf
