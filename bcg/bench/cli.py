"""``bcg-bench`` / ``python -m bcg.bench``: measure bcg against eager, one CUDA graph, and peers.

For every workload point (e.g. llama, attn=flash, T=512), in one process on the
same inputs: build (capture) every mode and time its first replay; then take
``--iters`` timed replays of each mode, each on a synchronized host wall clock,
in rounds: each round runs every mode once as a short block (``--warmup``
untimed, then up to 5 timed replays) in a random order (see
:func:`bcg.bench.timing.sample_interleaved`); then, mode by mode, write fresh
random inputs into the static inputs, replay once more and compare with
an eager reference on those inputs (``rel_err``). Before that check, modes that
time their host path (``Built.host``: the floors and bcg's) are called
:data:`HOST_CALLS` more times each, interleaved the same way, the GPU idle
before each call, timed until the call returns: ``host_us_per_replay`` is the
median, ``host_us_over_floor`` the median over rounds of the difference to the
host time of ``floor`` (else ``floor-compile``: both are one ``replay()``) in the
same round (the host's drift cancels, as in the paired ratios). A point's modes
are freed before the next point is built. With ``--captures N``, every mode is built N times,
in turns, and a row's samples are the mean over its builds (see :func:`_measure_case`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import bcg
from bcg.bench import report
from bcg.bench.argtypes import int_in, nonnegative_int, positive_int
from bcg.bench.case import Case, eager_step
from bcg.bench.registry import BuildContext, Built, NotApplicable, forward_of, load_modes, skip_reason
from bcg.bench.timing import (mean_of_captures, paired_difference, paired_ratio, rel_err, sample_interleaved, summarize,
                              sync_fn, timed_ms)
from bcg.bench.workloads import WORKLOADS

MODES = load_modes()  # every registered mode, in run order
HOST_CALLS = 30  # host-timed calls of each mode with Built.host (6 rounds of 5)

NO_CUDA_MESSAGE = (
    "bcg-bench: CUDA is not available here, and graph timings need an NVIDIA GPU.\n"
    "bcg-bench: running a smoke test instead: the llama workload at the tiny shape in modes "
    "eager and bcg-eager only (CPU timings say nothing about CUDA graphs)."
)
CPU_MODES = ("eager", "bcg-eager")
GPU_ITERS, CPU_ITERS = 50, 5
TIMING_NOTE = (
    "each sample: torch.cuda.synchronize(); t0=perf_counter(); replay(); torch.cuda.synchronize(); "
    "t1 -- host wall clock, so host launch/breakpoint work and GPU idle gaps count; median/min over --iters "
    "samples, taken in rounds: each round runs every mode of the point as a block of --warmup untimed and "
    "up to 5 timed replays, in a random order per round, so that all modes share the machine's drift; first_replay_ms is the first replay after capture; "
    "host_us_per_replay: median of 30 more calls per mode (floors and bcg), interleaved the same way, each from a "
    "synchronize until the call returns; host_us_over_floor: the median over rounds of the difference to the floor's; "
    "host_us_bcg (staged runner modes): the median over the same calls of the runner call's host time less the "
    "time in the staged breakpoint's fits and prepare, and the timer's own cost around each of them (calibrated on a "
    "no-op at start; the live metadata is built before the call); those clocks run in the host-timed calls only, "
    "not in the timed replays; with --captures N each mode is built N times, in turns (one build of each mode "
    "per turn, the order reversed every other turn), every build timed in the same rounds, "
    "and a mode's samples are the mean over its builds, sample by sample"
)


class _Every(list):  # type: ignore[type-arg]
    """The value of ``--workload``/``--modes`` when not narrowed by hand (the default or ``all``):
    what cannot run here is skipped with a note, where a hand-picked name would be refused."""


def _names(kind: str, known: Sequence[str]) -> Any:
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        if values == ["all"]:
            return _Every(known)
        bad = [v for v in values if v not in known]
        if not values or bad:
            raise argparse.ArgumentTypeError(
                f"unknown {kind} {', '.join(bad) or repr(text)}; choose a comma-separated subset of {','.join(known)}"
            )
        return list(dict.fromkeys(values))

    return parse


def writable_dir(text: str) -> Path:
    """``--out``: a directory that exists and is writable, or that can be made (its nearest
    existing ancestor is a writable directory). Nothing is created here: ``main`` makes it once
    every argument has been checked."""
    path = Path(text).expanduser()
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {str(probe)!r} exists and is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: directory {str(probe)!r} is not writable")
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bcg-bench",
        description="Benchmark breakpoint CUDA graphs (bcg) against eager, one CUDA graph (floor) and peer libraries.",
        epilog=f"Timing: {TIMING_NOTE}.",
    )
    p.add_argument("--workload", type=_names("workload", list(WORKLOADS)), default=_Every(WORKLOADS),
                   help=f"comma-separated workloads (default all: {','.join(WORKLOADS)}; a workload named here "
                   "that cannot run on this machine is an error)")
    p.add_argument("--modes", type=_names("mode", list(MODES)), default=None,
                   help=f"comma-separated modes (default all: {','.join(MODES)}, skipping those that cannot run "
                   "here; a mode named here that cannot run on this machine is an error)")
    p.add_argument("--iters", type=positive_int, default=None,
                   help=f"timed replays per row (default {GPU_ITERS}; {CPU_ITERS} without CUDA)")
    p.add_argument("--warmup", type=nonnegative_int, default=2,
                   help="untimed replays before each block of timed replays (default 2)")
    p.add_argument("--max-stitched", type=positive_int, default=bcg.VariantPolicy().max_stitched, metavar="N",
                   help="keyed modes (bcg-specialized*): stitched executables kept per graph; a new length tuple "
                   "beyond them updates the oldest in place (default %(default)s)")
    p.add_argument("--tp", type=positive_int, default=1, metavar="N",
                   help="tensor parallel over N ranks (llama; Megatron-style shards, NCCL all-reduces on GPUs, "
                   "gloo on the CPU): relaunches itself through torch.distributed.run (torchrun) unless already "
                   "under it; each rank writes bench.rank<r>.json/png (default 1)")
    p.add_argument("--rank-agreement", choices=("same-inputs", "every-call"), default=None,
                   help="--tp: how runner modes' ranks agree: 'same-inputs' (every rank gets the same batch, "
                   "as here: choices made locally, checked after the launch) or 'every-call' (all-reduces "
                   "on the CPU group before every launch) (default same-inputs)")
    p.add_argument("--captures", type=positive_int, default=1, metavar="N",
                   help="build (capture) each mode N times, in turns, and time every build in the same rounds; "
                   "rows give the mean over a mode's builds, sample by sample, so that where each capture's "
                   "memory landed averages out of the ratios (two captures of one forward can differ by more "
                   "than a percent: see floor-again) (default 1)")
    p.add_argument("--capture-warmup", type=nonnegative_int, default=1,
                   help="eager runs on the capture stream before each capture (default 1)")
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0,
                   help="seed of weights, inputs and request lengths (0 to 2**32-1; default 0)")
    p.add_argument("--out", type=writable_dir, metavar="DIR", help="write DIR/bench.json and DIR/bench.png")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none either when stderr is not a terminal)")
    p.add_argument("--list", action="store_true", help="list workloads and modes, then exit")
    for module in WORKLOADS.values():
        module.add_arguments(p)
    return p


def _no_cuda_message(modes: Sequence[str]) -> str:
    if tuple(modes) == CPU_MODES:
        return NO_CUDA_MESSAGE
    return NO_CUDA_MESSAGE.replace("eager and bcg-eager only", f"{', '.join(modes) or 'none'} only")


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, cuda: bool | None) -> None:
    """Checks across flags, right after parsing: a bad combination exits 2 via ``parser.error``.

    ``cuda``: whether this machine has CUDA (None: do not check what can run here). Without
    CUDA the llama shape is the tiny preset (CPU smoke test), and a mode or workload that was
    named by hand (``--modes``/``--workload``, not ``all``) but cannot run here is refused:
    all of them are named, each with its reason.
    """
    forced = ""
    if args.rank_agreement is not None and args.tp == 1:
        parser.error("argument --rank-agreement: only with --tp N (N > 1)")
    if cuda and args.tp > 1 and args.tp > torch.cuda.device_count():
        parser.error(f"argument --tp: {args.tp} ranks need {args.tp} GPUs; this machine has {torch.cuda.device_count()}")
    if cuda is False and getattr(args, "shape", "tiny") != "tiny":
        args.shape = "tiny"
        forced = " (without CUDA the llama workload runs the tiny shape)"
    for name in args.workload:
        check = getattr(WORKLOADS[name], "check_args", None)
        message = check(args) if check is not None else None
        if message:
            parser.error(message + (forced if "from --shape" in message else ""))
    if cuda is None or args.list:
        return
    cannot: list[str] = []
    if args.modes is not None and not isinstance(args.modes, _Every):
        cannot += [f"mode {m} ({reason})" for m in args.modes if (reason := skip_reason(m, cuda))]
    if not isinstance(args.workload, _Every) and not cuda:
        cannot += [f"workload {w} (needs an NVIDIA GPU)" for w in args.workload if WORKLOADS[w].NEEDS_CUDA]
    if cannot:
        modes = ",".join(m for m in MODES if not skip_reason(m, cuda))
        workloads = ",".join(w for w, module in WORKLOADS.items() if cuda or not module.NEEDS_CUDA)
        parser.error(f"cannot run here: {'; '.join(cannot)}. This machine can run modes {modes or 'none'} "
                     f"and workloads {workloads}")


def parse_args(argv: Sequence[str] | None = None, cuda: bool | None = None) -> argparse.Namespace:
    """Parse and check ``argv`` (see :func:`_check_args` for ``cuda``); bad input exits 2
    with argparse's usage and one ``error:`` line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args, cuda)
    return args


def _list() -> str:
    lines = ["workloads:"]
    lines += [f"  {name:22} {(m.__doc__ or '').strip().splitlines()[0]}" for name, m in WORKLOADS.items()]
    lines.append("modes:")
    lines += [f"  {name:22} {spec.help}" for name, spec in MODES.items()]
    return "\n".join(lines)


def _cleanup(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _reference(case: Case, sync: Any, compiled: bool | str = False) -> torch.Tensor:
    """Eager output on the fresh inputs (after one eager warm-up run); ``compiled``: of the
    torch.compile'd forward (what the compile modes must reproduce); a decode loop's: every
    step's output of the loop run eagerly."""
    fn = forward_of(case, case.bp, compiled)
    with bcg.live_scope(case.live):
        fn(*case.static_args)
        case.write_inputs(True)
        ref = (case.loop.run(eager_step(fn, case.static_args), case.static_args) if case.loop is not None
               else fn(*case.static_args)).detach().clone()
        case.write_inputs(False)
    sync()
    return ref


def _row(case: Case, mode: str, built: Built, first: float, samples: list[float], err: float, iters: int,
         measured: dict[str, Any] | None = None) -> dict[str, Any]:
    stats = summarize(samples)
    return {
        "workload": case.workload,
        "attn": case.attn,
        "mode": mode,
        "T": case.T,
        "ms_median": stats["ms_median"],
        "ms_min": stats["ms_min"],
        "first_replay_ms": first,
        "ratio_to_floor": None,
        "capture_s": built.capture_s,
        "pool_mib": None if built.pool_bytes is None else built.pool_bytes / 2**20,
        "extra_us_per_break": None,
        "rel_err": err,
        "ms_mean": stats["ms_mean"],
        "samples_ms": samples,
        "iters": len(samples),
        "breaks": case.num_breaks,
        **case.fields,
        **built.info,
        **(measured or {}),
    }


def _check(case: Case, built: Built, ref: torch.Tensor, sync: Any) -> float:
    """``rel_err`` of one replay on fresh inputs against ``ref`` (the eager output on them)."""
    case.write_inputs(True)
    try:
        out = built.check() if built.check is not None else built.run()
        sync()
        return rel_err(out, ref)
    finally:
        case.write_inputs(False)


def _capture_key(mode: str, k: int) -> str:
    """The name capture ``k`` (from 0) of ``mode`` is timed under: the mode's own for the first."""
    return mode if k == 0 else f"{mode}#{k + 1}"


def _measure_case(case: Case, modes: list[str], reference: Callable[[bool | str], torch.Tensor], ctx: BuildContext,
                  iters: int, warmup: int, sync: Any, failed: Callable[[str, Exception], None],
                  skipped: Callable[[str, NotApplicable], None], progress: Callable[[str], None],
                  captures: int = 1) -> list[dict[str, Any]]:
    """Build every mode, time them in rounds (each mode's ``measure`` started before and ended
    right after them: its fields go into the row), check each against ``reference(compiled)``
    (called after the builds, so that a compile happens in a build); close them all.

    ``captures``: each mode is built that many times (each build its own capture and pool), and
    every build is timed in the same rounds. A row's ``samples_ms`` is then the mean over its
    builds, sample by sample, so that where each capture's memory landed averages out of the
    ratios; ``capture_samples_ms`` keeps each build's. The modes are built in turns, one build
    of each per turn, the order reversed every other turn: where memory lands depends on what
    the process allocated before, so building one mode's captures after another's would give
    one mode the later memory at every build. Its first replay, build fields, measures
    and host times come from the first build; ``rel_err`` is the largest of all builds'.
    """
    built: dict[str, list[Built]] = {}
    dropped: list[Built] = []  # the builds of modes that failed (closed at the end, with the rest)
    first: dict[str, float] = {}
    rows: list[dict[str, Any]] = []

    def drop(mode: str, exc: Exception) -> None:  # reported once (its other builds' samples go unused)
        if mode in built:
            dropped.extend(built.pop(mode))
            failed(mode, exc)

    try:
        building = list(modes)
        for k in range(captures):  # in turns, the order reversed every other turn (see the docstring)
            for mode in building if k % 2 == 0 else building[::-1]:
                progress(f"build {mode}" + (f" ({k + 1}/{captures})" if captures > 1 else ""))
                copies = built.setdefault(mode, [])
                try:
                    copies.append(MODES[mode].build(case, ctx))
                    ms = timed_ms(copies[-1].run, sync)
                    first.setdefault(mode, ms)
                except NotApplicable as exc:
                    dropped.extend(built.pop(mode))
                    skipped(mode, exc)
                except Exception as exc:  # keep going: one failing mode must not lose the run
                    drop(mode, exc)
            building = [m for m in building if m in built]
        progress(f"time {len(built)} modes")
        stops: dict[str, Callable[[], dict[str, Any]]] = {}
        for mode, copies in list(built.items()):
            try:
                if copies[0].measure is not None:
                    stops[mode] = copies[0].measure()
            except Exception as exc:
                drop(mode, exc)
        owner = {_capture_key(m, k): m for m, copies in built.items() for k in range(len(copies))}
        runs = {_capture_key(m, k): b.run for m, copies in built.items() for k, b in enumerate(copies)}
        samples = sample_interleaved(runs, sync, iters, warmup, on_error=lambda key, exc: drop(owner[key], exc))
        measured: dict[str, dict[str, Any]] = {}
        for mode in list(built):
            try:
                measured[mode] = stops[mode]() if mode in stops else {}
            except Exception as exc:
                drop(mode, exc)
        host_failed: set[str] = set()

        def host_error(mode: str, exc: Exception) -> None:
            host_failed.add(mode)
            failed(mode, exc)

        host = sample_interleaved({m: built[m][0].host_run or built[m][0].run for m in measured if built[m][0].host},
                                  sync, HOST_CALLS, on_error=host_error, wait=False)
        floor = next((m for m in ("floor", "floor-compile") if m in host and m not in host_failed), None)
        for mode, fields in measured.items():
            if mode in host_failed:
                continue
            if mode in host:
                fields["host_us_per_replay"] = statistics.median(host[mode]) * 1e3
                over = paired_difference(host[mode], host[floor]) if floor is not None else None
                if over is not None:
                    fields["host_us_over_floor"] = over * 1e3
                own = built[mode][0].own_host_s
                if own:
                    fields["host_us_bcg"] = statistics.median(own) * 1e6
            each = [samples[_capture_key(mode, k)] for k in range(len(built[mode]))]
            try:
                err = max(_check(case, b, reference(MODES[mode].compiled), sync) for b in built[mode])
            except Exception as exc:
                failed(mode, exc)
                continue
            if len(each) > 1:
                fields["capture_samples_ms"] = each
            rows.append(_row(case, mode, built[mode][0], first[mode], mean_of_captures(each), err, iters,
                             {"captures": len(each), **fields}))
    finally:
        for b in [b for copies in built.values() for b in copies] + dropped:
            b.close()
    return rows


def _finish_case(case: Case, rows: list[dict[str, Any]]) -> None:
    floor = next((r for r in rows if r["mode"] == "floor"), None)
    no_reduce = next((r for r in rows if r["mode"] == "floor-no-allreduce"), None)
    if floor is not None and no_reduce is not None:  # --tp: the all-reduces' share of the floor's time
        ratio = paired_ratio(no_reduce["samples_ms"], floor["samples_ms"])
        for row in rows:
            row["allreduce_share"] = 1 - ratio if ratio is not None else None
    floor_compile = next((r for r in rows if r["mode"] == "floor-compile"), None)
    floor_full = next((r for r in rows if r["mode"] == "floor-fullcompile"), None)
    for row in rows:
        row["ratio_to_floor_compile"] = row["ratio_to_floor_paired"] = row["ratio_to_floor_compile_paired"] = None
        if floor_full is not None and floor_full["ms_median"] > 0:
            row["ratio_to_floor_fullcompile_paired"] = paired_ratio(row["samples_ms"], floor_full["samples_ms"])
        row["pool_ratio_to_floor"] = None
        if floor is not None and floor.get("pool_mib") and row.get("pool_mib") is not None:
            row["pool_ratio_to_floor"] = row["pool_mib"] / floor["pool_mib"]
        if floor is not None and floor["ms_median"] > 0:
            row["ratio_to_floor"] = row["ms_median"] / floor["ms_median"]
            row["ratio_to_floor_paired"] = paired_ratio(row["samples_ms"], floor["samples_ms"])
            if "capture_samples_ms" in row:  # each build's alone, against the floor's mean
                row["ratio_to_floor_paired_by_capture"] = [
                    paired_ratio(each, floor["samples_ms"]) for each in row["capture_samples_ms"]]
            row["extra_us_per_break"] = (row["ms_median"] - floor["ms_median"]) * 1e3 / max(case.num_breaks, 1)
        if floor_compile is not None and floor_compile["ms_median"] > 0:
            row["ratio_to_floor_compile"] = row["ms_median"] / floor_compile["ms_median"]
            row["ratio_to_floor_compile_paired"] = paired_ratio(row["samples_ms"], floor_compile["samples_ms"])
        if case.finish_row is not None:
            case.finish_row(row)


def _say(text: str) -> None:
    """Print a message on its own line, also while the progress bar is drawn (``tqdm.write``
    clears the bar, writes the line, redraws the bar), and flush it."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


@contextlib.contextmanager
def _messages_above(bar: Any) -> Any:
    """While ``bar`` is drawn: log records and Python warnings (written to stderr, where the
    bar is) go through ``tqdm.write`` too, each on its own line."""
    if bar.disable:
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    logging.captureWarnings(True)
    try:
        with logging_redirect_tqdm():
            yield
    finally:
        logging.captureWarnings(False)


def _launch_ranks(tp: int, argv: Sequence[str] | None) -> int:
    """Run this command again under ``torch.distributed.run`` with ``tp`` processes; its exit code."""
    import subprocess

    args = list(sys.argv[1:] if argv is None else argv)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
           "-m", "bcg.bench", *args]
    _say(f"bcg-bench: --tp {tp}: launching {' '.join(cmd)}")
    return subprocess.call(cmd)


def _init_ranks(tp: int, cuda: bool) -> tuple[int, torch.device]:
    """Join the process group torchrun describes (NCCL on GPUs, gloo on the CPU); (rank, device)."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp:
        raise SystemExit(f"bcg-bench: --tp {tp} but torchrun started {world} processes; pass --nproc-per-node={tp}")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    return dist.get_rank(), device


def main(argv: Sequence[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args, cuda)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.list:
        print(_list())
        return 0
    if args.tp > 1 and "LOCAL_RANK" not in os.environ:
        return _launch_ranks(args.tp, argv)
    if args.tp > 1:
        import torch.distributed as dist

        rank, device = _init_ranks(args.tp, cuda)
        try:
            return _run(args, argv, parser, cuda, device, rank)
        finally:
            dist.destroy_process_group()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return _run(args, argv, parser, cuda, device, None)


def _run(args: argparse.Namespace, argv: Sequence[str] | None, parser: argparse.ArgumentParser, cuda: bool,
         device: torch.device, rank: int | None) -> int:
    """One process's run (``rank``: its rank under ``--tp``, else None)."""
    notes: list[str] = []
    skipped: list[dict[str, str]] = []

    def note(text: str) -> None:
        notes.append(text)
        _say(f"bcg-bench: {text}")

    requested = args.modes if args.modes is not None else list(MODES)
    if not cuda and args.modes is None:
        requested = list(CPU_MODES)
    # what cannot run here is skipped only with the default or 'all': named by hand, it was refused above
    reasons = {mode: skip_reason(mode, cuda) for mode in requested}
    modes = [mode for mode in requested if not reasons[mode]]
    if not cuda:
        message = _no_cuda_message(modes)
        _say(message)
        notes.append(message.replace("bcg-bench: ", "").replace("\n", " "))
    for mode, reason in reasons.items():
        if reason:
            skipped.append({"mode": mode, "reason": reason})
            note(f"mode {mode} skipped: {reason}")
    workloads: list[str] = []
    for name in args.workload:
        if rank is not None and name != "llama":
            skipped.append({"workload": name, "reason": "--tp runs the llama workload only"})
            note(f"workload {name} skipped: --tp runs the llama workload only")
        elif WORKLOADS[name].NEEDS_CUDA and not cuda:
            skipped.append({"workload": name, "reason": "needs an NVIDIA GPU"})
            note(f"workload {name} skipped: needs an NVIDIA GPU")
        else:
            workloads.append(name)
    iters = args.iters or (GPU_ITERS if cuda else CPU_ITERS)
    sync = sync_fn(device)
    ctx = BuildContext(capture_warmup=args.capture_warmup, max_stitched=args.max_stitched)
    if rank is not None:
        # every rank agrees on buckets, capture failures and replay forms (every rank is given the
        # same batch: with same-inputs, each chooses locally and the choices are checked after the
        # launch); NCCL captures in thread_local mode (the process group's watchdog thread queries
        # events meanwhile)
        ctx.ranks = bcg.distributed.RankAgreement(same_inputs=args.rank_agreement != "every-call")
        ctx.capture_error_mode = "thread_local"
    suffix = f".rank{rank}" if rank is not None else ""

    env = report.environment()
    config: dict[str, Any] = {
        "argv": list(sys.argv[1:] if argv is None else argv),
        "workloads": workloads,
        "modes": modes,
        "iters": iters,
        "warmup": args.warmup,
        "capture_warmup": args.capture_warmup,
        "captures": args.captures,
        "seed": args.seed,
        "timing": TIMING_NOTE,
        "bcg_version": bcg.__version__,
    }
    for name in workloads:
        config[name] = WORKLOADS[name].config(args, device)

    out_dir: Path | None = args.out
    if out_dir is not None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # checked at parsing; changed since
            parser.error(f"argument --out: cannot make {str(out_dir)!r}: {exc.strerror or exc}")
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    extras: dict[str, Any] = {}  # top-level sections a workload adds (llama: "runner")

    def save() -> None:
        if out_dir is not None:
            report.write_json(out_dir / f"bench{suffix}.json", env, config, rows,
                              {**extras, "skipped": skipped, "errors": errors, "notes": notes})

    plan = [(name, point) for name in workloads for point in WORKLOADS[name].points(args)]
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    # disable=None: tqdm draws no bar when stderr is not a terminal (no carriage-return frames in a log)
    bar = tqdm(total=len(plan) * len(modes), disable=True if args.no_progress or not modes else None,
               file=sys.stderr, dynamic_ncols=True, mininterval=0.1, unit="row")
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(_messages_above(bar))
        for name in workloads:
            module = WORKLOADS[name]
            bar.set_description(f"{name}: setup", refresh=tty)
            t0 = time.perf_counter()
            state = module.setup(args, device)
            nbytes = getattr(state, "nbytes", None)
            if nbytes:
                size = f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
                _say(f"bcg-bench: {name}: weights {size} built in {time.perf_counter() - t0:.1f} s")
            for attn, T in module.points(args):
                case = module.make_case(state, args, device, attn, T)
                bar.set_description(f"{case.label}: eager reference", refresh=tty)
                refs: dict[bool | str, torch.Tensor] = {False: _reference(case, sync)}

                def reference(compiled: bool | str) -> torch.Tensor:
                    if compiled not in refs:
                        refs[compiled] = _reference(case, sync, compiled)
                    return refs[compiled]

                def failed(mode: str, exc: Exception, case: Case = case) -> None:
                    errors.append({"workload": case.workload, "attn": case.attn, "T": case.T, "mode": mode,
                                   "error": f"{type(exc).__name__}: {exc}"})
                    _say(f"bcg-bench: {case.label} {mode} FAILED: {type(exc).__name__}: {exc}")

                def not_applicable(mode: str, exc: NotApplicable, case: Case = case) -> None:
                    skipped.append({"workload": case.workload, "T": case.T, "mode": mode, "reason": str(exc)})

                def progress(step: str, case: Case = case) -> None:
                    bar.set_description(f"{case.label}: {step}", refresh=tty)

                case_rows = _measure_case(case, modes, reference, ctx, case.iters or iters, args.warmup, sync,
                                          failed, not_applicable, progress, args.captures)
                bar.update(len(modes))
                _finish_case(case, case_rows)
                rows.extend(case_rows)
                summary = ", ".join(f"{r['mode']} {r['ms_median']:.3f}" for r in case_rows)
                _say(f"bcg-bench: {case.label}: median ms: {summary}")
                save()
                del case, refs
                _cleanup(cuda)
            if hasattr(module, "extra"):
                bar.set_description(f"{name}: extra measures", refresh=tty)
                try:
                    extras.update(module.extra(state, args, device))
                except Exception as exc:
                    errors.append({"workload": name, "extra": True, "error": f"{type(exc).__name__}: {exc}"})
                    _say(f"bcg-bench: {name} extra measures FAILED: {type(exc).__name__}: {exc}")
                save()
            del state
            _cleanup(cuda)
        if ctx.ranks is not None:  # the last call's check (same inputs), before the group goes
            try:
                ctx.ranks.wait_checks()
            except bcg.ReplayError as exc:
                errors.append({"ranks": True, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        stack.close()
        bar.close()
    print()
    print(report.format_table(rows) if rows else "bcg-bench: no rows")
    ladder = extras.get("runner")
    if ladder:
        print(
            f"\nrunner ladder ({len(ladder['buckets'])} buckets up to {ladder['buckets'][-1]}): capture "
            f"{ladder['capture_s_total']:.2f} s; pool {ladder['pool_mib_total']:.1f} MiB all buckets vs "
            f"{ladder['pool_mib_largest_alone']:.1f} MiB largest alone (ratio {ladder['pool_ratio']:.3f})"
        )
    ladder = extras.get("runner_staged")
    if ladder:
        print(
            f"staged runner ladder (inline form, staged tiers and breakable form per bucket): capture {ladder['capture_s_total']:.2f} s; pool "
            f"{ladder['pool_mib_total']:.1f} MiB ({ladder['pool_ratio_to_breakable']:.3f}x the breakable ladder's)"
        )
    ladder = extras.get("runner_compile")
    if ladder:
        print(
            f"compiled runner ladder: compile {ladder['compile_s']:.2f} s ({ladder['graphs_compiled']} graphs), "
            f"capture {ladder['capture_s_total']:.2f} s ({ladder['graphs_compiled_during_capture']} graphs "
            f"compiled during it), total {ladder['compile_plus_capture_s']:.2f} s"
        )
    for key in ("lifecycle", "lifecycle_breakable"):
        life = extras.get(key)
        if not life:
            continue
        a, z, zb, bg = life["capture_all"], life["lazy"], life["lazy_at_bucket_size"], life["background"]
        print(
            f"{key} (T={life['calls_T']} calls): first result after {a['to_first_result_s']:.2f} s capturing "
            f"all, {z['to_first_result_s']:.2f} s lazy at T={z['first_T']} (eager call + its bucket's capture: "
            f"{z['eager_plus_one_capture_s']:.2f} s, with capture_all's: {z['eager_plus_capture_all_bucket_s']:.2f} s; "
            f"at T={zb['first_T']}: {zb['to_first_result_s']:.2f} s against {zb['eager_plus_one_capture_s']:.2f} s), "
            f"{bg['to_first_result_s']:.2f} s in the background; "
            f"capture {a['capture_s']:.2f} / {z['capture_s']:.2f} / {bg['capture_s']:.2f} s; pool "
            f"{a['pool_ratio_largest_first'] or 0:.3f}x the largest bucket largest first, "
            f"{z['pool_ratio_random_order'] or 0:.3f}x in a random order; reset() frees "
            f"{life['sleep_wake']['freed_mib'] or 0:.0f} MiB ({life['sleep_wake']['freed_of_taken'] or 0:.1%} of what the "
            f"capture took), waking takes {life['sleep_wake']['wake_to_first_result_s']:.2f} s; "
            f"{bg['calls_per_s_during_capture'] or 0:.1f} calls/s during the background capture "
            f"({bg['rate_ratio_to_eager'] or 0:.2f}x eager)"
        )
    print(f"\ntiming: {TIMING_NOTE}")
    if not cuda:
        print("bcg-bench: graph timings need an NVIDIA GPU; this was an eager smoke run (exit 0).")
    save()
    if out_dir is not None:
        title = f"{env['gpu']} | torch {env['torch']} | bcg {env['commit']} | {env['date']}"
        report.write_png(out_dir / f"bench{suffix}.png", rows, title=title)
        print(f"bcg-bench: wrote {out_dir / f'bench{suffix}.json'} and {out_dir / f'bench{suffix}.png'}")
    sys.stdout.flush()  # before the stderr line, also when both go to one file
    if errors:
        print(f"bcg-bench: {len(errors)} row(s) failed; see 'errors' in bench.json", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
