"""Multi-GPU: ranks that agree on what to capture and how to replay.

Under ``torch.distributed`` each rank captures and replays its own graphs;
collectives inside segments (``dist.all_reduce`` on the capture stream, NCCL)
are recorded in the graphs and replay in stream order. What bcg must add is
*agreement*: every rank has to issue the same collectives in the same order,
or some rank waits forever.

* :class:`RankAgreement` exchanges small integers between the ranks through a
  CPU (gloo) group, always outside any capture. With ``same_inputs=True`` (every
  rank is handed the same batch, as in tensor parallelism) a runner makes its
  per-call choices locally, and :meth:`RankAgreement.expect_same` checks them in
  the background: no exchange stands between a call and its launch.
* :class:`CaptureVote` keeps the ranks together while they capture one bucket:
  a vote at the end of each segment, before its first launch (segments may hold
  collectives, and the eager breakpoint after it rank-coupled work such as an
  ``all_to_all`` with live split sizes), and one at the end. A rank
  whose capture fails casts its last vote, ``False``; every other rank learns
  it at its next vote and abandons the capture too, so all ranks mark the
  bucket failed (and run it eagerly), and no rank is left waiting in a
  collective. The protocol needs each rank to reach the same sequence of
  votes while healthy, which holds when they run the same code on the same
  bucket.

The GPU side (NCCL in segments, ``capture_error_mode``) is documented in
docs/distributed.md. NVLink multicast is never used: bcg creates no
multicast objects, and leaves ``NCCL_NVLS_ENABLE`` as the environment sets it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bcg.errors import CaptureError, ReplayError, add_note

log = logging.getLogger("bcg")


def replay_on_ranks(ranks: RankAgreement, graph: Any, live: Any) -> int:
    """Replay ``graph`` (a :class:`bcg.BreakableGraph`) in one form on every rank; return that form.

    Every call agreeing (``same_inputs=False``): the most general form any rank chose (forms are
    tried in order, so a later one takes whatever an earlier one does), stitched only where every
    rank would stitch it (a rank whose first build of an executable the driver refuses still
    replays piecewise: the same collectives in the same order). One all-reduce when the graph has
    several forms or keyed breakpoints. With ``same_inputs=True`` each rank chooses alone
    (:func:`checked_call` checks it afterwards), but a keyed graph still agrees on stitching:
    variant caches are each rank's own."""
    form = graph.choose(live)
    stitch = True
    keyed = graph.keyed
    if not ranks.same_inputs:
        forms = len(graph.forms)
        if forms > 1 or keyed:
            values = [form] + ([int(not graph.would_stitch(k, live)) for k in range(forms)] if keyed else [])
            agreed = ranks.max(values)
            form = agreed[0]
            stitch = not (keyed and agreed[1 + form])
    elif keyed:
        stitch = ranks.all(graph.would_stitch(form, live))
    graph.replay_form(form, live, stitch=stitch)
    return form


def checked_call(ranks: RankAgreement, call: Callable[[dict[str, int]], Any], raised: dict[str, int]) -> Any:
    """``call(choice)`` under ``RankAgreement(same_inputs=True)``: the call chooses locally and
    records its choices (name -> integer) in ``choice``, then every rank checks that all chose alike.

    Every call posts one check after its launch (the GPU works meanwhile), even a call that
    raised (its choice then holds ``raised``), so the ranks' checks stay paired; the call's own
    exception goes on, with a failed check as its note.
    """
    choice = {"call T": -1, "bucket": 0, **raised}
    try:
        out = call(choice)
    except BaseException as exc:
        try:
            ranks.expect_same(choice)
        except ReplayError as check:
            add_note(exc, f"bcg: and the ranks' previous check failed: {check}")
        raise
    ranks.expect_same(choice)
    return out


class RankAgreement:
    """Agreement between the ranks of a process group, through a CPU (gloo) group.

    Arguments:
        group: a process group whose backend runs on the CPU (gloo). Default:
            the default group when its backend is gloo, else a new gloo group
            over all ranks (``torch.distributed.new_group(backend="gloo")``,
            a collective: construct the agreement on every rank, in the same order).
        same_inputs: every rank makes the same calls with the same ``T`` and the
            same live metadata (tensor parallelism, where each rank gets the
            batch). A :class:`bcg.GraphRunner` then picks the bucket and the form
            of replay locally, with no exchange before the launch, and checks
            after the launch that the ranks chose alike (:meth:`expect_same`).
            Default ``False``: the ranks agree before every launch (one or two
            all-reduces on the CPU group per call; see benchmarks/README.md).

    .. warning::
        Every method is a collective: all ranks of the group must call it, in
        the same order, outside any CUDA graph capture.

    .. warning::
        With ``same_inputs=True``, ranks handed different batches are caught one
        call late: the call whose choices differed has already launched, and its
        collectives may have mismatched (wrong values, or a stream that waits
        for ever); the next call raises after it has run too. Use it only where
        every rank is given the same batch, and call :meth:`wait_checks` before
        the process group goes, to check the last call.
    """

    def __init__(self, group: Any = None, *, same_inputs: bool = False) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "bcg.distributed.RankAgreement needs an initialized torch.distributed process group: call "
                "torch.distributed.init_process_group(...) first (torchrun sets the environment)"
            )
        if group is None:
            group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.same_inputs = bool(same_inputs)
        self._checks = 0  # expect_same calls so far
        self._pending: tuple[Any, torch.Tensor, dict[str, int], int] | None = None

    def max(self, values: Sequence[int]) -> list[int]:
        """The element-wise maximum of ``values`` over the ranks (one all-reduce)."""
        t = torch.tensor(list(values), dtype=torch.int64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

    def all(self, flag: bool) -> bool:
        """True when ``flag`` is true on every rank."""
        return self.max([0 if flag else 1])[0] == 0

    def same(self, value: int) -> bool:
        """True when every rank passed the same integer."""
        lo, hi = self.max([-value, value])
        return -lo == hi

    def expect_same(self, choice: dict[str, int]) -> None:
        """Check in the background that every rank made ``choice`` (name -> integer).

        Waits for the previous check (:meth:`wait_checks`), then starts this one: an
        asynchronous all-reduce, waited for at the next call. The runner calls it
        after each launch with ``same_inputs=True``.

        Raises:
            ReplayError: the previous check found ranks whose choices differed.
        """
        self.wait_checks()
        values = list(choice.values())
        t = torch.tensor(values + [-v for v in values], dtype=torch.int64)
        work = self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending = (work, t, dict(choice), self._checks)
        self._checks += 1

    def wait_checks(self) -> None:
        """Wait for the check :meth:`expect_same` started last, if any (a collective wait).

        Raises:
            ReplayError: the ranks' choices differed at that call.
        """
        if self._pending is None:
            return
        work, t, choice, index = self._pending
        self._pending = None
        work.wait()
        k = len(choice)
        highest = t[:k].tolist()
        lowest = [-v for v in t[k:].tolist()]
        differ = [f"{name} from {lo} to {hi}" for name, lo, hi in zip(choice, lowest, highest) if lo != hi]
        if differ:
            raise ReplayError(
                f"the ranks' calls differed at check {index} of this agreement (its checks counted from 0; "
                f"{'; '.join(differ)}; this rank: {choice}). RankAgreement(same_inputs=True) needs every rank "
                "to make the same calls with the "
                "same T and live metadata; that call's collectives may have mismatched (wrong values, or a "
                "stream waiting for ever). Give every rank the same batch, or use "
                "RankAgreement(same_inputs=False) to agree before every launch"
            )


class CaptureVote:
    """The votes that keep the ranks together through one bucket's capture (see the module doc).

    Call :meth:`barrier` at each segment's end, before its first launch (it
    raises :class:`bcg.CaptureError` once another rank's capture has failed),
    then exactly one of :meth:`finish` (the capture succeeded here) or
    :meth:`fail` (it raised here). Both return whether every rank succeeded.
    """

    def __init__(self, ranks: RankAgreement) -> None:
        self._ranks = ranks
        self._done: bool | None = None  # the outcome, once a vote has ended the protocol

    def barrier(self) -> None:
        if self._done is not None:
            return
        if not self._ranks.all(True):
            self._done = False
            raise CaptureError(
                "another rank's capture of this bucket failed: this rank abandons it too, so that every "
                "rank runs the bucket eagerly (the failing rank's error says why)"
            )

    def finish(self) -> bool:
        """This rank captured the bucket; True when every rank did."""
        if self._done is None:
            self._done = self._ranks.all(True)
        return self._done

    def fail(self) -> bool:
        """This rank's capture raised (or learnt that another's did): cast the last vote; False."""
        if self._done is None:
            self._ranks.all(False)
            self._done = False
        return False
