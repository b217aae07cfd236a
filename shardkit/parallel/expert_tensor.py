"""How much a mixture of experts moves over the ``expert`` and ``tensor`` axes: the formulas the
report's bound, the planner and the experts' own dispatch share, so that what shardkit chooses
is what it counts.

Example:
  >>> experts_under_tensor(dispatch_bytes(1000.0, 4), 100.0, 100.0, 2)["expert"]  # rows split: half
  1500.0
"""

from __future__ import annotations


def _ring(kind: str, full_bytes: float, n: int) -> float:
    """Bytes one device sends in a ring collective over ``n`` devices on ``full_bytes``."""
    if n <= 1:
        return 0.0
    return (2 if kind == "all-reduce" else 1) * (n - 1) / n * full_bytes


def dispatch_bytes(routed_bytes: float, expert_axis: int) -> float:
    """Bytes one device sends for one routed mixture's call, ``routed_bytes`` of its tokens'
    expert slots: dispatch and combine, forward and backward, each an all-to-all over ``expert``.

    Example:
      >>> dispatch_bytes(1000.0, 4)  # 4 x 3/4 x 1000
      3000.0
    """
    return 4 * _ring("all-to-all", routed_bytes, expert_axis)


def experts_under_tensor(
    dispatch: float, activation: float, group_weights: float, tensor: int, split: bool = True
) -> dict[str, float]:
    """The least one mixture call moves over ``expert`` and ``tensor`` when a layout has both:
    the cheaper of two ways to use the ``tensor`` axis for the experts.

    - Their hidden units split over ``tensor`` (Megatron-Core's expert tensor parallelism): the
      dispatch as without ``tensor``; the partial sums all-reduced at the tokens' size (after the
      combine, which is linear), forward, and the input's gradient backward.
    - Their rows split over ``tensor`` (expert tensor parallelism of 1): each tensor rank
      dispatches ``1/t`` of the tokens; the outputs are gathered over ``tensor`` forward and the
      input's gradient backward; an expert group's weights are gathered once and their gradients
      reduce-scattered.

    Args:
      dispatch: the call's dispatch and combine over ``expert`` without ``tensor``
        (:func:`shardkit.analysis.mixtures.expert_traffic`).
      activation: bytes of the tokens' ``(rows, seq, dim)`` activation of one tensor group.
      group_weights: bytes of the call's expert weights that one expert group holds, whole.
      tensor: the ``tensor`` axis' size.
      split: the layout splits the experts' weights over ``tensor``; if not, the first way moves
        nothing over ``tensor`` and the second gathers no weight.

    Returns:
      ``{"expert": bytes, "tensor": bytes}`` of the cheaper way.

    Example:
      >>> experts_under_tensor(1000.0, 100.0, 5000.0, 2)  # small tokens, big experts: hidden split
      {'expert': 1000.0, 'tensor': 200.0}
      >>> experts_under_tensor(1000.0, 100.0, 100.0, 2)  # 500 + 2 x 50 + 2 x 50 < 1000 + 200
      {'expert': 500.0, 'tensor': 200.0}
    """
    hidden = {"expert": dispatch, "tensor": 2 * _ring("all-reduce", activation, tensor) if split else 0.0}
    gathers = 2 * _ring("all-gather", activation, tensor) + (
        2 * _ring("all-gather", group_weights, tensor) if split else 0.0
    )
    rows = {"expert": dispatch / tensor, "tensor": gathers}
    return rows if sum(rows.values()) < sum(hidden.values()) else hidden
