"""Peak memory of a process tree, sampled from ``/proc`` (Linux; standard library only).

Usage: ``python3 .ci/memory.py PID OUT.json`` samples, every half second until ``PID`` exits
or this process gets SIGTERM/SIGINT, the resident set sizes (``VmRSS``) of ``PID`` and all its
descendants; it then writes ``OUT.json`` and prints one line: the peak of their sum (shared pages
are counted once per process, so this is an upper bound of the tree's use), the peak of any one
process (with its command), and the most notebook kernels (``ipykernel_launcher``) alive at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

INTERVAL_S = 0.5


def _processes() -> dict[int, tuple[int, int, str]]:
    """``pid -> (ppid, rss_bytes, command)`` for every readable process."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss_kb = int(fields.get("VmRSS", "0 kB").split()[0])
        found[int(entry)] = (int(fields["PPid"]), rss_kb * 1024, command.decode(errors="replace"))
    return found


def _tree(root: int, processes: dict[int, tuple[int, int, str]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in processes.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return [pid for pid in tree if pid in processes and pid != os.getpid()]


def main(root: int, out: Path) -> None:
    peak = {"sum_bytes": 0, "sum_at_s": 0.0, "processes_at_peak": 0, "one_bytes": 0,
            "one_command": "", "kernels_max": 0, "samples": 0}
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    start = time.monotonic()
    while not stop and Path(f"/proc/{root}").exists():
        processes = _processes()
        tree = _tree(root, processes)
        total = sum(processes[pid][1] for pid in tree)
        if total > peak["sum_bytes"]:
            peak.update(sum_bytes=total, sum_at_s=round(time.monotonic() - start, 1),
                        processes_at_peak=len(tree))
        for pid in tree:
            if processes[pid][1] > peak["one_bytes"]:
                peak.update(one_bytes=processes[pid][1], one_command=processes[pid][2][:200])
        kernels = sum("ipykernel_launcher" in processes[pid][2] for pid in tree)
        peak["kernels_max"] = max(peak["kernels_max"], kernels)
        peak["samples"] += 1
        time.sleep(INTERVAL_S)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(peak, indent=2) + "\n")
    gib = 1024**3
    print(f"peak memory: sum of RSS {peak['sum_bytes'] / gib:.2f} GiB "
          f"({peak['processes_at_peak']} processes, at {peak['sum_at_s']:.0f} s); one process "
          f"{peak['one_bytes'] / gib:.2f} GiB ({peak['one_command'][:80]}); at most "
          f"{peak['kernels_max']} notebook kernels at once", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
