"""Logits -> probabilities -> tokens. The same processing serves plain and speculative decoding,
so target and draft distributions are warped identically (temperature, top-k, top-p)."""
from __future__ import annotations

import torch

_TIE_MARGIN = 8  # warp_top_k's extra candidates for ties at a row's k-th value


def warp_probs(logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution for rows of logits [N, V] -> probs [N, V] (fp32).

    temperature must be > 0 here (greedy never needs probabilities).
    """
    logits = logits.float() / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        # stable: of tokens tied at the cut, the lowest ids stay (one answer, whatever the sort's internals)
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        cum = sorted_p.cumsum(-1)
        drop = (cum - sorted_p) >= top_p  # keep the smallest prefix whose mass reaches top_p
        drop[..., 0] = False  # ...never empty: a tiny top_p is 0 in float32, and then every token would drop
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [N, V] -> [N] (int64)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def warp_top_k(logits: torch.Tensor, temperature: float, top_k: int,
               top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """warp_probs' distribution on each row's top-k candidates alone: (probs [N, m], token ids [N, m]),
    m >= top_k (m > top_k where a row ties at its k-th value: warp_probs keeps every tie, so this does
    too). Every token outside a row's candidates has probability 0 under warp_probs, so sampling among the
    candidates draws from the same distribution at a fraction of the cost: one top-k over the vocabulary,
    no sort, fp32 copy or random draw per vocabulary entry (at 64 rows x 49k, a sampled generation step
    spent more on those than on the model)."""
    vocab = logits.shape[-1]
    if not 0 < top_k < vocab:
        raise ValueError(f"top_k must be in 1..{vocab - 1}, got {top_k}")
    m = min(top_k + _TIE_MARGIN, vocab)
    vals, ids = torch.topk(logits, m, dim=-1)  # largest first; scaling below keeps the order
    vals = vals.float() / temperature  # as warp_probs scales them, so its ties are these ties
    kth = vals[:, top_k - 1:top_k]
    if m < vocab and bool((vals[:, -1:] >= kth).any()):  # a row ties past the margin: take all its ties
        x = logits.float() / temperature
        vals, ids = torch.topk(x, int((x >= kth).sum(-1).max()), dim=-1)
    ids, by_id = ids.sort(-1)  # candidates in id order, so that the stable sort in warp_probs breaks ties
    vals = vals.gather(-1, by_id)
    vals = vals.masked_fill(vals < kth, float("-inf"))  # as it does
    return warp_probs(vals, 1.0, -1, top_p), ids


def warp_nucleus(logits: torch.Tensor, temperature: float, top_p: float,
                 first: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """warp_probs' top-p distribution (no top-k) on each row's nucleus: (probs [N, m], token ids [N, m]),
    the ids in ascending order, zero probability past the nucleus. The candidates are the row's `first`
    largest logits, grown 4x until every row's nucleus ends inside them with no tie at its last value left
    outside. The masses are warp_probs' own (a softmax of the whole row), so the cut falls where it does
    there; a row's result does not depend on m or on the other rows."""
    x = logits.float() / temperature
    vocab = x.shape[-1]
    full = torch.softmax(x, dim=-1)  # warp_probs' probabilities, so its cut and these agree
    m = min(first, vocab)
    while True:
        vals, ids = torch.topk(x, m, dim=-1)
        ids, by_id = ids.sort(-1)  # in id order, so that the stable sort below breaks ties by lowest id
        vals = vals.gather(-1, by_id)
        sorted_x, order = torch.sort(vals, dim=-1, descending=True, stable=True)
        sorted_p = full.gather(-1, ids.gather(-1, order))
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # as warp_probs: the smallest prefix reaching top_p
        drop[..., 0] = False
        kept = (~drop).sum(-1, keepdim=True)  # [N, 1]
        last = sorted_x.gather(-1, kept - 1)
        if m == vocab or bool(((kept < m) & (sorted_x[:, -1:] < last)).all()):
            break
        m = min(4 * m, vocab)
    keep = torch.zeros_like(drop).scatter_(-1, order, ~drop)
    probs = torch.where(keep, full.gather(-1, ids), torch.zeros_like(vals))
    return probs / probs.sum(-1, keepdim=True), ids


def warp_candidates(logits: torch.Tensor, temperature: float, top_k: int = -1,
                    top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """warp_probs' distribution on each row's candidates: (probs [N, m], token ids [N, m]) over the top-k
    (warp_top_k) where top_k is set, over the nucleus (warp_nucleus) where only top_p is, else (probs [N, V],
    None) over the whole vocabulary."""
    if 0 < top_k < logits.shape[-1]:
        return warp_top_k(logits, temperature, top_k, top_p)
    if top_p < 1.0:
        return warp_nucleus(logits, temperature, top_p)
    return warp_probs(logits, temperature, top_k, top_p), None


def sample_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of logits [N, V] from warp_probs' distribution -> [N] (int64); among the top-k
    candidates only where top_k is set (warp_candidates)."""
    probs, ids = warp_candidates(logits, temperature, top_k, top_p)
    tokens = sample(probs, generator)
    return tokens if ids is None else ids.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
