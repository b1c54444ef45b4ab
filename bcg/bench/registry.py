"""The mode registry: what a mode is, where modes are registered, and helpers modes share.

A mode is one function ``build(case, ctx) -> Built`` decorated with
:func:`register_mode`; ``--modes`` and the report pick it up. ``Built.run``
performs one forward (a replay) on the current stream and returns the output
tensor; ``Built.close`` frees what the mode holds (graphs, pools).

The modules that define modes are listed in :data:`MODE_MODULES`, in run order
(bcg's own modes, then the peer libraries'); :func:`load_modes` imports them.
They import this module only, never each other.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import bcg
from bcg.core.torch_internals import clear_cublas_workspaces
from bcg.bench.case import Case, Step

#: The modules whose import registers modes, in the order their modes run.
MODE_MODULES: tuple[str, ...] = ("bcg.bench.modes", "bcg.bench.peers")


@dataclass(eq=False)
class BuildContext:
    """Settings every mode may need."""

    capture_warmup: int = 1  # eager runs on the capture stream before a capture
    max_stitched: int = 32  # keyed modes: VariantPolicy.max_stitched
    # multi-GPU (--tp): the runner modes' bcg.distributed.RankAgreement, and "thread_local" captures (NCCL)
    ranks: Any = None
    capture_error_mode: str = "global"


@dataclass(eq=False)
class Built:
    run: Callable[[], torch.Tensor]
    capture_s: float | None = None
    pool_bytes: int | None = None
    info: dict[str, Any] = field(default_factory=dict)  # extra row fields (executor, segments, ...)
    close: Callable[[], None] = lambda: None
    # called right before the timed replays; the function it returns is called right after
    # them (before the check replay) and gives extra row fields measured over them
    measure: Callable[[], Callable[[], dict[str, Any]]] | None = None
    # time ``run``'s host path after the timed replays, interleaved with the other such modes
    # of the point (rows get host_us_per_replay and host_us_over_floor; see bcg.bench.cli)
    host: bool = False
    # the replay ``rel_err`` is measured on, on the case's current inputs and its own live
    # metadata (None: ``run``; modes whose ``run`` draws other metadata each call, or reads
    # inputs from buffers of its own, need it)
    check: Callable[[], torch.Tensor] | None = None
    # what the host-timed calls call instead of ``run`` (None: ``run``): ``run`` with clocks that
    # the timed replays must not pay for (see own_host_s)
    host_run: Callable[[], torch.Tensor] | None = None
    # seconds of bcg's own host time per host-timed call (the runner call less the user's fits
    # and prepare), appended by ``host_run``; rows get host_us_bcg, their median (None: not kept)
    own_host_s: list[float] | None = None


@dataclass(frozen=True)
class ModeSpec:
    name: str
    build: Callable[[Case, BuildContext], Built]
    needs_cuda: bool
    help: str
    # returns None when the mode can run here, else why it is skipped
    available: Callable[[], str | None]
    # runs a torch.compile'd forward (True: its regions; "full": the whole forward): rel_err is
    # measured against that forward run eagerly
    compiled: bool | str = False


MODES: dict[str, ModeSpec] = {}


def register_mode(
    name: str,
    *,
    needs_cuda: bool = True,
    help: str = "",  # noqa: A002
    available: Callable[[], str | None] | None = None,
    compiled: bool | str = False,
) -> Callable[[Callable[[Case, BuildContext], Built]], Callable[[Case, BuildContext], Built]]:
    """Register ``build`` as mode ``name`` (order of registration = order of runs)."""

    def deco(build: Callable[[Case, BuildContext], Built]) -> Callable[[Case, BuildContext], Built]:
        if name in MODES:
            raise ValueError(f"bench mode {name!r} is registered twice")
        MODES[name] = ModeSpec(name, build, needs_cuda, help, available or (lambda: None), compiled)
        return build

    return deco


def load_modes() -> dict[str, ModeSpec]:
    """Import every module of :data:`MODE_MODULES` (once: later calls import nothing) and
    return :data:`MODES` in run order: by module as listed there, whichever was imported
    first, then by registration; modes registered elsewhere come last."""
    for module in MODE_MODULES:
        importlib.import_module(module)
    rank = {module: i for i, module in enumerate(MODE_MODULES)}
    ordered = sorted(MODES.values(), key=lambda spec: rank.get(getattr(spec.build, "__module__", ""), len(rank)))
    MODES.clear()
    MODES.update((spec.name, spec) for spec in ordered)
    return MODES


def skip_reason(name: str, cuda: bool) -> str | None:
    """Why mode ``name`` cannot run on this machine, or None."""
    spec = MODES[name]
    if spec.needs_cuda and not cuda:
        return "needs an NVIDIA GPU"
    return spec.available()


class NotApplicable(Exception):
    """A mode that does not apply to this case (e.g. no compiled variant): the row is skipped."""


# -- helpers the modes share ----------------------------------------------------------------


def capture_stream_warmup(fn: Callable[..., Any], args: tuple[Any, ...], n: int, live: Any) -> torch.cuda.Stream:
    """Run ``fn`` ``n`` times on a fresh side stream (as before any CUDA graph capture); return it.

    Torch's cached cuBLAS workspaces are dropped after the warm-up, so that the capture on
    that stream allocates its own inside the capture, in its own pool: otherwise it would
    replay the warm-up's eager workspace, which the clears of other captures in this process
    (bcg's, Inductor's) hand back to the allocator (see :mod:`bcg.core.torch_internals`).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), bcg.live_scope(live):
        for _ in range(n):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    clear_cublas_workspaces()
    return stream


def forward_of(case: Case, bp: Callable[..., Any], compiled: bool | str) -> Callable[..., torch.Tensor]:
    """The case's forward around ``bp``: eager regions, the torch.compile'd ones (``True``), or
    the whole forward compiled with ``fullgraph=True`` (``"full"``)."""
    if not compiled:
        return case.forward(bp)
    if compiled == "full":
        if case.make_fullcompile_forward is None:
            raise NotApplicable(f"{case.workload} has no whole-forward compile here")
        return case.make_fullcompile_forward(bp)
    if case.make_compiled_forward is None:
        raise NotApplicable(f"{case.workload} has no torch.compile'd variant here")
    return case.make_compiled_forward(bp)


def looped(case: Case, built: Built, step: Step, inputs: Sequence[torch.Tensor]) -> Built:
    """``built`` as it runs a decode-loop case (``case.loop``; else ``built`` unchanged): ``run``
    (and the checked run) is the whole loop over ``step`` on ``inputs`` (the tensors ``step``
    reads, which the loop writes); the row gets ``gpu_idle_us_per_step`` and ``gpu_us_per_step``
    from loops run after the timed ones (:meth:`bcg.bench.case.DecodeLoop.gpu_idle`); no host
    timing (a loop's host path waits on the GPU when it runs ahead: see docs/staged.md)."""
    loop = case.loop
    if loop is None:
        return built

    def run() -> torch.Tensor:
        return loop.run(step, inputs)

    inner = built.measure

    def measure() -> Callable[[], dict[str, Any]]:
        stop_inner = inner() if inner is not None else None

        def stop() -> dict[str, Any]:
            fields = stop_inner() if stop_inner is not None else {}  # over the timed loops only
            return {**fields, **loop.gpu_idle(step, inputs)}

        return stop

    return dataclasses.replace(built, run=run, check=run, measure=measure, host=False, host_run=None)
