"""Every logical gradient element is counted exactly once per norm group, on every topology."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core.parallel_state import RankGenerator

from megatron_ext.counted_spans import exclusion_reason
from tests.support.gpt_inventory import gpt_inventory
from tests.support.topology import (
    LogicalParam,
    Topology,
    audit,
    norm_group_key,
    rank_norms,
    reference_norm,
    rule_dense_tp_for_experts,
    rule_experts_lost_tp_flag,
)

pytestmark = pytest.mark.mcore

# About 7 s of tests on a 2-core CPU (worlds up to 64 ranks); importing Megatron adds ~10 s.
PROPERTY = settings(max_examples=100, deadline=None)


@st.composite
def topologies(draw) -> Topology:
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, 2, 3, 4]))
    cp = draw(st.sampled_from([1, 2]))
    per_stage = tp * dp * cp
    etp, ep = draw(
        st.sampled_from([(e, p) for e in (1, 2, 4) for p in (1, 2, 4) if per_stage % (e * p) == 0])
    )
    distopt = draw(st.booleans())
    edp = per_stage // (etp * ep)
    instances = [n for n in (1, 2) if (dp * cp) % n == 0 and edp % n == 0] if distopt else [1]
    n = draw(st.sampled_from(instances))
    return Topology(tp, pp, dp, cp, ep, etp, distopt, n)


@st.composite
def inventories(draw, stages: int) -> tuple[LogicalParam, ...]:
    return gpt_inventory(
        stages=stages,
        layers_per_stage=draw(st.integers(1, 2)),
        hidden=draw(st.sampled_from([4, 8, 12])),
        num_experts=draw(st.sampled_from([0, 4, 8])),
        moe_layer_freq=draw(st.integers(1, 2)),
        expert_weights_partitioned=draw(st.booleans()),
        fp32_islands=draw(st.booleans()),
        tie_embeddings=draw(st.booleans()),
    )


def random_grads(inventory, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {p.name: rng.standard_normal(p.shape) for p in inventory if p.tied_to is None}


def assert_norms_match(topology, inventory, grads, **kw) -> None:
    ref = reference_norm(inventory, grads)
    for rank, norm in enumerate(rank_norms(topology, inventory, grads, **kw)):
        assert math.isclose(norm, ref, rel_tol=1e-12), (rank, norm, ref)


# -- rank mapping, checked against Megatron's own RankGenerator --------------------------


def groups_from_coords(topology: Topology, axes: dict[str, int], varying: list[str]):
    """Groups of ranks that differ only in ``varying``, ordered by them (``axes`` order)."""
    groups: dict[tuple, dict[int, int]] = {}
    for rank in range(topology.world):
        c = topology.coords(rank)
        key = tuple(getattr(c, a) for a in axes if a not in varying)
        position, stride = 0, 1
        for a in (a for a in axes if a in varying):
            position, stride = position + getattr(c, a) * stride, stride * axes[a]
        groups.setdefault(key, {})[position] = rank
    return sorted([g[i] for i in sorted(g)] for g in groups.values())


@PROPERTY
@given(topologies())
def test_rank_mapping_matches_megatron_rank_generator(t):
    order = "tp-cp-ep-dp-pp"  # initialize_model_parallel's default (parallel_state.py:617)
    dense = RankGenerator(tp=t.tp, ep=1, dp=t.dp, pp=t.pp, cp=t.cp, order=order)
    expert = RankGenerator(tp=t.etp, ep=t.ep, dp=t.edp, pp=t.pp, cp=1, order=order)
    dense_axes = {"tp": t.tp, "cp": t.cp, "dp": t.dp, "pp": t.pp}
    expert_axes = {"etp": t.etp, "ep": t.ep, "edp": t.edp, "pp": t.pp}
    for token in ("tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-cp"):
        ours = groups_from_coords(t, dense_axes, token.split("-"))
        assert ours == sorted(dense.get_ranks(token)), token
    for token in ("tp", "ep", "dp", "pp", "tp-ep", "tp-ep-pp"):
        varying = [{"tp": "etp", "dp": "edp"}.get(a, a) for a in token.split("-")]
        ours = groups_from_coords(t, expert_axes, varying)
        assert ours == sorted(expert.get_ranks(token)), token
    # Distributed-optimizer shard index is the position in the DP-CP group.
    for group in dense.get_ranks("dp-cp"):
        assert [t.coords(r).dp_cp_index(t.cp) for r in group] == list(range(len(group)))
    # Optimizer instances: consecutive expert tp-ep-pp groups (parallel_state.py:1562-1575).
    if t.distributed_optimizer:
        per_instance = t.edp // t.num_optimizer_instances
        for i, group in enumerate(expert.get_ranks("tp-ep-pp")):
            for r in group:
                key = ("optimizer instance", i // per_instance)
                for kind in (False, True):
                    assert norm_group_key(t, t.coords(r), kind) == key


# -- the property: our rule counts every element once, and the norm is exact -------------


@PROPERTY
@given(st.data(), topologies(), st.sampled_from([None, 64, 200, 1000]), st.integers(0, 2**32))
def test_every_element_counted_once_and_norm_exact(data, topology, bucket_size, seed):
    inventory = data.draw(inventories(topology.pp))
    report = audit(topology, inventory, bucket_size=bucket_size)
    assert report.ok, report.first_error
    assert report.bad_elements == 0
    grads = random_grads(inventory, seed)
    assert_norms_match(topology, inventory, grads, bucket_size=bucket_size)


def test_report_counts_per_norm_group():
    topology = Topology(tp=2, pp=1, dp=2, ep=2, distributed_optimizer=False)
    inventory = gpt_inventory(num_experts=4)
    report = audit(topology, inventory)
    emb = "embedding.word_embeddings.weight"
    # Without the distributed optimizer each DP replica is its own dense norm group.
    assert report.groups[emb] == ((0, 1), (2, 3))
    assert report.counts[emb].shape == (2, 32 * 8)
    assert (report.counts[emb] == 1).all()
    expert = "decoder.layers.0.mlp.experts.linear_fc1.weight3"
    assert report.groups[expert] == ((0, 1, 2, 3),)


# -- the published undercounting configurations -------------------------------------------


def test_published_a_megatron_5916_ep_and_tp():
    """EP > 1 and TP > 1 (ETP = TP): grouped-GEMM expert weights lost their TP flag."""
    topology = Topology(tp=2, pp=1, dp=2, ep=2)
    inventory = gpt_inventory(num_experts=4)
    assert audit(topology, inventory).ok
    buggy = audit(topology, inventory, rule=rule_experts_lost_tp_flag)
    assert not buggy.ok
    assert buggy.first_error.startswith("decoder.layers.0.mlp.experts.linear_fc1.weight")
    assert "counted 0 times" in buggy.first_error
    # Bug (b) is a different one: with ETP == TP the dense and expert TP ranks agree.
    assert audit(topology, inventory, rule=rule_dense_tp_for_experts).ok
    grads = random_grads(inventory, seed=5916)
    assert_norms_match(topology, inventory, grads)
    low = rank_norms(topology, inventory, grads, rule=rule_experts_lost_tp_flag)
    assert max(low) < 0.99 * reference_norm(inventory, grads)


def test_published_b_dense_tp_ownership_for_experts_under_etp1():
    """TP4/EP4/ETP1, as in the DeepSeek-V4 run that reported 11.51 instead of 12.28."""
    topology = Topology(tp=4, pp=1, dp=1, ep=4, etp=1)
    inventory = gpt_inventory(num_experts=4, expert_weights_partitioned=False)
    assert audit(topology, inventory).ok
    buggy = audit(topology, inventory, rule=rule_dense_tp_for_experts)
    assert not buggy.ok
    assert ".mlp.experts." in buggy.first_error.split(":")[0]
    assert "held on ranks [1]" in buggy.first_error
    grads = random_grads(inventory, seed=1228)
    assert_norms_match(topology, inventory, grads)
    # Experts on dense TP ranks 1-3 drop out: three quarters of the expert gradients.
    low = rank_norms(topology, inventory, grads, rule=rule_dense_tp_for_experts)
    assert max(low) < 0.9 * reference_norm(inventory, grads)


def test_published_b_catches_replicated_expert_bias_with_partitioned_weights():
    topology = Topology(tp=2, pp=2, dp=2, ep=2, etp=1)
    inventory = gpt_inventory(stages=2, num_experts=4)
    assert audit(topology, inventory).ok
    buggy = audit(topology, inventory, rule=rule_dense_tp_for_experts)
    assert not buggy.ok
    assert ".mlp.experts.linear_fc2.bias" in buggy.first_error.split(":")[0]


def test_published_c_deepspeed_mean_of_per_rank_norms():
    """Two ranks, two experts each: averaging their norms is 34% off (DeepSpeed #8469)."""
    topology = Topology(tp=1, pp=1, dp=2, ep=2, distributed_optimizer=False)
    inventory = tuple(
        LogicalParam(f"experts.weight{e}", (1,), is_expert=True, expert_index=e) for e in range(4)
    )
    grads = {f"experts.weight{e}": np.array([2.0 * (e + 1)]) for e in range(4)}
    assert audit(topology, inventory).ok
    assert reference_norm(inventory, grads) == pytest.approx(math.sqrt(120), rel=1e-15)
    assert_norms_match(topology, inventory, grads)
    mean = rank_norms(topology, inventory, grads, combine="mean")
    assert mean == pytest.approx(((math.sqrt(20) + math.sqrt(100)) / 2,) * 2, rel=1e-15)
    assert 1 - mean[0] / math.sqrt(120) == pytest.approx(0.339, abs=1e-3)


def test_mean_combine_is_wrong_even_when_counting_is_right():
    topology = Topology(tp=2, pp=1, dp=4, ep=4, etp=1)
    inventory = gpt_inventory(num_experts=8)
    grads = random_grads(inventory, seed=8469)
    assert audit(topology, inventory).ok
    mean = rank_norms(topology, inventory, grads, combine="mean")
    assert abs(mean[0] / reference_norm(inventory, grads) - 1) > 0.01


# -- the check can fail: double counting ----------------------------------------------------


def test_ignoring_shared_counts_the_tied_embedding_twice():
    def ignore_shared(**kw):
        return exclusion_reason(**{**kw, "shared": False})

    topology = Topology(tp=2, pp=2, dp=1)
    report = audit(topology, gpt_inventory(stages=2), rule=ignore_shared)
    assert not report.ok
    assert report.first_error.startswith("embedding.word_embeddings.weight: logical element 0")
    assert "counted 2 times" in report.first_error
    assert report.counts["embedding.word_embeddings.weight"].max() == 2


def test_counting_replicated_params_on_every_tp_rank_is_caught():
    def count_everything(**kw):
        return exclusion_reason(**{**kw, "tensor_model_parallel": True})

    report = audit(Topology(tp=4, pp=1, dp=2), gpt_inventory(), rule=count_everything)
    assert not report.ok
    assert report.first_error.startswith("decoder.layers.0.input_layernorm.weight")
    assert "counted 4 times" in report.first_error


# -- input validation ------------------------------------------------------------------------


def test_topology_rejects_sizes_megatron_rejects():
    with pytest.raises(ValueError, match=r"not divisible by etp\*ep\*pp = 8"):
        Topology(tp=2, pp=1, dp=3, ep=4)
    with pytest.raises(ValueError, match="tp must be a positive int"):
        Topology(tp=0, pp=1, dp=1)
    with pytest.raises(ValueError, match="needs distributed_optimizer=True"):
        Topology(tp=1, pp=1, dp=2, distributed_optimizer=False, num_optimizer_instances=2)
    with pytest.raises(ValueError, match="must divide both dp\\*cp = 3"):
        Topology(tp=1, pp=1, dp=3, num_optimizer_instances=2)
    assert Topology(tp=4, pp=2, dp=2, ep=2).etp == 4
    assert Topology(tp=4, pp=2, dp=2, ep=2, etp=1).edp == 4


def test_inventory_errors_name_the_parameter():
    with pytest.raises(ValueError, match="6 experts cannot be split evenly over ep=4"):
        audit(Topology(tp=1, pp=1, dp=4, ep=4), gpt_inventory(num_experts=6))
    with pytest.raises(ValueError, match="linear_qkv.weight'.*not divisible by tp=4"):
        audit(Topology(tp=4, pp=1, dp=1), gpt_inventory(hidden=6))
    with pytest.raises(
        ValueError, match="'decoder.layers.1.input_layernorm.weight' is on stage 1, but pp=1"
    ):
        audit(Topology(tp=1, pp=1, dp=1), gpt_inventory(stages=2))
    with pytest.raises(ValueError, match="combine must be one of"):
        rank_norms(
            Topology(1, 1, 1), gpt_inventory(), random_grads(gpt_inventory(), 0), combine="max"
        )
