"""The OffloadingConnector's history rows: what each names, checked without vLLM."""

from __future__ import annotations

import pytest

from kvstate.harness.vllm_engine import history, overlay, upstream


def test_every_row_names_a_case_of_the_driver_and_pinned_releases() -> None:
    import ast
    from pathlib import Path

    source = Path(history.__file__).with_name("history_cases.py").read_text()
    cases = next(
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "CASES"
    )
    assert isinstance(cases, ast.Dict)
    names = {key.value for key in cases.keys if isinstance(key, ast.Constant)}
    for fix, row in history.ROWS.items():
        for case, release in row:
            assert case in names, (fix, case)
            assert release == history.BASE or release in overlay.WHEELS, (fix, release)
            assert release in upstream.SDISTS, (fix, release)


def test_an_unknown_row_is_refused_before_anything_is_fetched(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert history.main(["99999"]) == 2
    assert "no row for 99999" in capsys.readouterr().err


def test_a_release_without_a_pinned_wheel_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(overlay.OverlayError, match="no pinned vllm wheel"):
        overlay.site(tmp_path, "0.1.0")
