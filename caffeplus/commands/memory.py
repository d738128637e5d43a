"""caffeplus memory: the device memory a model needs under each memory plan.

    caffeplus memory -model train_val.prototxt --estimate
    caffeplus memory -model train_val.prototxt -gpu 0 --plans stock,shared,auto --budget 12G
    caffeplus memory -model m.prototxt --estimate --batch 256 --json
    caffeplus memory -model m.prototxt --estimate --plot mem.png

For each plan (stock, arena, shared, offload, auto: see caffeplus.memory.plan)
the peak device memory of one training iteration (forward, backward, solver
update) and its breakdown: parameters, parameter diffs, solver history,
activations, activation diffs, workspace, other; and the iteration time.

--estimate (or no -gpu): the planner's numbers, computed on the CPU from a
  shape-only build of the net (no blob memory is allocated, so VGG-16 at
  batch 256 plans on a laptop); workspace, "other" and times come from the
  documented model in caffeplus.memory.workspace_model, fitted on the GPU
  the table names under it (workspace_model.MODEL_GPU). iter_ms is null
  (nothing ran); est_iter_ms is the model's time. Under the table: what
  each estimate's "other" holds (the runtime, stock Caffe's cuDNN handles,
  the layers' own buffers; JSON: other_parts). A net without a loss (a
  deploy net) is planned forward only: no gradients, no solver history.
-gpu N: each plan is also run for real on GPU N (caffeplus.memory.measure),
  each in a process of its own (its peak is the whole process, as stock
  Caffe's figures are), and the measurement is shown with the estimate
  beside it: peak_bytes is the training iterations' peak, and
  process_peak_bytes the whole process's, start-up (the algorithms' timing,
  planning, the first iterations) included (startup_peak_bytes: start-up's).

Data layers become DummyData of the same shapes (caffeplus.io.dummy), so no
database is needed (a Data layer whose database opens plans at its first
record's shape; --shape TOP=N,C,H,W gives a shape that cannot be told from
the net, e.g. HDF5Data's); --batch N sets the batch of every
data/DummyData/Input top. `auto` picks the fastest plan whose peak fits --budget (default: no
limit with --estimate, the GPU's memory with -gpu); when none fits, the error
names the smallest budget that would. --keep a,b keeps those blobs readable
after the iteration (reusing plans may overwrite them otherwise); --offload
picks the offload policy (conv, all, free, or blob names separated by ',').
`auto` weighs cuDNN's measured algorithms where it has them: on the GPU it
times them before it plans; --calibration FILE (or CAFFEPLUS_CALIBRATION)
loads a table saved on a GPU (tools/dump_algorithms.py --calibration), so
--estimate plans as the GPU would.

--json prints {"plans": {PLAN: {"peak_bytes": N, "breakdown": {CATEGORY: N},
"iter_ms": T or null, "estimated": true|false, ...}}, ...} and nothing else
on stdout. --plot NAME.png writes NAME.png (a stacked bar per plan) and
NAME_timeline.png (live memory across the steps of one iteration).

Reading the numbers: stock's "activations" is every blob's data once.
Caffe's log line "Memory required for data" (which caffeplus logs too)
adds each top's count as its layer is set up, so tops that alias an earlier
blob's data are counted again: in-place tops and Split's tops. Hence
    stock activations = Memory required for data
                        - bytes of in-place tops - bytes of Split tops
(tests/test_memory_command.py checks it against stock Caffe's figures for
the bench nets). For reusing plans, activations + activation diffs is the
planned arena, split between the two by their shares at the peak step.
"""
import json
import os
import sys

from caffeplus import config, precision
from caffeplus.errors import CaffeplusError
from caffeplus.proto import caffe_pb2

DEFAULT_PLANS = 'stock,arena,shared,offload,auto'


def add_arguments(parser):
    parser.add_argument('--model', default='', help='the model definition (prototxt)')
    parser.add_argument('--gpu', default='', help='measure on this GPU (one device ID)')
    parser.add_argument('--plans', default=DEFAULT_PLANS,
                        help="plans to report, separated by ',' (default: %s)" % DEFAULT_PLANS)
    parser.add_argument('--batch', type=int, default=None,
                        help='override the batch size of the data/DummyData/Input tops')
    parser.add_argument('--budget', default=None,
                        help="memory budget for plan 'auto', e.g. 12G, 800M, 1.5GiB")
    parser.add_argument('--host-budget', default=None,
                        help="pinned host memory plan 'auto' may offload to, e.g. 64G "
                             '(default: 75%% of this machine\'s memory with -gpu, no limit with '
                             '--estimate)')
    parser.add_argument('--plot', default=None,
                        help='write charts: NAME.png (bars) and NAME_timeline.png')
    parser.add_argument('--json', action='store_true', help='print the results as JSON')
    parser.add_argument('--calibration', default=None, metavar='FILE',
                        help="measured cuDNN algorithms (JSON, caffeplus.memory.calibration) "
                             "for auto's search, e.g. to plan for a GPU on a machine without one")
    parser.add_argument('--estimate', action='store_true',
                        help='estimate without a GPU (no measurement)')
    parser.add_argument('--keep', default='',
                        help="blobs to keep readable after the iteration, separated by ','")
    parser.add_argument('--offload', default='conv',
                        help="offload policy of plan 'offload': conv, all, free (the maps whose "
                             "copies the measured step times hide), or blob names")
    parser.add_argument('--solver_type', default='SGD',
                        help='solver whose history to count (SGD, Nesterov, AdaGrad, RMSProp, '
                             'AdaDelta, Adam)')
    parser.add_argument('--iterations', type=int, default=3,
                        help='timed iterations per plan with -gpu (after one stepped one)')
    parser.add_argument('--shape', action='append', default=[], metavar='TOP=N,C,H,W',
                        help="the shape of a data layer's top (or, under a layer's name, its "
                             "data top) when it cannot be told from the net; repeatable")
    parser.add_argument('--level', type=int, default=0, help='network level')
    parser.add_argument('--stage', default='', help="network stages, separated by ','")
    precision.add_argument(parser)
    config.add_arguments(parser, 'memory', skip=('calibration',))


def parse_plans(spec):
    from caffeplus.memory.plan import check_plan_name
    names = []
    for name in (spec or '').split(','):
        name = name.strip()
        if name and name not in names:
            names.append(check_plan_name(name))
    if not names:
        raise CaffeplusError('--plans names no plan (choose from stock, arena, shared, '
                             'offload, auto)')
    return names


def parse_shapes(specs):
    """['data=64,3,32,32', ...] -> {'data': (64, 3, 32, 32)}."""
    out = {}
    for spec in specs or ():
        name, sep, dims = spec.partition('=')
        try:
            shape = tuple(int(d) for d in dims.split(','))
        except ValueError:
            shape = ()
        if not sep or not name.strip() or not shape or any(d <= 0 for d in shape):
            raise CaffeplusError("--shape must be TOP=N,C,H,W with positive integers, not '%s'"
                                 % spec)
        out[name.strip()] = shape
    return out


def parse_gpu(spec):
    spec = (spec or '').strip()
    if not spec:
        return None
    try:
        ids = [int(x) for x in spec.split(',')]
    except ValueError:
        raise CaffeplusError("-gpu must be one device ID, not '%s'" % spec)
    if len(ids) != 1 or ids[0] < 0:
        raise CaffeplusError("-gpu: memory is measured on one device; got '%s'" % spec)
    return ids[0]


def check_keep(net, spec):
    keep = check_keep_names(spec)
    missing = [n for n in keep if n not in net.blobs]
    if missing:
        raise CaffeplusError('--keep: net %s has no blob named %s (its blobs: %s)'
                             % (net.name, ', '.join("'%s'" % n for n in missing),
                                ', '.join(list(net.blobs)[:20]) +
                                (', ...' if len(net.blobs) > 20 else '')))
    return keep


def offloaded_names(plan):
    return sorted({n for key in plan.offloaded for n in key[1]})


def plan_entry(plan, budget=None, net=None):
    """A plan's JSON entry (estimate); with the net, what its "other" holds."""
    from caffeplus.memory import workspace_model
    from caffeplus.memory.plan import workspace_calls
    entry = {
        'peak_bytes': int(plan.peak_bytes),
        'breakdown': {k: int(v) for k, v in plan.breakdown.items()},
        'iter_ms': None,
        'estimated': True,
        'est_iter_ms': round(plan.est_iter_ms, 3),
        'arena_bytes': int(plan.arena_bytes),
        'offloaded': offloaded_names(plan),
        'recomputed': plan.recomputed_names(),
        'masked': list(plan.masked),
        'workspace_calls': workspace_calls(plan),
    }
    if plan.name == 'auto':
        entry['budget'] = plan.budget
        entry['workspace_cap'] = int(plan.workspace_cap)
    if budget is not None:
        entry['fits_budget'] = plan.peak_bytes <= budget
    if net is not None:
        entry['other_parts'] = {k: int(v) for k, v in workspace_model.other_parts(
            net, plan.name, plan.breakdown['other']).items()}
    return entry


def trains(net):
    """Whether the net learns: some layer's backward runs (a deploy net
    without a loss has none, so no gradients and no solver history)."""
    return any(net.layer_need_backward)


def net_title(net, batch, solver_type, training):
    if training:
        return 'net %s, batch %s, solver %s' % (net.name, batch, solver_type)
    return 'net %s, batch %s, forward only: no loss, so no gradients or solver history' \
        % (net.name, batch)


def step_labels(net):
    L = len(net.layers)
    names = [layer.name for layer in net.layers]
    return ['fwd ' + n for n in names] + ['bwd ' + names[L - 1 - t] for t in range(L)] + \
        ['update']


def estimate_curve(plan):
    """Bytes live at each step: the activation buffers live then plus
    everything that lives throughout (parameters, diffs, history, workspace,
    other). A placing plan's arena holds its workspace and the gradients
    applied in backward too: what lives throughout is what its peak holds
    beside the arena."""
    b = plan.breakdown
    if plan.arena_bytes:
        fixed = plan.peak_bytes - plan.arena_bytes
    else:
        fixed = sum(b[c] for c in ('parameters', 'parameter_diffs', 'solver_history',
                                   'workspace', 'other'))
    return [fixed + v for v in plan.live_curve()]


def run(args):
    if args.calibration:
        args.calibration = os.path.abspath(args.calibration)    # the measuring processes'
    with config.cli_scope(args):
        return _run(args)


def _run(args):
    from caffeplus.memory import budget as budget_mod, report, shapes
    from caffeplus.memory.plan import HISTORY_COPIES
    if not args.model:
        raise CaffeplusError('Need a model definition to plan (--model).')
    plans = parse_plans(args.plans)
    if args.solver_type not in HISTORY_COPIES:
        raise CaffeplusError("unknown solver type '%s': choose one of %s"
                             % (args.solver_type, ', '.join(HISTORY_COPIES)))
    if args.batch is not None and args.batch <= 0:
        raise CaffeplusError('--batch must be positive (got %d)' % args.batch)
    if args.iterations < 1:
        raise CaffeplusError('--iterations must be at least 1 (got %d)' % args.iterations)
    budget = budget_mod.parse_bytes(args.budget) if args.budget is not None else None
    if args.calibration:
        from caffeplus.memory import calibration
        calibration.load(args.calibration)
    gpu = parse_gpu(args.gpu)
    measuring = gpu is not None and not args.estimate
    if args.host_budget is not None:
        host_budget = budget_mod.parse_bytes(args.host_budget)
    else:
        host_budget = budget_mod.default_host_budget() if measuring else None
    if not measuring and not args.estimate and not args.json:
        print('caffeplus memory: no -gpu given: showing estimates', file=sys.stderr)

    try:
        param = shapes.load_net_param(args.model, batch=args.batch, phase=caffe_pb2.TRAIN,
                                      shapes=parse_shapes(args.shape))
    except CaffeplusError as exc:
        if 'pass shapes=' not in str(exc):
            raise
        raise CaffeplusError('%s (on the command line: --shape TOP=N,C,H,W)'
                             % str(exc).split('; pass shapes=')[0])
    if args.precision:
        # In the parameters themselves: the measuring processes build from them.
        precision.override(param, args.precision)
    stages = [st for st in (args.stage or '').split(',') if st] or None
    net = shapes.build_net(param, level=args.level, stages=stages)
    keep = check_keep(net, args.keep)
    training = trains(net)
    if measuring and budget is None and 'auto' in plans:
        budget_for_auto = in_own_process(_device_total_child, gpu)
    else:
        budget_for_auto = budget

    batch = shapes.batch_of(param)
    estimates = {}
    for name in plans:
        estimates[name] = budget_mod.estimate_plan(
            net, name, solver_type=args.solver_type, keep=keep, training=training,
            offload_policy=args.offload, budget=budget_for_auto, host_budget=host_budget)

    results = {}
    for name, plan in estimates.items():
        entry = plan_entry(plan, budget, net)
        entry['curve'] = estimate_curve(plan)
        if measuring:
            entry = _measure(param, plan, gpu, args, entry, budget_for_auto, host_budget,
                             training)
        results[name] = entry

    title = net_title(net, batch, args.solver_type, training)
    device_name = next((r['device_name'] for r in results.values() if r.get('device_name')),
                       None)
    if args.plot:
        report.plot(args.plot, results, title=title, step_labels=step_labels(net))
    if args.json:
        doc = {'net': net.name, 'batch': batch,
               'solver_type': args.solver_type if training else None, 'training': training,
               'budget': budget, 'device': gpu if measuring else None,
               'device_name': device_name, 'model_gpu': report.model_gpu(),
               'plans': {n: {k: v for k, v in r.items()
                             if k not in ('curve', 'measured_curve')}
                         for n, r in results.items()}}
        print(json.dumps(doc, indent=1, sort_keys=False))
    else:
        source = 'measured on GPU %d' % gpu if measuring else 'estimated without a GPU'
        print(report.format_table(results, 'Memory plans for %s (%s)' % (title, source)))
        print(report.format_notes(results, measured_on=device_name,
                                  sixteen_bit=precision.type_names(net.layer_types)))
        if budget is not None:
            print('budget: %s' % budget_mod.format_bytes(budget))
        if args.plot:
            print('charts: %s, %s' % report.plot_paths(args.plot))
    return 0


def _measure(param, plan, gpu, args, estimate_entry, budget_for_auto=None, host_budget=None,
             training=True):
    """The measured entry of one plan, with the estimate beside it. The plan
    runs in a process of its own, as `caffe time` does: the peak is the
    device's used memory, so nothing another plan left behind (cuDNN
    handles, CUDA modules, cached blocks) may count."""
    estimate = {'peak_bytes': estimate_entry['peak_bytes'],
                'breakdown': estimate_entry['breakdown'],
                'iter_ms': estimate_entry['est_iter_ms']}
    try:
        measured = in_own_process(_measure_child, param.SerializeToString(), plan.name, gpu,
                                  {'solver_type': args.solver_type,
                                   'keep': check_keep_names(args.keep),
                                   'offload': args.offload, 'budget': budget_for_auto,
                                   'training': training,
                                   'host_budget': host_budget,
                                   'iterations': args.iterations, 'level': args.level,
                                   'settings': config.flag_values(),
                                   'stages': [st for st in (args.stage or '').split(',') if st]
                                   or None})
    except CaffeplusError as exc:
        entry = dict(estimate_entry)
        entry['measure_error'] = str(exc)
        return entry
    planned = measured.pop('planned', None)
    if planned:
        # Plan auto made in the measuring process, with measured algorithms.
        estimate = dict(estimate, peak_bytes=planned['peak_bytes'],
                        iter_ms=planned['est_iter_ms'], recomputed=planned['recomputed'],
                        masked=planned['masked'])
        estimate_entry = dict(estimate_entry, est_iter_ms=round(planned['est_iter_ms'], 3))
    if 'other_parts' in estimate_entry:
        estimate['other_parts'] = estimate_entry['other_parts']
    entry = {k: v for k, v in measured.items() if k != 'live_curve'}
    entry['estimate'] = estimate
    # Against the steady peak: the estimate is of the settled plan (offload
    # 'free' runs its first iterations as shared while it measures).
    settled = measured.get('steady_peak_bytes') or measured['peak_bytes']
    entry['estimate_error_pct'] = round(
        100.0 * (estimate['peak_bytes'] - settled) / max(settled, 1), 2)
    for key in ('arena_bytes', 'offloaded', 'budget', 'workspace_cap', 'fits_budget',
                'est_iter_ms'):
        if key in estimate_entry and key not in entry:     # the measured, where measured
            entry[key] = estimate_entry[key]
    entry['curve'] = estimate_entry['curve']
    entry['measured_curve'] = list(measured.get('live_curve', []))
    return entry


def check_keep_names(spec):
    return [n.strip() for n in (spec or '').split(',') if n.strip()]


def _measure_child(param_bytes, name, gpu, opts):
    """In the child: rebuild the net, plan `name` as the parent did, measure.
    Algorithms are chosen as `caffeplus train -gpu` chooses them (timed for
    the net's own workspace) unless the cudnn_search setting says otherwise;
    the parent's flags hold here too (caffeplus.config)."""
    config.set_command_default('cudnn_search', 'auto')
    with config.flags_scope(opts.get('settings', {})):
        return _measure_in_child(param_bytes, name, gpu, opts)


def _measure_in_child(param_bytes, name, gpu, opts):
    from caffeplus.memory import budget as budget_mod, shapes
    from caffeplus.memory.measure import measure_plan
    param = caffe_pb2.NetParameter()
    param.ParseFromString(param_bytes)
    with shapes.quiet():
        net = shapes.build_net(param, level=opts['level'], stages=opts['stages'])
        plan = budget_mod.estimate_plan(net, name, solver_type=opts['solver_type'],
                                        keep=opts['keep'],
                                        training=opts.get('training', True),
                                        offload_policy=opts['offload'],
                                        budget=opts['budget'], host_budget=opts['host_budget'])
    del net
    replan = None
    if name == 'auto':
        # Planned again on the GPU, with the convolutions' measured algorithms.
        from caffeplus.memory.apply import apply_named_plan

        def replan_auto(net):
            # As the estimate (and a solver that updates in backward) plans it.
            return apply_named_plan(net, 'auto', keep=opts['keep'],
                                    training=opts.get('training', True),
                                    solver_type=opts['solver_type'], budget=opts['budget'],
                                    host_budget=opts['host_budget'],
                                    param_diffs=plan.param_diffs)
        replan = replan_auto
    return measure_plan(param, plan, gpu, solver_type=opts['solver_type'],
                        iterations=opts['iterations'], apply=replan)


def _device_total_child(gpu):
    from caffeplus.memory.measure import device_total_bytes
    return device_total_bytes(gpu)


def _child_main(conn, fn, args):
    try:
        conn.send(('ok', fn(*args)))
    except CaffeplusError as exc:
        conn.send(('error', str(exc)))
    except BaseException as exc:       # a child's crash becomes the parent's clear error
        import traceback
        conn.send(('error', '%s: %s\n%s' % (type(exc).__name__, exc, traceback.format_exc())))
    finally:
        conn.close()


def in_own_process(fn, *args):
    """fn(*args) in a fresh (spawned) Python process, so that this one never
    holds a CUDA context; its CaffeplusError comes back as ours."""
    import multiprocessing
    ctx = multiprocessing.get_context('spawn')
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(child, fn, args))
    proc.start()
    child.close()
    try:
        status, value = parent.recv()
    except EOFError:
        proc.join()
        raise CaffeplusError('the measuring process died (exit code %s) before reporting; '
                             'out of host memory, or a crash in CUDA' % proc.exitcode)
    finally:
        proc.join()
    if status != 'ok':
        raise CaffeplusError(value)
    return value
