"""megatron_ext.train's flags: pattern splitting, the argparse group, name matching, refusals."""

import argparse

import pytest
import torch

from megatron_ext import train
from megatron_ext.fp32 import is_keep_in_fp32

pytestmark = pytest.mark.mcore


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


def test_delayed_update_flags_reach_the_options():
    args = parser().parse_args(["--offload-delayed-update", "--offload-delay-warmup", "3"])
    options = train.TrainOptions.from_args(args)
    assert options.on
    assert options.offload_flags == ["--offload-delayed-update", "--offload-delay-warmup 3"]
    got = options.megatron_options()
    assert (got.offload_delayed_update, got.offload_delay_warmup) == (True, 3)
    assert not got.offload_pin_threads
    pinned = train.TrainOptions.from_args(
        parser().parse_args(["--offload-delayed-update", "--offload-pin-threads"])
    )
    assert pinned.offload_flags == ["--offload-delayed-update", "--offload-pin-threads"]
    assert pinned.megatron_options().offload_pin_threads
    zero = train.TrainOptions.from_args(
        parser().parse_args(["--offload-delayed-update", "--offload-delay-warmup", "0"])
    )
    assert zero.megatron_options().offload_delay_warmup == 0
    with pytest.raises(SystemExit):
        parser().parse_args(["--offload-delay-warmup", "-1"])
    with pytest.raises(train.UnsupportedTrainingOptionError, match="needs --per-dtype-grad"):
        train.enable(args)


def test_the_overlap_flag_reaches_the_options_and_refuses_readers_after_the_step():
    args = parser().parse_args(["--offload-overlap-forward"])
    options = train.TrainOptions.from_args(args)
    assert options.on and options.offload_flags == ["--offload-overlap-forward"]
    assert options.megatron_options().offload_overlap_forward
    assert not train.TrainOptions.from_args(parser().parse_args([])).offload_overlap_forward
    with pytest.raises(train.UnsupportedTrainingOptionError, match="needs --per-dtype-grad"):
        train.enable(args)
    on = ["--per-dtype-grad-buffers", "--offload-overlap-forward"]
    for extra, named in (
        (dict(log_params_norm=True), "--log-params-norm"),
        (
            dict(check_weight_hash_across_dp_replicas_interval=5),
            "--check-weight-hash-across-dp-replicas-interval 5",
        ),
    ):
        args = parser().parse_args(on)
        vars(args).update(extra)
        with pytest.raises(train.UnsupportedTrainingOptionError, match=named):
            train.enable(args)
    with pytest.raises(ValueError, match="choose one"):
        train.TrainOptions.from_args(
            parser().parse_args(on + ["--offload-delayed-update"])
        ).megatron_options()


def test_offload_flags_parse_and_need_the_buffers(capsys):
    default = train.TrainOptions.from_args(parser().parse_args([]))
    # a flag not given is None: MegatronOptions holds its default, declared once
    assert (default.offload_step, default.offload_threads, default.on) == (None, None, False)
    assert default.megatron_options() == train_options(offload_step="chunked")
    assert not default.offload_delayed_update and default.offload_delay_warmup is None
    assert default.megatron_options().offload_delay_warmup == 10
    args = parser().parse_args(["--offload-step", "per_parameter", "--offload-threads", "6"])
    options = train.TrainOptions.from_args(args)
    assert options.on
    assert options.offload_flags == ["--offload-step per_parameter", "--offload-threads 6"]
    got = options.megatron_options()
    assert (got.offload_step, got.offload_threads, got.host_mirrors) == ("per_parameter", 6, True)
    with pytest.raises(train.UnsupportedTrainingOptionError, match="needs --per-dtype-grad"):
        train.enable(args)
    device = train.TrainOptions.from_args(parser().parse_args(["--offload-convert", "device"]))
    assert device.on
    assert device.offload_flags == ["--offload-convert device"]
    assert device.megatron_options().offload_convert == "device"
    assert default.megatron_options().offload_convert == "host"
    for bad, why in (
        (["--offload-convert", "gpu"], "invalid choice: 'gpu'"),
        (["--offload-threads", "0"], "0 is not positive"),
        (["--offload-threads", "x"], "'x' is not an integer"),
        (["--offload-step", "fast"], "invalid choice: 'fast'"),
    ):
        with pytest.raises(SystemExit):
            parser().parse_args(bad)
        assert why in capsys.readouterr().err


def train_options(**kw):
    from megatron_ext import MegatronOptions

    return MegatronOptions(**kw)


def test_per_layer_flag_parses_and_needs_the_buffers():
    args = parser().parse_args(["--log-per-layer-grad-norm"])
    options = train.TrainOptions.from_args(args)
    assert options.log_per_layer_grad_norm and options.on
    assert not train.TrainOptions.from_args(parser().parse_args([])).log_per_layer_grad_norm
    with pytest.raises(train.UnsupportedTrainingOptionError, match="needs --per-dtype-grad"):
        train.enable(args)


@pytest.mark.parametrize(
    ("name", "layer"),
    [
        ("module.module.decoder.layers.11.self_attention.linear_qkv.weight", "decoder.layers.11"),
        ("decoder.layers.0.mlp.experts.local_experts.7.linear_fc1.weight", "decoder.layers.0"),
        ("module.embedding.word_embeddings.weight", "embedding.word_embeddings"),
        ("module.decoder.final_layernorm.weight", "decoder.final_layernorm"),
        ("module.output_layer.weight", "output_layer"),
        ("mtp.layers.0.enorm.weight", "mtp.layers.0"),
        ("bias", "bias"),
    ],
)
def test_parameters_are_grouped_by_layer_else_by_owning_module(name, layer):
    assert train.layer_of(name) == layer


class FakeWriter:
    def __init__(self):
        self.scalars, self.logged = [], []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def log(self, values, step):
        self.logged.append((values, step))


def fake_norms(seed=0):
    """ParamNorms over random per-parameter norms, and the fp64 per-layer reference."""
    from buffers.param_norms import ParamNorms

    names = (
        "module.embedding.word_embeddings.weight",
        "module.decoder.layers.0.self_attention.linear_qkv.weight",
        "module.decoder.layers.0.mlp.router.weight",
        "module.decoder.layers.1.self_attention.linear_qkv.weight",
        "module.decoder.layers.1.input_layernorm.weight",
        "module.output_layer.weight",
    )
    norms = torch.rand(len(names), generator=torch.Generator().manual_seed(seed)) * 3
    want: dict[str, float] = {}
    for n, v in zip(names, norms.double().tolist(), strict=True):
        key = n.removeprefix("module.").split(".self_attention")[0].split(".mlp")[0]
        key = key.split(".input_layernorm")[0].removesuffix(".weight")
        want[key] = want.get(key, 0.0) + v * v
    want = {k: v**0.5 for k, v in want.items()}
    total = norms.double().square().sum().sqrt().float()
    return ParamNorms(total, norms, names, (True,) * len(names), 2.0), want


def test_per_layer_values_reach_console_tensorboard_and_wandb(monkeypatch, capsys):
    tb, wb = FakeWriter(), FakeWriter()
    real = train.seam.target
    fakes = {"training tensorboard": lambda: tb, "training wandb": lambda: wb}
    monkeypatch.setattr(train.seam, "target", lambda name: fakes.get(name) or real(name))
    norms, want = fake_norms()
    values = train.log_per_layer(norms, 10, {})
    assert list(values) == list(want)  # layers in the order they first appear
    for k, v in want.items():
        assert values[k] == pytest.approx(v, rel=1e-6)
    assert [(t, s) for t, _, s in tb.scalars] == [(f"per-layer grad norm/{k}", 10) for k in want]
    assert wb.logged[0][1] == 10 and set(wb.logged[0][0]) == {
        f"per-layer grad norm/{k}" for k in want
    }
    line = capsys.readouterr().out
    assert line.startswith(" per-layer grad norm | iteration       10 | ")
    assert f"decoder.layers.1: {want['decoder.layers.1']:.6E}" in line


def test_only_logged_iterations_request_per_parameter_norms(monkeypatch, capsys):
    monkeypatch.setattr(
        train.seam, "target", lambda name: (lambda: None) if "training " in name else None
    )

    class Optimizer:
        def __init__(self):
            self.requests, self.pending, self.kept = [], False, None

        def request_per_param_grad_norms(self):
            self.pending = True

        def step(self, skip):
            if self.pending and not skip:
                self.kept, self.pending = fake_norms(len(self.requests))[0], False

        def take_per_param_grad_norms(self):
            self.requests.append(self.kept is not None)
            self.pending, kept, self.kept = False, self.kept, None
            return kept

    def original(forward_step_func, data_iterator, model, optimizer, *rest, iteration=None):
        optimizer.step(skip=iteration == 9)  # an inf step: nothing kept
        return ("out", iteration)

    args = argparse.Namespace(log_interval=5)
    step = train._logging_per_layer(original, args)
    opt = Optimizer()
    for it in range(15):
        assert step(None, None, None, opt, iteration=it) == ("out", it)
    assert opt.requests == [True, False, True]  # iterations 5, 10 (skipped), 15 are logged
    out = capsys.readouterr().out
    assert out.count("per-layer grad norm |") == 2
    assert "iteration        5 |" in out and "iteration       15 |" in out


def test_the_offload_memory_flags_reach_the_options():
    """--offload-fraction auto with a headroom, and a host budget, given as sizes."""
    args = parser().parse_args(
        [
            "--offload-fraction",
            "auto",
            "--offload-gpu-headroom",
            "1.5GiB",
            "--offload-host-bytes",
            "100G",
        ]
    )
    got = train.TrainOptions.from_args(args).megatron_options()
    assert (got.offload_fraction, got.offload_gpu_headroom, got.offload_host_bytes) == (
        "auto",
        3 * 2**29,
        100 * 2**30,
    )
    assert train.byte_size("4096") == 4096 and train.byte_size("512MiB") == 512 * 2**20
    assert train.byte_size("2t") == 2 * 2**40 and train.byte_size("3 KB") == 3 * 1024
    for bad in ("ten", "10 GB extra", "-1G", "1.5X"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
            train.byte_size(bad)
    with pytest.raises(SystemExit):
        parser().parse_args(["--offload-fraction", "0.5"])  # a number: Megatron-LM's flag
