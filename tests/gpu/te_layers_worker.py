"""One rank of the transformer-engine GPT cells: a GPTModel with TE's layer spec, trained
with per-dtype gradient buffers (``--arm ours``) or stock megatron-core (``--arm stock``).

Launched by ``tests/gpu/test_te_layers_gpu.py`` through ``te_layers_driver.launch`` as
``torchrun --nproc_per_node N tests/gpu/te_layers_worker.py --arm ARM --out DIR CELL...``:
NCCL at one rank, gloo with ``tests/support/multirank`` first on ``PYTHONPATH`` at two (NCCL
refuses two ranks on one GPU). ``--cpu`` runs the same cells on the CPU through
``tests/support/cpu_megatron.py`` with megatron-core's local layer spec instead (the CPU
rehearsal of everything but TE: ``tests/test_te_layers_cells.py``).

The model: a 2-layer GPTModel built from ``get_gpt_layer_with_transformer_engine_spec``
with ``gradient_accumulation_fusion=True``, so TE's layers accumulate their weight gradients
straight into ``main_grad`` (TE's ``fuse_wgrad_accumulation``). megatron-core builds its
output layer (its own ``ColumnParallelLinear``) from the same config field and would need
apex's ``fused_weight_gradient_mlp_cuda`` for it; without apex the output layer is built
with megatron-core's check lifted for the construction only and its own
``gradient_accumulation_fusion`` then turned off (the attribute its forward passes on, and
what ``megatron_ext``'s refusal reads): TE layers fused, megatron-core's layer unfused.
Islands: every layer's MLP output is scaled by a per-layer vector ``hc_alpha`` (as
``benchmarks/train_step.py`` does), fp32 and marked keep-in-fp32 with islands on, bf16/fp16
with them off; everything else is low precision (``megatron_ext.Float16Module``).

Per step (``STEPS`` clipped steps of ``micro`` micro-batches), each rank appends to
``DIR/<arm>-rank<r>.jsonl``: a ``start`` row before each cell (so that a cell that kills
the process is known), then one result row: per step the norm the optimizer returned, the
fp64 reference (``megatron_lm_launcher.reference_norm``: every bucket's reduced
``grad_data``, this rank's shard with the distributed optimizer, squared in fp64 and
all-reduced, divided by the loss scale), the loss and whether the step was taken; how many
TE weights had their gradient accumulated by TE (``grad_added_to_main_grad``); or the
error. Rank 0 saves the parameters after the first step and after the last to
``DIR/<arm>-<cell>-1.pt`` and ``DIR/<arm>-<cell>.pt``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH = 2, 128, 4, 512, 64, 2
STEPS = 3
CLIP = 0.05  # small enough that clipping is active on every step

# name: OptimizerConfig fields, and ours' MegatronOptions.offload_step ("step"); fp16: the
# model and optimizer in fp16 with a dynamic loss scale. All use the distributed optimizer.
KINDS: dict[str, dict] = {
    "distopt": dict(opt={}),
    "pa": dict(opt=dict(use_precision_aware_optimizer=True)),
    **{
        f"pa_offload{fraction}{'_chunked' if step else ''}": dict(
            opt=dict(
                use_precision_aware_optimizer=True,
                optimizer_cpu_offload=True,
                optimizer_offload_fraction=fraction,
            ),
            **({"step": step} if step else {}),
        )
        for fraction in (1.0, 0.5)
        for step in (None, "chunked")
    },
    "fp16": dict(
        opt=dict(initial_loss_scale=2.0**12, min_loss_scale=1.0, loss_scale_window=1000),
        fp16=True,
    ),
}


def cell_name(kind: str, islands: bool, micro: int, world: int) -> str:
    return f"{kind}_islands{'_on' if islands else '_off'}_mb{micro}_w{world}"


def parse_cell(name: str) -> dict:
    """The inverse of :func:`cell_name`."""
    head, mb, w = name.rsplit("_", 2)
    kind, _, islands = head.rpartition("_islands_")
    if kind not in KINDS or islands not in ("on", "off") or mb[:2] != "mb" or w[:1] != "w":
        raise ValueError(f"{name!r} is not a cell name (kind_islands_on|off_mbN_wN)")
    return dict(kind=kind, islands=islands == "on", micro=int(mb[2:]), world=int(w[1:]))


def cells() -> list[str]:
    """Every cell: each kind with islands on and off at one rank with 1 and 2 micro-batches,
    and :data:`TWO_RANK_KINDS` at two ranks with 2 micro-batches."""
    out = []
    for world, micros, kinds in ((1, (1, 2), list(KINDS)), (2, (2,), TWO_RANK_KINDS)):
        for kind in kinds:
            for islands in (True, False):
                out += [cell_name(kind, islands, m, world) for m in micros]
    return out


# At two ranks, one offload cell per step kind (the one-rank cells hold the rest).
TWO_RANK_KINDS = ["distopt", "pa", "pa_offload1.0", "pa_offload0.5_chunked", "fp16"]


# What stock megatron-core (option off) does in each cell, by (kind, islands): "ok" (it runs
# and its norm is right: parameters compared with ours), "nonfinite" (it steps, with a norm
# that is inf or NaN on every step: transformer-engine's multi-tensor norm handed bf16 and
# fp32 decoupled gradients in one list), or the error it raises at construction.
STOCK_NON_LEAF = "can't optimize a non-leaf Tensor"
STOCK_FP32_UNSTEPPED = "fp32 parameters never stepped"
# one fused norm over bf16 and fp32 gradients as one list: a non-finite norm or, on
# 2026-12-05 (pa, islands, one micro-batch), a finite one 1.2e-5 off fp64
STOCK_MIXED_NORM = "wrong or non-finite norm"


def stock_expected(kind: str, islands: bool) -> str:
    if not islands:
        return "ok"
    if kind.startswith("pa_offload"):
        # the fp32 parameter's shard is a view: torch's CPU optimizer refuses it. Where every
        # fp32 shard of a rank lands in the GPU-resident part (fraction < 1), stock builds
        # instead and never steps them: judged as STOCK_FP32_UNSTEPPED, also expected.
        return STOCK_NON_LEAF
    if kind == "pa":
        return STOCK_MIXED_NORM
    return "ok"


def stock_cell(name: str) -> str:
    """The stock run that stands for ``name``: stock has no chunked offload step, so the
    chunked cells compare with stock's per-parameter one at the same fraction."""
    return name.replace("_chunked", "")


def build(cell: dict, option: bool, *, te: bool, device: str):
    """The GPT of ``cell`` wrapped by megatron_ext.build_stack; returns (model, optimizer)."""
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs
    from megatron.core.tensor_parallel import layers as mcore_layers
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_ext

    kind = KINDS[cell["kind"]]
    fp16 = kind.get("fp16", False)
    low = torch.float16 if fp16 else torch.bfloat16
    torch.manual_seed(0)
    if device == "cuda":  # megatron-core's CUDA RNG tracker (TE's layers draw from it)
        model_parallel_cuda_manual_seed(0)
    else:  # its attention forks the tracker, which needs CUDA; dropout is 0 here anyway
        get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        bf16=not fp16,
        fp16=fp16,
        params_dtype=low,
        pipeline_dtype=low,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=te,  # TE's layers fuse; megatron-core's output layer not
        use_cpu_initialization=device == "cpu",  # no CUDA RNG tracker on the CPU
    )
    if te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec()
    # megatron-core checks for apex's kernel when its ColumnParallelLinear is constructed,
    # and only then; its forward reads the layer's own attribute, turned off right after.
    lifted = (
        contextlib.nullcontext()
        if not te or mcore_layers._grad_accum_fusion_available
        else _attribute(mcore_layers, "_grad_accum_fusion_available", True)
    )
    with lifted:
        gpt = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    gpt.output_layer.gradient_accumulation_fusion = False
    gpt = gpt.to(device)
    for layer in gpt.decoder.layers:
        alpha = torch.nn.Parameter(
            1 + 0.1 * torch.randn(HIDDEN, device=device, dtype=torch.float32)
        )
        if cell["islands"]:
            megatron_ext.mark_keep_in_fp32(alpha)
        else:
            alpha = torch.nn.Parameter(alpha.detach().to(low))
        layer.mlp.register_parameter("hc_alpha", alpha)
        layer.mlp.register_forward_hook(
            lambda mod, inp, out: (out[0] * mod.hc_alpha.to(out[0].dtype), *out[1:])
        )
    module = megatron_ext.Float16Module(config, gpt)
    opt = dict(optimizer="adam", lr=1e-3, clip_grad=CLIP, **kind["opt"])
    options = megatron_ext.MegatronOptions(offload_step=kind.get("step", "per_parameter"))
    stack = megatron_ext.build_stack(
        module,
        config,
        per_dtype_grad_buffers=option,
        distributed_optimizer=True,
        optimizer=opt,
        options=options if option else None,
    )
    return stack.model, stack.optimizer


@contextlib.contextmanager
def _attribute(obj, name: str, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def batch(rank: int, step: int, micro: int, device: str):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)
    return tokens, labels


def save_params(model, path: Path) -> None:
    """Rank 0 saves every parameter (fp32 copies) and its dtype."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        params = {n: p.detach().float().cpu() for n, p in model.module.named_parameters()}
        dtypes = {n: str(p.dtype) for n, p in model.module.named_parameters()}
        torch.save(dict(params=params, dtypes=dtypes), path)


def train(cell: dict, model, opt, *, te: bool, device: str, first: Path) -> dict:
    """``STEPS`` clipped steps of ``cell['micro']`` micro-batches; the facts per step.
    The parameters after the first step go to ``first``."""
    import torch.distributed as dist
    from megatron_lm_launcher import reference_norm

    rank = dist.get_rank()
    position = torch.arange(SEQ, device=device).expand(BATCH, -1)
    # TE's attention is causal by its layer spec; the local spec reads the mask (True: masked)
    mask = None if te else torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device=device).triu(1)
    # the GEMM weights of TE's layers (not their layer_norm_weight: a norm's gradient is not
    # TE's wgrad GEMM)
    te_weights = [
        p
        for n, p in model.module.named_parameters()
        if n.rsplit(".", 1)[-1] == "weight" and _is_te(n, model)
    ]
    steps, fused = [], 0
    for step in range(STEPS):
        model.zero_grad_buffer()
        opt.zero_grad()
        scale = float(opt.get_loss_scale())
        losses = []
        for m in range(cell["micro"]):
            tokens, labels = batch(rank, step, m, device)
            # megatron-core's schedule: no gradient sync until the last micro-batch
            sync = model.no_sync() if m < cell["micro"] - 1 else contextlib.nullcontext()
            with sync:
                loss = model(tokens, position, mask, labels=labels).float().mean()
                (loss * scale / cell["micro"]).backward()
            losses.append(loss.item())
        model.finish_grad_sync()
        fused = max(
            fused, sum(bool(getattr(p, "grad_added_to_main_grad", False)) for p in te_weights)
        )
        ref = reference_norm([model], sharded=True) / scale
        ok, norm, _ = opt.step()
        steps.append(
            dict(
                ok=bool(ok),
                norm=None if norm is None else float(norm),
                ref=ref,
                loss=sum(losses) / len(losses),
                scale=scale,
            )
        )
        if step == 0:
            save_params(model, first)
    dtypes = sorted({str(b.grad_dtype) for b in model.all_grad_buffers()})
    return dict(steps=steps, te_weights=len(te_weights), te_fused=fused, grad_dtypes=dtypes)


def _is_te(name: str, model) -> bool:
    module_name = name.rsplit(".", 1)[0]
    module = model.module.get_submodule(module_name)
    return type(module).__module__.startswith("megatron.core.extensions.transformer_engine")


def run_cell(name: str, arm: str, out: Path, *, te: bool, device: str) -> dict:

    cell = parse_cell(name)
    row: dict = dict(cell=name, arm=arm, **cell, te=te, status="ok", error=None)
    try:
        model, opt = build(cell, arm == "ours", te=te, device=device)
    except Exception as e:  # noqa: BLE001 - a cell stock cannot build is a result row
        row.update(status="build failed", error=f"{type(e).__name__}: {e}"[:400])
        row["traceback"] = traceback.format_exc()[-2000:]
        return row
    row["optimizer"] = type(opt).__name__
    fp32_before = {
        n: p.detach().clone()
        for n, p in model.module.named_parameters()
        if p.dtype == torch.float32
    }
    try:
        row.update(train(cell, model, opt, te=te, device=device, first=out / f"{arm}-{name}-1.pt"))
    except Exception as e:  # noqa: BLE001 - a cell that cannot step is a result row
        row.update(status="step failed", error=f"{type(e).__name__}: {e}"[:400])
        row["traceback"] = traceback.format_exc()[-2000:]
        return row
    # fp32 parameters the steps left exactly as they were (stock at offload fraction < 1
    # leaves fp32 parameters in the GPU-resident part unstepped: test_offload_gpu.py's
    # test_stock_skips_gpu_resident_fp32_params)
    after = dict(model.module.named_parameters())
    row["fp32_unchanged"] = sorted(n for n, b in fp32_before.items() if torch.equal(after[n], b))
    save_params(model, out / f"{arm}-{name}.pt")
    return row


def finite(x) -> bool:
    return x is not None and math.isfinite(x)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arm", choices=("ours", "stock"), required=True)
    parser.add_argument("--out", required=True, type=Path, help="folder for the rows")
    parser.add_argument(
        "--cpu", action="store_true", help="the CPU rehearsal: local layer spec, the shim"
    )
    parser.add_argument("cells", nargs="+")
    args = parser.parse_args(argv)
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # stock vs ours: same bits
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not args.cpu:
        torch.cuda.set_device(0)  # every rank on the one GPU
    dist.init_process_group("gloo" if args.cpu or world > 1 else "nccl")
    rank = dist.get_rank()
    stack = contextlib.ExitStack()
    if args.cpu:
        sys.path.insert(0, str(ROOT))
        from tests.support.cpu_megatron import cpu_megatron

        stack.enter_context(cpu_megatron())
        device = "cpu"
    else:
        device = "cuda"
    from megatron.core import parallel_state as ps

    te = not args.cpu
    rows = args.out / f"{args.arm}-rank{rank}.jsonl"
    with stack:
        for name in args.cells:
            if parse_cell(name)["world"] != dist.get_world_size():
                raise SystemExit(f"{name} needs {parse_cell(name)['world']} ranks")
            # abort:<cell> or hang:<cell> in stock's arm, for the CPU tests
            fault = os.environ.get("TE_LAYERS_FAULT", "")
            with open(rows, "a") as f:
                f.write(json.dumps(dict(start=name)) + "\n")
            if fault == f"abort:{name}" and args.arm == "stock":
                os.abort()
            if fault == f"hang:{name}" and args.arm == "stock":
                import time

                time.sleep(3600)
            ps.initialize_model_parallel()
            try:
                row = run_cell(name, args.arm, args.out, te=te, device=device)
            finally:
                ps.destroy_model_parallel()
            with open(rows, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")
            print(f"[rank {rank}] {args.arm} {name}: {row['status']} {row['error'] or ''}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
