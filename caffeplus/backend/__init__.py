"""The array backend: NumPy on the CPU, CuPy on the GPU.

Layers write their math once against `xp` (the array module of their
inputs, found with get_array_module) in the style of Chainer; a cuDNN path
is a separate, explicit branch where cuDNN has the op.
"""
import numpy

from caffeplus.errors import CaffeplusError

CPU, GPU = 'cpu', 'gpu'
_state = {'mode': CPU, 'device': 0, 'xp': numpy}


def mode():
    return _state['mode']


def xp():
    """The array module of the current mode."""
    return _state['xp']


def set_mode_cpu():
    _state.update(mode=CPU, xp=numpy)


def set_mode_gpu(device=None):
    try:
        import cupy
    except ImportError as exc:
        raise CaffeplusError(
            'GPU mode needs CuPy, which is not installed (%s). Install it with '
            "`pip install caffeplus[gpu]` or `pip install cupy-cuda12x`." % exc)
    if device is not None:
        _state['device'] = int(device)
    try:
        cupy.cuda.Device(_state['device']).use()
    except Exception as exc:  # CUDA driver errors come in several types
        raise CaffeplusError('cannot use GPU %d: %s' % (_state['device'], exc))
    _state.update(mode=GPU, xp=cupy)
    from caffeplus.backend import mathmode
    mathmode.ensure_strict_default()   # strict FP32 unless set_math_mode('tf32')


def set_device(device):
    _state['device'] = int(device)
    if _state['mode'] == GPU:
        set_mode_gpu(device)


def device():
    return _state['device']


def get_array_module(*arrays):
    """numpy or cupy, whichever the given arrays live in."""
    for a in arrays:
        mod = type(a).__module__
        if mod.startswith('cupy'):
            import cupy
            return cupy
    return numpy


def on_device_float32(arrays):
    """Whether `arrays` are all C-contiguous float32 CuPy arrays, as the
    solver's one-kernel-for-all-parameters passes need (at least one)."""
    return bool(arrays) and all(type(a).__module__.startswith('cupy') and
                                a.dtype == numpy.float32 and a.flags.c_contiguous
                                for a in arrays)


def to_numpy(a):
    if type(a).__module__.startswith('cupy'):
        return a.get()
    return numpy.asarray(a)


def gpu_name(device):
    try:
        import cupy
        name = cupy.cuda.runtime.getDeviceProperties(device)['name']
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return 'unknown'


def release_cached(xp):
    """Hand the device memory that CuPy's pool caches but no array holds back
    to the device: arrays a plan replaced (a net's first blobs, its default
    workspace, an old arena) would else stay in the process's footprint."""
    if xp is numpy:
        return
    try:
        xp.get_default_memory_pool().free_all_blocks()
    except AttributeError:
        pass


_SCRATCH = {}


def device_scratch(slot, count, dtype):
    """`count` values of `dtype` from a device buffer kept per slot, device
    and type (grown to the largest asked for), for calls that take turns
    with it; its start stays 256-byte aligned, as CuPy allocates."""
    import cupy
    key = (slot, cupy.cuda.runtime.getDevice(), numpy.dtype(dtype))
    buf = _SCRATCH.get(key)
    if buf is None or buf.size < count:
        buf = _SCRATCH[key] = cupy.empty(max(int(count), 1), dtype)
    return buf[:count]


def scratch_buffers():
    """The device_scratch buffers as they are now (a captured CUDA graph
    keeps them: caffeplus.pass_graph)."""
    return tuple(_SCRATCH.values())
