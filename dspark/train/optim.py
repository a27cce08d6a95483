"""AdamW over fp32 master weights of a bf16 model: bf16 compute without autocast's per-call weight casts."""
from __future__ import annotations

import torch
import torch.distributed as dist


class MasterAdamW:
    """The model's parameters stay in the compute dtype (no casts in forward or backward); AdamW
    updates fp32 masters and copies them back after each step. Gradients are summed into the masters
    in fp32 after every micro-batch (accumulate), so long accumulations lose nothing to bf16."""

    def __init__(self, params, *, lr: float, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.0):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=betas, weight_decay=weight_decay)

    def accumulate(self) -> None:
        """Move the model's gradients into the masters' (sums across calls)."""
        for p, m in zip(self.params, self.master):
            if p.grad is None:
                continue
            g = p.grad.float()
            m.grad = g if m.grad is None else m.grad.add_(g)
            p.grad = None

    def step(self, lr: float, clip: float, world: int = 1) -> float:
        """Sum gradients over ranks, clip, update the masters, copy them into the model; returns the norm."""
        grads = [m.grad if m.grad is not None else torch.zeros_like(m) for m in self.master]
        if world > 1:  # one flat all-reduce (sum: each rank's loss already carries the global denominator)
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
        for m, g in zip(self.master, grads):
            m.grad = g
        norm = float(torch.nn.utils.clip_grad_norm_(self.master, clip))
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)
        return norm

    def state_dict(self) -> dict:
        return {"adamw": self.opt.state_dict(), "master": [m.detach().clone() for m in self.master]}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.master, state["master"]):
                m.copy_(saved)
                p.copy_(saved)
        self.opt.load_state_dict(state["adamw"])
