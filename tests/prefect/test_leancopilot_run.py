"""A trained lifelong run in LeanCopilot: `leanagent export RUN_DIR --format leancopilot OUT` writes both folders,
and loaded and ranked as LeanCopilot does (`tests/leancopilot_standin.py`: no leanagent code) they give
`leanagent retrieve`'s top 10 for every test state of the three repositories that fits the run's cut, never the
placeholder row 0 at k = 16 or 64 (its index check would abort Lean); the CTranslate2 encoder's mean-pooled
embedding is torch fp32's. The run is the session's (`lifelong_run3`); the export and the checks take seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from leanagent.data.theorems import load_states, strip_goal_count
from leanagent.ground.atomic import read_json
from leanagent.index.query import PremiseIndex
from leanagent.serve import resolve_source
from tests.conftest import DemoAssets, FinishedRun
from tests.leancopilot_standin import PREMISES_FOLDER, SPECIAL_STATES, LeanCopilot
from tests.unit.test_leancopilot_export import REPO_ROOT

pytestmark = [pytest.mark.prefect, pytest.mark.ddp]


def test_the_run_s_newest_stage_answers_in_leancopilot_as_leanagent_retrieve(
        lifelong_run3: FinishedRun, demo_assets: DemoAssets, tmp_path) -> None:
    out = tmp_path / "leancopilot"
    done = subprocess.run([sys.executable, "-m", "leanagent.cli", "export", str(lifelong_run3.run_dir), str(out),
                           "--format", "leancopilot"], capture_output=True, text=True, cwd=REPO_ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=900)
    assert done.returncode == 0, done.stderr
    assert "(#3)" in done.stdout, done.stdout  # its newest stage, the third
    folder, stage = resolve_source(lifelong_run3.run_dir)
    assert stage is not None and stage["stage_number"] == 3
    leancopilot = LeanCopilot(out)
    dictionary = json.loads((out / PREMISES_FOLDER / "dictionary.json").read_text(encoding="utf-8"))
    reference = PremiseIndex.load(folder, engine="torch", dtype="fp32")
    assert len(dictionary) == len(reference) + 1 and leancopilot.embeddings.shape[0] == len(reference) + 1
    real = {(p["full_name"], p["path"]) for p in reference.premises}
    retrieve = PremiseIndex.load(folder)  # what `leanagent retrieve RUN_DIR` runs by default: ct2 fp32
    assert (retrieve.engine, retrieve.dtype) == ("ct2", "fp32")
    states = sorted({strip_goal_count(s) for repo in demo_assets.repos[:3]
                     for s in load_states([repo / "random" / "test.json"])})
    assert len(states) >= 30
    cut = reference.state_max_len  # tokens: one per UTF-8 byte, then </s>
    for state in states + list(SPECIAL_STATES):
        for k in (16, 64):  # LeanCopilot's default k, and four times it: k real premises, no abort
            found = leancopilot.retrieve(state, k)
            assert len(found) == k and all((name, path) in real for _, name, path, _, _ in found), (k, state)
        if state in SPECIAL_STATES or len(state.encode()) >= cut:
            continue
        top10 = leancopilot.names(state, 10)
        assert top10 == [h.full_name for h in retrieve.retrieve(state, k=10)], state
        assert top10 == [h.full_name for h in reference.retrieve(state, k=10)], state
        mean = torch.nn.functional.normalize(torch.from_numpy(leancopilot.encode(state)).float(), dim=0)
        torch_fp32 = reference.encode_state(state)[0]
        assert float(torch.nn.functional.cosine_similarity(mean, torch_fp32, dim=0)) >= 0.9999, state
        assert float((mean - torch_fp32).abs().max()) <= 1e-4, state
    # Past the cut: leanagent encodes the first cut - 1 bytes, LeanCopilot the whole state.
    long = "h : " + " ∧ ".join(f"frob {i} = {i}" for i in range(200)) + "\n⊢ True"
    assert len(long.encode()) > 4 * cut
    assert torch.equal(reference.encode_state(long), reference.encode_state(long.encode()[:cut - 1].decode()))
    whole = torch.nn.functional.normalize(torch.from_numpy(leancopilot.encode(long)).float(), dim=0)
    assert float(torch.nn.functional.cosine_similarity(whole, reference.encode_state(long)[0], dim=0)) < 0.9999
    assert not np.isnan(leancopilot.scores(long)).any() and len(leancopilot.retrieve(long, 16)) == 16


def test_every_retrieval_job_says_which_product_ranked(lifelong_run3: FinishedRun) -> None:
    """result.json's `scoring` (`leanagent.model.topk.SCORING`): these jobs train and evaluate in fp32 (32-true),
    so their corpus rows are fp32 and the plain product ranks them, on any CPU."""
    results = [read_json(p) for p in (lifelong_run3.run_dir / "jobs").rglob("result.json")]
    ranked = [r for r in results if r.get("program") in ("train", "evaluate")]
    assert ranked and all(r.get("scoring") == ["native"] for r in ranked), [r.get("scoring") for r in ranked]
