"""The encoder as the retriever runs it: one attention mask per forward (bit-identical to transformers'
per-layer masks, forward and backward) and regional compilation (equal to eager within tolerance)."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.sdpa_attention as sdpa_attention
from torch._dynamo.utils import counters
from transformers import T5EncoderModel

from leanagent.model.encoder import CompiledBlocks, encoder_hidden
from leanagent.model.presets import encoder_config


def encoder(layers: int = 3, dropout: float = 0.1, seed: int = 0) -> T5EncoderModel:
    torch.manual_seed(seed)
    config = encoder_config("tiny")
    config.num_layers, config.dropout_rate = layers, dropout
    config._attn_implementation = "sdpa"
    model = T5EncoderModel(config).train()
    with torch.no_grad():  # away from the initial values, so that every weight's gradient is distinct
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def batch(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, 259, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def run(model: T5EncoderModel, forward, ids, mask, autocast: bool, seed: int = 7):
    """Output and every parameter's gradient of one forward and backward, dropout drawn from `seed`."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden = forward(model, ids, mask)
    weights = torch.linspace(-1, 1, hidden.shape[-1])  # not a plain sum: every position and feature counts
    (hidden.float() * weights).sum().backward()
    return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def stock(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).last_hidden_state


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("lengths", [[21, 6, 15], [12, 12]], ids=["padded", "unpadded"])
def test_one_mask_is_bit_identical_to_transformers_forward_and_backward(autocast: bool, lengths: list[int]) -> None:
    """Dropout on: the same draws in the same order, and every gradient (the bias table's included) to the bit."""
    model = encoder()
    ids, mask = batch(lengths)
    out, grads = run(model, stock, ids, mask, autocast)
    ours, our_grads = run(model, encoder_hidden, ids, mask, autocast)
    assert torch.equal(out, ours)
    assert grads.keys() == our_grads.keys()
    assert all(torch.equal(grads[n], our_grads[n]) for n in grads), [n for n in grads
                                                                    if not torch.equal(grads[n], our_grads[n])]
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert float(our_grads[bias].abs().sum()) > 0


@pytest.mark.parametrize("autocast, dtype", [(False, torch.float32), (True, torch.bfloat16)])
def test_every_layer_gets_the_same_mask_built_once_in_sdpa_dtype(monkeypatch, autocast: bool,
                                                                  dtype: torch.dtype) -> None:
    seen: list[torch.Tensor] = []
    sdpa = sdpa_attention.torch.nn.functional.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        seen.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(sdpa_attention.torch.nn.functional, "scaled_dot_product_attention", spy)
    model = encoder(layers=4)
    ids, mask = batch([21, 6, 15])
    run(model, stock, ids, mask, autocast)
    stock_masks, seen[:] = list(seen), []
    run(model, encoder_hidden, ids, mask, autocast)
    assert len(seen) == len(stock_masks) == 4
    assert len({m.data_ptr() for m in seen}) == 1  # one tensor for all the layers
    assert all(m.dtype == dtype and m.shape == (3, 4, 21, 21) for m in seen)
    assert len({m.data_ptr() for m in stock_masks}) == 4 and all(m.dtype == torch.float32 for m in stock_masks)


def test_a_failed_compile_falls_back_to_eager_in_one_line(capsys) -> None:
    def broken_backend(graph, example_inputs):
        raise RuntimeError("no compiler here\nsecond line of the story")

    model = encoder(dropout=0.0)
    ids, mask = batch([21, 6, 15])
    blocks = CompiledBlocks(model, backend=broken_backend)
    blocks.warm_up(torch.device("cpu"), backward=True)
    assert blocks.failed is not None and "no compiler here" in blocks.failed and blocks.compile_s is None
    assert torch.equal(blocks.hidden(ids, mask), encoder_hidden(model, ids, mask))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "running them eagerly" in err[0] and "second line" not in err[0]


def test_compiled_blocks_equal_eager_and_new_lengths_do_not_recompile() -> None:
    """Regional compilation on the CPU (inductor, C++): forward and gradients within fp32 tolerance, one graph
    for all the layers, and batches of other sizes and lengths reuse it."""
    model = encoder(dropout=0.0)
    torch._dynamo.reset()
    counters.clear()
    blocks = CompiledBlocks(model)
    blocks.warm_up(torch.device("cpu"), backward=True)
    assert blocks.failed is None and blocks.compile_s > 0
    graphs = counters["stats"]["unique_graphs"]
    for lengths in ([21, 6, 15], [40, 33, 8, 2], [64, 17]):
        ids, mask = batch(lengths)
        eager, eager_grads = run(model, encoder_hidden, ids, mask, autocast=False)
        compiled, compiled_grads = run(model, lambda m, i, a: blocks.hidden(i, a), ids, mask, autocast=False)
        assert torch.allclose(compiled, eager, rtol=1e-4, atol=1e-5)
        for name, grad in eager_grads.items():
            assert (compiled_grads[name] - grad).norm() <= 1e-4 * grad.norm(), name
    assert blocks.failed is None
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation for the new sizes and lengths
