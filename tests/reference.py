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


# --- kl (exact_kl) ----------------------------------------------------------------------

def exact_kl_ref(logits, ref_logits, temperature=1.0):
    """sum_v p_v (log p_v - log q_v) at every [b, t], in Python floats."""
    B, T, V = logits.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            xs = [float(logits[b, t, v]) / temperature for v in range(V)]
            ys = [float(ref_logits[b, t, v]) / temperature for v in range(V)]
            mx, my = max(xs), max(ys)
            lse_x = mx + math.log(sum(math.exp(x - mx) for x in xs))
            lse_y = my + math.log(sum(math.exp(y - my) for y in ys))
            total = 0.0
            for x, y in zip(xs, ys):
                log_p, log_q = x - lse_x, y - lse_y
                total += math.exp(log_p) * (log_p - log_q)
            out[b, t] = total
    return out


# --- reduce (masked reductions) ---------------------------------------------------------

def masked_values_ref(values, mask):
    """The counted values of ``values`` as a flat Python list (row-major order)."""
    flat_v, flat_m = values.flatten(), mask.flatten()
    return [float(flat_v[i]) for i in range(flat_v.numel()) if bool(flat_m[i])]


def masked_var_ref(values, mask, unbiased=True):
    xs = masked_values_ref(values, mask)
    n = len(xs)
    dof = n - 1 if unbiased else n
    if dof <= 0:
        return 0.0
    mean = sum(xs) / n
    return sum((x - mean) ** 2 for x in xs) / dof


def masked_whiten_ref(values, mask, shift_mean=True, eps=1e-8):
    xs = masked_values_ref(values, mask)
    mean = sum(xs) / len(xs) if xs else 0.0
    std = math.sqrt(masked_var_ref(values, mask) + eps)
    out = torch.zeros(values.shape, dtype=torch.float64)
    for idx in range(values.numel()):
        if bool(mask.flatten()[idx]):
            w = (float(values.flatten()[idx]) - mean) / std if std > 0 else 0.0
            out.view(-1)[idx] = w if shift_mean else w + mean
    return out


# --- advantages ---------------------------------------------------------------------------

def gae_ref(rewards, values, mask, gamma, lam):
    """GAE by the definition: a reverse loop over the counted tokens of each row, in floats.

    Masked positions are skipped (value and running advantage carry across them), no
    bootstrap after the last counted token, 0 at masked positions.
    """
    B, T = mask.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    ret = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        counted = [t for t in range(T) if bool(mask[b, t])]
        next_value, running = 0.0, 0.0
        for t in reversed(counted):
            v = float(values[b, t])
            delta = float(rewards[b, t]) + gamma * next_value - v
            running = delta + gamma * lam * running
            adv[b, t] = running
            ret[b, t] = running + v
            next_value = v
    return adv, ret


def discounted_returns_ref(rewards, mask, gamma):
    """Reward-to-go over the counted tokens of each row; rewards [B, T] or [B] (last token)."""
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        counted = [t for t in range(T) if bool(mask[b, t])]
        running = 0.0
        for k, t in enumerate(reversed(counted)):
            if rewards.dim() == 2:
                r = float(rewards[b, t])
            else:
                r = float(rewards[b]) if k == 0 else 0.0
            running = r + gamma * running
            out[b, t] = running
    return out


def group_advantages_ref(rewards, group_size, scale, eps):
    """Per-group loop with the statistics module; NaN left out; all-equal groups give 0."""
    import statistics

    flat = [float(r) for r in rewards]
    valid_all = [r for r in flat if not math.isnan(r)]
    std_all = statistics.stdev(valid_all) if len(valid_all) > 1 else 0.0
    out = []
    for g in range(0, len(flat), group_size):
        group = flat[g:g + group_size]
        valid = [r for r in group if not math.isnan(r)]
        tied = len(set(valid)) <= 1
        mean = sum(valid) / len(valid) if valid else 0.0
        std = statistics.stdev(valid) if len(valid) > 1 else 0.0
        for r in group:
            if math.isnan(r) or tied:
                out.append(0.0)
            elif scale == "group":
                out.append((r - mean) / (std + eps))
            elif scale == "batch":
                out.append((r - mean) / (std_all + eps))
            else:
                out.append(r - mean)
    return torch.tensor(out, dtype=torch.float64)


def rloo_advantages_ref(rewards, group_size):
    """r_i minus the mean of the other valid rewards of its group."""
    flat = [float(r) for r in rewards]
    out = []
    for g in range(0, len(flat), group_size):
        group = flat[g:g + group_size]
        valid = [r for r in group if not math.isnan(r)]
        for i, r in enumerate(group):
            others = [x for j, x in enumerate(group) if j != i and not math.isnan(x)]
            if math.isnan(r) or not others or len(set(valid)) <= 1:
                out.append(0.0)
            else:
                out.append(r - sum(others) / len(others))
    return torch.tensor(out, dtype=torch.float64)


# --- log_probs --------------------------------------------------------------------------

def _log_softmax_row_ref(xs):
    """log softmax of a Python list of floats (max-shifted logsumexp)."""
    m = max(xs)
    if m == -math.inf:
        return [math.nan for _ in xs]
    lse = m + math.log(sum(math.exp(x - m) for x in xs))
    return [x - lse for x in xs]


def token_log_probs_ref(logits, tokens, temperature=1.0):
    """log softmax(logits[b, t] / temperature)[tokens[b, t]] at every [b, t], in Python floats."""
    B, T, V = logits.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            row = _log_softmax_row_ref([float(logits[b, t, v]) / temperature for v in range(V)])
            out[b, t] = row[int(tokens[b, t])]
    return out


def token_entropy_ref(logits, temperature=1.0):
    """-sum_v p_v log p_v of softmax(logits[b, t] / temperature), with 0 log 0 = 0."""
    B, T, V = logits.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            row = _log_softmax_row_ref([float(logits[b, t, v]) / temperature for v in range(V)])
            out[b, t] = -sum(math.exp(lp) * lp for lp in row if lp > -math.inf)
    return out


def lm_head_logits_ref(hidden, weight, bias=None):
    """logits[b, t, v] = sum_h hidden[b, t, h] * weight[v, h] (+ bias[v]), in Python floats."""
    B, T, H = hidden.shape
    V = weight.shape[0]
    out = torch.zeros(B, T, V, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            for v in range(V):
                acc = sum(float(hidden[b, t, h]) * float(weight[v, h]) for h in range(H))
                out[b, t, v] = acc + (float(bias[v]) if bias is not None else 0.0)
    return out


def head_transform_ref(logits, logit_scale=None, softcap=None):
    """z' = softcap * tanh(logit_scale * z / softcap) (z' = logit_scale * z without a cap),
    element by element in Python floats, as the models' own heads: scale first, then cap."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    flat, flat_out = logits.reshape(-1), out.view(-1)
    for i in range(flat.numel()):
        z = float(flat[i]) * (1.0 if logit_scale is None else logit_scale)
        flat_out[i] = z if softcap is None else softcap * math.tanh(z / softcap)
    return out


# --- distributed ------------------------------------------------------------------------

def global_counts_ref(masks_per_rank):
    """(tokens, sequences with >= 1 token) over a list (ranks) of lists (micro-batches) of masks."""
    tokens = sequences = 0
    for masks in masks_per_rank:
        for mask in masks:
            for row in mask.tolist():
                n = sum(1 for x in row if x)
                tokens += n
                sequences += 1 if n > 0 else 0
    return tokens, sequences


# --- losses -----------------------------------------------------------------------------

def ppo_per_token_ref(lp, old, adv, mask, clip_low=0.2, clip_high=None, dual_clip=None,
                      level="token", weights=None):
    """Per-token PPO loss as nested lists of floats (0.0 where masked), one token at a time."""
    clip_high = clip_low if clip_high is None else clip_high
    B, T = lp.shape
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        counted = [t for t in range(T) if mask[b, t]]
        if level == "sequence" and counted:
            seq = sum(float(lp[b, t]) - float(old[b, t]) for t in counted) / len(counted)
        for t in counted:
            log_ratio = seq if level == "sequence" else float(lp[b, t]) - float(old[b, t])
            ratio = math.exp(max(min(log_ratio, 20.0), -20.0))
            a = float(adv[b]) if adv.dim() == 1 else float(adv[b, t])
            unclipped = -a * ratio
            clipped = -a * min(max(ratio, 1 - clip_low), 1 + clip_high)
            loss = max(unclipped, clipped)
            if dual_clip is not None and a < 0:
                loss = min(loss, -dual_clip * a)
            if weights is not None:
                loss *= float(weights[b]) if weights.dim() == 1 else float(weights[b, t])
            out[b][t] = loss
    return out


def ppo_metrics_ref(lp, old, adv, mask, clip_low=0.2, clip_high=None, dual_clip=None):
    """Token-level PPO metrics by counting, one token at a time."""
    clip_high = clip_low if clip_high is None else clip_high
    B, T = lp.shape
    ratios, low, high, dual, kl = [], 0, 0, 0, 0.0
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            lr = float(lp[b, t]) - float(old[b, t])
            r = math.exp(lr)
            a = float(adv[b]) if adv.dim() == 1 else float(adv[b, t])
            ratios.append(r)
            low += r < 1 - clip_low and a < 0
            high += r > 1 + clip_high and a > 0
            dual += dual_clip is not None and r > dual_clip and a < 0
            kl += r - 1 - lr
    n = len(ratios)
    if n == 0:
        out = {"clip_frac_low": 0.0, "clip_frac_high": 0.0, "approx_kl": 0.0,
               "ratio_mean": 0.0, "ratio_min": 0.0, "ratio_max": 0.0}
    else:
        out = {"clip_frac_low": low / n, "clip_frac_high": high / n, "approx_kl": kl / n,
               "ratio_mean": sum(ratios) / n, "ratio_min": min(ratios), "ratio_max": max(ratios)}
    if dual_clip is not None:
        out["dual_clip_frac"] = dual / n if n else 0.0
    return out


def value_per_token_ref(v, v_old, ret, mask, clip):
    B, T = v.shape
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                x, x_old, r = float(v[b, t]), float(v_old[b, t]), float(ret[b, t])
                loss = (x - r) ** 2
                if clip is not None:
                    x_clip = min(max(x, x_old - clip), x_old + clip)
                    loss = max(loss, (x_clip - r) ** 2)
                out[b][t] = 0.5 * loss
    return out


# --- corrections ------------------------------------------------------------------------

def _level_log_ratio_ref(old, rollout, b, t, counted, level):
    """The log-ratio of token (b, t) at ``level``: its own, the row's mean or the row's sum."""
    if level == "token":
        return float(old[b, t]) - float(rollout[b, t])
    total = sum(float(old[b, u]) - float(rollout[b, u]) for u in counted)
    return total / len(counted) if level == "sequence" else total


def truncated_importance_weights_ref(old, rollout, mask, level, cap):
    B, T = old.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        counted = [t for t in range(T) if mask[b, t]]
        for t in counted:
            lr = _level_log_ratio_ref(old, rollout, b, t, counted, level)
            out[b, t] = 0.0 if math.isnan(lr) else min(math.exp(min(lr, 700.0)), cap)
    return out


def ratio_mask_ref(old, rollout, mask, low, high, level):
    B, T = old.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        counted = [t for t in range(T) if mask[b, t]]
        for t in counted:
            lr = _level_log_ratio_ref(old, rollout, b, t, counted, level)
            r = math.exp(min(lr, 700.0)) if not math.isnan(lr) else math.nan
            out[b, t] = 1.0 if low <= r <= high else 0.0
    return out


def high_entropy_mask_ref(entropy, mask, quantile):
    """Keep the counted tokens whose entropy is >= the (1 - quantile)-quantile (linear)."""
    xs = sorted(float(entropy[b, t]) for b in range(entropy.shape[0]) for t in range(entropy.shape[1]) if mask[b, t])
    out = torch.zeros(entropy.shape, dtype=torch.float64)
    if not xs:
        return out
    pos = (1 - quantile) * (len(xs) - 1)
    lo, hi = xs[math.floor(pos)], xs[math.ceil(pos)]
    tau = lo + (hi - lo) * (pos - math.floor(pos))
    for b in range(entropy.shape[0]):
        for t in range(entropy.shape[1]):
            out[b, t] = 1.0 if mask[b, t] and float(entropy[b, t]) >= tau else 0.0
    return out


def overlong_penalty_ref(lengths, max_length, buffer_length, penalty):
    out = []
    for length in lengths.tolist():
        if length <= max_length - buffer_length:
            out.append(0.0)
        elif length <= max_length:
            out.append(-penalty * (length - (max_length - buffer_length)) / buffer_length)
        else:
            out.append(-penalty)
    return torch.tensor(out)


def zero_std_groups_ref(rewards, group_size):
    out = []
    values = rewards.tolist()
    for start in range(0, len(values), group_size):
        group = [x for x in values[start:start + group_size] if not math.isnan(x)]
        out += [len(set(group)) <= 1] * group_size
    return torch.tensor(out, dtype=torch.bool)


def passk_advantages_ref(rewards, group_size, k, scale, eps):
    """Pass@k training (arXiv 2508.10751) per group with math.comb, as the authors' calc_adv."""
    flat = [float(r) for r in rewards]
    out = []
    for g in range(0, len(flat), group_size):
        group = flat[g:g + group_size]
        valid = [r for r in group if not math.isnan(r)]
        n, c = len(valid), sum(1 for r in valid if r == 1.0)
        if n < k:
            out += [0.0] * len(group)
            continue
        rho = 1 - math.comb(n - c, k) / math.comb(n, k)
        sigma = math.sqrt(rho * (1 - rho))
        a_pos = 1 - rho
        a_neg = 1 - rho - (math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1) if n - c >= 1 else 0.0)
        div = (sigma + eps) if scale == "group" else 1.0
        for r in group:
            if math.isnan(r) or sigma == 0:
                out.append(0.0)
            else:
                out.append((a_pos if r == 1.0 else a_neg) / div)
    return torch.tensor(out, dtype=torch.float64)


def best_minus_second_advantages_ref(rewards, group_ids, scale, eps):
    """Best-minus-second (arXiv 2503.19595) group by group: the unique best finite reward gets
    (r_max - r_second) / (std + eps) with the unbiased std of the group's finite rewards."""
    flat, ids = [float(r) for r in rewards], [int(i) for i in group_ids]
    out = [0.0] * len(flat)
    for g in set(ids):
        rows = [i for i in range(len(flat)) if ids[i] == g and math.isfinite(flat[i])]
        values = sorted((flat[i] for i in rows), reverse=True)
        if len(values) < 2 or values[0] == values[1]:
            continue
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        best = next(i for i in rows if flat[i] == values[0])
        out[best] = (values[0] - values[1]) / ((std + eps) if scale == "group" else 1.0)
    return torch.tensor(out, dtype=torch.float64)


def opo_advantages_ref(rewards, lengths, group_size):
    """OPO: r minus the length-weighted mean reward of the group (finite rewards only)."""
    flat, lens = [float(r) for r in rewards], [int(x) for x in lengths]
    out = []
    for g in range(0, len(flat), group_size):
        pairs = [(r, n) for r, n in zip(flat[g:g + group_size], lens[g:g + group_size]) if not math.isnan(r)]
        total = sum(n for _, n in pairs)
        tied = len({r for r, _ in pairs}) <= 1
        b = sum(r * n for r, n in pairs) / total if total else 0.0
        for r in flat[g:g + group_size]:
            out.append(0.0 if math.isnan(r) or tied or total == 0 else r - b)
    return torch.tensor(out, dtype=torch.float64)


def remax_advantages_ref(rewards, baseline_rewards, mask):
    """ReMax: per-row reverse running sum over counted tokens minus the greedy baseline."""
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    returns = discounted_returns_ref(rewards, mask, 1.0)
    for b in range(B):
        base = float(baseline_rewards[b])
        if math.isnan(base) or (rewards.dim() == 1 and math.isnan(float(rewards[b]))):
            continue
        for t in range(T):
            if mask[b, t]:
                out[b, t] = float(returns[b, t]) - base
    return out


def gdpo_advantages_ref(rewards, group_size, weights, eps):
    """GDPO / TRL normalize_then_sum: per-reward group normalization, weighted sum, batch std."""
    import statistics

    B, K = rewards.shape
    columns = [group_advantages_ref(rewards[:, k], group_size, "group", eps) for k in range(K)]
    s = [sum(float(weights[k]) * float(columns[k][i]) for k in range(K)) for i in range(B)]
    rows = [i for i in range(B) if any(not math.isnan(float(rewards[i, k])) for k in range(K))]
    std = statistics.stdev([s[i] for i in rows]) if len(rows) > 1 else 0.0
    mean = statistics.fmean(s)  # TRL subtracts the batch mean (0 up to rounding)
    return torch.tensor([(x - mean) / (std + eps) if std + eps > 0 else 0.0 for x in s], dtype=torch.float64)


# --- losses (SAPO, GMPO, Clip-Cov, KL-Cov) and kl (verl's low_var_kl) --------------------

def verl_low_var_kl_ref(log_probs, ref_log_probs):
    """verl's ``kl_penalty(..., "low_var_kl")`` (core_algos), in differentiable torch ops:
    ``kl = clamp(ref - lp, -20, 20)``, ``clamp(exp(kl) - kl - 1, -10, 10)``."""
    kl = torch.clamp(ref_log_probs - log_probs, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def sapo_per_token_ref(lp, old, adv, mask, tau_pos, tau_neg):
    """-A * (4 / tau) * sigmoid(tau * (r - 1)) at each counted token, in floats."""
    B, T = lp.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                a = float(adv[b] if adv.dim() == 1 else adv[b, t])
                r = math.exp(float(lp[b, t]) - float(old[b, t]))
                tau = tau_pos if a > 0 else tau_neg
                out[b, t] = -a * (4 / tau) / (1 + math.exp(-tau * (r - 1)))
    return out


def gmpo_loss_ref(lp, old, adv, mask, clip_low, clip_high):
    """Mean over rows with a counted token of -mean(A) * exp(mean of sign-clipped log-ratios)."""
    B, T = lp.shape
    losses = []
    for b in range(B):
        tokens = [t for t in range(T) if mask[b, t]]
        if not tokens:
            continue
        total, a_total = 0.0, 0.0
        for t in tokens:
            a = float(adv[b] if adv.dim() == 1 else adv[b, t])
            x = float(lp[b, t]) - float(old[b, t])
            total += min(x, clip_high) if a > 0 else (max(x, -clip_low) if a < 0 else 0.0)
            a_total += a
        losses.append(-a_total / len(tokens) * math.exp(total / len(tokens)))
    return sum(losses) / len(losses) if losses else 0.0



def gmpo_per_token_ref(lp, old, adv, mask, clip_low, clip_high, weights=None):
    """GMPO per token: at each counted token of row b, its weight times the row's
    -mean(A) * exp(mean of sign-clipped log-ratios), the mean over all of the row's counted
    tokens whatever their weights; 0 elsewhere. Reduce with aggregate_ref."""
    B, T = lp.shape
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        tokens = [t for t in range(T) if mask[b, t]]
        if not tokens:
            continue
        total, a_total = 0.0, 0.0
        for t in tokens:
            a = float(adv[b] if adv.dim() == 1 else adv[b, t])
            x = float(lp[b, t]) - float(old[b, t])
            total += min(x, clip_high) if a > 0 else (max(x, -clip_low) if a < 0 else 0.0)
            a_total += a
        row = -a_total / len(tokens) * math.exp(total / len(tokens))
        for t in tokens:
            w = 1.0 if weights is None else float(weights[b] if weights.dim() == 1 else weights[b, t])
            out[b][t] = w * row
    return out

def covariance_ref(adv, lp, mask):
    """{(b, t): (A - mean A) * (lp - mean lp)} over the counted tokens, in floats."""
    B, T = lp.shape
    cells = [(b, t) for b in range(B) for t in range(T) if mask[b, t]]
    a = {c: float(adv[c[0]] if adv.dim() == 1 else adv[c]) for c in cells}
    x = {c: float(lp[c]) for c in cells}
    mean_a = sum(a.values()) / len(cells) if cells else 0.0
    mean_x = sum(x.values()) / len(cells) if cells else 0.0
    return {c: (a[c] - mean_a) * (x[c] - mean_x) for c in cells}


def kl_cov_loss_ref(lp, old, adv, mask, select_frac, kl_coef):
    """Token-mean of -A r + kl_coef |log r| on the k largest-covariance tokens (ties: first)."""
    cov = covariance_ref(adv, lp, mask)
    k = max(int(math.floor(select_frac * len(cov))), 1)
    chosen = set(sorted(cov, key=lambda c: (-cov[c], c))[:k])
    total = 0.0
    for (b, t) in cov:
        a = float(adv[b] if adv.dim() == 1 else adv[b, t])
        x = float(lp[b, t]) - float(old[b, t])
        total += -a * math.exp(x) + (kl_coef * abs(x) if (b, t) in chosen else 0.0)
    return total / len(cov) if cov else 0.0


def adaptive_kl_coef_ref(kl_coef, observed_kl, target, horizon, num_steps):
    error = observed_kl / target - 1
    error = -0.2 if error < -0.2 else (0.2 if error > 0.2 else error)
    return kl_coef * (1 + error * num_steps / horizon)


# --- policy losses at extreme log-ratios (float64 torch, differentiable) -----------------
# Each loss's documented equation per token (gmpo: per row), with its clamp of the
# log-ratio at +-max_log_ratio before exp, in float64 torch ops so that autograd gives the
# reference gradient. Reduce with token_mean64 (gmpo: row_mean64, its default aggregation).

def token_mean64(per_token, mask):
    return torch.where(mask, per_token, 0.0).sum() / mask.sum().clamp(min=1)


def row_mean64(per_row, mask):
    """Mean over the rows with a counted token (0 without any)."""
    rows = mask.any(-1)
    return torch.where(rows, per_row, 0.0).sum() / rows.sum().clamp(min=1)


def _ratio64(lp, old, mask, max_log_ratio, level="token"):
    x = torch.where(mask, lp - old, 0.0)
    if level == "sequence":  # GSPO-token: sg(mean log-ratio of the row) + x - sg(x)
        mean = x.detach().sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        x = torch.where(mask, mean + x - x.detach(), 0.0)
    return torch.exp(x.clamp(-max_log_ratio, max_log_ratio))


def _adv64(adv):
    return adv[:, None] if adv.dim() == 1 else adv


def ppo_per_token64(lp, old, adv, mask, clip_low=0.2, clip_high=None, dual_clip=None, level="token",
                    weights=None, max_log_ratio=20.0):
    clip_high = clip_low if clip_high is None else clip_high
    ratio, A = _ratio64(lp, old, mask, max_log_ratio, level), _adv64(adv)
    pg_loss = torch.maximum(-A * ratio, -A * ratio.clamp(1 - clip_low, 1 + clip_high))
    if dual_clip is not None:
        pg_loss = torch.where(A < 0, torch.minimum(pg_loss, -dual_clip * A), pg_loss)
    if weights is not None:
        pg_loss = pg_loss * (weights[:, None] if weights.dim() == 1 else weights)
    return pg_loss


def k3_tangent64(lp, ref, max_ratio=2.0):
    """k3 = r - 1 - log r with r = ref / pi, r continued along its tangent beyond max_ratio."""
    log_r, knee = ref - lp, math.log(max_ratio)
    r = torch.where(log_r > knee, max_ratio * (1 + log_r - knee), torch.exp(log_r))
    return r - 1 - log_r


def grpo_per_token64(lp, old, adv, mask, ref, kl_coef, kl_gradient="estimator", **ppo):
    """PPO's per-token loss + kl_coef * k3 (tangent past ratio 2), whose gradient is k3's
    ("estimator"), k2's ("straight-through": k3's value), or that of k3 * pi / pi_old
    ("bias-corrected", the log-ratio clamped as PPO's)."""
    kl = k3_tangent64(lp, ref)
    if kl_gradient == "straight-through":
        k2 = 0.5 * (ref - lp) ** 2
        kl = kl.detach() + (k2 - k2.detach())
    elif kl_gradient == "bias-corrected":
        kl = kl * _ratio64(lp, old, mask, ppo.get("max_log_ratio", 20.0))
    return ppo_per_token64(lp, old, adv, mask, **ppo) + kl_coef * kl


def cispo_per_token64(lp, old, adv, mask, clip_low, clip_high, max_log_ratio=20.0):
    weight = _ratio64(lp, old, mask, max_log_ratio).detach().clamp(1 - clip_low, 1 + clip_high)
    return -weight * _adv64(adv) * lp


def sapo_per_token64(lp, old, adv, mask, tau_pos, tau_neg, max_log_ratio=20.0):
    ratio, A = _ratio64(lp, old, mask, max_log_ratio), _adv64(adv)
    tau = torch.where(A > 0, tau_pos, tau_neg)
    return -A * (4 / tau) * torch.sigmoid(tau * (ratio - 1))


def kl_cov_all_selected_per_token64(lp, old, adv, mask, kl_coef, max_log_ratio=20.0):
    """KL-Cov with every counted token selected: -A ratio + kl_coef |log ratio|, the
    penalty on the log-ratio as it is (not clamped)."""
    return -_adv64(adv) * _ratio64(lp, old, mask, max_log_ratio) + kl_coef * torch.where(mask, lp - old, 0.0).abs()


def gmpo_per_row64(lp, old, adv, mask, clip_low, clip_high, max_log_ratio=20.0):
    A = _adv64(adv).expand(mask.shape)
    x = torch.where(mask, lp - old, 0.0)
    clipped = torch.where(A > 0, x.clamp(max=clip_high), torch.where(A < 0, x.clamp(min=-clip_low), 0.0))
    n = mask.sum(-1).clamp(min=1)
    ratio = torch.exp((torch.where(mask, clipped, 0.0).sum(-1) / n).clamp(-max_log_ratio, max_log_ratio))
    return -(torch.where(mask, A, 0.0).sum(-1) / n) * ratio
