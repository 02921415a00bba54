"""Ahead-of-time builds of the Triton kernels for Hopper (``sm_90a``) without a GPU: the
signatures the wrappers launch with, compiled to cubin by Triton's bundled ptxas (CPU tests)."""

P, F, I = "*fp32", "fp32", "i32"
BF = "*bf16"


def _sig(names: str, types: list[str]) -> dict:
    return dict(zip(names.split(), types))


SLICES_SIG = _sig("X W Y P PSS CNT M N K Kf eps s_xm s_wn s_ym", [P, P, P, P, P, "*i32", I, I, I, F, F, I, I, I])


def kernels() -> dict:
    """name -> (jit function, signature, constexprs[, options]) at V4-Flash widths."""
    from v4stack.kernels import triton_attention as ta
    from v4stack.kernels import triton_attention_online as tao
    from v4stack.kernels import triton_gemm as tg
    from v4stack.kernels import triton_grouped as tgr
    from v4stack.kernels import triton_grouped_tma as tgt
    from v4stack.kernels import triton_layout as tlay
    from v4stack.kernels import triton_mhc as tm
    from v4stack.kernels import triton_ring as ring
    from v4stack.kernels import triton_round as tround
    from v4stack.kernels import triton_route as route
    from v4stack.kernels import triton_rows as tr
    from v4stack.kernels import triton_select as tsel
    from v4stack.kernels import triton_sample as tsm
    from v4stack.kernels import triton_slices as ts
    from v4stack.kernels import triton_wide as tw

    attn_args = "Q s_qt s_qh P0 I0 s_i0 K0 N0 P1 I1 s_i1 K1 N1 Sink"
    attn_types = [BF, I, I, BF, "*i64", I, I, I, BF, "*i64", I, I, I, P]
    cx = dict(D=512, BH=16, CH=64, IEEE=False, NB=4)
    return {
        "sparse_attention_fused": (ta.fused_kernel, _sig(attn_args + " O s_ot s_oh H scale NCH",
                                                         attn_types + [BF, I, I, I, F, I]), dict(cx, DV=512)),
        **{name: (tao.online_kernel, _sig(attn_args + " O s_ot s_oh H scale2 NCH qeps",
                                          attn_types + [BF, I, I, I, F, I, F]), dict(cx, BH=64, QN=qn),
                  dict(num_warps=8, num_stages=2))
           for name, qn in (("sparse_attention_online", False), ("sparse_attention_online_qn", True))},
        "sparse_attention_split": (ta.split_kernel, _sig(attn_args + " Pm Pl Pa H scale NCH",
                                                         attn_types + [P, P, P, I, F, I]), cx),
        "sparse_attention_merge": (ta.merge_kernel, _sig("Pm Pl Pa Sink O s_ot s_oh H NCH",
                                                         [P, P, P, P, BF, I, I, I, I]), dict(D=512, BH=16)),
        "grouped_gemm_bf16": (tgr.grouped_table_kernel, _sig("X W Y Off E N K s_xm s_we s_wn s_ym",
                                                             [BF, BF, BF, "*i64", I, I, I, I, I, I, I]),
                              dict(EB=256, BM=64, BN=128, BK=64, IEEE=False)),
        "grouped_gemm_bf16_tma": (tgt.grouped_tma_kernel,
                                  _sig("x_desc w_desc Y Off E N K s_ym", ["tensordesc<bf16[128, 64]>",
                                                                          "tensordesc<bf16[256, 64]>", BF, "*i64",
                                                                          I, I, I, I]),
                                  dict(EB=16, BM=128, BN=256, BK=64, NUM_SMS=132, FLAT=True),
                                  dict(num_warps=8, num_stages=3)),
        "group_gemm_bf16_tma": (tgt.group_tma_kernel,
                                _sig("x_desc w_desc Y T N K G s_ym", ["tensordesc<bf16[64, 64]>",
                                                                      "tensordesc<bf16[128, 64]>", BF, I, I, I, I, I]),
                                dict(BM=64, BN=128, BK=64, NUM_SMS=264), dict(num_warps=4, num_stages=4)),
        "gemm_fp32_tf32x3": (ts.slices_kernel, SLICES_SIG, dict(SPLIT=256, BM=64, BN=32, BK=32, TF32X3=True, RMS=False,
                                                                GRID=True, UNR=8, TWO=False),
                             dict(num_warps=4, num_stages=3)),
        **{f"gemm_bf16_{size}": (ts.slices_kernel, {**SLICES_SIG, **_sig("X W Y", [BF, BF, BF])},
                                 dict(SPLIT=2048, BM=t["BM"], BN=t["BN"], BK=t["BK"], TF32X3=False, RMS=False,
                                      GRID=t.get("grid", False), UNR=t.get("unroll", 8), TWO=t.get("two", False)),
                                 dict(num_warps=t["num_warps"], num_stages=t["num_stages"]))
           for size, (_, t) in zip(("small", "mid"), tg.HALF_TILES)},
        "gemm_bf16_large": (ts.slices_kernel, {**SLICES_SIG, **_sig("X W Y", [BF, BF, BF])},
                            dict(SPLIT=2048, BM=128, BN=128, BK=64, TF32X3=False, RMS=False, GRID=False, UNR=8,
                                 TWO=False),
                            dict(num_warps=8, num_stages=4)),
        "hc_mix": (ts.slices_kernel, SLICES_SIG, dict(SPLIT=256, BM=64, BN=32, BK=32, TF32X3=True, RMS=True, GRID=True,
                                                      UNR=8, TWO=True), dict(num_warps=4, num_stages=3)),
        "hc_mix_finish": (ts.finish_kernel, _sig("P PSS Y M N Kf eps s_ym", [P, P, P, I, I, F, F, I]),
                          dict(S=64, FR=4, BN=ts.FINISH_BN, RMS=True), dict(num_warps=4, num_stages=1)),
        "hc_mix_bf16_streams": (ts.slices_kernel, {**SLICES_SIG, **_sig("X", [BF])},
                                dict(SPLIT=256, BM=64, BN=32, BK=32, TF32X3=True, RMS=True, GRID=False, UNR=8,
                                     TWO=False),
                                dict(num_warps=4, num_stages=3)),
        "indexer_scores": (tg.indexer_kernel, _sig("Q Wt Kc Rows Y S H NK s_qt s_qh s_wt s_kt s_ks s_rt s_yt",
                                                   [BF, BF, BF, "*i64", BF] + [I] * 10),
                           dict(D=128, BH=64, BS=128, CH=1, IEEE=False, INDEXED=True)),
        # the decode step's launch as it runs: the pointers and the strides divisible by 16 (with a bf16
        # pool's 256-byte rows, and with V4's packed keys in 144-byte rows; at 132 bytes the key stride is not)
        **{name: (tg.indexer_kernel, _sig("Q Wt Kc Rows Y S H NK s_qt s_qh s_wt s_kt s_ks s_rt s_yt",
                                          [BF, P, key, "*i64", P] + [I] * 10),
                  dict(D=128, BH=64, BS=128, CH=1, IEEE=False, INDEXED=True, FP8=key == "*u8"),
                  dict(num_warps=4, num_stages=3, divisible=("Q", "Wt", "Kc", "Rows", "Y", "s_qt", "s_qh", "s_rt",
                                                             "s_yt") + (("s_ks",) if aligned else ())))
           for name, key, aligned in (("indexer_scores_decode", BF, True), ("indexer_scores_fp8", "*u8", True),
                                      ("indexer_scores_fp8_132", "*u8", False))},
        "topk_rows": (tsel.topk_rows_kernel, _sig("S ROWS OUT E k s_s s_r s_o", [P, "*i64", "*i64"] + [I] * 5),
                      dict(EB=4096, BITS=1, EBT=0, SHIFT=0), dict(num_warps=8)),
        # a 16k step's width (4608) on the indexer's bf16 scores: one 8192-wide block (the form before
        # the split), two bits a pass, and two blocks (4096 + 512)
        "topk_rows_bf16_wide": (tsel.topk_rows_kernel, _sig("S ROWS OUT E k s_s s_r s_o",
                                                            [BF, "*i64", "*i64"] + [I] * 5),
                                dict(EB=8192, BITS=1, EBT=0, SHIFT=0), dict(num_warps=16)),
        "topk_rows_bf16_pairs": (tsel.topk_rows_kernel, _sig("S ROWS OUT E k s_s s_r s_o",
                                                             [BF, "*i64", "*i64"] + [I] * 5),
                                 dict(EB=8192, BITS=2, EBT=0, SHIFT=0), dict(num_warps=16)),
        "topk_rows_bf16_split": (tsel.topk_rows_kernel, _sig("S ROWS OUT E k s_s s_r s_o",
                                                             [BF, "*i64", "*i64"] + [I] * 5),
                                 dict(EB=4096, BITS=1, EBT=512, SHIFT=16), dict(num_warps=4)),
        "feed_ids": (tlay.feed_ids_kernel, _sig("IDS SRC FED T", ["*i64", "*i64", "*i64", I]), dict(BT=256),
                     dict(num_warps=4)),
        "layout_in": (tlay.layout_in_kernel, _sig("STAGE BUF FED n R", ["*i64", "*i64", "*i64", I, I]), dict(BT=128),
                      dict(num_warps=4)),
        "fp8_gemm": (tg.fp8_kernel, _sig("X W Sc Y M N K s_xm s_wn s_sn s_ym", [BF, "*fp8e4nv", P, BF] + [I] * 7),
                     dict(BM=64, BN=128, BK=128, SB=128)),
        "softmax_row": (tr.softmax_kernel, _sig("X Y N s_x s_y", [P, P, I, I, I]), dict(LOG=False, BLOCK=4096)),
        "log_softmax_chunks": (tr.chunk_write_kernel, _sig("X Y Pm Ps N s_x s_y S", [P, P, P, P, I, I, I, I]),
                               dict(LOG=True, BLOCK=4096, SB=32)),
        "weighted_pool": (tr.pool_kernel, _sig("KV S Y P C s_kr s_kp s_sr s_sp s_yr", [P, P, P] + [I] * 7),
                          dict(BP=8, BC=256)),
        # an HCA entry's 128 rows: the launch's columns (POOL_ELEMS / 128), and the 256 it took before
        "weighted_pool_p128": (tr.pool_kernel, _sig("KV S Y P C s_kr s_kp s_sr s_sp s_yr", [P, P, P] + [I] * 7),
                               dict(BP=128, BC=32)),
        "weighted_pool_p128_wide": (tr.pool_kernel, _sig("KV S Y P C s_kr s_kp s_sr s_sp s_yr", [P, P, P] + [I] * 7),
                                    dict(BP=128, BC=256)),
        "moe_combine": (tr.combine_kernel, _sig("Yin Idx Out k D s_yn s_yk s_in s_on", [P, "*i64", P] + [I] * 6),
                        dict(BK=8, BD=1024)),
        "rms_norm": (tr.rms_norm_kernel, _sig("X W Y N Nf s_x s_y eps", [BF, BF, BF, I, F, I, I, F]),
                     dict(HAS_W=True, BLOCK=4096)),
        **{name: (tw.wide_partials_kernel, _sig("X W P PSS M N K s_xm s_wn", [BF, wt, P, P, I, I, I, I, I]),
                  dict(KC=tw.TILE["KC"], BM=tw.TILE["BM"], BN=bn, BK=tw.TILE["BK"], SPLIT_W=wt == P, RMS=rms),
                  dict(num_warps=tw.TILE["num_warps"], num_stages=tw.TILE["num_stages"]))
           for name, wt, bn, rms in (("wide_partials", P, 32, True), ("wide_partials_bf16w", BF, 16, False))},
        "unsort": (route.unsort_kernel, _sig("O RANK IDX S Y k D s_o s_s s_y", [BF, "*i64", "*i64", BF, BF, I, I, I, I, I]),
                   dict(BK=8, BD=1024, HAS_S=False, JOIN=True), dict(num_warps=4)),
        # as the decode step launches them (tm.ROW_LAUNCH), and the first with ptxas's register cap at 128
        **{name: (tm.finish_read_norm_kernel,
                  _sig("P PSS Y SCALE BASE PRE POST COMB X W OUT M N MN Kf norm_eps s_ym eps D Df s_xn s_xj s_on "
                       "rms_eps", [P] * 8 + [BF, BF, BF, I, I, I, F, F, I, F, I, F, I, I, I, F]),
                  dict(S=64, SP=64, BN=32, NH=4, ITERS=20, HAS_W=True, NB=4, BD=4096), dict(opts, num_stages=1))
           for name, opts in (("finish_read_norm", tm.ROW_LAUNCH), ("finish_read_norm_maxnreg128", dict(num_warps=8, maxnreg=128)))},
        "finish_head_read_norm": (tm.finish_head_read_norm_kernel,
                                  _sig("P PSS Y SCALE BASE X W OUT M N MN Kf norm_eps s_ym eps D Df s_xn s_xj s_on "
                                       "rms_eps", [P] * 5 + [BF, BF, BF, I, I, I, F, F, I, F, I, F, I, I, I, F]),
                                  dict(S=64, SP=64, BN=32, NH=4, HAS_W=True, NB=4, BD=4096),
                                  dict(tm.ROW_LAUNCH, num_stages=1)),
        "greedy_blocks": (tsm.greedy_blocks_kernel, _sig("X PM PS PI V s_x NC", [BF, P, P, "*i32", I, I, I]),
                          dict(CHUNK=tsm.SHIPPED["CHUNK"], BLOCK=tsm.SHIPPED["BLOCK"]),
                          # as a decode step launches it: V-Flash's 129280-wide rows, the buffers aligned
                          dict(num_warps=tsm.SHIPPED["num_warps"], divisible=("X", "PM", "PS", "PI", "V", "s_x"))),
        "greedy_lean": (tsm.greedy_lean_kernel, _sig("X PM PS PI V s_x NC", [BF, P, P, "*i32", I, I, I]),
                        dict(BLOCK=2048, VEC=8), dict(num_warps=2, divisible=("X", "PM", "PS", "PI", "V", "s_x"))),
        **route.builds(),  # the MoE routing kernels (moe_*)
        **ring.builds(),  # the decode step's ring writes
        **tround.builds(),  # the activation rounding
    }


# an SM's registers (sm_80 .. sm_90) and the unit a warp's are allocated in
SM_REGISTERS, WARP_REGISTER_UNIT = 65536, 256


def programs_per_sm(registers: int, num_warps: int) -> int:
    """How many programs of ``num_warps`` warps at ``registers`` a thread an SM holds at once, as far
    as its registers go (a warp's ``32 * registers`` rounded up to the allocation unit)."""
    per_warp = -(-32 * registers // WARP_REGISTER_UNIT) * WARP_REGISTER_UNIT
    return SM_REGISTERS // (per_warp * num_warps)


def build(name: str, arch: int = 90):
    """Compile kernel ``name`` for ``sm_{arch}`` (no GPU needed); returns Triton's compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, sig, cx, *opts = kernels()[name]
    sig = {**sig, **{k: "constexpr" for k in cx}}
    opts = dict(opts[0]) if opts else {}
    # arguments a real launch has divisible by 16 (Triton specialises on it: aligned, vector loads)
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in opts.pop("divisible", ())}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=opts)


def registers(name: str, arch: int = 90) -> dict:
    """Registers a thread and spill bytes of kernel ``name``'s ``sm_{arch}a`` build, as Triton's
    bundled ``ptxas -v`` reports them, and ``instructions``: the SASS instructions its bundled
    ``cuobjdump`` lists for the build (None where Triton bundles no ``cuobjdump``) - for a kernel
    bound by its instructions, the count that matters - with ``barriers``, its ``BAR.SYNC`` among
    them; ``layout_changes``: the ``convert_layout`` ops of its Triton GPU IR (each a trip through
    shared memory or lane shuffles)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = Path(get_ptxas(arch).path)
    k = build(name, arch)
    with tempfile.TemporaryDirectory() as d:
        src, cubin = Path(d) / "k.ptx", Path(d) / "k.cubin"
        src.write_text(k.asm["ptx"])
        r = subprocess.run([str(ptxas), f"-arch=sm_{arch}a", "-v", str(src), "-o", str(cubin)],
                           capture_output=True, text=True, check=True)
        dump = ptxas.parent / "cuobjdump"
        sass = subprocess.run([str(dump), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout if dump.exists() else None
    log = r.stdout + r.stderr
    return {"registers": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_bytes": sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)),
            # one instruction a line: "/*0a40*/  LDS R18, [UR4] ;"
            "instructions": None if sass is None else len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", sass, re.M)),
            "barriers": None if sass is None else len(re.findall(r"\bBAR\.SYNC\b", sass)),
            "layout_changes": k.asm["ttgir"].count("ttg.convert_layout")}


if __name__ == "__main__":  # python -m v4stack.kernels.builds NAME ...: registers, spills, instructions, barriers
    import sys

    for n in sys.argv[1:]:
        print(n, registers(n))
