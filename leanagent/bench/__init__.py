"""`leanagent bench`: how fast each stage of the data and model path runs, measured in one process.

A benchmark, not a test: it prints a table and writes JSON, and its numbers are meant to be
compared as ratios within one run (these machines are noisy). Each figure isolates one piece of
what a lifelong run spends its time on:

- corpus load (time and resident memory), premise tokenization;
- training examples: negative sampling + collate, batch 4, 3 negatives, 1024 bytes, one process;
- corpus embedding with the given model, sorted into token-budget batches and, for comparison,
  in corpus order (the straightforward way), in fp32 as evaluation does; sorted again under bf16
  autocast (`model.corpus_autocast`);
- retrieval: the top 100 accessible premises per context, batched, at the model's width, in bf16
  as under bf16-mixed; and LeanAgent's search (a full sort walked in Python) on the same embeddings,
  for the ratio and to check that both find the same scores; each part alone (the accessibility masks, the
  product, the selection) and the rows each way of selecting took, the passes taking turns;
- the real training step (`PremiseRetriever.training_step`, backward, clipping, AdamW) on the dataset's
  batches, optionally with the proof states of LeanDojo split files as contexts (`--states`: their real
  lengths), four ways: padded, length-sorted sub-batches, + one attention mask per forward, + compiled
  blocks; examples/s, real tokens/s, token efficiency, MFU on CUDA (`leanagent.bench.perf`), compile time
  cold and warm, and the sorted loss against the padded one;
- that step against the Fisher pass, per example, on the same examples (loop; vectorised on CUDA);
- the launch overhead of a real job, from its start to its first training step (on the demo);
- with `--device cuda`: the same training step on fixed-length batches (L = 512 and 1024, batch 4 to 16),
  with tokens/s and model FLOP utilisation.

On a CPU the training rows use the model's first 2 layers (`--train-layers`): every layer of byt5-small's
width has the same matmuls and attention shapes, so fewer layers keep each step's balance (the share of
matmuls against attention's and dropout's elementwise work) at a sixth of the time.

That is the `path` section. One module per concern: `data.py`, `retrieval.py` (embedding and retrieval),
`train_step.py`, `fisher.py`, `launch.py`, `cuda.py` (fixed-length batches), `table.py`; `options.py` (each
section's options, what a run measures: light, so the command line builds its flags from them without importing
torch), `results.py` (a typed section per measurement, and the flat JSON `--json` writes), `timing.py` (the one
set of timing helpers), `cpu.py` (the CPU's name and flags, read once), `run.py` (`run_bench`). The other sections,
a module each: `curriculum.py` (a whole curriculum twice, and the projection at LeanAgent's scale), `swap.py` (a
server following a run), `dtypes.py` (the served encoder per dtype), `grad_cache.py` (`model.grad_cache`'s memory
and time), `batching.py` (a server in process, batched or not), `serving.py` (real `leanagent serve` processes
under concurrent clients). Import what you use from its module: this package imports nothing, so that reading the
options costs nothing.
"""

