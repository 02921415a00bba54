// Fast mode's indexer scores over key rows read by index (a CSA decode step), in CUDA C++ for
// Hopper's warpgroup MMA: I[t, s] = sum_h w[t, h] relu(q[t, h] . k[rows[t, s]]) for 64 heads of
// 128-wide bf16 keys, rounded to bf16; a row index of -1 (or one outside [0, N)) scores -inf and
// reads nothing.
//
// A block (one warpgroup) takes the item (query t, slice of CPB chunks of 64 columns). Its start
// loads the slice's row indices into shared memory as row addresses (0: none) and the query's 64
// head weights into registers; a slice with no row at all writes -inf and is done. The query
// (64 x 128 bf16) and the chunks' key rows arrive by cp.async in wgmma's 128-byte-swizzled
// layout, NST chunks in flight: chunk c + NST streams into chunk c's stage once c's MMA is done.
// Per chunk the scores come out key-major - D[key, head] = keys (A, 64 x 128, K-major) times the
// query (B, 64 heads x 128, K-major), m64n64k16 over the 128 columns in order - so a thread holds
// 16 heads of two keys: relu, times the head weight, summed in registers, then over the quad's
// four threads (the xor-1 then the xor-2 partner): one fixed order of the 64 heads.
//
// Why not the Triton kernel's form: that program loads the query once per 128 or 256 keys through
// the registers, gathers its key tile through the registers too and reduces over the heads across
// warps; Nsight Compute on an H100 put it at 66% of DRAM throughput with L1 at 80%
// (bench/results/indexer_ncu_ch1_h100_92e840f.log). Here both tiles go straight from memory to
// shared memory and the head sum stays inside a quad.

#include "hopper.cuh"

#define IH 64        // heads
#define ID 128       // key width (two 64-column regions of the swizzled tile)
#define ICH 64       // keys a chunk
#define ITHREADS 128 // one warpgroup
#define ITILE (ICH * ID * 2)  // one chunk's (and the query's) tile: 16 KB

// shared memory, from the 1024-aligned base: the query's tile, NST stages, the slice's row
// addresses (CPB x 64 of 8 bytes); + the alignment of the base
#define ISMEM(NST, CPB) (ITILE + (NST) * ITILE + (CPB) * ICH * 8 + 1024)

template <typename IT, int NST, int CPB>
__device__ __forceinline__ void index_scores(const __nv_bfloat16 *__restrict__ Q, int64_t s_qt, int64_t s_qh,
                                             const __nv_bfloat16 *__restrict__ Wt, int64_t s_wt,
                                             const __nv_bfloat16 *__restrict__ P, int64_t N,
                                             const IT *__restrict__ Rows, int64_t s_rt, int S,
                                             __nv_bfloat16 *__restrict__ Y, int64_t s_yt, int slices) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t pad = (1024 - (raw & 1023)) & 1023;
    unsigned char *smem = smem_raw + pad;
    const uint32_t sq = raw + pad, sk = sq + ITILE;
    uint64_t *si = reinterpret_cast<uint64_t *>(smem + ITILE + NST * ITILE);

    const int tid = threadIdx.x, lane = tid & 31, wq = tid >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int seg = tid & 15, rg = tid >> 4;     // cp.async: segment seg of rows rg, rg + 8, ...
    const int ra = wq * 16 + g, rb = ra + 8;     // the MMA's rows (keys) this thread scores
    const int64_t t = blockIdx.x / slices;
    const int s0 = (blockIdx.x % slices) * (CPB * ICH);
    const int nch = min(CPB, (S - s0 + ICH - 1) / ICH);

    // the slice's row addresses (every index loaded before any is checked) and the head weights
    bool any = false;
    {
        int64_t r[CPB * ICH / ITHREADS];
#pragma unroll
        for (int u = 0; u < CPB * ICH / ITHREADS; u++) {
            const int s = s0 + u * ITHREADS + tid;
            r[u] = s < S ? (int64_t)Rows[t * s_rt + s] : -1;
        }
#pragma unroll
        for (int u = 0; u < CPB * ICH / ITHREADS; u++) {
            const bool ok = r[u] >= 0 && r[u] < N;
            any |= ok;
            si[u * ITHREADS + tid] = ok ? (uint64_t)(P + r[u] * ID) : 0;
        }
    }
    float wv[16];  // w[8 n + 2 tig + e] at wv[2 n + e]: the heads of this thread's accumulator columns
#pragma unroll
    for (int n = 0; n < 8; n++) {
        const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162 *>(Wt + t * s_wt + 8 * n + 2 * tig);
        const float2 f = __bfloat1622float2(v);
        wv[2 * n] = f.x;
        wv[2 * n + 1] = f.y;
    }
    if (!__syncthreads_or(any)) {  // no row in the slice: every column scores -inf
        for (int s = s0 + tid; s < min(S, s0 + CPB * ICH); s += ITHREADS) Y[t * s_yt + s] = __float2bfloat16(-INFINITY);
        return;
    }

    // the query with chunk 0 (group 0), chunk c in group c
    const __nv_bfloat16 *qrow = Q + t * s_qt;
#pragma unroll
    for (int i = 0; i < IH / 8; i++) {
        const int h = rg + 8 * i;
        cp16(sq + at<IH>(h, seg), qrow + h * s_qh + seg * 8, true);
    }
    auto stream = [&](int c) {  // chunk c's rows into its stage (a hidden row: zeros, nothing read)
        const uint32_t st = sk + (c % NST) * ITILE;
#pragma unroll
        for (int i = 0; i < ICH / 8; i++) {
            const int r = rg + 8 * i;
            const uint64_t a = si[c * ICH + r];
            cp16(st + at<ICH>(r, seg), a ? (const void *)(a + seg * 16) : (const void *)P, a != 0);
        }
    };
#pragma unroll
    for (int c = 0; c < NST; c++) {
        if (c < nch) stream(c);
        cp_commit();
    }

    __nv_bfloat16 *yrow = Y + t * s_yt;
    for (int c = 0; c < nch; c++) {
        cp_wait<NST - 1>();
        proxy_fence();
        __syncthreads();
        const uint32_t kb = sk + (c % NST) * ITILE;
        float d[32];
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < ID / 16; ks++) {
            const uint32_t o = (ks >> 2) * (ICH * 128) + (ks & 3) * 32;
            wg_qk(d, desc(kb + o, 16, 1024), desc(sq + o, 16, 1024), ks);
        }
        wg_commit();
        wg_wait();
        __syncthreads();  // every warp's MMA has read the stage: refill it
        if (c + NST < nch) stream(c + NST);
        cp_commit();
        // d[4 n + e]: key ra (e < 2) or rb, head 8 n + 2 tig + (e & 1)
        float xa = 0.f, xb = 0.f;
#pragma unroll
        for (int n = 0; n < 8; n++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                xa = fmaf(fmaxf(d[4 * n + e], 0.f), wv[2 * n + e], xa);
                xb = fmaf(fmaxf(d[4 * n + e + 2], 0.f), wv[2 * n + e], xb);
            }
        }
        xa += __shfl_xor_sync(0xffffffff, xa, 1);
        xb += __shfl_xor_sync(0xffffffff, xb, 1);
        xa += __shfl_xor_sync(0xffffffff, xa, 2);
        xb += __shfl_xor_sync(0xffffffff, xb, 2);
        if (tig == 0) {
            const int sa = s0 + c * ICH + ra, sb = sa + 8;
            if (sa < S) yrow[sa] = __float2bfloat16(si[c * ICH + ra] ? xa : -INFINITY);
            if (sb < S) yrow[sb] = __float2bfloat16(si[c * ICH + rb] ? xb : -INFINITY);
        }
    }
    cp_wait<0>();
}

#define IENTRY(name, IT, NST, CPB)                                                                              \
    extern "C" __global__ void __launch_bounds__(ITHREADS)                                                      \
        name(const __nv_bfloat16 *Q, int64_t s_qt, int64_t s_qh, const __nv_bfloat16 *Wt, int64_t s_wt,         \
             const __nv_bfloat16 *P, int64_t N, const IT *Rows, int64_t s_rt, int S, __nv_bfloat16 *Y,          \
             int64_t s_yt, int slices) {                                                                        \
        index_scores<IT, NST, CPB>(Q, s_qt, s_qh, Wt, s_wt, P, N, Rows, s_rt, S, Y, s_yt, slices);             \
    }
// the shipped form (cuda_indexer.py's FORMS) and the others bench/indexer_cuda.py times
IENTRY(indexer_rows_i64_s2_c8, int64_t, 2, 8)
IENTRY(indexer_rows_i32_s2_c8, int32_t, 2, 8)
IENTRY(indexer_rows_i64_s3_c8, int64_t, 3, 8)
IENTRY(indexer_rows_i64_s4_c8, int64_t, 4, 8)
IENTRY(indexer_rows_i64_s3_c4, int64_t, 3, 4)
IENTRY(indexer_rows_i64_s4_c16, int64_t, 4, 16)
