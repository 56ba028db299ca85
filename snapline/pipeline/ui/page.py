"""The HTML of ``snapline ui``: a job overview, the tasks, and a checkpoint history like
Flink's (with restores and savepoints), rendered on the server from a ``JobView``; no
JavaScript, no external assets. Cells carry ``data-*`` attributes for tests and scrapers.
"""

from __future__ import annotations

import datetime as dt
from html import escape

from snapline.pipeline.checkpoint.history import HistoryEntry
from snapline.pipeline.ui.view import JobView

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d2330;
background:#f5f6f8}
header{background:#1f2a44;color:#fff;padding:14px 24px}
header h1{margin:0;font-size:20px} header .sub{opacity:.75;font-size:13px;margin-top:4px}
main{padding:16px 24px}
section{background:#fff;border:1px solid #dde1e7;border-radius:6px;margin-bottom:16px;
padding:12px 16px}
h2{font-size:16px;margin:4px 0 10px}
.cards{display:flex;gap:12px;flex-wrap:wrap}
.card{border:1px solid #dde1e7;border-radius:6px;padding:8px 14px;min-width:120px}
.card .v{font-size:22px;font-weight:600} .card .k{font-size:12px;color:#5b6475}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{text-align:left;padding:5px 8px;border-bottom:1px solid #eceef2;vertical-align:top}
th{background:#f0f2f5;font-weight:600} td.num{text-align:right;font-variant-numeric:tabular-nums}
.completed,.restored{color:#1a7f37} .failed{color:#c62828;font-weight:600} .aborted{color:#b26a00}
.paused,.stopped{color:#1f5fbf}
details summary{cursor:pointer;color:#1f5fbf} .legend dt{font-weight:600}
.legend dd{margin:0 0 6px 0;color:#5b6475} .err{color:#c62828}
"""


def _time(ts: float) -> str:
    if ts <= 0:
        return "—"
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def seconds(value: float) -> str:
    """Durations as the page shows them: µs below 1 ms, ms below 10 s."""
    if value < 0.001:
        return f"{value * 1e6:.0f} µs"
    if value < 10:
        return f"{value * 1000:.1f} ms"
    return f"{value:.2f} s"


def size(value: int) -> str:
    """Bytes as the page shows them."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024  # type: ignore[assignment]
    return f"{value} B"


def _cell(value: str, key: str, raw: object = None, num: bool = False) -> str:
    data = "" if raw is None else f' data-value="{escape(str(raw))}"'
    cls = ' class="num"' if num else ""
    return f'<td data-col="{key}"{data}{cls}>{escape(value)}</td>'


def _task_details(entry: HistoryEntry) -> str:
    if entry.kind == "restore":
        if not entry.restored:
            return ""
        items = "".join(
            f"<tr><td>{escape(t)}</td><td>{'—' if c is None else c}</td></tr>"
            for t, c in sorted(entry.restored.items())
        )
        return (
            f"<details><summary>{len(entry.restored)} tasks</summary><table>"
            f"<tr><th>task</th><th>restored checkpoint</th></tr>{items}</table></details>"
        )
    if not entry.tasks:
        return ""
    rows = "".join(
        f'<tr data-task="{escape(t)}"><td>{escape(t)}</td><td class="num">{seconds(v.sync)}</td>'
        f'<td class="num">{seconds(v.alignment)}</td><td class="num">{seconds(v.async_)}</td>'
        f'<td class="num">{size(v.bytes)}</td><td class="num">{size(v.incremental_bytes)}</td></tr>'
        for t, v in sorted(entry.tasks.items())
    )
    return (
        f"<details><summary>{len(entry.tasks)} tasks</summary><table><tr><th>task</th>"
        "<th>sync</th><th>alignment</th><th>async</th><th>size</th><th>incremental</th></tr>"
        f"{rows}</table></details>"
    )


def _history_rows(view: JobView) -> str:
    rows = []
    for e in view.history:
        sp = e.kind == "savepoint"
        what = f"savepoint request {e.savepoint}" if sp else e.reason
        rows.append(
            f'<tr class="history-row" data-kind="{e.kind}" data-status="{e.status}">'
            + _cell(e.kind, "kind")
            + _cell("—" if e.checkpoint_id < 0 else str(e.checkpoint_id), "id", e.checkpoint_id)
            + _cell(e.worker, "worker")
            + f'<td data-col="status" class="{escape(e.status)}">{escape(e.status)}</td>'
            + _cell(_time(e.time), "time", e.time)
            + _cell("" if sp else seconds(e.duration), "duration", e.duration, True)
            + _cell(seconds(e.alignment) if e.kind == "checkpoint" else "", "alignment", None, True)
            + _cell(seconds(e.materialize) if e.kind == "checkpoint" else "", "async", None, True)
            + _cell(seconds(e.commit) if e.kind == "checkpoint" else "", "commit", None, True)
            + _cell("" if sp else size(e.bytes), "bytes", e.bytes, True)
            + _cell(
                size(e.incremental_bytes) if e.kind == "checkpoint" else "",
                "incremental",
                e.incremental_bytes,
                True,
            )
            + f'<td data-col="tasks">{_task_details(e)}</td>'
            + _cell(what, "detail")
            + "</tr>"
        )
    if not rows:
        rows.append(
            '<tr><td colspan="13">No history yet: no worker of this job has taken a '
            "checkpoint with this version of Snapline.</td></tr>"
        )
    return "".join(rows)


def _task_rows(view: JobView) -> str:
    rows = []
    for task in view.tasks:
        last = task.last_checkpoint
        lag = view.lag_of(task)
        rate = view.rates.get(task.task_id)
        parts = ", ".join(f"{p.topic}[{p.partition}]" for p in task.partitions) or "—"
        committed = ", ".join(str(p.committed) for p in task.partitions) or "—"
        end = ", ".join(str(p.end) for p in task.partitions) or "—"
        rows.append(
            f'<tr class="task-row" data-task="{escape(task.task_id)}">'
            + _cell(task.task_id, "task")
            + _cell(str(task.stage), "stage")
            + _cell(view.task_worker(task.task_id) or "—", "worker")
            + _cell(parts, "partitions")
            + _cell(committed, "committed")
            + _cell(end, "end")
            + _cell("—" if lag is None else f"{lag:.0f}", "lag", lag, True)
            + _cell("—" if rate is None else f"{rate:.1f}", "rate", rate, True)
            + _cell("—" if last is None else str(last.ref.checkpoint_id), "last")
            + _cell("—" if last is None else _time(last.created_at), "last-time")
            + _cell("—" if last is None else size(last.bytes), "last-bytes", None, True)
            + "</tr>"
        )
    return "".join(rows) or '<tr><td colspan="11">No tasks known yet.</td></tr>'


def _retained_rows(view: JobView) -> str:
    rows = []
    for task in view.tasks:
        for c in reversed(task.checkpoints):
            t = c.timings
            rows.append(
                f'<tr class="retained-row" data-task="{escape(task.task_id)}">'
                + _cell(task.task_id, "task")
                + _cell(str(c.ref.checkpoint_id), "id", c.ref.checkpoint_id)
                + _cell(c.ref.attempt, "attempt")
                + _cell(
                    "committed" if c.committed else "complete" if c.complete else "incomplete",
                    "state",
                )
                + _cell(c.worker or "—", "worker")
                + _cell(_time(c.created_at), "created")
                + _cell(size(c.bytes), "bytes", c.bytes, True)
                + _cell(seconds(t["sync"]) if "sync" in t else "—", "sync", None, True)
                + _cell(
                    seconds(t["alignment"]) if "alignment" in t else "—", "alignment", None, True
                )
                + _cell(seconds(t["async"]) if "async" in t else "—", "async", None, True)
                + _cell(c.error, "error")
                + "</tr>"
            )
    return "".join(rows) or '<tr><td colspan="11">No checkpoints stored.</td></tr>'


LEGEND = {
    "ID": "the checkpoint id (ids grow per task; a restore shows the newest restored one)",
    "Trigger time": "when the worker injected the barrier (restores: when restoring began)",
    "End-to-end": "trigger until the Kafka transaction committed (the commit point); "
    "restores: the whole restore",
    "Alignment": "trigger until every task of the worker passed the barrier",
    "Async": "writing the state to checkpoint storage while processing went on",
    "Commit": "the Kafka transaction commit with the source offsets",
    "Size": "all state files the checkpoint references (incremental: newly uploaded)",
    "Per task": "sync = the synchronous snapshot at the barrier; alignment = trigger until the "
    "task's barrier passed; async = writing that task's state",
    "Lag": "records after the committed offset (from Kafka; counted by reading them when "
    "fewer than 1000 offsets behind, else end minus committed offset, which includes "
    "transaction markers), or after the worker's read position (from its metrics)",
}


def render(view: JobView, refresh: int = 5) -> str:
    """The whole page; ``refresh`` > 0 reloads it every that many seconds."""
    completed = [e for e in view.history if e.kind == "checkpoint" and e.status == "completed"]
    failed = [e for e in view.history if e.kind == "checkpoint" and e.status != "completed"]
    lags = [view.lag_of(t) for t in view.tasks]
    known_lags = [x for x in lags if x is not None]
    rates = list(view.rates.values())
    partitions = sum(len(t.partitions) for t in view.tasks)
    cards = [
        ("workers", str(len(view.workers)), "workers"),
        ("tasks", str(len(view.tasks)), "tasks"),
        ("partitions", str(partitions) if partitions else "—", "partitions"),
        ("lag", f"{sum(known_lags):.0f}" if known_lags else "—", "lag (records)"),
        ("rate", f"{sum(rates):.1f}" if rates else "—", "records/s"),
        ("completed", str(len(completed)), "completed checkpoints"),
        ("failed", str(len(failed)), "failed / aborted"),
        (
            "last",
            str(completed[0].checkpoint_id) if completed else "—",
            "last completed checkpoint",
        ),
    ]
    card_html = "".join(
        f'<div class="card" data-card="{k}"><div class="v">{escape(v)}</div>'
        f'<div class="k">{escape(label)}</div></div>'
        for k, v, label in cards
    )
    errors = "".join(f'<p class="err">{escape(e)}</p>' for e in view.errors)
    legend = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in LEGEND.items())
    meta_refresh = f'<meta http-equiv="refresh" content="{refresh}">' if refresh > 0 else ""
    workers = ", ".join(view.workers) or "—"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">{meta_refresh}
<title>Snapline · {escape(view.job)}</title><style>{CSS}</style></head>
<body><header><h1>Snapline job <span id="job">{escape(view.job)}</span></h1>
<div class="sub">checkpoint storage {escape(view.storage)} ·
 Kafka {escape(view.kafka or "not asked")} · {_time(view.generated_at)}</div></header><main>
<section id="overview"><h2>Overview</h2>{errors}<div class="cards">{card_html}</div>
<p>Workers: <span id="workers">{escape(workers)}</span></p></section>
<section><h2>Tasks</h2><table id="tasks"><tr><th>task</th><th>stage</th><th>worker</th>
<th>partitions</th><th>committed offset</th><th>end offset</th><th>lag</th><th>records/s</th>
<th>last checkpoint</th><th>taken</th><th>size</th></tr>{_task_rows(view)}</table></section>
<section><h2>Checkpoint history</h2><table id="history"><tr><th>kind</th><th>ID</th>
<th>worker</th><th>status</th><th>trigger time</th><th>end-to-end</th><th>alignment</th>
<th>async</th><th>commit</th><th>size</th><th>incremental</th><th>per task</th>
<th>reason / savepoint</th></tr>{_history_rows(view)}</table></section>
<section><h2>Checkpoints in storage</h2><table id="retained"><tr><th>task</th><th>ID</th>
<th>attempt</th><th>state</th><th>worker</th><th>created</th><th>size</th><th>sync</th>
<th>alignment</th><th>async</th><th>error</th></tr>{_retained_rows(view)}</table></section>
<section class="legend"><h2>Columns</h2><dl>{legend}</dl></section>
</main></body></html>"""
