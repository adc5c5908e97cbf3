"""Losses returning (loss, gradient w.r.t. the prediction).

``denom`` is the number of samples the loss is averaged over; distributed training
passes the *global* batch size so that summing every rank's gradient gives exactly the
gradient of the global mean.
"""

from __future__ import annotations

import numpy as np


def softmax_cross_entropy(
    logits: np.ndarray, targets: np.ndarray, *, denom: int | None = None
) -> tuple[float, np.ndarray]:
    """Mean negative log-likelihood of integer ``targets`` under softmax(``logits``)."""
    flat = logits.reshape(-1, logits.shape[-1])
    labels = targets.reshape(-1)
    count = labels.size if denom is None else denom
    shifted = flat - flat.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    log_p = shifted - log_z
    rows = np.arange(labels.size)
    loss = -log_p[rows, labels].sum() / count
    grad = np.exp(log_p)
    grad[rows, labels] -= 1.0
    return float(loss), (grad / count).reshape(logits.shape)


def mse(
    pred: np.ndarray, target: np.ndarray, *, denom: int | None = None
) -> tuple[float, np.ndarray]:
    """Mean over samples (first axis) of the summed squared error."""
    count = len(pred) if denom is None else denom
    diff = pred - target
    return float((diff**2).sum() / count), 2.0 * diff / count
