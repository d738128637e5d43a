#!/usr/bin/env python3
"""Run caffeplus.kernels' CUDA source on the host, one std::thread per CUDA
thread, so the fused GPU layer paths can be tested without a GPU.

    from dev.kernel_emu import Emulator
    emu = Emulator.build()              # g++ -std=c++20; None if it cannot build
    kernels.set_emulator(emu)           # NumPy arrays now stand in for device arrays

Blocks run one after another; the threads of a block run concurrently, with
std::barrier for __syncthreads and a per-warp barrier around each
__shfl_down_sync, so reductions, shared memory and early returns behave as
on the device. __fmul_rn and friends are plain IEEE float operations
(built with -ffp-contract=off, so nothing is fused into an FMA).

Run as a script it builds the emulator and prints the kernels it found.
"""
import ctypes
import hashlib
import os
import re
import subprocess
import sys
import tempfile

import numpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PRELUDE = r'''
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
struct cp_dim3 { unsigned x, y, z; };
struct uint4 { unsigned x, y, z, w; };       /* CUDA's 16-byte vector */
static thread_local cp_dim3 threadIdx;
static cp_dim3 blockIdx, blockDim, gridDim;
static std::barrier<>* cp_block_barrier;
static std::barrier<>* cp_warp_barrier[32];
static double cp_warp_buf[1024];
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
static inline void __syncthreads() { cp_block_barrier->arrive_and_wait(); }
template <class T> static T __shfl_down_sync(unsigned, T v, int o) {
    const unsigned t = threadIdx.x, lane = t & 31, w = t >> 5;
    cp_warp_buf[t] = (double)v;
    cp_warp_barrier[w]->arrive_and_wait();
    T r = (lane + o < 32) ? (T)cp_warp_buf[t + o] : v;
    cp_warp_barrier[w]->arrive_and_wait();
    return r;
}
static unsigned __ballot_sync(unsigned, int p) {
    const unsigned t = threadIdx.x, w = t >> 5;
    cp_warp_buf[t] = p ? 1.0 : 0.0;
    cp_warp_barrier[w]->arrive_and_wait();
    unsigned r = 0;
    for (unsigned l = 0; l < 32; ++l)
        if (cp_warp_buf[(w << 5) + l] != 0.0) r |= 1u << l;
    cp_warp_barrier[w]->arrive_and_wait();
    return r;
}
using std::isfinite;
/* CUDA's __half as cuda_fp16.h declares it: constructible from every
   arithmetic type and convertible to float, so the same expressions are
   ambiguous here as under NVRTC (`c ? half_value : 0.0f`, say); the value
   is g++'s _Float16, which rounds a float to nearest, ties to even. */
struct __half {
    _Float16 h;
    __half() = default;
    __half(float f) : h((_Float16)f) {}
    __half(double f) : h((_Float16)f) {}
    __half(int v) : h((_Float16)v) {}
    __half(unsigned v) : h((_Float16)v) {}
    __half(long long v) : h((_Float16)v) {}
    __half(unsigned long long v) : h((_Float16)v) {}
    __half(short v) : h((_Float16)v) {}
    __half(unsigned short v) : h((_Float16)v) {}
    operator float() const { return (float)h; }
};
static_assert(sizeof(__half) == 2, "__half stands for 16 bits");
/* CUDA's __nv_bfloat16 likewise: the top 16 bits of a float, rounded to
   nearest, ties to even (NaN kept a NaN). */
struct __nv_bfloat16 {
    unsigned short bits;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) {
        unsigned u;
        std::memcpy(&u, &f, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) { bits = (unsigned short)((u >> 16) | 0x40u); return; }
        u += 0x7fffu + ((u >> 16) & 1u);
        bits = (unsigned short)(u >> 16);
    }
    __nv_bfloat16(double f) : __nv_bfloat16((float)f) {}
    __nv_bfloat16(int v) : __nv_bfloat16((float)v) {}
    __nv_bfloat16(unsigned v) : __nv_bfloat16((float)v) {}
    __nv_bfloat16(long long v) : __nv_bfloat16((float)v) {}
    __nv_bfloat16(unsigned long long v) : __nv_bfloat16((float)v) {}
    __nv_bfloat16(short v) : __nv_bfloat16((float)v) {}
    __nv_bfloat16(unsigned short v) : __nv_bfloat16((float)v) {}
    operator float() const {
        const unsigned u = (unsigned)bits << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
};
static_assert(sizeof(__nv_bfloat16) == 2, "__nv_bfloat16 stands for 16 bits");
static inline double __longlong_as_double(long long v) {
    double d;
    std::memcpy(&d, &v, sizeof d);
    return d;
}
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline unsigned __umulhi(unsigned a, unsigned b) {
    return (unsigned)(((unsigned long long)a * b) >> 32);
}
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
/* The device's fast approximations (MUFU lg2/ex2/rcp, a few ulps off) run
   here as the exact functions: tests of kernels using them allow for that.
   (glibc declares a __powf of its own, which it does not export.) */
static inline float cp_emu_powf(float a, float b) { return std::pow(a, b); }
#define __powf cp_emu_powf
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
static inline int min(int a, int b) { return a < b ? a : b; }
template <class... A, class... B>
static void cp_launch(void (*k)(A...), unsigned gx, unsigned bx, B... args) {
    gridDim = {gx, 1, 1};
    blockDim = {bx, 1, 1};
    std::barrier<> bar(bx);
    cp_block_barrier = &bar;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    for (unsigned w = 0; w < (bx + 31) / 32; ++w) {
        warps.emplace_back(new std::barrier<>(32));
        cp_warp_barrier[w] = warps.back().get();
    }
    for (unsigned b = 0; b < gx; ++b) {
        blockIdx = {b, 0, 0};
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < bx; ++t)
            ts.emplace_back([&, t] { threadIdx = {t, 0, 0}; k(args...); });
        for (auto& th : ts) th.join();
    }
}
'''

# CAFFEPLUS_EMU_ASAN=1: build with AddressSanitizer (run Python with
# LD_PRELOAD=$(g++ -print-file-name=libasan.so)) to catch out-of-bounds accesses.
_SANITIZE = ['-fsanitize=address', '-fno-omit-frame-pointer'] \
    if os.environ.get('CAFFEPLUS_EMU_ASAN') else []

_SIG = re.compile(r'extern "C" __global__ (?:__launch_bounds__\([^)]*\) )?void (\w+)\(([^)]*)\)',
                  re.S)
_POINTER_DTYPES = (numpy.float32, numpy.float16, numpy.float64, numpy.int32, numpy.uint32,
                   numpy.uint8, numpy.int64, numpy.uint64)
_POINTER_DTYPE_NAMES = {numpy.dtype(d).name for d in _POINTER_DTYPES} | {'bfloat16'}


def _params(text):
    out = []
    for p in text.split(','):
        p = ' '.join(p.split())
        m = re.match(r'(.*?)(\w+)$', p)
        out.append((m.group(1).strip(), m.group(2)))
    return out


def _ctype(decl):
    if '*' in decl:
        return ctypes.c_void_p
    base = decl.replace('const', '').strip()
    return {'unsigned': ctypes.c_uint, 'int': ctypes.c_int, 'float': ctypes.c_float,
            'long long': ctypes.c_longlong, 'unsigned long long': ctypes.c_ulonglong}[base]


class _Kernel:
    def __init__(self, fn, name, argtypes):
        self.fn, self.name, self.argtypes = fn, name, argtypes

    def __call__(self, grid, block, args, shared_mem=0):
        if len(args) != len(self.argtypes):
            raise TypeError('%s takes %d arguments, %d given' % (self.name, len(self.argtypes),
                                                                  len(args)))
        conv = []
        for a, t in zip(args, self.argtypes):
            if t is ctypes.c_void_p:
                if a is None:
                    conv.append(None)
                    continue
                if not isinstance(a, numpy.ndarray) or a.dtype.name not in _POINTER_DTYPE_NAMES \
                        or not a.flags.c_contiguous:
                    raise TypeError('%s: pointer arguments must be contiguous float32, float16, '
                                    'bfloat16, float64, int32, uint32, uint8, int64 or uint64 arrays '
                                    '(got %r)'
                                    % (self.name, type(a)))
                conv.append(ctypes.c_void_p(a.ctypes.data))
            else:
                if not isinstance(a, numpy.generic):
                    raise TypeError('%s: scalar arguments must be NumPy scalars, as CuPy '
                                    'needs (got %r)' % (self.name, type(a)))
                conv.append(a.item())
        self.fn(int(grid[0]), int(block[0]), *conv)


class Emulator:
    def __init__(self, lib, sigs):
        self.lib = lib
        self.sigs = sigs
        self._kernels = {}

    def kernel(self, name):
        k = self._kernels.get(name)
        if k is None:
            fn = getattr(self.lib, 'emu_' + name)
            argtypes = [_ctype(d) for d, _ in self.sigs[name]]
            fn.argtypes = [ctypes.c_uint, ctypes.c_uint] + argtypes
            fn.restype = None
            k = self._kernels[name] = _Kernel(fn, name, argtypes)
        return k

    @classmethod
    def build(cls, source=None, cache_dir=None):
        """Compile the kernels' source for the host; None if g++ cannot."""
        if source is None:
            from caffeplus import kernels
            source = kernels.SOURCE
        sigs = {m.group(1): _params(m.group(2)) for m in _SIG.finditer(source)}
        wrappers = []
        for name, params in sigs.items():
            decl = ', '.join('%s %s' % (d, n) for d, n in params)
            names = ', '.join(n for _, n in params)
            wrappers.append('extern "C" void emu_%s(unsigned gx, unsigned bx, %s) '
                            '{ cp_launch(%s, gx, bx, %s); }' % (name, decl, name, names))
        code = PRELUDE + source + '\n' + '\n'.join(wrappers) + '\n'
        digest = hashlib.sha1((code + ' '.join(_SANITIZE)).encode()).hexdigest()[:16]
        cache_dir = cache_dir or os.path.join(tempfile.gettempdir(), 'caffeplus_kernel_emu')
        os.makedirs(cache_dir, exist_ok=True)
        so = os.path.join(cache_dir, 'emu_%s.so' % digest)
        if not os.path.exists(so):
            src = os.path.join(cache_dir, 'emu_%s.cpp' % digest)
            with open(src, 'w') as f:
                f.write(code)
            cmd = ['g++', '-std=c++20', '-O1', '-ffp-contract=off', '-fPIC', '-shared',
                   '-pthread', '-Wall', '-Wno-unused-function', '-Wno-unknown-pragmas',
                   '-o', so + '.tmp', src] + _SANITIZE
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired):
                return None
            if p.returncode != 0:
                raise RuntimeError('kernel emulator build failed:\n' + p.stderr[-4000:])
            os.replace(so + '.tmp', so)
        return cls(ctypes.CDLL(so), sigs)


if __name__ == '__main__':
    emu = Emulator.build()
    print('emulator built:', sorted(emu.sigs))
