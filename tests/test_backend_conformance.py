"""The backend conformance suite (tests/conformance.py) on LocalBackend and on real gloo ranks.

The gloo ranks run the whole suite once per world size (spawning ranks is the slow part); each
check is then reported as its own test. MPI runs the same bodies in tests/test_mpi.py.
"""

from __future__ import annotations

import pytest

import conformance
from onebit.backends import LocalBackend


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def gloo_outcomes(request, tmp_path_factory):
    return conformance.gloo_suite(request.param, tmp_path_factory.mktemp(f"gloo{request.param}"))


@pytest.mark.slow
@pytest.mark.parametrize("check", conformance.CHECK_NAMES)
def test_gloo_backend_conforms(gloo_outcomes, check):
    for rank, outcomes in enumerate(gloo_outcomes):
        status, detail = outcomes[check]
        assert status == "ok", f"rank {rank} of {len(gloo_outcomes)}: {check} {status}:\n{detail}"


@pytest.mark.parametrize("check", conformance.CHECK_NAMES)
def test_local_backend_conforms(tmp_path, check):
    conformance.CHECKS[check](LocalBackend(), tmp_path, 1)


def test_a_broken_backend_fails_the_suite(tmp_path):
    """The suite can fail: a one-process backend claiming two ranks, whose all_gather repeats its
    own input and whose all_to_all keeps every row, is caught (and the runner stops there)."""

    class Broken(LocalBackend):
        @property
        def world_size(self) -> int:
            return 2

        def all_gather(self, output, input):
            return output.copy_(input.expand_as(output))

        def all_to_all(self, output, input):
            return output.copy_(input)

    outcomes = conformance.run_all(Broken(), tmp_path, 2)
    assert outcomes["rank_and_world_size_are_consistent"][0] == "failed"
    assert outcomes["all_to_all_sends_row_j_to_rank_j"][0] == "not run"
    with pytest.raises(AssertionError, match="received"):
        conformance.check_all_to_all_sends_row_j_to_rank_j(Broken(), tmp_path, 2)
