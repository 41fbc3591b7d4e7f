"""Prefix-affinity placement: the prefix key (router/admission/prefix_keys.py) and PrefixAffinity (router/fleet/policies.py), pure."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from hypothesis import given, strategies as st

from tailguard.router.admission import key_chars, prefix_key
from tailguard.router.fleet import LeastLoaded, PrefixAffinity, rendezvous_order, rendezvous_weight, url_seed

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tailguard.router.fleet import Endpoint


@dataclass
class FakeEndpoint:
    """What a policy reads of an endpoint."""

    url: str
    in_flight: int = 0
    borrowed: int = 0
    seats: int = 1000
    usable: bool = True

    @property
    def placement_load(self) -> int:
        return self.in_flight

    @property
    def rendezvous_seed(self) -> hashlib.blake2b:
        return url_seed(self.url)

    @property
    def has_room(self) -> bool:
        return self.usable and self.in_flight < self.seats


def endpoints(n: int, loads: Sequence[int] = ()) -> list[Endpoint]:
    loads = list(loads) or [0] * n
    return [cast("Endpoint", FakeEndpoint(f"http://engine-{i}:8000", loads[i])) for i in range(n)]


def keys(n: int) -> list[bytes]:
    return [k for i in range(n) if (k := prefix_key({"prompt": f"tenant {i} system prompt"})) is not None]


def policy(c: float = 1.25) -> PrefixAffinity:
    return PrefixAffinity(random.Random(0), c=c)


def placed(pool: Sequence[Endpoint], key: bytes, c: float = 1.25) -> Endpoint:
    placement = policy(c).place(pool, key)
    assert placement is not None
    return placement.endpoint


def test_same_key_same_endpoints_same_choice_in_any_order() -> None:
    pool = endpoints(5)
    for key in keys(50):
        first = placed(pool, key)
        assert placed(list(reversed(pool)), key) is first


def test_the_key_and_the_choice_are_equal_in_another_process() -> None:
    """Salted hash() would differ between processes; blake2b does not."""
    script = (
        "from tailguard.router.admission.prefix_keys import prefix_key;"
        "from tailguard.router.fleet.policies import rendezvous_weight;"
        "k = prefix_key({'messages': [{'role': 'system', 'content': 'be brief'}]});"
        "print(k.hex(), rendezvous_weight(k, 'http://a'))"
    )
    key = prefix_key({"messages": [{"role": "system", "content": "be brief"}]})
    assert key is not None
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True, env={"PYTHONHASHSEED": "123"}
    ).stdout.split()
    assert out == [key.hex(), str(rendezvous_weight(key, "http://a"))]


def test_an_endpoint_leaving_remaps_only_the_keys_it_held() -> None:
    pool = endpoints(5)
    many = keys(2000)
    before = {key: rendezvous_order(key, pool)[0] for key in many}
    gone = pool[2]
    after = {key: rendezvous_order(key, [e for e in pool if e is not gone])[0] for key in many}
    moved = [key for key in many if before[key] is not after[key]]
    assert all(before[key] is gone for key in moved)
    assert len(moved) == sum(1 for home in before.values() if home is gone)
    assert 2000 / 5 * 0.8 < len(moved) < 2000 / 5 * 1.2  # its share, about a fifth


def test_an_endpoint_joining_takes_only_its_share() -> None:
    pool = endpoints(5)
    many = keys(2000)
    before = {key: rendezvous_order(key, pool[:4])[0] for key in many}
    after = {key: rendezvous_order(key, pool)[0] for key in many}
    moved = [key for key in many if before[key] is not after[key]]
    assert all(after[key] is pool[4] for key in moved)
    assert 2000 / 5 * 0.8 < len(moved) < 2000 / 5 * 1.2


def test_keys_spread_over_the_endpoints() -> None:
    pool = endpoints(4)
    homes = Counter(rendezvous_order(key, pool)[0].url for key in keys(4000))
    assert len(homes) == 4
    assert max(homes.values()) < 1.15 * 1000


@given(st.lists(st.integers(0, 20), min_size=1, max_size=8), st.binary(min_size=16, max_size=16))
def test_a_key_new_here_is_held_to_the_mean_in_rendezvous_order(loads: list[int], key: bytes) -> None:
    pool = endpoints(len(loads), loads)
    chosen = placed(pool, key, 3.0)  # whatever c: a key never placed is most likely cached nowhere
    bound = policy(1.0).bound(pool)
    assert chosen.placement_load + 1 <= bound  # the least loaded is always eligible, so the bound never gives way
    order = rendezvous_order(key, pool)
    assert all(e.placement_load + 1 > bound for e in order[: order.index(chosen)])  # earlier ones were over it


@given(st.lists(st.integers(0, 20), min_size=1, max_size=8), st.binary(min_size=16, max_size=16), st.floats(1.0, 3.0))
def test_a_known_key_stays_home_within_c_times_the_mean(loads: list[int], key: bytes, c: float) -> None:
    pool = endpoints(len(loads))
    affinity = policy(c)
    assert affinity.place(pool, key) == (rendezvous_order(key, pool)[0], "home")  # idle: it goes home, remembered
    for endpoint, load in zip(pool, loads, strict=True):
        cast("FakeEndpoint", endpoint).in_flight = load
    again = affinity.place(pool, key)
    assert again is not None
    bound = affinity.bound(pool)
    assert again.endpoint.placement_load + 1 <= bound
    order = rendezvous_order(key, pool)
    assert all(e.placement_load + 1 > bound for e in order[: order.index(again.endpoint)])


def test_unique_keys_stay_as_level_as_least_loaded() -> None:
    pool = endpoints(4)
    affinity = policy(1.25)
    for placed_so_far, key in enumerate(keys(400), start=1):
        chosen = affinity.place(pool, key)
        assert chosen is not None
        cast("FakeEndpoint", chosen.endpoint).in_flight += 1
        assert max(e.placement_load for e in pool) <= -(-placed_so_far // 4)  # never above the mean, rounded up
    assert [e.placement_load for e in pool] == [100] * 4


def test_a_key_that_spilled_at_first_goes_back_where_it_went_and_its_home_comes_back() -> None:
    pool = endpoints(4)
    key = keys(1)[0]
    order = rendezvous_order(key, pool)
    affinity = policy(1.25)
    cast("FakeEndpoint", order[0]).in_flight = 6  # busy at first sight: the key spills
    first = affinity.place(pool, key)
    assert first == (order[1], "spilled")
    cast("FakeEndpoint", order[0]).in_flight = 0
    assert affinity.place(pool, key) == (order[1], "home")  # where its prefix was cached, not the idle rendezvous home
    cast("FakeEndpoint", order[1]).usable = False  # it leaves: the rendezvous order decides meanwhile
    assert affinity.place(pool, key) == (order[0], "home")
    cast("FakeEndpoint", order[1]).usable = True  # back: so is the key
    assert affinity.place(pool, key) == (order[1], "home")


def test_the_memory_is_bounded_least_recently_used_first() -> None:
    pool = endpoints(4)
    affinity = PrefixAffinity(random.Random(0), remember=2)
    first, second, third = keys(3)
    order = rendezvous_order(first, pool)
    cast("FakeEndpoint", order[0]).in_flight = 6
    assert affinity.place(pool, first) == (order[1], "spilled")  # remembered on order[1]
    cast("FakeEndpoint", order[0]).in_flight = 0
    affinity.place(pool, second)
    affinity.place(pool, third)  # past two keys: the first, least recently used, is forgotten
    assert affinity.place(pool, first) == (order[0], "home")


def test_a_hot_key_spills_in_rendezvous_order_and_no_endpoint_exceeds_the_bound() -> None:
    pool = endpoints(4)
    key = keys(1)[0]
    order = rendezvous_order(key, pool)
    affinity = policy(1.25)
    for _ in range(64):
        chosen = affinity.place(pool, key)
        assert chosen is not None
        assert chosen.kind == ("home" if chosen.endpoint is order[0] else "spilled")
        cast("FakeEndpoint", chosen.endpoint).in_flight += 1
        assert max(e.placement_load for e in pool) <= affinity.bound(pool)
    assert order[0].placement_load >= order[-1].placement_load


def test_the_home_takes_the_request_while_within_the_bound() -> None:
    pool = endpoints(4, [3, 3, 3, 3])
    key = keys(1)[0]
    assert policy().place(pool, key) == (rendezvous_order(key, pool)[0], "home")


def test_no_key_goes_to_the_least_loaded() -> None:
    pool = endpoints(4, [5, 2, 7, 3])
    assert policy().choose(pool, None, borrowed=False) == (pool[1], "no_key")
    assert LeastLoaded(random.Random(0)).choose(pool, keys(1)[0], borrowed=False) == (pool[1], "least_loaded")


def test_a_borrowed_seat_goes_to_least_loaded_packing() -> None:
    pool = endpoints(3, [1, 0, 1])
    cast("FakeEndpoint", pool[2]).borrowed = 1
    assert policy().choose(pool, keys(1)[0], borrowed=True) == (pool[2], "borrowed")


def test_a_key_places_by_affinity() -> None:
    pool = endpoints(4)
    key = keys(1)[0]
    assert policy().choose(pool, key, borrowed=False) == (rendezvous_order(key, pool)[0], "home")


def test_a_full_or_excluded_home_spills_down_the_order_and_says_so() -> None:
    pool = endpoints(4)
    key = keys(1)[0]
    order = rendezvous_order(key, pool)
    assert policy().choose(pool, key, borrowed=False, exclude=[order[0]]) == (order[1], "spilled")
    full = cast("FakeEndpoint", order[0])
    full.seats = full.in_flight = 3  # at its cap, and the bound lets the rest in
    assert policy().choose(pool, key, borrowed=False) == (order[1], "spilled")
    full.seats, full.usable = 1000, False  # out (ejected, unhealthy): the next one is the home now
    assert policy().choose(pool, key, borrowed=False) == (order[1], "home")


def test_no_candidates_no_choice() -> None:
    assert policy().place([], keys(1)[0]) is None
    assert policy().place(endpoints(2, [1, 1]), keys(1)[0], exclude=endpoints(0)) is not None


def test_hints_override_the_text_key_in_their_order() -> None:
    chat = {"messages": [{"role": "user", "content": "hello"}]}
    text = prefix_key(chat)
    by_session = prefix_key(chat, "session-1")
    by_user = prefix_key({**chat, "user": "u1"}, "session-1")
    by_cache_key = prefix_key({**chat, "user": "u1", "prompt_cache_key": "conv-9"}, "session-1")
    assert len({text, by_session, by_user, by_cache_key}) == 4
    assert by_cache_key == prefix_key({"messages": [{"role": "user", "content": "other"}], "prompt_cache_key": "conv-9"})
    assert by_user == prefix_key({"prompt": "anything", "user": "u1"})
    assert by_session == prefix_key({"prompt": "anything"}, "session-1")
    assert prefix_key({"prompt": "x", "user": "k"}) != prefix_key({"prompt": "x", "prompt_cache_key": "k"})


def test_prompts_sharing_their_leading_blocks_share_the_key() -> None:
    system = "You are a support agent for ACME. " * 200  # longer than the key covers
    first = prefix_key({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "my order?"}]})
    second = prefix_key({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "refund"}]})
    assert first == second
    assert prefix_key({"prompt": system + "a"}) == prefix_key({"prompt": system + "b"})


def test_prompts_differing_in_the_first_block_differ() -> None:
    tail = "x" * key_chars()
    assert prefix_key({"prompt": "A" + tail}) != prefix_key({"prompt": "B" + tail})
    system = {"role": "system", "content": "be brief"}
    assert prefix_key({"messages": [system]}) != prefix_key({"messages": [{"role": "user", "content": "be brief"}]})


@given(st.text(min_size=1), st.text(), st.text())
def test_only_the_leading_characters_count(head: str, tail1: str, tail2: str) -> None:
    chars = len(head)
    assert prefix_key({"prompt": head + tail1}, chars=chars) == prefix_key({"prompt": head + tail2}, chars=chars)


def test_prompt_forms() -> None:
    assert prefix_key({"prompt": ["first", "second"]}) == prefix_key({"prompt": "first"})
    assert prefix_key({"prompt": [1, 2, 3]}) == prefix_key({"prompt": [1, 2, 3, 4]}, chars=3 * 4)  # 4 characters a token
    assert prefix_key({"prompt": [1, -1]}) != prefix_key({"prompt": [1, 2**40]})  # odd ids spelled out, never raising
    assert prefix_key({"prompt": [1, 2, 3]}) != prefix_key({"prompt": [1, 2, 4]})
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]}]}
    assert prefix_key(parts) == prefix_key({"messages": [{"role": "user", "content": "hi"}]})
    assert prefix_key({}) is None
    assert prefix_key({"prompt": ""}) is None
    assert prefix_key({"model": "m", "messages": []}) is None


def test_a_bound_factor_below_one_is_refused() -> None:
    try:
        PrefixAffinity(random.Random(0), c=0.9)
    except ValueError:
        return
    raise AssertionError("c < 1 accepted")


def homed(pool: Sequence[Endpoint], home: Endpoint, *, other_than: Sequence[bytes] = ()) -> bytes:
    """A key whose rendezvous home over ``pool`` is ``home``."""
    return next(k for k in keys(200) if rendezvous_order(k, pool)[0] is home and k not in other_than)


def test_lent_seats_start_their_pack_at_the_key_home_and_keep_to_it_and_the_pools_own_keep_off() -> None:
    pool = endpoints(3)
    first = policy().choose(pool, keys(1)[0], borrowed=True)
    assert first == (rendezvous_order(keys(1)[0], pool)[0], "borrowed")  # no pack yet: it starts at the key's home
    pack = cast("FakeEndpoint", first.endpoint)
    pack.borrowed = pack.in_flight = 1
    elsewhere = next(e for e in pool if e is not first.endpoint)
    second = policy().choose(pool, homed(pool, elsewhere), borrowed=True)
    assert second == (first.endpoint, "borrowed")  # packed with the other lent seat, though its home is elsewhere
    own = policy().choose(pool, homed(pool, first.endpoint), borrowed=False)
    assert own is not None and own.endpoint is not first.endpoint and own.kind == "spilled"  # off the pack while it can
    for e in pool:
        if e is not first.endpoint:
            cast("FakeEndpoint", e).seats = 0  # full: the pack is all that has room
    assert policy().choose(pool, homed(pool, first.endpoint), borrowed=False) == (first.endpoint, "home")


def test_a_key_hotter_than_one_endpoints_share_goes_to_the_least_loaded() -> None:
    # Every request starts with the same system prompt (the Mooncake trace): once the window knows, its home is no
    # better than any engine, and holding it at c x the mean would cost that engine 25% more work.
    pool = endpoints(4)
    key = keys(1)[0]
    affinity = policy(1.25)
    first = [affinity.place(pool, key) for _ in range(PrefixAffinity.HOT_WINDOW)]  # the window learns it (loads 0)
    assert {p.kind for p in first if p is not None} == {"home"}
    for e, load in zip(pool, [5, 2, 3, 4], strict=True):
        cast("FakeEndpoint", e).in_flight = load
    kinds: Counter[str] = Counter()
    for _ in range(100):
        chosen = affinity.place(pool, key)
        assert chosen is not None and chosen.endpoint.placement_load == min(e.placement_load for e in pool)
        kinds[chosen.kind] += 1
        cast("FakeEndpoint", chosen.endpoint).in_flight += 1
    assert kinds == {"hot_key": 100}
    assert max(e.placement_load for e in pool) - min(e.placement_load for e in pool) <= 1  # level


def test_a_hot_key_lives_on_a_set_of_engines_as_large_as_its_share_needs() -> None:
    """A key with ~30% of the traffic over 8 engines: its set is the first ceil(1.1 x 0.3 x 8) = 3 of its rendezvous
    order, the same on every replica; the rest of the traffic (unique keys) goes on as before. Its set grows down
    that order when its members are past the load bound, and back when they are not."""
    pool = endpoints(8)
    hot = keys(1)[0]
    order = rendezvous_order(hot, pool)
    affinity = policy(1.1)
    others = (k for i in range(10_000) if (k := prefix_key({"prompt": f"unique {i}"})) is not None)
    used: Counter[str] = Counter()
    for i in range(4 * PrefixAffinity.HOT_WINDOW):  # 3 of every 10 placements are the hot key's
        key = hot if i % 10 < 3 else next(others)
        chosen = affinity.place(pool, key)
        assert chosen is not None
        if key is hot and chosen.kind == "hot_key":
            used[chosen.endpoint.url] += 1
            cast("FakeEndpoint", chosen.endpoint).in_flight += 1
        elif key is not hot:
            cast("FakeEndpoint", chosen.endpoint).in_flight += 1
        if i % 3 == 2:  # requests end: loads stay low, every engine within the bound
            for e in pool:
                cast("FakeEndpoint", e).in_flight = max(0, e.in_flight - 1)
    assert set(used) == {e.url for e in order[:3]}, used
    assert min(used.values()) > 0.1 * sum(used.values())  # least loaded within the set: shared among the three
    # Its set past the bound: the next in its rendezvous order takes it.
    for e in pool:
        cast("FakeEndpoint", e).in_flight = 10 if e in order[:3] else 2
    chosen = affinity.place(pool, hot)
    assert chosen is not None and (chosen.endpoint, chosen.kind) == (order[3], "hot_key")


def test_keys_at_one_endpoints_share_or_less_keep_their_homes() -> None:
    pool = endpoints(4)
    tenants = keys(4)  # four keys, a quarter of the traffic each: one engine's share, not more
    affinity = policy(1.25)
    kinds = Counter(chosen.kind for i in range(3 * PrefixAffinity.HOT_WINDOW) if (chosen := affinity.place(pool, tenants[i % 4])))
    assert "hot_key" not in kinds
    halves, affinity = keys(2), policy(1.25)  # two keys, half the traffic each: hot once the window is full
    kinds = Counter(chosen.kind for i in range(3 * PrefixAffinity.HOT_WINDOW) if (chosen := affinity.place(pool, halves[i % 2])))
    assert kinds["hot_key"] == 2 * PrefixAffinity.HOT_WINDOW
