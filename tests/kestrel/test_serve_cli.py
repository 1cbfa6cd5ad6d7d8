"""`kestrel serve`'s parser: built from both processes' settings, no torch needed."""

from __future__ import annotations

import pytest

from common.settings import settings_environ
from engine_worker.config import DTYPES
from kestrel.cli import main as kestrel
from kestrel.serve import parse


def test_flags_reach_the_right_process_and_shared_ones_both() -> None:
    gw, wk = parse(["/m", "--api-key", "k", "--max-num-seqs", "3", "--log-level", "DEBUG",
                    "--engine-address", "tcp://127.0.0.1:6001", "--port", "9001"], {})
    assert gw.keys() == {"k"} and gw.port == 9001 and wk.max_num_seqs == 3 and wk.model == "/m"
    assert gw.log_level == wk.log_level == "DEBUG"
    assert wk.gateway_address == gw.engine_address == "tcp://127.0.0.1:6001"


def test_environment_fills_in_under_flags() -> None:
    gw, wk = parse(["--model", "/m"], {"PORT": "9100", "KESTREL_MAX_NUM_SEQS": "5"})
    assert gw.port == 9100 and wk.max_num_seqs == 5


@pytest.mark.skipif("auto" not in DTYPES, reason="the worker's --dtype auto comes with issue 10")
def test_dtype_auto_passes_through_to_the_worker() -> None:
    _, wk = parse(["/m", "--dtype", "auto"], {})
    assert settings_environ(wk)["KESTREL_DTYPE"] == "auto"


def test_kestrel_without_a_command_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert kestrel([]) == 2 and "serve" in capsys.readouterr().out
    assert kestrel(["frobnicate"]) == 2 and "unknown command" in capsys.readouterr().err


def test_model_after_served_model_name_is_caught(tmp_path, capsys) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    with pytest.raises(SystemExit) as exc:
        parse(["--served-model-name", "a", str(model)], {})
    assert exc.value.code == 2 and "give MODEL before" in capsys.readouterr().err
    _, wk = parse([str(model), "--served-model-name", "a", "org/b"], {})
    assert wk.served_names() == ("a", "org/b") and wk.model == str(model)


def test_a_field_either_process_gains_is_a_serve_flag(monkeypatch, capsys) -> None:
    """Other issues add settings to the worker and gateway configs at the same time as this one:
    `kestrel serve` takes them from the dataclasses, so they need no change here. A name both
    processes have (but not one meaning) becomes --gateway-NAME and --worker-NAME."""
    from dataclasses import dataclass

    from common.settings import setting
    from engine_worker.config import WorkerConfig
    from kestrel import serve

    @dataclass(frozen=True)
    class Extended(WorkerConfig):
        new_knob: int = setting(3, "a setting another issue adds")
        port: str = setting("", "a name the gateway has too")

    monkeypatch.setattr(serve, "WorkerConfig", Extended)
    gw, wk = serve.parse(["/m", "--new-knob", "7", "--worker-port", "x", "--gateway-port",
                          "9002"], {})
    assert wk.new_knob == 7 and wk.port == "x" and gw.port == 9002
    with pytest.raises(SystemExit):
        serve.parse(["--help"], {})
    out = capsys.readouterr().out
    assert out.index("--new-knob") > out.index("worker (")
