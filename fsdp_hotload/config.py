"""One pydantic config drives the whole plugin (the Megatron ``--hotload-*`` flags are generated from it).

Every field is validated when the config is built, so a typo fails at startup with the field's name rather than
hours later in a background thread. Fields can also come from ``HOTLOAD_<FIELD>`` environment variables
(JSON for lists and dicts), which is how launchers usually pass settings to every rank.

Example::

    cfg = HotloadConfig(bucket_url="s3://rl-bucket/acct/acct-dep", hotload_api_url="https://api.fireworks.ai",
                        account_id="acct", model_id="qwen3-8b", deployment_id="dep", full_every=20,
                        hf_config_dir="/models/qwen3-8b")
    cfg = HotloadConfig.from_env()        # same, from HOTLOAD_BUCKET_URL, HOTLOAD_FULL_EVERY, ...
"""
from __future__ import annotations

import json
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

ENV_PREFIX = "HOTLOAD_"


class HotloadConfig(BaseModel):
    """Settings of one trainer's publishing to one bucket and zero or more deployments."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    # --- where snapshots go
    bucket_url: str = Field(description="Snapshot root: local path, file://, memory://, s3://, gs:// "
                                        "(the deployment's hot-load bucket URL; snapshot N lives at <bucket_url>/<identity>/)")
    storage_options: dict[str, Any] = Field(default_factory=dict,
                                            description="fsspec options, e.g. {'endpoint_url': ...} for MinIO")
    upload_concurrency: int = Field(8, ge=1, le=256, description="parallel uploads per rank")
    max_file_bytes: int = Field(5 * 10**9, ge=1, description="cap on a full-snapshot weight file (bytes)")
    keep_last: int | None = Field(None, ge=1, description="retention: keep the last K committed snapshots "
                                                          "(and every base they depend on); None keeps all")
    hf_config_dir: str | None = Field(None, description="folder with config.json and tokenizer files to copy "
                                                        "into every snapshot")
    # --- who gets signalled
    hotload_api_url: str | None = Field(None, description="hot-load API base URL (e.g. https://api.fireworks.ai);"
                                                          " None publishes to storage without signalling")
    account_id: str | None = None
    model_id: str | None = Field(None, description="model served by the deployment(s): 'name' or "
                                                   "'accounts/<a>/models/<m>'")
    deployment_id: str | list[str] | None = Field(None, description="one deployment or a list (several pools "
                                                                    "reading the same bucket)")
    api_key: SecretStr | None = Field(None, description="defaults to $FIREWORKS_API_KEY; never logged")
    ready_timeout_s: float = Field(600.0, gt=0, description="how long to wait for every replica to serve a snapshot")
    poll_interval_s: float = Field(2.0, gt=0, description="status poll interval while waiting for readiness")
    send_hints: bool = Field(True, description="send a per-file hint as each file becomes durable")
    reset_prompt_cache: Literal["all", "new_session", "none"] | None = None
    # --- what and when
    full_every: int = Field(20, ge=1, description="a full snapshot every N publishes (first one is always full)")
    max_chain_length: int | None = Field(None, ge=1, description="force a full snapshot after this many deltas")
    publish_every: int = Field(1, ge=1, description="publish every K trainer steps")
    codec: str = Field("arc_v2", description="delta codec: arc_v2 (Fireworks wire format) or arc_sparse_v1 "
                                             "(higher ratio, for receivers running our decoder)")
    snapshot_dtype: str = Field("bfloat16", description="dtype of floating tensors in snapshots")
    identity_prefix: str = Field("step", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,40}$")
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
    cache_on: Literal["device", "host"] = Field("device", description="where the previous snapshot's bytes live")
    keep_training_on_error: bool = Field(False, description="log background errors instead of raising them on "
                                                            "the next step")
    metrics_path: str | None = Field(None, description="append one JSON line per publish here (rank 0)")

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, v: str) -> str:
        from .arc import codec_names

        if v not in codec_names():
            raise ValueError(f"unknown codec {v!r}; known: {', '.join(codec_names())}")
        return v

    @field_validator("snapshot_dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        from .arc.dtypes import code_from_name, torch_name
        from .arc.errors import FormatError

        try:
            return torch_name(code_from_name(v))
        except FormatError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("bucket_url")
    @classmethod
    def _bucket(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("bucket_url must not be empty")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _signalling_complete(self) -> "HotloadConfig":
        if self.hotload_api_url:
            missing = [f for f in ("account_id", "model_id", "deployment_id") if not getattr(self, f)]
            if missing:
                raise ValueError(f"hotload_api_url is set, so {', '.join(missing)} must be set too")
            if not self.hf_config_dir:
                raise ValueError("hotload_api_url is set, so hf_config_dir must be set too: the deployment "
                                 "rejects snapshots without config.json and tokenizer files")
        return self

    @property
    def deployments(self) -> list[str]:
        if self.deployment_id is None:
            return []
        return [self.deployment_id] if isinstance(self.deployment_id, str) else list(self.deployment_id)

    def resolved_api_key(self) -> str | None:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ.get("FIREWORKS_API_KEY")

    @classmethod
    def from_env(cls, prefix: str = ENV_PREFIX, **overrides: Any) -> "HotloadConfig":
        """Build from ``<prefix><FIELD>`` variables (upper case); explicit ``overrides`` win."""
        values: dict[str, Any] = {}
        for name, field in cls.model_fields.items():
            raw = os.environ.get(prefix + name.upper())
            if raw is None:
                continue
            values[name] = _parse_env(raw, field.annotation)
        values.update(overrides)
        try:
            return cls(**values)
        except ValidationError as exc:
            raise ValueError(f"invalid hotload settings from {prefix}* environment variables:\n{exc}") from None


def _parse_env(raw: str, annotation: Any) -> Any:
    """Env strings to values: JSON for containers/booleans/numbers where it parses, else the string itself."""
    text = raw.strip()
    if text[:1] in "[{" or text in ("true", "false", "null"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return raw
    return raw
