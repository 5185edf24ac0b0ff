"""The server's engine worker: one job at a time, cancellation, errors (no HTTP here)."""

from __future__ import annotations

import asyncio

from blend.server.worker import EngineWorker, Finished, Job


async def _finished(job: Job) -> Finished:
    while True:
        event = await job.events.get()
        if isinstance(event, Finished):
            return event


def test_a_job_that_raises_once_stopped_is_cancelled_and_an_error_is_an_error():
    async def main() -> tuple[Finished, Finished]:
        worker = EngineWorker(4)

        def stops_early(job: Job) -> None:
            job.cancel()  # as a client disconnect or the deadline would, mid-job
            raise RuntimeError("stopped between two documents")

        def fails(_job: Job) -> None:
            raise ValueError("bad input")

        first, second = worker.submit(stops_early), worker.submit(fails)
        results = await _finished(first), await _finished(second)
        worker.stop(timeout=10)
        return results

    stopped, failed = asyncio.run(main())
    assert stopped.cancelled and stopped.error is None
    assert not failed.cancelled and isinstance(failed.error, ValueError)
