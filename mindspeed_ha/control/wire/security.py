"""CurveZMQ for the control plane: per-job keys, ZAP on the controller, server-key pinning on clients,
and roles: what each key may send.

A key dir (``DIR/keys/<job id>``, so every job gets its own, unless ``--ha-key-dir``) holds three key
pairs: ``server`` (every controller candidate needs its secret: a backup takes over with the same
identity, so clients keep pinning one server key), ``client`` (the job: processors and agents) and
``operator`` (the CLI: status, inject). ``authorized/`` has the public keys the controller's ZAP handler
accepts. The controller knows which key a message came with, and ``may_send`` says which role may send
what: a rank's key cannot inject a fault, the operator's cannot impersonate a rank. The dir is 0700 and
every secret 0600; a secret that others may read is refused. A job of several nodes needs one key
dir on every node: ``mindspeed-ha keygen DIR`` makes it (mounted flat, as a Kubernetes Secret is, it
works too), ``--ha-key-dir`` names it.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from ...events import get_logger

log = get_logger("control.security")
INSECURE_WARNING = ("!!! mindspeed-ha control plane runs WITHOUT authentication or encryption "
                    "(--ha-insecure): anyone who can reach the controller port can command every rank. "
                    "Use this only on a trusted, isolated network. !!!")


class SecurityError(RuntimeError):
    pass


# What each role may send (the controller drops the rest): ranks and agents speak for the job, the
# operator's CLI asks and drills.
MAY_SEND = {
    "job": frozenset({"register", "hb", "fault", "left", "result", "bye", "agent", "agent_hb", "results", "exit",
                      "status?", "health", "preempt"}),
    "operator": frozenset({"status?", "inject", "migrate"}),
}


def key_dir_for(log_dir: str, key_dir: str | None = None, job: str | None = None) -> str:
    """``--ha-key-dir`` (or MINDSPEED_HA_KEY_DIR), else this job's own under the log dir."""
    explicit = key_dir or os.environ.get("MINDSPEED_HA_KEY_DIR")
    if explicit:
        return explicit
    return os.path.join(log_dir, "keys", job) if job else os.path.join(log_dir, "keys")


def is_insecure(options_insecure: bool = False) -> bool:
    return bool(options_insecure) or os.environ.get("MINDSPEED_HA_INSECURE", "") in ("1", "true", "yes")


def create_keys(key_dir: str) -> str:
    """Make the job's keys once. Built in a temp dir and renamed into place, so concurrent creators
    (two agents, or rank 0 under torchrun) never see a half-written dir: the first rename wins."""
    if os.path.exists(os.path.join(key_dir, "client.key_secret")):
        return key_dir
    parent = os.path.dirname(os.path.abspath(key_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".keys-", dir=parent)
    try:
        os.chmod(tmp, 0o700)
        for name in ("server", "client", "operator"):
            zmq.auth.create_certificates(tmp, name)
        auth = os.path.join(tmp, "authorized")
        os.mkdir(auth, 0o700)
        for name in ("client", "operator"):
            shutil.copy(os.path.join(tmp, f"{name}.key"), os.path.join(auth, f"{name}.key"))
        for name in os.listdir(tmp):
            p = os.path.join(tmp, name)
            if name.endswith("_secret"):
                os.chmod(p, 0o600)
        try:
            os.rename(tmp, key_dir)
        except OSError:  # someone else won (the target exists and is not empty)
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return key_dir


def wait_for_keys(key_dir: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(key_dir, "client.key_secret")):
        if time.monotonic() > deadline:
            raise SecurityError(f"no CurveZMQ keys in {key_dir} after {timeout:.0f}s: the launcher makes them "
                            "(mindspeed-ha run), or pass --ha-key-dir with keys present on every node, "
                            "or --ha-insecure")
        time.sleep(0.05)
    for name in sorted(os.listdir(key_dir)):
        path = os.path.join(key_dir, name)
        mode = os.stat(path).st_mode & 0o777
        if name.endswith("_secret") and mode & 0o077:
            raise SecurityError(f"{path} has mode {mode:o}: others may read this secret key; run "
                                f"chmod 600 {path} (and chmod 700 {key_dir}), or make new keys")
    mode = os.stat(key_dir).st_mode & 0o777
    if mode & 0o077:
        log.warning("key dir %s has mode %o; it should be 0700", key_dir, mode)
    return key_dir


class Keys:
    """The keys one process needs (``role``: "job" for ranks and agents, "operator" for the CLI);
    ``None`` everywhere when insecure."""

    def __init__(self, key_dir: str | None, role: str = "job"):
        self.key_dir, self.role = key_dir, role
        self.roles: dict[bytes, str] = {}  # public key (z85) -> role, for the controller
        if key_dir is None:
            self.server_public = self.server_secret = self.client_public = self.client_secret = None
            return
        pair = {"job": "client", "operator": "operator"}[role]
        if not os.path.exists(os.path.join(key_dir, f"{pair}.key_secret")):
            raise SecurityError(f"{key_dir} has no {pair} key (made by an older mindspeed-ha?): make new keys")
        self.server_public, _ = zmq.auth.load_certificate(os.path.join(key_dir, "server.key"))
        self.client_public, self.client_secret = zmq.auth.load_certificate(
            os.path.join(key_dir, f"{pair}.key_secret"))
        secret = os.path.join(key_dir, "server.key_secret")
        self.server_secret = zmq.auth.load_certificate(secret)[1] if os.path.exists(secret) else None
        for name, r in (("client", "job"), ("operator", "operator")):
            path = os.path.join(key_dir, f"{name}.key")
            if os.path.exists(path):
                self.roles[zmq.auth.load_certificate(path)[0]] = r

    def role_of(self, user_id: str | None) -> str | None:
        """The role of the key a message came with (None when insecure: every role)."""
        if not self.secure:
            return None
        return self.roles.get((user_id or "").encode(), "unknown")

    @property
    def secure(self) -> bool:
        return self.key_dir is not None

    @classmethod
    def load(cls, log_dir: str, key_dir: str | None = None, insecure: bool = False, create: bool = False,
             timeout: float = 60.0, job: str | None = None, role: str = "job") -> "Keys":
        if is_insecure(insecure):
            log.warning(INSECURE_WARNING)
            return cls(None)
        d = key_dir_for(log_dir, key_dir, job)
        if create:
            create_keys(d)
        return cls(wait_for_keys(d, timeout), role)

    def server_public_text(self) -> str | None:
        return self.server_public.decode() if self.server_public else None


def secure_server(sock: zmq.Socket[bytes], keys: Keys) -> None:
    if not keys.secure:
        return
    if keys.server_secret is None:
        raise SecurityError(f"{keys.key_dir}/server.key_secret missing: this process cannot be a controller")
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_client(sock: zmq.Socket[bytes], keys: Keys, server_public: bytes | None = None) -> None:
    """Pin the server key from the key dir (never the one advertised in controller.json: a forged
    controller.json must not make a client trust a forged controller)."""
    if not keys.secure:
        return
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = server_public or keys.server_public


_auth_by_ctx: dict[int, ThreadAuthenticator] = {}


def start_authenticator(ctx: zmq.Context[zmq.Socket[bytes]], keys: Keys) -> ThreadAuthenticator | None:
    """One ZAP handler per context (ZAP is per context): accept only the job's client keys."""
    if keys.key_dir is None:  # insecure
        return None
    auth = _auth_by_ctx.get(id(ctx))
    if auth is None:
        auth = ThreadAuthenticator(ctx, log=get_logger("control.zap"))
        auth.start()
        auth.configure_curve(domain="*", location=_authorized_dir(keys.key_dir))
        _auth_by_ctx[id(ctx)] = auth
    return auth


def _authorized_dir(key_dir: str) -> str:
    """The public keys ZAP accepts: ``authorized/``, or — a key dir mounted flat, as a Kubernetes
    Secret is — a private copy of the job's and the operator's public keys."""
    auth = os.path.join(key_dir, "authorized")
    if os.path.isdir(auth):
        return auth
    tmp = tempfile.mkdtemp(prefix="mindspeed-ha-authorized-")
    for name in ("client.key", "operator.key"):
        if os.path.exists(os.path.join(key_dir, name)):
            shutil.copy(os.path.join(key_dir, name), os.path.join(tmp, name))
    return tmp


def stop_authenticator(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    auth = _auth_by_ctx.pop(id(ctx), None)
    if auth is not None:
        auth.stop()
