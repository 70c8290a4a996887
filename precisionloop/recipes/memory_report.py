"""The benchmark recipe's words on memory: the memory table per precision, and what the speed tables' peak and
reserve include."""

from __future__ import annotations

from precisionloop import MemoryBreakdown

MEMORY_ROWS = (("parameters_mb", "parameters"), ("buffers_mb", "buffers"), ("gradients_mb", "gradients"),
               ("optimizer_state_mb", "optimizer state"), ("activations_and_workspace_mb", "activations+workspace"),
               ("peak_mb", "peak"), ("reserved_mb", "reserved"))


def format_memory_table(breakdowns: dict[str, MemoryBreakdown | str], batch_size: int,
                        timed_peaks: dict[str, float] | None = None) -> str:
    """A column per precision, a row per part in MB; rows no precision has (the CUDA-only ones elsewhere) left out.

    ``timed_peaks`` (precision to MB), the speed table's peaks at the same batch size, adds a row that checks the
    breakdown against a peak measured apart from it, over the timed steps (the recipe leaves out precisions whose
    steps replay CUDA graphs, where neither peak holds the activations).
    """
    parts = {p: b.to_dict() for p, b in breakdowns.items() if isinstance(b, MemoryBreakdown)}
    rows = [(key, name) for key, name in MEMORY_ROWS if any(d[key] is not None for d in parts.values())]
    timed = {p: t for p, t in (timed_peaks or {}).items() if p in parts and parts[p]["peak_mb"] and t}
    label = max(len(name) for _, name in MEMORY_ROWS)

    def cell(precision: str, key: str) -> str:
        value = parts[precision][key] if precision in parts else None
        return "" if value is None else f"{value:.1f}" if value >= 10 else f"{value:.2f}"

    def against(p: str) -> str:
        return f"{timed[p]:.1f} ({100 * (parts[p]['peak_mb'] / timed[p] - 1):+.1f}%)" if p in timed else ""

    width = max([9] + [len(p) for p in breakdowns] + [len(against(p)) for p in breakdowns]
                + [len(cell(p, key)) for p in breakdowns for key, _ in rows])

    lines = [f"\nwhere the memory goes (batch {batch_size}), MB, read between a step's backward and its optimizer step:",
             f"{'':>{label}} | " + " | ".join(f"{p:>{width}}" for p in breakdowns)]
    lines += [f"{name:>{label}} | " + " | ".join(f"{cell(p, key):>{width}}" for p in breakdowns) for key, name in rows]
    if timed:
        lines.append(f"{'timed peak':>{label}} | " + " | ".join(f"{against(p):>{width}}" for p in breakdowns))
    lines += [f"{p}: {b}" for p, b in breakdowns.items() if not isinstance(b, MemoryBreakdown)]
    if any(d["peak_mb"] is not None for d in parts.values()):
        lines.append("peak: allocated since the steps before it (torch.cuda.max_memory_allocated); "
                     "activations+workspace: the peak less the four parts above it. CUDA graphs (compile "
                     "reduce-overhead) replay into their private pools without allocating, so their activations are "
                     "in neither: reserved (torch.cuda.memory_reserved, the warm-up's cache emptied first) holds them, "
                     "and is the figure to compare across precisions and compile modes"
                     + ("; timed peak: the speed table's peak at this batch size, and in brackets how far "
                        "the breakdown's parts (their sum, the peak above) are from it" if timed else ""))
    elif parts:
        lines.append("exact parts only: the peak, the activations and workspace and the reserve are measured on CUDA")
    return "\n".join(lines)


def memory_legend(results) -> list[str]:
    """What the peak and reserved rows include, where they are CUDA's."""
    results = [r for r in results if r is not None and not r.error]
    lines = []
    if any(r.memory_kind == "MB" for r in results):
        lines.append("peak MB: torch.cuda.max_memory_allocated from the last warm-up step to the last timed step, less "
                     "what the round's other systems held; CUDA graphs (compile reduce-overhead) replay into their "
                     "private pools without allocating, so their activations are not in it")
    if any(r.reserved_mb is not None for r in results):
        lines.append("reserved MB (systems timed alone): torch.cuda.max_memory_reserved over the same steps, the "
                     "warm-up's cache emptied before them: what the GPU held for the step, CUDA-graph pools included; "
                     "the figure to compare across precisions and compile modes")
    return lines
