"""Loss layers (caffeplus/layers/loss.py): float64 NumPy references for the
forward and the gradient, numerical gradient checks, normalization modes,
ignore_label, axes, loss weights, and Caffe's construction errors."""
import numpy
import pytest
from google.protobuf import text_format

import caffeplus.layers.loss  # noqa: F401  (registers the loss layers)
from caffeplus.blob import Blob
from caffeplus.errors import CaffeplusError, NetError
from caffeplus.layer import layer_class
from caffeplus.proto import caffe_pb2
from gradcheck import check_gradient

FLT_MIN = float(numpy.finfo(numpy.float32).tiny)
MODES = ['FULL', 'VALID', 'BATCH_SIZE', 'NONE']


# -- helpers ---------------------------------------------------------------------
def make_layer(type_name, params='', name='loss'):
    lp = caffe_pb2.LayerParameter()
    text_format.Parse('name: "%s" type: "%s" %s' % (name, type_name, params), lp)
    return layer_class(type_name)(lp)


def blobs(*arrays):
    out = []
    for i, a in enumerate(arrays):
        a = numpy.asarray(a, dtype=numpy.float32)
        b = Blob(a.shape, name='bottom_%d' % i)
        b.data = a
        out.append(b)
    return out


def run(layer, bottom, ntop=1, top_diff=None):
    """Set up, forward, backward (propagating to every bottom that may take a
    gradient); return (forward's return value, top value, bottom diffs)."""
    top = [Blob(name='top_%d' % i) for i in range(ntop)]
    layer.setup(bottom, top)
    ret = layer.forward(bottom, top)
    value = float(top[0].data)
    if top_diff is not None:
        top[0].diff[...] = top_diff
    propagate = [layer.allow_force_backward(i) for i in range(len(bottom))]
    for b in bottom:
        b.diff[...] = numpy.nan
    layer.backward(top, propagate, bottom)
    diffs = [b.diff.copy() if p else None for b, p in zip(bottom, propagate)]
    return ret, value, diffs, top


def normalizer(mode, outer, inner, valid):
    n = {'FULL': outer * inner, 'VALID': valid, 'BATCH_SIZE': outer, 'NONE': 1}[mode]
    return max(1.0, float(n))


def labels_for(rng, shape, classes, ignore=None, frac=0.3):
    lab = rng.integers(0, classes, size=shape).astype(numpy.float32)
    if ignore is not None:
        lab[rng.random(shape) < frac] = ignore
    return lab


def to3(x, axis):
    axis = axis % x.ndim
    outer = int(numpy.prod(x.shape[:axis]))
    inner = int(numpy.prod(x.shape[axis + 1:]))
    return x.reshape(outer, x.shape[axis], inner), outer, inner


def softmax64(x3):
    e = numpy.exp(x3 - x3.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


# -- float64 references -----------------------------------------------------------
def ref_softmax_with_loss(x, label, axis=1, ignore=None, mode='VALID'):
    x3, outer, inner = to3(x.astype(numpy.float64), axis)
    p = softmax64(x3)
    lab = label.reshape(outer, inner).astype(numpy.int64)
    valid = numpy.ones_like(lab, bool) if ignore is None else lab != ignore
    safe = numpy.where(valid, lab, 0)
    picked = numpy.take_along_axis(p, safe[:, None, :], axis=1)[:, 0, :]
    loss = -numpy.log(numpy.maximum(picked, FLT_MIN))[valid].sum()
    norm = normalizer(mode, outer, inner, valid.sum())
    onehot = numpy.arange(x3.shape[1])[None, :, None] == safe[:, None, :]
    grad = (p - onehot) * valid[:, None, :] / norm
    return loss / norm, grad.reshape(x.shape)


def ref_sigmoid_ce(x, t, ignore=None, mode='BATCH_SIZE'):
    x, t = x.astype(numpy.float64), t.astype(numpy.float64)
    valid = numpy.ones(x.shape, bool) if ignore is None else t.astype(numpy.int64) != ignore
    p = 1 / (1 + numpy.exp(-x))
    # the plain cross-entropy, written independently of Caffe's stable form
    term = -(t * numpy.log(p) + (1 - t) * numpy.log(1 - p))
    outer, inner = x.shape[0], x.size // x.shape[0]
    norm = normalizer(mode, outer, inner, valid.sum())
    return term[valid].sum() / norm, (p - t) * valid / norm


def ref_euclidean(a, b):
    d = a.astype(numpy.float64) - b.astype(numpy.float64).reshape(a.shape)
    n = a.shape[0]
    return (d * d).sum() / n / 2, d / n, -d.reshape(b.shape) / n


def ref_hinge(x, label, norm='L1'):
    n = x.shape[0]
    x2 = x.reshape(n, -1).astype(numpy.float64)
    s = numpy.ones_like(x2)
    s[numpy.arange(n), label.reshape(-1).astype(numpy.int64)] = -1
    m = numpy.maximum(0, 1 + s * x2)
    if norm == 'L1':
        return m.sum() / n, (s * (m > 0)).reshape(x.shape) / n
    return (m * m).sum() / n, (2 * s * m).reshape(x.shape) / n


def ref_contrastive(a, b, y, margin, legacy):
    n = a.shape[0]
    d = (a.astype(numpy.float64) - b.astype(numpy.float64)).reshape(n, -1)
    dsq = (d * d).sum(axis=1)
    dist = numpy.sqrt(dsq)
    sim = y.reshape(n).astype(numpy.int64) != 0
    if legacy:
        dis = numpy.maximum(margin - dsq, 0)
        gdis = -(margin - dsq > 0).astype(float)[:, None] * d
    else:
        dis = numpy.maximum(margin - dist, 0) ** 2
        gdis = -(numpy.maximum(margin - dist, 0) / dist)[:, None] * d
    loss = numpy.where(sim, dsq, dis).sum() / n / 2
    ga = numpy.where(sim[:, None], d, gdis) / n
    return loss, ga.reshape(a.shape), -ga.reshape(b.shape)


def ref_infogain(x, label, H, axis=1, ignore=None, mode='VALID'):
    x3, outer, inner = to3(x.astype(numpy.float64), axis)
    p = softmax64(x3)
    H = H.astype(numpy.float64).reshape(x3.shape[1], x3.shape[1])
    lab = label.reshape(outer, inner).astype(numpy.int64)
    valid = numpy.ones_like(lab, bool) if ignore is None else lab != ignore
    safe = numpy.where(valid, lab, 0)
    rows = numpy.moveaxis(H[safe], 2, 1)                    # outer x C x inner
    term = -(rows * numpy.log(numpy.maximum(p, 1e-20))).sum(axis=1)
    norm = normalizer(mode, outer, inner, valid.sum())
    grad = (p * rows.sum(axis=1, keepdims=True) - rows) * valid[:, None, :] / norm
    return term[valid].sum() / norm, grad.reshape(x.shape)


def ref_multinomial(p, label):
    n = p.shape[0]
    p2 = p.reshape(n, -1).astype(numpy.float64)
    lab = label.reshape(n).astype(numpy.int64)
    picked = numpy.maximum(p2[numpy.arange(n), lab], 1e-20)
    g = numpy.zeros_like(p2)
    g[numpy.arange(n), lab] = -1 / picked / n
    return -numpy.log(picked).sum() / n, g.reshape(p.shape)


def close(actual, expected, rtol=1e-5, atol=1e-6):
    numpy.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


# -- SoftmaxWithLoss -------------------------------------------------------------
SWL_SHAPES = [((4, 5), 1), ((3, 5, 2, 3), 1), ((2, 3, 4, 2), 2), ((2, 3, 4), -1),
              ((3, 3, 2), 0), ((1, 6), 1)]


@pytest.mark.parametrize('shape,axis', SWL_SHAPES)
@pytest.mark.parametrize('mode', MODES)
def test_softmax_with_loss_matches_reference(shape, axis, mode):
    rng = numpy.random.default_rng(hash((shape, axis, mode)) % 2 ** 32)
    x = rng.normal(0, 2, size=shape).astype(numpy.float32)
    a = axis % len(shape)
    lshape = shape[:a] + shape[a + 1:]
    label = labels_for(rng, lshape, shape[a], ignore=255)
    params = 'softmax_param { axis: %d } loss_param { ignore_label: 255 normalization: %s }' \
        % (axis, mode)
    ret, value, diffs, _ = run(make_layer('SoftmaxWithLoss', params), blobs(x, label),
                               top_diff=1.7)
    loss, grad = ref_softmax_with_loss(x, label, axis, 255, mode)
    close(value, loss)
    close(ret, loss)
    close(diffs[0], 1.7 * grad)
    assert diffs[1] is None


@pytest.mark.parametrize('normalize,mode', [(True, 'VALID'), (False, 'BATCH_SIZE')])
def test_softmax_with_loss_legacy_normalize(normalize, mode):
    rng = numpy.random.default_rng(3)
    x = rng.normal(size=(3, 4, 2, 2)).astype(numpy.float32)
    label = labels_for(rng, (3, 2, 2), 4, ignore=-1)
    params = 'loss_param { ignore_label: -1 normalize: %s }' % str(normalize).lower()
    _, value, diffs, _ = run(make_layer('SoftmaxWithLoss', params), blobs(x, label))
    loss, grad = ref_softmax_with_loss(x, label, 1, -1, mode)
    close(value, loss)
    close(diffs[0], grad)
    # an explicit normalization wins over the legacy flag
    params = 'loss_param { ignore_label: -1 normalize: %s normalization: FULL }' \
        % str(normalize).lower()
    _, value, _, _ = run(make_layer('SoftmaxWithLoss', params), blobs(x, label))
    close(value, ref_softmax_with_loss(x, label, 1, -1, 'FULL')[0])


def test_softmax_with_loss_defaults_and_clamp():
    # default VALID without ignore_label: mean over all positions; a
    # probability that underflows to 0 is clamped at FLT_MIN inside the log
    x = numpy.array([[0, 200, 0], [1, 2, 3]], numpy.float32)
    label = numpy.array([0, 2], numpy.float32)
    _, value, diffs, _ = run(make_layer('SoftmaxWithLoss'), blobs(x, label))
    loss, grad = ref_softmax_with_loss(x, label)
    close(value, loss)
    assert abs(value - (-numpy.log(FLT_MIN) + -numpy.log(softmax64(
        x[1:, :, None].astype(numpy.float64))[0, 2, 0])) / 2) < 1e-3
    close(diffs[0], grad)


def test_softmax_with_loss_all_ignored_and_truncated_labels():
    x = numpy.random.default_rng(0).normal(size=(2, 3)).astype(numpy.float32)
    _, value, diffs, _ = run(make_layer('SoftmaxWithLoss', 'loss_param { ignore_label: 1 }'),
                             blobs(x, [1, 1.9]))        # 1.9 casts to 1: ignored
    assert value == 0                                     # normalizer max(1, 0) = 1
    assert not diffs[0].any()
    _, value, _, _ = run(make_layer('SoftmaxWithLoss'), blobs(x, [2.7, 0.2]))
    close(value, ref_softmax_with_loss(x, numpy.array([2, 0]))[0])


@pytest.mark.parametrize('shape,axis', [((3, 4), 1), ((2, 3, 2, 2), 1), ((2, 3, 4), 2)])
@pytest.mark.parametrize('mode', MODES)
def test_softmax_with_loss_gradcheck(shape, axis, mode):
    rng = numpy.random.default_rng(7)
    lshape = shape[:axis] + shape[axis + 1:]
    x = rng.normal(size=shape).astype(numpy.float32)
    bottom = blobs(x, labels_for(rng, lshape, shape[axis], ignore=9))
    layer = make_layer('SoftmaxWithLoss', 'softmax_param { axis: %d } '
                       'loss_param { ignore_label: 9 normalization: %s }' % (axis, mode))
    check_gradient(layer, bottom, check_bottom=[0], atol=1e-4)


def test_softmax_with_loss_two_tops_refused():
    """README quirk 1: stock Caffe cannot build SoftmaxWithLoss with a prob top."""
    x, label = numpy.zeros((3, 6)), numpy.zeros(3)
    for params in ['', 'loss_weight: 2 loss_weight: 0', 'loss_weight: 1']:
        layer = make_layer('SoftmaxWithLoss', params)
        with pytest.raises(NetError, match='loss_weight'):
            layer.setup(blobs(x, label), [Blob(), Blob()])
    with pytest.raises(NetError, match='loss_weight'):      # 2 weights, 1 top
        make_layer('SoftmaxWithLoss', 'loss_weight: 1 loss_weight: 1').setup(
            blobs(x, label), [Blob()])


# -- SigmoidCrossEntropyLoss ---------------------------------------------------
@pytest.mark.parametrize('shape', [(3, 4), (2, 3, 2, 2), (5,), (1, 7, 3)])
@pytest.mark.parametrize('mode', MODES + [None])
def test_sigmoid_cross_entropy_matches_reference(shape, mode):
    rng = numpy.random.default_rng(len(shape) * 10 + MODES.index(mode) if mode else 99)
    x = rng.normal(0, 3, size=shape).astype(numpy.float32)
    t = rng.random(shape).astype(numpy.float32)
    t[rng.random(shape) < 0.25] = -1
    params = 'loss_param { ignore_label: -1 %s }' % ('normalization: %s' % mode if mode else '')
    _, value, diffs, _ = run(make_layer('SigmoidCrossEntropyLoss', params), blobs(x, t),
                             top_diff=0.3)
    loss, grad = ref_sigmoid_ce(x, t, -1, mode or 'BATCH_SIZE')   # quirk 6: BATCH_SIZE
    close(value, loss, rtol=2e-5)
    close(diffs[0], 0.3 * grad)
    assert diffs[1] is None


def test_sigmoid_cross_entropy_default_batch_size_and_legacy():
    rng = numpy.random.default_rng(5)
    x = rng.normal(0, 20, size=(4, 3)).astype(numpy.float32)     # saturating inputs
    t = (rng.random((4, 3)) > 0.5).astype(numpy.float32)
    _, value, diffs, _ = run(make_layer('SigmoidCrossEntropyLoss'), blobs(x, t))
    x64, t64 = x.astype(numpy.float64), t.astype(numpy.float64)
    stable = numpy.maximum(x64, 0) - x64 * t64 + numpy.log1p(numpy.exp(-abs(x64)))
    close(value, stable.sum() / 4, rtol=2e-5)
    assert numpy.isfinite(diffs[0]).all()
    _, value, _, _ = run(make_layer('SigmoidCrossEntropyLoss', 'loss_param { normalize: true }'),
                         blobs(x, t))
    close(value, stable.sum() / 12, rtol=2e-5)


@pytest.mark.parametrize('mode', MODES)
def test_sigmoid_cross_entropy_gradcheck(mode):
    rng = numpy.random.default_rng(11)
    x = rng.normal(size=(3, 2, 2)).astype(numpy.float32)
    t = rng.random((3, 2, 2)).astype(numpy.float32)
    t[0, 1] = 5                                  # ignored
    layer = make_layer('SigmoidCrossEntropyLoss',
                       'loss_param { ignore_label: 5 normalization: %s }' % mode)
    check_gradient(layer, blobs(x, t), check_bottom=[0], atol=1e-4)


# -- EuclideanLoss ---------------------------------------------------------------
@pytest.mark.parametrize('shapes', [((4, 3, 2), (4, 3, 2)), ((2, 5), (2, 5, 1, 1)),
                                    ((3, 1), (3, 1)), ((1, 2, 2, 2), (1, 8))])
def test_euclidean(shapes):
    rng = numpy.random.default_rng(2)
    a = rng.normal(size=shapes[0]).astype(numpy.float32)
    b = rng.normal(size=shapes[1]).astype(numpy.float32)
    layer = make_layer('EuclideanLoss')
    assert layer.allow_force_backward(0) and layer.allow_force_backward(1)
    _, value, diffs, _ = run(layer, blobs(a, b), top_diff=2.5)
    loss, ga, gb = ref_euclidean(a, b)
    close(value, loss)
    close(diffs[0], 2.5 * ga)
    close(diffs[1], 2.5 * gb)
    check_gradient(make_layer('EuclideanLoss'), blobs(a, b), atol=1e-4)


def test_euclidean_rejects_mismatch():
    with pytest.raises(NetError, match='loss.*same dimension'):
        make_layer('EuclideanLoss').setup(blobs(numpy.zeros((2, 3)), numpy.zeros((2, 4))),
                                          [Blob()])
    with pytest.raises(NetError, match='first dimension'):
        make_layer('EuclideanLoss').setup(blobs(numpy.zeros((2, 3)), numpy.zeros((3, 2))),
                                          [Blob()])


# -- HingeLoss -------------------------------------------------------------------
def hinge_inputs(rng, shape):
    n = shape[0]
    x = rng.uniform(-2, 2, size=shape).astype(numpy.float32)
    label = rng.integers(0, x.size // n, size=n).astype(numpy.float32)
    # keep every margin 1 + s x away from the kink at 0, for the finite differences
    x2 = x.reshape(n, -1)
    s = numpy.ones_like(x2)
    s[numpy.arange(n), label.astype(int)] = -1
    m = 1 + s * x2
    x2[abs(m) < 0.1] += 0.25 * s[abs(m) < 0.1]
    return x, label


@pytest.mark.parametrize('shape', [(5, 4), (3, 2, 2, 2), (4, 1), (2, 7)])
@pytest.mark.parametrize('norm', ['L1', 'L2'])
def test_hinge(shape, norm):
    rng = numpy.random.default_rng(shape[0] * 7 + len(shape))
    x, label = hinge_inputs(rng, shape)
    params = 'hinge_loss_param { norm: %s }' % norm
    _, value, diffs, _ = run(make_layer('HingeLoss', params), blobs(x, label), top_diff=0.8)
    loss, grad = ref_hinge(x, label, norm)
    close(value, loss)
    close(diffs[0], 0.8 * grad)
    assert diffs[1] is None
    check_gradient(make_layer('HingeLoss', params), blobs(x, label), check_bottom=[0],
                   atol=1e-4)


# -- ContrastiveLoss -------------------------------------------------------------
@pytest.mark.parametrize('legacy', [False, True])
@pytest.mark.parametrize('shape', [(6, 3, 1, 1), (5, 4), (4, 2, 1)])
def test_contrastive(legacy, shape):
    rng = numpy.random.default_rng(21 + len(shape))
    n = shape[0]
    a = rng.normal(0, 0.6, size=shape).astype(numpy.float32)
    b = rng.normal(0, 0.6, size=shape).astype(numpy.float32)
    y = numpy.array([1, 0, 0.5, 2, 0, 1][:n], numpy.float32).reshape(n, 1, 1, 1)  # 0.5 -> 0
    margin = 1.5
    # keep distances away from the hinge at the margin, for the finite differences
    d = (a - b).reshape(n, -1)
    key = (d * d).sum(1) if legacy else numpy.sqrt((d * d).sum(1))
    near = abs(key - margin) < 0.2
    a.reshape(n, -1)[near] *= 1.5
    params = 'contrastive_loss_param { margin: %g legacy_version: %s }' \
        % (margin, str(legacy).lower())
    layer = make_layer('ContrastiveLoss', params)
    assert layer.allow_force_backward(0) and layer.allow_force_backward(1)
    assert not layer.allow_force_backward(2)
    _, value, diffs, _ = run(layer, blobs(a, b, y), top_diff=1.3)
    loss, ga, gb = ref_contrastive(a, b, y, numpy.float32(margin), legacy)
    close(value, loss)
    # Caffe divides by (dist + 1e-4), not dist, in the non-legacy gradient
    tol = 1e-5 if legacy else 2e-3
    close(diffs[0], 1.3 * ga, rtol=tol, atol=1e-6)
    close(diffs[1], 1.3 * gb, rtol=tol, atol=1e-6)
    assert diffs[2] is None
    check_gradient(make_layer('ContrastiveLoss', params), blobs(a, b, y), check_bottom=[0, 1],
                   atol=1e-4)


def test_contrastive_rejects_bad_shapes():
    with pytest.raises(NetError, match='loss.*height and width'):
        make_layer('ContrastiveLoss').setup(
            blobs(numpy.zeros((2, 3, 2)), numpy.zeros((2, 3, 2)), numpy.zeros(2)), [Blob()])
    with pytest.raises(NetError, match='similarity'):
        make_layer('ContrastiveLoss').setup(
            blobs(numpy.zeros((2, 3)), numpy.zeros((2, 3)), numpy.zeros((2, 2))), [Blob()])


# -- InfogainLoss ----------------------------------------------------------------
@pytest.mark.parametrize('shape,axis', [((4, 5), 1), ((2, 3, 2, 2), 1), ((2, 2, 4), 2),
                                        ((3, 4, 2), -2)])
@pytest.mark.parametrize('mode', MODES)
def test_infogain_h_bottom(shape, axis, mode):
    rng = numpy.random.default_rng(31 + len(shape))
    a = axis % len(shape)
    c = shape[a]
    x = rng.normal(0, 1.5, size=shape).astype(numpy.float32)
    label = labels_for(rng, shape[:a] + shape[a + 1:], c, ignore=7)
    H = rng.random((c, c)).astype(numpy.float32)
    params = 'infogain_loss_param { axis: %d } loss_param { ignore_label: 7 normalization: %s }' \
        % (axis, mode)
    layer = make_layer('InfogainLoss', params)
    assert [layer.allow_force_backward(i) for i in range(3)] == [True, False, False]
    _, value, diffs, _ = run(layer, blobs(x, label, H), top_diff=0.6)
    loss, grad = ref_infogain(x, label, H, axis, 7, mode)
    close(value, loss)
    close(diffs[0], 0.6 * grad)
    assert diffs[1] is None and diffs[2] is None
    check_gradient(make_layer('InfogainLoss', params), blobs(x, label, H), check_bottom=[0],
                   atol=1e-4)


def test_infogain_source_and_prob_top(tmp_path):
    from caffeplus.io.blobproto import array_to_blobproto, write_blobproto
    rng = numpy.random.default_rng(8)
    H = rng.random((1, 1, 4, 4)).astype(numpy.float32)
    path = str(tmp_path / 'H.binaryproto')
    write_blobproto(array_to_blobproto(H), path)
    x = rng.normal(size=(3, 4)).astype(numpy.float32)
    label = numpy.array([0, 3, 1], numpy.float32)
    params = 'infogain_loss_param { source: "%s" } loss_weight: 1 loss_weight: 0' % path
    ret, value, diffs, top = run(make_layer('InfogainLoss', params), blobs(x, label), ntop=2)
    loss, grad = ref_infogain(x, label, H)
    close(value, loss)
    close(ret, loss)
    close(diffs[0], grad)
    close(top[1].data, softmax64(x[:, :, None].astype(numpy.float64))[:, :, 0])
    # the identity matrix gives SoftmaxWithLoss
    write_blobproto(array_to_blobproto(numpy.eye(4, dtype=numpy.float32)), path)
    _, value, _, _ = run(make_layer('InfogainLoss', params), blobs(x, label), ntop=2)
    close(value, ref_softmax_with_loss(x, label)[0])
    # two tops with the single default loss weight fail as in Caffe
    with pytest.raises(NetError, match='loss_weight'):
        make_layer('InfogainLoss', 'infogain_loss_param { source: "%s" }' % path).setup(
            blobs(x, label), [Blob(), Blob()])


def test_infogain_errors(tmp_path):
    x, label = numpy.zeros((2, 3)), numpy.zeros(2)
    with pytest.raises(NetError, match='loss.*infogain_loss_param.source'):
        make_layer('InfogainLoss').setup(blobs(x, label), [Blob()])
    with pytest.raises(NetError, match='infogain_loss_param.source'):
        make_layer('InfogainLoss', 'infogain_loss_param { source: "%s" }'
                   % (tmp_path / 'missing.binaryproto')).setup(blobs(x, label), [Blob()])
    with pytest.raises(NetError, match='3 x 3'):
        make_layer('InfogainLoss').setup(blobs(x, label, numpy.zeros((2, 2))), [Blob()])
    layer = make_layer('InfogainLoss')
    bottom = blobs(x, label, numpy.eye(3))
    top = [Blob()]
    layer.setup(bottom, top)
    layer.forward(bottom, top)
    with pytest.raises(NetError, match='infogain inputs'):
        layer.backward(top, [True, False, True], bottom)


# -- MultinomialLogisticLoss -----------------------------------------------------
@pytest.mark.parametrize('shape', [(4, 5, 1, 1), (3, 2), (6, 3)])
def test_multinomial_logistic(shape):
    rng = numpy.random.default_rng(41 + shape[0])
    n = shape[0]
    p = rng.uniform(0.2, 1, size=shape).astype(numpy.float32)
    label = rng.integers(0, p.size // n, size=(n, 1, 1, 1)).astype(numpy.float32)
    _, value, diffs, _ = run(make_layer('MultinomialLogisticLoss'), blobs(p, label),
                             top_diff=0.9)
    loss, grad = ref_multinomial(p, label)
    close(value, loss)
    close(diffs[0], 0.9 * grad)
    check_gradient(make_layer('MultinomialLogisticLoss'), blobs(p, label), check_bottom=[0],
                   atol=1e-4)


def test_multinomial_logistic_clamp_and_label_shape():
    p = numpy.array([[0, 1], [0.5, 0.5]], numpy.float32)
    _, value, diffs, _ = run(make_layer('MultinomialLogisticLoss'), blobs(p, [0, 1]))
    close(value, ref_multinomial(p, numpy.array([0, 1]))[0])
    close(value, (-numpy.log(numpy.float32(1e-20)) - numpy.log(0.5)) / 2, rtol=1e-6)
    assert numpy.isfinite(diffs[0]).all()
    with pytest.raises(NetError, match='labels must be N x 1 x 1 x 1'):
        make_layer('MultinomialLogisticLoss').setup(blobs(p, numpy.zeros((2, 2))), [Blob()])


# -- shared behaviour ------------------------------------------------------------
def _case(type_name, rng):
    """(params, bottom arrays, gradient-checked bottoms) for each loss type."""
    x = rng.normal(size=(3, 4)).astype(numpy.float32)
    label = numpy.array([0, 3, 1], numpy.float32)
    return {
        'SoftmaxWithLoss': ('', [x, label], [0]),
        'SigmoidCrossEntropyLoss': ('', [x, rng.random((3, 4))], [0]),
        'EuclideanLoss': ('', [x, rng.normal(size=(3, 4))], [0, 1]),
        'HingeLoss': ('', [x, label], [0]),
        'ContrastiveLoss': ('', [x, rng.normal(size=(3, 4)), [[1], [0], [0]]], [0, 1]),
        'InfogainLoss': ('', [x, label, rng.random((4, 4))], [0]),
        'MultinomialLogisticLoss': ('', [abs(x) + 0.1, label.reshape(3, 1)], [0]),
    }[type_name]


LOSS_TYPES = ['SoftmaxWithLoss', 'SigmoidCrossEntropyLoss', 'EuclideanLoss', 'HingeLoss',
              'ContrastiveLoss', 'InfogainLoss', 'MultinomialLogisticLoss']


@pytest.mark.parametrize('type_name', LOSS_TYPES)
def test_loss_weight_scales_loss_and_gradient(type_name):
    rng = numpy.random.default_rng(0)
    params, arrays, grads = _case(type_name, rng)
    results = []
    for weight in ['', 'loss_weight: 0.5']:
        layer = make_layer(type_name, params + ' ' + weight)
        bottom = blobs(*arrays)
        top = [Blob()]
        layer.setup(bottom, top)                   # puts the weight into top diff
        assert layer.loss_weights == [1.0 if not weight else 0.5]
        ret = layer.forward(bottom, top)
        layer.backward(top, [i in grads for i in range(len(bottom))], bottom)
        results.append((ret, float(top[0].data), [bottom[i].diff.copy() for i in grads]))
    (r1, v1, g1), (r2, v2, g2) = results
    assert v1 == v2                                # the top holds the unweighted loss
    close(r1, v1)
    close(r2, 0.5 * v1)
    for a, b in zip(g1, g2):
        close(b, 0.5 * a)
        assert abs(a).sum() > 0


@pytest.mark.parametrize('type_name', LOSS_TYPES)
def test_declarations(type_name):
    cls = layer_class(type_name)
    assert cls.backward_reads == frozenset(['bottom_data'])
    assert not cls.inplace_ok
    rng = numpy.random.default_rng(0)
    _, arrays, grads = _case(type_name, rng)
    layer = make_layer(type_name)
    assert [layer.allow_force_backward(i) for i in range(len(arrays))] == \
        [i in grads for i in range(len(arrays))]


@pytest.mark.parametrize('type_name', ['SoftmaxWithLoss', 'HingeLoss', 'InfogainLoss',
                                       'MultinomialLogisticLoss'])
def test_label_out_of_range(type_name):
    rng = numpy.random.default_rng(0)
    params, arrays, _ = _case(type_name, rng)
    arrays[1] = numpy.array([0, 4, 1], numpy.float32).reshape(numpy.shape(arrays[1]))
    layer = make_layer(type_name, params, name='myloss')
    bottom = blobs(*arrays)
    top = [Blob()]
    layer.setup(bottom, top)
    with pytest.raises(NetError, match=r'myloss.*label value 4 .*\[0, 4\)'):
        layer.forward(bottom, top)
    bottom[1].data[...] = -1
    with pytest.raises(NetError, match='myloss.*-1'):
        layer.forward(bottom, top)


@pytest.mark.parametrize('type_name', ['SoftmaxWithLoss', 'SigmoidCrossEntropyLoss',
                                       'HingeLoss', 'MultinomialLogisticLoss'])
def test_no_gradient_to_labels(type_name):
    rng = numpy.random.default_rng(0)
    params, arrays, _ = _case(type_name, rng)
    layer = make_layer(type_name, params)
    bottom = blobs(*arrays)
    top = [Blob()]
    layer.setup(bottom, top)
    layer.forward(bottom, top)
    with pytest.raises(NetError, match='label inputs'):
        layer.backward(top, [True, True], bottom)


def test_softmax_with_loss_shape_errors():
    with pytest.raises(NetError, match='softmax_param.axis'):
        make_layer('SoftmaxWithLoss', 'softmax_param { axis: 2 }').setup(
            blobs(numpy.zeros((2, 3)), numpy.zeros(2)), [Blob()])
    with pytest.raises(NetError, match='number of labels'):
        make_layer('SoftmaxWithLoss').setup(
            blobs(numpy.zeros((2, 3, 2)), numpy.zeros(2)), [Blob()])
    with pytest.raises(NetError, match='same count'):
        make_layer('SigmoidCrossEntropyLoss').setup(
            blobs(numpy.zeros((2, 3)), numpy.zeros((2, 2))), [Blob()])


def test_backward_only_where_asked():
    rng = numpy.random.default_rng(0)
    params, arrays, _ = _case('EuclideanLoss', rng)
    layer = make_layer('EuclideanLoss')
    bottom = blobs(*arrays)
    top = [Blob()]
    layer.setup(bottom, top)
    layer.forward(bottom, top)
    bottom[0].diff[...] = 42
    layer.backward(top, [False, True], bottom)
    assert (bottom[0].diff == 42).all()
    assert abs(bottom[1].diff).sum() > 0


def test_caffeplus_error_type():
    assert issubclass(NetError, CaffeplusError)


# -- CuPy ------------------------------------------------------------------------
GPU_CASES = [
    ('SoftmaxWithLoss', 'softmax_param { axis: 2 } loss_param { ignore_label: 3 }',
     lambda r: [r.normal(size=(2, 3, 3, 2)), labels_for(r, (2, 3, 2), 3, ignore=3)]),
    ('SigmoidCrossEntropyLoss', 'loss_param { ignore_label: -1 normalization: VALID }',
     lambda r: [r.normal(size=(2, 5)), numpy.where(r.random((2, 5)) < 0.3, -1, r.random((2, 5)))]),
    ('EuclideanLoss', '', lambda r: [r.normal(size=(3, 4)), r.normal(size=(3, 4))]),
    ('HingeLoss', 'hinge_loss_param { norm: L2 }',
     lambda r: [r.normal(size=(4, 3)), r.integers(0, 3, size=4)]),
    ('ContrastiveLoss', 'contrastive_loss_param { margin: 2 }',
     lambda r: [r.normal(size=(4, 3)), r.normal(size=(4, 3)), [[1], [0], [0], [1]]]),
    ('InfogainLoss', 'loss_param { ignore_label: 0 normalization: FULL }',
     lambda r: [r.normal(size=(3, 4, 2)), r.integers(0, 4, size=(3, 2)), r.random((4, 4))]),
    ('MultinomialLogisticLoss', '', lambda r: [r.uniform(0.1, 1, size=(3, 4)), [[1], [0], [3]]]),
]


@pytest.mark.gpu
@pytest.mark.parametrize('type_name,params,make', GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_cupy_matches_numpy(type_name, params, make):
    import caffeplus
    from caffeplus import backend
    arrays = make(numpy.random.default_rng(3))
    results = []
    for gpu in (False, True):
        caffeplus.set_mode_gpu() if gpu else caffeplus.set_mode_cpu()
        ret, value, diffs, top = run(make_layer(type_name, params), blobs(*arrays),
                                     top_diff=0.7)
        assert (backend.get_array_module(top[0].data).__name__ == 'cupy') == gpu
        results.append((ret, value, [None if d is None else backend.to_numpy(d) for d in diffs]))
    caffeplus.set_mode_cpu()
    (r0, v0, d0), (r1, v1, d1) = results
    close(v1, v0)
    close(r1, r0)
    for a, b in zip(d0, d1):
        assert (a is None) == (b is None)
        if a is not None:
            close(b, a)


# -- inside a Net ------------------------------------------------------------------
NET = """
name: "losses" force_backward: true
layer { name: "in" type: "Input" top: "x" top: "label" top: "H"
        input_param { shape { dim: 3 dim: 4 } shape { dim: 3 } shape { dim: 4 dim: 4 } } }
layer { name: "swl" type: "SoftmaxWithLoss" bottom: "x" bottom: "label" top: "swl"
        loss_weight: 0.5 }
layer { name: "info" type: "InfogainLoss" bottom: "x" bottom: "label" bottom: "H" top: "info" }
"""


def test_losses_in_a_net():
    import caffeplus
    param = caffe_pb2.NetParameter()
    text_format.Parse(NET, param)
    net = caffeplus.Net(param, caffeplus.TRAIN)
    rng = numpy.random.default_rng(4)
    x = rng.normal(size=(3, 4)).astype(numpy.float32)
    label = numpy.array([1, 0, 3], numpy.float32)
    H = rng.random((4, 4)).astype(numpy.float32)
    net.blobs['x'].data = x
    net.blobs['label'].data = label
    net.blobs['H'].data = H
    loss = net.forward_prefilled()
    swl, gswl = ref_softmax_with_loss(x, label)
    info, ginfo = ref_infogain(x, label, H)
    close(float(net.blobs['swl'].data), swl)
    close(float(net.blobs['info'].data), info)
    close(loss, 0.5 * swl + info)
    assert net.blob_loss_weights['swl'] == 0.5
    # force_backward reaches x only: labels and H take no gradient
    names = net.bottom_names
    need = dict(zip(net.layer_dict, net.bottom_need_backward))
    assert need['info'] == [True, False, False]
    assert names['swl'][1].startswith('label') and need['swl'][1] is False
    net.backward_all()
    close(net.blobs['x'].diff, 0.5 * gswl + ginfo)
