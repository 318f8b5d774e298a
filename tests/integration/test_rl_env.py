"""corral.rl against a real server, driven by the released gymnasium package (issue 20)."""

from __future__ import annotations

import pickle
import uuid

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_space_limit

import corral
from corral.embedded import EmbeddedServer
from corral.rl import ENV_ID, EPISODE_LABEL, AsyncSandboxEnv, SandboxEnv, TaskSpec

TASK = TaskSpec(
    image="busybox",
    setup=("mkdir -p /work && echo 0 > /work/count",),
    prompt="Make /work/answer contain 42, then submit.\n",
    reward_cmd='test "$(cat /work/answer 2>/dev/null)" = 42 && echo 1.0 || echo 0.0',
    max_steps=5,
    memory_mb=64,
    labels={"test": "rl-env"},
)


def test_gymnasium_make_and_its_checkers(server: EmbeddedServer) -> None:
    """gymnasium.make wraps it in the passive checker (spaces and return types at every call). check_env's
    determinism checks cannot hold: each episode is a new sandbox with its own id, so only its others run."""
    env = gymnasium.make(ENV_ID, task=TASK, url=server.url, api_key=server.api_key)
    try:
        observation, _ = env.reset(seed=3)
        assert env.observation_space.contains(observation)
        observation, *_ = env.step("echo checked")
        assert observation["stdout"] == "checked\n"
        check_space_limit(env.observation_space, "observation")
        check_space_limit(env.action_space, "action")
    finally:
        env.close()


def test_an_episode_scores_and_ends(server: EmbeddedServer, client: corral.Client) -> None:
    env = SandboxEnv(TASK, server.url, server.api_key)
    try:
        observation, info = env.reset(seed=1)
        assert observation["stdout"].startswith("Make /work/answer contain 42")
        assert env.observation_space.contains(observation)
        observation, reward, terminated, truncated, info = env.step("echo 41 > /work/answer; cat /work/answer")
        assert (observation["stdout"], int(observation["exit_code"]), reward) == ("41\n", 0, 0.0)
        assert not terminated and not truncated
        assert env.step("submit")[1:3] == (0.0, True)  # wrong answer: reward 0, episode over

        env.reset(seed=2)
        env.step("echo 42 > /work/answer")
        _, reward, terminated, _, info = env.step("submit")
        assert (reward, terminated) == (1.0, True)
        sandbox_id = info["sandbox_id"]
        assert client.get(sandbox_id).info.labels[EPISODE_LABEL] == info["episode_id"]
    finally:
        env.close()
    assert client.get(sandbox_id).info.state == corral.SandboxState.ENDED


def test_steps_past_the_limit_truncate(server: EmbeddedServer) -> None:
    env = SandboxEnv(TASK, server.url, server.api_key)
    try:
        env.reset()
        outcomes = [env.step("true")[3] for _ in range(TASK.max_steps)]
        assert outcomes == [False] * (TASK.max_steps - 1) + [True]
    finally:
        env.close()


def test_a_preempted_trainer_resumes_its_episode_from_the_log(server: EmbeddedServer) -> None:
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    counter = "n=$(($(cat /work/count) + 1)); echo $n > /work/count; echo $n"  # not idempotent
    first = SandboxEnv(TASK, server.url, server.api_key)
    first.reset(options={"episode_id": episode})
    assert [first.step(counter)[0]["stdout"] for _ in range(2)] == ["1\n", "2\n"]
    sandbox_id = first._episode.sandbox_id  # noqa: SLF001 - the trainer dies without closing: no kill
    revived = pickle.loads(pickle.dumps(first))  # what a restarted worker has: the task and the episode id
    second = SandboxEnv(TASK, server.url, server.api_key)
    try:
        second.reset(options={"episode_id": episode})  # finds the sandbox by its episode label
        replayed = [second.step(counter) for _ in range(3)]
        assert [r[0]["stdout"] for r in replayed] == ["1\n", "2\n", "3\n"]  # the first two from the log
        assert [r[4]["replayed"] for r in replayed] == [True, True, False]
        assert replayed[0][4]["sandbox_id"] == sandbox_id
        assert revived.sandbox.id == sandbox_id
    finally:
        second.close()


@pytest.mark.parametrize("vector", ["sync", "async"])
def test_gymnasiums_vector_envs_run_sandboxes_side_by_side(server: EmbeddedServer, vector: str) -> None:
    """AsyncVectorEnv pickles each env into a worker process: the env travels as task and settings."""
    url, key = server.url, server.api_key
    make = [lambda: SandboxEnv(TASK, url, key) for _ in range(3)]
    envs = gymnasium.vector.SyncVectorEnv(make) if vector == "sync" else gymnasium.vector.AsyncVectorEnv(make)
    try:
        observations, infos = envs.reset(seed=7)
        assert len(set(infos["sandbox_id"])) == 3
        observations, rewards, terminated, _, _ = envs.step(("echo 42 > /work/answer", "echo 7 > /work/answer", "true"))
        observations, rewards, terminated, _, _ = envs.step(("submit",) * 3)
        assert list(rewards) == [1.0, 0.0, 0.0] and list(terminated) == [True, True, True]
    finally:
        envs.close()


async def test_the_async_env(server: EmbeddedServer) -> None:
    env = AsyncSandboxEnv(TASK, server.url, server.api_key)
    try:
        observation, info = await env.reset()
        assert "Make /work/answer" in observation["stdout"]
        await env.step("echo 42 > /work/answer")
        _, reward, terminated, _, _ = await env.step("submit")
        assert (reward, terminated) == (1.0, True)
    finally:
        await env.close()


def test_episodes_can_start_as_forks_of_a_prepared_sandbox(server: EmbeddedServer, client: corral.Client) -> None:
    with client.create("busybox", memory_mb=64) as prepared:
        prepared.exec("mkdir -p /work && echo prepared-state > /work/given")
        env = SandboxEnv(TaskSpec(fork_from=prepared.id, memory_mb=64), server.url, server.api_key)
        try:
            _, info = env.reset()
            assert info["sandbox_id"] != prepared.id
            assert env.step("cat /work/given")[0]["stdout"] == "prepared-state\n"
        finally:
            env.close()
