"""Builds the lpsync Grafana dashboard (deploy/grafana/dashboards/lpsync.json).

Run after changing it: ``python deploy/grafana/dashboard.py`` (needs the ``deploy``
extra: grafana-foundation-sdk). tests/deploy regenerates the JSON and fails when the
committed file is stale, and checks every series named here against a running daemon.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, DataSourceRef

OUTPUT = Path(__file__).resolve().parent / "dashboards" / "lpsync.json"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'instance=~"$instance"'  # every query is filtered by the instance variable
RATE = "$__rate_interval"


def _query(expr: str, legend: str, ref: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref)


def _series(
    title: str, unit: str, description: str, *queries: tuple[str, str], width: int = 12
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .height(8)
        .span(width)
    )
    for i, (expr, legend) in enumerate(queries):
        panel = panel.with_target(_query(expr, legend, chr(ord("A") + i)))
    return panel


def _stat(title: str, unit: str, expr: str, legend: str, description: str) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .height(4)
        .span(6)
        .with_target(_query(expr, legend))
    )


def _quantile(q: float, by: str) -> str:
    return (
        f"histogram_quantile({q}, sum by ({by}, le) "
        f"(rate(lpsync_collective_seconds_bucket{{{SEL}}}[{RATE}])))"
    )


def build() -> dict:
    dash = (
        db.Dashboard("lpsync")
        .uid("lpsync")
        .tags(["lpsync"])
        .description(
            "lpsync daemons: collective latency and bandwidth, errors, sessions, "
            "peers (docs/deploy.md says how to read it)"
        )
        .refresh("10s")
        .time("now-1h", "now")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            db.QueryVariable("instance")
            .label("Daemon")
            .datasource(DATASOURCE)
            .query("label_values(lpsync_sessions, instance)")
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
        .with_row(db.Row("Overview"))
        .with_panel(
            _stat(
                "Daemons up", "none", 'count(up{job=~".*lpsync.*"} == 1)', "up", "Daemons answering scrapes"
            )
        )
        .with_panel(
            _stat(
                "Sessions",
                "none",
                f"sum(lpsync_sessions{{{SEL}}})",
                "sessions",
                "Training processes attached",
            )
        )
        .with_panel(
            _stat(
                "Collectives/s",
                "ops",
                f"sum(rate(lpsync_collective_seconds_count{{{SEL}}}[{RATE}]))",
                "ops",
                "Completed collectives per second, all daemons",
            )
        )
        .with_panel(
            _stat(
                "Errors/s",
                "ops",
                f"sum(rate(lpsync_collective_errors_total{{{SEL}}}[{RATE}])) or vector(0)",
                "errors",
                "Failed collectives per second (panel 'Errors by code')",
            )
        )
        .with_row(db.Row("Collectives"))
        .with_panel(
            _series(
                "Latency per op (p50, p99)",
                "s",
                "From the last rank's arrival to completion; buckets from 10 us to 1000 s.",
                (_quantile(0.5, "op"), "p50 {{op}}"),
                (_quantile(0.99, "op"), "p99 {{op}}"),
            )
        )
        .with_panel(
            _series(
                "p99 latency per op and size",
                "s",
                "size: the message size class (nccl-tests bytes)",
                (_quantile(0.99, "op, size"), "{{op}} {{size}}"),
            )
        )
        .with_panel(
            _series(
                "Bus bandwidth per op",
                "Bps",
                "busbw of the latest collective (nccl-tests formulas), per daemon",
                (f"lpsync_busbw_bytes_per_second{{{SEL}}}", "{{op}} {{instance}}"),
            )
        )
        .with_panel(
            _series(
                "Throughput per op",
                "Bps",
                "Collective bytes completed per second",
                (f"sum by (op) (rate(lpsync_collective_bytes_total{{{SEL}}}[{RATE}]))", "{{op}}"),
            )
        )
        .with_panel(
            _series(
                "Errors by code",
                "ops",
                "Failed collectives per second by gRPC status code (docs/deploy.md, alerts)",
                (
                    f"sum by (op, code) (rate(lpsync_collective_errors_total{{{SEL}}}[{RATE}]))",
                    "{{op}} {{code}}",
                ),
            )
        )
        .with_panel(
            _series(
                "Algorithm the tuner picks",
                "ops",
                "Collectives per second by the algorithm that ran, per op and size class",
                (
                    f"sum by (op, size, algorithm) (rate(lpsync_collective_seconds_count{{{SEL}}}[{RATE}]))",
                    "{{op}} {{size}}: {{algorithm}}",
                ),
            )
        )
        .with_row(db.Row("Sessions, buffers and jobs"))
        .with_panel(
            _series(
                "Sessions",
                "none",
                "Attached training processes per daemon",
                (f"lpsync_sessions{{{SEL}}}", "{{instance}}"),
            )
        )
        .with_panel(
            _series(
                "Registered bytes",
                "bytes",
                "Bytes in shared-memory buffers; the largest session against --max-session-bytes",
                (f"lpsync_registered_bytes{{{SEL}}}", "all sessions {{instance}}"),
                (f"lpsync_session_registered_bytes_max{{{SEL}}}", "largest session {{instance}}"),
                (f"lpsync_session_bytes_limit{{{SEL}}}", "limit per session {{instance}}"),
            )
        )
        .with_panel(
            _series(
                "Outstanding collectives per job",
                "none",
                "Collectives waiting for ranks or running; stuck above 0 means a rank is late",
                (f"lpsync_job_pending_collectives{{{SEL}}}", "{{job_name}} {{instance}}"),
            )
        )
        .with_panel(
            _series(
                "Seconds since a job's last completed collective",
                "s",
                "Grows while a job computes; alert LpsyncJobStalled when it also has work waiting",
                (
                    f"time() - lpsync_job_last_progress_timestamp_seconds{{{SEL}}}",
                    "{{job_name}} {{instance}}",
                ),
            )
        )
        .with_row(db.Row("Peers"))
        .with_panel(
            _series(
                "Peers connected",
                "none",
                "Connected peer daemons against configured ones",
                (f"lpsync_peers_connected{{{SEL}}}", "connected {{instance}}"),
                (f"lpsync_peers_expected{{{SEL}}}", "expected {{instance}}"),
                width=8,
            )
        )
        .with_panel(
            _series(
                "Peer link bandwidth",
                "Bps",
                "Probed when the peer mesh forms",
                (f"lpsync_peer_link_bytes_per_second{{{SEL}}}", "{{instance}} -> {{peer}}"),
                width=8,
            )
        )
        .with_panel(
            _series(
                "Heartbeats received",
                "hertz",
                "Per peer; 0 for a heartbeat timeout: peer gone",
                (f"rate(lpsync_peer_heartbeats_total{{{SEL}}}[{RATE}])", "{{instance}} <- {{peer}}"),
                width=8,
            )
        )
    )
    model = json.loads(json.dumps(dash.build(), cls=JSONEncoder))
    for number, panel in enumerate(model["panels"], 1):  # Grafana wants unique panel ids
        panel["id"] = number
    return model


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
