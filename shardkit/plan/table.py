"""The planner's answer as a table, and the ``shardkit plan`` command."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

from shardkit.analysis.hardware import DEFAULT_HARDWARE
from shardkit.core.errors import InputError
from shardkit.core.flags import config_from
from shardkit.plan.options import PlanInterrupted, PlanOptions, size_text
from shardkit.plan.planner import plan


def format_plans(result: Mapping[str, Any], top: int = 15) -> str:
    """The ranked plans as a table, and the best plan's complete ``shardkit train`` command.

    Compiled plans show the step time their compiled program predicts; the others show the
    analytic estimate in brackets, with why they were not compiled.
    """
    lines = [
        f"{result['model']} on {result['devices']} x {result['hardware']}, batch {result['batch']} x seq "
        f"{result['seq']}, {result['precision']}, {size_text(result['memory_budget'])} per device to fill: "
        f"{result.get('searched', len(result['plans']))} layouts searched, "
        f"{result.get('compiled', '?')} compiled in {result.get('seconds', 0):.0f} s"
        + (" (interrupted: partial table)" if result.get("interrupted") else ""),
        f"{'rank':>4s}  {'layout':28s} {'mb':>3s} {'remat':6s} {'GB/dev':>7s} {'fits':5s} {'step s':>9s} "
        f"{'overlap s':>9s} {'MFU':>5s}  bytes per axis (MB)",
    ]
    for i, p in enumerate(result["plans"][:top], 1):
        if p["predicted_step_seconds"] is not None:
            step = f"{p['predicted_step_seconds']:9.3f}"
        elif p.get("estimated_step_seconds") is not None:
            step = f"{'(' + format(p['estimated_step_seconds'], '.3f') + ')':>9s}"
        else:
            step = f"{'-':>9s}"
        over = (
            f"{p['predicted_step_seconds_overlap']:9.3f}"
            if p["predicted_step_seconds_overlap"] is not None
            else f"{'-':>9s}"
        )
        mfu = f"{p['predicted_mfu']:5.2f}" if p["predicted_mfu"] is not None else f"{'-':>5s}"
        moved = ", ".join(f"{a} {b / 1e6:.1f}" for a, b in sorted(p["bytes_by_axes"].items()) if b)
        detail = moved if p.get("compiled", True) else f"{p['note']}" + (f"; est. {moved}" if moved else "")
        fits = ("yes" if p["fits"] else "no") + ("" if p.get("compiled", True) else "?")
        lines.append(
            f"{i:4d}  {layout_text(p):28s} {p['microbatches']:3d} {p['remat']:6s} {p['memory_per_device'] / 1e9:7.2f} "
            f"{fits:5s} {step} {over} {mfu}  {detail or '-'}"
        )
    if len(result["plans"]) > top:
        lines.append(f"      ... {len(result['plans']) - top} more (--json lists all)")
    if result["best"]:
        lines.append(f"best: shardkit train {result['best_flags']}")
    elif result.get("interrupted"):
        lines.append("interrupted before any plan was compiled")
    else:
        lines.append("no plan fits in memory: more devices, a smaller batch, or more microbatches")
    return "\n".join(lines)


def layout_text(row: Mapping[str, Any]) -> str:
    """A plan's layout as the table shows it, with its ZeRO stage when it has one."""
    return row["layout"] + (f" zero{row['zero']}" if row.get("zero") else "")


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InputError(f"Expected comma-separated integers, got {text!r}.") from None


def options_from(args: Any) -> PlanOptions:
    """PlanOptions from the ``shardkit plan`` flags (generated from its fields)."""
    return config_from(PlanOptions, args)


def run_cli(args: Any) -> None:
    """``shardkit plan``: progress lines, then the ranked table (or its JSON); Ctrl-C prints the
    partial table."""
    options = options_from(args)
    stream = sys.stderr if args.json else sys.stdout
    try:
        result = plan(
            None if args.init_from else args.model,
            args.devices,
            args.hardware or DEFAULT_HARDWARE,
            args.batch,
            args.seq,
            options,
            init_from=args.init_from,
            progress=lambda m: print(m, file=stream, flush=True),
        )
    except PlanInterrupted as stop:
        print(json.dumps(stop.result.to_dict()) if args.json else format_plans(stop.result), flush=True)
        raise SystemExit(130) from None
    print(json.dumps(result.to_dict()) if args.json else format_plans(result))
