"""Prompt-lookup proposals."""
from __future__ import annotations

import random

import pytest

from dspark.speculative.ngram import propose_ngram


def test_longest_suffix_match_wins() -> None:
    # suffix [1, 2, 3] occurred at 0 (followed by 9, 9); [2, 3] alone occurs later followed by 7
    tokens = [1, 2, 3, 9, 9, 5, 2, 3, 7, 1, 2, 3]
    assert propose_ngram(tokens, k=2, max_n=3) == [9, 9]
    assert propose_ngram(tokens, k=2, max_n=2) == [7, 1]  # most recent [2, 3] is at index 6


def test_most_recent_occurrence_and_k_truncation() -> None:
    tokens = [4, 5, 6, 4, 8, 8, 4]
    assert propose_ngram(tokens, k=5, max_n=1) == [8, 8, 4]
    assert propose_ngram(tokens, k=1, max_n=1) == [8]


def test_continuation_may_run_into_suffix() -> None:
    assert propose_ngram([7, 7, 7], k=4, max_n=2) == [7]  # match [7,7] at 0, followed by one token


def test_no_match_or_degenerate_inputs() -> None:
    assert propose_ngram([1, 2, 3, 4], k=3) == []
    assert propose_ngram([], k=3) == []
    assert propose_ngram([5], k=3) == []
    assert propose_ngram([1, 2, 1], k=0) == []
    assert propose_ngram([1, 2, 3, 1, 2], k=3, max_n=3, min_n=3) == []  # only a 2-gram matches
    with pytest.raises(ValueError):
        propose_ngram([1, 2], k=1, max_n=1, min_n=2)


def test_matches_reference_scan() -> None:
    rng = random.Random(0)

    def reference(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
        for n in range(max_n, min_n - 1, -1):
            if n >= len(tokens):
                continue
            for i in range(len(tokens) - n - 1, -1, -1):
                if tokens[i : i + n] == tokens[-n:]:
                    return tokens[i + n : i + n + k]
        return []

    for _ in range(200):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(0, 40))]
        assert propose_ngram(tokens, 4) == reference(tokens, 4, 3, 1)
    # a long history: the match lies thousands of tokens back, or nowhere (its cost is in the bench's
    # ngram method, not timed here)
    history = [rng.randrange(32000) for _ in range(4096)]
    for tail in (history[10:13], history[-3:], [32001, 32002]):
        tokens = history + tail
        assert propose_ngram(tokens, 7, max_n=4) == reference(tokens, 7, 4, 1)
