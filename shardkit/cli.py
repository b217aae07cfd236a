"""``shardkit`` command line: ``shardkit train [...]``.

With no GPU present, JAX runs on ``--devices`` (default 8) simulated CPU devices.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

DEFAULT_SIMULATED_DEVICES = 8


def _use_simulated_devices_if_no_accelerator(n: int) -> None:
    """Ask for ``n`` CPU devices before JAX starts; a GPU/TPU, if present, still wins."""
    import jax

    # Only the CPU backend reads this option, so it is harmless where an accelerator is present.
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", n)


def _train_parser(sub: argparse._SubParsersAction) -> None:
    from shardkit.run import OPTIMIZERS, TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train", help="train the reference GPT on text (built-in corpus by default)")
    p.add_argument("--layout", default=d.layout, help=f"mesh axis sizes (default {d.layout}); -1 fills the rest")
    p.add_argument("--model", default=d.model, help=f"GPT preset (default {d.model})")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch, help="global batch size (sequences per step)")
    p.add_argument("--seq", type=int, default=d.seq, help="sequence length")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=d.optimizer)
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data", default=None, help="a text file (or directory of *.txt) instead of the built-in corpus")
    p.add_argument("--json-log", default=None, help="write one JSON object per step to this file")
    p.add_argument("--sample-tokens", type=int, default=d.sample_tokens, help="tokens to generate at the end")
    p.add_argument("--prompt", default=d.prompt)
    p.add_argument(
        "--devices",
        type=int,
        default=DEFAULT_SIMULATED_DEVICES,
        help="simulated CPU devices when no GPU is present (default 8)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardkit", description="Train Flax models with JAX SPMD sharding.")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    args = parser.parse_args(argv)

    from shardkit.errors import ShardkitError

    try:
        if args.command == "train":
            _use_simulated_devices_if_no_accelerator(args.devices)
            from shardkit.run import TrainConfig, train

            cfg = TrainConfig(
                model=args.model,
                layout=args.layout,
                steps=args.steps,
                batch=args.batch,
                seq=args.seq,
                lr=args.lr,
                optimizer=args.optimizer,
                dropout=args.dropout,
                seed=args.seed,
                data=args.data,
                json_log=args.json_log,
                sample_tokens=args.sample_tokens,
                prompt=args.prompt,
            )
            train(cfg)
    except ShardkitError as e:
        print(f"shardkit: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
