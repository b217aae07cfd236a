"""What a run reports while it trains: JSON lines, TensorBoard scalars, held-out evaluations,
profiles and MFU. :func:`shardkit.cli.run.train` calls these; none of them changes what is trained."""

from __future__ import annotations

import json
import pathlib
from typing import Any, TextIO

import jax

from shardkit.analysis.hardware import profile_of_device
from shardkit.core.config import TrainConfig
from shardkit.core.precision import as_precision
from shardkit.io.data import TextDataset
from shardkit.io.tensorboard import Scalars
from shardkit.models.model import model_facts
from shardkit.training.train import Trainer


def mfu(model: Any, cfg: TrainConfig, tokens_per_second: float, devices: int) -> float | None:
    """Model FLOPs utilisation at the device's published peak (6N FLOPs per token plus attention,
    PaLM's count); None where there is no published peak (a CPU)."""
    profile = profile_of_device(jax.devices()[0].device_kind)
    if profile is None:
        return None
    facts = model_facts(model)
    per_token = 6 * facts["matmul_params"] + 12 * facts["layers"] * facts["dim"] * cfg.seq
    dtype = jax.numpy.dtype(as_precision(cfg.precision).compute).name
    return per_token * tokens_per_second / (devices * profile.peak_flops(dtype))


def mfu_text(model: Any, cfg: TrainConfig, tokens_per_second: float, devices: int) -> str:
    """``MFU 0.41 (h100 peak)``, or why there is none: a CPU has no published peak."""
    device = jax.devices()[0]
    value = mfu(model, cfg, tokens_per_second, devices)
    if value is None:
        return f"MFU n/a ({device.platform} has no published peak; benchmarks/mfu.py measures one)"
    profile = profile_of_device(device.device_kind)
    return f"MFU {value:.2f} ({profile.name if profile else device.device_kind} peak)"


def board_values(
    cfg: TrainConfig,
    trainer: Trainer,
    step: int,
    loss: float,
    metrics: Any,
    seconds: float,
    batch: Any,
    learning_rate: float,
) -> dict[str, float | None]:
    """The TensorBoard scalars of step ``step`` (1-based)."""
    tokens_per_s = cfg.batch * cfg.seq / seconds
    values: dict[str, float | None] = {
        "train/loss": loss,
        "train/learning_rate": learning_rate,
        "train/grad_norm": float(metrics["grad_norm"]),
        "train/tokens_per_s": tokens_per_s,
        "train/mfu": mfu(trainer.model, cfg, tokens_per_s, trainer.mesh.devices.size),
    }
    values |= {f"experts/{k}": float(metrics[k]) for k in EXPERT_METRICS if k in metrics}
    if step == 1:  # the compiled step's state and temporaries per device, once
        memory = trainer.compile(batch).memory_analysis()
        if memory is not None:
            values["memory/per_device_mib"] = (memory.argument_size_in_bytes + memory.temp_size_in_bytes) / 2**20
    return values


# A mixture of experts' step metrics (shardkit.training.steps.load_metrics), logged as they come.
EXPERT_METRICS = ("expert_tokens_min", "expert_tokens_max", "dropped_fraction")


def open_json_log(path: pathlib.Path, first_step: int) -> TextIO:
    """The step log, opened for this run: after a resume from step N it keeps steps 1..N of the
    earlier run and drops later ones, so each step appears once."""
    if first_step and path.is_file():
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= first_step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a kill mid-write
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)
        return path.open("a")
    return path.open("w")


class Profiler:
    """A ``jax.profiler`` trace of the steps in ``steps`` (0-based), written to ``directory``."""

    def __init__(self, steps: range, directory: str, out: TextIO):
        self.steps, self.directory, self.out, self.active = steps, directory, out, False

    def before(self, step: int) -> None:
        if self.steps and step == self.steps.start:
            jax.profiler.start_trace(self.directory)
            self.active = True

    def after(self, step: int) -> None:
        if self.active and step + 1 == self.steps.stop:
            self.close()
            first, last = self.steps.start + 1, self.steps.stop  # as the progress line numbers them
            which = f"step {first}" if first == last else f"steps {first} to {last}"
            print(f"profile of {which} (--profile-steps {self.steps.start}:{last}) in {self.directory}", file=self.out)

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


HELD_OUT = 0.05  # the fraction of the text kept for evaluation when --eval-every is set


def evaluate_held_out(cfg: TrainConfig, trainer: Trainer, held_out: TextDataset, params: Any) -> float:
    """Mean loss over ``cfg.eval_batches`` fixed batches of the held-out text (each process reads
    its rows), weighted by the tokens each scored."""
    rows, total, tokens = trainer.local_rows(cfg.batch), 0.0, 0
    for i in range(cfg.eval_batches):
        result = trainer.evaluate(params, trainer.shard_batch(held_out.batch(i, cfg.batch, cfg.seq, rows=rows)))
        count = int(result["tokens"])
        total, tokens = total + float(result["loss"]) * count, tokens + count
    return total / max(tokens, 1)


def log_step(
    cfg: TrainConfig,
    trainer: Trainer,
    sinks: tuple[TextIO | None, Scalars | None],
    step: int,
    loss: float,
    metrics: Any,
    seconds: float,
    batch: Any,
    evaluated: dict[str, float],
    learning_rate: float,
) -> None:
    """Step ``step``'s JSON line and TensorBoard scalars (with its held-out loss when evaluated)."""
    log, board = sinks
    if log is not None:
        record = {"step": step, "loss": loss, "tokens_per_s": cfg.batch * cfg.seq / seconds}
        record |= {"grad_norm": float(metrics["grad_norm"]), "seconds": seconds, **evaluated}
        record |= {k: float(metrics[k]) for k in EXPERT_METRICS if k in metrics}  # a mixture of experts' load
        log.write(json.dumps(record) + "\n")
        log.flush()
    if board is not None:
        values = board_values(cfg, trainer, step, loss, metrics, seconds, batch, learning_rate)
        values |= {"eval/loss": evaluated.get("eval_loss"), "eval/perplexity": evaluated.get("eval_perplexity")}
        board.write(step, values)
