"""Caffe's fillers: each keeps its distribution (moments and bounds checked
statistically against the formulas of Caffe's filler.hpp), draws into the
blob's own storage, and repeats under a seed."""
import math

import numpy
import pytest

import caffeplus
from caffeplus import fillers
from caffeplus.blob import Blob
from caffeplus.proto import caffe_pb2
from google.protobuf import text_format

SHAPE = (64, 32, 5, 5)          # Caffe's fan_in: count / 64 = 800; fan_out: count / 32 = 1600


def _filler(text):
    return text_format.Parse(text, caffe_pb2.FillerParameter())


def _filled(text, shape=SHAPE):
    blob = Blob(shape)
    fillers.fill(blob, _filler(text))
    return numpy.array(blob.data, dtype=numpy.float64)


def _assert_uniform(values, low, high):
    """Bounds, mean and variance of U[low, high]; the tolerances are five
    standard errors of the sample moments."""
    n = values.size
    span = high - low
    assert values.min() >= numpy.float32(low) and values.max() <= numpy.float32(high)
    # The extremes come close to the bounds (a scaled [0, 1/2) would not).
    assert values.min() < low + span * 1e-3 and values.max() > high - span * 1e-3
    assert abs(values.mean() - (low + high) / 2) < 5 * span / math.sqrt(12 * n)
    var = span ** 2 / 12
    assert abs(values.var() - var) < 5 * var * math.sqrt(0.8 / n)


def _assert_normal(values, mean, std):
    n = values.size
    assert abs(values.mean() - mean) < 5 * std / math.sqrt(n)
    assert abs(values.std() - std) < 5 * std / math.sqrt(2 * n)
    # Tails of a normal, not of a uniform: 0.27% beyond 3 sigma.
    beyond = numpy.mean(numpy.abs(values - mean) > 3 * std)
    assert 0.0015 < beyond < 0.0040


def test_constant():
    values = _filled('type: "constant" value: 0.25')
    assert (values == numpy.float32(0.25)).all()
    assert (_filled('type: "constant"') == 0).all()


def test_uniform_bounds_and_moments():
    _assert_uniform(_filled('type: "uniform" min: -0.3 max: 0.7'), -0.3, 0.7)
    _assert_uniform(_filled('type: "uniform"'), 0.0, 1.0)       # Caffe's defaults


def test_uniform_of_an_empty_range_is_its_bound():
    assert (_filled('type: "uniform" min: 2 max: 2') == 2).all()


class _LargestDraws:
    """A stand-in generator whose every [0, 1) float32 draw is the largest
    NumPy's can be, (2**24 - 1) / 2**24: what a uniform filler writes from
    it is its largest value."""

    def random(self, dtype, out):
        out[...] = numpy.float32(1 - 2.0 ** -24)
        return out


# The last pair's largest draw rounds one step past high (its width, taken
# in float64, rounds up to float32): the case the clamp is kept for.
_OVERSHOOT = (-0.24266349212557745, -0.21885267692002966)


@pytest.mark.parametrize('low, high', [(-0.3, 0.7), (0.0, 1.0), (-1.0, 1.0), (0.1, 0.3),
                                       (-0.0123, 0.0123), (1e-3, 1e6), (-7.7, -7.6),
                                       (2.0, 3.0), (-3.0, 10.0), _OVERSHOOT])
def test_the_largest_uniform_draw_never_passes_the_upper_bound(low, high):
    """The clamp to `high` is skipped only where float32 rounding cannot
    carry the largest draw past it."""
    out = numpy.empty(8, dtype=numpy.float32)
    fillers._uniform(_LargestDraws(), out, low, high)
    high32 = numpy.float32(high)
    assert (out <= high32).all()
    # The unclamped value, computed independently: the exact float64
    # product and sum of float32s, each rounded once to float32.
    u = 1 - 2.0 ** -24
    scaled = numpy.float32(u * float(numpy.float32(high - low)))
    unclamped = numpy.float32(float(scaled) + float(numpy.float32(low)))
    assert out[0] == min(unclamped, high32)
    if (low, high) == _OVERSHOOT:
        assert unclamped > high32

def test_gaussian_moments():
    _assert_normal(_filled('type: "gaussian" mean: 0.5 std: 0.02'), 0.5, 0.02)
    _assert_normal(_filled('type: "gaussian"'), 0.0, 1.0)        # Caffe's defaults


def test_sparse_gaussian_keeps_sparse_of_each_column():
    """Caffe keeps each weight with probability sparse / num_outputs (the
    first axis), so about `sparse` non-zeros per input column."""
    shape = (100, 4000)
    values = _filled('type: "gaussian" std: 2 sparse: 10', shape)
    kept = values != 0
    p = 10 / 100.0
    n = values.size
    assert abs(kept.mean() - p) < 5 * math.sqrt(p * (1 - p) / n)
    _assert_normal(values[kept], 0.0, 2.0)


def test_positive_unitball_rows_sum_to_one():
    values = _filled('type: "positive_unitball"')
    assert (values >= 0).all()
    rows = values.reshape(SHAPE[0], -1)
    numpy.testing.assert_allclose(rows.sum(axis=1), 1.0, rtol=1e-5)
    # Uniform draws normalised: each row's values spread as U[0, 1] does.
    scaled = rows * rows.shape[1]
    assert abs(scaled.mean() - 1.0) < 1e-4
    assert abs(scaled.var() - 4.0 / 12) < 0.02


@pytest.mark.parametrize('norm, n', [('FAN_IN', 800), ('FAN_OUT', 1600),
                                     ('AVERAGE', (800 + 1600) / 2.0)])
def test_xavier_is_uniform_of_variance_one_over_n(norm, n):
    scale = math.sqrt(3.0 / n)
    _assert_uniform(_filled('type: "xavier" variance_norm: %s' % norm), -scale, scale)


@pytest.mark.parametrize('norm, n', [('FAN_IN', 800), ('FAN_OUT', 1600),
                                     ('AVERAGE', (800 + 1600) / 2.0)])
def test_msra_is_normal_of_variance_two_over_n(norm, n):
    _assert_normal(_filled('type: "msra" variance_norm: %s' % norm), 0.0, math.sqrt(2.0 / n))


@pytest.mark.parametrize('width', [3, 4, 5])
def test_bilinear_against_its_formula(width):
    """Caffe's loop over every element, in float64."""
    shape = (2, 3, width, width)
    got = _filled('type: "bilinear"', shape)
    f = math.ceil(width / 2.0)
    c = (2 * f - 1 - f % 2) / (2.0 * f)
    want = numpy.empty(int(numpy.prod(shape)))
    for i in range(want.size):
        x, y = i % width, (i // width) % width
        want[i] = (1 - abs(x / f - c)) * (1 - abs(y / f - c))
    numpy.testing.assert_array_equal(got, want.reshape(shape).astype(numpy.float32))


@pytest.mark.parametrize('text', ['type: "uniform" min: -1 max: 1', 'type: "gaussian" std: 3',
                                  'type: "gaussian" std: 3 sparse: 5', 'type: "xavier"',
                                  'type: "msra"', 'type: "positive_unitball"'])
def test_a_seed_repeats_and_fill_matches_fill_array(text):
    caffeplus.set_random_seed(7)
    first = _filled(text)
    caffeplus.set_random_seed(7)
    again = fillers.fill_array(_filler(text), SHAPE)
    assert again.dtype == numpy.float32
    numpy.testing.assert_array_equal(first, again)
    assert not numpy.array_equal(first, _filled(text))      # the stream moved on


@pytest.mark.parametrize('text', ['type: "gaussian" std: 1', 'type: "xavier"',
                                  'type: "uniform" min: -2 max: 3', 'type: "msra"',
                                  'type: "constant" value: 3', 'type: "positive_unitball"'])
def test_fill_draws_into_the_blobs_own_storage(text):
    """No array of the blob's size is made and copied in (VGG-16's fc6 is
    400 MB): the values land in the storage the blob already views."""
    import tracemalloc
    blob = Blob((1024, 1024))
    view = blob.data
    tracemalloc.start()
    try:
        fillers.fill(blob, _filler(text))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < blob.count * 4 // 8
    assert numpy.shares_memory(view, blob.data) and view.any()


def test_a_new_blob_filled_with_zero_stays_zero():
    blob = Blob((3, 4))
    fillers.fill(blob, _filler('type: "constant"'))
    assert (blob.data == 0).all()
    blob.data[...] = 5                              # not a new blob: zero is written
    fillers.fill(blob, _filler('type: "constant"'))
    assert (blob.data == 0).all()


def test_bad_fields_are_checked_before_filling_a_blob():
    blob = Blob((2, 3))
    with pytest.raises(caffeplus.errors.NetError, match=r'FillerParameter\.std'):
        fillers.fill(blob, _filler('type: "gaussian" std: -1'))
    with pytest.raises(caffeplus.errors.NetError, match='Unknown filler name'):
        fillers.fill(blob, _filler('type: "nope"'))
    with pytest.raises(caffeplus.errors.NetError, match='square kernels'):
        fillers.fill(blob, _filler('type: "bilinear"'))


def test_shape_only_builds_draw_nothing():
    """Under caffeplus.memory.shapes.shape_only a filled array takes no
    memory and the real stream is not drawn from."""
    from caffeplus import rng
    from caffeplus.memory import shapes
    caffeplus.set_random_seed(3)
    before = rng.get_state()
    with shapes.shape_only():
        values = fillers.fill_array(_filler('type: "gaussian" std: 1'), (4096, 4096))
        blob = Blob((4096, 4096))
        fillers.fill(blob, _filler('type: "xavier"'))
    assert values.shape == (4096, 4096) and not any(values.strides)
    assert rng.get_state() == before


def test_building_a_net_fills_its_weights_without_a_second_copy():
    """Net construction: the 4 MiB of weights are drawn where they live;
    a filled array copied into the blob would double the peak."""
    import tracemalloc
    text = ('input: "x" input_shape { dim: 1 dim: 1024 } '
            'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param '
            '{ num_output: 1024 weight_filler { type: "gaussian" std: 0.01 } '
            'bias_filler { type: "constant" value: 0.5 } } }')
    param = text_format.Parse(text, caffe_pb2.NetParameter())
    caffeplus.Net(param, caffeplus.TEST)        # one-off caches of a first build
    tracemalloc.start()
    try:
        net = caffeplus.Net(param, caffeplus.TEST)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    weights, bias = net.params['ip']
    assert peak < 1.5 * weights.count * 4
    assert abs(float(weights.data.std()) - 0.01) < 0.0005 and (bias.data == 0.5).all()
