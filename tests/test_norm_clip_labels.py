"""norm_clip's --variants names are the labels its rows carry (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from benchmarks import norm_clip

pytestmark = pytest.mark.mcore


def test_the_megatron_spans_rows_are_asked_for_by_their_label(capsys):
    args = norm_clip.parse_args(["--device", "cuda", "--variants", "flat,flat/megatron_spans"])
    assert args.variants == "flat,flat/megatron_spans"
    norm_clip.parse_args(["--device", "cpu"])  # all variants: the CUDA-only one is skipped
    assert "skipping ['flat/megatron_spans']: CUDA only" in capsys.readouterr().err


def test_an_unknown_variant_lists_the_labels(capsys):
    with pytest.raises(SystemExit):
        norm_clip.parse_args(["--device", "cuda", "--variants", "flat_megatron"])
    assert "flat/megatron_spans" in capsys.readouterr().err
