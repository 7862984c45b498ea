"""Every place where ``megatron_ext`` reaches into megatron-core, in one table.

Each :class:`Entry` names one target in megatron-core, how we touch it (``subclass``,
``override``, ``class swap``, ``wrap``, ``replace``, ``re-point``, ``read``, ``call``),
what that changes, why, the upstream issue where there is one, and the megatron-core
versions it applies to. The rest of ``megatron_ext`` reaches megatron-core only through
:func:`target` (and :func:`optional` for what some versions lack), so this table is the
whole coupling.

:func:`check` runs when ``megatron_ext`` is imported, before anything is touched: the
installed version must lie in :data:`SUPPORTED`, and every entry that applies to it must
resolve with the parameters we rely on. A mismatch raises one
:class:`MegatronCoreMismatchError` naming the entry and the version, instead of an
``AttributeError`` inside a training step. Attributes that exist only on instances (a
gradient buffer's ``param_index_map``, an optimizer's groups) are checked by
:func:`check_instance` where the first instance appears, before its state is used.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from dataclasses import dataclass

# The megatron-core versions this library was tested on (the README's Versions section and
# pyproject.toml say the same): from the first through the last, inclusive of their
# patch releases and local builds (Megatron-LM main reports the next version's number).
# The first and last megatron-core versions tested, both inclusive (pyproject.toml pins the
# same): 0.18.2, 0.19.0 and 0.19.2 from PyPI, and Megatron-LM main at the commit in
# scripts/mcore_main.sha, which reports 0.20.0. Local build suffixes (+sha) are ignored.
SUPPORTED = ((0, 18, 2), (0, 20, 0))


class MegatronCoreMismatchError(ImportError):
    """The installed megatron-core lacks, or changed, something ``megatron_ext`` relies on."""


@dataclass(frozen=True)
class Entry:
    """One touch point with megatron-core.

    Attributes:
        name: how the code refers to it (:func:`target`).
        target: ``module:qualified.name``.
        how: ``subclass``, ``override``, ``class swap``, ``wrap``, ``replace``,
            ``re-point``, ``read`` or ``call``.
        change: what we change there (or read).
        why: the reason.
        upstream: the upstream issue or pull request, where there is one.
        since: the first megatron-core version it applies to.
        params: parameter names the target must take, in order (``self``/``cls`` left
            out); None: not a callable, or not checked.
        attrs: instance attributes read or re-pointed (checked by :func:`check_instance`).
        optional: absent in some supported versions; :func:`optional` returns None there
            and the feature adapts (the README says what is unavailable).
    """

    name: str
    target: str
    how: str
    change: str
    why: str
    upstream: str = ""
    since: tuple[int, int] = (0, 18)
    params: tuple[str, ...] | None = None
    attrs: tuple[str, ...] = ()
    optional: bool = False


_DDP = "megatron.core.distributed"
_BUF = "megatron.core.distributed.param_and_grad_buffer"
_OPT = "megatron.core.optimizer.optimizer"
_DIST = "megatron.core.optimizer.distrib_optimizer"
_HDO = "megatron.core.optimizer.cpu_offloading"
_CKPT = "megatron.core.dist_checkpointing.optimizer"

ENTRIES: tuple[Entry, ...] = (
    # -- DDP: the option, the buffers, fp32 islands --------------------------------------
    Entry("DistributedDataParallelConfig", f"{_DDP}:DistributedDataParallelConfig",
          "subclass", "adds the per_dtype_grad_buffers field and its checks",
          "the option is a DDP config field, as megatron-core's own options are",
          attrs=("use_megatron_fsdp", "num_distributed_optimizer_instances",
                 "use_distributed_optimizer")),
    Entry("DistributedDataParallel", f"{_DDP}:DistributedDataParallel",
          "subclass", "casts keep_in_fp32 parameters to fp32 before the buffers are built; "
          "records each buffer's layout; carves one fp32 island per buffer",
          "fp32 parameters need their own (fp32) gradient buffer",
          params=("config", "ddp_config", "module"),
          attrs=("buffers", "expert_parallel_buffers", "module")),
    Entry("buffer layout", f"{_BUF}:_ParamAndGradBuffer", "read",
          "reads where each parameter's gradient sits, the buckets and the shard group",
          "spans are computed once from megatron-core's own layout",
          attrs=("param_index_map", "bucket_indices", "buckets", "grad_data", "param_data",
                 "numel", "data_parallel_group", "param_dtype", "grad_dtype")),
    Entry("fp32 accumulation island", f"{_BUF}:_ParamAndGradBuffer", "re-point",
          "param.main_grad of fp32-local-accumulation parameters becomes a view of one "
          "fp32 island per buffer; buffer.extra_main_grads becomes [island]",
          "one zero and one fused norm launch per island instead of one per parameter",
          attrs=("extra_main_grads",)),
    Entry("Float16Module", "megatron.core.transformer.module:Float16Module",
          "subclass", "restores keep_in_fp32 parameters (unrounded) after the cast",
          "megatron-core 0.19 casts every parameter to bf16/fp16",
          params=("config", "module")),
    # -- optimizer construction -------------------------------------------------------------
    Entry("OptimizerConfig", "megatron.core.optimizer:OptimizerConfig", "call",
          "build_stack builds it from a mapping, use_distributed_optimizer set to agree with "
          "the DDP config", "one argument says whether the distributed optimizer is on",
          attrs=("use_distributed_optimizer", "bf16", "fp16")),
    Entry("get_megatron_optimizer", "megatron.core.optimizer:get_megatron_optimizer", "call",
          "builds the optimizers, then swaps their classes (below)",
          "same signature and return types as megatron-core's",
          params=("config", "model_chunks")),
    Entry("fp32 shards as leaves",
          f"{_DIST}:DistributedOptimizer._build_model_and_main_param_groups", "wrap",
          "during construction only: natively fp32 parameter shards become detached views",
          "megatron-core 0.19 slices them without detach(); CPU offload then raises "
          "\"can't optimize a non-leaf Tensor\"",
          params=("gbuf_ranges", "param_gbuf_map", "opt_group_ranges", "config")),
    Entry("DistributedOptimizer", f"{_DIST}:DistributedOptimizer", "class swap",
          "the instance becomes a subclass whose norm, clip, zero count, grad copy and "
          "checkpoint load read flat spans (methods below)",
          "one fused launch per buffer instead of a per-parameter list",
          attrs=("buffers", "model_float16_groups", "model_fp32_groups",
                 "shard_fp32_from_float16_groups", "shard_fp32_groups", "shard_float16_groups",
                 "model_param_gbuf_map", "gbuf_ranges", "config", "optimizer",
                 "init_state_fn")),
    Entry("param group order", f"{_DIST}:DistributedOptimizer", "re-point",
          "model_param_group_index_map re-numbered in the order of the optimizer's own param "
          "groups (fp32 parameters first, then fp16/bf16), checked against each shard's size",
          "megatron-core numbers a group's parameters in the group's order but lists its "
          "fp32 ones first in the optimizer: once a group holds both (fp32 islands), "
          "checkpoint save and load pair states with the wrong parameters (save fails: "
          "'AssertionError: (torch.Size([1024]), 512, 262656)', seen on the GPU)",
          attrs=("model_param_group_index_map", "model_float16_groups", "model_fp32_groups",
                 "optimizer")),
    Entry("distopt without TE or Apex", f"{_DIST}:HAVE_APEX_OR_TE", "read",
          "whether megatron-core's distributed optimizer reads Adam's step from torch's "
          "per-parameter state (False: neither TE nor Apex)",
          "then loading a checkpoint into a never-stepped optimizer asserts in its "
          "state_dict() ('assert len(steps) == 1', Megatron-LM --load, seen on the GPU); "
          "the state is created first, as megatron-core's own load_state_dict does next"),
    Entry("param range map", f"{_DIST}:DistributedOptimizer._get_model_param_range_map",
          "call", "reads the range of a parameter this rank owns",
          "bindings of main gradients to mirror views", params=("param",)),
    Entry("Float16OptimizerWithFloat16Params", f"{_OPT}:Float16OptimizerWithFloat16Params",
          "class swap", "as DistributedOptimizer", "as DistributedOptimizer",
          attrs=("float16_groups", "fp32_from_float16_groups", "fp32_from_fp32_groups")),
    Entry("FP32Optimizer", f"{_OPT}:FP32Optimizer", "class swap", "as DistributedOptimizer",
          "as DistributedOptimizer"),
    Entry("ChainedOptimizer", f"{_OPT}:ChainedOptimizer", "class swap",
          "norm, clip, zero count and step over every child's spans in one sequence",
          "stock takes one norm over the union of the children's gradients",
          attrs=("chained_optimizers",)),
    Entry("copy grads to main",
          f"{_OPT}:Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads",
          "override", "one copy per owned range into a preallocated fp32 mirror",
          "one allocation per parameter per step otherwise", params=()),
    Entry("distopt copy grads to main",
          f"{_DIST}:DistributedOptimizer._copy_model_grads_to_main_grads", "override",
          "as copy grads to main", "as copy grads to main", params=()),
    Entry("get_grad_norm", f"{_OPT}:MegatronOptimizer.get_grad_norm", "override",
          "the norm from flat spans", "the mixed-dtype list bug and per-step host work",
          params=()),
    Entry("clip_grad_norm", f"{_OPT}:MegatronOptimizer.clip_grad_norm", "override",
          "norm and scale from flat spans, coefficient on the device", "as get_grad_norm",
          params=("clip_grad",)),
    Entry("count_zeros", f"{_OPT}:MegatronOptimizer.count_zeros", "override",
          "zero count from flat spans", "as get_grad_norm", params=()),
    Entry("grad stats group", f"{_OPT}:MegatronOptimizer.get_grad_stats_parallel_group",
          "call", "reads the group the norm is all-reduced over", "same collectives as stock",
          params=()),
    Entry("chained get_grad_norm", f"{_OPT}:ChainedOptimizer.get_grad_norm", "override",
          "one norm over every child's spans", "as get_grad_norm", params=()),
    Entry("chained count_zeros", f"{_OPT}:ChainedOptimizer.count_zeros", "override",
          "one count over every child's spans", "as get_grad_norm", params=()),
    Entry("chained step", f"{_OPT}:ChainedOptimizer.step", "override",
          "prepare, flat norm and clip, skip logic, inner steps (as stock's)",
          "the clip runs fused with the norm", params=()),
    Entry("chained helpers", f"{_OPT}:ChainedOptimizer.grads_states_parallel_group_is_shared",
          "call", "whether one norm spans every child", "as stock decides", params=()),
    Entry("load_state_dict", f"{_OPT}:Float16OptimizerWithFloat16Params.load_state_dict",
          "override", "megatron-core's load, then one step tensor per parameter again",
          "without TE/Apex, 0.19.2 shares one step tensor between all parameters",
          params=("state_dict",)),
    Entry("distopt load_state_dict", f"{_DIST}:DistributedOptimizer.load_state_dict",
          "override", "as load_state_dict", "as load_state_dict", params=("state_dict",)),
    Entry("set main param and states",
          f"{_DIST}:DistributedOptimizer._set_main_param_and_optimizer_states", "override",
          "step always from the param groups, every other state required, copies under "
          "no_grad", "0.19.2 fails with torch's Adam in every checkpoint format",
          params=("model_param", "tensors")),
    Entry("float16 sharded_state_dict",
          f"{_OPT}:Float16OptimizerWithFloat16Params.sharded_state_dict", "override",
          "walks model parameters in the optimizer's own order",
          "0.19.2 mispairs states when fp32 and bf16 parameters share a group",
          params=("model_sharded_state_dict", "is_loading")),
    Entry("param id map", f"{_CKPT}:get_param_id_to_sharded_param_map", "call",
          "maps optimizer ids to sharded parameters", "float16 sharded_state_dict",
          params=("model_sharded_state_dict", "optim_params_iter")),
    Entry("sharded optimizer tensor", f"{_CKPT}:make_sharded_optimizer_tensor", "call",
          "wraps a main copy as a sharded tensor", "float16 sharded_state_dict",
          params=("model_param", "optim_param", "prefix")),
    Entry("optimizer state sharding", f"{_CKPT}:optim_state_to_sharding_state", "call",
          "turns optimizer state into sharded tensors", "float16 sharded_state_dict",
          params=("optim_state_dict", "id_to_sharded_param_map", "exclude_keys")),
    Entry("GTP backfill", f"{_OPT}:_backfill_gtp_sharded_param_map", "call",
          "fills GTP-remat entries of the id map", "float16 sharded_state_dict",
          since=(0, 19), optional=True),
    Entry("separate grad-norm groups", f"{_OPT}:SEPARATE_GRAD_NORM_GROUPS", "read",
          "refuses parameters tagged with a separate grad_norm_group",
          "the flat norm does not split by group yet", since=(0, 19), optional=True),
    Entry("has_grad_norm_group", f"{_OPT}:MegatronOptimizer.has_grad_norm_group", "call",
          "the globally consistent flag behind that refusal", "as above",
          since=(0, 19), params=("grad_norm_group",), optional=True),
    # -- ownership rules -------------------------------------------------------------------
    Entry("upstream mark_keep_in_fp32", "megatron.core.transformer.module:mark_keep_in_fp32",
          "call", "megatron_ext.mark_keep_in_fp32 marks through it where it exists",
          "one marking: a parameter marked either way gets an fp32 island (same attribute, "
          "keep_in_fp32)", "NVIDIA/Megatron-LM#5929", since=(0, 20), params=("tensor",),
          optional=True),
    Entry("GTP duplicate rule", "megatron.core.tensor_parallel.layers:param_is_not_gtp_duplicate",
          "call", "excludes GTP-remat duplicates from the norm, as stock does",
          "counted once across the GTP-remat axis", since=(0, 19), params=("param",),
          optional=True),
    Entry("parallel state", "megatron.core:parallel_state", "read",
          "TP/ETP/PP/EP ranks when the optimizer has no groups; the audit's ranks",
          "megatron-core's global state, only as a fallback"),
    # -- CPU offload -------------------------------------------------------------------------
    Entry("HybridDeviceOptimizer", f"{_HDO}:HybridDeviceOptimizer", "class swap",
          "gradients and parameters move through one pinned host mirror per buffer; CPU "
          "copies' .data re-pointed into it (methods below)",
          "one copy per block instead of one per parameter",
          attrs=("cpu_param_groups", "gpu_param_groups", "gpu_params_map_cpu_copy",
                 "cpu_copys_map_gpu_param", "param_to_fp32_param", "pin_cpu_grads",
                 "cpu_optimizers", "gpu_optimizer", "param_update_in_fp32",
                 "fp32_param_to_orig_param", "param_to_inner_param", "state",
                 "sub_optimizers")),
    Entry("hdo placement", f"{_HDO}:HybridDeviceOptimizer._get_sub_optimizer_param_groups",
          "override", "reuses the placement already made", "no second copy of every parameter",
          params=("offload_fraction",)),
    Entry("hdo sub-optimizers", f"{_HDO}:HybridDeviceOptimizer._init_sub_optimizers",
          "override", "builds the host mirrors after megatron-core's sub-optimizers",
          "the mirrors replace the per-parameter copies", params=()),
    Entry("hdo hooks", f"{_HDO}:HybridDeviceOptimizer._register_param_copy_back_gpu_hook",
          "override", "per-block hooks instead of per-parameter ones", "as above", params=()),
    Entry("hdo grads", f"{_HDO}:HybridDeviceOptimizer._set_sub_optimizer_grads", "override",
          "one device-to-host copy per block", "as above", params=()),
    Entry("hdo load", f"{_HDO}:HybridDeviceOptimizer._update_fp32_params_by_new_state",
          "override", "loads natively fp32 parameters too",
          "0.19.2 raises KeyError for them when loading a checkpoint", params=()),
    Entry("hdo sync after load",
          f"{_HDO}:HybridDeviceOptimizer._sync_hdo_state_to_sub_optimizers", "call",
          "after a distributed-optimizer load: sub-optimizer states and inner parameters "
          "from the loaded state; then every state tensor on its parameter's device",
          "0.19.2 syncs only for fully_sharded_model_space, and its sync tells the GPU "
          "and CPU sub-optimizers apart by class (both torch Adam without TE), moving GPU "
          "moments to the CPU: the next GPU step fails", params=()),
    Entry("hdo refresh", f"{_HDO}:HybridDeviceOptimizer.update_fp32_param_by_new_param",
          "override", "refreshes natively fp32 inner copies too", "0.19.2 skips them",
          params=()),
    # -- install(): the list functions for code without the option -----------------------
    Entry("get_grad_norm_fp32", "megatron.core.optimizer.clip_grads:get_grad_norm_fp32",
          "replace", "a dtype-safe version, in clip_grads and every module that imported it",
          "the fused list kernel reads every tensor with the first tensor's dtype",
          params=("grads_for_norm", "norm_type", "grad_stats_parallel_group")),
    Entry("clip_grad_by_total_norm_fp32",
          "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32", "replace",
          "as get_grad_norm_fp32", "as get_grad_norm_fp32",
          params=("parameters", "max_norm", "total_norm", "use_decoupled_grad")),
    Entry("dtensor helpers", "megatron.core.utils:to_local_if_dtensor", "call",
          "reads DTensor gradients through their local shards", "as stock does",
          params=("tensor",)),
    Entry("dtensor group", "megatron.core.utils:get_data_parallel_group_if_dtensor", "call",
          "the DTensors' data-parallel group", "as stock reduces over it",
          params=("tensor", "data_parallel_group")),
    # -- Megatron-LM's training loop (megatron_ext.train; checked by check_deferred) -------
    Entry("training args", "megatron.training.arguments:parse_and_validate_args", "wrap",
          "adds --per-dtype-grad-buffers and --keep-in-fp32-params to the script's "
          "extra_args_provider; once parsed, applies the training entries below if either is on",
          "Megatron-LM's scripts parse their arguments before pretrain(), through this function",
          since=(0, 19), params=("extra_args_provider", "ignore_unknown_args", "args_defaults")),
    Entry("training DDP config", "megatron.training.training:DistributedDataParallelConfig",
          "replace", "get_megatron_ddp_config(args) builds megatron_ext's config; its fields, "
          "per_dtype_grad_buffers included, are read from the parsed arguments",
          "the option is a DDP config field", since=(0, 19)),
    Entry("training DDP", "megatron.training.models.dist_utils:DistributedDataParallel",
          "replace", "model chunks are wrapped in megatron_ext.DistributedDataParallel",
          "per-dtype buffers, layouts and fp32 islands are built by our DDP", since=(0, 19),
          params=("config", "ddp_config", "module")),
    Entry("training optimizer", "megatron.training.training:get_megatron_optimizer", "replace",
          "setup_model_and_optimizer builds megatron_ext's optimizers; refuses chunks that "
          "were not built by the training entries above", "flat norm, clip and zero count",
          since=(0, 19), params=("config", "model_chunks")),
    Entry("training fp32 islands", "megatron.training.models.dist_utils:_wrap_with_mp_wrapper",
          "wrap", "marks parameters matching --keep-in-fp32-params, then wraps the chunks in "
          "megatron_ext.Float16Module instead of megatron-core's",
          "megatron-core's Float16Module casts every parameter to bf16/fp16", since=(0, 19),
          params=("model_list", "transformer_config", "mixed_precision_wrapper")),
    Entry("training step", "megatron.training.training:train_step", "wrap",
          "with --log-per-layer-grad-norm, on steps whose iteration is logged: asks the "
          "optimizer for per-parameter norms in that step's norm pass, then logs them per "
          "layer (console, TensorBoard, W&B)", "the loop calls train_step(..., optimizer, "
          "..., iteration=...) once per iteration; nothing else sees the step's norm pass",
          since=(0, 19), params=("forward_step_func", "data_iterator", "model", "optimizer")),
    Entry("training tensorboard", "megatron.training.global_vars:get_tensorboard_writer",
          "call", "the run's TensorBoard writer (None on ranks without one)",
          "per-layer norms go where Megatron-LM logs its grad norm", since=(0, 19), params=()),
    Entry("training wandb", "megatron.training.global_vars:get_wandb_writer", "call",
          "the run's W&B writer (None on ranks without one)",
          "per-layer norms go where Megatron-LM logs its grad norm", since=(0, 19), params=()),
    Entry("dataset helpers build", "megatron.core.datasets.utils:compile_helpers", "replace",
          "skips `make` when megatron/core/datasets has no Makefile and the compiled helpers "
          "import (the megatron-core wheel)", "the wheel ships helpers_cpp but no Makefile: "
          "rank 0 exits at start-up (\"Failed to compile the C++ dataset helper functions\")",
          since=(0, 19), params=()),
    Entry("training arguments", "megatron.training.arguments:add_megatron_arguments", "call",
          "python -m megatron_ext.train --help lists Megatron-LM's arguments after ours",
          "the help shows the whole command line a script takes", since=(0, 19),
          params=("parser",), optional=True),
    Entry("dataset helpers", "megatron.core.datasets.helpers_cpp:build_sample_idx_int64",
          "read", "whether the compiled dataset helpers import",
          "decides whether the build can be skipped", since=(0, 19), optional=True),
)  # fmt: skip

_BY_NAME = {e.name: e for e in ENTRIES}

# Modules of Megatron-LM's training loop: their entries are checked by check_deferred() when
# megatron_ext.train first uses them, not at import (importing megatron.training would pull
# Megatron-LM's whole training stack into every `import megatron_ext`).
DEFERRED = ("megatron.training.", "megatron.core.datasets.")


def installed_version() -> tuple[int, ...]:
    """The installed megatron-core version as integers (``0.19.2+abc`` -> ``(0, 19, 2)``)."""
    from megatron.core.package_info import __version__

    return parse_version(__version__)


def parse_version(text: str) -> tuple[int, ...]:
    """``"0.19.2+138362d"`` -> ``(0, 19, 2)``; ``"0.20.0rc0"`` -> ``(0, 20, 0)``."""
    out = []
    for part in text.split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if m is None:
            break
        out.append(int(m.group()))
        if m.end() != len(part):
            break
    return tuple(out)


def _applies(entry: Entry, version: tuple[int, ...]) -> bool:
    return version[:2] >= entry.since


def _resolve(entry: Entry):
    module_name, _, qualname = entry.target.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _params_of(obj) -> tuple[str, ...]:
    sig = inspect.signature(obj)
    return tuple(n for n in sig.parameters if n not in ("self", "cls"))


def _problem(entry: Entry, version: tuple[int, ...]) -> str | None:
    try:
        obj = _resolve(entry)
    except (ImportError, AttributeError) as e:
        return f"{entry.target} is missing ({type(e).__name__}: {e})"
    if entry.params is not None:
        have = _params_of(obj)
        if have[: len(entry.params)] != entry.params:
            return f"{entry.target} takes {have}, expected {entry.params} first"
    return None


def _version_text(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@functools.cache
def check() -> tuple[int, ...]:
    """Check the installed megatron-core against :data:`SUPPORTED` and every entry.

    Returns the installed version. Raises :class:`MegatronCoreMismatchError` naming the
    first entry that does not hold (or the version, when it is out of range).
    """
    version = installed_version()
    low, high = SUPPORTED
    if not low <= version[:3] <= high:
        raise MegatronCoreMismatchError(
            f"megatron_ext supports megatron-core >= {_version_text(low)}, <= "
            f"{_version_text(high)}; the installed one is {_version_text(version)}. Install "
            "a supported megatron-core, or megatron_ext's release for yours."
        )
    _check_entries([e for e in ENTRIES if not _deferred(e)], version)
    return version


@functools.cache
def check_deferred() -> tuple[int, ...]:
    """Check the entries :func:`check` leaves out (:data:`DEFERRED`); call before using them.

    Returns the installed version. Raises :class:`MegatronCoreMismatchError` as
    :func:`check` does.
    """
    version = check()
    _check_entries([e for e in ENTRIES if _deferred(e)], version)
    return version


def _deferred(entry: Entry) -> bool:
    return entry.target.startswith(DEFERRED)


def _check_entries(entries: list[Entry], version: tuple[int, ...]) -> None:
    for entry in entries:
        if not _applies(entry, version):
            continue
        problem = _problem(entry, version)
        if problem is not None and not entry.optional:
            raise MegatronCoreMismatchError(
                f"megatron_ext's touch point {entry.name!r} ({entry.how}: {entry.change}) "
                f"does not hold on megatron-core {_version_text(version)}: {problem}"
            )


def target(name: str):
    """The megatron-core object of entry ``name``; :func:`check` has checked its signature."""
    entry = _BY_NAME[name]
    try:
        return _resolve(entry)
    except (ImportError, AttributeError) as e:
        raise MegatronCoreMismatchError(
            f"megatron_ext's touch point {name!r} is unavailable on megatron-core "
            f"{_version_text(installed_version())}: {entry.target} is missing ({e})"
        ) from None


def owner(name: str) -> tuple[object, str]:
    """The object that holds entry ``name``'s target, and the attribute name there.

    For entries that replace or wrap a binding: ``setattr(*owner(name), new)``.
    """
    entry = _BY_NAME[name]
    module_name, _, qualname = entry.target.partition(":")
    path, _, attr = qualname.rpartition(".")
    obj = importlib.import_module(module_name)
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj, attr


def optional(name: str):
    """The object of an optional entry, or None where this megatron-core lacks it."""
    entry = _BY_NAME[name]
    if not entry.optional:
        raise ValueError(f"{name!r} is not an optional entry; use seam.target")
    try:
        return _resolve(entry)
    except (ImportError, AttributeError):
        return None


def check_instance(name: str, obj) -> None:
    """Check that ``obj`` has the instance attributes entry ``name`` reads or re-points."""
    entry = _BY_NAME[name]
    missing = [a for a in entry.attrs if not hasattr(obj, a)]
    if missing:
        raise MegatronCoreMismatchError(
            f"megatron_ext's touch point {name!r} ({entry.how}: {entry.change}) does not hold "
            f"on megatron-core {_version_text(installed_version())}: a "
            f"{type(obj).__name__} has no {', '.join(missing)}"
        )


def describe() -> str:
    """The table, one line per entry: what is touched, how, and since when."""
    return "\n".join(
        f"{e.name}: {e.how} {e.target} (>= {_version_text(e.since)}"
        f"{', optional' if e.optional else ''}): {e.change}"
        for e in ENTRIES
    )
