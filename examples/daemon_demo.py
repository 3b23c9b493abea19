"""Start a real `tltd serve` on the embedded defaults, talk to it with tltctl, shut it down cleanly.

Used by `make demo` until the RL demo lands: SQLite under a temporary data dir, CPU slots,
the torch backend, the project's own small policy when it is present.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-policy"


def run(*args: str) -> None:
    print(f"\n$ tltctl {' '.join(args)}", flush=True)
    subprocess.run(
        [sys.executable, "-m", "tltd_clients.tltctl", *args],
        check=True,
        cwd=ROOT,
        env={**os.environ, "TLTD_TARGET": os.environ["TLTD_TARGET"]},
    )


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="tltd-demo-") as tmp:
        port_file = Path(tmp) / "port"
        print(f"starting tltd serve (data dir {tmp}, SQLite, 2 CPU slots)", flush=True)
        daemon = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tltd",
                "serve",
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--data-dir",
                tmp,
                "--cpu-slots",
                "2",
            ],
            cwd=ROOT,
        )
        try:
            deadline = time.monotonic() + 60
            while not (port_file.exists() and port_file.read_text().strip()):
                if daemon.poll() is not None or time.monotonic() > deadline:
                    print("tltd did not start", file=sys.stderr)
                    return 1
                time.sleep(0.1)
            os.environ["TLTD_TARGET"] = f"127.0.0.1:{port_file.read_text().strip()}"
            run("status")
            run("devices")
            if MODEL.is_dir():
                subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        "import os; from clients import TltClient; "
                        "c = TltClient(os.environ['TLTD_TARGET']); "
                        f"print('created job', c.create_job({str(MODEL)!r}, job_id='demo').job_id)",
                    ],
                    check=True,
                    cwd=ROOT,
                )
                run("jobs", "ls")
            run("cordon", "cpu:1", "--reason", "demo")
            run("devices", "-o", "json")
            run("uncordon", "cpu:1")
        finally:
            daemon.send_signal(signal.SIGTERM)
            code = daemon.wait(timeout=60)
        print(f"\ntltd exited with status {code} after SIGTERM", flush=True)
        return code


if __name__ == "__main__":
    raise SystemExit(main())
