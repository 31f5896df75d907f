"""A small OpenAI-compatible chat server on loopback, for tests and benchmarks.

It answers ``POST /v1/chat/completions`` from a script, can wait a fixed latency per
request (each request has its own thread, so a slow request never blocks the others)
and can inject failures: the first ``fail_first`` requests answer ``fail_status``
(e.g. 429, 500, 400) or, with ``fail_status="hang"``, stay silent for ``hang_s``.

    with StubServer(reply=["hello"], latency=0.2) as srv:
        llm = get_llm("openai:stub", base_url=srv.base_url, cache=False)
        llm.chat([{"role": "user", "content": "hi"}])
        srv.requests       # the JSON bodies received
        srv.max_in_flight  # the highest number of requests handled at once

A reply script may also return a dict (sent verbatim as the JSON body, e.g. a completion
without ``choices``) or a :class:`Raw` body (any status, content type, or a body cut short
after ``cut_at`` bytes), to play a misbehaving endpoint. ``finish_reason`` sets the one the
stub reports. While a request waits (latency or hang) the stub watches its socket:
``srv.disconnects`` lists the requests whose client closed the connection first.

``GET /v1/models`` lists the one model, with ``model_info`` merged into its entry (vLLM's
``{"max_model_len": 8192}``); ``GET /props`` answers ``props`` (llama.cpp's ``{"total_slots": 1,
"default_generation_settings": {"n_ctx": 8192}}``), or 404 when it is None, as other servers do.
Every other path is a 404, as on llama-cpp-python's server.

Only the presence of an ``Authorization`` header is recorded (``srv.auth_seen``), never
its value, so nothing a test captures can leak a key.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal



@dataclass
class Raw:
    """A body sent as is: ``cut_at`` sends only that many bytes of it (the declared
    Content-Length stays the full size) and then closes the connection; ``hang_up`` closes it
    before a single byte, as a server that crashed mid-request does."""

    body: str | bytes
    content_type: str = "application/json"
    status: int = 200
    cut_at: int | None = None
    hang_up: bool = False


Reply = str | Sequence[str] | Callable[[dict[str, Any]], "str | dict[str, Any] | Raw"]


def _words(text: str) -> int:
    return len(text.split())


class StubServer:
    """Context manager running the stub in a background thread on ``127.0.0.1:<free port>``."""

    def __init__(self, reply: Reply = "ok", *, latency: float = 0.0, fail_first: int = 0,
                 fail_status: int | Literal["hang"] = 500, hang_s: float = 30.0,
                 model: str = "stub", finish_reason: str = "stop", model_info: dict[str, Any] | None = None,
                 props: dict[str, Any] | None = None):
        self.reply, self.latency, self.model, self.finish_reason = reply, latency, model, finish_reason
        self.model_info, self.props = model_info or {}, props
        self.fail_first, self.fail_status, self.hang_s = fail_first, fail_status, hang_s
        self.requests: list[dict[str, Any]] = []
        self.auth_seen: list[bool] = []
        self.statuses: list[int | str] = []
        self.disconnects: list[int] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> StubServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        handler = type("Handler", (_Handler,), {"stub": self})
        self._server = _Server(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="deepr-stub-server")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()  # wakes hanging / sleeping handlers
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("StubServer is not running; use it as a context manager")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    @property
    def n_requests(self) -> int:
        with self._lock:
            return len(self.requests)

    # -- behaviour -------------------------------------------------------------------
    def _admit(self, body: dict[str, Any], has_auth: bool) -> int:
        """Record the request; return its 0-based index."""
        with self._lock:
            self.requests.append(body)
            self.auth_seen.append(has_auth)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return len(self.requests) - 1

    def _leave(self, status: int | str) -> None:
        with self._lock:
            self.in_flight -= 1
            self.statuses.append(status)

    def _dropped(self, index: int) -> None:
        with self._lock:
            self.disconnects.append(index)

    def _script(self, body: dict[str, Any], index: int) -> str | dict[str, Any] | Raw:
        if callable(self.reply):
            return self.reply(body)
        if isinstance(self.reply, str):
            return self.reply
        replies = list(self.reply)
        # Successful requests walk the list; the last reply repeats once it runs out.
        served = max(0, index - self.fail_first)
        return replies[min(served, len(replies) - 1)]

    def _completion(self, body: dict[str, Any], text: str) -> dict[str, Any]:
        prompt = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
        p, c = _words(prompt), _words(text)
        return {
            "id": f"chatcmpl-stub-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", self.model),
            "choices": [{"index": 0, "finish_reason": self.finish_reason,
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c},
        }


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a hanging request must not block shutdown
    request_queue_size = 256  # the default backlog of 5 drops connections in a concurrent burst


class _Handler(BaseHTTPRequestHandler):
    stub: StubServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: avoid a 40 ms ACK stall

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        """Silence the default per-request stderr log."""

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_raw(self, raw: Raw) -> None:
        data = raw.body.encode() if isinstance(raw.body, str) else raw.body
        if raw.hang_up:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.send_response(raw.status)
        self.send_header("Content-Type", raw.content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: raw.cut_at] if raw.cut_at is not None else data)
        if raw.cut_at is not None:
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    def _wait(self, seconds: float, index: int) -> bool:
        """Wait ``seconds`` (or until the stub stops); True if the client hung up meanwhile."""
        stub, end = self.stub, time.monotonic() + seconds
        while not stub._stop.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.connection], [], [], min(left, 0.05))
            if ready:
                try:
                    gone = self.connection.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    gone = True
                if gone:
                    stub._dropped(index)
                    return True
                stub._stop.wait(min(left, 0.05))  # bytes of a pipelined request: keep waiting
        return False

    def do_GET(self) -> None:  # noqa: N802
        stub, path = self.stub, self.path.rstrip("/")
        if path == "/v1/models":
            entry = {"id": stub.model, "object": "model", "owned_by": "stub", **stub.model_info}
            self._send(200, {"object": "list", "data": [entry]})
        elif path == "/props" and stub.props is not None:
            self._send(200, stub.props)
        else:
            self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
            return
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            self._send(400, {"error": {"message": "body is not JSON", "type": "invalid_request"}})
            return
        stub = self.stub
        index = stub._admit(body, has_auth=bool(self.headers.get("Authorization")))
        if index < stub.fail_first and stub.fail_status == "hang":
            self._wait(stub.hang_s, index)
            stub._leave("hang")
            return
        if stub.latency > 0 and self._wait(stub.latency, index):
            stub._leave("dropped")
            return
        if index < stub.fail_first:
            status = int(stub.fail_status)
            payload = {"error": {"message": f"injected failure {status}", "type": "stub_error", "code": status}}
        else:
            try:
                out = stub._script(body, index)
                status, payload = 200, out if isinstance(out, (dict, Raw)) else stub._completion(body, out)
            except Exception as e:  # a broken test script shows up as a 500 with its reason
                status, payload = 500, {"error": {"message": f"stub reply script failed: {e!r}",
                                                  "type": "stub_error"}}
            if isinstance(payload, Raw):
                status = payload.status
        # Leave before answering: once the client has the reply it may send its next request,
        # which must not be counted as overlapping with this one.
        stub._leave(status)
        try:
            if isinstance(payload, Raw):
                self._send_raw(payload)
            else:
                self._send(status, payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client timed out and closed the socket
