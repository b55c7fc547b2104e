// Standalone check and timing of mold's fused attention kernel
// (crates/mold-exec/kernels/flash_attn.cu) against a naive fp32 reference, on one GPU.
//
//   nvcc -O3 -arch=sm_90 --use_fast_math -o flash_attn_test benches/attention/flash_attn_test.cu
//   ./flash_attn_test            # prints one line per case: max abs / rel error, ms, TFLOP/s
//
// Exit status 1 when a case exceeds the tolerance (bf16: 2e-2 relative to max |ref|).
#include "../../crates/mold-exec/kernels/flash_attn.cu"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e = (x);                                                                   \
        if (e != cudaSuccess) {                                                                \
            fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));          \
            exit(2);                                                                           \
        }                                                                                      \
    } while (0)

// One thread per (b, h, row): exact softmax in fp32; output (B, L, H, D) like the kernel.
template <typename T, int D>
__global__ void reference(const T *q, const T *k, const T *v, float *o, int B, int H, int lq,
                          int lk, float scale) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * H * lq) return;
    int row = idx % lq;
    int bh = idx / lq;
    int h = bh % H;
    int b = bh / H;
    const T *qr = q + ((size_t)bh * lq + row) * D;
    const T *kb = k + (size_t)bh * lk * D;
    const T *vb = v + (size_t)bh * lk * D;
    float qf[D];
    for (int d = 0; d < D; ++d) qf[d] = (float)qr[d];
    float m = -INFINITY;
    for (int j = 0; j < lk; ++j) {
        float s = 0;
        for (int d = 0; d < D; ++d) s += qf[d] * (float)kb[(size_t)j * D + d];
        m = fmaxf(m, s * scale);
    }
    float acc[D];
    for (int d = 0; d < D; ++d) acc[d] = 0;
    float sum = 0;
    for (int j = 0; j < lk; ++j) {
        float s = 0;
        for (int d = 0; d < D; ++d) s += qf[d] * (float)kb[(size_t)j * D + d];
        float p = expf(s * scale - m);
        sum += p;
        for (int d = 0; d < D; ++d) acc[d] += p * (float)vb[(size_t)j * D + d];
    }
    float *out = o + (((size_t)b * lq + row) * H + h) * D;
    for (int d = 0; d < D; ++d) out[d] = acc[d] / sum;
}

template <typename T> __global__ void fill(T *x, size_t n, uint32_t seed) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    uint32_t s = (uint32_t)i * 2654435761u ^ seed;
    s ^= s >> 13;
    s *= 0x5bd1e995u;
    s ^= s >> 15;
    x[i] = (T)(((s & 0xffff) / 65535.0f) * 4.0f - 2.0f);
}

template <typename T, int D>
int run_case(const char *name, void (*kern)(const T *, const T *, const T *, T *, int, int, int,
                                            float),
             int B, int H, int lq, int lk, bool check, int iters) {
    size_t nq = (size_t)B * H * lq * D, nk = (size_t)B * H * lk * D;
    T *q, *k, *v, *o;
    float *ref;
    CK(cudaMalloc(&q, nq * sizeof(T)));
    CK(cudaMalloc(&k, nk * sizeof(T)));
    CK(cudaMalloc(&v, nk * sizeof(T)));
    CK(cudaMalloc(&o, nq * sizeof(T)));
    CK(cudaMalloc(&ref, nq * sizeof(float)));
    fill<<<(nq + 255) / 256, 256>>>(q, nq, 1);
    fill<<<(nk + 255) / 256, 256>>>(k, nk, 2);
    fill<<<(nk + 255) / 256, 256>>>(v, nk, 3);
    float scale = 1.0f / sqrtf((float)D);
    int smem = MOLD_FA_SMEM(D);
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    dim3 grid((lq + mold_fa::BLOCK_M - 1) / mold_fa::BLOCK_M, H, B);
    kern<<<grid, mold_fa::THREADS, smem>>>(q, k, v, o, H, lq, lk, scale * 1.4426950408889634f);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    double max_abs = 0, max_ref = 0;
    if (check) {
        reference<T, D><<<(B * H * lq + 127) / 128, 128>>>(q, k, v, ref, B, H, lq, lk, scale);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        std::vector<T> ho(nq);
        std::vector<float> hr(nq);
        CK(cudaMemcpy(ho.data(), o, nq * sizeof(T), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hr.data(), ref, nq * sizeof(float), cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < nq; ++i) {
            double a = (double)(float)ho[i], r = hr[i];
            if (!std::isfinite(a)) max_abs = INFINITY;
            max_abs = fmax(max_abs, fabs(a - r));
            max_ref = fmax(max_ref, fabs(r));
        }
    }
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; ++i)
        kern<<<grid, mold_fa::THREADS, smem>>>(q, k, v, o, H, lq, lk, scale * 1.4426950408889634f);
    CK(cudaEventRecord(e0));
    for (int i = 0; i < iters; ++i)
        kern<<<grid, mold_fa::THREADS, smem>>>(q, k, v, o, H, lq, lk, scale * 1.4426950408889634f);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    ms /= iters;
    double flops = 4.0 * B * H * (double)lq * lk * D;
    double rel = check ? max_abs / fmax(max_ref, 1e-30) : 0;
    bool ok = !check || rel <= 2e-2;
    printf("%-34s B=%d H=%2d Lq=%5d Lk=%5d D=%3d  %s max_abs=%.3e rel=%.3e  %.3f ms  %.1f TFLOP/s\n",
           name, B, H, lq, lk, D, check ? (ok ? "ok  " : "FAIL") : "-   ", max_abs, rel, ms,
           flops / ms / 1e9);
    cudaFree(q);
    cudaFree(k);
    cudaFree(v);
    cudaFree(o);
    cudaFree(ref);
    return ok ? 0 : 1;
}

int main() {
    int fails = 0;
    // Edge cases: lengths that are not multiples of the tiles, tiny lengths, batch > 1.
    fails += run_case<__nv_bfloat16, 128>("bf16 d128 edge", mold_flash_fwd_bf16_d128, 2, 3, 77, 77, true, 5);
    fails += run_case<__nv_bfloat16, 128>("bf16 d128 cross", mold_flash_fwd_bf16_d128, 1, 2, 200, 333, true, 5);
    fails += run_case<__nv_bfloat16, 64>("bf16 d64 edge", mold_flash_fwd_bf16_d64, 2, 3, 130, 70, true, 5);
    fails += run_case<__half, 128>("f16 d128", mold_flash_fwd_f16_d128, 1, 4, 300, 300, true, 5);
    fails += run_case<__half, 64>("f16 d64", mold_flash_fwd_f16_d64, 1, 4, 257, 257, true, 5);
    // FLUX-dev at 1024²: 4096 image + 512 text tokens, 24 heads (TP2: 12, TP4: 6).
    fails += run_case<__nv_bfloat16, 128>("flux 1024² bf16 (1 GPU)", mold_flash_fwd_bf16_d128, 1, 24, 4608, 4608, true, 50);
    fails += run_case<__nv_bfloat16, 128>("flux 1024² bf16 (TP2 rank)", mold_flash_fwd_bf16_d128, 1, 12, 4608, 4608, false, 50);
    fails += run_case<__nv_bfloat16, 128>("flux 1024² bf16 (TP4 rank)", mold_flash_fwd_bf16_d128, 1, 6, 4608, 4608, false, 50);
    printf("%s\n", fails ? "FAILED" : "all ok");
    return fails ? 1 : 0;
}
