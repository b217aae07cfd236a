"""shardkit: train Flax models across many accelerators with JAX SPMD sharding.

The public API, all of it re-exported here::

    import shardkit as sk
    sk.simulate_devices(8)
    trainer = sk.Trainer(sk.from_nnx(lambda rngs: sk.models.GPT(cfg, rngs=rngs)),
                         optax.adamw(1e-3), layout="data=2,fsdp=2,tensor=2")
"""

from shardkit import checkpoint, distributed, hardware, hlo, models, parallel, report, rules
from shardkit.checkpoint import Checkpointer
from shardkit.data import TextDataset, builtin_corpus, load_text
from shardkit.devices import simulate_devices
from shardkit.dryrun import DryRunConfig, dryrun
from shardkit.errors import ShardkitError
from shardkit.hardware import Hardware
from shardkit.mesh import MESH_AXES, Layout
from shardkit.model import Model, annotate, from_functions, from_linen, from_nnx
from shardkit.partition import Axes, constrain, logical, use_sharding
from shardkit.plan import PlanOptions, plan
from shardkit.precision import Precision
from shardkit.report import Report
from shardkit.rules import LOGICAL_AXES, Rules, default_rules
from shardkit.train import NonFiniteError, Trainer, TrainState, mse_loss, next_token_loss

__version__ = "0.1.0"

__all__ = [
    "LOGICAL_AXES",
    "MESH_AXES",
    "Axes",
    "Checkpointer",
    "DryRunConfig",
    "Hardware",
    "Layout",
    "Model",
    "NonFiniteError",
    "PlanOptions",
    "Precision",
    "Report",
    "Rules",
    "ShardkitError",
    "TextDataset",
    "TrainState",
    "Trainer",
    "annotate",
    "builtin_corpus",
    "checkpoint",
    "constrain",
    "default_rules",
    "distributed",
    "dryrun",
    "from_functions",
    "from_linen",
    "from_nnx",
    "hardware",
    "hlo",
    "load_text",
    "logical",
    "models",
    "mse_loss",
    "next_token_loss",
    "parallel",
    "plan",
    "report",
    "rules",
    "simulate_devices",
    "use_sharding",
]
