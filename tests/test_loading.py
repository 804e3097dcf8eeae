"""kvtrace.loading is a library module: bad values raise BadOption (no click), and the CLI turns
them into click's usage error with exit 64."""

from __future__ import annotations

import pytest

from kvtrace import exitcodes
from kvtrace.cli import main
from kvtrace.errors import BadOption
from kvtrace.loading import model_config_dict


def test_bad_model_is_a_bad_option_naming_the_option(tmp_path):
    with pytest.raises(BadOption, match="no such model directory") as info:
        model_config_dict(str(tmp_path / "absent"))
    assert info.value.option == "--model"
    (tmp_path / "m").mkdir()
    with pytest.raises(BadOption, match="holds no config.json"):
        model_config_dict(str(tmp_path / "m"))
    # Control: a directory with a readable config.json is accepted and read.
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama"}')
    assert model_config_dict(str(tmp_path / "m")) == {"model_type": "llama"}


def test_cli_maps_bad_option_to_usage(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["record", "--model", str(tmp_path / "absent"), "-o", str(tmp_path / "t.kvt.h5"),
              "--prompt", "hi", "--max-new-tokens", "2"])
    assert exc.value.code == exitcodes.USAGE
    err = capsys.readouterr().err
    assert err.startswith("kvtrace: Invalid value for --model:") and "no such model directory" in err
    assert err.count("\n") == 1 and "Traceback" not in err
