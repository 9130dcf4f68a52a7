"""What vLLM's connector unit tests take from vLLM's top-level ``tests/conftest.py``.

That conftest wants vLLM's whole test stack (model downloads, tblib, the
GPU helpers) and is not copied (:mod:`kvstate.harness.vllm_engine.upstream`).
The connector tests use two fixtures of it: ``dist_init``, a one-process
distributed environment (world size 1, gloo on this CPU machine) around a
test, and ``default_vllm_config``, a default ``VllmConfig`` current around
it. This plugin provides both, written here, in every mode (plain and
observed alike), so a test's outcome depends only on the observer.

    pytest -p kvstate.harness.vllm_engine.unit_fixtures ...
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def dist_init() -> Iterator[None]:
    """A one-process distributed environment and model-parallel groups of size 1."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )

    handle, rendezvous = tempfile.mkstemp(prefix="kvstate-dist-")
    os.close(handle)
    # vLLM's parallel state reads the current config, also while it is torn down.
    with set_current_vllm_config(VllmConfig()):
        try:
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"file://{rendezvous}",
                local_rank=0,
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
            yield
        finally:
            cleanup_dist_env_and_memory()
            with contextlib.suppress(FileNotFoundError):  # torch's file store may remove it
                os.unlink(rendezvous)


@pytest.fixture
def default_vllm_config() -> Iterator[None]:
    """A default ``VllmConfig``, current for the test (what vLLM's code reads globally)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield
