"""Triton matmul of activations with the packed weights of `PackedIntLinear`: y = x Ŵᵀ + b.

Reads the layer's own layout (optkit/kernels/packed_int.py): q - qmin in 2- or 4-bit fields of int32
words along the input dimension (column 8w + j of a 4-bit row at bits 4j of word w), or int8 for
5..8 bits (read as int32 words of four bytes); scale and zero point per (row, group).

Dequantization in registers: a field u becomes float32 2^23 + u by OR-ing in the exponent bits of
2^23 (no int-to-float conversion), and Ŵ = ((2^23 + u) - (2^23 + qoffset + z)) · s, the exact float32
value of the reference's (q - z) · s.
- M = 1 (decode): a GEMV on the CUDA cores. A program owns BLOCK_N rows and a split of K; per step
  it loads [BLOCK_N, BLOCK_KW] words and, for each field position j, multiplies field j of every word
  by x at columns 8w + j (for 4 bits), so everything stays in the layout of the loaded words. A
  [BLOCK_N, BLOCK_KW] float32 accumulator is reduced once at the end. Ŵ stays float32 (not rounded
  to the activation dtype first, unlike the reference: slightly more exact, not bit-identical).
- M > 1: tl.dot of the activation tile with Ŵ cast to the activation dtype (bit-identical to the
  weight the reference multiplies), accumulating in float32 on the tensor cores.
Both split K across programs when the output alone would not fill the GPU; a small kernel then sums
the float32 partials, adds the bias and casts.

Act-order (GPTQ g_idx): when every group holds exactly group_size columns, sorting the columns by
group makes the groups contiguous. `packed_for` repacks the weight once in that order (cached on the
layer) and the kernels read x through the permutation. Other g_idx use the reference path.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from optkit.kernels.triton import _interpreter, next_pow2, num_sms  # noqa: F401 (interpreter fixes)
from optkit.weights.packing import field_bits, pack_int32, unpack_int32

MAGIC = 8388608.0  # 2^23: float32 whose low mantissa bits hold a small integer exactly


@triton.jit
def _dequantize(words, shifts, s, zf, code_ptr, WIDTH: tl.constexpr, SIGNED: tl.constexpr, CODEBOOK: tl.constexpr):
    """Fields of `words` at `shifts` (broadcast against each other) -> Ŵ float32 = (q - z) · s,
    with zf = 2^23 + qoffset + z and s broadcastable to the result; or, for a code book (NF4),
    Ŵ = code[field] · s (a gather from a 16-entry table that stays in L1)."""
    fields = (words >> shifts) & ((1 << WIDTH) - 1)
    if CODEBOOK:
        return tl.load(code_ptr + fields) * s
    if SIGNED:  # int8 storage: two's complement byte -> offset binary (u = q + 128)
        fields = fields ^ 0x80
    return ((fields | 0x4B000000).to(tl.float32, bitcast=True) - zf) * s


@triton.jit
def _group_params(scale_ptr, zero_ptr, offs, mask, zf_offset):
    """Scale and zf = 2^23 + qoffset + z (float32) at `offs` into the [N, G] scale and zero point."""
    s = tl.load(scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return s, tl.load(zero_ptr + offs, mask=mask, other=0).to(tl.float32) + zf_offset


@triton.jit
def _store_or_partial(out_ptr, part_ptr, bias_ptr, y, rows, n, M, N, stride_om, pid_k,
                      HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    mask = (rows < M)[:, None] & (n < N)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # partials [SPLIT_K, M, N] float32
        tl.store(part_ptr + (pid_k * M + rows[:, None]) * N + n[None, :], y, mask=mask)


@triton.jit
def _gemv_kernel(
    out_ptr, part_ptr, x_ptr, qw_ptr, scale_ptr, zero_ptr, perm_ptr, bias_ptr, code_ptr,
    M, N, K, stride_xm, stride_om, stride_qn, stride_sn, zf_offset,
    GROUP_SIZE: tl.constexpr, WIDTH: tl.constexpr, SIGNED: tl.constexpr, CODEBOOK: tl.constexpr,
    TILE_GROUPS: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
    SPLIT_K: tl.constexpr,
):  # fmt: skip
    PER_WORD: tl.constexpr = 32 // WIDTH
    BLOCK_K: tl.constexpr = BLOCK_KW * PER_WORD
    pid_n, pid_k, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    words = tl.arange(0, BLOCK_KW)
    acc = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        word_cols = k0 + words * PER_WORD  # the first column of each word
        w_mask = n_mask[:, None] & (word_cols < K)[None, :]
        q = tl.load(qw_ptr + n[:, None] * stride_qn + (k0 // PER_WORD + words)[None, :], mask=w_mask, other=0)
        if TILE_GROUPS:  # the whole tile lies in one group
            s, zf = _group_params(scale_ptr, zero_ptr, n * stride_sn + k0 // GROUP_SIZE, n_mask, zf_offset)
            s, zf = s[:, None], zf[:, None]
        else:  # the group of each word (a word never straddles two groups)
            offs = n[:, None] * stride_sn + (word_cols // GROUP_SIZE)[None, :]
            s, zf = _group_params(scale_ptr, zero_ptr, offs, w_mask, zf_offset)
        # field j of every word at once: all in the layout of the loaded words, no reshapes
        for j in tl.static_range(PER_WORD):
            cols = word_cols + j
            x_cols = tl.load(perm_ptr + cols, mask=cols < K, other=0) if HAS_PERM else cols
            x = tl.load(x_ptr + m * stride_xm + x_cols, mask=cols < K, other=0.0).to(tl.float32)
            acc += _dequantize(q, j * WIDTH, s, zf, code_ptr, WIDTH, SIGNED, CODEBOOK) * x[None, :]
    y = tl.sum(acc, 1)
    rows = m + tl.arange(0, 1)
    _store_or_partial(out_ptr, part_ptr, bias_ptr, y[None, :], rows, n, M, N, stride_om, pid_k, HAS_BIAS, SPLIT_K)


@triton.jit
def _mm_kernel(
    out_ptr, part_ptr, x_ptr, qw_ptr, scale_ptr, zero_ptr, perm_ptr, bias_ptr, code_ptr,
    M, N, K, stride_xm, stride_om, stride_qn, stride_sn, zf_offset,
    GROUP_SIZE: tl.constexpr, WIDTH: tl.constexpr, SIGNED: tl.constexpr, CODEBOOK: tl.constexpr,
    TILE_GROUPS: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    PER_WORD: tl.constexpr = 32 // WIDTH
    BLOCK_K: tl.constexpr = BLOCK_KW * PER_WORD
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    words = tl.arange(0, BLOCK_KW)
    shifts = (tl.arange(0, PER_WORD) * WIDTH)[None, :, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_mask = cols < K
        if HAS_PERM:
            cols = tl.load(perm_ptr + cols, mask=k_mask, other=0)
        x_mask = (rows < M)[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=x_mask, other=0.0)  # [BM, BK]
        w_mask = (k0 + words * PER_WORD < K)[:, None] & n_mask[None, :]
        q = tl.load(qw_ptr + n[None, :] * stride_qn + (k0 // PER_WORD + words)[:, None], mask=w_mask, other=0)
        if TILE_GROUPS:
            s, zf = _group_params(scale_ptr, zero_ptr, n * stride_sn + k0 // GROUP_SIZE, n_mask, zf_offset)
            s, zf = s[None, None, :], zf[None, None, :]
        else:
            offs = n[None, :] * stride_sn + ((k0 + words * PER_WORD) // GROUP_SIZE)[:, None]
            s, zf = _group_params(scale_ptr, zero_ptr, offs, w_mask, zf_offset)
            s, zf = s[:, None, :], zf[:, None, :]
        # [KW, PW, BN], reshaped so that row w·PW + j is column k0 + w·PW + j
        w = _dequantize(q[:, None, :], shifts, s, zf, code_ptr, WIDTH, SIGNED, CODEBOOK)
        w = tl.reshape(w, [BLOCK_K, BLOCK_N]).to(x.dtype)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    _store_or_partial(out_ptr, part_ptr, bias_ptr, acc, rows, n, M, N, stride_om, pid_k, HAS_BIAS, SPLIT_K)


@triton.jit
def _sum_splits_kernel(out_ptr, part_ptr, bias_ptr, M, N, stride_om,
                       HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    y = tl.zeros([BLOCK_N], tl.float32)
    for split in tl.static_range(SPLIT_K):
        y += tl.load(part_ptr + (split * M + m) * N + n, mask=n < N, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, y.to(out_ptr.dtype.element_ty), mask=n < N)


@dataclass
class PackedWeight:
    """The layer's weight as the kernels read it (the layer's own buffers unless act-order repacked it)."""

    qweight: torch.Tensor  # int32 [N, ceil(K / per_word)]
    scale: torch.Tensor  # [N, G], contiguous
    zero_point: torch.Tensor  # int8 [N, G], contiguous
    perm: torch.Tensor | None  # int32 [K]: the x column of each weight column, when act-order reordered them
    bits: int
    width: int  # field width: 2, 4 or 8 (int8 bytes)
    in_features: int
    group_size: int
    codebook: torch.Tensor | None = None  # float32 [2^bits]: Ŵ = codebook[field] · s (NF4), no zero point


def pack_layer(
    qweight, scale, zero_point, bits: int, in_features: int, g_idx=None, codebook=None
) -> PackedWeight | str:
    """The kernels' view of a PackedIntLinear's (or an NF4Linear's) buffers, or why the kernels cannot take it."""
    width, groups = field_bits(bits), scale.shape[1]
    if codebook is not None and (g_idx is not None or width != 4):
        return "a code book over 4-bit fields in contiguous groups only"
    if in_features % groups:
        return f"{in_features} columns in {groups} groups"
    group_size, per_word = in_features // groups, 32 // width
    if group_size % per_word:
        return f"group size {group_size} splits a {width}-bit word"
    perm = None
    if g_idx is not None:
        g = g_idx.long()
        counts = torch.bincount(g.clamp(0, groups - 1), minlength=groups)
        if g.min() < 0 or g.max() >= groups or not bool((counts == group_size).all()):
            return "g_idx groups are not all group_size columns"
        order = torch.argsort(g, stable=True)
        if not torch.equal(order, torch.arange(in_features, device=g.device)):
            perm = order.to(torch.int32)
    aligned = width != 8 or (in_features % 4 == 0 and qweight.is_contiguous() and qweight.data_ptr() % 4 == 0)
    if perm is not None or not aligned:  # repack: columns in sorted-group order, int8 rows padded to whole words
        q = _signed_int_weight(qweight, bits, in_features)
        q = q if perm is None else q[:, perm.long()]
        if width == 8:
            q = torch.nn.functional.pad(q.to(torch.int8), (0, -in_features % 4))
            qweight = q.contiguous().view(torch.int32)
        else:
            qweight = pack_int32(q.to(torch.int64) + (1 << (bits - 1)), width)
    elif width == 8:
        qweight = qweight.view(torch.int32)  # the layer's own int8 storage, four columns a word
    return PackedWeight(
        qweight.contiguous(), scale.contiguous(), zero_point.to(torch.int8).contiguous(), perm, bits, width,
        in_features, group_size, None if codebook is None else codebook.float().contiguous(),
    )  # fmt: skip


def _signed_int_weight(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    width = field_bits(bits)
    return qweight if width == 8 else unpack_int32(qweight, width, in_features) - (1 << (bits - 1))


def packed_for(layer) -> PackedWeight | None:
    """`pack_layer` of a PackedIntLinear, cached on the layer until its buffers change (None: use the reference)."""
    codebook = getattr(layer, "codebook", None)  # NF4Linear's code book
    buffers = (layer.qweight, layer.scale, layer.zero_point, layer.g_idx, codebook)
    # inference tensors have no version counter (they cannot change outside inference mode)
    key = tuple(
        None if t is None else (t.data_ptr(), t.device, None if t.is_inference() else t._version) for t in buffers
    )
    cached = layer.__dict__.get("_triton_packed")
    if cached is None or cached[0] != key:
        packed = pack_layer(
            layer.qweight, layer.scale, layer.zero_point, layer.bits, layer.in_features, layer.g_idx, codebook
        )
        cached = (key, packed if isinstance(packed, PackedWeight) else None)
        layer.__dict__["_triton_packed"] = cached
    return cached[1]


def _choose(num_rows: int, n: int, packed: PackedWeight, dtype: torch.dtype, device: torch.device) -> dict:
    """Tile sizes, the group mode and split-K for an [M, K] x [K, N] product. No autotuning: the
    choice is a pure function of the shape, so CUDA-graph capture and the interpreter both work.
    Untuned guesses for the H200 (bench/gpu/kernels.py sweeps alternatives to pass as overrides)."""
    per_word, group_size, k = 32 // packed.width, packed.group_size, packed.in_features
    gemv = num_rows == 1
    # GEMV: 32 words (128 bytes) of each row per step; matmul: 128 (64 for large M) columns
    block_k = 32 * per_word if gemv else (128 if num_rows <= 64 else 64)
    tile_groups = group_size % block_k == 0
    if not tile_groups and group_size & (group_size - 1) == 0 and group_size >= max(64, 8 * per_word):
        block_k, tile_groups = group_size, True  # a group of 64 or 128 columns per step
    if gemv:
        config = {"BLOCK_N": max(16, min(64, 1024 * per_word // block_k))}  # ~1024 words per step
        tiles_mn, warps, stages, waves = triton.cdiv(n, config["BLOCK_N"]), 4, 3, 4
    else:
        block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
        block_n = 32 if dtype == torch.float32 else 64 if num_rows <= 64 else 128  # fp32 operands: half the tile
        config = {"BLOCK_M": block_m, "BLOCK_N": block_n}
        tiles_mn = triton.cdiv(num_rows, block_m) * triton.cdiv(n, block_n)
        warps, stages, waves = 4, 4, 2
    split = max(1, min(waves * num_sms(device) // tiles_mn, triton.cdiv(k, block_k) // 2, 16))
    config.update(BLOCK_KW=block_k // per_word, TILE_GROUPS=tile_groups, SPLIT_K=1 << (split.bit_length() - 1))
    return config | {"num_warps": warps, "num_stages": stages}


def w4a16_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None, **overrides) -> torch.Tensor:
    """x [..., K] (fp16, bf16 or fp32) -> [..., N] in x's dtype. `overrides` replace chosen tile
    sizes or SPLIT_K (tests, tuning)."""
    k, n = packed.in_features, packed.scale.shape[0]
    assert x.shape[-1] == k and x.dtype in (torch.float16, torch.bfloat16, torch.float32), (x.shape, x.dtype)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    num_rows = x2.shape[0]
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out.reshape(*x.shape[:-1], n)
    config = _choose(num_rows, n, packed, x.dtype, x.device) | overrides
    if config["TILE_GROUPS"] and packed.group_size % (config["BLOCK_KW"] * 32 // packed.width):
        raise ValueError(f"TILE_GROUPS needs a tile of whole groups: BLOCK_KW={config['BLOCK_KW']}, {packed}")
    split = config["SPLIT_K"]
    part = out if split == 1 else torch.empty(split, num_rows, n, dtype=torch.float32, device=x.device)
    bias = None if bias is None else bias.contiguous()
    args = (
        out, part, x2, packed.qweight, packed.scale, packed.zero_point,
        packed.qweight if packed.perm is None else packed.perm, out if bias is None else bias,
        packed.scale if packed.codebook is None else packed.codebook,
        num_rows, n, k, x2.stride(0), out.stride(0), packed.qweight.stride(0), packed.scale.stride(0),
        MAGIC + (128 if packed.width == 8 else 1 << (packed.bits - 1)),  # zf = 2^23 + qoffset (+ z in-kernel)
    )  # fmt: skip
    flags = {
        "GROUP_SIZE": packed.group_size, "WIDTH": packed.width, "SIGNED": packed.width == 8,
        "CODEBOOK": packed.codebook is not None,
        "HAS_PERM": packed.perm is not None, "HAS_BIAS": bias is not None and split == 1,
    }  # fmt: skip
    if "BLOCK_M" in config:
        grid = (triton.cdiv(num_rows, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]), split)
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        _mm_kernel[grid](*args, **flags, **config, PRECISION=precision)
    else:
        grid = (triton.cdiv(n, config["BLOCK_N"]), split, num_rows)
        _gemv_kernel[grid](*args, **flags, **config)
    if split > 1:
        block_n = min(1024, next_pow2(n))
        _sum_splits_kernel[(num_rows, triton.cdiv(n, block_n))](
            out, part, out if bias is None else bias, num_rows, n, out.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK_N=block_n,
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)
