"""Protocol: round trips, limits, validation, and a fuzz of the decoders and of a live controller."""
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from mindspeed_ha.control import protocol as P, security
from mindspeed_ha.control.controller import Controller
from mindspeed_ha.options import HAOptions

SAMPLES = {
    "register": dict(rank=1, world=4, node="n0", pid=12, local_rank=1, groups=[[1, 3]], host="h", iteration=-1),
    "hb": dict(rank=1, it=5, upd=False, health="ok", phase="forward", progress=1.5, steps=4, busy=0.05, ckpt=4),
    "fault": dict(rank=1, kind="memory-error", iteration=3, phase="optimizer", detail="x", at=1.0, rid="12.fault.1"),
    "result": dict(rank=1, action="stop", id=3, ok=True, data={"iteration": 3, "replica_group": [1, 3]}),
    "bye": dict(rank=2),
    "preempt": dict(signal=15, rank=2, pid=7),
    "agent": dict(node="n", node_rank=0, nnodes=1, pid=5, ranks=[0, 1], pids=[7, 8]),
    "agent_hb": dict(node_rank=0, spares=1),
    "health": dict(node_rank=0, ranks=[2], detail="health check: ECC"),
    "exit": dict(node_rank=0, rank=1, pid=9, code=0, signal=9, at=2.0, iteration=4, phase="backward"),
    "status?": {},
    "inject": dict(kind="kill", rank=1, step=3, phase="forward"),
    "migrate": dict(rank=2, reason="operator"),
    "ack": dict(epoch=1, state="normal", standby=False, backups=["tcp://127.0.0.1:1"]),
    "do": dict(action="exit", id=4, args={"code": 1, "diagnosis": "d"}, epoch=1),
    "status": dict(body={"state": "normal", "ranks": [{"rank": 0}]}),
    "refused": dict(reason="no"),
    "settled": dict(rids=["12.fault.1", "5.exit.9"]),
}


def test_every_type_has_a_sample():
    assert set(SAMPLES) == set(P.SCHEMAS)


@pytest.mark.parametrize("t", sorted(SAMPLES))
def test_round_trip(t):
    msg = P.decode(P.encode(t, **SAMPLES[t]))
    assert msg.pop("t") == t and msg.pop("v") == P.VERSION and msg == SAMPLES[t]


@pytest.mark.parametrize("bad", [
    b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"v": P.VERSION + 1, "t": "bye", "rank": 1}),
    msgpack.packb({"v": P.VERSION, "t": "nope"}), msgpack.packb({"v": P.VERSION, "t": "bye"}),
    msgpack.packb({"v": P.VERSION, "t": "bye", "rank": "1"}), msgpack.packb({"v": P.VERSION, "t": "bye", "rank": True}),
    msgpack.packb({"v": P.VERSION, "t": "bye", "rank": 1, "extra": 0}), msgpack.packb({"v": P.VERSION, "t": "bye", "rank": 2**62}),
    msgpack.packb({"v": P.VERSION, "t": "hb", "rank": 1, "it": 1, "upd": 0, "health": "ok"}),
    msgpack.packb({"v": P.VERSION, "t": "register", "rank": 1, "world": 4, "node": "x", "pid": 1, "groups": [[-1]]}),
    msgpack.packb({"v": P.VERSION, "t": "status?", 1: 2}),
    msgpack.packb({"v": P.VERSION, "t": "agent", "node": "n", "node_rank": 0, "nnodes": 1, "pid": 1,
                   "ranks": list(range(P.MAX_LIST + 1)), "pids": []}),
    b"\x00" * (P.MAX_BYTES + 1),
])
def test_rejects(bad):
    with pytest.raises(P.ProtocolError):
        P.decode(bad)


def test_encode_refuses_what_decode_would():
    with pytest.raises(P.ProtocolError):
        P.encode("bye")
    with pytest.raises(P.ProtocolError):
        P.encode("bye", rank=1, junk=2)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=20),
                    st.binary(max_size=20))
values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=5),
                                                     st.dictionaries(st.text(max_size=8), c, max_size=5)),
                      max_leaves=20)
messages = st.builds(
    lambda t, fields, drop: {**{"v": P.VERSION, "t": t}, **{k: v for k, v in fields.items() if k not in drop}},
    st.sampled_from(sorted(P.SCHEMAS) + ["x"]),
    st.dictionaries(st.sampled_from(sorted({f for s in P.SCHEMAS.values() for f in s}) + ["zz"]), values,
                    max_size=8),
    st.sets(st.text(max_size=3), max_size=2))


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=300), messages.map(lambda m: msgpack.packb(m, use_bin_type=True))))
def test_fuzz_decoder(data):
    try:
        msg = P.decode(data)
    except P.ProtocolError:
        return
    P.validate(msg)  # what passes is a valid message
    assert P.decode(P.encode(msg["t"], **{k: v for k, v in msg.items() if k not in ("v", "t")})) == msg


@settings(max_examples=100, deadline=None)
@given(messages)
def test_fuzz_mutated_valid(m):
    data = msgpack.packb(m, use_bin_type=True)
    try:
        P.decode(data)
    except P.ProtocolError:
        pass


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


def _status(s):
    while s.poll(0):
        s.recv()
    s.send(P.encode("status?"))
    assert s.poll(5000), "controller stopped answering"
    while True:
        msg = P.decode(s.recv())
        if msg["t"] == "status":
            return msg["body"]


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(
    st.binary(max_size=200),
    messages.map(lambda m: msgpack.packb(m, use_bin_type=True)),
    st.lists(st.binary(max_size=30), min_size=2, max_size=3),  # extra frames
))
def test_fuzz_live_controller(live, data):
    c, s = live
    if isinstance(data, list):
        s.send_multipart(data)
    else:
        s.send(data)
    while s.poll(0):
        s.recv()


def test_live_controller_survives_fuzz(live):
    c, s = live
    s.send(b"\x00" * (P.MAX_BYTES + 10))  # above the socket's maxmsgsize: libzmq drops the connection
    time.sleep(0.2)
    assert c._thread.is_alive()
    st_ = _status(s)
    assert st_["state"] == "init"
    assert sum(st_["dropped"].values()) > 0  # malformed input was dropped and counted
    # a legitimate registration after the storm still works
    s.send(P.encode("register", **SAMPLES["register"]))
    deadline = time.time() + 5
    while time.time() < deadline and not any(r["rank"] == 1 and r["pid"] == 12 for r in _status(s)["ranks"]):
        time.sleep(0.05)
    assert any(r["rank"] == 1 for r in _status(s)["ranks"])
