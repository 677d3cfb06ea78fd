"""Compare strategies: run each one under the same config, then explain where memory and time go.

    python launch/compare.py compare.strategies=[single,ddp,fsdp,zero1,zero2,zero3,gpipe] compare.nproc=2 model=tiny

settings.py  the compare.* options and the per-row strategy specs
runner.py    one training launch per strategy (a failure becomes a row with its reason)
table.py     a row per strategy from the run's summary.json / metrics.jsonl
verdict.py   loss curve against single's
predicted.py the estimator's prediction beside the measurement
plots.py     the pictures; report.py / document.py the tables and report.md; wandb_log.py the W&B run
main.py      the order of all of the above
"""

from dist_train.compare.main import Comparison, main, run_comparison
from dist_train.compare.settings import CompareConfig, StrategySpec

__all__ = ["CompareConfig", "Comparison", "StrategySpec", "main", "run_comparison"]
