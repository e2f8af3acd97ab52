"""The torch ops one call runs, as the host issues them (on a GPU each is a kernel launch, or a no-op when it only
views or moves a tensor already in place): for host-cost benchmarks on a CPU machine."""

from __future__ import annotations

import collections
from typing import Any, Callable

from torch.profiler import ProfilerActivity, profile

# ops that only make a view (no kernel on any device)
VIEW_OPS = frozenset({
    "aten::view", "aten::reshape", "aten::slice", "aten::detach", "aten::as_strided", "aten::alias", "aten::narrow",
    "aten::expand", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::split", "aten::split_with_sizes",
    "aten::t", "aten::transpose", "aten::permute", "aten::unbind", "aten::lift_fresh", "aten::_unsafe_view",
    "aten::contiguous",
})


def count_ops(call: Callable[[], Any]) -> dict[str, int]:
    """Top-level aten ops of one `call()` (an op's own inner ops not counted again), views left out, by name."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    counts = collections.Counter(event.name for event in prof.events()
                                 if event.name.startswith("aten::") and event.cpu_parent is None
                                 and event.name not in VIEW_OPS)
    return dict(sorted(counts.items()))


def ops_cell(ops: dict[str, int]) -> str:
    """`count_ops`'s result for a markdown table cell: "cat 1, zeros 2"."""
    return ", ".join(f"{name.removeprefix('aten::')} {count}" for name, count in ops.items())
