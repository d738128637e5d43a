"""GPU math modes: how float32 convolutions and matrix products may round.

    strict         (default) true FP32: cuDNN convolutions with
                   CUDNN_FMA_MATH (no tensor cores), CuPy/cuBLAS matmuls with
                   the default (non-TF32) compute type, caffeplus.backend.blas
                   GEMMs (InnerProduct) with CUBLAS_COMPUTE_32F.
    tf32           TF32 tensor cores allowed: cuDNN algorithms searched under
                   TENSOR_OP_MATH and each run with the math type cuDNN found
                   it with (DEFAULT or TENSOR_OP, both TF32-capable; layers/
                   cudnn.py _ConvDescs.conv_for), CuPy's float32 compute type
                   COMPUTE_TYPE_TF32 (what CUPY_TF32=1 selects), blas GEMMs
                   with CUBLAS_COMPUTE_32F_FAST_TF32 (bias sums stay FP32).
                   About 3e-4 relative error instead of 1e-6.
    deterministic  strict, and only convolution algorithms cuDNN reports as
                   deterministic (bit-identical runs); MAX pooling uses
                   CUDNN_POOLING_MAX_DETERMINISTIC.

Modes combine with '+' or ',' ('tf32+deterministic'). The solver's
caffeplus_param.math and the CLI's --math pass their string here.
Layers read the mode at reshape (when they build their descriptors), so set
it before building a net; set_math_mode also marks every live cuDNN layer
to rebuild at its next reshape.
"""
import os

from caffeplus.errors import CaffeplusError

MODES = ('strict', 'tf32', 'deterministic')
_state = {'tf32': False, 'deterministic': False, 'generation': 0}

# CuPy's compute-type codes (cupy/_core/_routines_linalg.pyx).
_CUPY_COMPUTE_DEFAULT = 1
_CUPY_COMPUTE_TF32 = 7


def parse(name):
    """'strict' | 'tf32' | 'deterministic' | combinations -> (tf32, deterministic)."""
    if name is None or name == '':
        name = 'strict'
    parts = [p.strip().lower() for p in str(name).replace(',', '+').split('+') if p.strip()]
    for p in parts:
        if p not in MODES:
            raise CaffeplusError("unknown math mode '%s': choose strict, tf32 or deterministic "
                                 "(or combine them: tf32+deterministic)" % p)
    return 'tf32' in parts, 'deterministic' in parts


def set_math_mode(name):
    """Select the GPU math mode; returns the previous mode's name."""
    previous = math_mode()
    tf32, deterministic = parse(name)
    _state.update(tf32=tf32, deterministic=deterministic)
    _state['generation'] += 1
    _apply_cupy()
    return previous


def math_mode():
    parts = []
    if _state['tf32']:
        parts.append('tf32')
    if _state['deterministic']:
        parts.append('deterministic')
    return '+'.join(parts) or 'strict'


def tf32():
    return _state['tf32']


def deterministic():
    return _state['deterministic']


def generation():
    """Bumped on every change: layers compare it to know when to rebuild."""
    return _state['generation']


def cudnn_math_type():
    """cudnnMathType_t for convolution descriptors."""
    from caffeplus.cudnn import api
    return api.TENSOR_OP_MATH if _state['tf32'] else api.FMA_MATH


def _apply_cupy():
    """Set CuPy's float32 matmul compute type (only if CuPy is imported: the
    environment variable covers a later import)."""
    os.environ['CUPY_TF32'] = '1' if _state['tf32'] else '0'
    import sys
    if 'cupy' not in sys.modules:
        return
    try:
        import numpy
        from cupy._core import _routines_linalg
        _routines_linalg.set_compute_type(
            numpy.float32, _CUPY_COMPUTE_TF32 if _state['tf32'] else _CUPY_COMPUTE_DEFAULT)
    except Exception:   # an older/newer CuPy without this hook: the env var still applies
        pass


def ensure_strict_default():
    """Called when GPU mode starts: an inherited CUPY_TF32=1 must not turn
    strict mode into TF32 behind the user's back."""
    _apply_cupy()
