"""`leanagent export`: a trained retriever as a Hugging Face model folder anyone can load offline.

The folder holds the encoder (`save_pretrained`, safetensors), the ByT5 tokenizer files, a README.md
model card (which run and checkpoint, which data, which validation metrics), and `retriever.json` with
what a plain HF folder cannot say (the premise length the corpus was embedded at), so the folder works
as `model.name_or_path` of a new run and as `--model` of `leanagent index` with the same settings.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers import ByT5Tokenizer

from leanagent.ground.atomic import file_mode, out_folder_problem, refuse_non_empty, write_atomic
from leanagent.model.loading import RETRIEVER_FILE, LoadedModel, load_model
from leanagent.model.progress_bars import no_progress_bars

MODEL_FILES = frozenset({
    "config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
    "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack", "generation_config.json",
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.json", "spiece.model",
    "README.md", RETRIEVER_FILE,
})
METRIC_ORDER = ("Recall@1_val", "Recall@10_val", "MRR", "Recall@1", "Recall@10", "num_contexts")


def export_model(source: str | Path, out: str | Path, force: bool = False, base_model: str | None = None) -> Path:
    """Write `source` (a .ckpt or an HF folder) to `out`; a non-empty `out` is refused unless `force`.

    With `force`, model and tokenizer files already there are replaced (see `_remove_model_files`).
    """
    out = Path(out)
    problem = out_folder_problem(out)  # a folder that cannot be written: said before the model is loaded
    if problem is not None:
        raise FileExistsError(problem)
    loaded = load_model(source, base_model=base_model)  # before touching `out`: a bad source must leave it as it was
    if force and out.is_dir():
        if out.resolve() == loaded.source.resolve():
            raise FileExistsError(f"{out} is the model being exported; choose another folder")
        _remove_model_files(out)
    else:
        refuse_non_empty(out)
    out.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in out.iterdir()}
    with no_progress_bars():
        loaded.retriever.encoder.save_pretrained(out, safe_serialization=True)
    ByT5Tokenizer().save_pretrained(out)
    # transformers writes the weights through a temporary file of mode 0600: give what it wrote the user's umask,
    # as every other file, so that a team's other users can load the model.
    mode = file_mode(out)
    for path in out.iterdir():
        if path.is_file() and path.name not in before:
            os.chmod(path, mode)
    write_atomic(out / RETRIEVER_FILE, lambda f: json.dump(retriever_meta(loaded), f, indent=2, sort_keys=True))
    write_atomic(out / "README.md", lambda f: f.write(model_card(loaded)))
    return out


def _remove_model_files(folder: Path) -> None:
    """--force: remove the files an earlier export (or any HF model) left, so from_pretrained cannot pick up a
    stale one (it prefers some weight files over others); anything else in the folder is left alone."""
    for path in folder.iterdir():
        if path.is_file() and (path.name in MODEL_FILES or path.name.startswith(("model-", "pytorch_model-"))):
            path.unlink()


def retriever_meta(loaded: LoadedModel) -> dict[str, Any]:
    return {
        "max_seq_len": loaded.retriever.options.max_seq_len,
        "source": str(loaded.source),
        "base_model": loaded.base_model,
        "dataset": loaded.dataset,
        "epoch": loaded.epoch,
        "global_step": loaded.global_step,
        "metrics": loaded.metrics,
    }


def _fmt(name: str, value: float) -> str:
    if name.startswith("Recall"):
        return f"{value:.2f}%"
    if name == "num_contexts":
        return str(int(value))
    return f"{value:.4f}"


def model_card(loaded: LoadedModel) -> str:
    """The README.md: enough to tell, months later, which training produced these weights and how good they were."""
    config = loaded.retriever.encoder.config
    source = loaded.source
    origin = "checkpoint" if loaded.checkpoint is not None else "model folder"
    lines = [
        "---",
        "library_name: transformers",
        "tags: [leanagent, lean4, premise-retrieval, byt5]",
        "---",
        "",
        f"# Premise retriever: {source.stem if loaded.checkpoint else source.name}",
        "",
        "A ByT5 encoder trained by `leanagent` (LeanAgent's lifelong premise retriever). A proof state and each",
        "premise are embedded by masked mean pooling of the last hidden state, then L2-normalised; premises are",
        "ranked by cosine similarity.",
        "",
        "## Origin",
        "",
        f"- exported from {origin}: `{source}`",
    ]
    if loaded.epoch is not None:
        lines.append(f"- epoch {loaded.epoch} (0-based, as in checkpoint names such as `epoch={loaded.epoch}-...ckpt`; "
                     f"`leanagent run`'s table counts epochs trained from 1), global step {loaded.global_step}")
    lines.append(f"- training started from: `{loaded.base_model}`" if loaded.base_model else
                 "- training started from: unknown")
    lines.append(f"- data: `{loaded.dataset}`" if loaded.dataset else
                 "- data: unknown (no result.json in the checkpoint's job folder)")
    lines += ["", "## Validation metrics", ""]
    if loaded.metrics:
        names = [n for n in METRIC_ORDER if n in loaded.metrics] + \
                sorted(n for n in loaded.metrics if n not in METRIC_ORDER)
        lines += ["| metric | value |", "| --- | --- |"]
        lines += [f"| {n} | {_fmt(n, loaded.metrics[n])} |" for n in names]
        lines += ["", "Recall in percent (fraction of a state's ground-truth premises in the top k), MRR a fraction."]
    else:
        lines.append("None recorded with this model.")
    if loaded.history:
        lines += ["", "Validation history carried in the checkpoint (all repositories so far):", "",
                  "| epoch | step | Recall@1_val | Recall@10_val | MRR |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {h.get('epoch')} | {h.get('step')} | {h.get('Recall@1_val', float('nan')):.2f} | "
                  f"{h.get('Recall@10_val', float('nan')):.2f} | {h.get('MRR', float('nan')):.4f} |"
                  for h in loaded.history]
    lines += [
        "",
        "## Architecture",
        "",
        f"T5 encoder: d_model {config.d_model}, {config.num_layers} layers, {config.num_heads} heads, "
        f"vocab {config.vocab_size} (ByT5 bytes); premises embedded at up to "
        f"{loaded.retriever.options.max_seq_len} tokens.",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoTokenizer, T5EncoderModel",
        "model = T5EncoderModel.from_pretrained(PATH)",
        "tokenizer = AutoTokenizer.from_pretrained(PATH)",
        "```",
        "",
        "or `leanagent index --model PATH --dataset DATASET --out INDEX`, then `leanagent retrieve INDEX --state ...`;",
        "PATH also works as `model.name_or_path` of a new leanagent run.",
        "",
    ]
    return "\n".join(lines)
