"""Reference models, every parameter named by logical axes."""

from shardkit.models.gpt import GPT, GPTConfig
from shardkit.models.mlp import MLP, MLPConfig

__all__ = ["GPT", "MLP", "GPTConfig", "MLPConfig"]
