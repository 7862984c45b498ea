"""megatron_ext.train against Megatron-LM's real argument parsing and model-wrapping code.

Flags off: nothing of megatron.training is replaced and the DDP config is megatron-core's.
Flags on: exactly the named seam entries are replaced, and removing restores every binding.
"""

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import megatron_ext
from megatron_ext import seam, train

pytestmark = pytest.mark.mcore

if seam.installed_version()[:2] < (0, 19):
    pytest.skip(
        "megatron_ext.train patches the training loop of megatron-core >= 0.19 (0.18's "
        "megatron.training has another API and needs pyyaml); it refuses 0.18 at start-up",
        allow_module_level=True,
    )

ROOT = Path(__file__).resolve().parent.parent

# The recipe that ran on the H200 (docs/megatron-lm.md, tests/gpu/test_megatron_lm_gpu.py),
# parsed here on the CPU.
RECIPE_TEXT = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --num-layers 2 "
    "--hidden-size 256 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
    "--micro-batch-size 2 --global-batch-size 2 --train-iters 6 --lr 1e-4 --bf16 "
    "--transformer-impl local --log-interval 1 --eval-iters 0 --eval-interval 1000 "
    "--use-distributed-optimizer --clip-grad 1.0 --split 99,1,0 "
    "--no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion "
    "--no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion"
)
RECIPE = RECIPE_TEXT.split()

TRAINING_ENTRIES = [e.name for e in seam.ENTRIES if e.target.startswith(seam.DEFERRED)]
AFTER_PARSE = ("training DDP config", "training DDP", "training fp32 islands", "training optimizer")


def bindings():
    """What every training entry's binding points at now."""
    return {
        name: getattr(*seam.owner(name)) for name in TRAINING_ENTRIES if name != "dataset helpers"
    }


@pytest.fixture
def megatron_parse(monkeypatch):
    """Install, then parse Megatron-LM's arguments as pretrain_gpt.py does (its __main__)."""
    from megatron.training import global_vars

    before = bindings()
    installed = []

    def parse(*flags):
        installed.append(train.install())
        from megatron.training.arguments import parse_and_validate_args

        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *RECIPE, *flags])
        monkeypatch.setenv("RANK", "0")  # as torchrun sets it; megatron-core warns without
        with warnings.catch_warnings():
            # the recipe's --tokenizer-type overrides pretrain_gpt.py's default, as it does
            # on the GPU, and Megatron-LM says so
            warnings.filterwarnings(
                "ignore", r"Overriding default arguments for tokenizer_type", UserWarning
            )
            args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
        return args, installed[-1]

    yield parse
    for patches in installed:
        patches.remove()
    global_vars.unset_global_variables()
    assert bindings() == before


def ddp_config_of(args):
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )

    return pretrain_cfg_container_from_args(args, gpt_config_from_args(args)).ddp


def test_deferred_entries_are_not_imported_by_megatron_ext():
    code = (
        "import sys, megatron_ext; "
        "print(sorted(m for m in sys.modules if m.startswith('megatron.training')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "[]"
    assert set(TRAINING_ENTRIES) >= {*AFTER_PARSE, "training args", "dataset helpers build"}
    assert seam.check_deferred() == seam.installed_version()


def test_flags_off_is_stock(megatron_parse):
    stock = bindings()
    args, patches = megatron_parse()
    assert patches.applied == ("dataset helpers build", "training args")
    assert args.per_dtype_grad_buffers is False and args.keep_in_fp32_params == []
    now = bindings()
    for name in AFTER_PARSE:
        assert now[name] is stock[name], name
    from megatron.core.distributed import DistributedDataParallelConfig

    assert type(ddp_config_of(args)) is DistributedDataParallelConfig


def test_flag_on_builds_our_config_ddp_and_optimizer(megatron_parse):
    stock = bindings()
    args, patches = megatron_parse("--per-dtype-grad-buffers")
    assert patches.applied[2:] == ("training DDP config", "training DDP", "training optimizer")
    cfg = ddp_config_of(args)
    assert type(cfg) is megatron_ext.DistributedDataParallelConfig
    assert cfg.per_dtype_grad_buffers and cfg.use_distributed_optimizer
    now = bindings()
    assert now["training DDP"] is megatron_ext.DistributedDataParallel
    assert now["training fp32 islands"] is stock["training fp32 islands"]
    assert now["training optimizer"] is not stock["training optimizer"]
    patches.remove()
    assert bindings() == stock


def test_per_layer_logging_wraps_the_training_step(megatron_parse):
    stock = bindings()
    args, patches = megatron_parse("--per-dtype-grad-buffers", "--log-per-layer-grad-norm")
    assert patches.applied[2:] == (
        "training DDP config", "training DDP", "training optimizer", "training step"
    )  # fmt: skip
    assert bindings()["training step"] is not stock["training step"]
    patches.remove()
    assert bindings() == stock


def test_keep_in_fp32_alone_leaves_ddp_and_config_stock(megatron_parse):
    stock = bindings()
    args, patches = megatron_parse("--keep-in-fp32-params", r"router\.weight$")
    assert patches.applied[2:] == ("training fp32 islands", "training optimizer")
    now = bindings()
    assert now["training DDP"] is stock["training DDP"]
    assert now["training DDP config"] is stock["training DDP config"]
    assert not getattr(ddp_config_of(args), "per_dtype_grad_buffers", False)


def test_an_unsupported_combination_stops_the_parse(megatron_parse):
    with pytest.raises(train.UnsupportedTrainingOptionError, match="--optimizer lion"):
        megatron_parse("--per-dtype-grad-buffers", "--optimizer", "lion")


def test_a_bad_value_of_our_flags_is_left_to_megatrons_parser(megatron_parse, capsys):
    # a launcher of one's own: Megatron-LM's parser reports it as a usage error
    with pytest.raises(SystemExit) as exc:
        megatron_parse("--per-dtype-grad-buffers", "--offload-threads", "0")
    assert exc.value.code == 2
    assert "error: argument --offload-threads: 0 is not positive" in capsys.readouterr().err


def test_installing_twice_is_refused():
    patches = train.install()
    try:
        with pytest.raises(RuntimeError, match="already in effect"):
            train.install()
    finally:
        patches.remove()


def wrap_for_mixed_precision_default(patterns):
    """As megatron.training's builders, leaving the wrapper to its default."""
    from megatron.core.transformer import TransformerConfig
    from megatron.training.models import dist_utils

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True)
    chunk = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    with train.TrainingPatches() as patches:
        wrap = train._keeping_fp32(
            seam.target("training fp32 islands"), patterns, train._BuildRecord()
        )
        patches.replace("training fp32 islands", wrap)
        (wrapped,) = dist_utils._wrap_with_mp_wrapper([chunk], config)
    return wrapped


def test_the_default_wrapper_is_ours_too():
    wrapped = wrap_for_mixed_precision_default((r"^0\.",))
    assert isinstance(wrapped, megatron_ext.Float16Module)
    assert all(p.dtype == torch.float32 for p in wrapped.module[0].parameters())


def wrap_for_mixed_precision(patterns, pipeline=1):
    """Call megatron.training's mixed-precision wrapping, as its model builders do."""
    from megatron.core.transformer import TransformerConfig
    from megatron.training.models import dist_utils

    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True,
        pipeline_model_parallel_size=pipeline, pipeline_dtype=torch.bfloat16,
    )  # fmt: skip
    torch.manual_seed(0)
    chunk = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    original = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    built = train._BuildRecord()
    with train.TrainingPatches() as patches:
        wrap = train._keeping_fp32(seam.target("training fp32 islands"), patterns, built)
        patches.replace("training fp32 islands", wrap)
        (wrapped,) = dist_utils._wrap_with_mp_wrapper([chunk], config, dist_utils.Float16Module)
    return wrapped, original, built


def test_marked_parameters_stay_fp32_and_unrounded():
    wrapped, original, built = wrap_for_mixed_precision((r"^0\.",))
    assert isinstance(wrapped, megatron_ext.Float16Module)
    assert built.marked == ["0.weight", "0.bias"] and built.wrapped_chunks == 1
    for name, p in wrapped.module.named_parameters():
        if name.startswith("0."):
            assert p.dtype == torch.float32 and torch.equal(p, original[name]), name
        else:
            assert p.dtype == torch.bfloat16, name


def test_a_pattern_matching_nothing_is_an_error_with_one_pipeline_stage():
    with pytest.raises(train.UnsupportedTrainingOptionError, match="'sink' matches no parameter"):
        wrap_for_mixed_precision((r"^0\.", "sink"))
    wrapped, _, built = wrap_for_mixed_precision((r"^0\.", "sink"), pipeline=2)
    assert built.marked == ["0.weight", "0.bias"]


def test_the_optimizer_refuses_chunks_the_patches_did_not_build():
    chunks = [torch.nn.Linear(2, 2)]
    build = train._checked_optimizer(train.TrainOptions(True, ()), train._BuildRecord())
    with pytest.raises(train.UnsupportedTrainingOptionError, match="Linear were not wrapped"):
        build(None, chunks)
    build = train._checked_optimizer(train.TrainOptions(False, ("x",)), train._BuildRecord())
    with pytest.raises(train.UnsupportedTrainingOptionError, match="no parameter was marked"):
        build(None, chunks)


def test_per_layer_logging_refuses_an_optimizer_without_per_parameter_norms(monkeypatch):
    chunk = torch.nn.Linear(2, 2)
    chunk.per_dtype_grad_buffers = True

    class Chained:
        def request_per_param_grad_norms(self):
            pass

    options = train.TrainOptions(True, (), log_per_layer_grad_norm=True)
    build = train._checked_optimizer(options, train._BuildRecord())
    monkeypatch.setattr(train, "get_megatron_optimizer", lambda *a, **k: object())
    with pytest.raises(train.UnsupportedTrainingOptionError, match="not a ChainedOptimizer"):
        build(None, [chunk])
    made = Chained()
    monkeypatch.setattr(train, "get_megatron_optimizer", lambda *a, **k: made)
    assert build(None, [chunk]) is made


def test_the_offload_flags_reach_the_optimizer(monkeypatch):
    chunk = torch.nn.Linear(2, 2)
    chunk.per_dtype_grad_buffers = True
    options = train.TrainOptions(
        True,
        (),
        offload_step="chunked",
        offload_threads=3,
        offload_delayed_update=True,
        offload_delay_warmup=0,
    )
    made = []
    build = train._checked_optimizer(options, train._BuildRecord(), made)
    seen = {}
    monkeypatch.setattr(train, "get_megatron_optimizer", lambda *a, **k: seen.update(k) or "opt")
    assert build(None, [chunk], "positional", extra=1) == "opt"
    assert seen["extra"] == 1 and made == ["opt"]  # what the run drains at its end
    got = seen["options"]
    assert (got.offload_step, got.offload_threads, got.offload_delay_warmup) == ("chunked", 3, 0)
    assert got.offload_delayed_update
    described = train._describe(options)
    assert "--offload-step chunked --offload-threads 3" in described
    assert "--offload-delayed-update --offload-delay-warmup 0" in described


@pytest.mark.parametrize("makefile", [False, True])
def test_the_helpers_build_is_skipped_only_without_a_makefile(tmp_path, makefile, capsys):
    # A wheel ships the compiled helpers; a source tree (Megatron-LM main) does not.
    pytest.importorskip("megatron.core.datasets.helpers_cpp", reason="no compiled helpers here")
    (tmp_path / "utils.py").write_text("def compile_helpers():\n    return 'made'\n")
    if makefile:
        (tmp_path / "Makefile").write_text("all:\n")
    namespace = {}
    code = compile((tmp_path / "utils.py").read_text(), str(tmp_path / "utils.py"), "exec")
    exec(code, namespace)
    result = train._unless_prebuilt(namespace["compile_helpers"])()
    assert result == ("made" if makefile else None)
    assert ("skipping `make`" in capsys.readouterr().out) != makefile


FAKE_SCRIPT = """
    import json, sys
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.argument_utils import (
        gpt_config_from_args, pretrain_cfg_container_from_args)
    import megatron.training.training as training
    from megatron.training.models import dist_utils
    from sibling import VALUE  # a module beside the script, as pretrain_gpt.py imports its own

    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    ddp = pretrain_cfg_container_from_args(args, gpt_config_from_args(args)).ddp
    print("RESULT", json.dumps({
        "argv0": sys.argv[0], "sibling": VALUE,
        "ddp_config": type(ddp).__module__,
        "per_dtype": getattr(ddp, "per_dtype_grad_buffers", None),
        "ddp": dist_utils.DistributedDataParallel.__module__,
        "optimizer": training.get_megatron_optimizer.__module__,
    }))
"""


@pytest.mark.parametrize("flag", [[], ["--per-dtype-grad-buffers"]])
def test_the_entry_point_runs_a_script_as_main(tmp_path, flag):
    (tmp_path / "script.py").write_text(textwrap.dedent(FAKE_SCRIPT))
    (tmp_path / "sibling.py").write_text("VALUE = 7\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MEGATRON_LM_PATH": str(tmp_path)}
    # the entry point as `python -m megatron_ext.train` runs it, where torch reports a GPU:
    # without one, it refuses a script that parses Megatron-LM's arguments (test_entry_points)
    launcher = (
        "import sys, torch; torch.cuda.is_available = lambda: True; "
        "from megatron_ext.train import main; main(sys.argv[1:])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", launcher, "script.py", *RECIPE, *flag],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    import json

    result = json.loads(lines[0][len("RESULT ") :])
    assert result["argv0"] == str(tmp_path / "script.py") and result["sibling"] == 7
    ours = bool(flag)
    assert (result["ddp_config"] == "megatron_ext.config") == ours
    assert result["per_dtype"] is (True if ours else None)
    assert (result["ddp"] == "megatron_ext.ddp") == ours
    assert (result["optimizer"] == "megatron_ext.train") == ours


@pytest.mark.skipif(
    not os.environ.get("MEGATRON_LM_PATH"),
    reason="MEGATRON_LM_PATH is not set (scripts/fetch_megatron_lm.sh brings pretrain_gpt.py)",
)
def test_pretrain_gpt_without_a_gpu_is_refused_before_it_prints_its_arguments():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.train", "pretrain_gpt.py", *RECIPE,
         "--per-dtype-grad-buffers", "--keep-in-fp32-params", "router"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    # the script ran (its version lines; its sibling modules imported) up to its parse
    assert "> Megatron-Core version" in proc.stdout and "arguments" not in proc.stdout
    assert len(proc.stdout.splitlines()) < 10, proc.stdout[-3000:]
    last = proc.stderr.splitlines()[-1]
    assert last == f"megatron_ext.train: error: {train.NEEDS_CUDA}", proc.stderr[-3000:]


@pytest.mark.parametrize("fails", [False, True])
def test_the_run_drains_the_offloaded_update_at_its_end_and_when_it_fails(
    tmp_path, monkeypatch, capsys, fails
):
    """The entry point lands a delayed offloaded update still in flight when the script
    ends, and when it leaves by an exception (that exception is what the caller sees; a
    drain that fails then is printed, not raised over it)."""
    script = tmp_path / "pretrain_fake.py"
    script.write_text("raise RuntimeError('the loop failed')\n" if fails else "x = 1\n")
    drained = []

    def drain(opt):
        drained.append(opt)
        if fails:
            raise RuntimeError("worker failed too")
        return 1

    patches = train.TrainingPatches()
    patches.optimizers.append("opt")
    monkeypatch.setattr(train, "install", lambda: patches)
    monkeypatch.setattr(train, "drain_offload", drain)
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    if fails:
        with pytest.raises(RuntimeError, match="the loop failed"):
            train.main([str(script), "--no-gradient-accumulation-fusion"])
        assert "draining the offloaded update failed: worker failed too" in capsys.readouterr().out
    else:
        train.main([str(script), "--no-gradient-accumulation-fusion"])
    assert drained == ["opt"]
