"""Start training from a Hugging Face checkpoint: a GPT, its trainer and its state in one call."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import optax

from shardkit.core.errors import InputError, ModelError, short_repr
from shardkit.core.mesh import Layout
from shardkit.core.state import TrainState
from shardkit.models import hf, peft
from shardkit.models.generate import generate
from shardkit.models.gpt import GPTConfig
from shardkit.models.lora import LoRA
from shardkit.training.train import Trainer

_MODEL_FIELDS = (
    "param_dtype",
    "dtype",
    "scan_layers",
    "scan_unroll",
    "remat",
    "dropout",
    "attention",
    "max_seq",
    "aux_loss_weight",
    "capacity_factor",
    "moe_dropless",
)


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """A checkpoint made trainable: its ``trainer``, the ``state`` holding its weights, the GPT
    ``config`` and the checkpoint's own ``hf_config``."""

    trainer: Trainer
    state: TrainState
    config: GPTConfig
    hf_config: Mapping[str, Any]
    base: str | None = None  # the checkpoint's directory (an adapter records it as its base)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        params: Any = None,
        layout: Layout | str | Mapping[str, int] | None = None,
        **sampling: Any,
    ) -> list[list[int]]:
        """Continue token-id prompts with this checkpoint (:func:`shardkit.generate`).

        Args:
          prompts: token-id lists of any lengths.
          max_new_tokens: new tokens per prompt.
          params: the parameters to use (default: ``state.params``, the checkpoint's, or pass
            the trained ``state.params``).
          layout: generation's own layout (default: one device on CPUs).
          **sampling: ``temperature``, ``top_k``, ``top_p``, ``seed``, ``eos_ids``.

        Returns:
          The new tokens of each prompt.
        """
        chosen = self.state.params if params is None else params
        return generate(self.trainer.model, chosen, prompts, max_new_tokens, layout=layout, **sampling)

    def save(self, params: Any, directory: str | os.PathLike[str], *, adapter_only: bool = False) -> pathlib.Path:
        """Write ``params`` (``state.params`` after training) back in the checkpoint's format,
        keeping its ``config.json``'s other keys (see :func:`shardkit.models.hf.save_pretrained`).

        With LoRA adapters: ``adapter_only=True`` writes them in peft's format
        (``adapter_config.json``, ``adapter_model.safetensors``; peft loads them onto the base),
        ``adapter_only=False`` a whole checkpoint with each adapter merged into its weight.
        """
        if adapter_only:
            return peft.write_adapter(params, self.config, directory, base=self.base)
        weights, cfg = peft.merged(params, self.config)
        return hf.save_pretrained(weights, cfg, directory, base_config=self.hf_config)


def from_pretrained(
    path: str | os.PathLike[str],
    layout: Layout | str | Mapping[str, int] = "data=-1",
    optimizer: optax.GradientTransformation | None = None,
    *,
    seed: int = 0,
    adapter: str | os.PathLike[str] | None = None,
    lora: LoRA | None = None,
    drop_mtp: bool = False,
    balance_rate: float = 0.0,
    **options: Any,
) -> Pretrained:
    """A trainer of shardkit's GPT and a state holding a Hugging Face checkpoint's weights: Llama 2/3.x,
    Mistral, Mixtral, Qwen2/2.5, Qwen3, Gemma 2 or 3, Qwen3-MoE, gpt-oss, DeepSeek-V3 or Kimi K2
    (:mod:`shardkit.models.hf_config`).

    Every parameter is read straight into its shards: each process reads only the blocks of the
    ``.safetensors`` tensors its devices hold, so no host ever holds the whole model.

    Args:
      path: a Hugging Face model directory (``config.json`` and ``*.safetensors``).
      layout: the mesh layout, as for :class:`~shardkit.Trainer`.
      optimizer: the optax transformation (default ``adamw(1e-5)``, a fine-tuning rate).
      seed: the dropout seed (and new adapters' initialization).
      adapter: a directory peft saved a LoRA adapter of this checkpoint in: the adapter is read
        onto the frozen base and trains on (:mod:`shardkit.models.peft`).
      lora: new LoRA adapters (:class:`shardkit.models.LoRA`) on the frozen base: only they train.
      drop_mtp: import a DeepSeek-V3 checkpoint without its multi-token-prediction layers (the
        layers past ``num_hidden_layers``), which are otherwise refused by name.
      balance_rate: DeepSeek-V3's auxiliary-loss-free balancing: after each step its score
        biases move this much toward an even load (:class:`shardkit.parallel.experts.Router`;
        0: they stay as the checkpoint has them).
      **options: GPTConfig fields that say how to train (``param_dtype``, ``dtype``,
        ``scan_layers``, ``scan_unroll``, ``remat``, ``dropout``, ``attention``, ``max_seq``,
        ``aux_loss_weight``; ``moe_dropless``/``capacity_factor`` to route as shardkit's MoE does);
        everything else goes to the Trainer.

    Returns:
      A :class:`Pretrained`: ``.trainer``, ``.state``, ``.config``, ``.hf_config``, ``.save()``.

    Example:
      >>> run = sk.from_pretrained("llama-tiny/", layout="fsdp=8")  # doctest: +SKIP
      >>> state, metrics = run.trainer.step(run.state, run.trainer.shard_batch(batch))  # doctest: +SKIP
      >>> run.save(state.params, "llama-tiny-tuned/")  # doctest: +SKIP
    """
    if adapter is not None and lora is not None:
        raise InputError("from_pretrained: give adapter= (one peft saved) or lora= (new adapters), not both.")
    if lora is not None and not isinstance(lora, LoRA):
        raise InputError(f"from_pretrained: lora={short_repr(lora)} must be a shardkit.models.LoRA.")
    hf_config = hf.read_config(path)
    model_options = {k: options.pop(k) for k in _MODEL_FIELDS if k in options}
    if adapter is not None:
        lora = peft.read_lora(adapter)
    cfg: GPTConfig = hf.gpt_config(hf_config, **model_options, lora=lora)
    if balance_rate:
        if not cfg.router.score_bias:
            raise ModelError(
                f"from_pretrained: balance_rate={balance_rate} moves a router's score bias, and this "
                f"{hf_config.get('model_type')} checkpoint's router has none (DeepSeek-V3's e_score_correction_bias). "
                "Fix: drop balance_rate; balance with aux_loss_weight."
            )
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, balance_rate=balance_rate))
    model = cfg.model(name=str(hf_config.get("model_type", "GPT")))
    trainer = Trainer(model, optimizer if optimizer is not None else optax.adamw(1e-5), layout, **options)
    params = peft.load_with_adapters(path, cfg, model, trainer.state_shardings.params, seed, adapter, drop_mtp)
    return Pretrained(trainer, trainer.init(seed, params=params), cfg, hf_config, str(path))
