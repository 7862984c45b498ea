"""The one seam to megatron-core: the table, the checks at import, and that nothing else
in megatron_ext reaches megatron-core around it."""

import ast
import types
from pathlib import Path

import pytest

import megatron_ext
from megatron_ext import seam
from megatron_ext.offload import HostMirrorHybridOptimizer
from megatron_ext.optimizer import FlatChainedOptimizer, FlatNormOptimizer

PACKAGE = Path(megatron_ext.__file__).parent


def fresh_check():
    return seam.check.__wrapped__()


def test_the_installed_version_passes_every_entry():
    version = fresh_check()
    assert seam.SUPPORTED[0] <= version[:3] <= seam.SUPPORTED[1]
    assert seam.parse_version("0.19.2+138362d") == (0, 19, 2)
    assert seam.parse_version("0.20.0rc0") == (0, 20, 0)
    assert seam.parse_version("0.18.2") == (0, 18, 2)


def test_a_version_out_of_range_is_one_clear_error(monkeypatch):
    for version, pattern in [
        ((0, 18, 0), r">= 0\.18\.2, <= 0\.20\.0; the installed one is 0\.18\.0"),
        ((0, 20, 1), r">= 0\.18\.2, <= 0\.20\.0; the installed one is 0\.20\.1"),
    ]:
        monkeypatch.setattr(seam, "installed_version", lambda v=version: v)
        with pytest.raises(seam.MegatronCoreMismatchError, match=pattern):
            fresh_check()


def test_a_missing_target_names_the_entry_and_the_version(monkeypatch):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    monkeypatch.delattr(DistributedOptimizer, "_get_model_param_range_map")
    with pytest.raises(seam.MegatronCoreMismatchError) as e:
        fresh_check()
    assert "'param range map'" in str(e.value)
    assert "_get_model_param_range_map is missing" in str(e.value)
    assert ".".join(map(str, seam.installed_version())) in str(e.value)


def test_a_changed_signature_names_the_entry(monkeypatch):
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    monkeypatch.setattr(MegatronOptimizer, "clip_grad_norm", lambda self, max_norm: None)
    with pytest.raises(seam.MegatronCoreMismatchError, match="'clip_grad_norm'.*max_norm"):
        fresh_check()


def test_an_optional_entry_may_be_absent(monkeypatch):
    from megatron.core.tensor_parallel import layers

    if hasattr(layers, "param_is_not_gtp_duplicate"):
        monkeypatch.delattr(layers, "param_is_not_gtp_duplicate")
    fresh_check()
    assert seam.optional("GTP duplicate rule") is None
    with pytest.raises(ValueError, match="not an optional entry"):
        seam.optional("DistributedOptimizer")


def test_an_instance_without_an_attribute_we_read_is_refused():
    buf = types.SimpleNamespace(param_index_map={}, bucket_indices=[])
    with pytest.raises(seam.MegatronCoreMismatchError, match="'buffer layout'.*no buckets"):
        seam.check_instance("buffer layout", buf)


def test_only_the_seam_imports_megatron_core():
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "seam.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "megatron"]
    assert not offenders, offenders


def test_every_overridden_megatron_core_method_is_an_entry():
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import (
        ChainedOptimizer,
        Float16OptimizerWithFloat16Params,
        FP32Optimizer,
    )

    overrides = {e.target.rsplit(".", 1)[1] for e in seam.ENTRIES if e.how == "override"}
    pairs = [
        (
            FlatNormOptimizer,
            (DistributedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer),
        ),
        (FlatChainedOptimizer, (ChainedOptimizer,)),
        (HostMirrorHybridOptimizer, (HybridDeviceOptimizer,)),
    ]
    missing = []
    for mixin, bases in pairs:
        for name, value in vars(mixin).items():
            if name.startswith("__") or not callable(value):
                continue
            if any(hasattr(b, name) for b in bases) and name not in overrides:
                missing.append(f"{mixin.__name__}.{name}")
    assert not missing, f"overrides without a seam entry: {missing}"


def test_the_table_describes_every_entry():
    text = seam.describe()
    assert len(text.splitlines()) == len(seam.ENTRIES)
    assert len({e.name for e in seam.ENTRIES}) == len(seam.ENTRIES)
    for e in seam.ENTRIES:
        assert e.how in {"subclass", "override", "class swap", "wrap", "replace", "re-point",
                         "read", "call"}, e.name  # fmt: skip
        assert e.change and e.why, e.name
