"""`leanagent index`: a dataset's corpus embedded once by a model, written as an INDEX folder."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from leanagent.data.corpus import Corpus
from leanagent.ground import model_identity
from leanagent.ground.names import CORPUS_FILE
from leanagent.index.encoders import EncoderSource, build_encoder
from leanagent.index.files import CONTEXT_MAX_LEN, PremiseIndexError, check_out, write_index
from leanagent.model.engines import EngineError, choose
from leanagent.model.loading import load_model, model_path


def build_index(model: str | Path, dataset: str | Path, out: str | Path, device: str = "cpu",
                batch_tokens: int | None = None, force: bool = False,
                context_max_len: int = CONTEXT_MAX_LEN, base_model: str | None = None,
                dtype: str = "auto", engine: str = "auto") -> dict[str, Any]:
    """Embed `dataset`'s corpus with `model` (a .ckpt or an HF folder) into the INDEX folder `out`; its index.json.

    `batch_tokens` is the padded-token budget of one embedding batch (default: the model's
    eval_batch_size x max_seq_len, as at evaluation); it is rounded down to whole premises of max_seq_len.
    `engine` and `dtype`: what embeds the corpus (`leanagent.model.engines.choose`); the rows are stored in bf16
    whatever they are, and index.json records both.
    """
    dataset, out = Path(dataset), Path(out)
    corpus_file = dataset / CORPUS_FILE
    if not corpus_file.is_file():
        raise PremiseIndexError(f"--dataset {dataset}: no {CORPUS_FILE} in it")
    check_out(out, force)
    try:
        engine, dtype = choose(engine, dtype, torch.device(device).type)
    except EngineError as exc:
        raise PremiseIndexError(str(exc)) from None
    model = model_path(model)  # a cached hub id as its snapshot folder
    identity = model_identity.identify(model)  # before loading: the bytes the embeddings come from
    loaded = load_model(model, device, base_model=base_model)
    source = EncoderSource(None, None, str(model), device, matches=False, base_model=base_model, _loaded=loaded)
    max_len = loaded.retriever.options.max_seq_len
    encoder = build_encoder(engine, source, dtype)  # ct2: converted for this process (no index folder yet)
    if batch_tokens is not None:
        if batch_tokens < max_len:
            raise PremiseIndexError(f"--batch-tokens {batch_tokens}: below the model's premise length {max_len}")
        batch_tokens = batch_tokens // max_len * max_len
    corpus = Corpus.from_jsonl(corpus_file)
    start = time.perf_counter()
    with torch.inference_mode():
        embeddings = encoder.embed_corpus(corpus, max_len, batch_tokens)
    seconds = time.perf_counter() - start
    meta = {
        "checkpoint": str(loaded.checkpoint) if loaded.checkpoint else None,
        "model": str(loaded.model_dir) if loaded.model_dir else None,
        "model_identity": identity,
        "base_model": base_model,  # the architecture of a LeanAgent/ReProver checkpoint, if given
        "dataset": str(dataset.resolve()),
        "corpus": str(corpus_file.resolve()),
        "max_seq_len": max_len,
        "context_max_len": context_max_len,
        "model_metrics": loaded.metrics,
        "embed_seconds": round(seconds, 3),
        "device": device,
        "embedded_at": encoder.dtype,
        "engine": engine,
    }
    # Only now: a model or corpus that fails to load leaves an earlier index as it was.
    return write_index(out, corpus, embeddings, meta)
