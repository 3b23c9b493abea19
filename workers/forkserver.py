"""Imported first by the forkserver that forks the worker processes (`tltd.contract.processes`).

The forkserver leaves stop signals to the daemon, as the workers do (`tltd_workers.signals`):
a SIGTERM to the daemon's whole process group would otherwise end it, and the daemon would
read that as the death of every worker it forked, losing their partial samples in the drain.
It ends when the daemon does (multiprocessing closes its pipe)."""

from tltd_workers.signals import ignore_stop_signals

ignore_stop_signals()
