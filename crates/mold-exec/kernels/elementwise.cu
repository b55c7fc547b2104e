// Fused element-wise kernels for the FLUX blocks (mold-exec, `cuda` feature).
//
// candle's broadcast binary kernels compute every element's source index with 64-bit
// divisions over all dimensions; on a (1, 4608, 21504) bias add that costs ~3 ms on an
// H200 where the memory traffic needs 0.15 ms. These kernels take rows of `n` elements
// (row stride `ldx` for the input, so narrowed views need no copy), per-batch vectors with
// a batch stride, compute in f32 and round once.
//
// Launch: grid (rows, ceil(n / 2 / 256)), block 256; each thread handles one pair of
// columns (n must be even).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace mold_ew {

template <typename T> __device__ __forceinline__ float2 load2(const T *p);
template <> __device__ __forceinline__ float2 load2<__nv_bfloat16>(const __nv_bfloat16 *p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(p));
}
template <> __device__ __forceinline__ float2 load2<__half>(const __half *p) {
    return __half22float2(*reinterpret_cast<const __half2 *>(p));
}
template <> __device__ __forceinline__ float2 load2<float>(const float *p) {
    return *reinterpret_cast<const float2 *>(p);
}
template <typename T> __device__ __forceinline__ void store2(T *p, float2 v);
template <> __device__ __forceinline__ void store2<__nv_bfloat16>(__nv_bfloat16 *p, float2 v) {
    *reinterpret_cast<__nv_bfloat162 *>(p) = __float22bfloat162_rn(v);
}
template <> __device__ __forceinline__ void store2<__half>(__half *p, float2 v) {
    *reinterpret_cast<__half2 *>(p) = __float22half2_rn(v);
}
template <> __device__ __forceinline__ void store2<float>(float *p, float2 v) {
    *reinterpret_cast<float2 *>(p) = v;
}

__device__ __forceinline__ float gelu_tanh(float x) {
    const float k = 0.7978845608028654f; // sqrt(2 / pi)
    return 0.5f * x * (1.f + tanhf(k * (x + 0.044715f * x * x * x)));
}

} // namespace mold_ew

// y[r, c] = x[r, c] + b[c]   (act = 1: gelu_tanh of that; b may be null)
#define MOLD_EW_BIAS(NAME, T, ACT)                                                             \
    extern "C" __global__ void NAME(const T *x, const T *b, T *y, int n, long long ldx) {      \
        const int c = 2 * (blockIdx.y * blockDim.x + threadIdx.x);                             \
        if (c >= n) return;                                                                    \
        const long long r = blockIdx.x;                                                        \
        float2 v = mold_ew::load2<T>(x + r * ldx + c);                                         \
        if (b) {                                                                               \
            const float2 bb = mold_ew::load2<T>(b + c);                                        \
            v.x += bb.x;                                                                       \
            v.y += bb.y;                                                                       \
        }                                                                                      \
        if (ACT) {                                                                             \
            v.x = mold_ew::gelu_tanh(v.x);                                                     \
            v.y = mold_ew::gelu_tanh(v.y);                                                     \
        }                                                                                      \
        mold_ew::store2<T>(y + r * n + c, v);                                                  \
    }

// y[r, c] = x[r, c] * (1 + scale[b, c]) + shift[b, c], b = r / len
#define MOLD_EW_MODULATE(NAME, T)                                                              \
    extern "C" __global__ void NAME(const T *x, const T *scale, const T *shift, T *y, int n,    \
                                    long long ldx, int len, long long sscale,                  \
                                    long long sshift) {                                        \
        const int c = 2 * (blockIdx.y * blockDim.x + threadIdx.x);                             \
        if (c >= n) return;                                                                    \
        const long long r = blockIdx.x;                                                        \
        const long long bt = r / len;                                                          \
        const float2 v = mold_ew::load2<T>(x + r * ldx + c);                                   \
        const float2 s = mold_ew::load2<T>(scale + bt * sscale + c);                           \
        const float2 h = mold_ew::load2<T>(shift + bt * sshift + c);                           \
        mold_ew::store2<T>(y + r * n + c,                                                      \
                           make_float2(v.x * (1.f + s.x) + h.x, v.y * (1.f + s.y) + h.y));     \
    }

// y[r, c] = res[r, c] + gate[b, c] * (x[r, c] + bias[c]), b = r / len (bias may be null)
#define MOLD_EW_GATE(NAME, T)                                                                  \
    extern "C" __global__ void NAME(const T *res, const T *x, const T *bias, const T *gate,    \
                                    T *y, int n, long long ldres, long long ldx, int len,      \
                                    long long sgate) {                                         \
        const int c = 2 * (blockIdx.y * blockDim.x + threadIdx.x);                             \
        if (c >= n) return;                                                                    \
        const long long r = blockIdx.x;                                                        \
        const long long bt = r / len;                                                          \
        const float2 a = mold_ew::load2<T>(res + r * ldres + c);                               \
        float2 v = mold_ew::load2<T>(x + r * ldx + c);                                         \
        if (bias) {                                                                            \
            const float2 bb = mold_ew::load2<T>(bias + c);                                     \
            v.x += bb.x;                                                                       \
            v.y += bb.y;                                                                       \
        }                                                                                      \
        const float2 g = mold_ew::load2<T>(gate + bt * sgate + c);                             \
        mold_ew::store2<T>(y + r * n + c, make_float2(a.x + g.x * v.x, a.y + g.y * v.y));      \
    }

// LayerNorm without affine parameters, then modulation, one pass over memory:
// y[r, :] = (x[r, :] - mean) * rsqrt(var + eps) * (1 + scale[b, :]) + shift[b, :], b = r / len.
// One block per row; the row is staged in shared memory as f32 (n floats, dynamic), the
// mean and the variance (of the deviations, two passes over shared memory) in f32.
// Launch: grid (rows), block 256, shared n * 4 bytes.
namespace mold_ew {
__device__ __forceinline__ float block_sum(float v, float *red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads(); // red may still be read from the previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = 0.f;
    const int warps = blockDim.x / 32;
    for (int i = 0; i < warps; ++i) t += red[i];
    return t;
}
} // namespace mold_ew

// The row's mean and 1 / sqrt(variance + eps), the row staged in shared memory as f32.
namespace mold_ew {
template <typename T>
__device__ __forceinline__ float2 ln_row_stats(const T *__restrict__ xr, float *row, float *red,
                                               int n, float eps) {
    float s = 0.f;
    for (int c = 2 * threadIdx.x; c < n; c += 2 * blockDim.x) {
        const float2 v = load2<T>(xr + c);
        row[c] = v.x;
        row[c + 1] = v.y;
        s += v.x + v.y;
    }
    const float mean = block_sum(s, red) / n;
    float q = 0.f;
    for (int c = 2 * threadIdx.x; c < n; c += 2 * blockDim.x) {
        const float d0 = row[c] - mean, d1 = row[c + 1] - mean;
        q += d0 * d0 + d1 * d1;
    }
    return make_float2(mean, rsqrtf(block_sum(q, red) / n + eps));
}

// Columns c, c + 1 of a staged row, normalised and modulated (f32).
__device__ __forceinline__ float2 ln_modulated(const float *row, int c, float2 st, float2 sc,
                                               float2 sh) {
    return make_float2((row[c] - st.x) * st.y * (1.f + sc.x) + sh.x,
                       (row[c + 1] - st.x) * st.y * (1.f + sc.y) + sh.y);
}
} // namespace mold_ew

#define MOLD_EW_LN_MODULATE(NAME, T)                                                           \
    extern "C" __global__ void NAME(const T *x, const T *scale, const T *shift, T *y, int n,    \
                                    long long ldx, int len, long long sscale,                  \
                                    long long sshift, float eps) {                             \
        extern __shared__ float row[];                                                         \
        __shared__ float red[32];                                                              \
        const long long r = blockIdx.x;                                                        \
        const long long bt = r / len;                                                          \
        const float2 st = mold_ew::ln_row_stats<T>(x + r * ldx, row, red, n, eps);             \
        for (int c = 2 * threadIdx.x; c < n; c += 2 * blockDim.x) {                            \
            const float2 sc = mold_ew::load2<T>(scale + bt * sscale + c);                      \
            const float2 sh = mold_ew::load2<T>(shift + bt * sshift + c);                      \
            mold_ew::store2<T>(y + r * n + c, mold_ew::ln_modulated(row, c, st, sc, sh));      \
        }                                                                                      \
    }

// ln_modulate with its output quantized per row to e4m3 for an FP8 product, in the same
// pass: each value rounded to T first (what ln_modulate writes), then the row scaled by
// 448 / amax and rounded to e4m3 as kernels/fp8.cu's quantize_rows does — the same bits
// and scales as ln_modulate followed by quantize_rows. q (rows, n) bytes, qscale[r] =
// amax / 448 (1 for a zero or non-finite row). Launch: as ln_modulate.
namespace mold_ew {
__device__ __forceinline__ float block_max(float v, float *red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads(); // red may still be read from the previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = 0.f;
    const int warps = blockDim.x / 32;
    for (int i = 0; i < warps; ++i) t = fmaxf(t, red[i]);
    return t;
}
template <typename T> __device__ __forceinline__ float2 round2(float2 v);
template <> __device__ __forceinline__ float2 round2<__nv_bfloat16>(float2 v) {
    return __bfloat1622float2(__float22bfloat162_rn(v));
}
template <> __device__ __forceinline__ float2 round2<__half>(float2 v) {
    return __half22float2(__float22half2_rn(v));
}
} // namespace mold_ew

#define MOLD_EW_LN_MODULATE_FP8(NAME, T)                                                       \
    extern "C" __global__ void NAME(const T *x, const T *scale, const T *shift,                \
                                    __nv_fp8_storage_t *q, float *qscale, int n,               \
                                    long long ldx, int len, long long sscale,                  \
                                    long long sshift, float eps) {                             \
        extern __shared__ float row[];                                                         \
        __shared__ float red[32];                                                              \
        const long long r = blockIdx.x;                                                        \
        const long long bt = r / len;                                                          \
        const float2 st = mold_ew::ln_row_stats<T>(x + r * ldx, row, red, n, eps);             \
        float m = 0.f;                                                                         \
        for (int c = 2 * threadIdx.x; c < n; c += 2 * blockDim.x) {                            \
            const float2 sc = mold_ew::load2<T>(scale + bt * sscale + c);                      \
            const float2 sh = mold_ew::load2<T>(shift + bt * sshift + c);                      \
            const float2 v = mold_ew::round2<T>(mold_ew::ln_modulated(row, c, st, sc, sh));    \
            row[c] = v.x;                                                                      \
            row[c + 1] = v.y;                                                                  \
            m = fmaxf(m, fmaxf(fabsf(v.x), fabsf(v.y)));                                       \
        }                                                                                      \
        const float a = mold_ew::block_max(m, red);                                            \
        const bool ok = a > 0.0f && isfinite(a);                                               \
        const float inv = ok ? __fdiv_rn(448.0f, a) : 1.0f;                                    \
        if (threadIdx.x == 0) qscale[r] = ok ? __fdiv_rn(a, 448.0f) : 1.0f;                    \
        __nv_fp8_storage_t *qr = q + r * n;                                                    \
        for (int c = 2 * threadIdx.x; c < n; c += 2 * blockDim.x) {                            \
            qr[c] = __nv_cvt_float_to_fp8(__fmul_rn(row[c], inv), __NV_SATFINITE, __NV_E4M3); \
            qr[c + 1] =                                                                        \
                __nv_cvt_float_to_fp8(__fmul_rn(row[c + 1], inv), __NV_SATFINITE, __NV_E4M3); \
        }                                                                                      \
    }

// y[r, c] = act(x[r, c]) * x[r, n + c]: a gated feed-forward's two halves (one product's
// output, row stride ldx ≥ 2n) in one pass (act 0: SiLU, 1: tanh-GELU), y (rows, n)
#define MOLD_EW_GATED(NAME, T, ACT)                                                            \
    extern "C" __global__ void NAME(const T *x, T *y, int n, long long ldx) {                  \
        const int c = 2 * (blockIdx.y * blockDim.x + threadIdx.x);                             \
        if (c >= n) return;                                                                    \
        const long long r = blockIdx.x;                                                        \
        float2 a = mold_ew::load2<T>(x + r * ldx + c);                                         \
        const float2 g = mold_ew::load2<T>(x + r * ldx + n + c);                               \
        if (ACT) {                                                                             \
            a.x = mold_ew::gelu_tanh(a.x);                                                     \
            a.y = mold_ew::gelu_tanh(a.y);                                                     \
        } else {                                                                               \
            a.x = a.x / (1.f + __expf(-a.x));                                                  \
            a.y = a.y / (1.f + __expf(-a.y));                                                  \
        }                                                                                      \
        a.x *= g.x;                                                                            \
        a.y *= g.y;                                                                            \
        mold_ew::store2<T>(y + r * n + c, a);                                                  \
    }

#define MOLD_EW_ALL(SUFFIX, T)                                                                 \
    MOLD_EW_BIAS(mold_bias_add_##SUFFIX, T, 0)                                                 \
    MOLD_EW_BIAS(mold_bias_gelu_##SUFFIX, T, 1)                                                \
    MOLD_EW_MODULATE(mold_modulate_##SUFFIX, T)                                                \
    MOLD_EW_GATE(mold_gate_residual_##SUFFIX, T)                                              \
    MOLD_EW_LN_MODULATE(mold_ln_modulate_##SUFFIX, T)                                          \
    MOLD_EW_GATED(mold_gated_silu_##SUFFIX, T, 0)                                              \
    MOLD_EW_GATED(mold_gated_gelu_##SUFFIX, T, 1)

MOLD_EW_ALL(bf16, __nv_bfloat16)
MOLD_EW_ALL(f16, __half)
MOLD_EW_ALL(f32, float)
MOLD_EW_LN_MODULATE_FP8(mold_ln_modulate_fp8_bf16, __nv_bfloat16)
MOLD_EW_LN_MODULATE_FP8(mold_ln_modulate_fp8_f16, __half)

// q/k/v preparation for attention, one warp per (token, head): reads the row segments of
// q, k and v of the fused projection `qkv` (row = token, [q | k | v] each heads × D wide,
// row stride `ld`), applies RMSNorm (scale q_scale / k_scale) and RoPE (interleaved pairs,
// tables cos/sin (len_tot, D/2) per batch, in T or f32: the `_f32tab` kernels) to q and k, and
// writes q, k, v at sequence offset l_off — so txt and img segments land concatenated without
// a copy — either transposed into out = (3, B, heads, len_tot, D) (groups = 0) or as the
// messages of a sequence-parallel all-to-all (groups >= 1, see below; group `me`, if >= 0,
// at element `me_base` of out_me instead of its place in out). All loads of a warp (q, k, v, the tables, the scales)
// are issued before any arithmetic, so each warp keeps several requests in flight.
// With `amax` (else null): the largest magnitude of the q, k and v values written (as
// stored, in T; NaN skipped, as fp8.cu's amax3 does), for FP8 attention's per-tensor scales
// without a pass of their own: each block's maxima are folded by atomicMax (non-negative
// floats order as their bits) into slot blockIdx.x % QKV_AMAX_SLOTS of tensor `which`, at
// amax[(which * QKV_AMAX_SLOTS + slot) * QKV_AMAX_STRIDE]: a 128-byte line each, so that the
// blocks' atomics spread over the L2's slices instead of queueing at one line. The caller
// zeroes the buffer; fp8.cu's quantize3 reads the slots as its partial maxima.
// Launch: grid (ceil(len * heads / 4), B), block 128.
namespace mold_ew {
template <typename T> __device__ __forceinline__ float tof(T v);
template <> __device__ __forceinline__ float tof<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}
template <> __device__ __forceinline__ float tof<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float tof<float>(float v) { return v; }

// v as T stores it (round to nearest even, as store2), back in f32.
template <typename T> __device__ __forceinline__ float as_stored(float v);
template <> __device__ __forceinline__ float as_stored<__nv_bfloat16>(float v) {
    return __bfloat162float(__float2bfloat16_rn(v));
}
template <> __device__ __forceinline__ float as_stored<__half>(float v) {
    return __half2float(__float2half_rn(v));
}
template <> __device__ __forceinline__ float as_stored<float>(float v) { return v; }

constexpr int QKV_AMAX_SLOTS = 64;
constexpr int QKV_AMAX_STRIDE = 32;

// The block's (4 warps') largest magnitudes m[0..3] folded into amax (see qkv_prep). Every
// thread of the block calls it.
template <typename T> __device__ __forceinline__ void qkv_amax(float m[3], float *amax) {
    __shared__ float part[4][3];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int w = 0; w < 3; ++w) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m[w] = fmaxf(m[w], __shfl_xor_sync(0xffffffff, m[w], o));
        if (lane == 0) part[warp][w] = m[w];
    }
    __syncthreads();
    if (threadIdx.x < 3) {
        const int w = threadIdx.x;
        const float a = fmaxf(fmaxf(part[0][w], part[1][w]), fmaxf(part[2][w], part[3][w]));
        // Rounding is monotonic: the largest stored value is the largest value, stored.
        const float r = as_stored<T>(a);
        if (r > 0.f)
            atomicMax(reinterpret_cast<int *>(
                          amax + (w * QKV_AMAX_SLOTS + blockIdx.x % QKV_AMAX_SLOTS) *
                                     QKV_AMAX_STRIDE),
                      __float_as_int(r));
    }
}

template <typename T, typename C, int D>
__device__ __forceinline__ void qkv_prep(const T *qkv, long long ld, int len, int l_off,
                                         int len_tot, int heads, const T *q_scale,
                                         const T *k_scale, const C *cos_t, const C *sin_t,
                                         long long cs_batch, T *out, float eps, int groups,
                                         int me, T *out_me, long long me_base, float m[3]) {
    constexpr int E = D / 32; // elements per lane (even)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long idx = static_cast<long long>(blockIdx.x) * 4 + warp;
    const int h = idx % heads;
    const long long l = idx / heads;
    if (l >= len) return;
    const int b = blockIdx.y;
    const int B = gridDim.y;
    const T *src = qkv + (static_cast<long long>(b) * len + l) * ld +
                   static_cast<long long>(h) * D + lane * E;
    const long long hd = static_cast<long long>(heads) * D;
    const long long pos = l_off + l;
    const C *c = cos_t + b * cs_batch + pos * (D / 2) + lane * (E / 2);
    const C *s = sin_t + b * cs_batch + pos * (D / 2) + lane * (E / 2);
    float x[3][E], cs[E / 2], sn[E / 2], w[2][E];
#pragma unroll
    for (int which = 0; which < 3; ++which) {
#pragma unroll
        for (int e = 0; e < E; e += 2) {
            const float2 v = load2<T>(src + which * hd + e);
            x[which][e] = v.x;
            x[which][e + 1] = v.y;
        }
    }
#pragma unroll
    for (int e = 0; e < E / 2; ++e) {
        cs[e] = tof<C>(c[e]);
        sn[e] = tof<C>(s[e]);
    }
#pragma unroll
    for (int e = 0; e < E; e += 2) {
        const float2 a = load2<T>(q_scale + lane * E + e);
        const float2 k = load2<T>(k_scale + lane * E + e);
        w[0][e] = a.x;
        w[0][e + 1] = a.y;
        w[1][e] = k.x;
        w[1][e + 1] = k.y;
    }
    float ss[2] = {0.f, 0.f};
#pragma unroll
    for (int which = 0; which < 2; ++which)
#pragma unroll
        for (int e = 0; e < E; ++e) ss[which] += x[which][e] * x[which][e];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        ss[0] += __shfl_xor_sync(0xffffffff, ss[0], o);
        ss[1] += __shfl_xor_sync(0xffffffff, ss[1], o);
    }
#pragma unroll
    for (int which = 0; which < 2; ++which) {
        const float r = rsqrtf(ss[which] / D + eps);
#pragma unroll
        for (int e = 0; e < E; e += 2) {
            const float x0 = x[which][e] * r * w[which][e];
            const float x1 = x[which][e + 1] * r * w[which][e + 1];
            const float cc = cs[e / 2], sv = sn[e / 2];
            x[which][e] = x0 * cc - x1 * sv;
            x[which][e + 1] = x0 * sv + x1 * cc;
        }
    }
    // groups == 0: (3, B, heads, len_tot, D). groups >= 1: the heads in `groups` groups
    // (sequence.rs's `split`: the first heads % groups one head more), group j's heads
    // hs_j written token-major as (len_tot, 3, B, hs_j, D), the groups one after another:
    // each group is one contiguous all-to-all message.
    long long base = 0, row = 0, hstride = 0;
    T *dst0 = out;
    if (groups > 0) {
        const int q = heads / groups, r = heads % groups, big = r * (q + 1);
        int hs, hl, hstart;
        if (h < big) {
            hs = q + 1;
            hl = h % hs;
            hstart = h - hl;
        } else {
            hs = q;
            hl = (h - big) % q;
            hstart = h - hl;
        }
        // Group `me` (this rank's own heads) goes to out_me + me_base instead: its place in
        // the buffer the other ranks' pieces are received into.
        if ((h < big ? h / hs : r + (h - big) / q) == me) {
            dst0 = out_me + me_base;
        } else {
            dst0 = out + static_cast<long long>(hstart) * 3 * B * len_tot * D;
        }
        base = static_cast<long long>(hl) * D;
        row = static_cast<long long>(hs) * D; // one (token, which, b) row of the group
        hstride = 3LL * B * row;              // one token
    }
#pragma unroll
    for (int which = 0; which < 3; ++which) {
        T *dst = groups > 0
                     ? dst0 + base + pos * hstride + (static_cast<long long>(which) * B + b) * row +
                           lane * E
                     : out + ((static_cast<long long>(which) * B + b) * heads + h) * len_tot * D +
                           pos * D + lane * E;
#pragma unroll
        for (int e = 0; e < E; e += 2) {
            store2<T>(dst + e, make_float2(x[which][e], x[which][e + 1]));
            // fmaxf skips a NaN.
            m[which] = fmaxf(m[which], fmaxf(fabsf(x[which][e]), fabsf(x[which][e + 1])));
        }
    }
}
} // namespace mold_ew

#define MOLD_QKV_PREP(NAME, T, C, D)                                                           \
    extern "C" __global__ void NAME(const T *qkv, long long ld, int len, int l_off,            \
                                    int len_tot, int heads, const T *q_scale,                  \
                                    const T *k_scale, const C *cos_t, const C *sin_t,          \
                                    long long cs_batch, T *out, float eps, int groups, int me, \
                                    T *out_me, long long me_base, float *amax) {               \
        float m[3] = {0.f, 0.f, 0.f};                                                          \
        mold_ew::qkv_prep<T, C, D>(qkv, ld, len, l_off, len_tot, heads, q_scale, k_scale,       \
                                   cos_t, sin_t, cs_batch, out, eps, groups, me, out_me,       \
                                   me_base, m);                                                \
        if (amax != nullptr) mold_ew::qkv_amax<T>(m, amax);                                    \
    }
#define MOLD_QKV_PREP_ALL(SUFFIX, T, D)                                                        \
    MOLD_QKV_PREP(mold_qkv_prep_##SUFFIX##_d##D, T, T, D)                                     \
    MOLD_QKV_PREP(mold_qkv_prep_##SUFFIX##_d##D##_f32tab, T, float, D)

MOLD_QKV_PREP_ALL(bf16, __nv_bfloat16, 128)
MOLD_QKV_PREP_ALL(bf16, __nv_bfloat16, 64)
MOLD_QKV_PREP_ALL(f16, __half, 128)
MOLD_QKV_PREP_ALL(f16, __half, 64)
MOLD_QKV_PREP(mold_qkv_prep_f32_d128, float, float, 128)
MOLD_QKV_PREP(mold_qkv_prep_f32_d64, float, float, 64)

// Grouped-query q/k/v preparation (Qwen2's attention): from the fused projection `qkv` (row =
// token, [q | k | v] heads·D, kv·D and kv·D wide, row stride `ld`), q and k rotated by the
// rotate-half RoPE (f32 tables cos/sin (len, D/2)), and k and v repeated to the query heads
// (head h reads key/value head h / (heads / kv)), written as out = (3, len, heads, D).
// Launch: grid (len, heads, 3), block D/2; thread i handles the pair (i, i + D/2).
namespace mold_ew {
template <typename T> __device__ __forceinline__ T fromf(float v);
template <> __device__ __forceinline__ __nv_bfloat16 fromf<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half fromf<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ float fromf<float>(float v) { return v; }

template <typename T>
__device__ __forceinline__ void qkv_rope_gqa(const T *qkv, long long ld, int len, int heads,
                                             int kv, int d, const float *cos_t,
                                             const float *sin_t, T *out) {
    const int half = d / 2;
    const int i = threadIdx.x;
    if (i >= half) return;
    const long long t = blockIdx.x;
    const int h = blockIdx.y, which = blockIdx.z;
    const int g = h / (heads / kv);
    const int src_head = which == 0 ? h : (which == 1 ? heads + g : heads + kv + g);
    const T *src = qkv + t * ld + static_cast<long long>(src_head) * d;
    float x1 = tof<T>(src[i]), x2 = tof<T>(src[i + half]);
    if (which < 2) {
        const float c = cos_t[t * half + i], s = sin_t[t * half + i];
        const float y1 = x1 * c - x2 * s;
        x2 = x2 * c + x1 * s;
        x1 = y1;
    }
    T *dst = out + ((static_cast<long long>(which) * len + t) * heads + h) * d;
    dst[i] = fromf<T>(x1);
    dst[i + half] = fromf<T>(x2);
}
} // namespace mold_ew

#define MOLD_QKV_ROPE_GQA(NAME, T)                                                             \
    extern "C" __global__ void NAME(const T *qkv, long long ld, int len, int heads, int kv,    \
                                    int d, const float *cos_t, const float *sin_t, T *out) {   \
        mold_ew::qkv_rope_gqa<T>(qkv, ld, len, heads, kv, d, cos_t, sin_t, out);               \
    }
MOLD_QKV_ROPE_GQA(mold_qkv_rope_gqa_bf16, __nv_bfloat16)
MOLD_QKV_ROPE_GQA(mold_qkv_rope_gqa_f16, __half)
MOLD_QKV_ROPE_GQA(mold_qkv_rope_gqa_f32, float)

// Pieces put side by side along the last dimension (the attention output's head groups after
// a sequence-parallel all-to-all): piece (rows, w) into out (rows, ld) at column col, every
// width counted in 16-byte units, one thread per unit. Type-blind.
extern "C" __global__ void mold_join_columns(const uint4 *src, uint4 *dst, long long rows, int w,
                                             int ld, int col) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= rows * w) return;
    const long long r = i / w;
    const int c = static_cast<int>(i - r * w);
    dst[r * ld + col + c] = src[i];
}
