"""The calculator on any model and device, and on fine-tuning: parameter counts against the published
totals, LoRA/QLoRA bytes by kind against the papers, the ZeRO formula against DeepSpeed's estimators,
and the command line. Arithmetic only: no torch.distributed, no GPU."""
import contextlib
import io
import json
from pathlib import Path

import pytest

from labkit.memory import GB, MODELS, estimate_memory, model_shape
from labkit.memory.architecture import ModelShape, linear_layers
from labkit.memory.finetune import (NF4_BITS, estimate_finetune, frozen_weight_bytes, linear_weight_params,
                                    lora_params, lora_targets)
from labkit.memory.zero_crosscheck import GIB, cross_check_zero, deepspeed_gpu_bytes, deepspeed_host_bytes
from labkit.planning.memory_cli import main as memory_main

CONFIGS = Path(__file__).parent / "data" / "hf_configs"

# Each fixture is the model's published config.json (the Hugging Face Hub repository named), as published.
# name: (the exact count from the shape, the published total in billions, decimals it is published to
# (None: published exactly), the source of the published total)
PUBLISHED = {
    # meta-llama/Llama-2-7b-hf (Touvron et al. 2023, "7B"); the Hub's safetensors total
    "llama-2-7b": (6_738_415_616, 6.738415616, None, "Hub safetensors metadata of meta-llama/Llama-2-7b-hf"),
    # meta-llama/Llama-2-70b-hf: GQA with 8 KV heads (k_proj, v_proj are 8192 x 1024)
    "llama-2-70b": (68_976_648_192, 68.976648192, None, "Hub safetensors metadata of meta-llama/Llama-2-70b-hf"),
    # mistralai/Mistral-7B-v0.1: the Hub's "7.24B"; GGUF conversions record general.parameter_count 7241732096
    "mistral-7b-v0.1": (7_241_732_096, 7.241732096, None, "GGUF general.parameter_count of Mistral-7B-v0.1"),
    # mistralai/Mixtral-8x7B-v0.1: "46.7B total parameters but only uses 12.9B parameters per token"
    # (Mistral AI, "Mixtral of experts", December 2023)
    "mixtral-8x7b-v0.1": (46_702_792_704, 46.7, 1, "Mistral AI, Mixtral of experts (2023): 46.7B"),
    # Qwen/Qwen2-7B; the Qwen2.5-7B model card, whose shape is the same (28 layers, 28/4 heads, 3584,
    # 18944, vocab 152064, untied): "Number of Parameters: 7.61B; Number of Paramaters (Non-Embedding):
    # 6.53B" (7.6156B, truncated)
    "qwen2-7b": (7_615_616_512, 7.61, 2, "Qwen2.5-7B model card: 7.61B"),
    # openai-community/gpt2: "124M" (Radford et al. 2019); 124,439,808 with the output layer tied
    "gpt2": (124_439_808, 0.124439808, None, "GPT2LMHeadModel of openai-community/gpt2"),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_config_json_parameter_counts_are_exact(name):
    exact, published, decimals, source = PUBLISHED[name]
    shape = model_shape(str(CONFIGS / f"{name}.json"))
    assert shape.n_params == exact, source
    if decimals is None:
        assert exact == round(published * 1e9), source
    else:  # published rounded (Mixtral) or truncated (Qwen) to `decimals` places of billions
        assert abs(exact / 1e9 - published) < 10 ** -decimals, source


def test_gqa_moe_and_biases_in_the_counts():
    mixtral = model_shape(str(CONFIGS / "mixtral-8x7b-v0.1.json"))
    assert (mixtral.experts, mixtral.experts_per_token) == (8, 2)
    assert mixtral.active_params == 12_879_925_248 and round(mixtral.active_params / 1e9, 1) == 12.9  # "12.9B"
    big = model_shape(str(CONFIGS / "llama-2-70b.json"))
    assert linear_layers(big)["k"] == (8192, 1024, 1) and linear_layers(big)["q"] == (8192, 8192, 1)
    qwen = model_shape(str(CONFIGS / "qwen2-7b.json"))
    embeddings = 2 * qwen.vocab * qwen.hidden
    assert round((qwen.n_params - embeddings) / 1e9, 2) == 6.53  # the model card's non-embedding count
    assert model_shape(str(CONFIGS / "gpt2.json")).n_params == MODELS["gpt2-124m"].n_params
    assert model_shape(str(CONFIGS / "llama-2-70b.json")).n_params == MODELS["llama2-70b"].n_params
    assert MODELS["llama-65b"].n_params == 65_285_660_672  # LLaMA 65B (Touvron et al. 2023a: "65.2B")


def test_lora_parameter_counts_against_hu_and_qlora():
    # Hu et al. 2021, Table 4: GPT-3 175B with LoRA on Wq and Wv: 4.7M (r=1) and 37.7M (r=8) parameters
    gpt3 = ModelShape.from_dims("llama", 12288, 96, 96, 50257, intermediate=4 * 12288)
    assert lora_params(gpt3, 1, "q,v") == 4_718_592 and lora_params(gpt3, 8, ["q_proj", "v_proj"]) == 37_748_736
    # QLoRA's qlora.py on LLaMA-7B, r=64 on every linear layer, prints "trainable params: 79953920.0 || all
    # params: 3660320768": it halves the trainable count for 4-bit, and bitsandbytes packs two 4-bit
    # weights per stored element, so "all params" counts each quantised weight as one half.
    llama7 = MODELS["llama2-7b"]  # LLaMA-7B's shape
    lora = lora_params(llama7, 64, "all")
    assert lora / 2 == 79_953_920
    assert llama7.n_params - linear_weight_params(llama7) // 2 + lora == 3_660_320_768


def test_lora_targets_and_their_errors():
    assert lora_targets("llama2-7b", "all") == ("q", "k", "v", "o", "gate", "up", "down")
    assert lora_targets("llama2-7b", "mlp,q_proj") == ("q", "gate", "up", "down")
    assert lora_targets("gpt2-124m", "q,v") == ("qkv",)  # GPT-2's fused c_attn
    with pytest.raises(ValueError, match="lora target 'w9' is unknown for a llama-family model"):
        lora_targets("llama2-7b", "q,w9")
    with pytest.raises(ValueError, match="lora_rank=2048 exceeds the smaller side of k"):
        lora_params("llama2-70b", 2048, "k")


def test_qlora_frozen_bytes_follow_nf4_with_double_quantisation():
    assert float(NF4_BITS) == pytest.approx(4.127, abs=5e-4)  # Dettmers et al. 2023: 4 + 0.127 bits
    shape = MODELS["llama-65b"]
    linear = linear_weight_params(shape)
    assert frozen_weight_bytes(shape, "qlora") == pytest.approx(linear * 4.126953125 / 8 + 2 * (shape.n_params - linear), abs=1)
    assert frozen_weight_bytes(shape, "lora") == 2 * shape.n_params and frozen_weight_bytes(shape, "full") == 0


def test_qlora_65b_fits_on_one_48gb_gpu():
    """QLoRA's headline (Dettmers et al. 2023): a 65B model fine-tuned on one 48 GB GPU. Assumptions, as
    the paper's Guanaco-65B recipe (qlora.py, scripts/finetune_guanaco_65b.sh): LoRA r=64 on every
    linear layer with dropout, bf16 adapters with paged 32-bit AdamW (fp32 moments, no master copy),
    gradient checkpointing; micro-batch 1 of 512 tokens (the paper's Figure 6 setting). The paged
    optimizer is not needed for this to fit: optimizer states stay on the device."""
    e = estimate_finetune("llama-65b", "qlora", 64, "all", micro_batch=1, seq_len=512, recompute="full",
                          device_memory_gb=48, lora_dropout=True)
    assert e.fits and 44 * GB < e.total < 46 * GB
    assert e.trainable_params == 799_539_200 and e.optimizer == 8 * e.trainable_params
    assert 34 * GB < e.frozen_weights < 35 * GB  # vs 130.6 GB for the bf16 base
    # The script's own micro-batch, 4 sequences of up to 16 + 512 tokens, needs a little more than
    # 48 x 10^9 bytes, and fits the 48 GiB (49,140 MiB) such a card really has.
    worst = estimate_finetune("llama-65b", "qlora", 64, "all", micro_batch=4, seq_len=528, recompute="full",
                              device_memory_gb=48, lora_dropout=True)
    assert not worst.fits and worst.total < 48 * GIB
    for mode in ("full", "lora"):
        assert not estimate_finetune("llama-65b", mode, 64, micro_batch=1, seq_len=512, recompute="full",
                                     device_memory_gb=48).fits


def test_finetune_kinds_shard_by_stage_and_full_equals_pretraining():
    e = [estimate_finetune("llama2-70b", "qlora", 16, world_size=8, stage=s, recompute="full") for s in range(4)]
    assert e[0].frozen_weights == e[2].frozen_weights == pytest.approx(8 * e[3].frozen_weights, abs=8)
    assert e[1].optimizer == pytest.approx(e[0].optimizer / 8, abs=1) and e[1].grads == e[0].grads
    assert e[2].grads == pytest.approx(e[0].grads / 8, abs=1) and e[2].trained_weights == e[0].trained_weights
    full = estimate_finetune("llama2-70b", "full", world_size=8, stage=3)
    pre = estimate_memory("llama2-70b", world_size=8, stage=3)
    assert full.total == pre.total and full.frozen_weights == 0
    lora = estimate_finetune("llama2-70b", "lora", 16, world_size=8, stage=3)
    assert lora.activations > pre.activations + pre.head  # backward still runs through every frozen layer
    # LoRA drops the trained states; the activations of a SwiGLU block (40.5 sbh a layer), which it
    # keeps, are then most of what is left
    assert lora.total < 0.6 * full.total and lora.activations > lora.total / 2
    assert lora.to_dict()["fits"] is False


def test_zero_formula_against_deepspeed_numbers_in_the_issue():
    c = cross_check_zero(7.5e9, 8, 2)
    assert round(c.paper_gib, 1) == 26.2 and round(c.deepspeed_gib, 2) == 29.69
    assert round(c.paper_gb, 1) == 28.1 and round(c.deepspeed_gb, 1) == 31.9  # GiB labelled "GB" in DeepSpeed
    assert c.paper_bytes + sum(c.terms.values()) == c.deepspeed_bytes  # the fp32 gradients, 4 Psi / N
    three = cross_check_zero(7.5e9, 8, 3, largest_layer_params=218_718_464)
    assert abs(three.paper_bytes + sum(three.terms.values()) - three.deepspeed_bytes) <= 1
    assert round(three.deepspeed_gib, 2) == 16.53 and "largest layer" in "\n".join(three.explanation())


def test_zero_crosscheck_reproduces_deepspeeds_own_estimators(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    s12 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    s3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    for psi, gpus, layer in ((7.5e9, 8, 218_718_464), (1_000_003, 3, 12_345), (175e9, 64, 617_558_016)):
        cpu, gpu = s12.estimate_zero2_model_states_mem_needs(psi, gpus, 1, cpu_offload=False)
        assert (gpu, cpu) == (deepspeed_gpu_bytes(psi, gpus, 2), deepspeed_host_bytes(psi, gpus, 2))
        cpu, gpu, _ = s3.estimate_zero3_model_states_mem_needs(psi, layer, gpus, 1, cpu_offload=False,
                                                               cpu_offload_params=False, zero_init=True)
        assert (gpu, cpu) == (deepspeed_gpu_bytes(psi, gpus, 3, layer), deepspeed_host_bytes(psi, gpus, 3, layer))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        s12.estimate_zero2_model_states_mem_needs_all_cold(7.5e9, num_gpus_per_node=8)
    assert "29.69GB | offload_optimizer=none" in out.getvalue()


def _run(capsys, *argv) -> str:
    assert memory_main(list(argv)) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("mode", ["full", "lora", "qlora"])
def test_cli_prints_finetune_bytes_per_device_and_fit(capsys, mode):
    out = _run(capsys, "--model", "llama2-70b", "--finetune", mode, "--lora-rank", "16", "--devices", "8",
               "--device-type", "a100-80gb")
    assert "68.98 B parameters" in out and "frozen" in out and "recommended:" in out
    assert out.count(" no\n") + out.count(" yes\n") == 4
    if mode == "qlora":
        assert "207.1 M trained parameters" in out and "recommended: DDP + full recompute" in out


def test_cli_json_matches_the_human_numbers(capsys):
    argv = ["--model", "llama-65b", "--finetune", "qlora", "--lora-rank", "64", "--devices", "1", "--device-gb",
            "48", "--seq-len", "512", "--recompute", "full"]
    r = json.loads(_run(capsys, *argv, "--json"))
    assert r["fits"] is True and r["device"]["memory_gb"] == 48 and r["lora"]["trainable_params"] == 799_539_200
    assert set(r["bytes_per_device"]) == {"frozen_weights", "trained_weights", "grads", "optimizer", "activations"}
    assert r["total_bytes_per_device"] == r["stages"][0]["total"] and r["recommendation"]["strategy"]
    assert f"{r['stages'][0]['total'] / GB:9.1f}  yes" in _run(capsys, *argv)
    pre = json.loads(_run(capsys, "--model", "llama2-70b", "--json"))
    assert pre["finetune"] is None and pre["fits"] is True and pre["bytes_per_device"]["frozen_weights"] == 0
    assert pre["recommendation"]["rule_of_thumb"] == "FSDP"


def test_cli_takes_a_config_path_shape_flags_and_any_device(capsys):
    out = _run(capsys, "--model", str(CONFIGS / "mixtral-8x7b-v0.1.json"), "--devices", "8", "--device-type", "h200")
    assert "46.70 B parameters (12.88 B active)" in out and "NVIDIA H200" in out
    shape = json.loads(_run(capsys, "--hidden", "4096", "--layers", "32", "--heads", "32", "--kv-heads", "8",
                            "--intermediate", "14336", "--experts", "8", "--json"))
    assert (shape["n_params"], shape["n_active_params"]) == (46_702_792_704, 12_879_925_248)
    gpt2 = json.loads(_run(capsys, "--family", "gpt", "--hidden", "768", "--layers", "12", "--heads", "12",
                           "--vocab", "50257", "--seq-len", "1024", "--json"))
    assert gpt2["n_params"] == 124_439_808
    assert "1 x custom device (24 GB)" in _run(capsys, "--model", "llama2-7b", "--devices", "1", "--device-gb", "24")
    for key in ("a100-40gb", "a100-80gb", "h100-80gb", "h200", "l4", "l40s", "mi300x"):
        assert "recommended:" in _run(capsys, "--devices", "8", "--device-type", key)


@pytest.mark.parametrize("argv", [
    ["--model", "/no/such/config.json"], ["--model", str(CONFIGS)], ["--model", "gpt9"],
    ["--hidden", "0", "--layers", "2", "--heads", "2"], ["--hidden", "64", "--layers", "-1", "--heads", "2"],
    ["--hidden", "64", "--layers", "2", "--heads", "x"], ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "3"],
    ["--hidden", "64", "--layers", "2", "--heads", "4", "--intermediate", "0"],
    ["--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "0"],
    ["--hidden", "64", "--layers", "2", "--heads", "4", "--experts", "2", "--experts-per-token", "3"],
    ["--hidden", "64", "--layers", "2", "--heads", "4", "--experts", "0"],
    ["--hidden", "64", "--layers", "2"], ["--model", "llama2-7b", "--hidden", "64"], ["--family", "bert"],
    ["--tied-embeddings=1"], ["--device-gb", "0"], ["--device-gb", "nan"], ["--device-gb", "lots"], ["--json=1"],
    ["--finetune", "adapter"], ["--finetune", "lora", "--lora-rank", "0"], ["--finetune", "lora", "--lora-rank", "9999"],
    ["--finetune", "lora", "--lora-targets", "nosuch"], ["--finetune", "qlora", "--lora-dropout=1"],
    ["--lora-rank", "8"], ["--finetune", "qlora", "--precision", "fp32"], ["--precision", "bf16_adam32"],
])
def test_new_memory_cli_flags_with_bad_values_are_one_line_and_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as e:
        memory_main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert e.value.code == 2 and captured.out == "", (argv, err)
    assert len(err.splitlines()) == 1 and ": error: " in err and "Traceback" not in err, (argv, err)


def test_a_bad_config_json_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 768}))
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "partial.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    for path, match in ((tmp_path, "model_type='bert' is unknown"), (tmp_path / "broken.json", "not a readable JSON"),
                        (tmp_path / "partial.json", "lacks 'num_attention_heads'")):
        with pytest.raises(SystemExit):
            memory_main(["--model", str(path)])
        assert match in capsys.readouterr().err
