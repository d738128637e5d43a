#!/usr/bin/env python3
"""How much of a host-bound iteration is Python and launch cost: a bench
net's forward and backward run eagerly, then captured as CUDA graphs and
replayed (the loss layer eager between them, its value unread).

    python3 dev/graph_probe.py [--nets resnet50_b64,googlenet_b64] [--precision fp16]

Prints device wall time and host time per pass, eager and replayed. A
measurement of what whole-pass graphs would give, not a training path:
the replay is not checked against the eager values, and cuBLAS runs on
caffeplus's own handle over a 32 MiB workspace (CuPy refuses its cuBLAS
wrappers during a capture). Nets with Dropout do not capture (cuRAND).
"""
import argparse
import os
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _gemm_on_own_workspace():
    """Every caffeplus GEMM through ctypes on its own handle (capturable)."""
    import cupy
    from caffeplus.backend import blas
    buf = cupy.empty(blas.FALLBACK_BYTES, cupy.uint8)

    def wrap(real):
        def call(*a, **k):
            if k.get('workspace') is None:
                k['workspace'] = (buf.data.ptr, buf.nbytes)
            return real(*a, **k)
        return call
    blas.gemm, blas.gemm_strided_batched = wrap(blas.gemm), wrap(blas.gemm_strided_batched)


def _timed(fn, n=20):
    """(median device ms, median host ms) of fn() on the current stream."""
    import cupy
    s = cupy.cuda.get_current_stream()
    for _ in range(5):
        fn()
    cupy.cuda.Device().synchronize()
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    dev, host = [], []
    for _ in range(n):
        e0.record(s)
        h = time.perf_counter()
        fn()
        host.append(time.perf_counter() - h)
        e1.record(s)
        e1.synchronize()
        dev.append(cupy.cuda.get_elapsed_time(e0, e1))
    return statistics.median(dev), statistics.median(host) * 1e3


def probe(name, bench_dir, precision, label):
    import cupy
    from caffeplus.cudnn import api
    from dev.gpu_host_probe import _build
    net, _ = _build(name, bench_dir, True, plan='shared', search='timed',
                    precision=precision, layout='nhwc')
    start, last = 1, len(net.layers) - 1
    loss_layer = net.layers[last]

    def forward():
        net.clear_param_diffs()
        net.forward_from_to(start, last - 1)

    def loss():
        # (its value unread: reading it would wait for the pass)
        loss_layer._forward(net.bottom_vecs[last], net.top_vecs[last])
        net.backward_from_to(last, last)

    def backward():
        net.backward_from_to(last - 1, start)

    def eager():
        forward()
        loss()
        backward()
    print('%s %s eager forward and backward: %.2f ms on the device, %.2f ms host'
          % ((name, label) + _timed(eager)))
    api.set_graphs(False)       # cuDNN's per-call graphs: captured into the pass's
    stream = cupy.cuda.Stream(non_blocking=True)
    try:
        graphs = []
        with stream:
            eager()
            stream.synchronize()
            for part in (forward, backward):
                if part is backward:
                    loss()
                stream.begin_capture()
                try:
                    part()
                finally:
                    graphs.append(stream.end_capture())
            fwd, bwd = graphs

            def replay():
                fwd.launch(stream)
                loss()
                bwd.launch(stream)
            print('%s %s replayed as two graphs: %.2f ms on the device, %.2f ms host'
                  % ((name, label) + _timed(replay)))
    except Exception as exc:    # noqa: BLE001 -- a probe reports what does not capture
        print('%s %s: capture failed: %r' % (name, label, exc))
        traceback.print_exc(limit=8)
    finally:
        api.set_graphs(True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--nets', default='resnet50_b64')
    ap.add_argument('--bench-dir', default=os.path.join(ROOT, '.gpu_carry', 'bench'))
    ap.add_argument('--precision', default='fp16', choices=('fp16', 'bf16', 'fp32'))
    args = ap.parse_args(argv)
    import logging
    logging.disable(logging.INFO)
    _gemm_on_own_workspace()
    precision = None if args.precision == 'fp32' else args.precision
    for name in args.nets.split(','):
        probe(name, args.bench_dir, precision, args.precision)


if __name__ == '__main__':
    main()
