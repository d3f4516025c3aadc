"""kernels/huge_pages.py: the weights a CPU decode step streams, copied into 2 MiB-page mappings."""

import gc

import pytest
import torch

from optkit.kernels import cpu_w4a8, huge_pages
from optkit.kernels.w8a8 import W8A8Linear

needs_huge_pages = pytest.mark.skipif(bool(huge_pages.unavailable_reason()), reason=huge_pages.unavailable_reason())


def mapping_of(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps fields of the mapping holding `address` (None where none does)."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
                if inside:
                    return fields
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields if inside else None


@needs_huge_pages
def test_a_copy_has_the_values_and_lies_in_a_mapping_advised_for_huge_pages():
    t = torch.randn(300, 77).t()  # not contiguous
    placed = huge_pages.copy_in(t)
    assert torch.equal(placed, t) and placed.dtype == t.dtype and placed.is_contiguous()
    assert placed.data_ptr() % huge_pages.ALIGN == 0
    fields = mapping_of(placed.data_ptr())
    if fields is None or "THPeligible" not in fields:
        pytest.skip("this kernel's smaps does not say whether a mapping may take huge pages")
    assert fields["THPeligible"] == "1"


@needs_huge_pages
def test_copies_lie_next_to_each_other_in_the_order_they_were_made():
    first = huge_pages.copy_in(torch.ones(1000, dtype=torch.uint8))
    second = huge_pages.copy_in(torch.ones(10, dtype=torch.float32))
    if second.data_ptr() != first.data_ptr() + 1024:  # the first ended a mapping: the pair has to start one
        first = huge_pages.copy_in(torch.ones(1000, dtype=torch.uint8))
        second = huge_pages.copy_in(torch.ones(10, dtype=torch.float32))
    assert second.data_ptr() == first.data_ptr() + 1024  # 1000 bytes, then the next cache line


@needs_huge_pages
def test_a_copy_outlives_the_arena_moving_on_and_its_mapping_goes_with_the_last_copy():
    filling = torch.zeros(huge_pages.CHUNK + 1, dtype=torch.uint8)
    huge_pages.copy_in(filling)  # a mapping of its own, full: the next copy starts a new one
    placed = huge_pages.copy_in(torch.arange(1000, dtype=torch.int32))  # alone in its mapping
    address = placed.data_ptr()
    huge_pages.copy_in(filling)  # no room left beside `placed`: the arena maps anew
    gc.collect()
    assert torch.equal(placed, torch.arange(1000, dtype=torch.int32))  # still readable, unchanged
    assert mapping_of(address) is not None
    del placed
    gc.collect()
    assert mapping_of(address) is None  # unmapped: nothing leaks


def test_off_by_the_environment_a_copy_is_the_plain_contiguous_tensor(monkeypatch):
    monkeypatch.setenv("OPTKIT_HUGE_PAGES", "0")
    huge_pages.unavailable_reason.cache_clear()
    try:
        t = torch.randn(4, 6)
        assert huge_pages.unavailable_reason() == "OPTKIT_HUGE_PAGES=0"
        assert huge_pages.copy_in(t) is t  # already contiguous: no copy
        assert huge_pages.copy_in(t.t()).is_contiguous()
    finally:
        monkeypatch.delenv("OPTKIT_HUGE_PAGES")
        huge_pages.unavailable_reason.cache_clear()


@needs_huge_pages
@pytest.mark.skipif(bool(cpu_w4a8.unavailable_reason()), reason=cpu_w4a8.unavailable_reason() or "runs")
def test_a_w4a8_layout_lies_in_huge_pages_and_computes_what_it_did_in_plain_pages(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (40, 128), generator=gen, dtype=torch.int8)
    scale = torch.rand(40, 2, generator=gen).bfloat16().float()
    zero = torch.zeros(40, 2, dtype=torch.int8)
    x = torch.randn(3, 128, generator=gen)
    placed = cpu_w4a8.pack(q, scale, zero, 4)
    assert mapping_of(placed.weight.data_ptr()).get("THPeligible", "1") == "1"
    monkeypatch.setenv("OPTKIT_HUGE_PAGES", "0")
    huge_pages.unavailable_reason.cache_clear()
    try:
        plain = cpu_w4a8.pack(q, scale, zero, 4)
    finally:
        monkeypatch.delenv("OPTKIT_HUGE_PAGES")
        huge_pages.unavailable_reason.cache_clear()
    assert torch.equal(placed.weight, plain.weight) and torch.equal(placed.params, plain.params)
    assert torch.equal(cpu_w4a8.w4a8_linear(x, placed), cpu_w4a8.w4a8_linear(x, plain))


@needs_huge_pages
def test_a_w8a8_layer_prepared_on_the_cpu_keeps_its_weight_column_major_in_huge_pages():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (48, 64), generator=gen, dtype=torch.int8)
    layer = W8A8Linear(weight, torch.rand(48, generator=gen) * 0.01 + 1e-3)
    x = torch.randn(2, 64)
    before = layer(x)
    layer.prepare()
    assert torch.equal(layer.weight_t, weight.t()) and layer.weight_t.stride(0) == 1  # [in, out], column-major
    assert mapping_of(layer.weight_t.data_ptr()).get("THPeligible", "1") == "1"
    assert torch.equal(layer(x), before)
