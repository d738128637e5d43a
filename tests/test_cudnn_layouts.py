"""Channels-last strides for cuDNN's Nd descriptors, checked against NumPy:
a (N, H, W, C) array seen as (N, C, H, W) has exactly these strides."""
import numpy
import pytest

from caffeplus.cudnn import api


@pytest.mark.parametrize('shape', [(2, 3, 4, 5), (64, 64, 224, 224), (1, 8, 7), (3, 2, 4, 5, 6)])
def test_nhwc_strides_are_a_channels_last_arrays(shape):
    channels_last = numpy.empty((shape[0],) + tuple(shape[2:]) + (shape[1],), numpy.float16)
    view = numpy.moveaxis(channels_last, -1, 1)          # logical N, C, spatial...
    assert view.shape == tuple(shape)
    assert api.nhwc_strides(shape) == [s // view.itemsize for s in view.strides]
