"""A small tour of the torchforge primitives on random data (runs in a second on a CPU)."""

import torch

import torchforge as tf


def main() -> None:
    torch.manual_seed(0)
    B, T = 8, 16
    log_probs = -torch.rand(B, T)
    ref_log_probs = log_probs + 0.1 * torch.randn(B, T)
    mask = torch.arange(T).expand(B, T) < torch.randint(4, T + 1, (B, 1))
    batch = tf.Batch(log_probs=log_probs, ref_log_probs=ref_log_probs, mask=mask, batch_size=[B])

    for estimator in tf.KL_ESTIMATORS:
        kl = tf.approx_kl(batch, estimator=estimator)
        print(f"KL estimate {estimator:>3}: {tf.masked_mean(kl, mask).item():+.5f}")
    per_token = -log_probs
    for mode in tf.AGGREGATION_MODES:
        print(f"aggregate {mode:<24}: {tf.aggregate(per_token, mask, mode=mode).item():.5f}")


if __name__ == "__main__":
    main()
