"""The question before any sharding: call an API, adapt with LoRA/QLoRA, or train every weight?

:func:`three_ways` answers one scenario (a model, a device type and a device count) each way with the
calculator's numbers (:func:`labkit.planning.memory_report.choose_finetune`,
:func:`labkit.planning.choose.choose_strategy`) and prices what each costs beyond GPU-hours. Every
figure that is not the calculator's is an assumption of :class:`Assumptions`, named in the row:

* **Compute.** Model FLOPs per run: 6ND for full fine-tuning, 4ND for LoRA and QLoRA, whose
  backward computes the activations' gradients (2ND) but no weight gradient for the frozen base
  (the adapters' few FLOPs aside). Hours at an assumed model-FLOPs utilisation of the datasheet peak.
* **Storage.** What a run leaves to keep: a full fine-tune is a whole model (16-bit, 2 bytes per
  parameter); a LoRA run is its adapters (16-bit), next to one shared copy of the base. While a run
  trains, a resumable checkpoint also holds the optimizer: 14 bytes per trained parameter (16-bit
  weights, the fp32 master copy, Adam's two fp32 moments). ``states_gb`` is the model states in
  memory, 16 bytes per trained parameter (ZeRO's 2 + 2 + 12).
* **Network.** Bytes each GPU sends per optimizer step: ZeRO-3 all-gathers the 16-bit weights in
  forward and again in backward and reduce-scatters the gradients, ``(n-1)/n`` of 2 bytes x
  parameters each time (Rajbhandari et al. 2020, section 7); a frozen base is gathered but has no
  gradient to reduce. One GPU sends nothing.
* **People and cadence**: engineering weeks per run and runs a year, assumptions stated as such.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from labkit.core.checks import positive_int
from labkit.memory.calculator import GB, model_shape
from labkit.planning.accelerators import accelerator
from labkit.planning.choose import choose_strategy
from labkit.planning.cost import training_hours
from labkit.planning.memory_report import choose_finetune


@dataclass(frozen=True)
class Assumptions:
    """What :func:`three_ways` assumes; every field is an assumption to replace with your own."""

    tokens: float = 3e7  # training tokens per run: 10,000 examples x 1,000 tokens x 3 epochs
    pretrain_tokens: float = 2e12  # pretraining from scratch: LLaMA-2's 2 trillion tokens (Touvron et al. 2023)
    seq_len: int = 4096  # tokens per sequence (LLaMA-2's context)
    api_usd_per_m_tokens: float = 25.0  # hosted fine-tuning, USD per million training tokens (a 2024 list price)
    mfu: dict = field(default_factory=lambda: {"full": 0.3, "lora": 0.4, "qlora": 0.3})  # offload and
    # dequantisation cost full fine-tuning and QLoRA some utilisation
    storage_usd_per_gb_month: float = 0.023  # object storage, standard tier
    months_kept: int = 12  # how long a run's result is kept
    engineer_weeks: dict = field(default_factory=lambda: {"api": 1.0, "qlora": 2.0, "lora": 3.0, "full": 8.0})
    runs_per_year: int = 4  # "a few a year" (a classic model retrained monthly: 12)


def _network_bytes(n_params: int, trained: int, n: int, stage: int) -> float:
    """Bytes a GPU sends per optimizer step under data parallelism at ZeRO ``stage`` (16-bit)."""
    if n == 1:
        return 0.0
    share = (n - 1) / n
    grads = 2 * 2 * trained * share if stage < 2 else 2 * trained * share  # all-reduce, or reduce-scatter
    gathers = 2 * 2 * n_params * share if stage == 3 else 0.0  # forward and backward all-gathers
    return grads + gathers


def _row(option: str, key: str, n: int, rec_label: str | None, total: int, host: int, n_params: int,
         trained: int, flops_per_token: float, device_name: str, a: Assumptions, stage: int) -> dict:
    dev = accelerator(device_name)
    flops = flops_per_token * n_params * a.tokens
    hours = training_hours(flops, n, dev.peak_bf16_tflops, a.mfu[key])
    result_gb = 2 * (n_params if key == "full" else trained) / GB
    return {"option": option, "gpus": n, "layout": rec_label or "nothing fits", "fits": rec_label is not None,
            "gb_per_gpu": total / GB, "host_gb_per_gpu": host / GB, "trained_params": trained,
            "model_flops": flops, "gpu_hours": hours * n, "compute_usd": hours * n * dev.price_on_demand,
            "result_gb": result_gb, "checkpoint_gb": 14 * trained / GB, "states_gb": 16 * trained / GB,
            "storage_usd": result_gb * a.storage_usd_per_gb_month * a.months_kept,
            "network_gb_per_step": _network_bytes(n_params, trained, n, stage) / GB,
            "engineer_weeks": a.engineer_weeks[key], "runs_per_year": a.runs_per_year}


def three_ways(model: str = "llama2-70b", device: str = "a100-80gb", devices: int = 8, rank: int = 16,
               assumptions: Assumptions | None = None) -> list[dict]:
    """One row per way to adapt ``model``: a hosted API, QLoRA on one GPU, LoRA on ``devices`` GPUs,
    full fine-tuning on ``devices`` GPUs (the calculator's recommended layout for each), with memory,
    compute, storage, network, people and cadence, and yearly totals; last, for scale, pretraining
    the same model from scratch on the same GPUs (no people or cadence: not a team's routine)."""
    a = assumptions or Assumptions()
    n = positive_int("devices", devices)
    shape = model_shape(model)
    dev = accelerator(device)
    common = dict(rank=rank, targets="all", micro_batch=1, seq_len=a.seq_len)
    rows = [{"option": "hosted API fine-tuning", "gpus": 0, "layout": "the provider's", "fits": True,
             "gb_per_gpu": 0.0, "host_gb_per_gpu": 0.0, "trained_params": None, "model_flops": None,
             "gpu_hours": 0.0, "compute_usd": a.tokens / 1e6 * a.api_usd_per_m_tokens, "result_gb": 0.0,
             "checkpoint_gb": 0.0, "states_gb": 0.0, "storage_usd": 0.0, "network_gb_per_step": 0.0,
             "engineer_weeks": a.engineer_weeks["api"], "runs_per_year": a.runs_per_year}]
    for key, gpus, label in (("qlora", 1, "QLoRA on 1 GPU"), ("lora", n, f"LoRA on {n} GPUs")):
        rec = choose_finetune(shape, key, gpus, dev.memory_gb, **common)
        e = rec.estimate
        rows.append(_row(label, key, gpus, rec.strategy, e.total if e else 0, 0, shape.n_params,
                         e.trainable_params if e else 0, 4.0, device, a, e.stage if e else 0))
    rec = choose_strategy(shape, n, dev.memory_gb, 1, a.seq_len, device=device)
    chosen = rec.chosen
    full = dict(rec_label=rec.strategy, total=chosen.memory.total if chosen else 0,
                host=chosen.memory.host if chosen else 0, n_params=shape.n_params, trained=shape.n_params,
                flops_per_token=6.0, device_name=device, stage=chosen.plan.zero if chosen else 0)
    rows.append(_row(f"full fine-tuning on {n} GPUs", "full", n, a=a, **full))
    scratch = _row(f"pretraining from scratch on {n} GPUs", "full", n, a=a, **full)
    scale = a.pretrain_tokens / a.tokens  # the same step, D tokens instead of the fine-tuning set's
    rows.append({**scratch, **{k: scratch[k] * scale for k in ("model_flops", "gpu_hours", "compute_usd")},
                 "engineer_weeks": None, "runs_per_year": None})
    for r in rows:
        runs = r["runs_per_year"]
        r["yearly_usd"] = (r["compute_usd"] + r["storage_usd"]) * runs if runs else None
        r["yearly_engineer_weeks"] = r["engineer_weeks"] * runs if runs else None
    return rows


def assumptions_dict(a: Assumptions | None = None) -> dict:
    """The assumptions as a plain dict (for a table or a metrics file)."""
    return asdict(a or Assumptions())
