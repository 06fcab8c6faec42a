"""Scores of decoded sequences against references: edit distance and character error rate."""

from collections.abc import Sequence

import numpy as np


def _codes(seq: str | Sequence[int]) -> np.ndarray:
    if isinstance(seq, str):
        return np.frombuffer(seq.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    return np.asarray(seq, dtype=np.int64)


def levenshtein(a: str | Sequence[int], b: str | Sequence[int]) -> int:
    """Edit distance (insertions, deletions, substitutions) between two strings or id lists."""
    a, b = _codes(a), _codes(b)
    if len(a) > len(b):
        a, b = b, a  # the Python loop runs over the shorter one, numpy along the longer one
    cols = np.arange(len(b) + 1)
    row = cols  # distances from the empty prefix of a
    for i, x in enumerate(a, start=1):
        # Substitution (or match) and deletion only look at the previous row...
        best = np.concatenate(([i], np.minimum(row[:-1] + (b != x), row[1:] + 1)))
        # ...insertions chain along this row: row[j] = min over k <= j of best[k] + (j - k).
        row = np.minimum.accumulate(best - cols) + cols
    return int(row[-1])


def character_error_rate(
    predictions: Sequence[str | Sequence[int]], references: Sequence[str | Sequence[int]]
) -> float:
    """Total edit distance over total reference length (corpus-level CER)."""
    if len(predictions) != len(references):
        raise ValueError(f"got {len(predictions)} predictions for {len(references)} references")
    errors = sum(levenshtein(p, r) for p, r in zip(predictions, references, strict=True))
    return errors / max(sum(len(r) for r in references), 1)
