"""The wire format between the native hook entry (`_native/entry.c`) and `gpuhook service`.

One request and one answer per connection on a SOCK_STREAM unix socket:

    request  = u32 header_len (big-endian) | header (JSON, UTF-8) | state (the OCI state bytes)
    header   = {"v": 1, "argv": [hook arguments, argv[0] excluded], "state": len(state),
                "config_env": $GPUHOOK_CONFIG of the client or null, "pid_fd": true when an fd came with it,
                "cwd": the client's working directory, "exe": its sys.executable, "env": ["NAME=value" of the
                SERVED_ENV it has] (the three optional: a command's), "later": true (optional, below)}
    answer   = u32 exit_code | u32 stderr_len | stderr (UTF-8, the hook's stderr; may be empty)
               [| u32 stdout_len | stdout: only for a `generate-cdi` request (the spec, when it goes to stdout)]
    taking   = u32 TAKING | u32 0: "I will change something for this request once you say so"
    go       = the one byte GO, the client's answer to TAKING

Who owns a start is the client's word, never a guess. Everything the service does before it sends TAKING only
reads (the state, config.json, the plan), so a client that has no TAKING within its bound (a stopped, stuck,
crashed or flooded service: entry.c's GPUHOOK_SERVICE_ACK_MS, 250 ms) closes the connection and runs the call
in-process itself. A client that got TAKING in time sends GO and from then on waits for the answer and never runs
the call itself; the service's child touches nothing until it has read GO, and leaves without a trace when the
connection ends first (the client gave up). So exactly one of the two ever acts: the client's GO decides. Every
start's answer that comes with a log line (no GPU request and a refusal too, answered by the service's parent) comes
after TAKING and GO, so exactly one of the two ever logs it. An answer that comes without TAKING (DECLINED, a bad
request, a ping) changed nothing, logged nothing and is final.

Besides the hooks, Python clients (service/client.py) send `generate-cdi ARGS` (the `gpuhook` console script) and
`runtime-prepare BUNDLE ID CONFIG` (the shim, gpuhook-runtime), with an empty state, their cwd and interpreter;
the native entry sends the same `generate-cdi` request for `ENTRY generate-cdi ARGS` (its interpreter: the Python
entry's #! line).

An exit code of DECLINED means the service took nothing on and did nothing: the client runs the call in-process
(a peer the service cannot pin or will not serve, server.py; a request of another protocol version; a service at
its bound of connections or children; a `cdi-hook` command line only click can word, help or a malformed option,
so the messages stay click's).

The first message of a request may carry one SCM_RIGHTS descriptor: an O_DIRECTORY fd of /proc/<pid> the
client opened for the container's process. The service reaches that process through it (calls.check_pid_fd),
not through the state's pid, which means that process only in the runtime's PID namespace (and a pid reused
meanwhile would name another one).

A `cdi-hook` request may send its header before it has the state ("later": true, "state": 0, no fd): the state
follows as `u32 state_len | state` (read_late_state) once the runtime wrote it. runc runs a createContainer
hook from `runc init`, whose Go runtime (one P) writes the hook's stdin only after its scheduler takes the P back
from the goroutine waiting on the hook (measured 1-5 ms idle under podman); meanwhile the service has parsed
the arguments and handed the connection to the child, which has joined the client's namespace and waits for the
state there. Nothing is done before the state is whole, so a client whose state could not be delivered (the
peer gone: EPIPE, and no answer) may still run the call in-process.

The answer is binary so the C side parses nothing but two integers; the header is JSON so the Python side needs
no parser of its own; it is written here with `_json`'s string encoder, so a client imports neither `json` nor
`socket` (their `re` and `enum` cost the console script's start more than the whole round trip).

Every size is bounded (MAX_HEADER, MAX_STATE, MAX_ANSWER, MAX_OUTPUT) and the whole request must arrive within
REQUEST_TIMEOUT_S: the service refuses what is out of bounds in one line (a client bigger than the bounds before any
of its state is read), and answers DECLINED to a request not whole in time, so that its client runs it. The service
reads requests as their bytes come (Incoming), so a slow client delays nobody else.
"""

from __future__ import annotations

import os
import time
from _json import encode_basestring_ascii as _quote
from _struct import Struct

from gpuhook.errors import GpuhookError, clip

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket

VERSION = 2  # 2: TAKING/GO; a request of another version is DECLINED (its client runs it in-process)
MAX_HEADER = 64 << 10  # argv and a config path: far below this
MAX_STATE = 1 << 20  # the OCI state: id, pid, bundle, annotations; the C entry reads at most this much
MAX_ANSWER = 64 << 10
MAX_OUTPUT = 64 << 20  # a generate-cdi spec on stdout (8 GPUs x 7 MIG: ~0.3 MiB)
GENERATE_CDI, RUNTIME_PREPARE = "generate-cdi", "runtime-prepare"  # the Python clients' commands (client.py)
PING = "ping"  # doctor's question: answered 0 with "gpuhook service pid N" by the resident process itself
OUTPUT_COMMANDS = (GENERATE_CDI, RUNTIME_PREPARE)  # requests whose answer carries stdout
SERVED_ENV = ("PATH", "CUDA_MPS_PIPE_DIRECTORY")  # what a served command reads of its environment (the gpuhook a
# spec names when none is beside the interpreter: discover/executables.py; discover/scan.py): the client's are used
DECLINED = 256  # "not taken: run it in-process" (no exit status is this large)
TAKING = 257  # "about to change something: say GO" (see the module docstring)
GO = b"\x01"
TAKING_WAIT_MS = 250  # how long a client waits for TAKING or an answer before it runs the call itself
TAKING_WAIT_ENV = "GPUHOOK_SERVICE_ACK_MS"  # overrides it, for entry.c and client.py alike (1..60000)
REQUEST_TIMEOUT_S = 1.0  # a client has this long to send its whole request (the native entry sends at once)
LATE_STATE_TIMEOUT_S = 4.0  # a late state waits on the runtime, in the child: below the entry's 5 s answer timeout
_U32 = Struct(">I")


class ProtocolError(GpuhookError):
    """A request outside the format or its bounds: answered with one line, nothing run."""


class OtherVersion(ProtocolError):
    """A request of another protocol version (an entry from another gpuhook): DECLINED, so it runs in-process."""


class Request:
    """One decoded request: the hook's argv, the client's GPUHOOK_CONFIG, the OCI state (or `later`: it follows),
    the /proc/<pid> fd."""

    __slots__ = ("argv", "config_env", "state", "pid_fd", "cwd", "exe", "env", "later")

    def __init__(self, argv: list[str], config_env: str | None, state: bytes, pid_fd: int | None,
                 cwd: str | None = None, exe: str | None = None, env: list[str] | None = None,
                 later: bool = False) -> None:
        self.argv, self.config_env, self.state, self.pid_fd = argv, config_env, state, pid_fd
        self.cwd, self.exe, self.env = cwd, exe, env
        self.later = later  # the state follows the header (read_late_state); `state` is empty until then


def taking_wait_s(environ: dict[str, str] | os._Environ[str]) -> float:
    """TAKING_WAIT_MS, or $GPUHOOK_SERVICE_ACK_MS when it is a whole number in 1..60000, in seconds."""
    value = environ.get(TAKING_WAIT_ENV, "")
    return (int(value) if value.isdigit() and 0 < int(value) <= 60000 else TAKING_WAIT_MS) / 1000


def served_env(environ: dict[str, str] | os._Environ[str]) -> list[str]:
    """The SERVED_ENV entries `environ` has, as NAME=value."""
    return [f"{name}={environ[name]}" for name in SERVED_ENV if name in environ]


def _json_value(value: str | bool | int | list[str] | None) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_quote(v) for v in value) + "]"
    return _quote(value)


def encode_request(argv: list[str], state: bytes, config_env: str | None = None, pid_fd: bool = False,
                   cwd: str | None = None, exe: str | None = None, env: list[str] | None = None,
                   later: bool = False) -> bytes:
    """The request bytes (what entry.c writes); the fd itself goes alongside with send_fds. `later`: the header
    alone (`state` empty), its state to follow (encode_late_state)."""
    if later and state:
        raise ValueError("a request whose state follows carries none in its header")
    fields = {"v": VERSION, "argv": list(argv), "state": len(state), "config_env": config_env, "pid_fd": pid_fd}
    if cwd is not None:
        fields.update(cwd=cwd, exe=exe, env=env or [])
    if later:
        fields["later"] = True
    header = ("{" + ", ".join(f"{_quote(k)}: {_json_value(v)}" for k, v in fields.items()) + "}").encode()
    return _U32.pack(len(header)) + header + state


def encode_taking() -> bytes:
    """The service's TAKING frame (see the module docstring)."""
    return _U32.pack(TAKING) + _U32.pack(0)


def encode_answer(code: int, line: str, output: bytes | None = None) -> bytes:
    """An answer; with `output` (a generate-cdi request's), its stdout part too."""
    data = line.encode(errors="replace")[:MAX_ANSWER]
    answer = _U32.pack(code & 0xFFFFFFFF) + _U32.pack(len(data)) + data
    return answer if output is None else answer + _U32.pack(len(output)) + output


def decode_answer(data: bytes, with_output: bool = False) -> tuple[int, str, bytes]:
    """(exit code, stderr, stdout) of a whole answer (stdout empty unless `with_output`: a generate-cdi
    request's); ProtocolError when it is short or oversized."""
    if len(data) < 8:
        raise ProtocolError(f"short answer ({len(data)} bytes)")
    code, size = _U32.unpack_from(data, 0)[0], _U32.unpack_from(data, 4)[0]
    end = 8 + size
    if size > MAX_ANSWER or len(data) < end or (not with_output and len(data) != end):
        raise ProtocolError(f"answer of {len(data)} bytes does not match its length {size}")
    output = b""
    if with_output and len(data) > end:  # (a refusal or a malformed request is answered before the command is
        if len(data) < end + 4:         # known: no output part)
            raise ProtocolError(f"answer of {len(data)} bytes has a cut output part")
        out_size = _U32.unpack_from(data, end)[0]
        if out_size > MAX_OUTPUT or len(data) != end + 4 + out_size:
            raise ProtocolError(f"answer of {len(data)} bytes does not match its output length {out_size}")
        output = data[end + 4:]
    return code, data[8:end].decode(errors="replace"), output


def encode_late_state(state: bytes) -> bytes:
    """The part a `later` request sends once it has its state."""
    return _U32.pack(len(state)) + state


def _parse_header(raw: bytes) -> tuple[list[str], str | None, int, bool, str | None, str | None, list[str] | None,
                                       bool]:
    import json

    try:
        header = json.loads(raw)
    except ValueError:
        raise ProtocolError("request header is not JSON") from None
    if not isinstance(header, dict):
        raise ProtocolError("request header is not a JSON object")
    if header.get("v") != VERSION:
        raise OtherVersion(f"request version {clip(str(header.get('v')), quote=False)} is not {VERSION}")
    argv, config_env, size = header.get("argv"), header.get("config_env"), header.get("state")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ProtocolError("request argv is not a list of strings")
    if config_env is not None and not isinstance(config_env, str):
        raise ProtocolError("request config_env is not a string")
    _check_state_size(size)
    cwd, exe, env = header.get("cwd"), header.get("exe"), header.get("env")
    if not all(v is None or isinstance(v, str) for v in (cwd, exe)):
        raise ProtocolError("request cwd or exe is not a string")
    if env is not None and (not isinstance(env, list) or not all(isinstance(e, str) for e in env)):
        raise ProtocolError("request env is not a list of strings")
    later = header.get("later", False)
    if later is not False and (later is not True or size or header.get("pid_fd") is True):
        raise ProtocolError("a request whose state follows has no state or descriptor in its header")
    return argv, config_env, size, header.get("pid_fd") is True, cwd, exe, env, later


def _check_state_size(size: object) -> None:
    """A state length, in a header or before a late state: an int within 0..MAX_STATE."""
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_STATE:
        raise ProtocolError(f"request state size {clip(str(size), quote=False)} is outside 0..{MAX_STATE}")


class Incoming:
    """One request read as its bytes come: `feed` takes what one recv gives (never more than the request still
    needs: anything a client sends after its state is never read) and returns the Request once it is whole. The
    service's loop feeds each connection when it is readable, so no client waits on another; a blocking socket
    (read_request, tests) works the same. SCM_RIGHTS descriptors are collected on the way; at most one is kept."""

    __slots__ = ("buf", "need", "sized", "fields", "fds")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.need = 4  # the header's length first
        self.sized = False  # the header's length is known (need = 4 + it)
        self.fields: tuple[list[str], str | None, int, bool, str | None, str | None, list[str] | None,
                           bool] | None = None
        self.fds: list[int] = []

    def feed(self, conn: socket.socket) -> Request | None:
        """One recv from `conn`; the whole Request, or None while more must come. ProtocolError: cut short (the
        client closed) or out of bounds. BlockingIOError passes through (nothing to read yet)."""
        import socket

        data, fds, _flags, _addr = socket.recv_fds(conn, min(self.need - len(self.buf), 1 << 16), 4)
        for fd in fds:  # one descriptor is the format (the header says whether it came); any other is closed
            if self.fields is None and len(self.fds) < 1:
                self.fds.append(fd)
            else:
                os.close(fd)
        if not data:
            raise ProtocolError(f"request cut short after {len(self.buf)} of {self.need} bytes")
        self.buf += data
        while len(self.buf) >= self.need:
            if not self.sized:
                size = _U32.unpack(self.buf[:4])[0]
                if size > MAX_HEADER:
                    raise ProtocolError(f"request header of {size} bytes is over {MAX_HEADER}")
                self.need, self.sized = 4 + size, True
            elif self.fields is None:
                self.fields = _parse_header(bytes(self.buf[4:self.need]))
                del self.buf[:self.need]
                self.need = self.fields[2]
                if self.need == 0:
                    return self._request()
            else:
                return self._request()
        return None

    def _request(self) -> Request:
        assert self.fields is not None
        argv, config_env, _size, has_fd, cwd, exe, env, later = self.fields
        pid_fd = self.fds.pop(0) if self.fds and has_fd else None
        self.close()
        return Request(argv, config_env, bytes(self.buf), pid_fd, cwd, exe, env, later)

    def close(self) -> None:
        """Close the descriptors collected and not handed on (a request given up, or one the header had none for)."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class _Reader:
    """Reads exact byte counts from `conn` within `timeout` seconds in all, collecting SCM_RIGHTS fds (up to 4
    a message) on the way."""

    def __init__(self, conn: socket.socket, timeout: float) -> None:
        self.conn, self.timeout, self.deadline = conn, timeout, time.monotonic() + timeout
        self.fds: list[int] = []
        self.buf = b""

    def read(self, size: int) -> bytes:
        while len(self.buf) < size:
            self._wait()
            import socket

            try:
                data, fds, _flags, _addr = socket.recv_fds(self.conn, min(size - len(self.buf), 1 << 16), 4)
            except socket.timeout:
                raise self._late() from None
            self.fds.extend(fds)
            if not data:
                raise ProtocolError(f"request cut short after {len(self.buf)} of {size} bytes")
            self.buf += data
        out, self.buf = self.buf[:size], self.buf[size:]
        return out

    def _wait(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self._late()
        self.conn.settimeout(left)

    def _late(self) -> ProtocolError:
        return ProtocolError(f"request not complete within {self.timeout:.1f} s")


def read_request(conn: socket.socket, timeout: float = REQUEST_TIMEOUT_S) -> Request:
    """One whole request from `conn` within `timeout` seconds (Incoming, fed until whole); ProtocolError (every fd
    received closed) else."""
    import socket

    incoming, deadline = Incoming(), time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProtocolError(f"request not complete within {timeout:.1f} s")
            conn.settimeout(left)
            try:
                request = incoming.feed(conn)
            except socket.timeout:
                raise ProtocolError(f"request not complete within {timeout:.1f} s") from None
            if request is not None:
                return request
    except BaseException:
        incoming.close()
        raise


def read_late_state(conn: socket.socket, timeout: float = LATE_STATE_TIMEOUT_S) -> bytes:
    """A `later` request's state (encode_late_state's part) within `timeout` seconds; ProtocolError else. A
    descriptor sent with it is closed: the format has none."""
    reader = _Reader(conn, timeout)
    try:
        size = _U32.unpack(reader.read(4))[0]
        _check_state_size(size)
        return reader.read(size)
    finally:
        for fd in reader.fds:
            os.close(fd)


def send_request(sock: socket.socket, argv: list[str], state: bytes, config_env: str | None = None,
                 pid_fd: int | None = None, later: bool = False) -> None:
    """What the native entry does, for tests and Python clients: the request, the fd on its first message
    (`later`: the header alone, `state` empty; then sock.sendall(encode_late_state(the state)))."""
    data = encode_request(argv, state, config_env, pid_fd is not None, later=later)
    if pid_fd is not None:
        import socket

        data = data[socket.send_fds(sock, [data], [pid_fd]):]
    sock.sendall(data)


def recv_answer(sock: socket.socket, with_output: bool = False, go: bool = True,
                prefix: bytes | None = None) -> tuple[int, str, bytes]:
    """The whole answer (until the service closes), decoded (decode_answer). A TAKING frame first is answered
    with GO (`go`; else the answer is (TAKING, "", b"") and nothing more is read): a client that calls this has
    committed to the service's answer. `prefix`: what of the answer was read already (no TAKING in it)."""
    first = b"" if prefix is None else prefix
    while prefix is None and len(first) < 8:
        chunk = sock.recv(8 - len(first))
        if not chunk:
            break
        first += chunk
    if first == encode_taking():
        if not go:
            return TAKING, "", b""
        sock.sendall(GO)
        first = b""
    data, bound = bytearray(first), 12 + MAX_ANSWER + (MAX_OUTPUT if with_output else 0)
    while not _whole(data, with_output):  # until the answer is whole, or the service closes
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
        if len(data) > bound:
            raise ProtocolError("answer over its bound")
    return decode_answer(bytes(data), with_output)


def _whole(data: bytearray, with_output: bool) -> bool:
    """Whether `data` is a whole answer already (its lengths say so): a child's answer is, before the connection
    ends (the service keeps a copy of it until the child is reaped). An answer without its output part (a
    refusal) is whole only at the connection's end."""
    if len(data) < 8:
        return False
    end = 8 + _U32.unpack_from(data, 4)[0]
    if not with_output:
        return len(data) >= end
    return len(data) >= end + 4 and len(data) >= end + 4 + _U32.unpack_from(data, end)[0]
