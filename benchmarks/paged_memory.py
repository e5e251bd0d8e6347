"""`kivi bench memory`'s serving table: how many sequences four caches hold in one budget, from
their exact bytes (caches built on the meta device), for the Llama-2-7B and Llama-3-8B attention
shapes (fp16 cache, KIVI-2 with G=32, R=128 and fp16 scales).

- static fp16 and static KIVI-2: a row per sequence reserves max_seq_len tokens (4K or 8K),
  whatever the sequence uses: budget // bytes of one row.
- paged fp16 (16-token pages, vLLM's default) and paged KIVI-2 (page_size tokens of quantized
  keys and values per page, plus each row's fixed full-precision window of R tokens): a sequence
  holds the pages its length needs (pages_needed) plus its row state (lengths, window, its
  block-table row): budget // the mean of those bytes over the workload.

- KIVI-2 paged, window paged (a design, computed, not built): the same quantized pages, and the
  full-precision windows in fp16 pages of FP_PAGE tokens of their own instead of a fixed R-token
  buffer per row. Under KIVI's schedule (kivi_ops/options/schedule.py) a sequence of L tokens keeps
  L mod R keys and min(L, R) values exact, so the windows hold (L mod R) + min(L, R) tokens, not
  2R: the row state loses its windows and the sequence pays for the window pages it holds. This
  row is how the design was chosen (docs/serve.md): it shows what paging the window would buy.

Workloads: "chat" (ShareGPT-like log-normal prompt and output lengths, traces.py; a sequence is
counted at its final length, prompt + output, each clipped to 2048 so that a 4K row holds it), and
every sequence 2048 or 8192 tokens long.
"""

from __future__ import annotations

import statistics

import torch

from kivi_ops import FPCache, KIVICache, KIVIConfig
from kivi_ops.cache.paged_fp import PagedFPCache

from .traces import SHAREGPT, chat_lengths

SHAPES = {"llama2-7b": dict(num_layers=32, num_kv_heads=32, head_dim=128),
          "llama3-8b": dict(num_layers=32, num_kv_heads=8, head_dim=128)}
STATIC_ROWS = (4096, 8192)
WORKLOADS = ("chat", 2048, 8192)
FP_PAGE = 16
WINDOW_PAGED = "KIVI-2 paged, window paged (design, computed)"


def _paged_kivi(config: KIVIConfig, shape: dict, *, batch_size: int, num_pages: int, page_size: int, max_pages: int):
    from kivi_ops.cache.paged import PagedKIVICache  # the paged KIVI layer

    return PagedKIVICache(config, **shape, batch_size=batch_size, num_pages=num_pages, page_size=page_size,
                          max_pages_per_seq=max_pages, dtype=torch.float16, device="meta")


def paged_costs(kind: str, shape: dict, *, max_seq_len: int, page_size: int, config: KIVIConfig):
    """(bytes per page, bytes per row, pages_needed): exact, from caches on the meta device."""
    max_pages = -(-max_seq_len // page_size)

    def build(batch_size, num_pages):
        if kind == "fp16 paged":
            return PagedFPCache(**shape, batch_size=batch_size, num_pages=num_pages, page_size=page_size,
                                max_pages_per_seq=max_pages, dtype=torch.float16, device="meta")
        return _paged_kivi(config, shape, batch_size=batch_size, num_pages=num_pages, page_size=page_size,
                           max_pages=max_pages)

    b11, b12, b21 = (build(b, p).nbytes() for b, p in ((1, 1), (1, 2), (2, 1)))
    return b12 - b11, b21 - b11, build(1, 1).pages_needed


def window_paged_cost(kind_costs, shape: dict, config: KIVIConfig, *, fp_page: int = FP_PAGE):
    """(bytes per page, bytes per row, bytes(L)) of the paged-window design from the built paged KIVI
    cache's exact costs: the row state without its two R-token windows, and per sequence the fp16
    pages its exact keys (L mod R) and values (min(L, R)) occupy."""
    per_page, per_row, needed = kind_costs
    R = config.residual_length
    token_bytes = shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * 2  # one K or V token, fp16
    row_without_windows = per_row - 2 * R * token_bytes

    def sequence_bytes(n: int) -> int:
        fp_pages = -(-(n % R) // fp_page) + -(-min(n, R) // fp_page)
        return needed(n) * per_page + fp_pages * fp_page * token_bytes

    return row_without_windows, sequence_bytes


def bench_paged_memory(budget_gib: float = 40.0, *, chat_samples: int = 20_000, seed: int = 0,
                       kivi_page_size: int = 32) -> dict:
    budget = budget_gib * 2**30
    config = KIVIConfig()  # KIVI-2, G=32, R=128
    chat = [p + o for p, o in chat_lengths(chat_samples, seed=seed, max_prompt=2048, max_output=2048)]  # <= 4K
    workloads = {"chat": chat, 2048: [2048], 8192: [8192]}
    rows = []
    have_paged_kivi = True
    try:
        import kivi_ops.cache.paged  # noqa: F401
    except ImportError:
        have_paged_kivi = False
    for shape_name, shape in SHAPES.items():
        static = {}
        for S in STATIC_ROWS:
            static[("fp16", S)] = FPCache(**shape, batch_size=1, max_seq_len=S, dtype=torch.float16,
                                          device="meta").nbytes()
            static[("KIVI-2", S)] = KIVICache(config, **shape, batch_size=1, max_seq_len=S, dtype=torch.float16,
                                              device="meta").nbytes()
        paged = {"fp16 paged": paged_costs("fp16 paged", shape, max_seq_len=8192, page_size=FP_PAGE, config=config)}
        if have_paged_kivi:
            paged["KIVI-2 paged"] = paged_costs("KIVI-2 paged", shape, max_seq_len=8192, page_size=kivi_page_size,
                                                config=config)
        window_design = window_paged_cost(paged["KIVI-2 paged"], shape, config) if have_paged_kivi else None
        for workload, lengths in workloads.items():
            longest = max(lengths)
            found = {}
            for name, (per_page, per_row, needed) in paged.items():
                per_seq = statistics.fmean(needed(n) * per_page for n in lengths) + per_row
                found[name] = dict(bytes_per_seq=per_seq, sequences=int(budget // per_seq),
                                   page_size=FP_PAGE if name == "fp16 paged" else kivi_page_size)
            if window_design is not None:
                per_row, sequence_bytes = window_design
                per_seq = statistics.fmean(sequence_bytes(n) for n in lengths) + per_row
                found[WINDOW_PAGED] = dict(bytes_per_seq=per_seq, sequences=int(budget // per_seq),
                                           page_size=kivi_page_size, computed=True)
            for (kind, S), per_row in static.items():
                name = f"{kind} static {S // 1024}K rows"
                found[name] = dict(bytes_per_seq=per_row, sequences=int(budget // per_row) if longest <= S else None)
            base = found["fp16 paged"]["sequences"]
            for name, r in found.items():
                rows.append(dict(shape=shape_name, workload=workload, mean_tokens=statistics.fmean(lengths), cache=name,
                                 **r, vs_paged_fp16=None if r["sequences"] is None else r["sequences"] / base))
    return dict(budget_gib=budget_gib, trace=SHAREGPT, chat_samples=chat_samples, kivi_config="KIVI-2 G=32 R=128",
                paged_kivi="exact" if have_paged_kivi else "missing: kivi_ops.cache.paged is not built", rows=rows)


def paged_memory_markdown(result: dict) -> str:
    lines = [f"Sequences held in {result['budget_gib']:g} GiB of cache (exact bytes; fp16; KIVI-2 G=32 R=128). "
             f"chat: {result['trace']['name']} log-normal lengths, mean "
             f"{next(r['mean_tokens'] for r in result['rows'] if r['workload'] == 'chat'):.0f} tokens per sequence.", "",
             "| shape | workload | cache | bytes per sequence | sequences | vs paged fp16 |", "| --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        held = "does not fit" if r["sequences"] is None else f"{r['sequences']:,}"
        ratio = "" if r["vs_paged_fp16"] is None else f"{r['vs_paged_fp16']:.2f}x"
        lines.append(f"| {r['shape']} | {r['workload']} | {r['cache']} | {r['bytes_per_seq']:,.0f} | {held} | {ratio} |")
    return "\n".join(lines) + "\n"
