"""caffeplus's GEMMs on a workspace of ours (for dev/cublas_workspace_probe.py).

    with own_workspace(ptr, nbytes):     # caffeplus.backend.blas's calls run there

Every call of caffeplus.backend.blas inside the block runs on caffeplus's
own cuBLAS handle (made without a pool of its own) on those bytes, as a
memory plan runs an InnerProduct's calls on its arena's bytes
(caffeplus.memory.cublas_pool); the probe measures what that holds and
whether the bits stay.
"""
import contextlib
import functools

from caffeplus.backend import blas


@contextlib.contextmanager
def own_workspace(ptr, nbytes):
    saved = blas.gemm, blas.gemm_strided_batched
    blas.gemm = functools.partial(saved[0], workspace=(int(ptr), int(nbytes)))
    blas.gemm_strided_batched = functools.partial(saved[1], workspace=(int(ptr), int(nbytes)))
    try:
        yield
    finally:
        blas.gemm, blas.gemm_strided_batched = saved
