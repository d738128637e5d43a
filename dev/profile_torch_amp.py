#!/usr/bin/env python3
"""Where PyTorch's AMP training iteration spends device time, by kernel
(torch.profiler), on the torchvision model of a bench net: the peer that
benchmarks/bench_gpu.py times, run the same way (autocast, channels_last,
cudnn.benchmark, SGD with momentum, GradScaler for FP16).

    python dev/profile_torch_amp.py --model resnet50 --batch 64 --amp fp16 [--top 25]
"""
import argparse
import sys


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--model', default='resnet50')
    ap.add_argument('--batch', type=int, default=64)
    ap.add_argument('--size', type=int, default=224)
    ap.add_argument('--amp', default='fp16', choices=('fp16', 'bf16'))
    ap.add_argument('--iters', type=int, default=5)
    ap.add_argument('--top', type=int, default=25)
    args = ap.parse_args(argv)
    import torch
    import torchvision
    from torch.profiler import ProfilerActivity, profile
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dtype = torch.float16 if args.amp == 'fp16' else torch.bfloat16
    model = getattr(torchvision.models, args.model)(num_classes=1000).cuda()
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler('cuda', enabled=args.amp == 'fp16')
    x = torch.randn(args.batch, 3, args.size, args.size, device='cuda')
    x = x.to(memory_format=torch.channels_last)
    y = torch.zeros(args.batch, dtype=torch.long, device='cuda')
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast('cuda', dtype=dtype):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        step()
    end.record()
    end.synchronize()
    print('%s b%d AMP %s: %.2f ms/iter' % (args.model, args.batch, args.amp,
                                          start.elapsed_time(end) / args.iters))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by='cuda_time_total', row_limit=args.top,
                                      max_name_column_width=70)
    print(table)
    return 0


if __name__ == '__main__':
    sys.exit(main())
