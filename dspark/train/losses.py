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


def tv_distance(log_pd: torch.Tensor, pt: torch.Tensor) -> torch.Tensor:
    """||p_d - p_t||_1, exact: log_pd [..., Vd] (the drafter's distribution, zero outside the draft
    vocabulary) and pt [..., Vd] the target's probabilities on the draft vocabulary, normalised over
    the full vocabulary, so the target mass outside it (1 - sum pt) is where p_d is zero."""
    outside = (1.0 - pt.sum(-1)).clamp(min=0)
    return ((log_pd.exp() - pt).abs().sum(-1) + outside).clamp(max=2.0)


def dspark_loss_parts(logits: torch.Tensor, conf_logits: torch.Tensor | None, labels_d: torch.Tensor,
                      valid: torch.Tensor, pt: torch.Tensor, weights: torch.Tensor) -> LossParts:
    """Local loss pieces for blocks [B, A, gamma]: logits [.., Vd]; labels_d the target's greedy token
    as a draft id (IGNORE where unsupervised or outside the draft vocabulary); pt [.., Vd] (tv_distance)."""
    w = weights.view(1, 1, -1) * valid.float()
    log_pd = torch.log_softmax(logits.float(), dim=-1)
    ce_ok = valid & (labels_d != IGNORE)
    nll = -log_pd.gather(-1, labels_d.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    w_ce = w * ce_ok.float()
    tv = tv_distance(log_pd, pt)
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


def combine(parts: LossParts, den: float, *, scale: float = 1.0,
            w_ce: float = 0.1, w_tv: float = 0.9, w_conf: float = 1.0) -> torch.Tensor:
    """(0.1 CE + 0.9 TV + 1.0 BCE) sums over one GLOBAL denominator: the weight mass of the optimizer
    step's valid slots, known from the data before any forward, so micro-batches and ranks can each
    backpropagate their share (times scale, e.g. the world size under DDP). CE sums only the slots whose
    label is in the draft vocabulary; with the vocabulary covering ~97% of labels that is a rounding."""
    return scale * (w_ce * parts.ce_num + w_tv * parts.tv_num + w_conf * parts.conf_num) / max(den, 1e-9)


def summarize(stats: torch.Tensor, gamma: int) -> dict:
    """Global metrics from summed LossParts.stats(): losses, per-position acceptance, offline greedy tau."""
    ce_num, ce_den, tv_num, conf_num, den, blocks = stats[:6].tolist()
    soft, match, lead, count = stats[6:].view(4, gamma)
    ce, tv, conf = ce_num / max(ce_den, 1e-9), tv_num / max(den, 1e-9), conf_num / max(den, 1e-9)
    acc = (soft / count.clamp(min=1)).tolist()
    tau_est = 1.0 + sum(math.prod(acc[:k + 1]) for k in range(gamma))  # chain of conditional acceptances
    reached = torch.cat([torch.tensor([blocks], dtype=lead.dtype), lead[:-1]])  # blocks whose slots < k all survived
    return {"loss": 0.1 * ce + 0.9 * tv + conf, "ce": ce, "tv": tv, "bce": conf, "acc": acc,
            "greedy_match": (match / count.clamp(min=1)).tolist(),
            "greedy_accept": (lead / reached.clamp(min=1)).tolist(),  # P(draft k survives | 1..k-1 did)
            "greedy_tau": 1.0 + float(lead.sum()) / max(blocks, 1.0), "tau_est": tau_est}
