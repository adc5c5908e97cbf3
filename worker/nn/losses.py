"""Losses returning (loss, gradient w.r.t. the prediction).

``denom`` is the number of samples the loss is averaged over; distributed training
passes the *global* batch size so that summing every rank's gradient gives exactly the
gradient of the global mean.
"""

from __future__ import annotations

import numpy as np

from shardwire.protocol.errors import InvalidArgument

IGNORE_INDEX = -100  # targets equal to this are left out of the loss, as elsewhere


def softmax_cross_entropy(
    logits: np.ndarray,
    targets: np.ndarray,
    *,
    denom: int | None = None,
    ignore_index: int | None = IGNORE_INDEX,
) -> tuple[float, np.ndarray]:
    """Mean negative log-likelihood of integer ``targets`` under softmax(``logits``).

    Targets equal to ``ignore_index`` (default -100; None: none) contribute neither loss
    nor gradient, and are not counted when ``denom`` is None. Any other target outside
    ``[0, classes)`` raises ValueError.
    """
    classes = logits.shape[-1]
    flat = logits.reshape(-1, classes)
    labels = np.asarray(targets).reshape(-1)
    if labels.size != flat.shape[0]:
        raise InvalidArgument(f"{labels.size} targets for {flat.shape[0]} rows of logits")
    if not np.issubdtype(labels.dtype, np.integer):
        raise InvalidArgument(f"targets must be integers, got dtype {labels.dtype}")
    keep = labels != ignore_index if ignore_index is not None else np.ones(labels.size, bool)
    bad = keep & ((labels < 0) | (labels >= classes))
    if bad.any():
        first = int(labels[bad][0])
        raise InvalidArgument(
            f"target {first} is outside [0, {classes}) (ignore_index is {ignore_index})"
        )
    rows = np.flatnonzero(keep)
    kept = labels[rows]
    count = rows.size if denom is None else denom
    shifted = flat - flat.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    log_p = shifted - log_z
    grad = np.exp(log_p)
    grad[rows, kept] -= 1.0
    grad[~keep] = 0.0
    if count == 0:  # every target ignored: no loss and no gradient
        return 0.0, np.zeros_like(logits)
    loss = -log_p[rows, kept].sum() / count
    return float(loss), (grad / count).reshape(logits.shape)


def mse(
    pred: np.ndarray, target: np.ndarray, *, denom: int | None = None
) -> tuple[float, np.ndarray]:
    """Squared error summed over every element, divided by the number of rows (samples,
    the first axis) or ``denom`` -- not by the number of elements: for predictions of
    shape (n, k) this is k times the element-wise mean that some libraries report."""
    count = len(pred) if denom is None else denom
    diff = pred - target
    return float((diff**2).sum() / count), 2.0 * diff / count
