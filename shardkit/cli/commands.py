"""``shardkit`` command line: ``shardkit train [...]``.

With no GPU present, JAX runs on ``--devices`` (default 8) simulated CPU devices.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from shardkit import __version__
from shardkit.core.config import DryRunSettings, PlanOptions, TrainConfig
from shardkit.core.errors import InputError, LayoutError, ShardkitError
from shardkit.core.flags import add_flags, config_from, file_values

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

    def parse_args(  # type: ignore[override]  # argparse's overloads; this one takes no namespace
        self, args: Sequence[str] | None = None
    ) -> argparse.Namespace:
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args)

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
    if n < 1:
        raise InputError(f"--devices {n}: simulate at least 1 device (default {DEFAULT_SIMULATED_DEVICES}).")


def _devices_for(layout: str, devices: int | None) -> int:
    """``--devices``, or by default the layout's device count (8 when it has a -1)."""
    if devices is not None:
        return devices
    if layout == "auto":  # the planner places the run on the devices there are
        return DEFAULT_SIMULATED_DEVICES
    from shardkit.core.mesh import Layout

    parsed = Layout.parse(layout)
    return DEFAULT_SIMULATED_DEVICES if any(s == -1 for _, s in parsed.sizes) else parsed.num_devices


def _use_simulated_devices_if_no_accelerator(n: int) -> None:
    """Ask for ``n`` CPU devices before JAX starts; a GPU/TPU, if present, still wins."""
    _check_device_count(n)
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():  # called in-process (a notebook, a test): devices are set
        return
    from shardkit.runtime.devices import ask_for_cpu_devices

    ask_for_cpu_devices(n)  # not started yet: jax.distributed may still need to initialize first


def _simulate_exactly(n: int) -> None:
    """Plans are compiled for simulated CPU devices, whatever hardware this machine has."""
    _check_device_count(n)
    from shardkit.runtime.devices import simulate_devices

    simulate_devices(n)


class DefaultsHelp(argparse.HelpFormatter):
    """Shows each flag's default, unless its help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # A switch's default is that it is off: a store_false switch (--unrolled) defaults to its
        # field's True, which is not what the flag does unless given.
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if switch or "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


EXAMPLES = {
    "train": "example: shardkit train --model tiny --layout fsdp=8 --steps 100 --run-dir runs/tiny",
    "dryrun": "example: shardkit dryrun --model llama2-70b --layout fsdp=64,tensor=8 --batch 512 --seq 4096 "
    "--precision bf16-master --remat full --hardware h100",
    "inspect": "example: shardkit inspect --model tiny --layout data=2,fsdp=2,tensor=2",
    "plan": "example: shardkit plan --model llama2-7b --devices 64 --hardware h100 --batch 256 --seq 4096",
    "launch": "example: shardkit launch --nproc 2 -- shardkit train --layout data=2,fsdp=2,tensor=2 --steps 50",
    "export": "example: shardkit export --model tiny --checkpoint-dir runs/tiny/checkpoints --out tiny-hf",
    "tokenizer": "example: shardkit tokenizer train --vocab 1024 --out tokenizer.json",
    "eval": "example: shardkit eval --model tiny --checkpoint runs/tiny/checkpoints --eval-batches 8",
    "generate": "example: shardkit generate --init-from llama-tiny/ --prompt 'Once upon a time' --max-new-tokens 64 "
    "--temperature 0.7 --top-p 0.9",
}


# The flags that name a saved run's model and checkpoints (export, eval).
SAVED_RUN = ("model", "init_from", "lora_rank", "lora_alpha", "lora_targets", "adapter", "tokenizer", "checkpoint_dir")
REQUIRED_CHECKPOINT = {"checkpoint_dir": {"required": True, "aliases": ("--checkpoint",)}}
# The commands whose settings are one config dataclass, and so also come from --config FILE key=value.
CONFIGS = {"train": TrainConfig, "dryrun": DryRunSettings, "inspect": DryRunSettings}


# Short usage lines: an error message names the bad flag, --help lists them all (train has ~70).
USAGE = {
    "launch": "%(prog)s --nproc N [options] -- COMMAND ...",
    **{name: "%(prog)s [options] [key=value ...]" for name in CONFIGS},
}


def _subcommand(sub: argparse._SubParsersAction, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand whose help shows the defaults and ends with an example."""
    usage = USAGE.get(name, "%(prog)s [options]")
    return sub.add_parser(name, help=summary, epilog=EXAMPLES[name], formatter_class=DefaultsHelp, usage=usage)


def _config_flags(p: argparse.ArgumentParser, cls: type, defaults: Mapping[str, Any]) -> None:
    """The flags of ``cls``'s fields, ``--config FILE`` and ``key=value`` overrides; values read
    from the file and the overrides are the defaults, so a flag on the command line wins."""
    add_flags(p, cls)
    p.add_argument("--config", default=None, metavar="FILE", help="a TOML file of settings (key = value per line)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="settings that override the --config file")
    p.set_defaults(**defaults)


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    p = _subcommand(sub, "plan", "rank layouts for a model on N devices of some hardware")
    # The planner is asked about a size, so the device count and the batch shape have no default.
    add_flags(
        p,
        TrainConfig,
        only=("model", "devices", "batch", "seq"),
        overrides={"devices": {"required": True}, "batch": {"required": True}, "seq": {"required": True}},
    )
    add_flags(p, DryRunSettings, only=("init_from",))
    add_flags(p, TrainConfig, only=("hardware",))
    add_flags(p, PlanOptions)
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _launch_parser(sub: argparse._SubParsersAction) -> None:
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


def _export_parser(sub: argparse._SubParsersAction) -> None:
    exp = _subcommand(sub, "export", "write a training checkpoint's weights as a Hugging Face checkpoint")
    add_flags(exp, TrainConfig, only=SAVED_RUN, overrides=REQUIRED_CHECKPOINT)
    exp.add_argument("--out", required=True, help="the directory to create (config.json + *.safetensors)")
    exp.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest that verifies)")
    exp.add_argument(
        "--format", choices=("hf",), default="hf", help="hf: Hugging Face safetensors, loadable as Llama/Qwen2"
    )
    exp.add_argument(
        "--adapter-only",
        action="store_true",
        help="write the run's LoRA adapter alone, in peft's format (default: the weights, adapters merged)",
    )


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    ev = _subcommand(sub, "eval", "held-out loss and perplexity of a saved training run")
    only = (*SAVED_RUN, "layout", "devices", "batch", "seq", "eval_batches", "data", "seed")
    add_flags(ev, TrainConfig, only=only, overrides=REQUIRED_CHECKPOINT)
    ev.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest that verifies)")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = _subcommand(sub, "generate", "continue text with a checkpoint or a saved run (KV cache, batched)")
    # --prompt is the one of `train`'s sample: its continuation is printed as it is produced.
    add_flags(gen, TrainConfig, only=(*SAVED_RUN, "devices", "seed", "prompt"))
    gen.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest that verifies)")
    gen.add_argument(
        "--prompts",
        default=None,
        metavar="FILE.jsonl",
        help='prompts, one {"prompt": "..."} a line (instead of --prompt)',
    )
    gen.add_argument("--max-new-tokens", type=int, required=True, help="new tokens per prompt (>= 1)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else the softmax temperature")
    gen.add_argument("--top-k", type=int, default=None, help="draw from the k likeliest tokens only")
    gen.add_argument("--top-p", type=float, default=None, help="draw from the likeliest tokens of probability p")
    gen.add_argument(
        "--layout",
        dest="gen_layout",
        default=None,
        help="generation's layout, e.g. data=2,tensor=2 (default: one device)",
    )
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at the checkpoint's eos_token_id")


def _tokenizer_parser(sub: argparse._SubParsersAction) -> None:
    tok = _subcommand(sub, "tokenizer", "train a byte-level BPE tokenizer (tokenizer.json) on text")
    actions = tok.add_subparsers(dest="action", required=True)
    train = actions.add_parser("train", help="learn BPE merges from the text", formatter_class=DefaultsHelp)
    train.add_argument("--vocab", type=int, required=True, help="tokens in the vocabulary (>= 256)")
    train.add_argument("--out", required=True, help="the tokenizer.json to write")
    add_flags(train, TrainConfig, only=("data",))


def _inspect(cfg: Any, as_json: bool) -> None:
    from shardkit.analysis.report import sharding_warnings
    from shardkit.plan.dryrun import trainer_for

    trainer, batch = trainer_for(cfg)
    if as_json:  # the same facts for a program: the table's rows, the report, the warnings
        report = trainer.report(batch, dry_run=True)
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
    print(trainer.report(batch, dry_run=True).table())
    warnings = sharding_warnings(trainer)
    for w in warnings:
        print(f"warning: {w}")
    if not warnings:
        print("no warnings")


def build_parser(file_defaults: Mapping[str, Any] | None = None) -> argparse.ArgumentParser:
    """Every subcommand's flags, generated from the config dataclasses (``file_defaults``: values
    from ``--config``/``key=value`` for the subcommand on the command line). Building it imports no
    JAX (``shardkit --help`` answers at once)."""
    parser = SuggestingParser(prog="shardkit", description="Train Flax models with JAX SPMD sharding.")
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    summaries = {
        "train": "train the reference GPT on text (built-in corpus by default)",
        "dryrun": "compile a train step for N simulated devices; print memory and collectives",
        "inspect": "per-parameter shardings, collectives, memory and warnings",
    }
    for name, cls in CONFIGS.items():
        p = _subcommand(sub, name, summaries[name])
        _config_flags(p, cls, file_defaults or {})
        if name != "train":
            p.add_argument("--json", action="store_true", help="print the result as JSON")
        if name == "dryrun":
            add_flags(p, TrainConfig, only=("hardware",))
    _plan_parser(sub)
    _launch_parser(sub)
    _export_parser(sub)
    _eval_parser(sub)
    _generate_parser(sub)
    _tokenizer_parser(sub)
    return parser


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with ``--config FILE`` and ``key=value`` settings under the flags:
    defaults < file < ``key=value`` < flags."""
    args = build_parser().parse_args(argv)
    cls = CONFIGS.get(args.command)
    if cls is None or (args.config is None and not args.overrides):
        return args
    values = file_values(cls, args.config, args.overrides)
    values = {k: list(v) if k == "allow_change" else v for k, v in values.items()}  # an appending flag
    return build_parser(values).parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``shardkit`` command: parse, run one subcommand, and turn a ``ShardkitError`` into its
    message and exit status 2.

    Returns:
      The exit status (128 + the signal for a run stopped by SIGTERM/SIGINT).
    """
    try:
        if argv is None:  # the command itself, not a call from Python
            from shardkit.runtime.host_allocator import restart_with_huge_pages

            restart_with_huge_pages()  # glibc reads its tunables at start: CPU steps map huge pages
        args = parse(argv)
        return SUBCOMMANDS[args.command](args)
    except ShardkitError as e:
        print(f"shardkit: error: {e}", file=sys.stderr)
        return 2


def _launch(args: argparse.Namespace) -> int:
    from shardkit.runtime.launch import launch

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


def _join_or_simulate(args: argparse.Namespace) -> None:
    """Join the other processes when launched as several; else simulate the layout's devices
    where no accelerator is present."""
    from shardkit.runtime import distributed

    if distributed.initialize() is None:
        _use_simulated_devices_if_no_accelerator(_devices_for(args.layout, args.devices))


def _train(args: argparse.Namespace) -> int:
    from shardkit.runtime.xla_flags import use_overlap_flags

    use_overlap_flags()  # GPUs overlap collectives with compute; the CPU ignores these flags
    _join_or_simulate(args)
    from shardkit.cli.run import train

    result = train(config_from(TrainConfig, args))
    # SIGTERM/SIGINT: saved and stopped, exit as if killed by it
    return 128 + int(result["stopped_by"]) if "stopped_by" in result else 0


def _export(args: argparse.Namespace) -> int:
    from shardkit.cli.saved_run import export_checkpoint

    export_checkpoint(config_from(TrainConfig, args), args.out, args.step, args.adapter_only)
    return 0


def _eval(args: argparse.Namespace) -> int:
    _join_or_simulate(args)
    from shardkit.cli.saved_run import eval_checkpoint

    result = eval_checkpoint(config_from(TrainConfig, args), args.step)
    if args.json:
        print(json.dumps(result))
    return 0


def _generate(args: argparse.Namespace) -> int:
    args.layout = args.gen_layout or "data=1"  # one device unless a layout asks for more
    _join_or_simulate(args)
    from shardkit.cli.generation import run

    run(args, config_from(TrainConfig, args))
    return 0


def _tokenizer(args: argparse.Namespace) -> int:
    from shardkit.io.data import builtin_corpus, load_text
    from shardkit.io.tokenizer import train_bpe

    text = load_text(args.data) if args.data else builtin_corpus()
    tok = train_bpe(text, args.vocab, args.out)
    per = len(tok.encode(text[:100_000].decode("utf-8", errors="replace")).ids) / len(text[:100_000])
    print(f"wrote {args.out}: byte-level BPE, vocab {tok.get_vocab_size()}, {per:.2f} tokens per byte")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from shardkit.plan import run_cli as plan_cli

    _check_device_count(args.devices)  # JAX is not started here: the planner compiles in worker processes
    plan_cli(args)
    return 0


def _dryrun_or_inspect(args: argparse.Namespace) -> int:
    from shardkit.analysis.extrapolate import MAX_COMPILED_DEVICES
    from shardkit.plan.dryrun import DryRunConfig

    cfg = config_from(DryRunConfig, args)
    if cfg.num_devices() > MAX_COMPILED_DEVICES and args.command == "inspect":
        raise LayoutError(
            f"inspect compiles the whole program, at most {MAX_COMPILED_DEVICES} devices on CPU; "
            f"{cfg.layout} has {cfg.num_devices():,}. Fix: shardkit dryrun, which extrapolates past the limit."
        )
    if cfg.num_devices() <= MAX_COMPILED_DEVICES:  # beyond it the dry run compiles in subprocesses
        _simulate_exactly(cfg.num_devices())
    if args.command == "inspect":
        _inspect(cfg, args.json)
        return 0
    from shardkit.analysis.hardware import DEFAULT_HARDWARE, get_hardware
    from shardkit.plan.dryrun import run_cli

    hardware = args.hardware or DEFAULT_HARDWARE
    get_hardware(hardware)  # an unknown name is refused before the compile
    run_cli(cfg, args.json, hardware)
    return 0


# Each subcommand's step: (parsed arguments) -> exit status.
SUBCOMMANDS = {
    "launch": _launch,
    "train": _train,
    "export": _export,
    "eval": _eval,
    "generate": _generate,
    "tokenizer": _tokenizer,
    "plan": _plan,
    "dryrun": _dryrun_or_inspect,
    "inspect": _dryrun_or_inspect,
}


if __name__ == "__main__":
    sys.exit(main())
