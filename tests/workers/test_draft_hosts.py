"""Mirror-SD across workers (thread actors, see ``rollout_cases.py``): the worker that finishes first
drafts the mirror branches of the one still decoding the long tail, the pair ends with the rollout,
and no token changes."""

import functools

from rollout_cases import EOS, kinds, long_tail_batch, policy

from tailspec.rollout import RolloutConfig, RolloutEngine
from tailspec.testing import perturbed_copy
from tailspec.workers import RolloutCoordinator, WorkersConfig

MIRROR = RolloutConfig(strategy="mirror:chain:3,k=1", mirror={"executor": "inline"}, kv_cache_tokens=8192)


@functools.cache
def drafter_lm():
    return perturbed_copy(policy(), noise=0.2, seed=4)


def _coordinator(config: RolloutConfig, **overrides) -> RolloutCoordinator:
    workers = WorkersConfig(
        num_workers=2, backend="threads", schedule="static", spot_training=False, draft_hosts=True, **overrides
    )
    return RolloutCoordinator(policy(), config, [EOS], drafter=drafter_lm(), config=workers)


def test_an_idle_worker_drafts_for_the_busy_one_and_no_token_changes():
    prompts, params = long_tail_batch()
    want = [o.completion_ids for o in RolloutEngine(policy(), RolloutConfig()).generate(prompts, params)]
    coord = _coordinator(MIRROR)
    for _ in range(2):  # a second rollout pairs afresh (a new pairing: the host builds a new drafter)
        report = coord.generate(prompts, params)
        assert [o.completion_ids for o in report.outputs] == want
    paired, ended = kinds(coord.events, "draft_host"), kinds(coord.events, "draft_host_end")
    assert len(paired) == 2 and len(ended) == 2
    assert paired[0].detail["pairing"] < paired[1].detail["pairing"]
    host, busy = paired[0].worker, paired[0].detail["for_worker"]
    assert host != busy
    assert coord.actors.get(coord.actors.call(coord.workers[host], "hosted_commands")) > 0  # it drafted for the other
    worker_events = coord.worker_events()
    assert [e.kind for e in worker_events[busy] if e.kind == "draft_host"] == ["draft_host"] * 4  # on, off, on, off
    coord.shutdown()


def test_no_pair_is_made_for_an_engine_without_mirror_steps():
    prompts, params = long_tail_batch()
    coord = _coordinator(RolloutConfig(strategy="chain:3", kv_cache_tokens=8192))
    coord.generate(prompts, params)
    assert not kinds(coord.events, "draft_host")
    coord.shutdown()
