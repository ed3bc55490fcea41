"""`leanagent bench abuse`: attacks that once cost this server seconds, gigabytes, a lockout or a traceback within
every limit, replayed against real `leanagent serve` processes on 127.0.0.1 (and the commands that must refuse at
once), each bounded in count and time, and what each costs the server.

Per attack (the table of them is `leanagent.bench.attacks.ATTACKS`): the answers' statuses (or the command's exit
code), the server process's CPU seconds over the attack (psutil: user + system, whatever else the machine runs) and
per request, its peak resident memory during the attack (Linux's VmHWM, reset before each attack through
/proc/PID/clear_refs) against the idle server's, its resident memory a second after, the worst latency of
`GET /health` asked every 100 ms on a new connection all along, and the lines (and tracebacks) it logged. The
common bars: no 500, at most 2 s of CPU per request, a peak within 1.5 times the idle server's or within its body
budget (--bodies-mb) above it, /health within 2 s, no traceback; and each attack's own (`Attack.bar`, checked by the
attack: `Outcome.problems`). The command exits 1 when a row fails.

Attacks that need the same server flags share one server, one after another. The index is the demo's shape (the
tiny random encoder over a demo repository), built once under `work`.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from leanagent.bench.attacks import ATTACKS, Attack, Context, build_index_for
from leanagent.bench.options import AbuseOptions
from leanagent.bench.results import Section
from leanagent.bench.target import HealthWatch, Server

SETTLE_S = 1.0
MAX_CPU_PER_REQUEST_S = 2.0
MAX_PEAK_RATIO = 1.5
MAX_HEALTH_S = 2.0
# What asking /health meets while the server stops: its connections closed, then refused.
STOPPING = ("ConnectionRefusedError", "ConnectionResetError", "RemoteDisconnected", "BrokenPipeError", "503")
BODIES_MB = 256.0  # --bodies-mb's default: a peak within it above the idle server's passes


@dataclass
class AttackRow:
    attack: str
    bar: str
    what: str
    statuses: dict[str, int]
    requests: int
    cpu_s: float | None = None
    cpu_s_per_request: float | None = None
    idle_rss_mb: float | None = None
    peak_rss_mb: float | None = None
    rss_after_mb: float | None = None
    health_worst_s: float | None = None
    health_failures: int | None = None
    log_lines: int = 0
    tracebacks: int = 0
    note: str = ""
    problems: list[str] = field(default_factory=list)  # the attack's own bar, not met
    verdict: str = ""

    def judge(self) -> str:
        problems = list(self.problems)
        if any(status.startswith("5") and status != "503" for status in self.statuses):
            problems.append("a 5xx")
        if self.cpu_s_per_request is not None and self.cpu_s_per_request > MAX_CPU_PER_REQUEST_S:
            problems.append("CPU")
        if self.peak_rss_mb is not None and self.idle_rss_mb is not None and \
                self.peak_rss_mb > max(MAX_PEAK_RATIO * self.idle_rss_mb, self.idle_rss_mb + BODIES_MB):
            problems.append("memory")
        if self.health_worst_s is not None and (self.health_worst_s > MAX_HEALTH_S or self.health_failures):
            problems.append("/health")
        if self.tracebacks:
            problems.append("traceback")
        return "ok" if not problems else "FAIL: " + ", ".join(problems)


@dataclass
class AbuseFigures(Section):
    size: str
    rows: list[AttackRow] = field(default_factory=list)
    seconds: float = 0.0

    def flat(self) -> dict:
        return {"size": self.size, "seconds": self.seconds, "rows": [asdict(r) for r in self.rows],
                "failed": self.failures()}

    def failures(self) -> list[str]:
        """The attacks whose row failed a bar (the command then exits 1); one not run (it needs root) is none."""
        return [r.attack for r in self.rows if r.verdict != "ok" and not r.verdict.startswith("not run")]


def bench_abuse(options: AbuseOptions) -> AbuseFigures:
    if not Path("/proc/self/status").is_file():
        raise RuntimeError("bench abuse reads the server's memory from /proc (Linux)")
    wanted = [a for a in ATTACKS if not options.attacks or a.name in options.attacks]
    figures = AbuseFigures(options.size)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="leanagent-abuse-") as tmp:
        work = Path(options.work or tmp)
        index = build_index_for(work)
        groups: dict[tuple, list] = {}
        for attack in wanted:
            groups.setdefault((attack.source, attack.args, attack.nofile), []).append(attack)
        ctx = Context(work, index, options.size == "small")
        for (source, args, nofile), attacks in groups.items():
            if source == "none":
                for attack in attacks:
                    figures.rows.append(_refusal(attack, ctx))
                continue
            server = Server(ctx.source(source), ctx.expand(args), work / "access.log", nofile)
            try:
                for k, attack in enumerate(attacks):
                    figures.rows.append(_measured(attack, ctx, server))
                    if server.proc.poll() is not None and k + 1 < len(attacks):  # ended by the attack (a signal)
                        server = Server(ctx.source(source), ctx.expand(args), work / "access.log", nofile)
            finally:
                server.stop()
    figures.seconds = round(time.perf_counter() - start, 1)
    return figures


def _measured(attack: Attack, ctx: Context, server: Server) -> AttackRow:
    time.sleep(SETTLE_S)
    server.reset_peak()
    lines_before, cpu_before = len(server.lines), server.cpu_s()
    with HealthWatch(server.url) as health:
        outcome = attack.run(ctx, server)
        time.sleep(SETTLE_S)  # what the server does once the clients are gone (the memory it gives back)
    alive = server.proc.poll() is None
    cpu = server.cpu_s() - cpu_before if alive else None
    logged = server.lines[lines_before:]
    # A server the attack stopped (a signal) closes its connections and then refuses them: not a failure of /health.
    failures = [f for f in health.failures if alive or f not in STOPPING]
    if not attack.health:  # an attack that holds more sockets than the server may take: /health may be refused
        failures = []
    row = AttackRow(attack.name, attack.bar, attack.what, dict(outcome.statuses), outcome.requests,
                    round(cpu, 2) if cpu is not None else None,
                    round(cpu / outcome.requests, 3) if cpu is not None and outcome.requests else None,
                    round(server.idle_rss_mb), round(server.peak_mb()) if alive else None,
                    round(server.rss_mb()) if alive else None,
                    round(max(health.latencies), 3) if health.latencies else None, len(failures),
                    len(logged), sum("Traceback" in line for line in logged), outcome.note, outcome.problems)
    row.verdict = row.judge()
    return row


def _refusal(attack: Attack, ctx: Context) -> AttackRow:
    outcome = attack.run(ctx, None)
    row = AttackRow(attack.name, attack.bar, attack.what, dict(outcome.statuses), outcome.requests,
                    note=outcome.note, problems=outcome.problems)
    row.tracebacks = int("Traceback" in outcome.note)
    if "not run" in outcome.statuses:
        row.verdict = f"not run: {outcome.note}"
        return row
    wrong = [f"{n} x {status}" for status, n in outcome.statuses.items() if status != attack.exits]
    problems = [*wrong, *outcome.problems, *(["traceback"] if row.tracebacks else [])]
    row.verdict = "ok" if not problems else "FAIL: " + ", ".join(problems)
    return row


def _cell(value: object, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def abuse_table(f: AbuseFigures, markdown: bool = False) -> str:
    head = ["attack", "its bar", "answers", "server CPU s (per request)", "peak RSS MB (idle)", "RSS after MB",
            "worst /health s", "log lines", "verdict"]
    rows = []
    for r in f.rows:
        answers = ", ".join(f"{n} x {s}" for s, n in sorted(r.statuses.items()))
        cpu = "-" if r.cpu_s is None else f"{r.cpu_s:.2f} ({_cell(r.cpu_s_per_request, 3)})"
        peak = "-" if r.peak_rss_mb is None else f"{r.peak_rss_mb:,} ({r.idle_rss_mb:,})"
        lines = f"{r.log_lines}" + (f" ({r.tracebacks} tracebacks)" if r.tracebacks else "")
        rows.append([r.attack, r.bar, answers, cpu, peak, _cell(r.rss_after_mb), _cell(r.health_worst_s, 3),
                     lines, r.verdict])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(row) + " |" for row in rows]
    else:
        widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
        out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
        out += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    notes = [f"- {r.attack}: {r.what}" + (f" ({r.note})" if r.note else "") for r in f.rows]
    return "\n".join([f"bench abuse ({f.size}, {f.seconds:.0f} s)", *out, "", *notes])
