"""``bcg.BreakableGraph``: the captured forms of one piece of code, and the one choice of which
form a replay runs.

A graph holds its *forms* in the order a replay tries them: staged tiers (inline
forms captured for smaller bounds), the inline form, and the breakable form.
A form whose staged breakpoints all fit the replay's live metadata serves it;
a form without staged breakpoints (the breakable form, or a graph that has
none) serves any. :meth:`BreakableGraph.choose` makes that choice; a replay,
the runner (also across ranks) and :func:`bcg.verify` all ask it. Within a
form, keyed breakpoints that all hit run as one stitched launch.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

from bcg.core import native
from bcg.core.breakpoint import UNSET, live_variable, reset_live, set_live
from bcg.core.plan import GraphSource, Recording, Step, breakpoint_tensors
from bcg.core.pool import PoolHandle, PoolLease
from bcg.core.process import release_when_safe
from bcg.core.storages import check_suspects
from bcg.core.torch_internals import PROFILER_FLAG, stream_readers
from bcg.errors import CaptureError, NoFormFitsError, ReplayError
from bcg.form import Form
from bcg.graph_stats import GraphStats, describe, dump_dot, graph_stats
from bcg.keyed.variants import VariantPolicy

_current_device, _current_stream = stream_readers()

log = logging.getLogger("bcg")


def _nothing_fits(reason: str | None) -> ReplayError:
    return NoFormFitsError(
        f"this replay's live metadata does not fit the graph's staged breakpoints ({reason}) and "
        "the graph has no breakable form: use bcg.make_graph or bcg.GraphRunner, which capture one"
    )


class BreakableGraph:
    """Segments of CUDA graphs with eager breakpoints between them, in one or more forms.

    Fill it with ``with bcg.capture(graph): ...`` or build it with
    :func:`bcg.make_graph`, then call :meth:`replay`. Replays run on the current
    stream and must be issued on the device the graph was captured on.
    """

    def __init__(self) -> None:
        self._forms: list[Form] = []
        self._first: Form | None = None  # the first capture (the inline form of a staged graph)
        self._lease: PoolLease | None = None  # held since an abandoned capture into a caller's pool
        self._was_reset = False
        self._replaying = 0  # replays in progress (a breakpoint may reset, or another thread)
        self._disabled: frozenset[str] = frozenset()  # node groups set_enabled turned off
        self._switch_done: dict[tuple[str, bool], bool] = {}  # set_enabled's answers while _disabled holds
        self._suspects: list[Any] = []  # storages read that nothing but the graph may hold any more
        self._breakable_replays: dict[str, int] = {}
        self._policy: VariantPolicy | None = None  # keyed breakpoints' policy, shared by every form
        self.source: GraphSource | None = None
        self._native: Any = None  # the replay in C (bcg._native.Replay); None: not built; False: not here
        self._retired: list[Any] = []  # native replays dropped while they ran (see _stale)
        self._generators: list[torch.Generator] = []  # registered for the next captures

    def register_generator_state(self, generator: torch.Generator) -> None:
        """Register a CUDA generator that code captured into this graph draws from, as
        ``torch.cuda.CUDAGraph.register_generator_state`` does: every segment is captured with
        it, and each replay of a segment advances it as eager code would. (The default
        generator needs none.)

        Arguments:
            generator: a ``torch.Generator`` on the CUDA device of the capture, or the state
                its ``graphsafe_get_state()`` returns.

        .. warning::
            Register before ``bcg.capture``: a capture uses the generators registered when
            it begins, and a graph that holds a capture refuses more (``CaptureError``; graphs
            of ``bcg.make_graph`` and ``bcg.GraphRunner`` are captured when made). They stay
            registered after ``reset()``.
        """
        if not isinstance(generator, torch.Generator) or generator.device.type != "cuda":
            what = f"a generator on {generator.device}" if isinstance(generator, torch.Generator) else repr(generator)
            raise TypeError(f"BreakableGraph.register_generator_state: expected a CUDA torch.Generator, got {what}")
        if self.is_captured:
            raise CaptureError(
                "BreakableGraph.register_generator_state: this graph holds a capture already, which registered "
                "generators do not change: register before bcg.capture (or after graph.reset()). Graphs of "
                "bcg.make_graph and GraphRunner are captured when made: draw from the default generator there, "
                "or from yours inside a breakpoint"
            )
        if all(g is not generator for g in self._generators):
            self._generators.append(generator)

    @property
    def generator_states(self) -> tuple[torch.Generator, ...]:
        """The generators :meth:`register_generator_state` registered, in order."""
        return tuple(self._generators)

    # -- filled by capture / make_graph / the runner ---------------------------------------
    def install(self, recording: Recording, variants: VariantPolicy | None = None) -> None:
        """Make ``recording`` this graph's first form (``bcg.capture`` calls it).

        Raises:
            ReplayError: the graph already holds a capture (``reset()`` it first).
        """
        if self.is_captured:
            raise ReplayError("this BreakableGraph already holds a capture: call graph.reset() before installing another")
        self.hold(None)
        if recording.held is not None:
            self._suspects = recording.held.suspects
            recording.held.set_bcg_tensors(functools.partial(breakpoint_tensors, recording.plan))
        self._policy = variants
        name = "inline" if recording.staged_breakpoints else "graph"
        self._first = Form(recording, name, None, variants, self._suspects, recording.pool)
        self._first.on_change = self._stale
        self._forms = [self._first]
        self._stale()
        self._switch_done = {}
        self._was_reset = False
        self._breakable_replays = {}

    def add_form(self, recording: Recording, outputs: Any, *, tier: bool = False) -> None:
        """Add a form captured from the same code into this graph's pool (make_graph and the
        runner call it): the breakable form (``recording.staged_breakpoints`` empty), replayed when no
        staged form fits; or with ``tier``, a staged form with smaller bounds, tried after the
        tiers added before it and before the inline form. ``outputs``: what its capture
        returned; after it replays they are copied into :attr:`outputs` (nothing is copied
        when they are those tensors). Its storages are the first form's (the same code).
        """
        first = self._first
        if first is None:
            raise ReplayError("add_form needs a captured graph: capture its first form with bcg.capture")
        if self.outputs is None or outputs is None:
            raise ReplayError(
                "a graph with several forms needs the outputs of each capture: set graph.outputs to what "
                "the first capture returned, and pass what this one returned"
            )
        inline = recording.staged_breakpoints.names if recording.staged_breakpoints else ()
        if tier and set(inline) != set(self.staged):
            raise ReplayError("a staged tier must capture every staged breakpoint inline (its live metadata "
                              "did not fit its own bounds)")
        name = f"tier {sum(f.tier for f in self._forms)}" if tier else "breakable"
        self._switch_done = {}  # the new form's always-run groups count in the answers
        form = Form(recording, name, outputs, self._policy, self._suspects, first.recording.pool)
        form.on_change = self._stale
        self._stale()
        if not tier:
            # it replays only for metadata that fits no other form: its segments disable the
            # nodes of skipped groups in place, right before it replays, rather than each
            # building an executable without them
            for step in form.segments:
                if step.in_place is None and not step.skipped:
                    step.in_place = "it is a breakable form: its nodes are disabled in place"
            self._forms.append(form)
        else:
            self._forms.insert(self._forms.index(first), form)
            if self._disabled:
                form.switch(self._disabled)

    def drop_form(self, index: int) -> None:
        """Drop form ``index``, a staged tier (the runner drops those no faster than the form after
        them); its executables are freed once the device has run what is queued.

        Raises:
            ReplayError: it is not a staged tier, or a replay of this graph is in progress.
        """
        form = self._forms[index]
        if not form.tier or self._in_replay():
            raise ReplayError(f"drop_form drops a staged tier between replays (form {index}: {form.name}; "
                              f"replaying now: {self._in_replay()})")
        del self._forms[index]
        self._switch_done = {}
        self._stale()
        device = form.recording.device

        def free() -> None:
            if device is not None:
                torch.cuda.synchronize(device)  # no queued replay may still launch its executables
            form.free()

        release_when_safe(free)

    def hold(self, lease: PoolLease | None) -> None:
        """Keep ``lease`` (a pool lease) until ``reset()``, releasing any other one held.

        An abandoned capture into a caller's pool leaves its lease here, so that
        the pool stays usable for the next capture.
        """
        if self._lease is not None and self._lease is not lease:
            self._lease.release()
        self._lease = lease

    # -- the choice ------------------------------------------------------------------------
    def choose(self, live: Any = UNSET, start: int = 0) -> int:
        """The index (into :attr:`forms`) of the form a replay with ``live`` runs: the first whose
        staged breakpoints all fit it, else the first without staged breakpoints.

        Arguments:
            start: the first form tried (``i + 1``: what a replay would run without form ``i``).

        Raises:
            NoFormFitsError: nothing fits and the graph has no breakable form.
        """
        return self._choice(live, start)[0]

    def _choice(self, live: Any, start: int = 0) -> tuple[int, str | None]:
        """:meth:`choose`, and why the last staged form tried did not fit (None: none was skipped)."""
        forms = self._forms
        if not forms:
            raise ReplayError(self._not_captured_message())
        reason = None
        for i, form in enumerate(forms[start:], start):
            staged = form.staged_breakpoints
            if staged is None:
                return i, reason
            reason = staged.misfit(live)
            if reason is None:
                return i, None
        raise _nothing_fits(reason)

    @property
    def forms(self) -> tuple[Form, ...]:
        """The forms, in the order a replay tries them (see :meth:`choose`)."""
        return tuple(self._forms)

    # -- replay ------------------------------------------------------------------------------
    def check_held(self) -> None:
        """Raise :class:`bcg.errors.StaleTensorError` if a tensor the captured kernels read was
        replaced (nothing but the graph holds its storage any more): what every replay asks first.

        Cheap: a replay pays one list check unless a tensor the graph reads was
        collected (see :mod:`bcg.core.storages`).
        """
        if self._suspects:
            check_suspects(self._suspects)

    def replay(self, live: Any = UNSET) -> Any:
        """Run the form :meth:`choose` picks for ``live``: segment, breakpoint, segment, ... on the
        current stream.

        Arguments:
            live: what :func:`bcg.live` returns inside breakpoints during this replay
                (and what staged breakpoints' ``fits``/``prepare`` and keyed
                breakpoints' ``key`` read).

        Returns ``outputs`` (set by :func:`bcg.make_graph`; ``None`` for the
        context-manager form, whose outputs are the tensors the captured code
        returned). A breakpoint that raises stops the replay; the graph stays
        replayable.

        Raises:
            StaleTensorError: a tensor the graph reads was replaced (nothing launched).
            VerificationError: an audit replay (``VariantPolicy.audit_every``)
                found a variant that differs from its eager call.
        """
        run = self._native
        if run is None:
            run = self._native = self._build_native()
        if run:
            return run.run(live)  # (the same steps, in C: its ``slow`` calls back for the rest)
        index, reason = self._choice(live)
        return self._run(index, live, True, reason)

    def _replay_slow(self, live: Any, index: int | None, reason: str | None) -> Any:
        """What the native replay leaves to Python: ``index`` None, the whole replay; -1, nothing
        fits; else form ``index``, chosen in C for ``reason``."""
        if index is None:
            index, reason = self._choice(live)
        elif index < 0:
            raise _nothing_fits(reason)
        return self._run(index, live, True, reason)

    def _stale(self) -> None:
        """The forms or their groups changed: the next replay builds a new native replay. One
        still running (the change came from its breakpoint, or another thread) is kept in
        ``_retired`` until it returns, so :meth:`_in_replay` still sees it."""
        old = self._native
        if old and old.replaying:
            self._retired.append(old)
        self._native = None

    def _build_native(self) -> Any:
        """The C replay of the forms as they are now (``bcg._native.Replay``), or False where a
        replay goes through Python: eager mode, the Python executor, ``BCG_NATIVE=0`` (read now),
        keyed breakpoints, guards or poison, or no native extension. A form C cannot replay goes to
        :meth:`_replay_slow`: the breakable form of a staged graph (see :meth:`Form.native_entry`)."""
        forms, first = self._forms, self._first
        if first is None or not native.enabled_by_env() or not native.available() or any(
                not f.replays_natively for f in forms):
            return False
        entries = [form.native_entry(first) for form in forms]
        device = first.recording.device
        assert device is not None
        # the groups every form skips: known once a set_enabled has switched them all (its answers
        # are cleared whenever the groups or the forms change, and so is this object)
        groups_off = self._disabled if self._switch_done else None
        return native.module().Replay(
            entries, device, _current_device, _current_stream, self._replay_slow, self._suspects, check_suspects,
            PROFILER_FLAG, live_variable(), UNSET, first.outputs, groups_off)

    def _in_replay(self) -> bool:
        """A replay of this graph is in progress (from a breakpoint of it, or another thread)."""
        if self._replaying or (self._native and self._native.replaying):
            return True
        if self._retired:
            self._retired = [r for r in self._retired if r.replaying]
        return bool(self._retired)

    def replay_form(self, index: int, live: Any = UNSET, *, stitch: bool = True) -> Any:
        """Replay form ``index`` (of :meth:`choose`): what ranks that agreed on one form call.

        Arguments:
            index: the form (ranks run the highest index any of them chose).
            live: as in :meth:`replay`.
            stitch: allow one stitched launch of keyed breakpoints (``False``:
                piecewise, when another rank cannot stitch).
        """
        return self._run(index, live, stitch, None)

    def _run(self, index: int, live: Any, stitch: bool, reason: str | None) -> Any:
        form = self._forms[index] if self._forms else None
        if form is None:
            raise ReplayError(self._not_captured_message())
        rec = form.recording
        device = rec.device if form.executor is not None else None
        if device is not None and (current := _current_device()) != device:
            raise ReplayError(
                f"this graph was captured on cuda:{device} but the current device is "
                f"cuda:{current}: replay it under torch.cuda.device({device})"
            )
        self.check_held()
        if form.breakable and self._first is not None and self._first.staged_breakpoints is not None:
            if reason is None:  # (chosen by ranks' agreement)
                reason = self._first.misfit(live) or "another rank's metadata does not fit"
            self._breakable_replays[reason] = self._breakable_replays.get(reason, 0) + 1
            if form.disabled != self._disabled:
                form.switch(self._disabled)  # the groups set_enabled switched since it last replayed
        first = self._first.recording if self._first is not None else rec
        guards = rec.guards if rec.guards is not None else first.guards
        poison = rec.poison if rec.poison is not None else first.poison
        token = set_live(live)
        self._replaying += 1
        try:
            if guards is not None:
                guards.check()
            if poison is not None:
                poison.apply()
            form.run(live, stitch, device)
        finally:
            self._replaying -= 1
            reset_live(token)
        if form.outputs is not None and form.outputs is not self.outputs:
            form.copy_outputs_to(self.outputs)
        return self.outputs

    def would_stitch(self, index: int, live: Any) -> bool:
        """Whether form ``index`` would replay ``live`` as one stitched launch (keyed breakpoints
        all hit; no side effect)."""
        variants = self._forms[index].variants
        return variants is not None and variants.would_stitch(live)

    @property
    def keyed(self) -> bool:
        """Whether a form has keyed breakpoints (their variants are per-process state)."""
        return any(f.variants is not None for f in self._forms)

    def set_enabled(self, label: str, enabled: bool) -> bool:
        """Run (``True``) or skip (``False``) the node group ``label`` (``node_group`` blocks) in
        the replays that follow; the runner skips its padded-row zeroing when nothing is padded.

        A segment that skips groups replays an executable built without their
        nodes (see :mod:`bcg.core.trim`), built the first time and kept until
        ``reset()``; a segment that uses RNG, and the breakable form's (switched
        right before it replays), disable the nodes in place instead. Returns
        whether every node of the group is now in the asked state (False: the
        group holds nodes CUDA cannot disable, which always run). Stitched
        launches always run the group.

        Raises:
            ReplayError: called while this graph replays (from a breakpoint).
        """
        if self._in_replay():
            raise ReplayError("set_enabled was called during a replay of this graph: call it between replays")
        if (label in self._disabled) != enabled:  # nothing changes (the runner asks at every call)
            done = self._switch_done.get((label, enabled))
            if done is not None:
                return done
        if not self._forms or self._forms[0].executor is None:
            return enabled  # no captured CUDA graph (eager mode, not captured): the work runs
        disabled = self._disabled - {label} if enabled else self._disabled | {label}
        if disabled != self._disabled:
            self._switch_done = {}
            self._stale()
        self._disabled = disabled
        done = True
        for form in self._forms:
            if form.breakable:
                done = done and label not in form.recording.always_run
            else:
                done = form.switch(disabled) and done
        self._switch_done[(label, enabled)] = done
        return done

    def use_executor(self, name: str | None) -> None:
        """Replay with ``"python"`` or ``"native"`` (``None``: the best available, as by default)."""
        if not self._forms or self._forms[0].executor is None:
            raise ReplayError("use_executor applies to a captured graph in graph mode")
        for form in self._forms:
            form.use_executor(name)
        self._stale()

    @property
    def executor(self) -> str:
        """Which executor replays this graph (``"python"`` or ``"native"``; ``"none"`` in eager mode)."""
        first = self._first
        return first.executor.name if first is not None and first.executor is not None else "none"

    # -- inspection ---------------------------------------------------------------------
    @property
    def is_captured(self) -> bool:
        return bool(self._forms)

    @property
    def outputs(self) -> Any:
        """What the captured code returned (its tensors are rewritten by every replay)."""
        return self._first.outputs if self._first is not None else None

    @outputs.setter
    def outputs(self, value: Any) -> None:
        first = self._first
        if first is None:
            raise ReplayError("set graph.outputs after the capture")
        old = first.outputs
        for form in self._forms:  # the forms that write the graph's outputs in the graph (tiers)
            if form.outputs is old:
                form.outputs = value
        first.outputs = value
        self._stale()

    @property
    def mode(self) -> str:
        """``"graph"`` (CUDA graph segments) or ``"eager"`` (re-runs the function)."""
        return self._first.recording.mode if self._first is not None else "graph"

    @property
    def plan(self) -> tuple[Step, ...]:
        """The first form's replay plan: segment and breakpoint steps in stream order."""
        return self._first.plan if self._first is not None else ()

    @property
    def device(self) -> int | None:
        return self._first.recording.device if self._first is not None else None

    def pool(self) -> PoolHandle:
        """The private memory pool token; pass it as ``pool=`` to share it with another graph."""
        if self._first is None or self._first.recording.pool is None:
            raise ReplayError("this graph has no memory pool: capture it first")
        return self._first.recording.pool

    @property
    def staged(self) -> tuple[str, ...]:
        """The staged breakpoints captured inline (their names)."""
        staged = self._first.recording.staged_breakpoints if self._first is not None else None
        return tuple(staged.names) if staged else ()

    def stats(self) -> GraphStats:
        """Segments, breakpoints, per-segment work, pool and bridge bytes, capture seconds, and the
        staged and keyed sub-records."""
        return graph_stats(self._first, self._forms, self._breakable_replays)

    def _not_captured_message(self) -> str:
        if self._was_reset:
            return "this graph was reset: capture it again before replaying"
        return "this graph holds no capture yet: fill it with bcg.capture(graph) or bcg.make_graph()"

    # -- release -------------------------------------------------------------------------
    def reset(self) -> None:
        """Free every form's segments, bridges, held arguments and storages, and the graph's pool
        lease.

        Tensors the captured code returned (``outputs``) stay valid only as long
        as you hold them; their pool memory is returned when you drop them.
        The graph is reset at once; while a bcg capture is underway (on any
        thread) the freeing itself waits until it ends, since CUDA forbids
        destroying graphs during a capture. Dropping the last reference to a
        graph frees it the same way.

        Raises:
            ReplayError: a replay of this graph is in progress (``reset()`` called
                from one of its breakpoints, or from another thread while a
                breakpoint runs); nothing is freed.
        """
        if self._in_replay():
            raise ReplayError(
                "reset() was called while this graph is replaying (from one of its breakpoints, or "
                "from another thread during a replay): freeing its segments now would let the "
                "replay launch destroyed graphs. Reset it after the replay returns; nothing was freed"
            )
        forms, lease = self._forms, self._lease
        device = self.device if forms and forms[0].executor is not None else None
        for form in forms:
            if form.recording.held is not None:
                form.recording.held.release()  # (no CUDA call: stop checking now)
        self._forms, self._first, self._lease = [], None, None
        self._suspects, self._disabled, self._switch_done = [], frozenset(), {}
        self._breakable_replays = {}
        self.source = None
        self._native = None
        self._was_reset = True

        def free() -> None:
            if device is not None:
                torch.cuda.synchronize(device)  # no queued replay may still read what is freed
            for form in forms:
                form.free()
            if lease is not None:
                lease.release()
            if device is not None:
                torch.cuda.empty_cache()  # the pool's now-free blocks go back to the driver

        release_when_safe(free)
        log.debug("bcg: graph reset")

    def describe(self) -> str:
        """A readable table of the first form's plan: step, kind, name, nodes, bridge bytes; pool
        bytes and the other forms last."""
        return describe(self.plan, self.stats(), [f.name for f in self._forms])

    def dump_dot(self, directory: str | os.PathLike[str]) -> list[str]:
        """Write one DOT file per segment of the first form (``cudaGraphDebugDotPrint``); return their paths."""
        if self._first is None or self._first.executor is None:
            raise ReplayError("dump_dot needs a graph captured in graph mode")
        return dump_dot(self._first.segments, directory)

    def __repr__(self) -> str:
        state = "captured" if self.is_captured else ("reset" if self._was_reset else "empty")
        st = self.stats()
        forms = f", forms={len(self._forms)}" if len(self._forms) > 1 else ""
        return f"BreakableGraph({state}, mode={self.mode}, segments={st.segments}, breakpoints={st.breakpoints}{forms})"
