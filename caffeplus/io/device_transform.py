"""A data layer's batch transformed on the GPU: raw pixels in, float32 out
(float16 or bfloat16 for a 16-bit net's data top: the value computed in float32,
rounded once).

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

from caffeplus.io.batch_transform import TransformPlan, check_plan
from caffeplus.kernel_sources import CUDA_SIXTEEN_BIT_TYPES

_SOURCE = r'''
extern "C" __global__ void transform_batch(
    const {T}* raw, const long long* h_off, const long long* w_off,
    const unsigned char* mirror, const float* mean, const float* mean_values,
    float scale, int apply_scale, {O}* out,
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
        out[idx] = ({O})v;
    }}
}}
'''

_TYPES = {numpy.dtype(numpy.uint8): 'unsigned char', numpy.dtype(numpy.float32): 'float'}
_kernels = {}


def _out_type_ok(dtype):
    return dtype == numpy.float32 or dtype.name in CUDA_SIXTEEN_BIT_TYPES


def kernel_source(dtype, out_dtype=numpy.float32, cuda_headers=True):
    """The transform kernel's CUDA source for pixels of `dtype`, written as
    `out_dtype` (float32, or float16 as __half and bfloat16 as __nv_bfloat16:
    from CUDA's headers, or without `cuda_headers` the emulator's stand-ins)."""
    dtype, out_dtype = numpy.dtype(dtype), numpy.dtype(out_dtype)
    if dtype not in _TYPES:
        raise ValueError('the device transform takes uint8 or float32 pixels, not %s' % dtype)
    if not _out_type_ok(out_dtype):
        raise ValueError('the device transform writes float32, float16 or bfloat16, not %s'
                         % out_dtype)
    if out_dtype == numpy.float32:
        return _SOURCE.format(T=_TYPES[dtype], O='float')
    name, header = CUDA_SIXTEEN_BIT_TYPES[out_dtype.name]
    include = '#include <%s>\n' % header if cuda_headers else ''
    return include + _SOURCE.format(T=_TYPES[dtype], O=name)


def launch(kernel, xp, raw, plan, out, null=None):
    """Run `kernel` (CuPy's, or an emulator's with xp numpy) on the batch:
    the plan's small arrays are moved to `xp` first; `null` stands for an
    absent mean."""
    check_plan(raw, plan)
    n, c, h, w = (int(s) for s in raw.shape)
    shape = (n, c, plan.crop_h, plan.crop_w)
    if tuple(out.shape) != shape or not _out_type_ok(out.dtype):
        raise ValueError('out is %s %s, the batch transforms to float32, float16 or bfloat16 %s'
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


# Multiply and add kept apart, as the host transform computes them.
COMPILE_OPTIONS = ('--fmad=false',)


def compile_units():
    """(label, CUDA source, NVRTC options) of every build of the transform
    kernel, for tests/test_kernel_compile.py."""
    from caffeplus.precision import bfloat16_dtype
    outs = [numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), bfloat16_dtype()]
    return [('device_transform.%s_to_%s' % (t.name, o.name), kernel_source(t, o), COMPILE_OPTIONS)
            for t in _TYPES for o in outs if o is not None]


def _kernel(cupy, dtype, out_dtype=numpy.float32):
    key = (numpy.dtype(dtype), numpy.dtype(out_dtype))
    if key not in _kernels:
        module = cupy.RawModule(code=kernel_source(*key), options=COMPILE_OPTIONS)
        _kernels[key] = module.get_function('transform_batch')
    return _kernels[key]


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
        return launch(_kernel(cupy, raw.dtype, out.dtype), cupy, raw, plan, out, _null(cupy))


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


# -- a data layer's batches on the device ------------------------------------------
# Constants of at most this many values are cached by value.
SMALL_CONSTANT = 4096

def _aligned(nbytes, to=8):
    return (nbytes + to - 1) // to * to


class _Layout:
    """Where a staged batch's parts lie in one flat buffer (pinned on the
    host, and the same on the device), so that one copy carries them all:
    the raw N x C x H x W pixels, then int64 h_off and w_off, then the
    uint8 mirror flags."""

    def __init__(self, shape, dtype):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = numpy.dtype(dtype)
        n = self.shape[0]
        self.raw_bytes = int(numpy.prod(self.shape)) * self.dtype.itemsize
        self.h_off = _aligned(self.raw_bytes)
        self.w_off = self.h_off + 8 * n
        self.mirror = self.w_off + 8 * n
        self.nbytes = self.mirror + n

    def views(self, flat):
        """(raw, h_off, w_off, mirror) views of a flat uint8 buffer (NumPy or CuPy)."""
        n = self.shape[0]
        raw = flat[:self.raw_bytes].view(self.dtype).reshape(self.shape)
        return (raw, flat[self.h_off:self.w_off].view(numpy.int64),
                flat[self.w_off:self.mirror].view(numpy.int64),
                flat[self.mirror:self.mirror + n])


class _PinnedBuffer:
    __slots__ = ('memory', 'flat', 'raw', 'h_off', 'w_off', 'mirror', 'copied')


class _DeviceSlot:
    __slots__ = ('flat', 'raw', 'h_off', 'w_off', 'mirror', 'done')


class StagedBatch:
    """A batch on its way to the device: its slot, the copy's event, and the
    plan whose arrays lie in the slot. `shape` is the float32 output's."""
    __slots__ = ('slot', 'copied', 'plan', 'shape')

    def __init__(self, slot, copied, plan, shape):
        self.slot, self.copied, self.plan, self.shape = slot, copied, plan, shape


class DeviceStager:
    """A data layer's device path: uint8 batches decoded into pinned host
    memory, copied to the device on a stream of their own, transformed
    there by the kernel.

    The prefetch thread calls host_buffer() for the pinned N x C x H x W
    array the workers decode into, then send(raw, plan), which starts one
    copy (pixels and the plan's per-image decisions) into a free device slot
    and returns a StagedBatch; the layer's forward calls transform(staged,
    out), which makes the compute stream wait for that copy and runs the
    kernel into `out`.

    Reuse is ordered by events, never by timing: a pinned buffer is handed
    to the workers again only once the copy that read it has finished (the
    host waits for its event; with two buffers it rarely must), and a
    device slot is written again only after the kernel that read it (the
    copy stream waits for that event, the host never does). reclaim()
    frees the slots of batches dropped unread (a prefetcher stopped for a
    restore). `cuda_module` and `launch_kernel` stand in for CuPy and the
    kernel in tests.
    """

    def __init__(self, device, shape, dtype=numpy.uint8, pinned=2, cuda_module=None,
                 launch_kernel=None):
        if cuda_module is None:
            import cupy as cuda_module
        self._cp = cuda_module
        self.device = int(device)
        self.layout = _Layout(shape, dtype)
        self._launch = launch_kernel or apply_plan_device
        self._use_device()
        self.stream = self._cp.cuda.Stream(non_blocking=True)
        self._pinned = [self._pinned_buffer() for _ in range(max(1, int(pinned)))]
        self._next_pinned = 0
        self._current = None
        self.slots = []             # every device slot made (for counts and reclaim)
        self._free = []
        self._constants = {}        # id(host array) -> (host array, device copy)
        import threading
        self._lock = threading.Lock()

    def _use_device(self):
        # The device is current per thread: the prefetch thread must choose it too.
        self._cp.cuda.Device(self.device).use()

    def _pinned_buffer(self):
        b = _PinnedBuffer()
        b.memory = self._cp.cuda.alloc_pinned_memory(self.layout.nbytes)
        b.flat = numpy.frombuffer(b.memory, dtype=numpy.uint8, count=self.layout.nbytes)
        b.raw, b.h_off, b.w_off, b.mirror = self.layout.views(b.flat)
        b.copied = None
        return b

    @property
    def pinned_buffers(self):
        return len(self._pinned)

    def host_buffer(self):
        """The pinned raw array the next batch is decoded into (waits until
        the copy that last read it has finished)."""
        buf = self._pinned[self._next_pinned]
        self._next_pinned = (self._next_pinned + 1) % len(self._pinned)
        if buf.copied is not None:
            buf.copied.synchronize()
            buf.copied = None
        self._current = buf
        return buf.raw

    def _slot(self):
        with self._lock:
            if self._free:
                return self._free.pop()
        slot = _DeviceSlot()
        slot.flat = self._cp.empty(self.layout.nbytes, dtype=numpy.uint8)
        slot.raw, slot.h_off, slot.w_off, slot.mirror = self.layout.views(slot.flat)
        slot.done = None
        with self._lock:
            self.slots.append(slot)
        return slot

    def _constant(self, array):
        """The device copy of a constant host array (mean image, mean
        values), uploaded once on the copy stream. Small arrays are known
        by their values (a plan's mean values are a fresh array each
        batch), large ones by identity (the transformer's one mean image)."""
        if array is None:
            return None
        array = numpy.asarray(array, dtype=numpy.float32)
        key = (array.shape, array.tobytes()) if array.size <= SMALL_CONSTANT \
            else ('id', id(array))
        known = self._constants.get(key)
        if known is None or (key[0] == 'id' and known[0] is not array):
            with self.stream:
                known = self._constants[key] = (array, self._cp.asarray(
                    numpy.ascontiguousarray(array)))
        return known[1]

    def send(self, raw, plan):
        """Start the copy of `raw` (the array host_buffer() gave) and of
        `plan`'s decisions to the device; returns the StagedBatch."""
        buf = self._current
        if buf is None or raw is not buf.raw:
            raise ValueError('send() takes the array host_buffer() gave last')
        check_plan(raw, plan)
        self._current = None
        self._use_device()
        buf.h_off[...] = plan.h_off
        buf.w_off[...] = plan.w_off
        buf.mirror[...] = plan.mirror
        slot = self._slot()
        if slot.done is not None:
            self.stream.wait_event(slot.done)   # the kernel that read the slot
            slot.done = None
        mean, mean_values = self._constant(plan.mean), self._constant(plan.mean_values)
        slot.flat.set(buf.flat, stream=self.stream)
        copied = self._cp.cuda.Event(block=False, disable_timing=True)
        copied.record(self.stream)
        buf.copied = copied
        device_plan = TransformPlan(plan.h_off, plan.w_off, plan.mirror, plan.crop_h,
                                    plan.crop_w, None, None, plan.scale)
        device_plan.h_off, device_plan.w_off, device_plan.mirror = \
            slot.h_off, slot.w_off, slot.mirror
        device_plan.mean, device_plan.mean_values = mean, mean_values
        return StagedBatch(slot, copied, device_plan,
                           device_plan.output_shape(self.layout.shape[1]))

    def transform(self, staged, out):
        """The float32 batch into device array `out`, on the current stream,
        once the batch's copy has finished; the slot is free again after."""
        stream = self._cp.cuda.get_current_stream()
        stream.wait_event(staged.copied)
        self._launch(staged.slot.raw, staged.plan, out, stream)
        done = self._cp.cuda.Event(block=False, disable_timing=True)
        done.record(stream)
        self._release(staged.slot, done)
        return out

    def to_host(self, staged):
        """The float32 batch on the host (the backend went back to the CPU
        after the layer was set up): the raw batch and plan come back and
        the host transform runs."""
        from caffeplus.io.batch_transform import apply_plan
        staged.copied.synchronize()
        raw = self._cp.asnumpy(staged.slot.raw)
        plan = TransformPlan(self._cp.asnumpy(staged.plan.h_off),
                             self._cp.asnumpy(staged.plan.w_off),
                             self._cp.asnumpy(staged.plan.mirror).astype(bool),
                             staged.plan.crop_h, staged.plan.crop_w,
                             _host(self._cp, staged.plan.mean),
                             _host(self._cp, staged.plan.mean_values), staged.plan.scale)
        self._release(staged.slot, None)
        return apply_plan(numpy, raw, plan)

    def _release(self, slot, done):
        slot.done = done
        with self._lock:
            self._free.append(slot)

    def reclaim(self):
        """Every slot free again: call it once the batches sent so far are
        consumed or dropped (the prefetch thread stopped)."""
        with self._lock:
            self._free = list(self.slots)

    def close(self):
        """Wait for the copies in flight, so that the pinned memory can go."""
        self.stream.synchronize()
        for buf in self._pinned:
            buf.copied = None


def _host(cuda_module, array):
    return None if array is None else cuda_module.asnumpy(array)
