"""The signaller drives several deployments at once, against a real HTTP server that sees the overlap."""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from fsdp_hotload.engine.signal import NotSignalled, Signaller
from fsdp_hotload.fireworks import HotLoadClient
from tests.http_fixture import serve

DEPLOYMENTS = ("d1", "d2", "d3")


class Fleet:
    """Each POST is held until every deployment's POST has arrived (or 3 s pass): signals sent one after another
    would each wait out the hold, signals sent together pass at once (``expect``: how many are signalled).
    ``refuse`` names deployments answered 409; ``down`` those that report no replica (a manager not up)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.arrived: dict[str, int] = {}  # identity -> POSTs seen
        self.most_at_once = 0
        self.in_flight = 0
        self.serving: dict[str, str] = {}
        self.refuse: set[str] = set()
        self.down: set[str] = set()
        self.stuck: set[str] = set()  # their replicas never report what they were signalled
        self.expect = len(DEPLOYMENTS)
        self.gets: dict[str, int] = {}  # status requests per deployment
        self.while_down: list[tuple[str, str]] = []  # (deployment, identity) signalled while down or failing
        self.loading: dict[str, tuple[str, str, str]] = {}  # deployment -> (what its replicas serve, load, stage)
        self.flip: dict[str, int] = {}  # deployment -> parity: its status lists a replica on requests of that parity
        self.reject: set[str] = set()  # each answered HTTP 400 once (refused: never taken)
        self.failing: set[str] = set()  # every request answered HTTP 503 (a gateway before a restarting container)
        self.on_get: Callable[[str, bool], None] | None = None  # (deployment, up): after the answer is decided

    def post(self, deployment: str, identity: str) -> int:
        with self.cond:
            self.in_flight += 1
            self.most_at_once = max(self.most_at_once, self.in_flight)
            self.arrived[identity] = self.arrived.get(identity, 0) + 1
            if deployment in self.down or deployment in self.failing:
                self.while_down.append((deployment, identity))
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.arrived[identity] >= self.expect, timeout=3)
            self.in_flight -= 1
            if deployment in self.failing:
                return 503
            if deployment in self.reject:
                self.reject.discard(deployment)
                return 400
            if deployment in self.refuse:
                return 409
            self.serving[deployment] = identity
            return 200


def fleet_clients(url: str, poll_interval_s: float = 0.02) -> list[HotLoadClient]:
    """One client per deployment of the fleet, polling fast."""
    return [HotLoadClient(url, account_id="a", model_id="m", deployment_id=d, api_key="k",
                          poll_interval_s=poll_interval_s, retry_budget_s=5) for d in DEPLOYMENTS]


@pytest.fixture
def fleet() -> Iterator[tuple[str, Fleet]]:
    state = Fleet()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            deployment = self.headers["fireworks-deployment"].rsplit("/", 1)[-1]
            status = state.post(deployment, body["identity"])
            self._reply(status, {"status": "ok"} if status == 200 else {"error": {"message": "refused"}})

        def do_GET(self) -> None:  # noqa: N802
            deployment = self.headers["fireworks-deployment"].rsplit("/", 1)[-1]
            state.gets[deployment] = state.gets.get(deployment, 0) + 1
            if deployment in state.failing:
                return self._reply(503, {"error": {"message": "restarting"}})
            if deployment in state.flip:
                up = state.gets[deployment] % 2 == state.flip[deployment]
                (state.down.discard if up else state.down.add)(deployment)
            up = deployment not in state.down
            if state.on_get is not None:
                state.on_get(deployment, up)
            current = None if deployment in state.stuck else state.serving.get(deployment)
            loading = {"stage": "done"}
            if deployment in state.loading:
                current, target, stage = state.loading[deployment]
                loading = {"stage": stage, "target_snapshot_identity": target}
            self._reply(200, {"replicas": [] if not up else [
                {"current_snapshot_identity": current, "readiness": True, "loading_state": loading}]})

        def log_message(self, *args: Any) -> None:
            pass

    with serve(Handler) as url:
        yield url, state


def test_deployments_are_signalled_at_once_and_each_failure_is_named(fleet: tuple[str, Fleet]) -> None:
    """One deployment after another, N stalled signals take N retry budgets, which can outlast the side group's
    timeout the other ranks wait under; at once they take one."""
    url, state = fleet
    clients = fleet_clients(url)
    sig = Signaller(clients, ready_timeout_s=10)
    try:
        t0 = time.monotonic()
        sig.signal_and_wait("s1", None)
        assert state.most_at_once == len(DEPLOYMENTS) and time.monotonic() - t0 < 3
        assert sig.served == {f"accounts/a/deployments/{d}": "s1" for d in DEPLOYMENTS}

        state.refuse = {"d2"}
        with pytest.raises(RuntimeError, match=r"^accounts/a/deployments/d2: .*refused") as info:
            sig.signal_and_wait("s2", "s1")
        assert "d1" not in str(info.value) and "d3" not in str(info.value)
        assert state.serving == {"d1": "s2", "d2": "s1", "d3": "s2"}  # the others were signalled all the same
        with pytest.raises(RuntimeError, match="serves 's1', not the delta's parent 's2'"):
            sig.signal_and_wait("s3", "s2")  # d1 and d3 accepted s2 but were not waited for: a full is needed
        assert state.arrived.get("s3") is None, "no deployment is signalled when any chain is broken"
    finally:
        sig.close()


def test_a_snapshot_replicas_still_load_when_a_wait_ends_is_kept_for_them(fleet: tuple[str, Fleet]) -> None:
    """Slow loads queue up: when s3's wait ends, d3's replicas serve s1 and still load s2, and may serve it next.
    :meth:`Signaller.may_serve`, which retention spares, must hold s2: it used to hold what they served and s3
    only, and ``keep_last=1`` deleted s2 under the download (the replicas' load of it failed)."""
    url, state = fleet
    clients = fleet_clients(url)
    sig = Signaller(clients, ready_timeout_s=0.3)
    try:
        sig.signal_and_wait("s1", None)
        state.loading = {"d3": ("s1", "s2", "downloading")}
        for identity, previous in (("s2", "s1"), ("s3", None)):
            with pytest.raises(RuntimeError, match="d3.*not served by every replica"):
                sig.signal_and_wait(identity, previous)
        assert sig.may_serve() >= {"s1", "s2", "s3"}
        state.loading = {"d3": ("s1", "s3", "error")}  # a load that failed will not end in s3
        with pytest.raises(RuntimeError, match="d3.*not served by every replica"):
            sig.signal_and_wait("s4", None)
        assert sig.may_serve() == {"s1", "s4"}
    finally:
        sig.close()


def test_a_manager_whose_status_flips_between_up_and_down_fails_the_wait_in_a_few_rounds(
        fleet: tuple[str, Fleet]) -> None:
    """Answers that alternate (a gateway in front of one good backend and one restarting) made the wait for the
    managers ask again and wait again until its deadline, hundreds of status requests a second. It gives up after
    one round per deployment (with "all" nobody is signalled then). Whether the two ever read as up at once depends
    on when each is asked, so the wait may also end early: what is bounded is the number of requests, each wait
    reading at most 2 statuses and each re-read 1."""
    url, state = fleet
    clients = fleet_clients(url, poll_interval_s=1e-4)
    sig = Signaller(clients, ready_timeout_s=10)
    state.flip = {"d1": 1, "d2": 0}  # out of step: each is found down while the other is waited for
    try:
        t0 = time.monotonic()
        try:
            sig.signal_and_wait("s1", None)
        except NotSignalled as exc:
            assert "stopped reporting a replica while another was waited for" in str(exc)
            assert state.arrived == {}
        rounds = len(DEPLOYMENTS) + 1
        assert time.monotonic() - t0 < 5 and state.gets["d1"] + state.gets["d2"] <= 2 * rounds * (2 + 1), state.gets
    finally:
        sig.close()


@pytest.mark.parametrize("required", ["all", "any"])
def test_a_manager_that_goes_down_while_another_is_waited_for_is_waited_for_too(
        fleet: tuple[str, Fleet], required: str) -> None:
    """A manager that is down is waited for before anyone is signalled (with "all" at every snapshot, with "any"
    at the first), which can take minutes; another may go down meanwhile (a rolling restart: d3 comes back as d2
    goes). The status is read again after that wait, and d2 is waited for too: no signal reaches a manager that
    lists no replica."""
    url, state = fleet
    clients = fleet_clients(url)
    sig = Signaller(clients, ready_timeout_s=10, require_all=required == "all")

    def after_gets(deployment: str, more: int) -> None:
        seen = state.gets.get(deployment, 0)
        deadline = time.monotonic() + 5
        while state.gets.get(deployment, 0) < seen + more and time.monotonic() < deadline:
            time.sleep(0.005)

    def roll() -> None:
        after_gets("d3", 3)  # asked before the signal (or waited for from the first), then waited for
        state.down = {"d2"}
        after_gets("d2", 3)  # asked again after d3's wait, then waited for
        state.down = set()

    try:
        previous = None
        if required == "all":
            sig.signal_and_wait("s1", None)
            previous = "s1"
        state.down = {"d3"}
        rolling = threading.Thread(target=roll)
        rolling.start()
        sig.signal_and_wait("s2", previous)
        rolling.join()
        assert state.while_down == []
        assert state.serving == {d: "s2" for d in DEPLOYMENTS}
        assert state.arrived == ({"s1": 3} if previous else {}) | {"s2": 3}
    finally:
        sig.close()


def test_with_any_a_deployment_whose_manager_is_down_costs_the_others_one_wait(
        fleet: tuple[str, Fleet], caplog: pytest.LogCaptureFixture) -> None:
    """deployments_required="all" waits for every manager at each snapshot and signals none while one is down.
    With "any" the first snapshot waits for them (at most the manager wait, here ready_timeout_s), then goes on
    with those up; later deltas leave the one that is down out without asking, and each full asks it once. Its
    catch-up asks it once after each publish, off the publisher's thread, and once it is up, brings it to the
    newest snapshot: the next delta is signalled to it too."""
    url, state = fleet
    state.down, state.expect = {"d3"}, 2
    clients = fleet_clients(url)
    d3 = "accounts/a/deployments/d3"
    strict = Signaller(clients, ready_timeout_s=0.5)
    with pytest.raises(NotSignalled, match="d3.*no replica"):
        strict.signal_and_wait("s0", None)
    assert state.arrived == {}  # nobody was signalled
    strict.close()

    clients = fleet_clients(url)
    sig = Signaller(clients, ready_timeout_s=1.0, require_all=False)

    def timed(identity: str, previous: str | None) -> float:
        t0 = time.monotonic()
        sig.signal_and_wait(identity, previous)
        return time.monotonic() - t0

    try:
        with caplog.at_level(logging.INFO, logger="fsdp_hotload"):
            assert timed("s1", None) >= 0.9  # the manager wait, once
            assert state.serving == {"d1": "s1", "d2": "s1"} and list(sig.behind) == [d3]
            assert sig.drain(5)  # its catch-up asked once, and stopped
            asked = state.gets["d3"]
            assert timed("s2", "s1") < 0.5 and sig.drain(5) and state.gets["d3"] == asked + 1  # its catch-up only
            assert timed("s3", None) < 0.5 and sig.drain(5) and state.gets["d3"] == asked + 3  # the publish, once
            state.down = set()
            assert timed("s4", "s3") < 0.5 and "d3" not in state.serving and list(sig.behind) == [d3]
            assert sig.drain(5) and state.serving["d3"] == "s4"  # its catch-up found it up: s3, then s4
            assert [n for i, n in sorted(state.arrived.items())] == [2, 2, 3, 3]  # d3 got s3 and s4, once each
            state.expect = 3
            timed("s5", "s4")
        assert state.serving == {"d1": "s5", "d2": "s5", "d3": "s5"} and sig.behind == {}
        assert sig.may_serve() == {"s5"} and sig.not_serving("s5") == []
        told = [r.getMessage() for r in caplog.records if "d3" in r.getMessage()]
        assert sum("does not serve s1" in t for t in told) == 1 and not any("does not serve s2" in t for t in told)
        assert any("d3 serves s5: it is no longer behind" in t for t in told)
    finally:
        sig.close()


@pytest.mark.parametrize("down", ["no replica", "503"])
def test_with_any_a_catch_up_that_found_its_manager_down_is_asked_again_before_a_snapshot_joins_it(
        fleet: tuple[str, Fleet], down: str) -> None:
    """With "any", a full snapshot signals a deployment that is catching up once its catch-up's load ends. Its
    manager may have gone down during that load (the container restarts: its status lists no replica, or a gateway
    answers 503), and the signal went to it all the same. It is asked again first and left out; here nobody else is
    up, so nothing is sent and the snapshot fails as not signalled (retention may delete it at once)."""
    url, state = fleet
    sig = Signaller(fleet_clients(url), ready_timeout_s=2.0, require_all=False)
    d3_gets = 0

    def d2_goes_down() -> None:  # after s3 read d3's status twice (before its signal, then asked whether it is up)
        deadline = time.monotonic() + 5
        while state.gets["d3"] < d3_gets + 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        (state.down if down == "no replica" else state.failing).add("d2")

    try:
        sig.signal_and_wait("s1", None)
        state.reject, state.stuck = {"d2"}, {"d2"}  # d2 refuses s2; then its catch-up's load of s2 hangs
        sig.signal_and_wait("s2", "s1")
        deadline = time.monotonic() + 5
        while state.arrived["s2"] < 4 and time.monotonic() < deadline:  # the catch-up's signal
            time.sleep(0.005)
        assert state.arrived["s2"] == 4 and list(sig.behind) == ["accounts/a/deployments/d2"]
        state.down, d3_gets = {"d1", "d3"}, state.gets["d3"]  # s3 leaves them out, and joins d2's catch-up
        going = threading.Thread(target=d2_goes_down)
        going.start()
        with pytest.raises(NotSignalled, match=r"^accounts/a/deployments/d2: its (hot-load manager went down|status)"):
            sig.signal_and_wait("s3", None)
        going.join()
        assert state.while_down == [] and "s3" not in state.arrived and "s3" not in sig.may_serve()
        state.down, state.failing, state.stuck, state.expect = set(), set(), set(), 2
        sig.signal_and_wait("s4", None)  # d2's last load timed out: its catch-up signals it, after the publish
        assert sig.drain(10) and state.serving == {d: "s4" for d in DEPLOYMENTS} and state.while_down == []
    finally:
        sig.close()


def test_with_any_a_catch_ups_late_answer_up_does_not_undo_a_newer_down(fleet: tuple[str, Fleet]) -> None:
    """A catch-up first asks whether its deployment's manager is up. Where that answer ("up") arrives after the next
    publish read the manager down (its container restarted in between), the older answer must not count: the
    catch-up signalled the snapshot to a manager that lists no replica (a signal then can crash it)."""
    url, state = fleet
    sig = Signaller(fleet_clients(url), ready_timeout_s=2.0, require_all=False)
    armed, held, release = threading.Event(), threading.Event(), threading.Event()

    def on_get(deployment: str, up: bool) -> None:  # d2's catch-up is told "up"; its container restarts meanwhile
        if deployment == "d2" and up and armed.is_set():
            armed.clear()
            state.down.add("d2")
            held.set()
            release.wait(10)

    post = state.post

    def post_arming(deployment: str, identity: str) -> int:  # d2's next status request is its catch-up's
        status = post(deployment, identity)
        if (deployment, identity) == ("d2", "s2"):
            armed.set()
        return status

    state.on_get, state.post = on_get, post_arming  # type: ignore[method-assign]
    try:
        sig.signal_and_wait("s1", None)
        state.reject = {"d2"}
        sig.signal_and_wait("s2", "s1")  # d2 refuses s2: its catch-up starts
        assert held.wait(5)
        state.expect = 2
        sig.signal_and_wait("s3", None)  # d2 is read down, and left out
        assert state.serving == {"d1": "s3", "d2": "s1", "d3": "s3"}
        release.set()  # the catch-up's answer "up" arrives now
        assert sig.drain(10)
        assert state.while_down == [] and state.serving["d2"] == "s1"
        state.down, state.expect = set(), 3
        sig.signal_and_wait("s4", None)
        assert state.serving == {d: "s4" for d in DEPLOYMENTS} and state.while_down == []
    finally:
        release.set()
        sig.close()


def test_with_any_a_refused_deployment_is_left_out_of_the_deltas_until_the_next_full(
        fleet: tuple[str, Fleet]) -> None:
    url, state = fleet
    clients = fleet_clients(url)
    sig = Signaller(clients, ready_timeout_s=10, require_all=False)
    d2 = "accounts/a/deployments/d2"
    try:
        sig.signal_and_wait("s1", None)
        state.refuse = {"d2"}
        sig.signal_and_wait("s2", "s1")  # d2 refuses (409): the others serve s2
        assert state.serving == {"d1": "s2", "d2": "s1", "d3": "s2"} and list(sig.behind) == [d2]
        assert "its signal failed" in sig.behind[d2] and sig.not_serving("s2") == [d2]
        assert sig.may_serve() == {"s1", "s2"}  # a 409 may have been taken: d2 may load s2 yet
        state.refuse, state.expect = set(), 2
        sig.signal_and_wait("s3", "s2")
        assert state.arrived["s3"] == 2 and state.serving["d2"] == "s1"  # d2 serves none of this chain
        state.refuse = {"d1", "d3"}
        with pytest.raises(RuntimeError, match="d1.*d3"):  # every deployment signalled failed: the publish fails
            sig.signal_and_wait("s4", "s3")
        state.refuse, state.expect = set(), 3
        sig.signal_and_wait("s5", None)
        assert set(state.serving.values()) == {"s5"} and sig.behind == {}
    finally:
        sig.close()


def test_with_any_a_wait_cancelled_by_close_fails_the_snapshot(fleet: tuple[str, Fleet]) -> None:
    """close() gave up (cancel()) while d2 was still loading: the snapshot must not count as served by the quicker
    deployments, with d2 merely left behind."""
    url, state = fleet
    state.stuck = {"d2"}
    clients = fleet_clients(url)
    sig = Signaller(clients, ready_timeout_s=10, require_all=False)
    timer = threading.Timer(0.5, sig.cancel)
    timer.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="d2.*cancel"):
            sig.signal_and_wait("s1", None)
        assert time.monotonic() - t0 < 5 and sig.behind == {}
    finally:
        timer.cancel()
        sig.close()


@pytest.mark.parametrize("fault", ["no answer", "no replica"])
def test_with_any_a_delta_says_why_a_deployment_was_found_down(
        fleet: tuple[str, Fleet], caplog: pytest.LogCaptureFixture, fault: str) -> None:
    """d2 served s1, then its API takes requests and never answers (or its status lists no replica). The status
    request before s2's signal finds it down, and s2 leaves it out: the warning, Signaller.behind and the metrics
    said "its hot-load manager has not reported a replica yet", which sent the user after a manager that never
    came up rather than a region that stopped answering."""
    url, state = fleet
    state.expect = 2
    sig = Signaller(fleet_clients(url)[:2], ready_timeout_s=0.6, require_all=False)
    silent, release = threading.Event(), threading.Event()  # silent: d2's status requests get no answer
    state.on_get = lambda deployment, up: release.wait(5) if deployment == "d2" and silent.is_set() else None
    d2 = "accounts/a/deployments/d2"
    try:
        sig.signal_and_wait("s1", None)
        state.expect = 1
        if fault == "no answer":
            silent.set()
        else:
            state.down.add("d2")
        with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
            sig.signal_and_wait("s2", "s1")
        assert list(sig.behind) == [d2], sig.behind
        why = sig.behind[d2]
        assert "not reported a replica yet" not in why, why
        if fault == "no answer":
            assert "its status request failed" in why and "no answer" in why, why
        else:
            assert "it reports no replica now" in why, why
        assert why in caplog.text
        assert state.serving == {"d1": "s2", "d2": "s1"}
        if fault == "no answer":  # its catch-up's status request hangs too: closing cancels it before any load
            with caplog.at_level(logging.INFO, logger="fsdp_hotload"):
                sig.close(0.0)
                deadline = time.monotonic() + 5
                while "catch-up ended" not in caplog.text and time.monotonic() < deadline:
                    time.sleep(0.02)
            assert f"{d2}'s catch-up ended at its start: cancelled" in caplog.text, caplog.text
    finally:
        release.set()
        sig.close()


@pytest.mark.parametrize("fault", ["503", "no answer", "no answer before the others serve"])
def test_with_straggler_wait_s_a_region_whose_polls_fail_is_left_to_its_catch_up(
        fleet: tuple[str, Fleet], caplog: pytest.LogCaptureFixture, fault: str) -> None:
    """d2 takes s2's signal, then its gateway answers 503 (its container restarts), or, from 0.1 s later, does not
    answer, or stops answering at once while the others take 0.5 s to serve s2 (an attempt begun before the
    release).
    Its status poll's retries (1, 2, 4, 8 s apart within a 30 s budget), or an attempt waiting for an answer (up to
    that budget), must end once straggler_wait_s has passed since d1 served s2, not hold the publish, nor be told as
    a spent retry budget that calls for a full snapshot; its catch-up waits on and finds it serving s2 once the
    gateway is back."""
    url, state = fleet
    clients = [HotLoadClient(url, account_id="a", model_id="m", deployment_id=d, api_key="k", poll_interval_s=0.02,
                             retry_budget_s=30) for d in DEPLOYMENTS]  # min(300 s, ready_timeout_s): from_config's
    sig = Signaller(clients, ready_timeout_s=30, require_all=False, straggler_wait_s=0.2)
    post, back, silent_from = state.post, threading.Event(), [float("inf")]

    def post_then_fail(deployment: str, identity: str) -> int:
        status = post(deployment, identity)
        if (deployment, identity) == ("d2", "s2"):
            if fault == "503":
                state.failing.add("d2")
            else:  # loading (not serving it yet), then no answer: d1 serves s2 meanwhile
                state.stuck.add("d2")
                silent_from[0] = time.monotonic() + (0.1 if fault == "no answer" else 0.0)
        if deployment != "d2" and identity == "s2" and fault == "no answer before the others serve":
            state.stuck.add(deployment)
            threading.Timer(0.5, state.stuck.discard, (deployment,)).start()
        return status

    def silent(deployment: str, up: bool) -> None:
        if deployment == "d2" and time.monotonic() > silent_from[0]:
            back.wait(10)

    state.post, state.on_get = post_then_fail, silent  # type: ignore[method-assign]
    d2 = "accounts/a/deployments/d2"
    try:
        sig.signal_and_wait("s1", None)
        t0 = time.monotonic()
        with caplog.at_level(logging.INFO, logger="fsdp_hotload"):
            sig.signal_and_wait("s2", "s1")
        took = time.monotonic() - t0
        # 15 s (503) or 30 s (no answer) when the retries ignored straggler_wait_s; 10 s (d2's handler gives up
        # waiting) when an attempt begun before d1 and d3 served s2 was bounded only by its own timeout
        assert took < 3, took
        assert "retries ended when another deployment served the snapshot" in caplog.text
        assert not [r for r in caplog.records if "budget is spent" in r.getMessage()]
        assert list(sig.behind) == [d2] and "straggler_wait_s" in sig.behind[d2]
        assert sig.served == {f"accounts/a/deployments/{d}": "s2" if d != "d2" else "s1" for d in DEPLOYMENTS}
        state.failing.discard("d2")
        state.stuck.discard("d2")
        silent_from[0] = float("inf")
        back.set()
        assert sig.drain(10)
        assert sig.served[d2] == "s2" and state.arrived["s2"] == 3  # its catch-up did not signal it again
    finally:
        back.set()
        sig.close()


def test_a_side_group_timeout_shorter_than_signalling_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    from fsdp_hotload.config import HotloadConfig
    from fsdp_hotload.engine.signal import longest_signal_s, warn_at_start

    base = dict(bucket_url="/tmp/b", hotload_api_url="https://api.example", account_id="a", model_id="m",
                deployment_id="d", hf_config_dir="/tmp", ready_timeout_s=600)
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        warn_at_start(HotloadConfig(**base))  # the default: the longest signalling may take + an hour
        # ready_timeout_s + an hour was shorter than signalling may take with "any" from ready_timeout_s ~54 min on
        long = HotloadConfig(**{**base, "ready_timeout_s": 3600, "deployment_id": ["d", "e"]},
                             deployments_required="any")
        assert long.side_group_timeout_s == longest_signal_s(long) + 3600 > 7555
        warn_at_start(long)
        assert caplog.records == []
        short = HotloadConfig(**base, collective_timeout_s=1220)
        assert longest_signal_s(short) == 1220
        assert longest_signal_s(HotloadConfig(**base, deployments_required="any")) == 1555  # a catch-up's load
        warn_at_start(short)
    assert "collective_timeout_s (1220 s) is not longer than signalling may take (1220 s" in caplog.text
    assert "set it above 1220 s, or leave it unset" in caplog.text


def test_a_codec_fireworks_does_not_take_is_warned_about_for_a_remote_api(caplog: pytest.LogCaptureFixture) -> None:
    """codec="arc_sparse_v1" against Fireworks: every delta got HTTP 400 and half the publishes failed, with
    nothing said at start. The emulator (a loopback API) is told the formats it takes, so it is not warned about."""
    from fsdp_hotload.config import HotloadConfig
    from fsdp_hotload.engine.signal import warn_at_start

    base = dict(bucket_url="/tmp/b", account_id="a", model_id="m", deployment_id="d", hf_config_dir="/tmp")
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        warn_at_start(HotloadConfig(**base, hotload_api_url="https://api.fireworks.ai"))
        warn_at_start(HotloadConfig(**base, hotload_api_url="http://127.0.0.1:8000", hotload_api_allow_http=True,
                                    codec="arc_sparse_v1"))
        assert caplog.records == []
        warn_at_start(HotloadConfig(**base, hotload_api_url="https://api.fireworks.ai", codec="arc_sparse_v1"))
    (record,) = caplog.records
    assert "codec 'arc_sparse_v1' is not arc_v2" in record.getMessage()


def test_straggler_wait_s_with_one_deployment_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """The wait it bounds ends once another deployment serves the snapshot: with one deployment it changed nothing,
    silently (a fleet's config reused for a one-region job)."""
    from fsdp_hotload.config import HotloadConfig
    from fsdp_hotload.engine.signal import warn_at_start

    straggler = dict(bucket_url="/tmp/b", account_id="a", model_id="m", deployment_id="d", hf_config_dir="/tmp",
                     hotload_api_url="https://api.fireworks.ai", deployments_required="any", straggler_wait_s=5.0)
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        warn_at_start(HotloadConfig(**dict(straggler, deployment_id=["d", "e"])))
        assert caplog.records == []
        warn_at_start(HotloadConfig(**straggler))
    (record,) = caplog.records
    assert "straggler_wait_s is set with one deployment (d)" in record.getMessage()
