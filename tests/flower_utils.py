"""Helpers for the Flower tests: an in-process Grid, and real SuperLink/SuperNode processes.

``LocalGrid`` (now fl_platform/flower/local.py) delivers each message straight to our ClientApp
in this process (one Context per node, kept across rounds as a SuperNode keeps it), so the whole
server/client path runs in milliseconds. ``Federation`` starts a real ``flower-superlink`` and ``flower-supernode``s on
loopback (free ports, ``FLWR_HOME`` in a temporary directory, optional TLS and SuperNode
authentication), runs ``flwr`` commands against it, and stops every process it started by PID.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from fl_platform.flower.local import LocalGrid  # noqa: F401  (re-exported: the tests' in-process grid)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# What `flwr run .` packages from this checkout: the top folders of pyproject.toml's fab-include patterns,
# with pyproject.toml itself and the .gitignore Flower applies.
APP_FILES = ("pyproject.toml", ".gitignore")
APP_TREES = tuple(sorted({pattern.split("/")[0] for pattern in tomllib.loads(
    (REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["fab-include"]}))


def stage_app(dest: Path) -> Path:
    """A folder holding only the app's files, for ``flwr run <folder>``: it packages the same FAB as
    ``flwr run .`` from the checkout (tests/test_flower_unit.py compares the two), but Flower lists
    every file under the app folder before it filters, and the checkout's ``.venv`` alone holds
    ~50,000 (7-12 s of CPU per ``flwr run`` here)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in APP_FILES:
        shutil.copy2(REPO / name, dest / name)
    for tree in APP_TREES:
        shutil.copytree(REPO / tree, dest / tree, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


# ---------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1/localhost: (ca.crt, server.pem, server.key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fl_platform test CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP384R1())
    import ipaddress

    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    paths = directory / "ca.crt", directory / "server.pem", directory / "server.key"
    paths[0].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def make_node_key(directory: Path, name: str) -> tuple[Path, Path]:
    """An EC P-384 key pair in OpenSSH format, as ``ssh-keygen -t ecdsa -b 384`` writes it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = directory / name, directory / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    private.chmod(0o600)
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH) + b"\n")
    return private, public


@dataclass
class Federation:
    """A SuperLink and SuperNodes on loopback, with ``FLWR_HOME`` in ``home``; stop() kills them by PID."""

    home: Path
    tls: bool = False
    node_auth: bool = False
    port: int = field(default_factory=free_port)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    certs: tuple[Path, Path, Path] | None = None
    connection: str = "local-test"
    _counter: itertools.count = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "flwr").mkdir(exist_ok=True)
        (self.home / "logs").mkdir(exist_ok=True)
        (self.home / "cwd").mkdir(exist_ok=True)
        if self.node_auth and not self.tls:
            raise ValueError("SuperNode authentication needs TLS")
        if self.tls:
            self.certs = make_certificates(self.home / "certs")

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["FLWR_HOME"] = str(self.home / "flwr")
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.home / "logs" / f"{name}.log", "wb")  # noqa: SIM115 - kept open while it runs
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.home / "cwd",
                                start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.home / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start_superlink(self) -> None:
        args = [str(BIN / "flower-superlink"), "--host", "127.0.0.1", "--port", str(self.port),
                "--disable-runtime-dependency-installation"]
        if self.tls:
            ca, cert, key = self.certs  # type: ignore[misc]
            args += ["--ssl-ca-certfile", str(ca), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
        else:
            args.append("--insecure")
        if self.node_auth:
            args.append("--enable-supernode-auth")
        self._start("superlink", args)
        self.write_connection()
        self.wait_for_port(self.port, "superlink")

    def wait_for_port(self, port: int, name: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
            with socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"{name} did not listen on port {port} within {timeout} s:\n{self.log(name)[-3000:]}")

    def write_connection(self) -> None:
        lines = ["[superlink]", f'default = "{self.connection}"', "", f"[superlink.{self.connection}]",
                 f'address = "{self.address}"']
        if self.tls:
            lines.append(f'root-certificates = "{self.certs[0]}"')  # type: ignore[index]
        else:
            lines.append("insecure = true")
        (self.home / "flwr" / "config.toml").write_text("\n".join(lines) + "\n")

    def start_supernode(self, node_config: str, name: str | None = None, private_key: Path | None = None) -> str:
        name = name or f"supernode{next(self._counter)}"
        args = [str(BIN / "flower-supernode"), "--superlink", self.address, "--port", str(free_port()),
                "--node-config", node_config, "--max-retries", "3", "--max-wait-time", "60"]
        args += ["--root-certificates", str(self.certs[0])] if self.tls else ["--insecure"]  # type: ignore[index]
        if private_key is not None:
            args += ["--auth-supernode-private-key", str(private_key)]
        self._start(name, args)
        return name

    def flwr(self, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run a ``flwr`` CLI command (from the repository root) against this federation."""
        proc = subprocess.run([str(BIN / "flwr"), *args], env=self.env, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"flwr {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
        return proc

    def kill(self, name: str, sig: int = signal.SIGTERM) -> None:
        """Stop process ``name`` (and the ClientApp/ServerApp processes it spawned) by its PID's group.

        ``SIGKILL`` is a device that drops off without a goodbye; ``SIGTERM`` lets it sign off.
        """
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        try:  # the group outlives its leader while the apps it spawned still run
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):  # stragglers of the group
            os.killpg(proc.pid, signal.SIGKILL)

    def stop(self, timeout: float = 20.0) -> None:
        """Stop every process: SIGTERM to each SuperNode's group at once, then the SuperLink; whatever has
        not exited within ``timeout`` seconds is killed (SIGKILL), by group."""
        nodes = [n for n in self.procs if n != "superlink"]
        for group in (nodes, ["superlink"]):
            procs = {n: self.procs.pop(n) for n in group if n in self.procs}
            for proc in procs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for proc in procs.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            time.sleep(0.2)
            for proc in procs.values():
                with contextlib.suppress(ProcessLookupError):  # stragglers of the group
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
