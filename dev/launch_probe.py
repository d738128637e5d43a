#!/usr/bin/env python3
"""Host cost of one kernel launch on the GPU machine: a CuPy RawKernel call, the
driver's cuLaunchKernel through ctypes (arguments built once, or each call), and
a CUDA graph of ten launches (per graph).

    python3 dev/launch_probe.py
"""
import ctypes
import time

SOURCE = r'''extern "C" __global__ void f(float* a, unsigned n, float s) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] *= s;
}'''
LAUNCHES = 5000


def _bench(fn, label):
    import cupy
    for _ in range(200):
        fn()
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(LAUNCHES):
        fn()
    t1 = time.perf_counter()
    cupy.cuda.Device().synchronize()
    print('%-40s %.2f us/launch (host)' % (label, (t1 - t) / LAUNCHES * 1e6))


def main():
    import cupy
    import numpy
    k = cupy.RawKernel(SOURCE, 'f')
    a = cupy.zeros(1024, cupy.float32)
    n, s = numpy.uint32(1024), numpy.float32(1.0)
    _bench(lambda: k((4,), (256,), (a, n, s)), 'cupy RawKernel')
    _bench(lambda: k((4,), (256,), (a, numpy.uint32(1024), numpy.float32(1.0))),
           'cupy RawKernel, new scalars')
    f = k.kernel.ptr
    launch = ctypes.CDLL('libcuda.so.1').cuLaunchKernel
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    stream = cupy.cuda.get_current_stream().ptr
    pa, pn, ps = ctypes.c_uint64(a.data.ptr), ctypes.c_uint32(1024), ctypes.c_float(1.0)
    args = (ctypes.c_void_p * 3)(ctypes.addressof(pa), ctypes.addressof(pn), ctypes.addressof(ps))
    _bench(lambda: launch(f, 4, 1, 1, 256, 1, 1, 0, stream, args, None),
           'ctypes cuLaunchKernel, args built once')

    def rebuilt():
        pa, pn, ps = ctypes.c_uint64(a.data.ptr), ctypes.c_uint32(1024), ctypes.c_float(1.0)
        args = (ctypes.c_void_p * 3)(ctypes.addressof(pa), ctypes.addressof(pn),
                                     ctypes.addressof(ps))
        launch(f, 4, 1, 1, 256, 1, 1, 0, stream, args, None)
    _bench(rebuilt, 'ctypes cuLaunchKernel, args built each call')
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        side.begin_capture()
        for _ in range(10):
            k((4,), (256,), (a, n, s))
        graph = side.end_capture()
    _bench(lambda: graph.launch(side), 'graph of 10 launches (per graph)')


if __name__ == '__main__':
    main()
