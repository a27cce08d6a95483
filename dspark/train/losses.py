"""DSpark training losses: position-decayed CE + TV + confidence BCE against the analytic acceptance."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.drafters.blocks import IGNORE


@dataclass
class LossParts:
    """Weighted sums (numerators), weight sums (denominators) and per-position statistics, all local."""

    ce_num: torch.Tensor  # scalars (with grad for the three loss numerators)
    ce_den: torch.Tensor
    tv_num: torch.Tensor
    conf_num: torch.Tensor
    den: torch.Tensor  # weight mass of the valid slots (TV and confidence share it)
    soft_sum: torch.Tensor  # [gamma] sum of the soft label c* over valid slots
    match_sum: torch.Tensor  # [gamma] greedy match (argmax p_d == data token) over valid slots
    lead_sum: torch.Tensor  # [gamma] blocks whose first k+1 slots all matched (greedy prefix survival)
    count: torch.Tensor  # [gamma] valid slots per position
    blocks: torch.Tensor  # scalar: number of blocks with a valid first slot

    def stats(self) -> torch.Tensor:
        """All no-grad statistics flattened into one vector (for a single all_reduce)."""
        return torch.cat([torch.stack([self.ce_num.detach(), self.ce_den, self.tv_num.detach(),
                                       self.conf_num.detach(), self.den, self.blocks]),
                          self.soft_sum, self.match_sum, self.lead_sum, self.count]).double()


def position_weights(gamma: int, decay: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """w_k = exp(-(k-1)/decay) for k = 1..gamma."""
    return torch.exp(-torch.arange(gamma, device=device, dtype=torch.float32) / decay)


def tv_distance(log_pd: torch.Tensor, top_ids_d: torch.Tensor, top_probs: torch.Tensor) -> torch.Tensor:
    """||p_d - p_t||_1 from p_t's top-K (ids in draft vocab, -1 outside): exact when the top-K holds all mass.

    log_pd [..., Vd]; top_ids_d / top_probs [..., K]. The p_t mass outside its top-K and the p_d mass
    outside those K tokens are counted as disjoint (an upper bound; tight when either is ~0).
    """
    pd = log_pd.exp()
    inside = top_ids_d >= 0
    pd_at = pd.gather(-1, top_ids_d.clamp(min=0)) * inside  # p_d on p_t's top-K tokens
    l1_top = torch.where(inside, (pd_at - top_probs).abs(), top_probs).sum(-1)
    pd_rest = (1.0 - pd_at.sum(-1)).clamp(min=0)
    pt_rest = (1.0 - top_probs.sum(-1)).clamp(min=0)
    return (l1_top + pd_rest + pt_rest).clamp(max=2.0)


def dspark_loss_parts(logits: torch.Tensor, conf_logits: torch.Tensor | None, labels_d: torch.Tensor,
                      valid: torch.Tensor, top_ids_d: torch.Tensor, top_probs: torch.Tensor,
                      weights: torch.Tensor) -> LossParts:
    """Local loss pieces for blocks [B, A, gamma]: logits [.., Vd], labels_d draft ids (IGNORE outside)."""
    w = weights.view(1, 1, -1) * valid.float()
    log_pd = torch.log_softmax(logits.float(), dim=-1)
    ce_ok = valid & (labels_d != IGNORE)
    nll = -log_pd.gather(-1, labels_d.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    w_ce = w * ce_ok.float()
    tv = tv_distance(log_pd, top_ids_d, top_probs)
    soft = (1.0 - 0.5 * tv).detach().clamp(0.0, 1.0)
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), soft, reduction="none")
        conf_num = (w * bce).sum()
    else:
        conf_num = logits.new_zeros(())
    greedy = (log_pd.argmax(-1) == labels_d) & ce_ok
    lead = greedy.long().cumprod(-1).bool() & valid[..., :1]
    vf = valid.float()
    return LossParts(ce_num=(w_ce * nll).sum(), ce_den=w_ce.sum().detach(), tv_num=(w * tv).sum(),
                     conf_num=conf_num, den=w.sum().detach(),
                     soft_sum=(soft * vf).sum((0, 1)), match_sum=(greedy.float() * vf).sum((0, 1)),
                     lead_sum=lead.float().sum((0, 1)), count=vf.sum((0, 1)), blocks=vf[..., 0].sum())


def combine(parts: LossParts, ce_den: float, den: float, *, scale: float = 1.0,
            w_ce: float = 0.1, w_tv: float = 0.9, w_conf: float = 1.0) -> torch.Tensor:
    """0.1 CE + 0.9 TV + 1.0 BCE with GLOBAL denominators (times scale, e.g. world size under DDP)."""
    ce = parts.ce_num / max(ce_den, 1e-9)
    rest = (w_tv * parts.tv_num + w_conf * parts.conf_num) / max(den, 1e-9)
    return scale * (w_ce * ce + rest)


def summarize(stats: torch.Tensor, gamma: int) -> dict:
    """Global metrics from summed LossParts.stats(): losses, per-position acceptance, offline greedy tau."""
    ce_num, ce_den, tv_num, conf_num, den, blocks = stats[:6].tolist()
    soft, match, lead, count = stats[6:].view(4, gamma)
    ce, tv, conf = ce_num / max(ce_den, 1e-9), tv_num / max(den, 1e-9), conf_num / max(den, 1e-9)
    acc = (soft / count.clamp(min=1)).tolist()
    tau_est = 1.0 + sum(math.prod(acc[:k + 1]) for k in range(gamma))  # chain of conditional acceptances
    return {"loss": 0.1 * ce + 0.9 * tv + conf, "ce": ce, "tv": tv, "bce": conf, "acc": acc,
            "greedy_match": (match / count.clamp(min=1)).tolist(),
            "greedy_tau": 1.0 + float(lead.sum()) / max(blocks, 1.0), "tau_est": tau_est}
