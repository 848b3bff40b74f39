"""One pydantic config drives the whole plugin (the Megatron ``--hotload-*`` flags are generated from it).

Every field is validated when the config is built, so a typo fails at startup with the field's name rather than
hours later in a background thread. Fields can also come from ``HOTLOAD_<FIELD>`` environment variables (JSON for
lists and dicts, see :func:`.config_text.parse_setting`), which is how launchers usually pass settings to every
rank; an unknown ``HOTLOAD_*`` variable (a misspelt field) is an error too.

Example::

    cfg = HotloadConfig(bucket_url="s3://rl-bucket/acct/acct-dep", hotload_api_url="https://api.fireworks.ai",
                        account_id="acct", model_id="accounts/fireworks/models/qwen3-8b", deployment_id="dep",
                        full_every=20, hf_config_dir="/models/qwen3-8b")
    cfg = HotloadConfig.from_env()        # same, from HOTLOAD_BUCKET_URL, HOTLOAD_FULL_EVERY, ...
"""
from __future__ import annotations

import difflib
import os
import re
import urllib.parse
from typing import Any, Callable, Literal

from pydantic import (BaseModel, ConfigDict, Field, SecretStr, ValidationError, ValidationInfo, field_serializer,
                      field_validator, model_validator)

from .config_text import merged_options, parse_setting
from .masking import MASK, mask_secrets, mask_url, url_has_credentials

ENV_PREFIX = "HOTLOAD_"
#: Settings every rank must hold alike, checked when the publisher starts: they decide where snapshots go, what
#: their bytes are, which step is published and how ranks vote at close. The rest (threads, timeouts, priorities,
#: credentials) may differ per node.
RANK_SHARED_FIELDS = ("bucket_url", "codec", "snapshot_dtype", "dtype_overrides", "max_file_bytes", "full_every",
                      "max_chain_length", "publish_every", "identity_prefix", "busy_policy", "max_inflight",
                      "publish_on_close", "keep_training_on_error", "send_hints", "carry_base_tensors")
MAX_TIMEOUT_S = 30 * 24 * 3600.0  # a finite bound: gloo takes timeouts as integer milliseconds
# HOTLOAD_* variables the package reads that are not config fields (codec switches read by arc/zstd_seq.py and
# arc/codecs.py); from_env accepts these and rejects every other unknown HOTLOAD_* variable.
NON_CONFIG_ENV: frozenset[str] = frozenset({"HOTLOAD_ARC_ENCODER", "HOTLOAD_ARC_ONE_CALL", "HOTLOAD_LIBZSTD"})


def _is_protocol(name: str) -> bool:
    """Whether fsspec knows ``name`` as a protocol (``s3:bucket/x`` is a URL missing its slashes, as the storage
    root's check says; ``a:b`` is a name)."""
    import fsspec

    return name.lower() in fsspec.available_protocols()


class HotloadConfig(BaseModel):
    """Settings of one trainer's publishing to one bucket and zero or more deployments.

    Example::

        cfg = HotloadConfig(bucket_url="s3://rl-bucket/acct/acct-dep", hotload_api_url="https://api.fireworks.ai",
                            account_id="acct", model_id="accounts/fireworks/models/qwen3-8b", deployment_id="dep",
                            hf_config_dir="/models/qwen3-8b", full_every=20)
        cfg = HotloadConfig.from_env(full_every=10)      # HOTLOAD_* variables; keyword arguments win
    """

    # Errors never echo the input: a model-level error would print the whole dict, api_key and
    # storage_options secrets included. Validators name the bad value themselves where it helps.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, hide_input_in_errors=True)

    # --- where snapshots go
    bucket_url: str = Field(description="Snapshot root: local path, file://, s3:// (s3a://), gs:// (gcs://), or "
                                        "memory:// for single-process tests; other schemes and fsspec chains are "
                                        "refused (the deployment's hot-load bucket URL; snapshot N lives at "
                                        "<bucket_url>/<identity>/)")
    storage_options: dict[str, Any] = Field(default_factory=dict, description='fsspec options, e.g. '
                                            '{"endpoint_url": "http://minio:9000"} for MinIO')
    upload_concurrency: int = Field(8, ge=1, le=256, description="parallel uploads per rank")
    storage_attempts: int = Field(6, ge=1, le=100, description="tries per transient storage error (and per "
                                                              "refused part of a multipart upload) before the "
                                                              "publish fails (the next one is then full): the jittered "
                                                              "waits between 6 tries add up to 6.2 s at most, "
                                                              "between 10 tries to about 65 s")
    max_file_bytes: int = Field(5 * 10**9, ge=1, description="cap on a full-snapshot weight file (bytes)")
    keep_last: int | None = Field(None, ge=1, description="retention: keep the last K committed snapshots "
                                                          "(and every base they depend on), and those of another "
                                                          "publisher live under the same root; None keeps all")
    retention_grace_s: float = Field(3600.0, gt=0, description="retention: how long after its last commit "
                                                               "another run under the same root (a restart, a "
                                                               "paused run, a second trainer) keeps its snapshots, "
                                                               "since a deployment may still serve them; raise it "
                                                               "above the longest interval between any such run's "
                                                               "commits, and for runs paused longer")
    hf_config_dir: str | None = Field(None, description="folder with config.json and tokenizer files to copy "
                                                        "into every snapshot")
    carry_base_tensors: list[str] = Field(default_factory=list, description="globs of base-checkpoint tensors the "
                                          "trainer does not hold (DeepSeek-V3's MTP layer: model.layers.61.*), "
                                          "carried unchanged into every snapshot from the *.safetensors files in "
                                          "hf_config_dir (rank 0 reads them), so that full snapshots cover the base "
                                          "model")
    # --- who gets signalled
    hotload_api_url: str | None = Field(None, description="hot-load API base URL (e.g. https://api.fireworks.ai);"
                                                          " None publishes to storage without signalling")
    account_id: str | None = Field(None, description="Fireworks account (required when signalling)")
    model_id: str | None = Field(None, description="model the deployment(s) serve, the fireworks-model header: "
                                                   "'accounts/<a>/models/<m>' (a public base model is "
                                                   "'accounts/fireworks/models/<m>'); a bare name means a model "
                                                   "of account_id")
    deployment_id: str | list[str] | None = Field(None, description="one deployment or a list (several pools "
                                                                    "reading the same bucket); a snapshot is signalled "
                                                                    "to all at once (deployments_required says which "
                                                                    "must serve it)")
    deployments_required: Literal["all", "any"] = Field(
        "all", description="with several deployments, which must serve a snapshot for it to count as published: "
                           "'all' (one that fails fails the publish, and the next one is full for all), or 'any' "
                           "(the others go on; one that fails is left behind, named in the metrics' "
                           "deployments_behind, and catches up on a thread of its own, loading the snapshots it "
                           "missed in order, or at the next full snapshot)")
    straggler_wait_s: float | None = Field(
        None, ge=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
        description="with deployments_required='any': once one deployment serves a snapshot, how much longer the "
                    "publish waits for the others; those still loading then are left behind (deployments_behind) "
                    "to their catch-up, which waits for them up to ready_timeout_s from the signal and then brings "
                    "them to the newest snapshot, so a region whose replicas hang or load slowly holds a publish that "
                    "long, not for its whole load; nor does a publish wait for a catch-up's load in flight. None: "
                    "each is waited for up to ready_timeout_s")
    api_key: SecretStr | None = Field(None, description="defaults to $FIREWORKS_API_KEY; never logged")
    hotload_api_headers: dict[str, str] = Field(default_factory=dict, description="extra headers on every "
                                                "hot-load request, e.g. a private gateway's secret; they override "
                                                "the defaults, and their values are never logged")
    hotload_api_allow_http: bool = Field(False, description="allow a plain-http hotload_api_url to a host other "
                                         "than this one (a private gateway on a trusted network, such as "
                                         "http://10.0.0.5:8083); the API key then travels unencrypted")
    ready_timeout_s: float = Field(600.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
                                   description="how long to wait for every replica to serve a snapshot")
    poll_interval_s: float = Field(2.0, gt=0, le=3600, allow_inf_nan=False,
                                   description="status poll interval while waiting for readiness")
    collective_timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
                                               description="timeout of the publisher's side gloo groups, where "
                                               "ranks wait while the others upload and rank 0 signals and waits "
                                               "for readiness; None = the longest rank 0 may spend signalling "
                                               "a snapshot (about ready_timeout_s + 10 min; 2 x ready_timeout_s "
                                               "+ 6 min with deployments_required='any') + 3600")
    send_hints: bool = Field(True, description="send a per-file hint as each file becomes durable")
    reset_prompt_cache: Literal["all", "new_session", "none"] | None = Field(
        None, description="prompt-cache reset the fleet applies with each new snapshot (sent with every signal)")
    extra_fields_ignore: list[str] | None = Field(
        None, description="top-level config.json keys each signal asks the server to leave out of its comparison "
                          "with the base model's config (validation.extra_fields_ignore), besides those the snapshots "
                          "drop from hf_config_dir's; None also names quantization_config and compression_config "
                          "where no published tensor is quantized and the snapshots' config lacks them (a quantized "
                          "base served from a bf16 copy's config); [] names only the dropped ones")
    # --- what and when
    full_every: int = Field(20, ge=1, description="a full snapshot every N publishes (first one is always full)")
    max_chain_length: int | None = Field(None, ge=1, description="force a full snapshot after this many deltas")
    publish_every: int = Field(1, ge=1, description="publish every K trainer steps")
    codec: str = Field("arc_v2", description="delta codec: arc_v2 (Fireworks wire format) or arc_sparse_v1 "
                                             "(higher ratio, for receivers running our decoder)")
    snapshot_dtype: str = Field("bfloat16", description="dtype of floating tensors in snapshots (a floating "
                                                        "dtype; integer and bool tensors keep their own)")
    dtype_overrides: dict[str, str] = Field(
        default_factory=dict, description="per-tensor dtypes: {glob on the published name: floating dtype or "
        "'keep' (the trainer's own dtype)}; the first matching glob wins, e.g. "
        '{"*.e_score_correction_bias": "keep"} keeps an fp32 router bias in fp32')
    identity_prefix: str = Field("step", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,40}$",
                                 description="first part of every snapshot identity (<prefix>-<step>-<session>)")
    # --- how
    max_inflight: int = Field(1, ge=1, le=8, description="snapshots staged or publishing at once (each costs "
                                                         "one bf16 copy of the local shard)")
    busy_policy: Literal["skip", "wait"] = Field("skip", description="when all in-flight slots are taken: "
                                                                     "skip this step (publish the newest state "
                                                                     "later) or block until a slot frees")
    background_nice: int = Field(10, ge=0, le=19, description="Linux nice value of the publisher's threads: "
                                 "the trainer wins contended CPU cores, publishing uses what is left (0 = same "
                                 "priority as training)")
    async_copy: bool = Field(True, description="CPU trainers with attach(optimizer): copy the shard on a helper "
                             "thread and let the next optimizer.step() wait for it, instead of copying on the "
                             "trainer's thread (CUDA always copies on a side stream)")
    encode_workers: int | None = Field(None, ge=1, le=64, description="threads that encode one rank's chunks at "
                                       "once (None: 1 on a CPU trainer, whose cores train; on a GPU rank half its "
                                       "share of the cores, at most 4)")
    cache_on: Literal["device", "host"] = Field("device", description="where the previous snapshot's bytes live")
    publish_on_close: bool = Field(True, description="close() publishes the newest step when it was skipped (while "
                                   "busy, or between publish_every steps), so the fleet ends on the final weights; "
                                   "not when closing on an error")
    close_timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description="how "
                                          "long close() waits for the snapshots in flight before it abandons them "
                                          "and raises, for the ranks' vote on the newest step (past it none "
                                          "publishes that step), and for deployments catching up (past it their "
                                          "catch-up is cancelled); None = as long as they take (S3/GCS calls and "
                                          "readiness have deadlines of their own, a hung local write has none)")
    keep_training_on_error: bool = Field(False, description="log background errors instead of raising them on "
                                                            "the next step")
    metrics_path: str | None = Field(None, description="append one JSON line per publish here (rank 0)")
    progress_log_s: float | None = Field(30.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description="while a "
                                         "publish runs longer than this, rank 0 logs its stage, files and bytes "
                                         "written and replicas ready once per this many seconds (other ranks, "
                                         "their own copy, encode and uploads at 4x); None = never")

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, v: str) -> str:
        from .arc import codec_names

        if v not in codec_names():
            raise ValueError(f"unknown codec {v!r}; known: {', '.join(codec_names())}")
        return v

    @field_validator("identity_prefix")
    @classmethod
    def _prefix_makes_identities(cls, v: str) -> str:
        from .identity import new_identity

        new_identity(0, prefix=v, session="0" * 8)  # e.g. 'aux.run1' makes names Windows cannot store
        return v

    @field_validator("snapshot_dtype")
    @classmethod
    def _floating_dtype(cls, v: str) -> str:
        """Floating dtypes of 16 bits or more only: casting weights to an integer dtype would truncate them
        without any error, and every floating tensor (norms and embeddings too) cast to 8 bits, with no scales
        and no quantization_config describing them, is not a model a server can load as meant."""
        from .arc.dtypes import torch_name
        from .dtype_policy import float_code

        return torch_name(float_code(v, "snapshot_dtype", eight_bit=False))

    @field_validator("api_key")
    @classmethod
    def _key_not_blank(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value().strip():  # e.g. HOTLOAD_API_KEY="" from an unset variable
            raise ValueError("api_key is empty (set it, or leave it unset to use $FIREWORKS_API_KEY)")
        from .fireworks_names import clean_api_key

        if v is not None:  # a key that cannot be sent (a space, non-ASCII) fails here, naming its source
            clean_api_key(v.get_secret_value(), "api_key")
        return v

    @field_validator("hotload_api_headers")
    @classmethod
    def _headers_sendable(cls, v: dict[str, str]) -> dict[str, str]:
        from .fireworks_names import clean_headers

        return clean_headers(v, "hotload_api_headers")

    @field_validator("dtype_overrides")
    @classmethod
    def _override_dtypes(cls, v: dict[str, str]) -> dict[str, str]:
        from .dtype_policy import override_dtype

        if any(not pattern.strip() for pattern in v):
            raise ValueError("dtype_overrides has an empty glob")
        return {pattern: override_dtype(pattern, dtype) for pattern, dtype in v.items()}

    @field_validator("carry_base_tensors")
    @classmethod
    def _carry_globs(cls, v: list[str]) -> list[str]:
        if any(not pattern.strip() for pattern in v):
            raise ValueError("carry_base_tensors has an empty glob")
        return v

    @field_validator("extra_fields_ignore")
    @classmethod
    def _config_keys(cls, v: list[str] | None) -> list[str] | None:
        bad = [key for key in v or [] if not key or key != key.strip() or "." in key]
        if bad:
            raise ValueError(f"extra_fields_ignore names {bad[0]!r}: give top-level config.json keys (the server "
                             "ignores top-level keys only), without white space")
        return v

    @field_validator("bucket_url")
    @classmethod
    def _bucket(cls, v: str) -> str:
        root = (os.path.expanduser(v) if v.startswith("~") else v).rstrip("/")
        if not root.strip() or root.endswith(":"):
            raise ValueError(f"bucket_url {mask_url(v)!r} names no folder or bucket")
        if v != v.strip():  # a line read from an env file: s3 would take the newline into every key
            raise ValueError(f"bucket_url {mask_url(v)!r} starts or ends with white space")
        from .storage_paths import normalise_root

        try:  # what the storage layer would refuse when it opens, refused before any training step
            normalise_root(root)
        except ValueError as exc:
            raise ValueError(re.sub(r"^storage root\b", "bucket_url", str(exc))) from None
        return root

    @field_validator("hotload_api_url")
    @classmethod
    def _url_given(cls, v: str | None) -> str | None:
        """An unset shell variable gives '', which used to turn signalling off in silence. Credentials before the
        host are refused here, without showing them: the client never sends them, and until it refused them the
        config's repr and its plain-http error printed them."""
        if v is not None and not v.strip():
            raise ValueError("hotload_api_url is empty; leave it unset to publish without signalling")
        if v is not None and url_has_credentials(v.strip()):
            raise ValueError("hotload_api_url must not carry credentials before its host ('user:password@'); pass "
                             "a gateway's credentials as headers (hotload_api_headers)")
        return v

    @field_validator("hf_config_dir", "metrics_path")
    @classmethod
    def _home(cls, v: str | None, info: ValidationInfo) -> str | None:
        """``~`` is expanded as a shell would (a YAML file or a quoted variable leaves it as it is). An empty path
        (an unset shell variable) is refused: it turned the metrics file off in silence."""
        if v is not None and not v.strip():
            raise ValueError(f"{info.field_name} is empty; leave it unset for None")
        if v is not None and v != v.strip():  # a ConfigMap value's newline would end up in the file's name
            raise ValueError(f"{info.field_name} {v!r} starts or ends with white space")
        scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]+):", v or "")  # two letters or more: not a drive (C:)
        if v is not None and scheme and ("://" in v[:scheme.end() + 2] or _is_protocol(scheme[1])):
            # it was "does not exist" at start, or (s3:bucket/x) a folder of that name in the working directory
            local = urllib.parse.urlsplit(v).path if scheme[1].lower() in ("file", "local") else None
            what = (f"give the local path {local!r}" if local else
                    "download the base model's config and tokenizer files to a local folder" if
                    info.field_name == "hf_config_dir" else "copy the file to the bucket after the run")
            raise ValueError(f"{info.field_name} {mask_url(v)!r} is a URL, and rank 0 opens it as a local path: "
                             f"{what}")
        return os.path.expanduser(v) if v else v

    def __repr_args__(self) -> Any:
        """``storage_options`` may hold credentials (s3fs ``secret``, ``token``, nested ``client_kwargs``, an
        endpoint or proxy URL with a password), ``hotload_api_headers`` a gateway's secret and ``bucket_url`` a
        ``user:password@`` part (sftp): they are masked like ``api_key`` wherever the config is printed or
        logged."""
        for name, value in super().__repr_args__():
            if name == "hotload_api_headers":
                value = {k: MASK for k in value}
            elif name == "storage_options":
                value = mask_secrets(value)
            elif name in ("bucket_url", "hotload_api_url") and isinstance(value, str):
                value = mask_url(value)
            yield name, value

    def shared_settings(self) -> dict[str, Any]:
        """The :data:`RANK_SHARED_FIELDS` in their JSON form (credentials masked), for the ranks to compare."""
        return self.model_dump(mode="json", include=set(RANK_SHARED_FIELDS))

    @field_serializer("storage_options", "hotload_api_headers", "bucket_url", "hotload_api_url", when_used="json")
    def _masked_in_json(self, value: Any, info: Any) -> Any:
        """The same masks in the JSON form (``model_dump_json``, ``model_dump(mode="json")``: what experiment
        trackers and config logs store), as ``api_key`` already is. A config rebuilt from that JSON therefore
        lacks those secrets, like the key: give them again (environment, storage options) where it is used."""
        if info.field_name == "hotload_api_headers":
            return {k: MASK for k in value}
        if info.field_name == "storage_options":
            return mask_secrets(value)
        return mask_url(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _carry_needs_base(self) -> "HotloadConfig":
        if self.carry_base_tensors and not self.hf_config_dir:
            raise ValueError("carry_base_tensors is set, so hf_config_dir must be set too: the carried tensors are "
                             "read from the base checkpoint's *.safetensors files there")
        return self

    @model_validator(mode="after")
    def _signalling_complete(self) -> "HotloadConfig":
        if self.hotload_api_url:
            missing = [f for f in ("account_id", "model_id", "deployment_id") if not getattr(self, f)]
            if missing:
                raise ValueError(f"hotload_api_url is set, so {', '.join(missing)} must be set too")
            if not self.hf_config_dir:
                raise ValueError("hotload_api_url is set, so hf_config_dir must be set too: the deployment "
                                 "rejects snapshots without config.json and tokenizer files")
            from .fireworks_names import deployment_name, model_name

            model_name(self.account_id or "", self.model_id or "")  # checked here: the error then names its source
            names = [deployment_name(self.account_id or "", d)[0] for d in self.deployments]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:  # every snapshot would be signalled to it twice at once
                raise ValueError(f"deployment_id names {', '.join(twice)} more than once")
            from .fireworks import is_loopback

            url = urllib.parse.urlsplit(self.hotload_api_url)
            if url.scheme == "http" and not self.hotload_api_allow_http and not is_loopback(url.hostname or ""):
                raise ValueError(f"hotload_api_url {mask_url(self.hotload_api_url)!r} is plain http to another host, "
                                 "which would send the API key unencrypted: use https, or set "
                                 "hotload_api_allow_http for a gateway on a trusted private network")
            from .fireworks_http import check_url

            # The client's own checks (scheme, host, port, no query), here so that the error names this field
            # (or its variable or flag) at construction, not the client's base_url when the callback is built.
            check_url(self.hotload_api_url, self.hotload_api_allow_http, "hotload_api_url")
            if self.straggler_wait_s is not None and self.deployments_required != "any":
                raise ValueError("straggler_wait_s is set, so deployments_required must be 'any': with 'all' every "
                                 "deployment must serve each snapshot, and the publish waits for each")
        else:  # a forgotten URL would publish to storage only, every record ok, and the fleet would never move
            given = [f for f in ("account_id", "model_id", "deployment_id", "hotload_api_headers", "reset_prompt_cache")
                     if getattr(self, f)] + (["deployments_required"] if self.deployments_required != "all" else [])
            given += ["straggler_wait_s"] if self.straggler_wait_s is not None else []
            if given:
                raise ValueError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} set but hotload_api_url is "
                                 "not, so no snapshot would be signalled: set hotload_api_url too, or leave them unset "
                                 "to publish to storage only")
        return self

    @property
    def side_group_timeout_s(self) -> float:
        """The side groups' timeout: long enough for the slowest rank's upload plus all that signalling may take.
        Why not ``ready_timeout_s`` + an hour: with ``deployments_required="any"`` a snapshot may wait for a
        catch-up's load before its own readiness wait, and from ``ready_timeout_s`` of about 54 min on that
        default broke the side groups (and stopped publishing) under a user who had set no timeout."""
        from .engine.signal_limits import longest_signal_s

        return self.collective_timeout_s or longest_signal_s(self) + 3600.0

    @property
    def deployments(self) -> list[str]:
        if self.deployment_id is None:
            return []
        return [self.deployment_id] if isinstance(self.deployment_id, str) else list(self.deployment_id)

    def checked(self) -> "HotloadConfig":
        """A copy validated again as a whole; what a publisher keeps. Why: pydantic keeps an assignment that a
        model validator refused (``cfg.hf_config_dir = None`` under signalling raises, and stays set),
        ``model_copy(update=...)`` validates nothing, and a publisher must not change under the trainer when its
        caller edits the object later."""
        return type(self).model_validate(dict(self))

    def resolved_api_key(self) -> str | None:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ.get("FIREWORKS_API_KEY")

    @classmethod
    def from_env(cls, prefix: str = ENV_PREFIX, **overrides: Any) -> "HotloadConfig":
        """Build from ``<prefix><FIELD>`` variables (upper case); explicit ``overrides`` win, except that the
        entries of a ``storage_options`` override are merged over the variable's (:func:`merged_options`).

        Every other ``<prefix>*`` variable (for a non-empty prefix), except :data:`NON_CONFIG_ENV`, raises
        ValueError: a misspelt setting would otherwise be ignored in silence. Errors name the variables, not only
        the fields.
        """
        return cls.from_env_under(overrides, prefix=prefix)

    @classmethod
    def check_env_names(cls, prefix: str = ENV_PREFIX) -> None:
        """ValueError naming every ``<prefix>*`` variable that is neither a field's nor in :data:`NON_CONFIG_ENV`
        (a misspelt setting), with the closest name; a caller that decides not to build a config (publishing
        off) still runs it, since the misspelt variable may be the one that would have turned publishing on."""
        variables = [prefix + name.upper() for name in cls.model_fields]
        unknown = sorted(k for k in os.environ if prefix and k.startswith(prefix) and k not in variables
                         and k not in NON_CONFIG_ENV)
        if unknown:
            raise ValueError(_unknown_env_message(unknown, [*variables, *sorted(NON_CONFIG_ENV)], prefix))

    @classmethod
    def from_env_under(cls, overrides: dict[str, Any], *, prefix: str = ENV_PREFIX,
                       name_of: Callable[[str], str] = str, source: str = "") -> "HotloadConfig":
        """:meth:`from_env` where ``overrides`` come from elsewhere (``source``, e.g. command-line flags) and
        errors call a field that is not a variable ``name_of(field)``; ValueError for every problem."""
        cls.check_env_names(prefix)
        variables = {prefix + name.upper(): name for name in cls.model_fields}
        values: dict[str, Any] = {}
        options = prefix + "STORAGE_OPTIONS"
        if isinstance(overrides.get("storage_options"), dict) and options in os.environ:
            try:  # credentials (a variable) and an endpoint (in code, a flag): the entries merged, none dropped
                under = parse_setting(os.environ[options], cls.model_fields["storage_options"].annotation)
            except ValueError as exc:
                raise ValueError(f"invalid hotload setting {options}: {exc}") from None
            if not isinstance(under, dict):  # alone it fails validation; merged, it would vanish with its secrets
                raise ValueError(f"invalid hotload setting {options}: not a JSON object of fsspec options")
            overrides = {**overrides, "storage_options": merged_options(under, overrides["storage_options"])}
        for var, name in variables.items():
            raw = os.environ.get(var)
            if raw is None or name in overrides:
                continue
            try:
                values[name] = parse_setting(raw, cls.model_fields[name].annotation)
            except ValueError as exc:
                raise ValueError(f"invalid hotload setting {var}: {exc}") from None
        env_fields = set(values)
        values.update(overrides)

        def label(field: str) -> str:  # a missing field, from the environment alone, is its variable's to set
            if field in env_fields or (field not in values and not source and prefix):
                return prefix + field.upper()
            return name_of(field)

        try:
            return cls(**values)
        except ValidationError as exc:
            names = error_names(exc, label)
            raise ValueError(f"invalid hotload settings from {source or prefix + '* environment variables'}"
                             f"{f' ({names})' if names else ''}: {error_text(exc, label)}") from None


def error_names(exc: ValidationError, name: Callable[[str], str]) -> str:
    """The fields a validation error is about, each once (a union fails once per member), spelt ``name(field)``.
    A check of several fields together has no location, so the fields its message names are taken."""
    fields: list[str] = []
    for e in exc.errors():
        if e.get("loc"):
            fields.append(str(e["loc"][0]))
        else:
            fields += [f for f in HotloadConfig.model_fields if re.search(rf"\b{f}\b", str(e.get("msg", "")))]
    return ", ".join(dict.fromkeys(name(f) for f in fields))


#: Fields whose values an error never shows (credentials, or containers of them).
_UNSHOWN = frozenset({"api_key", "hotload_api_headers", "storage_options"})


def error_text(exc: ValidationError, name: Callable[[str], str]) -> str:
    """A validation error on one line, each field spelt ``name(field)`` once with the value given (a union's
    members merged): pydantic's own text takes a few lines per field, names the Python field and adds a URL.
    A field's own check that opens with the field's name loses it (the label says it already:
    ``--hotload-snapshot-dtype: 'int8' is not ...``, not ``--hotload-snapshot-dtype: snapshot_dtype 'int8' ...``);
    other fields it names are spelt as this path sets them."""
    parts: dict[str, tuple[str, list[str]]] = {}  # label: (the value shown, the messages)
    for e in exc.errors(include_url=False):
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        key = ""
        if not e.get("loc"):  # a check of several fields: their names as this path spells them
            msg = spell_fields(msg, name)
        else:
            field = str(e["loc"][0])
            key = name(field)
            msg = spell_fields(re.sub(rf"^{field}(?![\w-])\s*", "", msg), name, but=field)
            value = e.get("input")
            if key not in parts:
                parts[key] = ("" if field in _UNSHOWN or isinstance(value, dict) else f" (got {_short(value)})", [])
        msgs = parts.setdefault(key, ("", []))[1]
        if msg not in msgs:
            msgs.append(msg)
    return "; ".join("; ".join(msgs) if not key else f"{key}: {' or '.join(msgs)}{shown}"
                     for key, (shown, msgs) in parts.items())


def spell_fields(text: str, name: Callable[[str], str], *, but: str = "") -> str:
    """``text`` with each field name (but ``but``) spelt ``name(field)``: as a flag or variable sets it. Not inside
    another word, a dotted API key (``validation.extra_fields_ignore``) or a placeholder (``<bucket_url>``)."""
    for f in HotloadConfig.model_fields:
        if f != but:
            text = re.sub(rf"(?<![\w.<-]){f}(?![\w-])", name(f), text)
    return text


def _short(value: Any) -> str:
    text = repr(mask_url(value) if isinstance(value, str) else value)
    return text if len(text) <= 80 else text[:77] + "..."


def _unknown_env_message(unknown: list[str], known: list[str], prefix: str) -> str:
    suffixes = {k[len(prefix):]: k for k in known if k.startswith(prefix)}
    parts = []
    for var in unknown:
        close = difflib.get_close_matches(var[len(prefix):], suffixes, n=1)
        parts.append(f"{var} (did you mean {suffixes[close[0]]}?)" if close else var)
    return (f"unknown environment variable{'s' if len(parts) > 1 else ''} {', '.join(parts)}: {prefix}* "
            f"variables must name a HotloadConfig field ({prefix}<FIELD>) or be one of "
            f"{', '.join(sorted(NON_CONFIG_ENV))}")
