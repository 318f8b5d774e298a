"""Steps without a client id: written in batches after their answers, off the request path, on simulated nodes.

The loop's clock is frozen while the execs run, so the flush delay's timer cannot fire: what reaches the log
then was written because the batch filled up, not because time passed."""

from __future__ import annotations

import asyncio
from pathlib import Path

from corral.api.models import CreateSandboxRequest, ExecRequest
from corral.bench import control_plane
from corral.gateway import operations as operations_module
from corral.gateway.images import ImageService
from corral.gateway.operations import Operations
from corral.images.builders import LayerBuilder
from corral.state.db import StateStore
from corral.trajectory import TrajectoryLog


class _FrozenClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock stops while ``frozen``: timers (call_later) wait, ready callbacks run."""

    frozen_at: float | None = None

    def time(self) -> float:
        return self.frozen_at if self.frozen_at is not None else super().time()


def _run(tmp_path: Path, execs: int, *, streamed: bool = False) -> tuple[int, int]:
    """Steps in the log right after ``execs`` execs (``streamed``: exec streams, read to their exit) with the clock
    frozen, and after the delay has passed."""
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    loop = _FrozenClockLoop()

    async def main() -> tuple[int, int]:
        async with control_plane.simulated_cluster(1, store, tmp_path / "layers") as service:
            log = TrajectoryLog(store.engine)
            images = ImageService(
                service._catalogue, LayerBuilder(service._catalogue, tmp_path / "build", 1 << 20), service
            )  # noqa: SLF001
            ops = Operations(log, service, images, max_logged_file_bytes=0)
            info = await service.create(CreateSandboxRequest(image=control_plane.IMAGE, cpu=0.25, memory_mb=256))
            loop.frozen_at = loop.time()
            for _ in range(execs):
                if streamed:
                    assert [event.type async for event in ops.exec_stream(info.id, ExecRequest(cmd=["true"]))][
                        -1
                    ] == "exit"
                else:
                    await ops.exec(info.id, ExecRequest(cmd=["true"]))
            await asyncio.sleep(0)  # what was scheduled to run at once runs
            at_once = len(log.steps(info.id))
            loop.frozen_at = None
            await asyncio.sleep(2 * operations_module._FLUSH_DELAY_S)  # noqa: SLF001
            return at_once, len(log.steps(info.id))

    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()
        store.close()


def test_a_few_steps_wait_for_the_delay_then_are_all_written(tmp_path: Path) -> None:
    assert _run(tmp_path, 3) == (0, 3)


def test_a_full_batch_is_written_without_waiting_for_the_delay(tmp_path: Path) -> None:
    batch = operations_module._FLUSH_AT  # noqa: SLF001
    # The flush is queued to run at once when the batch fills; the simulated execs never wait, so it runs at the
    # first pause, after the two more: all of them are in the log before the clock moved.
    assert _run(tmp_path, batch + 2) == (batch + 2, batch + 2)


def test_a_streamed_command_is_logged_with_the_others_after_its_exit(tmp_path: Path) -> None:
    """Not in a transaction of its own before the exit goes out (the E2B facade's commands.run is one)."""
    assert _run(tmp_path, 3, streamed=True) == (0, 3)
