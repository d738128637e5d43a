#!/usr/bin/env python3
"""Which step of a training iteration needs how much CUDA per-thread stack.

    python dev/stack_probe.py .gpu_carry/bench/alexnet_b128.prototxt [--plan offload --offload free]

The driver raises cudaLimitStackSize by itself for a kernel that needs more
and keeps it raised (caffeplus.memory.thread_stack). This builds the net as
`caffeplus memory -gpu` does, with the limit at 0, and prints the limit after
the first iterations (the timed algorithm search runs every candidate); then
sets it to 0 again and runs one iteration step by step, printing each step
that raised it: what the chosen kernels alone need.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('model')
    ap.add_argument('--plan', default='shared')
    ap.add_argument('--offload', default='free')
    args = ap.parse_args(argv)
    from caffeplus.memory import thread_stack
    thread_stack.LIMIT_FOR_PLACING_PLANS = 0
    os.environ.setdefault('CAFFEPLUS_CUDNN_SEARCH', 'auto')
    import cupy
    from caffeplus import backend
    from caffeplus.memory import measure, thread_stack
    backend.set_mode_gpu(0)
    net, solver = measure.settled_net(args.model, args.plan, args.offload)
    cupy.cuda.Device().synchronize()
    print('%s, plan %s: stack limit after the first iterations (the search among them) %d bytes'
          % (os.path.basename(args.model), args.plan, thread_stack.current_bytes()))
    names = net._layer_names
    L = len(names)
    cupy.cuda.runtime.deviceSetLimit(0, 0)
    seen = {'limit': thread_stack.current_bytes()}

    def after_step(t):
        cupy.cuda.Device().synchronize()
        now = thread_stack.current_bytes()
        if now != seen['limit']:
            label = ('forward ' + names[t]) if t < L else ('backward ' + names[2 * L - 1 - t])
            print('  step %d (%s): %d -> %d bytes' % (t, label, seen['limit'], now))
            seen['limit'] = now

    measure.run_iteration(net, solver, after_step)
    cupy.cuda.Device().synchronize()
    print('  after one iteration from 0: %d bytes' % thread_stack.current_bytes())
    return 0


if __name__ == '__main__':
    sys.exit(main())
