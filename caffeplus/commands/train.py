"""caffeplus train: Caffe's `caffe train`.

    caffeplus train -solver solver.prototxt [-weights a.caffemodel[,b.caffemodel]]
    caffeplus train -solver solver.prototxt -snapshot lenet_iter_500.solverstate
    caffeplus train -solver solver.prototxt -gpu 0

-weights finetunes from the given weights (copied by layer name into the
train and test nets); -snapshot resumes from a solver state; the two exclude
each other. Several GPUs (-gpu 0,1 or all) or an MPI launch hand over to
caffeplus.parallel (data-parallel ranks). Without -gpu the solver's solver_mode decides (GPU uses
device_id); with neither it runs on the CPU. SIGINT and SIGHUP do what
-sigint_effect / -sighup_effect say (stop, snapshot or none; defaults stop
and snapshot), checked once per iteration as Caffe does; a second SIGINT
before the first was acted on interrupts at once (exit status 130). SIGTERM
(what `docker stop`, systemd and batch schedulers send before SIGKILL)
always stops, whatever -sigint_effect and -sighup_effect say: the run stops
at the end of the iteration, writes its final snapshot (as a SIGINT stop
does: snapshot_after_train), logs "Optimization stopped early." and exits 0;
a second SIGTERM before the first was acted on exits at once (status 143).

The helpers here (GPU list, stages, phase) serve `test` and `time` too.
"""
import os
import re

from caffeplus import backend, config, log, precision
from caffeplus.backend import gpu_name
from caffeplus.errors import CaffeplusError
from caffeplus.io import workers
from caffeplus.proto import caffe_pb2
from caffeplus.signal_handler import SignalHandler

EFFECTS = ('snapshot', 'stop', 'none')
MEMORY_PLANS = ('stock', 'arena', 'shared', 'offload', 'auto')


# -- helpers shared by train, test and time ---------------------------------------
def add_device_arguments(parser):
    parser.add_argument('--gpu', default='',
                        help="run in GPU mode on the given device IDs separated by ','; "
                             "'all' for every GPU (default: CPU)")
    parser.add_argument('--level', type=int, default=0, help='network level')
    parser.add_argument('--stage', default='',
                        help="network stages (not to be confused with phase), separated by ','")


def gpu_count():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # ImportError or a CUDA runtime error
        raise CaffeplusError('no usable GPU: %s' % exc)


def parse_gpus(spec):
    """Caffe's get_gpus: '' -> [], 'all' -> every device, '0,1' -> [0, 1]."""
    spec = (spec or '').strip()
    if not spec:
        return []
    if spec == 'all':
        return list(range(gpu_count()))
    try:
        return [int(x) for x in spec.split(',')]
    except ValueError:
        raise CaffeplusError("--gpu must be device IDs separated by ',' or 'all', not '%s'"
                             % spec)


def parse_stages(spec):
    """Caffe splits the -stage flag on ','; an empty flag gives one empty stage."""
    return (spec or '').split(',')


def parse_phase(spec, default):
    if not spec:
        return default
    try:
        return {'TRAIN': caffe_pb2.TRAIN, 'TEST': caffe_pb2.TEST}[spec]
    except KeyError:
        raise CaffeplusError('phase must be "TRAIN" or "TEST" (got "%s")' % spec)


def use_device(gpus, style):
    """Switch to the first GPU of `gpus` (or the CPU) and log as Caffe's
    `style` command does ('train' or 'test'/'time')."""
    if not gpus:
        log.info('Use CPU.')
        backend.set_mode_cpu()
        return
    if style == 'train':
        log.info('Using GPUs %s', ', '.join(str(g) for g in gpus))
        for g in gpus:
            log.info('GPU %d: %s', g, gpu_name(g))
    else:
        log.info('Use GPU with device ID %d', gpus[0])
        log.info('GPU device name: %s', gpu_name(gpus[0]))
    if style == 'train':
        # Training times its convolution algorithms (FindEx in the arena), as
        # cudnn.benchmark does; cudnn_search heuristic opts out.
        config.set_command_default('cudnn_search', 'auto')
    backend.set_mode_gpu(gpus[0])


def parse_bytes(text):
    """'1073741824', '512M', '2G' -> bytes."""
    m = re.match(r'^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$', text or '')
    if not m:
        raise CaffeplusError("cannot read '%s' as a size in bytes (e.g. 1073741824, 512M, 2G)"
                             % text)
    scale = {'': 1, 'k': 2 ** 10, 'm': 2 ** 20, 'g': 2 ** 30, 't': 2 ** 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


# -- the command -------------------------------------------------------------------------
def add_arguments(parser):
    parser.add_argument('--solver', default='', help='the solver definition protocol buffer '
                        'text file')
    parser.add_argument('--weights', default='',
                        help="the pretrained weights to initialize finetuning, separated by ','. "
                             'Cannot be set simultaneously with snapshot.')
    parser.add_argument('--snapshot', default='', help='the snapshot solver state to resume '
                        'training')
    add_device_arguments(parser)
    parser.add_argument('--sigint_effect', default='stop', choices=EFFECTS,
                        help='action to take when a SIGINT signal is received (SIGTERM '
                             'always stops, with the final snapshot)')
    parser.add_argument('--sighup_effect', default='snapshot', choices=EFFECTS,
                        help='action to take when a SIGHUP signal is received')
    parser.add_argument('--memory', default=None, choices=MEMORY_PLANS,
                        help='memory plan for the nets: stock, arena, shared, offload, auto '
                             "(default: the solver's caffeplus_param memory_plan, else shared)")
    parser.add_argument('--workspace_limit', '--workspace-limit', default=None,
                        help='cap on the cuDNN workspace, in bytes (suffixes K, M, G allowed)')
    parser.add_argument('--memory_budget', '--memory-budget', default=None,
                        help='memory budget for the auto plan, in bytes (suffixes K, M, G)')
    parser.add_argument('--keep', default=None,
                        help="blobs that stay readable after forward under reusing plans, "
                             "separated by ','")
    parser.add_argument('--offload', default=None,
                        help="offload policy: conv, all, free (what the measured step times hide), "
                             "or blob names separated by ','")
    workers.add_argument(parser)
    parser.add_argument('--math', default=None,
                        help='GPU math: strict (default), tf32, deterministic')
    precision.add_argument(parser)
    config.add_arguments(parser, 'train', skip=('data_workers',))


def build_solver_param(args):
    from caffeplus.solver import read_solver_file
    if not args.solver:
        raise CaffeplusError('Need a solver definition to train (--solver).')
    if args.snapshot and args.weights:
        raise CaffeplusError('Give a snapshot to resume training or weights to finetune but '
                             'not both.')
    param = read_solver_file(args.solver)
    param.train_state.level = args.level
    param.train_state.stage.extend(parse_stages(args.stage))
    if args.snapshot:
        param.ClearField('weights')
    elif args.weights:
        param.ClearField('weights')
        param.weights.append(args.weights)
    if args.memory is not None:
        param.caffeplus_param.memory_plan = args.memory
    if args.workspace_limit is not None:
        param.caffeplus_param.workspace_limit = parse_bytes(args.workspace_limit)
    if getattr(args, 'memory_budget', None) is not None:
        param.caffeplus_param.memory_budget = parse_bytes(args.memory_budget)
    for flag in ('keep', 'offload'):
        value = getattr(args, flag, None)
        if value is not None:
            field = getattr(param.caffeplus_param, flag)
            del field[:]
            field.extend(v.strip() for v in value.split(',') if v.strip())
    if getattr(args, 'math', None) is not None:
        param.caffeplus_param.math = args.math
    if getattr(args, 'precision', None):
        param.caffeplus_param.precision = args.precision
    if getattr(args, 'data_workers', None):
        # Carried by the solver to data-parallel ranks in other processes.
        param.caffeplus_param.data_workers = args.data_workers
    copy_setting_flags(args, param)
    args.workspace_limit_bytes = param.caffeplus_param.workspace_limit \
        if param.HasField('caffeplus_param') else 0
    return param


def choose_gpus(args, param):
    spec = args.gpu
    from_solver = False
    if not spec and param.HasField('solver_mode') and \
            param.solver_mode == caffe_pb2.SolverParameter.GPU:
        spec = str(param.device_id)
        from_solver = True
    try:
        gpus = parse_gpus(spec)
        if gpus and from_solver:
            gpu_count()
    except CaffeplusError as exc:
        if not from_solver:
            raise
        log.warning('The solver asks for solver_mode GPU, but %s; training on the CPU.', exc)
        return []
    return gpus


def _parallel():
    try:
        import caffeplus.parallel as parallel
    except ImportError:
        return None
    return parallel


def copy_setting_flags(args, param):
    """The settings flags that have a solver field go into the solver's
    caffeplus_param too: data-parallel ranks in other processes get them."""
    for s in config.SETTINGS.values():
        value = getattr(args, s.name, None)
        if s.solver_field and s.name != 'data_workers' and value is not None:
            value = s.check(value, s.flag)
            if value is None:
                continue
            if s.name == 'calibration':
                value = os.path.abspath(value)
            setattr(param.caffeplus_param, s.solver_field, value)


def restored_search_setting():
    """A command's own defaults (cudnn_search auto on a GPU) hold for its
    run only, so an in-process caller (pycaffe scripts, tests) keeps its own."""
    return config.command_defaults()


def run(args):
    with restored_search_setting(), workers.cli_setting(args), config.cli_scope(args):
        return _run(args)


def _run(args):
    from caffeplus.solver import get_solver
    param = build_solver_param(args)
    gpus = choose_gpus(args, param)
    parallel = _parallel()
    if parallel is not None and parallel.wants_parallel(gpus):
        # Several GPUs, or several MPI ranks: caffeplus.parallel runs the
        # ranks (each builds this solver through get_solver).
        return parallel.launch(args, param, gpus)
    if len(gpus) > 1:
        raise CaffeplusError('training on several GPUs (--gpu %s) is not available in this '
                             'build; give one device ID' % args.gpu)
    use_device(gpus, 'train')
    if gpus:
        param.device_id = gpus[0]
    with SignalHandler(args.sigint_effect, args.sighup_effect) as handler:
        solver = get_solver(param, solver_path=args.solver)
        solver.set_action_function(handler.action)
        if args.snapshot:
            log.info('Resuming from %s', args.snapshot)
            solver.restore(args.snapshot)
        log.info('Starting Optimization')
        solver.solve()
    log.info('Optimization Done.')
    return 0
