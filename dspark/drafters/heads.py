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

    def step(self, prev_emb: torch.Tensor, hidden: torch.Tensor,
             state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One position: prev_emb [..., r], hidden h_k [..., d] -> (bias [..., Vd], next state)."""
        if self.head_type == "vanilla":
            return self.markov_w2(prev_emb), None
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1)))
            return self.markov_w2(gate * prev_emb), None
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


class ConfidenceHead(nn.Module):
    """c_k logit = w . [h_k ; W1[x_{k-1}]] + b (just h_k without a Markov head)."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, hidden: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor:
        """hidden [..., d], prev_emb [..., r] or None -> logits [...]."""
        x = hidden if prev_emb is None else torch.cat([hidden, prev_emb], dim=-1)
        return self.proj(x).squeeze(-1)
