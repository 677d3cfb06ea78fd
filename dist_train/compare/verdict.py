"""Does a strategy train like one process? Its loss curve against single's, step by step."""

from __future__ import annotations

from typing import Any, Optional

BASELINE = "single"


def baseline_row(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    return next((r for r in rows if r["strategy"] == BASELINE and r["status"] == "ok"), None)


def add_verdicts(rows: list[dict[str, Any]], *, rtol: float) -> None:
    """Sets loss_dev (final loss - single's), loss_max_rel_dev, agrees and verdict on every row."""
    base = baseline_row(rows)
    for row in rows:
        row["agrees"], row["verdict"] = judge(row, base, rtol=rtol)


def judge(row: dict[str, Any], base: Optional[dict[str, Any]], *, rtol: float) -> tuple[Optional[bool], str]:
    if row["status"] != "ok":
        return None, f"{row['status']}: {row['reason']}"
    if row["strategy"] == BASELINE:
        return True, f"baseline (one process), final loss {row['final_loss']:.6f}"
    if base is None:
        return None, "no single baseline to compare with (single failed or was not run)"
    ours, theirs = row["losses"], base["losses"]
    if len(ours) != len(theirs):
        return False, f"cannot compare: {len(ours)} logged steps vs {len(theirs)} for single"
    devs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, theirs)]
    worst = max(range(len(devs)), key=devs.__getitem__)
    row["loss_dev"] = row["final_loss"] - base["final_loss"]
    row["loss_max_rel_dev"] = devs[worst]
    detail = (f"max relative loss deviation {devs[worst]:.1e} (step {worst + 1} of {len(devs)}), "
              f"final {row['final_loss']:.6f} vs {base['final_loss']:.6f} (Δ {row['loss_dev']:+.1e})")
    if devs[worst] <= rtol:
        return True, f"agrees with single: {detail}"
    return False, f"DIFFERS from single (> {rtol:g}): {detail}"
