"""vLLM's OffloadingConnector release by release: before each fix and after it, observed.

Each release's ``vllm`` package is laid over the 0.32.0 venv
(:mod:`kvstate.harness.vllm_engine.overlay`): the 0.32.0 venv's torch and
libraries, the older release's vLLM.

The bugs are driven through the release's own offloading unit-test harness
(its ``RequestRunner``: vLLM's real V1 scheduler and the connector's two
halves, with a mocked tier), from the release's source distribution, by
:mod:`kvstate.harness.vllm_engine.history_cases` under
:func:`kvstate.vllm.install`. :func:`run_case` runs one case on one release
and returns what happened; replaying its journals is the caller's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from journal import atomic_output
from kvstate.harness.vllm_engine import overlay, upstream, venvs

BASE = overlay.BASE
#: the upstream fix -> ((case, release) without it, (case, release) with it):
#: the last release before the fix and the first after, where one exists;
#: vLLM #52211 was never merged, so its "with" is 0.32.0 with the PR's change;
#: the cache reset's fence came with no PR of its own this names: the last
#: release without it (0.32.0) and the first with it (0.33.0)
ROWS = {
    "29870": (("unflushed-preemption", "0.13.0"), ("unflushed-preemption", "0.14.0")),
    "39186": (("acknowledged-after-resume", "0.20.0"), ("acknowledged-after-resume", "0.21.0")),
    "46014": (("load-under-store", "0.23.0"), ("load-under-store", "0.24.0")),
    "52211": (("stale-store-cursor", "0.32.0"), ("rewound-store-cursor", "0.32.0")),
    "reset-fence": (("reset-late-write", "0.32.0"), ("reset-late-write", "0.33.0")),
}
MARKER = ".kvstate-history"
#: what the cases need of the release's source distribution: the offloading
#: tests' folder, one file of them before 0.15
TESTS = f"{upstream.UNIT}/offloading_connector"
SINGLE_FILE = {"0.13.0", "0.14.0"}


def _expect(release: str) -> str:
    if release in SINGLE_FILE:
        return f"{upstream.UNIT}/test_offloading_connector.py"
    return TESTS


class HistoryError(RuntimeError):
    """A release could not be laid over the base venv, or a case could not run."""


def tests(root: Path, release: str) -> Path:
    """The release's unit tests (its ``tests/`` tree), fetched once."""
    if release == BASE or release in upstream.OVERLAID:  # the tree its unit tests run from
        return upstream.ensure(root, release)
    tree = venvs.ensure(root, BASE) / "history" / f"vllm-{release}-tests"
    marker = tree / MARKER
    if marker.is_file() and marker.read_text().strip() == upstream.SDISTS[release]:
        return tree
    with tempfile.TemporaryDirectory(dir=tree.parent if tree.parent.exists() else None) as tmp:
        unpacked = Path(tmp) / "tree"
        upstream.fetch_tests(release, unpacked, expect=_expect(release))
        if tree.exists():
            shutil.rmtree(tree)
        tree.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(unpacked), tree)
    with atomic_output(marker, force=True) as out:
        Path(out).write_text(upstream.SDISTS[release] + "\n")
    return tree


def run_case(root: Path, release: str, case: str, journals: Path) -> dict[str, Any]:
    """Case ``case`` on ``release``, journaled into ``journals`` (a new folder).

    Returns the case's result: the vLLM version it ran on, and the error
    vLLM raised (None when it raised none).
    """
    if journals.exists():
        raise HistoryError(f"{journals} already exists: journals go into a new folder")
    tree = tests(root, release)
    python = venvs.python_of(venvs.venv_path(root, BASE))
    try:
        # the release's vLLM ahead of the venv's; its tests importable as `tests`
        if release == BASE:
            env = {**os.environ, "PYTHONPATH": str(tree)}
        else:
            env = overlay.environ(root, release, tree)
    except overlay.OverlayError as exc:
        raise HistoryError(str(exc)) from exc
    env.update(HF_HOME=str(upstream.model_cache(tree)), HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = [str(python), "-m", "kvstate.harness.vllm_engine.history_cases"]
        argv += [case, str(journals), str(out)]
        done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
        if done.returncode or not out.is_file():
            raise HistoryError(
                f"{case} on vLLM {release} failed (status {done.returncode}):\n"
                f"{done.stdout[-2000:]}{done.stderr[-3000:]}"
            )
        result: dict[str, Any] = json.loads(out.read_text())
    if result.get("vllm") != release:
        raise HistoryError(f"{case} ran on vLLM {result.get('vllm')}, not {release}")
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstate.harness.vllm_engine.history [FIX ...] [--out DIR]``.

    Each fix's row (vLLM PR or issue numbers, all by default): its case
    without the fix and with it; prints where the journals are, and the
    command that judges them. ``--fetch`` only installs what the rows need
    (``make vllm-unit-tests``), so the tests that run them need no network.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    root = Path(__file__).resolve().parents[3]
    if args == ["--fetch"]:
        releases = sorted({r for row in ROWS.values() for _, r in row} - {BASE})
        try:
            for release in releases:
                print(f"vLLM {release}: {overlay.site(root, release)}", flush=True)
                print(f"vLLM {release}'s tests: {tests(root, release)}", flush=True)
        except (HistoryError, overlay.OverlayError, upstream.UpstreamError, venvs.VenvError) as exc:
            print(f"history: {exc}", file=sys.stderr)
            return 1
        return 0
    out = Path("vllm-history")
    if "--out" in args:
        at = args.index("--out")
        out, args = Path(args[at + 1]), args[:at] + args[at + 2 :]
    unknown = [f for f in args if f not in ROWS]
    if unknown:
        print(f"no row for {', '.join(unknown)} (known: {', '.join(ROWS)})", file=sys.stderr)
        return 2
    for fix in args or list(ROWS):
        for case, release in ROWS[fix]:
            journals = out / f"{case}-{release}"
            try:
                result = run_case(root, release, case, journals)
            except (HistoryError, upstream.UpstreamError, venvs.VenvError) as exc:
                print(f"{case} on vLLM {release}: {exc}", file=sys.stderr)
                return 1
            ended = result["error"] or "no error"
            name = f"vLLM #{fix}" if fix.isdigit() else fix
            print(f"{name}: {case} on {release}: {ended}; kvstate replay {journals}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
