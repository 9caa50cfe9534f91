"""A recorded Kubernetes API server: answers on 127.0.0.1 with responses recorded from a real kube-apiserver
(v1.34, tests/data/dra/*.json: the request that was made, the status code and the JSON body it got), and keeps
every request it receives, so a test asserts what the DRA driver sent as well as what it did with the answers.

A route is (method, path without the query); its answers are played in order, the last one again and again.
A request without a route gets the recorded 404 Status.
"""

from __future__ import annotations

import copy
import json
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent.parent / "data" / "dra"


def recorded(name: str) -> dict[str, Any]:
    """{"request": {method, path}, "code", "body"} as recorded (a fresh copy each time)."""
    return copy.deepcopy(json.loads((DATA / f"{name}.json").read_text()))


class Seen:
    def __init__(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> None:
        self.method, self.path, self.query, self.body = method, path, query, body

    def __repr__(self) -> str:
        return f"{self.method} {self.path}"


class ApiReplay:
    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], list[tuple[int, Any]]] = {}
        self.seen: list[Seen] = []
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.url = ""

    def add(self, name: str, body: Any = None, path: str | None = None, method: str | None = None,
            code: int | None = None) -> dict[str, Any]:
        """Answer the recorded request `name` (its method and path unless given) with its recorded code and body
        (or `body`, an edited copy). Returns the record."""
        rec = recorded(name)
        key = (method or rec["request"]["method"], urllib.parse.urlsplit(path or rec["request"]["path"]).path)
        with self.lock:
            self.routes.setdefault(key, []).append((code or rec["code"], rec["body"] if body is None else body))
        return rec

    def clear(self) -> None:
        with self.lock:
            self.routes.clear()
            self.seen.clear()

    def requests(self, method: str | None = None, prefix: str = "") -> list[Seen]:
        with self.lock:
            return [s for s in self.seen if (method is None or s.method == method) and s.path.startswith(prefix)]

    def _answer(self, method: str, raw_path: str, body: Any) -> tuple[int, Any]:
        split = urllib.parse.urlsplit(raw_path)
        with self.lock:
            self.seen.append(Seen(method, split.path, urllib.parse.parse_qs(split.query), body))
            answers = self.routes.get((method, split.path))
            if not answers:
                return 404, recorded("claim-missing")["body"]
            return answers.pop(0) if len(answers) > 1 else answers[0]

    @contextmanager
    def serve(self) -> Iterator[ApiReplay]:
        replay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall

            def _do(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                code, answer = replay._answer(self.command, self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _do

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.server.shutdown()
            self.server.server_close()
