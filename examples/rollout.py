"""A rollout worker that survives preemption: reconnect by job token, fast-forward from the log.

Each episode has a sandbox (labelled job=<job>, episode=<n>) and runs a fixed
list of steps, each a non-idempotent command (it appends to a file), sent
with a step id. Kill this process at any point and run it again: it finds
its sandboxes through the job token, sends every step again, and Corral
answers the ones that already ran from the trajectory log instead of running
them twice. Only the steps that never ran are executed.

    CORRAL_URL=... CORRAL_API_KEY=<job token> python examples/rollout.py --job j1
    (--crash-after N kills the process after N steps, to try it out)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

import corral


def step_command(episode: int, step: int) -> str:
    # Appending is not idempotent: running a step twice would show as a duplicate line.
    return f"echo 'episode {episode} step {step}' >> /work/log && wc -l < /work/log"


async def sandbox_for(client: corral.AsyncClient, job: str, episode: int) -> corral.AsyncSandbox:
    """The episode's sandbox: the existing one after a restart, else a new one."""
    found = await client.list(labels={"job": job, "episode": str(episode)})
    if found:
        return await client.get(found[0].id)
    sandbox = await client.create("busybox", labels={"job": job, "episode": str(episode)}, ttl_s=3600)
    await sandbox.exec("mkdir -p /work && : > /work/log", step_id=f"ep{episode}-setup")
    return sandbox


async def run(job: str, episodes: int, steps: int, crash_after: int | None) -> dict[str, int]:
    counts = {"ran": 0, "replayed": 0}
    async with corral.AsyncClient() as client:

        async def episode(index: int) -> None:
            sandbox = await sandbox_for(client, job, index)
            for step in range(steps):
                result = await sandbox.exec(step_command(index, step), step_id=f"ep{index}-step{step}")
                if result.exit_code != 0:
                    raise RuntimeError(f"episode {index} step {step} failed: {result.stderr}")
                counts["replayed" if result.replayed else "ran"] += 1
                if crash_after is not None and counts["ran"] >= crash_after:
                    os.kill(os.getpid(), signal.SIGKILL)  # preemption: no cleanup, no goodbye

        await asyncio.gather(*(episode(i) for i in range(episodes)))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job", required=True)
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--crash-after", type=int, default=None, help="SIGKILL this process after N executed steps")
    args = parser.parse_args()
    counts = asyncio.run(run(args.job, args.episodes, args.steps, args.crash_after))
    print(f"ran {counts['ran']} steps, answered {counts['replayed']} from the trajectory log")


if __name__ == "__main__":
    main()
