"""Ranking-task metrics computed on the host over a whole eval set: AUC and normalised entropy."""

from __future__ import annotations

import numpy as np


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney U with tied scores sharing their average rank); NaN if one class."""
    labels = np.asarray(labels, bool).ravel()
    scores = np.asarray(scores, np.float64).ravel()
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    average_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based average rank of each distinct score
    ranks = average_rank[inverse]
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


def normalized_entropy(labels: np.ndarray, probabilities: np.ndarray, eps: float = 1e-7) -> float:
    """Mean log loss divided by the entropy of the base rate (He et al. 2014); < 1 beats the prior."""
    y = np.asarray(labels, np.float64).ravel()
    p = np.clip(np.asarray(probabilities, np.float64).ravel(), eps, 1 - eps)
    log_loss = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    base = np.clip(y.mean(), eps, 1 - eps)
    return float(log_loss / -(base * np.log(base) + (1 - base) * np.log(1 - base)))
