"""A local Hugging Face model directory (`model=hf model.path=DIR`): its config, its weights, read safely.

Nothing is downloaded: a hub name, or a directory that holds no `config.json`, is one ConfigError line. A model
directory is data, not code: a config that needs the repository's own modelling code (`auto_map`) is refused
unless `model.trust_remote_code=true`. `.bin` weights are read with `torch.load(weights_only=True)`; a file that
fails that is refused, never unpickled.

The directory's `config.json` also fills the run's `model` group (layers, widths, heads, vocabulary, context), so
validation, FLOPs and the estimator see the same model the strategies build.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dist_train.config import ConfigError, ModelConfig, require
from dist_train.weights import WeightSource

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
INITS = ("pretrained", "random")


def _hub_name(path: str) -> str | None:
    """`org/name` where a missing model.path reads as a hub name as the user typed it: the entry points make a
    relative path absolute (paths.normalize_paths), so it is judged as it was given (`~/models/x` is not one)."""
    from dist_train.paths import as_typed

    typed = as_typed(path)
    return typed if typed.count("/") == 1 and not typed.startswith((".", "~", "/", "$")) else None


@dataclass(frozen=True)
class ModelDir(WeightSource):
    """A model directory; as a WeightSource its units are the weight files."""

    path: Path

    @classmethod
    def open(cls, path: str | None) -> "ModelDir":
        """The directory `model.path` names, checked: a ConfigError line for anything that is not one."""
        require(bool(path), "model=hf needs model.path=DIR: a local directory with a transformers config.json "
                            "(save_pretrained's output)")
        p = Path(os.path.expanduser(str(path)))
        if not p.exists():
            hub = _hub_name(str(path))
            raise ConfigError(
                f"model.path={path!r} is not a local directory"
                + ("; it looks like a hub name, and dist_train downloads nothing: fetch it first (e.g. "
                   f"`huggingface-cli download {hub} --local-dir DIR`) and pass model.path=DIR" if hub else "")
            )
        require(p.is_dir(), f"model.path={path!r} is a file, not a model directory")
        adapter = p / "adapter_config.json"
        if adapter.is_file() and not (p / "config.json").is_file():
            base = json.loads(adapter.read_text()).get("base_model_name_or_path")
            raise ConfigError(
                f"model.path={path!r} holds a LoRA adapter (peft's format"
                + (f", over {base}" if base else "")
                + "), not a model: export the run with `launch/export.py CHECKPOINT OUT --merge` and pass "
                "model.path=OUT, or load the adapter with peft's PeftModel.from_pretrained(base, DIR)"
            )
        require((p / "config.json").is_file(),
                f"model.path={path!r} has no config.json: not a transformers model directory (save_pretrained writes one)")
        return cls(p.resolve())

    # ------------------------------------------------------------------ config
    def raw_config(self) -> dict[str, Any]:
        try:
            return json.loads((self.path / "config.json").read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model.path={self.path}: config.json is not valid JSON ({exc.msg}, line {exc.lineno})")

    def needs_remote_code(self) -> bool:
        """Whether the config names modelling code shipped with the directory (`auto_map`)."""
        return bool(self.raw_config().get("auto_map"))

    def config(self, *, trust_remote_code: bool = False, dropout: float | None = None) -> Any:
        """transformers' config for this directory (local files only). `dropout` replaces every dropout
        probability the config sets (dist_train's promise of one training for every strategy needs it fixed)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig

        if self.needs_remote_code():
            require(trust_remote_code,
                    f"model.path={self.path}: its config.json names modelling code shipped with the directory (auto_map); "
                    "it runs only with model.trust_remote_code=true, if you trust that code")
        try:
            cfg = AutoConfig.from_pretrained(self.path, local_files_only=True, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"model.path={self.path}: transformers cannot read its config.json "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from exc
        cfg.use_cache = False
        if dropout is not None:
            for key, value in list(cfg.to_dict().items()):
                if (key.endswith("dropout") or key.endswith("pdrop")) and isinstance(value, float):
                    setattr(cfg, key, dropout)
        return cfg

    # ------------------------------------------------------------------ weights
    @functools.cached_property
    def _layout(self) -> tuple[list[Path], dict[str, str] | None]:
        """(the weight files, in the index's order where there is one; the index's weight_map, or None)."""
        for index, single in ((SAFETENSORS_INDEX, SAFETENSORS), (BIN_INDEX, BIN)):
            if (self.path / index).is_file():
                weight_map = json.loads((self.path / index).read_text()).get("weight_map", {})
                return [self.path / name for name in dict.fromkeys(weight_map.values())], weight_map
            if (self.path / single).is_file():
                return [self.path / single], None
        return sorted(self.path.glob("*.safetensors")), None

    def weight_files(self) -> list[Path]:
        """The weight files; [] when the directory holds none."""
        return self._layout[0]

    @property
    def has_weights(self) -> bool:
        return bool(self.weight_files())

    def check_bin_files(self) -> None:
        """Every .bin file loads with weights_only=True (tensors only), or a ConfigError line: never unpickled."""
        import pickle

        for f in self.weight_files():
            if f.suffix != ".bin":
                continue
            try:
                _open(f)
            except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as exc:
                raise ConfigError(f"{f}: refused, it does not load with torch.load(weights_only=True) (it holds more than "
                                  "tensors, and unpickling it could run code); convert it to safetensors") from exc

    @functools.cached_property
    def locations(self) -> dict[str, Path]:
        """Which file holds each tensor, found once: the index's weight_map where there is one, else each file's
        own list of names (safetensors' header; a .bin is loaded memory-mapped)."""
        files, weight_map = self._layout
        if weight_map is not None:
            return {name: self.path / file for name, file in weight_map.items()}
        out: dict[str, Path] = {}
        for f in files:
            out.update(dict.fromkeys(self._handle(f).keys(), f))
        return out

    def _open_unit(self, key: Any) -> Any:
        return _open(key)


def _open(f: Path) -> Any:
    """A safetensors file's lazy reader (its pages mapped, read when a tensor or slice is asked for), or a .bin's
    state dict loaded memory-mapped (tensors only)."""
    if f.suffix == ".safetensors":
        from safetensors import safe_open

        return safe_open(f, framework="pt")
    import torch

    return torch.load(f, map_location="cpu", weights_only=True, mmap=True)


def resolve_model(model: ModelConfig) -> None:
    """For `model.path=DIR`: check the directory, choose the init, and fill the model group from its config.json.
    A preset (no path) is left as it is; `model=hf` without a path is refused (it would train the schema's default
    sizes, a model nobody asked for)."""
    if model.path is None:
        require(model.name != "hf", "model=hf needs model.path=DIR: a local directory with a transformers config.json "
                                    "(save_pretrained's output)")
        return
    d = ModelDir.open(model.path)
    if model.init is not None:
        require(model.init in INITS, f"model.init={model.init!r} is not supported; allowed: {', '.join(INITS)}")
    weights = d.has_weights
    init = model.init or ("pretrained" if weights else "random")
    require(init == "random" or weights,
            f"model.init=pretrained but model.path={model.path} holds no weights (model.safetensors, an index of "
            "shards, or pytorch_model.bin); use model.init=random to train it from scratch")
    if init == "pretrained":
        d.check_bin_files()
    cfg = d.config(trust_remote_code=model.trust_remote_code, dropout=model.dropout)
    model.init = init
    model.path = str(d.path)
    if model.name in ("hf", "", None):
        model.name = d.path.name
    model.arch = str(cfg.model_type)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    model.num_layers = int(text.num_hidden_layers)
    model.hidden_size = int(text.hidden_size)
    model.num_heads = int(text.num_attention_heads)
    model.num_kv_heads = getattr(text, "num_key_value_heads", None)
    model.ffn_hidden_size = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None)
    model.head_dim = getattr(text, "head_dim", None)
    # attention_bias covers q, k, v and o (Llama, Mistral, Qwen3, Gemma); Qwen2 builds q, k, v with biases always
    attention_bias = bool(getattr(text, "attention_bias", False))
    # (Qwen2-MoE's config says so as qkv_bias)
    model.qkv_bias = attention_bias or bool(getattr(text, "qkv_bias", False)) or cfg.model_type == "qwen2"
    model.out_bias = attention_bias
    model.mlp_bias = bool(getattr(text, "mlp_bias", False))
    # per-head q/k norms: the entries transformers' tensor-parallel plan keeps whole on every rank (Qwen3)
    plan = getattr(text, "base_model_tp_plan", None) or {}
    model.qk_norm = {"layers.*.self_attn.q_norm", "layers.*.self_attn.k_norm"} <= plan.keys()
    model.vocab_size = int(text.vocab_size)
    model.max_seq_len = int(getattr(text, "max_position_embeddings", 0) or model.max_seq_len)
    model.tie_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
    _read_experts(model, text)


def _read_experts(model: ModelConfig, text: Any) -> None:
    """An MoE config's experts (transformers' stacked experts: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): how many, the
    top-k, each expert's width, which layers are MoE (decoder_sparse_step, mlp_only_layers) and a shared expert."""
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0
    model.num_experts = int(experts)
    if not experts:
        return
    model.experts_per_token = int(getattr(text, "num_experts_per_tok", 0) or 0)
    model.moe_ffn_hidden_size = getattr(text, "moe_intermediate_size", None) or model.ffn_hidden_size
    step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(text, "mlp_only_layers", None) or [])
    moe = [i for i in range(model.num_layers) if i not in dense and (i + 1) % step == 0]
    model.moe_layers = None if len(moe) == model.num_layers else moe
    model.shared_expert_ffn_hidden_size = getattr(text, "shared_expert_intermediate_size", None) or None
