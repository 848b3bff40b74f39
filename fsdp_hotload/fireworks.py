"""Client for the Fireworks hot-load API: signal a snapshot, send per-file hints, poll until it is served.

The wire protocol is the one Fireworks documents publicly; this module is the trainer's side of it. The
request/response models and error types live in :mod:`fsdp_hotload.fireworks_models` (shared with the local
emulator, so both sides validate the same schema) and are re-exported here; one exchange on the wire, the URL
check and what each HTTP status means live in :mod:`fsdp_hotload.fireworks_http`.

The API key is held in a wrapper whose ``repr`` is redacted, and every message this module builds from server
text passes through a redaction step, so the key never reaches a log line or a traceback.

Only the standard library speaks HTTP (``http.client``): the client must work in trainer images where
``requests`` is not installed.

Example::

    client = HotLoadClient("https://api.fireworks.ai", account_id="acme",
                           model_id="accounts/fireworks/models/qwen3-8b",
                           deployment_id="rl-rollouts")        # key from FIREWORKS_API_KEY
    client.signal("step-00040")                                 # full snapshot
    client.wait_ready("step-00040", timeout_s=600)
    client.signal("step-00041", previous_identity="step-00040")  # arc_v2 delta on top of it
    client.wait_ready("step-00041")
"""
from __future__ import annotations

import json
import logging
import os
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from .fireworks_connect import Canceller, RequestCancelled
from .fireworks_http import (
    MAX_RESPONSE_BYTES,
    RETRYABLE_STATUS,
    Headers,
    NotSent,
    check_url,
    extract_server_message,
    fatal_while_polling,
    hint_for,
    is_loopback,
    redirect_base,
    retry_after,
    send_once,
    status_seen,
    tls_context,
)
from .fireworks_http import unsendable as unsendable_failure
from .fireworks_proxy import proxy_answer, unreachable_hint
from .fireworks_models import (
    HINT_PATH,
    HOT_LOAD_PATH,
    IDENTITY_MAX_LEN,
    HintRequest,
    HintSnapshot,
    HotLoadBodyError,
    HotLoadCancelled,
    HotLoadError,
    HotLoadRequest,
    HotLoadRequestError,
    HotLoadResponseError,
    HotLoadStatus,
    HotLoadTimeout,
    IncrementalSnapshotMetadata,
    LoadedAdapter,
    LoadingState,
    ReplicaStatus,
    ResetPromptCache,
    ValidationOptions,
    validate_filename,
    validate_identity,
)
from .fireworks_names import API_KEY_ENV, Secret, clean_api_key, clean_headers, deployment_name, model_name
from .storage_errors import backoff_delay

log = logging.getLogger(__name__)
#: Shorter secrets (an emulator's made-up key) are not removed from messages: they would match ordinary text.
MIN_REDACTED = 4

__all__ = [
    "API_KEY_ENV",
    "DeploymentTarget",
    "HINT_PATH",
    "HOT_LOAD_PATH",
    "IDENTITY_MAX_LEN",
    "HintRequest",
    "HintSnapshot",
    "HotLoadBodyError",
    "HotLoadCancelled",
    "HotLoadClient",
    "HotLoadError",
    "HotLoadRequest",
    "HotLoadRequestError",
    "HotLoadResponseError",
    "HotLoadStatus",
    "HotLoadTimeout",
    "IncrementalSnapshotMetadata",
    "LoadedAdapter",
    "LoadingState",
    "ReplicaStatus",
    "ResetPromptCache",
    "ValidationOptions",
    "extract_server_message",
    "is_loopback",
    "validate_filename",
    "validate_identity",
]

DEFAULT_BASE_URL = "https://api.fireworks.ai"
SOURCE_URL_HEADER = "x-fireworks-hot-load-source-url"
#: The hint of a request whose retries ``until()`` ended (``straggler_wait_s``): nothing for the user to fix.
RELEASED_HINT = "none: its retries ended when another deployment served the snapshot (straggler_wait_s); this " \
    "deployment's catch-up polls on"


class DeploymentTarget(BaseModel):
    """One deployment to publish to; a snapshot can be signalled to several.

    Example::

        target = DeploymentTarget(account_id="acme", model_id="accounts/fireworks/models/qwen3-8b",
                                  deployment_id="rollouts-eu")
        client = target.client(api_key=key)
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    account_id: str
    model_id: str
    deployment_id: str
    base_url: str = DEFAULT_BASE_URL

    @property
    def deployment_name(self) -> str:
        return deployment_name(self.account_id, self.deployment_id)[0]

    def client(self, **kwargs: Any) -> "HotLoadClient":
        return HotLoadClient(
            self.base_url,
            account_id=self.account_id,
            model_id=self.model_id,
            deployment_id=self.deployment_id,
            **kwargs,
        )


# ---------------------------------------------------------------------------------------------------- client


class HotLoadClient:
    """Signals snapshots to one Fireworks deployment and waits until they are served.

    Transient failures (connection errors, timeouts, 408/429/5xx) are retried with capped exponential backoff
    (``backoff_initial_s`` doubling up to ``backoff_max_s``; ``Retry-After`` is a floor, itself capped at
    ``backoff_max_s``) for at most ``retry_budget_s`` seconds, attempts included (each is cut to what is left of the
    budget, ``timeout_s`` at most). A re-signal of the same identity is assumed idempotent (Fireworks does not
    document it); a 409 to a retry is taken as the earlier attempt accepted.

    Example::

        client = HotLoadClient("http://127.0.0.1:8083", account_id="acme", model_id="m", deployment_id="d",
                               api_key="...")
        client.signal("step-7")
        status = client.wait_ready("step-7", timeout_s=120)
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        account_id: str,
        model_id: str,
        deployment_id: str,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retry_budget_s: float = 300.0,
        poll_interval_s: float = 5.0,
        additional_headers: Mapping[str, str] | None = None,
        allow_insecure: bool = False,
        control_plane_url: str | None = None,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
    ) -> None:
        env_key = os.environ.get(API_KEY_ENV)
        key = api_key if api_key is not None else env_key
        if not key:
            raise ValueError(f"no Fireworks API key: set {API_KEY_ENV} (or pass api_key=)")
        # Callers often resolve the environment variable themselves and pass it on: name it in that case too.
        source = f"${API_KEY_ENV}" if api_key is None or api_key == env_key else "the api_key field"
        self._api_key = Secret(clean_api_key(key, source))
        self.deployment_name, self.account_id, self.deployment_id = deployment_name(account_id, deployment_id)
        self.model_name = model_name(self.account_id, model_id)
        self.base_url = check_url(base_url, allow_insecure, "base_url")
        self.control_plane_url = check_url(control_plane_url or base_url, allow_insecure, "control_plane_url")
        for name, value in (("timeout_s", timeout_s), ("poll_interval_s", poll_interval_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if retry_budget_s < 0 or backoff_initial_s < 0 or backoff_max_s < 0:
            raise ValueError("retry_budget_s, backoff_initial_s and backoff_max_s must be >= 0")
        self.timeout_s = float(timeout_s)
        self.retry_budget_s = float(retry_budget_s)
        self.poll_interval_s = float(poll_interval_s)
        self.backoff_initial_s = float(backoff_initial_s)
        self.backoff_max_s = float(backoff_max_s)
        # Headers' repr hides the values: vars(client), debuggers and error reporters that record locals print it
        self.additional_headers = Headers(clean_headers(dict(additional_headers or {}), "additional_headers"))
        # Older servers reject reset_prompt_cache as an unknown field; after the first such 400 we stop sending it.
        self.send_reset_prompt_cache = True
        # read only where TLS is used: a stale REQUESTS_CA_BUNDLE must not fail a client of an http:// API
        uses_tls = "https" in (self.base_url.scheme, self.control_plane_url.scheme)
        self._ssl = tls_context() if uses_tls else None
        self._canceller = Canceller()

    def cancel(self) -> None:
        """End this client's waits and requests now, from any thread; every later call raises
        :class:`HotLoadCancelled`. For an owner that is closing (a publisher giving up on a snapshot), whose
        thread would otherwise poll a deployment for up to its whole readiness timeout."""
        self._canceller.cancel()

    def __repr__(self) -> str:
        return (
            f"HotLoadClient(base_url={urllib.parse.urlunsplit(self.base_url)!r}, model={self.model_name!r}, "
            f"deployment={self.deployment_name!r}, api_key={self._api_key!r})"
        )

    __str__ = __repr__

    # --------------------------------------------------------------------------------------------- transport

    def redact(self, text: str) -> str:
        """``text`` with the key and the extra headers' values (a gateway's secret) removed, also in the escaped
        forms ``repr`` of a str or bytes and a JSON string give them. For text a server sent (a replica's error)
        that is logged outside the client's own errors. Values under :data:`MIN_REDACTED` characters are left:
        they would match ordinary text (a key ``k`` for the emulator cut every ``k`` out of every message)."""
        secrets = [self._api_key.get(), *self.additional_headers.values()]
        for secret in (s for s in secrets if len(s) >= MIN_REDACTED):
            for form in {secret, repr(secret)[1:-1], repr(secret.encode())[2:-1], json.dumps(secret)[1:-1]}:
                text = text.replace(form, "<redacted>")
        return text

    def headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Headers of every hot-load request; caller ``additional_headers`` override the defaults."""
        h: dict[str, str] = Headers({
            "Authorization": f"Bearer {self._api_key.get()}",
            "fireworks-model": self.model_name,
            "fireworks-deployment": self.deployment_name,
            "Content-Type": "application/json",
        })
        h.update(extra or {})
        lowered = {k.lower() for k in self.additional_headers}
        for k in [k for k in h if k.lower() in lowered]:
            del h[k]
        h.update(self.additional_headers)
        return h

    def _request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        extra_headers: Mapping[str, str] | None = None,
        deadline: float | None = None,
        control_plane: bool = False,
        until: Callable[[], float] | None = None,
    ) -> Any:
        """One API call with transport retries; returns the parsed JSON body (None for an empty body). ``until()``
        (a ``time.monotonic()`` value, re-read before each attempt and retry) may end them sooner than ``deadline``:
        another deployment's readiness can bring it forward (``straggler_wait_s``) while the server answers 503 or
        not at all."""
        base = self.control_plane_url if control_plane else self.base_url
        what = f"{method} {urllib.parse.urlunsplit(base).rstrip('/')}{path}"
        payload = json.dumps(body).encode() if body is not None else None
        headers = self.headers(extra_headers)
        start = time.monotonic()
        end = start + self.retry_budget_s
        if deadline is not None:
            end = min(end, deadline)

        def stop() -> float:  # when the attempts and retries end now
            return end if until is None else min(end, until())
        attempt = sent = 0  # sent: the attempts that may have reached the server
        heard = False  # a status line came, though no whole answer
        signal = method == "POST" and path == HOT_LOAD_PATH
        while True:
            attempt += 1
            if self._canceller.cancelled:
                raise self._cancelled(what)
            # Each attempt gets what is left of the budget (at least 0.5 s to have a chance): the budget, not
            # timeout_s, is what callers plan with (longest_signal_s), and a server that takes a request and never
            # answers must not hold the last attempt a full timeout_s past it.
            timeout = min(self.timeout_s, max(0.5, stop() - time.monotonic()))
            status: int | None = None
            data = b""
            rheaders: dict[str, str] = {}
            wait_hint: float | None = None
            unsendable: str | None = None
            cancelled = False
            hint: str | None = None
            try:
                status, rheaders, data, oversized = send_once(base, method, path, payload, headers, timeout,
                                                              self._ssl, self._canceller, until)
            except RequestCancelled:
                cancelled = True
            except Exception as exc:  # noqa: BLE001 - sorted by unsendable(): retried, or raised at once
                refused = unsendable_failure(exc, base)
                if refused is not None:
                    unsendable, hint = f"{what}: {refused[0]}", refused[1]
                else:
                    failure = f"{type(exc).__name__}: {exc}"
                    sent += not isinstance(exc, NotSent)
                    heard = heard or status_seen(exc)
            else:
                sent += 1
                if 200 <= status < 300:
                    if oversized:
                        raise HotLoadBodyError(f"{what} returned a body over {MAX_RESPONSE_BYTES} bytes",
                                               hint="check that base_url (hotload_api_url) points at the "
                                               "Fireworks hot-load API")
                    return self._parse_json(what, data)
                if status not in RETRYABLE_STATUS:
                    raise self._http_error(what, status, data, attempt, sent, rheaders, signal, path=path, base=base)
                failure = f"HTTP {status}: {extract_server_message(data, self.redact)}"
                wait_hint = retry_after(rheaders)
            if cancelled:
                raise self._cancelled(what)
            if unsendable is not None:
                # Raised outside the except block so the original exception (whose text may hold the key) is
                # not chained as __context__.
                raise HotLoadRequestError(self.redact(unsendable), hint=hint, attempts=sent)
            delay = backoff_delay(attempt, self.backoff_initial_s, self.backoff_max_s, 1.0)  # no jitter: one caller
            if wait_hint is not None:
                delay = max(delay, min(wait_hint, self.backoff_max_s))
            if time.monotonic() + delay > stop():
                released = time.monotonic() + delay <= end  # until() ended the retries, not the budget
                hint = RELEASED_HINT if released else None
                if status is not None:
                    raise self._http_error(what, status, data, attempt, sent, rheaders, signal, hint, path, base)
                raise HotLoadError(
                    self.redact(
                        f"{what}: no {'complete ' if heard else ''}answer after {attempt} attempt(s) over "
                        f"{time.monotonic() - start:.1f}s: {failure}"
                    ),
                    hint=hint or (unreachable_hint(base) or "check that base_url (hotload_api_url) is reachable "
                    "from this host (proxy, firewall, DNS)") + "; raise retry_budget_s for flaky networks "
                    "(HotloadConfig: ready_timeout_s, capped at 300 s)",
                    attempts=sent,
                )
            log.warning("%s failed (%s); retry %d in %.1fs", what, self.redact(failure), attempt, delay)
            if self._canceller.wait(delay):
                raise self._cancelled(what)

    def _cancelled(self, what: str) -> HotLoadCancelled:
        return HotLoadCancelled(self.redact(f"{what}: cancelled (the client is closing)"))

    def _redact_body(self, data: bytes) -> bytes:
        """The body with the key removed, before anything cuts it short: a key split by a cut is not found."""
        return self.redact(data.decode("utf-8", errors="replace")).encode()

    def _http_error(self, what: str, status: int, data: bytes, attempts: int, sent: int,
                    headers: Mapping[str, str], signal: bool, hint: str | None = None, path: str = "",
                    base: urllib.parse.SplitResult | None = None) -> HotLoadError:
        """The error for an answer that ends a request; ``path`` (the request's, under ``base``) is taken off a
        redirect's Location in the hint, and a 403 or 407 through a proxy is said to be possibly the proxy's."""
        message = extract_server_message(data, self.redact)
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        location = self.redact(headers["location"]) if 300 <= status < 400 and "location" in headers else None
        moved = f" (Location: {location})" if location else ""
        via = proxy_answer(status, base) if base is not None else None
        return HotLoadError(
            f"{what} returned HTTP {status}{moved}{via[0] if via else ''}{tries}: {message}",
            status_code=status,
            server_message=message,
            hint=hint or (via[1] if via else None) or hint_for(
                status, location and redirect_base(location, path), signal=signal),
            response_text=self._response_text(data),
            attempts=sent,
        )

    def _response_text(self, data: bytes) -> str:
        """The whole error body with the secrets removed. A JSON body is re-encoded first: a server that echoes a
        header escapes it (``\\/`` for '/', ``\\u00xx``), which the raw text does not match."""
        text = data.decode("utf-8", errors="replace")
        try:
            text = json.dumps(json.loads(text))
        except (ValueError, RecursionError):
            pass
        return self.redact(text)

    def _parse_json(self, what: str, data: bytes) -> Any:
        """The JSON body, or None for an empty one: kept apart from a literal ``{}``, which is an answer."""
        if not data.strip():
            return None
        try:
            return json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            raise HotLoadBodyError(
                f"{what} returned a body that is not JSON: {self._redact_body(data)[:200]!r}",
                hint="check that base_url (hotload_api_url) points at the Fireworks API (or a gateway that "
                "forwards it)",
            ) from None

    # --------------------------------------------------------------------------------------------- API

    def signal(
        self,
        identity: str,
        *,
        previous_identity: str | None = None,
        reset_prompt_cache: ResetPromptCache | None = None,
        validation: ValidationOptions | Mapping[str, Any] | None = None,
        source_url: str | None = None,
        compression_format: str = "arc_v2",
        deadline: float | None = None,
    ) -> dict[str, Any]:
        """Tell the deployment that snapshot ``identity`` is complete in the bucket (a delta when
        ``previous_identity`` is given). Returns the response body; success means accepted, not loaded.
        ``deadline`` (``time.monotonic()``) ends the retries before ``retry_budget_s`` does."""
        validate_identity(identity)
        if previous_identity is not None:
            validate_identity(previous_identity, field="previous_identity")
        meta = (
            IncrementalSnapshotMetadata(previous_snapshot_identity=previous_identity,
                                        compression_format=compression_format)
            if previous_identity is not None
            else None
        )
        if isinstance(validation, Mapping):
            validation = ValidationOptions.model_validate(dict(validation))
        extra = {SOURCE_URL_HEADER: source_url} if source_url else None

        def body(with_cache: bool) -> dict[str, Any]:
            return HotLoadRequest(
                identity=identity,
                incremental_snapshot_metadata=meta,
                reset_prompt_cache=reset_prompt_cache if with_cache else None,
                validation=validation,
            ).to_body()

        with_cache = reset_prompt_cache is not None and self.send_reset_prompt_cache
        try:
            result = self._request("POST", HOT_LOAD_PATH, body(with_cache), extra_headers=extra, deadline=deadline)
        except HotLoadError as exc:
            if exc.status_code == 409 and exc.attempts > 1:
                # A conflict for a signal sent again (an answer lost, a 5xx): the identity is new to this run, so
                # the likely conflict is with the earlier attempt, which the server took. The readiness wait
                # that follows tells whether it did.
                log.warning("signal of %r to %s: HTTP 409 after %d attempts, taken as an earlier attempt accepted; "
                            "waiting for readiness decides (%s)", identity, self.deployment_name, exc.attempts,
                            exc.server_message)
                return {}
            # The whole response, as the reference client reads it: the message extracted for display
            # (error.message, a gRPC status' message, the first 200 characters) may not name the field.
            text = (exc.response_text or exc.server_message or "").lower()
            if not (
                with_cache
                and exc.status_code == 400
                and "reset_prompt_cache" in text
                and "extra inputs are not permitted" in text
            ):
                raise
            log.warning("hotload: server does not accept reset_prompt_cache; signalling %r without it from now on",
                        identity)
            self.send_reset_prompt_cache = False
            result = self._request("POST", HOT_LOAD_PATH, body(False), extra_headers=extra, deadline=deadline)
        log.debug("hotload: signalled %s snapshot %r to %s", "delta" if meta else "full", identity,
                  self.deployment_name)
        if result is None:
            return {}
        return result if isinstance(result, dict) else {"response": result}

    def hint(self, identity: str, filename: str, *, previous_identity: str | None = None,
             compression_format: str = "arc_v2", deadline: float | None = None) -> None:
        """Tell replicas that one file of ``identity`` is durable, so they can start fetching it early.
        ``deadline`` (a ``time.monotonic()`` value) bounds the call, retries included."""
        meta = None
        if previous_identity is not None:
            validate_identity(previous_identity, field="previous_identity")
            meta = IncrementalSnapshotMetadata(previous_snapshot_identity=previous_identity,
                                               compression_format=compression_format)
        req = HintRequest(
            snapshot=HintSnapshot(identity=validate_identity(identity), incremental_snapshot_metadata=meta),
            filename=validate_filename(filename),
        )
        self._request("POST", HINT_PATH, req.to_body(), deadline=deadline)

    def status(self, *, deadline: float | None = None, until: Callable[[], float] | None = None) -> HotLoadStatus:
        """One status poll; ``deadline`` and ``until`` bound its retries as in :meth:`_request`."""
        what = f"GET {urllib.parse.urlunsplit(self.base_url).rstrip('/')}{HOT_LOAD_PATH}"
        data = self._request("GET", HOT_LOAD_PATH, deadline=deadline, until=until)
        if data is None:  # an empty body (a proxy's, or the route still coming up): polled through like non-JSON
            raise HotLoadBodyError(f"{what} returned an empty body")
        try:
            return HotLoadStatus.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "the body"
            raise HotLoadResponseError(
                f"{what}: unrecognized hot-load status response format: {where}: {err['msg']} "
                f"in {self.redact(json.dumps(data))[:200]}",
                hint="check that base_url (hotload_api_url) points at the hot-load gateway of this deployment",
            ) from None

    def wait_manager(self, *, timeout_s: float = 300.0) -> HotLoadStatus:
        """Poll until the deployment reports a replica: its hot-load manager is up. Why: a signal sent before
        then can crash the serving container, so the reference client waits like this before its first signal."""
        return self.wait_ready(None, timeout_s=timeout_s)

    def wait_ready(
        self,
        identity: str | None,
        *,
        timeout_s: float = 600.0,
        on_poll: Callable[[HotLoadStatus], None] | None = None,
        until: Callable[[], float] | None = None,
    ) -> HotLoadStatus:
        """Poll until every replica serves ``identity`` (None: until any replica is reported); fail fast on an
        error stage for ``identity``.

        Transient poll failures are logged and polled through (the load goes on server-side meanwhile);
        redirects, 400/401/403/405/410/415/422, unreadable responses and requests that cannot be sent are raised
        at once because waiting cannot fix them, and so is a 404 while waiting for the manager (``identity``
        None), which is how a wrong deployment or URL shows. ``until()``, read after each poll and before each of
        its retries, may end the wait sooner (a ``time.monotonic()`` value): another deployment's readiness can
        set it.
        """
        if identity is not None:
            validate_identity(identity)
        deadline = time.monotonic() + timeout_s
        last: HotLoadStatus | None = None
        last_error: str | None = None
        what = f"status poll for {identity!r}" if identity is not None else "status poll for a replica"
        while True:
            try:
                st = self.status(deadline=deadline, until=until)
            except HotLoadBodyError as exc:  # not JSON at all (a proxy's page): the reference client polls on
                last_error = str(exc)
                log.warning("%s failed: %s", what, last_error)
            except (HotLoadResponseError, HotLoadRequestError, HotLoadCancelled):
                raise
            except HotLoadError as exc:
                if fatal_while_polling(exc.status_code, signalled=identity is not None):
                    raise
                last_error = str(exc)
                released = exc.hint == RELEASED_HINT  # the wait ends now, and the caller says why
                log.log(logging.INFO if released else logging.WARNING, "%s failed: %s", what, last_error)
            else:
                last, last_error = st, None
                if on_poll is not None:
                    try:
                        on_poll(st)
                    except Exception:  # noqa: BLE001 - a progress report must not fail a snapshot that loads
                        log.warning("%s: the on_poll callback failed (the wait goes on)", what, exc_info=True)
                if identity is None and st.replicas:
                    return st
                # Readiness first, as the reference wait does: a replica that serves the snapshot may still report
                # an error for it (a repeated signal's second load), and every replica serving it is the answer.
                if identity is not None and st.is_ready(identity):
                    return st
                failed = st.failed_replicas(identity) if identity is not None else []
                if failed:
                    raise HotLoadError(
                        self.redact(f"snapshot {identity!r} failed to load on replica(s) "
                                     f"{', '.join(map(str, failed))}: {st.describe()}"),
                        hint="the deployment keeps serving its previous snapshot; read the ledger for the error, "
                        "fix the snapshot, and publish a new full snapshot (a failed load ends the delta chain)",
                    )
            remaining = (deadline if until is None else min(deadline, until())) - time.monotonic()
            if remaining <= 0:
                if last is None:
                    state = f"no status was received (last error: {last_error})"
                else:
                    state = last.describe() + (f" (last poll failed: {last_error})" if last_error else "")
                waited = (f"snapshot {identity!r} was not served by every replica" if identity is not None else
                          f"{self.deployment_name} reported no replica (its hot-load manager is not up)")
                raise HotLoadTimeout(
                    self.redact(f"{waited} within {timeout_s:g}s; last state: {state}"),
                    hint="loads of large snapshots take minutes: raise timeout_s (HotloadConfig: ready_timeout_s), "
                    "check the deployment's replicas are up, and publish a full snapshot if the chain is stuck",
                )
            if self._canceller.wait(min(self.poll_interval_s, remaining)):
                waited = f"waiting for {identity!r}" if identity is not None else "waiting for a replica"
                raise self._cancelled(f"{waited} on {self.deployment_name}")

    def reset_ledger(self) -> None:
        """Forget every hot-loaded snapshot on the deployment; the next signal must be a full snapshot."""
        path = f"/v1/accounts/{self.account_id}/deployments/{self.deployment_id}/ledger"
        self._request("DELETE", path, control_plane=True)
        log.info("hotload: reset the hot-load ledger of %s", self.deployment_name)
