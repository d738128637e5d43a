"""Out of GPU memory: telling CuPy's, CUDA's and cuDNN's allocation errors
apart from others, and the error that names the layer, what it was doing,
the memory plan and the bytes asked for."""
import re

from caffeplus.errors import CaffeplusError


def _cupy():
    import cupy
    return cupy


def is_out_of_memory(exc):
    name = type(exc).__name__
    if name == 'OutOfMemoryError':
        return True
    if name == 'CUDARuntimeError' and 'cudaErrorMemoryAllocation' in str(exc):
        return True
    return name == 'CudnnError' and 'ALLOC' in str(exc).upper()      # STATUS_ALLOC_FAILED


def requested_bytes(exc):
    """The byte count in CuPy's 'Out of memory allocating 1,234 bytes' message."""
    m = re.search(r'allocating ([\d,]+) bytes', str(exc))
    return int(m.group(1).replace(',', '')) if m else None


def out_of_memory_error(layer, stage, exc, plan=None, nbytes=None):
    """A CaffeplusError naming the layer, what it was doing, the plan and the bytes."""
    if nbytes is None:
        nbytes = requested_bytes(exc)
    if plan is None:
        plan = getattr(layer, 'memory_plan', None) or 'arena'
    name = getattr(getattr(layer, 'layer_param', None), 'name', None) or str(layer)
    ltype = getattr(getattr(layer, 'layer_param', None), 'type', '')
    free = total = None
    try:
        free, total = _cupy().cuda.runtime.memGetInfo()
    except Exception:
        pass
    msg = ('out of GPU memory in layer %s (%s) during %s under memory plan \'%s\': '
           'asked for %s bytes' % (name, ltype, stage, plan,
                                   '{:,}'.format(nbytes) if nbytes is not None else 'an unknown number of'))
    if free is not None:
        msg += ' with {:,} of {:,} bytes free on the device'.format(free, total)
    msg += ('. Try a smaller batch, a memory plan that reuses buffers (shared, offload, auto) '
            'or a lower --workspace_limit. (%s)' % exc)
    err = CaffeplusError(msg)
    err.layer, err.stage, err.plan, err.nbytes = name, stage, plan, nbytes
    return err
