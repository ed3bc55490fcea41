"""The ground floor: what every other floor stands on, and nothing above it.

`config.py` (the typed config, LeanAgent's settings as defaults), `atomic.py` (atomic file writes), `ranks.py` (which
rank this process is), `file_digest.py` (a file's SHA-256), `model_identity.py` (which weights built an index),
`job.py` (one job as both sides see it: its arguments, `result.json`, heartbeats), `timings.py` (where a job's time
went), `supervision.py` (process trees, signals, nothing left behind), `exit_fast.py` (a rank's quick exit)."""
