"""Numerical gradient checks for layers, in the spirit of Caffe's GradientChecker.

The layer runs in float32 as always; the checked function is the weighted
sum of its tops, sum(top * R) with fixed random R, and its derivative with
respect to every bottom and parameter element is estimated by central
differences computed in float64 from float32 forwards.
"""
import numpy

from caffeplus.blob import Blob


def make_blobs(shapes, rng, low=-1.0, high=1.0):
    blobs = []
    for i, s in enumerate(shapes):
        b = Blob(s, name='bottom_%d' % i)
        b.data = rng.uniform(low, high, size=s).astype(numpy.float32)
        blobs.append(b)
    return blobs


def check_gradient(layer, bottom, top=None, check_bottom=None, check_params=True,
                   step=1e-2, rtol=1e-2, atol=1e-3, seed=0, max_checks=200):
    """Compare analytic and numeric gradients; raise AssertionError on mismatch.

    `layer` must be set up already, or `top` None to let this set it up.
    check_bottom: indices of bottoms to check (default all).
    """
    rng = numpy.random.default_rng(seed)
    if top is None:
        top = [Blob(name='top_%d' % i) for i in range(max(layer.exact_num_top, layer.min_num_top, 1))]
        layer.setup(bottom, top)
    layer.forward(bottom, top)
    weights = [rng.standard_normal(t.shape).astype(numpy.float32) for t in top]

    def objective():
        layer.forward(bottom, top)
        return sum(float(numpy.dot(t.data.astype(numpy.float64).ravel(), w.astype(numpy.float64).ravel()))
                   for t, w in zip(top, weights))

    check_bottom = range(len(bottom)) if check_bottom is None else check_bottom
    targets = [('bottom', i, bottom[i]) for i in check_bottom]
    if check_params:
        targets += [('param', i, b) for i, b in enumerate(layer.blobs)]

    # analytic
    objective()
    for t, w in zip(top, weights):
        t.diff = w
    for b in layer.blobs:
        b.diff[...] = 0
    propagate = [i in check_bottom for i in range(len(bottom))]
    layer.backward(top, propagate, bottom)
    analytic = {(kind, i): blob.diff.astype(numpy.float64).copy() for kind, i, blob in targets}

    for kind, i, blob in targets:
        flat = blob.data.reshape(-1)
        n = flat.size
        idx = numpy.arange(n) if n <= max_checks else rng.choice(n, max_checks, replace=False)
        grad = analytic[(kind, i)].reshape(-1)
        for j in idx:
            orig = flat[j]
            flat[j] = orig + step
            plus = objective()
            flat[j] = orig - step
            minus = objective()
            flat[j] = orig
            numeric = (plus - minus) / (2 * step)
            tol = atol + rtol * max(abs(numeric), abs(grad[j]))
            if abs(numeric - grad[j]) > tol:
                raise AssertionError('%s %d element %d: analytic %.6g vs numeric %.6g'
                                     % (kind, i, j, grad[j], numeric))
    objective()
