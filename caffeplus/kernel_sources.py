"""The CUDA C source of the fused kernels, which caffeplus.kernels compiles
as two modules (one failing to build leaves the other): COMMON, the helpers
both include; CORE, BatchNorm, Scale, ReLU, Eltwise SUM, Split and zeroing.
The other module's kernels, EXTRA, are in caffeplus.kernel_sources_extra."""

# CUDA's 16-bit map types by NumPy dtype name: (the type, its header). The
# kernels' 16-bit builds (caffeplus.kernels) and the data layer's device
# transform (caffeplus.io.device_transform) write maps in them.
CUDA_SIXTEEN_BIT_TYPES = {'float16': ('__half', 'cuda_fp16.h'),
                          'bfloat16': ('__nv_bfloat16', 'cuda_bf16.h')}

COMMON = r'''
#define CP_FULL_MASK 0xffffffffu
/* The type of the maps (tops and their gradients) the CORE kernels marked
   CP_A read and write (and EXTRA's pooling, SoftmaxWithLoss and BatchNorm
   split kernels): float, or
   __half for the 16-bit build (float math,
   values rounded to nearest on store); also the convolution bias's channel
   sums and cp_accumulate's input. */
#ifndef CP_A
#define CP_A float
#endif
/* v as a map stores it (the identity for float): BatchNorm rounds its
   normalized values once, so the top, the kept copy and the backward's
   recomputed ReLU mask agree. */
#define CP_ROUND(v) ((float)(CP_A)(v))

__device__ __forceinline__ double cp_warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(CP_FULL_MASK, v, o);
    return v;
}

/* Block-wide sums of a and b; every thread gets both totals.
   blockDim.x must be a multiple of 32 (at most 1024). */
__device__ void cp_block_sum2(double* a, double* b, double* sh) {
    const int lane = threadIdx.x & 31;
    const int wid = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5;
    double x = cp_warp_sum(*a);
    double y = cp_warp_sum(*b);
    if (lane == 0) { sh[wid] = x; sh[32 + wid] = y; }
    __syncthreads();
    if (wid == 0) {
        x = lane < nw ? sh[lane] : 0.0;
        y = lane < nw ? sh[32 + lane] : 0.0;
        x = cp_warp_sum(x);
        y = cp_warp_sum(y);
        if (lane == 0) { sh[64] = x; sh[65] = y; }
    }
    __syncthreads();
    *a = sh[64];
    *b = sh[65];
    __syncthreads();
}

/* numpy.maximum(v, 0): NaN and -0.0 pass through. */
__device__ __forceinline__ float cp_relu0(float v) {
    return (v >= 0.0f || v != v) ? v : 0.0f;
}

/* The chain's top from the normalized value: relu(v * s + b). */
__device__ __forceinline__ float cp_chain(float v, float s, float b, int flags) {
    if (flags & 4) v = __fmul_rn(v, s);
    if (flags & 8) v = __fadd_rn(v, b);
    if (flags & 16) v = cp_relu0(v);
    return v;
}

/* y = ca * a + cb * b (each product rounded, then the sum); with relu,
   y = max(that, 0) (Eltwise SUM followed by an in-place ReLU). */
__device__ __forceinline__ float cp_axpby_of(float a, float b, float ca, float cb, int relu) {
    const float t = __fadd_rn(__fmul_rn(ca, a), __fmul_rn(cb, b));
    return relu ? cp_relu0(t) : t;
}

/* BatchNorm's backward, per value: the top diff g masked by the chain's
   ReLU (recomputed from the normalized value v), ... */
__device__ __forceinline__ float cp_bn_masked(float g, float v, float s, float b, int flags) {
    return (flags & 16) ? __fmul_rn(g, cp_chain(v, s, b, flags & 12) > 0.0f ? 1.0f : 0.0f) : g;
}

/* ... and dx from it (flags 1: batch statistics, mdyy and mdy their terms):
   cp_bn_dx_num divided by the deviation sd. */
__device__ __forceinline__ float cp_bn_dx_num(float gg, float v, float s, float mdyy, float mdy,
                                              int flags) {
    if (flags & 4) gg = __fmul_rn(gg, s);
    return (flags & 1) ? __fsub_rn(gg, __fadd_rn(__fmul_rn(v, mdyy), mdy)) : gg;
}

__device__ __forceinline__ float cp_bn_dx(float gg, float v, float s, float sd, float mdyy,
                                          float mdy, int flags) {
    return __fdiv_rn(cp_bn_dx_num(gg, v, s, mdyy, mdy, flags), sd);
}

/* a / b rounded as __fdiv_rn rounds it, given r = __frcp_rn(b) (made once
   per channel): q = a * r and one correction step (Markstein's), exact
   wherever a, the quotient and the step's residual are normal floats
   (tested against NumPy's float32 division across float's range, b up to
   2^60: BatchNorm's deviations). Elsewhere (|a| or |q| under 1e-30, |q|
   past 1e37, zeros, infinities, NaN) it is q itself: the same zeros,
   infinities and NaN, the others within two units in the last place
   (no division kept for those cases: its code in the loop cost more than
   the division it saved). */
__device__ __forceinline__ float cp_div_rcp(float a, float b, float r) {
    const float q = __fmul_rn(a, r);
    const float c = __fmaf_rn(__fmaf_rn(-q, b, a), r, q);
    return (fabsf(q) >= 1.0e-30f && fabsf(q) < 1.0e37f && fabsf(a) >= 1.0e-30f) ? c : q;
}

/* cp_bn_dx given rsd = __frcp_rn(sd): the same value where cp_div_rcp is exact. */
__device__ __forceinline__ float cp_bn_dx_rcp(float gg, float v, float s, float sd, float rsd,
                                              float mdyy, float mdy, int flags) {
    return cp_div_rcp(cp_bn_dx_num(gg, v, s, mdyy, mdy, flags), sd, rsd);
}

/* The elementwise kernels move maps as 16-byte vectors where every pointer
   is 16-byte aligned (CuPy and the memory plans' arenas align blobs to 256
   bytes): one load per 4 floats or 8 16-bit values instead of one per value,
   which 16-bit maps need to reach the memory's bandwidth; a scalar loop
   takes the rest (and misaligned views). */
#define CP_V (16 / (int)sizeof(CP_A))
struct alignas(16) cp_vec { CP_A v[CP_V]; };
__device__ __forceinline__ bool cp_aligned16(const void* p) {
    return ((unsigned long long)p & 15ull) == 0;
}

/* Half a vector, 8 bytes: for the per-channel loops over runs whose length
   is a multiple of CP_H but not of CP_V (ResNet-50's 14 x 14 maps, 196
   values a run, in 16 bits). */
#define CP_H (CP_V / 2)
struct alignas(8) cp_half_vec { CP_A v[CP_H]; };
__device__ __forceinline__ bool cp_aligned8(const void* p) {
    return ((unsigned long long)p & 7ull) == 0;
}

/* W values of a map from p as floats, and back (one 16-byte access for
   W == CP_V, one 8-byte access for W == CP_H; p then aligned to it). */
template <int W> __device__ __forceinline__ void cp_load(const CP_A* p, float* out) {
    if (W == CP_V) {
        const cp_vec a = *(const cp_vec*)p;
        for (int k = 0; k < W; ++k) out[k] = a.v[k];
    } else if (W == CP_H) {
        const cp_half_vec a = *(const cp_half_vec*)p;
        for (int k = 0; k < W; ++k) out[k] = a.v[k];
    } else {
        for (int k = 0; k < W; ++k) out[k] = p[k];
    }
}
template <int W> __device__ __forceinline__ void cp_store(CP_A* p, const float* in) {
    if (W == CP_V) {
        cp_vec a;
        for (int k = 0; k < W; ++k) a.v[k] = in[k];
        *(cp_vec*)p = a;
    } else if (W == CP_H) {
        cp_half_vec a;
        for (int k = 0; k < W; ++k) a.v[k] = in[k];
        *(cp_half_vec*)p = a;
    } else {
        for (int k = 0; k < W; ++k) p[k] = in[k];
    }
}

/* The per-channel kernels (BatchNorm) read a channel of (N, C, S) maps as N
   runs of S values, W at a time: CP_V (one 16-byte load a map) where S is a
   multiple of CP_V and the maps are 16-byte aligned, else CP_H (8 bytes)
   where S is a multiple of CP_H and they are 8-byte aligned, else 1 (the
   scalar loops below). cp_channel_runs hands f(cp_width<W>(), o) the offset
   of each W values in turn over [lo, hi) (multiples of W). */
__device__ __forceinline__ int cp_channel_width(unsigned S, const void* a, const void* b,
                                                const void* c) {
    if (S % CP_V == 0 && cp_aligned16(a) && cp_aligned16(b) && cp_aligned16(c)) return CP_V;
    if (S % CP_H == 0 && cp_aligned8(a) && cp_aligned8(b) && cp_aligned8(c)) return CP_H;
    return 1;
}
template <int W> struct cp_width { static constexpr int value = W; };
template <int W, class F>
__device__ __forceinline__ void cp_channel_vec(unsigned lo, unsigned hi, unsigned S,
                                               unsigned base, unsigned step, F f) {
    const unsigned SV = S / W;
    for (unsigned j = lo / W + threadIdx.x; j < hi / W; j += blockDim.x) {
        const unsigned n = j / SV;
        f(cp_width<W>(), base + n * step + (j - n * SV) * W);
    }
}
template <class F>
__device__ __forceinline__ void cp_channel_runs(int W, unsigned lo, unsigned hi, unsigned S,
                                                unsigned base, unsigned step, F f) {
    if (W == CP_V) cp_channel_vec<CP_V>(lo, hi, S, base, step, f);
    else cp_channel_vec<CP_H>(lo, hi, S, base, step, f);
}

/* Loops over values [lo, hi) of a channel of a (N, C, S)-like layout (all of
   it, or a block's share), U values per thread per step, their loads issued
   before any use (memory-level parallelism; in place the loads of a step
   precede its stores). */
#define CP_U 4
#define CP_RANGE_LOOP(lo, hi, S, base, step, BODY_LOAD, BODY_USE)                \
    for (unsigned i0 = (lo) + threadIdx.x; i0 < (hi); i0 += CP_U * blockDim.x) { \
        unsigned o[CP_U];                                                        \
        bool in[CP_U];                                                           \
        for (int u = 0; u < CP_U; ++u) {                                         \
            const unsigned i = i0 + u * blockDim.x;                              \
            in[u] = i < (hi);                                                    \
            const unsigned n = in[u] ? i / (S) : 0;                              \
            o[u] = (base) + n * (step) + (in[u] ? i - n * (S) : 0);              \
        }                                                                        \
        for (int u = 0; u < CP_U; ++u) if (in[u]) { BODY_LOAD }                  \
        for (int u = 0; u < CP_U; ++u) if (in[u]) { BODY_USE }                   \
    }

/* The same over the channel's M values. */
#define CP_CHANNEL_LOOP(M, S, base, step, BODY_LOAD, BODY_USE)                    \
    CP_RANGE_LOOP(0u, M, S, base, step, BODY_LOAD, BODY_USE)

/* The same over n elements of a flat array, grid-stride. */
#define CP_FLAT_LOOP(n, BODY_LOAD, BODY_USE)                                     \
    for (unsigned i0 = blockIdx.x * blockDim.x + threadIdx.x; i0 < (n);          \
         i0 += CP_U * gridDim.x * blockDim.x) {                                  \
        unsigned o[CP_U];                                                        \
        bool in[CP_U];                                                           \
        for (int u = 0; u < CP_U; ++u) {                                         \
            o[u] = i0 + u * gridDim.x * blockDim.x;                              \
            in[u] = o[u] < (n);                                                  \
        }                                                                        \
        for (int u = 0; u < CP_U; ++u) if (in[u]) { BODY_LOAD }                  \
        for (int u = 0; u < CP_U; ++u) if (in[u]) { BODY_USE }                   \
    }

/* BatchNorm's batch statistics from the shifted sums of a channel's M values,
   a = sum(x - K) and b = sum((x - K)^2), into stat (mean, biased variance);
   with `update`, the moving sums too (Caffe's mean sum, unbiased variance
   sum, and, for channel 0, the scale factor). */
__device__ __forceinline__ void cp_bn_batch_stats(double a, double b, double K, unsigned M,
    unsigned c, bool update, float* b0, float* b1, float* b2, float maf, float corr,
    float* stat)
{
    const double m = (double)M;
    const double dm = a / m;
    double var = b / m - dm * dm;
    if (var < 0.0) var = 0.0;
    const float meanf = (float)(K + dm);
    const float varf = (float)var;
    stat[0] = meanf;
    stat[1] = varf;
    if (update) {
        b0[c] = __fadd_rn(__fmul_rn(b0[c], maf), meanf);
        b1[c] = __fadd_rn(__fmul_rn(b1[c], maf), __fmul_rn(varf, corr));
        if (c == 0) b2[0] = __fadd_rn(__fmul_rn(b2[0], maf), 1.0f);
    }
}

/* BatchNorm's stored statistics into stat: the moving sums over their
   scale factor (0 where the factor is 0). */
__device__ __forceinline__ void cp_bn_stored_stats(unsigned c, const float* b0,
    const float* b1, const float* b2, float* stat)
{
    const float f = b2[0];
    const float scale = f == 0.0f ? 0.0f : 1.0f / f;
    stat[0] = __fmul_rn(b0[c], scale);
    stat[1] = __fmul_rn(b1[c], scale);
}

/* BatchNorm forward's second pass over W values at offset o (the vector
   loop): y and the kept normalized copy, as the scalar loop computes them. */
template <int W>
__device__ __forceinline__ void cp_bn_apply_run(const CP_A* x, CP_A* y, CP_A* xn, unsigned o,
    float mean, float sd, float s, float bb, int flags)
{
    float w[W], t[W];
    cp_load<W>(x + o, w);
    for (int k = 0; k < W; ++k) {
        t[k] = CP_ROUND(__fdiv_rn(__fsub_rn(w[k], mean), sd));
        w[k] = cp_chain(t[k], s, bb, flags);
    }
    if (flags & 2) cp_store<W>(xn + o, t);
    cp_store<W>(y + o, w);
}

/* BatchNorm forward's shifted sums over W values at offset o:
   a += x - K, b += (x - K)^2. */
template <int W>
__device__ __forceinline__ void cp_bn_stats_run(const CP_A* x, unsigned o, double K,
                                                double* a, double* b)
{
    float w[W];
    cp_load<W>(x + o, w);
    for (int k = 0; k < W; ++k) {
        const double d = (double)w[k] - K;
        *a += d;
        *b += d * d;
    }
}

/* BatchNorm backward's sums over W values at offset o: a += g v, b += g. */
template <int W>
__device__ __forceinline__ void cp_bn_sums_run(const CP_A* dy, const CP_A* xn, unsigned o,
    float s, float bb, int flags, double* a, double* b)
{
    float v[W], g[W];
    cp_load<W>(xn + o, v);
    cp_load<W>(dy + o, g);
    for (int k = 0; k < W; ++k) {
        const float gg = cp_bn_masked(g[k], v[k], s, bb, flags);
        *a += (double)gg * (double)v[k];
        *b += (double)gg;
    }
}

/* BatchNorm backward's dx over W values at offset o. */
template <int W>
__device__ __forceinline__ void cp_bn_dx_run(const CP_A* dy, const CP_A* xn, CP_A* dx,
    unsigned o, float s, float bb, float sd, float mdyy, float mdy, int flags)
{
    float v[W], g[W];
    cp_load<W>(xn + o, v);
    cp_load<W>(dy + o, g);
    for (int k = 0; k < W; ++k)
        g[k] = cp_bn_dx(cp_bn_masked(g[k], v[k], s, bb, flags), v[k], s, sd, mdyy, mdy, flags);
    cp_store<W>(dx + o, g);
}

/* BatchNorm's four passes over values [lo, hi) of a channel (all of it, or a
   block's share: cp_bn_fwd and cp_bn_bwd, and EXTRA's split kernels): the
   vector loop of vw values (cp_channel_width) where it is above 1, else the
   scalar loop, each computing what the *_run above computes. */
__device__ __forceinline__ void cp_bn_stats_range(const CP_A* x, int vw, unsigned lo,
    unsigned hi, unsigned S, unsigned base, unsigned step, double K, double* a, double* b)
{
    if (vw > 1) {
        cp_channel_runs(vw, lo, hi, S, base, step, [&](auto w, unsigned o) {
            cp_bn_stats_run<decltype(w)::value>(x, o, K, a, b);
        });
        return;
    }
    float v[CP_U];
    CP_RANGE_LOOP(lo, hi, S, base, step,
        v[u] = x[o[u]];,
        const double d = (double)v[u] - K; *a += d; *b += d * d;)
}

__device__ __forceinline__ void cp_bn_apply_range(const CP_A* x, CP_A* y, CP_A* xn, int vw,
    unsigned lo, unsigned hi, unsigned S, unsigned base, unsigned step,
    float mean, float sd, float s, float bb, int flags)
{
    if (vw > 1) {
        cp_channel_runs(vw, lo, hi, S, base, step, [&](auto w, unsigned o) {
            cp_bn_apply_run<decltype(w)::value>(x, y, xn, o, mean, sd, s, bb, flags);
        });
        return;
    }
    float v[CP_U];
    CP_RANGE_LOOP(lo, hi, S, base, step,
        v[u] = x[o[u]];,
        const float t = CP_ROUND(__fdiv_rn(__fsub_rn(v[u], mean), sd));
        if (flags & 2) xn[o[u]] = t;
        y[o[u]] = cp_chain(t, s, bb, flags);)
}

__device__ __forceinline__ void cp_bn_sums_range(const CP_A* dy, const CP_A* xn, int vw,
    unsigned lo, unsigned hi, unsigned S, unsigned base, unsigned step,
    float s, float bb, int flags, double* a, double* b)
{
    if (vw > 1) {
        cp_channel_runs(vw, lo, hi, S, base, step, [&](auto w, unsigned o) {
            cp_bn_sums_run<decltype(w)::value>(dy, xn, o, s, bb, flags, a, b);
        });
        return;
    }
    float v[CP_U], g[CP_U];
    CP_RANGE_LOOP(lo, hi, S, base, step,
        v[u] = xn[o[u]]; g[u] = dy[o[u]];,
        const float gg = cp_bn_masked(g[u], v[u], s, bb, flags);
        *a += (double)gg * (double)v[u];
        *b += (double)gg;)
}

__device__ __forceinline__ void cp_bn_dx_range(const CP_A* dy, const CP_A* xn, CP_A* dx, int vw,
    unsigned lo, unsigned hi, unsigned S, unsigned base, unsigned step,
    float s, float bb, float sd, float mdyy, float mdy, int flags)
{
    if (vw > 1) {
        cp_channel_runs(vw, lo, hi, S, base, step, [&](auto w, unsigned o) {
            cp_bn_dx_run<decltype(w)::value>(dy, xn, dx, o, s, bb, sd, mdyy, mdy, flags);
        });
        return;
    }
    float v[CP_U], g[CP_U];
    CP_RANGE_LOOP(lo, hi, S, base, step,
        v[u] = xn[o[u]]; g[u] = dy[o[u]];,
        dx[o[u]] = cp_bn_dx(cp_bn_masked(g[u], v[u], s, bb, flags), v[u], s, sd, mdyy, mdy,
                            flags);)
}
'''

# Which of a table's arrays (concatenated at offsets) holds a value: the
# multi-array kernels' lookups, here and in caffeplus/solver/gpu_kernels.py.
ARRAY_LOOKUP = r'''
/* Which of n arrays concatenated at offsets (ascending, offsets[0] = 0)
   holds value w. */
__device__ __forceinline__ int cp_array_of(const long long* offsets, const int n,
                                           const long long w) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (offsets[mid] <= w) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* cp_array_of for the next word of a thread's grid-stride loop, `last`
   the array of its previous word: w only grows, so the array is that one
   or a later one, and most steps stay in it or reach the next: a
   comparison or two instead of a search per word (with which VGG-16's
   zeroing and casting ran at a quarter to a third of the memory's pace). */
__device__ __forceinline__ int cp_array_next(const long long* offsets, const int n,
                                             const long long w, const int last) {
    if (last + 1 >= n || w < offsets[last + 1]) return last;
    if (last + 2 >= n || w < offsets[last + 2]) return last + 1;
    return cp_array_of(offsets, n, w);
}
'''

CORE = r'''
/* BatchNorm forward, one block per channel over x viewed as (N, C, S).
   flags: 1 batch statistics (else the stored ones), 2 keep the normalized
   copy in xn (a map: 16-bit in the 16-bit build), 4 multiply by sc[c],
   8 add bi[c], 16 ReLU (the chain). */
extern "C" __global__ void cp_bn_fwd(
    const CP_A* x, CP_A* y, CP_A* xn, float* b0, float* b1, float* b2, float* stdv,
    const float* sc, const float* bi,
    const unsigned N, const unsigned C, const unsigned S, const int flags,
    const float maf, const float eps, const float corr)
{
    __shared__ double sh[66];
    __shared__ float stat[2];
    const unsigned c = blockIdx.x;
    const unsigned M = N * S;
    const unsigned base = c * S;
    const unsigned step = C * S;
    const int vw = cp_channel_width(S, x, y, (flags & 2) ? xn : nullptr);
    if (flags & 1) {
        const double K = (double)(float)x[base];
        double a = 0.0, b = 0.0;
        cp_bn_stats_range(x, vw, 0, M, S, base, step, K, &a, &b);
        cp_block_sum2(&a, &b, sh);
        if (threadIdx.x == 0)
            cp_bn_batch_stats(a, b, K, M, c, true, b0, b1, b2, maf, corr, stat);
    } else if (threadIdx.x == 0) {
        cp_bn_stored_stats(c, b0, b1, b2, stat);
    }
    __syncthreads();
    const float mean = stat[0];
    const float sd = sqrtf(__fadd_rn(stat[1], eps));
    if (threadIdx.x == 0) stdv[c] = sd;
    const float s = (flags & 4) ? sc[c] : 1.0f;
    const float bb = (flags & 8) ? bi[c] : 0.0f;
    cp_bn_apply_range(x, y, xn, vw, 0, M, S, base, step, mean, sd, s, bb, flags);
}

/* BatchNorm backward, one block per channel. xn: the normalized forward
   output; stdv: the std the forward used.
   flags: 1 batch statistics (else dx = dy / std), 4/8/16 the chain's Scale,
   bias and ReLU (dy is then the ReLU's top diff), 32 accumulate the scale
   gradient into dsc, 64 the bias gradient into dbi, 128 write dx. */
extern "C" __global__ void cp_bn_bwd(
    const CP_A* dy, const CP_A* xn, const float* stdv, CP_A* dx,
    const float* sc, const float* bi, float* dsc, float* dbi,
    const unsigned N, const unsigned C, const unsigned S, const int flags)
{
    __shared__ double sh[66];
    const unsigned c = blockIdx.x;
    const unsigned M = N * S;
    const unsigned base = c * S;
    const unsigned step = C * S;
    const float s = (flags & 4) ? sc[c] : 1.0f;
    const float bb = (flags & 8) ? bi[c] : 0.0f;
    const float sd = stdv[c];
    float mdyy = 0.0f, mdy = 0.0f;
    const int vw = cp_channel_width(S, dy, xn, (flags & 128) ? dx : nullptr);
    if (flags & (1 | 32 | 64)) {
        double a = 0.0, b = 0.0;
        cp_bn_sums_range(dy, xn, vw, 0, M, S, base, step, s, bb, flags, &a, &b);
        cp_block_sum2(&a, &b, sh);
        if (threadIdx.x == 0) {
            if (flags & 32) dsc[c] = __fadd_rn(dsc[c], (float)a);
            if (flags & 64) dbi[c] = __fadd_rn(dbi[c], (float)b);
        }
        /* BatchNorm's own top diff is Scale's bottom diff, g * s. */
        mdyy = (float)((double)s * a / (double)M);
        mdy = (float)((double)s * b / (double)M);
    }
    if (!(flags & 128)) return;
    cp_bn_dx_range(dy, xn, dx, vw, 0, M, S, base, step, s, bb, sd, mdyy, mdy, flags);
}

/* Scale forward: y = x * s[c] (+ b[c]) over (outer, dim, inner), in float32,
   rounded once where the map is 16-bit. flags: 1 keep a copy of x (in the
   maps' type), 2 add the bias. */
extern "C" __global__ void cp_scale_fwd(
    const CP_A* x, CP_A* y, CP_A* keep, const float* sc, const float* bi,
    const unsigned outer, const unsigned dim, const unsigned inner, const int flags)
{
    const unsigned total = outer * dim * inner;
    float v[CP_U];
    CP_FLAT_LOOP(total,
        v[u] = x[o[u]];,
        const unsigned c = (o[u] / inner) % dim;
        if (flags & 1) keep[o[u]] = v[u];           /* exact: v came from the map */
        float r = __fmul_rn(v[u], sc[c]);
        if (flags & 2) r = __fadd_rn(r, bi[c]);
        y[o[u]] = r;)
}

/* Scale backward, one block per channel c of (outer, dim, inner).
   flags: 1 scale gradient sum(dy * x) (2: added to dsc, else written),
   4 bias gradient sum(dy) added to dbi, 8 dx = dy * s. */
extern "C" __global__ void cp_scale_bwd(
    const CP_A* dy, const CP_A* x, const float* sc, CP_A* dx, float* dsc, float* dbi,
    const unsigned outer, const unsigned dim, const unsigned inner, const int flags)
{
    __shared__ double sh[66];
    const unsigned c = blockIdx.x;
    const unsigned M = outer * inner;
    const unsigned base = c * inner;
    const unsigned step = dim * inner;
    float g[CP_U], v[CP_U];
    if (flags & (1 | 4)) {
        double a = 0.0, b = 0.0;
        CP_CHANNEL_LOOP(M, inner, base, step,
            g[u] = dy[o[u]]; v[u] = (flags & 1) ? (float)x[o[u]] : 0.0f;,
            a += (double)g[u] * (double)v[u];
            b += (double)g[u];)
        cp_block_sum2(&a, &b, sh);
        if (threadIdx.x == 0) {
            if (flags & 4) dbi[c] = __fadd_rn(dbi[c], (float)b);
            if (flags & 1) dsc[c] = (flags & 2) ? __fadd_rn(dsc[c], (float)a) : (float)a;
        }
    }
    if (!(flags & 8)) return;
    const float s = sc[c];
    CP_CHANNEL_LOOP(M, inner, base, step,
        g[u] = dy[o[u]];,
        dx[o[u]] = __fmul_rn(g[u], s);)
}

/* ReLU: y = max(x, 0), or x * slope where x <= 0. */
__device__ __forceinline__ float cp_relu_of(float v, float slope) {
    return slope == 0.0f ? cp_relu0(v) : (v > 0.0f ? v : __fmul_rn(v, slope));
}

extern "C" __global__ void cp_relu_fwd(const CP_A* x, CP_A* y, const unsigned n,
                                       const float slope)
{
    const unsigned t0 = blockIdx.x * blockDim.x + threadIdx.x, step = gridDim.x * blockDim.x;
    const unsigned nv = cp_aligned16(x) && cp_aligned16(y) ? n / CP_V : 0;
    for (unsigned i = t0; i < nv; i += step) {
        cp_vec a = ((const cp_vec*)x)[i];
        for (int k = 0; k < CP_V; ++k) a.v[k] = cp_relu_of(a.v[k], slope);
        ((cp_vec*)y)[i] = a;
    }
    for (unsigned i = nv * CP_V + t0; i < n; i += step) y[i] = cp_relu_of(x[i], slope);
}

/* ReLU backward: dx = dy where ref > 0, else dy * slope (0: Caffe's dy * (ref > 0)). */
__device__ __forceinline__ float cp_relu_grad(float g, float r, float slope) {
    return slope == 0.0f ? __fmul_rn(g, r > 0.0f ? 1.0f : 0.0f)
                         : (r > 0.0f ? g : __fmul_rn(g, slope));
}

extern "C" __global__ void cp_relu_bwd(const CP_A* dy, const CP_A* ref, CP_A* dx,
                                       const unsigned n, const float slope)
{
    const unsigned t0 = blockIdx.x * blockDim.x + threadIdx.x, step = gridDim.x * blockDim.x;
    const unsigned nv = cp_aligned16(dy) && cp_aligned16(ref) && cp_aligned16(dx) ? n / CP_V : 0;
    for (unsigned i = t0; i < nv; i += step) {
        cp_vec g = ((const cp_vec*)dy)[i];
        const cp_vec r = ((const cp_vec*)ref)[i];
        for (int k = 0; k < CP_V; ++k) g.v[k] = cp_relu_grad(g.v[k], r.v[k], slope);
        ((cp_vec*)dx)[i] = g;
    }
    for (unsigned i = nv * CP_V + t0; i < n; i += step) dx[i] = cp_relu_grad(dy[i], ref[i], slope);
}

extern "C" __global__ void cp_axpby(const CP_A* a, const CP_A* b, CP_A* y, const unsigned n,
                                    const float ca, const float cb, const int relu)
{
    const unsigned t0 = blockIdx.x * blockDim.x + threadIdx.x, step = gridDim.x * blockDim.x;
    const unsigned nv = cp_aligned16(a) && cp_aligned16(b) && cp_aligned16(y) ? n / CP_V : 0;
    for (unsigned i = t0; i < nv; i += step) {
        cp_vec va = ((const cp_vec*)a)[i];
        const cp_vec vb = ((const cp_vec*)b)[i];
        for (int k = 0; k < CP_V; ++k) va.v[k] = cp_axpby_of(va.v[k], vb.v[k], ca, cb, relu);
        ((cp_vec*)y)[i] = va;
    }
    for (unsigned i = nv * CP_V + t0; i < n; i += step) y[i] = cp_axpby_of(a[i], b[i], ca, cb, relu);
}

/* d0 = c0 * g (flags & 1), d1 = c1 * g (flags & 2); with flags & 4, g is
   first masked by an in-place ReLU's top (g *= (ref > 0), written back).
   16-byte loads where every array it touches is aligned: the scalar loop
   ran at about half the memory's pace (ResNet-50's Eltwise backward). */
__device__ __forceinline__ void cp_store_scaled(CP_A* d, const unsigned i, const float c,
                                                const cp_vec& v) {
    cp_vec o;
    for (int k = 0; k < CP_V; ++k) o.v[k] = __fmul_rn(c, (float)v.v[k]);
    ((cp_vec*)d)[i] = o;
}

/* cp_scale2's work on vector i of the gradient v (g's store: flags & 8). */
__device__ __forceinline__ void cp_scale2_vec(cp_vec v, CP_A* g, CP_A* d0, CP_A* d1,
                                              const CP_A* ref, const unsigned i, const float c0,
                                              const float c1, const int flags) {
    if (flags & 4) {
        const cp_vec r = ((const cp_vec*)ref)[i];
        for (int k = 0; k < CP_V; ++k) v.v[k] = cp_relu_grad(v.v[k], r.v[k], 0.0f);
        if (flags & 8) ((cp_vec*)g)[i] = v;
    }
    if (flags & 1) cp_store_scaled(d0, i, c0, v);
    if (flags & 2) cp_store_scaled(d1, i, c1, v);
}

/* The same for value i, the gradient t. */
__device__ __forceinline__ void cp_scale2_one(float t, CP_A* g, CP_A* d0, CP_A* d1,
                                              const CP_A* ref, const unsigned i, const float c0,
                                              const float c1, const int flags) {
    if (flags & 4) { t = cp_relu_grad(t, ref[i], 0.0f); if (flags & 8) g[i] = t; }
    if (flags & 1) d0[i] = __fmul_rn(c0, t);
    if (flags & 2) d1[i] = __fmul_rn(c1, t);
}

extern "C" __global__ void cp_scale2(CP_A* g, CP_A* d0, CP_A* d1, const CP_A* ref,
                                     const unsigned n, const float c0, const float c1,
                                     const int flags)
{
    const unsigned t0 = blockIdx.x * blockDim.x + threadIdx.x, step = gridDim.x * blockDim.x;
    const bool aligned = cp_aligned16(g) && (!(flags & 4) || cp_aligned16(ref)) &&
        (!(flags & 1) || cp_aligned16(d0)) && (!(flags & 2) || cp_aligned16(d1));
    const unsigned nv = aligned ? n / CP_V : 0;
    for (unsigned i = t0; i < nv; i += step)
        cp_scale2_vec(((const cp_vec*)g)[i], g, d0, d1, ref, i, c0, c1, flags | 8);
    for (unsigned i = nv * CP_V + t0; i < n; i += step)
        cp_scale2_one(g[i], g, d0, d1, ref, i, c0, c1, flags | 8);
}

/* A Split's backward and, in the same pass, the Eltwise SUM -> ReLU's
   before it (a residual block's output: ResNet-50 moved each such map
   eight times, three for the Split's sum and five for cp_scale2, where
   this moves it five): g = a + b, the Split's two top diffs summed as
   cp_axpby sums them and rounded to the map type as its store rounds, then
   cp_scale2's work on g with flags 1, 2 and 4 as its; g itself is stored
   only with flags & 8 (where something reads that diff later). */
extern "C" __global__ void cp_sum_scale2(const CP_A* a, const CP_A* b, CP_A* g, CP_A* d0,
                                         CP_A* d1, const CP_A* ref, const unsigned n,
                                         const float c0, const float c1, const int flags)
{
    const unsigned t0 = blockIdx.x * blockDim.x + threadIdx.x, step = gridDim.x * blockDim.x;
    const bool aligned = cp_aligned16(a) && cp_aligned16(b) && (!(flags & 8) || cp_aligned16(g)) &&
        (!(flags & 4) || cp_aligned16(ref)) && (!(flags & 1) || cp_aligned16(d0)) &&
        (!(flags & 2) || cp_aligned16(d1));
    const unsigned nv = aligned ? n / CP_V : 0;
    for (unsigned i = t0; i < nv; i += step) {
        cp_vec v = ((const cp_vec*)a)[i];
        const cp_vec w = ((const cp_vec*)b)[i];
        for (int k = 0; k < CP_V; ++k) v.v[k] = cp_axpby_of(v.v[k], w.v[k], 1.0f, 1.0f, 0);
        cp_scale2_vec(v, g, d0, d1, ref, i, c0, c1, flags);
    }
    for (unsigned i = nv * CP_V + t0; i < n; i += step)
        cp_scale2_one(CP_ROUND(cp_axpby_of(a[i], b[i], 1.0f, 1.0f, 0)), g, d0, d1, ref, i,
                      c0, c1, flags);
}

''' + ARRAY_LOOKUP + r'''
/* Zero n arrays in one launch: word w of the concatenation lies in array
   k where offsets[k] <= w < offsets[k + 1] (32-bit words: float32 values,
   int32 flags, a float64 guard as two). A launch per array costs the host
   5-20 us each; ResNet-50 clears 161 gradients every iteration. */
extern "C" __global__ void cp_zero_many(const unsigned long long* ptrs,
    const long long* offsets, const int n, const long long total)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    int lo = 0;
    for (long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x; w < total;
         w += stride) {
        lo = cp_array_next(offsets, n, w, lo);
        reinterpret_cast<unsigned*>(ptrs[lo])[w - offsets[lo]] = 0u;
    }
}

/* The 16-bit copies of a net's FP32 weights, all in one launch at the start
   of a forward pass: dst[t][i] = src[t][i] rounded to nearest, value w of
   the concatenation at offsets (as cp_zero_many's) in array t. */
extern "C" __global__ void cp_cast_many(const unsigned long long* src,
    const unsigned long long* dst, const long long* offsets, const int n, const long long total)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    int lo = 0;
    for (long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x; w < total;
         w += stride) {
        lo = cp_array_next(offsets, n, w, lo);
        const long long i = w - offsets[lo];
        reinterpret_cast<CP_A*>(dst[lo])[i] = reinterpret_cast<const float*>(src[lo])[i];
    }
}

/* cp_cast_many into cuDNN's channels-last filter order: array t's source
   holds (K, C, S) float32 values (S = kh kw, Caffe's order), its copy
   (K, S, P), P >= C channels, those past C zero (an image convolution's
   filters padded to 4 channels); cs[t] = C << 40 | P << 20 | S. */
extern "C" __global__ void cp_cast_many_krsc(const unsigned long long* src,
    const unsigned long long* dst, const unsigned long long* cs, const long long* offsets,
    const int n, const long long total)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    int lo = 0;
    for (long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x; w < total;
         w += stride) {
        lo = cp_array_next(offsets, n, w, lo);
        const long long i = w - offsets[lo];
        const long long C = (long long)(cs[lo] >> 40), P = (long long)((cs[lo] >> 20) & 0xfffff),
                        S = (long long)(cs[lo] & 0xfffff);
        const long long c = i % P, t = i / P;
        reinterpret_cast<CP_A*>(dst[lo])[i] = c < C
            ? reinterpret_cast<const float*>(src[lo])[((t / S) * C + c) * S + t % S] : 0.0f;
    }
}
'''
