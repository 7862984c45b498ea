"""The model the megatron-core CPU tests train (test support): a bf16 MLP with an fp32
island ``alpha`` (a bf16 parameter marked ``keep_in_fp32``, or natively fp32 for stock) and
a natively fp32 ``sink``; its seeded batches, clipped steps, and reads of what each rank
holds (the reduced gradient pieces and optimizer state it owns, joined across ranks).
"""

from __future__ import annotations

import torch

H, F, BATCH, CLIP, LR = 32, 48, 8, 1.0, 0.05
BF16 = torch.bfloat16


def initial_params(keep_alpha_bf16: bool, seed: int = 11) -> dict[str, torch.Tensor]:
    """bf16 MLP weights, a natively fp32 sink, and alpha: fp32 from bf16 values (exact)."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "w1": torch.randn(F, H, generator=g) * 0.3,
        "b1": torch.randn(F, generator=g) * 0.3,
        "w2": torch.randn(H, F, generator=g) * 0.3,
        "alpha": torch.randn(H, generator=g),
    }
    out = {n: t.to(BF16) for n, t in out.items()}
    out["sink"] = torch.randn(H, generator=g)
    if not keep_alpha_bf16:
        out["alpha"] = out["alpha"].float()
    return out


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh per rank and step; not exact in bf16 before the cast."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, H, generator=g).to(BF16), torch.randn(BATCH, H, generator=g)


def loss_of(p: dict[str, torch.Tensor], x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ p["w1"].t() + p["b1"]) @ p["w2"].t()
    y = h.float() * p["alpha"].float() + p["sink"]
    return ((y - t) ** 2).sum() / BATCH


class MLP(torch.nn.Module):
    """The model; alpha stays fp32 by the option (a marked bf16 parameter) or, for stock,
    by being created fp32: the same values and the same math either way."""

    def __init__(self, option: bool, seed: int = 11):
        super().__init__()
        import megatron_ext

        for name, value in initial_params(keep_alpha_bf16=option, seed=seed).items():
            self.register_parameter(name, torch.nn.Parameter(value.clone()))
        if option:
            megatron_ext.mark_keep_in_fp32(self.alpha)

    def forward(self, x, t):
        return loss_of(dict(self.named_parameters()), x, t)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {}, sharded_offsets)


def owned_pieces(model) -> list[tuple[str, int, int, torch.Tensor]]:
    """(name, start, end, reduced gradient) of every element this rank's optimizer owns."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    names = {p: n for n, p in model.module.named_parameters()}
    out = []
    for buf in model.all_grad_buffers():
        (per_bucket,) = DistributedOptimizer._build_gbuf_range_map(buf).values()
        for bucket in per_bucket:
            for p, r in bucket["param_map"].items():
                start = buf.param_index_map[p][0]
                lo, hi = r["param"].start, r["param"].end
                piece = buf.grad_data[start + lo : start + hi].clone()
                out.append((names[p], lo, hi, piece))
    return out


def owned_state(model, opt) -> dict:
    """(name, start, end) -> this rank's main parameter shard and every tensor of its
    inner optimizer state, from megatron-core's own range map."""
    names = {p: n for n, p in model.module.named_parameters()}
    out = {}
    for child in opt.chained_optimizers:
        pairs = [
            (m, s if s is not None else s16)  # precision-aware: the bf16 shard is the key
            for ms, ss, s16s in zip(
                child.model_float16_groups,
                child.shard_fp32_from_float16_groups,
                child.shard_float16_groups,
                strict=True,
            )
            for m, s, s16 in zip(ms, ss, s16s, strict=True)
        ]
        pairs += [
            (m, s)
            for ms, ss in zip(child.model_fp32_groups, child.shard_fp32_groups, strict=True)
            for m, s in zip(ms, ss, strict=True)
        ]
        for model_param, main in pairs:
            r = child._get_model_param_range_map(model_param)["param"]
            state = child.optimizer.state[main]
            entry = {k: v.detach().clone() for k, v in state.items() if torch.is_tensor(v)}
            # the fp32 main value: the main parameter, or the precision-aware optimizer's
            # master copy in its state
            entry["param"] = state.get("master_param", main).detach().clone()
            out[names[model_param], r.start, r.end] = entry
    return out


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def clipped_steps(model, opt, rank, steps) -> list[float]:
    norms = []
    for step in steps:
        model.zero_grad_buffer()
        opt.zero_grad()
        model(*batch(rank, step)).backward()
        model.finish_grad_sync()
        ok, norm, _ = opt.step()
        assert ok
        norms.append(float(norm))
    return norms


def joined(pieces: list[dict]) -> dict:
    """Each parameter's full state from the ranks' (name, start, end) pieces, each element
    exactly once."""
    by_name: dict[str, list] = {}
    for piece in pieces:
        for (name, lo, hi), entry in piece.items():
            by_name.setdefault(name, []).append((lo, hi, entry))
    out = {}
    for name, parts in by_name.items():
        parts.sort(key=lambda x: x[0])
        assert [lo for lo, _, _ in parts[1:]] == [hi for _, hi, _ in parts[:-1]], name
        full = {k: torch.cat([e[k].reshape(-1) for *_, e in parts]) for k in parts[0][2]}
        if "step" in full:  # a scalar per parameter: every piece holds the same one
            assert len(set(full["step"].tolist())) == 1, name
            full["step"] = parts[0][2]["step"]
        out[name, 0, parts[-1][1]] = full
    return out
