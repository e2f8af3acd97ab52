"""How long a call that lets the GIL go (as a CUDA graph replay or a wait for the device does) takes to get it back
while another thread of the process runs Python (as a replica's event loop does), per GIL switch interval."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path

CALL_S = 0.0001  # the call itself: a sleep, which lets the GIL go
CALLS = 200


def _busy(stop: threading.Event) -> None:
    count = 0
    while not stop.is_set():
        for _ in range(1000):
            count += 1


def call_ms(busy: bool) -> float:
    """Mean ms per GIL-releasing call, with or without a busy Python thread beside it."""
    stop = threading.Event()
    other = threading.Thread(target=_busy, args=(stop,)) if busy else None
    if other is not None:
        other.start()
    started = time.perf_counter()
    for _ in range(CALLS):
        time.sleep(CALL_S)
    elapsed = (time.perf_counter() - started) / CALLS * 1000
    stop.set()
    if other is not None:
        other.join()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--intervals-ms", default="5,1,0.5,0.2", help="GIL switch intervals to try (ms)")
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    args = parser.parse_args()
    default = sys.getswitchinterval()
    rows = []
    for interval_ms in [float(v) for v in args.intervals_ms.split(",")]:
        sys.setswitchinterval(interval_ms / 1000)
        rows.append({"switch_interval_ms": interval_ms, "alone_ms": call_ms(False), "beside_busy_thread_ms": call_ms(True)})
    sys.setswitchinterval(default)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"# A GIL-releasing call beside a busy thread ({platform.processor() or platform.machine()}, {date.today()})",
        "",
        f"commit `{commit}`, command `python -m benchmarks.gil_switch_probe {' '.join(sys.argv[1:])}`, Python "
        f"{platform.python_version()}",
        "",
        f"Each call sleeps {CALL_S * 1000:.1f} ms (letting the GIL go), {CALLS} calls, mean per call.",
        "",
        "| switch interval (ms) | alone (ms) | beside a busy thread (ms) |",
        "|---|---|---|",
    ]
    lines += [f"| {r['switch_interval_ms']} | {r['alone_ms']:.2f} | {r['beside_busy_thread_ms']:.2f} |" for r in rows]
    print("\n".join(lines))
    if args.out is not None:
        args.out.with_suffix(".json").write_text(json.dumps({"commit": commit, "rows": rows}, indent=2))
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
