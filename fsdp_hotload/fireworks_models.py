"""Wire models of the Fireworks hot-load API, identity rules and the client's error types.

Shared by the client (``fireworks.py``) and the local emulator, so both sides validate the same schema: requests
are ``extra="forbid"`` like the server's body schema (a typo fails before it reaches the network, and the
emulator rejects unknown fields with the same pydantic-style text as the real service); responses allow unknown
fields because the server adds fields over time.

Example::

    body = HotLoadRequest(identity="step-2", incremental_snapshot_metadata=IncrementalSnapshotMetadata(
        previous_snapshot_identity="step-1")).to_body()
    status = HotLoadStatus.model_validate(response_json)
    status.is_ready("step-2")
"""
from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError,
                      ValidatorFunctionWrapHandler, WrapValidator, field_validator)

from .fireworks_http import MAX_MESSAGE_CHARS
from .identity import MAX_IDENTITY_LEN as IDENTITY_MAX_LEN
from .identity import validate_identity as _validate_identity

__all__ = [
    "HINT_PATH",
    "HOT_LOAD_PATH",
    "IDENTITY_MAX_LEN",
    "HintRequest",
    "HintSnapshot",
    "HotLoadBodyError",
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
    "holds_it",
    "manager_may_be_down",
    "never_taken",
    "validate_filename",
    "validate_identity",
]

HOT_LOAD_PATH = "/hot_load/v1/models/hot_load"
HINT_PATH = "/hot_load/v1/models/hot_load/hint"


# ---------------------------------------------------------------------------------------------------- errors


class HotLoadError(RuntimeError):
    """A hot-load request failed, or a snapshot failed to load.

    ``status_code`` is the HTTP status (None for network failures and load failures), ``server_message`` the
    message extracted from the response body, ``response_text`` the whole body as text with the client's secrets
    removed (what the older-server fallback matches: the extracted message can leave the field name out),
    ``hint`` a sentence saying what to do, ``attempts`` how many times the request may have reached the server
    (tries whose connection failed are not counted: an answer to a retry may be about an earlier attempt the
    server took only if one was sent).
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        server_message: str | None = None,
        hint: str | None = None,
        response_text: str | None = None,
        attempts: int = 1,
    ) -> None:
        self.status_code = status_code
        self.server_message = server_message
        self.response_text = response_text
        self.hint = hint
        self.attempts = attempts
        super().__init__(f"{message}; what to do: {hint}" if hint else message)


class HotLoadTimeout(HotLoadError):
    """The snapshot was not served by every replica within the wait budget."""


class HotLoadCancelled(HotLoadError):
    """The client was cancelled (:meth:`HotLoadClient.cancel`): its owner is closing, so the request or wait was
    ended early. The server may still act on what it already received (a signal may still load)."""


class HotLoadRequestError(HotLoadError):
    """The request cannot be sent as built (a URL or header ``http.client`` refuses) or its server's TLS
    certificate does not verify: trying again cannot change that, so it is neither retried nor polled through."""


class HotLoadResponseError(HotLoadError):
    """The server answered 2xx with a body this client cannot read (wrong endpoint or incompatible server)."""


class HotLoadBodyError(HotLoadResponseError):
    """A 2xx body that is not JSON at all: a proxy's page, say. While polling it is waited through, as the
    reference client does; only a JSON status without a ``replicas`` list ends the wait."""


def never_taken(exc: BaseException) -> bool:
    """Whether a failed request cannot have been taken by the server: one that reached no server (``attempts`` 0:
    no connection, or one that could not be sent as built), or a 4xx answer to the only attempt that reached it.
    Not a 408 or 409 (a timeout, a conflict), nor a cancelled one: the server may have the request. Why: a
    snapshot whose signal no deployment took is loaded by no replica, so it may be deleted at once (signal.py)."""
    if not isinstance(exc, HotLoadError) or isinstance(exc, HotLoadCancelled):
        return False
    if exc.status_code is None:
        return exc.attempts == 0
    return 400 <= exc.status_code < 500 and exc.status_code not in (408, 409) and exc.attempts == 1


def manager_may_be_down(exc: BaseException) -> bool:
    """Whether a failed signal or hint may mean the hot-load manager is down (no answer, or a 5xx: its container
    restarts). Why: the next signal there must first ask for a replica, as one sent before the manager is up can
    crash the container (signal.py)."""
    return isinstance(exc, HotLoadError) and not isinstance(exc, HotLoadCancelled) and (
        exc.status_code is None or exc.status_code >= 500)


def holds_it(exc: BaseException) -> bool:
    """Whether a failed signal was answered 409 (a conflict: the deployment holds that identity already), so that
    sending it again is refused too; any other failure (refused, a 5xx, no connection, a timeout) may be sent again."""
    return getattr(exc, "status_code", None) == 409


# ---------------------------------------------------------------------------------------------------- identity


def validate_identity(identity: str, *, field: str = "identity") -> str:
    """Check a snapshot identity (one safe path segment; the rule lives in :mod:`fsdp_hotload.layout`)."""
    return _validate_identity(identity, what=field)


def validate_filename(filename: str, *, field: str = "filename") -> str:
    """A file path relative to a snapshot directory: no absolute paths, no '..', no empty segments."""
    if not isinstance(filename, str) or not filename:
        raise ValueError(f"{field} must be a non-empty string, got {filename!r}")
    parts = filename.split("/")
    if filename.startswith("/") or "\\" in filename or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{field} {filename!r} must be a relative path inside the snapshot directory")
    return filename


# ---------------------------------------------------------------------------------------------------- models


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def to_body(self) -> dict[str, Any]:
        """The JSON body: unset optional fields are left out, because the server rejects unknown ones and older
        servers do not know every optional field."""
        return self.model_dump(mode="json", exclude_none=True)


class IncrementalSnapshotMetadata(_Request):
    """Marks a signal as a delta (arc_v2) on top of ``previous_snapshot_identity``."""

    previous_snapshot_identity: str
    compression_format: str = "arc_v2"
    checksum_format: str = "alder32"  # sic: the wire token is misspelt

    @field_validator("previous_snapshot_identity")
    @classmethod
    def _check_previous(cls, v: str) -> str:
        return validate_identity(v, field="previous_snapshot_identity")


class ValidationOptions(_Request):
    """Top-level ``config.json`` keys to ignore when the server compares the snapshot config with the base."""

    extra_fields_ignore: list[str] = Field(default_factory=list)


ResetPromptCache = Union[Literal["all", "new_session", "none"], StrictBool]


class HotLoadRequest(_Request):
    """Body of POST /hot_load/v1/models/hot_load.

    Example::

        HotLoadRequest(identity="step-2",
                       incremental_snapshot_metadata=IncrementalSnapshotMetadata(previous_snapshot_identity="step-1"))
    """

    identity: str
    incremental_snapshot_metadata: Optional[IncrementalSnapshotMetadata] = None
    reset_prompt_cache: Optional[ResetPromptCache] = None
    validation: Optional[ValidationOptions] = None

    @field_validator("identity")
    @classmethod
    def _check_identity(cls, v: str) -> str:
        return validate_identity(v)


class HintSnapshot(_Request):
    identity: str
    incremental_snapshot_metadata: Optional[IncrementalSnapshotMetadata] = None

    @field_validator("identity")
    @classmethod
    def _check_identity(cls, v: str) -> str:
        return validate_identity(v)


class HintRequest(_Request):
    """Body of POST /hot_load/v1/models/hot_load/hint: one file of a snapshot is durable in the bucket."""

    snapshot: HintSnapshot
    filename: str

    @field_validator("filename")
    @classmethod
    def _check_filename(cls, v: str) -> str:
        return validate_filename(v)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


def _null_is(default: Callable[[], Any]) -> BeforeValidator:
    """A JSON ``null`` reads as the field's default: servers send null for "not set", and a status poll must not
    fail over a field the readiness test does not need."""
    return BeforeValidator(lambda v: default() if v is None else v)


def _unreadable_is(default: Callable[[], Any]) -> WrapValidator:
    """A value of another type than the documented one (or null) reads as ``default``. For the fields the
    readiness test (``readiness``, ``current_snapshot_identity``) does not read: a server that adds or retypes
    one of them (``"supports_rdma_weight_sync": "unknown"``) must not end the wait for a snapshot it serves.
    At worst an unreadable ``stage`` hides a load error, and the wait ends at its timeout instead."""
    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if value is None:
            return default()
        try:
            return handler(value)
        except ValidationError:
            return default()
    return WrapValidator(validate)


def _adapters(value: Any) -> list[Any]:
    """``loaded_adapters``: anything but a list reads as none, and entries that are not objects are skipped."""
    return [a for a in value if isinstance(a, dict)] if isinstance(value, list) else []


class LoadingState(_Response):
    stage: Annotated[str, _unreadable_is(lambda: "unknown")] = "unknown"
    target_snapshot_identity: Annotated[Optional[str], _unreadable_is(lambda: None)] = None

    @property
    def error_text(self) -> str | None:
        """Error text if the server adds one (the emulator does; the documented API has no such field)."""
        extra = self.model_extra or {}
        value = extra.get("error")
        return str(value)[:MAX_MESSAGE_CHARS] if value not in (None, "") else None  # logged at each poll


class LoadedAdapter(_Response):
    identity: Annotated[Optional[str], _unreadable_is(lambda: None)] = None
    status: Annotated[Optional[str], _unreadable_is(lambda: None)] = None


class ReplicaStatus(_Response):
    """One replica's status. Only ``readiness`` and ``current_snapshot_identity`` must have their documented
    types (the readiness test reads them; ``readiness`` as pydantic reads a bool, so null is false and "true",
    1 or "yes" true); every other field reads as its default when it has another."""

    current_snapshot_identity: Optional[str] = None
    readiness: Annotated[bool, _null_is(lambda: False)] = False
    loading_state: Annotated[Optional[LoadingState], _unreadable_is(lambda: None)] = None
    loaded_adapters: Annotated[list[LoadedAdapter], BeforeValidator(_adapters)] = Field(default_factory=list)
    supports_rdma_weight_sync: Annotated[Optional[bool], _unreadable_is(lambda: None)] = None
    rdma_weight_sync_enabled: Annotated[Optional[bool], _unreadable_is(lambda: None)] = None

    @property
    def stage(self) -> str:
        return self.loading_state.stage if self.loading_state is not None else "unknown"

    @property
    def target(self) -> str | None:
        return self.loading_state.target_snapshot_identity if self.loading_state is not None else None

    def serves(self, identity: str) -> bool:
        return bool(self.readiness) and self.current_snapshot_identity == identity

    def failed(self, identity: str) -> bool:
        """True for an error of *this* load; an error whose target is another identity is stale."""
        return self.stage == "error" and self.target == identity

    def describe(self) -> str:
        text = (
            f"current={self.current_snapshot_identity!r} readiness={self.readiness} "
            f"stage={self.stage!r} target={self.target!r}"
        )
        err = self.loading_state.error_text if self.loading_state is not None else None
        return f"{text} error={err!r}" if err else text


class HotLoadStatus(_Response):
    """Body of GET /hot_load/v1/models/hot_load.

    Example::

        st = HotLoadStatus.model_validate({"replicas": [{"current_snapshot_identity": "s1", "readiness": True}]})
        assert st.is_ready("s1") and not st.failed_replicas("s1")
    """

    replicas: list[ReplicaStatus]
    replica_distribution: Any = None

    def is_ready(self, identity: str) -> bool:
        """Strict (on-policy) readiness: at least one replica, and every replica serves ``identity``."""
        return bool(self.replicas) and all(r.serves(identity) for r in self.replicas)

    def failed_replicas(self, identity: str) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.failed(identity)]

    def failed_everywhere(self, identity: str) -> bool:
        """Whether every replica (one at least) reports an error of its load of ``identity`` and none holds it.
        Why: such a snapshot is loaded by no replica of this deployment, nor can one still be loading it (a
        reused identity is refused), so retention may delete it (signal.py)."""
        return bool(self.replicas) and all(r.failed(identity) and r.current_snapshot_identity != identity
                                           for r in self.replicas)

    def describe(self) -> str:
        if not self.replicas:
            return "no replicas reported (the hot-load manager may not be initialised yet)"
        return "; ".join(f"replica {i}: {r.describe()}" for i, r in enumerate(self.replicas))
