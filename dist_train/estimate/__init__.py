"""Predict per-rank memory and per-step communication of a strategy from closed-form formulas.

    python -m dist_train.estimate model=llama_1b strategy=zero3 world_size=8 precision=bf16 gpu_gib=80

Pure arithmetic (no torch, no process group): shapes.py counts parameters, memory.py applies the ZeRO
paper's model-state formulas plus activations and KV cache, comm.py the per-step collective volumes,
fit.py answers "which strategies fit in G GiB per GPU on N GPUs", cli.py is the command line; step_time.py
predicts a step's time from those collectives and a device's profile (hardware.py), for the advisor
(dist_train/plan) and the comparison report.
"""

from dist_train.estimate.comm import Collective, predict_comm, ring_bytes
from dist_train.estimate.fit import FitCell, FitModel, fit_table
from dist_train.estimate.memory import (
    RankMemory,
    StateBytes,
    activation_bytes,
    kv_cache_bytes,
    model_state_bytes,
    predict_memory,
    state_bytes,
)
from dist_train.estimate.setup import KNOWN_STRATEGIES, REGIMES, Setup, family_of, setup_from_config
from dist_train.estimate.shapes import PRESETS, ModelShape, stage_params

__all__ = [
    "Collective", "FitCell", "FitModel", "KNOWN_STRATEGIES", "ModelShape", "PRESETS", "REGIMES", "RankMemory",
    "Setup", "StateBytes", "activation_bytes", "family_of", "fit_table", "kv_cache_bytes", "model_state_bytes",
    "predict_comm", "predict_memory", "ring_bytes", "setup_from_config", "stage_params", "state_bytes",
]
