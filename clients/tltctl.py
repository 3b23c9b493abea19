"""`tltctl`: the operator's command line for tltd (tables for people, -o json for scripts)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from datetime import UTC
from typing import Any

import click
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich.console import Console
from rich.table import Table

from tltd.v1 import admin_pb2, common_pb2, drafter_pb2, job_pb2, session_pb2
from tltd_clients.client import DEFAULT_TARGET, TltClient
from tltd_clients.errors import TltClientError


class _Ctx:
    def __init__(self, target: str, token: str | None, output: str, **tls: str | None) -> None:
        self.target, self.token, self.output, self.tls = target, token, output, tls
        self._client: TltClient | None = None

    @property
    def client(self) -> TltClient:
        if self._client is None:
            self._client = TltClient(self.target, token=self.token, **self.tls)
        return self._client


def _output_option(fn: Callable) -> Callable:
    """`-o json` accepted after the subcommand too (`tltctl devices -o json`)."""

    def set_output(ctx: click.Context, _param, value: str | None) -> None:
        if value:
            ctx.find_object(_Ctx).output = value

    return click.option(
        "-o",
        "--output",
        type=click.Choice(["table", "json"]),
        expose_value=False,
        callback=set_output,
        help="Output format.",
    )(fn)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--target",
    envvar="TLTD_TARGET",
    default=DEFAULT_TARGET,
    show_default=True,
    help="Daemon address host:port (env TLTD_TARGET).",
)
@click.option("--token", envvar="TLTD_TOKEN", default=None, help="Bearer token (env TLTD_TOKEN).")
@click.option(
    "--tls-ca",
    envvar="TLTD_TLS_CA",
    default=None,
    help="PEM CA to trust; turns TLS on (env TLTD_TLS_CA).",
)
@click.option(
    "--tls-cert",
    envvar="TLTD_CLIENT_CERT",
    default=None,
    help="Client certificate for daemons that require mTLS (env TLTD_CLIENT_CERT).",
)
@click.option(
    "--tls-key",
    envvar="TLTD_CLIENT_KEY",
    default=None,
    help="Key of --tls-cert (env TLTD_CLIENT_KEY).",
)
@click.option(
    "-o",
    "--output",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="Output format.",
)
@click.pass_context
def cli(
    ctx: click.Context,
    target: str,
    token: str | None,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    output: str,
) -> None:
    """Operate a tltd daemon: devices, workers, jobs, drafters, cordon/drain."""
    if bool(tls_cert) != bool(tls_key):  # gRPC would abort the process (SIGABRT)
        raise click.UsageError("--tls-cert and --tls-key must be given together")
    ctx.obj = _Ctx(target, token, output, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
    ctx.call_on_close(lambda: ctx.obj._client and ctx.obj._client.close())


pass_ctx = click.make_pass_decorator(_Ctx)


# -- rendering -------------------------------------------------------------------------------


_INT64 = frozenset(
    (
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    )
)


def _dict(msg: Message) -> dict[str, Any]:
    data = MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _numbers(msg.DESCRIPTOR, data)


def _numbers(desc: Descriptor, data: dict[str, Any]) -> dict[str, Any]:
    """Proto3 JSON writes 64-bit integers as strings (for JavaScript); scripts want numbers."""
    for f in desc.fields:
        if f.name not in data:
            continue
        value, sub = data[f.name], f.message_type
        if sub is None:
            if f.type in _INT64:
                data[f.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
        elif sub.GetOptions().map_entry:
            vf = sub.fields_by_name["value"]
            if vf.type in _INT64:
                data[f.name] = {k: int(v) for k, v in value.items()}
            elif vf.message_type is not None and not _well_known(vf.message_type):
                data[f.name] = {k: _numbers(vf.message_type, v) for k, v in value.items()}
        elif not _well_known(sub):
            if isinstance(value, list):
                data[f.name] = [_numbers(sub, v) for v in value]
            else:
                _numbers(sub, value)
    return data


def _well_known(desc: Descriptor) -> bool:
    """Timestamp, Duration, ...: JSON has their own string forms."""
    return desc.full_name.startswith("google.protobuf.")


def _enum(value: str) -> str:
    """JOB_STATUS_ACTIVE -> active (the proto prefix is noise in a table)."""
    for prefix in (
        "JOB_STATUS_",
        "DRAFTER_STATUS_",
        "BACKEND_",
        "REQUEST_STATUS_",
        "SPECULATIVE_MODE_",
        "SESSION_STATUS_",
    ):
        if value.startswith(prefix):
            return value[len(prefix) :].lower()
    return value


def _when(msg: Message, field: str) -> str:
    if not msg.HasField(field):
        return ""
    return getattr(msg, field).ToDatetime(tzinfo=UTC).strftime("%Y-%m-%d %H:%M:%S")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}" if n else "-"


def _console() -> Console:
    # Not a terminal (a pipe, a test): do not wrap tables at 80 columns.
    return Console(width=None if sys.stdout.isatty() else 200, highlight=False)


def _emit(
    obj: _Ctx,
    data: Any,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    title: str | None = None,
) -> None:
    if obj.output == "json":
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    table = Table(title=title, show_edge=False, pad_edge=False, box=None, header_style="bold")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    _console().print(table)


def _emit_record(obj: _Ctx, msg: Message, extra: dict[str, Any] | None = None) -> None:
    data = _dict(msg) | (extra or {})
    _emit(obj, data, ("field", "value"), [(k, _cell(v)) for k, v in data.items()])


def _cell(value: Any) -> str:
    """One table cell: maps as k=v pairs, floats rounded, enum names without their prefix."""
    if isinstance(value, dict):
        return " ".join(f"{k}={_cell(v)}" for k, v in sorted(value.items())) or "-"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value) or "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, str):
        return _enum(value)
    return str(value)


# -- commands --------------------------------------------------------------------------------


@cli.command()
@_output_option
@pass_ctx
def status(obj: _Ctx) -> None:
    """Node summary: version, uptime, each device's state, workers, requests, acceptance."""
    stats = obj.client.stats()
    states = {d.device_id: _device_state(d) for d in obj.client.list_devices()}
    _emit_record(obj, stats, {"health": obj.client.health(), "device_states": states})


def _device_state(d: admin_pb2.Device) -> str:
    flags = _flags(d)
    return d.state if flags == "-" else f"{d.state}({flags})"


@cli.command()
@_output_option
@pass_ctx
def devices(obj: _Ctx) -> None:
    """Devices the daemon owns (or sees as foreign)."""
    devs = obj.client.list_devices()
    rows = [
        (
            d.device_id,
            d.name,
            d.state,
            _flags(d),
            _gib(d.memory_used_bytes),
            _gib(d.memory_total_bytes),
            f"{d.utilization:.0%}",
            d.state_reason,
        )
        for d in devs
    ]
    _emit(
        obj,
        [_dict(d) for d in devs],
        ("DEVICE", "NAME", "STATE", "FLAGS", "MEM USED GiB", "MEM GiB", "UTIL", "REASON"),
        rows,
    )


@cli.command()
@_output_option
@pass_ctx
def nodes(obj: _Ctx) -> None:
    """Every daemon on the shared database: DOWN when its heartbeat is too old."""
    ns = obj.client.list_nodes()
    rows = [
        (
            n.node_id,
            n.address,
            n.state,
            n.epoch,
            f"{n.heartbeat_age_seconds:.1f}s",
            ",".join(f for f, on in (("cordoned", n.cordoned), ("draining", n.draining)) if on)
            or "-",
        )
        for n in ns
    ]
    _emit(
        obj,
        [_dict(n) for n in ns],
        ("NODE", "ADDRESS", "STATE", "EPOCH", "HEARTBEAT AGE", "FLAGS"),
        rows,
    )


def _flags(d: admin_pb2.Device) -> str:
    flags = [
        name
        for name, on in (("foreign", d.foreign), ("cordoned", d.cordoned), ("draining", d.draining))
        if on
    ]
    return ",".join(flags) or "-"


@cli.command()
@click.option("--device", "device_id", default="", help="Only workers on this device.")
@_output_option
@pass_ctx
def workers(obj: _Ctx, device_id: str) -> None:
    """Rollout and drafter-training worker processes."""
    ws = obj.client.list_workers(device_id)
    rows = [
        (
            w.worker_id,
            w.kind,
            w.device_id,
            w.job_id,
            w.state,
            w.pid or "",
            _when(w, "last_heartbeat"),
            w.state_reason,
        )
        for w in ws
    ]
    _emit(
        obj,
        [_dict(w) for w in ws],
        ("WORKER", "KIND", "DEVICE", "JOB", "STATE", "PID", "HEARTBEAT", "REASON"),
        rows,
    )


@cli.group()
@_output_option
def jobs() -> None:
    """Create, list, show and cancel jobs."""


_JOB_STATUSES = {
    "active": job_pb2.JOB_STATUS_ACTIVE,
    "cancelled": job_pb2.JOB_STATUS_CANCELLED,
    "failed": job_pb2.JOB_STATUS_FAILED,
}


_UINT32 = click.IntRange(0, 2**32 - 1)  # what the proto fields can carry
_VERSION = click.IntRange(1, 2**64 - 1)
_BACKENDS = {
    "torch": common_pb2.BACKEND_TORCH,
    "sglang": common_pb2.BACKEND_SGLANG,
    "sim": common_pb2.BACKEND_SIM,
}
_POLICY_SWITCHES = {
    "finish-on-start-version": job_pb2.POLICY_SWITCH_FINISH_ON_START_VERSION,
    "next-step": job_pb2.POLICY_SWITCH_NEXT_STEP,
}
_SPECULATIVE_MODES = {
    "auto": common_pb2.SPECULATIVE_MODE_AUTO,
    "off": common_pb2.SPECULATIVE_MODE_OFF,
}


def _draft_lengths(_ctx: click.Context, _param: click.Parameter, value: str) -> list[int]:
    """`2,4,6` -> [2, 4, 6]. Only what the proto cannot carry is refused here; the daemon
    judges the rest (0 included) and names the bad entry."""
    try:
        lengths = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        lengths = [-1]
    if not all(0 <= k < 2**32 for k in lengths):
        raise click.BadParameter(f"expected comma-separated integers >= 0, got {value!r}")
    return lengths


@jobs.command("create")
@click.argument("model_path")
@click.option("--job-id", default="", help="Idempotent when given (default: daemon assigns).")
@click.option("--name", default="", help="Free-form label.")
@click.option("--priority", type=_UINT32, default=0, show_default=True)
@click.option("--weight", type=float, default=0.0, help="Fair-share weight (0 = 1.0).")
@click.option(
    "--backend",
    type=click.Choice(list(_BACKENDS)),
    default=None,
    help="Rollout engine (default: the daemon's).",
)
@click.option(
    "--speculative",
    type=click.Choice(list(_SPECULATIVE_MODES)),
    default=None,
    help="auto: speculate in the long tail; off: plain decoding (default: auto).",
)
@click.option(
    "--draft-lengths",
    default="",
    callback=_draft_lengths,
    help="Comma-separated draft lengths for the bandit, e.g. 2,4,6 (default: the daemon's).",
)
@click.option(
    "--drafter",
    type=click.Choice(["auto", "ngram", "eagle", "history"]),
    default=None,
    help="auto: bandit over both; ngram: model-free only; eagle: learned only (default: auto).",
)
@click.option(
    "--batch-threshold",
    type=_UINT32,
    default=0,
    help="Speculate only at running batch <= this (0 = daemon default).",
)
@click.option(
    "--online-training/--no-online-training",
    default=True,
    show_default=True,
    help="Train the learned drafter on idle devices.",
)
@click.option(
    "--initial-drafter",
    default="",
    help="Offline-fitted EAGLE drafter directory the job starts from (on the daemon's host).",
)
@click.option(
    "--policy-switch",
    type=click.Choice(["finish-on-start-version", "next-step"]),
    default=None,
    help="What running requests do on a new policy version (default: finish on their start "
    "version; next-step: continue on the new one from the next decode step, torch only).",
)
@_output_option
@pass_ctx
def jobs_create(
    obj: _Ctx,
    model_path: str,
    job_id: str,
    name: str,
    priority: int,
    weight: float,
    backend: str | None,
    speculative: str | None,
    draft_lengths: list[int],
    drafter: str | None,
    batch_threshold: int,
    online_training: bool,
    initial_drafter: str,
    policy_switch: str | None,
) -> None:
    """Create a job serving MODEL_PATH (a model directory on the daemon's host)."""
    spec = common_pb2.SpeculativeConfig(
        mode=_SPECULATIVE_MODES.get(speculative or "", common_pb2.SPECULATIVE_MODE_UNSPECIFIED),
        batch_threshold=batch_threshold,
        draft_lengths=draft_lengths,
        drafter=drafter or "",
        online_training=online_training,  # always sent: unset would read as False
        initial_drafter_path=initial_drafter,
    )
    job = obj.client.create_job(
        model_path,
        job_id=job_id,
        name=name,
        backend=_BACKENDS[backend] if backend else common_pb2.BACKEND_UNSPECIFIED,
        priority=priority,
        weight=weight,
        speculative=spec,
        policy_switch=_POLICY_SWITCHES.get(policy_switch or "", job_pb2.POLICY_SWITCH_UNSPECIFIED),
    )
    _emit_record(obj, job)


@jobs.command("ls")
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice(list(_JOB_STATUSES)),
    help="Only jobs in this status (repeatable).",
)
@click.option("--limit", type=click.IntRange(0, 2**32 - 1), default=100, show_default=True)
@_output_option
@pass_ctx
def jobs_ls(obj: _Ctx, statuses: tuple[str, ...], limit: int) -> None:
    """List jobs."""
    js = obj.client.list_jobs([_JOB_STATUSES[s] for s in statuses], limit)
    rows = [
        (
            j.job_id,
            j.name,
            _enum(job_pb2.JobStatus.Name(j.status)),
            _enum(common_pb2.Backend.Name(j.backend)),
            j.policy_version,
            j.drafter_version or "-",
            _when(j, "created_at"),
            j.model_path,
        )
        for j in js
    ]
    _emit(
        obj,
        [_dict(j) for j in js],
        ("JOB", "NAME", "STATUS", "BACKEND", "POLICY", "DRAFTER", "CREATED", "MODEL"),
        rows,
    )


@jobs.command("show")
@click.argument("job_id")
@_output_option
@pass_ctx
def jobs_show(obj: _Ctx, job_id: str) -> None:
    """Show one job (with a bounded job's groups, parked prompts and partial ratio)."""
    job = obj.client.get_job(job_id)
    extra = {}
    if job.HasField("bounded") and job.bounded.samples_sent:
        b = job.bounded
        extra["partial_ratio"] = round(b.samples_multi_version / b.samples_sent, 3)
    _emit_record(obj, job, extra)


@jobs.command("cancel")
@click.argument("job_id")
@click.option("--reason", default="", help="Recorded with the status change.")
@_output_option
@pass_ctx
def jobs_cancel(obj: _Ctx, job_id: str, reason: str) -> None:
    """Cancel a job and its unfinished rollout requests."""
    _emit_record(obj, obj.client.cancel_job(job_id, reason or "cancelled with tltctl"))


_SESSION_STATUSES = {
    "open": session_pb2.SESSION_STATUS_OPEN,
    "closed": session_pb2.SESSION_STATUS_CLOSED,
}


@cli.command()
@click.option("--job", "job_id", default="", help="Only this job's sessions.")
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice(list(_SESSION_STATUSES)),
    help="Only sessions in this status (repeatable).",
)
@click.option("--limit", type=_UINT32, default=100, show_default=True)
@_output_option
@pass_ctx
def sessions(obj: _Ctx, job_id: str, statuses: tuple[str, ...], limit: int) -> None:
    """List multi-turn sessions, newest first (RUNNING: the turn running now; PINNED: the
    node/worker holding its KV; REUSED: turns that reused it, positions restored; both as
    the node answering knows them)."""
    found = obj.client.list_sessions(job_id, [_SESSION_STATUSES[s] for s in statuses], limit)
    rows = [
        (
            s.session_id,
            s.job_id,
            s.num_turns,
            s.num_tokens,
            _enum(session_pb2.SessionStatus.Name(s.status)),
            s.running_turn if s.running_turn >= 0 else "-",
            f"{s.node_id}/{s.worker_id}" if s.worker_id else "-",
            f"{s.reuse_hits} ({s.reused_tokens})",
            _when(s, "updated_at"),
        )
        for s in found
    ]
    header = ("SESSION", "JOB", "TURNS", "TOKENS", "STATE", "RUNNING", "PINNED", "REUSED")
    _emit(obj, [_dict(s) for s in found], (*header, "UPDATED"), rows)


@cli.group()
@_output_option
def drafters() -> None:
    """Learned drafter versions of a job: list, show, pin, export."""


def _drafter_rows(vs: Sequence[drafter_pb2.DrafterVersion]) -> list[tuple]:
    return [
        (
            v.version,
            _enum(drafter_pb2.DrafterStatus.Name(v.status)),
            v.policy_version,
            v.train_steps,
            f"{v.loss:.4f}",
            f"{v.acceptance_length:.2f}",
            "yes" if v.pinned else "",
            "yes" if v.active else "",
            (v.node_id or "-") + (" (shared)" if v.shared else ""),
            _when(v, "created_at"),
        )
        for v in vs
    ]


_DRAFTER_COLUMNS = (
    "VERSION",
    "STATUS",
    "POLICY",
    "STEPS",
    "LOSS",
    "ACCEPT LEN",
    "PINNED",
    "ACTIVE",
    "NODE",
    "CREATED",
)


@drafters.command("ls")
@click.argument("job_id")
@_output_option
@pass_ctx
def drafters_ls(obj: _Ctx, job_id: str) -> None:
    """List a job's drafter versions."""
    resp = obj.client.list_drafters(job_id)
    _emit(
        obj,
        _dict(resp),
        _DRAFTER_COLUMNS,
        _drafter_rows(resp.drafters),
        title=f"{job_id}: active drafter version {resp.active_version or 'none'}",
    )


@drafters.command("show")
@click.argument("job_id")
@click.argument("version", type=_VERSION)
@_output_option
@pass_ctx
def drafters_show(obj: _Ctx, job_id: str, version: int) -> None:
    """Show one drafter version."""
    _emit_record(obj, obj.client.get_drafter(job_id, version))


@drafters.command("pin")
@click.argument("job_id")
@click.argument("version", type=click.IntRange(0, 2**64 - 1))
@_output_option
@pass_ctx
def drafters_pin(obj: _Ctx, job_id: str, version: int) -> None:
    """Pin VERSION for JOB_ID's workers (0 unpins: back to the newest promoted)."""
    _emit_record(obj, obj.client.pin_drafter(job_id, version))


@drafters.command("export")
@click.argument("job_id")
@click.argument("version", type=_VERSION)
@click.option("--output-dir", required=True, help="Absolute directory on the daemon's host.")
@click.option("--format", "fmt", default="sglang-eagle", show_default=True)
@_output_option
@pass_ctx
def drafters_export(obj: _Ctx, job_id: str, version: int, output_dir: str, fmt: str) -> None:
    """Write a drafter version as a standalone checkpoint (on the daemon's host)."""
    _emit_record(obj, obj.client.export_drafter(job_id, version, output_dir, fmt))


def _device_result(obj: _Ctx, devs: Sequence[admin_pb2.Device]) -> None:
    rows = [(d.device_id, d.state, _flags(d), d.state_reason) for d in devs]
    _emit(obj, [_dict(d) for d in devs], ("DEVICE", "STATE", "FLAGS", "REASON"), rows)


def _one_target(device_id: str, node_id: str) -> None:
    if bool(device_id) == bool(node_id):
        raise click.UsageError("give a DEVICE_ID or --node NODE_ID (not both)")


@cli.command()
@click.argument("device_id", required=False, default="")
@click.option("--node", "node_id", default="", help="Cordon every device of this node.")
@click.option("--reason", default="", help="Recorded with the change.")
@_output_option
@pass_ctx
def cordon(obj: _Ctx, device_id: str, node_id: str, reason: str) -> None:
    """Place no new work on DEVICE_ID, or on every device of a node with --node NODE_ID (any
    node of the database; what runs there keeps running)."""
    _one_target(device_id, node_id)
    why = reason or "cordoned with tltctl"
    _device_result(obj, [obj.client.cordon(device_id, why, node_id=node_id)])


@cli.command()
@click.argument("device_id", required=False, default="")
@click.option("--node", "node_id", default="", help="Uncordon every device of this node.")
@_output_option
@pass_ctx
def uncordon(obj: _Ctx, device_id: str, node_id: str) -> None:
    """Make DEVICE_ID (or every device of --node NODE_ID) schedulable again."""
    _one_target(device_id, node_id)
    _device_result(obj, [obj.client.uncordon(device_id, node_id=node_id)])


_THIS_NODE = "\0this node"


@cli.command()
@click.argument("device_id", required=False, default="")
@click.option(
    "--node",
    is_flag=False,
    flag_value=_THIS_NODE,
    default=None,
    help="Drain the whole node: this daemon's, or NODE_ID's (any node of the database); it "
    "refuses new rollouts and finishes or hands over its work.",
    metavar="[NODE_ID]",
)
@click.option(
    "--grace",
    "grace_seconds",
    type=click.IntRange(min=0),
    default=0,
    help="With --node: seconds before in-flight work is aborted (0 = daemon default).",
)
@_output_option
@pass_ctx
def drain(obj: _Ctx, device_id: str, node: str | None, grace_seconds: int) -> None:
    """Drain DEVICE_ID, or the whole node with --node (another one with --node NODE_ID)."""
    if bool(device_id) == (node is not None):
        raise click.UsageError("give a DEVICE_ID or --node (not both)")
    if grace_seconds and node is None:
        raise click.UsageError(
            "--grace applies to --node only: a drained device takes no new work and lets what "
            "runs there finish"
        )
    node_id = "" if node in (None, _THIS_NODE) else node
    devices = obj.client.drain(
        device_id, node=node is not None, grace_seconds=grace_seconds, node_id=node_id
    )
    _device_result(obj, devices)


def main(argv: Sequence[str] | None = None) -> None:
    """The one error boundary: a failed call prints its status and message, exit 1."""
    try:
        cli.main(args=argv, prog_name="tltctl", standalone_mode=False)
    except TltClientError as exc:
        click.echo(f"tltctl: {exc.code.name.lower()}: {exc.message}", err=True)
        sys.exit(1)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(1)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except OSError as exc:  # e.g. --tls-ca file missing
        click.echo(f"tltctl: {exc}", err=True)
        sys.exit(1)
    except ValueError as exc:  # a value the client refuses (e.g. out of a field's range)
        click.echo(f"tltctl: invalid input: {exc}", err=True)
        sys.exit(2)
    sys.exit(0)


if __name__ == "__main__":  # pragma: no cover
    main()
