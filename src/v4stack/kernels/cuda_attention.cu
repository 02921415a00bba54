// Fast mode's decode attention over candidate indices for 64-head blocks of 512-wide heads
// (V4-Flash's and V4-Pro's widths), in CUDA C++ for Hopper's warpgroup MMA (wgmma, sm_90a): one
// block of two warpgroups per (query row, 64-head group), the candidates in chunks of 64 read
// from the pools by index.
//
// Memory: the block's queries (64 x 512 bf16) and two chunk stages (64 candidate rows each) sit in
// shared memory in wgmma's 128-byte-swizzled layout: a tile is eight regions of 64 columns (128
// bytes a row, 1024-byte aligned), and 16-byte segment s of row r sits at (s ^ (r & 7)) in its
// row. Candidate rows arrive by cp.async, the next chunk's while this one computes; a hidden
// candidate (-1, or an index outside [0, N)) is a zero-filled row never read from memory that
// scores -inf. A chunk's row addresses are looked up while the chunk two before it computes.
//
// Work: each warpgroup computes the chunk's scores for all 64 heads over its 256 columns (wgmma
// m64n64k16, queries and candidate rows both K-major from shared memory, fp32 accumulators, two
// independent chains of K steps), and the warpgroups swap these partials through shared memory, so
// both hold the same scores and the same softmax; then p @ v for its half of the 512 output columns (wgmma
// m64n128k16 twice, p rounded to bf16 in registers as the A operand, the same candidate rows read
// as an N-major B: key == value). Online softmax in base 2 (the scale carries log2 e) from the
// sink alone (M = sink, L = 1). The output A / L goes back through shared memory to 16-byte stores.
//
// QN: the queries are RMS-normalised per head first (weightless, fp32, rounded back to bf16) in
// shared memory, so normalised queries are never written to or read from device memory.

#include <cuda_bf16.h>
#include <stdint.h>

#define HB 64          // heads a block
#define DW 512         // head width
#define CH 64          // candidates a chunk
#define TILE (64 * 1024)  // one 64-row tile of 512-wide bf16 rows
#define NTHREADS 256
#define SMEM_Q 0
#define SMEM_K TILE                   // two stages
#define SMEM_X (SMEM_K + 2 * TILE)    // the warpgroups' score partials: 2 x 32 floats x 128 threads
#define SMEM_I (SMEM_X + 2 * 32 * 128 * 4)  // row addresses: 3 slots x CH (0: hidden)
#define SMEM_N (SMEM_I + 3 * CH * 8)  // the live chunk count
#define SMEM_BYTES (SMEM_N + 16 + 1024)  // + the alignment of the tiles to 1024 bytes

// byte offset of 16-byte segment s (0..63) of row r (0..63) in a tile
__device__ __forceinline__ uint32_t at(int r, int s) {
    return (uint32_t)((s >> 3) * (64 * 128) + r * 128 + (((s & 7) ^ (r & 7)) << 4));
}

__device__ __forceinline__ void cp16(uint32_t dst, const void *src, bool ok) {
    int n = ok ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// a shared-memory matrix descriptor, 128-byte swizzle
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | ((uint64_t)1 << 62);
}

__device__ __forceinline__ void wg_qk(float *d, uint64_t da, uint64_t db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void wg_pv(float *d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t db) {  // d += a b (always accumulates)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(1));
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
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t pad = (1024 - (raw & 1023)) & 1023;
    unsigned char *smem = smem_raw + pad;
    const uint32_t sbase = raw + pad;
    uint64_t *si = reinterpret_cast<uint64_t *>(smem + SMEM_I);
    int *snch = reinterpret_cast<int *>(smem + SMEM_N);

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int wq = w & 3, half = w >> 2;  // the warp's 16 rows of the warpgroup's 64; the warpgroup's columns
    const int g = lane >> 2, tig = lane & 3;
    const int64_t t = blockIdx.y;
    const int h0 = blockIdx.x * HB;

    if (tid == 0) *snch = 0;
    __syncthreads();
    int last = K0;  // the live chunks: up to the chunk of the last candidate pool 1 can show
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
            cp16(sbase + SMEM_Q + at(h, seg), qrow + h * s_qh + seg * 8, true);
        }
        for (int c = 0; c < 2; c++) {
            if (c < nch) {
#pragma unroll
                for (int i = 0; i < 16; i++) {
                    int r = r4 + 4 * i;
                    uint64_t a = si[c * CH + r];
                    cp16(sbase + SMEM_K + c * TILE + at(r, seg), a ? (const void *)(a + seg * 16) : (const void *)P0,
                         a != 0);
                }
            }
            cp_commit();
        }
    }

    const int ra = wq * 16 + g, rb = ra + 8;  // this thread's two rows (heads) of the block's 64
    float M0 = Sink[h0 + ra] * 1.4426950408889634f, M1 = Sink[h0 + rb] * 1.4426950408889634f;
    float L0 = tig == 0 ? 1.f : 0.f, L1 = L0;  // the sink's term, counted by one thread of four
    float acc[128];  // [64 heads x 256 columns]: two m64n128 accumulators
#pragma unroll
    for (int i = 0; i < 128; i++) acc[i] = 0.f;

    for (int c = 0; c < nch; c++) {
        const int st = c & 1;
        uint64_t nxt = 0;
        if (tid < CH && c + 2 < nch) nxt = cand((c + 2) * CH + tid, t, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1);
        cp_wait<1>();
        proxy_fence();
        __syncthreads();
        if (qn && c == 0) {  // per-head RMS normalisation of the queries, in place
            const int h = tid >> 2, part = tid & 3;
            float sq = 0.f;
            for (int i = 0; i < 16; i++) {
                const __nv_bfloat162 *v = reinterpret_cast<const __nv_bfloat162 *>(smem + SMEM_Q + at(h, part * 16 + i));
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
                __nv_bfloat162 *v = reinterpret_cast<__nv_bfloat162 *>(smem + SMEM_Q + at(h, part * 16 + i));
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float2 f = __bfloat1622float2(v[e]);
                    v[e] = __floats2bfloat162_rn(f.x * rs, f.y * rs);
                }
            }
            proxy_fence();
            __syncthreads();
        }
        const uint32_t kb = sbase + SMEM_K + st * TILE;

        // scores [64 heads x 64 candidates]: s[4n + e] is row ra (e < 2) or rb, column 8n + 2 tig + (e & 1)
        // each warpgroup takes the K steps of its 256 columns as two chains (even / odd steps), then
        // the two warpgroups swap their sums: a + b is b + a, so both hold the same scores
        float s[32], s1[32];
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < 16; ks += 2) {
            const uint32_t o0 = (4 * half + (ks >> 2)) * (64 * 128) + (ks & 3) * 32, o1 = o0 + 32;
            wg_qk(s, desc(sbase + SMEM_Q + o0, 16, 1024), desc(kb + o0, 16, 1024), ks);
            wg_qk(s1, desc(sbase + SMEM_Q + o1, 16, 1024), desc(kb + o1, 16, 1024), ks);
        }
        wg_commit();
        wg_wait();
        float *xs = reinterpret_cast<float *>(smem + SMEM_X);
        const int lt = tid & 127;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            s[i] += s1[i];
            xs[half * 4096 + i * 128 + lt] = s[i];
        }
        asm volatile("bar.sync 1, 256;\n" ::: "memory");
#pragma unroll
        for (int i = 0; i < 32; i++) s[i] += xs[(1 - half) * 4096 + i * 128 + lt];

        const uint64_t *slot = si + (c % 3) * CH;
        float x0 = -INFINITY, x1 = -INFINITY;
#pragma unroll
        for (int n = 0; n < 8; n++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const bool ok = slot[n * 8 + 2 * tig + e] != 0;
                s[4 * n + e] = ok ? s[4 * n + e] * scale2 : -INFINITY;
                s[4 * n + e + 2] = ok ? s[4 * n + e + 2] * scale2 : -INFINITY;
                x0 = fmaxf(x0, s[4 * n + e]);
                x1 = fmaxf(x1, s[4 * n + e + 2]);
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
            s[4 * n] = ex2(s[4 * n] - n0);
            s[4 * n + 1] = ex2(s[4 * n + 1] - n0);
            s[4 * n + 2] = ex2(s[4 * n + 2] - n1);
            s[4 * n + 3] = ex2(s[4 * n + 3] - n1);
            p0 += s[4 * n] + s[4 * n + 1];
            p1 += s[4 * n + 2] + s[4 * n + 3];
        }
        L0 = L0 * al0 + p0;
        L1 = L1 * al1 + p1;
#pragma unroll
        for (int i = 0; i < 128; i += 4) {
            acc[i] *= al0;
            acc[i + 1] *= al0;
            acc[i + 2] *= al1;
            acc[i + 3] *= al1;
        }
        // p @ v over this warpgroup's 256 output columns: regions 4 half .. 4 half + 3
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const uint32_t a0 = pack(s[8 * kk], s[8 * kk + 1]), a1 = pack(s[8 * kk + 2], s[8 * kk + 3]);
            const uint32_t a2 = pack(s[8 * kk + 4], s[8 * kk + 5]), a3 = pack(s[8 * kk + 6], s[8 * kk + 7]);
#pragma unroll
            for (int nb = 0; nb < 2; nb++) {
                const uint32_t off = (4 * half + 2 * nb) * (64 * 128) + kk * 16 * 128;
                wg_pv(acc + 64 * nb, a0, a1, a2, a3, desc(kb + off, 64 * 128, 1024));
            }
        }
        wg_commit();
        wg_wait();
        if (tid < CH) si[((c + 2) % 3) * CH + tid] = nxt;
        __syncthreads();  // the stage and the next slot are free / written
        if (c + 2 < nch) {
#pragma unroll
            for (int i = 0; i < 16; i++) {
                int r = r4 + 4 * i;
                uint64_t a = si[((c + 2) % 3) * CH + r];
                cp16(kb + at(r, seg), a ? (const void *)(a + seg * 16) : (const void *)P0, a != 0);
            }
        }
        cp_commit();
    }
    cp_wait<0>();
    __syncthreads();  // every warpgroup is done with the queries (also where no chunk ran)

    L0 += __shfl_xor_sync(0xffffffff, L0, 1);
    L0 += __shfl_xor_sync(0xffffffff, L0, 2);
    L1 += __shfl_xor_sync(0xffffffff, L1, 1);
    L1 += __shfl_xor_sync(0xffffffff, L1, 2);
    const float i0 = 1.f / L0, i1 = 1.f / L1;
#pragma unroll
    for (int n = 0; n < 32; n++) {  // acc[4n ..]: columns 256 half + 8n + 2 tig (+1)
        const int col = half * 256 + n * 8 + 2 * tig;
        *reinterpret_cast<uint32_t *>(smem + SMEM_Q + at(ra, col >> 3) + (col & 7) * 2) =
            pack(acc[4 * n] * i0, acc[4 * n + 1] * i0);
        *reinterpret_cast<uint32_t *>(smem + SMEM_Q + at(rb, col >> 3) + (col & 7) * 2) =
            pack(acc[4 * n + 2] * i1, acc[4 * n + 3] * i1);
    }
    __syncthreads();
    __nv_bfloat16 *orow = O + t * s_ot + (int64_t)h0 * s_oh;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        int h = r4 + 4 * i;
        *reinterpret_cast<uint4 *>(orow + h * s_oh + seg * 8) = *reinterpret_cast<const uint4 *>(smem + SMEM_Q + at(h, seg));
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
