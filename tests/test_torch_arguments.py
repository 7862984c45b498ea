"""torch's argument habits: positional order, any max_norm >= 0, checked keyword arguments,
and construction from what torch's clip accepts, all-or-nothing."""

import inspect
import math

import pytest
import torch

from buffers import FlatGradBuffers, GradientOutsideBufferError

BF16, FP32, FP64 = torch.bfloat16, torch.float32, torch.float64
TOL = {BF16: 2**-7, FP32: 1e-6, FP64: 1e-12}


def filled(dtypes=(BF16, FP32), seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(17 + 5 * i, dtype=dt)) for i, dt in enumerate(dtypes)]
    fgb = FlatGradBuffers(params)
    for p in params:
        p.grad.copy_(torch.randn(p.shape, generator=gen, dtype=FP64) * scale)
    return fgb, params


def torch_clip(params, *args, dtype=FP64):
    """torch.nn.utils.clip_grad_norm_ over copies of the real gradients: fp64 copies by
    default (torch's own bf16 per-tensor norms are ~1e-3 off), or copies in their own dtype
    (``dtype=None``) where the range of torch's statistic is what decides (an inf norm)."""
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for t, p in zip(twins, params, strict=True):
        t.data = t.data.to(dtype or p.dtype)
        t.grad = p.grad.to(dtype or p.dtype, copy=True)
    norm = torch.nn.utils.clip_grad_norm_(twins, *args)
    return norm, [t.grad.double() for t in twins]


def assert_grads(params, want):
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad.double(), w, rtol=TOL[p.dtype], atol=0, equal_nan=True)


# --- positional order -------------------------------------------------------------------------


def positional(fn):
    return [
        n
        for n, a in inspect.signature(fn).parameters.items()
        if a.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD and n != "self"
    ]


def test_positional_parameters_are_torchs():
    assert (
        positional(FlatGradBuffers.clip_grad_norm_)
        == positional(torch.nn.utils.clip_grad_norm_)[1:]
    )
    assert positional(FlatGradBuffers.grad_norm) == positional(torch.nn.utils.get_total_norm)[1:]
    for fn in (FlatGradBuffers.clip_grad_norm_, FlatGradBuffers.grad_norm):
        kw = inspect.signature(fn).parameters
        assert kw["group"].kind == inspect.Parameter.KEYWORD_ONLY
        assert kw["per_param"].kind == inspect.Parameter.KEYWORD_ONLY
    assert inspect.signature(FlatGradBuffers.count_zeros).parameters["group"].kind == (
        inspect.Parameter.KEYWORD_ONLY
    )
    step = inspect.signature(FlatGradBuffers.clipped_step).parameters
    assert step["group"].kind == step["fold"].kind == inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf, "inf"])
@pytest.mark.parametrize("foreach", [None, True, False])
def test_positional_call_as_torch(norm_type, foreach):
    fgb, params = filled(seed=1)
    want, grads = torch_clip(params, 0.5, norm_type, True, foreach)
    got = fgb.clip_grad_norm_(0.5, norm_type, True, foreach)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert_grads(params, grads)
    total = torch.nn.utils.get_total_norm([p.grad.double() for p in params], norm_type, True)
    assert fgb.grad_norm(norm_type, True, foreach).item() == pytest.approx(total.item(), rel=1e-5)


@pytest.mark.parametrize("call", ["clip", "norm"])
def test_positional_error_if_nonfinite_raises_as_torch(call):
    fgb, params = filled(seed=2)
    params[1].grad[3] = math.inf
    before = [p.grad.clone() for p in params]
    with pytest.raises(RuntimeError, match="non-finite"):
        torch_clip(params, 1.0, 2.0, True)
    with pytest.raises(RuntimeError, match="non-finite"):
        fgb.clip_grad_norm_(1.0, 2.0, True) if call == "clip" else fgb.grad_norm(2.0, True)
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p.grad, b)


# --- keyword arguments checked before any gradient is touched --------------------------------

NOT_A_GROUP = [True, False, 0, "world", object()]


def calls(fgb, opt):
    return {
        "clip_grad_norm_": lambda **kw: fgb.clip_grad_norm_(0.1, **kw),
        "grad_norm": lambda **kw: fgb.grad_norm(**kw),
        "count_zeros": lambda **kw: fgb.count_zeros(**kw),
        "clipped_step": lambda **kw: fgb.clipped_step(opt, 0.1, **kw),
    }


def _stable_id(value) -> str:
    """A test id that is the same in every process (pytest-xdist's workers collect apart): a
    bare object's repr holds its address."""
    return "object()" if type(value) is object else repr(value)


@pytest.mark.parametrize("bad", NOT_A_GROUP, ids=_stable_id)
@pytest.mark.parametrize("call", ["clip_grad_norm_", "grad_norm", "count_zeros", "clipped_step"])
def test_a_group_that_is_not_a_process_group_is_refused_first(bad, call):
    fgb, params = filled(seed=3)
    opt = torch.optim.SGD(params, lr=0.5)
    grads = [p.grad.clone() for p in params]
    weights = [p.detach().clone() for p in params]
    with pytest.raises(TypeError, match="group must be a torch.distributed.ProcessGroup"):
        calls(fgb, opt)[call](group=bad)
    for p, g, w in zip(params, grads, weights, strict=True):
        assert torch.equal(p.grad, g) and torch.equal(p.detach(), w)


@pytest.mark.parametrize(
    ("call", "args", "kwargs", "named"),
    [
        ("clip_grad_norm_", (0.1, 2.0, "yes"), {}, "error_if_nonfinite"),
        ("clip_grad_norm_", (0.1, 2.0, False, "yes"), {}, "foreach"),
        ("clip_grad_norm_", (0.1,), {"per_param": 1}, "per_param"),
        ("grad_norm", (2.0, None), {}, "error_if_nonfinite"),
        ("grad_norm", (2.0, False, 1), {}, "foreach"),
        ("clipped_step", (0.1,), {"fold": "no"}, "fold"),
    ],
)
def test_flags_must_be_bools(call, args, kwargs, named):
    fgb, params = filled(seed=4)
    opt = torch.optim.SGD(params, lr=0.5)
    grads = [p.grad.clone() for p in params]
    fn = getattr(fgb, call)
    with pytest.raises(TypeError, match=f"{named} must be a bool"):
        fn(opt, *args, **kwargs) if call == "clipped_step" else fn(*args, **kwargs)
    for p, g in zip(params, grads, strict=True):
        assert torch.equal(p.grad, g)


# --- any max_norm >= 0 ------------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [1e39, 1e300, math.inf, 3.4e38, 0.0, 1e-30])
@pytest.mark.parametrize("dtypes", [(BF16, FP32), (FP32,), (BF16, FP64)], ids=str)
@pytest.mark.parametrize("nonfinite", [False, True])
def test_any_max_norm_as_torch(max_norm, dtypes, nonfinite):
    fgb, params = filled(dtypes, seed=5, scale=1e3)
    if nonfinite:
        params[0].grad[1] = math.inf
    want, grads = torch_clip(params, max_norm, dtype=None if nonfinite else FP64)
    got = fgb.clip_grad_norm_(max_norm)
    assert got.item() == pytest.approx(want.item(), rel=1e-5, nan_ok=True)
    if max_norm == 1e-30 and not nonfinite:
        # coefficient 1e-30 / 1e4: below bf16/fp32's range for the products, as in torch
        for p in params:
            assert p.grad.abs().max().item() < 1e-30
        return
    assert_grads(params, grads)


# --- construction -----------------------------------------------------------------------------


def test_a_single_parameter_as_torch():
    p = torch.nn.Parameter(torch.zeros(10))
    fgb = FlatGradBuffers(p)
    p.grad.copy_(torch.arange(10.0))
    want, grads = torch_clip([p], 2.0)
    assert fgb.clip_grad_norm_(2.0).item() == pytest.approx(want.item(), rel=1e-6)
    assert_grads([p], grads)


def test_a_non_leaf_tensor_is_refused_by_name():
    w = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"'double' is not a leaf tensor .*MulBackward0"):
        FlatGradBuffers([("w", w), ("double", w * 2)])


def test_an_empty_list_is_torchs_zero_and_an_exhausted_generator_an_error():
    fgb = FlatGradBuffers([])
    assert fgb.clip_grad_norm_(1.0).item() == 0.0 == torch.nn.utils.clip_grad_norm_([], 1.0)
    assert fgb.count_zeros().item() == 0
    net = torch.nn.Linear(3, 3)
    params = net.parameters()
    list(params)
    with pytest.raises(ValueError, match="exhausted generator"):
        FlatGradBuffers(params)
    assert FlatGradBuffers(iter([]), device="cpu").grad_norm().item() == 0.0


def test_all_frozen_warns():
    net = torch.nn.Linear(3, 3).requires_grad_(False)
    with pytest.warns(UserWarning, match="none of the 2 parameters .* requires grad"):
        fgb = FlatGradBuffers(net.parameters())
    assert fgb.grad_norm().item() == 0.0


def test_complex_parameters_are_an_unsupported_dtype():
    z = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(
        TypeError, match=r"'z' has dtype torch.complex64, which is unsupported.*accepted dtypes"
    ):
        FlatGradBuffers([("a", torch.nn.Parameter(torch.zeros(2))), ("z", z)])


class RefusesHooks(torch.nn.Parameter):
    """A parameter whose hook registration fails: construction fails while binding."""

    def register_post_accumulate_grad_hook(self, hook):
        raise RuntimeError("no hooks here")

    def register_hook(self, hook):
        raise RuntimeError("no hooks here")


def invalid(kind):
    if kind == "non_leaf":
        return torch.nn.Parameter(torch.zeros(3)) * 2
    if kind == "complex":
        return torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    if kind == "meta":
        return torch.nn.Parameter(torch.zeros(3, device="meta"))
    return RefusesHooks(torch.zeros(3))


@pytest.mark.parametrize("kind", ["non_leaf", "complex", "meta", "hook_fails"])
@pytest.mark.parametrize("at", [0, 3, 5])
def test_a_failed_construction_leaves_nothing_behind(kind, at):
    gen = torch.Generator().manual_seed(at)
    params = []
    for i in range(6):
        dt = BF16 if i % 2 else FP32
        p = torch.nn.Parameter(torch.zeros(4 + i, dtype=dt))
        if i % 3 == 0:
            p.grad = torch.randn(p.shape, generator=gen).to(dt)
        params.append(p)
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    params.insert(2, frozen)
    params[at if at < 2 else at + 1] = invalid(kind)
    grads = [p.grad if p.is_leaf else None for p in params]
    values = [None if g is None else g.clone() for g in grads]
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        FlatGradBuffers(params)
    for p, g, v in zip(params, grads, values, strict=True):
        if p.is_leaf:
            assert p.grad is g, "a .grad was replaced"
            assert v is None or torch.equal(p.grad, v)
            assert not getattr(p, "_post_accumulate_grad_hooks", None), "a hook was left"
            assert not getattr(p, "_backward_hooks", None), "a hook was left"
    assert not frozen.requires_grad


# --- what construction refuses, by name ------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"params": 3}, r"FlatGradBuffers\(params=3\): expected a module, a parameter, or an "),
        ({"params": None}, r"params=None\): .* not a NoneType"),
        ({"counted": 1}, r"counted=1: expected None .* or a function"),
        ({"options": "fast"}, r"options='fast': expected a buffers.BufferOptions"),
    ],
)
def test_arguments_of_the_wrong_type_are_named(kwargs, match):
    net = torch.nn.Linear(3, 2)
    args = {"params": net.named_parameters()} | kwargs
    params = args.pop("params")
    with pytest.raises(TypeError, match=match):
        FlatGradBuffers(params, **args)
    assert net.weight.grad is None  # nothing bound


@pytest.mark.parametrize("answer", [1, "yes", None, torch.tensor(True)])
def test_counted_must_answer_true_or_false(answer):
    net = torch.nn.Linear(3, 2)
    with pytest.raises(TypeError, match=r"counted returned .* for parameter 'weight'; it must"):
        FlatGradBuffers(net.named_parameters(), counted=lambda p: answer)
    fgb = FlatGradBuffers(net.named_parameters(), counted=lambda p: p.dim() == 2)
    assert [s.counted for s in fgb.plan.buffers[FP32].slots] == [True, False]


def test_a_lazy_module_before_its_first_forward_is_named():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LazyLinear(2))
    with pytest.raises(ValueError, match=r"'1\.weight' is not initialized yet .*run one forward"):
        FlatGradBuffers(net.named_parameters())
    assert net[0].weight.grad is None
    net(torch.randn(3, 4))  # initialized now
    fgb = FlatGradBuffers(net.named_parameters())
    assert fgb.view(net[1].weight).shape == (2, 4)


# --- sparse gradients --------------------------------------------------------------------------


def sparse_model(kind=torch.nn.Embedding):
    torch.manual_seed(0)
    net = torch.nn.ModuleDict({"emb": kind(10, 4, sparse=True), "head": torch.nn.Linear(4, 1)})
    return net


def sparse_loss(net):
    emb = net["emb"]
    idx = torch.tensor([[1, 3], [3, 7]])
    out = (
        emb(idx)
        if isinstance(emb, torch.nn.Embedding)
        else emb(idx.flatten(), torch.tensor([0, 2]))
    )
    return net["head"](out).square().sum()


@pytest.mark.parametrize("kind", [torch.nn.Embedding, torch.nn.EmbeddingBag])
@pytest.mark.parametrize("given", ["module", "named_parameters", "parameters"])
def test_a_sparse_embedding_is_refused_at_build_by_name(kind, given):
    net = sparse_model(kind)
    params = {
        "module": net,
        "named_parameters": net.named_parameters(),
        "parameters": net.parameters(),
    }[given]
    name = "emb.weight" if given != "parameters" else r"params\[0\]"
    with pytest.raises(TypeError, match=rf"'{name}' gets sparse gradients \({kind.__name__}\(sp"):
        FlatGradBuffers(params)
    assert all(p.grad is None for p in net.parameters())  # nothing bound
    net["emb"].sparse = False  # dense gradients: accepted
    FlatGradBuffers(net)


def test_a_frozen_sparse_embedding_is_accepted():
    net = sparse_model()
    net["emb"].weight.requires_grad_(False)
    fgb = FlatGradBuffers(net)
    fgb.zero_()
    sparse_loss(net).backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in net["head"].parameters()])
    assert fgb.grad_norm().item() == pytest.approx(want.item(), rel=1e-6)


def test_a_sparse_gradient_given_as_a_list_is_refused_by_the_hook():
    # a list says nothing of the module: its backward hook sees the sparse gradient
    net = sparse_model()
    fgb = FlatGradBuffers(list(net.parameters()))
    fgb.zero_()
    with pytest.raises(
        GradientOutsideBufferError, match=r"'params\[0\]' received a torch.sparse_coo gradient"
    ):
        sparse_loss(net).backward()
    net["emb"].sparse = False
    fgb.zero_()
    sparse_loss(net).backward()  # dense now: accumulated in the buffer
    assert net["emb"].weight.grad is fgb.view(net["emb"].weight)


def test_a_sparse_parameter_is_refused_by_name():
    dense = torch.nn.Parameter(torch.zeros(2))
    sparse = torch.nn.Parameter(torch.zeros(3, 3).to_sparse())
    with pytest.raises(TypeError, match=r"'s' is a torch.sparse_coo tensor; flat buffers hold"):
        FlatGradBuffers([("d", dense), ("s", sparse)])


def test_a_sparse_embedding_left_out_trains_with_sparse_adam():
    # what the refusal advises: the dense rest in the buffers, the embedding on its own
    net = sparse_model()
    rest = [(n, p) for n, p in net.named_parameters() if not n.startswith("emb.")]
    fgb = FlatGradBuffers(rest)
    dense = torch.optim.AdamW([p for _, p in rest], lr=0.1)
    sparse = torch.optim.SparseAdam([net["emb"].weight], lr=0.1)
    before = net["emb"].weight.detach().clone()
    for _ in range(2):
        fgb.zero_()
        sparse.zero_grad()
        sparse_loss(net).backward()
        assert net["emb"].weight.grad.is_sparse
        want = torch.nn.utils.get_total_norm([p.grad.double() for _, p in rest])
        assert fgb.clip_grad_norm_(1.0).item() == pytest.approx(want.item(), rel=1e-6)
        dense.step()
        sparse.step()
    changed = (net["emb"].weight != before).any(dim=1)
    assert changed.tolist() == [i in (1, 3, 7) for i in range(10)]  # only the rows looked up
