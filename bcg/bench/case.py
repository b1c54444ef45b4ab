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
* ``loop`` - optionally, a :class:`DecodeLoop`: the forward is one decode step,
  and a mode's ``run`` is ``loop.steps`` steps back to back, each step's inputs
  written on the device from the previous step's output.

Modes call ``case.forward(bp)`` to get a function of ``*case.static_args``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import bcg
from bcg.bench.timing import UserTime

#: one decode step of a mode: ``step(live)`` runs the forward once with this step's live
#: metadata, on the inputs the mode's loop writes, and returns its output
Step = Callable[[Any], torch.Tensor]


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
    # the forward is one decode step, run as a loop of steps per sample (None: one forward per sample)
    loop: DecodeLoop | None = None

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


@dataclass(eq=False)
class DecodeLoop:
    """A decode loop: ``steps`` forwards back to back, each one's inputs written on the device
    from the previous one's output (no host synchronization), each with its own live metadata.

    Arguments:
        steps: forwards per loop (>= 1).
        start: step 0's inputs on the device, one per forward input: a loop begins by copying
            them into the inputs it runs on (device copies).
        live: ``live(n)``: step ``n``'s live metadata, built anew at every step (host work that
            counts, as an engine's scheduler builds each step's batch).
        advance: ``advance(inputs, out)``: writes the next step's inputs from a step's output,
            with device ops only (say, the sampled token ids copied into the ids input).

    Every mode's loop does the same device work around its step: the copies of ``start``,
    ``advance`` and one copy of each step's output into the loop's result.
    """

    steps: int
    start: tuple[torch.Tensor, ...]
    live: Callable[[int], Any]
    advance: Callable[[Sequence[torch.Tensor], torch.Tensor], None]
    _outputs: torch.Tensor | None = field(default=None, init=False, repr=False)

    def run(self, step: Step, inputs: Sequence[torch.Tensor],
            marks: tuple[Sequence[Any], Sequence[Any]] | None = None) -> torch.Tensor:
        """Run the loop over ``step`` on ``inputs`` (the tensors ``step`` reads); return every
        step's output, ``[steps, *output shape]`` (rewritten by the next loop).

        ``marks``: two sequences of ``steps`` CUDA events (``enable_timing=True``), recorded
        on the current stream right before each step's call and after its last device op."""
        for buf, x in zip(inputs, self.start):
            buf.copy_(x)
        outputs = self._outputs
        live, advance = self.live, self.advance
        for n in range(self.steps):
            if marks is not None:
                marks[0][n].record()
            out = step(live(n))
            if outputs is None:
                outputs = self._outputs = torch.empty((self.steps, *out.shape), dtype=out.dtype, device=out.device)
            outputs[n].copy_(out)
            advance(inputs, out)
            if marks is not None:
                marks[1][n].record()
        assert outputs is not None
        return outputs

    def gpu_idle(self, step: Step, inputs: Sequence[torch.Tensor], loops: int = 3) -> dict[str, float | None]:
        """``loops`` more loops with CUDA events between the steps (none without CUDA):
        ``gpu_idle_us_per_step``, the mean gap on the GPU between one step's last op and the
        next step's start event (the GPU waited for the host's loop there), and
        ``gpu_us_per_step``, the GPU's span from the first step's start to the last step's end
        over ``steps`` (the median over the loops: GPU work plus any idle, also inside a step)."""
        if not (torch.cuda.is_available() and self.start and self.start[0].is_cuda):
            return {}
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.steps)]
        gaps: list[float] = []
        spans: list[float] = []
        for _ in range(loops):
            self.run(step, inputs, (starts, ends))
            ends[-1].synchronize()
            gaps += [end.elapsed_time(start) for end, start in zip(ends, starts[1:])]
            spans.append(starts[0].elapsed_time(ends[-1]) / self.steps)
        return {"gpu_idle_us_per_step": statistics.fmean(gaps) * 1e3 if gaps else None,
                "gpu_us_per_step": statistics.median(spans) * 1e3}


def eager_step(fn: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> Step:
    """``fn(*args)`` as a :data:`Step`: run eagerly with the step's live metadata (``bcg.live_scope``)."""

    def step(live: Any) -> torch.Tensor:
        with bcg.live_scope(live):
            return fn(*args)

    return step
