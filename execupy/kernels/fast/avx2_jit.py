"""XNNPACK's qb4w products in its "avx2" arithmetic (xnnpack_gemm.py) with AVX2's byte products, on
weights in the "lanes" layout (imported only where numba is installed).

The arithmetic keeps four exact integer sums per output and block, lane t holding the inputs k
with (k mod 8) // 2 == t, each block's sum joining its lane's chain with one fma. A stored byte
holds one lane's two inputs of one word row (inputs 8r + 2t in the low nibble, 8r + 2t + 1 in the
high one), so the "lanes" layout (xnnpack_gemm._panel_words) puts side by side the bytes of two
word rows, r = 2d and 2d + 1, of the same output and lane: in a register's 32 bytes, four
outputs' four lanes, byte 2 * (4t + c) + rho for output c, lane t, row 2d + rho. The low nibbles
of such a register are then, per int16, a lane's inputs 2t of the two rows, and `vpmaddubsw`
(unsigned bytes times signed bytes, adjacent products added) multiplies them by the activations
arranged to match (lane_activations) into that lane's int16: 32 products an instruction, with no
shuffle of the weights (the "rows" layout took two shuffles a register and a permute of the
scales per block: 33 -> 47 G weights/s a core in cache). Sixteen registers make a panel's double
row; each pair of them (GROUP) is one run of memory, a cache line per double row, read straight
through while the pair's chains stay in vector registers, and their block scales one run too
(xnnpack_gemm.lanes_scales: read across the panel's rows, they cost a third of a mat-vec's time
from memory).

int16 sums are widened every CHUNK double rows (4 * 2 * 2 * 15 * 128 fits), then, per block,
chain = fma(float(sum) - shift, scale, chain) in each lane as XNNPACK does: the same bits. A
prompt's rows go ROWS at a time, each register's nibbles taken apart once for all of them.

`AVX2` is True only where numba compiles for a CPU with AVX2 and FMA (vnni_jit.target_has).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .vnni_jit import PANEL, _arrays, prefetch_ahead, target_has

AVX2 = target_has("avx2", "fma")
LANES = 4  # partial sums per output
OUTPUTS = 4  # outputs per 32-byte register (four lanes each, two word rows)
REGISTERS = PANEL // OUTPUTS  # registers per double row of a panel
GROUP = 2  # registers side by side in the lanes layout, a cache line (xnnpack_gemm.LANES_GROUP)
CHUNK = 4  # double rows whose int16 sums cannot overflow: 4 * (2 + 2) * 15 * 128 < 2**15

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_V8, _V8F, _V4F = ir.VectorType(_I32, 8), ir.VectorType(_F32, 8), ir.VectorType(_F32, 4)
_V32B, _V16B, _V16S = ir.VectorType(_I8, 32), ir.VectorType(_I8, 16), ir.VectorType(_I16, 16)
_NIBBLES, _FOUR = ir.Constant(_V32B, [0x0F] * 32), ir.Constant(_V8, [4] * 8)


def _indices(values) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(values)), list(values))


def _activation_pattern(e: int) -> ir.Constant:
    """Which of a double row's 16 inputs each byte of the activations register holds: byte
    2 * (4t + c) + rho is input 8 * rho + 2t + e (the low nibbles' factors for e = 0, the high
    ones' for e = 1), whatever the output c."""
    return _indices([8 * rho + 2 * t + e for t in range(LANES) for c in range(OUTPUTS) for rho in (0, 1)])


@intrinsic
def lane_activations(typingctx, q, xs):
    """xs int8 [K/16, 2, 32]: for each double row d, the row's signed activations q int8 [K]
    (C order) arranged as panel_outputs' registers need them: xs[d, e] for the nibbles
    e = 0 (low) and 1 (high)."""
    def codegen(context, builder, sig, args):
        q_t, xs_t = sig.args
        q_arr, xs_arr = _arrays(context, builder, sig, args, (0, 1))
        intp = cgutils.intp_t
        zero, one = ir.Constant(intp, 0), ir.Constant(intp, 1)
        q_at = builder.bitcast(cgutils.get_item_pointer(context, builder, q_t, q_arr, [zero], wraparound=False),
                               _V16B.as_pointer())
        with cgutils.for_range_slice(builder, zero, builder.extract_value(xs_arr.shape, 0), one) as (d, _):
            inputs = builder.load(builder.gep(q_at, [d]), align=1)
            for e in (0, 1):
                at = cgutils.get_item_pointer(context, builder, xs_t, xs_arr, [d, ir.Constant(intp, e), zero],
                                              wraparound=False)
                builder.store(builder.shuffle_vector(inputs, inputs, _activation_pattern(e)),
                              builder.bitcast(at, _V32B.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.void(q, xs), codegen


def _fma8(builder, a, b, c):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8F, [_V8F] * 3), "llvm.fma.v8f32")
    return builder.call(fn, [a, b, c])


def _maddubs(builder):
    """vpmaddubsw (unsigned bytes, signed bytes) -> the int16 sums of adjacent byte products."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16S, [_V32B, _V32B]),
                                          "llvm.x86.avx2.pmadd.ub.sw")


def _vector(context, builder, array_type, array, indices, vector):
    at = cgutils.get_item_pointer(context, builder, array_type, array, indices, wraparound=False)
    return builder.bitcast(at, vector.as_pointer())


def _sums_of_double_row(context, builder, xs_t, xs_arr, row_ids, d, starts, step, sums):
    """sums[m][g] (int16 [16], row m, register g of the pair) plus double row d's products: the
    low nibbles times xs[row, d, 0], the high ones times xs[row, d, 1]; each register's nibbles
    taken apart once for all the rows."""
    intp = cgutils.intp_t
    zero, one = ir.Constant(intp, 0), ir.Constant(intp, 1)
    maddubs = _maddubs(builder)
    x = [[builder.load(_vector(context, builder, xs_t, xs_arr, [row, d, e, zero], _V32B), align=1) for e in (zero, one)]
         for row in row_ids]
    out = [list(row_sums) for row_sums in sums]
    for g, start in enumerate(starts):
        at = builder.gep(start, [builder.mul(d, step)])
        if g == 0:
            prefetch_ahead(builder, at)  # the pair's 64 bytes: one cache line
        w = builder.load(builder.bitcast(at, _V8.as_pointer()), align=1)
        low = builder.and_(builder.bitcast(w, _V32B), _NIBBLES)
        high = builder.and_(builder.bitcast(builder.lshr(w, _FOUR), _V32B), _NIBBLES)
        for m, (low_x, high_x) in enumerate(x):
            products = builder.add(builder.call(maddubs, [low, low_x]), builder.call(maddubs, [high, high_x]))
            out[m][g] = builder.add(out[m][g], products)
    return out


def _widened(builder, sums):
    """int16 [16] -> (int32 [8] lanes 0, 1; int32 [8] lanes 2, 3)."""
    return tuple(builder.sext(builder.shuffle_vector(sums, sums, _indices(range(8 * h, 8 * h + 8))), _V8) for h in (0, 1))


def _splat4(builder, x):
    one = builder.insert_element(ir.Constant(_V4F, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(_V4F, ir.Undefined), _indices([0] * 4))


def _emit_panel_outputs(context, builder, sig, args, per: int | None, rows: int) -> None:
    """The IR of panel_outputs for blocks of `per` double rows, unrolled (per <= CHUNK), or, for
    None, of any size (the per_block argument), widened every CHUNK double rows; `rows` rows at a time."""
    words_t, xs_t, sh_t, sc_t, ks_t, zf_t, _, _, _, _, y_t = sig.args
    w_arr, xs_arr, sh_arr, sc_arr, ks_arr, zf_arr, y_arr = _arrays(context, builder, sig, args,
                                                                   (0, 1, 2, 3, 4, 5, 10))
    p0, p1, r0 = args[7], args[8], args[9]
    intp = cgutils.intp_t
    per_d = args[6] if per is None else ir.Constant(intp, per)
    zero, one = ir.Constant(intp, 0), ir.Constant(intp, 1)
    row_ids = [builder.add(r0, ir.Constant(intp, m)) for m in range(rows)]
    doubles = builder.extract_value(xs_arr.shape, 1)
    blocks = builder.extract_value(sh_arr.shape, 1)
    step = ir.Constant(intp, 32 * GROUP)  # a pair of registers' bytes of a double row
    run_bytes = builder.mul(doubles, step)  # the pair's run through a panel
    zf4 = [_splat4(builder, builder.load(_vector(context, builder, zf_t, zf_arr, [row], _F32))) for row in row_ids]
    # v1..v3 start as 0 * zp (-0.0 for a negative one, as XNNPACK's)
    zeros8 = [builder.fmul(ir.Constant(_V8F, [0.0] * 8), builder.shuffle_vector(z, z, _indices([0] * 8)))
              for z in zf4]
    chains = [[[cgutils.alloca_once(builder, _V8F) for _ in range(2)] for _ in range(GROUP)] for _ in range(rows)]
    acc32 = [[[cgutils.alloca_once(builder, _V8) for _ in range(2)] for _ in range(GROUP)] for _ in range(rows)]
    acc16 = [[cgutils.alloca_once(builder, _V16S) for _ in range(GROUP)] for _ in range(rows)]
    with cgutils.for_range_slice(builder, p0, p1, one) as (p, _):
        panel_at = _vector(context, builder, words_t, w_arr, [p, zero, zero], _I8)
        scales_at = _vector(context, builder, sc_t, sc_arr, [p, zero, zero], _F32)
        with cgutils.for_range_slice(builder, zero, ir.Constant(intp, REGISTERS), ir.Constant(intp, GROUP)) \
                as (g0, _):
            pair = builder.udiv(g0, ir.Constant(intp, GROUP))
            run_at = builder.gep(panel_at, [builder.mul(pair, run_bytes)])
            starts = [builder.gep(run_at, [ir.Constant(intp, 32 * g)]) for g in range(GROUP)]
            outputs = [builder.mul(builder.add(g0, ir.Constant(intp, g)), ir.Constant(intp, OUTPUTS))
                       for g in range(GROUP)]
            for g in range(GROUP):  # v0 = ksum * zp, v1..v3 = 0 * zp
                ks_at = _vector(context, builder, ks_t, ks_arr,
                                [builder.add(builder.mul(p, ir.Constant(intp, PANEL)), outputs[g])], _V4F)
                ks = builder.load(ks_at, align=4)
                for m in range(rows):
                    low4 = builder.shuffle_vector(zeros8[m], zeros8[m], _indices(range(4)))
                    builder.store(builder.shuffle_vector(builder.fmul(ks, zf4[m]), low4, _indices(range(8))),
                                  chains[m][g][0])
                    builder.store(zeros8[m], chains[m][g][1])
            with cgutils.for_range_slice(builder, zero, blocks, one) as (b, _):
                d0 = builder.mul(b, per_d)
                if per is not None:  # the block's double rows unrolled, its int16 sums in registers
                    sums = [[ir.Constant(_V16S, None)] * GROUP for _ in range(rows)]
                    for i in range(per):
                        sums = _sums_of_double_row(context, builder, xs_t, xs_arr, row_ids,
                                                   builder.add(d0, ir.Constant(intp, i)), starts, step, sums)
                    wide = [[_widened(builder, s) for s in row_sums] for row_sums in sums]
                else:
                    for acc in (a for row_accs in acc32 for g_accs in row_accs for a in g_accs):
                        builder.store(ir.Constant(_V8, None), acc)
                    d_end = builder.add(d0, per_d)
                    with cgutils.for_range_slice(builder, d0, d_end, ir.Constant(intp, CHUNK)) as (chunk, _):
                        for acc in (a for row_accs in acc16 for a in row_accs):
                            builder.store(ir.Constant(_V16S, None), acc)
                        chunk_end = builder.add(chunk, ir.Constant(intp, CHUNK))
                        chunk_end = builder.select(builder.icmp_signed("<", chunk_end, d_end), chunk_end, d_end)
                        with cgutils.for_range_slice(builder, chunk, chunk_end, one) as (d, _):
                            sums = _sums_of_double_row(context, builder, xs_t, xs_arr, row_ids, d, starts, step,
                                                       [[builder.load(a) for a in row_accs] for row_accs in acc16])
                            for row_accs, row_sums in zip(acc16, sums):
                                for acc, value in zip(row_accs, row_sums):
                                    builder.store(value, acc)
                        for m in range(rows):
                            for g in range(GROUP):
                                for acc, half in zip(acc32[m][g], _widened(builder, builder.load(acc16[m][g]))):
                                    builder.store(builder.add(builder.load(acc), half), acc)
                    wide = [[[builder.load(a) for a in g_accs] for g_accs in row_accs] for row_accs in acc32]
                # the pair's scales of block b: eight floats at (pair * blocks + b) * 8 in the panel's
                pair_scales = builder.mul(builder.add(builder.mul(pair, blocks), b), ir.Constant(intp, 4 * GROUP))
                scale = []
                for g in range(GROUP):
                    scale4 = builder.load(builder.bitcast(builder.gep(scales_at, [
                        builder.add(pair_scales, ir.Constant(intp, 4 * g))]), _V4F.as_pointer()), align=4)
                    scale.append(builder.shuffle_vector(scale4, scale4, _indices(list(range(4)) * 2)))
                for m, row in enumerate(row_ids):
                    shift = [builder.load(_vector(context, builder, sh_t, sh_arr, [row, b, ir.Constant(intp, h), zero],
                                                  _V8F), align=4) for h in (0, 1)]
                    for g in range(GROUP):
                        for h in (0, 1):
                            lane_sums = builder.fsub(builder.sitofp(wide[m][g][h], _V8F), shift[h])  # exact: < 2**24
                            chain = chains[m][g][h]
                            builder.store(_fma8(builder, lane_sums, scale[g], builder.load(chain)), chain)
            lo, hi = _indices(range(4)), _indices(range(4, 8))
            column0 = builder.mul(builder.sub(p, p0), ir.Constant(intp, PANEL))
            for m, row in enumerate(row_ids):
                for g in range(GROUP):  # y = (v0 + v1) + (v2 + v3)
                    v01, v23 = builder.load(chains[m][g][0]), builder.load(chains[m][g][1])
                    y4 = builder.fadd(
                        builder.fadd(builder.shuffle_vector(v01, v01, lo), builder.shuffle_vector(v01, v01, hi)),
                        builder.fadd(builder.shuffle_vector(v23, v23, lo), builder.shuffle_vector(v23, v23, hi)))
                    at = _vector(context, builder, y_t, y_arr, [row, builder.add(column0, outputs[g])], _V4F)
                    builder.store(y4, at, align=4)


def _panel_outputs(rows: int):
    """panel_outputs for `rows` rows at a time: blocks of 16, 32 and 64 inputs (per_block 1, 2, 4)
    unrolled, any other multiple of 16 through the loop, chosen by per_block."""
    @intrinsic
    def panel_outputs(typingctx, words, xs, shifts, scales, ksum, zf, per_block, p0, p1, r0, y):
        def codegen(context, builder, sig, args):
            unrolled = (1, 2, 4)
            done = builder.append_basic_block("panels_done")
            bodies = [builder.append_basic_block(f"per_block_{per}") for per in (*unrolled, "any")]
            switch = builder.switch(args[6], bodies[-1])
            for per, body in zip(unrolled, bodies):
                switch.add_case(ir.Constant(cgutils.intp_t, per), body)
            for per, body in zip((*unrolled, None), bodies):
                builder.position_at_end(body)
                _emit_panel_outputs(context, builder, sig, args, per, rows)
                builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()
        return types.void(words, xs, shifts, scales, ksum, zf, per_block, p0, p1, r0, y), codegen
    return panel_outputs


# panel_outputs_one / _four(words, xs, shifts, scales, ksum, zf, per_block, p0, p1, r0, y):
# y[r, (p - p0) * PANEL + j] for rows r0 .. r0 + 1 (or ROWS) and panels p0..p1: each output's four lane
# chains in XNNPACK's "avx2" arithmetic, v0 from ksum * zf[r] and v1..v3 from 0 * zf[r],
# v = fma(float(block sum) - shift, scale, v) block after block, then (v0 + v1) + (v2 + v3).
# words uint32 [P, K/8, PANEL] and scales float32 [P, blocks, PANEL] in the lanes layout
# (xnnpack_gemm._panel_words, lanes_scales); xs int8 [M, K/16, 2, 32] (lane_activations of each
# row); shifts float32 [M, blocks, 2, 8]: each row's lane shifts as the chains hold them ([t0 x4,
# t1 x4], [t2 x4, t3 x4]); ksum float32 [P * PANEL]; zf float32 [M] the zero points; per_block:
# double rows a block; y float32 [M, *].
ROWS = 4  # rows of a prompt a weight's nibbles are taken apart for
panel_outputs_one, panel_outputs_four = _panel_outputs(1), _panel_outputs(ROWS)
