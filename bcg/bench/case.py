"""What a workload hands to a mode: one benchmark point, ready to build and run.

A :class:`Case` is one (workload, attention, T) point. Its forward is built
around a *breakpoint callable* so that every mode runs the same kernels:

* ``bp`` - the ``@bcg.breakpoint`` function; reads per-replay data from
  :func:`bcg.live` (modes ``eager``, ``bcg``, ``bcg-eager``, ...);
* ``bp_raw`` - the same function undecorated (for peers' own decorators);
* ``bp_frozen`` - the same work with the live values frozen at build time and
  no host-only steps, so it can be captured inside one CUDA graph (``floor``).
* ``staged`` - optionally, the same point again with a *staged* breakpoint
  (``@bcg.breakpoint(prepare=..., fits=...)``) and its own live metadata
  (modes ``bcg-staged``, ``bcg-staged-compile``).
* ``specialized`` - optionally, the same point with a *keyed* breakpoint
  (``@bcg.breakpoint(key=...)``), and ``live_stream`` the live metadata whose
  length tuples repeat in a chosen way (modes ``bcg-specialized*``, ``bcg-never``).

Modes call ``case.forward(bp)`` to get a function of ``*case.static_args``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bcg.bench.timing import UserTime


@dataclass(eq=False)
class Case:
    workload: str
    attn: str | None  # None for workloads without an attention choice
    T: int | None  # tokens (None where it does not apply)
    device: torch.device
    static_args: tuple[torch.Tensor, ...]
    live: Any
    make_forward: Callable[[Callable[..., Any]], Callable[..., torch.Tensor]]
    bp: Callable[..., Any]
    bp_raw: Callable[..., Any]
    bp_frozen: Callable[..., Any]
    num_breaks: int
    # writes fresh (True) or the original (False) random inputs into the static inputs
    write_inputs: Callable[[bool], None]
    fields: dict[str, Any] = field(default_factory=dict)  # extra row fields (shape, lengths, ...)
    iters: int | None = None  # timed replays for this case (None: --iters)
    # workload-specific measures added to each row (row, timing context) -> None
    finish_row: Callable[[dict[str, Any]], None] | None = None
    # bcg modes through a GraphRunner (serving-style: inputs copied into padded static
    # buffers each call) or a bare make_graph (the library's own replay cost only)
    use_runner: bool = True
    # the live metadata for another token count (a runner runs the forward at other sizes)
    live_for: Callable[[int], Any] | None = None
    # builds this forward's live metadata anew (what an engine does per batch); timed
    # runs call it so that its cost counts (None: ``live`` is reused)
    new_live: Callable[[], Any] | None = None
    # the same forward with the token-shaped regions compiled by torch.compile (None: no
    # compiled variant here; the compile modes skip this case)
    make_compiled_forward: Callable[[Callable[..., Any]], Callable[..., torch.Tensor]] | None = None
    # the same point (same static inputs) with the staged breakpoint as ``bp`` and the live
    # metadata it takes (``live``, ``new_live``, ``live_for``); None: no staged form here
    staged: Case | None = None
    # the same point with a keyed breakpoint (``key=``, modes ``bcg-specialized*``); None: not here
    specialized: Case | None = None
    # ``live_stream(kind)``: a fresh function returning each forward's live metadata, its length
    # tuples repeating as ``kind`` says ("fixed", "zipf", "never"); None: the point has no stream
    live_stream: Callable[[str], Callable[[], Any]] | None = None
    # the whole forward around a breakpoint compiled with fullgraph=True (the breakpoint one op
    # in the graph; modes *-fullcompile), or around its form that returns its result where the
    # workload has one (for every whole-compiled mode alike); None: not here
    make_fullcompile_forward: Callable[[Callable[..., Any]], Callable[..., torch.Tensor]] | None = None
    # the forward with attention as a custom op tagged cudagraph_unsafe, not compiled (the peer
    # inductor-partition compiles it with graph partition); None: not here
    make_partition_forward: Callable[[], Callable[..., torch.Tensor]] | None = None
    # tensor parallel: the same forward without its all-reduces (mode floor-no-allreduce)
    make_forward_no_reduce: Callable[[Callable[..., Any]], Callable[..., torch.Tensor]] | None = None
    # the clock of the staged breakpoint's ``fits`` and ``prepare`` (runner rows get host_us_bcg:
    # the call's host time less theirs); None: no user callback is timed
    user_time: UserTime | None = None

    def forward(self, bp: Callable[..., Any]) -> Callable[..., torch.Tensor]:
        return self.make_forward(bp)

    def fresh_live(self) -> Any:
        """This forward's live metadata: built anew when the workload says how, else ``live``."""
        return self.new_live() if self.new_live is not None else self.live

    @property
    def label(self) -> str:
        parts = [self.workload]
        if self.attn:
            parts.append(self.attn)
        if self.T is not None:
            parts.append(f"T={self.T}")
        return " ".join(parts)
