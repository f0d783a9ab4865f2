"""The KV events example in docs/deployment.md: it needs only what setup installs, and it works."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from infer8.core import kv_events as records
from infer8.core.block_pool import BlockPool, hash_block_tokens
from infer8.kv_events import KVEventEncoder

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deployment.md"
IMPORTS_MSGPACK = re.compile(r"^\s*(import|from)\s+msgpack\b", re.MULTILINE)


def python_blocks(text: str) -> list[str]:
    """Return the code of every ```python block."""
    return re.findall(r"^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)


def documented_decoder() -> Callable[[set[Any], bytes], None]:
    """Return the page's `apply_kv_events`, executed from its code block."""
    (code,) = [c for c in python_blocks(DOC.read_text()) if "def apply_kv_events" in c]
    namespace: dict[str, Any] = {}
    exec(compile(code, f"{DOC}:apply_kv_events", "exec"), namespace)
    return namespace["apply_kv_events"]


def test_docs_decode_with_msgspec_and_their_python_compiles() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    pages += sorted(p for p in (ROOT / "deploy").rglob("*") if p.is_file())
    for page in pages:
        text = page.read_text(errors="replace")
        assert not IMPORTS_MSGPACK.search(text), f"{page} imports msgpack, which setup lacks"
        for i, code in enumerate(python_blocks(text)):
            compile(code, f"{page}:block {i}", "exec")
    example = "\n".join(c for c in python_blocks(DOC.read_text()) if "msgspec.msgpack" in c)
    assert "import msgspec" in example


@pytest.mark.parametrize("use_int_block_hashes", [True, False])
def test_the_example_replays_the_pools_events_into_its_cached_set(
    use_int_block_hashes: bool,
) -> None:
    apply_kv_events = documented_decoder()
    encoder = KVEventEncoder(use_int_block_hashes=use_int_block_hashes)
    rng = random.Random(0)
    bs = 4
    pool = BlockPool(16, enable_kv_cache_events=True)
    index: set[Any] = set()
    held: list[list[int]] = []
    prefixes = [[rng.randrange(50) for _ in range(bs * 5)] for _ in range(3)]
    kinds: set[type] = set()
    for step in range(200):
        if rng.random() < 0.6:
            tokens = rng.choice(prefixes)[: bs * rng.randint(1, 5)]
            tokens += [rng.randrange(50) for _ in range(bs * rng.randint(0, 2))]
            hashes: list[bytes] = []
            for i in range(len(tokens) // bs):
                parent = hashes[-1] if hashes else None
                hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))
            hits = []
            for h in hashes:
                block_id = pool.get_cached_block(h)
                if block_id is None:
                    break
                hits.append(block_id)
            num_free_hits = sum(pool.is_free(b) for b in hits)
            if len(hashes) - len(hits) + num_free_hits > pool.num_free_blocks:
                continue
            pool.touch(hits)
            block_ids = hits + pool.allocate(len(hashes) - len(hits))
            pool.cache_full_blocks(
                block_ids,
                hashes,
                block_token_ids=[tokens[i * bs : (i + 1) * bs] for i in range(len(hashes))],
            )
            held.append(block_ids)
        elif held and rng.random() < 0.9:
            pool.free(held.pop(rng.randrange(len(held)))[::-1])
        else:
            for block_ids in held:
                pool.free(block_ids[::-1])
            held.clear()
            pool.reset_prefix_cache()
        events = pool.take_events()
        kinds.update(type(e) for e in events)
        # The host tier's events name another medium: the device index must ignore them.
        events.append(records.BlockStored([bytes([step % 256]) * 32], None, [1] * bs, bs, [None],
                                          medium=records.MEDIUM_HOST))  # fmt: skip
        apply_kv_events(index, encoder.encode(events, ts=float(step)))
        assert index == {encoder.external_hash(h) for h in pool.cached_block_hash_to_block}
    assert kinds == {records.BlockStored, records.BlockRemoved, records.AllBlocksCleared}
