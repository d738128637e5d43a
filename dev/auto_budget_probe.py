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
    with _phases_sampled() as sampler:
        try:
            return command._measure_child(param_bytes, name, gpu, opts)
        finally:
            for phase, peak in sampler.peaks.items():
                print('PHASE %-45s device peak %.0f MiB' % (phase, peak / MiB))
            sys.stdout.flush()


def _phases_sampled():
    """A DeviceSampler (every 2 ms) whose phase follows the measuring
    process: construction, the algorithm timing, planning and placing,
    each iteration."""
    from caffeplus.memory import apply as apply_module, calibration, measure
    from caffeplus.memory.sampler import DeviceSampler
    sampler = DeviceSampler(0, interval=0.002)
    sampler.set_phase('construction')
    count = [0]

    def entering(phase, real):
        def run(*args, **kwargs):
            sampler.set_phase(phase())
            return real(*args, **kwargs)
        return run

    def iteration():
        count[0] += 1
        return 'iteration %d' % (count[0] - 1)
    calibration.measure_net = entering(lambda: 'algorithm timing (calibration.measure_net)',
                                       calibration.measure_net)
    apply_module.apply_plan = entering(lambda: 'planning and placing (apply_plan)',
                                       apply_module.apply_plan)
    measure.run_iteration = entering(iteration, measure.run_iteration)
    return sampler


def _bytes_by_kind(bufs):
    """{kind: MiB} of placed buffers ('life' for the applied plan's lives)."""
    kinds = {}
    for b in bufs:
        kind = 'life' if b.key[0] == 'life' else b.kind
        kinds[kind] = kinds.get(kind, 0) + b.nbytes
    return {k: round(v / MiB) for k, v in kinds.items()}


def _print_largest_workspace(label, bufs, count=6):
    for b in sorted((b for b in bufs if b.kind == 'workspace'), key=lambda b: -b.nbytes)[:count]:
        print('%s %s %.0f MiB steps %s-%s' % (label, b.key, b.nbytes / MiB, b.start, b.end))


def _print_arena(applied, layout_json=None):
    """The plan's own arena beside the applied one, and what differs;
    `layout_json`: write the applied layout there (dev/arena_layout.py's
    record, as pool_census.py --layout-json writes it)."""
    import json
    from caffeplus.memory import placement
    plan = applied.plan
    bufs = applied.layout[0]
    if layout_json:
        from dev.arena_layout import layout_record
        with open(layout_json, 'w') as f:
            json.dump(layout_record(applied.net), f)
    lives = [b for b in bufs if b.key[0] == 'life']
    print('PLAN peak %.0f MiB, arena %.0f MiB, breakdown %s'
          % (plan.peak_bytes / MiB, plan.arena_bytes / MiB,
             {k: round(v / MiB) for k, v in plan.breakdown.items()}))
    print('APPLIED arena %.0f MiB (limit %s), live bound %.0f; lives alone placed %.0f MiB; '
          'bytes by kind %s' % (applied.arena_bytes / MiB, applied.arena_limit,
                                placement.live_bound(bufs) / MiB,
                                placement.place(lives)[1] / MiB, _bytes_by_kind(bufs)))
    print('PLAN bytes by kind %s; plan buffers placed %.0f MiB, bound %.0f'
          % (_bytes_by_kind(plan.buffers), placement.place(plan.buffers)[1] / MiB,
             placement.live_bound(plan.buffers) / MiB))
    for e in applied.entries:
        if e.offloaded:
            print('OFFLOADED %s: lives %s' % (e.name, [(life.start, life.end, round(
                life.buf.nbytes / MiB)) for life in e.lives]))
    _print_largest_workspace('WORKSPACE', bufs)
    _print_largest_workspace('PLAN WORKSPACE', plan.buffers)
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
