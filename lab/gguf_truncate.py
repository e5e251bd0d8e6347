"""A GGUF model cut to some of its transformer blocks: real (quantized) weights, the real tokenizer,
in a file small enough to carry to the lent GPU machine (at most 64 MiB travel with a call, and
the embedded model's GGUF is 98 MB). Its perplexity is worse than the whole model's; tests that
compare two devices or two code paths on the same weights do not care. Keeping the first and the
last blocks (the default, 0-2 and 27-29 of SmolLM2's 30) keeps it far better than the first N alone.

    python -m lab gguf_truncate [--blocks 0-2,27-29] [--src PATH] [--out .gpu/model.gguf]

Every metadata field is copied (block_count set to the number kept), and the tensors of the kept
blocks, renumbered in order, with every tensor outside blk.<i>.*, byte for byte in its own
quantized type (gguf-py's gguf_new_metadata copy, filtered).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path


def parse_blocks(text: str) -> list[int]:
    """"0-2,27-29" -> [0, 1, 2, 27, 28, 29]."""
    blocks = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        blocks.extend(range(int(first), int(last or first) + 1))
    return sorted(set(blocks))


def truncate(src: Path, out: Path, blocks: list[int]) -> int:
    """Write `blocks` of `src` (renumbered 0..) to `out`; returns the bytes written."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    block_count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    total = reader.get_field(block_count_key).contents()
    if not blocks or not all(0 <= b < total for b in blocks):
        raise SystemExit(f"--blocks must name blocks in 0..{total - 1} (the model has {total}), got {blocks}")
    renumber = {old: new for new, old in enumerate(blocks)}
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = len(blocks) if field.name == block_count_key else field.contents()
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)

    def new_name(name: str):
        """The tensor's name in the output, None if its block is dropped."""
        m = re.match(r"blk\.(\d+)\.(.*)", name)
        if m is None:
            return name
        block = int(m.group(1))
        return f"blk.{renumber[block]}.{m.group(2)}" if block in renumber else None

    tensors = [(new_name(t.name), t) for t in reader.tensors if new_name(t.name) is not None]
    for name, t in tensors:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return out.stat().st_size


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab gguf_truncate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=parse_blocks, default=parse_blocks("0-2,27-29"),
                        help="blocks to keep, e.g. 0-2,27-29 (the default)")
    parser.add_argument("--src", type=Path, default=None, help="default: the embedded model's GGUF")
    parser.add_argument("--out", type=Path, default=Path(".gpu/model.gguf"))
    args = parser.parse_args(argv)
    if args.src is None:
        # the GGUF file itself: resolve_model_path("default") is its converted safetensors folder
        from kivi_models.loading import default_gguf_path

        args.src = default_gguf_path()
    size = truncate(args.src, args.out, args.blocks)
    print(f"{args.out}: blocks {args.blocks} of {args.src.name}, {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
