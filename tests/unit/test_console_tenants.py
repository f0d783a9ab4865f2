"""With API keys, the engine view shows a viewer its own tenant's requests by id and every other
key's as one anonymous row and colour: no other tenant's request ids or token counts."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

from infer8.entrypoints.console import StepRecorder
from infer8.entrypoints.console.recorder import OTHERS_LABEL
from infer8.entrypoints.console.snapshot import CELL_FIRST_OWNER
from infer8.entrypoints.openai.guards import tenant_of
from infer8.request import Request
from infer8.sampling_params import SamplingParams
from tests.unit.test_console_recorder import Clock, FakeEngine, _stats

TENANT_A, TENANT_B = tenant_of("key-a"), tenant_of("key-b")


def _add(engine: FakeEngine, req_id: str, salt: str | None, num_tokens: int) -> None:
    request = Request(req_id, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=8), [0],
                      cache_salt=salt)  # fmt: skip
    engine.scheduler.requests[req_id] = request
    engine.scheduler.running.append(request)
    assert engine.kv_cache_manager.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens = num_tokens


def _steps(texts: list[str]) -> list[dict[str, Any]]:
    records = []
    for text in texts:
        lines = text.strip().split("\n")
        if lines[0] == "event: step":
            records.append(json.loads(lines[1][len("data: ") :]))
    return records


def test_each_tenant_sees_its_own_requests_by_id_and_others_as_one_row() -> None:
    async def run() -> None:
        engine = FakeEngine()
        _add(engine, "cmpl-a-0", TENANT_A, 8)  # 2 blocks
        _add(engine, "cmpl-a2-0", f"{TENANT_A}:user-salt", 4)  # 1 block, A's own salt too
        _add(engine, "cmpl-b-0", TENANT_B, 12)  # 3 blocks
        recorder = StepRecorder(engine, clock=Clock())
        streams = {
            "a": recorder.stream(heartbeat_s=60, tenant=TENANT_A, is_redacted=True),
            "b": recorder.stream(heartbeat_s=60, tenant=TENANT_B, is_redacted=True),
            "shared": recorder.stream(heartbeat_s=60, tenant=None, is_redacted=True),
            "keyless": recorder.stream(heartbeat_s=60),  # a server without keys
        }
        first = {name: _steps([await s.__anext__(), await s.__anext__()]) for name, s in
                 streams.items()}  # fmt: skip
        recorder.on_step(_stats(num_running=3, num_tokens=3, req_ids=("cmpl-a-0", "cmpl-b-0")))
        await asyncio.sleep(0)
        queued = {(v.tenant, v.is_redacted): _steps(list(v.events)) for v in recorder._viewers}
        for stream in streams.values():
            await stream.aclose()

        def rows(record: dict[str, Any]) -> dict[str, list[Any]]:
            return {row[1]: row for row in record["reqs"]}

        for record in (first["a"][0], queued[(TENANT_A, True)][0]):
            seen = rows(record)
            assert set(seen) == {"cmpl-a-0", "cmpl-a2-0", f"{OTHERS_LABEL} (1)"}
            assert seen["cmpl-a-0"][2:] == [8, 0, 2]
            assert seen[f"{OTHERS_LABEL} (1)"][2:] == [None, None, 3]  # B: blocks, no tokens
            # The map shows B's blocks in the others' colour, A's in their own.
            cells = list(base64.b64decode(record["kv"]))
            others_value = CELL_FIRST_OWNER + seen[f"{OTHERS_LABEL} (1)"][0]
            assert cells.count(others_value) == 3
            assert others_value not in {CELL_FIRST_OWNER + r[0] for r in record["reqs"][:-1]}
        b_seen = rows(first["b"][0])
        assert set(b_seen) == {"cmpl-b-0", f"{OTHERS_LABEL} (2)"}
        assert "cmpl-a" not in json.dumps(first["b"]) + json.dumps(queued[(TENANT_B, True)])
        # Keys that share the cache: requests carry no tenant, so none is shown by id.
        assert set(rows(first["shared"][0])) == {f"{OTHERS_LABEL} (3)"}
        # Without keys every request is shown.
        keyless = first["keyless"][0]
        assert set(rows(keyless)) == {"cmpl-a-0", "cmpl-a2-0", "cmpl-b-0"}
        assert set(rows(queued[(None, False)][0])) == set(rows(keyless))

    asyncio.run(run())
