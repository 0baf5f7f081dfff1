"""XNNPACK's qb4w mat-vec on AVX512-VNNI, one panel of 64 output columns in registers (imported
only where numba is installed; the layout and arithmetic are xnnpack_gemm.py's); the same chains
for four rows of a prompt at once (`panel_chain_rows`), and the int32 sums of int8 weights for a
prompt's rows (`channel_panel_rows`, qd8 x qc8w).

`vpdpbusd` multiplies four unsigned bytes by four signed bytes and adds the four products into
an int32 lane: a panel's eight inputs of a word row in two instructions, where the float path
converts and multiplies every nibble alone. numba cannot emit it, so `panel_chain` writes the
LLVM IR: per block the exact integer sums, then the block's fma into v (`llvm.fma`, rounded
once as XNNPACK's vfmadd and the float path's fma32: the same bits). The fma in float32 is
sixteen lanes an instruction where its float64 emulation was half as wide and four steps longer
(a 576 x 1536 mat-vec in cache: 17 -> 10 us). A panel
is four registers wide: each register's chain of fmas waits on the block before, and four
independent chains keep the core busy (one register at a time ran 2x slower, in-cache), while
a word row of the panel is one run of 256 bytes (four panels of 16 read side by side were
slower from memory).

`VNNI` is True only where numba compiles for a CPU that has the instruction: the host's own
features, and no NUMBA_CPU_NAME / NUMBA_CPU_FEATURES override (a cache built for another CPU
must not hold it). numba keys its disk cache by the target CPU and its features, so a kernel
compiled here with the intrinsic is never loaded on a machine without it.
"""
from __future__ import annotations

from llvmlite import binding, ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic


def target_has(*features: str) -> bool:
    """Whether numba compiles for a CPU with all these features (LLVM's names): the host's own,
    unless NUMBA_CPU_NAME / NUMBA_CPU_FEATURES name another target, where nothing is assumed
    (LLVM aborts the process on an instruction its target lacks)."""
    if config.CPU_NAME not in (None, "host") or config.CPU_FEATURES is not None:
        return False
    try:
        host = binding.get_host_cpu_features()
    except RuntimeError:  # llvmlite cannot read them on this platform
        return False
    return all(host.get(f, False) for f in features)


VNNI = target_has("avx512f", "avx512vnni")
LANES = 16  # output columns per instruction (512-bit registers of int32)
PANEL = 64  # output columns per panel: four registers, whose chains of fmas run side by side
VECTORS = PANEL // LANES
# Each word row asks for the row 2 KiB ahead: a panel's rows from memory took longer than its
# arithmetic plus the read (1536 x 576, 30 us against 8.6 in cache); with it 21-26 us on one thread.
PREFETCH_BYTES = 2048

_I32, _F32 = ir.IntType(32), ir.FloatType()
_BYTES = ir.IntType(8).as_pointer()
_V16, _V16F = ir.VectorType(_I32, LANES), ir.VectorType(_F32, LANES)


def _splat(builder, x, vector=_V16):
    """x in every lane of a `vector`."""
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined), ir.Constant(_V16, [0] * LANES))


def prefetch_ahead(builder, at, offset: int = 0) -> None:
    """Ask for the cache line PREFETCH_BYTES + offset bytes past pointer `at` (read, kept in
    every cache level). A prefetch never faults, past an array's end included."""
    fn = cgutils.get_or_insert_function(  # (address, read, locality, data)
        builder.module, ir.FunctionType(ir.VoidType(), [_BYTES, _I32, _I32, _I32]), "llvm.prefetch.p0i8")
    ahead = builder.gep(builder.bitcast(at, _BYTES), [ir.Constant(cgutils.intp_t, PREFETCH_BYTES + offset)])
    builder.call(fn, [ahead, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


# The IR constants every kernel here uses: the low nibble of each byte, a shift by 4, and the
# loop bounds and column offsets of a panel (zero, one, one offset per register).
_LOW_NIBBLES, _FOUR = ir.Constant(_V16, [0x0F0F0F0F] * LANES), ir.Constant(_V16, [4] * LANES)
_INDICES = (ir.Constant(cgutils.intp_t, 0), ir.Constant(cgutils.intp_t, 1),
            [ir.Constant(cgutils.intp_t, LANES * g) for g in range(VECTORS)])


def _arrays(context, builder, sig, args, which: tuple[int, ...]) -> list:
    """The intrinsic's array arguments at positions `which`, as numba's array structures."""
    return [context.make_array(sig.args[k])(context, builder, args[k]) for k in which]


def _vpdpbusd(builder):
    """vpdpbusd (acc, four unsigned bytes, four signed bytes) -> acc + their four products, per int32 lane."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16] * 3),
                                          "llvm.x86.avx512.vpdpbusd.512")


def _fma(builder, a, b, c):
    """a * b + c per float32 lane, rounded once (llvmlite's builder.fma takes scalars only)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _vector_at(context, builder, array_type, array, indices):
    at = cgutils.get_item_pointer(context, builder, array_type, array, indices, wraparound=False)
    return builder.bitcast(at, ir.VectorType(context.get_value_type(array_type.dtype), LANES).as_pointer())


def _item(context, builder, array_type, array, indices):
    return builder.load(cgutils.get_item_pointer(context, builder, array_type, array, indices, wraparound=False))


@intrinsic
def panel_chain(typingctx, words, xbytes, shifts, scales, per_block, p, v, i):
    """v[i, :] = XNNPACK's qb4w chain over every block for panel p's PANEL outputs:
    v = fma(float(block sum) - shifts[b], scales[p, b, :], v) block after block, v starting as
    given. words uint32 [P, K/8, PANEL]: input 8r + t of word row r in bits 4t..4t+3 (the stored
    values 0..15); xbytes int32 [K/8, 2]: row r's even inputs' bytes q + 128 in [r, 0] (input 8r
    in the low byte), its odd inputs' in [r, 1]; shifts float32 [blocks]: 8 * the block's sum of
    q + 128 (the stored values' +8); scales float32 [P, blocks, PANEL]; v float32 [*, PANEL]."""
    def codegen(context, builder, sig, args):
        words_t, x_t, shifts_t, scales_t, _, _, v_t, _ = sig.args
        w_arr, x_arr, sh_arr, sc_arr, v_arr = _arrays(context, builder, sig, args, (0, 1, 2, 3, 6))
        per, p, i = args[4], args[5], args[7]
        dot, (zero, one, columns) = _vpdpbusd(builder), _INDICES
        v_at = [_vector_at(context, builder, v_t, v_arr, [i, c]) for c in columns]
        vs = [cgutils.alloca_once_value(builder, builder.load(at, align=4)) for at in v_at]
        accs = [cgutils.alloca_once(builder, _V16) for _ in columns]
        with cgutils.for_range_slice(builder, zero, builder.extract_value(sh_arr.shape, 0), one) as (b, _):
            for acc in accs:
                builder.store(ir.Constant(_V16, None), acc)
            r0 = builder.mul(b, per)
            with cgutils.for_range_slice(builder, r0, builder.add(r0, per), one) as (r, _):
                even = _splat(builder, _item(context, builder, x_t, x_arr, [r, zero]))
                odd = _splat(builder, _item(context, builder, x_t, x_arr, [r, one]))
                for c, acc in zip(columns, accs):
                    at = _vector_at(context, builder, words_t, w_arr, [p, r, c])
                    prefetch_ahead(builder, at)
                    w = builder.load(at, align=4)
                    # byte t of a word holds inputs 2t (low nibble) and 2t + 1 (high); vpdpbusd's
                    # first factor is unsigned (q + 128), its second signed (0..15 either way)
                    total = builder.call(dot, [builder.load(acc), even, builder.and_(w, _LOW_NIBBLES)])
                    total = builder.call(dot, [total, odd, builder.and_(builder.lshr(w, _FOUR), _LOW_NIBBLES)])
                    builder.store(total, acc)
            shift = _splat(builder, _item(context, builder, shifts_t, sh_arr, [b]), _V16F)
            for c, acc, v in zip(columns, accs, vs):
                sums = builder.fsub(builder.sitofp(builder.load(acc), _V16F), shift)  # exact: below 2**24
                scale = builder.load(_vector_at(context, builder, scales_t, sc_arr, [p, b, c]), align=4)
                builder.store(_fma(builder, sums, scale, builder.load(v)), v)
        for at, v in zip(v_at, vs):
            builder.store(builder.load(v), at, align=4)
        return context.get_dummy_value()
    return types.void(words, xbytes, shifts, scales, per_block, p, v, i), codegen


ROWS = 4  # rows of a prompt per panel_chain_rows: one unpacking of a word row feeds four rows' sums


@intrinsic
def panel_chain_rows(typingctx, words, xbytes, shifts, scales, per_block, p, v, r0):
    """panel_chain for ROWS rows r0.. of a prompt at once: v[r0 + m, :] = the chain of row r0 + m
    over every block for panel p's PANEL outputs, each word row's nibbles unpacked once for all
    of them. xbytes int32 [M, K/8, 2] and shifts float32 [M, blocks] hold each row's panel_chain
    operands; v float32 [M, PANEL] the chains, starting as given. Per row and output the
    operations are panel_chain's, in its order: the same bits."""
    def codegen(context, builder, sig, args):
        words_t, x_t, shifts_t, scales_t, _, _, v_t, _ = sig.args
        w_arr, x_arr, sh_arr, sc_arr, v_arr = _arrays(context, builder, sig, args, (0, 1, 2, 3, 6))
        per, p, r0 = args[4], args[5], args[7]
        dot, (zero, one, columns) = _vpdpbusd(builder), _INDICES
        rows = [builder.add(r0, ir.Constant(cgutils.intp_t, m)) for m in range(ROWS)]
        accs = [[cgutils.alloca_once(builder, _V16) for _ in columns] for _ in rows]
        with cgutils.for_range_slice(builder, zero, builder.extract_value(sc_arr.shape, 1), one) as (b, _):
            for row_accs in accs:
                for acc in row_accs:
                    builder.store(ir.Constant(_V16, None), acc)
            start = builder.mul(b, per)
            with cgutils.for_range_slice(builder, start, builder.add(start, per), one) as (r, _):
                even = [_splat(builder, _item(context, builder, x_t, x_arr, [row, r, zero])) for row in rows]
                odd = [_splat(builder, _item(context, builder, x_t, x_arr, [row, r, one])) for row in rows]
                for g, c in enumerate(columns):
                    at = _vector_at(context, builder, words_t, w_arr, [p, r, c])
                    prefetch_ahead(builder, at)
                    w = builder.load(at, align=4)
                    low, high = builder.and_(w, _LOW_NIBBLES), builder.and_(builder.lshr(w, _FOUR), _LOW_NIBBLES)
                    for m in range(ROWS):
                        total = builder.call(dot, [builder.load(accs[m][g]), even[m], low])
                        builder.store(builder.call(dot, [total, odd[m], high]), accs[m][g])
            for m, row in enumerate(rows):
                shift = _splat(builder, _item(context, builder, shifts_t, sh_arr, [row, b]), _V16F)
                for g, c in enumerate(columns):
                    sums = builder.fsub(builder.sitofp(builder.load(accs[m][g]), _V16F), shift)  # exact: below 2**24
                    scale = builder.load(_vector_at(context, builder, scales_t, sc_arr, [p, b, c]), align=4)
                    v_at = _vector_at(context, builder, v_t, v_arr, [row, c])
                    builder.store(_fma(builder, sums, scale, builder.load(v_at, align=4)), v_at, align=4)
        return context.get_dummy_value()
    return types.void(words, xbytes, shifts, scales, per_block, p, v, r0), codegen


def _panel_sums(context, builder, words_t, w_arr, x_t, x_arr, p, row_ids):
    """The int32 sums of one panel for the rows `row_ids`: per row a list of VECTORS allocas,
    acc = sum over word rows r of vpdpbusd(xquads[row, r], words[p, r, :])."""
    dot, (zero, one, columns) = _vpdpbusd(builder), _INDICES
    accs = [[cgutils.alloca_once_value(builder, ir.Constant(_V16, None)) for _ in columns] for _ in row_ids]
    with cgutils.for_range_slice(builder, zero, builder.extract_value(w_arr.shape, 1), one) as (r, _):
        quads = [_splat(builder, _item(context, builder, x_t, x_arr, [row, r])) for row in row_ids]
        for g, c in enumerate(columns):
            at = _vector_at(context, builder, words_t, w_arr, [p, r, c])
            prefetch_ahead(builder, at)
            w = builder.load(at, align=4)
            for m in range(len(row_ids)):
                builder.store(builder.call(dot, [builder.load(accs[m][g]), quads[m], w]), accs[m][g])
    return accs


def _channel_panel(rows: int):
    """An intrinsic summing int8 products for `rows` rows of a prompt against one panel:
    acc[r0 + m, :] = sum over word rows r of vpdpbusd(xquads[r0 + m, r], words[p, r, :]), where
    each int32 of words [P, K/4, PANEL] holds four consecutive inputs' signed weights of one output
    (input 4r + t in byte t) and xquads int32 [M, K/4] the row's four activations q + 128 likewise;
    acc int32 [M, PANEL]. Exact: every partial sum is an int32 (K * 255 * 128 below 2**31)."""
    @intrinsic
    def channel_panel(typingctx, words, xquads, p, acc, r0):
        def codegen(context, builder, sig, args):
            words_t, x_t, _, acc_t, _ = sig.args
            w_arr, x_arr, acc_arr = _arrays(context, builder, sig, args, (0, 1, 3))
            p, r0 = args[2], args[4]
            row_ids = [builder.add(r0, ir.Constant(cgutils.intp_t, m)) for m in range(rows)]
            accs = _panel_sums(context, builder, words_t, w_arr, x_t, x_arr, p, row_ids)
            for m, row in enumerate(row_ids):
                for g, c in enumerate(_INDICES[2]):
                    builder.store(builder.load(accs[m][g]), _vector_at(context, builder, acc_t, acc_arr, [row, c]), align=4)
            return context.get_dummy_value()
        return types.void(words, xquads, p, acc, r0), codegen
    return channel_panel


def _channel_panel_scaled(rows: int):
    """`_channel_panel`'s sums for `rows` rows, scaled in registers straight into out float32 [M, N]
    at columns p * PANEL.. (a whole panel: the caller keeps the last, partial one for the other
    path): out = fma(float32(acc - zr * wsum) * x_scale, w_scale, bias), xnnpack_gemm_jit.scale_sums'
    steps, so the same bits. zr int32 [M] (zero point + 128), x_scale float32 [M]; wsum int32,
    w_scale and bias float32, one per output. acc - zr * wsum wraps in int32 to the exact
    sum of (q - zp) * w, which fits (K * 255 * 128 below 2**31)."""
    @intrinsic
    def channel_panel_scaled(typingctx, words, xquads, p, r0, zr, x_scale, wsum, w_scale, bias, out):
        def codegen(context, builder, sig, args):
            words_t, x_t, _, _, zr_t, xs_t, wsum_t, ws_t, bias_t, out_t = sig.args
            w_arr, x_arr, zr_arr, xs_arr, wsum_arr, ws_arr, bias_arr, out_arr = _arrays(
                context, builder, sig, args, (0, 1, 4, 5, 6, 7, 8, 9))
            p, r0 = args[2], args[3]
            row_ids = [builder.add(r0, ir.Constant(cgutils.intp_t, m)) for m in range(rows)]
            accs = _panel_sums(context, builder, words_t, w_arr, x_t, x_arr, p, row_ids)
            c0 = builder.mul(p, ir.Constant(cgutils.intp_t, PANEL))
            for g, c in enumerate(_INDICES[2]):
                col = builder.add(c0, c)
                wsum_v = builder.load(_vector_at(context, builder, wsum_t, wsum_arr, [col]), align=4)
                ws_v = builder.load(_vector_at(context, builder, ws_t, ws_arr, [col]), align=4)
                bias_v = builder.load(_vector_at(context, builder, bias_t, bias_arr, [col]), align=4)
                for m, row in enumerate(row_ids):
                    zr_v = _splat(builder, _item(context, builder, zr_t, zr_arr, [row]))
                    xs_v = _splat(builder, _item(context, builder, xs_t, xs_arr, [row]), _V16F)
                    sums = builder.sub(builder.load(accs[m][g]), builder.mul(zr_v, wsum_v))
                    value = _fma(builder, builder.fmul(builder.sitofp(sums, _V16F), xs_v), ws_v, bias_v)
                    builder.store(value, _vector_at(context, builder, out_t, out_arr, [row, col]), align=4)
            return context.get_dummy_value()
        return types.void(words, xquads, p, r0, zr, x_scale, wsum, w_scale, bias, out), codegen
    return channel_panel_scaled


channel_panel_rows = _channel_panel(ROWS)  # four rows of a prompt
channel_panel_row = _channel_panel(1)  # the rows left over
channel_panel_rows_scaled = _channel_panel_scaled(ROWS)
channel_panel_row_scaled = _channel_panel_scaled(1)
