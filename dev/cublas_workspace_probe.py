#!/usr/bin/env python3
"""Does cuBLAS's workspace size change caffeplus's GEMMs, and what does it hold?

    python dev/cublas_workspace_probe.py OUT.npz        # one process, this environment
    python dev/cublas_workspace_probe.py OUT.npz --own BYTES   # on a buffer of ours
    python dev/cublas_workspace_probe.py --compare A.npz B.npz

Runs the bench nets' InnerProduct shapes (AlexNet's and VGG-16's fc6-8 at
their batches, ResNet-50's fc1000, GoogLeNet's classifiers) forward and
backward through caffeplus's InnerProduct layer on the GPU from fixed
inputs, saves every output, and prints the device memory cuBLAS added
(before and after the first GEMM). Run it once per CUBLAS_WORKSPACE_CONFIG
and compare the files bit for bit. --own runs the GEMMs on caffeplus's own
handle (no pool) and a workspace buffer from CuPy's pool
(dev/cublas_own_workspace.py), as a memory plan runs InnerProduct on its
arena's bytes.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MiB = 2 ** 20
# (batch, inputs, outputs)
SHAPES = [(128, 9216, 4096), (128, 4096, 4096), (128, 4096, 1000), (64, 25088, 4096),
          (64, 2048, 1000), (64, 1024, 1000), (64, 2048, 1024), (256, 25088, 4096)]


def run(path, own=None):
    import contextlib
    import numpy
    import cupy
    from caffeplus import backend
    from caffeplus.backend import blas
    backend.set_mode_gpu(0)
    cupy.zeros(1)
    cupy.cuda.Device().synchronize()
    free0, total = cupy.cuda.runtime.memGetInfo()
    if os.environ.get('PROBE_SET_CONFIG') is not None:
        # set in the process once CUDA runs, before the cuBLAS handle exists
        os.environ['CUBLAS_WORKSPACE_CONFIG'] = os.environ['PROBE_SET_CONFIG']
    # --own: caffeplus's handle alone (no pool), as the memory plans run
    # InnerProduct; else CuPy's, with the pool CUBLAS_WORKSPACE_CONFIG gives.
    blas.own_handle() if own else blas._handle()
    cupy.cuda.Device().synchronize()
    free_h, _ = cupy.cuda.runtime.memGetInfo()
    print('the cuBLAS handle (%s) added %.1f MiB'
          % ('caffeplus\'s' if own else 'CuPy\'s', (free0 - free_h) / MiB))
    scope = contextlib.nullcontext()
    if own:
        buf = cupy.empty(own, dtype=numpy.uint8)
        from dev.cublas_own_workspace import own_workspace
        scope = own_workspace(buf.data.ptr, own)
    with scope:
        _gemms(path, own, free0)


def _gemms(path, own, free0):
    import numpy
    import cupy
    from caffeplus.blob import Blob
    from caffeplus.layer import create_layer
    from caffeplus.proto import caffe_pb2
    out = {}
    rng = numpy.random.RandomState(7)
    for n, k, m in SHAPES:
        p = caffe_pb2.LayerParameter(name='fc', type='InnerProduct')
        p.inner_product_param.num_output = m
        bottom, top = Blob((n, k)), Blob()
        bottom.data[...] = cupy.asarray(rng.standard_normal((n, k)).astype(numpy.float32))
        layer = create_layer(p)
        layer.setup([bottom], [top])
        layer.blobs[0].data[...] = cupy.asarray(
            rng.standard_normal(layer.blobs[0].shape).astype(numpy.float32) * 0.01)
        layer.forward([bottom], [top])
        top.diff[...] = cupy.asarray(rng.standard_normal(top.shape).astype(numpy.float32))
        for b in layer.blobs:
            b.diff[...] = 0
        layer.backward([top], [True], [bottom])
        key = '%dx%dx%d' % (n, k, m)
        out[key + '_y'] = cupy.asnumpy(top.data)
        out[key + '_dx'] = cupy.asnumpy(bottom.diff)
        out[key + '_dw'] = cupy.asnumpy(layer.blobs[0].diff)
        if len(out) == 3:
            cupy.cuda.Device().synchronize()
            free1, _ = cupy.cuda.runtime.memGetInfo()
            pool = cupy.get_default_memory_pool().total_bytes()
            print('CUBLAS_WORKSPACE_CONFIG=%s%s: the handle and the first GEMMs added %.1f MiB '
                  'outside CuPy\'s pool'
                  % (os.environ.get('CUBLAS_WORKSPACE_CONFIG', '(unset)'),
                     ', own workspace %d bytes' % own if own else '',
                     (free0 - free1 - pool) / MiB))
    # a strided-batched GEMM as a 1x1 convolution runs it (ResNet-50's
    # 256 -> 64 channels at 56x56, 64 images)
    from caffeplus.backend import blas
    P, M, K, B = 56 * 56, 64, 256, 64
    x = cupy.asarray(rng.standard_normal((B, K, P)).astype(numpy.float32))
    w = cupy.asarray(rng.standard_normal((M, K)).astype(numpy.float32) * 0.05)
    y = cupy.empty((B, M, P), dtype=numpy.float32)
    blas.gemm_strided_batched(blas.N, blas.N, P, M, K, x.data.ptr, P, K * P, w.data.ptr, K, 0,
                              y.data.ptr, P, M * P, B)
    out['batched_1x1_y'] = cupy.asnumpy(y)
    numpy.savez(path, **out)


def compare(a, b):
    import numpy
    x, y = numpy.load(a), numpy.load(b)
    same = 0
    for key in sorted(x.files):
        if numpy.array_equal(x[key], y[key]):
            same += 1
        else:
            d = numpy.abs(x[key] - y[key]).max()
            print('  differs: %s (max |diff| %.3g)' % (key, d))
    print('%s vs %s: %d of %d outputs bit-identical' % (os.path.basename(a), os.path.basename(b),
                                                        same, len(x.files)))


if __name__ == '__main__':
    if sys.argv[1] == '--compare':
        compare(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 3 and sys.argv[2] == '--own':
        run(sys.argv[1], int(sys.argv[3]))
    else:
        run(sys.argv[1])
