"""``make gpu-check`` items for the newer dimensions: context parallelism against PyTorch's own API,
and expert parallelism against one process (see :mod:`labkit.labs.gpu_items` for the rest)."""
from __future__ import annotations

from dataclasses import replace

from labkit.labs.gpu_items import LOSS_TOL, Item, Setting, _max_dev


def context(s: Setting) -> list[Item]:
    """The from-scratch ring attention against one process and against torch's ``context_parallel``
    (which needs CUDA: on CPU processes torch has no sharding rule for its attention kernel)."""
    from labkit.launch import launch
    from labkit.parallel.context_parallel_torch import check_against_torch_cp

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
    from labkit.labs.gpu_items import model_for
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
