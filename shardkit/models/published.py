"""Model configs of real sizes, shipped without weights, so a laptop can dry-run and plan them.

``shardkit dryrun --init-from llama-3.1-70b`` and ``shardkit plan --init-from ...`` read a
Hugging Face ``config.json`` and need no weights; these are the configs of the models people
fine-tune and pretrain, written from each family's published numbers (the model cards' configs;
for Gemma 3 27B the text decoder of the published model, its vision tower left out):

==============  ======================  =========================================
name            family (``model_type``)  parameters (``GPTConfig.num_params()``)
==============  ======================  =========================================
llama-3.1-8b    llama                   8.03B
llama-3.1-70b   llama                   70.55B
llama-3.1-405b  llama                   405.85B
mixtral-8x7b    mixtral                 46.70B
qwen3-32b       qwen3                   32.76B
gemma-3-27b     gemma3_text             27.01B
qwen3-30b-a3b   qwen3_moe               30.53B
qwen3-235b-a22b qwen3_moe               235.09B
gpt-oss-20b     gpt_oss                 20.91B (experts dequantized: no MXFP4)
gpt-oss-120b    gpt_oss                 116.83B (experts dequantized: no MXFP4)
deepseek-v3     deepseek_v3             671.03B (684.5B with its multi-token-prediction layer,
                                        which shardkit does not train)
kimi-k2         deepseek_v3             1,026.41B (Moonshot's file says ``kimi_k2``, the
                                        DeepSeek-V3 architecture; no FP8 quantization)
==============  ======================  =========================================

A directory of your own (a checkpoint's, or one holding only its ``config.json``) takes
precedence over a name here.

Example:
  >>> from shardkit.models import published
  >>> published.config_dir("llama-3.1-70b").name
  'llama-3.1-70b'
"""

from __future__ import annotations

import os
import pathlib

from shardkit.core.errors import CheckpointError

ROOT = pathlib.Path(__file__).parent / "published"
CONFIG = "config.json"


def names() -> tuple[str, ...]:
    """The shipped configs' names, sorted."""
    return tuple(sorted(p.name for p in ROOT.iterdir() if (p / CONFIG).is_file()))


def config_dir(source: str | os.PathLike[str]) -> pathlib.Path:
    """The directory whose ``config.json`` ``source`` names: ``source`` itself when it holds one,
    else the shipped config of that name.

    Raises:
      CheckpointError: neither, naming the shipped configs.
    """
    path = pathlib.Path(source)
    if (path / CONFIG).is_file():
        return path
    if str(source) in names():
        return ROOT / str(source)
    raise CheckpointError(
        f"--init-from {source}: no {CONFIG} there, and no shipped config of that name. Fix: a Hugging Face model "
        f"directory (its {CONFIG} is enough for dryrun and plan), or one of {', '.join(names())}."
    )
