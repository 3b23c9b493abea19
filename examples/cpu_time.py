"""The demo's CPU: the seconds its processes spent (what a step's work costs, apart from its wall
time) and the threads the trainer's torch may use."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


def process_tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process, its live descendants, and the children it has
    reaped (Linux /proc): the daemon with its workers and drafter trainers."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                raw = (entry / "stat").read_text()
            except OSError:
                continue  # exited meanwhile
            stats[int(entry.name)] = raw[raw.rindex(")") + 2 :].split()
    tree, grew = {pid}, True
    while grew:  # field 1 (after the name) is the parent's pid
        new = {p for p, f in stats.items() if int(f[1]) in tree} - tree
        tree |= new
        grew = bool(new)
    total = sum(int(stats[p][11]) + int(stats[p][12]) for p in tree if p in stats)
    if pid in stats:  # reaped children: cutime + cstime
        total += int(stats[pid][13]) + int(stats[pid][14])
    return total / ticks


def demo_cpu(daemon_pid: int) -> float:
    """CPU seconds so far of the daemon's process tree and of this (the trainer's) process."""
    return process_tree_cpu(daemon_pid) + time.process_time()


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
