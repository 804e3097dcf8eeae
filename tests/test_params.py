"""The one comma-list splitter, KEY=VALUE parser and model-spec reader (kvtrace.params,
kvtrace.modelspec), and the call sites that now use them answering as before."""

from __future__ import annotations

import pytest

from kvtrace.modelspec import preset_name, tiny_shrink
from kvtrace.params import split_key_value, split_list


@pytest.mark.parametrize("text, items", [
    ("a,b", ["a", "b"]), (" a , b ,", ["a", "b"]), (",,", []), ("", []), ("one", ["one"]),
    ("model_type, transformers_version", ["model_type", "transformers_version"]),
])
def test_split_list_strips_and_drops_empty_items(text, items):
    assert split_list(text) == items


@pytest.mark.parametrize("item, kv", [
    ("k=v", ("k", "v")), ("k=v=w", ("k", "v=w")), ("k=", ("k", "")), ("=v", ("", "v")),
    (" k = v ", (" k ", " v ")), ("k", None), ("", None),
])
def test_split_key_value_splits_at_the_first_equals_as_written(item, kv):
    assert split_key_value(item) == kv


def test_fleet_selectors_read_as_before():
    from kvtrace.fleet.compare import Selector

    assert Selector.parse(" transformers_version = 5.23.0 ") == Selector("transformers_version", "5.23.0")
    assert Selector.parse("k=a=b") == Selector("k", "a=b")
    for bad in ("novalue", "=5", " =5"):
        with pytest.raises(ValueError, match="expected KEY=VALUE"):
            Selector.parse(bad)


def test_policy_parameters_read_as_before():
    from kvtrace.whatif.policies import PolicyError, parse_policy

    assert parse_policy("kivi:nbits=2, group_size=64,").label() == parse_policy("kivi:group_size=64,nbits=2").label()
    with pytest.raises(PolicyError, match="unknown parameter 'nbits'; parameters"):
        parse_policy("kivi:nbits")  # no '=': the whole item is named
    with pytest.raises(PolicyError, match="unknown parameter 'nbits '"):
        parse_policy("kivi:nbits =2")  # spaces inside an item count, as they always did


def test_whatif_labels_shorten_as_before():
    from kvtrace.report.whatif_section import _short

    assert _short("kivi:nbits=4,group_size=32") == "kivi 4b"
    assert _short("fp8:fmt=e4m3") == "fp8 e4m3"
    assert _short("snapkv:window=32") == "snapkv" and _short("streaming_llm") == "streaming_llm"


def test_preset_names():
    assert preset_name("preset:llama-3.1-8b") == "llama-3.1-8b"
    assert preset_name("preset:") == ""  # an empty name: the presets module says it is unknown
    assert preset_name("meta-llama/Llama-3.1-8B") is None and preset_name("./preset:x") is None


def test_tiny_keeps_what_was_given_explicitly():
    from kvtrace import presets

    small = presets.tiny_shrink_args("gpt-oss-20b")
    assert tiny_shrink("gpt-oss-20b") == (small["layers"], small["width_scale"], small["vocab"])
    assert tiny_shrink("gpt-oss-20b", layers=3, vocab=1024) == (3, small["width_scale"], 1024)
    with pytest.raises(KeyError):
        tiny_shrink("no-such-preset")
