"""caffeplus device_query: Caffe's `caffe device_query`.

    caffeplus device_query -gpu 0        (or -gpu 0,1 or -gpu all)

Logs each GPU's CUDA properties (through CuPy) in Caffe's lines. Without
CuPy or a GPU it stops with an error saying so.
"""
from caffeplus import log
from caffeplus.commands.train import parse_gpus
from caffeplus.errors import CaffeplusError

# (label, cudaDeviceProp field) in Caffe's order.
_FIELDS = (
    ('Major revision number:         ', 'major'),
    ('Minor revision number:         ', 'minor'),
    ('Name:                          ', 'name'),
    ('Total global memory:           ', 'totalGlobalMem'),
    ('Total shared memory per block: ', 'sharedMemPerBlock'),
    ('Total registers per block:     ', 'regsPerBlock'),
    ('Warp size:                     ', 'warpSize'),
    ('Maximum memory pitch:          ', 'memPitch'),
    ('Maximum threads per block:     ', 'maxThreadsPerBlock'),
    ('Maximum dimension of block:    ', 'maxThreadsDim'),
    ('Maximum dimension of grid:     ', 'maxGridSize'),
    ('Clock rate:                    ', 'clockRate'),
    ('Total constant memory:         ', 'totalConstMem'),
    ('Texture alignment:             ', 'textureAlignment'),
    ('Concurrent copy and execution: ', 'deviceOverlap'),
    ('Number of multiprocessors:     ', 'multiProcessorCount'),
    ('Kernel execution timeout:      ', 'kernelExecTimeoutEnabled'),
)
_YES_NO = ('deviceOverlap', 'kernelExecTimeoutEnabled')
# Fields newer CUDA versions dropped from cudaDeviceProp, with the device
# attribute that still carries them.
_ATTRIBUTES = {'clockRate': 13, 'deviceOverlap': 15, 'kernelExecTimeoutEnabled': 17,
               'memPitch': 11, 'textureAlignment': 14}


def add_arguments(parser):
    parser.add_argument('--gpu', default='', help="device IDs to query, separated by ',', or "
                        "'all'")


def _cupy():
    try:
        import cupy
    except ImportError as exc:
        raise CaffeplusError('device_query needs CuPy to talk to the GPU, and it is not '
                             'installed (%s): pip install cupy-cuda12x' % exc)
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise CaffeplusError('no usable CUDA GPU: %s' % exc)
    if count == 0:
        raise CaffeplusError('no CUDA GPU found')
    return cupy, count


def _value(cupy, props, device, field):
    if field in props:
        return props[field]
    if field in _ATTRIBUTES:
        try:
            return cupy.cuda.runtime.deviceGetAttribute(_ATTRIBUTES[field], device)
        except Exception:
            pass
    return None


def run(args):
    if not args.gpu:
        raise CaffeplusError('Need a device ID to query (--gpu).')
    cupy, count = _cupy()
    gpus = parse_gpus(args.gpu)
    log.info('Querying GPUs %s', args.gpu)
    for device in gpus:
        if not 0 <= device < count:
            raise CaffeplusError('GPU %d does not exist (this machine has %d)' % (device, count))
        try:
            props = cupy.cuda.runtime.getDeviceProperties(device)
        except Exception as exc:
            raise CaffeplusError('cannot query GPU %d: %s' % (device, exc))
        log.info('Device id:                     %d', device)
        for label, field in _FIELDS:
            value = _value(cupy, props, device, field)
            if value is None:
                text = 'n/a'
            elif field in _YES_NO:
                text = 'Yes' if value else 'No'
            elif isinstance(value, bytes):
                text = value.decode(errors='replace')
            elif isinstance(value, (tuple, list)):
                text = ', '.join(str(v) for v in value)
            else:
                text = str(value)
            log.info('%s%s', label, text)
    return 0
