"""CUDA C source of the kernels that move maps between layouts or work on
channels-last ones, appended to caffeplus.kernel_sources_extra's EXTRA
(whose LRN helpers the channels-last LRN uses): tiled transposes between
Caffe's order and channels-last, Concat's row copies, the LRN over
channels-last maps, and space-to-depth images and filters."""

LAYOUT = r'''
/* Maps between Caffe's order and channels-last: dst[n][b][a] = src[n][a][b]
   for a < A, b < B, src's rows lds values apart (>= B), dst's ldd apart (>=
   A); with `pad`, dst's a in [A, ldd) are written 0 (an image padded to 4
   channels). One 32 x 32 tile a block of 256 threads, through shared
   memory, so that both the reads and the writes are of consecutive
   addresses: CuPy's copy through a transposed view, which strides one of
   them, took 0.9 ms of GoogLeNet's FP16 iteration. The values are moved as
   bits (T: unsigned short for 16-bit maps, unsigned for float32). */
template <class T>
__device__ __forceinline__ void cp_transpose_tile(const T* src, T* dst, unsigned A, unsigned B,
                                                  unsigned lds, unsigned ldd, unsigned pad)
{
    __shared__ T tile[32][33];
    const unsigned Ae = pad ? ldd : A;
    const unsigned ta = (Ae + 31) / 32, tb = (B + 31) / 32;
    unsigned q = blockIdx.x;
    const unsigned jb = q % tb;
    q /= tb;
    const unsigned ja = q % ta, n = q / ta;
    const unsigned tx = threadIdx.x & 31u, ty = threadIdx.x >> 5;
    const unsigned a0 = ja * 32, b0 = jb * 32;
    const T* s = src + (size_t)n * A * lds;
    T* d = dst + (size_t)n * B * ldd;
    for (unsigned k = ty; k < 32; k += 8) {
        const unsigned a = a0 + k, b = b0 + tx;
        tile[k][tx] = (a < A && b < B) ? s[(size_t)a * lds + b] : (T)0;
    }
    __syncthreads();
    for (unsigned k = ty; k < 32; k += 8) {
        const unsigned b = b0 + k, a = a0 + tx;
        if (b < B && a < Ae) d[(size_t)b * ldd + a] = tile[tx][k];
    }
}

extern "C" __global__ void cp_transpose2(const unsigned short* src, unsigned short* dst,
    const unsigned A, const unsigned B, const unsigned lds, const unsigned ldd, const unsigned pad)
{
    cp_transpose_tile<unsigned short>(src, dst, A, B, lds, ldd, pad);
}

extern "C" __global__ void cp_transpose4(const unsigned* src, unsigned* dst,
    const unsigned A, const unsigned B, const unsigned lds, const unsigned ldd, const unsigned pad)
{
    cp_transpose_tile<unsigned>(src, dst, A, B, lds, ldd, pad);
}

/* The same with dst's rows short (ldd <= NARROW_ROWS values: an image of 3
   channels relaid to 4): a thread a dst row, its a values read from a rows
   (consecutive threads, consecutive addresses) and its ldd values written
   together. One 32 x 32 tile a block left 7 of 8 threads idle there and
   took 0.4 ms to relay AlexNet's b128 image. */
template <class T>
__device__ __forceinline__ void cp_transpose_narrow(const T* src, T* dst, unsigned A, unsigned B,
                                                    unsigned lds, unsigned ldd, unsigned pad,
                                                    unsigned long long total)
{
    const unsigned Ae = pad ? ldd : A;
    for (unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         t < total; t += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long n = t / B;
        const unsigned b = (unsigned)(t - n * B);
        const T* s = src + n * A * lds + b;
        T* d = dst + (n * B + b) * ldd;
        for (unsigned a = 0; a < Ae; ++a)
            d[a] = a < A ? s[(size_t)a * lds] : (T)0;
    }
}

extern "C" __global__ void cp_transpose_narrow2(const unsigned short* src, unsigned short* dst,
    const unsigned A, const unsigned B, const unsigned lds, const unsigned ldd, const unsigned pad,
    const unsigned long long total)
{
    cp_transpose_narrow<unsigned short>(src, dst, A, B, lds, ldd, pad, total);
}

extern "C" __global__ void cp_transpose_narrow4(const unsigned* src, unsigned* dst,
    const unsigned A, const unsigned B, const unsigned lds, const unsigned ldd, const unsigned pad,
    const unsigned long long total)
{
    cp_transpose_narrow<unsigned>(src, dst, A, B, lds, ldd, pad, total);
}

/* `rows` rows of `width` bytes from src + src_off (rows src_pitch apart)
   to dst + dst_off (dst_pitch apart): Concat's bottoms into their column
   ranges of its top, and back. In the widest of 16, 8, 4, 2 or 1 bytes
   that divides every address, pitch and the width. cudaMemcpy2D moved
   channels-last rows of 64 to 256 bytes at a quarter of the memory's
   bandwidth (GoogLeNet's inceptions: 0.95 ms of an FP16 iteration). */
template <class V>
__device__ __forceinline__ void cp_copy_rows_as(const unsigned char* src, unsigned long long sp,
                                                unsigned char* dst, unsigned long long dp,
                                                unsigned long long width, unsigned rows)
{
    const unsigned wv = (unsigned)(width / sizeof(V));
    const unsigned total = rows * wv;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const unsigned r = i / wv, k = i - r * wv;
        *(V*)(dst + r * dp + (unsigned long long)k * sizeof(V)) =
            *(const V*)(src + r * sp + (unsigned long long)k * sizeof(V));
    }
}

struct alignas(16) cp_bytes16 { unsigned long long a, b; };

extern "C" __global__ void cp_copy_rows(const unsigned char* src, const unsigned long long src_off,
    const unsigned long long src_pitch, unsigned char* dst, const unsigned long long dst_off,
    const unsigned long long dst_pitch, const unsigned long long width, const unsigned rows)
{
    const unsigned char* s = src + src_off;
    unsigned char* d = dst + dst_off;
    const unsigned long long all = (unsigned long long)s | (unsigned long long)d | src_pitch |
                                   dst_pitch | width;
    if ((all & 15ull) == 0) cp_copy_rows_as<cp_bytes16>(s, src_pitch, d, dst_pitch, width, rows);
    else if ((all & 7ull) == 0) cp_copy_rows_as<unsigned long long>(s, src_pitch, d, dst_pitch, width, rows);
    else if ((all & 3ull) == 0) cp_copy_rows_as<unsigned>(s, src_pitch, d, dst_pitch, width, rows);
    else if ((all & 1ull) == 0) cp_copy_rows_as<unsigned short>(s, src_pitch, d, dst_pitch, width, rows);
    else cp_copy_rows_as<unsigned char>(s, src_pitch, d, dst_pitch, width, rows);
}

/* The same LRN over channels-last maps: thread i takes value i, channel
   c = i % C of the pixel whose C channels start at i - c, and adds its
   window's squares (and in backward its window's ratios, each from its own
   window) in channel order, as cp_lrn_fwd_n/cp_lrn_bwd_n do: the same bits.
   A pixel's channels are consecutive, so a warp's loads are too. */
__device__ __forceinline__ float cp_lrn_x_nhwc(const CP_A* x, const unsigned long long base,
                                               const int j, const int C)
{
    return (j >= 0 && j < C) ? (float)x[base + (unsigned)j] : 0.0f;
}

template <int N>
__device__ __forceinline__ float cp_lrn_scale_nhwc(const CP_A* x, const unsigned long long base,
    const int c, const int C, const float alpha_n, const float k)
{
    const int pre = (N - 1) / 2;
    float w[N];
#pragma unroll
    for (int s = 0; s < N; ++s) w[s] = cp_lrn_x_nhwc(x, base, c - pre + s, C);
    return cp_lrn_scale<N>(w, alpha_n, k);
}

template <int N>
__device__ void cp_lrn_fwd_nhwc_n(const CP_A* x, CP_A* y, const unsigned long long i,
    const int C, const float alpha_n, const float k, const float beta)
{
    const int c = (int)(i % (unsigned)C);
    const unsigned long long base = i - (unsigned)c;
    const float scale = cp_lrn_scale_nhwc<N>(x, base, c, C, alpha_n, k);
    y[i] = __fmul_rn((float)x[i], __powf(scale, -beta));
}

template <int N>
__device__ void cp_lrn_bwd_nhwc_n(const CP_A* x, const CP_A* y, const CP_A* dy, CP_A* dx,
    const unsigned long long i, const int C, const float alpha_n, const float k,
    const float beta, const float coef)
{
    const int pre = (N - 1) / 2;
    const int c = (int)(i % (unsigned)C);
    const unsigned long long base = i - (unsigned)c;
    float acc = 0.0f, own_scale = 0.0f;
#pragma unroll
    for (int s = 0; s < N; ++s) {
        const int t = c - pre + s;
        float r = 0.0f;
        if (t >= 0 && t < C) {
            const float scale = cp_lrn_scale_nhwc<N>(x, base, t, C, alpha_n, k);
            const unsigned long long o = base + (unsigned)t;
            r = __fdividef(__fmul_rn((float)dy[o], (float)y[o]), scale);
            if (s == pre) own_scale = scale;
        }
        acc = __fadd_rn(acc, r);
    }
    const float own = __fmul_rn((float)dy[i], __powf(own_scale, -beta));
    dx[i] = __fsub_rn(own, __fmul_rn(__fmul_rn(coef, (float)x[i]), acc));
}

extern "C" __global__ void cp_lrn_fwd_nhwc(const CP_A* x, CP_A* y, const unsigned total,
    const int C, const int n, const float alpha_n, const float k, const float beta)
{
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += gridDim.x * blockDim.x) {
        switch (n) {
#define CP_LRN_FWD_NHWC_CASE(S) case S: cp_lrn_fwd_nhwc_n<S>(x, y, i, C, alpha_n, k, beta); break;
        CP_LRN_SIZES(CP_LRN_FWD_NHWC_CASE)
#undef CP_LRN_FWD_NHWC_CASE
        default: return;
        }
    }
}

extern "C" __global__ void cp_lrn_bwd_nhwc(const CP_A* x, const CP_A* y, const CP_A* dy,
    CP_A* dx, const unsigned total, const int C, const int n, const float alpha_n,
    const float k, const float beta)
{
    const float coef = __fmul_rn(2.0f * beta, alpha_n);
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += gridDim.x * blockDim.x) {
        switch (n) {
#define CP_LRN_BWD_NHWC_CASE(S) case S: \
            cp_lrn_bwd_nhwc_n<S>(x, y, dy, dx, i, C, alpha_n, k, beta, coef); break;
        CP_LRN_SIZES(CP_LRN_BWD_NHWC_CASE)
#undef CP_LRN_BWD_NHWC_CASE
        default: return;
        }
    }
}
/* Space-to-depth (layers/conv_s2d.py): a convolution of stride s over C
   channels is a stride-1 convolution of ceil(kh/s) x ceil(kw/s) taps over
   C s^2 channels of s x s pixel blocks. x2 (N, C s^2, H2, W2), channels-last
   (nhwc) or in Caffe's order, channel q = (by s + bx) C + c holding
   x[n][c][s Y + by - ph][s X + bx - pw] (0 outside the image); x's element
   (n, c, h, w) at n sn + c sc + h sh + w sw (either order). */
extern "C" __global__ void cp_space_to_depth(const CP_A* x, CP_A* x2,
    const unsigned long long total, const int C, const int H, const int W, const int s,
    const int ph, const int pw, const int H2, const int W2, const unsigned long long sn,
    const unsigned long long sc, const unsigned long long sh, const unsigned long long sw,
    const int nhwc)
{
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long Q = (unsigned long long)C * s * s;
    const unsigned long long HW2 = (unsigned long long)H2 * W2;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < total; i += step) {
        unsigned long long q, p, n;
        if (nhwc) {
            q = i % Q;
            p = (i / Q) % HW2;
            n = i / (Q * HW2);
        } else {
            p = i % HW2;
            q = (i / HW2) % Q;
            n = i / (Q * HW2);
        }
        const int X = (int)(p % W2), Y = (int)(p / W2);
        const int c = (int)(q % C), b = (int)(q / C), by = b / s, bx = b - by * s;
        const int h = s * Y + by - ph, w = s * X + bx - pw;
        CP_A v = (CP_A)0.0f;
        if (h >= 0 && h < H && w >= 0 && w < W)
            v = x[n * sn + c * sc + h * sh + w * sw];
        x2[i] = v;
    }
}

/* The filters of that convolution: w2 (K, C s^2, KH2, KW2), channels-last
   (nhwc: K KH2 KW2 C s^2) or in Caffe's order, w2[k][(by s + bx) C + c][a][b]
   = w[k][c][s a + by][s b + bx] (0 past the kernel); w's element (k, c, i, j)
   at k wk + c wc + i wi + j wj. */
extern "C" __global__ void cp_s2d_filter(const CP_A* w, CP_A* w2, const unsigned total,
    const int C, const int KH, const int KW, const int s, const int KH2, const int KW2,
    const unsigned wk, const unsigned wc, const unsigned wi, const unsigned wj, const int nhwc)
{
    const unsigned Q = (unsigned)(C * s * s), T = (unsigned)(KH2 * KW2);
    for (unsigned t = blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += gridDim.x * blockDim.x) {
        const unsigned q = nhwc ? t % Q : (t / T) % Q, p = nhwc ? (t / Q) % T : t % T;
        const int b = (int)(p % KW2), a = (int)(p / KW2), k = (int)(t / (Q * T));
        const int c = (int)(q % C), blk = (int)(q / C), by = blk / s, bx = blk - by * s;
        const int i = s * a + by, j = s * b + bx;
        CP_A v = (CP_A)0.0f;
        if (i < KH && j < KW)
            v = w[k * wk + c * wc + i * wi + j * wj];
        w2[t] = v;
    }
}

/* dw (K, C, KH, KW) float32 += the filter gradient of that convolution,
   dw2 as cp_s2d_filter lays it out (the taps past the kernel dropped). */
extern "C" __global__ void cp_s2d_filter_grad(const CP_A* dw2, float* dw, const unsigned total,
    const int C, const int KH, const int KW, const int s, const int KH2, const int KW2,
    const int nhwc)
{
    const unsigned Q = (unsigned)(C * s * s);
    for (unsigned t = blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += gridDim.x * blockDim.x) {
        const int j = (int)(t % KW), i = (int)((t / KW) % KH), c = (int)((t / (KW * KH)) % C);
        const unsigned k = t / (unsigned)(KW * KH * C);
        const int a = i / s, by = i - a * s, b = j / s, bx = j - b * s;
        const unsigned q = (unsigned)((by * s + bx) * C + c);
        const unsigned at = nhwc ? ((k * KH2 + a) * KW2 + b) * Q + q
                                 : ((k * Q + q) * KH2 + a) * KW2 + b;
        dw[t] = __fadd_rn(dw[t], (float)dw2[at]);
    }
}
'''
