"""Hostile or mistyped hostlist expressions get a HostlistError, never a raw one."""

import pytest

from ft_launch.errors import ExitCode, UsageError
from ft_launch.slurm.hostlist import MAX_HOSTS, HostlistError, compress, expand


def test_the_error_is_a_usage_error_naming_the_input():
    with pytest.raises(HostlistError) as info:
        expand("n[1-3")
    assert isinstance(info.value, UsageError) and info.value.exit_code is ExitCode.USAGE
    assert "bad hostlist 'n[1-3'" in str(info.value) and "n[1-4,7]" in str(info.value)


def test_a_bound_of_thousands_of_digits_is_refused():
    with pytest.raises(HostlistError, match="more than 18 digits") as info:
        expand("n[1-" + "9" * 5000 + "]")
    assert len(str(info.value)) < 500  # the message quotes the input cut short


@pytest.mark.parametrize("expression", [
    "n[0-99999999]",                                  # python-hostlist's cap is 100,000
    f"n[1-{MAX_HOSTS + 1}]",
    f"a[1-{MAX_HOSTS}],b1",                          # the total over items counts
    "a[1-1000]b[1-1000]",                            # so does the product of groups
    "a[1-999999999999999999]b[1-999999999999999999]c[1-9]",
])
def test_expansion_past_the_cap_is_refused_before_it_is_built(expression):
    with pytest.raises(HostlistError, match=f"more than {MAX_HOSTS} names"):
        expand(expression)


def test_the_cap_itself_expands():
    names = expand(f"n[1-{MAX_HOSTS}]")
    assert len(names) == MAX_HOSTS and names[-1] == f"n{MAX_HOSTS}"


@pytest.mark.parametrize("expression", [
    "n$x", "n x", "n/../x", "n\n1", "n\x00", "n²", "nü[1-2]", "n[١-٣]", "n[1-2]$",
    "n[1-2]/x", "'n1'", "n;rm", "n[[1]]", "n[1]]", "n[]", "n[-1]", "n[1-]", "n[a-b]",
    "n" * 256,
])
def test_names_outside_slurm_host_characters_are_refused(expression):
    with pytest.raises(HostlistError, match="bad hostlist"):
        expand(expression)


def test_allowed_characters_expand():
    assert expand("gpu-01.ib_0,a[08-10]z.b") == ["gpu-01.ib_0", "a08z.b", "a09z.b", "a10z.b"]
    assert compress(["n1", "n2", "n3", "n07", "x"]) == "n[1-3],n07,x"
