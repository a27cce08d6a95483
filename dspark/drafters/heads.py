"""Sequential heads (vanilla / gated Markov, RNN) and the confidence head of DSpark
(docs/method.md#sequential-heads, docs/method.md#confidence-head)."""
from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    """Logit bias B_k from the previous block token: W2 applied to W1[x_{k-1}] (gated / recurrent variants)."""

    def __init__(self, *, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int,
                 head_type: str = "vanilla"):
        super().__init__()
        self.head_type = head_type
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # indexed by TARGET token id
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)  # -> gate, candidate, output
        elif head_type != "vanilla":
            raise ValueError(f"unknown markov_head_type {head_type!r}")

    def prev_embedding(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: [...] target ids -> [..., r]."""
        return self.markov_w1(prev_ids)

    def init_state(self, batch_shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        """Initial recurrent state s_0 = 0 [..., r] (None for stateless heads)."""
        if self.head_type != "rnn":
            return None
        return like.new_zeros(*batch_shape, self.rank)

    def bias_input(self, prev_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """A stateless head's input to W2 (bias = W2 u): u = W1[x_{k-1}] (vanilla) or gate * W1[x_{k-1}]
        (gated); [..., r]."""
        if self.head_type == "vanilla":
            return prev_emb
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1))) * prev_emb
        raise ValueError("the recurrent head's bias depends on its state: use step()")

    def step(self, prev_emb: torch.Tensor, hidden: torch.Tensor,
             state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One position: prev_emb [..., r], hidden h_k [..., d] -> (bias [..., Vd], next state)."""
        if self.head_type != "rnn":
            return self.markov_w2(self.bias_input(prev_emb, hidden)), None
        assert state is not None
        gate, cand, out = self.joint_proj(torch.cat([state, prev_emb, hidden], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(gate)
        state = g * state + (1.0 - g) * torch.tanh(cand)
        return self.markov_w2(torch.tanh(out)), state

    def block_bias(self, prev_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced biases for whole blocks: prev_emb [N, gamma, r], hidden [N, gamma, d] -> [N, gamma, Vd]."""
        if self.head_type != "rnn":  # stateless: every position at once
            return self.step(prev_emb, hidden, None)[0]
        state = self.init_state(prev_emb.shape[:1], prev_emb)
        biases = []
        for k in range(prev_emb.shape[1]):
            bias, state = self.step(prev_emb[:, k], hidden[:, k], state)
            biases.append(bias)
        return torch.stack(biases, dim=1)


class _BiasedHead(torch.autograd.Function):
    """[h, u] @ [W_lm, W2]^T in one matmul; gradients for h, u and W2 (the LM head is frozen)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, u: torch.Tensor, lm_head: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        x = torch.cat([h, u.to(h.dtype)], dim=-1)
        w = torch.cat([lm_head.to(h.dtype), w2.to(h.dtype)], dim=-1)  # [Vd, d + r]
        ctx.save_for_backward(x, w)
        ctx.d, ctx.dtypes = h.shape[-1], (u.dtype, w2.dtype)
        return x @ w.T

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x, w), d, (u_dtype, w2_dtype) = ctx.saved_tensors, ctx.d, ctx.dtypes
        grad = grad.to(x.dtype).contiguous()
        gx = grad @ w  # [N, d + r]
        gw2 = grad.T @ x[:, d:]  # [Vd, r]
        return gx[:, :d], gx[:, d:].to(u_dtype), None, gw2.to(w2_dtype)


def biased_logits(head: MarkovHead, h: torch.Tensor, prev_emb: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits h W_lm^T + W2 u of a stateless head for rows h [N, d], prev_emb [N, r] ->
    [N, Vd] in h's dtype, as one matmul over the concatenated [h, u]. The separate bias matmul, its [N, Vd]
    output and the sum of the two (and the same again in the backward) cost a 2-core CPU ~13% of a DSpark
    drafter's training throughput alone, ~5% of its step beside a twin (docs/training.md). Values agree
    with base + bias up to rounding (the sum is accumulated once, in fp32)."""
    return _BiasedHead.apply(h, head.bias_input(prev_emb, h), lm_head, head.markov_w2.weight)


class ConfidenceHead(nn.Module):
    """c_k logit = w . [h_k ; W1[x_{k-1}]] + b (just h_k without a Markov head)."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, hidden: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor:
        """hidden [..., d], prev_emb [..., r] or None -> logits [...]."""
        x = hidden if prev_emb is None else torch.cat([hidden, prev_emb], dim=-1)
        return self.proj(x).squeeze(-1)
