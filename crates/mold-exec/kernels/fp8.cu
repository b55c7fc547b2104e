// FP8 (e4m3) conversions for mold's FP8 products (mold-exec, `cuda` feature).
//
// quantize_rows: each row of a (rows, k) bf16/f16 matrix scaled by its own factor into
//   e4m3: amax = max |x|, q = sat(x * (448 / amax)), scale = amax / 448 (1 for a zero
//   row). The same arithmetic as the CPU reference (src/model/fp8/mod.rs): f32, IEEE
//   division (explicit, whatever --use_fast_math says), round to nearest even, saturated
//   at ±448, NaN kept.
//   Launch: grid (rows), block 256.
// quantize_rows_vec: quantize_rows for rows of k = 8·n values (16-byte aligned), k ≤ 16384:
//   each thread loads its 8-value pieces of the row once into registers (16-byte loads),
//   takes their amax, and writes their e4m3 values 8 bytes at a time: the row is read once,
//   not twice. The same values and scale as quantize_rows. Launch: grid (rows), block 256.
// quantize_cols: as quantize_rows with the whole row's scale, writing only columns
//   c0 .. c0 + len, at column out_col of a (rows, kout) output. Launch: grid (rows), block 256.
// dequantize_rows: out = q * scale[row] in bf16/f16 (the weight-only path on GPUs without
//   FP8 products; FP8 attention's output widened to be sent under sequence parallelism).
//   Launch: grid (rows, ceil(k / 256)), block 256.
// dequantize_rows_vec: dequantize_rows for k a multiple of 8, 8 values a thread. Launch:
//   grid (rows, ceil(k / 8 / 256)), block 256.
// amax3 / quantize3: three tensors (attention's q, k and v) of n values each (n a multiple
//   of 8, 16-byte aligned) quantized to e4m3 with one scale per tensor, for cuDNN's FP8
//   attention. The three are (b, h, L, d) views with the same strides (d contiguous, every
//   8-value piece 16-byte aligned: View4), read in place; quantize3 writes them contiguous.
//   amax3: block (x, y) writes the largest magnitude of its share of tensor y to
//   partial[y * P + x] (P = gridDim.x). quantize3: every block takes tensor y's amax over
//   its P partials, partial[(y * P + i) * stride] (amax3's, stride 1, or those elementwise.cu's
//   q/k/v preparation takes as it writes q, k and v, a 128-byte line apart: then amax3 does
//   not run), scales by 448 / amax (1 for a zero or non-finite tensor) and writes its
//   share as e4m3 at q3 + y * n; block (0, y) writes the descale amax / 448 to scales[4 * y], block (0, 0)
//   also the probabilities' descale 1 / 448 and scale 448 at scales[12] and scales[16], and
//   block (0, 2) v's factor 448 / amax at scales[20]: the attention output's scale, as its
//   values are averages of v's (one value per 16 bytes: cuDNN's scalar tensors are 16-byte
//   aligned); the blocks (.., 2) also write v's descale (the value at scales[8]) to each of
//   the output's `tokens` rows, v_tokens[0 .. tokens]: its per-token scales. Launch: grid
//   (P or any, 3), block 256.
// quantize_thirds: the q/k/v all-to-all's messages in e4m3 (sequence parallelism with FP8
//   attention). x holds n values (n a multiple of 8, 16-byte aligned) laid out as `(.., 3,
//   inner)`: value e belongs to tensor (e / inner) % 3 (inner a multiple of 8: a
//   piece never straddles two); each is scaled by 448 / amax of its tensor, amax folded as
//   quantize3 folds it from partial[(y * parts + i) * pstride] (every rank's maxima one
//   after another: one scale per tensor agreed by the group, as one GPU takes it), and
//   written as e4m3 to q (n values, same layout). Where `scales` is not null, block 0 writes
//   the six scales as quantize3 does, and the blocks write v's descale to v_tokens[0 ..
//   tokens]. The same factors, so the same bits, as quantize3 given the same maxima.
//   Launch: grid any, block 256.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace mold_fp8 {

constexpr int THREADS = 256;
constexpr float E4M3_MAX = 448.0f;

__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

// The largest of the block's threads' `m`, in every thread.
__device__ float block_max(float m) {
    __shared__ float part[THREADS / 32];
    __shared__ float all;
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        float a = 0.0f;
        for (int w = 0; w < THREADS / 32; ++w) a = fmaxf(a, part[w]);
        all = a;
    }
    __syncthreads();
    return all;
}

// Row `blockIdx.x`'s factor 448 / amax, amax the largest of the block's threads' `m` (1
// for a zero or non-finite row), its scale amax / 448 written to scale[row]; every thread
// of the block gets the factor.
__device__ float block_factor(float m, float *__restrict__ scale) {
    const float a = block_max(m);
    // A zero (or non-finite) row keeps scale 1: its values are 0 either way.
    const bool ok = a > 0.0f && isfinite(a);
    if (threadIdx.x == 0) scale[blockIdx.x] = ok ? __fdiv_rn(a, E4M3_MAX) : 1.0f;
    return ok ? __fdiv_rn(E4M3_MAX, a) : 1.0f;
}

// Row `blockIdx.x`'s factor over its k values (block_factor).
template <typename T>
__device__ float row_factor(const T *__restrict__ xr, float *__restrict__ scale, int k) {
    float m = 0.0f;
    for (int i = threadIdx.x; i < k; i += THREADS) m = fmaxf(m, fabsf(to_f(xr[i])));
    return block_factor(m, scale);
}

// 8 values of T (16 bytes) times `inv`, each rounded to e4m3 (nearest even, saturated at
// ±448, a NaN kept): 8 bytes.
template <typename T> __device__ __forceinline__ uint2 pack8_e4m3(uint4 v, float inv) {
    static_assert(sizeof(T) == 2, "8 values in 16 bytes");
    const T *e = reinterpret_cast<const T *>(&v);
    union {
        uint2 u;
        __nv_fp8_storage_t b[8];
    } out;
#pragma unroll
    for (int t = 0; t < 8; ++t)
        out.b[t] = __nv_cvt_float_to_fp8(__fmul_rn(to_f(e[t]), inv), __NV_SATFINITE, __NV_E4M3);
    return out.u;
}

// Pieces of 8 values a thread holds at most: rows up to 8 · 8 · THREADS = 16384 values.
constexpr int VEC_PIECES = 8;

template <typename T>
__device__ void quantize_rows_vec(const T *__restrict__ x, __nv_fp8_storage_t *__restrict__ q,
                                  float *__restrict__ scale, int k) {
    static_assert(sizeof(T) == 2, "8 values in 16 bytes");
    const int64_t row = blockIdx.x;
    const uint4 *xr = reinterpret_cast<const uint4 *>(x + row * (int64_t)k);
    uint2 *qr = reinterpret_cast<uint2 *>(q + row * (int64_t)k);
    const int n = k / 8;
    uint4 v[VEC_PIECES];
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < VEC_PIECES; ++j) {
        const int i = threadIdx.x + j * THREADS;
        if (i < n) {
            v[j] = xr[i];
            const T *e = reinterpret_cast<const T *>(&v[j]);
#pragma unroll
            for (int t = 0; t < 8; ++t) m = fmaxf(m, fabsf(to_f(e[t])));
        }
    }
    const float inv = block_factor(m, scale);
#pragma unroll
    for (int j = 0; j < VEC_PIECES; ++j) {
        const int i = threadIdx.x + j * THREADS;
        if (i < n) qr[i] = pack8_e4m3<T>(v[j], inv);
    }
}

template <typename T>
__device__ void quantize_rows(const T *__restrict__ x, __nv_fp8_storage_t *__restrict__ q,
                              float *__restrict__ scale, int k) {
    const int64_t row = blockIdx.x;
    const T *xr = x + row * (int64_t)k;
    __nv_fp8_storage_t *qr = q + row * (int64_t)k;
    const float inv = row_factor(xr, scale, k);
    for (int i = threadIdx.x; i < k; i += THREADS) {
        // Saturated at ±448 by the conversion; a NaN stays NaN (as on the CPU).
        qr[i] = __nv_cvt_float_to_fp8(__fmul_rn(to_f(xr[i]), inv), __NV_SATFINITE, __NV_E4M3);
    }
}

// Columns c0 .. c0 + len of each row, scaled by the whole row's factor, written at column
// out_col of q (rows, kout): a row-parallel piece of a weight quantized as the whole row is.
template <typename T>
__device__ void quantize_cols(const T *__restrict__ x, __nv_fp8_storage_t *__restrict__ q,
                              float *__restrict__ scale, int k, int c0, int len, int out_col,
                              int kout) {
    const int64_t row = blockIdx.x;
    const T *xr = x + row * (int64_t)k;
    __nv_fp8_storage_t *qr = q + row * (int64_t)kout + out_col;
    const float inv = row_factor(xr, scale, k);
    for (int i = threadIdx.x; i < len; i += THREADS) {
        qr[i] = __nv_cvt_float_to_fp8(__fmul_rn(to_f(xr[c0 + i]), inv), __NV_SATFINITE,
                                      __NV_E4M3);
    }
}

template <typename T>
__device__ void dequantize_rows(const __nv_fp8_storage_t *__restrict__ q,
                                const float *__restrict__ scale, T *__restrict__ out, int k) {
    const int64_t row = blockIdx.x;
    const int i = blockIdx.y * THREADS + threadIdx.x;
    if (i >= k) return;
    __half_raw h = __nv_cvt_fp8_to_halfraw(q[row * (int64_t)k + i], __NV_E4M3);
    float v = __half2float(__half(h));
    out[row * (int64_t)k + i] = from_f<T>(__fmul_rn(v, scale[row]));
}

// dequantize_rows for rows of k = 8·n values (8-byte aligned): each thread widens 8 values,
// read 8 bytes at a time and written 16 at a time. The same values as dequantize_rows.
template <typename T>
__device__ void dequantize_rows_vec(const __nv_fp8_storage_t *__restrict__ q,
                                    const float *__restrict__ scale, T *__restrict__ out, int k) {
    static_assert(sizeof(T) == 2, "8 values in 16 bytes");
    const int64_t row = blockIdx.x;
    const int i = blockIdx.y * THREADS + threadIdx.x;
    if (i >= k / 8) return;
    const uint2 v = reinterpret_cast<const uint2 *>(q + row * (int64_t)k)[i];
    const __nv_fp8_storage_t *e = reinterpret_cast<const __nv_fp8_storage_t *>(&v);
    const float s = scale[row];
    union {
        uint4 u;
        T t[8];
    } o;
#pragma unroll
    for (int t = 0; t < 8; ++t) {
        __half_raw h = __nv_cvt_fp8_to_halfraw(e[t], __NV_E4M3);
        o.t[t] = from_f<T>(__fmul_rn(__half2float(__half(h)), s));
    }
    reinterpret_cast<uint4 *>(out + row * (int64_t)k)[i] = o.u;
}

// Tensor blockIdx.y of (x0, x1, x2).
template <typename T>
__device__ __forceinline__ const T *pick3(const T *x0, const T *x1, const T *x2) {
    return blockIdx.y == 0 ? x0 : (blockIdx.y == 1 ? x1 : x2);
}

// Where 8-value piece i of a (b, h, L, d) view with strides (sb, sh, sl, 1) starts, in values
// (d a multiple of 8): i · 8 where the view is contiguous (`dense`), as one rank's q, k and v
// are; under sequence parallelism they are views of the all-to-all's (L, 3, b, h, d) buffer,
// read in place (each 8-value piece still 16 contiguous bytes).
struct View4 {
    bool dense;
    uint32_t h, l, dp; // heads, tokens, pieces a row (d / 8)
    int64_t sb, sh, sl;
};

__device__ __forceinline__ int64_t piece_at(const View4 &w, int64_t i) {
    if (w.dense) return i * 8;
    const uint32_t row = (uint32_t)(i / w.dp), p = (uint32_t)(i - (int64_t)row * w.dp);
    const uint32_t li = row % w.l, bh = row / w.l;
    return (int64_t)(bh / w.h) * w.sb + (int64_t)(bh % w.h) * w.sh + (int64_t)li * w.sl +
           (int64_t)p * 8;
}

template <typename T>
__device__ void amax3(const T *__restrict__ x0, const T *__restrict__ x1,
                      const T *__restrict__ x2, int64_t n, View4 w, float *__restrict__ partial) {
    const T *x = pick3(x0, x1, x2);
    const int64_t pieces = n / 8;
    float m = 0.0f;
    for (int64_t i = blockIdx.x * (int64_t)THREADS + threadIdx.x; i < pieces;
         i += (int64_t)gridDim.x * THREADS) {
        const uint4 v = *reinterpret_cast<const uint4 *>(x + piece_at(w, i));
        const T *e = reinterpret_cast<const T *>(&v);
#pragma unroll
        for (int t = 0; t < 8; ++t) m = fmaxf(m, fabsf(to_f(e[t])));
    }
    m = block_max(m);
    if (threadIdx.x == 0) partial[blockIdx.y * gridDim.x + blockIdx.x] = m;
}

template <typename T>
__device__ void quantize3(const T *__restrict__ x0, const T *__restrict__ x1,
                          const T *__restrict__ x2, int64_t n, View4 w,
                          const float *__restrict__ partial,
                          int parts, int pstride, __nv_fp8_storage_t *__restrict__ q3,
                          float *__restrict__ scales, int64_t tokens,
                          float *__restrict__ v_tokens) {
    float m = 0.0f;
    for (int i = threadIdx.x; i < parts; i += THREADS)
        m = fmaxf(m, partial[(blockIdx.y * (int64_t)parts + i) * pstride]);
    const float a = block_max(m);
    const bool ok = a > 0.0f && isfinite(a);
    const float inv = ok ? __fdiv_rn(E4M3_MAX, a) : 1.0f;
    const float descale = ok ? __fdiv_rn(a, E4M3_MAX) : 1.0f;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        scales[4 * blockIdx.y] = descale;
        // v's factor is the attention output's scale too: |o| <= amax(v).
        if (blockIdx.y == 2) scales[20] = inv;
        if (blockIdx.y == 0) {
            scales[12] = __fdiv_rn(1.0f, E4M3_MAX);
            scales[16] = E4M3_MAX;
        }
    }
    // Every token of the attention output has v's descale: v's blocks write it per token.
    if (blockIdx.y == 2)
        for (int64_t i = blockIdx.x * (int64_t)THREADS + threadIdx.x; i < tokens;
             i += (int64_t)gridDim.x * THREADS)
            v_tokens[i] = descale;
    const T *x = pick3(x0, x1, x2);
    uint2 *q = reinterpret_cast<uint2 *>(q3 + blockIdx.y * n);
    const int64_t pieces = n / 8;
    for (int64_t i = blockIdx.x * (int64_t)THREADS + threadIdx.x; i < pieces;
         i += (int64_t)gridDim.x * THREADS) {
        q[i] = pack8_e4m3<T>(*reinterpret_cast<const uint4 *>(x + piece_at(w, i)), inv);
    }
}


template <typename T>
__device__ void quantize_thirds(const T *__restrict__ x, int64_t n, int64_t inner,
                                const float *__restrict__ partial, int parts, int pstride,
                                __nv_fp8_storage_t *__restrict__ q, float *__restrict__ scales,
                                int64_t tokens, float *__restrict__ v_tokens) {
    float inv[3], descale[3];
#pragma unroll
    for (int y = 0; y < 3; ++y) {
        float m = 0.0f;
        for (int i = threadIdx.x; i < parts; i += THREADS)
            m = fmaxf(m, partial[(y * (int64_t)parts + i) * pstride]);
        const float a = block_max(m);
        const bool ok = a > 0.0f && isfinite(a);
        inv[y] = ok ? __fdiv_rn(E4M3_MAX, a) : 1.0f;
        descale[y] = ok ? __fdiv_rn(a, E4M3_MAX) : 1.0f;
    }
    if (scales != nullptr) {
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            scales[0] = descale[0];
            scales[4] = descale[1];
            scales[8] = descale[2];
            scales[12] = __fdiv_rn(1.0f, E4M3_MAX);
            scales[16] = E4M3_MAX;
            scales[20] = inv[2];
        }
        for (int64_t i = blockIdx.x * (int64_t)THREADS + threadIdx.x; i < tokens;
             i += (int64_t)gridDim.x * THREADS)
            v_tokens[i] = descale[2];
    }
    const uint4 *xv = reinterpret_cast<const uint4 *>(x);
    uint2 *qv = reinterpret_cast<uint2 *>(q);
    const int64_t pieces = n / 8;
    for (int64_t i = blockIdx.x * (int64_t)THREADS + threadIdx.x; i < pieces;
         i += (int64_t)gridDim.x * THREADS) {
        const int w = (int)(((i * 8) / inner) % 3);
        const float f = w == 0 ? inv[0] : (w == 1 ? inv[1] : inv[2]);
        qv[i] = pack8_e4m3<T>(xv[i], f);
    }
}

} // namespace mold_fp8

#define MOLD_FP8(T, SUFFIX)                                                                    \
    extern "C" __global__ void mold_fp8_quantize_rows_##SUFFIX(                               \
        const T *x, __nv_fp8_storage_t *q, float *scale, int k) {                             \
        mold_fp8::quantize_rows<T>(x, q, scale, k);                                           \
    }                                                                                          \
    extern "C" __global__ void mold_fp8_quantize_rows_vec_##SUFFIX(                           \
        const T *x, __nv_fp8_storage_t *q, float *scale, int k) {                             \
        mold_fp8::quantize_rows_vec<T>(x, q, scale, k);                                       \
    }                                                                                          \
    extern "C" __global__ void mold_fp8_quantize_cols_##SUFFIX(                               \
        const T *x, __nv_fp8_storage_t *q, float *scale, int k, int c0, int len, int out_col,  \
        int kout) {                                                                            \
        mold_fp8::quantize_cols<T>(x, q, scale, k, c0, len, out_col, kout);                    \
    }                                                                                          \
    extern "C" __global__ void mold_fp8_dequantize_rows_##SUFFIX(                             \
        const __nv_fp8_storage_t *q, const float *scale, T *out, int k) {                     \
        mold_fp8::dequantize_rows<T>(q, scale, out, k);                                       \
    }                                                                                          \
    extern "C" __global__ void mold_fp8_dequantize_rows_vec_##SUFFIX(                         \
        const __nv_fp8_storage_t *q, const float *scale, T *out, int k) {                     \
        mold_fp8::dequantize_rows_vec<T>(q, scale, out, k);                                   \
    }                                                                                          \
    extern "C" __global__ void mold_fp8_amax3_##SUFFIX(                                       \
        const T *x0, const T *x1, const T *x2, int64_t n, int dense, uint32_t h, uint32_t l,   \
        uint32_t dp, int64_t sb, int64_t sh, int64_t sl, float *partial) {                     \
        mold_fp8::amax3<T>(x0, x1, x2, n, mold_fp8::View4{dense != 0, h, l, dp, sb, sh, sl},   \
                           partial);                                                           \
    }                                                                                          \
    extern "C" __global__ void mold_fp8_quantize3_##SUFFIX(                                   \
        const T *x0, const T *x1, const T *x2, int64_t n, int dense, uint32_t h, uint32_t l,   \
        uint32_t dp, int64_t sb, int64_t sh, int64_t sl, const float *partial, int parts,      \
        int pstride, __nv_fp8_storage_t *q3, float *scales, int64_t tokens, float *v_tokens) { \
        mold_fp8::quantize3<T>(x0, x1, x2, n,                                                 \
                               mold_fp8::View4{dense != 0, h, l, dp, sb, sh, sl}, partial,     \
                               parts, pstride, q3, scales, tokens, v_tokens);                  \
    }                                                                                          \
    extern "C" __global__ void mold_fp8_quantize_thirds_##SUFFIX(                             \
        const T *x, int64_t n, int64_t inner, const float *partial, int parts, int pstride,    \
        __nv_fp8_storage_t *q, float *scales, int64_t tokens, float *v_tokens) {               \
        mold_fp8::quantize_thirds<T>(x, n, inner, partial, parts, pstride, q, scales, tokens,  \
                                     v_tokens);                                                \
    }

MOLD_FP8(__nv_bfloat16, bf16)
MOLD_FP8(__half, f16)
