"""``hotload emulate``: the hot-load emulator from the command line, serving until Ctrl-C.

Example::

    hotload emulate --bucket /tmp/bucket --replicas 2 --deployment d=m
"""
from __future__ import annotations

import argparse
import errno
import logging
import sys
import threading
from typing import Any

from .emulator import HotLoadEmulator, served_deployments
from .emulator_rules import BaseModelSpec
from .fireworks_names import deployment_name
from .masking import mask_text, mask_url


def _compression_formats(text: str) -> tuple[str, ...]:
    """``--compression-formats``: a comma list of codecs our decoder reads (the replicas rebuild with it)."""
    from .arc import codec_names

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in codec_names()]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma list of {', '.join(codec_names())}")
    return names


_S3_KEYS = "reads AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) from the environment"
_GCS_KEYS = "reads GOOGLE_APPLICATION_CREDENTIALS (or gcloud's default login)"
_CREDENTIALS = {"s3": _S3_KEYS, "s3a": _S3_KEYS, "gs": _GCS_KEYS, "gcs": _GCS_KEYS}


def _bucket_problem(bucket: str, options: dict[str, Any] | None) -> str | None:
    """Why ``bucket`` cannot be served, found at startup rather than as a load error on the first signal: an
    unknown scheme, a missing backend, a local folder that does not exist, or a remote bucket that refuses a
    listing for good (no credentials, access denied). A remote bucket that cannot be reached yet only warns: the
    emulator may be started before the object store."""
    import fsspec.core

    from .storage import Storage, StorageError
    from .storage_errors import classify_error, credential_hint

    try:
        storage = Storage(bucket, options, max_attempts=2, call_timeout_s=15.0)
    except (StorageError, ValueError, OSError) as exc:  # OSError: a backend that connects at once (ftp, sftp)
        return mask_text(f"{type(exc).__name__}: {exc}" if isinstance(exc, OSError) else str(exc))
    protocol, _ = fsspec.core.split_protocol(storage.root)
    if protocol in (None, "file"):
        return f"{storage.root} is not a folder" if not storage.fs.isdir(storage.root) else None
    try:
        storage.list_dirs()
    except StorageError as exc:
        if classify_error(exc).retryable:
            print(f"hotload emulate: warning: cannot list {mask_url(bucket)} yet ({mask_text(str(exc))}); serving "
                  "anyway, signals get 503 until it answers", file=sys.stderr)
            return None
        keys = _CREDENTIALS.get(protocol.lower())
        advice = credential_hint(exc, options) or (f"{protocol}:// {keys}" if keys else "")
        return mask_text(str(exc)) + (f"; {advice}" if advice else "")
    return None


def _api_key_arg(text: str) -> str:
    """``--api-key "$KEY"`` with KEY unset is an empty key, which every client would fail with 401."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (an unset variable?): give a key, or leave --api-key out to "
                                         "accept any bearer key")
    return text


def _host_arg(text: str) -> str:
    """``--host "$HOST"`` with HOST unset would listen on every interface (the socket layer reads an empty
    address as all of them), the opposite of what leaving the flag out gives."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (an unset variable?): give an address such as 127.0.0.1, or "
                                         "0.0.0.0 to listen on every interface, or leave --host out for loopback")
    return text.strip()


def _endpoint_arg(text: str) -> str:
    """``--endpoint-url "$URL"`` with URL unset would be dropped, and an s3:// bucket then read from AWS itself
    rather than the S3-compatible store meant."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (an unset variable?): give the store's URL, such as "
                                         "http://127.0.0.1:9000, or leave --endpoint-url out to use AWS S3")
    return text.strip()


def _account_arg(text: str) -> str:
    """``--account``: an account id, as a client's ``account_id`` would name it."""
    try:
        return deployment_name(text, "d")[1]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("account_id", "the account")) from None


def _deployment_arg(text: str) -> tuple[str, str]:
    """``--deployment ID=MODEL``; the names are checked with the others when the emulator is made."""
    dep, eq, model = text.partition("=")
    if not eq or not dep.strip() or not model.strip():
        raise argparse.ArgumentTypeError(f"must be ID=MODEL (a deployment and the model it serves), got {text!r}")
    return dep.strip(), model.strip()


def main(args: list[str] | None = None) -> int:
    """``hotload emulate``: serve until Ctrl-C; prints the URL to point HotLoadClient at."""
    from .cli import arg_float, arg_int

    p = argparse.ArgumentParser(prog="hotload emulate", description="Run a local Fireworks hot-load emulator.")
    p.add_argument("--bucket", required=True, help="bucket prefix URI holding <identity>/ snapshot folders")
    p.add_argument("--host", type=_host_arg, default="127.0.0.1",
                   help="address to listen on (default: %(default)s; another address without --api-key is "
                        "warned about: anyone reaching it may signal loads)")
    p.add_argument("--port", type=arg_int(0, 65535), default=0, help="TCP port; 0 (the default) picks a free one")
    p.add_argument("--replicas", type=arg_int(1), default=2, help="replicas per deployment (default: %(default)s)")
    p.add_argument("--api-key", type=_api_key_arg, default=None,
                   help="require 'Authorization: Bearer KEY' (default: any bearer key)")
    p.add_argument("--load-delay", type=arg_float(0), default=0.0, metavar="SECONDS",
                   help="extra seconds per load (default: %(default)s)")
    p.add_argument("--manager-delay", type=arg_float(0), default=0.0, metavar="SECONDS",
                   help="seconds a new deployment reports no replicas and refuses signals and hints "
                   "(default: %(default)s)")
    p.add_argument("--compression-formats", type=_compression_formats, default="arc_v2", metavar="LIST",
                   help="comma list of the compression_format values delta signals may name (default: "
                        "%(default)s; add arc_sparse_v1 to load our sparse deltas)")
    p.add_argument("--base-model", default=None, metavar="DIR",
                   help="the deployments' base model (HF folder): full snapshots must match its config.json and "
                        "cover its tensors with the same shapes (only the safetensors headers are read)")
    p.add_argument("--endpoint-url", type=_endpoint_arg, default=None,
                   help="S3-compatible endpoint for s3:// buckets")
    p.add_argument("--account", type=_account_arg, default="emulator", metavar="ID",
                   help="the account GET /v1/accounts reports, and bare --deployment ids are in (default: %(default)s)")
    p.add_argument("--deployment", type=_deployment_arg, action="append", default=None, metavar="ID=MODEL",
                   help="serve this deployment, for this model (ids or full names; repeat for more): requests naming "
                        "any other deployment get 404, another model 400 (default: any deployment, first model named)")
    p.add_argument("--history-limit", type=arg_int(1), default=10_000, metavar="N",
                   help="ledger rows and hints kept per deployment for reading (default: %(default)s)")
    ns = p.parse_args(args)
    # The emulator's warnings (a load that failed, a listening address open to others) reach stderr marked as such
    logging.basicConfig(level=logging.WARNING, format="hotload emulate: %(levelname)s: %(message)s")
    opts = {"endpoint_url": ns.endpoint_url} if ns.endpoint_url is not None else None
    problem = _bucket_problem(ns.bucket, opts)
    if problem is not None:
        print(f"hotload emulate: error: --bucket {mask_url(ns.bucket)}: {problem}", file=sys.stderr)
        return 2
    base = None
    if ns.base_model is not None:
        try:
            base = BaseModelSpec.from_folder(ns.base_model)
        except (OSError, ValueError) as exc:
            print(f"hotload emulate: error: --base-model {ns.base_model}: {exc}", file=sys.stderr)
            return 2
    served = None
    try:
        if ns.deployment is not None:
            served = served_deployments(dict(ns.deployment), ns.account)
            if len(served) < len(ns.deployment):
                raise ValueError("the same deployment is given twice")
    except ValueError as exc:
        print(f"hotload emulate: error: --deployment: {exc}", file=sys.stderr)
        return 2
    emu = HotLoadEmulator(ns.bucket, storage_options=opts, host=ns.host, port=ns.port, replicas=ns.replicas,
                          api_key=ns.api_key, load_delay_s=ns.load_delay, manager_delay_s=ns.manager_delay,
                          compression_formats=ns.compression_formats, history_limit=ns.history_limit,
                          base_model=base, deployments=served, account_id=ns.account)
    try:
        emu.start()
    except OSError as exc:
        what = "pick another --port, or 0 for a free one" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else \
            "check --host (an address of this machine) and --port"
        print(f"hotload emulate: error: cannot listen on {ns.host}:{ns.port}: {exc}; {what}", file=sys.stderr)
        return 2
    stop = threading.Event()
    try:  # entered before the URL is printed, so a Ctrl-C right after it still stops cleanly
        print(f"hot-load emulator for {mask_url(ns.bucket)} listening on {emu.url} (Ctrl-C to stop)", flush=True)
        while not stop.wait(3600):
            pass
    except KeyboardInterrupt:
        print("stopping", flush=True)
    finally:
        emu.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
