"""The seam table (``megatron_ext/seam.py``) lists every attribute our code reads or writes on
megatron-core's objects, and every attribute it lists is one our code touches.

One run, in this process, at one gloo rank on the CPU shim (``tests/support/cpu_megatron.py``:
megatron-core's real DDP, buffers, bucket groups, distributed optimizer and
HybridDeviceOptimizer), while ``tests/support/seam_access.py`` records each attribute our code
(``megatron_ext``, ``buffers``) reads or writes on an object of a megatron-core class:

- a tiny MoE ``GPTModel`` (local spec: transformer layers, a router kept in fp32, experts,
  megatron-core's linear layers) in our ``Float16Module`` and DDP, the distributed optimizer:
  its sharded state dict before the first step (a load into a never-stepped optimizer), a
  step, the norm audit and per-parameter norms;
- a small model with an fp32 island and a natively fp32 parameter, CPU-offloaded at fraction
  0.5 through host mirrors with the precision-aware optimizer: the exact chunked step, a
  checkpoint saved and loaded through ``dist_checkpointing`` into a fresh stack that steps
  on; the delayed update (a warm-up step, ``state_dict``, a drain); the overlapped step (its
  forward pre-hooks and bucket-group waits); megatron-core's per-parameter step; the fraction
  chosen for the GPU's free memory (``offload_fraction="auto"``, a stand-in for the free
  memory); a loss scale over bf16 gradients, which ``get_megatron_optimizer`` refuses;
- the same model with ``Float16OptimizerWithFloat16Params`` (no distributed optimizer): a
  step, its sharded state dict, a state-dict round trip.

The run takes a few seconds; it runs twice, the first time unrecorded (see ``recorded``).
Each test compares what was recorded with the table. An entry covers the instances of its
class (the target, or the class whose method the target is) and of its subclasses:

- a read is covered by a name in ``attrs``, ``probes`` or ``adds``, or by an entry whose
  target is that method or value of the class (``DistributedOptimizer._get_model_param_range_map``);
- a write by a name in ``writes`` or ``adds``; a write of ``__class__`` by a class swap;
- a read that found nothing (``getattr`` with a default, probing what the object is) by any
  entry listing the name: the coupling is to the attribute where it is there;
- a name in ``attrs`` is there on every instance (``check_instance`` requires it): found
  absent, it belongs in ``probes``.

Every attribute the table lists is touched by the run, or is in :data:`NOT_RUN` with the
path that touches it; and every one of those is named in our code (a static check).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import enum
import queue
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import megatron_ext
from megatron_ext import seam
from megatron_ext.offload import host_memory
from tests.support import seam_access
from tests.support.seam_access import Access, AccessLog

pytestmark = pytest.mark.mcore

PACKAGE = Path(megatron_ext.__file__).parent
BF16 = torch.bfloat16
H, F, BATCH = 16, 24, 4

# (entry, attribute) of a read, (entry, attribute, "write") of a write or an add -> the path
# that touches it, which the run above does not take.
NOT_RUN: dict[tuple[str, ...], str] = {
    ("TransformerConfig", "pipeline_model_parallel_size"): "megatron_ext.train's check "
    "that every --keep-in-fp32-params pattern matched (Megatron-LM's training loop)",
}


class Net(torch.nn.Module):
    """bf16 weights, a bf16 gate marked ``keep_in_fp32`` (an fp32 island) and a natively
    fp32 scale: a bf16 buffer and an fp32 one."""

    def __init__(self, seed: int = 3):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter((torch.randn(F, H, generator=g) * 0.3).to(BF16))
        self.w2 = torch.nn.Parameter((torch.randn(H, F, generator=g) * 0.3).to(BF16))
        self.gate = torch.nn.Parameter(torch.randn(H, generator=g).to(BF16))
        self.scale = torch.nn.Parameter(torch.randn(H, generator=g))
        megatron_ext.mark_keep_in_fp32(self.gate)

    def forward(self, x, t):
        h = torch.relu(x @ self.w1.t()) @ self.w2.t()
        y = h.float() * self.gate.float() * self.scale
        return ((y - t) ** 2).mean()

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {}, sharded_offsets)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, H, generator=g).to(BF16), torch.randn(BATCH, H, generator=g)


def _net_loss(model, step: int) -> torch.Tensor:
    return model(*_batch(step))


def _steps(model, opt, steps, loss=_net_loss) -> None:
    for s in steps:
        model.zero_grad_buffer()
        opt.zero_grad()
        loss(model, s).backward()
        model.finish_grad_sync()
        ok, norm, _ = opt.step()
        assert ok and torch.isfinite(norm)


def _config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, bf16=True, params_dtype=BF16
    )


# w2's gradient accumulates in an fp32 island (megatron-core's fp32 local accumulation)
DDP = dict(param_name_patterns_for_fp32_local_accumulation=("w2",))


# Adam clipped, CPU-offloaded at 0.5 with the precision-aware optimizer
OFFLOADED = dict(
    optimizer="adam",
    lr=0.01,
    clip_grad=1.0,
    optimizer_cpu_offload=True,
    optimizer_offload_fraction=0.5,
    use_precision_aware_optimizer=True,
)


def _net_stack(seed: int = 3, **options):
    """``Net`` in our DDP, :data:`OFFLOADED` through host mirrors
    (``MegatronOptions(**options)``)."""
    stack = megatron_ext.build_stack(
        Net(seed),
        _config(),
        ddp=DDP,
        optimizer=OFFLOADED,
        options=megatron_ext.MegatronOptions(offload_chunk_numel=64, **options),
    )
    return stack.model, stack.optimizer


def _sharded(model, opt, loading: bool) -> dict:
    state = {"model": model.module.sharded_state_dict()}
    state["optimizer"] = opt.sharded_state_dict(
        state["model"],
        is_loading=loading,
        metadata={"distrib_optim_sharding_type": "fully_reshardable"},
    )
    return state


def _gpt_run() -> None:
    """A tiny MoE GPT: built, its state dict for a load before any step, a step, the audit."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=H, num_attention_heads=4, bf16=True, params_dtype=BF16,
        pipeline_dtype=BF16, num_moe_experts=2, moe_router_topk=1, moe_router_pre_softmax=True,
        moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather", add_bias_linear=False,
    )  # fmt: skip
    gpt = GPTModel(
        config, get_gpt_layer_local_spec(num_experts=2), vocab_size=32, max_sequence_length=8
    )
    for layer in gpt.decoder.layers:
        megatron_ext.mark_keep_in_fp32(layer.mlp.router.weight)
    ddp_config = megatron_ext.DistributedDataParallelConfig(
        per_dtype_grad_buffers=True, use_distributed_optimizer=True
    )
    model = megatron_ext.DistributedDataParallel(
        config, ddp_config, megatron_ext.Float16Module(config, gpt)
    )
    opt = megatron_ext.get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=0.01, clip_grad=1.0, bf16=True, use_distributed_optimizer=True
        ),
        [model],
    )
    _sharded(model, opt, loading=True)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(8).expand(2, 8)
    _steps(model, opt, [0], lambda m, s: m(tokens, positions, None, labels=tokens).mean())
    megatron_ext.audit_norm_ownership([model], opt)
    megatron_ext.explain_norm([model], opt)
    opt.per_param_grad_norms()


def _offload_runs(checkpoint: str) -> None:
    """The offloaded steps: exact with a checkpoint, delayed, overlapped, per parameter; a
    refused configuration."""
    from megatron.core import dist_checkpointing

    model, opt = _net_stack(offload_step="chunked")
    _steps(model, opt, range(2))
    dist_checkpointing.save(_sharded(model, opt, loading=False), checkpoint)
    model, opt = _net_stack(seed=4, offload_step="chunked")
    loaded = dist_checkpointing.load(_sharded(model, opt, loading=True), checkpoint)
    model.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    _steps(model, opt, range(2, 3))

    model, opt = _net_stack(
        offload_step="chunked", offload_delayed_update=True, offload_delay_warmup=1
    )
    _steps(model, opt, range(3))
    opt.state_dict()
    _steps(model, opt, range(3, 4))
    assert megatron_ext.drain_offload(opt) == 1

    model, opt = _net_stack(offload_step="chunked", offload_overlap_forward=True)
    _steps(model, opt, range(3))
    assert megatron_ext.drain_offload(opt) == 1

    model, opt = _net_stack(offload_step="per_parameter")
    _steps(model, opt, range(2))

    # the fraction chosen for the GPU's free memory (1 MiB here), set on a copy of the config
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(host_memory, "gpu_free_bytes", lambda: 1 << 20)
        _net_stack(offload_fraction="auto", offload_gpu_headroom=0)

    # refused at construction: a loss scale over bf16 gradients (its message reads the config)
    with pytest.raises(megatron_ext.UnsupportedCombinationError, match="loss_scale=1024.0"):
        megatron_ext.build_stack(
            Net(), _config(), ddp=DDP, optimizer={**OFFLOADED, "loss_scale": 1024.0}
        )


def _float16_run() -> None:
    """Configs built by the caller (build_stack checks them), no distributed optimizer."""
    from megatron.core.optimizer import OptimizerConfig

    stack = megatron_ext.build_stack(
        Net(),
        _config(),
        distributed_optimizer=False,
        ddp=megatron_ext.DistributedDataParallelConfig(
            per_dtype_grad_buffers=True, use_distributed_optimizer=False, **DDP
        ),
        optimizer=OptimizerConfig(optimizer="adam", lr=0.01, clip_grad=1.0, bf16=True),
    )
    model, opt = stack.model, stack.optimizer
    _steps(model, opt, range(2))
    _sharded(model, opt, loading=True)
    opt.load_state_dict(opt.state_dict())


@contextlib.contextmanager
def _one_rank(tmp_path, monkeypatch):
    """One gloo rank in this process, the CPU shim, megatron-core's parallel state, its
    offload placement as on a device, its checkpoint writer without a subprocess."""
    import megatron.core.dist_checkpointing.strategies.filesystem_async as writer
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
    from megatron.core.tensor_parallel import random as mp_random

    from tests.support.cpu_megatron import cpu_megatron
    from tests.support.offload_sim import placement

    monkeypatch.setattr(
        HybridDeviceOptimizer,
        "_get_sub_optimizer_param_groups",
        lambda self, fraction: placement(self.param_groups, fraction),
    )
    # megatron-core's CUDA RNG tracker: no device generator here, and nothing reads it
    monkeypatch.setattr(
        type(mp_random.get_cuda_rng_tracker()),
        "fork",
        lambda self, *a, **k: contextlib.nullcontext(),
    )
    # the checkpoint writer's results queue lives in a subprocess it spawns; the writes
    # themselves run on threads of this process
    monkeypatch.setattr(writer, "_results_queue", queue.Queue())
    if not writer.HAVE_PSUTIL:  # it only logs the process's memory
        monkeypatch.setattr(writer, "_process_memory", lambda: 0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with cpu_megatron(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parallel_state.initialize_model_parallel()
            try:
                yield
            finally:
                parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def _run(checkpoint: Path) -> None:
    checkpoint.mkdir()
    _gpt_run()
    _offload_runs(str(checkpoint))
    _float16_run()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> AccessLog:
    """Every access of the run (module docstring). It runs twice: first unrecorded, so that
    every module of megatron-core it imports lazily (checkpoint strategies, model code) is
    loaded and its classes are hooked the second time."""
    tmp = tmp_path_factory.mktemp("seam")
    with (
        torch.random.fork_rng(devices=[]),  # the GPT's initial values: seeded, then restored
        pytest.MonkeyPatch.context() as patch,
        _one_rank(tmp, patch),
    ):
        _run(tmp / "warm-up")
        before = set(seam_access.megatron_roots())
        with seam_access.recording() as log:
            _run(tmp / "recorded")
        after = set(seam_access.megatron_roots())
    assert after <= before, f"classes loaded during the recorded run: {after - before}"
    return log


# -- the comparison ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scope:
    """What an entry covers: the instances of ``cls``, and ``member``, when its target is a
    method or value of that class."""

    entry: seam.Entry
    cls: type
    member: str | None


def scopes(entries) -> list[Scope]:
    """The entries that apply to the installed megatron-core and name a class, with it."""
    version = seam.installed_version()
    out = []
    for e in entries:
        if e.target.startswith(seam.DEFERRED) or not seam._applies(e, version):
            continue
        if e.optional and not seam._present(e):
            continue
        target = seam._resolve(e)
        if isinstance(target, type):
            out.append(Scope(e, target, None))
            continue
        owner, member = seam._owner(e)
        if isinstance(owner, type):
            out.append(Scope(e, owner, member))
    return out


def covers(scope: Scope, access: Access) -> bool:
    e = scope.entry
    if scope.cls not in access.cls.__mro__:
        return False
    if access.mode == "read":
        return access.name in (*e.attrs, *e.probes, *e.adds) or access.name == scope.member
    if access.name == "__class__":
        return e.how == "class swap" and scope.member is None
    return access.name in (*e.writes, *e.adds)


def uncovered(log: AccessLog, entries) -> list[str]:
    """Every access no entry covers, with where our code made it."""
    found = scopes(entries)
    names = {n for s in found for n in (*s.entry.attrs, *s.entry.probes, *s.entry.adds)}
    out = []
    for access, where in sorted(log.where.items(), key=lambda item: _order(item[0])):
        if any(covers(s, access) for s in found):
            continue
        if access in log.absent and access.name in names:
            continue  # a probe for an attribute of another kind of object
        out.append(f"{_describe(access)} ({where})")
    return out


def misfiled_probes(log: AccessLog, entries) -> list[str]:
    """Names an entry lists as always there (``attrs``) that a read found absent."""
    return [
        f"{_describe(a)} ({log.where[a]}): {s.entry.name!r} lists it in attrs"
        for a in sorted(log.absent, key=_order)
        for s in scopes(entries)
        if s.cls in a.cls.__mro__ and a.name in s.entry.attrs
    ]


FIELDS = {"attrs": "read", "probes": "read", "writes": "write", "adds": "write"}


def listed(entries) -> list[tuple[Scope, str, str]]:
    """(scope, field, attribute) of every attribute the applicable entries list."""
    return [
        (s, field, name)
        for s in scopes(entries)
        for field in FIELDS
        for name in getattr(s.entry, field)
    ]


def touched(log: AccessLog, scope: Scope, field: str, name: str) -> bool:
    mode = FIELDS[field]
    return any(a.name == name and a.mode == mode and scope.cls in a.cls.__mro__ for a in log.where)


def _mark(scope: Scope, field: str, name: str) -> tuple:
    """The key of :data:`NOT_RUN` for a listed attribute (writes and adds name the mode)."""
    key = (scope.entry.name, name)
    return key if FIELDS[field] == "read" else (*key, "write")


def _order(access: Access):
    return (_megatron_class(access.cls).__qualname__, access.name, access.mode)


def _megatron_class(cls: type) -> type:
    return next(k for k in cls.__mro__ if (k.__module__ or "").startswith("megatron."))


def _describe(access: Access) -> str:
    return f"{access.mode} of {_megatron_class(access.cls).__qualname__}.{access.name}"


def test_every_attribute_our_code_touches_is_in_the_table(recorded):
    assert recorded.where, "nothing was recorded"
    missing = uncovered(recorded, seam.ENTRIES)
    assert not missing, "not in megatron_ext/seam.py's table:\n" + "\n".join(missing)


def test_what_the_table_says_is_always_there_was_there(recorded):
    wrong = misfiled_probes(recorded, seam.ENTRIES)
    assert not wrong, "found absent, so a probe:\n" + "\n".join(wrong)


def test_every_attribute_the_table_lists_is_touched_or_marked(recorded):
    unused, stale = [], []
    for scope, field, name in listed(seam.ENTRIES):
        mark = _mark(scope, field, name)
        if touched(recorded, scope, field, name):
            if mark in NOT_RUN:
                stale.append(f"{mark}: the run touches it")
        elif mark not in NOT_RUN:
            unused.append(f"{scope.entry.name!r} {field} {name!r}")
    known = {_mark(*x) for x in listed(seam.ENTRIES)}
    stale += [f"{mark}: no entry lists it" for mark in NOT_RUN if mark not in known]
    assert not unused, "listed, never touched (mark it in NOT_RUN with the path):\n" + "\n".join(
        unused
    )
    assert not stale, "stale NOT_RUN marks:\n" + "\n".join(stale)


def test_the_run_hooked_every_kind_of_object_the_table_names(recorded):
    unhooked = [
        s.entry.name
        for s in scopes(seam.ENTRIES)
        if not any(h in s.cls.__mro__ for h in recorded.hooked)
    ]
    assert not unhooked


# -- the table against our code, without running it --------------------------------------


def _our_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name not in ("seam.py", "seam_signatures.py"):
            yield path, ast.parse(path.read_text())


def named_in_our_code() -> set[str]:
    """Attribute names our code uses: ``x.name`` and strings (``getattr(x, "name")``,
    a constant holding the name)."""
    out = set()
    for _, tree in _our_modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                out.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.add(node.value)
    return out


def test_every_attribute_the_table_lists_is_named_in_our_code():
    names = named_in_our_code()
    stale = sorted(
        f"{e.name!r} {field} {name!r}"
        for e in seam.ENTRIES
        for field in FIELDS
        for name in getattr(e, field)
        if name not in names
    )
    assert not stale, "the table lists attributes no code of ours names:\n" + "\n".join(stale)


def _private_members(cls: type) -> set[str]:
    """The private names megatron-core gives ``cls``'s instances: class members and
    ``self._x = ...`` in its methods' source."""
    import inspect

    out = {n for n in vars(cls) if n.startswith("_") and not n.startswith("__")}
    try:
        tree = ast.parse(inspect.getsource(cls).lstrip())
    except (OSError, TypeError, SyntaxError):
        return out
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            out.add(node.attr)
    return out


def _ours_defined() -> set[str]:
    """Names our code defines: functions, classes, and attributes assigned or annotated in
    a class body or on ``self``."""
    out = set()
    for _, tree in _our_modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out.add(node.name)
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    out.add(t.id)
                elif (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                ):
                    out.add(t.attr)
    return out


def test_every_private_megatron_core_attribute_our_code_names_is_in_the_table():
    """Static, for paths the run may not take: a private attribute of a class the table
    names (``_cpu_optimizer_map_data_event``) that our code names, and does not define
    itself, is listed by an entry of that class."""
    named = named_in_our_code() - _ours_defined()
    found = scopes(seam.ENTRIES)
    lists = {
        n
        for s in found
        for n in (*s.entry.attrs, *s.entry.probes, *s.entry.writes, *s.entry.adds, s.member)
    }
    missing = {
        f"{cls.__qualname__}.{name}"
        for cls in {s.cls for s in found}
        for name in (_private_members(cls) & named) - lists
    }
    assert not missing, sorted(missing)


# -- the comparison, checked on a table with a gap -----------------------------------------


def _without(entries, entry_name: str, field: str, name: str):
    out = []
    for e in entries:
        if e.name == entry_name:
            assert name in getattr(e, field), (entry_name, field, name)
            e = dataclasses.replace(e, **{field: tuple(n for n in getattr(e, field) if n != name)})
        out.append(e)
    return out


@pytest.mark.parametrize(
    "entry, field, name, access",
    [
        ("HybridDeviceOptimizer", "attrs", "_cpu_optimizer_map_data_event",
         "read of HybridDeviceOptimizer._cpu_optimizer_map_data_event"),
        ("bucket group", "writes", "param_gather_handle",
         "write of _ParamAndGradBucketGroup.param_gather_handle"),
        ("bucket group param sync", "writes", "start_param_sync",
         "write of _ParamAndGradBucketGroup.start_param_sync"),
        ("HybridDeviceOptimizer", "adds", "offload", "write of HybridDeviceOptimizer.offload"),
        ("any optimizer", "probes", "grad_scaler", "read of DistributedOptimizer.grad_scaler"),
        ("DistributedDataParallel", "probes", "bucket_groups",
         "read of DistributedDataParallel.bucket_groups"),
    ],
)  # fmt: skip
def test_an_attribute_taken_out_of_the_table_is_named(recorded, entry, field, name, access):
    assert not uncovered(recorded, seam.ENTRIES)
    missing = uncovered(recorded, _without(seam.ENTRIES, entry, field, name))
    assert any(m.startswith(access + " (megatron_ext.") for m in missing), missing


def test_a_class_swap_is_covered_only_by_a_class_swap_entry(recorded):
    assert not uncovered(recorded, seam.ENTRIES)
    kept = [dataclasses.replace(e, how="re-point") if e.name == "ChainedOptimizer" else e
            for e in seam.ENTRIES]  # fmt: skip
    assert any(
        m.startswith("write of ChainedOptimizer.__class__") for m in uncovered(recorded, kept)
    )


def test_a_read_that_found_nothing_is_covered_only_by_an_entry_listing_the_name():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    log = AccessLog()
    # asking whether it is a chain (ChainedOptimizer's attribute), and a name nobody lists
    for name in ("chained_optimizers", "no_entry_lists_this"):
        log.note(Access(DistributedOptimizer, name, "read"), "megatron_ext.x:1", found=False)
    log.note(Access(DistributedOptimizer, "buffers", "read"), "megatron_ext.x:2", found=False)
    assert uncovered(log, seam.ENTRIES) == [
        "read of DistributedOptimizer.no_entry_lists_this (megatron_ext.x:1)"
    ]
    assert misfiled_probes(log, seam.ENTRIES) == [
        "read of DistributedOptimizer.buffers (megatron_ext.x:2): 'DistributedOptimizer' "
        "lists it in attrs"
    ]


def test_an_attribute_listed_but_never_touched_is_reported(recorded):
    extra = [
        dataclasses.replace(e, probes=(*e.probes, "not_an_attribute"))
        if e.name == "bucket group"
        else e
        for e in seam.ENTRIES
    ]
    unused = [
        (s.entry.name, f, n)
        for s, f, n in listed(extra)
        if not touched(recorded, s, f, n) and _mark(s, f, n) not in NOT_RUN
    ]
    assert unused == [("bucket group", "probes", "not_an_attribute")]


# -- the recorder itself -------------------------------------------------------------------

FAKE = "megatron.core.fake_for_the_recorder"


def _fake_megatron():
    """A megatron-core class (by its module), a subclass of ours, and a torch module of
    megatron-core's that shadows a torch method with an attribute of its own."""

    class Core:
        level = 1
        other = 8  # read only where it must not be noted
        shared = 9  # read only by buffers' code

        def __init__(self):
            self.kept = 2

        def method(self):
            return 3

    Core.__module__ = FAKE

    class Ours(Core):
        mine = 4

    class CoreModule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.buffers = [5]
            self.inner = torch.nn.Linear(1, 1)

    CoreModule.__module__ = FAKE
    return Core, Ours, CoreModule


def _run_as(module: str, source: str, **names) -> dict:
    """Run ``source`` as code of ``module`` (from a file of that name)."""
    scope = {"__name__": module, **names}
    exec(compile(source, f"/{module.replace('.', '/')}.py", "exec"), scope)
    return scope


def test_the_recorder_notes_what_our_code_touches_and_nothing_else():
    Core, Ours, CoreModule = _fake_megatron()
    core, ours, mod = Core(), Ours(), CoreModule()
    source = """
a = obj.kept
b = obj.level
c = obj.method()
d = getattr(obj, "absent", None)
e = ours.mine
obj.kept = 6
obj.added = 7
del obj.added
f = mod.buffers
g = mod.inner
h = mod.named_parameters
i = isinstance(obj, list)
j = obj.__dict__
ours.__class__ = Core
"""
    with seam_access.recording([Core, CoreModule]) as log:
        _run_as("megatron_ext.fake", source, obj=core, ours=ours, mod=mod, Core=Core)
        _run_as("tests.fake", source, obj=Core(), ours=Ours(), mod=CoreModule(), Core=Core)
        _run_as("tests.fake", "x = obj.other", obj=core)
        _run_as("buffers.fake", "x = obj.shared", obj=core)
        _run_as("megatron_ext.seam", "x = obj.other", obj=core)
        scope = {"__name__": "megatron_ext.generated", "obj": core}
        exec(compile("y = obj.other", "<string>", "exec"), scope)  # no file: generated
    got = {(a.cls.__name__, a.name, a.mode) for a in log.where}
    assert got == {
        ("Core", "kept", "read"),
        ("Core", "level", "read"),
        ("Core", "method", "read"),
        ("Core", "shared", "read"),
        ("Core", "absent", "read"),
        ("Core", "kept", "write"),
        ("Core", "added", "write"),
        ("CoreModule", "buffers", "read"),
        ("CoreModule", "inner", "read"),
        ("Ours", "__class__", "write"),
    }
    assert {(a.name, a.mode) for a in log.absent} == {("absent", "read")}
    assert log.where[Access(Core, "shared", "read")] == "buffers.fake:1"
    assert all(
        w.startswith("megatron_ext.fake:")
        for a, w in log.where.items()
        if a != Access(Core, "shared", "read")
    )
    assert log.hooked == [Core, CoreModule]
    # the hooks are gone, and the objects work as before
    assert "__getattribute__" not in vars(Core) and "__setattr__" not in vars(CoreModule)
    assert core.kept == 6 and not hasattr(core, "added") and mod.inner.in_features == 1


def test_the_recorder_hooks_each_megatron_core_class_tree_once(monkeypatch):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    assert MegatronOptimizer in seam_access.megatron_roots()
    assert DistributedOptimizer not in seam_access.megatron_roots()

    class Base:
        pass

    class Plain(Base):
        pass

    class Frozen(Base):  # its own attribute access would bypass Base's hook
        def __setattr__(self, name, value):
            raise AttributeError(name)

    class Kind(enum.Enum):
        A = 1

    class Failure(Exception):
        pass

    class Slotted:
        __slots__ = ("x",)

    module = types.ModuleType(FAKE)
    for c in (Base, Plain, Frozen, Kind, Failure, Slotted):
        c.__module__ = FAKE
        setattr(module, c.__name__, c)
    module.Imported = torch.nn.Linear  # another module's class, named here
    monkeypatch.setitem(sys.modules, FAKE, module)
    mine = [c for c in seam_access.megatron_roots() if c.__module__ == FAKE]
    assert mine == [Base, Frozen]


def test_a_seam_check_is_not_a_use():
    Core, _, _ = _fake_megatron()
    entry = seam.Entry("fake", f"{FAKE}:Core", "read", "reads kept", "test", attrs=("kept",))
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, FAKE, types.SimpleNamespace(Core=Core))
        patch.setitem(seam._BY_NAME, "fake", entry)
        with seam_access.recording([Core]) as log:
            seam.check_instance("fake", Core())
    assert not log.where
