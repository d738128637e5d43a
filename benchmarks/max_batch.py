#!/usr/bin/env python3
"""The largest batch a net trains at within a memory budget: caffeplus's
`auto` plan against PyTorch's default allocator (the memory issue's
"largest VGG-16 batch on the 80 GB card" comparison).

    python3 benchmarks/max_batch.py --model tests/data/bench/vgg16_b64.prototxt --budget 78G
    python3 benchmarks/max_batch.py --model .gpu_carry/bench/vgg16_b64.prototxt --gpu 0 --torch vgg16

Without --gpu: the planner's estimate only (binary search on the batch for
the largest whose `auto` plan fits --budget). With --gpu: that batch is then
trained for real (`caffeplus memory -gpu --plans auto`, one process per
try), stepping down until a measured run fits. --torch ARCH: the largest
batch torchvision's ARCH trains at (SGD with momentum, one process per try,
until CUDA runs out of memory). Prints both and their ratio.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
STEP = 16


def fits_estimate(model, batch, budget, host_budget=None):
    """The auto plan's estimated peak for `batch` (offloading at most
    `host_budget` bytes to pinned host memory), or None when none fits."""
    from caffeplus.errors import CaffeplusError
    from caffeplus.memory import budget as budget_mod, shapes
    with shapes.quiet():
        net = shapes.build_net(shapes.load_net_param(model, batch=batch))
        try:
            return budget_mod.plan_for_budget(net, budget, host_budget=host_budget).peak_bytes
        except CaffeplusError:
            return None


def largest(fits, low, high):
    """Largest multiple of STEP in [low, high] for which fits(batch) holds
    (fits must be monotone); 0 when none does."""
    lo, hi = 0, high // STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * STEP):
            lo = mid
        else:
            hi = mid - 1
    return lo * STEP if lo * STEP >= low else 0


def measured_fits(model, batch, budget, gpu, timeout, host_budget=None):
    """The measured peak of one `auto` training iteration at `batch`, or None
    if it failed or timed out."""
    cmd = [sys.executable, '-m', 'caffeplus', 'memory', '-model', model, '-gpu', str(gpu),
           '--plans', 'auto', '--budget', str(budget), '--batch', str(batch),
           '--iterations', '1', '--json'] + \
        (['--host-budget', str(host_budget)] if host_budget else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print('    timed out after %d s' % timeout)
        return None
    try:
        entry = json.loads(p.stdout)['plans']['auto']
    except (ValueError, KeyError):
        print('    no result (exit %d): %s' % (p.returncode, p.stderr.strip()[-400:]))
        return None
    if 'measure_error' in entry:
        print('    failed: %s' % entry['measure_error'].strip()[-400:])
        return None
    return entry['peak_bytes']


TORCH_STEP = r'''
import sys, torch, torchvision
arch, batch = sys.argv[1], int(sys.argv[2])
torch.backends.cudnn.benchmark = True
model = getattr(torchvision.models, arch)(weights=None).cuda().train()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(batch, 3, 224, 224, device='cuda')
y = torch.zeros(batch, dtype=torch.long, device='cuda')
for _ in range(2):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
torch.cuda.synchronize()
print('peak', torch.cuda.max_memory_allocated())
'''


def torch_fits(arch, batch, timeout):
    try:
        p = subprocess.run([sys.executable, '-c', TORCH_STEP, arch, str(batch)],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return p.returncode == 0 and 'peak' in p.stdout


def main(argv=None):
    from caffeplus.memory.budget import format_bytes, parse_bytes
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--model', required=True)
    ap.add_argument('--budget', default='78G')
    ap.add_argument('--max-batch', type=int, default=8192)
    ap.add_argument('--host-budget', default=None,
                    help='pinned host memory to offload to (default: 75%% of this '
                         "machine's memory with --gpu, no limit without)")
    ap.add_argument('--gpu', type=int, default=None)
    ap.add_argument('--torch', default=None, help='torchvision architecture, e.g. vgg16')
    ap.add_argument('--timeout', type=int, default=240)
    ap.add_argument('--json', default=None)
    args = ap.parse_args(argv)
    from caffeplus.memory.budget import default_host_budget
    budget = parse_bytes(args.budget)
    host = parse_bytes(args.host_budget) if args.host_budget else \
        (default_host_budget() if args.gpu is not None else None)
    est = largest(lambda b: fits_estimate(args.model, b, budget, host) is not None, STEP,
                  args.max_batch)
    print('caffeplus auto, estimate: largest batch %d within %s' % (est, format_bytes(budget)))
    result = {'budget': budget, 'host_budget': host, 'estimated_batch': est}
    if args.gpu is not None and est:
        batch, tries = est, []
        while batch >= STEP:
            peak = measured_fits(args.model, batch, budget, args.gpu, args.timeout, host)
            tries.append((batch, peak))
            print('  batch %d: measured peak %s' % (batch, format_bytes(peak) if peak else
                                                       'none (failed or timed out)'), flush=True)
            if peak is not None and peak <= budget:
                break
            # Over budget: scale the batch down by the overshoot (each try
            # is minutes at these batches); failed: an eighth down.
            shrink = int(batch * budget / peak) if peak else batch - max(batch // 8, STEP)
            batch = min(batch - STEP, shrink // STEP * STEP)
        result['measured_batch'] = max(batch, 0)
        result['measured_tries'] = tries
        print('caffeplus auto, measured: largest batch %d' % max(batch, 0))
    if args.torch:
        tb = largest(lambda b: torch_fits(args.torch, b, args.timeout), STEP, args.max_batch)
        result['torch_batch'] = tb
        print('PyTorch %s: largest batch %d' % (args.torch, tb))
        ours = result.get('measured_batch', est)
        if tb:
            print('ratio: %.2fx (target >= 4x)' % (ours / float(tb)))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
