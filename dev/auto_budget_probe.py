"""Plan `auto` under a budget on the GPU, iteration by iteration: what it
planned (peak, arena, the arena's limit), then after each iteration the
arena it holds, the offload look-ahead, and the device's memory, with
caffeplus's INFO lines about the plan (which `caffeplus memory` keeps quiet).

    python3 dev/auto_budget_probe.py tests/data/bench/vgg16_b256.prototxt --budget 12G
"""
import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 2 ** 20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('model')
    ap.add_argument('--budget', required=True)
    ap.add_argument('--iterations', type=int, default=8)
    ap.add_argument('--batch', type=int, default=None)
    ap.add_argument('--as-memory', action='store_true',
                    help="plan and measure as `caffeplus memory -gpu 0 --plans auto` does in "
                         "its measuring process, with the plan's INFO lines, and print the "
                         "measured entry")
    ap.add_argument('--layout-json', help='(with --as-memory) write the applied arena\'s '
                                          'buffers there')
    args = ap.parse_args(argv)
    if args.as_memory:
        return _as_memory(args)
    os.environ.setdefault('CAFFEPLUS_CUDNN_SEARCH', 'auto')    # as `caffeplus memory`'s child
    import cupy
    from caffeplus import backend, log
    from caffeplus.memory import budget, measure, shapes
    from caffeplus.memory.apply import apply_named_plan
    from caffeplus.proto import caffe_pb2
    from caffeplus.solver import update_in_backward
    backend.set_mode_gpu(0)
    limit = budget.parse_bytes(args.budget)
    param = shapes.load_net_param(args.model, batch=args.batch, phase=caffe_pb2.TRAIN)
    with shapes.quiet():
        solver = measure._solver(param, 'SGD', args.iterations + 8)
    net = solver.net
    log.set_level(logging.INFO)
    # As `caffeplus memory` plans it (its estimate's parameter gradients,
    # placed where the solver updates in backward) and as `caffeplus train`.
    info = apply_named_plan(net, 'auto', budget=limit, host_budget=budget.default_host_budget(),
                            param_diffs=update_in_backward.places_gradients('auto', net=net))
    applied = net.applied_plan
    plan = applied.plan
    log.set_level(logging.WARNING)
    print('budget %.0f MiB; plan: peak %.0f MiB, arena %.0f MiB, arena limit %s; offloaded %s; '
          'recomputed %s' % (limit / MiB, plan.peak_bytes / MiB, plan.arena_bytes / MiB,
                             '-' if applied.arena_limit is None else
                             '%.0f MiB' % (applied.arena_limit / MiB),
                             info.get('offloaded'), plan.recomputed_names()))
    pool = cupy.get_default_memory_pool()
    for it in range(args.iterations):
        log.set_level(logging.INFO)
        measure.run_iteration(net, solver)
        log.set_level(logging.WARNING)
        cupy.cuda.Device().synchronize()
        runtime = applied.runtime
        print('iteration %d: arena %.0f MiB (held %.0f), device used %.0f MiB, pool %.0f MiB '
              '(%.0f in use); look-ahead %s%s'
              % (it, applied.arena_bytes / MiB, applied.info()['arena_held_bytes'] / MiB,
                 measure.device_used_bytes() / MiB, pool.total_bytes() / MiB,
                 pool.used_bytes() / MiB,
                 runtime.lookaheads() if runtime is not None else '-',
                 ' (pending %s)' % runtime.pending_lookahead
                 if runtime is not None and runtime.pending_lookahead else ''))
        sys.stdout.flush()
    return 0


def _loud_measure_child(param_bytes, name, gpu, opts):
    """commands.memory._measure_child with the plan's INFO lines shown."""
    import contextlib
    from caffeplus import log
    from caffeplus.commands import memory as command
    from caffeplus.memory import shapes

    @contextlib.contextmanager
    def loud():
        yield
    shapes.quiet = loud
    log.set_level(logging.INFO)
    from caffeplus.memory import apply as apply_module
    real = apply_module.apply_named_plan

    def traced(net, *args, **kwargs):
        info = real(net, *args, **kwargs)
        _print_arena(net.applied_plan, opts.get('layout_json'))
        return info
    apply_module.apply_named_plan = traced
    phases = _PhaseSampler()
    phases.wrap()
    try:
        return command._measure_child(param_bytes, name, gpu, opts)
    finally:
        phases.stop()
        phases.report()


class _PhaseSampler:
    """The device's used memory every 2 ms, its peak kept per phase of the
    measuring process: construction, the algorithm timing, planning and
    placing, each iteration."""

    def __init__(self):
        import threading
        self.phase, self.peaks, self.order = 'construction', {}, ['construction']
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = False

    def _run(self):
        import cupy
        cupy.cuda.Device(0).use()
        while not self._stop.wait(0.002):
            free, total = cupy.cuda.runtime.memGetInfo()
            used = total - free
            if used > self.peaks.get(self.phase, 0):
                self.peaks[self.phase] = used

    def set(self, phase):
        if not self._started:
            self._thread.start()
            self._started = True
        if phase not in self.peaks:
            self.order.append(phase)
        self.phase = phase

    def wrap(self):
        from caffeplus.memory import apply as apply_module, calibration, measure
        real_measure, real_apply = calibration.measure_net, apply_module.apply_plan
        real_iteration = measure.run_iteration
        count = [0]

        def measure_net(*args, **kwargs):
            self.set('algorithm timing (calibration.measure_net)')
            return real_measure(*args, **kwargs)

        def apply_plan(*args, **kwargs):
            self.set('planning and placing (apply_plan)')
            return real_apply(*args, **kwargs)

        def run_iteration(*args, **kwargs):
            self.set('iteration %d' % count[0])
            count[0] += 1
            return real_iteration(*args, **kwargs)
        calibration.measure_net = measure_net
        apply_module.apply_plan = apply_plan
        measure.run_iteration = run_iteration
        self.set('construction')

    def stop(self):
        self._stop.set()
        if self._started:
            self._thread.join()

    def report(self):
        for phase in self.order:
            if phase in self.peaks:
                print('PHASE %-45s device peak %.0f MiB' % (phase, self.peaks[phase] / MiB))
        sys.stdout.flush()


def _print_arena(applied, layout_json=None):
    """The plan's own arena beside the applied one, and what differs;
    `layout_json`: write the applied buffers there (kind, bytes, life)."""
    import json
    from caffeplus.memory import placement
    plan = applied.plan
    bufs, placed, offsets = applied.layout
    if layout_json:
        with open(layout_json, 'w') as f:
            json.dump({'arena_bytes': applied.arena_bytes,
                       'buffers': [{'kind': b.kind if b.key[0] != 'life' else 'life',
                                    'nbytes': b.nbytes, 'start': b.start, 'end': b.end}
                                   for b in bufs]}, f)
    kinds = {}
    for b in bufs:
        kind = 'life' if b.key[0] == 'life' else b.kind
        kinds[kind] = kinds.get(kind, 0) + b.nbytes
    lives = [b for b in bufs if b.key[0] == 'life']
    print('PLAN peak %.0f MiB, arena %.0f MiB, breakdown %s'
          % (plan.peak_bytes / MiB, plan.arena_bytes / MiB,
             {k: round(v / MiB) for k, v in plan.breakdown.items()}))
    print('APPLIED arena %.0f MiB (limit %s), live bound %.0f; lives alone placed %.0f MiB; '
          'bytes by kind %s' % (applied.arena_bytes / MiB, applied.arena_limit,
                                placement.live_bound(bufs) / MiB,
                                placement.place(lives)[1] / MiB,
                                {k: round(v / MiB) for k, v in kinds.items()}))
    plan_kinds = {}
    for b in plan.buffers:
        plan_kinds[b.kind] = plan_kinds.get(b.kind, 0) + b.nbytes
    print('PLAN bytes by kind %s; plan buffers placed %.0f MiB, bound %.0f'
          % ({k: round(v / MiB) for k, v in plan_kinds.items()},
             placement.place(plan.buffers)[1] / MiB, placement.live_bound(plan.buffers) / MiB))
    for e in applied.entries:
        if e.offloaded:
            print('OFFLOADED %s: lives %s' % (e.name, [(life.start, life.end, round(
                life.buf.nbytes / MiB)) for life in e.lives]))
    ws = [b for b in bufs if b.kind == 'workspace']
    for b in sorted(ws, key=lambda b: -b.nbytes)[:6]:
        print('WORKSPACE %s %.0f MiB steps %s-%s' % (b.key, b.nbytes / MiB, b.start, b.end))
    pws = [b for b in plan.buffers if b.kind == 'workspace']
    for b in sorted(pws, key=lambda b: -b.nbytes)[:6]:
        print('PLAN WORKSPACE %s %.0f MiB steps %s-%s' % (b.key, b.nbytes / MiB, b.start, b.end))
    sys.stdout.flush()


def _as_memory(args):
    import json
    from caffeplus import config
    from caffeplus.commands import memory as command
    from caffeplus.memory import budget, shapes
    from caffeplus.proto import caffe_pb2
    param = shapes.load_net_param(args.model, batch=args.batch, phase=caffe_pb2.TRAIN)
    opts = {'solver_type': 'SGD', 'keep': [], 'offload': 'conv',
            'budget': budget.parse_bytes(args.budget), 'training': True,
            'host_budget': budget.default_host_budget(), 'iterations': args.iterations,
            'level': 0, 'settings': config.flag_values(), 'stages': None,
            'layout_json': args.layout_json}
    # In a spawned process of its own, as the command measures.
    entry = command.in_own_process(_loud_measure_child, param.SerializeToString(), 'auto', 0,
                                   opts)
    keep = ('peak_bytes', 'steady_peak_bytes', 'startup_peak_bytes', 'arena_bytes',
            'arena_bound_bytes', 'offloaded', 'planned', 'iter_ms')
    print(json.dumps({k: entry.get(k) for k in keep}))
    return 0


if __name__ == '__main__':
    sys.exit(main())
