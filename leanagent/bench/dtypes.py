"""`leanagent bench dtypes`: the served encoder's pass per `--dtype`, and its corpus embedding rate.

The encoder is a random one of the preset's shape (byt5-small's by default: 12 layers, from its `T5Config`; no
download, and a pass's time does not depend on the weights). The states: the median-length one of a LeanDojo split
and a 1,024-byte one (the cut; longer states are cut there), encoded as `PremiseIndex.encode_state` encodes them,
each the median of `repeats` passes after a warm-up. The corpus rate: `premises` premises of growing lengths, as
`PremiseIndex.encode_together` embeds them (sorted token-budget sub-batches). `leanagent.model.dtypes.AUTO_CPU`
records what `auto` takes on a CPU from these figures.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leanagent.bench.options import DtypesOptions
from leanagent.bench.results import Section
from leanagent.bench.timing import median_seconds
from leanagent.data.dataset import tokenize_texts
from leanagent.data.theorems import load_states
from leanagent.model.dtypes import apply_dtype, precision
from leanagent.model.loading import load_model
from leanagent.model.presets import write_random_encoder

STATE_CUT = 1024  # bytes: where a served state is cut


@dataclass
class DtypeRow(Section):
    dtype: str  # as applied (`auto` resolved)
    state_s: dict[str, float]  # by state name (`state_<bytes>b`): the median pass
    premises_per_s: float


@dataclass
class DtypesFigures(Section):
    device: str
    preset: str
    rows: list[DtypeRow] = field(default_factory=list)

    def flat(self) -> dict:
        out: dict = {"device": self.device, "preset": self.preset}
        for row in self.rows:
            out.update({f"{row.dtype}_{name}_s": s for name, s in row.state_s.items()})
            out[f"{row.dtype}_premises_per_s"] = row.premises_per_s
        return out


def pick_states(file: Path | None) -> dict[str, str]:
    """The median-length state of a LeanDojo split and a 1,024-byte one (a longer state repeated and cut)."""
    found = sorted(set(load_states([file])) if file is not None else set(), key=lambda s: len(s.encode()))
    if not found:
        found = ["x y : Nat\n⊢ x + y = y + x" * 8]
    median = found[len(found) // 2]
    long = max(found, key=lambda s: len(s.encode())).encode()
    long = (long * (STATE_CUT // len(long) + 1))[:STATE_CUT].decode(errors="ignore")
    return {f"state_{len(median.encode())}b": median, f"state_{len(long.encode())}b": long}


def _encode(retriever, dtype: str, texts: list[str], max_len: int) -> torch.Tensor:
    """As the index encodes: cut at `max_len`, sorted token-budget sub-batches, at `dtype`'s precision."""
    device = retriever.device
    ids, mask = tokenize_texts(retriever.tokenizer, texts, max_len)
    with torch.inference_mode(), precision(dtype, device):
        return retriever.encode_pool(ids.to(device), mask.to(device), mask.sum(dim=1).tolist(), sort=True)[0]


def bench_dtypes(options: DtypesOptions) -> DtypesFigures:
    torch.manual_seed(0)
    states = pick_states(options.states)
    premises = [("theorem t (x : Nat) : " + "frob x = x ∧ " * 40)[: 120 + 6 * i] for i in range(options.premises)]
    figures = DtypesFigures(options.device, options.preset)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_random_encoder(Path(tmp) / options.preset, options.preset)
        for dtype in options.dtypes:
            figures.rows.append(_row(folder, dtype, states, premises, options))
    return figures


def _row(folder: Path, dtype: str, states: dict[str, str], premises: list[str], options: DtypesOptions) -> DtypeRow:
    """One dtype, on a model loaded afresh (a quantized copy is not reused for another dtype)."""
    device = torch.device(options.device)
    retriever = load_model(folder, options.device).retriever
    resolved = apply_dtype(retriever, dtype)
    state_s = {name: median_seconds(lambda s=state: _encode(retriever, resolved, [s], STATE_CUT), options.repeats,
                                    device) for name, state in states.items()}
    seconds = median_seconds(lambda: _encode(retriever, resolved, premises, 512), 1, device)
    return DtypeRow(resolved, state_s, len(premises) / seconds)


def dtypes_table(figures: DtypesFigures) -> str:
    names = list(figures.rows[0].state_s) if figures.rows else []
    lines = [f"the served encoder per dtype ({figures.preset}, {figures.device}): seconds per state, premises/s",
             f"  {'dtype':<6} " + " ".join(f"{n:>16}" for n in names) + f" {'premises/s':>12}"]
    lines += [f"  {row.dtype:<6} " + " ".join(f"{row.state_s[n]:>16.3f}" for n in names)
              + f" {row.premises_per_s:>12.2f}" for row in figures.rows]
    return "\n".join(lines)
