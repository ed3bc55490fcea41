"""The vectorised per-example Fisher (two forwards and one backward per batch) against the loop (one per example).

Both accumulate sum over the non-padding examples of (d loss_e / d theta)^2 in fp32; the vectorised
path rebuilds each example's gradient from activations and output gradients, so it must give the
loop's sums for every parameter up to float tolerance: tight in fp32, looser under bf16 autocast
(each path rounds its own bf16 activations and weight gradients).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from transformers import T5Config

from leanagent.data.datamodule import RetrievalDataModule
from leanagent.ground.config import DataConfig
from leanagent.model.fisher import FisherModule, per_example, vectorised
from leanagent.model.fisher.batches import example_groups
from leanagent.model.fisher.vectorised import accumulate_squared_example_grads, example_major_batch, unsupported_modules
from leanagent.model.options import RetrieverOptions
from leanagent.model.retriever import PremiseRetriever
from leanagent.model.sub_batches import call_cost_for, plan_sub_batches

BATCH_SIZE = 4
COLUMNS = 4  # the positive and 3 negatives


def tiny_t5(dropout: float = 0.0, seed: int = 0) -> PremiseRetriever:
    torch.manual_seed(seed)
    config = T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
                      tie_word_embeddings=False, dropout_rate=dropout)
    model = PremiseRetriever(RetrieverOptions(name_or_path="tiny-t5", max_seq_len=512),
                             encoder_config=config.to_dict())
    # Not the initial values: layer norms at exactly 1 would hide a wrong layer-norm gradient less well.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def hand_batch(context_lens: list[int], premise_lens: list[int], padding: list[bool], seed: int = 0) -> dict:
    """A collated batch (right padding, slot-major premise columns), with lengths chosen by the test."""
    g = torch.Generator().manual_seed(seed)
    b = len(context_lens)
    assert len(premise_lens) == b * COLUMNS

    def tokens(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, n in enumerate(lengths):
            ids[row, :n] = torch.randint(3, 384, (n,), generator=g)
            ids[row, n - 1] = 1  # </s>
            mask[row, :n] = 1
        return ids, mask

    context_ids, context_mask = tokens(context_lens)
    premise_ids, premise_mask = tokens(premise_lens)
    label = torch.zeros(b, b * COLUMNS)
    label[torch.arange(b), torch.arange(b)] = 1.0  # each example's own positive (column 0)
    label[0, b + 1] = 1.0  # and another example's premise that example 0 also uses
    return {"context_ids": context_ids, "context_mask": context_mask, "premise_ids": premise_ids,
            "premise_mask": premise_mask, "label": label, "index": torch.arange(b),
            "is_padding": torch.tensor(padding, dtype=torch.bool)}


# Very different lengths: a 3-token context beside a 200-token one; premises from 2 to 230 tokens.
LENGTHS = ([3, 200, 41, 17], [2, 230, 9, 64, 120, 5, 33, 7, 18, 99, 150, 3, 71, 12, 230, 44])


def sums_by(method: str, model: PremiseRetriever, batches: list[dict], bf16: bool = False) -> tuple[dict, int]:
    module = FisherModule(model, method=method)
    module.on_train_epoch_start()
    for i, batch in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            module.training_step(batch, i)
    return module.sums, module.count


def assert_same_sums(expected: dict, actual: dict, rel: float) -> None:
    """Every parameter, relative to the size of its own sums (entries near 0 compare against that scale)."""
    assert expected.keys() == actual.keys()
    for name in expected:
        e, a = expected[name], actual[name]
        assert a.dtype == torch.float32 and a.shape == e.shape
        scale = e.abs().max()
        assert scale > 0, name
        err = (a - e).abs().max()
        assert err <= rel * scale, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


def test_vectorised_equals_the_loop_in_fp32_with_padding_items_and_uneven_lengths() -> None:
    model = tiny_t5()
    batches = [hand_batch(*LENGTHS, padding=[False, False, True, False]),
               hand_batch([60, 5, 7, 130], [12, 3, 90, 8] * 4, padding=[False] * 4, seed=1)]
    loop, loop_count = sums_by("loop", model, batches)
    vec, vec_count = sums_by("vectorised", model, batches)
    assert loop_count == vec_count == 7  # the padding item is skipped by both
    assert_same_sums(loop, vec, rel=2e-5)
    # Every trainable parameter got a gradient, the relative attention bias and the embedding included.
    assert all(float(s.sum()) > 0 for s in vec.values())
    assert any("relative_attention_bias" in n for n in vec) and any(n.endswith("shared.weight") for n in vec)


@pytest.mark.parametrize("reduce_on, chunk_entries", [(("cuda",), 2**28), (("cpu", "cuda"), 1)])
def test_the_squares_are_the_same_however_they_are_summed(monkeypatch, reduce_on: tuple, chunk_entries: int) -> None:
    """The GPU's one reduction over the examples (run here on the CPU), and groups of layers cut to one layer each."""
    monkeypatch.setattr(vectorised.PerExampleGrads, "reduce_on", reduce_on)
    monkeypatch.setattr(vectorised.PerExampleGrads, "chunk_entries", chunk_entries)
    model = tiny_t5()
    batches = [hand_batch(*LENGTHS, padding=[False, False, True, False])]
    loop, _ = sums_by("loop", model, batches)
    vec, _ = sums_by("vectorised", model, batches)
    assert_same_sums(loop, vec, rel=2e-5)


def test_vectorised_equals_the_loop_under_bf16_autocast() -> None:
    model = tiny_t5()
    batches = [hand_batch(*LENGTHS, padding=[False, True, False, False])]
    loop, _ = sums_by("loop", model, batches, bf16=True)
    vec, _ = sums_by("vectorised", model, batches, bf16=True)
    assert_same_sums(loop, vec, rel=5e-2)
    # Both are bf16 estimates of the same fp32 quantity, and equally close to it.
    exact, _ = sums_by("loop", model, batches)
    total = sum(float(s.sum()) for s in exact.values())
    for sums in (loop, vec):
        assert sum(float(s.sum()) for s in sums.values()) == pytest.approx(total, rel=2e-2)


def test_dropout_stays_off_and_parameters_do_not_move() -> None:
    model = tiny_t5(dropout=0.5)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batches = [hand_batch(*LENGTHS, padding=[False] * 4)]
    loop, _ = sums_by("loop", model, batches)
    vec, _ = sums_by("vectorised", model, batches)
    assert not any(m.training for m in model.modules())
    assert_same_sums(loop, vec, rel=2e-5)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())  # nothing accumulated into .grad
    assert not model.encoder.encoder.block[0].layer[0].SelfAttention._forward_pre_hooks  # hooks removed


def test_an_all_padding_batch_adds_nothing() -> None:
    model = tiny_t5()
    sums, count = sums_by("vectorised", model, [hand_batch(*LENGTHS, padding=[True] * 4)])
    assert count == 0 and all(float(s.abs().sum()) == 0 for s in sums.values())


def test_the_batch_is_example_major_and_cut_to_the_longest_real_sequences() -> None:
    batch = hand_batch(*LENGTHS, padding=[False, False, True, False])
    ctx_ids, ctx_mask, prem_ids, prem_mask, label = example_major_batch(batch)
    kept = [0, 1, 3]
    assert ctx_ids.shape == ctx_mask.shape == (3, 200)  # the padding item's context is left out
    assert prem_ids.shape == prem_mask.shape == (3 * COLUMNS, 230) and label.shape == (3, COLUMNS)
    for e, i in enumerate(kept):  # example e is batch item i: premise rows i, i+4, i+8, i+12
        n = int(batch["context_mask"][i].sum())
        assert torch.equal(ctx_ids[e, :n], batch["context_ids"][i, :n]) and int(ctx_mask[e].sum()) == n
        for j in range(COLUMNS):
            r = i + BATCH_SIZE * j
            n = int(batch["premise_mask"][r].sum())
            assert torch.equal(prem_ids[e * COLUMNS + j, :n], batch["premise_ids"][r, :n])
            assert int(prem_mask[e * COLUMNS + j].sum()) == n
        assert torch.equal(label[e], batch["label"][i, [i + BATCH_SIZE * j for j in range(COLUMNS)]])


# ---- real batches from the data module, through Lightning -------------------------------------------

@pytest.fixture(scope="module")
def real(unit_repo, tiny_model) -> dict:
    return {"repo": unit_repo, "model_dir": tiny_model}


def fit_fisher(model: PremiseRetriever, repo: Path, method: str, world_size: int, examples: int,
               precision: str = "32-true") -> FisherModule:
    cfg = DataConfig(batch_size=BATCH_SIZE, num_workers=0, max_seq_len=256)
    dm = RetrievalDataModule(repo, model.tokenizer, cfg, premise_max_len=256, seed=5)
    dm.train_examples = dm.train_examples[:examples]
    loader = FisherModule.train_loader(dm, world_size)  # as run_fisher builds it: flagged padding items
    module = FisherModule(model, method=method)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, precision=precision, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=loader)
    return module


@pytest.mark.parametrize("precision, rel", [("32-true", 2e-5), ("bf16-mixed", 5e-2)])
def test_vectorised_equals_the_loop_on_data_module_batches(real: dict, precision: str, rel: float) -> None:
    # 9 examples padded for 4 ranks: 12 items, the last 3 padding, in a batch of their own beside one real example.
    results = {}
    for method in ("loop", "vectorised"):
        torch.manual_seed(0)
        model = PremiseRetriever(RetrieverOptions(name_or_path=str(real["model_dir"]), max_seq_len=256))
        results[method] = fit_fisher(model, real["repo"], method, world_size=4, examples=9, precision=precision)
    loop, vec = results["loop"], results["vectorised"]
    assert loop.num_examples == vec.num_examples == 9
    assert loop.fisher.keys() == vec.fisher.keys() == {n for n, _ in model.named_parameters()}
    assert_same_sums(loop.fisher, vec.fisher, rel=rel)


# ---- choosing the method -----------------------------------------------------------------------

def test_auto_picks_the_loop_everywhere() -> None:
    # Measured: faster on CPU; on an H200 the vectorised pass ran out of memory at realistic batches (before its
    # groups were bounded by the token budget: `scripts/gpu_run.sh` measures both again).
    module = FisherModule(tiny_t5())
    assert module.method == "auto"
    assert module.resolved_method(torch.device("cuda", 0)) == "loop"
    assert module.resolved_method(torch.device("cpu")) == per_example.AUTO_METHOD_BY_DEVICE["cpu"] == "loop"
    assert module.resolved_method(torch.device("mps")) == per_example.AUTO_METHOD == "loop"
    assert FisherModule(tiny_t5(), method="vectorised").resolved_method(torch.device("cpu")) == "vectorised"
    assert FisherModule(tiny_t5(), method="loop").resolved_method(torch.device("cuda")) == "loop"
    with pytest.raises(ValueError, match="unknown Fisher method"):
        FisherModule(tiny_t5(), method="vmap")


def test_a_layer_it_does_not_know_falls_back_to_the_loop() -> None:
    model = tiny_t5()
    assert unsupported_modules(model) == []
    model.extra = nn.Conv1d(2, 2, 1)  # a trainable parameter the hooks would not cover
    assert unsupported_modules(model) == ["extra (Conv1d)"]
    assert FisherModule(model).resolved_method(torch.device("cuda")) == "loop"
    with pytest.raises(ValueError, match="does not cover"):
        FisherModule(model, method="vectorised")


def test_frozen_parameters_are_left_out() -> None:
    model = tiny_t5()
    model.encoder.encoder.final_layer_norm.weight.requires_grad_(False)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    sums = {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
    model.eval()
    assert accumulate_squared_example_grads(model, hand_batch(*LENGTHS, padding=[False] * 4), sums) == 4
    assert sorted(sums) == sorted(names) and "encoder.encoder.final_layer_norm.weight" not in sums
    loop, _ = sums_by("loop", model, [hand_batch(*LENGTHS, padding=[False] * 4)])
    assert_same_sums(loop, sums, rel=2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("bf16, rel", [(False, 1e-3), (True, 5e-2)])
def test_vectorised_equals_the_loop_on_cuda(bf16: bool, rel: float) -> None:
    model = tiny_t5().cuda()
    batch = {k: v.cuda() for k, v in hand_batch(*LENGTHS, padding=[False, False, True, False]).items()}
    results = {}
    for method in ("loop", "vectorised"):
        module = FisherModule(model, method=method)
        module.on_train_epoch_start()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            module.training_step(batch, 0)
        results[method] = module.sums
    # TF32 may be on for fp32 matmuls on the GPU: a looser tolerance than on the CPU.
    assert_same_sums(results["loop"], results["vectorised"], rel=rel)


# ---- sorted sub-batches -----------------------------------------------------------------------

def test_the_loop_with_sorted_premises_equals_the_padded_loop_in_float64() -> None:
    """Each example's premise columns as sorted sub-batches of their own: the same squared gradients."""
    model = tiny_t5().double()
    batches = [hand_batch(*LENGTHS, padding=[False, False, True, False])]
    batches = [{k: v.double() if k == "label" else v for k, v in b.items()} for b in batches]
    model.reconfigure(sort_by_length=True)
    # Example 0's columns (rows 0, 4, 8, 12: 2, 120, 18, 71 tokens) are cut in two, example 1's in three.
    assert len(plan_sub_batches([2, 120, 18, 71], 16384, call_cost_for("cpu"))) == 2
    assert len(plan_sub_batches([230, 5, 99, 12], 16384, call_cost_for("cpu"))) == 3
    sorted_sums, _ = sums_by("loop", model, batches)
    model.reconfigure(sort_by_length=False)
    padded_sums, _ = sums_by("loop", model, batches)
    for name in padded_sums:
        err = (sorted_sums[name] - padded_sums[name]).abs().max()
        assert err <= 1e-10 * padded_sums[name].abs().max(), name


def test_vectorised_in_groups_under_a_small_budget_equals_the_loop() -> None:
    model = tiny_t5()
    batch = hand_batch(*LENGTHS, padding=[False, False, True, False])
    model.reconfigure(token_budget=300)  # example 1 (200 + 4 x 230 tokens) alone, the short ones together
    groups = example_groups(batch, 300, 64, True)
    assert sorted(i for g in groups for i in g) == [0, 1, 3] and len(groups) >= 2 and [1] in groups
    loop, _ = sums_by("loop", model, [batch])
    vec, count = sums_by("vectorised", model, [batch])
    assert count == 3
    assert_same_sums(loop, vec, rel=2e-5)
