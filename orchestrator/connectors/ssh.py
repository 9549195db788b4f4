"""SSH transport: the only module that imports paramiko.

Policy lives here and nowhere else:

- Host keys are checked strictly against one known_hosts table, parsed once per run (paramiko's
  own loader is quadratic in the file's lines). An unknown key is refused unless the caller
  explicitly accepts new keys, which appends and records them; a changed key is always refused.
- One connection per endpoint per run, reused for every command; containers marked ``jump`` are
  reached through a ``direct-tcpip`` channel of their GPU host's connection.
- Transient failures (refused, unreachable, timed out, reset, closed mid-command) are retried
  with exponential backoff; authentication and host-key failures never are.
- Every paramiko, socket and EOF error is mapped to ``orchestrator.errors`` here.

fabric is deliberately not used: its ``Connection`` loads known_hosts per connection and its
host-key policy is not strict by default; what we need of it is these few hundred lines.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import hmac
import logging
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paramiko
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from orchestrator.config.inventory import Endpoint, Target
from orchestrator.config.localfiles import KNOWN_HOSTS_IS_A_FILE, open_regular
from orchestrator.connectors.base import (
    Command,
    Counters,
    Feed,
    OnStderr,
    Result,
    RetryPolicy,
    StderrTail,
    Stdin,
    readable,
)
from orchestrator.errors import (
    AuthenticationFailed,
    CommandTimeout,
    ConnectFailed,
    ConnectionLost,
    HostKeyChanged,
    HostKeyError,
    TransportError,
    UnknownHostKey,
)

# paramiko logs the failures it raises (with tracebacks, from its own threads); with no logging
# set up, Python's last-resort handler printed them over our progress lines. We report each
# failure once, mapped below; an application that sets up logging still gets paramiko's records.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

_SEND_CHUNK = 1 << 18
_FIRST_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")
_SEND_POLL = 0.002


class _PromptAckSocket(socket.socket):
    """A TCP socket that acknowledges what it receives at once.

    After authentication sshd sends a few small packets (host key list, debug notes) and then
    holds its answer to our channel open under Nagle until they are acknowledged, while our
    kernel delays that acknowledgement (~40 ms): twice per connection, most of a connection's
    latency. sshd turns Nagle off only for sessions with a terminal, so the fix is on our side:
    no Nagle for what we send (TCP_NODELAY) and a prompt ACK after every read (TCP_QUICKACK,
    Linux; it does not stay set by itself). Serial connect + exec: ~115 ms -> ~30 ms.
    """

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data = super().recv(bufsize, flags)
        _quick_ack(self)
        return data


def _quick_ack(sock: socket.socket) -> None:
    if hasattr(socket, "TCP_QUICKACK"):
        # An error here means the connection is going away; the read that follows reports it.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)


class _Transport(paramiko.Transport):
    """paramiko's transport with a quieter reader thread.

    paramiko's thread wakes every 0.1 s from a read that timed out, only to see whether the
    transport was closed and whether a keepalive is due. A controller holding a connection per host
    pays that on every one: at 1024 hosts, 10,240 wakeups a second fighting over one interpreter
    lock, which took a watch holding 1024 sessions to 416 s of CPU for 10 rounds (a round 11.6 s,
    18 ms of CPU a host; 0.8 ms at 512). Data still wakes the thread at once; closing no longer
    waits for a wake (``_close`` shuts the socket down, and paramiko's close returns once its
    packetizer is closed); a keepalive (every 15 s on a kept session) goes out within 5 s of due;
    a rekey starts within 5 s of being needed.
    """

    _active_check_timeout = 5.0


def _close(t: paramiko.Transport) -> None:
    """Close a connection and wake its reader thread now, not at its next timeout."""
    if isinstance(t.sock, socket.socket):
        with contextlib.suppress(OSError):
            t.sock.shutdown(socket.SHUT_RDWR)
    t.close()


_JUMP = "jump:"  # the prefix of a jump host's own connection among a run's

KEY_FILE_LIMIT = 1 << 20  # OpenSSH's MAX_KEY_FILE_SIZE (authfile.c)


def _refuse_unprotected(path: Path) -> None:
    """A private key that others may read is refused, as OpenSSH refuses it ("UNPROTECTED
    PRIVATE KEY FILE"): a credential anyone on the controller could copy is no credential. A key
    that is not a regular file (a FIFO would be read for ever, a link to /dev/zero without end),
    or larger than OpenSSH reads, is refused before it is opened."""
    st = os.stat(path)
    mode = st.st_mode
    if not stat.S_ISREG(mode):
        raise ValueError("it is not a regular file (a key is read from a file; this one would not end)")
    if st.st_size > KEY_FILE_LIMIT:
        raise ValueError(f"it is {st.st_size} bytes, larger than a key file can be ({KEY_FILE_LIMIT})")
    if mode & 0o077:
        raise ValueError(
            f"others may read it (mode {stat.S_IMODE(mode):04o}), and OpenSSH refuses such a key: chmod 600 it"
        )


def fingerprint(key_type: str, blob_b64: str) -> str:
    """A host key's fingerprint as OpenSSH prints it (SHA256, base64, no padding)."""
    digest = hashlib.sha256(base64.b64decode(blob_b64)).digest()
    return f"{key_type} SHA256:{base64.b64encode(digest).decode().rstrip('=')}"


@dataclass
class _KnownKey:
    key_type: str
    blob: str
    line: int
    revoked: bool = False


class KnownHosts:
    """An OpenSSH known_hosts file, parsed once; lookups by ``host`` or ``[host]:port``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._plain: dict[str, list[_KnownKey]] = {}
        # A hashed name is found only by hashing each name looked up with each entry's salt: a run
        # over N hosts with N hashed entries does N*N HMACs. Each salt's HMAC state is made once
        # (0.9 us a match instead of 2) and each name's answer kept (a connection asks twice).
        self._hashed: list[tuple[Any, Any, bytes, _KnownKey]] = []
        self._found: dict[str, list[_KnownKey]] = {}
        self._lock = threading.Lock()
        self.accepted: list[str] = []
        text = self._read()
        for number, raw in enumerate(text.splitlines(), start=1):
            self._add_line(raw, number)

    def _open(self, flags: int) -> int | None:
        return open_regular(self.path, flags, KNOWN_HOSTS_IS_A_FILE)

    def _read(self) -> str:
        fd = self._open(os.O_RDONLY)
        if fd is None:
            return ""
        with os.fdopen(fd, "rb") as f:
            # A line that is not UTF-8 names no host we look up; OpenSSH skips what it cannot read.
            return f.read().decode("utf-8", "replace")

    def _add_line(self, raw: str, number: int) -> None:
        parts = raw.split()
        if not parts or parts[0].startswith("#"):
            return
        revoked = False
        if parts[0].startswith("@"):
            if parts[0] != "@revoked":
                return  # @cert-authority: certificates are not supported; never trust silently
            revoked, parts = True, parts[1:]
        if len(parts) < 3:
            return
        names, key_type, blob = parts[0], parts[1], parts[2]
        entry = _KnownKey(key_type, blob, number, revoked)
        for name in names.split(","):
            if name.startswith("|1|"):
                try:
                    salt_b64, digest_b64 = name[3:].split("|", 1)
                    salt, digest = base64.b64decode(salt_b64), base64.b64decode(digest_b64)
                except ValueError:
                    continue
                # HMAC-SHA1 (RFC 2104) with the salt as key, its two padded key blocks hashed once.
                key = salt if len(salt) <= 64 else hashlib.sha1(salt).digest()
                key = key.ljust(64, b"\0")
                inner = hashlib.sha1(bytes(b ^ 0x36 for b in key))
                outer = hashlib.sha1(bytes(b ^ 0x5C for b in key))
                self._hashed.append((inner, outer, digest, entry))
            else:
                self._plain.setdefault(name, []).append(entry)
        self._found.clear()

    @staticmethod
    def host_name(address: str, port: int) -> str:
        """How known_hosts names an endpoint (``[address]:port`` off port 22)."""
        return address if port == 22 else f"[{address}]:{port}"

    def lookup(self, name: str) -> list[_KnownKey]:
        """Every known_hosts entry for a name, plain or hashed."""
        known = self._found.get(name)
        if known is not None:
            return list(known)
        found = list(self._plain.get(name, []))
        encoded = name.encode()
        for inner_pad, outer_pad, digest, entry in self._hashed:
            inner, outer = inner_pad.copy(), outer_pad.copy()
            inner.update(encoded)
            outer.update(inner.digest())
            if hmac.compare_digest(outer.digest(), digest):
                found.append(entry)
        self._found[name] = found
        return list(found)

    def preferred_type(self, name: str) -> str | None:
        """The key type known_hosts trusts for a name, to ask the server for that one first."""
        for entry in self.lookup(name):
            if not entry.revoked:
                return entry.key_type
        return None

    def check(self, endpoint: str, name: str, key: paramiko.PKey, accept_new: bool) -> None:
        """Trust the key a host offers only if known_hosts holds it; an unknown key is refused (or
        added, when the user said so), a changed or revoked one always refused."""
        key_type, blob = key.get_name(), key.get_base64()
        offered = fingerprint(key_type, blob)
        entries = self.lookup(name)
        for entry in entries:
            if entry.revoked and entry.blob == blob:
                raise HostKeyChanged(endpoint, f"host key {offered} of {name} is marked @revoked in {self.path}")
        trusted = [e for e in entries if not e.revoked]
        if any(e.blob == blob for e in trusted):
            return
        if trusted:
            lines = ", ".join(str(e.line) for e in trusted)
            raise HostKeyChanged(
                endpoint,
                f"HOST KEY CHANGED for {name}: {self.path} line {lines} holds "
                f"{fingerprint(trusted[0].key_type, trusted[0].blob)}, the host offers {offered}. "
                f"This is refused: it may be an attack, or the host was rebuilt. Verify the new key out of "
                f"band, then remove the old entry (ssh-keygen -R '{name}' -f {self.path}).",
            )
        if not accept_new:
            raise UnknownHostKey(
                endpoint,
                f"host {name} is not in {self.path} (it offers {offered}). Verify that fingerprint out of band "
                f"and add the key to {self.path}, or rerun with --accept-new-host-keys to trust and record it.",
            )
        self._append(name, key_type, blob)

    def _append(self, name: str, key_type: str, blob: str) -> None:
        with self._lock:
            if any(e.blob == blob for e in self.lookup(name)):
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):  # made here, or there already (then checked)
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            fd = self._open(os.O_RDWR | os.O_APPEND)
            assert fd is not None
            with os.fdopen(fd, "r+b") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                size = os.fstat(fd).st_size
                # A file whose last line has no newline (an editor's doing) would have the new entry
                # joined to that line, and the key it holds lost: the newline goes first.
                ends = size == 0 or os.pread(fd, 1, size - 1) == b"\n"
                f.write(("" if ends else "\n").encode() + f"{name} {key_type} {blob}\n".encode())
            number = len(self._read().splitlines())
            self._add_line(f"{name} {key_type} {blob}", number)
            self.accepted.append(f"{name} {fingerprint(key_type, blob)}")


class SshConnector:
    """Connections to many endpoints for one run. Thread-safe: one thread per target is the norm."""

    def __init__(
        self,
        known_hosts: KnownHosts,
        *,
        accept_new_host_keys: bool = False,
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        self.known_hosts = known_hosts
        self.accept_new = accept_new_host_keys
        self.retry = retry
        self._connections: dict[str, paramiko.Transport] = {}
        self._presented: dict[str, str] = {}  # host key fingerprint -> the container that presented it
        self._counters: dict[str, Counters] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._keys: dict[Path | None, list[paramiko.PKey]] = {}

    # --- public --------------------------------------------------------------------------

    @property
    def accepted_host_keys(self) -> list[str]:
        """The host keys this run trusted for the first time (--accept-new-host-keys)."""
        return list(self.known_hosts.accepted)

    def run(
        self,
        target: Target,
        command: Command,
        stdin: Stdin = b"",
        timeout: float | None = None,
        on_stderr: OnStderr | None = None,
    ) -> Result:
        """Run one command, retrying transient failures with a fresh connection (not when stdin is
        a stream: it cannot be sent again; its caller resumes instead). ``on_stderr``: each chunk
        of stderr as it arrives (progress), besides the whole stream in the result."""
        counters = self.counters(target.name)
        retrying = Retrying(
            retry=retry_if_exception(lambda exc: isinstance(exc, TransportError) and exc.transient),
            stop=stop_after_attempt(self.retry.attempts if isinstance(stdin, bytes) else 1),
            wait=wait_exponential(multiplier=self.retry.initial_wait, max=self.retry.max_wait),
            before_sleep=lambda _state: self._note_retry(target, counters),
            reraise=True,
        )
        return retrying(self._run_once, target, command, stdin, timeout, on_stderr)

    def open(self, target: Target, command: Command) -> _SshSession:
        """Start ``command`` for a long conversation (``base.Session``), over the target's
        pooled connection; connecting is retried like ``run``. Keepalives every 15 s find a
        connection that died while the conversation was quiet."""
        counters = self.counters(target.name)
        retrying = Retrying(
            retry=retry_if_exception(lambda exc: isinstance(exc, TransportError) and exc.transient),
            stop=stop_after_attempt(self.retry.attempts),
            wait=wait_exponential(multiplier=self.retry.initial_wait, max=self.retry.max_wait),
            before_sleep=lambda _state: self._note_retry(target, counters),
            reraise=True,
        )
        return retrying(self._open_once, target, command)

    def _open_once(self, target: Target, command: Command) -> _SshSession:
        name = target.name
        t = self._connection(target)
        t.set_keepalive(15)
        try:
            chan = t.open_session(timeout=target.container.ssh.connect_timeout)
            chan.exec_command(command.render())
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self._drop(name)
            raise ConnectionLost(name, f"could not start {command.argv[0]}: {exc or type(exc).__name__}") from exc
        self.counters(name).execs += 1
        return _SshSession(self, name, chan)

    def counters(self, name: str) -> Counters:
        with self._guard:
            return self._counters.setdefault(name, Counters())

    def close(self) -> None:
        with self._guard:
            # Those through a jump host first: each one's socket is a channel of its jump host's
            # connection, and closing it sends on that connection. Closed after it, the send
            # failed in its reader thread (EOFError, an unhandled thread exception).
            connections = sorted(self._connections.items(), key=lambda kv: kv[0].startswith(_JUMP))
            self._connections.clear()
        for _, t in connections:
            _close(t)

    def __enter__(self) -> SshConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- connections -----------------------------------------------------------------------

    def _note_retry(self, target: Target, counters: Counters) -> None:
        counters.retries += 1
        self._drop(target.name)

    def _lock_for(self, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(name, threading.Lock())

    def _drop(self, name: str) -> None:
        with self._guard:
            t = self._connections.pop(name, None)
        if t is not None:
            _close(t)

    def _connection(self, target: Target) -> paramiko.Transport:
        name = target.name
        with self._lock_for(name):
            t = self._connections.get(name)
            if t is not None and t.is_active():
                return t
            sock: socket.socket | paramiko.Channel
            if target.jump is not None:
                jump_t = self._jump_connection(target.jump)
                sock = self._open_tunnel(target.jump.name, jump_t, target.container.endpoint)
            else:
                sock = self._dial(target.container.endpoint)
            t = self._handshake(target.container.endpoint, sock)
            key = t.get_remote_server_key()
            presented = fingerprint(key.get_name(), key.get_base64())
            with self._guard:
                # Two containers of the inventory that are one host (two spellings of an address,
                # two names of one machine) would be deployed twice and READY twice while another
                # host is never touched: each host key answers for one container only.
                other = self._presented.setdefault(presented, name)
                if other == name:
                    self._connections[name] = t
            if other != name:
                _close(t)
                raise HostKeyError(
                    target.container.endpoint.name,
                    f"presents the host key of container {other} ({presented}): one host cannot be two containers",
                )
            return t

    def _jump_connection(self, endpoint: Endpoint) -> paramiko.Transport:
        key = f"{_JUMP}{endpoint.name}"
        with self._lock_for(key):
            t = self._connections.get(key)
            if t is not None and t.is_active():
                return t
            t = self._handshake(endpoint, self._dial(endpoint))
            with self._guard:
                self._connections[key] = t
            return t

    def _dial(self, endpoint: Endpoint) -> socket.socket:
        try:
            # An ASCII name or address goes as bytes: for str, getaddrinfo first loads the IDNA
            # codec (stringprep, unicodedata: ~3 ms of every run) only to encode it.
            address = endpoint.address
            host: str | bytes = address.encode("ascii") if address.isascii() else address
            plain = socket.create_connection(
                (host, endpoint.ssh.port),  # type: ignore[arg-type]  # bytes: accepted, not in the stubs
                timeout=endpoint.ssh.connect_timeout,
            )
            plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock = _PromptAckSocket(plain.family, plain.type, plain.proto, fileno=plain.detach())
            sock.settimeout(endpoint.ssh.connect_timeout)  # the new object does not carry it over
            _quick_ack(sock)
            return sock
        except TimeoutError as exc:
            raise ConnectFailed(endpoint.name, f"connect to {endpoint.address}:{endpoint.ssh.port} timed out") from exc
        except OSError as exc:
            raise ConnectFailed(
                endpoint.name, f"connect to {endpoint.address}:{endpoint.ssh.port}: {exc.strerror or exc}"
            ) from exc

    def _open_tunnel(self, jump_name: str, jump: paramiko.Transport, endpoint: Endpoint) -> paramiko.Channel:
        try:
            return jump.open_channel(
                "direct-tcpip",
                (endpoint.address, endpoint.ssh.port),
                ("127.0.0.1", 0),
                timeout=endpoint.ssh.connect_timeout,
            )
        except paramiko.ChannelException as exc:
            raise ConnectFailed(
                endpoint.name,
                f"jump host {jump_name} could not reach {endpoint.address}:{endpoint.ssh.port}: {exc.text}",
            ) from exc
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self._drop(f"{_JUMP}{jump_name}")
            raise ConnectFailed(endpoint.name, f"tunnel through {jump_name} failed: {exc}") from exc

    def _handshake(self, endpoint: Endpoint, sock: socket.socket | paramiko.Channel) -> paramiko.Transport:
        name = KnownHosts.host_name(endpoint.address, endpoint.ssh.port)
        t = _Transport(sock)
        # connect_timeout bounds the banner and the key exchange as well as the TCP connect, as
        # OpenSSH's ConnectTimeout does. paramiko's own 15 s limits on them would cut a wait the
        # user made longer (a thousand hosts at once: sshd answers its banner late under the burst).
        t.banner_timeout = t.handshake_timeout = endpoint.ssh.connect_timeout
        ok = False
        try:
            options = t.get_security_options()
            # AES-GCM first: paramiko's default (CTR + HMAC-SHA2) spends most of a bulk transfer's
            # CPU on the MAC; GCM carried a 1 GiB stream at 367 MiB/s against 205 (one host,
            # loopback), which is what a model push is. Hosts without it still get the others.
            options.ciphers = [c for c in _FIRST_CIPHERS if c in options.ciphers] + [
                c for c in options.ciphers if c not in _FIRST_CIPHERS
            ]
            preferred = self.known_hosts.preferred_type(name)
            if preferred is not None:
                options.key_types = [preferred] + [k for k in options.key_types if k != preferred]
            try:
                t.start_client(timeout=endpoint.ssh.connect_timeout)
                done = t.completion_event
                if done is None or not done.is_set():  # start_client returns at its timeout, unfinished
                    raise ConnectFailed(
                        endpoint.name,
                        f"SSH handshake with {name} failed: not finished within {endpoint.ssh.connect_timeout:g} s "
                        "(connect_timeout)",
                    )
                # The server may drop the connection right after the key exchange (sshd's
                # MaxStartups under a burst of connections): paramiko then says "No existing
                # session" here, which is the same transient failure as one in the exchange.
                key = t.get_remote_server_key()
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise ConnectFailed(
                    endpoint.name, f"SSH handshake with {name} failed: {exc or type(exc).__name__}"
                ) from exc
            self.known_hosts.check(endpoint.name, name, key, self.accept_new)
            self._authenticate(t, endpoint)
            self.counters(endpoint.name).connects += 1
            ok = True
            return t
        finally:
            if not ok:
                _close(t)

    def _authenticate(self, t: paramiko.Transport, endpoint: Endpoint) -> None:
        keys = self._private_keys(endpoint)
        last: Exception | None = None
        for pkey in keys:
            try:
                t.auth_publickey(endpoint.ssh.user, pkey)
                return
            except paramiko.AuthenticationException as exc:
                last = exc
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise ConnectionLost(endpoint.name, f"connection lost during authentication: {exc}") from exc
        which = str(endpoint.ssh.key) if endpoint.ssh.key else "the ssh-agent and default keys"
        raise AuthenticationFailed(
            endpoint.name,
            f"public key authentication as {endpoint.ssh.user} failed with {which}" + (f": {last}" if last else ""),
        )

    def _private_keys(self, endpoint: Endpoint) -> list[paramiko.PKey]:
        path = endpoint.ssh.key
        with self._guard:
            cached = self._keys.get(path)
        if cached is not None:
            return cached
        keys: list[paramiko.PKey] = []
        if path is not None:
            try:
                _refuse_unprotected(path)
                keys.append(paramiko.PKey.from_path(path))
            except FileNotFoundError as exc:
                raise AuthenticationFailed(endpoint.name, f"private key {path} does not exist") from exc
            except TypeError as exc:  # paramiko's word for a key that needs a passphrase
                raise AuthenticationFailed(
                    endpoint.name,
                    f"private key {path} is protected by a passphrase: add it to ssh-agent (ssh-add) and leave "
                    "key: out of the inventory, or give a key without one",
                ) from exc
            except (paramiko.SSHException, OSError, ValueError) as exc:
                raise AuthenticationFailed(endpoint.name, f"cannot load private key {path}: {exc}") from exc
        else:
            keys.extend(paramiko.Agent().get_keys())
            for candidate in ("id_ed25519", "id_ecdsa", "id_rsa"):
                default = Path.home() / ".ssh" / candidate
                if default.exists():
                    try:
                        _refuse_unprotected(default)
                        keys.append(paramiko.PKey.from_path(default))
                    except (paramiko.SSHException, OSError, ValueError, TypeError):
                        continue  # as ssh does: a default key it cannot use is passed over
        with self._guard:
            self._keys[path] = keys
        return keys

    # --- commands ----------------------------------------------------------------------

    def _run_once(
        self, target: Target, command: Command, stdin: Stdin, timeout: float | None, on_stderr: OnStderr | None
    ) -> Result:
        name = target.name
        t = self._connection(target)
        limit = timeout if timeout is not None else target.container.ssh.command_timeout
        counters = self.counters(name)
        try:
            chan = t.open_session(timeout=target.container.ssh.connect_timeout)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self._drop(name)
            raise ConnectionLost(name, f"could not open a session: {exc or type(exc).__name__}") from exc
        counters.execs += 1
        try:
            return self._exchange(name, chan, command, stdin, limit, counters, on_stderr)
        finally:
            chan.close()

    def _exchange(
        self,
        name: str,
        chan: paramiko.Channel,
        command: Command,
        stdin: Stdin,
        limit: float,
        counters: Counters,
        on_stderr: OnStderr | None = None,
    ) -> Result:
        """Send stdin while draining stdout/stderr, so a command that answers as it reads never stalls us.

        The command is over only when the streams have ended (EOF, or the channel closed) *and*
        the exit status is in. The exit status alone is no such sign: sshd sends it as soon as the
        command exits, while output it already read from the command may still wait for window
        space behind it (8 MiB through ``cat`` lost its last ~32 KB that way).
        """
        deadline = time.monotonic() + limit
        out, err = bytearray(), bytearray()
        pending = Feed(stdin)
        try:
            chan.exec_command(command.render())
            chan.setblocking(False)
            if not pending:
                chan.shutdown_write()
            while True:
                progressed = False
                if pending and chan.closed:
                    pending.drop()  # the command is gone without reading it all
                while pending and chan.send_ready():
                    try:
                        sent = chan.send(pending.take(_SEND_CHUNK))
                    except TimeoutError:
                        break
                    except OSError:
                        if not chan.closed:
                            raise
                        sent = 0
                    if sent == 0:  # closed under us: the command ended without reading it all
                        pending.drop()
                        break
                    pending.advance(sent)
                    counters.bytes_sent += sent
                    progressed = True
                    if not pending:
                        chan.shutdown_write()
                while chan.recv_ready():
                    out += chan.recv(1 << 16)
                    progressed = True
                while chan.recv_stderr_ready():
                    chunk = chan.recv_stderr(1 << 16)
                    err += chunk
                    if on_stderr is not None:
                        on_stderr(chunk)
                    progressed = True
                # EOF is set only after every data packet before it was buffered (one transport
                # thread, in order), so once it is in and the buffers are empty, nothing is missing.
                ended = (chan.eof_received or chan.closed) and not chan.recv_ready() and not chan.recv_stderr_ready()
                if ended and chan.exit_status_ready() and not pending:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommandTimeout(name, f"{command.argv[0]} did not finish within {limit:.0f} s")
                if progressed:
                    continue
                if ended:
                    # Only the exit status (or stdin's last window) is still to come. paramiko keeps
                    # the channel readable from EOF on, so polling it would spin here.
                    chan.status_event.wait(min(remaining, _SEND_POLL) if pending else remaining)
                else:
                    # Readable data wakes the poll; a reopened send window does not, so poll
                    # briefly then.
                    readable(chan, min(remaining, _SEND_POLL if pending else 1.0))
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self._drop(name)
            raise ConnectionLost(name, f"connection lost during the command: {exc or type(exc).__name__}") from exc
        status = chan.recv_exit_status() if chan.exit_status_ready() else -1
        if status == -1:
            self._drop(name)
            raise ConnectionLost(name, "the connection closed before the command reported its exit status")
        return Result(name, command, status, bytes(out), bytes(err))


class _SshSession:
    """One command's channel, kept open (``base.Session``)."""

    def __init__(self, transport: SshConnector, name: str, chan: paramiko.Channel) -> None:
        self._transport, self._name, self._chan = transport, name, chan
        self._stderr = StderrTail()

    def _lost(self, exc: BaseException | None, what: str) -> ConnectionLost:
        """The session is over. The pooled connection goes too only when it failed (a command
        that ended leaves it as good as it was)."""
        pooled = self._chan.get_transport()
        if exc is not None or pooled is None or not pooled.is_active():
            self._transport._drop(self._name)
        detail = f": {exc or type(exc).__name__}" if exc is not None else ""
        return ConnectionLost(self._name, f"connection lost {what}{detail}")

    def send(self, data: bytes, deadline: float) -> None:
        chan = self._chan
        view = memoryview(data)
        try:
            while view:
                # Its stdout at an end is the command ended, as recv says (b""): the exit status can
                # still be on its way, and sshd takes bytes for a channel whose command is gone.
                if chan.closed or chan.eof_received or chan.exit_status_ready():
                    raise ConnectionLost(self._name, "the command ended while we were sending")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommandTimeout(self._name, "could not send within the deadline")
                if not chan.send_ready():
                    time.sleep(min(remaining, _SEND_POLL))
                    continue
                sent = chan.send(bytes(view[:_SEND_CHUNK]))
                if sent == 0:
                    raise ConnectionLost(self._name, "the command ended while we were sending")
                view = view[sent:]
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise self._lost(exc, "while sending") from exc

    def recv(self, deadline: float) -> bytes:
        chan = self._chan
        try:
            while True:
                while chan.recv_stderr_ready():
                    self._stderr.add(chan.recv_stderr(1 << 16))
                if chan.recv_ready():
                    return bytes(chan.recv(1 << 16))
                if chan.eof_received or chan.closed:
                    return b""
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommandTimeout(self._name, "no answer within the deadline")
                readable(chan, min(remaining, 1.0))
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise self._lost(exc, "while reading") from exc

    def stderr_tail(self) -> str:
        with contextlib.suppress(paramiko.SSHException, EOFError, OSError):
            while self._chan.recv_stderr_ready():
                self._stderr.add(self._chan.recv_stderr(1 << 16))
        return self._stderr.text()

    def close(self) -> None:
        # The agent reads EOF on its stdin and exits; the connection stays pooled for the next one.
        with contextlib.suppress(paramiko.SSHException, EOFError, OSError):
            self._chan.shutdown_write()
        self._chan.close()
