"""Does a strategy train like one process? Its loss curve against single's, step by step."""

from __future__ import annotations

from typing import Any, Optional

BASELINE = "single"


def is_baseline(row: dict[str, Any]) -> bool:
    """A single run, whatever its row's overrides (`single+precision=bf16` is the bf16 rows' baseline)."""
    return row.get("strategy_name", row["strategy"]) == BASELINE


def baseline_row(rows: list[dict[str, Any]], *, like: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    """The single run to judge `like` against: one that trained the same config (the same config hash)."""
    for r in rows:
        if is_baseline(r) and r["status"] == "ok":
            if like is None or r.get("config_hash") == like.get("config_hash"):
                return r
    return None


def add_verdicts(rows: list[dict[str, Any]], *, rtol: float) -> None:
    """Sets loss_dev (final loss - single's), loss_max_rel_dev, agrees and verdict on every row."""
    for row in rows:
        row["agrees"], row["verdict"] = judge(row, baseline_row(rows, like=row), rtol=rtol)


def judge(row: dict[str, Any], base: Optional[dict[str, Any]], *, rtol: float) -> tuple[Optional[bool], str]:
    if row["status"] != "ok":
        return None, f"{row['status']}: {row['reason']}"
    if is_baseline(row):
        return True, f"baseline (one process), final loss {row['final_loss']:.6f}"
    if base is None:
        return None, "no single baseline with the same training config to compare with (single failed, was not run, " \
                     "or trained another config)"
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
