#!/usr/bin/env python3
"""GPU training benchmark: caffeplus (memory plans stock, arena, shared) against
PyTorch on the same nets, batch and optimiser.

    python benchmarks/bench_gpu.py --bench-dir tests/data/bench \\
        --nets alexnet_b128,resnet50_b32 --plans stock,arena --torch \\
        --iters 20 --warmup 3 --md benchmarks/gpu_results.md --json out.json

Every measurement runs in its own process (so each peak is that
configuration's alone). One iteration is forward + backward + an SGD
momentum update (lr 0.01, momentum 0.9, no weight decay) on every learnable
parameter: what caffeplus's SGDSolver runs on the GPU (Net.clear_param_diffs,
the loss read once backward is queued, one kernel for every parameter's
update). Plan names: stock and arena (the
workspace plans: every blob in memory of its own), shared, offload and auto
(memory plans, maps sharing memory as under `caffeplus train`), with
':timed' for cuDNN FindEx search and '/generic' for the fused kernels off
(caffeplus.kernels; the generic CuPy layers and a per-parameter update),
'/nographs' for cuDNN calls made directly instead of replayed as CUDA graphs,
'/eager' for the passes run layer by layer (not launched as one CUDA graph:
caffeplus.pass_graph),
'/nogroups' for grouped convolutions without the one-call-per-group
candidates, '/fp16' and '/bf16' for the net in FLOAT16 ('+scaled' with
adaptive loss scaling) and BFLOAT16 ('+nchw' with its convolution maps in
Caffe's order, '+nhwc' channels-last: caffeplus.layout, whose default is
nhwc; '+nhwcbn' with BatchNorm channels-last too, as by default, '+nobn'
without), and '/strict' for true FP32 math
whatever --tf32 says (variants combine with '+':
'arena:timed/nographs+nogroups'). With 16-bit rows the table ends with
issue 37's ratios: speed against PyTorch AMP in the same type and against
the same plan's '/strict' row, peak against AMP's.
caffeplus's data layers (DummyData, refilled on the host each forward as
stock Caffe does) run once before timing and are left out of
the timed iterations, as the stock-Caffe column of the bench README leaves
out its `data` layer. Time: median of --iters iterations after --warmup,
each bracketed by CUDA events. Peak memory: the device's used memory
(total - free, the whole process with its CUDA context, as nvidia-smi
reports) sampled every 5 ms from a thread, plus the framework's own peak
(CuPy pool / torch max_memory_reserved).

PyTorch: torchvision's model of the same architecture, cudnn.benchmark =
True, channels-first float32, constant labels, TF32 off for both frameworks
and then on for both (--tf32 both). With --torch-amp fp16,bf16 also PyTorch's
mixed precision as its users run it: autocast to that type, channels_last
model and input, and for FP16 a GradScaler (dynamic loss scaling); those
rows' plan reads '-/amp-fp16' ('bvlc/amp-bf16' for the BVLC model).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_MODELS = {'alexnet': 'alexnet', 'vgg16': 'vgg16', 'resnet50': 'resnet50',
                'googlenet': 'googlenet', 'alexnettv': 'alexnet'}
# Input side per architecture (default 224). 'alexnettv' is torchvision's
# AlexNet written as a Caffe net (benchmarks/nets/): the same work in both
# frameworks, where BVLC's AlexNet (96 conv1 filters, LRN, groups) does more.
INPUT_SIZE = {'alexnet': 227}
NETS_DIR = os.path.join(ROOT, 'benchmarks', 'nets')


def _kept_prototxt(bench_dir, name):
    """The prototxt `name` in the shared bench folder, else in benchmarks/nets
    (None: in neither)."""
    for folder in (bench_dir, NETS_DIR):
        path = os.path.join(folder, name + '.prototxt')
        if os.path.exists(path):
            return path
    return None


def net_path(bench_dir, net):
    """The bench net's prototxt: the shared bench folder's, else benchmarks/nets'."""
    path = _kept_prototxt(bench_dir, net)
    if path is None:
        raise SystemExit('no prototxt for bench net %r in %s or %s'
                         % (net, bench_dir, NETS_DIR))
    return path


def net_source(bench_dir, net):
    """What caffeplus builds for bench net 'ARCH_bN': its own prototxt, or,
    where none is kept at that batch (issue 37's ResNet-50 b256), another
    batch's of the same architecture with its data layers' batch set to N."""
    path = _kept_prototxt(bench_dir, net)
    if path is not None:
        return path
    arch, batch = parse_net(net)
    for folder in (bench_dir, NETS_DIR):
        found = sorted(f for f in (os.listdir(folder) if os.path.isdir(folder) else ())
                       if f.startswith(arch + '_b') and f.endswith('.prototxt'))
        if found:
            sys.path.insert(0, ROOT)
            from caffeplus.memory.shapes import load_net_param
            param = load_net_param(os.path.join(folder, found[0]), batch=batch)
            param.name = '%s (batch %d)' % (param.name, batch)
            return param
    return net_path(bench_dir, net)         # none: its error


DATA_TYPES = ('DummyData', 'Input', 'Data', 'ImageData', 'HDF5Data', 'MemoryData')
# Plans applied as memory plans (caffeplus.memory.apply); the others are
# workspace plans alone, every blob kept in memory of its own.
REUSING_PLANS = ('shared', 'offload', 'auto')
MiB = 1024 * 1024


class Sampler(threading.Thread):
    """Polls the device's used memory (and an optional extra probe)."""

    def __init__(self, used, extra=None, period=0.005):
        super().__init__(daemon=True)
        self.used, self.extra, self.period = used, extra, period
        self.peak = self.peak_extra = 0
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.sample()
            time.sleep(self.period)

    def sample(self):
        self.peak = max(self.peak, self.used())
        if self.extra is not None:
            self.peak_extra = max(self.peak_extra, self.extra())

    def finish(self):
        self.stop.set()
        self.join()
        self.sample()


def parse_net(name):
    arch, _, b = name.partition('_b')
    return arch, int(b)


# -- workers ------------------------------------------------------------------
def worker_caffeplus(args):
    sys.path.insert(0, ROOT)
    import cupy
    import caffeplus
    from caffeplus.backend import mathmode
    from caffeplus.memory import workspace
    from caffeplus import kernels
    caffeplus.set_mode_gpu(0)
    # 'arena:timed/generic': plan arena, FindEx search, fused kernels off
    # (the generic CuPy layers and a per-parameter update, as before them);
    # '/nographs': cuDNN calls made directly (no CUDA-graph replays);
    # '/nogroups': grouped convolutions never timed one call per group;
    # '/fp16': see below; '/fp16+scaled': with adaptive loss scaling, as
    # the solver runs it and as PyTorch's AMP FP16 runs its GradScaler
    spec, _, variant = args.plan.partition('/')
    plan, _, search = spec.partition(':')
    variants = set(variant.split('+')) if variant else set()
    # '/strict': true FP32 math whatever --tf32 says (the 16-bit rows' own
    # FP32 peer, issue 37's "1.8x caffeplus's FP32").
    strict = 'strict' in variants
    mathmode.set_math_mode('tf32' if args.tf32 and not strict else 'strict')
    generic = 'generic' in variants
    kernels.set_enabled(not generic)
    from caffeplus.cudnn import api
    api.set_graphs('nographs' not in variants)
    if 'nogroups' in variants:
        from caffeplus.cudnn import algo_search
        algo_search.PER_GROUP_SEARCH = False
    if (search or args.search) == 'timed':
        workspace.set_search('timed')
    os.environ.setdefault('GLOG_minloglevel', '2')
    pool = cupy.get_default_memory_pool()

    def used():
        free, total = cupy.cuda.runtime.memGetInfo()
        return total - free
    cupy.zeros(1)
    baseline = used()
    sampler = Sampler(used, pool.total_bytes)
    sampler.start()
    t0 = time.time()
    # '/fp16', '/bf16': the net built with `--precision fp16` or `bf16`
    # (16-bit maps and gradients, FP32 master weights; no loss scaling here
    # unless '+scaled', as no solver)
    from caffeplus import precision
    sixteen = [v for v in ('fp16', 'bf16') if v in variants]
    # '+nchw' / '+nhwc': a 16-bit net's convolution maps in Caffe's order or
    # channels-last (caffeplus.layout; the default is the layout setting's)
    from caffeplus import config
    layout = next((v for v in ('nchw', 'nhwc') if v in variants), config.get('layout'))
    if 'nhwcbn' in variants or 'nobn' in variants:
        # '+nhwcbn': channels-last with BatchNorm and Scale on channels-last
        # maps too (layout.CHANNELS_LAST_BATCHNORM, the default); '+nobn':
        # channels-last but BatchNorm (and the maps around it) in Caffe's order
        from caffeplus import layout as layout_module
        layout_module.CHANNELS_LAST_BATCHNORM = 'nobn' not in variants
        layout = 'nhwc'
    with precision.setting(sixteen[0] if sixteen else None), config.using(layout=layout):
        net = caffeplus.Net(net_source(args.bench_dir, args.net), caffeplus.TRAIN)
    start = 0
    while start < len(net.layers) and net.layers[start].layer_param.type in DATA_TYPES:
        start += 1
    if plan in REUSING_PLANS:
        # A memory plan as `caffeplus train` applies one (its default is
        # `shared`): maps share memory across the iteration. The data
        # layers' tops, filled once below, are kept out of the sharing.
        from caffeplus.memory.apply import apply_named_plan
        tops = sorted({net._blob_names[i] for ids in net.top_id_vecs[:start] for i in ids})
        apply_named_plan(net, plan, keep=tops, training=True,
                         workspace_limit=args.workspace_limit)
    else:
        workspace.apply_workspace_plan(net, plan, args.workspace_limit)
    params = net.learnable_params
    last = len(net.layers) - 1
    if generic:
        hist = [cupy.zeros(p.shape, dtype=cupy.float32) for p in params]
        update = cupy.ElementwiseKernel('float32 g, float32 lr, float32 mom',
                                        'float32 w, float32 h',
                                        'h = mom * h + lr * g; w -= h', 'sgd_momentum')

        def step():
            for p in params:
                p.diff[...] = 0
            net.forward_from_to(start, last)
            net.backward_from_to(last, start)
            for p, h in zip(params, hist):
                update(p.diff, 0.01, 0.9, p.data, h)
    else:
        # What caffeplus's SGDSolver runs on the GPU: memset param diffs, one
        # kernel for every parameter's momentum update (no weight decay here).
        from caffeplus.blob import Blob
        from caffeplus.solver import gpu_kernels
        hist = [Blob(p.shape) for p in params]
        for h in hist:
            h.data[...] = 0
        multi = gpu_kernels.MultiTensorUpdate()
        ones, zeros = [1.0] * len(params), [0.0] * len(params)
        scaler = None
        if 'scaled' in variants:
            # As the solver runs it: the update skips on the scaler's guard,
            # read once the update is queued.
            import types
            holder = types.SimpleNamespace(net=net, iter=0, update_guard=None,
                                           can_guard_update=lambda: True)
            scaler = precision.LossScaler(holder, net.precision,
                                          precision.ADAPTIVE_INITIAL_SCALE, True, 1000)

        # As the solver: the passes launched as one CUDA graph where the net
        # allows (caffeplus.pass_graph), unless '+eager'.
        from caffeplus.pass_graph import PassGraph
        graph = None if 'eager' in variants else PassGraph(net, 'bench net')

        def step():
            if graph is not None and graph.usable():
                loss = graph.run(data=False)
            else:
                net.clear_param_diffs()
                loss = net.forward_from_to(start, last, defer_loss=True)
                net.backward_from_to(last, start)
            # As the solver: the loss read once backward is queued (reading
            # it at the loss layer would leave the GPU idle while the host
            # queues the backward pass).
            float(loss)
            guard = None
            if scaler is not None:
                holder.update_guard = None
                scaler.on_gradients_ready()
                guard = holder.update_guard
            multi.prepare(params, hist, None, ones, zeros)
            multi.run('SGD', 0.01, 1.0, 0.0, False, 0.9, guard=guard)
            if scaler is not None:
                scaler.settle()

    net.forward_prefilled()         # the data layers fill their tops once
    setup_s = time.time() - t0
    times = _time_steps(step, args, cupy_events=True)
    sampler.finish()
    ws = net.workspace.nbytes if net.workspace is not None else sum(
        l._ws.nbytes for l in workspace.workspace_layers(net) if l._ws is not None)
    loss = float(sum(float(cupy.asarray(net._blob_dict[n].data).sum())
                     for n in net.outputs if net._blob_dict[n].count == 1))
    chains = net.__dict__.get('_fused_chains') or []
    algorithms = {}
    for layer in workspace.workspace_layers(net):
        try:
            algorithms[layer.layer_param.name] = {k: repr(c) for k, c in
                                                  layer.algorithms().items()}
        except Exception as exc:    # noqa: BLE001 -- a record, not a measurement
            algorithms[layer.layer_param.name] = str(exc)
    return dict(framework='caffeplus', plan=args.plan, net=args.net,
                tf32=0 if strict else args.tf32,
                graphs=api.graph_stats(), algorithms=algorithms,
                pass_graph=None if generic or graph is None else dict(
                    captures=graph.captures, replays=graph.replays, off=graph.off),
                # (a Convolution -> ReLU chain fuses its forward only)
                fused_chains=sum(1 for c in chains if c.fwd_done and (
                    c.bwd_done or not c.needs_backward)),
                kernel_failures=kernels.failures(),
                search=search or args.search, median_ms=statistics.median(times), times_ms=times,
                peak_used_mib=sampler.peak / MiB, baseline_used_mib=baseline / MiB,
                peak_pool_mib=sampler.peak_extra / MiB, workspace_mib=ws / MiB,
                setup_s=setup_s, loss=loss)


def _time_steps(step, args, cupy_events):
    if cupy_events:
        import cupy
        ev = lambda: cupy.cuda.Event()   # noqa: E731
        sync = cupy.cuda.get_current_stream().synchronize
    else:
        import torch
        ev = lambda: torch.cuda.Event(enable_timing=True)   # noqa: E731
        sync = torch.cuda.synchronize
    for _ in range(args.warmup):
        step()
    sync()
    times = []
    for _ in range(args.iters):
        a, b = ev(), ev()
        a.record()
        step()
        b.record()
        b.synchronize()
        if cupy_events:
            import cupy
            times.append(cupy.cuda.get_elapsed_time(a, b))
        else:
            times.append(a.elapsed_time(b))
    return times


# Architectures with a PyTorch model of BVLC's own form (bvlc_torch_model).
BVLC_TORCH_ARCHS = ('alexnet',)


def bvlc_torch_model(torch, arch):
    """BVLC's own AlexNet in PyTorch (96 conv1 filters, LRN, two groups in
    conv2/4/5), the same work as the bench prototxt: torchvision's AlexNet
    (64 filters, no LRN, no groups) does less. Only AlexNet is offered."""
    if arch not in BVLC_TORCH_ARCHS:
        raise SystemExit('--torch-models bvlc: only alexnet has a BVLC model here')
    nn = torch.nn

    def lrn():
        return nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=1.0)
    return nn.Sequential(
        nn.Conv2d(3, 96, 11, stride=4), nn.ReLU(inplace=True), lrn(), nn.MaxPool2d(3, 2),
        nn.Conv2d(96, 256, 5, padding=2, groups=2), nn.ReLU(inplace=True), lrn(),
        nn.MaxPool2d(3, 2),
        nn.Conv2d(256, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 384, 3, padding=1, groups=2), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, 3, padding=1, groups=2), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2), nn.Flatten(),
        nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, 1000))


def torch_plans(net, models, amps, plain=True):
    """The PyTorch rows of bench net `net`: for each model variant of
    `models` ('torchvision', 'bvlc'; comma-separated) its plain row (unless
    not `plain`) and one AMP row per type of `amps` ('fp16,bf16'). 'bvlc' is
    skipped where the architecture has no model of BVLC's form
    (torchvision's is its peer)."""
    plans = []
    for variant in models.split(','):
        if variant == 'bvlc' and parse_net(net)[0] not in BVLC_TORCH_ARCHS:
            continue
        base = '-' if variant == 'torchvision' else variant
        if plain:
            plans.append(base)
        plans += ['%s/amp-%s' % (base, amp) for amp in filter(None, amps.split(','))]
    return plans


def worker_torch(args):
    import torch
    import torchvision
    arch, batch = parse_net(args.net)
    variant, _, amp = args.plan.partition('/amp-')
    amp_dtype = {'': None, 'fp16': torch.float16, 'bf16': torch.bfloat16}[amp]
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
    torch.backends.cudnn.allow_tf32 = bool(args.tf32)
    dev = torch.device('cuda')

    def used():
        free, total = torch.cuda.mem_get_info()
        return total - free
    torch.zeros(1, device=dev)
    baseline = used()
    sampler = Sampler(used, torch.cuda.memory_reserved)
    sampler.start()
    kw = {'weights': None}
    if arch == 'googlenet':
        kw.update(aux_logits=True, init_weights=True)
    if variant == 'bvlc':
        model = bvlc_torch_model(torch, arch).to(dev).train()
    else:
        model = getattr(torchvision.models, TORCH_MODELS[arch])(**kw).to(dev).train()
    size = INPUT_SIZE.get(arch, 224)
    x = torch.randn(batch, 3, size, size, device=dev)
    y = torch.zeros(batch, dtype=torch.long, device=dev)
    if amp_dtype is not None:
        model = model.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lossf = torch.nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler('cuda') if amp_dtype is torch.float16 else None

    def forward_loss():
        out = model(x)
        if isinstance(out, tuple):         # GoogLeNet: logits, aux2, aux1 (weights 1, .3, .3)
            return lossf(out[0], y) + 0.3 * lossf(out[1], y) + 0.3 * lossf(out[2], y)
        return lossf(out, y)

    def step():
        opt.zero_grad(set_to_none=False)
        if amp_dtype is None:
            forward_loss().backward()
            opt.step()
            return
        with torch.autocast('cuda', dtype=amp_dtype):
            loss = forward_loss()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    times = _time_steps(step, args, cupy_events=False)
    sampler.finish()
    return dict(framework='pytorch', plan=args.plan,
                net=args.net, tf32=args.tf32, search='benchmark',
                median_ms=statistics.median(times), times_ms=times,
                peak_used_mib=sampler.peak / MiB, baseline_used_mib=baseline / MiB,
                peak_pool_mib=torch.cuda.max_memory_reserved() / MiB,
                peak_allocated_mib=torch.cuda.max_memory_allocated() / MiB)


# -- driver -------------------------------------------------------------------
def run_worker(kind, net, args, plan='-', tf32=0):
    cmd = [sys.executable, os.path.abspath(__file__), '--worker', kind, '--net', net,
           '--plan=' + plan, '--tf32', 'on' if tf32 else 'off', '--iters', str(args.iters),
           '--warmup', str(args.warmup), '--bench-dir', args.bench_dir,
           '--search', args.search, '--workspace-limit', str(args.workspace_limit)]
    env = dict(os.environ, GLOG_minloglevel='2', PYTHONUNBUFFERED='1')
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(framework=kind, net=net, plan=plan, tf32=tf32, error='timeout after %ds'
                    % args.timeout)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith('{'):
            r = json.loads(line)
            r['wall_s'] = time.time() - t0
            return r
    return dict(framework=kind, net=net, plan=plan, tf32=tf32,
                error=(p.stderr or p.stdout)[-1500:])


def _commit():
    """The snapshot's commit (dev/gpu_snapshot.sh writes COMMIT), else git's."""
    try:
        with open(os.path.join(ROOT, 'COMMIT')) as f:
            return f.read().strip()
    except OSError:
        pass
    try:
        return subprocess.run(['git', '-C', ROOT, 'rev-parse', '--short', 'HEAD'],
                              capture_output=True, text=True, timeout=10).stdout.strip() or \
            'unknown'
    except (OSError, subprocess.SubprocessError):
        return 'unknown'


def gpu_name():
    try:
        return subprocess.run(['nvidia-smi', '--query-gpu=name,driver_version',
                               '--format=csv,noheader'], capture_output=True, text=True,
                              timeout=20).stdout.strip()
    except Exception:
        return 'unknown'


def markdown(results, args):
    lines = ['## %s, %s, commit %s' % (time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
                                       gpu_name(), os.environ.get('CAFFEPLUS_COMMIT') or _commit()),
             '',
             'One iteration = forward + backward + SGD momentum; median of %d after %d warm-up; '
             'caffeplus without its data layers; algorithm search: %s (a plan named ":timed": '
             'timed). Peak = device memory used '
             '(whole process, incl. CUDA context), sampled every 5 ms.' % (args.iters, args.warmup,
                                                                         args.search),
             '',
             '| net | framework | plan | TF32 | ms/iter | images/s | peak used MiB | '
             'pool/reserved MiB | workspace MiB | vs PyTorch time | vs PyTorch memory |',
             '|---|---|---|---|---|---|---|---|---|---|---|']
    torch_ref = {(r['net'], r['tf32']): r for r in results
                 if r.get('framework') == 'pytorch' and r.get('plan', '-') == '-' and
                 'error' not in r}
    for r in results:
        if 'error' in r:
            lines.append('| %s | %s | %s | %s | error: %s | | | | | | |' % (
                r['net'], r['framework'], r.get('plan', '-'), 'on' if r.get('tf32') else 'off',
                r['error'].strip().splitlines()[-1][:160] if r['error'].strip() else '?'))
            continue
        batch = parse_net(r['net'])[1]
        t = torch_ref.get((r['net'], r['tf32']))
        rt = '%.2fx' % (r['median_ms'] / t['median_ms']) if t and r['framework'] != 'pytorch' else ''
        rm = '%.2fx' % (r['peak_used_mib'] / t['peak_used_mib']) \
            if t and r['framework'] != 'pytorch' else ''
        lines.append('| %s | %s | %s | %s | %.1f | %.0f | %.0f | %.0f | %s | %s | %s |' % (
            r['net'], r['framework'], r['plan'], 'on' if r['tf32'] else 'off', r['median_ms'],
            batch * 1000.0 / r['median_ms'], r['peak_used_mib'], r['peak_pool_mib'],
            '%.1f' % r['workspace_mib'] if 'workspace_mib' in r else '-', rt, rm))
    return '\n'.join(lines + sixteen_bit_targets(results)) + '\n'


def amp_peers(rows):
    """{(net, 'fp16'|'bf16'): PyTorch's AMP row} of the runs' rows: each
    net's peer of the same architecture, BVLC's AlexNet (LRN, groups)
    against the PyTorch model of BVLC's ('bvlc/amp-fp16') where the run has
    one, else torchvision's model ('-/amp-fp16')."""
    amp = {}
    for r in rows:
        for kind in ('fp16', 'bf16'):
            if r['framework'] == 'pytorch' and r.get('plan', '').endswith('/amp-' + kind):
                if r['plan'].startswith('bvlc') or (r['net'], kind) not in amp:
                    amp[r['net'], kind] = r
    return amp


def caffeplus_row(rows, net, plan, tf32=None):
    """caffeplus's row of `net` under `plan` (with TF32 on or off where
    `tf32` says), or None."""
    return next((r for r in rows if r['framework'] == 'caffeplus' and r['net'] == net and
                 r['plan'] == plan and (tf32 is None or bool(r.get('tf32')) == tf32)), None)


def sixteen_bit_targets(results):
    """Issue 37's ratios for each caffeplus 16-bit row ('/fp16', '/bf16'):
    its speed against PyTorch AMP in the same type on the same architecture
    and against caffeplus's own '/strict' FP32 row of the same plan (and
    its TF32 row, the plan with no variant, where the run has one), its
    peak against AMP's; all measured in this run."""
    ok = [r for r in results if 'error' not in r]
    amp = amp_peers(ok)
    rows = []
    for r in ok:
        variants = r['plan'].partition('/')[2].split('+') if r['framework'] == 'caffeplus' \
            else []
        kind = next((k for k in ('fp16', 'bf16') if k in variants), None)
        if kind is None:
            continue
        base = r['plan'].partition('/')[0]
        fp32 = caffeplus_row(ok, r['net'], base + '/strict')
        tf32 = caffeplus_row(ok, r['net'], base, tf32=True)
        a = amp.get((r['net'], kind))
        rows.append('| %s | %s | %.1f | %s | %s | %s | %s | %s | %s | %s | %s |' % (
            r['net'], r['plan'], r['median_ms'], a['plan'] if a else '-',
            '%.1f' % a['median_ms'] if a else '-',
            '%.2fx' % (a['median_ms'] / r['median_ms']) if a else '-',
            '%.1f' % fp32['median_ms'] if fp32 else '-',
            '%.2fx' % (fp32['median_ms'] / r['median_ms']) if fp32 else '-',
            '%.1f' % tf32['median_ms'] if tf32 else '-',
            '%.2fx' % (tf32['median_ms'] / r['median_ms']) if tf32 else '-',
            '%.2fx' % (r['peak_used_mib'] / a['peak_used_mib']) if a else '-'))
    if not rows:
        return []
    return ['', '16-bit targets (issue 37: speed >= 1.1x AMP of the same type and >= 1.8x '
            'caffeplus FP32, peak <= 0.6x AMP):', '',
            '| net | plan | ms/iter | AMP peer | AMP ms | speed vs AMP | caffeplus FP32 ms | '
            'speed vs FP32 | caffeplus TF32 ms | speed vs TF32 | peak vs AMP |',
            '|---|---|---|---|---|---|---|---|---|---|---|'] + rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--bench-dir', default=os.path.join(ROOT, 'tests', 'data', 'bench'))
    ap.add_argument('--nets', default='alexnet_b128,resnet50_b32')
    ap.add_argument('--plans', default='stock,arena')
    ap.add_argument('--torch', action='store_true', help='measure PyTorch in the same run')
    ap.add_argument('--torch-models', default='torchvision',
                    help="PyTorch peers: torchvision (the issue's peer), bvlc (AlexNet as BVLC "
                         "defines it: same work as the prototxt), or both, separated by ','")
    ap.add_argument('--torch-amp', default='',
                    help="also PyTorch AMP runs: fp16, bf16 or both, separated by ','")
    ap.add_argument('--torch-plain', default='on', choices=('on', 'off'),
                    help="PyTorch's rows without AMP too (off: only the --torch-amp rows)")
    ap.add_argument('--tf32', default='off', choices=('off', 'on', 'both'))
    ap.add_argument('--iters', type=int, default=20)
    ap.add_argument('--warmup', type=int, default=3)
    ap.add_argument('--search', default='heuristic', choices=('heuristic', 'timed'))
    ap.add_argument('--workspace-limit', type=int, default=0)
    ap.add_argument('--timeout', type=int, default=300)
    ap.add_argument('--json', default=None)
    ap.add_argument('--md', default=None, help='append the table to this markdown file')
    # worker mode
    ap.add_argument('--worker', default=None, choices=('caffeplus', 'pytorch'))
    ap.add_argument('--net', default=None)
    ap.add_argument('--plan', default='arena')
    args = ap.parse_args(argv)
    if args.worker:
        args.tf32 = 1 if args.tf32 == 'on' else 0
        r = worker_caffeplus(args) if args.worker == 'caffeplus' else worker_torch(args)
        print(json.dumps(r))
        return 0
    tf32s = {'off': [0], 'on': [1], 'both': [0, 1]}[args.tf32]
    results = []
    for tf32 in tf32s:
        for net in args.nets.split(','):
            runs = [('caffeplus', p) for p in args.plans.split(',')]
            if args.torch:
                runs += [('pytorch', plan) for plan in
                         torch_plans(net, args.torch_models, args.torch_amp,
                                     args.torch_plain == 'on')]
            for kind, plan in runs:
                r = run_worker(kind, net, args, plan, tf32)
                results.append(r)
                if 'error' in r:
                    print('%-14s %-9s %-6s tf32=%d ERROR %s' % (net, kind, plan, tf32,
                                                                 r['error'][-600:]), flush=True)
                else:
                    print('%-14s %-9s %-6s tf32=%d %8.1f ms  peak %7.0f MiB  ws %s%s' % (
                        net, kind, plan, tf32, r['median_ms'], r['peak_used_mib'],
                        '%.1f MiB' % r['workspace_mib'] if 'workspace_mib' in r else '-',
                        '  chains %d' % r['fused_chains'] if 'fused_chains' in r else ''),
                        flush=True)
                    if r.get('kernel_failures'):
                        print('  kernel failures:', r['kernel_failures'][:3], flush=True)
    table = markdown(results, args)
    print(table)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(results, f, indent=1)
    if args.md:
        with open(args.md, 'a') as f:
            f.write('\n' + table)
    return 0


if __name__ == '__main__':
    sys.exit(main())
