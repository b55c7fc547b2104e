// Softmax over the last dimension of contiguous rows, one block of 256 threads per row (the
// autoencoders' mid attention: 16384 x 16384 scores for FLUX at 1024x1024; launched from
// src/model/softmax.rs). Rows of up to 32768 elements are held in registers; longer ones are
// walked twice (softmax_row_long).
//
// The row is read once into registers (VPT 8-element vectors per thread), its maximum and
// the sum of exponentials reduced across the block in f32, and the normalised values written
// once, rounded once. (candle's softmax gives a row one warp and reads and writes it twice.)
//
// Requirements (checked by the caller): ncols % 8 == 0, and ncols <= 256 * 8 * VPT for the
// register-held kernels.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <float.h>
#include <stdint.h>

namespace mold_sm {

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

template <typename T> union Vec8 {
    uint4 raw;
    T v[8];
};

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;

// op 0: max, 1: sum.
template <int OP> __device__ __forceinline__ float block_reduce(float v, float *sh) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
        const float o = __shfl_xor_sync(0xffffffff, v, m);
        v = OP == 0 ? fmaxf(v, o) : v + o;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < WARPS ? sh[lane] : (OP == 0 ? -FLT_MAX : 0.f);
#pragma unroll
    for (int m = WARPS / 2; m > 0; m >>= 1) {
        const float o = __shfl_xor_sync(0xffffffff, v, m);
        v = OP == 0 ? fmaxf(v, o) : v + o;
    }
    // Lanes 0..WARPS-1 hold the block's value; every other lane reduced identities.
    return __shfl_sync(0xffffffff, v, 0);
}

template <typename T, int VPT> __device__ void softmax_row(const T *x, T *y, int ncols) {
    __shared__ float sh[WARPS];
    const long long row = blockIdx.x;
    const T *xr = x + row * ncols;
    T *yr = y + row * ncols;
    float v[VPT][8];
    float mx = -FLT_MAX;
#pragma unroll
    for (int k = 0; k < VPT; k++) {
        const int c = (k * THREADS + threadIdx.x) * 8;
        if (c < ncols) {
            Vec8<T> a;
            a.raw = *reinterpret_cast<const uint4 *>(xr + c);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                v[k][i] = tof<T>(a.v[i]);
                mx = fmaxf(mx, v[k][i]);
            }
        }
    }
    mx = block_reduce<0>(mx, sh);
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; k++) {
        const int c = (k * THREADS + threadIdx.x) * 8;
        if (c < ncols) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                v[k][i] = __expf(v[k][i] - mx);
                sum += v[k][i];
            }
        }
    }
    sum = block_reduce<1>(sum, sh);
    const float inv = 1.f / sum;
#pragma unroll
    for (int k = 0; k < VPT; k++) {
        const int c = (k * THREADS + threadIdx.x) * 8;
        if (c < ncols) {
            Vec8<T> o;
#pragma unroll
            for (int i = 0; i < 8; i++) o.v[i] = fromf<T>(v[k][i] * inv);
            *reinterpret_cast<uint4 *>(yr + c) = o.raw;
        }
    }
}

// Rows too long for registers (FLUX's 2048² decode: 65536 scores a row): each thread walks
// its vectors keeping a running maximum and a sum of exponentials rescaled to it, the block
// merges them, and a second walk writes exp(x - max) / sum. Reads the row twice.
template <typename T> __device__ void softmax_row_long(const T *x, T *y, int ncols) {
    __shared__ float sh[WARPS];
    const long long row = blockIdx.x;
    const T *xr = x + row * (long long)ncols;
    T *yr = y + row * (long long)ncols;
    float m = -FLT_MAX, s = 0.f;
    for (int c = threadIdx.x * 8; c < ncols; c += THREADS * 8) {
        Vec8<T> a;
        a.raw = *reinterpret_cast<const uint4 *>(xr + c);
        float lm = m;
#pragma unroll
        for (int i = 0; i < 8; i++) lm = fmaxf(lm, tof<T>(a.v[i]));
        s *= __expf(m - lm);
#pragma unroll
        for (int i = 0; i < 8; i++) s += __expf(tof<T>(a.v[i]) - lm);
        m = lm;
    }
    const float mx = block_reduce<0>(m, sh);
    // A thread that saw nothing holds (-FLT_MAX, 0): its share rescales to 0.
    s *= __expf(m - mx);
    const float inv = 1.f / block_reduce<1>(s, sh);
    for (int c = threadIdx.x * 8; c < ncols; c += THREADS * 8) {
        Vec8<T> a, o;
        a.raw = *reinterpret_cast<const uint4 *>(xr + c);
#pragma unroll
        for (int i = 0; i < 8; i++) o.v[i] = fromf<T>(__expf(tof<T>(a.v[i]) - mx) * inv);
        *reinterpret_cast<uint4 *>(yr + c) = o.raw;
    }
}

} // namespace mold_sm

#define MOLD_SOFTMAX(SUFFIX, T, VPT)                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        mold_softmax_v##VPT##_##SUFFIX(const T *x, T *y, int ncols) {                          \
        mold_sm::softmax_row<T, VPT>(x, y, ncols);                                             \
    }
#define MOLD_SOFTMAX_ALL(SUFFIX, T)                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        mold_softmax_long_##SUFFIX(const T *x, T *y, int ncols) {                              \
        mold_sm::softmax_row_long<T>(x, y, ncols);                                             \
    }                                                                                          \
    MOLD_SOFTMAX(SUFFIX, T, 1)                                                                 \
    MOLD_SOFTMAX(SUFFIX, T, 2)                                                                 \
    MOLD_SOFTMAX(SUFFIX, T, 4)                                                                 \
    MOLD_SOFTMAX(SUFFIX, T, 8)                                                                 \
    MOLD_SOFTMAX(SUFFIX, T, 16)

MOLD_SOFTMAX_ALL(bf16, __nv_bfloat16)
MOLD_SOFTMAX_ALL(f16, __half)
