"""An image layer's convolution as im2row + cuBLAS (layers/conv_gemm.py,
`rows`) on the GPU: timed search times it (switched on) for a 16-bit image
layer that writes channels-last maps from an image in Caffe's order; forced
to it, the
forward and the filter gradient give the convolution's values (the CPU's
float32 layer, and cuDNN's own calls over the same 16-bit values), the
same bits every pass."""
import numpy
import pytest

from test_gpu_layers import (_assert_close, _exact_conv_inputs, _forced_conv_passes, _param,
                             _type_and_tolerance)

pytestmark = pytest.mark.gpu

GEMM = 2


def _round(lp, x, dy, params, dtype, variant):
    """Two forward and backward passes of the layer over `dtype` maps, its
    forward and filter gradient forced to im2row + cuBLAS (`variant` 2) or
    to cuDNN's fastest that the arena holds (0)."""
    def pick(site, arena):
        if variant == GEMM:
            return [c for c in site.candidates if c.variant == GEMM]
        # cuDNN's own calls (not space-to-depth's)
        return [c for c in site.candidates if c.variant not in (GEMM, 6) and c.memory <= arena]

    def check(layer):
        assert layer.compute_nhwc and layer._bottom_relaid and layer._gemm.rows
    return _forced_conv_passes(lp, x, dy, params, dtype, pick, passes=2, check=check)[2]


@pytest.mark.parametrize('type_name', ['float16', 'bfloat16'])
@pytest.mark.parametrize('conv, shape', [
    ('num_output: 8 kernel_size: 11 stride: 4', (4, 3, 39, 35)),
    ('num_output: 6 kernel_size: 7 stride: 2 pad: 3', (5, 3, 20, 21)),
    ('num_output: 16 kernel_size: 3 pad: 1', (3, 4, 12, 10))])
def test_rows_variant_follows_the_convolution(type_name, conv, shape, monkeypatch):
    from caffeplus.backend import mathmode
    from caffeplus.cudnn import algo_search
    from caffeplus.layers import cudnn_conv
    monkeypatch.setattr(cudnn_conv, 'IMAGE_CHANNELS_LAST', True)
    monkeypatch.setattr(algo_search, 'GEMM_ROWS_SEARCH', True)
    dtype, tol = _type_and_tolerance(type_name)
    # (one bottom and one top named: an image layer runs channels-last)
    lp = _param('type: "Convolution" bottom: "x" top: "y" convolution_param { %s }' % conv)
    x, params, dy, cpu = _exact_conv_inputs(lp, shape, dtype, 43)
    old_math = mathmode.set_math_mode('strict')
    try:
        rows, rows_again = _round(lp, x, dy, params, dtype, GEMM)
        cudnn, _ = _round(lp, x, dy, params, dtype, 0)
    finally:
        mathmode.set_math_mode(old_math)
    for a, b, c, what in zip(rows, cudnn, cpu, ['top', 'dx', 'dw', 'db']):
        _assert_close(a, b, tol, '%s im2row against cuDNN, %s' % (type_name, what))
        _assert_close(a, c, tol, '%s im2row against the CPU, %s' % (type_name, what))
    for i in (0, 2):        # the variant's own calls: the top and the filter gradient
        numpy.testing.assert_array_equal(rows[i], rows_again[i])
