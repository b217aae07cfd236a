"""``shardkit`` command line: ``shardkit train [...]``.

With no GPU present, JAX runs on ``--devices`` (default 8) simulated CPU devices.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from shardkit import __version__
from shardkit.config import LR_SCHEDULES, OPTIMIZER_NAMES, PRECISION_NAMES, TrainConfig
from shardkit.parallel.schedule import SCHEDULES

DEFAULT_SIMULATED_DEVICES = 8


# Names other training tools use for shardkit's flags.
OTHER_NAMES = {
    "--learning-rate": "--lr",
    "--learning_rate": "--lr",
    "--batch-size": "--batch",
    "--batch_size": "--batch",
    "--global-batch-size": "--batch",
    "--seq-len": "--seq",
    "--seq_len": "--seq",
    "--max-seq-len": "--seq",
    "--max-steps": "--steps",
    "--max_steps": "--steps",
    "--num-steps": "--steps",
    "--output-dir": "--checkpoint-dir",
    "--save-dir": "--checkpoint-dir",
    "--mesh": "--layout",
    "--grad-accum": "--microbatches",
    "--gradient-accumulation-steps": "--microbatches",
    "--dtype": "--precision",
}


class SuggestingParser(argparse.ArgumentParser):
    """argparse, plus "did you mean" for a misspelt flag or subcommand."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: object = None) -> argparse.Namespace:
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)  # type: ignore[arg-type]

    def _all_options(self) -> set[str]:
        """The flags of the subcommand on the command line (of every subcommand if none)."""
        options = set(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                named = [a for a in getattr(self, "_argv", []) if a in action.choices]
                for name, sub in action.choices.items():
                    if not named or name == named[0]:
                        options |= set(sub._option_string_actions)
        return options

    def error(self, message: str) -> NoReturn:
        import difflib

        hints = []
        if message.startswith("unrecognized arguments:"):
            for token in message.split(":", 1)[1].split():
                flag = token.split("=", 1)[0]
                if flag in OTHER_NAMES:
                    hints.append(f"{flag}: shardkit calls it {OTHER_NAMES[flag]}")
                elif flag.startswith("-"):
                    close = difflib.get_close_matches(flag, sorted(self._all_options()), n=1, cutoff=0.6)
                    if close:
                        hints.append(f"{flag}: did you mean {close[0]}?")
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            options = re.findall(r"'?([\w.-]+)'?", choice.group(2))
            close = difflib.get_close_matches(choice.group(1), options, n=1, cutoff=0.6)
            if close:
                hints.append(f"did you mean '{close[0]}'?")
        super().error(message + "".join(f"\n  {h}" for h in hints))


def _check_device_count(n: int) -> None:
    from shardkit.errors import ShardkitError

    if n < 1:
        raise ShardkitError(f"--devices {n}: simulate at least 1 device (default {DEFAULT_SIMULATED_DEVICES}).")


def _devices_for(layout: str, devices: int | None) -> int:
    """``--devices``, or by default the layout's device count (8 when it has a -1)."""
    if devices is not None:
        return devices
    from shardkit.mesh import Layout

    parsed = Layout.parse(layout)
    return DEFAULT_SIMULATED_DEVICES if any(s == -1 for _, s in parsed.sizes) else parsed.num_devices


def _use_simulated_devices_if_no_accelerator(n: int) -> None:
    """Ask for ``n`` CPU devices before JAX starts; a GPU/TPU, if present, still wins."""
    _check_device_count(n)
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():  # called in-process (a notebook, a test): devices are set
        return
    from shardkit.devices import ask_for_cpu_devices

    ask_for_cpu_devices(n)  # not started yet: jax.distributed may still need to initialize first


def _simulate_exactly(n: int) -> None:
    """Plans are compiled for simulated CPU devices, whatever hardware this machine has."""
    _check_device_count(n)
    from shardkit.devices import simulate_devices

    simulate_devices(n)


class DefaultsHelp(argparse.HelpFormatter):
    """Shows each flag's default, unless its help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


EXAMPLES = {
    "train": "example: shardkit train --model tiny --layout fsdp=8 --steps 100 --run-dir runs/tiny",
    "dryrun": "example: shardkit dryrun --model llama2-70b --layout fsdp=64,tensor=8 --batch 512 --seq 4096 "
    "--precision bf16-master --remat full --hardware h100",
    "inspect": "example: shardkit inspect --model tiny --layout data=2,fsdp=2,tensor=2",
    "plan": "example: shardkit plan --model llama2-7b --devices 64 --hardware h100 --batch 256 --seq 4096",
    "launch": "example: shardkit launch --nproc 2 -- shardkit train --layout data=2,fsdp=2,tensor=2 --steps 50",
}


def _shared_flags() -> dict[str, dict[str, object]]:
    """Flags that several subcommands take: one name, one meaning, one help, one default (the
    main job's, :class:`TrainConfig`), wherever they appear."""
    d = TrainConfig()
    return {
        "--model": dict(
            default=d.model,
            help="a GPT preset (tiny, mini, gpt2-small, ..., llama2-70b, mixtral-8x7b); dryrun, inspect and plan "
            "also take your own factory as package.module:function",
        ),
        "--layout": dict(default=d.layout, help="mesh axis sizes, e.g. data=2,fsdp=-1,tensor=2 (-1 fills the rest)"),
        "--batch": dict(type=int, default=d.batch, help="global batch (sequences per step)"),
        "--seq": dict(type=int, default=d.seq, help="sequence length (tokens the model sees per sequence)"),
        "--precision": dict(choices=PRECISION_NAMES, default=d.precision, help="mixed-precision policy"),
        "--microbatches": dict(
            type=int,
            default=d.microbatches,
            help="gradient accumulation steps; with stage>1, the microbatches in the pipeline",
        ),
        "--schedule": dict(choices=SCHEDULES, default=d.schedule, help="pipeline schedule with stage>1 (default 1f1b)"),
        "--virtual-stages": dict(type=int, default=d.virtual_stages, help="interleaved pipeline stages per device"),
        "--remat": dict(default=d.remat, help="rematerialisation per layer: none, full, dots, dots_no_batch"),
        "--hardware": dict(
            default="h100",
            help="the device to plan for: h100, h200, a100, tpu-v5p, tpu-v5e, or a JSON profile (dryrun says "
            "whether the step fits one; plan ranks layouts on it)",
        ),
        "--devices": dict(
            type=int,
            default=None,
            help="device count, simulated on CPU where no GPU is present (default: the layout's count; "
            f"{DEFAULT_SIMULATED_DEVICES} when it has a -1)",
        ),
    }


# The shared flags that describe one training run (all but --hardware).
RUN_FLAGS = (
    "--model",
    "--layout",
    "--batch",
    "--seq",
    "--precision",
    "--microbatches",
    "--schedule",
    "--virtual-stages",
    "--remat",
    "--devices",
)


def _add_shared(p: argparse.ArgumentParser, *names: str, **overrides: dict[str, object]) -> None:
    shared = _shared_flags()
    for name in names:
        p.add_argument(name, **{**shared[name], **overrides.get(name.lstrip("-").replace("-", "_"), {})})


def _subcommand(sub: argparse._SubParsersAction, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand whose help shows the defaults and ends with an example."""
    return sub.add_parser(name, help=summary, epilog=EXAMPLES[name], formatter_class=DefaultsHelp)


def _train_parser(sub: argparse._SubParsersAction) -> None:
    d = TrainConfig()
    p = _subcommand(sub, "train", "train the reference GPT on text (built-in corpus by default)")
    _add_shared(p, *RUN_FLAGS)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--optimizer", choices=OPTIMIZER_NAMES, default=d.optimizer)
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data", default=None, help="a text file (or directory of *.txt) instead of the built-in corpus")
    p.add_argument("--json-log", default=None, help="write one JSON object per step to this file")
    p.add_argument("--sample-tokens", type=int, default=d.sample_tokens, help="tokens to generate at the end")
    p.add_argument("--prompt", default=d.prompt)
    p.add_argument(
        "--nonfinite",
        choices=["skip", "halt"],
        default=d.nonfinite,
        help="a step with NaN/Inf is skipped or stops the run",
    )
    p.add_argument(
        "--checkpoint-dir", default=None, help="save checkpoints here and resume from the newest one (under any layout)"
    )
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    p.add_argument("--reset-optimizer", action="store_true", help="resume the parameters with a fresh optimizer state")
    p.add_argument(
        "--allow-schedule-change",
        action="store_true",
        help="resume although the schedule (--lr, --warmup, --weight-decay, --lr-schedule, --clip, --b2, --steps, "
        "--optimizer) differs from the checkpoint's",
    )
    p.add_argument(
        "--run-dir",
        default=None,
        help="one directory per run: config.json, checkpoints/ and log.jsonl; run again to resume",
    )
    p.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="KEY",
        help="with --run-dir: resume although this setting changed (e.g. lr, steps, batch); repeatable",
    )
    p.add_argument("--overwrite", action="store_true", help="with --run-dir: start the run over")
    p.add_argument("--warmup", type=int, default=d.warmup, help="learning-rate warmup steps")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    p.add_argument(
        "--lr-schedule",
        choices=LR_SCHEDULES,
        default=d.lr_schedule,
        help="after the warmup: cosine decay to lr/10 at the last step, or constant",
    )
    p.add_argument("--clip", type=float, default=d.clip, help="clip gradients to this global norm (0: off)")
    p.add_argument("--b2", type=float, default=d.b2, help="AdamW's second-moment decay")
    p.add_argument(
        "--max-skips",
        type=int,
        default=d.max_skips,
        help=f"non-finite steps skipped in a row that stop the run (default {d.max_skips}; 0: never)",
    )
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism on the tensor axis")


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `dryrun` and `inspect`: the shared ones, and two for compile-time studies."""
    _add_shared(p, *RUN_FLAGS)
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument("--unrolled", action="store_true", help="unroll the layer stack instead of scanning it")


def _dryrun_config(args: argparse.Namespace):
    from shardkit.dryrun import DryRunConfig

    return DryRunConfig(
        model=args.model,
        layout=args.layout,
        batch=args.batch,
        seq=args.seq,
        precision=args.precision,
        microbatches=args.microbatches,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        remat=args.remat,
        scan_layers=not args.unrolled,
        n_layers=args.layers,
        devices=args.devices,
    )


def _inspect(args: argparse.Namespace) -> None:
    from shardkit.dryrun import trainer_for
    from shardkit.report import sharding_warnings

    trainer, batch = trainer_for(_dryrun_config(args))
    if args.json:  # the same facts for a program: the table's rows, the report, the warnings
        import json

        report = trainer.report(batch)
        out = {
            "model": trainer.model.name,
            "layout": trainer.layout.spec(),
            "parameters": trainer.sharding_table(),
            "report": report.to_dict(),
            "warnings": sharding_warnings(trainer),
        }
        print(json.dumps(out, default=str))
        return
    print(f"{trainer.model.name}: parameters and their shardings (layout {trainer.layout.spec()})")
    print(trainer.format_sharding_table())
    print()
    print(trainer.report(batch).table())
    warnings = sharding_warnings(trainer)
    for w in warnings:
        print(f"warning: {w}")
    if not warnings:
        print("no warnings")


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's flags; building it imports no JAX (``shardkit --help`` answers at once)."""
    parser = SuggestingParser(prog="shardkit", description="Train Flax models with JAX SPMD sharding.")
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    dry = _subcommand(sub, "dryrun", "compile a train step for N simulated devices; print memory and collectives")
    _plan_arguments(dry)
    dry.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_shared(dry, "--hardware")
    ins = _subcommand(sub, "inspect", "per-parameter shardings, collectives, memory and warnings")
    _plan_arguments(ins)
    ins.add_argument("--json", action="store_true", help="print the result as JSON")
    pln = _subcommand(sub, "plan", "rank layouts for a model on N devices of some hardware")
    # The planner is asked about a size, so the device count and the batch shape have no default;
    # it plans for accelerators, so its precision default is bf16 with fp32 master weights.
    _add_shared(
        pln,
        "--model",
        "--devices",
        "--batch",
        "--seq",
        "--precision",
        "--schedule",
        devices={"required": True},
        batch={"required": True},
        seq={"required": True},
        precision={"default": "bf16-master"},
    )
    _add_shared(pln, "--hardware")
    pln.add_argument("--remat-options", default="none,full", help="remat policies to try, cheapest first")
    pln.add_argument("--microbatch-options", default="1,2,4,8,16", help="microbatch counts to try, fewest first")
    pln.add_argument("--tensor", default=None, help="tensor sizes to consider (default: powers of 2 in a node)")
    pln.add_argument("--sequence", default=None, help="sequence (ring attention) sizes to consider (default 1,2,4,8)")
    pln.add_argument("--stage", default=None, help="pipeline stage counts to consider (default 1,2,4,8)")
    pln.add_argument("--expert", default=None, help="expert sizes to consider (default: divisors of the experts)")
    pln.add_argument(
        "--compile-top",
        type=int,
        default=6,
        help="compile this many layouts, the fastest by the analytic estimate (0: all of them)",
    )
    pln.add_argument("--workers", type=int, default=None, help="processes compiling at once (default: one per core)")
    pln.add_argument("--json", action="store_true", help="print the result as JSON")
    lau = _subcommand(sub, "launch", "start P processes of a command on this machine (jax.distributed)")
    lau.add_argument("--nproc", type=int, required=True, help="number of processes (on this node)")
    lau.add_argument("--nnodes", type=int, default=1, help="nodes in the job (run the launcher on each)")
    lau.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0..nnodes-1")
    lau.add_argument("--coordinator", default=None, help="host:port of node 0 (required with --nnodes > 1)")
    lau.add_argument("--verbose", action="store_true", help="keep Gloo's connection messages")
    lau.add_argument("--devices-per-proc", type=int, default=None, help="simulated CPU devices per process")
    lau.add_argument("--port", type=int, default=None, help="the coordinator's port (default: a free one)")
    lau.add_argument(
        "--grace", type=float, default=10.0, help="seconds workers get to exit after a failure or a signal"
    )
    lau.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    from shardkit.errors import ShardkitError

    try:
        if args.command == "launch":
            from shardkit.launch import launch

            command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            return launch(
                command,
                args.nproc,
                args.devices_per_proc,
                port=args.port,
                nnodes=args.nnodes,
                node_rank=args.node_rank,
                coordinator=args.coordinator,
                grace_s=args.grace,
                verbose=args.verbose,
            )
        if args.command == "train":
            from shardkit import distributed

            if distributed.initialize() is None:  # joins the other processes when launched as several
                _use_simulated_devices_if_no_accelerator(_devices_for(args.layout, args.devices))
            import dataclasses

            from shardkit.run import train

            # Every TrainConfig field is a flag of the same name: the config is declared once.
            cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
            result = train(cfg)
            if "stopped_by" in result:  # SIGTERM/SIGINT: saved and stopped, exit as if killed by it
                return 128 + int(result["stopped_by"])
        elif args.command == "plan":
            from shardkit.plan import run_cli as plan_cli

            _check_device_count(args.devices)  # JAX is not started here: the planner compiles in worker processes
            plan_cli(args)
        elif args.command in ("dryrun", "inspect"):
            cfg = _dryrun_config(args)
            _simulate_exactly(cfg.num_devices())
            if args.command == "dryrun":
                from shardkit.dryrun import run_cli
                from shardkit.hardware import get_hardware

                get_hardware(args.hardware)  # an unknown name is refused before the compile
                run_cli(cfg, args.json, args.hardware)
            else:
                _inspect(args)
    except ShardkitError as e:
        print(f"shardkit: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
