"""caffeplus time: Caffe's `caffe time`, layer-by-layer timing.

    caffeplus time -model m.prototxt [-iterations 50] [-phase TRAIN] [-gpu 0] [--memory stock]

One forward and backward pass first (logging the initial loss), then
--iterations timed forward-backward passes; per-layer means and totals in
Caffe's lines:

    Iteration: 1 forward-backward time: 26 ms.
         conv1	forward: 1.4728 ms.
         conv1	backward: 1.5266 ms.
    Average Forward pass: 13.3522 ms.
    Average Backward pass: 13.4744 ms.
    Average Forward-Backward: 26.8 ms.
    Total Time: 134 ms.
    *** Benchmark ends ***

The net's inputs are whatever its data layers produce (as Caffe, the
benchmark assumes no externally fed input blobs). On the GPU each reading
waits for the device, so the times are the layers' own. A prefetching data
layer's forward time is what it waited for a batch; two more lines give its
prefetch thread's mean times per batch apart (`data` is the layer's name):

          data	prefetch wait: 0.05 ms.
          data	read and decode: 12.1 ms, transform: 3.2 ms (a batch, in the
              prefetch thread, 2 data workers).

--memory PLAN applies a memory plan (caffeplus.memory.apply) before the
first pass: `stock` reproduces BVLC Caffe 1.0's device memory (per-layer
cuDNN workspaces and handles, its layers' own buffers), so the peak of
`caffeplus time --memory stock -gpu 0` compares with `caffe time -gpu 0`'s;
arena, shared, offload, auto as for training. Without it the net is built
as caffeplus.Net builds it (every blob kept; on the GPU one workspace arena
for the cuDNN calls, as plan `arena`). Each timed pass runs the way
Net.forward/backward run it (the plan's and the fused chains' per-pass
hooks), layer by layer. With a plan other than stock on the GPU, the
convolutions time their algorithms as `caffeplus train` does
(cudnn_search auto unless set: docs/configuration.md), so `time` measures what training runs.
"""
import time

from caffeplus import backend, config, kernels, log, precision
from caffeplus.commands.train import add_device_arguments, parse_gpus, parse_phase, \
    parse_stages, restored_search_setting, use_device
from caffeplus.errors import CaffeplusError
from caffeplus.io import workers
from caffeplus.net import call_hooks, hook_table
from caffeplus.proto import caffe_pb2


def add_arguments(parser):
    parser.add_argument('--model', default='', help='the model definition protocol buffer '
                        'text file')
    parser.add_argument('--iterations', type=int, default=50,
                        help='the number of iterations to run')
    parser.add_argument('--phase', default='', help='network phase (TRAIN or TEST; default '
                        'TRAIN)')
    parser.add_argument('--memory', default='', metavar='PLAN',
                        help='memory plan: stock (BVLC Caffe 1.0\'s device memory, to compare '
                        'with `caffe time`), arena, shared, offload or auto (default: none '
                        'applied: every blob kept, one cuDNN workspace arena on the GPU)')
    add_device_arguments(parser)
    workers.add_argument(parser)
    precision.add_argument(parser)
    config.add_arguments(parser, 'time', skip=('data_workers',))


def _sync():
    if backend.mode() == backend.GPU:
        import cupy
        cupy.cuda.Device().synchronize()


class _Timer:
    """Caffe's CPU Timer: whole microseconds / whole milliseconds."""

    def start(self):
        _sync()
        self.t0 = time.perf_counter()

    def micro(self):
        _sync()
        return int((time.perf_counter() - self.t0) * 1e6)

    def milli(self):
        _sync()
        return int((time.perf_counter() - self.t0) * 1e3)


def parse_memory(name):
    """The --memory plan name ('' or None: none), checked before the net is built."""
    if not name:
        return None
    from caffeplus.memory.plan import check_plan_name
    return check_plan_name(name.strip().lower())


def _forward_pass(net, timer, per_layer):
    """Net.forward_from_to over the whole net, each layer's forward timed
    (Caffe's time calls Layer::Forward, which reshapes first, as here)."""
    n = len(net.layers)
    plan = net.applied_plan
    if plan is not None:
        plan.before_forward(0, n - 1)
    kernels.begin_pass(net, 0, n - 1)       # fused chains run whole passes only
    before, after = hook_table(net.before_layer_forward), hook_table(net.after_layer_forward)
    for i in range(n):
        call_hooks(before, i)
        timer.start()
        net.layers[i].reshape(net.bottom_vecs[i], net.top_vecs[i])
        net.layers[i].forward(net.bottom_vecs[i], net.top_vecs[i])
        per_layer[i] += timer.micro()
        call_hooks(after, i)
    if plan is not None:
        plan.after_forward(0, n - 1)


def _backward_pass(net, timer, per_layer):
    """Net.backward_from_to over the whole net, each layer's backward timed."""
    n = len(net.layers)
    plan = net.applied_plan
    if plan is not None:
        plan.before_backward(n - 1, 0)
    kernels.begin_pass(net, n - 1, 0, backward=True)
    before, done = hook_table(net.before_layer_backward), hook_table(net.on_layer_backward_done)
    for i in range(n - 1, -1, -1):
        call_hooks(before, i)
        timer.start()
        if net.layer_need_backward[i]:
            net.layers[i].backward(net.top_vecs[i], net.bottom_need_backward[i],
                                   net.bottom_vecs[i])
        per_layer[i] += timer.micro()
        call_hooks(done, i)
    if plan is not None:
        plan.after_backward(n - 1, 0)


def _data_timings(layers):
    """The prefetching data layers' timers (layers/data.py DataTiming), zeroed
    so that they cover the timed iterations: a data layer's forward time is
    what it waited for its batch; these add how long the prefetch thread
    took to read and decode it, and to transform it."""
    timings = [getattr(layer, 'timing', None) for layer in layers]
    timings = [t for t in timings if hasattr(t, 'summary_lines')]
    for t in timings:
        t.reset()
    return timings


# Plans whose convolutions choose algorithms in caffeplus's own workspace;
# `time` then searches as `train` does, so it times what training runs.
TRAINING_SEARCH_PLANS = ('arena', 'shared', 'offload', 'auto')


def run(args):
    with restored_search_setting(), workers.cli_setting(args), config.cli_scope(args):
        return _run(args)


def _run(args):
    from caffeplus.net import Net
    if not args.model:
        raise CaffeplusError('Need a model definition to time (--model).')
    if args.iterations <= 0:
        raise CaffeplusError('--iterations must be positive (got %d)' % args.iterations)
    phase = parse_phase(args.phase, caffe_pb2.TRAIN)
    stages = parse_stages(args.stage)
    plan = parse_memory(args.memory)
    gpus = parse_gpus(args.gpu)
    if gpus and plan in TRAINING_SEARCH_PLANS:
        config.set_command_default('cudnn_search', 'auto')
    use_device(gpus, 'time')
    with precision.setting(args.precision):
        net = Net(args.model, phase, level=args.level, stages=stages, memory=plan)
    if plan:
        log.info('Memory plan: %s', plan)
    log.info('Performing Forward')
    initial_loss = net.forward_prefilled()
    log.info('Initial loss: %g', initial_loss)
    log.info('Performing Backward')
    net.backward_all()

    layers = net.layers
    n = len(layers)
    log.info('*** Benchmark begins ***')
    data_timings = _data_timings(layers)
    log.info('Testing for %d iterations.', args.iterations)
    total_timer, forward_timer, backward_timer, timer = _Timer(), _Timer(), _Timer(), _Timer()
    forward_per_layer = [0] * n
    backward_per_layer = [0] * n
    forward_time = backward_time = 0
    total_timer.start()
    for j in range(args.iterations):
        iter_timer = _Timer()
        iter_timer.start()
        forward_timer.start()
        _forward_pass(net, timer, forward_per_layer)
        forward_time += forward_timer.micro()
        backward_timer.start()
        _backward_pass(net, timer, backward_per_layer)
        backward_time += backward_timer.micro()
        log.info('Iteration: %d forward-backward time: %d ms.', j + 1, iter_timer.milli())
    log.info('Average time per layer: ')
    for i, layer in enumerate(layers):
        name = layer.layer_param.name
        log.info('%10s\tforward: %g ms.', name, forward_per_layer[i] / 1000.0 / args.iterations)
        log.info('%10s\tbackward: %g ms.', name,
                 backward_per_layer[i] / 1000.0 / args.iterations)
    for timing in data_timings:
        for line in timing.summary_lines():
            log.info('%s', line)
    total_ms = total_timer.milli()
    log.info('Average Forward pass: %g ms.', forward_time / 1000.0 / args.iterations)
    log.info('Average Backward pass: %g ms.', backward_time / 1000.0 / args.iterations)
    log.info('Average Forward-Backward: %g ms.', total_ms / args.iterations)
    log.info('Total Time: %g ms.', total_ms)
    log.info('*** Benchmark ends ***')
    return 0
