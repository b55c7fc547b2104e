// GroupNorm (+ SiLU) and RMS norm (+ SiLU) over channels-last activations, nearest 2x
// up-sampling and the interleaving of four output phases into a 2x image, for the FLUX and
// Qwen-Image autoencoders' decoders (mold-exec, `cuda` feature; launched from
// src/model/group_norm.rs).
//
// x is (n, hw, c) contiguous: every pixel's c channels side by side. The statistics of
// each (image, group) are f32 and reduced in two levels, merged with Chan's formula (count,
// mean, sum of squared deviations), so a group of a million elements loses no precision
// to E[x^2] - E[x]^2:
//
//   gn_partial   grid (blocks, n), 256 threads: a block takes a chunk of pixels; each
//                thread one 8-channel vector of `lanes` = 256 / (c / 8) pixels at a time;
//                per-channel statistics, merged over the block's lanes, written as
//                part[n][block][c] = (count, mean, m2)
//   gn_finalize  grid (groups, n), 256 threads: merges a group's channels over all blocks;
//                writes ab[n][c] = (a, b) with y = x * a + b (a = gamma * rstd,
//                b = beta - mean * a)
//   gn_group_stats grid (groups, n): as gn_finalize, but writes each group's merged
//                (count, mean, m2), for statistics merged across devices first
//   gn_merge_ab  grid (groups, n): k bands' group statistics merged (f64) into (a, b)
//   gn_apply     grid (blocks, n), grid-stride over an image's 8-channel vectors:
//                y = x * a + b, SiLU when asked, rounded once to the element type
//
// Requirements (checked by the caller): c % 8 == 0, 256 % (c / 8) == 0, groups | c,
// h * w * c / 8 < 2^31.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace mold_gn {

template <typename T> __device__ __forceinline__ float tof(T v);
template <> __device__ __forceinline__ float tof<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}
template <> __device__ __forceinline__ float tof<__half>(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T fromf(float v);
template <> __device__ __forceinline__ __nv_bfloat16 fromf<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half fromf<__half>(float v) { return __float2half_rn(v); }

// Eight elements, 16 bytes.
template <typename T> union Vec8 {
    uint4 raw;
    T v[8];
};

struct Stat {
    float n, mean, m2;
};

__device__ __forceinline__ Stat merge(Stat a, Stat b) {
    const float n = a.n + b.n;
    if (n == 0.f) return a;
    const float d = b.mean - a.mean;
    const float fb = b.n / n;
    return Stat{n, a.mean + d * fb, a.m2 + b.m2 + d * d * a.n * fb};
}

constexpr int THREADS = 256;

template <typename T>
__device__ void partial(const T *x, float *part, int hw, int c, int chunk) {
    const int c8 = c / 8;
    const int lanes = THREADS / c8;
    const int v = threadIdx.x % c8;
    const int lane = threadIdx.x / c8;
    const long long n = blockIdx.y;
    const long long p0 = (long long)blockIdx.x * chunk;
    const long long p1 = min(p0 + chunk, (long long)hw);
    const T *xn = x + n * hw * c + v * 8;
    // Sums of deviations from the thread's first value (a shift against cancellation).
    float shift[8], s[8], ss[8];
#pragma unroll
    for (int i = 0; i < 8; i++) shift[i] = s[i] = ss[i] = 0.f;
    int cnt = 0;
    long long p = p0 + lane;
    if (p < p1) {
        Vec8<T> a;
        a.raw = *reinterpret_cast<const uint4 *>(xn + p * c);
#pragma unroll
        for (int i = 0; i < 8; i++) shift[i] = tof<T>(a.v[i]);
    }
    // Four pixels per step: four loads in flight before the arithmetic.
    for (; p + 3LL * lanes < p1; p += 4LL * lanes) {
        Vec8<T> a[4];
#pragma unroll
        for (int u = 0; u < 4; u++)
            a[u].raw = *reinterpret_cast<const uint4 *>(xn + (p + u * lanes) * c);
#pragma unroll
        for (int u = 0; u < 4; u++) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const float d = tof<T>(a[u].v[i]) - shift[i];
                s[i] += d;
                ss[i] += d * d;
            }
        }
        cnt += 4;
    }
    for (; p < p1; p += lanes) {
        Vec8<T> a;
        a.raw = *reinterpret_cast<const uint4 *>(xn + p * c);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float d = tof<T>(a.v[i]) - shift[i];
            s[i] += d;
            ss[i] += d * d;
        }
        cnt++;
    }
    // lanes x c statistics; THREADS * 8 entries whatever c is.
    __shared__ Stat sh[THREADS * 8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        Stat st{0.f, 0.f, 0.f};
        if (cnt > 0) {
            const float fn = (float)cnt;
            const float mean = s[i] / fn;
            st = Stat{fn, shift[i] + mean, fmaxf(ss[i] - s[i] * mean, 0.f)};
        }
        sh[lane * c + v * 8 + i] = st;
    }
    __syncthreads();
    for (int ch = threadIdx.x; ch < c; ch += THREADS) {
        Stat acc = sh[ch];
        for (int l = 1; l < lanes; l++) acc = merge(acc, sh[l * c + ch]);
        float *o = part + ((n * gridDim.x + blockIdx.x) * c + ch) * 3;
        o[0] = acc.n;
        o[1] = acc.mean;
        o[2] = acc.m2;
    }
}

// A group's statistics merged over its channels and the partial blocks, left in sh[0].
__device__ __forceinline__ void group_reduce(const float *part, Stat *sh, int blocks, int c,
                                             int groups) {
    const int cpg = c / groups;
    const int g = blockIdx.x;
    const long long n = blockIdx.y;
    Stat acc{0.f, 0.f, 0.f};
    for (int e = threadIdx.x; e < blocks * cpg; e += THREADS) {
        const int b = e / cpg;
        const int ch = g * cpg + e % cpg;
        const float *p = part + ((n * blocks + b) * c + ch) * 3;
        acc = merge(acc, Stat{p[0], p[1], p[2]});
    }
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (int w = THREADS / 2; w > 0; w /= 2) {
        if (threadIdx.x < w) sh[threadIdx.x] = merge(sh[threadIdx.x], sh[threadIdx.x + w]);
        __syncthreads();
    }
}

template <typename T>
__device__ void finalize(const float *part, const T *gamma, const T *beta, float *ab, int blocks,
                         int c, int groups, float eps) {
    const int cpg = c / groups;
    const int g = blockIdx.x;
    const long long n = blockIdx.y;
    __shared__ Stat sh[THREADS];
    __shared__ float mean_rstd[2];
    group_reduce(part, sh, blocks, c, groups);
    if (threadIdx.x == 0) {
        const Stat t = sh[0];
        const float var = t.n > 0.f ? t.m2 / t.n : 0.f;
        mean_rstd[0] = t.mean;
        mean_rstd[1] = rsqrtf(var + eps);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < cpg; i += THREADS) {
        const int ch = g * cpg + i;
        const float a = tof<T>(gamma[ch]) * mean_rstd[1];
        ab[(n * c + ch) * 2] = a;
        ab[(n * c + ch) * 2 + 1] = tof<T>(beta[ch]) - mean_rstd[0] * a;
    }
}

// grid (groups, n): stats[n][g] = (count, mean, m2), for statistics merged across devices
// (a decoder split into row bands) before the coefficients are made on the host.
__device__ void group_stats(const float *part, float *stats, int blocks, int c, int groups) {
    __shared__ Stat sh[THREADS];
    group_reduce(part, sh, blocks, c, groups);
    if (threadIdx.x == 0) {
        float *o = stats + ((long long)blockIdx.y * groups + blockIdx.x) * 3;
        o[0] = sh[0].n;
        o[1] = sh[0].mean;
        o[2] = sh[0].m2;
    }
}

// grid (groups, n): the statistics of k row bands of one image set, stats[b][n][g] = (count,
// mean, m2) as gn_group_stats wrote them on each band's device and gathered here, merged in
// f64 (Chan's formula, bands in order) into ab[n][c] = (a, b) as gn_finalize writes them: every
// band normalises with the whole image's statistics, the host never waits.
template <typename T>
__device__ void merge_ab(const float *stats, int k, const T *gamma, const T *beta, float *ab,
                         int images, int c, int groups, float eps) {
    const int cpg = c / groups;
    const int g = blockIdx.x;
    const long long n = blockIdx.y;
    __shared__ float mean_rstd[2];
    if (threadIdx.x == 0) {
        double cnt = 0.0, mean = 0.0, m2 = 0.0;
        for (int b = 0; b < k; b++) {
            const float *s = stats + (((long long)b * images + n) * groups + g) * 3;
            const double nb = s[0], mb = s[1], sb = s[2];
            const double tot = cnt + nb;
            if (tot == 0.0) continue;
            const double d = mb - mean;
            mean += d * nb / tot;
            m2 += sb + d * d * cnt * nb / tot;
            cnt = tot;
        }
        const double var = cnt > 0.0 ? m2 / cnt : 0.0;
        mean_rstd[0] = (float)mean;
        mean_rstd[1] = (float)(1.0 / sqrt(var + (double)eps));
    }
    __syncthreads();
    for (int i = threadIdx.x; i < cpg; i += blockDim.x) {
        const int ch = g * cpg + i;
        const float a = tof<T>(gamma[ch]) * mean_rstd[1];
        ab[(n * c + ch) * 2] = a;
        ab[(n * c + ch) * 2 + 1] = tof<T>(beta[ch]) - mean_rstd[0] * a;
    }
}

// grid (blocks, n): image blockIdx.y, its hw * c / 8 vectors grid-strided (32-bit indices).
template <typename T>
__device__ void apply(const T *x, const float *ab, T *y, int vecs, int c, int silu) {
    const long long n = blockIdx.y;
    const long long off = n * vecs * 8LL;
    const float2 *abn = reinterpret_cast<const float2 *>(ab) + n * c;
    const int c8 = c / 8;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < vecs; i += gridDim.x * blockDim.x) {
        const int ch = (i % c8) * 8;
        Vec8<T> a, o;
        a.raw = *reinterpret_cast<const uint4 *>(x + off + i * 8LL);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float2 m = abn[ch + k];
            float v = tof<T>(a.v[k]) * m.x + m.y;
            if (silu) v = v / (1.f + __expf(-v));
            o.v[k] = fromf<T>(v);
        }
        *reinterpret_cast<uint4 *>(y + off + i * 8LL) = o.raw;
    }
}

// (n, h, w, c) -> (n, 2h, 2w, c), each input vector of 8 channels written four times.
template <typename T>
__device__ void upsample2x(const T *x, T *y, long long vecs, int c, int h, int w) {
    const int c8 = c / 8;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < vecs;
         i += (long long)gridDim.x * blockDim.x) {
        const int v = (int)(i % c8);
        const long long pix = i / c8;
        const long long col = pix % w;
        const long long row = (pix / w) % h;
        const long long n = pix / ((long long)w * h);
        const uint4 val = reinterpret_cast<const uint4 *>(x)[i];
        const long long ow = 2LL * w;
        const long long base = ((n * 2 * h + 2 * row) * ow + 2 * col) * c + v * 8;
        uint4 *o = reinterpret_cast<uint4 *>(y + base);
        o[0] = val;
        o[c8] = val;
        reinterpret_cast<uint4 *>(y + base + ow * c)[0] = val;
        reinterpret_cast<uint4 *>(y + base + ow * c)[c8] = val;
    }
}

// Four (n, h, w, c) phases -> (n, 2h, 2w, c): y[n, 2i + a, 2j + b] = p[2a + b][n, i, j].
template <typename T>
__device__ void interleave2x(const T *p00, const T *p01, const T *p10, const T *p11, T *y,
                             long long vecs, int c, int h, int w) {
    const int c8 = c / 8;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < vecs;
         i += (long long)gridDim.x * blockDim.x) {
        const int v = (int)(i % c8);
        const long long pix = i / c8;
        const long long col = pix % w;
        const long long row = (pix / w) % h;
        const long long n = pix / ((long long)w * h);
        const long long ow = 2LL * w;
        const long long base = ((n * 2 * h + 2 * row) * ow + 2 * col) * c + v * 8;
        uint4 *o = reinterpret_cast<uint4 *>(y + base);
        o[0] = reinterpret_cast<const uint4 *>(p00)[i];
        o[c8] = reinterpret_cast<const uint4 *>(p01)[i];
        uint4 *o2 = reinterpret_cast<uint4 *>(y + base + ow * c);
        o2[0] = reinterpret_cast<const uint4 *>(p10)[i];
        o2[c8] = reinterpret_cast<const uint4 *>(p11)[i];
    }
}

// RMS norm over each pixel's channels (Qwen-Image's VAE: x / ||x||_2 * sqrt(c) * gamma, which
// is x / rms(x) * gamma), SiLU when asked: a warp per pixel, each lane one or two 8-channel
// vectors (c % 8 == 0, c <= 512), the sum of squares in f32, one rounding per output.
template <typename T>
__device__ void rms_rows(const T *x, const T *gamma, T *y, long long rows, int c, float eps,
                         int silu) {
    const int lane = threadIdx.x & 31;
    const int c8 = c >> 3;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows;
         r += warps) {
        const uint4 *xr = reinterpret_cast<const uint4 *>(x + r * c);
        Vec8<T> v[2];
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int i = lane + 32 * k;
            if (i < c8) {
                v[k].raw = xr[i];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float f = tof<T>(v[k].v[j]);
                    ss += f * f;
                }
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float inv = rsqrtf(ss / (float)c + eps);
        uint4 *yr = reinterpret_cast<uint4 *>(y + r * c);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int i = lane + 32 * k;
            if (i < c8) {
                Vec8<T> g, out;
                g.raw = reinterpret_cast<const uint4 *>(gamma)[i];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    float f = tof<T>(v[k].v[j]) * inv * tof<T>(g.v[j]);
                    if (silu) f = f / (1.f + __expf(-f));
                    out.v[j] = fromf<T>(f);
                }
                yr[i] = out.raw;
            }
        }
    }
}

} // namespace mold_gn

#define MOLD_GN_ALL(SUFFIX, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        mold_gn_partial_##SUFFIX(const T *x, float *part, int hw, int c, int chunk) {          \
        mold_gn::partial<T>(x, part, hw, c, chunk);                                            \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        mold_gn_finalize_##SUFFIX(const float *part, const T *gamma, const T *beta, float *ab, \
                                  int blocks, int c, int groups, float eps) {                  \
        mold_gn::finalize<T>(part, gamma, beta, ab, blocks, c, groups, eps);                   \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        mold_gn_group_stats_##SUFFIX(const float *part, float *stats, int blocks, int c,       \
                                     int groups) {                                             \
        mold_gn::group_stats(part, stats, blocks, c, groups);                                  \
    }                                                                                          \
    extern "C" __global__ void mold_gn_merge_ab_##SUFFIX(                                      \
        const float *stats, int k, const T *gamma, const T *beta, float *ab, int images, int c, \
        int groups, float eps) {                                                               \
        mold_gn::merge_ab<T>(stats, k, gamma, beta, ab, images, c, groups, eps);               \
    }                                                                                          \
    extern "C" __global__ void mold_gn_apply_##SUFFIX(const T *x, const float *ab, T *y,       \
                                                      int vecs, int c, int silu) {             \
        mold_gn::apply<T>(x, ab, y, vecs, c, silu);                                            \
    }                                                                                          \
    extern "C" __global__ void mold_upsample2x_##SUFFIX(const T *x, T *y, long long vecs,      \
                                                        int c, int h, int w) {                 \
        mold_gn::upsample2x<T>(x, y, vecs, c, h, w);                                           \
    }                                                                                          \
    extern "C" __global__ void mold_interleave2x_##SUFFIX(                                     \
        const T *p00, const T *p01, const T *p10, const T *p11, T *y, long long vecs, int c,   \
        int h, int w) {                                                                        \
        mold_gn::interleave2x<T>(p00, p01, p10, p11, y, vecs, c, h, w);                        \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) mold_rms_rows_##SUFFIX(                  \
        const T *x, const T *gamma, T *y, long long rows, int c, float eps, int silu) {        \
        mold_gn::rms_rows<T>(x, gamma, y, rows, c, eps, silu);                                 \
    }

MOLD_GN_ALL(bf16, __nv_bfloat16)
MOLD_GN_ALL(f16, __half)
