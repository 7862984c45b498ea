"""One rank of the multi-rank GPU suite: several ranks on one GPU over gloo.

Launched by ``tests/gpu/test_multirank_gpu.py`` as
``torchrun --nproc_per_node N tests/gpu/multirank_worker.py --out DIR CONFIG...`` with
``tests/support/multirank`` first on ``PYTHONPATH``. For each configuration (parallel
sizes, optimizer kind, offload, loss scaling) every rank builds the same model twice, with
``per_dtype_grad_buffers`` on and off (stock megatron-core), trains three clipped steps
with each, and checks on every step:

- the flat norm against an fp64 reference over the full, unsharded gradients: every rank
  sends the gradient elements megatron-core's own range functions say it owns
  (``DistributedOptimizer._build_gbuf_range_map``; the whole gradient on data-parallel
  rank 0 without the distributed optimizer), all ranks gather them, and pieces are joined
  by (pipeline stage, name, tensor-parallel piece, expert rank), each element once;
- the norm against stock's where stock runs, and parameters after the steps against
  stock's within bf16 rounding (where stock cannot build, against an fp64 reference and a
  run of ours without offload);
- from the second step on, ours computes every parameter's norm in the step's norm pass
  (``request_per_param_grad_norms``): each against the fp64 norm of that name's full
  gradient (all its pieces), their total equal to the step's norm, the root of the
  counted squares equal to the total;
- the collectives each optimizer step issues (function, reduce op, group) against stock's;
- the runtime norm-ownership audit.

Gradients are small multiples of 1/64, so every data-parallel reduction is exact in bf16,
fp16 and fp32 alike: ours (fp32 islands) and stock (bf16 there) see the same gradients.
Each rank writes ``DIR/rank<r>.json``: per configuration, a list of failures (empty when
every check passed) and the numbers behind them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
import traceback
import zlib

import torch
import torch.distributed as dist

# Collectives issued while RECORDING is on, as (function, reduce op, group ranks). Installed
# (install_recorder) before megatron-core is imported, so its references go through it too.
RECORDING: list | None = None
_NAMES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather",
          "broadcast", "_all_gather_base", "_reduce_scatter_base", "all_gather_object")  # fmt: skip


def _recorder(name, fn):
    def wrapper(*args, **kwargs):
        if RECORDING is not None:
            group = kwargs.get("group")
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else "world"
            RECORDING.append((name, str(kwargs.get("op", "")), ranks))
        return fn(*args, **kwargs)

    return wrapper


def install_recorder() -> None:
    """Wrap the collectives; called in the worker only, before megatron-core is imported."""
    for n in _NAMES:
        if hasattr(dist, n):
            wrapped = _recorder(n, getattr(dist, n))
            setattr(dist, n, wrapped)
            setattr(dist.distributed_c10d, n, wrapped)


H = 256
STEPS = 3
CLIP = 1.0

# name: world size and options. distopt: distributed optimizer; pa: precision-aware;
# offload: CPU offload fraction (None: no offload); tp/pp/ep/etp: parallel sizes; sp:
# sequence parallel; scale: "dynamic" (fp16) or a static bf16 loss scale; kind "float16"
# / "fp32": the non-distributed optimizers; buckets: a small bucket size (several buckets).
CONFIGS = {
    "dp2": dict(world=2),
    "dp2_buckets": dict(world=2, buckets=True),
    "dp2_offload0.5": dict(world=2, offload=0.5),
    "dp2_offload1.0": dict(world=2, offload=1.0),
    "dp2_pa_offload0.0": dict(world=2, pa=True, offload=0.0),
    "dp2_pa_offload0.5": dict(world=2, pa=True, offload=0.5, buckets=True),
    "dp2_pa_offload1.0": dict(world=2, pa=True, offload=1.0),
    "tp2_sp": dict(world=2, tp=2, sp=True),
    "ep2_etp1": dict(world=2, ep=2),
    "pp2": dict(world=2, pp=2),
    "dp2_fp16_dynamic": dict(world=2, scale="dynamic"),
    "dp2_bf16_static": dict(world=2, scale=1024.0),
    "dp2_float16": dict(world=2, distopt=False),
    "dp2_float16_bf16_static": dict(world=2, distopt=False, scale=1024.0),
    "dp2_fp32": dict(world=2, distopt=False, fp32=True),
    "dp4": dict(world=4, buckets=True),
    "dp4_pa_offload0.5": dict(world=4, pa=True, offload=0.5),
    # the chunked offload step (MegatronOptions(offload_step="chunked")): also compared
    # bit for bit with ours stepping per parameter
    "dp2_pa_offload1.0_chunked": dict(world=2, pa=True, offload=1.0, offload_step="chunked"),
    "dp2_pa_offload0.5_chunked": dict(
        world=2, pa=True, offload=0.5, buckets=True, offload_step="chunked"
    ),
    "dp2_offload1.0_chunked": dict(world=2, offload=1.0, offload_step="chunked"),
    "dp4_offload1.0": dict(world=4, offload=1.0),
    "dp2_tp2_sp": dict(world=4, tp=2, sp=True),
    "ep2_etp2": dict(world=4, tp=2, ep=2, etp=2),
    "pp2_dp2": dict(world=4, pp=2),
}
# The guarantees matrix at two ranks (docs/guarantees.md): fp32 local accumulation of some
# parameters (a pattern) or all, with each dtype and loss scaler, for every optimizer kind.
# bf16 + precision-aware + a loss scale is refused at construction (tests/test_refusals.py,
# tests/gpu/test_guarantees_gpu.py) unless every bf16 gradient is read in fp32 ('all').
_OPTIMIZER_KINDS = {
    "distopt": {},
    "float16": dict(distopt=False),
    "pa_offload1.0": dict(pa=True, offload=1.0),
    "pa_offload0.5": dict(pa=True, offload=0.5, buckets=True),
}
_SCALERS = {
    "bf16": {},
    "bf16_static": dict(scale=1024.0),
    "fp16_static": dict(fp16=True, scale=1024.0),
    "fp16_dynamic": dict(scale="dynamic"),
}
if importlib.util.find_spec("transformer_engine") is not None:
    # precision-aware on the GPU: megatron-core's FusedAdam from transformer-engine (without
    # TE it has no precision-aware optimizer); fp32 local accumulation is refused with it
    _OPTIMIZER_KINDS["pa_te"] = dict(pa=True)
    # (fp16 precision-aware: stock's clip asserts bf16/fp32 decoupled gradients, so those
    # compare parameters with ours without precision-aware)
for _o, _ocfg in _OPTIMIZER_KINDS.items():
    for _p, _pat in {"none": (), "row": ("*row*",), "all": ("all",)}.items():
        for _s, _scfg in _SCALERS.items():
            if _ocfg.get("pa") and _s == "bf16_static" and _p != "all":
                continue  # refused: precision-aware + a loss scale + bf16 gradients
            if _o == "pa_te" and _p == "row":
                continue  # refused: TE's FusedAdam + fp32 local accumulation of some
            CONFIGS[f"dp2_{_o}_fp32acc_{_p}_{_s}"] = dict(world=2, patterns=_pat, **_ocfg, **_scfg)


def is_fp16(cfg) -> bool:
    return cfg.get("scale") == "dynamic" or bool(cfg.get("fp16"))


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


class Spec:
    """One parameter: local shape, dtype, how it is split and marked."""

    def __init__(self, name, shape, dtype, *, split=False, expert=False, shared=False,
                 keep_fp32=False, sp=False):  # fmt: skip
        self.name, self.shape, self.dtype = name, shape, dtype
        self.split, self.expert, self.shared, self.keep_fp32, self.sp = (
            split,
            expert,
            shared,
            keep_fp32,
            sp,
        )


def specs_for(cfg, ranks) -> list[Spec]:
    """The parameters of this rank's model chunk.

    Pipeline stage 0 (or the only stage): TP-split column/row weights, a replicated row
    bias and layernorm (duplicates across TP ranks; sequence-parallel flagged with SP), a
    ``shared`` tied weight, natively fp32 sink, a bf16 weight marked keep-in-fp32, and with
    EP two local experts (weight split over expert TP, bias replicated over it). With PP the
    second stage holds only fp32 parameters and the first none.
    """
    tp, etp = cfg.get("tp", 1), cfg.get("etp", 1)
    low = torch.float32 if cfg.get("fp32") else (torch.float16 if is_fp16(cfg) else torch.bfloat16)
    if cfg.get("pp", 1) > 1 and ranks["pp"] == 1:
        return [
            Spec("final_norm.weight", (H,), torch.float32),
            Spec("head.sink", (4 * H,), torch.float32),
        ]
    out = [
        Spec("col.weight", (4 * H // tp, H), low, split=True),
        Spec("col.bias", (4 * H // tp,), low, split=True),
        Spec("row.weight", (H, 4 * H // tp), low, split=True),
        Spec("row.bias", (H,), low),
        Spec("norm.weight", (H,), low, sp=cfg.get("sp", False)),
        Spec("embed.weight", (64, H), low, shared=True),
    ]
    if cfg.get("pp", 1) == 1 and not cfg.get("fp32"):
        out += [
            Spec("sink", (H // 2,), torch.float32),
            Spec("hc.alpha", (3 * H,), low, keep_fp32=True),
        ]
    if cfg.get("ep", 1) > 1:
        for k in range(2):
            out += [
                Spec(f"experts.{k}.weight", (2 * H // etp, H), low, split=etp > 1, expert=True),
                Spec(f"experts.{k}.bias", (H,), low, expert=True),
            ]
    return out


def piece_of(spec, ranks):
    """(tensor-parallel piece or None, expert rank or None): what tells copies apart."""
    tp_piece = (ranks["etp"] if spec.expert else ranks["tp"]) if spec.split else None
    return tp_piece, ranks["ep"] if spec.expert else None


class Chunk(torch.nn.Module):
    """The parameters of ``specs``; the loss is sum(param * target): grad = target."""

    def __init__(self, specs, ranks, *, mark):
        super().__init__()
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        import megatron_ext

        self.specs = specs
        for s in specs:
            tp_piece, ep = piece_of(s, ranks)
            # Same values on every data-parallel rank and every copy of a duplicate.
            init = torch.randn(s.shape, generator=seeded("init", s.name, tp_piece, ep)) * 0.02
            p = torch.nn.Parameter(init.to(s.dtype).cuda())
            if s.split:
                set_tensor_model_parallel_attributes(p, True, 0, 1)
            if s.expert:
                p.allreduce = False
            if s.shared:
                p.shared = True
            if s.sp:
                p.sequence_parallel = True
            if s.keep_fp32 and mark:
                megatron_ext.mark_keep_in_fp32(p)
            self.register_parameter(s.name.replace(".", "_"), p)

    def named_specs(self):
        return [(s, getattr(self, s.name.replace(".", "_"))) for s in self.specs]


def targets(chunk, ranks, step):
    """Per parameter: integers in [-16, 16] / 64, fresh per step and data-parallel rank;
    equal on every copy of a tensor-parallel duplicate."""
    out = {}
    for s, p in chunk.named_specs():
        tp_piece, ep = piece_of(s, ranks)
        dp = ranks["edp"] if s.expert else ranks["dp"]
        g = seeded("grad", s.name, tp_piece, ep, dp, step)
        out[s.name] = (torch.randint(-16, 17, p.shape, generator=g).float() / 64).cuda()
    return out


def current_ranks():
    from megatron.core import parallel_state as ps

    return {
        "world": dist.get_rank(),
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_rank(),
        "edp": ps.get_expert_data_parallel_rank(),
    }


def build(cfg, option, ranks, offload_override=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_ext

    fp16 = is_fp16(cfg)
    fp32 = cfg.get("fp32", False)
    low = torch.float32 if fp32 else (torch.float16 if fp16 else torch.bfloat16)
    chunk = Chunk(specs_for(cfg, ranks), ranks, mark=option)
    tcfg = TransformerConfig(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=4,
        bf16=not (fp16 or fp32),
        fp16=fp16,
        params_dtype=low,
        pipeline_dtype=low,
        tensor_model_parallel_size=cfg.get("tp", 1),
        pipeline_model_parallel_size=cfg.get("pp", 1),
        sequence_parallel=cfg.get("sp", False),
    )
    distopt = cfg.get("distopt", True)
    offload = cfg.get("offload") if offload_override is None else offload_override
    opts = dict(optimizer="adam", lr=1e-3, clip_grad=CLIP, bf16=not (fp16 or fp32), fp16=fp16)
    if cfg.get("pa"):
        opts["use_precision_aware_optimizer"] = True
    if offload is not None and offload is not False:
        opts.update(optimizer_cpu_offload=True, optimizer_offload_fraction=offload)
    scale = cfg.get("scale")
    if scale == "dynamic":
        opts.update(initial_loss_scale=2.0**12, min_loss_scale=1.0, loss_scale_window=1000)
    elif scale is not None:
        opts["loss_scale"] = scale
    stack = megatron_ext.build_stack(
        chunk,
        tcfg,
        per_dtype_grad_buffers=option,
        distributed_optimizer=distopt,
        ddp=dict(
            overlap_grad_reduce=cfg.get("buckets", False),
            bucket_size=20_000 if cfg.get("buckets") else None,
            param_name_patterns_for_fp32_local_accumulation=cfg.get("patterns", ()),
        ),
        optimizer=opts,
        options=megatron_ext.MegatronOptions(offload_step=cfg.get("offload_step", "per_parameter"))
        if option
        else None,
    )
    model, opt = stack.model, stack.optimizer
    return model, opt


def owned_pieces(model, ranks, distributed):
    """What this rank contributes to the reference: [(key, start, values)], fp64 lists."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chunk = model.module
    spec_of = {id(p): s for s, p in chunk.named_specs()}
    out = []
    for buf in model.all_grad_buffers():
        if distributed:
            (per_bucket,) = DistributedOptimizer._build_gbuf_range_map(buf).values()
            ranges = {p: r["param"] for b in per_bucket for p, r in b["param_map"].items()}
        for p, (start, end, _) in buf.param_index_map.items():
            s = spec_of[id(p)]
            if s.shared:
                continue  # megatron-core's rule: a shared (tied) gradient is counted elsewhere
            if distributed:
                if p not in ranges:
                    continue
                lo, hi = ranges[p].start, ranges[p].end
            else:
                if (ranks["edp"] if s.expert else ranks["dp"]) != 0:
                    continue
                lo, hi = 0, end - start
            values = buf.grad_data[start + lo : start + hi].double().cpu().tolist()
            key = (ranks["pp"], s.name, *piece_of(s, ranks), end - start)
            out.append((key, lo, values))
    return out


def reference_norm(model, ranks, distributed, scale):
    """fp64 norm over the full gradients, every element once, from every rank's pieces;
    and per parameter name (its every tensor-parallel piece, expert rank and stage)."""
    mine = owned_pieces(model, ranks, distributed)
    everyone = [None] * dist.get_world_size()
    global RECORDING
    saved, RECORDING = RECORDING, None
    dist.all_gather_object(everyone, mine)
    RECORDING = saved
    full: dict = {}
    for pieces in everyone:
        for key, lo, values in pieces:
            have = full.setdefault(key, {})
            if lo in have:
                if have[lo] != values:  # a duplicate must hold the same gradient
                    raise AssertionError(f"copies of {key} at {lo} differ")
                continue
            have[lo] = values
    total = 0.0
    per_name: dict[str, float] = {}
    for key, parts in full.items():
        numel = key[-1]
        pos = 0
        for lo in sorted(parts):
            if lo != pos:
                raise AssertionError(f"{key}: elements [{pos}, {lo}) were sent by no rank")
            pos += len(parts[lo])
            sq = math.fsum(v * v for v in parts[lo])
            total += sq
            name = key[1].replace(".", "_")  # as registered on the chunk
            per_name[name] = per_name.get(name, 0.0) + sq
        if pos != numel:
            raise AssertionError(f"{key}: elements [{pos}, {numel}) were sent by no rank")
    return math.sqrt(total) / scale, {n: math.sqrt(v) / scale for n, v in per_name.items()}


def run_steps(cfg, model, opt, ranks, *, option, inf_at=None):
    """STEPS clipped steps; per step (ok, norm, reference, loss scale, collectives)."""
    global RECORDING
    import megatron_ext

    distributed = cfg.get("distopt", True)
    out = []
    for step in range(STEPS + (1 if inf_at is not None else 0)):
        model.zero_grad_buffer()
        opt.zero_grad()
        scale = float(opt.get_loss_scale())
        tg = targets(model.module, ranks, step)
        if step == inf_at and ranks["world"] == 0:  # an inf gradient, from the backward
            first = model.module.named_specs()[0][0].name
            tg[first].view(-1)[3] = float("inf")
        loss = sum((p.float() * tg[s.name]).sum() for s, p in model.module.named_specs())
        (loss * scale).backward()
        model.finish_grad_sync()
        ref, ref_names = (None, None)
        if step != inf_at:
            ref, ref_names = reference_norm(model, ranks, distributed, scale)
        # Ours, from the second step on: the step's norm pass is the per-parameter one.
        per_param = option and step >= 1
        if per_param:
            opt.last_per_param_grad_norms = None
            opt.request_per_param_grad_norms()
        RECORDING = []
        ok, norm, _ = opt.step()
        calls, RECORDING = RECORDING, None
        pp = check_per_param(opt, norm, ref, ref_names) if per_param and ref else None
        if option and step == 0:
            # Gathers the names across ranks once (all_gather_object) before the steps
            # whose collectives are compared with stock's; its values are not used.
            opt.per_param_grad_norms()
        out.append(dict(ok=bool(ok), norm=None if norm is None else float(norm), ref=ref,
                        scale=scale, calls=calls, per_param=pp))  # fmt: skip
    if option:
        megatron_ext.audit_norm_ownership([model], opt)
    return out


def check_per_param(opt, norm, ref, ref_names):
    """The step's per-parameter norms against fp64 per name; their total against the
    step's norm and against the root of the counted squares. Returns the numbers."""
    pn = opt.last_per_param_grad_norms
    if pn is None:
        return {"error": "the step kept no per-parameter norms"}
    values = pn.as_dict()
    worst, missing = 0.0, []
    for name, counted in zip(pn.names, pn.counted, strict=True):
        if not counted:
            continue  # a shared (tied) weight: counted nowhere, not in the reference
        if name not in ref_names:
            missing.append(name)
            continue
        want = ref_names[name]
        worst = max(worst, abs(values[name] - want) / max(want, 1e-30))
    counted_sq = math.fsum(values[n] ** 2 for n, c in zip(pn.names, pn.counted, strict=True) if c)
    return {
        "n": len(pn.names),
        "max_rel_err": worst,
        "missing": missing + sorted(set(ref_names) - set(pn.names)),
        "total_vs_step_norm": abs(float(pn.total) - float(norm)) / float(norm),
        "root_of_counted_squares_vs_total": abs(math.sqrt(counted_sq) - float(pn.total))
        / float(pn.total),
        "total_vs_fp64": abs(float(pn.total) - ref) / ref,
    }


def params_of(model):
    return {s.name: p.detach().float().cpu() for s, p in model.module.named_specs()}


def check_config(name, cfg, log):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.get("tp", 1),
        pipeline_model_parallel_size=cfg.get("pp", 1),
        expert_model_parallel_size=cfg.get("ep", 1),
        expert_tensor_parallel_size=cfg.get("etp", 1) if cfg.get("ep", 1) > 1 else None,
    )
    failures, facts = [], {}
    try:
        ranks = current_ranks()
        facts["ranks"] = ranks
        inf_at = 1 if cfg.get("scale") == "dynamic" else None
        torch.manual_seed(0)
        model, opt = build(cfg, True, ranks)
        facts["optimizer"] = type(opt).__name__
        ours = run_steps(cfg, model, opt, ranks, option=True, inf_at=inf_at)
        ours_params = params_of(model)
        facts["ours"] = [{k: v for k, v in s.items() if k != "calls"} for s in ours]
        if cfg.get("offload_step") == "chunked":
            hdos = [c.optimizer for c in opt.chained_optimizers]
            if not all(h.offload.plan is not None for h in hdos):
                failures.append("the chunked offload step did not run")
            per_cfg = {**cfg, "offload_step": "per_parameter"}
            torch.manual_seed(0)
            per_model, per_opt = build(per_cfg, True, ranks)
            run_steps(per_cfg, per_model, per_opt, ranks, option=True, inf_at=inf_at)
            for k, v in params_of(per_model).items():
                if not torch.equal(v, ours_params[k]):
                    failures.append(f"chunked vs per-parameter: parameter {k} differs")
            facts["chunked_vs_per_parameter"] = "compared bit for bit"
        for i, s in enumerate(ours):
            if s["ref"] is None:
                continue
            err = abs(s["norm"] - s["ref"]) / s["ref"]
            if not err <= 1e-6:
                failures.append(
                    f"step {i}: norm {s['norm']!r} vs fp64 {s['ref']!r} (rel {err:.2e})"
                )
            if not s["ref"] > CLIP:
                failures.append(f"step {i}: clipping was not active (norm {s['norm']})")
            pp = s["per_param"]
            if i >= 1 and pp is None:
                failures.append(f"step {i}: no per-parameter norms were checked")
            elif pp is not None:
                bad = (
                    pp.get("error")
                    or pp["missing"]
                    or not (
                        pp["max_rel_err"] <= 1e-6
                        and pp["total_vs_step_norm"] == 0.0
                        and pp["root_of_counted_squares_vs_total"] <= 1e-6
                        and pp["total_vs_fp64"] <= 1e-6
                    )
                )
                if bad:
                    failures.append(f"step {i}: per-parameter norms {pp}")
        if inf_at is not None and ours[inf_at]["ok"]:
            failures.append(f"step {inf_at} had an inf gradient and was not skipped")
        try:
            stock_model, stock_opt = build(cfg, False, ranks)
        except Exception as e:  # noqa: BLE001 - reported: where stock cannot build
            facts["stock_error"] = f"{type(e).__name__}: {e}"
            stock_model = None
        stock = None
        if stock_model is not None:
            try:
                stock = run_steps(cfg, stock_model, stock_opt, ranks, option=False, inf_at=inf_at)
            except Exception as e:  # noqa: BLE001 - reported: where stock cannot step
                facts["stock_error"] = f"{type(e).__name__} at a step: {str(e)[:200]}"
        if stock is not None:
            facts["stock"] = [{k: v for k, v in s.items() if k != "calls"} for s in stock]
            tol = 5e-3 if cfg.get("pa") else 1e-6  # stock's no-TE fallback sums bf16 norms
            for i, (a, b) in enumerate(zip(ours, stock, strict=True)):
                if a["ok"] != b["ok"] or a["scale"] != b["scale"]:
                    failures.append(f"step {i}: ok/scale {a['ok']}/{a['scale']} vs stock "
                                    f"{b['ok']}/{b['scale']}")  # fmt: skip
                if a["norm"] is None or b["norm"] is None:
                    if a["norm"] != b["norm"]:
                        failures.append(f"step {i}: norm {a['norm']} vs stock {b['norm']}")
                    continue
                if abs(a["norm"] - b["norm"]) > tol * b["norm"]:
                    failures.append(f"step {i}: norm {a['norm']!r} vs stock {b['norm']!r}")
                # megatron-core's first step adds a one-time flag all-reduce; compare later ones
                if i > 0 and a["calls"] != b["calls"]:
                    failures.append(f"step {i}: collectives {a['calls']} vs stock {b['calls']}")
            facts["collectives_per_step"] = len(ours[-1]["calls"])
            compare = params_of(stock_model)
            facts["params_vs"] = "stock"
        else:
            # Stock cannot build or step this one: compare with ours without offload/PA.
            base = {**cfg, "pa": False}
            ref_model, ref_opt = build(base, True, ranks, offload_override=False)
            run_steps(base, ref_model, ref_opt, ranks, option=True, inf_at=inf_at)
            compare = params_of(ref_model)
            facts["params_vs"] = "ours without offload or precision-aware"
        worst = 0.0
        for k, v in ours_params.items():
            diff = (v - compare[k]).abs().max().item()
            worst = max(worst, diff / max(compare[k].abs().max().item(), 1e-12))
            if not torch.allclose(v, compare[k], rtol=2**-7, atol=1e-5):
                failures.append(f"parameter {k} differs by up to {diff:.3g} after {STEPS} steps")
        facts["params_max_rel_diff"] = worst
    except Exception:  # noqa: BLE001 - every failure is reported per configuration
        failures.append(traceback.format_exc())
    finally:
        ps.destroy_model_parallel()
    log(f"{name}: {'ok' if not failures else 'FAILED ' + failures[0][:300]}")
    return {"failures": failures, "facts": facts}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for rank<r>.json")
    parser.add_argument("configs", nargs="+", help=f"names from {sorted(CONFIGS)}")
    args = parser.parse_args()
    install_recorder()
    dist.init_process_group("gloo")
    torch.cuda.set_device(0)
    rank = dist.get_rank()

    def log(msg):
        print(f"[rank {rank} {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    results = {}
    for name in args.configs:
        cfg = CONFIGS[name]
        if cfg["world"] != dist.get_world_size():
            raise SystemExit(f"{name} needs {cfg['world']} ranks, not {dist.get_world_size()}")
        results[name] = check_config(name, cfg, log)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
