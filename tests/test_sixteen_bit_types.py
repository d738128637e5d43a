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


def test_lrn_kernel_arguments_match_the_kernels_source():
    """The layer's launch of cp_lrn_*: one thread a chunk of channels of a
    pixel, the window bound the kernels' register arrays hold, Caffe's
    alpha / local_size in float32."""
    import re
    from caffeplus.kernel_sources_extra import EXTRA
    from caffeplus.layers import cudnn_lrn
    from caffeplus.proto import caffe_pb2
    assert int(re.search(r'#define CP_LRN_MAX (\d+)', EXTRA).group(1)) == \
        cudnn_lrn.KERNEL_MAX_SIZE
    # An instance for every size the layer may launch (Caffe's are odd).
    sizes = re.search(r'#define CP_LRN_SIZES\(F\) (.*)', EXTRA).group(1)
    assert [int(v) for v in re.findall(r'F\((\d+)\)', sizes)] == \
        list(range(1, cudnn_lrn.KERNEL_MAX_SIZE + 1, 2))
    fwd = re.search(r'void cp_lrn_fwd\(([^)]*)\)', EXTRA).group(1)
    param = caffe_pb2.LayerParameter(name='norm2', type='LRN')
    param.lrn_param.local_size = 5
    param.lrn_param.alpha = 1e-4
    layer = cudnn_lrn.CuDNNLRNLayer(param)
    layer.size, layer.alpha, layer.beta, layer.k = 5, 1e-4, 0.75, 1.0
    args = layer._kernel_args((128, 256, 27, 27))
    assert len(args) + 2 == fwd.count(',') + 1          # after the two map pointers
    chunks = 256 // cudnn_lrn.KERNEL_CHANNEL_CHUNK
    assert int(args[0]) == 128 * chunks * 27 * 27
    assert (int(args[1]), int(args[2]), int(args[3])) == (256, 27 * 27, 5)
    assert args[4] == numpy.float32(numpy.float32(1e-4) / numpy.float32(5))
    assert int(args[-1]) == cudnn_lrn.KERNEL_CHANNEL_CHUNK
    # A last chunk that is not full still gets its threads.
    assert int(layer._kernel_args((2, 17, 3, 3))[0]) == 2 * 2 * 9
