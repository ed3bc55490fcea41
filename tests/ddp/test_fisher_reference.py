"""`lifelong.fisher_estimator: reference` under real torchrun with 2 gloo ranks on CPU.

First the real `leanagent fisher` program, as a user runs it. Then a probe on the same trainer
builder that shows what "reference" means under DDP: each rank squares the gradient DDP has
already averaged across ranks (so both ranks hold the same local sum, though they saw different
batches), and the result is sum over steps of (mean of the ranks' batch gradients)^2 / N.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from leanagent.checkpoints.ours import load_fisher
from leanagent.data.corpus import Corpus
from leanagent.data.examples import build_train_examples
from leanagent.data.theorems import load_split
from leanagent.model.options import RetrieverOptions
from leanagent.model.retriever import PremiseRetriever

from .conftest import leanagent

pytestmark = pytest.mark.ddp

BATCH_SIZE = 4


def _base_checkpoint(model_dir: Path, path: Path) -> Path:
    """What the fisher program reads from a Lightning checkpoint: the hparams (architecture) and weights."""
    torch.manual_seed(0)
    model = PremiseRetriever(RetrieverOptions(name_or_path=str(model_dir), max_seq_len=256))
    torch.save({"hyper_parameters": model.options.to_hparams(model.encoder.config.to_dict()),
                "state_dict": model.state_dict()}, path)
    return path


def test_reference_fisher_program_on_two_ranks(demo_assets, write_cpu_config, tmp_path: Path) -> None:
    repo = demo_assets.repos[0]
    cfg = write_cpu_config(tmp_path / "cfg.yaml", tmp_path / "run", [repo],
                           data={"batch_size": BATCH_SIZE}, lifelong={"fisher_estimator": "reference"})
    ckpt = _base_checkpoint(demo_assets.model, tmp_path / "base.ckpt")
    out = tmp_path / "fisher"
    proc = leanagent("fisher", "--config", str(cfg), "--dataset", str(repo), "--checkpoint", str(ckpt),
                     "--out", str(out), timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    result = json.loads((out / "result.json").read_text())

    n = len(build_train_examples(Corpus.from_jsonl(repo / "corpus.jsonl"), load_split(repo / "random" / "train.json")))
    per_rank = -(-n // 2)  # DistributedSampler pads to equal shards; drop_last then keeps full batches only
    assert result["estimator"] == "reference" and result["world_size"] == 2
    assert result["num_examples"] == n and result["steps"] == per_rank // BATCH_SIZE > 0

    fisher, meta = load_fisher(Path(result["fisher"]))  # refuses negative or non-finite entries itself
    assert meta["estimator"] == "reference" and meta["world_size"] == 2 and meta["num_examples"] == n
    values = torch.cat([t.flatten() for t in fisher.values()])
    assert torch.isfinite(values).all() and (values >= 0).all() and values.sum() > 0
    model = PremiseRetriever(RetrieverOptions(name_or_path=str(demo_assets.model), max_seq_len=256))
    assert set(fisher) == {name for name, _ in model.named_parameters()}
    model.set_ewc(fisher, 0.1)  # the keys and shapes EWC needs


PROBE = textwrap.dedent('''
    """Under torchrun: the reference Fisher on 2 ranks, with every rank's batches and local sums recorded."""
    import json, os, sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from pytorch_lightning.callbacks import Callback
    from transformers import T5Config

    from leanagent.ground.config import DataConfig, TrainerConfig
    from leanagent.data.datamodule import RetrievalDataModule
    from leanagent.model.fisher import ReferenceFisherModule
    from leanagent.model.options import RetrieverOptions
    from leanagent.model.retriever import PremiseRetriever
    from leanagent.train.trainer import build_fisher_trainer, init_process_group

    repo, out, num_examples = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    cfg = TrainerConfig(accelerator="cpu", devices=2, precision="32-true")
    init_process_group(cfg)
    torch.manual_seed(0)
    config = T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
                      tie_word_embeddings=False, dropout_rate=0.0)
    model = PremiseRetriever(RetrieverOptions(name_or_path="tiny-t5", max_seq_len=96), encoder_config=config.to_dict())
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    dm = RetrievalDataModule(repo, model.tokenizer, DataConfig(batch_size=4, num_workers=0, max_seq_len=96),
                             premise_max_len=96, seed=5)
    dm.train_examples = dm.train_examples[:num_examples]

    class Probe(ReferenceFisherModule):
        def on_train_epoch_end(self):
            self.local_sums = {n: s.clone() for n, s in self.sums.items()}
            super().on_train_epoch_end()

    class Recorder(Callback):
        batches = []
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.batches.append({k: v.clone() for k, v in batch.items() if torch.is_tensor(v)})

    module, recorder = Probe(model), Recorder()
    trainer = build_fisher_trainer(cfg, out, [recorder])
    trainer.fit(module, train_dataloaders=dm.train_dataloader())

    gathered = [None, None]
    dist.all_gather_object(gathered, (recorder.batches, module.local_sums))
    if dist.get_rank() == 0:
        (b0, s0), (b1, s1) = gathered
        names = sorted(module.fisher)
        plain = PremiseRetriever(RetrieverOptions(name_or_path="tiny-t5", max_seq_len=96),
                                 encoder_config=config.to_dict())
        plain.load_state_dict({k: v for k, v in model.state_dict().items()})
        params = [dict(plain.named_parameters())[n] for n in names]
        expected = [torch.zeros_like(p) for p in params]
        for x0, x1 in zip(b0, b1, strict=True):
            g0 = torch.autograd.grad(plain.batch_loss(x0), params)
            g1 = torch.autograd.grad(plain.batch_loss(x1), params)
            for e, a, b in zip(expected, g0, g1, strict=True):
                e += ((a + b) / 2) ** 2
        err = max(float(((module.fisher[n] - e / num_examples).abs() / (e / num_examples).abs().clamp(min=1e-12))
                        .max()) for n, e in zip(names, expected, strict=True))
        sums_equal = max(float((s0[n] - s1[n]).abs().max() / s0[n].abs().max().clamp(min=1e-30)) for n in names)
        report = {
            "steps_per_rank": [len(b0), len(b1)],
            "batch_sizes": sorted({len(b["index"]) for b in b0 + b1}),
            "indices": [[i for b in b0 for i in b["index"].tolist()], [i for b in b1 for i in b["index"].tolist()]],
            "max_rel_error": err,
            "local_sums_rel_diff": sums_equal,
            "weights_unchanged": all(torch.equal(p, initial[n]) for n, p in model.named_parameters()),
            "num_examples": module.num_examples, "num_steps": module.num_steps,
            "fisher_total": float(sum(f.sum() for f in module.fisher.values())),
        }
        (out / "probe.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
''')


def test_ddp_averages_the_gradient_before_it_is_squared(demo_assets, tmp_path: Path, run_probe) -> None:
    num_examples = 26  # 13 per rank, 3 full batches of 4 each, 1 example per rank dropped
    out = tmp_path / "out"
    out.mkdir()
    run_probe(PROBE, tmp_path, str(demo_assets.repos[0]), str(out), str(num_examples), timeout=600)
    report = json.loads((out / "probe.json").read_text())
    assert report["steps_per_rank"] == [3, 3] and report["batch_sizes"] == [BATCH_SIZE]
    assert report["num_examples"] == num_examples and report["num_steps"] == 3
    rank0, rank1 = report["indices"]
    assert not set(rank0) & set(rank1)  # the DistributedSampler gave the ranks different examples ...
    assert report["local_sums_rel_diff"] < 1e-5  # ... yet their sums agree: DDP averaged before squaring
    assert report["max_rel_error"] < 1e-3  # sum over steps of (mean of the ranks' gradients)^2 / N
    assert report["fisher_total"] > 0
    assert report["weights_unchanged"]
