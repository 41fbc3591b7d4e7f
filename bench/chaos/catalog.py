"""The chaos run's attacks, in run order: the first rounds' (``bench.chaos.attacks``), then issue 32's.

Issue 32's rows (``abuse``, ``operations``, ``tenants``) come before the gRPC
flood; the flood and the shed evasion run with the gRPC gate as shipped
(``abuse.SHIPPED_GATE``), which the lab's small pools would otherwise lower.
"""

from __future__ import annotations

from dataclasses import replace

from bench.chaos.abuse import MANY_CHOICES, SHIPPED_GATE, costly, many_choices, shed_evasion
from bench.chaos.attacks import ATTACKS as FIRST_ROUNDS, Attack, Phase
from bench.chaos.lab import SHIPPED_GRPC_GATE, Lab, Setup
from bench.chaos.operations import black_hole, relayed_messages, reload_removes_pool
from bench.chaos.tenants import BUDGETS, TENANTS, TENANTS_CLUSTER, budgets_redis_restart, tenant_cardinality

FLOOD = "gRPC flood"

ISSUE_32: tuple[Attack, ...] = (
    Attack("n > 1", "n = 4..8 choices (streamed and whole) and n = 32, beside normal traffic; a budgeted key's n = 8", many_choices, setup=MANY_CHOICES),
    Attack("costly bodies", "5 a second of 3 MB bodies: 100,000 empty text parts, 100,000 one-letter messages", costly),
    Attack("reload removes a pool", "the interactive pool full and queued, then a reload without it (its class to batch)", reload_removes_pool),
    Attack(
        "relayed engine messages", "engines a (400), a and b (500, 401) answer errors quoting the Authorization they got (tailguard's engine key)", relayed_messages, fresh=True
    ),
    Attack(
        "black hole (shipped timeouts)",
        "engine a accepts and never answers from before tailguard starts; shipped timeouts and health checks; 20 streams",
        black_hole,
        setup=Setup(shipped_timeouts=True),
        start_fault={"mode": "hang"},
        normal=False,
    ),
    Attack("tenant cardinality", "3 sets of budgeted API keys rotated by reloads, one request each; then idle", tenant_cardinality, setup=TENANTS, normal=False),
    Attack(
        "tenant cardinality [cluster]",
        "the same with [cluster] on a real redis-server",
        tenant_cardinality,
        setup=TENANTS_CLUSTER,
        normal=False,
    ),
    Attack(
        "budgets across an empty Redis restart",
        "two replicas, a busy key (2x its budget) and a quiet one (1/3); Redis killed and started empty",
        budgets_redis_restart,
        setup=BUDGETS,
    ),
)


def _at_shipped_gate(attack: Attack) -> Attack:
    """``attack`` with the gRPC gate as shipped, said in its row."""

    async def run(lab: Lab, phase: Phase) -> None:
        phase.extra["grpc_gate"] = {"shipped": SHIPPED_GRPC_GATE, "pools_seat_and_queue": lab.setup.room}
        await attack.run(lab, phase)

    return replace(attack, run=run, setup=SHIPPED_GATE)


def _run_order() -> tuple[Attack, ...]:
    first = [a for a in FIRST_ROUNDS if a.name != FLOOD]
    flood = [_at_shipped_gate(a) for a in FIRST_ROUNDS if a.name == FLOOD]
    shed = Attack(
        "shed evasion",
        "gRPC calls beyond what the pools hold on one channel: one authorization value, then a new one per call",
        shed_evasion,
        setup=SHIPPED_GATE,
    )
    return (*first, *ISSUE_32, *flood, shed)


ATTACKS = _run_order()
