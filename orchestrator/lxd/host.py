"""LXD: the only module that imports pylxd (and, through it, requests).

One ``LxdHost`` per GPU host per run, over the local unix socket or HTTPS with a client
certificate and a *pinned* server certificate: the server's certificate must have exactly the
pinned SHA-256 fingerprint (no CA, no hostname), and the environment's CA-bundle and proxy
variables (``REQUESTS_CA_BUNDLE``, ``https_proxy``, ...) are ignored so they cannot replace the pin.

LXD reports many failures inside the async operation (HTTP 200, then an operation error such as
"Failed to detect requested GPU device"): every pylxd and requests error becomes ``LxdError``
with LXD's own message. A container we fail to change is put back as it was.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pylxd
import requests
from pylxd import exceptions as lxd_exceptions
from requests.adapters import HTTPAdapter

from orchestrator.config.inventory import LxdEndpoint
from orchestrator.errors import LxdError
from orchestrator.lxd.containers import ContainerSpec, Drift, diff, ipv4, read_instance


class _PinnedAdapter(HTTPAdapter):
    """HTTPS that accepts one server certificate, by fingerprint, and nothing else."""

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        super().__init__()

    def cert_verify(self, conn: Any, url: str, verify: Any, cert: Any) -> None:
        conn.assert_fingerprint = self.fingerprint
        super().cert_verify(conn, url, False, cert)


def cert_fingerprint(pem_path: Path) -> str:
    """SHA-256 of the DER certificate in a PEM file (what ``lxc info`` shows)."""
    import ssl

    try:
        der = ssl.PEM_cert_to_DER_cert(pem_path.read_text())
    except (OSError, ValueError) as exc:
        raise LxdError(str(pem_path), f"cannot read the pinned server certificate: {exc}") from exc
    return hashlib.sha256(der).hexdigest()


@dataclass
class ContainerReport:
    """The containers gate for one container: whether it is right now, what was done to make it so,
    its address and any drift left."""

    name: str
    ok: bool
    detail: str
    status: str = "missing"
    address: str | None = None
    actions: list[str] = field(default_factory=list)
    drift: list[Drift] = field(default_factory=list)


class LxdHost:
    """The LXD of one GPU host. Calls are serialised: LXD itself queues operations per host."""

    def __init__(self, host: str, endpoint: LxdEndpoint, timeout: float = 30.0) -> None:
        self.host = host
        self.endpoint = endpoint
        self._lock = threading.Lock()
        try:
            if endpoint.url == "local":
                self.client = pylxd.Client(timeout=timeout, project=endpoint.project)
            else:
                if endpoint.client_cert is None or endpoint.client_key is None or endpoint.server_cert is None:
                    raise LxdError(host, "an HTTPS LXD endpoint needs client_cert, client_key and server_cert")
                session = requests.Session()
                session.trust_env = False  # no CA bundle or proxy from the environment
                session.cert = (str(endpoint.client_cert), str(endpoint.client_key))
                session.verify = False  # replaced by the fingerprint check below, never skipped
                session.mount("https://", _PinnedAdapter(cert_fingerprint(endpoint.server_cert)))
                self.client = pylxd.Client(
                    endpoint=endpoint.url, timeout=timeout, project=endpoint.project, session=session
                )
                if not self.client.trusted:
                    raise LxdError(
                        host, f"LXD at {endpoint.url} does not trust our client certificate {endpoint.client_cert}"
                    )
        except lxd_exceptions.ClientConnectionFailed as exc:
            raise LxdError(host, _connection_message(endpoint.url, str(exc))) from exc
        except (lxd_exceptions.LXDAPIException, requests.RequestException) as exc:
            raise LxdError(host, f"LXD at {endpoint.url}: {_api_message(exc)}") from exc

    # --- reading -------------------------------------------------------------------------

    def _get(self, name: str) -> Any | None:
        try:
            return self.client.instances.get(name)
        except lxd_exceptions.NotFound:
            return None

    def inspect(self, spec: ContainerSpec) -> ContainerReport:
        """Read-only: state, address and drift from the spec. Never changes anything."""
        with self._lock, _mapped(self.host, spec.name):
            inst = self._get(spec.name)
            instance = None
            if inst is not None:
                instance = {"status": inst.status, "devices": dict(inst.devices), "config": dict(inst.config)}
                if inst.status == "Running":
                    instance["state"] = {"network": inst.state().network}
        found = read_instance(spec, self.host, instance)
        return ContainerReport(spec.name, found.ok, found.detail, found.status, found.address, [], found.drift)

    def read_file(self, name: str, path: str) -> bytes | None:
        """A file of a container, through LXD's file API."""
        with self._lock, _mapped(self.host, name):
            inst = self._get(name)
            if inst is None:
                return None
            try:
                data = inst.files.get(path)
            except lxd_exceptions.NotFound:
                return None
            return bytes(data)

    def status(self, name: str) -> str | None:
        """A container's LXD status (Running, Stopped...), or None when there is no such container."""
        with self._lock, _mapped(self.host, name):
            inst = self._get(name)
            return None if inst is None else str(inst.status)

    # --- changing ------------------------------------------------------------------------

    def ensure(self, spec: ContainerSpec, address_timeout: float = 60.0) -> ContainerReport:
        """Make the container exist, match the spec and run; wait for its IPv4 address."""
        actions: list[str] = []
        with self._lock, _mapped(self.host, spec.name):
            inst = self._get(spec.name)
            created = inst is None
            if inst is None:
                inst = self._create(spec)
                actions.append(f"created from image {spec.image}")
            before_devices, before_config = dict(inst.devices), dict(inst.config)
            drift = [] if created else diff(spec, before_devices, before_config)
            try:
                if drift:
                    inst.devices = {**before_devices, **spec.devices}
                    inst.config = {**before_config, **spec.config}
                    inst.save(wait=True)
                    actions.append("updated " + ", ".join(d.key for d in drift))
                if inst.status != "Running":
                    inst.start(wait=True)
                    actions.append("started")
            except (lxd_exceptions.LXDAPIException, requests.RequestException) as exc:
                self._restore(inst, created, before_devices, before_config)
                message = _api_message(exc)
                if "GPU" in message:
                    message += (
                        f"; the container was left as it was. Check that GPU host {self.host} has these GPUs"
                        " (nvidia-smi) and that the container's gpus / lxd.gpu_pci name them"
                    )
                raise LxdError(self.host, f"container {spec.name}: {message}") from exc
        address = self.wait_address(spec.name, address_timeout)
        detail = f"running, {address}" + (f" ({'; '.join(actions)})" if actions else "")
        return ContainerReport(spec.name, True, detail, "Running", address, actions, drift)

    def _create(self, spec: ContainerSpec) -> Any:
        config = {
            "name": spec.name,
            "source": {"type": "image", "alias": spec.image},
            "profiles": list(spec.profiles),
            "config": dict(spec.config),
            "devices": dict(spec.devices),
        }
        return self.client.instances.create(config, wait=True)

    def _restore(self, inst: Any, created: bool, devices: dict[str, Any], config: dict[str, Any]) -> None:
        """Put a container we failed to change back as it was (or remove one we just made)."""
        try:
            inst.sync()
            if created:
                if inst.status == "Running":
                    inst.stop(wait=True, force=True)
                inst.delete(wait=True)
                return
            if dict(inst.devices) != devices or dict(inst.config) != config:
                inst.devices, inst.config = devices, config
                inst.save(wait=True)
        except (lxd_exceptions.LXDAPIException, requests.RequestException):
            pass  # the original error is what the user needs; LXD keeps its own state consistent

    def wait_address(self, name: str, timeout: float) -> str:
        """Wait until a container has an IPv4 address on its network and return it; a clear error at
        the deadline."""
        deadline = time.monotonic() + timeout
        delay = 0.1
        while True:
            with self._lock, _mapped(self.host, name):
                inst = self._get(name)
                address = ipv4(inst.state().network) if inst is not None else None
            if address:
                return address
            if time.monotonic() > deadline:
                raise LxdError(self.host, f"container {name} has no IPv4 address after {timeout:.0f} s (DHCP on eth0?)")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def stop(self, name: str) -> None:
        """Stop a container (it stays defined)."""
        with self._lock, _mapped(self.host, name):
            inst = self._get(name)
            if inst is not None and inst.status == "Running":
                inst.stop(wait=True, force=True)

    def delete(self, name: str) -> None:
        """Stop and delete a container."""
        with self._lock, _mapped(self.host, name):
            inst = self._get(name)
            if inst is None:
                return
            if inst.status == "Running":
                inst.stop(wait=True, force=True)
            inst.delete(wait=True)

    def names(self, prefix: str = "") -> list[str]:
        """The names of the host's containers that start with prefix."""
        with self._lock, _mapped(self.host, "*"):
            return sorted(i.name for i in self.client.instances.all() if i.name.startswith(prefix))


class _mapped:
    """Context manager: pylxd/requests errors -> LxdError naming host and container."""

    def __init__(self, host: str, name: str) -> None:
        self.host, self.name = host, name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, (lxd_exceptions.LXDAPIException, requests.RequestException)):
            raise LxdError(self.host, f"container {self.name}: {_api_message(exc)}") from exc


def _api_message(exc: BaseException) -> str:
    if isinstance(exc, lxd_exceptions.LXDAPIException):
        try:
            data = exc.response.json()
            message = data.get("error") or data.get("metadata", {}).get("err")
            if message:
                return str(message)
        except (ValueError, AttributeError):
            pass
    return str(exc) or type(exc).__name__


def _connection_message(url: str, raw: str) -> str:
    if "ingerprint" in raw:
        return f"LXD at {url} presented a certificate that is not the pinned server_cert: refused ({raw})"
    return f"cannot reach LXD at {url}: {raw}"
