"""Parameter inventories (names, shapes, dtypes; no weights) of the models we benchmark.

Each builder takes a ``scale`` that multiplies every width (hidden size, FFN size, head and
low-rank dimensions) and keeps every count (layers, heads, experts), so a scaled inventory
has the same parameters, hence the same host cost per step, with fewer bytes.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch

from benchmarks import common
from buffers import ParamEntry

BF16, FP32 = torch.bfloat16, torch.float32


@dataclass(frozen=True)
class Inventory:
    """One rank's trainable parameters, as Megatron would hold them.

    Attributes:
        name: label used in tables and JSON (``inventory`` field).
        entries: the parameters, in module order.
        expert_parallel: names of the parameters Megatron keeps in expert-parallel buffers.
    """

    name: str
    entries: tuple[ParamEntry, ...]
    expert_parallel: frozenset[str] = frozenset()

    @property
    def nbytes(self) -> int:
        """Gradient bytes without padding (every gradient in its parameter's dtype)."""
        return sum(e.numel * _itemsize(e.dtype) for e in self.entries)

    @property
    def num_params(self) -> int:
        return len(self.entries)

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def width(size: int, scale: float) -> int:
    """``size`` scaled and rounded, at least 1."""
    return max(1, round(size * scale))


@dataclass(frozen=True)
class DenseConfig:
    """A dense transformer's stage: ``layers`` layers, weights sharded ``tp`` ways."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    layers: int
    tp: int = 1
    gated: bool = False  # SwiGLU: fc1 holds the gate and the up projection
    biases: bool = True
    norm_dtype: torch.dtype = FP32


# GPT-like: MHA, 4x FFN with biases, layernorms kept in fp32 (the mixed-dtype case).
GPT_STAGE = DenseConfig(hidden=8192, ffn=32768, heads=64, kv_heads=64, layers=4)
# Llama-70B-like: GQA, SwiGLU, no biases, all bf16; a middle stage of 80 layers at PP8.
DENSE_70B_STAGE = DenseConfig(
    hidden=8192, ffn=28672, heads=64, kv_heads=8, layers=10, tp=8, gated=True, biases=False,
    norm_dtype=BF16,
)  # fmt: skip


def dense_stage(name: str, cfg: DenseConfig, scale: float = 1.0) -> Inventory:
    """A dense transformer stage's parameters with tensor-parallel-sharded shapes.

    Args:
        name: the inventory's label.
        cfg: the model's sizes.
        scale: multiplies every width.

    Returns:
        The :class:`Inventory` (bf16 weights, norms in ``cfg.norm_dtype``).
    """
    h, d = width(cfg.hidden, scale), width(cfg.hidden // cfg.heads, scale)
    ffn, tp = width(cfg.ffn, scale), cfg.tp
    qkv_rows = max(1, (cfg.heads + 2 * cfg.kv_heads) * d // tp)
    fc1_rows = max(1, (2 if cfg.gated else 1) * ffn // tp)
    out: list[ParamEntry] = []
    for i in range(cfg.layers):
        pre = f"layers.{i}."
        shapes = {
            "self_attention.linear_qkv": (qkv_rows, h),
            "self_attention.linear_proj": (h, max(1, cfg.heads * d // tp)),
            "mlp.linear_fc1": (fc1_rows, h),
            "mlp.linear_fc2": (h, max(1, ffn // tp)),
        }
        for norm in ("input_layernorm", "pre_mlp_layernorm"):
            out.append(ParamEntry(pre + norm + ".weight", (h,), cfg.norm_dtype))
            if cfg.biases:
                out.append(ParamEntry(pre + norm + ".bias", (h,), cfg.norm_dtype))
        for module, shape in shapes.items():
            out.append(ParamEntry(pre + module + ".weight", shape, BF16))
            if cfg.biases:
                out.append(ParamEntry(pre + module + ".bias", shape[:1], BF16))
    return Inventory(name, tuple(out))


@dataclass(frozen=True)
class MoEConfig:
    """A DeepSeek-V3/V4-like MoE stage: MLA attention, routed + shared experts, fp32 islands."""

    hidden: int = 7168
    heads: int = 128
    q_lora: int = 1536
    kv_lora: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    experts: int = 256
    ep: int = 1  # each rank holds experts // ep routed experts per layer
    moe_ffn: int = 2048
    shared_ffn: int = 2048
    hc_streams: int = 4  # hyper-connection residual streams
    layers: int = 2  # 61 layers over PP32: a middle stage holds two MoE layers


DEEPSEEK_STAGE = MoEConfig()


def _mla(pre: str, c: MoEConfig, s: float) -> list[ParamEntry]:
    h, nope, rope, v = (width(x, s) for x in (c.hidden, c.qk_nope, c.qk_rope, c.v_head))
    q, kv = width(c.q_lora, s), width(c.kv_lora, s)
    a = pre + "self_attention."
    return [
        ParamEntry(a + "linear_q_down_proj.weight", (q, h), BF16),
        ParamEntry(a + "linear_q_up_proj.layer_norm_weight", (q,), BF16),
        ParamEntry(a + "linear_q_up_proj.weight", (c.heads * (nope + rope), q), BF16),
        ParamEntry(a + "linear_kv_down_proj.weight", (kv + rope, h), BF16),
        ParamEntry(a + "linear_kv_up_proj.layer_norm_weight", (kv,), BF16),
        ParamEntry(a + "linear_kv_up_proj.weight", (c.heads * (nope + v), kv), BF16),
        ParamEntry(a + "linear_proj.weight", (h, c.heads * v), BF16),
        ParamEntry(a + "sinks", (c.heads,), FP32),  # attention sinks: an fp32 island
    ]


def _hyper_connection(pre: str, c: MoEConfig, s: float) -> list[ParamEntry]:
    n = c.hc_streams
    mix = n * n + 2 * n  # residual mixing (n x n) plus pre and post weights (n each)
    out = []
    for site in ("hc_attn", "hc_ffn"):
        out += [
            ParamEntry(f"{pre}{site}.fn", (mix, n * width(c.hidden, s)), FP32),
            ParamEntry(f"{pre}{site}.bias", (mix,), FP32),
            ParamEntry(f"{pre}{site}.alpha", (3,), FP32),
        ]
    return out


def _moe_mlp(pre: str, c: MoEConfig, s: float) -> tuple[list[ParamEntry], list[str]]:
    h, f, fs = width(c.hidden, s), width(c.moe_ffn, s), width(c.shared_ffn, s)
    m = pre + "mlp."
    out = [
        ParamEntry(m + "router.weight", (c.experts, h), FP32),
        ParamEntry(m + "router.expert_bias", (c.experts,), FP32),
        ParamEntry(m + "shared_experts.linear_fc1.weight", (2 * fs, h), BF16),
        ParamEntry(m + "shared_experts.linear_fc2.weight", (h, fs), BF16),
    ]
    experts = []
    for e in range(c.experts // c.ep):
        x = f"{m}experts.local_experts.{e}."
        experts += [
            ParamEntry(x + "linear_fc1.weight", (2 * f, h), BF16),
            ParamEntry(x + "linear_fc2.weight", (h, f), BF16),
        ]
    return out + experts, [e.name for e in experts]


def moe_stage(name: str, cfg: MoEConfig, scale: float = 1.0) -> Inventory:
    """A DeepSeek-like MoE stage: every expert's fc1 and fc2 are separate parameters.

    Args:
        name: the inventory's label.
        cfg: the model's sizes and expert parallelism.
        scale: multiplies every width (not the number of heads or experts).

    Returns:
        The :class:`Inventory`; routed experts are expert-parallel when ``cfg.ep > 1``.
    """
    h = width(cfg.hidden, scale)
    out: list[ParamEntry] = []
    expert_names: list[str] = []
    for i in range(cfg.layers):
        pre = f"layers.{i}."
        out += _hyper_connection(pre, cfg, scale)
        out.append(ParamEntry(pre + "input_layernorm.weight", (h,), BF16))
        out += _mla(pre, cfg, scale)
        out.append(ParamEntry(pre + "pre_mlp_layernorm.weight", (h,), BF16))
        mlp, experts = _moe_mlp(pre, cfg, scale)
        out += mlp
        expert_names += experts
    return Inventory(name, tuple(out), frozenset(expert_names) if cfg.ep > 1 else frozenset())


def scaling_inventory(count: int, total_bytes: int, dtype: torch.dtype = FP32) -> Inventory:
    """``count`` equal 1-D parameters of one dtype that together hold ``total_bytes``.

    The series over ``count`` keeps bytes (hence device time) fixed, so what grows is the
    per-parameter host cost. fp32 by default: Megatron's norm and clip functions operate on
    fp32 main gradients, so every variant can run on it.

    Args:
        count: number of parameters.
        total_bytes: their combined gradient bytes (each gets at least one element).
        dtype: their dtype.

    Returns:
        The :class:`Inventory`, named ``scaling_<count>``.
    """
    numel = max(1, total_bytes // (count * _itemsize(dtype)))
    entries = tuple(ParamEntry(f"p{i}", (numel,), dtype) for i in range(count))
    return Inventory(f"scaling_{count}", entries)


def fit_scale(build: Callable[[float], Inventory], target_bytes: float) -> float:
    """The width scale (at most 1) that brings ``build(scale)`` to about ``target_bytes``.

    Args:
        build: an inventory builder taking only the scale.
        target_bytes: the wanted gradient bytes.

    Returns:
        The scale; bytes grow with its square (both dimensions of a matrix scale).
    """
    return min(1.0, math.sqrt(target_bytes / build(1.0).nbytes))


# The two model inventories the benchmarks use, by name: width scale -> Inventory.
MODEL_STAGES: dict[str, Callable[[float], Inventory]] = {
    "dense_gpt": lambda s: dense_stage("dense_gpt", GPT_STAGE, s),
    "deepseek_moe": lambda s: moe_stage("deepseek_moe", DEEPSEEK_STAGE, s),
}


def model_stage(name: str, target_bytes: float) -> Inventory:
    """The model inventory ``name`` of :data:`MODEL_STAGES`, scaled to about
    ``target_bytes`` of gradients (:func:`fit_scale`)."""
    build = MODEL_STAGES[name]
    return build(fit_scale(build, target_bytes))


def describe(inventories: Sequence[Inventory]) -> str:
    """One line per inventory: parameters, bytes, and parameters per dtype."""
    lines = []
    for inv in inventories:
        per_dtype: dict[str, int] = {}
        for e in inv.entries:
            key = str(e.dtype).removeprefix("torch.")
            per_dtype[key] = per_dtype.get(key, 0) + 1
        mix = ", ".join(f"{n} {k}" for k, n in per_dtype.items())
        lines.append(f"{inv.name}: {inv.num_params} params ({mix}), {inv.nbytes / 2**20:.1f} MiB")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(
        common.not_a_script(__file__, ("norm_clip.py", "memory.py", "offload.py", "clip_step.py"))
    )
