// Fast mode's decode attention over candidate indices for 64-head blocks of 512-wide heads
// (V4-Flash's and V4-Pro's widths), in CUDA C++ for Hopper's warpgroup MMA (wgmma, sm_90a).
// A block (two warpgroups) walks the items (query row, 64-head group) b, b + grid, ..., and its
// candidates run as one stream of chunks of 64 across its items, so the next item's queries and
// first chunks load while this item finishes. The launcher picks the grid: one block an item
// (nothing to walk) or at most one an SM; an item's bits do not depend on which.
//
// Memory: the item's queries (64 x 512 bf16) and two chunk stages (64 candidate rows each) sit in
// shared memory in wgmma's 128-byte-swizzled layout: a tile is eight regions of 64 columns (128
// bytes a row, 64 x 128 bytes a region, 1024-byte aligned), and 16-byte segment s of row r sits at
// (s ^ (r & 7)) in its row. Candidate rows arrive by cp.async, stream chunk j + 2 into chunk j's
// stage once j is done; a hidden candidate (-1, or an index outside [0, N)) is a zero-filled row
// never read from memory that scores -inf. A chunk's row addresses are looked up while the chunk
// two before it computes. The next item's queries load once the last chunk's scores are computed
// (nothing reads the queries after that). An item's chunks end at the chunk of the last candidate
// pool 1 shows (a padded top-k tail costs nothing), and are at least two (a hidden chunk adds
// nothing: it scores -inf), so the chunks two ahead are always this item's or the next one's
// first two; the next item's extent is found while its p @ v computes.
//
// Work: each warpgroup computes the chunk's scores for all 64 heads over its 256 columns (wgmma
// m64n64k16, queries and candidate rows both K-major from shared memory, fp32 accumulators, two
// independent chains of K steps), and the warpgroups swap these partials through shared memory,
// so both hold the same scores and the same softmax; then p @ v for its half of the 512 output
// columns (wgmma m64n128k16 twice a K step, p rounded to bf16 in registers as the A operand,
// packed for every K step before the first MMA, the same candidate rows read as an N-major B:
// key == value). Online softmax in base 2 (the scale carries log2 e) from the sink alone (M =
// sink, L = 1). The output A / L goes through the last chunk's stage to 16-byte stores, before
// that stage's next load.
//
// QN: the queries are RMS-normalised per head (weightless, fp32): each head's 1 / rms is computed
// from shared memory while the item's first scores are in flight and scales that head's scores,
// so normalised queries are never written anywhere (the scores equal those of the normalised
// queries before their rounding to bf16).
//
// Measured on an H100 (bench/results/attention_cuda_variants_h100_17eb7bf.json,
// attention_cuda_persistent_h100_bd144fa.json, attention_cuda_ownrows_h100_7b9329b.json,
// attention_walk_ab_h100.log): chunks of 32 with four stages or of 16 with eight (more bytes in
// flight) ran 15-60% slower - a chunk's fixed work bounds them; the output stored straight from
// the registers, in 4-byte pieces or traded across a quad into 16-byte ones, ran slower than
// through shared memory; threads looking up their own rows of the first chunks ran slower. Walking
// items gains where an item has few chunks (the window at 256 rows: 39.7 -> 37.0 us) and loses
// where it has many (CSA at 16k: 90.0 -> 95.1 us; bench/attention_cuda.py's cuda_grid,
// attention_cuda_h100_7cbf2b1.json), so the launcher walks items of at most ``WALK_CHUNKS`` chunks.
// A block's start loads every index it needs (its first chunks', its extent's) and the sinks before it
// checks any: Nsight Compute showed a block waiting out those loads one after another (13% of a CSA
// launch's stall samples at 256 rows, bench/results/attention_ncu_h100_514b797.log); loaded together the
// four attention launches of a flash4 batch-256 16k step took 199 / 200 us against 217 / 227 (an H100,
// the same bits; bench/results/serve_profile_ab_*_h100_f5095fc_*.json, attention_cuda_ab_h100_f5095fc.json).
// Per chunk, the score swap goes in swizzled 16-byte pieces, the score scale rides in each exponent's fma
// (maxima over the raw scores), a warp whose rows' maxima did not move skips its accumulators' rescale, and
// the row addresses are read two at a time: the PTX of both entries 7372 -> 6974 instruction lines
// (`nvcc -ptx -O3`, lines that open with an opcode), and only 1-2% faster (CSA 16k at 256 rows 85.2 against 86.8 us on an H100, attention_cuda_ab_h100_22e7b32.json) -
// the chunk's chain of dependent steps, not the instruction count, bounds the kernel.

#include <cuda_bf16.h>
#include <stdint.h>

#define HB 64                 // heads a block
#define DW 512                // head width
#define QTILE (64 * 1024)     // the block's queries: 64 rows of 512-wide bf16
#define NTHREADS 256
#define CH 64                 // candidates a chunk
#define NST 2                 // chunk stages (the stream's look-ahead is written for two)
// shared memory, in bytes from the 1024-aligned base: the queries, NST stages of CH rows, the
// warpgroups' score partials (2 x CH / 2 floats x 128 threads), the row addresses (NST + 1 slots of
// CH; 0: hidden), the heads' query scales, the warps' live extents; + the alignment of the base
#define SMEM_K QTILE
#define SMEM_X (SMEM_K + NST * CH * 1024)
#define SMEM_I (SMEM_X + 2 * (CH / 2) * 128 * 4)
#define SMEM_R (SMEM_I + (NST + 1) * CH * 8)
#define SMEM_W (SMEM_R + HB * 4)
#define SMEM_BYTES (SMEM_W + 8 * 4 + 1024)

#include "hopper.cuh"

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

// candidate column j's index as stored (-1 past both lists): the load alone, so a caller issues
// several before it reads any (a check of a loaded index right after its load waits out the load)
template <typename IT>
__device__ __forceinline__ int64_t cand_index(int j, int64_t t, const IT *I0, int64_t s_i0, int K0, const IT *I1,
                                              int64_t s_i1, int K1) {
    if (j < K0) return (int64_t)I0[t * s_i0 + j];
    j -= K0;
    return j < K1 ? (int64_t)I1[t * s_i1 + j] : -1;
}

// the address of candidate column j's pool row from its index r, 0 for none
__device__ __forceinline__ uint64_t cand_row(int j, int64_t r, const __nv_bfloat16 *P0, int K0, int N0,
                                             const __nv_bfloat16 *P1, int N1) {
    if (j < K0) return (r >= 0 && r < N0) ? (uint64_t)(P0 + r * DW) : 0;
    return (r >= 0 && r < N1) ? (uint64_t)(P1 + r * DW) : 0;
}

// a chunk's 64 candidate rows into a stage by cp.async from their addresses ``slot`` (0: a zero row):
// thread (r4, seg) takes segment seg of rows 16 r4 .. 16 r4 + 15, so its addresses are two 16-byte
// loads apart (one address for a whole warp: a broadcast) and each row's swizzle (r & 7 = i & 7) is
// known at compile time
__device__ __forceinline__ void chunk_rows(uint32_t stage, const uint64_t *slot, int r4, int seg,
                                           const __nv_bfloat16 *P0) {
    const ulonglong2 *a2 = reinterpret_cast<const ulonglong2 *>(slot + r4 * 16);
#pragma unroll
    for (int i2 = 0; i2 < CH / 8; i2++) {
        const ulonglong2 v = a2[i2];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const uint64_t a = e ? v.y : v.x;
            const int r = r4 * 16 + 2 * i2 + e;
            cp16(stage + at<CH>(r, seg), a ? (const void *)(a + seg * 16) : (const void *)P0, a != 0);
        }
    }
}

template <typename IT>
__device__ __forceinline__ void attend(const __nv_bfloat16 *__restrict__ Q, int64_t s_qt, int64_t s_qh,
                                       const __nv_bfloat16 *P0, const IT *__restrict__ I0, int64_t s_i0, int K0,
                                       int N0, const __nv_bfloat16 *P1, const IT *__restrict__ I1, int64_t s_i1,
                                       int K1, int N1, const float *__restrict__ Sink, __nv_bfloat16 *__restrict__ O,
                                       int64_t s_ot, int64_t s_oh, float scale2, float qeps, int qn, int items,
                                       int groups) {
    constexpr int NS = CH / 2;        // score floats a thread holds
    constexpr int KT = CH * 1024;     // one stage
    constexpr int NSLOT = NST + 1;    // address slots: the chunks in flight and the one being looked up
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t pad = (1024 - (raw & 1023)) & 1023;
    unsigned char *smem = smem_raw + pad;
    const uint32_t sbase = raw + pad, sq = sbase, sk = sbase + SMEM_K;
    uint64_t *si = reinterpret_cast<uint64_t *>(smem + SMEM_I);
    float *srs = reinterpret_cast<float *>(smem + SMEM_R);
    int *swl = reinterpret_cast<int *>(smem + SMEM_W);
    float *xs = reinterpret_cast<float *>(smem + SMEM_X);

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int wq = w & 3, half = w >> 2;  // the warp's 16 rows of the warpgroup's 64; the warpgroup's columns
    const int g = lane >> 2, tig = lane & 3;
    const int seg = tid & 63, r4 = tid >> 6, lt = tid & 127;
    const int ra = wq * 16 + g, rb = ra + 8;  // this thread's two rows (heads) of the block's 64
    const int nchk = (K0 + K1 + CH - 1) / CH;  // an item's chunks at most

    int item = blockIdx.x;
    if (item >= items) return;
    int64_t t = item / groups;
    int h0 = (item % groups) * HB;

    // the queries of an item (they need no index)
    auto load_q = [&](int64_t tq, int hq) {
        const __nv_bfloat16 *qrow = Q + tq * s_qt + (int64_t)hq * s_qh;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            int h = r4 + 4 * i;
            cp16(sq + at<64>(h, seg), qrow + h * s_qh + seg * 8, true);
        }
    };
    // this thread's share of an item's live extent: one past the last candidate pool 1 shows
    // (four indices a thread loaded before any is checked: one load's wait, not four in turn)
    auto extent = [&](int64_t te) {
        int last = K0;
        for (int j = tid; j < K1; j += 4 * NTHREADS) {
            int64_t r[4];
#pragma unroll
            for (int u = 0; u < 4; u++) r[u] = j + u * NTHREADS < K1 ? (int64_t)I1[te * s_i1 + j + u * NTHREADS] : -1;
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (r[u] >= 0 && r[u] < N1) last = max(last, K0 + j + u * NTHREADS + 1);
        }
        return __reduce_max_sync(0xffffffffu, last);
    };
    // an item's chunks from the warps' extents: the live ones, at least two
    auto chunks = [&]() {
        int last = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) last = max(last, swl[i]);
        return max(2, min((last + CH - 1) / CH, nchk));
    };

    load_q(t, h0);
    // the first chunks' indices, then the extent's, all loaded before any is checked
    const float sink0 = Sink[h0 + ra], sink1 = Sink[h0 + rb];
    int64_t first[NST];
#pragma unroll
    for (int c = 0; c < NST; c++) first[c] = tid < CH ? cand_index(c * CH + tid, t, I0, s_i0, K0, I1, s_i1, K1) : -1;
    {
        int last = extent(t);
        if (lane == 0) swl[w] = last;
    }
    if (tid < CH) {
#pragma unroll
        for (int c = 0; c < NST; c++) si[c * CH + tid] = cand_row(c * CH + tid, first[c], P0, K0, N0, P1, N1);
    }
    __syncthreads();
    int nch = chunks();
#pragma unroll
    for (int c = 0; c < NST; c++) {  // stream chunk c in group c (the queries with chunk 0)
        chunk_rows(sk + c * KT, si + c * CH, r4, seg, P0);
        cp_commit();
    }

    // the next item of this block
    int nitem = item + gridDim.x;
    bool more = nitem < items;
    int64_t tn = more ? nitem / groups : 0;
    int hn = more ? (nitem % groups) * HB : 0;

    float M0 = sink0 * 1.4426950408889634f, M1 = sink1 * 1.4426950408889634f;
    float L0 = tig == 0 ? 1.f : 0.f, L1 = L0;  // the sink's term, counted by one thread of four
    float qs0 = scale2, qs1 = scale2;          // the score scales of rows ra, rb
    float acc[128];  // [64 heads x 256 columns]: two m64n128 accumulators
#pragma unroll
    for (int i = 0; i < 128; i++) acc[i] = 0.f;

    for (int j = 0, c = 0;; j++) {  // stream chunk j: chunk c of the item
        const int st = j % NST;
        // stream chunk j + 2: this item's chunk c + 2, else the next item's chunk c + 2 - nch (0 or 1)
        const bool own = c + NST < nch, ahead = own || more;
        const int64_t ta = own ? t : tn;
        const int ca = own ? c + NST : c + NST - nch;
        // its index loaded now, checked once this chunk's p @ v is done
        const int jn = ca * CH + tid;
        const int64_t nraw = tid < CH && ahead ? cand_index(jn, ta, I0, s_i0, K0, I1, s_i1, K1) : -1;
        const bool scan = more && c == nch - NST;  // look up the next item's extent in this one
        cp_wait<NST - 1>();
        proxy_fence();
        __syncthreads();
        const uint32_t kb = sk + st * KT;

        // scores [64 heads x 64 candidates]: s[4n + e] is row ra (e < 2) or rb, column 8n + 2 tig + (e & 1)
        // each warpgroup takes the K steps of its 256 columns as two chains (even / odd steps), then
        // the two warpgroups swap their sums: a + b is b + a, so both hold the same scores
        float s[NS], s1[NS];
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < 16; ks += 2) {
            const uint32_t r = 4 * half + (ks >> 2), o = (ks & 3) * 32;
            wg_qk(s, desc(sq + r * (64 * 128) + o, 16, 1024), desc(kb + r * (CH * 128) + o, 16, 1024), ks);
            wg_qk(s1, desc(sq + r * (64 * 128) + o + 32, 16, 1024), desc(kb + r * (CH * 128) + o + 32, 16, 1024), ks);
        }
        wg_commit();
        if (qn && c == 0) {  // each head's 1 / rms while the scores compute (both only read the queries)
            const int h = tid >> 2, part = tid & 3;
            float q2 = 0.f;
#pragma unroll
            for (int i = 0; i < 16; i++) {
                const uint4 u = *reinterpret_cast<const uint4 *>(smem + at<64>(h, part * 16 + i));
                const __nv_bfloat162 *v = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float2 f = __bfloat1622float2(v[e]);
                    q2 = fmaf(f.x, f.x, q2);
                    q2 = fmaf(f.y, f.y, q2);
                }
            }
            q2 += __shfl_xor_sync(0xffffffff, q2, 1);
            q2 += __shfl_xor_sync(0xffffffff, q2, 2);
            if (part == 0) srs[h] = __frcp_rn(__fsqrt_rn(__fdiv_rn(q2, (float)DW) + qeps));
        }
        wg_wait();
        // the swap in 16-byte pieces: thread lt's eight float4 at (lt, q ^ (lt & 7)), so the eight threads
        // of a quarter warp touch eight distinct bank groups
        float4 *xs4 = reinterpret_cast<float4 *>(xs);
#pragma unroll
        for (int q = 0; q < NS / 4; q++) {
            float4 v;
            v.x = s[4 * q] += s1[4 * q];
            v.y = s[4 * q + 1] += s1[4 * q + 1];
            v.z = s[4 * q + 2] += s1[4 * q + 2];
            v.w = s[4 * q + 3] += s1[4 * q + 3];
            xs4[(half * 128 + lt) * (NS / 4) + (q ^ (lt & 7))] = v;
        }
        asm volatile("bar.sync 1, 256;\n" ::: "memory");
#pragma unroll
        for (int q = 0; q < NS / 4; q++) {
            const float4 v = xs4[((1 - half) * 128 + lt) * (NS / 4) + (q ^ (lt & 7))];
            s[4 * q] += v.x;
            s[4 * q + 1] += v.y;
            s[4 * q + 2] += v.z;
            s[4 * q + 3] += v.w;
        }
        if (qn && c == 0) {
            qs0 = scale2 * srs[ra];
            qs1 = scale2 * srs[rb];
        }
        if (more && c == nch - 1) {  // nothing reads these queries again: the next item's load now
            load_q(tn, hn);
            cp_commit();
        }

        // the row maxima over the raw scores (a score scale is positive: the scaled maximum is the
        // maximum scaled), the scale applied inside each exponent's fma
        const uint64_t *slot = si + (j % NSLOT) * CH;
        float x0 = -INFINITY, x1 = -INFINITY;
#pragma unroll
        for (int n = 0; n < CH / 8; n++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const bool ok = slot[n * 8 + 2 * tig + e] != 0;
                s[4 * n + e] = ok ? s[4 * n + e] : -INFINITY;
                s[4 * n + e + 2] = ok ? s[4 * n + e + 2] : -INFINITY;
                x0 = fmaxf(x0, s[4 * n + e]);
                x1 = fmaxf(x1, s[4 * n + e + 2]);
            }
        }
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffff, x0, 1));
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffff, x0, 2));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffff, x1, 1));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffff, x1, 2));
        const float n0 = fmaxf(M0, x0 * qs0), n1 = fmaxf(M1, x1 * qs1);
        const float al0 = ex2(M0 - n0), al1 = ex2(M1 - n1);
        M0 = n0;
        M1 = n1;
        float p0 = 0.f, p1 = 0.f;
#pragma unroll
        for (int n = 0; n < CH / 8; n++) {
            s[4 * n] = ex2(fmaf(s[4 * n], qs0, -n0));
            s[4 * n + 1] = ex2(fmaf(s[4 * n + 1], qs0, -n0));
            s[4 * n + 2] = ex2(fmaf(s[4 * n + 2], qs1, -n1));
            s[4 * n + 3] = ex2(fmaf(s[4 * n + 3], qs1, -n1));
            p0 += s[4 * n] + s[4 * n + 1];
            p1 += s[4 * n + 2] + s[4 * n + 3];
        }
        L0 = L0 * al0 + p0;
        L1 = L1 * al1 + p1;
        // a row whose maximum did not move has al == 1 (2^0): times 1 is exact, so a warp none of whose
        // 16 rows moved skips the 128 products
        if (__any_sync(0xffffffff, al0 != 1.f || al1 != 1.f)) {
#pragma unroll
            for (int i = 0; i < 128; i += 4) {
                acc[i] *= al0;
                acc[i + 1] *= al0;
                acc[i + 2] *= al1;
                acc[i + 3] *= al1;
            }
        }
        // p @ v over this warpgroup's 256 output columns: regions 4 half .. 4 half + 3
        uint32_t pa[CH / 4];
#pragma unroll
        for (int i = 0; i < CH / 4; i++) pa[i] = pack(s[2 * i], s[2 * i + 1]);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < CH / 16; kk++) {
#pragma unroll
            for (int nb = 0; nb < 2; nb++) {
                const uint32_t off = (4 * half + 2 * nb) * (CH * 128) + kk * 16 * 128;
                wg_pv(acc + 64 * nb, pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3],
                      desc(kb + off, CH * 128, 1024));
            }
        }
        wg_commit();
        int lastn = 0;
        if (scan) lastn = extent(tn);  // while p @ v computes
        wg_wait();
        if (tid < CH) si[((j + NST) % NSLOT) * CH + tid] = ahead ? cand_row(jn, nraw, P0, K0, N0, P1, N1) : 0;
        if (scan && lane == 0) swl[w] = lastn;
        __syncthreads();  // the stage and the next slot are free / written; the next extent is in
        const bool done = c + 1 == nch;
        if (done) {  // the item's output through this stage (free until its next load, below)
            L0 += __shfl_xor_sync(0xffffffff, L0, 1);
            L0 += __shfl_xor_sync(0xffffffff, L0, 2);
            L1 += __shfl_xor_sync(0xffffffff, L1, 1);
            L1 += __shfl_xor_sync(0xffffffff, L1, 2);
            const float i0 = 1.f / L0, i1 = 1.f / L1;
            unsigned char *ot = smem + SMEM_K + st * KT;
#pragma unroll
            for (int n = 0; n < 32; n++) {  // acc[4n ..]: columns 256 half + 8n + 2 tig (+1)
                const int col = half * 256 + n * 8 + 2 * tig;
                *reinterpret_cast<uint32_t *>(ot + at<64>(ra, col >> 3) + (col & 7) * 2) =
                    pack(acc[4 * n] * i0, acc[4 * n + 1] * i0);
                *reinterpret_cast<uint32_t *>(ot + at<64>(rb, col >> 3) + (col & 7) * 2) =
                    pack(acc[4 * n + 2] * i1, acc[4 * n + 3] * i1);
            }
            __syncthreads();
            __nv_bfloat16 *orow = O + t * s_ot + (int64_t)h0 * s_oh;
#pragma unroll
            for (int i = 0; i < 16; i++) {
                int h = r4 + 4 * i;
                *reinterpret_cast<uint4 *>(orow + h * s_oh + seg * 8) = *reinterpret_cast<const uint4 *>(ot + at<64>(h, seg));
            }
            __syncthreads();
        }
        if (ahead) chunk_rows(kb, si + ((j + NST) % NSLOT) * CH, r4, seg, P0);
        cp_commit();
        if (!done) {
            c++;
            continue;
        }
        if (!more) break;
        item = nitem;
        t = tn;
        h0 = hn;
        nch = chunks();
        nitem = item + gridDim.x;
        more = nitem < items;
        tn = more ? nitem / groups : 0;
        hn = more ? (nitem % groups) * HB : 0;
        c = 0;
        M0 = Sink[h0 + ra] * 1.4426950408889634f;
        M1 = Sink[h0 + rb] * 1.4426950408889634f;
        L0 = tig == 0 ? 1.f : 0.f;
        L1 = L0;
        qs0 = qs1 = scale2;
#pragma unroll
        for (int i = 0; i < 128; i++) acc[i] = 0.f;
    }
    cp_wait<0>();
}

#define ENTRY(name, IT)                                                                                        \
    extern "C" __global__ void __launch_bounds__(NTHREADS, 1)                                                  \
        name(const __nv_bfloat16 *Q, int64_t s_qt, int64_t s_qh, const __nv_bfloat16 *P0, const IT *I0,       \
             int64_t s_i0, int K0, int N0, const __nv_bfloat16 *P1, const IT *I1, int64_t s_i1, int K1, int N1, \
             const float *Sink, __nv_bfloat16 *O, int64_t s_ot, int64_t s_oh, float scale2, float qeps, int qn,  \
             int items, int groups) {                                                                          \
        attend<IT>(Q, s_qt, s_qh, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1, Sink, O, s_ot, s_oh, scale2, qeps, qn, \
                   items, groups);                                                                             \
    }
ENTRY(decode_attention_i64, int64_t)
ENTRY(decode_attention_i32, int32_t)
