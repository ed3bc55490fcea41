"""The query side's encoder, one per engine of `leanagent.model.engines.ENGINES`: what turns token ids into the
unit rows an index is ranked with. The index's stored rows stay what evaluation (or `leanagent index`) embedded;
only the states and uploaded premises are encoded here.

- `torch_encoder`: the retriever's own encoder at a `--dtype` of `leanagent.model.dtypes`.
- `ct2_encoder`: the same weights converted to CTranslate2 (`leanagent.model.ct2`), converted once per model and
  cached next to the index (`INDEX/ct2-<sha256 of the model's files>/`, with `leanagent.json` naming that
  identity): a cached conversion is used only when the index's model is the one it records (`check_model`), as
  the embeddings are, and a conversion of another model in that folder is replaced. Where the index folder cannot
  be written (or its model cannot be identified) it is converted into a temporary folder, loaded, and removed:
  CTranslate2 reads the whole model when it loads. The torch model is loaded only to convert; once converted, a
  ct2 query side holds no torch weights.

Both take a batch as padded ids and mask and give rows in its order; `encode_many` sorts a pool by length into
token-budget sub-batches first (`leanagent.model.pool_plan`), as the retriever's `encode_pool` does.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import ByT5Tokenizer

from leanagent.data.corpus import Corpus
from leanagent.data.dataset import tokenize_premises
from leanagent.ground import model_identity
from leanagent.index.files import PremiseIndexError
from leanagent.index.read import IndexMeta
from leanagent.model.ct2 import Ct2Encoder, Ct2Missing, convert, read_meta
from leanagent.model.dtypes import DtypeError, apply_dtype, precision
from leanagent.model.engines import ENGINES
from leanagent.model.evaluation import length_order, premise_token_lengths, token_budget_batches
from leanagent.model.loading import LoadedModel, ModelSourceError, load_model
from leanagent.model.pool_plan import plan_pool
from leanagent.model.sub_batches import call_cost_for

CT2_FOLDER_PREFIX = "ct2-"
CT2_FORMAT = 1  # of a cached conversion's leanagent.json
CT2_TOKEN_BUDGET = 16_384  # padded tokens per CTranslate2 call (a pass of byt5-small's width: ~100 MB of states)


class QueryEncoder(Protocol):
    engine: str
    dtype: str
    device: torch.device
    width: int
    tokenizer: Any

    def encode(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor: ...

    def encode_many(self, ids: torch.Tensor, mask: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor: ...

    def embed_corpus(self, corpus: Corpus, max_len: int, batch_tokens: int | None) -> torch.Tensor: ...


@dataclass
class EncoderSource:
    """What an engine builds its encoder from: the index (its folder and index.json), its model's path, where it
    runs, and whether the model is the one index.json records (`matches`: a cached conversion may be used)."""

    folder: Path | None
    meta: IndexMeta | None  # None: no index yet (`leanagent index` builds one)
    model: str
    device: str
    matches: bool
    warnings: list[str] = field(default_factory=list)
    base_model: str | None = None  # a LeanAgent/ReProver checkpoint's base model (index.json's, when there is one)
    _loaded: LoadedModel | None = None

    def __post_init__(self) -> None:
        if self.meta is not None and self.base_model is None:
            self.base_model = self.meta.base_model

    def loaded(self) -> LoadedModel:
        """The torch model, loaded on first use (one line naming index.json when it cannot be)."""
        if self._loaded is None:
            try:
                self._loaded = load_model(self.model, self.device, base_model=self.base_model)
            except (ModelSourceError, FileNotFoundError, ValueError) as exc:
                where = self.folder / "index.json" if self.folder is not None else self.model
                raise PremiseIndexError(f"{where}: its model cannot be loaded: {exc}") from None
        return self._loaded

    def forget(self) -> None:
        """Let go of the torch model (a ct2 query side has no more use for it)."""
        self._loaded = None


def build_encoder(engine: str, source: EncoderSource, dtype: str) -> QueryEncoder:
    """The encoder of `engine` (a resolved name, `leanagent.model.engines.choose`) at `dtype`."""
    module, _, name = ENGINES[engine].build.partition(":")
    return getattr(import_module(module), name)(source, dtype)


class TorchEncoder:
    engine = "torch"

    def __init__(self, retriever: Any, dtype: str) -> None:
        try:
            self.dtype = apply_dtype(retriever, dtype)  # int8: the encoder quantized
        except DtypeError as exc:
            raise PremiseIndexError(str(exc)) from None
        self.retriever = retriever
        self.device = retriever.device
        self.width = int(retriever.encoder.config.d_model)
        self.tokenizer = retriever.tokenizer

    def encode(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with precision(self.dtype, self.device):
            return self.retriever.encode(ids.to(self.device), mask.to(self.device))

    def encode_many(self, ids: torch.Tensor, mask: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        with precision(self.dtype, self.device):
            return self.retriever.encode_pool(ids.to(self.device), mask.to(self.device), list(lengths), sort=True)[0]

    def embed_corpus(self, corpus: Corpus, max_len: int, batch_tokens: int | None) -> torch.Tensor:
        """Every premise of `corpus`, as evaluation embeds them (`embed_premises`: sorted token-budget batches)."""
        with precision(self.dtype, self.device):
            return self.retriever.embed_corpus(corpus, batch_tokens)


def torch_encoder(source: EncoderSource, dtype: str) -> TorchEncoder:
    return TorchEncoder(source.loaded().retriever, dtype)


class Ct2QueryEncoder:
    engine = "ct2"

    def __init__(self, folder: Path, dtype: str, width: int) -> None:
        self.model = Ct2Encoder(folder, dtype)
        self.dtype = dtype
        self.device = torch.device("cpu")
        self.width = width
        self.tokenizer = ByT5Tokenizer()  # ct2 converts ByT5 encoders only (`leanagent.model.ct2.vocabulary`)

    def encode(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.encode_many(ids, mask, mask.sum(dim=1).tolist())

    def encode_many(self, ids: torch.Tensor, mask: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        plan = plan_pool(ids, mask, lengths, True, CT2_TOKEN_BUDGET, call_cost_for("cpu"))
        parts = []
        for piece in plan.pieces:
            rows = piece.mask.sum(dim=1).tolist()
            parts.append(self.model.encode([piece.ids[i, :n].tolist() for i, n in enumerate(rows)]))
        return plan.assemble(parts) if parts else torch.empty(0, self.width)

    def embed_corpus(self, corpus: Corpus, max_len: int, batch_tokens: int | None) -> torch.Tensor:
        """Every premise of `corpus` in corpus order, cut at `max_len` tokens, in length-sorted batches of at most
        `batch_tokens` padded tokens (as `embed_premises` cuts them)."""
        order = length_order(corpus, max_len)
        lengths = premise_token_lengths(corpus, max_len)[order]
        out = torch.empty(len(corpus), self.width)
        for lo, hi in token_budget_batches(lengths, batch_tokens or CT2_TOKEN_BUDGET):
            ids, mask = tokenize_premises(self.tokenizer, corpus, order[lo:hi], max_len)
            out[torch.from_numpy(order[lo:hi])] = self.encode(ids, mask)
        return out


def ct2_encoder(source: EncoderSource, dtype: str) -> Ct2QueryEncoder:
    """The index's model as CTranslate2 at `dtype`: its cached conversion, or a new one (module docstring)."""
    with ct2_conversion(source) as (folder, width):
        return Ct2QueryEncoder(folder, dtype, width)  # read whole when loaded: a temporary folder may go


@contextmanager
def ct2_conversion(source: EncoderSource) -> Iterator[tuple[Path, int]]:
    """(folder, width) of the index's model converted to CTranslate2: the cached conversion next to the index when
    there is one of this model, else converted now (and cached there when it can be, else into a temporary folder
    that goes when the context ends). The torch model, if it had to be loaded, is let go of afterwards."""
    digest = model_identity.digest(source.meta.identity()) if source.matches and source.meta is not None else None
    cached = source.folder / f"{CT2_FOLDER_PREFIX}{digest[:16]}" if digest and source.folder else None
    expected = {"format": CT2_FORMAT, "model_sha256": digest}
    if cached is not None and _is(cached, expected):
        yield cached, int(_meta_of(cached)["width"])
        return
    encoder = source.loaded().retriever.encoder
    width = int(encoder.config.d_model)
    meta = {**expected, "width": width, "model": source.model}
    if cached is not None:
        try:
            convert_encoder(encoder, cached, meta)
        except OSError as exc:  # a folder this process may not write: converted for this process only
            source.warnings.append(f"{source.folder}: the CTranslate2 conversion cannot be cached there "
                                   f"({exc.strerror or exc}); converted for this process only")
        else:
            _drop_stale(source.folder, keep=cached)
            source.forget()
            yield cached, width
            return
    with tempfile.TemporaryDirectory(prefix="leanagent-ct2-") as tmp:
        folder = convert_encoder(encoder, Path(tmp) / "model", meta)
        source.forget()
        yield folder, width


def convert_encoder(encoder: Any, out: Path, meta: dict[str, Any]) -> Path:
    """`leanagent.model.ct2.convert`, refusing in one line where CTranslate2 is missing."""
    try:
        return convert(encoder, out, meta)
    except Ct2Missing as exc:
        raise PremiseIndexError(str(exc)) from None


def _meta_of(folder: Path) -> dict[str, Any] | None:
    return read_meta(folder) if (folder / "model.bin").is_file() else None


def _is(folder: Path, expected: dict[str, Any]) -> bool:
    meta = _meta_of(folder) or {}
    return all(meta.get(k) == v for k, v in expected.items()) and isinstance(meta.get("width"), int)


def _drop_stale(folder: Path, keep: Path) -> None:
    """Conversions of earlier models of this index (rebuilt in place): ours, and of no use now."""
    for other in folder.glob(f"{CT2_FOLDER_PREFIX}*"):
        if other != keep and other.is_dir() and _meta_of(other) is not None:
            shutil.rmtree(other, ignore_errors=True)
