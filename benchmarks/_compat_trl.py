"""The TRL rows of bench_compat.py: ``torchforge.compat.trl.grpo_loss`` against TRL 1.16's own
``GRPOTrainer._compute_loss`` on the same inputs.

Forward + backward of the loss w.r.t. the [B, T] float32 log-probs (B=64, T=1024 unless
``--quick``), with the ``old`` and reference log-probs, [B] advantages, a padding mask
(each row counts a random prefix) and a precomputed vLLM importance-sampling ratio
(``sequence_mask``, TRL's default) on both sides. TRL runs through the harness of
tests/compat/test_trl.py (a trainer built with ``object.__new__``, its
``_get_per_token_logps_and_entropies`` returning the given log-probs, no model), so what is
timed is ``_compute_loss`` itself, its metrics included (TRL reads them back with
``.item()``; compat returns them as tensors, read back here with ``.item()`` too, so both
sides pay the same sync). Interleaved (TRL, compat, TRL, compat, ...), medians; each
configuration is checked equal (to float32 rounding) before it is timed.

Run alone: ``python benchmarks/_compat_trl.py [--quick] [--threads N]`` from the repository
root, in an environment with trl (``pip install -e '.[compat]'``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for folder in (ROOT, ROOT / "benchmarks"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from bench_advantages import interleaved  # noqa: E402  (the benchmarks' A B A B ... timer)

# (label, loss_type, beta, importance_sampling_level)
CONFIGS = [
    ("dapo (TRL's default)", "dapo", 0.0, "token"),
    ("grpo, beta=0.04", "grpo", 0.04, "token"),
    ("dr_grpo", "dr_grpo", 0.0, "token"),
    ("GSPO: grpo, sequence level", "grpo", 0.0, "sequence"),
    ("cispo", "cispo", 0.0, "token"),
    ("sapo", "sapo", 0.0, "token"),
]


def _inputs(B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3
    old = lp + 0.1 * torch.randn(B, T, generator=g)
    ref = lp + 0.1 * torch.randn(B, T, generator=g)
    sampling = old + 0.05 * torch.randn(B, T, generator=g)
    A = torch.randn(B, generator=g)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths.unsqueeze(-1)).long()
    return lp, old, ref, sampling, A, mask


def trl_rows(quick: bool = False, reps: int | None = None) -> list[dict]:
    """One row per configuration: ``config``, ``trl_ms``, ``compat_ms``, ``ratio`` (compat / TRL)."""
    from tests.compat.test_trl import _loss_config, trl_importance_sampling, trl_loss
    from torchforge.compat.trl import grpo_loss, loss_kwargs, vllm_importance_sampling_ratio

    B, T = (16, 256) if quick else (64, 1024)
    reps = reps or (5 if quick else 41)
    lp0, old, ref, sampling, A, mask = _inputs(B, T)
    entropies = torch.rand(B, T)
    is_trl, _ = trl_importance_sampling(old, sampling, mask, "sequence_mask", None, 3.0)
    is_compat, _ = vllm_importance_sampling_ratio(old, sampling, mask)
    rows = []
    for label, loss_type, beta, level in CONFIGS:
        config = _loss_config(loss_type, level, beta)
        config.max_completion_length = T  # dr_grpo's constant
        inputs = dict(advantages=A, completion_mask=mask, old_per_token_logps=old, ref_per_token_logps=ref,
                      importance_sampling_ratio=is_trl, num_items_in_batch=torch.tensor(float(mask.sum())))
        kwargs = loss_kwargs(config)

        def run_trl():
            lp = lp0.clone().requires_grad_()
            loss, _ = trl_loss(config, lp, entropies, inputs)
            loss.backward()
            return loss.detach(), lp.grad

        def run_compat():
            lp = lp0.clone().requires_grad_()
            loss, metrics = grpo_loss(lp, old, A, mask, ref, is_compat, entropies, **kwargs)
            loss.backward()
            _ = {k: v.item() for k, v in metrics.items()}
            return loss.detach(), lp.grad

        (loss_t, grad_t), (loss_c, grad_c) = run_trl(), run_compat()
        scale = max(grad_t.abs().max().item(), 1e-30)
        if not (abs(loss_c.item() - loss_t.item()) <= 1e-5 * max(abs(loss_t.item()), 1.0)
                and (grad_c - grad_t).abs().max().item() <= 1e-5 * scale):
            raise AssertionError(f"{label}: compat and TRL differ (loss {loss_c.item()} vs {loss_t.item()})")
        medians = interleaved({"trl": run_trl, "compat": run_compat}, {"trl": reps, "compat": reps}, warmup=0)
        trl_ms, compat_ms = (1e3 * medians[k] for k in ("trl", "compat"))
        rows.append(dict(config=label, shape=f"B={B}, T={T}", trl_ms=trl_ms, compat_ms=compat_ms,
                         ratio=compat_ms / trl_ms))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| TRL loss | shape | TRL `_compute_loss` ms | `compat.trl.grpo_loss` ms | compat / TRL |",
             "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {r['config']} | {r['shape']} | {r['trl_ms']:.2f} | {r['compat_ms']:.2f} | {r['ratio']:.2f}x |"
              for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(table(trl_rows(quick=args.quick)))
