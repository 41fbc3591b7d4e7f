"""The router's rebalancing loop in virtual time, and what it did: moves (whole engines, seat moves) and each pool's seats.

``Router.run`` is not started in the virtual fleet (its health checks and
scrapes would call engines that answer in-process), so rebalancing, which
it would run every ``[rebalance] interval`` seconds, runs here: the same
``Router.rebalance_turn`` on the same interval, in the fleet's nursery, so
moves and seat shares happen in virtual time as in the router.

A seat move changes the books inside the turn (``Fleet.move_seats``): the
router's move count rises during the call. A whole move only starts there
and is counted when its engine has drained and joined; so the seat moves
are the count's rise inside turns, and the whole moves the rest.

A share made by a seat move takes its engine's client when it is made
(``Endpoint.new_share``), which ``plug_engines`` has by then replaced with
the in-process ``EngineClient``: requests on a share reach the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from tailguard.router import Router
from tailguard.router.config import Config


@dataclass
class Rebalancing:
    """What rebalancing did in one point (``pool_seats`` at its end: each pool's cap, ``PoolStatistics.max_concurrency``)."""

    whole_moves: int = 0  # engines that changed pools (joined: a move still draining at the end is in ``draining``)
    seat_moves: int = 0  # moves of seats of an engine into or out of a share
    draining: int = 0  # whole moves begun but not joined at the end
    pool_seats: dict[str, int] = field(default_factory=dict)

    def text(self) -> str:
        seats = " : ".join(f"{name} {seats}" for name, seats in self.pool_seats.items())
        draining = f", {self.draining} draining" if self.draining else ""
        return f"{self.whole_moves} whole-engine move(s), {self.seat_moves} seat move(s){draining}; seats {seats}"


def rebalances(config: Config) -> bool:
    """Whether rebalancing can move anything: a pool with ``rebalance = "auto"`` holding a movable endpoint.

    Without one, every look finds nothing to move (no endpoint is movable and
    no share exists), so the loop is left out and a set-up runs as before.
    """
    return any(pool.rebalance == "auto" and any(e.movable for e in pool.endpoints) for pool in config.pools)


class RebalanceLoop:
    """``Router.rebalance_turn`` every ``interval`` s, as ``Router.run`` does, counting the moves it makes."""

    def __init__(self, router: Router, interval: float) -> None:
        self._router = router
        self._interval = interval
        self._seat_moves = 0

    def _moves(self) -> int:
        return sum(self._router.statistics().moves.values())

    async def run(self, nursery: trio.Nursery) -> None:
        """Look, forever; whole moves finish (drain, then join) in ``nursery``."""
        while True:
            await trio.sleep(self._interval)
            before = self._moves()
            self._router.rebalance_turn(nursery)
            self._seat_moves += self._moves() - before

    def result(self) -> Rebalancing:
        """What it did so far, and each pool's seats now."""
        stats = self._router.statistics()
        return Rebalancing(
            whole_moves=sum(stats.moves.values()) - self._seat_moves,
            seat_moves=self._seat_moves,
            draining=len(stats.moving),
            pool_seats={pool.name: pool.max_concurrency for pool in stats.pools},
        )
