"""The ``hotload`` command line: diff / apply / verify / inspect snapshots, run the emulator or the demo.

Exit codes: 0 success, 1 verification failed (checksum, parent or layout mismatch, corrupt payload),
2 bad usage or unreadable input, 130 interrupted (Ctrl-C). User errors print one line, never a traceback.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from .retention import CommitInfo

EXIT_OK, EXIT_VERIFY, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal or forced)."""

    def __init__(self, label: str, enabled: bool | None = None) -> None:
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.t0 = time.monotonic()

    def __call__(self, done: int, total: int, item: str) -> None:
        if not self.enabled:
            return
        width = 30
        fill = int(width * done / max(total, 1))
        sys.stderr.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} "
                         f"{time.monotonic() - self.t0:5.1f}s {item[:40]:<40}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def arg_int(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` for an integer in [lo, hi]: an out-of-range value is a one-line usage error (exit 2)
    instead of a traceback from deep inside the command."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value} is out of range (must be {_range(lo, hi)})")
        return value

    return parse


def arg_float(lo: float) -> Callable[[str], float]:
    """An argparse ``type`` for a finite float >= lo (see :func:`arg_int`)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < lo:
            raise argparse.ArgumentTypeError(f"{text} is out of range (must be a finite number >= {lo:g})")
        return value

    return parse


def _range(lo: int, hi: int | None) -> str:
    return f">= {lo}" if hi is None else f"{lo}..{hi}"


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def _print_table(report: object, show_status: bool) -> None:
    from .arc.folder import Report

    assert isinstance(report, Report)
    head = f"{'file':<34} {'tensor':<44} {'dtype':<8} {'shape':<16} {'codec':<14} {'stored':>10} {'ratio':>8}"
    print(head + ("  status" if show_status else ""))
    for r in report.rows:
        line = (f"{r.file[:34]:<34} {r.name[:44]:<44} {r.dtype:<8} {str(list(r.shape))[:16]:<16} {r.codec:<14} "
                f"{_human(r.stored):>10} {r.ratio:>7.1f}x")
        print(line + (f"  {r.status}" if show_status else ""))
    raw = sum(r.raw for r in report.rows)
    payload = sum(r.stored for r in report.rows)
    # The ratio is against the files' sizes (headers included): that is what a transfer moves.
    on_disk = report.file_bytes
    print(f"total: {len(report.rows)} tensors, {_human(raw)} raw, {_human(on_disk)} in {report.files} weight "
          f"file(s) ({_human(payload)} of it tensor payload), ratio {raw / on_disk if on_disk else float('inf'):.1f}x "
          "(raw / file bytes)")


def _warn_if_unmarked(path: str) -> None:
    """Our readers treat a snapshot folder without its commit marker as possibly incomplete."""
    from .arc.folder import INDEX
    from .retention import COMMIT_MARKER, SHARD_FILE

    if not os.path.isdir(path) or os.path.exists(os.path.join(path, COMMIT_MARKER)):
        return
    names = os.listdir(path)  # an index, or shards named for one (an upload that never reached its manifests)
    if INDEX in names or any(SHARD_FILE.fullmatch(n) for n in names):
        print(f"warning: {path} has no {COMMIT_MARKER}: the snapshot may be incomplete (an upload still in "
              "progress, or one that failed)", file=sys.stderr)


def _marker_problem(path: str) -> str | None:
    """What a snapshot folder lacks of what its commit marker lists (a file gone, or of another size), or None.
    Why: the checksums cover the tensors only, so a folder that lost its tokenizer or had its config cut short
    would be rebuilt, and its rebuild marked complete, as if it were whole."""
    import json

    from .retention import COMMIT_MARKER, CommitInfo

    marker = os.path.join(path, COMMIT_MARKER)
    if not os.path.isdir(path) or not os.path.isfile(marker):
        return None
    try:
        with open(marker, "rb") as f:
            info = CommitInfo.from_json(json.loads(f.read().decode("utf-8")), source=marker)
    except (ValueError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return f"its {COMMIT_MARKER} cannot be read: {exc}"
    for name, meta in sorted(info.files.items()):
        where = os.path.join(path, name)
        size = os.path.getsize(where) if os.path.isfile(where) else None
        if size != meta.get("size"):
            got = "is missing" if size is None else f"holds {size} bytes"
            return f"{name} {got}, but its {COMMIT_MARKER} lists it at {meta.get('size')} bytes: the snapshot is " \
                   "damaged (copy it again from the bucket)"
    return None


def _marker_plan(folder: str, kind: str, parent: str | None) -> CommitInfo:
    """The commit marker a snapshot folder the CLI writes will get, checked before any work is done.

    The folder's name is the snapshot's identity and, for a delta, the parent identity is recorded too; a name
    that cannot be an identity is bad usage, found up front rather than after writing a folder nobody can mark.
    """
    from .retention import CommitInfo

    identity = os.path.basename(os.path.normpath(os.path.abspath(folder)))
    try:
        return CommitInfo(identity, kind, parent if kind == "delta" else None, {})
    except ValueError as exc:
        hint = " (a delta's parent is PARENT's folder name unless --parent-identity is given)" if kind == "delta" \
            else ""
        raise ValueError(f"cannot write snapshot folder {folder}: its name is the snapshot identity, and {exc}"
                         f"{hint}") from None


def _mark_complete(folder: str, plan: CommitInfo) -> None:
    """Write the commit marker planned by :func:`_marker_plan`, listing the files now in the folder."""
    from .arc.folder import folder_files
    from .retention import CommitInfo, write_commit_marker
    from .storage import Storage

    files = {name: {"size": os.path.getsize(path)} for name, path in folder_files(folder)}  # sub-folders too
    _make_durable(folder)
    info = CommitInfo(plan.identity, plan.kind, plan.parent_identity, files)
    write_commit_marker(Storage(os.path.dirname(os.path.normpath(os.path.abspath(folder)))), info)


def _make_durable(folder: str) -> None:
    """fsync every file below ``folder`` and every folder in it: the commit marker may be written only once the
    files it vouches for are durable (``write_commit_marker``). diff and apply write them with plain writes and
    copies; after a power loss the marker, which is synced, could list files whose data never reached the disk."""
    from .arc.folder import folder_files
    from .storage_local import fsync_file, fsync_folder

    dirs = {os.path.abspath(folder)}
    for _name, path in folder_files(folder):
        with open(path, "rb") as f:  # Linux syncs a file's dirty pages through any descriptor of it
            fsync_file(f)
        d = os.path.dirname(os.path.abspath(path))
        while d not in dirs and d.startswith(os.path.abspath(folder)):
            dirs.add(d)
            d = os.path.dirname(d)
    dirs.add(os.path.dirname(os.path.abspath(folder)))  # the folder's own name, made by diff or apply
    for d in sorted(dirs, reverse=True):  # the names in each folder, then the folder in its parent
        fsync_folder(d)


def _parent_hint(parent: str, delta: str, given: str | None) -> str | None:
    """Why a rebuild may have failed: PARENT's folder name (a snapshot folder is named by its identity) differs
    from the parent the delta records. Only a hint, given when verification fails: a correctly rebuilt PARENT
    may sit in a folder of any name, and then its checksums still match."""
    from .arc.errors import ArcError
    from .arc.folder import inspect_path
    from .identity import validate_identity

    if given is not None or not os.path.isdir(parent):
        return None
    name = os.path.basename(os.path.normpath(os.path.abspath(parent)))
    try:
        validate_identity(name)
        recorded = inspect_path(delta).parent
    except (ValueError, OSError, ArcError):  # only a hint: never in place of the error it explains
        return None
    if recorded is None or recorded == name:
        return None
    return (f"the delta was made against {recorded!r}, PARENT is {name!r}: is PARENT the right snapshot? (if it "
            f"holds {recorded!r} under another name, pass --parent-identity {recorded} to check that instead)")


_PARENT = "the full snapshot the delta is made against: a .safetensors file or a snapshot folder"
_DELTA = "the delta: a .safetensors file or a snapshot folder written by 'hotload diff' or a trainer"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hotload", description="Lossless delta snapshots for RL weight hot-loading.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")  # "required: COMMAND", not "cmd"
    d = sub.add_parser("diff", help="encode NEW as a delta against PARENT")
    d.add_argument("parent", help=_PARENT)
    d.add_argument("new", help="the newer full snapshot: a .safetensors file, or a folder with the same weight files")
    d.add_argument("out", help="where the delta goes: a file (for file inputs) or a new folder named like an identity")
    d.add_argument("--codec", default="arc_v2", help="arc_v2 (Fireworks wire format) or arc_sparse_v1")
    d.add_argument("--parent-identity", default=None, help="identity recorded as the parent (default: PARENT's name)")
    d.add_argument("--vendor-module", default=None,
                   help="encode files with this module's delta_compress_files_to_file (Fireworks' reference "
                        "encoder) for byte compatibility with Fireworks' loader; a module name or a .py file's path")
    a = sub.add_parser("apply", help="rebuild a full snapshot from PARENT and DELTA into OUT")
    a.add_argument("parent", help=_PARENT)
    a.add_argument("delta", help=_DELTA)
    a.add_argument("out", help="where the rebuilt full snapshot goes: a file, or a new folder named like an identity")
    a.add_argument("--parent-identity", default=None, help="reject a delta made against another parent")
    v = sub.add_parser("verify", help="rebuild in memory and check every checksum")
    v.add_argument("parent", help=_PARENT)
    v.add_argument("delta", help=_DELTA)
    v.add_argument("--parent-identity", default=None, help="reject a delta made against another parent")
    i = sub.add_parser("inspect", help="kind, parent, codec and per-tensor sizes of a snapshot file or folder")
    i.add_argument("path", help="a .safetensors file or a snapshot folder (local; copy one out of the bucket first)")
    sub.add_parser("emulate", help="run the local hot-load emulator (see 'hotload emulate --help')", add_help=False)
    sub.add_parser("demo", help="run the end-to-end local demo", add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(args_list)
    except KeyboardInterrupt:  # while starting up (importing torch takes seconds), or in emulate's or demo's set-up
        cmd = args_list[0] if args_list and not args_list[0].startswith("-") else "hotload"
        return _interrupted(cmd, None)


def _interrupted(cmd: str, out: str | None) -> int:
    """One line for a Ctrl-C instead of a KeyboardInterrupt traceback, and exit 130 as a shell reports SIGINT. A
    snapshot folder OUT is left without its commit marker (written last), which readers take as incomplete; it is
    not removed here, since it may be one the user made, but the user is told to. A file OUT is written through a
    temp file renamed over it, so it is as it was."""
    from .retention import COMMIT_MARKER

    line = f"interrupted: {cmd} did not finish"
    if out is not None and os.path.isdir(out) and not os.path.exists(os.path.join(out, COMMIT_MARKER)):
        line += f"; OUT {out} is incomplete (it has no {COMMIT_MARKER}): remove it before running again"
    print(("\n" if sys.stderr.isatty() else "") + line, file=sys.stderr)  # after the ^C or a progress bar
    return EXIT_INTERRUPTED


def _main(args_list: list[str]) -> int:
    if args_list[:1] in (["emulate"], ["demo"]):
        if args_list[0] == "emulate":
            from .emulator import run_emulator_cli as run
        else:
            from .demo import run_demo_cli as run
        try:
            return run(args_list[1:])
        except SystemExit as exc:  # argparse's usage errors and --help: a code, as for the other commands
            return exc.code if isinstance(exc.code, int) else (EXIT_USAGE if exc.code else EXIT_OK)
    parser = _parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    from .arc.errors import ArcError, VendorOutputError
    from .arc.folder import apply_paths, diff_paths, inspect_path, verify_paths
    from .identity import validate_identity

    code = EXIT_OK  # verify's result, known before its table is printed
    try:
        for role in ("parent", "new", "delta", "path"):
            path = getattr(args, role, None)
            if path is None:
                continue
            if not path:  # an unset shell variable
                print(f"error: {role.upper()} is empty: give a file or folder", file=sys.stderr)
                return EXIT_USAGE
            if "://" in path and not os.path.exists(path):  # s3://, gs://: not a typo, a limit
                print(f"error: {role.upper()} {path}: the command line reads local files and folders only; copy the "
                      "snapshot folder here first (aws s3 cp --recursive, gcloud storage cp -r)", file=sys.stderr)
                return EXIT_USAGE
            if not os.path.exists(path):
                print(f"error: {role.upper()} {path}: no such file or folder", file=sys.stderr)
                return EXIT_USAGE
            _warn_if_unmarked(path)
            problem = _marker_problem(path)
            if problem is not None:
                print(f"error: {role.upper()} {path}: {problem}", file=sys.stderr)
                return EXIT_VERIFY
        if args.cmd in ("diff", "apply"):
            inputs = (args.parent, args.new if args.cmd == "diff" else args.delta)
            if "://" in args.out:
                raise ValueError(f"OUT {args.out}: the command line writes local files and folders only; write here "
                                 "and copy the result up")
            if not os.path.isdir(inputs[1]) and os.path.isdir(args.out):
                raise ValueError(f"OUT {args.out} is a folder, but the inputs are files: name an output file")
            if os.path.isdir(inputs[1]) and os.path.exists(args.out) and not os.path.isdir(args.out):
                raise ValueError(f"OUT {args.out} is a file, but the inputs are folders: name a new or empty folder")
            if os.path.exists(args.out) and any(os.path.samefile(args.out, p) for p in inputs):
                raise ValueError(f"OUT {args.out} is one of the inputs: name a new file or folder")
            for p in inputs:  # copying that input's other files would copy OUT into itself, and change the input
                if os.path.isdir(p) and os.path.realpath(args.out).startswith(os.path.join(os.path.realpath(p), "")):
                    raise ValueError(f"OUT {args.out} is inside the input folder {p}: name a folder outside it")
            if os.path.isdir(inputs[1]) and os.path.isdir(args.out) and os.listdir(args.out):
                from .retention import COMMIT_MARKER

                left = "" if os.path.exists(os.path.join(args.out, COMMIT_MARKER)) else \
                    f" (it has no {COMMIT_MARKER}: what a failed or interrupted run left? remove it and run again)"
                raise ValueError(f"OUT {args.out} already holds files{left}: a snapshot there would be overwritten, "
                                 "and the new one's commit marker would list the others as its own; name a new or "
                                 "empty folder")
        if getattr(args, "parent_identity", None) is not None:  # diff records it in every delta file
            validate_identity(args.parent_identity, what="--parent-identity")
        if args.cmd == "diff":
            plan = _marker_plan(args.out, "delta", args.parent_identity or os.path.basename(
                os.path.abspath(args.parent))) if os.path.isdir(args.new) else None
            unverified: list[str] = []
            n = diff_paths(args.parent, args.new, args.out, codec=args.codec, parent_identity=args.parent_identity,
                           progress=Progress("diff"), vendor_module=args.vendor_module, unverified=unverified)
            if unverified:
                print(f"warning: {len(unverified)} file(s) the vendor module wrote (e.g. {unverified[0]}) are in a "
                      "layout hotload cannot decode, so they were checked as safetensors files only, not rebuilt: "
                      "verify them with Fireworks' loader", file=sys.stderr)
            if plan is not None:
                _mark_complete(args.out, plan)
            print(f"wrote {_human(n)} to {args.out}")
        elif args.cmd == "apply":
            plan = _marker_plan(args.out, "full", None) if os.path.isdir(args.delta) else None
            try:
                apply_paths(args.parent, args.delta, args.out, expected_parent=args.parent_identity,
                            progress=Progress("apply"))
            except ArcError:
                hint = _parent_hint(args.parent, args.delta, args.parent_identity)
                if hint:
                    print(f"hint: {hint}", file=sys.stderr)
                raise
            if plan is not None:
                _mark_complete(args.out, plan)
            print(f"rebuilt {args.out}: every checksum verified")
        elif args.cmd == "verify":
            report = verify_paths(args.parent, args.delta, expected_parent=args.parent_identity,
                                  progress=Progress("verify"))
            code = EXIT_OK if report.ok else EXIT_VERIFY
            _print_table(report, show_status=True)
            for e in report.errors:
                print(f"error: {e}", file=sys.stderr)
            hint = _parent_hint(args.parent, args.delta, args.parent_identity) if report.errors else None
            if hint:
                print(f"hint: {hint}", file=sys.stderr)
            print("verified: all checksums match" if report.ok else "verification FAILED")
        elif args.cmd == "inspect":
            report = inspect_path(args.path)
            print(f"kind: {report.kind}" + (f"  parent: {report.parent}" if report.parent else ""))
            _print_table(report, show_status=False)
        sys.stdout.flush()  # here, where a closed pipe is caught below, not at exit
    except KeyboardInterrupt:
        return _interrupted(args.cmd, getattr(args, "out", None))
    except BrokenPipeError:
        # The reader stopped early (``| head``): not a failure of the command. Later writes, and the flush at
        # exit, go nowhere instead of raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return code
    except FileNotFoundError as exc:
        print(f"error: no such file or folder: {exc.filename or exc}", file=sys.stderr)
        return EXIT_USAGE
    except ArcError as exc:
        # apply/verify rebuild payloads: a corrupt payload, a checksum, parent or layout mismatch fails
        # verification. diff and inspect only read headers or full files, so there it is unusable input, except
        # for a vendor module's output, which diff rebuilds and checks.
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_VERIFY if args.cmd in ("apply", "verify") or isinstance(exc, VendorOutputError) else EXIT_USAGE
    except (OSError, ValueError) as exc:  # includes UnusableInputError and the marker's identity rules
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return code


if __name__ == "__main__":
    sys.exit(main())
