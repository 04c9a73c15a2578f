"""One model-naming scheme for every command: built-in names, aliases, and clear errors for bad folders."""

from __future__ import annotations

import pytest

from quantmla.models.names import MODEL_NAMES, ModelNotFoundError, canonical_name, check_model_name


def test_names_and_aliases():
    assert canonical_name("smollm2-mla-a") == "smollm2-mla" and canonical_name("SmolLM2-MLA") == "smollm2-mla"
    assert canonical_name("smollm3") is None
    for name in MODEL_NAMES:
        check_model_name(name)  # no loading, no error


def test_bad_folders(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither a folder nor a built-in name"):
        check_model_name(str(tmp_path / "missing"))
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        check_model_name(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="no weights"):
        check_model_name(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="is a file"):
        check_model_name(str(tmp_path / "config.json"))
    (tmp_path / "model.safetensors").write_bytes(b"")
    check_model_name(str(tmp_path))
