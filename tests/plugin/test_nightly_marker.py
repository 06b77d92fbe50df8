"""``@pytest.mark.parity_nightly``: a long parity check runs only under the nightly job's hypothesis profile."""
import pytest
from hypothesis import settings

from pytest_npu_parity import hypothesis_profiles as profiles

LONG = """
import pytest

@pytest.mark.parity_nightly
def test_long():
    print("LONG RAN")

def test_short():
    pass
"""


@pytest.mark.parametrize("args, ran", [
    (("--npu-parity",), False),
    (("--npu-parity", "--hypothesis-profile", "nightly"), True),
    (("--npu-parity", "--hypothesis-profile", "default"), False),
])
def test_a_nightly_check_runs_only_under_the_nightly_profile(pytester, args, ran):
    pytester.makepyfile(LONG)
    before = profiles.current_profile_name()
    try:
        result = pytester.runpytest("-s", "-rs", "-p", "no:cacheprovider", "--parity-device", "cpu",
                                    "--strict-markers", *args)
    finally:
        settings.load_profile(before)
    result.assert_outcomes(passed=1 + ran, skipped=0 if ran else 1)
    if ran:
        result.stdout.fnmatch_lines(["*LONG RAN*"])
    else:
        result.stdout.fnmatch_lines(["*parity_nightly: runs in the nightly job (--hypothesis-profile nightly)*"])
