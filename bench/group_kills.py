"""Replica groups on the whole loop: one group's container killed again and again.

    sudo .venv/bin/python -u bench/group_kills.py [--kills 20] [--busy 2]

A job of 3 replica groups of one pod each (heartbeat timeout 1000 ms, collective timeout
5000 ms, as tests/e2e/test_fault_tolerance_e2e.py) runs on the whole loop of
tests/cluster/whole_loop.py. Every ~25 steps group 1's container is killed (kill -9 of
torchrun and its trainer): the operator replaces its pod, and the group heals from a live
one. --busy spins that many processes beside it, as a loaded CI machine's other tests do:
the rare stalls of the live groups showed only under load.

For each kill: the live groups' longest pause between two steps (by their own clocks) from
the kill until the quorum was whole again, and when the pause was long, what torchft's
lighthouse said meanwhile (its `/status` page, polled every 50 ms) and the live groups'
error lines. Last, how many kills paused the live groups over --stall-seconds and the
longest pause of the others. Node avoidance is off (`avoidNodesFor: 0s`) and the backoff
capped at 1 s, so that the kills, all on one group, measure the same thing each time.
"""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "cluster"), str(REPO / "images" / "offline")]

from whole_loop import (  # noqa: E402
    Cluster,
    break_groups,
    missing_host_support,
    quorums,
    replica_groups_job,
    standalone,
    steps_printed,
)

from kubetrain.pod_conventions import LIGHTHOUSE_PORT  # noqa: E402

GROUPS, BROKEN, NAME = 3, 1, "group-kills"
STARTED = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f}s] {text}", flush=True)


def poll_lighthouse(url: str, stop: threading.Event, seen: list[tuple[float, str]]) -> None:
    """Each change of the lighthouse's quorum status, with when it was read."""
    last = None
    while not stop.is_set():
        try:
            with urllib.request.urlopen(url, timeout=1) as page:
                found = re.search(r"(Fast quorum|New quorum not ready|Valid quorum)[^<]*",
                                  page.read().decode())
            said = " ".join(found.group(0).split()) if found else "(no status)"
        except OSError as error:
            said = f"(unreachable: {error})"
        if said != last:
            seen.append((time.monotonic() - STARTED, said))
            last = said
        time.sleep(0.05)


def kills(cluster: Cluster, count: int, stall_seconds: float) -> int:
    manifest = replica_groups_job(NAME, cluster.s3, groups=GROUPS, steps=1_000_000,
                                  heartbeat_ms=1000, collective_ms=5000)
    manifest["spec"]["runPolicy"].update({"maxRestarts": 100_000, "avoidNodesFor": "0s",
                                          "maxBackoffSeconds": 1})
    cluster.apply(manifest)
    cluster.wait_for("all 3 groups in the quorum", lambda: GROUPS in [
        groups for _, groups in quorums(cluster.worker_lines(NAME, 0))], 300, every=0.2)
    lighthouse = next(pod for pod in cluster.pods(NAME)
                      if pod["metadata"]["name"] == f"{NAME}-lighthouse")
    url = f"http://{lighthouse['status']['podIP']}:{LIGHTHOUSE_PORT}/status"
    longest: list[float] = []
    for kill in range(count):
        at = max(steps_printed(cluster.worker_lines(NAME, 0)))
        cluster.wait_for_printed_step(NAME, at + 25, timeout=120)
        stop, seen = threading.Event(), list[tuple[float, str]]()
        poller = threading.Thread(target=poll_lighthouse, args=(url, stop, seen), daemon=True)
        poller.start()
        try:
            done = break_groups(cluster, NAME, GROUPS, [BROKEN],
                                lambda: cluster.kill_container(f"{NAME}-worker-{BROKEN}"))
        finally:
            stop.set()
            poller.join()
        pauses = {group: max(seconds for _, seconds in stepped)
                  for group, stepped in done.steps.items()}
        longest.append(max(pauses.values()))
        say(f"kill {kill + 1} at step {done.at_step}: the live groups' longest pauses "
            + ", ".join(f"group {group} {pause:.2f}s" for group, pause in pauses.items())
            + f"; group {BROKEN} healed {done.healed_after:.1f}s after the kill")
        if longest[-1] > stall_seconds:
            print("  the lighthouse meanwhile:")
            for when, said in seen:
                print(f"    [{when:6.1f}s] {said}")
            for group in done.steps:
                errors = [line for line in cluster.worker_lines(NAME, group, done.marks[group])
                          if "got exception" in line]
                print(f"  group {group}'s errors: {errors or 'none'}")
    cluster.delete(NAME)
    stalls = [pause for pause in longest if pause > stall_seconds]
    others = [pause for pause in longest if pause <= stall_seconds]
    print(f"\n{count} kills of group {BROKEN}'s container: {len(stalls)} paused the live "
          f"groups over {stall_seconds:g}s ({', '.join(f'{p:.2f}s' for p in stalls) or '-'}); "
          f"the longest of the others {max(others, default=0):.2f}s")
    return 1 if stalls else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--busy", type=int, default=2,
                        help="processes spinning beside the cluster (default 2)")
    parser.add_argument("--stall-seconds", type=float, default=2.5,
                        help="a pause over this is a stall (default 2.5)")
    args = parser.parse_args()
    reason = missing_host_support()
    if reason is not None:
        print(f"bench/group_kills.py: skipped: {reason}")
        return 0
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    try:
        with standalone("kubetrain-group-kills-", say) as cluster:
            say(f"whole loop up; {args.busy} processes spinning beside it")
            return kills(cluster, args.kills, args.stall_seconds)
    finally:
        for process in busy:
            process.kill()


if __name__ == "__main__":
    sys.exit(main())
