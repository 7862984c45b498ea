"""The one seam to megatron-core: the table, the checks at import, and that nothing else
in megatron_ext reaches megatron-core around it."""

import ast
import dataclasses
import importlib
import inspect
import re
import sys
import textwrap
import types
from pathlib import Path

import pytest

import megatron_ext
from megatron_ext import seam
from megatron_ext.offload import HostMirrorHybridOptimizer
from megatron_ext.offload.forward_waits import ForwardWaits
from megatron_ext.optimizer import FlatChainedOptimizer, FlatNormOptimizer

pytestmark = pytest.mark.mcore

PACKAGE = Path(megatron_ext.__file__).parent


def fresh_check():
    return seam.check.__wrapped__()


def test_the_installed_version_passes_every_entry():
    version = fresh_check()
    assert seam.supports(version)
    assert seam.check_deferred.__wrapped__() == version


@pytest.mark.parametrize(
    "text, release, pre, dev, local",
    [
        ("0.19.2+138362d", (0, 19, 2), None, None, "138362d"),
        ("0.20.0rc5", (0, 20, 0), ("rc", 5), None, None),
        ("0.18.2.dev0", (0, 18, 2), None, 0, None),
        ("0.20.0a1", (0, 20, 0), ("a", 1), None, None),
        ("0.18.2", (0, 18, 2), None, None, None),
        ("0.20", (0, 20, 0), None, None, None),
    ],
)
def test_version_parsing_keeps_pre_release_dev_and_local_parts(text, release, pre, dev, local):
    v = seam.parse_version(text)
    assert v[:3] == release and v[:2] == release[:2]
    assert (v.pre, v.dev, v.local) == (pre, dev, local)
    assert str(v) == text or text == "0.20"


def test_versions_are_ordered_as_pep_440_orders_them():
    texts = ["0.18.2.dev0", "0.18.2rc1", "0.18.2", "0.18.2+abc", "0.19.0", "0.20.0.dev3",
             "0.20.0a1", "0.20.0rc0", "0.20.0rc5", "0.20.0", "0.20.1.dev0"]  # fmt: skip
    parsed = [seam.parse_version(t) for t in texts]
    assert sorted(reversed(parsed)) == parsed
    assert all(a < b for a, b in zip(parsed, parsed[1:], strict=False))


def test_an_unparsable_version_is_one_clear_error():
    with pytest.raises(seam.MegatronCoreMismatchError, match=r"'0\.19\.x'.*not a PEP 440"):
        seam.parse_version("0.19.x")


@pytest.mark.parametrize(
    "text, supported",
    [
        ("0.18.2", True), ("0.18.2+abc", True), ("0.19.2+fff5d5b", True),
        ("0.20.0rc5", True), ("0.20.0a1", True), ("0.20.0.dev0", True), ("0.20.0", True),
        ("0.20.0+abc", True),  # a local build of the last version (pyproject's <= agrees)
        ("0.18.2.dev0", False), ("0.18.2rc1", False), ("0.18.1", False),  # before 0.18.2
        ("0.20.1.dev0", False), ("0.20.1", False), ("0.21.0rc0", False),
    ],
)  # fmt: skip
def test_the_supported_range_reads_as_the_pyproject_pins_do(text, supported):
    from packaging.specifiers import SpecifierSet

    pins = SpecifierSet(">=0.18.2,<=0.20.0")
    assert pins.contains(text, prereleases=True) == supported  # the oracle: PEP 440's rules
    assert seam.supports(seam.parse_version(text)) == supported


def test_a_version_out_of_range_is_one_clear_error(monkeypatch):
    for text in ["0.18.0", "0.18.2.dev0", "0.20.1", "0.21.0rc0"]:
        monkeypatch.setattr(seam, "installed_version", lambda t=text: seam.parse_version(t))
        pattern = rf">= 0\.18\.2, <= 0\.20\.0; the installed one is {re.escape(text)}\. "
        with pytest.raises(seam.MegatronCoreMismatchError, match=pattern):
            fresh_check()
    for text in ["0.20.0rc5", "0.19.2+abc"]:
        monkeypatch.setattr(seam, "installed_version", lambda t=text: seam.parse_version(t))
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


def test_an_instance_without_an_attribute_we_re_point_is_refused():
    entry = seam._BY_NAME["fp32 accumulation island"]
    assert entry.writes == ("extra_main_grads",) and not entry.attrs
    seam.check_instance("fp32 accumulation island", types.SimpleNamespace(extra_main_grads=[]))
    with pytest.raises(
        seam.MegatronCoreMismatchError,
        match="'fp32 accumulation island'.*a SimpleNamespace has no extra_main_grads",
    ):
        seam.check_instance("fp32 accumulation island", types.SimpleNamespace())


def test_an_attribute_we_add_that_megatron_core_now_has_is_refused(monkeypatch):
    check_against(monkeypatch, "HybridDeviceOptimizer",
                  HybridDeviceOptimizer=holder("HybridDeviceOptimizer"))  # fmt: skip
    refused(monkeypatch, "HybridDeviceOptimizer",
            r"HybridDeviceOptimizer now has offload of its own, which we add to its instances",
            HybridDeviceOptimizer=holder("HybridDeviceOptimizer", offload=None))  # fmt: skip
    # a method's entry checks the class that holds it
    entry = seam.Entry("synthetic", f"{FAKE}:Holder.method", "call", "calls it", "test",
                       params=(), adds=("mark",))  # fmt: skip
    check_against(monkeypatch, entry, Holder=holder("Holder", method=lambda self: None))
    refused(monkeypatch, entry, r"Holder.method now has mark of its own",
            Holder=holder("Holder", method=lambda self: None, mark=1))  # fmt: skip


# Every module of the package, subpackages included, except the seam's own (the table and its
# signature checks): the name each check reports it by.
MODULES = sorted(
    p.relative_to(PACKAGE).as_posix()
    for p in PACKAGE.rglob("*.py")
    if p.name not in ("seam.py", "seam_signatures.py")
)

# Call sites the checks below refuse today, in code owned elsewhere: module -> why. Each is
# an expected failure (strict: it must fail until fixed, then the mark must go).
KNOWN_CALL_SITE_PROBLEMS: dict[str, str] = {}


def module_cases(known):
    return [
        pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=known[m])) if m in known else m
        for m in MODULES
    ]


@pytest.mark.parametrize("module", MODULES)
def test_only_the_seam_imports_megatron_core(module):
    offenders = []
    for node in ast.walk(ast.parse((PACKAGE / module).read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        offenders += [f"{module}: {n}" for n in names if n.split(".")[0] == "megatron"]
    assert not offenders, offenders


def test_the_seam_checks_walk_every_subpackage():
    assert "offload/hybrid.py" in MODULES and "optimizer.py" in MODULES


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
        assert e.kind is None or e.kind in seam._KINDS, e.name
        assert e.how in seam.SIGNATURES or e.params is None, e.name
        # each attribute once per entry, in one field (a read of what we add is ours; one
        # read and re-pointed is in attrs and writes)
        fields = (e.attrs, e.probes, e.writes, e.adds)
        assert all(len(set(f)) == len(f) for f in fields), e.name
        assert not set(e.attrs) & set(e.probes), e.name
        assert not set(e.adds) & {*e.attrs, *e.probes, *e.writes}, e.name


# -- every entry checked against a fake megatron-core whose signature changed ---------------
# Each test points a real entry of the table (its params, kind and returns) at a fake module
# that mimics megatron-core 0.19.2's target with one change, and checks the error names the
# entry and the change. The unchanged fake passes, so each failure is the change's.

FAKE = "fake_megatron_core"
V = seam.parse_version("0.19.2")


def check_against(monkeypatch, entry_name, **members):
    """Check entry ``entry_name`` against a fake module holding ``members``."""
    entry = seam._BY_NAME[entry_name] if isinstance(entry_name, str) else entry_name
    module = types.ModuleType(FAKE)
    vars(module).update(members)
    monkeypatch.setitem(sys.modules, FAKE, module)
    fake = dataclasses.replace(entry, target=f"{FAKE}:{entry.target.partition(':')[2]}")
    seam._check_entries([fake], V)


def refused(monkeypatch, entry_name, *patterns, **members):
    with pytest.raises(seam.MegatronCoreMismatchError) as e:
        check_against(monkeypatch, entry_name, **members)
    text = str(e.value)
    name = entry_name if isinstance(entry_name, str) else entry_name.name
    assert f"touch point {name!r}" in text, text
    for pattern in patterns:
        assert re.search(pattern, text), (pattern, text)
    return text


def holder(name, **methods):
    return type(name, (), methods)


# megatron-core 0.19.2's DistributedOptimizer._build_model_and_main_param_groups, and variants
def build_groups(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
    model_float16_groups = model_fp32_groups = shard_float16_groups = []
    shard_fp32_groups = shard_fp32_from_float16_groups = []
    return (
        model_float16_groups,
        model_fp32_groups,
        shard_float16_groups,
        shard_fp32_groups,
        shard_fp32_from_float16_groups,
    )


def build_groups_new_required(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config, pg):
    return build_groups(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)


def build_groups_new_optional(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config, x=1):
    return build_groups(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)


def build_groups_six(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
    model_float16_groups = model_fp32_groups = shard_float16_groups = []
    shard_fp32_groups = shard_fp32_from_float16_groups = shard_fp8_groups = []
    if config:
        return (model_float16_groups, model_fp32_groups, shard_float16_groups,
                shard_fp32_groups, shard_fp32_from_float16_groups)  # fmt: skip
    return (model_float16_groups, model_fp32_groups, shard_float16_groups, shard_fp8_groups,
            shard_fp32_groups, shard_fp32_from_float16_groups)  # fmt: skip


def build_groups_reordered(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
    model_float16_groups = model_fp32_groups = shard_float16_groups = []
    shard_fp32_groups = shard_fp32_from_float16_groups = []
    return (model_float16_groups, model_fp32_groups, shard_float16_groups,
            shard_fp32_from_float16_groups, shard_fp32_groups)  # fmt: skip


def build_groups_named(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
    groups = build_groups(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)

    def nested():
        return None  # a nested function's return is not the target's

    return groups


def distopt(build, wrap=classmethod):
    return {"DistributedOptimizer": holder("DistributedOptimizer", **{
        "_build_model_and_main_param_groups": wrap(build)})}  # fmt: skip


def test_the_wrapped_classmethod_as_megatron_core_has_it_passes(monkeypatch):
    check_against(monkeypatch, "fp32 shards as leaves", **distopt(build_groups))


@pytest.mark.parametrize(
    "wrap, kind", [(staticmethod, "staticmethod"), (lambda f: f, "method"), (property, "property")]
)
def test_a_classmethod_we_replace_that_changed_kind_is_refused(monkeypatch, wrap, kind):
    refused(monkeypatch, "fp32 shards as leaves",
            rf"_build_model_and_main_param_groups is now a {kind}, where we use a classmethod",
            **distopt(build_groups, wrap))  # fmt: skip


def test_a_new_parameter_of_a_method_we_replace_is_refused_required_or_not(monkeypatch):
    refused(monkeypatch, "fp32 shards as leaves",
            r"new required positional 'pg' parameter 5",
            **distopt(build_groups_new_required))  # fmt: skip
    # megatron-core's caller may pass a new optional argument; our replacement would not take it
    refused(monkeypatch, "fp32 shards as leaves", r"new optional positional 'x' parameter 5",
            **distopt(build_groups_new_optional))  # fmt: skip


@pytest.mark.parametrize(
    "build, pattern",
    [
        (build_groups_six, r"returns a 6-tuple \(model_float16_groups, .*shard_fp8_groups"),
        (build_groups_reordered, r"returns a 5-tuple \(.*shard_fp32_from_float16_groups, "
                                 r"shard_fp32_groups\); we index or unpack the 5-tuple"),
        (build_groups_named, r"it returns groups; we index or unpack the 5-tuple"),
    ],
)  # fmt: skip
def test_a_returned_tuple_we_index_that_changed_is_refused(monkeypatch, build, pattern):
    refused(monkeypatch, "fp32 shards as leaves", pattern, **distopt(build))


def placement(self, offload_fraction: float):
    cpu_param_groups = gpu_param_groups = gpu_params_map_cpu_copy = []
    cpu_copys_map_gpu_param = param_to_fp32_param = []
    return (cpu_param_groups, gpu_param_groups, gpu_params_map_cpu_copy,
            cpu_copys_map_gpu_param, param_to_fp32_param)  # fmt: skip


def placement_four(self, offload_fraction: float):
    cpu_param_groups = gpu_param_groups = gpu_params_map_cpu_copy = []
    cpu_copys_map_gpu_param = []
    return (cpu_param_groups, gpu_param_groups, gpu_params_map_cpu_copy,
            cpu_copys_map_gpu_param)  # fmt: skip


def test_the_tuple_our_override_returns_in_megatron_cores_place_is_checked(monkeypatch):
    def hdo(f):
        return {"HybridDeviceOptimizer": holder("HybridDeviceOptimizer",
                                                _get_sub_optimizer_param_groups=f)}  # fmt: skip

    check_against(monkeypatch, "hdo placement", **hdo(placement))
    refused(monkeypatch, "hdo placement", r"returns a 4-tuple .*the 5-tuple \(cpu_param_groups",
            **hdo(placement_four))  # fmt: skip


def megatron_optimizer(**methods):
    return {"MegatronOptimizer": holder("MegatronOptimizer", **methods)}


@pytest.mark.parametrize(
    "method, patterns",
    [
        (lambda self, clip_grad, *, group: None, [r"new required keyword-only 'group'"]),
        (lambda self, clip_grad, group=None: None, [r"new optional positional 'group'"]),
        (lambda self, clip_grad=1.0: None, [r"'clip_grad' now has a default"]),
        (lambda self, *, clip_grad: None, [r"'clip_grad' is now keyword-only"]),
        (lambda self, max_norm: None,
         [r"new required positional 'max_norm'", r"no longer takes required positional "
          r"'clip_grad'"]),
        (staticmethod(lambda clip_grad: None), [r"now a staticmethod, where we use a method"]),
    ],
)  # fmt: skip
def test_an_override_whose_target_changed_is_refused(monkeypatch, method, patterns):
    refused(monkeypatch, "clip_grad_norm", *patterns,
            **megatron_optimizer(clip_grad_norm=method))  # fmt: skip


def test_an_override_declared_without_parameters_refuses_any_new_one(monkeypatch):
    check_against(monkeypatch, "get_grad_norm", **megatron_optimizer(get_grad_norm=lambda self: 0))
    refused(monkeypatch, "get_grad_norm", r"new optional positional 'norm_type' parameter 1",
            **megatron_optimizer(get_grad_norm=lambda self, norm_type=2.0: 0))  # fmt: skip


def test_a_subclass_stands_in_for_its_base(monkeypatch):
    def ddp(init):
        return {"DistributedDataParallel": holder("DistributedDataParallel", __init__=init)}

    def f16(init):
        return {"Float16Module": holder("Float16Module", __init__=init)}

    # DistributedDataParallel: ours forwards *args/**kwargs after (config, ddp_config, module)
    check_against(
        monkeypatch,
        "DistributedDataParallel",
        **ddp(lambda self, config, ddp_config, module, new=None, *, other: None),
    )
    refused(monkeypatch, "DistributedDataParallel", r"'module' moved from position 3 to 2",
            r"'ddp_config' moved from position 2 to 3",
            **ddp(lambda self, config, module, ddp_config: None))  # fmt: skip
    # Float16Module: ours takes exactly (config, module)
    check_against(monkeypatch, "Float16Module", **f16(lambda self, config, module: None))
    refused(monkeypatch, "Float16Module", r"new optional positional 'fp8' parameter 3",
            **f16(lambda self, config, module, fp8=False: None))  # fmt: skip
    refused(monkeypatch, "Float16Module", r"is now a function, where we use a class",
            Float16Module=lambda config, module: None)  # fmt: skip


def test_a_function_we_call_checks_each_argument_we_pass(monkeypatch):
    def tensor(model_param, optim_param, prefix, **more):
        return None

    def ok(f):
        check_against(monkeypatch, "sharded optimizer tensor", make_sharded_optimizer_tensor=f)

    def bad(f, *patterns):
        refused(monkeypatch, "sharded optimizer tensor", *patterns,
                make_sharded_optimizer_tensor=f)  # fmt: skip

    ok(tensor)
    ok(lambda model_param, optim_param, prefix, replica_id=0: None)  # new optional: not ours
    ok(lambda model_param, optim_param, *, prefix: None)  # we pass prefix by keyword
    bad(
        lambda model_param, optim_param, prefix, replica_id: None,
        r"new required positional 'replica_id' parameter, which we do not pass",
    )
    bad(
        lambda model_param, optim_param, prefix, *, replica_id: None,
        r"new required keyword-only 'replica_id'",
    )
    bad(
        lambda model_param, optim_param, name: None,
        r"no parameter 'prefix', which we pass by "
        r"keyword",
        r"new required positional 'name'",
    )
    bad(
        lambda model_param, optim_param, prefix, /: None,
        r"'prefix' is now positional-only; we pass it by keyword",
    )
    bad(
        lambda param, optim_param, prefix: None,
        r"its positional parameter 1 is 'param', where we pass 'model_param'",
    )
    bad(
        lambda model_param, *, optim_param, prefix: None,
        r"it takes 1 positional parameters; we pass 'optim_param' as positional argument 2",
    )
    bad(
        lambda optim_param, model_param, prefix: None,
        r"its positional parameter 1 is 'optim_param', where we pass 'model_param'",
    )


def test_an_argument_we_pass_only_sometimes_must_keep_its_default(monkeypatch):
    entry = seam.Entry("synthetic", f"{FAKE}:f", "call", "calls f(a) or f(a, b=...)", "test",
                       params=("a", "*", "b="))  # fmt: skip
    check_against(monkeypatch, entry, f=lambda a, b=None: None)
    refused(monkeypatch, entry, r"'b' is now required; we do not always pass it",
            f=lambda a, b: None)  # fmt: skip


def test_forwarded_arguments_are_the_callers_business(monkeypatch):
    # get_megatron_optimizer(config, model_chunks, *args, **kwargs): a new required argument
    # comes from our caller, so it is no problem of ours; a reorder of what we name is.
    check_against(
        monkeypatch,
        "get_megatron_optimizer",
        get_megatron_optimizer=lambda config, model_chunks, pg_collection: None,
    )
    refused(monkeypatch, "get_megatron_optimizer",
            r"positional parameter 1 is 'model_chunks', where we pass 'config'",
            get_megatron_optimizer=lambda model_chunks, config: None)  # fmt: skip


def test_an_optional_entry_that_is_present_is_checked(monkeypatch):
    check_against(monkeypatch, "GTP duplicate rule", **{})  # absent: fine
    refused(monkeypatch, "GTP duplicate rule", r"new required positional 'group'",
            param_is_not_gtp_duplicate=lambda param, group: True)  # fmt: skip


def test_a_staticmethod_we_call_through_an_instance_must_stay_one(monkeypatch):
    def common_step(state_dict):
        return None

    check_against(
        monkeypatch,
        "common step",
        **megatron_optimizer(_extract_common_per_param_step=staticmethod(common_step)),
    )
    refused(
        monkeypatch,
        "common step",
        r"now a method, where we use a staticmethod",
        **megatron_optimizer(_extract_common_per_param_step=lambda self, state_dict: None),
    )


def test_tuples_we_unpack_from_instance_attributes_are_checked():
    good = types.SimpleNamespace(param_index_map={"p": (0, 4, 0)}, bucket_indices=[[0, 64]])
    attrs = {a: None for a in seam._BY_NAME["buffer layout"].attrs}
    seam.check_instance("buffer layout", types.SimpleNamespace(**{**attrs, **vars(good)}))
    bad = types.SimpleNamespace(**{**attrs, "param_index_map": {"p": (0, 4)},
                                   "bucket_indices": [(0, 64)]})  # fmt: skip
    with pytest.raises(seam.MegatronCoreMismatchError,
                       match=r"'buffer layout'.*param_index_map holds \(0, 4\), where we unpack "
                             r"3-tuples"):  # fmt: skip
        seam.check_instance("buffer layout", bad)


# -- the table says what our code does ------------------------------------------------------
# The checks above compare the table with megatron-core; these compare it with megatron_ext:
# every override, replacement and call site must take or pass what its entry records.


def params_of(func, drop_first=True):
    params = list(inspect.signature(func).parameters.values())
    return params[1:] if drop_first else params


def test_every_overridden_megatron_core_method_is_an_entry_that_resolves_to_it():
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import (
        ChainedOptimizer,
        Float16OptimizerWithFloat16Params,
        FP32Optimizer,
    )

    overrides = [e for e in seam.ENTRIES if e.how == "override"]
    pairs = [
        (
            FlatNormOptimizer,
            (DistributedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer),
        ),
        (FlatChainedOptimizer, (ChainedOptimizer,)),
        (HostMirrorHybridOptimizer, (HybridDeviceOptimizer,)),
    ]
    missing, seen = [], set()
    for mixin, bases in pairs:
        for name, value in vars(mixin).items():
            if name.startswith("__") or not callable(value):
                continue
            for base in bases:
                if not hasattr(base, name):
                    continue
                hits = [e for e in overrides if seam._resolve(e) is getattr(base, name)]
                if not hits:
                    missing.append(f"{mixin.__name__}.{name} over {base.__name__}.{name}")
                seen.update(e.name for e in hits)
    assert not missing, f"overrides without a seam entry that resolves to them: {missing}"
    assert seen == {e.name for e in overrides}, "override entries that override nothing"


# Where our code does not take everything megatron-core's callers may pass (reported; the fix
# belongs to the file named): entry -> the problem, exactly as the check words it.
KNOWN_STAND_IN_GAPS: dict = {}  # none today: every stand-in takes what its target takes


def test_our_overrides_take_what_megatron_core_passes():
    mixins = (FlatNormOptimizer, FlatChainedOptimizer, HostMirrorHybridOptimizer)
    # each target class's overrides come from one mixin (several override ``step``)
    owner = {"ChainedOptimizer": (FlatChainedOptimizer,)}
    owner["HybridDeviceOptimizer"] = (HostMirrorHybridOptimizer,)
    gaps = {}
    for entry in (e for e in seam.ENTRIES if e.how == "override"):
        cls_name, attr = entry.target.split(":", 1)[1].rsplit(".", 1)
        ours = [vars(m)[attr] for m in owner.get(cls_name, mixins) if attr in vars(m)]
        assert ours, entry.name
        for func in ours:
            problems = seam._stand_in_problems(seam._spec(entry.params), params_of(func))
            if problems:
                gaps[entry.name] = problems
    assert gaps == KNOWN_STAND_IN_GAPS


def our_stand_ins():
    """Our code that megatron-core calls in place of each replace/wrap/subclass target."""
    from megatron_ext import ddp, fp32, optimizer, train
    from megatron_ext.config import DistributedDataParallelConfig

    install = importlib.import_module("megatron_ext.install")  # the package exports install()

    with optimizer._fp32_shards_as_leaves():
        build = optimizer.DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]
    # the overlapped offload step's wrapper, as it puts it on a bucket group
    group = types.SimpleNamespace(start_param_sync=lambda force_sync=False: None)
    waits = ForwardWaits.__new__(ForwardWaits)
    waits.wrapped = []
    waits._wrap(group)
    out = {
        "bucket group param sync": group.start_param_sync,
        "DistributedDataParallel": ddp.DistributedDataParallel.__init__,
        "Float16Module": fp32.Float16Module.__init__,
        "fp32 shards as leaves": build.__func__,  # drop cls
        "get_grad_norm_fp32": install.get_grad_norm_fp32,
        "clip_grad_by_total_norm_fp32": install.clip_grad_by_total_norm_fp32,
        "DistributedDataParallelConfig": DistributedDataParallelConfig,
    }
    if seam.installed_version()[:2] >= (0, 19):  # Megatron-LM's training loop
        args = types.SimpleNamespace(log_interval=1)
        options = train.TrainOptions.from_args(
            types.SimpleNamespace(
                per_dtype_grad_buffers=True, keep_in_fp32_params=None, log_per_layer_grad_norm=False
            )  # fmt: skip
        )
        built = train._BuildRecord()
        out |= {
            "training args": train._parse_then_enable(lambda **kw: None, train.TrainingPatches()),
            "training DDP config": DistributedDataParallelConfig,
            "training DDP": ddp.DistributedDataParallel.__init__,
            "training optimizer": train._checked_optimizer(options, built),
            "training fp32 islands": train._keeping_fp32(lambda *a: None, ("x",), built),
            "training step": train._logging_per_layer(lambda *a, **k: None, args),
            "dataset helpers build": train._unless_prebuilt(seam.target("dataset helpers build")),
        }
    return out


def test_our_replacements_take_what_megatron_core_passes():
    ours = our_stand_ins()
    version = seam.installed_version()
    kinds = ("replace", "wrap", "subclass")
    for entry in (e for e in seam.ENTRIES if e.how in kinds and seam._applies(e, version)):
        assert entry.name in ours, f"no stand-in listed for {entry.name!r}"
        if entry.params is None:
            continue
        func = ours[entry.name]
        drop = inspect.isfunction(func) and "." in func.__qualname__.split("<locals>.")[-1]
        drop = drop or entry.name == "fp32 shards as leaves"
        problems = seam._stand_in_problems(seam._spec(entry.params), params_of(func, drop))
        assert not problems, (entry.name, problems)


def _entry_calls(tree: ast.AST):
    """(entry, call node, unbound) for every call of a megatron-core target in ``tree``.

    Found: ``seam.target/optional("name")(...)`` and names bound to those; ``x.method(...)``
    where an entry of ``how`` call or override targets a method of that name;
    ``x._flat_base.method(self, ...)`` (unbound: the first argument is ``self``).
    """
    methods = {}
    for e in seam.ENTRIES:
        qual = e.target.partition(":")[2]
        if e.params is not None and "." in qual and e.how in ("call", "override"):
            methods.setdefault(qual.rsplit(".", 1)[1], []).append(e)

    def looked_up(node):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("target", "optional")
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "seam"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            return seam._BY_NAME[node.args[0].value]
        return None

    def own_nodes(scope):  # the nodes of a scope, not of the functions defined in it
        todo = list(ast.iter_child_nodes(scope))
        while todo:
            node = todo.pop()
            yield node
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                todo.extend(ast.iter_child_nodes(node))

    # the base-class names of the class each method is defined in: super().name(...) there
    # calls the entry of that base's method, not every entry of a method of that name
    bases_of: dict[int, set[str]] = {}
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef):
            names = {b.id for b in cls.bases if isinstance(b, ast.Name)}
            for item in cls.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    bases_of[id(item)] = names

    def is_super(node) -> bool:
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "super"
        )

    def walk(scope, outer, bases=frozenset()):
        bases = bases_of.get(id(scope), bases)
        aliases = dict(outer)
        if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            for a in ast.walk(scope.args):
                if isinstance(a, ast.arg):
                    aliases.pop(a.arg, None)
        nodes = list(own_nodes(scope))
        for node in nodes:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                e = looked_up(node.value)
                if e is not None and isinstance(node.targets[0], ast.Name):
                    aliases[node.targets[0].id] = e
        for node in nodes:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from walk(node, aliases, bases)
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            e = looked_up(f)
            if e is None and isinstance(f, ast.Name):
                e = aliases.get(f.id)
            if e is not None:
                if e.params is not None:
                    yield e, node, "." in e.target.partition(":")[2] and e.kind is None
                continue
            if isinstance(f, ast.Attribute) and f.attr in methods:
                unbound = isinstance(f.value, ast.Attribute) and f.value.attr == "_flat_base"
                candidates = methods[f.attr]
                if is_super(f.value) and bases:
                    owned = [e for e in candidates if _target_class(e) in bases]
                    candidates = owned or candidates
                for e in candidates:
                    yield e, node, unbound

    yield from walk(tree, {})


def _target_class(entry) -> str:
    """The class of a method entry's target (``module:Class.method`` -> ``Class``)."""
    return entry.target.partition(":")[2].rsplit(".", 1)[0].rsplit(".", 1)[-1]


def _call_problem(entry, node: ast.Call, unbound: bool) -> str | None:
    spec = seam._spec(entry.params)
    args = node.args[1:] if unbound else node.args
    n = sum(not isinstance(a, ast.Starred) for a in args)
    star = any(isinstance(a, ast.Starred) for a in args)
    kw = {k.arg for k in node.keywords if k.arg is not None}
    dstar = any(k.arg is None for k in node.keywords)
    if entry.how == "call":  # the call must be the one the entry records
        P = inspect.Parameter
        positional = [p for p in spec if p.kind == P.POSITIONAL_OR_KEYWORD]
        required = sum(p.default is P.empty for p in positional)
        keywords = {p.name for p in spec if p.kind == P.KEYWORD_ONLY}
        needed = {p.name for p in spec if p.kind == P.KEYWORD_ONLY and p.default is P.empty}
        forwards = (any(p.kind == P.VAR_POSITIONAL for p in spec),
                    any(p.kind == P.VAR_KEYWORD for p in spec))  # fmt: skip
        fits = required <= n <= len(positional) and needed <= kw <= keywords
        if fits and (star, dstar) == forwards:
            return None
        return f"passes {n} positional{' and *args' if star else ''}, keywords {sorted(kw)}"
    try:  # a call of megatron-core's method that we override: it must bind to its signature
        sig = inspect.Signature(spec)
        bind = sig.bind_partial if star or dstar else sig.bind
        bind(*range(n), **dict.fromkeys(kw))
    except TypeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("module", module_cases(KNOWN_CALL_SITE_PROBLEMS))
def test_every_call_site_passes_what_its_entry_records(module):
    wrong = []
    for entry, node, unbound in _entry_calls(ast.parse((PACKAGE / module).read_text())):
        problem = _call_problem(entry, node, unbound)
        if problem is not None:
            wrong.append(f"{module}:{node.lineno} {entry.name!r} "
                         f"({', '.join(entry.params)}): {problem}")  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_every_call_entry_has_a_call_site():
    found = set()
    for module in MODULES:
        found.update(e.name for e, _, _ in _entry_calls(ast.parse((PACKAGE / module).read_text())))
    called = {e.name for e in seam.ENTRIES if e.how == "call" and e.params is not None}
    assert called <= found, f"call entries with no call site found: {called - found}"


def test_a_parameter_our_wrapper_reads_by_name_is_checked_though_it_forwards(monkeypatch):
    # train_step(..., *rest, **kwargs) forwards everything but reads kwargs["iteration"]
    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                   config, forward_backward_func, iteration=None, pg_collection=None):  # fmt: skip
        return None

    def renamed(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                config, forward_backward_func, step=None):  # fmt: skip
        return None

    check_against(monkeypatch, "training step", train_step=train_step)
    refused(monkeypatch, "training step", r"no longer takes optional positional 'iteration'",
            train_step=renamed)  # fmt: skip


def test_super_calls_are_checked_against_the_base_classes_entry():
    """``super().step(closure)`` in a subclass of ``HybridDeviceOptimizer`` is that class's
    ``step`` (``closure=``), not ``ChainedOptimizer.step`` (no arguments); a wrong call
    there is still caught, and a super call in a class of no known base is checked against
    every entry of that name."""
    source = textwrap.dedent(
        """
        class Mine(HybridDeviceOptimizer):
            def step(self, closure=None):
                return super().step(closure)

        class Wrong(HybridDeviceOptimizer):
            def step(self, closure=None):
                return super().step(closure, 1, 2)

        class Unknown(Something):
            def step(self, closure=None):
                return super().step(closure)
        """
    )
    problems = {}
    for entry, node, unbound in _entry_calls(ast.parse(source)):
        problems.setdefault(node.lineno, []).append(
            (entry.name, _call_problem(entry, node, unbound))
        )
    assert problems[4] == [("hdo step", None)]
    assert [name for name, _ in problems[8]] == ["hdo step"] and problems[8][0][1]
    unknown = dict(problems[12])
    assert unknown["hdo step"] is None and unknown["chained step"] is not None
