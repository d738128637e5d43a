"""The GPU batch transform (caffeplus.io.device_transform) against the host's.

Its kernel runs here through the host emulator of CUDA kernels, and on a GPU
through CuPy; both must give batch_transform.apply_plan's bits exactly."""
import numpy
import pytest

from caffeplus.io import batch_transform, device_transform
from conftest import build_emulator


def _plan(rng, n, c, h, w, crop, mean_kind, scale, mirror=None):
    crop_h = crop_w = crop or h
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
