#!/usr/bin/env python3
"""Does cuBLAS read CUBLAS_WORKSPACE_CONFIG for each handle it makes?

    python dev/cublas_handles_probe.py            # both orders, one process each

caffeplus's own handle (caffeplus.backend.blas.own_handle) is made with
`:0:0` set for the moment; CuPy's, made before or after it, should still
get the pool the environment asks for (`:32768:1` here, as the memory
plans set it). Prints the device memory each handle's creation took.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MiB = 2 ** 20


def _taken(make):
    import cupy
    cupy.cuda.Device().synchronize()
    before = cupy.cuda.runtime.memGetInfo()[0]
    make()
    cupy.cuda.Device().synchronize()
    return (before - cupy.cuda.runtime.memGetInfo()[0]) / MiB


def one(order):
    import cupy
    from caffeplus.backend import blas
    cupy.zeros(1)
    os.environ['CUBLAS_WORKSPACE_CONFIG'] = ':32768:1'
    makers = {'own': blas.own_handle, 'cupy': blas._handle}
    for name in order.split(','):
        print('%s first=%s: %s handle took %.1f MiB'
              % (order, order.split(',')[0], name, _taken(makers[name])))


if __name__ == '__main__':
    if len(sys.argv) > 1:
        one(sys.argv[1])
    else:
        for order in ('own,cupy', 'cupy,own'):
            subprocess.run([sys.executable, __file__, order], check=False)
