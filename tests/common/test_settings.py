"""The settings layer: no prefix abbreviation, other spellings of a flag, repeatable flags, and a
config handed to a child process through KESTREL_* variables unchanged."""

from __future__ import annotations

import pytest

from common.settings import parse_settings, settings_environ
from engine_worker.config import WorkerConfig
from gateway.config import GatewayConfig


def test_a_prefix_of_a_flag_is_not_that_flag(capsys: pytest.CaptureFixture[str]) -> None:
    # --api-key is a flag of its own; --api-key-f must not be read as --api-key-file.
    with pytest.raises(SystemExit) as exc:
        parse_settings(GatewayConfig, ["--api-key-f", "x"], {})
    assert exc.value.code == 2
    assert "--api-key-f" in capsys.readouterr().err


def test_api_key_repeats_and_joins_with_api_keys() -> None:
    cfg = parse_settings(GatewayConfig, ["--api-key", "a", "--api-key", "b", "--api-keys", "c,d"],
                         {})
    assert cfg.keys() == {"a", "b", "c", "d"}


def test_vllm_spellings_set_the_same_fields() -> None:
    cfg = parse_settings(WorkerConfig, ["--served-model-name", "x", "y",
                                        "--no-enable-prefix-caching", "--kv-cache-memory", "1GiB"],
                         {})
    assert cfg.served_names() == ("x", "y") and cfg.prefix_caching is False
    assert parse_settings(WorkerConfig, ["--enable-prefix-caching"],
                          {"KESTREL_PREFIX_CACHING": "0"}).prefix_caching is True
    assert parse_settings(WorkerConfig, ["--model-id", "solo"], {}).served_names() == ("solo",)


def test_settings_environ_rebuilds_the_same_config() -> None:
    cfg = parse_settings(WorkerConfig, ["--served-model-name", "x", "y", "--no-prefix-caching",
                                        "--max-num-seqs", "3", "--heartbeat-s", "0.5"], {})
    assert parse_settings(WorkerConfig, [], settings_environ(cfg)) == cfg
