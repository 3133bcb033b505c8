"""x86 integer dot products written with LLVM intrinsics (numba.extending.intrinsic).

Shapes: P codes per plane (bytes of a group), n = 8 / bits planes, NB = P // 32 blocks of 32 bytes.

avx2_dot(bits)(packed, b0, xq, x0, plane, nblocks) -> int32, exactly
    sum over blocks i < NB, bytes k < 32, planes j < n of code_j(packed[b0 + 32 i + k]) * xq[x0 + j * plane + 32 i + k]
with packed a flat uint8 array (planar codes, edgemoe.quant.formats) and xq a flat int8 array; the
caller adds the bytes past the last whole block. Offsets are uint64 and never bounds-checked: the
caller guarantees them (edgemoe/kernels/cpu_int.py).

INT2 and INT4: vpmaddubsw (u8 code x s8 activation, adjacent pairs summed to int16), then vpmaddwd
with ones (pairs of int16 summed to int32). vpmaddubsw saturates at +-32767, which codes up to 15
cannot reach: a pair is at most 2 * 15 * 127 = 3810, and the planes of one block are added in int16
before widening (INT4: 2 * 3810, INT2: 4 * 2 * 3 * 127 = 3048), far from the limit. INT8 codes (up to
255) could saturate vpmaddubsw (2 * 255 * 127 = 64770), so INT8 takes another route, exact with no
trick: codes zero-extended and activations sign-extended to int16 (vpmovzxbw, vpmovsxbw), then
vpmaddwd (int16 x int16, pairs summed to int32; a pair is at most 64770). The int32 accumulators
cannot overflow for the group sizes edgemoe/kernels/ops.py admits (|sum| <= 255 * 127 * G < 2^31).

vnni_dot(bits): the same sum over 64-byte blocks (NB = P // 64) with AVX-512 VNNI's vpdpbusd (u8
code x s8 activation, four adjacent products added into each int32 lane, no saturation: exact at
every width, INT8 included), one accumulator per plane.

They run on CPUs with their feature only: edgemoe/kernels/cpu_int.py calls them on the "avx2" and
"avx512vnni" paths, which edgemoe/kernels/ops.py offers only when numba compiles for such a CPU.
For any other target (aarch64, old x86) they compile to a RuntimeError, so that the kernels holding
them still compile for the portable path.
"""

from __future__ import annotations

from functools import partial

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._jit import target_has

I8, I16, I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
BLOCK = 32  # bytes per 256-bit vector
VNNI_BLOCK = 64  # bytes per 512-bit vector


def _vec(t, n):
    return ir.VectorType(t, n)


def _splat(t, n, value):
    return ir.Constant(_vec(t, n), [value] * n)


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _load(builder, base, offset, vtype):
    """Unaligned vector load of vtype from byte pointer base + offset."""
    ptr = builder.bitcast(builder.gep(base, [offset]), vtype.as_pointer())
    return builder.load(ptr, align=1)


def _hsum(builder, v):
    total = builder.extract_element(v, ir.Constant(I32, 0))
    for i in range(1, v.type.count):
        total = builder.add(total, builder.extract_element(v, ir.Constant(I32, i)))
    return total


def _small_codes(builder, bits, pbase, poff):
    """The codes of each of the 8 / bits planes of one 32-byte block at 2 or 4 bits."""
    raw = _load(builder, pbase, poff, _vec(I8, 32))
    mask = _splat(I8, 32, (1 << bits) - 1)
    return [builder.and_(builder.lshr(raw, _splat(I8, 32, j * bits)) if j else raw, mask) for j in range(8 // bits)]


def _small_products(builder, codes, xbase, xoff, plane):
    """int32x8 partial sums of a 2- or 4-bit block's plane codes against the activations at xoff
    (vpmaddubsw, then vpmaddwd by ones)."""
    pairs = None
    for j, plane_codes in enumerate(codes):
        xoff_j = builder.add(xoff, builder.mul(plane, ir.Constant(plane.type, j)))
        x = _load(builder, xbase, xoff_j, _vec(I8, 32))
        p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(I16, 16), [plane_codes, x])
        pairs = p if pairs is None else builder.add(pairs, p)
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _vec(I32, 8), [pairs, _splat(I16, 16, 1)])


def _block_small(builder, bits, pbase, xbase, poff, xoff, plane):
    """int32x8 partial sums of one 32-byte block at 2 or 4 bits."""
    return _small_products(builder, _small_codes(builder, bits, pbase, poff), xbase, xoff, plane)


def _int8_codes(builder, pbase, poff):
    """One 32-byte INT8 block's codes as two int16x16 halves."""
    return [builder.zext(_load(builder, pbase, builder.add(poff, ir.Constant(poff.type, 16 * half)), _vec(I8, 16)),
                         _vec(I16, 16)) for half in range(2)]


def _int8_products(builder, codes, xbase, xoff):
    """int32x8 partial sums of an INT8 block's halves against the activations at xoff (vpmaddwd)."""
    total = None
    for half, half_codes in enumerate(codes):
        x = builder.sext(_load(builder, xbase, builder.add(xoff, ir.Constant(xoff.type, 16 * half)), _vec(I8, 16)),
                         _vec(I16, 16))
        p = _call(builder, "llvm.x86.avx2.pmadd.wd", _vec(I32, 8), [half_codes, x])
        total = p if total is None else builder.add(total, p)
    return total


def _block_int8(builder, pbase, xbase, poff, xoff):
    """int32x8 partial sums of one 32-byte block at 8 bits: two halves widened to int16, vpmaddwd."""
    return _int8_products(builder, _int8_codes(builder, pbase, poff), xbase, xoff)


def _dot_intrinsic(feature: str, body):
    """An intrinsic (packed, b0, xq, x0, plane, nblocks) -> int32 whose code `body` writes
    (builder, packed base, xq base, b0, x0, plane, nblocks); compiled for a CPU without `feature`
    it raises instead of failing to compile."""
    @intrinsic
    def dot(typingctx, packed, b0, xq, x0, plane, nblocks):
        sig = types.int32(packed, b0, xq, x0, plane, nblocks)

        def codegen(context, builder, sig, args):
            if not target_has(feature):
                with builder.if_then(cgutils.true_bit):
                    context.call_conv.return_user_exc(builder, RuntimeError, (f"{feature} code on a CPU without it",))
                return ir.Constant(I32, 0)
            packed_a, b0_v, xq_a, x0_v, plane_v, nblocks_v = args
            pbase = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=packed_a).data
            xbase = cgutils.create_struct_proxy(sig.args[2])(context, builder, value=xq_a).data
            return body(builder, pbase, xbase, b0_v, x0_v, plane_v, nblocks_v)

        return sig, codegen

    return dot


def _avx2_sums(bits, block_int8, builder, pbase, xbase, b0, x0, plane, nblocks):
    """int32x8 partial sums of `nblocks` 32-byte blocks from packed[b0] (zero at this point of the
    code each time it runs); INT8 blocks by block_int8."""
    acc = cgutils.alloca_once_value(builder, _splat(I32, 8, 0))
    with cgutils.for_range(builder, nblocks) as loop:
        step = builder.mul(loop.index, ir.Constant(loop.index.type, BLOCK))
        poff, xoff = builder.add(b0, step), builder.add(x0, step)
        block = (block_int8(builder, pbase, xbase, poff, xoff) if bits == 8
                 else _block_small(builder, bits, pbase, xbase, poff, xoff, plane))
        builder.store(builder.add(builder.load(acc), block), acc)
    return builder.load(acc)


def _avx2_body(bits, builder, pbase, xbase, b0, x0, plane, nblocks):
    return _hsum(builder, _avx2_sums(bits, _block_int8, builder, pbase, xbase, b0, x0, plane, nblocks))


avx2_dot2, avx2_dot4, avx2_dot8 = (_dot_intrinsic("avx2", partial(_avx2_body, b)) for b in (2, 4, 8))


def _masked_load(builder, base, offset, count):
    """The first `count` (< 64) bytes from byte pointer base + offset, zeros in the other lanes of an
    int8x64 vector; the bytes past them are not read (AVX-512 BW's masked load suppresses their
    faults), so a row's last bytes may end its array."""
    vtype = _vec(I8, VNNI_BLOCK)
    limit = builder.trunc(count, I32)
    splat = builder.insert_element(ir.Constant(_vec(I32, VNNI_BLOCK), None), limit, ir.Constant(I32, 0))
    splat = builder.shuffle_vector(splat, splat, ir.Constant(_vec(I32, VNNI_BLOCK), [0] * VNNI_BLOCK))
    mask = builder.icmp_unsigned("<", ir.Constant(_vec(I32, VNNI_BLOCK), list(range(VNNI_BLOCK))), splat)
    ptr = builder.bitcast(builder.gep(base, [offset]), vtype.as_pointer())
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vtype, [ptr.type, I32, mask.type, vtype]),
                                        "llvm.masked.load.v64i8.p0")
    return builder.call(fn, [ptr, ir.Constant(I32, 1), mask, _splat(I8, VNNI_BLOCK, 0)])


def _vnni_token_sums(bits, builder, pbase, xbase, b0, x0s, plane, nblocks, tail=False):
    """int32x16 partial sums of `nblocks` 64-byte blocks from packed[b0] against each token's
    activations (xq from each offset of x0s), the planes' accumulators added (zero at this point of
    the code each time it runs); with `tail`, the plane's bytes past those blocks too, as a block
    whose missing bytes are zero codes (which add nothing). A block's codes are unpacked once for
    all the tokens; each (token, plane) has an accumulator of its own, so that the vpdpbusd (u8 code
    x s8 activation, four adjacent products summed into each int32 lane, no saturation) are
    independent (its latency would chain them)."""
    lanes = _vec(I32, VNNI_BLOCK // 4)
    nplanes = 8 // bits
    accs = [[cgutils.alloca_once_value(builder, _splat(I32, VNNI_BLOCK // 4, 0)) for _ in range(nplanes)]
            for _ in x0s]
    mask = _splat(I8, VNNI_BLOCK, (1 << bits) - 1)

    def block(step, load):
        raw = load(pbase, builder.add(b0, step))
        codes = [builder.bitcast(raw if bits == 8 else builder.and_(
            builder.lshr(raw, _splat(I8, VNNI_BLOCK, j * bits)) if j else raw, mask), lanes) for j in range(nplanes)]
        for token_accs, x0 in zip(accs, x0s):
            for j, (acc, plane_codes) in enumerate(zip(token_accs, codes)):
                xoff = builder.add(builder.add(x0, step), builder.mul(plane, ir.Constant(plane.type, j)))
                x = builder.bitcast(load(xbase, xoff), lanes)
                builder.store(_call(builder, "llvm.x86.avx512.vpdpbusd.512", lanes,
                                    [builder.load(acc), plane_codes, x]), acc)

    with cgutils.for_range(builder, nblocks) as loop:
        block(builder.mul(loop.index, ir.Constant(loop.index.type, VNNI_BLOCK)),
              lambda base, offset: _load(builder, base, offset, _vec(I8, VNNI_BLOCK)))
    if tail:
        done = builder.mul(nblocks, ir.Constant(nblocks.type, VNNI_BLOCK))
        rest = builder.sub(plane, done)
        with builder.if_then(builder.icmp_unsigned(">", rest, ir.Constant(rest.type, 0))):
            block(done, lambda base, offset: _masked_load(builder, base, offset, rest))
    totals = []
    for token_accs in accs:
        total = builder.load(token_accs[0])
        for acc in token_accs[1:]:
            total = builder.add(total, builder.load(acc))
        totals.append(total)
    return totals


def _vnni_sums(bits, builder, pbase, xbase, b0, x0, plane, nblocks):
    """int32x16 partial sums of `nblocks` 64-byte blocks from packed[b0] for one token."""
    return _vnni_token_sums(bits, builder, pbase, xbase, b0, [x0], plane, nblocks)[0]


def _avx2_token_sums(bits, builder, pbase, xbase, b0, x0s, plane, nblocks):
    """int32x8 partial sums of `nblocks` 32-byte blocks from packed[b0] against each token's
    activations (xq from each offset of x0s), a block's codes unpacked once for all the tokens."""
    accs = [cgutils.alloca_once_value(builder, _splat(I32, 8, 0)) for _ in x0s]
    with cgutils.for_range(builder, nblocks) as loop:
        step = builder.mul(loop.index, ir.Constant(loop.index.type, BLOCK))
        poff = builder.add(b0, step)
        codes = _int8_codes(builder, pbase, poff) if bits == 8 else _small_codes(builder, bits, pbase, poff)
        for acc, x0 in zip(accs, x0s):
            xoff = builder.add(x0, step)
            block = (_int8_products(builder, codes, xbase, xoff) if bits == 8
                     else _small_products(builder, codes, xbase, xoff, plane))
            builder.store(builder.add(builder.load(acc), block), acc)
    return [builder.load(acc) for acc in accs]


def _vnni_body(bits, builder, pbase, xbase, b0, x0, plane, nblocks):
    return _call(builder, "llvm.vector.reduce.add.v16i32", I32,
                 [_vnni_sums(bits, builder, pbase, xbase, b0, x0, plane, nblocks)])


vnni_dot2, vnni_dot4, vnni_dot8 = (_dot_intrinsic("avx512vnni", partial(_vnni_body, b)) for b in (2, 4, 8))


# Grouped rows: one call per (block of rows, token) instead of one per group. The products of each group are
# kept as eight int32 lanes, lane l holding the bytes k of the group's planes with (k mod 32) // 4 == l
# (what vpmaddwd-by-ones makes of a 32-byte block, and vpdpbusd's 16 lanes folded in half), so that
# no horizontal sum is paid per group. See edgemoe/kernels/cpu_int.py for the float rule they feed.
LANES = 8
F32 = ir.FloatType()


def _fold(builder, v):
    """int32x16 -> int32x8: lanes l and l + 8 added (bytes 4l..4l+3 and 32+4l..32+4l+3 of a 64-byte block)."""
    lo = builder.shuffle_vector(v, v, ir.Constant(_vec(I32, LANES), list(range(LANES))))
    hi = builder.shuffle_vector(v, v, ir.Constant(_vec(I32, LANES), list(range(LANES, 2 * LANES))))
    return builder.add(lo, hi)


def _block_int8_lanes(builder, pbase, xbase, poff, xoff):
    """_block_int8's products regrouped so that lane l holds bytes 4l..4l+3 (vpmaddwd pairs bytes
    2m, 2m+1 of each 16-byte half): the even and odd pair sums of the two halves, added."""
    halves = []
    for half in range(2):
        step = ir.Constant(poff.type, 16 * half)
        codes = builder.zext(_load(builder, pbase, builder.add(poff, step), _vec(I8, 16)), _vec(I16, 16))
        x = builder.sext(_load(builder, xbase, builder.add(xoff, step), _vec(I8, 16)), _vec(I16, 16))
        halves.append(_call(builder, "llvm.x86.avx2.pmadd.wd", _vec(I32, 8), [codes, x]))
    even = builder.shuffle_vector(halves[0], halves[1], ir.Constant(_vec(I32, LANES), [0, 2, 4, 6, 8, 10, 12, 14]))
    odd = builder.shuffle_vector(halves[0], halves[1], ir.Constant(_vec(I32, LANES), [1, 3, 5, 7, 9, 11, 13, 15]))
    return builder.add(even, odd)


def _group_lanes_avx2(bits, builder, pbase, xbase, poff, xoff, plane):
    """int32x8 lanes of one group whose plane bytes (a multiple of 32) start at poff."""
    blocks = builder.udiv(plane, ir.Constant(plane.type, BLOCK))
    return _avx2_sums(bits, _block_int8_lanes, builder, pbase, xbase, poff, xoff, plane, blocks)


def _group_lanes_vnni(bits, builder, pbase, xbase, poff, xoff, plane):
    """int32x8 lanes of one group whose plane bytes (a multiple of 64) start at poff."""
    blocks = builder.udiv(plane, ir.Constant(plane.type, VNNI_BLOCK))
    return _fold(builder, _vnni_sums(bits, builder, pbase, xbase, poff, xoff, plane, blocks))


def _row_lanes_body(group_lanes, builder, pbase, xbase, sbase, xsbase, b0, x0, plane, ngroups, group):
    """The lane rule (edgemoe/kernels/cpu_int.py) for one row and token: with s[g] = scale[g] * xs[g],
    the first sum: over lanes l in order of (over groups g in order of float32(lanes[g, l]) * s[g])."""
    acc = cgutils.alloca_once_value(builder, _splat(F32, LANES, 0.0))
    with cgutils.for_range(builder, ngroups) as loop:
        g = loop.index
        lanes = group_lanes(builder, pbase, xbase, builder.add(b0, builder.mul(g, plane)),
                            builder.add(x0, builder.mul(g, group)), plane)
        s = builder.fmul(builder.load(builder.gep(sbase, [g])), builder.load(builder.gep(xsbase, [g])))
        splat = builder.insert_element(ir.Constant(_vec(F32, LANES), None), s, ir.Constant(I32, 0))
        splat = builder.shuffle_vector(splat, splat, ir.Constant(_vec(I32, LANES), [0] * LANES))
        term = builder.fmul(builder.sitofp(lanes, _vec(F32, LANES)), splat)
        builder.store(builder.fadd(builder.load(acc), term), acc)
    v = builder.load(acc)
    total = builder.extract_element(v, ir.Constant(I32, 0))
    for i in range(1, LANES):
        total = builder.fadd(total, builder.extract_element(v, ir.Constant(I32, i)))
    return total


def _rows_lanes_body(group_lanes, builder, pbase, xbase, sbase, xsbase, obase, b0, x0, plane, ngroups, group,
                     s0, nrows):
    """_row_lanes_body for `nrows` consecutive rows: row i's bytes from packed[b0 + i * ngroups * plane],
    its scales from scale[s0 + i * ngroups]; its first sum stored to out[i]."""
    row_bytes = builder.mul(ngroups, plane)
    with cgutils.for_range(builder, nrows) as loop:
        i = loop.index
        row_scale = builder.gep(sbase, [builder.add(s0, builder.mul(i, ngroups))])
        total = _row_lanes_body(group_lanes, builder, pbase, xbase, row_scale, xsbase,
                                builder.add(b0, builder.mul(i, row_bytes)), x0, plane, ngroups, group)
        builder.store(total, builder.gep(obase, [i]))


def _rows_intrinsic(feature: str, group_lanes):
    """An intrinsic (packed, b0, xq, x0, plane, ngroups, group, scale, s0, xs, nrows, out) -> None:
    _rows_lanes_body, for one token, over `nrows` rows of `ngroups` groups of `plane` bytes from
    packed[b0] and of `group` activations from xq[x0]; scale float32 flat (row i's from s0 + i * ngroups),
    xs float32 [NG] the token's, out float32 [nrows]. A call per block of rows, not per row: a numba
    loop that called a row intrinsic per row, branching between the paths' intrinsics each time, took
    2.5x as long (tools/bench_grouped_rows.py: 1024 x 1024 INT4 in groups of 128, AVX2, one thread, hot,
    136 us against 54; docs/benchmarks.md)."""
    @intrinsic
    def rows(typingctx, packed, b0, xq, x0, plane, ngroups, group, scale, s0, xs, nrows, out):
        sig = types.none(packed, b0, xq, x0, plane, ngroups, group, scale, s0, xs, nrows, out)

        def codegen(context, builder, sig, args):
            if target_has(feature):
                packed_a, b0_v, xq_a, x0_v, plane_v, ng_v, group_v, scale_a, s0_v, xs_a, nrows_v, out_a = args

                def data(i, value):
                    return cgutils.create_struct_proxy(sig.args[i])(context, builder, value=value).data
                _rows_lanes_body(group_lanes, builder, data(0, packed_a), data(2, xq_a), data(7, scale_a),
                                 data(9, xs_a), data(11, out_a), b0_v, x0_v, plane_v, ng_v, group_v, s0_v, nrows_v)
            else:
                with builder.if_then(cgutils.true_bit):
                    context.call_conv.return_user_exc(builder, RuntimeError, (f"{feature} code on a CPU without it",))
            return context.get_dummy_value()

        return sig, codegen

    return rows


avx2_rows2, avx2_rows4, avx2_rows8 = (_rows_intrinsic("avx2", partial(_group_lanes_avx2, b)) for b in (2, 4, 8))
vnni_rows4, vnni_rows8 = (_rows_intrinsic("avx512vnni", partial(_group_lanes_vnni, b)) for b in (4, 8))


# Ungrouped rows in batches: the isums of up to W consecutive rows (W = a vector's int32 lanes: 16
# on VNNI, 8 on AVX2) for one token, or for TOKEN_TILE tokens at once. Each row's products stay a
# vector until the batch is done; one transposed tree of shuffles and adds a token then turns the W
# vectors into the W rows' sums, 15 shuffle pairs for 16 rows instead of a horizontal sum per row
# (small rows, as fine-grained experts have, paid it per 3-8 blocks). With several tokens a block's
# codes are loaded and unpacked once for all of them (a prompt's tokens share every weight). Integer
# sums are exact, so the isums are the per-row intrinsics' to the bit.

TOKEN_TILE = 4   # tokens a tiled call: 8 VNNI accumulators at INT4 (two planes), within the 32 registers


def _transposed_sums(builder, vectors):
    """W int32xW vectors -> one int32xW vector whose lane r is the sum of vectors[r]'s lanes."""
    width = len(vectors)
    half = width // 2
    while len(vectors) > 1:
        first, second = [], []
        for offset in (0, width):
            for chunk in range(0, width, 2 * half):
                first += [offset + chunk + i for i in range(half)]
                second += [offset + chunk + half + i for i in range(half)]
        mask_a, mask_b = (ir.Constant(_vec(I32, width), m) for m in (first, second))
        vectors = [builder.add(builder.shuffle_vector(a, b, mask_a), builder.shuffle_vector(a, b, mask_b))
                   for a, b in zip(vectors[0::2], vectors[1::2])]
        half //= 2
    return vectors[0]


def _isums_body(width, tokens, token_sums, builder, pbase, xbase, obase, b0, x0, xstride, plane, nblocks, nrows):
    """Stores the isums of `nrows` <= width ungrouped rows (row i's `plane` bytes from packed[b0 + i *
    plane], nblocks whole blocks) for `tokens` tokens (token t's activations from xq[x0 + t * xstride])
    into out[t * width : (t + 1) * width], zero past nrows.
    The row count is a runtime value: a constant one let LLVM unroll the rows, doubling compile time."""
    vtype = _vec(I32, width)
    rows = cgutils.alloca_once(builder, ir.ArrayType(vtype, width * tokens))
    slots = [[builder.gep(rows, [ir.Constant(I32, 0), ir.Constant(I32, t * width + i)]) for i in range(width)]
             for t in range(tokens)]
    for token_slots in slots:
        for slot in token_slots:
            builder.store(_splat(I32, width, 0), slot)
    x0s = [builder.add(x0, builder.mul(xstride, ir.Constant(xstride.type, t))) for t in range(tokens)]
    with cgutils.for_range(builder, nrows) as loop:
        start = builder.add(b0, builder.mul(loop.index, plane))
        sums = token_sums(builder, pbase, xbase, start, x0s, plane, nblocks)
        for t, total in enumerate(sums):
            index = builder.add(builder.trunc(loop.index, I32), ir.Constant(I32, t * width))
            builder.store(total, builder.gep(rows, [ir.Constant(I32, 0), index]))
    for t, token_slots in enumerate(slots):
        target = builder.bitcast(builder.gep(obase, [ir.Constant(I32, t * width)]), vtype.as_pointer())
        builder.store(_transposed_sums(builder, [builder.load(slot) for slot in token_slots]), target, align=1)


def _isums_intrinsic(feature: str, width: int, tokens: int, token_sums):
    """An intrinsic (packed, b0, xq, x0, xstride, plane, nblocks, nrows, out) -> None: _isums_body, out
    an int32 array of at least tokens * width elements. Compiled for a CPU without `feature` it
    raises, as _dot_intrinsic's."""
    @intrinsic
    def isums(typingctx, packed, b0, xq, x0, xstride, plane, nblocks, nrows, out):
        sig = types.none(packed, b0, xq, x0, xstride, plane, nblocks, nrows, out)

        def codegen(context, builder, sig, args):
            if target_has(feature):
                packed_a, b0_v, xq_a, x0_v, xstride_v, plane_v, nb_v, nrows_v, out_a = args

                def data(i, value):
                    return cgutils.create_struct_proxy(sig.args[i])(context, builder, value=value).data
                _isums_body(width, tokens, token_sums, builder, data(0, packed_a), data(2, xq_a), data(8, out_a),
                            b0_v, x0_v, xstride_v, plane_v, nb_v, nrows_v)
            else:
                with builder.if_then(cgutils.true_bit):
                    context.call_conv.return_user_exc(builder, RuntimeError, (f"{feature} code on a CPU without it",))
            return context.get_dummy_value()

        return sig, codegen

    return isums


AVX2_ROWS, VNNI_ROWS = BLOCK // 4, VNNI_BLOCK // 4   # rows a batch: a vector's int32 lanes
avx2_isums2, avx2_isums4, avx2_isums8 = (
    _isums_intrinsic("avx2", AVX2_ROWS, 1, partial(_avx2_token_sums, b)) for b in (2, 4, 8))
vnni_isums4, vnni_isums8 = (
    _isums_intrinsic("avx512vnni", VNNI_ROWS, 1, partial(_vnni_token_sums, b, tail=True)) for b in (4, 8))
avx2_tile_isums2, avx2_tile_isums4, avx2_tile_isums8 = (
    _isums_intrinsic("avx2", AVX2_ROWS, TOKEN_TILE, partial(_avx2_token_sums, b)) for b in (2, 4, 8))
vnni_tile_isums4, vnni_tile_isums8 = (
    _isums_intrinsic("avx512vnni", VNNI_ROWS, TOKEN_TILE, partial(_vnni_token_sums, b, tail=True)) for b in (4, 8))
