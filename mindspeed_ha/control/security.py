"""CurveZMQ for the control plane: per-job keys, ZAP on the controller, server-key pinning on clients.

Layout of a key dir (``DIR/keys`` unless ``--ha-key-dir``): ``server.key`` / ``server.key_secret``
(every controller candidate needs the secret: a backup takes over with the same identity, so clients
keep pinning one server key), ``client.key`` / ``client.key_secret`` (processors, agents, the CLI),
``authorized/`` (public keys the controller's ZAP handler accepts). Dir 0700, secrets 0600.
Multi-node jobs need the key dir on every node (shared file system or copied before launch).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from ..events import get_logger

log = get_logger("control.security")
INSECURE_WARNING = ("!!! mindspeed-ha control plane runs WITHOUT authentication or encryption "
                    "(--ha-insecure): anyone who can reach the controller port can command every rank. "
                    "Use this only on a trusted, isolated network. !!!")


class SecurityError(RuntimeError):
    pass


def key_dir_for(log_dir: str, key_dir: str | None = None) -> str:
    return key_dir or os.environ.get("MINDSPEED_HA_KEY_DIR") or os.path.join(log_dir, "keys")


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
        zmq.auth.create_certificates(tmp, "server")
        zmq.auth.create_certificates(tmp, "client")
        auth = os.path.join(tmp, "authorized")
        os.mkdir(auth, 0o700)
        shutil.copy(os.path.join(tmp, "client.key"), os.path.join(auth, "client.key"))
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
    mode = os.stat(key_dir).st_mode & 0o777
    if mode & 0o077:
        log.warning("key dir %s has mode %o; it should be 0700", key_dir, mode)
    return key_dir


class Keys:
    """The keys one process needs; ``None`` everywhere when insecure."""

    def __init__(self, key_dir: str | None):
        self.key_dir = key_dir
        if key_dir is None:
            self.server_public = self.server_secret = self.client_public = self.client_secret = None
            return
        self.server_public, _ = zmq.auth.load_certificate(os.path.join(key_dir, "server.key"))
        self.client_public, self.client_secret = zmq.auth.load_certificate(
            os.path.join(key_dir, "client.key_secret"))
        secret = os.path.join(key_dir, "server.key_secret")
        self.server_secret = zmq.auth.load_certificate(secret)[1] if os.path.exists(secret) else None

    @property
    def secure(self) -> bool:
        return self.key_dir is not None

    @classmethod
    def load(cls, log_dir: str, key_dir: str | None = None, insecure: bool = False, create: bool = False,
             timeout: float = 60.0) -> "Keys":
        if is_insecure(insecure):
            log.warning(INSECURE_WARNING)
            return cls(None)
        d = key_dir_for(log_dir, key_dir)
        if create:
            create_keys(d)
        return cls(wait_for_keys(d, timeout))

    def server_public_text(self) -> str | None:
        return self.server_public.decode() if self.server_public else None


def secure_server(sock: zmq.Socket, keys: Keys) -> None:
    if not keys.secure:
        return
    if keys.server_secret is None:
        raise SecurityError(f"{keys.key_dir}/server.key_secret missing: this process cannot be a controller")
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: Keys, server_public: bytes | None = None) -> None:
    """Pin the server key from the key dir (never the one advertised in controller.json: a forged
    controller.json must not make a client trust a forged controller)."""
    if not keys.secure:
        return
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = server_public or keys.server_public


_auth_by_ctx: dict[int, ThreadAuthenticator] = {}


def start_authenticator(ctx: zmq.Context, keys: Keys) -> ThreadAuthenticator | None:
    """One ZAP handler per context (ZAP is per context): accept only the job's client keys."""
    if not keys.secure:
        return None
    auth = _auth_by_ctx.get(id(ctx))
    if auth is None:
        auth = ThreadAuthenticator(ctx, log=get_logger("control.zap"))
        auth.start()
        auth.configure_curve(domain="*", location=os.path.join(keys.key_dir, "authorized"))
        _auth_by_ctx[id(ctx)] = auth
    return auth


def stop_authenticator(ctx: zmq.Context) -> None:
    auth = _auth_by_ctx.pop(id(ctx), None)
    if auth is not None:
        auth.stop()
