"""The producer table's bound: the largest principal gives way first, least recently used first."""

from __future__ import annotations

from receivers.producer_table import ProducerTable, principal_of


def key(principal: str, producer: str) -> str:
    return f"\0{principal}\0{producer}" if principal else producer


def test_principal_of_a_key() -> None:
    assert principal_of(key("app", "p1")) == "app"
    assert principal_of("p1") == ""


def test_one_principal_is_plain_lru_and_busy_producers_stay() -> None:
    table: ProducerTable[bool] = ProducerTable()  # state: may it go?
    for i in range(4):
        table.add(f"p{i}", True)
    table.touch("p0")
    table.add("p4", True)
    table.add("busy", False)
    assert table.evict(3, lambda free: free) == ["p1", "p2", "p3"]
    assert list(table) == ["p0", "p4", "busy"]
    table.add("busy2", False)
    assert table.evict(1, lambda free: free) == ["p0", "p4"]  # over the bound while the rest are busy
    assert list(table) == ["busy", "busy2"]


def test_a_flood_evicts_the_flooders_own() -> None:
    table: ProducerTable[bool] = ProducerTable()
    table.add(key("victim", "v"), True)  # the least recently used of all
    for i in range(10):
        table.add(key("flood", f"f{i}"), True)
        table.evict(5, lambda free: free)
    assert key("victim", "v") in table
    assert len(table) == 5
    assert [k for k in table if principal_of(k) == "flood"] == [key("flood", f"f{i}") for i in range(6, 10)]


def test_principals_of_equal_size_give_way_least_recently_used_first() -> None:
    table: ProducerTable[bool] = ProducerTable()
    for producer in ("a1", "b1", "a2", "b2"):
        table.add(key(producer[0], producer), True)
    assert table.evict(2, lambda free: free) == [key("a", "a1"), key("b", "b1")]
    assert table.evict(0, lambda free: free) == [key("a", "a2"), key("b", "b2")]
    assert len(table) == 0
