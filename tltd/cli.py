"""`tltd` command line: `tltd serve` with flags over the config file and TLTD_* environment."""

from __future__ import annotations

import asyncio
import sys

import click

import tltd
from tltd.errors import ConfigError
from tltd.logs import configure_logging
from tltd.settings import load_settings
from tltd.worker_code import start_forkserver


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=tltd.__version__, prog_name="tltd")
def main() -> None:
    """tltd: a node daemon serving LLM rollouts to RL trainers over gRPC."""


@main.command()
@click.option(
    "--config", "config_file", type=click.Path(dir_okay=False), help="TOML settings file."
)
@click.option("--host", help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, help="Port to listen on (0 = any free port).")
@click.option("--data-dir", help="State directory (SQLite database by default).")
@click.option("--database-url", help="SQLAlchemy URL (sqlite:///... or postgresql+psycopg://...).")
@click.option("--cpu-slots", type=int, help="CPU device slots where there is no GPU.")
@click.option("--metrics-port", type=int, help="Prometheus /metrics port (0 = off, the default).")
@click.option(
    "--http/--no-http",
    "http_enabled",
    default=None,
    help="Also serve the OpenAI- and SGLang-compatible HTTP API (off by default).",
)
@click.option("--http-port", type=int, help="HTTP API port (default 8000; 0 = any free port).")
@click.option(
    "--http-port-file",
    type=click.Path(dir_okay=False),
    help="Write the bound HTTP port here once serving (useful with --http-port 0).",
)
@click.option("--log-level", help="DEBUG, INFO, WARNING, ERROR.")
@click.option("--log-json/--no-log-json", default=None, help="JSON lines instead of key=value.")
@click.option(
    "--port-file",
    type=click.Path(dir_okay=False),
    help="Write the bound port here once serving (useful with --port 0).",
)
def serve(
    config_file,
    host,
    port,
    data_dir,
    database_url,
    cpu_slots,
    metrics_port,
    http_enabled,
    http_port,
    http_port_file,
    log_level,
    log_json,
    port_file,
) -> None:
    """Run the daemon until SIGTERM/SIGINT."""
    overrides = {
        "host": host,
        "port": port,
        "data_dir": data_dir,
        "database_url": database_url,
        "cpu_slots": cpu_slots,
        "metrics_port": metrics_port,
        "http_enabled": http_enabled,
        "http_port": http_port,
        "log_level": log_level,
        "log_json": log_json,
    }
    try:
        settings = load_settings(config_file, overrides=overrides)
        configure_logging(settings.log_level, settings.log_json)
        start_forkserver()
        # Imported late so that `tltd --help` stays fast and config errors need no database.
        from tltd.daemon import serve as run

        code = asyncio.run(run(settings, port_file=port_file, http_port_file=http_port_file))
    except ConfigError as exc:
        click.echo(f"tltd: configuration error: {exc}", err=True)
        sys.exit(2)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
