"""A local Fireworks hot-load emulator: a real HTTP server on loopback with replicas that really load snapshots.

It exists so the whole publish → signal → load loop runs offline, in tests and in the demo, against the same
HTTP protocol the real service speaks, as Fireworks describes it publicly: same paths, headers, body schema
(unknown fields rejected, pydantic-style), ledger rules, status shape. Replicas download each snapshot from the bucket
through the storage layer, rebuild deltas with the reference decoder (which verifies every tensor's Adler-32),
check the result against the index and weight spec, and only then swap. Faults can be injected to exercise the
trainer's recovery paths.

Endpoints (all answer JSON; errors are ``{"error": {"message": ...}}``):

* ``POST/GET /hot_load/v1/models/hot_load`` — signal / status, routed by the ``fireworks-deployment`` header
* ``POST /hot_load/v1/models/hot_load/hint`` — per-file hint (recorded, not acted on)
* ``DELETE|GET /v1/accounts/<a>/deployments/<d>/ledger`` — reset / read the ledger (oldest row first); GET of a
  deployment no request has named yet is 404, DELETE of one is a no-op (neither creates it)
* ``GET /v1/accounts`` — account lookup, as the Fireworks SDK does it before building headers
* ``GET /emulator/v1/state`` — every deployment's replicas (identity + per-tensor dtype, shape and digest:
  SHA-256 of the three), ledger and hints

The two POSTs need ``Content-Type: application/json`` (else 415). Request bodies need a Content-Length
(chunked bodies get 411); the whole request, headers included, must arrive within ``request_timeout_s`` of the
connection opening (else 400 or 408); HEAD, OPTIONS and other methods get a JSON 405/501 like every error.

Example::

    with HotLoadEmulator("/tmp/bucket", replicas=2, api_key="k") as emu:
        client = HotLoadClient(emu.url, account_id="a", model_id="m", deployment_id="d", api_key="k")
        client.signal("step-1")
        client.wait_ready("step-1", timeout_s=30)
        print(emu.state()["deployments"]["accounts/a/deployments/d"]["replicas"][0]["tensors"])
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from http.server import ThreadingHTTPServer
from typing import Any

from pydantic import ValidationError

from .emulator_http import Handler, Server, Server6
from .emulator_rules import BaseModelSpec
from .emulator_state import Deployment, EmulatorSettings, SignalRejected
from .fireworks_names import deployment_name, model_name
from .fireworks_models import HINT_PATH, HOT_LOAD_PATH, HintRequest, HotLoadRequest

log = logging.getLogger(__name__)

__all__ = ["BaseModelSpec", "HotLoadEmulator", "run_emulator_cli", "format_validation_error"]

STATE_PATH = "/emulator/v1/state"
_LEDGER_RE = re.compile(r"/v1/accounts/([^/]+)/deployments/([^/]+)/ledger")
_MODEL_RE = re.compile(r"accounts/[^/]+/models/[^/]+")
_DEPLOYMENT_RE = re.compile(r"accounts/[^/]+/deployments/[^/]+")
_META_KEYS = ("previous_snapshot_identity", "compression_format", "checksum_format")
#: How long stop() waits, all replica threads together, for the loads it cancelled to reach their next file.
STOP_JOIN_S = 10.0


def _checked(deployment: str) -> str:
    """``deployment``, a name such as ``"accounts/a/deployments/d"`` (a fault injected on a bare id would match
    no request)."""
    if not _DEPLOYMENT_RE.fullmatch(deployment):
        raise ValueError(f"deployment must be a name such as 'accounts/a/deployments/d', got {deployment!r}")
    return deployment


def served_deployments(deployments: Mapping[str, str], account_id: str) -> dict[str, str]:
    """``{deployment: model}`` in full names, read as the client reads ``deployment_id`` and ``model_id``: a bare
    deployment id is in ``account_id``, a bare model id in its deployment's account."""
    out: dict[str, str] = {}
    for dep, model in deployments.items():
        account = dep.split("/")[1] if isinstance(dep, str) and dep.startswith("accounts/") else account_id
        try:
            key, account, _ = deployment_name(account, dep)
            name = model_name(account, model)
        except ValueError as exc:
            raise ValueError(f"deployments {dep!r}: {exc}") from None
        if key in out:
            raise ValueError(f"deployments names {key!r} twice")
        out[key] = name
    if not out:
        raise ValueError("deployments is empty: no request could be served (None serves any deployment)")
    return out


def _is_loopback(host: str) -> bool:
    """Whether the bound address ``host`` is reachable from this machine only (``0.0.0.0`` and ``::`` are not:
    they listen on every interface)."""
    try:
        return ipaddress.ip_address(host.partition("%")[0]).is_loopback
    except ValueError:
        return False


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


def format_validation_error(exc: ValidationError) -> str:
    """Pydantic errors in the one-line style the real server uses (clients match on this text)."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            parts.append(f"Extra inputs are not permitted, field: '{loc}', value: {err.get('input')!r}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"{msg}, field: '{loc}'")
    return "; ".join(parts)


def _require_meta_keys(body: dict[str, Any], where: str) -> None:
    """The docs say all three metadata keys must be sent; the emulator does not default them."""
    meta = body.get("incremental_snapshot_metadata")
    if isinstance(meta, dict):
        for k in _META_KEYS:
            if k not in meta:
                raise _HttpError(400, f"Field required, field: '{where}incremental_snapshot_metadata.{k}'")


def _check_content_type(headers: Any) -> None:
    """The protocol lists ``Content-Type: application/json`` as required (notes §1.3), so a client that drops it
    (an ``additional_headers`` entry that replaces it, say) fails here as it may on the service. 415 is the HTTP
    answer for it; which status the service sends is not documented."""
    value = headers.get("Content-Type") or ""
    if value.split(";", 1)[0].strip().lower() != "application/json":
        raise _HttpError(415, f"Content-Type must be application/json, got {value or 'none'!r}")


class HotLoadEmulator:
    """Serves the hot-load protocol on loopback for snapshots stored under ``bucket``.

    Deployments are created on first use, keyed by the ``fireworks-deployment`` header; each has ``replicas``
    replicas with their own loader thread. ``base_model`` (optional: a Hugging Face model folder or a
    :class:`BaseModelSpec`) is what the deployments were created from: each full snapshot's ``config.json`` is
    compared with its config, and its tensors with the base model's names and shapes, as the real service does
    (§6.2); ``base_config`` alone checks the config only. Full snapshots must hold one layer per file either
    way. ``request_timeout_s`` bounds how long one connection may take to send its whole request (line,
    headers and body), counted from the connection opening, so a stalled or trickling client cannot hold a
    handler thread.
    ``manager_delay_s`` keeps each new deployment's hot-load manager down that long after its first request: GET
    reports no replicas, and signals and hints are refused with 503, counted in ``state()`` as
    ``premature_signals`` and ``premature_hints``. A hint for a file not in the bucket yet is taken (the
    service's answer is not documented) and counted as ``hints_before_file``.
    ``deployments`` (``{deployment id or name: model id or name}``) makes the emulator serve only those, as a
    Fireworks account has only the deployments created in it: a request naming another deployment is answered
    404, and one naming another model 400, so a misspelt id fails here as it would on the service. Without it,
    any deployment is created on first use and serves the first model a request names.
    ``history_limit`` caps the ledger rows and hints each deployment keeps for reading (oldest dropped), so an
    emulator that runs for days stays bounded; identity reuse and delta parents are still checked against every
    identity signalled since the last ledger reset.

    Example::

        emu = HotLoadEmulator("s3://bucket/prefix", storage_options={"endpoint_url": url}).start()
        emu.fail_next_loads(1, replica=0)      # the next load on replica 0 fails
        emu.reject_next_signals(2, status=503)  # the next two signals get HTTP 503
        emu.restart_replica(1)                  # replica 1 rebuilds what it serves from the bucket
        ...
        emu.stop()
    """

    def __init__(
        self,
        bucket: str,
        *,
        storage_options: dict[str, Any] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        replicas: int = 2,
        api_key: str | None = None,
        load_delay_s: float = 0.0,
        manager_delay_s: float = 0.0,
        account_id: str = "emulator",
        compression_formats: Sequence[str] = ("arc_v2",),
        base_config: dict[str, Any] | None = None,
        base_model: str | os.PathLike[str] | BaseModelSpec | None = None,
        request_timeout_s: float = 30.0,
        history_limit: int = 10_000,
        deployments: Mapping[str, str] | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if history_limit < 1:
            raise ValueError(f"history_limit must be >= 1, got {history_limit}")
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        if base_model is not None and base_config is not None:
            raise ValueError("give base_model or base_config, not both (a base model folder has its config.json)")
        if base_model is None:
            base = BaseModelSpec(config=base_config)
        else:
            base = base_model if isinstance(base_model, BaseModelSpec) else BaseModelSpec.from_folder(base_model)
        self.request_timeout_s = float(request_timeout_s)
        self.bucket = bucket
        self.storage_options = dict(storage_options or {})
        self.host = host
        self.port = port
        self.replicas = replicas
        self.account_id = account_id
        self._served = None if deployments is None else served_deployments(deployments, account_id)
        if api_key is not None and not api_key.strip():
            raise ValueError("api_key is empty: no client could match it (None accepts any bearer key)")
        self._api_key = api_key
        self._storage: Any = None
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []
        self._reject: list[tuple[int, str, str | None]] = []  # (status, message, deployment or None: any)
        self._deployments: dict[str, Deployment] = {}
        self._serving = False  # False from stop(): a request still in a handler thread makes no new deployment
        self.settings = EmulatorSettings(
            get_bytes=self._get_bytes, list_files=self._list_files, file_exists=lambda rel: self._bucket().exists(rel),
            load_delay_s=float(load_delay_s), manager_delay_s=float(manager_delay_s),
            compression_formats=tuple(compression_formats), base=base,
            record_error=self._record_error, history_limit=int(history_limit))
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"HotLoadEmulator(bucket={self.bucket!r}, url={self.url if self._server else None!r})"

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self) -> "HotLoadEmulator":
        if self._server is not None:
            return self
        server_cls = Server6 if ":" in self.host else Server
        server = server_cls((self.host, self.port), Handler)
        server.emulator = self
        self._server = server
        with self._lock:
            self._serving = True
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="hotload-emulator-http", daemon=True)
        self._thread.start()
        log.info("hot-load emulator serving %s on %s", self.bucket, self.url)
        if self._api_key is None and not _is_loopback(str(server.server_address[0])):
            log.warning("hot-load emulator listens on %s, which is not a loopback address, without an API key: "
                        "anyone who can reach it may signal loads and reset ledgers with any bearer key (give "
                        "api_key, --api-key in 'hotload emulate')", self.url)
        return self

    def stop(self) -> None:
        """Stop the server and the replica threads; raises the first internal error a background thread hit.

        Every deployment's loads are cancelled first (each stops at its next file), then all replica threads are
        waited for against one deadline, ``STOP_JOIN_S`` from now: waiting on each deployment in turn made a stop
        with many loads in flight take that long per replica. From the start of the stop, every request still
        being read is answered 503."""
        with self._lock:
            self._serving = False
            deps = list(self._deployments.values())
            self._deployments.clear()
        for dep in deps:
            dep.cancel()
        deadline = time.monotonic() + STOP_JOIN_S
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(max(0.0, deadline - time.monotonic()))
            self._server, self._thread = None, None
        running = [name for dep in deps for name in dep.join(deadline)]
        if running:
            log.warning("hot-load emulator stopped with %d replica thread(s) still running after %gs (a bucket read "
                        "that does not return; they end with it): %s", len(running), STOP_JOIN_S, ", ".join(running))
        self.check()

    def check(self) -> None:
        """Re-raise an internal error recorded by a background thread (a bug, not a load failure)."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise RuntimeError(f"hot-load emulator hit {len(errors)} internal error(s); first: {errors[0]!r}") \
                from errors[0]

    def __enter__(self) -> "HotLoadEmulator":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the emulator is not running; call start() first")
        host, port = self._server.server_address[:2]
        host = str(host)
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    # ------------------------------------------------------------------------------------------ faults

    def _named(self, deployment: str) -> str:
        """``deployment``, checked to be a name this emulator would serve."""
        _checked(deployment)
        if self._served is not None and deployment not in self._served:
            raise ValueError(f"no deployment {deployment!r}: this emulator serves {', '.join(sorted(self._served))}")
        return deployment

    def fail_next_loads(self, k: int, replica: int | None = None, deployment: str | None = None) -> None:
        """The next ``k`` loads on ``replica`` (on every replica if None) of ``deployment`` (a name such as
        ``"accounts/a/deployments/d"``; if None, of every deployment, also those no request has named yet, which
        fail their first ``k`` loads) end in stage "error". Each deployment counts its own."""
        targets = range(self.replicas) if replica is None else [replica]
        if replica is not None and not 0 <= replica < self.replicas:
            raise ValueError(f"replica must be in [0, {self.replicas}), got {replica}")
        if deployment is not None:
            self._named(deployment)
        # Both locks for the whole update, in the order _deployment takes them: a deployment a request names
        # meanwhile is then either listed here or made after, taking its count from the "" entry.
        with self._lock, self.settings.lock:
            keys = [deployment] if deployment is not None else [*self._deployments, ""]
            for key in keys:
                for i in targets:
                    self.settings.fail_counts[(key, i)] = self.settings.fail_counts.get((key, i), 0) + k

    def restart_replica(self, replica: int, deployment: str | None = None) -> None:
        """Restart ``replica`` of ``deployment`` (of every deployment a request has named if None) once the loads
        queued on it are done: it loses its weights and rebuilds the snapshot it served from the bucket, the full
        snapshot its chain starts from and every delta after it. Why: a rescheduled or added replica reads the
        chain again, so a file deleted by retention or rewritten after its signal fails here (``stage ==
        "error"``, the replica then serves the base model), not months later in production."""
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica must be in [0, {self.replicas}), got {replica}")
        with self._lock:
            if deployment is not None and deployment not in self._deployments:
                raise ValueError(f"no deployment {deployment!r}: no hot-load request has named it yet")
            deps = [self._deployments[deployment]] if deployment is not None else list(self._deployments.values())
        for dep in deps:
            dep.restart_replica(replica)

    def set_load_delay(self, seconds: float, deployment: str | None = None) -> None:
        """Every load waits this long after its download starts (makes in-flight states observable); with
        ``deployment`` (a name such as ``"accounts/a/deployments/d"``), that deployment's loads only, whatever the
        delay of the others (a region whose loads hang)."""
        if deployment is None:
            self.settings.load_delay_s = float(seconds)
        else:
            self.settings.load_delays[self._named(deployment)] = float(seconds)

    def set_manager_up(self, up: bool, deployment: str) -> None:
        """Take ``deployment``'s hot-load manager down (``up`` False: GET reports no replica, signals and hints are
        refused with 503, as while ``manager_delay_s`` runs) or bring it back; also for a deployment that no
        request has named yet. Why: a region whose manager is down while the trainer starts, and comes up later."""
        with self.settings.lock:
            (self.settings.managers_down.discard if up else self.settings.managers_down.add)(self._named(deployment))

    def reject_next_signals(self, k: int, status: int = 503, message: str = "injected fault: service unavailable",
                            deployment: str | None = None) -> None:
        """The next ``k`` signal POSTs (to ``deployment`` only, a name such as ``"accounts/a/deployments/d"``, if
        given) are answered with ``status`` and ``message`` before any validation of their body."""
        if deployment is not None:
            self._named(deployment)
        with self._lock:
            self._reject.extend([(status, message, deployment)] * k)

    # ------------------------------------------------------------------------------------------ state

    def state(self) -> dict[str, Any]:
        """Same dict as GET /emulator/v1/state."""
        with self._lock:
            deps = dict(self._deployments)
        return {"deployments": {k: d.inspect() for k, d in sorted(deps.items())}}

    def _record_error(self, exc: BaseException) -> None:
        log.error("hot-load emulator internal error: %r", exc)
        with self._lock:
            self._errors.append(exc)

    def _bucket(self) -> Any:
        with self._lock:
            if self._storage is None:
                from .storage import Storage

                self._storage = Storage(self.bucket, self.storage_options)
            return self._storage

    def _get_bytes(self, relpath: str) -> bytes:
        return self._bucket().get_bytes(relpath)

    def _list_files(self, identity: str) -> dict[str, tuple[int, float | None]]:
        return {k: (v.size, v.mtime) for k, v in self._bucket().list_info(identity).items()}

    def _existing(self, key: str) -> Deployment | None:
        """The deployment if a request has named it; the ledger endpoints use this so that reading or resetting an
        unknown deployment does not create one (each costs a thread per replica)."""
        with self._lock:
            return self._deployments.get(key)

    def _deployment(self, key: str, model: str | None) -> Deployment:
        with self._lock:
            dep = self._deployments.get(key)
            if dep is None:
                if not self._serving:  # a request that was in flight as stop() ran: its replicas would outlive it
                    raise _HttpError(503, "the emulator is stopping")
                if self._served is not None and key not in self._served:
                    raise _HttpError(404, f"deployment {key!r} not found: this emulator serves "
                                          f"{', '.join(sorted(self._served))}")
                self.settings.new_deployment(key)
                served = None if self._served is None else self._served[key]
                dep = Deployment(key, served, replicas=self.replicas, settings=self.settings)
                self._deployments[key] = dep
        if model is not None:
            dep.check_model(model)
        return dep

    # ------------------------------------------------------------------------------------------ routing

    def _check_auth(self, headers: Any, path: str) -> None:
        """With an API key, every route needs it. Without one, any key is taken, but the service's routes still
        need an ``Authorization: Bearer`` header, as the service does: a client that sent none passed here and
        failed only against the real API. The emulator's own state route is then open (``curl`` it)."""
        auth = headers.get("Authorization") or ""
        scheme, _, token = auth.partition(" ")
        if self._api_key is None:
            if path != STATE_PATH and (scheme.lower() != "bearer" or not token.strip()):
                raise _HttpError(401, "missing API key (send 'Authorization: Bearer <key>'; this emulator was "
                                      "started without --api-key, so any key is accepted)")
            return
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._api_key.encode()):
            raise _HttpError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')")

    def _routed(self, headers: Any) -> Deployment:
        model, dep = headers.get("fireworks-model"), headers.get("fireworks-deployment")
        if not dep:
            raise _HttpError(400, "missing header fireworks-deployment: accounts/<account>/deployments/<id>")
        if not model:
            raise _HttpError(400, "missing header fireworks-model: accounts/<account>/models/<model>")
        if not _DEPLOYMENT_RE.fullmatch(dep):
            raise _HttpError(400, f"fireworks-deployment {dep!r} must look like accounts/<account>/deployments/<id>")
        if not _MODEL_RE.fullmatch(model):
            raise _HttpError(400, f"fireworks-model {model!r} must look like accounts/<account>/models/<model>")
        return self._deployment(dep, model)

    @staticmethod
    def _json_body(body: bytes) -> dict[str, Any]:
        try:
            obj = json.loads(body)
        except RecursionError:  # the decoder recurses per nesting level: a client's input, not our bug
            raise _HttpError(400, "request body is not valid JSON: nested too deeply") from None
        except ValueError as exc:  # malformed JSON, not UTF-8, an integer over Python's digit limit
            raise _HttpError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise _HttpError(400, "request body must be a JSON object")
        return obj

    def handle(self, method: str, target: str, headers: Any, body: bytes) -> tuple[int, Any]:
        """Route one request; returns (status, JSON-able body)."""
        path = urllib.parse.urlsplit(target).path.rstrip("/") or "/"
        try:
            with self._lock:
                if not self._serving:  # in flight as stop() ran: no route answers as if the emulator were up
                    raise _HttpError(503, "the emulator is stopping")
            self._check_auth(headers, path)
            if method in ("HEAD", "OPTIONS"):
                raise _HttpError(405, f"{method} is not allowed on {path}; the emulator answers GET, POST and DELETE")
            if method == "POST" and path in (HOT_LOAD_PATH, HINT_PATH):
                _check_content_type(headers)
            if path == HOT_LOAD_PATH:
                if method == "POST":
                    return self._signal(headers, body)
                if method == "GET":
                    return 200, self._routed(headers).status()
                raise _HttpError(405, f"{method} is not allowed on {path}")
            if path == HINT_PATH:
                if method != "POST":
                    raise _HttpError(405, f"{method} is not allowed on {path}")
                return self._hint(headers, body)
            m = _LEDGER_RE.fullmatch(path)
            if m:
                key = f"accounts/{m.group(1)}/deployments/{m.group(2)}"
                dep = self._existing(key)
                if method == "DELETE":
                    if dep is not None:  # an unknown deployment has an empty ledger already
                        dep.reset_ledger()
                    return 200, {}
                if method == "GET":
                    if dep is None:
                        raise _HttpError(404, f"no deployment {key!r}: no hot-load request has named it yet")
                    return 200, {"ledger": dep.ledger_rows()}
                raise _HttpError(405, f"{method} is not allowed on {path}")
            if path == "/v1/accounts" and method == "GET":
                return 200, {"accounts": [{"name": f"accounts/{self.account_id}"}]}
            if path == STATE_PATH and method == "GET":
                return 200, self.state()
            raise _HttpError(404, f"no such endpoint: {method} {path}")
        except _HttpError as exc:
            return exc.status, {"error": {"message": str(exc), "code": exc.status}}
        except SignalRejected as exc:
            return exc.status, {"error": {"message": str(exc), "code": exc.status}}

    def _signal(self, headers: Any, body: bytes) -> tuple[int, Any]:
        dep = self._routed(headers)
        with self._lock:
            i = next((i for i, r in enumerate(self._reject) if r[2] in (None, dep.key)), None)
            reject = self._reject.pop(i) if i is not None else None
        if reject is not None:
            raise _HttpError(*reject[:2])
        obj = self._json_body(body)
        try:
            req = HotLoadRequest.model_validate(obj)
        except ValidationError as exc:
            raise _HttpError(400, format_validation_error(exc)) from None
        _require_meta_keys(obj, "")
        return 200, dep.signal(req)

    def _hint(self, headers: Any, body: bytes) -> tuple[int, Any]:
        dep = self._routed(headers)
        obj = self._json_body(body)
        try:
            req = HintRequest.model_validate(obj)
        except ValidationError as exc:
            raise _HttpError(400, format_validation_error(exc)) from None
        if isinstance(obj.get("snapshot"), dict):
            _require_meta_keys(obj["snapshot"], "snapshot.")
        meta = req.snapshot.incremental_snapshot_metadata
        dep.hint(req.snapshot.identity, req.filename, meta.previous_snapshot_identity if meta else None)
        return 200, {"status": "ok"}


def run_emulator_cli(args: list[str] | None = None) -> int:
    """``hotload emulate``: serve until Ctrl-C (the command line lives in :mod:`.emulator_cli`)."""
    from .emulator_cli import main

    return main(args)


if __name__ == "__main__":
    raise SystemExit(run_emulator_cli())
