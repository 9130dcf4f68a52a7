"""The alerting rules for kvstate's figures on vLLM's own ``/metrics``.

``docs/ops/kvstate-vllm-alerts.yml`` is checked by ``promtool check rules``
and evaluated by ``promtool test rules`` (Debian's prometheus package) on
series shaped as vLLM publishes them: ``vllm:kvstate_violations_total``
labelled ``code``, ``engine`` and ``model_name`` (kvstate.vllm._stats), and
``job`` and ``instance`` by the scrape. A code counted for the first time
starts a series whose first sample is already above zero, and must page; a
count that grows again must page; an old count that stays flat must not.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "docs" / "ops" / "kvstate-vllm-alerts.yml"
#: the labels a series on vLLM's /metrics has: vLLM's, kvstate's code, the scrape's
LABELS = {"engine": "0", "model_name": "m", "job": "vllm", "instance": "gpu-7:8000"}
ALERT = "KvstateVllmViolation"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("promtool") is None:
        pytest.fail("Debian's prometheus is not installed (make system-packages installs it)")
    return subprocess.run(["promtool", *args], capture_output=True, text=True)


def _series(code: str) -> str:
    labels = ",".join(f'{k}="{v}"' for k, v in sorted({**LABELS, "code": code}.items()))
    return f"vllm:kvstate_violations_total{{{labels}}}"


def _fired(code: str) -> dict[str, object]:
    return {
        "exp_labels": {**LABELS, "code": code, "severity": "page"},
        "exp_annotations": {
            "summary": f"kvstate: new {code} finding(s) in vLLM engine 0 on gpu-7:8000",
            "description": (
                f"kvstate's live audit found {code} in the journal of vLLM engine 0 (m) on "
                "gpu-7:8000. The journals are on that host, in the connector's "
                "`kvstate_journal_dir` folder (else $KVSTATE_VLLM_JOURNAL_DIR, else "
                "./kvstate-journals in vLLM's working directory): `kvstate replay DIR/*.db` "
                "explains each finding with the records that led to it (docs/vllm.md)."
            ),
        },
    }


def test_the_vllm_rules_are_valid() -> None:
    done = _promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 1 rules found" in done.stdout


def test_they_name_only_labels_vllm_publishes() -> None:
    text = RULES.read_text()
    assert set(re.findall(r"\$labels\.(\w+)", text)) <= {*LABELS, "code"}
    assert set(re.findall(r"\b(vllm:\w+|kvstate_\w+)\b", text)) <= {
        "vllm:kvstate_violations_total",
        "kvstate_journal_dir",  # the extra config's key, named in the annotation
    }


def test_new_findings_page_and_old_ones_do_not(tmp_path: Path) -> None:
    # one sample a minute; a series begins where its values do
    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    # a code first counted at 15m (`_xN`: N missing samples), its first sample 5
                    {"series": _series("UNFLUSHED_REUSE"), "values": "_x15 5x30"},
                    # counted before, flat since
                    {"series": _series("POISONED_KEY"), "values": "3x45"},
                    # counted before, one more at 30m
                    {"series": _series("STALE_GENERATION"), "values": "1x29 2x15"},
                ],
                "alert_rule_test": [
                    {"eval_time": "14m", "alertname": ALERT, "exp_alerts": []},
                    {
                        "eval_time": "15m",
                        "alertname": ALERT,
                        "exp_alerts": [_fired("UNFLUSHED_REUSE")],
                    },
                    {
                        "eval_time": "24m",
                        "alertname": ALERT,
                        "exp_alerts": [_fired("UNFLUSHED_REUSE")],
                    },
                    {"eval_time": "26m", "alertname": ALERT, "exp_alerts": []},
                    {
                        "eval_time": "30m",
                        "alertname": ALERT,
                        "exp_alerts": [_fired("STALE_GENERATION")],
                    },
                    {"eval_time": "45m", "alertname": ALERT, "exp_alerts": []},
                ],
            }
        ],
    }
    unit = tmp_path / "vllm-alerts-test.yml"
    unit.write_text(json.dumps(tests))  # JSON is YAML
    done = _promtool("test", "rules", str(unit))
    assert done.returncode == 0, done.stdout + done.stderr
