"""Which holder serves which optimizer shard, at which iteration: the pure planner of every recovery.

No torch, no I/O: the controller plans with it, the ranks read its plans, and the unit tests drive it
with tables. Its input is one *holder* per rank of the job (``holders`` builds it):

    rank -> {"iteration": shard's iteration, "updating": inside its update window,
             "touched": the update's arithmetic has begun, "replica_group": ranks holding the same
             shard, "alive": usable (False: lost, poisoned by a memory error, or restarted and empty)}

* ``plan_dump``: the newest iteration every shard has a usable holder for, and one writer per shard
  (the dying-gasp checkpoint is written from those) — or a refusal naming the shards without one.
* ``plan_repair``: the same choice for an in-place repair, plus the shard copies it needs (every
  holder not at the target gets it from that shard's writer) and who brings a restarted rank its
  counters (its twin).
* ``plan_reload``: without replicas, the periodic checkpoint every rank reloads.
* ``plan_elastic``: scale-in without a spare: which whole data-parallel replicas train on, at which
  data-parallel size and iteration, and which of them serves each shard to the new layout.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, Mapping, Sequence

Shard = tuple[int, ...]                # a shard, named by its sorted replica group
Holders = dict[int, dict[str, Any]]    # rank -> its holder (see above)


@dataclasses.dataclass(frozen=True)
class DumpPlan:
    ok: bool
    iteration: int | None = None
    writers: dict[Shard, int] = dataclasses.field(default_factory=dict)   # shard (sorted replica group) -> rank
    at_target: tuple[int, ...] = ()     # live ranks whose shard is (or, once finished, will be) at `iteration`
    finishing: tuple[int, ...] = ()     # live ranks inside their update: they must finish it before the dump
    missing: tuple[Shard, ...] = ()     # shards with no live holder at all (every replica lost)
    reason: str = ""
    fallback: tuple[int, str] | None = None  # (iteration, path) of the newest periodic checkpoint, or None

    def message(self) -> str:
        if self.ok:
            return (f"dying-gasp checkpoint of iteration {self.iteration}: writers "
                    f"{sorted(self.writers.values())}")
        fb = (f"fall back to the newest periodic checkpoint, iteration {self.fallback[0]} in {self.fallback[1]}"
              if self.fallback else "no periodic checkpoint exists to fall back on")
        return f"dying-gasp checkpoint refused, nothing written: {self.reason}; {fb}"

    def to_wire(self) -> dict[str, Any]:
        """The plan as an order's argument (msgpack: shard tuples become "r,r" keys)."""
        d = dataclasses.asdict(self)
        d["writers"] = {",".join(map(str, g)): r for g, r in self.writers.items()}
        d["missing"] = [list(g) for g in self.missing]
        for k in ("at_target", "finishing"):
            d[k] = list(d[k])
        d["fallback"] = list(self.fallback) if self.fallback else None
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "DumpPlan":
        d = dict(d)
        d["writers"] = {tuple(int(r) for r in g.split(",")): int(w) for g, w in d["writers"].items()}
        for k in ("at_target", "finishing"):
            d[k] = tuple(d[k])
        d["missing"] = tuple(tuple(g) for g in d["missing"])
        d["fallback"] = tuple(d["fallback"]) if d["fallback"] else None
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_wire(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "DumpPlan":
        return cls.from_wire(json.loads(text))


def servable(h: Mapping[str, Any]) -> set[int]:
    """Iterations a holder's shard can be served (written, copied) at.

    Not updating: its ``iteration``. Updating: the optimizer update toward ``iteration + 1`` is local
    arithmetic, so a holder that has begun changing its shard finishes it (the shard is half-updated
    until then and can serve neither iteration); one stopped before touching it (``touched`` False,
    e.g. blocked in the grad-norm all-reduce, which a dead peer never completes) still holds
    ``iteration`` and cannot advance.
    """
    if not h.get("alive", True):
        return set()
    it = int(h["iteration"])
    if not h.get("updating", False):
        return {it}
    return {it + 1} if h.get("touched", True) else {it}


def holders(world: int, statuses: Mapping[int, Mapping[str, Any]],
            groups: Mapping[int, Sequence[int] | None] | None = None, unusable: Iterable[int] = ()) -> Holders:
    """``plan_dump``'s input for the whole job, from what the ranks reported.

    ``statuses``: rank -> its shard status (``iteration``, ``updating``, ``touched``,
    ``replica_group``, ``poisoned``: a memory error corrupted it) for every rank that answered.
    ``groups``: rank -> replica group as known otherwise (registration), for ranks that did not
    answer. ``unusable``: ranks that answered but hold nothing usable otherwise.
    Every other rank is lost; its replica group is the known one, or the survivors' group that
    names it, or just itself (a whole replica group lost: its shard is reported missing)."""
    unusable = set(unusable)
    out: Holders = {}
    s: Mapping[str, Any] | None
    for r in range(world):
        s = statuses.get(r)
        if s is not None and "iteration" in s:
            out[r] = {"iteration": int(s["iteration"]), "updating": bool(s.get("updating", False)),
                      "touched": bool(s.get("touched", True)), "replica_group": list(s["replica_group"]),
                      "alive": r not in unusable and not s.get("poisoned", False)}
    if len(out) == world:
        return out
    # (the lost ranks' groups: as registered, else as a survivor of the same group says)
    known = {int(r): list(g) for r, g in (groups or {}).items() if g}
    for s in statuses.values():
        for m in s.get("replica_group") or ():
            known.setdefault(int(m), list(s["replica_group"]))
    for r in range(world):
        if r not in out:
            out[r] = {"iteration": -1, "updating": False, "touched": False, "alive": False,
                      "replica_group": known.get(r, [r])}
    return {r: out[r] for r in range(world)}


def plan_dump(holders: Holders, fallback: tuple[int, str] | None = None) -> DumpPlan:
    """``holders``: rank -> {"iteration", "updating", "replica_group", "alive"[, "touched"]} for every
    rank of the job (dead ones included: their replica group says which shard is at stake).
    ``fallback``: (iteration, path) of the newest periodic checkpoint, for the refusal message."""
    return _plan_dump(holders, fallback)[0]


def _plan_dump(holders: Holders, fallback: tuple[int, str] | None = None
               ) -> tuple[DumpPlan, dict[int, Shard], dict[int, set[int]]]:
    """``plan_dump``, with each rank's shard and the iterations it can serve (``plan_repair`` reads them
    again: each is worked out once a rank, which counts at 16,384 of them)."""
    shards: dict[Shard, list[int]] = {}
    shard_of: dict[int, Shard] = {}
    for rank, h in holders.items():
        group = tuple(sorted(map(int, h["replica_group"])))
        if rank not in group:
            raise ValueError(f"rank {rank} is not in its own replica group {list(group)}")
        shards.setdefault(group, []).append(rank)
        shard_of[rank] = group
    for group, members in shards.items():
        if sorted(members) != list(group) and any(r in holders for r in group if r not in members):
            raise ValueError(f"replica group {list(group)} is not reported consistently by its ranks")
    # (most holders are alike — at rest at one iteration — and each alike holder gets the same set,
    # which nothing changes)
    alike: dict[tuple[Any, ...], set[int]] = {}
    serves = {}
    for r, h in holders.items():
        key = (h.get("alive", True), h["iteration"], h.get("updating", False), h.get("touched", True))
        got = alike.get(key)
        serves[r] = got if got is not None else alike.setdefault(key, servable(h))

    missing = tuple(sorted(g for g in shards if not any(serves[r] for r in shards[g])))
    if missing:
        lost = ", ".join(str(list(g)) for g in missing)
        return DumpPlan(False, missing=missing, fallback=fallback,
                        reason=f"no live holder for shard(s) with replica group {lost} (every replica lost)"), \
            shard_of, serves

    per_shard = {g: set().union(*(serves[r] for r in shards[g])) for g in shards}
    common = set.intersection(*per_shard.values()) if per_shard else set()
    if not common:
        detail = "; ".join(f"{list(g)}: {sorted(v)}" for g, v in sorted(per_shard.items()))
        return DumpPlan(False, fallback=fallback,
                        reason=f"the live holders cannot be brought to one iteration ({detail})"), shard_of, serves
    target = max(common)
    writers, at_target = {}, []
    for g in sorted(shards):
        able = [r for r in sorted(shards[g]) if target in serves[r]]
        at_target += able
        # Prefer a holder already at rest at the target (nothing to wait for), then the lowest rank.
        writers[g] = min(able, key=lambda r: (bool(holders[r].get("updating")), r))
    finishing = tuple(sorted(r for r, h in holders.items()
                             if h.get("alive", True) and h.get("updating") and h.get("touched", True)))
    return DumpPlan(True, target, writers, tuple(sorted(at_target)), finishing, fallback=fallback), shard_of, serves


@dataclasses.dataclass(frozen=True)
class RepairPlan:
    ok: bool
    iteration: int | None = None
    copies: tuple[tuple[int, int], ...] = ()   # (src, dst): dst's shard is overwritten with src's
    # (restarted rank, or one past the iteration; its twin: it sends the counters, scheduler and RNG)
    joiners: tuple[tuple[int, int], ...] = ()
    reason: str = ""

    @property
    def pairs_flat(self) -> list[int]:
        return [r for pair in self.copies for r in pair]

    @property
    def joiners_flat(self) -> list[int]:
        return [r for pair in self.joiners for r in pair]


def plan_repair(holders: Holders, joiners: Iterable[int] = ()) -> RepairPlan:
    """In-place repair: the dump's choice of iteration and holder per shard; every holder that is
    not usable at that iteration (poisoned, restarted, stopped behind its twin, or past it) gets the
    shard from its writer. Each restarted rank takes its counters from that writer too, and so does a
    holder whose shard is past the iteration: its replica got through a step that the others' did
    not (a pipeline stage's instance whose grad-norm all-reduce completed while its twin's was cut
    short), and it goes back to the iteration with its twin's scheduler, counters and RNG."""
    plan, shard_of, serves = _plan_dump(holders)
    if not plan.ok:
        return RepairPlan(False, reason=plan.reason)
    copies = tuple((plan.writers[shard_of[r]], r) for r in sorted(holders) if plan.iteration not in serves[r])
    assert plan.iteration is not None  # (a plan that is ok has one)
    ahead = {r for r, h in holders.items() if int(h["iteration"]) > plan.iteration}
    sources = tuple((r, plan.writers[shard_of[r]]) for r in sorted(set(joiners) | ahead))
    return RepairPlan(True, plan.iteration, copies, sources)


@dataclasses.dataclass(frozen=True)
class ReloadPlan:
    ok: bool
    iteration: int | None = None
    path: str = ""
    lost_steps: int = 0
    reason: str = ""


def plan_reload(statuses: Mapping[int, Mapping[str, Any]]) -> ReloadPlan:
    """No replicas: every rank reloads the newest periodic checkpoint; the steps since it are lost
    (and recomputed). ``statuses``: rank -> {"checkpoint": [iteration, path] or None, "ended"}."""
    ckpts = {tuple(s["checkpoint"]) if s.get("checkpoint") else None for s in statuses.values()}
    if not statuses or None in ckpts or len(ckpts) != 1:
        return ReloadPlan(False, reason="no replicas and no periodic checkpoint every rank can reload "
                                        "(--save with --save-interval)")
    newest = ckpts.pop()
    assert newest is not None  # ruled out above
    iteration, path = newest
    lost = max(int(s["ended"]) for s in statuses.values()) - int(iteration)
    return ReloadPlan(True, int(iteration), str(path), lost)


@dataclasses.dataclass(frozen=True)
class ElasticPlan:
    ok: bool
    iteration: int | None = None
    dp: int = 0                # the new data-parallel size
    instances: int = 1         # optimizer instances at the new size (2: every shard has a twin)
    kept: tuple[Sequence[int], ...] = ()  # the replicas that train on, in their new data-parallel order
    parked: tuple[int, ...] = ()          # live ranks left out (a replica with a lost rank, or one too many)
    writers: dict[Shard, int] = dataclasses.field(default_factory=dict)  # shard (sorted replica group) -> kept rank
    microbatches: int = 0      # per rank and step at the new size (the global batch is unchanged)
    reason: str = ""
    sources: dict[int, int] = dataclasses.field(default_factory=dict)  # scale-out: newcomer -> the kept rank it copies
    direction: str = "in"      # in: whole replicas dropped; out: newcomer replicas added
    stages: int = 1            # pipeline stages: each replica lists its ranks stage by stage

    @property
    def order(self) -> list[int]:
        """The job ranks of the new layout in their new default-group order: megatron-core lays
        ranks out TP innermost, then data-parallel, then pipeline stage outermost, so each stage's
        ranks of every kept replica come together (without a pipeline: replica after replica)."""
        width = len(self.kept[0]) // self.stages if self.kept else 0
        return [r for s in range(self.stages) for rep in self.kept for r in rep[s * width:(s + 1) * width]]

    @property
    def redundancy(self) -> bool:
        return self.instances > 1

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kept"] = [list(r) for r in self.kept]
        d["parked"] = list(self.parked)
        d["writers"] = {",".join(map(str, g)): r for g, r in self.writers.items()}
        d["sources"] = [x for pair in sorted(self.sources.items()) for x in pair]
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "ElasticPlan":
        d = dict(d)
        d["kept"] = tuple(tuple(int(r) for r in rep) for rep in d["kept"])
        d["parked"] = tuple(d["parked"])
        d["writers"] = {tuple(int(r) for r in g.split(",")): int(w) for g, w in d["writers"].items()}
        flat = [int(x) for x in d.get("sources", ())]
        d["sources"] = dict(zip(flat[0::2], flat[1::2]))
        return cls(**d)

    def message(self) -> str:
        if not self.ok:
            return f"scale-{self.direction} refused: {self.reason}"
        twins = "two optimizer instances" if self.redundancy else \
            "one optimizer instance (no twins until the job scales out again)"
        return (f"scale {self.direction} to data-parallel size {self.dp} at iteration {self.iteration}: replicas "
                f"{[list(r) for r in self.kept]}, {self.microbatches} micro-batches per rank, {twins}"
                + (f"; ranks {list(self.parked)} parked" if self.parked else ""))


def plan_elastic(holders: Holders, replicas: Sequence[Sequence[int]], global_batch: int, micro_batch: int,
                 instances: int = 2, stages: int = 1, experts: int = 1) -> ElasticPlan:
    """Scale in: train on the whole data-parallel replicas that survive, without a spare.

    ``holders``: as for ``plan_dump`` (lost ranks ``alive`` False). ``replicas``: the job's current
    data-parallel replicas in order, each the job ranks of one full TP x PP slice, stage by stage
    (``stages`` of them; the slices are not contiguous with a pipeline, nor after a scale-in). A replica is whole when none of its ranks is lost; only whole
    replicas train on, so every kept rank keeps its TP/PP position and no weight moves.

    The new size is the largest that the whole replicas and the global batch allow (the global
    batch divisible by micro-batch x size) and that keeps ``instances`` optimizer instances (twins),
    parking a healthy replica where an odd size would be larger; only where no such size exists, the
    largest one. It is at least the number of distinct shards: in this
    version every shard is served by a kept replica (one holding it at the target iteration; its
    twins that are dropped could serve it too, but would need a side channel). ``instances``
    optimizer instances when the new size divides by it, else one (no twins until scale-out).
    Replicas are kept in this order: a holder for each shard (the lowest replica that has one),
    then the rest by old order; the new order is the old order of the kept ones.

    With MoE, ``experts`` (the expert-parallel size; expert-TP equal to TP) consecutive replicas
    hold the experts between them, one expert-parallel position each (replica d at d mod
    ``experts``). They stay or go together: kept whole, in order, every rank keeps its experts and
    its expert-parallel groups, and the new size counts such blocks. Twins need the expert
    data-parallel size (size / ``experts``) to divide by ``instances`` too."""
    dump = plan_dump(holders)
    if not dump.ok:
        return ElasticPlan(False, reason=dump.reason)
    target = dump.iteration
    replicas = [tuple(int(r) for r in rep) for rep in replicas]
    alive = [all(holders[r].get("alive", True) for r in rep) for rep in replicas]
    blocks = [range(b, b + experts) for b in range(0, len(replicas) - len(replicas) % experts, experts)]
    whole = [i for block in blocks if all(alive[i] for i in block) for i in block]

    def shards(i: int) -> frozenset[Shard]:  # the shards replica i holds: twins hold the same set
        return frozenset(tuple(sorted(holders[r]["replica_group"])) for r in replicas[i])

    needed = {shards(i) for i in range(len(replicas))}
    serving: dict[frozenset[Shard], int] = {}
    for i in whole:
        if all(target in servable(holders[r]) for r in replicas[i]):
            serving.setdefault(shards(i), i)
    unserved = [k for k in needed if k not in serving]
    if unserved:
        lost = ", ".join(str(sorted(list(g) for g in k)) for k in unserved)
        return ElasticPlan(False, reason=f"no whole surviving replica holds shard(s) {lost} at iteration "
                                         f"{target}: the dying gasp writes them from the holders left")
    first = sorted({b for i in serving.values() for b in range(i - i % experts, i - i % experts + experts)})
    smallest = max(len(needed), len(first))
    sizes = [d for d in range(len(whole), 0, -experts) if global_batch % (micro_batch * d) == 0 and d >= smallest]
    # A size that keeps the twins first (one more replica parked, redundancy kept), then any.
    dp = next((d for d in sizes if (d // experts) % instances == 0), sizes[0] if sizes else None)
    if dp is None:
        unit = f" in blocks of {experts} (the expert-parallel size)" if experts > 1 else ""
        return ElasticPlan(False, reason=f"{len(whole)} whole replica(s) survive; no data-parallel size from "
                                         f"{smallest} (one per shard) to {len(whole)}{unit} divides the global "
                                         f"batch {global_batch} into micro-batches of {micro_batch}")
    chosen = first + [i for i in whole if i not in first][:dp - len(first)]
    kept = tuple(replicas[i] for i in sorted(chosen))
    in_kept = {r for rep in kept for r in rep}
    parked = tuple(sorted(r for r, h in holders.items() if h.get("alive", True) and r not in in_kept))
    writers = {}
    for key, i in serving.items():
        for r in replicas[i]:
            writers[tuple(sorted(holders[r]["replica_group"]))] = r
    return ElasticPlan(True, target, dp, instances if (dp // experts) % instances == 0 else 1, kept, parked, writers,
                       global_batch // (micro_batch * dp), stages=stages)


def plan_scale_out(holders: Holders, replicas: Sequence[Sequence[int]], joiners: Iterable[int], global_batch: int,
                   micro_batch: int, instances: int = 2, stages: int = 1, experts: int = 1,
                   world: int | None = None) -> ElasticPlan:
    """Scale out: ranks that registered again (``joiners``, job ranks; fresh processes holding
    nothing) rejoin the job's ``replicas`` (as for ``plan_elastic``, every one live) as whole
    data-parallel replicas.

    A newcomer replica is one of the job's original TP x PP slices, and only a whole one of joiners
    can come in: ``len(replica)`` consecutive ranks without a pipeline; with ``stages`` of them
    (megatron-core lays the stages outermost, each ``world / stages`` ranks) the TP ranks at the same
    place of every stage. The new size is the largest that the global batch allows (divisible by
    micro-batch x size) and that keeps the optimizer instance count of the current size; newcomers
    beyond it are parked. Every replica of the new layout is ordered by its lowest rank, so a job
    back at its full size has its original layout again. The state comes from one current holder of
    each shard at the newest iteration every shard has (``writers``); each newcomer copies counters,
    scheduler and RNG from the kept rank at its TP/PP position (``sources``). With MoE (``experts``,
    as for ``plan_elastic``) newcomers come in whole blocks of that many replicas, and each copies
    the kept rank at its TP, PP and expert-parallel position."""
    replicas = [tuple(int(r) for r in rep) for rep in replicas]
    if stages > 1 and not world:
        raise ValueError("a pipeline job's scale-out needs the job's world size")
    dump = plan_dump(holders)
    if not dump.ok:
        return ElasticPlan(False, reason=dump.reason, direction="out")
    target, width = dump.iteration, len(replicas[0])
    joined = {int(r) for r in joiners}
    tp = width // stages
    span = world // stages if world else max([*joined, *holders]) + 1  # the ranks of one stage

    def original(d: int) -> tuple[int, ...]:  # the job's d-th replica, stage by stage
        return tuple(s * span + d * tp + t for s in range(stages) for t in range(tp))

    def block(b: int) -> list[tuple[int, ...]]:  # the b-th block of replicas (MoE; else one replica)
        return [original(d) for d in range(b * experts, (b + 1) * experts)]

    def slot(r: int) -> tuple[int, int]:  # (replica index inside its block, place in the replica)
        return (r % span) // tp % experts, (r // span) * tp + r % tp

    came_for = sorted({(r % span) // tp // experts for r in joined})
    whole: list[Sequence[int]] = [rep for b in came_for if {r for rep in block(b) for r in rep} <= joined
                                  for rep in block(b)]
    if not whole:
        unit = f" (with MoE, {experts} of them together)" if experts > 1 else ""
        return ElasticPlan(False, target, direction="out", reason=(
            f"the newcomers {sorted(joined)} make no whole replica{unit}: a replica is {tp} rank(s) on each of "
            f"{stages} pipeline stage(s); start the nodes that hold a replica's ranks together"))
    current = len(replicas)
    now_instances = instances if (current // experts) % instances == 0 else 1
    sizes = [d for d in range(current + len(whole), current, -experts)
             if global_batch % (micro_batch * d) == 0 and ((d // experts) % instances == 0) == (now_instances == instances)]
    if not sizes:
        return ElasticPlan(False, target, direction="out", reason=(
            f"{len(whole)} whole replica(s) of newcomers ({sorted(joined)}) and {current} running; no larger "
            f"data-parallel size up to {current + len(whole)} divides the global batch {global_batch} into "
            f"micro-batches of {micro_batch} with the same optimizer instance count"))
    dp = sizes[0]
    added = whole[:dp - current]
    kept = tuple(sorted(replicas + added, key=min))
    writers = {}
    for rep in replicas:  # the first (lowest) replica holding a shard at the target serves it
        for r in rep:
            key = tuple(sorted(holders[r]["replica_group"]))
            if key not in writers and target in servable(holders[r]):
                writers[key] = r
    sources = {r: replicas[slot(r)[0]][slot(r)[1]] for rep in added for r in rep}
    parked = tuple(sorted(joined - set(sources)))
    return ElasticPlan(True, target, dp, now_instances, kept, parked, writers,
                       global_batch // (micro_batch * dp), sources=sources, direction="out", stages=stages)
