// Fast mode's decode attention over candidate indices for 64-head blocks of 512-wide heads
// (V4-Flash's and V4-Pro's widths), in CUDA C++ for Hopper: one block of 8 warps per (query row,
// 64-head group), the candidates in chunks of 64 read from the pools by index.
//
// Memory: the block's queries (64 x 512 bf16) and two chunk stages (64 candidate rows each) sit in
// shared memory, swizzled (16-byte segment s of row r at s ^ (r & 7)) so that eight rows read at one
// column are eight different banks. Candidate rows arrive by cp.async, the next chunk's while this
// one computes; a hidden candidate (-1, or an index outside [0, N)) is a zero-filled row that is
// never read from memory and scores -inf. The chunk's row addresses are looked up one chunk ahead.
//
// Work: warp w owns heads 16 (w & 3) .. +16 and output columns 256 (w >> 2) .. +256. Its scores
// are a partial sum over its 256 columns (mma.sync m16n8k16, bf16 in, fp32 out); the two warps of
// a head group swap partials through shared memory and both add them (a + b is b + a, so both hold
// the same scores). Online softmax in base 2 (the scale carries log2 e), from the sink alone
// (M = sink, L = 1); p is rounded to bf16 for p @ v, whose B operand is the same chunk rows read
// transposed (key == value). The output A / L goes back through shared memory to 16-byte stores.
//
// QN: the queries are RMS-normalised per head first (weightless, fp32, rounded back to bf16) in
// shared memory, so normalised queries are never written to or read from device memory.

#include <cuda_bf16.h>
#include <stdint.h>

#define HB 64          // heads a block
#define DW 512         // head width
#define CH 64          // candidates a chunk
#define ROWB 1024      // bytes of one 512-wide bf16 row
#define NTHREADS 256
#define SMEM_Q 0
#define SMEM_K (HB * ROWB)                 // two stages of CH rows
#define SMEM_X (SMEM_K + 2 * CH * ROWB)    // score partials: 8 warps x 32 floats x 32 lanes
#define SMEM_I (SMEM_X + 8 * 32 * 32 * 4)  // row addresses: 4 slots x CH (0: hidden)
#define SMEM_N (SMEM_I + 4 * CH * 8)       // the live chunk count
#define SMEM_BYTES (SMEM_N + 16)

__device__ __forceinline__ uint32_t swz(int r, int s) { return (uint32_t)(r * ROWB + ((s ^ (r & 7)) << 4)); }

__device__ __forceinline__ void cp16(uint32_t dst, const void *src, bool ok) {
    int n = ok ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldm4(uint32_t a, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
__device__ __forceinline__ void ldm4t(uint32_t a, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
__device__ __forceinline__ void mma(float *c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
__device__ __forceinline__ float ex2(float x) {  // 2^x (ex2.approx: -inf gives +0)
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n)); }

// the address of candidate column j's pool row, 0 for none
template <typename IT>
__device__ __forceinline__ uint64_t cand(int j, int64_t t, const __nv_bfloat16 *P0, const IT *I0, int64_t s_i0,
                                         int K0, int N0, const __nv_bfloat16 *P1, const IT *I1, int64_t s_i1,
                                         int K1, int N1) {
    if (j < K0) {
        int64_t r = (int64_t)I0[t * s_i0 + j];
        return (r >= 0 && r < N0) ? (uint64_t)(P0 + r * DW) : 0;
    }
    j -= K0;
    if (j < K1) {
        int64_t r = (int64_t)I1[t * s_i1 + j];
        return (r >= 0 && r < N1) ? (uint64_t)(P1 + r * DW) : 0;
    }
    return 0;
}

template <typename IT>
__device__ __forceinline__ void attend(const __nv_bfloat16 *__restrict__ Q, int64_t s_qt, int64_t s_qh,
                                       const __nv_bfloat16 *P0, const IT *__restrict__ I0, int64_t s_i0, int K0,
                                       int N0, const __nv_bfloat16 *P1, const IT *__restrict__ I1, int64_t s_i1,
                                       int K1, int N1, const float *__restrict__ Sink, __nv_bfloat16 *__restrict__ O,
                                       int64_t s_ot, int64_t s_oh, float scale2, float qeps, int qn) {
    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);
    float *sx = reinterpret_cast<float *>(smem + SMEM_X);
    uint64_t *si = reinterpret_cast<uint64_t *>(smem + SMEM_I);
    int *snch = reinterpret_cast<int *>(smem + SMEM_N);

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int hg = w & 3, half = w >> 2;
    const int g = lane >> 2, tig = lane & 3;
    const int64_t t = blockIdx.y;
    const int h0 = blockIdx.x * HB;

    // the live chunks: up to the chunk of the last candidate pool 1 can show (pool 0's all count)
    if (tid == 0) *snch = 0;
    __syncthreads();
    int last = K0;
    for (int j = tid; j < K1; j += NTHREADS) {
        int64_t r = (int64_t)I1[t * s_i1 + j];
        if (r >= 0 && r < N1) last = max(last, K0 + j + 1);
    }
    atomicMax(snch, last);
    if (tid < CH) {
        si[tid] = cand(tid, t, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1);
        si[CH + tid] = cand(CH + tid, t, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1);
    }
    __syncthreads();
    const int nch = min((*snch + CH - 1) / CH, (K0 + K1 + CH - 1) / CH);

    const int seg = tid & 63, r4 = tid >> 6;
    {  // the queries and chunk 0 (group 0), chunk 1 (group 1)
        const __nv_bfloat16 *qrow = Q + t * s_qt + (int64_t)h0 * s_qh;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            int h = r4 + 4 * i;
            cp16(sbase + SMEM_Q + swz(h, seg), qrow + h * s_qh + seg * 8, true);
        }
        for (int c = 0; c < 2; c++) {
            if (c < nch) {
#pragma unroll
                for (int i = 0; i < 16; i++) {
                    int r = r4 + 4 * i;
                    uint64_t a = si[c * CH + r];
                    cp16(sbase + SMEM_K + c * CH * ROWB + swz(r, seg), a ? (const void *)(a + seg * 16) : (const void *)P0,
                         a != 0);
                }
            }
            cp_commit();
        }
    }

    float M0 = Sink[h0 + hg * 16 + g] * 1.4426950408889634f, M1 = Sink[h0 + hg * 16 + g + 8] * 1.4426950408889634f;
    float L0 = tig == 0 ? 1.f : 0.f, L1 = L0;  // the sink's term, counted by one thread of four
    float acc[32][4];
#pragma unroll
    for (int n = 0; n < 32; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

    for (int c = 0; c < nch; c++) {
        const int st = c & 1;
        uint64_t nxt = 0;
        if (tid < CH && c + 2 < nch) nxt = cand((c + 2) * CH + tid, t, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1);
        cp_wait<1>();
        __syncthreads();
        if (qn && c == 0) {  // per-head RMS normalisation of the queries, in place
            const int h = tid >> 2, part = tid & 3;
            float sq = 0.f;
            for (int i = 0; i < 16; i++) {
                const __nv_bfloat162 *v = reinterpret_cast<const __nv_bfloat162 *>(smem + SMEM_Q + swz(h, part * 16 + i));
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float2 f = __bfloat1622float2(v[e]);
                    sq = fmaf(f.x, f.x, sq);
                    sq = fmaf(f.y, f.y, sq);
                }
            }
            sq += __shfl_xor_sync(0xffffffff, sq, 1);
            sq += __shfl_xor_sync(0xffffffff, sq, 2);
            const float rs = __frcp_rn(__fsqrt_rn(__fdiv_rn(sq, (float)DW) + qeps));
            for (int i = 0; i < 16; i++) {
                __nv_bfloat162 *v = reinterpret_cast<__nv_bfloat162 *>(smem + SMEM_Q + swz(h, part * 16 + i));
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float2 f = __bfloat1622float2(v[e]);
                    v[e] = __floats2bfloat162_rn(f.x * rs, f.y * rs);
                }
            }
            __syncthreads();
        }
        const uint32_t kb = sbase + SMEM_K + st * CH * ROWB;

        // scores over this warp's 256 columns: s[n] is the m16n8 tile of candidates 8n .. 8n + 8
        float s[8][4];
#pragma unroll
        for (int n = 0; n < 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
        const int m = lane >> 3, mr = lane & 7;
#pragma unroll
        for (int ks = 0; ks < 16; ks++) {
            const int sg = half * 32 + ks * 2;
            uint32_t a0, a1, a2, a3;
            ldm4(sbase + SMEM_Q + swz(hg * 16 + mr + ((m & 1) << 3), sg + (m >> 1)), a0, a1, a2, a3);
#pragma unroll
            for (int np = 0; np < 4; np++) {
                uint32_t b0, b1, b2, b3;
                ldm4(kb + swz(np * 16 + mr + ((m >> 1) << 3), sg + (m & 1)), b0, b1, b2, b3);
                mma(s[2 * np], a0, a1, a2, a3, b0, b1);
                mma(s[2 * np + 1], a0, a1, a2, a3, b2, b3);
            }
        }
        // swap partials with the other warp of the head group
        float *mine = sx + w * 1024, *theirs = sx + (w ^ 4) * 1024;
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) mine[(n * 4 + e) * 32 + lane] = s[n][e];
        named_sync(1 + hg, 64);
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[n][e] += theirs[(n * 4 + e) * 32 + lane];

        // online softmax (base 2), rows g (e = 0, 1) and g + 8 (e = 2, 3)
        const uint64_t *slot = si + (c & 3) * CH;
        float x0 = -INFINITY, x1 = -INFINITY;
#pragma unroll
        for (int n = 0; n < 8; n++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const bool ok = slot[n * 8 + 2 * tig + e] != 0;
                s[n][e] = ok ? s[n][e] * scale2 : -INFINITY;
                s[n][e + 2] = ok ? s[n][e + 2] * scale2 : -INFINITY;
                x0 = fmaxf(x0, s[n][e]);
                x1 = fmaxf(x1, s[n][e + 2]);
            }
        }
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffff, x0, 1));
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffff, x0, 2));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffff, x1, 1));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffff, x1, 2));
        const float n0 = fmaxf(M0, x0), n1 = fmaxf(M1, x1);
        const float al0 = ex2(M0 - n0), al1 = ex2(M1 - n1);
        M0 = n0;
        M1 = n1;
        float p0 = 0.f, p1 = 0.f;
#pragma unroll
        for (int n = 0; n < 8; n++) {
            s[n][0] = ex2(s[n][0] - n0);
            s[n][1] = ex2(s[n][1] - n0);
            s[n][2] = ex2(s[n][2] - n1);
            s[n][3] = ex2(s[n][3] - n1);
            p0 += s[n][0] + s[n][1];
            p1 += s[n][2] + s[n][3];
        }
        L0 = L0 * al0 + p0;
        L1 = L1 * al1 + p1;
#pragma unroll
        for (int n = 0; n < 32; n++) {
            acc[n][0] *= al0;
            acc[n][1] *= al0;
            acc[n][2] *= al1;
            acc[n][3] *= al1;
        }
        // p @ v over this warp's 256 output columns
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const uint32_t a0 = pack(s[2 * kk][0], s[2 * kk][1]), a1 = pack(s[2 * kk][2], s[2 * kk][3]);
            const uint32_t a2 = pack(s[2 * kk + 1][0], s[2 * kk + 1][1]), a3 = pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < 16; dp++) {
                uint32_t b0, b1, b2, b3;
                ldm4t(kb + swz(kk * 16 + mr + ((m & 1) << 3), half * 32 + dp * 2 + (m >> 1)), b0, b1, b2, b3);
                mma(acc[2 * dp], a0, a1, a2, a3, b0, b1);
                mma(acc[2 * dp + 1], a0, a1, a2, a3, b2, b3);
            }
        }
        if (tid < CH) si[((c + 2) & 3) * CH + tid] = nxt;
        __syncthreads();  // the stage, the partials and the next slot are free / written
        if (c + 2 < nch) {
#pragma unroll
            for (int i = 0; i < 16; i++) {
                int r = r4 + 4 * i;
                uint64_t a = si[((c + 2) & 3) * CH + r];
                cp16(kb + swz(r, seg), a ? (const void *)(a + seg * 16) : (const void *)P0, a != 0);
            }
        }
        cp_commit();
    }
    cp_wait<0>();
    __syncthreads();  // every warp is done with the queries (also where no chunk ran)

    L0 += __shfl_xor_sync(0xffffffff, L0, 1);
    L0 += __shfl_xor_sync(0xffffffff, L0, 2);
    L1 += __shfl_xor_sync(0xffffffff, L1, 1);
    L1 += __shfl_xor_sync(0xffffffff, L1, 2);
    const float i0 = 1.f / L0, i1 = 1.f / L1;
    const int ra = hg * 16 + g, rb = ra + 8;
#pragma unroll
    for (int n = 0; n < 32; n++) {
        const int col = half * 256 + n * 8 + 2 * tig;
        *reinterpret_cast<uint32_t *>(smem + SMEM_Q + swz(ra, col >> 3) + (col & 7) * 2) = pack(acc[n][0] * i0, acc[n][1] * i0);
        *reinterpret_cast<uint32_t *>(smem + SMEM_Q + swz(rb, col >> 3) + (col & 7) * 2) = pack(acc[n][2] * i1, acc[n][3] * i1);
    }
    __syncthreads();
    __nv_bfloat16 *orow = O + t * s_ot + (int64_t)h0 * s_oh;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        int h = r4 + 4 * i;
        *reinterpret_cast<uint4 *>(orow + h * s_oh + seg * 8) = *reinterpret_cast<const uint4 *>(smem + SMEM_Q + swz(h, seg));
    }
}


#define ENTRY(name, IT)                                                                                         \
    extern "C" __global__ void __launch_bounds__(NTHREADS, 1)                                                  \
        name(const __nv_bfloat16 *Q, int64_t s_qt, int64_t s_qh, const __nv_bfloat16 *P0, const IT *I0,       \
             int64_t s_i0, int K0, int N0, const __nv_bfloat16 *P1, const IT *I1, int64_t s_i1, int K1, int N1, \
             const float *Sink, __nv_bfloat16 *O, int64_t s_ot, int64_t s_oh, float scale2, float qeps, int qn) { \
        attend<IT>(Q, s_qt, s_qh, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1, Sink, O, s_ot, s_oh, scale2, qeps, qn); \
    }
ENTRY(decode_attention_i64, int64_t)
ENTRY(decode_attention_i32, int32_t)
