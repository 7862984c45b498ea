"""Run-time norm-ownership audit: the pure check, a gloo gather, and the explain table."""

import os
import pickle
import re
import types

import pytest
import torch
import torch.distributed as dist

from buffers.spans import Span
from megatron_ext.counted_spans import SHARED, GradRecord, exclusion_reason, rank_spans
from megatron_ext.norm_audit import (
    AuditResult,
    Claim,
    NormOwnershipError,
    ParallelRanks,
    PieceKey,
    audit_norm_ownership,
    buffer_claims,
    check_claims,
    explain_norm,
    gather_and_check,
    local_spans,
    piece_key,
)
from tests.support.spawn import spawn

pytestmark = pytest.mark.mcore

W = PieceKey(0, 0, "decoder.layers.0.mlp.linear_fc1.weight", 1, None)
B = PieceKey(0, 0, "decoder.layers.0.input_layernorm.weight", None, None)
OUT = PieceKey(1, 0, "output_layer.weight", 0, None)
TP_DUP = exclusion_reason(
    shared=False, tensor_model_parallel=False, is_expert=False, tp_rank=1, expert_tp_rank=0
)


def claim(key, numel, *spans, why=None):
    return Claim(key, numel, tuple(Span(a, b) for a, b in spans), why)


def good_claims():
    return {
        0: [claim(W, 128, (0, 64)), claim(B, 10, (0, 10)), claim(OUT, 32, why=SHARED)],
        1: [claim(W, 128, (64, 128)), claim(B, 10, why=TP_DUP), claim(OUT, 32, why=SHARED)],
    }


def test_each_piece_covered_once_passes():
    assert check_claims(good_claims()) == AuditResult(((0, 1),), 3, 138, 1)


@pytest.mark.parametrize(
    ("rank", "replacement", "expected"),
    [
        (
            1,
            claim(W, 128, (60, 128)),
            "for 'decoder.layers.0.mlp.linear_fc1.weight' (pipeline rank 0, model chunk 0, "
            "tensor-parallel piece 1): local elements [60, 64) of 128 are counted twice "
            "(expected once), by ranks [0, 1]; held by ranks [0, 1].",
        ),
        (
            1,
            claim(W, 128, (70, 128)),
            "local elements [64, 70) of 128 are counted zero times (expected once), by no rank",
        ),
        (
            0,
            claim(B, 10, why=TP_DUP),
            "for 'decoder.layers.0.input_layernorm.weight' (pipeline rank 0, model chunk 0, "
            "replicated over tensor-parallel ranks): local elements [0, 10) of 10 are counted "
            "zero times (expected once), by no rank; held by ranks [0, 1]; excluded on ranks "
            "[0, 1]: tensor-parallel duplicate (counted on rank 0, this is rank 1).",
        ),
        (
            1,
            claim(OUT, 32, (0, 32), why=SHARED),
            "'output_layer.weight' (pipeline rank 1, model chunk 0, tensor-parallel piece 0): "
            "local elements [0, 32) of 32 are counted once (expected zero times: a shared copy",
        ),
        (
            0,
            claim(W, 128, (0, 70)),
            "[64, 70) of 128 are counted twice (expected once), by ranks [0, 1]",
        ),
        (1, claim(W, 128, (64, 130)), "[128, 130) of 128 are counted once (expected none"),
        (1, claim(W, 256, (64, 128)), "ranks disagree on the size of 'decoder.layers.0.mlp"),
    ],
)
def test_miscount_names_the_piece_range_and_ranks(rank, replacement, expected):
    claims = good_claims()
    claims[rank] = [replacement if c.key == replacement.key else c for c in claims[rank]]
    with pytest.raises(NormOwnershipError, match=re.escape(expected)):
        check_claims(claims)


def test_first_bad_piece_is_reported_in_the_lowest_ranks_order():
    claims = good_claims()
    claims[1] = [claim(W, 128), claim(B, 10, (0, 10), why=None), claims[1][2]]
    with pytest.raises(NormOwnershipError, match="'decoder.layers.0.mlp.linear_fc1.weight'"):
        check_claims(claims)


def test_piece_keys_follow_megatrons_groups():
    ranks = ParallelRanks(pp=2, tp=1, expert_tp=3, ep=5)

    def key(tmp, expert):
        return piece_key("w", chunk=1, tensor_model_parallel=tmp, is_expert=expert, ranks=ranks)

    assert key(True, False) == PieceKey(2, 1, "w", 1, None)
    assert key(False, False) == PieceKey(2, 1, "w", None, None)
    assert key(True, True) == PieceKey(2, 1, "w", 3, 5)
    assert key(False, True) == PieceKey(2, 1, "w", None, 5)


def test_claims_are_local_offsets_without_padding():
    records = [
        GradRecord("a", 0, 100, 0),
        GradRecord("b", 128, 200, 0),
        GradRecord("c", 256, 300, 1),
    ]
    norm = (Span(0, 200), Span(270, 300))  # bridged across the padding between a and b
    assert local_spans(records[1], norm) == (Span(0, 72),)
    keys = [PieceKey(0, 0, r.name, None, None) for r in records]
    got = buffer_claims(records, norm, keys)
    assert [c.counted for c in got] == [(Span(0, 100),), (Span(0, 72),), (Span(14, 44),)]
    assert [c.numel for c in got] == [100, 72, 44]


# A buffer of two buckets (each a multiple of 2 and 3 elements), one parameter shared.
RECORDS = (
    GradRecord("embedding.word_embeddings.weight", 0, 100, 0),
    GradRecord("output_layer.weight", 128, 228, 0, SHARED),
    GradRecord("decoder.layers.0.mlp.linear_fc1.weight", 256, 300, 0),
    GradRecord("decoder.layers.0.mlp.linear_fc2.weight", 384, 600, 1),
    GradRecord("decoder.final_layernorm.weight", 640, 700, 1),
)
BUCKETS = (Span(0, 384), Span(384, 768))


def sharded_claims(size, index):
    spans = rank_spans(RECORDS, 768, BUCKETS, size, index)
    keys = [PieceKey(0, 0, r.name, None, None) for r in RECORDS]
    return buffer_claims(RECORDS, spans.norm, keys)


class FakeOptimizer(types.SimpleNamespace):
    def grads_states_parallel_group_is_shared(self):
        return False


def fake_model(records, buckets=None, dp=(1, 0), tp_flags=None):
    """A model chunk, a buffer, and one optimizer child whose target covers the buffer."""
    params = {}
    for r in records:
        p = torch.empty(r.end - r.start)
        p.tensor_model_parallel = (tp_flags or {}).get(r.name, False)
        params[p] = (r.start, r.end, r.bucket)
    numel = max(r.end for r in records)
    buf = types.SimpleNamespace(param_index_map=params, numel=numel)
    spans = rank_spans(records, numel, buckets, *dp) if buckets else rank_spans(records, numel)
    target = types.SimpleNamespace(
        name="bf16 grads of bf16 params (dense)", records=records, buffer=buf, spans=spans
    )
    chunk = types.SimpleNamespace(all_grad_buffers=lambda: [buf], per_dtype_grad_buffers=True)
    return chunk, types.SimpleNamespace(_flat=types.SimpleNamespace(targets=[target]))


def worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    pair = dist.new_group([0, 1])
    singles = [dist.new_group([r]) for r in range(world)]
    results = {}
    for name, group, members in (("world", None, world), ("pair", pair, 2)):
        if rank >= members:
            continue
        for corrupt in (False, True):
            # The corrupted last rank counts rank 0's shard instead of its own.
            index = 0 if corrupt and rank == members - 1 else rank
            try:
                results[name, corrupt] = gather_and_check(sharded_claims(members, index), group)
            except NormOwnershipError as e:
                results[name, corrupt] = str(e)
    # Children with different norm groups are audited over their own groups, in order.
    sharded, dense = fake_model(RECORDS, BUCKETS, (world, rank))
    unsharded, expert = fake_model(RECORDS[2:4])
    dense.get_grad_stats_parallel_group = lambda: dist.group.WORLD
    expert.get_grad_stats_parallel_group = lambda: singles[rank]
    chain = FakeOptimizer(chained_optimizers=[dense, expert])
    results["chain"] = audit_norm_ownership([sharded, unsharded], chain)
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    dist.destroy_process_group()


def test_gather_and_check_over_gloo(tmp_path):
    # One spawn of 3 processes checks a 3-rank group (the world) and a 2-rank subgroup.
    world = 3
    spawn(worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    results = [pickle.loads((tmp_path / f"{r}.pkl").read_bytes()) for r in range(world)]
    for name, members in (("world", 3), ("pair", 2)):
        for r in range(members):
            assert results[r][name, False] == AuditResult((tuple(range(members)),), 5, 420, 1)
        messages = {results[r][name, True] for r in range(members)}
        assert len(messages) == 1, messages
        (message,) = messages
        assert message.startswith(
            "gradient-norm ownership check failed for 'embedding.word_embeddings.weight' "
            "(pipeline rank 0, model chunk 0, replicated over tensor-parallel ranks): local "
            "elements [0, 100) of 100 are counted twice (expected once), by ranks "
            f"[0, {members - 1}]"
        )
    for r in range(world):
        assert results[r]["chain"] == AuditResult(((0, 1, 2), (r,)), 7, 680, 1)


def test_audit_single_process_checks_this_ranks_claims_alone():
    chunk, child = fake_model(RECORDS)
    child.get_grad_stats_parallel_group = lambda: None
    opt = types.SimpleNamespace(chained_optimizers=[child])
    assert audit_norm_ownership([chunk], opt) == AuditResult(((0,),), 5, 420, 1)
    dup = (RECORDS[0], GradRecord("decoder.layers.0.input_layernorm.weight", 128, 140, 0, TP_DUP))
    chunk, child = fake_model(dup)
    child.get_grad_stats_parallel_group = lambda: None
    with pytest.raises(NormOwnershipError, match="input_layernorm.weight.*counted zero times"):
        audit_norm_ownership([chunk], types.SimpleNamespace(chained_optimizers=[child]))


def test_audit_rejects_an_optimizer_without_flat_state_or_foreign_chunks():
    chunk, child = fake_model(RECORDS)
    with pytest.raises(ValueError, match="no flat norm state"):
        audit_norm_ownership([chunk], types.SimpleNamespace(chained_optimizers=[object()]))
    other, _ = fake_model(tuple(list(RECORDS)))  # equal records, another buffer
    with pytest.raises(ValueError, match="in none of the model chunks"):
        explain_norm([other], types.SimpleNamespace(chained_optimizers=[child]))


def test_explain_norm_shows_every_exclusion_reason():
    records = (
        GradRecord("decoder.layers.0.mlp.linear_fc1.weight", 0, 128, 0),
        GradRecord("output_layer.weight", 128, 192, 0, SHARED),
        GradRecord("decoder.layers.0.input_layernorm.weight", 192, 200, 0, TP_DUP),
        GradRecord("decoder.layers.0.mlp.linear_fc2.weight", 256, 384, 1),
    )
    tp = {"decoder.layers.0.mlp.linear_fc1.weight": True}
    chunk, child = fake_model(records, (Span(0, 256), Span(256, 384)), (2, 1), tp)
    text = explain_norm([chunk], types.SimpleNamespace(chained_optimizers=[child]))
    print(text)
    lines = text.splitlines()
    assert lines[0].startswith("Gradient-norm ownership on rank 0 (pipeline rank 0")
    assert (
        "bf16 grads of bf16 params (dense): optimizer 0 (SimpleNamespace), model chunk 0;" in text
    )
    assert "this rank owns 192 of 384 elements" in text
    row = {line.split()[0]: line for line in lines[3:]}
    assert "other rank's shard: [0, 128)" in row["decoder.layers.0.mlp.linear_fc1.weight"]
    assert row["output_layer.weight"].rstrip().endswith("shared")
    assert (
        row["decoder.layers.0.input_layernorm.weight"]
        .rstrip()
        .endswith("tensor-parallel duplicate (counted on rank 0, this is rank 1)")
    )
    fc2 = row["decoder.layers.0.mlp.linear_fc2.weight"]  # bucket 1: rank 1 owns its 2nd half
    assert "[256, 384)" in fc2 and "[64, 128)" in fc2 and "other rank's shard: [0, 64)" in fc2
    assert re.search(
        r"total\s+4 params\s+328\s+64\s+other rank's shard: 192; shared: 64; "
        r"tensor-parallel duplicate: 8$",
        row["total"],
    )
    header, *body = lines[3:]
    numel_end = header.index("numel") + len("numel")  # right-aligned numbers end under it
    assert all(line[numel_end - 1].isdigit() and line[numel_end] == " " for line in body)
