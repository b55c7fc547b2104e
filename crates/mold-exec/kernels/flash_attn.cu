// Fused scaled-dot-product attention (FlashAttention-2 style forward) for mold.
//
// softmax(Q Kᵀ · scale) V without materialising the L×L score matrix: each CTA owns
// BLOCK_M = 128 query rows of one (batch, head); its 8 warps own 16 rows each. Key/value
// tiles of BLOCK_N = 64 rows stream through shared memory (cp.async, double buffered)
// while the warps run tensor-core MMAs (mma.sync m16n8k16, bf16 or f16 in, f32
// accumulate) with an online softmax in registers. P never leaves registers: the S
// accumulators of Q Kᵀ are re-packed as the A operand of P V.
//
// Layouts: q (B, H, Lq, D), k and v (B, H, Lk, D), all contiguous; the output is written
// as (B, Lq, H, D) — the layout the transformer needs next, which saves a transpose.
// Rows beyond Lq / Lk are zero-filled on load and masked, so any length works.
//
// Built by mold-exec's build.rs with nvcc into PTX for the `cuda` feature; also included
// by the standalone harness benches/attention/flash_attn_test.cu.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace mold_fa {

constexpr int BLOCK_M = 128;
constexpr int BLOCK_N = 64;
constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;

template <typename T> struct Mma;

template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float *c, const uint32_t *a, const uint32_t *b) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
};

template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float *c, const uint32_t *a, const uint32_t *b) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
};

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global → shared; `valid == false` zero-fills the destination.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool valid) {
    int src_size = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_size));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t *r, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t *r, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Shared-memory tiles are rows of D elements = D/8 chunks of 16 bytes; chunk c of row r
// is stored at chunk (c ^ (r & 7)) so the 8 rows an ldmatrix reads hit distinct banks.
template <int D> __device__ __forceinline__ uint32_t swz(int row, int chunk) {
    return static_cast<uint32_t>(row * D * 2 + ((chunk ^ (row & 7)) << 4));
}

// Copy `rows` rows of a (L, D) matrix starting at row `row0` into a swizzled tile.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_tile(uint32_t tile, const T *src, int row0, int len) {
    constexpr int CHUNKS = D / 8;
    constexpr int TOTAL = ROWS * CHUNKS;
    static_assert(TOTAL % THREADS == 0, "tile chunks must divide among threads");
#pragma unroll
    for (int i = 0; i < TOTAL / THREADS; ++i) {
        int idx = threadIdx.x + i * THREADS;
        int r = idx / CHUNKS;
        int c = idx % CHUNKS;
        int gr = row0 + r;
        bool valid = gr < len;
        const T *p = src + static_cast<size_t>(valid ? gr : 0) * D + c * 8;
        cp_async16(tile + swz<D>(r, c), p, valid);
    }
}

template <typename T, int D>
__device__ __forceinline__ void flash_fwd(const T *__restrict__ q, const T *__restrict__ k,
                                          const T *__restrict__ v, T *__restrict__ o, int heads,
                                          int lq, int lk, float scale_log2) {
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int KSTEPS = D / 16;        // k-steps of Q Kᵀ over the head dimension
    constexpr int S_TILES = BLOCK_N / 8;  // n-tiles of S per warp
    constexpr int O_TILES = D / 8;        // n-tiles of O per warp
    constexpr int Q_BYTES = BLOCK_M * D * 2;
    constexpr int KV_BYTES = BLOCK_N * D * 2;

    const int m_block = blockIdx.x;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;   // row within an 8-row group of a fragment
    const int tig = lane % 4; // thread in group

    const size_t bh = static_cast<size_t>(b) * heads + h;
    const T *qb = q + bh * lq * D;
    const T *kb = k + bh * lk * D;
    const T *vb = v + bh * lk * D;

    const uint32_t q_s = smem_u32(smem);
    // K tiles at k_s + buf * KV_BYTES, V tiles at v_s + buf * KV_BYTES (buf = 0, 1).
    const uint32_t k_s = q_s + Q_BYTES;
    const uint32_t v_s = q_s + Q_BYTES + 2 * KV_BYTES;

    const int n_tiles = (lk + BLOCK_N - 1) / BLOCK_N;

    load_tile<T, D, BLOCK_M>(q_s, qb, m_block * BLOCK_M, lq);
    load_tile<T, D, BLOCK_N>(k_s, kb, 0, lk);
    load_tile<T, D, BLOCK_N>(v_s, vb, 0, lk);
    cp_async_commit();

    // Q fragments for this warp's 16 rows, kept in registers for the whole loop.
    uint32_t qf[KSTEPS][4];
    cp_async_wait<0>();
    __syncthreads();
    {
        const int r = warp * 16 + (lane % 8) + ((lane / 8) & 1) * 8;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            const int c = ks * 2 + lane / 16;
            ldmatrix_x4(qf[ks], q_s + swz<D>(r, c));
        }
    }

    float acc[O_TILES][4];
#pragma unroll
    for (int t = 0; t < O_TILES; ++t)
        acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.f, 0.f};

    for (int j = 0; j < n_tiles; ++j) {
        const uint32_t cur = (j & 1) * KV_BYTES;
        const uint32_t next = KV_BYTES - cur;
        // Prefetch the next K/V tile into the other buffer (freed by the barrier that
        // ended the previous iteration).
        if (j + 1 < n_tiles) {
            load_tile<T, D, BLOCK_N>(k_s + next, kb, (j + 1) * BLOCK_N, lk);
            load_tile<T, D, BLOCK_N>(v_s + next, vb, (j + 1) * BLOCK_N, lk);
        }
        cp_async_commit();

        // S = Q Kᵀ for 16 rows × BLOCK_N keys.
        float s[S_TILES][4];
#pragma unroll
        for (int t = 0; t < S_TILES; ++t)
            s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
            for (int nt = 0; nt < S_TILES; nt += 2) {
                uint32_t kf[4];
                const int r = nt * 8 + (lane % 8) + (lane / 16) * 8;
                const int c = ks * 2 + ((lane / 8) & 1);
                ldmatrix_x4(kf, k_s + cur + swz<D>(r, c));
                Mma<T>::run(s[nt], qf[ks], kf);
                Mma<T>::run(s[nt + 1], qf[ks], kf + 2);
            }
        }

        // Mask keys past the end (only the last tile can have them).
        if ((j + 1) * BLOCK_N > lk) {
#pragma unroll
            for (int t = 0; t < S_TILES; ++t) {
                const int col = j * BLOCK_N + t * 8 + tig * 2;
                if (col >= lk) s[t][0] = s[t][2] = -INFINITY;
                if (col + 1 >= lk) s[t][1] = s[t][3] = -INFINITY;
            }
        }

        // Online softmax; rows g (elements 0,1) and g + 8 (elements 2,3); a row is spread
        // over the 4 threads of a quad.
        float new_max[2] = {row_max[0], row_max[1]};
#pragma unroll
        for (int t = 0; t < S_TILES; ++t) {
            new_max[0] = fmaxf(new_max[0], fmaxf(s[t][0], s[t][1]) * scale_log2);
            new_max[1] = fmaxf(new_max[1], fmaxf(s[t][2], s[t][3]) * scale_log2);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            new_max[i] = fmaxf(new_max[i], __shfl_xor_sync(0xffffffff, new_max[i], 1));
            new_max[i] = fmaxf(new_max[i], __shfl_xor_sync(0xffffffff, new_max[i], 2));
        }
        float corr[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            corr[i] = exp2f(row_max[i] - new_max[i]);
            row_max[i] = new_max[i];
            row_sum[i] *= corr[i];
        }
#pragma unroll
        for (int t = 0; t < O_TILES; ++t) {
            acc[t][0] *= corr[0];
            acc[t][1] *= corr[0];
            acc[t][2] *= corr[1];
            acc[t][3] *= corr[1];
        }
        uint32_t pf[S_TILES / 2][4];
#pragma unroll
        for (int t = 0; t < S_TILES; ++t) {
            const float p0 = exp2f(s[t][0] * scale_log2 - new_max[0]);
            const float p1 = exp2f(s[t][1] * scale_log2 - new_max[0]);
            const float p2 = exp2f(s[t][2] * scale_log2 - new_max[1]);
            const float p3 = exp2f(s[t][3] * scale_log2 - new_max[1]);
            row_sum[0] += p0 + p1;
            row_sum[1] += p2 + p3;
            // A fragment of P for k-step t/2: tiles 2kk → regs 0,1; 2kk+1 → regs 2,3.
            pf[t / 2][(t % 2) * 2 + 0] = Mma<T>::pack(p0, p1);
            pf[t / 2][(t % 2) * 2 + 1] = Mma<T>::pack(p2, p3);
        }

        // O += P V.
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
#pragma unroll
            for (int nt = 0; nt < O_TILES; nt += 2) {
                uint32_t vf[4];
                const int r = kk * 16 + (lane % 8) + ((lane / 8) & 1) * 8;
                const int c = nt + lane / 16;
                ldmatrix_x4_trans(vf, v_s + cur + swz<D>(r, c));
                Mma<T>::run(acc[nt], pf[kk], vf);
                Mma<T>::run(acc[nt + 1], pf[kk], vf + 2);
            }
        }

        cp_async_wait<0>();
        __syncthreads();
    }

    // Finish the row sums across the quad and normalise.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        row_sum[i] += __shfl_xor_sync(0xffffffff, row_sum[i], 1);
        row_sum[i] += __shfl_xor_sync(0xffffffff, row_sum[i], 2);
    }
    const float inv0 = row_sum[0] > 0.f ? 1.f / row_sum[0] : 0.f;
    const float inv1 = row_sum[1] > 0.f ? 1.f / row_sum[1] : 0.f;
    const int row0 = m_block * BLOCK_M + warp * 16 + g;
    const int row1 = row0 + 8;
#pragma unroll
    for (int t = 0; t < O_TILES; ++t) {
        const int d = t * 8 + tig * 2;
        if (row0 < lq) {
            T *p = o + ((static_cast<size_t>(b) * lq + row0) * heads + h) * D + d;
            *reinterpret_cast<uint32_t *>(p) = Mma<T>::pack(acc[t][0] * inv0, acc[t][1] * inv0);
        }
        if (row1 < lq) {
            T *p = o + ((static_cast<size_t>(b) * lq + row1) * heads + h) * D + d;
            *reinterpret_cast<uint32_t *>(p) = Mma<T>::pack(acc[t][2] * inv1, acc[t][3] * inv1);
        }
    }
}

} // namespace mold_fa

// Shared memory each kernel needs: one Q tile and two K and two V tiles.
#define MOLD_FA_SMEM(D) ((mold_fa::BLOCK_M + 4 * mold_fa::BLOCK_N) * (D) * 2)

#define MOLD_FA_KERNEL(NAME, T, D)                                                             \
    extern "C" __global__ void __launch_bounds__(mold_fa::THREADS, 1)                          \
        NAME(const T *q, const T *k, const T *v, T *o, int heads, int lq, int lk,              \
             float scale_log2) {                                                               \
        mold_fa::flash_fwd<T, D>(q, k, v, o, heads, lq, lk, scale_log2);                       \
    }

MOLD_FA_KERNEL(mold_flash_fwd_bf16_d128, __nv_bfloat16, 128)
MOLD_FA_KERNEL(mold_flash_fwd_bf16_d64, __nv_bfloat16, 64)
MOLD_FA_KERNEL(mold_flash_fwd_f16_d128, __half, 128)
MOLD_FA_KERNEL(mold_flash_fwd_f16_d64, __half, 64)
