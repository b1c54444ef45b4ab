"""Breakpoints: ``@bcg.breakpoint``, the live metadata they read, and the recorder that sees them.

* :func:`breakpoint` marks a function as work that runs eagerly at every replay
  (or, *staged*, inline in the graph; see :mod:`bcg.staged.staging`);
  :class:`BreakpointSpec` is what the library knows about one.
* :func:`live` is the per-replay host metadata breakpoints read. It is carried
  by a :class:`contextvars.ContextVar`, so it is thread- and reentrancy-safe.
* The *active recorder* (another ContextVar) is whoever is capturing or
  eagerly recording on this context: the capture, eager-mode recording and
  replay, the runner's warm-ups, verify's reference run. ``None`` means a
  breakpoint is a plain call. Every recorder derives from :class:`Recorder`,
  which owns the rules they share.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import torch
from bcg.core.compiled import opaque_op
from bcg.core.torch_internals import pytree

from bcg.core.args import check_bool, check_callable, check_type, describe, fail
from bcg.errors import LiveReadInSegmentError, user_line

log = logging.getLogger("bcg")

_WHERE = "bcg.breakpoint"

# -- live metadata ---------------------------------------------------------------------------


class _Unset:
    """The type of :data:`UNSET`, "no value given" (``None`` is a valid live value).

    One instance; compared by identity (``is UNSET``). Its repr makes signatures
    read ``live=<unset>``; copies are the instance itself.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "<unset>"

    def __copy__(self) -> _Unset:
        return self

    def __deepcopy__(self, memo: object) -> _Unset:
        return self


UNSET: Any = _Unset()
_LIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("bcg_live", default=UNSET)


def live(default: Any = UNSET, *, static_ok: bool = False) -> Any:
    """Return this replay's live metadata.

    Inside a breakpoint this is what was passed to ``graph.replay(live=...)``;
    during capture it is what was passed to ``bcg.capture(..., live=...)``; in a
    plain eager run it is what :func:`live_scope` set. Inside a staged
    breakpoint running inline, it is what its ``prepare`` returned at capture.

    Arguments:
        default: returned when no live metadata is set (otherwise ``LookupError``).
        static_ok: allow a read from code between breakpoints while it is being
            captured (or recorded in eager mode). Such code runs once, at capture:
            whatever it derives from the value is frozen into the graph. Pass
            ``True`` only for fields that never change for this graph.

    .. warning::
        Read per-replay values only inside ``@bcg.breakpoint`` functions. A read
        from segment code during a capture raises :class:`bcg.errors.LiveReadInSegmentError`
        naming the line, unless ``static_ok=True``.
    """
    if not static_ok:
        recorder = ACTIVE.get()
        if recorder is not None and recorder.in_segment and recorder.refuses_live_reads:
            where = user_line(traceback.extract_stack()[:-1])
            raise LiveReadInSegmentError(
                f"bcg.live() was read{' at ' + where if where else ''} by code between breakpoints "
                f"while {recorder.segment_label} was being recorded: its value would be frozen into the "
                "graph, and every replay would reuse the capture-time metadata. Move the code that "
                "depends on it into a @bcg.breakpoint function (it runs at every replay), or, if it only "
                "reads fields that never change for this graph, call bcg.live(static_ok=True)."
            )
    value = _LIVE.get()
    if value is UNSET:
        if default is not UNSET:
            return default
        raise LookupError(
            "bcg.live() was called with no live metadata set: pass live=... to "
            "bcg.capture()/graph.replay(), or wrap an eager run in bcg.live_scope(meta)"
        )
    return value


@contextlib.contextmanager
def live_scope(value: Any) -> Iterator[Any]:
    """Make ``value`` what :func:`live` returns inside this block (for eager runs).

    ``UNSET`` (library use) leaves the current value as it is.
    """
    token = _LIVE.set(value) if value is not UNSET else None
    try:
        yield value
    finally:
        if token is not None:
            _LIVE.reset(token)


def live_variable() -> contextvars.ContextVar[Any]:
    """The context variable :func:`live` reads (the native replay sets it from C)."""
    return _LIVE


def set_live(value: Any) -> contextvars.Token[Any] | None:
    """Set the live metadata (``UNSET``: leave it); the token goes to :func:`reset_live`.

    The replay loop's form of :func:`live_scope`, without a generator frame.
    """
    return _LIVE.set(value) if value is not UNSET else None


def reset_live(token: contextvars.Token[Any] | None) -> None:
    if token is not None:
        _LIVE.reset(token)


# -- what is known about one breakpoint ---------------------------------------------------------


def normalize_mutates(fn: Callable[..., Any], mutates: Any) -> tuple[str, ...] | None:
    """``mutates`` as a tuple of parameter names of ``fn``, checked against its signature.

    A single string is one name. Raises ``TypeError`` naming what is wrong: an
    entry that is not a string, or a name ``fn`` has no parameter for (allowed
    only when ``fn`` takes ``**kwargs``).
    """
    if mutates is None:
        return None
    expects = "the names of parameters (strings: one name, or a tuple of names)"
    if not isinstance(mutates, (str, tuple, list, set, frozenset)):
        fail(_WHERE, "mutates", expects, mutates, "e.g. mutates='out' or mutates=('k_cache', 'v_cache')")
    names = (mutates,) if isinstance(mutates, str) else tuple(mutates)
    for i, name in enumerate(names):
        if not isinstance(name, str):
            fail(_WHERE, f"mutates[{i}]", "a parameter name (strings only)", name)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and C functions: nothing to check against
        return names
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return names
    unknown = [n for n in names if n not in params]
    if unknown:
        qualname = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"@bcg.breakpoint(mutates=...) names {', '.join(map(repr, unknown))}, which "
            f"{'is not a parameter' if len(unknown) == 1 else 'are not parameters'} of "
            f"{qualname}({', '.join(params)}); name the arguments the function writes in place"
        )
    return names


@dataclass(frozen=True, eq=False)
class BreakpointSpec:
    """A breakpoint: the eager function, its optional capture stub, and a name.

    ``enabled`` is a bool or a zero-argument callable asked at each capture-time
    call; a disabled breakpoint is captured into the segment like any code.
    ``mutates`` names the arguments it writes in place (``None``: any of them).
    ``prepare`` and ``fits`` make it *staged* (see :mod:`bcg.staged.staging`);
    ``key`` makes it *keyed* (see :mod:`bcg.keyed.variants`). Build specs through
    :func:`bcg.breakpoint`, which checks them.
    """

    fn: Callable[..., Any]
    name: str
    enabled: bool | Callable[[], bool] = True
    capture_stub: Callable[..., Any] | None = None
    mutates: tuple[str, ...] | None = None
    prepare: Callable[[Any], Any] | None = None
    fits: Callable[..., bool] | None = None
    key: Callable[[Any], Any] | None = None

    @property
    def staged(self) -> bool:
        return self.prepare is not None

    @functools.cached_property
    def fits_reads_staged(self) -> bool:
        """Whether ``fits`` requires a second positional argument: what ``prepare`` returned at capture."""
        if self.fits is None:
            return False
        try:
            params = inspect.signature(self.fits).parameters.values()
        except (TypeError, ValueError):  # no signature (a builtin): called with live alone
            return False
        required = [p for p in params
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
        return len(required) >= 2

    def is_enabled(self) -> bool:
        return bool(self.enabled() if callable(self.enabled) else self.enabled)

    @functools.cached_property
    def _signature(self) -> inspect.Signature:
        return inspect.signature(self.fn)

    def mutated_tensors(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The tensor arguments this breakpoint writes: those named in ``mutates``, else all."""
        if self.mutates is None:
            leaves = pytree.tree_leaves((args, kwargs))
        else:
            params = self._signature.parameters
            bound = self._signature.bind(*args, **kwargs).arguments
            extra: dict[str, Any] = next(
                (v for k, v in bound.items() if params[k].kind is inspect.Parameter.VAR_KEYWORD), {}
            )
            leaves = pytree.tree_leaves([bound[n] if n in bound else extra.get(n) for n in self.mutates])
        return [x for x in leaves if isinstance(x, torch.Tensor)]


# -- the active recorder ----------------------------------------------------------------------------


class Recorder:
    """Base of the active recorders.

    A disabled breakpoint, or one called from inside another breakpoint, is
    plain code. Subclasses implement :meth:`on_breakpoint` (an enabled
    breakpoint called from segment code), and may override :meth:`on_staged`
    (a staged one; default: the breakable form, as :meth:`on_breakpoint`) and
    :meth:`on_graph_break`; they run the breakpoint's function through
    :meth:`run_breakpoint`, which makes ``in_segment`` false while it runs
    (:func:`live` refuses reads otherwise).
    """

    #: What ``bcg.live()`` errors call the code being recorded ("graph segment 3", ...).
    segment_label = "a graph segment"
    #: ``bcg.live()`` read by segment code raises (``False``: a recorder that only watches a plain run).
    refuses_live_reads = True

    def __init__(self) -> None:
        self.in_segment = True

    def call_breakpoint(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.in_segment or not spec.is_enabled():
            return spec.fn(*args, **kwargs)  # nested in a breakpoint, or disabled: plain code
        if spec.prepare is not None:
            return self.on_staged(spec, args, kwargs)
        return self.on_breakpoint(spec, args, kwargs)

    def graph_break(self) -> None:
        if self.in_segment:
            self.on_graph_break()

    def on_breakpoint(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def on_staged(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.on_breakpoint(spec, args, kwargs)

    def on_graph_break(self) -> None:
        pass

    def staging_point(self) -> None:
        """Called right before the recording's first staged copy (default: nothing)."""

    def staged_node(self, node: Any, buffer: Any) -> None:
        """A staged copy was captured as ``node``, a kernel whose parameters carry ``buffer``'s
        value, which every replay sets (default: nothing; a capture keeps it with its segment)."""

    def run_breakpoint(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], live: Any = UNSET) -> Any:
        """``fn(*args, **kwargs)`` as breakpoint code: ``bcg.live()`` may be read inside
        (and returns ``live``, when given)."""
        self.in_segment = False
        token = set_live(live)
        try:
            return fn(*args, **kwargs)
        finally:
            reset_live(token)
            self.in_segment = True


NOT_INLINE: Any = object()
"""What a recorder of staged breakpoints returns for one it recorded as a breakpoint instead
(its metadata did not fit): the caller records it as a plain breakpoint."""

ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("bcg_active_recorder", default=None)


@contextlib.contextmanager
def recording(recorder: Recorder | None, live: Any = UNSET) -> Iterator[None]:
    """Make ``recorder`` the active recorder (and ``live`` the live metadata, unless ``UNSET``) in the block."""
    token = ACTIVE.set(recorder)
    live_token = set_live(live)
    try:
        yield
    finally:
        reset_live(live_token)
        ACTIVE.reset(token)


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def crossing_tensors(
    results: list[torch.Tensor], spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The tensors crossing a breakpoint: its results, then its mutated arguments, each object once.

    This order is the contract of ``bcg.capture(after_breakpoint=...)``; the
    runner's eager warm-ups compute the same list so that the ``k``-th list of
    an eager run lines up with the ``k``-th of a capture.
    """
    seen: set[int] = set()
    out = []
    for t in results + spec.mutated_tensors(args, kwargs):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


# -- the decorator ------------------------------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])


@overload
def breakpoint(fn: F, /) -> F: ...
@overload
def breakpoint(
    *,
    enabled: bool | Callable[[], bool] = True,
    capture_stub: Callable[..., Any] | None = None,
    name: str | None = None,
    mutates: str | tuple[str, ...] | None = None,
    prepare: Callable[[Any], Any] | None = None,
    fits: Callable[..., bool] | None = None,
    key: Callable[[Any], Any] | None = None,
    fake: Callable[..., Any] | None = None,
) -> Callable[[F], F]: ...


def breakpoint(  # noqa: A001 - the public name is part of the contract
    fn: Callable[..., Any] | None = None,
    /,
    *,
    enabled: bool | Callable[[], bool] = True,
    capture_stub: Callable[..., Any] | None = None,
    name: str | None = None,
    mutates: str | tuple[str, ...] | None = None,
    prepare: Callable[[Any], Any] | None = None,
    fits: Callable[..., bool] | None = None,
    key: Callable[[Any], Any] | None = None,
    fake: Callable[..., Any] | None = None,
) -> Any:
    """Mark ``fn`` as work that must run eagerly at every replay.

    Outside a capture the decorated function is a plain call. Inside
    ``bcg.capture`` it ends the current segment, runs eagerly (``capture_stub``
    instead, if given: it must return the same structure, shapes and dtypes),
    and a new segment begins.

    Arguments:
        enabled: a bool, or a zero-argument callable asked at each capture-time
            call; a disabled breakpoint is captured into the segment like any code.
        capture_stub: run instead of ``fn`` during capture.
        name: a str, for messages and stats (default: the function's qualified name).
        mutates: the parameters written in place (a name or a tuple of names,
            checked against the signature: ``TypeError`` otherwise; default:
            any tensor argument may be); padding sanitizers run on exactly those.
        prepare, fits: make the breakpoint *staged*: captured inline, reading
            metadata that ``prepare(live)`` stages in staging buffers at every
            replay, whenever ``fits(live)`` (or ``fits(live, staged)``, given what
            ``prepare`` returned at capture); see :mod:`bcg.staged.staging` for the contract.
        key: make the breakpoint *keyed*: ``key(live)`` returns a hashable value
            covering everything host-dynamic its GPU work depends on; its work is
            captured once per key (a *variant*) and replayed from then on, and a
            forward whose breakpoints all hit runs as one stitched graph; see
            :mod:`bcg.keyed.variants` for the contract.
        fake: for a breakpoint that returns tensors and is called from
            ``torch.compile``d code: a function of the same arguments that
            returns empty tensors of the results' shapes and dtypes (what
            ``torch.library.register_fake`` takes); see below.

    Every argument is checked at decoration: ``fn``, ``capture_stub``,
    ``prepare``, ``fits``, ``key`` and ``fake`` must be callable (or ``None``),
    ``enabled`` a bool or a callable, ``name`` a str; a wrong one raises
    ``TypeError`` naming it, what it got and what it expects (``bcg.breakpoint(42)``
    raises there, not at the first call).

    Constraints:
        * Tensor arguments are held by the graph and passed again, at the same
          addresses, at every replay: write results into them in place, or return
          tensors (each is copied into a graph-owned *bridge* buffer at replay).
        * Non-tensor return values are frozen at capture; a replay returning a
          different value, structure, shape or dtype raises ``BreakpointOutputMismatch``.
        * Read per-replay host data with :func:`bcg.live`, never from closures.
        * A result that is one of its tensor arguments exactly (same storage,
          offset, shape, strides, dtype) is taken as written in place and must be
          that same argument at every replay; any other result, views of arguments
          included, is copied into a bridge.
        * Inside ``torch.compile``d code (``fullgraph=True`` too) a breakpoint is
          one opaque custom op (``bcg::<name>``), never traced: its parameters
          must be annotated with types ``torch.library.custom_op`` takes
          (``torch.Tensor``, ``int``, ``float``, ``bool``, ``str``, lists and
          optionals of those), it must return ``None`` or be given ``fake=``,
          and ``mutates=`` must name what it writes (else any tensor argument
          may be written, which costs the compiled code copies). A breakpoint
          that cannot be an op is a Dynamo graph break instead.
    """
    _check_options(fn, enabled, capture_stub, name, prepare, fits, key, fake)

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        check_callable(_WHERE, "fn", f, expects="a function to decorate")
        spec = BreakpointSpec(
            fn=f,
            name=name or getattr(f, "__qualname__", repr(f)),
            enabled=enabled,
            capture_stub=capture_stub,
            mutates=normalize_mutates(f, mutates),
            prepare=prepare,
            fits=fits,
            key=key,
        )
        active = ACTIVE.get

        # The breakpoint's dispatch: eager, or the active capture's. torch.compiler.disable:
        # Dynamo never traces into it. Replays do not come here: they call the function directly.
        @torch.compiler.disable
        def call(*args: Any, **kwargs: Any) -> Any:
            recorder = active()
            if recorder is None:
                return f(*args, **kwargs)
            return recorder.call_breakpoint(spec, args, kwargs)

        op, why = opaque_op(f, spec.name, spec.mutates, call, fake)
        if op is None:
            log.debug("bcg: breakpoint %r is a graph break in compiled code, not an op: %s", spec.name, why)
            wrapper = call
        else:

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if torch.compiler.is_compiling():  # Dynamo traces this call: record the op
                    return op(*args, **kwargs)
                return call(*args, **kwargs)

        wrapper = functools.update_wrapper(wrapper, f)
        wrapper.__bcg_breakpoint__ = spec  # type: ignore[attr-defined]
        return wrapper

    return decorate(fn) if fn is not None else decorate


def _check_options(fn: Any, enabled: Any, capture_stub: Any, name: Any, prepare: Any, fits: Any, key: Any,
                   fake: Any) -> None:
    """The decorator's arguments (``mutates`` is checked against the function's signature, in
    :func:`normalize_mutates`); ``TypeError`` naming the first one that is wrong."""
    if fn is not None:
        hint = "use @bcg.breakpoint on a function, or @bcg.breakpoint(...) with keyword options"
        if isinstance(fn, str):
            hint = f"options are keyword arguments: @bcg.breakpoint(name={fn!r})"
        check_callable(_WHERE, "fn", fn, expects="a function to decorate", hint=hint)
    if not callable(enabled):
        check_bool(_WHERE, "enabled", enabled, expects="True, False, or a zero-argument function returning a bool")
    check_callable(_WHERE, "capture_stub", capture_stub, optional=True)
    check_type(_WHERE, "name", name, str, "a str", optional=True)
    check_callable(_WHERE, "prepare", prepare, optional=True,
                   expects="a function of the live metadata (prepare(live))")
    check_callable(_WHERE, "fits", fits, optional=True,
                   expects="a function of the live metadata (fits(live) or fits(live, staged))")
    check_callable(_WHERE, "key", key, optional=True, expects="a function of the live metadata",
                   hint="key= takes a function of the live metadata that returns a hashable value")
    check_callable(_WHERE, "fake", fake, optional=True)
    if (prepare is None) != (fits is None):
        given, missing = ("prepare", "fits") if fits is None else ("fits", "prepare")
        raise TypeError(
            f"{_WHERE}: prepare and fits must be given together (a staged breakpoint needs both), got "
            f"{given}={describe(prepare if fits is None else fits)} and {missing}=None; give prepare= and "
            "fits= together"
        )
    if capture_stub is not None and prepare is not None:
        fail(_WHERE, "capture_stub", "None for a staged breakpoint (prepare=/fits=)", capture_stub,
             "a staged breakpoint is captured by running its function inline, so it takes no capture_stub")


def graph_break() -> None:
    """End the current segment and begin a new one, with no eager work between."""
    recorder = ACTIVE.get()
    if recorder is not None:
        recorder.graph_break()
