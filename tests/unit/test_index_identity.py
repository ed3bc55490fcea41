"""An index records which weights embedded its corpus; a changed or different model is refused, `--force` warns.

Models are tiny random encoders (HF folders), so each test builds its own index in about a second; the CLI
tests run the real `leanagent retrieve` command (`leanagent serve`'s refusal: tests/serve/test_command.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from leanagent import cli
from leanagent.data.synthetic import write_demo_repos
from leanagent.ground import model_identity
from leanagent.index.build import build_index
from leanagent.index.files import PremiseIndexError
from leanagent.index.query import PremiseIndex
from leanagent.model.presets import write_random_encoder

REPO_ROOT = Path(__file__).resolve().parents[2]
STATE = "x y : Nat\n⊢ Eq (glend 0) (blix x y)"


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("identity")
    return {"repo": write_demo_repos(root / "data", 1)[0], "model": write_random_encoder(root / "model", "tiny"),
            "other": write_random_encoder(root / "other", "tiny", seed=1)}


@pytest.fixture()
def built(assets, tmp_path) -> dict[str, Path]:
    """A model folder of this test's own (it may be changed) and an index built from it."""
    model = tmp_path / "model"
    shutil.copytree(assets["model"], model)
    build_index(model, assets["repo"], tmp_path / "index")
    return {"model": model, "index": tmp_path / "index", "other": assets["other"]}


def _retrain(model: Path, other: Path) -> None:
    """What a rerun of training does to a checkpoint at the same path: new bytes under the same name."""
    shutil.copyfile(other / "model.safetensors", model / "model.safetensors")


def test_the_index_records_its_model_identity(built) -> None:
    identity = json.loads((built["index"] / "index.json").read_text())["model_identity"]
    assert identity["path"] == str(built["model"].resolve())
    files = {f["name"]: f for f in identity["files"]}
    assert set(files) == {"config.json", "model.safetensors"}  # weights and architecture; not tokenizer files
    weights = built["model"] / "model.safetensors"
    assert files["model.safetensors"]["size"] == weights.stat().st_size
    assert files["model.safetensors"]["mtime_ns"] == weights.stat().st_mtime_ns
    assert len(files["model.safetensors"]["sha256"]) == 64
    assert PremiseIndex.load(built["index"]).warnings == []


def test_the_same_bytes_touched_or_moved_are_accepted(built, tmp_path) -> None:
    weights = built["model"] / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert PremiseIndex.load(built["index"]).warnings == []  # re-hashed: the same weights
    moved = tmp_path / "elsewhere"
    shutil.copytree(built["model"], moved)
    assert PremiseIndex.load(built["index"], model=moved).warnings == []


def test_a_retrained_checkpoint_is_refused_naming_both(built) -> None:
    recorded = model_identity.describe(json.loads((built["index"] / "index.json").read_text())["model_identity"])
    _retrain(built["model"], built["other"])
    with pytest.raises(PremiseIndexError) as refused:
        PremiseIndex.load(built["index"])
    message = str(refused.value)
    now = model_identity.describe(model_identity.identify(built["model"]))
    assert "\n" not in message and recorded in message and now in message and recorded != now
    assert "stale" in message and "--force" in message
    forced = PremiseIndex.load(built["index"], force=True)
    assert len(forced.warnings) == 1 and "used anyway (--force)" in forced.warnings[0]
    assert forced.retrieve(STATE, k=3)  # it serves, as asked


def test_a_different_model_is_refused_naming_both(built) -> None:
    with pytest.raises(PremiseIndexError, match=r"embedded with .*model .*but the model is now .*other"):
        PremiseIndex.load(built["index"], model=built["other"])


def test_a_missing_model_is_named(built) -> None:
    shutil.rmtree(built["model"])
    with pytest.raises(PremiseIndexError, match=r"but the model is now .*model \(missing\)"):
        PremiseIndex.load(built["index"])


def test_an_index_from_before_identities_loads_with_a_warning(built) -> None:
    meta_file = built["index"] / "index.json"
    meta = json.loads(meta_file.read_text())
    del meta["model_identity"]
    meta_file.write_text(json.dumps(meta))
    loaded = PremiseIndex.load(built["index"])
    assert len(loaded.warnings) == 1 and "records no model identity" in loaded.warnings[0]


def test_identity_of_a_checkpoint_file(tmp_path) -> None:
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"weights, epoch 1")
    recorded = model_identity.identify(ckpt)
    assert [f["name"] for f in recorded["files"]] == ["last.ckpt"]
    assert model_identity.mismatch(recorded, ckpt) is None
    ckpt.write_bytes(b"weights, epoch 2")  # the same size: the hash tells them apart
    # A rewrite within one timestamp tick of the filesystem could keep the mtime; training takes longer than that.
    os.utime(ckpt, ns=(recorded["files"][0]["mtime_ns"] + 10**9,) * 2)
    now = model_identity.mismatch(recorded, ckpt)
    assert now is not None and str(ckpt) in now and "16 bytes" in now and recorded["files"][0]["sha256"][:12] not in now


# ---- the commands ---------------------------------------------------------------------------------

def test_retrieve_refuses_a_stale_index_in_one_line_and_force_warns(built, capsys) -> None:
    _retrain(built["model"], built["other"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["retrieve", str(built["index"]), "--state", STATE])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 1 and len(err.splitlines()) == 1 and err.startswith("error: ") and "stale" in err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["retrieve", str(built["index"]), "--state", STATE, "-k", "3", "--force", "--json"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 0 and len(json.loads(captured.out)["premises"]) == 3
    assert captured.err.startswith("warning: ") and "used anyway (--force)" in captured.err.splitlines()[0]
