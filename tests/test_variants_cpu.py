"""Keyed breakpoints without a GPU: the key contract, the LRU and key bookkeeping, eager-mode semantics."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

import bcg
from bcg.keyed.lru import Lru
from bcg.keyed.variants import KeyBook, VariantCache, live_tensors, variant_key


@dataclass(frozen=True)
class Meta:
    lengths: tuple[int, ...]


def test_key_must_be_callable() -> None:
    with pytest.raises(TypeError, match="key= takes a function"):
        bcg.breakpoint(key=(1, 2))(lambda x: x)


def test_an_unhashable_key_names_the_breakpoint() -> None:
    spec = bcg.breakpoint(name="attn", key=lambda m: list(m.lengths))(lambda x: x).__bcg_breakpoint__
    with pytest.raises(TypeError, match="'attn' returned an unhashable list"):
        variant_key(spec, Meta((1, 2)))
    ok = bcg.breakpoint(name="attn", key=lambda m: m.lengths)(lambda x: x).__bcg_breakpoint__
    assert variant_key(ok, Meta((1, 2))) == (1, 2)


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="max_variants"):
        bcg.VariantPolicy(max_variants=0)
    with pytest.raises(ValueError, match="min_hit_rate"):
        bcg.VariantPolicy(min_hit_rate=1.5)
    with pytest.raises(ValueError, match="audit_every"):
        bcg.VariantPolicy(audit_every=-1)


def test_lru_evicts_least_recently_used_by_count_and_bytes() -> None:
    lru: Lru[str, int] = Lru(max_count=3, max_bytes=100)
    for name, size in (("a", 10), ("b", 20), ("c", 30)):
        lru.put(name, len(name), size)
    assert lru.nbytes == 60 and len(lru) == 3
    assert lru.over(lambda k: False, room=0) == []
    assert lru.over(lambda k: False, room=1) == ["a"]  # one more must fit: the oldest goes
    lru.get("a")  # now the most recent
    assert lru.over(lambda k: False, room=1) == ["b"]
    assert lru.over(lambda k: k == "b", room=1) == ["c"]  # a protected key is skipped
    lru.add_bytes("c", 60)  # 120 bytes: over the byte bound even without room
    assert lru.over(lambda k: False) == ["b"]  # b alone brings it to 100
    assert lru.full(room=0)
    assert lru.pop("c") == 1 and lru.nbytes == 30 and "c" not in lru
    assert lru.pop("missing") is None and lru.nbytes == 30
    assert lru.oldest() == "b"


def test_keybook_counts_repeats_and_stops_capturing_when_keys_do_not_repeat(caplog: pytest.LogCaptureFixture) -> None:
    spec = bcg.breakpoint(name="attn", key=lambda m: m)(lambda x: x).__bcg_breakpoint__
    book = KeyBook(bcg.VariantPolicy(window=4, min_hit_rate=0.5))
    for key in (1, 1, 1, 2):  # 2 of 4 repeat: 50%, keeps capturing
        book.observe(spec, key)
    assert book.stats(spec).capturing
    for key in (3, 4, 5, 3):  # 1 of 4: one low window, still capturing
        book.observe(spec, key)
    assert book.stats(spec).capturing
    with caplog.at_level(logging.WARNING, logger="bcg"):
        for key in (6, 7, 5, 8):  # 1 of 4 again: two low windows in a row, stops
            book.observe(spec, key)
    st = book.summary()["attn"]
    assert st["replays"] == 12 and st["repeats"] == 4
    assert not st["capturing"] and "25%" in st["stopped"] and "two windows" in st["stopped"]
    assert any("attn" in r.getMessage() and "no new variants" in r.getMessage() for r in caplog.records)


def test_keybook_judges_served_replays_when_told() -> None:
    spec = bcg.breakpoint(name="attn", key=lambda m: m)(lambda x: x).__bcg_breakpoint__
    book = KeyBook(bcg.VariantPolicy(window=4))
    for _ in range(8):  # the same key every time, but never served (a cache that thrashes)
        book.observe(spec, 1, served=False)
    assert not book.stats(spec).capturing
    book = KeyBook(bcg.VariantPolicy(window=4))
    for i in range(16):  # 4 keys in rotation: a low first window (first sightings), then all served
        book.observe(spec, i % 4, served=i >= 4)
    assert book.stats(spec).capturing


def test_keybook_remembers_a_bounded_number_of_keys() -> None:
    spec = bcg.breakpoint(name="attn", key=lambda m: m)(lambda x: x).__bcg_breakpoint__
    book = KeyBook(bcg.VariantPolicy(max_variants=2, window=1000))
    for key in range(100):
        book.observe(spec, key)
    book.observe(spec, 99)
    book.observe(spec, 0)  # forgotten long ago: not a repeat
    assert book.stats(spec).repeats == 1


def test_live_tensors_are_found_through_dataclasses_containers_and_attributes() -> None:
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)

    @dataclass
    class Batch:
        cu: torch.Tensor
        extra: dict

    class Obj:
        def __init__(self) -> None:
            self.batch = Batch(a, {"x": [b]})
            self.n = 3

    found = live_tensors((Obj(), c))
    assert {id(t) for t in found} == {id(a), id(b), id(c)}
    assert live_tensors(None) == [] and live_tensors((1, "s")) == []


@bcg.breakpoint(name="scaled", mutates=("out",), key=lambda m: m.lengths)
def scaled(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * sum(bcg.live().lengths))


def _forward(x: torch.Tensor) -> torch.Tensor:
    y = x + 1
    out = torch.empty_like(y)
    scaled(y, out)
    z = out * 2
    out2 = torch.empty_like(z)
    scaled(z, out2)
    return out2 - 1


def test_eager_mode_runs_keyed_breakpoints_eagerly_and_counts_their_keys() -> None:
    x = torch.randn(4)
    graph = bcg.make_graph(_forward, x, live=Meta((1, 2)), mode="eager")
    assert isinstance(graph.forms[0].variants, VariantCache)
    for lengths in [(1, 2), (3,), (1, 2), (2, 2)]:
        x.copy_(torch.randn(4))
        with bcg.live_scope(Meta(lengths)):
            want = _forward(x.clone())
        assert torch.equal(graph.replay(live=Meta(lengths)), want)
    st = graph.stats().keyed["graph"]
    assert st is not None
    bp = st["breakpoints"]["scaled"]
    assert bp["replays"] == 4 and bp["repeats"] == 1  # one key per replay, shared by both calls
    assert bp["misses"] == 8 and bp["hits"] == 0 and bp["captures"] == 0
    assert st["stitched"] is None


def test_eager_mode_refuses_an_unhashable_key() -> None:
    @bcg.breakpoint(name="bad", key=lambda m: list(m.lengths))
    def bad(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    x = torch.randn(4)
    graph = bcg.make_graph(lambda x: bad(x + 1) + 1, x, live=Meta((1,)), mode="eager")
    with pytest.raises(TypeError, match="'bad' returned an unhashable list"):
        graph.replay(live=Meta((1,)))


def test_a_graph_without_keyed_breakpoints_has_no_variants() -> None:
    @bcg.breakpoint
    def plain(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    graph = bcg.make_graph(lambda x: plain(x + 1) + 1, torch.randn(4), mode="eager")
    assert graph.forms[0].variants is None and graph.stats().keyed is None


def test_keys_that_never_repeat_make_the_breakpoint_plain_calls() -> None:
    x = torch.randn(4)
    graph = bcg.make_graph(_forward, x, live=Meta((1,)), mode="eager", variants=bcg.VariantPolicy(window=4))
    for n in range(2, 10):  # never the same key
        with bcg.live_scope(Meta((n,))):
            want = _forward(x.clone())
        assert torch.equal(graph.replay(live=Meta((n,))), want)
    bp = graph.stats().keyed["graph"]["breakpoints"]["scaled"]
    assert not bp["capturing"] and "0%" in bp["stopped"] and "plain breakpoint" in bp["stopped"]
