"""The CUDA C source of caffeplus.kernels' second module, EXTRA (built after
caffeplus.kernel_sources' COMMON helpers): pooling with Caffe's windows,
masks, SoftmaxWithLoss, BatchNorm over several blocks a channel, im2col, the
convolution bias's channel sums and the 16-bit filter gradient's
accumulation."""
from caffeplus.kernel_sources_layout import LAYOUT

EXTRA = r'''
#define CP_FLT_MAX 3.402823466e+38f
#define CP_FLT_MIN 1.175494351e-38f

__device__ __forceinline__ float cp_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(CP_FULL_MASK, v, o));
    return v;
}

/* Block-wide max (every thread gets it). */
__device__ float cp_block_max(float v, float* sh) {
    const int lane = threadIdx.x & 31;
    const int wid = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5;
    v = cp_warp_max(v);
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    if (wid == 0) {
        v = lane < nw ? sh[lane] : -CP_FLT_MAX;
        v = cp_warp_max(v);
        if (lane == 0) sh[32] = v;
    }
    __syncthreads();
    v = sh[32];
    __syncthreads();
    return v;
}

/* Index i of a (planes, H, W) layout: its row *h, its column *w, and
   (returned) its plane. */
template <class I>
__device__ __forceinline__ I cp_plane_of(const I i, const int H, const int W, int* h, int* w)
{
    *w = (int)(i % (I)W);
    const I t = i / (I)W;
    *h = (int)(t % (I)H);
    return t / (I)H;
}

/* The first maximum of each of V channels over the window rows hs..,
   columns ws.. (clipped to the H x W plane xp, its pixels CS values apart:
   1 in Caffe's order, C channels-last) in scan order: strict >, from
   -FLT_MAX, so NaN never wins; a[k] = its offset kh*KW+kw in the window,
   `none` if nothing beat -FLT_MAX. */
template <int V, class A>
__device__ __forceinline__ void cp_window_max(const CP_A* xp, const int H, const int W,
    const int hs, const int ws, const int KH, const int KW, const int none, const int CS,
    float* m, A* a)
{
    for (int k = 0; k < V; ++k) { m[k] = -CP_FLT_MAX; a[k] = (A)none; }
    for (int kh = 0; kh < KH; ++kh) {
        const int h = hs + kh;
        if (h < 0 || h >= H) continue;
        for (int kw = 0; kw < KW; ++kw) {
            const int w = ws + kw;
            if (w < 0 || w >= W) continue;
            float v[V];
            cp_load<V>(xp + (long long)(h * W + w) * CS, v);
            for (int k = 0; k < V; ++k)
                if (v[k] > m[k]) { m[k] = v[k]; a[k] = (A)(kh * KW + kw); }
        }
    }
}

/* Pooling with Caffe's windows (rows oh*SH-PH .. +KH, clipped to the image),
   one thread per output value. MAX: the first maximum in scan order (strict
   >, so NaN never wins) starting from -FLT_MAX; arg = its offset kh*KW+kw in
   the window, -1 if nothing beat -FLT_MAX. AVE: the clipped window's sum
   over the window clipped to H+PH (Caffe's divisor). */
extern "C" __global__ void cp_pool_fwd(const CP_A* x, CP_A* y, int* arg,
    const unsigned NC, const int H, const int W, const int OH, const int OW,
    const int KH, const int KW, const int SH, const int SW, const int PH, const int PW,
    const int ave)
{
    const unsigned total = NC * (unsigned)(OH * OW);
    const unsigned stride = gridDim.x * blockDim.x;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        int oh, ow;
        const unsigned nc = cp_plane_of(i, OH, OW, &oh, &ow);
        const int hs = oh * SH - PH, ws = ow * SW - PW;
        const CP_A* xp = x + nc * (unsigned)(H * W);
        if (ave) {
            const int he = min(hs + KH, H + PH), we = min(ws + KW, W + PW);
            const float size = (float)((he - hs) * (we - ws));
            float sum = 0.0f;
            for (int kh = 0; kh < KH; ++kh) {
                const int h = hs + kh;
                if (h < 0 || h >= H) continue;
                for (int kw = 0; kw < KW; ++kw) {
                    const int w = ws + kw;
                    if (w < 0 || w >= W) continue;
                    sum = __fadd_rn(sum, (float)xp[h * W + w]);
                }
            }
            y[i] = __fdiv_rn(sum, size);
        } else {
            float m;
            int a;
            cp_window_max<1>(xp, H, W, hs, ws, KH, KW, -1, 1, &m, &a);
            y[i] = m;
            arg[i] = a;
        }
    }
}

/* The windows that hold input value (h, w) under Caffe's geometry: output
   rows ph0 <= ph < ph1 and columns pw0 <= pw < pw1. */
__device__ __forceinline__ void cp_windows_of(const int h, const int w, const int KH,
    const int KW, const int SH, const int SW, const int PH, const int PW, const int OH,
    const int OW, int* ph0, int* ph1, int* pw0, int* pw1)
{
    const int hp = h + PH, wp = w + PW;
    *ph0 = hp < KH ? 0 : (hp - KH) / SH + 1;
    *ph1 = min(hp / SH + 1, OH);
    *pw0 = wp < KW ? 0 : (wp - KW) / SW + 1;
    *pw1 = min(wp / SW + 1, OW);
}

/* Pooling backward, one thread per input value: the sum over the windows
   that hold it of dy routed by arg (MAX) or dy / divisor (AVE). */
extern "C" __global__ void cp_pool_bwd(const CP_A* dy, const int* arg, CP_A* dx,
    const unsigned NC, const int H, const int W, const int OH, const int OW,
    const int KH, const int KW, const int SH, const int SW, const int PH, const int PW,
    const int ave)
{
    const unsigned total = NC * (unsigned)(H * W);
    const unsigned stride = gridDim.x * blockDim.x;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        int h, w;
        const unsigned nc = cp_plane_of(i, H, W, &h, &w);
        int ph0, ph1, pw0, pw1;
        cp_windows_of(h, w, KH, KW, SH, SW, PH, PW, OH, OW, &ph0, &ph1, &pw0, &pw1);
        const unsigned ob = nc * (unsigned)(OH * OW);
        float acc = 0.0f;
        for (int ph = ph0; ph < ph1; ++ph) {
            const int hs = ph * SH - PH;
            for (int pw = pw0; pw < pw1; ++pw) {
                const int ws = pw * SW - PW;
                const unsigned o = ob + (unsigned)(ph * OW + pw);
                if (ave) {
                    const int he = min(hs + KH, H + PH), we = min(ws + KW, W + PW);
                    const float size = (float)((he - hs) * (we - ws));
                    acc = __fadd_rn(acc, __fdiv_rn((float)dy[o], size));
                } else if (arg[o] == (h - hs) * KW + (w - ws)) {
                    acc = __fadd_rn(acc, (float)dy[o]);
                }
            }
        }
        dx[i] = acc;
    }
}

/* Masks instead of maps (caffeplus.memory.masks): max pooling and ReLU
   whose backward reads a few bits kept by their forward, not x or y, so a
   memory plan can drop the maps after forward. 64-bit indices: VGG-16's
   first maps pass 2**32 values past batch 1300.

   MAX pooling as cp_pool_fwd (Caffe's windows, the first maximum in scan
   order), keeping the argmax as one byte: the window offset kh*KW+kw (the
   layer masks windows of at most 255 values), 255 where nothing beat
   -FLT_MAX. total = N*C*OH*OW. Maps of CP_A, as the other pooling kernels;
   a gradient is summed in float and rounded once. */
template <class I>
__device__ __forceinline__ void cp_mpool_fwd_run(const I total, const CP_A* x, CP_A* y,
    unsigned char* arg, const int H, const int W, const int OH, const int OW,
    const int KH, const int KW, const int SH, const int SW, const int PH, const int PW)
{
    const I stride = (I)gridDim.x * blockDim.x;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        int oh, ow;
        const unsigned long long nc = cp_plane_of(i, OH, OW, &oh, &ow);
        const int hs = oh * SH - PH, ws = ow * SW - PW;
        const CP_A* xp = x + nc * (unsigned long long)(H * W);
        float m;
        unsigned char a;
        cp_window_max<1>(xp, H, W, hs, ws, KH, KW, 255, 1, &m, &a);
        y[i] = m;
        arg[i] = a;
    }
}

/* 64-bit division is slow on the device: 32-bit indices up to 2**31 values.
   CP_BY_INDEX(run, total, args...) calls run<unsigned> or run<unsigned long long>. */
#define CP_INDEX_32 2147483648ULL
#define CP_BY_INDEX(run, total, ...)                                             \
    if ((total) <= CP_INDEX_32) run<unsigned>((unsigned)(total), __VA_ARGS__);   \
    else run<unsigned long long>((total), __VA_ARGS__)

extern "C" __global__ void cp_mpool_fwd(const CP_A* x, CP_A* y, unsigned char* arg,
    const unsigned long long total, const int H, const int W, const int OH, const int OW,
    const int KH, const int KW, const int SH, const int SW, const int PH, const int PW)
{
    CP_BY_INDEX(cp_mpool_fwd_run, total, x, y, arg, H, W, OH, OW, KH, KW, SH, SW, PH, PW);
}

/* Its backward, one thread per input value (total = N*C*H*W): the sum, in
   window order, of dy over the windows whose argmax is this value. */
template <class I>
__device__ __forceinline__ void cp_mpool_bwd_run(const I total, const CP_A* dy,
    const unsigned char* arg, CP_A* dx, const int H, const int W, const int OH, const int OW,
    const int KH, const int KW, const int SH, const int SW, const int PH, const int PW)
{
    const I stride = (I)gridDim.x * blockDim.x;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        int h, w;
        const unsigned long long nc = cp_plane_of(i, H, W, &h, &w);
        int ph0, ph1, pw0, pw1;
        cp_windows_of(h, w, KH, KW, SH, SW, PH, PW, OH, OW, &ph0, &ph1, &pw0, &pw1);
        const unsigned long long ob = nc * (unsigned long long)(OH * OW);
        float acc = 0.0f;
        for (int ph = ph0; ph < ph1; ++ph) {
            const int hs = ph * SH - PH;
            for (int pw = pw0; pw < pw1; ++pw) {
                const int ws = pw * SW - PW;
                const unsigned long long o = ob + (unsigned long long)(ph * OW + pw);
                if ((int)arg[o] == (h - hs) * KW + (w - ws)) acc = __fadd_rn(acc, dy[o]);
            }
        }
        dx[i] = acc;
    }
}

extern "C" __global__ void cp_mpool_bwd(const CP_A* dy, const unsigned char* arg, CP_A* dx,
    const unsigned long long total, const int H, const int W, const int OH, const int OW,
    const int KH, const int KW, const int SH, const int SW, const int PH, const int PW)
{
    CP_BY_INDEX(cp_mpool_bwd_run, total, dy, arg, dx, H, W, OH, OW, KH, KW, SH, SW, PH, PW);
}

/* The same where the windows tile the input exactly (stride = kernel, no
   pad, H = OH * KH, W = OW * KW: VGG-16's 2x2), one thread per output value
   (total = N*C*OH*OW) writing its window: 0 + dy at the argmax (as the sum
   above, so -0.0 becomes 0.0), 0 elsewhere. */
template <class I>
__device__ __forceinline__ void cp_mpool_bwd_tiled_run(const I total, const CP_A* dy,
    const unsigned char* arg, CP_A* dx, const int OH, const int OW, const int KH, const int KW)
{
    const int W = OW * KW;
    const I stride = (I)gridDim.x * blockDim.x;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        int oh, ow;
        const unsigned long long nc = cp_plane_of(i, OH, OW, &oh, &ow);
        const int a = (int)arg[i];
        const float g = __fadd_rn(0.0f, dy[i]);
        CP_A* dp = dx + nc * (unsigned long long)(OH * KH) * (unsigned long long)W +
            (unsigned long long)(oh * KH) * W + (unsigned long long)(ow * KW);
        for (int kh = 0; kh < KH; ++kh)
            for (int kw = 0; kw < KW; ++kw)
                dp[kh * W + kw] = (kh * KW + kw == a) ? g : 0.0f;
    }
}

extern "C" __global__ void cp_mpool_bwd_tiled(const CP_A* dy, const unsigned char* arg,
    CP_A* dx, const unsigned long long total, const int OH, const int OW, const int KH,
    const int KW)
{
    CP_BY_INDEX(cp_mpool_bwd_tiled_run, total, dy, arg, dx, OH, OW, KH, KW);
}

/* The three above over channels-last maps (x, y, dx, dy: N, H, W, C; the
   argmax in y's order), the same windows, argmax and sums: each thread
   takes V consecutive channels of a pixel. V is CP_V where C is a multiple
   of it, the maps are 16-byte aligned and the argmax CP_V-byte aligned
   (one 16-byte load a window value, the index arithmetic once for CP_V
   values: ResNet-50 b256's pool1 backward took 2.4 ms with a value a
   thread, 0.45 ms with 8 channels; dev/kernel_profile.py), else 1. */
template <int V> struct alignas(V) cp_arg_bytes { unsigned char v[V]; };

#define CP_BY_INDEX_W(run, V, total, ...)                                        \
    if ((total) <= CP_INDEX_32) run<unsigned, V>((unsigned)(total), __VA_ARGS__); \
    else run<unsigned long long, V>((total), __VA_ARGS__)

/* Whether a channels-last pooling kernel's threads can take CP_V channels. */
__device__ __forceinline__ bool cp_pool_vec_ok(const int C, const void* a, const void* b,
                                               const void* arg) {
    return C % CP_V == 0 && cp_aligned16(a) && cp_aligned16(b) &&
        ((unsigned long long)arg % CP_V) == 0;
}

/* Group i of V channels: its pixel, and its first channel *c. */
template <class I, int V>
__device__ __forceinline__ I cp_pixel_of_group(const I i, const int C, int* c) {
    const int G = C / V;
    const I pixel = i / (I)G;
    *c = (int)(i - pixel * (I)G) * V;
    return pixel;
}

template <class I, int V>
__device__ __forceinline__ void cp_mpool_fwd_nhwc_run(const I groups, const CP_A* x, CP_A* y,
    unsigned char* arg, const int C, const int H, const int W, const int OH, const int OW,
    const int KH, const int KW, const int SH, const int SW, const int PH, const int PW)
{
    const I stride = (I)gridDim.x * blockDim.x;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < groups; i += stride) {
        int c;
        const I pixel = cp_pixel_of_group<I, V>(i, C, &c);
        int oh, ow;
        const unsigned long long n = cp_plane_of(pixel, OH, OW, &oh, &ow);
        const CP_A* xp = x + n * (unsigned long long)(H * W) * C + c;
        const int hs = oh * SH - PH, ws = ow * SW - PW;
        float m[V];
        cp_arg_bytes<V> a;
        cp_window_max<V>(xp, H, W, hs, ws, KH, KW, 255, C, m, a.v);
        const unsigned long long o = (unsigned long long)i * V;
        cp_store<V>(y + o, m);
        *(cp_arg_bytes<V>*)(arg + o) = a;
    }
}

extern "C" __global__ void cp_mpool_fwd_nhwc(const CP_A* x, CP_A* y, unsigned char* arg,
    const unsigned long long total, const int C, const int H, const int W, const int OH,
    const int OW, const int KH, const int KW, const int SH, const int SW, const int PH,
    const int PW)
{
    if (cp_pool_vec_ok(C, x, y, arg)) {
        CP_BY_INDEX_W(cp_mpool_fwd_nhwc_run, CP_V, total / CP_V, x, y, arg, C, H, W, OH, OW,
                      KH, KW, SH, SW, PH, PW);
    } else {
        CP_BY_INDEX_W(cp_mpool_fwd_nhwc_run, 1, total, x, y, arg, C, H, W, OH, OW, KH, KW, SH,
                      SW, PH, PW);
    }
}

template <class I, int V>
__device__ __forceinline__ void cp_mpool_bwd_nhwc_run(const I groups, const CP_A* dy,
    const unsigned char* arg, CP_A* dx, const int C, const int H, const int W, const int OH,
    const int OW, const int KH, const int KW, const int SH, const int SW, const int PH,
    const int PW)
{
    const I stride = (I)gridDim.x * blockDim.x;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < groups; i += stride) {
        int c;
        const I pixel = cp_pixel_of_group<I, V>(i, C, &c);
        int h, w;
        const unsigned long long n = cp_plane_of(pixel, H, W, &h, &w);
        int ph0, ph1, pw0, pw1;
        cp_windows_of(h, w, KH, KW, SH, SW, PH, PW, OH, OW, &ph0, &ph1, &pw0, &pw1);
        const unsigned long long ob = n * (unsigned long long)(OH * OW);
        float acc[V];
        for (int k = 0; k < V; ++k) acc[k] = 0.0f;
        for (int ph = ph0; ph < ph1; ++ph) {
            const int hs = ph * SH - PH;
            for (int pw = pw0; pw < pw1; ++pw) {
                const int ws = pw * SW - PW;
                const unsigned long long o = (ob + (unsigned long long)(ph * OW + pw)) * C + c;
                const cp_arg_bytes<V> a = *(const cp_arg_bytes<V>*)(arg + o);
                float g[V];
                cp_load<V>(dy + o, g);
                const int here = (h - hs) * KW + (w - ws);
                for (int k = 0; k < V; ++k)
                    if ((int)a.v[k] == here) acc[k] = __fadd_rn(acc[k], g[k]);
            }
        }
        cp_store<V>(dx + (unsigned long long)i * V, acc);
    }
}

extern "C" __global__ void cp_mpool_bwd_nhwc(const CP_A* dy, const unsigned char* arg,
    CP_A* dx, const unsigned long long total, const int C, const int H, const int W,
    const int OH, const int OW, const int KH, const int KW, const int SH, const int SW,
    const int PH, const int PW)
{
    if (cp_pool_vec_ok(C, dy, dx, arg)) {
        CP_BY_INDEX_W(cp_mpool_bwd_nhwc_run, CP_V, total / CP_V, dy, arg, dx, C, H, W, OH, OW,
                      KH, KW, SH, SW, PH, PW);
    } else {
        CP_BY_INDEX_W(cp_mpool_bwd_nhwc_run, 1, total, dy, arg, dx, C, H, W, OH, OW, KH, KW,
                      SH, SW, PH, PW);
    }
}

template <class I, int V>
__device__ __forceinline__ void cp_mpool_bwd_tiled_nhwc_run(const I groups, const CP_A* dy,
    const unsigned char* arg, CP_A* dx, const int C, const int OH, const int OW, const int KH,
    const int KW)
{
    const int W = OW * KW;
    const I stride = (I)gridDim.x * blockDim.x;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < groups; i += stride) {
        int c;
        const I pixel = cp_pixel_of_group<I, V>(i, C, &c);
        int oh, ow;
        const unsigned long long n = cp_plane_of(pixel, OH, OW, &oh, &ow);
        const unsigned long long o = (unsigned long long)i * V;
        const cp_arg_bytes<V> a = *(const cp_arg_bytes<V>*)(arg + o);
        float g[V];
        cp_load<V>(dy + o, g);
        for (int k = 0; k < V; ++k) g[k] = __fadd_rn(0.0f, g[k]);
        CP_A* dp = dx + ((n * (unsigned long long)(OH * KH) + (unsigned long long)(oh * KH)) *
                         W + (unsigned long long)(ow * KW)) * C + c;
        for (int kh = 0; kh < KH; ++kh)
            for (int kw = 0; kw < KW; ++kw) {
                float out[V];
                for (int k = 0; k < V; ++k) out[k] = (kh * KW + kw == (int)a.v[k]) ? g[k] : 0.0f;
                cp_store<V>(dp + (long long)(kh * W + kw) * C, out);
            }
    }
}

extern "C" __global__ void cp_mpool_bwd_tiled_nhwc(const CP_A* dy, const unsigned char* arg,
    CP_A* dx, const unsigned long long total, const int C, const int OH, const int OW,
    const int KH, const int KW)
{
    if (cp_pool_vec_ok(C, dy, dx, arg)) {
        CP_BY_INDEX_W(cp_mpool_bwd_tiled_nhwc_run, CP_V, total / CP_V, dy, arg, dx, C, OH, OW,
                      KH, KW);
    } else {
        CP_BY_INDEX_W(cp_mpool_bwd_tiled_nhwc_run, 1, total, dy, arg, dx, C, OH, OW, KH, KW);
    }
}

/* ReLU (negative slope 0) that also keeps bit i%32 of bits[i/32] = (y[i] > 0),
   the mask its backward reads instead of y. A warp's 32 lanes handle 32
   consecutive values each step (__ballot_sync), so the loop runs to n
   rounded up to 32 and blockDim.x is a multiple of 32. */
extern "C" __global__ void cp_relu_bits_fwd(const CP_A* x, CP_A* y, unsigned* bits,
                                            const unsigned long long n)
{
    const unsigned long long n32 = (n + 31ULL) & ~31ULL;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n32; i += stride) {
        float r = 0.0f;
        if (i < n) {
            r = cp_relu0(x[i]);
            y[i] = r;
        }
        const unsigned word = __ballot_sync(CP_FULL_MASK, r > 0.0f);
        if ((threadIdx.x & 31) == 0) bits[i >> 5] = word;
    }
}

/* Its backward: dx = dy * (bit ? 1 : 0), Caffe's dy * (y > 0). */
extern "C" __global__ void cp_relu_bits_bwd(const CP_A* dy, const unsigned* bits, CP_A* dx,
                                            const unsigned long long n)
{
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride)
        dx[i] = __fmul_rn(dy[i], ((bits[i >> 5] >> (unsigned)(i & 31ULL)) & 1u) ? 1.0f : 0.0f);
}

/* SoftmaxWithLoss, one block per (outer, inner) row of x viewed as
   (outer, classes, inner): rowloss[r] = -log(max(p[label], FLT_MIN)) (0 when
   the label is ignored), rowvalid[r] = 1 or 0. A label outside [0, classes)
   that is not ignored sets err[0] = 1, err[1] = the label. */
extern "C" __global__ void cp_softmax_loss_rows(const CP_A* x, const float* label,
    float* rowloss, float* rowvalid, float* err,
    const unsigned outer, const unsigned classes, const unsigned inner,
    const int has_ignore, const int ignore)
{
    __shared__ float shf[33];
    __shared__ double sh[66];
    const unsigned r = blockIdx.x;
    const unsigned o = r / inner, in = r - o * inner;
    const CP_A* xr = x + o * classes * inner + in;
    float m = -CP_FLT_MAX;
    for (unsigned c = threadIdx.x; c < classes; c += blockDim.x) m = fmaxf(m, (float)xr[c * inner]);
    m = cp_block_max(m, shf);
    double a = 0.0, b = 0.0;
    for (unsigned c = threadIdx.x; c < classes; c += blockDim.x)
        a += (double)expf(__fsub_rn((float)xr[c * inner], m));
    cp_block_sum2(&a, &b, sh);
    if (threadIdx.x == 0) {
        const float lf = label[r];
        const int l = (int)lf;
        const int valid = !(has_ignore && l == ignore);
        if (valid && (l < 0 || l >= (int)classes)) {
            err[0] = 1.0f;
            err[1] = lf;
            rowloss[r] = 0.0f;
            rowvalid[r] = 0.0f;
        } else if (valid) {
            const float p = __fdiv_rn(expf(__fsub_rn((float)xr[(unsigned)l * inner], m)), (float)a);
            rowloss[r] = -logf(fmaxf(p, CP_FLT_MIN));
            rowvalid[r] = 1.0f;
        } else {
            rowloss[r] = 0.0f;
            rowvalid[r] = 0.0f;
        }
    }
}

/* SoftmaxWithLoss total, one block: top[0] = sum(rowloss) / normalizer (NaN
   after a label error, so that a check guarding the update skips it before
   the host reads the error); info = [normalizer, err[0], err[1]], and err is
   cleared for the next call.
   mode: Caffe's LossParameter.NormalizationMode (FULL, VALID, BATCH_SIZE, NONE). */
extern "C" __global__ void cp_softmax_loss_total(const float* rowloss, const float* rowvalid,
    float* err, float* top, float* info, const unsigned rows, const int mode,
    const unsigned outer, const unsigned inner)
{
    __shared__ double sh[66];
    double a = 0.0, b = 0.0;
    for (unsigned r = threadIdx.x; r < rows; r += blockDim.x) {
        a += (double)rowloss[r];
        b += (double)rowvalid[r];
    }
    cp_block_sum2(&a, &b, sh);
    if (threadIdx.x == 0) {
        double n;
        if (mode == 0) n = (double)outer * (double)inner;
        else if (mode == 1) n = b;
        else if (mode == 2) n = (double)outer;
        else n = 1.0;
        const float norm = (float)(n > 1.0 ? n : 1.0);
        top[0] = err[0] != 0.0f ? (float)__longlong_as_double(0x7ff8000000000000LL)
                                : (float)(a / (double)norm);
        info[0] = norm;
        info[1] = err[0];
        info[2] = err[1];
        err[0] = 0.0f;
        err[1] = 0.0f;
    }
}

/* SoftmaxWithLoss backward, one block per row: dx = (p - onehot(label)) *
   valid * (top_diff[0] / normalizer); NaN after a label error (info[1]), so
   that no update in backward applies what it leads to. */
extern "C" __global__ void cp_softmax_loss_bwd(const CP_A* x, const float* label,
    const float* top_diff, const float* info, CP_A* dx,
    const unsigned outer, const unsigned classes, const unsigned inner,
    const int has_ignore, const int ignore)
{
    __shared__ float shf[33];
    __shared__ double sh[66];
    const unsigned r = blockIdx.x;
    const unsigned o = r / inner, in = r - o * inner;
    const unsigned off = o * classes * inner + in;
    const CP_A* xr = x + off;
    float m = -CP_FLT_MAX;
    for (unsigned c = threadIdx.x; c < classes; c += blockDim.x) m = fmaxf(m, (float)xr[c * inner]);
    m = cp_block_max(m, shf);
    double a = 0.0, b = 0.0;
    for (unsigned c = threadIdx.x; c < classes; c += blockDim.x)
        a += (double)expf(__fsub_rn((float)xr[c * inner], m));
    cp_block_sum2(&a, &b, sh);
    const float s = (float)a;
    const int l = (int)label[r];
    const float valid = (has_ignore && l == ignore) ? 0.0f : 1.0f;
    const float scale = info[1] != 0.0f ? (float)__longlong_as_double(0x7ff8000000000000LL)
                                        : __fdiv_rn(top_diff[0], info[0]);
    for (unsigned c = threadIdx.x; c < classes; c += blockDim.x) {
        float d = __fdiv_rn(expf(__fsub_rn((float)xr[c * inner], m)), s);
        d = __fsub_rn(d, (int)c == l ? 1.0f : 0.0f);
        d = __fmul_rn(d, valid);
        dx[off + c * inner] = __fmul_rn(d, scale);
    }
}

/* BatchNorm for few channels: P blocks per channel (grid C * P, block
   c * P + p takes values [M p / P, M (p + 1) / P) of channel c), in two
   launches each way: partial sums, then every block sums the P partials
   in the same order (so all agree) and does its share. */
__device__ __forceinline__ void cp_share(unsigned M, unsigned p, unsigned P,
                                         unsigned* lo, unsigned* hi, unsigned W = 1) {
    /* In whole runs of W values (the vector loop's; M a multiple of W). */
    const unsigned long long m = M / W;
    *lo = (unsigned)((m * p) / P) * W;
    *hi = (unsigned)((m * (p + 1)) / P) * W;
}

/* part[2 (c P + p)] = sum(x - K), part[2 (c P + p) + 1] = sum((x - K)^2),
   K = kv[c] = x[c S] (the channel's first value, kept for the second launch:
   in place it is overwritten there). */
extern "C" __global__ void cp_bn_stats_part(const CP_A* x, double* part, float* kv,
    const unsigned N, const unsigned C, const unsigned S, const unsigned P)
{
    __shared__ double sh[66];
    const unsigned c = blockIdx.x / P, p = blockIdx.x - c * P;
    const unsigned M = N * S, base = c * S, step = C * S;
    const int vw = cp_channel_width(S, x, nullptr, nullptr);
    unsigned lo, hi;
    cp_share(M, p, P, &lo, &hi, vw);
    const double K = (double)(float)x[base];
    double a = 0.0, b = 0.0;
    cp_bn_stats_range(x, vw, lo, hi, S, base, step, K, &a, &b);
    cp_block_sum2(&a, &b, sh);
    if (threadIdx.x == 0) {
        part[2 * blockIdx.x] = a;
        part[2 * blockIdx.x + 1] = b;
        if (p == 0) kv[c] = x[base];
    }
}

/* cp_bn_fwd's second half for block (c, p); flags as cp_bn_fwd's. */
extern "C" __global__ void cp_bn_fwd_apply(
    const CP_A* x, CP_A* y, CP_A* xn, float* b0, float* b1, float* b2, float* stdv,
    const float* sc, const float* bi, const double* part, const float* kv,
    const unsigned N, const unsigned C, const unsigned S, const unsigned P, const int flags,
    const float maf, const float eps, const float corr)
{
    __shared__ float stat[2];
    const unsigned c = blockIdx.x / P, p = blockIdx.x - c * P;
    const unsigned M = N * S, base = c * S, step = C * S;
    if (threadIdx.x == 0) {
        if (flags & 1) {
            double a = 0.0, b = 0.0;
            for (unsigned q = 0; q < P; ++q) {
                a += part[2 * (c * P + q)];
                b += part[2 * (c * P + q) + 1];
            }
            cp_bn_batch_stats(a, b, (double)kv[c], M, c, p == 0, b0, b1, b2, maf, corr,
                              stat);
        } else {
            cp_bn_stored_stats(c, b0, b1, b2, stat);
        }
    }
    __syncthreads();
    const float mean = stat[0];
    const float sd = sqrtf(__fadd_rn(stat[1], eps));
    if (threadIdx.x == 0 && p == 0) stdv[c] = sd;
    const float s = (flags & 4) ? sc[c] : 1.0f;
    const float bb = (flags & 8) ? bi[c] : 0.0f;
    const int vw = cp_channel_width(S, x, y, (flags & 2) ? xn : nullptr);
    unsigned lo, hi;
    cp_share(M, p, P, &lo, &hi, vw);
    cp_bn_apply_range(x, y, xn, vw, lo, hi, S, base, step, mean, sd, s, bb, flags);
}

/* part[2 (c P + p)] = sum(g * xn), [.. + 1] = sum(g) over block (c, p)'s
   share, g = dy masked by the chain's ReLU (flags as cp_bn_bwd's). */
extern "C" __global__ void cp_bn_bwd_part(const CP_A* dy, const CP_A* xn,
    const float* sc, const float* bi, double* part,
    const unsigned N, const unsigned C, const unsigned S, const unsigned P, const int flags)
{
    __shared__ double sh[66];
    const unsigned c = blockIdx.x / P, p = blockIdx.x - c * P;
    const unsigned M = N * S, base = c * S, step = C * S;
    const float s = (flags & 4) ? sc[c] : 1.0f;
    const float bb = (flags & 8) ? bi[c] : 0.0f;
    const int vw = cp_channel_width(S, dy, xn, nullptr);
    unsigned lo, hi;
    cp_share(M, p, P, &lo, &hi, vw);
    double a = 0.0, b = 0.0;
    cp_bn_sums_range(dy, xn, vw, lo, hi, S, base, step, s, bb, flags, &a, &b);
    cp_block_sum2(&a, &b, sh);
    if (threadIdx.x == 0) {
        part[2 * blockIdx.x] = a;
        part[2 * blockIdx.x + 1] = b;
    }
}

/* cp_bn_bwd's second half for block (c, p). */
extern "C" __global__ void cp_bn_bwd_apply(
    const CP_A* dy, const CP_A* xn, const float* stdv, CP_A* dx,
    const float* sc, const float* bi, float* dsc, float* dbi, const double* part,
    const unsigned N, const unsigned C, const unsigned S, const unsigned P, const int flags)
{
    __shared__ float stat[2];
    const unsigned c = blockIdx.x / P, p = blockIdx.x - c * P;
    const unsigned M = N * S, base = c * S, step = C * S;
    const float s = (flags & 4) ? sc[c] : 1.0f;
    const float bb = (flags & 8) ? bi[c] : 0.0f;
    const float sd = stdv[c];
    if (threadIdx.x == 0) {
        double a = 0.0, b = 0.0;
        for (unsigned q = 0; q < P; ++q) {
            a += part[2 * (c * P + q)];
            b += part[2 * (c * P + q) + 1];
        }
        if (p == 0) {
            if (flags & 32) dsc[c] = __fadd_rn(dsc[c], (float)a);
            if (flags & 64) dbi[c] = __fadd_rn(dbi[c], (float)b);
        }
        stat[0] = (float)((double)s * a / (double)M);
        stat[1] = (float)((double)s * b / (double)M);
    }
    __syncthreads();
    if (!(flags & 128)) return;
    const float mdyy = stat[0], mdy = stat[1];
    const int vw = cp_channel_width(S, dy, xn, dx);
    unsigned lo, hi;
    cp_share(M, p, P, &lo, &hi, vw);
    cp_bn_dx_range(dy, xn, dx, vw, lo, hi, S, base, step, s, bb, sd, mdyy, mdy, flags);
}

/* im2col of images n0 .. n0+B-1 of x (N, C, H, W) into col (K, B, P), K = C*KH*KW
   in Caffe's (c, i, j) order, P = OH*OW: row k of image b is col[(k*B + b)*P ...],
   so one image's columns are a (K x P) matrix of leading dimension B*P (a
   strided-batched GEMM's operand). Zero where the window leaves the image.
   Values are copied in the maps' type (a 16-bit build moves 16-bit values). */
extern "C" __global__ void cp_im2col(const CP_A* x, CP_A* col, const unsigned long long total,
    const int n0, const int B, const int C, const int H, const int W, const int KH, const int KW,
    const int OH, const int OW, const int SH, const int SW, const int PH, const int PW,
    const int DH, const int DW)
{
    const unsigned long long P = (unsigned long long)OH * (unsigned long long)OW;
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         t < total; t += step) {
        const unsigned long long r = t / P;
        const unsigned long long p = t - r * P;
        const int b = (int)(r % (unsigned long long)B);
        const int k = (int)(r / (unsigned long long)B);
        const int j = k % KW, i = (k / KW) % KH, c = k / (KW * KH);
        const int oy = (int)(p / (unsigned long long)OW), ox = (int)(p % (unsigned long long)OW);
        const int yy = oy * SH - PH + i * DH, xx = ox * SW - PW + j * DW;
        CP_A v = (CP_A)0.0f;
        if (yy >= 0 && yy < H && xx >= 0 && xx < W)
            v = x[(((unsigned long long)(n0 + b) * C + c) * H + yy) * W + xx];
        col[t] = v;
    }
}

/* im2row of images n0 .. of x (N, C, H, W), Caffe's order, for an image
   layer's channels-last GEMM: row (b*OH + oy)*OW + ox (an output pixel)
   holds its window's KP values, taps[k] = c << 16 | i << 8 | j*DW for k < K
   (Caffe's (c, i, j) order) and -1 past K (zeros: KP is K rounded up to 8,
   so every row starts 16-byte aligned for cuBLAS's tensor-core kernels).
   A block makes one output row of one image: it first reads the C x KH
   input rows the row's windows cover into shared memory, coalesced, the
   padding as zeros (WP = W + 2*PW values a row), then writes the OW rows
   it makes as one contiguous run, 8 values a thread in 16-byte stores. */
#define CP_IM2ROW_TILE 12288
extern "C" __global__ void cp_im2row(const CP_A* x, CP_A* rows, const int n0, const int C,
    const int H, const int W, const int KH, const int OH, const int OW, const int SH,
    const int SW, const int PH, const int PW, const int DH, const int WP, const int KP,
    const int* taps)
{
    __shared__ CP_A tile[CP_IM2ROW_TILE];
    const int oy = blockIdx.x % OH, b = blockIdx.x / OH;
    const CP_A* img = x + (size_t)(n0 + b) * C * H * W;
    for (int t = threadIdx.x; t < C * KH * WP; t += blockDim.x) {
        const int ci = t / WP, xx = t - ci * WP - PW;
        const int yy = oy * SH - PH + (ci % KH) * DH;
        CP_A v = (CP_A)0.0f;
        if (yy >= 0 && yy < H && xx >= 0 && xx < W)
            v = img[((ci / KH) * H + yy) * W + xx];
        tile[t] = v;
    }
    __syncthreads();
    const int G = KP / 8;
    uint4* out = reinterpret_cast<uint4*>(rows + ((size_t)b * OH + oy) * OW * KP);
    for (int t = threadIdx.x; t < OW * G; t += blockDim.x) {
        const int ox = t / G, g = t - ox * G;
        union { CP_A v[8]; uint4 u[sizeof(CP_A) / 2]; } pack;
        for (int q = 0; q < 8; ++q) {
            const int e = taps[g * 8 + q];
            pack.v[q] = e < 0 ? (CP_A)0.0f
                : tile[((e >> 16) * KH + ((e >> 8) & 255)) * WP + ox * SW + (e & 255)];
        }
        for (int q = 0; q < (int)(sizeof(CP_A) / 2); ++q)
            out[t * (int)(sizeof(CP_A) / 2) + q] = pack.u[q];
    }
}

/* The loss layer's report to the host, out[0..4] = normalizer, label error
   flag and value, loss, loss weight (top diff; 0 without one). `out` is
   pinned host memory the kernel writes directly: a read-back through a copy
   would queue behind the offload copies on the copy engine. */
extern "C" __global__ void cp_loss_report(const float* info, const float* top,
    const float* dtop, float* out, const int has_dtop)
{
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        out[0] = info[0];
        out[1] = info[1];
        out[2] = info[2];
        out[3] = top[0];
        out[4] = has_dtop ? dtop[0] : 0.0f;
    }
}

/* A convolution's bias gradient, db[c] += sum over n, s of dy (N, C, S), in
   two launches: part[c P + p] = the sum over block (c, p)'s share of channel
   c (grid C * P), then one thread per channel adds its P partials in order
   (deterministic: fixed shares, fixed order). */
extern "C" __global__ void cp_channel_sum_part(const CP_A* dy, double* part,
    const unsigned N, const unsigned C, const unsigned S, const unsigned P)
{
    __shared__ double sh[66];
    const unsigned c = blockIdx.x / P, p = blockIdx.x - c * P;
    const unsigned M = N * S, base = c * S, step = C * S;
    unsigned lo, hi;
    cp_share(M, p, P, &lo, &hi);
    double a = 0.0, b = 0.0;
    float v[CP_U];
    CP_RANGE_LOOP(lo, hi, S, base, step,
        v[u] = dy[o[u]];,
        a += (double)v[u];)
    cp_block_sum2(&a, &b, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = a;
}

extern "C" __global__ void cp_channel_sum_apply(const double* part, float* db,
    const unsigned C, const unsigned P)
{
    const unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    double s = 0.0;
    for (unsigned p = 0; p < P; ++p) s += part[c * P + p];
    db[c] = __fadd_rn(db[c], (float)s);
}

/* The channel sums of channels-last maps, dy M rows of C values: block p
   sums rows lo..hi of each channel into the double partial part[p C + c]
   that cp_channel_sum_apply_rows adds up (fixed shares, fixed order). The
   block's threads lie across W = min(C, threads) channels (consecutive
   addresses) and R = threads / W rows: thread (r, w) adds rows lo + r,
   lo + r + R, ..., CP_U loads issued before their adds, and the R sums of
   a channel are added in r's order. The partials lie row by row so that
   both kernels' threads touch consecutive addresses. A thread a channel
   walking its block's rows one load at a time, 12 blocks for GoogLeNet's
   7 x 7 maps, took 1.8 ms of its FP16 iteration. */
extern "C" __global__ void cp_channel_sum_part_nhwc(const CP_A* dy, double* part,
    const unsigned M, const unsigned C, const unsigned P)
{
    __shared__ double sh[1024];
    unsigned lo, hi;
    cp_share(M, blockIdx.x, P, &lo, &hi);
    const unsigned W = C < blockDim.x ? C : blockDim.x;
    const unsigned R = blockDim.x / W;
    const unsigned w = threadIdx.x % W, rl = threadIdx.x / W;
    /* R > 1 only where C < the threads: then one pass over the channels. */
    for (unsigned c0 = 0; c0 < C; c0 += W) {
        const unsigned c = c0 + w;
        double a = 0.0;
        if (rl < R && c < C) {
            unsigned r = lo + rl;
            for (; r + (CP_U - 1) * R < hi; r += CP_U * R) {
                float v[CP_U];
                for (int u = 0; u < CP_U; ++u) v[u] = (float)dy[(size_t)(r + u * R) * C + c];
                for (int u = 0; u < CP_U; ++u) a += (double)v[u];
            }
            for (; r < hi; r += R) a += (double)(float)dy[(size_t)r * C + c];
        }
        if (R == 1) {       /* (threads past R W, rl 1, are idle) */
            if (rl == 0 && c < C) part[(size_t)blockIdx.x * C + c] = a;
            continue;
        }
        sh[threadIdx.x] = a;
        __syncthreads();
        if (rl == 0) {
            double t = 0.0;
            for (unsigned k = 0; k < R; ++k) t += sh[k * W + w];
            part[(size_t)blockIdx.x * C + c] = t;
        }
        __syncthreads();
    }
}

/* db[c] += the sum over p of part[p C + c]. A block of W warps (its
   threads / 32, at most 32) takes 32 channels, a lane each (consecutive
   addresses); warp j adds the rows p = j, j + W, ... in turn, then lane c
   of the first warp adds the warps' sums in j's order: a fixed order for
   a launch shape. One thread a channel walking all P (up to 4096)
   partials took 0.81 ms of VGG-16 b64's FP16 iteration for its 13
   convolutions' biases. */
extern "C" __global__ void cp_channel_sum_apply_rows(const double* part, float* db,
    const unsigned C, const unsigned P)
{
    __shared__ double sh[32][32];
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const unsigned c = blockIdx.x * 32u + lane;
    double a = 0.0;
    if (c < C)
        for (unsigned p = warp; p < P; p += warps) a += part[(size_t)p * C + c];
    sh[warp][lane] = a;
    __syncthreads();
    if (warp == 0 && c < C) {
        double s = 0.0;
        for (unsigned j = 0; j < warps; ++j) s += sh[j][lane];
        db[c] = __fadd_rn(db[c], (float)s);
    }
}

/* A channels-last convolution's bias: y[r C + c] = y + b[c] over M rows
   (the sum in float32, rounded once to the map's type), 16 bytes a thread
   where C is a multiple of CP_V and both are aligned. cudnnAddTensor took
   3.2 ms of VGG-16 b64's FP16 iteration for 1.7 GB of maps. With `relu`,
   the ReLU that follows in place too (cp_relu0 of the rounded sum, as the
   two layers one after the other): one pass over the map instead of two. */
__device__ __forceinline__ float cp_bias_relu_of(float v, unsigned relu) {
    return relu ? cp_relu0((float)(CP_A)v) : v;
}

extern "C" __global__ void cp_bias_nhwc(CP_A* y, const CP_A* b, const unsigned long long M,
                                        const unsigned C, const unsigned relu)
{
    const unsigned long long total = M * C;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long t0 = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (C % CP_V == 0 && cp_aligned16(y) && cp_aligned16(b)) {
        const unsigned G = C / CP_V;
        for (unsigned long long i = t0; i < total / CP_V; i += stride) {
            const unsigned c = (unsigned)(i % G) * CP_V;
            float v[CP_V], bb[CP_V];
            cp_load<CP_V>(y + i * CP_V, v);
            cp_load<CP_V>(b + c, bb);
            for (int k = 0; k < CP_V; ++k) v[k] = cp_bias_relu_of(__fadd_rn(v[k], bb[k]), relu);
            cp_store<CP_V>(y + i * CP_V, v);
        }
        return;
    }
    for (unsigned long long i = t0; i < total; i += stride)
        y[i] = cp_bias_relu_of(__fadd_rn((float)y[i], (float)b[i % C]), relu);
}

/* acc (K, C, RS) += g (K, RS, C): a filter gradient cuDNN wrote in its
   channels-last filter order, added to the FP32 master's in Caffe's. */
extern "C" __global__ void cp_accumulate_krsc(const CP_A* g, float* acc, const unsigned K,
    const unsigned C, const unsigned RS)
{
    const unsigned n = K * C * RS, crs = C * RS;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const unsigned k = i / crs, rem = i - k * crs, c = rem / RS, rs = rem - c * RS;
        acc[i] = __fadd_rn(acc[i], (float)g[(k * RS + rs) * C + c]);
    }
}

/* acc[i] += g[i]: a 16-bit filter gradient cuDNN wrote (it has no 16-bit
   input, float32 output call) added to its FP32 master's. */
extern "C" __global__ void cp_accumulate(const CP_A* g, float* acc, const unsigned n)
{
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        acc[i] = __fadd_rn(acc[i], (float)g[i]);
}
/* ACROSS_CHANNELS LRN with Caffe's formula, for the map types cuDNN's LRN
   lacks (BFLOAT16): scale_c = k + alpha/n * sum of x^2 over channels
   c-pre..c+pre (pre = (n-1)/2, zero outside), y_c = x_c * scale_c^-beta.
   A thread walks `CB` channels of one pixel, float32 math, each sum taken
   whole in channel order (no running difference to drift); maps rounded
   once where stored. scale^-beta and the backward's ratio over scale take
   the device's approximations (__powf, __fdividef: MUFU lg2, ex2, rcp),
   a few float32 ulps off, far below a 16-bit map's rounding (powf and IEEE
   division took about a quarter of the kernels' time on AlexNet's LRNs).
   The window is a shift register of N = n values, N a template argument
   (Caffe's n is odd): every index is known when compiled,
   so the window stays in registers (a ring indexed at run time would live
   in local memory, with an integer division a step). total = N_batch *
   ceil(C/CB) * HW: consecutive threads take consecutive pixels (coalesced),
   and chunks of channels give the device enough threads (one thread a
   pixel, AlexNet's norm2 has a third of an H200's). */
#define CP_LRN_MAX 15

__device__ __forceinline__ unsigned long long cp_lrn_chunk(const unsigned i, const int C,
    const unsigned HW, const int CB, int* c0, int* c1)
{
    const unsigned chunks = (unsigned)((C + CB - 1) / CB);
    const unsigned rest = i / HW;
    *c0 = (int)(rest % chunks) * CB;
    *c1 = min(C, *c0 + CB);
    return (unsigned long long)(rest / chunks) * C * HW + (i % HW);
}

/* Channel j of the pixel at `base`, 0 outside [0, C). */
__device__ __forceinline__ float cp_lrn_x(const CP_A* x, const unsigned long long base,
    const int j, const int C, const unsigned HW)
{
    return (j >= 0 && j < C) ? (float)x[base + (unsigned long long)j * HW] : 0.0f;
}

/* Drops w[0], moves the rest down a slot and puts v in the last. */
template <int N>
__device__ __forceinline__ void cp_lrn_shift(float* w, const float v)
{
#pragma unroll
    for (int s = 0; s + 1 < N; ++s) w[s] = w[s + 1];
    w[N - 1] = v;
}

/* k + alpha/n * the sum of squares of the window, in channel order. */
template <int N>
__device__ __forceinline__ float cp_lrn_scale(const float* w, const float alpha_n,
    const float k)
{
    float sq = 0.0f;
#pragma unroll
    for (int s = 0; s < N; ++s) sq = __fadd_rn(sq, __fmul_rn(w[s], w[s]));
    return __fadd_rn(k, __fmul_rn(alpha_n, sq));
}

/* Channel steps whose loads a thread issues together before it uses any:
   a step's loads wait on memory, and one step's worth in flight a thread
   left the kernels far below the memory's speed. For Caffe's usual window
   of 5: 8 forward, 5 backward (a chunk's 16 + 4 steps in 4 rounds; 8 would
   take 72 registers, and every kernel here must fit blocks of 1,024
   threads, 64 registers). Fewer for wider windows, whose registers would
   otherwise set every size's (one kernel takes them all). Each step's math
   is as it would be one step at a time: the same bits. */
template <int N, int MOST>
__device__ constexpr int cp_lrn_steps() { return N <= 5 ? MOST : (N <= 9 ? 2 : 1); }

template <int N>
__device__ void cp_lrn_fwd_n(const CP_A* x, CP_A* y, const unsigned i, const int C,
    const unsigned HW, const float alpha_n, const float k, const float beta, const int CB)
{
    const int pre = (N - 1) / 2;
    int c0, c1;
    const unsigned long long base = cp_lrn_chunk(i, C, HW, CB, &c0, &c1);
    float w[N];                             // channels c-pre..c+pre
#pragma unroll
    for (int s = 1; s < N; ++s) w[s] = cp_lrn_x(x, base, c0 - pre - 1 + s, C, HW);
    constexpr int U = cp_lrn_steps<N, 8>();
    for (int cb = c0; cb < c1; cb += U) {
        float next[U];
#pragma unroll
        for (int u = 0; u < U; ++u) next[u] = cp_lrn_x(x, base, cb + u + pre, C, HW);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = cb + u;
            cp_lrn_shift<N>(w, next[u]);
            if (c >= c1) break;
            const float scale = cp_lrn_scale<N>(w, alpha_n, k);
            y[base + (unsigned long long)c * HW] = __fmul_rn(w[pre], __powf(scale, -beta));
        }
    }
}

/* Its backward (reads x, y and dy, as cuDNN's): dx_c = dy_c * scale_c^-beta
   - 2 alpha beta / n * x_c * sum over c-pre..c+pre of dy * y / scale.
   Step t finds scale_t and that ratio (0 outside [0, C)), then dx of
   channel c = t - pre, whose window of ratios is complete by then; a chunk
   starts pre channels early. Registers: x of t-pre..t+pre, the ratios of
   c-pre..c+pre, scale and dy of c..t, and the next steps' loads. */
template <int N>
__device__ void cp_lrn_bwd_n(const CP_A* x, const CP_A* y, const CP_A* dy, CP_A* dx,
    const unsigned i, const int C, const unsigned HW, const float alpha_n, const float k,
    const float beta, const float coef, const int CB)
{
    const int pre = (N - 1) / 2;
    int c0, c1;
    const unsigned long long base = cp_lrn_chunk(i, C, HW, CB, &c0, &c1);
    const int t0 = c0 - pre, t1 = c1 + pre;
    float xw[N], ratio[N], sc[pre + 1], dyw[pre + 1];
#pragma unroll
    for (int s = 1; s < N; ++s) xw[s] = cp_lrn_x(x, base, t0 - pre - 1 + s, C, HW);
#pragma unroll
    for (int s = 0; s < N; ++s) ratio[s] = 0.0f;
#pragma unroll
    for (int s = 0; s <= pre; ++s) sc[s] = dyw[s] = 0.0f;
    constexpr int U = cp_lrn_steps<N, 5>();
    for (int tb = t0; tb < t1; tb += U) {
        float xn[U], yn[U], dyn[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = tb + u;
            xn[u] = cp_lrn_x(x, base, t + pre, C, HW);
            yn[u] = cp_lrn_x(y, base, t, C, HW);
            dyn[u] = cp_lrn_x(dy, base, t, C, HW);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = tb + u;
            if (t >= t1) break;
            cp_lrn_shift<N>(xw, xn[u]);
            float r = 0.0f, scale = 0.0f, g = 0.0f;
            if (t >= 0 && t < C) {
                scale = cp_lrn_scale<N>(xw, alpha_n, k);
                g = dyn[u];
                r = __fdividef(__fmul_rn(g, yn[u]), scale);
            }
            cp_lrn_shift<N>(ratio, r);
            cp_lrn_shift<pre + 1>(sc, scale);
            cp_lrn_shift<pre + 1>(dyw, g);
            const int c = t - pre;
            if (c < c0) continue;
            float acc = 0.0f;
#pragma unroll
            for (int s = 0; s < N; ++s) acc = __fadd_rn(acc, ratio[s]);
            const float own = __fmul_rn(dyw[0], __powf(sc[0], -beta));
            dx[base + (unsigned long long)c * HW] =
                __fsub_rn(own, __fmul_rn(__fmul_rn(coef, xw[0]), acc));
        }
    }
}

/* One instance a window size: n odd, 1..CP_LRN_MAX (Caffe takes odd sizes
   only; the layer launches these for no other). */
#define CP_LRN_SIZES(F) F(1) F(3) F(5) F(7) F(9) F(11) F(13) F(15)

extern "C" __global__ void cp_lrn_fwd(const CP_A* x, CP_A* y, const unsigned total,
    const int C, const unsigned HW, const int n, const float alpha_n, const float k,
    const float beta, const int CB)
{
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += gridDim.x * blockDim.x) {
        switch (n) {
#define CP_LRN_FWD_CASE(S) case S: cp_lrn_fwd_n<S>(x, y, i, C, HW, alpha_n, k, beta, CB); break;
        CP_LRN_SIZES(CP_LRN_FWD_CASE)
#undef CP_LRN_FWD_CASE
        default: return;
        }
    }
}

extern "C" __global__ void cp_lrn_bwd(const CP_A* x, const CP_A* y, const CP_A* dy, CP_A* dx,
    const unsigned total, const int C, const unsigned HW, const int n, const float alpha_n,
    const float k, const float beta, const int CB)
{
    const float coef = __fmul_rn(2.0f * beta, alpha_n);
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += gridDim.x * blockDim.x) {
        switch (n) {
#define CP_LRN_BWD_CASE(S) case S: \
            cp_lrn_bwd_n<S>(x, y, dy, dx, i, C, HW, alpha_n, k, beta, coef, CB); break;
        CP_LRN_SIZES(CP_LRN_BWD_CASE)
#undef CP_LRN_BWD_CASE
        default: return;
        }
    }
}

/* Dropout in TRAIN (Caffe's: y = x * mask * scale, mask = u >= ratio): u
   from word i of Philox4x32-10 (Salmon et al., SC'11; Random123's rounds
   and constants), counter (i / 4, offset), key the seed, u = (word >> 8)
   / 2^24 in [0, 1). The seed and the offset are read from the device
   (state[0], state[1]), so a CUDA graph of the pass draws new masks on each
   replay: cp_dropout_step moves the offset after each draw (no block of
   this kernel may, the others still read it). mask: one byte a value. */
__device__ __forceinline__ unsigned cp_philox_word(unsigned long long seed,
    unsigned long long offset, unsigned long long i)
{
    unsigned c0 = (unsigned)(i >> 2), c1 = (unsigned)(i >> 34), c2 = (unsigned)offset,
             c3 = (unsigned)(offset >> 32), k0 = (unsigned)seed, k1 = (unsigned)(seed >> 32);
    for (int r = 0; r < 10; ++r) {
        const unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    const unsigned w = (unsigned)(i & 3);
    return w == 0 ? c0 : w == 1 ? c1 : w == 2 ? c2 : c3;
}

extern "C" __global__ void cp_dropout_fwd(const CP_A* x, CP_A* y, unsigned char* mask,
    const unsigned long long* state, const unsigned n, const float ratio, const float scale)
{
    const unsigned long long seed = state[0], offset = state[1];
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float u = (float)(cp_philox_word(seed, offset, i) >> 8) * (1.0f / 16777216.0f);
        const unsigned char keep = u >= ratio;
        mask[i] = keep;
        y[i] = __fmul_rn(__fmul_rn((float)x[i], keep ? 1.0f : 0.0f), scale);
    }
}

extern "C" __global__ void cp_dropout_step(unsigned long long* state)
{
    state[1] += 1;
}

/* Dropout backward: dx = dy * mask * scale (a NaN gradient stays NaN, as Caffe's). */
extern "C" __global__ void cp_dropout_bwd(const CP_A* dy, const unsigned char* mask, CP_A* dx,
    const unsigned n, const float scale)
{
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        dx[i] = __fmul_rn(__fmul_rn((float)dy[i], mask[i] ? 1.0f : 0.0f), scale);
}
'''

# The channels-last LRN and the relayout kernels (after the LRN helpers above).
EXTRA += LAYOUT
