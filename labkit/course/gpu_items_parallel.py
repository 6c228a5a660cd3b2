"""``make gpu-check`` items for FSDP2 on one rank, context parallelism against PyTorch's own API, and
expert parallelism against one process (see :mod:`labkit.course.gpu_items` for the rest)."""
from __future__ import annotations

from dataclasses import replace

from labkit.course.gpu_items import LOSS_TOL, Item, Setting, _max_dev


def context(s: Setting) -> list[Item]:
    """The from-scratch ring attention against one process and against torch's ``context_parallel``
    (which needs CUDA: on CPU processes torch has no sharding rule for its attention kernel)."""
    from labkit.launch import launch
    from labkit.parallel.context.torch_cp import check_against_torch_cp

    if s.world < 2:
        return [Item("context parallel", "skip", "needs >= 2 GPUs (one rank holds the whole sequence)")]
    world = 2
    res = launch(check_against_torch_cp, world_size=world, device=s.device, quiet=True, timeout=600)
    ours = max(r["ours_err"] for r in res)
    items = [Item("context parallel: ring attention", "pass" if ours < 1e-4 else "fail",
                  f"{world} rank(s): max |ring - one process| {ours:.1e} (output and gradients, fp32)",
                  {"ours_err": ours})]
    if res[0]["torch_err"] is None:
        if s.device != "cuda":
            items.append(Item("context parallel: torch's API", "skip", "needs CUDA (torch's context_parallel has no "
                              f"CPU sharding rule for its attention kernel: {res[0]['torch_error']})"))
        else:
            items.append(Item("context parallel: torch's API", "fail",
                              f"torch's context_parallel did not run here: {res[0]['torch_error']}"))
    else:
        theirs = max(r["torch_err"] for r in res)
        ok = theirs < 1e-4 and all(r["same_layout"] for r in res)
        items.append(Item("context parallel: torch's API", "pass" if ok else "fail",
                          f"max |torch - one process| {theirs:.1e}; same zig-zag positions: "
                          f"{all(r['same_layout'] for r in res)}", {"torch_err": theirs}))
    return items


def experts(s: Setting) -> list[Item]:
    """A mixture-of-experts GPT trained with ``--strategy ep`` on the node, against one process."""
    from labkit.course.gpu_items import model_for
    from labkit.launch import launch
    from labkit.train import TrainConfig, train

    if s.world < 2:
        return [Item("experts", "skip", "needs >= 2 GPUs (one rank holds every expert)")]
    e = 2 * s.world
    model = replace(model_for(s), moe_experts=e, moe_top_k=2, moe_capacity_factor=4.0)
    base = TrainConfig(device=s.device, steps=s.steps, batch_size=8 * s.world, lr=3e-3, seed=0, count_comm="none")
    ref = train(base, model)
    run = launch(train, replace(base, strategy="ep", ep=s.world), model, world_size=s.world, device=s.device,
                 quiet=True, timeout=1200)[0]
    dev = _max_dev(run["loss"], ref["loss"])
    return [Item("experts: ep against one process", "pass" if dev < LOSS_TOL["fp32"] else "fail",
                 f"{e} experts over {s.world} rank(s): max |loss - one process| {dev:.1e} (bar {LOSS_TOL['fp32']:g})",
                 {"max_loss_dev": dev, "tokens_per_s": run["tokens_per_s"]})]


def fsdp2(s: Setting) -> list[Item]:
    """FSDP2 on one rank, as one GPU can run it: bf16 parameters (fp32 shards) trained against one process
    in bf16 autocast, and a DCP save and load of the sharded state. On one GPU labkit's loop trains
    ``--strategy fsdp`` without FSDP2 (nothing to shard over); this is what FSDP2 itself does there."""
    import tempfile

    from labkit.course.gpu_items import model_for
    from labkit.launch import launch

    with tempfile.TemporaryDirectory() as d:
        r = launch(fsdp2_alone, s.device, s.steps, model_for(s), d, world_size=1, device=s.device, quiet=True,
                   timeout=600)[0]
    dev, bar = _max_dev(r["loss"], r["ref_loss"]), LOSS_TOL["16-bit"]
    ok = dev < bar and r["compute_dtype"] == "bfloat16" and r["dtensors"] and r["shard_dtype"] == "float32" \
        and r["dcp_equal"]
    return [Item("fsdp2 alone", "pass" if ok else "fail",
                 f"1 rank, fully_shard with bf16 parameters: computes in {r['compute_dtype']}, keeps "
                 f"{r['shard_dtype']} DTensor shards; max |loss - one process in bf16 autocast| {dev:.1e} over "
                 f"{s.steps} steps (bar {bar:g}); DCP save and load {'equal' if r['dcp_equal'] else 'DIFFER'}",
                 {"max_loss_dev": dev, **r})]


def fsdp2_alone(device: str, steps: int, model_cfg, ckpt_dir: str) -> dict:
    """On a group of one rank: the GPT under ``fully_shard`` with bf16 parameters and its twin without,
    both in bf16 autocast (``--fsdp-bf16 --precision bf16``), trained on the same batches; the dtype a
    matmul saw, the shards' type, and whether a DCP checkpoint of the shards loads back equal."""
    import copy

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from labkit.core.devices import current_device
    from labkit.core.model import build_model
    from labkit.parallel.fsdp import apply_fsdp
    from labkit.parallel.layout.mesh import alone_mesh

    dev = current_device(device)
    model = build_model(model_cfg, seed=0).to(dev)
    twin = copy.deepcopy(model)
    apply_fsdp([model], alone_mesh(dev.type), bf16_params=True, device=dev)
    seen = []
    model.head.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, twin)]
    g, losses = torch.Generator().manual_seed(0), ([], [])
    for _ in range(steps):
        x = torch.randint(0, model_cfg.vocab_size, (8, model_cfg.block_size + 1), generator=g).to(dev)
        for i, (m, opt) in enumerate(zip((model, twin), opts)):
            with torch.autocast(dev.type, dtype=torch.bfloat16):  # as --precision bf16: the loss in fp32
                loss = m(x[:, :-1].contiguous(), x[:, 1:].contiguous())[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[i].append(loss.item())
    state = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    loaded = {"model": model.state_dict()}
    dcp.load(loaded, checkpoint_id=ckpt_dir)
    params = list(model.parameters())
    return {"loss": losses[0], "ref_loss": losses[1], "compute_dtype": str(seen[0]).removeprefix("torch."),
            "dtensors": all(isinstance(p, DTensor) for p in params),
            "shard_dtype": str(params[0].dtype).removeprefix("torch."),
            "dcp_equal": all(torch.equal(v.full_tensor(), state[k]) for k, v in model.state_dict().items())}
