// The grouped (per-expert) GEMM of the MoE layers in CUDA C++ for Hopper (sm_90a): tensor-memory
// accelerator (TMA) loads and warpgroup MMA (wgmma) in a persistent, warp-specialised kernel.
//
// Rows sorted by expert (``off [E + 1]``, int64, on the device), ``X [T, K]`` and ``W [E * N, K]``
// bf16, K-major. Work unit: (chunk, column block), where a chunk is up to 128 rows of one expert
// (an expert of n rows owns ceil(n / 128) chunks, from its first row) and a column block BN
// output columns; units run chunk-fastest, so the units in flight at once share one expert's
// weight tile through L2.
//
// Warpgroup 0 is the producer: one thread issues, per K step of 64, the TMA loads of the chunk's
// 128 rows of X (one box) and the BN weight rows (one box; SWIGLU: gate and up, one each) into a ring of STAGES stages (128-byte swizzle,
// wgmma's K-major layout), signalling a "full" mbarrier with the bytes expected; rows past T read
// as zeros, rows of the next expert are computed and never stored. Warpgroups 1 and 2 consume:
// each owns one 64-row half of the chunk and runs m64nBNk16 MMAs over the stage (fp32
// accumulators), keeps one stage's MMAs in flight and frees the stage before it ("empty").
//
// Without SK each CTA (one a multiprocessor) runs units blockIdx.x, + gridDim.x, ...: an output
// element's K chain is the MMA steps in K order from zero whatever the unit or the batch, so a
// row's bits do not depend on the other rows. With SK (stream-K) each CTA runs an equal share of
// all units' K steps laid end to end, so no multiprocessor idles through a last partial round; a
// unit cut in two has its tail run first by CTA i + 1, which leaves the fp32 partial sums in its
// slot of ``part`` and raises ``flags[i + 1]``; CTA i runs the head last, adds them, clears the
// flag and writes the unit (the sum's order then depends on where the cut falls: fast mode only).
//
// SWIGLU: the column block is BN / 2 rows of W1 (gate) and the same rows of W3 (up), so a thread
// holds the gate and up of the same (row, channel); the epilogue rounds both to bf16 (what the
// two-GEMM path stores), applies silu(min(g, limit)) * clamp(u, -limit, limit) [* ws[row]] in
// fp32 and writes bf16 ``Y [T, N]`` (N = W1's rows per expert), the activations only.

#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

#define BK 64       // K a stage
#define SUB (64 * 128)  // one 64-row box: 64 rows x 128 bytes
#define NTHREADS 384

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void bar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap *map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(dst), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// a shared-memory matrix descriptor, K-major, 128-byte swizzle (8-row groups 1024 bytes apart)
__device__ __forceinline__ uint64_t desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

// d += a b (accumulators zeroed by the caller; both operands K-major in shared memory)
template <int BN> __device__ __forceinline__ void mma(float *d, uint64_t da, uint64_t db);
template <> __device__ __forceinline__ void mma<128>(float *d, uint64_t da, uint64_t db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) : "l"(da), "l"(db));
}
template <> __device__ __forceinline__ void mma<256>(float *d, uint64_t da, uint64_t db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) : "l"(da), "l"(db));
}

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
__device__ __forceinline__ float bf(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// chunk c (of all experts' chunks) -> its expert e, the chunk's first row r0 and the expert's end r1
template <int TM>
__device__ __forceinline__ void chunk_rows(int c, const int64_t *off, int E, int &e, int &r0, int &r1) {
    for (e = 0; e < E; e++) {
        const int lo = (int)off[e], hi = (int)off[e + 1];
        const int n = (hi - lo + TM - 1) / TM;
        if (c < n) {
            r0 = lo + c * TM;
            r1 = hi;
            return;
        }
        c -= n;
    }
    r0 = r1 = 0;
}

template <int TM>
__device__ __forceinline__ int total_chunks(const int64_t *off, int E) {
    int n = 0;
    for (int e = 0; e < E; e++) n += ((int)(off[e + 1] - off[e]) + TM - 1) / TM;
    return n;
}

// The pieces a CTA runs: whole units blockIdx.x, + gridDim.x, ... (no SK), or the CTA's share
// [i L, (i + 1) L) of all K steps (SK; L >= a unit's K steps, so a unit is cut at most once).
struct Pieces {
    int units, kt_n, L, pos, end, u, ka, kb;
    __device__ __forceinline__ Pieces(int units_, int kt_n_, bool sk) : units(units_), kt_n(kt_n_), u(-1) {
        if (sk) {
            const long long w = (long long)units * kt_n;
            L = max(kt_n, (int)((w + gridDim.x - 1) / gridDim.x));
            pos = (int)min(w, (long long)blockIdx.x * L);
            end = (int)min(w, (long long)pos + L);
        } else {
            L = 0;
            pos = end = 0;
        }
    }
    __device__ __forceinline__ bool next() {
        if (L == 0) {
            u = u < 0 ? (int)blockIdx.x : u + (int)gridDim.x;
            ka = 0;
            kb = kt_n;
            return u < units;
        }
        if (pos >= end) return false;
        u = pos / kt_n;
        ka = pos - u * kt_n;
        kb = min(kt_n, ka + (end - pos));
        pos += kb - ka;
        return true;
    }
};

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }

// a consumer warpgroup's K steps [ka, kb) of one unit (LIVE: its half has rows; else it only keeps
// the ring's count), one stage's MMAs left in flight while the stage before is freed
template <int BN, int STAGES, int RW, int NA, uint32_t AOFF>
__device__ __forceinline__ void consume(float (&acc)[RW][BN / 2], uint32_t base, uint32_t bars, int ka, int kb, int &s,
                                        uint32_t &ph, int lane) {
    constexpr uint32_t STAGE = 2 * RW * SUB + BN * 128;
#pragma unroll
    for (int m = 0; m < NA; m++)
#pragma unroll
        for (int i = 0; i < BN / 2; i++) acc[m][i] = 0.f;
    int prev = -1;
    for (int kt = ka; kt < kb; kt++) {
        bar_wait(bars + 8 * s, ph);
        if (NA > 0) {
            const uint64_t d0 = desc(base + s * STAGE);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
#pragma unroll
                for (int m = 0; m < NA; m++)
                    mma<BN>(acc[m], d0 + ((AOFF + m * SUB + kk * 32) >> 4), d0 + ((2 * RW * SUB + kk * 32) >> 4));
            }
            wg_commit();
            wg_wait<1>();
        }
        if (prev >= 0 && lane == 0) bar_arrive(bars + 8 * (STAGES + prev));
        prev = s;
        if (++s == STAGES) {
            s = 0;
            ph ^= 1;
        }
    }
    if (NA > 0) wg_wait<0>();
    if (prev >= 0 && lane == 0) bar_arrive(bars + 8 * (STAGES + prev));
}

template <int BN, int STAGES, bool SWIGLU, bool SK, int RW>
__device__ __forceinline__ void grouped(const CUtensorMap *tx, const CUtensorMap *tw1, const CUtensorMap *tw3,
                                        const int64_t *__restrict__ off, int E, int N, int K,
                                        __nv_bfloat16 *__restrict__ Y, int64_t s_y, const float *__restrict__ ws,
                                        float limit, float *__restrict__ part, int *__restrict__ flags) {
    constexpr uint32_t STAGE = 2 * RW * SUB + BN * 128;
    constexpr int NA = BN / 2;  // accumulators a thread a subtile
    constexpr int TM = 128 * RW;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t base = raw + ((1024 - (raw & 1023)) & 1023);
    const uint32_t bars = base + STAGES * STAGE;  // full[STAGES], empty[STAGES]
    const int tid = threadIdx.x, wg = tid >> 7;

    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) {
            bar_init(bars + 8 * s, 1);
            bar_init(bars + 8 * (STAGES + s), 8);  // lane 0 of each consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    const int nc = total_chunks<TM>(off, E);
    const int nb = N / (SWIGLU ? BN / 2 : BN);
    const int units = nc * nb;
    const int kt_n = K / BK;

    if (wg == 0) {  // producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid == 0) {
            int s = 0;
            uint32_t ph = 0;
            Pieces pc(units, kt_n, SK);
            while (pc.next()) {
                const int c = pc.u % nc, jb = pc.u / nc;
                int e, r0, r1;
                chunk_rows<TM>(c, off, E, e, r0, r1);
                const int wr = e * N + jb * (SWIGLU ? BN / 2 : BN);
                for (int kt = pc.ka; kt < pc.kb; kt++) {
                    bar_wait(bars + 8 * (STAGES + s), ph ^ 1);
                    const uint32_t st = base + s * STAGE, full = bars + 8 * s;
                    bar_expect(full, 2 * RW * SUB + BN * 128);
                    tma_load(st, tx, kt * BK, r0, full);  // one TM-row box
                    if (SWIGLU) {  // BN / 2 gate rows, then the same up rows
                        tma_load(st + 2 * RW * SUB, tw1, kt * BK, wr, full);
                        tma_load(st + 2 * RW * SUB + BN * 64, tw3, kt * BK, wr, full);
                    } else {
                        tma_load(st + 2 * RW * SUB, tw1, kt * BK, wr, full);  // one BN-row box
                    }
                    if (++s == STAGES) {
                        s = 0;
                        ph ^= 1;
                    }
                }
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int cw = wg - 1, lt = tid & 127, warp = lt >> 5, lane = lt & 31, g = lane >> 2, tig = lane & 3;
    float acc[RW][NA];
    int s = 0;
    uint32_t ph = 0;
    Pieces pc(units, kt_n, SK);
    while (pc.next()) {
        const int c = pc.u % nc, jb = pc.u / nc;
        int e, r0, r1;
        chunk_rows<TM>(c, off, E, e, r0, r1);
        const int ms = min(2 * RW, (r1 - r0 + 63) / 64);
        const int na = max(0, min(RW, ms - RW * cw));  // this warpgroup's live subtiles (uniform)
        const bool live = na > 0;
        if (cw == 0) {  // compile-time A offsets for each warpgroup
            if (na == RW) consume<BN, STAGES, RW, RW, 0>(acc, base, bars, pc.ka, pc.kb, s, ph, lane);
            else if (na == 1) consume<BN, STAGES, RW, 1, 0>(acc, base, bars, pc.ka, pc.kb, s, ph, lane);
            else consume<BN, STAGES, RW, 0, 0>(acc, base, bars, pc.ka, pc.kb, s, ph, lane);
        } else {
            if (na == RW) consume<BN, STAGES, RW, RW, RW * SUB>(acc, base, bars, pc.ka, pc.kb, s, ph, lane);
            else if (na == 1) consume<BN, STAGES, RW, 1, RW * SUB>(acc, base, bars, pc.ka, pc.kb, s, ph, lane);
            else consume<BN, STAGES, RW, 0, RW * SUB>(acc, base, bars, pc.ka, pc.kb, s, ph, lane);
        }
        if (SK && pc.ka > 0) {  // a unit's tail (this CTA's first piece): its partial sums to slot blockIdx.x
            float *pp = part + ((size_t)blockIdx.x * 2 + cw) * (RW * NA * 128) + lt;
            if (live) {
#pragma unroll
                for (int i = 0; i < RW * NA; i++) __stcg(pp + i * 128, acc[i / NA][i % NA]);
            }
            __threadfence();
            consumers_sync();
            if (tid == 128) atomicExch(flags + blockIdx.x, 1);
            continue;
        }
        if (SK && pc.kb < kt_n) {  // a unit's head (this CTA's last piece): add the next CTA's tail
            const int j = blockIdx.x + 1;
            if (tid == 128)
                while (atomicAdd(flags + j, 0) == 0) __nanosleep(32);
            consumers_sync();
            __threadfence();
            const float *pp = part + ((size_t)j * 2 + cw) * (RW * NA * 128) + lt;
            if (live) {
#pragma unroll
                for (int i = 0; i < RW * NA; i++) acc[i / NA][i % NA] += __ldcg(pp + i * 128);
            }
            consumers_sync();
            if (tid == 128) atomicExch(flags + j, 0);  // clear for the next launch
        }
        if (!live) continue;
#pragma unroll
        for (int m = 0; m < RW; m++) {
        if (m >= na) break;
        // acc[m][4 j + q]: row r0 + 64 (RW cw + m) + 16 warp + g (+8 for q >= 2), column 8 j + 2 tig (+1)
        const int ra = r0 + 64 * (RW * cw + m) + 16 * warp + g, rb = ra + 8;
        if (SWIGLU) {
            const float wa = (ws != nullptr && ra < r1) ? ws[ra] : 1.f, wb = (ws != nullptr && rb < r1) ? ws[rb] : 1.f;
#pragma unroll
            for (int j = 0; j < BN / 16; j++) {
                float a[4];
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    float gt = bf(acc[m][4 * j + q]), up = bf(acc[m][4 * (j + BN / 16) + q]);
                    if (limit > 0.f) {
                        gt = fminf(gt, limit);
                        up = fminf(fmaxf(up, -limit), limit);
                    }
                    a[q] = __fdiv_rn(gt, 1.f + __expf(-gt)) * up * (q < 2 ? wa : wb);
                }
                const int col = jb * (BN / 2) + 8 * j + 2 * tig;
                if (ra < r1) *reinterpret_cast<uint32_t *>(Y + (int64_t)ra * s_y + col) = pack(a[0], a[1]);
                if (rb < r1) *reinterpret_cast<uint32_t *>(Y + (int64_t)rb * s_y + col) = pack(a[2], a[3]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < BN / 8; j++) {
                const int col = jb * BN + 8 * j + 2 * tig;
                if (ra < r1) *reinterpret_cast<uint32_t *>(Y + (int64_t)ra * s_y + col) = pack(acc[m][4 * j], acc[m][4 * j + 1]);
                if (rb < r1) *reinterpret_cast<uint32_t *>(Y + (int64_t)rb * s_y + col) = pack(acc[m][4 * j + 2], acc[m][4 * j + 3]);
            }
        }
        }
    }
}

#define ENTRY(name, BN, STAGES, SWIGLU, SK, RW)                                                                  \
    extern "C" __global__ void __launch_bounds__(NTHREADS, 1)                                                   \
        name(const __grid_constant__ CUtensorMap tx, const __grid_constant__ CUtensorMap tw1,                  \
             const __grid_constant__ CUtensorMap tw3, const int64_t *off, int E, int N, int K, __nv_bfloat16 *Y, \
             int64_t s_y, const float *ws, float limit, float *part, int *flags) {                              \
        grouped<BN, STAGES, SWIGLU, SK, RW>(&tx, &tw1, &tw3, off, E, N, K, Y, s_y, ws, limit, part, flags);     \
    }
ENTRY(grouped_gemm_n128, 128, 6, false, false, 1)
ENTRY(grouped_gemm_n128_sk, 128, 6, false, true, 1)
ENTRY(grouped_gemm_r2_n128, 128, 4, false, false, 2)
ENTRY(grouped_gemm_r2_n128_sk, 128, 4, false, true, 2)
ENTRY(grouped_swiglu_r2_n128, 128, 4, true, false, 2)
ENTRY(grouped_swiglu_r2_n128_sk, 128, 4, true, true, 2)
