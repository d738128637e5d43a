"""The CUDA C source of BatchNorm's channels-last kernels (caffeplus.layout):
caffeplus.kernels' third module, built after COMMON and EXTRA, whose
helpers (cp_share, cp_block_sum2, cp_load, the per-value operations) they
use. A module of their own: they run only where layout.CHANNELS_LAST_BATCHNORM
is on, and a failure to build them leaves the other modules' kernels."""

CHANNELS_LAST_BATCHNORM = r'''
/* BatchNorm over channels-last maps (M rows of C values), the split
   kernels' work regrouped. A block of 32 * R threads covers 32 channels
   (a warp: one row's 32 consecutive values) and R rows at a time; the 1-D
   grid is (ceil(C / 32) channel tiles) x (row chunks). The sums' blocks
   each take a share of the rows and leave double partials at
   part[2 (c P + p)] as the split kernels keep them; a block per channel
   then adds a channel's partials; the per-value passes walk their rows.
   Every per-value operation is cp_bn_fwd's and cp_bn_bwd's (cp_chain,
   cp_bn_masked, cp_bn_dx); flags as theirs. */
__device__ __forceinline__ void cp_nhwc_tile(unsigned C, unsigned* c, unsigned* chunk,
                                             unsigned* chunks, unsigned* row, unsigned* rows)
{
    const unsigned T = (C + 31) / 32;
    *c = (blockIdx.x % T) * 32 + (threadIdx.x & 31);
    *chunk = blockIdx.x / T;
    *chunks = gridDim.x / T;
    *row = threadIdx.x >> 5;
    *rows = blockDim.x >> 5;
}

/* The R row lanes' sums of each channel added (lane 0 of the tile keeps them). */
__device__ __forceinline__ void cp_nhwc_lanes_sum(double* a, double* b, double* sh)
{
    sh[threadIdx.x] = *a;
    sh[blockDim.x + threadIdx.x] = *b;
    __syncthreads();
    if ((threadIdx.x >> 5) == 0)
        for (unsigned k = 32 + threadIdx.x; k < blockDim.x; k += 32) {
            *a += sh[k];
            *b += sh[blockDim.x + k];
        }
}

extern "C" __global__ void cp_bn_stats_part_nhwc(const CP_A* x, double* part, float* kv,
    const unsigned M, const unsigned C, const unsigned P)
{
    __shared__ double sh[2 * 1024];
    unsigned c, p, np, row, rows;
    cp_nhwc_tile(C, &c, &p, &np, &row, &rows);
    unsigned lo, hi;
    cp_share(M, p, P, &lo, &hi);
    double a = 0.0, b = 0.0;
    if (c < C) {
        const double K = (double)(float)x[c];
        for (unsigned r = lo + row; r < hi; r += rows) {
            const double d = (double)(float)x[(unsigned long long)r * C + c] - K;
            a += d;
            b += d * d;
        }
    }
    cp_nhwc_lanes_sum(&a, &b, sh);
    if (row == 0 && c < C) {
        part[2 * (c * P + p)] = a;
        part[2 * (c * P + p) + 1] = b;
        if (p == 0) kv[c] = x[c];
    }
}

/* A channel's mean (ms[c]) and std (stdv[c]), one block per channel: the
   batch's from the partials (the moving sums updated), or the stored ones. */
extern "C" __global__ void cp_bn_stats_nhwc(const double* part, const float* kv, float* b0,
    float* b1, float* b2, float* stdv, float* ms, const unsigned M, const unsigned C,
    const unsigned P, const int flags, const float maf, const float eps, const float corr)
{
    __shared__ double sh[66];
    __shared__ float stat[2];
    const unsigned c = blockIdx.x;
    if (flags & 1) {
        double a = 0.0, b = 0.0;
        for (unsigned q = threadIdx.x; q < P; q += blockDim.x) {
            a += part[2 * (c * P + q)];
            b += part[2 * (c * P + q) + 1];
        }
        cp_block_sum2(&a, &b, sh);
        if (threadIdx.x == 0)
            cp_bn_batch_stats(a, b, (double)kv[c], M, c, true, b0, b1, b2, maf, corr, stat);
    } else if (threadIdx.x == 0) {
        cp_bn_stored_stats(c, b0, b1, b2, stat);
    }
    if (threadIdx.x == 0) {
        ms[c] = stat[0];
        stdv[c] = sqrtf(__fadd_rn(stat[1], eps));
    }
}

extern "C" __global__ void cp_bn_apply_nhwc(const CP_A* x, CP_A* y, CP_A* xn,
    const float* ms, const float* stdv, const float* sc, const float* bi,
    const unsigned M, const unsigned C, const int flags)
{
    unsigned c, chunk, chunks, row, rows;
    cp_nhwc_tile(C, &c, &chunk, &chunks, &row, &rows);
    if (c >= C) return;
    const float s = (flags & 4) ? sc[c] : 1.0f;
    const float bb = (flags & 8) ? bi[c] : 0.0f;
    const float mean = ms[c], sd = stdv[c];
    for (unsigned r = chunk * rows + row; r < M; r += chunks * rows) {
        const unsigned long long i = (unsigned long long)r * C + c;
        const float t = CP_ROUND(__fdiv_rn(__fsub_rn((float)x[i], mean), sd));
        if (flags & 2) xn[i] = t;
        y[i] = cp_chain(t, s, bb, flags);
    }
}

extern "C" __global__ void cp_bn_bwd_part_nhwc(const CP_A* dy, const CP_A* xn,
    const float* sc, const float* bi, double* part, const unsigned M, const unsigned C,
    const unsigned P, const int flags)
{
    __shared__ double sh[2 * 1024];
    unsigned c, p, np, row, rows;
    cp_nhwc_tile(C, &c, &p, &np, &row, &rows);
    unsigned lo, hi;
    cp_share(M, p, P, &lo, &hi);
    double a = 0.0, b = 0.0;
    if (c < C) {
        const float s = (flags & 4) ? sc[c] : 1.0f;
        const float bb = (flags & 8) ? bi[c] : 0.0f;
        for (unsigned r = lo + row; r < hi; r += rows) {
            const unsigned long long o = (unsigned long long)r * C + c;
            const float v = xn[o];
            const float gg = cp_bn_masked(dy[o], v, s, bb, flags);
            a += (double)gg * (double)v;
            b += (double)gg;
        }
    }
    cp_nhwc_lanes_sum(&a, &b, sh);
    if (row == 0 && c < C) {
        part[2 * (c * P + p)] = a;
        part[2 * (c * P + p) + 1] = b;
    }
}

/* The scale and bias gradients (added, flags 32 and 64) and the means the
   dx pass reads, md[2 c] = s mean(g xn), md[2 c + 1] = s mean(g), one
   block per channel; zeros without batch statistics or parameter
   gradients (as cp_bn_bwd). */
extern "C" __global__ void cp_bn_bwd_stats_nhwc(const double* part, const float* sc,
    float* dsc, float* dbi, float* md, const unsigned M, const unsigned C, const unsigned P,
    const int flags)
{
    __shared__ double sh[66];
    const unsigned c = blockIdx.x;
    float mdyy = 0.0f, mdy = 0.0f;
    if (flags & (1 | 32 | 64)) {
        double a = 0.0, b = 0.0;
        for (unsigned q = threadIdx.x; q < P; q += blockDim.x) {
            a += part[2 * (c * P + q)];
            b += part[2 * (c * P + q) + 1];
        }
        cp_block_sum2(&a, &b, sh);
        if (threadIdx.x != 0) return;
        if (flags & 32) dsc[c] = __fadd_rn(dsc[c], (float)a);
        if (flags & 64) dbi[c] = __fadd_rn(dbi[c], (float)b);
        const double s = (flags & 4) ? (double)sc[c] : 1.0;
        mdyy = (float)(s * a / (double)M);
        mdy = (float)(s * b / (double)M);
    }
    if (threadIdx.x == 0) {
        md[2 * c] = mdyy;
        md[2 * c + 1] = mdy;
    }
}

extern "C" __global__ void cp_bn_dx_nhwc(const CP_A* dy, const CP_A* xn, const float* stdv,
    CP_A* dx, const float* sc, const float* bi, const float* md, const unsigned M,
    const unsigned C, const int flags)
{
    unsigned c, chunk, chunks, row, rows;
    cp_nhwc_tile(C, &c, &chunk, &chunks, &row, &rows);
    if (c >= C) return;
    const float s = (flags & 4) ? sc[c] : 1.0f;
    const float bb = (flags & 8) ? bi[c] : 0.0f;
    const float sd = stdv[c], mdyy = md[2 * c], mdy = md[2 * c + 1];
    for (unsigned r = chunk * rows + row; r < M; r += chunks * rows) {
        const unsigned long long i = (unsigned long long)r * C + c;
        const float v = xn[i];
        dx[i] = cp_bn_dx(cp_bn_masked(dy[i], v, s, bb, flags), v, s, sd, mdyy, mdy, flags);
    }
}

/* The same four passes where a row's channels load CP_V at a time (C a
   multiple of CP_V, the maps 16-byte aligned): a thread takes CP_V
   consecutive channels (a group), a block's GT threads the groups of a row
   and its R = blockDim.x / GT lanes R rows at a time; the grid's blocks
   are the rows' shares (the sums) or chunks (the per-value passes). The
   sums' partials, their layout and every per-value operation are the
   scalar kernels'. */
__device__ __forceinline__ void cp_nhwc_groups(unsigned C, unsigned* G, unsigned* GT,
                                               unsigned* lane, unsigned* row, unsigned* R)
{
    *G = C / CP_V;
    *GT = min(*G, (unsigned)blockDim.x);
    *R = blockDim.x / *GT;
    *lane = threadIdx.x % *GT;
    *row = threadIdx.x / *GT;
}

/* Lane 0 of each group adds the R row lanes' sums: sh holds blockDim.x * CP_V
   pairs, thread t's k-th at t * CP_V + k. */
__device__ __forceinline__ void cp_nhwc_vec_lanes_sum(double* a, double* b, double* sh,
                                                      unsigned GT, unsigned R, unsigned row,
                                                      unsigned lane)
{
    const unsigned n = blockDim.x * CP_V;
    for (int k = 0; k < CP_V; ++k) {
        sh[threadIdx.x * CP_V + k] = a[k];
        sh[n + threadIdx.x * CP_V + k] = b[k];
    }
    __syncthreads();
    if (row == 0)
        for (unsigned q = 1; q < R; ++q)
            for (int k = 0; k < CP_V; ++k) {
                a[k] += sh[(q * GT + lane) * CP_V + k];
                b[k] += sh[n + (q * GT + lane) * CP_V + k];
            }
    __syncthreads();
}

/* One row's CP_V values added to a lane's statistics: the values less the
   shift K, and their squares. */
__device__ __forceinline__ void cp_nhwc_stats_add(const float* v, const float* K, double* a,
                                                  double* b)
{
    for (int k = 0; k < CP_V; ++k) {
        const double d = (double)v[k] - (double)K[k];
        a[k] += d;
        b[k] += d * d;
    }
}

/* The vector sums are bound by memory latency, not bandwidth: a thread's
   registers (double sums) leave few threads a multiprocessor, so each
   thread loads CP_NHWC_U rows (the backward's: 2 rows of two maps) before
   it uses any. (The per-value passes load one row a step: two rows a step,
   or their per-channel values read per row, ran slower on the H200;
   dev/bn_nhwc_bench.py.) */
#define CP_NHWC_U 4

extern "C" __global__ void cp_bn_stats_part_nhwc_vec(const CP_A* x, double* part, float* kv,
    const unsigned M, const unsigned C, const unsigned P)
{
    __shared__ double sh[2 * 256 * CP_V];
    unsigned G, GT, lane, row, R;
    cp_nhwc_groups(C, &G, &GT, &lane, &row, &R);
    unsigned lo, hi;
    cp_share(M, blockIdx.x, P, &lo, &hi);
    for (unsigned g0 = 0; g0 < G; g0 += GT) {
        const unsigned g = g0 + lane;
        double a[CP_V], b[CP_V];
        float K[CP_V];
        for (int k = 0; k < CP_V; ++k) { a[k] = 0.0; b[k] = 0.0; }
        if (g < G) {
            cp_load<CP_V>(x + g * CP_V, K);
            const CP_A* base = x + g * CP_V;
            unsigned r = lo + row;
            for (; r + (CP_NHWC_U - 1) * R < hi; r += CP_NHWC_U * R) {
                float v[CP_NHWC_U][CP_V];
                for (int u = 0; u < CP_NHWC_U; ++u)
                    cp_load<CP_V>(base + (unsigned long long)(r + u * R) * C, v[u]);
                for (int u = 0; u < CP_NHWC_U; ++u) cp_nhwc_stats_add(v[u], K, a, b);
            }
            for (; r < hi; r += R) {
                float v[CP_V];
                cp_load<CP_V>(base + (unsigned long long)r * C, v);
                cp_nhwc_stats_add(v, K, a, b);
            }
        }
        cp_nhwc_vec_lanes_sum(a, b, sh, GT, R, row, lane);
        if (row == 0 && g < G)
            for (int k = 0; k < CP_V; ++k) {
                const unsigned c = g * CP_V + k;
                part[2 * (c * P + blockIdx.x)] = a[k];
                part[2 * (c * P + blockIdx.x) + 1] = b[k];
                if (blockIdx.x == 0) kv[c] = K[k];
            }
    }
}

/* cp_bn_apply_nhwc_vec's rows. With ADD, the Eltwise SUM after the chain
   in the same pass (a residual branch's last BatchNorm): e = ce * other +
   cy * y, cp_axpby_of of y as its map stores it, with its ReLU where
   add_flags & 2, into sum; y itself is stored only with add_flags & 1. */
template <bool ADD>
__device__ __forceinline__ void cp_bn_apply_rows(const CP_A* x, CP_A* y, CP_A* xn,
    const float* ms, const float* stdv, const float* sc, const float* bi, const unsigned M,
    const unsigned C, const int flags, const CP_A* other, CP_A* sum, const float ce,
    const float cy, const int add_flags)
{
    unsigned G, GT, lane, row, R;
    cp_nhwc_groups(C, &G, &GT, &lane, &row, &R);
    for (unsigned g = lane; g < G; g += GT) {
        float s[CP_V], bb[CP_V], mean[CP_V], sd[CP_V], v[CP_V], t[CP_V];
        for (int k = 0; k < CP_V; ++k) {
            const unsigned c = g * CP_V + k;
            s[k] = (flags & 4) ? sc[c] : 1.0f;
            bb[k] = (flags & 8) ? bi[c] : 0.0f;
            mean[k] = ms[c];
            sd[k] = stdv[c];
        }
        for (unsigned r = blockIdx.x * R + row; r < M; r += gridDim.x * R) {
            const unsigned long long o = (unsigned long long)r * C + g * CP_V;
            cp_load<CP_V>(x + o, v);
            for (int k = 0; k < CP_V; ++k) {
                t[k] = CP_ROUND(__fdiv_rn(__fsub_rn(v[k], mean[k]), sd[k]));
                v[k] = cp_chain(t[k], s[k], bb[k], flags);
            }
            if (flags & 2) cp_store<CP_V>(xn + o, t);
            if (ADD) {
                float e[CP_V];
                cp_load<CP_V>(other + o, e);
                for (int k = 0; k < CP_V; ++k)
                    e[k] = cp_axpby_of(e[k], CP_ROUND(v[k]), ce, cy, add_flags & 2);
                if (add_flags & 1) cp_store<CP_V>(y + o, v);
                cp_store<CP_V>(sum + o, e);
            } else {
                cp_store<CP_V>(y + o, v);
            }
        }
    }
}

extern "C" __global__ void cp_bn_apply_nhwc_vec(const CP_A* x, CP_A* y, CP_A* xn,
    const float* ms, const float* stdv, const float* sc, const float* bi,
    const unsigned M, const unsigned C, const int flags)
{
    cp_bn_apply_rows<false>(x, y, xn, ms, stdv, sc, bi, M, C, flags, x, y, 0.0f, 0.0f, 0);
}

extern "C" __global__ void cp_bn_apply_add_nhwc_vec(const CP_A* x, CP_A* y, CP_A* xn,
    const float* ms, const float* stdv, const float* sc, const float* bi,
    const unsigned M, const unsigned C, const int flags, const CP_A* other, CP_A* sum,
    const float ce, const float cy, const int add_flags)
{
    cp_bn_apply_rows<true>(x, y, xn, ms, stdv, sc, bi, M, C, flags, other, sum, ce, cy,
                           add_flags);
}

extern "C" __global__ void cp_bn_bwd_part_nhwc_vec(const CP_A* dy, const CP_A* xn,
    const float* sc, const float* bi, double* part, const unsigned M, const unsigned C,
    const unsigned P, const int flags)
{
    __shared__ double sh[2 * 256 * CP_V];
    unsigned G, GT, lane, row, R;
    cp_nhwc_groups(C, &G, &GT, &lane, &row, &R);
    unsigned lo, hi;
    cp_share(M, blockIdx.x, P, &lo, &hi);
    for (unsigned g0 = 0; g0 < G; g0 += GT) {
        const unsigned g = g0 + lane;
        double a[CP_V], b[CP_V];
        for (int k = 0; k < CP_V; ++k) { a[k] = 0.0; b[k] = 0.0; }
        if (g < G) {
            const unsigned c0 = g * CP_V;
            float s[CP_V], bb[CP_V];
            for (int k = 0; k < CP_V; ++k) {
                s[k] = (flags & 4) ? sc[c0 + k] : 1.0f;
                bb[k] = (flags & 8) ? bi[c0 + k] : 0.0f;
            }
            unsigned r = lo + row;
            for (; r + R < hi; r += 2 * R) {
                const unsigned long long o0 = (unsigned long long)r * C + c0;
                const unsigned long long o1 = o0 + (unsigned long long)R * C;
                float v0[CP_V], d0[CP_V], v1[CP_V], d1[CP_V];
                cp_load<CP_V>(xn + o0, v0);
                cp_load<CP_V>(dy + o0, d0);
                cp_load<CP_V>(xn + o1, v1);
                cp_load<CP_V>(dy + o1, d1);
                for (int k = 0; k < CP_V; ++k) {
                    const float g0v = cp_bn_masked(d0[k], v0[k], s[k], bb[k], flags);
                    const float g1v = cp_bn_masked(d1[k], v1[k], s[k], bb[k], flags);
                    a[k] += (double)g0v * (double)v0[k];
                    b[k] += (double)g0v;
                    a[k] += (double)g1v * (double)v1[k];
                    b[k] += (double)g1v;
                }
            }
            if (r < hi) {
                const unsigned long long o = (unsigned long long)r * C + c0;
                float v[CP_V], d[CP_V];
                cp_load<CP_V>(xn + o, v);
                cp_load<CP_V>(dy + o, d);
                for (int k = 0; k < CP_V; ++k) {
                    const float gg = cp_bn_masked(d[k], v[k], s[k], bb[k], flags);
                    a[k] += (double)gg * (double)v[k];
                    b[k] += (double)gg;
                }
            }
        }
        cp_nhwc_vec_lanes_sum(a, b, sh, GT, R, row, lane);
        if (row == 0 && g < G)
            for (int k = 0; k < CP_V; ++k) {
                const unsigned c = g * CP_V + k;
                part[2 * (c * P + blockIdx.x)] = a[k];
                part[2 * (c * P + blockIdx.x) + 1] = b[k];
            }
    }
}

/* dx divides by a channel's reciprocal (cp_div_rcp): 8.1 ms over ResNet-50
   b256's BatchNorms against 11.0 with a division a value. (The normalize
   pass keeps its division: a reciprocal array more cost it more than the
   division did, 6.2 against 5.7; dev/bn_nhwc_bench.py.) */
extern "C" __global__ void cp_bn_dx_nhwc_vec(const CP_A* dy, const CP_A* xn, const float* stdv,
    CP_A* dx, const float* sc, const float* bi, const float* md, const unsigned M,
    const unsigned C, const int flags)
{
    unsigned G, GT, lane, row, R;
    cp_nhwc_groups(C, &G, &GT, &lane, &row, &R);
    for (unsigned g = lane; g < G; g += GT) {
        float s[CP_V], bb[CP_V], sd[CP_V], rsd[CP_V], mdyy[CP_V], mdy[CP_V], v[CP_V], d[CP_V];
        for (int k = 0; k < CP_V; ++k) {
            const unsigned c = g * CP_V + k;
            s[k] = (flags & 4) ? sc[c] : 1.0f;
            bb[k] = (flags & 8) ? bi[c] : 0.0f;
            sd[k] = stdv[c];
            rsd[k] = __frcp_rn(sd[k]);
            mdyy[k] = md[2 * c];
            mdy[k] = md[2 * c + 1];
        }
        for (unsigned r = blockIdx.x * R + row; r < M; r += gridDim.x * R) {
            const unsigned long long o = (unsigned long long)r * C + g * CP_V;
            cp_load<CP_V>(xn + o, v);
            cp_load<CP_V>(dy + o, d);
            for (int k = 0; k < CP_V; ++k)
                d[k] = cp_bn_dx_rcp(cp_bn_masked(d[k], v[k], s[k], bb[k], flags), v[k], s[k],
                                    sd[k], rsd[k], mdyy[k], mdy[k], flags);
            cp_store<CP_V>(dx + o, d);
        }
    }
}

'''
