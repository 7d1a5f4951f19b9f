"""``RLTrainer``: the product card's convenience API over the loop's functions.

One step, top to bottom (:meth:`RLTrainer.train_step`):

1. take this step's prompts (this process's share of ``prompts_per_step``);
2. ``_rollout``: sample G completions each (:func:`torchforge.loop.rollout`, with the
   sampler's ``rollout_log_probs``), and ``_score`` them with the reward functions;
3. ``_counted_completions``: with ``mask_truncated_completions``, truncated ones count for nothing;
   ``_update_rewards``: [B, K] rewards for GDPO, ``reward_clip``;
4. ``_reference_log_probs``: reference (and, when the algorithm needs them first, old)
   log-probs, no grad; the step's :class:`~torchforge.trainer.algorithms.StepContext` (its
   KL coefficient, reward weights, the entropy threshold of ``top_entropy_quantile``),
   bound to the algorithm for the rest of the step;
5. ``algorithm.prepare`` (advantages, values...);
6. ``_update``: ``num_iterations`` optimizer steps, each over every micro-batch with exact
   aggregation (``_loss``: the forward, ``algorithm.compute_loss``'s ``(loss, metrics)``,
   the entropy bonus);
7. ``_metrics``: reduced over processes as sums and counts, maxima and minima; the
   learning-rate schedule steps once per step (not per optimizer step);
   ``_after_update``: the adaptive KL coefficient, the reference refresh; then logging
   and checkpoints (:meth:`RLTrainer.train`).
"""

from __future__ import annotations

import copy
import math
import os
import threading
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import yaml
from torch import nn

from torchforge.advantages import zero_std_groups
from torchforge.batch import Batch
from torchforge.distributed import (
    DistributedConfig,
    barrier,
    export_pretrained,
    full_weights,
    gather_over_ranks,
    init_distributed,
    is_main_process,
    latest_checkpoint,
    load_checkpoint,
    rank,
    save_checkpoint,
    shard,
    sum_over_ranks,
    sync_weights,
    unwrap_model,
    world_size,
)
from torchforge.distributed.weight_sync import _clean_name
from torchforge.entropy_selection import entropy_threshold
from torchforge.errors import InvalidArgumentError, TorchforgeError
from torchforge.kl import adaptive_kl_coef
from torchforge.loop import (
    accumulate_gradients,
    completion_stop_ids,
    ValueModel,
    check_packable,
    micro_batches,
    micro_batches_by_tokens,
    optimizer_step,
    policy_log_probs,
    rollout_log_prob_gap,
)
from torchforge.loop.rewards import GuardedReward, close_rewards, guard_rewards, reward_keys
from torchforge.loop.engines import HFEngine, make_engine
from torchforge.loop.metrics import StepMetrics
from torchforge.loop.vision import cat_vision
from torchforge.reduce import Aggregation, masked_mean, masked_var
from torchforge.trainer.episodes import EpisodeRollout
from torchforge.trainer.evaluation import check_eval_rows, evaluate_dataset
from torchforge.trainer.vision_task import freeze_vision_tower, lora_without_vision_tower, vision_task
from torchforge.trainer.algorithms import Algorithm, StepContext, algorithm_from_name
from torchforge.trainer.async_generation import AsyncGenerator
from torchforge.trainer.config import RLConfig
from torchforge.trainer.rollouts import RolloutStrategy, ScoredBatch, SingleTurnRollout, render_prompt
from torchforge.trainer.lora import (
    adapters_disabled,
    apply_lora,
    apply_lora_to_module,
    export_merged,
    merged_weights,
    shard_lora,
)
from torchforge.trainer.run_dir import RunInterrupted, StopOnInterrupt, earlier_run
from torchforge.trainer.tracking import MetricsLogger, check_tracker_packages

__all__ = ["RLTrainer"]

_CHECKPOINTS = "checkpoints"


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _lr_lambda(config: RLConfig, total_steps: int) -> Callable[[int], float]:
    warmup, kind = config.warmup_steps, config.lr_scheduler

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _checked_config(config: RLConfig | None) -> RLConfig:
    config = config if config is not None else RLConfig()
    if not isinstance(config, RLConfig):
        raise InvalidArgumentError(f"RLTrainer: config is a {type(config).__name__}; expected an RLConfig")
    return config


def _flag(algorithm: Algorithm, name: str) -> bool:
    """A capability flag of ``algorithm`` (a bool attribute or property), checked."""
    value = getattr(algorithm, name)
    if not isinstance(value, bool):
        raise TorchforgeError(
            f"RLTrainer: {algorithm.name}.{name} is {type(value).__name__}; expected a bool (capability "
            f"flags are attributes or properties, e.g. `{name} = True`, not methods)"
        )
    return value


def _enable_gradient_checkpointing(model: nn.Module) -> None:
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise InvalidArgumentError(f"RLTrainer: gradient_checkpointing=True but {type(model).__name__} cannot "
                                   "enable it; expected a Hugging Face model, or gradient_checkpointing=False")


def _changing_weight_names(model: nn.Module) -> frozenset[str]:
    """The engine-side names (Hugging Face, as :func:`full_weights` / :func:`merged_weights`
    yield them) of the weights training changes: each trainable parameter's, and with LoRA
    each adapted layer's merged weight; then every weight of the same parent module, since an
    engine may pack siblings into one tensor (vLLM's ``qkv_proj`` and ``gate_up_proj``) and
    needs them all to rebuild it. The rest stays as the engine loaded it."""
    changing = set()
    for name, parameter in unwrap_model(model).named_parameters():
        plain = _clean_name(name).removeprefix("base_model.model.")  # as full_weights names it
        if ".lora_" in plain:
            changing.add(plain.split(".lora_")[0] + ".weight")  # the merged W0 + scaling * B @ A
        elif parameter.requires_grad:
            changing.add(plain.replace(".base_layer.", "."))
    parents = {name.rsplit(".", 2)[0] for name in changing}
    return frozenset(parents)


def _cat_padded(batches: list[Batch], pad_id: int) -> Batch:
    """Batches of different lengths as one: responses right-padded, prompts left-padded
    (``pad_id`` for ids, False for masks, 0 for floats), then concatenated."""
    if len(batches) == 1:
        return batches[0]
    fields = {}
    for key in ("tokens", "mask", "log_probs", "old_log_probs", "ref_log_probs", "rollout_log_probs",
                "prompt_tokens", "prompt_mask", "rewards", "truncated", "advantages", "policy_version"):
        values = [b.get(key) for b in batches]
        if values[0] is None:
            continue
        if values[0].dim() == 2 and key not in ("rewards", "advantages"):
            width = max(v.shape[1] for v in values)
            fill = pad_id if key.endswith("tokens") else (False if values[0].dtype == torch.bool else 0.0)
            left = key.startswith("prompt")
            values = [torch.nn.functional.pad(v, (width - v.shape[1], 0) if left else (0, width - v.shape[1]),
                                              value=fill) for v in values]
        fields[key] = torch.cat(values)
    fields["vision"] = cat_vision([b.get("vision") for b in batches], [b.batch_size[0] for b in batches])
    return Batch(**fields, batch_size=[sum(b.batch_size[0] for b in batches)])


class RLTrainer:
    """Train a Hugging Face causal LM with GRPO, PPO, REINFORCE or your own ``Algorithm``.

    Every argument is optional: with no model, the trainer builds the embedded demo (a
    tiny Llama, a character tokenizer, the copy-digits task and its reward) — what
    ``torchforge train`` runs with no arguments.

    Args:
        model: a causal LM (``AutoModelForCausalLM``) on the CPU or its device.
        tokenizer: its tokenizer (required with a model).
        config: an :class:`RLConfig`; default ``RLConfig()``.
        reward_functions: RewardFunction objects and / or TRL-style callables.
        train_dataset: a ``datasets.Dataset`` or a sequence of dicts with a ``"prompt"``
            (a string, or a list of chat messages rendered with the tokenizer's chat
            template); the other fields reach the reward functions as keyword arguments.
        algorithm: an :class:`~torchforge.trainer.algorithms.Algorithm`; default from
            ``config.algorithm``.
        distributed_config: a :class:`DistributedConfig`; its strategy and precision
            override the config's. Processes are started by ``torchrun`` (or
            ``torchforge train --nproc N``); one process trains alone.
        eval_dataset: rows like ``train_dataset``'s, scored every ``config.eval_steps`` steps
            (``eval/reward``, ``eval/pass@1``, ``eval/pass@k``: :func:`torchforge.loop.evaluate`).
        peft_config: a ``peft.LoraConfig``: train LoRA adapters only, the reference policy being
            the same model with its adapters off (:mod:`torchforge.trainer.lora`); default from
            ``config.lora``.
        environment_factory: a class or function making one multi-turn environment per
            episode (``reset(row)``, ``step(action)``: :class:`torchforge.loop.environments.Environment`);
            each row plays ``num_generations`` episodes of up to ``config.max_turns`` turns,
            and ``reward_functions`` become optional (see :mod:`torchforge.trainer.episodes`).
            A factory with a ``train_dataset`` (a verifiers environment,
            :mod:`torchforge.loop.verifiers_env`) gives the rows when ``train_dataset`` is None;
            OpenEnv servers: :mod:`torchforge.loop.openenv`.
        processor: a vision-language model's processor (``AutoProcessor``; it may also be
            passed as ``tokenizer``): rows with ``images`` and ``{"type": "image"}`` chat
            parts, the vision tower frozen unless ``config.train_vision_tower``
            (:mod:`torchforge.trainer.vision_task`).

    Returns:
        The trainer; :meth:`train` runs it.

    Example:
        >>> from torchforge import RLConfig
        >>> trainer = RLTrainer(config=RLConfig(max_steps=1, num_generations=2, prompts_per_step=2,
        ...     max_completion_length=4, kl_coef=0.0, progress_bar=False, output_dir="/tmp/tf-doctest"))
        >>> trainer.algorithm.name
        'GRPO'
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        tokenizer: Any = None,
        config: RLConfig | None = None,
        reward_functions: Sequence[Callable] | None = None,
        train_dataset: Any = None,
        algorithm: Algorithm | None = None,
        distributed_config: DistributedConfig | None = None,
        eval_dataset: Any = None,
        peft_config: Any = None,
        environment_factory: Callable[[], Any] | None = None,
        processor: Any = None,
    ) -> None:
        self.config = _checked_config(config)
        self.output_dir = Path(self.config.output_dir)
        self._check_new_run()
        check_tracker_packages(self.config.report_to)  # a missing wandb / trackio: one line, before any model
        if eval_dataset is not None:
            eval_dataset = check_eval_rows(eval_dataset, "RLTrainer")
        elif self.config.eval_steps is not None:
            raise InvalidArgumentError(f"RLTrainer: eval_steps={self.config.eval_steps} without an eval_dataset: nothing "
                                       "would be evaluated; expected eval_dataset=rows with a 'prompt', or eval_steps=None")
        self.eval_dataset = eval_dataset
        self.peft_config = peft_config if peft_config is not None else self.config.lora
        if environment_factory is not None and self.config.dynamic_sampling:
            raise InvalidArgumentError("RLTrainer: dynamic_sampling=True with an environment_factory; expected "
                                       "single-turn prompts (dynamic sampling redraws prompts, not episodes)")
        if self.peft_config is not None and self.config.ref_model_sync_steps is not None:
            raise InvalidArgumentError(
                f"RLTrainer: ref_model_sync_steps={self.config.ref_model_sync_steps} with a peft_config; expected "
                "one of them: with LoRA the reference is the policy with its adapters off")
        self.environment_factory = environment_factory
        init_distributed()
        self.device = _device()
        model = self._build_task(model, tokenizer, reward_functions, train_dataset, processor)
        self._build_parallelism(distributed_config)
        self.algorithm = self._build_algorithm(algorithm)
        self._build_models(model)
        self.kl_coef = self.algorithm.kl_coef  # the KL coefficient of the next step (adaptive with kl_target)
        self._build_optimizer()
        self._build_engine()
        self.rollout_strategy = self._build_rollout_strategy()
        self.step = 0
        self.history: list[dict[str, float]] = []
        self._order_cache: tuple[int, torch.Tensor] | None = None
        self._generator: AsyncGenerator | None = None
        self._changing_parents: frozenset[str] | None = None  # see _changing_weight_names
        self._sampling_lock = threading.Lock()  # async: the generator's sampling, or an evaluation

    def _check_new_run(self) -> None:
        """One run per folder (:mod:`torchforge.trainer.run_dir`): unless resuming, never write
        into an ``output_dir`` that holds a run, whose metrics and checkpoints would be lost
        or mixed with this one's."""
        held = None if self.config.resume else earlier_run(self.output_dir)
        if held is not None:
            raise InvalidArgumentError(
                f"RLTrainer: output_dir {str(self.output_dir)!r} already holds {held}; continue it with "
                "RLConfig(resume=True), or choose a new output_dir (`torchforge train --overwrite` replaces a run)"
            )

    # --- building ------------------------------------------------------------------------------

    def _build_task(self, model, tokenizer, reward_functions, train_dataset, processor=None) -> nn.Module:
        """Check the model, tokenizer, rewards and data (the embedded demo when no model); keep them."""
        fn, config = "RLTrainer", self.config
        if train_dataset is None:  # an environment that brings its rows (a verifiers environment's dataset)
            train_dataset = getattr(self.environment_factory, "train_dataset", None)
        if model is None:
            from torchforge.trainer import demo

            if tokenizer is not None:
                raise InvalidArgumentError(f"{fn}: a tokenizer was given without a model; pass both, or neither for the demo")
            tokenizer = demo.char_tokenizer()
            # vLLM's CPU attention needs heads of >= 32 dims: the demo's 4 heads of 16 become 2 of 32
            model = demo.tiny_llama(tokenizer, seed=config.seed, **({} if config.engine == "hf" else {"num_heads": 2}))
            if reward_functions is None:
                reward_functions = [] if self.environment_factory is not None else [demo.CopyDigitsReward()]
            train_dataset = train_dataset if train_dataset is not None else demo.copy_digits_dataset(4096, seed=config.seed)
        # a vision-language model: its processor (given, or as the tokenizer), images checked
        tokenizer, self.vision = vision_task(model, tokenizer, processor, train_dataset, config,
                                             eval_dataset=self.eval_dataset)
        if tokenizer is None:
            raise InvalidArgumentError(f"{fn}: tokenizer is None; expected the model's tokenizer")
        if not reward_functions and self.environment_factory is None:
            raise InvalidArgumentError(f"{fn}: reward_functions is empty; expected at least one reward function")
        if train_dataset is None or len(train_dataset) == 0:
            raise InvalidArgumentError(f"{fn}: train_dataset is empty or None; expected rows with a 'prompt' field")
        if "prompt" not in train_dataset[0] and self.environment_factory is None:
            raise InvalidArgumentError(
                f"{fn}: train_dataset rows have fields {sorted(train_dataset[0])}; expected a 'prompt' field"
            )
        self.tokenizer = tokenizer
        # reward_timeout / reward_processes: graders that hang or crash cost a completion, not the run
        self.reward_functions = guard_rewards(list(reward_functions or []), timeout=config.reward_timeout,
                                              processes=config.reward_processes, failure_reward=config.reward_on_failure)
        self.train_dataset = train_dataset
        self.stop_ids = completion_stop_ids(tokenizer, model, config.stop_token_ids)
        return model

    def _build_parallelism(self, distributed_config: DistributedConfig | None) -> None:
        """The strategy, the precision and the sharding settings of this run (warnings where they fall back)."""
        fn, config = "RLTrainer", self.config
        dist_cfg = distributed_config or DistributedConfig(
            strategy=config.distributed_strategy, mixed_precision=config.mixed_precision,
        )
        if dist_cfg.num_gpus is not None and dist_cfg.num_gpus != world_size():
            warnings.warn(
                f"{fn}: DistributedConfig(num_gpus={dist_cfg.num_gpus}) but this run has {world_size()} "
                f"process(es); start {dist_cfg.num_gpus} with `torchforge train --nproc {dist_cfg.num_gpus}` "
                f"or `torchrun --nproc_per_node {dist_cfg.num_gpus}`. Continuing with {world_size()}.",
                stacklevel=3,
            )
        bf16 = dist_cfg.mixed_precision == "bf16"
        if bf16 and not (self.device.type == "cuda" and torch.cuda.is_bf16_supported()):
            warnings.warn(f"{fn}: mixed_precision='bf16' needs a GPU with bf16 support; this machine has "
                          "none, training in float32", stacklevel=3)
            bf16 = False
        if config.prompts_per_step % world_size():
            raise InvalidArgumentError(
                f"{fn}: prompts_per_step={config.prompts_per_step} is not divisible by the {world_size()} "
                "processes; expected an equal share of prompts per process"
            )
        if dist_cfg.strategy == "none" and world_size() > 1:  # each process would train its own copy
            raise InvalidArgumentError(
                f"{fn}: distributed_strategy='none' with {world_size()} processes would train one unsynchronized "
                "copy of the model per process; expected 'fsdp' or 'ddp', or a single process"
            )
        self.strategy = dist_cfg.strategy if world_size() > 1 else "none"
        self._autocast = bf16 and self.strategy != "fsdp"  # FSDP2 casts parameters itself; otherwise autocast does
        self._shard_kwargs = dict(
            strategy=self.strategy, sharding_strategy=dist_cfg.sharding_strategy,
            mixed_precision="bf16" if bf16 and self.strategy == "fsdp" else None,
            # the model's own checkpointing (_build_models) already covers the policy
            activation_checkpointing=dist_cfg.activation_checkpointing and not config.gradient_checkpointing,
        )

    def _build_algorithm(self, algorithm: Algorithm | None) -> Algorithm:
        """The given algorithm, or the built-in one named by ``config.algorithm``; its flags checked."""
        algorithm = algorithm if algorithm is not None else algorithm_from_name(self.config.algorithm)
        if not isinstance(algorithm, Algorithm):
            raise InvalidArgumentError(f"RLTrainer: algorithm is a {type(algorithm).__name__}; expected an Algorithm")
        return algorithm

    def _build_models(self, model: nn.Module) -> None:
        """The policy (sharded), the frozen reference copy when needed, the algorithm's modules."""
        model = model.to(self.device)
        self.algorithm.setup(self.config, model)
        # async_generation with "hf": the generator samples with its own copy, loaded with the
        # published weights, while the policy trains (the base model with LoRA: merged weights)
        self._generation_model = None
        if self.config.async_generation and self.config.engine == "hf":
            self._generation_model = copy.deepcopy(model).eval().requires_grad_(False)
        if self.vision and not self.config.train_vision_tower:  # a VLM: the language model trains, the vision tower not
            freeze_vision_tower(model)
            if self.peft_config is not None:
                self.peft_config = lora_without_vision_tower(model, self.peft_config)
        if self.peft_config is not None:  # LoRA: only the adapters train
            model = apply_lora(model, self.peft_config, seed=self.config.seed)
        self.ref_model = None
        if _flag(self.algorithm, "needs_reference") and self.peft_config is None:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if self.config.gradient_checkpointing:
            _enable_gradient_checkpointing(model)
        self.model = (shard_lora if self.peft_config is not None else shard)(model, **self._shard_kwargs)
        if self.ref_model is not None and self.strategy == "fsdp":
            self.ref_model = shard(self.ref_model, **self._shard_kwargs)
        if _flag(self.algorithm, "needs_reference") and self.peft_config is not None:
            self.ref_model = self.model  # run under adapters_disabled: one copy of the base weights
        if self.config.padding_free:  # a model that cannot be packed: one line, before any step
            with self._autocast_context():
                check_packable(self.model, fn="RLTrainer")
        modules = {"policy": self.model}
        for name, module in self.algorithm.modules().items():
            if isinstance(module, ValueModel):  # the critic runs packed too
                module.packed = self.config.padding_free
            if self.peft_config is not None:  # LoRA: a copied decoder (PPO's critic) freezes, gets adapters
                module = apply_lora_to_module(module, self.peft_config, seed=self.config.seed + 1)
            module = shard(module.to(self.device), **self._shard_kwargs)
            setattr(self.algorithm, name, module)  # the algorithm calls the sharded module
            modules[name] = module
        self.modules = nn.ModuleDict(modules)

    def _build_optimizer(self) -> None:
        """AdamW over every trainable parameter, and the learning-rate schedule of the whole run."""
        config = self.config
        self.trainable_parameters = [p for p in self.modules.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable_parameters, lr=config.learning_rate,
                                           weight_decay=config.weight_decay)
        self.total_steps = config.max_steps or max(
            1, math.ceil(config.num_train_epochs * len(self.train_dataset) / config.prompts_per_step))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(config, self.total_steps))

    def _build_engine(self) -> None:
        """The generation engine of ``config.engine``: Hugging Face ``generate`` on the policy
        itself, or a vLLM engine loaded with the policy's weights (merged, with LoRA)."""
        cfg = self.config
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        if self._generation_model is not None:
            self.engine = HFEngine(self._generation_model, pad_token_id=pad)
            return
        weights = None if cfg.engine == "hf" else self._engine_weights()
        self.engine = make_engine(cfg.engine, self.model, self.tokenizer, engine_args=cfg.engine_args,
                                  weights=weights, pad_token_id=pad)

    def _build_rollout_strategy(self) -> RolloutStrategy:
        """Single-turn completions, or multi-turn episodes with an environment factory."""
        parts = dict(config=self.config, model=self.model, tokenizer=self.tokenizer, stop_ids=self.stop_ids,
                     reward_functions=self.reward_functions, autocast=self._autocast_context, device=self.device)
        if self.environment_factory is not None:
            return EpisodeRollout(**parts, environment_factory=self.environment_factory, processor=self.vision.processor)
        return SingleTurnRollout(**parts, processor=self.vision.processor)

    def close_engine(self) -> None:
        """Stop the generation engine (a vLLM engine, or a vLLM server this trainer started),
        before the process group goes: vLLM in process tears down its own groups. The
        default engine has nothing to stop. Every process calls this.

        Args:
            None.

        Returns:
            None.
        """
        self._close_generator()
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()

    def _engine_weights(self, changed_only: bool = False):
        """What the engine loads: the policy's full weights, or with LoRA the adapters merged in
        (every engine takes plain weights; vLLM's own LoRA path would also need enable_lora).
        ``changed_only``: only the weights of modules that training changes (every process
        still walks all of them: under FSDP each gather is a collective)."""
        weights = merged_weights(self.model) if self.peft_config is not None else full_weights(self.model)
        if not changed_only:
            return weights
        if self._changing_parents is None:
            self._changing_parents = _changing_weight_names(self.model)
        parents = self._changing_parents
        return ((name, tensor) for name, tensor in weights if name.rsplit(".", 2)[0] in parents)

    def _engine_is_policy(self) -> bool:
        """True when the engine samples with the trained model itself (the default "hf")."""
        return isinstance(self.engine, HFEngine) and self.engine.model is self.model

    def _sync_engine(self, version: int, *, everything: bool = False) -> float:
        """Give the engine the weights trained for ``version`` steps; returns the seconds it took.
        The default engine samples with the policy itself, so only its version moves. Others get
        the weights training changes (``everything``: all of them, as after loading a checkpoint),
        nothing when they hold ``version`` already."""
        if self._engine_is_policy():
            self.engine.update_weights((), version=version)
            return 0.0
        if self.engine.weights_version == version and not everything:  # it holds these weights already
            return 0.0
        start = time.perf_counter()
        self.engine.update_weights(self._engine_weights(changed_only=not everything), version=version)
        return time.perf_counter() - start

    # --- data ---------------------------------------------------------------------------------

    def _rows(self, step: int, sampling_round: int = 0) -> tuple[list[dict[str, Any]], list[int]]:
        """This process's prompts for ``step`` and their ids in the (epoch-shuffled) stream; round
        r > 0 of dynamic sampling reads past the run's own prompts, at ``r * total_steps + step``."""
        n, per_step = len(self.train_dataset), self.config.prompts_per_step
        share = per_step // world_size()
        first = (sampling_round * self.total_steps + step) * per_step + rank() * share
        rows, ids = [], []
        for k in range(first, first + share):
            epoch, offset = divmod(k, n)
            order = self._order(epoch)
            rows.append(dict(self.train_dataset[int(order[offset])]))
            ids.append(k)
        return rows, ids

    def _order(self, epoch: int) -> torch.Tensor:
        """The permutation of the dataset for ``epoch`` (seeded; the last one is cached)."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + epoch)
            self._order_cache = (epoch, torch.randperm(len(self.train_dataset), generator=generator))
        return self._order_cache[1]

    # --- one step -----------------------------------------------------------------------------

    def _autocast_context(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._autocast)

    def _log_probs(self, model: nn.Module, batch: Batch, *, grad: bool, entropy: bool = False):
        with torch.set_grad_enabled(grad), self._autocast_context():
            return policy_log_probs(model, batch, temperature=self.config.temperature, return_entropy=entropy,
                                    packed=self.config.padding_free)

    def _micro_batches(self, batch: Batch) -> list[Batch]:
        cfg = self.config
        if cfg.micro_batch_tokens is not None:  # a token budget, the same number on every process
            return micro_batches_by_tokens(batch, cfg.micro_batch_tokens, group_size=cfg.num_generations)
        return list(micro_batches(batch, cfg.micro_batch_size or batch.batch_size[0]))

    def _log_probs_no_grad(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """[B, T] log-probs of ``batch`` under ``model``, one micro-batch at a time, without grad."""
        return torch.cat([self._log_probs(model, part, grad=False)[0] for part in self._micro_batches(batch)])

    def train_step(self, step: int) -> dict[str, float]:
        """Sample, score and update once; returns this step's metrics (all processes combined).

        Args:
            step: the 0-based step.

        Returns:
            name -> float.
        """
        start = time.perf_counter()
        sampling: dict[str, float] = {}
        if self.config.async_generation:  # sampled ahead by the generator thread
            ahead, sampling = self._started_generator(step).take(step)
            scored = ahead.payload
        else:
            self._pop_reward_failures()  # count this step's failures only (not an evaluation's before it)
            scored = self.sample_step(step)
            if self.config.dynamic_sampling:
                scored, sampling = self._dynamic_sampling(step, scored)
            scored.reward_failures = self._pop_reward_failures()
        batch, per_function = scored.batch, scored.per_function
        counted = self._counted_completions(self._update_rewards(batch, per_function))
        self._reference_log_probs(counted)
        context = StepContext(step=step, kl_coef=self.kl_coef, reward_weights=self._reward_weights(),
                              entropy_threshold=self._entropy_threshold(counted))
        with self.algorithm.using(context):
            self.algorithm.prepare(counted)
            loss, loss_metrics, grad_norm = self._update(counted)
        metrics = self._metrics(scored, counted, loss, loss_metrics, grad_norm, time.perf_counter() - start)
        self.scheduler.step()  # the schedule counts steps, whatever num_iterations makes of each
        self._after_update(step, metrics)
        # how many steps behind the trained weights the samples were; then the engine catches up
        if batch.policy_version is not None:
            metrics["rollout/staleness"] = step - float(batch.policy_version.double().mean())
        every = self.config.engine_sync_steps
        if self.config.async_generation:
            metrics["async/staleness"] = metrics["rollout/staleness"]
            if (step + 1) % every == 0:
                metrics["engine/sync_seconds"] = self._publish_weights(step + 1)
        elif self._engine_is_policy() or (every and (step + 1) % every == 0):
            metrics["engine/sync_seconds"] = self._sync_engine(step + 1)
        metrics["engine/weights_version"] = float(self.engine.weights_version)
        return {**metrics, **sampling}

    def _pop_reward_failures(self) -> dict[str, torch.Tensor]:
        """``rewards/<name>/timeouts`` and ``/crashes``: this process's completions of guarded
        reward functions whose call timed out or crashed since the last call (to sum over processes)."""
        return {f"rewards/{key}/{kind}": torch.tensor(float(n))
                for key, f in zip(reward_keys(self.reward_functions), self.reward_functions)
                if isinstance(f, GuardedReward) for kind, n in f.pop_failures().items()}

    # --- asynchronous generation --------------------------------------------------------------

    def _sample_step_ahead(self, step: int) -> ScoredBatch:
        """The generator thread's work: :meth:`sample_step`, with its reward failures."""
        scored = self.sample_step(step)
        scored.reward_failures = self._pop_reward_failures()
        return scored

    def _started_generator(self, step: int) -> AsyncGenerator:
        """The generator thread, started at ``step`` when it is not running yet."""
        if self._generator is None:
            self._generator = AsyncGenerator(
                self._sample_step_ahead, self.engine, start=step, end=self.total_steps,
                version=self.engine.weights_version, max_staleness=self.config.max_staleness,
                partial_rollouts=self.config.partial_rollouts, lock=self._sampling_lock,
                threads=self.config.generator_threads).start_thread()
        return self._generator

    def _publish_weights(self, version: int) -> float:
        """Hand the generator the weights of ``version`` (gathered here, a collective under FSDP;
        copied, since training goes on in place); returns the seconds it took."""
        start = time.perf_counter()
        weights = [(name, tensor.detach().clone()) for name, tensor in self._engine_weights(changed_only=True)]
        self._generator.publish(version, weights)
        return time.perf_counter() - start

    def _close_generator(self, timeout: float | None = 60.0) -> None:
        """Stop the generator thread after the batch it samples (the batches ahead are dropped:
        a resumed run samples them again, for the same prompts)."""
        if self._generator is not None:
            self._generator.close(timeout)
            self._generator = None

    def _dynamic_sampling(self, step: int, scored: ScoredBatch) -> tuple[ScoredBatch, dict[str, float]]:
        """DAPO: drop the all-equal groups, draw more rounds (the same number on every process)
        until each process has its share of informative groups; fill with dropped ones if short."""
        cfg, G = self.config, self.config.num_generations
        share = cfg.prompts_per_step // world_size()
        rounds = [scored]

        def informative(b: Batch) -> torch.Tensor:  # [groups] bool
            return ~zero_std_groups(b.rewards.cpu(), group_size=G).view(-1, G)[:, 0]

        kept = int(informative(scored.batch).sum())
        while len(rounds) < cfg.max_sampling_rounds:
            short = sum_over_ranks(torch.tensor([float(max(share - kept, 0))], device=self.device))
            if float(short) == 0:  # every process full: the same answer everywhere
                break
            rounds.append(self.sample_step(step, len(rounds)))
            kept += int(informative(rounds[-1].batch).sum())
        picks = [(i, g) for i, r in enumerate(rounds) for g in informative(r.batch).nonzero().flatten().tolist()]
        filler = [(i, g) for i, r in enumerate(rounds) for g in (~informative(r.batch)).nonzero().flatten().tolist()]
        chosen = (picks + filler)[:share]
        parts, scores, rows = [], [], []
        for i, r in enumerate(rounds):
            groups = [g for k, g in chosen if k == i]
            samples = torch.tensor([g * G + j for g in groups for j in range(G)], dtype=torch.long)
            if len(samples):
                parts.append(r.batch[samples.to(r.batch.rewards.device)])
                scores.append({k: v[samples] for k, v in r.per_function.items()})
                rows += [r.rows[g] for g in groups]
        filled = sum_over_ranks(torch.tensor([float(max(share - len(picks), 0)), float(len(rounds))],
                                             device=self.device))
        metrics = {"dynamic_sampling/rounds": float(len(rounds)),
                   "dynamic_sampling/prompts_drawn": float(len(rounds) * cfg.prompts_per_step),
                   "dynamic_sampling/filled_groups": float(filled[0])}
        return ScoredBatch(_cat_padded(parts, self.tokenizer.pad_token_id or 0),
                           {k: torch.cat([f[k] for f in scores]) for k in scored.per_function}, rows), metrics

    def _update_rewards(self, batch: Batch, per_function: dict[str, torch.Tensor]) -> Batch:
        """The rewards the update sees: [B, K] per function with ``reward_aggregation="normalize_then_sum"``
        (GDPO, weighted in ``compute_advantages``), clipped with ``reward_clip``. ``batch`` is left as scored."""
        cfg = self.config
        if cfg.reward_aggregation == "weighted_sum" and cfg.reward_clip is None:
            return batch
        updated = batch.clone(recurse=False)
        if cfg.reward_aggregation == "normalize_then_sum":
            updated.rewards = torch.stack(list(per_function.values()), -1).to(batch.rewards.device)
        if cfg.reward_clip is not None:
            updated.rewards = updated.rewards.clamp(*cfg.reward_clip)  # NaN stays NaN
        return updated

    def _reward_weights(self) -> list[float] | None:
        """The [K] weights GDPO sums the normalized rewards with (``reward_aggregation=
        "normalize_then_sum"``): ``reward_weights``, else each function's ``weight``
        (score_rewards' default); None otherwise."""
        if self.config.reward_aggregation != "normalize_then_sum":
            return None
        return self.config.reward_weights or [float(getattr(f, "weight", 1.0)) for f in self.reward_functions]

    def _after_update(self, step: int, metrics: dict[str, float]) -> None:
        """Adaptive KL (``kl_target``: the next coefficient from this step's ``kl``; logs the one
        used, ``kl_coef``) and the reference refresh of ``ref_model_sync_steps``."""
        cfg = self.config
        if cfg.kl_target is not None:
            metrics["kl_coef"] = self.kl_coef
            if "kl" in metrics and math.isfinite(metrics["kl"]):  # the same float on every process
                self.kl_coef = adaptive_kl_coef(
                    self.kl_coef, metrics["kl"], target=cfg.kl_target, horizon=cfg.kl_horizon,
                    num_steps=cfg.prompts_per_step * cfg.num_generations)  # sequences, as TRL and verl count
        if cfg.ref_model_sync_steps and self.ref_model is not None and (step + 1) % cfg.ref_model_sync_steps == 0:
            with torch.no_grad():
                if self.strategy == "fsdp":  # both sharded alike: each local shard to its twin
                    for ref, new in zip(self.ref_model.parameters(), self.model.parameters()):
                        ref.copy_(new)
                else:
                    sync_weights(self.model, self.ref_model)

    def sample(self, step: int) -> tuple[Batch, dict[str, torch.Tensor]]:
        """Sample and score this process's batch of ``step``.

        Args:
            step: the 0-based step (selects the prompts and the samples).

        Returns:
            ``(batch, per_function_rewards)``: :meth:`sample_step`'s batch and scores.
        """
        scored = self.sample_step(step)
        return scored.batch, scored.per_function

    def sample_step(self, step: int, sampling_round: int = 0) -> ScoredBatch:
        """This process's batch of ``step`` from the rollout strategy (``rollout_strategy``):
        G completions (or episodes) of each prompt, scored, with ``rollout_log_probs``.

        Args:
            step: the 0-based step (selects the prompts and the samples).
            sampling_round: round r > 0 of dynamic sampling reads past the run's own prompts.

        Returns:
            A :class:`~torchforge.trainer.rollouts.ScoredBatch` (its ``episodes``: the
            multi-turn record, with an environment factory).
        """
        return self.rollout_strategy(*self._rows(step, sampling_round), self.engine)

    def _counted_completions(self, batch: Batch) -> Batch:
        """The batch the update sees: with ``mask_truncated_completions``, a truncated
        completion's tokens leave the mask and its reward is NaN ("not applicable": left out
        of the group statistics, advantage 0). ``batch`` itself is left as sampled (for the logs)."""
        if not self.config.mask_truncated_completions:
            return batch
        counted = batch.clone(recurse=False)
        truncated = batch.truncated.to(batch.mask.device)
        counted.mask = batch.mask & ~truncated[:, None]
        rows = truncated.to(batch.rewards.device).view(-1, *[1] * (batch.rewards.dim() - 1))  # [B] or [B, K]
        counted.rewards = batch.rewards.masked_fill(rows, float("nan"))
        return counted

    def _reference_log_probs(self, batch: Batch) -> None:
        """``ref_log_probs`` (with a reference policy), and ``old_log_probs`` when ``prepare`` needs them."""
        if self.ref_model is not None:
            with adapters_disabled(self.ref_model):  # LoRA: the policy without its adapters
                batch.ref_log_probs = self._log_probs_no_grad(self.ref_model, batch)
        if _flag(self.algorithm, "needs_old_log_probs_in_prepare"):
            sampler = self._proximal_log_probs(batch)
            batch.old_log_probs = sampler if sampler is not None else self._log_probs_no_grad(self.model, batch)

    def _entropy_threshold(self, batch: Batch) -> torch.Tensor | None:
        """``top_entropy_quantile``'s threshold of the step: every counted token of every
        process, from a no-grad forward; None when off."""
        if self.config.top_entropy_quantile == 1:
            return None
        entropy = torch.cat([self._log_probs(self.model, part, grad=False, entropy=True)[1]
                             for part in self._micro_batches(batch)])
        return entropy_threshold(gather_over_ranks(entropy[batch.mask].float()),
                                 quantile=self.config.top_entropy_quantile)

    def _update(self, batch: Batch) -> tuple[torch.Tensor, StepMetrics, float]:
        """``num_iterations`` optimizer steps over every micro-batch; the last one's loss share,
        metrics (on the device, with their reductions) and grad norm."""
        cfg = self.config
        parts = self._micro_batches(batch)
        self.model.train()
        for _ in range(cfg.num_iterations):
            loss_metrics = StepMetrics()
            loss, _ = accumulate_gradients(parts, self._loss, mode=cfg.loss_aggregation,
                                           norm_length=cfg.max_completion_length, metrics=loss_metrics)
            grad_norm = optimizer_step(self.trainable_parameters, self.optimizer, max_grad_norm=cfg.max_grad_norm)
        return loss, loss_metrics, grad_norm

    def _loss(self, part: Batch, aggregation: Aggregation) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The algorithm's ``(loss, metrics)`` of one micro-batch, after its forward (with grad)."""
        log_probs, entropy = self._log_probs(self.model, part, grad=True, entropy=True)
        part.log_probs = log_probs
        sampler = self._proximal_log_probs(part)
        if part.old_log_probs is None:  # the first pass runs before any update: pi_prox, the step's weights
            part.old_log_probs = sampler if sampler is not None else log_probs.detach()
        # the canary: the sampler's log-probs against the first pass's (~0 when they share weights)
        if getattr(part, "rollout_log_probs", None) is not None:
            trainer_side = part.old_log_probs if sampler is None else log_probs.detach()
            logged_gap = rollout_log_prob_gap(trainer_side, part.rollout_log_probs, part.mask)
            if self.config.async_generation:  # the second factor pi_prox / mu (ratio_mean is the first)
                behaviour = (part.old_log_probs - part.rollout_log_probs).clamp(max=20).exp()
                logged_gap["async/behaviour_ratio_mean"] = masked_mean(behaviour, part.mask)
        else:
            logged_gap = {}
        weights, correction = self.algorithm.correction_weights(part, entropy)  # rollout_correction, top entropy
        with self.algorithm.bind(part, aggregation, weights), self._autocast_context():
            out = self.algorithm.compute_loss(part)
            logged = self.algorithm.pop_metrics()
        loss, metrics = self._checked_loss_output(out)
        logged_gap = {**logged_gap, **correction}
        if self.config.entropy_coef > 0:  # the entropy bonus, on the counted tokens, aggregated as the loss
            loss = loss - self.config.entropy_coef * aggregation(entropy, part.mask)
        return loss, {**metrics, **logged, **logged_gap, "entropy": masked_mean(entropy.detach(), part.mask)}

    def _proximal_log_probs(self, batch: Batch) -> torch.Tensor | None:
        """``proximal_log_probs="sampler"``: the engine's log-probs as ``old_log_probs`` (the
        loss clips pi_theta / mu); None for "recomputed" (the step's weights, pi_prox)."""
        if self.config.proximal_log_probs != "sampler":
            return None
        if batch.rollout_log_probs is None:
            raise TorchforgeError("RLTrainer: proximal_log_probs='sampler' but the batch has no rollout_log_probs; "
                                  "expected the engine's log-probs of every sampled token")
        return batch.rollout_log_probs.to(batch.mask.device)

    def _checked_loss_output(self, out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``compute_loss``'s ``(loss, metrics)``, or an error naming what it returned instead."""
        expected = "expected (loss, metrics): a scalar tensor and a dict, as every torchforge loss returns"
        what = f"{self.algorithm.name}.compute_loss returned"
        if not (isinstance(out, tuple) and len(out) == 2):
            shape = f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else ""
            size = f" of {len(out)} items" if isinstance(out, tuple) else ""
            raise TorchforgeError(f"{what} {type(out).__name__}{shape}{size}; {expected}")
        loss, metrics = out
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0) or not isinstance(metrics, dict):
            shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""
            raise TorchforgeError(f"{what} ({type(loss).__name__}{shape}, {type(metrics).__name__}); {expected}")
        return loss, metrics

    def _metrics(self, scored: ScoredBatch, counted: Batch, loss: torch.Tensor, loss_metrics: StepMetrics,
                 grad_norm: float, seconds: float) -> dict[str, float]:
        """The step's metrics over every process: the loss metrics (as their reductions say),
        the step's own and the rollout strategy's counts go to the CPU together, in two
        collectives (sums and means, extremes); never means of means. The rewards and lengths
        are the sampled batch's; the loss metrics and the groups without signal are the
        ``counted`` batch's, which the update saw (``mask_truncated_completions``)."""
        batch, per_function = scored.batch, scored.per_function
        G = self.config.num_generations
        lengths = batch.mask.sum(-1).float()
        sequences = float(len(lengths))
        scored_rewards = self._counted_completions(batch).rewards  # a truncated one that counts for nothing: NaN
        logged = [k for k in loss_metrics if not (k == "kl" and self.ref_model is None)]  # no reference: no KL
        step = loss_metrics  # the loss metrics, then the step's own, reduced together
        step.add("loss", loss / world_size(), reduction="sum")  # each process's share
        per_sequence = {"completions/mean_length": lengths, "completions/clipped_ratio": batch.truncated.float(),
                        "frac_reward_zero_std": zero_std_groups(scored_rewards, group_size=G).float()}
        for name, values in per_sequence.items():  # every process adds the same names: no sequences, weight 0
            step.add(name, values.sum() / max(sequences, 1.0), reduction="mean", weight=sequences)
        step.add("completions/max_length", lengths.max() if sequences else 0.0, reduction="max", weight=sequences)
        step.add("counts/tokens", lengths.sum(), reduction="sum")
        series = {"": batch.rewards, **{f"rewards/{k}/": v for k, v in per_function.items()}}
        for prefix, scores in series.items():
            step.add(f"counts/scored/{prefix}", (~scores.isnan()).sum(), reduction="sum")
        strategy_sums = self.rollout_strategy.metric_sums(scored)
        for name, value in {**strategy_sums, **scored.reward_failures}.items():
            step.add(name, value, reduction="sum")
        total = step.reduce()

        def mean_std(prefix: str) -> tuple[float, float]:
            """Over every process; the variance from deviations about the mean (reduce.masked_var),
            so rewards near 1e4 keep their spread, which sum(r^2) / n - mean^2 rounds away."""
            if total[f"counts/scored/{prefix}"] == 0:  # the same on every process: all skip the collectives
                return math.nan, math.nan
            scores = series[prefix]
            valid = ~scores.isnan()
            mean = masked_mean(scores, valid, sum_over_ranks=sum_over_ranks)
            var = masked_var(scores, valid, sum_over_ranks=sum_over_ranks)
            return float(mean), math.sqrt(float(var))

        out: dict[str, float] = {}
        out["reward"], out["reward_std"] = mean_std("")
        for name in per_function:
            out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = mean_std(f"rewards/{name}/")
        out["frac_reward_zero_std"] = total["frac_reward_zero_std"]
        out.update({key: total[key] for key in logged})
        out["loss"] = total["loss"]
        for key in ("completions/mean_length", "completions/max_length", "completions/clipped_ratio"):
            out[key] = total[key]
        out["grad_norm"] = grad_norm
        out["learning_rate"] = self.scheduler.get_last_lr()[0]
        out["tokens_per_second"] = total["counts/tokens"] / seconds
        out["step_time"] = seconds
        out.update(self.rollout_strategy.metrics({k: total[k] for k in strategy_sums}))
        out.update({k: total[k] for k in scored.reward_failures})
        return out

    # --- the run ------------------------------------------------------------------------------

    def save(self, step: int) -> Path:
        """Checkpoint everything needed to continue after ``step`` steps (every process calls this).

        Args:
            step: steps done.

        Returns:
            The checkpoint folder.
        """
        path = self.output_dir / _CHECKPOINTS / f"step-{step:06d}"
        save_checkpoint(path, model=self.modules, optimizer=self.optimizer, scheduler=self.scheduler,
                        extra={"step": step, "kl_coef": self.kl_coef},
                        trainable_only=self.peft_config is not None)  # LoRA: the adapters, not the base
        return path

    def evaluate(self) -> dict[str, float]:
        """Score ``eval_dataset`` with the reward functions (every process calls this).

        Args:
            None.

        Returns:
            The ``eval/...`` metrics of :func:`torchforge.loop.evaluate`.
        """
        if self.eval_dataset is None:
            raise InvalidArgumentError("RLTrainer.evaluate: no eval_dataset was given")
        # async_generation: the engine may hold older weights (and is the generator's): evaluate
        # the trained ones with Hugging Face generate, the reward functions not shared meanwhile
        engine = None if self.config.async_generation else self.engine
        with self._sampling_lock, self._autocast_context():
            metrics = evaluate_dataset(self.model, self.tokenizer, self.eval_dataset, self.reward_functions,
                                       self.config, render=partial(render_prompt, self.tokenizer),
                                       stop_token_ids=self.stop_ids, engine=engine, processor=self.vision.processor)
            self._pop_reward_failures()  # an evaluation's failures are not a training step's
        return metrics

    def resume(self) -> int:
        """Load the newest checkpoint in ``output_dir``; returns the steps it had done (0 if none).

        Args:
            None.

        Returns:
            int.
        """
        latest = latest_checkpoint(self.output_dir / _CHECKPOINTS)
        if latest is None:
            if is_main_process():
                warnings.warn(f"RLTrainer: resume=True but {self.output_dir / _CHECKPOINTS} holds no "
                              "checkpoint; starting from step 0", stacklevel=2)
            return 0
        extra = load_checkpoint(latest, model=self.modules, optimizer=self.optimizer, scheduler=self.scheduler,
                                trainable_only=self.peft_config is not None)
        if "kl_coef" in extra:  # the adaptive KL coefficient (kl_target) resumes where it was
            self.kl_coef = extra["kl_coef"]
        return int(extra["step"])

    def _stop_interrupted(self, last_saved: Path | None) -> None:
        """Ctrl-C between steps: checkpoint this step (unless just saved), then raise RunInterrupted."""
        if last_saved is None or last_saved.name != f"step-{self.step:06d}":
            self.save(self.step)
        raise RunInterrupted(self.step, self.step)

    def train(self) -> dict[str, Any]:
        """Run until ``max_steps`` (or ``num_train_epochs``), logging, checkpointing and exporting.

        Args:
            None.

        Returns:
            A summary: ``steps``, ``reward_first`` / ``reward_last`` (mean reward of the first
            and last 10% of logged steps), and the paths of ``metrics``, ``checkpoint``,
            ``final_model`` and ``plot``.
        """
        cfg = self.config
        self._check_new_run()  # this trainer's own earlier train() counts too
        if is_main_process():
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        start = self.step = self.resume() if cfg.resume else 0
        if start and (self._engine_is_policy() or cfg.engine_sync_steps):
            self._sync_engine(start, everything=True)  # the engine samples with the checkpoint's weights
        logger = MetricsLogger(self.output_dir, total_steps=self.total_steps, initial_step=start,
                               enabled=is_main_process(), progress_bar=cfg.progress_bar, report_to=cfg.report_to,
                               run_config=cfg.to_dict(), run_name=cfg.run_name)
        last_saved = None
        interrupt = StopOnInterrupt()  # the first Ctrl-C stops after the current step
        try:
            for step in range(start, self.total_steps):
                metrics = self.train_step(step)
                self.step = step + 1
                evaluating = self.eval_dataset is not None and bool(cfg.eval_steps) and self.step % cfg.eval_steps == 0
                if evaluating:
                    metrics.update(self.evaluate())
                self.history.append({"step": self.step, **metrics})
                if evaluating or self.step % cfg.logging_steps == 0 or self.step == self.total_steps:
                    logger.log(self.step, metrics)
                logger.advance()
                if cfg.save_steps and self.step % cfg.save_steps == 0:
                    last_saved = self.save(self.step)
                if interrupt.requested():
                    self._stop_interrupted(last_saved)
        finally:
            self._close_generator()  # async: after the batch in flight; nothing trains on it
            logger.close()
            interrupt.close()
            close_rewards(self.reward_functions)  # reward worker processes (they restart if used again)
        if last_saved is None or self.step != int(last_saved.name.split("-")[1]):
            last_saved = self.save(self.step)
        final = self.output_dir / "final"
        export_pretrained(self.model, self.vision.processor or self.tokenizer, final)  # a VLM: its processor too
        if (cfg.lora or {}).get("merge") and self.peft_config is not None:
            export_merged(self.model, self.vision.processor or self.tokenizer, self.output_dir / "final-merged")
        summary: dict[str, Any] = {"steps": self.step, "metrics": self.output_dir / "metrics.jsonl",
                                   "checkpoint": last_saved, "final_model": final, "plot": None}
        rewards = [h["reward"] for h in self.history if not math.isnan(h["reward"])]
        window = max(1, len(rewards) // 10)
        summary["reward_first"] = sum(rewards[:window]) / window if rewards else math.nan
        summary["reward_last"] = sum(rewards[-window:]) / window if rewards else math.nan
        if is_main_process() and (self.output_dir / "metrics.jsonl").exists():
            from torchforge.trainer.plot import plot_run

            summary["plot"] = plot_run(self.output_dir)
        barrier()
        return summary
