"""build_stack on the CPU: configs from arguments, errors before anything is built, wiring.

megatron-core's DDP allocates its buffers on CUDA, so the constructors are replaced by
recording fakes here; tests/gpu/ builds real stacks with it.
"""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.distributed import DistributedDataParallel as MCoreDDP
from megatron.core.distributed import DistributedDataParallelConfig as MCoreDDPConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig

import megatron_ext
from megatron_ext import stack as stack_module

pytestmark = pytest.mark.mcore

BF16 = SimpleNamespace(bf16=True, fp16=False)


@pytest.fixture
def recorded(monkeypatch):
    """Replace the DDP class and the optimizer factory build_stack calls; record the calls."""
    calls = SimpleNamespace(ddp=[], optimizer=[])

    def ddp(config, ddp_config, module):
        calls.ddp.append((config, ddp_config, module))
        return SimpleNamespace(name="model")

    def get_optimizer(config, model_chunks, **kwargs):
        calls.optimizer.append((config, model_chunks, kwargs))
        return SimpleNamespace(name="optimizer")

    monkeypatch.setattr(stack_module, "DistributedDataParallel", ddp)
    monkeypatch.setattr(stack_module, "get_megatron_optimizer", get_optimizer)
    return calls


def test_defaults_are_the_option_and_the_distributed_optimizer(recorded):
    module = torch.nn.Linear(2, 2)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, bf16=True)
    built = megatron_ext.build_stack(module, config)
    want_ddp = megatron_ext.DistributedDataParallelConfig(
        per_dtype_grad_buffers=True, use_distributed_optimizer=True
    )
    want_opt = OptimizerConfig(use_distributed_optimizer=True, bf16=True, fp16=False)
    assert built.ddp_config == want_ddp and isinstance(built.ddp_config, MCoreDDPConfig)
    assert built.optimizer_config == want_opt
    assert recorded.ddp == [(config, built.ddp_config, module)]
    [(opt_config, chunks, kwargs)] = recorded.optimizer
    assert opt_config is built.optimizer_config
    assert chunks == [built.model] and built.model.name == "model"
    assert kwargs == {"options": None}
    assert built.optimizer.name == "optimizer"


def test_mappings_become_megatron_core_config_fields(recorded):
    options = megatron_ext.MegatronOptions(host_mirrors=False)
    built = megatron_ext.build_stack(
        torch.nn.Linear(2, 2),
        BF16,
        ddp=dict(grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=40_000),
        optimizer=dict(
            lr=1e-2,
            weight_decay=0.1,
            clip_grad=0.5,
            use_precision_aware_optimizer=True,
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=0.5,
            overlap_cpu_optimizer_d2h_h2d=True,
        ),
        options=options,
    )
    assert built.ddp_config == megatron_ext.DistributedDataParallelConfig(
        per_dtype_grad_buffers=True,
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=True,
        bucket_size=40_000,
    )
    assert built.optimizer_config == OptimizerConfig(
        lr=1e-2,
        weight_decay=0.1,
        bf16=True,
        clip_grad=0.5,
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=True,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=0.5,
        overlap_cpu_optimizer_d2h_h2d=True,
    )
    assert recorded.optimizer[0][2] == {"options": options}


def test_one_argument_turns_the_distributed_optimizer_off_in_both_configs(recorded):
    built = megatron_ext.build_stack(
        torch.nn.Linear(2, 2), BF16, per_dtype_grad_buffers=False, distributed_optimizer=False
    )
    assert built.ddp_config.use_distributed_optimizer is False
    assert built.ddp_config.per_dtype_grad_buffers is False
    assert built.optimizer_config.use_distributed_optimizer is False


@pytest.mark.parametrize(
    "config, given, want",
    [
        (SimpleNamespace(bf16=False, fp16=True), {}, (False, True)),
        (SimpleNamespace(bf16=False, fp16=False), {}, (False, False)),
        (BF16, {"bf16": False}, (False, False)),  # given fields win
    ],
)
def test_optimizer_precision_defaults_to_the_transformer_configs(recorded, config, given, want):
    built = megatron_ext.build_stack(torch.nn.Linear(2, 2), config, optimizer=given)
    assert (built.optimizer_config.bf16, built.optimizer_config.fp16) == want


def test_ready_configs_are_used_as_they_are(recorded):
    ddp_config = megatron_ext.DistributedDataParallelConfig(
        per_dtype_grad_buffers=True, use_distributed_optimizer=True, bucket_size=123
    )
    opt_config = OptimizerConfig(lr=3.0, use_distributed_optimizer=True, bf16=False)
    built = megatron_ext.build_stack(
        torch.nn.Linear(2, 2), BF16, ddp=ddp_config, optimizer=opt_config
    )
    assert built.ddp_config is ddp_config and built.optimizer_config is opt_config
    stock = MCoreDDPConfig(use_distributed_optimizer=False)
    built = megatron_ext.build_stack(
        torch.nn.Linear(2, 2),
        BF16,
        per_dtype_grad_buffers=False,
        distributed_optimizer=False,
        ddp=stock,
    )
    assert built.ddp_config is stock


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(ddp=dict(per_dtype_grad_buffers=False)), ValueError,
         r"ddp\['per_dtype_grad_buffers'\] is set by build_stack's per_dtype_grad_buffers="),
        (dict(ddp=dict(use_distributed_optimizer=True)), ValueError,
         r"ddp\['use_distributed_optimizer'\] .* distributed_optimizer= argument; pass "
         r"distributed_optimizer=True"),
        (dict(optimizer=dict(use_distributed_optimizer=False)), ValueError,
         r"optimizer\['use_distributed_optimizer'\] .* distributed_optimizer="),
        (dict(ddp=dict(bucket_sise=1, overlap_grad_reduce=True)), ValueError,
         r"ddp has 'bucket_sise', which .*DistributedDataParallelConfig does not take"),
        (dict(optimizer=dict(learning_rate=1.0)), ValueError,
         r"optimizer has 'learning_rate', which .*OptimizerConfig does not take"),
        (dict(ddp=megatron_ext.DistributedDataParallelConfig(use_distributed_optimizer=True)),
         ValueError, r"ddp has per_dtype_grad_buffers=False but build_stack was given "
         r"per_dtype_grad_buffers=True; make them agree"),
        (dict(ddp=megatron_ext.DistributedDataParallelConfig(per_dtype_grad_buffers=True)),
         ValueError, r"ddp has use_distributed_optimizer=False but .* distributed_optimizer=True"),
        (dict(ddp=MCoreDDPConfig(use_distributed_optimizer=True)), ValueError,
         r"megatron-core's own DDP config, which has no per_dtype_grad_buffers; pass a "
         r"megatron_ext.DistributedDataParallelConfig"),
        (dict(optimizer=OptimizerConfig()), ValueError,
         r"optimizer has use_distributed_optimizer=False but .* distributed_optimizer=True"),
        (dict(per_dtype_grad_buffers=False, options=megatron_ext.MegatronOptions()), ValueError,
         r"options apply to per-dtype gradient buffers only"),
        (dict(ddp=[("bucket_size", 1)]), TypeError,
         r"ddp must be a mapping of DistributedDataParallelConfig fields .* not list"),
        (dict(optimizer="adam"), TypeError,
         r"optimizer must be a mapping of OptimizerConfig fields or an? OptimizerConfig, not str"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_before_anything_is_built(recorded, kwargs, error, match):
    with pytest.raises(error, match=match):
        megatron_ext.build_stack(torch.nn.Linear(2, 2), BF16, **kwargs)
    assert recorded.ddp == [] and recorded.optimizer == []


@pytest.fixture
def mcore_constructors(monkeypatch):
    """megatron-core's DDP constructor (CUDA-only) and optimizer factory, as recording fakes.

    megatron_ext's own classes run for real on top of them.
    """
    calls = SimpleNamespace(ddp=[], factory=[], flat=[])

    def ddp_init(self, config, ddp_config, module, *args, **kwargs):
        torch.nn.Module.__init__(self)
        self.module = module
        self.buffers, self.expert_parallel_buffers = [], []
        self.intra_dp_cp_group = self.intra_expt_dp_group = None  # no process group here
        calls.ddp.append((config, ddp_config, module, args, kwargs))

    def factory(config, model_chunks, *args, **kwargs):
        calls.factory.append((config, model_chunks, args, kwargs))
        return SimpleNamespace(name="megatron-core's optimizer")

    def enable_flat_norm(opt, model_chunks, options=None):
        calls.flat.append((opt, model_chunks, options))
        return SimpleNamespace(name="flat", inner=opt)

    import megatron.core.optimizer as mcore_optimizer

    monkeypatch.setattr(MCoreDDP, "__init__", ddp_init)
    monkeypatch.setattr(mcore_optimizer, "get_megatron_optimizer", factory)
    monkeypatch.setattr(megatron_ext.optimizer, "enable_flat_norm", enable_flat_norm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the fakes need no GPU
    return calls


@pytest.mark.parametrize("per_dtype_grad_buffers", [True, False])
def test_without_cuda_both_refuse_in_one_line_before_megatron_core_runs(
    mcore_constructors, monkeypatch, per_dtype_grad_buffers
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = torch.nn.Linear(2, 2)
    ddp_config = megatron_ext.DistributedDataParallelConfig(
        per_dtype_grad_buffers=per_dtype_grad_buffers
    )
    calls = [
        lambda: megatron_ext.DistributedDataParallel(BF16, ddp_config, module),
        lambda: megatron_ext.build_stack(
            module, BF16, per_dtype_grad_buffers=per_dtype_grad_buffers
        ),
    ]
    for call in calls:
        with pytest.raises(RuntimeError) as exc:
            call()
        message = str(exc.value)
        assert "\n" not in message and "needs a CUDA GPU" in message, message
        assert "buffers.FlatGradBuffers" in message  # what to use on the CPU instead
    assert mcore_constructors.ddp == [] and mcore_constructors.factory == []


def test_stock_is_megatron_cores_ddp_and_optimizer_factory(mcore_constructors):
    module = torch.nn.Linear(2, 2)
    built = megatron_ext.build_stack(module, BF16, per_dtype_grad_buffers=False)
    [(config, ddp_config, wrapped, args, kwargs)] = mcore_constructors.ddp
    assert config is BF16 and ddp_config is built.ddp_config and wrapped is module
    assert args == () and kwargs == {}
    assert built.model.per_dtype_grad_buffers is False and built.model.layout is None
    assert built.optimizer.name == "megatron-core's optimizer"
    assert mcore_constructors.factory == [(built.optimizer_config, [built.model], (), {})]
    assert mcore_constructors.flat == []


def test_the_option_builds_layouts_and_flat_norm_optimizers(mcore_constructors):
    options = megatron_ext.MegatronOptions(host_mirrors=False)
    built = megatron_ext.build_stack(torch.nn.Linear(2, 2), BF16, options=options)
    assert built.model.per_dtype_grad_buffers is True and built.model.layout is not None
    [(inner, chunks, given)] = mcore_constructors.flat
    assert inner.name == "megatron-core's optimizer" and chunks == [built.model]
    assert given is options
    assert built.optimizer.name == "flat" and built.optimizer.inner is inner


def _megatron_core_linear(cls, fused: bool):
    """An instance of megatron-core's linear layer class as its constructor leaves the
    attribute its forward reads (the constructor needs process groups)."""
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    layer.gradient_accumulation_fusion = fused
    return layer


@pytest.mark.parametrize("layer", ["ColumnParallelLinear", "RowParallelLinear"])
def test_fusion_without_apexs_kernel_and_a_megatron_core_linear_is_refused_in_one_line(
    mcore_constructors, monkeypatch, layer
):
    from megatron.core import tensor_parallel

    from megatron_ext import wgrad_fusion

    monkeypatch.setattr(wgrad_fusion, "fusion_kernel_available", lambda: False)
    config = SimpleNamespace(bf16=True, fp16=False, gradient_accumulation_fusion=True)

    def model(fused: bool):
        linear = _megatron_core_linear(getattr(tensor_parallel, layer), fused)
        return torch.nn.ModuleDict({"te_layer": torch.nn.Linear(2, 2), "output_layer": linear})

    with pytest.raises(megatron_ext.MissingFusionKernelError) as exc:
        megatron_ext.build_stack(model(fused=True), config)
    message = str(exc.value)
    assert "\n" not in message and "fused_weight_gradient_mlp_cuda" in message
    assert "gradient_accumulation_fusion=False" in message and "'output_layer'" in message
    assert mcore_constructors.ddp == [] and mcore_constructors.factory == []
    # what still builds: megatron-core's layer built unfused beside (transformer-engine's)
    # fused ones; no megatron-core layer at all; the kernel installed
    megatron_ext.build_stack(model(fused=False), config)
    megatron_ext.build_stack(torch.nn.Sequential(torch.nn.Linear(2, 2)), config)
    monkeypatch.setattr(wgrad_fusion, "fusion_kernel_available", lambda: True)
    megatron_ext.build_stack(model(fused=True), config)
    assert len(mcore_constructors.ddp) == 3
