"""A pure-torch Adam with Apex ``FusedAdam``'s interface and state layout, for tests.

megatron-core has two code paths for Adam's checkpoint state: with TE or Apex installed,
``step`` is one integer per param group (the fused optimizers keep it there); without them,
torch's Adam keeps a ``step`` tensor per parameter, and megatron-core 0.19.2 cannot load
its own distributed-optimizer checkpoints on that path. The GPU test machine has neither
TE nor Apex, so to test stock megatron-core loading a checkpoint (on->off) where stock's own
round trip works, :func:`use_apex_path` points megatron-core's optimizer modules at
:class:`FusedAdam` below and sets their "Apex is installed" flags, for one test.

Semantics (Apex's documented ones): one ``step`` counter per group, incremented on every
``step()``; ``exp_avg`` and ``exp_avg_sq`` per parameter, shaped like it; bias correction
on by default; ``adam_w_mode=True`` decays the weights decoupled from the gradient
(AdamW), ``False`` adds ``weight_decay * p`` to the gradient (L2). Math in fp32.
"""

import torch


class FusedAdam(torch.optim.Optimizer):
    """Apex ``FusedAdam``'s constructor and state layout, computed with torch ops."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
    ) -> None:
        for name, value in (
            ("amsgrad", amsgrad),
            ("capturable", capturable),
            ("master_weights", master_weights),
        ):
            if value:
                raise NotImplementedError(f"apex_standin.FusedAdam: {name}=True not supported")
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
            weight_decay=weight_decay,
        )  # fmt: skip
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            step = group["step"]
            beta1, beta2 = group["betas"]
            c1 = 1 - beta1**step if group["bias_correction"] else 1.0
            c2 = 1 - beta2**step if group["bias_correction"] else 1.0
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                g = p.grad.float()
                w = p.float()
                if not self.adam_w_mode and wd != 0:
                    g = g + wd * w
                m = state["exp_avg"].float().mul_(beta1).add_(g, alpha=1 - beta1)
                v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / c1) / ((v / c2).sqrt() + eps)
                if self.adam_w_mode and wd != 0:
                    update = update + wd * w
                p.copy_(w - lr * update)
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
        return loss


def use_apex_path(monkeypatch) -> None:
    """Make megatron-core (0.19.2) build and checkpoint Adam as it does with Apex installed.

    Patches, for the calling test only: ``megatron.core.optimizer.Adam`` and
    ``distrib_optimizer.Adam`` (the class it builds and accepts), and the module flags that
    choose the Apex branches (``USING_PYTORCH_OPTIMIZER``, ``HAVE_APEX_OR_TE``,
    ``USING_APEX_OPTIMIZER``). Fails loudly if a name is gone (another megatron-core).
    """
    import megatron.core.optimizer as mcore_opt
    from megatron.core.optimizer import distrib_optimizer

    monkeypatch.setattr(mcore_opt, "Adam", FusedAdam, raising=True)
    monkeypatch.setattr(mcore_opt, "USING_PYTORCH_OPTIMIZER", False, raising=True)
    monkeypatch.setattr(distrib_optimizer, "Adam", FusedAdam, raising=True)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True, raising=True)
    monkeypatch.setattr(distrib_optimizer, "USING_APEX_OPTIMIZER", True, raising=True)
