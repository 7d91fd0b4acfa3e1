"""Writing a Hugging Face folder from sharded ranks: safetensors shards with their index,
a config, the tokenizer files, as transformers' `save_pretrained` lays them out.

    written = write_folder(folder, items, write_rest, tokenizer_from=source)

`items` yields (name in the folder, full tensor) one at a time on every rank, in step
(gathering is collective); rank 0 streams them into part files of at most
`shard_bytes` and joins the parts into the shards at the end, so no rank holds more
than one shard's tensors. Used by `nbtrain.save_pretrained` (transformers models) and
`Runtime.save_pretrained` (the runtime's registered models).
"""

from __future__ import annotations

import json
import os
import shutil

from ..checkpoint import stream
from ..checkpoint.layout import agreed
from ..comm import collectives as C
from ..comm.context import get_context

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
SHARD_BYTES = 2 << 30  # what one safetensors shard holds at most (transformers: 5 GB)


def tokenizer_source(what: str, source: str | None, given: bool, note: bool = True) -> bool:
    """Whether the folder `source` has tokenizer files. `given`: the user named it
    (tokenizer_from), so a folder without them is an error; otherwise rank 0 notes
    that the written folder will have none (`note`). Local."""
    has = bool(source) and any(os.path.isfile(os.path.join(source, n)) for n in TOKENIZER_FILES)
    if given and not has:
        raise FileNotFoundError(
            f"{what}: tokenizer_from={source!r} has no tokenizer files (looked for "
            f"{', '.join(TOKENIZER_FILES[:2])}, ...); give the folder your tokenizer was "
            "saved to (tokenizer.save_pretrained(folder)), or leave tokenizer_from out"
        )
    if note and not has and get_context().rank == 0:
        print(
            f"{what}: no tokenizer files in {source!r}, so the folder has none; pass "
            "tokenizer_from=FOLDER to copy them",
            flush=True,
        )
    return has


def prepare(what: str, folder: str, overwrite: bool) -> None:
    """Creates `folder`; refuses (on every rank) one that is not empty unless
    `overwrite`. Collective."""

    def make():
        if os.path.isdir(folder) and os.listdir(folder) and not overwrite:
            raise FileExistsError(
                f"{what}: {folder!r} is not empty; give a new folder, or overwrite=True "
                "to replace its files"
            )
        os.makedirs(folder, exist_ok=True)

    agreed(what, make, run_here=get_context().rank == 0)


def write_folder(
    what: str,
    folder: str,
    items,
    write_rest,
    *,
    tokenizer_from: str | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> list[str]:
    """Streams `items` ((name, full tensor), every rank in step) into the folder's
    safetensors shards, then on rank 0 `write_rest(folder) -> [names]` (the config)
    and a copy of `tokenizer_from`'s tokenizer files. Returns the names written, on
    every rank. Collective; `prepare` first."""
    writes = get_context().rank == 0
    shards, writer, size = [], None, 0
    try:
        for key, tensor in items:
            if not writes:
                continue
            nbytes = tensor.numel() * tensor.element_size()
            if writer is None or (size and size + nbytes > shard_bytes):
                if writer is not None:
                    writer.close()
                writer = stream.PartWriter(os.path.join(folder, f".part{len(shards)}"))
                shards.append(writer)
                size = 0
            writer.add(key, tensor)
            size += nbytes
            del tensor
    finally:
        if writer is not None:
            writer.close()

    def finish() -> list[str]:
        written = _write_shards(folder, shards) + list(write_rest(folder))
        for name in TOKENIZER_FILES:
            if tokenizer_from and os.path.isfile(os.path.join(tokenizer_from, name)):
                shutil.copyfile(os.path.join(tokenizer_from, name), os.path.join(folder, name))
                written.append(name)
        return written

    try:
        written = agreed(what, finish, run_here=writes)
    finally:
        for part in shards:
            stream.remove_quietly(part.path)
    return rank0_list(written)


def rank0_list(names: list[str]) -> list[str]:
    """Rank 0's list of names on every rank. Collective."""
    if get_context().world_size > 1:
        return C.all_gather_object(names)[0]
    return names


def _write_shards(folder: str, parts: list) -> list[str]:
    """The part files as safetensors shards (one file when there is one), and the index."""
    if not parts:
        return []
    if len(parts) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    weight_map, total = {}, 0
    for part, name in zip(parts, names):
        final = os.path.join(folder, name)
        tmp = f"{final}.tmp-{os.getpid()}"
        try:
            stream.join_parts(tmp, [(part.path, part.entries)])
            os.replace(tmp, final)  # whole or not at all
        except BaseException:
            stream.remove_quietly(tmp)
            raise
        for key, _, _, nbytes in part.entries:
            weight_map[key] = name
            total += nbytes
    if len(parts) <= 1:
        return names
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return [*names, "model.safetensors.index.json"]
