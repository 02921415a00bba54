// The grouped (per-expert) GEMM of the MoE layers in CUDA C++ for Hopper (sm_90a): tensor-memory
// accelerator (TMA) loads and warpgroup MMA (wgmma) in a persistent, warp-specialised kernel.
//
// Rows sorted by expert (``off [E + 1]``, int64, on the device), ``X [T, K]`` and ``W [E * N, K]``
// bf16, K-major. Work unit: (chunk, column block), where a chunk is up to 64 * MT rows of one
// expert (an expert of n rows owns ceil(n / (64 MT)) chunks, from its first row) and a column
// block 128 output columns; units run chunk-fastest, so the blocks in flight at once share one
// expert's weight tile through L2, and every CTA (one a multiprocessor) walks units
// blockIdx.x, + gridDim.x, ... .
//
// Warpgroup 0 is the producer: one thread issues, per K step of 64, the TMA loads of the chunk's
// live 64-row subtiles of X and the 128 weight rows into a ring of STAGES stages (128-byte
// swizzle, which is wgmma's K-major layout), signalling a "full" mbarrier with the bytes expected;
// rows past T read as zeros, rows of the next expert are computed and never stored. Warpgroups 1
// and 2 consume: each owns MT / 2 of the chunk's 64-row subtiles and runs m64n128k16 MMAs over
// all 128 columns (fp32 accumulators), waits for them, and frees the stage ("empty" mbarrier).
// An output element's K chain is the MMA steps in K order from zero, whatever the unit, chunk
// or batch: a row's bits do not depend on the other rows.
//
// SWIGLU: the column block is 64 rows of W1 (gate) and the same 64 rows of W3 (up), so a thread
// holds the gate and up of the same (row, channel); the epilogue rounds both to bf16 (what the
// two-GEMM path stores), applies silu(min(g, limit)) * clamp(u, -limit, limit) [* ws[row]] in
// fp32 and writes bf16 ``Y [T, N]`` (N = W1's rows per expert), the activations only.

#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

#define BN 128      // output columns a unit (SWIGLU: 64 channels x gate, up)
#define BK 64       // K a stage
#define SUB (64 * 128)  // one 64-row subtile: 64 rows x 128 bytes
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
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// a shared-memory matrix descriptor, K-major, 128-byte swizzle (8-row groups 1024 bytes apart)
__device__ __forceinline__ uint64_t desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

// d += a b (the accumulators are zeroed by the caller: a run-time scale-d predicate was miscompiled
// into a stale one for some unrolled copies)
__device__ __forceinline__ void mma(float *d, uint64_t da, uint64_t db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db));
}

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
__device__ __forceinline__ float bf(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// chunk c (of all experts' chunks) -> its expert's first row of the chunk r0 and the expert's end r1
// (and e); false past the last chunk
__device__ __forceinline__ bool chunk_rows(int c, const int64_t *off, int E, int TM, int &e, int &r0, int &r1) {
    for (e = 0; e < E; e++) {
        const int lo = (int)off[e], hi = (int)off[e + 1];
        const int n = (hi - lo + TM - 1) / TM;
        if (c < n) {
            r0 = lo + c * TM;
            r1 = hi;
            return true;
        }
        c -= n;
    }
    return false;
}

__device__ __forceinline__ int total_chunks(const int64_t *off, int E, int TM) {
    int n = 0;
    for (int e = 0; e < E; e++) n += ((int)(off[e + 1] - off[e]) + TM - 1) / TM;
    return n;
}

// a consumer warpgroup's K loop for one unit: NA live subtiles from m0 (NA 0: it only keeps the
// ring's count)
template <int MT, int STAGES, int NA, int MW>
__device__ __forceinline__ void consume(float (&acc)[MW][64], uint32_t base, uint32_t bars, int m0, int ka, int kb, int &s,
                                        uint32_t &ph, int lane) {
    constexpr uint32_t STAGE = MT * SUB + BN * 128;
#pragma unroll
    for (int m = 0; m < NA; m++)
#pragma unroll
        for (int i = 0; i < 64; i++) acc[m][i] = 0.f;
    for (int kt = ka; kt < kb; kt++) {
        bar_wait(bars + 8 * s, ph);
        if (NA > 0) {
            // descriptors as the stage's plus offsets in 16-byte units (the address field is 14 bits
            // of 16-byte units, and a stage's offsets stay inside it)
            const uint64_t d0 = desc(base + s * STAGE);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                const uint64_t db = d0 + (uint64_t)((MT * SUB + kk * 32) >> 4);
#pragma unroll
                for (int m = 0; m < NA; m++) mma(acc[m], d0 + (uint64_t)((((m0 + m) * SUB) + kk * 32) >> 4), db);
            }
            wg_commit();
            wg_wait();
        }
        if (lane == 0) bar_arrive(bars + 8 * (STAGES + s));
        if (++s == STAGES) {
            s = 0;
            ph ^= 1;
        }
    }
}

// The pieces a CTA runs: without SK, whole units blockIdx.x, + gridDim.x, ...; with SK (stream-K),
// the CTA's equal share [i L, (i + 1) L) of all units' K steps laid end to end (L >= a unit's K
// steps, so a unit is cut at most once: its head runs last on CTA i, its tail first on CTA i + 1).
struct Pieces {
    int units, kt_n, L, pos, end, u, ka, kb;
    __device__ __forceinline__ Pieces(int units_, int kt_n_, bool sk) : units(units_), kt_n(kt_n_) {
        if (sk) {
            const long long w = (long long)units * kt_n;
            L = max(kt_n, (int)((w + gridDim.x - 1) / gridDim.x));
            pos = (int)min(w, (long long)blockIdx.x * L);
            end = (int)min(w, (long long)pos + L);
        } else {
            L = 0;
            pos = blockIdx.x;
        }
        u = -1;
    }
    __device__ __forceinline__ bool next() {
        if (L == 0) {  // whole units
            if (u < 0) u = pos; else u += gridDim.x;
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

template <int MT, int STAGES, bool SWIGLU, bool SK>
__device__ __forceinline__ void grouped(const CUtensorMap *tx, const CUtensorMap *tw1, const CUtensorMap *tw3,
                                        const int64_t *__restrict__ off, int E, int N, int K,
                                        __nv_bfloat16 *__restrict__ Y, int64_t s_y, const float *__restrict__ ws,
                                        float limit, float *__restrict__ part, int *__restrict__ flags) {
    constexpr int TM = 64 * MT;
    constexpr uint32_t STAGE = MT * SUB + BN * 128;
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

    const int nc = total_chunks(off, E, TM);
    const int nb = SWIGLU ? N / 64 : N / BN;
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
                chunk_rows(c, off, E, TM, e, r0, r1);
                const int ms = min(MT, (r1 - r0 + 63) / 64);
                const int wr0 = SWIGLU ? e * N + jb * 64 : e * N + jb * BN;
                const int wr1 = SWIGLU ? wr0 : wr0 + 64;
                for (int kt = pc.ka; kt < pc.kb; kt++) {
                    bar_wait(bars + 8 * (STAGES + s), ph ^ 1);
                    const uint32_t st = base + s * STAGE, full = bars + 8 * s;
                    bar_expect(full, ms * SUB + BN * 128);
                    for (int m = 0; m < ms; m++) tma_load(st + m * SUB, tx, kt * BK, r0 + 64 * m, full);
                    tma_load(st + MT * SUB, tw1, kt * BK, wr0, full);
                    tma_load(st + MT * SUB + SUB, SWIGLU ? tw3 : tw1, kt * BK, wr1, full);
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
    constexpr int MW = MT / 2;  // subtiles a consumer warpgroup
    const int cw = wg - 1, lt = tid & 127, warp = lt >> 5, lane = lt & 31, g = lane >> 2, tig = lane & 3;
    float acc[MW][64];
    int s = 0;
    uint32_t ph = 0;
    Pieces pc(units, kt_n, SK);
    while (pc.next()) {
        const int c = pc.u % nc, jb = pc.u / nc;
        int e, r0, r1;
        chunk_rows(c, off, E, TM, e, r0, r1);
        const int ms = min(MT, (r1 - r0 + 63) / 64);
        const int m0 = cw * MW;  // this warpgroup's first subtile
        const int na = max(0, min(MW, ms - m0));  // its live ones (warpgroup-uniform)
        if (na == MW)
            consume<MT, STAGES, MW>(acc, base, bars, m0, pc.ka, pc.kb, s, ph, lane);
        else if (MW == 2 && na == 1)
            consume<MT, STAGES, 1>(acc, base, bars, m0, pc.ka, pc.kb, s, ph, lane);
        else
            consume<MT, STAGES, 0>(acc, base, bars, m0, pc.ka, pc.kb, s, ph, lane);
        if (SK && pc.ka > 0) {  // a unit's tail (this CTA's first piece): the partial sums to slot blockIdx.x
            float *pp = part + ((size_t)blockIdx.x * 2 + cw) * (MW * 64 * 128) + lt;
#pragma unroll
            for (int m = 0; m < MW; m++)
#pragma unroll
                for (int i = 0; i < 64; i++) __stcg(pp + (m * 64 + i) * 128, acc[m][i]);
            __threadfence();
            consumers_sync();
            if (tid == 128) atomicExch(flags + blockIdx.x, 1);
            continue;
        }
        if (SK && pc.kb < kt_n) {  // a unit's head (this CTA's last piece): add the next CTA's tail
            const int j = blockIdx.x + 1;
            if (tid == 128)
                while (atomicAdd(flags + j, 0) == 0) __nanosleep(64);
            consumers_sync();
            __threadfence();
            const float *pp = part + ((size_t)j * 2 + cw) * (MW * 64 * 128) + lt;
#pragma unroll
            for (int m = 0; m < MW; m++)
#pragma unroll
                for (int i = 0; i < 64; i++) acc[m][i] += __ldcg(pp + (m * 64 + i) * 128);
            consumers_sync();
            if (tid == 128) atomicExch(flags + j, 0);  // ready for the next launch
        }
        // epilogue: acc[m][4 j + q]: row r0 + 64 (m0 + m) + 16 warp + g (+8 for q >= 2), column 8 j + 2 tig (+1)
#pragma unroll
        for (int m = 0; m < MW; m++) {
            if (m0 + m >= ms) continue;
            const int ra = r0 + 64 * (m0 + m) + 16 * warp + g, rb = ra + 8;
            if (SWIGLU) {
                const float wa = (ws != nullptr && ra < r1) ? ws[ra] : 1.f, wb = (ws != nullptr && rb < r1) ? ws[rb] : 1.f;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    float a[4];
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        float gt = bf(acc[m][4 * j + q]), up = bf(acc[m][4 * (j + 8) + q]);
                        if (limit > 0.f) {
                            gt = fminf(gt, limit);
                            up = fminf(fmaxf(up, -limit), limit);
                        }
                        a[q] = __fdiv_rn(gt, 1.f + __expf(-gt)) * up * (q < 2 ? wa : wb);
                    }
                    const int col = jb * 64 + 8 * j + 2 * tig;
                    if (ra < r1) *reinterpret_cast<uint32_t *>(Y + (int64_t)ra * s_y + col) = pack(a[0], a[1]);
                    if (rb < r1) *reinterpret_cast<uint32_t *>(Y + (int64_t)rb * s_y + col) = pack(a[2], a[3]);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 16; j++) {
                    const int col = jb * BN + 8 * j + 2 * tig;
                    if (ra < r1) *reinterpret_cast<uint32_t *>(Y + (int64_t)ra * s_y + col) = pack(acc[m][4 * j], acc[m][4 * j + 1]);
                    if (rb < r1)
                        *reinterpret_cast<uint32_t *>(Y + (int64_t)rb * s_y + col) = pack(acc[m][4 * j + 2], acc[m][4 * j + 3]);
                }
            }
        }
    }
}

#define SMEM_BYTES(MT, STAGES) ((STAGES) * ((MT) * SUB + BN * 128) + 2 * (STAGES) * 8 + 1024)

#define ENTRY(name, MT, STAGES, SWIGLU, SK)                                                                      \
    extern "C" __global__ void __launch_bounds__(NTHREADS, 1)                                                   \
        name(const __grid_constant__ CUtensorMap tx, const __grid_constant__ CUtensorMap tw1,                  \
             const __grid_constant__ CUtensorMap tw3, const int64_t *off, int E, int N, int K, __nv_bfloat16 *Y, \
             int64_t s_y, const float *ws, float limit, float *part, int *flags) {                              \
        grouped<MT, STAGES, SWIGLU, SK>(&tx, &tw1, &tw3, off, E, N, K, Y, s_y, ws, limit, part, flags);         \
    }
ENTRY(grouped_gemm_m2, 2, 6, false, false)
ENTRY(grouped_gemm_m4, 4, 4, false, false)
ENTRY(grouped_swiglu_m2, 2, 6, true, false)
ENTRY(grouped_swiglu_m4, 4, 4, true, false)
ENTRY(grouped_gemm_m2_sk, 2, 6, false, true)
ENTRY(grouped_gemm_m4_sk, 4, 4, false, true)
ENTRY(grouped_swiglu_m2_sk, 2, 6, true, true)
ENTRY(grouped_swiglu_m4_sk, 4, 4, true, true)
