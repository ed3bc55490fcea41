"""A lifelong run's state, in one place and without Prefect: `manifest.py` (the manifest file: how it is read, the
stages it records and their names), `fingerprint.py` (the settings that make a run the experiment it is),
`state.py` (the run_dir's lock and the manifest's writer), `plan.py` (what a run of a config will do in its
run_dir, checked before anything is written), `strategy.py` (what each repository trains on: itself, the merge
of those before it, or that merge with a replayed share of the earlier ones)."""
