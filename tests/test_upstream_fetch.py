"""How vLLM's own unit tests are fetched and read, without vLLM: a package
index served on loopback stands for the real one.

The release's tests are code nobody here wrote, so they run only when the
bytes are the pinned ones; a report is read test by test.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstate.harness.vllm import upstream

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
    """A loopback index: put the sdist's bytes in ``served["sdist"]``."""
    served: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            host = f"http://127.0.0.1:{self.server.server_address[1]}"
            if self.path == "/simple/vllm/":
                name = f"vllm-{RELEASE}.tar.gz"
                body = json.dumps({"files": [{"filename": name, "url": f"{host}/f"}]}).encode()
            else:
                body = served["sdist"]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(
        upstream, "INDEX", f"http://127.0.0.1:{server.server_address[1]}/simple/vllm/"
    )
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()


GOOD = {
    upstream.SCHEDULER_TESTS: "# SPDX-License-Identifier: Apache-2.0\ndef test_x():\n    pass\n",
    "tests/__init__.py": "",
    "vllm/__init__.py": "raise ImportError('the package itself is never unpacked')\n",
}


def test_the_pinned_sdist_is_unpacked_tests_only(
    index: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index["sdist"] = _sdist(GOOD)
    monkeypatch.setitem(upstream.SDISTS, RELEASE, hashlib.sha256(index["sdist"]).hexdigest())
    sdist = tmp_path / "s.tar.gz"
    upstream._download(RELEASE, sdist)
    upstream._unpack(sdist, f"vllm-{RELEASE}/", tmp_path / "tree")
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
    index["sdist"] = _sdist(GOOD)
    with pytest.raises(upstream.UpstreamError, match=r"not the pinned .* refusing to run it"):
        upstream._download(RELEASE, tmp_path / "s.tar.gz")


def test_an_sdist_without_the_scheduler_tests_is_refused_by_name(
    index: dict[str, bytes], tmp_path: Path
) -> None:
    sdist = tmp_path / "s.tar.gz"
    sdist.write_bytes(_sdist({"tests/__init__.py": ""}))
    with pytest.raises(upstream.UpstreamError, match="holds no tests/v1/kv_connector/unit"):
        upstream._unpack(sdist, f"vllm-{RELEASE}/", tmp_path / "tree")


def test_an_index_that_does_not_answer_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a port nothing listens on
    monkeypatch.setattr(upstream, "INDEX", "http://127.0.0.1:9/simple/vllm/")
    with pytest.raises(upstream.UpstreamError, match=r"fetching vllm-0\.32\.0\.tar\.gz from"):
        upstream._download(RELEASE, tmp_path / "s.tar.gz")


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
