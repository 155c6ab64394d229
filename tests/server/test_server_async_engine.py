"""AsyncEngine in-process: the engine thread batches callers, sleeps when idle, aborts
closed streams at once, fails every caller when the engine breaks, and shuts down
cleanly with requests in flight."""

from __future__ import annotations

import asyncio
import time

import pytest

from hyprefix.async_engine import AsyncEngine, EngineClosedError, EngineDeadError
from hyprefix.config import EngineArgs
from hyprefix.demo import demo_model_path
from hyprefix.engine import Engine
from hyprefix.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineArgs(model=str(demo_model_path("dense")), num_kv_blocks=256, enforce_eager=True,
                             log_stats_interval=0))


def adder(request_id: str, prompt, params: SamplingParams):
    return lambda eng: eng.add_request(request_id, prompt, params)


async def collect(stream) -> dict:
    finals = {}
    async for outs in stream:
        for out in outs:
            finals[out.request_id] = out
    return finals


async def settle(ae: AsyncEngine) -> dict:
    """Engine stats once every command queued so far has run (and the engine is idle)."""
    for _ in range(200):
        stats = await ae.call(ae.engine.get_stats)
        if stats["num_requests_running"] == stats["num_requests_waiting"] == 0:
            await ae.call(ae.engine.check_invariants)
            return stats
        await asyncio.sleep(0.02)
    raise AssertionError(f"the engine did not go idle: {stats}")


def test_an_idle_engine_thread_maps_the_kv_pool_without_writing_it():
    """With nothing to do, the engine thread maps the K/V pool's pages ahead of their first
    write (``Engine.map_kv_pages``) until all are, then sleeps; no value changes."""
    fresh = Engine(EngineArgs(model=str(demo_model_path("dense")), num_kv_blocks=64, enforce_eager=True,
                              log_stats_interval=0))
    mapper = fresh.runner.kv_pages
    if mapper.done:
        pytest.skip("nothing to map here (not Linux 5.14+, or no CPU K/V)")

    async def main() -> None:
        ae = AsyncEngine(fresh)
        ae.start()
        try:
            for _ in range(500):
                if await ae.call(lambda: mapper.done):
                    break
                await asyncio.sleep(0.01)
            assert await ae.call(lambda: mapper.done)
            assert await ae.call(lambda: all(not t.any() for pair in fresh.runner.kv_caches for t in pair))
            iterations = ae.iterations
            for _ in range(20):  # the loop counts the iteration that ran that call after its result is back
                await asyncio.sleep(0.05)
                if ae.iterations == iterations:
                    break
                iterations = ae.iterations
            await asyncio.sleep(0.2)
            assert ae.iterations == iterations  # mapped, then asleep: no spinning
            out = await collect_one(ae, "after", [5, 6, 7, 8], GREEDY)
            assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())


def test_concurrent_callers_and_idle_loop(engine):
    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            reference = (await collect_one(ae, "ref", [5, 6, 7, 8], GREEDY)).outputs[0].token_ids
            streams = []
            for i in range(6):
                stream = ae.open_stream()
                await ae.add(stream, [f"r{i}"], adder(f"r{i}", [5, 6, 7, 8], GREEDY))
                streams.append(stream)
            results = await asyncio.gather(*(collect(s) for s in streams))
            assert [r[f"r{i}"].outputs[0].token_ids for i, r in enumerate(results)] == [reference] * 6
            stats = await settle(ae)
            assert stats["kv_blocks_used"] == 0
            await asyncio.sleep(0.1)  # the iteration that ran settle's last command ends
            idle_iterations = ae.iterations
            await asyncio.sleep(0.3)
            assert ae.iterations == idle_iterations  # blocked on the command queue, not spinning
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())


async def collect_one(ae: AsyncEngine, request_id: str, prompt, params: SamplingParams):
    stream = ae.open_stream()
    await ae.add(stream, [request_id], adder(request_id, prompt, params))
    return (await collect(stream))[request_id]


def test_bad_input_raises_and_leaves_nothing(engine):
    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            stream = ae.open_stream()
            with pytest.raises(ValueError, match="empty"):
                await ae.add(stream, ["bad"], adder("bad", "", GREEDY))
            assert stream.finished
            assert not await ae.call(engine.has_unfinished)
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())


def test_closing_a_stream_aborts_and_frees_blocks(engine):
    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            stream = ae.open_stream()
            await ae.add(stream, ["long"], adder("long", list(range(3, 60)), LONG))
            async for outs in stream:
                if len(outs[0].outputs[0].token_ids) >= 3:
                    break
            assert (await ae.call(engine.get_stats))["kv_blocks_used"] > 0
            stream.close()
            stats = await settle(ae)
            assert stats["kv_blocks_used"] == 0
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())


def test_shutdown_aborts_requests_in_flight(engine):
    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        stream = ae.open_stream()
        await ae.add(stream, ["a"], adder("a", [9, 10, 11], LONG))
        await ae.add(stream, ["b"], adder("b", [12, 13, 14], LONG))
        await asyncio.to_thread(ae.shutdown)
        finals = await asyncio.wait_for(collect(stream), 10)
        assert {o.outputs[0].finish_reason for o in finals.values()} == {"abort"}
        assert not ae.is_running and not ae._thread.is_alive()
        with pytest.raises(EngineClosedError):
            await ae.add(ae.open_stream(), ["late"], adder("late", [1, 2], GREEDY))
        assert engine.get_stats()["kv_blocks_used"] == 0
        engine.check_invariants()

    asyncio.run(main())


def test_engine_failure_fails_every_caller(engine):
    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        real_step = engine.step

        def broken_step():
            raise RuntimeError("boom")

        await ae.call(lambda: setattr(engine, "step", broken_step))
        try:
            stream = ae.open_stream()
            await ae.add(stream, ["x"], adder("x", [5, 6], GREEDY))
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(collect(stream), 10)
            deadline = time.monotonic() + 10
            while ae._thread.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert ae.dead is not None and not ae.is_running
            with pytest.raises(EngineDeadError):
                await ae.call(engine.get_stats)
        finally:
            del engine.step
            assert engine.step == real_step
            engine.abort("x")
            engine.step()
            assert engine.get_stats()["kv_blocks_used"] == 0

    asyncio.run(main())


def test_a_stream_nobody_reads_holds_only_the_latest_outputs(engine):
    # n=4 samples, 150 tokens each, and the consumer reads nothing until the end: a queue of
    # cumulative outputs would hold ~150 outputs of up to 600 token ids each.
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=150, ignore_eos=True, n=4)

    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            stream = ae.open_stream()
            await ae.add(stream, ["fan"], adder("fan", [5, 6, 7], params))
            peak = 0
            while not (stream._latest.get("fan") and stream._latest["fan"].finished):
                await asyncio.sleep(0.01)
                held = sum(len(c.token_ids) for out in stream._latest.values() for c in out.outputs)
                peak = max(peak, held)
                assert stream.num_buffered <= 1
            assert peak <= 4 * 150  # bounded by the current output, never steps x tokens
            (final,) = await stream.__anext__()
            assert final.finished and [len(c.token_ids) for c in final.outputs] == [150] * 4
            assert stream.finished
            await settle(ae)
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())


def test_a_stream_whose_reader_stalls_is_aborted_and_freed(engine):
    async def main() -> None:
        ae = AsyncEngine(engine, stall_timeout=0.3)
        ae.start()
        try:
            reader = ae.open_stream()  # read steadily: never stalls, however long it runs
            await ae.add(reader, ["steady"], adder("steady", [3, 4, 5], GREEDY))
            stalled = ae.open_stream()
            await ae.add(stalled, ["stuck"], adder("stuck", list(range(3, 40)), LONG))
            assert (await collect(reader))["steady"].outputs[0].finish_reason == "length"
            assert not reader.stalled
            stats = await settle(ae)  # waits until "stuck" is gone: the stall aborted it
            assert stats["kv_blocks_used"] == 0 and stalled.stalled
            outs = await asyncio.wait_for(stalled.__anext__(), 5)  # what it held when aborted
            assert len(outs) == 1 and not outs[0].finished
            assert len(outs[0].outputs[0].token_ids) < LONG.max_tokens
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())
