"""An INDEX folder read back and verified: index.json, the embeddings against their recorded digest (finite, unit
rows), the JSON-lines files line by line, and the model against the identity that embedded them. Every problem is
one `PremiseIndexError` line naming the file (and line)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from leanagent.data.corpus import Corpus, FileRecord, Premise
from leanagent.ground import model_identity
from leanagent.ground.config import format_validation_error
from leanagent.ground.json_files import MIB, read_json_file, validate_as
from leanagent.index.files import (
    EMBEDDINGS_FILE,
    FILES_FILE,
    FORMAT_VERSION,
    INDEX_FILE,
    NAMES_FILE,
    NORM_TOLERANCE,
    PREMISES_FILE,
    READABLE_FORMATS,
    PremiseIndexError,
)


@dataclass(frozen=True)
class FileInfo:
    imports: list[str]
    rows: tuple[int, int]
    last_line: int | None


STALE_ADVICE = "Rebuild it with `leanagent index`, or pass --force to use it anyway"


def check_model(folder: Path, meta: dict[str, Any], model: Path, force: bool, advice: str = STALE_ADVICE
                ) -> list[str]:
    """Refuse (or, with `force`, warn about) a model that is not the one the corpus was embedded with; `advice`
    ends the refusal (what the command can do about it)."""
    recorded = meta.get("model_identity")
    if not isinstance(recorded, dict):
        return [f"{folder / INDEX_FILE}: records no model identity (built before leanagent recorded one), so a "
                f"changed model cannot be detected; rebuild it with `leanagent index` to have that checked"]
    now = model_identity.mismatch(recorded, model)
    if now is None:
        return []
    problem = (f"{folder}: its corpus was embedded with {model_identity.describe(recorded)}, but the model is now "
               f"{now}; its embeddings would be stale")
    if not force:
        raise PremiseIndexError(f"{problem}. {advice}")
    return [f"{problem}; used anyway (--force)"]


def accessibility_corpus(premises: list[dict[str, Any]], files: dict[str, FileInfo]) -> Corpus:
    """A `Corpus` with the index's files, imports and premise positions (no code): its import closure and
    in-file cut-off are the ones evaluation computes, so accessibility cannot drift from evaluation's."""
    records = []
    for path, info in files.items():
        lo, hi = info.rows
        records.append(FileRecord(path, info.imports, [
            Premise(p["full_name"], path, "", tuple(p["start"]), tuple(p["end"]), p.get("kind"))
            for p in premises[lo:hi]]))
    corpus = Corpus(records)
    if len(corpus) != len(premises):
        raise PremiseIndexError(f"{FILES_FILE}: its premise ranges cover {len(corpus)} of {len(premises)} premises; "
                                f"rebuild the index")
    return corpus


MAX_SEQ_LEN = 1 << 16  # bytes a ByT5 input is cut at: LeanAgent's are 512 (premises) and 1,024 (states)
MAX_WIDTH = 1 << 16
MAX_META_BYTES = MIB  # index.json: its settings and the stamps of its model's files
HEADER_BYTES = 1 << 20  # a safetensors header beside the rows, at most (ours is under 200 bytes)


class FileStamp(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: StrictStr
    size: StrictInt = Field(ge=0)
    mtime_ns: StrictInt = Field(ge=0)
    sha256: StrictStr | None = Field(None, pattern=r"^[0-9a-f]{64}$")


class ModelIdentity(BaseModel):
    model_config = ConfigDict(extra="allow")

    path: StrictStr | None = None
    files: list[FileStamp] = []


class IndexMeta(BaseModel):
    """index.json: every key a reader takes, typed, with its range; keys nobody reads pass as they are."""

    model_config = ConfigDict(extra="allow")

    format: Literal[READABLE_FORMATS]  # type: ignore[valid-type]
    num_premises: StrictInt = Field(ge=0, le=10**9)
    max_seq_len: StrictInt = Field(ge=1, le=MAX_SEQ_LEN)
    context_max_len: StrictInt | None = Field(None, ge=1, le=MAX_SEQ_LEN)
    embedding_dim: StrictInt | None = Field(None, ge=1, le=MAX_WIDTH)
    num_files: StrictInt | None = Field(None, ge=0, le=10**9)
    checkpoint: StrictStr | None = None
    model: StrictStr | None = None
    base_model: StrictStr | None = None
    model_identity: ModelIdentity | None = None
    embeddings_sha256: StrictStr | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    file_sizes: dict[StrictStr, Annotated[int, Field(ge=0, strict=True)]] | None = None


def read_regular(file: Path, size: int | None = None, limit: int | None = None) -> bytes:
    """The bytes of `file` once it is known to be a regular file (a FIFO would block the reader, a device such as
    /dev/zero would fill its memory) of the size index.json records, or at most `limit` bytes; one
    PremiseIndexError line naming the file otherwise. Opened without blocking, then checked on the open file."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise PremiseIndexError(f"{file}: missing from the index; rebuild it") from None
    except OSError as exc:
        raise PremiseIndexError(f"{file}: cannot be read ({exc.strerror or exc}); rebuild the index") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PremiseIndexError(f"{file}: not a regular file (a pipe, a device or a folder); rebuild the index")
        if size is not None and st.st_size != size:
            raise PremiseIndexError(f"{file}: {st.st_size:,} bytes, but index.json records {size:,}: changed or "
                                    f"damaged since the index was written; rebuild the index")
        if limit is not None and st.st_size > limit:
            raise PremiseIndexError(f"{file}: {st.st_size:,} bytes, more than an index of its size holds "
                                    f"({limit:,}); rebuild the index")
        try:
            return f.read()
        except OSError as exc:
            raise PremiseIndexError(f"{file}: cannot be read ({exc.strerror or exc}); rebuild the index") from None


def read_meta(folder: Path) -> dict[str, Any]:
    """index.json, checked against `IndexMeta`: one line naming the file and the key for anything else."""
    file = folder / INDEX_FILE
    if not folder.is_dir():
        raise PremiseIndexError(f"{folder}: no such index folder (build one with `leanagent index`)")
    if not file.exists():
        raise PremiseIndexError(f"{folder}: not a finished index (no {INDEX_FILE}); build it with `leanagent index`")
    meta = read_json_file(file, MAX_META_BYTES, INDEX_FILE, PremiseIndexError, "rebuild the index")
    if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS:
        raise PremiseIndexError(f"{file}: not a format-{FORMAT_VERSION} leanagent index")
    validate_as(meta, IndexMeta, str(file), INDEX_FILE, PremiseIndexError, "rebuild the index")
    return meta


def index_file_sizes(folder: Path, meta: dict[str, Any]) -> dict[str, int | None]:
    """Each file of the index (names.json when present) checked before any is read: a regular file, of the size
    index.json records (an index written before it recorded sizes: the embeddings within what their count and
    width hold). {name: size to expect on reading}."""
    recorded = meta.get("file_sizes") or {}
    wanted = [EMBEDDINGS_FILE, PREMISES_FILE, FILES_FILE, *([NAMES_FILE] if (folder / NAMES_FILE).exists() else [])]
    out: dict[str, int | None] = {}
    for name in wanted:
        path = folder / name
        try:
            st = path.stat()
        except FileNotFoundError:
            raise PremiseIndexError(f"{path}: missing from the index; rebuild it") from None
        except OSError as exc:
            raise PremiseIndexError(f"{path}: cannot be read ({exc.strerror or exc}); rebuild the index") from None
        if not stat.S_ISREG(st.st_mode):
            raise PremiseIndexError(f"{path}: not a regular file (a pipe, a device or a folder); rebuild the index")
        size = recorded.get(name)
        if size is not None and st.st_size != size:
            raise PremiseIndexError(f"{path}: {st.st_size:,} bytes, but index.json records {size:,}: changed or "
                                    f"damaged since the index was written; rebuild the index")
        out[name] = size
    if recorded.get(EMBEDDINGS_FILE) is None:
        width = meta.get("embedding_dim") or MAX_WIDTH
        most = meta["num_premises"] * width * 4 + HEADER_BYTES
        if (folder / EMBEDDINGS_FILE).stat().st_size > most:
            raise PremiseIndexError(f"{folder / EMBEDDINGS_FILE}: larger than {meta['num_premises']:,} rows of "
                                    f"{width} can be; rebuild the index")
    return out


def read_embeddings(folder: Path, meta: dict[str, Any], warnings: list[str]) -> torch.Tensor:
    """The embeddings, after their bytes are checked against index.json's SHA-256, each row finite and of unit
    length."""
    from safetensors.torch import load

    file = folder / EMBEDDINGS_FILE
    blob = read_regular(file, (meta.get("file_sizes") or {}).get(EMBEDDINGS_FILE),
                        meta["num_premises"] * (meta.get("embedding_dim") or MAX_WIDTH) * 4 + HEADER_BYTES)
    recorded = meta.get("embeddings_sha256")
    if recorded is None:
        warnings.append(f"{folder / INDEX_FILE}: records no digest of its embeddings (written before leanagent "
                        f"recorded one), so a changed file cannot be detected; rebuild it with `leanagent index`")
    elif hashlib.sha256(blob).hexdigest() != recorded:
        raise PremiseIndexError(f"{file}: its bytes are not those index.json records (SHA-256 "
                                f"{hashlib.sha256(blob).hexdigest()[:12]}, recorded {str(recorded)[:12]}): changed or "
                                f"damaged since the index was written; rebuild the index")
    try:
        embeddings = load(blob)["embeddings"]
    except Exception as exc:  # safetensors raises its own SafetensorError; a wrong file, KeyError
        raise PremiseIndexError(f"{file}: not a readable index embedding "
                                f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    if embeddings.dim() != 2:
        raise PremiseIndexError(f"{file}: embeddings of shape {tuple(embeddings.shape)}, not rows; rebuild the index")
    values = embeddings.float()
    bad = (~torch.isfinite(values).all(dim=1)).nonzero().flatten()
    if len(bad):
        raise PremiseIndexError(f"{file}: row {int(bad[0])} (and {len(bad) - 1} more) is not finite; rebuild the "
                                f"index")
    norms = values.norm(dim=1)
    off = ((norms - 1).abs() > NORM_TOLERANCE).nonzero().flatten()
    if len(off):
        raise PremiseIndexError(f"{file}: row {int(off[0])} has length {float(norms[off[0]]):.3f}, not 1 (and "
                                f"{len(off) - 1} more): not an index's unit embeddings; rebuild the index")
    return embeddings


class PremiseLine(BaseModel):
    model_config = ConfigDict(extra="ignore")

    full_name: StrictStr
    path: StrictStr
    start: tuple[StrictInt, StrictInt]
    end: tuple[StrictInt, StrictInt]
    kind: StrictStr | None = None
    text: StrictStr


class FileLine(BaseModel):
    model_config = ConfigDict(extra="ignore")

    path: StrictStr
    imports: list[StrictStr]
    premises: tuple[StrictInt, StrictInt]
    last_line: StrictInt | None = None


def read_jsonl(file: Path, model: type[BaseModel], size: int | None = None) -> list[Any]:
    """Each line of `file` (of `size` bytes, when index.json records it) as `model`; the first line that is not
    one refused as `file:line: problem`."""
    data = read_regular(file, size)
    out = []
    for lineno, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            out.append(model.model_validate(json.loads(raw.decode("utf-8"))))
        except UnicodeDecodeError as exc:
            raise PremiseIndexError(f"{file}:{lineno}: not UTF-8 (byte {exc.start} of the line); rebuild the "
                                    f"index") from None
        except json.JSONDecodeError as exc:
            raise PremiseIndexError(f"{file}:{lineno}: not valid JSON ({exc.msg}); rebuild the index") from None
        except ValidationError as exc:
            raise PremiseIndexError(f"{file}:{lineno}: {format_validation_error(exc)}; rebuild the index") from None
    return out
