"""Anchored-block geometry: block positions, attention masks and teacher-forced labels."""
from __future__ import annotations

import torch

IGNORE = -100  # label of an unsupervised block slot (cross_entropy's default ignore_index)


def block_positions(anchor_pos: torch.Tensor, gamma: int) -> torch.Tensor:
    """Positions of each block's slots: anchor_pos [...] -> [..., gamma] (anchor_pos + k)."""
    return anchor_pos.unsqueeze(-1) + torch.arange(gamma, device=anchor_pos.device)


def draft_mask(ctx_lengths: torch.Tensor, max_len: int, gamma: int) -> torch.Tensor:
    """Padded inference mask [R, gamma, max_len + gamma]: context rows < ctx_lengths[r], whole block."""
    ctx = torch.arange(max_len, device=ctx_lengths.device) < ctx_lengths.unsqueeze(-1)  # [R, L]
    ctx = ctx.unsqueeze(1).expand(-1, gamma, -1)  # [R, gamma, L]
    own = torch.ones(ctx.shape[0], gamma, gamma, dtype=torch.bool, device=ctx.device)
    return torch.cat([ctx, own], dim=-1)


def gather_tokens(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """input_ids [B, S] at positions [B, A, gamma] (clamped into the sequence) -> [B, A, gamma]."""
    b, a, g = positions.shape
    idx = positions.clamp(0, input_ids.shape[1] - 1).reshape(b, a * g)
    return input_ids.gather(1, idx).view(b, a, g)


def block_labels(input_ids: torch.Tensor, anchor_pos: torch.Tensor, anchor_valid: torch.Tensor, gamma: int,
                 loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels [B, A, gamma] (slot k -> input_ids[anchor+k+1], IGNORE where unsupervised) and valid [B, A, gamma].

    A slot is valid while its whole label prefix is: inside the sequence, a valid anchor, and (with
    loss_mask [B, S]) every label position up to it is a loss token.
    """
    pos = block_positions(anchor_pos, gamma) + 1  # label positions [B, A, gamma]
    valid = (pos < input_ids.shape[1]) & anchor_valid.bool().unsqueeze(-1)
    if loss_mask is not None:
        valid &= gather_tokens(loss_mask.long(), pos).bool()
    valid = valid.long().cumprod(-1).bool()
    labels = gather_tokens(input_ids, pos).masked_fill(~valid, IGNORE)
    return labels, valid
