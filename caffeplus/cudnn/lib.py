"""Finding and loading libcudnn.so.9, and turning statuses into exceptions.

Search order: the cudnn_library setting (a file; caffeplus.config), the NVIDIA cuDNN wheel's
folder (site-packages/nvidia/cudnn/lib), then the system's library paths.
"""
import ctypes
import glob
import os
import site
import sys

from caffeplus.errors import CaffeplusError

LIBNAME = 'libcudnn.so.9'
_state = {'lib': None, 'searched': []}


class CudnnError(CaffeplusError):
    """A cuDNN call returned a status other than CUDNN_STATUS_SUCCESS."""

    def __init__(self, function, status, message):
        self.function, self.status = function, status
        super().__init__('%s failed: %s (status %d)' % (function, message, status))


def _candidate_dirs():
    dirs = []
    try:
        import nvidia.cudnn
        for p in getattr(nvidia.cudnn, '__path__', []):
            dirs.append(os.path.join(p, 'lib'))
    except ImportError:
        pass
    roots = list(site.getsitepackages()) + [site.getusersitepackages()] + sys.path
    for root in roots:
        if isinstance(root, str):
            dirs.append(os.path.join(root, 'nvidia', 'cudnn', 'lib'))
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def _load():
    searched = []
    from caffeplus import config
    chosen = config.get('cudnn_library')
    candidates = [chosen] if chosen else []
    for d in _candidate_dirs():
        candidates.append(os.path.join(d, LIBNAME))
    candidates.append(LIBNAME)  # the dynamic linker's own search (LD_LIBRARY_PATH, ldconfig)
    for path in candidates:
        searched.append(path)
        if os.sep in path and not os.path.exists(path):
            continue
        try:
            if os.sep in path:
                # cuDNN 9 splits into sub-libraries it dlopens from its own
                # folder; load them globally first so they resolve.
                for sub in sorted(glob.glob(os.path.join(os.path.dirname(path), 'libcudnn_*.so.9'))):
                    try:
                        ctypes.CDLL(sub, mode=ctypes.RTLD_GLOBAL)
                    except OSError:
                        pass
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _state['lib'] = lib
        _state['searched'] = searched
        _declare(lib)
        return lib
    _state['searched'] = searched
    return None


def library():
    """The loaded cuDNN library; a clear error naming what was searched if none."""
    if _state['lib'] is None and _load() is None:
        raise CaffeplusError(
            'cuDNN (%s) was not found. Searched: %s. Install it with '
            '`pip install nvidia-cudnn-cu12` (or caffeplus[gpu]) or set '
            'CAFFEPLUS_CUDNN_LIBRARY (or --cudnn_library) to the library file.' % (LIBNAME, ', '.join(_state['searched'])))
    return _state['lib']


def available():
    try:
        library()
        return True
    except CaffeplusError:
        return False


def version():
    return int(library().cudnnGetVersion())


def check(function, status):
    if status != 0:
        msg = library().cudnnGetErrorString(status)
        raise CudnnError(function, status, msg.decode() if msg else 'unknown status')


def call(function, *args):
    """Call cudnn<function>(*args) and raise CudnnError on failure."""
    check(function, getattr(library(), function)(*args))


_P = ctypes.c_void_p
_I = ctypes.c_int
_F = ctypes.c_float
_S = ctypes.c_size_t
_IP = ctypes.POINTER(ctypes.c_int)


class FwdPerf(ctypes.Structure):
    _fields_ = [('algo', _I), ('status', _I), ('time', _F), ('memory', _S),
                ('determinism', _I), ('mathType', _I), ('reserved', _I * 3)]


# The three perf structs share one layout.
BwdDataPerf = FwdPerf
BwdFilterPerf = FwdPerf


def _declare(lib):
    sigs = {
        'cudnnGetVersion': ([], _S),
        'cudnnGetErrorString': ([_I], ctypes.c_char_p),
        'cudnnCreate': ([ctypes.POINTER(_P)], _I),
        'cudnnDestroy': ([_P], _I),
        'cudnnSetStream': ([_P, _P], _I),
        'cudnnCreateTensorDescriptor': ([ctypes.POINTER(_P)], _I),
        'cudnnDestroyTensorDescriptor': ([_P], _I),
        'cudnnSetTensorNdDescriptor': ([_P, _I, _I, _IP, _IP], _I),
        'cudnnCreateFilterDescriptor': ([ctypes.POINTER(_P)], _I),
        'cudnnDestroyFilterDescriptor': ([_P], _I),
        'cudnnSetFilterNdDescriptor': ([_P, _I, _I, _I, _IP], _I),
        'cudnnCreateConvolutionDescriptor': ([ctypes.POINTER(_P)], _I),
        'cudnnDestroyConvolutionDescriptor': ([_P], _I),
        'cudnnSetConvolutionNdDescriptor': ([_P, _I, _IP, _IP, _IP, _I, _I], _I),
        'cudnnSetConvolutionGroupCount': ([_P, _I], _I),
        'cudnnSetConvolutionMathType': ([_P, _I], _I),
        'cudnnGetConvolutionForwardAlgorithm_v7': ([_P, _P, _P, _P, _P, _I, _IP, _P], _I),
        'cudnnGetConvolutionBackwardDataAlgorithm_v7': ([_P, _P, _P, _P, _P, _I, _IP, _P], _I),
        'cudnnGetConvolutionBackwardFilterAlgorithm_v7': ([_P, _P, _P, _P, _P, _I, _IP, _P], _I),
        'cudnnFindConvolutionForwardAlgorithmEx': ([_P, _P, _P, _P, _P, _P, _P, _P, _I, _IP, _P, _P, _S], _I),
        'cudnnFindConvolutionBackwardDataAlgorithmEx': ([_P, _P, _P, _P, _P, _P, _P, _P, _I, _IP, _P, _P, _S], _I),
        'cudnnFindConvolutionBackwardFilterAlgorithmEx': ([_P, _P, _P, _P, _P, _P, _P, _P, _I, _IP, _P, _P, _S], _I),
        'cudnnGetConvolutionForwardWorkspaceSize': ([_P, _P, _P, _P, _P, _I, ctypes.POINTER(_S)], _I),
        'cudnnGetConvolutionBackwardDataWorkspaceSize': ([_P, _P, _P, _P, _P, _I, ctypes.POINTER(_S)], _I),
        'cudnnGetConvolutionBackwardFilterWorkspaceSize': ([_P, _P, _P, _P, _P, _I, ctypes.POINTER(_S)], _I),
        'cudnnConvolutionForward': ([_P, _P, _P, _P, _P, _P, _P, _I, _P, _S, _P, _P, _P], _I),
        'cudnnConvolutionBackwardData': ([_P, _P, _P, _P, _P, _P, _P, _I, _P, _S, _P, _P, _P], _I),
        'cudnnConvolutionBackwardFilter': ([_P, _P, _P, _P, _P, _P, _P, _I, _P, _S, _P, _P, _P], _I),
        'cudnnConvolutionBackwardBias': ([_P, _P, _P, _P, _P, _P, _P], _I),
        'cudnnCreatePoolingDescriptor': ([ctypes.POINTER(_P)], _I),
        'cudnnDestroyPoolingDescriptor': ([_P], _I),
        'cudnnSetPoolingNdDescriptor': ([_P, _I, _I, _I, _IP, _IP, _IP], _I),
        'cudnnPoolingForward': ([_P, _P, _P, _P, _P, _P, _P, _P], _I),
        'cudnnPoolingBackward': ([_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P], _I),
        'cudnnCreateActivationDescriptor': ([ctypes.POINTER(_P)], _I),
        'cudnnDestroyActivationDescriptor': ([_P], _I),
        'cudnnSetActivationDescriptor': ([_P, _I, _I, ctypes.c_double], _I),
        'cudnnActivationForward': ([_P, _P, _P, _P, _P, _P, _P, _P], _I),
        'cudnnActivationBackward': ([_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P], _I),
        'cudnnSoftmaxForward': ([_P, _I, _I, _P, _P, _P, _P, _P, _P], _I),
        'cudnnSoftmaxBackward': ([_P, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P], _I),
        'cudnnCreateLRNDescriptor': ([ctypes.POINTER(_P)], _I),
        'cudnnDestroyLRNDescriptor': ([_P], _I),
        'cudnnSetLRNDescriptor': ([_P, ctypes.c_uint, ctypes.c_double, ctypes.c_double, ctypes.c_double], _I),
        'cudnnLRNCrossChannelForward': ([_P, _P, _I, _P, _P, _P, _P, _P, _P], _I),
        'cudnnLRNCrossChannelBackward': ([_P, _P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P], _I),
        'cudnnAddTensor': ([_P, _P, _P, _P, _P, _P, _P], _I),
    }
    for name, (argtypes, restype) in sigs.items():
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.argtypes = argtypes
        fn.restype = restype
