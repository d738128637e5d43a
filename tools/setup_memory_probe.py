#!/usr/bin/env python3
"""Where a `caffeplus time` run's whole-process peak falls, phase by phase.

    python tools/setup_memory_probe.py .gpu_carry/bench/alexnet_b128.prototxt --plan shared

Does what `caffeplus time -model NET -gpu 0 --memory PLAN` does (the same
algorithm search, the untimed forward and backward, then --iterations timed
passes) in this process, while a thread reads the device's used memory
(total - free, the whole process as nvidia-smi counts it) and CuPy's pool
every millisecond. Each layer's forward and backward in the untimed pass is
a phase of its own, so the search's scratch shows under the layer whose
first call searched. Prints, per phase, the peak used and the pool's total
and in-use bytes at that moment, then the phase that holds the run's peak.
--json FILE writes the same.
"""
import argparse
import json
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MiB = 2 ** 20


class Sampler(threading.Thread):
    """Used device memory and the pool's bytes, tagged with the phase."""

    def __init__(self, cupy, interval=0.001):
        super().__init__(daemon=True)
        self.cupy, self.interval = cupy, interval
        self.phase = 'start'
        self.peaks = {}             # phase -> (used, pool total, pool used)
        self.order = []
        self._halt = threading.Event()

    def mark(self, phase):
        self.take()                 # what the last phase ended with
        self.phase = phase
        self.take()

    def take(self):
        free, total = self.cupy.cuda.runtime.memGetInfo()
        pool = self.cupy.get_default_memory_pool()
        row = (total - free, pool.total_bytes(), pool.used_bytes())
        best = self.peaks.get(self.phase)
        if best is None or row[0] > best[0]:
            if self.phase not in self.peaks:
                self.order.append(self.phase)
            self.peaks[self.phase] = row

    def run(self):
        while not self._halt.is_set():
            self.take()
            time.sleep(self.interval)

    def stop(self):
        self._halt.set()
        self.join(timeout=2)
        self.take()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('model')
    ap.add_argument('--plan', default='shared')
    ap.add_argument('--gpu', type=int, default=0)
    ap.add_argument('--iterations', type=int, default=3)
    ap.add_argument('--json', default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault('NVIDIA_TF32_OVERRIDE', '0')
    import cupy
    from caffeplus import backend
    from caffeplus.proto import caffe_pb2
    from caffeplus.commands import time as time_command
    from caffeplus.net import Net
    if args.plan in time_command.TRAINING_SEARCH_PLANS:
        os.environ.setdefault('CAFFEPLUS_CUDNN_SEARCH', 'auto')
    backend.set_mode_gpu(args.gpu)
    sampler = Sampler(cupy)
    sampler.mark('context')
    sampler.start()
    sampler.mark('build the net and apply the plan')
    net = Net(args.model, caffe_pb2.TRAIN, memory=args.plan)
    names = [l.layer_param.name for l in net.layers]
    first = {'on': True}

    def before_forward(i):
        if first['on']:
            sampler.mark('first forward: %s' % names[i])

    def before_backward(i):
        if first['on']:
            sampler.mark('first backward: %s' % names[i])
    net.before_layer_forward.append(before_forward)
    net.before_layer_backward.append(before_backward)
    net.forward_prefilled()
    net.backward_all()
    cupy.cuda.Device().synchronize()
    first['on'] = False
    sampler.mark('timed iterations')
    for _ in range(args.iterations):
        net.forward_prefilled()
        net.backward_all()
    cupy.cuda.Device().synchronize()
    sampler.stop()
    rows = [(p,) + tuple(v / MiB for v in sampler.peaks[p]) for p in sampler.order
            if p in sampler.peaks]
    print('%-44s %10s %10s %10s' % ('phase', 'used MiB', 'pool', 'pool used'))
    for p, used, total, inuse in rows:
        print('%-44s %10.0f %10.0f %10.0f' % (p[:44], used, total, inuse))
    top = max(rows, key=lambda r: r[1])
    timed = [r for r in rows if r[0] == 'timed iterations']
    print('peak %.0f MiB in "%s"; timed iterations %.0f MiB'
          % (top[1], top[0], timed[0][1] if timed else float('nan')))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'model': args.model, 'plan': args.plan,
                       'phases': [{'phase': p, 'used_mib': round(u, 1), 'pool_mib': round(t, 1),
                                   'pool_used_mib': round(n, 1)} for p, u, t, n in rows]},
                      f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
