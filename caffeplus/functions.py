"""Array functions several layers share, written once for numpy and cupy."""
from caffeplus import backend


def softmax(x, axis):
    """Softmax along `axis`, max-subtracted as Caffe does."""
    xp = backend.get_array_module(x)
    e = xp.exp(x - x.max(axis=axis, keepdims=True))
    e /= e.sum(axis=axis, keepdims=True)
    return e
