"""Your own model (`model=hf model.path=DIR`) in this process: a local transformers directory the tests make with
save_pretrained (tests/own_model_support.py), checked, loaded as transformers loads it, quantised as it is read,
refused where a strategy cannot split it; nothing is downloaded. Trained under the strategies:
tests/launched/test_own_model.py."""

from __future__ import annotations

from types import SimpleNamespace

import json

import pytest
import torch

from dist_train.config import ConfigError, ModelConfig
from dist_train.pretrained import ModelDir, resolve_model
from dist_train.rundir import register_resolvers
from dist_train.strategies.registry import register_configs
from tests.own_model_support import ARCHS, batch_of_step_one, make_model_dir, reference_loss

register_configs()
register_resolvers()


# ---------------------------------------------------------------------------------------------- the directory


def test_a_directory_fills_the_model_group_from_its_config(tmp_path):
    d = make_model_dir(tmp_path, "qwen2")
    m = ModelConfig(name="hf", path=str(d))
    resolve_model(m)
    assert (m.arch, m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size, m.vocab_size) == \
        ("qwen2", 2, 64, 4, 2, 128, 256)
    assert m.init == "pretrained" and m.name == d.name


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("meta-llama/Llama-3.2-1B", "looks like a hub name, and dist_train downloads nothing"),
        ("/nonexistent/model", "is not a local directory"),
    ],
)
def test_what_is_not_a_local_model_directory_is_one_line(path, needle):
    from dist_train.paths import normalize_paths

    for made_absolute in (False, True):  # as typed, and as the entry points hand it on (normalize_paths)
        model = ModelConfig(name="hf", path=path)
        if made_absolute:
            normalize_paths(SimpleNamespace(model=model))
            assert model.path.startswith("/")
        with pytest.raises(ConfigError) as err:
            resolve_model(model)
        assert needle in str(err.value) and "\n" not in str(err.value)
    if "hub" in needle:
        assert f"huggingface-cli download {path} --local-dir DIR" in str(err.value)


def test_a_directory_without_config_or_weights_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json: not a transformers model directory"):
        resolve_model(ModelConfig(name="hf", path=str(tmp_path)))
    d = make_model_dir(tmp_path, "llama")
    for f in d.glob("*.safetensors"):
        f.unlink()
    m = ModelConfig(name="hf", path=str(d))
    resolve_model(m)
    assert m.init == "random"  # config only: random weights by default
    with pytest.raises(ConfigError, match="model.init=pretrained but .* holds no weights"):
        resolve_model(ModelConfig(name="hf", path=str(d), init="pretrained"))
    adapter = tmp_path / "adapter"  # what launch/export.py writes for a LoRA run without --merge
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base"}))
    with pytest.raises(ConfigError, match=r"holds a LoRA adapter \(peft's format, over /models/base\), not a model: "
                                          r"export the run with .* --merge"):
        resolve_model(ModelConfig(name="hf", path=str(adapter)))


def test_custom_modelling_code_runs_only_when_trusted(tmp_path):
    d = make_model_dir(tmp_path, "llama")
    raw = json.loads((d / "config.json").read_text())
    raw["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="modelling code shipped with the directory .* model.trust_remote_code=true"):
        resolve_model(ModelConfig(name="hf", path=str(d)))


class _NotATensor:  # what a malicious pickle would carry: anything but tensors
    pass


def test_a_bin_file_that_holds_more_than_tensors_is_refused_never_unpickled(tmp_path):
    d = make_model_dir(tmp_path, "llama", weights="bin")
    assert ModelDir.open(str(d)).weight_files()[0].suffix == ".bin"
    resolve_model(ModelConfig(name="hf", path=str(d)))  # tensors only: accepted
    torch.save({"model.embed_tokens.weight": torch.zeros(1), "x": _NotATensor()}, d / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="refused, it does not load with torch.load.weights_only=True"):
        resolve_model(ModelConfig(name="hf", path=str(d)))


# ---------------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_loaded_model_gives_transformers_first_loss(arch, tmp_path):
    """build_model reads the directory as from_pretrained does, for each architecture."""
    from dist_train.model import build_model, forward_loss

    d = make_model_dir(tmp_path, arch, tie=arch == "gpt2")
    m = ModelConfig(name="hf", path=str(d))
    resolve_model(m)
    model = build_model(m, seed=1234)
    ids, labels = batch_of_step_one(d, global_batch=4)
    with torch.no_grad():
        loss = float(forward_loss(model.eval(), ids, labels))
    assert loss == pytest.approx(reference_loss(d, global_batch=4), rel=1e-5)


def test_strategies_that_cannot_split_an_architecture_say_so_before_starting(tmp_path):
    """OPT has neither a pipeline nor a tensor-parallel plan in transformers: one line each, before any process
    group; fsdp takes it."""
    from hydra import compose, initialize_config_dir
    from transformers import AutoConfig

    from dist_train.checks import validate
    from dist_train.train import to_run_config
    from tests.helpers import ROOT

    d = tmp_path / "opt"
    AutoConfig.for_model("opt", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         ffn_dim=128, max_position_embeddings=128).save_pretrained(d)

    def check(strategy: str) -> None:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[f"strategy={strategy}", "model=hf", f"model.path={d}"])
        validate(to_run_config(cfg), 2)

    for strategy, needle in (("gpipe", "strategy=gpipe: model.arch=opt has no pipeline plan"),
                             ("tp", "strategy=tp: model.arch=opt has no tensor-parallel plan")):
        with pytest.raises(ConfigError, match=needle):
            check(strategy)
    check("fsdp")


def test_prepare_tokens_uses_the_model_directorys_tokenizer(tmp_path):
    import subprocess
    import sys

    from transformers import AutoConfig, AutoModelForCausalLM

    from dist_train.checks import validate
    from tests.helpers import ROOT, env, run_config
    from tests.unit.test_data import TEXT, _local_tokenizer

    d = tmp_path / "model"
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=320, **ARCHS["llama"])).save_pretrained(d)
    _local_tokenizer(d)  # its tokenizer beside its weights, as a hub download has it
    text, out = tmp_path / "t.txt", tmp_path / "t.bin"
    text.write_text(TEXT)
    proc = subprocess.run([sys.executable, "launch/prepare_tokens.py", str(text), str(out), f"--model={d}"], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.with_suffix(".json").read_text())["tokenizer"] == str(d)
    assert f"train with: data=tokens data.path={out} model=hf model.path={d}" in proc.stdout
    _, run = run_config("model=hf", f"model.path={d}", "data=tokens", f"data.path={out}", "train.seq_len=16")
    validate(run, 1)  # the directory's vocabulary holds the tokenizer's


def test_prepare_tokens_refuses_a_model_directory_without_a_tokenizer(tmp_path):
    """launch/export.py's output (save_pretrained of the model alone) has no tokenizer: one line naming the fix, not
    byte ids, which a pretrained model would take without a word; bytes only when asked for."""
    import subprocess
    import sys

    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers import ROOT, env

    d = tmp_path / "exported"
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=320, **ARCHS["llama"])).save_pretrained(d)
    text, out = tmp_path / "t.txt", tmp_path / "t.bin"
    text.write_text("some text")

    def prepare(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "launch/prepare_tokens.py", str(text), str(out), f"--model={d}", *extra],
                              cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)

    refused = prepare()
    assert refused.returncode == 2 and not out.exists(), refused.stderr
    assert refused.stderr.splitlines() == [
        f"config error: --model={d}: no tokenizer there (tokenizer.json or tokenizer_config.json); copy the tokenizer "
        "files of the model it came from into it, or pass --tokenizer=DIR with them (--tokenizer=byte only for a "
        "model that learned bytes)"]
    asked = prepare("--tokenizer=byte")
    assert asked.returncode == 0, asked.stderr
    assert json.loads(out.with_suffix(".json").read_text())["tokenizer"] == "byte"


def test_the_setup_peak_is_this_processs_own_not_its_launchers():
    """Linux's ru_maxrss survives exec, so a rank would report the RSS of a launcher that held a model; VmHWM not."""
    import subprocess
    import sys

    hold = torch.ones(2**30 // 4)  # 1 GiB resident in this process, the "launcher"
    hold.add_(1)
    code = "from dist_train.telemetry.memory import HostPeak; print(HostPeak().peak_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert child < 600 * 2**20 < float(hold.sum()) * 4  # the child's imports only (about 250 MiB with torch)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_qlora_quantises_each_projection_as_it_loads(arch, tmp_path):
    """peft=qlora builds on meta and packs each projection as it is read from the files (the fp32 model is never
    held): the same 4-bit bytes and scales as quantising the loaded model, every other tensor the file's, and the
    first loss the same. GPT-2's Conv1D is transposed into the Linear layout either way; a layer's weight and bias
    may sit in two files (the sharded llama)."""
    import bitsandbytes as bnb

    from dist_train.config import PeftConfig
    from dist_train.model import build_model, default_lora_targets, forward_loss, qlora_base, quantize_base

    d = make_model_dir(tmp_path, arch, shard=arch == "llama", tie=arch == "gpt2")
    m = ModelConfig(name="hf", path=str(d))
    resolve_model(m)
    peft = PeftConfig(name="qlora")
    loaded = build_model(m, seed=0, quantize=qlora_base(peft, torch.float32))
    whole = build_model(m, seed=0)
    quantize_base(whole, default_lora_targets(whole), quant_type="nf4", compute_dtype=torch.float32)
    whole.to("cpu")  # packs the 4-bit layers
    packed = [n for n, mod in loaded.named_modules() if isinstance(mod, bnb.nn.Linear4bit)]
    assert len(packed) == len([n for n, mod in whole.named_modules() if isinstance(mod, bnb.nn.Linear4bit)]) > 0
    for name, t in whole.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    ids, labels = batch_of_step_one(d, global_batch=4)
    with torch.no_grad():
        assert float(forward_loss(loaded.eval(), ids, labels)) == float(forward_loss(whole.eval(), ids, labels))


def test_an_architecture_with_its_own_head_width_needs_no_divisible_hidden_size(tmp_path):
    """Qwen3 and Gemma set head_dim apart from hidden_size / num_heads: 96 over 5 heads of 32 is a valid model."""
    from hydra import compose, initialize_config_dir
    from transformers import AutoConfig

    from dist_train.checks import validate
    from dist_train.train import to_run_config
    from tests.helpers import ROOT

    d = tmp_path / "qwen3"
    AutoConfig.for_model("qwen3", vocab_size=256, hidden_size=96, num_attention_heads=5, num_key_value_heads=5,
                         head_dim=32, intermediate_size=64, num_hidden_layers=1).save_pretrained(d)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=hf", f"model.path={d}"])
    validate(to_run_config(cfg), 1)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model.hidden_size=96", "model.num_heads=5"])
    with pytest.raises(ConfigError, match="must be divisible by model.num_heads=5"):
        validate(to_run_config(cfg), 1)
