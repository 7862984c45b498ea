"""One rank of the transformer-engine GPT cells: a GPTModel with TE's layer spec, trained
with per-dtype gradient buffers (``--arm ours``) or stock megatron-core (``--arm stock``).

Launched by ``tests/gpu/test_te_layers_gpu.py`` (see :func:`launch`) as
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
error. Rank 0 saves the parameters after the steps to ``DIR/<arm>-<cell>.pt``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
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
    "pa_offload1.0": dict(
        opt=dict(
            use_precision_aware_optimizer=True,
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=1.0,
        )
    ),
    "pa_offload1.0_chunked": dict(
        opt=dict(
            use_precision_aware_optimizer=True,
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=1.0,
        ),
        step="chunked",
    ),
    "pa_offload0.5": dict(
        opt=dict(
            use_precision_aware_optimizer=True,
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=0.5,
        )
    ),
    "pa_offload0.5_chunked": dict(
        opt=dict(
            use_precision_aware_optimizer=True,
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=0.5,
        ),
        step="chunked",
    ),
    "fp16": dict(
        opt=dict(initial_loss_scale=2.0**12, min_loss_scale=1.0, loss_scale_window=1000),
        fp16=True,
    ),
}
# Kinds that need transformer-engine beyond its layers (megatron-core's precision-aware
# optimizer is TE's FusedAdam) or CUDA (CPU offload): not in the CPU rehearsal.
NEEDS_TE_OPTIMIZER = {k for k, v in KINDS.items() if v["opt"].get("use_precision_aware_optimizer")}


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


def stock_expected(kind: str, islands: bool) -> str:
    if not islands:
        return "ok"
    if kind.startswith("pa_offload"):
        return STOCK_NON_LEAF  # the fp32 parameter's shard is a view: torch's optimizer refuses it
    if kind == "pa":
        return "nonfinite"
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
    try:
        row.update(train(cell, model, opt, te=te, device=device, first=out / f"{arm}-{name}-1.pt"))
    except Exception as e:  # noqa: BLE001 - a cell that cannot step is a result row
        row.update(status="step failed", error=f"{type(e).__name__}: {e}"[:400])
        row["traceback"] = traceback.format_exc()[-2000:]
        return row
    save_params(model, out / f"{arm}-{name}.pt")
    return row


def finite(x) -> bool:
    return x is not None and math.isfinite(x)


# --- the driver: launching the arms and judging their rows (imported by the tests) -------


def read_rows(out: Path, arm: str) -> tuple[dict[str, dict], set[str]]:
    """Every rank's rows of ``arm``: per cell, the rank rows (rank -> row); and the cells
    started by some rank."""
    rows: dict[str, dict] = {}
    started: set[str] = set()
    for path in sorted(out.glob(f"{arm}-rank*.jsonl")):
        rank = int(path.stem.rsplit("rank", 1)[1])
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "start" in row:
                started.add(row["start"])
            else:
                rows.setdefault(row["cell"], {})[rank] = row
    return rows, started


def launch(arm: str, names: list[str], out: Path, *, cpu: bool = False,
           timeout: float = 600.0) -> dict[str, dict]:  # fmt: skip
    """Run ``names`` (one world size) for ``arm`` under torchrun; a cell whose process dies
    becomes a ``crashed`` row (exit status and first error line) and the cells after it run
    in a fresh launch. Returns per cell rank 0's row, with ``ranks_disagree`` set where
    another rank's status differs."""
    world = {parse_cell(n)["world"] for n in names}
    if len(world) != 1:
        raise ValueError(f"cells of one world size per launch, not {sorted(world)}")
    (world,) = world
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{arm}-rank*.jsonl"):  # rows of an earlier launch (read already)
        stale.unlink()
    env = dict(os.environ)
    paths = [str(ROOT), env.get("PYTHONPATH", "")]
    if world > 1 and not cpu:
        paths.insert(0, str(ROOT / "tests" / "support" / "multirank"))
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")
    remaining = list(names)
    crashed: dict[str, dict] = {}
    while remaining:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={world}", str(HERE / "te_layers_worker.py"), "--arm", arm,
               "--out", str(out), *(["--cpu"] if cpu else []), *remaining]  # fmt: skip
        rc, text = run_group(cmd, env, None, timeout)
        rows, started = read_rows(out, arm)
        left = [n for n in remaining if n not in rows and n not in crashed]
        if not left:
            break
        dead = next((n for n in left if n in started), left[0])
        crashed[dead] = dict(cell=dead, arm=arm, **parse_cell(dead), status=f"crashed ({rc})",
                             error=first_error_line(text), output=text[-4000:])  # fmt: skip
        remaining = [n for n in left if n != dead]
    rows, _ = read_rows(out, arm)
    result = {}
    for name in names:
        if name in crashed:
            result[name] = crashed[name]
            continue
        ranks = rows[name]
        row = dict(ranks[min(ranks)])
        statuses = {r["status"] for r in ranks.values()}
        row["ranks_disagree"] = len(ranks) != world or len(statuses) > 1
        result[name] = row
    return result


_ERROR = re.compile(r"Signal \d+|SIG[A-Z]+|\b\w+(Error|Exception): |illegal memory|Aborted")


def run_group(cmd: list[str], env: dict, cwd, timeout: float) -> tuple[int | str, str]:
    """Run ``cmd``; its exit status (``"timeout"`` when it ran past ``timeout`` seconds:
    then it and every process under it are killed, torchrun's workers too, which it starts
    in sessions of their own, so that none is left holding the GPU) and its output."""
    import signal
    import subprocess

    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        text, _ = proc.communicate(timeout=timeout)
        return proc.returncode, text
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        text, _ = proc.communicate()
        return "timeout", text


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (from /proc), children before their children."""
    parent_of = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parent_of[int(stat.parent.name)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        frontier = [p for p, parent in parent_of.items() if parent in frontier]
        out += frontier
    return out


def first_error_line(text: str) -> str:
    """The line of a dead launch's output that says what happened: a signal, an error with
    its message; else the last line."""
    for line in text.splitlines():
        if _ERROR.search(line) and "ChildFailedError" not in line:
            return line.strip()[:300]
    return text.strip().splitlines()[-1][:300] if text.strip() else "no output"


def norm_errors(row: dict) -> list[float]:
    """Per step, the norm's relative error against the fp64 reference (inf where either is
    not finite)."""
    out = []
    for s in row.get("steps", []):
        ok = finite(s["norm"]) and finite(s["ref"]) and s["ref"] > 0
        out.append(abs(s["norm"] - s["ref"]) / s["ref"] if ok else math.inf)
    return out


# Parameters after the first step (the same gradients on both sides), ours against stock,
# per element: within one unit in the last place of the parameter's dtype relative to
# stock's value, plus 1e-6 absolute (ours' norm and stock's differ in the last bits of
# fp32, so the clip coefficients do, and a rounding may land on the other side). From the
# second step on the gradients differ in the last bits too and Adam amplifies the ones that
# are rounding noise (a key bias's, zero in exact arithmetic; measured on the CPU: 1 ulp
# after one step, up to 70 after three), so later steps compare the loss: within LOSS_RTOL.
LOSS_RTOL = 1e-4
PARAM_RTOL = {"torch.bfloat16": 2.0**-7, "torch.float16": 2.0**-10, "torch.float32": 2.0**-20}
PARAM_ATOL = 1e-6


def compare_params(ours: Path, stock: Path) -> dict:
    """Ours' saved parameters against stock's: the worst element relative to its
    tolerance (at most 1 passes), how many tensors are bit for bit equal, and the names
    of those out of tolerance."""
    a, b = torch.load(ours), torch.load(stock)
    if set(a["params"]) != set(b["params"]):
        return dict(worst=math.inf, equal=0, total=0, bad=["different parameter names"])
    worst, equal, bad = 0.0, 0, []
    for n, x in a["params"].items():
        y = b["params"][n]
        tol = PARAM_RTOL[b["dtypes"][n]] * y.abs() + PARAM_ATOL
        ratio = float(((x - y).abs() / tol).max()) if x.numel() else 0.0
        worst = max(worst, ratio)
        equal += bool(torch.equal(x, y))
        if not ratio <= 1.0:
            bad.append(n)
    return dict(worst=worst, equal=equal, total=len(a["params"]), bad=bad)


def judge(name: str, ours: dict, stock: dict, out: Path, stock_tol: float = 1e-6) -> dict:
    """One result row for ``name``: ours' and stock's outcome, the worst norm errors
    against fp64, where stock runs and is right the parameters after the first step and the
    losses compared (:data:`PARAM_RTOL`, :data:`LOSS_RTOL`), and
    ``failures``: what contradicts the expectations (ours right every step; stock as
    :func:`stock_expected` says; "right" is within ``stock_tol`` of fp64)."""
    cell = parse_cell(name)
    failures = []
    ours_err = norm_errors(ours)
    if ours["status"] != "ok" or ours.get("ranks_disagree"):
        failures.append(f"ours: {ours['status']} {ours.get('error') or ''}".strip())
    elif len(ours_err) != STEPS or not max(ours_err) <= 1e-6:
        failures.append(f"ours: norm vs fp64 per step {ours_err}")
    elif not all(s["ok"] for s in ours["steps"]):
        failures.append("ours: a step was skipped")
    elif not min(s["ref"] for s in ours["steps"]) > CLIP:
        failures.append("ours: clipping was not active")
    if ours.get("te") and ours["status"] == "ok" and not ours.get("te_weights"):
        failures.append("ours: the model holds no transformer-engine layer")
    if ours.get("te_weights") and ours.get("te_fused") != ours["te_weights"]:
        failures.append(
            f"ours: TE accumulated {ours.get('te_fused')} of {ours['te_weights']} weight "
            "gradients into main_grad (fuse_wgrad_accumulation not in effect)"
        )
    low = "torch.float16" if KINDS[cell["kind"]].get("fp16") else "torch.bfloat16"
    want = sorted({low, "torch.float32"} if cell["islands"] else {low})
    if ours["status"] == "ok" and ours.get("grad_dtypes") != want:
        failures.append(f"ours: gradient buffers {ours.get('grad_dtypes')}, not {want}")
    expected = stock_expected(cell["kind"], cell["islands"])
    stock_err = norm_errors(stock)
    if stock["status"] == "ok" and stock_err and max(stock_err) <= stock_tol:
        outcome = "ok"
    elif (
        stock["status"] == "ok" and stock_err and not any(finite(s["norm"]) for s in stock["steps"])
    ):
        outcome = "nonfinite"
    elif stock["status"] == "ok":
        outcome = "wrong norm"
    else:
        outcome = stock["status"]
    row = dict(cell=name, **cell, ours=ours["status"], ours_norm_err=max(ours_err, default=None),
               stock=outcome, stock_error=stock.get("error"),
               stock_norm_err=max(stock_err, default=None), expected_stock=expected)  # fmt: skip
    if expected == "ok":
        if outcome != "ok":
            failures.append(f"stock: {outcome} {stock.get('error') or stock_err}")
        elif ours["status"] == "ok":
            first = abs(ours["steps"][0]["ref"] - stock["steps"][0]["ref"])
            if not first <= 1e-6 * stock["steps"][0]["ref"]:
                failures.append("the first step's gradients differ between ours and stock")
            cmp = compare_params(out / f"ours-{name}-1.pt", out / f"stock-{stock['cell']}-1.pt")
            row.update(params_worst=cmp["worst"], params_equal=f"{cmp['equal']}/{cmp['total']}")
            if cmp["bad"]:
                failures.append(f"parameters after step 1 differ from stock's: {cmp['bad']}")
            last = compare_params(out / f"ours-{name}.pt", out / f"stock-{stock['cell']}.pt")
            row["params_equal_last"] = f"{last['equal']}/{last['total']}"
            loss = max(
                abs(a["loss"] - b["loss"]) / abs(b["loss"])
                for a, b in zip(ours["steps"], stock["steps"], strict=True)
            )
            row["loss_vs_stock"] = loss
            if not loss <= LOSS_RTOL:
                failures.append(f"losses differ from stock's by up to {loss:.2e} (relative)")
    elif expected == "nonfinite":
        if outcome != "nonfinite":
            failures.append(f"stock was expected to give a non-finite norm, gave {outcome}")
    elif not (outcome == "build failed" and expected in (stock.get("error") or "")):
        failures.append(f"stock was expected to fail to build ({expected}), gave {outcome}")
    row["failures"] = failures
    return row


def run_all(names: list[str], out: Path, timeout: float) -> tuple[dict[str, dict], str]:
    """Both arms of ``names``, a world size at a time (stock once per :func:`stock_cell`),
    judged; the table and the rows as JSON written to ``out`` after each world size (a run
    cut short keeps the first's). Returns the judged rows by cell, and the table."""
    out.mkdir(parents=True, exist_ok=True)
    judged: dict[str, dict] = {}
    text = ""
    for world in sorted({parse_cell(n)["world"] for n in names}):
        these = [n for n in names if parse_cell(n)["world"] == world]
        ours = launch("ours", these, out, timeout=timeout)
        stock = launch("stock", list(dict.fromkeys(map(stock_cell, these))), out, timeout=timeout)
        for n in these:
            judged[n] = judge(n, ours[n], stock[stock_cell(n)], out)
        rows = [judged[n] for n in names if n in judged]
        text = table(rows)
        (out / "te_layers.txt").write_text(text + "\n")
        (out / "te_layers.json").write_text(json.dumps(rows, indent=1, default=str))
    return judged, text


def table(rows: list[dict]) -> str:
    """The result rows as a fixed-width table (one line per cell)."""

    def fmt(x):
        return "-" if x is None else f"{x:.1e}" if isinstance(x, float) else str(x)

    def ratio(x):
        return "-" if x is None else f"{x:.2f}"

    head = (f"{'cell':40} {'ours':4} {'vs fp64':>7} {'stock':14} {'vs fp64':>7} "
            f"{'step1':>5} {'equal':>5} {'loss':>7} {'last':>5}  verdict")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        stock = r["stock"] if r["stock"] != "build failed" else "fails to build"
        lines.append(
            f"{r['cell']:40} {r['ours']:4} {fmt(r['ours_norm_err']):>7} {stock[:14]:14} "
            f"{fmt(r['stock_norm_err']):>7} {ratio(r.get('params_worst')):>5} "
            f"{r.get('params_equal', '-'):>5} {fmt(r.get('loss_vs_stock')):>7} "
            f"{r.get('params_equal_last', '-'):>5}  {'ok' if not r['failures'] else 'FAILED'}"
        )
    lines.append(
        "vs fp64: worst relative norm error over the steps; step1: parameters after step 1, "
        "worst element / tolerance; equal: tensors bit for bit equal after step 1 / after "
        "the last (last); loss: worst relative loss difference"
    )
    errors = sorted({r["stock_error"] for r in rows if r.get("stock_error")})
    lines += [f"stock error: {e}" for e in errors]
    return "\n".join(lines)


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
