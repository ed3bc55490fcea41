"""The table `leanagent bench` prints: one line per figure, the training step's rows, the CUDA rows."""

from __future__ import annotations

from leanagent.bench.results import BenchResult

LABELS = [
    ("corpus_load_s", "corpus load (s)"), ("corpus_rss_mb", "corpus resident memory (MB)"),
    ("train_examples_per_s", "negatives + collate (examples/s)"), ("tokenize_premises_per_s", "tokenize (premises/s)"),
    ("embed_premises_per_s", "embed corpus, sorted (premises/s)"),
    ("embed_unsorted_premises_per_s", "embed corpus, corpus order (premises/s)"),
    ("embed_speedup", "embedding speed-up from sorting"),
    ("embed_autocast_premises_per_s", "embed corpus, sorted, bf16 autocast (premises/s)"),
    ("embed_autocast_speedup", "embedding speed-up from bf16 autocast"),
    ("retrieval_ms_per_context", "retrieval, top 100 accessible (ms/context)"),
    ("retrieval_leanagent_style_ms_per_context", "retrieval, LeanAgent's search (ms/context)"),
    ("retrieval_speedup", "retrieval speed-up over LeanAgent's search"),
    ("retrieval_same_as_leanagent_style", "retrieval scores equal LeanAgent's search"),
    ("retrieval_scoring_path", "  its product's scoring path"),
    ("retrieval_mask_ms_per_context", "  its accessibility masks alone (ms/context)"),
    ("retrieval_product_ms_per_context", "  its product alone (ms/context)"),
    ("retrieval_selection_ms_per_context", "  its selection alone (ms/context)"),
    ("retrieval_rows_candidates", "  rows decided among the candidates"),
    ("retrieval_rows_ties", "  rows with a tie past the candidates"),
    ("train_s_per_example", "training step (s/example)"), ("fisher_s_per_example", "Fisher pass, loop (s/example)"),
    ("fisher_over_train", "Fisher loop / training per example"),
    ("fisher_vectorised_s_per_example", "Fisher pass, vectorised (s/example)"),
    ("fisher_vectorised_over_train", "Fisher vectorised / training per example"),
    ("train_max_len", "training and Fisher sequences cut at (bytes)"),
    ("train_peak_memory_gb", "training step, peak GPU memory (GiB)"),
    ("fisher_peak_memory_gb", "Fisher pass, peak GPU memory (GiB)"),
    ("launch_overhead_s", "job start to first step (s)"),
]
STEP_LABELS = {"padded": "padded", "sorted": "sorted", "sorted_one_mask": "sorted + one mask",
               "compiled": "sorted + one mask + compiled"}


def format_table(result: BenchResult) -> str:
    """The figures of `result`, labelled; scalar figures by their JSON key (`LABELS`), the rest by section."""
    figures = result.flat()
    run, corpus, step = result.run, result.corpus, result.train_step
    lines = [f"leanagent bench: {run.dataset} ({corpus.num_premises if corpus else None} premises, "
             f"{corpus.num_files if corpus else None} files), model {run.model}, device {run.device}",
             f"  CPU {run.cpu} [{run.cpu_flags}], {run.threads} threads, torch {run.torch}"]
    for key, label in LABELS:
        value = figures.get(key)
        if isinstance(value, bool):
            lines.append(f"  {label:<46} {'yes' if value else 'NO':>12}")
        elif isinstance(value, (int, float)):
            lines.append(f"  {label:<46} {value:>12.4g}")
        elif isinstance(value, str):
            lines.append(f"  {label:<46} {value:>12}")
    if result.fisher is not None:
        lines.append(f"  {'Fisher method auto takes here':<46} {result.fisher.fisher_auto:>12}")
        for name, figures_of_pass in result.fisher.passes.items():
            if figures_of_pass.error is not None:
                lines.append(f"  {name.replace('_', ' ')} error: {figures_of_pass.error}")
    if step is not None:
        contexts = (f"contexts: {run.num_states} proof states of {', '.join(run.states)}"
                    if run.states else "contexts: the dataset's")
        lines.append(f"  training step, {step.train_step_examples} examples in batches of 4 cut at "
                     f"{run.train_step_max_len} bytes ({contexts}; premises: the dataset's corpus), "
                     f"{step.train_step_real_tokens_per_example:.0f} real tokens per example;")
        lines.append(f"  model {run.train_model}, bf16 autocast; loss sorted vs padded (fp32, dropout off): "
                     f"{step.train_step_loss_rel_diff:.2e} relative; rows in turns, each its best of "
                     f"{step.train_step_rounds_best_of} rounds")
        if step.compile_s is not None:
            warm = step.compile_warm_s if step.compile_warm_s is not None else float("nan")
            lines.append(f"  compile (regional, each T5 block): {step.compile_s:.1f} s cold, "
                         f"{warm:.1f} s with the inductor cache warm")
        if step.compile_error is not None:
            lines.append(f"  compile failed: {step.compile_error}")
        lines.append(f"    {'':<30} {'examples/s':>11} {'real tok/s':>11} {'token eff.':>10} {'speed-up':>9}"
                     + (f" {'MFU':>6}" if run.peak_bf16_tflops else ""))
        for name, label in STEP_LABELS.items():
            row = step.rows.get(name)
            if row is None:
                continue
            if row.examples_per_s is None:
                if row.error is not None:
                    lines.append(f"    {label:<30} {row.error}")
                continue
            speedup = row.speedup if row.speedup is not None else 1.0
            line = (f"    {label:<30} {row.examples_per_s:>11.3g} {row.tokens_per_s:>11.4g} "
                    f"{row.token_efficiency:>10.3f} {speedup:>8.2f}x")
            if row.mfu is not None:
                line += f" {100 * row.mfu:>5.1f}%"
            lines.append(line)
    for row in result.cuda_training or []:
        compiled = " compiled" if row.compiled else ""
        head = f"  cuda training{compiled} L={row.length:<5} batch {row.batch_size:<3}"
        if row.error is not None:
            lines.append(f"{head} {row.error}")
            continue
        mfu_text = f"MFU {100 * row.mfu:.1f}%" if row.mfu is not None else "MFU -"
        lines.append(f"{head} {row.examples_per_s:>9.1f} ex/s {row.tokens_per_s:>12.0f} tok/s  {mfu_text}")
    return "\n".join(lines)
