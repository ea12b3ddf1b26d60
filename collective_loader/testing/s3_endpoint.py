"""A local S3 endpoint: moto's S3 server in this process, which can be watched, slowed and stopped.

The demo's ``--remote``, ``bench/loading.py --remote`` and the tests stream from it. It serves
moto's own server application (what ``moto_server`` and ``ThreadedMotoServer`` serve) through a
thin WSGI layer that

- records every request: which client sent it (a process names itself with the environment
  variable ``AWS_SDK_UA_APP_ID``, which botocore appends to its User-Agent as ``app/<id>``), the
  method, the object key, the status and the bytes of the response body;
- adds ``latency`` seconds before answering each GET of an object whose key matches ``slow_keys``
  (a slow or throttled store);
- answers with ``Connection: close``, so that :meth:`S3Endpoint.stop` leaves no kept-alive
  connection being served: after it, every new request is refused, as by a store that went away
  (``ThreadedMotoServer.stop`` keeps its listening socket open, so requests would queue instead).

Objects live in moto's in-process backend, so they survive :meth:`~S3Endpoint.stop` and
:meth:`~S3Endpoint.start` on the same port (the store comes back with its data). Needs
``moto[server]`` (``pip install -e ".[s3]"``)::

    with S3Endpoint() as s3:
        os.environ.update(s3.client_env())        # S3_ENDPOINT_URL and dummy credentials
        s3.create_bucket("data")
        # ... MDSWriter(out="s3://data/tokens", ...), StreamingDataset(remote="s3://data/tokens", ...)
        print(s3.requests_by_client())             # {"rank0": 12, ...}
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

APP_ID_VARIABLE = "AWS_SDK_UA_APP_ID"  # botocore: appended to the User-Agent as "app/<value>"
UNNAMED = "unnamed"  # the client of a request whose User-Agent names no app


@dataclass(frozen=True)
class Request:
    """One request the endpoint answered."""

    client: str  # the sender's AWS_SDK_UA_APP_ID, or UNNAMED
    method: str
    bucket: str
    key: str  # the object's key; "" for a request on the bucket (a listing, its creation)
    status: int
    bytes: int  # bytes of the response body
    time: float  # time.time() when the answer was ready, before it was sent


def client_of(user_agent: str) -> str:
    """The app id in a botocore User-Agent.

    >>> client_of("Boto3/1.43 md/Botocore#1.43 ua/2.1 os/linux app/rank3 cfg/retry-mode#adaptive")
    'rank3'
    >>> client_of("curl/8.5")
    'unnamed'
    """
    for part in user_agent.split():
        if part.startswith("app/"):
            return part[len("app/") :]
    return UNNAMED


class S3Endpoint:
    """moto's S3 on ``http://127.0.0.1:<port>`` (a free port unless given), served from a thread.

    Args:
        port: 0 for a free one; :attr:`port` holds the one in use, kept across restarts.
        latency: seconds added before answering a GET of an object whose key matches
            ``slow_keys`` (a regular expression, searched; every key by default). Both may be
            changed at any time.
    """

    def __init__(self, port: int = 0, latency: float = 0.0, slow_keys: str = "") -> None:
        self.port = port
        self.latency = latency
        self.slow_keys = slow_keys
        self._requests: list[Request] = []
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Serve (again, on the same port after a stop)."""
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            create_backend_app,
        )
        from werkzeug.serving import WSGIRequestHandler, make_server

        class Quiet(WSGIRequestHandler):
            def log_request(self, *args: Any, **kwargs: Any) -> None:  # a line per request is noise here
                pass

        assert self._server is None, "already serving"
        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server("127.0.0.1", self.port, self._observed(app), threaded=True, request_handler=Quiet)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-endpoint", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop answering: requests being answered finish; new connections are refused."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        assert self._thread is not None
        self._thread.join()
        self._server, self._thread = None, None

    def __enter__(self) -> S3Endpoint:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def client_env(self) -> dict[str, str]:
        """What a process needs to reach this endpoint through boto3 and streaming: the endpoint
        and credentials moto accepts (any will do)."""
        return {
            "S3_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self) -> Any:
        """A boto3 S3 client of this endpoint (for set-up and inspection; its requests count as
        this process's)."""
        import boto3

        env = self.client_env()
        return boto3.client(
            "s3",
            endpoint_url=env["S3_ENDPOINT_URL"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_DEFAULT_REGION"],
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    # --- what was asked -------------------------------------------------------------------------

    def requests(self) -> list[Request]:
        """Every request answered so far, in order."""
        with self._lock:
            return list(self._requests)

    def clear(self) -> None:
        """Forget the requests recorded so far."""
        with self._lock:
            self._requests.clear()

    def requests_by_client(self) -> dict[str, int]:
        """Requests per client, over every request recorded."""
        return self._by_client(lambda r: 1)

    def bytes_by_client(self) -> dict[str, int]:
        """Response-body bytes sent to each client."""
        return self._by_client(lambda r: r.bytes)

    def _by_client(self, amount: Callable[[Request], int]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.requests():
            counts[r.client] = counts.get(r.client, 0) + amount(r)
        return counts

    def _observed(self, app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterator[bytes]]:
        def observed(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
            method = environ["REQUEST_METHOD"]
            bucket, _, key = environ.get("PATH_INFO", "/").lstrip("/").partition("/")
            if method == "GET" and key and self.latency > 0 and re.search(self.slow_keys, key):
                time.sleep(self.latency)
            status = [0]

            def start(status_line: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
                status[0] = int(status_line.split()[0])
                headers = [(k, v) for k, v in headers if k.lower() != "connection"] + [("Connection", "close")]
                return start_response(status_line, headers, exc_info)

            body = app(environ, start)
            try:
                chunks = list(body)  # moto's answers are in memory already
            finally:
                close = getattr(body, "close", None)
                if close is not None:
                    close()
            # recorded before the first byte goes out: a client that has its answer finds it counted
            client = client_of(environ.get("HTTP_USER_AGENT", ""))
            request = Request(client, method, bucket, key, status[0], sum(map(len, chunks)), time.time())
            with self._lock:
                self._requests.append(request)
            yield from chunks

        return observed
