"""State TTL through snapline.testing: random writes and reads at random processing times
(the harness's clock) see exactly what a brute-force reference with expiry times sees, with
crashes, on both backends (expired state is also swept before every checkpoint)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapline import (
    Context,
    KafkaSink,
    KafkaSource,
    KeyedProcessFunction,
    ListState,
    MapState,
    Pipeline,
    ValueState,
)
from snapline.testing import Message, run_pipeline


def probe_pipeline(ttl_ms: int, backend: str, now: list[int]) -> Pipeline:
    ttl = timedelta(milliseconds=ttl_ms)

    class Probe(KeyedProcessFunction):
        last = ValueState("last", ttl=ttl)
        items = ListState("items", ttl=ttl)
        seen = MapState("seen", ttl=ttl)

        def process(self, value: dict[str, Any], ctx: Context) -> Any:
            out = {
                "i": value["i"],
                "last": self.last.value(),
                "items": self.items.get(),
                "seen": sorted(self.seen.keys()),
            }
            if value["write"]:
                self.last.update(value["x"])
                self.items.add(value["x"])
                self.seen.put(value["x"], True)
            yield out

    def clock(value: dict[str, Any]) -> int:
        now[0] = value["t"]  # the processing time of this record, for the harness's clock
        return int(value["t"])

    pipeline = Pipeline("ttl", state_backend=backend)
    (
        pipeline.source(KafkaSource("ops", timestamp=clock, idle_timeout=None))
        .key_by()
        .process(Probe())
        .sink(KafkaSink("reads"))
    )
    return pipeline


def reference(ops: list[tuple[str, int, int, bool]], ttl: int) -> list[dict[str, Any]]:
    last: dict[str, tuple[int, int]] = {}
    items: dict[str, tuple[list[int], int]] = {}
    seen: dict[tuple[str, int], int] = {}
    out = []
    for i, (key, t, x, write) in enumerate(ops):
        alive_last = last.get(key)
        alive_items = items.get(key)
        out.append(
            {
                "i": i,
                "last": alive_last[0] if alive_last and alive_last[1] > t else None,
                "items": list(alive_items[0]) if alive_items and alive_items[1] > t else [],
                "seen": sorted(k[1] for k, exp in seen.items() if k[0] == key and exp > t),
            }
        )
        if write:
            last[key] = (x, t + ttl)
            kept = alive_items[0] if alive_items and alive_items[1] > t else []
            items[key] = ([*kept, x], t + ttl)
            seen[(key, x)] = t + ttl
    return out


@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.integers(0, 15),
            st.integers(0, 3),
            st.booleans(),
        ),
        min_size=1,
        max_size=40,
    ),
    ttl=st.integers(1, 40),
    crash=st.lists(st.integers(1, 50), max_size=2),
    backend=st.sampled_from(["memory", "rocksdb"]),
)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_ttl_state_matches_the_reference(
    steps: list[tuple[str, int, int, bool]], ttl: int, crash: list[int], backend: str
) -> None:
    # Processing time moves forward by the step's increment (never back).
    ops, t = [], 1_000
    for key, dt, x, write in steps:
        t += dt
        ops.append((key, t, x, write))
    now = [0]
    inputs = [
        Message({"i": i, "t": t, "x": x, "write": w}, key=k) for i, (k, t, x, w) in enumerate(ops)
    ]
    run = run_pipeline(
        probe_pipeline(ttl, backend, now),
        {"ops": inputs},
        checkpoint_every=5,
        crash_after=crash,
        processing_time=lambda: now[0],
    )
    assert sorted(run.outputs["reads"], key=lambda o: o["i"]) == reference(ops, ttl)
