"""How vLLM's own unit tests are fetched and read, without vLLM: a package
index served on loopback, which pip is set up for, stands for the user's.

The release's tests are code nobody here wrote, so they run only when the
bytes are the pinned ones; a report is read test by test.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstate.harness.vllm_engine import upstream

RELEASE = "0.32.0"


def _sdist(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{RELEASE}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture
def index(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, bytes]]:
    """A loopback index, the one pip is set up for: put the sdist's bytes in
    ``served["sdist"]``. Nothing of the machine's own pip setup is read."""
    served: dict[str, bytes] = {}
    name = f"vllm-{RELEASE}.tar.gz"

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/simple/vllm":
                body = f'<html><body><a href="/files/{name}">{name}</a></body></html>'.encode()
                kind = "text/html"
            elif self.path == f"/files/{name}" and "sdist" in served:
                body, kind = served["sdist"], "application/octet-stream"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    isolate_pip(monkeypatch, f"http://127.0.0.1:{server.server_address[1]}/simple/")
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()


def isolate_pip(monkeypatch: pytest.MonkeyPatch, index_url: str) -> None:
    """pip as a user set up for one index would run it: no config file, no other index."""
    for name in list(os.environ):
        if name.startswith("PIP_") and name != "PIP_CERT":
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", index_url)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")


GOOD = {
    upstream.SCHEDULER_TESTS: "# SPDX-License-Identifier: Apache-2.0\ndef test_x():\n    pass\n",
    "tests/__init__.py": "",
    "vllm/__init__.py": "raise ImportError('the package itself is never unpacked')\n",
}


def serve(index: dict[str, bytes], monkeypatch: pytest.MonkeyPatch, files: dict[str, str]) -> None:
    index["sdist"] = _sdist(files)
    monkeypatch.setitem(upstream.SDISTS, RELEASE, hashlib.sha256(index["sdist"]).hexdigest())


def test_the_pinned_sdist_is_fetched_through_pip_tests_only(
    index: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(index, monkeypatch, GOOD)
    upstream.fetch_tests(RELEASE, tmp_path / "tree")
    unpacked = sorted(
        str(p.relative_to(tmp_path / "tree")) for p in (tmp_path / "tree").rglob("*.py")
    )
    assert unpacked == sorted(["tests/__init__.py", upstream.SCHEDULER_TESTS])
    # the release's file as it ships, license header first
    text = (tmp_path / "tree" / upstream.SCHEDULER_TESTS).read_text()
    assert text.startswith("# SPDX-License-Identifier: Apache-2.0")


def test_bytes_that_are_not_the_pinned_ones_are_refused(
    index: dict[str, bytes], tmp_path: Path
) -> None:
    index["sdist"] = _sdist(GOOD)  # the real release's pin, other bytes
    with pytest.raises(upstream.UpstreamError, match=r"not the pinned .* refusing to run it"):
        upstream.fetch_tests(RELEASE, tmp_path / "tree")
    assert not (tmp_path / "tree").exists()


def test_an_sdist_without_the_scheduler_tests_is_refused_by_name(
    index: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(index, monkeypatch, {"tests/__init__.py": ""})
    with pytest.raises(upstream.UpstreamError, match="holds no tests/v1/kv_connector/unit"):
        upstream.fetch_tests(RELEASE, tmp_path / "tree")


def test_an_index_that_does_not_answer_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate_pip(monkeypatch, "http://127.0.0.1:9/simple/")  # a port nothing listens on
    with pytest.raises(upstream.UpstreamError, match=r"pip could not fetch vllm-0\.32\.0\.tar\.gz"):
        upstream.fetch_tests(RELEASE, tmp_path / "tree")


def test_no_index_host_is_named_in_the_code() -> None:
    """The user's pip setup decides where the sdist comes from."""
    text = Path(upstream.__file__).read_text()
    assert "://" not in text


def test_a_junit_report_is_read_test_by_test(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="t" name="a"/>'
        '<testcase classname="t" name="b"><failure message="x"/></testcase>'
        '<testcase classname="t" name="c"><skipped/></testcase>'
        '<testcase classname="t" name="d"><error message="y"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert upstream.outcomes(report) == {
        "t::a": "passed",
        "t::b": "failed",
        "t::c": "skipped",
        "t::d": "error",
    }
