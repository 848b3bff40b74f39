"""The hot-load emulator over real HTTP on loopback, driven by HotLoadClient and by raw requests: loads served bit
for bit, the request and ledger rules, injected faults and delays, history limits, base config, S3 and the CLI.
What fails a load is in test_emulator_load_failures.py, malformed and hostile requests in test_emulator_requests.py;
the helpers here (client_for, raw, served, settle, load_full) are shared with those files."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import fsdp_hotload.emulator_state as emulator_state
from fsdp_hotload.emulator import HotLoadEmulator
from fsdp_hotload.fireworks import HotLoadClient, HotLoadError, HotLoadStatus, HotLoadTimeout
from tests.emulator_fixture import (  # the emulator and s3_server fixtures come from tests/conftest.py
    CONFIG,
    EMULATOR_API_KEY,
    perturb,
    digest_map,
    tiny_model,
    write_delta_snapshot,
    write_full_snapshot,
)

DEP = "accounts/acct/deployments/dep"
REPO_ROOT = Path(__file__).resolve().parents[1]


def client_for(emu: HotLoadEmulator, **kw: Any) -> HotLoadClient:
    opts: dict[str, Any] = dict(account_id="acct", model_id="m", deployment_id="dep", api_key=EMULATOR_API_KEY,
                                poll_interval_s=0.02, backoff_initial_s=0.01, backoff_max_s=0.05, retry_budget_s=5)
    opts.update(kw)
    return HotLoadClient(emu.url, **opts)


def raw(emu: HotLoadEmulator, method: str, path: str, body: Any = None, *, headers: dict[str, str] | None = None,
        auth: bool = True) -> tuple[int, Any]:
    h = {"fireworks-model": "accounts/acct/models/m", "fireworks-deployment": DEP, "Content-Type": "application/json"}
    if auth:
        h["Authorization"] = f"Bearer {EMULATOR_API_KEY}"
    h.update(headers or {})
    h = {k: v for k, v in h.items() if v is not None}
    host, port = emu.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(), headers=h)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def served(emu: HotLoadEmulator) -> list[tuple[str | None, dict[str, str]]]:
    reps = emu.state()["deployments"][DEP]["replicas"]
    return [(r["identity"], {n: t["digest"] for n, t in r["tensors"].items()}) for r in reps]


def settle(emu: HotLoadEmulator, identity: str, timeout_s: float = 30) -> list[dict[str, Any]]:
    """Wait until every replica has finished (done or error) the load of ``identity``; returns its ledger row's
    per-replica entries. wait_ready fails fast on the first replica error, while others may still be loading."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = [r for r in emu.state()["deployments"][DEP]["ledger"] if r["identity"] == identity]
        if rows and all(p["stage"] in ("done", "error") for p in rows[0]["per_replica"]):
            return rows[0]["per_replica"]
        if time.monotonic() > deadline:
            raise AssertionError(f"replicas did not finish loading {identity!r}: {rows}")
        time.sleep(0.01)


def load_full(emu: HotLoadEmulator, client: HotLoadClient, identity: str, seed: int = 0) -> dict[str, Any]:
    model = tiny_model(seed)
    write_full_snapshot(emu.bucket, identity, model)
    client.signal(identity)
    client.wait_ready(identity, timeout_s=30)
    return model


# ------------------------------------------------------------------------------------------------ happy path


def test_full_then_delta_load_serves_exact_bytes(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    m1 = load_full(emulator, client, "step-1")
    assert served(emulator) == [("step-1", digest_map(m1))] * 2
    tensors = emulator.state()["deployments"][DEP]["replicas"][0]["tensors"]
    assert tensors["model.norm.weight"]["dtype"] == "bfloat16" and tensors["model.norm.weight"]["shape"] == [8]

    m2 = perturb(m1, seed=1)
    assert digest_map(m2) != digest_map(m1)
    write_delta_snapshot(emulator.bucket, "step-2", "step-1", m1, m2)
    client.signal("step-2", previous_identity="step-1", reset_prompt_cache="new_session")
    st = client.wait_ready("step-2", timeout_s=30)
    assert [r.loading_state.stage for r in st.replicas if r.loading_state] == ["done", "done"]
    assert served(emulator) == [("step-2", digest_map(m2))] * 2

    m3 = perturb(m2, seed=2)
    write_delta_snapshot(emulator.bucket, "step-3", "step-2", m2, m3)
    client.signal("step-3", previous_identity="step-2")
    client.wait_ready("step-3", timeout_s=30)
    assert served(emulator) == [("step-3", digest_map(m3))] * 2

    ledger = emulator.state()["deployments"][DEP]["ledger"]
    assert [(r["identity"], r["kind"], r["previous"]) for r in ledger] == [
        ("step-1", "full", None), ("step-2", "delta", "step-1"), ("step-3", "delta", "step-2")]
    assert ledger[1]["reset_prompt_cache"] == "new_session"
    assert all(p["stage"] == "done" and p["ready_at"] for r in ledger for p in r["per_replica"])
    code, body = raw(emulator, "GET", "/emulator/v1/state")
    assert code == 200 and body == json.loads(json.dumps(emulator.state()))


def test_status_shape_and_idempotent_resignal(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    code, body = raw(emulator, "GET", "/hot_load/v1/models/hot_load")
    assert code == 200
    st = HotLoadStatus.model_validate(body)
    assert len(st.replicas) == 2 and st.replicas[0].current_snapshot_identity is None
    load_full(emulator, client, "step-1")
    assert raw(emulator, "POST", "/hot_load/v1/models/hot_load", {"identity": "step-1"}) == (200, {"status": "ok"})
    assert len(emulator.state()["deployments"][DEP]["ledger"]) == 1
    code, body = raw(emulator, "GET", "/v1/accounts?pageSize=2")
    assert code == 200 and body == {"accounts": [{"name": "accounts/emulator"}]}


# ------------------------------------------------------------------------------------------------ validation


def test_unknown_field_is_rejected_pydantic_style(emulator: HotLoadEmulator) -> None:
    code, body = raw(emulator, "POST", "/hot_load/v1/models/hot_load", {"identity": "s1", "bogus": True})
    assert code == 400
    assert body["error"]["message"] == "Extra inputs are not permitted, field: 'bogus', value: True"
    code, body = raw(emulator, "POST", "/hot_load/v1/models/hot_load",
                     {"identity": "s2", "incremental_snapshot_metadata": {
                         "previous_snapshot_identity": "s1", "compression_format": "arc_v2"}})
    assert code == 400 and "incremental_snapshot_metadata.checksum_format" in body["error"]["message"]
    for bad in ([1, 2], {"identity": "a/b"}, {"identity": ""}, {"identity": "s", "reset_prompt_cache": "some"}):
        code, body = raw(emulator, "POST", "/hot_load/v1/models/hot_load", bad)
        assert code == 400, bad
    # reset_prompt_cache is accepted both as the documented enum and as the SDK's bool
    write_full_snapshot(emulator.bucket, "s1", tiny_model(0))
    code, _ = raw(emulator, "POST", "/hot_load/v1/models/hot_load", {"identity": "s1", "reset_prompt_cache": True})
    assert code == 200


def test_headers_are_required_and_model_must_match(emulator: HotLoadEmulator) -> None:
    code, body = raw(emulator, "GET", "/hot_load/v1/models/hot_load", headers={"fireworks-deployment": None})
    assert code == 400 and "fireworks-deployment" in body["error"]["message"]
    code, body = raw(emulator, "GET", "/hot_load/v1/models/hot_load", headers={"fireworks-model": None})
    assert code == 400 and "fireworks-model" in body["error"]["message"]
    assert raw(emulator, "GET", "/hot_load/v1/models/hot_load")[0] == 200
    code, body = raw(emulator, "GET", "/hot_load/v1/models/hot_load",
                     headers={"fireworks-model": "accounts/acct/models/other"})
    assert code == 400 and "does not match" in body["error"]["message"]


def test_auth_is_checked(emulator: HotLoadEmulator) -> None:
    with pytest.raises(HotLoadError) as info:
        client_for(emulator, api_key="wrong-key").signal("s1")
    assert info.value.status_code == 401 and "wrong-key" not in str(info.value)
    assert raw(emulator, "GET", "/emulator/v1/state", auth=False)[0] == 401


def test_delta_parent_rules(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    m1 = load_full(emulator, client, "step-1")
    m2 = perturb(m1, seed=1)
    write_delta_snapshot(emulator.bucket, "step-2", "step-1", m1, m2)
    with pytest.raises(HotLoadError, match="not in the ledger") as info:
        client.signal("step-2", previous_identity="step-0")
    assert info.value.status_code == 400
    code, body = raw(emulator, "POST", "/hot_load/v1/models/hot_load", {
        "identity": "step-2", "incremental_snapshot_metadata": {
            "previous_snapshot_identity": "step-1", "compression_format": "zstd", "checksum_format": "alder32"}})
    assert code == 400 and "compression_format" in body["error"]["message"]
    load_full(emulator, client, "step-3", seed=3)
    # step-1 is in the ledger but no longer served
    with pytest.raises(HotLoadError, match="not the snapshot the replicas serve"):
        client.signal("step-2", previous_identity="step-1")


def test_reused_identity_conflicts(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    load_full(emulator, client, "step-1")
    load_full(emulator, client, "step-2", seed=2)
    with pytest.raises(HotLoadError) as info:
        client.signal("step-1")
    assert info.value.status_code == 409 and "new identity" in str(info.value)


def test_delta_after_ledger_reset_is_rejected(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    m1 = load_full(emulator, client, "step-1")
    write_delta_snapshot(emulator.bucket, "step-2", "step-1", m1, perturb(m1, seed=1))
    client.reset_ledger()
    state = emulator.state()["deployments"][DEP]
    assert state["ledger"] == [] and [r["identity"] for r in state["replicas"]] == [None, None]
    with pytest.raises(HotLoadError, match="ledger is empty") as info:
        client.signal("step-2", previous_identity="step-1")
    assert info.value.status_code == 400
    m3 = load_full(emulator, client, "step-3", seed=3)
    assert served(emulator) == [("step-3", digest_map(m3))] * 2


def test_ledger_reset_cancels_an_in_flight_load(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    write_full_snapshot(emulator.bucket, "step-1", tiny_model(0))
    emulator.set_load_delay(600)
    client.signal("step-1")
    client.reset_ledger()
    emulator.set_load_delay(0)
    m2 = load_full(emulator, client, "step-2", seed=2)
    state = emulator.state()["deployments"][DEP]
    assert [r["identity"] for r in state["ledger"]] == ["step-2"]
    assert served(emulator) == [("step-2", digest_map(m2))] * 2


# ----------------------------------------------------------------------------------- injected faults and delays


def test_fail_next_loads_on_one_replica(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    emulator.fail_next_loads(1, replica=1)
    model = tiny_model(0)
    write_full_snapshot(emulator.bucket, "step-1", model)
    client.signal("step-1")
    with pytest.raises(HotLoadError, match=r"replica\(s\) 1:.*injected fault"):
        client.wait_ready("step-1", timeout_s=30)
    assert [p["stage"] for p in settle(emulator, "step-1")] == ["done", "error"]
    assert [i for i, _ in served(emulator)] == ["step-1", None]
    # a delta needs every replica on its parent; the recovery is a new full snapshot
    m2 = perturb(model, seed=1)
    write_delta_snapshot(emulator.bucket, "step-2", "step-1", model, m2)
    with pytest.raises(HotLoadError, match="not the snapshot the replicas serve"):
        client.signal("step-2", previous_identity="step-1")
    load_full(emulator, client, "step-3", seed=3)
    assert [i for i, _ in served(emulator)] == ["step-3", "step-3"]


def test_fail_next_loads_counts_per_deployment(emulator: HotLoadEmulator) -> None:
    """One emulator serves several deployments: "every replica" means every replica of each of them (the counters
    were keyed by replica alone, so whichever deployment loaded first took the one failure), and ``deployment=``
    names one."""
    us, eu = client_for(emulator, deployment_id="us"), client_for(emulator, deployment_id="eu")
    emulator.fail_next_loads(1)  # before any request named them: each fails its first load
    for identity, seed in (("step-1", 1), ("step-2", 2), ("step-3", 3)):
        write_full_snapshot(emulator.bucket, identity, tiny_model(seed))

    def outcome(client: HotLoadClient, identity: str) -> str:
        client.signal(identity)
        try:
            client.wait_ready(identity, timeout_s=30)
            return "ready"
        except HotLoadError as exc:
            assert "injected fault" in str(exc)
            return "failed"

    assert [outcome(us, "step-1"), outcome(eu, "step-1")] == ["failed", "failed"]
    assert [outcome(us, "step-2"), outcome(eu, "step-2")] == ["ready", "ready"]
    emulator.fail_next_loads(1, deployment="accounts/acct/deployments/eu")
    assert [outcome(us, "step-3"), outcome(eu, "step-3")] == ["ready", "failed"]
    with pytest.raises(ValueError, match="deployment must be a name"):
        emulator.fail_next_loads(1, deployment="eu")


def test_one_deployments_manager_and_load_delay(emulator: HotLoadEmulator) -> None:
    """``set_manager_up`` and ``set_load_delay(deployment=)`` act on one deployment, also before any request named
    it: its GET reports no replica and its signal is refused (503, counted as premature) while the other's is not,
    and its loads take the delay set for it."""
    us, eu = client_for(emulator, deployment_id="us"), client_for(emulator, deployment_id="eu")
    name = "accounts/acct/deployments/eu"
    emulator.set_manager_up(False, name)
    emulator.set_load_delay(1.5, deployment=name)
    write_full_snapshot(emulator.bucket, "step-1", tiny_model(1))
    assert us.status().replicas and not eu.status().replicas
    # One request, not the client's retries until a 0.5 s deadline: on a loaded CI the first attempt's answer
    # outlasted that deadline, and the call ended in a timeout with no status.
    code, _ = raw(emulator, "POST", "/hot_load/v1/models/hot_load", {"identity": "step-1"},
                  headers={"fireworks-deployment": name})
    assert code == 503 and emulator.state()["deployments"][name]["premature_signals"] == 1
    emulator.set_manager_up(True, name)
    took = []
    for client in (us, eu):
        t0 = time.monotonic()
        client.signal("step-1")
        client.wait_ready("step-1", timeout_s=30)
        took.append(time.monotonic() - t0)
    assert took[0] < 1.5 <= took[1], took
    with pytest.raises(ValueError, match="deployment must be a name"):
        emulator.set_manager_up(True, "eu")


def test_reject_next_signals_is_retried_by_the_client(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    emulator.reject_next_signals(2, status=503, message="warming up")
    load_full(emulator, client, "step-1")
    assert [i for i, _ in served(emulator)] == ["step-1", "step-1"]
    emulator.reject_next_signals(1, status=403, message="forbidden here")
    with pytest.raises(HotLoadError, match="forbidden here"):
        client.signal("step-2")


def test_load_delay_shows_in_flight_state(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    write_full_snapshot(emulator.bucket, "step-1", tiny_model(0))
    emulator.set_load_delay(600)  # held until released below
    client.signal("step-1")
    first = client.status()
    assert not first.is_ready("step-1")
    assert {r.target for r in first.replicas} == {"step-1"}
    assert {r.stage for r in first.replicas} <= {"pending", "downloading"}
    assert all(r.readiness and r.current_snapshot_identity is None for r in first.replicas)
    with pytest.raises(HotLoadTimeout, match="within 0.1s"):
        client.wait_ready("step-1", timeout_s=0.1)
    emulator.set_load_delay(0)
    assert client.wait_ready("step-1", timeout_s=30).is_ready("step-1")


def test_hint_is_recorded(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    client.hint("step-1", "model-00001.safetensors")
    code, body = raw(emulator, "POST", "/hot_load/v1/models/hot_load/hint",
                     {"snapshot": {"identity": "step-1"}, "filename": "x", "extra": 1})
    assert code == 400 and "field: 'extra'" in body["error"]["message"]
    state = emulator.state()["deployments"][DEP]
    assert [(h["identity"], h["filename"], h["file_present"]) for h in state["hints"]] == \
        [("step-1", "model-00001.safetensors", False)]  # taken, and counted: a publisher hints durable files only
    assert state["hints_before_file"] == 1
    write_full_snapshot(emulator.bucket, "step-1", tiny_model(0))
    client.hint("step-1", "model-00001.safetensors")
    assert emulator.state()["deployments"][DEP]["hints"][-1]["file_present"] is True


def test_history_is_bounded_but_identities_are_never_forgotten(tmp_path: Path) -> None:
    """A long-running emulator keeps only the newest ledger rows and hints; an identity whose row was dropped is
    still refused when reused, and a delta on the served snapshot is still accepted."""
    with HotLoadEmulator(str(tmp_path), replicas=1, api_key=EMULATOR_API_KEY, history_limit=3) as emu:
        client = client_for(emu)
        for i in range(5):
            model = load_full(emu, client, f"step-{i}", seed=i)
            client.hint(f"step-{i}", "model-00001.safetensors")
        state = emu.state()["deployments"][DEP]
        assert [r["identity"] for r in state["ledger"]] == ["step-2", "step-3", "step-4"]
        assert [h["identity"] for h in state["hints"]] == ["step-2", "step-3", "step-4"]
        with pytest.raises(HotLoadError) as info:
            client.signal("step-0")
        assert info.value.status_code == 409
        write_delta_snapshot(emu.bucket, "step-5", "step-4", model, perturb(model, seed=5))
        client.signal("step-5", previous_identity="step-4")
        client.wait_ready("step-5", timeout_s=30)
        assert [r["identity"] for r in emu.state()["deployments"][DEP]["ledger"]] == ["step-3", "step-4", "step-5"]
    with pytest.raises(ValueError, match="history_limit"):
        HotLoadEmulator(str(tmp_path), history_limit=0)


def test_base_config_comparison(tmp_path: Path) -> None:
    base = dict(CONFIG, hidden_size=16)
    with HotLoadEmulator(str(tmp_path), replicas=1, api_key=EMULATOR_API_KEY, base_config=base) as emu:
        client = client_for(emu)
        write_full_snapshot(tmp_path, "step-1", tiny_model(0))
        client.signal("step-1")
        with pytest.raises(HotLoadError, match="Config value mismatch for hidden_size"):
            client.wait_ready("step-1", timeout_s=30)
        write_full_snapshot(tmp_path, "step-2", tiny_model(0))
        client.signal("step-2", validation={"extra_fields_ignore": ["hidden_size"]})
        client.wait_ready("step-2", timeout_s=30)


def test_without_a_base_config_the_first_served_snapshot_stands_in_for_it(tmp_path: Path) -> None:
    """On Fireworks the first snapshot passing the comparison means the base's config equals it, so a later one
    whose config differs is refused; without base_config the emulator compared nothing and served it."""
    with HotLoadEmulator(str(tmp_path), replicas=2, api_key=EMULATOR_API_KEY) as emu:
        client = client_for(emu)
        write_full_snapshot(tmp_path, "step-1", tiny_model(0))
        client.signal("step-1")
        client.wait_ready("step-1", timeout_s=30)
        folder = write_full_snapshot(tmp_path, "step-2", perturb(tiny_model(0), seed=2))
        (folder / "config.json").write_text(json.dumps(dict(CONFIG, hidden_size=4096)))
        client.signal("step-2")
        with pytest.raises(HotLoadError, match="Config value mismatch for hidden_size"):
            client.wait_ready("step-2", timeout_s=30)
        write_full_snapshot(tmp_path, "step-3", perturb(tiny_model(0), seed=3))  # the first one's config
        client.signal("step-3")
        client.wait_ready("step-3", timeout_s=30)


def test_reads_snapshots_from_s3(tmp_path: Path, s3_server: Any) -> None:
    from fsdp_hotload.storage import Storage

    uri = s3_server.unique_uri("emulator")
    store = Storage(uri, s3_server.storage_options)
    m1 = tiny_model(0)
    m2 = perturb(m1, seed=1)
    for ident, folder in (("step-1", write_full_snapshot(tmp_path, "step-1", m1)),
                          ("step-2", write_delta_snapshot(tmp_path, "step-2", "step-1", m1, m2))):
        store.put_many({f"{ident}/{f.name}": f.read_bytes() for f in folder.iterdir()})
    with HotLoadEmulator(uri, storage_options=s3_server.storage_options, replicas=1,
                         api_key=EMULATOR_API_KEY) as emu:
        client = client_for(emu, retry_budget_s=60)  # the emulator's first S3 access answers this signal
        client.signal("step-1")
        client.wait_ready("step-1", timeout_s=60)
        client.signal("step-2", previous_identity="step-1")
        client.wait_ready("step-2", timeout_s=60)
        assert served(emu) == [("step-2", digest_map(m2))]


def test_cli_serves_until_interrupted(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from fsdp_hotload.emulator import run_emulator_cli; "
                               "sys.exit(run_emulator_cli(sys.argv[1:]))", "--bucket", str(tmp_path),
         "--replicas", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = line.split("listening on ")[1].split()[0]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/v1/accounts?pageSize=2", headers={"Authorization": "Bearer any-key"})
        assert json.loads(conn.getresponse().read()) == {"accounts": [{"name": "accounts/emulator"}]}
        conn.close()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ledger_of_an_unknown_deployment_creates_nothing(emulator: HotLoadEmulator) -> None:
    for i in range(3):
        code, body = raw(emulator, "GET", f"/v1/accounts/acct/deployments/ghost-{i}/ledger")
        assert code == 404 and f"ghost-{i}" in body["error"]["message"]
        assert raw(emulator, "DELETE", f"/v1/accounts/acct/deployments/ghost-{i}/ledger") == (200, {})
    assert emulator.state()["deployments"] == {}
    load_full(emulator, client_for(emulator), "step-1")
    code, body = raw(emulator, "GET", "/v1/accounts/acct/deployments/dep/ledger")
    assert code == 200 and [r["identity"] for r in body["ledger"]] == ["step-1"]


def test_emulator_state_docstring_example_runs(tmp_path: Path) -> None:
    from fsdp_hotload.fireworks_models import HotLoadRequest
    from fsdp_hotload.storage import Storage

    model = tiny_model(0)
    write_full_snapshot(tmp_path, "step-1", model)
    example = textwrap.dedent(emulator_state.__doc__.split("Example::", 1)[1])
    scope = {"EmulatorSettings": emulator_state.EmulatorSettings, "Deployment": emulator_state.Deployment,
             "HotLoadRequest": HotLoadRequest, "Storage": Storage, "time": time, "bucket": str(tmp_path)}
    exec(compile(example, "emulator_state docstring", "exec"), scope)
    rep = scope["dep"].replicas[0]
    assert rep.current == "step-1" and {n: t["digest"] for n, t in rep.summary.items()} == digest_map(model)


def test_a_delta_must_follow_the_load_queued_before_it(emulator: HotLoadEmulator) -> None:
    """"The snapshot the deployment serves immediately before this load": with a full load still queued, a delta
    against the snapshot served now is refused at POST (it used to be accepted, then fail on every replica)."""
    client = client_for(emulator)
    m1 = load_full(emulator, client, "step-1")
    write_full_snapshot(emulator.bucket, "step-2", perturb(m1, seed=2))
    write_delta_snapshot(emulator.bucket, "step-3", "step-1", m1, perturb(m1, seed=3))
    emulator.set_load_delay(600)
    client.signal("step-2")
    with pytest.raises(HotLoadError, match="loaded just before this one") as info:
        client.signal("step-3", previous_identity="step-1")
    assert info.value.status_code == 400
    emulator.set_load_delay(0)
    assert client.wait_ready("step-2", timeout_s=30).is_ready("step-2")


def test_signals_wait_for_the_hot_load_manager(tmp_path: Path) -> None:
    """A new deployment reports no replicas until its hot-load manager is up, and refuses (counts) signals and
    hints until then. The publisher polls first: its signal arrives once replicas are reported, never before, and
    the first snapshot's hints (sent as files land, before rank 0 waits for the manager) are left out."""
    from fsdp_hotload.publish import TensorPublisher
    from tests.publisher_helpers import API_KEY, config, expected_sha, make_model, served, train_step

    bucket = str(tmp_path / "bucket")
    with HotLoadEmulator(bucket, replicas=2, api_key=API_KEY, manager_delay_s=0.6) as emu:
        model = make_model()
        with TensorPublisher(model, config(bucket, emu, tmp_path)) as pub:
            pub.publish(0, model)
            pub.wait()
            first = pub.metrics[-1].identity
            train_step(model, 1)
            pub.publish(1, model)
            pub.wait()
        assert [m.ok for m in pub.metrics] == [True, True]
        assert served(emu) == [(pub.metrics[-1].identity, expected_sha(model))] * 2
        (dep,) = emu.state()["deployments"].values()
        assert dep["premature_signals"] == 0 and dep["premature_hints"] == 0 and dep["hints_before_file"] == 0
        assert dep["hints"] and all(h["file_present"] for h in dep["hints"])  # each hint follows its file's upload
        assert [r["identity"] for r in dep["ledger"]] == [first, pub.metrics[-1].identity]
        hinted = {h["identity"] for h in dep["hints"]}
        assert hinted == {pub.metrics[-1].identity}  # hints resume once the manager is known to be up
        with pytest.raises(HotLoadTimeout, match="reported no replica"):
            HotLoadClient(emu.url, account_id="acct", model_id="m", deployment_id="other", api_key=API_KEY,
                          poll_interval_s=0.05).wait_manager(timeout_s=0.2)
        with pytest.raises(HotLoadError, match="not initialised") as info:  # what an early signal gets
            HotLoadClient(emu.url, account_id="acct", model_id="m", deployment_id="late", api_key=API_KEY,
                          retry_budget_s=0).signal("step-000000-aaaaaaaa")
        assert info.value.status_code == 503
        assert emu.state()["deployments"]["accounts/acct/deployments/late"]["premature_signals"] == 1


def test_a_delta_on_a_parent_still_loading_is_refused(emulator: HotLoadEmulator) -> None:
    """"previous_snapshot_identity must match the snapshot currently served" (Fireworks' delta docs): a delta
    signalled while its parent was still loading was queued behind it, so a client that sent deltas early passed
    here and would fail on Fireworks. Once the parent is served everywhere the same delta is taken."""
    client = client_for(emulator)
    m1 = load_full(emulator, client, "step-1")
    write_full_snapshot(emulator.bucket, "step-2", m1)  # same bytes as step-1, another identity
    m3 = perturb(m1, seed=3)
    write_delta_snapshot(emulator.bucket, "step-3", "step-2", m1, m3)
    emulator.set_load_delay(600)
    client.signal("step-2")
    with pytest.raises(HotLoadError, match=r"previous_snapshot_identity 'step-2' is not the snapshot the replicas "
                                           r"serve \(\['step-1', 'step-1'\]\); wait until it is served") as info:
        client.signal("step-3", previous_identity="step-2")
    assert info.value.status_code == 400
    emulator.set_load_delay(0)
    settle(emulator, "step-2")
    client.signal("step-3", previous_identity="step-2")
    settle(emulator, "step-3")
    assert served(emulator) == [("step-3", digest_map(m3))] * 2
