"""The blocks of 32, the K-quants and the IQ4s with 8 columns interleaved (Q4_0_X8 .. Q8_0_X8, IQ4_NL_X8, Q2_K_X8 ..
Q6_K_X8, IQ4_XS_X8: kernels/cpu_interleaved.c), the CPU integer paths' layouts for them: the same bits rearranged
(packing and unpacking give the file's bytes back, dequantizing gives the file's values), the kernel's products match
the integer path's torch reference, a row's result is bitwise the same whatever the batch, its position, the thread
count and the parts beside it, and a packed layer takes the layout on the CPU only where nothing else reads its blocks
in the file's layout.

Where no C compiler exists the layer keeps the file's layout; the tests check that branch instead of skipping."""

from __future__ import annotations

import pytest
import torch
from test_kernels_cpu_gguf import HAVE_KERNEL, ROWS, _rows_independent_of_the_batch, _weights, _x

from llmd.kernels import cpu_gemm
from llmd.kernels import gguf_blocks as gb


LAYOUTS = ["Q4_0_X8", "Q4_1_X8", "Q5_0_X8", "Q5_1_X8", "IQ4_NL_X8", "Q8_0_X8", "Q2_K_X8", "Q3_K_X8", "Q4_K_X8",
           "Q5_K_X8", "Q6_K_X8", "IQ4_XS_X8"]


def test_packing_keeps_the_files_bits():
    q, k = _weights("Q4_K", n=24, k=768)
    packed = gb.q4k_x8_pack(q)
    assert packed.shape == q.shape and not torch.equal(packed, q)
    assert torch.equal(torch.sort(packed.view(3, 3, 1152)[:, :, 128:].reshape(3, -1)).values,  # codes: moved
                       torch.sort(q.view(3, 8, 3, 144)[..., 16:].reshape(3, -1)).values)
    q6, _ = _weights("Q6_K", n=24, k=768)
    file6, packed6 = q6.view(3, 8, 3, 210), gb.q6k_x8_pack(q6).view(3, 3, 1680)  # [group, column / block, bytes]
    assert torch.equal(torch.sort(packed6[..., :144].reshape(3, -1)).values,  # d and scales: moved
                       torch.sort(file6[..., 192:].reshape(3, -1)).values)
    unit0 = (file6[..., 0:32] & 15) | (file6[..., 128:160] & 3) << 4  # codes re-coded: unit 0's, whole bytes of X
    assert torch.equal(packed6[..., 144:400].reshape(3, 3, 8, 8, 4).permute(0, 3, 1, 2, 4).reshape(3, 8, 3, 32) & 63,
                       unit0)
    for layout in LAYOUTS:
        q, _ = _weights(gb.X8_OF[layout], n=24, k=768)
        packed = gb.x8_pack(q, layout)
        assert torch.equal(gb.x8_unpack(packed, layout), q)
        ids = torch.tensor([23, 0, 9, 9, 16])  # a tied table's lookup (C for Q6_K_X8 and the blocks of 32)
        assert torch.equal(cpu_gemm.x8_rows(packed, ids, layout), q[ids])
        in_place = q.clone()
        cpu_gemm.x8_pack_(in_place, layout)  # the loader's packing (C where the library loads): the reference's bytes
        assert torch.equal(in_place, packed)
        assert torch.equal(gb.dequantize_blocks(packed, layout).view(torch.int32),
                           gb.dequantize_blocks(q, gb.X8_OF[layout]).view(torch.int32))
        with pytest.raises(ValueError, match="groups of 8"):
            gb.x8_pack(q[:20], layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_products_match_the_integer_paths_reference(layout):
    if not HAVE_KERNEL:
        return
    blocks_of_32 = gb.BLOCKS[gb.X8_OF[layout]][0] == 32  # K need not fill a chunk of 256 of the row data's sums
    for k in (256, 768) + ((96,) if blocks_of_32 else ()):
        q, _ = _weights(gb.X8_OF[layout], n=40, k=k, seed=k)
        kernel = cpu_gemm.GGUFKernel(cpu_gemm.load(), [(gb.x8_pack(q, layout), layout)], k, act="int8")
        for m in ROWS:
            x = _x(m, k, seed=m)
            ref = cpu_gemm.gguf_matmul_q8_ref(x, q, gb.X8_OF[layout])
            torch.testing.assert_close(kernel(x), ref, rtol=1e-5, atol=2e-5 * ref.abs().max().item())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_do_not_depend_on_batch_threads_or_parts(layout):
    if not HAVE_KERNEL:
        return
    q, k = _weights(gb.X8_OF[layout], n=48, k=512)
    other, _ = _weights("Q8_0", n=11, k=k, seed=3)
    lib, packed = cpu_gemm.load(), gb.x8_pack(q, layout)
    kernel = cpu_gemm.GGUFKernel(lib, [(packed, layout)], k, act="int8")
    fused = cpu_gemm.GGUFKernel(lib, [(other, "Q8_0"), (packed, layout), (other, "Q8_0")], k, act="int8")
    x = _x(70, k)
    full = _rows_independent_of_the_batch(kernel, x)
    for threads in (1, 2, 3):
        for m in (1, 2, 3, 4, 5, 7, 70):  # one row, the 2-4 row tiles and their remainders
            assert torch.equal(kernel(x[:m], threads), full[:m])
    both = fused(x, 2)
    assert torch.equal(both[:, 11:59], full) and torch.equal(both[:, :11], both[:, 59:])


def test_interleaved_q8_0_gives_the_file_layouts_very_bits():
    """Q8_0_X8 keeps the file layout's order of operations per output, so a Q8_0 model's outputs do not move; codes
    of -128 against activations of +-127 (the largest products) stay exact."""
    if not HAVE_KERNEL:
        return
    lib = cpu_gemm.load()
    q, k = _weights("Q8_0", n=40, k=768)
    q.view(40, 24, 34)[:8, :, 2:] = 128  # -128: |w| = 128, the pairs' sums at their largest
    interleaved = cpu_gemm.GGUFKernel(lib, [(gb.x8_pack(q, "Q8_0_X8"), "Q8_0_X8")], k, act="int8")
    file_layout = cpu_gemm.GGUFKernel(lib, [(q, "Q8_0")], k, act="int8")
    x = _x(9, k)
    x[0] = x[0].sign() * 10.0  # every int8 activation of row 0 at +-127
    for m in (1, 2, 4, 9):
        assert torch.equal(interleaved(x[:m]), file_layout(x[:m]))
    torch.testing.assert_close(interleaved(x), cpu_gemm.gguf_matmul_q8_ref(x, q, "Q8_0"), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("layout", ["Q6_K_X8", "Q4_1_X8", "Q8_0_X8"])
def test_the_int16_paths_interleaved_tiles_match_its_reference_whatever_the_batch(layout):
    """Q6_K_X8 and Q8_0_X8 (output heads) and Q4_1_X8 (Q4_1 layers) on the int16 path: the codes widened to int16
    against the activations' int16 codes (cpu_interleaved.c), close to the path's reference and to the file layout's
    kernel, a row's bits the same whatever the rows and threads beside it."""
    if not HAVE_KERNEL:
        return
    lib, type_name = cpu_gemm.load(), gb.X8_OF[layout]
    for k in (256, 768) + ((96,) if layout != "Q6_K_X8" else ()):
        q, _ = _weights(type_name, n=40, k=k, seed=k)
        head = cpu_gemm.GGUFKernel(lib, [(gb.x8_pack(q, layout), layout)], k, act="int16")
        assert head.act == "int16"
        file_layout = cpu_gemm.GGUFKernel(lib, [(q, type_name)], k, act="int16")
        x = _x(70, k, seed=k) * torch.logspace(-3, 3, k)  # activations of very different sizes per block
        full = _rows_independent_of_the_batch(head, x)
        ref = cpu_gemm.gguf_matmul_q16_ref(x, q, type_name)
        torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        torch.testing.assert_close(full, file_layout(x), rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        for threads in (1, 3):
            for m in (1, 2, 3, 4, 5, 7):
                assert torch.equal(head(x[:m], threads), full[:m])
    x = torch.full((1, 256), 1e4)  # every code at its extreme: the integer sums stay exact (|I sc| < 2^31)
    if layout == "Q4_1_X8":
        q = torch.full((8, 160), 255, dtype=torch.uint8)  # codes 15 against activation codes 32767
        q.view(8, 8, 20)[..., :4] = torch.tensor([1.0, -2.0], dtype=torch.float16).view(torch.uint8)  # d 1, m -2
        extreme = cpu_gemm.GGUFKernel(lib, [(gb.x8_pack(q, layout), layout)], 256, act="int16")(x)
        torch.testing.assert_close(extreme, torch.full((1, 8), 256 * (15 - 2) * 1e4), rtol=1e-6, atol=0)
        return
    if layout == "Q8_0_X8":
        q = torch.full((8, 272), 128, dtype=torch.uint8)  # codes -128 against activation codes 32767
        q.view(8, 8, 34)[..., :2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
        extreme = cpu_gemm.GGUFKernel(lib, [(gb.x8_pack(q, layout), layout)], 256, act="int16")(x)
        torch.testing.assert_close(extreme, torch.full((1, 8), 256 * -128 * 1e4), rtol=1e-6, atol=0)
        return
    q = torch.zeros(8, 210, dtype=torch.uint8)
    q[:, 192:208] = torch.tensor([-128 % 256] * 16, dtype=torch.uint8)
    q[:, 208:210] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    extreme = cpu_gemm.GGUFKernel(lib, [(gb.x8_pack(q, "Q6_K_X8"), "Q6_K_X8")], 256, act="int16")(x)
    assert torch.equal(extreme, cpu_gemm.gguf_matmul_q16_ref(x, q, "Q6_K"))


def test_the_kernel_refuses_what_the_layout_cannot_hold():
    if not HAVE_KERNEL:
        return
    q, k = _weights("Q4_K", n=16, k=512)
    packed, lib = gb.q4k_x8_pack(q), cpu_gemm.load()
    with pytest.raises(ValueError, match="rejected"):  # whole groups of 8 columns only
        cpu_gemm.GGUFKernel(lib, [(packed[:12], "Q4_K_X8")], k, act="int8")(_x(1, k))
    with pytest.raises(ValueError, match="rejected"):  # the integer path only
        cpu_gemm.GGUFKernel(lib, [(packed, "Q4_K_X8")], k, act="fp32")(_x(1, k))


def test_a_layer_interleaves_on_the_cpu_where_nothing_else_reads_its_blocks():
    from llmd.model.quant import GGUFLinear

    q, k = _weights("Q4_K", n=32, k=512)
    x = _x(3, k)

    def layer(n: int = 32, head: bool = False, shared: bool = False) -> GGUFLinear:
        out = GGUFLinear(k, n, "Q4_K")
        out.output_head, out.shared_blocks = head, shared
        out.fill(q[:n], "w", "test")
        out.prepare(torch.device("cpu"), torch.float32)
        return out

    plain = layer()
    if not HAVE_KERNEL:
        assert plain.type_name == "Q4_K" and torch.equal(plain.qweight, q)
        return
    assert plain.type_name == "Q4_K_X8" and torch.equal(plain.qweight, gb.q4k_x8_pack(q))
    torch.testing.assert_close(plain(x), cpu_gemm.gguf_matmul_q8_ref(x, q, "Q4_K"), rtol=1e-5, atol=1e-3)
    assert torch.equal(plain.dequantized_weight(), gb.dequantize_blocks(q, "Q4_K"))
    plain.fill(q.flip(0).contiguous(), "w", "test")  # new rows come in the file's layout
    assert plain.type_name == "Q4_K" and torch.equal(plain.qweight, q.flip(0))
    for kept in (layer(n=20), layer(head=True), layer(shared=True)):  # not 8 | N, a Q4_K head, an expert's view
        assert kept.type_name == "Q4_K" and torch.equal(kept.qweight, q[:kept.out_features])
    plain.prepare(torch.device("meta"), torch.float32)  # another device: the file's layout back
    assert plain.type_name == "Q4_K"
    q41, _ = _weights("Q4_1", n=16, k=k)  # a Q4_1 layer interleaves for the int16 path it computes on
    layer41 = GGUFLinear(k, 16, "Q4_1")
    layer41.fill(q41, "w", "test")
    layer41.prepare(torch.device("cpu"), torch.float32)
    assert layer41.type_name == "Q4_1_X8" and cpu_gemm.gguf_kernel(layer41.cpu_parts(), k).act == "int16"
    ref = cpu_gemm.gguf_matmul_q16_ref(x, q41, "Q4_1")
    torch.testing.assert_close(layer41(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    q80, _ = _weights("Q8_0", n=16, k=k)  # and a Q8_0 output head for its int16 path
    head80 = GGUFLinear(k, 16, "Q8_0")
    head80.output_head = True
    head80.fill(q80, "w", "test")
    head80.prepare(torch.device("cpu"), torch.float32)
    assert head80.type_name == "Q8_0_X8" and cpu_gemm.gguf_kernel(head80.cpu_parts(), k, head=True).act == "int16"
    ref = cpu_gemm.gguf_matmul_q16_ref(x, q80, "Q8_0")
    torch.testing.assert_close(head80(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_a_tied_q6_k_head_interleaves_its_table_and_the_embedding_still_reads_the_files_rows():
    """A tied Q6_K table (as Q4_K_M files carry it) is interleaved in place by its head; the embedding then reads its
    rows through the groups of 8, the file's values bit for bit, and the head computes on the int16 path."""
    from torch import nn

    from llmd.model.quant import GGUFEmbedding, tie_gguf_head

    q, k = _weights("Q6_K", n=64, k=512)
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = emb = GGUFEmbedding(64, k, "Q6_K", torch.float32)
    model.lm_head = None
    emb.fill(q, "token_embd.weight", "test")
    assert tie_gguf_head(model, torch.float32)
    head = model.lm_head
    head.output_head = True
    ids = torch.tensor([[3, 17, 3, 63], [0, 8, 9, 40]])
    before = emb(ids)
    head.prepare(torch.device("cpu"), torch.float32)
    assert torch.equal(before, gb.dequantize_blocks(q, "Q6_K")[ids])
    if not HAVE_KERNEL:
        assert head.type_name == "Q6_K"
        return
    assert head.type_name == "Q6_K_X8" and torch.equal(emb.qweight, gb.x8_pack(q, "Q6_K_X8"))
    assert torch.equal(emb(ids), before)
    assert torch.equal(gb.x8_rows(emb.qweight, ids.flatten(), "Q6_K_X8"), q[ids.flatten()])  # the torch reference
    with pytest.raises(IndexError):
        emb(torch.tensor([64]))
    x = _x(3, k)
    ref = cpu_gemm.gguf_matmul_q16_ref(x, q, "Q6_K")
    torch.testing.assert_close(head(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
