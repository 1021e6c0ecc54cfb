"""Packed weights on transparent huge pages (llmd.model.huge_pages): one 2 MiB-aligned mapping advised before the
loader fills it, alive while a tensor views it. (The models' outputs are the family and kernel tests': every CPU
model loaded there has its packed weights in such a mapping.)"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from llmd.model.attention import allocate_kv_cache
from llmd.model.huge_pages import HUGE_PAGE, huge_page_buffer, packed_tensors
from llmd.model.loader import load_model
from test_gguf_kquant import write_kquant_gguf


def thp_offered() -> bool:
    """Whether this kernel gives huge pages to memory that asks (enabled: always or madvise, not never)."""
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = start <= address < end
            if inside:
                fields["range"] = head
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    assert inside, f"no mapping holds {address:#x}"
    return fields


def test_buffer_is_aligned_zeroed_advised_and_outlives_its_mapping_object():
    buf = huge_page_buffer(3 * HUGE_PAGE + 1000)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * HUGE_PAGE + 1000
    assert buf.data_ptr() % HUGE_PAGE == 0
    assert int(buf.sum()) == 0
    view = buf[100:200]
    del buf
    gc.collect()  # the mmap object is held by the tensors that view it, not by a name
    view.fill_(7)
    assert int(view.sum()) == 700
    if thp_offered():
        assert mapping_of(view.data_ptr())["THPeligible"] == "1"


@pytest.mark.parametrize("variant", ["untied", "tied"])
def test_gguf_model_on_cpu_has_its_packed_weights_in_one_advised_mapping(tmp_path, variant):
    path = tmp_path / f"{variant}.gguf"
    write_kquant_gguf(path, embd="Q4_K", head="Q6_K" if variant == "untied" else None, seed=3)
    loaded = load_model(path, quant="gguf", device="cpu")
    tensors = packed_tensors(loaded.model)
    assert len(tensors) >= 7  # q, k, v, o, gate, up, down per layer at least, and the token table
    starts = sorted(t.data_ptr() for t in tensors)
    base = starts[0]
    assert base % HUGE_PAGE == 0 and all(s % 64 == 0 for s in starts)
    region = mapping_of(base)
    low, high = (int(x, 16) for x in region["range"].split("-"))
    assert all(low <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= high for t in tensors)
    if thp_offered():
        assert region["THPeligible"] == "1"

    del loaded, tensors  # unloading unmaps it
    gc.collect()
    assert all(line.split()[0] != region["range"] for line in Path("/proc/self/maps").read_text().splitlines())



def test_cpu_kv_caches_are_zeroed_separate_and_advised():
    caches = allocate_kv_cache(3, 64, 16, 2, 64, torch.float32, "cpu")
    tensors = [t for kv in caches for t in kv]
    assert all(t.shape == (64, 16, 2, 64) and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
    assert all(int(t.count_nonzero()) == 0 for t in tensors)
    caches[1][0][5].fill_(1.0)  # one layer's K block: nothing else moves
    assert [int(t.count_nonzero()) for t in tensors] == [0, 0, 16 * 2 * 64, 0, 0, 0]
    assert tensors[0].data_ptr() % HUGE_PAGE == 0
    if thp_offered():
        assert mapping_of(tensors[-1].data_ptr())["THPeligible"] == "1"


def test_cpu_int8_kv_caches_codes_and_scales_are_zeroed_and_advised():
    (cache,) = allocate_kv_cache(1, 32, 16, 2, 64, torch.float32, "cpu", kv_cache_dtype="int8")
    assert [t.dtype for t in cache] == [torch.int8, torch.int8, torch.float32, torch.float32]
    assert [tuple(t.shape) for t in cache] == [(32, 16, 2, 64)] * 2 + [(32, 16, 2)] * 2
    assert all(int(t.count_nonzero()) == 0 and t.data_ptr() % 64 == 0 for t in cache)
    cache.k_scale.fill_(0.5)
    assert [int(t.count_nonzero()) for t in cache] == [0, 0, 32 * 16 * 2, 0]
    if thp_offered():
        assert mapping_of(cache.v_scale.data_ptr())["THPeligible"] == "1"
