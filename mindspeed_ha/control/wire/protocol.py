"""Wire protocol of the control plane: every message, its version, its limits.

A message is a msgpack map ``{"v": VERSION, "t": TYPE, ...fields}`` sent as one ZeroMQ frame (the
ROUTER adds the peer identity frame). ``decode`` returns a validated dict or raises ``ProtocolError``;
callers drop what fails and count it in ``DropCounter`` -- a bad peer must never crash or stall the
controller or a processor.

Orders' arguments, results and the status a controller reports are *trees*: msgpack maps (string
keys), lists and scalars, as deep as ``MAX_DEPTH``, checked whole and never cut. The limits are sized
for a job of 16,384 ranks: a repair plan names two ranks per shard copy, a status report a few
hundred bytes per rank.
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable

import msgpack

VERSION = 7
MAX_BYTES = 64 * 1024 * 1024    # one frame: the status of 16,384 ranks is about 4 MB
MAX_LIST = 1 << 20              # any list: ranks of the job (pairs of them), shards, status rows
MAX_STR = 1 << 20               # any string (a diagnosis, a path, an error with its causes)
MAX_KEYS = 1 << 16              # any map
MAX_DEPTH = 8                   # nesting of a tree
MAX_INT = 2 ** 62

FAULT_KINDS = ("memory-error", "comm-failure", "other", "process-exit", "hang", "heartbeat-lost",
               "controller-lost", "node-lost", "preempted")
PHASES = ("startup", "forward", "backward", "grad-sync", "optimizer", "param-sync", "checkpoint",
          "step", "unknown", "recovery", "rebuild", "resize")
INJECT_KINDS = ("kill", "exit", "exception", "bug", "uce", "hang", "comm", "ecc", "slow")
INJECT_PHASES = ("forward", "backward", "grad-sync", "optimizer", "param-sync", "step-end", "checkpoint", "recovery",
                 "rebuild", "connect", "resize", "pipeline-send", "pipeline-recv")


class ProtocolError(ValueError):
    pass


_int, _str, _bool, _float = "int", "str", "bool", "float"


# What a field of each kind may hold. One predicate per kind, found by a dict lookup, and trees
# walked with plain loops: every heartbeat and answer passes through here on the controller's one
# thread (at 16k ranks, 8,000 heartbeats a second and 16,384 answers a round).
def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -MAX_INT < v < MAX_INT


def _is_index(v: object) -> bool:  # (a rank, a shard: never negative)
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_INT


def _is_str(v: object) -> bool:
    return isinstance(v, str) and len(v) <= MAX_STR


def _list_of(v: object, ok: Callable[[object], bool]) -> bool:
    if not isinstance(v, list) or len(v) > MAX_LIST:
        return False
    for x in v:
        if not ok(x):
            return False
    return True


def _is_ints(v: object) -> bool:
    if not isinstance(v, list) or len(v) > MAX_LIST:
        return False
    for x in v:  # (ranks and pids: ints as decoded, judged inline; anything else by _is_index)
        if not (type(x) is int and 0 <= x < MAX_INT) and not _is_index(x):
            return False
    return True


def _is_map(v: object) -> bool:
    return isinstance(v, dict) and _tree(v, MAX_DEPTH)


def _whole(t: str) -> Callable[[object], bool]:
    """One rank's message of type ``t`` inside an agent's batch (an answer, a heartbeat): whole."""
    def ok(v: object) -> bool:
        if not isinstance(v, dict) or v.get("t") != t:
            return False
        try:
            validate(v)
        except ProtocolError:
            return False
        return True
    return ok


_KINDS: dict[str, Any] = {
    _int: _is_int,
    _str: _is_str,
    _bool: lambda v: isinstance(v, bool),
    _float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v == v,
    "ints": _is_ints,
    "groups": lambda v: _list_of(v, _is_ints),
    "strs": lambda v: _list_of(v, _is_str),
    "map": _is_map,  # order arguments, status reports
    "tree": lambda v: _tree(v, MAX_DEPTH),  # a handler's result: any tree
    "maps": lambda v: _list_of(v, _is_map),  # each rank's own part of a status (folding.py)
    "results": lambda v: _list_of(v, _whole("result")),
    "beats": lambda v: _is_beats(v),
    "answers": lambda v: _list_of(v, _whole("answers")),
}


def _is_beats(v: object) -> bool:
    """A node's heartbeats as columns (``folding.as_columns``): ``ranks``; ``same``, fields of a
    heartbeat every one of them has alike; ``each``, the others, a value a rank (None: the rank's
    lacks it). Each rank's heartbeat put back together is a whole one."""
    if type(v) is not dict or not v.keys() <= _BEATS_KEYS or not _is_ints(v.get("ranks")):
        return False
    n, same, each = len(v["ranks"]), v.get("same", {}), v.get("each", {})
    if type(same) is not dict or type(each) is not dict:
        return False
    fields = SCHEMAS["hb"]
    for name, value in same.items():
        spec = fields.get(name)
        if spec is None or name == "rank" or not _KINDS[spec[0]](value):
            return False
    for name, values in each.items():
        spec = fields.get(name)
        if spec is None or name == "rank" or name in same or type(values) is not list or len(values) != n:
            return False
        ok = _KINDS[spec[0]]
        for value in values:
            if value is None:
                if spec[1]:  # (a field every heartbeat has)
                    return False
            elif not ok(value):
                return False
    return n == 0 or all(name in same or name in each for name in _REQUIRED["hb"] if name != "rank")


_BEATS_KEYS = frozenset(("ranks", "same", "each"))


def _tree(value: object, depth: int) -> bool:
    """Is ``value`` a tree (what ``decode`` can give back) no deeper than ``depth``? A map or list of
    the exact types msgpack decodes to is walked here, its scalars judged inline (a status answer is
    mostly scalars and short lists, and a call per scalar was most of its decoding); anything else (a
    scalar on its own, a tuple, a subclass) by ``_tree_of_any``."""
    kind = type(value)
    values: Any
    if kind is dict:
        if depth <= 0 or len(value) > MAX_KEYS:  # type: ignore[arg-type]
            return False
        for key in value:  # type: ignore[attr-defined]
            if not isinstance(key, str) or len(key) > 256:
                return False
        values = value.values()  # type: ignore[attr-defined]
    elif kind is list:
        if depth <= 0 or len(value) > MAX_LIST:  # type: ignore[arg-type]
            return False
        values = value
    else:
        return _tree_of_any(value, depth)
    depth -= 1
    for v in values:
        kind = type(v)
        if kind is int:
            if not -MAX_INT < v < MAX_INT:
                return False
        elif kind is str:
            if len(v) > MAX_STR:
                return False
        elif not (kind is bool or kind is float or v is None or _tree(v, depth)):
            return False
    return True


def _tree_of_any(value: object, depth: int) -> bool:
    if value is None or isinstance(value, (bool, float)):
        return True
    if isinstance(value, int):
        return -MAX_INT < value < MAX_INT
    if isinstance(value, str):
        return len(value) <= MAX_STR
    if depth <= 0:
        return False
    if isinstance(value, (list, tuple)):
        if len(value) > MAX_LIST:
            return False
        for v in value:
            if not _tree(v, depth - 1):
                return False
        return True
    if isinstance(value, dict):
        if len(value) > MAX_KEYS:
            return False
        for k, v in value.items():
            if not isinstance(k, str) or len(k) > 256 or not _tree(v, depth - 1):
                return False
        return True
    return False


# type -> {field: (kind, required)}. Unknown fields are rejected too: a peer speaking a newer version
# must bump VERSION rather than be half-understood.
R, O = True, False
SCHEMAS: dict[str, dict[str, tuple[str, bool]]] = {
    # processor -> controller
    # A rank's messages carry its incarnation: ``pid`` (and, registering, ``restarts``). The controller
    # drops those of a process it declared lost, and tells that process to exit.
    "register": {"rank": (_int, R), "world": (_int, R), "node": (_str, R), "pid": (_int, R),
                 "local_rank": (_int, O), "groups": ("groups", O), "host": (_str, O), "epoch": (_int, O),
                 "iteration": (_int, O), "standby": (_str, O), "restarts": (_int, O),
                 "agent_node": (_int, O), "strategies": ("strs", O)},
    "hb": {"rank": (_int, R), "it": (_int, R), "upd": (_bool, R), "health": (_str, R),
           "phase": (_str, O), "progress": (_float, O), "wait": (_bool, O), "pid": (_int, O), "steps": (_int, O),
           "busy": (_float, O), "ckpt": (_int, O), "held": (_str, O),
           # waited in its collectives past --ha-desync-after: its counts by group (rank/processor/long_wait.py)
           "desync": ("map", O),
           # through its agent's relay: ``now``, to be passed on at once (it ends a recovery, says the
           # rank is held); ``age``, the seconds it waited at the agent (the controller's clock of it)
           "now": (_bool, O), "age": (_float, O)},
    # A survivor whose training thread left the step's collectives for a stop: the collectives it issued
    # by then, for the peers still waiting in one it never entered (as a faulted rank's report carries them).
    "left": {"rank": (_int, R), "pid": (_int, O), "entered": ("map", R)},
    # A report that a link re-sends to a new controller carries ``rid``, its sender's own id for it:
    # the controller that recovered it names it in ``settled``, and nobody acts on it again.
    "fault": {"rank": (_int, R), "kind": (_str, R), "iteration": (_int, R), "phase": (_str, R),
              "detail": (_str, O), "at": (_float, O), "pid": (_int, O), "rid": (_str, O),
              # the rank's place in the default group and its counts of the collectives it issued
              "entered": ("map", O),
              # software (an error of the job's own code) or fault; where it was raised in that code
              "class": (_str, O), "frame": (_str, O)},
    # ``kind``: a failed answer's fault kind, where its handler raised a fault (a memory or communication error)
    "result": {"rank": (_int, R), "action": (_str, R), "id": (_int, R), "ok": (_bool, R),
               "data": ("tree", O), "error": (_str, O), "kind": (_str, O), "pid": (_int, O)},
    "bye": {"rank": (_int, R), "pid": (_int, O)},
    # the scheduler preempts the job (a signal to a rank or an agent): dying gasp, then exit
    "preempt": {"signal": (_int, R), "rank": (_int, O), "node_rank": (_int, O), "pid": (_int, O),
                "rid": (_str, O)},
    # agent -> controller
    # ``store``: host:port of the job store this agent serves, or stands ready to (the job store
    # moves there should the one in use be lost)
    # ``relay``: the agent passes the controller's orders to its ranks and their answers back
    # (``relayed``: the ranks whose process is connected to it, by ``relayed_pids``)
    "agent": {"node": (_str, R), "node_rank": (_int, R), "nnodes": (_int, R), "pid": (_int, R),
              "ranks": ("ints", R), "pids": ("ints", R), "store": (_str, O), "relay": (_bool, O),
              "relayed": ("ints", O), "relayed_pids": ("ints", O)},
    # ``beats``: its ranks' heartbeats that came to its relay since its last one, as columns: what they
    # say alike once, the rest a value a rank (folding.as_columns)
    "agent_hb": {"node_rank": (_int, R), "spares": (_int, O), "relayed": ("ints", O), "relayed_pids": ("ints", O),
                 "beats": ("beats", O)},
    # the answers of its ranks to the controller's orders, as many as came in one turn of its loop;
    # ``same``: those that several of them gave to one order, each once with their ranks (most rounds'
    # "ok", a status); ``items``: the others, one by one
    "results": {"node_rank": (_int, R), "items": ("results", R), "same": ("answers", O)},
    # (inside ``results`` only: not a message of its own) one answer, given by ``ranks`` (``pids``; 0: not
    # said): alike, or, with ``own``, each rank's ``data`` is ``data`` with its own part over it (a
    # status: what the node's ranks have alike goes once, folding.py), in the order of ``ranks``
    "answers": {"action": (_str, R), "id": (_int, R), "ok": (_bool, R), "data": ("tree", O), "error": (_str, O),
                "kind": (_str, O), "ranks": ("ints", R), "pids": ("ints", R), "own": ("maps", O)},
    # processor -> its agent's relay: this process takes its orders there too
    "relay_hello": {"rank": (_int, R), "pid": (_int, R)},
    "health": {"node_rank": (_int, R), "ranks": ("ints", R), "detail": (_str, O)},
    "exit": {"node_rank": (_int, R), "rank": (_int, R), "pid": (_int, R), "code": (_int, O),
             "signal": (_int, O), "at": (_float, O), "iteration": (_int, O), "phase": (_str, O),
             "rid": (_str, O)},
    # cli -> controller
    "status?": {},
    "inject": {"kind": (_str, R), "rank": (_int, R), "step": (_int, O), "phase": (_str, O), "factor": (_float, O)},
    "migrate": {"rank": (_int, R), "reason": (_str, O)},
    # controller -> peers
    # ``store``: host:port of the job store in use (it moved from --master-addr when that one was lost)
    # ``endpoint``: passed on by a relaying agent to the ranks whose heartbeats it carried, naming the
    # controller it came from (the rank takes it only from the controller its own link is connected to)
    "ack": {"epoch": (_int, R), "state": (_str, R), "standby": (_bool, O), "backups": ("strs", O),
            "store": (_str, O), "endpoint": (_str, O)},
    # ``ranks``: to an agent that relays, for those of its ranks (each gets the order without it)
    "do": {"action": (_str, R), "id": (_int, R), "args": ("map", O), "epoch": (_int, R), "ranks": ("ints", O)},
    "status": {"body": ("map", R)},
    "settled": {"rids": ("strs", R)},  # reports whose fault a recovery has dealt with: never re-send them
    "refused": {"reason": (_str, R)},
    # to a relaying agent: the heartbeats it passed on for these ranks were not taken (not registered
    # here, or from a process declared lost): each is to register on its own link
    "unheard": {"ranks": ("ints", R)},
}

class DropCounter:
    """Counts dropped input per reason; logs the first of each reason and then every 1000th."""

    def __init__(self, log: logging.Logger):
        self.counts: collections.Counter[str] = collections.Counter()
        self._log = log
        self._lock = threading.Lock()

    def drop(self, reason: str, detail: str = "") -> None:
        with self._lock:
            self.counts[reason] += 1
            n = self.counts[reason]
        if n == 1 or n % 1000 == 0:
            self._log.warning("dropped input (%s, %d so far): %s", reason, n, detail[:200])

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def decoded(self, frame: bytes) -> dict[str, Any] | None:
        """``decode(frame)``, or None with the frame counted as malformed."""
        try:
            return decode(frame)
        except ProtocolError as e:
            self.drop("malformed", str(e))
            return None


# (each type's required fields, once)
_REQUIRED = {t: tuple(name for name, (_, required) in schema.items() if required) for t, schema in SCHEMAS.items()}


def encode(t: str, **fields: Any) -> bytes:
    msg = {"v": VERSION, "t": t}
    msg.update(fields)
    validate(msg)  # we never send what we would refuse to read
    data: bytes = msgpack.packb(msg, use_bin_type=True)
    return data


def encode_each(t: str, key: str, values: list[Any], **fields: Any) -> list[bytes]:
    """``encode(t, **fields, key=value)`` for each of ``values``, the other fields validated and packed
    once: one order to each node's agent, naming its ranks (its arguments can be a whole job's plan)."""
    if not values:
        return []
    validate({"v": VERSION, "t": t, **fields, key: values[0]})
    ok = _KINDS[SCHEMAS[t][key][0]]
    packer = msgpack.Packer(use_bin_type=True)
    head = {"v": VERSION, "t": t, **fields}
    shared = packer.pack_map_header(len(head) + 1) + b"".join(packer.pack(k) + packer.pack(v)
                                                              for k, v in head.items()) + packer.pack(key)
    out = []
    for value in values:
        if not ok(value):
            raise ProtocolError(f"field {key!r}: bad {SCHEMAS[t][key][0]}")
        out.append(shared + packer.pack(value))
    return out


def decode(frame: bytes) -> dict[str, Any]:
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError("not bytes")
    if len(frame) > MAX_BYTES:
        raise ProtocolError(f"oversized ({len(frame)} bytes)")
    try:
        msg: dict[str, Any] = msgpack.unpackb(frame, raw=False, strict_map_key=True,
                                              max_array_len=MAX_LIST, max_map_len=MAX_KEYS, max_str_len=MAX_STR,
                                              max_bin_len=0, max_ext_len=0)
    except Exception as e:  # msgpack raises many types for garbage
        raise ProtocolError(f"undecodable: {type(e).__name__}") from None
    validate(msg)  # (raises unless msg is a map of the schema)
    return msg


def validate(msg: object) -> None:
    if not isinstance(msg, dict):
        raise ProtocolError("not a map")
    if msg.get("v") != VERSION:
        raise ProtocolError(f"version {msg.get('v')!r} != {VERSION}")
    t = msg.get("t")
    if not isinstance(t, str) or t not in SCHEMAS:
        raise ProtocolError(f"unknown type {t!r}")
    schema = SCHEMAS[t]
    for name, value in msg.items():
        if name == "v" or name == "t":
            continue
        spec = schema.get(name)
        if spec is None:
            raise ProtocolError(f"unknown field {name!r} in {t!r}")
        kind, is_a = spec[0], type(value)
        # (the commonest kinds judged inline: a heartbeat is nine of them)
        if is_a is int and kind is _int:
            if -MAX_INT < value < MAX_INT:
                continue
        elif is_a is str and kind is _str:
            if len(value) <= MAX_STR:
                continue
        elif is_a is float and kind is _float:
            if value == value:  # (not NaN)
                continue
        elif (is_a is bool and kind is _bool) or _KINDS[kind](value):
            continue
        raise ProtocolError(f"field {name!r}: bad {kind}")
    for name in _REQUIRED[t]:
        if name not in msg:
            raise ProtocolError(f"missing field {name!r} in {t!r}")
