"""What a lifelong run reports: a row per repository, the recall matrix and LeanAgent's lifelong metrics.

Kept in the library (no Prefect) so that the CLI's plain-text table, the Prefect artifacts and
the tests all read one representation. The matrix is the point of lifelong learning: row i is
the model after training on repository i, column j the repository it is evaluated on, so the
column under an early repository shows what later training forgot. The untrained model's row
(the baseline) shows what training gained at all. The metrics (WF5, FM, EBWT, WP5, IP, CFR; see
`leanagent.report.metrics`) are LeanAgent's summary of that matrix and of the validation recall
curve, and are recomputed after every repository, so a run can be judged while it is still going.

Units, as in LeanAgent: Recall@1 and Recall@10 in percent (2 decimals), MRR a fraction (3 decimals).

`leanagent report SOURCE...` compares runs: a SOURCE is a run_dir (its manifest) or a JSON file of
a recall matrix (`load_run`); `comparison_text`, `comparison_json` and `write_png` render them.

One module per concern: `run.py` (one run's report), `compare.py` (runs side by side), `png.py` (the
figure), `cells.py` (how a number is printed), `timing.py` (where each job's time went); this package names what
the rest of leanagent uses.
"""

from leanagent.report.compare import (
    LifelongRun,
    SourceError,
    compare,
    comparison_json,
    comparison_text,
    load_run,
    run_setup,
)
from leanagent.report.png import write_png
from leanagent.report.run import (
    MATRIX_METRIC,
    UNTRAINED,
    RunReport,
    glossary_text,
    report_from_manifest,
)
from leanagent.report.timing import JobCost, job_costs, time_markdown, time_text

__all__ = ["MATRIX_METRIC", "UNTRAINED", "JobCost", "LifelongRun", "RunReport", "SourceError", "compare",
           "comparison_json", "comparison_text", "glossary_text", "job_costs", "load_run", "report_from_manifest",
           "run_setup", "time_markdown", "time_text", "write_png"]
