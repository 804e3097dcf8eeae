"""Policy parameters are checked within their domains where they are parsed: a value
that passed the parser and failed later was exit 70 (random:seed=-1, a window of 2^63 - 1)."""

from __future__ import annotations

import pytest

from kvtrace.whatif import PolicyError, parse_policy
from kvtrace.whatif.policies import KERNEL_MAX, REGISTRY, SEED_MAX, TOKENS_MAX

OUT_OF_DOMAIN = [
    ("random:seed=-1", "seed must be in [0, 9223372036854775807], got -1"),
    (f"random:seed={SEED_MAX + 1}", "seed must be in"),
    (f"streaming_llm:window={2**63 - 1}", f"window must be in [0, {TOKENS_MAX}]"),
    ("streaming_llm:n_sink=-1", "n_sink must be in"),
    (f"snapkv:kernel_size={2**63 - 1}", f"kernel_size must be in [1, {KERNEL_MAX}]"),
    ("snapkv:window_size=0", "window_size must be in [1,"),
    (f"kivi:group_size={2**63 - 1}", "group_size must be in"),
    (f"kivi:residual_length={2**40}", "residual_length must be in"),
    (f"quanto:q_group_size={2**31}", "q_group_size must be in"),
    (f"hqq:residual_length={-5}", "residual_length must be in"),
    ("expected_attention:epsilon=inf", "epsilon must be in [0, 1e+06], got inf"),
    ("expected_attention:epsilon=nan", "epsilon must be in"),
    (f"expected_attention:n_sink={2**63}", "n_sink must be in"),
    ("random:seed=" + "9" * 5000, "seed must be an integer"),  # past Python's digit limit
]


@pytest.mark.parametrize(("text", "phrase"), OUT_OF_DOMAIN)
def test_out_of_domain_is_a_policy_error_naming_the_range(text, phrase):
    with pytest.raises(PolicyError) as info:
        parse_policy(text)
    assert phrase in str(info.value) and str(info.value).startswith(text.split(":")[0] + ":")


def test_the_edges_of_each_domain_parse():
    for text in (f"random:seed={SEED_MAX}", "random:seed=0", f"streaming_llm:window={TOKENS_MAX}",
                 f"snapkv:kernel_size={KERNEL_MAX}", "snapkv:window_size=1", "kivi:residual_length=0",
                 "expected_attention:epsilon=1e6"):
        parse_policy(text)


def test_every_default_is_in_its_domain():
    for cls in REGISTRY.values():
        cls()  # the constructor checks the ranges too (library callers)


def test_the_constructor_checks_the_domain():
    from kvtrace.whatif.policies import StreamingLLM

    with pytest.raises(PolicyError, match="window must be in"):
        StreamingLLM(window=2**63 - 1)


@pytest.mark.parametrize("text", ["random:seed=-1", f"streaming_llm:window={2**63 - 1}",
                                  f"snapkv:kernel_size={2**63 - 1}"])
def test_cli_usage_error_exit_64(text, tmp_path, capsys):
    from kvtrace import exitcodes
    from tests.helpers.cli_run import run_main

    for argv in (["whatif", str(tmp_path / "absent.kvt.h5"), "--policy", text],
                 ["report", str(tmp_path / "absent.kvt.h5"), "-o", str(tmp_path / "r.html"), "--whatif", text]):
        code, _, err = run_main(argv, capsys)
        assert code == exitcodes.USAGE, err
        assert "must be in [" in err and err.count("\n") == 1 and "Traceback" not in err
