"""Paged KV cache: fixed pool of blocks, a block table per sequence, truncation for rejected drafts.

Memory is bounded by the pool size chosen at start-up and reclaimed block by block when a
sequence is truncated or freed.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch


class CacheFullError(RuntimeError):
    """Raised when the pool has too few free blocks for a reservation."""


WINDOW_Q = 16  # windows up to this many tokens (decodes, verify windows) share one padded attention call


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences whose attention runs as one padded call: Bg sequences, Qg = their longest window."""

    rows: torch.Tensor | None  # [Tg] this group's tokens among the batch's T; None = all T, in order
    # [2 * kv_heads * Bg * S]: the cache rows each sequence reads (S of them, padding reads row 0,
    # masked), for every K/V head, in a layer's pool viewed as [2 * kv_heads * rows, head_dim]: one
    # gather along the first axis (a gather along the pool's row axis, its second, runs ~2x slower);
    # None where kv_start is set and nothing gathers
    kv_rows: torch.Tensor | None
    mask: torch.Tensor  # [Bg, 1, Qg, S] bool, True = may attend
    q_index: torch.Tensor | None  # [Tg] row of each token in the padded [Bg*Qg] layout; None when Bg == 1
    max_q: int
    # one sequence whose rows are consecutive in the pool: it reads rows kv_start + arange(S), so
    # attention reads a view of the pool instead of gathering (the same layout, so the same numerics)
    kv_start: int | None = None
    # [Bg, S]: the pool row of each sequence's key s (padding: row 0, masked), for dspark's attention kernel,
    # which reads the keys where they are (native.attention_paged) instead of the gather kv_rows makes
    kv_index: torch.Tensor | None = None


@dataclass(frozen=True)
class WindowsRead:
    """Several sequences' windows of up to WINDOW_Q tokens (no prefill chunk) as one kernel call reads them
    (csrc/step.c, attention on dspark_attention_paged): sequence b's q_lens[b] rows start at row q_off[b] of the
    batch, its key s is pool row kv_index[b, s] (padding: row 0, masked), mask [B, max window, S] bool."""

    q_off: torch.Tensor  # [B] int64
    q_lens: torch.Tensor  # [B] int64
    kv_index: torch.Tensor  # [B, S] int64
    mask: torch.Tensor  # [B, Q, S] bool


@dataclass(frozen=True)
class AttentionMetadata:
    """Where a ragged batch writes and reads K/V. B sequences, T new tokens.

    Attention is split into groups so that short windows are not padded to a prefill chunk's length:
    all windows of one token, all windows of 2..WINDOW_Q tokens, and each longer chunk on its own
    (usually a single group). Every row's result is independent of its group's make-up
    (models/attention.py), so the split changes cost, not numerics. A batch of several sequences' windows
    also carries them whole (windows), for the kernel call that runs them unpadded."""

    slot_mapping: torch.Tensor  # [T] flat cache row written by each new token
    groups: tuple[AttentionGroup, ...]
    windows: WindowsRead | None = None


DEFAULT_BLOCK_SIZE = 16  # tokens per KV page (EngineConfig.cache.kv_block_size)


def blocks_for(tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // block_size)


class KVCache:
    """Per-layer pools of keys and values side by side, head-major: kv[layer] is [2 * kv_heads,
    num_blocks * block_size, head_dim], keys in the first kv_heads, values in the rest (so a layer
    writes and gathers both with one call, and a gather lands as [2 * kv_heads, B, S, head_dim]:
    every (head, sequence) a plain matrix that attention multiplies without another copy); `k` and
    `v` are views of the two halves."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = DEFAULT_BLOCK_SIZE, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 kv_align: int = 1):
        """kv_align: pad the key axis of every batch to a multiple of it (masked keys); the
        window-invariant attention (models/attention.py) needs the same padding in every call."""
        if num_blocks < 1:
            raise ValueError("KV cache needs at least one block")
        rows = num_blocks * block_size
        self.kv = torch.zeros(num_layers, 2 * num_kv_heads, rows, head_dim, dtype=dtype, device=device)
        self.k, self.v = self.kv[:, :num_kv_heads], self.kv[:, num_kv_heads:]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_align = kv_align
        self.device = torch.device(device)
        self._free: list[int] = list(range(num_blocks))  # a min-heap: the lowest free block goes first,
        # so a sequence alone in the pool gets consecutive blocks (AttentionGroup.kv_start)
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    # --- bookkeeping -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def length(self, seq: Hashable) -> int:
        return self._lengths.get(seq, 0)

    def blocks_needed(self, seq: Hashable, new_length: int) -> int:
        have = len(self._tables.get(seq, ()))
        return max(0, -(-new_length // self.block_size) - have)

    def can_reserve(self, seq: Hashable, new_length: int) -> bool:
        return self.blocks_needed(seq, new_length) <= len(self._free)

    def reserve(self, seq: Hashable, new_length: int) -> None:
        """Make room for `new_length` tokens of `seq` (allocating blocks); raises CacheFullError."""
        need = self.blocks_needed(seq, new_length)
        if need > len(self._free):
            raise CacheFullError(f"need {need} KV blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq, [])
        self._lengths.setdefault(seq, 0)
        for _ in range(need):
            table.append(heapq.heappop(self._free))

    def truncate(self, seq: Hashable, length: int) -> None:
        """Forget every token of `seq` at or after `length`, returning whole blocks to the pool."""
        if length > self._lengths.get(seq, 0):
            raise ValueError(f"cannot truncate sequence {seq!r} of length {self.length(seq)} to {length}")
        self._lengths[seq] = length
        table = self._tables[seq]
        keep = -(-length // self.block_size)
        while len(table) > keep:
            heapq.heappush(self._free, table.pop())

    def free(self, seq: Hashable) -> None:
        """Release all blocks of `seq`."""
        for block in self._tables.pop(seq, []):
            heapq.heappush(self._free, block)
        self._lengths.pop(seq, None)

    # --- batch metadata ----------------------------------------------------------------------
    def prepare(self, seqs: Sequence[Hashable], query_lens: Sequence[int]) -> AttentionMetadata:
        """Metadata for appending `query_lens[i]` tokens to each `seqs[i]` (room must be reserved).

        Advances each sequence's length: the forward that uses this metadata writes those rows.
        """
        if len(seqs) == 1:
            meta = self._prepare_consecutive(seqs[0], query_lens[0])
            if meta is not None:
                return meta
        bs = self.block_size
        starts = [self._lengths[s] for s in seqs]
        totals = [st + q for st, q in zip(starts, query_lens)]
        slots = []  # per sequence: the flat cache row of each of its positions
        for s, tot in zip(seqs, totals):
            table = torch.tensor(self._tables[s], dtype=torch.long)
            pos = torch.arange(tot)
            slots.append(table[pos // bs] * bs + pos % bs)
        slot_mapping = torch.cat([sl[st:] for sl, st in zip(slots, starts)])
        buckets: dict[object, list[int]] = {}
        for i, q in enumerate(query_lens):
            buckets.setdefault(0 if q <= 1 else 1 if q <= WINDOW_Q else ("chunk", i), []).append(i)
        offsets = [0]
        for q in query_lens:
            offsets.append(offsets[-1] + q)
        groups = []
        for members in buckets.values():
            rows = None
            if len(members) < len(seqs):
                rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in members]).to(self.device)
            groups.append(self._group([seqs[i] for i in members], [starts[i] for i in members],
                                      [query_lens[i] for i in members], [slots[i] for i in members], rows))
        windows = None
        if len(seqs) > 1 and max(query_lens) <= WINDOW_Q:
            if len(groups) == 1:  # one group of every sequence: the same keys and mask, built once
                kv_index, mask = groups[0].kv_index, groups[0].mask.squeeze(1)
            else:
                kv_index, mask = self._keys(starts, query_lens, slots)
            windows = WindowsRead(q_off=torch.tensor(offsets[:-1]).to(self.device),
                                  q_lens=torch.tensor(list(query_lens)).to(self.device),
                                  kv_index=kv_index.to(self.device), mask=mask.to(self.device))
        for s, tot in zip(seqs, totals):
            self._lengths[s] = tot
        return AttentionMetadata(slot_mapping=slot_mapping.to(self.device), groups=tuple(groups), windows=windows)

    def _prepare_consecutive(self, seq: Hashable, q: int) -> AttentionMetadata | None:
        """prepare() for one sequence whose blocks are consecutive in the pool (a sequence alone in it: batch 1),
        from three tensor ops: its new rows, and its keys as rows kv_start.. of the pool (no gather rows). The same
        metadata as the general path builds, less kv_rows; None where the blocks are not consecutive."""
        start = self._lengths[seq]
        total = start + q
        max_s = -(-total // self.kv_align) * self.kv_align
        row0 = self._view_start(seq, max_s)
        if row0 is None:
            return None
        mask = torch.arange(max_s, device=self.device) <= torch.arange(start, total, device=self.device).unsqueeze(1)
        self._lengths[seq] = total
        group = AttentionGroup(rows=None, kv_rows=None, mask=mask.view(1, 1, q, max_s), q_index=None, max_q=q,
                               kv_start=row0)
        return AttentionMetadata(slot_mapping=torch.arange(row0 + start, row0 + total, device=self.device),
                                 groups=(group,))

    def _view_start(self, seq: Hashable, keys: int) -> int | None:
        """The pool row where `seq`'s keys start if its blocks are consecutive and `keys` rows from there fit in
        the pool (attention then reads them as one view: AttentionGroup.kv_start), else None."""
        table = self._tables[seq]
        first = table[0] if table else 0
        bs = self.block_size
        if table != list(range(first, first + len(table))) or first * bs + keys > self.num_blocks * bs:
            return None
        return first * bs

    def _keys(self, starts: Sequence[int], query_lens: Sequence[int],
              slots: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences' keys as attention reads them: ([B, S] the pool row of each one's key s, padding row 0;
        [B, Q, S] bool, causal within each sequence, padded query rows copying the last real row), S the longest
        length rounded up to kv_align, Q the longest window."""
        totals = [st + q for st, q in zip(starts, query_lens)]
        max_s, max_q = -(-max(totals) // self.kv_align) * self.kv_align, max(query_lens)
        start_t = torch.tensor(list(starts)).view(-1, 1, 1)
        qlen_t = torch.tensor(list(query_lens)).view(-1, 1, 1)
        j = torch.arange(max_q).view(1, -1, 1)
        s_idx = torch.arange(max_s).view(1, 1, -1)
        mask = s_idx <= start_t + torch.minimum(j, qlen_t - 1)  # never all-masked
        kv_index = torch.zeros(len(starts), max_s, dtype=torch.long)
        for i, sl in enumerate(slots):
            kv_index[i, : sl.numel()] = sl
        return kv_index, mask

    def _group(self, seqs: list[Hashable], starts: list[int], query_lens: list[int], slots: list[torch.Tensor],
               rows: torch.Tensor | None) -> AttentionGroup:
        kv_index, mask = self._keys(starts, query_lens, slots)
        max_s, max_q = mask.shape[-1], mask.shape[1]
        q_index, kv_start = None, None
        if len(seqs) == 1:
            kv_start = self._view_start(seqs[0], max_s)
        else:
            q_index = torch.cat([torch.arange(q) + i * max_q for i, q in enumerate(query_lens)]).to(self.device)
        heads, pool_rows = self.kv.shape[1], self.kv.shape[2]
        kv_rows = (torch.arange(heads).view(-1, 1) * pool_rows + kv_index.view(1, -1)).view(-1).to(self.device)
        return AttentionGroup(rows=rows, kv_rows=kv_rows, mask=mask.unsqueeze(1).to(self.device), q_index=q_index,
                              max_q=max_q, kv_start=kv_start, kv_index=kv_index.to(self.device))
