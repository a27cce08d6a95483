"""DSpark training losses: position-decayed CE + TV + confidence BCE against the analytic acceptance."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.drafters.blocks import IGNORE
from dspark.models import native


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
        """All no-grad statistics flattened into one CPU vector (for a single all_reduce)."""
        return torch.cat([torch.stack([self.ce_num.detach(), self.ce_den, self.tv_num.detach(),
                                       self.conf_num.detach(), self.den, self.blocks]),
                          self.soft_sum, self.match_sum, self.lead_sum, self.count]).double().cpu()


def position_weights(gamma: int, decay: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """w_k = exp(-(k-1)/decay) for k = 1..gamma."""
    return torch.exp(-torch.arange(gamma, device=device, dtype=torch.float32) / decay)


class _VocabLoss(torch.autograd.Function):
    """Per-row NLL of the label, exact TV against p_t (1 - sum p_t, the target's mass outside the draft vocabulary, is where
    p_d is zero) and "label is the argmax", over the draft
    vocabulary, fused and taken a few rows at a time: each chunk of [rows, Vd] stays in cache through
    the softmax, both losses and, in backward, their gradient (recomputed from the saved log-normaliser),
    where autograd would make about ten passes over the whole [N, Vd] tensor in memory. Where dspark's
    kernels run (models/native.py, vocab_loss.c) both directions are one call that reads a row once or
    twice; the chunked PyTorch form below is the reference they are tested against."""

    @staticmethod
    def forward(ctx, logits, pt, pt_rows, labels, chunk):  # noqa: D102 (see vocab_loss)
        n = logits.shape[0]
        ok = labels >= 0
        lab = labels.clamp(min=0)
        ctx.native = _native(logits, pt)
        if ctx.native:
            pt_rows, lab = pt_rows.contiguous(), lab.contiguous()
            lse, nll, tv, hit = native.vocab_loss_forward(native.loaded(), logits, pt, pt_rows, lab, ok)
            ctx.save_for_backward(logits, pt, pt_rows, lab, ok, lse)
            ctx.mark_non_differentiable(hit)
            return nll, tv, hit
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        nll, tv = torch.empty_like(lse), torch.empty_like(lse)
        hit = torch.empty(n, dtype=torch.bool, device=logits.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            x = logits[s:e].float()
            q = pt.index_select(0, pt_rows[s:e])
            lse[s:e] = torch.logsumexp(x, dim=-1)
            p = (x - lse[s:e, None]).exp_()
            tv[s:e] = p.sub_(q).abs_().sum(-1) + (1.0 - q.sum(-1)).clamp_(min=0)
            xl = x.gather(1, lab[s:e, None]).squeeze(1)
            nll[s:e] = (lse[s:e] - xl) * ok[s:e]
            hit[s:e] = (xl >= x.amax(-1)) & ok[s:e]
        ctx.save_for_backward(logits, pt, pt_rows, lab, ok, lse)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(hit)
        return nll, tv.clamp_(max=2.0), hit

    @staticmethod
    def backward(ctx, g_nll, g_tv, _g_hit):  # noqa: D102
        logits, pt, pt_rows, lab, ok, lse = ctx.saved_tensors
        n = logits.shape[0]
        g_nll = (g_nll if g_nll is not None else torch.zeros_like(lse)) * ok
        g_tv = g_tv if g_tv is not None else torch.zeros_like(lse)
        if ctx.native:
            grad = native.vocab_loss_backward(native.loaded(), logits, pt, pt_rows, lab, ok, lse,
                                              g_nll.float().contiguous(), g_tv.float().contiguous())
            return grad, None, None, None, None
        grad = torch.empty_like(logits)
        for s in range(0, n, ctx.chunk):
            e = min(s + ctx.chunk, n)
            p = (logits[s:e].float() - lse[s:e, None]).exp_()
            ps = p * (p - pt.index_select(0, pt_rows[s:e])).sign_()  # d|p-q|/dp, times p
            # d TV/dx = p*sign - p * <p, sign>;  d NLL/dx = p - onehot(label)
            g = ps.sub_(p * ps.sum(-1, keepdim=True)).mul_(g_tv[s:e, None])
            g.add_(p.mul_(g_nll[s:e, None]))
            g.scatter_add_(1, lab[s:e, None], -g_nll[s:e, None])
            grad[s:e] = g
        return grad, None, None, None, None


def _native(logits: torch.Tensor, pt: torch.Tensor) -> bool:
    """Whether vocab_loss runs on dspark's kernel for these tensors."""
    return (native.library() is not None and logits.device.type == "cpu" and logits.dim() == 2
            and logits.dtype in (torch.float32, torch.bfloat16) and logits.is_contiguous()
            and pt.dtype == torch.float32 and pt.is_contiguous() and pt.shape[-1] == logits.shape[-1])


def vocab_loss(logits: torch.Tensor, pt: torch.Tensor, pt_rows: torch.Tensor, labels: torch.Tensor,
               chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, Vd]; the target's p_t rows pt [U, Vd] (normalised over the full vocabulary, see
    tv_distance) with pt_rows [N] picking each slot's row; labels [N] draft ids (IGNORE: no CE) ->
    (nll [N] (0 where IGNORE), tv [N], hit [N] bool: the label has the highest logit). Differentiable
    in logits only. `chunk` rows a pass of the PyTorch form (default: 32 on the CPU, sized for its
    cache; 2048 on a GPU, where 32-row chunks were ~1,400 small launches a training step)."""
    if chunk is None:
        chunk = 32 if logits.device.type == "cpu" else 2048
    return _VocabLoss.apply(logits, pt, pt_rows, labels, chunk)


CONF_LABELS = ("tv", "greedy")  # the confidence head's target: sampled acceptance, or greedy acceptance


def dspark_loss_parts(logits: torch.Tensor, conf_logits: torch.Tensor | None, labels_d: torch.Tensor,
                      valid: torch.Tensor, pt: torch.Tensor, pt_rows: torch.Tensor,
                      weights: torch.Tensor, conf_label: str = "tv") -> LossParts:
    """Local loss pieces over the valid slots of blocks [B, A, gamma]: valid selects N slots, and
    logits [N, Vd], conf_logits [N], labels_d [N] (the target's greedy token as a draft id, IGNORE
    outside the draft vocabulary) and pt_rows [N] (into pt [U, Vd], see vocab_loss) are in its order.

    conf_label "tv": the confidence head learns 1 - TV/2, the chance a draft sampled from p_d survives
    against p_t (what sampling at T = 1 accepts); "greedy": 1 where the drafter's argmax is the target's,
    what greedy verification accepts."""
    if conf_label not in CONF_LABELS:
        raise ValueError(f"conf_label must be one of {CONF_LABELS}, got {conf_label!r}")
    w = weights.view(1, 1, -1).expand_as(valid)[valid]
    nll, tv, hit = vocab_loss(logits, pt, pt_rows, labels_d)
    w_ce = w * (labels_d != IGNORE).float()
    soft = (1.0 - 0.5 * tv).detach().clamp(0.0, 1.0)
    if conf_logits is not None:
        label = soft if conf_label == "tv" else hit.float()
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), label, reduction="none")
        conf_num = (w * bce).sum()
    else:
        conf_num = logits.new_zeros((), dtype=torch.float32)

    def grid(x: torch.Tensor) -> torch.Tensor:  # rows back onto the [B, A, gamma] block slots
        return torch.zeros(valid.shape, dtype=torch.float32, device=valid.device).masked_scatter_(valid, x.float())

    greedy = grid(hit)
    lead = greedy.long().cumprod(-1).bool() & valid[..., :1]
    vf = valid.float()
    return LossParts(ce_num=(w_ce * nll).sum(), ce_den=w_ce.sum().detach(), tv_num=(w * tv).sum(),
                     conf_num=conf_num, den=w.sum().detach(),
                     soft_sum=grid(soft).sum((0, 1)), match_sum=greedy.sum((0, 1)),
                     lead_sum=lead.float().sum((0, 1)), count=vf.sum((0, 1)), blocks=vf[..., 0].sum())


def combine(parts: LossParts, den: float, *, scale: float = 1.0,
            w_ce: float = 0.1, w_tv: float = 0.9, w_conf: float = 1.0) -> torch.Tensor:
    """(w_ce CE + w_tv TV + w_conf BCE; DeepSpec's 0.1 / 0.9 / 1.0 by default) sums over one GLOBAL
    denominator: the weight mass of the optimizer step's valid slots, known from the data before any
    forward, so micro-batches and ranks can each backpropagate their share (times scale, e.g. the world
    size under DDP). CE sums only the slots whose label is in the draft vocabulary; with the vocabulary
    covering ~97% of labels that is a rounding."""
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
