"""CurveZMQ: strangers (no keys, wrong keys) cannot register or ask; a forged controller gets nothing."""
import json
import os
import stat
import time

import pytest
import zmq
import zmq.auth

from mindspeed_ha.control.wire import protocol, security
from mindspeed_ha.control.controller import Controller
from mindspeed_ha.control.wire.announcement import write_controller_json
from mindspeed_ha.control.wire.link import ControllerLink
from mindspeed_ha.options import HAOptions


@pytest.fixture
def ctl(tmp_path):
    d = str(tmp_path)
    keys = security.Keys.load(d, create=True)
    c = Controller(d, 4, HAOptions(strategies=frozenset({"dump"}), log_dir=d), keys).start()
    yield d, keys, c
    c.close()


def _client(keys=None, server_key=None, secret=None, public=None):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    # A refused handshake leaves a DEALER with no peer, where a send would block forever.
    s.sndtimeo = 1000
    if keys is not None:
        security.secure_client(s, keys)
    elif server_key:
        s.curve_secretkey, s.curve_publickey, s.curve_serverkey = secret, public, server_key
    return s


def _offer(s, msg: bytes) -> bool:
    """Send; False when the socket has no peer to take it (its handshake was refused)."""
    try:
        s.send(msg)
        return True
    except zmq.Again:
        return False


def _ask_status(s, timeout=2.0):
    if not _offer(s, protocol.encode("status?")):
        return None
    if not s.poll(int(timeout * 1000)):
        return None
    return protocol.decode(s.recv())["body"]


REG = dict(rank=1, world=4, node="evil", pid=666)


def test_key_files(ctl):
    d, keys, c = ctl
    kd = os.path.join(d, "keys")
    assert stat.S_IMODE(os.stat(kd).st_mode) == 0o700
    for name in os.listdir(kd):
        if name.endswith("_secret"):
            assert stat.S_IMODE(os.stat(os.path.join(kd, name)).st_mode) == 0o600
    info = json.load(open(os.path.join(d, "controller.json")))
    assert {"host", "port", "server_public_key"} <= set(info)
    assert info["server_public_key"] == keys.server_public.decode() and info["secure"]


def test_no_keys_refused(ctl):
    d, keys, c = ctl
    s = _client()
    s.connect(c.endpoint)
    _offer(s, protocol.encode("register", **REG))
    assert _ask_status(s, 1.0) is None
    ok = _client(keys)
    ok.connect(c.endpoint)
    st = _ask_status(ok, 5.0)
    assert st is not None and st["ranks"] == []


def test_wrong_keys_refused(ctl):
    d, keys, c = ctl
    public, secret = zmq.curve_keypair()
    s = _client(server_key=keys.server_public, secret=secret, public=public)
    s.connect(c.endpoint)
    _offer(s, protocol.encode("register", **REG))
    _offer(s, protocol.encode("inject", kind="kill", rank=1))
    assert _ask_status(s, 1.5) is None
    ok = _client(keys)
    ok.connect(c.endpoint)
    st = _ask_status(ok, 5.0)
    assert st["ranks"] == [] and st["state"] == "init"


def test_forged_controller_gets_nothing(ctl, tmp_path):
    d, keys, c = ctl
    # A forger who can write controller.json but lacks the job's server secret.
    fake_pub, fake_sec = zmq.curve_keypair()
    ctx = zmq.Context()
    forged = ctx.socket(zmq.ROUTER)
    forged.linger = 0
    forged.curve_server, forged.curve_secretkey, forged.curve_publickey = True, fake_sec, fake_pub
    port = forged.bind_to_random_port("tcp://127.0.0.1")
    write_controller_json(d, {"host": "127.0.0.1", "port": port, "endpoint": f"tcp://127.0.0.1:{port}",
                              "server_public_key": fake_pub.decode(), "epoch": 99})
    link = ControllerLink(keys, d, None, lambda: protocol.encode("register", rank=1, world=4, node="n", pid=1), 0.2)
    t = time.time()
    while time.time() - t < 1.5:
        link.maintain()
        link.receive(20)
    assert not forged.poll(100), "the forged controller received a frame"
    assert not link.active
    forged.close()
    ctx.term()
    link.close()


def test_a_link_whose_connect_failed_connects_again(ctl):
    """An endpoint that cannot be connected to (a malformed address in controller.json or in an
    ack's backups) fails that connect only: the next one, to the real controller, registers."""
    d, keys, c = ctl
    link = ControllerLink(keys, d, None, lambda: protocol.encode("register", rank=1, world=4, node="n", pid=7), 0.2)
    try:
        with pytest.raises(zmq.ZMQError):
            link._connect("tcp://127.0.0.1:not-a-port")
        link._connect(c.endpoint)
        t = time.time()
        while time.time() - t < 5 and not any(r["pid"] == 7 for r in c.status()["ranks"]):
            link.receive(20)
        assert any(r["rank"] == 1 and r["pid"] == 7 for r in c.status()["ranks"])
    finally:
        link.close()


def test_another_threads_frame_is_sent_at_once_not_after_the_receive_wait(ctl):
    """A frame another thread gives the processor thread (an order's answer, a fault report, the
    heartbeat that ends a recovery) wakes that thread's wait for the controller: it goes out at once,
    not when the wait runs out. Connected or not yet."""
    import threading
    from mindspeed_ha.rank.processor.processor import Outbox
    d, keys, c = ctl
    link = ControllerLink(keys, d, None, lambda: protocol.encode("register", rank=1, world=4, node="n", pid=9), 0.2)
    outbox = Outbox()
    outbox.link = link
    try:
        for connected in (False, True):
            if connected:
                link._connect(c.endpoint)
                t = time.time()
                while time.time() - t < 5 and not link.active:
                    link.receive(20)
                assert link.active
            timer = threading.Timer(0.05, outbox.put, args=(b"frame", "rid-1"))
            t0 = time.monotonic()
            timer.start()
            while not link.receive(5000) and time.monotonic() - t0 < 5:
                if list(outbox.drain()):
                    break
            woken_after = time.monotonic() - t0
            timer.join()
            assert woken_after < 1.0, f"the wait ran {woken_after:.2f} s after the frame was given (connected: {connected})"
            assert list(outbox.drain()) == [] and not link.receive(0)
    finally:
        link.close()


def test_insecure_is_loud(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        k = security.Keys.load(str(tmp_path), insecure=True)
    assert not k.secure and "WITHOUT authentication" in caplog.text


def test_missing_keys_explain(tmp_path):
    with pytest.raises(security.SecurityError, match="--ha-insecure"):
        security.Keys.load(str(tmp_path), timeout=0.1)


def test_roles_the_operator_drills_ranks_report(ctl):
    """The operator's key (the CLI) may ask and inject but not speak for a rank; a rank's key may
    report but not inject a fault."""
    d, keys, c = ctl
    op = _client(security.Keys.load(d, role="operator"))
    op.connect(c.endpoint)
    op.send(protocol.encode("register", **REG))  # an operator impersonating rank 1: dropped
    assert _ask_status(op, 5.0)["ranks"] == []
    rank = _client(keys)
    rank.connect(c.endpoint)
    rank.send(protocol.encode("register", **REG))
    rank.send(protocol.encode("inject", kind="kill", rank=1))  # a rank's key may not drill: dropped
    time.sleep(0.3)
    while rank.poll(0):  # (the ack of its registration)
        rank.recv()
    st = _ask_status(rank, 5.0)
    assert [r["rank"] for r in st["ranks"]] == [1] and st["dropped"].get("role") == 2
    op.send(protocol.encode("inject", kind="kill", rank=1))  # the operator may (rank 1 is live)
    assert op.poll(5000)
    while True:
        msg = protocol.decode(op.recv())
        if msg["t"] == "status" and msg["body"].get("action") == "inject":
            break
    assert msg["body"]["ok"] and msg["body"]["detail"] == "delivered"


def test_a_secret_key_others_may_read_is_refused(tmp_path):
    security.Keys.load(str(tmp_path), create=True)
    secret = tmp_path / "keys" / "client.key_secret"
    os.chmod(secret, 0o644)
    with pytest.raises(security.SecurityError) as e:
        security.Keys.load(str(tmp_path))
    assert f"{secret} has mode 644" in str(e.value) and f"chmod 600 {secret}" in str(e.value)


def test_every_job_gets_its_own_keys(tmp_path):
    a = security.Keys.load(str(tmp_path), create=True, job="job-a")
    b = security.Keys.load(str(tmp_path), create=True, job="job-b")
    assert a.key_dir.endswith("keys/job-a") and b.key_dir.endswith("keys/job-b")
    assert a.server_public != b.server_public and a.client_public != b.client_public
    same = security.Keys.load(str(tmp_path), key_dir=a.key_dir, job="job-b")  # --ha-key-dir: shared on purpose
    assert same.server_public == a.server_public


def test_the_rebuild_store_listens_on_the_given_address_only(ctl):
    import psutil
    d, keys, c = ctl
    store = c.store()
    listening = [x.laddr for x in psutil.net_connections(kind="tcp")
                 if x.status == psutil.CONN_LISTEN and x.laddr.port == store.port]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
