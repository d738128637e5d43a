"""Helpers the memory-plan tests share: a net parameter from text, and a
plain SGD loop whose losses and weights plans must not change."""
import numpy

from caffeplus.io.prototxt import parse_text
from caffeplus.proto import caffe_pb2


def param_of(text):
    return parse_text(text, caffe_pb2.NetParameter())


def sgd_run(net, iters=4, lr=0.05):
    """A plain SGD loop over the net's passes; losses and final weights."""
    losses = []
    for _ in range(iters):
        net.clear_param_diffs()
        losses.append(net.forward_prefilled())
        net.backward_all()
        for p in net.learnable_params:
            p.data[...] -= numpy.float32(lr) * p.diff
    return losses, [p.data.copy() for p in net.learnable_params]


def assert_same_run(a, b):
    """Two sgd_run results: the same losses, and weights bit for bit."""
    assert a[0] == b[0]
    assert all(numpy.array_equal(x, y) for x, y in zip(a[1], b[1]))
