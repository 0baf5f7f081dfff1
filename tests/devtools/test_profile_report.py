"""`execupy profile` and `execupy generate --profile`: one self-contained HTML report, checked as
text and, where Debian's Chromium is installed, as a browser renders it (the charts are drawn
by the page's own script, so only a browser shows whether they are there)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from execupy.devtools.tracer import profile_name
from execupy.schema import program as P
from execupy.schema.reader import read_pte

REPO = Path(__file__).resolve().parents[2]
MLP = REPO / "execupy" / "examples" / "mlp.pte"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def execupy(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "execupy", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def kernel_ops(pte: Path) -> set[str]:
    plan = read_pte(pte.read_bytes()).program.execution_plan[0]
    return {profile_name(plan.operators[ins.op_index].key).removeprefix("native_call_")
            for ins in plan.instructions if isinstance(ins, P.KernelCall)}


def assert_self_contained(html: str) -> None:
    """Nothing the page would fetch: no external scripts, styles, images or links."""
    assert not re.search(r"<(script|img|link|iframe)[^>]+(src|href)=", html)
    assert "@import" not in html and "url(" not in html


def rendered_bars(report: Path, tmp_path: Path) -> dict[str, list[float]]:
    """Chart id -> the widths, as laid out by Chromium, of the bars the page's script drew."""
    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync", "--no-first-run",
                           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--dump-dom", report.as_uri()],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    charts = {}
    for chart_id, body in re.findall(r'<svg[^>]*id="(chart-[^"]+)"[^>]*>(.*?)</svg>', proc.stdout, re.S):
        charts[chart_id] = [float(w) for w in re.findall(r'<rect[^>]*data-drawn-width="([0-9.]+)"', body)]
    return charts


def test_profile_writes_a_self_contained_report_of_every_operator(tmp_path):
    report = tmp_path / "report.html"
    proc = execupy("profile", str(MLP), "--random-inputs", "--repeat", "3", "-o", str(report))
    assert f"report written to {report}" in proc.stdout
    html = report.read_text()
    assert_self_contained(html)
    for op in kernel_ops(MLP):  # in the chart's data and in the table
        assert f'"op": "{op}"' in html and f"<td>{op}</td>" in html
    assert "3 run(s)" in html
    assert not list(tmp_path.glob(".*"))  # written atomically: no temporary file left behind


def test_profile_refuses_missing_inputs_with_a_reason(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "execupy", "profile", str(MLP), "-o", str(tmp_path / "r.html")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 1 and "--random-inputs" in proc.stderr
    assert not (tmp_path / "r.html").exists()


@pytest.fixture(scope="module")
def smollm2_pte():
    from tests.llm.smollm2_cache import smollm2_program_or_skip

    return smollm2_program_or_skip()


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium to render the report (apt-get install chromium)")
def test_chromium_renders_the_smollm2_profile_with_non_empty_charts(smollm2_pte, tmp_path):
    report = tmp_path / "smollm2.html"
    execupy("profile", str(smollm2_pte), "--random-inputs", "--repeat", "1", "-o", str(report))
    assert_self_contained(report.read_text())
    charts = rendered_bars(report, tmp_path)
    bars, timeline = charts["chart-bars0"], charts["chart-timeline0"]
    assert len(bars) >= 10 and all(w >= 1 for w in bars) and max(bars) > 100  # the largest bar is long
    assert bars == sorted(bars, reverse=True)  # the costliest operator first
    assert len(timeline) > 1000 and sum(timeline) > 500  # every op of one forward call, across the width


@pytest.mark.slow
def test_generate_profile_reports_prefill_and_decode(smollm2_pte, tmp_path):
    report = tmp_path / "generate.html"
    proc = execupy("generate", str(smollm2_pte), "--prompt", "Name a colour.", "--max-new-tokens", "4",
                   "--ignore-eos", "--profile", str(report))
    assert proc.stdout.strip()  # the text still comes out
    assert f"profile written to {report}" in proc.stderr
    html = report.read_text()
    assert_self_contained(html)
    headings = re.findall(r"<h2>([^<]*)</h2>", html)
    assert headings[0].startswith("prefill: ") and headings[1] == "decode: 3 call(s) of one token"
    if CHROMIUM is not None:
        charts = rendered_bars(report, tmp_path)
        assert all(charts[f"chart-bars{k}"] and charts[f"chart-timeline{k}"] for k in (0, 1))
