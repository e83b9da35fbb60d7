"""What a converted checkpoint carries over from its source: the tokenizer and generation files, by name,
never through a link out of the source, never a pickle (a token or a training state must not ride along
into a published checkpoint)."""

from __future__ import annotations

import hashlib
import shutil

import pytest

from hpu_fp8_loader.errors import UnsafePathError
from hpu_fp8_loader.io.checkpoint import source_file
from hpu_fp8_loader.spec.names import COPIED_SOURCE_FILES


def tree_digest(root) -> dict:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture
def source(tmp_path, source_factory):
    root = tmp_path / "src"
    shutil.copytree(source_factory("qwen2-tiny"), root)
    return root


def test_only_the_tokenizer_and_generation_files_are_copied(tmp_path, source, spec_factory):
    (source / "tokenizer.json").write_text('{"model": {}}')
    (source / "generation_config.json").write_text('{"do_sample": false}')
    for other in ("pytorch_model.bin", "training_args.bin", "optimizer.pt", "notes.txt", "convert.sh"):
        (source / other).write_bytes(b"\x80\x04not for publishing")
    from hpu_fp8_loader.conversion.convert import convert as run_convert
    from hpu_fp8_loader.conversion.plan import ConvertOptions
    from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements

    run_convert(source, tmp_path / "out", [synthetic_measurements(preset_config("qwen2-tiny"))], ConvertOptions())
    copied = {p.name for p in (tmp_path / "out").iterdir()} & ({"tokenizer.json", "generation_config.json", "notes.txt",
                                                                "convert.sh", "pytorch_model.bin", "training_args.bin",
                                                                "optimizer.pt"})  # fmt: skip
    assert copied == {"tokenizer.json", "generation_config.json"}
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"model": {}}'


def test_a_tokenizer_file_linking_out_of_the_source_is_refused_and_nothing_is_published(tmp_path, source):
    secret = tmp_path / "environ"
    secret.write_text("HF_TOKEN=hf_secret_value\n")
    (source / "tokenizer_config.json").symlink_to(secret)
    before = tree_digest(source)
    from hpu_fp8_loader.conversion.convert import convert as run_convert
    from hpu_fp8_loader.conversion.plan import ConvertOptions
    from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements

    with pytest.raises(UnsafePathError, match=r"tokenizer_config.json: a link to .*environ, outside the source checkpoint"):
        run_convert(source, tmp_path / "out", [synthetic_measurements(preset_config("qwen2-tiny"))], ConvertOptions())
    assert not (tmp_path / "out").exists()
    assert tree_digest(source) == before  # the input is never modified
    leaked = [
        p
        for p in tmp_path.rglob("*")
        if p.is_file() and not p.is_symlink() and p != secret and b"hf_secret_value" in p.read_bytes()
    ]
    assert leaked == []


def test_a_hugging_face_snapshot_links_into_its_own_blob_store(tmp_path, monkeypatch):
    """Followed only in huggingface_hub's own cache (HF_HUB_CACHE here), where its blob names are Hub ETags."""
    blob = "ab" * 32
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / blob).write_text('{"model": {}}')
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").symlink_to(f"../../blobs/{blob}")
    with pytest.raises(UnsafePathError, match="tokenizer.json: a link to .*outside the source checkpoint"):
        source_file(snapshot, "tokenizer.json")  # the same layout elsewhere is no cache: nothing is followed out of it
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert source_file(snapshot, "tokenizer.json") == (repo / "blobs" / blob).resolve()
    assert source_file(snapshot, "tokenizer.model") is None
    (snapshot / "vocab.json").mkdir()
    with pytest.raises(UnsafePathError, match="vocab.json: not a regular file"):
        source_file(snapshot, "vocab.json")


def test_the_copied_names_are_tokenizer_and_generation_files_only():
    assert all(("token" in n or "vocab" in n or "merges" in n or "generation" in n or "chat_template" in n)
               for n in COPIED_SOURCE_FILES)  # fmt: skip
    assert not any(n.endswith((".bin", ".pt", ".pth", ".pkl", ".pickle", ".safetensors")) for n in COPIED_SOURCE_FILES)
