#!/usr/bin/env python3
"""Where the host time of a caffeplus GPU training step goes (issue #6).

    python dev/gpu_host_probe.py --bench-dir .gpu_carry/bench \\
        [--sections env,raw,cprofile] [--nets googlenet_b64,alexnet_b128] [--tf32 both]

Sections:
  env       CuPy, CUDA, cuDNN versions; CuPy's float32 matmul compute type in
            each math mode (does TF32 reach cuBLAS?).
  raw       host and device microseconds of one cuDNN convolution call, three
            ways: caffeplus.cudnn.api's wrapper, the ctypes function with its
            arguments built once, and an empty ctypes call; the math type
            cuDNN's FindEx reports for each algorithm under TENSOR_OP_MATH;
            a CuPy RawKernel launch and an elementwise op for scale.
  cprofile  cProfile of training steps (the benchmark's step: clear diffs,
            forward, backward, fused SGD) on each net, top functions by own
            time, plus host ms/step without the profiler and device ms/step.
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DATA_TYPES = ('DummyData', 'Input', 'Data', 'ImageData', 'HDF5Data', 'MemoryData')


def section_env():
    import cupy
    import numpy
    from caffeplus.cudnn import lib
    from caffeplus.backend import mathmode
    print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'CUDA runtime',
          cupy.cuda.runtime.runtimeGetVersion(), 'cudnn', lib.version())
    import caffeplus
    caffeplus.set_mode_gpu(0)
    from cupy._core import _routines_linalg as rl
    for mode in ('strict', 'tf32', 'strict'):
        mathmode.set_math_mode(mode)
        print('math %-6s CUPY_TF32=%s cupy float32 compute type %s' % (
            mode, os.environ.get('CUPY_TF32'), rl.get_compute_type(numpy.float32)))
    # matmul timing in each mode: TF32 should be several times faster
    a = cupy.random.standard_normal((4096, 4096), dtype=numpy.float32)
    b = cupy.random.standard_normal((4096, 4096), dtype=numpy.float32)
    out = cupy.empty((4096, 4096), dtype=numpy.float32)
    for mode in ('strict', 'tf32'):
        mathmode.set_math_mode(mode)
        print('  matmul 4096^3 %-6s %.3f ms' % (mode, _dev_ms(lambda: cupy.matmul(a, b, out=out))))
        from cupy import cublas
        print('  cublas.gemm   %-6s %.3f ms' % (
            mode, _dev_ms(lambda: cublas.gemm('T', 'N', a, b, out=out, alpha=1.0, beta=1.0))))
    mathmode.set_math_mode('strict')


def _dev_ms(fn, n=20):
    import cupy
    for _ in range(3):
        fn()
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    e1.synchronize()
    return cupy.cuda.get_elapsed_time(e0, e1) / n


def _host_dev_us(fn, n=200):
    """(host us per call, device us per call) for n calls in a row."""
    import cupy
    for _ in range(5):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    e0.record()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    e1.record()
    e1.synchronize()
    return host, cupy.cuda.get_elapsed_time(e0, e1) / n * 1e3


def section_raw():
    import ctypes
    import cupy
    import numpy
    import caffeplus
    from caffeplus.cudnn import api, lib
    caffeplus.set_mode_gpu(0)
    L = lib.library()
    print('empty ctypes call (cudnnGetVersion): host %.2f us' % _host_dev_us(L.cudnnGetVersion)[0])
    k = cupy.RawKernel(r'extern "C" __global__ void nop(float* x, unsigned n) '
                       r'{ if (threadIdx.x == 0 && n == 12345) x[0] = 1; }', 'nop')
    x = cupy.zeros(16, dtype=numpy.float32)
    print('CuPy RawKernel launch: host %.2f us, device %.2f us' % _host_dev_us(
        lambda: k((1,), (32,), (x, numpy.uint32(1)))))
    big = cupy.zeros((64, 256, 28, 28), dtype=numpy.float32)
    print('CuPy in-place add (12.8 MB): host %.2f us, device %.2f us' % _host_dev_us(
        lambda: big.__iadd__(1.0)))
    print('cupy.cuda.runtime.getDevice: host %.2f us' % _host_dev_us(cupy.cuda.runtime.getDevice)[0])
    print('cupy.cuda.get_current_stream().ptr: host %.2f us' % _host_dev_us(
        lambda: cupy.cuda.get_current_stream().ptr)[0])
    print('api.handle(): host %.2f us' % _host_dev_us(api.handle)[0])
    # (n, cin, h, w, cout, k, pad, stride, group)
    geoms = [(64, 192, 28, 28, 64, 1, 0, 1, 1), (64, 96, 28, 28, 128, 3, 1, 1, 1),
             (64, 480, 14, 14, 192, 1, 0, 1, 1), (64, 832, 7, 7, 384, 3, 1, 1, 1),
             (128, 96, 27, 27, 256, 5, 2, 1, 2), (128, 384, 13, 13, 384, 3, 1, 1, 2)]
    for math in (api.FMA_MATH, api.TENSOR_OP_MATH):
        print('-- math type %d' % math)
        for (n, c, h, w, m, kk, p, s, g) in geoms:
            oh = (h + 2 * p - kk) // s + 1
            ow = (w + 2 * p - kk) // s + 1
            xd = api.TensorDesc((n, c, h, w))
            yd = api.TensorDesc((n, m, oh, ow))
            wd = api.FilterDesc((m, c // g, kk, kk))
            cd = api.ConvDesc((p, p), (s, s), (1, 1), g, math)
            xa = cupy.random.standard_normal((n, c, h, w), dtype=numpy.float32)
            ya = cupy.random.standard_normal((n, m, oh, ow), dtype=numpy.float32)
            wa = cupy.random.standard_normal((m, c // g, kk, kk), dtype=numpy.float32)
            ws = cupy.empty(512 << 20, dtype=numpy.uint8)
            line = ['geom n%d c%d %dx%d m%d k%d g%d' % (n, c, h, w, m, kk, g)]
            for kind in ('fwd', 'bwd_data', 'bwd_filter'):
                found = api.timed_algorithms(kind, xd, wd, cd, yd, xa, wa, ya, ws, ws.nbytes)
                best = found[0]
                desc = ' '.join('%s/m%d/%.3f' % (f.name, f.math, f.time) for f in found[:4])
                if kind == 'fwd':
                    wrap = lambda: api.conv_forward(xd, xa, wd, wa, cd, best.algo, ws, ws.nbytes,
                                                    yd, ya)
                    fn = L.cudnnConvolutionForward
                    args = (api.handle().value, api.ONE, xd.value, ctypes.c_void_p(xa.data.ptr),
                            wd.value, ctypes.c_void_p(wa.data.ptr), cd.value, best.algo,
                            ctypes.c_void_p(ws.data.ptr), ctypes.c_size_t(ws.nbytes), api.ZERO,
                            yd.value, ctypes.c_void_p(ya.data.ptr))
                elif kind == 'bwd_data':
                    wrap = lambda: api.conv_backward_data(wd, wa, yd, ya, cd, best.algo, ws,
                                                          ws.nbytes, xd, xa)
                    fn = L.cudnnConvolutionBackwardData
                    args = (api.handle().value, api.ONE, wd.value, ctypes.c_void_p(wa.data.ptr),
                            yd.value, ctypes.c_void_p(ya.data.ptr), cd.value, best.algo,
                            ctypes.c_void_p(ws.data.ptr), ctypes.c_size_t(ws.nbytes), api.ZERO,
                            xd.value, ctypes.c_void_p(xa.data.ptr))
                else:
                    wrap = lambda: api.conv_backward_filter(xd, xa, yd, ya, cd, best.algo, ws,
                                                            ws.nbytes, wd, wa, beta=0.0)
                    fn = L.cudnnConvolutionBackwardFilter
                    args = (api.handle().value, api.ONE, xd.value, ctypes.c_void_p(xa.data.ptr),
                            yd.value, ctypes.c_void_p(ya.data.ptr), cd.value, best.algo,
                            ctypes.c_void_p(ws.data.ptr), ctypes.c_size_t(ws.nbytes), api.ZERO,
                            wd.value, ctypes.c_void_p(wa.data.ptr))
                hw, dw = _host_dev_us(wrap, 100)
                hr, dr = _host_dev_us(lambda: fn(*args), 100)
                line.append('\n   %-10s wrapper host %6.1f us dev %7.1f | raw host %6.1f dev %7.1f'
                            ' | FindEx: %s' % (kind, hw, dw, hr, dr, desc))
            print(' '.join(line), flush=True)
            xa = ya = wa = ws = None        # (freed before the next geometry allocates)


def _build(net_name, bench_dir, tf32, plan='arena', search='timed', precision=None,
           layout='nhwc'):
    """caffeplus's bench step on bench net `net_name` ('ARCH_bN'); `precision`
    the switch's type (fp16, bf16), `layout` the 16-bit maps' order (nchw,
    nhwc, or nhwcbn: BatchNorm's channels-last too)."""
    import caffeplus
    from caffeplus import config, kernels
    from caffeplus import layout as layout_module
    from caffeplus import precision as precision_module
    from benchmarks.bench_gpu import net_source
    from caffeplus.backend import mathmode
    from caffeplus.blob import Blob
    from caffeplus.memory import workspace
    from caffeplus.solver import gpu_kernels
    caffeplus.set_mode_gpu(0)
    mathmode.set_math_mode('tf32' if tf32 else 'strict')
    kernels.set_enabled(True)
    workspace.set_search(search)
    if layout == 'nhwcbn':      # (the default since; kept for the records' names)
        layout_module.CHANNELS_LAST_BATCHNORM = True
    with precision_module.setting(precision), \
            config.using(layout='nhwc' if layout == 'nhwcbn' else layout):
        net = caffeplus.Net(net_source(bench_dir, net_name), caffeplus.TRAIN)
    workspace.apply_workspace_plan(net, plan, 0)
    params = net.learnable_params
    hist = [Blob(p.shape) for p in params]
    for h in hist:
        h.data[...] = 0
    multi = gpu_kernels.MultiTensorUpdate()
    ones, zeros = [1.0] * len(params), [0.0] * len(params)
    start = 0
    while start < len(net.layers) and net.layers[start].layer_param.type in DATA_TYPES:
        start += 1
    last = len(net.layers) - 1
    net.forward_prefilled()

    def step():
        net.clear_param_diffs()
        loss = net.forward_from_to(start, last, defer_loss=True)     # read as the solver does
        net.backward_from_to(last, start)
        float(loss)
        multi.prepare(params, hist, None, ones, zeros)
        multi.run('SGD', 0.01, 1.0, 0.0, False, 0.9)
    return net, step


def section_cprofile(nets, bench_dir, tf32s, steps, top, precision=None, layouts=('nhwc',)):
    import cupy
    for tf32, layout in ((t, lay) for t in tf32s for lay in layouts):
        for name in nets:
            net, step = _build(name, bench_dir, tf32, precision=precision, layout=layout)
            for _ in range(3):
                step()
            sync = cupy.cuda.get_current_stream().synchronize
            sync()
            hosts, devs = [], []
            for _ in range(steps):
                e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                e0.record()
                t0 = time.perf_counter()
                step()
                hosts.append((time.perf_counter() - t0) * 1e3)
                e1.record()
                e1.synchronize()
                devs.append(cupy.cuda.get_elapsed_time(e0, e1))
            print('== %s tf32=%d %s %s: host %.2f ms/step (launch only), event-to-event %.2f ms'
                  % (name, tf32, precision or 'fp32', layout, statistics.median(hosts),
                     statistics.median(devs)), flush=True)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(steps):
                step()
            sync()
            prof.disable()
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s)
            st.sort_stats('tottime').print_stats(top)
            txt = s.getvalue()
            # keep it short: drop the header lines pstats prints
            print('\n'.join(l for l in txt.splitlines() if l.strip())[:9000], flush=True)
            del net, step


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument('--bench-dir', default=os.path.join(ROOT, '.gpu_carry', 'bench'))
    ap.add_argument('--sections', default='env,raw,cprofile')
    ap.add_argument('--nets', default='googlenet_b64,alexnet_b128')
    ap.add_argument('--tf32', default='both', choices=('off', 'on', 'both'))
    ap.add_argument('--steps', type=int, default=5)
    ap.add_argument('--top', type=int, default=30)
    ap.add_argument('--precision', default=None, choices=('fp16', 'bf16'))
    ap.add_argument('--layouts', default='nhwc', help='nchw, nhwc, nhwcbn (comma-separated)')
    args = ap.parse_args(argv)
    secs = args.sections.split(',')
    tf32s = {'off': [0], 'on': [1], 'both': [0, 1]}[args.tf32]
    for name, fn in (('env', section_env), ('raw', section_raw)):
        if name in secs:
            print('#### %s' % name, flush=True)
            try:
                fn()
            except Exception as exc:   # keep the other sections
                import traceback
                traceback.print_exc()
                print('section %s failed: %r' % (name, exc))
    if 'cprofile' in secs:
        print('#### cprofile', flush=True)
        section_cprofile(args.nets.split(','), args.bench_dir, tf32s, args.steps, args.top,
                         args.precision, args.layouts.split(','))
    return 0


if __name__ == '__main__':
    sys.exit(main())
