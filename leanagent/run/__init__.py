"""A lifelong run's state, in one place and without Prefect: `plan.py` (what a run of a config will do in its
run_dir, checked before anything is written, planned once per process), `state.py` (the manifest, its lock and the
stages' records), `strategy.py` (what each repository trains on: itself, or the merge of those before it)."""
