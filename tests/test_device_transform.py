"""The GPU batch transform (caffeplus.io.device_transform) against the host's.

Its kernel runs here through the host emulator of CUDA kernels, and on a GPU
through CuPy; both must give batch_transform.apply_plan's bits exactly."""
import numpy
import pytest

from caffeplus.io import batch_transform, device_transform
from conftest import build_emulator


def _plan(rng, n, c, h, w, crop, mean_kind, scale, mirror=None):
    crop_h, crop_w = crop or h, crop or w
    plan = batch_transform.TransformPlan(
        rng.integers(0, h - crop_h + 1, n), rng.integers(0, w - crop_w + 1, n),
        rng.random(n) < 0.5 if mirror is None else numpy.full(n, mirror), crop_h, crop_w,
        mean=(rng.random((c, h, w)) * 255).astype(numpy.float32) if mean_kind == 'image' else None,
        mean_values=numpy.array([104, 117, 123][:c], numpy.float32) if mean_kind == 'values'
        else None, scale=scale)
    return plan


CASES = [(dtype, crop, mean_kind, scale, mirror)
         for dtype in ('uint8', 'float32')
         for crop, mean_kind, scale, mirror in [(5, 'values', 1.0, None), (5, 'image', 0.017, None),
                                                (None, None, 1.0, True), (3, None, 0.5, False),
                                                (7, 'image', 1.0, True)]]


def _raw(rng, dtype, shape):
    if dtype == 'uint8':
        return rng.integers(0, 256, shape).astype(numpy.uint8)
    return (rng.standard_normal(shape) * 50).astype(numpy.float32)


@pytest.fixture(scope='module')
def emulated_kernels():
    return {dtype: build_emulator(device_transform.kernel_source(dtype)).kernel('transform_batch')
            for dtype in ('uint8', 'float32')}


@pytest.mark.parametrize('dtype,crop,mean_kind,scale,mirror', CASES)
def test_emulated_kernel_matches_the_host_transform(emulated_kernels, dtype, crop, mean_kind,
                                                    scale, mirror):
    rng = numpy.random.default_rng(7)
    n, c, h, w = 4, 3, 9, 11
    raw = _raw(rng, dtype, (n, c, h, w))
    plan = _plan(rng, n, c, h, w, crop, mean_kind, scale, mirror)
    want = batch_transform.apply_plan(numpy, raw, plan)
    got = numpy.full(want.shape, numpy.nan, numpy.float32)
    device_transform.launch(emulated_kernels[dtype], numpy, raw, plan, got)
    assert got.tobytes() == want.tobytes()


def test_emulated_kernel_against_a_float64_formula(emulated_kernels):
    """Independent of apply_plan: the formula, one value at a time."""
    rng = numpy.random.default_rng(3)
    n, c, h, w = 3, 2, 6, 5
    raw = _raw(rng, 'uint8', (n, c, h, w))
    plan = _plan(rng, n, c, h, w, 4, 'image', 0.25)
    got = numpy.zeros((n, c, 4, 4), numpy.float32)
    device_transform.launch(emulated_kernels['uint8'], numpy, raw, plan, got)
    for b in range(n):
        for k in range(c):
            for i in range(4):
                for j in range(4):
                    y = plan.h_off[b] + i
                    x = plan.w_off[b] + (3 - j if plan.mirror[b] else j)
                    want = (float(raw[b, k, y, x]) - float(plan.mean[k, y, x])) * 0.25
                    assert got[b, k, i, j] == pytest.approx(want, rel=1e-6, abs=1e-5)


def _sixteen_bit_types():
    try:
        import ml_dtypes
    except ImportError:
        return [numpy.float16]
    return [numpy.float16, ml_dtypes.bfloat16]


@pytest.mark.parametrize('out_type', _sixteen_bit_types())
@pytest.mark.parametrize('dtype', ['uint8', 'float32'])
def test_emulated_16_bit_output_is_the_float32_value_rounded_once(dtype, out_type):
    """A FLOAT16 or BFLOAT16 net's data top: the kernel's 16-bit build (the
    emulator's stand-ins for __half and __nv_bfloat16) stores the float32
    result rounded to nearest."""
    kernel = build_emulator(device_transform.kernel_source(
        dtype, out_type, cuda_headers=False)).kernel('transform_batch')
    rng = numpy.random.default_rng(5)
    n, c, h, w = 3, 3, 9, 11
    raw = _raw(rng, dtype, (n, c, h, w))
    plan = _plan(rng, n, c, h, w, 7, 'values', 0.0125, True)
    want = batch_transform.apply_plan(numpy, raw, plan).astype(out_type)
    got = numpy.full(want.shape, numpy.nan, out_type)
    device_transform.launch(kernel, numpy, raw, plan, got)
    assert got.tobytes() == want.tobytes()


def test_launch_refuses_what_does_not_fit():
    rng = numpy.random.default_rng(0)
    raw = _raw(rng, 'uint8', (2, 3, 8, 8))
    plan = _plan(rng, 2, 3, 8, 8, 5, None, 1.0)
    with pytest.raises(ValueError, match='float32'):
        device_transform.launch(None, numpy, raw, plan, numpy.zeros((2, 3, 4, 4), numpy.float32))
    with pytest.raises(ValueError, match='uint8 or float32'):
        device_transform.kernel_source(numpy.int16)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype,crop,mean_kind,scale,mirror', CASES)
def test_gpu_kernel_matches_the_host_transform(dtype, crop, mean_kind, scale, mirror):
    import cupy
    rng = numpy.random.default_rng(11)
    n, c, h, w = 16, 3, 40, 36
    raw = _raw(rng, dtype, (n, c, h, w))
    plan = _plan(rng, n, c, h, w, crop and crop * 4, mean_kind, scale, mirror)
    want = batch_transform.apply_plan(numpy, raw, plan)
    out = cupy.full(want.shape, cupy.nan, dtype=cupy.float32)
    device_transform.apply_plan_device(cupy.asarray(raw), plan, out)
    assert cupy.asnumpy(out).tobytes() == want.tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize('out_type', _sixteen_bit_types())
def test_gpu_kernel_writes_16_bit_tops(out_type):
    import cupy
    rng = numpy.random.default_rng(12)
    n, c, h, w = 8, 3, 20, 18
    raw = _raw(rng, 'uint8', (n, c, h, w))
    plan = _plan(rng, n, c, h, w, 16, 'image', 0.00390625, True)
    want = batch_transform.apply_plan(numpy, raw, plan).astype(out_type)
    out = cupy.full(want.shape, cupy.nan, dtype=out_type)
    device_transform.apply_plan_device(cupy.asarray(raw), plan, out)
    assert cupy.asnumpy(out).tobytes() == want.tobytes()


@pytest.mark.gpu
def test_gpu_feeder_overlaps_copies_and_keeps_batches_apart():
    """Batches sent back to back through the two pinned slots come out as
    the host transforms them, each into its own output."""
    import cupy
    rng = numpy.random.default_rng(5)
    feeder = device_transform.DeviceFeeder()
    outs, wants = [], []
    for k in range(5):
        raw = _raw(rng, 'uint8', (8, 3, 32, 32))
        plan = _plan(rng, 8, 3, 32, 32, 24, 'values', 1.0)
        ticket = feeder.send(raw)
        out = cupy.empty((8, 3, 24, 24), cupy.float32)
        feeder.transform(ticket, plan, out)
        outs.append(out)
        wants.append(batch_transform.apply_plan(numpy, raw, plan))
    cupy.cuda.get_current_stream().synchronize()
    for out, want in zip(outs, wants):
        assert cupy.asnumpy(out).tobytes() == want.tobytes()


# -- DeviceStager's ordering, with streams that run late --------------------------
class _FakeStream:
    """A stream whose work runs when something waits for it (lazy) or at
    once (eager): a copy or a kernel then reads its inputs when it runs,
    as on a device, so a buffer reused too early gives wrong batches."""

    def __init__(self, eager=False):
        self.ops = []
        self.eager = eager

    def enqueue(self, op):
        self.ops.append(op)
        if self.eager:
            self.synchronize()

    def run_one(self):
        self.ops.pop(0)()

    def synchronize(self):
        while self.ops:
            self.run_one()

    def wait_event(self, event):
        self.enqueue(event.synchronize)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _FakeEvent:
    def __init__(self, block=False, disable_timing=True):
        self.stream, self.done = None, True

    def record(self, stream):
        self.stream, self.done = stream, False
        stream.enqueue(self._mark)

    def _mark(self):
        self.done = True

    def synchronize(self):
        while not self.done:
            self.stream.run_one()


class _FakeDeviceArray(numpy.ndarray):
    def set(self, host, stream):
        stream.enqueue(lambda: numpy.copyto(self, host))


class _FakeCupy:
    """What DeviceStager asks of CuPy, over NumPy, with a copy stream and a
    compute stream that run late (or the copy stream at once)."""

    def __init__(self, eager_copies):
        self.compute = _FakeStream()
        self.copies = _FakeStream(eager_copies)
        self.pinned_allocations = 0
        fake = self

        class cuda:
            Event = _FakeEvent

            @staticmethod
            def Stream(non_blocking=True):
                return fake.copies

            @staticmethod
            def Device(device):
                return type('D', (), {'use': lambda self: None})()

            @staticmethod
            def get_current_stream():
                return fake.compute

            @staticmethod
            def alloc_pinned_memory(nbytes):
                fake.pinned_allocations += 1
                return bytearray(nbytes)
        self.cuda = cuda

    @staticmethod
    def empty(n, dtype):
        return numpy.zeros(n, dtype).view(_FakeDeviceArray)

    @staticmethod
    def asarray(a):
        return numpy.array(a).view(_FakeDeviceArray)

    @staticmethod
    def asnumpy(a):
        return numpy.array(a).view(numpy.ndarray)


def _late_kernel(raw, plan, out, stream):
    stream.enqueue(lambda: batch_transform.apply_plan(numpy, raw, plan, out))


def _stage_batches(stager, fake, rng, count, ahead, shape=(4, 3, 10, 12)):
    """`count` batches through the stager with `ahead` sent before the
    first is transformed (a prefetch queue); returns (outputs, expected)."""
    n, c, h, w = shape
    mean_values = numpy.array([104, 117, 123], numpy.float32)
    pending, outs, wants = [], [], []
    for k in range(count + ahead):
        if k < count:
            raw = stager.host_buffer()
            raw[...] = _raw(rng, 'uint8', shape)
            plan = _plan(rng, n, c, h, w, 7, 'values', 0.5)
            plan.mean_values = mean_values.copy()      # as transformer.plan gives
            wants.append(batch_transform.apply_plan(numpy, raw.copy(), plan))
            pending.append(stager.send(raw, plan))
        if len(pending) > ahead or (k >= count and pending):
            out = numpy.full(wants[len(outs)].shape, numpy.nan, numpy.float32)
            stager.transform(pending.pop(0), out)
            outs.append(out)
    fake.compute.synchronize()
    fake.copies.synchronize()
    return outs, wants


@pytest.mark.parametrize('eager_copies', [False, True])
@pytest.mark.parametrize('ahead', [0, 1, 3])
def test_stager_waits_for_copies_and_kernels_before_reusing_buffers(eager_copies, ahead):
    """Lazy copies: the workers would overwrite a pinned buffer whose copy
    has not run yet. Eager copies with lazy kernels: a copy would overwrite
    a device slot whose kernel has not run yet. Both must give every batch
    exactly, with slots bounded by the batches in flight."""
    fake = _FakeCupy(eager_copies)
    stager = device_transform.DeviceStager(0, (4, 3, 10, 12), cuda_module=fake,
                                           launch_kernel=_late_kernel)
    outs, wants = _stage_batches(stager, fake, numpy.random.default_rng(ahead), 9, ahead)
    for k, (out, want) in enumerate(zip(outs, wants)):
        assert out.tobytes() == want.tobytes(), 'batch %d' % k
    assert len(stager.slots) <= ahead + 1
    assert fake.pinned_allocations == stager.pinned_buffers == 2
    # Each plan brings its own mean-values array: one device copy for all.
    assert len(stager._constants) == 1


@pytest.mark.parametrize('eager_copies,breakage', [(False, 'pinned'), (True, 'slot')])
def test_the_ordering_test_catches_a_stager_that_does_not_wait(monkeypatch, eager_copies,
                                                                breakage):
    """Without either wait the fake streams give wrong batches: the test
    above can fail."""
    fake = _FakeCupy(eager_copies)
    stager = device_transform.DeviceStager(0, (4, 3, 10, 12), cuda_module=fake,
                                           launch_kernel=_late_kernel)
    if breakage == 'pinned':
        def host_buffer_without_waiting(self):
            buf = self._pinned[self._next_pinned]
            self._next_pinned = (self._next_pinned + 1) % len(self._pinned)
            self._current = buf
            return buf.raw
        monkeypatch.setattr(device_transform.DeviceStager, 'host_buffer',
                            host_buffer_without_waiting)
    else:
        monkeypatch.setattr(fake.copies, 'wait_event', lambda event: None)
    outs, wants = _stage_batches(stager, fake, numpy.random.default_rng(0), 6, 2)
    assert any(o.tobytes() != w.tobytes() for o, w in zip(outs, wants))


def test_stager_reclaims_the_slots_of_dropped_batches():
    fake = _FakeCupy(False)
    stager = device_transform.DeviceStager(0, (2, 3, 10, 12), cuda_module=fake,
                                           launch_kernel=_late_kernel)
    rng = numpy.random.default_rng(1)
    for _ in range(3):       # sent ahead, then dropped (a restore)
        raw = stager.host_buffer()
        stager.send(raw, _plan(rng, 2, 3, 10, 12, 7, None, 1.0))
    assert len(stager.slots) == 3
    stager.reclaim()
    outs, wants = _stage_batches(stager, fake, rng, 6, 2, shape=(2, 3, 10, 12))
    assert all(o.tobytes() == w.tobytes() for o, w in zip(outs, wants))
    assert len(stager.slots) == 3
    with pytest.raises(ValueError, match='host_buffer'):
        stager.send(numpy.zeros((2, 3, 10, 12), numpy.uint8),
                    _plan(rng, 2, 3, 10, 12, 7, None, 1.0))
