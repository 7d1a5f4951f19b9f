"""Tiny causal LMs of the architectures people post-train, their LM heads scaled so that the
logits reach realistic magnitudes, and the worker that tests/loop/test_architectures.py
launches on 2 processes (DDP / FSDP2).

Run as ``python tests/loop/_arch_worker.py OUT_DIR ARCH [ARCH ...]`` with torchrun's
environment; rank 0 writes ``OUT_DIR/<arch>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORKER = Path(__file__).resolve()
VOCAB = 128
# the largest |logit| the model returns after scaling its head (realistic: 20-40 nats)
TARGET_LOGIT = 36.0

_COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
               "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _config(name: str):
    import transformers as tr

    c = dict(_COMMON)
    if name == "llama":
        return tr.LlamaConfig(**c), tr.LlamaForCausalLM
    if name == "llama-tied":
        return tr.LlamaConfig(**c, tie_word_embeddings=True), tr.LlamaForCausalLM
    if name == "qwen2":
        return tr.Qwen2Config(**c), tr.Qwen2ForCausalLM
    if name == "qwen3":
        return tr.Qwen3Config(**c, head_dim=8), tr.Qwen3ForCausalLM
    if name == "mistral":
        return tr.MistralConfig(**c), tr.MistralForCausalLM
    if name == "phi3":
        return tr.Phi3Config(**c), tr.Phi3ForCausalLM
    if name == "olmo2":
        return tr.Olmo2Config(**c), tr.Olmo2ForCausalLM
    if name == "gpt2":
        return tr.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0), tr.GPT2LMHeadModel
    if name == "gemma2":
        return tr.Gemma2Config(**c, head_dim=8, final_logit_softcapping=30.0), tr.Gemma2ForCausalLM
    if name == "gemma3":
        return tr.Gemma3TextConfig(**c, head_dim=8, final_logit_softcapping=30.0), tr.Gemma3ForCausalLM
    if name == "granite":
        return tr.GraniteConfig(**c, logits_scaling=4.0), tr.GraniteForCausalLM
    if name == "cohere":
        return tr.CohereConfig(**c, logit_scale=0.25), tr.CohereForCausalLM
    if name == "cohere2":
        return tr.Cohere2Config(**c, logit_scale=0.25), tr.Cohere2ForCausalLM
    if name == "falcon_h1":
        return tr.FalconH1Config(**c, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
                                 mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16,
                                 lm_head_multiplier=0.5), tr.FalconH1ForCausalLM
    if name == "minicpm3":
        # logits_scaling = hidden_size / dim_model_base = 4
        c["num_key_value_heads"] = 4
        return tr.MiniCPM3Config(**c, dim_model_base=8, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                                 qk_rope_head_dim=4, v_head_dim=8), tr.MiniCPM3ForCausalLM
    if name == "hyperclovax":  # logits * logits_scaling (Granite divides by it)
        return tr.HyperCLOVAXConfig(**c, logits_scaling=0.25), tr.HyperCLOVAXForCausalLM
    if name == "gemma3-multimodal":  # Gemma3ForConditionalGeneration: the cap is in its text config
        text = tr.Gemma3TextConfig(**c, head_dim=8, final_logit_softcapping=30.0)
        vision = tr.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=28, patch_size=14)
        return tr.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                               image_token_id=VOCAB - 1, boi_token_id=VOCAB - 2, eoi_token_id=VOCAB - 3), \
            tr.Gemma3ForConditionalGeneration
    raise KeyError(name)


ARCHITECTURES = ("llama", "llama-tied", "qwen2", "qwen3", "mistral", "phi3", "olmo2", "gpt2",
                 "gemma2", "gemma3", "granite", "cohere", "cohere2", "falcon_h1", "minicpm3", "hyperclovax", "gemma3-multimodal")


def build(name: str, seed: int = 0):
    """The tiny ``name`` model in float32, eval mode, its head scaled so that the logits the
    model returns reach ``TARGET_LOGIT`` (its head's own output reaches 1.25x that under a
    soft cap, which keeps the returned ones below the cap)."""
    from torchforge.loop import head_transform

    config, cls = _config(name)
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    head = model.get_output_embeddings()
    seen = {}
    handle = head.register_forward_hook(lambda m, a, o: seen.setdefault("z", o))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, logits_to_keep=0).logits
    finally:
        handle.remove()
    _, softcap = head_transform(model)
    capped = softcap is not None and not torch.equal(logits, seen["z"])  # a cap the forward applies
    factor = 1.25 * TARGET_LOGIT / float(seen["z"].abs().max()) if capped else \
        TARGET_LOGIT / float(logits.abs().max())
    with torch.no_grad():
        head.weight.mul_(factor)
    return model


# --- the 2-process worker ----------------------------------------------------------------

def launch(nproc: int, out_dir: Path, archs: list[str], timeout: float = 300) -> None:
    """Start ``nproc`` workers with torchrun's environment; raise with their output on failure."""
    from tests._dist_worker import spawn

    spawn(WORKER, [str(out_dir), *archs], nproc, timeout)


def global_batch(B: int = 4, P: int = 3, T: int = 5, seed: int = 1):
    """A fixed batch of left-padded prompts and completions, and a weight per token."""
    from torchforge.batch import Batch

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, VOCAB, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.bool)
    prompt_mask[1, 0] = False  # left padding
    prompt[1, 0] = 0
    tokens = torch.randint(3, VOCAB, (B, T), generator=g)
    batch = Batch(prompt_tokens=prompt, prompt_mask=prompt_mask, tokens=tokens,
                  mask=torch.ones(B, T, dtype=torch.bool), batch_size=[B])
    return batch, torch.randn(B, T, generator=g)


def run(name: str, out: Path) -> None:
    """Log-probs and gradients of ``sum(weights * log_probs)`` on this rank's half of the
    global batch under DDP and FSDP2; rank 0 saves full gradients and all log-probs."""
    from torch.distributed.tensor import DTensor

    from torchforge.distributed import rank, shard, world_size
    from torchforge.loop import policy_log_probs

    batch, weights = global_batch()
    B = batch.batch_size[0]
    share = B // world_size()
    rows = slice(rank() * share, (rank() + 1) * share)
    results = {}
    for strategy in ("ddp", "fsdp"):
        model = shard(build(name), strategy=strategy)
        log_probs, _ = policy_log_probs(model, batch[rows])
        # the global-batch sum: each rank's share, summed by the all-reduce of the gradients
        (log_probs * weights[rows]).sum().mul(world_size()).backward()
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad
            g = g.full_tensor() if isinstance(g, DTensor) else g
            grads[n.removeprefix("module.")] = g.detach().clone()
        gathered = [torch.zeros_like(log_probs) for _ in range(world_size())]
        torch.distributed.all_gather(gathered, log_probs.detach().contiguous())
        results[strategy] = {"log_probs": torch.cat(gathered), "grads": grads}
    if rank() == 0:
        torch.save(results, out / f"{name}.pt")


def main() -> None:
    from torchforge.distributed import init_distributed, teardown_distributed

    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    assert init_distributed()
    try:
        for name in sys.argv[2:]:
            run(name, out)
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main()
    from torchforge.distributed import end_process

    end_process(0)  # every result is written: skip the shutdown where gloo can abort
