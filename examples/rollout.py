"""A rollout worker that survives preemption: gymnasium-style episodes (corral.rl) replayed from the log.

Each episode is a ``corral.rl.AsyncSandboxEnv`` with a fixed episode id (<job>-ep<n>) and runs a fixed list
of steps, each a non-idempotent command (it appends to a file); ``submit`` scores the episode 1.0 when the
file holds every step exactly once, in order. Kill this process at any point and run it again: each env
resets with its episode id, finds its sandbox again, and sends every step again with the same step id;
Corral answers the ones that already ran from the trajectory log instead of running them twice, so only
the steps that never ran are executed and every episode still scores 1.0.

    CORRAL_URL=... CORRAL_API_KEY=<job token> python examples/rollout.py --job j1
    (--crash-after N kills the process after N executed steps, to try it out)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

from corral.rl import AsyncSandboxEnv, TaskSpec


def step_command(episode: int, step: int) -> str:
    # Appending is not idempotent: running a step twice would show as a duplicate line.
    return f"echo 'episode {episode} step {step}' >> /work/log && wc -l < /work/log"


def task_for(job: str, episode: int, steps: int) -> TaskSpec:
    expected = "".join(f"episode {episode} step {k}\\n" for k in range(steps))
    return TaskSpec(
        image="busybox",
        setup=("mkdir -p /work && : > /work/log",),  # step-id logged too: a restart does not empty the log
        reward_cmd=f"printf '{expected}' | cmp -s - /work/log && echo 1.0 || echo 0.0",
        max_steps=steps + 1,
        memory_mb=64,
        labels={"job": job, "episode": str(episode)},
    )


async def run(job: str, episodes: int, steps: int, crash_after: int | None) -> tuple[dict[str, int], list[float]]:
    """Steps run and replayed, and each episode's reward."""
    counts = {"ran": 0, "replayed": 0}
    rewards = [0.0] * episodes

    async def episode(index: int) -> None:
        env = AsyncSandboxEnv(task_for(job, index, steps))
        await env.reset(options={"episode_id": f"{job}-ep{index}"})  # the same sandbox after a restart
        for step in range(steps):
            observation, _, _, _, info = await env.step(step_command(index, step))
            if observation["exit_code"] != 0:
                raise RuntimeError(f"episode {index} step {step} failed: {observation['stderr']}")
            counts["replayed" if info["replayed"] else "ran"] += 1
            if crash_after is not None and counts["ran"] >= crash_after:
                os.kill(os.getpid(), signal.SIGKILL)  # preemption: no cleanup, no goodbye
        _, rewards[index], _, _, _ = await env.step("submit")  # the episode ends (terminated)
        await env.close()  # the episode is over: its sandbox is killed

    await asyncio.gather(*(episode(i) for i in range(episodes)))
    return counts, rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job", required=True)
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--crash-after", type=int, default=None, help="SIGKILL this process after N executed steps")
    args = parser.parse_args()
    counts, rewards = asyncio.run(run(args.job, args.episodes, args.steps, args.crash_after))
    print(f"ran {counts['ran']} steps, answered {counts['replayed']} from the trajectory log")
    for episode, reward in enumerate(rewards):
        print(f"episode {episode} reward {reward}")


if __name__ == "__main__":
    main()
