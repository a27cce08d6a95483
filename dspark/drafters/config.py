"""DrafterConfig: the shape and head choices of a DSpark / DFlash block drafter."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass(frozen=True)
class DrafterConfig:
    """Frozen drafter configuration; DFlash is markov_rank=0 with confidence_head=False."""

    # Layer shapes, copied from the target (see for_target).
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary (embedding rows)
    target_layer_ids: tuple[int, ...]  # 0-based target layers whose OUTPUT hidden states feed the drafter
    mask_token_id: int  # target-vocab id whose embedding fills the non-anchor block slots
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Drafter choices.
    num_layers: int = 1
    block_size: int = 7  # gamma: drafts per block, the anchor slot predicts x1
    markov_rank: int = 256  # r; 0 disables the sequential head
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    draft_vocab_size: int | None = None  # None: draft over the full target vocabulary
    qk_norm: bool = True  # per-head RMSNorm on q and k (Qwen3-style layers, as published drafters use)
    attention_bias: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        self._validate()

    @property
    def num_context_layers(self) -> int:
        """m: how many target layers are concatenated into the context features."""
        return len(self.target_layer_ids)

    @property
    def draft_vocab(self) -> int:
        """Size of the vocabulary the drafter's head scores (Vd)."""
        return self.draft_vocab_size if self.draft_vocab_size is not None else self.vocab_size

    def _validate(self) -> None:
        positive = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "vocab_size", "num_layers", "block_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must divide "
                             f"num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        ids = self.target_layer_ids
        if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"target_layer_ids must be distinct non-negative ints, got {ids}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must lie in [0, {self.vocab_size}), got {self.mask_token_id}")
        if not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            raise ValueError(f"markov_rank must be an int >= 0, got {self.markov_rank!r}")
        if self.markov_head_type not in HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {HEAD_TYPES}, got {self.markov_head_type!r}")
        dv = self.draft_vocab_size
        if dv is not None and not (isinstance(dv, int) and 0 < dv <= self.vocab_size):
            raise ValueError(f"draft_vocab_size must be None or in [1, {self.vocab_size}], got {dv!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples become lists)."""
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        """Inverse of to_dict; unknown keys raise ValueError naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown DrafterConfig field(s): {unknown}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.name not in d)
        if missing:
            raise ValueError(f"missing DrafterConfig field(s): {missing}")
        return cls(**d)

    @classmethod
    def for_target(cls, target: dict[str, Any], **overrides: Any) -> "DrafterConfig":
        """Drafter config copying the layer shapes of a HF-style target config dict."""
        hidden, heads = int(target["hidden_size"]), int(target["num_attention_heads"])
        rope = target.get("rope_parameters") or {}
        theta = target.get("rope_theta") or rope.get("rope_theta") or 10000.0
        vocab = int(target["vocab_size"])
        fields: dict[str, Any] = dict(
            hidden_size=hidden,
            intermediate_size=int(target["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(target.get("num_key_value_heads") or heads),
            head_dim=int(target.get("head_dim") or hidden // heads),
            rms_norm_eps=float(target.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            vocab_size=vocab,
            target_layer_ids=default_target_layer_ids(int(target["num_hidden_layers"])),
            # The last embedding row: HF vocabularies are usually padded past the tokenizer, so it is
            # an unused id. Pass mask_token_id= to match a trained checkpoint.
            mask_token_id=vocab - 1,
        )
        fields.update(overrides)
        return cls.from_dict(fields)


def default_target_layer_ids(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """Layers spread over depth, never the last: 36 -> (1, 9, 17, 25, 33), 30 -> (1, 8, 15, 22, 28)."""
    if num_layers < 2:
        raise ValueError(f"num_hidden_layers must be >= 2 to pick context layers, got {num_layers}")
    if num_layers < count + 1:
        return tuple(range(num_layers - 1))
    step = math.ceil((num_layers - 4) / (count - 1))
    return tuple(sorted({min(1 + i * step, num_layers - 2) for i in range(count)}))

