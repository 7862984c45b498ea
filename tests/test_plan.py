import pytest
import torch

from buffers.plan import ParamEntry, plan_layout
from buffers.spans import Span

BF16, FP32 = torch.bfloat16, torch.float32


def test_slots_are_aligned_and_disjoint_and_padding_is_accounted():
    entries = [
        ParamEntry(f"p{i}", (n,), BF16) for i, n in enumerate([1, 3, 63, 65, 127, 129, 1000])
    ]
    plan = plan_layout(entries, align=64)
    b = plan.buffers[BF16]
    ends = 0
    for s in b.slots:
        assert s.offset % 64 == 0 and s.offset >= ends
        ends = s.offset + s.numel
    assert b.numel % 64 == 0 and b.numel >= ends
    assert b.norm_spans == (Span(0, ends),)
    padding = sum(b.padding_in.values())
    assert padding == ends - sum(e.numel for e in entries)


def test_fp32_island_separate_buffer_in_input_order():
    entries = [
        ParamEntry("w1", (4, 8), BF16),
        ParamEntry("alpha", (8,), FP32),
        ParamEntry("w2", (8,), BF16),
        ParamEntry("sink", (3,), FP32),
    ]
    plan = plan_layout(entries, align=4)
    assert set(plan.buffers) == {BF16, FP32}
    assert [s.name for s in plan.buffers[BF16].slots] == ["w1", "w2"]
    assert [s.name for s in plan.buffers[FP32].slots] == ["alpha", "sink"]
    assert plan.buffers[FP32].slots[1].offset == 8
    assert plan.nbytes == plan.buffers[BF16].numel * 2 + plan.buffers[FP32].numel * 4


def test_counted_parameters_form_one_leading_span():
    entries = [
        ParamEntry("a", (5,), BF16, counted=False),
        ParamEntry("b", (7,), BF16),
        ParamEntry("c", (9,), BF16, counted=False),
        ParamEntry("d", (2,), BF16),
    ]
    b = plan_layout(entries, align=8).buffers[BF16]
    assert [s.name for s in b.slots] == ["b", "d", "a", "c"]
    assert b.norm_spans == (Span(0, 8 + 2),)
    assert b.scale_spans == (Span(0, b.slots[-1].offset + 9),)


def test_buffer_with_no_counted_parameter_has_no_norm_span():
    b = plan_layout([ParamEntry("a", (5,), FP32, counted=False)]).buffers[FP32]
    assert b.norm_spans == ()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int32, torch.bool])
def test_unsupported_dtype_names_the_parameter(dtype):
    with pytest.raises(TypeError, match="'layers.3.w'.*accepted dtypes"):
        plan_layout([ParamEntry("layers.3.w", (2,), dtype)])


@pytest.mark.parametrize("align", [0, -1, 1.5, True])
def test_bad_alignment(align):
    with pytest.raises(ValueError, match="align"):
        plan_layout([ParamEntry("a", (2,), FP32)], align=align)
