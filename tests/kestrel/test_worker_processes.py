"""`kestrel serve --models-dir`'s catalog (kestrel/worker_processes.py): what a folder serves and
under which ids."""

from __future__ import annotations

from pathlib import Path

from kestrel.worker_processes import catalog


def test_gguf_files_and_checkpoint_folders_are_served_under_their_usual_ids(tmp_path: Path) -> None:
    (tmp_path / "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf").write_bytes(b"")
    (tmp_path / "smol.gguf").write_bytes(b"")
    (tmp_path / "llama-folder").mkdir()
    (tmp_path / "llama-folder" / "config.json").write_text("{}")
    (tmp_path / "no-config").mkdir()
    (tmp_path / "notes.txt").write_text("")
    assert catalog(tmp_path) == {
        "Qwen2.5-Coder-1.5B-Instruct": str(tmp_path / "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf"),
        "llama-folder": str(tmp_path / "llama-folder"),
        "smol": str(tmp_path / "smol.gguf")}


def test_two_quantizations_of_one_model_keep_their_full_names(tmp_path: Path) -> None:
    for name in ("m.Q4_K_M.gguf", "m.Q8_0.gguf"):
        (tmp_path / name).write_bytes(b"")
    assert sorted(catalog(tmp_path)) == ["m.Q4_K_M", "m.Q8_0"]
