"""megatron_ext.train's flags: pattern splitting, the argparse group, name matching, refusals."""

import argparse

import pytest
import torch

from megatron_ext import train
from megatron_ext.fp32 import is_keep_in_fp32


def parser():
    return train.add_arguments(argparse.ArgumentParser(allow_abbrev=False))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("layernorm", ["layernorm"]),
        (r"router\.weight$,final_layernorm", [r"router\.weight$", "final_layernorm"]),
        ("x{1,2},[a,b],(c|d,e)", ["x{1,2}", "[a,b]", "(c|d,e)"]),  # commas inside the regex
        (r"a\,b,c", [r"a\,b", "c"]),  # an escaped comma is the regex's
    ],
)
def test_patterns_split_at_top_level_commas(text, expected):
    assert train.split_patterns(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [("a,,b", "empty pattern"), ("ok,x[", "'x\\[' is not a regular expression")],
)
def test_a_bad_pattern_is_a_usage_error_naming_it(text, message, capsys):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        train.split_patterns(text)
    with pytest.raises(SystemExit):
        parser().parse_args(["--keep-in-fp32-params", text])
    assert "--keep-in-fp32-params" in capsys.readouterr().err


def test_flags_default_off_and_patterns_accumulate():
    args = parser().parse_args([])
    assert args.per_dtype_grad_buffers is False and args.keep_in_fp32_params == []
    assert not train.TrainOptions.from_args(args).on
    args = parser().parse_args(
        ["--per-dtype-grad-buffers", "--keep-in-fp32-params", "a,b", "--keep-in-fp32-params", "c"]
    )
    options = train.TrainOptions.from_args(args)
    assert options == train.TrainOptions(True, ("a", "b", "c"))
    assert options.on
    assert train.TrainOptions.from_args(argparse.Namespace()) == train.TrainOptions()


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = torch.nn.LayerNorm(8)
        self.linear = torch.nn.Linear(8, 8)
        self.router = torch.nn.Linear(8, 4, bias=False)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.final_layernorm = torch.nn.LayerNorm(8)


def test_marking_matches_names_with_re_search():
    model = Model()
    marked = train.mark_matching(model, [r"router\.weight$", r"^final_layernorm\.weight"])
    expected = ["layers.0.router.weight", "layers.1.router.weight", "final_layernorm.weight"]
    assert marked == expected
    for name, p in model.named_parameters():
        assert is_keep_in_fp32(p) == (name in expected), name


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (dict(use_torch_fsdp2=True), "--use-torch-fsdp2"),
        (dict(use_megatron_fsdp=True), "--use-megatron-fsdp"),
        (dict(use_custom_fsdp=True), "--use-megatron-fsdp"),
        (dict(num_distributed_optimizer_instances=2), "--num-distributed-optimizer-instances 2"),
        (dict(optimizer="muon"), "--optimizer muon"),
        (dict(use_layer_wise_distributed_optimizer=True), "--optimizer adam"),
    ],
)
def test_unsupported_combinations_are_refused_by_name(flags, named):
    args = argparse.Namespace(**{"per_dtype_grad_buffers": True, "optimizer": "adam", **flags})
    with pytest.raises(train.UnsupportedTrainingOptionError, match=named):
        train.check_supported(args)


def test_supported_combinations_pass():
    train.check_supported(
        argparse.Namespace(
            optimizer="sgd",
            use_distributed_optimizer=True,
            use_precision_aware_optimizer=True,
            optimizer_cpu_offload=True,
            num_distributed_optimizer_instances=1,
        )
    )


def test_the_script_is_found_under_megatron_lm_path(tmp_path, monkeypatch):
    (tmp_path / "pretrain_gpt.py").write_text("")
    monkeypatch.setenv("MEGATRON_LM_PATH", str(tmp_path))
    monkeypatch.chdir(tmp_path.parent)
    assert train.find_script("pretrain_gpt.py") == (tmp_path / "pretrain_gpt.py").resolve()
    with pytest.raises(SystemExit, match="fetch_megatron_lm.sh"):
        train.find_script("pretrain_bert.py")
    monkeypatch.delenv("MEGATRON_LM_PATH")
    with pytest.raises(SystemExit, match="MEGATRON_LM_PATH is not set"):
        train.find_script("pretrain_gpt.py")
