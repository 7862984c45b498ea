"""Every place where ``megatron_ext`` reaches into megatron-core, in one table.

Each :class:`Entry` names one target in megatron-core, how we touch it (``subclass``,
``override``, ``class swap``, ``wrap``, ``replace``, ``re-point``, ``read``, ``call``),
what that changes, why, the upstream issue where there is one, and the megatron-core
versions it applies to, and every attribute of megatron-core's objects we read or write
(``attrs``, ``probes``, ``writes``, ``adds``). The rest of ``megatron_ext`` reaches
megatron-core only through :func:`target` (and :func:`optional` for what some versions
lack), and touches no attribute of its objects that an entry does not list, so this table
is the whole coupling: ``tests/test_seam_coverage.py`` records every attribute our code
reads or writes on megatron-core's objects through a CPU training loop and compares them
with the table, and ``tests/test_seam.py`` checks that nothing imports megatron-core
around it.

:func:`check` runs when ``megatron_ext`` is imported, before anything is touched: the
installed version must lie in :data:`SUPPORTED`, and every entry that applies to it must
resolve as we use it: the method kind (plain method, classmethod, staticmethod, class),
the signature (:data:`SIGNATURES` says what is compared) and, where we index or unpack a
returned tuple, every ``return`` of the target's source (the comparisons live in
:mod:`megatron_ext.seam_signatures`). A mismatch raises one
:class:`MegatronCoreMismatchError` naming the entry and the version, instead of an
``AttributeError`` inside a training step. Attributes that exist only on instances (a
gradient buffer's ``param_index_map``, an optimizer's groups) are checked by
:func:`check_instance` where the first instance appears, before its state is used.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

from megatron_ext.seam_signatures import call_problems as _call_problems
from megatron_ext.seam_signatures import kind_of as _kind_of
from megatron_ext.seam_signatures import returns_problem as _returns_problem
from megatron_ext.seam_signatures import signature_params as _signature_params
from megatron_ext.seam_signatures import spec as _spec
from megatron_ext.seam_signatures import stand_in_problems as _stand_in_problems

# The first and last megatron-core versions tested, both inclusive, read as pyproject.toml's
# ">=0.18.2,<=0.20.0" pins read (:func:`supports`): 0.18.2, 0.19.0 and 0.19.2 from PyPI,
# and Megatron-LM main at the commit in scripts/mcore_main.sha, which reports 0.20.0 (or a
# pre-release of it). Local build suffixes (+sha) are ignored.
SUPPORTED = ((0, 18, 2), (0, 20, 0))


class MegatronCoreMismatchError(ImportError):
    """The installed megatron-core lacks, or changed, something ``megatron_ext`` relies on."""


# How an entry's ``params`` are compared with its target's signature, by ``how``:
# - "call" (call, read, re-point): ``params`` is how we call the target, written as a
#   signature: names before ``*`` are passed positionally in that order, names after it by
#   keyword, ``name=`` only sometimes (so the target must give it a default), ``*args`` /
#   ``**kwargs``: we forward our caller's extra arguments. Each argument must bind to the
#   parameter of that name and kind, and every required parameter must be passed.
# - "stand-in" (override, replace, wrap, subclass): megatron-core's callers call our code in
#   the target's place, so ``params`` is the target's signature as our code takes it; it
#   must match the target's parameter for parameter (name, position, kind, whether
#   required). ``*args`` / ``**kwargs``: our code forwards the rest, so parameters the target
#   adds there are passed through. Anything else the target adds, even with a default, is
#   an argument megatron-core may pass that our code does not take.
SIGNATURES = {"call": "call", "read": "call", "re-point": "call", "override": "stand-in",
              "replace": "stand-in", "wrap": "stand-in", "subclass": "stand-in"}  # fmt: skip

_KINDS = ("class", "method", "classmethod", "staticmethod", "function", "property")


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
        params: the target's parameters as we use them (``self``/``cls`` left out), in
            signature syntax: ``"name"``, ``"name="`` (has a default), ``"*"`` (keyword
            arguments follow), ``"*args"``, ``"**kwargs"``; compared as :data:`SIGNATURES`
            says for ``how``. None: not a callable, or not checked.
        kind: what the target is in its module or class: one of ``class``, ``method``
            (a plain function in a class), ``classmethod``, ``staticmethod``, ``function``
            (in a module), ``property``. None: ``class`` for subclass and class-swap
            entries, ``method``/``function`` for entries with ``params``, else unchecked.
        returns: the items of the tuple every ``return`` of the target builds, as written
            there (we index or unpack that tuple, or return one in its place); checked on
            the target's source.
        attrs: instance attributes we read, there on every instance (checked by
            :func:`check_instance`). A method we call is not listed: an entry of its own
            targets it.
        probes: instance attributes we read where they are (``getattr`` with a default):
            some versions or kinds of object lack them.
        writes: megatron-core's instance attributes we assign (re-point), there before we
            do (checked by :func:`check_instance`).
        adds: attributes of ours we set on megatron-core's instances (our state and marks);
            megatron-core's class must not have them (checked by :func:`check`).
        arity: (instance attribute, n): every value of that mapping (or item of that
            sequence) is a tuple we unpack into n names or index (checked by
            :func:`check_instance`).
        optional: absent in some supported versions; :func:`optional` returns None there
            and the feature adapts (docs/versions.md says what is unavailable). Where it is
            present it is checked as any other entry.
    """

    name: str
    target: str
    how: str
    change: str
    why: str
    upstream: str = ""
    since: tuple[int, int] = (0, 18)
    params: tuple[str, ...] | None = None
    kind: str | None = None
    returns: tuple[str, ...] | None = None
    attrs: tuple[str, ...] = ()
    probes: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    adds: tuple[str, ...] = ()
    arity: tuple[tuple[str, int], ...] = ()
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
          attrs=("use_megatron_fsdp", "use_custom_fsdp", "num_distributed_optimizer_instances",
                 "use_distributed_optimizer", "overlap_param_gather")),
    Entry("DistributedDataParallel", f"{_DDP}:DistributedDataParallel",
          "subclass", "casts keep_in_fp32 parameters to fp32 before the buffers are built; "
          "records each buffer's layout; carves one fp32 island per buffer",
          "fp32 parameters need their own (fp32) gradient buffer",
          params=("config", "ddp_config", "module", "*args", "**kwargs"),
          attrs=("buffers", "expert_parallel_buffers", "module", "intra_dp_cp_group",
                 "intra_expt_dp_group"),
          probes=("config", "bucket_groups", "expert_parallel_bucket_groups"),
          adds=("per_dtype_grad_buffers", "layout", "_by_key")),
    Entry("buffer layout", f"{_BUF}:_ParamAndGradBuffer", "read",
          "reads where each parameter's gradient sits, the buckets and the shard group",
          "spans are computed once from megatron-core's own layout",
          attrs=("param_index_map", "bucket_indices", "buckets", "grad_data", "param_data",
                 "numel", "data_parallel_group", "param_dtype", "grad_dtype"),
          arity=(("param_index_map", 3), ("bucket_indices", 2))),
    Entry("fp32 accumulation island", f"{_BUF}:_ParamAndGradBuffer", "re-point",
          "param.main_grad of fp32-local-accumulation parameters becomes a view of one "
          "fp32 island per buffer; buffer.extra_main_grads becomes [island]",
          "one zero and one fused norm launch per island instead of one per parameter",
          writes=("extra_main_grads",)),
    Entry("bucket", f"{_BUF}:_ParamAndGradBucket", "read",
          "the parameters whose gradients accumulate in fp32 outside the buffer (islands); "
          "the parameter bytes each bucket's all-gather sends (overlapped offload step)",
          "islands are carved from them; the forward waits are found by byte range",
          kind="class", attrs=("params_with_extra_main_grads", "param_data")),
    Entry("bucket group", f"{_BUF}:_ParamAndGradBucketGroup", "read",
          "the overlapped offload step's all-gather waits read each group's buckets, shard "
          "and overlap_param_gather; at one rank without it, a gather while a host update is "
          "in flight is skipped, leaving the two fields megatron-core's synchronous path "
          "leaves (offload.forward_waits)",
          "a gather must not send parameters the host has not sent back; at one rank it "
          "moves nothing, and waiting there would end the overlap",
          kind="class",
          attrs=("buckets", "ddp_config", "intra_distributed_optimizer_instance_size",
                 "intra_distributed_optimizer_instance_rank"),
          writes=("param_gather_handle", "param_gather_dispatched")),
    Entry("bucket group param sync", f"{_BUF}:_ParamAndGradBucketGroup.start_param_sync",
          "wrap", "per instance, while the overlapped offload step is installed: waits for the "
          "host update's chunks of the group's shard, then megatron-core's; taken off again "
          "(offload.forward_waits)", "as bucket group",
          params=("*args", "**kwargs"), writes=("start_param_sync",)),
    Entry("Float16Module", "megatron.core.transformer.module:Float16Module",
          "subclass", "restores keep_in_fp32 parameters (unrounded) after the cast",
          "megatron-core 0.19 casts every parameter to bf16/fp16",
          params=("config", "module"), attrs=("module",)),
    Entry("MoE router", "megatron.core.transformer.moe.router:Router", "read",
          "a router whose weight is kept in fp32 gets a forward pre-hook that casts its "
          "input to fp32 (fp32.align_router_inputs)",
          "megatron-core's router_gating_linear hands a bf16 input and an fp32 weight to "
          "transformer-engine's GEMM, which cuBLAS refuses, or without TE rounds the weight "
          "to bf16", kind="class", probes=("weight",),
          adds=("_megatron_ext_input_follows_weight",)),
    Entry("model modules", "megatron.core.transformer.module:MegatronModule", "read",
          "global parameter names: a transformer layer's layer_number (not an MTP layer's), "
          "an expert module's num_local_experts and its ep_group's rank; probed on every "
          "module of the model (megatron_ext.global_param_norms)",
          "per-parameter norms are matched across pipeline and expert ranks by global name",
          kind="class",
          probes=("layer_number", "is_mtp_layer", "num_local_experts", "ep_group")),
    Entry("TransformerConfig", "megatron.core.transformer.transformer_config:TransformerConfig",
          "read", "build_stack takes bf16/fp16 from it; the overlapped offload step reads "
          "whether CUDA graphs replay the forward; megatron_ext.train whether the model has "
          "one pipeline stage", "an optimizer config as Megatron-LM builds it; a replayed "
          "graph skips the forward pre-hooks; only one stage holds every parameter",
          kind="class",
          probes=("bf16", "fp16", "cuda_graph_impl", "enable_cuda_graph",
                  "external_cuda_graph", "pipeline_model_parallel_size")),
    *(Entry(layer, f"megatron.core.tensor_parallel:{layer}", "read",
            "whether the module holds megatron-core's own linear layers built with the fusion on",
            "with gradient_accumulation_fusion they call apex's fused_weight_gradient_mlp_cuda; "
            "without it the DDP refuses the module in one line (wgrad_fusion.py)",
            kind="class", attrs=("gradient_accumulation_fusion",))
      for layer in ("ColumnParallelLinear", "RowParallelLinear")),
    # -- optimizer construction -------------------------------------------------------------
    Entry("OptimizerConfig", "megatron.core.optimizer:OptimizerConfig", "call",
          "build_stack builds it from a mapping, use_distributed_optimizer set to agree with "
          "the DDP config; the flat optimizers read the clip, skip and zero-count settings, "
          "the offload code the offload and precision-aware settings (a copy of the config "
          "gets the fraction offload_fraction='auto' chose)",
          "one argument says whether the distributed optimizer is on; the flat step does "
          "what stock's does with the same settings",
          kind="class",
          attrs=("use_distributed_optimizer", "fp16", "clip_grad",
                 "grad_norm_skip_threshold", "log_num_zeros_in_grad", "loss_scale",
                 "use_precision_aware_optimizer_no_fp8_or_ds_fp8",
                 "optimizer_offload_fraction"),
          probes=("optimizer_cpu_offload", "use_precision_aware_optimizer", "exp_avg_dtype",
                  "exp_avg_sq_dtype", "main_params_dtype"),
          writes=("optimizer_offload_fraction",)),
    Entry("get_megatron_optimizer", "megatron.core.optimizer:get_megatron_optimizer", "call",
          "builds the optimizers, then swaps their classes (below)",
          "same signature and return types as megatron-core's",
          params=("config", "model_chunks", "*args", "**kwargs")),
    Entry("fp32 shards as leaves",
          f"{_DIST}:DistributedOptimizer._build_model_and_main_param_groups", "wrap",
          "during construction only: natively fp32 parameter shards become detached views",
          "megatron-core 0.19 slices them without detach(); CPU offload then raises "
          "\"can't optimize a non-leaf Tensor\"",
          params=("gbuf_ranges", "param_gbuf_map", "opt_group_ranges", "config"),
          kind="classmethod",
          returns=("model_float16_groups", "model_fp32_groups", "shard_float16_groups",
                   "shard_fp32_groups", "shard_fp32_from_float16_groups")),
    Entry("DistributedOptimizer", f"{_DIST}:DistributedOptimizer", "class swap",
          "the instance becomes a subclass whose norm, clip, zero count, grad copy and "
          "checkpoint load read flat spans (methods below)",
          "one fused launch per buffer instead of a per-parameter list",
          attrs=("buffers", "model_float16_groups", "model_fp32_groups",
                 "shard_fp32_from_float16_groups", "shard_fp32_groups", "shard_float16_groups",
                 "model_param_gbuf_map", "config", "optimizer", "init_state_fn"),
          arity=(("model_param_gbuf_map", 3),)),
    Entry("param group order", f"{_DIST}:DistributedOptimizer", "re-point",
          "model_param_group_index_map re-numbered in the order of the optimizer's own param "
          "groups (fp32 parameters first, then fp16/bf16), checked against each shard's size",
          "megatron-core numbers a group's parameters in the group's order but lists its "
          "fp32 ones first in the optimizer: once a group holds both (fp32 islands), "
          "checkpoint save and load pair states with the wrong parameters (save fails: "
          "'AssertionError: (torch.Size([1024]), 512, 262656)', seen on the GPU)",
          attrs=("model_param_group_index_map", "model_float16_groups", "model_fp32_groups",
                 "optimizer"),
          writes=("model_param_group_index_map",)),
    Entry("distopt without TE or Apex", f"{_DIST}:HAVE_APEX_OR_TE", "read",
          "whether megatron-core's distributed optimizer reads Adam's step from torch's "
          "per-parameter state (False: neither TE nor Apex)",
          "then loading a checkpoint into a never-stepped optimizer asserts in its "
          "state_dict() ('assert len(steps) == 1', Megatron-LM --load, seen on the GPU); "
          "the state is created first, as megatron-core's own load_state_dict does next"),
    Entry("param range map", f"{_DIST}:DistributedOptimizer._get_model_param_range_map",
          "call", "reads the range of a parameter this rank owns",
          "bindings of main gradients to mirror views", params=("param",)),
    Entry("param range", f"{_DIST}:Range", "read",
          "the owned range the param range map holds for a parameter",
          "bindings, host-mirror sources and the group-order check index the buffer by it",
          kind="class", attrs=("start", "end", "size")),
    Entry("Float16OptimizerWithFloat16Params", f"{_OPT}:Float16OptimizerWithFloat16Params",
          "class swap", "as DistributedOptimizer", "as DistributedOptimizer",
          attrs=("float16_groups", "fp32_from_float16_groups", "fp32_from_fp32_groups")),
    Entry("FP32Optimizer", f"{_OPT}:FP32Optimizer", "class swap", "as DistributedOptimizer",
          "as DistributedOptimizer"),
    Entry("any optimizer", f"{_OPT}:MegatronOptimizer", "read",
          "of every optimizer (each child of the chain, and the chain): its inner optimizer, "
          "config and state initializer; whether it is a stub, loss-scaled, and its "
          "tensor-parallel groups (where it has them); the flat state is added as _flat "
          "([Note: the class swap] in megatron_ext.flat_state)",
          "what the flat norm counts and reads, and the state before a checkpoint load",
          kind="class", attrs=("optimizer", "config", "init_state_fn"),
          probes=("is_stub_optimizer", "grad_scaler", "tp_group", "expert_tp_group"),
          adds=("_flat",)),
    Entry("float16 state_dict", f"{_OPT}:Float16OptimizerWithFloat16Params.state_dict",
          "call", "the state float16 sharded_state_dict makes sharded",
          "float16 sharded_state_dict", params=()),
    Entry("ChainedOptimizer", f"{_OPT}:ChainedOptimizer", "class swap",
          "norm, clip, zero count and step over every child's spans in one sequence",
          "stock takes one norm over the union of the children's gradients",
          attrs=("chained_optimizers",)),
    Entry("copy grads to main",
          f"{_OPT}:Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads",
          "override", "one copy per owned range into an fp32 mirror (allocated for the step)",
          "one allocation per parameter per step otherwise", params=()),
    Entry("distopt copy grads to main",
          f"{_DIST}:DistributedOptimizer._copy_model_grads_to_main_grads", "override",
          "as copy grads to main", "as copy grads to main", params=()),
    Entry("zero_grad", f"{_OPT}:Float16OptimizerWithFloat16Params.zero_grad", "override",
          "megatron-core's, then (set_to_none) the fp32 mirrors' storage freed until the "
          "next copy step", "stock frees its fp32 copies there: a mirror kept through "
          "forward and backward costs 4 bytes per owned element at the activation peak",
          params=("set_to_none=",)),
    Entry("distopt zero_grad", f"{_DIST}:DistributedOptimizer.zero_grad", "override",
          "as zero_grad", "as zero_grad", params=("set_to_none=",)),
    Entry("fp32 zero_grad", f"{_OPT}:FP32Optimizer.zero_grad", "override",
          "as zero_grad (it has no mirror)", "one mixin serves every optimizer class",
          params=("set_to_none=",)),
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
    Entry("chained prepare", f"{_OPT}:ChainedOptimizer.prepare_grads", "call",
          "chained step: every child's gradients ready (unscaled, copied), whether any "
          "overflowed", "as stock's step", params=()),
    Entry("chained inner steps", f"{_OPT}:ChainedOptimizer.step_with_ready_grads", "call",
          "chained step: every child's inner step, once the norm and clip ran",
          "as stock's step", params=()),
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
          params=("model_sharded_state_dict", "is_loading=", "metadata=")),
    Entry("distopt sharded_state_dict", f"{_DIST}:DistributedOptimizer.sharded_state_dict",
          "override", "creates the state of a never-stepped optimizer before a load "
          "(distopt without TE or Apex), then megatron-core's",
          "as distopt without TE or Apex",
          params=("model_sharded_state_dict=", "is_loading=", "sharding_type=", "metadata=")),
    Entry("fp32 sharded_state_dict", f"{_OPT}:FP32Optimizer.sharded_state_dict", "override",
          "megatron-core's (the override is shared with the float16 optimizer's)",
          "one class of flat methods for every optimizer kind",
          params=("model_sharded_state_dict", "is_loading=", "metadata=")),
    Entry("fp32 load_state_dict", f"{_OPT}:FP32Optimizer.load_state_dict", "override",
          "as load_state_dict", "as load_state_dict", params=("state_dict",)),
    Entry("common step", f"{_OPT}:MegatronOptimizer._extract_common_per_param_step", "call",
          "float16 sharded_state_dict saves the one step of every parameter as "
          "megatron-core's does", "float16 sharded_state_dict", params=("state_dict",),
          kind="staticmethod"),
    Entry("param id map", f"{_CKPT}:get_param_id_to_sharded_param_map", "call",
          "maps optimizer ids to sharded parameters", "float16 sharded_state_dict",
          params=("model_sharded_state_dict", "optim_params_iter")),
    Entry("sharded optimizer tensor", f"{_CKPT}:make_sharded_optimizer_tensor", "call",
          "wraps a main copy as a sharded tensor", "float16 sharded_state_dict",
          params=("model_param", "optim_param", "*", "prefix")),
    Entry("optimizer state sharding", f"{_CKPT}:optim_state_to_sharding_state", "call",
          "turns optimizer state into sharded tensors", "float16 sharded_state_dict",
          params=("optim_state_dict", "id_to_sharded_param_map", "*", "exclude_keys")),
    Entry("GTP backfill", f"{_OPT}:_backfill_gtp_sharded_param_map", "call",
          "fills GTP-remat entries of the id map", "float16 sharded_state_dict",
          since=(0, 19), params=("id_to_sharded_param_map", "float16_groups",
                                 "model_sharded_state_dict"), optional=True),
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
          "copies' .data re-pointed into it (methods below); the offload step's state is "
          "one OffloadState added as offload (megatron_ext.offload.offload_state)",
          "one copy per block instead of one per parameter",
          attrs=("cpu_param_groups", "gpu_param_groups", "gpu_params_map_cpu_copy",
                 "cpu_copys_map_gpu_param", "param_to_fp32_param", "pin_cpu_grads",
                 "cpu_optimizers", "gpu_optimizer", "param_update_in_fp32",
                 "fp32_param_to_orig_param", "param_to_inner_param", "state",
                 "sub_optimizers", "param_groups", "_cpu_optimizer_map_data_event"),
          probes=("cpu_optimizer_cls", "gpu_optimizer_cls"), adds=("offload",)),
    Entry("hdo placement", f"{_HDO}:HybridDeviceOptimizer._get_sub_optimizer_param_groups",
          "override", "while the sub-optimizers are rebuilt at attach time: the placement "
          "already made (the tuple megatron-core's returns, from the attributes its caller "
          "unpacks it into)", "no second copy of every parameter",
          params=("offload_fraction",),
          returns=("cpu_param_groups", "gpu_param_groups", "gpu_params_map_cpu_copy",
                   "cpu_copys_map_gpu_param", "param_to_fp32_param")),
    Entry("hdo sub-optimizers", f"{_HDO}:HybridDeviceOptimizer._init_sub_optimizers",
          "override", "builds the host mirrors after megatron-core's sub-optimizers",
          "the mirrors replace the per-parameter copies", params=()),
    Entry("hdo hooks", f"{_HDO}:HybridDeviceOptimizer._register_param_copy_back_gpu_hook",
          "override", "per-block hooks instead of per-parameter ones", "as above", params=()),
    Entry("hdo grads", f"{_HDO}:HybridDeviceOptimizer._set_sub_optimizer_grads", "override",
          "one device-to-host copy per block on the offload's own stream; each CPU "
          "optimizer's event put in megatron-core's _cpu_optimizer_map_data_event, which "
          "its step synchronizes before that optimizer's step", "as above", params=()),
    Entry("hdo step", f"{_HDO}:HybridDeviceOptimizer.step", "override",
          "with offload_step='chunked', the CPU update runs chunk by chunk over the host "
          "mirrors (megatron_ext.offload.step), pipelined with the copies, in series or "
          "(offload_delayed_update) one step late on a host worker; else megatron-core's",
          "per-parameter CPU steps wait for the whole block and serialize the copies",
          params=("closure=",)),
    Entry("hdo state_dict", f"{_HDO}:HybridDeviceOptimizer.state_dict", "override",
          "lands a delayed update in flight first, then torch's",
          "a checkpoint holds every update its step count says", params=()),
    Entry("hdo load_state_dict", f"{_HDO}:HybridDeviceOptimizer.load_state_dict", "override",
          "waits for a delayed update in flight and drops it, then torch's (megatron-core's "
          "hooks)", "the loaded state replaces what it would write", params=("state_dict",)),
    Entry("distopt main to model params",
          f"{_DIST}:DistributedOptimizer._copy_main_params_to_model_params", "call",
          "after a delayed offloaded update lands outside a step (megatron_ext.drain_offload)",
          "megatron-core copies main to model parameters only after its inner step",
          params=()),
    Entry("hdo load", f"{_HDO}:HybridDeviceOptimizer._update_fp32_params_by_new_state",
          "override", "loads natively fp32 parameters too",
          "0.19.2 raises KeyError for them when loading a checkpoint", params=()),
    Entry("hdo state before load", f"{_HDO}:HybridDeviceOptimizer.dummy_step", "call",
          "creates a never-stepped offload optimizer's state before a checkpoint load",
          "as distopt without TE or Apex", params=()),
    Entry("hdo sync after load",
          f"{_HDO}:HybridDeviceOptimizer._sync_hdo_state_to_sub_optimizers", "call",
          "after a distributed-optimizer load: sub-optimizer states and inner parameters "
          "from the loaded state; then every state tensor on its parameter's device",
          "0.19.2 syncs only for fully_sharded_model_space, and its sync tells the GPU "
          "and CPU sub-optimizers apart by class (both torch Adam without TE), moving GPU "
          "moments to the CPU: the next GPU step fails", params=()),
    Entry("hdo group sync",
          f"{_HDO}:HybridDeviceOptimizer._sync_hdo_param_groups_to_sub_optimizers", "override",
          "copies every param-group key but 'step' into the sub-optimizers, over group pairs "
          "worked out once", "0.19.2 copies 'step' too: after a load, a GPU optimizer that "
          "counts steps per group (TE FusedAdam, offload fraction < 1) is reset to the saved "
          "step before every step, its bias correction stuck there", params=()),
    Entry("hdo state sync",
          f"{_HDO}:HybridDeviceOptimizer._sync_sub_optimizers_state_to_hdo", "override",
          "megatron-core's, then a per-group 'step' a sub-optimizer advanced into its group",
          "a checkpoint then saves the GPU optimizer's step (at fraction 0 megatron-core "
          "finds none to save and a resume restarts TE FusedAdam's bias correction)",
          params=()),
    Entry("hdo state placement",
          f"{_HDO}:HybridDeviceOptimizer._move_new_state_to_right_device", "override",
          "each sub-optimizer's state on its parameters' device; no per-parameter 'step' in "
          "the state of an optimizer that counts per group", "0.19.2 places by class and "
          "moves non-CPU-class state to 'cuda' by name; the distributed optimizer's load "
          "gives TE FusedAdam's states a 'step' an uninterrupted run lacks", params=()),
    Entry("hdo refresh", f"{_HDO}:HybridDeviceOptimizer.update_fp32_param_by_new_param",
          "override", "refreshes natively fp32 inner copies too", "0.19.2 skips them",
          params=()),
    # -- install(): the list functions for code without the option -----------------------
    Entry("get_grad_norm_fp32", "megatron.core.optimizer.clip_grads:get_grad_norm_fp32",
          "replace", "a dtype-safe version, in clip_grads and every module that imported it",
          "the fused list kernel reads every tensor with the first tensor's dtype",
          params=("grads_for_norm", "norm_type=", "grad_stats_parallel_group=")),
    Entry("clip_grad_by_total_norm_fp32",
          "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32", "replace",
          "as get_grad_norm_fp32", "as get_grad_norm_fp32",
          params=("parameters", "max_norm", "total_norm", "use_decoupled_grad=")),
    Entry("dtensor helpers", "megatron.core.utils:to_local_if_dtensor", "call",
          "reads DTensor gradients through their local shards", "as stock does",
          params=("tensor",)),
    Entry("dtensor group", "megatron.core.utils:get_data_parallel_group_if_dtensor", "call",
          "the DTensors' data-parallel group", "as stock reduces over it",
          params=("tensor",)),
    # -- the main job's demo of the bug (megatron_ext.mixed_list_demo): read only ---------
    Entry("l2 norm kernel", "megatron.core.optimizer.clip_grads:l2_norm_impl", "read",
          "which l2-norm kernel get_grad_norm_fp32 bound at import (TE's, Apex's or "
          "megatron-core's fallback); the demo prints it beside stock's norm",
          "the mixed-list bug is in TE's and Apex's fused kernel; the fallback is right",
          optional=True),
    Entry("fallback l2 norm", "megatron.core.utils:local_multi_tensor_l2_norm", "read",
          "compared with the bound kernel: does stock run its per-tensor fallback here",
          "then the demo says that the kernel bug cannot be shown on this machine",
          optional=True),
    # -- Megatron-LM's training loop (megatron_ext.train; checked by check_deferred) -------
    Entry("training args", "megatron.training.arguments:parse_and_validate_args", "wrap",
          "adds --per-dtype-grad-buffers and --keep-in-fp32-params to the script's "
          "extra_args_provider; once parsed, applies the training entries below if either is on",
          "Megatron-LM's scripts parse their arguments before pretrain(), through this function",
          since=(0, 19),
          params=("extra_args_provider=", "ignore_unknown_args=", "args_defaults=")),
    Entry("training DDP config", "megatron.training.training:DistributedDataParallelConfig",
          "replace", "get_megatron_ddp_config(args) builds megatron_ext's config; its fields, "
          "per_dtype_grad_buffers included, are read from the parsed arguments",
          "the option is a DDP config field", since=(0, 19), kind="class"),
    Entry("training DDP", "megatron.training.models.dist_utils:DistributedDataParallel",
          "replace", "model chunks are wrapped in megatron_ext.DistributedDataParallel",
          "per-dtype buffers, layouts and fp32 islands are built by our DDP", since=(0, 19),
          kind="class", params=("config", "ddp_config", "module", "*args", "**kwargs")),
    Entry("training optimizer", "megatron.training.training:get_megatron_optimizer", "replace",
          "setup_model_and_optimizer builds megatron_ext's optimizers; refuses chunks that "
          "were not built by the training entries above", "flat norm, clip and zero count",
          since=(0, 19), params=("config", "model_chunks", "*args", "**kwargs")),
    Entry("training fp32 islands", "megatron.training.models.dist_utils:_wrap_with_mp_wrapper",
          "wrap", "marks parameters matching --keep-in-fp32-params, then wraps the chunks in "
          "megatron_ext.Float16Module instead of megatron-core's",
          "megatron-core's Float16Module casts every parameter to bf16/fp16", since=(0, 19),
          params=("model_list", "transformer_config", "mixed_precision_wrapper=")),
    Entry("training step", "megatron.training.training:train_step", "wrap",
          "with --log-per-layer-grad-norm, on steps whose iteration is logged: asks the "
          "optimizer for per-parameter norms in that step's norm pass, then logs them per "
          "layer (console, TensorBoard, W&B)", "the loop calls train_step(..., optimizer, "
          "..., iteration=...) once per iteration; nothing else sees the step's norm pass",
          since=(0, 19),
          params=("forward_step_func", "data_iterator", "model", "optimizer",
                  "opt_param_scheduler", "config", "forward_backward_func", "iteration=",
                  "*args", "**kwargs")),
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


class MegatronCoreVersion(Version):
    """A megatron-core version, ordered as PEP 440 orders it (``0.20.0a1 < 0.20.0rc5 <
    0.20.0``, ``0.18.2.dev0 < 0.18.2``); indexing reads the release padded to three
    numbers, so ``v[:2] == (0, 19)`` holds for ``0.19.2+abc``."""

    def __getitem__(self, index):
        return (*self.release, 0, 0, 0)[:3][index]


def installed_version() -> MegatronCoreVersion:
    """The installed megatron-core version (:func:`parse_version`)."""
    from megatron.core.package_info import __version__

    return parse_version(__version__)


def parse_version(text: str) -> MegatronCoreVersion:
    """``"0.19.2+138362d"``, ``"0.20.0rc5"``, ``"0.18.2.dev0"`` as a comparable version.

    Raises:
        MegatronCoreMismatchError: ``text`` is not a PEP 440 version.
    """
    try:
        return MegatronCoreVersion(text)
    except InvalidVersion:
        raise MegatronCoreMismatchError(
            f"megatron-core reports the version {text!r}, which is not a PEP 440 version"
        ) from None


def supports(version: Version) -> bool:
    """Whether ``version`` lies in :data:`SUPPORTED`, as pyproject.toml's ``>=, <=`` pins
    read it: pre-releases of the last version count, local labels (``+sha``) are ignored,
    a development or pre-release of the first version comes before it."""
    low, high = (Version(_version_text(v)) for v in SUPPORTED)
    return low <= Version(version.public) <= high


def _applies(entry: Entry, version) -> bool:
    return version[:2] >= entry.since


def _resolve(entry: Entry):
    module_name, _, qualname = entry.target.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _expected_kind(entry: Entry) -> str | None:
    if entry.kind is not None:
        return entry.kind
    if entry.how in ("subclass", "class swap"):
        return "class"
    if entry.params is None:
        return None
    return "method" if "." in entry.target.partition(":")[2] else "function"


def _problem(entry: Entry) -> str | None:
    try:
        obj = _resolve(entry)
    except (ImportError, AttributeError) as e:
        return f"{entry.target} is missing ({type(e).__name__}: {e})"
    owner_obj, attr = _owner(entry)
    kind = _kind_of(owner_obj, inspect.getattr_static(owner_obj, attr))
    expected = _expected_kind(entry)
    if expected is not None and kind != expected:
        return f"{entry.target} is now a {kind}, where we use a {expected}"
    if entry.params is not None:
        try:
            have = _signature_params(obj, kind)
        except (TypeError, ValueError) as e:
            return f"{entry.target} has no signature to check ({e})"
        mode = SIGNATURES[entry.how]
        check = _call_problems if mode == "call" else _stand_in_problems
        problems = check(have, _spec(entry.params))
        if problems:
            sig = inspect.signature(obj)
            plain = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
            shown = sig.replace(parameters=plain, return_annotation=inspect.Parameter.empty)
            return (
                f"{entry.target}{shown}: {'; '.join(problems)} (we rely on "
                f"({', '.join(entry.params)}) as a {mode})"
            )
    holder = obj if isinstance(obj, type) else owner_obj
    taken = [a for a in entry.adds if hasattr(holder, a)]
    if taken:
        return (
            f"{entry.target} now has {', '.join(taken)} of its own, which we add to its instances"
        )
    if entry.returns is not None:
        problem = _returns_problem(obj, entry.returns)
        if problem is not None:
            return f"{entry.target}: {problem}"
    return None


def _version_text(version) -> str:
    return str(version) if isinstance(version, Version) else ".".join(map(str, version))


@functools.cache
def check() -> MegatronCoreVersion:
    """Check the installed megatron-core against :data:`SUPPORTED` and every entry.

    Returns the installed version. Raises :class:`MegatronCoreMismatchError` naming the
    first entry that does not hold (or the version, when it is out of range).
    """
    version = installed_version()
    low, high = SUPPORTED
    if not supports(version):
        raise MegatronCoreMismatchError(
            f"megatron_ext supports megatron-core >= {_version_text(low)}, <= "
            f"{_version_text(high)}; the installed one is {_version_text(version)}. Install "
            "a supported megatron-core, or megatron_ext's release for yours."
        )
    _check_entries([e for e in ENTRIES if not _deferred(e)], version)
    return version


@functools.cache
def check_deferred() -> MegatronCoreVersion:
    """Check the entries :func:`check` leaves out (:data:`DEFERRED`); call before using them.

    Returns the installed version. Raises :class:`MegatronCoreMismatchError` as
    :func:`check` does.
    """
    version = check()
    _check_entries([e for e in ENTRIES if _deferred(e)], version)
    return version


def _deferred(entry: Entry) -> bool:
    return entry.target.startswith(DEFERRED)


def _check_entries(entries: list[Entry], version) -> None:
    for entry in entries:
        if not _applies(entry, version):
            continue
        if entry.optional and not _present(entry):
            continue
        problem = _problem(entry)
        if problem is not None:
            raise MegatronCoreMismatchError(
                f"megatron_ext's touch point {entry.name!r} ({entry.how}: {entry.change}) "
                f"does not hold on megatron-core {_version_text(version)}: {problem}"
            )


def target(name: str) -> Any:
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
    return _owner(_BY_NAME[name])


def _owner(entry: Entry) -> tuple[object, str]:
    module_name, _, qualname = entry.target.partition(":")
    path, _, attr = qualname.rpartition(".")
    obj = importlib.import_module(module_name)
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj, attr


def optional(name: str) -> Any:
    """The object of an optional entry, or None where this megatron-core lacks it."""
    entry = _BY_NAME[name]
    if not entry.optional:
        raise ValueError(f"{name!r} is not an optional entry; use seam.target")
    return _resolve(entry) if _present(entry) else None


def _present(entry: Entry) -> bool:
    try:
        _resolve(entry)
    except (ImportError, AttributeError):
        return False
    return True


def check_instance(name: str, obj) -> None:
    """Check that ``obj`` has the instance attributes entry ``name`` reads (``attrs``) and
    re-points (``writes``), and that the tuples we unpack from them (``arity``) have as many
    items as we take."""
    entry = _BY_NAME[name]
    missing = [a for a in (*entry.attrs, *entry.writes) if not hasattr(obj, a)]
    problems = [f"a {type(obj).__name__} has no {', '.join(missing)}"] if missing else []
    for attr, n in entry.arity:
        values = getattr(obj, attr, ())
        values = values.values() if isinstance(values, dict) else values
        bad = next((v for v in values if not isinstance(v, tuple | list) or len(v) != n), None)
        if bad is not None:
            problems.append(
                f"{type(obj).__name__}.{attr} holds {bad!r}, where we unpack {n}-tuples"
            )
    if problems:
        raise MegatronCoreMismatchError(
            f"megatron_ext's touch point {name!r} ({entry.how}: {entry.change}) does not hold "
            f"on megatron-core {_version_text(installed_version())}: {'; '.join(problems)}"
        )


def describe() -> str:
    """The table, one line per entry: what is touched, how, and since when."""
    return "\n".join(
        f"{e.name}: {e.how} {e.target} (>= {_version_text(e.since)}"
        f"{', optional' if e.optional else ''}): {e.change}"
        for e in ENTRIES
    )
