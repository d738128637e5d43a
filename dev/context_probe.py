"""Where the process's fixed device memory goes (the memory model's RUNTIME_BYTES).

    python dev/context_probe.py [--stack BYTES] [--net NET.prototxt --plan shared]

Prints the device's used memory (cudaMemGetInfo, and nvidia-smi where it
runs) after each stage: the CUDA context, cuBLAS's handle and a GEMM,
cuDNN's handle and a convolution, and, with --net, a training iteration of
`caffeplus memory` minus what CuPy's pool holds. --stack sets the CUDA
per-thread stack limit right after the context exists: the driver reserves
that much local memory for every thread the GPU can hold at once. --heap
sets the device-side malloc heap (CUDA's default 8 MiB) the same way.
"""
import argparse
import subprocess

MiB = 2 ** 20
LIMITS = {'stack': 0, 'printf_fifo': 1, 'malloc_heap': 2}


def smi_used():
    try:
        out = subprocess.run(['nvidia-smi', '--query-gpu=memory.used',
                              '--format=csv,noheader,nounits'],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def report(stage, cupy=None):
    line = '%-28s smi %s MiB' % (stage, smi_used())
    if cupy is not None:
        cupy.cuda.runtime.deviceSynchronize()
        free, total = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool().total_bytes()
        line += '  used %.0f MiB  pool %.0f MiB  outside pool %.0f MiB  stack limit %d' % (
            (total - free) / MiB, pool / MiB, (total - free - pool) / MiB,
            cupy.cuda.runtime.deviceGetLimit(LIMITS['stack']))
    print(line, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--stack', type=int, help='per-thread stack limit in bytes')
    parser.add_argument('--heap', type=int, help='device malloc heap limit in bytes')
    parser.add_argument('--net', help='a training net to run under caffeplus memory -gpu 0')
    parser.add_argument('--plan', default='shared')
    parser.add_argument('--iterations', type=int, default=5)
    args = parser.parse_args()
    report('before CUDA')
    import cupy
    cupy.zeros(1)
    report('context', cupy)
    if args.stack is not None:
        cupy.cuda.runtime.deviceSetLimit(LIMITS['stack'], args.stack)
        report('stack limit set', cupy)
    if args.heap is not None:
        cupy.cuda.runtime.deviceSetLimit(LIMITS['malloc_heap'], args.heap)
        report('malloc heap limit set', cupy)
    for name, limit in sorted(LIMITS.items()):
        print('  limit %-12s %d' % (name, cupy.cuda.runtime.deviceGetLimit(limit)))
    a = cupy.ones((512, 512), dtype=cupy.float32)
    (a @ a).sum()
    report('cuBLAS GEMM', cupy)
    from caffeplus import backend
    backend.set_mode_gpu(0)
    from caffeplus.blob import Blob
    from caffeplus.layer import create_layer
    from caffeplus.proto import caffe_pb2
    param = caffe_pb2.LayerParameter(name='c', type='Convolution')
    param.convolution_param.num_output = 64
    param.convolution_param.kernel_size.append(3)
    bottom, top = Blob((8, 32, 56, 56)), Blob()
    bottom.data[...] = 1
    layer = create_layer(param)
    layer.setup([bottom], [top])
    layer.forward([bottom], [top])
    report('cuDNN convolution (%s)' % type(layer).__name__, cupy)
    top.diff[...] = 1
    layer.backward([top], [True], [bottom])
    report('cuDNN backward', cupy)
    del layer, bottom, top
    cupy.get_default_memory_pool().free_all_blocks()
    report('layer freed', cupy)
    if args.net:
        from caffeplus.cli import main as cli
        cli(['memory', '-model', args.net, '-gpu', '0', '--plans', args.plan,
             '--iterations', str(args.iterations)])
        report('after caffeplus memory', cupy)
        print('  limit stack %d' % cupy.cuda.runtime.deviceGetLimit(LIMITS['stack']))


if __name__ == '__main__':
    main()
