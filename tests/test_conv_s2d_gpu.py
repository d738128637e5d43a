"""The space-to-depth convolution variant (layers/conv_s2d.py) on the GPU:
timed search times it beside cuDNN's algorithms for a strided image
convolution; forced to it, the forward and the filter gradient give the
convolution's values (the CPU's float32 layer, and cuDNN's own calls over
the same 16-bit values), in float32 and the 16-bit types, the image in
Caffe's order or channels-last, the batch whole or in halves, and the same
bits every pass."""
import numpy
import pytest

from test_gpu_layers import (_assert_close, _exact_conv_inputs, _forced_conv_passes, _param,
                             _type_and_tolerance)

pytestmark = pytest.mark.gpu

S2D = 6


def _round(lp, x, dy, params, dtype, variant, slices=1):
    """Two forward and backward passes of the layer over `dtype` maps, its
    forward and filter gradient forced to the space-to-depth variant
    (`variant` 6) over the batch in `slices`, or to cuDNN's fastest that
    the arena holds (0)."""
    from caffeplus.cudnn import api

    def pick(site, arena):
        if variant == S2D:
            return [c for c in site.candidates if c.variant == S2D and
                    api.s2d_parts(c.algo)[0] == slices]
        return [c for c in site.candidates if c.variant != S2D and c.memory <= arena]

    def check(layer):
        assert layer._s2d is not None
    return _forced_conv_passes(lp, x, dy, params, dtype, pick, passes=2, check=check)[2]


@pytest.mark.parametrize('slices', [1, 2])
@pytest.mark.parametrize('type_name, channels_last', [
    ('float32', False), ('float16', False), ('float16', True), ('bfloat16', True)])
@pytest.mark.parametrize('conv, shape', [
    ('num_output: 8 kernel_size: 11 stride: 4', (4, 3, 39, 35)),
    ('num_output: 6 kernel_size: 7 stride: 2 pad: 3', (4, 3, 20, 21))])
def test_space_to_depth_variant_follows_the_convolution(type_name, channels_last, conv, shape,
                                                       slices, monkeypatch):
    from caffeplus.backend import mathmode
    from caffeplus.layers import cudnn_conv
    monkeypatch.setattr(cudnn_conv, 'IMAGE_CHANNELS_LAST', channels_last)
    dtype, tol = _type_and_tolerance(type_name)
    lp = _param('type: "Convolution" convolution_param { %s }' % conv)
    x, params, dy, cpu = _exact_conv_inputs(lp, shape, dtype, 41)
    old_math = mathmode.set_math_mode('strict')
    try:
        s2d, s2d_again = _round(lp, x, dy, params, dtype, S2D, slices)
        cudnn, _ = _round(lp, x, dy, params, dtype, 0)
    finally:
        mathmode.set_math_mode(old_math)
    for a, b, c, what in zip(s2d, cudnn, cpu, ['top', 'dx', 'dw', 'db']):
        _assert_close(a, b, tol, '%s space-to-depth against cuDNN, %s' % (type_name, what))
        _assert_close(a, c, tol, '%s space-to-depth against the CPU, %s' % (type_name, what))
    for i in (0, 2):        # the variant's own calls: the top and the filter gradient
        numpy.testing.assert_array_equal(s2d[i], s2d_again[i])
