"""``hotload demo``: the whole loop on one machine, offline.

The launcher starts the hot-load emulator (2 replicas) over a local folder bucket, then runs a small FSDP2
training job on CPU with ``torchrun`` (2 ranks, gloo). The job publishes every step through
:class:`HotloadCallback` (a full snapshot every 10 publishes, deltas otherwise); after each publish rank 0
checks that every replica serves exactly the bytes of the trainer's gathered state, and prints one row per
publish and a summary.

Example::

    hotload demo                       # 30 steps, 2 ranks, full every 10
    hotload demo --steps 60 --codec arc_sparse_v1 --workdir /tmp/hotload-demo
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, FFN, HEADS, LAYERS = 512, 128, 344, 4, 4
API_KEY = "demo-key"
DESCRIPTION = ("Run the whole loop on one machine, offline: a local hot-load emulator (2 replicas) and a small "
               "FSDP2 training job on CPU that publishes every step; every replica is checked against the "
               "trainer's weights after each publish.")
RESULT_FILES = ("metrics.jsonl", "demo_result.json")  # what the demo writes into --workdir besides bucket/, hf/


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, dim: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(dim)
        self.self_attn = Attention(dim, heads)
        self.post_attention_layernorm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Layer(dim, hidden, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)


class CausalLM(nn.Module):
    """HF-like names: model.embed_tokens.weight, model.layers.N.mlp.up_proj.weight, ..., lm_head.weight."""

    def __init__(self, vocab: int, dim: int, hidden: int, heads: int, layers: int) -> None:
        super().__init__()
        self.model = Inner(vocab, dim, hidden, heads, layers)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        for p in self.parameters():  # small init, like real checkpoints (sets how often a bf16 ulp flips)
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h)
        return self.lm_head(self.model.norm(h))


def _model() -> Any:
    torch.manual_seed(0)
    return CausalLM(VOCAB, DIM, FFN, HEADS, LAYERS)


def _served(url: str) -> list[tuple[str | None, dict[str, str]]]:
    req = urllib.request.Request(f"{url}/emulator/v1/state", headers={"Authorization": f"Bearer {API_KEY}"})
    # The emulator is on loopback: urlopen would send this through $http_proxy (set on many clusters) unless
    # $no_proxy names 127.0.0.1, and a proxy cannot reach our loopback.
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30) as resp:
        (dep,) = json.load(resp)["deployments"].values()
    return [(r["identity"], {k: t["digest"] for k, t in r["tensors"].items()}) for r in dep["replicas"]]


def job(args: argparse.Namespace) -> None:
    """One rank of the demo training job (run under torchrun)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .callback import HotloadCallback
    from .config import HotloadConfig
    from .engine.jobs import PublishError
    from .engine.metrics import METRICS_ATTR
    from .fsdp_verify import gather_full_state

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    # Each publish's outcome is a row of the table below, and a failed one's cause the launcher's last line: the
    # library's own line for a failed publish would say that cause a second time.
    logging.getLogger("fsdp_hotload").addFilter(lambda record: not hasattr(record, METRICS_ATTR))
    model = _model()
    # A CPU mesh, named: without one, fully_shard picks CUDA wherever torch sees a GPU, and a one-GPU machine
    # then fails on rank 1 ("invalid device ordinal").
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    cfg = HotloadConfig(bucket_url=args.bucket, hotload_api_url=args.url, account_id="demo", model_id="tiny-lm",
                        deployment_id="rollout", api_key=API_KEY, hf_config_dir=args.hf_dir,
                        full_every=args.full_every, codec=args.codec, poll_interval_s=0.02,
                        busy_policy="wait",  # the demo checks every publish before the next step
                        metrics_path=os.path.join(args.workdir, "metrics.jsonl"))
    gen = torch.Generator().manual_seed(1234 + rank)
    rows: list[dict[str, Any]] = []
    if rank == 0:
        print(f"{'step':>4} {'kind':<5} {'identity':<22} {'weights B':>10} {'ratio':>7} {'changed':>8} "
              f"{'block ms':>8} {'upload s':>8} {'ready s':>7}  verified", flush=True)
    error = None
    try:
        with HotloadCallback(model, cfg) as hot:
            hot.attach(opt)  # publishes from optimizer.step()'s post-step hook
            for step in range(args.steps):
                ids = torch.randint(0, VOCAB, (4, 33), generator=gen)
                logits = model(ids[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad()
                hot.wait()  # the demo checks every publish; a real job keeps training while it uploads
                full = gather_full_state(model)
                if rank == 0:
                    rows.append(_row(step, hot.metrics[-1], full, args))
    except PublishError as exc:
        # Every rank raises it at the same publish (the ranks agree on each outcome): the summary below, and
        # the launcher's one line naming the cause, instead of a traceback per rank.
        error = str(exc)
    if rank == 0:
        verified = _summary(rows, error)
        with open(os.path.join(args.workdir, "demo_result.json"), "w") as f:
            json.dump({"verified": verified, "rows": rows, "error": error}, f)
    dist.barrier()
    _exit_cleanly()


def _summary(rows: list[dict[str, Any]], error: str | None) -> bool:
    """Print the run's summary line; whether every publish was made and verified on every replica. The traffic
    is that of the snapshots published: a failed one's files are not a snapshot anyone loads."""
    done = [r for r in rows if r["ok"]]
    # every file of each snapshot's folder: weights, and the config, tokenizer, index, spec and marker files
    sent, weights = sum(r["folder"] for r in done), sum(r["bytes"] for r in done)
    fulls = [r["folder"] for r in done if r["kind"] == "full"]
    full_every_step = len(done) * (sum(fulls) / len(fulls) if fulls else max((r["raw"] for r in done), default=0))
    verified = bool(rows) and all(r["verified"] for r in rows) and error is None
    failed = f", {len(rows) - len(done)} FAILED" if len(done) < len(rows) else ""
    traffic = (f"; sent {sent / 1e6:.2f} MB ({weights / 1e6:.2f} MB of weight files, the rest config, tokenizer, "
               f"index and marker files) vs {full_every_step / 1e6:.2f} MB for a full snapshot every step "
               f"({full_every_step / max(sent, 1):.1f}x less traffic)") if done else ""
    print(f"\n{len(rows)} publishes: {sum(r['kind'] == 'full' for r in rows)} full, "
          f"{sum(r['kind'] == 'delta' for r in rows)} delta{failed}{traffic}; every replica verified bit-exact: "
          f"{'yes' if verified else 'NO'}", flush=True)
    return verified


def _row(step: int, m: Any, full: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Check one publish against every replica, print its row and return it (rank 0). A publish that failed shows
    FAILED and no ratio: the bytes it wrote before failing are not a snapshot anyone serves."""
    from .arc.dtypes import RawTensor

    want = {k: RawTensor.from_any(v).digest() for k, v in full.items()}
    ok = m.ok and all(i == m.identity and shas == want for i, shas in _served(args.url))
    changed = f"{100 * m.changed_fraction:.2f}%" if m.changed_fraction is not None and m.ok else "-"
    size, ratio = (f"{m.bytes_written:>10,}", f"{m.ratio or 0:>6.1f}x") if m.ok else (f"{'FAILED':>10}", f"{'-':>7}")
    print(f"{step:>4} {m.kind:<5} {m.identity:<22} {size} {ratio} {changed:>8} {m.blocking_ms:>8.2f} "
          f"{m.upload_s:>8.3f} {m.ready_s:>7.3f}  {'yes' if ok else 'NO'}", flush=True)
    return {"kind": m.kind, "bytes": m.bytes_written, "raw": m.raw_bytes, "verified": ok, "ok": m.ok,
            "identity": m.identity, "folder": _folder_bytes(os.path.join(args.bucket, m.identity))}


def _folder_bytes(folder: str) -> int:
    """Bytes of every file a snapshot's folder holds (the bucket is a local folder here)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


#: The file that marks a --workdir as the demo's own, so a re-run may empty its bucket/.
DEMO_MARK = ".hotload-demo"


def _exit_cleanly() -> None:
    """Leave without C++ teardown: gloo can abort in static destructors after all work is done, which would
    turn a finished job into a failed one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_demo_cli(argv: list[str] | None = None) -> int:
    from .arc import codec_names
    from .cli import arg_float, arg_int

    # Every value is range-checked here, in the launcher: a bad one found inside torchrun would print a
    # traceback per rank, and --steps 0 would "verify" nothing and report success.
    p = argparse.ArgumentParser(prog="hotload demo", description=DESCRIPTION)
    p.add_argument("--steps", type=arg_int(1), default=30, help="training steps, one publish each (default: "
                   "%(default)s)")
    p.add_argument("--full-every", type=arg_int(1), default=10, metavar="N",
                   help="a full snapshot every N publishes, deltas in between (default: %(default)s)")
    p.add_argument("--nproc", type=arg_int(1), default=2, help="training ranks (default: %(default)s)")
    p.add_argument("--codec", choices=codec_names(), default="arc_v2",
                   help="delta codec (default: %(default)s)")
    p.add_argument("--lr", type=arg_float(0), default=3e-6,
                   help="RL-like learning rate, so few bf16 values change per step (default: %(default)s)")
    p.add_argument("--workdir", default=None, help="keep the bucket and metrics here (default: a temp dir)")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bucket", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--hf-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        try:
            job(args)
        except KeyboardInterrupt:  # torchrun passes the launcher's Ctrl-C on: one line per rank, no traceback
            print(f"rank {os.environ.get('RANK', '?')}: interrupted", file=sys.stderr, flush=True)
            os._exit(130)
        return 0
    from .emulator import HotLoadEmulator

    workdir = args.workdir or tempfile.mkdtemp(prefix="hotload-demo-")
    bucket, hf = os.path.join(workdir, "bucket"), os.path.join(workdir, "hf")
    mark = os.path.join(workdir, DEMO_MARK)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        p.error(f"--workdir {workdir} is not a folder")
    if not os.path.isfile(mark) and (any(os.path.isdir(d) and os.listdir(d) for d in (bucket, hf))
                                     or any(os.path.lexists(os.path.join(workdir, n)) for n in RESULT_FILES)):
        # Each run empties bucket/, rewrites hf/ and replaces its result files: only in a folder an earlier demo
        # made.
        p.error(f"--workdir {workdir} holds a bucket/ or hf/ folder, or a {' or '.join(RESULT_FILES)} file, that no "
                f"demo made (no {DEMO_MARK}); pick an empty or new folder")
    try:
        shutil.rmtree(bucket, ignore_errors=True)
        os.makedirs(bucket), os.makedirs(hf, exist_ok=True)
        with open(mark, "w") as f:
            f.write("made by hotload demo: its bucket/ and hf/ are replaced on every run\n")
        for name in RESULT_FILES:  # a re-run in the same --workdir must not append to, or report, the last run's
            if os.path.isfile(os.path.join(workdir, name)):
                os.remove(os.path.join(workdir, name))
        _write_base_model(hf)
    except OSError as exc:  # under a file, read-only, full, a bucket/ that is a file: one line, as every user error
        p.error(f"--workdir {workdir} cannot be set up: {exc}")
    print(f"hotload demo: {args.nproc}-rank FSDP2 job on CPU, {args.steps} steps, full every {args.full_every}, "
          f"codec {args.codec}; bucket {bucket}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TORCH_CPP_LOG_LEVEL="ERROR")
    # Our emulator stands in for a receiver running our decoder, so it accepts every codec we write. Like the
    # service, it compares each full snapshot's config.json with the base model's (the hf folder).
    with HotLoadEmulator(bucket, replicas=2, api_key=API_KEY, compression_formats=codec_names(),
                         base_model=hf) as emu:
        print(f"emulator: {emu.url} (2 replicas rebuild and verify every snapshot from the bucket)\n", flush=True)
        cmd = [sys.executable, "-m", "fsdp_hotload.demo_torchrun", "--standalone", f"--nproc-per-node={args.nproc}",
               "-m", "fsdp_hotload.demo", "--job", "--bucket", bucket, "--url", emu.url, "--hf-dir", hf,
               "--workdir", workdir, "--steps", str(args.steps), "--full-every", str(args.full_every),
               "--codec", args.codec, "--lr", str(args.lr)]
        proc = subprocess.Popen(cmd, env=env)
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            # torchrun starts each rank in a session of its own, so only torchrun can stop them: it gets the
            # interrupt (subprocess.call would SIGKILL it, leaving the ranks training with no emulator)
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            print(f"\ninterrupted; snapshots so far are in {bucket}", file=sys.stderr)
            return 130
    if rc != 0:  # a rank failed: its own error is above
        print(f"demo job failed (exit {rc})", file=sys.stderr)
        return 1
    with open(os.path.join(workdir, "demo_result.json")) as f:
        result = json.load(f)
    good = [r["identity"] for r in result["rows"] if r["verified"]]
    inspect = f"; try: {_hotload_command()} inspect {shlex.quote(os.path.join(bucket, good[-1]))}" if good else ""
    print(f"\nsnapshots and metrics are in {workdir}{inspect}", flush=True)
    if result.get("error"):  # the last line says why: the publish's own error, once, not a traceback per rank
        print(f"\ndemo FAILED: a publish failed: {result['error']}", file=sys.stderr)
        return 1
    return 0 if result["verified"] else 1


def _write_base_model(hf: str) -> None:
    """The base model's config and a word-level tokenizer of its vocabulary: what the trainer uploads with every
    full snapshot, and what the emulator compares each snapshot's config with."""
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "vocab_size": VOCAB, "hidden_size": DIM, "intermediate_size": FFN,
                   "num_hidden_layers": LAYERS, "tie_word_embeddings": False}, f)
    with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 32}, f)
    with open(os.path.join(hf, "tokenizer.json"), "w") as f:
        json.dump({"version": "1.0", "pre_tokenizer": {"type": "WhitespaceSplit"},
                   "model": {"type": "WordLevel", "unk_token": "t0", "vocab": {f"t{i}": i for i in range(VOCAB)}}}, f)


def _hotload_command() -> str:
    """How to run ``hotload`` from the user's shell: its path in the venv the demo runs from when that venv is not
    activated (a bare ``hotload`` would then be "command not found", or another install's)."""
    sibling = os.path.join(os.path.dirname(sys.executable), "hotload")
    if not os.access(sibling, os.X_OK):
        return "hotload"
    found = shutil.which("hotload")
    if found is not None and os.path.samefile(found, sibling):
        return "hotload"
    return shlex.quote(sibling)


if __name__ == "__main__":
    sys.exit(run_demo_cli())
