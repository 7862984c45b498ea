"""Small GPT-like (optionally MoE) inventories of logical parameters for the ownership checks.

Builds :class:`megatron_ext.ownership.LogicalParam` tuples in Megatron's
``named_parameters()`` order: embeddings, attention, MLP or MoE layers, fp32 islands
(attention sinks, routers, hyper-connection-like gates), tied output layers.
"""

from __future__ import annotations

import torch

from tests.support.topology import LogicalParam


def gpt_inventory(
    *,
    stages: int = 1,
    layers_per_stage: int = 1,
    hidden: int = 8,
    ffn: int = 16,
    vocab: int = 32,
    heads: int = 4,
    num_experts: int = 0,
    moe_layer_freq: int = 1,
    expert_weights_partitioned: bool = True,
    fp32_islands: bool = True,
    tie_embeddings: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[LogicalParam, ...]:
    """A small GPT-like (optionally MoE) inventory in Megatron's ``named_parameters()`` order.

    Layer ``l`` is MoE when ``num_experts > 0`` and ``l % moe_layer_freq == 0``. With tied
    embeddings and more than one stage, the last stage holds ``output_layer.weight`` tied to
    the embedding and marked ``shared``, the copy Megatron marks
    (models/common/language_module/language_module.py:272-284).

    Args:
        stages: pipeline stages.
        layers_per_stage: transformer layers on each stage.
        hidden: hidden size.
        ffn: MLP and expert intermediate size.
        vocab: vocabulary size.
        heads: attention heads (sizes the per-head fp32 island).
        num_experts: routed experts per MoE layer; 0 for a dense model.
        moe_layer_freq: every how many layers one is MoE.
        expert_weights_partitioned: whether expert weights are split over ETP ranks;
            False models experts built replicated (every ETP rank holds whole experts).
        fp32_islands: add natively fp32 parameters (attention sinks split by head, a
            replicated hyper-connection gate, an fp32 router).
        tie_embeddings: share the embedding with the output layer.
        dtype: dtype of every other parameter.

    Returns:
        The inventory.
    """
    emb = LogicalParam("embedding.word_embeddings.weight", (vocab, hidden), dtype, 0)
    out = [emb]
    f32 = torch.float32 if fp32_islands else None
    for stage in range(stages):
        for layer in range(stage * layers_per_stage, (stage + 1) * layers_per_stage):
            specs = _attention_specs(hidden, heads, dtype, f32)
            if num_experts and layer % moe_layer_freq == 0:
                specs += _moe_specs(
                    hidden, ffn, num_experts, dtype, f32, expert_weights_partitioned
                )
            else:
                specs += [("mlp.linear_fc1.weight", (2 * ffn, hidden), 0, dtype, None)]
                specs += [("mlp.linear_fc2.weight", (hidden, ffn), 1, dtype, None)]
            for name, shape, dim, kind, expert in specs:
                out.append(
                    LogicalParam(
                        f"decoder.layers.{layer}.{name}",
                        shape,
                        kind,
                        dim,
                        expert is not None,
                        stage=stage,
                        expert_index=expert,
                    )
                )
    last = stages - 1
    out.append(LogicalParam("decoder.final_layernorm.weight", (hidden,), dtype, stage=last))
    if not tie_embeddings:
        out.append(LogicalParam("output_layer.weight", (vocab, hidden), dtype, 0, stage=last))
    elif stages > 1:
        out.append(
            LogicalParam(
                "output_layer.weight",
                (vocab, hidden),
                dtype,
                0,
                shared=True,
                stage=last,
                tied_to=emb.name,
            )
        )
    return tuple(out)


_Spec = tuple[str, tuple[int, ...], int | None, torch.dtype, int | None]


def _attention_specs(
    hidden: int, heads: int, dtype: torch.dtype, f32: torch.dtype | None
) -> list[_Spec]:
    specs: list[_Spec] = [
        ("input_layernorm.weight", (hidden,), None, dtype, None),
        ("self_attention.linear_qkv.weight", (3 * hidden, hidden), 0, dtype, None),
        ("self_attention.linear_qkv.bias", (3 * hidden,), 0, dtype, None),
        ("self_attention.linear_proj.weight", (hidden, hidden), 1, dtype, None),
        ("self_attention.linear_proj.bias", (hidden,), None, dtype, None),
    ]
    if f32 is not None:
        specs.append(("self_attention.core_attention.softmax_offset", (heads,), 0, f32, None))
        specs.append(("hyper_connection.alpha", (4,), None, f32, None))
    specs.append(("pre_mlp_layernorm.weight", (hidden,), None, dtype, None))
    return specs


def _moe_specs(
    hidden: int,
    ffn: int,
    num_experts: int,
    dtype: torch.dtype,
    f32: torch.dtype | None,
    partitioned: bool,
) -> list[_Spec]:
    fc1, fc2 = (0, 1) if partitioned else (None, None)
    specs: list[_Spec] = [("mlp.router.weight", (num_experts, hidden), None, f32 or dtype, None)]
    for e in range(num_experts):
        specs.append((f"mlp.experts.linear_fc1.weight{e}", (2 * ffn, hidden), fc1, dtype, e))
        specs.append((f"mlp.experts.linear_fc2.weight{e}", (hidden, ffn), fc2, dtype, e))
        # A row-parallel bias is replicated over ETP ranks (transformer_engine.py:115-118).
        specs.append((f"mlp.experts.linear_fc2.bias{e}", (hidden,), None, dtype, e))
    return specs
