"""A data layer's batch transformed on the GPU: raw pixels in, float32 out.

The host sends the batch as it was stored or decoded (uint8, a quarter of
the float32 bytes) and the plan's per-image decisions; one kernel then
evaluates batch_transform's formula for every output value:

    out[n, c, i, j] = (raw[n, c, y, x] - mean[c, y, x]) * scale
        y = h_off[n] + i,   x = w_off[n] + (mirror[n] ? crop_w - 1 - j : j)

The subtraction and the product are done in float32 in that order, as the
host path does, so both give the same bits.

DeviceFeeder stages the raw batch in pinned host memory and copies it on a
stream of its own, so the copy of batch k+1 overlaps the compute of batch k;
the compute stream waits for the copy's event before the kernel reads it.
"""
import numpy

from caffeplus.io.batch_transform import check_plan

_SOURCE = r'''
extern "C" __global__ void transform_batch(
    const {T}* raw, const long long* h_off, const long long* w_off,
    const unsigned char* mirror, const float* mean, const float* mean_values,
    float scale, int apply_scale, float* out,
    int n, int c, int h, int w, int ch, int cw)
{{
    long long total = (long long)n * c * ch * cw;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)blockDim.x * gridDim.x) {{
        int j = (int)(idx % cw);
        int i = (int)((idx / cw) % ch);
        int k = (int)((idx / ((long long)cw * ch)) % c);
        int b = (int)(idx / ((long long)cw * ch * c));
        int y = (int)h_off[b] + i;
        int x = (int)w_off[b] + (mirror[b] ? cw - 1 - j : j);
        float v = (float)raw[(((long long)b * c + k) * h + y) * w + x];
        if (mean) v = v - mean[((long long)k * h + y) * w + x];
        else if (mean_values) v = v - mean_values[k];
        if (apply_scale) v = v * scale;
        out[idx] = v;
    }}
}}
'''

_TYPES = {numpy.dtype(numpy.uint8): 'unsigned char', numpy.dtype(numpy.float32): 'float'}
_kernels = {}


def kernel_source(dtype):
    """The transform kernel's CUDA source for pixels of `dtype`."""
    dtype = numpy.dtype(dtype)
    if dtype not in _TYPES:
        raise ValueError('the device transform takes uint8 or float32 pixels, not %s' % dtype)
    return _SOURCE.format(T=_TYPES[dtype])


def launch(kernel, xp, raw, plan, out, null=None):
    """Run `kernel` (CuPy's, or an emulator's with xp numpy) on the batch:
    the plan's small arrays are moved to `xp` first; `null` stands for an
    absent mean."""
    check_plan(raw, plan)
    n, c, h, w = (int(s) for s in raw.shape)
    shape = (n, c, plan.crop_h, plan.crop_w)
    if tuple(out.shape) != shape or out.dtype != numpy.float32:
        raise ValueError('out is %s %s, the batch transforms to float32 %s'
                         % (out.dtype, tuple(out.shape), shape))
    if not raw.flags.c_contiguous or not out.flags.c_contiguous:
        raise ValueError('the device transform needs C-contiguous arrays')
    total = int(out.size)
    if total == 0:
        return out
    h_off = xp.ascontiguousarray(xp.asarray(plan.h_off, dtype=numpy.int64))
    w_off = xp.ascontiguousarray(xp.asarray(plan.w_off, dtype=numpy.int64))
    mirror = xp.ascontiguousarray(xp.asarray(plan.mirror, dtype=numpy.uint8))
    mean = (xp.ascontiguousarray(xp.asarray(plan.mean, dtype=numpy.float32))
            if plan.mean is not None else null)
    mean_values = (xp.ascontiguousarray(xp.asarray(plan.mean_values, dtype=numpy.float32))
                   if plan.mean_values is not None else null)
    blocks = min((total + THREADS - 1) // THREADS, MAX_BLOCKS)
    kernel((blocks,), (THREADS,),
           (raw, h_off, w_off, mirror, mean, mean_values,
            numpy.float32(plan.scale), numpy.int32(plan.scale != 1), out,
            numpy.int32(n), numpy.int32(c), numpy.int32(h), numpy.int32(w),
            numpy.int32(plan.crop_h), numpy.int32(plan.crop_w)))
    return out


# A grid-stride loop: enough blocks to fill the device, never one per value.
THREADS = 256
MAX_BLOCKS = 4096


def _kernel(cupy, dtype):
    dtype = numpy.dtype(dtype)
    if dtype not in _kernels:
        module = cupy.RawModule(code=kernel_source(dtype), options=('--fmad=false',))
        _kernels[dtype] = module.get_function('transform_batch')
    return _kernels[dtype]


def _null(cupy):
    # A pointer argument passed by value: zero is the kernel's "no mean".
    return numpy.uint64(0)


def apply_plan_device(raw, plan, out, stream=None):
    """Write the float32 batch of device array `raw` under `plan` into the
    device array `out` (N, C, crop_h, crop_w), on `stream` (the current one
    by default). The plan's arrays may be on the host; they are small."""
    import cupy
    stream = stream or cupy.cuda.get_current_stream()
    with stream:
        return launch(_kernel(cupy, raw.dtype), cupy, raw, plan, out, _null(cupy))


class DeviceFeeder:
    """Raw batches to the device through pinned memory, on a copy stream.

    send(raw) copies a host batch into a pinned staging buffer, starts its
    copy to the device on the copy stream and returns a ticket; transform()
    makes the compute stream wait for that copy and runs the kernel. Two
    staging buffers alternate, so the next batch's copy can run while the
    current one is transformed.
    """

    def __init__(self, slots=2):
        import cupy
        self._cupy = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._slots = [None] * slots
        self._next = 0

    def _slot(self, shape, dtype):
        cupy = self._cupy
        k = self._next
        self._next = (k + 1) % len(self._slots)
        slot = self._slots[k]
        nbytes = int(numpy.prod(shape)) * numpy.dtype(dtype).itemsize
        if slot is None or slot['nbytes'] < nbytes:
            pinned = cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
            slot = {'pinned': pinned, 'nbytes': nbytes,
                    'device': cupy.empty(max(nbytes, 1), dtype=numpy.uint8),
                    'done': None}
            self._slots[k] = slot
        if slot['done'] is not None:
            slot['done'].synchronize()     # the kernel that read this slot is finished
        return slot

    def send(self, raw):
        """Start copying host array `raw` to the device; returns the ticket
        that transform() takes."""
        cupy = self._cupy
        raw = numpy.ascontiguousarray(raw)
        slot = self._slot(raw.shape, raw.dtype)
        host = numpy.frombuffer(slot['pinned'], dtype=raw.dtype, count=raw.size).reshape(raw.shape)
        host[...] = raw
        device = slot['device'][:raw.nbytes].view(raw.dtype).reshape(raw.shape)
        device.set(host, stream=self.stream)
        copied = cupy.cuda.Event(block=False, disable_timing=True)
        copied.record(self.stream)
        return {'slot': slot, 'device': device, 'copied': copied}

    def transform(self, ticket, plan, out):
        """Run the plan on the sent batch into device array `out`, on the
        current stream, after the copy."""
        cupy = self._cupy
        stream = cupy.cuda.get_current_stream()
        stream.wait_event(ticket['copied'])
        apply_plan_device(ticket['device'], plan, out, stream)
        done = cupy.cuda.Event(block=False, disable_timing=True)
        done.record(stream)
        ticket['slot']['done'] = done
        return out
