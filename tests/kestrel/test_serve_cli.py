"""`kestrel serve`'s parser: built from both processes' settings, no torch needed."""

from __future__ import annotations

import pytest

from common.settings import settings_environ
from engine_worker.config import DTYPES
from kestrel.cli import main as kestrel
from kestrel.serve import parse, private_dir


def test_flags_reach_the_right_process_and_shared_ones_both() -> None:
    gw, wk = parse(["/m", "--api-key", "k", "--max-num-seqs", "3", "--log-level", "DEBUG",
                    "--engine-address", "tcp://127.0.0.1:6001", "--port", "9001",
                    "--insecure-link"], {})
    assert gw.keys() == {"k"} and gw.port == 9001 and wk.max_num_seqs == 3 and wk.model == "/m"
    assert gw.log_level == wk.log_level == "DEBUG"
    assert wk.gateway_address == gw.engine_address == "tcp://127.0.0.1:6001"


def test_with_two_api_server_processes_the_worker_joins_both_links(tmp_path) -> None:
    gw, wk = parse(["/m", "--api-server-count", "2", "--port", "9004"],
                   {"XDG_RUNTIME_DIR": str(tmp_path)})
    sock = f"ipc://{tmp_path}/kestrel/engine-9004.sock"
    assert gw.engine_address == sock and wk.gateway_address == f"{sock},{sock}.1"
    _, wk = parse(["/m", "--api-server-count", "3", "--insecure-link", "--engine-address",
                   "tcp://127.0.0.1:6010"], {})
    assert wk.gateway_address == "tcp://127.0.0.1:6010,tcp://127.0.0.1:6011,tcp://127.0.0.1:6012"


def test_the_default_link_is_a_private_ipc_socket_per_port(tmp_path) -> None:
    """Issue 23: no keyless TCP port on loopback for one host; the socket sits in the user's
    runtime folder, named by the HTTP port so two servers never share one."""
    gw, wk = parse(["/m", "--port", "9002"], {"XDG_RUNTIME_DIR": str(tmp_path)})
    assert gw.engine_address == wk.gateway_address == f"ipc://{tmp_path}/kestrel/engine-9002.sock"
    gw, _ = parse(["/m"], {"XDG_RUNTIME_DIR": str(tmp_path), "PORT": "9003"})
    assert gw.engine_address.endswith("/kestrel/engine-9003.sock")
    gw, _ = parse(["/m", "--insecure-link"], {"KESTREL_ENGINE_ADDRESS": "tcp://127.0.0.1:6002"})
    assert gw.engine_address == "tcp://127.0.0.1:6002"  # asked for by name: kept


def test_a_keyless_tcp_link_must_be_asked_for_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["/m", "--engine-address", "tcp://127.0.0.1:6003"], {})
    assert exc.value.code == 2 and "--insecure-link" in capsys.readouterr().err


def test_a_link_folder_of_another_user_or_open_to_others_is_refused_or_closed(tmp_path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    private_dir(open_dir)
    assert open_dir.stat().st_mode & 0o777 == 0o700
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises((SystemExit, FileExistsError)):
        private_dir(not_a_dir)


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


def test_admin_keys_are_api_keys_too_and_need_api_keys(
        capsys: pytest.CaptureFixture[str]) -> None:
    gw, _ = parse(["/m", "--api-key", "tenant", "--admin-keys", "op1,op2"], {})
    assert gw.keys() == {"tenant", "op1", "op2"} and gw.admin_key_set() == {"op1", "op2"}
    with pytest.raises(SystemExit) as exc:
        parse(["/m", "--admin-keys", "op1"], {})  # with no API keys anyone may load models
    assert exc.value.code == 2 and "admin_keys" in capsys.readouterr().err
