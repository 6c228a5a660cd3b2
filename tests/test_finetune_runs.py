"""The fine-tuning lab's pieces: its corpus and samples, the runs side by side and their frozen-weight
check, the calculator against one measured step, gradient accumulation in the one loop, and the
question first (API, LoRA/QLoRA, full) answered with the calculator's numbers."""
import logging

import pytest
import torch

from labkit.core.data import load_corpus, train_val_split
from labkit.core.model import GPTConfig, build_model
from labkit.core.text import SOURCE_DIR, generate, source_corpus
from labkit.memory.finetune_runs import calculator_check, frozen_snapshot, frozen_unchanged, run_methods
from labkit.memory.finetune_probe import prepare
from labkit.planning.finetune_choice import Assumptions, three_ways
from labkit.train.batch_sweeps import accumulation_sweep, best_lr

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
CFG = GPTConfig()


def test_source_corpus_is_torchs_nn_modules_and_samples_are_seeded(tmp_path):
    code = source_corpus()
    text = bytes(code.tolist()).decode()
    assert code.dtype == torch.uint8 and "class Linear(Module):" in text and "import torch" in text
    assert len(code) > 100_000 and SOURCE_DIR.parts[-2:] == ("nn", "modules")
    with pytest.raises(ValueError, match="holds no file matching"):
        source_corpus(tmp_path)
    model = build_model(CFG, seed=0)
    a, b = generate(model, "def f(", 30, seed=1), generate(model, "def f(", 30, seed=1)
    assert a == b and a.startswith("def f(") and generate(model, "def f(", 30, seed=2) != a
    with pytest.raises(ValueError, match="prompt must not be empty"):
        generate(model, "", 5)


def test_runs_side_by_side_keep_the_base_and_detect_a_change():
    data = train_val_split(load_corpus())
    base = build_model(CFG, seed=0)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    rows, models = run_methods(base, data.train, data.val, [("full", 0), ("lora", 4), ("qlora", 4)], steps=3,
                               batch_size=4, eval_batches=1)
    assert [r["run"] for r in rows] == ["full", "lora r=4", "qlora r=4"] and set(models) == {r["run"] for r in rows}
    assert all(r["frozen_unchanged"] for r in rows)
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in before.items())  # copies were trained
    assert rows[1]["trainable_params"] == 16 * 4 * CFG.n_embd * CFG.n_layer and rows[0]["frozen"] == 0
    lora = prepare(base, "lora", r=4)
    snap = frozen_snapshot(lora)
    with torch.no_grad():
        lora.blocks[0].attn.qkv.base.weight[0, 0] += 1e-3
    assert not frozen_unchanged(lora, snap)


def test_calculator_matches_one_measured_step_kind_by_kind():
    base = build_model(CFG, seed=0)
    for c in calculator_check(base, load_corpus(), rank=8, micro_batch=4):
        m, e = c["measured"], c["calculator"]
        assert m["trainable"] == e["trainable"] and m["gradients"] == e["gradients"], c["method"]
        assert m["optimizer"] - e["optimizer"] == 4 * c["n_trainable_tensors"]  # AdamW's step counters
        frozen = m["frozen"] - c["nf4_tables"]  # the lookup tables the per-weight 4.127 bits leave out
        assert abs(frozen - e["frozen"]) <= 8 * CFG.n_layer * 4, (c["method"], frozen, e["frozen"])
        if c["method"] == "full":  # fp32, no dropout in the lab GPT: the calculator's masks, LN statistics
            assert abs(c["rel_diff"]["activations"]) < 0.05


def test_accumulation_in_the_one_loop_matches_the_unaccumulated_run():
    rows = accumulation_sweep(CFG, global_batch=8, accums=[1, 4], steps=3)
    assert [r["micro_batch"] for r in rows] == [8, 2] and rows[1]["max_loss_diff"] <= 1e-5
    assert rows[1]["activation_bytes"] == pytest.approx(rows[0]["activation_bytes"] / 4, rel=0.01)
    model = build_model(CFG)  # fp32 AdamW: 4 + 4 + 8 bytes a parameter, and a step counter per tensor
    assert rows[0]["state_bytes"] == rows[1]["state_bytes"] == 16 * model.num_params() + 4 * len(list(model.parameters()))
    with pytest.raises(ValueError, match="accum=3 must divide global_batch=8"):
        accumulation_sweep(CFG, 8, [3], 1)
    assert best_lr([{"batch": 2, "lr": lr, "val_loss": v} for lr, v in ((1e-3, 3.0), (2e-3, 2.0), (4e-3, 3.0))]) \
        == {2: pytest.approx(2e-3)}


def test_three_ways_answer_the_seed_scenario_with_the_calculator():
    rows = {r["option"].split(" ")[0]: r for r in three_ways("llama2-70b", "a100-80gb", 8, 16)}
    assert rows["QLoRA"]["fits"] and rows["QLoRA"]["gpus"] == 1 and 40 < rows["QLoRA"]["gb_per_gpu"] < 72
    assert rows["LoRA"]["layout"].startswith("ZeRO-3") and rows["LoRA"]["trained_params"] == 207_093_760
    assert "offload" in rows["full"]["layout"] and rows["full"]["host_gb_per_gpu"] > 100
    assert rows["full"]["checkpoint_gb"] == pytest.approx(14 * 68_976_648_192 / 1e9)  # 2 + 4 + 4 + 4
    assert rows["LoRA"]["states_gb"] == pytest.approx(16 * 207_093_760 / 1e9)
    assert rows["LoRA"]["result_gb"] == pytest.approx(2 * 207_093_760 / 1e9)  # the adapters, in 16 bits
    a = Assumptions()
    assert rows["pretraining"]["gpu_hours"] == pytest.approx(rows["full"]["gpu_hours"] * a.pretrain_tokens / a.tokens)
    assert rows["QLoRA"]["model_flops"] == pytest.approx(4 * 68_976_648_192 * a.tokens)  # no weight gradients
    assert rows["hosted"]["compute_usd"] == a.tokens / 1e6 * a.api_usd_per_m_tokens and rows["hosted"]["gpus"] == 0
    assert rows["QLoRA"]["network_gb_per_step"] == 0 < rows["LoRA"]["network_gb_per_step"] < \
        rows["full"]["network_gb_per_step"]
