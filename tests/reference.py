"""Slow, obviously-correct reference implementations: Python loops over plain definitions.

Each section belongs to one module of torchforge; add to this file only by appending.
"""

import math

import torch


# --- reduce -----------------------------------------------------------------------------

def aggregate_ref(per_token, mask, mode, norm_length=None):
    B, T = per_token.shape
    rows = [[float(per_token[b, t]) for t in range(T) if mask[b, t]] for b in range(B)]
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        flat = [x for r in rows for x in r]
        return sum(flat) / len(flat) if flat else 0.0
    if not nonempty:
        return 0.0
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / len(nonempty)
    length = T if norm_length is None else norm_length
    return sum(sum(r) for r in nonempty) / (len(nonempty) * length)


# --- kl ---------------------------------------------------------------------------------

def approx_kl_ref(lp, ref, estimator):
    out = torch.empty(lp.shape, dtype=torch.float64)
    for idx in range(lp.numel()):
        log_ratio = float(lp.flatten()[idx]) - float(ref.flatten()[idx])
        if estimator == "k1":
            v = log_ratio
        elif estimator == "k2":
            v = 0.5 * log_ratio**2
        elif estimator == "k3":
            v = math.exp(-log_ratio) - 1 + log_ratio
        else:
            v = abs(log_ratio)
        out.view(-1)[idx] = v
    return out
