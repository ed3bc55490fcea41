"""A trained lifelong run in LeanCopilot: `leanagent export RUN_DIR --format leancopilot OUT` writes both folders,
and loaded as LeanCopilot loads them (the `ctranslate2` and `numpy` packages) they give `leanagent retrieve`'s
top 10 for every test state of the three repositories; the CTranslate2 encoder's mean-pooled embedding is torch
fp32's. The run is the session's (`lifelong_run3`); the export and the checks take seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from leanagent.data.theorems import load_states, strip_goal_count
from leanagent.index.query import PremiseIndex
from leanagent.serve import resolve_source
from tests.conftest import DemoAssets, FinishedRun, read_json
from tests.unit.test_leancopilot_export import REPO_ROOT, LeanCopilot

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
    dictionary = json.loads((out / "premise-embeddings-leandojo-lean4-retriever-byt5-small" /
                             "dictionary.json").read_text(encoding="utf-8"))
    reference = PremiseIndex.load(folder, engine="torch", dtype="fp32")
    assert len(dictionary) == len(reference) and leancopilot.embeddings.shape == tuple(reference.embeddings.shape)
    retrieve = PremiseIndex.load(folder)  # what `leanagent retrieve RUN_DIR` runs by default: ct2 fp32
    assert (retrieve.engine, retrieve.dtype) == ("ct2", "fp32")
    states = sorted({strip_goal_count(s) for repo in demo_assets.repos[:3]
                     for s in load_states([repo / "random" / "test.json"])})
    assert len(states) >= 30
    for state in states:
        top10 = leancopilot.retrieve(state)
        assert top10 == [h.full_name for h in retrieve.retrieve(state, k=10)], state
        assert top10 == [h.full_name for h in reference.retrieve(state, k=10)], state
        mean = torch.nn.functional.normalize(torch.from_numpy(leancopilot.encode(state)).float(), dim=0)
        torch_fp32 = reference.encode_state(state)[0]
        assert float(torch.nn.functional.cosine_similarity(mean, torch_fp32, dim=0)) >= 0.9999, state
        assert float((mean - torch_fp32).abs().max()) <= 1e-4, state


def test_every_retrieval_job_says_which_product_ranked(lifelong_run3: FinishedRun) -> None:
    """result.json's `scoring` (`leanagent.model.topk.SCORING`): these jobs train and evaluate in fp32 (32-true),
    so their corpus rows are fp32 and the plain product ranks them, on any CPU."""
    results = [read_json(p) for p in (lifelong_run3.run_dir / "jobs").rglob("result.json")]
    ranked = [r for r in results if r.get("program") in ("train", "evaluate")]
    assert ranked and all(r.get("scoring") == ["native"] for r in ranked), [r.get("scoring") for r in ranked]
