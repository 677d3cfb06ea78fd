"""Causal LMs from `transformers` configs or local model directories (nothing is downloaded), and their loss.

This module knows nothing of distribution: strategies wrap, shard or split what it builds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from dist_train.config import ModelConfig, checkpointing_mode
from dist_train.contracts import local_tensor, whole_numel


def build_model(cfg: ModelConfig, *, seed: int, empty: ContextManager[Any] | None = None,
                quantize: Callable[[nn.Module, Any], None] | None = None) -> nn.Module:
    """The model on the CPU in fp32: a model directory's weights (`model.init=pretrained`, read by transformers),
    or random weights drawn from `seed` block by block (`SeededInit`: the same values whatever a strategy shards).

    empty: build the structure only, inside this context: the strategy's `empty_model_context()` (the meta device,
    or DeepSpeed's zero.Init). The strategy shards or splits it, then each rank fills only what it holds from
    `weight_source(cfg, seed)` (weights.materialize): the files, or the same seeded draw.

    quantize: QLoRA's base (`qlora_base`), built on meta and quantised as it loads: each projection is read and
    packed in turn, then the rest is filled; the fp32 model is never held.

    Building never draws from the global generator (under zero.Init, construction initialises real tensors), so
    what follows starts from `torch.manual_seed(seed)` under every strategy."""
    assert empty is None or quantize is None, "QLoRA's packed layers are built whole, not sharded"
    if cfg.path is not None and cfg.init == "pretrained" and empty is None and quantize is None:
        torch.manual_seed(seed)
        model = _from_pretrained(cfg)
    else:
        make = _constructor(cfg)  # the architecture's code imported outside `empty` (see _constructor)
        with torch.random.fork_rng(devices=[]), (empty if empty is not None else torch.device("meta")):
            model = make()
        if empty is None:  # whole: random weights drawn as every strategy draws them, or QLoRA's base
            from dist_train.weights import materialize

            source = weight_source(cfg, seed)
            if quantize is not None:
                quantize(model, source)
            materialize(model, source, "cpu")
        torch.manual_seed(seed)
    model.train()
    return model


def weight_source(cfg: ModelConfig, seed: int) -> Any:
    """Where the weights of a model built empty come from: the directory's files (`model.init=pretrained`), or
    the seeded random init drawn on a reference built on meta."""
    from dist_train.weights import SeededInit

    if cfg.path is not None and cfg.init == "pretrained":
        from dist_train.pretrained import ModelDir
        from dist_train.weights import experts_stacked

        d = ModelDir.open(cfg.path)
        # an MoE model's files hold each expert apart, where the model stacks them
        return experts_stacked(d, d.raw_config().get("model_type", "")) if cfg.num_experts else d
    make = _constructor(cfg)
    with torch.device("meta"):
        reference = make()
    return SeededInit(reference, seed, blocks=list(transformer_blocks(reference)))


def _constructor(cfg: ModelConfig) -> Callable[[], nn.Module]:
    """A function that builds the architecture with no weights drawn or read (they are filled afterwards), its
    modelling code imported now: zero.Init patches torch.Tensor.__new__, and an import under it (transformers' lazy
    modules import torch._dynamo) fails."""
    if cfg.path is None:
        from transformers import GPT2LMHeadModel, LlamaForCausalLM, Qwen3MoeForCausalLM  # noqa: F401

        build = {"gpt2": _build_gpt2, "qwen3_moe": _build_qwen3_moe}.get(cfg.arch, _build_llama)

        def make() -> nn.Module:
            return build(cfg)
    else:
        from transformers import AutoModelForCausalLM
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        from dist_train.pretrained import ModelDir

        hf = ModelDir.open(cfg.path).config(trust_remote_code=cfg.trust_remote_code, dropout=cfg.dropout)
        pin_experts(hf, cfg)
        if type(hf) in MODEL_FOR_CAUSAL_LM_MAPPING:
            MODEL_FOR_CAUSAL_LM_MAPPING[type(hf)]

        def make() -> nn.Module:
            return AutoModelForCausalLM.from_config(hf, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code)

    from transformers.initialization import no_init_weights

    def empty() -> nn.Module:
        # transformers' own init would run on zero.Init's partitions (Gemma's padding row: an IndexError on an
        # empty partition) and draw what the filling overwrites; the head is tied here instead of in it.
        with no_init_weights():
            model = make()
        model.tie_weights()
        return model

    return empty


def _from_pretrained(cfg: ModelConfig) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from dist_train.pretrained import ModelDir

    d = ModelDir.open(cfg.path)
    hf = d.config(trust_remote_code=cfg.trust_remote_code, dropout=cfg.dropout)
    extra = {}
    quantized = getattr(hf, "quantization_config", None) or {}
    method = quantized.get("quant_method") if isinstance(quantized, dict) else getattr(quantized, "quant_method", None)
    if method == "mxfp4":  # GPT-OSS's published experts: kept quantized (and untrainable) where transformers' MXFP4
        # kernels run (a GPU with triton and `kernels`), dequantized elsewhere; trained here, so dequantized always
        from transformers import Mxfp4Config

        extra["quantization_config"] = Mxfp4Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(
        d.path, config=hf, dtype=torch.float32, local_files_only=True, trust_remote_code=cfg.trust_remote_code,
        **extra)


def _build_gpt2(cfg: ModelConfig) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.max_seq_len,
        n_embd=cfg.hidden_size,
        n_layer=cfg.num_layers,
        n_head=cfg.num_heads,
        n_inner=cfg.ffn_hidden_size,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        tie_word_embeddings=cfg.tie_embeddings,
        use_cache=False,
        bos_token_id=None,  # no special tokens: synthetic and byte-level data
        eos_token_id=None,
    )
    return GPT2LMHeadModel(hf)


_GROUPED_MM_AUTOCAST: set[str] = set()  # the devices whose autocast now casts grouped_mm (autocast_grouped_mm)


def autocast_grouped_mm(devices: tuple[str, ...] = ("cpu", "cuda")) -> None:
    """Make torch's grouped matrix product autocast to bf16, which torch does not do (pytorch/pytorch#174763).
    transformers' grouped_mm experts cast their input to the weights' dtype instead, so over torch autocast's fp32
    weights (single, dp, ddp, the pipelines, tp under precision=bf16) the experts multiplied in fp32: a whole step of
    a 64-expert model on an H200 took 176 ms (docs/BENCHMARKS.md), and the arithmetic differed from FSDP2's and
    DeepSpeed's, whose parameters are bf16 in compute. Registered once per process, for bf16 runs: the cast dtype
    is fixed at registration (an fp16 run's grouped_mm stays in fp32)."""
    for device in devices:
        if device not in _GROUPED_MM_AUTOCAST:
            torch.library.register_autocast("aten::_grouped_mm", device, torch.bfloat16)
            _GROUPED_MM_AUTOCAST.add(device)


def pin_experts(hf: Any, cfg: ModelConfig) -> None:
    """An MoE config's experts implementation, pinned to model.experts_implementation (transformers would choose
    grouped_mm where it can dispatch, eager elsewhere: arithmetic that differs between machines)."""
    if cfg.num_experts:
        hf._experts_implementation = cfg.experts_implementation


def _build_qwen3_moe(cfg: ModelConfig) -> nn.Module:
    """Qwen3-MoE from the preset's fields: every layer MoE, top-k weights renormalised, no auxiliary loss (transformers
    adds it only with output_router_logits), experts as model.experts_implementation computes them."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf = Qwen3MoeConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size or 4 * cfg.hidden_size,
        moe_intermediate_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size or 4 * cfg.hidden_size,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.experts_per_token,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        output_router_logits=False,
        head_dim=cfg.head_dim or cfg.hidden_size // cfg.num_heads,
        **_decoder_fields(cfg),
    )
    pin_experts(hf, cfg)
    return Qwen3MoeForCausalLM(hf)


def _build_llama(cfg: ModelConfig) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size or 4 * cfg.hidden_size,
        **_decoder_fields(cfg),
    )
    return LlamaForCausalLM(hf)


def _decoder_fields(cfg: ModelConfig) -> dict[str, Any]:
    """What a Llama-like transformers config takes from the preset beside its widths: depth, heads, context, dropout,
    tying, and no cache or special tokens (synthetic and byte-level data)."""
    return dict(num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads or cfg.num_heads, max_position_embeddings=cfg.max_seq_len,
                attention_dropout=cfg.dropout, tie_word_embeddings=cfg.tie_embeddings, use_cache=False,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)


@dataclass(frozen=True)
class Layout:
    first: tuple[str, ...]  # only the first stage runs these (embeddings)
    blocks: str  # the nn.ModuleList of transformer blocks
    last: tuple[str, ...]  # only the last stage runs these (final norm, LM head)
    embedding: str  # the input embedding (tied to the head when tie_word_embeddings)
    head: str
    # (model, its blocks of this stage, input, is_first=, is_last=) -> output: a stage's forward where transformers'
    # own cannot run a slice of the blocks (no pipeline plan); None: the model's own forward
    stage_forward: Callable[..., torch.Tensor] | None = None

    @property
    def generic(self) -> bool:
        """Whether a pipeline stage runs the model's own forward (else `stage_forward`, written out here)."""
        return self.stage_forward is None


def _gpt2_stage_forward(model: nn.Module, blocks: list[nn.Module], x: torch.Tensor, *, is_first: bool,
                        is_last: bool) -> torch.Tensor:
    """GPT2Model.forward + GPT2LMHeadModel.forward (transformers 5.x) over one pipeline stage's blocks, no cache, no
    padding: the first stage embeds the token ids `x` (tokens and learned positions), the others take the hidden
    states; the last applies the final norm and the head."""
    from transformers.masking_utils import create_causal_mask

    t = model.transformer
    positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    if is_first:
        hidden = t.wte(x)
        hidden = t.drop(hidden + t.wpe(positions).to(hidden.device))
    else:
        hidden = x
    # As the full model builds it (with sdpa and no padding mask: None, causal by `is_causal`). The cache (None)
    # goes by position: transformers 5.24 renamed it `past_key_values` -> `cache` (the old name warns), 5.23
    # knows only the old one.
    mask = create_causal_mask(model.config, hidden, None, None, position_ids=positions)
    for block in blocks:
        hidden = block(hidden, None, mask, None, encoder_attention_mask=None, use_cache=False, position_ids=positions)
    if not is_last:
        return hidden
    return model.lm_head(t.ln_f(hidden))


# GPT-2 has no pipeline plan in transformers; a pipeline stage runs its forward as written above.
GPT2 = Layout(first=("transformer.wte", "transformer.wpe", "transformer.drop"), blocks="transformer.h",
              last=("transformer.ln_f", "lm_head"), embedding="transformer.wte", head="lm_head",
              stage_forward=_gpt2_stage_forward)


def layout_of(config: Any, *, prefix: str = "model", model: nn.Module | None = None) -> Layout:
    """Where the parts of a model of this config live: GPT-2's, or what transformers' pipeline plan says
    (`base_model_pp_plan`, in order: what runs before the blocks, the block list (the entry that takes the attention
    mask), what runs after), under the base model's attribute `prefix`, and the head `lm_head`. A model without a plan
    whose base model is a plain decoder stack (embeddings, the list of its `_no_split_modules` blocks, a final norm;
    `model`, or built from the config on the meta device) is laid out from that structure. ValueError, saying why,
    for a model that is neither."""
    if config.model_type == "gpt2":
        return GPT2
    plan = dict(getattr(config, "base_model_pp_plan", None) or {})
    names = list(plan)
    blocks = [i for i, name in enumerate(names) if "attention_mask" in plan[name][0]]
    if len(blocks) != 1 or blocks[0] == 0 or blocks[0] == len(names) - 1:
        no_plan = (f"model.arch={config.model_type} has no pipeline plan of the form embeddings, blocks, final norm in "
                   f"transformers (base_model_pp_plan: {names or 'none'})")
        return _stack_layout(model if model is not None else _meta_model(config, no_plan), no_plan)
    at = blocks[0]
    path = [f"{prefix}.{name}" for name in names]
    return Layout(first=tuple(path[:at]), blocks=path[at], last=(*path[at + 1:], "lm_head"), embedding=path[0],
                  head="lm_head")


def _meta_model(config: Any, no_plan: str) -> nn.Module:
    """The causal LM of `config` on the meta device (no memory, no weights): its structure, for `_stack_layout`."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - one transformers cannot build: the plan's absence is the reason
        raise ValueError(f"{no_plan}, and it could not be built to look at its structure ({exc}), so it cannot be cut "
                         "into stages") from None


def _stack_layout(model: nn.Module, no_plan: str) -> Layout:
    """The layout of a model without a pipeline plan whose base model is a plain decoder stack: the input
    embedding, then the one list of blocks transformers keeps whole (`_no_split_modules`), then one module with
    parameters (the final norm), the head `lm_head` on the causal LM. Modules without parameters (rotary tables,
    dropouts) stay where they are and run on every stage, as they do under a plan. Anything else is a ValueError
    naming what was found: such a model's forward may do more between its blocks than a stage can cut."""
    prefix = getattr(model, "base_model_prefix", "") or "model"
    base = getattr(model, prefix, None)
    whole = set(getattr(model, "_no_split_modules", None) or ())
    children = list(base.named_children()) if isinstance(base, nn.Module) else []
    lists = [i for i, (_, m) in enumerate(children)
             if isinstance(m, nn.ModuleList) and len(m) and all(type(b).__name__ in whole for b in m)]
    holding = [i for i, (_, m) in enumerate(children) if next(m.parameters(), None) is not None]
    holds = [children[i][0] for i in holding]
    if len(lists) == 1:
        at = lists[0]
        before = [children[i][0] for i in holding if i < at]
        after = [children[i][0] for i in holding if i > at]
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if (len(before) == 1 and getattr(base, before[0]) is embedding and len(after) == 1
                and isinstance(getattr(model, "lm_head", None), nn.Module)):
            return Layout(first=(f"{prefix}.{before[0]}",), blocks=f"{prefix}.{children[at][0]}",
                          last=(f"{prefix}.{after[0]}", "lm_head"), embedding=f"{prefix}.{before[0]}", head="lm_head")
    found = ", ".join(holds) or "nothing"
    raise ValueError(f"{no_plan}, and it is not a plain decoder stack (embeddings, one list of its _no_split_modules "
                     f"{sorted(whole)}, a final norm, lm_head; its {prefix} holds {found}), so it cannot be cut into "
                     "stages")


def model_layout(model: nn.Module) -> Layout:
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__}: not a transformers model (no config), no pipeline layout")
    return layout_of(config, prefix=getattr(model, "base_model_prefix", "model") or "model", model=model)


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks: the unit of FSDP sharding, pipeline splitting and activation checkpointing. Where the
    model's layout says they are; for a model without a pipeline plan, the list of the modules transformers keeps
    whole (`_no_split_modules`)."""
    try:
        return model.get_submodule(model_layout(model).blocks)
    except ValueError:
        whole = set(getattr(model, "_no_split_modules", None) or ())
        for name, module in model.named_modules():
            if isinstance(module, nn.ModuleList) and len(module) and all(type(b).__name__ in whole for b in module):
                return module
        raise TypeError(f"{type(model).__name__}: no list of transformer blocks (no pipeline plan, and no list of "
                        f"its _no_split_modules {sorted(whole)})") from None


def checkpointed_blocks(num_blocks: int, every: int) -> list[int]:
    """The indices of the blocks that train.checkpoint_every=`every` checkpoints: every k-th, counted from 1."""
    return [i for i in range(num_blocks) if (i + 1) % every == 0]


def apply_activation_checkpointing(model: nn.Module, mode: str = "full", *, every: int = 1) -> None:
    """Recompute each transformer block's activations in backward instead of keeping them (every `every`-th block
    only: `checkpointed_blocks`): all of them (`full`:
    the block keeps its input), or all but what its matrix products and attention produce (`selective`, torchtitan's
    per-op policy: those are kept, the cheap ops between them, norms, activations, residuals, rotary, casts, are
    recomputed; `selective_policy`). `none` changes nothing.

    Applied before FSDP shards the blocks, as torchtitan does: after tensor parallelism and before FSDP2 by
    dist_train.parallel.apply (fsdp, hsdp, tp, fsdp_tp), as a model transform before the others wrap the model
    (DDP, DeepSpeed, a pipeline stage). Non-reentrant checkpointing: works with DDP, FSDP2 and no_sync.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from dist_train.telemetry.activations import metered_checkpoint

    mode = checkpointing_mode(mode)  # true and false stay full and none
    if mode == "none":
        return
    kwargs: dict[str, Any] = {}
    if mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_policy(saved_ops()))
    blocks = transformer_blocks(model)
    for i in checkpointed_blocks(len(blocks), every):
        block = blocks[i]
        # torch's non-reentrant checkpoint, through a function that lets the activation meter see the
        # recomputation and selective checkpointing's kept outputs (telemetry/activations.py); the wrapper keeps
        # the state dict's keys unchanged.
        blocks[i] = checkpoint_wrapper(block, checkpoint_fn=metered_checkpoint, **kwargs)


# What selective checkpointing keeps (torchtitan's `_save_list`, by name: an op this torch lacks is skipped): the
# outputs of the matrix products and of attention, the expensive ops; every other op of a block is recomputed in
# backward. Tensor parallelism's all-reduce (a row-parallel projection's output) and sequence parallelism's
# reduce-scatter are kept too, so that backward does not communicate again to recompute them.
_SAVED_OPS = (
    "aten.mm", "aten.addmm", "aten.bmm", "aten.linear",
    "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_cudnn_attention",
    "_c10d_functional.all_reduce", "_c10d_functional.reduce_scatter_tensor",
)


def saved_ops() -> frozenset[Any]:
    """The ops of _SAVED_OPS this torch has (their default overloads)."""
    found = []
    for name in _SAVED_OPS:
        namespace, op = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            found.append(packet.default)
    return frozenset(found)


def selective_policy(saved: frozenset[Any]) -> Any:
    """torch's per-op checkpoint policy: keep (MUST_SAVE) what an op of `saved` returns, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each transformer block in place (`nn.Module.compile`: the module stays itself, so a strategy
    wraps and shards it as before). Per block, as torchtitan does: every block has the same graph, compiled once
    and reused; a whole-model compile would break at every collective a strategy inserts between blocks."""
    for block in transformer_blocks(model):
        block.compile()


def count_params(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Distinct parameters (a tied weight counts once); only those that train, if asked."""
    distinct = {id(p): p for p in model.parameters()}.values()
    return sum(whole_numel(p) for p in distinct if p.requires_grad or not trainable_only)


def idle_expert_params(model: nn.Module, experts_per_token: int) -> int:
    """Parameters of the experts a token does not pass through: in each MoE layer's stacked experts, all but
    `experts_per_token` experts' worth. MFU counts a model's active parameters (the N of 6·N·tokens), as the MoE
    papers and torchtitan do: an MoE model's total would count every expert for every token."""
    from dist_train.architectures import expert_modules

    idle = 0
    for module in expert_modules(model):
        gate_up = module.gate_up_proj
        experts = (getattr(gate_up, "ds_shape", None) or gate_up.shape)[0]
        held = sum(whole_numel(p) for p in module.parameters())
        idle += held * (experts - experts_per_token) // experts
    return idle


class NEFTune:
    """NEFTune (Jain et al. 2023): noise on the token embeddings while training, as a forward hook on the
    embedding module (so it survives any wrapping, and a pipeline's first stage keeps it).

    Each sample's noise is a function of the run's seed, the step (`begin_step`, set by the loop) and the
    sample's tokens, so a sample gets the same noise whichever rank, micro-batch or pipeline stage embeds it:
    every strategy still trains the same way. In eval mode the output is untouched.

    The noise is made where the output lives, with no host synchronisation: a counter-based hash (splitmix64 in
    int64 tensor ops) of the sample's key and each element's index, its top 24 bits read as uniform in [0, 1).
    It is built `_CHUNK_ELEMENTS` at a time (at least one sample's worth): at most two int64 temporaries at
    once, 16 bytes per element of a chunk (64 MiB), besides the noise itself in the output's dtype."""

    _CHUNK_ELEMENTS = 1 << 22
    # splitmix64's constants, as the signed int64s with the same bits (all three have the top bit set)
    _GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))

    def __init__(self, *, alpha: float, seed: int) -> None:
        self.alpha, self.seed, self.step = alpha, seed, 0
        # (sequence length, device) -> the weights that hash a row's tokens; drawn on the CPU once, moved once
        self._weights: dict[tuple[int, torch.device], torch.Tensor] = {}

    def begin_step(self, step: int) -> None:
        self.step = step

    @staticmethod
    def _splitmix64_(z: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """splitmix64's finaliser (Steele et al. 2014), in place on the int64 tensor `z`, with `scratch` (same
        shape) as its only temporary. Products wrap mod 2**64 as in C; torch's `>>` on int64 is arithmetic, so
        each logical shift masks off the copied sign bits. Integer ops are exact: every device gives these bits."""
        for shift, mult in ((30, NEFTune._MIX1), (27, NEFTune._MIX2), (31, None)):
            torch.bitwise_right_shift(z, shift, out=scratch)
            z.bitwise_xor_(scratch.bitwise_and_((1 << (64 - shift)) - 1))
            if mult is not None:
                z.mul_(mult)
        return z

    def _row_keys(self, rows: torch.Tensor) -> torch.Tensor:
        """One int64 key per row of token ids, from its tokens, the seed and the step, computed on its device."""
        n, device = rows.shape[-1], rows.device
        if (n, device) not in self._weights:
            weights = torch.randint(1, 2**31 - 1, (n,), generator=torch.Generator().manual_seed(self.seed))
            self._weights[(n, device)] = weights.to(device)
        salt = (self.seed * 1_000_003 + self.step * 7_919) % (2**63 - 1)
        keys = (rows.long() * self._weights[(n, device)]).sum(-1).add_(salt)  # wraps mod 2**64, in any order
        return self._splitmix64_(keys, torch.empty_like(keys))  # rows whose sums are close get unrelated streams

    def _noise(self, rows: torch.Tensor, *, width: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """`scale` * uniform [-1, 1) noise, (rows, width) in `dtype`: element i of a row is hashed from (key, i)."""
        keys = self._row_keys(rows)
        counters = torch.arange(1, width + 1, device=rows.device, dtype=torch.long).mul_(self._GOLDEN)
        noise = torch.empty(rows.shape[0], width, device=rows.device, dtype=dtype)
        per_chunk = max(1, self._CHUNK_ELEMENTS // width)
        for start in range(0, rows.shape[0], per_chunk):
            z = keys[start:start + per_chunk, None] + counters  # splitmix64's state of each element
            bits = self._splitmix64_(z, torch.empty_like(z)).bitwise_right_shift_(40).bitwise_and_((1 << 24) - 1)
            uniform = bits.float().mul_(2.0 ** -23).sub_(1.0)  # exact: 24 bits fit a float's mantissa
            noise[start:start + per_chunk] = uniform.mul_(scale)
        return noise

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        if not module.training or self.alpha == 0:
            return output
        ids = local_tensor(args[0])  # a replicated DTensor under tensor parallelism
        seq_len, hidden = output.shape[-2], output.shape[-1]
        rows = ids.reshape(-1, seq_len).to(output.device)
        noise = self._noise(rows, width=seq_len * hidden, scale=self.alpha / math.sqrt(seq_len * hidden),
                            dtype=output.dtype)
        return output + noise.reshape(output.shape)


def apply_neftune(model: nn.Module, *, alpha: float, seed: int) -> NEFTune:
    """Register NEFTune's noise on the model's token embeddings, if this process holds them (a pipeline's later
    stages do not); returns the hook (the loop sets its step). Registered after the strategy wrapped the
    model, so it sees the embedding's output as the model computes with it (a local tensor under TP)."""
    hook = NEFTune(alpha=alpha, seed=seed)
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = None
    if isinstance(embeddings, nn.Module):
        embeddings.register_forward_hook(hook)
    return hook


def quantize_base(model: nn.Module, targets: list[str], *, quant_type: str, compute_dtype: torch.dtype,
                  source: Any = None) -> None:
    """QLoRA's base (Dettmers et al. 2023): each target projection becomes a bitsandbytes Linear4bit holding the
    same weight, packed into 4 bits. GPT-2's Conv1D stores its weight as in x out: it is transposed into the
    Linear layout.

    source: a model built on meta, quantised as it loads (the QLoRA promise: the fp32 model is never held): each
    projection's weight is read from this WeightSource (the files, or the seeded init) one unit at a time,
    packed at once, and its fp32 copy dropped. Without it, the model's own weights are packed when the strategy
    moves the model to its device."""
    import bitsandbytes as bnb
    from transformers.pytorch_utils import Conv1D

    chosen = {name: module for name, module in model.named_modules()
              if name.rsplit(".", 1)[-1] in targets and isinstance(module, (nn.Linear, Conv1D))
              and not isinstance(module, bnb.nn.Linear4bit)}
    tensors = {f"{name}.{kind}": module for name, module in chosen.items() for kind in ("weight", "bias")
               if getattr(module, kind, None) is not None}
    if source is None:
        loaded: Any = ((n, n, m) for n, m in tensors.items())
    else:
        from dist_train.weights import source_names

        loaded = source.by_unit(source_names(model, source, tensors))
    values: dict[str, torch.Tensor] = {}
    for name, held, module in loaded:
        values[name] = getattr(module, name.rsplit(".", 1)[1]).detach() if source is None else source.read(held)
        owner = name.rsplit(".", 1)[0]
        if not all(n in values for n in (f"{owner}.weight", f"{owner}.bias") if n in tensors):
            continue  # the layer's other tensor comes later (the next one, or from another file)
        module = chosen[owner]
        weight, bias = values.pop(f"{owner}.weight"), values.pop(f"{owner}.bias", None)
        if isinstance(module, Conv1D):
            weight = weight.t().contiguous()
        out_features, in_features = weight.shape
        layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias is not None, compute_dtype=compute_dtype,
                                  quant_type=quant_type, device="meta" if source is not None else "cpu")
        packed = bnb.nn.Params4bit(weight, requires_grad=False, quant_type=quant_type)
        layer.weight = packed.to("cpu") if source is not None else packed
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        model.set_submodule(owner, layer)


def qlora_base(peft: Any, compute_dtype: torch.dtype) -> Callable[[nn.Module, Any], None]:
    """build_model's `quantize` for peft=qlora: the target projections of a model on meta, quantised from the
    weight source as they are read."""

    def quantize(model: nn.Module, source: Any) -> None:
        targets = list(peft.target_modules or default_lora_targets(model))
        quantize_base(model, targets, quant_type=peft.quant_type, compute_dtype=compute_dtype, source=source)

    return quantize


def default_lora_targets(model: nn.Module) -> list[str]:
    """The names of every projection of the model's transformer blocks (its nn.Linear layers, and GPT-2's Conv1D),
    as the model itself is built: Llama's q/k/v/o and gate/up/down, Phi-3's fused qkv_proj and gate_up_proj,
    GPT-2's c_attn, c_proj and c_fc. Read from the first block; no architecture is named. A model whose blocks have
    none needs peft.target_modules."""
    from transformers.pytorch_utils import Conv1D

    names: list[str] = []
    for name, module in transformer_blocks(model)[0].named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, (nn.Linear, Conv1D)) and leaf not in names:
            names.append(leaf)
    if not names:
        raise ValueError(f"{type(model).__name__}'s transformer blocks have no linear projection for LoRA to adapt: "
                         "set peft.target_modules=[...]")
    return names


def apply_lora(model: nn.Module, peft: Any, *, seed: int, compute_dtype: torch.dtype = torch.float32) -> None:
    """LoRA adapters (Hu et al. 2021, through peft) on the target projections, in place; everything else frozen.

    `inject_adapter_in_model` keeps the transformers model itself (no PeftModel around it), so every strategy
    wraps, splits and checkpoints it as it does without adapters. The adapters' random init is seeded: every
    rank and every strategy starts from the same A (B starts at zero: the model is unchanged at step 0)."""
    from peft import LoraConfig, inject_adapter_in_model

    from transformers.pytorch_utils import Conv1D

    targets = list(peft.target_modules or default_lora_targets(model))
    conv1d = any(isinstance(m, Conv1D) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in targets)
    if peft.name == "qlora":
        quantize_base(model, targets, quant_type=peft.quant_type, compute_dtype=compute_dtype)
    config = LoraConfig(
        r=peft.rank, lora_alpha=peft.alpha, lora_dropout=peft.dropout, target_modules=targets,
        # transformers' Conv1D (GPT-2's) stores its weight as in x out (QLoRA's Linear4bit layers do not)
        fan_in_fan_out=conv1d and peft.name == "lora",
    )
    torch.manual_seed(seed)
    inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; `labels` are already shifted by the data pipeline.

    Under tensor parallelism the logits are a DTensor split by vocabulary and the loss (computed under torch's
    `loss_parallel`) a replicated one: every rank holds the same value, returned as a plain tensor."""
    return local_tensor(F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1)))


def forward_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(model(input_ids=input_ids).logits, labels)
