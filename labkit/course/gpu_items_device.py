"""``make gpu-check``'s item for what one device does (the chapter "Inside one device"), measured with
no plotting library: the lab measures the same with figures, but a bare GPU image may lack matplotlib,
and these are the figures the chapter's ``gpu`` profile exists for.

* the device's two roofs (the best matmul in the check's precision, a streaming copy) against its
  datasheet;
* each op of a Llama-2-7B block (one 4,096-token sequence) against its roofline bound;
* fusion: an illustrative chain of element-wise ops and a whole block, eager, compiled and replayed
  as a CUDA graph (compiling passes when it moves fewer bytes and launches no more kernels);
* an FP8 GEMM (``torch._scaled_mm``) against one in the check's precision, and whether FP8 is hardware;
* the from-scratch FlashAttention against ``scaled_dot_product_attention``: error and saved bytes.

On ``--device cpu`` (the suite checking the check) the shapes are small and the precision fp32.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from labkit.course.gpu_items import Item, Setting

if TYPE_CHECKING:
    from labkit.device.roofline import Roof

# A block's ops at a shape a GPU's roofline means something at; on CPU, one the suite can afford.
GPU_SHAPE = dict(hidden=4096, heads=32, seq=4096, chain_tokens=65536, gemm=8192, roof_sizes=(4096, 8192),
                 copy_mb=1024)
CPU_SHAPE = dict(hidden=128, heads=4, seq=128, chain_tokens=2048, gemm=256, roof_sizes=(256,), copy_mb=16)
FLASH_TOL = 1e-4  # fp32, against SDPA, output and gradients (the lab's bar is 1e-5 on CPU)


def device(s: Setting) -> list[Item]:
    """Each part in turn; one that fails is its own failing line, one that lacks a tool (a compiler or
    Triton for ``torch.compile``) its own skip naming it, and the others still run."""
    import torch

    cuda = s.device == "cuda"
    z = dict(GPU_SHAPE if cuda else CPU_SHAPE, dtype=torch.bfloat16 if cuda else torch.float32,
             name=torch.cuda.get_device_name() if cuda else "CPU", family="llama" if cuda else "gpt")
    from labkit.course.gpu_items import emit

    items: list[Item] = []
    # torch.compile last: its cold compiles are most of the item's time, and a part finished before the
    # item's time budget runs out is reported even if the compiles are stopped
    for part, fn in (("roofs and block ops", _roofs), ("FP8 GEMM", _fp8_gemm), ("FlashAttention", _flash),
                     ("fusion", _fusion)):
        try:
            items += emit(fn(s.device, z))
        except ModuleNotFoundError as e:  # a tool the part needs (torch.compile's): a skip that names it
            from labkit.labs.script import missing

            items += emit([Item(f"device: {part}", "skip", f"needs {missing(e)}")])
        except Exception as e:  # noqa: BLE001 - a failed part is reported, and the next one runs
            first = (str(e).strip().splitlines() or [""])[0]
            items += emit([Item(f"device: {part}", "fail", f"{type(e).__name__}: {first}"[:300])])
    return items


def _roofs(dev: str, z: dict) -> list[Item]:
    from labkit.device.measure import measured_roof, time_block_ops
    from labkit.memory.architecture import ModelShape

    roof = measured_roof(dev, z["dtype"], sizes=z["roof_sizes"], copy_bytes=z["copy_mb"] << 20)
    items = [Item("device: roofs", "pass", f"{z['name']}: best {str(z['dtype'])[6:]} matmul "
                  f"{roof.flops_per_s / 1e12:.1f} TFLOP/s, copy {roof.bytes_per_s / 1e12:.2f} TB/s, ridge "
                  f"{roof.ridge:.0f} FLOP/B{_datasheet(z['name'], roof)}",
                  {"flops_per_s": roof.flops_per_s, "bytes_per_s": roof.bytes_per_s, "ridge": roof.ridge})]
    shape = ModelShape.from_dims(z["family"], z["hidden"], 1, z["heads"], 32000, z["seq"])
    rows = time_block_ops(shape, 1, z["seq"], roof, dev, z["dtype"], repeats=5)
    mm = [r["of_roofline"] for r in rows if r["kind"] == "matmul"]
    mem = [r["of_roofline"] for r in rows if r["bound"] == "memory"]
    def span(xs: list[float]) -> str:  # a busy CPU's measured ridge can leave one kind empty
        return f"{min(xs):.0%}-{max(xs):.0%}" if xs else "-"

    items.append(Item("device: block ops", "pass",
                      f"{len(rows)} ops of a {z['hidden']}-wide block, 1 x {z['seq']} tokens: matmuls at "
                      f"{span(mm)} of their bound, the {len(mem)} memory-bound ops at {span(mem)}", {"ops": rows}))
    return items


def _fusion(dev: str, z: dict) -> list[Item]:
    from labkit.device import fusion

    chain = fusion.chain_inputs(z["chain_tokens"], z["hidden"], dev, z["dtype"])
    block, xb = fusion.block_and_input(z["hidden"], z["heads"], 1, z["seq"], dev, z["dtype"])
    items = []
    for what, fn, args in (("chain", fusion.silu_residual_rmsnorm, chain), ("block", block, (xb,))):
        r = fusion.eager_and_compiled(fn, *args, repeats=5)
        # a block's matmuls and attention stay library kernels: fewer bytes, not always fewer kernels
        fewer = r["compiled_kernels"] <= r["eager_kernels"] and r["compiled_bytes"] < r["eager_bytes"]
        graph = f", CUDA graph {r['graph_s'] * 1e6:,.0f} us" if r["graph_s"] else ""
        items.append(Item(f"device: fusion, {what}", "pass" if fewer else "fail",
                          f"eager {r['eager_kernels']} kernels {r['eager_bytes'] / 2**20:,.0f} MiB "
                          f"{r['eager_s'] * 1e6:,.0f} us; compiled {r['compiled_kernels']} kernels "
                          f"{r['compiled_bytes'] / 2**20:,.0f} MiB {r['compiled_s'] * 1e6:,.0f} us "
                          f"(compiling {r['compile_s']:.0f} s){graph}", r))
    return items


def _fp8_gemm(dev: str, z: dict) -> list[Item]:
    from labkit.device import fp8

    speed = fp8.gemm_speed(z["gemm"], dev, z["dtype"], repeats=5)
    ratio = speed["fp8_flops_per_s"] / speed["flops_per_s"]
    if speed["fp8_gemm"] != "torch._scaled_mm":  # a GPU without FP8 units: no library FP8 GEMM to check
        import torch

        cc = ".".join(map(str, torch.cuda.get_device_capability())) if torch.cuda.is_available() else "?"
        return [Item("device: FP8 GEMM", "skip", f"needs FP8 units (compute capability 8.9 or later; this GPU's "
                     f"is {cc}): torch._scaled_mm has no kernel here; the emulated FP8 GEMM ran at "
                     f"{ratio:.2f}x {speed['dtype']}'s speed", speed)]
    return [Item("device: FP8 GEMM", "pass",
                 f"{z['gemm']}^3: {speed['dtype']} {speed['flops_per_s'] / 1e12:.1f} TFLOP/s, torch._scaled_mm "
                 f"E4M3 {speed['fp8_flops_per_s'] / 1e12:.1f} TFLOP/s ({ratio:.2f}x); "
                 + ("FP8 tensor cores" if speed["fp8_units"] else "no FP8 units: FP8 here saves bytes, not time"),
                 speed)]


def _datasheet(name: str, roof: Roof) -> str:
    """The measured roofs as shares of the datasheet's, for this device's share of its card (a MIG
    slice's SMs and memory slices)."""
    import torch

    from labkit.planning.accelerators import datasheet

    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    sheet = datasheet(name, props and props.multi_processor_count, props and props.total_memory / 1e9)
    if sheet is None:
        return ""
    peak, hbm = sheet["peak_tflops"]["bf16"] * 1e12, sheet["hbm_tb_per_s"]
    out = f" ({roof.flops_per_s / peak:.0%} of the datasheet's dense bf16 {peak / 1e12:,.0f} TFLOP/s"
    out += f"; copy at {roof.bytes_per_s / (hbm * 1e12):.0%} of its {hbm:.2f} TB/s" if hbm else ""
    return out + (f", for {sheet['share']:.0%} of the card" if sheet["share"] < 1 else "") + ")"


def _flash(dev: str, z: dict) -> list[Item]:
    """The tiles against SDPA in fp32, forward and gradients, and the bytes each saves for backward."""
    import torch
    import torch.nn.functional as F

    from labkit.device.flash_attention import attention_memory, error_against_sdpa, flash_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 512, 64, generator=g).to(dev) for _ in range(3))
    err = error_against_sdpa(q, k, v, True, 128)  # fp32 matmuls, whatever an earlier item set (TF32)
    ours = attention_memory(lambda a, b, c: flash_attention(a, b, c, True, 128), q, k, v)["saved_bytes"]
    sdpa = attention_memory(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
                            q, k, v)["saved_bytes"]
    ok = err < FLASH_TOL and ours == sdpa
    return [Item("device: FlashAttention", "pass" if ok else "fail",
                f"max |tiles - sdpa| {err:.1e} (bar {FLASH_TOL:g}, fp32, output and gradients); saved for backward "
                f"{ours / 2**20:.2f} MiB, sdpa {sdpa / 2**20:.2f} MiB", {"max_err": err, "saved_bytes": ours,
                                                                          "sdpa_saved_bytes": sdpa})]
