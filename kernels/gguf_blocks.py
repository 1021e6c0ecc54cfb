"""GGUF (GGML) quantized blocks as llmd keeps them, and a pure-torch reference dequantize.

Layout: a packed GGUF weight stays the file's own bytes, a uint8 tensor [N, (K / block_elems) * block_bytes], one
output row per line (row-major, as in the file), plus its GGML type name. Nothing is widened or repacked, so the
resident bytes are the file's. Every kernel (the C CPU kernels in cpu_gguf.c, the Triton kernels) reads this layout
and must dequantize to exactly `dequantize_blocks`' values, which equal `gguf.quants.dequantize` bit for bit (the same
fp32 operations in the same order: scale products first, then `scale * q`, then the offset; no fused multiply-add).

Per block (little-endian; d, dmin, m are fp16; "q[j]" is element j of the block):

  type    elems bytes  fields (byte offsets)                                   value of element j
  Q4_0    32    18     d@0 qs[16]@2                                            d * (nib(j) - 8)
  Q4_1    32    20     d@0 m@2 qs[16]@4                                        (d * nib(j)) + m
  Q5_0    32    22     d@0 qh(u32)@2 qs[16]@6                                  d * ((nib(j) | bit_j(qh) << 4) - 16)
  Q5_1    32    24     d@0 m@2 qh(u32)@4 qs[16]@8                              (d * (nib(j) | bit_j(qh) << 4)) + m
  Q8_0    32    34     d@0 qs(int8)[32]@2                                      q[j] * d
  IQ4_NL  32    18     d@0 qs[16]@2                                            d * KVALUES[nib(j)]
  MXFP4   32    17     e(u8)@0 qs[16]@1                                        2^(e - 128) * E2M1X2[nib(j)]
    nib(j): low nibble of qs[j] for j < 16, high nibble of qs[j - 16] otherwise
    MXFP4 (gpt-oss's expert weights): e is an E8M0 exponent, the codes E2M1 (sign, 2 exponent bits, 1 mantissa bit)
    as ggml keeps them, doubled (E2M1X2 = 0, 1, 2, 3, 4, 6, 8, 12 and their negatives) with the scale halved, so
    2^(e - 128) * E2M1X2 = 2^(e - 127) * E2M1. Every e is a finite power of two here (ggml's rule: e = 0 and 1 are
    fp32 subnormals, 255 is 2^127, not E8M0's NaN), and each value is exact (or overflows to inf).
  Q2_K    256   84     scales[16]@0 qs[64]@16 d@80 dmin@82                     (d*sc_s) * q - (dmin*mn_s), 16 per s
                       j = 128h + 32t + l: q = qs[32h + l] >> 2t & 3; sc_s / mn_s = low / high nibble of scales[s]
  Q3_K    256   110    hmask[32]@0 qs[64]@32 scales[12]@96 d@108               (d * sc_s) * q, 16 per s
                       q = (qs bits as Q2_K) - 4 * (1 - (hmask[l] >> j // 32 & 1)), l = j % 32
                       sc_s = 6 bits (low 4: scales[s % 8] >> 4 (s // 8), high 2: scales[8 + s % 4] >> 2 (s // 4))
                              as int8 minus 32
  Q4_K    256   144    d@0 dmin@2 scales[12]@4 qs[128]@16                      (d*sc_s) * q - (dmin*mn_s), 32 per s
                       j = 64c + 32h + l: q = qs[32c + l] >> 4h & 15; (sc_s, mn_s): 6-bit pairs (scale_min_k4)
  Q5_K    256   176    d@0 dmin@2 scales[12]@4 qh[32]@16 qs[128]@48            as Q4_K, q |= (qh[l] >> j // 32 & 1) << 4
  Q6_K    256   210    ql[128]@0 qh[64]@128 scales(int8)[16]@192 d@208         (d * sc_s) * q, 16 per s
                       j = 128h + 32t + l: q = (ql[64h + 32(t & 1) + l] >> 4(t >> 1) & 15
                                           | (qh[32h + l] >> 2t & 3) << 4) - 32
  IQ4_XS  256   136    d@0 scales_h(u16)@2 scales_l[4]@4 qs[128]@8             (d * sc_s) * KVALUES[q], 32 per s
                       j = 32s + 16h + t: q = qs[16s + t] >> 4h & 15;
                       sc_s = (scales_l[s // 2] >> 4 (s % 2) & 15 | (scales_h >> 2s & 3) << 4) - 32

`scale_min_k4` (Q4_K, Q5_K), for sub-block s of 8 from the 12 bytes b: s < 4: sc = b[s] & 63, mn = b[s + 4] & 63;
s >= 4: sc = b[s + 4] & 15 | (b[s - 4] >> 6) << 4, mn = b[s + 4] >> 4 | (b[s] >> 6) << 4.
"""

from __future__ import annotations

import torch

QK_K = 256

# GGML type name -> (elements per block, bytes per block)
BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "IQ4_NL": (32, 18),
    "MXFP4": (32, 17),
    "Q2_K": (QK_K, 84),
    "Q3_K": (QK_K, 110),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
    "IQ4_XS": (QK_K, 136),
}
PACKED_TYPES = tuple(BLOCKS)
# llmd's interleaved layouts (x8_pack) -> the file's type
X8_OF = {"Q4_0_X8": "Q4_0", "Q4_1_X8": "Q4_1", "Q5_0_X8": "Q5_0", "Q5_1_X8": "Q5_1", "Q8_0_X8": "Q8_0",
         "IQ4_NL_X8": "IQ4_NL", "Q2_K_X8": "Q2_K", "Q3_K_X8": "Q3_K", "Q4_K_X8": "Q4_K", "Q5_K_X8": "Q5_K",
         "Q6_K_X8": "Q6_K", "IQ4_XS_X8": "IQ4_XS"}
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # E2M1 codes' values, doubled


def row_bytes(type_name: str, k: int) -> int:
    """Bytes of one row of k elements; ValueError when k is not a whole number of the type's blocks."""
    elems, nbytes = block_shape(type_name)
    if k <= 0 or k % elems:
        raise ValueError(f"a row of {k} elements is not a multiple of the {type_name} block ({elems} elements)")
    return k // elems * nbytes


def block_shape(type_name: str) -> tuple[int, int]:
    try:
        return BLOCKS[X8_OF.get(type_name, type_name)]
    except KeyError:
        raise ValueError(f"{type_name} is not a packed GGUF type llmd keeps (known: {', '.join(BLOCKS)})") from None


# ---- field helpers (all on [B, block_bytes] uint8 views) --------------------------------------------------------


def _f16(b: torch.Tensor, offset: int) -> torch.Tensor:
    """fp16 at byte `offset` of each block -> fp32 [B, 1]."""
    return b[:, offset:offset + 2].contiguous().view(torch.float16).to(torch.float32)


def _u32(b: torch.Tensor, offset: int) -> torch.Tensor:
    """little-endian uint32 at `offset` -> int64 [B, 1]."""
    v = b[:, offset:offset + 4].to(torch.int64)
    return v[:, :1] | v[:, 1:2] << 8 | v[:, 2:3] << 16 | v[:, 3:4] << 24


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """[B, 16] bytes -> [B, 32] values: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(v: torch.Tensor, count: int) -> torch.Tensor:
    """[B, 1] integers -> [B, count] of bit j (j = 0..count-1)."""
    return (v >> torch.arange(count, dtype=v.dtype, device=v.device)) & 1


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """[B, 64] bytes -> [B, 256] 2-bit values: element 128h + 32t + l is qs[32h + l] >> 2t & 3."""
    b = qs.shape[0]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device).view(1, 1, 4, 1)
    return ((qs.view(b, 2, 1, 32) >> shifts) & 3).reshape(b, QK_K)


def scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 12 scale bytes [B, 12] -> (scales, mins) [B, 8] as integers 0..63."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _per_sub(values: torch.Tensor, scale: torch.Tensor, sub: int) -> torch.Tensor:
    """values [B, 256] fp32, scale [B, 256 / sub] fp32 -> scale * values per sub-block (scale first, as gguf does)."""
    b = values.shape[0]
    return (scale.view(b, -1, 1) * values.view(b, -1, sub)).reshape(b, -1)


# ---- per type: [B, block_bytes] uint8 -> [B, block_elems] fp32 ------------------------------------------------


def _q4_0(b):
    return _f16(b, 0) * (_nibbles32(b[:, 2:18]).to(torch.int8) - 8).to(torch.float32)


def _q4_1(b):
    return (_f16(b, 0) * _nibbles32(b[:, 4:20]).to(torch.float32)) + _f16(b, 2)


def _q5_0(b):
    q = _nibbles32(b[:, 6:22]).to(torch.int64) | (_bits(_u32(b, 2), 32) << 4)
    return _f16(b, 0) * (q - 16).to(torch.float32)


def _q5_1(b):
    q = _nibbles32(b[:, 8:24]).to(torch.int64) | (_bits(_u32(b, 4), 32) << 4)
    return (_f16(b, 0) * q.to(torch.float32)) + _f16(b, 2)


def _q8_0(b):
    return b[:, 2:34].contiguous().view(torch.int8).to(torch.float32) * _f16(b, 0)


def _kvalues(device) -> torch.Tensor:
    return torch.tensor(IQ4_KVALUES, dtype=torch.float32, device=device)


def _iq4_nl(b):
    return _f16(b, 0) * _kvalues(b.device)[_nibbles32(b[:, 2:18]).to(torch.int64)]


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes -> 2^(e - 128) as fp32 (ggml's ggml_e8m0_to_fp32_half: e < 2 are the subnormals)."""
    e = e.to(torch.int32)
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def _mxfp4(b):
    kv = torch.tensor(MXFP4_KVALUES, dtype=torch.float32, device=b.device)
    return e8m0_half(b[:, 0:1]) * kv[_nibbles32(b[:, 1:17]).to(torch.int64)]


def _q2_k(b):
    scales = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    q = _crumbs(b[:, 16:80]).to(torch.float32)
    dl = d * (scales & 0x0F).to(torch.float32)
    ml = dmin * (scales >> 4).to(torch.float32)
    n = b.shape[0]
    return (dl.view(n, 16, 1) * q.view(n, 16, 16) - ml.view(n, 16, 1)).reshape(n, QK_K)


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, sc_bytes = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    low = torch.cat((sc_bytes[:, 0:8] & 0x0F, sc_bytes[:, 0:8] >> 4), dim=-1)  # s = 0..15
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 4, 1)
    high = ((sc_bytes[:, 8:12].view(n, 1, 4) >> shifts) & 3).reshape(n, 16)  # s = 4t + j
    sc = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    dl = d * sc
    hbits = (hmask.view(n, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)) & 1
    q = _crumbs(qs).to(torch.int8) - ((hbits.reshape(n, QK_K) ^ 1) << 2).to(torch.int8)
    return _per_sub(q.to(torch.float32), dl, 16)


def _k4_values(b, ql_bytes: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K low nibbles: element 64c + 32h + l is ql[32c + l] >> 4h & 15 -> [B, 256] uint8."""
    n = b.shape[0]
    v = ql_bytes.view(n, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8, device=b.device).view(1, 1, 2, 1)
    return (v & 0x0F).reshape(n, QK_K)


def _k_scaled(b, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = scale_min_k4(scales)
    dd = (d * sc.to(torch.float32)).view(n, 8, 1)
    dm = (dmin * mn.to(torch.float32)).view(n, 8, 1)
    return (dd * q.to(torch.float32).view(n, 8, 32) - dm).reshape(n, QK_K)


def _q4_k(b):
    return _k_scaled(b, _k4_values(b, b[:, 16:144]), b[:, 4:16])


def _q5_k(b):
    n = b.shape[0]
    qh = b[:, 16:48]
    hbits = (qh.view(n, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)) & 1
    q = _k4_values(b, b[:, 48:176]) | (hbits.reshape(n, QK_K) << 4)
    return _k_scaled(b, q, b[:, 4:16])


def _q6_k(b):
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(b, 208) * sc
    low = (ql.view(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8, device=b.device).view(1, 1, 2, 1)) & 0x0F
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    high = (qh.view(n, 2, 1, 32) >> shifts) & 3
    q = (low.reshape(n, QK_K) | (high.reshape(n, QK_K) << 4)).to(torch.int8) - 32
    return _per_sub(q.to(torch.float32), d, 16)


def _iq4_xs(b):
    n = b.shape[0]
    d = _f16(b, 0)
    sh = b[:, 2:4].to(torch.int64)
    sh = sh[:, :1] | sh[:, 1:2] << 8
    sl = b[:, 4:8]
    low = torch.stack((sl & 0x0F, sl >> 4), dim=-1).reshape(n, 8).to(torch.int64)
    high = (sh >> (2 * torch.arange(8, dtype=torch.int64, device=b.device))) & 3
    sc = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    qs = b[:, 8:136].reshape(n, 8, 16)
    idx = torch.cat((qs & 0x0F, qs >> 4), dim=-1).reshape(n, QK_K).to(torch.int64)
    return _per_sub(_kvalues(b.device)[idx], d * sc, 32)


_DEQUANT = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "IQ4_NL": _iq4_nl, "MXFP4": _mxfp4,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_XS": _iq4_xs,
}


def dequantize_blocks(blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    """uint8 blocks [N, (K / block_elems) * block_bytes] of `type_name` -> fp32 [N, K], bit-exact with
    gguf.quants.dequantize. A 1-D tensor is one row."""
    elems, nbytes = block_shape(type_name)
    if blocks.dtype is not torch.uint8:
        raise ValueError(f"GGUF blocks must be uint8, not {blocks.dtype}")
    if type_name in X8_OF:
        blocks, type_name = x8_unpack(blocks, type_name), X8_OF[type_name]
    rows = blocks.reshape(1, -1) if blocks.dim() == 1 else blocks
    if rows.dim() != 2 or rows.shape[1] % nbytes:
        raise ValueError(f"{type_name} rows of {rows.shape[-1]} bytes are not whole {nbytes}-byte blocks")
    n, nb = rows.shape[0], rows.shape[1] // nbytes
    if n == 0 or nb == 0:
        return torch.empty(n, nb * elems, dtype=torch.float32, device=blocks.device)
    out = _DEQUANT[type_name](rows.contiguous().view(n * nb, nbytes))
    return out.reshape(n, nb * elems)


def dequantize_rows(blocks: torch.Tensor, type_name: str, rows: torch.Tensor | slice) -> torch.Tensor:
    """Only the selected rows (an index tensor or a slice) dequantized: embeddings and bounded chunks."""
    return dequantize_blocks(blocks[rows], type_name)


# ---- Q4_K with 8 columns interleaved (the CPU integer path's layout: kernels/cpu_interleaved.c) -------------------
# A group of 8 rows' super-block b (8 x 144 bytes) becomes 1152 bytes: d [8] and dmin [8] (fp16), the 6-bit scales and
# mins split into low nibbles (byte 8j + c: sub-block j of column c, high nibble sub-block j + 4) and their top 2 bits
# (byte 8j + c: scale j, scale j + 4, min j, min j + 4 in bits 0-1, 2-3, 4-5, 6-7), then the code bytes in runs of 4
# per column: run (c, g) holds bytes 32c + 4g .. 32c + 4g + 3 of each column. The same bits, rearranged.


def _x8_groups(blocks: torch.Tensor, type_name: str) -> tuple[int, int]:
    n, width = blocks.shape
    nbytes = BLOCKS[X8_OF[type_name]][1]
    if blocks.dtype is not torch.uint8 or n % 8 or width % nbytes:
        raise ValueError(f"{type_name} needs uint8 rows in groups of 8 and whole {nbytes}-byte blocks, not "
                         f"{tuple(blocks.shape)}")
    return n // 8, width // nbytes


def x8_pack(blocks: torch.Tensor, layout: str) -> torch.Tensor:
    """Rows of X8_OF[layout]'s blocks [N, row bytes] (N % 8 == 0) -> the same bits in the interleaved `layout`."""
    if layout in X8_FIELDS:
        return _x8_fields(_q5_bits(blocks, layout, _Q5_BITS), layout, X8_FIELDS[layout])
    return {"Q4_K_X8": q4k_x8_pack, "Q5_K_X8": q5k_x8_pack, "Q6_K_X8": q6k_x8_pack,
            "IQ4_XS_X8": iq4xs_x8_pack}[layout](blocks)


def x8_unpack(packed: torch.Tensor, layout: str) -> torch.Tensor:
    """The interleaved `layout` -> the file's rows (x8_pack's inverse)."""
    if layout in X8_FIELDS:
        return _q5_bits(_x8_fields_back(packed, layout, X8_FIELDS[layout]), layout, _Q5_BITS.argsort())
    return {"Q4_K_X8": q4k_x8_unpack, "Q5_K_X8": q5k_x8_unpack, "Q6_K_X8": q6k_x8_unpack,
            "IQ4_XS_X8": iq4xs_x8_unpack}[layout](packed)


def _runs(code_bytes: torch.Tensor) -> torch.Tensor:
    """[..., bytes] (a multiple of 4) -> int32 [..., bytes / 4]: runs of 4 code bytes move as one element."""
    return code_bytes.contiguous().view(torch.int32)


def _bytes_of(words: torch.Tensor, mask: int) -> torch.Tensor:
    return words & int.from_bytes(bytes([mask]) * 8, "little", signed=True)  # the mask in every byte of an int64


def q4k_x8_pack(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K rows [N, nb * 144] (N % 8 == 0) -> the same bits in the Q4_K_X8 layout, [N, nb * 144]. The 6-bit fields
    are moved 8 bytes at a time (int64 words: one byte per column)."""
    groups, nb = _x8_groups(blocks, "Q4_K_X8")
    b = blocks.reshape(groups, 8, nb, 144).transpose(1, 2)  # [G, nb, column, 144]
    w = b[..., 4:16].contiguous().view(torch.int32).to(torch.int64)  # the 12 scale bytes as 3 words
    w0, w1, w2 = w[..., 0], w[..., 1], w[..., 2]
    fields = torch.stack([w0 & 0x3F3F3F3F, (w2 & 0x0F0F0F0F) | ((w0 >> 6) & 0x03030303) << 4,  # scales 0-3, 4-7
                          w1 & 0x3F3F3F3F, ((w2 >> 4) & 0x0F0F0F0F) | ((w1 >> 6) & 0x03030303) << 4], dim=-1)
    fields = fields.to(torch.int32).view(torch.uint8).reshape(groups, nb, 8, 2, 8)  # [.., column, sc/mn, sub-block]
    words = fields.permute(0, 1, 3, 4, 2).contiguous().view(torch.int64)[..., 0]  # [G, nb, sc/mn, sub-block]
    sc, mn = words[:, :, 0], words[:, :, 1]
    low = lambda v: _bytes_of(v[..., :4], 15) | _bytes_of(v[..., 4:], 15) << 4  # noqa: E731
    high = (_bytes_of(sc[..., :4] >> 4, 3) | _bytes_of(sc[..., 4:] >> 4, 3) << 2 | _bytes_of(mn[..., :4] >> 4, 3) << 4
            | _bytes_of(mn[..., 4:] >> 4, 3) << 6)
    codes = _runs(b[..., 16:]).reshape(groups, nb, 8, 4, 8).permute(0, 1, 3, 4, 2)  # [G, nb, c, g, column]
    out = torch.cat([b[..., 0:2].reshape(groups, nb, 16), b[..., 2:4].reshape(groups, nb, 16),
                     low(sc).view(torch.uint8), low(mn).view(torch.uint8), high.view(torch.uint8),
                     codes.contiguous().view(torch.uint8).reshape(groups, nb, 1024)], dim=-1)
    return out.reshape(blocks.shape)


def q4k_x8_unpack(packed: torch.Tensor) -> torch.Tensor:
    """The Q4_K_X8 layout [N, nb * 144] -> the file's Q4_K rows (q4k_x8_pack's inverse)."""
    groups, nb = _x8_groups(packed, "Q4_K_X8")
    p = packed.reshape(groups, nb, 1152)
    lo_sc, lo_mn, high = (p[..., o:o + 32].reshape(groups, nb, 4, 8) for o in (32, 64, 96))
    sc = torch.cat([(lo_sc & 15) | (high & 3) << 4, (lo_sc >> 4) | (high >> 2 & 3) << 4], dim=2)  # [G, nb, 8 j, col]
    mn = torch.cat([(lo_mn & 15) | (high >> 4 & 3) << 4, (lo_mn >> 4) | (high >> 6) << 4], dim=2)
    sc, mn = sc.transpose(2, 3), mn.transpose(2, 3)  # [G, nb, column, sub-block]
    scales = torch.cat([sc[..., :4] | (sc[..., 4:] >> 4) << 6, mn[..., :4] | (mn[..., 4:] >> 4) << 6,
                        (sc[..., 4:] & 15) | (mn[..., 4:] & 15) << 4], dim=-1)  # scale_min_k4's 12 bytes
    codes = p[..., 128:].reshape(groups, nb, 4, 8, 8, 4).permute(0, 1, 4, 2, 3, 5).reshape(groups, nb, 8, 128)
    out = torch.cat([p[..., 0:16].reshape(groups, nb, 8, 2), p[..., 16:32].reshape(groups, nb, 8, 2), scales, codes],
                    dim=-1)  # [G, nb, column, 144]
    return out.transpose(1, 2).reshape(packed.shape)


# Q4_0's, Q8_0's, Q2_K's and Q3_K's groups of 8 rows' (super-)block hold each field of the 8 columns side by side: fp16
# values as 8 fp16s, other bytes column-interleaved (byte i of column c at 8i + c), codes in runs of 4 bytes per
# column:
#   Q4_0 (8 x 18 bytes): d [8] (fp16), then run g of the codes (qs bytes 4g ..) at 16 + 32g; Q8_0 (8 x 34 bytes) too;
#   Q2_K (8 x 84 bytes): d [8] and dmin [8] (fp16), the 16 scale bytes (scale | min << 4 of sub-block s at 32 + 8s + c),
#       then run (h, g) of the 2-bit codes (qs bytes 32h + 4g ..) at 160 + 32 (8h + g);
#   Q3_K (8 x 110 bytes): d [8] (fp16), the 12 scale bytes (at 16 + 8i + c), run g of the high bits (hmask bytes
#       4g ..) at 112 + 32g, then run (h, g) of the low 2 bits (qs bytes 32h + 4g ..) at 368 + 32 (8h + g).


_UNIT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _x8_fields(blocks: torch.Tensor, layout: str, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """the file's rows -> `layout`: each span (lo, hi, w) of a block's bytes as units of w bytes, unit u of column c
    at (8u + c) w (a byte field, fp16 values side by side, runs of 4 code bytes)"""
    groups, nb = _x8_groups(blocks, layout)
    b = blocks.reshape(groups, 8, nb, -1).transpose(1, 2)  # [G, nb, column, bytes]
    parts = [b[..., lo:hi].contiguous().view(_UNIT_DTYPES[w]).transpose(2, 3).reshape(groups, nb, -1)
             .view(torch.uint8) for lo, hi, w in spans]
    return torch.cat(parts, dim=-1).reshape(blocks.shape)


def _x8_fields_back(packed: torch.Tensor, layout: str, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """_x8_fields' inverse"""
    groups, nb = _x8_groups(packed, layout)
    p = packed.reshape(groups, nb, -1)
    at, fields = 0, {}
    for lo, hi, w in spans:
        units = p[..., at:at + 8 * (hi - lo)].contiguous().view(_UNIT_DTYPES[w]).reshape(groups, nb, -1, 8)
        fields[lo] = units.transpose(2, 3).reshape(groups, nb, -1).view(torch.uint8).reshape(groups, nb, 8, hi - lo)
        at += 8 * (hi - lo)
    return torch.cat([fields[lo] for lo in sorted(fields)], dim=-1).transpose(1, 2).reshape(packed.shape)


# the layouts made of whole fields: each one's spans of the file's block in the interleaved block's order
X8_FIELDS = {"Q4_0_X8": [(0, 2, 2), (2, 18, 4)],  # d, codes
             "Q4_1_X8": [(0, 2, 2), (2, 4, 2), (4, 20, 4)],  # d, m, codes
             "Q5_0_X8": [(0, 2, 2), (2, 22, 4)],  # d, fifth bits (re-ordered: _q5_bits), codes
             "Q5_1_X8": [(0, 2, 2), (2, 4, 2), (4, 24, 4)],  # d, m, fifth bits, codes
             "IQ4_NL_X8": [(0, 2, 2), (2, 18, 4)],  # d, codes
             "Q8_0_X8": [(0, 2, 2), (2, 34, 4)],  # d, codes
             "Q2_K_X8": [(80, 82, 2), (82, 84, 2), (0, 16, 1), (16, 80, 4)],  # d, dmin, scales, codes
             "Q3_K_X8": [(108, 110, 2), (96, 108, 1), (0, 32, 4), (32, 96, 4)]}  # d, scales, high bits, low bits


# Q5_0_X8's and Q5_1_X8's fifth bits: bit 8i + j of the interleaved word is bit _Q5_BITS[8i + j] of the file's qh
# (element 4j + i for j < 4, 16 + 4 (j - 4) + i after), so that each run of codes' bits sit at one bit of every byte
_Q5_BITS = torch.tensor([4 * j + i if j < 4 else 16 + 4 * (j - 4) + i for i in range(4) for j in range(8)])
_QH_AT = {"Q5_0_X8": 2, "Q5_1_X8": 4}


def _q5_bits(blocks: torch.Tensor, layout: str, order: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1 rows with each block's fifth bits re-ordered (bit b of the result: bit order[b]); others as given"""
    if layout not in _QH_AT:
        return blocks
    at, nbytes = _QH_AT[layout], BLOCKS[X8_OF[layout]][1]
    out = blocks.clone()
    qh = out.view(-1, nbytes)[:, at:at + 4].to(torch.int64)
    word = qh[:, 0] | qh[:, 1] << 8 | qh[:, 2] << 16 | qh[:, 3] << 24
    bits = (word[:, None] >> order) & 1
    word = (bits << torch.arange(32)).sum(-1)
    out.view(-1, nbytes)[:, at:at + 4] = torch.stack([(word >> 8 * i) & 255 for i in range(4)], -1).to(torch.uint8)
    return out


# Q5_K's group of 8 rows' super-block (8 x 176 bytes): Q4_K_X8's 1152 bytes of its d, dmin, scales, mins and low 4
# bits, then its fifth bits in runs of 4 bytes per column (run g: qh bytes 4g .. 4g + 3; bit j is sub-block j's).


def q5k_x8_pack(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K rows [N, nb * 176] (N % 8 == 0) -> the same bits in the Q5_K_X8 layout."""
    groups, nb = _x8_groups(blocks, "Q5_K_X8")
    b = blocks.reshape(groups, 8, nb, 176)
    q4 = q4k_x8_pack(torch.cat([b[..., :16], b[..., 48:]], dim=-1).reshape(groups * 8, nb * 144))
    high = _runs(b.transpose(1, 2)[..., 16:48]).permute(0, 1, 3, 2)  # [G, nb, run, column]
    out = torch.cat([q4.reshape(groups, nb, 1152), high.contiguous().view(torch.uint8).reshape(groups, nb, 256)], -1)
    return out.reshape(blocks.shape)


def q5k_x8_unpack(packed: torch.Tensor) -> torch.Tensor:
    """The Q5_K_X8 layout -> the file's Q5_K rows (q5k_x8_pack's inverse)."""
    groups, nb = _x8_groups(packed, "Q5_K_X8")
    p = packed.reshape(groups, nb, 1408)
    q4 = q4k_x8_unpack(p[..., :1152].reshape(groups * 8, nb * 144)).reshape(groups, 8, nb, 144)
    high = p[..., 1152:].reshape(groups, nb, 8, 8, 4).permute(0, 3, 1, 2, 4).reshape(groups, 8, nb, 32)
    return torch.cat([q4[..., :16], high, q4[..., 16:]], dim=-1).reshape(packed.shape)


# Q6_K's group of 8 rows' super-block (8 x 210 bytes): d [8] (fp16), the 16 int8 scales as byte 8s + c, then the
# codes in three runs of 512 bytes, byte o = 256h + 32g + 4c + i of each for the 4 units' codes at elements
# 128h + 32t + 4g + i of column c: X (unit 0's code | unit 2's top 2 bits << 6), Y (unit 1's | unit 3's top bits << 6),
# Z (unit 2's low 4 bits | unit 3's << 4): two of every four codes whole bytes (cpu_interleaved.c).


def x8_rows(packed: torch.Tensor, ids: torch.Tensor, layout: str) -> torch.Tensor:
    """Rows `ids` of an interleaved table [N, row bytes] in the file's layout (an embedding lookup in a table a tied
    head interleaved): each row's group of 8 unpacked once."""
    groups, where = torch.unique(ids // 8, return_inverse=True)
    n, width = packed.shape
    rows = x8_unpack(packed.view(n // 8, 8 * width)[groups].view(-1, width), layout).view(-1, 8, width)
    return rows[where, ids % 8]


def q6k_x8_pack(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K rows [N, nb * 210] (N % 8 == 0) -> the same bits in the Q6_K_X8 layout."""
    groups, nb = _x8_groups(blocks, "Q6_K_X8")
    b = blocks.reshape(groups, 8, nb, 210).transpose(1, 2)  # [G, nb, column, 210]
    ql = _runs(b[..., 0:128]).reshape(groups, nb, 8, 2, 2, 8).permute(0, 1, 3, 4, 5, 2)  # [G, nb, h, p, g, column]
    qh = _runs(b[..., 128:192]).reshape(groups, nb, 8, 2, 8).permute(0, 1, 3, 4, 2)
    ql = ql.contiguous().view(torch.uint8).reshape(groups, nb, 2, 2, 256)
    low, high = ql[:, :, :, 0], ql[:, :, :, 1]  # units 0 | 2 << 4 and 1 | 3 << 4 at each position o of half h
    top = qh.contiguous().view(torch.uint8).reshape(groups, nb, 2, 256)
    x = (low & 15) | (top & 3) << 4 | (top >> 4 & 3) << 6
    y = (high & 15) | (top >> 2 & 3) << 4 | (top >> 6) << 6
    z = low >> 4 | (high >> 4) << 4
    out = torch.cat([b[..., 208:210].reshape(groups, nb, 16), b[..., 192:208].transpose(2, 3).reshape(groups, nb, 128),
                     x.reshape(groups, nb, 512), y.reshape(groups, nb, 512), z.reshape(groups, nb, 512)], dim=-1)
    return out.reshape(blocks.shape)


def q6k_x8_unpack(packed: torch.Tensor) -> torch.Tensor:
    """The Q6_K_X8 layout -> the file's Q6_K rows (q6k_x8_pack's inverse)."""
    groups, nb = _x8_groups(packed, "Q6_K_X8")
    p = packed.reshape(groups, nb, 1680)
    x, y, z = (p[..., at:at + 512].reshape(groups, nb, 2, 256) for at in (144, 656, 1168))
    low, high = (x & 15) | (z & 15) << 4, (y & 15) | (z >> 4) << 4
    top = (x >> 4 & 3) | (y >> 4 & 3) << 2 | (x >> 6) << 4 | (y >> 6) << 6
    ql = torch.stack([low, high], dim=3).reshape(groups, nb, 2, 2, 8, 8, 4).permute(0, 1, 5, 2, 3, 4, 6)
    ql = ql.reshape(groups, nb, 8, 128)
    qh = top.reshape(groups, nb, 2, 8, 8, 4).permute(0, 1, 4, 2, 3, 5).reshape(groups, nb, 8, 64)
    scales = p[..., 16:144].reshape(groups, nb, 16, 8).transpose(2, 3)
    out = torch.cat([ql, qh, scales, p[..., 0:16].reshape(groups, nb, 8, 2)], dim=-1)  # [G, nb, column, 210]
    return out.transpose(1, 2).reshape(packed.shape)


# IQ4_XS's group of 8 rows' super-block (8 x 136 bytes): d [8] (fp16), the 6-bit scales' low 4 bits as Q4_K_X8's
# (byte 8j + c, high nibble sub-block j + 4), their top 2 bits (byte 8p + c: sub-block 4p + k in bits 2k), then the
# codes in runs of 4 bytes per column (run (j, g): qs bytes 16j + 4g ..).


def iq4xs_x8_pack(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_XS rows [N, nb * 136] (N % 8 == 0) -> the same bits in the IQ4_XS_X8 layout."""
    groups, nb = _x8_groups(blocks, "IQ4_XS_X8")
    b = blocks.reshape(groups, 8, nb, 136).transpose(1, 2)  # [G, nb, column, 136]
    high = (b[..., 2].to(torch.int32) | b[..., 3].to(torch.int32) << 8).unsqueeze(-1)
    high = (high >> (2 * torch.arange(8, dtype=torch.int32, device=b.device)) & 3).to(torch.uint8)  # [.., col, 8]
    low = torch.stack((b[..., 4:8] & 15, b[..., 4:8] >> 4), dim=-1).reshape(groups, nb, 8, 8)  # sub-block j: [.., j]
    low, high = low.transpose(2, 3), high.transpose(2, 3)  # [G, nb, sub-block, column]
    tops = high.reshape(groups, nb, 2, 4, 8)  # [.., p, k, column]
    tops = tops[:, :, :, 0] | tops[:, :, :, 1] << 2 | tops[:, :, :, 2] << 4 | tops[:, :, :, 3] << 6
    codes = _runs(b[..., 8:]).reshape(groups, nb, 8, 8, 4).permute(0, 1, 3, 4, 2)  # [G, nb, j, g, column]
    out = torch.cat([b[..., 0:2].reshape(groups, nb, 16), (low[:, :, :4] | low[:, :, 4:] << 4).reshape(groups, nb, 32),
                     tops.reshape(groups, nb, 16), codes.contiguous().view(torch.uint8).reshape(groups, nb, 1024)],
                    dim=-1)
    return out.reshape(blocks.shape)


def iq4xs_x8_unpack(packed: torch.Tensor) -> torch.Tensor:
    """The IQ4_XS_X8 layout -> the file's IQ4_XS rows (iq4xs_x8_pack's inverse)."""
    groups, nb = _x8_groups(packed, "IQ4_XS_X8")
    p = packed.reshape(groups, nb, 1088)
    lows = p[..., 16:48].reshape(groups, nb, 4, 8)
    low = torch.cat([lows & 15, lows >> 4], dim=2).transpose(2, 3)  # [G, nb, column, sub-block]
    tops = p[..., 48:64].reshape(groups, nb, 2, 1, 8) >> (2 * torch.arange(4, dtype=torch.uint8,
                                                                        device=p.device)).view(1, 1, 1, 4, 1)
    high = (tops & 3).reshape(groups, nb, 8, 8).transpose(2, 3).to(torch.int32)  # [G, nb, column, sub-block]
    h16 = (high << (2 * torch.arange(8, dtype=torch.int32, device=p.device))).sum(-1)
    codes = p[..., 64:].reshape(groups, nb, 8, 4, 8, 4).permute(0, 1, 4, 2, 3, 5).reshape(groups, nb, 8, 128)
    out = torch.cat([p[..., 0:16].reshape(groups, nb, 8, 2), torch.stack((h16 & 255, h16 >> 8), -1).to(torch.uint8),
                     low[..., 0::2] | low[..., 1::2] << 4, codes], dim=-1)  # [G, nb, column, 136]
    return out.transpose(1, 2).reshape(packed.shape)
