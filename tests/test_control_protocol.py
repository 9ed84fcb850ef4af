"""Protocol: round trips, limits, validation, and a fuzz of the decoders and of a live controller."""
import collections
import copy
import math
import re
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

from mindspeed_ha.control.wire import protocol, security
from mindspeed_ha.control.controller import Controller
from mindspeed_ha.options import HAOptions

SAMPLES = {
    "register": dict(rank=1, world=4, node="n0", pid=12, local_rank=1, groups=[[1, 3]], host="h", iteration=-1),
    "hb": dict(rank=1, it=5, upd=False, health="ok", phase="forward", progress=1.5, steps=4, busy=0.05, ckpt=4),
    "fault": dict(rank=1, kind="memory-error", iteration=3, phase="optimizer", detail="x", at=1.0, rid="12.fault.1"),
    "left": dict(rank=2, pid=12, entered={"member": 2, "counts": {"k-dp": 3}}),
    "result": dict(rank=1, action="stop", id=3, ok=True, data={"iteration": 3, "replica_group": [1, 3]}),
    "bye": dict(rank=2),
    "preempt": dict(signal=15, rank=2, pid=7),
    "agent": dict(node="n", node_rank=0, nnodes=1, pid=5, ranks=[0, 1], pids=[7, 8]),
    "agent_hb": dict(node_rank=0, spares=1, relayed=[0, 1], relayed_pids=[7, 8],
                     beats={"ranks": [1, 2], "same": {"it": 5, "upd": False, "health": "ok"},
                            "each": {"pid": [8, 9], "age": [0.012, None]}}),
    "results": dict(node_rank=0, items=[{"v": protocol.VERSION, "t": "result", "rank": 1, "action": "stop", "id": 3,
                                         "ok": True, "pid": 8, "data": "park requested"}],
                    same=[{"v": protocol.VERSION, "t": "answers", "action": "stop", "id": 3, "ok": True, "data": "ok",
                           "ranks": [2, 3], "pids": [9, 0]},
                          {"v": protocol.VERSION, "t": "answers", "action": "ha-status", "id": 4, "ok": True,
                           "data": {"iteration": 3}, "ranks": [4, 5], "pids": [10, 11],
                           "own": [{"rank": 4}, {"rank": 5}]}]),
    "answers": dict(action="rebuild", id=4, ok=False, error="x", ranks=[0, 1], pids=[7, 8]),
    "relay_hello": dict(rank=1, pid=8),
    "health": dict(node_rank=0, ranks=[2], detail="health check: ECC"),
    "exit": dict(node_rank=0, rank=1, pid=9, code=0, signal=9, at=2.0, iteration=4, phase="backward"),
    "status?": {},
    "inject": dict(kind="kill", rank=1, step=3, phase="forward"),
    "migrate": dict(rank=2, reason="operator"),
    "ack": dict(epoch=1, state="normal", standby=False, backups=["tcp://127.0.0.1:1"], endpoint="tcp://127.0.0.1:2"),
    "do": dict(action="exit", id=4, args={"code": 1, "diagnosis": "d"}, epoch=1, ranks=[0, 1]),
    "status": dict(body={"state": "normal", "ranks": [{"rank": 0}]}),
    "refused": dict(reason="no"),
    "unheard": dict(ranks=[1]),
    "settled": dict(rids=["12.fault.1", "5.exit.9"]),
}


def test_every_type_has_a_sample():
    assert set(SAMPLES) == set(protocol.SCHEMAS)


@pytest.mark.parametrize("t", sorted(SAMPLES))
def test_round_trip(t):
    msg = protocol.decode(protocol.encode(t, **SAMPLES[t]))
    assert msg.pop("t") == t and msg.pop("v") == protocol.VERSION and msg == SAMPLES[t]


@pytest.mark.parametrize("bad", [
    b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"v": protocol.VERSION + 1, "t": "bye", "rank": 1}),
    msgpack.packb({"v": protocol.VERSION, "t": "nope"}), msgpack.packb({"v": protocol.VERSION, "t": "bye"}),
    msgpack.packb({"v": protocol.VERSION, "t": "bye", "rank": "1"}), msgpack.packb({"v": protocol.VERSION, "t": "bye", "rank": True}),
    msgpack.packb({"v": protocol.VERSION, "t": "bye", "rank": 1, "extra": 0}), msgpack.packb({"v": protocol.VERSION, "t": "bye", "rank": 2**62}),
    msgpack.packb({"v": protocol.VERSION, "t": "hb", "rank": 1, "it": 1, "upd": 0, "health": "ok"}),
    msgpack.packb({"v": protocol.VERSION, "t": "register", "rank": 1, "world": 4, "node": "x", "pid": 1, "groups": [[-1]]}),
    msgpack.packb({"v": protocol.VERSION, "t": "status?", 1: 2}),
    msgpack.packb({"v": protocol.VERSION, "t": "agent", "node": "n", "node_rank": 0, "nnodes": 1, "pid": 1,
                   "ranks": list(range(protocol.MAX_LIST + 1)), "pids": []}),
    b"\x00" * (protocol.MAX_BYTES + 1),
])
def test_rejects(bad):
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(bad)


def test_encode_refuses_what_decode_would():
    with pytest.raises(protocol.ProtocolError):
        protocol.encode("bye")
    with pytest.raises(protocol.ProtocolError):
        protocol.encode("bye", rank=1, junk=2)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=20),
                    st.binary(max_size=20))
values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=5),
                                                     st.dictionaries(st.text(max_size=8), c, max_size=5)),
                      max_leaves=20)
FIELDS = sorted({f for s in protocol.SCHEMAS.values() for f in s})
messages = st.builds(
    lambda t, fields, drop: {**{"v": protocol.VERSION, "t": t}, **{k: v for k, v in fields.items() if k not in drop}},
    st.sampled_from(sorted(protocol.SCHEMAS) + ["x"]),
    st.dictionaries(st.sampled_from(FIELDS + ["zz"]), values, max_size=8),
    st.sets(st.text(max_size=3), max_size=2))


def _mutate(t, mutations):
    """A valid message (SAMPLES[t]) with up to a few things changed: a field dropped, a field (known
    to its type, to another type, or to none) set to any value, another version or type."""
    m = {"v": protocol.VERSION, "t": t, **copy.deepcopy(SAMPLES[t])}
    for what, *rest in mutations:
        if what == "drop":
            m.pop(rest[0], None)
        else:
            m[rest[0]] = rest[1]
    return m


mutated = st.builds(_mutate, st.sampled_from(sorted(SAMPLES)), st.lists(st.one_of(
    st.tuples(st.just("drop"), st.sampled_from(FIELDS + ["v", "t"])),
    st.tuples(st.just("set"), st.sampled_from(FIELDS + ["zz"]), values),
    st.tuples(st.just("set"), st.just("v"), st.one_of(values, st.integers(protocol.VERSION - 1, protocol.VERSION + 1))),
    st.tuples(st.just("set"), st.just("t"), st.one_of(values, st.sampled_from(sorted(protocol.SCHEMAS))))), max_size=3))


# ---- an oracle, written apart from protocol.py: what a decoder must make of a message ------------------
def _index(v):
    return type(v) is int and 0 <= v < protocol.MAX_INT


def _tree_ok(v, depth=protocol.MAX_DEPTH):
    if v is None or type(v) in (bool, float, str):
        return True
    if type(v) is int:
        return -protocol.MAX_INT < v < protocol.MAX_INT
    if type(v) is list:
        return depth > 0 and all(_tree_ok(x, depth - 1) for x in v)
    if type(v) is dict:
        return depth > 0 and all(type(k) is str and _tree_ok(x, depth - 1) for k, x in v.items())
    return False  # bytes


KIND_OK = {
    "int": lambda v: type(v) is int and -protocol.MAX_INT < v < protocol.MAX_INT,
    "str": lambda v: type(v) is str,
    "bool": lambda v: type(v) is bool,
    "float": lambda v: type(v) is int or type(v) is float and not math.isnan(v),
    "ints": lambda v: type(v) is list and all(map(_index, v)),
    "groups": lambda v: type(v) is list and all(type(g) is list and all(map(_index, g)) for g in v),
    "strs": lambda v: type(v) is list and all(type(x) is str for x in v),
    "map": lambda v: type(v) is dict and _tree_ok(v),
    "tree": _tree_ok,
    "maps": lambda v: type(v) is list and all(type(x) is dict and _tree_ok(x) for x in v),
    # (an agent's batch of its ranks' answers: each a whole result message)
    "results": lambda v: type(v) is list and all(type(x) is dict and x.get("t") == "result" and not refusals(x)
                                                 for x in v),
    "answers": lambda v: type(v) is list and all(type(x) is dict and x.get("t") == "answers" and not refusals(x)
                                                 for x in v),
    # (an agent's heartbeat: its ranks' heartbeats as columns, each rank's a whole hb message again)
    "beats": lambda v: _beats_ok(v),
}


def _beats_ok(v) -> bool:
    """Columns of heartbeats: ranks, fields alike and fields a rank each (None: that rank's lacks it),
    each a heartbeat's field of its kind, none of them the rank, none both; each rank's heartbeat put
    back together is a valid hb."""
    if type(v) is not dict or set(v) - {"ranks", "same", "each"} or not KIND_OK["ints"](v.get("ranks")):
        return False
    same, each, hb = v.get("same", {}), v.get("each", {}), protocol.SCHEMAS["hb"]
    if type(same) is not dict or type(each) is not dict or set(same) & set(each) or "rank" in {*same, *each}:
        return False
    if any(k not in hb or not KIND_OK[hb[k][0]](x) for k, x in same.items()):
        return False
    if any(k not in hb or type(col) is not list or len(col) != len(v["ranks"])
           or not all(x is None or KIND_OK[hb[k][0]](x) for x in col) for k, col in each.items()):
        return False
    for i, r in enumerate(v["ranks"]):
        beat = {"v": protocol.VERSION, "t": "hb", **same, "rank": r,
                **{k: col[i] for k, col in each.items() if col[i] is not None}}
        if refusals(beat):
            return False
    return True


def _binary(v):
    if isinstance(v, bytes):
        return len(v) > 0  # (the decoder allows no binary but the empty one)
    if isinstance(v, list):
        return any(map(_binary, v))
    if isinstance(v, dict):
        return any(map(_binary, v.values()))
    return False


def refusals(m) -> list[str]:
    """The reasons a decoder may give for refusing ``m`` (each a message's start); [] when ``m``
    is a valid message that must decode as it is."""
    if _binary(m):
        return ["undecodable: "]
    if m.get("v") != protocol.VERSION:
        return [f"version {m.get('v')!r} != {protocol.VERSION}"]
    t = m.get("t")
    if type(t) is not str or t not in protocol.SCHEMAS:
        return [f"unknown type {t!r}"]
    schema = protocol.SCHEMAS[t]
    out = [f"unknown field {k!r} in {t!r}" if k not in schema else f"field {k!r}: bad {schema[k][0]}"
           for k, v in m.items() if k not in ("v", "t") and (k not in schema or not KIND_OK[schema[k][0]](v))]
    return out + [f"missing field {k!r} in {t!r}" for k, (_, required) in schema.items() if required and k not in m]


REASON = re.compile(r"(not bytes|oversized \(\d+ bytes\)|undecodable: \w+|not a map|version .+ != \d+|"
                    r"unknown type .+|unknown field .+ in .+|field .+: bad \w+|missing field .+ in .+)", re.DOTALL)


def _same(a, b) -> bool:
    """Equal as messages: NaN equals NaN (a float field or a tree may carry one), and a map's order of
    keys is no part of it (the encoder writes "v" and "t" first; a sender may not)."""
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b or (type(a) in (int, float) and type(b) in (int, float) and a == b)


def _round_trips(msg: dict) -> None:
    protocol.validate(msg)  # what passes is a valid message
    again = protocol.decode(protocol.encode(msg["t"], **{k: v for k, v in msg.items() if k not in ("v", "t")}))
    assert _same(again, msg), (again, msg)


def test_oracle_knows_every_kind():
    assert {kind for s in protocol.SCHEMAS.values() for kind, _ in s.values()} <= set(KIND_OK)
    assert all(refusals({"v": protocol.VERSION, "t": t, **SAMPLES[t]}) == [] for t in SAMPLES)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=300), messages.map(lambda m: msgpack.packb(m, use_bin_type=True))))
def test_fuzz_decoder(data):
    try:
        msg = protocol.decode(data)
    except protocol.ProtocolError as e:
        assert REASON.fullmatch(str(e)), f"refused without a reason: {e!r}"
        return
    _round_trips(msg)


@settings(max_examples=100, deadline=None)
@given(st.one_of(mutated, messages))
@example({"v": protocol.VERSION, "t": "bye", "rank": 3})                    # valid: decodes, round trips
@example({"v": protocol.VERSION, "t": "bye"})                               # a required field missing
@example({"v": protocol.VERSION, "t": "hb", **SAMPLES["hb"], "upd": 0})     # a field of the wrong type
@example({"v": protocol.VERSION + 1, "t": "bye", "rank": 3})                # another version
# an agent's heartbeats as columns: a value of the wrong kind where no rank's beat reads it, a rank's
# beat without a field every beat has, a column longer than the ranks, the rank among the fields
@example({"v": protocol.VERSION, "t": "agent_hb", "node_rank": 0, "beats": {"ranks": [], "same": {"it": "x"}}})
@example({"v": protocol.VERSION, "t": "agent_hb", "node_rank": 0,
          "beats": {"ranks": [1, 2], "same": {"upd": False, "health": "ok"}, "each": {"it": [5, None]}}})
@example({"v": protocol.VERSION, "t": "agent_hb", "node_rank": 0,
          "beats": {"ranks": [1], "same": {"it": 5, "upd": False, "health": "ok"}, "each": {"pid": [8, 9]}}})
@example({"v": protocol.VERSION, "t": "agent_hb", "node_rank": 0,
          "beats": {"ranks": [1], "same": {"it": 5, "upd": False, "health": "ok", "rank": 1}}})
def test_fuzz_mutated_valid(m):
    """Each example either decodes into the very message, or is refused with one of its real faults."""
    expected = refusals(m)
    try:
        msg = protocol.decode(msgpack.packb(m, use_bin_type=True))
    except protocol.ProtocolError as e:
        event(f"refused: {str(e).split(' ', 1)[0]}")
        assert expected, f"a valid message was refused: {e}"
        assert any(str(e).startswith(r) for r in expected), f"refused for {e!r}; its faults are {expected}"
        return
    event("decoded")
    assert not expected, f"accepted {m!r}, though {expected}"
    assert _same(msg, m), (msg, m)
    _round_trips(msg)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("fuzz"))
    keys = security.Keys.load(d, create=True)
    c = Controller(d, 4, HAOptions(strategies=frozenset({"dump"}), log_dir=d), keys).start()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    security.secure_client(s, keys)
    s.connect(c.endpoint)
    yield c, s
    s.close()
    ctx.term()
    c.close()


def _status(s, owed: int = 0):
    """The controller's status, asked after everything sent on ``s`` so far (ZeroMQ keeps a connection's
    order, and the controller answers in it); ``owed``: status answers due to what was sent before.
    (Other answers — ack, refused — are skipped.)"""
    s.send(protocol.encode("status?"))
    for _ in range(owed + 1):
        while True:
            assert s.poll(5000), "controller stopped answering"
            msg = protocol.decode(s.recv())
            if msg["t"] == "status":
                break
    return msg["body"]


# Valid messages a job's key may send that change nothing (a heartbeat of a rank that has not registered
# is refused: register first): none of them may count as dropped.
harmless = st.one_of(st.just(protocol.encode("status?")), st.builds(
    lambda fields, extra: protocol.encode("hb", **fields, **extra),
    st.fixed_dictionaries({"rank": st.integers(0, 3), "it": st.integers(-1, 10**6), "upd": st.booleans(),
                           "health": st.text(max_size=10)}),
    st.fixed_dictionaries({}, optional={"phase": st.sampled_from(protocol.PHASES), "wait": st.booleans(),
                                        "progress": st.floats(allow_nan=False), "steps": st.integers(0, 10**6),
                                        "busy": st.floats(0, 10), "ckpt": st.integers(-1, 10**6),
                                        "held": st.text(max_size=40)})))
# Valid messages a job's key may not send: each must be dropped for its role.
FORBIDDEN = [protocol.encode(t, **SAMPLES[t]) for t in sorted(set(SAMPLES) - security.MAY_SEND["job"])]


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(
    st.binary(max_size=200),
    messages.map(lambda m: msgpack.packb(m, use_bin_type=True)),
    st.lists(st.binary(max_size=30), min_size=2, max_size=3),  # extra frames
    harmless.map(lambda data: (data,)),  # (tagged: this one must not count as dropped)
    st.sampled_from(FORBIDDEN),
))
def test_fuzz_live_controller(live, data):
    """After each example the controller still answers, and counts what it had to drop, by reason."""
    c, s = live
    is_harmless = isinstance(data, tuple)
    data = data[0] if is_harmless else data
    before = collections.Counter(_status(s)["dropped"])
    owed, must = 0, None  # must: the reason the input has to be dropped for (None: it may be taken)
    if isinstance(data, list):
        s.send_multipart(data)
        must = "frames"
    else:
        s.send(data)
        try:
            msg = protocol.decode(data)
        except protocol.ProtocolError:
            must = "malformed"
        else:
            if msg["t"] not in security.MAY_SEND["job"]:
                must = "role"
            owed = int(msg["t"] == "status?")
    after = collections.Counter(_status(s, owed)["dropped"])
    assert c._thread.is_alive()
    rose = after - before
    event(f"dropped: {sorted(rose) or 'nothing'}")
    if must is not None:
        assert rose == {must: 1}, f"{data!r}: expected one {must!r} drop, counted {dict(rose)}"
    elif is_harmless:
        assert not rose, f"a valid message counted as dropped: {dict(rose)}"
    else:  # a valid message its handler may still refuse (a rank outside the world): once at most
        assert sum(rose.values()) <= 1 and set(rose) <= {"invalid", "unexpected", "stale"}, dict(rose)


def test_live_controller_survives_fuzz(live):
    c, s = live
    s.send(b"\x00" * (protocol.MAX_BYTES + 10))  # above the socket's maxmsgsize: libzmq drops the connection
    time.sleep(0.2)
    assert c._thread.is_alive()
    st_ = _status(s)
    assert st_["state"] == "init"
    assert sum(st_["dropped"].values()) > 0  # malformed input was dropped and counted
    # a legitimate registration after the storm still works
    s.send(protocol.encode("register", **SAMPLES["register"]))
    deadline = time.time() + 5
    while time.time() < deadline and not any(r["rank"] == 1 and r["pid"] == 12 for r in _status(s)["ranks"]):
        time.sleep(0.05)
    assert any(r["rank"] == 1 for r in _status(s)["ranks"])


# Trees as a status holds them: maps in maps, a few keys (often the same ones), scalars of every type.
_leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.0, -0.0, 1.0, 1.5, math.nan]), st.sampled_from("ab"))
_datas = st.recursive(_leaf, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.sampled_from("abcd"), c,
                                                                                           max_size=4)), max_leaves=12)


def _exact(v):
    """``v`` with every type said (True is not 1, 1 is not 1.0) and maps in key order: equal iff the same."""
    if isinstance(v, dict):
        return ("map", sorted((k, _exact(x)) for k, x in v.items()))
    if isinstance(v, list):
        return ("list", [_exact(x) for x in v])
    return (type(v).__name__, repr(v))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from("abcd"), _datas, max_size=4), min_size=2, max_size=5))
def test_what_answers_share_is_sent_once_and_each_answer_is_put_back_exactly(datas):
    """``folding``: the parts every answer has alike, once; each answer's own parts; merged back, each is
    exactly what its rank sent (types too: a shared True never stands for a 1)."""
    from mindspeed_ha.control.wire.folding import merged, split_common
    common, own = split_common(datas)
    assert [_exact(merged(common, mine)) for mine in own] == [_exact(d) for d in datas]


# A node's heartbeats: the fields a rank's may carry, each with values of its kind (ties likely: a
# node's ranks say the same iteration, phase and health), and some left out.
_beat_values = {"it": st.integers(-1, 2), "upd": st.booleans(), "health": st.sampled_from(["ok", "faulty"]),
                "phase": st.sampled_from(["forward", "step"]), "progress": st.sampled_from([1.0, 1.5, 2]),
                "wait": st.booleans(), "pid": st.integers(100, 101), "steps": st.integers(0, 1),
                "busy": st.sampled_from([0.05, 0.06, 0, 0.0, -0.0]), "ckpt": st.integers(-1, 0), "held": st.just("frame"),
                "desync": st.sampled_from([{"k": [1, 2]}, {}]), "now": st.booleans(), "age": st.sampled_from([0.0, 0.01])}
_beat = st.fixed_dictionaries({k: _beat_values[k] for k in ("it", "upd", "health")},
                              optional={k: v for k, v in _beat_values.items() if k not in ("it", "upd", "health")})


@settings(max_examples=300, deadline=None)
@given(st.lists(_beat, max_size=8))
def test_a_nodes_heartbeats_as_columns_are_each_ranks_own_again_after_the_wire(beats):
    """``folding.as_columns`` in an agent's heartbeat, through ``encode`` and ``decode``: ``rows`` gives
    back each rank's heartbeat exactly as the rank sent it (fields, values and their types), and
    whatever every one of them says alike goes once."""
    from mindspeed_ha.control.wire.folding import as_columns, rows
    beats = [{"v": protocol.VERSION, "t": "hb", "rank": r, **b} for r, b in enumerate(beats)]
    msg = protocol.decode(protocol.encode("agent_hb", node_rank=0, beats=as_columns(beats)))
    assert [_exact(b) for b in rows(msg["beats"])] == [
        _exact({k: v for k, v in b.items() if k not in ("v", "t")}) for b in beats]
    same = msg["beats"].get("same", {})
    assert all(len(beats) > 0 and all(_exact(b.get(k)) == _exact(v) for b in beats) for k, v in same.items())
    assert not set(same) & set(msg["beats"].get("each", {}))


def test_one_message_to_many_is_each_ones_own_message_with_the_rest_packed_once():
    """``encode_each``: what ``encode`` gives for each value of the one field that differs, and a bad
    value is refused like ``encode`` refuses it."""
    args = {"pairs": list(range(64)), "iteration": 7}
    frames = protocol.encode_each("do", "ranks", [[0, 1], [8, 9, 10]], action="repair", id=5, args=args, epoch=2)
    assert [protocol.decode(f) for f in frames] == [
        protocol.decode(protocol.encode("do", action="repair", id=5, args=args, epoch=2, ranks=r))
        for r in ([0, 1], [8, 9, 10])]
    assert protocol.encode_each("do", "ranks", [], action="stop", id=1, epoch=1) == []
    with pytest.raises(protocol.ProtocolError):
        protocol.encode_each("do", "ranks", [[0], [-1]], action="stop", id=1, epoch=1)
    with pytest.raises(protocol.ProtocolError):
        protocol.encode_each("do", "ranks", [[0]], action="stop", id=1, epoch=1, junk=2)
