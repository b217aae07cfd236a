"""Plan: choose a layout from a model of the hardware, checked by what the compiler produces.

For a model, a global batch and a sequence length on N devices, the planner

1. enumerates the factorisations of N over ``data x fsdp x tensor x sequence x stage x expert``
   (tensor and sequence only inside a node and where heads and sequence divide; stages only
   where the layers divide; experts only for a mixture of experts);
2. prices every one of them *analytically* (:func:`shardkit.analysis.estimate.analytic`: FLOPs, the bytes
   each axis moves, state and activation memory), for each remat policy and microbatch count,
   and drops those whose estimated memory exceeds the budget at every setting;
3. compiles only the fastest few by that estimate (``PlanOptions.compile_top``), the fastest of
   each kind of layout first (the mesh axes it splits, ZeRO or not), in parallel processes of N
   simulated devices where cores allow, walking from the cheapest setting the estimate says fits
   until the compiled step does fit (cached on disk), and skipping a layout estimated slower than
   a compiled plan that fits while the estimate has proved a lower bound in the search;
4. ranks the compiled plans by the step time predicted from their compiled FLOPs and bytes per
   axis at the device's peak and the links' bandwidths (NVLink/ICI inside a node, InfiniBand/DCN
   between nodes), with and without overlap. A pipeline's bubble needs no formula there: the
   lock-step pipeline computes its idle slots, so they are in the compiled FLOPs.

Layouts that were not compiled stay in the result with their estimate, so a user sees what was
pruned and why.

Modules: :mod:`~shardkit.plan.options` (the question's options and the answer's rows),
:mod:`~shardkit.plan.search` (layouts a model allows, priced by :mod:`shardkit.analysis.estimate`),
:mod:`~shardkit.plan.cache` (compiled dry runs on disk), :mod:`~shardkit.plan.workers` (compiles
here or in worker processes), :mod:`~shardkit.plan.planner` (``plan``), :mod:`~shardkit.plan.table`
(the printed table and ``shardkit plan``); :mod:`~shardkit.plan.dryrun` (one layout compiled on
simulated devices, ``shardkit dryrun``) and :mod:`~shardkit.plan.auto_layout` (``--layout auto``).

May import: ``core``, ``runtime``, ``io``, ``parallel``, ``models``, ``analysis``, ``training``.
"""

from shardkit.plan.options import Plan, PlanInterrupted, PlanOptions, PlanResult
from shardkit.plan.planner import plan
from shardkit.plan.search import ModelFacts, candidate_layouts
from shardkit.plan.table import format_plans, options_from, parse_ints, run_cli

__all__ = [
    "ModelFacts",
    "Plan",
    "PlanInterrupted",
    "PlanOptions",
    "PlanResult",
    "candidate_layouts",
    "format_plans",
    "options_from",
    "parse_ints",
    "plan",
    "run_cli",
]
