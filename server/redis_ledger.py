"""The shared admission ledger on Redis: one Lua script, one round trip a sync.

Keys, under the namespace ``NS``:
- ``NS:alive:REPLICA`` -- the replica's lease, set with a TTL at every sync; its value names the
  process (``AdmissionLedger.incarnation``), so a restarted one under the same id is told apart;
- ``NS:grant:RESOURCE`` -- a hash, replica -> "SEATS RESERVE pPROCESS": seats of the resource's cap
  recorded as its own, and its reserve (``Want.share``: counted against the others as seats are);
  absent when both are 0;
- ``NS:want:RESOURCE`` -- a hash, replica -> "PRIORITY SINCE pPROCESS": the most urgent class
  priority waiting there, and when the oldest request of that priority came (wall-clock ms);
- ``NS:used:RESOURCE`` -- a hash, replica -> "USED SINCE_MS pPROCESS": what of the resource is in use
  there (absent: none), so a replica can tell a cap that is full across replicas from one held as
  idle blocks, and since when the oldest of it counts (0: not said; a budget's window says it).
  Each entry names the process that wrote it: another process under the same replica id (which
  may never sync that key) does not inherit it;
- ``NS:held:RESOURCE`` -- for resources whose use outlives a lease (``Want.hold``: a budget's
  sliding window), a hash, "REPLICA INCARNATION" -> "GRANT RESERVE UNTIL_MS": a replica's grant (and
  its reserve, if Redis went away while it was alive: only then could it use it), counted after its
  lease lapses until what it admitted has left the window (Redis's own clock):
  ``hold`` and the lease after its last sync of the key, or, if later, of anything
  (``NS:seen:REPLICA INCARNATION``, kept ten minutes): a key is not in every sync;
- ``NS:poke:REPLICA`` -- a set of an API key's resources a request waits for on another replica
  while this one holds some (``Want.sparse``): it carries them at its next sync;
- ``NS:epoch`` -- the ledger's memory, made by the first sync that finds none: a sync naming
  another (its replica's grants are not here: Redis restarted empty, or was flushed) is refused;
- ``NS:clock``, ``NS:resumed``, ``NS:paused`` -- the last sync, and the first after nobody synced
  for half a lease (and the last before it); ``NS:members`` -- a hash, replica -> its last sync:
  who must have synced again before grants grow after an outage (router/quotas/ledger_recovery.py);
- ``NS:served:POOL`` -- a hash, "REPLICA<tab>TENANT" -> the tokens that replica served the tenant
  (over its weight) since it started, ``NS:served-sum:POOL`` their sum per tenant and
  ``NS:served-changed:POOL`` when each tenant's last changed: fair shares traded across replicas
  (``trade_service``, router/queueing/fair_share_sync.py), kept an hour after the last trade.

A sync carries the replica's wall-clock deadline for it: one Redis runs
later (it was stopped with the sync queued, the replica having given up on
it and fallen back) changes nothing.

The script runs atomically in Redis, so grants are decided one replica at a
time: a grant grows only by seats that no live replica holds (the grants of
replicas whose lease has lapsed are dropped on the way); while another live
replica has a request waiting that comes first -- more urgent, or as
urgent and older by more than the want's ``tolerance`` -- a grant keeps only
the seats the replica may be using until it hears the answer (``keep``: its
grant during the round trip, then at its next sync the seats in use) and
does not grow, so seats that free up go to the first request. Each answer
also says, per resource, the most urgent priority waiting on the other
replicas and when the oldest of them came, so a seat freed between two
syncs goes back too (``router.quotas.ledger.Yielding``). coredis (anyio, so it runs
under Trio) speaks the protocol.

A sync is tried once: the budget's next sync is the retry, and a failed one
falls back to the static shares (``router.quotas.ledger.AdmissionLedger``, which logs
the outage once when it begins and once when it ends). coredis's own retries
would only spend the sync's half-lease deadline on a Redis that is away, and
log a line for each attempt (three a sync, ~24 a second a replica). The
script is run by its digest and loaded again when Redis answers that it has
lost it (a restarted Redis), here, not by coredis's retrying ``Script``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import coredis
from coredis.exceptions import NoScriptError
from coredis.retry import NoRetryPolicy

from tailguard.router.quotas import NO_TERMS, NO_WAITER, Synced, SyncTerms, Want

_SYNC = """
-- Redis 3.2 and 4 replicate a script by its effects only when asked: it reads TIME before writing
if redis.replicate_commands then redis.replicate_commands() end
local prefix, me, ttl, n, me_as = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local known, deadline, probe = ARGV[6], tonumber(ARGV[7]), ARGV[8] == '1'
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if deadline > 0 and now_ms > deadline then
  -- the replica gave up on this sync (Redis was stopped with it queued): it must change nothing
  return {'late', '', now_ms, 0, 0, 0, 0, 0}
end
-- the ledger's memory: made anew by the first sync that finds none (a new, restarted or flushed Redis)
local epoch = redis.call('GET', prefix .. 'epoch')
if not epoch then
  epoch = t[1] .. '.' .. t[2]
  redis.call('SET', prefix .. 'epoch', epoch)
end
-- nobody synced for half a lease (Redis stopped, or new): replicas may be on fallback caps it does not count
-- (``paused``: the last sync before that; the replicas that synced within a lease of it were alive then)
local last = tonumber(redis.call('GET', prefix .. 'clock') or '0')
local resumed = tonumber(redis.call('GET', prefix .. 'resumed') or '0')
local paused = tonumber(redis.call('GET', prefix .. 'paused') or '0')
if last == 0 or now_ms - last > ttl / 2 then
  resumed, paused = now_ms, last
  redis.call('SET', prefix .. 'resumed', resumed)
  redis.call('SET', prefix .. 'paused', paused)
end
redis.call('SET', prefix .. 'clock', now_ms)
if known ~= '' and known ~= epoch then
  -- this replica's grants are not in this memory: it must claim them again before anything is granted
  return {'epoch', epoch, now_ms, resumed, paused, 0, 0, 0}
end
if probe then
  return {'probe', epoch, now_ms, resumed, paused, 0, 0, 0}
end
redis.call('SET', prefix .. 'alive:' .. me, me_as, 'PX', ttl)
-- when this process last synced anything: what it holds of a key counts after its death from then, not
-- from the key's own last sync (a key is not in every sync; it may have admitted under its grant since)
redis.call('SET', prefix .. 'seen:' .. me .. ' ' .. me_as, now_ms, 'PX', 600000)
local members_key = prefix .. 'members'
redis.call('HSET', members_key, me, now_ms)
local members = redis.call('HGETALL', members_key)
local header = {'ok', epoch, now_ms, resumed, paused, 0}
local listed = {}
for j = 1, #members, 2 do
  if tonumber(members[j + 1]) < math.min(last, now_ms) - 600000 then  -- gone ten minutes before the last sync
    redis.call('HDEL', members_key, members[j])
  else
    listed[#listed + 1] = members[j]
    listed[#listed + 1] = members[j + 1]
  end
end
local poke_key = prefix .. 'poke:' .. me
local pokes = redis.call('SMEMBERS', poke_key)
if #pokes > 0 then redis.call('DEL', poke_key) end
local alive = {}  -- replica -> the incarnation its live lease names, or false
local function incarnation(replica)
  if alive[replica] == nil then
    alive[replica] = redis.call('GET', prefix .. 'alive:' .. replica) or false
  end
  return alive[replica]
end
-- an entry counts while its replica's lease lives, and names the process that holds it now: a
-- restarted process under the same id has not claimed what the last one left (entries end "... AS")
local function live(replica, value)
  local now_as = incarnation(replica)
  if now_as == false then return false end
  local as = string.match(value, ' p(%S*)$')
  return as == nil or as == now_as
end
local as_tag = 'p' .. me_as  -- this process, in the entries it writes (a letter first: told from a number)
local no_waiter = tonumber(ARGV[#ARGV])
local out = {}
local contended = 0  -- 1 when a request waits on another replica: everyone syncs sooner
for i = 0, n - 1 do
  local base = 9 + i * 13
  local name = ARGV[base]
  local cap, target, urgency = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  local in_use, keep = tonumber(ARGV[base + 4]), tonumber(ARGV[base + 5])
  local since, tolerance = tonumber(ARGV[base + 6]), tonumber(ARGV[base + 7])
  local hold, used_since = tonumber(ARGV[base + 8]), tonumber(ARGV[base + 9])
  local share, reserve_keep, sparse = tonumber(ARGV[base + 10]), tonumber(ARGV[base + 11]), ARGV[base + 12] == '1'
  local yielding = 0
  local grants_key, wants_key, used_key = prefix .. 'grant:' .. name, prefix .. 'want:' .. name, prefix .. 'used:' .. name
  local grants = redis.call('HGETALL', grants_key)
  local others = 0
  local holders = {}  -- the other live replicas holding some of it (grant or reserve)
  for j = 1, #grants, 2 do
    local replica = grants[j]
    local seats, spare = string.match(grants[j + 1], '^(%d+) ?(%d*)')
    local claim = tonumber(seats) + (tonumber(spare) or 0)
    if replica == me then
      -- rewritten below
    elseif live(replica, grants[j + 1]) then
      others = others + claim
      if claim > 0 then holders[#holders + 1] = replica end
    else
      redis.call('HDEL', grants_key, replica)
      redis.call('HDEL', wants_key, replica)
      redis.call('HDEL', used_key, replica)
    end
  end
  local used = redis.call('HGETALL', used_key)
  local elsewhere, elsewhere_since = 0, 0  -- in use on the others, and since when the oldest of it (0: not said)
  local function older(first)
    if first > 0 and (elsewhere_since == 0 or first < elsewhere_since) then elsewhere_since = first end
  end
  for j = 1, #used, 2 do
    if used[j] ~= me and live(used[j], used[j + 1]) then
      local count, first = string.match(used[j + 1], '^(%d+) ?(%d*)')
      elsewhere = elsewhere + tonumber(count)
      older(tonumber(first) or 0)
    end
  end
  local held_key = prefix .. 'held:' .. name
  if hold > 0 then
    -- what replicas gone since (or earlier processes under a live id) admitted still counts until it has
    -- left the window: their grant as last recorded, and their reserve if Redis went away while they were
    -- alive (only then could they have used it), until the time recorded with them
    local held = redis.call('HGETALL', held_key)
    for j = 1, #held, 2 do
      local who, as = string.match(held[j], '^(.*) (%S+)$')
      local seats, reserve, till = string.match(held[j + 1], '^(%d+) (%d+) (%S+)$')
      if seats == nil then seats, till = string.match(held[j + 1], '^(%S+) (%S+)$') end
      if who == me and as == me_as then
        -- this process's own: rewritten below
      elseif who ~= nil and incarnation(who) == as then
        -- a live replica's: its grant is counted already
      else
        -- its process's last sync (of anything), or this key's if later: what it admitted is taken as that young
        local seen = tonumber(redis.call('GET', prefix .. 'seen:' .. held[j]) or '0')
        local last_sync = math.max(tonumber(till or '0') - ttl - hold, seen)
        if seats ~= nil and last_sync + ttl + hold > now_ms then
          local counted = tonumber(seats)
          if resumed > last_sync and paused < last_sync + ttl then counted = counted + (tonumber(reserve) or 0) end
          others = others + counted
          elsewhere = elsewhere + counted
          older(last_sync)
        else
          redis.call('HDEL', held_key, held[j])
        end
      end
    end
  end
  local wants = redis.call('HGETALL', wants_key)
  local urgent, urgent_since = no_waiter, 0  -- the first request waiting on another replica: priority, arrival
  for j = 1, #wants, 2 do
    if wants[j] ~= me and live(wants[j], wants[j + 1]) then
      contended = 1
      local priority, came = string.match(wants[j + 1], '^(%d+) (%d+)')
      if priority == nil then priority, came = wants[j + 1], 0 end
      priority, came = tonumber(priority), tonumber(came)
      if priority < urgent or (priority == urgent and came < urgent_since) then
        urgent, urgent_since = priority, came
      end
      if priority < urgency or (priority == urgency and came + tolerance < since) then
        -- a request that comes first (more urgent, or as urgent and older) waits elsewhere: this replica
        -- keeps only the seats it may be using until it hears this answer (its next sync gives back those
        -- it does not use), and takes none of the free ones
        target = math.min(target, math.max(keep, 0))
        yielding = 1
      end
    end
  end
  local granted = math.max(0, math.min(target, cap - others))
  -- a reserve of what nobody holds, while nobody waits for it elsewhere; what the replica may use until it
  -- hears this answer (``keep`` and its last reserve) stays recorded whatever the new reserve
  local spare = 0
  if share > 0 and urgent == no_waiter then spare = math.floor(share * math.max(0, cap - others - granted)) end
  local claim = math.max(granted + spare, keep + reserve_keep)
  if claim == 0 then
    redis.call('HDEL', grants_key, me)
  elseif claim > granted then
    redis.call('HSET', grants_key, me, string.format('%d %d %s', granted, claim - granted, as_tag))
  else
    redis.call('HSET', grants_key, me, string.format('%d 0 %s', granted, as_tag))
  end
  if hold > 0 then
    -- kept past this replica's lease: what it may admit until then leaves the window ``hold`` later
    local who = me .. ' ' .. me_as
    if claim == 0 then
      redis.call('HDEL', held_key, who)
    else
      redis.call('HSET', held_key, who, string.format('%d %d %.0f', granted, claim - granted, now_ms + ttl + hold))
      -- (a key with use here is carried again within ``hold``, when its oldest admission leaves)
      redis.call('PEXPIRE', held_key, ttl + 2 * hold + 1000)
    end
  end
  if urgency < no_waiter then
    redis.call('HSET', wants_key, me, string.format('%d %.0f %s', urgency, since, as_tag))
    if sparse and granted < target then
      -- a key's resource others hold while a request waits for it here: they sync it at once to say
      -- what they use of it (its resources are not in every sync)
      for _, holder in ipairs(holders) do
        redis.call('SADD', prefix .. 'poke:' .. holder, name)
        redis.call('PEXPIRE', prefix .. 'poke:' .. holder, ttl)
      end
    end
  else
    redis.call('HDEL', wants_key, me)
  end
  if in_use > 0 then
    redis.call('HSET', used_key, me, string.format('%d %.0f %s', in_use, used_since, as_tag))
  else
    redis.call('HDEL', used_key, me)
  end
  out[#out + 1] = granted
  out[#out + 1] = elsewhere
  out[#out + 1] = yielding
  out[#out + 1] = urgent
  out[#out + 1] = urgent_since
  out[#out + 1] = elsewhere_since
  out[#out + 1] = spare
end
header[6] = contended
header[#header + 1] = #listed / 2
for _, value in ipairs(listed) do header[#header + 1] = value end
header[#header + 1] = #pokes
for _, value in ipairs(pokes) do header[#header + 1] = value end
for _, value in ipairs(out) do header[#header + 1] = value end
return header
"""


class LateSync(Exception):
    """Redis ran a sync after the replica's deadline for it: it changed nothing."""


def _answer(result: list[Any], wants: int, deadline: float) -> Synced:
    """The script's flat answer: a header (status, epoch, clock, members, pokes), then 7 numbers per want."""
    status, epoch, now_ms, resumed_ms, paused_ms = str(result[0]), str(result[1]), int(result[2]), int(result[3]), int(result[4])
    contended = int(result[5])
    if status == "late":
        raise LateSync(
            f"Redis ran the sync {now_ms / 1000 - deadline:.2f} s after this replica gave up on it "
            "(Redis stalled, or its clock is ahead of this replica's by that much)"
        )
    at = 7 + 2 * int(result[6])
    members = {str(result[i]): int(result[i + 1]) / 1000 for i in range(7, at, 2)}
    pokes = [str(name) for name in result[at + 1 : at + 1 + int(result[at])]]
    numbers = [int(value) for value in result[at + 1 + len(pokes) :]]
    if status != "ok":
        numbers = [0] * (7 * wants)
    return Synced(
        grants=numbers[0::7],
        contended=bool(contended),
        elsewhere=numbers[1::7],
        yielding=[bool(y) for y in numbers[2::7]],
        urgent=numbers[3::7],
        urgent_since=[ms / 1000 for ms in numbers[4::7]],
        elsewhere_since=[ms / 1000 for ms in numbers[5::7]],
        reserves=numbers[6::7],
        status=status,
        epoch=epoch,
        now=now_ms / 1000,
        resumed=resumed_ms / 1000,
        paused=paused_ms / 1000,
        members=members,
        poked=pokes,
    )


_SERVED_KEPT_MS = 3_600_000  # a pool's traded totals outlive an hour without trades by no replica

_TRADE = """
-- per pool: this replica's totals that changed, written with the sum over every replica and when each
-- tenant changed; back, the tenants changed since this replica's last trade (all at its first): the sum and its own
local prefix, me, kept, npools = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {now}
local at = 5
for p = 1, npools do
  local pool, since, n = ARGV[at], tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2])
  at = at + 3
  local served, sums, changed = prefix .. 'served:' .. pool, prefix .. 'served-sum:' .. pool, prefix .. 'served-changed:' .. pool
  for i = 1, n do
    local tenant, total = ARGV[at], ARGV[at + 1]
    at = at + 2
    local field = me .. '\t' .. tenant
    local before = tonumber(redis.call('HGET', served, field) or '0')
    redis.call('HSET', served, field, total)
    redis.call('HINCRBYFLOAT', sums, tenant, tonumber(total) - before)
    redis.call('ZADD', changed, now, tenant)
  end
  if n > 0 then
    for _, key in ipairs({served, sums, changed}) do redis.call('PEXPIRE', key, kept) end
    redis.call('ZREMRANGEBYSCORE', changed, '-inf', now - kept)
  end
  local tenants
  if since == 0 then tenants = redis.call('HKEYS', sums) else tenants = redis.call('ZRANGEBYSCORE', changed, since, '+inf') end
  out[#out + 1] = pool
  out[#out + 1] = #tenants
  for _, tenant in ipairs(tenants) do
    out[#out + 1] = tenant
    out[#out + 1] = redis.call('HGET', sums, tenant) or '0'
    out[#out + 1] = redis.call('HGET', served, me .. '\t' .. tenant) or '0'
  end
end
return out
"""


class RedisLedger:
    """``router.quotas.ledger.LedgerStore`` on one Redis (``redis://host:port/db``).

    Use it as an async context manager: coredis keeps its connections in a
    task group that lives as long as the block.
    """

    def __init__(self, url: str, namespace: str, *, timeout: float = 1.0) -> None:
        self._client: Any = coredis.Redis.from_url(
            url, decode_responses=True, stream_timeout=timeout, connect_timeout=timeout, retry_policy=NoRetryPolicy()
        )
        self._prefix = namespace + ":"
        self._sha = hashlib.sha1(_SYNC.encode()).hexdigest()
        self._trade_sha = hashlib.sha1(_TRADE.encode()).hexdigest()
        self._traded: dict[tuple[str, str], int] = {}  # (replica, pool) -> Redis's clock at its last trade (ms)

    async def sync(
        self, replica: str, lease_ttl: float, wants: Sequence[Want], incarnation: str = "", *, terms: SyncTerms = NO_TERMS
    ) -> Synced:
        """``router.quotas.ledger.LedgerStore.sync``.

        Raises:
          LateSync: Redis ran it after ``terms.deadline`` (this replica had given up on it): nothing changed.
        """
        args: list[str | int | float] = [
            self._prefix, replica, max(1, round(lease_ttl * 1000)), len(wants), incarnation or "-",
            terms.epoch, round(terms.deadline * 1000), int(terms.probe),
        ]
        for want in wants:
            keep = want.in_use if want.keep is None else want.keep
            since, tolerance = round(want.since * 1000), round(want.tolerance * 1000)  # milliseconds: integers in Lua
            hold, used_since = round(want.hold * 1000), round(want.used_since * 1000)
            args += [want.resource, want.cap, want.target, want.best_waiting, want.in_use, keep, since, tolerance, hold, used_since]
            args += [repr(want.share), want.reserve_keep, int(want.sparse)]
        args.append(NO_WAITER)
        return _answer(await self._run_script(args), len(wants), terms.deadline)
    async def trade_service(self, replica: str, served: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
        """``router.queueing.fair_share_sync.ServiceStore``: record this replica's totals, return the others' sums, per pool and tenant.

        Only the tenants whose totals changed (anywhere) since this replica's
        last trade of the pool come back; all of them at its first.
        """
        args: list[str | int] = [self._prefix, replica, _SERVED_KEPT_MS, len(served)]
        for pool, tenants in served.items():
            args += [pool, self._traded.get((replica, pool), 0), len(tenants)]
            for tenant, total in tenants.items():
                args += [tenant, repr(total)]
        result = list(await self._script(_TRADE, self._trade_sha, args))
        now, at = int(result[0]), 1
        theirs: dict[str, dict[str, float]] = {}
        while at < len(result):
            pool, count = str(result[at]), int(result[at + 1])
            at += 2
            sums: dict[str, float] = {}
            for i in range(at, at + 3 * count, 3):
                others = float(result[i + 1]) - float(result[i + 2])
                if abs(others) > 1e-9:
                    sums[str(result[i])] = others
            at += 3 * count
            theirs[pool] = sums
            self._traded[(replica, pool)] = now
        return theirs

    async def _run_script(self, args: Sequence[str | int | float]) -> list[Any]:
        return await self._script(_SYNC, self._sha, args)

    async def _script(self, script: str, sha: str, args: Sequence[str | int | float]) -> list[Any]:
        """A script by its digest; loaded first where Redis does not have it (a new or restarted one)."""
        try:
            return list(await self._client.evalsha(sha, keys=[], args=args))
        except NoScriptError:
            await self._client.script_load(script)
            return list(await self._client.evalsha(sha, keys=[], args=args))

    async def grants(self, resource: str) -> dict[str, int]:
        """Every replica's recorded grant of ``resource`` (tests and the benchmark check the ledger)."""
        raw = await self._client.hgetall(self._prefix + "grant:" + resource)
        return {str(k): int(str(v).split()[0]) for k, v in raw.items()}  # "GRANT" or "GRANT RESERVE"

    async def wants(self, resource: str) -> dict[str, int]:
        """Every replica's most urgent class priority waiting for ``resource`` (absent: none waits there)."""
        raw = await self._client.hgetall(self._prefix + "want:" + resource)
        return {str(k): int(str(v).split()[0]) for k, v in raw.items()}

    async def __aenter__(self) -> RedisLedger:
        await self._client.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._client.__aexit__(*exc_info)
