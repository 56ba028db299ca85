"""How the PostgreSQL sink connects: the checks of its DSN and ``connect_kwargs`` when it is
built, the libpq options its connections get by default (TCP keepalives and a TCP user
timeout, which bound a connection to a server that is gone), and its password kept out of
every message.

Threads: functions without state. ``check_dsn`` runs where the sink is built; the others on
the writer's background thread (which opens its connections) and wherever a message is made.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from snapline.connectors.config import redact_text
from snapline.pipeline.errors import ConfigurationError

__all__ = [
    "REFUSED",
    "TCP_DEFAULTS",
    "ConnectTarget",
    "check_dsn",
    "connect_arguments",
    "hide",
    "passwords",
    "tcp_defaults",
    "where",
    "without_secrets",
]

#: libpq options each connection of the sink gets unless its DSN or ``connect_kwargs`` set
#: them (``tcp_defaults``): a server that is gone without a word (its host down, a network
#: partition: no FIN, no RST) is found within about 40 s, not at the kernel's TCP timeout
#: (15 minutes and more with data in flight, 2 hours and more without), which bounded the
#: writer's waits before: a statement's, and through it the task thread's waits for the
#: background thread (``_drain``, ``close``). Keepalive probes start after 20 s without a
#: packet from the server, every 5 s, and after 40 s without an answer the connection fails
#: (4 probes; Linux ends it at ``tcp_user_timeout``, as long); data the server does not
#: acknowledge for 40 s fails it too. A live server's kernel answers the probes and
#: acknowledges the data while its backend works or waits for a lock, so a long apply is not
#: cut short; a backend that reads none of a COPY's data for 40 s (its receive window stays
#: closed: a server stalled that long) is taken for gone too (so on Linux 6.18, where it was tried).
#: An option given in the DSN or ``connect_kwargs`` wins, ``None`` in ``connect_kwargs`` leaves it
#: to libpq and the system, and ``keepalives=0`` turns all of them off (libpq sets
#: ``tcp_user_timeout`` only with keepalives on). A DSN that names a service (or ``PGSERVICE``) gets
#: none of them: its service file may set them.
TCP_DEFAULTS: Mapping[str, str] = MappingProxyType(
    {
        "keepalives": "1",
        "keepalives_idle": "20",  # seconds
        "keepalives_interval": "5",  # seconds
        "keepalives_count": "4",  # probes
        "tcp_user_timeout": "40000",  # milliseconds
    }
)


class ConnectTarget(Protocol):
    """What the sink is given to connect with (``PostgresSink``)."""

    @property
    def dsn(self) -> str: ...

    @property
    def connect_kwargs(self) -> Mapping[str, Any]: ...

    @property
    def connect_timeout(self) -> float: ...


def connect_arguments(target: ConnectTarget, application_name: str) -> dict[str, Any]:
    """The keyword arguments of a connection of the sink (``psycopg.connect(target.dsn,
    autocommit=True, **these)``): its ``connect_timeout`` (which wins over the DSN's) and
    ``application_name``, the ``TCP_DEFAULTS`` the DSN and ``connect_kwargs`` leave unset,
    and ``connect_kwargs``, which win over all of them."""
    return {
        "connect_timeout": max(1, int(target.connect_timeout)),
        "application_name": application_name[:63],
        **tcp_defaults(target),
        **dict(target.connect_kwargs),
    }


def tcp_defaults(target: ConnectTarget, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The ``TCP_DEFAULTS`` that neither the DSN nor ``connect_kwargs`` name (a ``None`` in
    ``connect_kwargs`` names one: the user leaves it to libpq); none where a service is named
    (``service=`` or ``PGSERVICE`` in ``environ``): its service file may set them, and an
    option given to libpq would win over the file's."""
    try:
        given: dict[str, Any] = dict(conninfo_to_dict(target.dsn))
    except psycopg.Error:
        return {}  # refused when the sink was built (check_dsn): nothing is known of it
    given.update(target.connect_kwargs)
    if given.get("service") or environ.get("PGSERVICE"):
        return {}
    return {name: value for name, value in TCP_DEFAULTS.items() if name not in given}


def where(target: ConnectTarget) -> str:
    """``PostgreSQL at host:port/dbname``, as the DSN names them (no piece of its password:
    ``hide``), for messages."""
    try:
        info = conninfo_to_dict(target.dsn)
    except psycopg.ProgrammingError:
        return "PostgreSQL"
    place = f"{info.get('host', 'localhost')}:{info.get('port', 5432)}" + (
        f"/{info['dbname']}" if info.get("dbname") else ""
    )
    return f"PostgreSQL at {hide(place, passwords(target))}"


# --------------------------------------------------------------------------- the password


def without_secrets(text: str, target: ConnectTarget) -> str:
    """``text`` (a libpq error can quote the DSN, or a piece of a malformed one) without the
    sink's password (``passwords``), wherever it appears, nor credentials in URIs or settings."""
    for secret in passwords(target):
        text = text.replace(secret, "***")
    return redact_text(text)


def passwords(target: ConnectTarget) -> list[str]:
    """The sink's password as each place may write it, longest first (those of 3 characters
    or more: shorter ones would mask any text): ``connect_kwargs``'; the DSN's, as libpq reads
    it and as written in a ``password=`` setting; and in a URI, everything between the user
    name's ``:`` and the last ``@``. That is the password the user meant: libpq ends the user
    info at a ``/`` or the first ``@``, and reads the rest of a password with an unencoded
    ``/`` or ``@`` in it as the host, port, database or query (a refusal quoted
    ``port 'hunter2'`` for ``postgresql://app:hunter2/x@db/shop``)."""
    found = [str(target.connect_kwargs.get("password") or "")]
    with contextlib.suppress(psycopg.Error):
        found.append(str(conninfo_to_dict(target.dsn).get("password") or ""))
    for match in _DSN_PASSWORD.finditer(target.dsn):
        found.append(match.group(1) or match.group(2) or "")
    scheme = _URI_SCHEME.match(target.dsn)
    if scheme is not None:
        userinfo, at, _ = target.dsn[scheme.end() :].rpartition("@")
        if at and ":" in userinfo:
            found.append(userinfo.partition(":")[2])
    return sorted({secret for secret in found if len(secret) >= 3}, key=len, reverse=True)


def hide(value: str, known: Sequence[str]) -> str:
    """``value`` (a piece of the DSN) as ``***`` if it is a piece of one of ``known``, else
    with every run of 3 characters or more that is one replaced by ``***``: a malformed URI
    can split its password among several options, so a value may hold a part of it only, or
    a part and something else."""
    if any(value in secret for secret in known):
        return "***" if value else value
    out: list[str] = []
    i = 0
    while i < len(value):
        longest = 0
        for secret in known:
            n = 3
            while i + n <= len(value) and value[i : i + n] in secret:
                n += 1
            longest = max(longest, n - 1)
        if longest >= 3:
            if not out or out[-1] != "***":
                out.append("***")
            i += longest
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


# --------------------------------------------------------------------------- the checks


#: libpq's sslmode values.
_SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
#: libpq's options that take one of a few words (libpq-connect.html). libpq refuses any other
#: value, an empty one too, at every connection: an OperationalError, taken for an outage.
_ENUMERATED: dict[str, tuple[str, ...]] = {
    "sslmode": _SSLMODES,
    "target_session_attrs": (
        "any",
        "read-write",
        "read-only",
        "primary",
        "standby",
        "prefer-standby",
    ),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "load_balance_hosts": ("disable", "random"),
    "sslnegotiation": ("postgres", "direct"),
    "sslcertmode": ("disable", "allow", "require"),
}
#: libpq's integer options, with the unit the fix names. libpq takes what C's strtol reads
#: whole (blanks around, a sign) within a C int; psycopg reads connect_timeout itself.
_INTEGERS = {
    "connect_timeout": "seconds",
    "keepalives": "1: on, 0: off",
    "keepalives_idle": "seconds",
    "keepalives_interval": "seconds",
    "keepalives_count": "probes",
    "tcp_user_timeout": "milliseconds",
}
_C_INT = re.compile(r"\s*[+-]?[0-9]+\s*")
#: What Linux's setsockopt takes for the keepalive options (TCP_KEEPIDLE, TCP_KEEPINTVL,
#: TCP_KEEPCNT): libpq passes anything else on, and every TCP connection fails (EINVAL) —
#: 0 too, which libpq's documentation calls the system default.
_LINUX_KEEPALIVE_RANGES = {
    "keepalives_idle": 32767,
    "keepalives_interval": 32767,
    "keepalives_count": 127,
}
#: psycopg.connect's own arguments that ``connect_kwargs`` may hold; every other key is a libpq
#: option, but for those of ``_SINKS_OWN_ARGUMENTS``.
_PSYCOPG_ARGUMENTS = frozenset(("prepare_threshold",))
#: psycopg.connect's arguments that set what the sink's own queries return or how its session
#: runs them, and why ``connect_kwargs`` may not hold them (refused when the sink is built).
#: With these two sets, every keyword-only argument of psycopg.connect is named.
_SINKS_OWN_ARGUMENTS = {
    # psycopg.connect raised TypeError (a keyword argument given twice) at the first connection.
    "autocommit": "its session is in autocommit mode, and runs each step in a transaction of "
    "its own",
    # The setup read a dict (or a class) where it reads a tuple: it failed at every
    # connection, and the worker was restarted without end.
    "row_factory": "its queries read their rows as tuples; a row factory gives them rows of "
    "another shape",
    "cursor_factory": "its queries run on psycopg's own cursors, which return rows as "
    "tuples; another cursor class may return or run them otherwise: a RawCursor takes $1 "
    "placeholders, not the sink's %s",
    "context": "its parameters, its COPY and its rows are converted by psycopg's default "
    "adapters; a context's dumpers and loaders send and read them otherwise",
}
#: What libpq says when the server refused the connection for its settings (user,
#: password, database, pg_hba.conf, a bad ``options=-c ...``), which restarts do not fix: not
#: an outage. Not the LDAP, PAM, RADIUS or GSSAPI "authentication failed for user": a server
#: says that too when its LDAP server or KDC is down, an outage.
REFUSED = re.compile(
    r"password authentication failed|no password supplied|no pg_hba\.conf entry|"
    r"pg_hba\.conf rejects connection|is not permitted to log in|"
    r"(database|role) \"[^\"]*\" does not exist|permission denied for database|"
    r"invalid value for parameter|unrecognized configuration parameter|"
    r"permission denied to set parameter",
    re.IGNORECASE,
)


def check_dsn(target: ConnectTarget) -> None:
    """A DSN libpq cannot use fails at start, naming why (no piece of its password shown:
    ``hide``), not at the first connection: a malformed DSN was an OperationalError there,
    taken for a database down, and the worker was restarted for it without end (exit 75).

    Checks what the sink is given, the DSN and the libpq options of ``connect_kwargs`` (which
    win over the DSN's): libpq's parse (syntax, option names), then the values libpq and
    psycopg check only when they connect. Values libpq would take from its environment
    (``PGPORT``, ``PGSSLMODE``...) are not checked: they are read at each connection."""
    found = passwords(target)
    uri = _URI_SCHEME.match(target.dsn) is not None
    encode = (
        " (in a URI, percent-encode '@', '/', '?' and '%' in the user info: %40, %2F, %3F, %25)"
        if uri
        else ""
    )
    try:
        info = {k: str(v) for k, v in conninfo_to_dict(target.dsn).items()}
    except psycopg.ProgrammingError as exc:
        problem = without_secrets(hide(str(exc).strip(), found), target)
        raise ConfigurationError(
            f"PostgresSink dsn is not valid: {problem} "
            "(use 'postgresql://user@host:5432/db' or 'host=... dbname=...')"
            + (encode if "***" in problem else "")
        ) from None
    for name, why in _SINKS_OWN_ARGUMENTS.items():
        if name in target.connect_kwargs:
            raise ConfigurationError(
                f"PostgresSink connect_kwargs: {name} is the sink's own ({why}); remove it"
            )
    given = {
        k: str(v)
        for k, v in target.connect_kwargs.items()
        if k not in _PSYCOPG_ARGUMENTS and v is not None
    }
    try:
        make_conninfo("", **given)
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(
            f"PostgresSink connect_kwargs are not valid: "
            f"{without_secrets(str(exc).strip(), target)} (its keys are libpq connection "
            f"options or psycopg.connect's {', '.join(sorted(_PSYCOPG_ARGUMENTS))})"
        ) from None
    info.update(given)

    def refuse(name: str, problem: str) -> ConfigurationError:
        place = "connect_kwargs" if name in given else "dsn"
        text = without_secrets(f"PostgresSink {place}: {problem}", target)
        return ConfigurationError(text + (encode if place == "dsn" and "***" in text else ""))

    def shown(value: str) -> str:
        """``value`` quoted, without a piece of the password (a malformed URI's)."""
        return repr(hide(value, found))

    if uri and "@" in _uri_path(target.dsn):
        # Not quoted: libpq took the database name from a password's unencoded '/' on.
        raise refuse(
            "dbname",
            "the URI's path (its database name) holds an '@': libpq ends the user info at a "
            "'/', and reads what follows as the database name (percent-encode '@', '/', '?' "
            "and '%' in the user info: %40, %2F, %3F, %25; an '@' in a database name: %40)",
        )
    for host in info.get("host", "").split(","):
        if "@" in host and not host.startswith(("/", "@")):
            # libpq looked it up at every connection, and quoted it in its error.
            raise refuse(
                "host", f"host {shown(host)} is not a host name, an IP address or a socket path"
            )
    for port in info.get("port", "").split(","):
        if port and not (port.strip().isdigit() and 0 < int(port) < 65536):
            raise refuse("port", f"port {shown(port.strip())} is not a port number (1..65535)")
    for name, values in _ENUMERATED.items():
        value = info.get(name)
        if value is not None and value not in values:
            raise refuse(name, f"{name} {shown(value)} is not one of {', '.join(values)}")
    for name, unit in _INTEGERS.items():
        value = info.get(name)
        if value is not None and _integer(name, value) is None:
            kind = "a number" if name == "connect_timeout" else "an integer"
            raise refuse(name, f"{name} {shown(value)} is not {kind} ({unit})")
    if (
        sys.platform.startswith("linux")
        and not _unix_sockets_only(info)
        and _integer("keepalives", info.get("keepalives", "1"))
    ):
        for name, most in _LINUX_KEEPALIVE_RANGES.items():
            number = _integer(name, info.get(name, "1"))
            if number is not None and not 0 < number <= most:
                raise refuse(
                    name,
                    f"{name} {shown(info[name])} is not within 1..{most}, the range Linux "
                    f"takes (libpq passes it on, 0 too, and every TCP connection fails; leave "
                    f"{name} out for the system's default)",
                )
    for address in info.get("hostaddr", "").split(","):
        if address and not _numeric_address(address):
            raise refuse(
                "hostaddr",
                f"hostaddr {shown(address)} is not a numeric IP address (a host name goes in "
                "host=)",
            )
    _check_host_counts(info, refuse)


def _uri_path(dsn: str) -> str:
    """The path (the database name) of a URI DSN as written, as libpq finds it: the user info
    ends at the first ``@`` unless a ``/`` comes first, the hosts at a ``/`` or a ``?``, the
    path at a ``?``."""
    scheme = _URI_SCHEME.match(dsn)
    rest = dsn[scheme.end() :] if scheme is not None else dsn
    userinfo = re.match(r"[^@/]*@", rest)
    if userinfo is not None:
        rest = rest[userinfo.end() :]
    rest = rest[len(re.match(r"[^/?]*", rest).group()) :]  # type: ignore[union-attr]
    return rest[1:].partition("?")[0] if rest.startswith("/") else ""


def _unix_sockets_only(info: Mapping[str, str]) -> bool:
    """Whether every host the options name is a Unix-domain socket (a directory, or ``@`` and
    an abstract name), to which libpq applies no TCP keepalive option. Not where no host is
    given (``PGHOST`` may name a TCP host), nor for a host with a ``hostaddr`` (TCP)."""
    hosts = info["host"].split(",") if info.get("host") else []
    addresses = info["hostaddr"].split(",") if info.get("hostaddr") else []
    return bool(hosts) and all(
        host.startswith(("/", "@")) and not (addresses[i] if i < len(addresses) else "")
        for i, host in enumerate(hosts)
    )


def _integer(name: str, value: str) -> int | None:
    """``value`` as the integer libpq (psycopg for connect_timeout) reads, or None."""
    if name == "connect_timeout":
        try:
            return int(float(value))  # psycopg's own reading (conninfo.timeout_from_conninfo)
        except (ValueError, OverflowError):
            return None
    if _C_INT.fullmatch(value) is None or not -(2**31) <= int(value) < 2**31:
        return None
    return int(value)


def _numeric_address(address: str) -> bool:
    """Whether libpq reads ``address`` as a numeric address (as it does: getaddrinfo with
    AI_NUMERICHOST, which never looks a name up)."""
    try:
        socket.getaddrinfo(address, None, flags=socket.AI_NUMERICHOST)
    except (OSError, UnicodeError):
        return False
    return True


def _check_host_counts(
    info: Mapping[str, str], refuse: Callable[[str, str], ConfigurationError]
) -> None:
    """One hostaddr per host, and one port for all hosts or one per host: psycopg checks
    that at every connection (an OperationalError, taken for an outage). Only where the
    hosts are given: ``PGHOST`` may give them otherwise."""
    hosts = info["host"].split(",") if info.get("host") else []
    addresses = info["hostaddr"].split(",") if info.get("hostaddr") else []
    ports = info["port"].split(",") if info.get("port") else []
    if hosts and addresses and len(hosts) != len(addresses):
        raise refuse(
            "hostaddr",
            f"hostaddr gives {len(addresses)} addresses for the {len(hosts)} names of host "
            "(give one per name, an empty one for a name to look up)",
        )
    count = max(len(hosts), len(addresses))
    if count and 1 < len(ports) != count:
        raise refuse(
            "port",
            f"port gives {len(ports)} ports for {count} hosts (give one port for every host, "
            "or one per host)",
        )


#: The password of a URI DSN (``://user:password@``) or of a ``password=`` setting.
_DSN_PASSWORD = re.compile(r"://[^:/@\s]*:([^@\s]+)@|password\s*=\s*'?([^'\s]+)")
#: How a URI DSN starts (libpq's two schemes).
_URI_SCHEME = re.compile(r"postgres(?:ql)?://")
