"""The private helpers an older copy of a torchforge module imports (``--before``), under the
old names they had before they became public; shared by bench_kl.py and bench_losses.py."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def old_private_names():
    """While an older copy of a module loads (``--before``), the private helpers it imports
    from torchforge that have since become public, under their old names."""
    from torchforge import errors, log_probs, ratios

    def _clamp_log_ratio(log_ratio, max_log_ratio):
        return ratios.clamp_log_ratio(log_ratio, max_log_ratio=max_log_ratio)

    old = {(log_probs, "_check_temperature"): errors.check_temperature, (log_probs, "_row_chunks"): log_probs.row_chunks,
           (ratios, "_clamp_log_ratio"): _clamp_log_ratio}
    added = [key for key in old if not hasattr(*key)]
    for module, name in added:
        setattr(module, name, old[(module, name)])
    try:
        yield
    finally:
        for module, name in added:
            delattr(module, name)
