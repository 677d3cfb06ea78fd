"""W&B trouble never stops training: a failing log call turns W&B off, once. Online trouble and an unusable
directory on real runs: tests/launched/test_wandb_trouble.py."""

from __future__ import annotations

import logging


def test_a_failing_log_call_turns_wandb_off_once(caplog):
    from dist_train.telemetry.wandb_sink import WandbSink

    class Broken:
        def log(self, *args: object, **kwargs: object) -> None:
            raise OSError(28, "No space left on device")

    sink = WandbSink.__new__(WandbSink)
    sink.run, sink.mode = Broken(), "offline"
    with caplog.at_level(logging.WARNING, logger="dist_train"):
        for step in (1, 2, 3):
            sink.log(step, [{"step": step, "rank": 0, "loss": 1.0}])
        sink.finish({"final_loss": 1.0})
    assert sink.run is None
    assert [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()] == [
        "W&B: OSError: [Errno 28] No space left on device; W&B is off for the rest of this run "
        "(metrics.jsonl and summary.json go on)"
    ]
