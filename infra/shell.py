"""A shell on a machine: run a command, copy a file each way. Local processes or SSH (paramiko).

The SSH shell verifies the host key against a known_hosts file (or a key the provider returned)
and rejects unknown hosts; it auto-accepts only when the user set `accept_new_host_keys` for this
provider. A dropped connection is re-opened on the next call: the remote run never depended on it.
Keys are read from a path or a secret and never logged.
"""

from __future__ import annotations

import io
import logging
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from jex.errors import InfraError
from jex.infra.backoff import SSH_CONNECT, SSH_RECONNECT, retry

T = TypeVar("T")

log = logging.getLogger(__name__)


class ShellError(InfraError):
    """A command failed on the machine, or the machine could not be reached."""


class Unreachable(ShellError):
    """No connection to the machine (after the reconnect attempts)."""


@dataclass(frozen=True)
class CommandResult:
    code: int
    stdout: str
    stderr: str


class Shell(Protocol):
    def run(self, command: str, *, timeout: float = 120, check: bool = True,
            input: str | None = None) -> CommandResult: ...
    def put(self, local: Path, remote: str) -> None: ...
    def get(self, remote: str, local: Path) -> None: ...
    def close(self) -> None: ...


def _checked(command: str, result: CommandResult, check: bool, where: str) -> CommandResult:
    if check and result.code != 0:
        raise ShellError(f"{where}: `{command[:120]}` exited {result.code}: {result.stderr.strip()[-500:]}")
    return result


class LocalShell:
    """The machine is this host: commands run under bash, files are copied (atomically)."""

    where = "localhost"

    def run(self, command: str, *, timeout: float = 120, check: bool = True,
            input: str | None = None) -> CommandResult:
        """`input` goes to the command's stdin (secrets travel this way, never on a command line)."""
        p = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout,
                           input=input if input is not None else "")
        return _checked(command, CommandResult(p.returncode, p.stdout, p.stderr), check, self.where)

    def put(self, local: Path, remote: str) -> None:
        dest = Path(remote)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part")
        shutil.copyfile(local, tmp)
        tmp.replace(dest)

    def get(self, remote: str, local: Path) -> None:
        self.put(Path(remote), str(local))

    def close(self) -> None:
        pass


@dataclass
class SSHShell:
    """paramiko client with host-key pinning and transparent reconnects."""

    host: str
    port: int = 22
    user: str = "root"
    key_path: Path | None = None
    key_text: str | None = field(default=None, repr=False)
    key_source: str = "the SSH private key"
    """Where `key_text` came from (a setting, a Prefect block), named when it cannot be loaded."""
    known_hosts: Path | None = None
    host_key: str | None = None
    """'TYPE BASE64' returned by the provider (e.g. from the cloud's console output)."""
    accept_new_host_keys: bool = False
    connect_timeout: float = 10.0
    reconnect_attempts: int = 5
    _client: Any = field(default=None, init=False, repr=False)
    """The open `paramiko.SSHClient`, or None (paramiko ships no types)."""

    @property
    def where(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    def private_key(self) -> Any:
        """The key this shell signs in with (its text, else its file), loaded and checked; None: none given."""
        if self.key_text:
            return load_private_key(self.key_text, where=self.key_source)
        return load_private_key_file(self.key_path) if self.key_path else None

    def _host_pattern(self) -> str:
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"

    def _connect(self) -> Any:
        """A connected `paramiko.SSHClient`."""
        import paramiko

        logging.getLogger("paramiko.transport").setLevel(logging.CRITICAL)  # its tracebacks: retry logs the cause
        client = paramiko.SSHClient()
        if self.known_hosts and Path(self.known_hosts).exists():
            client.load_host_keys(str(self.known_hosts))
        if self.host_key:
            kind, b64 = self.host_key.split()[:2]
            client.get_host_keys().add(self._host_pattern(), kind, paramiko.PKey.from_type_string(kind, _b64(b64)))
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy() if self.accept_new_host_keys
                                           else paramiko.RejectPolicy())
        client.connect(self.host, port=self.port, username=self.user, pkey=self.private_key(),
                       timeout=self.connect_timeout, banner_timeout=self.connect_timeout,
                       auth_timeout=self.connect_timeout, allow_agent=False, look_for_keys=False)
        return client

    def client(self) -> Any:
        """The open connection (a `paramiko.SSHClient`), re-opened with backoff when it dropped."""
        transport = self._client.get_transport() if self._client is not None else None
        if transport is not None and transport.is_active():
            return self._client
        import paramiko

        self.private_key()  # a broken key is one line now, not "unreachable after N attempts" later

        def connect() -> Any:
            try:
                return self._connect()
            except paramiko.BadHostKeyException as e:
                raise ShellError(f"ssh {self.where}: host key does not match known_hosts: {e}") from None
            except paramiko.SSHException as e:
                if "not found in known_hosts" in str(e):
                    raise ShellError(f"ssh {self.where}: unknown host key (pin it in known_hosts, or set "
                                     "accept_new_host_keys for this provider)") from None
                raise

        try:
            self._client = retry(connect, replace(SSH_CONNECT, attempts=self.reconnect_attempts),
                                 retry_on=(paramiko.SSHException, OSError), what=f"ssh connect {self.where}")
        except (paramiko.SSHException, OSError) as e:
            raise Unreachable(f"ssh {self.where}: unreachable after {self.reconnect_attempts} attempts: {e}") from None
        return self._client

    def _retrying(self, what: str, fn: Callable[[Any], T]) -> T:
        """`fn(client)`, once more on a fresh connection when the connection dropped under it."""
        import paramiko

        def attempt() -> T:
            client = self.client()
            try:
                return fn(client)
            except (paramiko.SSHException, EOFError, OSError) as e:
                if not isinstance(e, FileNotFoundError):
                    self.drop()  # the next attempt (or call) reconnects
                raise

        return retry(attempt, SSH_RECONNECT, retry_on=(paramiko.SSHException, EOFError, OSError),
                     give_up=lambda e: isinstance(e, FileNotFoundError), what=f"ssh {self.where}: {what}")

    def run(self, command: str, *, timeout: float = 120, check: bool = True,
            input: str | None = None) -> CommandResult:
        def go(client: Any) -> CommandResult:
            stdin, out, err = client.exec_command(command, timeout=timeout)
            if input:
                stdin.write(input)
            stdin.channel.shutdown_write()
            stdout, stderr = out.read().decode(), err.read().decode()
            return CommandResult(out.channel.recv_exit_status(), stdout, stderr)

        return _checked(command, self._retrying("command", go), check, self.where)

    def put(self, local: Path, remote: str) -> None:
        def go(client: Any) -> None:
            with client.open_sftp() as sftp:
                tmp = f"{remote}.part"
                sftp.put(str(local), tmp)
                sftp.posix_rename(tmp, remote)

        self._retrying("upload", go)

    def get(self, remote: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.part")

        def go(client: Any) -> None:
            with client.open_sftp() as sftp:
                sftp.get(remote, str(tmp))
            tmp.replace(local)

        self._retrying("download", go)

    def drop(self) -> None:
        """Close the connection (the next call reconnects); fault tests call this mid-run."""
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001
                pass

    close = drop


_PEM_KINDS = {"RSA": "ssh-rsa", "EC": "ecdsa"}


def private_key_type(text: str, where: str = "the SSH private key") -> str:
    """The key type ('ssh-ed25519', 'ssh-rsa', 'ecdsa-sha2-nistp256', ...) of a private key's text.

    OpenSSH format (`ssh-keygen`'s default): the type is the first field of the public key inside
    the blob (PROTOCOL.key: magic, cipher, kdf, kdf options, key count, public key). PEM: the header.
    """
    import base64
    import struct

    lines = [line.strip() for line in text.strip().splitlines()]
    header = lines[0] if lines else ""
    if header == "-----BEGIN OPENSSH PRIVATE KEY-----":
        try:
            blob = base64.b64decode("".join(line for line in lines[1:] if not line.startswith("-----")))
            magic = b"openssh-key-v1\0"
            if not blob.startswith(magic):
                raise ValueError("no openssh-key-v1 magic")
            pos = len(magic)

            def string() -> bytes:
                nonlocal pos
                (n,) = struct.unpack(">I", blob[pos:pos + 4])
                pos += 4 + n
                return blob[pos - n:pos]

            string(), string(), string()  # cipher, kdf, kdf options
            pos += 4  # number of keys
            public = string()
            (n,) = struct.unpack(">I", public[:4])
            return public[4:4 + n].decode("ascii")
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            raise InfraError(f"{where} is not a readable OpenSSH key ({e})") from None
    for word, kind in _PEM_KINDS.items():
        if header == f"-----BEGIN {word} PRIVATE KEY-----":
            return kind
    raise InfraError(f"{where} is neither OpenSSH nor PEM (RSA/EC/PKCS#8) text; "
                     "write it with `ssh-keygen -t ed25519|rsa|ecdsa`")


def load_private_key(text: str, *, where: str = "the SSH private key") -> Any:
    """A `paramiko.PKey` of the key's actual type (Ed25519, RSA or ECDSA), in OpenSSH, PEM or PKCS#8
    PEM format; any malformed key is one `InfraError` (paramiko raises bare AssertionError,
    ValueError or IndexError on a corrupted one)."""
    import paramiko

    if text.lstrip().startswith("-----BEGIN ENCRYPTED PRIVATE KEY-----"):
        raise InfraError(f"{where} is encrypted; give an unencrypted key (jex asks for no passphrase)")
    if text.lstrip().startswith("-----BEGIN PRIVATE KEY-----"):
        text = _pkcs8_as_openssh(text, where)
    kind = private_key_type(text, where)
    cls = (paramiko.Ed25519Key if kind == "ssh-ed25519" else paramiko.RSAKey if kind == "ssh-rsa"
           else paramiko.ECDSAKey if kind.startswith("ecdsa") else None)
    if cls is None:
        raise InfraError(f"SSH private keys of type {kind} are not supported; use ed25519, rsa or ecdsa")
    try:
        return cls.from_private_key(io.StringIO(text))
    except Exception as e:  # noqa: BLE001 - paramiko's parsers raise anything on a corrupted key
        raise InfraError(f"{where} ({kind}) could not be loaded ({_one_line(e)}); is it corrupted or truncated?"
                         ) from None


def _one_line(e: BaseException) -> str:
    """paramiko's (or cryptography's) complaint about a key in one short line: its whitespace, newlines
    included, collapsed, cryptography's boilerplate before 'Details:' dropped (a PEM header over garbage)."""
    text = " ".join(str(e).split())
    text = text.split("Details:", 1)[1].strip() if "Details:" in text else text
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _pkcs8_as_openssh(text: str, where: str) -> str:
    """A PKCS#8 PEM key ('BEGIN PRIVATE KEY', as openssl writes it) as OpenSSH text, via `cryptography`."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_private_key(text.encode(), password=None)
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                 serialization.NoEncryption()).decode()
    except (ValueError, TypeError, UnicodeError, UnsupportedAlgorithm) as e:
        raise InfraError(f"{where} is not a readable PKCS#8 key ({_one_line(e)})") from None


def load_private_key_file(path: Path) -> Any:
    """The key of a key file (`JEX_INFRA__SSH_KEY_PATH`): read, then loaded as `load_private_key` does."""
    where = f"the SSH private key file {path}"
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise InfraError(f"{where} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise InfraError(f"{where} is not key text (not UTF-8)") from None
    return load_private_key(text, where=where)


def _b64(text: str) -> bytes:
    import base64

    return base64.b64decode(text)
