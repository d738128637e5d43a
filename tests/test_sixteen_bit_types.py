"""How the 16-bit storage types reach the GPU libraries, checked without a
GPU: cuDNN's and cuBLAS's type codes for each NumPy type, and the float32
route BFLOAT16 maps take through cuDNN's LRN (which has no BFLOAT16 form)."""
import numpy
import pytest

from caffeplus.backend import blas
from caffeplus.cudnn import api
from caffeplus.errors import CaffeplusError

ml_dtypes = pytest.importorskip('ml_dtypes')


@pytest.mark.parametrize('dtype,code', [
    (None, 0), (numpy.float32, 0), (numpy.dtype(numpy.float32), 0),
    (numpy.float16, 2), (numpy.dtype(numpy.float16), 2),
    (ml_dtypes.bfloat16, 9), (numpy.dtype(ml_dtypes.bfloat16), 9)])
def test_cudnn_data_types_of_numpy_types_and_dtypes(dtype, code):
    # cudnnDataType_t: FLOAT 0, HALF 2, BFLOAT16 9
    assert api.data_type(dtype) == code


def test_an_unsupported_type_is_a_clear_error():
    with pytest.raises(CaffeplusError, match='not float64'):
        api.data_type(numpy.float64)


def test_cublas_data_types():
    # cudaDataType: CUDA_R_32F 0, CUDA_R_16F 2, CUDA_R_16BF 14
    assert blas._DATA_TYPES == {'float32': 0, 'float16': 2, 'bfloat16': 14}
    assert numpy.dtype(ml_dtypes.bfloat16).name in blas._DATA_TYPES


def test_lrn_runs_bfloat16_maps_in_float32_slices_of_at_most_16_mib(monkeypatch):
    from caffeplus.layers import cudnn_lrn
    bf16 = numpy.dtype(ml_dtypes.bfloat16)
    assert cudnn_lrn._math_dtype(bf16) == numpy.float32
    assert cudnn_lrn._math_dtype(numpy.dtype(numpy.float16)) == numpy.float16
    made = []
    monkeypatch.setattr(cudnn_lrn.api, 'TensorDesc',
                        lambda shape, dtype=None: made.append((tuple(shape), dtype)) or shape)
    layer = cudnn_lrn.CuDNNLRNLayer.__new__(cudnn_lrn.CuDNNLRNLayer)
    # GoogLeNet's norm2 at batch 64: 192 x 56 x 56 float32 values an image (2.4 MB).
    shape = (64, 192, 56, 56)
    slices = list(layer._float32_slices(shape))
    assert slices[0][0] == 0 and slices[-1][1] == 64
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))       # no gap, no overlap
    per_image = 4 * 192 * 56 * 56
    assert all((hi - lo) * per_image <= cudnn_lrn.FLOAT32_SLICE_BYTES for lo, hi, _ in slices)
    assert all(d[0] == hi - lo and d[1:] == shape[1:] for lo, hi, d in slices)
    assert all(dtype == numpy.float32 for _, dtype in made)
    # An image larger than a slice still goes one image at a time.
    assert [hi - lo for lo, hi, _ in layer._float32_slices((2, 1024, 128, 128))] == [1, 1]
