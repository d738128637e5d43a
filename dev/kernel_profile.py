#!/usr/bin/env python3
"""Device kernels of one training step, caffeplus against PyTorch, in one
process (issue #6: where caffeplus's device time differs from PyTorch's).

    python dev/kernel_profile.py --net alexnettv_b128 --bench-dir benchmarks/nets --tf32
    python dev/kernel_profile.py --net resnet50_b256 --bench-dir .gpu_carry/bench --tf32 \
        --precision fp16 --layouts nchw,nhwcbn    (PyTorch under AMP FP16)

CUPTI (through torch.profiler) records every kernel and copy the process
launches, CuPy's and cuDNN's included, so both frameworks are measured by
the same clock. Prints, per framework, device milliseconds per step by
kernel name (top --top), the total kernel time per step, the step's wall
time between CUDA events, and the gap (wall - kernels: time the device
waited for the host or for a synchronisation).
"""
import argparse
import collections
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _torch_step(torch, net_name, tf32, amp=None):
    from benchmarks.bench_gpu import INPUT_SIZE, TORCH_MODELS, parse_net
    import torchvision
    arch, batch = parse_net(net_name)
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    model = getattr(torchvision.models, TORCH_MODELS[arch])(weights=None).cuda().train()
    size = INPUT_SIZE.get(arch, 224)
    x = torch.randn(batch, 3, size, size, device='cuda')
    y = torch.zeros(batch, dtype=torch.long, device='cuda')
    if amp:
        # AMP as its users run it (bench_gpu's peer): autocast, channels_last,
        # a GradScaler for FP16
        model = model.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    dtype = {'fp16': torch.float16, 'bf16': torch.bfloat16}.get(amp)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler('cuda', enabled=amp == 'fp16')
    lossf = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=False)
        with torch.autocast('cuda', dtype=dtype or torch.float16, enabled=bool(amp)):
            out = model(x)
            if isinstance(out, tuple):
                out = out[0]
            loss = lossf(out, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return step


def _profile(torch, step, steps, top, label):
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    walls = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        walls.append(a.elapsed_time(b))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type.name != 'CUDA':
            continue
        d = by_name[ev.name[:90]]
        d[0] += ev.device_time_total if hasattr(ev, 'device_time_total') else ev.cuda_time_total
        d[1] += 1
    total = sum(v[0] for v in by_name.values()) / 1e3 / steps
    wall = statistics.median(walls)
    print('== %s: wall %.2f ms/step (median of %d, events), kernels %.2f ms/step, gap %.2f ms'
          % (label, wall, steps, total, wall - total))
    for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print('  %7.3f ms  %4.1f/step  %s' % (us / 1e3 / steps, n / steps, name))
    sys.stdout.flush()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--net', default='alexnettv_b128')
    ap.add_argument('--bench-dir', default=os.path.join(ROOT, 'benchmarks', 'nets'))
    ap.add_argument('--tf32', action='store_true')
    ap.add_argument('--steps', type=int, default=20)
    ap.add_argument('--top', type=int, default=25)
    ap.add_argument('--only', choices=('caffeplus', 'pytorch'))
    ap.add_argument('--plans', default='arena', help="caffeplus's plans, comma-separated")
    ap.add_argument('--precision', default=None, choices=('fp16', 'bf16'),
                    help='caffeplus built with the precision switch, PyTorch under AMP')
    ap.add_argument('--layouts', default='nhwc',
                    help="caffeplus's 16-bit map orders, comma-separated: nchw, nhwc, nhwcbn")
    args = ap.parse_args(argv)
    import torch
    torch.zeros(1, device='cuda')
    if args.only != 'pytorch':
        from dev.gpu_host_probe import _build
        for plan in args.plans.split(','):
            for layout in args.layouts.split(','):
                t0 = time.time()
                # stock: Caffe 1.0's heuristic choice under 8 MB; the others timed
                _, step = _build(args.net, args.bench_dir, args.tf32, plan=plan,
                                 search='heuristic' if plan == 'stock' else 'timed',
                                 precision=args.precision, layout=layout)
                print('caffeplus %s set-up %.1f s' % (plan, time.time() - t0))
                _profile(torch, step, args.steps, args.top, 'caffeplus %s %s %s %s tf32=%d' % (
                    plan, args.net, args.precision or 'fp32', layout, args.tf32))
                del step
    if args.only != 'caffeplus':
        step = _torch_step(torch, args.net, args.tf32, args.precision)
        _profile(torch, step, args.steps, args.top, 'pytorch %s %s tf32=%d' % (
            args.net, 'amp-' + args.precision if args.precision else 'fp32', args.tf32))


if __name__ == '__main__':
    main()
